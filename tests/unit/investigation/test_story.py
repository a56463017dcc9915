"""helpers.investigation.story: cause, findings, verdict, measured fix and sentence tell one story, for every finding
kind that costs acceptance at a stage of the budget (helpers.kinds.KIND_STAGE)."""
from __future__ import annotations

import pytest

from helpers.draft.budget import REQUIRED_STAGES, _loss, budget_sentence, cause_of
from helpers.investigation.story import CAUSE_KINDS, no_fix_text, reconcile
from helpers.kinds import BY_NAME, KIND_STAGE
from helpers.records import Finding, InvestigationDoc, ProposedFix

LADDER = [{"name": "training log", "accept_length": 2.6}, {"name": "checkpoint (teacher-forced)", "accept_length": 2.6},
          {"name": "offline on training states", "accept_length": 2.7},
          {"name": "offline on served states", "accept_length": 2.7},
          {"name": "offline on live prompts' served states", "accept_length": 2.6}, {"name": "live", "accept_length": 2.6}]
STAGE_KINDS = sorted(k for k, s in KIND_STAGE.items() if s in REQUIRED_STAGES)
WORKLOAD_KINDS = sorted(k for k, s in KIND_STAGE.items() if s == "workload" and k not in CAUSE_KINDS.values())


def _budget(**decisions) -> dict:
    """Every required stage clear unless ``decisions`` says ``counts`` or ``undecided`` for it."""
    losses = {}
    for st in REQUIRED_STAGES:
        d = decisions.get(st, "clear")
        args = {"clear": (0.01, -0.02, 0.04), "counts": (0.6, 0.4, 0.8), "undecided": (0.3, -0.1, 0.7)}[d]
        losses[st] = _loss(st, *args, f"ladder {st}", 2.6, n=16)        # 16 prompts: a nonzero loss can be clear
        assert losses[st]["decision"] == d
    b = {"stages": [dict(s) for s in LADDER], "losses": losses, "required": list(REQUIRED_STAGES),
         "settings": {"steps": 3, "topk": 1, "draft_tokens": 4}, "notes": [], "missing": []}
    b["cause"] = cause_of(losses)
    b["sentence"] = budget_sentence(b)
    return b


def _doc(kind: str, budget: dict, *, measured: dict | None = None, fixed: bool = False) -> InvestigationDoc:
    fix = ProposedFix(kind="config", summary="a fix", addresses=[kind], applicable=True) if fixed else \
        ProposedFix(kind="none", summary="none")
    return InvestigationDoc(verdict="mismatch", findings=[Finding(kind=kind, detail=f"{kind} seen")], acceptance=budget,
                            proposed_fix=fix, measured=measured)


def _measured(delta=0.45, lo=0.3, hi=0.6) -> dict:
    return {"before": {"accept_length": 2.2}, "after": {"accept_length": 2.2 + delta},
            "effect": {"accept_length_delta": delta, "accept_length_delta_lo": lo, "accept_length_delta_hi": hi,
                       "n_paired": 16}}


@pytest.mark.parametrize("kind", STAGE_KINDS)
def test_a_counted_stage_and_its_finding_agree(kind):
    stage = KIND_STAGE[kind]
    doc = reconcile(_doc(kind, _budget(**{stage: "counts"})))
    b = doc.acceptance
    assert b["cause"] == stage and f"Cause: {stage}:" in b["sentence"]
    f = next(f for f in doc.findings if f.kind == kind)
    assert f.evidence["acceptance"]["stage"] == stage and f.evidence["acceptance"]["decision"] == "counts"
    # the finding names the stage's loss: no second finding says the same
    own = [f.kind for f in doc.findings if f.kind == CAUSE_KINDS[stage]]
    assert len(own) == 1 if kind == CAUSE_KINDS[stage] else own == []
    assert doc.verdict == "mismatch"


@pytest.mark.parametrize("kind", [k for k in STAGE_KINDS if KIND_STAGE[k] != "engine"])
def test_a_measured_fix_is_the_loss_of_the_stage_it_addresses(kind):
    """The ladder cannot decide the stage (too few samples), the fix for the finding recovers 0.45 tokens per verify
    step on the server: that is the stage's loss, and the cause."""
    stage = KIND_STAGE[kind]
    doc = reconcile(_doc(kind, _budget(**{stage: "undecided"}), measured=_measured(), fixed=True))
    b = doc.acceptance
    assert b["cause"] == stage, b["sentence"]
    loss = b["losses"][stage]
    assert loss["decision"] == "counts" and loss["delta"] == pytest.approx(0.45) and "measured" in loss["basis"]
    assert loss["ladder"]["decision"] == "undecided"                 # the ladder's own estimate is kept beside it
    f = next(f for f in doc.findings if f.kind == kind)
    assert f.evidence["acceptance"]["decision"] == "counts"
    assert "Cause: " + stage in b["sentence"]


@pytest.mark.parametrize("kind", STAGE_KINDS)
def test_a_finding_whose_stage_loses_nothing_material_says_so(kind):
    doc = reconcile(_doc(kind, _budget()))
    b = doc.acceptance
    assert b["cause"] == "none" and "rules out a material loss" in b["sentence"]
    if kind in CAUSE_KINDS.values():
        # the budget's own finding of an earlier cause contradicts cause none: it goes, and so does the mismatch
        assert doc.findings == [] and doc.verdict == "ok"
        return
    f = next(f for f in doc.findings if f.kind == kind)
    assert f.evidence["acceptance"]["decision"] == "clear"
    # a finding stands (the tensors, config or checkpoint differ), so the verdict is not ok
    assert doc.verdict == "mismatch"


@pytest.mark.parametrize("kind", WORKLOAD_KINDS)
def test_workload_findings_never_become_the_servers_cause(kind):
    doc = reconcile(_doc(kind, _budget()))
    assert doc.acceptance["cause"] == "none" and doc.verdict == "mismatch"


def test_undecided_is_never_ok_nor_nothing_to_fix():
    doc = reconcile(InvestigationDoc(verdict="ok", acceptance=_budget(wiring="undecided"),
                                     proposed_fix=ProposedFix(kind="none")))
    assert doc.verdict == "undecided" and doc.acceptance["cause"] == "undecided"
    assert "not ruled out" in doc.acceptance["sentence"] and "wiring" in doc.acceptance["sentence"]
    assert "nothing to fix" not in no_fix_text(doc) and "undecided" in no_fix_text(doc)
    ok = reconcile(InvestigationDoc(verdict="ok", acceptance=_budget(), proposed_fix=ProposedFix(kind="none")))
    assert ok.verdict == "ok" and "nothing to fix" in no_fix_text(ok)
    # asked for and not computed: nothing rules a loss out
    assert reconcile(InvestigationDoc(verdict="ok"), budget_expected=True).verdict == "undecided"
    assert reconcile(InvestigationDoc(verdict="ok")).verdict == "ok"


def test_every_stage_kind_is_declared_with_a_required_or_workload_stage():
    assert set(KIND_STAGE.values()) <= set(REQUIRED_STAGES) | {"workload"}
    assert set(CAUSE_KINDS.values()) <= set(BY_NAME)
    assert all(KIND_STAGE[k] == s for s, k in CAUSE_KINDS.items())


def test_a_withdrawn_fix_is_said_to_be_withdrawn_not_an_engine_change():
    """A config fix the budget withdrew (its offline proof ruled a material gain out) is not an engine change: the
    run says it was withdrawn (found with a generated fault, config ids [2, 4, 5] on a TP 2 server: the sentence said
    "the fix is a change in the engine's capture path")."""
    from helpers.investigation.live import not_measured

    fix = ProposedFix(kind="config", summary="none proven: ...", applicable=False,
                      draft_config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}})
    doc = _doc("layer_offset", _budget(), fixed=True)
    m = not_measured(doc, fix, withdrawn="the proposed fix ... rules out a material gain", apply_fix=True,
                     measured_by=None, not_applied="", restartable=True)
    assert "withdrawn" in m["not_measured"] and "engine" not in m["not_measured"] and m["withdrawn"], m
    engine = ProposedFix(kind="engine", summary="feed the all-reduced embedding", applicable=False)
    assert "engine's capture path" in not_measured(doc, engine, withdrawn=None, apply_fix=True, measured_by=None,
                                                   not_applied="", restartable=True)["not_measured"]
    applicable = ProposedFix(kind="config", summary="set ids", applicable=True)
    assert not_measured(doc, applicable, withdrawn=None, apply_fix=True, measured_by=None, not_applied="",
                        restartable=True) is None


def test_a_fix_is_withdrawn_only_when_its_offline_proof_rules_a_material_gain_out():
    """The offline proof of a fix on a few training samples: a gain near 0 whose CI still holds a material gain is
    undecided, not "nil" (the fix stays, to be measured); only a CI that rules a material gain out withdraws it."""
    from helpers.draft.decide import decide, threshold
    from helpers.investigation.acceptance import fix_withdrawal

    def fo(gain, lo, hi, n=3):
        return {"label": "the proposed fix", "plan": ["out(1)", "out(3)", "out(4)"], "accept_length": 3.3,
                "gain": gain, "gain_ci": [lo, hi], "n_paired": n,
                "decision": decide(gain, lo, hi, threshold(3.3), n=n)["decision"]}

    assert fix_withdrawal(fo(0.05, -0.3, 0.6)) is None                 # undecided: kept
    assert fix_withdrawal(fo(0.9, 0.5, 1.3)) is None                   # proven: kept
    # a narrow CI on 3 samples rules nothing out (fewer than SMALL_N sequences): kept, to be measured
    assert fo(0.02, -0.05, 0.08)["decision"] == "undecided" and fix_withdrawal(fo(0.02, -0.05, 0.08)) is None
    text = fix_withdrawal(fo(0.02, -0.05, 0.08, n=16))                 # rules a material gain out: withdrawn
    assert text and "[-0.05, +0.08]" in text and "16 sample(s)" in text
    assert fix_withdrawal(None) is None and fix_withdrawal({"gain": None}) is None


def test_a_fix_measured_after_the_investigation_is_the_stage_loss_and_the_headline_says_so():
    """A replay measures the proposed fix at a later step: the stage's loss becomes that measured change even though
    the ladder's offline estimate counted already (kept beside it), telling the story again changes nothing more, and
    the headline's three parts carry the same numbers."""
    from helpers.investigation.story import headline_parts, headline_text, named_text, record_measured_fix

    kind = "embedding_in_place_of_layer"
    doc = reconcile(_doc(kind, _budget(wiring="counts"), measured={"measured_by": "step 7"}, fixed=True))
    assert doc.acceptance["losses"]["wiring"]["delta"] == pytest.approx(0.6)      # the ladder's, until measured
    m = _measured()
    m["before"]["accept_rate"], m["after"]["accept_rate"] = 0.30, 0.56
    record_measured_fix(doc, {**m, "measured_by": "this replay's step 7 ('fix') against step 1 ('as deployed')",
                              "prompts": 16})
    loss = doc.acceptance["losses"]["wiring"]
    assert loss["delta"] == pytest.approx(0.45) and loss["on_server"] and loss["decision"] == "counts"
    assert loss["ladder"]["delta"] == pytest.approx(0.6) and "step 7" in loss["basis"]
    assert doc.acceptance["cause"] == "wiring" and "0.45 tokens per verify step lost at the wiring" in \
        doc.acceptance["sentence"]
    again = reconcile(doc.model_copy(deep=True), budget_expected=True)
    assert again.acceptance["losses"] == doc.acceptance["losses"]
    parts = headline_parts(doc, named=named_text(43.4, 2.5, step=2))
    assert [p["label"] for p in parts] == ["What is wrong", "The fix", "Measured effect"]
    assert "0.45 [0.30, 0.60] tokens per verify step (counts; measured on the server)" in parts[0]["text"]
    assert parts[0]["source"].startswith("named blind in 43.4 s (step 2, wall clock") and "2.5 s after attach" in \
        parts[0]["source"]
    assert parts[1]["text"] == "a fix"
    assert parts[2]["text"] == ("accept rate 30% -> 56%, accept length 2.20 -> 2.65 (+0.45 [+0.30, +0.60] tokens per "
                                "verify step, paired over 16 prompts)")
    assert parts[2]["source"].startswith("this replay's step 7")
    text = headline_text(parts)
    assert text.count("[source: ") == 3 and text.startswith("What is wrong: ")


def test_a_fix_that_leaves_the_effective_settings_gives_the_settings_stage_no_share():
    """The Kimi case's fix: the ids (wiring) and --speculative-num-draft-tokens 4, which SGLang already ran in place of
    the 16 asked (num_draft_tokens_overridden, settings stage). Both sides ran steps 3, topk 1, 4 draft tokens, so the
    measured +0.68 is the wiring stage's loss only; the settings stage keeps the ladder's own estimate (clear) and no
    flag says its 'measured' loss misses that estimate."""
    from helpers.investigation.story import record_measured_fix, same_effective_settings

    kinds = ["embedding_in_place_of_layer", "num_draft_tokens_overridden"]
    doc = InvestigationDoc(verdict="mismatch", findings=[Finding(kind=k, detail=k) for k in kinds],
                           acceptance=_budget(wiring="counts"),
                           proposed_fix=ProposedFix(kind="config", summary="ids and flag", addresses=kinds,
                                                    applicable=True))
    m = _measured(0.68, 0.50, 0.87)
    for side in ("before", "after"):
        m[side].update(num_steps=3, topk=1, num_draft_tokens=4)
    assert same_effective_settings(m)
    record_measured_fix(doc, {**m, "measured_by": "step 9 against step 1", "prompts": 16})
    losses = doc.acceptance["losses"]
    assert losses["wiring"]["delta"] == pytest.approx(0.68) and losses["wiring"]["on_server"]
    assert losses["settings"]["decision"] == "clear" and not losses["settings"].get("on_server")
    assert losses["settings"]["delta"] == pytest.approx(0.01)
    assert doc.acceptance["cause"] == "wiring"
    # the same fix where the flag did change what ran (8 draft tokens at topk 2): both stages get the measured change
    m2 = _measured(0.68, 0.50, 0.87)
    m2["before"].update(num_steps=3, topk=1, num_draft_tokens=4)
    m2["after"].update(num_steps=3, topk=2, num_draft_tokens=8)
    assert not same_effective_settings(m2)
    doc2 = InvestigationDoc(verdict="mismatch", findings=[Finding(kind=k, detail=k) for k in kinds],
                            acceptance=_budget(wiring="counts"),
                            proposed_fix=ProposedFix(kind="config", summary="ids and flag", addresses=kinds,
                                                     applicable=True))
    record_measured_fix(doc2, {**m2, "measured_by": "step 9 against step 1", "prompts": 16})
    assert doc2.acceptance["losses"]["settings"]["delta"] == pytest.approx(0.68)
    assert doc2.acceptance["losses"]["settings"]["on_server"]
    # a measurement without recorded settings (older records) is attributed as before
    assert not same_effective_settings(_measured())


def test_sweeps_run_only_for_stages_the_requests_decide_and_a_stale_note_goes_when_a_stage_counts():
    """investigate's automatic workload sweeps: an undecided wiring or draft stage (too few training samples) is not
    settled by sweeping the requests, an undecided engine stage is; join_ablation's "no stage loses a material share"
    note (written while nothing counted) is dropped once the measured fix makes a stage count."""
    from helpers.draft.budget import NO_STAGE_COUNTS, join_ablation, sweeps_can_settle

    for stage, want in (("wiring", False), ("draft", False), ("settings", False), ("engine", True)):
        assert sweeps_can_settle(_budget(**{stage: "undecided"})) is want, stage
    assert not sweeps_can_settle(_budget()) and not sweeps_can_settle(_budget(engine="counts"))
    b = join_ablation(_budget(wiring="undecided"), [{"kind": "context_loses_acceptance", "detail": "falls past 190"}])
    assert b["cause"] == "undecided" and b["notes"][-1].startswith(NO_STAGE_COUNTS)
    doc = reconcile(_doc("layer_offset", b, measured=_measured(), fixed=True))
    assert doc.acceptance["cause"] == "wiring"
    assert not any(n.startswith(NO_STAGE_COUNTS) for n in doc.acceptance["notes"]), doc.acceptance["notes"]


def test_naming_time_leaves_out_the_restart_that_measures_the_fix():
    """An investigate page's "named blind in" is the wall clock to the fix and the budget: the engine-state probes,
    the user's requests, the workload sweeps and the relaunch come after naming and are left out (and said to be)."""
    from helpers.investigation.story import named_text, naming_seconds

    doc = InvestigationDoc(wall_s=121.6, seconds_to_verdict=1.3,
                           timings={"attach": 2.0, "acceptance budget": 12.7, "engine state": 15.0, "workload": 5.0,
                                    "relaunch": 64.8, "workload sweeps": 5.0})
    secs, out = naming_seconds(doc)
    assert secs == pytest.approx(31.8) and out == pytest.approx(89.8)
    text = named_text(secs, doc.seconds_to_verdict, left_out=out)
    assert text.startswith("in 31.8 s (") and "the 89.8 s of the steps after it (engine-state probes" in text
    assert naming_seconds(InvestigationDoc(wall_s=20.0))[0] == 20.0 and naming_seconds(InvestigationDoc()) == (None, 0.0)


def test_the_facts_say_how_many_training_samples_each_part_used():
    """The diagnosis compared 4 training samples; the budget's wiring stage grew to 16: the facts table gives both
    (it said 'training samples compared: 4' while the budget ran on 16)."""
    from helpers.views.investigation import facts_frame

    budget = {"stages": [{"name": "offline on training states", "sequences": 16},
                         {"name": "offline on served states", "sequences": 16}]}
    doc = InvestigationDoc(verdict="ok", samples=4, acceptance=budget)
    f = facts_frame(doc).set_index("fact")["value"]
    assert f["training samples compared (diagnosis)"] == "4"
    assert f["training samples in the acceptance budget"] == "16"
