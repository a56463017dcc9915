"""The embedded vLLM server against the embedded SGLang server, side by side on the same target, draft and prompts:
start (seconds to a healthy /health), attach (engine detection + the effective speculative config through the engine
adapter) and capture (the aux states fed to the draft for ``--prompts`` token-id prompts, one new token each, through
the adapter's ``capture_served``). Issue 29's target: vLLM's attach and capture within 2x SGLang's.

Both servers run at TP 1 on a random 8-layer Llama with 2 heads x 64 (vLLM's CPU attention refuses head_dim 16) and a
random EAGLE-3 draft (ids [1, 3, 4]), built here with tests/support/tinymodels.py. The engines alternate per run, so a
change of load on the shared machine hits both. Prints a markdown table (paste into bench/RESULTS.md) and the load
average before and after.

    .venv/bin/python bench/bench_vllm.py --runs 2 --prompts 8
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
sys.path.insert(0, str(ROOT / "tests"))

from helpers.engines.detect import adapter as engine_adapter, detect  # noqa: E402
from support.tinymodels import build_eagle3_draft, build_target  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    """``n`` fixed token-id prompts of ``length`` tokens (ids 3..383)."""
    return [[3 + (17 * i + 31 * j) % 380 for j in range(length)] for i in range(n)]


def one_run(engine: str, target: Path, draft: Path, ps: list[list[int]], out: Path, timeout: float) -> dict:
    ad = engine_adapter(engine)
    kw = {"timeout": timeout}
    if engine == "sglang":
        from helpers.server.settings import SpecSettings   # noqa: PLC0415  (bench: SGLang's launch shape)
        kw["spec"] = SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)
    t0 = time.monotonic()
    handle = ad.start(target, draft, tp=1, **kw)
    try:
        start_s = time.monotonic() - t0
        t1 = time.monotonic()
        found = detect(handle.url)
        client = found.adapter.client(handle.url, timeout=120)
        cfg = found.adapter.spec_config(client, draft=draft)
        attach_s = time.monotonic() - t1
        t2 = time.monotonic()
        dump = found.adapter.capture_served(client, ps, out, name=f"{engine}-{time.time_ns()}", progress=False)
        capture_s = time.monotonic() - t2
        client.close()
    finally:
        handle.stop()
    return {"start_s": start_s, "attach_s": attach_s, "capture_s": capture_s, "dump": str(dump),
            "ids": cfg.aux_layer_ids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    target = build_target(tmp / "target", hidden=128, heads=2, kv_heads=2, intermediate=256, vocab=384, seed=4)
    draft = build_eagle3_draft(tmp / "draft", target, layer_ids=[1, 3, 4], draft_vocab=256, intermediate=256)
    ps = prompts(args.prompts, args.length)
    load0 = os.getloadavg()
    res: dict[str, list[dict]] = {"sglang": [], "vllm": []}
    for _ in range(args.runs):
        for engine in ("sglang", "vllm"):
            r = one_run(engine, target, draft, ps, tmp / "dumps", args.timeout)
            print(f"{engine}: {r}", flush=True)
            res[engine].append(r)
    load1 = os.getloadavg()
    med = {e: {k: statistics.median(r[k] for r in rs) for k in ("start_s", "attach_s", "capture_s")}
           for e, rs in res.items()}
    print(f"\nload average (1/5/15 min) before {load0}, after {load1}; {args.runs} run(s) per engine, "
          f"{args.prompts} prompts x {args.length} tokens\n")
    print("| step | SGLang 0.5.23 s (median) | vLLM 0.32.0 s (median) | vLLM / SGLang |")
    print("|---|---|---|---|")
    for k, name in (("start_s", "start"), ("attach_s", "attach"), ("capture_s", "capture")):
        runs = {e: ", ".join(f"{r[k]:.2f}" for r in res[e]) for e in res}
        print(f"| {name} | {med['sglang'][k]:.2f} [{runs['sglang']}] | {med['vllm'][k]:.2f} [{runs['vllm']}] | "
              f"{med['vllm'][k] / med['sglang'][k]:.2f} |")


if __name__ == "__main__":
    main()
