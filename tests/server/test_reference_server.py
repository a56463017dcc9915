"""The embedded reference server: real SGLang 0.5.23 on CPU with the sgl_kernel stand-in.

Checks against HF transformers on the same weights (fp32): greedy tokens, and the aux hidden
states SGLang returns with ``return_hidden_states`` (``sglang/srt/layers/logits_processor.py``
concatenates the captured layers; ``sglang/srt/models/llama.py`` captures in(i) = HF
``hidden_states[i]`` for ``layers_to_capture = [id + 1 for id in eagle_aux_hidden_state_layer_ids]``).
"""
from __future__ import annotations

import json
import os
import socket
import time

import httpx
import psutil
import pytest
import torch

from helpers.server import embedded
from helpers.errors import BadServerInput, ServerStartError
from helpers.server.embedded import start

pytestmark = pytest.mark.server

PROMPT_IDS = [5, 17, 42, 99, 7, 250, 31, 8, 120, 64, 3, 77]
NEW_TOKENS = 24


def _alive(pids):
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.fixture(scope="module")
def hf_model(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, torch_dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def tp2_server(tiny_target, tiny_draft):
    t0 = time.monotonic()
    handle = start(tiny_target, tiny_draft, tp=2, timeout=300)
    handle.startup_s = time.monotonic() - t0
    pids = [p.pid for p in handle.processes()]
    yield handle
    handle.stop()
    assert _alive(pids) == [], "processes of the TP 2 server survived stop()"


def _generate(url, ids, n=NEW_TOKENS, hidden=False):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                  "ignore_eos": True}}
    if hidden:
        body["return_hidden_states"] = True
    r = httpx.post(url + "/generate", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


def _hf_greedy(model, ids, n=NEW_TOKENS):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             min_new_tokens=n, pad_token_id=2)
    return out[0, len(ids):].tolist()


def test_tp2_eagle3_health_server_info_and_spec_fields(tp2_server):
    assert httpx.get(tp2_server.url + "/health", timeout=30).status_code == 200
    info = httpx.get(tp2_server.url + "/server_info", timeout=30).json()
    assert info["tp_size"] == 2
    assert info["speculative_algorithm"] == "EAGLE3"
    assert info["speculative_num_steps"] == 3
    assert info["speculative_eagle_topk"] == 1
    assert info["speculative_num_draft_tokens"] == 4
    assert info["version"] == "0.5.23"
    out = _generate(tp2_server.url, PROMPT_IDS)
    meta = out["meta_info"]
    assert meta["completion_tokens"] == NEW_TOKENS
    assert meta["spec_verify_ct"] >= 1
    assert meta["spec_accept_length"] == pytest.approx(NEW_TOKENS / meta["spec_verify_ct"])


def test_tp2_greedy_tokens_equal_hf_greedy(tp2_server, hf_model):
    for ids in (PROMPT_IDS, PROMPT_IDS[:5], [9, 9, 9, 1 + 3, 200]):
        assert _generate(tp2_server.url, ids)["output_ids"] == _hf_greedy(hf_model, ids)


def test_tp2_return_hidden_states_are_captured_layers_of_hf(tp2_server, hf_model, tiny_draft):
    # a radix-cache hit would shorten the prompt block (batch_result_processor.py::_append_prefill_hidden_states)
    assert httpx.post(tp2_server.url + "/flush_cache", timeout=60).status_code == 200
    out = _generate(tp2_server.url, PROMPT_IDS, hidden=True)
    hs = out["meta_info"]["hidden_states"]
    h = hf_model.config.hidden_size
    assert len(hs) == out["meta_info"]["completion_tokens"]
    assert len(hs[0]) == len(PROMPT_IDS) and all(len(r) == 3 * h for r in hs[0])
    assert all(len(r) == 3 * h for r in hs[1:])
    served = torch.tensor(hs[0] + hs[1:])  # rows: prompt + output_ids[:-1]
    seq = PROMPT_IDS + out["output_ids"][:-1]
    assert served.shape == (len(seq), 3 * h)
    ids = json.loads((tiny_draft / "config.json").read_text())["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    capture = [i + 1 for i in ids]  # SGLang capture index = HF hidden_states index
    with torch.no_grad():
        ref = hf_model(torch.tensor([seq]), output_hidden_states=True).hidden_states
    expected = torch.cat([ref[k][0] for k in capture], dim=-1)
    torch.testing.assert_close(served, expected, atol=2e-4, rtol=2e-4)
    # and not any other layer: each chunk is closest to its own HF index
    for c, k in enumerate(capture):
        chunk = served[:, c * h:(c + 1) * h]
        errs = [(chunk - ref[j][0]).abs().max().item() for j in range(len(ref))]
        assert min(range(len(errs)), key=errs.__getitem__) == k


def test_stop_leaves_no_process(tiny_target):
    handle = start(tiny_target, None, tp=1, timeout=300)
    pids = [p.pid for p in handle.processes()]
    assert handle.pid in pids and len(pids) >= 3  # launcher, scheduler, detokenizer
    assert httpx.get(handle.url + "/health", timeout=30).status_code == 200
    handle.stop()
    assert not handle.is_alive()
    assert _alive(pids) == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(handle.url + "/health", timeout=3)


def test_bad_inputs_give_one_clear_error(tmp_path, tiny_target):
    with pytest.raises(BadServerInput, match="is not a directory"):
        start(tmp_path / "nope")
    not_eagle = tmp_path / "not-eagle"
    not_eagle.mkdir()
    (not_eagle / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(BadServerInput, match="not an EAGLE-3 draft"):
        start(tiny_target, not_eagle)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(BadServerInput, match=f"port {s.getsockname()[1]} .* in use"):
            start(tiny_target, port=s.getsockname()[1])


def test_server_dying_during_startup_reports_log_tail(tmp_path, tiny_target):
    import shutil

    broken = tmp_path / "broken-target"
    shutil.copytree(tiny_target, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated: the header cannot be parsed
    before = {p.pid for p in psutil.process_iter()}
    # SGLang spawns its TP ranks, which fail while loading weights, then tears everything down.
    with pytest.raises(ServerStartError) as err:
        start(broken, tp=2, timeout=240, log_path=tmp_path / "dies.log")
    msg = str(err.value)
    assert "exited with code" in msg and "last lines of the server log" in msg
    assert "SafetensorError" in msg
    time.sleep(1)
    # this test's own server only (its model path in the command line): another server started meanwhile on the
    # same machine (a parallel run) is not a leftover of this one
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if p.pid not in before and "sglang" in (cmd := " ".join(p.info["cmdline"] or []))
                 and str(broken) in cmd]
    assert _alive([p.pid for p in leftovers]) == []


def test_cpu_bind_spec():
    assert embedded.cpu_bind_spec(1, [0, 1]) == "0,1"
    assert embedded.cpu_bind_spec(2, [0, 1]) == "0|1"
    assert embedded.cpu_bind_spec(8, [0, 1]) == "0|1|0|1|0|1|0|1"
    assert embedded.cpu_bind_spec(2, [0, 1, 2, 3]) == "0,1|2,3"


def test_api_key_is_redacted_from_the_log(tmp_path, tiny_target):
    key = "sk-test-" + os.urandom(6).hex()
    with start(tiny_target, tp=1, api_key=key, log_path=tmp_path / "srv.log") as srv:
        assert httpx.get(srv.url + "/model_info", timeout=30).status_code == 401
        ok = httpx.get(srv.url + "/model_info", timeout=30,
                       headers={"Authorization": f"Bearer {key}"})
        assert ok.status_code == 200
        assert key not in " ".join(srv.command)
    text = (tmp_path / "srv.log").read_text()
    assert "api_key" in text and "<redacted>" in text
    assert key not in text
