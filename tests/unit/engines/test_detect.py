"""Engine and version detection from a server's own endpoints (issue 29, deliverable 2 and "bad input"): fake servers
on 127.0.0.1 that answer like SGLang 0.5.23, vLLM 0.32.0 (the answers recorded from the embedded servers), a vLLM
release whose rules are unknown, and servers that are neither; bad input is one line, exit 2, naming what was found
and what is supported."""
from __future__ import annotations

import json
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler

import pytest

from helpers.__main__ import main
from helpers.engines.detect import detect, detect_or, supported_text
from helpers.errors import BadInput, SGLangError
from support.fakeserver import free_port, in_thread, send_json
from support.vllm_answers import METRICS_1

#: what the embedded vLLM 0.32.0 server answered (GET /version, GET /v1/models), trimmed
VLLM_MODELS = {"object": "list", "data": [{"id": "/tmp/h64/target", "object": "model", "owned_by": "vllm",
                                           "root": "/tmp/h64/target", "parent": None, "max_model_len": 512}]}
SGLANG_INFO = {"version": "0.5.23", "tp_size": 2, "speculative_algorithm": "EAGLE3", "model_path": "/m/target"}


@contextmanager
def serve(routes: dict[str, tuple[int, object]]):
    """An HTTP server on 127.0.0.1 answering GET ``path`` with ``routes[path] = (status, json or text)`` (404 for
    any other path); stopped on exit."""

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            send_json(self, *routes.get(self.path.split("?")[0], (404, {"detail": "Not Found"})))

        def log_message(self, *a):
            pass

    with in_thread(H) as url:
        yield url


def test_vllm_0_32_is_detected_from_version_and_models():
    with serve({"/version": (200, {"version": "0.32.0"}), "/v1/models": (200, VLLM_MODELS)}) as url:
        found = detect(url)
    assert (found.engine, found.version, found.adapter.label) == ("vllm", "0.32.0", "vLLM")
    assert found.evidence["/version"] == "0.32.0" and found.evidence["/v1/models owned_by"] == ["vllm"]


def test_sglang_is_detected_from_server_info():
    with serve({"/server_info": (200, SGLANG_INFO), "/v1/models": (200, {"data": [{"owned_by": "sglang"}]})}) as url:
        found = detect(url)
    assert (found.engine, found.version) == ("sglang", "0.5.23")


def test_unknown_vllm_release_is_one_line_naming_it_and_what_is_supported():
    with serve({"/version": (200, {"version": "0.31.2"}), "/v1/models": (200, VLLM_MODELS)}) as url:
        with pytest.raises(BadInput) as exc:
            detect(url)
    msg = str(exc.value)
    assert "\n" not in msg and "vLLM 0.31.2" in msg and "vLLM 0.32.0" in msg and "SGLang 0.5.6-0.5.23" in msg


def test_neither_engine_names_what_each_endpoint_answered():
    routes = {"/v1/models": (200, {"data": [{"id": "m", "owned_by": "tgi"}]}), "/info": (200, {"version": "3.1"})}
    with serve(routes) as url:
        with pytest.raises(BadInput) as exc:
            detect(url)
    msg = str(exc.value)
    assert "neither SGLang nor vLLM" in msg and "['tgi']" in msg and "/server_info -> HTTP 404" in msg
    assert "/version -> HTTP 404" in msg and supported_text() in msg and "\n" not in msg


def test_vllm_models_without_a_version_is_not_guessed():
    with serve({"/v1/models": (200, VLLM_MODELS)}) as url:
        with pytest.raises(BadInput, match="owned_by vllm but GET /version gives no version"):
            detect(url)


def test_sglang_server_info_without_server_args_is_not_taken_for_sglang():
    # a /server_info with a version but none of SGLang's ServerArgs fields (e.g. another engine's) is not SGLang
    with serve({"/server_info": (200, {"version": "1.0"}), "/version": (200, {"version": "1.0"})}) as url:
        with pytest.raises(BadInput, match="neither SGLang nor vLLM"):
            detect(url)


def test_unreachable_server_is_a_server_error_not_bad_input():
    with pytest.raises(SGLangError) as exc:
        detect(f"http://127.0.0.1:{free_port()}", deadline_s=5)
    assert not isinstance(exc.value, BadInput)


def test_cli_detect_prints_the_engine_and_exits_2_on_neither(capsys):
    with serve({"/version": (200, {"version": "0.32.0"}), "/v1/models": (200, VLLM_MODELS)}) as url:
        assert main(["server", "detect", "--url", url]) == 0
        assert capsys.readouterr().out.strip() == f"vLLM 0.32.0 at {url}"
    with serve({"/v1/models": (200, {"data": [{"owned_by": "llama.cpp"}]})}) as url:
        assert main(["server", "detect", "--url", url]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("server: error:") and "llama.cpp" in err[0]


def test_cli_server_start_vllm_refuses_sglang_only_flags_and_a_missing_target(capsys):
    assert main(["server", "start", "--engine", "vllm", "--draft", "/x"]) == 2
    assert "--target is required" in capsys.readouterr().err
    assert main(["server", "start", "--engine", "vllm", "--target", "/t", "--faults", "[]x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--faults apply to SGLang only" in err[0]
    assert main(["server", "start", "--engine", "vllm", "--target", "/t", "--trace-draft", "/tmp/x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trace-draft apply to SGLang only" in err[0]


def test_attach_without_the_worker_extension_uses_vllms_rules_and_says_so(tmp_path):
    """A vLLM server started by someone else (no dev mode, no extension): the draft is given, the ids come from vLLM
    0.32.0's rules on its config (a top-level list wins over eagle_config), num_speculative_tokens from /metrics."""
    from helpers.engines.vllm import VLLMAdapter

    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8}))
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                   "eagle_aux_hidden_state_layer_ids": [2, 5, 7],
                                                   "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    models = {"data": [{"id": "t", "owned_by": "vllm", "root": str(target), "max_model_len": 512}]}
    with serve({"/version": (200, {"version": "0.32.0"}), "/v1/models": (200, models),
                "/metrics": (200, METRICS_1)}) as url:
        ad = VLLMAdapter()
        cfg = ad.spec_config(ad.client(url), draft=draft)
    assert (cfg.num_speculative_tokens, cfg.method, cfg.target, cfg.draft) == (3, "eagle3", str(target), str(draft))
    assert cfg.aux_layer_ids == [2, 5, 7] and cfg.aux_tensors == ["out(1)", "out(4)", "out(6)"]
    assert "top" not in cfg.sources["aux_layer_ids"] and "eagle_aux_hidden_state_layer_ids" in cfg.sources[
        "aux_layer_ids"] and "gpu_model_runner.py::GPUModelRunner._get_eagle3_aux_layers_from_config" in cfg.sources[
        "aux_layer_ids"]
    assert any("no worker extension" in n for n in cfg.notes) and cfg.loaded is None


def test_measure_and_capture_take_vllm_when_it_answers_and_sglang_otherwise():
    """detect_or: vLLM recognised from its own endpoints, anything else left to SGLang's client (whose checks name
    a malformed /server_info), an unknown vLLM release still bad input."""
    from helpers.engines.detect import detect_or

    with serve({"/version": (200, {"version": "0.32.0"}), "/v1/models": (200, VLLM_MODELS)}) as url:
        assert detect_or(url).name == "vllm"
    with serve({"/server_info": (200, [1, 2])}) as url:
        assert detect_or(url).name == "sglang"
    with serve({"/version": (200, {"version": "0.40.1"}), "/v1/models": (200, VLLM_MODELS)}) as url:
        with pytest.raises(BadInput, match="0.40.1"):
            detect_or(url)


def test_an_sglang_version_that_is_not_a_release_is_refused_before_any_capture():
    """Found by an adversarial run: /server_info with ``version "banana"`` was taken for SGLang, captured and built
    the HF reference (~15 s) before failing on the version; it is one line at detection naming the endpoint and what
    is supported (each adapter's version_refusal, no engine branch in detect). A /v1/models whose ``data`` is not a
    list is not vLLM evidence (no TypeError)."""
    with serve({"/server_info": (200, {**SGLANG_INFO, "version": "banana"})}) as url:
        with pytest.raises(BadInput) as exc:
            detect(url)
        with pytest.raises(BadInput):
            detect_or(url, default="vllm")
    msg = str(exc.value)
    assert "\n" not in msg and "'banana'" in msg and "/server_info" in msg and "SGLang 0.5.6-0.5.23" in msg, msg
    with serve({"/v1/models": (200, {"data": 5}), "/server_info": (200, SGLANG_INFO)}) as url:
        assert detect(url).engine == "sglang"


def test_what_tells_a_malformed_sglang_from_a_server_that_is_not_sglang():
    """Issue 40: a /server_info answer that is not SGLang's object (HTML, a JSON list) is SGLang's malformed answer
    only when SGLang's other endpoints say it is SGLang (/model_info with model_path, /v1/models owned_by sglang):
    then a server error naming the endpoint, what it answered and why (exit 1); otherwise "neither", naming what each
    endpoint answered (exit 2). An object with a version and ServerArgs fields is SGLang's whatever its types: a
    wrongly-typed field is named."""
    page = "<html><body>router</body></html>"
    with serve({p: (200, page) for p in ("/server_info", "/model_info", "/version", "/v1/models")}) as url:
        with pytest.raises(BadInput) as exc:          # a web page on every path: not an engine
            detect(url)
    msg = str(exc.value)
    assert "neither SGLang nor vLLM" in msg and "\n" not in msg, msg
    assert f"/server_info -> HTTP 200 not JSON (application/json): {page}" in msg, msg
    assert f"/model_info -> HTTP 200 not JSON" in msg and "/v1/models -> HTTP 200 owned_by (unreadable)" in msg, msg
    with serve({"/server_info": (200, [SGLANG_INFO])}) as url:
        with pytest.raises(BadInput, match=r"/server_info -> HTTP 200 a JSON list, /model_info -> HTTP 404"):
            detect(url)
    sglang_models = {"data": [{"id": "m", "owned_by": "sglang"}]}
    with serve({"/server_info": (200, [SGLANG_INFO]), "/v1/models": (200, sglang_models)}) as url:
        with pytest.raises(SGLangError) as exc:
            detect(url)
    msg = str(exc.value)
    assert not isinstance(exc.value, BadInput) and msg.startswith(f"GET {url}/server_info: expected SGLang's server "
                                                                  "info"), msg
    assert msg.endswith("got a JSON list (the server is SGLang by GET /v1/models (owned_by \"sglang\"))"), msg
    with serve({"/server_info": (200, {**SGLANG_INFO, "speculative_num_steps": "three"})}) as url:
        with pytest.raises(SGLangError, match=f"GET {url}/server_info: field speculative_num_steps: Input should be "
                                              "a valid integer"):
            detect(url)
