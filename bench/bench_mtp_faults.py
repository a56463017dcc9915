"""Generated MTP / NextN faults through the NextN budget offline (issue 37 part 4): each seed draws a fault
(``tests/support/mtp_faults.py``), the budget's stages run with no server (the head of the faulty target copy
teacher-forced on the committed validation rows against ``nextn_training_log.json``; the settings check; the
served-state identification on HF-recorded states), and the table says which stage named it.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_mtp_faults.py --seeds 20
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

from support.mtp_faults import draw, offline_named, served_world  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=8, help="live prompts for the states and the live-prompt cost")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        world = served_world(Path(tmp) / "ref", n_prompts=a.prompts, new_tokens=32)
        for seed in range(a.first, a.first + a.seeds):
            f = draw(seed)
            r = offline_named(f, Path(tmp), world)
            lc = r["live_prompt_cost"]
            if f.stage == "none":
                hit = "yes" if r["named"] == ["none"] else "NO"
            elif f.stage in r["named"]:
                hit = "yes"
            elif lc is not None and lc["ci"][1] < lc["threshold"] and r["named"] in (["none"], ["undecided"]):
                hit = "immaterial"          # the live prompts' CI rules a material cost out too
            elif lc is not None and not lc["material"] and r["named"] in (["none"], ["undecided"]):
                hit = "borderline"          # under the threshold on the live prompts, but their CI reaches it
            else:
                hit = "NO"
            cost = "-" if lc is None else f"{lc['delta']:.3f} [{lc['ci'][0]:.3f}, {lc['ci'][1]:.3f}]"
            d = r["draft"]
            ci = d.get("ci") or [None, None]
            line = (f"| {seed} | {f.label()} | {f.stage} | {', '.join(r['named'])} | {hit} | "
                    f"{r['accept_length']:.3f} | {d['delta']:.3f} [{ci[0]:.3f}, {ci[1]:.3f}] {d['decision']} | "
                    f"{cost} | {', '.join(r['findings']) or '-'} | {r['seconds']} |")
            print(line, flush=True)
            rows.append({"seed": seed, "fault": f.label(), "true": f.stage, **r, "hit": hit})
    print("| seed | fault | true stage | named | hit | checkpoint accept length | draft loss (log - checkpoint) "
          "| live-prompt cost (clean - faulty, drafting chain) | state finding | s |")
    print(f"hits {sum(r['hit'] == 'yes' for r in rows)}/{len(rows)}, immaterial {sum(r['hit'] == 'immaterial' for r in rows)}, "
          f"borderline {sum(r['hit'] == 'borderline' for r in rows)}, missed {sum(r['hit'] == 'NO' for r in rows)}; "
          f"{time.monotonic() - t0:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
