"""The concatenation-order check (seeds msg 4513) when the config lists the ids out of layer order: the Kimi case's
ids [1, 3, -1] on the DeepSeek rule of SGLang 0.5.23 become layers_to_capture [2, 4, 0], captured in the layer loop as
[embedding, out(1), out(3)]. The served chunks sit where the engine's plan puts them, so the check refutes a
reordering and says why the config's order differs (the plan comes from the real rules, the measured chunks are
what the live replay identified)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from helpers.diagnosis.conventions import served_plan
from helpers.formats.configs import read_draft_config, read_target_config
from helpers.investigation.checks import run_check
from helpers.investigation.inputs import Investigation
from support import ROOT

KIMI = ROOT / "env" / "models" / "kimi"
pytestmark = pytest.mark.skipif(not (KIMI / "draft" / "config.json").exists(),
                                reason="the Kimi-class models (env/models/kimi) are not built")


def _inv(tmp_path, ids, measured):
    cfg = json.loads((KIMI / "draft" / "config.json").read_text())
    cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": ids}
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(cfg))
    plan = served_plan(read_draft_config(draft), read_target_config(KIMI / "target"), version="0.5.23")
    trained = SimpleNamespace(tensors=["out(1)", "out(3)", "out(4)"])
    chunks = [{"index": i, "width": 64, "identified_as": m, "matched_training_chunk": None, "rel_diff": None,
               "cosine": None} for i, m in enumerate(measured)]
    inv = Investigation(tmp_path / "run", None, training=KIMI / "data" / "sample", draft_dir=draft,
                        target_dir=KIMI / "target")
    inv._diagnoses[True] = SimpleNamespace(served_plan=plan, training_plan=trained, chunks=chunks, findings=[])
    return inv, plan


def test_ids_out_of_layer_order_are_explained_by_the_engine(tmp_path):
    inv, plan = _inv(tmp_path, [1, 3, -1], ["embedding", "out(1)", "out(3)"])
    assert plan.tensors == ["embedding", "out(1)", "out(3)"]
    assert list(plan.engine_ids.ids) == [2, 4, 0]
    order = [n for n in plan.notes if "is not ascending" in n]
    assert len(order) == 1 and "ascending layer order [0, 2, 4]" in order[0]
    assert order[0].endswith("deepseek_v2.py::DeepseekV2Model.forward (the captures fill an AuxHiddenStatePacker in "
                             "loop order)")
    res = run_check("concat_order", inv)
    assert res.verdict == "refuted", res.explanation
    assert res.explanation.startswith("The order is the one SGLang's rules predict")
    assert "specforge=[1, 3, -1] (SGLang's layers_to_capture [2, 4, 0])" in res.explanation
    assert list(res.evidence["position configured for this tensor"]) == [0, 1, 2]


def test_ids_in_layer_order_keep_the_plain_sentence(tmp_path):
    inv, plan = _inv(tmp_path, [1, 3, 4], ["out(1)", "out(3)", "out(4)"])
    assert list(plan.engine_ids.ids) == [2, 4, 5]
    res = run_check("concat_order", inv)
    assert res.verdict == "refuted", res.explanation
    assert res.explanation.startswith("The order is as configured")
    assert "which here is the configured order" in res.explanation


def test_a_swapped_chunk_is_confirmed(tmp_path):
    inv, _ = _inv(tmp_path, [1, 3, 4], ["out(3)", "out(1)", "out(4)"])
    res = run_check("concat_order", inv)
    assert res.verdict == "confirmed", res.explanation
    assert res.data["short"] == "chunk 0 holds out(3), configured at position 1"
