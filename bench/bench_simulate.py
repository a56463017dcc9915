#!/usr/bin/env python
"""Speed and memory of the offline draft run (helpers.draft) on a Kimi-shaped EAGLE-3 draft.

Draft: hidden 7168, 56 heads x 128, 8 KV heads, intermediate 18432, draft vocab 32000, target vocab 163840 (Kimi-K2's),
3 aux chunks, random bf16 weights built in memory (no checkpoint on disk). One sequence of 513 tokens: 512 positions
simulated at ``--speculative-num-steps 3`` (chain: the draft-extend pass and two draft steps over every row).

Printed, measured side by side in one run:
  * sim_s: :func:`helpers.draft.simulate.simulate_sequences` wall time (minimum of ``--repeat`` runs interleaved with
    the plain pass: on a shared machine the minimum is the run least disturbed by others' load);
  * plain_s: a plain ``F.linear`` pass over the same weights for the same rows (fc once, the decoder layer and
    lm_head per step): the matmul work the simulation cannot avoid;
  * ratio = plain_s / sim_s (goal >= 0.5);
  * peak RSS (CPU) or peak allocated (CUDA) over the weights' bytes (goal < 1.5).

    .venv/bin/python bench/bench_simulate.py [--device cpu|cuda] [--positions 512] [--steps 3] [--small]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.draft.model import DraftArch, Eagle3Draft  # noqa: E402
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences  # noqa: E402

KIMI = dict(hidden=7168, target_hidden=7168, num_aux=3, heads=56, kv_heads=8, head_dim=128, intermediate=18432,
            layers=1, vocab=163840, draft_vocab=32000)
SMALL = dict(hidden=1024, target_hidden=1024, num_aux=3, heads=8, kv_heads=8, head_dim=128, intermediate=2816,
             layers=1, vocab=32000, draft_vocab=8000)


def build(shape: dict, device: str) -> Eagle3Draft:
    a = DraftArch(eps=1e-5, rope_theta=50000.0, rope_scaling=None, tie=False, lm_head_from_target=False,
                  norm_before_fc=False, fc_norm=False, norm_output=False, fc_bias=False, max_position=131072,
                  architecture="LlamaForCausalLMEagle3", **shape)
    g = torch.Generator(device=device).manual_seed(0)
    bf = torch.bfloat16

    def w(*s):
        t = torch.empty(*s, device=device, dtype=bf)
        for row in range(0, s[0], 4096):                   # bf16 noise built in slices: no fp32 copy of a weight
            t[row:row + 4096] = torch.randn(min(4096, s[0] - row), *s[1:], generator=g, device=device) * 0.02
        return t

    H, I, hd = a.hidden, a.intermediate, a.head_dim
    p = "layers.0."
    weights = {"fc.weight": w(H, a.target_hidden * a.num_aux), "norm.weight": torch.ones(H, dtype=bf, device=device),
               p + "self_attn.q_proj.weight": w(a.heads * hd, 2 * H),
               p + "self_attn.k_proj.weight": w(a.kv_heads * hd, 2 * H),
               p + "self_attn.v_proj.weight": w(a.kv_heads * hd, 2 * H),
               p + "self_attn.o_proj.weight": w(H, a.heads * hd),
               p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H), p + "mlp.down_proj.weight": w(H, I)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[p + n + ".weight"] = torch.ones(H, dtype=bf, device=device)
    embed = w(a.vocab, H)
    lm_head = w(a.draft_vocab, H)
    hot = (torch.randperm(a.vocab, generator=torch.Generator().manual_seed(1))[: a.draft_vocab]).sort().values
    return Eagle3Draft(a, weights, embed, lm_head, hot.to(device), dtype=bf, sources={"draft": "random"})


def plain_pass(d: Eagle3Draft, rows: int, steps: int) -> float:
    """F.linear over every weight for ``rows`` rows: fc once, the decoder layer + lm_head once per step."""
    dev, bf = d.device, torch.bfloat16
    a = d.arch
    x_aux = torch.randn(rows, a.target_hidden * a.num_aux, device=dev, dtype=bf)
    x2 = torch.randn(rows, 2 * a.hidden, device=dev, dtype=bf)
    xh = torch.randn(rows, a.hidden, device=dev, dtype=bf)
    xi = torch.randn(rows, a.intermediate, device=dev, dtype=bf)
    xo = torch.randn(rows, a.heads * a.head_dim, device=dev, dtype=bf)
    p = "layers.0."
    _sync(dev)
    t = time.perf_counter()
    F.linear(x_aux, d.w["fc.weight"])
    for _ in range(steps):
        for k in ("q_proj", "k_proj", "v_proj"):
            F.linear(x2, d.w[p + "self_attn." + k + ".weight"])
        F.linear(xo, d.w[p + "self_attn.o_proj.weight"])
        F.linear(xh, d.w[p + "mlp.gate_proj.weight"])
        F.linear(xh, d.w[p + "mlp.up_proj.weight"])
        F.linear(xi, d.w[p + "mlp.down_proj.weight"])
        F.linear(xh, d.lm_head)
    _sync(dev)
    return time.perf_counter() - t


def _sync(dev) -> None:
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a 1024-wide draft (a quick check, not the Kimi figure)")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs of each (default 3; minimum reported)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    dev = a.device
    if dev == "cpu":
        torch.set_num_threads(os.cpu_count() or 2)
    d = build(SMALL if a.small else KIMI, dev)
    wbytes = sum(t.numel() * t.element_size() for t in list(d.w.values()) + [d.embed, d.lm_head])
    T = a.positions + 1
    g = torch.Generator().manual_seed(2)
    seq = SimSequence("bench", torch.randint(0, d.arch.vocab, (T,), generator=g),
                      (torch.randn(T, d.arch.target_hidden * d.arch.num_aux, generator=g)).to(torch.bfloat16), 1)
    st = DraftSettings.chain(a.steps)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    plain_pass(d, min(64, a.positions), 1)                     # warm-up (allocator, kernels)
    sims, plains = [], []
    for _ in range(a.repeat):                  # interleaved; the minimum of each is the least disturbed by load
        t = time.perf_counter()
        simulate_sequences(d, [seq], [st])
        _sync(dev)
        sims.append(time.perf_counter() - t)
        plains.append(plain_pass(d, a.positions, a.steps))
    sim_s, plain_s = min(sims), min(plains)
    out = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else f"cpu x {torch.get_num_threads()}",
           "positions": a.positions, "steps": a.steps, "shape": "small" if a.small else "kimi",
           "weights_gib": wbytes / 2**30, "sim_s": sim_s, "plain_s": plain_s, "ratio": plain_s / sim_s,
           "sim_runs_s": sims, "plain_runs_s": plains,
           "load_avg": os.getloadavg()}
    if dev.startswith("cuda"):
        out["peak_alloc_over_weights"] = torch.cuda.max_memory_allocated() / wbytes
    else:
        # ru_maxrss: the process's peak resident set (KiB on Linux), weights included
        import resource
        out["peak_rss_over_weights"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / wbytes
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
