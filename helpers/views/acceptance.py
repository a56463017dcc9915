"""The acceptance page (``20_acceptance``): the ledger per fix with CIs, the main fixes, the sweep, a live
measurement.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from ..acceptance.ledger import Ledger
from ..acceptance.measure import measure
from ..acceptance.prompts import load_prompts
from ..acceptance.stats import format_ci
from .budget import budget_parts
from .common import RunContext, connect, read_json_or_none
from .investigation import load_investigation


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
    Returns the summary dict.

    Raises:
        helpers.errors.BadInput: the run folder is a finished run the user did not name (before any request)."""
    ctx.require_writable("measuring acceptance")

    client = connect(ctx)
    try:
        res = measure(client, load_prompts(prompts or None, n=count), max_new_tokens=max_new_tokens,
                      concurrency=concurrency, ignore_eos=True, label=label, progress=False)
    finally:
        client.close()
    saved = res.record(ctx.run_dir, label, under="acceptance")
    return {**res.summary, "saved_to": str(saved.relative_to(ctx.run_dir))}


def investigation_measurements(run_dir: Path) -> pd.DataFrame:
    """The before / after measurements of the run folder's live investigation (``investigation.json`` ``measured
    .saved_to``: ``acceptance/before``, ``acceptance/after``) as ledger-like rows (``fix`` = the measurement's label,
    accept length / rate / tok/s with CIs, ``positions_json``, ``histogram_json``), so that the ledger's tables and
    charts draw them; empty when the investigation measured nothing. The same prompts were measured on both servers
    (:func:`helpers.investigation.live.investigate`)."""
    doc = load_investigation(run_dir)
    rows = []
    for rel in ((doc.measured or {}).get("saved_to") or []) if doc is not None else []:
        saved = read_json_or_none(Path(run_dir) / rel / "summary.json") or {}
        summary = saved.get("summary") or {}
        if not summary:
            continue
        row = {k: v for k, v in summary.items() if not isinstance(v, (list, dict))}
        row.update(fix=summary.get("label") or Path(rel).name, saved_to=rel,
                   histogram_json=json.dumps(saved.get("histogram") or []),
                   positions_json=json.dumps(saved.get("positions") or []))
        rows.append(row)
    return pd.DataFrame(rows)


def measured_fixes(run_dir: Path, ledger: pd.DataFrame) -> pd.DataFrame:
    """What the acceptance page draws: the investigation's before / after (:func:`investigation_measurements`; a
    measurement the ledger holds already, as a replay's fix does, once), then the ledger's fixes (:func:`main_fixes`)."""
    inv, led = investigation_measurements(run_dir), main_fixes(ledger)
    if len(inv) and led is not None and len(led) and "saved_to" in led.columns:
        inv = inv[~inv["saved_to"].isin(set(led["saved_to"].astype(str)))]   # a replay's fix: in the ledger already
    parts = [f for f in (inv, led) if f is not None and len(f)]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def acceptance_budget(run_dir: Path, replay: Any = None) -> list:
    """The investigation's acceptance budget (``investigation.json`` key ``acceptance``) as the page parts of
    :func:`helpers.views.budget.budget_parts` (a heading, the cause, the ladder with the settings line and the gains,
    the waterfall and ladder figures, losses, other settings, the fix proven offline; ``replay``: the run folder's
    replay, whose sweep the settings line compares); an empty list when the investigation has none."""
    doc = load_investigation(run_dir)
    if doc is None or not doc.acceptance:
        return []
    return ["<h3>Acceptance budget: where the accept length goes</h3>"] + budget_parts(doc.acceptance, doc=replay)
