"""The NextN settings fix (``mtp_steps_beyond_head``: served with 3 steps, trained for 1 -> ``--speculative-num-steps
1``) measured on two live SGLang 0.5.23 NEXTN servers of the Kimi-class target at once, the two arms interleaved
round by round so that the machine's load (other jobs on 2 shared cores) falls on both alike.

Usage (PYTHONPATH=$PWD): ``python bench/bench_mtp_steps_fix.py [--url-served URL] [--rounds 3] [--prompts 16]
[--new 32]``. Without ``--url-served`` both servers are started here (TP 1, 3 and 1 steps) and stopped at the end.

Prints per arm: the accept length (tokens per verify step, bonus included) with its 95 % CI over all prompts of all
rounds, tok/s (``helpers.acceptance.measure`` per round; the pooled per-request ratio with its CI), the paired time
per token ratio (fixed / served) per round and pooled, and the head's cost measured from the two arms
(``helpers.investigation.mtp_fix.measured_cost``) against the parameter model (``nextn_draft_cost``).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd

from helpers.acceptance.measure import measure, summarize
from helpers.acceptance.prompts import load_prompts
from helpers.investigation.mtp_fix import measured_cost, nextn_draft_cost
from helpers.server.client import SGLangClient
from helpers.server.embedded import start
from helpers.server.settings import SpecSettings

TARGET = Path(__file__).resolve().parents[1] / "env" / "models" / "kimi" / "target"


def _server(steps: int):
    t0 = time.monotonic()
    h = start(TARGET, None, tp=1, spec=SpecSettings(algorithm="NEXTN", num_steps=steps, topk=1,
                                                     num_draft_tokens=steps + 1), timeout=1500)
    print(f"server {steps} step(s) ready in {time.monotonic() - t0:.0f} s: {h.url}", flush=True)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url-served", default=None, help="a running 3-step NEXTN server (default: start one)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    args = ap.parse_args()
    handles = []
    try:
        if args.url_served is None:
            handles.append(_server(3))
        served_url = args.url_served or handles[0].url
        handles.append(_server(1))
        urls = {"served (3 steps)": served_url, "fixed (1 step)": handles[-1].url}
        clients = {k: SGLangClient(u, timeout=600) for k, u in urls.items()}
        ps = load_prompts(None, n=args.prompts)
        frames: dict[str, list[pd.DataFrame]] = {k: [] for k in urls}
        ratios = []
        print(f"load before: {os.getloadavg()}", flush=True)
        for i in range(args.rounds):
            order = list(urls) if i % 2 == 0 else list(reversed(urls))
            got = {}
            for k in order:
                r = measure(clients[k], ps, max_new_tokens=args.new, concurrency=4, progress=False, seed=i, label=k)
                got[k] = r
                frames[k].append(r.per_request.assign(round=i))
                print(f"round {i} {k}: accept length {r.summary['accept_length']:.3f}, tok/s "
                      f"{r.summary['tok_s']:.2f} [{r.summary['tok_s_lo']:.2f}, {r.summary['tok_s_hi']:.2f}], runnable "
                      f"{(r.summary.get('machine') or {}).get('runnable_mean')}", flush=True)
            a, b = (got[k].summary for k in urls)
            ratios.append(a["tok_s"] / b["tok_s"])
        pooled = {}
        for k, fs in frames.items():
            df = pd.concat(fs, ignore_index=True)
            df["prompt_id"] = df["prompt_id"].astype(str) + "-r" + df["round"].astype(str)
            s, _, _, _ = summarize(df, positions=None)
            pooled[k] = s
            print(f"{k}: accept length {s['accept_length']:.3f} [{s['accept_length_lo']:.3f}, "
                  f"{s['accept_length_hi']:.3f}], tok/s {s['tok_s']:.2f} [{s['tok_s_lo']:.2f}, {s['tok_s_hi']:.2f}] "
                  f"({len(df)} requests)")
        (sk, fk) = list(urls)
        print(f"time per token fixed / served per round: {[round(x, 3) for x in ratios]} (mean {np.mean(ratios):.3f})")
        mc = measured_cost({**pooled[sk], "num_steps": 3}, {**pooled[fk], "num_steps": 1})
        print(f"measured head cost: {mc}; parameter model: {nextn_draft_cost(TARGET)}")
        print(f"load after: {os.getloadavg()}")
    finally:
        for h in handles:
            h.stop()


if __name__ == "__main__":
    main()
