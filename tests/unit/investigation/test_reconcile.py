"""A hypothesis refuted while a finding of the same run answers its question the other way is not reported as
refuted (helpers.investigation.live.reconcile)."""
from helpers.investigation.live import reconcile
from helpers.records import Finding


def test_refuted_check_contradicted_by_a_finding_becomes_inconclusive():
    hyps = [{"check": "embedding_all_reduce", "verdict": "refuted", "explanation": "ranks agree", "short": "x"},
            {"check": "concat_order", "verdict": "refuted", "explanation": "in order", "short": "y"},
            {"check": "num_steps_override", "verdict": "refuted", "explanation": "runs what was asked", "short": ""}]
    f = [Finding(kind="embedding_not_all_reduced", chunk=0, detail="chunk 0 is rank 0's partial embedding",
                 evidence={}),
         Finding(kind="spec_settings_low", chunk=None, detail="steps 1: 1.71 vs 2.68 at steps 3", evidence={})]
    out = {h["check"]: h for h in reconcile(hyps, f)}
    assert out["embedding_all_reduce"]["verdict"] == "inconclusive"
    assert "embedding_not_all_reduced" in out["embedding_all_reduce"]["short"]
    # low settings do not contradict "the server runs what was asked": that check stays refuted
    assert out["num_steps_override"]["verdict"] == "refuted"
    assert out["concat_order"]["verdict"] == "refuted"           # nothing contradicts it
    assert [h["verdict"] for h in reconcile(hyps, f)] == ["inconclusive", "refuted", "refuted"]
