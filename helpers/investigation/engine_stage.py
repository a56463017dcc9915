"""The investigation's ``engine state`` stage, one implementation for every draft: the engine-state probes
(:mod:`helpers.investigation.probes`) run on the live server with the acceptance budget's live answers as their cold
arm. The EAGLE-3 stages (:mod:`helpers.investigation.live`) and the MTP / NextN head's
(:func:`helpers.investigation.mtp.investigate_mtp`) both call :func:`run_engine_state` and fold its result into their
budget's engine stage (:func:`helpers.investigation.probes.join_engine_state`). Which probe applies to which draft is
each probe's own declaration (:attr:`helpers.investigation.probes.Probe.mtp`), never a branch here.
"""
from __future__ import annotations

from typing import Any, Optional

from ..acceptance.prompts import load_prompts
from .probes import PARTIAL, ProbeContext, asks_none, run_probes


#: the words that mark the acceptance budget's console line as not final (the engine-state probes join after it)
PROVISIONAL = "provisional, the engine-state probes join next"


def _can_run(r: Any) -> bool:
    """Whether probes can run for the run ``r`` at all: the server reports speculative settings and the run measures
    live requests."""
    return bool((r.att.spec or {}).get("num_steps")) and bool(r.req.live_measure)


def probes_join(r: Any) -> bool:
    """Whether :func:`run_engine_state` will run probes for the run ``r`` (:func:`_can_run`, and
    ``r.req.engine_probes`` asks for some: not ``none``, :func:`helpers.investigation.probes.asks_none`), i.e.
    whether the acceptance budget printed before it is still to change."""
    return _can_run(r) and not asks_none(r.req.engine_probes)


def budget_line(r: Any, text: str) -> str:
    """The acceptance budget's console note ``text`` (its cause and stages), marked ``[`` :data:`PROVISIONAL` ``]``
    when the engine-state probes will join it afterwards (:func:`probes_join`), so that a ``Cause: none`` printed
    before them is not read as the verdict."""
    return f"[{PROVISIONAL}] {text}" if probes_join(r) else text


def final_budget_line(r: Any, budget: Optional[dict]) -> None:
    """Print (``r.progress``) the acceptance budget once the engine-state probes have joined it (``budget``: the
    joined budget, its ``sentence`` recomputed by :func:`helpers.investigation.probes.join_engine_state`); nothing
    for None, nor when no probe was asked for (``--engine-probes none``: the first line, unmarked, was the final one;
    the probes are recorded as not asked for, which changes no decision)."""
    if budget and probes_join(r):
        r.progress("acceptance budget (final, engine-state probes joined): "
                   + (budget.get("sentence") or f"cause {budget.get('cause')}"))


def run_engine_state(r: Any, extra: Optional[dict] = None) -> Optional[dict]:
    """Run the probes ``r.req.engine_probes`` asks for on the server of the run ``r``
    (:class:`helpers.investigation.live.Run`: its attach has run; ``r.live`` the budget's live per-request frame, the
    probes' cold arm, or None) and record them: ``r.doc.engine_state`` and the probes' notes. Returns
    :func:`helpers.investigation.probes.run_probes`'s state, or None with a note when no probe can run (``--no-measure``:
    no live requests; a server without speculative settings).

    Raises: what :func:`run_probes` propagates (the run's deadline, a signal), after recording the probes that
    finished (``r.doc.engine_state``, with why it stopped)."""
    req, doc = r.req, r.doc
    if not _can_run(r):     # --engine-probes none still runs: every probe recorded as not asked for, with why
        doc.notes.append("engine-state probes not run: " + ("--no-measure (no live requests)" if not req.live_measure
                                                            else "the server reports no speculative settings"))
        return None
    t = r.step("engine state")
    ctx = ProbeContext(client=r.client, adapter=r.adapter, att=r.att, run_dir=req.run_dir,
                       prompts=load_prompts(None, n=req.measure_prompts), max_new_tokens=req.max_new_tokens, dl=r.dl,
                       progress=r.progress, api_key=req.api_key, port=req.port, cold=r.live,
                       sampling=req.probe_sampling, extra=dict(extra or {}))
    try:
        state = run_probes(ctx, req.engine_probes)
    except BaseException:
        doc.engine_state = ctx.extra.get(PARTIAL)     # the decisions reached before the stop, with why it stopped
        raise
    doc.engine_state = state
    doc.notes += state["notes"]
    ran = [p for p in state["probes"] if p["status"] == "ran"]
    r.done("engine state", t, ", ".join(f"{p['probe']} {p['decision'] or 'done'}" for p in ran) or "no probe ran")
    return state


__all__ = ["PROVISIONAL", "budget_line", "final_budget_line", "probes_join", "run_engine_state"]
