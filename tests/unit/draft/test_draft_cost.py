"""The settings stage's draft-step cost (helpers.draft.budget.draft_cost): the ratio of the parameters the draft
multiplies by to the target's, from the safetensors headers. How the checkpoint is stored must not change it: a
float32 copy of the bf16 reference draft (served in one dtype all the same) and a stray weight file beside it gave
twice and more the cost when it was read from the bytes on disk."""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers.draft.budget import draft_cost
from helpers.errors import BadInput
from support import ROOT

DRAFT, TARGET = ROOT / "env" / "models" / "draft", ROOT / "env" / "models" / "target"


def _copy(tmp_path, name="draft"):
    d = tmp_path / name
    shutil.copytree(DRAFT, d)
    return d


def test_the_reference_pair_counts_the_draft_layer_fc_and_lm_head_against_the_whole_target():
    cost, src = draft_cost(DRAFT, TARGET)
    draft = {k: v for k, v in load_file(str(DRAFT / "model.safetensors")).items()
             if v.is_floating_point() and "embed_tokens" not in k}
    target = {k: v for k, v in load_file(str(TARGET / "model.safetensors")).items() if v.is_floating_point()}
    assert cost == pytest.approx(sum(v.numel() for v in draft.values()) / sum(v.numel() for v in target.values()))
    assert "parameters" in src and 0.2 < cost < 0.3


def test_a_float32_copy_and_a_stray_file_give_the_same_cost(tmp_path):
    base, _ = draft_cost(DRAFT, TARGET)
    d = _copy(tmp_path)
    w = load_file(str(d / "model.safetensors"))
    save_file({k: (v.float() if v.is_floating_point() else v) for k, v in w.items()}, str(d / "model.safetensors"))
    save_file({"optimizer.exp_avg": torch.zeros(4096, 128)}, str(d / "training_state.safetensors"))
    assert (d / "model.safetensors").stat().st_size > 1.9 * (DRAFT / "model.safetensors").stat().st_size
    cost, _ = draft_cost(d, TARGET)
    assert cost == pytest.approx(base, rel=1e-12)


def test_an_embedding_in_the_draft_checkpoint_is_a_lookup_not_a_read(tmp_path):
    base, _ = draft_cost(DRAFT, TARGET)
    d = _copy(tmp_path)
    w = load_file(str(d / "model.safetensors"))
    w["model.embed_tokens.weight"] = torch.zeros(4096, 128, dtype=torch.bfloat16)
    save_file(w, str(d / "model.safetensors"))
    assert draft_cost(d, TARGET)[0] == pytest.approx(base, rel=1e-12)


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    d = _copy(tmp_path)
    (d / "broken.safetensors").write_bytes(b"not a header")
    with pytest.raises(BadInput, match="broken.safetensors"):
        draft_cost(d, TARGET)
