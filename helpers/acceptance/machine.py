"""What the machine was doing while a measurement ran, and whether it explains a change of tok/s.

tok/s is wall-clock speed: on a machine whose cores are shared (other developers' servers, a CI runner), it moves
with the load whatever the server does. A measurement therefore records the load around and during it
(:class:`LoadSampler`), and :func:`speed_change` says whether a change of tok/s between two measurements of the same
prompts is what the fix did or what the machine did:

* with the same settings (``num_steps``, ``topk``, ``num_draft_tokens``) a verify step runs the same forwards whatever
  the draft is fed, so a fix that raises the accept length needs fewer of them for the same tokens: by itself it cannot
  make a **token take longer**; a token that does take longer, paired per prompt, is the machine's (or something this
  run did not record), not the fix's;
* the load model: ``C`` cores shared by ``R`` runnable tasks (the kernel's instantaneous count, field 4 of
  ``/proc/loadavg``, sampled through the measurement; the sampler itself left out) give a task
  ``min(1, C / R)`` of a core, so a verify step takes ``max(1, R / C)`` times as long as on an idle machine;
  two measurements' ratio of that factor is the slowdown the load change predicts.

Only the machine this tool runs on is seen: when the server runs elsewhere its load is unknown (said so).
"""
from __future__ import annotations

import math
import os
import threading
import time
from typing import Any, Mapping, Optional

import numpy as np
import pandas as pd

from .stats import _percentile, _weights

#: seconds between two samples of /proc/loadavg during a measurement
SAMPLE_S = 0.25
LOADAVG = "/proc/loadavg"


def _runnable() -> Optional[int]:
    """Runnable tasks right now (``/proc/loadavg`` field 4, ``running/total``), less this reader; None off Linux."""
    try:
        with open(LOADAVG, encoding="ascii") as f:
            return max(0, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        return None


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def cpu_count() -> int:
    """Cores this process may run on (``sched_getaffinity``; ``os.cpu_count()`` where that is missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class LoadSampler:
    """Context manager: the machine's load before, during and after a block (a measurement's requests).

    ``result`` (after exit): ``{"cpu_count", "loadavg_before": [1, 5, 15 min], "loadavg_after": [...],
    "runnable_mean", "runnable_max", "samples", "seconds", "source"}``; ``runnable_*`` is None where
    ``/proc/loadavg`` is not readable (then the 1-minute averages before and after stand in). The sampling thread
    is a daemon and is joined on exit.
    """

    def __init__(self, every_s: float = SAMPLE_S):
        self.every_s = float(every_s)
        self._stop = threading.Event()
        self._samples: list[int] = []
        self._thread: Optional[threading.Thread] = None
        self.result: dict = {}

    def _run(self) -> None:
        while not self._stop.is_set():
            r = _runnable()
            if r is not None:
                self._samples.append(r)
            self._stop.wait(self.every_s)

    def __enter__(self) -> "LoadSampler":
        self._t0 = time.monotonic()
        self.result = {"cpu_count": cpu_count(), "loadavg_before": _loadavg()}
        self._thread = threading.Thread(target=self._run, name="e3f-load-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        s = self._samples
        self.result.update(loadavg_after=_loadavg(), samples=len(s), seconds=round(time.monotonic() - self._t0, 2),
                           runnable_mean=round(float(np.mean(s)), 2) if s else None,
                           runnable_max=int(max(s)) if s else None,
                           source=(f"{LOADAVG} field 4 (runnable tasks) sampled every {self.every_s:g} s, and "
                                   "os.getloadavg() before / after" if s else "os.getloadavg() before / after"))


def runnable(machine: Optional[Mapping[str, Any]]) -> Optional[float]:
    """The runnable tasks during a measurement (the sampled mean; else the mean of the 1-minute load averages before
    and after); None when nothing was recorded."""
    if not machine:
        return None
    if machine.get("runnable_mean") is not None:
        return float(machine["runnable_mean"])
    ab = [m[0] for m in (machine.get("loadavg_before"), machine.get("loadavg_after")) if m]
    return float(np.mean(ab)) if ab else None


def slowdown(machine: Optional[Mapping[str, Any]]) -> Optional[float]:
    """``max(1, R / C)``: how many times longer a task takes than on an idle machine (module docstring)."""
    r = runnable(machine)
    if r is None:
        return None
    return max(1.0, r / max(1, int(machine.get("cpu_count") or 1)))


def time_per_token_ratio(before: pd.DataFrame, after: pd.DataFrame, *, n_boot: int = 4000, level: float = 0.95,
                         seed: Optional[int] = 0) -> dict:
    """How many times as long a completion token took after as before (wall-clock latency summed over requests /
    completion tokens summed: the inverse of the tok/s ratio), paired per prompt with a percentile-bootstrap CI
    (prompts resampled jointly).

    Args:
        before / after: ``per_request`` frames of :func:`helpers.acceptance.measure.measure` (``prompt_id``,
            ``latency_s`` in seconds, ``completion_tokens``, ``error``).

    Returns:
        ``{"n_paired", "before_ms", "after_ms", "ratio", "ratio_lo", "ratio_hi"}`` (milliseconds per completion token);
        NaN where fewer than 2 prompts pair.
    """
    cols = ["prompt_id", "latency_s", "completion_tokens"]

    def clean(df):
        if df is None or any(c not in df.columns for c in cols):
            return pd.DataFrame(columns=cols)
        ok = pd.to_numeric(df["completion_tokens"], errors="coerce").fillna(0) > 0
        if "error" in df.columns:
            ok &= df["error"].isna() | df["error"].astype(str).isin(("", "None"))
        return df.loc[ok, cols].drop_duplicates("prompt_id")

    m = clean(before).merge(clean(after), on="prompt_id", suffixes=("_a", "_b"))
    nan = float("nan")
    out = {"n_paired": int(len(m)), "before_ms": nan, "after_ms": nan, "ratio": nan, "ratio_lo": nan,
           "ratio_hi": nan}
    if len(m) < 2:
        return out
    la, ca, lb, cb = (m[c].to_numpy(np.float64) for c in ("latency_s_a", "completion_tokens_a", "latency_s_b",
                                                          "completion_tokens_b"))
    out["before_ms"], out["after_ms"] = 1e3 * la.sum() / ca.sum(), 1e3 * lb.sum() / cb.sum()
    out["ratio"] = out["after_ms"] / out["before_ms"]
    w = _weights(len(m), n_boot, np.random.default_rng(seed))
    with np.errstate(invalid="ignore", divide="ignore"):
        r = ((w @ lb) / (w @ cb)) / ((w @ la) / (w @ ca))
    lo, hi = _percentile(r, level)
    out["ratio_lo"], out["ratio_hi"] = float(lo), float(hi)
    return out


SETTINGS_KEYS = ("num_steps", "topk", "num_draft_tokens", "algorithm")


def _f(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def _fmt_load(m: Optional[Mapping[str, Any]]) -> str:
    if not m:
        return "not recorded"
    r = runnable(m)
    la = [x[0] for x in (m.get("loadavg_before"), m.get("loadavg_after")) if x]
    avg = f"1-min load average {la[0]:.1f} -> {la[-1]:.1f}" if len(la) == 2 else ""
    return (f"{r:.1f} runnable task(s) on {m.get('cpu_count')} core(s)" if r is not None else "no runnable count") \
        + (f" ({avg})" if avg else "")


def speed_change(before: Mapping[str, Any], after: Mapping[str, Any], before_frame: Optional[pd.DataFrame],
                 after_frame: Optional[pd.DataFrame], *, local: bool = True) -> dict:
    """Whether a change of tok/s between two measurements of the same prompts is the fix's or the machine's.

    With the same settings (``num_steps``, ``topk``, ``num_draft_tokens``, algorithm) a verify step runs the same
    forwards whatever the draft is fed, so a fix that raises the accept length needs fewer of them for the same tokens:
    by itself it cannot make a token take longer. When tok/s nevertheless moves against the accept length beyond both
    CIs, the time per token's change (paired per prompt, :func:`time_per_token_ratio`) is set against the slowdown the
    machine's recorded load predicts (:func:`slowdown` after / before).

    Args:
        before / after: the two summaries (:func:`helpers.acceptance.measure.summarize` keys ``tok_s``, ``tok_s_lo``,
            ``tok_s_hi``, ``accept_length``, the settings ``num_steps`` / ``topk`` / ``num_draft_tokens`` /
            ``algorithm``, and ``machine``: :class:`LoadSampler`'s result, absent in runs before it was recorded).
        before_frame / after_frame: their ``per_request`` frames (the time per token, paired per prompt).
        local: the server runs on this machine (the load recorded is the server's).

    Returns:
        ``{"contradicts": bool, "tok_s": [before, after], "accept_length": [before, after], "outside_cis": bool,
        "paired_against": bool, "same_settings": bool, "token_time": time_per_token_ratio(...), "predicted":
        float|None, "explained": True|False|None, "local", "load": [before machine, after machine], "lags": bool,
        "text": str}``: ``contradicts`` when tok/s moves against the accept length with both tok/s CIs apart, or with
        the paired time per token's CI beyond 1 (``paired_against``); ``lags`` when the accept length moved beyond its
        CIs and tok/s did not follow beyond its own without contradicting (``text`` then gives the figures);
        ``explained`` True when the predicted slowdown
        reaches the time-per-token ratio's CI bound nearest to 1 (the load can account for it all), False when it
        does not, None when the tool cannot tell (no load recorded, a remote server, other settings); ``text`` says
        which, with the numbers (empty when nothing contradicts).
    """
    t = [_f(before.get("tok_s")), _f(after.get("tok_s"))]
    al = [_f(before.get("accept_length")), _f(after.get("accept_length"))]
    lo_a, hi_a, lo_b, hi_b = (_f(x) for x in (before.get("tok_s_lo"), before.get("tok_s_hi"), after.get("tok_s_lo"),
                                              after.get("tok_s_hi")))
    outside = all(math.isfinite(x) for x in (lo_a, hi_a, lo_b, hi_b)) and (lo_b > hi_a or hi_b < lo_a)
    al_bounds = [_f(x.get(k)) for x in (before, after) for k in ("accept_length_lo", "accept_length_hi")]
    al_moved = all(math.isfinite(x) for x in al_bounds) and (al_bounds[2] > al_bounds[1] or al_bounds[3] < al_bounds[0])
    against = all(math.isfinite(x) for x in t + al) and (t[1] - t[0]) * (al[1] - al[0]) < 0
    same = all(before.get(k) == after.get(k) for k in SETTINGS_KEYS)
    tt = time_per_token_ratio(before_frame, after_frame)
    # paired per prompt: a token took longer (accept length up) / less long (down) beyond the CI
    paired_against = math.isfinite(tt["ratio_lo"]) and math.isfinite(al[1] - al[0]) and (
        tt["ratio_lo"] > 1.0 if al[1] > al[0] else tt["ratio_hi"] < 1.0)
    ma, mb = before.get("machine"), after.get("machine")
    sa, sb = slowdown(ma), slowdown(mb)
    pred = None if sa is None or sb is None else sb / sa
    out = {"contradicts": bool(against and (outside or paired_against)), "tok_s": t, "accept_length": al,
           "outside_cis": bool(outside), "paired_against": bool(paired_against), "same_settings": same,
           "token_time": tt, "predicted": pred, "explained": None, "local": local, "load": [ma, mb], "text": "",
           "lags": False}
    if not out["contradicts"]:
        if al_moved and not (outside and not against) and math.isfinite(tt["ratio"]) and \
                tt["ratio_lo"] <= 1.0 <= tt["ratio_hi"]:
            # the accept length moved beyond its CIs, tok/s did not follow beyond its own: say what is known
            out["lags"] = True
            load = "" if pred is None else f"; the load went from {_fmt_load(ma)} to {_fmt_load(mb)} (x{pred:.2f})"
            out["text"] = (f"tok/s {t[0]:.1f} -> {t[1]:.1f} did not follow accept length {al[0]:.2f} -> {al[1]:.2f} "
                           f"beyond its CIs: a token took x{tt['ratio']:.2f} [{tt['ratio_lo']:.2f}, "
                           f"{tt['ratio_hi']:.2f}] as long, paired over {tt['n_paired']} prompts (the CI reaches 1: "
                           f"this measurement cannot tell){load}")
        return out
    head = (f"tok/s {t[0]:.1f} -> {t[1]:.1f} moves against accept length {al[0]:.2f} -> {al[1]:.2f}"
            + (", outside both 95% CIs" if outside else " (the tok/s CIs overlap; paired per prompt, beyond the CI)"))
    if not same:
        diff = ", ".join(f"{k} {before.get(k)} -> {after.get(k)}" for k in SETTINGS_KEYS
                         if before.get(k) != after.get(k))
        out["text"] = (f"{head}: not attributable to the fix alone: the two servers ran other settings ({diff}), "
                       "so a verify step does different work")
        return out
    r = tt["ratio"]
    tok = (f"a token took {tt['before_ms']:.0f} -> {tt['after_ms']:.0f} ms (x{r:.2f} [{tt['ratio_lo']:.2f}, "
           f"{tt['ratio_hi']:.2f}], paired over {tt['n_paired']} prompts) with the same settings, where a fix "
           "that raises the accept length needs fewer verify steps of the same forwards") if math.isfinite(r) else \
        "the time per token could not be paired over the prompts"
    if not local:
        out["text"] = (f"{head}: not attributable to the fix: {tok}; the server runs on another machine, whose load "
                       "this tool cannot see")
        return out
    if pred is None or not math.isfinite(r):
        out["text"] = (f"{head}: not attributable to the fix: {tok}; this run recorded no machine load for the "
                       "two measurements, so the tool cannot tell how much the machine explains")
        return out
    load = f"the machine's load went from {_fmt_load(ma)} to {_fmt_load(mb)}, which predicts x{pred:.2f}"
    slower = r >= 1.0
    bound = tt["ratio_lo"] if slower else tt["ratio_hi"]
    if (pred >= bound) if slower else (pred <= bound):
        out["explained"] = True
        out["text"] = (f"{head}: the machine, not the fix: {tok}; {load}: the change lies within what the load "
                       "change explains")
    else:
        out["explained"] = False
        out["text"] = (f"{head}: not attributable to the fix: {tok}; {load}, short of the x{bound:.2f} the CI "
                       "allows at its nearest: the load this run recorded does not explain it")
    return out
