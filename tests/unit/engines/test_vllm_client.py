"""The client contract on vLLM without a server (fake HTTP servers on 127.0.0.1 answering as the embedded vLLM 0.32.0
server did): server_info in the suite's vocabulary from the worker extension, else from /metrics; a completion's
per-request spec metrics as SGLang's meta_info; impossible counters refused; a measurement through the engine-neutral
measure() with the suite's definitions; the prefix-cache reset."""
from __future__ import annotations

import copy
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers.acceptance.measure import measure
from helpers.engines.vllm import VLLMClient
from helpers.errors import EndpointMissing, SGLangError
from support.fakeserver import free_port
from support.vllm_answers import METRICS_1

MODELS = {"object": "list", "data": [{"id": "/m/target", "object": "model", "owned_by": "vllm", "root": "/m/target",
                                      "max_model_len": 512}]}
#: rank 0's e3f_describe of the embedded server (h64 reference pair, TP 1), trimmed
DESCRIBE = {"tp_rank": 0, "tp_size": 1, "target_class": "LlamaForCausalLM", "num_layers": 8, "hidden_size": 128,
            "aux_layer_ids": [1, 3, 4], "enforce_eager": True,
            "settings": {"enable_prefix_caching": True, "async_scheduling": False, "rejection_sample_method": "standard",
                         "draft_sample_method": "greedy", "dtype": "float32", "max_model_len": 512, "device": "cpu",
                         "max_num_seqs": 8},
            "draft": {"class": "Eagle3LlamaForCausalLM", "method": "eagle3", "model": "/m/draft",
                      "num_speculative_tokens": 3, "embed_shared": True, "lm_head_shared": False}}
#: one /v1/completions answer of that server (16 tokens: the prefill's, then 4 verify steps; the last step cut at 3);
#: the rates unrounded, as vLLM computes them (v1/metrics/stats.py::RequestSpecDecodeMetrics.to_dict), which the spec
#: counter identities (helpers.server.protocol.SPEC_IDENTITIES) check to double precision
ANSWER = {"id": "cmpl-1", "choices": [{"text": "x", "token_ids": list(range(100, 116)), "finish_reason": "length",
                                       "prompt_token_ids": [5, 6, 7]}],
          "usage": {"prompt_tokens": 3, "completion_tokens": 16},
          "metrics": {"speculative_decoding": {"num_spec_steps": 5, "num_accepted_draft_tokens": 10,
                                               "num_draft_tokens": 15, "acceptance_histogram": [1, 0, 2, 2],
                                               "mean_acceptance_length": 3.0, "draft_acceptance_rate": 10 / 15}}}


@contextmanager
def vllm_server(*, extension: bool = True, answer: dict = ANSWER, dev: bool = True):
    """A fake vLLM 0.32.0 server; ``seen`` collects the completion bodies."""
    seen: list = []

    class H(BaseHTTPRequestHandler):
        def _send(self, status, body):
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            routes = {"/version": (200, {"version": "0.32.0"}), "/v1/models": (200, MODELS),
                      "/metrics": (200, METRICS_1)}
            self._send(*routes.get(path, (404, {"detail": "Not Found"})))

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["content-length"] or 0)) or b"{}")
            if self.path == "/collective_rpc" and extension and body.get("method") == "e3f_describe":
                return self._send(200, {"results": [DESCRIBE]})
            if self.path == "/reset_prefix_cache" and dev:
                return self._send(200, {})
            if self.path == "/v1/completions":
                seen.append(body)
                return self._send(200, answer)
            return self._send(404, {"detail": "Not Found"})

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        srv.shutdown()
        srv.server_close()


def test_server_info_speaks_the_suites_vocabulary_from_the_extension():
    with vllm_server() as (url, _), VLLMClient(url) as c:
        info = c.server_info()
    assert (info["engine"], info["version"], info["sglang_version"]) == ("vllm", "0.32.0", None)
    assert (info["speculative_algorithm"], info["speculative_num_steps"], info["speculative_eagle_topk"],
            info["speculative_num_draft_tokens"]) == ("EAGLE3", 3, 1, 4)
    assert (info["model_path"], info["speculative_draft_model_path"], info["context_length"]) == \
        ("/m/target", "/m/draft", 512)
    assert info["enable_prefix_caching"] is True and info["draft_sample_method"] == "greedy"
    assert info["aux_layer_ids"] == [1, 3, 4] and "e3f_describe" in info["sources"]["settings"]


def test_without_the_extension_the_settings_come_from_metrics_and_say_so():
    with vllm_server(extension=False) as (url, _), VLLMClient(url) as c:
        info = c.server_info()
    assert info["speculative_num_steps"] == 3 and info["speculative_draft_model_path"] is None
    assert "/metrics" in info["sources"]["settings"] and info["worker_extension"] is False


def test_a_completion_becomes_sglangs_meta_info_and_a_measurement_uses_the_suites_definitions():
    with vllm_server() as (url, seen), VLLMClient(url) as c:
        r = c.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 16, "temperature": 0.0})
        m = r.meta_info
        assert (m.spec_verify_ct, m.spec_num_correct_drafts, m.spec_num_proposed_drafts) == (5, 10, 15)
        assert m.spec_correct_drafts_histogram == [1, 0, 2, 2] and m.spec_accept_length == pytest.approx(16 / 5)
        assert r.output_ids == list(range(100, 116)) and seen[-1]["max_tokens"] == 16 and seen[-1]["prompt"] == [5, 6, 7]
        res = measure(c, [[5, 6, 7], [8, 9]], max_new_tokens=16, progress=False, warmup=0)
    s = res.summary
    assert s["engine"] == "vllm" and s["sglang_version"] is None and s["engine_version"] == "0.32.0"
    assert s["accept_length"] == pytest.approx(32 / 10) and s["accept_rate"] == pytest.approx(20 / 30)
    assert s["num_steps"] == 3 and s["n_requests"] == 2


def test_impossible_counters_are_refused_and_a_missing_reset_is_said():
    bad = copy.deepcopy(ANSWER)
    bad["metrics"]["speculative_decoding"]["num_accepted_draft_tokens"] = 50
    with vllm_server(answer=bad, dev=False) as (url, _), VLLMClient(url) as c:
        c.server_info()
        with pytest.raises(SGLangError, match="impossible spec counters"):
            c.generate(input_ids=[1, 2], max_new_tokens=16)
        with pytest.raises(EndpointMissing, match="VLLM_SERVER_DEV_MODE"):
            c.flush_cache()


@pytest.mark.parametrize("draft", ["/m/draft as a string", {**DESCRIBE["draft"], "num_speculative_tokens": "three"}])
def test_a_worker_answer_of_another_shape_is_one_server_error(monkeypatch, draft):
    """Found by an adversarial run: a field of another type than vLLM 0.32.0 writes it (the draft as a string, the
    token count as a word) was a bare AttributeError / ValueError with the E3F_DEBUG hint; it is one ServerError line
    naming the server and what was wrong."""
    from helpers.cli.common import describe
    from helpers.errors import ServerError

    monkeypatch.setitem(DESCRIBE, "draft", draft)
    with vllm_server() as (url, _), VLLMClient(url) as c:
        with pytest.raises(ServerError) as err:
            c.server_info()
    msg = describe(err.value)
    assert msg.startswith(url) and "not what vLLM 0.32.0 writes" in msg and "\n" not in msg, msg
