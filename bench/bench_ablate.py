"""Ablation and workload-sweep speed, side by side in one run (issue 23): on one embedded TP 1 reference server
(``server start --detach``), run ``python -m helpers ablate`` (CLI, process start included)

1. with its defaults (three sweeps, every toggle, ``--budget 120``): wall time against the budget, points and toggles
   measured and skipped;
2. the three sweeps alone (``--toggles none``);
3. one toggle alone (``--sweeps none --toggles radix_cache_off``): the cost of a restart and one measurement;

and, from the run folders, the time inside measurements (sum of each point's ``wall_s``) against the command's wall
time: the share of the budget the tool itself spends (process start, server_info, restarts, saving). Prints one table
and the ratios; record it in bench/RESULTS.md with the date and the machine's load.

    .venv/bin/python bench/bench_ablate.py
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.server.process import stop_pid  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")


def cli(*args: str) -> tuple[float, subprocess.CompletedProcess]:
    t = time.monotonic()
    out = subprocess.run([PY, "-m", "helpers", *args], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ))
    return time.monotonic() - t, out


def run_folder(stderr: str) -> Path:
    return Path(re.search(r"\[ablate\] run folder (\S+)", stderr).group(1))


def inside(doc: dict) -> float:
    """Seconds spent inside measurements: each measured point's and toggle's wall time."""
    s = sum(p["summary"].get("wall_s") or 0 for sw in doc["sweeps"].values() for p in sw["points"] if not p["skipped"])
    return s + sum(t.get("wall_s") or 0 for t in doc["toggles"] if t["status"] == "measured")


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="bench-ablate-"))
    os.environ["E3F_SERVER_REGISTRY"] = str(tmp / "registry")
    t, out = cli("server", "start", "--reference-draft", "--tp", "1", "--detach")
    if out.returncode:
        print(out.stderr[-2000:])
        return 1
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    print(f"server up in {t:.0f} s at {url}; load average {os.getloadavg()[0]:.1f}")
    rows = []
    try:
        for name, args in (("defaults (budget 120 s)", []),
                           ("sweeps only", ["--toggles", "none"]),
                           ("radix_cache_off only", ["--sweeps", "none", "--toggles", "radix_cache_off",
                                                     "--budget", "300"])):
            wall, out = cli("ablate", "--url", url, "--out", str(tmp / "runs"), *args)
            doc = json.loads((run_folder(out.stderr) / "results" / "ablate.json").read_text())
            pts = [p for sw in doc["sweeps"].values() for p in sw["points"]]
            rows.append({"run": name, "wall_s": wall, "budget_s": doc["budget_s"], "inside_s": inside(doc),
                         "points": sum(1 for p in pts if not p["skipped"]),
                         "points_skipped": sum(1 for p in pts if p["skipped"]),
                         "toggles": sum(1 for x in doc["toggles"] if x["status"] == "measured"),
                         "toggles_skipped": sum(1 for x in doc["toggles"] if x["status"] != "measured"),
                         "progress_lines": out.stderr.count("[ablate] "), "rc": out.returncode})
    finally:
        stop_pid(pid)
    print(f"{'run':<26}{'wall s':>8}{'budget':>8}{'inside':>8}{'pts':>5}{'skip':>5}{'tog':>5}{'skip':>5}"
          f"{'lines':>7}{'rc':>4}")
    for r in rows:
        print(f"{r['run']:<26}{r['wall_s']:>8.1f}{r['budget_s']:>8.0f}{r['inside_s']:>8.1f}{r['points']:>5}"
              f"{r['points_skipped']:>5}{r['toggles']:>5}{r['toggles_skipped']:>5}{r['progress_lines']:>7}{r['rc']:>4}")
    d = rows[0]
    print(f"defaults: wall / budget {d['wall_s'] / d['budget_s']:.2f}; measured share of the wall time "
          f"{d['inside_s'] / d['wall_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
