"""A check's result (helpers.investigation.checks.HypothesisResult) has one recorded form per document: the
investigation's HypothesisEntry (same keys on disk as before it was typed) and the replay's HypothesisStep."""
from __future__ import annotations

import pandas as pd

from helpers.investigation.checks import HypothesisResult
from helpers.records import InvestigationDoc


def _result() -> HypothesisResult:
    return HypothesisResult("tp_sharding", "TP sharding", "Full width?", "refuted", "ranks agree",
                            pd.DataFrame({"rank": [0, 1], "rel_diff": [0.0, 1.5e-7]}), None,
                            {"short": "ranks equal", "ranks": 2})


def test_entry_dumps_the_investigation_json_keys_and_reads_back():
    e = _result().entry("tp_sharding", "figures/investigate-tp_sharding.json")
    d = InvestigationDoc(hypotheses=[e]).model_dump(mode="json")["hypotheses"][0]
    assert list(d) == ["check", "title", "question", "verdict", "explanation", "short", "evidence", "figure"]
    assert d["evidence"] == [{"rank": 0, "rel_diff": 0.0}, {"rank": 1, "rel_diff": 1.5e-7}]
    assert d["short"] == "ranks equal"
    back = InvestigationDoc.model_validate({"hypotheses": [d]}).hypotheses[0]
    assert back == e and back["verdict"] == "refuted"
    s = back.as_step(label="live investigation", on_fix="live server")
    assert (s.check, s.verdict, s.data, s.figure) == ("tp_sharding", "refuted", {"short": "ranks equal"},
                                                      "figures/investigate-tp_sharding.json")


def test_step_carries_the_expectation_and_the_data():
    s = _result().step(index=3, check="tp_sharding", label="msg 4525", on_fix="seeds", expect="refuted", figure=None)
    assert (s.index, s.as_expected, s.question) == (3, True, "Full width?")
    assert s.data == {"short": "ranks equal", "ranks": 2}
    assert s.evidence[1] == {"rank": 1, "rel_diff": 1.5e-7}
