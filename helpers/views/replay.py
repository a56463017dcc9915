"""The replay page (``00_replay``) and the pieces other pages reuse: the replay document, its headline, the
fixes and hypotheses tables, the accept-rate timeline and the num_steps sweep.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from ..acceptance.stats import format_ci
from ..acceptance.sweeps import steps_sweep_verdict
from ..errors import BadInput
from ..investigation.catalog import CATALOG
from ..investigation.replay import headline_parts, replay_case
from ..plots.acceptance import nice_step, tok_s_vs_steps
from ..records import REPLAY_STEP, ReplayDoc
from .common import VERDICT_COLORS, RunContext, esc, headline_box, show, verdict_badge, write_result


def as_replay(doc: Any) -> Optional[ReplayDoc]:
    """A replay document as :class:`helpers.records.ReplayDoc` (a dict, as read from JSON, is validated)."""
    if doc is None or isinstance(doc, ReplayDoc):
        return doc
    return ReplayDoc.model_validate(doc)


def as_step(step: Any):
    """One replay step, typed (:data:`helpers.records.REPLAY_STEP`)."""
    return step if not isinstance(step, Mapping) else REPLAY_STEP.validate_python(dict(step))


def run_or_load_replay(ctx: RunContext, *, progress: bool = False) -> Optional[dict]:
    """Replay the case of ``ctx.case_path`` into ``ctx.run_dir`` (or load a complete replay of it already there);
    record the case path in ``results/00_replay.json``. Returns the replay document, None without a case.
    The API key, if any, is read from the environment variable named by ``ctx.api_key_env``.

    Raises:
        helpers.errors.BadInput: a replay would be written into a run folder that holds one already, or into a
            finished run the user did not name (before any work)."""

    case = ctx.load_case()
    if case is None:
        return ctx.replay
    doc = as_replay(ctx.replay)
    if doc is None or not doc.complete or doc.case != case.name:
        ctx.require_writable("replaying the case")
        if any(ctx.run_dir.glob("results/replay-*.json")):
            raise BadInput("this run folder already holds a replay (of another case, or incomplete); a replay is "
                           "never written over another: leave run_dir empty for a new run folder",
                           path=ctx.run_dir, field="run_dir")
        key = os.environ.get(ctx.api_key_env) or None
        doc = replay_case(case, ctx.run_dir, progress=progress, api_key=key)
    ctx.replay = doc
    write_result(ctx, "00_replay", {
        "case_path": str(ctx.case_path), "case": doc.case, "headline": doc.headline,
        "complete": doc.complete, "wall_s": doc.wall_s,
        "models": {"target": str(ctx.target_dir), "draft": str(ctx.draft_dir), "training": str(ctx.training)},
        "hypotheses": [{"index": s.index, "check": s.check, "label": s.label, "verdict": s.verdict,
                        "expect": s.expect, "as_expected": s.as_expected} for s in doc.of_kind("hypothesis")],
        "errors": [{"index": s.index, "kind": s.kind, "error": s.error} for s in doc.steps if s.error]})
    return doc


def headline(doc: Optional[Mapping[str, Any]]) -> str:
    """The replay's one-sentence headline (plain text), or a sentence saying why there is none."""
    doc = as_replay(doc)
    if not doc:
        return "No replay in this run folder (no case file was given)."
    return str(doc.headline or "The replay recorded no headline (no step finished).")


def headline_html(doc: Optional[Mapping[str, Any]], inv: Any = None) -> str:
    """The replay's headline as one escaped box (:func:`helpers.views.common.headline_box` of
    :func:`helpers.investigation.replay.headline_parts`; ``inv``: the run folder's investigation record, told again
    once the replay measured its fix), with the case title."""
    d = as_replay(doc)
    if not d or not d.steps:
        return f'<div class="e3f-headline">{esc(headline(doc))}</div>'
    title = f'<div class="e3f-note">Case: {esc(d.title)}</div>' if d.title else ""
    return headline_box(headline_parts(list(d.steps), d.fix_effect, inv)) + title


def story_html(doc: Optional[Mapping[str, Any]]) -> str:
    """The case's title and story (free text from the case file), escaped; "" without a story."""
    doc = as_replay(doc)
    if not doc or not (doc.story or "").strip():
        return ""
    paras = [p.strip() for p in str(doc.story).split("\n\n") if p.strip()]
    return (f'<p><b>{esc(doc.title or doc.case or "")}</b></p>'
            + "".join(f"<p>{esc(' '.join(p.split()))}</p>" for p in paras))


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def fixes_frame(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per fix step: step, fix, accept length / rate / tok/s with 95% CI bounds, requests, error.

    Columns: ``step`` (1-based), ``fix``, ``accept_length``, ``accept_length_lo``, ``accept_length_hi``,
    ``accept_rate``, ``accept_rate_lo``, ``accept_rate_hi``, ``tok_s``, ``tok_s_lo``, ``tok_s_hi``,
    ``n_requests``, ``baseline``, ``error``.
    """
    rows = []
    d = as_replay(doc)
    for s in (d.of_kind("fix") if d else []):
        sm = s.summary or {}
        row = {"step": s.index + 1, "fix": s.name or "(fix)"}
        for k in ("accept_length", "accept_rate", "tok_s"):
            for suf in ("", "_lo", "_hi"):
                row[k + suf] = _num(sm.get(k + suf))
        row["n_requests"] = sm.get("n_requests")
        row["baseline"] = bool(s.baseline)
        row["error"] = s.error or s.server_error or ""
        rows.append(row)
    return pd.DataFrame(rows)


def fixes_display(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """:func:`fixes_frame` formatted for reading: ``value [lo, hi]`` strings."""
    df = fixes_frame(doc)
    if df.empty:
        return df

    return pd.DataFrame({"step": df["step"], "fix": df["fix"],
                         "accept length [95% CI]": [format_ci(r, "accept_length") for _, r in df.iterrows()],
                         "accept rate [95% CI]": [format_ci(r, "accept_rate", pct=True) for _, r in df.iterrows()],
                         "tok/s [95% CI]": [format_ci(r, "tok_s", digits=1) for _, r in df.iterrows()],
                         "requests": df["n_requests"], "error": df["error"]})


def hypotheses_frame(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per hypothesis step: step, label, check, question, verdict, expected, as_expected, on_fix."""
    rows = []
    d = as_replay(doc)
    for s in (d.of_kind("hypothesis") if d else []):
        rows.append({"step": s.index + 1, "label": s.label, "check": s.check, "question": s.question,
                     "verdict": s.verdict or ("error" if s.error else ""), "expected": s.expect or "",
                     "as expected": "" if s.as_expected is None else ("yes" if s.as_expected else "NO"),
                     "on fix": s.on_fix, "error": s.error or ""})
    return pd.DataFrame(rows)


def step_html(step: Mapping[str, Any]) -> str:
    """Header block of one hypothesis step: label, question, verdict badge, expected verdict, explanation
    (all escaped)."""
    step = as_step(step)
    n = step.index + 1
    label = f" &middot; {esc(step.label)}" if step.label else ""
    expected = ""
    if step.expect:
        mark = "as expected" if step.as_expected else "NOT as expected"
        expected = f' &nbsp; expected {verdict_badge(step.expect)} <span class="e3f-note">({mark})</span>'
    err = f'<p style="color:#c62828">{esc(step.error)}</p>' if step.error else ""
    return (f'<div class="e3f-step"><b>Step {n}: {esc(step.check)}</b>{label}'
            f'<br><i>{esc(step.question)}</i>'
            f'<br>verdict {verdict_badge(step.verdict or ("error" if step.error else None))}{expected}'
            f'<p>{esc(step.explanation)}</p>{err}'
            f'<span class="e3f-note">on fix: {esc(step.on_fix)}; {esc(step.wall_s if step.wall_s is not None else "")} s'
            '</span></div>')


def evidence_frame(step: Mapping[str, Any]) -> pd.DataFrame:
    """The step's evidence table (records -> DataFrame; empty when none)."""
    ev = as_step(step).evidence or []
    return pd.DataFrame(ev) if ev else pd.DataFrame()


def load_figure(run_dir: Path, rel: Optional[str]):
    """A plotly figure saved as JSON in the run folder (``figures/...``), or None."""
    if not rel:
        return None
    p = Path(run_dir) / rel
    if not p.exists():
        return None

    return pio.from_json(p.read_text())


def _step_label(s) -> str:
    """The x-axis label of a timeline step: the fix's name, what a hypothesis asks (its check's title), the
    investigation, the sweep."""
    if s.kind == "fix":
        return s.name or "fix"
    if s.kind == "hypothesis":
        return CATALOG.get(s.check, (s.check,))[0] + "?"
    if s.kind == "investigate":
        return "blind investigation"
    return "num_steps sweep"


def timeline_figure(doc: Optional[Mapping[str, Any]], *, title: str = "Accept rate per fix along the timeline"):
    """Accept rate per fix (points with 95% CI bars, x = timeline step; no line between fixes: the steps between
    them are not measured) and accept length on the right axis (round ticks); every hypothesis as a vertical line
    coloured by its verdict, with a marker whose hover says what it asked and found; the investigation as a purple
    line; sweeps as grey bands. Each step is named on the x axis (``1. as deployed``, ``3. Embedding all-reduce?``).

    Returns a ``plotly.graph_objects.Figure`` (empty axes when there are no steps).
    """

    d = as_replay(doc)
    steps = list(d.steps) if d else []
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fx = fixes_frame(doc)
    fx = fx[~fx["baseline"]] if len(fx) else fx
    if len(fx):
        y = 100 * fx["accept_rate"]
        fig.add_trace(go.Scatter(
            x=fx["step"], y=y, mode="markers", name="accept rate (95% CI)", text=[esc(f) for f in fx["fix"]],
            marker=dict(size=12, color="#1565c0"),
            error_y=dict(type="data", array=(100 * (fx["accept_rate_hi"] - fx["accept_rate"])).clip(lower=0)
                         .fillna(0).tolist(),
                         arrayminus=(100 * (fx["accept_rate"] - fx["accept_rate_lo"])).clip(lower=0)
                         .fillna(0).tolist(), visible=True),
            hovertemplate="step %{x}: %{text}<br>accept rate %{y:.1f}%<extra></extra>"), secondary_y=False)
        fig.add_trace(go.Scatter(
            x=fx["step"], y=fx["accept_length"], mode="markers", name="accept length (95% CI)",
            marker=dict(size=9, symbol="diamond", color="#ef6c00"),
            error_y=dict(type="data", array=(fx["accept_length_hi"] - fx["accept_length"]).clip(lower=0)
                         .fillna(0).tolist(),
                         arrayminus=(fx["accept_length"] - fx["accept_length_lo"]).clip(lower=0)
                         .fillna(0).tolist(), visible=True),
            hovertemplate="step %{x}: accept length %{y:.2f}<extra></extra>"), secondary_y=True)
    seen = set()
    for s in steps:
        x = s.index + 1
        if s.kind == "hypothesis":
            v = s.verdict or "inconclusive"
            color = VERDICT_COLORS.get(v, "#616161")
            fig.add_vline(x=x, line=dict(color=color, width=2, dash="dash"))
            asked = s.question or CATALOG.get(s.check, ("", ""))[1]
            fig.add_trace(go.Scatter(
                x=[x], y=[0], mode="markers", marker=dict(symbol="triangle-up", size=11, color=color),
                name=v, legendgroup=v, showlegend=v not in seen,
                hovertext=esc(f"step {x}: {asked} Verdict: {v}" + (f" (expected {s.expect})" if s.expect else "")
                              + (f" [{s.label}]" if s.label else "")),
                hoverinfo="text"), secondary_y=False)
            seen.add(v)
        elif s.kind == "investigate":
            fig.add_vline(x=x, line=dict(color="#6a1b9a", width=3))
        elif s.kind == "sweep":
            fig.add_vrect(x0=x - 0.4, x1=x + 0.4, fillcolor="#9e9e9e", opacity=0.15, line_width=0)
            fig.add_annotation(x=x, y=0.02, yref="paper", showarrow=False,
                               text=esc(_sweep_label(s)), font=dict(size=10))
    fig.update_layout(title=title, template="plotly_white", height=520,
                      margin=dict(l=60, r=60, t=90, b=60), legend=dict(orientation="h", x=0, y=1.02,
                                                                       yanchor="bottom"))
    fig.update_xaxes(title_text="timeline step", range=[0.5, max([len(steps), 1]) + 0.5], tickangle=-35,
                     tickvals=[s.index + 1 for s in steps],
                     ticktext=[esc(f"{s.index + 1}. {_step_label(s)}") for s in steps], automargin=True)
    fig.update_yaxes(title_text="accept rate (%)", range=[-5, 105], tickvals=[0, 20, 40, 60, 80, 100],
                     secondary_y=False)
    top = float(np.nanmax(fx["accept_length_hi"].to_numpy(float))) if len(fx) and \
        np.isfinite(fx["accept_length_hi"].to_numpy(float)).any() else 1.0
    # round ticks, in the same -5..105 % frame as the left axis: 0 lines up, the top leaves room for the CI bar
    dtick = nice_step(top)
    span = dtick * np.ceil(top / dtick)
    fig.update_yaxes(title_text="accept length", secondary_y=True, showgrid=False, dtick=dtick, tick0=0,
                     range=[-0.05 * span, 1.05 * span])
    return fig


def sweep_points(doc: Optional[Mapping[str, Any]]) -> list[dict]:
    """Points of the (last) num_steps sweep, each ``{num_steps, tok_s, tok_s_lo, tok_s_hi, accept_length,
    ..., fix}``; empty without a sweep."""
    d = as_replay(doc)
    sweeps = [s for s in (d.of_kind("sweep") if d else []) if s.points]
    if not sweeps:
        return []
    s = sweeps[-1]
    return [dict(p, fix=f"{s.on_fix} | num_steps={p.get('num_steps')}", topk=p.get("topk") or 1) for p in s.points]


def _sweep_label(s) -> str:
    """The short word on one sweep step (:func:`helpers.acceptance.sweeps.steps_sweep_verdict`'s ``label``)."""
    v = steps_sweep_verdict(s.points or [])
    return v["label"] if v else "no point measured"


def sweep_figure(doc: Optional[Mapping[str, Any]]):
    """tok/s (and accept length) against num_steps for the replay's sweep (:func:`helpers.plots.acceptance.
    tok_s_vs_steps`), or None without a sweep. Points the sweep took from the fix's own measurement
    (``reused``) are included."""

    pts = sweep_points(doc)
    if not pts:
        return None
    s = as_replay(doc).of_kind("sweep")[-1]
    return tok_s_vs_steps(pts, title=f"tok/s vs num_steps (sweep on '{esc(s.on_fix)}'; {esc(_sweep_label(s))})")


def hypothesis_steps(doc: Optional[Mapping[str, Any]], check: str) -> list[dict]:
    """The replay's steps that ran ``check``."""
    d = as_replay(doc)
    return [s for s in (d.of_kind("hypothesis") if d else []) if s.check == check]


def show_hypothesis(step: Mapping[str, Any], run_dir: Path) -> None:
    """Display one hypothesis step: header (:func:`step_html`), evidence table, figure."""
    show(step_html(step))
    ev = evidence_frame(step)
    if len(ev):
        show(ev)
    fig = load_figure(run_dir, as_step(step).figure)
    if fig is not None:
        show(fig)


def show_timeline(doc: Optional[Mapping[str, Any]], run_dir: Path) -> None:
    """Display every step of a replay in order (hypotheses in full, fixes as a one-line summary)."""
    d = as_replay(doc)
    for s in (d.steps if d else []):
        if s.kind == "hypothesis":
            show_hypothesis(s, run_dir)
        elif s.kind == "investigate":
            show(investigation_html(s))
        elif s.kind == "fix":
            sm = s.summary or {}
            txt = (f"Step {s.index + 1}: fix '{s.name}'" + (" (proposed by the investigation)" if s.proposed else "")
                   + (" (target only, baseline)" if s.baseline else "")
                   + (f": accept length {_num(sm.get('accept_length')):.2f}, accept rate "
                      f"{100 * _num(sm.get('accept_rate')):.1f}%, {_num(sm.get('tok_s')):.1f} tok/s"
                      if sm else "")
                   + (f"; server start {s.server_startup_s} s" if s.server_startup_s else ""))
            problem = s.error or s.server_error
            err = f'<p style="color:#c62828">{esc(problem)}</p>' if problem else ""
            show(f'<div class="e3f-step" style="background:#fafafa"><b>{esc(txt)}</b>{err}</div>')
        elif s.kind == "sweep":
            v = steps_sweep_verdict(s.points or [])
            show(f'<div class="e3f-step"><b>Step {s.index + 1}: num_steps sweep</b> '
                 f'{esc(v["text"] if v else "no point measured")}'
                 + (f'<p style="color:#c62828">{esc(s.error)}</p>' if s.error else "") + "</div>")


def investigation_html(step: Any) -> str:
    """One investigation step: its one-sentence verdict, the proposed fix and how long naming the fault took."""
    s = as_step(step)
    fix = s.proposed_fix or {}
    took = f"{s.seconds_to_verdict:.0f} s" if s.seconds_to_verdict is not None else "n/a"
    err = f'<p style="color:#c62828">{esc(s.error)}</p>' if s.error else ""
    return (f'<div class="e3f-step" style="border-left:4px solid #6a1b9a"><b>Step {s.index + 1}: blind investigation '
            f'of \'{esc(s.on_fix)}\'</b> verdict {esc(s.verdict)} (named in {esc(took)})<p>{esc(s.sentence)}</p>'
            + (f'<p>proposed fix: {esc(fix.get("summary", ""))}</p>' if fix else "") + err + "</div>")
