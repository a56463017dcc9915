"""helpers.server against a real reference server (SGLang 0.5.23 on CPU, tiny random models).

One server for the module: TP 1, EAGLE3 with topk 1, num_steps 3 and num_draft_tokens 6 (SGLang
forces 4 = steps + 1), an API key, metrics on, and *without* --enable-return-hidden-states.
"""
from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers.acceptance.measure import measure
from helpers.plots.acceptance import write_report
from helpers.server.settings import SpecSettings
from helpers.server.embedded import start
from helpers.acceptance.ledger import Ledger
from helpers.runfiles import new_run_dir
from helpers.errors import AuthError, HiddenStatesDisabled
from helpers.server.client import SGLangClient

pytestmark = pytest.mark.server

KEY = "sk-e3f-" + os.urandom(8).hex()


@pytest.fixture(scope="module")
def server(tiny_target, tiny_draft, tmp_path_factory):
    log = tmp_path_factory.mktemp("srvlog") / "server.log"
    handle = start(tiny_target, tiny_draft, tp=1, api_key=KEY, return_hidden_states=False,
                   spec=SpecSettings(num_steps=3, topk=1, num_draft_tokens=6), log_path=log, timeout=300)
    yield handle
    handle.stop()


@pytest.fixture()
def client(server):
    with SGLangClient(server.url, api_key=KEY) as c:
        yield c


def _raw_info(server):
    r = httpx.get(server.url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    r.raise_for_status()
    return r.json()


def test_silent_num_draft_tokens_override_is_detected(server, client):
    raw = _raw_info(server)
    # what SGLang did (sglang/srt/arg_groups/speculative_hook.py): 6 was asked, steps + 1 runs
    assert "--speculative-num-draft-tokens 6" in raw["launch_command"]
    assert raw["speculative_num_draft_tokens"] == raw["speculative_num_steps"] + 1 == 4
    assert raw["max_running_requests"] == 48
    eff = client.effective_spec_config()
    assert eff.requested_from == "launch_command"
    assert eff.requested.num_draft_tokens == 6 and eff.effective.num_draft_tokens == 4
    ov = {o.field: o for o in eff.overrides}
    assert ov["speculative_num_draft_tokens"].finding == "num_draft_tokens_overridden"
    assert (ov["speculative_num_draft_tokens"].requested, ov["speculative_num_draft_tokens"].effective) == (6, 4)
    assert ov["max_running_requests"].effective == 48
    assert eff.draft_architectures == ["LlamaForCausalLMEagle3"]
    assert eff.target_architectures == ["LlamaForCausalLM"] and eff.sglang_version == raw["version"]
    assert eff.draft_positions == 3
    # the same from a user-given launch description (SpecSettings as a fixes file would give it)
    eff2 = client.effective_spec_config({"spec": {"num_steps": 3, "topk": 1, "num_draft_tokens": 6},
                                         "max_running_requests": 48})
    assert eff2.requested_from == "argument"
    assert eff2.override_fields() == ["speculative_num_draft_tokens"]
    eff3 = client.effective_spec_config(SpecSettings(num_steps=3, topk=1, num_draft_tokens=4))
    assert "speculative_num_draft_tokens" not in eff3.override_fields()


def test_server_info_snapshot_is_redacted(server, client):
    raw = _raw_info(server)
    assert raw["api_key"] == KEY and KEY in raw["launch_command"]  # SGLang really leaks it
    info = client.server_info(refresh=True)
    text = json.dumps(info)
    assert KEY not in text and "api_key" not in info
    assert info["tp_size"] == 1 and info["speculative_algorithm"] == "EAGLE3"
    assert "--api-key <redacted>" in info["launch_command"]
    assert info["internal_states"] and "api_key" not in info["internal_states"][0]


def test_auth_errors(server):
    with SGLangClient(server.url, api_key="", retries=0) as anon:
        assert anon.health()  # /health needs no key
        with pytest.raises(AuthError, match="started with --api-key"):
            anon.server_info()
    wrong = "sk-wrong-" + os.urandom(4).hex()
    with SGLangClient(server.url, api_key=wrong, retries=0) as bad:
        with pytest.raises(AuthError, match="refused") as err:
            bad.generate(text="hello", max_new_tokens=2)
        assert wrong not in str(err.value)


def test_generate_text_and_token_ids_agree(client):
    a = client.generate(text="the quick brown fox jumps", max_new_tokens=12,
                        sampling_params={"ignore_eos": True}, return_prompt_token_ids=True)
    m = a.meta_info
    assert m.completion_tokens == len(a.output_ids) == 12
    assert a.prompt_token_ids and len(a.prompt_token_ids) == m.prompt_tokens
    assert m.has_spec_fields and m.spec_verify_ct >= 1
    # the server's own accept length is completion / verify (bonus + prefill token included)
    assert m.spec_accept_length == pytest.approx(m.completion_tokens / m.spec_verify_ct)
    assert sum(m.spec_correct_drafts_histogram) == m.spec_verify_ct
    assert sum(n * c for n, c in enumerate(m.spec_correct_drafts_histogram)) == m.spec_num_correct_drafts
    assert m.spec_num_proposed_drafts == m.spec_verify_ct * (4 - 1)  # effective draft tokens, not 6
    b = client.generate(input_ids=a.prompt_token_ids, max_new_tokens=12, sampling_params={"ignore_eos": True})
    assert b.output_ids == a.output_ids  # greedy: same tokens from text or from its ids
    assert a.latency_s >= m.e2e_latency > 0


def test_return_hidden_states_refused_with_the_flag_to_add(client):
    with pytest.raises(HiddenStatesDisabled) as err:
        client.generate(input_ids=[5, 6, 7, 8], max_new_tokens=4, return_hidden_states=True)
    assert "--enable-return-hidden-states" in str(err.value) and err.value.status == 400


def test_metrics_verify_counter_grows_by_the_requests_verify_steps(client):
    before = client.metric_value("sglang:spec_verify_calls_total")
    assert before is not None
    verify = 0
    for text in ("alpha beta", "the lazy dog", "draft tokens and targets"):
        verify += client.generate(text=text, max_new_tokens=10).meta_info.spec_verify_ct
    time.sleep(0.5)
    after = client.metric_value("sglang:spec_verify_calls_total")
    assert after - before == verify
    steps = client.metrics("sglang:spec_num_steps")
    assert steps["value"].max() == 3


def test_flush_cache_waits_until_idle(client, server):
    done = {}

    def long_request():
        with SGLangClient(server.url, api_key=KEY) as c2:
            c2.generate(input_ids=list(range(5, 40)), max_new_tokens=400,
                        sampling_params={"ignore_eos": True})
        done["t"] = time.monotonic()

    th = threading.Thread(target=long_request)
    th.start()
    deadline = time.monotonic() + 60
    while not (client.metric_value("sglang:num_running_reqs") or 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the server says the request is running (no guess at how long 400 tokens take)
    assert th.is_alive(), "the 400-token request ended before the flush could be tried"
    started = time.monotonic()
    waited = client.flush_cache(timeout=300, poll=0.1)
    flushed_at = time.monotonic()
    th.join(timeout=300)
    assert "t" in done and done["t"] <= flushed_at + 0.5  # flushed only once idle
    assert waited >= done["t"] - started - 0.5  # it waited for the running request, not a fixed time


def test_api_key_never_reaches_any_written_file(server, tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_API_KEY", KEY)  # the key comes from the environment here
    res = measure(server.url, num_prompts=4, max_new_tokens=8, concurrency=2, label="key-check",
                  n_boot=200, keep_raw=True, progress=False)
    assert res.summary["n_requests"] == 4 and res.summary["n_spec"] == 4
    run = new_run_dir("key-check", outputs=tmp_path / "outputs")
    res.save(run / "fixes" / "key-check")
    Ledger(run / "ledger.parquet").append(res.ledger_row("key-check"))
    write_report(Ledger(run / "ledger.parquet").read(), run / "figures.html")
    files = [p for p in (tmp_path / "outputs").rglob("*") if p.is_file()] + [Path(server.log_path)]
    assert len(files) >= 6
    for p in files:
        assert KEY.encode() not in p.read_bytes(), f"API key found in {p}"
    # the snapshot did hold the launch command, with the key replaced
    summary = json.loads((run / "fixes" / "key-check" / "summary.json").read_text())
    assert "--api-key <redacted>" in summary["server"]["launch_command"]
    assert KEY not in repr(res) and KEY not in str(res.summary)
