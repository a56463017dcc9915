"""Acceptance measurement: accept length, accept rate, per-position acceptance, tok/s, with CIs.

Everything is computed from the **per-request** ``meta_info`` of finished, non-streaming
``/generate`` answers (``TokenizerManager._calculate_spec_decoding_metrics`` in
``sglang/srt/managers/tokenizer_manager.py``), never from ``/server_info``'s
``internal_states[*].avg_spec_accept_length``: that one is folded in only every
``decode_log_interval`` decode iterations (so it lags, or is absent after short runs), it covers
the server's whole lifetime (warm-up and earlier traffic included), and ``/flush_cache`` or
``/set_internal_state`` reset it (``sglang/srt/managers/scheduler_components/metrics_reporter.py``).
The spec fields exist only on the final chunk: this module never streams.

Definitions (``shared/reference/anchors.md`` §C, ``training-formats.md`` §5):

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

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

from .server.settings import EffectiveSpecConfig
from .server.protocol import GenerateResult
from .server.client import SGLangClient, as_client
from .errors import SGLangError
from .server.redaction import redact, redact_url

# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: ``text`` or ``input_ids`` (token ids, e.g. the prompt part of a training sample)."""

    id: str
    text: Optional[str] = None
    input_ids: Optional[tuple[int, ...]] = None
    kind: str = ""

    def __post_init__(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError(f"prompt {self.id!r}: give exactly one of text / input_ids")

    def request(self) -> dict:
        return {"text": self.text} if self.text is not None else {"input_ids": list(self.input_ids)}


def bundled_prompts_path() -> Path:
    """Path of the bundled prompt set (``helpers/data/prompts.jsonl``, 48 English prompts)."""
    return Path(str(resources.files("helpers") / "data" / "prompts.jsonl"))


def load_prompts(source: Any = None, n: Optional[int] = None) -> list[Prompt]:
    """Prompts from the bundled set (``source=None``), a ``.jsonl``/``.json`` file, or a list.

    List items may be strings (text), sequences of ints (token ids), dicts with ``text`` or
    ``input_ids`` (optional ``id``, ``kind``), or :class:`Prompt`. Files hold one such dict per
    line (jsonl) or a JSON list. ``n`` keeps the first n (cycling when n exceeds the set).
    Raises ValueError on an empty or malformed set.
    """
    if source is None:
        source = bundled_prompts_path()
    if isinstance(source, (str, Path)) and (Path(source).suffix in (".jsonl", ".json")
                                            or Path(source).is_file()):
        if not Path(source).is_file():
            raise ValueError(f"prompt file {source} not found")
        text = Path(source).read_text()
        if Path(source).suffix == ".json":
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif isinstance(source, (str, Path)):
        raise ValueError(f"prompt file {source} not found")
    else:
        items = list(source)
    prompts = []
    for i, it in enumerate(items):
        if isinstance(it, Prompt):
            prompts.append(it)
        elif isinstance(it, str):
            prompts.append(Prompt(id=f"u{i:03d}", text=it, kind="user"))
        elif isinstance(it, Mapping):
            ids = it.get("input_ids")
            prompts.append(Prompt(id=str(it.get("id", f"u{i:03d}")), text=it.get("text"),
                                  input_ids=tuple(int(t) for t in ids) if ids is not None else None,
                                  kind=str(it.get("kind", ""))))
        elif isinstance(it, (Sequence, np.ndarray)) and len(it) and not isinstance(it, bytes):
            prompts.append(Prompt(id=f"t{i:03d}", input_ids=tuple(int(t) for t in it), kind="tokens"))
        else:
            raise ValueError(f"prompt #{i}: cannot use {type(it).__name__} as a prompt")
    if not prompts:
        raise ValueError("the prompt set is empty")
    if n is not None:
        if n <= 0:
            raise ValueError(f"n must be >= 1, got {n}")
        prompts = [prompts[i % len(prompts)] if i < len(prompts) else
                   dataclasses.replace(prompts[i % len(prompts)], id=f"{prompts[i % len(prompts)].id}#{i // len(prompts)}")
                   for i in range(n)]
    return prompts


def prompts_from_samples(samples: Iterable[Any], *, max_prompt_tokens: Optional[int] = None,
                         min_prompt_tokens: int = 1) -> list[Prompt]:
    """Prompts (token ids) from training samples, so served and trained tokens line up.

    Each sample is a sequence of token ids or a mapping with ``input_ids`` and optionally
    ``loss_mask`` (SpecForge / speculators layout: 1 on assistant tokens). With a loss mask the
    prompt is the prefix before the first masked token (the part the draft was conditioned on);
    without, the whole sequence. ``max_prompt_tokens`` truncates. Samples whose prompt is shorter
    than ``min_prompt_tokens`` are skipped. ``id`` / ``sample_id`` of a mapping become the prompt id.
    """
    out = []
    for i, s in enumerate(samples):
        sid = f"s{i:04d}"
        mask = None
        if isinstance(s, Mapping):
            sid = str(s.get("id", s.get("sample_id", sid)))
            ids, mask = s["input_ids"], s.get("loss_mask")
        else:
            ids = s
        ids = [int(t) for t in np.asarray(ids).reshape(-1).tolist()]
        if mask is not None:
            m = np.asarray(mask).reshape(-1)
            nz = np.flatnonzero(m)
            if len(nz):
                ids = ids[:int(nz[0])]
        if max_prompt_tokens is not None:
            ids = ids[:max_prompt_tokens]
        if len(ids) >= min_prompt_tokens:
            out.append(Prompt(id=sid, input_ids=tuple(ids), kind="training"))
    if not out:
        raise ValueError("no usable training sample (all prompts empty?)")
    return out


def prompts_digest(prompts: Sequence[Prompt]) -> str:
    """sha256 (16 hex) of the prompt contents, to tell prompt sets apart in the ledger."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps(p.request(), sort_keys=True).encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# Pure math: histogram, bootstrap
# --------------------------------------------------------------------------------------------


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
    """Per-position acceptance from a correct-drafts histogram (anchors.md §C6).

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
    w = _weights(len(x), n_boot, np.random.default_rng(seed))
    sx, sy = w @ x, w @ y
    with np.errstate(invalid="ignore", divide="ignore"):
        r = np.where(sy != 0, sx / np.where(sy != 0, sy, 1.0), np.nan)
    lo, hi = _percentile(r, level)
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
        "accept_rate_delta", "accept_rate_delta_lo", "accept_rate_delta_hi"}`` (accept length in
        tokens per verify step, bonus token included; accept rate as a fraction); CI bounds are NaN
        with fewer than 2 paired prompts.

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
    out: dict[str, Any] = {"n_paired": int(len(m))}
    if len(m) == 0:
        for k in ("accept_length", "accept_rate"):
            out.update({f"{k}_delta": float("nan"), f"{k}_delta_lo": float("nan"), f"{k}_delta_hi": float("nan")})
        return out
    f = lambda c: m[c].to_numpy(dtype=np.float64)  # noqa: E731
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


# --------------------------------------------------------------------------------------------
# Running requests
# --------------------------------------------------------------------------------------------

PER_REQUEST_COLUMNS = [
    "idx", "prompt_id", "kind", "prompt_tokens", "completion_tokens", "cached_tokens", "verify_ct",
    "correct_drafts", "proposed_drafts", "hist_correct_drafts", "histogram", "accept_length",
    "accept_rate", "server_accept_length", "latency_s", "e2e_latency_s", "tok_s", "finish_reason",
    "has_spec", "error"]


def _record(i: int, p: Prompt, res: Optional[GenerateResult], error: Optional[str]) -> dict:
    row = {c: None for c in PER_REQUEST_COLUMNS}
    row.update(idx=i, prompt_id=p.id, kind=p.kind, has_spec=False, error=error)
    if res is None:
        return row
    m = res.meta_info
    hist = list(m.spec_correct_drafts_histogram) if m.spec_correct_drafts_histogram else None
    ct = m.completion_tokens if m.completion_tokens is not None else len(res.output_ids)
    fr = m.finish_reason
    row.update(
        prompt_tokens=m.prompt_tokens, completion_tokens=ct, cached_tokens=m.cached_tokens,
        verify_ct=m.spec_verify_ct, correct_drafts=m.spec_num_correct_drafts,
        proposed_drafts=m.spec_num_proposed_drafts,
        hist_correct_drafts=accepted_drafts(hist) if hist else None,
        histogram=json.dumps(hist) if hist is not None else None,
        accept_length=(ct / m.spec_verify_ct) if m.spec_verify_ct else None,
        accept_rate=(m.spec_num_correct_drafts / m.spec_num_proposed_drafts
                     if m.spec_num_proposed_drafts else None),
        server_accept_length=m.spec_accept_length, latency_s=res.latency_s,
        e2e_latency_s=m.e2e_latency, tok_s=(ct / res.latency_s) if res.latency_s > 0 else None,
        finish_reason=(fr.get("type") if isinstance(fr, Mapping) else fr), has_spec=m.has_spec_fields)
    return row


def run_requests(client: SGLangClient, prompts: Sequence[Prompt], *, max_new_tokens: int,
                 concurrency: int = 1, sampling_params: Optional[Mapping[str, Any]] = None,
                 return_hidden_states: bool = False, progress: bool | str = True,
                 keep_raw: bool = False, fail_fast: bool = False
                 ) -> tuple[pd.DataFrame, float, list[Optional[dict]]]:
    """Send every prompt once (``concurrency`` threads, one shared client); collect meta_info.

    Returns ``(per_request DataFrame [PER_REQUEST_COLUMNS], wall seconds, raw)``; ``raw[i]`` is
    the answer's ``meta_info`` dict (hidden states dropped) when ``keep_raw``, else None. A failed
    request gets its ``error`` column set (or raises when ``fail_fast``).
    """
    from tqdm.auto import tqdm

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    sp = dict(sampling_params or {})
    sp["max_new_tokens"] = int(max_new_tokens)
    rows: list[Optional[dict]] = [None] * len(prompts)
    raw: list[Optional[dict]] = [None] * len(prompts)

    def one(i: int) -> None:
        p = prompts[i]
        try:
            res = client.generate(**p.request(), sampling_params=sp,
                                  return_hidden_states=return_hidden_states)
        except SGLangError as exc:
            if fail_fast:
                raise
            rows[i] = _record(i, p, None, str(exc))
            return
        rows[i] = _record(i, p, res, None)
        if keep_raw:
            meta = res.meta_info.model_dump()
            meta.pop("hidden_states", None)
            raw[i] = {"output_ids": list(res.output_ids), "meta_info": meta}

    desc = progress if isinstance(progress, str) else "requests"
    bar = tqdm(total=len(prompts), desc=desc, disable=not progress, leave=False)
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [pool.submit(one, i) for i in range(len(prompts))]
            for f in futures:
                f.result()
                bar.update(1)
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    df = pd.DataFrame(rows, columns=PER_REQUEST_COLUMNS)
    return df, wall, raw


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def summarize(per_request: pd.DataFrame, *, positions: Optional[int], wall_s: float = float("nan"),
              n_boot: int = 2000, level: float = 0.95, seed: int = 0
              ) -> tuple[dict, pd.DataFrame, np.ndarray, list[str]]:
    """Totals, CIs and per-position curves from a per-request frame (:func:`run_requests`).

    ``positions``: draft positions k (``num_steps``; None: from the longest histogram).
    Returns ``(summary, positions_df, summed_histogram, warnings)``. Requests with an error are
    left out; requests without spec fields are left out of the spec figures and counted in
    ``n_missing_spec`` (a warning says so).
    """
    warn: list[str] = []
    ok = per_request[per_request["error"].isna()]
    n_err = int(len(per_request) - len(ok))
    if n_err:
        warn.append(f"{n_err} of {len(per_request)} requests failed and were left out "
                    f"(first error: {per_request.loc[per_request['error'].notna(), 'error'].iloc[0]})")
    spec = ok[ok["has_spec"].astype(bool)]
    n_missing = int(len(ok) - len(spec))
    s: dict[str, Any] = {"n_requests": int(len(ok)), "n_failed": n_err, "n_spec": int(len(spec)),
                         "n_missing_spec": n_missing, "ci_level": level, "n_boot": n_boot}
    comp = ok["completion_tokens"].to_numpy(float)
    lat = ok["latency_s"].to_numpy(float)
    s["completion_tokens"] = int(np.nansum(comp)) if len(ok) else 0
    s["prompt_tokens"] = int(np.nansum(ok["prompt_tokens"].to_numpy(float))) if len(ok) else 0
    s["wall_s"] = float(wall_s)
    s["throughput_tok_s"] = (s["completion_tokens"] / wall_s) if wall_s and wall_s > 0 else float("nan")
    if len(ok):
        s["tok_s"], s["tok_s_lo"], s["tok_s_hi"] = bootstrap_ratio_ci(comp, lat, n_boot=n_boot,
                                                                      level=level, seed=seed)
        s["latency_mean_s"], s["latency_mean_s_lo"], s["latency_mean_s_hi"] = bootstrap_mean_ci(
            lat, n_boot=n_boot, level=level, seed=seed)
        s["latency_p50_s"] = float(np.nanquantile(lat, 0.5))
        s["latency_p90_s"] = float(np.nanquantile(lat, 0.9))
        e2e = ok["e2e_latency_s"].to_numpy(float)
        s["server_e2e_latency_mean_s"] = float(np.nanmean(e2e)) if np.isfinite(e2e).any() else float("nan")
        with np.errstate(invalid="ignore", divide="ignore"):
            s["client_overhead_frac"] = (float(np.nanmean((lat - e2e) / lat))
                                         if np.isfinite(e2e).any() else float("nan"))
    else:
        for k in ("tok_s", "tok_s_lo", "tok_s_hi", "latency_mean_s", "latency_mean_s_lo",
                  "latency_mean_s_hi", "latency_p50_s", "latency_p90_s", "server_e2e_latency_mean_s",
                  "client_overhead_frac"):
            s[k] = float("nan")

    nan = float("nan")
    if len(spec):
        num = spec["completion_tokens"].to_numpy(float)
        ver = spec["verify_ct"].to_numpy(float)
        s["verify_steps"] = int(ver.sum())
        s["accept_length"], s["accept_length_lo"], s["accept_length_hi"] = bootstrap_ratio_ci(
            num, ver, n_boot=n_boot, level=level, seed=seed)
        (s["accept_length_mean_of_ratios"], s["accept_length_mean_of_ratios_lo"],
         s["accept_length_mean_of_ratios_hi"]) = bootstrap_mean_ci(num / ver, n_boot=n_boot,
                                                                  level=level, seed=seed)
        cor = spec["correct_drafts"].to_numpy(float)
        prop = spec["proposed_drafts"].to_numpy(float)
        s["correct_drafts"], s["proposed_drafts"] = int(np.nansum(cor)), int(np.nansum(prop))
        s["accept_rate"], s["accept_rate_lo"], s["accept_rate_hi"] = bootstrap_ratio_ci(
            cor, prop, n_boot=n_boot, level=level, seed=seed)
        hists = [json.loads(h) if isinstance(h, str) else None for h in spec["histogram"]]
        if any(h is None for h in hists):
            warn.append(f"{sum(h is None for h in hists)} answers carry spec_verify_ct but no "
                        "spec_correct_drafts_histogram (SGLang before #18332?): per-position "
                        "acceptance uses the others only")
        have = [h for h in hists if h is not None]
        k = positions if positions is not None else max([len(h) - 1 for h in have] + [0])
        mat = histogram_matrix(have, k + 1) if have else np.zeros((0, k + 1), dtype=np.int64)
        if mat.shape[1] > k + 1:
            warn.append(f"histograms have {mat.shape[1] - 1} positions but num_steps is {k}")
            k = mat.shape[1] - 1
        hist = mat.sum(axis=0)
        pos = bootstrap_positions_ci(mat, k, n_boot=n_boot, level=level, seed=seed) if len(have) else \
            pd.DataFrame(columns=["position", "marginal", "marginal_lo", "marginal_hi",
                                  "conditional", "conditional_lo", "conditional_hi"])
        S, A = int(hist.sum()), accepted_drafts(hist)
        s["hist_verify_steps"], s["hist_accepted_drafts"] = S, A
        if have:
            w = np.array([accepted_drafts(h) for h in have], float)
            st = np.array([sum(h) for h in have], float)
            s["accept_length_hist"], s["accept_length_hist_lo"], s["accept_length_hist_hi"] = (
                bootstrap_ratio_ci(w + st, st, n_boot=n_boot, level=level, seed=seed))
        else:
            s["accept_length_hist"] = s["accept_length_hist_lo"] = s["accept_length_hist_hi"] = nan
        # consistency of SGLang's own counters (a mismatch means a parsing / version problem)
        hv = spec["histogram"].notna()
        bad_steps = (spec.loc[hv, "verify_ct"].to_numpy() !=
                     np.array([sum(json.loads(h)) for h in spec.loc[hv, "histogram"]])).sum()
        bad_acc = (spec.loc[hv, "correct_drafts"].to_numpy() != spec.loc[hv, "hist_correct_drafts"]
                   .to_numpy()).sum()
        if bad_steps or bad_acc:
            warn.append(f"histogram disagrees with spec_verify_ct in {bad_steps} and with "
                        f"spec_num_correct_drafts in {bad_acc} answers")
        s["positions"] = int(k)
    else:
        hist = np.zeros(1 if positions is None else positions + 1, dtype=np.int64)
        pos = pd.DataFrame(columns=["position", "marginal", "marginal_lo", "marginal_hi",
                                    "conditional", "conditional_lo", "conditional_hi"])
        for key in ("accept_length", "accept_length_lo", "accept_length_hi",
                    "accept_length_mean_of_ratios", "accept_length_mean_of_ratios_lo",
                    "accept_length_mean_of_ratios_hi", "accept_rate", "accept_rate_lo",
                    "accept_rate_hi", "accept_length_hist", "accept_length_hist_lo",
                    "accept_length_hist_hi"):
            s[key] = nan
        s.update(verify_steps=0, correct_drafts=0, proposed_drafts=0, hist_verify_steps=0,
                 hist_accepted_drafts=0, positions=positions)
    if n_missing:
        warn.append(f"{n_missing} of {len(ok)} answers have no spec fields (spec_verify_ct absent): "
                    "they are set only on the final chunk and only when the request verified at "
                    "least once (max_new_tokens=1 or an immediate stop never verifies); they are "
                    "left out of the accept figures")
    return s, pos, hist, warn


# --------------------------------------------------------------------------------------------
# Result and measure()
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class AcceptanceResult:
    """Outcome of :func:`measure`.

    Attributes:
        summary: dict of totals and CIs (keys documented in the module docstring and
            :func:`summarize`; plus ``label``, ``url``, spec settings, ``baseline_tok_s``,
            ``speedup``, ``config_digest``, ``prompt_digest``).
        per_request: one row per request (:data:`PER_REQUEST_COLUMNS`).
        positions: per-position marginal / conditional rates with CIs (one row per position).
        histogram: summed correct-drafts histogram ``[num_steps + 1]`` (int64).
        spec: the server's :class:`~helpers.server.settings.EffectiveSpecConfig` (None if unavailable).
        server: redacted ``/server_info`` snapshot (no ``internal_states``, no secrets).
        warnings: human-readable caveats (missing spec fields, overrides, failures).
        baseline: summary of the baseline (target-only) run, when one was given.
        raw: per-request ``{"output_ids", "meta_info"}`` when ``keep_raw=True``.
    """

    summary: dict
    per_request: pd.DataFrame
    positions: pd.DataFrame
    histogram: np.ndarray
    spec: Optional[EffectiveSpecConfig] = None
    server: dict = dataclasses.field(default_factory=dict)
    warnings: list = dataclasses.field(default_factory=list)
    baseline: Optional[dict] = None
    raw: Optional[list] = None

    def summary_frame(self) -> pd.DataFrame:
        """The summary as a one-row DataFrame."""
        return pd.DataFrame([{k: v for k, v in self.summary.items()
                              if not isinstance(v, (list, dict))}])

    def ledger_row(self, fix: Optional[str] = None) -> dict:
        """Flat row for :class:`helpers.ledger.Ledger` (lists/dicts as JSON strings)."""
        row = {}
        for k, v in self.summary.items():
            row[k] = json.dumps(v) if isinstance(v, (list, dict)) else v
        row["fix"] = fix or self.summary.get("label") or "unnamed"
        row["histogram_json"] = json.dumps([int(x) for x in self.histogram])
        row["positions_json"] = self.positions.to_json(orient="records")
        row["warnings_json"] = json.dumps(self.warnings)
        row["overrides_json"] = json.dumps([o.model_dump() for o in self.spec.overrides]
                                           if self.spec else [])
        return row

    def save(self, folder: Path | str) -> Path:
        """Write ``summary.json``, ``per_request.parquet``, ``positions.csv`` into ``folder``
        (created; files written atomically). Returns the folder."""
        from .runfiles import atomic_write_bytes, atomic_write_text, parquet_bytes

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        doc = {"summary": self.summary, "warnings": self.warnings,
               "histogram": [int(x) for x in self.histogram],
               "positions": json.loads(self.positions.to_json(orient="records")),
               "spec": self.spec.model_dump() if self.spec else None, "baseline": self.baseline,
               "server": self.server}
        atomic_write_text(folder / "summary.json", json.dumps(doc, indent=1, default=_json_default))
        atomic_write_bytes(folder / "per_request.parquet", parquet_bytes(self.per_request))
        atomic_write_text(folder / "positions.csv", self.positions.to_csv(index=False))
        if self.raw is not None:
            atomic_write_text(folder / "raw_meta.json", json.dumps(self.raw, default=_json_default))
        return folder


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


#: ServerArgs fields that define a fix for the config digest (what changes acceptance or speed).
DIGEST_FIELDS = (
    "model_path", "speculative_algorithm", "speculative_draft_model_path", "speculative_num_steps",
    "speculative_eagle_topk", "speculative_num_draft_tokens", "speculative_accept_threshold_single",
    "speculative_accept_threshold_acc", "speculative_use_rejection_sampling",
    "speculative_attention_mode", "speculative_adaptive", "speculative_token_map",
    "tp_size", "dp_size", "pp_size", "enable_dp_attention", "dtype", "kv_cache_dtype", "quantization",
    "attention_backend", "sampling_backend", "page_size", "max_running_requests",
    "chunked_prefill_size", "disable_radix_cache", "disable_overlap_schedule", "disable_cuda_graph",
    "enable_return_hidden_states", "forward_hooks", "json_model_override_args", "context_length",
    "revision", "speculative_draft_model_revision", "device", "version")


def server_config(info: Mapping[str, Any]) -> dict:
    """The subset of a (redacted) ``/server_info`` that defines a fix (:data:`DIGEST_FIELDS`)."""
    return {k: info.get(k) for k in DIGEST_FIELDS}


def config_digest(info: Mapping[str, Any]) -> str:
    """sha256 (16 hex) of :func:`server_config` as canonical JSON; no secrets go in."""
    cfg = redact(server_config(info))
    return hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]


def server_snapshot(info: Mapping[str, Any]) -> dict:
    """Redacted ``/server_info`` without the bulky, volatile ``internal_states``."""
    return {k: v for k, v in redact(info).items() if k != "internal_states"}


def measure(client_or_url: "SGLangClient | str | Any", prompts: Any = None, max_new_tokens: int = 128,
            concurrency: int = 1, *, num_prompts: Optional[int] = None,
            sampling_params: Optional[Mapping[str, Any]] = None, temperature: float = 0.0,
            ignore_eos: bool = False, api_key: Optional[str] = None, baseline: Any = None,
            warmup: int = 1, flush_cache: bool = True, n_boot: int = 2000, level: float = 0.95,
            seed: int = 0, return_hidden_states: bool = False, progress: bool = True,
            label: Optional[str] = None, requested: Any = None, keep_raw: bool = False,
            draft_config: Any = None) -> AcceptanceResult:
    """Measure accept length / accept rate / per-position acceptance / tok/s on a live server.

    Args:
        client_or_url: :class:`~helpers.server.client.SGLangClient`, URL, or ``ServerHandle``.
        prompts: None (bundled 48 prompts), a file, or a list (see :func:`load_prompts`;
            training samples via :func:`prompts_from_samples`).
        max_new_tokens: tokens to generate per request (must be >= 2 for any verify step).
        concurrency: requests in flight at once (threads sharing one HTTP client).
        num_prompts: use the first n prompts (cycling when larger than the set).
        sampling_params: extra SGLang sampling params; ``temperature`` / ``ignore_eos`` fill
            their keys unless given there (greedy by default: acceptance is then deterministic
            per prompt; ``ignore_eos=True`` forces full-length answers).
        api_key: used when a URL is given (default ``$SGLANG_API_KEY``).
        baseline: a server without the draft (client / URL / handle) measured with the same
            prompts for ``baseline_tok_s`` and ``speedup``, or a number (tok/s known already).
        warmup: requests sent first and not counted (first-request costs).
        flush_cache: flush before measuring (cold radix cache for every run; this also resets
            ``avg_spec_accept_length``, which is not used here).
        n_boot, level, seed: bootstrap settings.
        return_hidden_states: also request hidden states (to measure capture overhead).
        label: name of the fix (goes into ``summary["label"]``).
        requested: the launch command / args asked for, for the override check
            (:meth:`SGLangClient.effective_spec_config`; default: the server's launch_command).
        keep_raw: keep each answer's ``meta_info`` (``result.raw``).
        draft_config: draft config.json (mapping/path) for the algorithm check.

    Returns: :class:`AcceptanceResult`. Raises :class:`~helpers.errors.SGLangError` when the
    server cannot be reached or every request failed; ValueError on bad arguments.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    own = not isinstance(client_or_url, SGLangClient)
    client = as_client(client_or_url, api_key=api_key)
    try:
        plist = load_prompts(prompts, n=num_prompts)
        sp = dict(sampling_params or {})
        sp.setdefault("temperature", temperature)
        if ignore_eos:
            sp.setdefault("ignore_eos", True)
        info = client.server_info(refresh=True)
        spec: Optional[EffectiveSpecConfig] = None
        warn: list[str] = []
        try:
            spec = client.effective_spec_config(requested, draft_config=draft_config)
        except SGLangError as exc:  # pragma: no cover - model_info missing on exotic servers
            warn.append(f"effective spec config unavailable: {exc}")
        if spec is not None:
            for o in spec.overrides:
                warn.append(f"override: {o.message}")
            warn.extend(spec.notes)
        spec_on = bool(info.get("speculative_algorithm"))
        if not spec_on:
            warn.append("the server runs without speculative decoding: accept length / rate are "
                        "undefined (NaN); tok/s is still measured")
        if max_new_tokens < 2 and spec_on:
            warn.append("max_new_tokens < 2: no request can verify, so no spec fields come back")
        if warmup:
            run_requests(client, plist[:max(1, min(warmup, len(plist)))], max_new_tokens=min(8, max_new_tokens),
                         sampling_params=sp, progress=False)
        if flush_cache:
            client.flush_cache()
        per_request, wall, raw = run_requests(
            client, plist, max_new_tokens=max_new_tokens, concurrency=concurrency, sampling_params=sp,
            return_hidden_states=return_hidden_states, progress=(f"measure {label}" if label and progress
                                                                 else progress), keep_raw=keep_raw)
        if per_request["error"].notna().all():
            raise SGLangError(f"all {len(per_request)} requests failed; first error: "
                              f"{per_request['error'].iloc[0]}", endpoint="/generate")
        positions = info.get("speculative_num_steps") if spec_on else None
        s, pos, hist, w2 = summarize(per_request, positions=positions, wall_s=wall, n_boot=n_boot,
                                     level=level, seed=seed)
        warn.extend(w2)
        s.update({
            "label": label, "url": redact_url(client.url), "sglang_version": info.get("version"),
            "algorithm": info.get("speculative_algorithm"), "num_steps": info.get("speculative_num_steps"),
            "topk": info.get("speculative_eagle_topk"),
            "num_draft_tokens": info.get("speculative_num_draft_tokens"), "tp_size": info.get("tp_size"),
            "draft_model_path": info.get("speculative_draft_model_path"),
            "model_path": info.get("model_path"),
            "max_new_tokens": int(max_new_tokens), "concurrency": int(concurrency),
            "temperature": sp.get("temperature"), "ignore_eos": bool(sp.get("ignore_eos", False)),
            "return_hidden_states": bool(return_hidden_states), "num_prompts": len(plist),
            "prompt_digest": prompts_digest(plist), "config_digest": config_digest(info),
            "overrides": [o.field for o in spec.overrides] if spec else [],
            "timestamp": pd.Timestamp.now(tz="UTC").isoformat(),
        })
        base_summary = None
        s["baseline_tok_s"] = s["baseline_tok_s_lo"] = s["baseline_tok_s_hi"] = float("nan")
        if baseline is not None:
            if isinstance(baseline, (int, float)):
                s["baseline_tok_s"] = float(baseline)
            else:
                bclient = as_client(baseline, api_key=api_key if not isinstance(baseline, SGLangClient)
                                    else None)
                try:
                    base_summary = measure_baseline(bclient, plist, max_new_tokens=max_new_tokens,
                                                    concurrency=concurrency, sampling_params=sp,
                                                    warmup=warmup, n_boot=n_boot, level=level, seed=seed,
                                                    progress=progress)
                finally:
                    if not isinstance(baseline, SGLangClient):
                        bclient.close()
                s["baseline_tok_s"] = base_summary["tok_s"]
                s["baseline_tok_s_lo"] = base_summary["tok_s_lo"]
                s["baseline_tok_s_hi"] = base_summary["tok_s_hi"]
        s["speedup"] = (s["tok_s"] / s["baseline_tok_s"]
                        if s["baseline_tok_s"] and np.isfinite(s["baseline_tok_s"]) else float("nan"))
        return AcceptanceResult(summary=s, per_request=per_request, positions=pos, histogram=hist,
                                spec=spec, server=server_snapshot(info), warnings=warn,
                                baseline=base_summary, raw=raw if keep_raw else None)
    finally:
        if own:
            client.close()


def measure_baseline(client: SGLangClient, prompts: Sequence[Prompt], *, max_new_tokens: int,
                     concurrency: int = 1, sampling_params: Optional[Mapping[str, Any]] = None,
                     warmup: int = 1, n_boot: int = 2000, level: float = 0.95, seed: int = 0,
                     progress: bool = True) -> dict:
    """tok/s of a server without the draft on the same prompts (``summary``-style dict).

    Warns (in ``warnings``) when that server does run speculative decoding after all.
    """
    info = client.server_info(refresh=True)
    if warmup:
        run_requests(client, list(prompts[:max(1, warmup)]), max_new_tokens=min(8, max_new_tokens),
                     sampling_params=sampling_params, progress=False)
    df, wall, _ = run_requests(client, prompts, max_new_tokens=max_new_tokens, concurrency=concurrency,
                               sampling_params=sampling_params,
                               progress="baseline" if progress else False)
    s, _, _, w = summarize(df, positions=None, wall_s=wall, n_boot=n_boot, level=level, seed=seed)
    if info.get("speculative_algorithm"):
        w.append(f"the baseline server runs speculative decoding ({info['speculative_algorithm']})")
    keep = ("n_requests", "completion_tokens", "wall_s", "throughput_tok_s", "tok_s", "tok_s_lo",
            "tok_s_hi", "latency_mean_s", "latency_p50_s", "latency_p90_s")
    out = {k: s[k] for k in keep}
    out.update(url=redact_url(client.url), config_digest=config_digest(info), warnings=w)
    return out


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

SUMMARY_COLUMNS = ("label", "n_requests", "accept_length", "accept_length_lo", "accept_length_hi",
                   "accept_rate", "accept_rate_lo", "accept_rate_hi", "tok_s", "tok_s_lo", "tok_s_hi",
                   "baseline_tok_s", "speedup", "latency_mean_s", "num_steps", "topk",
                   "num_draft_tokens", "config_digest")


def format_summary(summary: Mapping[str, Any]) -> str:
    """Human-readable lines of the main figures with their CIs."""
    def f(k, nd=3):
        v, lo, hi = summary.get(k), summary.get(k + "_lo"), summary.get(k + "_hi")
        if v is None or (isinstance(v, float) and not math.isfinite(v)):
            return "n/a"
        txt = f"{v:.{nd}f}"
        if lo is not None and hi is not None and math.isfinite(lo) and math.isfinite(hi):
            txt += f" [{lo:.{nd}f}, {hi:.{nd}f}]"
        return txt
    lvl = int(round(100 * summary.get("ci_level", 0.95)))
    lines = [
        f"fix: {summary.get('label') or '-'}   server: {summary.get('url')}   config {summary.get('config_digest')}",
        f"spec: {summary.get('algorithm')} steps={summary.get('num_steps')} topk={summary.get('topk')} "
        f"draft_tokens={summary.get('num_draft_tokens')} tp={summary.get('tp_size')}",
        f"requests: {summary.get('n_requests')} ({summary.get('n_missing_spec')} without spec fields, "
        f"{summary.get('n_failed')} failed), concurrency {summary.get('concurrency')}, "
        f"max_new_tokens {summary.get('max_new_tokens')}",
        f"accept length (Σcompletion/Σverify, {lvl}% CI): {f('accept_length')}",
        f"accept length, mean of per-request ratios:   {f('accept_length_mean_of_ratios')}",
        f"accept length, 1 + accepted/steps (hist):     {f('accept_length_hist')}",
        f"accept rate (correct/proposed drafts):        {f('accept_rate')}",
        f"tok/s per request stream:                     {f('tok_s', 1)}   (batch throughput "
        f"{summary.get('throughput_tok_s', float('nan')):.1f} tok/s)",
        f"latency mean (s):                             {f('latency_mean_s')}",
    ]
    if summary.get("baseline_tok_s") is not None and math.isfinite(summary.get("baseline_tok_s", float("nan"))):
        lines.append(f"baseline tok/s: {f('baseline_tok_s', 1)}   speedup x{summary.get('speedup', float('nan')):.2f}")
    return "\n".join(lines)


def cli_main(argv: Sequence[str]) -> int:
    """``python -m helpers measure ...``: measure one server, or run a fixes file (managed mode).

    Exit codes: 0 ok, 1 measurement failed (server errors), 2 bad input.
    """
    ap = argparse.ArgumentParser(
        prog="python -m helpers measure",
        description="Accept length / accept rate / per-position acceptance / tok/s with 95% CIs. "
                    "Attach to a server (--url) or run a fixes file (--fixes). The API key is read "
                    "from $SGLANG_API_KEY (never from the command line).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="server URL, e.g. http://127.0.0.1:30000")
    src.add_argument("--fixes", help="fixes YAML file (managed mode: a server per fix)")
    ap.add_argument("--label", default=None, help="fix name for this measurement")
    ap.add_argument("--prompts", default=None, help="prompt file (.jsonl/.json); default: bundled set")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-flush", action="store_true", help="do not flush the cache first")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--baseline-url", default=None, help="server without the draft, for baseline tok/s")
    ap.add_argument("--requested", default=None,
                    help="launch command as typed, for the override check (default: the server's own)")
    ap.add_argument("--outputs", default=None, help="outputs folder (default: <repo>/outputs)")
    ap.add_argument("--run-dir", default=None, help="existing run folder to append to (ledger.parquet)")
    ap.add_argument("--no-save", action="store_true", help="print only, write nothing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    try:
        args = ap.parse_args(list(argv))
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    from . import ledger as ledger_mod

    if args.fixes:
        try:
            fixes = ledger_mod.load_fixes(args.fixes)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            run_dir = ledger_mod.run_fixes(fixes, outputs=args.outputs, run_dir=args.run_dir,
                                           progress=not args.quiet)
        except ledger_mod.FixFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        df = ledger_mod.Ledger(Path(run_dir) / "ledger.parquet").read()
        cols = [c for c in SUMMARY_COLUMNS if c in df.columns]
        print(df[["fix"] + [c for c in cols if c != "label"]].to_string(index=False))
        print(f"run folder: {run_dir}")
        return 0
    try:
        prompts = load_prompts(args.prompts, n=args.num_prompts)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        res = measure(args.url, prompts, max_new_tokens=args.max_new_tokens,
                      concurrency=args.concurrency, temperature=args.temperature,
                      ignore_eos=args.ignore_eos, warmup=args.warmup, flush_cache=not args.no_flush,
                      n_boot=args.bootstrap, baseline=args.baseline_url, label=args.label,
                      requested=args.requested, progress=not args.quiet)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SGLangError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res.summary, indent=1, default=_json_default))
    else:
        print(format_summary(res.summary))
        if len(res.positions):
            print(res.positions.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for w in res.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not args.no_save:
        run_dir = Path(args.run_dir) if args.run_dir else ledger_mod.new_run_dir(
            f"measure-{args.label or 'server'}", outputs=args.outputs)
        fix = args.label or "server"
        res.save(run_dir / "fixes" / ledger_mod.safe_name(fix))
        ledger_mod.Ledger(run_dir / "ledger.parquet").append(res.ledger_row(fix))
        print(f"run folder: {run_dir}")
    return 0
