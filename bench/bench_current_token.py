"""The generated ``current_token`` fault (tests/support/mtp_faults.py, ``ENGINE_CLASSES``) on a live SGLang 0.5.23
server: the draft's extend rows fed the current token's id instead of the next one's (tests/support/engine_faults.py
``embed_current_token``), on a share of the rows drawn per seed (log-uniform 0.1 .. 1). One server with the draft
step trace and the fault armed by a file: each draw writes its strength and seed into the arm file, then runs
``check_draft`` (the step-trace probes ``served_draft`` + ``step_trace``) and, with ``--budget``, ``investigate`` with
the cheap engine probes (the acceptance budget's engine stage: the accept-length loss of the served draft against
the checkpoint run offline on the very states it fed). ``--clean N``: N runs with the arm file absent first.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_current_token.py --seeds 8 --clean 2 --budget
    PYTHONPATH=$PWD .venv/bin/python bench/bench_current_token.py --seeds 2 --steps 3
    PYTHONPATH=$PWD .venv/bin/python bench/bench_current_token.py --seeds 3 --pair eagle3   # the EAGLE-3 Llama pair

Per row: the draw, the kinds named, ``named`` (the finding ``draft_extend_ids_unshifted``) / ``-``, the replay's
counts (diverging step-1 rows explained by the current-token replay / diverging), and the engine stage's loss.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from support.mtp_faults import ENGINE_CLASSES, TARGET, VALIDATION, draw, engine_hook_specs  # noqa: E402

KIND = "draft_extend_ids_unshifted"


def start(tmp: Path, pair: str, steps: int) -> tuple[str, int]:
    """A server with the trace and the fault (armed by ``tmp/ARM``); returns (url, pid)."""
    hooks = engine_hook_specs(draw(0, ENGINE_CLASSES), arm=str(tmp / "ARM"))
    args = ["server", "start", "--tp", "1", "--steps", str(steps), "--detach", "--timeout", "900",
            "--trace-draft", str(tmp / "trace"), "--forward-hooks", json.dumps(hooks)]
    args += ["--target", str(TARGET), "--nextn"] if pair == "nextn" else ["--reference-draft"]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "helpers", *args], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(f"server start failed: {out.stderr[-2000:]}")
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    return url, int(re.search(r"\(pid (\d+)", out.stdout).group(1))


def one(url: str, run: Path, budget: bool, pair: str) -> dict:
    from helpers.investigation.check_draft import check_draft
    t0 = time.monotonic()
    d = check_draft(url, run_dir=run / "check", timeout=900, prompts=4, max_new_tokens=24)
    kinds = sorted({f["kind"] for f in d["findings"]})
    ct = {}
    for p in d["engine_state"]["probes"]:
        c = (p.get("evidence") or {}).get("current_token") or {}
        for k in ("diverging", "explained", "right_ids"):
            ct[k] = ct.get(k, 0) + int(c.get(k, 0))
    out = {"check": d["verdict"], "kinds": kinds, "replay": ct, "check_s": round(time.monotonic() - t0, 1)}
    if budget:
        from helpers.investigation.live import investigate
        t0 = time.monotonic()
        from helpers.paths import REFERENCE_TRAINING, REFERENCE_VALIDATION
        doc = investigate(url, training=None if pair == "nextn" else REFERENCE_TRAINING, run_dir=run / "investigate",
                          measure_prompts=8, max_new_tokens=24, timeout=1500, apply_fix=False, engine_probes="cheap",
                          validation=VALIDATION if pair == "nextn" else REFERENCE_VALIDATION)
        eng = ((doc.acceptance or {}).get("losses") or {}).get("engine") or {}
        out |= {"verdict": doc.verdict, "budget_kinds": sorted({getattr(f, "kind", None) or f["kind"] for f in doc.findings}),
                "engine_loss": {k: eng.get(k) for k in ("delta", "ci", "decision")},
                "investigate_s": round(time.monotonic() - t0, 1)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--clean", type=int, default=1, help="runs with the fault unarmed first")
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--pair", choices=("nextn", "eagle3"), default="nextn",
                    help="nextn: the Kimi-class target's NextN head; eagle3: `server start`'s default Llama pair")
    ap.add_argument("--budget", action="store_true", help="also run investigate (the engine stage's loss)")
    ap.add_argument("--url", default=None, help="a server already started with the fault's hooks and the trace")
    ap.add_argument("--arm", type=Path, default=None, help="its arm file (with --url)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    rows, t0 = [], time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        pid = None
        if a.url:
            url, arm = a.url, a.arm
        else:
            url, pid = start(tmp, a.pair, a.steps)
            arm = tmp / "ARM"
        try:
            cases = [("clean", None)] * a.clean + [(f"seed {s}", draw(s, ENGINE_CLASSES))
                                                    for s in range(a.first, a.first + a.seeds)]
            for i, (name, f) in enumerate(cases):
                if f is None:
                    arm.unlink(missing_ok=True)
                else:
                    arm.write_text(json.dumps({"strength": f.params["strength"], "seed": f.params["hook_seed"]}))
                r = one(url, tmp / f"run-{i}", a.budget, a.pair)
                named = KIND in r["kinds"] or KIND in r.get("budget_kinds", [])
                label = "clean" if f is None else f"{name}: strength {f.params['strength']:.3f}"
                el = r.get("engine_loss") or {}
                loss = "-" if el.get("delta") is None else \
                    f"{el['delta']:.3f} [{el['ci'][0]:.3f}, {el['ci'][1]:.3f}] {el['decision']}"
                print(f"| {a.pair} steps {a.steps} | {label} | {', '.join(r['kinds']) or '-'} | "
                      f"{'named' if named else '-'} | {r['replay'].get('explained', 0)}/"
                      f"{r['replay'].get('diverging', 0)} (right ids {r['replay'].get('right_ids', 0)}) | "
                      f"{r.get('verdict', '-')} {'+'.join(r.get('budget_kinds', [])) or ''} | {loss} | "
                      f"{r['check_s']} + {r.get('investigate_s', '-')} s |", flush=True)
                rows.append({"case": label, "fault": None if f is None else f.params, **r, "named": named})
        finally:
            if arm is not None:
                arm.unlink(missing_ok=True)
            if pid is not None:
                from helpers.server.process import stop_pid
                stop_pid(pid)
    faults = [r for r in rows if r["fault"] is not None]
    print(f"named {sum(r['named'] for r in faults)}/{len(faults)} faulty draws; clean runs naming it "
          f"{sum(r['named'] for r in rows if r['fault'] is None)}/{len(rows) - len(faults)}; "
          f"{time.monotonic() - t0:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
