"""The vLLM-specific fault generator (``support.vllm_faultgen``) and what the server-free tools name of its draws,
on the real head_dim-64 pair: draws are seeded, each class in turn, strengths in their ranges; the draft "as trained"
with ``norm_before_fc`` or linear rope scaling computes what the reference draft computes (the construction holds);
vLLM's loader rules name a kept ``input_norm.weight`` without its flag (vLLM drops it without a word) and nothing on a
clean conversion; the lost ids fall back to vLLM's default in the served plan. The live checks:
tests/server/test_vllm_gen_faults.py (extended); the hit table over 20 seeds: bench/bench_vllm_faults.py."""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from helpers.draft.checks import inspect_draft
from helpers.engines.vllm import VLLMAdapter
from support.vllm_faultgen import (CLASSES, DRAFT, TARGET, TRAINING, VLLMFault, aux_states, draw, draws,
                                   rope_factor)

RULES = VLLMAdapter().loader_rules("0.32.0")


def test_draws_are_seeded_cover_every_class_and_keep_their_ranges():
    a, b = draws(10, seed=3), draws(10, seed=3)
    assert [f.to_json() for f in a] == [f.to_json() for f in b]
    assert sorted({f.cls for f in a}) == sorted(CLASSES)
    for s in range(40):
        f = draw(s, "own_embedding")
        assert 0.03 <= f.params["strength"] <= 3.0
        n = draw(s, "norm_before_fc_dropped").params
        assert 0.1 <= n["level"] <= 10.0 and 0 <= n["spread"] <= 0.5
        k = draw(s, "rope_scaling_dropped").params["k"]
        assert 1 <= k <= 4
        ids = draw(s, "ids_lost").params["trained_out"]
        assert len(set(ids)) == 3 and all(0 <= i <= 6 for i in ids) and tuple(ids) != (1, 3, 4)
    with pytest.raises(ValueError, match="unknown vLLM fault class"):
        draw(0, "hook")


def test_the_norm_before_fc_draft_as_trained_reproduces_the_reference_fc_and_vllm_drops_a_kept_weight(tmp_path):
    f = VLLMFault(5, "norm_before_fc_dropped", {"level": 2.0, "spread": 0.3, "keep_weight": True})
    b = f.build(tmp_path / "d")
    ref, tr = load_file(str(DRAFT / "model.safetensors")), load_file(str(b.trained / "model.safetensors"))
    x = aux_states()[:400]
    rms = x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt()
    want = x @ ref["fc.weight"].float().T
    with_norm = (x / rms * tr["input_norm.weight"].float()) @ tr["fc.weight"].float().T
    without = x @ tr["fc.weight"].float().T                       # the flag dropped: fc on the raw aux states
    err = lambda y: float((y - want).norm() / want.norm())         # noqa: E731
    assert err(with_norm) < 0.15 and err(without) > 3 * err(with_norm), (err(with_norm), err(without))
    assert json.loads((b.trained / "config.json").read_text())["eagle_config"]["norm_before_fc"] is True
    served_cfg = json.loads((b.served / "config.json").read_text())
    assert "norm_before_fc" not in served_cfg and served_cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    kinds = {x["kind"]: x for x in inspect_draft(b.served, TARGET, TRAINING, loader=RULES)["findings"]}
    assert kinds["draft_weight_ignored"]["evidence"]["tensors"] == ["input_norm.weight"], kinds
    assert "load_weights" in kinds["draft_weight_ignored"]["evidence"]["source"]
    # the draft as trained (flag set) is loaded with its input_norm: nothing ignored
    assert "draft_weight_ignored" not in {x["kind"] for x in inspect_draft(b.trained, TARGET, TRAINING, loader=RULES)
                                          ["findings"]}


def test_the_rope_scaled_draft_as_trained_runs_the_reference_frequencies(tmp_path):
    k = 2
    b = VLLMFault(1, "rope_scaling_dropped", {"k": k, "factor": rope_factor(k)}).build(tmp_path / "d")
    cfg = json.loads((b.trained / "config.json").read_text())
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": rope_factor(k)}
    served = json.loads((b.served / "config.json").read_text())["transformer_layer_config"]
    assert served["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "default"}   # the scaling dropped
    inv = 10000.0 ** (-torch.arange(0, 64, 2).double() / 64)
    # slot j under the scaling runs pair j + k's frequency, exactly (the moved rows were trained at it)
    assert torch.allclose(inv[:-k] / rope_factor(k), inv[k:], rtol=1e-12)
    ref, tr = load_file(str(DRAFT / "model.safetensors")), load_file(str(b.trained / "model.safetensors"))
    for name in ("midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight"):
        for h in range(2):
            r, t = ref[name][h * 64:(h + 1) * 64], tr[name][h * 64:(h + 1) * 64]
            assert torch.equal(t[:32 - k], r[k:32]) and torch.equal(t[32:64 - k], r[32 + k:64])
    assert math.isclose(rope_factor(1), 10000 ** (1 / 32))


def test_lost_ids_fall_back_to_vllms_default_and_the_embedding_is_named(tmp_path):
    from helpers.engines.vllm_rules import VLLMRules
    from helpers.formats.configs import read_draft_config, read_target_config

    from helpers.formats.speculators import convert_eagle3_to_speculators

    # the served folder of an ids_lost draw is this conversion (its build also re-captures the training data with HF
    # transformers: 20+ s, left to the live test and the bench)
    d = read_draft_config(convert_eagle3_to_speculators(DRAFT, tmp_path / "ids", TARGET, keep_layer_ids=False))
    assert d.top_level_layer_ids is None or not d.top_level_layer_ids
    plan = VLLMRules("0.32.0").served_plan(d, read_target_config(TARGET))
    assert list(plan.tensors) == ["out(1)", "out(3)", "out(4)"] and any("falls back" in n for n in plan.notes)
    e = VLLMFault(4, "own_embedding", {"strength": 0.2}).build(tmp_path / "emb")
    f = {x["kind"]: x for x in inspect_draft(e.served, TARGET, TRAINING, loader=RULES)["findings"]}
    assert 0.1 < f["embedding_not_shared"]["evidence"]["rel_diff"] < 0.4, f
    clean = VLLMFault(6, "clean").build(tmp_path / "clean")
    assert inspect_draft(clean.served, TARGET, TRAINING, loader=RULES)["findings"] == []
