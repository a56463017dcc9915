"""helpers.acceptance.machine: the machine's load recorded around a measurement, and whether a change of tok/s between
two measurements of the same prompts is the fix's or the machine's (time per verify step, paired per prompt, against
the slowdown the recorded load predicts)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from helpers.acceptance.machine import LoadSampler, slowdown, speed_change, time_per_token_ratio
from support.measurements import frame, machine, summary


_frame, _machine, _summary = frame, machine, summary


@pytest.fixture()
def fix_on_a_busier_machine():
    """The fix raises accept length 1.9 -> 2.7 while a verify step takes twice as long (40 -> 80 ms)."""
    rng = np.random.default_rng(0)
    return _frame(rng, 16, 12, 40.0, 1.9), _frame(rng, 16, 12, 80.0, 2.7)


def test_tok_s_against_the_accept_length_is_explained_by_the_recorded_load(fix_on_a_busier_machine):
    a, b = fix_on_a_busier_machine
    sa, sb = _summary(a, _machine(2.0)), _summary(b, _machine(4.1))       # 1 -> 2.05 x an idle machine
    assert sb["tok_s"] < sa["tok_s"] and sb["accept_length"] > sa["accept_length"]
    sp = speed_change(sa, sb, a, b)
    tt = sp["token_time"]
    assert tt["n_paired"] == 16 and tt["ratio_lo"] < tt["ratio"] < tt["ratio_hi"]
    # 40 ms per step at 1.9 tokens -> 80 ms per step at 2.7 tokens: x(80 / 2.7) / (40 / 1.9) = x1.41 per token
    assert tt["ratio"] == pytest.approx(80 / 2.7 / (40 / 1.9), rel=0.03)
    assert tt["before_ms"] == pytest.approx(40 / 1.9, rel=0.05)
    assert sp["contradicts"] and sp["outside_cis"] and sp["same_settings"]
    assert sp["predicted"] == pytest.approx(2.05) and sp["explained"] is True
    assert "the machine, not the fix" in sp["text"] and "x2.05" in sp["text"]
    assert f"{sa['tok_s']:.1f} -> {sb['tok_s']:.1f}" in sp["text"]
    assert f"a token took {tt['before_ms']:.0f} -> {tt['after_ms']:.0f} ms (x{tt['ratio']:.2f}" in sp["text"]


def test_a_load_that_does_not_explain_it_or_was_not_recorded_is_not_attributable(fix_on_a_busier_machine):
    a, b = fix_on_a_busier_machine
    same = speed_change(_summary(a, _machine(3.0)), _summary(b, _machine(3.0)), a, b)
    assert same["contradicts"] and same["explained"] is False and same["predicted"] == pytest.approx(1.0)
    assert same["text"].startswith(f"tok/s {same['tok_s'][0]:.1f} -> {same['tok_s'][1]:.1f} moves against")
    assert "not attributable to the fix" in same["text"] and "predicts x1.00" in same["text"]
    old = speed_change(_summary(a, None), _summary(b, None), a, b)            # a run from before the load was recorded
    assert old["explained"] is None and "not attributable to the fix" in old["text"]
    assert "recorded no machine load" in old["text"]
    remote = speed_change(_summary(a, _machine(2.0)), _summary(b, _machine(4.1)), a, b, local=False)
    assert remote["explained"] is None and "another machine" in remote["text"]
    other = speed_change(_summary(a, _machine(2.0)), {**_summary(b, _machine(4.1)), "num_steps": 5}, a, b)
    assert other["explained"] is None and "num_steps 3 -> 5" in other["text"]


def test_tok_s_that_moves_with_the_accept_length_is_not_flagged():
    rng = np.random.default_rng(1)
    a, b = _frame(rng, 16, 12, 40.0, 1.9), _frame(rng, 16, 12, 40.0, 2.7)
    sp = speed_change(_summary(a, _machine(2.0)), _summary(b, _machine(2.0)), a, b)
    assert not sp["contradicts"] and sp["text"] == "" and sp["tok_s"][1] > sp["tok_s"][0]
    assert sp["token_time"]["ratio_hi"] < 1.0              # more tokens per verify step: a token takes less time


def test_tok_s_that_does_not_follow_the_accept_length_says_what_is_known():
    """Accept length 1.9 -> 2.7 (23 -> 32 tokens in 12 verify steps) while a verify step went 40 -> 56 ms: a token
    takes as long as before."""
    rng = np.random.default_rng(3)
    a, b = _frame(rng, 16, 12, 40.0, 1.9), _frame(rng, 16, 12, 40.0 * 32 / 23, 2.7)
    sp = speed_change(_summary(a, _machine(2.0)), _summary(b, _machine(2.0)), a, b)
    tt = sp["token_time"]
    assert not sp["contradicts"] and sp["lags"] and tt["ratio_lo"] < 1.0 < tt["ratio_hi"]
    assert sp["text"].startswith(f"tok/s {sp['tok_s'][0]:.1f} -> {sp['tok_s'][1]:.1f} did not follow accept length")
    assert f"x{tt['ratio']:.2f} [{tt['ratio_lo']:.2f}, {tt['ratio_hi']:.2f}]" in sp["text"] and "(x1.00)" in sp["text"]


def test_token_time_pairs_prompts_and_needs_two():
    rng = np.random.default_rng(2)
    a, b = _frame(rng, 4, 10, 50.0, 2.0), _frame(rng, 4, 10, 50.0, 2.0)
    assert time_per_token_ratio(a, b.iloc[:1])["n_paired"] == 1 and np.isnan(time_per_token_ratio(a, b.iloc[:1])["ratio"])
    b.loc[0, "error"] = "boom"
    assert time_per_token_ratio(a, b)["n_paired"] == 3


def test_the_sampler_records_the_load_around_a_block():
    with LoadSampler(every_s=0.05) as s:
        t = time.monotonic()
        while time.monotonic() - t < 0.3:
            pass
    r = s.result
    assert r["cpu_count"] >= 1 and len(r["loadavg_before"]) == 3 and len(r["loadavg_after"]) == 3
    assert r["samples"] >= 3 and r["runnable_mean"] >= 0 and r["runnable_max"] >= r["runnable_mean"]
    assert slowdown(r) >= 1.0 and slowdown({"cpu_count": 2, "runnable_mean": 5.0}) == 2.5
    assert slowdown(None) is None and slowdown({"cpu_count": 2, "loadavg_before": [3, 0, 0],
                                                "loadavg_after": [5, 0, 0]}) == 2.0
