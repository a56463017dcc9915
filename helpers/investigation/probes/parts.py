"""The acceptance budget's engine stage split into its parts (:data:`helpers.investigation.probes.base.ENGINE_PARTS`:
verification, the draft's computation, the served weights, cache state), each decided from the engine-state probes
that speak to it, as every budget stage is decided (``counts`` / ``clear`` / ``undecided``), or ``not measured`` with
why (no probe of it ran: not asked for, the server cannot be restarted, no trace hooks).

A part's decision:

* ``counts``: a probe of it counts (its loss, the largest of them, with its CI; a check without an accept-length
  loss, such as greedy losslessness, counts without one);
* ``undecided``: no probe of it counts, and one ran ``undecided`` (its CI holds a material loss and none);
* ``clear``: every probe of it that ran is ``clear`` (its CI rules a material loss out in that condition); the row
  says which probes it rests on (``rests_on``, each with its caveat in ``why``) and which of the part's probes did not
  run (``not_run``), so a part cleared by one probe is not read as cleared by all;
* ``not measured``: none ran with a decision: skipped or ``failed`` (no evidence either way; why is said), or the
  perfect-draft oracle alone (a floor, not a decision: its figure is kept as ``floor``).

The cold comparison (the draft run offline on the states the server fed, against the server's counters for the same
cold greedy answers: the engine stage as the budget measures it before any probe) is the first row, ``cold greedy``:
the parts say what else was looked at, so an engine stage ``clear`` on cold greedy prompts is read with the parts it
did not measure beside it (the budget's sentence: :func:`helpers.draft.budget.engine_parts_text`).
"""
from __future__ import annotations

from typing import Optional

from .base import ENGINE_PARTS

#: the cold comparison's row name
COLD = "cold greedy"


def engine_parts(state: dict, cold: Optional[dict]) -> list[dict]:
    """The engine stage's parts from the probes' results (``state`` of :func:`helpers.investigation.probes.run_probes`)
    and the budget's own cold engine loss ``cold`` (``losses["engine"]`` before the probes join, or None).

    Returns ``[{"part", "question", "decision", "probes": [names], "delta", "ci", "why", "floor"?}, ...]``: the cold
    comparison first, then one per :data:`ENGINE_PARTS` in order; ``delta`` / ``ci`` in tokens per verify step lost
    (positive = lost), None for a part without an accept-length loss."""
    rows = []
    if cold is not None:
        rows.append({"part": COLD, "question": "does the served draft, inside the engine, accept what it accepts run "
                                               "offline on the states the server fed (cold cache, greedy)?",
                     "decision": cold.get("decision") or "undecided", "probes": [],
                     "delta": cold.get("delta"), "ci": list(cold.get("ci") or [None, None]),
                     "why": (cold.get("settle") or {}).get("text") or cold.get("why") or cold.get("basis")})
    results = [r for r in state.get("probes") or [] if r.get("part")]
    for part, question in ENGINE_PARTS.items():
        mine = [r for r in results if r["part"] == part]
        rows.append({"part": part, "question": question, "probes": [r["probe"] for r in mine], **_decide(mine)})
    return rows


def _decide(mine: list[dict]) -> dict:
    ran = [r for r in mine if r.get("status") == "ran"]
    decided = [r for r in ran if r.get("decision")]
    counted = [r for r in decided if r["decision"] == "counts"]
    out: dict = {"delta": None, "ci": [None, None]}
    floor = next((r for r in ran if (r.get("evidence") or {}).get("floor")), None)
    if floor is not None:          # the perfect-draft oracle: what verification and KV lose whatever the draft does
        ev, f = floor["evidence"], floor["evidence"]["floor"]
        out["floor"] = {"probe": floor["probe"], "accept_length": ev.get("oracle_accept_length"),
                        "perfect": ev.get("perfect_accept_length"), "lost": f.get("delta"), "ci": f.get("ci")}
    if counted:
        best = max(counted, key=lambda r: ((r.get("loss") or {}).get("delta") or 0.0))
        loss = best.get("loss") or {}
        return {**out, "decision": "counts", "delta": loss.get("delta"), "ci": list(loss.get("ci") or [None, None]),
                "why": f"{best['probe']} ({best['condition']}) counts" + (
                    "" if loss else ": a fault the accept length does not measure (see its finding)")}
    open_ = [r for r in decided if r["decision"] == "undecided"]
    if open_:
        r = open_[0]
        settle = ((r.get("loss") or {}).get("settle") or {}).get("text") or r.get("why") or "more prompts"
        return {**out, "decision": "undecided", "why": f"{r['probe']} ({r['condition']}) undecided: {settle}"}
    if decided:
        best = max(decided, key=lambda r: ((r.get("loss") or {}).get("delta") or 0.0))
        loss = best.get("loss") or {}
        # a clear part says what it rests on: each deciding probe with its own caveat (SGLang on CPU verifies with the
        # argmax at every temperature: sampled_verify then checks the greedy verify), and the part's probes not run
        said = [f"{r['probe']} ({r['condition']}) clear" + (f" ({r['why']})" if r.get("why") else "") for r in decided]
        missing = [r for r in mine if r.get("status") != "ran"]
        if missing:
            said.append("not run: " + ", ".join(f"{r['probe']} ({r.get('why') or r.get('status')})" for r in missing))
        return {**out, "decision": "clear", "delta": loss.get("delta"), "ci": list(loss.get("ci") or [None, None]),
                "why": "; ".join(said), "rests_on": [r["probe"] for r in decided],
                "not_run": [r["probe"] for r in missing]}
    whys = [f"{r['probe']}: {r.get('why') or r.get('status')}" for r in mine if r.get("status") != "ran"]
    return {**out, "decision": "not measured",
            "why": "; ".join(whys) if whys else ("no probe of this part ran" if not ran else
                                                 "its probes give a figure, not a decision")}


__all__ = ["COLD", "engine_parts"]
