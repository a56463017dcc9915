"""Wall time of the notebook suite (what `make postmortem` runs) and the size of its HTML pages.

    .venv/bin/python bench/bench_suite.py [--params env/cases/main.yaml] [--out DIR] [--from-run RUN_DIR]

Runs ``python -m helpers suite run --params ...`` as a child process (the same command as the
Makefile, minus `make setup`), then prints a markdown report for bench/RESULTS.md: total wall time,
the replay's steps (server start-up per fix with its TP size, measurement, hypotheses, sweep points;
TP 8 parts are listed separately), each notebook's wall time and HTML size, the postmortem against
``helpers.suite.html.HTML_BUDGET_BYTES``, and the machine (CPUs, load average before/after).
``--from-run`` re-renders the report of an existing run folder without running anything.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def report(run_dir: Path, wall: float | None = None, load: tuple | None = None) -> str:
    from helpers.suite.html import HTML_BUDGET_BYTES

    status = json.loads((run_dir / "suite_status.json").read_text())
    replays = sorted((run_dir / "results").glob("replay-*.json"))
    doc = json.loads(replays[-1].read_text()) if replays else {}
    lines = [f"Run folder `{run_dir.name}`; {os.cpu_count()} CPUs"
             + (f"; load average before/after {load[0]:.1f} / {load[1]:.1f}" if load else "") + ".", ""]
    total = wall if wall is not None else status.get("wall_s")
    lines += [f"* **suite wall time: {total:.0f} s** (runner: {status.get('wall_s')} s; "
              f"notebooks failed: {status.get('failed') or 'none'})"]
    if doc:
        from helpers.runfiles import safe_name

        def tp_of(name):
            summ = json.loads((run_dir / "acceptance" / safe_name(name) / "summary.json").read_text()) \
                if (run_dir / "acceptance" / safe_name(name) / "summary.json").exists() else {}
            return (summ.get("summary") or {}).get("tp_size") or doc.get("tp")

        tp8 = [s for s in doc.get("steps", []) if s.get("kind") == "fix" and tp_of(s.get("name") or "") == 8]
        lines.append(f"* replay `{doc.get('case')}` (TP {doc.get('tp')}): {doc.get('wall_s')} s in 00_replay")
        for s in doc.get("steps", []):
            what = s.get("name") or s.get("check") or s.get("kind")
            extra = ""
            if s.get("kind") == "fix":
                sm = s.get("summary") or {}
                extra = (f" (TP {tp_of(s.get('name') or '')}, server start {s.get('server_startup_s')} s; accept length "
                         f"{(sm.get('accept_length') or float('nan')):.2f}, {(sm.get('tok_s') or float('nan')):.1f} tok/s)")
            elif s.get("kind") == "sweep":
                extra = " (" + ", ".join(
                    f"num_steps {p['num_steps']}: " + (f"reused '{p['reused']}'" if p.get("reused")
                                                       else f"start {p.get('server_startup_s')} s")
                    for p in s.get("points", [])) + ")"
            elif s.get("kind") == "hypothesis":
                extra = f" ({s.get('verdict')})"
            lines.append(f"  * step {s.get('index', 0) + 1} {s.get('kind')} `{what}`: {s.get('wall_s')} s{extra}")
        lines.append(f"* TP 8 part: {sum(s.get('wall_s') or 0 for s in tp8):.0f} s" if tp8
                     else "* TP 8 part: none (this case runs every server at TP "
                          f"{doc.get('tp')}; no step starts a TP 8 server)")
    lines += ["", "| notebook | wall s | HTML | offline, plotly.js copies |", "|---|---|---|---|"]
    for nb, e in status.get("notebooks", {}).items():
        chk = e.get("html_check") or {}
        lines.append(f"| {nb} | {e.get('wall_s')} | {(e.get('html_bytes') or 0) / 1e6:.2f} MB | "
                     f"{chk.get('offline')}, {chk.get('plotlyjs_copies')} |")
    pm = status.get("postmortem_bytes") or 0
    lines += ["", f"* postmortem.html: **{pm / 1e6:.2f} MB** (budget {HTML_BUDGET_BYTES / 1e6:.0f} MB; "
                  f"plotly.js is {_plotlyjs_bytes() / 1e6:.2f} MB of it)"]
    return "\n".join(lines)


def _plotlyjs_bytes() -> int:
    from plotly.offline import get_plotlyjs

    return len(get_plotlyjs().encode())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default=str(ROOT / "env" / "cases" / "main.yaml"))
    ap.add_argument("--out", default=None, help="parent of the run folder (default outputs/)")
    ap.add_argument("--from-run", default=None, help="report on an existing run folder")
    args = ap.parse_args(argv)
    if args.from_run:
        print(report(Path(args.from_run)))
        return 0
    out = Path(args.out) if args.out else ROOT / "outputs"
    before = set(out.glob("*")) if out.exists() else set()
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "helpers", "suite", "run", "--params", args.params, "--out", str(out)]
    rc = subprocess.call(cmd, cwd=ROOT)
    wall = time.monotonic() - t0
    load1 = os.getloadavg()[0]
    (run_dir,) = [p for p in out.glob("*") if p.is_dir() and p not in before]
    print(f"\n(suite exit code {rc})\n")
    print(report(run_dir, wall, (load0, load1)))
    return rc


if __name__ == "__main__":
    sys.exit(main())
