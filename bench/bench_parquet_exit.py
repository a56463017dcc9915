"""Exit aborts of short Parquet-writing processes: pandas' defaults vs helpers.runfiles, side by side.

pandas' ``to_parquet`` / ``read_parquet`` run on Arrow's global CPU and I/O thread pools; a process
that exits right after (a CLI such as ``python -m helpers measure``) sometimes aborts during
interpreter teardown with ``terminate called without an active exception`` (exit -6 / 134), after
its work is done (apache/arrow#34314). ``helpers.runfiles.parquet_bytes`` / ``read_parquet`` start
no Arrow thread. This script runs ``--runs`` short child processes per mode, ``--jobs`` at a time,
the two modes interleaved so both see the same machine load. Each child writes a per-request
Parquet file and appends two rows to a :class:`helpers.acceptance.ledger.Ledger` (read back under its lock),
then exits. It prints how many children exited non-zero per mode.

    .venv/bin/python bench/bench_parquet_exit.py                   # 600 runs per mode, 4 at a time
    .venv/bin/python bench/bench_parquet_exit.py --runs 200 --jobs 2
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import sys
from pathlib import Path
import numpy as np, pandas as pd
from helpers import ledger
from helpers.runfiles import atomic_write_bytes, parquet_bytes
mode, folder = sys.argv[1], Path(sys.argv[2])
df = pd.DataFrame({"a": np.arange(20), "b": np.random.rand(20), "c": ["x"] * 20})
if mode == "pandas":
    # the code before helpers.runfiles: pandas' defaults for the per-request file and the ledger
    df.to_parquet(folder / "per_request.parquet", index=False)
    ledger.parquet_bytes = lambda d: d.to_parquet(index=False)
    ledger.read_parquet = lambda b: pd.read_parquet(__import__("io").BytesIO(b))
else:
    atomic_write_bytes(folder / "per_request.parquet", parquet_bytes(df))
led = ledger.Ledger(folder / "ledger.parquet")
led.append({"fix": "f", "x": 1.0, "ids": [1, 2]})
led.append({"fix": "g", "x": 2.0})
assert len(led.read()) == 2
"""


def _one(mode: str, tmp: Path, i: int) -> tuple[str, int, str]:
    folder = tmp / f"{mode}-{i}"
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD, mode, str(folder)], capture_output=True,
                         text=True, env=env, timeout=300)
    return mode, out.returncode, (out.stderr.strip().splitlines() or [""])[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=600, help="child processes per mode")
    ap.add_argument("--jobs", type=int, default=4, help="children running at once")
    args = ap.parse_args()
    fails = {"pandas": 0, "runfiles": 0}
    rcs: dict[str, set] = {"pandas": set(), "runfiles": set()}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="e3f-parquet-exit-") as tmp, \
            ThreadPoolExecutor(args.jobs) as pool:
        jobs = [pool.submit(_one, mode, Path(tmp), i) for i in range(args.runs) for mode in fails]
        for fut in tqdm(jobs, desc="children", unit="proc"):
            mode, rc, last = fut.result()
            if rc != 0:
                fails[mode] += 1
                rcs[mode].add(f"{rc}: {last[:80]}")
    print(f"{args.runs} children per mode, {args.jobs} at a time, {os.cpu_count()} CPUs, "
          f"{time.monotonic() - t0:.0f} s")
    print("| mode | children | exited non-zero | exit codes / last stderr line |")
    print("| --- | --- | --- | --- |")
    for mode, n in fails.items():
        print(f"| {mode} | {args.runs} | {n} ({100 * n / args.runs:.1f}%) | {'; '.join(sorted(rcs[mode])) or '-'} |")


if __name__ == "__main__":
    main()
