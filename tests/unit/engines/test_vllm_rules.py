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
    assert rep.inputs["vllm version"] == "0.32.0 (from the server)"
    # the same pair under SGLang's rules (the default) is served as trained
    assert static_check(H64 / "draft", H64 / "target", training=H64 / "data" / "sample").verdict == "ok"
