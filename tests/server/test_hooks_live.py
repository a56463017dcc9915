"""Fault injection and per-rank capture through SGLang's own ``--forward-hooks`` flag, live: one TP 2
reference server with three faults on three chunks plus a per-rank capture, checked against HF transformers
on the same weights: what the draft receives (= ``return_hidden_states``) must be exactly the named
corruption of the HF hidden states, and the per-rank files must show real TP structure (vocab-sharded
embedding, partial sums that add up to the truth). Each fault on synthetic chunks: tests/unit/test_hooks.py.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from helpers.hooks import CaptureConfig, Fault, hook_specs

PROMPT = [5, 17, 42, 99, 7, 250, 31, 8, 120, 64, 3, 77, 380, 200]


@pytest.fixture(scope="module")
def faulted(tiny_target, tiny_draft, tmp_path_factory):
    from helpers.server.embedded import start

    cap = tmp_path_factory.mktemp("capture")
    faults = [Fault("embedding_in_place_of_layer", chunk=0),
              Fault("tp_partial_sum", chunk=1, layer=3),
              Fault("norm_mismatch", chunk=2)]
    specs = hook_specs(faults, CaptureConfig(out_dir=str(cap), keys=[
        "embedding", "embedding_local", "out(2)", "out(3)", "resid_mid(3)", "mlp_partial(3)"]),
        num_layers=8)
    with start(tiny_target, tiny_draft, tp=2, forward_hooks=specs, timeout=300) as srv:
        httpx.post(srv.url + "/flush_cache", timeout=60).raise_for_status()
        for f in cap.rglob("*"):
            if f.is_file():
                f.unlink()  # drop the warm-up forwards
        r = httpx.post(srv.url + "/generate", timeout=300, json={
            "input_ids": PROMPT, "return_hidden_states": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        yield r.json(), cap


@pytest.fixture(scope="module")
def hf_states(tiny_target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states


@pytest.mark.server
def test_faults_change_what_the_draft_receives(faulted, hf_states):
    out, _ = faulted
    h = 64
    prompt_block = torch.tensor(out["meta_info"]["hidden_states"][0])
    assert prompt_block.shape == (len(PROMPT), 3 * h)
    c0, c1, c2 = prompt_block.split(h, dim=1)
    # chunk 0: the embedding (HF hidden_states[0]) instead of out(1)
    torch.testing.assert_close(c0, hf_states[0][0], atol=1e-5, rtol=1e-5)
    assert (c0 - hf_states[2][0]).abs().max() > 0.1
    # chunk 2: out(4) (HF index 5) passed through an RMSNorm
    x = hf_states[5][0]
    torch.testing.assert_close(c2, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
                               atol=1e-4, rtol=1e-4)
    # chunk 1: rank 0's partial sum, not out(3)
    assert (c1 - hf_states[4][0]).abs().max() > 1e-3


@pytest.mark.server
def test_per_rank_capture_shows_tp_structure(faulted, hf_states, tiny_target):
    _, cap = faulted
    cfg = json.loads((Path(tiny_target) / "config.json").read_text())
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    ranks = {}
    for r in (0, 1):
        index = [json.loads(l) for l in (cap / f"rank{r}" / "index.jsonl").read_text().splitlines()]
        first = index[0]
        assert first["mode"] == "EXTEND" and first["tokens"] == len(PROMPT) and first["tp_size"] == 2
        ranks[r] = load_file(str(cap / f"rank{r}" / first["file"]))
        assert ranks[r]["input_ids"].tolist() == PROMPT
    emb = hf_states[0][0]
    ids = torch.tensor(PROMPT)
    for r in (0, 1):
        torch.testing.assert_close(ranks[r]["embedding"], emb, atol=1e-6, rtol=1e-6)  # all-reduced
        torch.testing.assert_close(ranks[r]["out(2)"], hf_states[3][0], atol=1e-4, rtol=1e-4)
        local = ranks[r]["embedding_local"]
        zero = local.abs().sum(1) == 0
        # rows are zero exactly for ids outside this rank's vocab shard
        shard = (ids >= r * vocab // 2) & (ids < (r + 1) * vocab // 2)
        assert torch.equal(zero, ~shard), (r, zero.tolist(), shard.tolist())
    torch.testing.assert_close(ranks[0]["embedding_local"] + ranks[1]["embedding_local"], emb,
                               atol=1e-6, rtol=1e-6)
    # the real per-rank MLP partial sums differ and add up to the reduced MLP output
    p0, p1 = ranks[0]["mlp_partial(3)"], ranks[1]["mlp_partial(3)"]
    assert (p0 - p1).abs().max() > 1e-3
    torch.testing.assert_close(ranks[0]["resid_mid(3)"] + p0 + p1, hf_states[4][0],
                               atol=1e-4, rtol=1e-4)
    # the faulted aux chunk 1 of both ranks sums to the true out(3)
    a0, a1 = ranks[0]["aux"][:, h:2 * h], ranks[1]["aux"][:, h:2 * h]
    torch.testing.assert_close(a0 + a1, hf_states[4][0], atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- the draft step trace, live
@pytest.mark.server
def test_step_trace_names_engine_faults_of_the_served_draft(tmp_path):
    """One TP 1 server with the reference draft, the draft step trace (``--trace-draft``) and two test-only faults
    (support.engine_faults, armed by file): clean, every traced draft step equals the checkpoint's; with the draft
    decode's KV over the previous slot, ``draft_kv_diverges`` (step 1 intact); with the draft's fc scaled after 2
    requests, ``served_draft_differs`` from step 1; ``investigate --check-draft`` on the same server exits 0 clean and 1
    naming ``served_draft_differs`` with the draft's fc scaled, its draft weights checksum moved."""
    from helpers.acceptance.prompts import load_prompts
    from helpers.budget import Budget
    from helpers.engines.sglang import SGLangAdapter
    from helpers.investigation.attach import attach
    from helpers.investigation.probes import ProbeContext, run_probes
    from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET
    from helpers.server.client import as_client
    from helpers.server.embedded import start
    from helpers.trace_hooks import trace_hook_specs
    from support.engine_faults import specs as fault_specs

    faults, arm_weights, arm_kv = fault_specs(str(tmp_path / "faults"), after_requests=2, scale=0.25)
    (tmp_path / "faults").mkdir()
    hooks = trace_hook_specs(tmp_path / "trace", REFERENCE_DRAFT) + faults
    with start(REFERENCE_TARGET, REFERENCE_DRAFT, tp=1, forward_hooks=hooks, timeout=300) as srv:
        (tmp_path / "trace").mkdir()
        client = as_client(srv.url)
        att = attach(client)
        assert att.other_hooks and all(h["name"].startswith("test-") for h in att.other_hooks)  # the trace is ours

        def probes(tag):
            ctx = ProbeContext(client=client, adapter=SGLangAdapter(), att=att, run_dir=tmp_path / tag, prompts=load_prompts(
                None, n=3), max_new_tokens=16, dl=Budget(600))
            (tmp_path / tag).mkdir()
            st = run_probes(ctx, "cheap")
            return {p["probe"]: p for p in st["probes"]}, st["findings"]

        def check(tag):
            """``investigate --check-draft --json`` on this server (the CLI, in process): exit code, document."""
            import io
            from contextlib import redirect_stdout
            from helpers.__main__ import main

            buf = io.StringIO()
            t = time.monotonic()
            with redirect_stdout(buf):
                rc = main(["investigate", "--url", srv.url, "--check-draft", "--json", "--out", str(tmp_path / tag)])
            doc = json.loads(buf.getvalue())
            print(f"check-draft {tag}: exit {rc} in {time.monotonic() - t:.1f} s ({doc['seconds']} s in the check)")
            return rc, doc

        rc, ok = check("check-clean")
        assert rc == 0 and ok["verdict"] == "matches" and not ok["findings"], ok["reason"]
        assert {p["probe"]: p["decision"] for p in ok["engine_state"]["probes"]} == {"served_draft": "clear",
                                                                                     "step_trace": "clear"}
        clean_sum = ok["weights"]["checksum"]
        clean, found = probes("clean")
        for name in ("served_draft", "step_trace"):
            ev = clean[name]["evidence"]
            assert clean[name]["decision"] == "clear", clean[name]
            rows = sum(sum(r["compared"].values()) for r in ev["requests"])
            assert rows >= 3 * 4 and all(not r["diverged"] for r in ev["requests"]), ev
        assert sum(sum(r["compared"].values()) for r in clean["step_trace"]["evidence"]["requests"]) >= 3 * 3 * 3
        assert not [f for f in found if f["kind"] in ("served_draft_differs", "draft_kv_diverges")]

        Path(arm_kv).write_text("")
        kv, found = probes("kv")
        Path(arm_kv).unlink()
        assert kv["step_trace"]["decision"] == "counts"
        f = next(f for f in found if f["kind"] == "draft_kv_diverges")
        per = f["evidence"]["diverged_per_step"]
        assert "1" not in per and 1 not in per and sum(per.values()) > 0, per
        assert not [f for f in found if f["kind"] == "served_draft_differs"]

        Path(arm_weights).write_text("")          # counts from here: the third request on drafts with fc x 0.25
        for n in range(3):
            client.generate(input_ids=[1, 2, 3, 4, 5, 6], max_new_tokens=2)
        bad, found = probes("weights")
        sd = next(f for f in found if f["kind"] == "served_draft_differs" and f["evidence"]["probe"] == "served_draft")
        assert sd["evidence"]["first_steps"] and set(sd["evidence"]["first_steps"].values()) == {1}
        assert "reload the draft" in sd["detail"]
        assert bad["step_trace"]["decision"] == "counts"
        rc, differs = check("check-weights")
        assert rc == 1 and differs["verdict"] == "differs", differs["reason"]
        assert differs["reason"].startswith("served_draft_differs:")
        assert "served_draft_differs" in {f["kind"] for f in differs["findings"]}
        # the engine's own hash of the draft (/weights_checker, selector draft) saw the scaled fc: it reaches the draft
        assert clean_sum and differs["weights"]["checksum"] not in (None, clean_sum), differs["weights"]
