"""Figures of the hypothesis checks (helpers.investigation.checks): bars per rank / step and the layer each aux
chunk holds (trained, configured, measured)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ..layers.ids import layer_index


def bar_figure(x, y, title, ytitle, *, log=False, color=None) -> go.Figure:
    """One bar per ``x`` (height ``y``), 320 px high; log y axis with ``log``."""
    fig = go.Figure(go.Bar(x=x, y=y, marker_color=color))
    fig.update_layout(title=title, yaxis_title=ytitle, height=320, margin=dict(l=60, r=20, t=50, b=40))
    if log:
        fig.update_yaxes(type="log")
    return fig


def chunk_layer_figure(frame: pd.DataFrame, title: str, with_configured: bool = False):
    """Plotly figure: per aux chunk, the decoder layer L of ``out(L)`` it was trained on, the one
    measured against the reference layers (-1 = embedding, gaps = unidentified) and, optionally,
    the one configured (the engine's plan)."""
    fig = go.Figure()
    series = [("trained on", "trained"), ("served (measured)", "measured (reference)")]
    if with_configured and "configured" in frame:
        series.insert(1, ("configured (engine plan)", "configured"))
    for name, col in series:
        fig.add_trace(go.Scatter(x=list(frame["chunk"]), y=[layer_index(v) for v in frame[col]],
                                 mode="markers+lines", name=name))
    fig.update_layout(title=title, xaxis_title="chunk", yaxis_title="decoder layer L of out(L)",
                      height=320, margin=dict(l=60, r=20, t=50, b=40))
    fig.update_xaxes(dtick=1)
    return fig
