"""The pages and console lines of an MTP / NextN investigation (helpers/views/draft_kind.py, helpers/investigation/
mtp.py) on a recorded run: ``tests/data/mtp_investigation/investigation.json`` is the ``investigation.json`` that
``python -m helpers investigate`` wrote for an SGLang 0.5.23 server started with ``--speculative-algorithm NEXTN`` on
the embedded Kimi-class target (env/models/kimi/target, TP 1, 16 live prompts, HF reference), unedited. The texts
asserted are read from that record (the rel. errors, the head's class and layers, the losses), not typed in."""
from __future__ import annotations

import html
import re

import pytest

from helpers.investigation.mtp import (LOSS_AT, POST_NORM, algorithm_text, budget_sentence, loss_text, ranked,
                                       state_line)
from helpers.records import InvestigationDoc
from helpers.views.budget import budget_parts, ladder_frame
from helpers.views.draft_kind import draft_kind
from helpers.views.investigation import facts_frame, load_investigation, page_html
from helpers.views.story import what_ran
from support import ROOT

DATA = ROOT / "tests" / "data" / "mtp_investigation"


@pytest.fixture(scope="module")
def doc() -> InvestigationDoc:
    d = load_investigation(DATA)
    assert d is not None and d.diagnosis["kind"] == "mtp"
    return d


@pytest.fixture(scope="module")
def text(doc) -> str:
    """The page's visible text (tags, scripts and styles dropped)."""
    s = re.sub(r"<(script|style).*?</\1>", "", page_html(doc), flags=re.S)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", s)))


def test_title_and_what_ran_name_the_nextn_head_and_both_algorithms(doc, text):
    head, spec = doc.attach["draft_head"], doc.attach["draft_head"]["spec"]
    assert doc.attach["algorithm"] == spec["algorithm_as_run"] == "EAGLE" and spec["algorithm_requested"] == "NEXTN"
    assert "MTP / NextN head live investigation" in text and "EAGLE-3" not in text
    ran = what_ran(None, None, doc)
    draft = ran.split("; draft ", 1)[1]
    assert draft.startswith(f"{head['class']} ({head['file']}): the target's own NextN / MTP head, {head['layers']} "
                            f"layer ({head['layers_field']} = {head['layers']})")
    assert "8 layers" not in draft.split("; SGLang")[0]          # not the whole target's config
    assert "NEXTN requested, run as EAGLE" in ran and "_resolve_speculative_algorithm_alias" in ran
    facts = dict(zip(facts_frame(doc)["fact"], facts_frame(doc)["value"]))
    assert facts["speculative algorithm"].startswith("NEXTN requested, run as EAGLE")
    assert facts["live prompts compared (diagnosis)"] == str(doc.samples)
    assert facts["live prompts in the acceptance budget"] == str(doc.acceptance["stages"][1]["sequences"])


def test_findings_say_which_state_is_served_against_which_reference(doc, text):
    ident = doc.diagnosis["served_state"]
    (best, err), (second, err2) = ranked(ident)[:2]
    assert best == ident["identified"] == POST_NORM and second != best
    want = (f"No finding: the served hidden state is {best} (rel. error {err:.2g}; runner-up {second} {err2:.2g}), "
            f"the one the NextN head should read")
    assert want in text
    assert f"reference: {doc.reference['how']}" in text
    assert "every served chunk equals its training chunk" not in text


def test_ladder_rows_carry_each_loss_and_no_negative_zero(doc, text):
    b = doc.acceptance
    assert b["losses"]["wiring"]["delta"] == 0.0 and str(b["losses"]["wiring"]["delta"]) == "-0.0"   # the trip
    lad = ladder_frame(b).set_index("stage")
    for loss, stage in LOSS_AT.items():
        v = b["losses"][loss]
        assert lad.loc[stage, "decision"] == v["decision"]
        assert lad.loc[stage, "lost at this stage [95% CI]"] == loss_text(v["delta"], v["ci"])
    assert lad.loc[LOSS_AT["wiring"], "lost at this stage [95% CI]"] == "0.00 [0.00, 0.00]"
    assert lad.loc[LOSS_AT["draft"], "note"] == b["losses"]["draft"]["settle"]["text"]
    assert set(lad["like with like"]) == {"teacher-forced, the log's rows", "drafting chain, live prompts", ""}
    assert "-0.00" not in text
    line = budget_sentence(b)
    assert "wiring loss 0.00 [0.00, 0.00] clear" in line and "-0.00" not in line


def test_loss_text_keeps_a_real_sign_and_drops_a_rounded_one():
    assert loss_text(-0.001, [-0.004, -0.0]) == "0.00 [0.00, 0.00]"
    assert loss_text(-0.05, [-0.08, -0.01]) == "-0.05 [-0.08, -0.01]"
    assert loss_text(None) == ""


def test_state_line_names_the_runner_up_or_the_expected_state(doc):
    ident = doc.diagnosis["served_state"]
    line = state_line(ident)
    assert line.count(POST_NORM) == 2                      # once matched, once inside the runner-up's name
    pre = dict(ident, rel_error={**ident["rel_error"], "out(7)": 4e-7, POST_NORM: 0.44}, identified="out(7)",
               matches=False)
    assert state_line(pre) == ("out(7) (rel. error 4e-07; runner-up norm(norm(out(n-1))) 0.02; "
                               f"{POST_NORM}, what SGLang feeds, 0.44)")


def test_console_attach_algorithm_and_eagle3_kind_unchanged(doc):
    assert algorithm_text("EAGLE", doc.attach["draft_head"]).startswith("NEXTN requested, run as EAGLE (")
    e3 = InvestigationDoc(url="http://x", attach={"algorithm": "EAGLE3", "draft_head": None}, diagnosis={})
    k = draft_kind(e3)
    assert (k.name, k.title, k.algorithm(e3.attach)) == ("eagle3", "EAGLE-3 live investigation", "EAGLE3")
    assert k.no_finding(e3) == "No finding: every served chunk equals its training chunk."
    assert draft_kind(budget=doc.acceptance).mtp and not draft_kind(budget={"stages": []}).mtp


def test_budget_figures_draw_every_stage_of_the_head(doc):
    figs = [p for p in budget_parts(doc.acceptance) if hasattr(p, "data")]
    water = next(f for f in figs if f.data[0].type == "waterfall")
    measured = [s for s in doc.acceptance["stages"] if s["accept_length"] is not None]   # no log: no checkpoint bar
    assert len(measured) == len(doc.acceptance["stages"]) - 1
    assert list(water.data[0].x) == [s["name"] for s in measured]
    assert list(water.data[1].y) == [s["accept_length"] for s in measured]
