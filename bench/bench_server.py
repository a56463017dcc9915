"""Reference-server speed on this machine: startup time and greedy tok/s at TP 1 / 2 / 8.

For each TP size, with and without the EAGLE-3 draft (steps 3, topk 1, 4 draft tokens), this
starts the CPU reference server ``--runs`` times and records the seconds until ``/health``
answers, then sends ``--requests`` greedy requests of ``--new-tokens`` tokens one at a time
(after one warm-up request) and reports tok/s = completion tokens / wall seconds. Medians are
printed as a markdown table (paste into bench/RESULTS.md).

    .venv/bin/python bench/bench_server.py                       # reference models, TP 1 2 8
    .venv/bin/python bench/bench_server.py --tp 1 2 --runs 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.server.embedded import REFERENCE_DRAFT, REFERENCE_TARGET, start
from helpers.server.settings import SpecSettings

PROMPTS = [
    "The function returns a list of",
    "To install the package, run",
    "In this module, the class",
    "An exception is raised when the",
]


def one_config(target, draft, tp, runs, requests, new_tokens, timeout):
    startups, rates, accept = [], [], []
    for _ in range(runs):
        t0 = time.monotonic()
        with start(target, draft, tp=tp, timeout=timeout,
                   spec=SpecSettings(num_steps=3, topk=1, num_draft_tokens=4)) as srv:
            startups.append(time.monotonic() - t0)
            with httpx.Client(base_url=srv.url, timeout=600) as c:
                body = {"text": PROMPTS[0], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
                c.post("/generate", json=body).raise_for_status()  # warm-up
                toks, secs, verify = 0, 0.0, 0
                for i in range(requests):
                    body = {"text": PROMPTS[i % len(PROMPTS)],
                            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0,
                                                "ignore_eos": True}}
                    t1 = time.monotonic()
                    meta = c.post("/generate", json=body).json()["meta_info"]
                    secs += time.monotonic() - t1
                    toks += meta["completion_tokens"]
                    verify += meta.get("spec_verify_ct", 0)
                rates.append(toks / secs)
                if verify:
                    accept.append(toks / verify)
    return {"startup_s": statistics.median(startups), "tok_s": statistics.median(rates),
            "accept_length": statistics.median(accept) if accept else None,
            "startups": startups, "rates": rates}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default=str(REFERENCE_TARGET))
    ap.add_argument("--draft", default=str(REFERENCE_DRAFT))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--runs", type=int, default=3, help="server starts per configuration")
    ap.add_argument("--requests", type=int, default=3, help="timed requests per start")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--timeout", type=float, default=900)
    args = ap.parse_args()
    rows = []
    for tp in args.tp:
        for label, draft in (("target only", None), ("EAGLE-3 3/1/4", args.draft)):
            r = one_config(args.target, draft, tp, args.runs, args.requests, args.new_tokens,
                           args.timeout)
            rows.append((tp, label, r))
            print(f"tp={tp} {label}: startup {r['startup_s']:.1f} s, {r['tok_s']:.2f} tok/s, "
                  f"accept length {r['accept_length']}  (startups {[round(x, 1) for x in r['startups']]},"
                  f" tok/s {[round(x, 2) for x in r['rates']]})", flush=True)
    print("\n| TP | server | startup s (median) | greedy tok/s, 64 new tokens (median) | accept length |")
    print("|---|---|---|---|---|")
    for tp, label, r in rows:
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(f"| {tp} | {label} | {r['startup_s']:.1f} | {r['tok_s']:.2f} | {acc} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
