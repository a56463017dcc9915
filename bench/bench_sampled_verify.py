"""The ``sampled_verify`` engine-state probe on one embedded SGLang server, clean and with the test-only fault of
``tests/support/verify_faults.py`` (at T > 0 a draft is accepted only when an independent sample of the target equals
it), armed by a file on the same server: per arm the probe's decision, the offline and live accept lengths, the gap
and its CI, the prompts whose verify steps equal the prediction exactly, and the probe's wall time; plus the greedy
accept length of the same prompts (T = 0, the budget's frame) beside it.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_sampled_verify.py --tp 2 --prompts 12 --temperature 1.0

``--strengths 0.05,0.2,1``: one armed arm per share of sampled rows (the arm file holds the number), the same server
(the strength sweep the generated ``sampled_verify`` class's strong / weak ranges come from).

Prints one line per arm and writes ``<out>/sampled-verify.json``; record the figures in bench/RESULTS.md with the
date and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.budget import Budget  # noqa: E402
from helpers.engines.detect import detect  # noqa: E402
from helpers.investigation.attach import attach  # noqa: E402
from helpers.investigation.probes import ProbeContext, _one, probes  # noqa: E402
from helpers.runfiles import new_run_dir  # noqa: E402
from tests.support.verify_faults import spec  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--strength", type=float, default=1.0)
    ap.add_argument("--strengths", default=None, help="comma-separated shares of sampled rows, one armed arm each "
                    "(default: one arm at --strength)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-sampled-verify"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arm = Path(tempfile.mkdtemp()) / "ARM_SAMPLED_VERIFY"
    state = arm.parent / "srv.json"
    cmd = [PY, "-m", "helpers", "server", "start", "--reference-draft", "--tp", str(a.tp), "--detach",
           "--state-file", str(state), "--log", str(out / "server.log"),
           "--forward-hooks", json.dumps([spec(str(arm), strength=a.strength, seed=a.seed)])]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    info = json.loads(state.read_text())
    rows = {}
    try:
        print(f"server up in {time.monotonic() - t0:.0f} s (TP {a.tp})", flush=True)
        ad = detect(info["url"], None, deadline_s=30).adapter
        dl = Budget(900)
        c = ad.client(info["url"], None, timeout=120, budget=dl)
        att = attach(c, caveats=ad.capture_caveats)
        prompts = load_prompts(None, n=a.prompts)
        rd = new_run_dir("sampled-verify", out)
        recs: list = []
        t = time.monotonic()
        ad.capture_served(c, prompts, rd / "dumps", name="greedy", max_new_tokens=a.max_new_tokens, records=recs)
        cold = pd.DataFrame(recs)
        print(f"greedy capture (the budget's live frame): {time.monotonic() - t:.1f} s", flush=True)
        probe = next(p for p in probes() if p.name == "sampled_verify")
        shares = [float(x) for x in a.strengths.split(",")] if a.strengths else [a.strength]
        for name in ["clean"] + [f"fault {x:g}" for x in shares]:
            if name != "clean":
                arm.write_text(name.split()[1] + "\n")     # the share of sampled rows, read by the fixture
            ctx = ProbeContext(client=c, adapter=ad, att=att, run_dir=rd, prompts=prompts,
                               max_new_tokens=a.max_new_tokens, dl=dl, cold=cold,
                               sampling={"temperature": a.temperature})
            r = _one(probe, ctx, "cheap").to_json()
            ev, loss = r["evidence"], r.get("loss") or {}
            rows[name] = {"status": r["status"], "decision": r["decision"], "delta": loss.get("delta"),
                          "ci": loss.get("ci"), "seconds": r["seconds"], "why": r.get("why"),
                          **{k: ev.get(k) for k in ("offline_accept_length", "live_accept_length",
                                                    "greedy_accept_length", "exact_prompts", "paired")},
                          "findings": [f["kind"] for f in r["findings"]]}
            x = rows[name]
            print(f"{name}: {x['status']} {x['decision']} offline {x['offline_accept_length']} live "
                  f"{x['live_accept_length']} greedy {x['greedy_accept_length']} gap {x['delta']} ci {x['ci']} "
                  f"exact {x['exact_prompts']}/{x['paired']} {x['seconds']} s {x['findings']}", flush=True)
        c.close()
    finally:
        if arm.exists():
            arm.unlink()
        subprocess.run([PY, "-m", "helpers", "server", "stop", str(info["pid"])], cwd=ROOT, capture_output=True)
    doc = {"tp": a.tp, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens, "temperature": a.temperature,
           "strength": a.strength, "strengths": a.strengths, "arms": rows, "load": os.getloadavg(),
           "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "sampled-verify.json").write_text(json.dumps(doc, indent=1, default=str))
    print(json.dumps({"load": doc["load"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
