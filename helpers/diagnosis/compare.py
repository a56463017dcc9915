"""Token-aligned, chunk-by-chunk comparison of served aux hidden states with training data.

For every served chunk i and every training chunk j (each H wide; ``H/k`` wide column slices when a rank
holds a TP-sharded width) the comparison accumulates, over all rows aligned by ``input_ids``:

* **per row** (the statistics that decide): ``rel_diff_t = |x_t - y_t|^2 / (|x_t|^2 + |y_t|^2)`` (SGLang's
  DeepGEMM-style ``calc_rel_diff`` applied to one row), the row cosine and the row norm ratio. Each goes
  into a fixed log-spaced histogram (:data:`HIST_EDGES`), and the rows within the tolerance are counted
  exactly. Two chunks are **equal** when at least :data:`MATCH_SHARE` of their rows are within the
  tolerance: a few rows (massive activations on the first token and delimiters, which are nearly the same
  in every layer and carry most of ``sum |x|^2``) cannot decide a chunk either way;
* **global** (reported, like SGLang's comparator): ``rel_diff = sum|x-y|^2 / (sum|x|^2 + sum|y|^2)`` over all
  rows (computed from the sums so that near-equal tensors do not lose precision to cancellation), ``cosine``,
  ``norm_ratio``, min / max per-row cosine and norm ratio;
* ``max_abs_diff`` with its coordinate (sample, row, position, token id, column), for near pairs (global
  ``rel_diff`` of the block <= :data:`NEAR_REL`; far pairs are not equal anyway and skip that pass);
* per chunk (:class:`ChunkStats`): non-finite and zero rows, the context-free test (equal token ids at
  different positions give equal rows: the embedding), and the **outlier rows** (largest row energies with
  their position, token id and dominant dims), reported as evidence;
* a bounded, seeded **reservoir** of aligned rows (:class:`RowReservoir`) on which the detectors fit the
  transforms they name (``helpers.diagnosis.fit``).

The per-row tolerance comes from the dtypes (:data:`REL_DIFF_TOLERANCE`, :func:`tolerance_why`).

Memory: the training data are streamed (at most two samples referenced) and rows are processed in blocks of
``block_rows`` rows, each block in flight with its own scratch: float32 tiles of :data:`TILE_BYTES` (one served
source), or float32 copies of the whole block (several ranks, or a block holding a non-finite row); served samples
from project dumps are read lazily per sample. Only bounded summaries are kept: per pair sums, extrema and
histograms, per chunk the top rows, :data:`CONTEXT_CACHE_IDS` cached rows for the context-free test and the
reservoir's fixed-size buffers.

Speed: blocks are compared by the calling thread and ``E3F_COMPARE_THREADS - 1`` workers (:class:`_Blocks`);
``bench/bench_compare.py`` measures it against a plain read + dot-product pass over the same bytes.
"""
from __future__ import annotations

import math
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..errors import BadInput
from ..formats.dumps import Sample, SampleSource

#: Per-row rel_diff tolerance by dtype (the loosest dtype of the two sides applies). What it separates:
#: rounding alone gives rel_diff ~1e-6 in bf16 (rel_diff is quadratic in the relative error); two engines
#: with different kernels and TP reduction orders differ by 1-3 % relative at the last layers of a deep
#: bf16 target (rel_diff <= ~5e-4); an adjacent layer of a deep target (row cosine 0.90-0.99) gives
#: rel_diff >= ~5e-3 per row. SGLang's comparator default is 1e-3 (``debug_utils/comparator``).
REL_DIFF_TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-3, "bfloat16": 2e-3}
#: Share of aligned rows that must be within the tolerance for two chunks to be called equal.
MATCH_SHARE = 0.9
#: rows per pair-loop step (and per pipeline block): 128 halves the Python steps per row against 64 and measured
#: faster with the block pipeline (bench/bench_compare.py); the difference buffer is [rows, chunk width] float32.
PAIR_ROWS = 128
#: pairs whose Gram-based |x-y|^2 is below this fraction of |x|^2+|y|^2 get the elementwise pass: max |x-y| and,
#: when the tolerance is tighter than :data:`EXACT_BELOW_TOL` (float32 / float64 data), |x-y|^2 recomputed from the
#: difference (the float32 Gram's cancellation limits a near pair's rel_diff to ~1e-6 absolute: far below a bf16
#: tolerance, not below a float32 one).
NEAR_REL = 1e-2
EXACT_BELOW_TOL = 1e-4
#: token ids whose first row is cached per source for the context-free test.
CONTEXT_CACHE_IDS = 256
#: rows of one token id at two positions count as equal (context-free: the embedding) below this rel_diff.
CONTEXT_FREE_REL = 1e-9
#: a row whose MASSIVE_DIMS largest squared entries hold more than MASSIVE_SHARE of its energy is a massive-
#: activation row (left out of the context-free test: such rows are nearly equal in every layer).
MASSIVE_DIMS, MASSIVE_SHARE = 4, 0.5
#: token ids of all-zero rows remembered per chunk for the vocab-shard test (zero rows are rare otherwise).
ID_SET_CAP = 1 << 16
#: Histogram edges for per-row statistics (rel_diff, 1 - cosine, |log norm ratio|): 0, then 10 bins per
#: decade from 1e-12 to 1e3. A quantile read from it is exact to a factor 10^0.1 = 1.26.
HIST_EDGES = np.concatenate([[0.0], 10.0 ** np.arange(-12, 3.01, 0.1)])
NB = len(HIST_EDGES)            # bins: [0, e1), [e1, e2), ..., [e_last, inf)
_EDGES_UP = HIST_EDGES[1:]
#: outlier rows kept per chunk (largest row energies).
TOP_ROWS = 6
#: aligned rows kept for transform fits, and a cap on the reservoir's reference buffer (bytes).
RESERVOIR_ROWS = 256
RESERVOIR_REF_BYTES = 96 << 20


def tolerance_for(*dtypes: Optional[str]) -> float:
    """Per-row rel_diff tolerance for comparing data of these dtypes: the loosest one (unknown names are
    ignored; float32 if none is known). See :data:`REL_DIFF_TOLERANCE` for what it separates."""
    tols = [REL_DIFF_TOLERANCE[d.replace("torch.", "")] for d in dtypes if d and d.replace("torch.", "") in REL_DIFF_TOLERANCE]
    return max(tols) if tols else REL_DIFF_TOLERANCE["float32"]


def tolerance_why(tol: float, dtypes: dict, overridden: bool = False) -> str:
    """One sentence saying what the tolerance is and why (printed with every diagnosis)."""
    if overridden:
        return f"per-row rel_diff tolerance {tol:g} (given by the caller)"
    names = ", ".join(f"{k} {v}" for k, v in dtypes.items() if v) or "dtypes unknown, float32 assumed"
    return (f"per-row rel_diff tolerance {tol:g} from the dtypes ({names}): above engine noise (two engines "
            f"with other kernels / TP reduction order: rel_diff <= ~5e-4 per row in bf16), below an adjacent "
            f"layer of a deep target (row cosine <= 0.99: rel_diff >= ~5e-3); chunks are equal when >= "
            f"{MATCH_SHARE:.0%} of the aligned rows are within it")


def norm_tolerance(rel_tol: float) -> float:
    """Per-row norm-ratio deviation that engine noise at per-row rel_diff ``rel_tol`` can reach in the worst
    case (all of the error along the row): ``sqrt(2 * rel_tol)``."""
    return math.sqrt(2 * rel_tol)


def hist_quantile(hist: np.ndarray, q: float) -> Optional[float]:
    """Quantile ``q`` of the values counted in ``hist`` (bins of :data:`HIST_EDGES`): the upper edge of the bin
    holding it (conservative: the true quantile is at most this and at least 10^-0.1 of it). None if empty."""
    n = int(hist.sum())
    if n == 0:
        return None
    k = int(np.searchsorted(np.cumsum(hist), math.ceil(q * n)))
    k = min(k, NB - 1)
    return float(HIST_EDGES[k + 1]) if k + 1 < NB else math.inf


def _bins_np(v: np.ndarray) -> np.ndarray:
    """Histogram bin of each value (values >= 0; bin 0 holds [0, 1e-12))."""
    return np.searchsorted(_EDGES_UP, v, side="right")


def _first_abs_max(diff: torch.Tensor, mn: float, mx: float) -> int:
    """Flat index of the first element of ``diff`` with ``|d| = max(mx, -mn)`` (``mn`` / ``mx``: its min and max):
    one argmax / argmin pass over ``diff`` instead of ``diff.abs().argmax()`` (a copy and two passes)."""
    if mx > -mn:
        return int(diff.argmax())
    if -mn > mx:
        return int(diff.argmin())
    return min(int(diff.argmax()), int(diff.argmin()))


# ------------------------------------------------------------------------------------------ accumulators

@dataclass
class RowInfo:
    """Where the rows of a block come from (for coordinates)."""

    key: str
    rows: np.ndarray          # served row index of each block row
    positions: np.ndarray     # sequence positions
    ids: np.ndarray           # token ids


@dataclass
class _PairPart:
    """What :meth:`PairAccumulator.measure` found in up to :data:`PAIR_ROWS` rows of a block: per row and pair the
    inner products ``xy``, ``|x|^2 + |y|^2`` (``den``) and ``|x - y|^2`` (``dd``) [n, ns, nu] float64, the squared
    norms, the finite-pair mask (None = all finite) and per near pair ``(i, j, max |x - y|, (row, column) or
    None)``."""

    info: RowInfo
    off: int
    n: int
    xy: np.ndarray
    nx64: np.ndarray
    ny64: np.ndarray
    den: np.ndarray
    dd: np.ndarray
    ok: Optional[np.ndarray]
    hits: list


class PairAccumulator:
    """Per-row histograms, exact within-tolerance counts, sums and extrema for an [ns x nu] grid of chunk
    pairs, updated block by block (float64 sums).

    Args:
        ns / nu: served chunks x training units (or reference layers).
        tol: per-row rel_diff tolerance (rows within it are counted exactly).
    """

    def __init__(self, ns: int, nu: int, tol: float = REL_DIFF_TOLERANCE["float32"]):
        self.ns, self.nu, self.tol = ns, nu, float(tol)
        z = lambda: np.zeros((ns, nu), np.float64)  # noqa: E731
        self.sxx, self.syy, self.sdd = z(), z(), z()
        self.rows = 0                                   # rows offered (any pair)
        self.n = np.zeros((ns, nu), np.int64)           # rows compared per pair (finite on both sides)
        self.within = np.zeros((ns, nu), np.int64)
        self.lnr_sq = z()
        self.valid = np.zeros((ns, nu), np.int64)      # rows with both norms > 0 (cosine / ratio defined)
        self.h_rel = np.zeros((ns, nu, NB), np.int64)
        self.h_cos = np.zeros((ns, nu, NB), np.int64)  # 1 - cosine
        self.h_lnr = np.zeros((ns, nu, NB), np.int64)  # |log norm ratio|
        self.lnr_sum = z()
        self.cos_sum = z()
        self.cos_min = np.full((ns, nu), np.inf)
        self.nr_min = np.full((ns, nu), np.inf)
        self.nr_max = np.zeros((ns, nu))
        self.max_abs = np.full((ns, nu), -1.0)
        self.max_at: list[list[Optional[dict]]] = [[None] * nu for _ in range(ns)]
        #: the pairs near in the last measured rows: :func:`_prepare_tiled` takes their differences tile by tile
        self.near_hint: frozenset = frozenset()

    def update(self, s3: torch.Tensor, t3: torch.Tensor, info: RowInfo, hs: int,
               nx: Optional[torch.Tensor] = None, ny: Optional[torch.Tensor] = None,
               sfin: Optional[np.ndarray] = None, tfin: Optional[np.ndarray] = None) -> None:
        """Add a block: ``s3`` [n, ns, hs] and ``t3`` [n, nu, hs] float32, rows aligned (non-finite chunk rows
        zeroed); ``nx`` / ``ny`` are their squared row norms per chunk if already computed; ``sfin`` [n, ns] /
        ``tfin`` [n, nu] (bool, None = all finite) say which chunk rows are finite: a pair (i, j) takes the rows
        finite in both chunks (a non-finite chunk never removes another chunk's rows).

        The same as :meth:`apply` of :meth:`measure` (the comparison runs the two halves in different threads)."""
        self.apply(self.measure(s3, t3, info, hs, nx, ny, sfin, tfin))

    def measure(self, s3: torch.Tensor, t3: torch.Tensor, info: RowInfo, hs: int,
                nx: Optional[torch.Tensor] = None, ny: Optional[torch.Tensor] = None,
                sfin: Optional[np.ndarray] = None, tfin: Optional[np.ndarray] = None,
                scratch: Optional["_Scratch"] = None, tiles: Optional["_Tiles"] = None) -> list["_PairPart"]:
        """The tensor half of :meth:`update` (arguments as there): per :data:`PAIR_ROWS` rows, the per-row inner
        products (one batched matmul), the near pairs' max |x - y| and, where it may be a new maximum, its
        coordinate. Reads nothing but the running ``max_abs`` (as a lower bound: it only grows), so blocks can be
        measured in worker threads while earlier blocks are applied; ``scratch`` holds the difference buffer (one
        per thread). ``tiles``: the products and near-pair differences already taken tile by tile
        (:func:`_prepare_tiled`; ``s3`` / ``t3`` are then the source rows, only their row count is used)."""
        n = s3.shape[0]
        if n == 0:
            return []
        if nx is None:
            nx = torch.linalg.vector_norm(s3, dim=-1).square()
        if ny is None:
            ny = torch.linalg.vector_norm(t3, dim=-1).square()
        parts = []
        for a in range(0, n, PAIR_ROWS):
            b = min(n, a + PAIR_ROWS)
            ok = None
            if sfin is not None or tfin is not None:
                sf = np.ones((b - a, self.ns), bool) if sfin is None else sfin[a:b]
                tf = np.ones((b - a, self.nu), bool) if tfin is None else tfin[a:b]
                ok = sf[:, :, None] & tf[:, None, :]
            parts.append(self._measure(s3[a:b], t3[a:b], nx[a:b], ny[a:b], info, a, hs, ok, scratch, tiles))
        return parts

    def _measure(self, s3, t3, nx, ny, info: RowInfo, off: int, hs: int, ok: Optional[np.ndarray],
                 scratch: Optional["_Scratch"], tiles: Optional["_Tiles"] = None) -> "_PairPart":
        n = s3.shape[0]
        # <x, y> per row and pair through one small batched matmul; |x - y|^2 = |x|^2 + |y|^2 - 2<x, y> is exact
        # enough for far pairs, and recomputed elementwise below for near pairs (no cancellation). The small
        # [n, ns, nu] arrays are handled in numpy (cheaper than many tiny torch ops).
        if tiles is not None:
            xy = tiles.xy[off:off + n].numpy().astype(np.float64)
        else:
            xy = torch.bmm(s3, t3.transpose(1, 2)).numpy().astype(np.float64)   # [n, ns, nu]
        nx64, ny64 = nx.numpy().astype(np.float64), ny.numpy().astype(np.float64)
        den = nx64[:, :, None] + ny64[:, None, :]
        dd = np.maximum(den - 2 * xy, 0.0)
        if ok is not None and ok.all():
            ok = None
        if ok is not None:              # pairs take only the rows finite in both chunks (rare: slow path)
            den = np.where(ok, den, 0.0)
            dd = np.where(ok, dd, 0.0)
        near = dd.sum(0) <= NEAR_REL * den.sum(0)
        if ok is not None:
            near &= ok.any(0)
        self.near_hint = frozenset(zip(*(x.tolist() for x in np.nonzero(near))))
        hits = []
        if tiles is not None:
            for i, j in sorted(self.near_hint):
                mn, mx, per_tile, exact = tiles.near(i, j, off, off + n)
                v = max(mx, -mn)
                if exact is not None:
                    dd[:, i, j] = exact
                    xy[:, i, j] = (nx64[:, i] + ny64[:, j] - exact) / 2
                at = None
                if v > self.max_abs[i, j]:      # the first tile holding it, then the first element there
                    q = next(q for q, (lo, hi) in enumerate(per_tile) if max(hi, -lo) == v)
                    t0 = off + q * tiles.rows
                    d = tiles.diff(i, j, t0, min(off + n, t0 + tiles.rows))
                    r, c = divmod(_first_abs_max(d, *per_tile[q]), hs)
                    at = (t0 - off + r, c)
                hits.append((i, j, v, at))
        elif near.any():
            if scratch is None:
                scratch = self._own_scratch = getattr(self, "_own_scratch", None) or _Scratch()
            buf = scratch.buf("diff", (n, hs))
            for i, j in zip(*np.nonzero(near)):
                i, j = int(i), int(j)
                sel = None if ok is None or ok[:, i, j].all() else torch.from_numpy(np.nonzero(ok[:, i, j])[0])
                if sel is None:
                    diff = torch.sub(s3[:, i], t3[:, j], out=buf)
                else:
                    diff = s3[sel, i] - t3[sel, j]
                mn, mx = torch.aminmax(diff)    # one pass; full reductions (aminmax with dim is ~7x slower on CPU)
                mn, mx = float(mn), float(mx)
                v = max(mx, -mn)
                if self.tol < EXACT_BELOW_TOL:
                    exact = torch.linalg.vector_norm(diff, dim=-1).numpy().astype(np.float64) ** 2
                    rows_ij = slice(None) if sel is None else sel.numpy()
                    dd[rows_ij, i, j] = exact
                    xy[rows_ij, i, j] = (nx64[rows_ij, i] + ny64[rows_ij, j] - exact) / 2
                at = None
                if v > self.max_abs[i, j]:      # may be a new maximum: where (the first element with |x - y| = v)
                    r, c = divmod(_first_abs_max(diff, mn, mx), hs)
                    at = (r if sel is None else int(sel[r]), c)
                hits.append((i, j, v, at))
        return _PairPart(info, off, n, xy, nx64, ny64, den, dd, ok, hits)

    def apply(self, parts: Sequence["_PairPart"]) -> None:
        """The accumulating half of :meth:`update`: adds measured blocks, in block order."""
        for p in parts:
            self._apply(p)

    def _apply(self, p: "_PairPart") -> None:
        info, off, n, xy, nx64, ny64, den, dd, ok = p.info, p.off, p.n, p.xy, p.nx64, p.ny64, p.den, p.dd, p.ok
        nxb, nyb = nx64[:, :, None], ny64[:, None, :]
        for i, j, v, at in p.hits:
            if v > self.max_abs[i, j]:
                r, c = at
                self.max_abs[i, j] = v
                self.max_at[i][j] = {"sample": info.key, "row": int(info.rows[off + r]),
                                     "position": int(info.positions[off + r]),
                                     "token_id": int(info.ids[off + r]), "column": int(c)}
        self.rows += n
        self.sdd += dd.sum(0)
        if ok is None:
            self.n += n
            self.sxx += nx64.sum(0)[:, None]
            self.syy += ny64.sum(0)[None, :]
        else:
            self.n += ok.sum(0)
            self.sxx += np.where(ok, nxb, 0.0).sum(0)
            self.syy += np.where(ok, nyb, 0.0).sum(0)
        # per-row statistics
        P = self.ns * self.nu
        base = (np.arange(P) * NB).reshape(1, self.ns, self.nu)
        both = (nxb > 0) & (nyb > 0)
        if ok is None and both.all():     # the common block (every chunk row finite and non-zero): no masking
            rel = dd / den
            self.within += (rel <= self.tol).sum(0)
            self.h_rel += np.bincount((base + _bins_np(rel)).ravel(), minlength=P * NB).reshape(self.ns, self.nu, NB)
            cos = np.clip(xy / np.sqrt(nxb * nyb), -1.0, 1.0)
            ratio = np.sqrt(nxb / nyb)
            lnr = np.log(ratio)
            self.h_cos += np.bincount((base + _bins_np(1 - cos)).ravel(), minlength=P * NB).reshape(
                self.ns, self.nu, NB)
            self.h_lnr += np.bincount((base + _bins_np(np.abs(lnr))).ravel(), minlength=P * NB).reshape(
                self.ns, self.nu, NB)
            self.valid += n
            self.cos_sum += cos.sum(0)
            self.lnr_sum += lnr.sum(0)
            self.lnr_sq += (lnr * lnr).sum(0)
            self.cos_min = np.minimum(self.cos_min, cos.min(0))
            self.nr_min = np.minimum(self.nr_min, ratio.min(0))
            self.nr_max = np.maximum(self.nr_max, ratio.max(0))
            return
        den_b = np.broadcast_to(den, dd.shape)
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(den_b > 0, dd / np.where(den_b > 0, den_b, 1.0), 0.0)
        if ok is None:
            self.within += (rel <= self.tol).sum(0)
            self.h_rel += np.bincount((base + _bins_np(rel)).ravel(), minlength=P * NB).reshape(
                self.ns, self.nu, NB)
        else:
            self.within += ((rel <= self.tol) & ok).sum(0)
            self.h_rel += np.bincount((base + _bins_np(rel)).ravel()[ok.ravel()], minlength=P * NB).reshape(
                self.ns, self.nu, NB)
        if ok is not None:
            both = both & ok
        if both.any():
            both = np.broadcast_to(both, dd.shape)
            with np.errstate(divide="ignore", invalid="ignore"):
                cos = np.clip(np.where(both, xy / np.sqrt(np.where(both, nxb * nyb, 1.0)), 0.0), -1.0, 1.0)
                ratio = np.where(both, np.sqrt(np.where(both, nxb / np.where(both, nyb, 1.0), 1.0)), 1.0)
            lnr = np.log(ratio)
            sel = both.ravel()
            self.h_cos += np.bincount((base + _bins_np(1 - cos)).ravel()[sel], minlength=P * NB).reshape(
                self.ns, self.nu, NB)
            self.h_lnr += np.bincount((base + _bins_np(np.abs(lnr))).ravel()[sel], minlength=P * NB).reshape(
                self.ns, self.nu, NB)
            self.valid += both.sum(0)
            self.cos_sum += np.where(both, cos, 0.0).sum(0)
            self.lnr_sum += np.where(both, lnr, 0.0).sum(0)
            self.lnr_sq += np.where(both, lnr * lnr, 0.0).sum(0)
            self.cos_min = np.minimum(self.cos_min, np.where(both, cos, np.inf).min(0))
            self.nr_min = np.minimum(self.nr_min, np.where(both, ratio, np.inf).min(0))
            self.nr_max = np.maximum(self.nr_max, np.where(both, ratio, -np.inf).max(0))

    def metrics(self, i: int, j: int, tol: Optional[float] = None) -> "PairMetrics":
        """Finalised metrics of pair (i, j). ``tol`` must be the accumulator's tolerance (the exact
        within-tolerance count was taken with it)."""
        if tol is not None and not math.isclose(tol, self.tol, rel_tol=1e-9):
            raise ValueError(f"metrics asked at tolerance {tol:g}; the rows were counted at {self.tol:g}")
        tol = self.tol
        sxx, syy, sdd = self.sxx[i, j], self.syy[i, j], self.sdd[i, j]
        den = sxx + syy
        rel = float(sdd / den) if den > 0 else 0.0
        sxy = (sxx + syy - sdd) / 2
        cos = float(sxy / math.sqrt(sxx * syy)) if sxx > 0 and syy > 0 else (1.0 if sxx == syy == 0 else 0.0)
        nr = float(math.sqrt(sxx / syy)) if syy > 0 else (1.0 if sxx == 0 else math.inf)
        cn = int(self.valid[i, j])
        nr_rows = int(self.n[i, j])
        share = float(self.within[i, j] / nr_rows) if nr_rows else 0.0
        q = lambda h, p: hist_quantile(h, p)  # noqa: E731
        hr, hc, hl = self.h_rel[i, j], self.h_cos[i, j], self.h_lnr[i, j]
        return PairMetrics(
            rel_diff=rel, cosine=cos, norm_ratio=nr,
            mean_row_cosine=float(self.cos_sum[i, j] / cn) if cn else None,
            min_row_cosine=float(self.cos_min[i, j]) if cn else None,
            row_norm_ratio_min=float(self.nr_min[i, j]) if cn else None,
            row_norm_ratio_max=float(self.nr_max[i, j]) if cn else None,
            max_abs_diff=None if self.max_abs[i, j] < 0 else float(self.max_abs[i, j]),
            max_abs_at=self.max_at[i][j], rows=nr_rows,
            share_within=share, row_rel_diff={"p10": q(hr, 0.1), "p50": q(hr, 0.5), "p90": q(hr, 0.9)},
            row_one_minus_cos={"p10": q(hc, 0.1), "p50": q(hc, 0.5), "p90": q(hc, 0.9)},
            row_abs_log_norm_ratio={"p50": q(hl, 0.5), "p90": q(hl, 0.9)},
            mean_log_norm_ratio=float(self.lnr_sum[i, j] / cn) if cn else None,
            std_log_norm_ratio=math.sqrt(max(0.0, float(self.lnr_sq[i, j] / cn)
                                             - (float(self.lnr_sum[i, j] / cn)) ** 2)) if cn else None,
            valid_rows=cn, passed=nr_rows > 0 and share >= MATCH_SHARE, tolerance=tol)


@dataclass
class PairMetrics:
    """Metrics of one served chunk against one training chunk (or reference layer), over all aligned rows.

    ``passed`` (the two are equal) is decided per row: ``share_within`` (rows with rel_diff <= ``tolerance``)
    >= :data:`MATCH_SHARE`. ``rel_diff`` / ``cosine`` / ``norm_ratio`` are the global sums SGLang's comparator
    prints (a few massive rows dominate them); ``row_*`` are quantiles of the per-row values (upper bin
    edges, within a factor 1.26). ``max_abs_diff`` is None for pairs too far apart to be near-equal.
    """

    rel_diff: float
    cosine: float
    norm_ratio: float
    mean_row_cosine: Optional[float]
    min_row_cosine: Optional[float]
    row_norm_ratio_min: Optional[float]
    row_norm_ratio_max: Optional[float]
    max_abs_diff: Optional[float]
    max_abs_at: Optional[dict]
    rows: int
    passed: bool
    tolerance: float
    share_within: float = 0.0
    row_rel_diff: dict = field(default_factory=dict)
    row_one_minus_cos: dict = field(default_factory=dict)
    row_abs_log_norm_ratio: dict = field(default_factory=dict)
    mean_log_norm_ratio: Optional[float] = None
    std_log_norm_ratio: Optional[float] = None
    valid_rows: int = 0

    @property
    def median_rel_diff(self) -> float:
        """Median per-row rel_diff (upper bin edge); ``inf`` when no row was compared."""
        v = self.row_rel_diff.get("p50")
        return math.inf if v is None else v

    @property
    def median_cosine(self) -> Optional[float]:
        v = self.row_one_minus_cos.get("p50")
        return None if v is None else 1 - v

    @property
    def min_tolerance(self) -> dict:
        """The smallest thresholds that would have passed: per-row ``rel_diff`` at the 90 % quantile (the
        robust decision), the global ``rel_diff`` (SGLang's comparator) and ``max_abs`` (near pairs)."""
        return {"row_rel_diff_p90": self.row_rel_diff.get("p90"), "rel_diff": self.rel_diff,
                "max_abs": self.max_abs_diff}

    def to_json(self) -> dict:
        r = lambda x: None if x is None else (x if isinstance(x, float) and math.isinf(x) else float(f"{x:.6g}"))  # noqa: E731
        rd = lambda d: {k: r(v) for k, v in d.items()}  # noqa: E731
        return {"share_within_tolerance": r(self.share_within), "row_rel_diff": rd(self.row_rel_diff),
                "row_cosine_p50": r(self.median_cosine), "row_one_minus_cos": rd(self.row_one_minus_cos),
                "row_abs_log_norm_ratio": rd(self.row_abs_log_norm_ratio),
                "mean_log_norm_ratio": r(self.mean_log_norm_ratio),
                "std_log_norm_ratio": r(self.std_log_norm_ratio),
                "rel_diff": r(self.rel_diff), "cosine": r(self.cosine), "norm_ratio": r(self.norm_ratio),
                "mean_row_cosine": r(self.mean_row_cosine), "min_row_cosine": r(self.min_row_cosine),
                "row_norm_ratio_min": r(self.row_norm_ratio_min), "row_norm_ratio_max": r(self.row_norm_ratio_max),
                "max_abs_diff": r(self.max_abs_diff), "max_abs_at": self.max_abs_at, "rows": self.rows,
                "passed": self.passed, "tolerance": self.tolerance,
                "min_tolerance": {k: r(v) for k, v in self.min_tolerance.items()}}


class ChunkStats:
    """Per-chunk facts about one side's rows: non-finite rows, zero rows (and their token ids), the
    context-free test (rows of equal token ids at different positions compared with each other), and the
    outlier rows (the :data:`TOP_ROWS` largest row energies |x|^2, with position, token id and the dims
    that carry them) against the total energy."""

    def __init__(self, n: int):
        self.n = n
        self.rows = 0
        self.nonfinite = [0] * n
        self.nonfinite_at: list[list[dict]] = [[] for _ in range(n)]
        self.zero = [0] * n
        self.zero_ids: list[set] = [set() for _ in range(n)]
        self.nonzero_min = [None] * n
        self.nonzero_max = [None] * n
        self.ctx_pairs = [0] * n
        self.ctx_max = [0.0] * n
        self.energy = [0.0] * n
        self.h_energy = np.zeros((n, NB), np.int64)
        self.top: list[list[dict]] = [[] for _ in range(n)]
        self._cache: dict[int, tuple[int, torch.Tensor]] = {}
        self._cache_ids: Optional[np.ndarray] = None

    def update(self, x3: torch.Tensor, finite: torch.Tensor, nx: torch.Tensor, info: RowInfo) -> None:
        """``x3`` [n, C, h] (non-finite rows already zeroed; any float dtype: the rows kept are converted to
        float32), ``finite`` [n, C] bool, ``nx`` [n, C] squared row norms."""
        n = x3.shape[0]
        self.rows += n
        fin = finite.numpy()
        nxn = nx.double().numpy()
        zero = (nxn == 0) & fin
        ids = info.ids
        all_fin = bool(fin.all())
        any_zero = bool(zero.any())
        if all_fin and not any_zero:        # the common block: every chunk row finite and non-zero
            lo, hi = int(ids.min()), int(ids.max())
            for c in range(self.n):
                self.nonzero_min[c] = lo if self.nonzero_min[c] is None else min(lo, self.nonzero_min[c])
                self.nonzero_max[c] = hi if self.nonzero_max[c] is None else max(hi, self.nonzero_max[c])
        else:
            for c in range(self.n):
                bad = np.nonzero(~fin[:, c])[0] if not all_fin else ()
                if len(bad):
                    self.nonfinite[c] += int(bad.size)
                    for r in bad[: max(0, 5 - len(self.nonfinite_at[c]))]:
                        self.nonfinite_at[c].append({"sample": info.key, "row": int(info.rows[r]),
                                                     "position": int(info.positions[r]), "token_id": int(ids[r])})
                z = zero[:, c]
                if any_zero and z.any():
                    self.zero[c] += int(z.sum())
                    if len(self.zero_ids[c]) < ID_SET_CAP:
                        self.zero_ids[c].update(ids[z].tolist())
                nz_ids = ids[fin[:, c] & ~z]
                if nz_ids.size:
                    lo, hi = int(nz_ids.min()), int(nz_ids.max())
                    self.nonzero_min[c] = lo if self.nonzero_min[c] is None else min(lo, self.nonzero_min[c])
                    self.nonzero_max[c] = hi if self.nonzero_max[c] is None else max(hi, self.nonzero_max[c])
        # energies [C, n] (contiguous per chunk: the same sums as per column), their histogram in one bincount
        et = np.ascontiguousarray(nxn.T)
        sums = et.sum(1)
        bins = np.searchsorted(_EDGES_UP, et, side="right") + (np.arange(self.n) * NB)[:, None]
        self.h_energy += np.bincount(bins.ravel(), minlength=self.n * NB).reshape(self.n, NB)
        for c in range(self.n):
            e = et[c]
            self.energy[c] += float(sums[c])
            floor = self.top[c][-1]["energy"] if len(self.top[c]) >= TOP_ROWS else -1.0
            cand = np.nonzero(e > floor)[0]
            if cand.size > TOP_ROWS:
                cand = cand[np.argsort(-e[cand])[:TOP_ROWS]]
            for r in cand:
                self._add_top(c, x3[r, c], float(e[r]), info, int(r))
        # context-free test: compare each repeated token id with its first (cached) occurrence, per chunk on the
        # rows finite in both occurrences (a non-finite chunk does not take the other chunks' rows out)
        rowok = fin.any(1)
        if len(self._cache) >= CONTEXT_CACHE_IDS:      # full: it never changes again; look the ids up at once
            if self._cache_ids is None:
                self._cache_ids = np.sort(np.fromiter(self._cache.keys(), np.int64, len(self._cache)))
            ck = self._cache_ids
            cached = ck[np.minimum(np.searchsorted(ck, ids), ck.size - 1)] == ids
            todo = np.nonzero(rowok & cached)[0]
        else:
            todo = np.nonzero(rowok)[0]
        hits, hit_ids, new_rows = [], [], []
        pos = info.positions
        for r in todo.tolist():
            tid = int(ids[r])
            hit = self._cache.get(tid)
            if hit is None:
                if len(self._cache) < CONTEXT_CACHE_IDS:
                    self._cache[tid] = (int(pos[r]), None, fin[r].copy())     # row filled in below
                    new_rows.append(r)
                continue
            if hit[0] != int(pos[r]):
                hits.append(r)
                hit_ids.append(tid)
        if new_rows:                        # the first occurrences' rows, copied at once
            kept = x3[torch.tensor(new_rows)].float()
            for q, r in enumerate(new_rows):
                tid = int(ids[r])
                self._cache[tid] = (self._cache[tid][0], kept[q], self._cache[tid][2])
        refs = [self._cache[t] for t in hit_ids]
        if hits:
            x = x3[torch.tensor(hits)].float()
            ref = torch.stack([h[1] for h in refs])
            both_fin = fin[hits] & np.stack([h[2] for h in refs])
            sq = x.square()
            num = (x - ref).square().sum(-1).double()
            den = (sq.sum(-1) + ref.square().sum(-1)).double()
            # rows dominated by a few massive dims (Sun et al. 2024: first token, delimiters) are nearly equal in
            # every layer, so they say nothing about context: such pairs are left out of the test
            k = min(MASSIVE_DIMS, sq.shape[-1])
            massive = (torch.topk(sq, k, dim=-1).values.sum(-1) > MASSIVE_SHARE * sq.sum(-1)).numpy()
            pos = (den > 0).numpy() & ~massive & both_fin
            rel = (num / torch.where(den > 0, den, torch.ones_like(den))).numpy()
            for c in range(self.n):
                k = int(pos[:, c].sum())
                if k:
                    self.ctx_pairs[c] += k
                    self.ctx_max[c] = max(self.ctx_max[c], float(rel[pos[:, c], c].max()))

    def _add_top(self, c: int, row: torch.Tensor, e: float, info: RowInfo, r: int) -> None:
        top = self.top[c]
        if len(top) >= TOP_ROWS and e <= top[-1]["energy"]:
            return
        sq = row.double().square()
        k = min(3, sq.shape[0])
        v, d = torch.topk(sq, k)
        top.append({"energy": e, "sample": info.key, "position": int(info.positions[r]),
                    "token_id": int(info.ids[r]), "dims": [int(x) for x in d],
                    "dims_energy_share": float(v.sum() / max(e, 1e-300))})
        top.sort(key=lambda t: -t["energy"])
        del top[TOP_ROWS:]

    def context_free(self, c: int, tol: Optional[float] = None) -> Optional[bool]:
        """True if chunk ``c`` gave equal rows for equal token ids at different positions, None if untested
        (no repeated ordinary token). "Equal" is bit-equality up to :data:`CONTEXT_FREE_REL` whatever the
        comparison tolerance: an embedding lookup (and its TP all-reduce of one non-zero shard) repeats a row
        exactly, while any layer mixes in context (in an early layer of a deep target by only ~1e-3)."""
        if self.ctx_pairs[c] == 0:
            return None
        return self.ctx_max[c] <= CONTEXT_FREE_REL

    def outliers(self, c: int) -> dict:
        """Evidence about the rows that dominate chunk ``c``'s energy: the top rows (position, token id,
        dominant dims), their share of ``sum |x|^2``, and their energy against the median row's."""
        med = hist_quantile(self.h_energy[c], 0.5)
        tot = self.energy[c]
        top = self.top[c]
        share = float(sum(t["energy"] for t in top) / tot) if tot > 0 else 0.0
        r = lambda x: float(f"{x:.4g}")  # noqa: E731
        return {"top_rows": [{**{k: v for k, v in t.items() if k != "energy"},
                              "energy_vs_median_row": None if not med else r(t["energy"] / med),
                              "dims_energy_share": r(t["dims_energy_share"])} for t in top],
                "top_rows_energy_share": r(share), "rows": self.rows}

    def to_json(self, c: int) -> dict:
        return {"rows": self.rows, "nonfinite_rows": self.nonfinite[c], "nonfinite_at": self.nonfinite_at[c],
                "zero_rows": self.zero[c], "repeated_token_pairs": self.ctx_pairs[c],
                "repeated_token_max_rel_diff": float(f"{self.ctx_max[c]:.6g}"),
                "nonzero_id_range": None if self.nonzero_min[c] is None else [self.nonzero_min[c], self.nonzero_max[c]],
                "outliers": self.outliers(c)}


class RowReservoir:
    """A seeded uniform sample of up to ``capacity`` aligned rows (reservoir sampling, Vitter's algorithm R),
    for the transform fits of ``helpers.diagnosis.fit``: training row, the primary served view, the reference
    row (bf16, fewer rows when wide: :data:`RESERVOIR_REF_BYTES`), token id and position.

    Memory: fixed buffers ``capacity x (training + served width) x 4`` bytes, allocated on the first block.
    """

    def __init__(self, capacity: int = RESERVOIR_ROWS, seed: int = 0):
        self.capacity = int(capacity)
        self.rng = np.random.default_rng(seed)
        self.seen = 0
        self.count = 0
        self.train = self.served = self.ref = None
        self.ref_capacity = 0
        self.ids = np.zeros(self.capacity, np.int64)
        self.positions = np.zeros(self.capacity, np.int64)

    def add(self, train: torch.Tensor, served: torch.Tensor, ref: Optional[torch.Tensor], info: RowInfo,
            ok: Optional[np.ndarray] = None) -> None:
        """Offer a block: ``train`` [n, Wt], ``served`` [n, Ws] (float32), ``ref`` [n, Wr] or None; only the rows
        where ``ok`` (both sides finite) is true take part."""
        if ok is not None and not ok.all():
            sel = np.nonzero(ok)[0]
            if sel.size == 0:
                return
            rows = sel
        else:
            rows = np.arange(train.shape[0])
        n = rows.size
        if n == 0 or self.capacity == 0:
            return
        if self.train is None:
            self.train = torch.empty(self.capacity, train.shape[1])
            self.served = torch.empty(self.capacity, served.shape[1])
            if ref is not None:
                self.ref_capacity = max(16, min(self.capacity, RESERVOIR_REF_BYTES // (2 * ref.shape[1])))
                self.ref = torch.zeros(self.ref_capacity, ref.shape[1], dtype=torch.bfloat16)
        slots = np.arange(self.seen, self.seen + n)
        take = slots < self.capacity
        rnd = self.rng.integers(0, slots + 1)
        slot = np.where(take, slots, rnd)
        keep = slot < self.capacity
        self.seen += n
        q = np.nonzero(keep)[0]
        if q.size == n and n and rows[-1] - rows[0] == n - 1 and slot[-1] - slot[0] == n - 1 and slot[0] == self.seen - n:
            # filling: one contiguous slice (advanced indexing is ~5x slower than slice / row copies on CPU)
            k0, r0 = int(slot[0]), int(rows[0])
            self.train[k0:k0 + n].copy_(train[r0:r0 + n])
            self.served[k0:k0 + n].copy_(served[r0:r0 + n])
            if self.ref is not None and ref is not None and k0 < self.ref_capacity:
                m = min(n, self.ref_capacity - k0)
                self.ref[k0:k0 + m].copy_(ref[r0:r0 + m])
            self.ids[k0:k0 + n] = info.ids[r0:r0 + n]
            self.positions[k0:k0 + n] = info.positions[r0:r0 + n]
        else:
            for qq in q:                    # later rows replace a few slots each: row copies
                k, r = int(slot[qq]), int(rows[qq])
                self.train[k].copy_(train[r])
                self.served[k].copy_(served[r])
                if self.ref is not None and ref is not None and k < self.ref_capacity:
                    self.ref[k].copy_(ref[r])
                self.ids[k] = int(info.ids[r])
                self.positions[k] = int(info.positions[r])
        self.count = min(self.capacity, self.seen)

    @property
    def ref_count(self) -> int:
        return min(self.count, self.ref_capacity) if self.ref is not None else 0


# --------------------------------------------------------------------------------------------- results

@dataclass
class SourceResult:
    """Everything accumulated for one served source (a TP rank, or a virtual 'sum' / 'gathered' of ranks)."""

    name: str
    tp_rank: Optional[int]
    chunk_width: int
    num_chunks: int
    pairs: PairAccumulator
    stats: ChunkStats
    ref: Optional[PairAccumulator] = None
    agree: Optional[PairAccumulator] = None   # this rank vs rank of index 0 (diagonal chunks used)
    tp_size: Optional[int] = None
    #: served x training pairs on the rows of samples whose prompt ids differ from training (rows that may not be
    #: aligned): reported with the token mismatch, never used to name a layer.
    suspect: Optional[PairAccumulator] = None

    def __post_init__(self):
        if self.suspect is None:
            self.suspect = PairAccumulator(self.pairs.ns, self.pairs.nu, self.pairs.tol)


@dataclass
class Comparison:
    """Result of :func:`compare` (bounded size).

    Attributes:
        hidden_size: H. chunk_width: served chunk width (H, or H/k when sharded).
        shard_factor: k > 1 when each served rank holds H/k columns per chunk.
        training_units: names of the training comparison units (``"t0"`` or ``"t0[r1]"`` for slices).
        sources: one :class:`SourceResult` per served rank, plus ``sum`` / ``gathered`` when several ranks.
        training_stats: :class:`ChunkStats` of the training chunks.
        training_ref: training chunks x reference layers (when a reference is given).
        reference_tensors: the reference layer names.
        tolerance: per-row rel_diff tolerance used; dtypes: the dtypes it came from; tolerance_why: one
            sentence saying what it is and why.
        alignment: pairing facts (samples, rows, token mismatches, unpaired served samples).
        reservoir: :class:`RowReservoir` of aligned rows (training, primary served view, reference).
    """

    hidden_size: int
    chunk_width: int
    shard_factor: int
    served_width: int
    training_width: int
    num_training_chunks: int
    training_units: list[str]
    sources: list[SourceResult]
    training_stats: ChunkStats
    training_ref: Optional[PairAccumulator]
    reference_tensors: Optional[list[str]]
    tolerance: float
    dtypes: dict
    alignment: dict
    tolerance_why: str = ""
    reservoir: Optional[RowReservoir] = None

    def source(self, name: str) -> Optional[SourceResult]:
        return next((s for s in self.sources if s.name == name), None)

    @property
    def primary(self) -> SourceResult:
        """The source the ``chunks`` table reports: the single served source, or TP rank 0 (the rank that
        sends outputs in SGLang: ``managers/scheduler.py::init_ipc_channels``)."""
        return self.sources[0]

    @property
    def rank_sources(self) -> list[SourceResult]:
        return [s for s in self.sources if s.name.startswith("rank") or s.name == "served"]

    def metrics(self, source: SourceResult, i: int, u: int) -> PairMetrics:
        return source.pairs.metrics(i, u, self.tolerance)

    def ranked(self, source: SourceResult, i: int) -> list[tuple[int, PairMetrics]]:
        """Training units ordered from closest to farthest for served chunk ``i`` (:func:`closeness`)."""
        ms = [(u, self.metrics(source, i, u)) for u in range(source.pairs.nu)]
        return sorted(ms, key=lambda um: closeness(um[1]))

    def best_match(self, source: SourceResult, i: int) -> tuple[int, PairMetrics]:
        """(unit, metrics) of the training unit closest to served chunk ``i`` (:func:`closeness`)."""
        return self.ranked(source, i)[0]

    def identify(self, acc: Optional[PairAccumulator], i: int, top: int = 3) -> Optional[dict]:
        """Reference identification of row ``i`` of ``acc`` (served or training chunk x reference layers):
        the closest layer, whether it is equal (per-row decision), and the next candidates with their
        share of rows within tolerance and median per-row rel_diff / cosine."""
        if acc is None or not self.reference_tensors or acc.rows == 0:
            return None
        ms = sorted(((k, acc.metrics(i, k)) for k in range(acc.nu)), key=lambda km: closeness(km[1]))
        k0, m0 = ms[0]
        out = {"best": self.reference_tensors[k0], "rel_diff": m0.rel_diff, "passed": m0.passed,
               "share_within": m0.share_within, "row_rel_diff_p50": m0.row_rel_diff.get("p50"),
               "candidates": [{"tensor": self.reference_tensors[k], "share_within": float(f"{m.share_within:.4g}"),
                               "row_rel_diff_p50": m.row_rel_diff.get("p50"),
                               "row_cosine_p50": None if m.median_cosine is None else float(f"{m.median_cosine:.6g}")}
                              for k, m in ms[:top]]}
        if len(ms) > 1:
            out["runner_up"] = self.reference_tensors[ms[1][0]]
            out["runner_up_rel_diff"] = ms[1][1].rel_diff
        return out


def closeness(m: PairMetrics) -> tuple:
    """Sort key, closest first: more rows within tolerance, then lower median per-row rel_diff, then lower
    global rel_diff."""
    return (-round(m.share_within, 6), m.median_rel_diff, m.rel_diff)


# ----------------------------------------------------------------------------------------------- compare

class _Scratch:
    """Grow-only float32 buffers reused block after block (no allocation / page faults per block)."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def buf(self, name: str, shape: tuple) -> torch.Tensor:
        """The float32 buffer ``name`` viewed as ``shape`` (contents undefined)."""
        need = math.prod(shape)
        b = self._bufs.get(name)
        if b is None or b.numel() < need:
            b = self._bufs[name] = torch.empty(need)
        return b[:need].view(shape)

    def f32(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``src`` (any dtype, 2-D) in the buffer ``name``: the block's one dtype conversion."""
        return self.buf(name, tuple(src.shape)).copy_(src)




class _Pairer:
    """Finds the served sample(s) belonging to each streamed training sample.

    Keys, in order: ``sample_id``; the exact prompt ids at the sample's ``first_position`` (the whole
    prompt part, hashed: a shared system prompt or template suffix does not make samples collide); for
    ``/generate`` JSON lists (in training-sample order by contract) the list position, also used as a
    fallback when the prompt ids differ (then reported as a token mismatch).
    """

    def __init__(self, groups: list[list[Sample]], by_order_fallback: bool):
        self.groups = groups                 # per served sample: one Sample per rank
        self.by_id: dict[str, int] = {}
        self.by_ids: dict[tuple, list[int]] = {}
        self.by_order: dict[int, int] = {}
        self.spans: set[tuple[int, int]] = set()
        for g, ranks in enumerate(groups):
            s = ranks[0]
            if s.sample_id is not None:
                self.by_id.setdefault(str(s.sample_id), g)
            if s.input_ids is not None:
                n = self._prompt_rows(s)
                if n >= 1:
                    span = (s.first_position, n)
                    self.spans.add(span)
                    self.by_ids.setdefault((span, s.input_ids[:n].astype(np.int64).tobytes()), []).append(g)
                if by_order_fallback and "order" in s.meta:
                    self.by_order[int(s.meta["order"])] = g
            else:
                self.by_order[int(s.meta.get("order", g))] = g
        self.used: set[int] = set()

    @staticmethod
    def _prompt_rows(s: Sample) -> int:
        if s.num_prompt_tokens is not None:
            return max(0, min(s.rows, s.num_prompt_tokens - s.first_position))
        return s.rows

    def find(self, tr: Sample, index: int) -> list[tuple[int, str]]:
        found: list[tuple[int, str]] = []

        def add(g, how):
            if g not in self.used and all(g != f[0] for f in found):
                found.append((g, how))
        if tr.sample_id is not None and str(tr.sample_id) in self.by_id:
            add(self.by_id[str(tr.sample_id)], "sample_id")
        ids = tr.input_ids
        for (p0, n) in self.spans:
            if p0 + n <= len(ids):
                for g in self.by_ids.get(((p0, n), ids[p0:p0 + n].astype(np.int64).tobytes()), []):
                    add(g, "input_ids")
        g = self.by_order.get(index)
        if g is not None:
            add(g, "order")
        for g, _ in found:
            self.used.add(g)
        return found


def _group_ranks(served: Sequence[SampleSource]) -> list[list[Sample]]:
    """Line up the samples of several rank sources (same keys, or same order)."""
    if len(served) == 1:
        return [[s] for s in served[0].samples]
    base = served[0].samples
    groups = []
    for n, s in enumerate(base):
        row = [s]
        for src in served[1:]:
            other = next((o for o in src.samples if o.key == s.key), None)
            if other is None and n < len(src.samples):
                other = src.samples[n]
            if other is None or other.rows != s.rows or (
                    other.input_ids is not None and s.input_ids is not None
                    and not np.array_equal(other.input_ids, s.input_ids)):
                raise BadInput(f"rank files hold different samples: {src.path} has no sample matching "
                               f"{served[0].path} sample {s.key!r} ({s.rows} rows)", path=src.path)
            row.append(other)
        groups.append(row)
    return groups


def _chunking(served_width: int, H: int, Wt: int, tp_sizes: set, n_ranks: int, path) -> tuple[int, int]:
    """(chunk width, shard factor k) for a served width."""
    if served_width % H == 0:
        return H, 1
    cands = sorted({k for k in tp_sizes if k} | ({n_ranks} if n_ranks > 1 else set()) | {2, 4, 8, 16})
    for k in cands:
        if H % k == 0 and served_width % (H // k) == 0 and (k in tp_sizes or k == n_ranks or served_width * k == Wt):
            return H // k, k
    raise BadInput(f"served width {served_width} is not a multiple of the target hidden size {H} "
                   "(nor a TP-sharded fraction of it)", path=path, field="width")


def compare(training: Iterable[Sample], served: Sequence[SampleSource], *, hidden_size: int,
            training_width: int, training_dtype: Optional[str] = None, served_dtype: Optional[str] = None,
            reference: Optional[SampleSource] = None, tolerance: Optional[float] = None,
            block_rows: int = 128, reservoir_rows: int = RESERVOIR_ROWS) -> Comparison:
    """Compare served aux hidden states (one source per TP rank) with streamed training samples.

    Args:
        training: training samples (streamed; e.g. :class:`helpers.formats.training_data.TrainingData`), rows
            ``[L, nt*H]`` aligned to ``input_ids``.
        served: served sources, one per TP rank (or one replicated source); each sample ``[T, Ws]``.
        hidden_size: target H (the chunk width of training data).
        training_width: ``nt * H``.
        training_dtype / served_dtype: dtype names for the tolerance (served JSON floats: pass the target's
            dtype if known).
        reference: a source whose ``layer_plan["tensors"]`` names each H-wide chunk (all layers), aligned to
            the same tokens, to identify every served and training chunk.
        tolerance: override the dtype-derived per-row rel_diff tolerance.
        block_rows: rows converted to float32 at once.
        reservoir_rows: aligned rows kept (seeded uniform sample) for the transform fits.

    Returns:
        :class:`Comparison`.

    Raises:
        BadInput: widths not divisible by H, rank files that disagree, a reference without a layer plan, or
            no served sample matching any training sample by ``input_ids`` ("mismatched token ids").

    Alignment: a served sample is paired with a training sample by ``sample_id``, else by its first
    ``input_ids`` at its ``first_position``, else (no ids: ``/generate`` without ``return_prompt_token_ids``)
    by order. Rows are compared while tokens agree; a disagreement inside the prompt is a token mismatch
    (rows after it have another context); after the prompt it only ends the comparable decode rows. The rows
    before a prompt mismatch go to the sources' ``suspect`` accumulators only (a sample whose prompt differs may
    be another sample altogether: its rows are evidence for the mismatch, not for a layer), counted in
    ``alignment["rows_in_mismatched_samples"]``.

    Non-finite values: each chunk pair is compared on the rows finite in both of its chunks, so a non-finite
    chunk never removes another chunk's rows; ``PairMetrics.rows`` is the number of rows a pair compared.
    """
    H = int(hidden_size)
    Wt = int(training_width)
    if Wt % H:
        raise BadInput(f"training width {Wt} is not a multiple of the hidden size {H}", field="training width")
    nt = Wt // H
    if not served or not any(src.samples for src in served):
        raise BadInput("no served samples")
    widths = {src.width for src in served}
    if len(widths) != 1:
        raise BadInput(f"served rank files have different widths {sorted(widths)}", path=served[1].path)
    Ws = widths.pop()
    tp_sizes = {src.tp_size for src in served} | {s.tp_size for src in served for s in src.samples[:1]}
    hs, k = _chunking(Ws, H, Wt, tp_sizes, len(served), served[0].path)
    ns = Ws // hs
    units = [f"t{j}" for j in range(nt)] if k == 1 else [f"t{j}[r{r}]" for j in range(nt) for r in range(k)]
    nu = len(units)
    dtypes = {"training": training_dtype, "served": served_dtype or served[0].dtype}
    tol = float(tolerance) if tolerance is not None else tolerance_for(training_dtype, dtypes["served"])
    why = tolerance_why(tol, dtypes, overridden=tolerance is not None)
    reservoir = RowReservoir(reservoir_rows)
    if all(src.tp_rank is not None for src in served):
        served = sorted(served, key=lambda src: src.tp_rank)
    groups = _group_ranks(served)
    multi = len(served) > 1

    names = [f"rank{src.tp_rank if src.tp_rank is not None else n}" for n, src in enumerate(served)] if multi else ["served"]
    sources = [SourceResult(name=nm, tp_rank=src.tp_rank, chunk_width=hs, num_chunks=ns,
                            pairs=PairAccumulator(ns, nu, tol), stats=ChunkStats(ns),
                            tp_size=src.tp_size or (src.samples[0].tp_size if src.samples else None))
               for nm, src in zip(names, served)]
    if multi:
        for s in sources[1:]:
            s.agree = PairAccumulator(ns, ns, tol)
        if k == 1:
            sources.append(SourceResult("sum", None, hs, ns, PairAccumulator(ns, nu, tol), ChunkStats(ns)))
        elif len(served) == k:
            sources.append(SourceResult("gathered", None, H, ns, PairAccumulator(ns, nt, tol), ChunkStats(ns)))
    ref_tensors = None
    ref_pairer = None
    train_ref = None
    if reference is not None:
        plan = reference.layer_plan or {}
        ref_tensors = plan.get("tensors") if isinstance(plan, dict) else None
        if not ref_tensors:
            raise BadInput("the reference has no layer_plan.tensors naming its chunks", path=reference.path,
                           field="layer_plan")
        if reference.width != len(ref_tensors) * H:
            raise BadInput(f"reference width {reference.width} != {len(ref_tensors)} tensors x hidden {H}",
                           path=reference.path, field="width")
        ref_pairer = _Pairer([[s] for s in reference.samples], by_order_fallback=False)
        train_ref = PairAccumulator(nt, len(ref_tensors), tol)
        for s in sources:
            if s.chunk_width == H:
                s.ref = PairAccumulator(s.num_chunks, len(ref_tensors), tol)
    train_stats = ChunkStats(nt)
    pairer = _Pairer(groups, by_order_fallback=all(src.format == "sglang-generate" for src in served))
    align = {"samples_paired": 0, "training_samples_seen": 0, "rows_compared": 0, "decode_rows_compared": 0,
             "paired_by": {}, "token_mismatches": [], "unpaired_served": [], "rows_beyond_training": 0,
             "rows_in_mismatched_samples": 0}

    blocks = _Blocks()
    try:
        for ti, tr in enumerate(training):
            align["training_samples_seen"] += 1
            found = pairer.find(tr, ti)
            if not found:
                continue
            tr_rows = None
            ref_rows = None
            ref_sample = None
            if ref_pairer is not None:
                rf = ref_pairer.find(tr, ti)
                ref_sample = reference.samples[rf[0][0]] if rf else None
            for g, how in found:
                ranks = groups[g]
                for r in groups[g + 1] if g + 1 < len(groups) else []:
                    r.hint()                         # served samples usually follow training order
                s0 = ranks[0]
                p0 = s0.first_position
                L = tr.rows
                tids = tr.input_ids
                if s0.input_ids is not None:
                    sids = s0.input_ids
                else:
                    n_dec = max(len(s0.output_ids or []) - 1, 0)
                    n_prompt = s0.rows - n_dec
                    sids = np.concatenate([tids[p0:p0 + n_prompt], np.asarray((s0.output_ids or [])[:-1], np.int64)])
                    if len(sids) < s0.rows:   # prompt longer than the training sample: unknown ids
                        sids = np.concatenate([sids, np.full(s0.rows - len(sids), -1, np.int64)])
                n = max(0, min(s0.rows, L - p0))
                align["rows_beyond_training"] += max(0, s0.rows - n)
                eq = sids[:n] == tids[p0:p0 + n]
                bad = np.nonzero(~eq)[0]
                m = int(bad[0]) if bad.size else n
                prompt_rows = (s0.num_prompt_tokens - p0) if s0.num_prompt_tokens is not None else s0.rows
                suspect = m < min(n, prompt_rows) or (m == 0 and n > 0)
                if suspect:
                    align["token_mismatches"].append({
                        "served_sample": s0.key, "training_sample": tr.sample_id, "position": int(p0 + m),
                        "served_token_id": int(sids[m]) if m < len(sids) else None,
                        "training_token_id": int(tids[p0 + m]) if p0 + m < L else None, "rows_compared": m,
                        "paired_by": how})
                if m == 0:
                    continue
                align["samples_paired"] += 1
                align["paired_by"][how] = align["paired_by"].get(how, 0) + 1
                align["rows_compared"] += m
                align["decode_rows_compared"] += max(0, m - prompt_rows)
                if suspect:
                    align["rows_in_mismatched_samples"] += m
                if tr_rows is None:
                    blocks.next_sample()             # at most this and the previous sample stay referenced
                    tr_rows = tr.load()
                    if ref_sample is not None:
                        ref_rows = ref_sample.load()
                srows = [r.load()[:m] for r in ranks]
                trow = tr_rows[p0:p0 + m]
                rrow = None
                if ref_sample is not None:
                    rp = p0 - ref_sample.first_position
                    if 0 <= rp and rp + m <= ref_sample.rows and ref_sample.input_ids is not None and \
                            np.array_equal(ref_sample.input_ids[rp:rp + m], tids[p0:p0 + m]):
                        rrow = ref_rows[rp:rp + m]
                _compare_rows(blocks, sources, srows, trow, rrow, hs, H, k, ns, nt, train_stats, train_ref,
                              block_rows, reservoir, key=s0.key, positions=np.arange(p0, p0 + m),
                              ids=tids[p0:p0 + m].copy(), suspect=suspect)
            del tr_rows, ref_rows
        blocks.finish()
    finally:
        blocks.close()
    align["training_truncated"] = bool(getattr(training, "truncated", False))
    for g, ranks in enumerate(groups):
        if g not in pairer.used:
            s0 = ranks[0]
            align["unpaired_served"].append({"served_sample": s0.key, "first_position": s0.first_position,
                                             "first_ids": None if s0.input_ids is None else
                                             [int(x) for x in s0.input_ids[:8]]})
    if align["samples_paired"] == 0:
        tm = align["token_mismatches"][:1]
        first = next(iter([groups[0][0]]), None)
        detail = (f"first mismatch: served {tm[0]['served_sample']} position {tm[0]['position']} "
                  f"id {tm[0]['served_token_id']} vs training {tm[0]['training_sample']} id "
                  f"{tm[0]['training_token_id']}" if tm else
                  f"served sample {first.key!r} starts with ids "
                  f"{None if first.input_ids is None else [int(x) for x in first.input_ids[:8]]} at position "
                  f"{first.first_position}; {align['training_samples_seen']} training samples searched")
        raise BadInput(f"mismatched token ids: no served sample matches any training sample ({detail})",
                       path=served[0].path, field="input_ids")
    return Comparison(hidden_size=H, chunk_width=hs, shard_factor=k, served_width=Ws, training_width=Wt,
                      num_training_chunks=nt, training_units=units, sources=sources, training_stats=train_stats,
                      training_ref=train_ref, reference_tensors=ref_tensors, tolerance=tol, dtypes=dtypes,
                      alignment=align, tolerance_why=why, reservoir=reservoir)


def _finite_rows(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite [n, C] per chunk row, squared norms [n, C]); non-finite chunk rows are zeroed in place."""
    nx = torch.linalg.vector_norm(x3, dim=-1).square()
    fin = torch.isfinite(nx)
    if not bool(fin.all()):
        x3[~fin] = 0
        nx = torch.where(fin, nx, torch.zeros_like(nx))
    return fin, nx


#: threads that compare blocks: the calling thread plus E3F_COMPARE_THREADS - 1 workers (default: one per core, up
#: to 2 threads; 1 = everything in the calling thread). Workers only run :func:`_prepare` (the tensor work).
_PIPELINE = None
#: per-block scratch buffers: one per block not yet consumed (see :class:`_Blocks`).
_SLOTS: list["_Scratch"] = []


def _pipeline() -> Optional[ThreadPoolExecutor]:
    """The block pipeline's worker threads (each runs torch ops on one intra-op thread: the blocks, not the ops,
    are spread over the cores), or None when turned off / on a single core."""
    global _PIPELINE
    if _PIPELINE is None:
        want = int(os.environ.get("E3F_COMPARE_THREADS", "0") or 0) or min(2, os.cpu_count() or 1)
        _PIPELINE = ThreadPoolExecutor(want - 1, thread_name_prefix="e3f-compare", initializer=torch.set_num_threads,
                                       initargs=(1,)) if want >= 2 else False
    return _PIPELINE or None


def _slot(i: int) -> "_Scratch":
    while len(_SLOTS) <= i:
        _SLOTS.append(_Scratch())
    return _SLOTS[i]


class _Block:
    """One block added to :class:`_Blocks`: its sample number, scratch slot, arguments, the worker's future and,
    once prepared by the calling thread instead, the result."""

    __slots__ = ("sample", "slot", "a", "args", "rest", "fut", "prep")

    def __init__(self, sample, slot, a, args, rest):
        self.sample, self.slot, self.a, self.args, self.rest = sample, slot, a, args, rest
        self.fut: Optional[Future] = None
        self.prep: Optional[dict] = None

    def run(self) -> dict:
        """``_prepare`` of the block; drops the arguments first (they hold the sample's rows, which must not
        outlive the block: see :meth:`_Blocks.next_sample`)."""
        args, self.args = self.args, None
        return _prepare(self.slot, self.a, *args)

    def steal(self) -> bool:
        """Prepare the block in the calling thread if no worker has started it."""
        if self.prep is None and self.fut.cancel():
            self.prep = self.run()
            return True
        return False


class _Blocks:
    """The block pipeline of one :func:`compare`. Blocks are queued to the worker threads for :func:`_prepare` (the
    tensor work) up to ``workers + 1`` ahead, across sample boundaries; the calling thread runs :func:`_consume` of
    the blocks in the order they were added (so the results are those of a sequential pass) and, rather than wait
    for a block a worker is still preparing, prepares a later queued block itself: no thread waits while there is
    work, and a machine loaded by other processes costs no more than a single thread. Each block not yet consumed
    has its own scratch slot.

    Samples: blocks of at most the current and the previous loaded sample are referenced (:meth:`next_sample`
    consumes older ones before the next sample is loaded), so streaming keeps at most 2 samples alive."""

    def __init__(self):
        self.pool = _pipeline()
        self.ahead = self.pool._max_workers + 1 if self.pool is not None else 0
        self.pending: deque[_Block] = deque()
        self.count = 0                       # blocks added: block c uses slot c % (ahead + 1)
        self.sample = 0

    def add(self, a: int, prepare_args: tuple, consume_args: tuple) -> None:
        """Compare the block starting at row ``a``: ``_prepare(slot, a, *prepare_args)`` then, in order,
        ``_consume(prepared, *consume_args)``."""
        if self.pool is None:
            _consume(_prepare(_slot(0), a, *prepare_args), *consume_args)
            return
        slot = _slot(self.count % (self.ahead + 1))
        self.count += 1
        blk = _Block(self.sample, slot, a, prepare_args, consume_args)
        blk.fut = self.pool.submit(blk.run)
        self.pending.append(blk)
        while len(self.pending) > self.ahead:
            self._consume_next()

    def _consume_next(self) -> None:
        blk = self.pending[0]
        if blk.prep is None and not blk.steal():
            while not blk.fut.done() and any(later.steal() for later in list(self.pending)[1:]):
                pass                         # a worker is on it: prepare later blocks meanwhile
            blk.prep = blk.fut.result()
        self.pending.popleft()
        _consume(blk.prep, *blk.rest)
        blk.prep.clear()                     # the future may outlive the block in the worker for a moment

    def next_sample(self) -> None:
        """A new sample is about to be loaded: consume the blocks of samples before the previous one."""
        while self.pending and self.pending[0].sample < self.sample:
            self._consume_next()
        self.sample += 1

    def finish(self) -> None:
        """Consume every block still pending."""
        while self.pending:
            self._consume_next()

    def close(self) -> None:
        """After an error: wait until no worker uses a scratch slot any more (nothing is consumed)."""
        while self.pending:
            blk = self.pending.popleft()
            blk.fut.cancel() or blk.fut.exception()


def _compare_rows(blocks: _Blocks, sources, srows, trow, rrow, hs, H, k, ns, nt, train_stats, train_ref, block_rows,
                  reservoir, *, key, positions, ids, suspect: bool = False) -> None:
    """Compare one aligned sample block by block through ``blocks``: :func:`_prepare` (float32 copies, finite rows,
    row norms and :meth:`PairAccumulator.measure` of every chunk pair) and :func:`_consume` (per-chunk stats,
    reservoir, :meth:`PairAccumulator.apply`), see :class:`_Blocks`.

    ``suspect``: the sample's prompt ids differ from training (its rows may not be aligned): its served x training
    pairs go to each source's ``suspect`` accumulator (reported with the token mismatch, never used to name a
    layer), and its rows stay out of the reservoir and the served x reference identification."""
    args = (sources, srows, trow, rrow, hs, H, k, ns, nt, train_ref, key, positions, ids, block_rows, suspect)
    rest = (sources, train_stats, reservoir, suspect)
    for a in range(0, trow.shape[0], block_rows):
        blocks.add(a, args, rest)


def _prepare(sc: "_Scratch", a, sources, srows, trow, rrow, hs, H, k, ns, nt, train_ref, key, positions, ids,
             block_rows, suspect=False) -> dict:
    """The tensor work of one block (see :func:`_compare_rows`), in scratch ``sc``: the block's float32 rows (or
    source views), finite masks, row norms and the measured chunk pairs (``jobs``: (accumulator, parts)).
    One served source: :func:`_prepare_tiled`; several ranks, or a block holding a non-finite row:
    :func:`_prepare_block`."""
    b = min(trow.shape[0], a + block_rows)
    info = RowInfo(key=key, rows=np.arange(a, b), positions=positions[a:b], ids=ids[a:b])
    if len(srows) == 1:
        prep = _prepare_tiled(sc, a, b, info, sources[0], srows[0], trow, rrow, hs, H, k, ns, nt, train_ref,
                              suspect)
        if prep is not None:
            return prep
    return _prepare_block(sc, a, b, info, sources, srows, trow, rrow, hs, H, k, ns, nt, train_ref, suspect)


#: bytes of float32 rows converted at once by :func:`_prepare_tiled` (training + served + reference row widths):
#: a tile is compared while it is in the core's L2 cache (2 MiB per core on the machine of bench/RESULTS.md), so
#: the block's rows are read from memory once, in their own dtype, and never written back as float32: with two
#: threads on two cores, whole-block float32 copies measured ~1.5x the CPU time (memory-bound), tiles ~1.1x.
TILE_BYTES = 3 << 19


def _tile_rows(row_bytes: int) -> int:
    """Rows per tile: the largest power of two (<= :data:`PAIR_ROWS`, which it divides) within :data:`TILE_BYTES`."""
    r = 1
    while r < PAIR_ROWS and 2 * r * row_bytes <= TILE_BYTES:
        r *= 2
    return r


class _Tiles:
    """What :func:`_prepare_tiled` measured tile by tile for one pair accumulator: the per-row inner products
    ``xy`` [n, ns, nu] (float32) and, for the pairs expected near (the accumulator's last near pairs), the min and
    max of ``x - y`` per tile (``lo`` / ``hi``) and, for a float32 tolerance, the per-row ``|x - y|`` (``dist``).
    :meth:`diff` converts a tile's two chunks again, for a near pair not expected or the coordinate of a new
    maximum."""

    def __init__(self, rows: int, xy: torch.Tensor, pairs, exact: bool, s_src: torch.Tensor, t_src: torch.Tensor,
                 scratch: "_Scratch"):
        self.rows, self.xy, self.s_src, self.t_src, self.sc, self.exact = rows, xy, s_src, t_src, scratch, exact
        self.ntiles = -(-xy.shape[0] // rows)
        self.lo: dict = {}
        self.hi: dict = {}
        self.dist: dict = {}
        for p in pairs:
            self._new(p)

    def _new(self, p: tuple) -> None:
        self.lo[p], self.hi[p] = np.empty(self.ntiles), np.empty(self.ntiles)
        if self.exact:
            self.dist[p] = torch.empty(self.xy.shape[0])

    def add(self, p: tuple, q: int, t0: int, d: torch.Tensor) -> None:
        """Tile ``q`` (rows from ``t0``) of pair ``p``: ``d`` = x - y (contiguous); as in :func:`_prepare_tiled`."""
        dn = d.numpy()
        self.lo[p][q], self.hi[p][q] = dn.min(), dn.max()
        if self.exact:
            torch.linalg.vector_norm(d, dim=-1, out=self.dist[p][t0:t0 + d.shape[0]])

    def diff(self, i: int, j: int, a: int, b: int) -> torch.Tensor:
        """``x_i - y_j`` of rows [a, b) (float32, in scratch)."""
        xs = self.sc.buf("rediff_s", (b - a, self.s_src.shape[-1])).copy_(self.s_src[a:b, i])
        ys = self.sc.buf("rediff_t", (b - a, self.t_src.shape[-1])).copy_(self.t_src[a:b, j])
        return xs.sub_(ys)

    def near(self, i: int, j: int, a: int, b: int):
        """(min, max, per tile [(min, max)], exact |x - y|^2 (float64) or None) of pair (i, j) over rows [a, b)
        (``a`` a multiple of the tile rows)."""
        p = (i, j)
        if p not in self.lo:            # not expected near: measure it now
            self._new(p)
            n = self.xy.shape[0]
            for q, t0 in enumerate(range(0, n, self.rows)):
                self.add(p, q, t0, self.diff(i, j, t0, min(n, t0 + self.rows)))
        k0, k1 = a // self.rows, -(-b // self.rows)
        lo, hi = self.lo[p][k0:k1].tolist(), self.hi[p][k0:k1].tolist()
        ex = self.dist[p][a:b].numpy().astype(np.float64) ** 2 if self.exact else None
        return min(lo), max(hi), list(zip(lo, hi)), ex


def _runs(pairs) -> list[tuple[int, int, list]]:
    """Pairs (i, j) grouped into diagonal runs (i0 + m, j0 + m), m < len: one subtraction each."""
    runs: list[tuple[int, int, list]] = []
    for i, j in sorted(pairs, key=lambda p: (p[0] - p[1], p[0])):
        if runs and runs[-1][0] + len(runs[-1][2]) == i and runs[-1][1] + len(runs[-1][2]) == j:
            runs[-1][2].append((i, j))
        else:
            runs.append((i, j, [(i, j)]))
    return runs


def _prepare_tiled(sc, a, b, info, src, srow, trow, rrow, hs, H, k, ns, nt, train_ref, suspect) -> Optional[dict]:
    """One served source: the block's rows are converted to float32 a tile at a time (:func:`_tile_rows`) and every
    tensor statistic is taken while the tile is in cache: row norms, per-row inner products of each chunk pair (one
    bmm per accumulator), the differences of the pairs expected near (one subtraction per diagonal run of pairs,
    e.g. served chunks 0, 1, 2 against training chunks 0, 1, 2). Few, large torch calls: each is a hand-over of
    the GIL between the threads. The per-chunk stats and the reservoir read the few rows they keep from the source
    rows. None (nothing kept) when a row is not finite: the block then goes through :func:`_prepare_block`, which
    zeroes those rows."""
    n = b - a
    tsrc, ssrc = trow[a:b], srow[a:b]
    rsrc = rrow[a:b] if rrow is not None else None
    Wt, Ws = tsrc.shape[1], ssrc.shape[1]
    Wr = rsrc.shape[1] if rsrc is not None else 0
    R = _tile_rows(4 * (Wt + Ws + Wr))
    nr = Wr // H
    shapes = {"T": (nt, H), "TU": (nt * k, hs), "S": (ns, hs), "R": (nr, H)}
    srcs = {"T": tsrc, "TU": tsrc, "S": ssrc, "R": rsrc}
    jobs = [(src.suspect if suspect else src.pairs, "S", "TU", hs)]
    if src.ref is not None and rsrc is not None and not suspect:
        jobs.append((src.ref, "S", "R", H))
    if train_ref is not None and rsrc is not None:
        jobs.append((train_ref, "T", "R", H))
    tiles = [_Tiles(R, torch.empty(n, shapes[sn][0], shapes[tn][0]), sorted(acc.near_hint), acc.tol < EXACT_BELOW_TOL,
                    srcs[sn].reshape(n, *shapes[sn]), srcs[tn].reshape(n, *shapes[tn]), sc)
             for acc, sn, tn, _ in jobs]
    # training and served rows side by side in one tile buffer when the chunks are equally wide: one norm call
    joint = k == 1
    buf = sc.buf("tile", (R, Wt + Ws + Wr))
    norms = {"TS": torch.empty(n, nt + ns)} if joint else {"T": torch.empty(n, nt), "S": torch.empty(n, ns)}
    if k > 1:
        norms["TU"] = torch.empty(n, nt * k)
    if Wr:
        norms["R"] = torch.empty(n, nr)

    def plan(r: int):
        """The views of an r-row tile: what to convert, whose norms, each accumulator's products and differences."""
        tile = buf[:r]
        x = {"T": tile[:, :Wt].unflatten(1, shapes["T"]), "TU": tile[:, :Wt].unflatten(1, shapes["TU"]),
             "S": tile[:, Wt:Wt + Ws].unflatten(1, shapes["S"])}
        if joint:
            x["TS"] = tile[:, :Wt + Ws].unflatten(1, (nt + ns, H))
        if Wr:
            x["R"] = tile[:, Wt + Ws:].unflatten(1, shapes["R"])
        copies = [(tile[:, :Wt], tsrc), (tile[:, Wt:Wt + Ws], ssrc)] + ([(tile[:, Wt + Ws:], rsrc)] if Wr else [])
        pairs = []
        for (acc, sn, tn, w), tl in zip(jobs, tiles):
            near = []
            for i0, j0, run in (_runs(tl.lo) if not tl.exact else [(i, j, [(i, j)]) for i, j in tl.lo]):
                m = len(run)
                d = sc.buf(f"tile_diff{w}", (R * m, w))[:r * m].view(r, m, w)
                near.append((x[sn][:, i0:i0 + m], x[tn][:, j0:j0 + m], d, d.numpy(),
                             [(tl.lo[p], tl.hi[p], tl.dist.get(p)) for p in run]))
            pairs.append((tl.xy, x[sn], x[tn].transpose(1, 2), near))
        return copies, [(x[s], nrm) for s, nrm in norms.items()], pairs

    full = plan(R)
    for q, t0 in enumerate(range(0, n, R)):
        t1 = min(n, t0 + R)
        copies, nrms, pairs = full if t1 - t0 == R else plan(t1 - t0)
        for dst, source in copies:          # the tile's one dtype conversion
            dst.copy_(source[t0:t1])
        for x, nrm in nrms:
            torch.linalg.vector_norm(x, dim=-1, out=nrm[t0:t1])
        for xy, xs, yt, near in pairs:
            torch.bmm(xs, yt, out=xy[t0:t1])
            for xi, yj, d, dn, run in near:
                torch.sub(xi, yj, out=d)
                if len(run) == 1:           # on a tile numpy's min + max: half of torch.aminmax's time
                    lo, hi, dist = run[0]
                    lo[q], hi[q] = dn.min(), dn.max()
                    if dist is not None:
                        torch.linalg.vector_norm(d[:, 0], dim=-1, out=dist[t0:t1])
                else:
                    for (lo, hi, _), mn, mx in zip(run, dn.min(axis=(0, 2)), dn.max(axis=(0, 2))):
                        lo[q], hi[q] = mn, mx
    for nrm in norms.values():
        nrm.square_()
        if not bool(torch.isfinite(nrm).all()):
            return None
    if joint:
        norms["T"], norms["S"] = norms["TS"][:, :nt], norms["TS"][:, nt:]
    norms.setdefault("TU", norms["T"])
    out = [(acc, acc.measure(tl.s_src, tl.t_src, info, w, norms[sn], norms[tn], tiles=tl))
           for (acc, sn, tn, w), tl in zip(jobs, tiles)]
    return {"info": info, "t": tsrc, "t3": tsrc.reshape(n, nt, H), "tfin": torch.ones(n, nt, dtype=torch.bool),
            "tnx": norms["T"], "r3": rsrc.reshape(n, nr, H) if rsrc is not None else None,
            "s3s": [(ssrc.reshape(n, ns, hs), torch.ones(n, ns, dtype=torch.bool), None, norms["S"])], "extra": None,
            "primary": ssrc, "ok": None, "n": n, "jobs": out}


def _prepare_block(sc, a, b, info, sources, srows, trow, rrow, hs, H, k, ns, nt, train_ref, suspect) -> dict:
    """The block's rows as float32 copies (non-finite chunk rows zeroed, per-chunk finite masks), every served rank
    and the virtual ``sum`` / ``gathered`` source."""
    n = b - a
    multi = len(srows) > 1
    t = sc.f32("train", trow[a:b])
    t3 = t.view(n, nt, H)
    tfin, tnx = _finite_rows(t3)
    r3 = sc.f32("ref", rrow[a:b]).view(n, -1, H) if rrow is not None else None
    s3s = []
    for n_src, sr in enumerate(srows):
        s3 = sc.f32(f"served{n_src}", sr[a:b]).view(n, ns, hs)
        sfin, snx = _finite_rows(s3)
        s3s.append((s3, sfin, _mask(sfin), snx))
    primary, pfin = s3s[0][0], s3s[0][2]
    extra = None
    if multi and len(sources) > len(srows):
        src_x = sources[len(srows)]
        fins = [f for _, _, f, _ in s3s]
        allfin = None if all(f is None for f in fins) else np.logical_and.reduce(
            [np.ones((n, ns), bool) if f is None else f for f in fins])
        if src_x.name == "sum":
            v = torch.stack([x for x, _, _, _ in s3s]).sum(0)
        else:  # gathered: concatenate each chunk's column slices in rank order
            v = torch.cat([x for x, _, _, _ in s3s], dim=-1)
            primary, pfin = v, allfin
        vfin, vnx = _finite_rows(v)
        extra = (src_x, v, allfin, vfin if allfin is None else vfin & torch.from_numpy(allfin), vnx)
    tf = _mask(tfin)
    ok = None if suspect else _rows_with_finite(n, tf, pfin)

    jobs = []
    tu = t3 if k == 1 else t3.reshape(n, nt * k, hs)
    tfu = tf if k == 1 or tf is None else np.repeat(tf, k, axis=1)
    for src, (s3, _, sfin, snx) in zip(sources, s3s):
        jobs.append(_measure_sel(src.suspect if suspect else src.pairs, s3, tu, sfin, tfu, info, hs, sc, snx,
                                 tnx if k == 1 else None))
        if src.ref is not None and r3 is not None and not suspect:
            jobs.append(_measure_sel(src.ref, s3, r3, sfin, None, info, H, sc))
    if len(s3s) > 1:
        base, _, bfin, _ = s3s[0]
        for src, (s3, _, sfin, _) in zip(sources[1:len(s3s)], s3s[1:]):
            jobs.append(_measure_sel(src.agree, s3, base, sfin, bfin, info, hs, sc))
    if extra is not None:
        src_x, v, allfin, _, _ = extra
        gathered = src_x.name == "gathered"
        jobs.append(_measure_sel(src_x.suspect if suspect else src_x.pairs, v, t3 if gathered else tu, allfin,
                                 tf if gathered else tfu, info, v.shape[-1], sc))
        if src_x.ref is not None and r3 is not None and not suspect:
            jobs.append(_measure_sel(src_x.ref, v, r3, allfin, None, info, H, sc))
    if train_ref is not None and r3 is not None:
        jobs.append(_measure_sel(train_ref, t3, r3, tf, None, info, H, sc))
    return {"info": info, "t": t, "t3": t3, "tfin": tfin, "tnx": tnx, "r3": r3, "s3s": s3s, "extra": extra,
            "primary": primary, "ok": ok, "n": n, "jobs": jobs}


def _rows_with_finite(n: int, *masks: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Rows (bool [n]) where every given per-chunk finite mask ([n, chunks], None = all finite) has at least one
    finite chunk; None when every mask is None (the fast path)."""
    given = [m.any(1) for m in masks if m is not None]
    return np.logical_and.reduce(given) if given else None


def _mask(fin: torch.Tensor) -> Optional[np.ndarray]:
    """Per-chunk finite mask as numpy, or None when every chunk row is finite (the fast path)."""
    return None if bool(fin.all()) else fin.numpy().copy()


def _consume(prep, sources, train_stats, reservoir, suspect=False) -> None:
    """Add one prepared block, in block order: per-chunk stats (training, each served source, the virtual one), the
    reservoir (not for suspect rows) and every measured chunk pair."""
    info, n = prep["info"], prep["n"]
    train_stats.update(prep["t3"], prep["tfin"], prep["tnx"], info)
    for src, (s3, sfin, _, snx) in zip(sources, prep["s3s"]):
        src.stats.update(s3, sfin, snx, info)
    if prep["extra"] is not None:
        src_x, v, _, vfin, vnx = prep["extra"]
        src_x.stats.update(v, vfin, vnx, info)
    if not suspect:
        r3 = prep["r3"]
        reservoir.add(prep["t"], prep["primary"].reshape(n, -1), None if r3 is None else r3.reshape(n, -1), info,
                      prep["ok"])
    for acc, parts in prep["jobs"]:
        acc.apply(parts)


def _measure_sel(acc: PairAccumulator, s3, t3, sfin: Optional[np.ndarray], tfin: Optional[np.ndarray],
                 info: RowInfo, hs: int, scratch: "_Scratch", nx: Optional[torch.Tensor] = None,
                 ny: Optional[torch.Tensor] = None) -> tuple[PairAccumulator, list]:
    """``(acc, acc.measure(...))`` on the rows where at least one chunk pair is finite on both sides (``sfin`` /
    ``tfin``: per-chunk finite masks, None = all finite), with the per-chunk masks passed on."""
    if sfin is None and tfin is None:
        return acc, acc.measure(s3, t3, info, hs, nx, ny, scratch=scratch)
    ok = _rows_with_finite(s3.shape[0], sfin, tfin)
    if ok.all():
        return acc, acc.measure(s3, t3, info, hs, nx, ny, sfin=sfin, tfin=tfin, scratch=scratch)
    idx = np.nonzero(ok)[0]
    if idx.size == 0:
        return acc, []
    sel = torch.from_numpy(idx)
    sub = RowInfo(key=info.key, rows=info.rows[idx], positions=info.positions[idx], ids=info.ids[idx])
    return acc, acc.measure(s3[sel], t3[sel], sub, hs, None if nx is None else nx[sel],
                            None if ny is None else ny[sel], sfin=None if sfin is None else sfin[idx],
                            tfin=None if tfin is None else tfin[idx], scratch=scratch)
