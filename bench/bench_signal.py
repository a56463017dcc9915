"""Seconds from SIGINT / SIGTERM to the end of ``measure --fixes`` whose fix starts the embedded reference server
(issue 30): docs/cli.md promises the command ends within 2 s, every process it started stopped.

Each run starts ``python -m helpers measure --fixes F`` (one fix: the embedded SGLang CPU server, reference target and
draft, TP ``--tp``) as a separate process, waits for the phase asked for, sends the signal and measures

* ``exit``: seconds from the signal to the command's exit (what docs/cli.md promises), and
* ``tree``: seconds from the signal until no process the command started (the server's leader, schedulers,
  detokenizer) is left (zombies aside);

and checks the exit code (130 / 143), the one-line error and the run folder's FAILED. Phases: ``startup`` (the
server started ``--startup-wait`` s ago and is not yet healthy) and ``measure`` (requests in flight: the command
holds a connection to the server's port). Servers are on 127.0.0.1 and stopped by their PIDs if anything is left.

    .venv/bin/python bench/bench_signal.py                       # 3 runs x SIGINT/SIGTERM x startup/measure
    .venv/bin/python bench/bench_signal.py --runs 5 --phases measure

Prints one line per run and the bound (max and median) per phase; record them in bench/RESULTS.md with the date
and the machine's load.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143)}


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def one_run(sig: str, phase: str, tmp: Path, *, tp: int, startup_wait: float) -> dict:
    """One command, one signal; returns ``{"sig", "phase", "exit_s", "tree_s", "rc", "ok", "line"}``."""
    signum, code = SIGNALS[sig]
    fixes = tmp / "fixes.yaml"
    fixes.write_text(json.dumps({"name": "sig", "measure": {"count": 400, "max_new_tokens": 64, "warmup": 0,
                                                            "concurrency": 2},
                                 "fixes": [{"name": "ref", "launch": {"tp": tp}}]}))
    out = tmp / "out"
    err_path = tmp / "stderr.txt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "helpers", "measure", "--fixes", str(fixes), "--outputs",
                                 str(out), "--quiet"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                stdin=subprocess.DEVNULL)
    me = psutil.Process(proc.pid)
    seen: dict[int, psutil.Process] = {}
    try:
        end = time.monotonic() + 600
        first_child = None
        while True:
            assert proc.poll() is None, f"exited {proc.returncode} early: {err_path.read_text()}"
            assert time.monotonic() < end, "the phase was not reached in 600 s"
            kids = me.children(recursive=True)
            seen.update({p.pid: p for p in kids})
            if kids and first_child is None:
                first_child = time.monotonic()
            if phase == "startup" and first_child is not None and time.monotonic() - first_child >= startup_wait:
                break
            if phase == "measure" and kids:
                ports = set()
                for k in kids:
                    with contextlib.suppress(psutil.Error):
                        ports |= {c.laddr.port for c in k.net_connections(kind="tcp")
                                  if c.status == psutil.CONN_LISTEN}
                conns = [c for c in me.net_connections(kind="tcp")
                         if c.raddr and c.raddr.port in ports and c.status == psutil.CONN_ESTABLISHED]
                if len(conns) >= 2:         # both workers are sending /generate
                    time.sleep(1.0)
                    break
            time.sleep(0.1)
        seen.update({p.pid: p for p in me.children(recursive=True)})
        t = time.monotonic()
        proc.send_signal(signum)
        rc = proc.wait(timeout=60)
        exit_s = time.monotonic() - t
        while any(_alive(p) for p in seen.values()) and time.monotonic() - t < 60:
            time.sleep(0.01)
        tree_s = time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for p in seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()
    text = err_path.read_text(errors="replace")
    line = next((ln for ln in text.splitlines() if ln.startswith("measure: error:")), "")
    runs = [p for p in out.iterdir() if p.is_dir()] if out.is_dir() else []
    failed = bool(runs) and (runs[0] / "FAILED").exists() and sig in (runs[0] / "FAILED").read_text()
    ok = rc == code and sig in line and failed and not any(_alive(p) for p in seen.values())
    return {"sig": sig, "phase": phase, "exit_s": exit_s, "tree_s": tree_s, "rc": rc, "ok": ok, "line": line,
            "processes": len(seen)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs per signal and phase (default 3)")
    ap.add_argument("--phases", default="startup,measure", help="comma-separated: startup, measure")
    ap.add_argument("--tp", type=int, default=1, help="TP size of the embedded server (default 1)")
    ap.add_argument("--startup-wait", type=float, default=8.0, help="seconds into the server start (default 8)")
    a = ap.parse_args()
    load = os.getloadavg()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f}; embedded server TP {a.tp}")
    results = []
    for phase in a.phases.split(","):
        for i in range(a.runs):
            for sig in SIGNALS:
                with tempfile.TemporaryDirectory(prefix="e3f-bench-signal-") as tmp:
                    r = one_run(sig, phase, Path(tmp), tp=a.tp, startup_wait=a.startup_wait)
                results.append(r)
                print(f"{phase:8s} {sig:8s} run {i + 1}: exit {r['exit_s']:.2f} s, every process gone "
                      f"{r['tree_s']:.2f} s, rc {r['rc']}, {r['processes']} processes, "
                      f"{'ok' if r['ok'] else 'NOT OK: ' + r['line']}", flush=True)
    for phase in a.phases.split(","):
        ex = [r["exit_s"] for r in results if r["phase"] == phase]
        tr = [r["tree_s"] for r in results if r["phase"] == phase]
        print(f"{phase}: exit max {max(ex):.2f} s, median {statistics.median(ex):.2f} s; every process gone max "
              f"{max(tr):.2f} s ({len(ex)} runs, {sum(r['ok'] for r in results if r['phase'] == phase)} ok)")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
