#!/usr/bin/env python
"""``investigate`` on the embedded vLLM 0.32.0 MTP server (method mtp, 1 step, TP 1) serving the MiMo pair with its
trained head (``env/models/make_mimo_pair.py``), clean or with a generated fault of the head's checkpoint
(``tests/support/mimo_faults.py``: one ``input_proj`` half scaled), as ``tests/server/test_vllm_mtp_server.py`` starts
it.

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python bench/vllm_mtp_investigate.py [--fault token:0.25] [--prompts 8]

Prints the verdict, the stages' accept lengths with CIs, the losses' decisions and the findings, and the seconds of
the build, the server start and the investigation. The server is stopped before the script ends.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from helpers.engines import vllm_server
from support import ROOT, import_from
from support.mimo_faults import write_scaled_input_proj


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault", default=None, help="HALF:FACTOR, e.g. token:0.25 (default: clean)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    t0 = time.monotonic()
    pair = tmp / "mimo"
    import_from(ROOT / "env" / "models", "make_mimo_pair").build(pair)
    if a.fault:
        half, f = a.fault.split(":")
        pair = write_scaled_input_proj(pair, tmp / "mimo-fault", half=half, factor=float(f))
    build_s = time.monotonic() - t0
    t0 = time.monotonic()
    h = vllm_server.start(pair, None, tp=1, num_speculative_tokens=1, mtp=True, timeout=1200)
    start_s = time.monotonic() - t0
    try:
        from helpers.investigation.live import investigate
        t0 = time.monotonic()
        doc = investigate(h.url, training=None, run_dir=tmp / "run", measure_prompts=a.prompts,
                          max_new_tokens=a.max_new_tokens, timeout=900, apply_fix=False, engine_probes="none")
        inv_s = time.monotonic() - t0
    finally:
        h.stop()
    b = doc.acceptance or {}
    print(json.dumps({
        "fault": a.fault, "verdict": doc.verdict, "sentence": doc.sentence,
        "served_state": {k: (doc.diagnosis.get("served_state") or {}).get(k) for k in ("expected", "best", "matches")},
        "stages": [{k: s.get(k) for k in ("name", "accept_length", "ci", "log_accept_length")}
                   for s in b.get("stages", [])],
        "losses": {k: {"delta": v.get("delta"), "ci": v.get("ci"), "decision": v.get("decision")}
                   for k, v in (b.get("losses") or {}).items()},
        "findings": [f"{f.kind} (stage {f.evidence.get('stage')})" for f in doc.findings],
        "seconds": {"build": round(build_s, 1), "server_start": round(start_s, 1), "investigate": round(inv_s, 1)},
    }, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
