"""Live investigation speed, side by side in one run (issue 12): on one embedded TP 2 reference server started with
the seeds' config fault and this tool's capture hooks (``server start --detach``), measure

1. ``python -m helpers investigate --no-apply`` (CLI, process start included): attach, capture, reference,
   diagnosis, hypotheses, proposed fix, report;
2. the same with the fix applied (a second server started with the proposed fix, 16 prompts measured on both);
3. the CLI path a user had before (``capture --every-layer`` then ``diagnose``), which names the fault but
   proposes nothing;
4. the live suite, every notebook (``suite run`` with ``server.url``), server start-up excluded;

and the idle CPU of the server (cores busy, over 10 s) with SGLang's ``--sleep-on-idle`` (this tool's default) and
without it, each on a fresh server. Prints one table and the ratios; record it in bench/RESULTS.md.

    .venv/bin/python bench/bench_live.py [--skip-suite] [--skip-idle]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.investigation.propose import draft_variant  # noqa: E402
from helpers.server.process import stop_pid  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
TRAINING = ROOT / "env" / "models" / "data" / "sample"


def cli(*args: str, env=None) -> tuple[float, subprocess.CompletedProcess]:
    t = time.monotonic()
    out = subprocess.run([PY, "-m", "helpers", *args], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=1800)
    return time.monotonic() - t, out


def start(tmp: Path, draft: Path, *extra: str) -> tuple[str, int, float]:
    t, out = cli("server", "start", "--draft", str(draft), "--tp", "2", "--detach", "--state-file",
                 str(tmp / f"state-{time.monotonic_ns()}.json"), *extra)
    if out.returncode:
        raise SystemExit(out.stderr)
    url = re.search(r"ready: (http://\S+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    return url, pid, t


def idle_cores(pid: int, seconds: float = 10.0) -> float:
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    t0 = {p.pid: sum(p.cpu_times()[:2]) for p in procs}
    time.sleep(seconds)
    used = 0.0
    for p in procs:
        try:
            used += sum(p.cpu_times()[:2]) - t0[p.pid]
        except psutil.Error:
            pass
    return used / seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-suite", action="store_true")
    ap.add_argument("--skip-idle", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-live-"))
    draft = draft_variant(ROOT / "env" / "models" / "draft",
                          {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [-1, 1, 3]}}, tmp / "draft")
    rows = []
    print(f"load average before: {os.getloadavg()}", flush=True)
    url, pid, t_start = start(tmp, draft, "--capture-layers", str(tmp / "layers"), "--capture-ranks",
                              str(tmp / "ranks"))
    rows.append(("server start (TP 2, detached)", t_start, ""))
    try:
        time.sleep(3)
        t, out = cli("investigate", "--url", url, "--training", str(TRAINING), "--out", str(tmp / "runs"),
                     "--no-apply", "--json")
        doc = json.loads(out.stdout)
        rows.append(("investigate --no-apply (CLI)", t, f"verdict {doc['verdict']}, first finding "
                     f"{doc['findings'][0]['kind']}, named after {doc['seconds_to_verdict']} s"))
        t, out = cli("capture", "--url", url, "--training", str(TRAINING), "--run-dir", str(tmp),
                     "--every-layer", str(tmp / "layers"), "--name", "old")
        t2, out2 = cli("diagnose", "--training", str(TRAINING), "--served", str(tmp / "dumps" / "old"),
                       "--draft-config", str(draft), "--target-config", str(ROOT / "env" / "models" / "target"),
                       "--reference", str(tmp / "dumps" / "old-reference-server"), "--json")
        kinds = [f["kind"] for f in json.loads(out2.stdout)["findings"]]
        rows.append(("capture --every-layer + diagnose (CLI, before)", t + t2, f"findings {kinds[:3]}, no fix"))
        t, out = cli("investigate", "--url", url, "--training", str(TRAINING), "--out", str(tmp / "runs"), "--json")
        doc = json.loads(out.stdout)
        m = doc["measured"] or {}
        if out.returncode not in (0, 1) or "not_measured" in m:
            raise SystemExit(f"investigate did not measure the fix: {m.get('not_measured') or out.stderr}")
        rows.append(("investigate with the fix applied (CLI)", t,
                     f"accept rate {m['before']['accept_rate']:.2f} -> {m['after']['accept_rate']:.2f}, "
                     f"after: {m.get('after_verdict')}"))
        if not a.skip_suite:
            params = tmp / "params.yaml"
            params.write_text(json.dumps({"name": "bench-live", "server": {"url": url},
                                          "training_data": str(TRAINING),
                                          "notebook_params": {"00_investigate": {"apply_fix": False},
                                                              "20_acceptance": {"count": 8, "max_new_tokens": 16}}}))
            t, out = cli("suite", "run", "--params", str(params), "--out", str(tmp / "suite"))
            status = json.loads(next((tmp / "suite").glob("*/suite_status.json")).read_text())
            per = {k: v["wall_s"] for k, v in status["notebooks"].items()}
            rows.append(("live suite, every notebook (server running)", t,
                         f"{len(per)} notebooks, failed {status['failed']}; per notebook {per}"))
        if not a.skip_idle:
            rows.append(("idle CPU, --sleep-on-idle (default)", idle_cores(pid), "cores busy over 10 s"))
    finally:
        stop_pid(pid)
    if not a.skip_idle:
        import helpers.server.embedded as E
        orig = E.build_command
        E.build_command = lambda *x, **k: [c for c in orig(*x, **k) if c != "--sleep-on-idle"]
        h = E.start(None, draft, tp=2)
        try:
            time.sleep(3)
            rows.append(("idle CPU, without --sleep-on-idle", idle_cores(h.pid), "cores busy over 10 s"))
        finally:
            h.stop()
    print(f"\n{'what':52s} {'seconds / cores':>16s}  notes")
    for what, v, note in rows:
        print(f"{what:52s} {v:16.2f}  {note}")
    d = dict((r[0], r[1]) for r in rows)
    inv = d["investigate --no-apply (CLI)"]
    print(f"\ninvestigate / (capture + diagnose): {inv / d['capture --every-layer + diagnose (CLI, before)']:.2f}")
    if "live suite, every notebook (server running)" in d:
        print(f"live suite / investigate: {d['live suite, every notebook (server running)'] / inv:.2f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
