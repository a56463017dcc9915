"""The postmortem page (``99_postmortem``): suite status and failures, links to the notebooks' pages, the verdict
summary, before / after, and the record the page passes on.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pandas as pd

from ..acceptance.stats import format_ci
from .acceptance import ledger_frame, main_fixes
from .common import esc, note, read_json_or_none
from .investigation import load_investigation
from .replay import _num, fixes_frame, headline, hypotheses_frame


def suite_status(run_dir: Path) -> dict:
    """``suite_status.json`` of the run folder ({} when the notebooks run outside the suite)."""
    return read_json_or_none(Path(run_dir) / "suite_status.json") or {}


def failures_frame(status: Mapping[str, Any]) -> pd.DataFrame:
    """Failed notebooks: notebook, cell (execution count / index), error (``ename: evalue``)."""
    rows = []
    for nb, e in (status.get("notebooks") or {}).items():
        if e.get("ok"):
            continue
        cell = e.get("exec_count") if e.get("exec_count") is not None else e.get("cell_index")
        err = f"{e.get('ename')}: {e.get('evalue')}" if e.get("ename") else e.get("error", "")
        rows.append({"notebook": nb, "cell": "" if cell is None else cell, "error": str(err)[:1500],
                     "html": e.get("html") or ""})
    return pd.DataFrame(rows)


def failures_html(status: Mapping[str, Any]) -> str:
    """:func:`failures_frame` as an escaped table with links to each failed notebook's HTML."""
    df = failures_frame(status)
    if df.empty:
        return '<p>All notebooks before this one ran without error.</p>' if status.get("notebooks") else \
            note("No suite status (this notebook ran outside the suite runner).")
    rows = "".join(
        f"<tr><td>{_link(r['html'], r['notebook'])}</td><td>{esc(r['cell'])}</td>"
        f"<td><pre style=\"white-space:pre-wrap;margin:0\">{esc(r['error'])}</pre></td></tr>"
        for _, r in df.iterrows())
    return (f'<table class="e3f-table"><tr><th>notebook</th><th>cell</th><th>error</th></tr>{rows}</table>')


def _link(href: str, text: str) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>' if href else esc(text)


def notebook_links_html(status: Mapping[str, Any], notebooks: Sequence[str] = ()) -> str:
    """Links to each notebook's HTML page (``html/<nb>.html``) with its status and wall time."""
    entries = status.get("notebooks") or {}
    names = list(entries) + [n for n in notebooks if n not in entries]
    items = []
    for nb in names:
        e = entries.get(nb, {})
        state = "ok" if e.get("ok") else ("FAILED" if e else "")
        href = e.get("html") or f"html/{nb}.html"
        wall = f", {e['wall_s']} s" if e.get("wall_s") is not None else ""
        items.append(f"<li>{_link(href, nb)} <span class=\"e3f-note\">{esc(state)}{esc(wall)}</span></li>")
    return "<ul>" + "".join(items) + "</ul>" if items else note("No notebooks recorded.")


def verdict_summary(run_dir: Path, doc: Optional[Mapping[str, Any]] = None) -> pd.DataFrame:
    """Every hypothesis verdict of the run: the replay's steps, then the blind investigation's
    (``investigation.json``, confirmed first). Columns: step, label, check, question, verdict, expected, as expected,
    source."""
    rows = []
    for _, r in hypotheses_frame(doc).iterrows():
        rows.append({"step": r["step"], "label": r["label"], "check": r["check"],
                     "question": r.get("question") or "", "verdict": r["verdict"],
                     "expected": r["expected"], "as expected": r["as expected"], "source": "replay"})
    inv = load_investigation(run_dir)
    for h in (inv.hypotheses if inv is not None else []):
        rows.append({"step": "", "label": "blind investigation", "check": h.get("check"),
                     "question": h.get("question") or "", "verdict": h.get("verdict"), "expected": "",
                     "as expected": "", "source": "investigation (investigation.json)"})
    return pd.DataFrame(rows)


def before_after(doc: Optional[Mapping[str, Any]] = None, ledger: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Accept rate / length / tok/s of the first fix (before) and the last fix (after) with 95% CIs, and
    whether the change is outside both CIs, and the paired CI of the change over the same prompts
    (the replay's ``fix_effect``, :func:`helpers.acceptance.stats.paired_effect`). From the replay (or, without one, the ledger's first and last
    main-fix rows). Empty with fewer than two fixes."""
    fx = fixes_frame(doc)
    if len(fx):
        fx = fx[~fx["baseline"] & (fx["error"] == "")]
    elif ledger is not None and len(main_fixes(ledger)):
        led = main_fixes(ledger)
        fx = pd.DataFrame({k: pd.to_numeric(led.get(k), errors="coerce") for k in
                           ("accept_length", "accept_length_lo", "accept_length_hi", "accept_rate",
                            "accept_rate_lo", "accept_rate_hi", "tok_s", "tok_s_lo", "tok_s_hi")})
        fx["fix"] = led["fix"].astype(str)
    if len(fx) < 2:
        return pd.DataFrame()
    a, b = fx.iloc[0], fx.iloc[-1]
    eff = (doc or {}).get("fix_effect") or {}
    rows = []
    for k, label, pct in (("accept_rate", "accept rate", True), ("accept_length", "accept length", False),
                          ("tok_s", "tok/s", False)):
        sep = ""
        if all(math.isfinite(_num(v)) for v in (a[k + "_lo"], a[k + "_hi"], b[k + "_lo"], b[k + "_hi"])):
            sep = "yes" if (b[k + "_lo"] > a[k + "_hi"] or b[k + "_hi"] < a[k + "_lo"]) else "no"
        paired = ""
        if all(math.isfinite(_num(eff.get(f"{k}_delta{x}"))) for x in ("", "_lo", "_hi")):
            paired = (format_ci(eff, f"{k}_delta", pct=pct, signed=True, unit="")
                      + f"{' points' if pct else ''} over {eff.get('n_paired')} prompts")
        elif k == "tok_s" and eff:
            paired = "n/a (wall-clock speed of two servers is not paired per prompt)"
        rows.append({"metric": label, f"before: {a['fix']}": format_ci(a, k, pct=pct),
                     f"after: {b['fix']}": format_ci(b, k, pct=pct),
                     "change": (f"{b[k] - a[k]:+.2f}" if not pct else f"{100 * (b[k] - a[k]):+.1f} points")
                     if math.isfinite(_num(a[k])) and math.isfinite(_num(b[k])) else "",
                     "outside both 95% CIs": sep,
                     "paired 95% CI of the change": paired})
    return pd.DataFrame(rows)


def postmortem_record(run_dir: Path, doc: Optional[Mapping[str, Any]]) -> dict:
    """The postmortem's data (``results/99_postmortem.json``): headline, verdicts, before/after, failures."""
    inv = load_investigation(run_dir)
    return {"headline": inv.sentence if inv is not None and not doc else headline(doc),
            "investigation": None if inv is None else inv.sentence, "case": (doc or {}).get("case"),
            "verdicts": verdict_summary(run_dir, doc).to_dict(orient="records"),
            "before_after": before_after(doc, ledger_frame(run_dir)).to_dict(orient="records"),
            "fixes": fixes_frame(doc).to_dict(orient="records"),
            "failures": failures_frame(suite_status(run_dir)).to_dict(orient="records")}
