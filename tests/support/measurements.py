"""Per-request frames of a measurement (the columns of helpers.acceptance.requests.PER_REQUEST_COLUMNS) with a given
time per verify step and accept length, and the machine's load as helpers.acceptance.machine.LoadSampler records it:
for the speed and first-screen tests, which compute every figure from these frames."""
from __future__ import annotations

import numpy as np
import pandas as pd

from helpers.acceptance.measure import summarize


def frame(rng: np.random.Generator, n: int, verify: int, ms_per_step: float, al: float) -> pd.DataFrame:
    """``n`` requests (prompt ids ``p0`` ...) of ``verify`` verify steps each at ``ms_per_step`` (+-5 % noise),
    ``al`` tokens per verify step, 3 drafts proposed per step."""
    v = np.full(n, verify)
    lat = v * ms_per_step / 1e3 * rng.uniform(0.95, 1.05, n)
    comp = np.round(v * al).astype(int)
    return pd.DataFrame({"idx": range(n), "prompt_id": [f"p{i}" for i in range(n)], "kind": "x", "prompt_tokens": 20,
                         "completion_tokens": comp, "cached_tokens": 0, "verify_ct": v,
                         "correct_drafts": comp - v, "proposed_drafts": 3 * v, "hist_correct_drafts": None,
                         "histogram": None, "accept_length": comp / v, "accept_rate": (comp - v) / (3 * v),
                         "server_accept_length": None, "latency_s": lat, "e2e_latency_s": lat, "tok_s": comp / lat,
                         "finish_reason": "length", "has_spec": True, "error": None})


def machine(runnable: float, cores: int = 2) -> dict:
    """A LoadSampler result with ``runnable`` tasks on ``cores`` cores through the measurement."""
    return {"cpu_count": cores, "loadavg_before": [runnable, 1.0, 1.0], "loadavg_after": [runnable, 1.0, 1.0],
            "runnable_mean": runnable, "runnable_max": int(runnable) + 1, "samples": 40}


def summary(df: pd.DataFrame, load: dict | None) -> dict:
    """The measurement's summary (helpers.acceptance.measure.summarize) with chain settings 3/1/4 and ``machine``."""
    s, *_ = summarize(df, positions=3, wall_s=float(df["latency_s"].sum()))
    return {**s, "num_steps": 3, "topk": 1, "num_draft_tokens": 4, "algorithm": "EAGLE3", "machine": load}
