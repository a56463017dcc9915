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
    ('{"prompt": "x", "max_tokens": 0}', "line 2: max_tokens is number 0; expected an integer from 1 to 1,000,000"),
    ('{"prompt": "x", "temperature": -1}', "line 2: temperature is number -1"),
    ('{"input_ids": [1, 2.5]}', "line 2: input_ids[1] is 2.5"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 2: is a chat body but no tokenizer"),
    ('[1, 2]', "line 2: is a JSON array, not an object"),
    # sampling params with SGLang 0.5.23's SamplingParams.verify bounds, named as the body names them
    ('{"prompt": "x", "top_k": "5"}', "line 2: top_k is string '5'; expected -1 (the whole vocabulary) or an integer"),
    ('{"prompt": "x", "top_k": -5}', "line 2: top_k is number -5"),
    ('{"prompt": "x", "top_k": 0}', "line 2: top_k is number 0"),
    ('{"prompt": "x", "top_p": "high"}', "line 2: top_p is string 'high'; expected a number in (0, 1]"),
    ('{"prompt": "x", "top_p": 0}', "line 2: top_p is number 0; expected a number in (0, 1]"),
    ('{"prompt": "x", "top_p": 1.5}', "line 2: top_p is number 1.5"),
    ('{"prompt": "x", "min_p": 2}', "line 2: min_p is number 2; expected a number in [0, 1]"),
    ('{"prompt": "x", "presence_penalty": 3}', "line 2: presence_penalty is number 3; expected a number in [-2, 2]"),
    ('{"prompt": "x", "repetition_penalty": 0}', "line 2: repetition_penalty is number 0; expected a number in (0, 2]"),
    ('{"prompt": "x", "stop": 5}', "line 2: stop is number 5; expected a string or a list of at most 32 strings"),
    ('{"prompt": "x", "stop": {"a": 1}}', "line 2: stop is object"),
    ('{"prompt": "x", "stop": [["x"]]}', "line 2: stop is array"),
    ('{"prompt": "x", "stop": ' + json.dumps(["s"] * 33) + '}', "line 2: stop is array"),
    ('{"prompt": "x", "stop_token_ids": [-1, "a"]}', "line 2: stop_token_ids is array [-1, 'a']; expected a list"),
    ('{"prompt": "x", "stop_token_ids": 5}', "line 2: stop_token_ids is number 5"),
    ('{"prompt": "x", "ignore_eos": "yes"}', "line 2: ignore_eos is string 'yes'; expected true or false"),
    ('{"text": "x", "sampling_params": {"no_stop_trim": 1}}', "line 2: sampling_params.no_stop_trim is number 1"),
    ('{"prompt": "x", "seed": 9223372036854775808}', "line 2: seed is number 9223372036854775808; expected an "
                                                     "integer in [-2**63, 2**63 - 1]"),
    ('{"prompt": "x", "seed": 1.5}', "line 2: seed is number 1.5"),
    ('{"text": "x", "sampling_params": {"sampling_seed": "7"}}', "line 2: sampling_params.sampling_seed is string"),
    ('{"prompt": "x", "logit_bias": "x"}', "line 2: logit_bias is string 'x'; expected an object mapping token ids"),
    ('{"prompt": "x", "logit_bias": {"abc": 1}}', "line 2: logit_bias is object"),
    ('{"prompt": "x", "logit_bias": {"-3": 1}}', "line 2: logit_bias is object"),
    ('{"prompt": "x", "logit_bias": {"3": "big"}}', "line 2: logit_bias is object"),
    ('{"prompt": "x", "max_tokens": 8, "min_tokens": 100}', "line 2: min_tokens is number 100; expected an integer "
                                                            "from 0 to the max tokens (8)"),
    ('{"prompt": "x", "max_tokens": 1000000000}', "line 2: max_tokens is number 1000000000; expected an integer "
                                                  "from 1 to 1,000,000"),
    ('{"prompt": "x", "max_tokens": 16.0}', "line 2: max_tokens is number 16.0"),
    ('{"text": "x", "sampling_params": {"max_new_tokens": "8"}}', "line 2: sampling_params.max_new_tokens is "
                                                                   "string '8'"),
    # odd bodies SGLang refuses or that the tool would silently misread
    ('{"text": "x", "input_ids": [1, 2]}', "line 2: gives both text and input_ids"),
    ('{"text": "x", "sampling_params": []}', "line 2: sampling_params is a JSON array; expected an object"),
    ('{"text": "x", "sampling_params": "t=0"}', "line 2: sampling_params is a JSON string; expected an object"),
    ('{"prompt": "x", "n": "many"}', "line 2: n is string 'many'; expected a positive integer"),
    ('{"prompt": "x", "n": 0}', "line 2: n is number 0; expected a positive integer"),
    ('{"text": "x", "sampling_params": {"n": -1}}', "line 2: sampling_params.n is number -1"),
    # a lone surrogate: valid JSON, no Unicode text (UnicodeEncodeError at send time before)
    ('{"prompt": "\\ud800x"}', "line 2: prompt holds a lone surrogate"),
    ('{"messages": [{"role": "user", "content": "\\udfff"}]}', "line 2: messages holds a lone surrogate"),
    # token ids: the position named (prompt as a list of ids too)
    ('{"prompt": [1, -2]}', "line 2: prompt[1] is -2"),
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
    assert "verify_sampling_params_wrong" not in f["detail"] and "verify_sampling" not in f["evidence"]
    # on a server whose own check shows its verify rows use other sampling values (the vLLM adapter's rule on a
    # failed check), the temperature's share is not put on the requests alone
    from helpers.engines.vllm import VLLMAdapter
    chk = {"function": "f", "fields": {"temperature": {"sent": [0.5], "expanded": [0.0], "expected": [0.5],
                                                       "equal": False}}, "equal": False}
    fault = VLLMAdapter().verify_sampling_fault({"version": "0.32.0", "device": "cpu", "verify_sampling": chk})
    g = workload_finding(loss, dec, diffs, user=du, ref=dr, verify_fault=fault)
    assert g["detail"].startswith(f["detail"]) and "the engine's as well" in g["detail"]
    assert g["evidence"]["verify_sampling"]["equal"] is False
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


# -- the requests file's hardening (breaker's B1-B15): every bad line exit 2 naming file, line and field ------------

def test_token_ids_at_or_beyond_the_vocab_size_are_refused_naming_the_position(tmp_path):
    from helpers.acceptance.workload import require_vocab, vocab_size_of
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
         "vocab_size": 320}))
    vocab = vocab_size_of(tmp_path / "target")
    assert vocab == 320
    for line, says in (('{"input_ids": [1, 2147483647]}', "line 2: input_ids[1] is 2147483647; expected a token id "
                                                           "from 0 to 319 (the target's vocab_size 320)"),
                       ('{"prompt": [5, 6, 320]}', "line 2: prompt[2] is 320; expected a token id from 0 to 319"),
                       ('{"prompt": "x", "stop_token_ids": [320]}', "line 2: stop_token_ids is array [320]"),
                       ('{"prompt": "x", "logit_bias": {"320": 1.0}}', "line 2: logit_bias is object")):
        p = _write(tmp_path, ['{"input_ids": [0, 319], "sampling_params": {"stop_token_ids": [319], '
                              '"logit_bias": {"319": -1}}}', line])
        with pytest.raises(BadInput) as e:
            load_requests(p, vocab_size=vocab)
        assert str(p) in str(e.value) and says in str(e.value), str(e.value)
    # the first line alone passes (the last id of the vocabulary is fine); without a vocab size no id is refused
    ok = load_requests(_write(tmp_path, ['{"input_ids": [0, 319]}', '{"prompt": "text"}']), vocab_size=320)
    assert ok[0].prompt.input_ids == (0, 319)
    # unknown vocab size: token-id bodies refused (never sent unchecked), text bodies pass
    with pytest.raises(BadInput, match=r"line 1 gives token ids.*vocab_size.*unknown.*--tokenizer"):
        require_vocab(ok, None, "no tokenizer", "r.jsonl")
    require_vocab(ok[1:], None, "no tokenizer", "r.jsonl")
    require_vocab(ok, 320, "", "r.jsonl")


def test_vocab_size_falls_back_to_the_tokenizer_length(tmp_path, chat_tok):
    from helpers.acceptance.workload import vocab_size_of
    assert vocab_size_of(tmp_path, chat_tok) == len(chat_tok) > 0       # no config.json there
    assert vocab_size_of(tmp_path, lambda: chat_tok) == len(chat_tok)   # a loader is called only then
    assert vocab_size_of(None) is None and vocab_size_of(tmp_path) is None

    def missing():
        raise BadInput("no tokenizer readable here")
    assert vocab_size_of(tmp_path, missing) is None


def test_a_chat_template_error_is_bad_input_naming_the_line_and_messages(tmp_path):
    from support.tinymodels import build_tokenizer
    tok = build_tokenizer(tmp_path / "strict")
    tok.chat_template = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                         "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                         "{{ m['role'] + '\n' + m['content'].strip() }}{% endfor %}")
    good = '{"messages": [{"role": "user", "content": "hi"}]}'
    for line, what in (('{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}',
                        "TemplateError: Conversation roles must alternate"),
                       ('{"messages": [{"role": "user"}]}', "UndefinedError")):
        p = _write(tmp_path, [good, line])
        with pytest.raises(BadInput) as e:
            load_requests(p, tokenizer=tok)
        msg = str(e.value)
        assert str(p) in msg and "line 2: messages: the tokenizer's chat template cannot render them" in msg, msg
        assert what in msg and "\n" not in msg
    assert len(load_requests(_write(tmp_path, [good]), tokenizer=tok)[0].prompt.input_ids) > 0


def test_line_separators_inside_strings_crlf_and_a_bom_parse(tmp_path):
    p = tmp_path / "odd.jsonl"
    rows = ['{"prompt": "a\u2028b", "max_tokens": 4}', '{"prompt": "c\u0085d\u2029e"}', "",
            '{"prompt": "last"}']
    p.write_bytes(("\ufeff" + "\r\n".join(rows) + "\r\n").encode("utf-8"))
    reqs = load_requests(p)
    assert [r.line for r in reqs] == [1, 2, 4]
    assert [r.prompt.text for r in reqs] == ["a\u2028b", "c\u0085d\u2029e", "last"]
    assert reqs[0].sampling["max_new_tokens"] == 4
    # a bad line after them is still named by its own number
    p.write_bytes(("\ufeff" + "\n".join(rows + ['{"prompt": "x", "top_p": 0}'])).encode("utf-8"))
    with pytest.raises(BadInput, match="line 5: top_p is number 0"):
        load_requests(p)


def test_ignored_keys_are_escaped_and_describe_takes_odd_values(tmp_path):
    from helpers.acceptance.prompts import Prompt
    from helpers.acceptance.workload import WorkloadRequest
    key = "\x1b]0;TITLE\x07\x1b[2J"
    r = load_requests(_write(tmp_path, [json.dumps({"prompt": "x", key: 1, "ok_key": 2})]))[0]
    assert r.ignored == ("\\x1b]0;TITLE\\x07\\x1b[2J", "ok_key")
    assert not any(ord(c) < 32 for k in r.ignored for c in k)
    # describe never fails on values no check passed (a WorkloadRequest built by hand)
    odd = [WorkloadRequest(prompt=Prompt(id="L1", text="x"), sampling={"temperature": "hot", "top_k": "5",
                                                                       "top_p": None, "max_new_tokens": True},
                           kind="completions", line=1),
           WorkloadRequest(prompt=Prompt(id="L2", text="y"), sampling={"temperature": 0.5, "top_k": 7,
                                                                       "max_new_tokens": 9}, kind="completions",
                           line=2)]
    d = describe(odd)
    assert d["temperature"] == {"median": 0.5, "min": 0.5, "max": 0.5}
    assert d["top_k"]["median"] == 7.0 and d["max_new_tokens"]["median"] == 9.0 and d["top_p"] is None


def test_valid_sampling_params_pass_as_given():
    r = parse_request({"prompt": "x", "top_k": -1, "top_p": 1, "min_p": 0, "stop": "END", "stop_token_ids": [2],
                       "ignore_eos": True, "seed": -(2 ** 63), "logit_bias": {"5": -100}, "min_tokens": 16,
                       "max_tokens": 16, "presence_penalty": -2, "repetition_penalty": 2, "n": 1}, 1, vocab_size=8)
    assert r.sampling == {"top_k": -1, "top_p": 1, "min_p": 0, "stop": "END", "stop_token_ids": [2],
                          "ignore_eos": True, "sampling_seed": -(2 ** 63), "logit_bias": {"5": -100},
                          "min_new_tokens": 16, "max_new_tokens": 16, "presence_penalty": -2,
                          "repetition_penalty": 2, "temperature": 1.0}
    # None inside sampling_params is SGLang's default (SamplingParams.__post_init__), not an error
    g = parse_request({"text": "x", "sampling_params": {"top_k": None, "stop": None}}, 1)
    assert g.sampling == {"temperature": 1.0, "max_new_tokens": 128}


def test_investigate_checks_chat_bodies_with_the_given_tokenizer_before_any_request(tmp_path, capsys):
    """B7: a tokenizer without a chat template and a chat body: exit 2 up front (the URL is closed: nothing could
    have been sent), not at the end of the investigation."""
    from helpers.__main__ import main
    from support.fakeserver import free_port
    from support.tinymodels import build_tokenizer
    build_tokenizer(tmp_path / "plain")
    p = _write(tmp_path, ['{"prompt": "fine"}', '{"messages": [{"role": "user", "content": "hi"}]}'])
    rc = main(["investigate", "--url", f"http://127.0.0.1:{free_port()}", "--training",
               str(ROOT / "env" / "models" / "data" / "sample"), "--requests", str(p), "--tokenizer",
               str(tmp_path / "plain"), "--out", str(tmp_path / "out"), "--timeout", "30"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{p}: line 2: the target tokenizer has no chat template" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


class _NoRequests:
    """A client whose /server_info names ``model_path``; any other call fails the test (a request was sent)."""

    def __init__(self, model_path=None):
        self.info = {"model_path": str(model_path)} if model_path else {}

    def server_info(self, refresh=False):
        return self.info

    def __getattr__(self, name):
        raise AssertionError(f"a request was sent ({name}) before the requests file was checked")


def _target(tmp_path, vocab=320) -> Path:
    from support.tinymodels import build_tokenizer
    d = tmp_path / "target"
    build_tokenizer(d)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                               "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": vocab}))
    return d


def test_measure_refuses_an_out_of_vocab_id_before_any_request(tmp_path):
    """B1: the ids are checked against the vocab_size of the server's model path (read here) before compare_workload
    sends anything; with no tokenizer / config known, token-id bodies are refused naming --tokenizer."""
    from helpers.cli.measure import _workload, build_parser
    target = _target(tmp_path)
    p = _write(tmp_path, ['{"prompt": "fine"}', '{"input_ids": [1, 2147483647]}'])
    args = build_parser().parse_args(["--url", "http://127.0.0.1:9", "--requests", str(p), "--no-save", "--quiet"])
    with pytest.raises(BadInput, match=r"line 2: input_ids\[1\] is 2147483647; expected a token id from 0 to 319 "
                                       r"\(the target's vocab_size 320\)"):
        _workload(args, _NoRequests(target), None, None, tmp_path, None, lambda *_: None)
    with pytest.raises(BadInput, match=r"line 2 gives token ids.*unknown.*--tokenizer"):
        _workload(args, _NoRequests(None), None, None, tmp_path, None, lambda *_: None)


def test_investigate_reads_the_requests_file_right_after_attach(tmp_path):
    """B7 without --tokenizer: the investigation's 'requests' stage (right after attach, before capture) renders the
    chat bodies with the tokenizer the workload stage uses and checks the ids against the target's vocab_size."""
    from types import SimpleNamespace

    from helpers.investigation.live import STAGES
    from helpers.investigation.workload import workload_check
    assert [n for n, _ in STAGES][:4] == ["attach", "requests", "training data", "capture"]
    target = _target(tmp_path)

    import httpx

    from helpers.engines.sglang import SGLangAdapter
    from helpers.server.client import SGLangClient
    info = {"version": "0.5.23", "tp_size": 1, "model_path": str(target), "speculative_algorithm": "EAGLE3",
            "speculative_eagle_topk": 1, "speculative_num_steps": 3, "speculative_num_draft_tokens": 4}
    models = {"object": "list", "data": [{"id": "t", "owned_by": "sglang", "max_model_len": 160}]}
    client = SGLangClient("http://sglang.test:1", retries=0, transport=httpx.MockTransport(
        lambda q: httpx.Response(200, json=info if q.url.path == "/server_info" else models)))

    def run(lines):
        p = _write(tmp_path, lines)
        r = SimpleNamespace(req=SimpleNamespace(requests=(p, None), live_measure=True, max_new_tokens=8),
                            att=SimpleNamespace(info={}, target_dir=target), workload=None,
                            adapter=SGLangAdapter(), client=client, doc=SimpleNamespace(notes=[]))
        workload_check(r)
        return r.workload
    # past the server's 160-token context with SGLang's 4 reserved draft slots: refused as the server would (HTTP 400)
    with pytest.raises(BadInput, match=r"line 2: 20 prompt tokens \+ max_new_tokens 137 \+ 4 slots the server "
                                       r"reserves = 161 tokens, past the server's context of 160 tokens"):
        run(['{"input_ids": [0, 319]}', json.dumps({"prompt": list(range(20)), "max_tokens": 137})])
    run([json.dumps({"prompt": list(range(20)), "max_tokens": 136})])          # 20 + 4 + 136 = 160: fits
    with pytest.raises(BadInput, match=r"line 1: input_ids\[0\] is 320; expected a token id from 0 to 319"):
        run(['{"input_ids": [320]}'])
    with pytest.raises(BadInput, match="line 2: the target tokenizer has no chat template"):
        run(['{"prompt": "fine"}', '{"messages": [{"role": "user", "content": "hi"}]}'])
    w = run(['{"input_ids": [0, 319]}', '{"prompt": "fine", "top_k": 5}'])
    assert w.vocab_size == 320 and [q.line for q in w.requests] == [1, 2] and w.tok_dir == target


def test_investigate_without_training_checks_the_requests_file_before_plan_identification(tmp_path, monkeypatch):
    """Without --training the layer plan is identified on the server's own continuations (requests): a bad
    --requests line stops the run first, so identification sends nothing (docs/workload.md: a bad line stops the
    command before any request). The server is faked: attach returns the shipped reference pair, and the adapter's
    continuations (identification's only requests) fail the test when called."""
    import httpx

    from helpers.engines.sglang import SGLangAdapter
    from helpers.investigation import live
    from helpers.investigation.attach import Attachment
    from helpers.server.client import SGLangClient

    target, draft = ROOT / "env" / "models" / "target", ROOT / "env" / "models" / "draft"
    sent: list = []

    class _Adapter(SGLangAdapter):
        def continuations(self, client, prompts, **kw):
            sent.append(len(prompts))
            raise AssertionError("plan identification sent its requests before the --requests file was checked")

    def connect(r):
        r.adapter = _Adapter()
        r.client = SGLangClient("http://sglang.test:1", retries=0, transport=httpx.MockTransport(
            lambda q: httpx.Response(500, json={"error": "no request expected"})))

    att = Attachment(url="http://sglang.test:1", version="0.5.23", tp=1, algorithm="EAGLE3", spec={},
                     served_draft=str(draft), served_target=str(target), draft_dir=draft, draft_source="server",
                     target_dir=target, target_source="server")
    monkeypatch.setattr(live, "_connect", connect)
    monkeypatch.setattr(live, "attach", lambda *a, **k: att)
    p = _write(tmp_path, ['{"prompt": "fine"}', '{"input_ids": [1, 4096]}'])
    with pytest.raises(BadInput, match=r"line 2: input_ids\[1\] is 4096; expected a token id from 0 to 4095"):
        live.investigate("http://sglang.test:1", training=None, run_dir=tmp_path / "run", requests=p, timeout=60)
    assert sent == []
    doc = json.loads((tmp_path / "run" / "investigation.json").read_text())
    assert "'requests' stage" in " ".join(doc["notes"]) and "plan identification" not in doc["timings"]
