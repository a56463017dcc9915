"""The decay detector of ``watch`` (helpers.acceptance.decay) on synthetic series: a step down is found with its
location inside its CI and triggers; flat noisy series trigger rarely, the rate measured over 200 seeded series, one
look each and a watch's run of looks."""
from __future__ import annotations

import numpy as np
import pytest

from helpers.acceptance.decay import ALPHA, change_point, covariate_steps, decide_drop
from helpers.draft.decide import threshold


def _step(seed: int, n: int = 60, at: int = 30, before: float = 2.5, after: float = 1.9, sd: float = 0.2):
    rng = np.random.default_rng(seed)
    x = rng.normal(before, sd, n)
    x[at:] += after - before
    return x


@pytest.mark.parametrize("seed", range(5))
def test_a_step_down_is_found_inside_its_ci_and_triggers(seed):
    x = _step(seed)
    cp = change_point(x, seed=seed)      # (the CI's coverage: the next test; seed 2 is one of its misses, at 27)
    assert cp.index_ci[0] <= cp.index <= cp.index_ci[1] and cp.index_ci[1] - cp.index_ci[0] <= 8, cp
    assert abs(cp.index - 30) <= 3 and abs(cp.effect + 0.6) < 0.15
    assert cp.effect_ci[1] < 0 and cp.p_value <= ALPHA
    d = decide_drop(cp, material=threshold(2.5), frac=0.15, baseline=float(x[:10].mean()))
    assert d.trigger, d.reason
    # the same step asked to fall below 1.5 (it does not): no trigger, and the reason says which condition failed
    d2 = decide_drop(cp, material=threshold(2.5), below=1.5)
    assert not d2.trigger and "drop-below 1.5" in d2.reason


def test_location_and_effect_cis_cover_the_true_step():
    """Over 100 seeded steps (2.5 -> 1.9 at sample 30 of 60, sd 0.2) the location CI holds 30 in >= 93 of them and
    the effect CI -0.6 in >= 88 (nominal 95 %; measured 99 / 93 over 200)."""
    hits_k = hits_e = 0
    for seed in range(100):
        cp = change_point(_step(seed), seed=seed)
        hits_k += cp.index_ci[0] <= 30 <= cp.index_ci[1]
        hits_e += cp.effect_ci[0] <= -0.6 <= cp.effect_ci[1]
    assert hits_k >= 93 and hits_e >= 88, (hits_k, hits_e)


def test_a_step_up_or_an_immaterial_step_does_not_trigger():
    up = change_point(_step(1, after=3.1), seed=1)
    assert up.effect > 0 and not decide_drop(up, material=0.2).trigger
    small = change_point(_step(2, after=2.42, sd=0.02), seed=2)       # significant, but 0.08 < the material 0.2
    assert small.p_value <= ALPHA and small.effect_ci[1] < 0
    d = decide_drop(small, material=threshold(2.5))
    assert not d.trigger and "material" in d.reason


def test_flat_noisy_series_false_alarm_rate():
    """200 flat series (accept length 2.5, sd 0.2, 60 samples), one look each: triggers at most 3 of 200. Under the
    null the permutation test alone fires at rate ALPHA = 0.002 (0.4 expected of 200; P(X > 3) < 0.1 % for
    Binomial(200, 0.002)), and the materiality and CI conditions only remove triggers. Measured: 0 of 200."""
    fired = 0
    for seed in range(200):
        x = np.random.default_rng(10_000 + seed).normal(2.5, 0.2, 60)
        fired += decide_drop(change_point(x, seed=seed), material=threshold(2.5)).trigger
    assert fired <= 3, fired


def test_flat_series_false_alarm_over_a_watchs_looks():
    """A watch looks again at every sample: 40 flat series looked at every 5th sample from 10 to 60 (11 looks each,
    correlated) trigger in at most 2 of 40 series (5 %): the per-look rate 0.002 times 11 looks bounds the union
    at 2.2 % (0.9 expected of 40; P(X > 2) < 6 %). Measured: 0 of 40 (and 1 of 50 series looked at every sample
    from 10 to 60, 51 looks: the rate a watch of 30-second samples pays per half hour, bounded by the cooldown)."""
    fired = 0
    for s in range(40):
        x = np.random.default_rng(20_000 + s).normal(2.5, 0.2, 60)
        fired += any(decide_drop(change_point(x[:n], seed=n), material=threshold(2.5)).trigger
                     for n in range(10, 61, 5))
    assert fired <= 2, fired


def test_too_short_a_series_has_no_change_point():
    assert change_point([2.0] * 9) is None
    assert not decide_drop(None, material=0.2).trigger


def test_covariate_that_moves_with_the_change_is_named():
    x = _step(3)
    kv = np.r_[np.full(30, 0.3), np.full(30, 0.9)] + np.random.default_rng(3).normal(0, 0.02, 60)
    running = np.random.default_rng(4).normal(8, 1, 60)
    up = np.arange(60) * 30.0
    out = covariate_steps(x, {"kv_cache_use": kv, "running_reqs": running, "uptime_s": up}, 30, uptime=up)
    assert out["moves_with"][0] == "kv_cache_use" and "running_reqs" not in out["moves_with"]
    assert out["covariates"]["kv_cache_use"]["step"] == pytest.approx(0.6, abs=0.03)
    assert out["shape"] == "step"
    # a slow decay with uptime fits a line better than a step
    trend = 2.8 - 0.02 * np.arange(60) + np.random.default_rng(5).normal(0, 0.05, 60)
    cp = change_point(trend)
    assert covariate_steps(trend, {"uptime_s": up}, cp.index, uptime=up)["shape"] == "trend"
