"""The dump page (``02_dump``): the aux hidden states dumped from the server, per chunk and sample.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from ..formats.dumps import read_dump
from .common import downsample, esc, read_json_or_none


def dump_paths(run_dir: Path) -> list[Path]:
    """Every dump folder (``manifest.json``) under ``run_dir/dumps`` (per-rank dumps included), sorted."""
    return sorted(p.parent for p in (Path(run_dir) / "dumps").rglob("manifest.json"))


def dumps_frame(run_dir: Path, hidden_size: Optional[int] = None) -> pd.DataFrame:
    """One row per dump: name (relative to dumps/), kind, TP rank, samples, rows, width, chunks, dtype."""

    rows = []
    for p in dump_paths(run_dir):
        try:
            src = read_dump(p)
        except Exception as exc:  # noqa: BLE001 - shown in the table
            rows.append({"dump": str(p.relative_to(Path(run_dir) / "dumps")), "kind": "unreadable",
                         "error": f"{type(exc).__name__}: {exc}"})
            continue
        H = src.hidden_size or hidden_size
        w = src.width or 0
        rows.append({"dump": str(p.relative_to(Path(run_dir) / "dumps")), "kind": src.kind,
                     "tp rank": "" if src.tp_rank is None else src.tp_rank, "samples": len(src.samples),
                     "rows": sum(s.rows for s in src.samples), "width": w,
                     "chunks": (w // H) if H and w and w % H == 0 else "", "dtype": src.dtype or "",
                     "layers": ", ".join((src.layer_plan or {}).get("tensors", [])[:12])})
    return pd.DataFrame(rows)


def chunk_norms(dump: Path, sample: int = 0, hidden_size: Optional[int] = None) -> dict:
    """Per-row L2 norm of each H-wide chunk of one dump sample.

    Returns ``{"norms": ndarray [chunks, rows] float64, "positions": ndarray [rows], "input_ids": ndarray,
    "chunk_names": [str], "key": str}``. ``hidden_size`` defaults to the dump's; a width that is not a
    multiple of it is shown as one chunk.
    """


    src = read_dump(dump)
    s = src.samples[min(int(sample), len(src.samples) - 1)]
    x = s.load().to(torch.float32).numpy().astype(np.float64)
    H = src.hidden_size or hidden_size or x.shape[1]
    C = x.shape[1] // H if x.shape[1] % H == 0 else 1
    H = x.shape[1] // C
    norms = np.sqrt((x.reshape(x.shape[0], C, H) ** 2).sum(-1)).T
    names = list((src.layer_plan or {}).get("tensors") or [])
    if len(names) != C:
        names = [f"chunk {i}" for i in range(C)]
    return {"norms": norms, "positions": s.first_position + np.arange(x.shape[0]),
            "input_ids": np.asarray(s.input_ids) if s.input_ids is not None else None,
            "chunk_names": names, "key": s.key}


def norm_heatmap(dump: Path, sample: int = 0, hidden_size: Optional[int] = None, *, title: str = ""):
    """Heatmap of per-chunk row norms (y = chunk, x = token position) of one dump sample; columns are
    downsampled to :data:`MAX_POINTS`. Returns a plotly Figure."""

    d = chunk_norms(dump, sample, hidden_size)
    keep = downsample(d["norms"].shape[1])
    z = d["norms"][:, keep]
    fig = go.Figure(go.Heatmap(z=z, x=d["positions"][keep], y=[esc(n) for n in d["chunk_names"]],
                               colorscale="Viridis", colorbar=dict(title="L2 norm"),
                               hovertemplate="pos %{x}, %{y}: |h| = %{z:.3g}<extra></extra>"))
    fig.update_layout(title=title or f"Per-chunk row norms: {esc(Path(dump).name)}, sample {esc(d['key'])}",
                      xaxis_title="token position", yaxis_title="chunk", template="plotly_white",
                      height=max(260, 60 + 28 * len(d["chunk_names"])), margin=dict(l=90, r=20, t=50, b=50))
    return fig


def dump_samples(dump: Path) -> list[tuple[str, int]]:
    """``(label, index)`` options for a dump's samples (for a dropdown)."""

    src = read_dump(dump)
    return [(f"{i}: {s.key} ({s.rows} rows)", i) for i, s in enumerate(src.samples)]


def served_dumps(run_dir: Path) -> list[Path]:
    """``kind: served`` dumps of the run folder, in creation order."""
    out = []
    for p in dump_paths(run_dir):
        man = read_json_or_none(p / "manifest.json") or {}
        if man.get("kind") == "served":
            out.append((man.get("created") or "", p))
    return [p for _, p in sorted(out)]


def reference_dump(run_dir: Path) -> Optional[Path]:
    """The run folder's reference dump (every layer for the same tokens), if any."""
    for p in dump_paths(run_dir):
        man = read_json_or_none(p / "manifest.json") or {}
        if man.get("kind") == "reference":
            return p
    return None
