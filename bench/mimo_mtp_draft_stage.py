#!/usr/bin/env python
"""The draft stage of the vLLM MTP pair's trained MiMo head, offline: the committed head against its training log on
the log's own validation rows, clean and with its ``input_proj`` halves scaled (``tests/support/mimo_faults.py``).

    PYTHONPATH=$PWD:$PWD/tests .venv/bin/python bench/mimo_mtp_draft_stage.py [--pair DIR]

Builds the pair with ``env/models/make_mimo_pair.py`` (when ``--pair`` has no config.json), then runs
``helpers.draft.nextn_stage.nextn_draft_stage`` (what ``investigate`` runs for the head at 1 step) on the clean pair
and on one copy per fault; prints one JSON line per case: accept length (checkpoint, teacher-forced; log), the draft
loss, its CI, threshold and decision, seconds.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from helpers.draft.loader import load_draft
from helpers.draft.nextn_stage import nextn_draft_stage
from support import ROOT, import_from
from support.mimo_faults import write_scaled_input_proj

FAULTS = (("hidden", 0.25), ("hidden", 0.1), ("hidden", 4.0), ("token", 0.25), ("token", 4.0))


def case(name: str, folder: Path) -> dict:
    t0 = time.monotonic()
    ds = nextn_draft_stage(load_draft(folder, folder), folder, 1)
    st, loss = ds["stage"], ds["loss"]
    return {"case": name, "checkpoint": round(st["accept_length"], 4), "log": round(st["log_accept_length"], 4),
            "loss": round(loss["delta"], 4), "ci": [round(x, 4) for x in loss["ci"]],
            "threshold": round(loss["threshold"], 4), "decision": loss["decision"], "same_rows": ds["same_rows"],
            "seconds": round(time.monotonic() - t0, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", type=Path, default=None)
    a = ap.parse_args()
    pair = a.pair or Path(tempfile.mkdtemp()) / "mimo"
    if not (pair / "config.json").is_file():
        t0 = time.monotonic()
        import_from(ROOT / "env" / "models", "make_mimo_pair").build(pair)
        print(json.dumps({"built": str(pair), "seconds": round(time.monotonic() - t0, 1)}))
    print(json.dumps(case("clean", pair)), flush=True)
    for half, f in FAULTS:
        bad = write_scaled_input_proj(pair, pair.parent / f"{pair.name}-{half}-x{f}", half=half, factor=f)
        print(json.dumps(case(f"input_proj {half} half x{f}", bad)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
