"""The hypothesis pages (``10_hyp_tp_sharding``, ``11_hyp_embedding_allreduce``, ``12_hyp_layer_offset``): the
verdict of the live investigation (helpers.views.investigation) or of the replay, per-rank figures, reference bars.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from ..formats.dumps import read_dump
from ..plots.acceptance import PALETTE
from .common import downsample, esc, read_json_or_none
from .dump import dump_paths


def hypothesis_result(nb: str, check: str, steps: Sequence[Mapping[str, Any]], source: str) -> dict:
    """The ``results/<nb>.json`` document of a hypothesis notebook."""
    return {"notebook": nb, "check": check, "source": source,
            "results": [{k: s.get(k) for k in ("index", "label", "question", "verdict", "expect", "as_expected",
                                                "explanation", "on_fix", "figure", "data")} for s in steps]}


def rank_dumps(run_dir: Path, key: str = "aux") -> dict[int, Path]:
    """``{rank: dump}`` of the per-rank dumps of stash ``key`` (``aux``, ``embedding``, ``embedding_local``)
    in the run folder (the first fix that captured them)."""
    out: dict[int, Path] = {}
    for p in dump_paths(run_dir):
        man = read_json_or_none(p / "manifest.json") or {}
        if man.get("kind") == "per_rank" and man.get("module") == key and man.get("tp_rank") is not None:
            out.setdefault(int(man["tp_rank"]), p)
    return dict(sorted(out.items()))


def rank_diff_figure(ranks: Mapping[int, Path], rank: int, hidden_size: int, *, sample: int = 0):
    """max |x(rank) - x(rank 0)| per token position and H-wide chunk, for one forward (sample) recorded on
    every rank. All zero = the ranks hold identical (all-reduced) values. Returns a plotly Figure."""


    fig = go.Figure()
    if 0 in ranks and rank in ranks:
        a, b = read_dump(ranks[0]), read_dump(ranks[rank])
        bk = {s.key: s for s in b.samples}
        pairs = [(s, bk[s.key]) for s in a.samples if s.key in bk]
        if pairs:
            sa, sb = pairs[min(int(sample), len(pairs) - 1)]
            x, y = sa.load().to(torch.float32).numpy(), sb.load().to(torch.float32).numpy()
            n = min(len(x), len(y))
            d = np.abs(x[:n] - y[:n])
            H = int(hidden_size) if x.shape[1] % int(hidden_size) == 0 else x.shape[1]
            keep = downsample(n)
            for c in range(x.shape[1] // H):
                fig.add_trace(go.Scatter(x=sa.first_position + keep, y=d[keep, c * H:(c + 1) * H].max(1),
                                         mode="lines+markers", name=f"chunk {c}", marker=dict(size=4),
                                         line=dict(color=PALETTE[c % len(PALETTE)])))
    fig.update_layout(title=f"max |x(rank {int(rank)}) - x(rank 0)| per token", xaxis_title="token position",
                      yaxis_title="max |difference|", template="plotly_white", height=340,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def reference_bars(matrix: pd.DataFrame, chunk: int):
    """rel_diff of one served chunk against every reference tensor (log y): the lowest bar is the layer
    the chunk really holds. ``matrix``: :func:`rel_diff_matrix` ``against="reference"`` (or its dict form
    from ``results/03_compare.json``)."""

    m = matrix if isinstance(matrix, pd.DataFrame) else pd.DataFrame(matrix)
    fig = go.Figure()
    if len(m) and 0 <= int(chunk) < len(m):
        row = m.iloc[int(chunk)].astype(float)
        best = row.idxmin()
        fig.add_trace(go.Bar(x=[esc(c) for c in row.index], y=np.clip(row.to_numpy(), 1e-12, None),
                             marker_color=["#c62828" if c == best else "#90a4ae" for c in row.index],
                             hovertemplate="%{x}: rel_diff %{y:.2e}<extra></extra>"))
        fig.update_layout(title=f"Served chunk {int(chunk)} vs every target layer: it holds {esc(best)}")
    fig.update_yaxes(type="log", title_text="rel_diff (log)")
    fig.update_layout(template="plotly_white", height=340, xaxis_title="reference tensor")
    return fig
