"""Token-aligned, chunk-by-chunk comparison of served aux hidden states with training data.

For every served chunk i and every training chunk j (each H wide; ``H/k`` wide column slices when a rank
holds a TP-sharded width) the comparison accumulates, over all rows aligned by ``input_ids``:

* ``rel_diff`` = 1 - 2<x,y>/(|x|^2+|y|^2) (DeepGEMM-style, as SGLang's
  ``sglang/srt/debug_utils/comparator/utils.py::calc_rel_diff``), computed as sum|x-y|^2/(sum|x|^2+sum|y|^2)
  so that near-equal tensors do not lose precision to cancellation;
* ``cosine`` = <x,y>/(|x||y|) over all rows, plus mean / min per-row cosine;
* ``norm_ratio`` = |x|/|y| over all rows, plus min / max per-row ratio;
* ``max_abs_diff`` with its coordinate (sample, row, position, token id, column);
* ``min_tolerance``: the smallest ``rel_diff`` / ``max_abs`` thresholds that would have passed.

The pass/fail tolerance comes from the dtypes (:data:`REL_DIFF_TOLERANCE`).

Memory: the training data are streamed (one sample at a time) and rows are processed in blocks whose
scratch is a [:data:`PAIR_ROWS`, width] buffer; served samples from project dumps are read lazily per
sample. Only bounded summaries are kept: per pair sums/extrema, and per token id at most
:data:`CONTEXT_CACHE_IDS` cached rows for the context-free (embedding) test.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..formats.dumps import Sample, SampleSource
from ..errors import BadInput

#: rel_diff tolerance by dtype. bf16 rounding alone gives rel_diff ~1e-6 (rel_diff is quadratic in the
#: relative error); kernel/reduction-order differences between engines reach ~1e-4..1e-3 in bf16. SGLang's
#: comparator default is 1e-3 (``debug_utils/comparator``); 2e-3 keeps a margin for bf16 while an adjacent
#: layer (rel_diff >= ~1e-2 in real models, >= 5e-2 in the tiny test model) never passes.
REL_DIFF_TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "float16": 1e-3, "bfloat16": 2e-3}
#: rows per pair-loop step: the [rows, width] float32 difference buffer stays cache-resident.
PAIR_ROWS = 64
#: pairs whose Gram-based |x-y|^2 is below this fraction of |x|^2+|y|^2 get it recomputed elementwise.
NEAR_REL = 1e-2
#: token ids whose first row is cached per source for the context-free test.
CONTEXT_CACHE_IDS = 256
#: token ids of all-zero rows remembered per chunk for the vocab-shard test (zero rows are rare otherwise).
ID_SET_CAP = 1 << 16


def tolerance_for(*dtypes: Optional[str]) -> float:
    """rel_diff tolerance for comparing data of these dtypes: the loosest one (unknown names are ignored;
    float32 if none is known)."""
    tols = [REL_DIFF_TOLERANCE[d.replace("torch.", "")] for d in dtypes if d and d.replace("torch.", "") in REL_DIFF_TOLERANCE]
    return max(tols) if tols else REL_DIFF_TOLERANCE["float32"]


def norm_tolerance(rel_tol: float) -> float:
    """Per-row norm-ratio tolerance matching a rel_diff tolerance (rel_diff ~ (relative error)^2 / 2)."""
    return max(1e-4, 10 * math.sqrt(rel_tol))


# ------------------------------------------------------------------------------------------ accumulators

@dataclass
class RowInfo:
    """Where the rows of a block come from (for coordinates)."""

    key: str
    rows: np.ndarray          # served row index of each block row
    positions: np.ndarray     # sequence positions
    ids: np.ndarray           # token ids


class PairAccumulator:
    """Sums and extrema for an [ns x nu] grid of chunk pairs, updated block by block (float64 sums)."""

    def __init__(self, ns: int, nu: int):
        self.ns, self.nu = ns, nu
        z = lambda: np.zeros((ns, nu), np.float64)  # noqa: E731
        self.sxx, self.syy, self.sdd = z(), z(), z()
        self.rows = 0
        self.cos_sum, self.cos_n = z(), np.zeros((ns, nu), np.int64)
        self.cos_min = np.full((ns, nu), np.inf)
        self.nr_min = np.full((ns, nu), np.inf)
        self.nr_max = np.zeros((ns, nu))
        self.max_abs = np.full((ns, nu), -1.0)
        self.max_at: list[list[Optional[dict]]] = [[None] * nu for _ in range(ns)]

    def update(self, s3: torch.Tensor, t3: torch.Tensor, info: RowInfo, hs: int,
               nx: Optional[torch.Tensor] = None, ny: Optional[torch.Tensor] = None) -> None:
        """Add a block: ``s3`` [n, ns, hs] and ``t3`` [n, nu, hs] float32, rows aligned and finite; ``nx`` /
        ``ny`` are their squared row norms per chunk if already computed."""
        n = s3.shape[0]
        if n == 0:
            return
        if nx is None:
            nx = torch.linalg.vector_norm(s3, dim=-1).square()
        if ny is None:
            ny = torch.linalg.vector_norm(t3, dim=-1).square()
        for a in range(0, n, PAIR_ROWS):
            b = min(n, a + PAIR_ROWS)
            self._update(s3[a:b], t3[a:b], nx[a:b], ny[a:b], info, a, hs)

    def _update(self, s3, t3, nx, ny, info: RowInfo, off: int, hs: int) -> None:
        n = s3.shape[0]
        # <x, y> per row and pair through one small batched matmul; |x - y|^2 = |x|^2 + |y|^2 - 2<x, y> is exact
        # enough for far pairs, and recomputed elementwise below for near pairs (no cancellation).
        xy = torch.bmm(s3, t3.transpose(1, 2)).double()            # [n, ns, nu]
        nx64, ny64 = nx.double(), ny.double()
        nxb, nyb = nx64[:, :, None].expand_as(xy), ny64[:, None, :].expand_as(xy)
        dd = (nxb + nyb - 2 * xy).clamp_min(0)
        near = (dd.sum(0) <= NEAR_REL * (nxb + nyb).sum(0)).numpy()
        buf = self._buf(n, hs)
        los, his = [], []
        for i in range(self.ns):
            si = s3[:, i]
            for j in range(self.nu):
                torch.sub(si, t3[:, j], out=buf)
                mn, mx = torch.aminmax(buf)     # one pass; full reductions (aminmax with dim is ~7x slower on CPU)
                los.append(mn)
                his.append(mx)
                if near[i, j]:
                    exact = torch.linalg.vector_norm(buf, dim=-1).double().square()
                    dd[:, i, j] = exact
                    xy[:, i, j] = (nx64[:, i] + ny64[:, j] - exact) / 2
        lo = torch.stack(los).view(self.ns, self.nu)
        hi = torch.stack(his).view(self.ns, self.nu)
        big = torch.maximum(hi, -lo).double().numpy()
        better = big > self.max_abs
        for i, j in zip(*np.nonzero(better)):
            d = (s3[:, i] - t3[:, j]).abs()
            r, c = divmod(int(d.argmax()), hs)
            self.max_abs[i, j] = big[i, j]
            self.max_at[i][j] = {"sample": info.key, "row": int(info.rows[off + r]),
                                 "position": int(info.positions[off + r]), "token_id": int(info.ids[off + r]),
                                 "column": int(c)}
        self.rows += n
        self.sdd += dd.sum(0).numpy()
        self.sxx += nx64.sum(0).numpy()[:, None]
        self.syy += ny64.sum(0).numpy()[None, :]
        both = (nxb > 0) & (nyb > 0)
        if bool(both.any()):
            one = torch.ones_like(xy)
            cos = torch.where(both, xy / torch.where(both, torch.sqrt(nxb * nyb), one), torch.zeros_like(xy))
            ratio = torch.where(both, torch.sqrt(nxb / torch.where(both, nyb, one)), one)
            self.cos_sum += cos.sum(0).numpy()
            self.cos_n += both.sum(0).numpy()
            inf = torch.full_like(cos, math.inf)
            self.cos_min = np.minimum(self.cos_min, torch.where(both, cos, inf).amin(0).numpy())
            self.nr_min = np.minimum(self.nr_min, torch.where(both, ratio, inf).amin(0).numpy())
            self.nr_max = np.maximum(self.nr_max, torch.where(both, ratio, -inf).amax(0).numpy())

    def _buf(self, n: int, hs: int) -> torch.Tensor:
        b = getattr(self, "_scratch", None)
        if b is None or b.numel() < n * hs:
            b = self._scratch = torch.empty(max(n, PAIR_ROWS) * hs)
        return b[:n * hs].view(n, hs)

    def metrics(self, i: int, j: int, tol: float) -> "PairMetrics":
        """Finalised metrics of pair (i, j) against tolerance ``tol``."""
        sxx, syy, sdd = self.sxx[i, j], self.syy[i, j], self.sdd[i, j]
        den = sxx + syy
        rel = float(sdd / den) if den > 0 else 0.0
        sxy = (sxx + syy - sdd) / 2
        cos = float(sxy / math.sqrt(sxx * syy)) if sxx > 0 and syy > 0 else (1.0 if sxx == syy == 0 else 0.0)
        nr = float(math.sqrt(sxx / syy)) if syy > 0 else (1.0 if sxx == 0 else math.inf)
        cn = int(self.cos_n[i, j])
        return PairMetrics(
            rel_diff=rel, cosine=cos, norm_ratio=nr,
            mean_row_cosine=float(self.cos_sum[i, j] / cn) if cn else None,
            min_row_cosine=float(self.cos_min[i, j]) if cn else None,
            row_norm_ratio_min=float(self.nr_min[i, j]) if cn else None,
            row_norm_ratio_max=float(self.nr_max[i, j]) if cn else None,
            max_abs_diff=float(max(self.max_abs[i, j], 0.0)), max_abs_at=self.max_at[i][j], rows=self.rows,
            passed=rel <= tol, tolerance=tol)


@dataclass
class PairMetrics:
    """Metrics of one served chunk against one training chunk (or reference layer), over all aligned rows."""

    rel_diff: float
    cosine: float
    norm_ratio: float
    mean_row_cosine: Optional[float]
    min_row_cosine: Optional[float]
    row_norm_ratio_min: Optional[float]
    row_norm_ratio_max: Optional[float]
    max_abs_diff: float
    max_abs_at: Optional[dict]
    rows: int
    passed: bool
    tolerance: float

    @property
    def min_tolerance(self) -> dict:
        """The smallest thresholds that would have passed: ``rel_diff`` and ``max_abs``."""
        return {"rel_diff": self.rel_diff, "max_abs": self.max_abs_diff}

    def to_json(self) -> dict:
        r = lambda x: None if x is None else float(f"{x:.6g}")  # noqa: E731
        return {"rel_diff": r(self.rel_diff), "cosine": r(self.cosine), "norm_ratio": r(self.norm_ratio),
                "mean_row_cosine": r(self.mean_row_cosine), "min_row_cosine": r(self.min_row_cosine),
                "row_norm_ratio_min": r(self.row_norm_ratio_min), "row_norm_ratio_max": r(self.row_norm_ratio_max),
                "max_abs_diff": r(self.max_abs_diff), "max_abs_at": self.max_abs_at, "rows": self.rows,
                "passed": self.passed, "tolerance": self.tolerance,
                "min_tolerance": {k: r(v) for k, v in self.min_tolerance.items()}}


class ChunkStats:
    """Per-chunk facts about one side's rows: non-finite rows, zero rows (and their token ids), and the
    context-free test (rows of equal token ids at different positions compared with each other)."""

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
        self._cache: dict[int, tuple[int, torch.Tensor]] = {}

    def update(self, x3: torch.Tensor, finite: torch.Tensor, nx: torch.Tensor, info: RowInfo) -> None:
        """``x3`` [n, C, h] float32 (non-finite rows already zeroed), ``finite`` [n, C] bool, ``nx`` [n, C]."""
        n = x3.shape[0]
        self.rows += n
        fin = finite.numpy()
        zero = (nx == 0).numpy() & fin
        ids = info.ids
        for c in range(self.n):
            bad = np.nonzero(~fin[:, c])[0]
            if bad.size:
                self.nonfinite[c] += int(bad.size)
                for r in bad[: max(0, 5 - len(self.nonfinite_at[c]))]:
                    self.nonfinite_at[c].append({"sample": info.key, "row": int(info.rows[r]),
                                                 "position": int(info.positions[r]), "token_id": int(ids[r])})
            z = zero[:, c]
            if z.any():
                self.zero[c] += int(z.sum())
                if len(self.zero_ids[c]) < ID_SET_CAP:
                    self.zero_ids[c].update(ids[z].tolist())
            nzm = fin[:, c] & ~z
            if nzm.any():
                nz_ids = ids[nzm]
                lo, hi = int(nz_ids.min()), int(nz_ids.max())
                self.nonzero_min[c] = lo if self.nonzero_min[c] is None else min(lo, self.nonzero_min[c])
                self.nonzero_max[c] = hi if self.nonzero_max[c] is None else max(hi, self.nonzero_max[c])
        # context-free test: compare each repeated token id with its first (cached) occurrence
        rowok = fin.all(1)
        for r in range(n):
            if not rowok[r]:
                continue
            tid = int(ids[r])
            hit = self._cache.get(tid)
            if hit is None:
                if len(self._cache) < CONTEXT_CACHE_IDS:
                    self._cache[tid] = (int(info.positions[r]), x3[r].clone())
                continue
            pos0, ref = hit
            if pos0 == int(info.positions[r]):
                continue
            x = x3[r]
            num = (x - ref).square().sum(-1).double()
            den = (x.square().sum(-1) + ref.square().sum(-1)).double()
            rel = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))
            for c in range(self.n):
                if float(den[c]) > 0:
                    self.ctx_pairs[c] += 1
                    self.ctx_max[c] = max(self.ctx_max[c], float(rel[c]))

    def context_free(self, c: int, tol: float) -> Optional[bool]:
        """True if chunk ``c`` gave equal rows for equal token ids (within ``tol``), None if untested."""
        if self.ctx_pairs[c] == 0:
            return None
        return self.ctx_max[c] <= tol

    def to_json(self, c: int) -> dict:
        return {"rows": self.rows, "nonfinite_rows": self.nonfinite[c], "nonfinite_at": self.nonfinite_at[c],
                "zero_rows": self.zero[c], "repeated_token_pairs": self.ctx_pairs[c],
                "repeated_token_max_rel_diff": float(f"{self.ctx_max[c]:.6g}"),
                "nonzero_id_range": None if self.nonzero_min[c] is None else [self.nonzero_min[c], self.nonzero_max[c]]}


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
        tolerance: rel_diff tolerance used; dtypes: the dtypes it came from.
        alignment: pairing facts (samples, rows, token mismatches, unpaired served samples).
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

    def best_match(self, source: SourceResult, i: int) -> tuple[int, PairMetrics]:
        """(unit, metrics) of the training unit closest to served chunk ``i`` (lowest rel_diff)."""
        ms = [self.metrics(source, i, u) for u in range(len(self.training_units))]
        u = int(np.argmin([m.rel_diff for m in ms]))
        return u, ms[u]

    def identify(self, acc: Optional[PairAccumulator], i: int) -> Optional[dict]:
        """Reference identification of row ``i`` of ``acc``: best tensor, its rel_diff, runner-up."""
        if acc is None or not self.reference_tensors or acc.rows == 0:
            return None
        rds = [acc.metrics(i, k, self.tolerance).rel_diff for k in range(acc.nu)]
        order = np.argsort(rds)
        best = int(order[0])
        out = {"best": self.reference_tensors[best], "rel_diff": rds[best], "passed": rds[best] <= self.tolerance}
        if len(order) > 1:
            out["runner_up"] = self.reference_tensors[int(order[1])]
            out["runner_up_rel_diff"] = rds[int(order[1])]
        return out


# ----------------------------------------------------------------------------------------------- compare

class _Scratch:
    """Grow-only float32 buffers reused block after block (no allocation / page faults per block)."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def f32(self, name: str, src: torch.Tensor) -> torch.Tensor:
        """A float32 copy of ``src`` (any dtype, 2-D) in the buffer ``name``."""
        need = src.numel()
        b = self._bufs.get(name)
        if b is None or b.numel() < need:
            b = self._bufs[name] = torch.empty(need)
        out = b[:need].view(src.shape)
        out.copy_(src)
        return out


_SCRATCH = _Scratch()


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
            block_rows: int = 64) -> Comparison:
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
        tolerance: override the dtype-derived rel_diff tolerance.
        block_rows: rows converted to float32 at once.

    Returns:
        :class:`Comparison`.

    Raises:
        BadInput: widths not divisible by H, rank files that disagree, a reference without a layer plan, or
            no served sample matching any training sample by ``input_ids`` ("mismatched token ids").

    Alignment: a served sample is paired with a training sample by ``sample_id``, else by its first
    ``input_ids`` at its ``first_position``, else (no ids: ``/generate`` without ``return_prompt_token_ids``)
    by order. Rows are compared while tokens agree; a disagreement inside the prompt is a token mismatch
    (rows after it have another context); after the prompt it only ends the comparable decode rows.
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
    if all(src.tp_rank is not None for src in served):
        served = sorted(served, key=lambda src: src.tp_rank)
    groups = _group_ranks(served)
    multi = len(served) > 1

    names = [f"rank{src.tp_rank if src.tp_rank is not None else n}" for n, src in enumerate(served)] if multi else ["served"]
    sources = [SourceResult(name=nm, tp_rank=src.tp_rank, chunk_width=hs, num_chunks=ns,
                            pairs=PairAccumulator(ns, nu), stats=ChunkStats(ns),
                            tp_size=src.tp_size or (src.samples[0].tp_size if src.samples else None))
               for nm, src in zip(names, served)]
    if multi:
        for s in sources[1:]:
            s.agree = PairAccumulator(ns, ns)
        if k == 1:
            sources.append(SourceResult("sum", None, hs, ns, PairAccumulator(ns, nu), ChunkStats(ns)))
        elif len(served) == k:
            sources.append(SourceResult("gathered", None, H, ns, PairAccumulator(ns, nt), ChunkStats(ns)))
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
        train_ref = PairAccumulator(nt, len(ref_tensors))
        for s in sources:
            if s.chunk_width == H:
                s.ref = PairAccumulator(s.num_chunks, len(ref_tensors))
    train_stats = ChunkStats(nt)
    pairer = _Pairer(groups, by_order_fallback=all(src.format == "sglang-generate" for src in served))
    align = {"samples_paired": 0, "training_samples_seen": 0, "rows_compared": 0, "decode_rows_compared": 0,
             "paired_by": {}, "token_mismatches": [], "unpaired_served": [], "rows_beyond_training": 0}

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
            if m < min(n, prompt_rows) or (m == 0 and n > 0):
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
            if tr_rows is None:
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
            _compare_rows(sources, srows, trow, rrow, hs, H, k, ns, nt, train_stats, train_ref, block_rows,
                          key=s0.key, positions=np.arange(p0, p0 + m), ids=tids[p0:p0 + m].copy())
        del tr_rows, ref_rows
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
                      alignment=align)


def _finite_rows(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(finite [n, C] per chunk row, squared norms [n, C]); non-finite chunk rows are zeroed in place."""
    nx = torch.linalg.vector_norm(x3, dim=-1).square()
    fin = torch.isfinite(nx)
    if not bool(fin.all()):
        x3[~fin] = 0
        nx = torch.where(fin, nx, torch.zeros_like(nx))
    return fin, nx


def _compare_rows(sources, srows, trow, rrow, hs, H, k, ns, nt, train_stats, train_ref, block_rows, *, key,
                  positions, ids) -> None:
    m = trow.shape[0]
    multi = len(srows) > 1
    for a in range(0, m, block_rows):
        b = min(m, a + block_rows)
        info = RowInfo(key=key, rows=np.arange(a, b), positions=positions[a:b], ids=ids[a:b])
        t = _SCRATCH.f32("train", trow[a:b])
        t3 = t.view(b - a, nt, H)
        tfin, tnx = _finite_rows(t3)
        train_stats.update(t3, tfin, tnx, info)
        tu = t3 if k == 1 else t3.reshape(b - a, nt * k, hs)
        tok = tfin.all(1)
        s3s = []
        for n_src, (src, sr) in enumerate(zip(sources, srows)):
            s = _SCRATCH.f32(f"served{n_src}", sr[a:b])
            s3 = s.view(b - a, ns, hs)
            sfin, snx = _finite_rows(s3)
            src.stats.update(s3, sfin, snx, info)
            s3s.append((s3, sfin))
            _update_sel(src.pairs, s3, tu, sfin.all(1) & tok, info, hs, snx, tnx if k == 1 else None)
            if src.ref is not None and rrow is not None:
                r3 = _SCRATCH.f32("ref", rrow[a:b]).view(b - a, -1, H)
                _update_sel(src.ref, s3, r3, sfin.all(1), info, H)
        if multi:
            base, bfin = s3s[0]
            for src, (s3, sfin) in zip(sources[1:len(srows)], s3s[1:]):
                _update_sel(src.agree, s3, base, sfin.all(1) & bfin.all(1), info, hs)
            allfin = torch.stack([f.all(1) for _, f in s3s]).all(0)
            extra = sources[len(srows)] if len(sources) > len(srows) else None
            if extra is not None:
                if extra.name == "sum":
                    v = torch.stack([x for x, _ in s3s]).sum(0)
                else:  # gathered: concatenate each chunk's column slices in rank order
                    v = torch.cat([x for x, _ in s3s], dim=-1)
                vfin, vnx = _finite_rows(v)
                extra.stats.update(v, vfin, vnx, info)
                _update_sel(extra.pairs, v, t3 if extra.name == "gathered" else tu, allfin & tok, info,
                            v.shape[-1])
                if extra.ref is not None and rrow is not None:
                    r3 = _SCRATCH.f32("ref", rrow[a:b]).view(b - a, -1, H)
                    _update_sel(extra.ref, v, r3, allfin, info, H)
        if train_ref is not None and rrow is not None:
            r3 = _SCRATCH.f32("ref", rrow[a:b]).view(b - a, -1, H)
            _update_sel(train_ref, t3, r3, tok, info, H)


def _update_sel(acc: PairAccumulator, s3, t3, ok: torch.Tensor, info: RowInfo, hs: int,
                nx: Optional[torch.Tensor] = None, ny: Optional[torch.Tensor] = None) -> None:
    if bool(ok.all()):
        acc.update(s3, t3, info, hs, nx, ny)
        return
    sel = torch.nonzero(ok).flatten()
    if sel.numel() == 0:
        return
    idx = sel.numpy()
    sub = RowInfo(key=info.key, rows=info.rows[idx], positions=info.positions[idx], ids=info.ids[idx])
    acc.update(s3[sel], t3[sel], sub, hs, None if nx is None else nx[sel], None if ny is None else ny[sel])
