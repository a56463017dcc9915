"""Engine-state probes: where a server that accepts well when freshly probed loses accepted tokens in production.

The acceptance budget (:mod:`helpers.draft.budget`) measures a server the way a fresh start sees it: short greedy
prompts, the prefix cache flushed before each. Accepted tokens are also lost where that never looks: the draft's KV
after a prefix-cache hit, chunked prefill boundaries, verification that is not lossless, the served draft's weights
after lifecycle events (``served_draft``, ``step_trace``: the served draft's proposals step by step against its
checkpoint's, :mod:`.trace`). Each such question is one :class:`Probe` of :data:`PROBES`, run by the investigation's
``engine state`` stage (:func:`run_probes`; ``investigate --engine-probes cheap|all|none``), never a branch in it:

* ``cheap`` probes run on the live server itself (a few more requests: seconds on the embedded server);
* ``restart`` probes start a copy of the server with other flags (``--chunked-prefill-size``, speculation off)
  within the run's restart budget, only with ``--engine-probes all`` and only when the tool can restart the server.

On a server drafting with an MTP / NextN head (SGLang ``NEXTN``: :func:`.base.on_mtp_head`) each probe's own
:attr:`Probe.mtp` says whether it applies as is, with the head run offline, or not at all (then it is skipped with its
``mtp_why``, which cites the engine's code); the runner reads that declaration, the investigation never branches.

A probe's result is one :class:`ProbeResult`: a condition's accept length against the cold one, paired per prompt
and decided like every budget stage (:func:`helpers.draft.decide.decide`: ``counts`` / ``clear`` / ``undecided``),
or a check with a decision of its own (greedy losslessness); its findings name the condition and the evidence.
:func:`join_engine_state` folds the results into the budget's engine stage: the engine stage is the worst of its
parts (a counted probe loss is the engine loss, measured on the server; an undecided probe keeps an otherwise clear
engine stage open), so the cause, the sentence and the verdict follow (``investigation.story.reconcile``).
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

from ...draft.budget import REQUIRED_STAGES, budget_sentence, cause_of
from ...errors import AuthError, BadInput, CacheBusy, EndpointMissing, RequestRejected, ServerError, ServerTimeout
from ...runfiles import jsonable
from .base import (CHOICES, ENGINE_PARTS, MTP_USES, Probe, ProbeContext, ProbeResult, on_mtp_head,
                   paired_condition_loss)
from .cache import CHUNKED_PREFILL, RADIX_HIT
from .hicache import HICACHE_HIT
from .integrity import INVARIANT_CHECK, KV_CANARY
from .lossless import GREEDY_LOSSLESS
from .oracle import ORACLE
from .parts import engine_parts
from .repeat import REPEATABLE
from .sampled import SAMPLED_VERIFY
from .trace import SERVED_DRAFT, STEP_TRACE, reconcile

#: every probe, in the order they run (cheap first)
PROBES: tuple[Probe, ...] = (REPEATABLE, SERVED_DRAFT, STEP_TRACE, RADIX_HIT, SAMPLED_VERIFY, CHUNKED_PREFILL,
                               HICACHE_HIT, GREEDY_LOSSLESS, ORACLE, KV_CANARY, INVARIANT_CHECK)


def probes() -> tuple[Probe, ...]:
    """Every probe, in the order they run (cheap first)."""
    return tuple(sorted(PROBES, key=lambda p: 0 if p.cost == "cheap" else 1))


def asks_none(which: str) -> bool:
    """Whether the ``--engine-probes`` value ``which`` (:data:`CHOICES`) asks for no probe at all (``none``: every
    probe is recorded as not asked for, none runs)."""
    return which == "none"


def check_choice(which: str) -> str:
    """``which`` if it is one of :data:`CHOICES`; else BadInput naming ``--engine-probes``."""
    if which not in CHOICES:
        raise BadInput(f"expected one of {', '.join(CHOICES)}, got {which!r}", field="--engine-probes")
    return which


#: seconds every probe leaves of the run's deadline (``--timeout``) after its own estimate: the run's end (the
#: report, a restarted copy's stop, the run folder's last writes) is never cut by a probe that overran. A probe
#: starts only when the time left is at least its estimate plus this; ``investigate --check-draft`` refuses a
#: ``--timeout`` below the cheapest check probe's need up front (:func:`least_timeout`).
RESERVE_S = 60.0


#: server errors that are answers (a request refused, an endpoint missing, the cache busy, no key): the server works
#: and the probe could not run on it, so with ``server_errors`` they stay the probe's ``failed``
ANSWERED = (RequestRejected, EndpointMissing, CacheBusy, AuthError)


def least_timeout(names: Sequence[str], ctx: object) -> float:
    """The smallest run deadline (s) under which at least one of the probes ``names`` can start: the least
    :attr:`Probe.estimate_s` of them on ``ctx`` (``prompts``, ``max_new_tokens``) plus :data:`RESERVE_S`."""
    return RESERVE_S + min(p.estimate_s(ctx) for p in PROBES if p.name in names)


def run_probes(ctx: ProbeContext, which: str = "cheap", only: Optional[Sequence[str]] = None, *,
               server_errors: bool = False) -> dict:
    """Run the probes ``which`` asks for (:data:`CHOICES`) and return ``{"asked": which, "probes": [ProbeResult
    JSON, ...], "findings": [...], "seconds": total}``; every probe not run is listed ``skipped`` with why.
    ``only``: the names of the probes to consider (``investigate --check-draft``: ``served_draft``, ``step_trace``);
    the others are neither run nor listed (BadInput for a name no probe has).

    A probe's own failure (a restarted copy that does not start, a request the server refuses) is ``failed`` with
    its one-line reason and the others still run; the run's deadline running out (``ServerTimeout``) or a signal
    propagates, and with ``server_errors`` a :class:`helpers.errors.ServerError` that is no answer (not one of
    :data:`ANSWERED`: unreachable, 5xx, a malformed answer) too (``--check-draft``: a server that fails is exit 1,
    not an undecided check). The probes that finished are left in ``ctx.extra[PARTIAL]`` with why it stopped when
    a signal or the deadline stops the run."""
    check_choice(which)
    names = {p.name for p in PROBES}
    if only is not None and not set(only) <= names:
        raise BadInput(f"no such engine-state probe: {', '.join(sorted(set(only) - names))} (known: "
                       f"{', '.join(sorted(names))})", field="probes")
    out, t_all = [], time.monotonic()
    try:
        for p in probes():
            if only is not None and p.name not in only:
                continue
            res = _one(p, ctx, which, server_errors)
            out.append(res.to_json())
            ctx.progress(f"engine state: {probe_line(out[-1])} ({res.seconds:.1f} s)")
    except BaseException as exc:      # a signal or the run's deadline: the probes that finished are kept, said so
        ctx.extra[PARTIAL] = {**_state(which, reconcile(out), t_all),
                              "stopped": f"{type(exc).__name__}: {exc}"[:400]}
        raise
    return _state(which, reconcile(out), t_all)


#: the key of :attr:`ProbeContext.extra` under which :func:`run_probes` leaves the probes that finished when a signal
#: or the run's deadline stops it (``stopped``: why); the caller records them (an interrupted investigation keeps
#: every decision it reached)
PARTIAL = "partial_state"


def _state(which: str, out: list[dict], t_all: float) -> dict:
    findings = [f for r in out for f in r["findings"]]
    notes = [f"engine state: {r['probe']}: {r['why']}" for r in out
             if r["status"] in ("ran", "failed") and r.get("why")]
    return {"asked": which, "probes": out, "findings": findings, "notes": notes,
            "seconds": round(time.monotonic() - t_all, 2)}


def _f(x: float) -> str:
    return f"{0.0 if abs(x) < 0.005 else x:.2f}"          # no "-0.00" for an identity


def _loss_text(loss: Optional[dict]) -> str:
    if not loss or loss.get("delta") is None:
        return ""
    lo, hi = (list(loss.get("ci") or []) + [None, None])[:2]
    ci = "" if lo is None or hi is None else f" [{_f(lo)}, {_f(hi)}]"
    return f", {_f(loss['delta'])}{ci} tokens per verify step lost"


def _one(p: Probe, ctx: ProbeContext, which: str, server_errors: bool = False) -> ProbeResult:
    skip = None
    if p.mtp == "no" and on_mtp_head(ctx):     # first: on a head no --engine-probes value runs it (not "all runs it")
        skip = f"does not apply to an MTP / NextN head: {p.mtp_why}"
    elif asks_none(which) or (which == "cheap" and p.cost == "restart"):
        skip = (f"not asked for (--engine-probes {which}; " +
                ("--engine-probes cheap runs it)" if p.cost == "cheap" else "--engine-probes all runs it: it "
                 "restarts a copy of the server)"))
    elif p.cost == "restart" and getattr(ctx.att, "restart", None) is None:
        skip = ("this server cannot be restarted by the tool (start it with `python -m helpers server start` or "
                "pass --relaunch)")
    else:
        skip = p.applies(ctx)
    if skip is None:
        left = ctx.dl.remaining()
        need = p.estimate_s(ctx)
        if left is not None and left - RESERVE_S < need:
            skip = (f"{max(0.0, left):.0f} s left of the run (--timeout); it needs about {need:.0f} s plus the "
                    f"{RESERVE_S:.0f} s every probe leaves for the run's end")
    if skip is not None:
        return ProbeResult(p.name, p.cost, p.condition, status="skipped", why=skip, part=p.part)
    t = time.monotonic()
    ctx.dl.check(f"before the engine-state probe {p.name}")
    try:
        res = p.run(ctx)
    except ServerTimeout:
        raise                                        # the run's own deadline: not this probe's failure
    except (ServerError, BadInput) as exc:
        if server_errors and isinstance(exc, ServerError) and not isinstance(exc, ANSWERED):
            raise
        res = ProbeResult(p.name, p.cost, p.condition, status="failed", why=str(exc).splitlines()[0][:400])
    res.seconds = round(time.monotonic() - t, 2)
    res.part = p.part
    if on_mtp_head(ctx) and res.status == "ran":       # how it ran on the head, with the engine's code that says so
        res.evidence["mtp"] = {"use": p.mtp, "why": p.mtp_why}
    return res


def join_engine_state(b: Optional[dict], state: dict) -> Optional[dict]:
    """Fold the probes' results (:func:`run_probes`) into the budget ``b`` (returned, changed in place) as parts of
    its engine stage: ``b["engine_state"] = state``; a probe loss that counts and is larger than the engine stage's
    own counted loss becomes ``b["losses"]["engine"]`` (``on_server``: measured on the server, its basis naming the
    condition); when no engine loss counts and a probe that ran is ``undecided``, an engine stage that was ``clear``
    becomes ``undecided`` with that probe's settle text (the cold measurement does not rule out a loss the condition
    may show). The engine loss carries its parts (``parts``: :func:`helpers.investigation.probes.parts.engine_parts`:
    the cold comparison, verification, the draft's computation, the served weights, cache state, each decided or
    ``not measured`` with why). The cause and the sentence are recomputed. A budget of None is returned as is (the findings carry the
    probes' evidence alone)."""
    if not b:
        return b
    b["engine_state"] = state
    losses = b.setdefault("losses", {})
    engine = dict(losses.get("engine") or {})
    cold = {k: v for k, v in engine.items() if k != "parts"} if engine else None
    ran = [r for r in state.get("probes") or [] if r.get("status") == "ran" and r.get("decision")]
    counted = [r for r in ran if r["decision"] == "counts"]
    best = max(counted, key=lambda r: (r.get("loss") or {}).get("delta") or 0.0, default=None)
    if best is not None:
        own = engine.get("delta") if engine.get("decision") == "counts" else None
        pl = best.get("loss")
        if pl is not None and pl.get("delta") is not None and (own is None or pl["delta"] > own):
            losses["engine"] = {**pl, "stage": "engine", "on_server": True, "probe": best["probe"],
                                "basis": f"measured on the server, {best['condition']}: {pl.get('basis', '')}",
                                "cold": {k: engine.get(k) for k in ("delta", "ci", "decision")}}
        elif pl is None and engine.get("decision") != "counts":
            # a check without an accept-length loss (greedy losslessness): the engine stage cannot be clear
            losses["engine"] = {**engine, "decision": "undecided", "counts": False, "probe": best["probe"],
                                "settle": {"n": None, "text": f"{best['probe']} found a fault the accept length does "
                                                              "not measure: see its finding"}}
    elif engine.get("decision") == "clear":
        open_ = [r for r in ran if r["decision"] == "undecided"]
        if open_:
            r = open_[0]
            settle = ((r.get("loss") or {}).get("settle") or {}).get("text") or r.get("why") or "more prompts"
            losses["engine"] = {**engine, "decision": "undecided", "counts": False, "probe": r["probe"],
                                "settle": {"n": None, "text": f"{r['probe']} ({r['condition']}) undecided: {settle}"}}
    if losses.get("engine") is not None:
        losses["engine"]["parts"] = engine_parts(state, (cold or {}).get("cold") or cold)
    b["cause"] = cause_of(losses, b.get("required") or REQUIRED_STAGES)
    b["sentence"] = budget_sentence(b)
    return jsonable(b)


def probe_line(r: dict) -> str:
    """One probe's result (:meth:`ProbeResult.to_json`) in a line: name, condition, decision with its loss (or its
    note when it has no decision), or why it was not run."""
    if r.get("status") == "ran":
        done = {True: "the same answer and counters twice", False: "the answers moved"}.get(
            (r.get("evidence") or {}).get("same"), "done")          # a check without a decision says what it saw
        return f"{r['probe']} ({r['condition']}): {r['decision'] or r.get('why') or done}{_loss_text(r.get('loss'))}"
    return f"{r['probe']} ({r['condition']}): {r['status']}: {r.get('why')}"


__all__ = ["ANSWERED", "CHOICES", "ENGINE_PARTS", "MTP_USES", "PARTIAL", "RESERVE_S", "Probe", "ProbeContext",
           "ProbeResult", "asks_none", "check_choice", "engine_parts", "join_engine_state", "least_timeout", "on_mtp_head",
           "paired_condition_loss", "probe_line", "probes", "run_probes"]
