"""The requests file (helpers.acceptance.workload) and the requests_accept_less decision
(helpers.investigation.workload) on real counters.

``tests/data/workload/counters.csv``: per-request ``/generate`` counters (completion_tokens, spec_verify_ct, ...) of
two ``measure --requests`` runs on the embedded SGLang 0.5.23 server (TP 1, the trained reference target and draft,
EAGLE3 3/1/4, 2026-12-06): ``junk/*`` the 20 requests of ``junk_requests.jsonl`` (non-ASCII character soup, temperature
1) against 20 bundled training-like prompts (greedy), ``small/*`` the 4 requests of ``small_requests.jsonl`` against
10 training-like prompts, 24 tokens each.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from helpers.acceptance.workload import (CHECK_ONLY, describe, differences, load_requests, parse_request,
                                         render_chat, training_is_chat, unpaired_loss)
from helpers.draft.decide import threshold
from helpers.errors import BadInput
from helpers.investigation.workload import workload_decision, workload_finding
from support import ROOT

DATA = ROOT / "tests" / "data" / "workload"
TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from support.tinymodels import build_tokenizer
    tok = build_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.chat_template = TEMPLATE
    return tok


def _write(tmp_path: Path, lines) -> Path:
    p = tmp_path / "requests.jsonl"
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_each_kind_maps_to_one_request_with_its_own_sampling(tmp_path, chat_tok):
    p = _write(tmp_path, [
        {"model": "m", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a list"}],
         "temperature": 0.7, "max_completion_tokens": 12, "top_k": 5, "stream": False, "tools": []},
        {"prompt": "Return the items", "max_tokens": 8, "top_p": 0.9, "stop": ["\n"], "seed": 3},
        {"prompt": [0, 45, 67, 89]},
        {"text": "The value", "sampling_params": {"temperature": 0, "max_new_tokens": 10, "json_schema": "{}"}},
        "",
        {"input_ids": [0, 12, 13], "sampling_params": {"min_new_tokens": 2}},
    ])
    reqs = load_requests(p, tokenizer=chat_tok, default_max_new_tokens=32, gen_defaults={"top_p": 0.8})
    assert [r.kind for r in reqs] == ["chat", "completions", "completions", "generate", "generate"]
    assert [r.line for r in reqs] == [1, 2, 3, 4, 6] and [r.prompt.id for r in reqs][:2] == ["L1", "L2"]
    chat, comp, ids, gen, gen_ids = reqs
    # chat: rendered to token ids by the template, the generation prompt last, one BOS (no second one added)
    want = chat_tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "a list"}], tokenize=True,
                                        add_generation_prompt=True, return_dict=False)
    assert list(chat.prompt.input_ids) == list(want) and chat.chat_template
    text = chat_tok.decode(chat.prompt.input_ids)
    assert text.startswith("<s>system\nBe brief.</s>") and text.endswith("<s>assistant\n")
    assert chat.sampling == {"temperature": 0.7, "max_new_tokens": 12, "top_k": 5, "top_p": 0.8}
    assert chat.ignored == ("tools",)
    # completions: OpenAI names to SGLang's; temperature / max tokens from CompletionRequest's defaults when absent
    assert comp.prompt.text == "Return the items" and not comp.chat_template
    assert comp.sampling == {"max_new_tokens": 8, "top_p": 0.9, "stop": ["\n"], "sampling_seed": 3,
                             "temperature": 1.0}
    assert ids.prompt.input_ids == (0, 45, 67, 89) and ids.sampling == {"temperature": 1.0, "max_new_tokens": 16}
    # /generate: sampling_params as given (SamplingParams' defaults filled), unknown ones listed as not sent
    assert gen.sampling == {"temperature": 0, "max_new_tokens": 10} and gen.ignored == ("sampling_params.json_schema",)
    assert gen_ids.sampling == {"min_new_tokens": 2, "temperature": 1.0, "max_new_tokens": 128}
    d = describe(reqs)
    assert d["kinds"] == {"chat": 1, "completions": 2, "generate": 2} and d["chat_template"] == pytest.approx(0.2)
    assert d["temperature"] == {"median": 1.0, "min": 0.0, "max": 1.0}
    assert d["max_new_tokens"]["median"] == 12.0


@pytest.mark.parametrize("line, says", [
    ("{not json", "line 2 is not JSON"),
    ('{"model": "m"}', "line 2: has none of messages / prompt / text / input_ids"),
    ('{"prompt": [[1, 2], [3]]}', "line 2: prompt is a batch"),
    ('{"prompt": "x", "max_tokens": 0}', "line 2: max tokens is 0; expected an integer >= 1"),
    ('{"prompt": "x", "temperature": -1}', "line 2: temperature is -1"),
    ('{"input_ids": [1, 2.5]}', "line 2: input_ids[1] is 2.5"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: is a chat body but no tokenizer"),
    ('[1, 2]', "line 2: is a JSON list, not an object"),
])
def test_a_bad_line_is_one_line_naming_file_and_line(tmp_path, line, says):
    p = _write(tmp_path, ['{"prompt": "fine"}', line])
    with pytest.raises(BadInput) as e:
        load_requests(p)
    msg = str(e.value)
    assert str(p) in msg and says in msg and "\n" not in msg
    if "not JSON" not in says:
        assert "expected one JSON object per line" in msg


def test_empty_file_and_template_less_tokenizer_are_refused(tmp_path):
    from support.tinymodels import build_tokenizer
    with pytest.raises(BadInput, match="the requests file is empty"):
        load_requests(_write(tmp_path, ["", "  "]))
    plain = build_tokenizer(tmp_path / "plain")
    with pytest.raises(BadInput, match="line 1: the target tokenizer has no chat template"):
        load_requests(_write(tmp_path, ['{"messages": [{"role": "user", "content": "hi"}]}']), tokenizer=plain)
    # the check before any work parses every line without rendering the chat bodies
    assert [r.kind for r in load_requests(_write(tmp_path, ['{"messages": [{"role": "user", "content": "hi"}]}']),
                                          tokenizer=CHECK_ONLY)] == ["chat"]


def test_training_is_chat_reads_the_generation_prompt_before_the_loss_mask(chat_tok):
    chat_ids = render_chat(chat_tok, [{"role": "user", "content": "sort the list"}])
    answer = chat_tok("the list is sorted", add_special_tokens=False)["input_ids"]
    chat_sample = {"input_ids": list(chat_ids) + answer, "loss_mask": [0] * len(chat_ids) + [1] * len(answer)}
    raw_ids = chat_tok("sort the list")["input_ids"]
    raw_sample = {"input_ids": raw_ids + answer, "loss_mask": [0] * len(raw_ids) + [1] * len(answer)}
    assert training_is_chat(chat_tok, [chat_sample, chat_sample, raw_sample]) is True
    assert training_is_chat(chat_tok, [raw_sample, raw_sample, chat_sample]) is False
    assert training_is_chat(chat_tok, [{"input_ids": raw_ids}]) is None          # no loss mask: cannot tell


def _counters(name: str) -> pd.DataFrame:
    df = pd.read_csv(DATA / "counters.csv")
    df = df[df["set"] == name].reset_index(drop=True)
    return df.assign(error=None, has_spec=True)


def test_unpaired_loss_counts_on_the_real_junk_requests():
    user, ref = _counters("junk/requests"), _counters("junk/training-like")
    loss = unpaired_loss(ref, user, n_boot=2000, seed=0)
    al_ref = ref["completion_tokens"].sum() / ref["verify_ct"].sum()
    al_user = user["completion_tokens"].sum() / user["verify_ct"].sum()
    assert loss["ref_accept_length"] == pytest.approx(al_ref) and loss["user_accept_length"] == pytest.approx(al_user)
    assert loss["delta"] == pytest.approx(al_ref - al_user) and loss["n_user"] == 20 and loss["n_ref"] == 20
    lo, hi = loss["ci"]
    assert lo < loss["delta"] < hi
    dec = workload_decision(loss)
    assert dec["threshold"] == pytest.approx(threshold(al_ref))
    assert dec["decision"] == "counts"          # 1.99 vs 2.55 tokens per verify step, CI beyond 0
    reqs = load_requests(DATA / "junk_requests.jsonl")
    du = describe(reqs, user)
    dr = describe([], ref) | {"temperature": {"median": 0.0, "min": 0.0, "max": 0.0}, "chat_template": 0.0,
                              "non_ascii": 0.0}
    diffs = differences(du, dr)
    assert any(d.startswith("temperature median 1 vs 0") for d in diffs)
    assert any(d.startswith("prompt length (tokens) median") for d in diffs)
    assert any(d.startswith("non-ASCII letters") for d in diffs)
    f = workload_finding(loss, dec, diffs, user=du, ref=dr)
    assert f["kind"] == "requests_accept_less" and f["evidence"]["decision"] == "counts"
    assert f"{al_user:.2f}" in f["detail"] and "not proven causes" in f["detail"]
    # the opening sentence of an investigation with no wiring fault tells the loss on the user's requests too
    from helpers.investigation.live import sentence
    from helpers.records import Finding, InvestigationDoc
    doc = InvestigationDoc(verdict="mismatch", findings=[Finding.model_validate(f)], measured={"not_measured": "x"})
    text = sentence(doc)
    assert text.startswith("No wiring fault, but acceptance is lost elsewhere") and f["detail"] in text, text
    # ... and so does the postmortem's first screen: the loss is what is wrong, and no fix is claimed
    from helpers.investigation.story import headline_parts
    parts = {p["label"]: p for p in headline_parts(doc)}
    assert parts["What is wrong"]["text"].startswith("your requests accept materially less") and \
        f"{al_user:.2f}" in parts["What is wrong"]["text"], parts
    assert parts["The fix"]["text"].startswith("no fix the tool can apply: the loss is on your requests"), parts


def test_few_requests_are_undecided_and_identical_sets_clear():
    loss = unpaired_loss(_counters("small/training-like"), _counters("small/requests"), n_boot=1000)
    dec = workload_decision(loss)
    assert loss["n_user"] == 4 and dec["decision"] == "undecided"     # below SMALL_N: never cleared
    assert dec["settle"]["n"] is not None and dec["settle"]["n"] > 4
    f = workload_finding(loss, dec, [], user={}, ref={})
    assert f["evidence"]["decision"] == "undecided"
    # the same 80 requests on both sides: no loss, and a CI narrow enough to rule a material one out
    ref = pd.concat([_counters("junk/training-like")] * 4, ignore_index=True)
    same = unpaired_loss(ref, ref.copy(), n_boot=2000)
    assert same["delta"] == 0.0
    d2 = workload_decision(same)
    assert d2["decision"] == "clear" and d2["ci"][1] < d2["threshold"]
    assert workload_finding(same, d2, [], user={}, ref={}) is None
    # a set without spec counters is not compared (NaN), and the decision says undecided, not clear
    none = unpaired_loss(ref, ref.assign(has_spec=False))
    assert np.isnan(none["delta"]) and workload_decision(none)["decision"] == "undecided"
