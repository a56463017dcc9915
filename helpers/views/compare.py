"""The compare page (``03_compare``): served vs training chunk by chunk, per-token rel_diff, histograms, the
minimum tolerance that would pass, named findings.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from ..diagnosis.diagnose import diagnose
from ..diagnosis.plan_rules import PlanRules
from ..engines.detect import adapter as engine_adapter
from ..formats.dumps import read_dump
from ..formats.training_data import TrainingData
from ..plots.acceptance import PALETTE
from .common import RunContext, as_path, downsample, esc, read_json_or_none


def run_diagnosis(ctx: RunContext, served: Path, *, reference: Optional[Path] = None,
                  max_samples: Optional[int] = 8):
    """:func:`helpers.diagnosis.diagnose.diagnose` of ``served`` against ``ctx.training`` with the target config, the
    draft config the dump was served with (:func:`draft_for_dump`) and the reference dump. ``max_samples`` limits the
    training samples read; served samples beyond them are left out with a note, never a finding."""

    return diagnose(ctx.training, [served], draft_config=draft_for_dump(ctx, served)[0],
                    target_config=ctx.target_dir, reference=reference, max_samples=max_samples,
                    rules=rules_for_dump(served))


def rules_for_dump(served: Path) -> PlanRules:
    """The id rules of the engine that served the dump, read from its manifest (``engine``, ``engine_version``;
    a dump without them is SGLang's, of its ``sglang_version``)."""
    m = read_json_or_none(Path(served) / "manifest.json") or {}
    return engine_adapter(m.get("engine") or "sglang").rules(m.get("engine_version") or m.get("sglang_version"))


def draft_for_dump(ctx: RunContext, served: Path) -> tuple[Optional[Path], str]:
    """The draft folder ``served`` was served with, and where that comes from: the server's
    ``speculative_draft_model_path`` in the dump's manifest (``server`` block) when this machine can read it, else
    the replay's draft variant of the same fix (``drafts/<fix>``, for a dump ``<fix>-served``), else the page's
    draft (``ctx.draft_dir``). ``(None, why)`` when there is none."""
    manifest = read_json_or_none(Path(served) / "manifest.json") or {}
    srv = manifest.get("server") if isinstance(manifest.get("server"), dict) else {}
    eff = srv.get("effective") if isinstance(srv.get("effective"), dict) else srv
    used = as_path(eff.get("speculative_draft_model_path"))
    if used is not None and (used / "config.json").exists():
        return used, "the dump's manifest (the server's speculative_draft_model_path)"
    stem = served.name[:-len("-served")] if served.name.endswith("-served") else ""
    variant = ctx.run_dir / "drafts" / stem
    if stem and (variant / "config.json").exists():
        return variant, f"the run folder's draft variant of fix {stem!r}"
    if ctx.draft_dir and (ctx.draft_dir / "config.json").exists():
        return ctx.draft_dir, "draft_dir (the dump's manifest names no draft readable here)"
    return None, "none readable here"


def chunk_table(diag) -> pd.DataFrame:
    """The diagnosis chunk table with the planned (configured) and trained tensor of each chunk."""
    served = list(diag.served_plan.tensors) if diag.served_plan is not None else []
    trained = list(diag.training_plan.tensors) if diag.training_plan is not None else []
    rows = []
    for ch in diag.chunks:
        i = ch["index"]
        rows.append({"chunk": i, "width": ch["width"], "configured": served[i] if i < len(served) else "",
                     "trained on": trained[i] if i < len(trained) else "",
                     "measured (reference)": ch.get("identified_as") or "",
                     "best training chunk": "" if ch["matched_training_chunk"] is None else ch["matched_training_chunk"],
                     "rel_diff": ch["rel_diff"], "cosine": ch["cosine"]})
    return pd.DataFrame(rows)


def rel_diff_matrix(diag, *, against: str = "training") -> pd.DataFrame:
    """rel_diff of each served chunk (rows) against each training chunk / unit (``against="training"``) or
    each reference tensor (``"reference"``) over all aligned rows. Index ``served chunk i``; columns the
    training plan's tensors (or units) / the reference tensor names. Empty when not available."""
    c = diag.comparison
    if c is None:
        return pd.DataFrame()
    src = c.primary
    if against == "reference":
        if src.ref is None or not c.reference_tensors or src.ref.rows == 0:
            return pd.DataFrame()
        acc, cols = src.ref, list(c.reference_tensors)
    else:
        acc = src.pairs
        trained = list(diag.training_plan.tensors) if diag.training_plan is not None else []
        cols = [f"t{j}: {trained[j]}" if c.shard_factor == 1 and j < len(trained) else u
                for j, u in enumerate(c.training_units)]
    m = np.array([[acc.metrics(i, j, c.tolerance).rel_diff for j in range(acc.nu)] for i in range(acc.ns)])
    return pd.DataFrame(m, index=[f"served chunk {i}" for i in range(acc.ns)], columns=cols)


def rel_diff_heatmap(matrix: pd.DataFrame, *, title: str, tolerance: Optional[float] = None):
    """log10(rel_diff) heatmap of a :func:`rel_diff_matrix` with the values as cell text; cells at or below
    ``tolerance`` are the matches."""

    z = np.log10(np.clip(matrix.to_numpy(dtype=float), 1e-12, None))
    text = [[f"{v:.2e}" for v in row] for row in matrix.to_numpy(dtype=float)]
    fig = go.Figure(go.Heatmap(z=z, x=[esc(c) for c in matrix.columns], y=[esc(i) for i in matrix.index],
                               text=text, texttemplate="%{text}", colorscale="RdBu", reversescale=True,
                               zmin=-12, zmax=0, colorbar=dict(title="log10 rel_diff"),
                               hovertemplate="%{y} vs %{x}: rel_diff %{text}<extra></extra>"))
    sub = f" (match: rel_diff <= {tolerance:.0e})" if tolerance else ""
    fig.update_layout(title=title + sub, template="plotly_white",
                      height=max(280, 120 + 40 * len(matrix.index)), margin=dict(l=110, r=20, t=60, b=80))
    fig.update_yaxes(autorange="reversed")
    return fig


def aligned_rows(served: Path, training: Path, hidden_size: int, *, max_samples: int = 8) -> list[dict]:
    """Served rows paired with the training rows of the same tokens.

    A served sample pairs with the training sample whose ``input_ids[first_position:first_position+rows]``
    equal the served ``input_ids``. Returns per pair ``{"key", "positions" [T], "input_ids" [T],
    "served" ndarray [T, Ws], "training" ndarray [T, Wt]}`` (float32). Unpaired samples are skipped.
    """


    src = read_dump(served)
    want = {}
    for s in src.samples:
        if s.input_ids is not None:
            want.setdefault((s.first_position, tuple(int(t) for t in s.input_ids)), s)
    out = []
    for t in TrainingData(training, hidden_size=hidden_size, max_samples=max_samples):
        ids = tuple(int(v) for v in np.asarray(t.input_ids))
        for (fp, sid), s in list(want.items()):
            if ids[fp:fp + len(sid)] == sid and len(sid):
                tr = t.load().to(torch.float32).numpy()[fp:fp + len(sid)]
                out.append({"key": s.key, "positions": fp + np.arange(len(sid)), "input_ids": np.array(sid),
                            "served": s.load().to(torch.float32).numpy(), "training": tr})
                del want[(fp, sid)]
                break
    return out


def per_token_rel_diff(pairs: Sequence[Mapping[str, Any]], hidden_size: int) -> pd.DataFrame:
    """Per token and chunk: rel_diff = |x-y|^2 / (|x|^2+|y|^2) of served chunk i vs training chunk i (what the
    draft's fc reads at that slot vs what it was trained on). Columns ``sample, position, token_id, chunk,
    rel_diff`` (rel_diff in [0, 2]; 0 = identical)."""
    frames = []
    H = int(hidden_size)
    for p in pairs:
        s, t = np.asarray(p["served"], np.float64), np.asarray(p["training"], np.float64)
        C = min(s.shape[1] // H, t.shape[1] // H)
        for c in range(C):
            x, y = s[:, c * H:(c + 1) * H], t[:, c * H:(c + 1) * H]
            den = (x * x).sum(1) + (y * y).sum(1)
            rd = np.where(den > 0, ((x - y) ** 2).sum(1) / np.where(den > 0, den, 1), 0.0)
            frames.append(pd.DataFrame({"sample": p["key"], "position": p["positions"],
                                        "token_id": p["input_ids"], "chunk": c, "rel_diff": rd}))
    if not frames:
        return pd.DataFrame(columns=["sample", "position", "token_id", "chunk", "rel_diff"])
    return pd.concat(frames, ignore_index=True)


def per_token_figure(df: pd.DataFrame, sample: Optional[str] = None, chunk: Optional[int] = None,
                     *, tolerance: Optional[float] = None):
    """rel_diff per token position (log y) for one sample, one line per chunk (or only ``chunk``)."""


    fig = go.Figure()
    if len(df):
        sample = sample if sample is not None else df["sample"].iloc[0]
        d = df[df["sample"] == sample]
        for c in sorted(d["chunk"].unique()):
            if chunk not in (None, "all") and int(c) != int(chunk):
                continue
            g = d[d["chunk"] == c].sort_values("position")
            keep = downsample(len(g))
            g = g.iloc[keep]
            fig.add_trace(go.Scatter(x=g["position"], y=np.clip(g["rel_diff"], 1e-12, None),
                                     mode="lines+markers", name=f"chunk {c}", marker=dict(size=4),
                                     line=dict(color=PALETTE[int(c) % len(PALETTE)]),
                                     customdata=g["token_id"],
                                     hovertemplate=f"chunk {c}" + ", pos %{x} (token %{customdata}): "
                                                   "%{y:.2e}<extra></extra>"))
        if tolerance:
            fig.add_hline(y=tolerance, line=dict(color="#616161", dash="dash"),
                          annotation_text=f"tolerance {tolerance:.0e}")
    fig.update_layout(title=f"Per-token rel_diff, served chunk i vs training chunk i (sample {esc(sample)})",
                      xaxis_title="token position", yaxis_title="rel_diff (log)", template="plotly_white",
                      height=380, legend=dict(orientation="h", y=-0.25))
    fig.update_yaxes(type="log")
    return fig


def rel_diff_histograms(df: pd.DataFrame, *, bins: int = 40, tolerance: Optional[float] = None):
    """Histogram of log10(per-token rel_diff) per chunk on shared bins (one set of edges for all chunks, so
    the bars compare). Returns a plotly Figure."""


    fig = go.Figure()
    if len(df):
        v = np.log10(np.clip(df["rel_diff"].to_numpy(float), 1e-12, None))
        edges = np.histogram_bin_edges(v, bins=bins, range=(min(v.min(), -12.0), max(v.max(), 0.5)))
        centers = (edges[:-1] + edges[1:]) / 2
        for c in sorted(df["chunk"].unique()):
            h, _ = np.histogram(v[df["chunk"].to_numpy() == c], bins=edges)
            fig.add_trace(go.Bar(x=centers, y=h, name=f"chunk {c}",
                                 marker_color=PALETTE[int(c) % len(PALETTE)]))
        if tolerance:
            fig.add_vline(x=math.log10(tolerance), line=dict(color="#616161", dash="dash"),
                          annotation_text="tolerance")
    fig.update_layout(title="Per-token rel_diff by chunk (shared bins)", barmode="group",
                      xaxis_title="log10 rel_diff (served chunk i vs training chunk i)",
                      yaxis_title="tokens", template="plotly_white", height=360,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def min_tolerance_frame(diag, per_token: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Per served chunk, the smallest tolerance that would have passed: against the same-index training
    chunk (what the draft reads) and against the best-matching one; plus the tolerance used. Columns
    ``chunk, tolerance used, min rel_diff tol (same slot), min max_abs tol (same slot), max per-token
    rel_diff (same slot), best training chunk, min rel_diff tol (best)``. The last row ("all") is the
    tolerance at which the whole served tensor would pass as wired."""
    c = diag.comparison
    if c is None:
        return pd.DataFrame()
    src = c.primary
    rows = []
    for i in range(src.pairs.ns):
        same = c.metrics(src, i, i) if i < src.pairs.nu else None
        j, best = c.best_match(src, i)
        tok = None
        if per_token is not None and len(per_token):
            sel = per_token[per_token["chunk"] == i]["rel_diff"]
            tok = float(sel.max()) if len(sel) else None
        rows.append({"chunk": str(i), "tolerance used": c.tolerance,
                     "min rel_diff tol (same slot)": None if same is None else same.min_tolerance["rel_diff"],
                     "min max_abs tol (same slot)": None if same is None else same.min_tolerance["max_abs"],
                     "max per-token rel_diff (same slot)": tok,
                     "best training chunk": c.training_units[j],
                     "min rel_diff tol (best)": best.min_tolerance["rel_diff"],
                     "passes now": "yes" if same is not None and same.passed else "no"})
    df = pd.DataFrame(rows)
    if len(df):
        allrow = {"chunk": "all", "tolerance used": c.tolerance,
                  "min rel_diff tol (same slot)": pd.to_numeric(df["min rel_diff tol (same slot)"]).max(),
                  "min max_abs tol (same slot)": pd.to_numeric(df["min max_abs tol (same slot)"]).max(),
                  "max per-token rel_diff (same slot)": pd.to_numeric(df["max per-token rel_diff (same slot)"]).max(),
                  "best training chunk": "", "min rel_diff tol (best)": pd.to_numeric(df["min rel_diff tol (best)"]).max(),
                  "passes now": "yes" if (df["passes now"] == "yes").all() else "no"}
        df = pd.concat([df, pd.DataFrame([allrow])], ignore_index=True)
    return df
