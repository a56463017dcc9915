"""The draft-state engine faults on a NextN / MTP head, through ``investigate`` (issue 37, part 3).

Each case is one embedded SGLang server serving the Kimi-class target's own NextN layer as the draft
(``python -m helpers server start --target env/models/kimi/target --nextn --tp 1 --steps S --trace-draft DIR
--detach``, stopped by its PID) with a fault drawn by ``tests/support/engine_faults.py::draws(..., draft="nextn")``
(the hooks on the head's modules, :data:`engine_faults.DRAFT_MODULES`): ``kv_wrong_slot`` (the head's decode KV,
MLA's latent ``kv_buffer``, written over the previous slot: wrong from draft step 2, so ``--steps`` >= 2) and
``draft_decay`` (the head's ``eh_proj`` scaled after N draft prefills), clean servers first; then ``investigate``
(:func:`helpers.investigation.live.investigate`, no training folder: the NextN budget against
``nextn_training_log.json``, the validation rows, the engine-state probes ``--engine-probes cheap`` by default).

Per case: what the engine-state probes name together (:func:`engine_faults.named`), the step_trace / served_draft
evidence (first diverging draft step per request), the engine loss of the budget (decision, tokens per verify step
with its CI) and the verdict. Goals: a strong fault named by its class's finding; a clean server ``ok`` (never ``ok``
when the engine loss is not ruled out).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_nextn_engine_state.py --draws 10 --clean 2 --seed 1 --steps 3

Writes ``<out>/nextn-engine-state.jsonl`` (one record per case) and prints the table; record it in bench/RESULTS.md
with the date and the load.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_engine_state import verdict  # noqa: E402
from helpers.investigation.live import investigate  # noqa: E402
from tests.support.engine_faults import EngineFault, draws, named  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
TARGET = ROOT / "env" / "models" / "kimi" / "target"
VALIDATION = ROOT / "env" / "models" / "kimi" / "data" / "validation"


def _trace_evidence(p: dict) -> str:
    ev = p.get("evidence") or {}
    fs = ev.get("first_steps") or {}
    steps = sorted(v for v in fs.values() if v is not None)
    return f"{len(steps)}/{len(fs)} req diverge, first steps {sorted(set(steps))}" if fs else "-"


def one(f: EngineFault, i: int, out: Path, steps: int, prompts: int, tokens: int, probes: str) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"e3f-nes-{i}-"))
    state, trace = tmp / "srv.json", tmp / "trace"
    trace.mkdir()
    cmd = [PY, "-m", "helpers", "server", "start", "--target", str(TARGET), "--nextn", "--tp", "1", "--steps",
           str(steps), "--detach", "--timeout", "600", "--state-file", str(state),
           "--log", str(out / f"server-{i}.log"), "--trace-draft", str(trace)]
    if f.hook_specs():
        cmd += ["--forward-hooks", json.dumps(f.hook_specs())]
    t0 = time.monotonic()
    rec = {**f.to_json(), "i": i, "steps": steps, "load_start": os.getloadavg()}
    try:
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=700)
    except subprocess.CalledProcessError as exc:
        why = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        return {**rec, "named": "failed", "verdict": verdict(f, "failed"), "why": f"server start: {why[0]}",
                "probes": {}, "wall_s": round(time.monotonic() - t0, 1)}
    info = json.loads(state.read_text())
    rec["start_s"] = round(time.monotonic() - t0, 1)
    try:
        doc = investigate(info["url"], training=None, run_dir=out / f"run-{i}", measure_prompts=prompts,
                          max_new_tokens=tokens, timeout=1500, apply_fix=False, engine_probes=probes,
                          validation=VALIDATION)
    finally:
        subprocess.run([PY, "-m", "helpers", "server", "stop", str(info["pid"])], cwd=ROOT, capture_output=True,
                       timeout=120)
    ps = doc.engine_state["probes"]
    eng = (doc.acceptance or {}).get("losses", {}).get("engine", {})
    pr = {p["probe"]: {"status": p["status"], "decision": p["decision"],
                       "delta": (p.get("loss") or {}).get("delta"), "ci": (p.get("loss") or {}).get("ci"),
                       "kinds": sorted({x["kind"] for x in p.get("findings") or []}), "why": p.get("why"),
                       "trace": _trace_evidence(p) if p["probe"] in ("step_trace", "served_draft") else None}
          for p in ps}
    name = named(ps)
    return {**rec, "named": name, "verdict": verdict(f, name), "probes": pr,
            "engine": {k: eng.get(k) for k in ("decision", "delta", "ci", "probe")},
            "doc_verdict": doc.verdict, "findings": [x.kind for x in doc.findings],
            "wall_s": round(time.monotonic() - t0, 1), "load_end": os.getloadavg()}


def line(r: dict) -> str:
    ps = " ".join(f"{k}:{v['decision'] or v['status']}" + ("" if v["delta"] is None else f":{v['delta']:.2f}")
                  + (f"({v['trace']})" if v.get("trace") else "")
                  for k, v in r["probes"].items() if k != "repeatable")
    e = r.get("engine") or {}
    return (f"{r['label']:36} -> {r['named']} [{r['verdict']}] engine {e.get('decision')} {e.get('delta')} "
            f"{e.get('ci')} verdict {r.get('doc_verdict')} | {ps} ({r['wall_s']} s)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=10)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clean", type=int, default=2, help="clean servers first")
    ap.add_argument("--classes", default="kv_wrong_slot,draft_decay")
    ap.add_argument("--skip", type=int, default=0, help="cases of the draw to leave out (already run)")
    ap.add_argument("--only", default=None, help="comma-separated case numbers to run")
    ap.add_argument("--steps", type=int, default=3, help="draft steps (kv_wrong_slot needs >= 2)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--engine-probes", default="cheap")
    ap.add_argument("--minutes", type=float, default=50.0)
    ap.add_argument("--list", action="store_true", help="print the draws and stop")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-nextn-engine-state"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + 60 * a.minutes
    cases = draws(a.draws, a.seed, clean=a.clean, classes=tuple(a.classes.split(",")), draft="nextn")
    only = {int(x) for x in a.only.split(",")} if a.only else None
    if a.list:
        for i, f in enumerate(cases):
            print(i, f.label, f.seed, json.dumps(f.hook_specs()))
        return 0
    recs = []
    for i, f in enumerate(cases):
        if i < a.skip or (only is not None and i not in only):
            continue
        if time.monotonic() > t_end:
            print(f"stopping: {a.minutes} min spent; {len(cases) - i} case(s) not run", flush=True)
            break
        print(f"[{time.strftime('%H:%M:%S')}] case {i}: {f.label} (seed {f.seed}), load {os.getloadavg()[0]:.1f}",
              flush=True)
        r = one(f, i, out, a.steps, a.prompts, a.tokens, a.engine_probes)
        recs.append(r)
        with open(out / "nextn-engine-state.jsonl", "a") as fh:
            fh.write(json.dumps(r, default=str) + "\n")
        print(line(r), flush=True)
    v = [r["verdict"] for r in recs]
    print(f"cases {len(recs)}: right {v.count('right')}, wrong {v.count('wrong')}, missed (strong) "
          f"{v.count('missed')}, weak open {v.count('weak-open')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
