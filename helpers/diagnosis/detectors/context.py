"""The detectors' shared state: a :class:`Context` (a comparison plus plans and configs, identities computed once),
its :class:`Claims` (which served chunk a detector has explained, and as what) and the :class:`Correspondence`
(which served chunk stands for which training chunk), settled from the claims once the served-side detectors ran
(:func:`helpers.diagnosis.detectors.run_numeric`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional

import torch

from ...kinds import FINDING_KINDS
from ..compare import Comparison, PairMetrics, SourceResult
from ...layers.ids import EMBEDDING, FINAL_NORM, layer_of
from ..conventions import CapturePlan
from ..fit import isometry_fit, noise_floor, rms_norm_fit, scale_fit

#: what a claim may say: a finding kind, or ``not_comparable`` (no comparable row: a note, no finding)
CLAIM_KINDS = frozenset(FINDING_KINDS) | {"not_comparable"}


@dataclass(frozen=True)
class Claim:
    """Why a served chunk is explained: ``kind`` (see :data:`CLAIM_KINDS`) and, when the detector found it, the
    ``training_chunk`` the served chunk stands for (a moved chunk, a fitted transform, a TP partial sum)."""

    kind: str
    training_chunk: Optional[int] = None


class Claims:
    """Served chunk -> the :class:`Claim` that explains it. A detector skips a claimed chunk (:meth:`claimed`), so
    the first detector in :data:`helpers.diagnosis.detectors.NUMERIC_DETECTORS` order that explains a chunk owns it.

    Raises:
        ValueError: a claim with a kind outside :data:`CLAIM_KINDS`.
    """

    def __init__(self) -> None:
        self._by: dict[int, Claim] = {}

    def claim(self, chunk: int, kind: str, training_chunk: Optional[int] = None, *, replace: bool = True) -> None:
        """Mark served ``chunk`` explained by ``kind`` (standing for ``training_chunk`` when known); with
        ``replace=False`` an existing claim is kept."""
        if kind not in CLAIM_KINDS:
            raise ValueError(f"unknown claim kind {kind!r}")
        if replace or chunk not in self._by:
            self._by[chunk] = Claim(kind, training_chunk)

    def claimed(self, chunk: int) -> bool:
        """Whether a detector explained served ``chunk``."""
        return chunk in self._by

    def get(self, chunk: int) -> Optional[Claim]:
        """The claim on served ``chunk``, or None."""
        return self._by.get(chunk)

    def training_chunks(self) -> set[int]:
        """The training chunks some claimed served chunk stands for."""
        return {c.training_chunk for c in self._by.values() if c.training_chunk is not None}

    def kinds(self) -> set[str]:
        """The kinds claimed so far."""
        return {c.kind for c in self._by.values()}


#: (tensor name, how it was identified) of one chunk; (None, None) when unknown
Identity = tuple[Optional[str], Optional[str]]


@dataclass(frozen=True)
class Correspondence:
    """Which served chunk stands for which training chunk, from the chunks no served-side detector claimed.

    Attributes:
        s_id / t_id: identity per served / training chunk (:meth:`Context.served_identity`,
            :attr:`Context.training_identity`).
        match: served chunk -> the training chunk it equals (unclaimed chunks only).
        unmatched_s: served chunks neither matched nor claimed, ascending.
        matched_t: training chunks matched or stood for by a claim.
        offsets: per position < min(ns, nt), served layer - training layer (None when either is unknown).
        positional: positions < min(ns, nt) not claimed.
        shift: the one layer offset of every positional chunk when none equals its training chunk, else None.
    """

    s_id: list[Identity]
    t_id: list[Identity]
    match: dict[int, int]
    unmatched_s: list[int]
    matched_t: set[int]
    offsets: list[Optional[int]]
    positional: list[int]
    shift: Optional[int]


#: how an identity or plan was established, most trusted first (shown in every finding's evidence).
IDENTITY_SOURCES = ("reference", "context-free", "equal chunk", "served plan", "training plan")


@dataclass
class Context:
    """A comparison plus what the detectors need (plans, configs): identities computed once, the detectors'
    :attr:`claims`, and the chunk correspondence (:attr:`corr`) settled from the claims by :meth:`settle`.

    Attributes:
        cmp: the comparison. served_plan / training_plan: capture plans (None if unknown); the training plan
            carries its provenance (``manifest`` / ``inferred`` / ``claimed`` / ``default``).
        draft / weights / target / server: configs when given.
        source: the served source the correspondence is computed on: TP rank 0 (the single source), or the
            ranks' ``gathered`` columns when they hold sharded widths. Chunks on which the ranks disagree are
            explained (or not) by the TP detectors, which look at the ranks' ``sum`` themselves.
    """

    cmp: Comparison
    served_plan: Optional[CapturePlan] = None
    training_plan: Optional[CapturePlan] = None
    draft: Any = None
    weights: Any = None
    target: Any = None
    server: Any = None
    claims: Claims = field(default_factory=Claims)   # served chunk -> the claim that explains it
    notes: list = field(default_factory=list)       # what the data could not settle (one line each)
    _corr: Optional[Correspondence] = field(default=None, init=False, repr=False)

    @property
    def tol(self) -> float:
        return self.cmp.tolerance

    @cached_property
    def ranks_agree(self) -> bool:
        """All TP ranks fed equal rows (within tolerance) on every chunk."""
        for s in self.cmp.rank_sources[1:]:
            if s.agree is None or s.agree.rows == 0:
                continue
            for i in range(s.num_chunks):
                if not s.agree.metrics(i, i).passed:
                    return False
        return True

    @cached_property
    def source(self) -> SourceResult:
        c = self.cmp
        if c.shard_factor > 1:
            return c.source("gathered") or c.primary
        return c.primary

    def m(self, i: int, j: int, source: Optional[SourceResult] = None) -> PairMetrics:
        return self.cmp.metrics(source or self.source, i, j)

    @cached_property
    def nt(self) -> int:
        return self.cmp.num_training_chunks

    @cached_property
    def ns(self) -> int:
        return self.source.num_chunks

    @property
    def full_width(self) -> bool:
        return self.source.chunk_width == self.cmp.hidden_size

    @cached_property
    def match(self) -> dict[int, int]:
        """served chunk -> the closest training chunk, when they are equal (per-row decision)."""
        if not self.full_width:
            return {}
        out = {}
        for i in range(self.ns):
            j, mt = self.cmp.best_match(self.source, i)
            if mt.passed:
                out[i] = j
        return out

    # -- reservoir rows and fits ------------------------------------------------------------------
    def rows(self, i: int, j: int) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """Reservoir rows (served chunk i, training chunk j), float32 ``[R, H]``; None when unavailable."""
        rv = self.cmp.reservoir
        H = self.cmp.hidden_size
        if rv is None or rv.count < 8 or not self.full_width:
            return None
        return rv.served[:rv.count, i * H:(i + 1) * H], rv.train[:rv.count, j * H:(j + 1) * H]

    @cached_property
    def floor(self) -> dict:
        """The isometry noise floor (:func:`helpers.diagnosis.fit.noise_floor`)."""

        pairs = [r for r in (self.rows(i, j) for i, j in self.match.items()) if r is not None]
        rv = self.cmp.reservoir
        H = self.cmp.hidden_size
        tref = rv.train[:rv.count, :H] if rv is not None and rv.count else torch.zeros(1, H)
        return noise_floor(self.tol, pairs, tref)

    def fit(self, kind: str, i: int, j: int):
        """Cached :class:`helpers.diagnosis.fit.FitResult` of ``kind`` (``isometry`` | ``norm`` | ``scale``) for
        (i, j)."""

        cache = self.__dict__.setdefault("_fits", {})
        key = (kind, i, j)
        if key not in cache:
            r = self.rows(i, j)
            if r is None:
                cache[key] = None
            else:
                cache[key] = (isometry_fit(r[0], r[1], self.floor) if kind == "isometry" else
                              scale_fit(r[0], r[1], self.tol) if kind == "scale" else
                              rms_norm_fit(r[0], r[1], self.tol))
        return cache[key]

    def compared_rows(self, i: int, j: Optional[int] = None) -> int:
        """Rows compared for served chunk ``i`` against training unit ``j`` (default: the most over all units):
        rows finite on both sides, from samples whose tokens agree with training."""
        pairs = self.source.pairs
        if j is not None:
            return int(pairs.n[i, j]) if j < pairs.nu else 0
        return int(pairs.n[i].max()) if pairs.nu else 0

    @cached_property
    def noise(self) -> Optional[dict]:
        """This deployment's measured engine noise: per-row rel_diff quantiles of the chunk pairs found equal."""
        if not self.match:
            return None
        ms = [self.m(i, j) for i, j in self.match.items()]
        p50 = max(m.row_rel_diff.get("p50") or 0 for m in ms)
        p90 = max(m.row_rel_diff.get("p90") or 0 for m in ms)
        return {"row_rel_diff_p50": p50, "row_rel_diff_p90": p90, "pairs": len(ms),
                "margin_to_tolerance": None if not p90 else float(f"{self.tol / p90:.3g}")}

    # -- identities ----------------------------------------------------------------------------------
    def served_identity(self, i: int) -> tuple[Optional[str], Optional[str]]:
        """(tensor name, how it was identified) for served chunk ``i`` of :attr:`source`."""
        ident = self.cmp.identify(self.source.ref, i)
        if ident and ident.passed:
            return ident.best, "reference"
        cf = self.source.stats.context_free(i, self.tol)
        if cf and self.source.stats.zero[i] == 0:
            return EMBEDDING, "context-free rows (equal rows for equal token ids at different positions)"
        plan = self.served_plan
        if plan is not None and plan.num_chunks == self.ns and not self._plan_contradicted_served:
            return plan.tensors[i], f"served plan ({plan.source or plan.who})"
        return None, None

    @cached_property
    def _plan_contradicted_served(self) -> bool:
        # the served plan is wrong if a chunk it calls "embedding" is not context-free, or vice versa, or if
        # the reference identifies a chunk as another tensor
        plan = self.served_plan
        if plan is None or plan.num_chunks != self.ns:
            return True
        for i, t in enumerate(plan.tensors):
            cf = self.source.stats.context_free(i, self.tol)
            if cf is not None and cf != (t == EMBEDDING):
                return True
            ident = self.cmp.identify(self.source.ref, i)
            if ident and ident.passed and ident.best != t:
                return True
        return False

    @cached_property
    def training_identity(self) -> list[tuple[Optional[str], Optional[str]]]:
        """(tensor name, how) per training chunk: reference > a served chunk it equals > training plan
        (shifted by the offset the equalities imply when they contradict the plan)."""
        res: list[tuple[Optional[str], Optional[str]]] = [(None, None)] * self.nt
        for j in range(self.nt):
            ident = self.cmp.identify(self.cmp.training_ref, j)
            if ident and ident.passed:
                res[j] = (ident.best, "reference")
        derived = {}
        for i, j in self.match.items():
            if res[j][0] is None:
                name, how = self.served_identity(i)
                if name is not None:
                    derived[j] = (name, f"equal chunk: equals served chunk {i} ({how})")
        plan = self.training_plan
        shift = None
        if plan is not None and plan.num_chunks == self.nt and derived:
            offs = {layer_of(derived[j][0]) - layer_of(plan.tensors[j]) for j in derived
                    if derived[j][0] not in (None, FINAL_NORM) and plan.tensors[j] != FINAL_NORM}
            if len(offs) == 1:
                shift = offs.pop()
        for j in range(self.nt):
            if res[j][0] is not None:
                continue
            if j in derived:
                res[j] = derived[j]
            elif plan is not None and plan.num_chunks == self.nt:
                t = plan.tensors[j]
                if shift and t != FINAL_NORM and layer_of(t) is not None:
                    L = layer_of(t) + shift
                    res[j] = (EMBEDDING if L == -1 else f"out({L})",
                              f"training plan ({plan.provenance}: {plan.source or plan.who}) {plan.tensors[j]} shifted "
                              f"by {shift:+d} (implied by equal chunks)")
                else:
                    res[j] = (t, f"training plan ({plan.provenance}: {plan.source or plan.who})")
        return res

    @cached_property
    def served_ids(self) -> list[Identity]:
        """:meth:`served_identity` of every served chunk (independent of the claims)."""
        return [self.served_identity(i) for i in range(self.ns)]

    @property
    def corr(self) -> Correspondence:
        """The chunk correspondence settled by :meth:`settle` (settled on first use when a detector runs alone)."""
        if self._corr is None:
            self.settle()
        return self._corr

    def settle(self) -> Correspondence:
        """Compute :attr:`corr` from the claims held now. :func:`helpers.diagnosis.detectors.run_numeric` calls it
        once the served-side detectors ran; the identity detectors then read it together with the claims they add
        (a chunk they claim is skipped by :meth:`Claims.claimed`, it does not leave the correspondence: a layer
        offset applies only when no positional chunk was claimed)."""
        ns, nt = self.ns, self.nt
        s_id = self.served_ids
        t_id = self.training_identity
        claimed = self.claims.claimed
        match = {i: j for i, j in self.match.items() if not claimed(i)}
        unmatched_s = [i for i in range(ns) if i not in match and not claimed(i)]
        matched_t = set(match.values()) | self.claims.training_chunks()
        # consistent layer shift: no chunk sits at its own index and every position has the same offset
        offsets = []
        for i in range(min(ns, nt)):
            a, b = s_id[i][0], t_id[i][0]
            la = layer_of(a) if a not in (None, FINAL_NORM) else None
            lb = layer_of(b) if b not in (None, FINAL_NORM) else None
            offsets.append(None if la is None or lb is None else la - lb)
        positional = [i for i in range(min(ns, nt)) if not claimed(i)]
        shift = None
        if positional and all(match.get(i) != i for i in positional):
            offs = {offsets[i] for i in positional}
            if len(offs) == 1 and None not in offs and 0 not in offs and \
                    all(s_id[i][0] != EMBEDDING for i in positional):
                shift = offs.pop()
        self._corr = Correspondence(s_id, t_id, match, unmatched_s, matched_t, offsets, positional, shift)
        return self._corr

    def candidates(self, i: int, top: int = 3) -> list[dict]:
        """The closest training chunks to served chunk ``i`` (and reference layers when given), ranked."""
        out = []
        if self.full_width:
            for j, mt in self.cmp.ranked(self.source, i)[:top]:
                out.append({"training_chunk": j, "training_identified_as": self.corr_t(j),
                            "share_within": float(f"{mt.share_within:.4g}"),
                            "row_rel_diff_p50": mt.row_rel_diff.get("p50"),
                            "row_cosine_p50": None if mt.median_cosine is None else float(f"{mt.median_cosine:.6g}")})
        return out

    def corr_t(self, j: int) -> Optional[str]:
        return self.training_identity[j][0] if j < self.nt else None

    def ev(self, i: Optional[int] = None, j: Optional[int] = None) -> dict:
        """Common evidence for served chunk i / training chunk j, with the provenance of both identities."""
        e: dict = {"source": self.source.name, "tolerance": self.tol}
        prov: dict = {}
        if i is not None:
            sid = self.served_ids[i]
            e["served_identified_as"] = sid[0]
            e["served_identified_by"] = sid[1]
            prov["served"] = sid[1] or "not identified (no reference, not context-free, no served plan)"
            ident = self.cmp.identify(self.source.ref, i)
            if ident:
                e["served_reference_match"] = ident
            if self.full_width:
                e["closest_training_chunks"] = self.candidates(i)
                e["outlier_rows"] = self.source.stats.outliers(i)
        if j is not None and j < self.nt:
            tid = self.training_identity[j]
            e["training_chunk"] = j
            e["training_identified_as"] = tid[0]
            e["training_identified_by"] = tid[1]
            prov["training"] = tid[1] or "not identified (no reference, no training plan)"
            if i is not None and self.full_width:
                e["metrics"] = self.m(i, j)
        if prov:
            e["provenance"] = prov
        return e
