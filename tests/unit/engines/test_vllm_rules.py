"""vLLM 0.32.0's id rules behind the engine seam (helpers.engines.vllm.VLLMRules): the served plan from a real draft
config file, where a proposed fix writes the ids (and that the written file, read again, is served as the training
plan), and the static check on the head_dim-64 reference pair: the SpecForge-trained draft (ids [1, 3, 4], out(i))
is fed out(0), out(2), out(3) by vLLM, one layer short, which SGLang does not do."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers.diagnosis.static import static_check
from helpers.engines.vllm import VLLMRules, draft_view
from helpers.formats.configs import read_draft_config, read_target_config
from helpers.investigation.propose import draft_variant, ids_for_plan
from helpers.layers import vllm as layer_rules

ROOT = Path(__file__).resolve().parents[3]
H64 = ROOT / "env" / "models" / "llama_h64"
RULES = VLLMRules("0.32.0")


def _draft(tmp_path: Path, **cfg) -> Path:
    """A copy of the h64 draft folder whose config.json is the reference config with ``cfg`` applied (None drops)."""
    d = tmp_path / "draft"
    shutil.copytree(H64 / "draft", d)
    raw = json.loads((d / "config.json").read_text())
    for k, v in cfg.items():
        if v is None:
            raw.pop(k, None)
        else:
            raw[k] = v
    (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.fixture(scope="module")
def target():
    return read_target_config(H64 / "target")


@pytest.mark.parametrize("cfg, tensors, source", [
    ({}, ["out(0)", "out(2)", "out(3)"], "eagle_config"),                                     # the reference: verbatim
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}, ["out(1)", "out(3)", "out(4)"], "draft config eagle_aux"),
    ({"eagle_config": {"use_aux_hidden_state": True}}, ["out(1)", "out(3)", "out(4)"], "default"),   # fallback
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 4, 8]}}, ["embedding", "out(3)", "out(7)"], "eagle"),
])
def test_served_plan_is_vllms_rule_on_the_real_config(tmp_path, target, cfg, tensors, source):
    d = read_draft_config(_draft(tmp_path, **cfg))
    plan = RULES.served_plan(d, target)
    assert plan.tensors == tensors and source in plan.source and plan.fatal is None
    # the same ids as the plain rule function on the JSON file itself (one implementation of the rule)
    ids, _ = layer_rules.aux_layer_ids(json.loads(d.path.read_text()), target.num_hidden_layers)
    assert list(plan.engine_ids.ids) == list(ids)
    assert any("gpu_model_runner.py::GPUModelRunner._get_eagle3_aux_layers_from_config" in r for r in plan.rules)


def test_fallback_and_an_unreachable_id_are_said(tmp_path, target):
    plan = RULES.served_plan(read_draft_config(_draft(tmp_path, eagle_config={"use_aux_hidden_state": True})), target)
    assert any("falls back" in n and "get_eagle3_default_aux_hidden_state_layers" in n for n in plan.notes)
    bad = RULES.served_plan(read_draft_config(_draft(tmp_path / "b", eagle_config={
        "eagle_aux_hidden_state_layer_ids": [2, 4, 9]})), target)
    assert bad.tensors == ["out(1)", "out(3)"] and [p["kind"] for p in bad.problems] == ["missing_chunk"]
    assert "fc takes 3 chunks" in bad.fatal


@pytest.mark.parametrize("cfg, key", [({}, "nested"), ({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, "top")])
def test_proposed_ids_are_written_where_vllm_reads_them(tmp_path, target, cfg, key):
    d = read_draft_config(_draft(tmp_path, **cfg))
    wanted = ["out(1)", "out(3)", "out(4)"]
    ids, plan, _ = ids_for_plan(wanted, d, target, rules=RULES)
    assert ids == [2, 4, 5] and plan.tensors == wanted
    over, text = RULES.ids_override(d, ids, ["layer_offset"])
    assert ("eagle_config" in over) == (key == "nested") and "in(i)" in text
    fixed = draft_variant(d.path.parent, over, tmp_path / "fixed")
    assert RULES.served_plan(read_draft_config(fixed), target).tensors == wanted   # the written file, read again


def test_draft_view_keeps_vllms_precedence(tmp_path):
    # an empty eagle_config stays falsy (dflash ids then apply), a nested key removed stays removed
    d = read_draft_config(_draft(tmp_path, eagle_config={}, dflash_config={"target_layer_ids": [0, 3]}))
    assert layer_rules.aux_layer_ids(draft_view(d), 8)[0] == (1, 4)


def test_static_check_on_the_reference_pair_names_the_offset_with_vllms_rule(target):
    rep = static_check(H64 / "draft", H64 / "target", training=H64 / "data" / "sample", rules=RULES)
    offs = [f for f in rep.findings if f["kind"] == "layer_offset"]
    assert [f["chunk"] for f in offs] == [0, 1, 2] and all(f["evidence"]["offset"] == -1 for f in offs)
    assert rep.training_plan.provenance == "manifest" and rep.served_plan.tensors == ["out(0)", "out(2)", "out(3)"]
    assert rep.inputs["vllm version"] == "0.32.0 (the release whose rules are read)"
    # the same pair under SGLang's rules (the default) is served as trained
    assert static_check(H64 / "draft", H64 / "target", training=H64 / "data" / "sample").verdict == "ok"


# ------------------------------------------------------------------------------------------------ the loader

def _weights(tmp_path: Path, edit) -> Path:
    """A copy of the h64 draft folder whose weights are ``edit(dict)``."""
    from safetensors.torch import load_file, save_file
    d = _draft(tmp_path)
    w = load_file(str(d / "model.safetensors"))
    save_file(edit(w), str(d / "model.safetensors"))
    return d


def _target_embed():
    from safetensors.torch import load_file
    return load_file(str(H64 / "target" / "model.safetensors"))["model.embed_tokens.weight"]


def _checks(draft: Path):
    from helpers.draft.checks import inspect_draft
    from helpers.engines.vllm_rules import VLLMLoaderRules
    return inspect_draft(draft, H64 / "target", H64 / "data" / "sample", loader=VLLMLoaderRules("0.32.0"))


def test_vllm_loader_on_the_reference_draft_finds_nothing_and_says_what_it_shares():
    rep = _checks(H64 / "draft")
    assert rep["findings"] == []
    assert rep["facts"]["embedding"]["source"] == "target" and rep["facts"]["lm_head"]["source"] == "draft"
    assert rep["facts"]["d2t"]["rule"] == "checkpoint"
    assert "_maybe_share_embeddings" in rep["facts"]["embedding"]["rule"]


def test_an_own_embedding_unlike_the_targets_is_kept_by_vllm_and_named(tmp_path):
    emb = _target_embed()
    d = _weights(tmp_path, lambda w: {**w, "embed_tokens.weight": (emb + 0.05 * emb.std()).to(emb.dtype)})
    f = {x["kind"]: x for x in _checks(d)["findings"]}["embedding_not_shared"]
    assert f["evidence"]["tensors_to_drop"] == ["embed_tokens.weight"] and 0 < f["evidence"]["rel_diff"] < 1
    # the target's own embedding copied in is shared (torch.equal): no finding
    same = _weights(tmp_path / "same", lambda w: {**w, "embed_tokens.weight": emb.clone()})
    assert not [x for x in _checks(same)["findings"] if x["kind"] == "embedding_not_shared"]


def test_a_missing_lm_head_is_the_targets_on_vllm_and_fails_with_a_pruned_vocab(tmp_path):
    d = _weights(tmp_path, lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"})
    f = {x["kind"]: x for x in _checks(d)["findings"]}["lm_head_missing"]
    assert f["evidence"]["fatal"] is True and "compute_logits" in f["detail"] and "_maybe_share_lm_head" in \
        f["evidence"]["source"]


def test_a_missing_or_shuffled_d2t_follows_vllms_rule(tmp_path):
    import torch
    d = _weights(tmp_path, lambda w: {k: v for k, v in w.items() if k != "d2t"})
    kinds = [x["kind"] for x in _checks(d)["findings"]]
    assert "vocab_map_missing" in kinds
    d2 = _weights(tmp_path / "perm", lambda w: {**w, "d2t": (w["d2t"] + torch.arange(2048))[torch.randperm(
        2048, generator=torch.Generator().manual_seed(0))] - torch.arange(2048)})
    f = {x["kind"]: x for x in _checks(d2)["findings"]}["vocab_map_differs"]
    assert "llama_eagle3.py::Eagle3LlamaForCausalLM" in f["evidence"]["source"]


def test_sglangs_adapter_reports_the_ids_its_rules_give_for_the_same_draft():
    """The other side of the seam: SGLangAdapter.spec_config gives SGLang's capture indices (+1) for the same config
    vLLM reads verbatim: [2, 4, 5] = out(1), out(3), out(4)."""
    import httpx

    from helpers.engines.sglang import SGLangAdapter
    from helpers.server.client import SGLangClient

    info = {"version": "0.5.23", "tp_size": 1, "model_path": str(H64 / "target"),
            "speculative_draft_model_path": str(H64 / "draft"), "speculative_algorithm": "EAGLE3",
            "speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}

    def handler(req):
        return httpx.Response(200, json=info if "server_info" in req.url.path else
                              {"architectures": ["LlamaForCausalLM"]})

    c = SGLangClient("http://sglang.test:30000", transport=httpx.MockTransport(handler), retries=0)
    cfg = SGLangAdapter().spec_config(c)
    assert (cfg.aux_layer_ids, cfg.aux_layer_convention) == ([2, 4, 5], "sglang_capture")
    assert cfg.aux_tensors == ["out(1)", "out(3)", "out(4)"] and cfg.num_speculative_tokens == 3
    assert RULES.served_plan(read_draft_config(H64 / "draft"), read_target_config(H64 / "target")).tensors == \
        ["out(0)", "out(2)", "out(3)"]                          # vLLM: the same config, one layer short
