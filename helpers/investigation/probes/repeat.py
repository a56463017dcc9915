"""Repeatability (``repeatable``, cheap): the same greedy request answered twice by the server, the prefix cache
emptied before each (:func:`helpers.acceptance.requests.repeatability`). The tool's own computation gives the same
result on the same answers; a server whose greedy tokens or speculative counters move between calls (batch-dependent
kernels, a draft sampling, other clients' requests batched beside ours) can make a decision near its threshold flip
between two runs of the same investigation. Not a loss: the probe has no decision, and when the answers differ its
note says so (the investigation's notes carry it)."""
from __future__ import annotations

from ...acceptance.requests import repeatability
from .base import Probe, ProbeContext, ProbeResult


def _run(ctx: ProbeContext) -> ProbeResult:
    p = REPEATABLE
    rep = repeatability(ctx.client, ctx.prompts[0], max_new_tokens=ctx.max_new_tokens)
    return ProbeResult(p.name, p.cost, p.condition, decision=None, why=rep["note"],
                       evidence={"same": rep["same"], "prompt": rep["prompt"], "answers": rep["answers"]})


REPEATABLE = Probe("repeatable", "cheap", "the same greedy request twice",
                   "does the server answer the same greedy request the same way twice?", _run,
                   applies=lambda ctx: None if ctx.prompts else "no live prompt",
                   estimate_s=lambda ctx: 1.0 + 0.05 * ctx.max_new_tokens,
                   mtp_why="the same greedy request sent twice: nothing of the draft's kind is read")
