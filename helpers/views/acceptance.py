"""The acceptance page (``20_acceptance``): the ledger per fix with CIs, the main fixes, the sweep, a live
measurement.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from ..acceptance.ledger import Ledger
from ..acceptance.measure import measure
from ..acceptance.prompts import load_prompts
from ..acceptance.stats import format_ci
from ..runfiles import safe_name
from .common import RunContext, connect


def ledger_frame(run_dir: Path) -> pd.DataFrame:
    """The run folder's ``ledger.parquet`` (empty frame when absent)."""
    p = Path(run_dir) / "ledger.parquet"
    if not p.exists():
        return pd.DataFrame()

    return Ledger(p).read()


def acceptance_table(ledger: pd.DataFrame) -> pd.DataFrame:
    """Ledger rows for reading: fix, accept length / rate / tok/s with 95% CIs, requests, num_steps, topk."""
    if ledger is None or ledger.empty:
        return pd.DataFrame()

    rows = []
    for _, r in ledger.iterrows():
        rows.append({"fix": r.get("fix"), "accept length [95% CI]": format_ci(r, "accept_length"),
                     "accept rate [95% CI]": format_ci(r, "accept_rate", pct=True),
                     "tok/s [95% CI]": format_ci(r, "tok_s", digits=1), "requests": r.get("n_requests"),
                     "num_steps": r.get("num_steps"), "topk": r.get("topk"),
                     "draft tokens": r.get("num_draft_tokens")})
    return pd.DataFrame(rows)


def main_fixes(ledger: pd.DataFrame) -> pd.DataFrame:
    """Ledger rows of the fixes themselves (sweep rows ``<fix> | num_steps=N`` left out)."""
    if ledger is None or ledger.empty or "fix" not in ledger.columns:
        return pd.DataFrame() if ledger is None else ledger
    return ledger[~ledger["fix"].astype(str).str.contains(r" \| num_steps=", regex=True)].reset_index(drop=True)


def sweep_rows(ledger: pd.DataFrame) -> pd.DataFrame:
    """Ledger rows of a num_steps sweep."""
    if ledger is None or ledger.empty or "fix" not in ledger.columns:
        return pd.DataFrame()
    return ledger[ledger["fix"].astype(str).str.contains(r" \| num_steps=", regex=True)].reset_index(drop=True)


def measure_live(ctx: RunContext, label: str, *, count: int = 24, max_new_tokens: int = 64,
                 concurrency: int = 4, prompts: Any = None) -> dict:
    """Measure acceptance on the live server, save ``acceptance/<label>/`` and append to the ledger.
    Returns the summary dict."""

    client = connect(ctx)
    try:
        res = measure(client, load_prompts(prompts or None, n=count), max_new_tokens=max_new_tokens,
                      concurrency=concurrency, ignore_eos=True, label=label, progress=False)
    finally:
        client.close()
    saved = res.save(ctx.run_dir / "acceptance" / safe_name(label))
    row = res.ledger_row(label)
    row["saved_to"] = str(saved.relative_to(ctx.run_dir))
    Ledger(ctx.run_dir / "ledger.parquet").append([row])
    return {**res.summary, "saved_to": row["saved_to"]}
