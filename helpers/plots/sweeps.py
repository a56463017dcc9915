"""Figures of the workload sweeps (:mod:`helpers.acceptance.sweeps`): accept length with its 95 % CI against the
sweep's value (context length, temperature, requests in flight), tok/s on a second axis, and for the context sweep
the draft's and the training data's limits as vertical lines."""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go

AXIS = {"context": "context length (tokens: prompt + generated)", "temperature": "temperature",
        "concurrency": "requests in flight"}


def sweep_figure(name: str, sweep: dict, limits: Optional[dict] = None) -> Optional[go.Figure]:
    """One sweep's figure; None when no point was measured.

    ``sweep``: ``{"points": [Point.to_json(), ...], "trend": {...} | None}`` of ``results/ablate.json``."""
    pts = [p for p in sweep.get("points") or [] if not p.get("skipped") and p["summary"].get("accept_length")]
    if not pts:
        return None
    x = [p["value"] for p in pts]
    s = [p["summary"] for p in pts]
    al = [v["accept_length"] for v in s]
    lo = [a - (v.get("accept_length_lo") if v.get("accept_length_lo") is not None else a) for a, v in zip(al, s)]
    hi = [(v.get("accept_length_hi") if v.get("accept_length_hi") is not None else a) - a for a, v in zip(al, s)]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=al, mode="lines+markers", name="accept length (95% CI)",
                             error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
                             text=[p["label"] for p in pts],
                             hovertemplate="%{text}: accept length %{y:.2f}<extra></extra>"))
    key = "throughput_tok_s" if name == "concurrency" else "tok_s"
    tok = [v.get(key) for v in s]
    if any(t is not None for t in tok):
        fig.add_trace(go.Scatter(x=x, y=tok, mode="lines+markers", yaxis="y2", line={"dash": "dot", "color": "#888"},
                                 name="tok/s (all requests)" if key == "throughput_tok_s" else "tok/s per request",
                                 hovertemplate="%{y:.1f} tok/s<extra></extra>"))
    for k, txt, color, where in (("draft", "draft max_position_embeddings", "#c62828", "top right"),
                                 ("training", "mean training sample", "#2e7d32", "bottom right")):
        v = (limits or {}).get(k)
        if name == "context" and v and v <= max(x) * 1.5:
            fig.add_vline(x=v, line={"dash": "dash", "color": color}, annotation_text=f"{txt} ({v})",
                          annotation_position=where)
    t = sweep.get("trend")
    title = f"Accept length vs {AXIS.get(name, name)}" + (
        f": falls from {t['first_falling']} ({t['delta']:+.2f} at {t['at']})" if t else ": no CI-supported fall")
    fig.update_layout(title=title, height=360, xaxis={"title": AXIS.get(name, name), "rangemode": "tozero"},
                      yaxis={"title": "accept length (tokens / verify step)", "rangemode": "tozero"},
                      yaxis2={"title": "tok/s", "overlaying": "y", "side": "right", "rangemode": "tozero"},
                      margin={"l": 60, "r": 60, "t": 60, "b": 50}, legend={"orientation": "h", "y": -0.25})
    return fig
