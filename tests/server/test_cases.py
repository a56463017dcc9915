"""Every bundled case replays on the reference server: each hypothesis gets its expected verdict,
and the fix raises accept length beyond the faulted configuration's 95% CI (bootstrap over
requests). The seeds' hunt runs in the fast tier; the other cases are marked slow (still run in CI).
Case files validated without a server: tests/unit/investigation/test_case_validation.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.investigation.cases import load_case
from helpers.investigation.replay import replay_case
from helpers.runfiles import new_run_dir
from support import ROOT

MODELS = ROOT / "env" / "models"
needs_models = pytest.mark.skipif(not (MODELS / "draft" / "config.json").exists(),
                                  reason="reference models (env/models) not built")


def _replay(name: str, tmp_path: Path) -> dict:
    path = ROOT / "env" / "cases" / f"{name}.yaml"
    run = new_run_dir(name, tmp_path)
    doc = replay_case(path, run, progress=False).model_dump(mode="json")
    assert doc["complete"], doc
    assert (run / "results" / f"replay-{load_case(path).name}.json").exists()
    return doc


def _check_verdicts(doc: dict, path: Path) -> None:
    case = load_case(path)
    for step, rec in zip(case.timeline, doc["steps"]):
        assert not rec.get("error"), rec      # server_error is a result (a fix whose server cannot start)
        if step.kind == "investigate" and (step.expect_finding or step.expect_fix):
            assert rec["as_expected"] is True, (rec["findings"][:1], rec["proposed_fix"], rec["sentence"])
        if step.kind == "hypothesis" and step.expect:
            assert rec["verdict"] == step.expect, (rec["check"], rec["verdict"], rec["explanation"])
            assert rec["as_expected"] is True


def _before_after(doc: dict) -> tuple[dict, dict]:
    fixes = [s for s in doc["steps"] if s["kind"] == "fix" and s.get("summary")]
    return fixes[0]["summary"], fixes[-1]["summary"]


def _assert_fix_helps(doc: dict, effect_test: str = "cis") -> None:
    before, after = _before_after(doc)
    assert after["accept_rate"] > before["accept_rate"]
    if effect_test == "cis":  # the two 95% CIs are disjoint
        assert after["accept_length_lo"] > before["accept_length_hi"], (before, after)
    else:  # the paired 95% CI of the change (same prompts, before vs after) excludes 0
        eff = doc["fix_effect"]
        assert eff["n_paired"] == before["n_requests"] == after["n_requests"], eff
        assert eff["accept_length_delta_lo"] > 0, eff
        assert abs(eff["accept_length_delta"] - (after["accept_length"] - before["accept_length"])) < 1e-9


@needs_models
@pytest.mark.server
def test_seeds_hunt_replays_with_expected_verdicts(tmp_path):
    doc = _replay("seeds_hunt", tmp_path)
    _check_verdicts(doc, ROOT / "env" / "cases" / "seeds_hunt.yaml")
    _assert_fix_helps(doc)
    inv = next(s for s in doc["steps"] if s["kind"] == "investigate")
    assert "embedding" in doc["headline"] and f"named blind in {inv['wall_s']:.1f} s" in doc["headline"], \
        doc["headline"]
    assert inv["findings"][0]["kind"] == "embedding_in_place_of_layer"
    assert inv["seconds_to_verdict"] is not None and inv["seconds_to_verdict"] < 120
    fixed = [s for s in doc["steps"] if s["kind"] == "fix"][-1]
    assert fixed["proposed"] and fixed["draft_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    sweep = next(s for s in doc["steps"] if s["kind"] == "sweep")
    assert [p["num_steps"] for p in sweep["points"]] == [2, 3]
    assert sweep["best_num_steps"] in (2, 3)
    assert sweep["points"][1].get("reused")  # num_steps=3 is the fix itself: not run twice
    led = json.loads((tmp_path / next(p.name for p in tmp_path.iterdir()) / "results" /
                      "replay-seeds-hunt.json").read_text())
    assert led["steps"][0]["summary"]["accept_length"] == doc["steps"][0]["summary"]["accept_length"]


SLOW_CASES = ["wrong_convention", "algorithm_eagle", "partial_sums", "missing_d2t", "seeds_hook_variant",
              "fallback_ids"]


@needs_models
@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_bundled_case_replays(name, tmp_path):
    doc = _replay(name, tmp_path)
    _check_verdicts(doc, ROOT / "env" / "cases" / f"{name}.yaml")
    _assert_fix_helps(doc, load_case(ROOT / "env" / "cases" / f"{name}.yaml").effect_test)


@needs_models
@pytest.mark.server
@pytest.mark.slow
def test_missing_final_chunk_crashes_and_static_check_names_it(tmp_path):
    doc = _replay("missing_final_chunk", tmp_path)
    _check_verdicts(doc, ROOT / "env" / "cases" / "missing_final_chunk.yaml")
    first = doc["steps"][0]
    assert first["summary"] is None and "shapes cannot be multiplied" in first["server_error"]
    static = doc["steps"][1]
    assert "missing_chunk" in static["data"]["findings"] or "width_mismatch" in static["data"]["findings"]
    assert doc["steps"][2]["summary"]["accept_length"] > 1.5
