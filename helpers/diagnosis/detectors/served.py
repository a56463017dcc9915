"""Served-side detectors: what the server delivers, whatever tensor it is (non-finite rows, the tokens, TP
sharding, partial sums and un-reduced embeddings, the width, chunks with no comparable row, zero chunks). They run
before the chunk correspondence is settled (:func:`helpers.diagnosis.detectors.run_numeric`) and claim the chunks
they explain."""
from __future__ import annotations

from ..compare import MATCH_SHARE
from .base import finding
from .context import Context


def detect_nan_or_inf(ctx: Context) -> list[dict]:
    """``nan_or_inf``: served (per rank) or training rows holding NaN/Inf. A non-finite chunk row is left out of
    that chunk's pairs only (the other chunks of the row are compared); a chunk left with no comparable row is
    said to be unsettled, never named a layer (:func:`detect_not_comparable`)."""
    out = []
    for src in ctx.cmp.rank_sources:
        for i in range(src.num_chunks):
            n = src.stats.nonfinite[i]
            if n:
                left = src.stats.rows - n
                what = (f"{n} of {src.stats.rows} served rows of chunk {i} hold NaN/Inf"
                        + (f" on TP rank {src.tp_rank}" if src.tp_rank is not None else ""))
                if left == 0:
                    what += (": no row of this chunk can be compared, so which tensor it holds is not settled "
                             "(the other chunks are compared on their own rows)")
                else:
                    what += f" (left out of this chunk's comparison; {left} finite rows compared)"
                out.append(finding("nan_or_inf", i, what, side="served", source=src.name, tp_rank=src.tp_rank,
                                   rows=n, rows_total=src.stats.rows, finite_rows=left,
                                   first=src.stats.nonfinite_at[i]))
    ts = ctx.cmp.training_stats
    for j in range(ts.n):
        if ts.nonfinite[j]:
            left = ts.rows - ts.nonfinite[j]
            out.append(finding("nan_or_inf", None,
                               f"{ts.nonfinite[j]} of {ts.rows} training rows of chunk {j} hold NaN/Inf"
                               + (f": no row of training chunk {j} can be compared" if left == 0 else
                                  f" (left out of comparisons with training chunk {j}; {left} finite rows)"),
                               side="training", training_chunk=j, rows=ts.nonfinite[j], rows_total=ts.rows,
                               finite_rows=left, first=ts.nonfinite_at[j]))
    return out


def detect_token_mismatch(ctx: Context) -> list[dict]:
    """``token_mismatch``: a served sample's prompt ids differ from its training sample's, or served samples match
    no training sample (unless the training data were read only up to ``max_samples``: then the served samples
    beyond are not compared and a note says so). The rows of such a sample (before the first difference) may not be aligned with the
    training rows (the file may hold another sample's rows): they are compared apart (the sources' ``suspect``
    accumulators, reported here) and never used to name a layer; when no other row was compared, the finding
    says that which tensor each chunk holds is not settled."""
    a = ctx.cmp.alignment
    out = []
    if a.token_mismatches:
        tm = a.token_mismatches
        f0 = tm[0]
        n_sus = a.rows_in_mismatched_samples
        clean = a.rows_compared - n_sus
        sus = ctx.source.suspect
        on_sus = {}
        if sus is not None and sus.rows and ctx.full_width:
            for i in range(min(ctx.ns, ctx.nt)):
                m = sus.metrics(i, i, ctx.tol)
                on_sus[str(i)] = {"rows": m.rows, "share_within_tolerance": float(f"{m.share_within:.4g}"),
                                  "row_cosine_p50": None if m.median_cosine is None else float(f"{m.median_cosine:.6g}")}
        detail = (f"{len(tm)} served sample(s) differ from their training sample inside the prompt; first: "
                  f"{f0['served_sample']} position {f0['position']} id {f0['served_token_id']} vs training "
                  f"{f0['training_sample']} id {f0['training_token_id']}")
        if n_sus:
            agree = ", ".join(f"chunk {i} {v['share_within_tolerance']:.0%}" for i, v in on_sus.items())
            detail += (f". Their {n_sus} rows before the difference are kept out of the layer comparison (a sample "
                       "whose prompt differs may hold rows that are not aligned with the training rows)"
                       + (f"; on them, rows within tolerance of the same training chunk: {agree}" if agree else ""))
        if clean == 0:
            detail += (". No row of a sample whose tokens agree was compared, so which tensor each chunk holds is "
                       "not settled: layer findings are withheld. Capture the served states for the training "
                       "prompts (the same token ids, in the same samples) to settle it")
        elif ctx.full_width and all(ctx.match.get(i) == i for i in range(ctx.ns)) and ctx.ns == ctx.nt:
            detail += f". The {clean} rows of the samples whose tokens agree match training chunk for chunk"
        out.append(finding("token_mismatch", None, detail, mismatches=tm[:10], count=len(tm),
                           rows_in_mismatched_samples=n_sus, rows_compared_for_layers=clean,
                           mismatched_rows_vs_same_training_chunk=on_sus))
    if a.unpaired_served and a.training_truncated:
        # the training data were read only up to max_samples: the served samples beyond are not compared, which says
        # nothing about their tokens
        ctx.notes.append(f"{len(a.unpaired_served)} served sample(s) were not compared: max_samples stopped "
                         f"reading the training data after {a.training_samples_seen} sample(s)")
    elif a.unpaired_served:
        out.append(finding("token_mismatch", None,
                           f"{len(a.unpaired_served)} served sample(s) match no training sample by input_ids",
                           unpaired=a.unpaired_served[:10], count=len(a.unpaired_served)))
    return out


def detect_tp_sharded_width(ctx: Context) -> list[dict]:
    """``tp_sharded_width``: each rank holds ``H/k`` columns per chunk (a capture taken on a TP-sharded
    tensor): the served width is the training width / k, and rank r's chunk i equals columns
    ``[r*H/k, (r+1)*H/k)`` of a training chunk."""
    c = ctx.cmp
    if c.shard_factor == 1:
        return []
    k = c.shard_factor
    slices = {}
    for src in c.rank_sources:
        for i in range(src.num_chunks):
            u, mt = c.best_match(src, i)
            slices[f"{src.name}/chunk{i}"] = {"training_unit": c.training_units[u], "rel_diff": mt.rel_diff,
                                             "passed": mt.passed}
    ev = {"served_width": c.served_width, "training_width": c.training_width, "chunk_width": c.chunk_width,
          "hidden_size": c.hidden_size, "shard_factor": k, "ranks": [s.tp_rank for s in c.rank_sources],
          "slices": slices}
    g = c.source("gathered")
    if g is not None:
        ev["gathered"] = {f"chunk{i}": c.metrics(g, i, i).to_json() for i in range(g.num_chunks)}
    return [finding("tp_sharded_width", None,
                    f"served width {c.served_width} = training width {c.training_width} / {k}: each TP rank holds "
                    f"{c.chunk_width} of {c.hidden_size} columns per chunk (captured before the gather)", **ev)]


def detect_tp_partial_sum(ctx: Context) -> list[dict]:
    """``tp_partial_sum``: ranks disagree on a chunk, no rank matches training, but the sum over ranks does
    (each rank captured its un-reduced share, SGLang comparator dims ``h[tp:partial]``)."""
    c = ctx.cmp
    ssum = c.source("sum")
    ranks = c.rank_sources
    if ssum is None or len(ranks) < 2 or ctx.ranks_agree:
        return []
    out = []
    for i in range(ssum.num_chunks):
        if ctx.claims.claimed(i):
            continue
        disagree = {s.name: s.agree.metrics(i, i, c.tolerance).rel_diff for s in ranks[1:] if s.agree is not None}
        if all(v <= c.tolerance for v in disagree.values()):
            continue
        j, mt = c.best_match(ssum, i)
        if not mt.passed:
            continue
        per_rank = {s.name: c.metrics(s, i, j).rel_diff for s in ranks}
        per_rank_share = {s.name: c.metrics(s, i, j).share_within for s in ranks}
        # one rank may come close when the layer's update is small next to the residual it adds to (a deep
        # target's middle layers); the ranks still feed their drafts different tensors, and only the sum is right
        if all(v >= MATCH_SHARE for v in per_rank_share.values()):
            continue
        ctx.claims.claim(i, "tp_partial_sum", j)
        out.append(finding("tp_partial_sum", i,
                           f"chunk {i} differs across the {len(ranks)} TP ranks and matches no training chunk on any "
                           f"rank, but the sum over ranks equals training chunk {j} (rel_diff {mt.rel_diff:.2e}): "
                           "the capture took un-reduced partial sums",
                           training_chunk=j, sum_metrics=mt, per_rank_rel_diff=per_rank,
                           per_rank_share_within=per_rank_share, rank_vs_rank0_rel_diff=disagree,
                           tp_size=len(ranks)))
    return out


def _vocab_shard(vocab: int, rank: int, tp: int) -> tuple[int, int]:
    """Vocab ids held by ``rank``: padded to 64 (x tp when needed), split evenly
    (``sglang/srt/layers/vocab_parallel_embedding.py``, ``pad_vocab_size``)."""
    pad = 64
    if ((vocab + pad - 1) // pad * pad) % tp:
        pad *= tp
    padded = (vocab + pad - 1) // pad * pad
    per = padded // tp
    return rank * per, min(vocab, (rank + 1) * per)


def detect_embedding_not_all_reduced(ctx: Context) -> list[dict]:
    """``embedding_not_all_reduced``: a chunk's rows are exactly zero for the token ids outside one contiguous
    id range and equal for equal ids inside it: a vocab-parallel embedding captured on one rank before its
    all-reduce (``VocabParallelEmbedding._embed_local_shard`` zeroes out-of-shard rows,
    ``sglang/srt/layers/vocab_parallel_embedding.py``)."""
    c = ctx.cmp
    vocab = ctx.target.vocab_size if ctx.target is not None else None
    out = []
    by_chunk: dict[int, list] = {}
    for src in c.rank_sources:
        st = src.stats
        for i in range(src.num_chunks):
            if st.zero[i] == 0 or st.nonzero_min[i] is None:
                continue
            lo, hi = st.nonzero_min[i], st.nonzero_max[i]
            if any(lo <= z <= hi for z in st.zero_ids[i]):
                continue
            if st.context_free(i, c.tolerance) is False:
                continue
            ev = {"tp_rank": src.tp_rank, "zero_rows": st.zero[i], "rows": st.rows, "nonzero_id_range": [lo, hi],
                  "zero_row_ids_sample": sorted(st.zero_ids[i])[:10],
                  "repeated_token_max_rel_diff": st.ctx_max[i]}
            tp = src.tp_size or (len(c.rank_sources) if len(c.rank_sources) > 1 else None)
            if vocab and tp and src.tp_rank is not None:
                a, b = _vocab_shard(vocab, src.tp_rank, tp)
                ev["expected_shard"] = [a, b - 1]
                ev["consistent_with_shard"] = a <= lo and hi <= b - 1
            by_chunk.setdefault(i, []).append(ev)
    ssum = c.source("sum")
    for i, evs in by_chunk.items():
        extra = {}
        if ssum is not None and i < ssum.num_chunks:
            extra["sum_over_ranks_context_free"] = ssum.stats.context_free(i, c.tolerance)
            ident = c.identify(ssum.ref, i)
            if ident:
                extra["sum_over_ranks_reference_match"] = ident
            if ssum.chunk_width == c.hidden_size:
                j, mt = c.best_match(ssum, i)
                extra["sum_over_ranks_best_training_chunk"] = {"chunk": j, "rel_diff": mt.rel_diff,
                                                               "passed": mt.passed}
                if mt.passed:
                    ctx.claims.claim(i, "embedding_not_all_reduced", j)
        else:
            ctx.claims.claim(i, "embedding_not_all_reduced")
        out.append(finding("embedding_not_all_reduced", i,
                           f"chunk {i} is an embedding captured before its TP all-reduce: rows are zero exactly for "
                           f"token ids outside one vocab shard ({len(evs)} rank(s) seen)",
                           ranks=evs, **extra))
        ctx.claims.claim(i, "embedding_not_all_reduced", replace=False)
    return out


def detect_width_mismatch(ctx: Context) -> list[dict]:
    """``width_mismatch``: served width != training width (not explained by TP sharding or a bypassed fc)."""
    c = ctx.cmp
    if c.shard_factor > 1 or "fc_bypassed" in ctx.claims.kinds():
        return []
    if c.served_width == c.training_width:
        return []
    return [finding("width_mismatch", None,
                    f"served rows are {c.served_width} wide ({c.served_width // c.hidden_size} chunks of {c.hidden_size}) "
                    f"but training rows are {c.training_width} wide ({c.num_training_chunks} chunks)",
                    served_width=c.served_width, training_width=c.training_width, hidden_size=c.hidden_size,
                    served_plan=None if ctx.served_plan is None else ctx.served_plan.tensors,
                    training_plan=None if ctx.training_plan is None else ctx.training_plan.tensors)]


def detect_not_comparable(ctx: Context) -> list[dict]:
    """No finding, a note: a served chunk with no comparable row against its training chunk (every row of one
    side non-finite, or only rows of samples whose tokens differ) is not settled, and no layer finding may be
    built on it. The ``nan_or_inf`` / ``token_mismatch`` finding says why."""
    a = ctx.cmp.alignment
    clean = a.rows_compared - a.rows_in_mismatched_samples
    for i in range(ctx.ns):
        if ctx.claims.claimed(i) or i in ctx.match:
            continue
        if ctx.compared_rows(i, i if i < ctx.nt and ctx.full_width else None) > 0:
            continue
        st = ctx.source.stats
        why = []
        if clean == 0:
            why.append("every aligned row comes from a sample whose prompt ids differ from training")
        if st.nonfinite[i] and st.nonfinite[i] == st.rows:
            why.append(f"all {st.rows} served rows of this chunk hold NaN/Inf")
        ts = ctx.cmp.training_stats
        if i < ts.n and ts.nonfinite[i] and ts.nonfinite[i] == ts.rows:
            why.append(f"all {ts.rows} rows of training chunk {i} hold NaN/Inf")
        ctx.claims.claim(i, "not_comparable")
        reason = "; ".join(why) or "no row finite on both sides"
        ctx.notes.append(f"chunk {i}: inconclusive, no comparable rows ({reason}): which tensor it holds is not "
                         "settled; a capture with finite rows for the training prompts would settle it")
    return []


def detect_zero_chunk(ctx: Context) -> list[dict]:
    """``zero_chunk``: a served chunk is exactly zero on (nearly) every finite row while the training chunk is not:
    the capture delivers zeros there (a hook that never fired, a buffer never written or cleared), not a layer
    output. A rank-local embedding (zero rows outside one vocab shard) is ``embedding_not_all_reduced``."""
    out = []
    st = ctx.source.stats
    ts = ctx.cmp.training_stats
    for i in range(ctx.ns):
        if ctx.claims.claimed(i) or i in ctx.match:
            continue
        finite = st.rows - st.nonfinite[i]
        if finite <= 0 or st.zero[i] < MATCH_SHARE * finite:
            continue
        j = i if i < ctx.nt else None
        tz = None if j is None else ts.zero[j]
        if j is not None and tz >= MATCH_SHARE * max(1, ts.rows - ts.nonfinite[j]):
            continue                    # training is zero too: not this fault
        ctx.claims.claim(i, "zero_chunk")
        ev = ctx.ev(i, j)
        ev.update(zero_rows=st.zero[i], finite_rows=finite, rows=st.rows, training_zero_rows=tz,
                  training_rows=ts.rows)
        out.append(finding("zero_chunk", i,
                           f"served chunk {i} is exactly zero on {st.zero[i]} of its {finite} finite rows"
                           + (f" while training chunk {j} is zero on {tz} of {ts.rows}" if j is not None else "")
                           + ": the capture delivers zeros here (a hook that never fired, a buffer never written or "
                           "cleared), not a layer output", **ev))
    return out
