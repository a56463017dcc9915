"""Layout detectors: which tensor sits in which chunk (a layer offset, the embedding in place of a layer, a
permuted concatenation, extra / missing chunks, another layer, or no layer at all). They read the settled
:class:`~helpers.diagnosis.detectors.context.Correspondence` and claim what they explain."""
from __future__ import annotations

from typing import Optional

from ...layers.ids import EMBEDDING
from .base import finding
from .context import Context


def _shift_applies(ctx: Context) -> bool:
    cr = ctx.corr
    return cr.shift is not None and not any(ctx.claims.claimed(i) for i in cr.positional)


def detect_layer_offset(ctx: Context) -> list[dict]:
    """``layer_offset``: every served chunk is the training chunk's layer shifted by the same k (typically +1:
    SGLang's +1 applied to ids that already mean capture points). Identities come from ``--reference``, from
    chunks found equal, or from the capture plans (each finding says which)."""
    if not _shift_applies(ctx):
        return []
    cr = ctx.corr
    k = cr.shift
    out = []
    plan_only = all(not (cr.s_id[i][1] or "").startswith(("reference", "context-free")) and
                    not (cr.t_id[i][1] or "").startswith(("reference", "equal chunk")) for i in cr.positional)
    for i in cr.positional:
        ev = ctx.ev(i, i)
        if plan_only:
            ev["note"] = ("both identities come from the capture plans (configs + rules); the data only show that "
                          "no chunk equals its training chunk. An every-layer reference (capture --every-layer, or HF) "
                          "would identify the served layers directly")
        out.append(finding("layer_offset", i,
                           f"served chunk {i} is {cr.s_id[i][0]} where training has {cr.t_id[i][0]} "
                           f"(every chunk {abs(k)} layer{'s' if abs(k) > 1 else ''} {'late' if k > 0 else 'early'})",
                           offset=k, **ev))
        ctx.claims.claim(i, "layer_offset")
    return out


def _is_extra(ctx: Context, i: int) -> bool:
    cr = ctx.corr
    return ctx.ns > ctx.nt and (i >= ctx.nt or len(cr.matched_t) >= ctx.nt)


def detect_embedding_in_place_of_layer(ctx: Context) -> list[dict]:
    """``embedding_in_place_of_layer``: a served chunk is the embedding output (context-free: equal rows for
    equal token ids; or identified by ``--reference``) where training had a decoder layer's output."""
    out = []
    cr = ctx.corr
    for i in cr.unmatched_s:
        if ctx.claims.claimed(i) or cr.s_id[i][0] != EMBEDDING or _is_extra(ctx, i):
            continue
        j = i if i < ctx.nt else None
        ev = ctx.ev(i, j)
        ev["repeated_token_pairs"] = ctx.source.stats.ctx_pairs[i]
        ev["repeated_token_max_rel_diff"] = ctx.source.stats.ctx_max[i]
        tj = [ctx.cmp.training_stats.context_free(t, ctx.tol) for t in range(ctx.nt)]
        ev["training_chunks_context_free"] = tj
        ctx.claims.claim(i, "embedding_in_place_of_layer")
        out.append(finding("embedding_in_place_of_layer", i,
                           f"served chunk {i} is the embedding output (rows depend only on the token id) where training "
                           f"had {cr.t_id[i][0] if j is not None and cr.t_id[i][0] else 'a layer output'}",
                           **ev))
    return out


def detect_chunk_order(ctx: Context) -> list[dict]:
    """``chunk_order``: served chunks equal training chunks at other positions (permuted or shifted
    concatenation, e.g. unsorted ids: SGLang concatenates in ascending layer order)."""
    if _shift_applies(ctx):
        return []
    moved = {i: j for i, j in ctx.corr.match.items() if i != j and not ctx.claims.claimed(i)}
    if not moved:
        return []
    for i in moved:
        ctx.claims.claim(i, "chunk_order", moved[i])
    perm = sorted(moved) == sorted(moved.values())
    return [finding("chunk_order", None,
                    ("chunks are permuted: " if perm else "chunks are shifted: ")
                    + ", ".join(f"served chunk {i} = training chunk {j}" for i, j in sorted(moved.items())),
                    mapping={str(i): j for i, j in sorted(moved.items())}, permutation=perm,
                    metrics={str(i): ctx.m(i, j) for i, j in sorted(moved.items())}, source=ctx.source.name)]


def detect_extra_chunk(ctx: Context) -> list[dict]:
    """``extra_chunk``: more served chunks than training chunks, and this one matches no training chunk."""
    out = []
    for i in ctx.corr.unmatched_s:
        if ctx.claims.claimed(i) or not _is_extra(ctx, i):
            continue
        ctx.claims.claim(i, "extra_chunk")
        out.append(finding("extra_chunk", i, f"served chunk {i} ({ctx.corr.s_id[i][0] or 'unidentified'}) has no "
                           f"counterpart in training ({ctx.ns} served vs {ctx.nt} training chunks)", **ctx.ev(i)))
    return out


def detect_wrong_layer(ctx: Context) -> list[dict]:
    """``wrong_layer``: a served chunk matches no training chunk and no more specific fault fits (offset,
    embedding, rotation, norm, TP): the server feeds another tensor at that position. The finding ranks the
    closest candidates (training chunks, reference layers) and says where each identity comes from; when the
    plans call both sides the same tensor it says that the data contradict the plans instead of stating it."""
    out = []
    cr = ctx.corr
    for i in cr.unmatched_s:
        if ctx.claims.claimed(i) or i >= ctx.nt:
            continue
        off = cr.offsets[i] if i < len(cr.offsets) else None
        (sname, sby), (tname, tby) = cr.s_id[i], cr.t_id[i]
        ctx.claims.claim(i, "wrong_layer")
        ev = ctx.ev(i, i)
        mt = ctx.m(i, i) if ctx.full_width else None
        data = (f"{mt.share_within:.0%} of {mt.rows} rows within tolerance, median per-row rel_diff "
                f"{(mt.row_rel_diff.get('p50') or 0):.2g}, median row cosine "
                + ("n/a (a zero row)" if mt.median_cosine is None else f"{mt.median_cosine:.3f}")) \
            if mt else "different widths"
        cands = ev.get("closest_training_chunks", [])
        ref = ev.get("served_reference_match")
        if sname is not None and sname == tname:
            detail = (f"served chunk {i} is not training chunk {i} ({data}), although the {_short(sby)} and the "
                      f"{_short(tby)} both call it {sname}: one of them is wrong")
            if ctx.training_plan is not None and ctx.training_plan.provenance == "claimed":
                detail += ("; the training side is only what the draft config claims (no training manifest), and "
                           "a config edited after training gives exactly this")
        else:
            what = f" ({sname}, {_short(sby)})" if sname else ""
            twhat = f" ({tname}, {_short(tby)})" if tname else ""
            detail = f"served chunk {i}{what} is not training chunk {i}{twhat}: {data}"
            if off:
                detail += f"; by those identities: offset {off:+d} layer(s)"
        if ref and not ref.passed:
            # no layer of the target equals the chunk on >= MATCH_SHARE of the rows (as a layer would: the reference
            # comes from the same engine): not "another layer", something transforms the chunk
            near = ", ".join(f"{c.tensor} ({c.share_within:.0%} rows within tolerance)"
                             for c in ref.candidates[:3])
            ctx.claims.claim(i, "unidentified_chunk")
            out.append(finding(
                "unidentified_chunk", i,
                f"served chunk {i} is not training chunk {i} ({data}) and matches no layer of the target for the "
                f"same tokens (closest reference layers: {near}): it is not a layer output; something between the "
                "residual stream and the capture transforms it (a per-rank partial value, a mix of tensors, a "
                "quantization error beyond tolerance). Per-rank capture (TP ranks compared) or the capture code "
                "settles what", offset=off, **ev))
            continue
        elif not ref and cands:
            detail += ("; closest training chunks: " + ", ".join(
                f"{c['training_chunk']} (median row cosine "
                f"{'n/a' if c['row_cosine_p50'] is None else c['row_cosine_p50']})" for c in cands[:2])
                       + "; to name the layer, compare with an every-layer reference (capture --every-layer, or HF)")
        out.append(finding("wrong_layer", i, detail, offset=off, **ev))
    return out


def _short(how: Optional[str]) -> str:
    """'served plan (...)' -> 'served plan'; 'reference' -> 'reference'."""
    if not how:
        return "unknown source"
    return how.split(" (")[0]


def detect_missing_chunk(ctx: Context) -> list[dict]:
    """``missing_chunk``: a training chunk that no served chunk equals and no served chunk stands in for
    (position beyond the served width, or taken by a chunk that moved)."""
    out = []
    cr = ctx.corr
    matched_t = set(cr.match.values()) | ctx.claims.training_chunks()
    for j in range(ctx.nt):
        if j in matched_t:
            continue
        why = ctx.claims.get(j)             # the claim on the served chunk at position j
        if j < ctx.ns and ((j not in cr.match and (why is None or why.training_chunk is None))
                           or (why is not None and why.kind == "layer_offset")):
            continue  # the served chunk at this position stands in for it (wrong layer, offset, ...)
        tid = cr.t_id[j]
        ev = {"training_chunk": j, "training_identified_as": tid[0], "training_identified_by": tid[1],
              "served_chunks": ctx.ns, "training_chunks": ctx.nt, "source": ctx.source.name}
        if ctx.served_plan is not None and ctx.served_plan.problems:
            ev["served_plan_problems"] = ctx.served_plan.problems
        out.append(finding("missing_chunk", None,
                           f"training chunk {j} ({tid[0] or 'unidentified'}) is not fed by the server", **ev))
    return out
