"""One story: the acceptance budget's cause, the findings, the verdict, the measured fix and the sentence agree.

:func:`reconcile` runs once at the end of an investigation, after every step that measures:

1. A fix that recovers acceptance is a loss of the stages of the findings it addresses
   (:data:`helpers.kinds.KIND_STAGE`): measured on the server (the before / after pair of the relaunch, paired per
   prompt) or proven offline (the drafting chain on the states the fix would feed; the checkpoint with the fix's
   vocab map on the draft stage's rows). Such a loss is decided like any other
   (:func:`helpers.draft.decide.decide`); when it counts and the ladder's own estimate did not, it replaces it (the
   ladder's estimate is kept beside it).
2. The cause is recomputed (:func:`helpers.draft.budget.cause_of`); the sentence is rewritten.
3. Every finding with a stage carries that stage's loss as evidence (``evidence["acceptance"]``); a stage that counts
   without a finding naming it gets the budget's own finding (``draft_underperforms``, ``wiring_loses_acceptance``,
   ...), so a cause is never left without a finding and a finding is never left without its stage's loss.
4. The verdict: ``mismatch`` when a finding stands or a stage counts; ``undecided`` when nothing is found but the
   budget cannot rule out a material loss; ``ok`` only when nothing is found and the cause is ``none``.
"""
from __future__ import annotations

from typing import Optional

from ..diagnosis.detectors import finding
from ..draft.budget import REQUIRED_STAGES, budget_sentence, cause_of
from ..draft.decide import decide, threshold
from ..kinds import KIND_STAGE
from ..records import Finding, InvestigationDoc
from ..runfiles import jsonable

#: cause -> the budget's own finding kind
CAUSE_KINDS = {"draft": "draft_underperforms", "wiring": "wiring_loses_acceptance",
               "engine": "engine_after_capture", "settings": "spec_settings_low",
               "workload": "workload_loses_acceptance"}
VERDICTS = ("ok", "mismatch", "undecided")


def _fix_stages(doc: InvestigationDoc) -> set[str]:
    fix = doc.proposed_fix
    if fix is None:
        return set()
    return {KIND_STAGE[k] for k in (fix.addresses or []) if k in KIND_STAGE}


def _merge(losses: dict, stage: str, new: dict) -> None:
    """Put ``new`` (a loss measured another way) in place of the stage's ladder estimate when it decides more: it
    counts and the ladder's did not. The ladder's estimate is kept under ``ladder``."""
    old = losses.get(stage) or {}
    if old.get("decision") == "counts" or new.get("decision") != "counts":
        old.setdefault("also", []).append({k: new.get(k) for k in ("delta", "ci", "decision", "basis")})
        losses[stage] = old
        return
    losses[stage] = {**new, "ladder": {k: old.get(k) for k in ("delta", "ci", "decision", "basis")}}


def _measured_losses(doc: InvestigationDoc) -> list[tuple[str, dict]]:
    """Losses from the fix: measured on the server, and proven offline."""
    b = doc.acceptance or {}
    stages = _fix_stages(doc)
    out = []
    m = doc.measured or {}
    eff = m.get("effect") or {}
    d, lo, hi = (eff.get(k) for k in ("accept_length_delta", "accept_length_delta_lo", "accept_length_delta_hi"))
    before = (m.get("before") or {}).get("accept_length")
    if stages and d is not None and lo is not None and hi is not None:
        n = eff.get("n_paired")
        dec = decide(d, lo, hi, threshold(before), n=n, unit="prompts")
        for st in stages:
            out.append((st, {"stage": st, "delta": d, "ci": [lo, hi], **dec, "n": n,
                             "counts": dec["decision"] == "counts", "material": d >= dec["threshold"],
                             "beyond_ci": lo > 0,
                             "basis": f"measured: the proposed fix moved live accept length {before:.2f} -> "
                                      f"{(m.get('after') or {}).get('accept_length', float('nan')):.2f}, paired "
                                      f"over {n} prompt(s) (the fix restores what this stage lost)"}))
    fo = b.get("fix_offline") or {}
    if stages & {"wiring"} and fo.get("gain") is not None and None not in (fo.get("gain_ci") or [None]):
        lo, hi = fo["gain_ci"]
        ref = next((s.get("accept_length") for s in b.get("stages", []) if s["name"] == "offline on served states"),
                   None)
        dec = decide(fo["gain"], lo, hi, threshold(ref), n=fo.get("n_paired"))
        out.append(("wiring", {"stage": "wiring", "delta": fo["gain"], "ci": [lo, hi], **dec, "n": fo.get("n_paired"),
                               "counts": dec["decision"] == "counts", "material": fo["gain"] >= dec["threshold"],
                               "beyond_ci": lo > 0,
                               "basis": f"proven offline: {fo['label']} (served plan [{', '.join(fo.get('plan') or [])}"
                                        f"]) run on the every-layer reference accepts {fo['gain']:+.2f} tokens per "
                                        "verify step over the served states, paired per sample"}))
    ds = next((s for s in b.get("stages", []) if s["name"] == "checkpoint (teacher-forced)"), {})
    dfix = ds.get("fix") or {}
    if stages & {"draft"} and dfix.get("gain") is not None:
        lo, hi = dfix["gain_ci"]
        dec = decide(dfix["gain"], lo, hi, threshold(ds.get("log_accept_length")),
                     n=(ds.get("rows") or {}).get("sequences"))
        out.append(("draft", {"stage": "draft", "delta": dfix["gain"], "ci": [lo, hi], **dec,
                              "counts": dec["decision"] == "counts", "material": dfix["gain"] >= dec["threshold"],
                              "beyond_ci": lo > 0,
                              "basis": f"proven offline: the checkpoint with {dfix['label']} ({dfix.get('source')}) "
                                       f"scores {dfix['gain']:+.2f} tokens per verify step more on the draft stage's "
                                       "rows, paired per sequence"}))
    return out


def reconcile(doc: InvestigationDoc, *, budget_expected: bool = False) -> InvestigationDoc:
    """Make the investigation tell one story (module docstring); returns ``doc``, changed in place.

    ``budget_expected``: the acceptance budget was asked for; when it is missing (it could not be computed) nothing
    rules a loss out, so the verdict cannot be ``ok``."""
    b = doc.acceptance
    if b:
        losses = b.setdefault("losses", {})
        for st, loss in _measured_losses(doc):
            _merge(losses, st, loss)
        b["cause"] = cause_of(losses, b.get("required") or REQUIRED_STAGES)
        b["sentence"] = budget_sentence(b)
        doc.acceptance = jsonable(b)
        b = doc.acceptance
        losses = b["losses"]
        # the budget's own finding for a counted cause no other finding names
        named = {KIND_STAGE.get(f.kind) for f in doc.findings if f.kind not in CAUSE_KINDS.values()}
        doc.findings = [f for f in doc.findings if not (f.kind in CAUSE_KINDS.values() and
                                                        f.kind != CAUSE_KINDS.get(b["cause"]))]
        cause = b["cause"]
        if cause in CAUSE_KINDS and cause not in named and not any(f.kind == CAUSE_KINDS[cause]
                                                                  for f in doc.findings):
            ds = next((s for s in b["stages"] if s["name"] == "checkpoint (teacher-forced)"), {})
            doc.findings.append(Finding(**finding(
                CAUSE_KINDS[cause], None, b["sentence"], stage=cause, loss=losses.get(cause),
                stages=[{k: s.get(k) for k in ("name", "accept_length", "ci")} for s in b["stages"]],
                per_step=ds.get("table") if cause == "draft" else None,
                recommended_settings=b.get("recommended_settings"),
                source="the acceptance budget: the draft checkpoint run offline as SGLang runs it (helpers.draft), "
                       "live counters from the same /generate answers")))
        for f in doc.findings:
            st = KIND_STAGE.get(f.kind)
            if st and st in losses:
                l = losses[st]
                f.evidence = {**(f.evidence or {}), "acceptance": {
                    "stage": st, "delta": l.get("delta"), "ci": l.get("ci"), "decision": l.get("decision"),
                    "basis": l.get("basis"), "cause": cause}}
    doc.verdict = verdict(doc, budget_expected=budget_expected)
    return doc


def verdict(doc: InvestigationDoc, *, budget_expected: bool = False) -> Optional[str]:
    """``mismatch`` / ``undecided`` / ``ok`` (module docstring); None before the diagnosis ran."""
    if doc.verdict is None and not doc.findings and not doc.acceptance:
        return None
    if doc.findings:
        return "mismatch"
    if doc.acceptance is None:
        return "undecided" if budget_expected else "ok"
    cause = doc.acceptance.get("cause")
    if cause == "none":
        return "ok"
    return "mismatch" if cause in CAUSE_KINDS else "undecided"


def no_fix_text(doc: InvestigationDoc) -> str:
    """Why nothing is measured when no fix is proposed: "nothing to fix" only when every stage is clear."""
    b = doc.acceptance
    if b is None:
        return "no fix proposed: the served aux states equal the training data; the acceptance budget was not " \
               "computed, so a loss elsewhere is not ruled out"
    cause = b.get("cause")
    if cause == "none":
        return "nothing to fix: the wiring is right and every stage of the acceptance budget rules out a material loss"
    if cause == "undecided":
        return "no fix proposed: the acceptance budget is undecided (a material loss is not ruled out): " + \
            "; ".join(f"{k}: {(v.get('settle') or {}).get('text') or v.get('why', '')}"
                      for k, v in (b.get("losses") or {}).items() if v.get("decision") == "undecided")
    return f"no fix the tool can apply: {STAGE_ADVICE.get(cause, 'see the acceptance budget')}"


#: what to do about a stage's loss when no finding gives a fix the tool can apply
STAGE_ADVICE = {
    "draft": "the draft checkpoint scores below its own training log on rows of the log's kind; serve the checkpoint "
             "the log belongs to (this one is damaged, mis-exported or another run's), then investigate again",
    "wiring": "the served aux states cost acceptance though no wiring finding names why; compare every TP rank "
              "(server start --capture-ranks) and give an every-layer reference, then investigate again",
    "engine": "the engine accepts less than the draft run offline on the very states it fed: the draft is computed "
              "differently after the capture point (draft-side hooks, positions, KV reuse); try the engine toggles "
              "(python -m helpers ablate)",
    "settings": "launch with the recommended speculative settings of the acceptance budget and measure",
    "workload": "the requests, not the server, lose the acceptance (see the workload sweeps)",
}
