#!/usr/bin/env python
"""Live vs offline accept length of an EAGLE-1 draft served by the embedded vLLM 0.32.0 CPU server (method eagle).

    PYTHONPATH=$PWD .venv/bin/python bench/vllm_eagle1_accept.py [--prompts 16] [--max-tokens 64] [--k 3]

Live: the server (``helpers.engines.vllm_server.start``, method inferred from the draft's architectures) generates
greedy continuations of the first ``--prompts`` held-out prompts (env/models/prompts.json, token ids sent,
``ignore_eos``); accept length = 1 + accepted / verify steps from the ``/metrics`` counter delta
(``helpers.engines.vllm_answers.parse_counters``). Offline: the same token sequences, the target's post-final-norm
states (transformers, float32: what vLLM hands ``drafter.propose`` for method eagle), the draft through
``helpers.draft.loader.load_draft`` (``Eagle1Draft``) in ``helpers.draft.simulate`` with a chain of ``k``.
Prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from helpers.draft.loader import load_draft
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences, summary
from helpers.engines import vllm_server
from helpers.engines.vllm_answers import parse_counters
from helpers.paths import ROOT

H64 = ROOT / "env" / "models" / "llama_h64"


def _get(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=H64 / "target")
    ap.add_argument("--draft", type=Path, default=H64 / "draft_eagle1")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.target, a.draft, prompts=a.prompts, max_tokens=a.max_tokens, k=a.k), indent=2,
                     default=float))
    return 0


def measure(target: Path, draft: Path, *, prompts: int = 16, max_tokens: int = 64, k: int = 3) -> dict:
    """Start the server (one), measure live, stop it, replay offline; the dict main prints (see the module
    docstring). Raises whatever the server start or a request raises (the server is stopped first)."""
    from types import SimpleNamespace
    a = SimpleNamespace(target=Path(target), draft=Path(draft), prompts=prompts, max_tokens=max_tokens, k=k)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(a.target))
    texts = json.loads((ROOT / "env" / "models" / "prompts.json").read_text())["prompts"][:a.prompts]
    prompts = [tok(t)["input_ids"] for t in texts]
    t0 = time.time()
    srv = vllm_server.start(a.target, a.draft, tp=1, num_speculative_tokens=a.k)
    try:
        start_s = time.time() - t0
        cap = Path(tempfile.mkdtemp(prefix="e3f-eagle1-cap-"))
        # the worker extension records drafter.propose's target_hidden_states for the first prompt only
        _post(srv.url + "/collective_rpc", {"method": "e3f_capture_start",
                                            "args": [json.dumps({"out_dir": str(cap), "max_forwards": 1})]})
        before = parse_counters(_get(srv.url + "/metrics"))
        outs = []
        for i, p in enumerate(prompts):
            r = _post(srv.url + "/v1/completions", {"model": str(a.target), "prompt": p, "max_tokens": a.max_tokens,
                                                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            outs.append(r["choices"][0]["token_ids"])
            if i == 0:
                _post(srv.url + "/collective_rpc", {"method": "e3f_capture_stop", "args": []})
        live = parse_counters(_get(srv.url + "/metrics")).delta(before)
    finally:
        srv.stop()
    live_al = 1.0 + live.accepted_tokens / live.verify_steps
    target = AutoModelForCausalLM.from_pretrained(str(a.target), dtype=torch.float32).eval()
    draft = load_draft(a.draft, a.target)
    seqs = []
    for i, (p, o) in enumerate(zip(prompts, outs)):
        ids = torch.tensor(list(p) + list(o), dtype=torch.long)
        with torch.no_grad():
            hid = target.model(input_ids=ids[None]).last_hidden_state[0]
        seqs.append(SimSequence(f"p{i}", ids, hid[:-1], start=len(p)))
    # what vLLM fed the draft at the first prompt's prefill vs the target's candidate tensors (HF, float32)
    from safetensors.torch import load_file
    prop = load_file(str(cap / "rank0" / "prop000000.safetensors"))
    ids0 = torch.tensor(prompts[0], dtype=torch.long)
    n0 = len(prompts[0])
    served = prop["aux"].float()[:n0]
    assert torch.equal(prop["input_ids"][:n0], ids0), "captured rows are not the first prompt's"
    last = {}                                    # the pre-norm stream leaving the last decoder layer
    hook = target.model.layers[-1].register_forward_hook(
        lambda m, i, out: last.update(x=out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        post = target.model(input_ids=ids0[None]).last_hidden_state[0]
    hook.remove()
    cands = {"post_final_norm (last_hidden_state)": post, "pre_final_norm (last layer output)": last["x"][0]}
    state_check = {k: float((served - v).abs().max()) for k, v in cands.items()}
    st = DraftSettings.chain(a.k)
    res = simulate_sequences(draft, seqs, [st])
    off = summary(res["per_request"][st], a.k)
    return {
        "draft": str(a.draft), "k": a.k, "prompts": len(prompts), "max_tokens": a.max_tokens,
        "server_start_s": round(start_s, 1),
        "live": {"verify_steps": live.verify_steps, "accepted_tokens": live.accepted_tokens,
                 "draft_tokens": live.draft_tokens, "accept_length": live_al,
                 "accepted_per_position": live.accepted_per_position},
        "offline": {**{k: off[k] for k in ("accept_length", "accept_length_lo", "accept_length_hi", "verify_steps",
                                           "correct_drafts", "p_accept_ge")},
                    # the live figure's definition: 1 + accepted drafts / verify steps (summary's accept_length is
                    # completion tokens / verify steps, which also counts the prefill's token)
                    "accept_length_1_plus_accepted": 1.0 + off["correct_drafts"] / off["verify_steps"]},
        "served_state_max_abs_diff": state_check, "served_state_rows": n0,
        "offline_marginal_teacher_forced": res["marginal"], "greedy_share": res["greedy_share"],
    }


if __name__ == "__main__":
    sys.exit(main())
