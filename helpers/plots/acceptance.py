"""Plotly figures of acceptance per fix, built from ledger rows (:mod:`helpers.acceptance.ledger`).

* :func:`accept_length_by_fix`: accept length per fix with CI error bars (left axis), tok/s per fix
  with CI and the baseline tok/s as a dashed line (right axis).
* :func:`position_curves`: per-position acceptance, marginal r_i (solid) and conditional α_i
  (dashed), with CI bars, one colour per fix.
* :func:`accept_length_histogram`: share of verify steps by tokens emitted per step (accepted
  drafts + 1 bonus), one bar group per fix.
* :func:`tok_s_vs_steps`: tok/s (and accept length) against ``num_steps``, one line per topk.

All take a ledger DataFrame (or one :meth:`helpers.acceptance.measure.AcceptanceResult.ledger_row` per
item) and return ``plotly.graph_objects.Figure``. :func:`report_html` / :func:`write_report` put
several figures in one self-contained HTML page that embeds plotly.js exactly once (no CDN, so it
renders offline); :func:`offline_notebook` does the same for Jupyter.
"""
from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.offline import init_notebook_mode
from plotly.subplots import make_subplots

from ..runfiles import atomic_write_text

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")


def _frame(ledger: pd.DataFrame | Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    df = ledger.copy() if isinstance(ledger, pd.DataFrame) else pd.DataFrame(list(ledger))
    if "error" in df.columns:
        df = df[df["error"].isna() | (df["error"] == "")]
    if "accept_length" not in df.columns and "tok_s" not in df.columns:
        return df.iloc[0:0]
    return df.reset_index(drop=True)


def _labels(df: pd.DataFrame) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for name in df.get("fix", pd.Series([f"row {i}" for i in range(len(df))])).astype(str):
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name} #{seen[name]}")
    return out


def _err(df: pd.DataFrame, col: str) -> Optional[dict]:
    lo, hi = f"{col}_lo", f"{col}_hi"
    if lo not in df.columns or hi not in df.columns:
        return None
    v = df[col].astype(float).to_numpy()
    plus = np.clip(df[hi].astype(float).to_numpy() - v, 0, None)
    minus = np.clip(v - df[lo].astype(float).to_numpy(), 0, None)
    return dict(type="data", array=np.nan_to_num(plus).tolist(), arrayminus=np.nan_to_num(minus).tolist(),
                visible=True)


def _finite(x: Any) -> bool:
    try:
        return x is not None and math.isfinite(float(x))
    except (TypeError, ValueError):
        return False


def accept_length_by_fix(ledger: pd.DataFrame | Sequence[Mapping[str, Any]], *,
                         title: str = "Accept length per fix") -> go.Figure:
    """Bars: accept length (Σcompletion/Σverify) per fix with its CI; markers: tok/s per fix
    with CI on the right axis; dashed line: baseline tok/s (target only) when known.

    Uses ledger columns ``fix, accept_length[_lo/_hi], tok_s[_lo/_hi], baseline_tok_s``.
    """
    df = _frame(ledger)
    names = _labels(df)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    if len(df):
        fig.add_trace(go.Bar(x=names, y=df["accept_length"].astype(float), name="accept length",
                             error_y=_err(df, "accept_length"), marker_color=PALETTE[0],
                             hovertemplate="%{x}: %{y:.3f} tokens/verify<extra></extra>"),
                      secondary_y=False)
        if "tok_s" in df.columns:
            fig.add_trace(go.Scatter(x=names, y=df["tok_s"].astype(float), name="tok/s",
                                     mode="markers+lines", error_y=_err(df, "tok_s"),
                                     marker=dict(color=PALETTE[1], size=10), line=dict(width=1),
                                     hovertemplate="%{x}: %{y:.1f} tok/s<extra></extra>"),
                          secondary_y=True)
        base = [float(b) for b in df.get("baseline_tok_s", pd.Series(dtype=float)) if _finite(b)]
        if base:
            b = float(np.median(base))
            fig.add_trace(go.Scatter(x=[names[0], names[-1]], y=[b, b], mode="lines",
                                     name=f"baseline tok/s ({b:.1f})",
                                     line=dict(color=PALETTE[7], dash="dash")), secondary_y=True)
    lvl = _level(df)
    fig.update_layout(title=f"{title} (error bars: {lvl}% bootstrap CI)", bargap=0.35,
                      legend=dict(orientation="h", y=-0.2), template="plotly_white")
    fig.update_yaxes(title_text="accept length (tokens per verify step)", secondary_y=False,
                     rangemode="tozero")
    fig.update_yaxes(title_text="tok/s per request", secondary_y=True, rangemode="tozero",
                     showgrid=False)
    fig.update_xaxes(title_text="fix")
    return fig


def _level(df: pd.DataFrame) -> int:
    if "ci_level" in df.columns and len(df) and _finite(df["ci_level"].iloc[0]):
        return int(round(100 * float(df["ci_level"].iloc[0])))
    return 95


def _positions_of(row: Mapping[str, Any]) -> pd.DataFrame:
    pj = row.get("positions_json")
    if isinstance(pj, str) and pj:
        return pd.DataFrame(json.loads(pj))
    if isinstance(pj, (list, pd.DataFrame)):
        return pd.DataFrame(pj)
    return pd.DataFrame()


def position_curves(ledger: pd.DataFrame | Sequence[Mapping[str, Any]], *, show: str = "both",
                    title: str = "Per-position acceptance") -> go.Figure:
    """Marginal r_i (solid) and conditional α_i (dashed) per draft position, one colour per fix.

    ``show``: ``"marginal"``, ``"conditional"`` or ``"both"``. Reads ``positions_json``.
    """
    if show not in ("marginal", "conditional", "both"):
        raise ValueError("show must be 'marginal', 'conditional' or 'both'")
    df = _frame(ledger)
    fig = go.Figure()
    for i, (name, (_, row)) in enumerate(zip(_labels(df), df.iterrows())):
        pos = _positions_of(row)
        if pos.empty:
            continue
        color = PALETTE[i % len(PALETTE)]
        kinds = ("marginal", "conditional") if show == "both" else (show,)
        for kind in kinds:
            fig.add_trace(go.Scatter(
                x=pos["position"], y=pos[kind].astype(float), mode="lines+markers",
                name=f"{name} {'r_i' if kind == 'marginal' else 'α_i'}", legendgroup=name,
                line=dict(color=color, dash="solid" if kind == "marginal" else "dash"),
                error_y=_err(pos, kind),
                hovertemplate=f"{name} {kind} pos %{{x}}: %{{y:.3f}}<extra></extra>"))
    fig.update_layout(title=f"{title}: r_i = P(>= i drafts accepted), α_i = r_i / r_(i-1)",
                      template="plotly_white", legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title_text="draft position i", dtick=1)
    fig.update_yaxes(title_text="acceptance", range=[0, 1.05])
    return fig


def accept_length_histogram(ledger: pd.DataFrame | Sequence[Mapping[str, Any]], *,
                            title: str = "Tokens per verify step") -> go.Figure:
    """Share of verify steps that emitted n + 1 tokens (n accepted drafts + bonus), per fix.

    Reads ``histogram_json`` (summed ``spec_correct_drafts_histogram``).
    """
    df = _frame(ledger)
    fig = go.Figure()
    for i, (name, (_, row)) in enumerate(zip(_labels(df), df.iterrows())):
        hj = row.get("histogram_json")
        if not isinstance(hj, str) or not hj:
            continue
        h = np.asarray(json.loads(hj), dtype=float)
        if h.sum() <= 0:
            continue
        fig.add_trace(go.Bar(x=np.arange(1, len(h) + 1), y=h / h.sum(), name=name,
                             marker_color=PALETTE[i % len(PALETTE)],
                             customdata=h.astype(int),
                             hovertemplate=f"{name}: %{{x}} tokens: %{{y:.3f}} (%{{customdata}} steps)"
                                           "<extra></extra>"))
    fig.update_layout(title=title, barmode="group", template="plotly_white",
                      legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title_text="tokens emitted in the verify step (accepted drafts + 1)", dtick=1)
    fig.update_yaxes(title_text="share of verify steps", range=[0, 1.0])
    return fig


def nice_step(span: float, ticks: int = 5) -> float:
    """A round tick spacing (1, 2, 2.5 or 5 times a power of ten) giving about ``ticks`` ticks over ``span``."""
    if not np.isfinite(span) or span <= 0:
        return 1.0
    raw = span / ticks
    mag = 10 ** np.floor(np.log10(raw))
    return float(next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw))


def tok_s_vs_steps(ledger: pd.DataFrame | Sequence[Mapping[str, Any]], *,
                   title: str = "tok/s vs num_steps") -> go.Figure:
    """tok/s (left, with CI) and accept length (right, dotted) against ``num_steps``, one line per
    ``topk``; dashed baseline tok/s when known. Reads ``num_steps, topk, tok_s[_lo/_hi],
    accept_length, baseline_tok_s``.
    """
    df = _frame(ledger)
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    if len(df) and "num_steps" in df.columns:
        d = df[df["num_steps"].map(_finite)].copy()
        d["num_steps"] = d["num_steps"].astype(float)
        d["topk"] = d.get("topk", pd.Series(1, index=d.index)).fillna(1).astype(float).astype(int)
        for i, (k, g) in enumerate(d.sort_values("num_steps").groupby("topk")):
            color = PALETTE[i % len(PALETTE)]
            fig.add_trace(go.Scatter(x=g["num_steps"], y=g["tok_s"].astype(float), mode="lines+markers",
                                     name=f"tok/s topk={k}", error_y=_err(g, "tok_s"),
                                     line=dict(color=color), text=g.get("fix"),
                                     hovertemplate="%{text}: steps %{x}: %{y:.1f} tok/s<extra></extra>"),
                          secondary_y=False)
            fig.add_trace(go.Scatter(x=g["num_steps"], y=g["accept_length"].astype(float),
                                     mode="lines+markers", name=f"accept length topk={k}",
                                     line=dict(color=color, dash="dot"), marker=dict(symbol="diamond"),
                                     error_y=_err(g, "accept_length"), text=g.get("fix"),
                                     hovertemplate="%{text}: steps %{x}: %{y:.3f}<extra></extra>"),
                          secondary_y=True)
        base = [float(b) for b in df.get("baseline_tok_s", pd.Series(dtype=float)) if _finite(b)]
        if base and len(d):
            b = float(np.median(base))
            fig.add_trace(go.Scatter(x=[d["num_steps"].min(), d["num_steps"].max()], y=[b, b],
                                     mode="lines", name=f"baseline tok/s ({b:.1f})",
                                     line=dict(color=PALETTE[7], dash="dash")), secondary_y=False)
    fig.update_layout(title=title, template="plotly_white", legend=dict(orientation="h", y=-0.2))
    fig.update_xaxes(title_text="speculative_num_steps", dtick=1)
    # round ticks on both axes (1, 2, 2.5 or 5 x 10^k apart, from 0)
    for col, name, secondary in (("tok_s_hi", "tok/s per request", False), ("accept_length", "accept length", True)):
        top = pd.to_numeric(df.get(col, df.get("tok_s") if col == "tok_s_hi" else None), errors="coerce").max() \
            if len(df) else float("nan")
        step = nice_step(float(top)) if _finite(top) else None
        fig.update_yaxes(title_text=name, secondary_y=secondary, rangemode="tozero", tick0=0, dtick=step,
                         **({"showgrid": False} if secondary else {}))
    return fig


def all_figures(ledger: pd.DataFrame | Sequence[Mapping[str, Any]]) -> dict[str, go.Figure]:
    """The four figures for a ledger (the sweep only when >= 2 distinct num_steps exist)."""
    df = _frame(ledger)
    figs = {"accept_length_by_fix": accept_length_by_fix(df), "position_curves": position_curves(df),
            "accept_length_histogram": accept_length_histogram(df)}
    if "num_steps" in df.columns and df["num_steps"].map(_finite).sum() and \
            df.loc[df["num_steps"].map(_finite), "num_steps"].nunique() >= 2:
        figs["tok_s_vs_steps"] = tok_s_vs_steps(df)
    return figs


def report_html(figures: Mapping[str, go.Figure] | Iterable[go.Figure], title: str = "Acceptance") -> str:
    """One self-contained HTML page: plotly.js embedded once (inline, no CDN), then each figure."""
    figs = list(figures.values()) if isinstance(figures, Mapping) else list(figures)
    parts = []
    for i, fig in enumerate(figs):
        parts.append(fig.to_html(full_html=False, include_plotlyjs=(i == 0), config={"responsive": True}))
    body = "\n".join(f'<div class="figure">{p}</div>' for p in parts)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title></head>\n<body>\n<h1>{html.escape(title)}</h1>\n"
            f"{body}\n</body></html>\n")


def write_report(ledger: pd.DataFrame | Sequence[Mapping[str, Any]], path: Path | str,
                 title: str = "Acceptance") -> Path:
    """Write :func:`all_figures` of ``ledger`` as one offline HTML file (atomically)."""

    return atomic_write_text(Path(path), report_html(all_figures(ledger), title=title))


def offline_notebook() -> None:
    """Jupyter: render figures with plotly.js injected once into the notebook (no CDN)."""

    init_notebook_mode(connected=False)
    pio.renderers.default = "notebook"
