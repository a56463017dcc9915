"""paired_effect: the change of accept length / rate between two measurements of the same prompts,
with a bootstrap CI that resamples prompts jointly."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from helpers.acceptance.stats import bootstrap_ratio_ci, paired_effect


def _frame(prompt_ids, tokens, verify, correct, proposed):
    return pd.DataFrame({"prompt_id": prompt_ids, "completion_tokens": tokens, "verify_ct": verify,
                         "correct_drafts": correct, "proposed_drafts": proposed, "error": None})


def _pair(n=48, shift=0.06, seed=1):
    """Prompts of very different difficulty; the 'after' server accepts a few % more on each."""
    rng = np.random.default_rng(seed)
    tokens = np.full(n, 48)
    base = rng.uniform(1.4, 3.6, n)                       # per-prompt accept length spreads widely
    v_a = np.maximum(1, np.round(tokens / base)).astype(int)
    v_b = np.maximum(1, np.round(tokens / (base * (1 + shift)))).astype(int)
    ids = [f"p{i}" for i in range(n)]
    a = _frame(ids, tokens, v_a, tokens - v_a, 3 * v_a)
    b = _frame(ids, tokens, v_b, tokens - v_b, 3 * v_b)
    return a, b


def test_point_estimate_is_the_difference_of_ratios_of_sums():
    a, b = _pair()
    e = paired_effect(a, b)
    want = b.completion_tokens.sum() / b.verify_ct.sum() - a.completion_tokens.sum() / a.verify_ct.sum()
    assert e["n_paired"] == 48
    assert e["accept_length_delta"] == pytest.approx(want, rel=1e-12)
    rate = b.correct_drafts.sum() / b.proposed_drafts.sum() - a.correct_drafts.sum() / a.proposed_drafts.sum()
    assert e["accept_rate_delta"] == pytest.approx(rate, rel=1e-12)
    assert e["accept_length_delta_lo"] < e["accept_length_delta"] < e["accept_length_delta_hi"]


def test_paired_ci_separates_what_independent_cis_cannot():
    a, b = _pair(shift=0.06)
    _, alo, ahi = bootstrap_ratio_ci(a.completion_tokens, a.verify_ct)
    _, blo, bhi = bootstrap_ratio_ci(b.completion_tokens, b.verify_ct)
    assert blo < ahi                                  # the two 95% CIs overlap ...
    e = paired_effect(a, b)
    assert e["accept_length_delta_lo"] > 0            # ... the paired CI of the change excludes 0
    assert (e["accept_length_delta_hi"] - e["accept_length_delta_lo"]) < 0.5 * (bhi - blo)


def test_no_change_straddles_zero_and_prompts_are_matched_by_id():
    a, _ = _pair()
    b = a.sample(frac=1.0, random_state=0)            # same measurements, other row order
    e = paired_effect(a, b)
    assert e["accept_length_delta"] == pytest.approx(0.0, abs=1e-12)
    assert e["accept_length_delta_lo"] == pytest.approx(0.0, abs=1e-12)
    b2 = b.copy()
    b2.loc[b2.index[:5], "error"] = "timeout"          # failed requests are left out of the pairing
    b2.loc[b2.index[5:8], "prompt_id"] = ["x1", "x2", "x3"]
    assert paired_effect(a, b2)["n_paired"] == 40


def test_missing_column_is_named():
    a, b = _pair()
    with pytest.raises(ValueError, match=r"after per_request frame lacks columns \['verify_ct'\]"):
        paired_effect(a, b.drop(columns=["verify_ct"]))


def test_the_ci_is_the_same_in_any_row_order():
    """The same measurements in another row order (a concurrent measurement, a rebuilt ledger) give the same CI, to
    the bit: the bootstrap resamples the prompts in id order (issue 40: the same investigation twice on one server
    must give the same verdict). Before, the resampling followed the rows' order and the bounds moved (0.0697 against 0.0694
    here) -- enough to flip a decision whose bound sits at the material threshold."""
    a, b = _pair(shift=0.03)
    e = paired_effect(a, b)
    for state in range(5):
        perm = np.random.default_rng(state).permutation(len(a))
        e2 = paired_effect(a.iloc[perm], b.iloc[perm[::-1]])
        for k in ("accept_length_delta_lo", "accept_length_delta_hi", "accept_rate_delta_lo", "accept_rate_delta_hi"):
            assert e2[k] == e[k], (k, state)
        assert sorted(e2["accept_length_per_prompt"]) == pytest.approx(sorted(e["accept_length_per_prompt"]))
