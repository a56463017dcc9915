"""A requests file's request past the server's context (``--requests``): refused before any request, in one line
naming the file, the line and the lengths, where the engine refuses it (SGLang 0.5.23 without
--allow-auto-truncate: HTTP 400 from TokenizerManager._validate_one_request, seen on the embedded server as
"... total of 548 tokens: 484 tokens from the input messages and 64 tokens for the completion"), its max_new_tokens
cut where the engine cuts it (vLLM 0.32.0, SGLang with --allow-auto-truncate). The engines' rules are read from
their answers (httpx.MockTransport plays SGLang's /server_info and /v1/models as the embedded server answers them)."""
from __future__ import annotations

import json

import httpx
import pytest

from helpers.acceptance.workload import fit_context, load_requests
from helpers.engines.base import ContextRule
from helpers.engines.sglang import SGLangAdapter
from helpers.errors import BadInput
from helpers.server.client import SGLangClient

#: the embedded server's answers (EAGLE3, topk 1, 3 steps, 4 draft tokens; the tiny target's 512 positions)
INFO = {"version": "0.5.23", "tp_size": 2, "model_path": "/m/target", "speculative_algorithm": "EAGLE3",
        "speculative_eagle_topk": 1, "speculative_num_steps": 3, "speculative_num_draft_tokens": 4,
        "allow_auto_truncate": False, "context_length": None}
MODELS = {"object": "list", "data": [{"id": "/m/target", "object": "model", "owned_by": "sglang",
                                      "max_model_len": 512}]}


def _sglang(info: dict) -> SGLangClient:
    def handler(req: httpx.Request) -> httpx.Response:
        if req.url.path == "/server_info":
            return httpx.Response(200, json=info)
        if req.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        return httpx.Response(404, json={"detail": "Not Found"})
    return SGLangClient("http://sglang.test:1", transport=httpx.MockTransport(handler), retries=0)


def _file(tmp_path, lines) -> object:
    p = tmp_path / "requests.jsonl"
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return p


def test_sglang_rule_is_read_from_the_server_reserved_slots_included():
    rule = SGLangAdapter().context_rule(_sglang(INFO))
    assert (rule.tokens, rule.reserved, rule.max_prompt, rule.clamps) == (512, 4, 507, False)
    assert rule.source.endswith("TokenizerManager._validate_one_request")
    auto = SGLangAdapter().context_rule(_sglang({**INFO, "allow_auto_truncate": True, "speculative_algorithm": None}))
    assert (auto.tokens, auto.reserved, auto.max_prompt, auto.clamps) == (512, 0, 511, True)


def test_a_request_past_the_context_is_one_line_naming_file_line_and_lengths(tmp_path):
    ids = [1] + [100 + i % 300 for i in range(479)]                   # 480 prompt tokens, as on the live server
    path = _file(tmp_path, [{"prompt": [5, 6, 7], "max_tokens": 16}, {"prompt": ids, "max_tokens": 64}])
    reqs = load_requests(path, vocab_size=32000)
    rule = SGLangAdapter().context_rule(_sglang(INFO))
    with pytest.raises(BadInput) as err:
        fit_context(reqs, rule, path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "line 2:" in msg
    assert "480 prompt tokens + max_new_tokens 64 + 4 slots the server reserves = 548 tokens" in msg
    assert "context of 512 tokens" in msg and "expected max_new_tokens <= 28" in msg
    # 28 new tokens fit exactly (480 + 4 + 28 = 512): the engine's own bound, not one off
    ok = load_requests(_file(tmp_path, [{"prompt": ids, "max_tokens": 28}]), vocab_size=32000)
    assert fit_context(ok, rule, path) == [] and ok[0].sampling["max_new_tokens"] == 28


def test_a_clamping_engine_gets_max_new_tokens_cut_with_a_note(tmp_path):
    ids = list(range(3, 3 + 500))
    path = _file(tmp_path, [{"prompt": ids, "max_tokens": 64}, {"prompt": [5, 6], "max_tokens": 64}])
    reqs = load_requests(path, vocab_size=32000)
    vllm = ContextRule(tokens=512, reserved=0, max_prompt=512, clamps=True,
                       source="vllm/entrypoints/serve/utils/api_utils.py::get_max_tokens")
    notes = fit_context(reqs, vllm, path)
    assert [q.sampling["max_new_tokens"] for q in reqs] == [12, 64]
    assert len(notes) == 1 and "line 1: max_new_tokens 64 cut to 12 (500 prompt tokens" in notes[0]


def test_a_prompt_longer_than_the_context_is_refused_whatever_the_rule(tmp_path):
    path = _file(tmp_path, [{"prompt": list(range(3, 3 + 600)), "max_tokens": 1}])
    reqs = load_requests(path, vocab_size=32000)
    rule = ContextRule(tokens=512, reserved=0, max_prompt=512, clamps=True, source="get_max_tokens")
    with pytest.raises(BadInput, match=r"line 1: the prompt is 600 tokens, longer than the server's context of 512"):
        fit_context(reqs, rule, path)


# --- the context's edges (breaker's inputs) -----------------------------------------------------------------------

from pathlib import Path  # noqa: E402

from helpers.acceptance.workload import CHECK_ONLY  # noqa: E402
from helpers.engines.vllm import VLLMAdapter  # noqa: E402
from helpers.engines.vllm_answers import meta_info  # noqa: E402
from helpers.server.protocol import MetaInfo  # noqa: E402

#: answers of the embedded vLLM 0.32.0 server (EAGLE3, num_speculative_tokens 3, max_model_len 512), recorded
VLLM_ANSWERS = json.loads((Path(__file__).parents[2] / "data" / "workload" / "vllm_context_answers.json").read_text())
#: what VLLMClient._spec_limits gives on that server
VLLM_LIMITS = {"num_steps": 3, "num_draft_tokens": 4, "proposed_exact": False, "histogram_bins": 4}
#: the embedded SGLang server's /server_info (TP 2): the scheduler's init info laid over the server args
SGLANG_SCHED = {**INFO, "max_total_num_tokens": 8192, "max_req_input_len": 506}


class _VLLMInfo:
    """A stand-in for VLLMClient.server_info: the embedded vLLM server's recorded context length."""

    def server_info(self):
        return {"context_length": 512, "version": "0.32.0"}


def test_vllm_last_token_at_the_context_is_a_plain_decode_step_not_a_verify_step():
    # 400 + 112 = 512 and 490 + 22 = 512 reach the context: the last step schedules no draft (per_step_drafted ends
    # 2, 1: the scheduler's max_model_len cap), so 1 + verify steps + accepted is one short of the completion
    metas = {k: MetaInfo.model_validate(meta_info(a)) for k, a in VLLM_ANSWERS.items() if not k.startswith("_")}
    p400, p22, p21 = metas["p400_m112"], metas["p490_m22"], metas["p490_m21"]
    assert (p400.completion_tokens, p400.spec_verify_ct, p400.spec_num_correct_drafts) == (112, 80, 30)
    assert VLLM_ANSWERS["p400_m112"]["metrics"]["speculative_decoding"]["per_step_drafted"][-3:] == [3, 2, 1]
    assert "112 completion tokens from 80 verify steps" in p400.spec_problem(**VLLM_LIMITS)
    assert "22 completion tokens from 19 verify steps" in p22.spec_problem(**VLLM_LIMITS)
    for m in (p400, p22, p21):
        assert m.spec_problem(**VLLM_LIMITS, context_len=512) is None
    # 490 + 21 = 511 does not reach it: same 19 steps and 1 accepted, one token fewer, valid either way
    assert (p21.spec_verify_ct, p21.spec_num_correct_drafts, p21.spec_problem(**VLLM_LIMITS)) == (19, 1, None)
    # the allowance is that one step, at the context only
    two = MetaInfo.model_validate({**meta_info(VLLM_ANSWERS["p490_m22"]), "prompt_tokens": 489,
                                   "completion_tokens": 23})
    assert "at most 22" in two.spec_problem(**VLLM_LIMITS, context_len=512)
    short = MetaInfo.model_validate({**meta_info(VLLM_ANSWERS["p490_m22"]), "prompt_tokens": 489})
    assert "plain decode" not in short.spec_problem(**VLLM_LIMITS, context_len=512)


def test_vllm_prompt_at_the_context_is_refused_it_leaves_no_room_for_one_token(tmp_path):
    rule = VLLMAdapter().context_rule(_VLLMInfo())
    assert (rule.tokens, rule.max_prompt, rule.clamps) == (512, 511, True)
    path = _file(tmp_path, [{"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 8}},
                            {"input_ids": list(range(5, 517)), "sampling_params": {"max_new_tokens": 8}}])
    with pytest.raises(BadInput) as err:
        fit_context(load_requests(path, vocab_size=32000), rule, path)
    msg = str(err.value)
    assert "\n" not in msg and "line 2: the prompt is 512 tokens, leaving no room for one generated token" in msg
    assert "SamplingParams._verify_args" in msg and "expected at most 511 prompt tokens" in msg
    ok = load_requests(_file(tmp_path, [{"input_ids": list(range(5, 516)), "sampling_params": {"max_new_tokens": 8}}]),
                       vocab_size=32000)
    assert len(fit_context(ok, rule, path)) == 1 and ok[0].sampling["max_new_tokens"] == 1


def test_a_cut_below_min_tokens_is_refused_as_the_engine_would(tmp_path):
    path = _file(tmp_path, [{"prompt": list(range(5, 505)), "max_tokens": 30, "min_tokens": 20}])
    with pytest.raises(BadInput, match=r"line 1: max_new_tokens 30 would be cut to 12 .* below min_new_tokens "
                                       r"20.*expected min_new_tokens <= 12"):
        fit_context(load_requests(path, vocab_size=32000), VLLMAdapter().context_rule(_VLLMInfo()), path)


def test_sglang_second_check_max_req_input_len_is_read_from_server_info(tmp_path):
    rule = SGLangAdapter().context_rule(_sglang(SGLANG_SCHED))
    assert (rule.tokens, rule.reserved, rule.max_prompt) == (512, 4, 505)
    assert "validate_input_length" in rule.prompt_source and "/server_info max_req_input_len" in rule.prompt_source
    # without max_req_input_len: the formula on max_total_num_tokens, same limit
    no_limit = {k: v for k, v in SGLANG_SCHED.items() if k != "max_req_input_len"}
    derived = SGLangAdapter().context_rule(_sglang(no_limit))
    assert derived.max_prompt == 505 and "max_total_num_tokens 8192" in derived.prompt_source
    # a small KV pool bites first: min(511, 299) - 5 = 294
    assert SGLangAdapter().context_rule(_sglang({**no_limit, "max_total_num_tokens": 300})).max_prompt == 293
    ids = list(range(5, 5 + 506))                    # breaker's at_ctx506_2.jsonl: 506 + 4 + 2 = 512 fits the first
    path = _file(tmp_path, [{"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}])
    with pytest.raises(BadInput) as err:
        fit_context(load_requests(path, vocab_size=32000), rule, path)
    msg = str(err.value)
    assert "\n" not in msg and "line 1: the prompt is 506 tokens, refused by sglang/srt/managers/utils.py::" \
        "validate_input_length, a prompt of max_req_input_len = 506 tokens or more" in msg
    assert "expected at most 505 prompt tokens" in msg
    ok = load_requests(_file(tmp_path, [{"input_ids": ids[:505], "sampling_params": {"max_new_tokens": 2}}]),
                       vocab_size=32000)
    assert fit_context(ok, rule, path) == []


def test_max_completion_tokens_wins_in_chat_and_is_not_read_in_completions(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    path = _file(tmp_path, [{"messages": msgs, "max_tokens": 8, "max_completion_tokens": 600},
                            {"messages": msgs, "max_completion_tokens": 600, "max_tokens": 8},
                            {"messages": msgs, "max_completion_tokens": None, "max_tokens": 8},
                            {"prompt": "hello", "max_tokens": 8, "max_completion_tokens": 600},
                            {"prompt": "hi", "max_completion_tokens": 300}])
    reqs = load_requests(path, tokenizer=CHECK_ONLY, vocab_size=32000)
    assert [q.sampling["max_new_tokens"] for q in reqs] == [600, 600, 8, 8, 16]
    assert "max_completion_tokens" in reqs[3].ignored and "max_completion_tokens" in reqs[4].ignored
    assert "max_completion_tokens" not in reqs[0].ignored
