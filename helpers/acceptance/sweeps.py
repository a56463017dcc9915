"""Workload sweeps on a running server, no restart: accept length / accept rate / per-position acceptance and tok/s
against the context length, the sampling temperature and the number of requests in flight, on the same prompts.

Each point is one :func:`helpers.acceptance.measure.measure` (the radix cache flushed first, so every point prefills
its whole prompt) with bootstrap CIs over requests; every point is compared with the sweep's reference point (the
shortest context, temperature 0, one request in flight) by :func:`helpers.acceptance.stats.paired_effect`, paired
on the prompt ids, which every point keeps: point k of the context sweep is prompt i with a longer prefix.

A point falls when its paired accept-length change has a CI wholly below zero and is material (at least
``MIN_TOKENS`` tokens per verify step and ``MATERIAL`` of the reference): :func:`trend` turns a sweep into that
verdict, and says where the fall begins (e.g. past the draft's ``max_position_embeddings``: the draft config's
rotary table ends there; SGLang 0.5.23 refuses such a draft unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1``,
``sglang/srt/configs/model_config.py::ModelConfig._derive_context_length``, which is how deployments run them).

What the public reports this mirrors measured: acceptance against context length (vllm-project/speculators#684:
accept length 2.30 at 2k tokens, 1.08 at 20k; vllm-project/vllm#48894: a draft with max_position 2048), against
temperature (vllm-project/vllm#40551: strict acceptance near 20 % at temperature 1) and against batch size
(NVIDIA/TensorRT-LLM#4168).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..budget import Budget
from ..errors import BadInput, ServerTimeout
from ..runfiles import jsonable
from .measure import AcceptanceResult, measure
from .prompts import Prompt, load_prompts
from .stats import format_ci, paired_effect

SWEEPS = ("context", "temperature", "concurrency")
#: a fall counts when it is at least this many tokens per verify step ...
MIN_TOKENS = 0.1
#: ... and at least this share of the reference point's accept length
MATERIAL = 0.08
#: the longest context a default context sweep reaches (tokens), whatever the target allows
DEFAULT_MAX_CONTEXT = 16384
#: kept from each point's summary (the rest is in the saved measurement)
SUMMARY_KEYS = ("accept_length", "accept_length_lo", "accept_length_hi", "accept_rate", "accept_rate_lo",
                "accept_rate_hi", "tok_s", "tok_s_lo", "tok_s_hi", "throughput_tok_s", "n_requests", "n_failed",
                "wall_s")


@dataclasses.dataclass
class Point:
    """One measured (or skipped) point of a sweep.

    ``value``: context length in tokens (prompt + generated, the last position reached, mean over requests),
    temperature, or requests in flight. ``summary``: :data:`SUMMARY_KEYS` of the measurement (accept length in
    tokens per verify step with the bonus token, accept rate as a fraction, ``tok_s`` per request with its CI,
    ``throughput_tok_s`` all generated tokens over the point's wall time); ``positions``:
    per-position acceptance (fraction of verify steps accepting position k); ``effect``: the paired change against
    the reference point (:func:`paired_effect`); ``result``: the measurement itself (not serialised)."""

    sweep: str
    value: float
    label: str
    summary: dict = dataclasses.field(default_factory=dict)
    positions: list = dataclasses.field(default_factory=list)
    effect: Optional[dict] = None
    prompt_tokens: Optional[float] = None
    max_position: Optional[int] = None
    skipped: Optional[str] = None
    result: Optional[AcceptanceResult] = dataclasses.field(default=None, repr=False)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("result")
        return jsonable(d)


# ------------------------------------------------------------------------------------------------ context prompts

def with_prefix(prompts: Sequence[Prompt], filler: Sequence[Prompt], *, chars: int = 0, tokens: int = 0
                ) -> list[Prompt]:
    """``prompts`` each behind a prefix cut from ``filler``: for a text prompt the other filler texts (never its own,
    unless it is the only one), joined and repeated up to ``chars`` characters, then a blank line; for a token prompt
    ``tokens`` ids from the filler's ids (cycled). The prompt ids are kept (points of a context sweep pair on them)."""
    texts = [p.text for p in filler if p.text is not None]
    ids = [t for p in filler if p.input_ids is not None for t in p.input_ids]
    out = []
    for i, p in enumerate(prompts):
        if p.text is not None:
            others = [t for t in texts if t != p.text] or texts
            if chars <= 0 or not others:
                out.append(p)
                continue
            unit = " ".join(others[(i + k) % len(others)] for k in range(len(others)))
            pre = " ".join([unit] * (chars // (len(unit) + 1) + 1))[:chars]   # one join, not a copy per repeat
            out.append(dataclasses.replace(p, text=pre + "\n\n" + p.text))
        else:
            if tokens <= 0:
                out.append(p)
                continue
            pool = ids or list(p.input_ids)
            start = (i * 97) % len(pool)
            pre = [pool[(start + k) % len(pool)] for k in range(tokens)]
            out.append(dataclasses.replace(p, input_ids=tuple(pre) + tuple(p.input_ids)))
    return out


def context_points(reference: float, limits: dict, *, max_new_tokens: int, count: int = 4,
                   max_context: int = DEFAULT_MAX_CONTEXT) -> list[int]:
    """The context lengths (tokens: prompt + generated) to measure beyond the ``reference`` (the prompts as they are).

    With a draft limit below the target's, two points sit on either side of it (0.75x and 1.5x), then the ladder goes
    on up to the target's limit; otherwise a geometric ladder of ``count`` points up to the target's limit (or
    ``max_context``), the last at 90 % of it. Points closer than 1.3x to each other or to the reference are merged."""
    hi = min(x for x in (limits.get("target"), max_context) if x)
    hi = int(hi * 0.9)
    pts: list[float] = []
    draft = limits.get("draft")
    if draft and draft < hi:
        pts += [0.75 * draft, 1.5 * draft]
    lo = max(reference * 2, (pts[-1] * 2) if pts else 0)
    if lo < hi:
        k = max(1, count - len(pts))
        pts += list(np.geomspace(lo, hi, k)) if k > 1 else [hi]
    out: list[int] = []
    for p in sorted(pts):
        p = int(round(p))
        if p < reference * 1.3 or p <= max_new_tokens + 1 or p > hi:
            continue
        if out and p < out[-1] * 1.3:
            continue
        out.append(p)
    return out


# ------------------------------------------------------------------------------------------------ running

def _point(sweep: str, value: float, label: str, res: AcceptanceResult) -> Point:
    s = res.summary
    pr = res.per_request
    ok = pr[pr["error"].isna()]
    pt = float(ok["prompt_tokens"].mean()) if len(ok) and ok["prompt_tokens"].notna().any() else None
    mp = int((ok["prompt_tokens"].fillna(0) + ok["completion_tokens"].fillna(0)).max()) if len(ok) else None
    pos = []
    if res.positions is not None and len(res.positions):
        pos = [{k: (None if v is None or (isinstance(v, float) and not math.isfinite(v)) else v)
                for k, v in r.items()} for r in res.positions.to_dict("records")]
    return Point(sweep=sweep, value=value, label=label, summary={k: s.get(k) for k in SUMMARY_KEYS},
                 positions=pos, prompt_tokens=pt, max_position=mp, result=res)


def run_sweep(client, sweep: str, *, prompts: Sequence[Prompt], max_new_tokens: int = 48, budget: Budget,
              limits: Optional[dict] = None, temperatures: Sequence[float] = (0.0, 1.0),
              concurrency: Sequence[int] = (1, 2, 4, 8), contexts: Optional[Sequence[int]] = None,
              max_context: int = DEFAULT_MAX_CONTEXT, progress: Callable[[str], None] = lambda s: None,
              on_point: Optional[Callable[[Point], None]] = None) -> list[Point]:
    """Measure one sweep; the first point is the reference. A point whose expected time (the previous point's wall
    time, scaled by its size) does not fit in ``budget`` is skipped with the reason, before its prompts are built;
    a context beyond the target's (``limits["target"]``: SGLang refuses longer inputs) is skipped with that reason;
    what was measured is kept.

    Args:
        client: :class:`helpers.server.client.SGLangClient` of the running server.
        sweep: one of :data:`SWEEPS`.
        prompts: the prompts every point sends (the same ids at every point).
        limits: ``{"target": tokens, "draft": tokens}`` (context sweep; either may be None).
        temperatures / concurrency / contexts: the values (contexts: prompt + generated tokens; default
            :func:`context_points`).
        on_point: called with each point as soon as it is measured or skipped (to save it before the sweep ends: a
            run cut short by a signal or a server failure keeps it).

    Returns: the points, measured and skipped, reference first. Raises BadInput on an unknown sweep.
    """
    if sweep not in SWEEPS:
        raise BadInput(f"unknown sweep {sweep!r}; expected one of {', '.join(SWEEPS)}", field="--sweeps")
    plan: list[tuple[float, str, dict]] = []
    if sweep == "temperature":
        vals = sorted(dict.fromkeys(float(t) for t in ([0.0] + list(temperatures))))
        plan = [(t, f"temperature {t:g}", {"temperature": t}) for t in vals]
    elif sweep == "concurrency":
        vals = sorted(dict.fromkeys(int(c) for c in ([1] + list(concurrency)) if int(c) >= 1))
        plan = [(c, f"{c} in flight", {"concurrency": c}) for c in vals]
    else:
        plan = [(0.0, "as given", {"prefix": 0})]
    points: list[Point] = []
    last_cost = None   # seconds per generated token of the last point
    i = 0
    while i < len(plan):
        value, label, how = plan[i]
        i += 1
        est = None
        if last_cost is not None:
            est = last_cost * len(prompts) * (max_new_tokens + how.get("extra_tokens", 0) / 8) / how.get("concurrency", 1)
        left = budget.remaining()
        why = None
        if how.get("beyond"):
            why = how["beyond"]
        elif left is not None and (left <= 0 or (est is not None and est > left)):
            why = f"budget: {max(0.0, left):.0f} s left" + (f", the point needs ~{est:.0f} s" if est is not None else "")
        if why is not None:
            points.append(Point(sweep=sweep, value=value, label=label, skipped=why))
            progress(f"{sweep}: {label}: skipped ({why})")
            if on_point is not None:
                on_point(points[-1])
            continue
        ps = list(prompts)
        if "prefix" in how and how["prefix"]:
            ps = with_prefix(prompts, prompts, chars=how["prefix"], tokens=how.get("tokens", 0))
        t0 = time.perf_counter()
        try:
            res = measure(client, ps, max_new_tokens=max_new_tokens, concurrency=how.get("concurrency", 1),
                          temperature=how.get("temperature", 0.0), label=f"{sweep} {label}", progress=False, seed=0)
        except ServerTimeout:
            if not budget.spent():
                raise
            points.append(Point(sweep=sweep, value=value, label=label, skipped="budget: spent while it was measured"))
            progress(f"{sweep}: {label}: cut short (the budget ran out while it was measured)")
            continue
        p = _point(sweep, value, label, res)
        wall = time.perf_counter() - t0
        last_cost = wall / max(1, len(ps) * max_new_tokens) * how.get("concurrency", 1)
        if sweep == "context":
            p.value = float(p.prompt_tokens or 0) + max_new_tokens
            if not points:   # the reference: now that its token count is known, plan the longer contexts
                toks_per_char = _tokens_per_char(prompts, res)
                targets = list(contexts) if contexts else context_points(p.value, limits or {},
                                                                         max_new_tokens=max_new_tokens,
                                                                         max_context=max_context)
                top = (limits or {}).get("target")
                for c in targets:
                    extra = max(0, int(c - p.value))
                    if extra <= 0:
                        continue
                    if top and c > top:
                        plan.append((float(c), f"~{c} tokens", {"beyond": f"beyond the target's context length {top} "
                                                                 f"(the server refuses longer inputs)"}))
                        continue
                    plan.append((float(c), f"~{c} tokens", {"prefix": int(extra / toks_per_char) if toks_per_char
                                                             else extra, "tokens": extra, "extra_tokens": extra}))
            p.label = f"{p.value:.0f} tokens" if points else f"as given ({p.value:.0f} tokens)"
        if points:
            p.effect = paired_effect(points[0].result.per_request, res.per_request)
        points.append(p)
        if on_point is not None:
            on_point(p)
        progress(f"{sweep}: {p.label}: accept length {_f(p.summary.get('accept_length'))} "
                 f"[{_f(p.summary.get('accept_length_lo'))}, {_f(p.summary.get('accept_length_hi'))}], "
                 f"tok/s {_f(p.summary.get('tok_s'), 1)} ({wall:.1f} s)")
    return points


def _tokens_per_char(prompts: Sequence[Prompt], res: AcceptanceResult) -> Optional[float]:
    """Prompt tokens per character of the text prompts, from the server's own ``prompt_tokens``."""
    pr = res.per_request
    chars = {p.id: len(p.text) for p in prompts if p.text is not None}
    ok = pr[pr["prompt_id"].isin(list(chars)) & pr["prompt_tokens"].notna()]
    n = sum(chars[i] for i in ok["prompt_id"])
    return float(ok["prompt_tokens"].sum()) / n if n else None


def _f(x: Any, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


# ------------------------------------------------------------------------------------------------ verdicts

def falls(p: Point, reference: Point) -> bool:
    """True when ``p``'s paired accept-length change is wholly below zero and material."""
    e = p.effect or {}
    d, hi = e.get("accept_length_delta"), e.get("accept_length_delta_hi")
    ref = reference.summary.get("accept_length")
    if d is None or hi is None or ref is None or not all(math.isfinite(x) for x in (d, hi, ref)):
        return False
    return hi < 0 and -d >= max(MIN_TOKENS, MATERIAL * ref)


def trend(points: Sequence[Point], limits: Optional[dict] = None) -> Optional[dict]:
    """The sweep's verdict when acceptance falls at its later points, else None.

    A fall counts when the last measured point falls (:func:`falls`) against the reference: acceptance is lost at
    that end of the sweep, not at one noisy point in the middle. Returns ``{"sweep", "first_falling", "value",
    "delta", "ci", "reference_accept_length", "at_accept_length", "last_ok", "past_draft_limit"}`` where
    ``first_falling`` is the label of the first point from which every later measured point falls, ``last_ok`` the
    label of the point before it, and ``past_draft_limit`` (context sweep) the draft's ``max_position_embeddings``
    when the fall begins past it and the last point that holds lies within it."""
    measured = [p for p in points if p.skipped is None and p.result is not None]
    if len(measured) < 2:
        return None
    ref = measured[0]
    if not falls(measured[-1], ref):
        return None
    k = len(measured) - 1
    while k > 1 and falls(measured[k - 1], ref):
        k -= 1
    first, last = measured[k], measured[-1]
    out = {"sweep": first.sweep, "first_falling": first.label, "value": first.value,
           "delta": last.effect["accept_length_delta"],
           "ci": [last.effect["accept_length_delta_lo"], last.effect["accept_length_delta_hi"]],
           "at": last.label, "reference": ref.label,
           "reference_accept_length": ref.summary.get("accept_length"),
           "at_accept_length": last.summary.get("accept_length"), "last_ok": measured[k - 1].label,
           "last_ok_value": measured[k - 1].value, "past_draft_limit": None}
    draft = (limits or {}).get("draft")
    if first.sweep == "context" and draft:
        held = measured[k - 1].max_position
        if (first.max_position or 0) > draft and (held or 0) <= draft * 1.05:
            out["past_draft_limit"] = int(draft)
    return jsonable(out)


def steps_sweep_verdict(points: Sequence[dict]) -> Optional[dict]:
    """What a ``num_steps`` sweep measured, in one rule for every place that says it (the console's replay line, the
    replay CLI, the sweep figure, the timeline, the postmortem's settings line): the point with the highest mean tok/s
    is ``fastest`` only when its tok/s CI lies above every other point's (``lo > hi``); otherwise the sweep cannot tell
    them apart and names no num_steps.

    ``points``: the sweep's points (``helpers.records.SweepStep.points``), each ``{num_steps, tok_s, tok_s_lo,
    tok_s_hi, ...}`` (tok/s in output tokens per second; a point without ``tok_s`` is left out). Returns ``{"fastest":
    int | None, "highest_mean": int, "apart": bool, "ci": bool (every point has a CI), "points": [the measured
    points], "text": str, "label": str}`` (``label``: the short form for figures, ``"fastest num_steps=2"`` or
    ``"num_steps not distinguishable"``), or None with no measured point. ``text``: ``"num_steps=2 fastest, its tok/s CI above
    every other point's (num_steps=2: 37.3 [34.6, 40.1]; num_steps=3: 30.8 [27.9, 34.3])"``, or ``"num_steps 2 and 3
    not distinguishable: their tok/s CIs overlap (...)"``; with one point, what it measured."""
    pts = [p for p in points if p.get("tok_s") is not None]
    if not pts:
        return None
    best = max(pts, key=lambda p: p["tok_s"])
    others = [p for p in pts if p is not best]
    has_ci = all(p.get("tok_s_lo") is not None and p.get("tok_s_hi") is not None for p in pts)
    apart = bool(others) and has_ci and all(best["tok_s_lo"] > o["tok_s_hi"] for o in others)
    each = "; ".join(f"num_steps={p['num_steps']}: {format_ci(p, 'tok_s', digits=1)}"
                     for p in sorted(pts, key=lambda p: p["num_steps"]))
    if not others:
        text = f"one point measured ({each})"
    elif apart:
        text = f"num_steps={best['num_steps']} fastest, its tok/s CI above every other point's ({each})"
    else:
        names = sorted(p["num_steps"] for p in pts)
        listed = ", ".join(map(str, names[:-1])) + f" and {names[-1]}"
        why = "their tok/s CIs overlap" if has_ci else "not every point has a tok/s CI"
        text = f"num_steps {listed} not distinguishable: {why} ({each})"
    label = (f"fastest num_steps={best['num_steps']}" if apart else
             f"num_steps={best['num_steps']} measured" if not others else "num_steps not distinguishable")
    return {"fastest": best["num_steps"] if apart else None, "highest_mean": best["num_steps"], "apart": apart,
            "ci": has_ci, "points": pts, "text": text, "label": label}
