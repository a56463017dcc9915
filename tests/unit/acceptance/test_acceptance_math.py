"""Pure functions of helpers.acceptance on synthetic data with known answers (no server)."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from helpers.acceptance.requests import PER_REQUEST_COLUMNS
from helpers.acceptance.prompts import Prompt, load_prompts, prompts_digest, prompts_from_samples
from helpers.acceptance.stats import accepted_drafts, bootstrap_mean_ci, bootstrap_positions_ci, bootstrap_ratio_ci, histogram_matrix, position_rates, requests_for_half_width, sum_histograms
from helpers.acceptance.measure import summarize
from helpers.server.protocol import MetaInfo


def test_position_rates_known_answer():
    # H = [2, 3, 5]: S = 10 verify steps; >=1 accepted: 8 -> r1 = .8; >=2: 5 -> r2 = .5
    marg, cond = position_rates([2, 3, 5])
    np.testing.assert_allclose(marg, [0.8, 0.5])
    np.testing.assert_allclose(cond, [0.8, 0.5 / 0.8])
    # padded to more positions: the extra position is never reached -> 0, then NaN conditional
    marg, cond = position_rates([2, 3, 5], positions=3)
    np.testing.assert_allclose(marg, [0.8, 0.5, 0.0])
    np.testing.assert_allclose(cond, [0.8, 0.625, 0.0])
    marg, cond = position_rates([4, 0, 0], positions=2)
    np.testing.assert_allclose(marg, [0.0, 0.0])
    assert cond[0] == 0.0 and np.isnan(cond[1])  # position 2 never reached: undefined
    assert np.isnan(position_rates([0, 0, 0])[0]).all()
    with pytest.raises(ValueError, match="beyond position"):
        position_rates([1, 1, 1, 1], positions=2)


def test_position_rates_batched_equals_rowwise():
    rng = np.random.default_rng(1)
    h = rng.integers(0, 20, size=(7, 5))
    bm, bc = position_rates(h, 4)
    for i in range(7):
        m, c = position_rates(h[i], 4)
        np.testing.assert_allclose(bm[i], m)
        np.testing.assert_allclose(bc[i], c)


def test_histogram_helpers():
    assert accepted_drafts([2, 3, 5]) == 0 * 2 + 1 * 3 + 2 * 5
    np.testing.assert_array_equal(sum_histograms([[1], [0, 2], None, [1, 1, 3]]), [2, 3, 3])
    np.testing.assert_array_equal(sum_histograms([[1]], length=4), [1, 0, 0, 0])
    m = histogram_matrix([[1], None, [0, 2, 1]])
    np.testing.assert_array_equal(m, [[1, 0, 0], [0, 0, 0], [0, 2, 1]])


def test_bootstrap_ratio_ci_degenerate_cases():
    est, lo, hi = bootstrap_ratio_ci([3, 6, 9], [1, 2, 3])  # every request has ratio 3
    assert est == pytest.approx(3.0) and lo == pytest.approx(3.0) and hi == pytest.approx(3.0)
    est, lo, hi = bootstrap_ratio_ci([5], [2])
    assert est == 2.5 and np.isnan(lo) and np.isnan(hi)
    with pytest.raises(ValueError):
        bootstrap_ratio_ci([1, 2], [1])


def test_bootstrap_mean_ci_width_and_coverage_on_normal_data():
    rng = np.random.default_rng(0)
    n, sigma, mu = 100, 2.0, 5.0
    covered, widths = 0, []
    for trial in range(150):
        x = rng.normal(mu, sigma, n)
        est, lo, hi = bootstrap_mean_ci(x, n_boot=800, seed=trial)
        covered += lo <= mu <= hi
        widths.append((hi - lo) / 2)
    # nominal 95%; 150 trials: binomial sd ~1.8% -> allow 88%..99.5%
    assert 0.88 <= covered / 150 <= 0.995
    assert np.mean(widths) == pytest.approx(1.96 * sigma / np.sqrt(n), rel=0.1)


def test_ratio_of_sums_differs_from_mean_of_ratios():
    df = _frame([(10, 10, [10, 0, 0, 0]), (100, 25, [0, 0, 0, 25])])
    s, pos, hist, warn = summarize(df, positions=3, n_boot=200)
    assert s["accept_length"] == pytest.approx(110 / 35)
    assert s["accept_length_mean_of_ratios"] == pytest.approx((1.0 + 4.0) / 2)
    # histogram convention: 1 + A/S = 1 + 75/35
    assert s["accept_length_hist"] == pytest.approx(1 + 75 / 35)
    assert s["accept_rate"] == pytest.approx(75 / (35 * 3))
    np.testing.assert_array_equal(hist, [10, 0, 0, 25])
    np.testing.assert_allclose(pos["marginal"], [25 / 35] * 3)
    np.testing.assert_allclose(pos["conditional"], [25 / 35, 1.0, 1.0])
    assert warn == []


def test_summarize_warns_on_missing_spec_fields_and_inconsistent_histograms():
    rows = _frame([(8, 4, [1, 2, 1]), (8, 4, [0, 4, 0])]).to_dict("records")
    rows.append(dict(rows[0], idx=2, has_spec=False, verify_ct=None, correct_drafts=None,
                     proposed_drafts=None, histogram=None, hist_correct_drafts=None))
    rows.append(dict(rows[0], idx=3, correct_drafts=99))  # disagrees with its histogram
    s, _, _, warn = summarize(pd.DataFrame(rows, columns=PER_REQUEST_COLUMNS), positions=2, n_boot=100)
    assert s["n_requests"] == 4 and s["n_spec"] == 3 and s["n_missing_spec"] == 1
    assert any("no spec fields" in w for w in warn)
    assert any("disagrees" in w and "spec_num_correct_drafts in 1" in w for w in warn)


def test_positions_ci_collapses_for_identical_requests():
    m = np.tile([1, 2, 3, 4], (10, 1))
    df = bootstrap_positions_ci(m, 3, n_boot=200)
    np.testing.assert_allclose(df["marginal_lo"], df["marginal"])
    np.testing.assert_allclose(df["marginal_hi"], df["marginal"])
    np.testing.assert_allclose(df["marginal"], [9 / 10, 7 / 10, 4 / 10])


def test_requests_for_half_width_reaches_the_target():
    rng = np.random.default_rng(3)
    n_obs = 60
    verify = rng.integers(20, 40, n_obs)
    per_tok = np.clip(rng.normal(2.0, 0.4, n_obs), 1.0, 4.0)
    comp = np.round(verify * per_tok).astype(int)
    df = _frame([(int(c), int(v), [int(v)]) for c, v in zip(comp, verify)])
    out = requests_for_half_width(df, target=0.05, sizes=(10, 40, 160), n_boot=400)
    assert out["n_obs"] == n_obs
    assert out["by_n"][10] > out["by_n"][40] > out["by_n"][160]
    n = out["n_needed"]
    assert n == int(np.ceil(n_obs * (out["half_width_obs"] / 0.05) ** 2))
    # draw n requests from the same population: the CI half-width is close to the target
    widths = []
    for rep in range(6):
        idx = rng.integers(0, n_obs, n)
        _, lo, hi = bootstrap_ratio_ci(comp[idx], verify[idx], n_boot=400, seed=rep)
        widths.append((hi - lo) / 2)
    assert np.mean(widths) == pytest.approx(0.05, rel=0.3)


def test_meta_info_maps_old_field_names():
    old = MetaInfo.model_validate({"completion_tokens": 9, "spec_verify_ct": 3,
                                   "spec_accept_token_num": 5, "spec_draft_token_num": 9,
                                   "spec_accept_histogram": [1, 0, 2]})
    assert old.spec_num_correct_drafts == 5 and old.spec_num_proposed_drafts == 9
    assert old.spec_correct_drafts_histogram == [1, 0, 2] and old.has_spec_fields
    mid = MetaInfo.model_validate({"spec_verify_ct": 2, "spec_accepted_drafts": 1,
                                   "spec_proposed_drafts": 6})
    assert (mid.spec_num_correct_drafts, mid.spec_num_proposed_drafts) == (1, 6)
    assert not MetaInfo.model_validate({"completion_tokens": 1}).has_spec_fields
    # 2025-12 servers always sent spec_verify_ct=0 without spec decoding
    assert not MetaInfo.model_validate({"spec_verify_ct": 0, "spec_accept_length": 0}).has_spec_fields


def test_bundled_prompt_set():
    ps = load_prompts()
    assert len(ps) >= 40
    assert len({p.id for p in ps}) == len(ps)
    assert len({p.kind for p in ps}) >= 5
    assert all(p.text and len(p.text.split()) >= 5 for p in ps)
    assert len(load_prompts(n=100)) == 100 and len({p.id for p in load_prompts(n=100)}) == 100
    assert prompts_digest(ps) != prompts_digest(ps[:-1])


def test_prompts_from_samples_uses_the_loss_mask_prefix():
    samples = [{"input_ids": [5, 6, 7, 8, 9], "loss_mask": [0, 0, 0, 1, 1], "id": "a"},
               [1, 2, 3], {"input_ids": [4, 4], "loss_mask": [1, 1]}]
    ps = prompts_from_samples(samples)
    assert [p.input_ids for p in ps] == [(5, 6, 7), (1, 2, 3)]  # third has an empty prompt
    assert ps[0].id == "a" and ps[0].request() == {"input_ids": [5, 6, 7]}
    assert prompts_from_samples(samples, max_prompt_tokens=2)[1].input_ids == (1, 2)
    with pytest.raises(ValueError):
        Prompt(id="x")


def _frame(reqs):
    """Per-request frame from (completion_tokens, verify_ct, histogram) triples."""
    rows = []
    for i, (c, v, h) in enumerate(reqs):
        k = len(h) - 1
        rows.append({"idx": i, "prompt_id": f"p{i}", "kind": "t", "prompt_tokens": 5,
                     "completion_tokens": c, "cached_tokens": 0, "verify_ct": v,
                     "correct_drafts": accepted_drafts(h), "proposed_drafts": v * max(k, 1),
                     "hist_correct_drafts": accepted_drafts(h), "histogram": json.dumps(h),
                     "accept_length": c / v, "accept_rate": None, "server_accept_length": c / v,
                     "latency_s": 0.1 * c, "e2e_latency_s": 0.09 * c, "tok_s": 10.0,
                     "finish_reason": "length", "has_spec": True, "error": None})
    return pd.DataFrame(rows, columns=PER_REQUEST_COLUMNS)
