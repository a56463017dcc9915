"""The result types of :func:`helpers.diagnosis.compare.compare`: the :class:`Comparison` with one
:class:`SourceResult` per served source, the :class:`Alignment` of served and training samples, and a reference
:class:`Identification` (:meth:`Comparison.identify`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional, TypedDict

from .accumulators import ChunkStats, PairAccumulator, PairMetrics, RowReservoir


class TokenMismatch(TypedDict):
    """A served sample whose ids differ from its training sample's inside the prompt."""

    served_sample: str
    training_sample: Optional[str]
    position: int
    served_token_id: Optional[int]
    training_token_id: Optional[int]
    rows_compared: int
    paired_by: str


class UnpairedSample(TypedDict):
    """A served sample no training sample was paired with."""

    served_sample: str
    first_position: int
    first_ids: Optional[list[int]]


@dataclass
class Alignment:
    """Pairing facts of one comparison (:func:`helpers.diagnosis.alignment.align_sample` fills it).

    Attributes:
        samples_paired: served samples compared on at least one row; training_samples_seen: training samples read.
        rows_compared / decode_rows_compared: aligned rows (of them after the prompt).
        paired_by: how samples were paired (``sample_id`` / ``input_ids`` / ``order``) -> count.
        token_mismatches: samples whose prompt ids differ; unpaired_served: served samples never paired.
        rows_beyond_training: served rows past the end of their training sample.
        rows_in_mismatched_samples: rows of samples in ``token_mismatches`` (compared apart: ``suspect``).
        training_truncated: the training data were read only up to ``max_samples``.
    """

    samples_paired: int = 0
    training_samples_seen: int = 0
    rows_compared: int = 0
    decode_rows_compared: int = 0
    paired_by: dict[str, int] = field(default_factory=dict)
    token_mismatches: list[TokenMismatch] = field(default_factory=list)
    unpaired_served: list[UnpairedSample] = field(default_factory=list)
    rows_beyond_training: int = 0
    rows_in_mismatched_samples: int = 0
    training_truncated: bool = False

    def to_json(self) -> dict:
        """Every field, in declaration order (JSON-safe)."""
        return asdict(self)


@dataclass(frozen=True)
class Candidate:
    """A reference layer near a chunk: share of rows within tolerance, median per-row rel_diff and cosine."""

    tensor: str
    share_within: float
    row_rel_diff_p50: Optional[float]
    row_cosine_p50: Optional[float]

    def to_json(self) -> dict:
        return {"tensor": self.tensor, "share_within": self.share_within, "row_rel_diff_p50": self.row_rel_diff_p50,
                "row_cosine_p50": self.row_cosine_p50}


@dataclass(frozen=True)
class Identification:
    """A chunk identified against the every-layer reference: the closest layer ``best`` and whether it is equal
    (``passed``: per-row decision), its global ``rel_diff``, ``share_within`` and median per-row rel_diff, the
    ``candidates`` closest first, and the runner-up (when the reference has more than one layer)."""

    best: str
    rel_diff: float
    passed: bool
    share_within: float
    row_rel_diff_p50: Optional[float]
    candidates: list[Candidate]
    runner_up: Optional[str] = None
    runner_up_rel_diff: Optional[float] = None

    def to_json(self) -> dict:
        """The evidence form (``runner_up`` keys only when there is one)."""
        out = {"best": self.best, "rel_diff": self.rel_diff, "passed": self.passed, "share_within": self.share_within,
               "row_rel_diff_p50": self.row_rel_diff_p50, "candidates": [c.to_json() for c in self.candidates]}
        if self.runner_up is not None:
            out["runner_up"] = self.runner_up
            out["runner_up_rel_diff"] = self.runner_up_rel_diff
        return out


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
    alignment: Alignment
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

    def identify(self, acc: Optional[PairAccumulator], i: int, top: int = 3) -> Optional[Identification]:
        """Reference identification of row ``i`` of ``acc`` (served or training chunk x reference layers):
        the closest layer, whether it is equal (per-row decision), and the next candidates with their
        share of rows within tolerance and median per-row rel_diff / cosine. None without a reference."""
        if acc is None or not self.reference_tensors or acc.rows == 0:
            return None
        ms = sorted(((k, acc.metrics(i, k)) for k in range(acc.nu)), key=lambda km: closeness(km[1]))
        k0, m0 = ms[0]
        return Identification(
            best=self.reference_tensors[k0], rel_diff=m0.rel_diff, passed=m0.passed, share_within=m0.share_within,
            row_rel_diff_p50=m0.row_rel_diff.get("p50"),
            candidates=[Candidate(tensor=self.reference_tensors[k], share_within=float(f"{m.share_within:.4g}"),
                                  row_rel_diff_p50=m.row_rel_diff.get("p50"),
                                  row_cosine_p50=None if m.median_cosine is None else float(f"{m.median_cosine:.6g}"))
                        for k, m in ms[:top]],
            runner_up=self.reference_tensors[ms[1][0]] if len(ms) > 1 else None,
            runner_up_rel_diff=ms[1][1].rel_diff if len(ms) > 1 else None)


def closeness(m: PairMetrics) -> tuple:
    """Sort key, closest first: more rows within tolerance, then lower median per-row rel_diff, then lower
    global rel_diff."""
    return (-round(m.share_within, 6), m.median_rel_diff, m.rel_diff)
