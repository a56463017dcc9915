"""Generated MTP / NextN faults through the NextN budget offline (issue 37 part 4): each seed draws a fault
(``tests/support/mtp_faults.py``), the budget's stages run with no server (the head of the faulty target copy
teacher-forced on the committed validation rows against ``nextn_training_log.json``; the settings check; the
served-state identification on HF-recorded states), and the table says which stage named it.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_mtp_faults.py --seeds 20
    PYTHONPATH=$PWD .venv/bin/python bench/bench_mtp_faults.py --seeds 20 --kinds weights   # own_head, missing

``--kinds weights`` draws the weights classes (an own vs the shared head, NextN tensors missing; stage ``weights``:
``helpers.draft.mtp_weights``); the default draws the classes of the first table (seeds unchanged).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.mtp_faults import CLASSES, WEIGHT_CLASSES, draw, offline_named, served_world  # noqa: E402


def hit_of(stage: str, stages: tuple, named: list, lc) -> str:
    """How the bench scores a draw: ``yes`` (every stage that should name it does; a clean draw: nothing named),
    ``immaterial`` / ``borderline`` (the loss stage cleared it and the live prompts' cost CI rules a material loss
    out / does not quite), ``partly`` (some of its stages named it), ``NO``. The weights check's finding is scored
    apart from the loss: a cleared loss with the weights finding named is ``immaterial`` when the cost is."""
    if stage == "none":
        return "yes" if named == ["none"] else "NO"
    if all(st in named for st in stages):
        return "yes"
    loss_named = [x for x in named if x != "weights"] or ["none"]
    weights_ok = "weights" not in stages or "weights" in named
    if weights_ok and lc is not None and loss_named in (["none"], ["undecided"]):
        if lc["ci"][1] < lc["threshold"]:
            return "immaterial"     # the live prompts' CI rules a material cost out too
        if not lc["material"]:
            return "borderline"     # under the threshold on the live prompts, but their CI reaches it
    return "partly" if any(st in named for st in stages) else "NO"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=8, help="live prompts for the states and the live-prompt cost")
    ap.add_argument("--kinds", choices=("default", "weights", "own_head", "all"), default="default",
                    help="default: the classes of tests/support/mtp_faults.py CLASSES; weights: WEIGHT_CLASSES "
                         "(clean included); own_head: that class alone; all: both")
    a = ap.parse_args(argv)
    kinds = {"default": CLASSES, "weights": ("clean",) + WEIGHT_CLASSES, "own_head": ("own_head",),
             "all": CLASSES + WEIGHT_CLASSES}[a.kinds]
    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        world = served_world(Path(tmp) / "ref", n_prompts=a.prompts, new_tokens=32)
        for seed in range(a.first, a.first + a.seeds):
            f = draw(seed, kinds)
            r = offline_named(f, Path(tmp), world)
            lc = r["live_prompt_cost"]
            hit = hit_of(f.stage, f.stages, r["named"], lc)
            cost = "-" if lc is None else f"{lc['delta']:.3f} [{lc['ci'][0]:.3f}, {lc['ci'][1]:.3f}]"
            d = r["draft"]
            ci = d.get("ci") or [None, None]
            num = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
            line = (f"| {seed} | {f.label()} | {'+'.join(f.stages)} | {', '.join(r['named'])} | {hit} | "
                    f"{num(r['accept_length'])} | {num(d['delta'])} [{num(ci[0])}, {num(ci[1])}] {d['decision']} | "
                    f"{cost} | {', '.join(r['findings']) or '-'} | {r['seconds']} |")
            print(line, flush=True)
            rows.append({"seed": seed, "fault": f.label(), "true": f.stage, **r, "hit": hit})
    print("| seed | fault | true stage | named | hit | checkpoint accept length | draft loss (log - checkpoint) "
          "| live-prompt cost (clean - faulty, drafting chain) | state finding | s |")
    print(f"hits {sum(r['hit'] == 'yes' for r in rows)}/{len(rows)}, immaterial {sum(r['hit'] == 'immaterial' for r in rows)}, "
          f"borderline {sum(r['hit'] == 'borderline' for r in rows)}, partly {sum(r['hit'] == 'partly' for r in rows)}, "
          f"missed {sum(r['hit'] == 'NO' for r in rows)}; "
          f"{time.monotonic() - t0:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
