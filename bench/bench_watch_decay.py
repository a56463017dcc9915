"""``python -m helpers watch`` and its decay detector on generated draft decays it was not shaped on (issue 36 items 5
and 7: "acceptance decaying over hours of uptime", the ``draft_decay`` class of ``tests/support/engine_faults.py``).

Each case is one embedded SGLang server (``python -m helpers server start --reference-draft --detach``, stopped by its
PID) with a fault drawn from a seed: the draft's ``fc`` scaled by a factor (strong 0.1-0.5, weak 0.97-0.995, the
generator's :data:`engine_faults.STRENGTH`) once more than N requests have been drafted, N drawn here in
``--after`` (later than the generator's 0-6, so the watch first sees a baseline), or a clean server. The watch runs
as a user runs it (the CLI in a subprocess, the lifecycle's fixed probe on: two requests per interval) for
``--samples`` intervals; the bench then reads the run's ``watch.jsonl``:

* the first ``drop`` record (the detector's change point that triggered, its index CI) against the true onset: the
  first sample whose interval held the request past N (from the server's own request counter in each sample);
* the accept length before and after the onset (the samples' own), and whether a lifecycle ``event`` fired.

Verdicts: a clean server has no drop (``right``; a drop is ``wrong``); a strong decay is ``right`` when a drop
triggered with the onset inside the change point's index CI widened by one sample, ``late/early`` when it triggered
elsewhere, ``missed`` when none did; a weak decay is ``right`` when a drop triggered at the onset, ``weak-open`` when
none did (a 0.5-3 % weight scale moves the accept length by less than the noise of 32-token probes), ``wrong``
when it triggered elsewhere.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_watch_decay.py --seed 1 --strong 3 --weak 1 --clean 1

Writes ``<out>/watch-decay.jsonl`` (one record per case) and prints the table; record it in bench/RESULTS.md with the
date and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.acceptance.watch import iter_log  # noqa: E402
from tests.support.engine_faults import STRENGTH, EngineFault  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")


def cases(seed: int, strong: int, weak: int, clean: int, after: tuple[int, int]) -> list[EngineFault]:
    """``clean`` clean servers, then ``strong`` and ``weak`` draft decays, each drawn from ``seed``: the factor
    uniform in the tier's range of :data:`STRENGTH`, N uniform in ``after``."""
    r = random.Random(seed)
    out = [EngineFault("clean", "-", 0.0, r.randrange(1 << 16)) for _ in range(clean)]
    for tier, n in (("strong", strong), ("weak", weak)):
        lo, hi = STRENGTH["draft_decay"][0 if tier == "strong" else 1]
        for _ in range(n):
            out.append(EngineFault("draft_decay", tier, round(r.uniform(lo, hi), 3), r.randrange(1 << 16),
                                   r.randint(*after)))
    return out


def onset(samples: list[dict], after: int) -> int | None:
    """The index ``i`` of the first sample whose interval held request ``after + 1`` (the first damaged one: the
    hook scales the draft once more than ``after`` prefills were drafted), from the server's own request counter at
    each sample (``counters.requests``: the warm-up request and the watch's first ones included, as the hook counts
    them; a request the metrics do not count moves it by one sample, the tolerance of :func:`verdict`)."""
    for s in samples:
        if float((s.get("counters") or {}).get("requests") or 0) > after:
            return s["i"]
    return None


def verdict(f: EngineFault, drop: dict | None, true_i: int | None) -> str:
    if f.cls == "clean":
        return "wrong" if drop else "right"
    if drop is None:
        return "weak-open" if f.tier == "weak" else "missed"
    lo, hi = drop["change"]["i_ci"]
    if true_i is not None and lo - 1 <= true_i <= hi + 1:
        return "right"
    return "wrong" if f.tier == "weak" else "late/early"


def one(f: EngineFault, k: int, out: Path, a: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"e3f-wd-{k}-"))
    state = tmp / "srv.json"
    cmd = [PY, "-m", "helpers", "server", "start", "--reference-draft", "--tp", str(a.tp), "--detach",
           "--state-file", str(state), "--log", str(out / f"server-{k}.log")]
    if f.hook_specs():
        cmd += ["--forward-hooks", json.dumps(f.hook_specs())]
    rec = {**f.to_json(), "k": k, "tp": a.tp, "load_start": os.getloadavg()}
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    info = json.loads(state.read_text())
    run = out / f"watch-{k}"
    try:
        w = subprocess.run([PY, "-m", "helpers", "watch", "--url", info["url"], "--interval", str(a.interval),
                            "--samples", str(a.samples), "--baseline", str(a.baseline), "--drop-frac",
                            str(a.drop_frac), "--probe-tokens", str(a.probe_tokens), "--out", str(run), "--quiet"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60 * a.case_minutes)
    finally:
        subprocess.run([PY, "-m", "helpers", "server", "stop", str(info["pid"])], cwd=ROOT, capture_output=True,
                       timeout=120)
    logs = sorted(run.rglob("watch.jsonl"))
    recs = list(iter_log(logs[0])) if logs else []
    samples = [r for r in recs if r["kind"] == "sample"]
    drops = [r for r in recs if r["kind"] == "drop"]
    events = [r for r in recs if r["kind"] == "event"]
    true_i = onset(samples, f.after) if f.cls != "clean" else None
    al = [(s["i"], s["accept_length"]) for s in samples if s.get("accept_length") is not None]
    before = [v for i, v in al if true_i is None or i < true_i]
    after_ = [v for i, v in al if true_i is not None and i > true_i]
    d = drops[0] if drops else None
    return {**rec, "watch_rc": w.returncode, "watch_err": w.stderr.strip().splitlines()[-1:] if w.returncode else [],
            "samples": len(samples), "onset_i": true_i, "drop": None if d is None else
            {"i": d["i"], "change_i": d["change"]["i"], "i_ci": d["change"]["i_ci"],
             "before": d["change"].get("before"), "after": d["change"].get("after"),
             "reason": d["decision"].get("reason")},
            "drops": len(drops), "events": [e.get("events") for e in events][:3],
            "accept_before": round(sum(before) / len(before), 3) if before else None,
            "accept_after": round(sum(after_) / len(after_), 3) if after_ else None,
            "verdict": verdict(f, d, true_i), "wall_s": round(time.monotonic() - t0, 1),
            "load_end": os.getloadavg(), "run_dir": str(run)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--strong", type=int, default=3)
    ap.add_argument("--weak", type=int, default=1)
    ap.add_argument("--clean", type=int, default=1)
    ap.add_argument("--after", default="14,30", help="N's range (requests before the decay), lo,hi")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--samples", type=int, default=36)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--baseline", type=int, default=5)
    ap.add_argument("--drop-frac", type=float, default=0.15)
    ap.add_argument("--probe-tokens", type=int, default=32)
    ap.add_argument("--case-minutes", type=float, default=8.0)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-watch-decay"))
    a = ap.parse_args()
    out = Path(a.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    lo, hi = (int(x) for x in a.after.split(","))
    recs = []
    for k, f in enumerate(cases(a.seed, a.strong, a.weak, a.clean, (lo, hi))):
        print(f"[{time.strftime('%H:%M:%S')}] case {k}: {f.label}, load {os.getloadavg()[0]:.1f}", flush=True)
        r = one(f, k, out, a)
        recs.append(r)
        with open(out / "watch-decay.jsonl", "a") as fh:
            fh.write(json.dumps(r) + "\n")
        d = r["drop"]
        print(f"  -> {r['verdict']}: onset sample {r['onset_i']}, drop "
              + ("none" if d is None else f"at {d['change_i']} CI {d['i_ci']} ({d['before']:.2f} -> {d['after']:.2f})")
              + f", accept {r['accept_before']} -> {r['accept_after']}, events {r['events']}, {r['wall_s']} s",
              flush=True)
    v = [r["verdict"] for r in recs]
    print(f"cases {len(recs)}: " + ", ".join(f"{x} {v.count(x)}" for x in sorted(set(v))))
    print(f"written: {out / 'watch-decay.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
