"""What a comparison accumulates (bounded): per chunk pair (:class:`PairAccumulator`, read as
:class:`PairMetrics`), per chunk (:class:`ChunkStats`) and a seeded sample of aligned rows (:class:`RowReservoir`);
the tolerance and histogram constants they use. :func:`helpers.diagnosis.compare.compare` drives them (see its
module docstring for what each statistic is and why)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

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
