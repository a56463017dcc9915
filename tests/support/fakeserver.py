"""A misbehaving SGLang look-alike on 127.0.0.1 for the reliability tests (issue 13): run as
``python -m support.fakeserver MODE PORT`` (stopped by its PID by :func:`fake_server`).

Modes: ``ok`` (plausible answers with spec fields and 3 x 16-wide hidden states), ``hang`` (/generate never answers),
``hangall`` (issue 40: no endpoint ever answers, /health included, so engine detection waits too),
``trickle`` (/generate sends one byte every 0.5 s, forever), ``die`` (the process exits at the 3rd /generate),
``oversize`` (/server_info is 20 MiB; /generate rows are 200000 wide), ``malformed`` (/generate answers without
``meta_info``, or with wrong types), and (issue 21):

* ``keyed``: needs ``Authorization: Bearer KEY`` (``--api-key KEY``, default :data:`KEY`) like SGLang with
  ``--api-key``; its ``/server_info`` holds the key and the admin key (``--admin-api-key``, default :data:`ADMIN_KEY`)
  in clear as values, inside ``launch_command``, and as dict keys (nested); it prints its argv at start, as SGLang
  prints its server args;
* ``impossible``: every 2nd ``/generate`` carries spec counters no server can produce (cycling: more correct drafts
  than proposed, negative counters, more tokens than the verify steps can emit, a histogram longer than
  num_steps + 1);
* ``identities`` (issue 27): topk 2 and 8 draft tokens; every 2nd ``/generate`` breaks one identity of SGLang's
  per-request counters, in turn (:data:`BROKEN_IDENTITIES`), the others satisfy all of them (and report
  ``spec_accept_length`` / ``spec_accept_rate`` as SGLang does);
* ``deep``: every 2nd ``/generate`` answer is JSON nested 200000 deep;
* ``hugesteps``: ``/server_info`` reports ``speculative_num_steps`` 3e6; ``infolist``: ``/server_info`` is a JSON
  list; ``tpstring``: ``tp_size`` is ``"two"``; ``redirect``: every endpoint but /health answers 307 with a JSON body;
* ``infohtml`` / ``infodeep`` / ``infoversion`` (issue 40): ``/server_info`` is an HTML page, JSON nested 200000
  deep, or has ``version`` 5 (a number); its ``/model_info`` is SGLang's, so the server is SGLang by its answers;
* ``flaky`` (issue 40): every 2nd ``/generate`` answer to the same greedy request differs (output token 2, one verify
  step more and one accepted draft fewer; the counters' identities hold), as a server whose kernels depend on the batch;
* ``nextn`` (issue 37): SGLang 0.5.23 serving an MTP / NextN head, as a real one answered (:data:`NEXTN_RECORDED`:
  algorithm EAGLE as run for NEXTN asked in its ``launch_command``, the draft path the target's ``--model-path``
  unless ``--draft-path``);
* ``escape``: ``/generate`` answers 400 with terminal escape sequences in its body (screen clear, window title,
  OSC 52 clipboard);
* ``workload`` (issue 23): an engine whose acceptance depends on the request as public reports describe: per prompt an
  accept length of 2.4-3.2 (from a hash of the prompt's last 40 characters, so a longer prefix keeps it), 1.0 less
  when prompt + generated tokens pass :data:`WORKLOAD_LIMIT` (a text prompt counts one token per 4 characters),
  0.8 x temperature less at temperature > 0, and the same at every concurrency; ``/server_info`` says CPU and a
  ``context_length`` of 1024.

* ``metrics`` (issue 36, ``watch``): ``/metrics`` in SGLang 0.5.23's names, its cumulative counters
  (``generation_tokens_total``, ``spec_verify_calls_total``, ``prompt_tokens_total``, ``cached_tokens_total``,
  ``num_requests_total``) counting every ``/generate`` answered plus whatever :data:`METRICS` says was served besides
  (a test or bench adds to it), and its gauges from :data:`METRICS` (``token_usage``, ``num_running_reqs``,
  ``cache_hit_rate``, ``spec_accept_length``); each answer accepts ``METRICS["accept_length"]`` tokens per verify
  step (``METRICS["accept_length_after"]`` once ``METRICS["drop_after"]`` requests were served);
  ``METRICS["meta_override"]`` (a dict, off by default) is laid over every answer's ``meta_info`` (a fault). ``POST
  /fake_metrics`` with a JSON object updates :data:`METRICS` (a subprocess server). Its lifecycle fields (``watch``'s
  events, set in :data:`METRICS` by an in-thread test; None: not reported): ``startup_time`` (``/server_info``; SGLang
  0.5.23's is a dict of the start's phase durations),
  ``weight_version`` (``/model_info``), ``weight_load_s`` (the ``sglang:weight_load_duration_seconds`` gauge),
  ``draft_checksum`` (``POST /weights_checker``' ``per_engine_checksum``; None: 404), ``answer_shift`` (added to every
  output token id) and ``answer_flip`` (that many next answers get output token 0 replaced by 77).

Extra words after MODE: ``PORT`` or ``--port PORT``; ``--api-key K`` / ``--admin-api-key=K2`` (``keyed``);
``--model-path P`` / ``--draft-path D`` (what ``/server_info`` says the server runs; default ``/nonexistent/...``); other
flags (``--speculative-draft-model-path D`` from a relaunch) are ignored.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import zlib
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

H = 16
#: mode ``workload``: acceptance falls past this many tokens of context
WORKLOAD_LIMIT = 150
STATE = {"generate": 0}
#: mode ``metrics``: the counters and gauges its /metrics reports (module docstring)
METRICS = {"accept_length": 2.5, "generation_tokens": 0.0, "verify_steps": 0.0, "prompt_tokens": 0.0,
           "cached_tokens": 0.0, "requests": 0.0, "token_usage": 0.1, "running": 0.0, "cache_hit_rate": 0.0,
           "spec_accept_length": 2.5, "drop_after": None, "accept_length_after": 1.5, "startup_time": None,
           "weight_version": None, "weight_load_s": None, "draft_checksum": None, "answer_shift": 0, "answer_flip": 0,
           "meta_override": None}


def metrics_text() -> str:
    """Mode ``metrics``' /metrics (SGLang 0.5.23's sample names and label sets)."""
    m = METRICS
    return "".join([
        "# TYPE sglang:generation_tokens_total counter\n",
        f'sglang:generation_tokens_total{{is_streaming="false",model_name="t"}} {m["generation_tokens"]}\n',
        "# TYPE sglang:spec_verify_calls_total counter\n",
        f'sglang:spec_verify_calls_total{{model_name="t"}} {m["verify_steps"]}\n',
        "# TYPE sglang:prompt_tokens_total counter\n",
        f'sglang:prompt_tokens_total{{is_streaming="false",model_name="t"}} {m["prompt_tokens"]}\n',
        "# TYPE sglang:cached_tokens_total counter\n",
        f'sglang:cached_tokens_total{{cache_source="device",model_name="t"}} {m["cached_tokens"]}\n',
        "# TYPE sglang:num_requests_total counter\n",
        f'sglang:num_requests_total{{is_streaming="false",model_name="t"}} {m["requests"]}\n',
        "# TYPE sglang:token_usage gauge\n", f'sglang:token_usage{{model_name="t"}} {m["token_usage"]}\n',
        "# TYPE sglang:num_running_reqs gauge\n", f'sglang:num_running_reqs{{model_name="t"}} {m["running"]}\n',
        "# TYPE sglang:cache_hit_rate gauge\n", f'sglang:cache_hit_rate{{model_name="t"}} {m["cache_hit_rate"]}\n',
        "# TYPE sglang:spec_accept_length gauge\n",
        f'sglang:spec_accept_length{{model_name="t"}} {m["spec_accept_length"]}\n'] + ([
            "# TYPE sglang:weight_load_duration_seconds gauge\n",
            f'sglang:weight_load_duration_seconds{{model_name="t",source="disk"}} {m["weight_load_s"]}\n']
            if m.get("weight_load_s") is not None else []))
#: the API keys of mode ``keyed`` unless --api-key / --admin-api-key say otherwise
KEY = "sk-fake-7d1e0c9a4b"
ADMIN_KEY = "adm-fake-3b8f2a6e51"
KEYS = {"api_key": KEY, "admin_api_key": ADMIN_KEY}
#: the folders /server_info names (--model-path / --draft-path)
PATHS = {"model_path": "/nonexistent/target", "draft_path": "/nonexistent/draft"}
#: what mode ``escape`` puts in its error bodies: clear screen, set the window title, write the clipboard (OSC 52)
ESCAPES = "\x1b[2J\x1b[H\x1b]0;owned\x07\x1b]52;c;ZWNobyBvd25lZA==\x07\x9b31m"
#: every 2nd answer of mode ``impossible``, in turn
IMPOSSIBLE = (
    {"spec_num_correct_drafts": 50, "spec_num_proposed_drafts": 3},
    {"completion_tokens": -20},
    {"completion_tokens": 64, "spec_verify_ct": 2, "spec_num_correct_drafts": 2, "spec_num_proposed_drafts": 6},
    {"spec_correct_drafts_histogram": [0, 1, 0, 0, 0, 0, 1]},
)


#: mode ``identities`` (8 new tokens: 4 verify steps accepting 1 draft token each of 7 proposed, topk 2, 3 steps, 8
#: draft tokens): every 2nd answer breaks one identity of SGLang's per-request counters, in turn -- the identity's
#: name (:data:`helpers.server.protocol.SPEC_IDENTITIES`) and what the answer changes
BROKEN_IDENTITIES = (
    ("no verify step, no draft", {"spec_verify_ct": 0, "spec_num_correct_drafts": 3}),
    ("accepted <= proposed", {"spec_num_correct_drafts": 29, "spec_correct_drafts_histogram": None}),
    ("proposed = verify steps x (draft tokens - 1)", {"spec_num_proposed_drafts": 12}),
    ("histogram bins <= num_steps + 1", {"spec_correct_drafts_histogram": [0, 3, 0, 0, 1]}),
    ("accepted <= verify steps x num_steps", {"spec_num_correct_drafts": 13, "completion_tokens": 8,
                                              "spec_correct_drafts_histogram": None}),
    ("completion tokens <= 1 + retractions + verify steps + accepted", {"completion_tokens": 10,
                                                                        "spec_accept_length": 2.5}),
    ("histogram sums to the verify steps", {"spec_correct_drafts_histogram": [1, 4, 0, 0]}),
    ("histogram weights to the accepted drafts", {"spec_correct_drafts_histogram": [1, 3, 0, 0]}),
    ("spec_accept_length = completion_tokens / spec_verify_ct", {"spec_accept_length": 3.5}),
    ("spec_accept_rate = correct / proposed", {"spec_accept_rate": 0.5}),
)


#: mode ``nextn``'s /server_info fields: recorded from a real SGLang 0.5.23 server started with
#: ``--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens
#: 2`` on env/models/kimi/target at TP 1 (2026-12-06, tests/data/mtp_configs/sglang-0.5.23-nextn-server_info.json):
#: NEXTN is stored as EAGLE, draft tokens 2 became steps + 1 = 4, max_running_requests 48; the recorded paths and port are
#: replaced by this server's --model-path / --draft-path (default: the model path, as ``_handle_eagle_family`` sets it
#: for a DeepseekV3ForCausalLM target; ``--draft-path none``: null, as for a Qwen3-Next / MiMo target)
NEXTN_RECORDED = Path(__file__).resolve().parents[1] / "data" / "mtp_configs" / "sglang-0.5.23-nextn-server_info.json"


def nextn_info() -> dict:
    """The recorded NEXTN /server_info with this fake's paths."""
    rec = json.loads(NEXTN_RECORDED.read_text())
    model, draft = rec["model_path"], rec["speculative_draft_model_path"]
    ours = (PATHS["model_path"] if PATHS["draft_path"] == "/nonexistent/draft"
            else None if PATHS["draft_path"] == "none" else PATHS["draft_path"])
    rec["launch_command"] = rec["launch_command"].replace(
        f"--speculative-draft-model-path {draft} ", "" if ours is None else f"--speculative-draft-model-path {ours} "
    ).replace(f"--model-path {model} ", f"--model-path {PATHS['model_path']} ")
    rec["model_path"] = PATHS["model_path"]
    rec["speculative_draft_model_path"] = ours
    return rec


def server_info(mode: str) -> dict:
    info = {"version": "0.5.23", "tp_size": 1, "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4, "model_path": PATHS["model_path"],
            "speculative_draft_model_path": PATHS["draft_path"], "launch_command": "--port 1"}
    if mode == "oversize":
        info["padding"] = "x" * (20 << 20)
    if mode == "keyed":
        k, k2 = KEYS["api_key"], KEYS["admin_api_key"]
        info.update(api_key=k, admin_api_key=k2, launch_command=f"sglang --port 1 --api-key {k} --admin-api-key={k2}",
                    lora_paths={k: "/adapters/a", "plain": f"/adapters/{k2}"},
                    internal_states=[{"avg_spec_accept_length": 2.0, "tenants": {k2: {"note": f"Bearer {k}"}}}])
    if mode == "hugesteps":
        info["speculative_num_steps"] = 3e6
    if mode == "tpstring":
        info["tp_size"] = "two"
    if mode == "identities":
        info.update(speculative_eagle_topk=2, speculative_num_draft_tokens=8)
    if mode == "nextn":           # SGLang 0.5.23 serving a DeepSeek-class target's NextN head (NEXTN -> EAGLE)
        info.update(nextn_info())
    if mode == "nospec":          # a server started without a draft (SGLang reports the speculative fields null)
        info.update(speculative_algorithm=None, speculative_num_steps=None, speculative_eagle_topk=None,
                    speculative_num_draft_tokens=None, speculative_draft_model_path=None)
    if mode == "workload":
        info.update(device="cpu", context_length=1024, disable_radix_cache=False, disable_overlap_schedule=True,
                    chunked_prefill_size=4096, attention_backend="intel_amx", sampling_backend="pytorch")
    return info


def _deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def generate_answer(body: dict, mode: str) -> dict:
    ids = body.get("input_ids") or [1, 2, 3]
    n_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 4))
    width = 200000 if mode == "oversize" else 3 * H
    v, c = max(1, n_new // 2), n_new // 2           # every verify step accepts one draft token (none for 1 token)
    flaky = mode == "flaky" and STATE["generate"] % 2 == 0 and c > 0
    if flaky:                                       # one verify step more, one accepted draft fewer
        v, c = v + 1, c - 1
    meta = {"id": f"req-{STATE['generate']}", "prompt_tokens": len(ids), "completion_tokens": n_new,
            "cached_tokens": 0, "finish_reason": {"type": "length"}, "spec_verify_ct": v,
            "spec_num_correct_drafts": c, "spec_num_proposed_drafts": 3 * v,
            "spec_correct_drafts_histogram": [v - c, c, 0, 0], "num_retractions": 0}
    if mode == "identities":                        # topk 2, 8 draft tokens: 7 proposed per verify step
        meta.update(spec_num_proposed_drafts=7 * v, spec_accept_length=n_new / v, spec_accept_rate=c / (7 * v))
        if STATE["generate"] % 2 == 0:
            meta.update(BROKEN_IDENTITIES[(STATE["generate"] // 2 - 1) % len(BROKEN_IDENTITIES)][1])
    if mode == "workload":
        text = body.get("text")
        n_prompt = len(body["input_ids"]) if body.get("input_ids") else max(1, len(text or "") // 4)
        key = (text or "")[-40:] if text else str(ids[-8:])
        al = 2.4 + (zlib.crc32(key.encode()) % 9) / 10
        al -= 1.0 if n_prompt + n_new > WORKLOAD_LIMIT else 0.0
        al -= 0.8 * float((body.get("sampling_params") or {}).get("temperature") or 0.0)
        verify = max(1, min(n_new, round(n_new / max(1.0, al))))
        meta.update(prompt_tokens=n_prompt, spec_verify_ct=verify, spec_num_correct_drafts=n_new - verify,
                    spec_num_proposed_drafts=3 * verify, spec_correct_drafts_histogram=None)
    if mode == "metrics":
        al = float(METRICS["accept_length"])
        if METRICS.get("drop_after") is not None and METRICS["requests"] >= METRICS["drop_after"]:
            al = float(METRICS["accept_length_after"])
        verify = max(1, min(n_new, round(n_new / max(1.0, al))))
        meta.update(spec_verify_ct=verify, spec_num_correct_drafts=n_new - verify, spec_num_proposed_drafts=3 * verify,
                    spec_correct_drafts_histogram=None)
        text = body.get("text")
        n_prompt = len(body["input_ids"]) if body.get("input_ids") else max(1, len(text or "") // 4)
        meta["prompt_tokens"] = n_prompt
        for k, v in (("generation_tokens", n_new), ("verify_steps", verify), ("prompt_tokens", n_prompt),
                     ("requests", 1)):
            METRICS[k] += v
        if METRICS.get("meta_override"):            # a fault for a test: impossible counters in every answer
            meta.update(METRICS["meta_override"])
    if mode == "impossible" and STATE["generate"] % 2 == 0:
        meta.update(IMPOSSIBLE[(STATE["generate"] // 2 - 1) % len(IMPOSSIBLE)])
    if body.get("return_hidden_states"):
        block = [[0.01 * (t + 1)] * width for t in range(len(ids))]
        meta["hidden_states"] = [block] + [[0.02] * width for _ in range(n_new - 1)]
    out = {"text": "x", "output_ids": list(range(n_new)), "meta_info": meta}
    if mode == "metrics":
        out["output_ids"] = [t + int(METRICS.get("answer_shift") or 0) for t in out["output_ids"]]
        if METRICS.get("answer_flip"):
            METRICS["answer_flip"] -= 1
            out["output_ids"][0] = 77
    if flaky and n_new > 2:
        out["output_ids"][2] = 99
    if body.get("return_prompt_token_ids"):
        out["prompt_token_ids"] = ids
    return out


class Handler(BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *args):  # quiet
        pass

    def _json(self, obj, status=200, headers=()):
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _refused(self) -> bool:
        """Answer 401 (mode keyed, wrong or no key) or 307 (mode redirect) and return True; else False."""
        if self.path == "/health":
            return False
        if self.mode == "keyed" and self.headers.get("Authorization") != f"Bearer {KEYS['api_key']}":
            self._json({"error": "Unauthorized"}, 401)
            return True
        if self.mode == "redirect":
            self._json(server_info("ok"), 307, [("Location", "http://127.0.0.1:1/elsewhere")])
            return True
        return False

    def do_GET(self):
        self.path = self.path.split("?")[0]
        if self.mode == "hangall":
            time.sleep(3600)
        if self._refused():
            return None
        if self.path in ("/health", "/flush_cache"):
            return self._json({})
        if self.path in ("/server_info", "/get_server_info"):
            if self.mode == "infohtml":
                return self._json(b"<!doctype html><html><body>Welcome</body></html>")
            if self.mode == "infodeep":
                return self._json(_deep(200000))
            if self.mode == "infoversion":
                return self._json({**server_info("ok"), "version": 5})
            info = server_info(self.mode)
            if self.mode == "metrics" and METRICS.get("startup_time") is not None:
                info["startup_time"] = METRICS["startup_time"]
            return self._json([server_info("ok")] if self.mode == "infolist" else info)
        if self.path in ("/model_info", "/get_model_info"):
            mi = {"model_path": PATHS["model_path"],
                  "architectures": ["DeepseekV3ForCausalLM" if self.mode == "nextn" else "LlamaForCausalLM"]}
            if self.mode == "metrics":
                mi["weight_version"] = METRICS.get("weight_version")
            return self._json(mi)
        if self.path == "/metrics":
            data = metrics_text().encode() if self.mode == "metrics" else b"# no metrics\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        self._json({"error": "not found"}, 404)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.path = self.path.split("?")[0]
        if self.mode == "hangall":
            time.sleep(3600)
        if self._refused():
            return None
        if self.path == "/flush_cache":
            return self._json({})
        if self.path == "/fake_metrics" and self.mode == "metrics":
            METRICS.update({k: float(v) for k, v in body.items() if k in METRICS})
            return self._json(METRICS)
        if self.path == "/weights_checker" and self.mode == "metrics" and METRICS.get("draft_checksum"):
            cs = METRICS["draft_checksum"]
            return self._json({"success": True, "message": "Success.", "per_engine_checksum": cs, "ranks": [
                {"checksums": {"fc.weight": cs[:16]}, "per_gpu_checksum": cs, "parallelism_info": [
                    {"role": "draft", "tp_rank": 0, "tp_size": 1}]}]})
        if self.path != "/generate":
            return self._json({"error": "not found"}, 404)
        STATE["generate"] += 1
        if self.mode == "hang":
            time.sleep(3600)
        if self.mode == "trickle":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            while True:
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.5)
        if self.mode == "die" and STATE["generate"] >= 3:
            os._exit(0)
        if self.mode == "malformed":
            return self._json({"text": "x", "output_ids": [1]} if STATE["generate"] % 2
                              else {"text": "x", "output_ids": "nope", "meta_info": {"completion_tokens": "many"}})
        if self.mode == "escape":
            data = f"bad request {ESCAPES} end".encode()
            self.send_response(400)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        if self.mode == "deep" and STATE["generate"] % 2 == 0:
            return self._json(_deep(200000))
        self._json(generate_answer(body, self.mode))


def send_json(handler, status: int, body) -> None:
    """Answer ``handler``'s request (a ``BaseHTTPRequestHandler``) with ``status`` and ``body`` (a str sent as is,
    else JSON), content-type application/json, its length."""
    import json as _json
    data = body.encode() if isinstance(body, str) else _json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def in_thread(handler: type):
    """An HTTP server of ``handler`` (a ``BaseHTTPRequestHandler`` class) on 127.0.0.1 in a daemon thread of this
    process; yields its URL, shut down and closed on exit."""
    import threading     # lazy: the subprocess server (``python fakeserver.py``) needs no thread
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


@contextmanager
def fake_server(mode: str, *extra: str):
    """Start ``python -m support.fakeserver MODE PORT [EXTRA...]`` on 127.0.0.1, yield its URL, stop it by PID."""
    port = free_port()
    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "support.fakeserver", mode, str(port), *extra], cwd=tests,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"fake server {mode} exited with {proc.returncode}")
                time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=10)


def main() -> None:
    args = sys.argv[1:]
    mode, rest, port = args[0], args[1:], None
    i = 0
    while i < len(rest):
        a = rest[i]
        name, eq, value = a.partition("=")
        if name in ("--port", "--api-key", "--admin-api-key", "--model-path", "--draft-path") and not eq:
            value, i = rest[i + 1], i + 1
        if name == "--port":
            port = int(value)
        elif name in ("--api-key", "--admin-api-key"):
            KEYS[name[2:].replace("-", "_")] = value
        elif name in ("--model-path", "--draft-path"):
            PATHS[name[2:].replace("-", "_")] = value
        elif i == 0 and a.isdigit():
            port = int(a)
        i += 1
    print(f"fake server {mode} on 127.0.0.1:{port}: argv {sys.argv}; keys {KEYS}", flush=True)
    Handler.mode = mode
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
