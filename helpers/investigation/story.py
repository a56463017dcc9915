"""One story: the acceptance budget's cause, the findings, the verdict, the measured fix and the sentence agree.

:func:`reconcile` runs once at the end of an investigation, after every step that measures:

1. A fix that recovers acceptance is a loss of the stages of the findings it addresses
   (:data:`helpers.kinds.KIND_STAGE`): measured on the server (the before / after pair of the relaunch, paired per
   prompt) or proven offline (the drafting chain on the states the fix would feed; the checkpoint with the fix's
   vocab map on the draft stage's rows). Such a loss is decided like any other
   (:func:`helpers.draft.decide.decide`); when it counts and the ladder's own estimate did not, it replaces it (the
   ladder's estimate is kept beside it). A fix that left the effective speculative settings as they were (it only
   requests what SGLang already ran) gives the settings stage no share of a change measured on the server.
2. The cause is recomputed (:func:`helpers.draft.budget.cause_of`); the sentence is rewritten.
3. Every finding with a stage carries that stage's loss as evidence (``evidence["acceptance"]``); a stage that counts
   without a finding naming it gets the budget's own finding (``draft_underperforms``, ``wiring_loses_acceptance``,
   ...), so a cause is never left without a finding and a finding is never left without its stage's loss.
4. The verdict: ``mismatch`` when a finding stands or a stage counts; ``undecided`` when nothing is found but the
   budget cannot rule out a material loss; ``ok`` only when nothing is found and the cause is ``none``.

:func:`record_measured_fix` is the same story when the fix is measured after the investigation by someone else (a
replay's later step): the measurement is put into the record and :func:`reconcile` runs again, so the stage's loss is
the fix's measured effect. :func:`headline_parts` tells the story in three parts (what is wrong, the fix, its measured
effect), each with its source: the postmortem's headline and the replay's.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from ..acceptance.stats import format_ci
from ..diagnosis.detectors import finding
from ..draft.budget import NO_STAGE_COUNTS, REQUIRED_STAGES, budget_sentence, cause_of
from ..draft.decide import decide, threshold
from ..kinds import ACCEPTANCE_KINDS, BY_NAME, KIND_STAGE, kind_words
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


def _brief(loss: dict) -> dict:
    return {k: loss.get(k) for k in ("delta", "ci", "decision", "basis")}


def _merge(losses: dict, stage: str, new: dict, *, on_server: bool = False) -> None:
    """Put ``new`` (a loss measured another way) in the stage's place when it decides more: it counts and the
    ladder's estimate did not; a loss measured **on the server** (the fix's before / after over the same prompts)
    that counts is the stage's loss whatever the ladder said: it is the direct measurement of what the fix restored.
    The ladder's estimate is kept under ``ladder``, other estimates under ``also``. Idempotent: a loss merged before
    (same basis) is not merged again (reconcile runs again after a later measurement)."""
    old = losses.get(stage) or {}
    if old.get("basis") == new.get("basis") or any(a.get("basis") == new.get("basis") for a in old.get("also") or []):
        return
    if new.get("decision") == "counts" and (on_server or old.get("decision") != "counts"):
        also = list(old.get("also") or [])
        if old.get("ladder"):                         # a replacement before this one: kept beside
            also.append(_brief(old))
        losses[stage] = {**new, "on_server": on_server, "also": also,
                         "ladder": old.get("ladder") or (_brief(old) if old else None)}
        return
    old.setdefault("also", []).append(_brief(new))
    losses[stage] = old


#: the effective speculative settings of a measurement (helpers.acceptance summaries)
SPEC_FIELDS = ("num_steps", "topk", "num_draft_tokens")


def same_effective_settings(measured: dict) -> bool:
    """The fix's before and after ran the same effective speculative settings (every field of :data:`SPEC_FIELDS`
    recorded on both sides and equal): e.g. a fix that only requests the draft tokens SGLang already ran
    (``num_draft_tokens_overridden`` with topk 1)."""
    a, b = (measured or {}).get("before") or {}, (measured or {}).get("after") or {}
    return all(a.get(k) is not None and a.get(k) == b.get(k) for k in SPEC_FIELDS)


def _measured_losses(doc: InvestigationDoc) -> list[tuple[str, dict, bool]]:
    """Losses from the fix: ``(stage, loss, measured on the server)``, measured on the server first, then proven
    offline. The settings stage gets no share of a measured change when the fix left the effective settings as they
    were (:func:`same_effective_settings`): the change came from the fix's other parts."""
    b = doc.acceptance or {}
    stages = _fix_stages(doc)
    out = []
    m = doc.measured or {}
    eff = m.get("effect") or {}
    d, lo, hi = (eff.get(k) for k in ("accept_length_delta", "accept_length_delta_lo", "accept_length_delta_hi"))
    before = (m.get("before") or {}).get("accept_length")
    on_server = stages - {"settings"} if same_effective_settings(m) else stages
    if on_server and d is not None and lo is not None and hi is not None:
        n = eff.get("n_paired")
        dec = decide(d, lo, hi, threshold(before), n=n, unit="prompts",
                     per_sequence=eff.get("accept_length_per_prompt"))
        for st in sorted(on_server):
            where = f" ({m['measured_by']})" if m.get("measured_by") else ""
            out.append((st, {"stage": st, "delta": d, **dec, "n": n,
                             "counts": dec["decision"] == "counts", "material": d >= dec["threshold"],
                             "beyond_ci": dec["ci"][0] > 0,
                             "basis": f"measured{where}: the proposed fix moved live accept length {before:.2f} -> "
                                      f"{(m.get('after') or {}).get('accept_length', float('nan')):.2f}, paired "
                                      f"over {n} prompt(s) (the fix restores what this stage lost)"}, True))
    fo = b.get("fix_offline") or {}
    if stages & {"wiring"} and fo.get("gain") is not None and None not in (fo.get("gain_ci") or [None]):
        lo, hi = fo["gain_ci"]
        ref = next((s.get("accept_length") for s in b.get("stages", []) if s["name"] == "offline on served states"),
                   None)
        dec = decide(fo["gain"], lo, hi, threshold(ref), n=fo.get("n_paired"), unit="training samples",
                     per_sequence=fo.get("gain_per_sequence"))
        out.append(("wiring", {"stage": "wiring", "delta": fo["gain"], **dec, "n": fo.get("n_paired"),
                               "counts": dec["decision"] == "counts", "material": fo["gain"] >= dec["threshold"],
                               "beyond_ci": dec["ci"][0] > 0,
                               "basis": f"proven offline: {fo['label']} (served plan [{', '.join(fo.get('plan') or [])}"
                                        f"]) run on the every-layer reference accepts {fo['gain']:+.2f} tokens per "
                                        "verify step over the served states, paired per sample"}, False))
    ds = next((s for s in b.get("stages", []) if s["name"] == "checkpoint (teacher-forced)"), {})
    dfix = ds.get("fix") or {}
    if stages & {"draft"} and dfix.get("gain") is not None:
        lo, hi = dfix["gain_ci"]
        dec = decide(dfix["gain"], lo, hi, threshold(ds.get("log_accept_length")),
                     n=(ds.get("rows") or {}).get("sequences"), per_sequence=dfix.get("gain_per_sequence"))
        out.append(("draft", {"stage": "draft", "delta": dfix["gain"], **dec,
                              "counts": dec["decision"] == "counts", "material": dfix["gain"] >= dec["threshold"],
                              "beyond_ci": dec["ci"][0] > 0,
                              "basis": f"proven offline: the checkpoint with {dfix['label']} ({dfix.get('source')}) "
                                       f"scores {dfix['gain']:+.2f} tokens per verify step more on the draft stage's "
                                       "rows, paired per sequence"}, False))
    return out


def draft_residual(b: dict) -> Optional[dict]:
    """The draft stage's loss that the proposed fix's vocab map leaves: when the checkpoint with it (the draft stage's
    ``fix``: the same rows, paired) still scores a material loss below its training log beyond the CI (the upper
    bound short of the log by more than :func:`helpers.draft.decide.threshold`), ``{"label", "accept_length", "ci",
    "log"}``: the checkpoint itself is below its log (damaged, mis-exported or another run's), whatever its d2t.
    None otherwise."""
    ds = next((s for s in b.get("stages", []) if s.get("name") == "checkpoint (teacher-forced)"), {})
    fx, log = ds.get("fix") or {}, ds.get("log_accept_length")
    ci = fx.get("ci") or [None, None]
    if log is None or fx.get("accept_length") is None or ci[1] is None or log - ci[1] < threshold(log):
        return None
    return {"label": fx.get("label"), "accept_length": fx["accept_length"], "ci": list(ci), "log": log}


def reconcile(doc: InvestigationDoc, *, budget_expected: bool = False) -> InvestigationDoc:
    """Make the investigation tell one story (module docstring); returns ``doc``, changed in place.

    ``budget_expected``: the acceptance budget was asked for; when it is missing (it could not be computed) nothing
    rules a loss out, so the verdict cannot be ``ok``."""
    b = doc.acceptance
    if b:
        losses = b.setdefault("losses", {})
        for st, loss, on_server in _measured_losses(doc):
            _merge(losses, st, loss, on_server=on_server)
        b["cause"] = cause_of(losses, b.get("required") or REQUIRED_STAGES)
        b["sentence"] = budget_sentence(b)
        if b["cause"] in CAUSE_KINDS:               # a stage counts now (e.g. the fix measured): that note is stale
            b["notes"] = [n for n in b.get("notes") or [] if not n.startswith(NO_STAGE_COUNTS)]
        doc.acceptance = jsonable(b)
        b = doc.acceptance
        losses = b["losses"]
        # the budget's own finding for a counted cause no other finding names
        named = {KIND_STAGE.get(f.kind) for f in doc.findings if f.kind not in CAUSE_KINDS.values()}
        doc.findings = [f for f in doc.findings if not (f.kind in CAUSE_KINDS.values() and
                                                        f.kind != CAUSE_KINDS.get(b["cause"]) and
                                                        not (f.evidence or {}).get("residual"))]
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
        _add_draft_residual(doc, b, named)
        for f in doc.findings:
            st = KIND_STAGE.get(f.kind)
            if st and st in losses:
                l = losses[st]
                f.evidence = {**(f.evidence or {}), "acceptance": {
                    "stage": st, "delta": l.get("delta"), "ci": l.get("ci"), "decision": l.get("decision"),
                    "basis": l.get("basis"), "cause": cause}}
    doc.verdict = verdict(doc, budget_expected=budget_expected)
    return doc


def _add_draft_residual(doc: InvestigationDoc, b: dict, named: set) -> None:
    """A finding that names the draft stage (a d2t unlike the training data's) does not hide a checkpoint that is
    below its log anyway: ``draft_underperforms`` for the loss its fix leaves (:func:`draft_residual`), once."""
    res = draft_residual(b) if "draft" in named else None
    if res is None or any(f.kind == "draft_underperforms" for f in doc.findings):
        return
    by = ", ".join(sorted(f.kind for f in doc.findings if KIND_STAGE.get(f.kind) == "draft"))
    doc.findings.append(Finding(**finding(
        "draft_underperforms", None,
        f"the checkpoint with {res['label']} still scores {_ci_text(res['accept_length'], res['ci'])} tokens per "
        f"verify step on the draft stage's rows where its training log says {res['log']:.2f}: {by} does not explain "
        "the draft stage's loss; the checkpoint itself is below its log (damaged, mis-exported or another run's)",
        stage="draft", residual=True, fixed=res, loss=(b.get("losses") or {}).get("draft"),
        source="the acceptance budget's draft stage: the checkpoint teacher-forced on rows of its log's kind, with "
               "the proposed fix's vocab map (helpers.draft.draft_stage)")))


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
    if _workload_counts(doc) is not None:
        return ("no fix the tool can apply: the loss is on your requests (requests_accept_less), measured against "
                "training-like prompts on the same server; the observed differences it names (template, temperature, "
                "length, language) are where to look, not proven causes")
    if b is None:
        return "no fix proposed: the served aux states equal the training data; the acceptance budget was not " \
               "computed, so a loss elsewhere is not ruled out"
    cause = b.get("cause")
    if cause == "none":
        return ("nothing to fix: the wiring is right and every stage of the acceptance budget rules out a material loss"
                + _unmeasured(b.get("losses") or {}))
    if cause == "undecided":
        return "no fix proposed: the acceptance budget is undecided (a material loss is not ruled out): " + \
            "; ".join(f"{k}: {(v.get('settle') or {}).get('text') or v.get('why', '')}"
                      for k, v in (b.get("losses") or {}).items() if v.get("decision") == "undecided")
    probe = ((b.get("losses") or {}).get(cause) or {}).get("probe")
    if probe:                 # the loss was measured by an engine-state probe: its finding says the mechanism
        f = next((x for x in doc.findings if (x.evidence or {}).get("condition") == probe), None)
        k = BY_NAME.get(f.kind) if f is not None else None
        if k is not None and k.engine_fix:
            return f"no fix the tool can apply ({f.kind}, engine-state probe {probe}): {k.engine_fix}"
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


def record_measured_fix(doc: InvestigationDoc, measurement: dict, *, budget_expected: bool = True) -> InvestigationDoc:
    """The proposed fix measured after the investigation (a replay's step that applies it): ``measurement`` =
    ``{"measured_by": str, "before": summary, "after": summary, "effect": paired_effect(...), "prompts": int,
    "saved_to": [before, after], "speed": helpers.acceptance.machine.speed_change(...)}`` replaces ``doc.measured``
    (its ``measured_by`` says who measured), then :func:`reconcile` makes the stage's loss the measured change (the
    ladder's estimate kept beside it). Returns ``doc``, changed in place; the caller rewrites the sentence."""
    doc.measured = {**(doc.measured or {}), **measurement}
    return reconcile(doc, budget_expected=budget_expected)


#: the ``investigation.json`` ``diagnosis.kind`` of the single-state drafts (the NextN / MTP head on SGLang, EAGLE-1
#: on vLLM: :mod:`helpers.investigation.mtp`), whose served state is compared with the target's every-layer reference
#: (``doc.reference["how"]``: the server's own every-layer capture, else HF transformers), not with training data
SINGLE_STATE_KINDS = ("mtp", "eagle1")

#: what ``InvestigationDoc.seconds_to_verdict`` waits for, per ``diagnosis.kind``: the single-state path sets it after
#: the acceptance budget and the engine-state probes (``helpers/investigation/mtp.py::investigate_mtp``), the EAGLE-3
#: path right after the diagnosis (``helpers/investigation/live.py``); other kinds: :data:`VERDICT_DEFAULT`
VERDICT_WAITS = {k: "the verdict (set once the acceptance budget and the engine-state probes are in)"
                 for k in SINGLE_STATE_KINDS}
VERDICT_DEFAULT = "the diagnosis's verdict (served vs training tensors, before the acceptance budget)"


def verdict_words(doc: Any) -> str:
    """What ``doc.seconds_to_verdict`` measures, in words (:data:`VERDICT_WAITS` by ``doc.diagnosis["kind"]``)."""
    return VERDICT_WAITS.get(((getattr(doc, "diagnosis", None) or {}).get("kind")), VERDICT_DEFAULT)


def reference_source(doc: Any) -> Optional[str]:
    """The reference a single-state draft's served state was compared with, in words (``doc.reference["how"]``);
    None for the other kinds (their reference is the training data)."""
    if ((getattr(doc, "diagnosis", None) or {}).get("kind")) not in SINGLE_STATE_KINDS:
        return None
    how = (getattr(doc, "reference", None) or {}).get("how")
    return ("served hidden state vs the target's every-layer reference ("
            + (how if how and how != "none" else "none recorded") + ")")


def provenance(f: Finding, doc: Any = None) -> str:
    """Where a finding's identities come from, in words (its evidence; with ``doc`` of a single-state draft, the
    reference for a state finding (:func:`reference_source`), the finding's own ``source`` for the others)."""
    ev = f.evidence or {}
    if ev.get("static"):
        return "configs + the serving engine's rules"
    if doc is not None and (ref := reference_source(doc)) is not None:
        # a state finding (rel_error against the reference's candidates) names the reference; another finding of a
        # single-state run (the steps check, the head's weights) names its own source
        return ref if "rel_error" in ev or not isinstance(ev.get("source"), str) else ev["source"]
    if "reference" in json.dumps(ev, default=str) or ev.get("identified_as"):
        return "served tensors vs training data and the every-layer reference"
    return "served tensors vs training data"


#: the investigation's steps that come after naming the fault (a relaunch measures the fix; sweeps and ablations
#: explain the workload): left out of the time it took to name it
#: the steps of an investigation after the fault is named and the budget computed: the engine-state probes, the
#: user's requests (--requests), the workload sweeps and the relaunch that measures the fix
AFTER_NAMING = ("engine state", "workload", "workload sweeps", "relaunch")


def naming_seconds(doc: InvestigationDoc, wall_s: Optional[float] = None) -> tuple[Optional[float], float]:
    """``(seconds, left out)``: the investigation's wall-clock seconds (``wall_s``, default its own: a replay passes
    its step's) without the steps after the fault was named (:data:`AFTER_NAMING`), from its recorded step timings,
    and the seconds taken out; ``(None, 0)`` without a wall time."""
    wall = doc.wall_s if wall_s is None else wall_s
    if wall is None:
        return None, 0.0
    after = sum(float(v) for k, v in (doc.timings or {}).items() if k in AFTER_NAMING)
    return max(0.0, float(wall) - after), after


def named_text(wall_s: Optional[float], seconds_to_verdict: Optional[float], *, step: Optional[int] = None,
               left_out: float = 0.0, verdict: str = VERDICT_DEFAULT) -> str:
    """How long naming the fault took, with its clock: the wall-clock time of the whole investigation (attach to the
    proposed fix and the acceptance budget; a replay's step time as the console prints it), and when the diagnosis's
    verdict came within it (``InvestigationDoc.seconds_to_verdict``: monotonic seconds from attach). ``left_out``:
    seconds of the steps after naming already taken out of ``wall_s`` (:func:`naming_seconds`), said when any.
    ``verdict``: what ``seconds_to_verdict`` waited for (:func:`verdict_words` of the doc)."""
    where = f"step {step}, " if step is not None else ""
    if wall_s is None:
        return "" if seconds_to_verdict is None else f"({verdict} came {seconds_to_verdict:.1f} s after attach)"
    verdict = (f"; {verdict} came {seconds_to_verdict:.1f} s after attach"
               if seconds_to_verdict is not None else "")
    out = (f"; the {left_out:.1f} s of the steps after it (engine-state probes, your requests, sweeps, the restart "
           "that measures the fix) left out" if left_out >= 0.05 else "")
    return f"in {wall_s:.1f} s ({where}wall clock from attach to the proposed fix and acceptance budget{out}{verdict})"


def _ci_text(v: Any, ci: Any, *, signed: bool = False) -> str:
    """``v [lo, hi]`` through the one CI formatter (:func:`helpers.acceptance.stats.format_ci`)."""
    lo, hi = (list(ci) + [None, None])[:2] if ci else (None, None)
    r = [None if x is None else round(float(x), 2) + 0.0 for x in (v, lo, hi)]     # no "-0.00"
    return format_ci({"x": r[0], "x_lo": r[1], "x_hi": r[2]}, "x", signed=signed)


def stage_loss_text(loss: Optional[dict]) -> str:
    """``1.13 [0.43, 1.54] tokens per verify step (counts; measured on the server)`` for one stage's loss."""
    if not loss or loss.get("delta") is None:
        return ""
    how = "measured on the server" if loss.get("on_server") else "estimated offline"
    return f"{_ci_text(loss['delta'], loss.get('ci'))} tokens per verify step ({loss.get('decision')}; {how})"


def measured_text(m: Optional[dict]) -> tuple[str, str]:
    """The measured effect of the fix and its source: ``("accept rate 19% -> 47%, accept length 1.92 -> 2.61 (+0.69
    [+0.5, +0.8] tokens per verify step, paired over 16 prompts)", "...")``; ``("not measured: why", "")``."""
    m = m or {}
    b, a, e = m.get("before") or {}, m.get("after") or {}, m.get("effect") or {}
    if not (b and a and e):
        if m.get("measured_by"):
            return f"measured by {m['measured_by']}", ""
        return f"not measured: {m.get('not_measured') or m.get('error') or 'no measurement'}", ""
    d = e.get("accept_length_delta")
    paired = (f" ({format_ci(e, 'accept_length_delta', signed=True)} tokens per verify step, paired over "
              f"{e.get('n_paired')} prompts)") if d is not None else ""
    rate = (f"accept rate {b['accept_rate']:.0%} -> {a['accept_rate']:.0%}, "
            if b.get("accept_rate") is not None and a.get("accept_rate") is not None else "")
    text = f"{rate}accept length {b['accept_length']:.2f} -> {a['accept_length']:.2f}{paired}"
    src = m.get("measured_by") or ("the investigation's before / after on the same prompts, on the server as served "
                                   "and on a restarted copy with the fix")
    if m.get("saved_to"):
        src += f" ({', '.join(m['saved_to'])})"
    return text, src


def headline_parts(doc: InvestigationDoc, *, named: str = "") -> list[dict]:
    """The story in three parts, each ``{"label", "text", "source"}``: what is wrong (the first finding the fix
    addresses, else the budget's cause, with the stage's loss), the fix (the proposal and where it comes from), its
    measured effect (:func:`measured_text`). ``named``: how long naming it took (:func:`named_text`)."""
    b = doc.acceptance or {}
    losses = b.get("losses") or {}
    wiring = [x for x in doc.findings if x.kind not in ACCEPTANCE_KINDS]
    parts = []
    if wiring:
        f = wiring[0]
        where = "" if f.chunk is None or f.kind in ("layer_offset", "chunk_order") else f", chunk {f.chunk}"
        cost = stage_loss_text(losses.get(KIND_STAGE.get(f.kind, "")))
        text = f"{kind_words(f.kind, f.evidence)} ({f.kind}{where}): {f.detail}"
        if cost:
            text += f"; the {KIND_STAGE[f.kind]} stage of the acceptance budget loses {cost}"
        more = [k for k in dict.fromkeys(x.kind for x in wiring[1:]) if k != f.kind]
        src = f"{provenance(f, doc)}" + (f"; also found: {', '.join(more)}" if more else "")
    elif (wl := _workload_counts(doc)) is not None:
        text = f"your requests accept materially less than training-like prompts ({wl.kind}): {wl.detail}"
        src = provenance(wl, doc)
    elif b.get("cause") in CAUSE_KINDS:
        c = b["cause"]
        part = next((p for p in (losses.get(c) or {}).get("parts") or [] if p["decision"] == "counts"
                     and p["part"] != "cold greedy"), None)
        text = (f"acceptance is lost at the {c} stage" + (f" ({part['part']}: {part['why']})" if part else "")
                + f": {stage_loss_text(losses.get(c))}")
        src = (losses.get(c) or {}).get("basis") or "the acceptance budget"
    elif doc.verdict is not None:
        served = ("the served hidden state is the one the draft reads, norm(out(n-1))"
                  if (doc.diagnosis or {}).get("kind") in ("mtp", "eagle1") else
                  "the served aux states equal the training data")          # a single-state draft: no training data
        text = {"ok": f"no fault: {served} and every stage of the acceptance "
                      "budget rules out a material loss" + _unmeasured(losses),
                "undecided": "no fault found, but the acceptance budget cannot rule out a material loss"}.get(
            doc.verdict, "no wiring fault found")
        src = "the acceptance budget" if b else (reference_source(doc) or "served tensors vs training data")
    else:
        text, src = doc.error or "the investigation did not reach a verdict", ""
    if named:
        src = f"named blind {named}; " + src if src else f"named blind {named}"
    parts.append({"label": "What is wrong", "text": text, "source": src})
    fix = doc.proposed_fix
    if fix is not None and fix.kind != "none":
        parts.append({"label": "The fix", "text": fix.summary, "source": "; ".join(fix.why) or fix.kind})
    else:
        parts.append({"label": "The fix", "text": no_fix_text(doc), "source": ""})
    text, src = measured_text(doc.measured)
    parts.append({"label": "Measured effect", "text": text, "source": src})
    return parts


def _workload_counts(doc: InvestigationDoc):
    """The ``requests_accept_less`` finding (``--requests``) when its loss counts, else None."""
    return next((x for x in doc.findings if x.kind == "requests_accept_less"
                 and (x.evidence or {}).get("decision") == "counts"), None)


def _unmeasured(losses: dict) -> str:
    """The engine stage's parts no probe measured (``losses.engine.parts``), as a clause: what an ``ok`` did not look
    at ("" when every part was measured or there are no parts)."""
    left = [p["part"] for p in (losses.get("engine") or {}).get("parts") or [] if p["decision"] == "not measured"]
    return f" (engine parts not measured: {', '.join(left)})" if left else ""


def headline_text(parts: list[dict]) -> str:
    """:func:`headline_parts` as one plain-text headline (sources in brackets)."""
    out = []
    for p in parts:
        t = p["text"].rstrip(".")
        out.append(f"{p['label']}: {t}" + (f" [source: {p['source']}]" if p.get("source") else "") + ".")
    return " ".join(out)
