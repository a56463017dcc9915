"""``investigate`` on the embedded vLLM server against the embedded SGLang server, side by side on the same trained
head_dim-64 pair (env/models/llama_h64: vLLM's CPU attention refuses head_dim 16), the same training samples and the
same live prompts, TP 1: the wall time of the whole investigation and of each of its stages (``investigation.json``
``timings``), with the fix proposed but not applied (no restart), so that both runs do the same work. Issue 29's
target: attach and capture on vLLM within 2x SGLang's.

The engines alternate per run, so a change of load on the shared machine hits both. Prints a markdown table (paste
into bench/RESULTS.md) and the load average before and after.

    .venv/bin/python bench/bench_investigate_engines.py --runs 1 --prompts 16
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.engines.detect import adapter as engine_adapter  # noqa: E402
from helpers.investigation.live import investigate  # noqa: E402

H64 = ROOT / "env" / "models" / "llama_h64"
ENGINES = ("sglang", "vllm")
STAGES = ("attach", "capture", "reference", "diagnosis", "draft checks", "hypotheses", "proposed fix",
          "acceptance budget")


def one_run(engine: str, out: Path, prompts: int, timeout: float) -> dict:
    """Start the engine's embedded server (TP 1, 3 speculative tokens), investigate it, stop it."""
    handle = engine_adapter(engine).start(H64 / "target", H64 / "draft", tp=1, timeout=timeout)
    try:
        t0 = time.monotonic()
        doc = investigate(handle.url, training=H64 / "data" / "sample", run_dir=out / f"{engine}-{time.time_ns()}",
                          apply_fix=False, measure_prompts=prompts, max_new_tokens=32, sweeps=(), timeout=timeout)
        wall = time.monotonic() - t0
    finally:
        handle.stop()
    return {"wall_s": wall, **{s: doc.timings.get(s) for s in STAGES}, "findings": [f.kind for f in doc.findings]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=1500)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-investigate-"))
    load0 = os.getloadavg()
    res: dict[str, list[dict]] = {e: [] for e in ENGINES}
    for _ in range(args.runs):
        for engine in ENGINES:
            r = one_run(engine, out, args.prompts, args.timeout)
            print(f"{engine}: {r}", flush=True)
            res[engine].append(r)
    load1 = os.getloadavg()
    print(f"\nload average before {load0[0]:.1f}, after {load1[0]:.1f}; {args.runs} run(s), {args.prompts} prompts\n")
    print("| step | SGLang 0.5.23 s (median) | vLLM 0.32.0 s (median) | vLLM / SGLang |")
    print("|---|---|---|---|")
    for k in ("wall_s",) + STAGES:
        a = statistics.median(r[k] or 0.0 for r in res["sglang"])
        b = statistics.median(r[k] or 0.0 for r in res["vllm"])
        print(f"| {k} | {a:.1f} | {b:.1f} | {b / a:.2f}x |" if a else f"| {k} | {a:.1f} | {b:.1f} | - |")


if __name__ == "__main__":
    main()
