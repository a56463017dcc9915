"""helpers.views: the notebooks' logic on synthetic run folders (no server, no kernel): escaping of
server-provided text, verdict tables, the timeline chart, before/after with CIs, per-token rel_diff and
shared-bin histograms, failures table, offline HTML export of a notebook with a widget."""
from __future__ import annotations

import json
import math

import nbformat
import numpy as np
import pandas as pd
import pytest

from helpers.investigation.replay import headline as replay_headline
from helpers.records import InvestigationDoc
from helpers.suite import html as suite_html
from helpers.views import attach as views_attach
from helpers.views import common as views_common
from helpers.views import compare as views_compare
from helpers.views import hypotheses as views_hypotheses
from helpers.views import investigation as views_investigation
from helpers.views import postmortem as views_postmortem
from helpers.views import replay as views_replay

EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def _doc():
    def fix(i, name, rate, length, lo=0.05):
        return {"kind": "fix", "index": i, "name": name, "baseline": False, "wall_s": 30.0,
                "summary": {"accept_rate": rate, "accept_rate_lo": rate - lo, "accept_rate_hi": rate + lo,
                            "accept_length": length, "accept_length_lo": length - 0.1,
                            "accept_length_hi": length + 0.1, "tok_s": 10 * length, "tok_s_lo": 9 * length,
                            "tok_s_hi": 11 * length, "n_requests": 24}}

    return {"case": "synthetic", "title": "t " + EVIL, "complete": True,
            "headline": "What was wrong: " + EVIL + "; found by step 3.",
            "steps": [fix(0, "as deployed", 0.05, 1.1),
                      {"kind": "hypothesis", "index": 1, "check": "embedding_all_reduce", "label": "msg 4495",
                       "question": "q?", "verdict": "refuted", "expect": "refuted", "as_expected": True,
                       "explanation": "explained " + EVIL, "evidence": [{"rank": 0, "note": EVIL}],
                       "figure": None, "on_fix": "as deployed", "wall_s": 1.0},
                      {"kind": "hypothesis", "index": 2, "check": "embedding_included", "label": "",
                       "question": "q2?", "verdict": "confirmed", "expect": "refuted", "as_expected": False,
                       "explanation": "found", "evidence": [], "figure": None, "on_fix": "as deployed"},
                      fix(3, "revert", 0.6, 2.6),
                      {"kind": "sweep", "index": 4, "on_fix": "revert", "best_num_steps": 3,
                       "points": [{"num_steps": n, "topk": 1, "tok_s": t, "tok_s_lo": t - 1, "tok_s_hi": t + 1,
                                   "accept_length": a} for n, t, a in ((2, 20, 2.2), (3, 24, 2.6), (4, 22, 2.8))]}]}


def test_escaping_of_server_and_case_text():
    doc = _doc()
    assert EVIL not in views_replay.headline_html(doc) and "&lt;script&gt;" in views_replay.headline_html(doc)
    step = doc["steps"][1]
    h = views_replay.step_html(step)
    assert EVIL not in h and "explained &lt;script&gt;" in h
    t = views_common.table_html(views_replay.evidence_frame(step))
    assert "<script>" not in t and "&lt;img src=x onerror=alert(1)&gt;" in t
    assert "<script" not in views_common.verdict_badge(EVIL)
    facts = views_attach.server_facts({"version": EVIL, "model_path": "/m", "tp_size": 8,
                            "forward_hooks": json.dumps([{"name": EVIL}])})
    assert "<script>" not in views_common.table_html(facts)
    status = {"notebooks": {"02": {"ok": False, "ename": "ValueError", "evalue": EVIL, "exec_count": 4,
                                   "html": 'html/x.html" onmouseover="alert(1)'}}}
    f = views_postmortem.failures_html(status)
    assert "<script>" not in f and 'onmouseover="alert' not in f and "<td>4</td>" in f
    links = views_postmortem.notebook_links_html({"notebooks": {EVIL: {"ok": True, "html": "html/a.html", "wall_s": 1}}})
    assert "<script>" not in links
    story = views_replay.story_html({"title": EVIL, "story": "para one " + EVIL + "\n\npara two"})
    assert "<script>" not in story and story.count("<p>") == 3
    assert views_replay.story_html({"story": ""}) == ""


def test_table_colours_verdicts_and_truncates():
    df = pd.DataFrame({"check": ["a", "b"], "verdict": ["confirmed", "refuted"], "x": [1.23456789, float("nan")]})
    h = views_common.table_html(df)
    assert views_common.VERDICT_COLORS["confirmed"] in h and views_common.VERDICT_COLORS["refuted"] in h
    assert "1.235" in h
    big = pd.DataFrame({"a": range(100)})
    assert "40 more rows" in views_common.table_html(big, max_rows=60)
    assert "no rows" in views_common.table_html(pd.DataFrame())


def test_fixes_hypotheses_and_before_after():
    doc = _doc()
    fx = views_replay.fixes_frame(doc)
    assert list(fx["fix"]) == ["as deployed", "revert"] and list(fx["step"]) == [1, 4]
    hy = views_replay.hypotheses_frame(doc)
    assert list(hy["verdict"]) == ["refuted", "confirmed"] and list(hy["as expected"]) == ["yes", "NO"]
    ba = views_postmortem.before_after(doc)
    row = ba.set_index("metric").loc["accept rate"]
    assert row["outside both 95% CIs"] == "yes" and row["change (paired 95% CI)"] == "+55.0 points"
    assert "60.0% [55.0%, 65.0%]" in row["after: revert"]
    disp = views_replay.fixes_display(doc)
    assert disp["accept length [95% CI]"].iloc[1] == "2.60 [2.50, 2.70]"
    assert views_postmortem.before_after({"steps": doc["steps"][:1]}).empty
    broken = {"steps": doc["steps"][:3] + [{"kind": "fix", "index": 3, "name": "no server", "summary": None,
                                             "server_error": "ServerStartError: " + EVIL}]}
    fx = views_replay.fixes_frame(broken)
    assert fx["error"].iloc[1].startswith("ServerStartError") and math.isnan(fx["accept_rate"].iloc[1])
    assert views_postmortem.before_after(broken).empty, "a fix whose server did not start is not an 'after'"


def test_timeline_figure_marks_hypotheses_by_verdict():
    doc = _doc()
    fig = views_replay.timeline_figure(doc)
    rate = fig.data[0]
    assert list(rate.x) == [1, 4] and pytest.approx(list(rate.y)) == [5.0, 60.0]
    assert pytest.approx(list(rate.error_y.array)) == [5.0, 5.0]
    colors = [s.line.color for s in fig.layout.shapes if s.type == "line"]
    assert colors == [views_common.VERDICT_COLORS["refuted"], views_common.VERDICT_COLORS["confirmed"]]
    assert "lines" not in rate.mode, "no line joins two fixes across the hypothesis steps between them"
    ticks = list(fig.layout.xaxis.ticktext)
    assert ticks[1] == "2. Embedding all-reduce?" and ticks[2] == "3. Embedding in place of a layer?", ticks
    hover = [t.hovertext for t in fig.data if t.name in ("refuted", "confirmed")]
    assert hover == ["step 2: q? Verdict: refuted (expected refuted) [msg 4495]",
                     "step 3: q2? Verdict: confirmed (expected refuted)"]
    assert not [a for a in fig.layout.annotations if a.textangle], "no rotated labels above the plot"
    # 3 steps has the highest mean, but its CI [23, 25] meets 4 steps' [21, 23]: no fastest (acceptance.sweeps rule)
    assert any(a.text == "num_steps not distinguishable" for a in fig.layout.annotations)
    assert {t.name for t in fig.data} >= {"refuted", "confirmed"}
    # round ticks on the accept-length axis: 0 and multiples of a 1/2/2.5/5 x 10^k step up to the top
    right = fig.layout.yaxis2
    assert right.dtick in (0.25, 0.5, 1.0, 2.0, 2.5, 5.0) and right.tick0 == 0
    assert [views_replay.nice_step(x) for x in (1.28, 3.2, 27.1, 0.9)] == [0.5, 1.0, 10.0, 0.2]
    assert views_replay.timeline_figure(None).data == ()


def test_sweep_figure_and_points():
    doc = _doc()
    pts = views_replay.sweep_points(doc)
    assert [p["num_steps"] for p in pts] == [2, 3, 4]
    fig = views_replay.sweep_figure(doc)
    assert "num_steps not distinguishable" in fig.layout.title.text and "best" not in fig.layout.title.text
    assert list(fig.data[0].y) == [20, 24, 22]
    assert (fig.layout.yaxis.dtick, fig.layout.yaxis2.dtick) == (5.0, 1.0), "round ticks: tok/s up to 25, length 2.8"
    assert views_replay.sweep_figure({"steps": doc["steps"][:2]}) is None


def test_hypothesis_steps_and_verdict_summary(tmp_path):
    doc = _doc()
    assert [s.index for s in views_replay.hypothesis_steps(doc, "embedding_included")] == [2]
    (tmp_path / "results").mkdir()
    views_common.write_result(tmp_path, "10_hyp_tp_sharding", views_hypotheses.hypothesis_result(
        "10_hyp_tp_sharding", "tp_sharding", [{"verdict": "inconclusive", "label": "live"}], "live"))
    inv = InvestigationDoc(url="http://x", verdict="mismatch", sentence="Wrong wiring: <b>x</b>",
                           findings=[{"kind": "embedding_in_place_of_layer", "chunk": 0, "detail": "served <b>x</b>"}],
                           hypotheses=[{"check": "tp_sharding", "verdict": "refuted", "question": "q"}])
    (tmp_path / "investigation.json").write_text(inv.model_dump_json())
    vs = views_postmortem.verdict_summary(tmp_path, doc)
    assert list(vs["check"]) == ["embedding_all_reduce", "embedding_included", "tp_sharding"]
    assert vs["source"].iloc[-1] == "investigation (investigation.json)" and vs["verdict"].iloc[-1] == "refuted"
    rec = views_postmortem.postmortem_record(tmp_path, doc)
    json.dumps(rec)  # JSON-safe
    # the replay's own headline function (no investigation step in this replay: the confirmed hypothesis)
    steps = list(views_replay.as_replay(doc).steps)
    assert rec["headline"] == replay_headline(None, steps, None) and rec["investigation"] == inv.sentence
    assert rec["headline"].startswith("What is wrong: found [source: step 3: check 'embedding_included' confirmed].")
    page = views_investigation.page_html(inv)
    assert "served &lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page   # server text escaped


def test_per_token_rel_diff_and_shared_bins():
    H = 4
    rng = np.random.default_rng(0)
    t = rng.normal(size=(5, 2 * H)).astype(np.float32)
    s = t.copy()
    s[:, :H] = rng.normal(size=(5, H))        # chunk 0 wrong
    s[2, H:] = 0                              # one zero row in chunk 1 -> rel_diff 1
    pairs = [{"key": "a", "positions": np.arange(5), "input_ids": np.arange(10, 15), "served": s, "training": t}]
    df = views_compare.per_token_rel_diff(pairs, H)
    assert len(df) == 10 and set(df["chunk"]) == {0, 1}
    c1 = df[df["chunk"] == 1].set_index("position")["rel_diff"]
    assert c1[2] == pytest.approx(1.0) and c1.drop(2).max() == 0.0
    x, y = s[0, :H].astype(float), t[0, :H].astype(float)
    want = ((x - y) ** 2).sum() / ((x * x).sum() + (y * y).sum())
    assert df[(df.chunk == 0) & (df.position == 0)]["rel_diff"].iloc[0] == pytest.approx(want)
    fig = views_compare.rel_diff_histograms(df, bins=20)
    assert len(fig.data) == 2 and list(fig.data[0].x) == list(fig.data[1].x)
    assert sum(fig.data[0].y) == 5 and sum(fig.data[1].y) == 5
    f2 = views_compare.per_token_figure(df, "a", 1, tolerance=1e-5)
    assert len(f2.data) == 1 and f2.layout.yaxis.type == "log"


def test_downsample_keeps_ends():
    idx = views_common.downsample(10_000, 100)
    assert len(idx) <= 100 and idx[0] == 0 and idx[-1] == 9999
    assert list(views_common.downsample(5, 100)) == [0, 1, 2, 3, 4]


def test_failures_frame_from_status():
    st = {"notebooks": {"a": {"ok": True}, "b": {"ok": False, "cell_index": 7, "error": "Timeout"},
                        "c": {"ok": False, "exec_count": 3, "ename": "KeyError", "evalue": "'x'"}}}
    df = views_postmortem.failures_frame(st)
    assert list(df["notebook"]) == ["b", "c"] and list(df["cell"]) == [7, 3]
    assert df["error"].iloc[1] == "KeyError: 'x'"
    assert "outside the suite" in views_postmortem.failures_html({})


def test_context_defaults_and_case_models(tmp_path, tiny_target, tiny_draft):
    run = tmp_path / "run"
    run.mkdir()
    ctx = views_common.context(run)
    assert ctx.target_dir == views_common.ROOT / views_common.DEFAULT_TARGET and ctx.training == views_common.ROOT / views_common.DEFAULT_TRAINING
    assert ctx.replay is None and not ctx.live
    case = tmp_path / "c.yaml"
    case.write_text(f"name: c\ntitle: t\nmodels: {{target: {tiny_target}, draft: {tiny_draft}, "
                    "training_data: /data}\ntimeline:\n  - fix: {name: f}\n")
    ctx = views_common.context(run, case=str(case))
    assert ctx.target_dir == tiny_target and ctx.draft_dir == tiny_draft and str(ctx.training) == "/data"
    assert ctx.hidden_size == 64
    ctx = views_common.context(run, case=str(case), draft_dir="/other")
    assert str(ctx.draft_dir) == "/other"


def test_static_wiring_from_configs(tiny_target, tiny_draft):
    sw = views_attach.static_wiring(tiny_draft, tiny_target, {"speculative_algorithm": "EAGLE3", "version": "0.5.23"})
    assert list(sw["plans"]["served"]) == ["out(1)", "out(3)", "out(4)"]
    assert list(sw["plans"]["offset"]) == [0, 0, 0] and sw["findings"] == []
    eagle = views_attach.static_wiring(tiny_draft, tiny_target, {"speculative_algorithm": "EAGLE", "version": "0.5.23"})
    assert "fc_bypassed" in [f["kind"] for f in eagle["findings"]]
    missing = views_attach.static_wiring(None, tiny_target, {})
    assert missing["plans"].empty and missing["notes"]


def test_renderer_bundle_has_no_cdn_script():
    import plotly.graph_objects as go
    import plotly.io as pio

    views_common.register_renderer()
    bundle = pio.renderers["e3f_html"].to_mimebundle(go.Figure(go.Bar(x=[EVIL], y=[1])).to_dict())
    html = bundle["text/html"]
    assert "<script src" not in html and "cdn" not in html.lower() and "require(" not in html
    assert "Plotly.newPlot" in html and "<script>alert" not in html
    assert pio.renderers.default == "plotly_mimetype+e3f_html"
    assert views_common.plotlyjs_html().count(suite_html.PLOTLYJS_MARKER) == 1 and "src=" not in views_common.plotlyjs_html()[:300]


def test_export_replaces_widgets_and_stays_offline(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    cell = nbformat.v4.new_code_cell("w")
    cell.outputs = [nbformat.v4.new_output("display_data", data={
        suite_html.WIDGET_VIEW: {"model_id": "abc", "version_major": 2, "version_minor": 0},
        "text/plain": "VBox(children=(Dropdown(...),))"})]
    cell2 = nbformat.v4.new_code_cell("fig")
    cell2.outputs = [nbformat.v4.new_output("display_data", data={"text/html": views_common.plotlyjs_html()})]
    nb.cells = [cell, cell2]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    p = tmp_path / "n.ipynb"
    nbformat.write(nb, p)
    out = tmp_path / "n.html"
    suite_html.export_html(p, out)
    text = out.read_text()
    assert "VBox(children" not in text and "interactive control" in text
    info = suite_html.check_html(out)
    assert info["offline"] and info["plotlyjs_copies"] == 1 and info["external_scripts"] == 0
    assert 'id="e3f-toggle"' in text


def test_check_html_flags_cdn_scripts(tmp_path):
    p = tmp_path / "x.html"
    p.write_text('<script src="https://cdn.plot.ly/plotly.js"></script><link href="//fonts.x/y.css">'
                 "* plotly.js v1 * plotly.js v2")
    info = suite_html.check_html(p)
    assert info == {"bytes": p.stat().st_size, "plotlyjs_copies": 2, "external_scripts": 1,
                    "external_links": 1, "offline": False}
    assert math.isfinite(info["bytes"])


def test_investigation_says_once_what_was_measured_and_which_file_to_edit(tmp_path):
    from helpers.investigation.live import sentence
    from helpers.records import Finding, ProposedFix

    (tmp_path / "drafts" / "proposed").mkdir(parents=True)
    (tmp_path / "drafts" / "proposed" / "config.json").write_text("{}")
    fix = ProposedFix(kind="config", summary="set eagle_config.eagle_aux_hidden_state_layer_ids to [1, 3, 4]",
                      draft_config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}, applicable=True)
    doc = InvestigationDoc(url="http://x", run_dir=str(tmp_path), verdict="mismatch", proposed_fix=fix,
                           findings=[Finding(kind="embedding_in_place_of_layer", chunk=0, detail="d", evidence={})],
                           attach={"served_draft": "/models/edited-draft", "draft_dir": "/mnt/edited-draft"},
                           measured={"measured_by": "this replay as its step 'fix' (before and after the fix, on "
                                                    "this page)"})
    doc.sentence = sentence(doc)
    assert doc.sentence.endswith("Measured by this replay as its step 'fix' (before and after the fix, on this page).")
    page = "".join(p for p in views_investigation.sections_html(doc) if isinstance(p, str))
    assert "not measured" not in page.lower() and page.lower().count("measured by this replay") == 2  # headline, section
    assert "file to edit: <code>/models/edited-draft/config.json</code>" in page
    assert str(tmp_path / "drafts" / "proposed" / "config.json") in page
    # the headline states the proposed fix; the fix section below it does not repeat the sentence
    assert page.count(doc.proposed_fix.summary) == 1
    assert views_investigation.sections_html(doc, with_headline=False)[5].count(doc.proposed_fix.summary) == 1


def test_a_kept_setting_the_sweep_measured_slower_is_flagged():
    """The budget keeps the served steps (nothing else modelled a material share faster) while the replay's sweep
    measured other steps faster beyond both tok/s CIs: the settings line says so and raises a flag (the fresh-user run
    of the Kimi main job: kept 3, sweep 2 steps 29.4 [27.2, 31.7] vs 3 steps 22.4 [20.7, 24.3] tok/s, unflagged)."""
    from helpers.views.budget import settings_text

    served = {"steps": 3, "topk": 1, "draft_tokens": 4}
    b = {"settings": served, "recommended_settings": dict(served), "cause": "wiring", "missing": [],
         "stages": [{"name": "best settings (simulated)", "grid": "served states", "modelled_speedup_gain": 0.076}]}
    doc = _doc()
    text, flag = settings_text(b, doc)                       # the synthetic sweep: 3 steps (24) is the fastest
    assert flag is None and "keeps the served" in text and "num_steps=4: 22.0 [21.0, 23.0]" in text
    assert "not distinguishable" in text and "Advice: the sweep recommends no num_steps" in text
    pts = doc["steps"][-1]["points"]
    pts[0].update(tok_s=29.4, tok_s_lo=27.2, tok_s_hi=31.7)   # 2 steps now measured faster beyond both CIs
    text, flag = settings_text(b, doc)
    assert flag is not None and flag.startswith("the budget keeps the served 3 steps") and "2 steps faster" in flag
    assert "29.4 [27.2, 31.7]" in text and "see the flags" in text and "Advice: undecided between 3 steps" in text
    pts[0].update(tok_s=24.5, tok_s_lo=23.0, tok_s_hi=26.0)   # overlapping CIs: no flag
    text, flag = settings_text(b, doc)
    assert flag is None and "not distinguishable" in text and "Advice: the sweep recommends no num_steps" in text
