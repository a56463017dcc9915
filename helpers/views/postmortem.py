"""The postmortem page (``99_postmortem``): its first screen is :func:`helpers.views.story.first_screen` (one
headline, before / after, the ladder, the flags); then suite status and failures, links to the notebooks' pages, the
verdict summary, and the record the page passes on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pandas as pd

from ..investigation.story import headline_text
from ..records import InvestigationDoc
from .acceptance import ledger_frame, main_fixes
from .common import esc, note, read_json_or_none
from .investigation import load_investigation
from .replay import fixes_frame, hypotheses_frame
from .story import before_after_frame, flags, measured_pair, story_parts


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


def before_after(doc: Optional[Mapping[str, Any]] = None, ledger: Optional[pd.DataFrame] = None, *,
                 run_dir: Optional[Path] = None, inv: Optional[InvestigationDoc] = None) -> pd.DataFrame:
    """Accept rate / length / tok/s before and after the fix with 95% CIs, the change, its paired CI over the same
    prompts, whether it lies outside both CIs, and a note where tok/s does not fit the story
    (:func:`helpers.views.story.before_after_frame` of :func:`helpers.views.story.measured_pair`: the investigation's
    measurement of its fix, else the replay's first and last fixes, else the ledger's). Empty with fewer than two
    fixes."""
    return before_after_frame(measured_pair(run_dir, doc, inv, None if ledger is None else main_fixes(ledger)))


def postmortem_record(run_dir: Path, doc: Optional[Mapping[str, Any]]) -> dict:
    """The postmortem's data (``results/99_postmortem.json``): the headline (plain text) and its parts, the flags,
    verdicts, before/after, fixes, failures."""
    inv = load_investigation(run_dir)
    parts = story_parts(doc, inv)
    pair = measured_pair(run_dir, doc, inv, main_fixes(ledger_frame(run_dir)))
    return {"headline": headline_text(parts), "story": parts,
            "flags": flags(pair, inv.acceptance if inv is not None else None, doc),
            "investigation": None if inv is None else inv.sentence, "case": (doc or {}).get("case")
            if isinstance(doc, Mapping) else getattr(doc, "case", None),
            "verdicts": verdict_summary(run_dir, doc).to_dict(orient="records"),
            "before_after": before_after_frame(pair).to_dict(orient="records"),
            "fixes": fixes_frame(doc).to_dict(orient="records"),
            "failures": failures_frame(suite_status(run_dir)).to_dict(orient="records")}
