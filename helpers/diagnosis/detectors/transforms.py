"""Transform detectors: a served chunk that is a training chunk through a transform (a rotation, a norm, a
constant factor) or with a minority of rows / a few dims altered (:mod:`helpers.diagnosis.fit`). Never named for a
chunk the reference identifies as a layer."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from ..compare import MATCH_SHARE
from .base import finding
from .context import Context


def _fit_target(ctx: Context, i: int, kind: str):
    """(training chunk, fit) of the first candidate (same index first, then the closest) whose ``kind``
    transform fits served chunk ``i``; (None, None) if none does."""
    if not ctx.full_width:
        return None, None
    order = ([i] if i < ctx.nt else []) + [j for j, _ in ctx.cmp.ranked(ctx.source, i) if j != i]
    for j in order:
        f = ctx.fit(kind, i, j)
        if f is not None and f.fits:
            return j, f
    return None, None


def _reference_layer(ctx: Context, i: int) -> Optional[str]:
    ident = ctx.cmp.identify(ctx.source.ref, i)
    return ident.best if ident and ident.passed else None


def _fitted_chunks(ctx: Context, transform: str, kind: str):
    """Yield ``(served chunk i, training chunk j, fit)`` for each unmatched, unclaimed served chunk that no
    reference layer identifies and that ``transform`` (``isometry`` / ``norm`` / ``scale``) maps from a training
    chunk; claims ``i`` for ``kind``, standing for ``j``. The one loop of the transform-fitted detectors."""
    for i in ctx.corr.unmatched_s:
        if ctx.claims.claimed(i) or _reference_layer(ctx, i) is not None:
            continue
        j, f = _fit_target(ctx, i, transform)
        if j is None:
            continue
        ctx.claims.claim(i, kind, j)
        yield i, j, f


def detect_rotated_basis(ctx: Context) -> list[dict]:
    """``rotated_basis``: an orthogonal map takes a training chunk to the served chunk at the noise floor
    (per-row norms and pairwise angles preserved: :func:`helpers.diagnosis.fit.isometry_fit`), while the rows
    themselves point elsewhere (median row cosine <= 0.9: a rotation-based quantisation applied on one side).
    Never named for a chunk the reference identifies as a layer."""
    out = []
    for i, j, f in _fitted_chunks(ctx, "isometry", "rotated_basis"):
        st = f.stats
        out.append(finding("rotated_basis", i,
                           f"served chunk {i} is training chunk {j} in another basis: an orthogonal map fits at the "
                           f"noise floor (row norms within {st['norm_dev_p90']:.2g}, pairwise angles within "
                           f"{st['angle_dev_p90']:.2g} at the 90th percentile; floor {f.floor['norm']:.2g}) while the "
                           f"rows' median cosine is {st['row_cosine_p50']:.3f}",
                           fit=f.to_json(), **ctx.ev(i, j)))
    return out


def detect_norm_mismatch(ctx: Context) -> list[dict]:
    """``norm_mismatch``: an RMS norm with a per-dim weight, applied on one side only, maps a training chunk
    to the served chunk (fitted on half of the reservoir rows, >= 90 % of the other half within tolerance:
    :func:`helpers.diagnosis.fit.rms_norm_fit`), e.g. a final norm / ``norm_before_fc`` / ``fc_norm`` moved."""
    out = []
    for i, j, f in _fitted_chunks(ctx, "norm", "norm_mismatch"):
        side = "served chunk = RMS norm of training chunk" if f.transform == "rms_norm" else \
            "training chunk = RMS norm of served chunk"
        out.append(finding("norm_mismatch", i,
                           f"served chunk {i} is training chunk {j} through an RMS norm applied on one side ({side}, "
                           f"per-dim weight fitted): {f.stats['share_within']:.0%} of held-out rows within tolerance",
                           fit=f.to_json(), **ctx.ev(i, j)))
    return out


def detect_scaled_chunk(ctx: Context) -> list[dict]:
    """``scaled_chunk``: the served chunk is a training chunk times one constant: rows point the same way and
    their norm ratio is constant, and scaling by the fitted factor brings >= ``MATCH_SHARE`` of held-out rows
    within tolerance (:func:`helpers.diagnosis.fit.scale_fit`). Never named for a chunk the reference identifies
    as a layer."""
    out = []
    for i, j, f in _fitted_chunks(ctx, "scale", "scaled_chunk"):
        st = f.stats
        mt = ctx.m(i, j)
        mean_f = None if mt.mean_log_norm_ratio is None else math.exp(mt.mean_log_norm_ratio)
        spread = mt.std_log_norm_ratio
        out.append(finding("scaled_chunk", i,
                           f"served chunk {i} is training chunk {j} times {st['factor']:.4g}: the rows point "
                           f"{'the same way' if st['factor'] > 0 else 'the opposite way'} (median row cosine "
                           f"{st['row_cosine_p50']:.5f}) with a constant norm ratio (per-row "
                           f"factor {st['row_factor_p10']:.4g} to {st['row_factor_p90']:.4g} at the 10th / 90th "
                           f"percentile; over all {mt.rows} rows the norm ratio runs {mt.row_norm_ratio_min:.4g} to "
                           f"{mt.row_norm_ratio_max:.4g}, geometric mean {mean_f:.4g}, log spread {spread:.2g}); scaled "
                           f"back, {st['share_within']:.0%} of held-out rows are within tolerance (unscaled "
                           f"{st['share_within_unscaled']:.0%}). Something multiplies one side by a constant; it is "
                           "not another layer",
                           factor=st["factor"], norm_ratio_geomean=mean_f, log_norm_ratio_std=spread,
                           fit=f.to_json(), **ctx.ev(i, j)))
    return out


#: a served chunk equal to one training chunk on at least this share of its rows (but < MATCH_SHARE) is that
#: chunk with a minority of rows altered: another layer of a deep target differs on the ordinary rows too
#: (row cosine <= 0.99: rel_diff above the tolerance), so it agrees on few rows (the massive-activation rows).
PARTIAL_SHARE = 0.5


def _sampled_pair(ctx: Context, i: int, j: int) -> Optional[tuple[torch.Tensor, torch.Tensor, np.ndarray]]:
    """The reservoir rows of (served i, training j) in float64 without the rows zero on both sides, and the keep
    mask (numpy bool over the reservoir); None when fewer than 8 rows are left. Shared by the partial-match
    evidence (:func:`_differing_rows`, :func:`_dims_partial`)."""
    r = ctx.rows(i, j)
    if r is None:
        return None
    S, T = r[0].double(), r[1].double()
    keep = (S.square().sum(-1) + T.square().sum(-1)) > 0
    if int(keep.sum()) < 8:
        return None
    return S[keep], T[keep], keep.numpy()


def _differing_rows(ctx: Context, i: int, j: int) -> Optional[dict]:
    """What sets the reservoir rows of (served i, training j) outside the tolerance apart: their energy against
    the median row, where they sit (positions / token ids) and the dims that hold their difference."""
    got = _sampled_pair(ctx, i, j)
    if got is None:
        return None
    S, T, keep = got
    rv = ctx.cmp.reservoir
    ids, pos = rv.ids[:rv.count][keep], rv.positions[:rv.count][keep]
    d2 = (S - T).square()
    rel = d2.sum(-1) / (S.square().sum(-1) + T.square().sum(-1))
    bad = (rel > ctx.tol).numpy()
    if not bad.any():
        return None
    e = T.square().sum(-1)
    med = float(e.median())
    be = e[torch.from_numpy(bad)]
    per_dim = d2[torch.from_numpy(bad)].sum(0)
    tot = float(per_dim.sum())
    v, dims = torch.topk(per_dim, min(3, per_dim.numel()))
    top_rank = torch.argsort(e, descending=True)[:int(bad.sum())]
    top_set = set(top_rank.tolist())
    bad_idx = np.nonzero(bad)[0]
    return {"reservoir_rows": int(S.shape[0]), "differing_rows": int(bad.sum()),
            "energy_vs_median_row_p50": float(f"{float(be.median()) / med:.4g}") if med > 0 else None,
            "share_among_highest_energy_rows": float(f"{len(top_set & set(bad_idx.tolist())) / bad.sum():.4g}"),
            "positions": [int(x) for x in pos[bad_idx[:8]]], "token_ids": [int(x) for x in ids[bad_idx[:8]]],
            "diff_dims": [int(x) for x in dims], "diff_dims_share": float(f"{float(v.sum()) / tot:.4g}") if tot else None}


#: at most this many dims may be left out for a dim-wise partial match (massive-activation / outlier dims).
PARTIAL_MAX_DIMS = 4


def _dims_partial(ctx: Context, i: int, j: int) -> Optional[dict]:
    """Reservoir test: leaving out the k <= :data:`PARTIAL_MAX_DIMS` dims that hold most of the difference, are
    >= ``MATCH_SHARE`` of the rows of (served i, training j) within tolerance? (Another layer differs across
    the whole width: a few dims never explain it.) Returns the dims and shares, or None."""
    got = _sampled_pair(ctx, i, j)
    if got is None:
        return None
    S, T, _ = got
    d2 = (S - T).square()
    # the rest of each row against the whole row's energy: engine noise scales with the row (a massive row's
    # noise would swamp its small remainder), and the left-out dims only leave the numerator
    e2 = (S.square() + T.square()).sum(-1).clamp_min(1e-300)
    per_dim = d2.sum(0)
    order = torch.argsort(per_dim, descending=True)
    tot = float(per_dim.sum())
    for k in range(1, min(PARTIAL_MAX_DIMS, S.shape[1] - 1) + 1):
        mask = torch.ones(S.shape[1], dtype=torch.bool)
        mask[order[:k]] = False
        rel = d2[:, mask].sum(-1) / e2
        share = float((rel <= ctx.tol).double().mean())
        if share >= MATCH_SHARE:
            return {"dims": [int(x) for x in order[:k]], "share_within_without_dims": float(f"{share:.4g}"),
                    "dims_share_of_difference": float(f"{float(per_dim[order[:k]].sum()) / tot:.4g}") if tot else None,
                    "reservoir_rows": int(S.shape[0])}
    return None


def detect_partial_match(ctx: Context) -> list[dict]:
    """``partial_match``: a served chunk equals one training chunk on most of its rows (>= :data:`PARTIAL_SHARE`,
    < ``MATCH_SHARE``): the same tensor with a minority of rows altered (the evidence says which rows: energy,
    positions, token ids, and the dims holding the difference); or on >= ``MATCH_SHARE`` of the rows once at
    most :data:`PARTIAL_MAX_DIMS` dims are left out (:func:`_dims_partial`): a few dims altered. Not another
    layer (another layer of a deep target differs on the ordinary rows, across the width). Never named for a
    chunk the reference identifies as a layer."""
    out = []
    if not ctx.full_width:
        return out
    for i in ctx.corr.unmatched_s:
        if ctx.claims.claimed(i) or _reference_layer(ctx, i) is not None:
            continue
        j, mt = ctx.cmp.best_match(ctx.source, i)
        if mt.rows == 0 or mt.share_within >= MATCH_SHARE:
            continue
        cos = "n/a" if mt.median_cosine is None else f"{mt.median_cosine:.4f}"
        if mt.share_within < PARTIAL_SHARE:
            dp = _dims_partial(ctx, i, j)
            if dp is None:
                continue
            ctx.claims.claim(i, "partial_match")
            ev = ctx.ev(i, j)
            ev["differing_dims"] = dp
            out.append(finding("partial_match", i,
                               f"served chunk {i} equals training chunk {j} except on dims {dp['dims']}: leaving them "
                               f"out, {dp['share_within_without_dims']:.0%} of the sampled rows are within tolerance "
                               f"(with them {mt.share_within:.0%} of {mt.rows} rows; median row cosine {cos}), and "
                               f"they hold {dp['dims_share_of_difference']:.0%} of the difference. The same tensor "
                               "with a few dims altered (often the massive-activation dims), not another layer "
                               "(another layer differs across the whole width); what alters them is not settled "
                               "by the data", **ev))
            continue
        ctx.claims.claim(i, "partial_match")
        within = int(round(mt.share_within * mt.rows))
        ev = ctx.ev(i, j)
        rows = _differing_rows(ctx, i, j)
        ev["differing_rows"] = rows
        ev["rows_within"] = within
        what = ""
        if rows:
            hi = rows["share_among_highest_energy_rows"]
            what = (f"; in the reservoir sample the {rows['differing_rows']} differing rows have a median energy "
                    f"{rows['energy_vs_median_row_p50']:.3g} x the median row's"
                    + (" (they are the highest-energy rows: massive activations)" if hi >= 0.8 and
                       (rows["energy_vs_median_row_p50"] or 0) > 10 else "")
                    + f", positions {rows['positions']}, token ids {rows['token_ids']}, and dims "
                    f"{rows['diff_dims']} hold {rows['diff_dims_share']:.0%} of their difference")
        out.append(finding("partial_match", i,
                           f"served chunk {i} equals training chunk {j} on {mt.share_within:.0%} of the rows ({within} "
                           f"of {mt.rows} within tolerance; median per-row rel_diff "
                           f"{(mt.row_rel_diff.get('p50') or 0):.2g}, median row cosine {cos}) but not on the other "
                           f"{mt.rows - within}{what}. The same tensor with a minority of rows altered, not another "
                           "layer (another layer differs on the ordinary rows too); what alters those rows (clamping "
                           "or overflow of large values, another path for some tokens) is not settled by the data",
                           **ev))
    return out
