"""Which run folder a notebook works on, and that nothing already written is changed: the newest run (interactive or
suite), finished runs only read unless named, results never overwritten, an investigation never written over
another. No server: the refusals happen before any request (the URLs point at a closed port)."""
from __future__ import annotations

import hashlib
import json

import pytest

from helpers.errors import BadInput
from helpers.investigation.live import investigate
from helpers.views import acceptance as views_acceptance
from helpers.views import common as R
from helpers.views import investigation as I

CLOSED = "http://127.0.0.1:9"     # discard port: nothing listens there


def _tree(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def outputs(tmp_path, monkeypatch):
    out = tmp_path / "outputs"
    (out / "servers").mkdir(parents=True)
    (out / "servers" / "12345.json").write_text("{}")
    suite = out / "20260101-100000-seeds-hunt"
    (suite / "results").mkdir(parents=True)
    (suite / "suite_status.json").write_text("{}")
    (suite / "postmortem.html").write_text("<html></html>")
    (suite / "results" / "01_attach.json").write_text(json.dumps({"notebook": "01_attach", "live": False,
                                                                   "servers": []}))
    monkeypatch.setenv("E3F_OUTPUTS", str(out))
    return out


def test_newest_run_is_found_whether_suite_or_interactive(outputs):
    assert R.latest_run_dir().name == "20260101-100000-seeds-hunt"
    live = outputs / "20260102-090000-interactive"
    live.mkdir()
    (live / "investigation.json").write_text(json.dumps({"url": CLOSED}))
    ctx = R.context("")
    assert ctx.run_dir == live and ctx.origin == "newest" and ctx.writable and not ctx.finished
    assert R.esc(R.run_dir_line(live)) in R.run_banner(ctx) and "Read only" not in R.run_banner(ctx)


def test_a_finished_newest_run_is_read_not_written(outputs):
    suite = outputs / "20260101-100000-seeds-hunt"
    before = _tree(suite)
    ctx = R.context("")
    assert ctx.origin == "newest" and not ctx.writable
    assert "postmortem.html" in ctx.finished and "Read only" in R.run_banner(ctx)
    assert R.write_result(ctx, "01_attach", {"live": False, "servers": []}) is None
    with pytest.raises(BadInput, match="finished run"):
        views_acceptance.measure_live(R.context("", server_url=CLOSED), "x")
    with pytest.raises(BadInput, match="finished run"):
        I.ensure(R.context("", server_url=CLOSED))
    assert _tree(suite) == before
    # named: the user may add to it, under new names
    named = R.context(str(suite))
    assert named.origin == "given" and named.writable
    R.write_result(named, "01_attach", {"live": True, "servers": []})
    assert R.result_path(suite, "01_attach").name == "01_attach-2.json"
    assert R.read_result(suite, "01_attach").live is True
    assert {k: v for k, v in _tree(suite).items() if k != "results/01_attach-2.json"} == before


def test_results_are_never_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for i in range(3):
        R.write_result(run, "03_compare", {"served": f"d{i}", "verdict": "ok"})
    assert sorted(p.name for p in (run / "results").iterdir()) == ["03_compare-2.json", "03_compare-3.json",
                                                                    "03_compare.json"]
    assert R.result_path(run, "03_compare").name == "03_compare-3.json"
    assert R.read_result(run, "03_compare").served == "d2"
    assert json.loads((run / "results" / "03_compare.json").read_text())["served"] == "d0"


def test_a_named_folder_must_exist_unless_created(tmp_path, outputs):
    with pytest.raises(BadInput, match="run folder does not exist"):
        R.context(str(tmp_path / "typo"))
    made = R.context("", create=True)
    assert made.origin == "new" and made.run_dir.parent == outputs and made.writable


def test_an_investigation_is_never_written_over_another(outputs):
    live = outputs / "20260102-090000-interactive"
    live.mkdir()
    (live / "investigation.json").write_text(json.dumps({"url": "http://127.0.0.1:7"}))
    before = _tree(live)
    with pytest.raises(BadInput, match="investigation of another server"):
        I.ensure(R.context(str(live), server_url=CLOSED))
    with pytest.raises(BadInput, match="already holds an investigation"):
        investigate(CLOSED, training="/nonexistent", run_dir=live)
    assert _tree(live) == before


def test_acceptance_page_reads_the_investigations_measurements(tmp_path):
    """20_acceptance draws the investigation's before / after (acceptance/before|after/summary.json, as the
    investigation saved them); no budget part without one in investigation.json."""
    run = tmp_path / "run"
    for name, label, rate in (("before", "before (as served)", 0.3), ("after", "after (proposed fix)", 0.56)):
        (run / "acceptance" / name).mkdir(parents=True)
        summary = {"label": label, "accept_rate": rate, "accept_rate_lo": rate - 0.05, "accept_rate_hi": rate + 0.05,
                   "accept_length": 1 + 3 * rate, "accept_length_lo": 0.9 + 3 * rate,
                   "accept_length_hi": 1.1 + 3 * rate, "tok_s": 10.0, "n_requests": 8, "per_position": [1, 2]}
        (run / "acceptance" / name / "summary.json").write_text(json.dumps(
            {"summary": summary, "histogram": [1, 2, 3], "positions": [{"position": 1, "r": rate}]}))
    doc = {"url": CLOSED, "measured": {"saved_to": ["acceptance/before", "acceptance/after"]}}
    (run / "investigation.json").write_text(json.dumps(doc))
    fixes = views_acceptance.measured_fixes(run, views_acceptance.ledger_frame(run))
    assert list(fixes["fix"]) == ["before (as served)", "after (proposed fix)"]
    assert list(fixes["accept_rate"]) == [0.3, 0.56] and "per_position" not in fixes.columns
    assert json.loads(fixes["positions_json"].iloc[1]) == [{"position": 1, "r": 0.56}]
    table = views_acceptance.acceptance_table(fixes)
    assert list(table["accept rate [95% CI]"].str.startswith(("30", "56"))) == [True, True], table
    assert views_acceptance.acceptance_budget(run) == []      # the budget itself: tests/unit/views/test_budget_view.py
    # a replay's fix is in the ledger and in the investigation's measurement: drawn once
    from helpers.acceptance.ledger import Ledger
    Ledger(run / "ledger.parquet").append([{"fix": "fix: the proposal", "saved_to": "acceptance/after",
                                            "accept_rate": 0.56, "accept_length": 2.68}])
    fixes = views_acceptance.measured_fixes(run, views_acceptance.ledger_frame(run))
    assert list(fixes["fix"]) == ["before (as served)", "fix: the proposal"]
