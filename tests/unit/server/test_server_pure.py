"""helpers.server without a server: redaction, launch parsing, override rules, client error paths.

The error paths use httpx.MockTransport (httpx's own in-process transport) to play the exact
answers SGLang 0.5.23 gives (status codes and bodies copied from sglang/srt/entrypoints/http_server.py
and tokenizer_manager.py); the live behaviour is covered in test_server_client.py.
"""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from helpers.errors import AuthError, CacheBusy, EndpointMissing, HiddenStatesDisabled, MetricsDisabled, RequestRejected, ServerUnavailable
from helpers.server.client import SGLangClient
from helpers.server.settings import detect_overrides, parse_launch_args
from helpers.redaction import redact, redact_argv, redact_url

KEY = "sk-unit-4f1c9e2b77"


def test_redact_drops_secret_fields_everywhere_and_scrubs_strings():
    info = {"api_key": KEY, "admin_api_key": "adm-secret-xyz", "tp_size": 2,
            "ssl_keyfile_password": "pw-1234", "bucket_time_to_first_token": [0.1, 0.2],
            "kt_max_deferred_experts_per_token": 3,
            "launch_command": f"--model-path /m --api-key {KEY} --admin-api-key=adm-secret-xyz --tp-size 2",
            "internal_states": [{"api_key": KEY, "avg_spec_accept_length": 2.5, "note": f"key={KEY}"}]}
    out = redact(info)
    text = json.dumps(out)
    assert KEY not in text and "adm-secret-xyz" not in text and "pw-1234" not in text
    assert "api_key" not in out and "admin_api_key" not in out
    assert out["tp_size"] == 2 and out["bucket_time_to_first_token"] == [0.1, 0.2]
    assert out["kt_max_deferred_experts_per_token"] == 3
    assert out["launch_command"] == "--model-path /m --api-key <redacted> --admin-api-key=<redacted> --tp-size 2"
    assert out["internal_states"][0] == {"avg_spec_accept_length": 2.5, "note": "key=<redacted>"}
    assert redact({"x": "abc token-XYZ"}, ["token-XYZ"]) == {"x": "abc <redacted>"}


def test_redact_scrubs_keys_held_as_dict_keys_nested_and_in_commands():
    """Issue 21: a key used as a dict key (nested), an admin key only present in launch_command, and a secret
    field holding a list: none survives, in values or keys, and every later text is scrubbed of them too."""
    from helpers.redaction import argv_secrets, scrub

    k2 = "adm-unit-9e1f2c3d"
    info = {"launch_command": ["sglang", "--api-key", KEY, f"--admin-api-key={k2}"],
            "lora_paths": {KEY: "/a", "b": {k2: [f"x {KEY} y"]}, "<redacted>": "/c"},
            "hf_token": ["tok-unit-55aa66bb"]}
    out = redact(info)
    text = json.dumps(out)
    assert KEY not in text and k2 not in text and "tok-unit-55aa66bb" not in text, text
    assert out["launch_command"] == ["sglang", "--api-key", "<redacted>", "--admin-api-key=<redacted>"]
    assert out["lora_paths"] == {"<redacted>": "/a", "b": {"<redacted>": ["x <redacted> y"]}, "<redacted>-2": "/c"}
    assert "hf_token" not in out
    assert argv_secrets(f"python -m sglang.launch_server --api-key {KEY} --admin-api-key={k2} --tp 2") == [KEY, k2]
    assert scrub(f"log: started with {k2}; token tok-unit-55aa66bb") == "log: started with <redacted>; token <redacted>"


def test_redact_argv_and_url():
    assert redact_argv(["sglang", "--api-key", "k1", "--hf-token=t2", "--speculative-num-draft-tokens",
                        "4", "--ssl-keyfile", "/k.pem"]) == [
        "sglang", "--api-key", "<redacted>", "--hf-token=<redacted>", "--speculative-num-draft-tokens",
        "4", "--ssl-keyfile", "/k.pem"]
    assert redact_url("http://user:pw@host:30000/x?token=abc") == "http://host:30000/x"


def test_parse_launch_args_forms():
    cmd = ("python -m sglang.launch_server --model /m/t --speculative-algorithm eagle3 "
           "--speculative-draft-model /m/d --speculative-num-steps=5 --speculative-eagle-topk 1 "
           "--speculative-num-draft-tokens 8 --tensor-parallel-size 8 --enable-return-hidden-states "
           f"--api-key {KEY}")
    a = parse_launch_args(cmd)
    assert a["model_path"] == "/m/t" and a["speculative_draft_model_path"] == "/m/d"
    assert a["speculative_algorithm"] == "EAGLE3" and a["speculative_num_steps"] == 5
    assert a["speculative_num_draft_tokens"] == 8 and a["tp_size"] == 8
    assert a["enable_return_hidden_states"] is True and "api_key" not in a
    assert parse_launch_args(cmd.split()) == a
    b = parse_launch_args({"spec": {"num_steps": 3, "topk": 1, "num_draft_tokens": "6"}, "tp": 2})
    assert b == {"speculative_num_steps": 3, "speculative_eagle_topk": 1,
                 "speculative_num_draft_tokens": 6, "tp_size": 2}
    from helpers.server.settings import SpecSettings

    c = parse_launch_args(SpecSettings(num_steps=2, topk=1, num_draft_tokens=7).with_launch_defaults())
    assert c["speculative_num_draft_tokens"] == 7 and c["speculative_algorithm"] == "EAGLE3"


EFFECTIVE = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
             "speculative_num_draft_tokens": 4, "max_running_requests": 48, "tp_size": 1, "dp_size": 1}


def test_detect_overrides_forced_draft_tokens_and_max_running_requests():
    req = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
           "speculative_num_draft_tokens": 6}
    ov = {o.field: o for o in detect_overrides(req, EFFECTIVE)}
    assert set(ov) == {"speculative_num_draft_tokens", "max_running_requests"}
    d = ov["speculative_num_draft_tokens"]
    assert (d.requested, d.effective, d.kind, d.finding) == (6, 4, "forced", "num_draft_tokens_overridden")
    assert ov["max_running_requests"].kind == "default_forced"
    # everything asked for explicitly and honoured: nothing to report
    req2 = dict(req, speculative_num_draft_tokens=4, max_running_requests=48)
    assert detect_overrides(req2, EFFECTIVE) == []


def test_detect_overrides_auto_chosen_values_by_architecture():
    eff = dict(EFFECTIVE, speculative_num_steps=5, speculative_eagle_topk=4, speculative_num_draft_tokens=8)
    ov = detect_overrides({"speculative_algorithm": "EAGLE3", "max_running_requests": 48}, eff,
                          target_arch="LlamaForCausalLM")
    assert [(o.field, o.effective, o.kind) for o in ov] == [
        ("speculative_num_steps", 5, "auto_chosen"), ("speculative_eagle_topk", 4, "auto_chosen"),
        ("speculative_num_draft_tokens", 8, "auto_chosen")]
    assert "(5, 4, 8)" not in ov[0].message and "5" in ov[0].message


def test_detect_overrides_algorithm_vs_draft():
    eff = dict(EFFECTIVE, speculative_algorithm="EAGLE")
    req = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
           "speculative_num_draft_tokens": 4, "max_running_requests": 48}
    ov = detect_overrides(req, eff, draft_archs=["LlamaForCausalLMEagle3"])
    assert [(o.field, o.finding) for o in ov] == [("speculative_algorithm", "fc_bypassed")]
    assert detect_overrides(req, eff, draft_archs=["LlamaForCausalLMEagle"]) == []
    assert detect_overrides({}, {"speculative_algorithm": None}) == []


def _mock(handler):
    return SGLangClient("http://sglang.test:30000", api_key=KEY, transport=httpx.MockTransport(handler),
                        retries=2, backoff=0.01)


def test_client_auth_error_never_shows_the_key():
    seen = []

    def handler(req):
        seen.append(req.headers.get("authorization"))
        return httpx.Response(401, json={"error": "Unauthorized"})

    c = _mock(handler)
    with pytest.raises(AuthError) as err:
        c.server_info()
    assert seen == [f"Bearer {KEY}"]  # sent as a bearer token, once (no retry on 401)
    assert KEY not in str(err.value) and "refused" in str(err.value)
    assert KEY not in repr(c) and "api_key=set" in repr(c)


def test_client_api_key_from_env(monkeypatch):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)
    got = []
    c = SGLangClient("http://x:1", transport=httpx.MockTransport(
        lambda r: got.append(r.headers.get("authorization")) or httpx.Response(200, text="ok")))
    assert c.health() and got == [f"Bearer {KEY}"]
    monkeypatch.delenv("SGLANG_API_KEY")
    c2 = SGLangClient("http://x:1", transport=httpx.MockTransport(
        lambda r: got.append(r.headers.get("authorization")) or httpx.Response(200, text="ok")))
    assert c2.health() and got[-1] is None


def test_client_falls_back_to_old_endpoints():
    paths = []

    def handler(req):
        paths.append(req.url.path)
        if req.url.path in ("/server_info", "/model_info"):
            return httpx.Response(404, json={"detail": "Not Found"})
        if req.url.path == "/get_server_info":
            return httpx.Response(200, json={"tp_size": 8, "api_key": KEY, "version": "0.4.9"})
        return httpx.Response(200, json={"architectures": ["LlamaForCausalLM"]})

    c = _mock(handler)
    info = c.server_info()
    assert info == {"tp_size": 8, "version": "0.4.9", "engine": "sglang"}   # the client contract's engine name
    assert c.model_info()["architectures"] == ["LlamaForCausalLM"]
    assert paths == ["/server_info", "/get_server_info", "/model_info", "/get_model_info"]


def test_client_flush_cache_retries_while_busy_then_gives_up():
    calls = []

    def busy_then_ok(req):
        calls.append(req.url.path)
        return httpx.Response(400 if len(calls) < 3 else 200, text="busy" if len(calls) < 3 else "ok")

    assert _mock(busy_then_ok).flush_cache(timeout=5, poll=0.01) >= 0 and len(calls) == 3
    with pytest.raises(CacheBusy, match="still HTTP 400"):
        _mock(lambda r: httpx.Response(400, text="busy")).flush_cache(timeout=0.05, poll=0.01)


def test_client_hidden_states_refusal_names_the_flag():
    body = {"error": {"message": "The server is not configured to return hidden states. Please set "
                                 "`--return-hidden-states-mode last`, `--return-hidden-states-mode full`, "
                                 "or the legacy `--enable-return-hidden-states` flag."}}
    c = _mock(lambda r: httpx.Response(400, json=body))
    with pytest.raises(HiddenStatesDisabled, match="restart it with --enable-return-hidden-states"):
        c.generate(input_ids=[1, 2], max_new_tokens=2, return_hidden_states=True)
    c2 = _mock(lambda r: httpx.Response(400, json={"error": {"message": "bad sampling param"}}))
    with pytest.raises(RequestRejected, match="bad sampling param") as err:
        c2.generate(text="hi", max_new_tokens=2)
    assert not isinstance(err.value, HiddenStatesDisabled)
    with pytest.raises(ValueError):
        c2.generate()


def test_client_metrics_disabled_and_parsed():
    with pytest.raises(MetricsDisabled, match="--enable-metrics"):
        _mock(lambda r: httpx.Response(404, text="Not Found")).metrics()
    text = ("# HELP sglang:spec_verify_calls_total Number of verify calls.\n"
            "# TYPE sglang:spec_verify_calls_total counter\n"
            'sglang:spec_verify_calls_total{model_name="m"} 69.0\n'
            "# HELP sglang:spec_accept_length Mean.\n# TYPE sglang:spec_accept_length gauge\n"
            'sglang:spec_accept_length{model_name="m",tp_rank="0"} 1.5\n')
    c = _mock(lambda r: httpx.Response(200, text=text))
    df = c.metrics("sglang:spec_")
    assert set(df["sample"]) == {"sglang:spec_verify_calls_total", "sglang:spec_accept_length"}
    assert c.metric_value("sglang:spec_verify_calls_total") == 69.0
    assert c.metric_value("sglang:spec_accept_length", tp_rank="0") == 1.5
    assert c.metric_value("sglang:nope") is None


def test_client_unreachable_server_retries_then_explains():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = SGLangClient(f"http://127.0.0.1:{port}", api_key=KEY, retries=2, backoff=0.05, timeout=2)
    t0 = time.monotonic()
    with pytest.raises(ServerUnavailable) as err:
        c.server_info()
    msg = str(err.value)
    assert "after 3 attempt(s)" in msg and "cannot connect" in msg and KEY not in msg
    assert time.monotonic() - t0 >= 0.05 + 0.1  # backoff 0.05, 0.1 between the 3 attempts
    with pytest.raises(EndpointMissing):
        _mock(lambda r: httpx.Response(404)).server_info()
    with pytest.raises(ValueError, match="http://host:port"):
        SGLangClient("localhost:30000")


def test_client_retries_503_on_probes_only():
    n = []

    def handler(req):
        n.append(req.url.path)
        return httpx.Response(503)

    c = _mock(handler)
    with pytest.raises(ServerUnavailable, match="HTTP 503"):
        c.server_info()
    assert n.count("/server_info") == 3
    n.clear()
    with pytest.raises(ServerUnavailable):
        c.generate(input_ids=[1], max_new_tokens=2)
    assert n == ["/generate"]  # not retried: the request may have run


def test_redaction_keeps_paths_of_this_tools_hook_specs():
    """The stash specs name their tensor in a field redaction does not treat as a secret, so a path containing
    "embedding" survives /server_info redaction (the investigation reads the draft path from it)."""
    from helpers.capture import server_hook_specs
    from helpers.investigation.attach import capture_hooks
    from helpers.redaction import redact

    hooks = server_hook_specs(8, rank_capture_dir="/x/ranks", layers_dir="/x/layers",
                              faults=[{"kind": "embedding_in_place_of_layer", "chunk": 0}])
    info = redact({"speculative_draft_model_path": "/runs/drafts/ids-1-1-3-embedding-first", "forward_hooks": hooks,
                   "api_key": "sk-very-secret", "launch_command": "--api-key sk-very-secret --port 1"})
    assert info["speculative_draft_model_path"] == "/runs/drafts/ids-1-1-3-embedding-first"
    assert "sk-very-secret" not in json.dumps(info) and "api_key" not in info
    ranks, layers, others = capture_hooks(info)
    assert (str(ranks), str(layers)) == ("/x/ranks", "/x/layers")
    assert [h["name"] for h in others] == ["e3f-faults"]


@pytest.mark.parametrize("answer, expect", [
    (httpx.Response(200, content=b"[" * 5000 + b"]" * 5000),
     "/server_info: the answer nests arrays/objects too deeply"),
    (httpx.Response(200, json=[{"tp_size": 2}]), "/server_info: expected a JSON object (server info), got a list"),
    (httpx.Response(200, json={"speculative_num_steps": 3e6}), "field speculative_num_steps: Input should be less"),
    (httpx.Response(200, json={"tp_size": "two"}), "field tp_size: Input should be a valid integer"),
    (httpx.Response(307, json={"tp_size": 2}, headers={"location": "http://u:p@other:1/x?t=1"}),
     "HTTP 307 redirect to http://other:1/x; this tool does not follow redirects"),
])
def test_client_refuses_malformed_server_info(answer, expect):
    """Issue 21, causes 6 and 10: one SGLangError naming the endpoint and the field, never a raw AttributeError,
    TypeError, RecursionError, and never the body of a redirect taken for the answer."""
    from helpers.errors import SGLangError

    with pytest.raises(SGLangError) as exc:
        _mock(lambda r: answer).server_info()
    assert expect in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_client_server_info_values_are_the_checked_ones():
    info = _mock(lambda r: httpx.Response(200, json={"tp_size": "2", "speculative_num_steps": 3.0, "version":
                                                     "0.5.23\x1b]0;title\x07", "other": {"x": 1}})).server_info()
    assert info == {"tp_size": 2, "speculative_num_steps": 3, "version": "0.5.23", "other": {"x": 1},
                    "engine": "sglang"}


def test_flush_cache_gives_up_at_once_on_an_unexpected_status():
    calls = []

    def handler(req):
        calls.append(req.url.path)
        return httpx.Response(500, text="boom \x1b[2J")

    with pytest.raises(RequestRejected, match="flush_cache: HTTP 500: boom $"):
        _mock(handler).flush_cache(timeout=30, poll=0.01)
    assert calls == ["/flush_cache"]


def test_spec_problem_names_counters_no_server_produces():
    """Issue 21, cause 7: the bounds of MetaInfo.spec_problem, from SGLang's counting (num_steps 3)."""
    from pydantic import ValidationError

    from helpers.server.protocol import MetaInfo

    def problem(**meta):
        return MetaInfo(**{"spec_verify_ct": 2, "completion_tokens": 7, "spec_num_correct_drafts": 4,
                           "spec_num_proposed_drafts": 6, **meta}).spec_problem(3)

    assert problem() is None                                           # 1 prefill + 2 x (2 accepted + bonus)
    assert problem(completion_tokens=9, spec_num_correct_drafts=6) is None   # the most 2 verify steps give
    assert "50 > spec_num_proposed_drafts 3" in problem(spec_num_correct_drafts=50, spec_num_proposed_drafts=3)
    assert "7 > 2 verify steps x 3" in problem(spec_num_correct_drafts=7, spec_num_proposed_drafts=12)
    assert "10 completion tokens from 2 verify steps" in problem(completion_tokens=10)
    assert "has 5 bins" in problem(spec_correct_drafts_histogram=[0, 0, 0, 1, 1])
    assert MetaInfo(spec_verify_ct=2, spec_num_correct_drafts=50, spec_num_proposed_drafts=3).spec_problem(None)
    for bad in ({"completion_tokens": -20}, {"spec_verify_ct": -1}, {"spec_correct_drafts_histogram": [1, -1]},
                {"spec_correct_drafts_histogram": [0] * 3_000_000}):
        with pytest.raises(ValidationError):
            MetaInfo(**bad)


def test_spec_identities_respect_what_sglang_allows():
    """Issue 27 item 5: what SGLang 0.5.23 may send is never refused -- an answer with no verify step and zero
    counters (2025 servers sent spec_verify_ct 0 on every answer), tokens after a retraction's re-prefill, an
    adaptive server's other draft lengths, reported ratios up to float rounding -- and what it cannot send is."""
    from pydantic import ValidationError

    from helpers.server.protocol import SPEC_IDENTITIES, MetaInfo

    ok = {"spec_verify_ct": 4, "completion_tokens": 9, "spec_num_correct_drafts": 4, "spec_num_proposed_drafts": 28,
          "spec_correct_drafts_histogram": [0, 4], "spec_accept_length": 9 / 4, "spec_accept_rate": 4 / 28}

    def problem(adaptive=False, **meta):
        return MetaInfo(**{**ok, **meta}).spec_problem(3, num_draft_tokens=8, adaptive=adaptive)

    assert problem() is None
    assert MetaInfo(spec_verify_ct=0, spec_accept_length=0, spec_num_correct_drafts=0).spec_problem(3) is None
    assert "'no verify step, no draft'" in MetaInfo(spec_verify_ct=0, spec_accept_length=2.0).spec_problem(3)
    # a retracted request is prefilled again: one more token per retraction
    assert "completion tokens <= 1 + retractions" in problem(completion_tokens=11, spec_accept_length=11 / 4)
    assert problem(completion_tokens=11, spec_accept_length=11 / 4, num_retractions=2) is None
    # adaptive: steps and draft tokens change at run time; the static bounds are not checked, the rest is
    assert "'proposed = verify steps x (draft tokens - 1)'" in problem(spec_num_proposed_drafts=20,
                                                                       spec_accept_rate=4 / 20)
    assert problem(adaptive=True, spec_num_proposed_drafts=20, spec_accept_rate=4 / 20) is None
    assert problem(adaptive=True, spec_num_correct_drafts=15, completion_tokens=18, spec_accept_length=4.5,
                   spec_accept_rate=15 / 28, spec_correct_drafts_histogram=[0, 0, 0, 1, 3]) is None
    assert "'histogram weights" in problem(adaptive=True, spec_correct_drafts_histogram=[1, 2, 0, 1])
    assert problem(spec_accept_length=9 / 4 * (1 + 1e-12)) is None              # a double's rounding
    assert "'spec_accept_length = " in problem(spec_accept_length=2.3)
    # each identity message starts with its declared name
    assert all(name in SPEC_IDENTITIES for name in ("accepted <= proposed", "histogram sums to the verify steps"))
    with pytest.raises(ValidationError, match="spec_accept_length"):
        MetaInfo(**{**ok, "spec_accept_length": float("nan")})


# ------------------------------------------------------------------------------------------------ ports

def test_ports_a_port_a_range_and_the_environment(monkeypatch):
    import socket

    from helpers.cli.server import _without_port
    from helpers.errors import BadServerInput
    from helpers.server.restart import set_flags
    from helpers.server import embedded

    assert embedded.parse_ports("30000") == (30000, 30000) and embedded.parse_ports(" 30000-30010") == (30000, 30010)
    assert embedded.parse_ports("") is None and embedded.parse_ports(None) is None
    for bad in ("x", "30010-30000", "0", "70000", "1-2-3"):
        with pytest.raises(BadServerInput, match="--port"):
            embedded.parse_ports(bad, what="--port")
    assert embedded.pick_port("31234") == 31234
    # a range: a free port of it; a taken port is never picked
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        p = taken.getsockname()[1]
        assert {embedded.pick_port(f"{p}-{p + 1}") for _ in range(20)} == {p + 1}
        with pytest.raises(BadServerInput, match=f"no free TCP port in {p}-{p}"):
            embedded.free_port(low=p, high=p)
    monkeypatch.setenv(embedded.PORT_RANGE_ENV, "31000-31003")
    assert embedded.port_range() == (31000, 31003) and 31000 <= embedded.pick_port(None) <= 31003
    monkeypatch.setenv(embedded.PORT_RANGE_ENV, "nonsense")
    with pytest.raises(BadServerInput, match="E3F_PORT_RANGE"):
        embedded.free_port()
    # a relaunch listens on 127.0.0.1 at the chosen port, whatever the command said
    argv = set_flags(["python", "-m", "sglang.launch_server", "--host", "0.0.0.0", "--port=30000", "--tp", "8"],
                      {"--host": "127.0.0.1", "--port": "31001"})
    assert argv == ["python", "-m", "sglang.launch_server", "--tp", "8", "--host", "127.0.0.1", "--port", "31001"]
    assert _without_port(["--tp", "2", "--port", "30000-30010", "--port=1", "--", "--port", "9"]) == \
        ["--tp", "2", "--", "--port", "9"]


def test_investigate_refuses_a_bad_port_before_any_request(tmp_path):
    from helpers.errors import BadInput
    from helpers.investigation.live import investigate

    with pytest.raises(BadInput, match="--port"):
        investigate("http://127.0.0.1:9", training=tmp_path, run_dir=tmp_path / "run", port="30010-30000")
    assert not (tmp_path / "run").exists()
