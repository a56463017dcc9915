"""What skipping SGLang's unneeded model modules saves at server start (``SGLANG_DISABLED_MODEL_ARCHS``).

Starts the embedded server (target only, the Llama reference target by default) alternately with the launcher's
default (every ``sglang/srt/models`` module but the ones ``KEEP_MODEL_MODULES`` names is skipped) and with the variable
set empty (SGLang imports all ~250 model modules in each process, as every embedded server did before 2026-12-02),
``--runs`` times each, and prints the seconds to a healthy ``/health`` side by side.

    .venv/bin/python bench/bench_model_imports.py --tp 1 --runs 2
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.server.embedded import REFERENCE_TARGET, start  # noqa: E402


def one(target: str, tp: int, skip: bool) -> float:
    saved = os.environ.pop("SGLANG_DISABLED_MODEL_ARCHS", None)
    if not skip:
        os.environ["SGLANG_DISABLED_MODEL_ARCHS"] = ""      # start() leaves a value it finds: import everything
    try:
        t0 = time.monotonic()
        with start(target, None, tp=tp, timeout=1800):
            return time.monotonic() - t0
    finally:
        os.environ.pop("SGLANG_DISABLED_MODEL_ARCHS", None)
        if saved is not None:
            os.environ["SGLANG_DISABLED_MODEL_ARCHS"] = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", default=str(REFERENCE_TARGET))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(args.runs):
        for skip in ((True, False) if r % 2 == 0 else (False, True)):
            times[skip].append(one(args.target, args.tp, skip))
            print(f"run {r} {'skip' if skip else 'import all'}: {times[skip][-1]:.1f} s", flush=True)
    a, b = statistics.median(times[True]), statistics.median(times[False])
    print(f"\nTP {args.tp}, {args.target}, load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after: "
          f"modules skipped {a:.1f} s {[round(x) for x in times[True]]}, all imported {b:.1f} s "
          f"{[round(x) for x in times[False]]}; saved {b - a:.1f} s ({(b - a) / b:.0%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
