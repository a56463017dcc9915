"""Every bundled case replays on the reference server: each hypothesis gets its expected verdict,
and the fix raises accept length beyond the faulted configuration's 95% CI (bootstrap over
requests). The seeds' hunt runs in the fast tier; the other cases are marked slow (still run in CI).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.errors import CaseError
from helpers.investigation.cases import load_case
from helpers.investigation.replay import replay_case
from helpers.runfiles import new_run_dir

ROOT = Path(__file__).resolve().parents[1]
CASES = sorted((ROOT / "env" / "cases").glob("*.yaml"))
CASE_FILES = [c for c in CASES if c.name != "main.yaml"]
MODELS = ROOT / "env" / "models"
needs_models = pytest.mark.skipif(not (MODELS / "draft" / "config.json").exists(),
                                  reason="reference models (env/models) not built")


def test_all_bundled_cases_validate():
    assert len(CASE_FILES) >= 7
    for path in CASE_FILES:
        case = load_case(path)
        assert case.timeline[0].kind == "fix"
        assert any(s.kind == "hypothesis" and s.expect for s in case.timeline), path


def test_case_validation_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - hypothesis: {check: no_such_check}\n")
    with pytest.raises(CaseError, match=r"timeline\.0\.hypothesis\.check.*unknown check"):
        load_case(bad)
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - hypothesis: {check: tp_sharding}\n")
    with pytest.raises(CaseError, match="before any fix"):
        load_case(bad)
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - fix: {name: f, faults: [{kind: bogus}]}\n")
    with pytest.raises(CaseError, match="unknown fault kind"):
        load_case(bad)
    with pytest.raises(CaseError, match="does not exist"):
        load_case(tmp_path / "missing.yaml")


def _replay(name: str, tmp_path: Path) -> dict:
    path = ROOT / "env" / "cases" / f"{name}.yaml"
    run = new_run_dir(name, tmp_path)
    doc = replay_case(path, run, progress=False)
    assert doc["complete"], doc
    assert (run / "results" / f"replay-{load_case(path).name}.json").exists()
    return doc


def _check_verdicts(doc: dict, path: Path) -> None:
    case = load_case(path)
    for step, rec in zip(case.timeline, doc["steps"]):
        assert "error" not in rec, rec
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
    assert "embedding" in doc["headline"] and "step 5" in doc["headline"]
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


def test_replay_cli_rejects_a_bad_case_with_status_2(tmp_path, capsys):
    from helpers.__main__ import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntitle: t\ntimeline:\n  - hypothesis: {check: no_such_check}\n")
    assert main(["replay", str(bad), "--out", str(tmp_path / "out")]) == 2
    assert "unknown check" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing created for a case that does not validate
