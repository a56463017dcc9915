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

Stages (typed intermediates): :func:`plan_comparison` (widths, chunking, units, tolerance: :class:`ComparePlan`),
:func:`new_accumulators` (:class:`Accumulators`, reference checked), :func:`accumulate` (the streaming pass:
:func:`helpers.diagnosis.alignment.align_sample` per paired sample, then the block pipeline below; returns the
:class:`helpers.diagnosis.comparison.Alignment`) and :func:`results` (the :class:`Comparison`). The accumulators
live in :mod:`helpers.diagnosis.accumulators`, the result types in :mod:`helpers.diagnosis.comparison`, the
pairing in :mod:`helpers.diagnosis.alignment`; this module keeps the stages and the block pipeline (executor).

Speed: blocks are compared by the calling thread and ``E3F_COMPARE_THREADS - 1`` workers (:class:`_Blocks`);
``bench/bench_compare.py`` measures it against a plain read + dot-product pass over the same bytes.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch

from ..errors import BadInput
from ..formats.dumps import Sample, SampleSource
from .accumulators import (  # noqa: F401  (re-exported: the comparison's public names)
    CONTEXT_CACHE_IDS,
    CONTEXT_FREE_REL,
    EXACT_BELOW_TOL,
    HIST_EDGES,
    MATCH_SHARE,
    NEAR_REL,
    PAIR_ROWS,
    REL_DIFF_TOLERANCE,
    RESERVOIR_ROWS,
    ChunkStats,
    PairAccumulator,
    PairMetrics,
    RowInfo,
    RowReservoir,
    _first_abs_max,
    _PairPart,
    _Scratch,
    hist_quantile,
    norm_tolerance,
    tolerance_for,
    tolerance_why,
)
from .alignment import Pairer, align_sample, chunking, finish_alignment, group_ranks
from .comparison import (  # noqa: F401  (re-exported)
    Alignment,
    Candidate,
    Comparison,
    Identification,
    SourceResult,
    closeness,
)




# ------------------------------------------------------------------------------------------------ stages

@dataclass(frozen=True)
class ComparePlan:
    """What one comparison compares (no data read yet).

    Attributes:
        H: target hidden size; Wt / nt: training width and chunks; Ws: served width; hs / k: served chunk width and
        shard factor (hs = H / k); ns: served chunks; units: training comparison units (``t0`` or ``t0[r1]`` per
        H/k slice); dtypes / tol / why: the tolerance and where it comes from; served: the sources in TP-rank order;
        groups: per served sample, one :class:`Sample` per rank.
    """

    H: int
    Wt: int
    nt: int
    Ws: int
    hs: int
    k: int
    ns: int
    units: list[str]
    dtypes: dict
    tol: float
    why: str
    served: list[SampleSource]
    groups: list[list[Sample]]

    @property
    def nu(self) -> int:
        return len(self.units)

    @property
    def multi(self) -> bool:
        return len(self.served) > 1


@dataclass
class Accumulators:
    """Everything the pass accumulates (bounded): one :class:`SourceResult` per served source (plus ``sum`` /
    ``gathered`` of several ranks), the training chunks' :class:`ChunkStats`, training x reference pairs, the
    reservoir, and the reference's tensor names."""

    sources: list[SourceResult]
    train_stats: ChunkStats
    train_ref: Optional[PairAccumulator]
    reservoir: RowReservoir
    ref_tensors: Optional[list[str]]


def plan_comparison(served: Sequence[SampleSource], *, hidden_size: int, training_width: int,
                    training_dtype: Optional[str], served_dtype: Optional[str],
                    tolerance: Optional[float]) -> ComparePlan:
    """The :class:`ComparePlan` of :func:`compare` (its arguments).

    Raises:
        BadInput: widths not divisible by H, no served sample, rank files of different widths or samples.
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
    hs, k = chunking(Ws, H, Wt, tp_sizes, len(served), served[0].path)
    ns = Ws // hs
    units = [f"t{j}" for j in range(nt)] if k == 1 else [f"t{j}[r{r}]" for j in range(nt) for r in range(k)]
    dtypes = {"training": training_dtype, "served": served_dtype or served[0].dtype}
    tol = float(tolerance) if tolerance is not None else tolerance_for(training_dtype, dtypes["served"])
    why = tolerance_why(tol, dtypes, overridden=tolerance is not None)
    if all(src.tp_rank is not None for src in served):
        served = sorted(served, key=lambda src: src.tp_rank)
    return ComparePlan(H=H, Wt=Wt, nt=nt, Ws=Ws, hs=hs, k=k, ns=ns, units=units, dtypes=dtypes, tol=tol, why=why,
                       served=list(served), groups=group_ranks(served))


def new_accumulators(p: ComparePlan, reference: Optional[SampleSource], reservoir_rows: int) -> Accumulators:
    """Empty :class:`Accumulators` for plan ``p`` (and the reference, checked here).

    Raises:
        BadInput: a reference without ``layer_plan.tensors`` or whose width is not one H per tensor.
    """
    H, ns, nu, tol = p.H, p.ns, p.nu, p.tol
    reservoir = RowReservoir(reservoir_rows)
    names = ([f"rank{src.tp_rank if src.tp_rank is not None else n}" for n, src in enumerate(p.served)] if p.multi
             else ["served"])
    sources = [SourceResult(name=nm, tp_rank=src.tp_rank, chunk_width=p.hs, num_chunks=ns,
                            pairs=PairAccumulator(ns, nu, tol), stats=ChunkStats(ns),
                            tp_size=src.tp_size or (src.samples[0].tp_size if src.samples else None))
               for nm, src in zip(names, p.served)]
    if p.multi:
        for s in sources[1:]:
            s.agree = PairAccumulator(ns, ns, tol)
        if p.k == 1:
            sources.append(SourceResult("sum", None, p.hs, ns, PairAccumulator(ns, nu, tol), ChunkStats(ns)))
        elif len(p.served) == p.k:
            sources.append(SourceResult("gathered", None, H, ns, PairAccumulator(ns, p.nt, tol), ChunkStats(ns)))
    ref_tensors = None
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
        train_ref = PairAccumulator(p.nt, len(ref_tensors), tol)
        for s in sources:
            if s.chunk_width == H:
                s.ref = PairAccumulator(s.num_chunks, len(ref_tensors), tol)
    return Accumulators(sources=sources, train_stats=ChunkStats(p.nt), train_ref=train_ref, reservoir=reservoir,
                        ref_tensors=ref_tensors)


def accumulate(training: Iterable[Sample], p: ComparePlan, acc: Accumulators, reference: Optional[SampleSource],
               block_rows: int) -> Alignment:
    """The streaming pass: pair each training sample with its served sample(s) (and reference sample), align
    them (:func:`helpers.diagnosis.alignment.align_sample`) and compare the aligned rows block by block into
    ``acc`` (:func:`_compare_rows`). Returns the :class:`Alignment`.

    Raises:
        BadInput: no served sample paired with any training sample (:func:`finish_alignment`).
    """
    groups = p.groups
    ref_pairer = Pairer([[s] for s in reference.samples], by_order_fallback=False) if reference is not None else None
    pairer = Pairer(groups, by_order_fallback=all(src.format == "sglang-generate" for src in p.served))
    align = Alignment()
    blocks = _Blocks()
    try:
        for ti, tr in enumerate(training):
            align.training_samples_seen += 1
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
                sa = align_sample(s0, tr, how, align)
                m, p0 = sa.rows, sa.first_position
                if m == 0:
                    continue
                tids = tr.input_ids
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
                _compare_rows(blocks, acc.sources, srows, trow, rrow, p.hs, p.H, p.k, p.ns, p.nt, acc.train_stats,
                              acc.train_ref, block_rows, acc.reservoir, key=s0.key, positions=np.arange(p0, p0 + m),
                              ids=tids[p0:p0 + m].copy(), suspect=sa.suspect)
            del tr_rows, ref_rows
        blocks.finish()
    finally:
        blocks.close()
    return finish_alignment(align, training, groups, pairer, p.served)


def results(p: ComparePlan, acc: Accumulators, alignment: Alignment) -> Comparison:
    """The :class:`Comparison` of a finished pass."""
    return Comparison(hidden_size=p.H, chunk_width=p.hs, shard_factor=p.k, served_width=p.Ws, training_width=p.Wt,
                      num_training_chunks=p.nt, training_units=p.units, sources=acc.sources,
                      training_stats=acc.train_stats, training_ref=acc.train_ref, reference_tensors=acc.ref_tensors,
                      tolerance=p.tol, dtypes=p.dtypes, alignment=alignment, tolerance_why=p.why,
                      reservoir=acc.reservoir)


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
    ``alignment.rows_in_mismatched_samples``.

    Non-finite values: each chunk pair is compared on the rows finite in both of its chunks, so a non-finite
    chunk never removes another chunk's rows; ``PairMetrics.rows`` is the number of rows a pair compared.
    """
    p = plan_comparison(served, hidden_size=hidden_size, training_width=training_width,
                        training_dtype=training_dtype, served_dtype=served_dtype, tolerance=tolerance)
    acc = new_accumulators(p, reference, reservoir_rows)
    return results(p, acc, accumulate(training, p, acc, reference, block_rows))


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
