#!/usr/bin/env python
"""Live vs offline accept length of a MiMo MTP head served by the embedded vLLM 0.32.0 CPU server (method mtp), and
which state vLLM hands the head.

    PYTHONPATH=$PWD .venv/bin/python bench/vllm_mtp_accept.py [--pair DIR] [--prompts 8] [--max-tokens 32] [--k 1]

The pair: ``env/models/make_mimo_pair.py`` (the llama_h64 target as ``MiMoForCausalLM`` with one MTP layer: the
trained head ``llama_h64/mimo_mtp``; the figures of 2026-12-06 in bench/RESULTS.md are of the earlier layer converted
from the EAGLE-1 draft), built into ``--pair`` (default a temp folder) unless it holds one already. vLLM's CPU
backend cannot run the Kimi-class target's MLA (``helpers.engines.vllm_mtp``), so this is the MTP pair it serves.

Live: ``helpers.engines.vllm_server.start(..., mtp=True)`` (``{"method": "mtp", "num_speculative_tokens": k}``),
greedy continuations of the first ``--prompts`` of env/models/prompts.json (token ids, ``ignore_eos``); accept length
= 1 + accepted / verify steps from the ``/metrics`` delta. The worker extension records ``drafter.propose``'s
``target_hidden_states`` at the first prompt's prefill. Offline: the same token sequences, the target's states
(transformers, float32) before its final norm (the last decoder layer's output: what ``mimo.py::MiMoModel.forward``
returns), the head through ``helpers.draft.loader.load_draft`` (``MiMoMTPHead``) in ``helpers.draft.simulate`` with a
chain of ``k``; also on the post-norm states (the DeepSeek rule) to show what the rule is worth. Prints one JSON
object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from helpers.draft.loader import load_draft
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences, summary
from helpers.engines import vllm_server
from helpers.engines.vllm_answers import parse_counters
from helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from vllm_eagle1_accept import _get, _post  # noqa: E402  (the same two HTTP helpers, with deadlines)


def ensure_pair(pair: Path) -> Path:
    """``pair`` holding the MiMo pair (built by env/models/make_mimo_pair.py when it has no config.json)."""
    if not (pair / "config.json").is_file():
        sys.path.insert(0, str(ROOT / "env" / "models"))
        from make_mimo_pair import build  # lazy: the builder imports transformers
        build(pair)
    return pair


def target_states(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pre_norm, post_norm)`` ``[T, H]`` float32 of a transformers causal LM on ``ids [T]``: the last decoder
    layer's output and ``last_hidden_state``."""
    last: dict = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, out: last.update(x=out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            post = model.model(input_ids=ids[None]).last_hidden_state[0]
    finally:
        hook.remove()
    return last["x"][0], post


def measure(pair: Path, *, prompts: int = 8, max_tokens: int = 32, k: int = 1, timeout: float = 1500.0) -> dict:
    """Start the server (one), measure live, stop it, replay offline; the dict :func:`main` prints. Raises whatever
    the server start or a request raises (the server is stopped first)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy: slow to import

    pair = ensure_pair(Path(pair))
    tok = AutoTokenizer.from_pretrained(str(pair))
    texts = json.loads((ROOT / "env" / "models" / "prompts.json").read_text())["prompts"][:prompts]
    ids_in = [tok(t)["input_ids"] for t in texts]
    t0 = time.time()
    srv = vllm_server.start(pair, None, tp=1, num_speculative_tokens=k, mtp=True, timeout=timeout)
    try:
        start_s = time.time() - t0
        info = _post(srv.url + "/collective_rpc", {"method": "e3f_describe", "args": []})
        cap = Path(tempfile.mkdtemp(prefix="e3f-mtp-cap-"))
        _post(srv.url + "/collective_rpc", {"method": "e3f_capture_start",
                                            "args": [json.dumps({"out_dir": str(cap), "max_forwards": 1})]})
        before = parse_counters(_get(srv.url + "/metrics"))
        t1 = time.time()
        outs = []
        for i, p in enumerate(ids_in):
            r = _post(srv.url + "/v1/completions", {"model": str(pair), "prompt": p, "max_tokens": max_tokens,
                                                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            outs.append(r["choices"][0]["token_ids"])
            if i == 0:
                _post(srv.url + "/collective_rpc", {"method": "e3f_capture_stop", "args": []})
        live_s = time.time() - t1
        live = parse_counters(_get(srv.url + "/metrics")).delta(before)
    finally:
        srv.stop()
    t2 = time.time()
    model = AutoModelForCausalLM.from_pretrained(str(pair), dtype=torch.float32).eval()
    head = load_draft(pair, pair)
    pre_seqs, post_seqs = [], []
    for i, (p, o) in enumerate(zip(ids_in, outs)):
        ids = torch.tensor(list(p) + list(o), dtype=torch.long)
        pre, post = target_states(model, ids)
        pre_seqs.append(SimSequence(f"p{i}", ids, pre[:-1], start=len(p)))
        post_seqs.append(SimSequence(f"p{i}", ids, post[:-1], start=len(p)))
    prop = load_file(str(cap / "rank0" / "prop000000.safetensors"))
    n0 = len(ids_in[0])
    served = prop["aux"].float()[:n0]
    if not torch.equal(prop["input_ids"][:n0], torch.tensor(ids_in[0])):
        raise RuntimeError("the captured rows are not the first prompt's")
    pre0, post0 = target_states(model, torch.tensor(ids_in[0]))
    rel = {name: float((served - v).norm() / v.norm()) for name, v in
           (("out(n-1) (pre-norm)", pre0), ("norm(out(n-1)) (post-norm)", post0))}
    st = DraftSettings.chain(k)
    off = {}
    for name, seqs in (("pre_norm (vLLM's rule for MiMo)", pre_seqs), ("post_norm (DeepSeek's rule)", post_seqs)):
        s = summary(simulate_sequences(head, seqs, [st])["per_request"][st], k)
        off[name] = {"accept_length_1_plus_accepted": 1.0 + s["correct_drafts"] / s["verify_steps"],
                     "verify_steps": s["verify_steps"], "correct_drafts": s["correct_drafts"],
                     "accept_length_lo": s["accept_length_lo"], "accept_length_hi": s["accept_length_hi"]}
    return {"pair": str(pair), "k": k, "prompts": len(ids_in), "max_tokens": max_tokens,
            "server_start_s": round(start_s, 1), "live_s": round(live_s, 1), "offline_s": round(time.time() - t2, 1),
            "describe_draft": info.get("result", info) if isinstance(info, dict) else info,
            "live": {"verify_steps": live.verify_steps, "accepted_tokens": live.accepted_tokens,
                     "draft_tokens": live.draft_tokens, "accept_length": 1.0 + live.accepted_tokens / live.verify_steps,
                     "accepted_per_position": live.accepted_per_position},
            "offline": off, "served_state_rel_error": rel, "served_state_rows": n0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pair", type=Path, default=None, help="the MiMo pair folder (built when empty)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=1)
    a = ap.parse_args(argv)
    pair = a.pair or Path(tempfile.mkdtemp(prefix="e3f-mimo-pair-"))
    print(json.dumps(measure(pair, prompts=a.prompts, max_tokens=a.max_tokens, k=a.k), indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
