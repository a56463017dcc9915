#!/usr/bin/env python
"""Speed and memory of the offline draft run (helpers.draft) on a Kimi-shaped EAGLE-3 draft, per CPU capability.

Draft: hidden 7168, 56 heads x 128, 8 KV heads, intermediate 18432, draft vocab 32000, target vocab 163840 (Kimi-K2's),
3 aux chunks, random weights built in memory (no checkpoint on disk) in the compute dtype. One sequence of 513 tokens:
512 positions simulated at ``--speculative-num-steps 3`` (chain: the draft-extend pass and two draft steps over every
row).

The compute dtype is the one the tool itself picks (``--dtype auto``: :func:`helpers.draft.precision.choose_dtype` for a
server computing in bfloat16, the usual GPU server): bfloat16 where the CPU has native bf16, float32 where it lacks it.
Each capability setting runs in its own process, one after the other, and the phases are printed side by side:

  * ``native``: this CPU as it is;
  * ``avx2``: an AVX2-only CPU emulated (``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``: ATen's AVX2 kernels and
    no oneDNN bf16 matmul, the path torch takes on an AVX2-only EPYC); left out when the CPU is AVX2-only already.

Phases (seconds, each printed as it ends, so the bench never sits silent):
  * ``build``: random weights in the compute dtype;
  * ``warm-up``: one small plain pass (allocator, kernels);
  * ``simulate``: :func:`helpers.draft.simulate.simulate_sequences` wall time, with the time inside the draft-extend
    pass (``extend``) and inside the draft steps (``steps``) measured by wrapping the draft's methods;
  * ``plain``: a plain ``F.linear`` pass over the same weights for the same rows (fc once, the decoder layer and
    lm_head per step; by default fc and one step run, the steps' time scaled: the same shapes each step, a third of
    the time; ``--full-plain`` runs them all): the matmul work the simulation cannot avoid; ratio = plain / simulate.
  Peak RSS over the weights' bytes (goal < 1.5).

``--linear`` times only one 512 x 7168 x 18432 ``F.linear`` in float32 and bfloat16 per setting: whether the
emulation is as slow as the CPU it emulates (issue 27: 6.2 s bf16 against 0.9 s float32 on an AVX2-only EPYC).

    .venv/bin/python bench/bench_simulate.py [--capability both|native|avx2] [--dtype auto|float32|bfloat16] [--linear]
        [--device cpu|cuda] [--positions 512] [--tf-positions 2000] [--steps 3] [--repeat 1] [--full-plain] [--small] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.draft.model import DraftArch, Eagle3Draft  # noqa: E402
from helpers.draft.precision import DTYPE_NAMES, CpuCapability, choose_dtype  # noqa: E402
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences  # noqa: E402
from helpers.draft.teacher_forced import TFSequence, run as tf_run  # noqa: E402

KIMI = dict(hidden=7168, target_hidden=7168, num_aux=3, heads=56, kv_heads=8, head_dim=128, intermediate=18432,
            layers=1, vocab=163840, draft_vocab=32000)
SMALL = dict(hidden=1024, target_hidden=1024, num_aux=3, heads=8, kv_heads=8, head_dim=128, intermediate=2816,
             layers=1, vocab=32000, draft_vocab=8000)
#: capability setting -> environment overrides (an AVX2-only CPU emulated on a wider one)
SETTINGS = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}
PHASES = ("build", "warm-up", "simulate", "extend", "steps", "plain", "teacher-forced")


def build(shape: dict, device: str, dtype: torch.dtype) -> Eagle3Draft:
    """A random draft of ``shape`` in ``dtype``: every weight a copy of one N(0, 0.02) block (built once; its rows
    repeat, which changes no matmul's speed), so building 8 GiB of float32 weights costs copies, not random numbers."""
    a = DraftArch(eps=1e-5, rope_theta=50000.0, rope_scaling=None, tie=False, lm_head_from_target=False,
                  norm_before_fc=False, fc_norm=False, norm_output=False, fc_bias=False, max_position=131072,
                  architecture="LlamaForCausalLMEagle3", **shape)
    g = torch.Generator(device=device).manual_seed(0)
    widest = max(a.target_hidden * a.num_aux, 2 * a.hidden, a.heads * a.head_dim, a.intermediate)
    block = (torch.randn(1024, widest, generator=g, device=device) * 0.02).to(dtype)

    def w(rows, cols):
        t = torch.empty(rows, cols, device=device, dtype=dtype)
        for r in range(0, rows, block.shape[0]):
            t[r:r + block.shape[0]] = block[: min(block.shape[0], rows - r), :cols]
        return t

    H, I, hd = a.hidden, a.intermediate, a.head_dim
    p = "layers.0."
    ones = lambda: torch.ones(H, dtype=dtype, device=device)  # noqa: E731
    weights = {"fc.weight": w(H, a.target_hidden * a.num_aux), "norm.weight": ones(),
               p + "self_attn.q_proj.weight": w(a.heads * hd, 2 * H),
               p + "self_attn.k_proj.weight": w(a.kv_heads * hd, 2 * H),
               p + "self_attn.v_proj.weight": w(a.kv_heads * hd, 2 * H),
               p + "self_attn.o_proj.weight": w(H, a.heads * hd),
               p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
               p + "mlp.down_proj.weight": w(H, I)}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        weights[p + n + ".weight"] = ones()
    embed = w(a.vocab, H)
    lm_head = w(a.draft_vocab, H)
    hot = (torch.randperm(a.vocab, generator=torch.Generator().manual_seed(1))[: a.draft_vocab]).sort().values
    return Eagle3Draft(a, weights, embed, lm_head, hot.to(device), dtype=dtype, sources={"draft": "random"})


def plain_pass(d: Eagle3Draft, rows: int, steps: int, *, run_steps: Optional[int] = None) -> float:
    """F.linear over every weight for ``rows`` rows in the draft's dtype: fc once, the decoder layer + lm_head once
    per step. Seconds. With ``run_steps`` < ``steps``, only that many steps are run and the steps' time is scaled to
    ``steps`` (every step multiplies the same shapes)."""
    dev, dt = d.device, d.dtype
    a = d.arch
    x_aux = torch.randn(rows, a.target_hidden * a.num_aux, device=dev).to(dt)
    x2 = torch.randn(rows, 2 * a.hidden, device=dev).to(dt)
    xh = torch.randn(rows, a.hidden, device=dev).to(dt)
    xi = torch.randn(rows, a.intermediate, device=dev).to(dt)
    xo = torch.randn(rows, a.heads * a.head_dim, device=dev).to(dt)
    p = "layers.0."
    run = steps if run_steps is None else max(1, min(steps, run_steps))
    _sync(dev)
    t = time.perf_counter()
    F.linear(x_aux, d.w["fc.weight"])
    _sync(dev)
    t_fc = time.perf_counter() - t
    for _ in range(run):
        for k in ("q_proj", "k_proj", "v_proj"):
            F.linear(x2, d.w[p + "self_attn." + k + ".weight"])
        F.linear(xo, d.w[p + "self_attn.o_proj.weight"])
        F.linear(xh, d.w[p + "mlp.gate_proj.weight"])
        F.linear(xh, d.w[p + "mlp.up_proj.weight"])
        F.linear(xi, d.w[p + "mlp.down_proj.weight"])
        F.linear(xh, d.lm_head)
    _sync(dev)
    return t_fc + (time.perf_counter() - t - t_fc) * steps / run


def _sync(dev) -> None:
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, acc: dict, key: str, dev):
    """``fn`` wrapped to add its wall seconds to ``acc[key]``."""
    def run(*args, **kw):
        t = time.perf_counter()
        out = fn(*args, **kw)
        _sync(dev)
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        return out
    return run


def one_linear(dev: str, repeat: int = 3) -> dict:
    """Seconds of one 512 x 7168 x 18432 ``F.linear`` (the MLP's gate projection at 512 rows) in float32 and in
    bfloat16: the minimum of ``repeat`` runs after a 64-row warm-up, with the runs."""
    g = torch.Generator(device=dev).manual_seed(0)
    x, w = torch.randn(512, 7168, generator=g, device=dev), torch.randn(18432, 7168, generator=g, device=dev) * 0.02
    out = {}
    for dt in (torch.float32, torch.bfloat16):
        xx, ww = x.to(dt), w.to(dt)
        F.linear(xx[:64], ww)
        runs = []
        for _ in range(repeat):
            _sync(dev)
            t = time.perf_counter()
            F.linear(xx, ww)
            _sync(dev)
            runs.append(time.perf_counter() - t)
        out[str(dt).removeprefix("torch.")] = {"s": min(runs), "runs_s": runs}
    out["bf16_over_fp32"] = out["bfloat16"]["s"] / out["float32"]["s"]
    return out


def child(a) -> dict:
    """One capability setting, in this process: the phases, each printed as it ends."""
    dev = a.device
    tag = f"[bench_simulate {a.capability}]"
    if dev == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    cap = CpuCapability.detect()
    if a.linear:
        print(f"{tag} {cap.describe()}: one 512 x 7168 x 18432 linear, float32 and bfloat16 ...", file=sys.stderr,
              flush=True)
        return {"capability": a.capability, "cpu": cap.describe(), "threads": torch.get_num_threads(),
                "linear": one_linear(dev), "load_avg": os.getloadavg()}
    choice = choose_dtype(torch.bfloat16, dev, requested=None if a.dtype == "auto" else DTYPE_NAMES[a.dtype])
    print(f"{tag} {cap.describe()}; compute dtype {choice.reason}", file=sys.stderr, flush=True)
    phases: dict[str, float] = {}
    cpu: dict[str, float] = {}
    t0 = time.perf_counter()

    @contextmanager
    def phase(name: str, note: str = ""):
        print(f"{tag} {name} ...{' ' + note if note else ''}", file=sys.stderr, flush=True)
        t, c = time.perf_counter(), time.process_time()
        yield
        _sync(dev)
        phases[name] = time.perf_counter() - t
        cpu[name] = cpu.get(name, 0.0) + time.process_time() - c
        print(f"{tag} {name}: {phases[name]:.1f} s, {cpu[name]:.1f} CPU s (total {time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)

    with phase("build", f"random {choice.name} weights"):
        d = build(SMALL if a.small else KIMI, dev, choice.dtype)
    wbytes = sum(t.numel() * t.element_size() for t in list(d.w.values()) + [d.embed, d.lm_head])
    T = a.positions + 1
    g = torch.Generator().manual_seed(2)
    seq = SimSequence("bench", torch.randint(0, d.arch.vocab, (T,), generator=g),
                      (torch.randn(T, d.arch.target_hidden * d.arch.num_aux, generator=g)).to(torch.bfloat16), 1)
    st = DraftSettings.chain(a.steps)
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with phase("warm-up"):
        plain_pass(d, min(64, a.positions), 1)
    inner: dict[str, float] = {}
    d.extend = _timed(d.extend, inner, "extend", dev)
    d.step = _timed(d.step, inner, "steps", dev)
    sims, plains, extends, steps = [], [], [], []
    for i in range(a.repeat):                  # interleaved; the minimum of each is the least disturbed by load
        inner.clear()
        with phase("simulate", f"{a.positions} positions at steps {a.steps} (run {i + 1} of {a.repeat})"):
            simulate_sequences(d, [seq], [st])
        sims.append(phases["simulate"])
        extends.append(inner.get("extend", 0.0))
        steps.append(inner.get("steps", 0.0))
        scaled = "" if a.full_plain else f" (fc and one step, the steps scaled to {a.steps})"
        with phase("plain", "the same linears, nothing else" + scaled):
            plains.append(plain_pass(d, a.positions, a.steps, run_steps=None if a.full_plain else 1))
    if a.tf_positions:
        # the draft stage's pass: the checkpoint teacher-forced over every loss-masked position of its rows, the
        # target's distribution from the rows' final hidden states and the target's lm_head (V x H, Kimi's 163840)
        Ttf = a.tf_positions + 1
        with phase("build target head", f"random {choice.name} lm_head [{d.arch.vocab}, {d.arch.target_hidden}]"):
            head = torch.empty(d.arch.vocab, d.arch.target_hidden, dtype=choice.dtype, device=dev)
            for row in range(0, d.arch.vocab, 8192):
                head[row:row + 8192] = (torch.randn(min(8192, d.arch.vocab - row), d.arch.target_hidden,
                                                    generator=g) * 0.02).to(choice.dtype)
        tfs = TFSequence("bench-tf", torch.randint(0, d.arch.vocab, (Ttf,), generator=g),
                         torch.cat([torch.zeros(8), torch.ones(Ttf - 8)]),
                         torch.randn(Ttf, d.arch.target_hidden * d.arch.num_aux, generator=g).to(torch.bfloat16),
                         torch.randn(Ttf, d.arch.target_hidden, generator=g).to(torch.bfloat16), head)
        with phase("teacher-forced", f"{a.tf_positions} positions x {a.steps + 1} TTT steps (the draft stage)"):
            tf_rows = tf_run(d, [tfs], a.steps + 1)
        phases["teacher-forced rows/s"] = a.tf_positions / phases["teacher-forced"]
        del head, tfs, tf_rows
    phases.update(simulate=min(sims), extend=min(extends), steps=min(steps), plain=min(plains))
    out = {"capability": a.capability, "cpu": cap.describe(), "dtype": choice.name, "dtype_reason": choice.reason,
           "device": torch.cuda.get_device_name() if dev.startswith("cuda") else f"cpu x {torch.get_num_threads()}",
           "positions": a.positions, "steps": a.steps, "shape": "small" if a.small else "kimi",
           "weights_gib": wbytes / 2**30, "phases_s": phases, "phases_cpu_s": cpu,
           "threads": torch.get_num_threads(), "cpu_s": time.process_time(),
           "ratio": phases["plain"] / phases["simulate"],
           "sim_runs_s": sims, "plain_runs_s": plains, "total_s": time.perf_counter() - t0,
           "load_avg": os.getloadavg()}
    if dev.startswith("cuda"):
        out["peak_alloc_over_weights"] = torch.cuda.max_memory_allocated() / wbytes
    else:
        # ru_maxrss: the process's peak resident set (KiB on Linux), weights included
        out["peak_rss_over_weights"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / wbytes
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capability", choices=("both", *SETTINGS), default="both")
    ap.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--tf-positions", type=int, default=2000, help="positions of the teacher-forced pass (the draft "
                    "stage: the target's logits over its whole vocabulary and the TTT steps; 0: skip)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a 1024-wide draft (a quick check, not the Kimi figure)")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs of simulate and plain (minimum reported)")
    ap.add_argument("--full-plain", action="store_true", help="run the plain pass over every step (default: fc and "
                    "one step, the steps' time scaled: the same shapes each step)")
    ap.add_argument("--linear", action="store_true", help="time only one 512 x 7168 x 18432 linear in float32 and "
                    "bfloat16 per setting (is the emulation as slow as the CPU it emulates?)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0
    wanted = list(SETTINGS) if a.capability == "both" else [a.capability]
    if a.device != "cpu" or CpuCapability.detect().aten == "AVX2":
        wanted = wanted[:1]                    # nothing to emulate: the CPU is AVX2-only, or the run is not on it
    t0 = time.perf_counter()
    runs = []
    for cap in wanted:
        args = [sys.executable, __file__, "--child", "--capability", cap, "--dtype", a.dtype, "--device", a.device,
                "--positions", str(a.positions), "--steps", str(a.steps), "--repeat", str(a.repeat),
                "--tf-positions", str(a.tf_positions)]
        args += ["--small"] if a.small else []
        args += ["--full-plain"] if a.full_plain else []
        args += ["--linear"] if a.linear else []
        r = subprocess.run(args, env={**os.environ, **SETTINGS[cap]},
                           stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            print(f"[bench_simulate] the {cap} run failed (exit {r.returncode})", file=sys.stderr)
            return 1
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    if a.linear:
        for r in runs:
            li = r["linear"]
            print(f"{r['capability']} ({r['cpu']}, {r['threads']} threads): float32 {li['float32']['s']:.2f} s "
                  f"{[round(x, 2) for x in li['float32']['runs_s']]}, bfloat16 {li['bfloat16']['s']:.2f} s "
                  f"{[round(x, 2) for x in li['bfloat16']['runs_s']]}: bf16 / float32 {li['bf16_over_fp32']:.2f}")
        out = {"runs": runs, "wall_s": time.perf_counter() - t0, "load_avg": os.getloadavg()}
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
        return 0
    cols = [f"{r['capability']} ({r['dtype']})" for r in runs]
    w = max(12, *map(len, cols))
    lines = ["phase (s)".ljust(24) + "".join(c.rjust(w + 2) for c in cols)]
    for ph in PHASES:
        lines.append(ph.ljust(24) + "".join(f"{r['phases_s'].get(ph, float('nan')):.3g}".rjust(w + 2) for r in runs))
    lines.append("CPU s (all runs; / threads ~ wall on idle cores)")
    for ph in ("build", "warm-up", "simulate", "plain"):
        lines.append(ph.ljust(24) + "".join(f"{r['phases_cpu_s'].get(ph, float('nan')):.3g}".rjust(w + 2)
                                            for r in runs))
    for key, fmt in (("cpu_s", "{:.1f}"), ("threads", "{}"), ("total_s", "{:.1f}"), ("ratio", "{:.3g}"),
                     ("peak_rss_over_weights", "{:.2f}"),
                     ("peak_alloc_over_weights", "{:.2f}"), ("weights_gib", "{:.2f}")):
        if any(key in r for r in runs):
            lines.append(key.ljust(24) + "".join((fmt.format(r[key]) if key in r else "-").rjust(w + 2)
                                                 for r in runs))
    print("\n".join(lines))
    for r in runs:
        print(f"{r['capability']}: {r['cpu']}; {r['dtype_reason']}")
    out = {"runs": runs, "wall_s": time.perf_counter() - t0, "load_avg": os.getloadavg()}
    print(f"wall {out['wall_s']:.1f} s, load {out['load_avg']}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
