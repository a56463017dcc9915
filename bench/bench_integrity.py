"""SGLang's own integrity switches on the embedded CPU server (the engine-state probes ``kv_canary`` and
``invariant_check``, :mod:`helpers.investigation.probes.integrity`): is the invariant check live on this build?

Two embedded SGLang servers (TP ``--tp``, the reference target and draft), each stopped by its handle:

1. ``probe``: the ``invariant_check`` probe end to end (its ``run``: a restarted copy with the adapter's
   ``integrity_launch`` environment, the live prompts cold and with their prefix cached, the copy's log scanned and
   decided); the launch carries the test-only fault hook of ``tests/support/integrity_faults.py`` *disarmed*, so
   this is a clean server: the goal is ``clear`` (the busy checker's own lines show it ran, nothing fired).
2. ``liveness``: one server with the same environment and the same fault hook: the prompts sent clean, the log so far
   scanned (goal: nothing fired), then the fault armed (its ``arm`` file created: one request's ``req_to_token``
   entry pointed at a free slot for one step) and one more prompt sent; the whole log scanned (goal: the
   ``KV page use-after-free`` line quoted, where it fired). ``kv_canary``'s ``applies`` is asked too (a CPU server:
   skipped, saying why). ``--switch kv_canary``: the same for the KV canary (its flags and environment, the fault
   ``kv_bytes_overwrite``), on this CPU build only with the stand-in's test-only ``E3F_TEST_CANARY_CPU=1``
   (``env/reference/standin/e3f_boot.py``, set in the server's launch environment here).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_integrity.py --prompts 4 --tokens 16
    PYTHONPATH=$PWD .venv/bin/python bench/bench_integrity.py --switch kv_canary --skip-probe

Prints one line per step and a JSON summary (``<out>/integrity.json``); record the figures in bench/RESULTS.md with
the date and the load (``os.getloadavg``). ``--excerpt FILE`` writes the liveness log's integrity lines (and a few
around them) as the unit tests' fixture.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.budget import Budget  # noqa: E402
from helpers.engines.sglang import SGLangAdapter  # noqa: E402
from helpers.investigation.probes import ProbeContext  # noqa: E402
from helpers.investigation.probes.cache import cold_arm, warm_arm  # noqa: E402
from helpers.investigation.probes.integrity import (INVARIANT_CHECK, KV_CANARY, decide, read_log,  # noqa: E402
                                                   scan_log)
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET  # noqa: E402
from helpers.runfiles import new_run_dir  # noqa: E402
from tests.support.integrity_faults import spec  # noqa: E402


#: switch -> the test-only fault of tests/support/integrity_faults.py it must catch, and the launch environment
#: (the KV canary on this CPU build only with the stand-in's test-only E3F_TEST_CANARY_CPU, env/reference/standin/
#: e3f_boot.py)
LIVENESS = {"invariant_check": ("req_to_token_use_after_free", {}),
            "kv_canary": ("kv_bytes_overwrite", {"E3F_TEST_CANARY_CPU": "1"})}


def _restart(tp: int, arm: Path, fault: str = "req_to_token_use_after_free", env: Optional[dict] = None) -> dict:
    return {"kind": "embedded", "launch": {"engine": "sglang", "target": str(REFERENCE_TARGET),
                                           "draft": str(REFERENCE_DRAFT), "tp": tp, "spec": None,
                                           "forward_hooks": [spec(str(arm), fault)], "extra_args": [],
                                           "dtype": "float32", "env": dict(env or {})}}


def probe_run(a, out: Path) -> dict:
    ad = SGLangAdapter()
    rd = new_run_dir("integrity-probe", out)
    arm = rd / "ARM_NEVER"                                  # never created: the fault stays off
    att = SimpleNamespace(restart=_restart(a.tp, arm), spec={}, target_dir=None)
    ctx = ProbeContext(client=SimpleNamespace(timeout=300), adapter=ad, att=att, run_dir=rd,
                       prompts=load_prompts(None, n=a.prompts), max_new_tokens=a.tokens, dl=Budget(900),
                       progress=lambda s: print("  " + s, flush=True))
    t = time.monotonic()
    res = INVARIANT_CHECK.run(ctx)
    ev = res.evidence
    return {"status": res.status, "decision": res.decision, "why": res.why, "live_lines": ev.get("live_lines"),
            "violation_lines": ev.get("violation_lines"), "cold_accept_length": ev.get("cold_accept_length"),
            "warm_accept_length": ev.get("warm_accept_length"), "prompts_with_hit": ev.get("prompts_with_hit"),
            "seconds": round(time.monotonic() - t, 1), "log": str(rd / ev["log"])}


def liveness_run(a, out: Path, switch: str = "invariant_check") -> dict:
    ad = SGLangAdapter()
    rd = new_run_dir(f"integrity-liveness-{switch}", out)
    arm = rd / "ARM"
    launch = ad.integrity_launch(switch)
    fault, extra = LIVENESS[switch]
    log = rd / "server.log"
    t = time.monotonic()
    dl = Budget(900)
    h = ad.start_variant(_restart(a.tp, arm, fault, extra), log_path=log, budget=dl, env=launch["env"],
                         flags=launch["flags"] or None, what="the liveness server")
    started = time.monotonic() - t
    try:
        c = ad.client(h.url, None, timeout=300, budget=dl)
        ctx = ProbeContext(client=c, adapter=ad, att=None, run_dir=rd, prompts=load_prompts(None, n=a.prompts),
                           max_new_tokens=a.tokens, dl=dl)
        skip_canary = KV_CANARY.applies(ctx)
        cold, _ = cold_arm(ctx)
        warm = warm_arm(ctx)
        time.sleep(1.0)
        clean_text = read_log(log)
        clean = scan_log(clean_text, switch)
        arm.write_text("armed\n")
        one = ProbeContext(client=c, adapter=ad, att=None, run_dir=rd, prompts=ctx.prompts[:2],
                           max_new_tokens=a.tokens, dl=dl)
        warm_arm(one)                   # the armed request, then more reads (and sweeps) of its slots
        time.sleep(1.0)
        c.close()
    finally:
        h.stop()
    text = read_log(log)
    fault = scan_log(text, switch)
    if a.excerpt:
        _excerpt(text, Path(a.excerpt), switch)
    return {"start_s": round(started, 1), "skip_kv_canary": skip_canary,
            "switch": switch, "fault_hook": fault,
            "clean": {"decision": decide(clean, switch)[0], "live_lines": clean["live_lines"],
                      "violation_lines": clean["violation_lines"], "log_lines": len(clean_text.splitlines())},
            "fault": {"decision": decide(fault, switch)[0], "violation_lines": fault["violation_lines"],
                      "violations": fault["violations"][:4], "live_lines": fault["live_lines"]},
            "cold_failed": int(cold["error"].notna().sum()), "warm_failed": int(warm["error"].notna().sum()),
            "seconds": round(time.monotonic() - t, 1), "log": str(log)}


def _excerpt(text: str, path: Path, switch: str) -> None:
    """The log's integrity lines with their context, in order (the unit tests' fixture: real SGLang 0.5.23 log
    text): the fault hook's registration, the switch's first per-step lines, its first violations (a canary violation
    with the 6 lines of its block) and the per-step lines that count them."""
    lines = text.split("\n")
    keep: set[int] = set()
    seen = {"live": 0, "viol": 0, "count": 0}
    for i, ln in enumerate(lines):
        if "Registered forward hook" in ln or "install_canary:" in ln:
            keep.add(i)
        elif any(k in ln for k in ("KV page use-after-free:", "KV double free:", "Leak Detected!", "invariant-check [",
                                   "memory leak detected!", "kv_canary violation:")):
            seen["viol"] += 1
            if seen["viol"] <= 3:
                keep.update(range(max(0, i - 1), min(len(lines), i + (7 if "kv_canary" in ln else 2))))
        elif "[Mem Check (BUSY)]" in ln or "[canary] step=" in ln:
            counted = re.search(r"violations=[1-9]", ln) is not None
            seen["count" if counted else "live"] += 1
            if (counted and seen["count"] <= 2) or (not counted and seen["live"] <= 4):
                keep.add(i)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines[i].replace("\r", "") for i in sorted(keep)) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--skip-probe", action="store_true", help="only the liveness server")
    ap.add_argument("--excerpt", default=None)
    ap.add_argument("--switch", default="invariant_check", choices=sorted(LIVENESS),
                    help="the switch whose liveness is shown (kv_canary: with the stand-in's test-only CPU canary)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-integrity"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tp": a.tp, "prompts": a.prompts,
                 "tokens": a.tokens, "load_before": os.getloadavg()}
    rec["liveness"] = liveness_run(a, out, a.switch)
    print("liveness:", json.dumps(rec["liveness"], default=str), flush=True)
    if not a.skip_probe:
        rec["probe"] = probe_run(a, out)
        print("probe:", json.dumps(rec["probe"], default=str), flush=True)
    rec["load_after"] = os.getloadavg()
    (out / "integrity.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
