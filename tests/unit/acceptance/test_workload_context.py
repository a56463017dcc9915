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
