"""EngineAdapter.continuations (plan identification's continuations, several requests in flight) without a server:
httpx.MockTransport (httpx's own in-process transport) plays an engine whose answer to a request depends only on that
request (its tokens and seed), answering after a delay that differs per prompt, so the requests finish out of order.
The live side (same tokens as one request at a time on the embedded TP 2 server, greedy) is
bench/bench_plan_id_concurrent.py's."""
from __future__ import annotations

import hashlib
import json
import threading
import time

import httpx
import pytest

from helpers.acceptance.prompts import load_prompts
from helpers.engines.sglang import SGLangAdapter
from helpers.engines.vllm import VLLMAdapter, VLLMClient
from helpers.errors import SGLangError
from helpers.server.client import SGLangClient

N_TOKENS = 7


def _answer(ids: list[int], seed: int, n: int) -> list[int]:
    """A continuation that depends only on the prompt's tokens and its seed (as a seeded engine's would)."""
    h = hashlib.sha256(json.dumps([ids, seed]).encode()).digest()
    return [int(b) for b in h[:n]]


class Engine:
    """Counts flushes, the requests in flight at once (the most seen), and each request's read deadline."""

    def __init__(self, short: bool = False):
        self.lock = threading.Lock()
        self.flushes = self.in_flight = self.most = 0
        self.order: list[int] = []
        self.read_timeouts: set = set()
        self.short = short

    def enter(self, req: httpx.Request) -> None:
        with self.lock:
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            self.read_timeouts.add(req.extensions.get("timeout", {}).get("read"))

    def leave(self, ids: list[int]) -> None:
        # the first prompts wait longest: with several in flight they finish last
        time.sleep(0.002 * (40 - len(ids) % 40))
        with self.lock:
            self.in_flight -= 1
            self.order.append(len(ids))

    def sglang(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == "/flush_cache":
            self.flushes += 1
            return httpx.Response(200, text="ok")
        assert req.url.path == "/generate"
        body = json.loads(req.content)
        assert "return_hidden_states" not in body and body["return_prompt_token_ids"] is True
        sp = body["sampling_params"]
        ids = body.get("input_ids") or [ord(c) % 97 for c in body["text"]]
        self.enter(req)
        self.leave(ids)
        out = _answer(ids, sp.get("sampling_seed", -1), sp["max_new_tokens"] - (1 if self.short else 0))
        return httpx.Response(200, json={"text": "", "output_ids": out, "prompt_token_ids": ids,
                                         "meta_info": {"prompt_tokens": len(ids), "completion_tokens": len(out)}})

    def vllm(self, req: httpx.Request) -> httpx.Response:
        if req.url.path == "/reset_prefix_cache":
            self.flushes += 1
            return httpx.Response(200, text="")
        if req.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m", "object": "model"}]})
        assert req.url.path == "/v1/completions"
        body = json.loads(req.content)
        ids = body["prompt"] if isinstance(body["prompt"], list) else [ord(c) % 97 for c in body["prompt"]]
        self.enter(req)
        self.leave(ids)
        out = _answer(ids, body.get("seed", -1), body["max_tokens"])
        return httpx.Response(200, json={"id": "cmpl-1", "object": "text_completion", "model": "m",
                                         "choices": [{"index": 0, "text": "", "token_ids": out,
                                                      "prompt_token_ids": ids, "finish_reason": "length"}],
                                         "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out),
                                                   "total_tokens": len(ids) + len(out)}})


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 16}


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_concurrent_continuations_equal_one_at_a_time_in_the_prompts_order(engine):
    """8 in flight give each prompt the same tokens (its own seed, seed + index) as one at a time, returned in the
    prompts' order though they finish out of order; the cache is flushed once; every request carries the deadline."""
    prompts = load_prompts(None, n=16)
    prompts = [p if i % 2 else {"id": p.id, "input_ids": list(range(3, 3 + i + 2))} for i, p in enumerate(prompts)]
    adapter = SGLangAdapter() if engine == "sglang" else VLLMAdapter()
    runs = {}
    for conc in (1, 8):
        e = Engine()
        handler = e.sglang if engine == "sglang" else e.vllm
        client = (SGLangClient if engine == "sglang" else VLLMClient)(
            "http://engine.test:1", transport=httpx.MockTransport(handler), retries=0)
        got = adapter.continuations(client, prompts, max_new_tokens=N_TOKENS, sampling=SAMPLING, concurrency=conc,
                                    timeout_s=37.0)
        runs[conc] = (got, e)
    (one, e1), (many, e8) = runs[1], runs[8]
    assert [c.id for c in many] == [p["id"] if isinstance(p, dict) else p.id for p in prompts]
    assert many == one
    for i, c in enumerate(many):
        assert len(c.output_ids) == N_TOKENS and c.tokens == [*c.prompt_ids, *c.output_ids]
        assert list(c.output_ids) == _answer(list(c.prompt_ids), 16 + i, N_TOKENS)
    assert e1.most == 1 and 1 < e8.most <= 8
    assert e8.order != e1.order          # with 8 in flight they finished out of the prompts' order
    assert e1.flushes == e8.flushes == 1
    assert e8.read_timeouts == e1.read_timeouts == {37.0}


def test_a_short_answer_is_one_line_naming_the_prompt():
    e = Engine(short=True)
    client = SGLangClient("http://engine.test:1", transport=httpx.MockTransport(e.sglang), retries=0)
    with pytest.raises(SGLangError, match=r"/generate \(p1\): expected the prompt's token ids and 7 generated "
                                          r"tokens, got 3 and 6"):
        SGLangAdapter().continuations(client, [{"id": "p1", "input_ids": [1, 2, 3]}], max_new_tokens=N_TOKENS,
                                      concurrency=4, timeout_s=5.0)
