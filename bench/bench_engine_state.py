"""The engine-state probes (helpers.investigation.probes) on generated engine faults they were not shaped on.

Each draw is one embedded SGLang server (``python -m helpers server start --detach``, stopped by PID) with a fault
class, a strength and a seed drawn at random (``--seed``): ``clean``, ``draft_kv_stale`` (the draft's KV of a cached
or earlier-chunk prefix replaced by noise on that share of its slots, after the draft's prefill extend) or
``verify_swap`` (target verify emits its runner-up token on that share of rows), injected by the test-only hooks of
``tests/support/engine_faults.py``; then every probe (``--engine-probes all``: radix_hit on the server,
chunked_prefill and greedy_lossless on restarted copies) on the bundled live prompts. Per draw: the class, strength,
TP, each probe's decision and loss, wall times. The table: true class x probes that count; the goal: a clean draw
counts nowhere, a fault counts in the probe(s) of its mechanism (draft_kv_stale: radix_hit / chunked_prefill;
verify_swap: greedy_lossless) and in no other.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_engine_state.py --draws 6 --seed 1 --tp 1,2 --minutes 25

Writes ``<out>/engine-state.jsonl`` (one record per draw, as it finishes) and prints the table; record it in
bench/RESULTS.md with the date and the load.
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

from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.budget import Budget  # noqa: E402
from helpers.engines.detect import detect  # noqa: E402
from helpers.investigation.attach import attach  # noqa: E402
from helpers.investigation.probes import ProbeContext, run_probes  # noqa: E402
from helpers.runfiles import new_run_dir  # noqa: E402
from tests.support.engine_faults import spec  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
#: class -> the probes whose counting is its mechanism
EXPECTED = {"clean": set(), "draft_kv_stale": {"radix_hit", "chunked_prefill"}, "verify_swap": {"greedy_lossless"}}
#: class -> strength range drawn from
STRENGTH = {"draft_kv_stale": (0.2, 1.0), "verify_swap": (0.02, 0.3)}


def draws(n: int, seed: int, tps: list[int]) -> list[dict]:
    rng = random.Random(seed)
    classes = list(EXPECTED)
    out = []
    for i in range(n):
        c = classes[i % len(classes)] if i < len(classes) else rng.choice(classes)
        lo, hi = STRENGTH.get(c, (0.0, 0.0))
        out.append({"cls": c, "strength": round(rng.uniform(lo, hi), 3), "seed": rng.randrange(1 << 16),
                    "tp": tps[i % len(tps)]})
    return out


def one(d: dict, out: Path, prompts: int) -> dict:
    state = Path(tempfile.mkdtemp()) / "srv.json"
    cmd = [PY, "-m", "helpers", "server", "start", "--reference-draft", "--tp", str(d["tp"]), "--detach",
           "--state-file", str(state), "--log", str(out / f"server-{d['i']}.log")]
    if d["cls"] != "clean":
        cmd += ["--forward-hooks", json.dumps([spec(d["cls"], strength=d["strength"], seed=d["seed"])])]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    info = json.loads(state.read_text())
    try:
        ad = detect(info["url"], None, deadline_s=30).adapter
        dl = Budget(900)
        c = ad.client(info["url"], None, timeout=120, budget=dl)
        att = attach(c, caveats=ad.capture_caveats)
        rd = new_run_dir(f"engine-state-{d['i']}", out)
        ctx = ProbeContext(client=c, adapter=ad, att=att, run_dir=rd, prompts=load_prompts(None, n=prompts),
                           max_new_tokens=32, dl=dl)
        st = run_probes(ctx, "all")
        c.close()
    finally:
        subprocess.run([PY, "-m", "helpers", "server", "stop", str(info["pid"])], cwd=ROOT, capture_output=True)
    probes = {p["probe"]: {"status": p["status"], "decision": p["decision"],
                           "delta": (p.get("loss") or {}).get("delta"), "ci": (p.get("loss") or {}).get("ci"),
                           "why": p.get("why"), "diverging": p["evidence"].get("diverging")}
              for p in st["probes"]}
    counted = {k for k, v in probes.items() if v["decision"] == "counts"}
    return {**d, "probes": probes, "counted": sorted(counted), "expected": sorted(EXPECTED[d["cls"]]),
            "wrong": sorted(counted - EXPECTED[d["cls"]]), "missed": sorted(EXPECTED[d["cls"]] - counted),
            "wall_s": round(time.monotonic() - t0, 1), "load": os.getloadavg()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=6)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=25.0)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-engine-state"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + 60 * a.minutes
    recs = []
    for i, d in enumerate(draws(a.draws, a.seed, [int(x) for x in a.tp.split(",")])):
        if time.monotonic() > t_end:
            print(f"stopping: {a.minutes} min spent", flush=True)
            break
        d["i"] = i
        r = one(d, out, a.prompts)
        recs.append(r)
        with open(out / "engine-state.jsonl", "a") as f:
            f.write(json.dumps(r) + "\n")
        print(f"{r['cls']:15} s={r['strength']:<6} tp={r['tp']} counted={r['counted']} wrong={r['wrong']} "
              f"missed={r['missed']} " + " ".join(f"{k}:{v['decision']}:{v['delta'] if v['delta'] is None else round(v['delta'], 2)}"
                                                 for k, v in r["probes"].items()) + f" ({r['wall_s']} s)", flush=True)
    wrong = sum(bool(r["wrong"]) for r in recs)
    missed = sum(bool(r["missed"]) for r in recs)
    print(f"draws {len(recs)}: counted in a probe not of its mechanism {wrong}; a mechanism's probe not counting "
          f"{missed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
