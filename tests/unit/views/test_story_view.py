"""The first screen (helpers.views.story): one headline in three parts with sources, one before / after table with
95 % CIs, the ladder, and every figure that does not fit the story flagged with why -- parsed from the HTML, on run
folders whose figures are computed from per-request frames (tests/support/measurements.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from bs4 import BeautifulSoup

from helpers.acceptance.machine import speed_change
from helpers.acceptance.stats import format_ci, paired_effect
from helpers.draft.budget import REQUIRED_STAGES, _loss, budget_sentence, cause_of
from helpers.investigation.story import reconcile
from helpers.records import Finding, InvestigationDoc, ProposedFix
from helpers.runfiles import parquet_bytes
from helpers.views import postmortem, story
from support.measurements import frame, machine, summary

EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def _budget() -> dict:
    """A budget whose draft stage gains (the checkpoint above its log), wiring counts, the rest clear; settings:
    fewer steps recommended."""
    st = [{"name": "training log", "accept_length": 2.22, "ci": [None, None]},
          {"name": "checkpoint (teacher-forced)", "accept_length": 2.40, "ci": [2.35, 2.45],
           "rows": {"path": "/data/validation", "sequences": 48, "kind": {"split": "validation", "text": "sampled"}},
           "log_kind": {"split": "validation"}, "why": "the rows are of the log's kind",
           "table": [{"step": 0, "acc": 0.66, "log_acc": 0.62}, {"step": 1, "acc": 0.50, "log_acc": 0.52}]},
          {"name": "offline on training states", "accept_length": 3.35, "ci": [3.1, 3.84]},
          {"name": "offline on served states", "accept_length": 2.22, "ci": [1.66, 2.67]},
          {"name": "offline on live prompts' served states", "accept_length": 1.92, "ci": [1.76, 2.12]},
          {"name": "live", "accept_length": 1.92, "ci": [1.76, 2.12]},
          {"name": "best settings (simulated)", "accept_length": 1.81, "ci": [1.69, 1.96], "grid": "served states",
           "settings": {"steps": 2, "topk": 1, "draft_tokens": 3}, "modelled_speedup_gain": 0.11,
           "served_accept_length": 1.92}]
    losses = {"draft": _loss("draft", 2.22 - 2.40, -0.23, -0.13, "training log 2.22 vs the checkpoint 2.40", 2.22, n=48),
              "wiring": _loss("wiring", 1.13, 0.43, 1.54, "training states vs served states, paired over 3 sample(s)",
                              3.35, n=3),
              "engine": _loss("engine", 0.0, 0.0, 0.0, "offline vs live", 1.92, n=16),
              "settings": _loss("settings", 0.0, 0.0, 0.0, "recommended vs served", 1.92, n=16)}
    b = {"stages": st, "losses": losses, "required": list(REQUIRED_STAGES), "notes": [], "missing": [],
         "settings": {"steps": 3, "topk": 1, "draft_tokens": 4}, "recommended_settings": {"steps": 2, "topk": 1,
                                                                                          "draft_tokens": 3}}
    b["cause"] = cause_of(losses)
    b["sentence"] = budget_sentence(b)
    return b


@pytest.fixture()
def run_dir(tmp_path):
    """A live investigation's run folder: the fix raises accept length 1.9 -> 2.7 while the machine got busier (a
    verify step 40 -> 80 ms, a token x1.41; 2 -> 4.1 runnable tasks on 2 cores); server text with markup in the finding
    and fix."""
    rng = np.random.default_rng(0)
    a, b = frame(rng, 16, 12, 40.0, 1.9), frame(rng, 16, 12, 80.0, 2.7)
    sa, sb = summary(a, machine(2.0)), summary(b, machine(4.1))
    for name, df in (("before", a), ("after", b)):
        (tmp_path / "acceptance" / name).mkdir(parents=True)
        (tmp_path / "acceptance" / name / "per_request.parquet").write_bytes(parquet_bytes(df))
    fix = ProposedFix(kind="config", summary="set ids to [1, 3, 4] " + EVIL, applicable=True,
                      addresses=["embedding_in_place_of_layer"], why=["SGLang rule " + EVIL])
    doc = InvestigationDoc(url="http://127.0.0.1:1", run_dir=str(tmp_path), verdict="mismatch", proposed_fix=fix,
                           findings=[Finding(kind="embedding_in_place_of_layer", chunk=0, detail="chunk 0 " + EVIL)],
                           acceptance=_budget(), seconds_to_verdict=2.5, wall_s=43.4,
                           measured={"before": sa, "after": sb, "effect": paired_effect(a, b), "prompts": 16,
                                     "labels": ["before (as served)", "after (proposed fix)"],
                                     "saved_to": ["acceptance/before", "acceptance/after"],
                                     "speed": speed_change(sa, sb, a, b)})
    reconcile(doc, budget_expected=True)
    (tmp_path / "investigation.json").write_text(doc.model_dump_json())
    return tmp_path


def test_the_first_screen_holds_one_headline_and_the_before_after_table(run_dir):
    inv = postmortem.load_investigation(run_dir)
    html = "".join(story.first_screen(run_dir, None, inv))
    soup = BeautifulSoup(html, "html.parser")
    heads = soup.select(".e3f-headline")
    assert len(heads) == 1, "one headline"
    parts = heads[0].select(".e3f-hl-part")
    assert [p.b.get_text() for p in parts] == ["What is wrong:", "The fix:", "Measured effect:"]
    assert all(p.select(".e3f-src") for p in parts), "each part names its source"
    m = inv.measured
    effect = format_ci(m["effect"], "accept_length_delta", signed=True)
    assert effect in parts[2].get_text() and "16 prompts" in parts[2].get_text()
    # the stage's loss in the headline is the measured change: one story
    loss = inv.acceptance["losses"]["wiring"]
    assert loss["on_server"] and loss["delta"] == pytest.approx(m["effect"]["accept_length_delta"])
    assert f"{round(loss['delta'], 2):.2f} [" in parts[0].get_text() and "measured on the server" in parts[0].get_text()
    assert "named blind in 43.4 s" in parts[0].get_text()
    tables = soup.select("table.e3f-table")
    rows = {tr.select("td")[0].get_text(): [td.get_text() for td in tr.select("td")] for tr in tables[0].select("tr")
            if tr.select("td")}
    assert list(rows) == ["accept rate", "accept length", "tok/s"]
    assert rows["accept length"][1] == format_ci(m["before"], "accept_length")
    assert rows["tok/s"][2] == format_ci(m["after"], "tok_s", digits=1)
    assert rows["accept length"][4] == "yes" and "the machine's load explains it" in rows["tok/s"][5]
    ladder = [[td.get_text() for td in tr.select("td")] for tr in tables[1].select("tr") if tr.select("td")]
    assert [r[1] for r in ladder][:2] == ["training log", "checkpoint (teacher-forced)"]
    assert ladder[3][3].startswith(f"{round(loss['delta'], 2):.2f} [") and ladder[3][4] == "counts"


def test_a_contradicting_tok_s_and_a_gain_are_flagged_with_why(run_dir):
    inv = postmortem.load_investigation(run_dir)
    soup = BeautifulSoup("".join(story.first_screen(run_dir, None, inv)), "html.parser")
    items = [li.get_text() for li in soup.select(".e3f-flags li")]
    sp = inv.measured["speed"]
    assert sp["contradicts"] and sp["explained"] is True
    assert items[0] == "tok/s: " + sp["text"]
    r = sp["token_time"]
    assert f"x{r['ratio']:.2f} [{r['ratio_lo']:.2f}, {r['ratio_hi']:.2f}]" in items[0] and "predicts x2.05" in items[0]
    gain = next(i for i in items if i.startswith("draft loss"))
    assert "the checkpoint scores 2.40" in gain and "above its training log's 2.22" in gain and "beyond its CI" in gain
    assert "step 0: 0.660 vs the log's 0.620" in gain and "step 1" not in gain
    # the settings line is the budget's recommendation
    text = soup.get_text()
    assert "recommends --speculative-num-steps 2 --speculative-eagle-topk 1 --speculative-num-draft-tokens 3" in text
    assert "simulated on the served states" in text


def test_without_the_load_a_contradicting_tok_s_is_not_attributable_to_the_fix(run_dir):
    """A replay run folder from before the load was recorded: the speed check is computed from its files."""
    inv = postmortem.load_investigation(run_dir)
    m = inv.measured
    steps = [{"kind": "fix", "index": 0, "name": "as deployed", "acceptance_dir": "acceptance/before",
              "summary": {k: v for k, v in m["before"].items() if k != "machine"}},
             {"kind": "fix", "index": 1, "name": "the fix " + EVIL, "acceptance_dir": "acceptance/after",
              "summary": {k: v for k, v in m["after"].items() if k != "machine"}}]
    doc = {"case": "c", "steps": steps, "complete": True,
           "fix_effect": {"before": "as deployed", "after": "the fix", **m["effect"]}}
    ba = postmortem.before_after(doc, run_dir=run_dir)
    assert "not attributable to the fix" in ba.set_index("metric").loc["tok/s", "note"]
    fl = story.flags(story.measured_pair(run_dir, doc), None)
    assert len(fl) == 1 and "recorded no machine load" in fl[0]["text"]
    html = "".join(story.first_screen(run_dir, doc, None))
    assert EVIL not in html and "the fix &lt;script&gt;" in html


def test_server_text_stays_escaped_on_the_first_screen(run_dir):
    inv = postmortem.load_investigation(run_dir)
    html = "".join(story.first_screen(run_dir, None, inv))
    assert EVIL not in html and "<script" not in html and "<img" not in html
    assert "chunk 0 &lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in html
    assert "set ids to [1, 3, 4] &lt;script&gt;" in html and "SGLang rule &lt;script&gt;" in html
    rec = postmortem.postmortem_record(run_dir, None)
    assert [p["label"] for p in rec["story"]] == ["What is wrong", "The fix", "Measured effect"]
    assert rec["headline"].startswith("What is wrong: ") and json.dumps(rec)
