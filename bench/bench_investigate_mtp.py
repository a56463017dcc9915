"""``investigate`` on the embedded Kimi-class NextN server against the same target with its EAGLE-3 draft (issue 37's
speed goal: the NextN investigation within the EAGLE-3 Kimi-class investigation's time, +20 %), side by side on one
machine at one load.

Both servers run at once (TP 1, ``python -m helpers server start``, 127.0.0.1):

* EAGLE-3: ``--target env/models/kimi/target --draft env/models/kimi/draft --tp 1`` (3 steps, topk 1, 4 draft
  tokens, the defaults), investigated with ``--training env/models/kimi/data/sample`` (the EAGLE-3 path's draft
  stage reads the training data; the NextN head finds its log in the target folder);
* NextN: ``--target env/models/kimi/target --nextn --tp 1 --steps 1``.

Then ``python -m helpers investigate --url URL`` (defaults otherwise: 16 prompts x 32 tokens, the cheap engine-state
probes) alternates between them, A B A B ...; per run the wall seconds of the command, ``seconds_to_verdict`` and
the stage timings of ``investigation.json`` (capture, reference, diagnosis, acceptance budget, engine state, and each
engine-state probe's seconds), and the wall split into the server's seconds answering the run's live requests
(``server_s``: ``latency_s`` of every per-request frame the run saved) and the rest, the investigation's own work
(``own_s``). Prints a markdown table of the medians and the ratio NextN / EAGLE-3 (paste into
bench/RESULTS.md) and the load average before and after. The servers are stopped by PID when the script ends, also
on an error or Ctrl-C.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_investigate_mtp.py --runs 2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
KIMI = ROOT / "env" / "models" / "kimi"
ARMS = {
    "eagle3": {"server": ["--target", str(KIMI / "target"), "--draft", str(KIMI / "draft"), "--tp", "1"],
               "investigate": ["--training", str(KIMI / "data" / "sample")]},
    "nextn": {"server": ["--target", str(KIMI / "target"), "--nextn", "--tp", "1", "--steps", "1"],
              "investigate": []},
}
STAGES = ("attach", "capture", "reference", "diagnosis", "draft checks", "hypotheses", "proposed fix",
          "acceptance budget", "engine state")
READY = re.compile(r"server ready: (http://127\.0\.0\.1:\d+) \(pid (\d+)")


def start_server(args: list[str], log: Path, timeout: float) -> tuple[subprocess.Popen, str]:
    """``python -m helpers server start ARGS`` in the foreground (its supervisor stops the server on SIGTERM);
    returns the supervisor process and the server's URL once it prints ready."""
    f = open(log, "w")
    p = subprocess.Popen([PY, "-m", "helpers", "server", "start", *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=f, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        line = p.stdout.readline()
        if not line:
            if p.poll() is not None:
                raise RuntimeError(f"server start {' '.join(args)} exited {p.returncode} (log {log})")
            continue
        m = READY.search(line)
        if m:
            print(f"  ready in {time.monotonic() - t0:.0f} s: {line.strip()}", flush=True)
            return p, m.group(1)
    stop_server(p)
    raise RuntimeError(f"server start {' '.join(args)}: not ready in {timeout:.0f} s (log {log})")


def stop_server(p: subprocess.Popen) -> None:
    """SIGTERM to the supervisor (it stops its server), SIGKILL after 60 s."""
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


def server_seconds(run_dir: Path) -> float:
    """Seconds the server spent answering the run's live requests: ``latency_s`` summed over the per-request frames
    the run saved (the budget's cold answers, each probe's arms; the offline replays have none)."""
    import pandas as pd
    total = 0.0
    for f in run_dir.rglob("*.parquet"):
        df = pd.read_parquet(f)
        if "latency_s" in df and not f.name.startswith("offline"):
            total += float(df["latency_s"].fillna(0.0).sum())
    return total


def one_run(arm: str, url: str, out: Path, timeout: float) -> dict:
    """``investigate --url URL`` once; its wall seconds, ``seconds_to_verdict``, stage and probe timings."""
    run_out = out / f"{arm}-{time.time_ns()}"
    cmd = [PY, "-m", "helpers", "investigate", "--url", url, "--out", str(run_out), *ARMS[arm]["investigate"]]
    t0 = time.monotonic()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.monotonic() - t0
    docs = sorted(run_out.rglob("investigation.json"))
    if not docs:
        raise RuntimeError(f"{arm}: no investigation.json (exit {p.returncode}): {p.stderr[-2000:]}")
    doc = json.loads(docs[-1].read_text())
    probes = {f"probe {q['probe']}": q.get("seconds") for q in (doc.get("engine_state") or {}).get("probes") or []
              if q.get("status") == "ran"}
    b = doc.get("acceptance") or {}
    srv = server_seconds(docs[-1].parent)
    return {"wall_s": wall, "server_s": srv, "own_s": wall - srv,
            "seconds_to_verdict": doc.get("seconds_to_verdict"), "exit": p.returncode,
            **{s: (doc.get("timings") or {}).get(s) for s in STAGES}, **probes,
            "verdict": doc.get("verdict"), "findings": [f["kind"] for f in doc.get("findings") or []],
            "stages": [(s.get("name"), s.get("accept_length")) for s in b.get("stages") or []],
            "run_dir": str(docs[-1].parent)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2, help="investigations per arm (alternating)")
    ap.add_argument("--timeout", type=float, default=1500)
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench-investigate-mtp-"))
    procs: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    try:
        for arm in ARMS:
            print(f"starting the {arm} server", flush=True)
            procs[arm], urls[arm] = start_server(ARMS[arm]["server"], out / f"{arm}-server.log", args.timeout)
        load0 = os.getloadavg()
        res: dict[str, list[dict]] = {a: [] for a in ARMS}
        for i in range(args.runs):
            for arm in (ARMS if i % 2 == 0 else list(ARMS)[::-1]):       # A B, B A, ...: neither always first
                r = one_run(arm, urls[arm], out, args.timeout)
                print(f"{arm}: {json.dumps(r)}", flush=True)
                res[arm].append(r)
        load1 = os.getloadavg()
    finally:
        for p in procs.values():
            stop_server(p)
    keys = ["wall_s", "server_s", "own_s", "seconds_to_verdict", *STAGES]
    keys += sorted({k for rs in res.values() for r in rs for k in r if k.startswith("probe ")})
    print(f"\nload average before {load0[0]:.1f}, after {load1[0]:.1f}; {args.runs} run(s) per arm\n")
    print("| step | EAGLE-3 s (median) | NextN s (median) | NextN / EAGLE-3 |")
    print("|---|---|---|---|")

    def med(arm: str, k: str) -> float:
        return statistics.median(float(r.get(k) or 0.0) for r in res[arm])
    for k in keys:
        a, b = med("eagle3", k), med("nextn", k)
        if a or b:
            print(f"| {k} | {a:.1f} | {b:.1f} | {b / a:.2f}x |" if a else f"| {k} | {a:.1f} | {b:.1f} | - |")
    per = [n["wall_s"] / e["wall_s"] for e, n in zip(res["eagle3"], res["nextn"])]
    print("\nwall NextN / EAGLE-3 per round (the load moves between rounds): " + ", ".join(f"{x:.2f}" for x in per))
    for arm in ARMS:
        print(f"{arm}: verdicts {[r['verdict'] for r in res[arm]]}, findings {[r['findings'] for r in res[arm]]}, "
              f"stages {res[arm][-1]['stages']}")


if __name__ == "__main__":
    main()
