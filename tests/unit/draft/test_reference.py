"""helpers.draft.reference on the shipped table: the schema loads and every figure is in its source's quote; a query
matches only rows whose known conditions equal its own (one differing known condition, or no shared name, and
nothing matches); the draft stage without a training log stays undecided and names the matching figure with its
source, or says the stage cannot be settled."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.draft.draft_stage import draft_stage
from helpers.draft.reference import (TABLE_PATH, Conditions, load_table, match_reference, model_name,
                                     no_match_words)
from helpers.errors import BadInput
from support import ROOT

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
LMSYS = "lmsys/sglang-EAGLE3-LLaMA3.1-Instruct-8B"
#: the conditions of SGLang's test/registered/spec/eagle/test_eagle3_basic.py
BASIC = dict(target_model=LLAMA, draft_model=LMSYS, steps=2, topk=1, draft_tokens=3, temperature=0.0,
             chat_template="target", engine="sglang")


def test_the_shipped_table_loads_and_each_figure_is_in_its_quote():
    t = load_table()
    assert 5 <= len(t.rows) <= 15
    for r in t.rows:
        assert f"{r.accept_length:g}" in r.source.quote, r.id
        assert r.source.url or (r.source.repo and r.source.path and (r.source.commit or r.source.release)), r.id
    assert TABLE_PATH.parent.name == "data"


def test_a_row_without_a_source_is_refused(tmp_path: Path):
    p = tmp_path / "t.yaml"
    p.write_text("rows:\n  - id: x\n    accept_length: 2.0\n    kind: reported\n"
                 "    conditions: {draft_model: a/b}\n    source: {quote: 'accept 2.0'}\n")
    with pytest.raises(BadInput, match="rows.0.source"):
        load_table(p)


def test_the_matching_query_returns_the_golden_row_with_its_source():
    ms = match_reference(Conditions(**BASIC))
    assert [m.reference.id for m in ms] == ["sglang-ci-eagle3-basic-mmlu"]
    m = ms[0]
    assert m.reference.accept_length == 2.26 and m.reference.kind == "lower_bound"
    assert m.reference.source.path == "test/registered/spec/eagle/test_eagle3_basic.py"
    assert m.reference.source.commit.startswith("46e1272ca2e0")
    assert set(m.matched) == set(BASIC) and m.unknown_in_query == ("benchmark",)
    assert "2.26" in m.text() and "test_eagle3_basic.py" in m.text() and "steps 2" in m.text()


def test_a_local_folder_name_matches_the_hub_id_but_another_owner_does_not():
    local = {**BASIC, "draft_model": "/models/sglang-EAGLE3-LLaMA3.1-Instruct-8B", "target_model": None}
    assert [m.reference.id for m in match_reference(Conditions(**local))] == ["sglang-ci-eagle3-basic-mmlu"]
    other = {**BASIC, "draft_model": "someone/sglang-EAGLE3-LLaMA3.1-Instruct-8B", "target_model": None}
    assert match_reference(Conditions(**other)) == []


@pytest.mark.parametrize("change", [{"topk": 2}, {"temperature": 0.7}, {"steps": 3}, {"engine": "vllm"},
                                    {"chat_template": "none"}])
def test_one_differing_known_condition_matches_nothing(change):
    assert match_reference(Conditions(**{**BASIC, **change})) == []


def test_settings_alone_match_nothing_and_unknowns_are_named():
    assert match_reference(Conditions(steps=5, topk=1, draft_tokens=6, temperature=0.0)) == []
    red = "RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3"
    ms = match_reference(Conditions(draft_model=red))
    assert [(m.reference.id, m.reference.accept_length) for m in ms] == [("vllm-ci-eagle3-llama3.1-8b-mtbench", 2.60)]
    assert "temperature" in ms[0].unknown_in_query and "target_model" in ms[0].unknown_in_query
    assert {"topk", "draft_tokens"} <= set(ms[0].unknown_in_reference)      # vLLM's golden test states neither
    assert match_reference(Conditions(draft_model=red, temperature=0.7)) == []


def test_model_name_reads_name_or_path_else_the_folder(tmp_path: Path):
    a = tmp_path / "ckpt"
    a.mkdir()
    (a / "config.json").write_text(json.dumps({"_name_or_path": LMSYS}))
    b = tmp_path / "sglang-EAGLE3-LLaMA3.1-Instruct-8B"
    b.mkdir()
    (b / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    assert model_name(a) == LMSYS and model_name(b) == b.name and model_name(None) is None


def test_the_draft_stage_without_a_log_names_the_published_figure_or_cannot_be_settled():
    q = Conditions(target_model=LLAMA, draft_model=LMSYS, steps=5, topk=1, draft_tokens=6)
    stage, loss = draft_stage(None, None, None, None, 5, reference=q)
    assert loss["decision"] == "undecided" and loss["delta"] is None
    assert [r["id"] for r in stage["reference"]] == ["sglang-0.5.23-eagle3base-fastapi",
                                                      "sglang-0.5.23-eagle3base-batch",
                                                      "sglang-0.5.23-eagle3base-gsm8k"]
    assert "above 1.6" in loss["why"] and "spec_eagle_fixture.py" in loss["why"] and "no training log" in loss["why"]
    stage, loss = draft_stage(None, None, None, None, 5, reference=Conditions(**{**q.model_dump(), "topk": 4}))
    assert stage["reference"] == [] and loss["decision"] == "undecided" and no_match_words() in loss["why"]
    stage, loss = draft_stage(None, None, None, None, 5)
    assert stage["reference"] == [] and no_match_words() in loss["settle"]["text"]


def test_the_offline_inputs_give_the_draft_stage_names_settings_and_engine():
    from helpers.draft.offline import OfflineInputs
    from helpers.draft.simulate import DraftSettings
    rows = {"rows": None, "kind": None, "path": None, "labels": "target"}
    off = OfflineInputs(draft=None, log=None, log_path=None, rows=rows, training=[], served=None, cost=0.1,
                        cost_source="given", names=("sglang-EAGLE3-LLaMA3.1-Instruct-8B", "Llama-3.1-8B-Instruct"))
    inp = off.budget_inputs(DraftSettings(5, 1, 6), engine="sglang")
    assert (inp.reference.steps, inp.reference.topk, inp.reference.draft_tokens, inp.reference.engine) == \
        (5, 1, 6, "sglang")
    assert len(match_reference(inp.reference)) == 3
    assert off.budget_inputs(DraftSettings(5, 1, 6), engine="other").reference.engine is None
    stage, loss = draft_stage(None, None, None, None, 5, reference=off.budget_inputs(DraftSettings(3, 1, 4)).reference)
    assert stage["reference"] == [] and no_match_words() in loss["why"]


def test_the_shipped_reference_draft_has_no_published_figure():
    root = ROOT / "env" / "models"
    q = Conditions(draft_model=model_name(root / "draft"), target_model=model_name(root / "llama_h64"),
                   steps=3, topk=1, draft_tokens=4)
    assert q.draft_model and match_reference(q) == []


def test_vllms_regression_golden_value_matches_a_vllm_query_only():
    q = dict(target_model=LLAMA, draft_model="RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3", steps=3,
             temperature=0.0, chat_template="target")
    ms = match_reference(Conditions(**q, engine="vllm"))
    assert [(m.reference.id, m.reference.accept_length, m.reference.rtol) for m in ms] == \
        [("vllm-ci-eagle3-llama3.1-8b-mtbench", 2.6, 0.05)]
    assert ms[0].reference.source.commit.startswith("51dacb530751") and "+/- 5%" in ms[0].text()
    assert match_reference(Conditions(**q, engine="sglang")) == []
