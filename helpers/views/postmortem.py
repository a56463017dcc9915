"""The postmortem page (``99_postmortem``): its first screen is :func:`helpers.views.story.first_screen` (one
headline, before / after, the ladder, the flags); then suite status and failures, links to the notebooks' pages, the
verdict summary, and the record the page passes on.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import pandas as pd

from ..investigation.live import contradicting_finding
from ..investigation.story import headline_text
from ..records import InvestigationDoc
from .acceptance import ledger_frame, main_fixes
from .budget import settings_text
from .common import esc, note, read_json_or_none, table_html
from .investigation import load_investigation
from .replay import as_replay, fixes_frame, hypotheses_frame
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


def _first_sentence(text: Optional[str]) -> str:
    """The first sentence of ``text`` (up to the first ". "), without its final full stop."""
    t = (text or "").strip()
    head = t.split(". ")[0]
    return head.rstrip(".") if head else ""


def verdict_differences(run_dir: Path, doc: Optional[Mapping[str, Any]] = None) -> list[str]:
    """One sentence per check whose verdict in the replay (its ``hypothesis`` steps) differs from the blind
    investigation's (``investigation.json``), each verdict with its basis: the replay reports its check's own
    measurement; the blind investigation reports a refutation that a finding of its run contradicts as inconclusive
    (the rule of :func:`helpers.investigation.live.reconcile`, :func:`helpers.investigation.live.
    contradicting_finding`), else its own check's explanation. Empty when they agree or either is missing."""
    inv = load_investigation(run_dir)
    d = as_replay(doc)
    if inv is None or d is None:
        return []
    blind = {h.get("check"): h for h in inv.hypotheses}
    out = []
    for s in d.of_kind("hypothesis"):
        h = blind.get(s.check)
        if h is None or not s.verdict or h.get("verdict") == s.verdict:
            continue
        replay_basis = _first_sentence(s.explanation) or "its check's own measurement"
        hit = contradicting_finding(s.check, inv.findings)
        if h.get("verdict") == "inconclusive" and hit and s.verdict == "refuted":
            blind_basis = (f"the finding {hit[0]} of its run stands ({hit[1]}), and the investigation never "
                           "reports a check refuted while a finding of its run that answers the check's question "
                           "stands: helpers/investigation/live.py::reconcile, a rule the replay's steps do not apply")
        else:
            blind_basis = h.get("short") or _first_sentence(h.get("explanation")) or "its check's own measurement"
        out.append(f"{s.check}: the replay's step {s.index + 1} ('{s.label or s.check}', on '{s.on_fix}') says "
                   f"{s.verdict} ({replay_basis}); the blind investigation says {h.get('verdict')} ({blind_basis}).")
    return out


def verdicts_html(run_dir: Path, doc: Optional[Mapping[str, Any]] = None) -> str:
    """The postmortem's verdicts: :func:`verdict_summary` as an escaped table, then, where the replay and the blind
    investigation disagree on a check, why (:func:`verdict_differences`), each as an escaped note."""
    df = verdict_summary(run_dir, doc)
    if not len(df):
        return note("No hypothesis was run.")
    why = verdict_differences(run_dir, doc)
    return table_html(df) + ("<p><b>Where the replay and the blind investigation disagree</b></p>"
                             + "".join(note(t) for t in why) if why else "")


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
    the settings advice (:func:`helpers.views.budget.settings_text`, the first screen's line, which the suite's
    console prints from here), verdicts and why the replay's and the blind investigation's differ, before/after,
    fixes, failures."""
    inv = load_investigation(run_dir)
    parts = story_parts(doc, inv)
    pair = measured_pair(run_dir, doc, inv, main_fixes(ledger_frame(run_dir)))
    return {"headline": headline_text(parts), "story": parts,
            "flags": flags(pair, inv.acceptance if inv is not None else None, doc),
            "settings": settings_text(inv.acceptance if inv is not None else None, doc)[0],
            "investigation": None if inv is None else inv.sentence, "case": (doc or {}).get("case")
            if isinstance(doc, Mapping) else getattr(doc, "case", None),
            "verdicts": verdict_summary(run_dir, doc).to_dict(orient="records"),
            "verdict_differences": verdict_differences(run_dir, doc),
            "before_after": before_after_frame(pair).to_dict(orient="records"),
            "fixes": fixes_frame(doc).to_dict(orient="records"),
            "failures": failures_frame(suite_status(run_dir)).to_dict(orient="records")}
