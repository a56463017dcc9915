"""Which served sample belongs to which training sample, and on how many rows their tokens agree: the alignment
stage of :func:`helpers.diagnosis.compare.compare` (:class:`Pairer`, :func:`align_sample`,
:func:`finish_alignment`), plus the served sources' chunking (:func:`chunking`, :func:`group_ranks`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..errors import BadInput
from ..formats.dumps import Sample, SampleSource
from .comparison import Alignment


class Pairer:
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


def group_ranks(served: Sequence[SampleSource]) -> list[list[Sample]]:
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


def chunking(served_width: int, H: int, Wt: int, tp_sizes: set, n_ranks: int, path) -> tuple[int, int]:
    """(chunk width, shard factor k) for a served width."""
    if served_width % H == 0:
        return H, 1
    cands = sorted({k for k in tp_sizes if k} | ({n_ranks} if n_ranks > 1 else set()) | {2, 4, 8, 16})
    for k in cands:
        if H % k == 0 and served_width % (H // k) == 0 and (k in tp_sizes or k == n_ranks or served_width * k == Wt):
            return H // k, k
    raise BadInput(f"served width {served_width} is not a multiple of the target hidden size {H} "
                   "(nor a TP-sharded fraction of it)", path=path, field="width")


@dataclass(frozen=True)
class SampleAlignment:
    """How one served sample lines up with its training sample: it starts at ``first_position`` of the training
    sample, its tokens agree on the first ``rows`` rows (0: nothing to compare), ``prompt_rows`` of its rows are
    prompt, and ``suspect`` says its prompt ids differ (its rows may belong to another sample)."""

    first_position: int
    rows: int
    prompt_rows: int
    suspect: bool


def align_sample(s0: Sample, tr: Sample, how: str, alignment: Alignment) -> SampleAlignment:
    """Line up served sample ``s0`` (paired ``how``) with training sample ``tr`` and count it in ``alignment``.

    Rows are compared while tokens agree; a disagreement inside the prompt is a token mismatch (rows after it
    have another context); after the prompt it only ends the comparable decode rows. A served sample without
    ids (``/generate`` without ``return_prompt_token_ids``) takes the training prompt's ids and its own
    ``output_ids[:-1]``."""
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
    alignment.rows_beyond_training += max(0, s0.rows - n)
    eq = sids[:n] == tids[p0:p0 + n]
    bad = np.nonzero(~eq)[0]
    m = int(bad[0]) if bad.size else n
    prompt_rows = (s0.num_prompt_tokens - p0) if s0.num_prompt_tokens is not None else s0.rows
    suspect = m < min(n, prompt_rows) or (m == 0 and n > 0)
    if suspect:
        alignment.token_mismatches.append({
            "served_sample": s0.key, "training_sample": tr.sample_id, "position": int(p0 + m),
            "served_token_id": int(sids[m]) if m < len(sids) else None,
            "training_token_id": int(tids[p0 + m]) if p0 + m < L else None, "rows_compared": m,
            "paired_by": how})
    if m == 0:
        return SampleAlignment(p0, 0, prompt_rows, suspect)
    alignment.samples_paired += 1
    alignment.paired_by[how] = alignment.paired_by.get(how, 0) + 1
    alignment.rows_compared += m
    alignment.decode_rows_compared += max(0, m - prompt_rows)
    if suspect:
        alignment.rows_in_mismatched_samples += m
    return SampleAlignment(p0, m, prompt_rows, suspect)


def finish_alignment(alignment: Alignment, training: Any, groups: list[list[Sample]], pairer: Pairer,
                     served: Sequence[SampleSource]) -> Alignment:
    """Record the served samples never paired and whether the training data were truncated.

    Raises:
        BadInput: no served sample was paired with any training sample ("mismatched token ids"), naming the
            first mismatch or the first served sample's ids.
    """
    alignment.training_truncated = bool(getattr(training, "truncated", False))
    for g, ranks in enumerate(groups):
        if g not in pairer.used:
            s0 = ranks[0]
            alignment.unpaired_served.append({"served_sample": s0.key, "first_position": s0.first_position,
                                              "first_ids": None if s0.input_ids is None else
                                              [int(x) for x in s0.input_ids[:8]]})
    if alignment.samples_paired == 0:
        tm = alignment.token_mismatches[:1]
        first = next(iter([groups[0][0]]), None)
        detail = (f"first mismatch: served {tm[0]['served_sample']} position {tm[0]['position']} "
                  f"id {tm[0]['served_token_id']} vs training {tm[0]['training_sample']} id "
                  f"{tm[0]['training_token_id']}" if tm else
                  f"served sample {first.key!r} starts with ids "
                  f"{None if first.input_ids is None else [int(x) for x in first.input_ids[:8]]} at position "
                  f"{first.first_position}; {alignment.training_samples_seen} training samples searched")
        raise BadInput(f"mismatched token ids: no served sample matches any training sample ({detail})",
                       path=served[0].path, field="input_ids")
    return alignment
