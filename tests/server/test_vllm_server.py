"""The embedded vLLM 0.32.0 CPU server (env/vllm/.venv), one TP 1 server for the module: it binds only 127.0.0.1,
is detected as vLLM 0.32.0 from its own endpoints, reports the speculative config the engine really built (aux ids
in(1), in(3), in(4) for a draft config saying [1, 3, 4]), its /metrics counters equal the per-request figures of the
same answers and a hand parse of the text, and the aux states it feeds the draft equal HF transformers'
hidden_states[i] on the same tokens; the engine-state probe radix_hit reads the prefix hits vLLM's block rule gives.
Stopped by PID at the end, nothing left.

The draft proposes one fixed token (draft vocabulary of 1, d2t = that token): the token the random target emits most
often, so that verify steps accept 0..3 drafts and every counter and position is exercised."""
from __future__ import annotations

import collections
import hashlib
import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from types import SimpleNamespace

from helpers.acceptance.prompts import load_prompts
from helpers.budget import Budget
from helpers.capture import per_rank_dumps
from helpers.engines.detect import detect
from helpers.engines.vllm import VLLMAdapter
from helpers.engines.vllm_server import listeners, start, vllm_python
from helpers.formats.dumps import read_dump
from helpers.investigation.probes import ProbeContext
from helpers.investigation.probes.cache import RADIX_HIT
from support.tinymodels import build_eagle3_draft, build_target

pytestmark = [pytest.mark.server, pytest.mark.vllm]
if not vllm_python().exists():
    pytest.skip("env/vllm/.venv is missing (make setup without SKIP_VLLM=1)", allow_module_level=True)

PROMPTS = [[5, 17, 42, 99, 7, 250, 31, 8, 77, 140, 3, 61, 200, 18, 9, 44],
           [12, 13, 14, 15, 300, 301, 21, 9, 88, 21, 65, 70, 71, 72, 11, 100, 120, 6]]
MEASURE = [[30 + i, 60 + 2 * i, 90 + 3 * i, 7, 8, 9, 10 + i] for i in range(4)]
NEW_TOKENS = 24
IDS = [1, 3, 4]          # the draft config's eagle_aux_hidden_state_layer_ids (vLLM: in(i), verbatim)


def _greedy(hf, prompt: list[int], n: int) -> list[int]:
    """HF's greedy continuation of ``prompt``, ``n`` tokens, no stop at EOS (the server runs with ignore_eos)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A random 8-layer Llama target with 2 heads x 64 (a head size vLLM's CPU attention serves), HF on it, and an
    EAGLE-3 draft that always proposes the target's most frequent greedy token."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("vllm-models")
    target = build_target(root / "target", hidden=128, heads=2, kv_heads=2, intermediate=256, vocab=384, seed=4)
    hf = AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    counts: collections.Counter = collections.Counter()
    for p in MEASURE:
        counts.update(_greedy(hf, p, NEW_TOKENS))
    token = counts.most_common(1)[0][0]
    draft = build_eagle3_draft(root / "draft", target, layer_ids=IDS, draft_vocab=1, intermediate=256)
    w = load_file(str(draft / "model.safetensors"))
    w["d2t"] = torch.tensor([token], dtype=torch.int64)
    save_file(w, str(draft / "model.safetensors"))
    return {"target": target, "draft": draft, "hf": hf, "token": token, "d2t": w["d2t"]}


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    handle = start(models["target"], models["draft"], tp=1, num_speculative_tokens=3, timeout=900,
                   log_path=tmp_path_factory.mktemp("vllm-log") / "vllm.log")
    yield handle
    handle.stop()
    assert not handle.processes(), "a process of the vLLM server survived stop()"


@pytest.fixture(scope="module")
def client(server):
    c = VLLMAdapter().client(server.url, timeout=60)
    yield c
    c.close()


def test_binds_loopback_only_and_is_detected(server):
    socks = listeners(server)
    assert socks and all(ip == "127.0.0.1" for ip, _, _ in socks), socks
    assert any(port == server.port for _, port, _ in socks)
    found = detect(server.url)
    assert (found.engine, found.version) == ("vllm", "0.32.0")


def test_effective_config_is_what_the_engine_built(models, client):
    cfg = VLLMAdapter().spec_config(client)
    assert (cfg.engine, cfg.version, cfg.method, cfg.num_speculative_tokens, cfg.tp_size) == \
        ("vllm", "0.32.0", "eagle3", 3, 1)
    assert cfg.draft == str(models["draft"]) and cfg.target == str(models["target"])
    assert cfg.aux_layer_ids == IDS and cfg.rule_aux_layer_ids == IDS and not cfg.overrides
    assert cfg.aux_tensors == ["out(0)", "out(2)", "out(3)"]          # in(i) = out(i-1): no +1
    assert "e3f_describe" in cfg.sources["aux_layer_ids"]
    d = cfg.loaded["draft"]
    # no embed_tokens in the checkpoint -> the target's embedding module; own lm_head -> kept
    assert d["embed_shared"] is True and d["lm_head_shared"] is False and d["has_own_lm_head"] is True
    assert d["draft_vocab_size"] == 1 and d["d2t"]["size"] == 1
    assert d["d2t"]["digest"] == hashlib.sha256(models["d2t"].numpy().tobytes()).hexdigest()[:16]
    assert d["fc_input_size"] == 3 * 128 and d["num_aux_hidden_states"] == 3
    # the serving worker's own expand of per-request sampling values to verify rows (the CPU override without Triton)
    # returns other values than sent: the adapter names it, with vLLM's function and the values
    chk = client.server_info()["verify_sampling"]
    assert chk["equal"] is False and chk["fields"]["temperature"]["expected"] == [0.5, 0.5, 1.25, 2.0, 2.0, 2.0]
    fault = VLLMAdapter().verify_sampling_fault(client.server_info())
    assert "expand_batch_to_tokens" in fault["detail"] and "_expand_kernel_impl" in fault["detail"]


def _hand_counters(text: str) -> dict:
    """The spec counters of a /metrics text by regular expression (independent of prometheus_client)."""
    out: dict = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        out[name] = float(m.group(1))
    out["pos"] = {int(p): float(v) for p, v in re.findall(
        r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} ([0-9.e+]+)$', text, re.M)}
    out["gen"] = float(re.search(r"^vllm:generation_tokens_total\{[^}]*\} ([0-9.e+]+)$", text, re.M).group(1))
    return out


def test_counters_match_per_request_data_and_a_hand_parse(client, models):
    adapter = VLLMAdapter()
    before, hand0 = adapter.counters(client), _hand_counters(client.metrics_text())
    answers = [client.complete(p, max_tokens=NEW_TOKENS) for p in MEASURE]
    after, hand1 = adapter.counters(client), _hand_counters(client.metrics_text())
    d = after.delta(before)
    sd = [a["metrics"]["speculative_decoding"] for a in answers]
    steps = sum(s["num_spec_steps"] for s in sd)
    accepted = sum(s["num_accepted_draft_tokens"] for s in sd)
    assert d.verify_steps == steps == hand1["num_drafts"] - hand0["num_drafts"]
    assert d.accepted_tokens == accepted == hand1["num_accepted_tokens"] - hand0["num_accepted_tokens"]
    assert d.draft_tokens == sum(s["num_draft_tokens"] for s in sd) == 3 * steps
    assert d.generation_tokens == NEW_TOKENS * len(MEASURE) == hand1["gen"] - hand0["gen"]
    per_step = [j for s in sd for j in s["per_step_accepted"]]
    assert len(per_step) == steps and sum(per_step) == accepted
    by_hand = [sum(1 for j in per_step if j >= i + 1) for i in range(3)]
    assert d.accepted_per_position == by_hand == [hand1["pos"][i] - hand0["pos"][i] for i in range(3)]
    assert 0 < accepted < 3 * steps, "the fixed-token draft should accept some drafts and reject others"
    s = d.summary()
    assert s["accept_length"] == pytest.approx(NEW_TOKENS * len(MEASURE) / steps)
    assert s["accept_length_drafts"] == pytest.approx(1 + accepted / steps)
    # every generated token after the prefill's is an accepted draft or a verify step's bonus token
    assert NEW_TOKENS * len(MEASURE) == len(MEASURE) + steps + accepted
    # the drafts are the fixed token: an accepted draft is that token in the target's greedy output
    for p, a in zip(MEASURE, answers):
        assert a["choices"][0]["token_ids"] == _greedy(models["hf"], p, NEW_TOKENS)
    # issue 40: a real answer keeps vLLM's identities the client checks (a dense histogram of k + 1 bins, proposed <=
    # steps x k) with k from the server, and the client's shape checks
    assert client.server_info()["speculative_num_steps"] == 3
    r = client.generate(input_ids=MEASURE[0], max_new_tokens=NEW_TOKENS)
    assert len(r.meta_info.spec_correct_drafts_histogram) == 3 + 1 and r.output_ids == answers[0]["choices"][0][
        "token_ids"]


def test_captured_aux_states_equal_hf_hidden_states(client, models, tmp_path):
    dump = VLLMAdapter().capture_served(client, PROMPTS + [PROMPTS[0]], tmp_path, name="served", layers=True,
                                        capture_dir=tmp_path / "ranks")
    man = json.loads((dump / "manifest.json").read_text())
    assert (man["kind"], man["engine"], man["engine_version"], man["width"]) == ("served", "vllm", "0.32.0", 3 * 128)
    assert man["layer_plan"]["tensors"] == ["out(0)", "out(2)", "out(3)"] and man["layer_plan"]["convention"] == "vllm"
    src = read_dump(dump)
    ref = read_dump(tmp_path / "served-layers")
    assert ref.layer_plan["tensors"] == ["embedding"] + [f"out({L})" for L in range(8)]
    rows = []
    for s, r, ids in zip(src.samples, ref.samples, PROMPTS + [PROMPTS[0]]):
        assert s.first_position == 0 and s.input_ids.tolist() == ids    # prefix cache reset: every prompt row
        with torch.no_grad():
            hs = models["hf"](torch.tensor([ids]), output_hidden_states=True).hidden_states
        served, layers = s.load(), r.load()
        expect = torch.cat([hs[i][0] for i in IDS], dim=-1)            # vLLM id i = HF hidden_states[i]
        assert torch.allclose(served, expect, rtol=1e-4, atol=1e-4), (served - expect).abs().max()
        for L in range(7):                                               # out(L) = hidden_states[L + 1]
            assert torch.allclose(layers[:, 128 * (L + 1):128 * (L + 2)], hs[L + 1][0], rtol=1e-4, atol=1e-4)
        assert torch.allclose(layers[:, :128], hs[0][0], rtol=1e-5, atol=1e-5)
        rows.append(served)
    assert torch.equal(rows[0], rows[2])          # the same prompt again, cache reset in between: the same rows
    # the raw per-rank capture kept: one per-rank dump (TP 1: rank 0) whose draft inputs are the served rows
    (rank0,) = per_rank_dumps(tmp_path / "ranks", tmp_path / "per-rank", key="aux", modes=("DRAFT_INPUT",))
    fed = [x.load() for x in read_dump(rank0).samples]
    assert len(fed) == 3 and all(torch.equal(a, b) for a, b in zip(fed, rows))


def test_the_draft_step_trace_compares_the_served_proposals_with_the_checkpoint(client, models, tmp_path):
    """The engine-state probes' draft step trace on vLLM (the worker extension's ``drafter.propose`` wrapper): every
    proposal of every verify cycle equals the served checkpoint's on the states the server fed; a checkpoint that
    proposes another token diverges at step 1 (``served_draft_differs``)."""
    from helpers.draft.model import Eagle3Draft
    from helpers.draft.trace import compare_trace
    from helpers.acceptance.prompts import load_prompts

    adapter = VLLMAdapter()
    assert adapter.trace_unavailable(client) is None
    prompts = load_prompts([{"id": f"t{i}", "input_ids": p} for i, p in enumerate(PROMPTS)])
    seqs, records = adapter.trace_requests(client, prompts, max_new_tokens=NEW_TOKENS, tag="t", folder=tmp_path / "a")
    assert [s.key for s in seqs] == ["t0", "t1"] and {r["rids"][0] for r in records} == {"t0", "t1"}
    same = compare_trace(Eagle3Draft.load(models["draft"], models["target"]), seqs, records)
    assert same["untraced"] == [] and same["mechanism"] is None
    steps = {k for r in same["requests"] for k in r["compared"]}
    assert steps == {1, 2, 3} and all(sum(r["compared"].values()) >= 6 for r in same["requests"])
    # the same trace against a checkpoint whose one draft token is another target token
    other = tmp_path / "other"
    other.mkdir()
    for f in models["draft"].iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    w = load_file(str(other / "model.safetensors"))
    w["d2t"] = torch.tensor([(models["token"] + 1) % 384], dtype=torch.int64)
    save_file(w, str(other / "model.safetensors"))
    diff = compare_trace(Eagle3Draft.load(other, models["target"]), seqs, records)
    assert diff["mechanism"] == "served_draft_differs" and set(diff["first_steps"].values()) == {1}


def test_the_radix_hit_probe_meets_vllms_block_rule(client, tmp_path):
    """The engine-state probe radix_hit on the engine itself: two 300-token prompts, each resent after a 1-token fill,
    are served 128 prompt tokens from the prefix cache (block 128 on the CPU backend, the EAGLE draft's last block
    recomputed: (299 // 128) * 128 - 128), what the adapter's rule says, in usage.prompt_tokens_details (the
    embedded server's --enable-prompt-tokens-details); the draft proposes one fixed token, so the verify steps are
    the target's greedy tokens' and a clean prefix hit changes none of them."""
    prompts = load_prompts([{"id": f"r{i}", "input_ids": [(7 * j + 3 * i) % 380 + 1 for j in range(300)]}
                            for i in range(2)])
    ctx = ProbeContext(client=client, adapter=VLLMAdapter(), att=SimpleNamespace(restart=None), run_dir=tmp_path,
                       prompts=prompts, max_new_tokens=8, dl=Budget(600.0))
    assert RADIX_HIT.applies(ctx) is None
    res = RADIX_HIT.run(ctx)
    assert res.evidence["cached_tokens"] == {"min": 128, "max": 128, "prompts_with_hit": 2}
    assert res.evidence["expected_cached_tokens"] == [128, 128]
    assert res.loss["delta"] == pytest.approx(0.0) and res.findings == []
