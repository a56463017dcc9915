"""Answers recorded from the embedded vLLM 0.32.0 server (trimmed), for tests without a server."""
from __future__ import annotations

#: /metrics of the embedded vLLM 0.32.0 server after one 16-token completion with a random draft (trimmed), and after
#: a second request: tests/unit/engines/test_vllm_pure.py computes the delta by hand
METRICS_1 = """# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/tmp/h64/target"} 15.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/tmp/h64/target"} 1.796207426856698e+09
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/tmp/h64/target"} 45.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/tmp/h64/target"} 0.0
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/h64/target",position="0"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/h64/target",position="1"} 0.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/h64/target",position="2"} 0.0
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0",model_name="/tmp/h64/target"} 16.0
# TYPE vllm:request_success counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="/tmp/h64/target"} 1.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="/tmp/h64/target"} 0.0
"""

#: choices[0] of a /v1/completions answer of the embedded server with logprobs 2 and return_tokens_as_token_ids
#: (prompt [5 .. 14], 3 tokens; 2026-12-03), trimmed to the fields read (the text shortened)
LOGPROBS_CHOICE = {"index": 0, "text": " x", "token_ids": [510, 9, 9], "finish_reason": "length",
                   "logprobs": {"text_offset": [0, 12, 22],
                                "token_logprobs": [-2.4548540115356445, -2.1991231441497803, -1.882392168045044],
                                "tokens": ["token_id:510", "token_id:9", "token_id:9"],
                                "top_logprobs": [{"token_id:510": -2.4548540115356445, "token_id:316": -2.7506103515625},
                                                 {"token_id:9": -2.1991231441497803, "token_id:16": -3.0106446743011475},
                                                 {"token_id:9": -1.882392168045044,
                                                  "token_id:299": -2.4128005504608154}]}}


class FakeVLLM:
    """A stateful fake of the embedded vLLM 0.32.0 server's routes the engine-state probes use, its answers shaped as
    the real ones (``/v1/completions`` with ``return_token_ids``, ``usage.prompt_tokens_details``, ``metrics.
    speculative_decoding``, ``logprobs.top_logprobs`` keyed ``token_id:<id>``: recorded from the embedded server,
    2026-12-03). Greedy tokens of a prompt: ``(sum(prompt) + 7 j) % 500`` at output position j.

    * prefix cache: a prompt sent since the last ``/reset_prefix_cache`` hits ``(n - 1) // B * B - B`` tokens (B =
      ``block_size``; the EAGLE rule the embedded server showed: 300 and 257 tokens hit 128, 256 hit 0), 0 without a
      draft's last-block drop when ``draft`` is False;
    * ``accept(i, cached) -> drafts accepted per verify step`` (``i``: the prompt's first token), ``k`` drafts per step;
      ``draft`` False: no speculative metrics (the target alone), and ``flip(i) -> output position`` whose token is
      changed (a speculative server that is not lossless is the other side), ``margin`` (nats) between the best and
      the second token there;
    * ``details`` False: no ``prompt_tokens_details`` (a server without ``--enable-prompt-tokens-details``).

    ``seen``: the completion bodies; ``resets``: how many resets."""

    def __init__(self, accept=lambda i, cached: 2, *, k=3, block_size=128, draft=True, details=True,
                 flip=lambda i: None, margin=1.0, prefix_caching=True):
        self.accept, self.k, self.block, self.draft, self.details = accept, k, block_size, draft, details
        self.flip, self.margin, self.prefix_caching = flip, margin, prefix_caching
        self.cache: set = set()
        self.seen: list = []
        self.resets = 0

    def describe(self) -> dict:
        return {"tp_rank": 0, "tp_size": 1, "target_class": "LlamaForCausalLM", "num_layers": 8, "hidden_size": 128,
                "aux_layer_ids": [1, 3, 4], "enforce_eager": True,
                "settings": {"enable_prefix_caching": self.prefix_caching, "async_scheduling": False,
                             "rejection_sample_method": "standard", "draft_sample_method": "greedy",
                             "dtype": "float32", "max_model_len": 512, "device": "cpu", "max_num_seqs": 8,
                             "block_size": self.block, "cache_hit_alignment_tokens": self.block},
                "draft": ({"class": "Eagle3LlamaForCausalLM", "method": "eagle3", "model": "/m/draft",
                           "num_speculative_tokens": self.k} if self.draft else None)}

    def complete(self, body: dict) -> dict:
        self.seen.append(body)
        ids, n = list(body["prompt"]), int(body["max_tokens"])
        key = tuple(ids)
        hit = key in self.cache and self.prefix_caching
        cached = max(0, (len(ids) - 1) // self.block * self.block - (self.block if self.draft else 0)) if hit else 0
        if self.prefix_caching:
            self.cache.add(key)
        out = [(sum(ids) + 7 * j) % 500 for j in range(n)]
        at = None if self.draft else self.flip(ids[0])
        if at is not None and at < n:
            out[at] = (out[at] + 1) % 500
        usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + n, "completion_tokens": n}
        if self.details:
            usage["prompt_tokens_details"] = {"cached_tokens": cached, "created_cache_tokens": None,
                                              "multimodal_tokens": None}
        choice = {"index": 0, "text": "x" * n, "token_ids": out, "finish_reason": "length",
                  "prompt_token_ids": ids}
        ans = {"id": f"cmpl-{len(self.seen)}", "object": "text_completion", "model": "/m/target",
               "choices": [choice], "usage": usage, "metrics": {"speculative_decoding": None}}
        if body.get("logprobs"):
            tops = []
            for j, t in enumerate(out):
                second = (t + 1) % 500 if j != at else (t - 1) % 500      # at the flip: the spec token is 2nd
                tops.append({f"token_id:{t}": -0.5, f"token_id:{second}": -0.5 - (self.margin if j == at else 2.0)})
            choice["logprobs"] = {"text_offset": list(range(n)), "token_logprobs": [-0.5] * n,
                                  "tokens": [f"token_id:{t}" for t in out], "top_logprobs": tops}
        if self.draft and n > 1:
            a = max(0, min(self.k, int(self.accept(ids[0], cached))))
            left, steps, acc, hist = n - 1, 0, 0, [0] * (self.k + 1)
            while left > 0:
                take = min(a + 1, left)
                hist[take - 1] += 1
                steps, acc, left = steps + 1, acc + take - 1, left - take
            ans["metrics"]["speculative_decoding"] = {
                "mean_acceptance_length": 1 + acc / steps, "draft_acceptance_rate": acc / (steps * self.k),
                "acceptance_histogram": hist, "num_spec_steps": steps, "num_accepted_draft_tokens": acc,
                "num_draft_tokens": steps * self.k, "num_spec_tokens": self.k}
        return ans

    def handler(self) -> type:
        """The ``BaseHTTPRequestHandler`` class serving this fake (``support.fakeserver.in_thread(fake.handler())``)."""
        import json
        from http.server import BaseHTTPRequestHandler

        from support.fakeserver import send_json
        fake = self

        class H(BaseHTTPRequestHandler):
            def _send(self, status, body):
                send_json(self, status, body)

            def do_GET(self):  # noqa: N802
                models = {"object": "list", "data": [{"id": "/m/target", "object": "model", "owned_by": "vllm",
                                                      "root": "/m/target", "max_model_len": 512}]}
                routes = {"/version": {"version": "0.32.0"}, "/v1/models": models, "/metrics": METRICS_1}
                path = self.path.split("?")[0]
                self._send(200, routes[path]) if path in routes else self._send(404, {"detail": "Not Found"})

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["content-length"] or 0)) or b"{}")
                if self.path == "/collective_rpc":
                    return self._send(200, {"results": [fake.describe() if body.get("method") == "e3f_describe"
                                                        else {}]})
                if self.path == "/reset_prefix_cache":
                    fake.cache.clear()
                    fake.resets += 1
                    return self._send(200, {})
                if self.path == "/v1/completions":
                    return self._send(200, fake.complete(body))
                return self._send(404, {"detail": "Not Found"})

            def log_message(self, *a):
                pass
        return H
