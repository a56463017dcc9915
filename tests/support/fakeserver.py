"""A misbehaving SGLang look-alike on 127.0.0.1 for the reliability tests (issue 13): run as
``python -m support.fakeserver MODE PORT`` (stopped by its PID by :func:`fake_server`).

Modes: ``ok`` (plausible answers with spec fields and 3 x 16-wide hidden states), ``hang`` (/generate never answers),
``trickle`` (/generate sends one byte every 0.5 s, forever), ``die`` (the process exits at the 3rd /generate),
``oversize`` (/server_info is 20 MiB; /generate rows are 200000 wide), ``malformed`` (/generate answers without
``meta_info``, or with wrong types).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

H = 16
STATE = {"generate": 0}


def server_info(mode: str) -> dict:
    info = {"version": "0.5.23", "tp_size": 1, "speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
            "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4, "model_path": "/nonexistent/target",
            "speculative_draft_model_path": "/nonexistent/draft", "launch_command": "--port 1"}
    if mode == "oversize":
        info["padding"] = "x" * (20 << 20)
    return info


def generate_answer(body: dict, mode: str) -> dict:
    ids = body.get("input_ids") or [1, 2, 3]
    n_new = int((body.get("sampling_params") or {}).get("max_new_tokens", 4))
    width = 200000 if mode == "oversize" else 3 * H
    meta = {"id": "r", "prompt_tokens": len(ids), "completion_tokens": n_new, "cached_tokens": 0,
            "finish_reason": {"type": "length"}, "spec_verify_ct": max(1, n_new // 2),
            "spec_num_correct_drafts": n_new // 2, "spec_num_proposed_drafts": 3 * max(1, n_new // 2),
            "spec_correct_drafts_histogram": [0, max(1, n_new // 2), 0, 0]}
    if body.get("return_hidden_states"):
        block = [[0.01 * (t + 1)] * width for t in range(len(ids))]
        meta["hidden_states"] = [block] + [[0.02] * width for _ in range(n_new - 1)]
    out = {"text": "x", "output_ids": list(range(n_new)), "meta_info": meta}
    if body.get("return_prompt_token_ids"):
        out["prompt_token_ids"] = ids
    return out


class Handler(BaseHTTPRequestHandler):
    mode = "ok"

    def log_message(self, *args):  # quiet
        pass

    def _json(self, obj, status=200):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.path = self.path.split("?")[0]
        if self.path in ("/health", "/flush_cache"):
            return self._json({})
        if self.path in ("/server_info", "/get_server_info"):
            return self._json(server_info(self.mode))
        if self.path in ("/model_info", "/get_model_info"):
            return self._json({"model_path": "/nonexistent/target", "architectures": ["LlamaForCausalLM"]})
        if self.path == "/metrics":
            data = b"# no metrics\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            return self.wfile.write(data)
        self._json({"error": "not found"}, 404)

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.path = self.path.split("?")[0]
        if self.path == "/flush_cache":
            return self._json({})
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
        self._json(generate_answer(body, self.mode))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def fake_server(mode: str):
    """Start ``python -m support.fakeserver MODE PORT`` on 127.0.0.1, yield its URL, stop it by PID."""
    port = free_port()
    tests = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "support.fakeserver", mode, str(port)], cwd=tests,
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
    mode, port = sys.argv[1], int(sys.argv[2])
    Handler.mode = mode
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
