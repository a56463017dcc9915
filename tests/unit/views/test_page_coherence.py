"""The main job's postmortem says one thing per question, on the fresh-user run of the main job recorded in
tests/data/main_job (README there): (1) where the replay and the blind investigation give a check different verdicts,
the page says why, each verdict with its basis; (2) the settings advice is one rule (helpers.views.budget.settings_text
over helpers.acceptance.sweeps.steps_sweep_verdict) that the first screen, the sweep figure, the timeline, the replay
console line and the suite's closing console line all say, and when the sweep's tok/s CIs overlap it recommends no
num_steps. Pure unit tests on recorded data (no server)."""
from __future__ import annotations

import copy
import html
import json

import pandas as pd
import pytest

from helpers.acceptance.stats import bootstrap_ratio_ci
from helpers.acceptance.sweeps import steps_sweep_verdict
from helpers.kinds import CHECK_FINDINGS
from helpers.records import SweepStep
from helpers.suite.runner import _sweep_line
from helpers.views import acceptance, postmortem, story
from helpers.views import investigation as I
from helpers.views import replay as views_replay
from helpers.views.budget import settings_text
from support import ROOT

RUN = ROOT / "tests" / "data" / "main_job"


@pytest.fixture(scope="module")
def recorded():
    doc = json.loads((RUN / "results" / "replay-kimi-seeds-hunt.json").read_text())
    raw_inv = json.loads((RUN / "investigation.json").read_text())
    return doc, raw_inv


def _first_screen(doc) -> str:
    inv = I.load_investigation(RUN)
    parts = story.first_screen(RUN, doc, inv, acceptance.main_fixes(acceptance.ledger_frame(RUN)))
    return "".join(p for p in parts if isinstance(p, str))


def _sweep(doc) -> dict:
    return next(s for s in doc["steps"] if s["kind"] == "sweep")


def test_the_verdicts_say_why_the_replay_and_the_blind_investigation_disagree(recorded):
    """The fresh user's trip 6: concat_order refuted in the replay's table, inconclusive in the blind investigation's,
    with no word on why. Every check whose two verdicts differ now has one note naming both verdicts and their bases
    (the replay step's own explanation; the finding of the investigation's run that withholds its refutation)."""
    doc, raw = recorded
    blind = {h["check"]: h for h in raw["hypotheses"]}
    steps = [s for s in doc["steps"] if s["kind"] == "hypothesis" and s["check"] in blind]
    differ = [s for s in steps if s["verdict"] != blind[s["check"]]["verdict"]]
    agree = [s for s in steps if s["verdict"] == blind[s["check"]]["verdict"]]
    assert differ and agree, "the recorded run has both kinds of check"
    page = postmortem.verdicts_html(RUN, doc)
    notes = [html.unescape(n.split("</p>")[0]) for n in page.split('<p class="e3f-note">')[1:]]
    assert len(notes) == len(differ), notes
    for s in differ:
        h = blind[s["check"]]
        (line,) = [n for n in notes if n.startswith(f"{s['check']}: the replay's step {s['index'] + 1} ")]
        assert f"says {s['verdict']} ({s['explanation'].split('. ')[0].rstrip('.')})" in line, line
        assert f"the blind investigation says {h['verdict']} (" in line, line
        hits = [f for f in raw["findings"] if f["kind"] in CHECK_FINDINGS.get(s["check"], ())]
        if s["verdict"] == "refuted" and h["verdict"] == "inconclusive" and hits:
            assert f"the finding {hits[0]['kind']} of its run stands ({hits[0]['detail']})" in line
            assert "helpers/investigation/live.py::reconcile" in line
    for s in agree:
        assert not any(n.startswith(f"{s['check']}: the replay's") for n in notes)
    assert postmortem.postmortem_record(RUN, doc)["verdict_differences"] == notes


def test_the_settings_advice_is_one_rule_on_the_page_and_the_console(recorded):
    """The fresh user's trip 11: the budget kept the served 3 steps while the sweep figure, the timeline and the
    console said 'best num_steps=2'. On the recorded sweep (2 steps' tok/s CI above 3 steps'), every place now says
    the sweep's one word, and the settings line gives one advice: undecided, with the flag."""
    doc, raw = recorded
    pts = _sweep(doc)["points"]
    best = max(pts, key=lambda p: p["tok_s"])
    others = [p for p in pts if p is not best]
    apart = all(best["tok_s_lo"] > o["tok_s_hi"] for o in others)
    v = steps_sweep_verdict(pts)
    assert v["apart"] == apart and v["fastest"] == (best["num_steps"] if apart else None)
    served = raw["acceptance"]["settings"]["steps"]
    modelled = raw["acceptance"]["recommended_settings"]["steps"]
    text, flag = settings_text(raw["acceptance"], doc)
    assert v["text"] in text
    if apart and best["num_steps"] != modelled:        # the recorded case: measured 2, modelled (kept) 3
        assert f"Advice: undecided between {modelled} steps (modelled) and {best['num_steps']} steps" in text
        assert flag is not None and f"the sweep measured {best['num_steps']} steps faster" in flag
    elif apart:
        assert f"Advice: {modelled} steps, modelled and measured" in text and flag is None
    assert text.count("Advice:") == 1
    page = _first_screen(doc)
    assert html.escape(text, quote=True) in page
    # the console: the replay step's line and the suite's closing settings line (the record the CLI prints)
    assert _sweep_line(SweepStep.model_validate(_sweep(doc))) == v["text"]
    assert postmortem.postmortem_record(RUN, doc)["settings"] == text
    # the figures use the same rule's short word, and nothing says "best num_steps"
    fig = views_replay.sweep_figure(doc)
    tl = views_replay.timeline_figure(doc)
    assert v["label"] in fig.layout.title.text
    assert any(a.text == v["label"] for a in tl.layout.annotations)
    said = [page, fig.layout.title.text] + [a.text for a in tl.layout.annotations]
    assert not any("best num_steps" in t for t in said)
    assert not any("best num_steps" in t for t in postmortem.postmortem_record(RUN, doc)["flags"])


def _points_from_rows(n: int) -> dict[int, tuple[float, float, float]]:
    """tok/s with its 95 % CI of each sweep point from its first ``n`` recorded requests (by prompt id), as
    helpers.acceptance.measure.summarize computes it (bootstrap_ratio_ci, 2000 resamples, seed 0)."""
    out = {}
    for steps, name in ((2, "fix-the-tool-s-proposal-num_steps-2"), (3, "fix-the-tool-s-proposal")):
        df = pd.read_parquet(RUN / "acceptance" / name / "per_request.parquet").sort_values("prompt_id").head(n)
        df = df[df["error"].isna()]
        out[steps] = bootstrap_ratio_ci(df["completion_tokens"].to_numpy(float), df["latency_s"].to_numpy(float),
                                        n_boot=2000, level=0.95, seed=0)
    return out


def test_overlapping_sweep_cis_recommend_no_num_steps(recorded):
    """The same sweep measured on its first 8 prompts (the recorded per-request rows; all 16 reproduce the recorded
    points): the CIs overlap, so the page, the figures and the console say the num_steps are not distinguishable
    and recommend none."""
    doc, raw = recorded
    full = _points_from_rows(16)
    for p in _sweep(doc)["points"]:
        assert (p["tok_s"], p["tok_s_lo"], p["tok_s_hi"]) == pytest.approx(full[p["num_steps"]])
    doc = copy.deepcopy(doc)
    part = _points_from_rows(8)
    for p in _sweep(doc)["points"]:
        p["tok_s"], p["tok_s_lo"], p["tok_s_hi"] = part[p["num_steps"]]
    (lo2, hi2), (lo3, hi3) = part[2][1:], part[3][1:]
    assert lo2 <= hi3 and lo3 <= hi2, "8 prompts: the two CIs overlap"
    v = steps_sweep_verdict(_sweep(doc)["points"])
    assert v["fastest"] is None and v["label"] == "num_steps not distinguishable"
    text, flag = settings_text(raw["acceptance"], doc)
    assert flag is None and v["text"] in text and "not distinguishable" in v["text"]
    assert "Advice: the sweep recommends no num_steps (not distinguishable)" in text and "fastest" not in text
    assert _sweep_line(SweepStep.model_validate(_sweep(doc))) == v["text"]
    assert html.escape(text, quote=True) in _first_screen(doc)
    assert v["label"] in views_replay.sweep_figure(doc).layout.title.text
