"""Acceptance measurement: accept length, accept rate, per-position acceptance, tok/s, with CIs.

Everything is computed from the **per-request** ``meta_info`` of finished, non-streaming
``/generate`` answers (``TokenizerManager._calculate_spec_decoding_metrics`` in
``sglang/srt/managers/tokenizer_manager.py``), never from ``/server_info``'s
``internal_states[*].avg_spec_accept_length``: that one is folded in only every
``decode_log_interval`` decode iterations (so it lags, or is absent after short runs), it covers
the server's whole lifetime (warm-up and earlier traffic included), and ``/flush_cache`` or
``/set_internal_state`` reset it (``sglang/srt/managers/scheduler_components/metrics_reporter.py``).
The spec fields exist only on the final chunk: this module never streams.

Definitions (SGLang's counters as ``TokenizerManager._calculate_spec_decoding_metrics`` sets them; the other
conventions named per item):

* **accept length** = Σ completion_tokens / Σ spec_verify_ct over requests (ratio of sums, as
  SpecForge ``benchmarks/benchmarker/utils.py::compute_metrics``): tokens emitted per verify
  step, bonus token included; SGLang's numerator also holds the prefill-sampled first token,
  so it is a little above ``accept_length_hist``.
* ``accept_length_mean_of_ratios``: mean over requests of completion/verify (Spec-Bench style);
  differs from the ratio of sums when lengths are skewed.
* ``accept_length_hist`` = 1 + A/S from the summed histogram (vLLM convention: bonus token,
  no prefill token). S = Σ H[n] verify steps, A = Σ n·H[n] accepted draft tokens.
* **accept rate** = Σ spec_num_correct_drafts / Σ spec_num_proposed_drafts (proposed =
  verify_ct x (num_draft_tokens - 1): per tree node when topk > 1).
* per-position **marginal** r_i = Σ_{n>=i} H[n] / S (probability a verify step accepts at least
  i drafts; vLLM's per-position rate) and **conditional** α_i = r_i / r_{i-1}, r_0 = 1 (EAGLE's
  n-α), i = 1..num_steps.
* **tok/s** = Σ completion_tokens / Σ client latency (per-stream speed; equals throughput at
  concurrency 1); ``throughput_tok_s`` = Σ completion_tokens / wall time of the whole batch.

Confidence intervals: percentile bootstrap over requests (requests are the independent units;
verify steps within a request are not), ``n_boot`` resamples, numpy only.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd


def sum_histograms(hists: Iterable[Optional[Sequence[int]]], length: Optional[int] = None) -> np.ndarray:
    """Element-wise sum of ragged histograms (SGLang grows them on demand); int64 ``[L]``.

    ``length`` pads (or checks) the result to at least that many bins.
    """
    hs = [np.asarray(h, dtype=np.int64) for h in hists if h is not None and len(h)]
    L = max([len(h) for h in hs] + [length or 0, 1])
    out = np.zeros(L, dtype=np.int64)
    for h in hs:
        out[:len(h)] += h
    return out


def histogram_matrix(hists: Sequence[Optional[Sequence[int]]], length: Optional[int] = None) -> np.ndarray:
    """Ragged per-request histograms as a zero-padded int64 matrix ``[n_requests, L]``."""
    L = max([len(h) for h in hists if h is not None] + [length or 0, 1])
    m = np.zeros((len(hists), L), dtype=np.int64)
    for i, h in enumerate(hists):
        if h is not None and len(h):
            m[i, :len(h)] = h
    return m


def accepted_drafts(hist: Sequence[int]) -> int:
    """A = Σ n·H[n]: accepted draft tokens implied by a correct-drafts histogram."""
    h = np.asarray(hist, dtype=np.int64)
    return int((np.arange(len(h)) * h).sum())


def position_rates(hist: Sequence[int] | np.ndarray, positions: Optional[int] = None
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Per-position acceptance from a correct-drafts histogram (``spec_correct_drafts_histogram`` of
    ``sglang/srt/managers/tokenizer_manager.py::TokenizerManager._calculate_spec_decoding_metrics``): the marginal and
    conditional rates of the module docstring.

    Args:
        hist: ``[..., L]`` counts, ``hist[..., n]`` = verify steps that accepted exactly n drafts
            (a batch of histograms along leading axes is allowed, e.g. bootstrap resamples).
        positions: k, the number of draft positions (default ``L - 1``); bins past k must be 0.

    Returns: ``(marginal, conditional)``, each ``[..., k]`` float64:
        marginal[i-1] = Σ_{n>=i} H[n] / Σ H (P(step accepts >= i drafts)),
        conditional[i-1] = marginal[i-1] / marginal[i-2] with marginal[-1] := 1 (NaN when the
        previous position was never reached). All NaN when Σ H = 0.
    """
    h = np.asarray(hist, dtype=np.float64)
    L = h.shape[-1]
    k = L - 1 if positions is None else int(positions)
    if k < 0:
        raise ValueError("positions must be >= 0")
    if L < k + 1:
        h = np.concatenate([h, np.zeros(h.shape[:-1] + (k + 1 - L,))], axis=-1)
    elif L > k + 1 and np.any(h[..., k + 1:] != 0):
        raise ValueError(f"histogram has counts beyond position {k} (len {L}); wrong positions?")
    total = h.sum(axis=-1, keepdims=True)
    tail = np.flip(np.cumsum(np.flip(h, axis=-1), axis=-1), axis=-1)  # tail[n] = Σ_{m>=n} H[m]
    with np.errstate(invalid="ignore", divide="ignore"):
        marginal = tail[..., 1:k + 1] / total
        prev = np.concatenate([np.ones(marginal.shape[:-1] + (1,)), marginal[..., :-1]], axis=-1)
        conditional = np.where(prev > 0, marginal / np.where(prev > 0, prev, 1.0), np.nan)
    marginal = np.where(total > 0, marginal, np.nan)
    return marginal, conditional


def _weights(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Bootstrap resample counts ``[n_boot, n]`` (each row sums to n)."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)


def _percentile(samples: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    a = (1.0 - level) / 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        lo = np.nanquantile(samples, a, axis=0)
        hi = np.nanquantile(samples, 1.0 - a, axis=0)
    return lo, hi


def bootstrap_ratios(num: np.ndarray, den: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """``n_boot`` bootstrap resamples of the ratio of sums Σnum/Σden over items (requests), ``[n_boot]`` float64;
    a resample with Σden = 0 is NaN (dropped by the percentile)."""
    w = _weights(len(num), n_boot, rng)
    sx, sy = w @ num, w @ den
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(sy != 0, sx / np.where(sy != 0, sy, 1.0), np.nan)


def bootstrap_ratio_diff_ci(num_a: Sequence[float], den_a: Sequence[float], num_b: Sequence[float],
                            den_b: Sequence[float], *, n_boot: int = 2000, level: float = 0.95,
                            seed: Optional[int] = 0) -> tuple[float, float, float]:
    """``Σnum_a/Σden_a - Σnum_b/Σden_b`` for two **independent** sets of items (different prompts: nothing pairs),
    with the percentile CI of the difference of two independent bootstraps, each set resampled on its own
    (:func:`paired_effect` is the paired counterpart). Returns ``(estimate, lo, hi)``; lo/hi NaN when a set has fewer
    than 2 items."""
    xa, ya, xb, yb = (np.asarray(v, dtype=np.float64) for v in (num_a, den_a, num_b, den_b))
    est = float(xa.sum() / ya.sum() - xb.sum() / yb.sum()) if ya.sum() and yb.sum() else float("nan")
    if len(xa) < 2 or len(xb) < 2:
        return est, float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    lo, hi = _percentile(bootstrap_ratios(xa, ya, n_boot, rng) - bootstrap_ratios(xb, yb, n_boot, rng), level)
    return est, float(lo), float(hi)


def bootstrap_ratio_ci(num: Sequence[float], den: Sequence[float], *, n_boot: int = 2000,
                       level: float = 0.95, seed: Optional[int] = 0) -> tuple[float, float, float]:
    """Ratio of sums Σnum/Σden with a percentile-bootstrap CI over items (requests).

    Returns ``(estimate, lo, hi)``; lo/hi are NaN with fewer than 2 items (no spread to
    resample) and resamples with Σden = 0 are dropped.
    """
    x = np.asarray(num, dtype=np.float64)
    y = np.asarray(den, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError("num and den must be 1-D arrays of the same length")
    est = float(x.sum() / y.sum()) if y.sum() != 0 else float("nan")
    if len(x) < 2:
        return est, float("nan"), float("nan")
    lo, hi = _percentile(bootstrap_ratios(x, y, n_boot, np.random.default_rng(seed)), level)
    return est, float(lo), float(hi)


def paired_effect(before: pd.DataFrame, after: pd.DataFrame, *, n_boot: int = 4000, level: float = 0.95,
                  seed: Optional[int] = 0) -> dict:
    """Change of accept length and accept rate between two measurements of the same prompts, with a
    paired percentile-bootstrap CI (prompts resampled jointly in both measurements).

    Two independent 95% CIs that overlap do not show "no effect": a wiring fault that costs a few
    percent of accept length (an off-by-one layer) needs hundreds of prompts before the two CIs
    separate, but greedy outputs are identical with and without the fault (the target decides every
    token), so per-prompt differences are tightly paired and the CI of the difference is narrow.

    Args:
        before / after: ``per_request`` frames of :func:`measure` (``prompt_id``, ``completion_tokens``,
            ``verify_ct``, ``correct_drafts``, ``proposed_drafts``, ``error``); rows with an error
            or without spec fields are dropped; prompts are matched on ``prompt_id``.

    Returns:
        ``{"n_paired", "accept_length_delta", "accept_length_delta_lo", "accept_length_delta_hi",
        "accept_rate_delta", "accept_rate_delta_lo", "accept_rate_delta_hi", "accept_length_per_prompt"}``
        (accept length in tokens per verify step, bonus token included; accept rate as a fraction; the last is
        each paired prompt's own accept length after minus before, in the order of ``before``, for the decision on few
        prompts: :func:`helpers.draft.decide.decide`); CI bounds are NaN with fewer than 2 paired prompts. The
        bootstrap resamples the paired prompts sorted by ``prompt_id`` (seed ``seed``): the same measurements give the
        same CI in any row order.

    Raises:
        ValueError: a frame lacks one of the columns named above.
    """
    cols = ["prompt_id", "completion_tokens", "verify_ct", "correct_drafts", "proposed_drafts"]
    for name, df in (("before", before), ("after", after)):
        missing = [c for c in cols if c not in df.columns]
        if missing:
            raise ValueError(f"paired_effect: the {name} per_request frame lacks columns {missing}")

    def clean(df):
        ok = df["verify_ct"].fillna(0) > 0
        if "error" in df.columns:
            ok &= df["error"].isna() | (df["error"].astype(str) == "") | (df["error"].astype(str) == "None")
        return df.loc[ok, cols].drop_duplicates("prompt_id")

    m = clean(before).merge(clean(after), on="prompt_id", suffixes=("_a", "_b"))
    per_prompt_order = m
    # the bootstrap resamples prompts in one canonical order (by prompt id), so the same measurements give the same
    # CI whatever order their rows came in (a concurrent measurement's, a rebuilt ledger's, another run's)
    m = m.assign(_key=m["prompt_id"].astype(str)).sort_values("_key", kind="stable").reset_index(drop=True)
    out: dict[str, Any] = {"n_paired": int(len(m))}
    if len(m) == 0:
        for k in ("accept_length", "accept_rate"):
            out.update({f"{k}_delta": float("nan"), f"{k}_delta_lo": float("nan"), f"{k}_delta_hi": float("nan")})
        out["accept_length_per_prompt"] = []
        return out
    f = lambda c: m[c].to_numpy(dtype=np.float64)  # noqa: E731
    g = lambda c: per_prompt_order[c].to_numpy(dtype=np.float64)  # noqa: E731
    out["accept_length_per_prompt"] = [float(x) for x in g("completion_tokens_b") / g("verify_ct_b")
                                       - g("completion_tokens_a") / g("verify_ct_a")]
    pairs = {"accept_length": (("completion_tokens_a", "verify_ct_a"), ("completion_tokens_b", "verify_ct_b")),
             "accept_rate": (("correct_drafts_a", "proposed_drafts_a"), ("correct_drafts_b", "proposed_drafts_b"))}
    w = _weights(len(m), n_boot, np.random.default_rng(seed)) if len(m) >= 2 else None
    for k, ((na, da), (nb, db)) in pairs.items():
        est = f(nb).sum() / f(db).sum() - f(na).sum() / f(da).sum() if f(da).sum() and f(db).sum() else float("nan")
        out[f"{k}_delta"] = float(est)
        if w is None:
            out[f"{k}_delta_lo"] = out[f"{k}_delta_hi"] = float("nan")
            continue
        with np.errstate(invalid="ignore", divide="ignore"):
            d = (w @ f(nb)) / (w @ f(db)) - (w @ f(na)) / (w @ f(da))
        lo, hi = _percentile(d, level)
        out[f"{k}_delta_lo"], out[f"{k}_delta_hi"] = float(lo), float(hi)
    return out


def bootstrap_mean_ci(values: Sequence[float], *, n_boot: int = 2000, level: float = 0.95,
                      seed: Optional[int] = 0) -> tuple[float, float, float]:
    """Mean with a percentile-bootstrap CI; ``(estimate, lo, hi)`` (NaN CI below 2 values)."""
    v = np.asarray(values, dtype=np.float64)
    v = v[np.isfinite(v)]
    if len(v) == 0:
        return float("nan"), float("nan"), float("nan")
    return bootstrap_ratio_ci(v, np.ones_like(v), n_boot=n_boot, level=level, seed=seed)


def bootstrap_positions_ci(hist_matrix: np.ndarray, positions: int, *, n_boot: int = 2000,
                           level: float = 0.95, seed: Optional[int] = 0) -> pd.DataFrame:
    """Per-position marginal and conditional rates with bootstrap CIs over requests.

    ``hist_matrix``: ``[n_requests, L]`` per-request histograms (:func:`histogram_matrix`).
    Returns a DataFrame with one row per position 1..k: ``position, marginal, marginal_lo,
    marginal_hi, conditional, conditional_lo, conditional_hi``.
    """
    m = np.asarray(hist_matrix, dtype=np.float64)
    marg, cond = position_rates(m.sum(axis=0), positions)
    df = pd.DataFrame({"position": np.arange(1, positions + 1), "marginal": marg, "conditional": cond})
    if m.shape[0] >= 2 and positions > 0:
        w = _weights(m.shape[0], n_boot, np.random.default_rng(seed))
        bm, bc = position_rates(w @ m, positions)
        (mlo, mhi), (clo, chi) = _percentile(bm, level), _percentile(bc, level)
    else:
        mlo = mhi = clo = chi = np.full(positions, np.nan)
    df["marginal_lo"], df["marginal_hi"] = mlo, mhi
    df["conditional_lo"], df["conditional_hi"] = clo, chi
    return df[["position", "marginal", "marginal_lo", "marginal_hi", "conditional",
               "conditional_lo", "conditional_hi"]]


def requests_for_half_width(per_request: pd.DataFrame, target: float = 0.05, *,
                            sizes: Sequence[int] = (10, 20, 40, 80, 160, 320), n_boot: int = 1000,
                            level: float = 0.95, seed: int = 0) -> dict:
    """How many requests give a ±``target`` CI on the accept length, from measured variance.

    Treats the measured requests as the population: for each n in ``sizes`` draws n requests
    (with replacement) and bootstraps the ratio-of-sums CI of that draw; the half-width shrinks
    like 1/√n, so ``n_needed = n_obs · (hw_obs / target)²`` with ``hw_obs`` the half-width of
    the full measurement (also checked against the simulated sizes). Returns ``{"n_obs",
    "half_width_obs", "n_needed", "by_n": {n: mean half-width}}``.
    """
    spec = per_request[per_request["has_spec"]]
    num = spec["completion_tokens"].to_numpy(float)
    den = spec["verify_ct"].to_numpy(float)
    if len(num) < 2:
        raise ValueError("need >= 2 requests with spec fields")
    _, lo, hi = bootstrap_ratio_ci(num, den, n_boot=n_boot, level=level, seed=seed)
    hw = (hi - lo) / 2
    rng = np.random.default_rng(seed)
    by_n = {}
    for n in sizes:
        widths = []
        for rep in range(5):
            idx = rng.integers(0, len(num), n)
            _, l2, h2 = bootstrap_ratio_ci(num[idx], den[idx], n_boot=n_boot, level=level,
                                           seed=seed + rep + 1)
            widths.append((h2 - l2) / 2)
        by_n[int(n)] = float(np.mean(widths))
    n_needed = int(math.ceil(len(num) * (hw / target) ** 2)) if hw > 0 else len(num)
    return {"n_obs": int(len(num)), "half_width_obs": float(hw), "n_needed": max(n_needed, 2),
            "by_n": by_n}


def _finite_number(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return math.nan
    return v


def format_ci(row: Mapping[str, Any], key: str, *, pct: bool = False, digits: int = 2, signed: bool = False,
              unit: Optional[str] = None, missing: str = "") -> str:
    """``"value [lo, hi]"`` for ``row[key]`` with its ``key_lo`` / ``key_hi`` bounds: the one CI formatter of the
    tables, headlines and the CLI.

    ``pct``: x100 with one decimal and a ``%`` unit (``unit=""`` for percentage points); else ``digits``
    decimals; ``signed``: a leading ``+`` on positive numbers (changes); the bounds are left out when not finite;
    ``missing`` is returned when the value is not finite."""
    v = _finite_number(row.get(key))
    lo, hi = _finite_number(row.get(f"{key}_lo")), _finite_number(row.get(f"{key}_hi"))
    if not math.isfinite(v):
        return missing
    sign = "+" if signed else ""
    u = ("%" if pct else "") if unit is None else unit
    f = (lambda x: f"{100 * x:{sign}.1f}{u}") if pct else (lambda x: f"{x:{sign}.{digits}f}{u}")
    return f"{f(v)} [{f(lo)}, {f(hi)}]" if math.isfinite(lo) and math.isfinite(hi) else f(v)


def accept_length(completion_tokens: Sequence[float], verify_ct: Sequence[float]) -> float:
    """Accept length: Σ completion_tokens / Σ spec_verify_ct over requests (tokens emitted per verify step, bonus
    token and SGLang's prefill-sampled first token included; ratio of sums, as SpecForge
    ``benchmarks/benchmarker/utils.py::compute_metrics``). NaN when no verify step was counted."""
    num, den = float(np.nansum(np.asarray(completion_tokens, float))), float(np.nansum(np.asarray(verify_ct, float)))
    return num / den if den > 0 else math.nan


def accept_rate(correct_drafts: Sequence[float], proposed_drafts: Sequence[float]) -> float:
    """Accept rate: Σ spec_num_correct_drafts / Σ spec_num_proposed_drafts (drafts only; proposed = verify steps x
    (num_draft_tokens - 1), per tree node when topk > 1). NaN when nothing was proposed."""
    num, den = float(np.nansum(np.asarray(correct_drafts, float))), float(np.nansum(np.asarray(proposed_drafts, float)))
    return num / den if den > 0 else math.nan
