"""The client contract on vLLM without a server (fake HTTP servers on 127.0.0.1 answering as the embedded vLLM 0.32.0
server did): server_info in the suite's vocabulary from the worker extension, else from /metrics; a completion's
per-request spec metrics as SGLang's meta_info; impossible counters refused; a measurement through the engine-neutral
measure() with the suite's definitions; the prefix-cache reset."""
from __future__ import annotations

import copy
import json
import os
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from helpers.acceptance.measure import measure
from helpers.engines.vllm import VLLMClient
from helpers.errors import EndpointMissing, SGLangError
from support.fakeserver import free_port, send_json
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
def vllm_server(*, extension: bool = True, answer: dict = ANSWER, dev: bool = True, models: dict = MODELS,
                ranks: list | None = None, metrics: str = METRICS_1, hang: bool = False, dev_info: dict | None = None):
    """A fake vLLM 0.32.0 server; ``seen`` collects the completion bodies. ``ranks``: the e3f_describe answer
    (default ``[DESCRIBE]``); other worker-extension methods answer one empty object per rank; ``hang``: completions
    never answer (until the server is stopped)."""
    seen: list = []
    stop = threading.Event()

    class H(BaseHTTPRequestHandler):
        def _send(self, status, body):
            send_json(self, status, body)

        def do_GET(self):  # noqa: N802
            path = self.path.split("?")[0]
            routes = {"/version": (200, {"version": "0.32.0"}), "/v1/models": (200, models),
                      "/metrics": (200, metrics)}
            if dev_info is not None:
                routes["/server_info"] = (200, dev_info)
            self._send(*routes.get(path, (404, {"detail": "Not Found"})))

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["content-length"] or 0)) or b"{}")
            if self.path == "/collective_rpc" and extension and body.get("method") == "e3f_describe":
                return self._send(200, {"results": [DESCRIBE] if ranks is None else ranks})
            if self.path == "/collective_rpc" and extension:
                return self._send(200, {"results": [{}]})
            if self.path == "/reset_prefix_cache" and dev:
                return self._send(200, {})
            if self.path == "/v1/completions":
                seen.append(body)
                if hang:
                    stop.wait(60)
                    try:
                        return self._send(200, answer)
                    except OSError:            # the client went away (it was interrupted)
                        return None
                return self._send(200, answer)
            return self._send(404, {"detail": "Not Found"})

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", free_port()), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", seen
    finally:
        stop.set()
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
    # issue 40: the field is named (the worker's answer is checked: helpers.engines.vllm_answers.RankReport)
    field = "draft" if isinstance(draft, str) else "draft.num_speculative_tokens"
    assert msg.startswith(f"POST {url}/collective_rpc e3f_describe (rank 0): field {field}: ") and "\n" not in msg, msg


# ---------------------------------------------------------------------------------------------------- issue 40 (B)

def _models(**fields) -> dict:
    return {"object": "list", "data": [{**MODELS["data"][0], **fields}]}


def _one_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    lines = [ln for ln in err if ln.startswith(f"{prog}: error:")]
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    return lines[0]


def test_a_model_path_of_another_type_is_named(tmp_path, capsys):
    """Issue 40: a /v1/models whose target path (root) is a number was a TypeError further on; it is one line naming
    the endpoint, the entry and the field, exit 1."""
    from helpers.__main__ import main

    with vllm_server(models=_models(root=5)) as (url, _):
        with VLLMClient(url) as c, pytest.raises(SGLangError) as err:
            c.server_info()
        assert str(err.value) == f"GET {url}/v1/models (data.0): field root: Input should be a valid string, got 5"
        rc = main(["measure", "--url", url, "--num-prompts", "2", "--max-new-tokens", "16", "--warmup", "0",
                   "--quiet", "--outputs", str(tmp_path), "--timeout", "30"])
    line = _one_error(capsys, "measure")
    assert rc == 1 and "/v1/models (data.0): field root: Input should be a valid string, got 5" in line, line
    dev = {"vllm_config": {"speculative_config": {"method": "eagle3", "model": 5, "num_speculative_tokens": 3}}}
    with vllm_server(extension=False, dev_info=dev) as (url, _), VLLMClient(url) as c:
        with pytest.raises(SGLangError) as err:
            c.server_info()
    assert str(err.value) == (f"GET {url}/server_info: field vllm_config.speculative_config.model: Input should be a "
                              "valid string, got 5")
    with vllm_server(models=_models(id=7)) as (url, _), VLLMClient(url) as c:
        with pytest.raises(SGLangError, match=r"\(data.0\): field id: Input should be a valid string, got 7"):
            c.models()


#: /metrics of a server that says it drafts 7 tokens (positions 0-6) while its answers are those of 3 (ANSWER)
METRICS_7 = METRICS_1 + "".join(
    f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="/tmp/h64/target",position="{p}"}} 0.0\n'
    for p in range(3, 7))


def test_a_lying_metrics_fails_every_request_naming_the_identity(tmp_path, capsys):
    """Issue 40: without the worker extension the token count comes from /metrics; one that says 7 while every answer
    is that of 3 drafts (vLLM writes a dense histogram of num_speculative_tokens + 1 bins) was recorded as "steps 7",
    exit 0; every request now fails naming the identity, the numbers and where the 7 came from, exit 1."""
    from helpers.__main__ import main

    with vllm_server(extension=False, metrics=METRICS_7) as (url, _):
        with VLLMClient(url) as c:
            assert c.server_info()["speculative_num_steps"] == 7
        rc = main(["measure", "--url", url, "--num-prompts", "2", "--max-new-tokens", "16", "--warmup", "0",
                   "--quiet", "--outputs", str(tmp_path), "--timeout", "30"])
    line = _one_error(capsys, "measure")
    assert rc == 1 and "2 of 2 requests failed" in line, line
    assert ("/v1/completions (request cmpl-1): impossible spec counters: identity 'dense histogram of num_steps + 1 "
            "bins' broken: spec_correct_drafts_histogram has 4 bins, the engine writes num_steps + 1 = 8 "
            "(num_speculative_tokens from GET /metrics") in line, line
    assert not list(tmp_path.rglob("ledger.parquet"))        # nothing measured: nothing recorded as "steps 7"


def test_vllm_may_propose_fewer_drafts_than_k_per_step_but_never_more():
    """vLLM trims a step's drafts to the token budget (v1/core/sched/scheduler.py::Scheduler.schedule), so proposed
    <= verify steps x k is its identity, not SGLang's equality: 14 drafts over 5 steps of k = 3 is an answer vLLM
    gives; 16 is not."""
    fewer, more = copy.deepcopy(ANSWER), copy.deepcopy(ANSWER)
    for a, n in ((fewer, 14), (more, 16)):
        a["metrics"]["speculative_decoding"].update(num_draft_tokens=n, draft_acceptance_rate=10 / n)
    with vllm_server(answer=fewer) as (url, _), VLLMClient(url) as c:
        c.server_info()
        assert c.generate(input_ids=[1, 2], max_new_tokens=16).meta_info.spec_num_proposed_drafts == 14
    with vllm_server(answer=more) as (url, _), VLLMClient(url) as c:
        c.server_info()
        with pytest.raises(SGLangError, match=r"identity 'proposed <= verify steps x \(draft tokens - 1\)' broken: "
                                              r"spec_num_proposed_drafts 16 > spec_verify_ct 5 x "
                                              r"\(speculative_num_draft_tokens 4 - 1\) = 15"):
            c.generate(input_ids=[1, 2], max_new_tokens=16)


@pytest.mark.parametrize("where, value, field", [
    ("speculative_decoding", {"num_accepted_draft_tokens": -4}, "metrics.speculative_decoding.num_accepted_draft_tokens"),
    ("speculative_decoding", {"acceptance_histogram": [1, -1, 2, 3]}, "metrics.speculative_decoding.acceptance_histogram.1"),
    ("usage", {"completion_tokens": -16}, "usage.completion_tokens"),
    ("choice", {"token_ids": [1, -2]}, "choices.0.token_ids.1"),
])
def test_negative_counters_name_their_field(where, value, field):
    """Issue 40: negative counters were "4 validation errors for GenerateResult" with no field named; the answer is
    checked as vLLM writes it and the first bad field is named with its value."""
    bad = copy.deepcopy(ANSWER)
    {"speculative_decoding": bad["metrics"]["speculative_decoding"], "usage": bad["usage"],
     "choice": bad["choices"][0]}[where].update(value)
    with vllm_server(answer=bad) as (url, _), VLLMClient(url) as c:
        with pytest.raises(SGLangError) as err:
            c.generate(input_ids=[1, 2], max_new_tokens=16)
    msg = str(err.value)
    assert msg.startswith(f"POST {url}/v1/completions: field {field}: Input should be greater than or equal to 0, "
                          "got -"), msg


def test_the_worker_report_is_bounded_by_the_target_and_never_empty(tmp_path):
    """Issue 40: e3f_describe with 10^12 layers exhausted memory in _write_layers, one whose rank list is empty was an
    IndexError: the report is checked before anything is sized by it (layers within 1024, and equal to the target
    config's num_hidden_layers when that is readable here), an empty list named; nothing is captured."""
    from helpers.engines.vllm import VLLMAdapter

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8}))
    cases = [([{**DESCRIBE, "num_layers": 10 ** 12}], MODELS,
              "(rank 0): field num_layers: Input should be less than or equal to 1024, got 1000000000000"),
             ([DESCRIBE, {**DESCRIBE, "tp_rank": 1, "num_layers": 9}], _models(root=str(target)),
              f"(rank 1): field num_layers: 9 layers, but the target's config.json ({target}) has num_hidden_layers 8"),
             ([], MODELS, "e3f_describe: no rank answered (expected one object per TP rank)")]
    for ranks, models, expect in cases:
        out = tmp_path / f"out{len(ranks)}"
        with vllm_server(ranks=ranks, models=models) as (url, seen), VLLMClient(url) as c:
            with pytest.raises(SGLangError) as err:
                VLLMAdapter().capture_served(c, [[1, 2, 3]], out, layers=True)
        assert str(err.value).startswith(f"POST {url}/collective_rpc e3f_describe") and expect in str(err.value), \
            str(err.value)
        assert not seen and not (out / "served").exists()
    with vllm_server(models=_models(root=str(target))) as (url, _), VLLMClient(url) as c:
        assert c.describe()[0]["num_layers"] == 8           # the true report passes


def test_a_capture_index_cannot_open_a_file_outside_its_folder(tmp_path):
    """Issue 40: a record of the worker's index.jsonl naming ``../x`` (or an absolute path, or a link out of the
    folder) made the capture open that file; it is refused naming the index, the line and the field, before any file
    is opened."""
    import torch
    from safetensors.torch import save_file

    from helpers.capture import per_rank_dumps, read_rank_capture
    from helpers.engines.vllm_capture import _segments

    secret = tmp_path / "secret.safetensors"
    save_file({"positions": torch.zeros(1, dtype=torch.int64)}, str(secret))
    rank0 = tmp_path / "cap" / "rank0"
    rank0.mkdir(parents=True)
    save_file({"positions": torch.zeros(1, dtype=torch.int64)}, str(rank0 / "prop0.safetensors"))
    (rank0 / "link.safetensors").symlink_to(secret)
    for bad in ("../../secret.safetensors", str(secret), "link.safetensors", 5):
        (rank0 / "index.jsonl").write_text(json.dumps({"file": "prop0.safetensors"}) + "\n"
                                           + json.dumps({"file": bad}) + "\n")
        for read in (_segments, read_rank_capture, lambda cap: per_rank_dumps(cap, tmp_path / "d")):
            with pytest.raises(SGLangError) as err:
                read(tmp_path / "cap")
            assert str(err.value).startswith(f"{rank0 / 'index.jsonl'}: line 2: field file: {bad!r} is not a file "
                                             f"name inside {rank0}"), str(err.value)
    (rank0 / "index.jsonl").write_text(json.dumps({"file": "prop0.safetensors"}) + "\n")
    assert len(_segments(tmp_path / "cap")) == 1


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_a_vllm_capture_exits_with_the_signal(sig, tmp_path, capsys):
    """Issue 40: a signal while a vLLM capture waits for a completion exited 1 (the disarm in a ``finally`` failed on
    the spent budget and replaced the interruption); it exits 143 / 130 with one line naming the signal, and the
    capture is disarmed first (the worker-extension call that stops it was tried)."""
    import signal as signals

    from helpers.__main__ import main
    from helpers.budget import reset_interrupt
    from support.fakerun import write_training

    training = write_training(tmp_path / "train")
    signum = getattr(signals, sig)
    with vllm_server(hang=True) as (url, seen):
        timer = threading.Timer(1.5, lambda: os.kill(os.getpid(), signum))
        timer.start()
        t = time.monotonic()
        try:
            rc = main(["capture", "--url", url, "--training", str(training), "--run-dir", str(tmp_path),
                       "--num-samples", "1", "--timeout", "60"])
        finally:
            timer.cancel()
            took = time.monotonic() - t
            reset_interrupt()            # the signal marked this process as stopping: later tests run in it too
    line = _one_error(capsys, "capture")
    assert rc == 128 + signum and took < 1.5 + 2.0, (rc, took, line)
    assert line == f"capture: error: interrupted by {sig}" and len(seen) == 1, line
    assert not (tmp_path / "dumps" / "served").exists()
