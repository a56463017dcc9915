"""The cross-engine comparison's statistics without servers: the paired terms (accept length as a ratio of sums per
frame, resampled jointly over prompts) and the per-position P(accepted >= j) change, against hand computations on
frames built here."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from helpers.investigation.cross_engine import paired_terms, position_effect


def _frame(rows):
    """rows: (prompt_id, completion_tokens, verify_ct, histogram)"""
    return pd.DataFrame([{"prompt_id": p, "completion_tokens": c, "verify_ct": v, "histogram": json.dumps(h),
                          "error": None} for p, c, v, h in rows])


A = _frame([("p0", 32, 16, [8, 4, 2, 2]), ("p1", 32, 12, [4, 4, 2, 2]), ("p2", 32, 14, [6, 4, 2, 2]),
            ("p3", 32, 15, [7, 4, 2, 2])])
B = _frame([("p0", 32, 20, [12, 4, 2, 2]), ("p1", 32, 18, [10, 4, 2, 2]), ("p2", 32, 19, [11, 4, 2, 2]),
            ("p3", 32, 21, [13, 4, 2, 2]), ("p9", 32, 1, [0, 0, 0, 1])])       # p9 only on b: left out


def test_paired_terms_are_ratios_of_sums_with_a_joint_bootstrap():
    t = paired_terms({"a": A, "b": B}, {"d": {"b": 1, "a": -1}})
    d = t["d"]
    assert d["n"] == 4 and d["delta"] == pytest.approx(128 / 78 - 128 / 57)
    assert d["lo"] <= d["delta"] <= d["hi"] < 0                 # every prompt accepts less on b: the CI excludes 0
    # a term with equal frames on both sides is exactly 0 in every resample
    z = paired_terms({"a": A, "c": A.copy()}, {"z": {"a": 1, "c": -1}})["z"]
    assert z["delta"] == z["lo"] == z["hi"] == 0.0


def test_double_difference_of_the_engine_term():
    off_a, off_b = A.copy(), B.copy()
    live_b = B.assign(verify_ct=B["verify_ct"] + 2)              # b loses 2 verify steps per prompt after capture
    t = paired_terms({"live_a": A, "off_a": off_a, "live_b": live_b, "off_b": off_b},
                     {"engine": {"live_b": 1, "off_b": -1, "live_a": -1, "off_a": 1}})["engine"]
    assert t["delta"] == pytest.approx(128 / 86 - 128 / 78) and t["hi"] < 0


def test_position_effect_is_p_accepted_at_least_j_per_side():
    pos = position_effect(A, B, 3)
    steps_a, steps_b = 57, 78
    assert [p["position"] for p in pos] == [1, 2, 3]
    assert pos[0]["a"] == pytest.approx((57 - 25) / steps_a) and pos[0]["b"] == pytest.approx((78 - 46) / steps_b)
    assert pos[2]["a"] == pytest.approx(8 / steps_a) and pos[2]["b"] == pytest.approx(8 / steps_b)
    for p in pos:
        assert p["delta"] == pytest.approx(p["b"] - p["a"]) and p["delta_lo"] <= p["delta"] <= p["delta_hi"]
    assert pos[0]["delta_hi"] < 0 and np.isfinite(pos[2]["delta_lo"])


def test_an_own_embedding_is_named_at_the_draft_term_not_wiring_or_engine(tmp_path):
    """The same draft (an embed_tokens of its own) on SGLang (a) and vLLM (b), each server modelled by the draft run
    with its engine's loader rules on the same states (the live check of tests/server/test_vllm_faults.py shows the
    vLLM server matches it): the live difference is the draft term (b's loader rules minus a's on b's states), the
    wiring and engine terms are 0; _same_tensors tells the two loads apart only where the loaders differ."""
    from types import SimpleNamespace

    from helpers.draft import simulate as sm
    from helpers.draft.sequences import training_sequences
    from helpers.engines.detect import adapter
    from helpers.formats.training_data import TrainingData
    from helpers.investigation.cross_engine import Pair, Side, _draft, _same_tensors, _stage_attribute, _stage_paired
    from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET, REFERENCE_TRAINING
    from support.drafts import own_embedding_draft

    own = own_embedding_draft(tmp_path / "own", target=REFERENCE_TARGET)
    spec = {"num_steps": 3, "topk": 1, "num_draft_tokens": 4}

    def side(label, engine, version, draft):
        att = SimpleNamespace(spec=spec, version=version, draft_dir=draft, target_dir=REFERENCE_TARGET, info={})
        return Side(label, f"http://{label}", adapter=adapter(engine), att=att, budget={"losses": {}})

    a, b = side("a", "sglang", "0.5.23", own), side("b", "vllm", "0.32.0", own)
    assert not _same_tensors(_draft(b, a), _draft(b, b))
    ra, rb = side("a", "sglang", "0.5.23", REFERENCE_DRAFT), side("b", "vllm", "0.32.0", REFERENCE_DRAFT)
    assert _same_tensors(_draft(rb, ra), _draft(rb, rb))
    seqs = training_sequences(TrainingData(REFERENCE_TRAINING, hidden_size=128))
    st = sm.DraftSettings.chain(3)
    run = {s.label: sm.simulate_sequences(_draft(b, s), seqs, [st])["per_request"][st] for s in (a, b)}
    a.live, a.offline, b.live, b.offline = run["a"], run["a"].copy(), run["b"], run["b"].copy()
    a.tokens = b.tokens = {q.key: q.tokens.tolist() for q in seqs}
    p = Pair(a, b, REFERENCE_TRAINING, tmp_path, len(seqs), 32, 3, None, lambda m: None, doc={"same_draft": True},
             b_as_a=run["a"].copy())
    _stage_paired(p)
    _stage_attribute(p)
    t = p.doc["terms"]
    assert t["wiring"]["delta"] == t["wiring"]["hi"] == 0.0 and t["engine"]["delta"] == 0.0
    assert t["draft"]["hi"] < 0 and t["draft"]["delta"] == pytest.approx(t["live"]["delta"])
    assert p.doc["named"] == ["draft"] and "each engine's loader" in p.doc["sentence"], p.doc["sentence"]
