"""Fit the transforms the detectors name, on the comparison's reservoir of aligned rows.

A detector may name a transform only when that transform fits the rows at the noise floor
(``helpers.diagnosis.detectors``): ``rotated_basis`` needs an orthogonal map, ``norm_mismatch`` needs an RMS
norm with a per-dim weight. Otherwise the chunk is a ``wrong_layer`` with its closest candidates.

* :func:`isometry_fit` -- ``S = T Q`` for an orthogonal ``Q`` holds exactly when the two row sets have the same
  Gram matrix (row norms and pairwise angles). With fewer rows than dims a Procrustes fit can absorb almost
  any difference (it rotates the row span), so the decision uses the basis-free statistics: per-row
  ``|log(|s_t| / |t_t|)|`` and, over row pairs, ``|cos(s_a, s_b) - cos(t_a, t_b)|``, both at their 90 %
  quantile against the noise floor. The Procrustes residual ``(|S|^2 + |T|^2 - 2 ||S^T T||_*) / (|S|^2 + |T|^2)``
  is reported too (computed through an R x R SVD, never an H x H matrix).
  A rotation that leaves rows at cosine > :data:`ROTATION_MAX_COSINE` is not a deployment fault (QuaRot /
  SpinQuant-style rotations give cosine ~ 0) and is indistinguishable from a nearby layer: not named.
* :func:`rms_norm_fit` -- ``S = rmsnorm(T) * w`` (or ``T = rmsnorm(S) * w``) with a per-dim weight ``w`` fitted
  by least squares on half of the rows and judged on the other half (per-row rel_diff within the tolerance
  for >= ``MATCH_SHARE`` of them): a final norm applied on one side only.
* :func:`scale_fit` -- ``S = c T`` for one scalar ``c`` (rows pointing the same way with a constant norm ratio):
  ``c`` is the median per-row ``<s, t> / |t|^2`` on half of the rows, judged on the other half (per-row rel_diff
  within the tolerance for >= ``MATCH_SHARE`` of them, where the unscaled rows are not): the right tensor
  multiplied by a constant (a scale folded in on one side, a doubled residual, a wrong dtype scale).
* :func:`noise_floor` -- the isometry floor: 3 x the statistics measured on chunk pairs known to be equal
  (the deployment's own engine noise), else a bound from the tolerance and the rows' participation ratio
  (noise spread over the dims moves a norm or an angle by about ``sqrt(2 tol / H_eff)``).

Inputs are float32 tensors ``[R, h]`` (R reservoir rows, h chunk width), rows finite and aligned.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .compare import MATCH_SHARE

#: above this median row cosine an isometry is not named (a nearby layer looks the same).
ROTATION_MAX_COSINE = 0.9
#: the floor is never tighter than this fraction of sqrt(tol) (rounding of the stored values).
FLOOR_MIN_FACTOR = 0.05


@dataclass
class FitResult:
    """Outcome of one transform fit.

    Attributes:
        transform: ``isometry`` | ``rms_norm`` (served = norm(training)) | ``rms_norm_inverse``
            (training = norm(served)).
        fits: the transform explains the rows at the noise floor.
        stats: the measured statistics (JSON-safe).
        floor: what they were compared with, and why.
        rows: rows used.
    """

    transform: str
    fits: bool
    stats: dict = field(default_factory=dict)
    floor: dict = field(default_factory=dict)
    rows: int = 0

    def to_json(self) -> dict:
        return {"transform": self.transform, "fits": self.fits, "rows": self.rows, "stats": _r(self.stats),
                "floor": _r(self.floor)}


def _r(x):
    if isinstance(x, dict):
        return {k: _r(v) for k, v in x.items()}
    if isinstance(x, float):
        return x if not math.isfinite(x) else float(f"{x:.4g}")
    return x


def _usable(S: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    keep = (S.norm(dim=-1) > 0) & (T.norm(dim=-1) > 0) & torch.isfinite(S).all(-1) & torch.isfinite(T).all(-1)
    return S[keep].double(), T[keep].double()


def participation(T: torch.Tensor) -> float:
    """Median participation ratio ``(sum x^2)^2 / sum x^4`` of the rows (how many dims carry a row's energy:
    H for a flat row, ~1 for a row dominated by one massive dim)."""
    x2 = T.double().square()
    pr = x2.sum(-1).square() / x2.square().sum(-1).clamp_min(1e-300)
    return float(pr.median()) if pr.numel() else 1.0


def isometry_stats(S: torch.Tensor, T: torch.Tensor, max_pairs_rows: int = 256) -> dict:
    """Basis-free statistics of how far ``S`` is from ``T Q`` for some orthogonal ``Q`` (see the module).

    Returns ``{"norm_dev_p90", "angle_dev_p90", "row_cosine_p50", "procrustes_residual", "participation"}``."""
    S, T = _usable(S, T)
    R = S.shape[0]
    if R < 4:
        return {}
    nS, nT = S.norm(dim=-1), T.norm(dim=-1)
    norm_dev = (nS / nT).log().abs()
    k = min(R, max_pairs_rows)
    a, b = S[:k] / nS[:k, None], T[:k] / nT[:k, None]
    iu = torch.triu_indices(k, k, 1)
    ang = ((a @ a.T) - (b @ b.T))[iu[0], iu[1]].abs()
    cos = (S * T).sum(-1) / (nS * nT)
    # Procrustes: ||S^T T||_* = ||Sigma_S U_S^T T||_* with S = U_S Sigma_S V_S^T (thin SVD: R x R work)
    U, sig, _ = torch.linalg.svd(S, full_matrices=False)
    nuc = float(torch.linalg.svdvals(sig[:, None] * (U.T @ T)).sum())
    den = float(S.square().sum() + T.square().sum())
    return {"norm_dev_p90": float(torch.quantile(norm_dev, 0.9)),
            "angle_dev_p90": float(torch.quantile(ang, 0.9)) if ang.numel() else 0.0,
            "row_cosine_p50": float(cos.median()),
            "procrustes_residual": max(0.0, (den - 2 * nuc) / den) if den > 0 else 0.0,
            "participation": participation(T), "rows": R}


def noise_floor(tol: float, equal_pairs: list[tuple[torch.Tensor, torch.Tensor]], T_ref: torch.Tensor) -> dict:
    """The isometry floor for ``norm_dev_p90`` / ``angle_dev_p90``.

    Args:
        tol: the per-row rel_diff tolerance.
        equal_pairs: (served rows, training rows) of chunk pairs the comparison found equal (may be empty).
        T_ref: rows whose participation ratio sets the theoretical bound when no equal pair exists.

    Returns ``{"norm", "angle", "from"}``: measured (3 x the largest statistic of the equal pairs) when
    possible, else ``3 * sqrt(2 tol / H_eff)``; never below ``FLOOR_MIN_FACTOR * sqrt(tol)``.
    """
    lo = FLOOR_MIN_FACTOR * math.sqrt(tol)
    measured = [isometry_stats(s, t) for s, t in equal_pairs]
    measured = [m for m in measured if m]
    if measured:
        nv = max(m["norm_dev_p90"] for m in measured)
        av = max(m["angle_dev_p90"] for m in measured)
        return {"norm": max(3 * nv, lo), "angle": max(3 * av, lo),
                "from": f"3 x the largest value on {len(measured)} chunk pair(s) found equal (this deployment's "
                        "engine noise)"}
    pr = max(participation(T_ref), 1.0)
    v = 3 * math.sqrt(2 * tol / pr)
    return {"norm": max(v, lo), "angle": max(v, lo),
            "from": f"no equal chunk pair to measure the noise on: 3 x sqrt(2 x tolerance / participation ratio "
                    f"{pr:.0f}) (noise at the tolerance, spread over the dims that carry the rows)"}


def isometry_fit(S: torch.Tensor, T: torch.Tensor, floor: dict) -> FitResult:
    """Does an orthogonal map take the training rows ``T`` to the served rows ``S`` at the noise floor?"""
    st = isometry_stats(S, T)
    if not st:
        return FitResult("isometry", False, {}, floor, 0)
    fits = (st["norm_dev_p90"] <= floor["norm"] and st["angle_dev_p90"] <= floor["angle"]
            and st["row_cosine_p50"] <= ROTATION_MAX_COSINE)
    return FitResult("isometry", fits, st, {**floor, "max_row_cosine": ROTATION_MAX_COSINE}, st["rows"])


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean(-1, keepdim=True).add(1e-12).sqrt()


def _norm_fit_one(S: torch.Tensor, T: torch.Tensor, tol: float) -> dict:
    """Fit ``S = T / rms(T) * w`` on the even rows, judge per-row rel_diff on the odd rows."""
    U = T / _rms(T)
    fa, fb = slice(0, None, 2), slice(1, None, 2)
    w = (S[fa] * U[fa]).sum(0) / U[fa].square().sum(0).clamp_min(1e-30)
    pred = U[fb] * w
    Sb = S[fb]
    rel = (Sb - pred).square().sum(-1) / (Sb.square().sum(-1) + pred.square().sum(-1)).clamp_min(1e-300)
    return {"share_within": float((rel <= tol).double().mean()), "row_rel_diff_p50": float(rel.median()),
            "weight_min": float(w.min()), "weight_max": float(w.max()), "held_out_rows": int(Sb.shape[0])}


def rms_norm_fit(S: torch.Tensor, T: torch.Tensor, tol: float) -> FitResult:
    """Is one side an RMS norm (per-dim weight) of the other? Tries ``S = norm(T)`` and ``T = norm(S)``; the
    better direction is reported. Fits when >= ``MATCH_SHARE`` of the held-out rows are within ``tol``."""
    S, T = _usable(S, T)
    if S.shape[0] < 8:
        return FitResult("rms_norm", False, {}, {}, int(S.shape[0]))
    fwd = _norm_fit_one(S, T, tol)
    inv = _norm_fit_one(T, S, tol)
    best, name = (fwd, "rms_norm") if fwd["share_within"] >= inv["share_within"] else (inv, "rms_norm_inverse")
    fits = best["share_within"] >= MATCH_SHARE
    return FitResult(name, fits, {**best, "other_direction_share_within": (inv if best is fwd else fwd)["share_within"]},
                     {"tolerance": tol, "share_needed": MATCH_SHARE,
                      "from": "per-row rel_diff on held-out rows (the weight is fitted on the other half)"},
                     int(S.shape[0]))


def scale_fit(S: torch.Tensor, T: torch.Tensor, tol: float) -> FitResult:
    """Is ``S = c T`` for one constant ``c``? ``c`` = median per-row ``<s, t> / |t|^2`` on the even rows; fits
    when >= ``MATCH_SHARE`` of the odd rows are within ``tol`` after scaling while fewer are without it (the
    scale is what makes them equal). Stats: ``factor``, its per-row spread (``row_factor_p10`` / ``p90``),
    ``share_within`` scaled and ``share_within_unscaled`` (held-out rows), ``row_cosine_p50``."""
    S, T = _usable(S, T)
    if S.shape[0] < 8:
        return FitResult("scale", False, {}, {}, int(S.shape[0]))
    per_row = (S * T).sum(-1) / T.square().sum(-1)
    fa, fb = slice(0, None, 2), slice(1, None, 2)
    c = float(per_row[fa].median())
    Sb, Tb = S[fb], T[fb]

    def share(x, y):
        rel = (x - y).square().sum(-1) / (x.square().sum(-1) + y.square().sum(-1)).clamp_min(1e-300)
        return float((rel <= tol).double().mean()), float(rel.median())
    sh, med = share(Sb, c * Tb)
    sh0, _ = share(Sb, Tb)
    cos = (S * T).sum(-1) / (S.norm(dim=-1) * T.norm(dim=-1))
    stats = {"factor": c, "row_factor_p10": float(torch.quantile(per_row, 0.1)),
             "row_factor_p90": float(torch.quantile(per_row, 0.9)), "share_within": sh, "row_rel_diff_p50": med,
             "share_within_unscaled": sh0, "row_cosine_p50": float(cos.median()), "held_out_rows": int(Sb.shape[0])}
    fits = sh >= MATCH_SHARE and sh0 < MATCH_SHARE
    return FitResult("scale", fits, stats, {"tolerance": tol, "share_needed": MATCH_SHARE,
                                            "from": "per-row rel_diff on held-out rows (the factor is fitted on the "
                                                    "other half)"}, int(S.shape[0]))
