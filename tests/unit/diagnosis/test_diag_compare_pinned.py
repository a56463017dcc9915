"""Pinned evidence values of the comparison (issue 22: the faster pair update must not change what the diagnosis
reports). Every value below was computed by the comparison as it was before issue 22 (commit 5ba5cdb) on the data
built here; the test checks the current code gives the same: exact counts, histogram quantiles to their bin (the
robust per-row statistics decide the verdict), floats to a relative 1e-4. The tolerances are those of float32 on
another CPU: the same code gave a mean log norm ratio 2.4e-5 (relative) apart, and rel_diff 1.3e-7 instead of 0
for rows that are exact copies (a Gram-sum cancellation at float32's precision), on two x86 machines whose BLAS
kernels sum in another order; so a quantile at or below 1e-6 (the "equal" bins) only has to stay there, a larger one
may move to the adjacent bin (edges 1.26x apart), never further."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from helpers.diagnosis.compare import compare
from helpers.diagnosis.diagnose import diagnose
from helpers.formats.dumps import Sample, SampleSource
from support.realistic import World, outs, specforge_default

REL = 1e-4
#: histogram edges are 10 per decade: adjacent bins differ by this factor
BIN = 10 ** 0.1
#: quantiles at or below this are "equal" (float32 precision of a rel_diff / 1 - cosine)
EQUAL = 1e-6


def _sample(key, ids, rows, **kw):
    return Sample(key=key, rows=rows.shape[0], width=rows.shape[1], loader=lambda r=rows: r,
                  input_ids=np.asarray(ids, np.int64), **kw)


def _wide_bf16(H: int = 1024, L: int = 300, samples: int = 2):
    """bf16 training rows [L, 3H] with a massive first row, and served rows: chunk 0 = training chunk 0 + bf16-level
    noise (equal), chunk 1 = training chunk 2 (order), chunk 2 = 0.9 x training chunk 1 + noise (far); one NaN row
    in served chunk 1. Token ids repeat (the context-free test runs). 300 rows = 3 blocks of the pipeline."""
    g = torch.Generator().manual_seed(22)
    rng = np.random.default_rng(22)
    train, served, ids = [], [], []
    for k in range(samples):
        t = 0.5 * torch.randn(L, 3 * H, generator=g)
        t[0, [5, 77, H + 5, 2 * H + 77]] = 150.0
        s = torch.empty_like(t)
        s[:, :H] = t[:, :H] + 0.002 * torch.randn(L, H, generator=g)
        s[:, H:2 * H] = t[:, 2 * H:]
        s[:, 2 * H:] = 0.9 * t[:, H:2 * H] + 0.2 * torch.randn(L, H, generator=g)
        if k == 1:
            s[17, H:2 * H] = float("nan")
        train.append(t.bfloat16())
        served.append(s.bfloat16())
        ids.append(rng.integers(0, 40, L))
    return H, train, served, ids


def _pair_values(m) -> dict:
    j = m.to_json()
    keep = ("share_within_tolerance", "row_rel_diff", "row_one_minus_cos", "row_abs_log_norm_ratio", "rows",
            "passed", "rel_diff", "cosine", "norm_ratio", "mean_row_cosine", "min_row_cosine", "row_norm_ratio_min",
            "row_norm_ratio_max", "mean_log_norm_ratio", "std_log_norm_ratio", "max_abs_diff", "max_abs_at")
    return {k: j[k] for k in keep}


def _check(got, want, path=""):
    """Exact for ints, bools and strings; histogram quantiles (upper bin edges) to their bin (module docstring);
    floats to REL."""
    if isinstance(want, dict):
        assert set(got) == set(want), path
        for k in want:
            _check(got[k], want[k], f"{path}/{k}")
    elif isinstance(want, list) and want and isinstance(want[0], (dict, float)):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            _check(g, w, f"{path}/{i}")
    elif isinstance(want, float) and not isinstance(got, bool):
        quantile = any(q in path for q in ("row_rel_diff/", "row_one_minus_cos/", "row_abs_log_norm_ratio/"))
        # a global rel_diff / cosine of a near pair comes from float32 Gram sums: ~1e-6 absolute is their precision
        near_one = path.endswith(("/rel_diff", "/cosine"))
        if quantile and want <= EQUAL:
            assert got <= EQUAL, (path, got, want)
        elif quantile:
            assert want / BIN * 0.999 <= got <= want * BIN * 1.001, (path, got, want)
        else:
            assert got == pytest.approx(want, rel=REL, abs=1e-6 if near_one else 1e-12), path
    else:
        assert got == want, path


#: compare() on _wide_bf16(): pairs (served chunk, training chunk), served chunk 1's stats, training chunk 0's
#: outlier rows, the reservoir.
WIDE = {'00': {'share_within_tolerance': 1.0,
        'row_rel_diff': {'p10': 1e-05, 'p50': 1.25893e-05, 'p90': 1.25893e-05},
        'row_one_minus_cos': {'p10': 1e-05, 'p50': 1.25893e-05, 'p90': 1.25893e-05},
        'row_abs_log_norm_ratio': {'p50': 0.000125893, 'p90': 0.000316228},
        'rows': 600,
        'passed': True,
        'rel_diff': 6.75774e-06,
        'cosine': 0.999993,
        'norm_ratio': 1.00001,
        'mean_row_cosine': 0.99999,
        'min_row_cosine': 0.999987,
        'row_norm_ratio_min': 0.999446,
        'row_norm_ratio_max': 1.00047,
        'mean_log_norm_ratio': 1.08786e-05,
        'std_log_norm_ratio': 0.000168791,
        'max_abs_diff': 0.015625,
        'max_abs_at': {'sample': 's0', 'row': 24, 'position': 24, 'token_id': 13, 'column': 756}},
 '12': {'share_within_tolerance': 1.0,
        'row_rel_diff': {'p10': 1e-12, 'p50': 1e-12, 'p90': 1e-12},
        'row_one_minus_cos': {'p10': 1e-12, 'p50': 1e-12, 'p90': 1e-12},
        'row_abs_log_norm_ratio': {'p50': 1e-12, 'p90': 1e-12},
        'rows': 599,
        'passed': True,
        'rel_diff': 8.45085e-08,
        'cosine': 1.0,
        'norm_ratio': 1.0,
        'mean_row_cosine': 1.0,
        'min_row_cosine': 1.0,
        'row_norm_ratio_min': 1.0,
        'row_norm_ratio_max': 1.0,
        'mean_log_norm_ratio': 0.0,
        'std_log_norm_ratio': 0.0,
        'max_abs_diff': 0.0,
        'max_abs_at': {'sample': 's0', 'row': 0, 'position': 0, 'token_id': 30, 'column': 0}},
 '21': {'share_within_tolerance': 0.0,
        'row_rel_diff': {'p10': 0.1, 'p50': 0.1, 'p90': 0.1},
        'row_one_minus_cos': {'p10': 0.1, 'p50': 0.1, 'p90': 0.1},
        'row_abs_log_norm_ratio': {'p50': 0.0158489, 'p90': 0.0316228},
        'rows': 600,
        'passed': False,
        'rel_diff': 0.0690845,
        'cosine': 0.931455,
        'norm_ratio': 0.966525,
        'mean_row_cosine': 0.914137,
        'min_row_cosine': 0.895102,
        'row_norm_ratio_min': 0.901054,
        'row_norm_ratio_max': 1.02433,
        'mean_log_norm_ratio': -0.0152883,
        'std_log_norm_ratio': 0.0136333,
        'max_abs_diff': None,
        'max_abs_at': None},
 '01': {'share_within_tolerance': 0.0,
        'row_rel_diff': {'p10': 1.0, 'p50': 1.25893, 'p90': 1.25893},
        'row_one_minus_cos': {'p10': 1.0, 'p50': 1.25893, 'p90': 1.25893},
        'row_abs_log_norm_ratio': {'p50': 0.0251189, 'p90': 0.0630957},
        'rows': 600,
        'passed': False,
        'rel_diff': 0.795774,
        'cosine': 0.205284,
        'norm_ratio': 1.10712,
        'mean_row_cosine': 0.00245941,
        'min_row_cosine': -0.126853,
        'row_norm_ratio_min': 0.913281,
        'row_norm_ratio_max': 1.41058,
        'mean_log_norm_ratio': 0.000704683,
        'std_log_norm_ratio': 0.0366932,
        'max_abs_diff': None,
        'max_abs_at': None},
 'served_stats_1': {'rows': 600,
                    'nonfinite_rows': 1,
                    'nonfinite_at': [{'sample': 's1', 'row': 17, 'position': 17, 'token_id': 2}],
                    'zero_rows': 0,
                    'repeated_token_pairs': 557,
                    'repeated_token_max_rel_diff': 1.08741,
                    'nonzero_id_range': [0, 39],
                    'outliers': {'top_rows': [{'sample': 's1',
                                               'position': 0,
                                               'token_id': 13,
                                               'dims': [77, 887, 122],
                                               'dims_energy_share': 0.9883,
                                               'energy_vs_median_row': 72.01},
                                              {'sample': 's0',
                                               'position': 0,
                                               'token_id': 30,
                                               'dims': [77, 716, 352],
                                               'dims_energy_share': 0.9896,
                                               'energy_vs_median_row': 71.92},
                                              {'sample': 's1',
                                               'position': 213,
                                               'token_id': 31,
                                               'dims': [555, 841, 311],
                                               'dims_energy_share': 0.03523,
                                               'energy_vs_median_row': 0.9681}],
                                 'top_rows_energy_share': 0.2355,
                                 'rows': 600}},
 'training_outliers_0': {'top_rows': [{'sample': 's0',
                                       'position': 0,
                                       'token_id': 30,
                                       'dims': [77, 5, 465],
                                       'dims_energy_share': 0.9944,
                                       'energy_vs_median_row': 143.1},
                                      {'sample': 's1',
                                       'position': 0,
                                       'token_id': 13,
                                       'dims': [77, 5, 862],
                                       'dims_energy_share': 0.9944,
                                       'energy_vs_median_row': 143.1},
                                      {'sample': 's0',
                                       'position': 137,
                                       'token_id': 20,
                                       'dims': [347, 299, 244],
                                       'dims_energy_share': 0.02542,
                                       'energy_vs_median_row': 0.9273}],
                         'top_rows_energy_share': 0.3763,
                         'rows': 600},
 'reservoir': {'count': 256,
               'train_sum': 558.3685066476464,
               'served_nansum': 627.2656435891986,
               'ids_sum': 4964,
               'positions_sum': 37496}}

#: diagnose() of a 32-layer synthetic target whose served chunk 1 is one layer late (test_diag_realistic's
#: test_one_chunk_one_layer_late_is_not_ok, in a world of its own): the finding's evidence, the chunk table, the noise.
REALISTIC = {'kinds': [['wrong_layer', 1]],
 'metrics': {'share_within_tolerance': 0.123288,
             'row_rel_diff': {'p10': 0.000158489, 'p50': 0.0125893, 'p90': 0.0125893},
             'row_cosine_p50': 0.987411,
             'row_one_minus_cos': {'p10': 6.30957e-05, 'p50': 0.0125893, 'p90': 0.0125893},
             'row_abs_log_norm_ratio': {'p50': 0.0630957, 'p90': 0.0630957},
             'mean_log_norm_ratio': 0.0507838,
             'std_log_norm_ratio': 0.0191675,
             'rel_diff': 0.000141762,
             'cosine': 0.999859,
             'norm_ratio': 1.00096,
             'mean_row_cosine': 0.990818,
             'min_row_cosine': 0.989076,
             'row_norm_ratio_min': 0.984028,
             'row_norm_ratio_max': 1.06511,
             'max_abs_diff': 3.0,
             'max_abs_at': {'sample': 'req0', 'row': 9, 'position': 9, 'token_id': 13, 'column': 142},
             'rows': 146,
             'passed': False},
 'closest': [{'training_chunk': 1,
              'training_identified_as': 'out(15)',
              'share_within': 0.1233,
              'row_rel_diff_p50': 0.0125893,
              'row_cosine_p50': 0.987411},
             {'training_chunk': 2,
              'training_identified_as': 'out(28)',
              'share_within': 0.08219,
              'row_rel_diff_p50': 0.630957,
              'row_cosine_p50': 0.601893},
             {'training_chunk': 0,
              'training_identified_as': 'out(1)',
              'share_within': 0.0,
              'row_rel_diff_p50': 0.794328,
              'row_cosine_p50': 0.498813}],
 'outliers': {'top_rows': [{'sample': 'req2',
                            'position': 9,
                            'token_id': 13,
                            'dims': [142, 120, 244],
                            'dims_energy_share': 0.9995,
                            'energy_vs_median_row': 1590.0},
                           {'sample': 'req2',
                            'position': 0,
                            'token_id': 1,
                            'dims': [142, 120, 230],
                            'dims_energy_share': 0.9996,
                            'energy_vs_median_row': 1590.0},
                           {'sample': 'req2',
                            'position': 27,
                            'token_id': 13,
                            'dims': [142, 120, 244],
                            'dims_energy_share': 0.9995,
                            'energy_vs_median_row': 1570.0}],
              'top_rows_energy_share': 0.3411,
              'rows': 146},
 'chunks': [{'index': 0,
             'width': 256,
             'matched_training_chunk': 0,
             'share_within': 1.0,
             'row_rel_diff_p50': 1e-05,
             'row_cosine_p50': 0.99999,
             'rel_diff': 8.69366e-06,
             'cosine': 0.999991,
             'identified_as': None},
            {'index': 1,
             'width': 256,
             'matched_training_chunk': None,
             'share_within': 0.123288,
             'row_rel_diff_p50': 0.0125893,
             'row_cosine_p50': 0.987411,
             'rel_diff': 0.000141762,
             'cosine': 0.999859,
             'identified_as': None},
            {'index': 2,
             'width': 256,
             'matched_training_chunk': 2,
             'share_within': 1.0,
             'row_rel_diff_p50': 0.0001,
             'row_cosine_p50': 0.9999,
             'rel_diff': 0.000146796,
             'cosine': 0.999853,
             'identified_as': None}],
 'noise': {'row_rel_diff_p50': 9.999999999999346e-05,
           'row_rel_diff_p90': 0.00012589254117940837,
           'pairs': 2,
           'margin_to_tolerance': 15.9}}


def test_wide_bf16_comparison_keeps_its_pinned_evidence():
    H, train, served, ids = _wide_bf16()
    tr = [_sample(f"data_{k}", ids[k], train[k], sample_id=f"data_{k}") for k in range(2)]
    sv = SampleSource(path=Path("served"), kind="served", format="e3f-dump",
                      samples=[_sample(f"s{k}", ids[k], served[k], sample_id=f"data_{k}") for k in range(2)])
    c = compare(tr, [sv], hidden_size=H, training_width=3 * H, training_dtype="bfloat16", served_dtype="bfloat16")
    for key in ("00", "12", "21", "01"):
        _check(_pair_values(c.metrics(c.primary, int(key[0]), int(key[1]))), WIDE[key], key)
    st = c.primary.stats.to_json(1)
    st["outliers"]["top_rows"] = st["outliers"]["top_rows"][:3]
    _check(st, WIDE["served_stats_1"], "served_stats_1")
    o = c.training_stats.outliers(0)
    o["top_rows"] = o["top_rows"][:3]
    _check(o, WIDE["training_outliers_0"], "training_outliers_0")
    r = c.reservoir
    _check({"count": r.count, "train_sum": float(r.train[:r.count].double().sum()),
            "served_nansum": float(r.served[:r.count].double().nansum()), "ids_sum": int(r.ids[:r.count].sum()),
            "positions_sum": int(r.positions[:r.count].sum())}, WIDE["reservoir"], "reservoir")


def test_realistic_wrong_layer_keeps_its_pinned_evidence(tmp_path):
    w = World.make(tmp_path, layers=32, hidden=256, noise=1e-2, seed=32)
    ids = specforge_default(32)
    train = w.training(outs(ids), manifest_ids=ids)
    dd, td = w.configs(ids)
    d = diagnose(train, [w.served_json(outs([ids[0], ids[1] + 1, ids[2]]))], draft_config=dd, target_config=td)
    ev = d.findings[0]["evidence"]
    m = dict(ev["metrics"])
    assert m.pop("tolerance") == 2e-3
    m.pop("min_tolerance")
    o = dict(ev["outlier_rows"])
    o["top_rows"] = o["top_rows"][:3]
    _check({"kinds": [[x["kind"], x["chunk"]] for x in d.findings], "metrics": m,
            "closest": ev["closest_training_chunks"], "outliers": o, "chunks": d.chunks, "noise": d.noise}, REALISTIC)


def _accumulated(c) -> dict:
    """Every number the comparison accumulated: served x training / suspect / served x reference / training x
    reference pairs (sums, counts, histograms, extrema and where), the chunk stats and the reservoir rows."""
    out = {}
    for name, acc in (("pairs", c.primary.pairs), ("suspect", c.primary.suspect), ("ref", c.primary.ref),
                      ("train_ref", c.training_ref)):
        for k in ("n", "within", "valid", "h_rel", "h_cos", "h_lnr", "sxx", "syy", "sdd", "lnr_sq", "lnr_sum",
                  "cos_sum", "cos_min", "nr_min", "nr_max", "max_abs"):
            out[f"{name}.{k}"] = getattr(acc, k).copy()
        out[f"{name}.max_at"] = acc.max_at
    out["stats"] = [c.primary.stats.to_json(i) for i in range(3)] + [c.training_stats.to_json(i) for i in range(3)]
    r = c.reservoir
    out["reservoir"] = (r.train[:r.count].clone(), r.served[:r.count].clone(), r.ref[:r.ref_count].clone(),
                        r.ids[:r.count].copy(), r.positions[:r.count].copy())
    return out


def _same(a: dict, b: dict) -> None:
    for k in a:
        if isinstance(a[k], np.ndarray):
            assert np.array_equal(a[k], b[k], equal_nan=True), k
        elif k == "reservoir":
            for x, y in zip(a[k], b[k]):
                assert (torch.equal(x, y) if isinstance(x, torch.Tensor) else np.array_equal(x, y)), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("tolerance", [None, 1e-6])
def test_tiles_of_any_size_and_the_block_path_give_the_same_bits(monkeypatch, tolerance):
    """The tiled path (one served source: the block compared a few rows at a time while they are in cache) gives
    bit-identical results whatever the tile size, and the same as the block path (float32 copies of the whole
    block, which several ranks and blocks with a non-finite row take); with a float32 tolerance the near pairs'
    per-row |x - y|^2 is taken elementwise in both."""
    import helpers.diagnosis.compare as C

    H, train, served, ids = _wide_bf16()
    served = [s.clone() for s in served]
    served[0][296, 7] += 1.0          # the near pair's largest difference in the last, partial tile of a block
    layers = [torch.cat([t[:, :H], t[:, 2 * H:], t[:, H:2 * H], 0.5 * t[:, :H]], dim=1) for t in train]
    ref = SampleSource(path=Path("ref"), kind="reference", format="e3f-dump",
                       samples=[_sample(f"r{k}", ids[k], layers[k], sample_id=f"data_{k}") for k in range(2)],
                       layer_plan={"tensors": ["out(1)", "out(3)", "out(2)", "half(1)"]})

    def run():
        tr = [_sample(f"data_{k}", ids[k], train[k], sample_id=f"data_{k}") for k in range(2)]
        sv = SampleSource(path=Path("served"), kind="served", format="e3f-dump",
                          samples=[_sample(f"s{k}", ids[k], served[k], sample_id=f"data_{k}") for k in range(2)])
        return _accumulated(compare(tr, [sv], hidden_size=H, training_width=3 * H, training_dtype="bfloat16",
                                    served_dtype="bfloat16", reference=ref, tolerance=tolerance))

    default = run()
    assert C._tile_rows(4 * 10 * H) < C.PAIR_ROWS            # the default really compares in tiles here
    monkeypatch.setattr(C, "TILE_BYTES", 1)                   # one row per tile
    _same(default, run())
    monkeypatch.setattr(C, "_prepare_tiled", lambda *args: None)
    _same(default, run())
    assert default["pairs.max_at"][0][0]["row"] == 296 and default["ref.n"].min() == 599
