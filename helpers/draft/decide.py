"""Decisions by equivalence, not significance: a stage's loss with its CI against the material threshold.

A loss (tokens per verify step lost at a stage, bonus token included) is

* ``counts``: beyond its CI (the lower bound above 0) and at least material (the point estimate >= the threshold);
* ``clear``: the CI rules a material loss out (the upper bound below the threshold);
* ``undecided``: neither: the CI holds a material loss and does not exclude none. Never read as "no loss": the
  stage says how many more sequences (or prompts) would settle it, from the CI's observed width.

The material threshold is ``max(MIN_TOKENS, MATERIAL x the reference accept length)``.
"""
from __future__ import annotations

import math
from typing import Optional

#: a loss is material when it is at least this share of the reference accept length ...
MATERIAL = 0.08
#: ... and at least this many tokens per verify step
MIN_TOKENS = 0.1
DECISIONS = ("counts", "clear", "undecided")
#: no settle estimate beyond this many times the current sample count (the loss sits at the threshold)
MAX_FACTOR = 64


def threshold(reference_accept_length: Optional[float]) -> float:
    """The material loss (tokens per verify step) for a stage whose reference accept length is given."""
    ref = reference_accept_length if reference_accept_length is not None and math.isfinite(reference_accept_length) \
        else 0.0
    return max(MIN_TOKENS, MATERIAL * ref)


def _finite(x: Optional[float]) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def decide(delta: Optional[float], lo: Optional[float], hi: Optional[float], thr: float, *, n: Optional[int] = None,
           unit: str = "sequences") -> dict:
    """The decision on one loss (module docstring).

    Args:
        delta / lo / hi: the loss and its 95 % CI (tokens per verify step; positive = lost). None or NaN: unknown.
        thr: the material threshold (:func:`threshold`).
        n: how many sequences / prompts the CI rests on (for the settle estimate).
        unit: what ``n`` counts, for the words.

    Returns:
        ``{"decision", "threshold", "settle": {"n": needed or None, "text"} or None, "why"}``; ``settle`` is given for
        ``undecided`` only: the sample count at which the CI, shrinking as 1/sqrt(n) around the same estimate, would
        either exclude 0 (a material loss counts) or fall below the threshold (cleared), whichever comes first.
    """
    if not (_finite(delta) and _finite(lo) and _finite(hi)):
        return {"decision": "undecided", "threshold": thr, "settle": {"n": None, "text": "no CI could be computed"},
                "why": "no CI (fewer than 2 " + unit + ")" if _finite(delta) else "not measured"}
    if lo > 0 and delta >= thr:
        return {"decision": "counts", "threshold": thr, "settle": None,
                "why": f"{delta:.2f} [{lo:.2f}, {hi:.2f}] lies beyond 0 and is material (>= {thr:.2f})"}
    if hi < thr:
        return {"decision": "clear", "threshold": thr, "settle": None,
                "why": f"the CI [{lo:.2f}, {hi:.2f}] rules out a material loss (< {thr:.2f})"}
    half = max((hi - lo) / 2.0, 1e-12)
    need = []
    if delta < thr:                       # clear when the upper bound drops below the threshold
        need.append(n * (half / (thr - delta)) ** 2 if n and thr - delta > 0 else math.inf)
    if delta >= thr and delta > 0:        # counts when the lower bound rises above 0
        need.append(n * (half / delta) ** 2 if n else math.inf)
    n_need = min(need) if need else math.inf
    if n and math.isfinite(n_need) and n_need <= MAX_FACTOR * n:
        k = int(math.ceil(n_need))
        text = (f"about {k} {unit} (now {n}) would settle it, if the loss stays near {delta:.2f}")
        settle = {"n": k, "text": text}
    else:
        settle = {"n": None, "text": f"the loss ({delta:.2f}) sits at the material threshold ({thr:.2f}): more than "
                                     f"{MAX_FACTOR}x the {n or '?'} {unit} would be needed to settle it"}
    return {"decision": "undecided", "threshold": thr, "settle": settle,
            "why": f"{delta:.2f} [{lo:.2f}, {hi:.2f}] neither excludes 0 with a material loss nor rules out a "
                   f"material one (>= {thr:.2f})"}
