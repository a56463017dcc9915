"""Every bundled case replays on the reference server: each hypothesis gets its expected verdict,
and the fix raises accept length beyond the faulted configuration's 95% CI (bootstrap over
requests). The main job's case (kimi_seeds_hunt) is replayed and checked by tests/suite/test_suite_main.py; the cases
here are marked slow (still run in CI) or extended (make test-all: a CI test already checks their fault live).
Case files validated without a server: tests/unit/investigation/test_case_validation.py.
"""
from __future__ import annotations

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


#: the extended tier (make test-all): cases whose fault and hypothesis a CI test already checks live --
#: algorithm_eagle and partial_sums in test_investigate_live.py (fc_bypass / tp_sharding confirmed), missing_d2t in
#: test_investigate_live.py::test_draft_without_vocab_map (vocab_map confirmed), seeds_hook_variant's forward-hook
#: capture in test_hooks_live.py, and seeds_hunt (the seeds' embedding on the Llama target) in
#: test_investigate_live.py::test_seeds_config_fault_is_named_fixed_and_measured and, on the Kimi-class target, the
#: main job (tests/suite/test_suite_main.py). Each replay is ~2-3 min of servers.
EXTENDED_CASES = {"algorithm_eagle", "partial_sums", "missing_d2t", "seeds_hook_variant", "seeds_hunt"}
SLOW_CASES = [pytest.param(c, marks=pytest.mark.extended) if c in EXTENDED_CASES else c
              for c in ["seeds_hunt", "wrong_convention", "algorithm_eagle", "partial_sums", "missing_d2t", "seeds_hook_variant",
                        "fallback_ids"]]


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


# ------------------------------------------------------------------ recorded cases (replayed offline, no server)
MTP_CASE = ROOT / "env" / "cases" / "mtp_embedding.yaml"


def _recorded_copy(tmp_path: Path, *, recording: Path, **changes) -> Path:
    """A copy of the MTP case file with ``recording`` (absolute) and top-level ``changes``."""
    import yaml

    data = yaml.safe_load(MTP_CASE.read_text())
    data.update(recording=str(recording), **changes)
    p = tmp_path / "case.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def test_mtp_recorded_case_replays_offline_with_its_fault_named(capsys):
    """The MTP / NextN case the main job's postmortem shows (env/cases/mtp_embedding.yaml), read back from its
    recording: the blind investigation named the case's fault (the head fed the tensor the case's fault feeds, not
    norm(out(n-1))), the wiring stage's loss is the paired difference of its two offline stages and counts, and the
    postmortem section carries the finding (escaped), as ``python -m helpers replay CASE`` prints it. Offline: no
    server."""
    import html

    from helpers.investigation.cases import load_recorded_case
    from helpers.investigation.mtp import POST_NORM
    from helpers.investigation.recorded import replay_recorded
    from helpers.views.recorded import recorded_parts

    case = load_recorded_case(MTP_CASE)
    doc, meta = replay_recorded(case)
    fault = case.faults[0]
    fed = "embedding" if fault["kind"] == "embedding_in_place_of_layer" else f"out({fault['layer']})"
    assert doc.findings[0].kind == case.expect_finding
    ident = doc.diagnosis["served_state"]
    assert ident["identified"] == fed and ident["rel_error"][fed] < 1e-4
    assert ident["rel_error"][POST_NORM] > 10 * ident["threshold"]
    assert doc.attach["draft_head"]["spec"]["algorithm_requested"] == case.server.spec.algorithm == "NEXTN"
    b = doc.acceptance
    by = {s["name"]: s["accept_length"] for s in b["stages"]}
    draft, wiring, live = (by[k] for k in ("draft (offline, reference states)", "wiring (offline, served states)",
                                           "live"))
    loss = b["losses"]["wiring"]
    assert loss["decision"] == "counts" and loss["ci"][0] > 0 and abs(loss["delta"] - (draft - wiring)) < 1e-9
    assert abs(b["losses"]["engine"]["delta"] - (wiring - live)) < 1e-9
    assert doc.verdict == "mismatch" and doc.proposed_fix.kind == "engine"
    assert meta["launch"]["faults"] == case.faults and meta["engine_version"] == doc.engine_version
    assert str(ROOT) not in (case.resolve(case.recording) / "investigation.json").read_text()   # checkout_relative
    page = "\n".join(p for p in recorded_parts(MTP_CASE) if isinstance(p, str))
    assert html.escape(doc.findings[0].detail) in page and html.escape(case.title) in page
    from helpers.cli.replay import cli_main
    assert cli_main([str(MTP_CASE)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{case.expect_finding}: {doc.findings[0].detail}. Recorded {meta['recorded_at']}")
    assert out[1] == doc.sentence


def test_recorded_case_escapes_case_and_server_text_and_refuses_a_stale_recording(tmp_path):
    """Every text of a recorded case is escaped (the case's title, the server's finding text), and a recording whose
    launch is not the case's (the case edited after recording) is refused with the file named, on the page too."""
    import json
    import shutil

    from helpers.errors import CaseError
    from helpers.investigation.cases import load_recorded_case
    from helpers.investigation.recorded import DOC, replay_recorded
    from helpers.views.recorded import recorded_parts

    rec = tmp_path / "rec"
    shutil.copytree(ROOT / load_recorded_case(MTP_CASE).recording, rec)
    d = json.loads((rec / DOC).read_text())
    d["findings"][0]["detail"] = "<img src=x onerror=alert(1)> " + d["findings"][0]["detail"]
    (rec / DOC).write_text(json.dumps(d))
    page = "\n".join(p for p in recorded_parts(_recorded_copy(tmp_path, recording=rec, title="<script>x</script>"))
                     if isinstance(p, str))
    assert "<script>x" not in page and "&lt;script&gt;x" in page
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    stale = _recorded_copy(tmp_path, recording=rec, faults=[{"kind": "wrong_layer", "chunk": 0, "layer": 4}])
    with pytest.raises(CaseError, match=r"recording.json: recorded launch differs .* \['faults'\]"):
        replay_recorded(stale)
    assert "not shown" in recorded_parts(stale)[0] and "faults" in recorded_parts(stale)[0]


@needs_models
@pytest.mark.server
@pytest.mark.extended
def test_mtp_recorded_case_records_again_as_recorded(tmp_path):
    """Recording the MTP case again (its NEXTN server started with the fault, investigated blind; ~1-2 min) gives the
    recording's finding, served state and, greedy on the same prompts, the same accept lengths."""
    from helpers.investigation.recorded import record_case, replay_recorded

    old, _ = replay_recorded(MTP_CASE)
    case = _recorded_copy(tmp_path, recording=tmp_path / "rec")
    record_case(case)
    new, meta = replay_recorded(case)
    assert [f.kind for f in new.findings] == [f.kind for f in old.findings]
    assert new.diagnosis["served_state"]["identified"] == old.diagnosis["served_state"]["identified"]
    for a, b in zip(new.acceptance["stages"], old.acceptance["stages"]):
        assert a["name"] == b["name"] and abs(a["accept_length"] - b["accept_length"]) < 0.02, (a, b)
    assert new.acceptance["losses"]["wiring"]["decision"] == old.acceptance["losses"]["wiring"]["decision"]
