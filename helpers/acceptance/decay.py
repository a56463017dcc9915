"""The decay detector of ``watch``: one change point in a series of accept lengths, with its CI, whether it is a drop
worth an investigation, and which covariate moves with it.

**Method: a two-segment mean split with block resampling.** Over a window of ``n`` samples (accept length per
interval, tokens per verify step), every split ``k`` (the first sample after the change; both segments at least
``min_segment`` samples) gets the standardised mean difference ``S_k = sqrt(k (n - k) / n) x |mean(x[k:]) -
mean(x[:k])|`` (the CUSUM statistic divided by its length: the likelihood-ratio split of a mean shift in Gaussian
noise); the change point is the ``k`` maximising it.

* Is there a change at all: a **block permutation test** of ``max_k S_k``. The blocks of ``b`` consecutive samples
  are shuffled ``n_perm`` times and the maximum recomputed, so the test accounts for the maximum having been picked
  over every split (a per-split test, or a bootstrap CI of the chosen split's effect alone, finds an "effect" in
  every flat series). ``b`` is 1 (a plain permutation) unless the residuals around the fitted step are correlated
  with their neighbours (lag-1 autocorrelation beyond ``2 / sqrt(n)``: load regimes of a live server last minutes,
  and plain permutation would then be too liberal), else ``ceil(n ** (1/3))``; always-on blocks would cost the test
  its power on short windows: with 10 blocks no arrangement is rarer than 2 / C(10, 4) = 1 %, so a clean step of 12 +
  18 samples could never reach :data:`ALPHA`. ``p_value = (1 + #{perm >= observed}) / (1 + n_perm)``.
* Where and how large: a **residual block bootstrap** around the fitted step (``n_boot`` series = the two segment
  means + the residuals resampled in circular blocks of ``b``), each re-split; the percentile interval of the
  re-estimated effect is ``effect_ci``. ``index_ci`` is the hull of the bootstrap's percentile interval of the
  location and Bai's asymptotic interval ``k +- ceil(11.03 sigma^2 / effect^2)`` (J. Bai, "Estimation of a change
  point in multiple regression models", Rev. Econ. Stat. 1997: 11.03 is the 97.5 % quantile of the argmax of a
  two-sided Brownian motion with drift -|s|/2), since the bootstrap alone, conditional on the estimated location,
  is a little narrow (measured over 200 seeded steps of 3 sigma at 60 samples: coverage 96.5 % for the bootstrap,
  99 % for Bai's, the effect's 93.5 %).

Why not CUSUM with a control limit: its limit needs the in-control mean and sd, which a running server does not give
(acceptance depends on the workload); the split needs neither, and its permutation test is exact under
exchangeability of blocks whatever the noise's distribution.

The decision (:func:`decide_drop`) triggers only on evidence: the change is significant (``p_value <= alpha``), it is
a drop whose effect CI excludes 0, the drop is material (at least ``material`` tokens per verify step: the caller
passes :func:`helpers.draft.decide.threshold` of the baseline), and, when asked, the level after it is below an
absolute accept length or below ``(1 - frac)`` of the run's baseline. One noisy sample cannot trigger it: each
segment holds at least ``min_segment`` samples.

Covariates (:func:`covariate_steps`): each covariate's correlation with the step indicator ``1[i >= k]`` and its
step (mean after - mean before); a covariate with ``|r| >= MOVES_WITH`` moves with the change. Uptime rises with
every sample, so it correlates with any step; whether the accept length follows uptime rather than jumping is
answered apart: ``shape`` is ``trend`` when a straight line in uptime fits the window better than the step
(smaller residual sum of squares), else ``step``.

Pure numpy, no engine, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Mapping, Optional, Sequence

import numpy as np

#: each segment holds at least this many samples
MIN_SEGMENT = 5
#: significance of the block permutation test for a trigger (the false-alarm rate per look; the test in
#: tests/unit/acceptance/test_watch_decay.py measures the rate over a run of looks)
ALPHA = 0.002
#: |correlation with the step| from which a covariate is said to move with the change
MOVES_WITH = 0.5
METHOD = ("two-segment mean split (max sqrt(k(n-k)/n)|mean after - mean before|); block permutation test of the "
          "max; residual block bootstrap CI of location and effect")


@dataclass(frozen=True)
class ChangePoint:
    """One change point of a series of ``n`` values. ``index``: the first value after the change (0-based in the
    series given); ``index_ci``: its percentile interval (inclusive); ``before`` / ``after``: the segment means;
    ``effect`` = after - before (negative: a drop), ``effect_ci`` its interval; ``p_value``: the block permutation
    test of there being a change at all; ``block``: the block length used."""

    n: int
    index: int
    index_ci: tuple[int, int]
    before: float
    after: float
    effect: float
    effect_ci: tuple[float, float]
    p_value: float
    block: int
    level: float = 0.95
    method: str = METHOD

    @property
    def drop(self) -> float:
        """before - after (positive for a drop)."""
        return self.before - self.after

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DropDecision:
    """Whether a change point is a drop to act on: ``trigger``, ``reason`` (one line, every condition with its
    numbers), the ``change``, the ``material`` threshold used and the ``baseline`` it was judged against."""

    trigger: bool
    reason: str
    change: Optional[ChangePoint]
    material: float
    baseline: Optional[float] = None
    conditions: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"trigger": self.trigger, "reason": self.reason, "material": self.material, "baseline": self.baseline,
                "conditions": self.conditions, "change": self.change.to_json() if self.change else None}


def block_length(n: int, resid: Optional[np.ndarray] = None) -> int:
    """The block length of the resampling: 1 when the residuals ``resid`` show no lag-1 autocorrelation beyond
    ``2 / sqrt(n)`` (module docstring), else ``ceil(n ** (1/3))`` (the usual rate for a moving-block bootstrap)."""
    if resid is not None and len(resid) > 2:
        a, b = resid[:-1], resid[1:]
        den = float(np.sqrt((a ** 2).sum() * (b ** 2).sum()))
        if den == 0 or abs(float((a * b).sum()) / den) < 2 / math.sqrt(n):
            return 1
    return max(1, int(math.ceil(n ** (1.0 / 3.0))))


def _split_stats(x: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For series ``x`` [B, n]: the split statistic [B, K], the effect (after - before) [B, K], for splits
    ``k = m .. n - m`` (K of them), and the splits."""
    n = x.shape[1]
    ks = np.arange(m, n - m + 1)
    c = np.cumsum(x, axis=1)
    total = c[:, -1:]
    before = c[:, ks - 1] / ks
    after = (total - c[:, ks - 1]) / (n - ks)
    eff = after - before
    stat = np.sqrt(ks * (n - ks) / n) * np.abs(eff)
    return stat, eff, ks


def _block_permutations(n: int, b: int, count: int, rng: np.random.Generator) -> np.ndarray:
    """``count`` index orders [count, n] of the series cut into consecutive blocks of ``b`` (the last shorter),
    the blocks shuffled."""
    nb = int(math.ceil(n / b))
    grid = np.arange(nb * b).reshape(nb, b)
    grid[grid >= n] = -1
    order = np.argsort(rng.random((count, nb)), axis=1)
    idx = grid[order].reshape(count, -1)
    return idx[idx >= 0].reshape(count, n)


def change_point(values: Sequence[float], *, min_segment: int = MIN_SEGMENT, n_perm: int = 999, n_boot: int = 400,
                 level: float = 0.95, seed: int = 0) -> Optional[ChangePoint]:
    """The most likely single change point of ``values`` (module docstring), or None when the series is shorter than
    two segments (``2 x min_segment`` finite values). Non-finite values are dropped first (the index then counts the
    finite values only). Deterministic for a given ``seed``.

    Cost: ``(n_perm + n_boot) x n`` cumulative sums over ``n - 2 min_segment`` splits (240 values: about 10 ms).
    """
    x = np.asarray([float(v) for v in values if v is not None and math.isfinite(float(v))], dtype=np.float64)
    n, m = len(x), int(min_segment)
    if n < 2 * m:
        return None
    rng = np.random.default_rng(seed)
    stat, eff, ks = _split_stats(x[None, :], m)
    j = int(np.argmax(stat[0]))
    k, s_obs = int(ks[j]), float(stat[0, j])
    before, after = float(x[:k].mean()), float(x[k:].mean())
    fitted = np.where(np.arange(n) < k, before, after)
    resid = x - fitted
    b = block_length(n, resid)
    # block permutation under "no change": shuffle whole blocks, recompute the maximum
    perms = _block_permutations(n, b, n_perm, rng)
    s_perm = _split_stats(x[perms], m)[0].max(axis=1)
    p = float((1 + np.count_nonzero(s_perm >= s_obs - 1e-12)) / (1 + n_perm))
    # residual circular block bootstrap around the fitted step
    n_blocks = int(math.ceil(n / b))
    starts = rng.integers(0, n, size=(n_boot, n_blocks))
    idx = ((starts[:, :, None] + np.arange(b)[None, None, :]) % n).reshape(n_boot, -1)[:, :n]
    xb = fitted[None, :] + resid[idx]
    sb, eb, _ = _split_stats(xb, m)
    jb = np.argmax(sb, axis=1)
    kb = ks[jb]
    effb = eb[np.arange(n_boot), jb]
    q = (1 - level) / 2
    sigma2 = float((resid ** 2).sum()) / max(1, n - 2)
    eff0 = after - before
    bai = int(math.ceil(11.03 * sigma2 / eff0 ** 2)) if eff0 != 0 else n
    lo = min(int(np.floor(np.quantile(kb, q))), k - bai)
    hi = max(int(np.ceil(np.quantile(kb, 1 - q))), k + bai)
    return ChangePoint(n=n, index=k, index_ci=(max(1, lo), min(n - 1, hi)),
                       before=before, after=after, effect=after - before,
                       effect_ci=(float(np.quantile(effb, q)), float(np.quantile(effb, 1 - q))), p_value=p, block=b,
                       level=level)


def decide_drop(change: Optional[ChangePoint], *, material: float, alpha: float = ALPHA,
                below: Optional[float] = None, frac: Optional[float] = None,
                baseline: Optional[float] = None) -> DropDecision:
    """Whether ``change`` is a drop to act on (module docstring). ``material``: the smallest drop that matters, in
    tokens per verify step; ``below``: the absolute accept length the level after the change must be under;
    ``frac``: the share of ``baseline`` (the run's own first samples) it must have lost. Neither given: any
    significant, material drop.

    Raises:
        ValueError: ``frac`` without a ``baseline``."""
    if frac is not None and baseline is None:
        raise ValueError("a drop against the baseline needs the baseline")
    if change is None:
        return DropDecision(False, "too few samples for a change point", None, material, baseline)
    c = change
    cond = {"significant": c.p_value <= alpha, "ci_excludes_0": c.effect_ci[1] < 0.0,
            "material": c.drop >= material}
    if below is not None:
        cond["below"] = c.after < below
    if frac is not None:
        cond["frac"] = c.after <= (1.0 - frac) * baseline
    words = {"significant": f"p {c.p_value:.3g} {'<=' if cond['significant'] else '>'} {alpha:g}",
             "ci_excludes_0": f"effect {c.effect:+.3f} CI [{c.effect_ci[0]:+.3f}, {c.effect_ci[1]:+.3f}]",
             "material": f"drop {c.drop:.3f} {'>=' if cond['material'] else '<'} material {material:.3f}",
             "below": f"after {c.after:.3f} vs --drop-below {below}",
             "frac": f"after {c.after:.3f} vs (1 - {frac}) x baseline "
                     f"{baseline if baseline is None else round(baseline, 3)}"}
    failed = [k for k, ok in cond.items() if not ok]
    reason = ("; ".join(words[k] for k in cond) if not failed
              else "no trigger: " + "; ".join(words[k] for k in failed))
    return DropDecision(not failed, reason, c, material, baseline, cond)


def covariate_steps(values: Sequence[float], covariates: Mapping[str, Sequence[Optional[float]]], index: int,
                    uptime: Optional[Sequence[Optional[float]]] = None) -> dict:
    """Which covariate moves with a change at ``index`` of ``values`` (module docstring).

    Returns ``{"covariates": {name: {"r", "before", "after", "step", "n"}}, "moves_with": [names, largest |r|
    first], "shape": "step" | "trend" | None}``; a covariate with fewer than 2 finite values on either side has
    ``r`` None. ``uptime``: seconds, for ``shape`` (None when not given or not finite everywhere)."""
    y = np.asarray(values, dtype=np.float64)
    n = len(y)
    step = (np.arange(n) >= index).astype(np.float64)
    out: dict = {}
    for name, col in covariates.items():
        c = np.asarray([np.nan if v is None else float(v) for v in col], dtype=np.float64)
        ok = np.isfinite(c)
        pre, post = c[ok & (step == 0)], c[ok & (step == 1)]
        r = None
        if len(pre) >= 2 and len(post) >= 2 and float(np.std(c[ok])) > 0:
            r = float(np.corrcoef(c[ok], step[ok])[0, 1])
        out[name] = {"r": r, "before": float(pre.mean()) if len(pre) else None,
                     "after": float(post.mean()) if len(post) else None,
                     "step": float(post.mean() - pre.mean()) if len(pre) and len(post) else None, "n": int(ok.sum())}
    moves = sorted((k for k, v in out.items() if v["r"] is not None and abs(v["r"]) >= MOVES_WITH),
                   key=lambda k: -abs(out[k]["r"]))
    shape = None
    if uptime is not None and n >= 4:
        u = np.asarray([np.nan if v is None else float(v) for v in uptime], dtype=np.float64)
        if np.all(np.isfinite(u)) and float(np.std(u)) > 0 and 0 < index < n:
            fit_step = np.where(step == 1, y[index:].mean(), y[:index].mean())
            coef = np.polyfit(u, y, 1)
            sse_step = float(((y - fit_step) ** 2).sum())
            sse_line = float(((y - np.polyval(coef, u)) ** 2).sum())
            shape = "trend" if sse_line < sse_step else "step"
    return {"covariates": out, "moves_with": moves, "shape": shape}
