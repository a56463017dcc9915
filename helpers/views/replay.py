"""The replay page (``00_replay``) and the pieces other pages reuse: the replay document, its headline, the
fixes and hypotheses tables, the accept-rate timeline and the num_steps sweep.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional
import numpy as np
import pandas as pd
from .common import RunContext, VERDICT_COLORS, esc, show, verdict_badge, write_result


def run_or_load_replay(ctx: RunContext, *, rerun: bool = False, progress: bool = False) -> Optional[dict]:
    """Replay the case of ``ctx.case_path`` into ``ctx.run_dir`` (or load a complete replay already there unless ``rerun``);
    record the case path in ``results/00_replay.json``. Returns the replay document, None without a case.
    The API key, if any, is read from the environment variable named by ``ctx.api_key_env``."""
    from ..investigation.replay import replay_case

    case = ctx.load_case()
    if case is None:
        return ctx.replay
    doc = ctx.replay
    if rerun or doc is None or not doc.get("complete") or doc.get("case") != case.name:
        key = os.environ.get(ctx.api_key_env) or None
        doc = replay_case(case, ctx.run_dir, progress=progress, api_key=key)
    ctx.replay = doc
    write_result(ctx.run_dir, "00_replay", {
        "case_path": str(ctx.case_path), "case": doc.get("case"), "headline": doc.get("headline"),
        "complete": doc.get("complete"), "wall_s": doc.get("wall_s"),
        "models": {"target": str(ctx.target_dir), "draft": str(ctx.draft_dir), "training": str(ctx.training)},
        "hypotheses": [{"index": s.get("index"), "check": s.get("check"), "label": s.get("label"),
                        "verdict": s.get("verdict"), "expect": s.get("expect"), "as_expected": s.get("as_expected")}
                       for s in doc.get("steps", []) if s.get("kind") == "hypothesis"],
        "errors": [{"index": s.get("index"), "kind": s.get("kind"), "error": s.get("error")}
                   for s in doc.get("steps", []) if s.get("error")]})
    return doc


def headline(doc: Optional[Mapping[str, Any]]) -> str:
    """The replay's one-sentence headline (plain text), or a sentence saying why there is none."""
    if not doc:
        return "No replay in this run folder (no case file was given)."
    return str(doc.get("headline") or "The replay recorded no headline (no step finished).")


def headline_html(doc: Optional[Mapping[str, Any]]) -> str:
    """:func:`headline` in a highlighted, escaped block, with the case title."""
    title = esc((doc or {}).get("title") or "")
    sub = f'<div class="e3f-note">Case: {title}</div>' if title else ""
    return f'<div class="e3f-headline">{esc(headline(doc))}{sub}</div>'


def story_html(doc: Optional[Mapping[str, Any]]) -> str:
    """The case's title and story (free text from the case file), escaped; "" without a story."""
    if not doc or not (doc.get("story") or "").strip():
        return ""
    paras = [p.strip() for p in str(doc["story"]).split("\n\n") if p.strip()]
    return (f'<p><b>{esc(doc.get("title") or doc.get("case") or "")}</b></p>'
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
    for s in (doc or {}).get("steps", []):
        if s.get("kind") != "fix":
            continue
        sm = s.get("summary") or {}
        row = {"step": int(s.get("index", 0)) + 1, "fix": s.get("name") or "(fix)"}
        for k in ("accept_length", "accept_rate", "tok_s"):
            for suf in ("", "_lo", "_hi"):
                row[k + suf] = _num(sm.get(k + suf))
        row["n_requests"] = sm.get("n_requests")
        row["baseline"] = bool(s.get("baseline"))
        row["error"] = s.get("error") or s.get("server_error") or ""
        rows.append(row)
    return pd.DataFrame(rows)


def fixes_display(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """:func:`fixes_frame` formatted for reading: ``value [lo, hi]`` strings."""
    df = fixes_frame(doc)
    if df.empty:
        return df

    def ci(r, k, pct=False, nd=2):
        v, lo, hi = r[k], r[k + "_lo"], r[k + "_hi"]
        if not math.isfinite(v):
            return ""
        f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.{nd}f}")
        return f"{f(v)} [{f(lo)}, {f(hi)}]" if math.isfinite(lo) and math.isfinite(hi) else f(v)

    return pd.DataFrame({"step": df["step"], "fix": df["fix"],
                         "accept length [95% CI]": [ci(r, "accept_length") for _, r in df.iterrows()],
                         "accept rate [95% CI]": [ci(r, "accept_rate", pct=True) for _, r in df.iterrows()],
                         "tok/s [95% CI]": [ci(r, "tok_s", nd=1) for _, r in df.iterrows()],
                         "requests": df["n_requests"], "error": df["error"]})


def hypotheses_frame(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per hypothesis step: step, label, check, question, verdict, expected, as_expected, on_fix."""
    rows = []
    for s in (doc or {}).get("steps", []):
        if s.get("kind") != "hypothesis":
            continue
        rows.append({"step": int(s.get("index", 0)) + 1, "label": s.get("label") or "",
                     "check": s.get("check") or "", "question": s.get("question") or "",
                     "verdict": s.get("verdict") or ("error" if s.get("error") else ""),
                     "expected": s.get("expect") or "",
                     "as expected": "" if s.get("as_expected") is None else ("yes" if s["as_expected"] else "NO"),
                     "on fix": s.get("on_fix") or "", "error": s.get("error") or ""})
    return pd.DataFrame(rows)


def step_html(step: Mapping[str, Any]) -> str:
    """Header block of one hypothesis step: label, question, verdict badge, expected verdict, explanation
    (all escaped)."""
    n = int(step.get("index", 0)) + 1
    label = f" &middot; {esc(step['label'])}" if step.get("label") else ""
    exp = step.get("expect")
    expected = ""
    if exp:
        ok = step.get("as_expected")
        mark = "as expected" if ok else "NOT as expected"
        expected = f' &nbsp; expected {verdict_badge(exp)} <span class="e3f-note">({mark})</span>'
    err = f'<p style="color:#c62828">{esc(step["error"])}</p>' if step.get("error") else ""
    return (f'<div class="e3f-step"><b>Step {n}: {esc(step.get("check", ""))}</b>{label}'
            f'<br><i>{esc(step.get("question", ""))}</i>'
            f'<br>verdict {verdict_badge(step.get("verdict") or ("error" if step.get("error") else None))}{expected}'
            f'<p>{esc(step.get("explanation", ""))}</p>{err}'
            f'<span class="e3f-note">on fix: {esc(step.get("on_fix", ""))}; {esc(step.get("wall_s", ""))} s</span></div>')


def evidence_frame(step: Mapping[str, Any]) -> pd.DataFrame:
    """The step's evidence table (records -> DataFrame; empty when none)."""
    ev = step.get("evidence") or []
    return pd.DataFrame(ev) if ev else pd.DataFrame()


def load_figure(run_dir: Path, rel: Optional[str]):
    """A plotly figure saved as JSON in the run folder (``figures/...``), or None."""
    if not rel:
        return None
    p = Path(run_dir) / rel
    if not p.exists():
        return None
    import plotly.io as pio

    return pio.from_json(p.read_text())


def timeline_figure(doc: Optional[Mapping[str, Any]], *, title: str = "Accept rate per fix along the timeline"):
    """Accept rate per fix (points with 95% CI bars, x = timeline step) with every hypothesis as a vertical
    line annotated with its check and coloured by its verdict; accept length on the right axis; sweeps as
    grey bands labelled with the best num_steps.

    Returns a ``plotly.graph_objects.Figure`` (empty axes when there are no steps).
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = list((doc or {}).get("steps", []))
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fx = fixes_frame(doc)
    fx = fx[~fx["baseline"]] if len(fx) else fx
    if len(fx):
        y = 100 * fx["accept_rate"]
        fig.add_trace(go.Scatter(
            x=fx["step"], y=y, mode="markers+lines+text", name="accept rate (95% CI)",
            text=[esc(f) for f in fx["fix"]],
            textposition=["top right" if i == 0 and len(fx) > 1 else "top left" if i == len(fx) - 1 and len(fx) > 1
                          else "top center" for i in range(len(fx))],
            marker=dict(size=12, color="#1565c0"), line=dict(color="#1565c0", width=1, dash="dot"),
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
        x = int(s.get("index", 0)) + 1
        if s.get("kind") == "hypothesis":
            v = s.get("verdict") or "inconclusive"
            color = VERDICT_COLORS.get(v, "#616161")
            fig.add_vline(x=x, line=dict(color=color, width=2, dash="dash"))
            fig.add_annotation(x=x, y=1.0, yref="paper", text=esc(s.get("label") or s.get("check")),
                               textangle=-60, showarrow=False, font=dict(color=color, size=10),
                               xanchor="left", yanchor="bottom")
            fig.add_trace(go.Scatter(
                x=[x], y=[0], mode="markers", marker=dict(symbol="triangle-up", size=11, color=color),
                name=v, legendgroup=v, showlegend=v not in seen,
                hovertext=esc(f"step {x}: {s.get('check')}: {v}" + (f" (expected {s['expect']})"
                                                                       if s.get("expect") else "")),
                hoverinfo="text"), secondary_y=False)
            seen.add(v)
        elif s.get("kind") == "sweep":
            fig.add_vrect(x0=x - 0.4, x1=x + 0.4, fillcolor="#9e9e9e", opacity=0.15, line_width=0)
            best = s.get("best_num_steps")
            fig.add_annotation(x=x, y=0.02, yref="paper", showarrow=False,
                               text=f"sweep: best num_steps={esc(best)}", font=dict(size=10))
    fig.update_layout(title=title, template="plotly_white", height=480,
                      margin=dict(l=60, r=60, t=130, b=60), legend=dict(orientation="h", y=-0.18))
    fig.update_xaxes(title_text="timeline step", dtick=1, range=[0.5, max([len(steps), 1]) + 0.5])
    fig.update_yaxes(title_text="accept rate (%)", range=[-5, 105], secondary_y=False)
    top = float(np.nanmax(fx["accept_length_hi"].to_numpy(float))) if len(fx) and \
        np.isfinite(fx["accept_length_hi"].to_numpy(float)).any() else 1.0
    # same -5..105 % frame as the left axis: 0 lines up, and the top leaves room for the CI bar
    fig.update_yaxes(title_text="accept length", secondary_y=True, showgrid=False,
                     range=[-0.05 * top * 1.1, 1.05 * top * 1.1])
    return fig


def sweep_points(doc: Optional[Mapping[str, Any]]) -> list[dict]:
    """Points of the (last) num_steps sweep, each ``{num_steps, tok_s, tok_s_lo, tok_s_hi, accept_length,
    ..., fix}``; empty without a sweep."""
    sweeps = [s for s in (doc or {}).get("steps", []) if s.get("kind") == "sweep" and s.get("points")]
    if not sweeps:
        return []
    s = sweeps[-1]
    return [dict(p, fix=f"{s.get('on_fix')} | num_steps={p.get('num_steps')}", topk=p.get("topk") or 1)
            for p in s["points"]]


def sweep_figure(doc: Optional[Mapping[str, Any]]):
    """tok/s (and accept length) against num_steps for the replay's sweep (:func:`helpers.plots.acceptance.
    tok_s_vs_steps`), or None without a sweep. Points the sweep took from the fix's own measurement
    (``reused``) are included."""
    from ..plots.acceptance import tok_s_vs_steps

    pts = sweep_points(doc)
    if not pts:
        return None
    s = [x for x in (doc or {}).get("steps", []) if x.get("kind") == "sweep"][-1]
    return tok_s_vs_steps(pts, title=f"tok/s vs num_steps (sweep on '{esc(s.get('on_fix'))}'; best "
                                     f"num_steps={esc(s.get('best_num_steps'))})")


def hypothesis_steps(doc: Optional[Mapping[str, Any]], check: str) -> list[dict]:
    """The replay's steps that ran ``check``."""
    return [s for s in (doc or {}).get("steps", []) if s.get("kind") == "hypothesis" and s.get("check") == check]


def show_hypothesis(step: Mapping[str, Any], run_dir: Path) -> None:
    """Display one hypothesis step: header (:func:`step_html`), evidence table, figure."""
    show(step_html(step))
    ev = evidence_frame(step)
    if len(ev):
        show(ev)
    fig = load_figure(run_dir, step.get("figure"))
    if fig is not None:
        show(fig)


def show_timeline(doc: Optional[Mapping[str, Any]], run_dir: Path) -> None:
    """Display every step of a replay in order (hypotheses in full, fixes as a one-line summary)."""
    for s in (doc or {}).get("steps", []):
        if s.get("kind") == "hypothesis":
            show_hypothesis(s, run_dir)
        elif s.get("kind") == "fix":
            sm = s.get("summary") or {}
            txt = (f"Step {int(s.get('index', 0)) + 1}: fix '{s.get('name')}'"
                   + (" (target only, baseline)" if s.get("baseline") else "")
                   + (f": accept length {_num(sm.get('accept_length')):.2f}, accept rate "
                      f"{100 * _num(sm.get('accept_rate')):.1f}%, {_num(sm.get('tok_s')):.1f} tok/s"
                      if sm else "")
                   + (f"; server start {s.get('server_startup_s')} s" if s.get("server_startup_s") else ""))
            problem = s.get("error") or s.get("server_error")
            err = f'<p style="color:#c62828">{esc(problem)}</p>' if problem else ""
            show(f'<div class="e3f-step" style="background:#fafafa"><b>{esc(txt)}</b>{err}</div>')
        elif s.get("kind") == "sweep":
            pts = ", ".join(f"{p.get('num_steps')}: {_num(p.get('tok_s')):.1f} tok/s" for p in s.get("points", []))
            show(f'<div class="e3f-step"><b>Step {int(s.get("index", 0)) + 1}: num_steps sweep</b> '
                 f'{esc(pts)}; best num_steps = {esc(s.get("best_num_steps"))}'
                 + (f'<p style="color:#c62828">{esc(s["error"])}</p>' if s.get("error") else "") + "</div>")
