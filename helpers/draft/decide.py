"""Decisions by equivalence, not significance: a stage's loss with its CI against the material threshold.

A loss (tokens per verify step lost at a stage, bonus token included) is

* ``counts``: beyond its CI (the lower bound above 0) and at least material (the point estimate >= the threshold);
* ``clear``: the CI rules a material loss out (the upper bound below the threshold);
* ``undecided``: neither: the CI holds a material loss and does not exclude none. Never read as "no loss": the
  stage says how many more sequences (or prompts) would settle it, from the CI's observed width.

The material threshold is ``max(MIN_TOKENS, MATERIAL x the reference accept length)``.

**Few sequences.** Every stage's CI is a percentile bootstrap over sequences (samples, prompts, rows). Over fewer
than :data:`SMALL_N` of them that CI is far too narrow: its resamples hold at most n distinct values, so over 3
sequences with losses -0.23, 0, 0 it is [-0.23, 0.00] (a wiring fault, config ids [2, 4, 5], whose loss on 64
prompts is 0.16 and live 0.30, was cleared on it). Below :data:`SMALL_N` sequences, :func:`decide` (the one place
every stage is decided) therefore

* widens the CI to at least the Student-t interval on the per-sequence losses (mean +- t(0.975, n-1) x sd /
  sqrt(n); the CI used is the hull of both, the bootstrap's kept as ``bootstrap_ci``), when the caller gives them;
* never clears a loss unless it is an exact identity: the two arms gave the same result on every sequence
  (every per-sequence loss exactly 0, or loss and CI all exactly 0 when no per-sequence losses are given: the
  served plan is the trained plan, the fix changes nothing, the recommended settings are the served ones). A
  nonzero loss on fewer sequences is ``undecided``, with at least :data:`SMALL_N` sequences as its settle count.
  (The clean reference server's wiring stage on the first 3 bundled training samples is such an identity: their bf16
  training states and the float32 HF every-layer reference of the same tokens give the same verify steps on all
  three. A served capture whose rounding flipped one draft token on one of few samples would be undecided: that is
  the honest answer on so few.)

From :data:`SMALL_N` sequences on, the decision is the bootstrap's, unchanged.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

#: a loss is material when it is at least this share of the reference accept length ...
MATERIAL = 0.08
#: ... and at least this many tokens per verify step
MIN_TOKENS = 0.1
DECISIONS = ("counts", "clear", "undecided")
#: no settle estimate beyond this many times the current sample count (the loss sits at the threshold)
MAX_FACTOR = 64
#: below this many sequences a percentile bootstrap CI is not trusted (module docstring): the CI is widened to the
#: Student-t interval and only an exact identity is cleared
SMALL_N = 10
#: two-sided 95 % Student-t quantiles t(0.975, df), df = 1 .. 30 (no scipy in the suite's environment)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def threshold(reference_accept_length: Optional[float]) -> float:
    """The material loss (tokens per verify step) for a stage whose reference accept length is given."""
    ref = reference_accept_length if reference_accept_length is not None and math.isfinite(reference_accept_length) \
        else 0.0
    return max(MIN_TOKENS, MATERIAL * ref)


def _finite(x: Optional[float]) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def student_t_ci(values: Sequence[float]) -> Optional[tuple[float, float]]:
    """The 95 % Student-t interval of the mean of ``values`` (finite ones; None below 2)."""
    v = np.asarray([float(x) for x in values if x is not None and math.isfinite(float(x))], dtype=np.float64)
    if len(v) < 2:
        return None
    df = len(v) - 1
    t = T975[df - 1] if df <= len(T975) else 1.96
    half = t * float(v.std(ddof=1)) / math.sqrt(len(v))
    m = float(v.mean())
    return m - half, m + half


def _identity(delta: float, lo: float, hi: float, per_sequence: Optional[Sequence[float]]) -> bool:
    """Both arms gave the same result on every sequence (module docstring)."""
    if per_sequence is not None:
        return len(per_sequence) > 0 and all(x == 0 for x in per_sequence)
    return delta == 0 and lo == 0 and hi == 0


def decide(delta: Optional[float], lo: Optional[float], hi: Optional[float], thr: float, *, n: Optional[int] = None,
           unit: str = "sequences", per_sequence: Optional[Sequence[float]] = None) -> dict:
    """The decision on one loss (module docstring).

    Args:
        delta / lo / hi: the loss and its 95 % CI (tokens per verify step; positive = lost). None or NaN: unknown.
        thr: the material threshold (:func:`threshold`).
        n: how many sequences / prompts the CI rests on (for the settle estimate; the length of ``per_sequence``
            when not given). None: unknown, the bootstrap CI is taken as it is.
        unit: what ``n`` counts, for the words.
        per_sequence: the loss on each sequence (same sign as ``delta``), for the Student-t interval and the exact
            identity below :data:`SMALL_N` sequences.

    Returns:
        ``{"decision", "threshold", "ci": [lo, hi] the CI decided on, "settle": {"n": needed or None, "text"} or
        None, "why"}``, and below :data:`SMALL_N` sequences ``"small_n": {"min_n", "bootstrap_ci", "t_ci",
        "per_sequence", "identity"}``; ``settle`` is given for ``undecided`` only: the sample count at which the CI,
        shrinking as 1/sqrt(n) around the same estimate, would either exclude 0 (a material loss counts) or fall below
        the threshold (cleared), whichever comes first (each from its own side's half-width), always more than n, and
        at least :data:`SMALL_N` where only that many can clear.
    """
    if per_sequence is not None:
        per_sequence = [float(x) for x in per_sequence if x is not None and math.isfinite(float(x))]
        n = len(per_sequence) if n is None else n
    if not (_finite(delta) and _finite(lo) and _finite(hi)):
        return {"decision": "undecided", "threshold": thr, "ci": [lo, hi],
                "settle": {"n": None, "text": "no CI could be computed"},
                "why": "no CI (fewer than 2 " + unit + ")" if _finite(delta) else "not measured"}
    small: Optional[dict] = None
    b_half = (hi - lo) / 2.0
    if n is not None and n < SMALL_N:
        ident = _identity(delta, lo, hi, per_sequence)
        t = student_t_ci(per_sequence) if per_sequence is not None else None
        small = {"min_n": SMALL_N, "bootstrap_ci": [lo, hi], "t_ci": None if t is None else [t[0], t[1]],
                 "per_sequence": per_sequence, "identity": ident}
        if t is not None:
            lo, hi = min(lo, t[0]), max(hi, t[1])
            # the settle estimate's width (a count where the CI is normal): 1.96 x the per-sequence sd / sqrt(n),
            # if wider than the bootstrap's
            b_half = max(b_half, 1.96 * float(np.std(per_sequence, ddof=1)) / math.sqrt(len(per_sequence)))
    out = {"threshold": thr, "ci": [lo, hi]}
    if small is not None:
        out["small_n"] = small
    if lo > 0 and delta >= thr:
        return {"decision": "counts", **out, "settle": None,
                "why": f"{delta:.2f} [{lo:.2f}, {hi:.2f}] lies beyond 0 and is material (>= {thr:.2f})"}
    if hi < thr and (small is None or small["identity"]):
        return {"decision": "clear", **out, "settle": None,
                "why": (f"the CI [{lo:.2f}, {hi:.2f}] rules out a material loss (< {thr:.2f})" if small is None else
                        f"no loss: both arms gave the same result on each of the {n} {unit}")}
    # each side's own half-width (a bootstrap CI need not be symmetric: with the mean half-width an undecided loss
    # could be "settled" by fewer sequences than it has), at least the normal one below SMALL_N
    up, down = max(hi - delta, b_half if small is not None else 0.0, 1e-12), \
        max(delta - lo, b_half if small is not None else 0.0, 1e-12)
    need = []
    if delta < thr:                       # clear when the upper bound drops below the threshold
        need.append(n * (up / (thr - delta)) ** 2 if n and thr - delta > 0 else math.inf)
    if delta >= thr and delta > 0:        # counts when the lower bound rises above 0
        need.append(n * (down / delta) ** 2 if n else math.inf)
    n_need = min(need) if need else math.inf
    if n and math.isfinite(n_need):       # an undecided loss is never settled by the sequences it already has
        n_need = max(n_need, n + 1)
    if small is not None and math.isfinite(n_need):
        n_need = max(n_need, SMALL_N)
    if n and math.isfinite(n_need) and n_need <= MAX_FACTOR * n:
        k = int(math.ceil(n_need))
        text = (f"about {k} {unit} (now {n}) would settle it, if the loss stays near {delta:.2f}")
        settle = {"n": k, "text": text}
    else:
        settle = {"n": None, "text": f"the loss ({delta:.2f}) sits at the material threshold ({thr:.2f}): more than "
                                     f"{MAX_FACTOR}x the {n or '?'} {unit} would be needed to settle it"}
    why = (f"{delta:.2f} [{lo:.2f}, {hi:.2f}] neither excludes 0 with a material loss nor rules out a material one "
           f"(>= {thr:.2f})")
    if small is not None and hi < thr:
        why = (f"{delta:.2f} [{lo:.2f}, {hi:.2f}] on only {n} {unit}: below {SMALL_N} {unit} a loss that is not "
               "exactly 0 on every one is never cleared (a bootstrap over so few is far too narrow)")
    elif small is not None:
        why += f" (CI on {n} {unit}: the bootstrap's widened to the Student-t interval)"
    return {"decision": "undecided", **out, "settle": settle, "why": why}
