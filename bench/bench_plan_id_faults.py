"""Plan identification (helpers.draft.plan_id) over wiring faults drawn by the fault generator (tests/support/faultgen.py,
classes ``layer_offset`` and ``chunk_order``), training data withheld: for each draw the draft folder the faulted
server would load (:meth:`GenFault.draft_copy`: the config ids the fault gives it, the weights as trained) is loaded
and identified as ``investigate`` without ``--training`` does it (:func:`helpers.investigation.identify.identify_stage`:
the config's own ids, 16 continuations, twice as many when undecided), on the HF every-layer reference of the target's
sampled continuations of held-out prompts (``env/models/prompts.json``). Every draw serves another plan than the
trained one (checked); the identified plan must be the trained one or ``undecided``, never another.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_plan_id_faults.py [--seeds 24] [--systems llama,vllm]

Prints one JSON line per draw, then a markdown table and a summary; the figures go in bench/RESULTS.md. Exit 1 when a
plan is named wrongly."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.draft.model import Eagle3Draft  # noqa: E402
from helpers.draft.plan_id import TargetHead, identify_plan, reference_from_hf  # noqa: E402
from helpers.formats.configs import read_draft_config  # noqa: E402
from helpers.investigation.identify import IDENTIFY_PROMPTS, IDENTIFY_TOKENS  # noqa: E402
from tests.support import faultgen  # noqa: E402

M = ROOT / "env" / "models"


def prompts(target: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [tok(p)["input_ids"] for p in json.loads((M / "prompts.json").read_text())["prompts"][:n]]


def trained_plan(system: faultgen.System) -> tuple[str, ...]:
    """The truth, from the system's training data capture.json (SpecForge out(i) ids): read only to score."""
    ids = json.loads((system.training / "capture.json").read_text())["layer_ids"]["specforge_out_i"]
    return tuple(f"out({i})" for i in ids)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=24, help="draws per system (faultgen.draws seed 0 .. of the two "
                                                          "wiring classes the system takes)")
    ap.add_argument("--systems", default="llama,vllm", help="faultgen.SYSTEMS names, comma-separated")
    ap.add_argument("--prompts", type=int, default=IDENTIFY_PROMPTS)
    ap.add_argument("--new-tokens", type=int, default=IDENTIFY_TOKENS)
    a = ap.parse_args()
    print(json.dumps({"load": os.getloadavg(), "prompts": a.prompts, "new_tokens": a.new_tokens}), flush=True)
    rows, refs = [], {}
    for name in a.systems.split(","):
        sysm = faultgen.SYSTEMS[name]
        truth = trained_plan(sysm)
        t = time.perf_counter()
        if sysm.target not in refs:                                    # kimi and kimi-mla share the target
            refs[sysm.target] = reference_from_hf(sysm.target, prompts(sysm.target, 2 * a.prompts),
                                                  new_tokens=a.new_tokens, temperature=1.0, seed=0)
        ref = refs[sysm.target]
        t_ref = time.perf_counter() - t
        head = TargetHead.load(sysm.target)
        classes = [c for c in ("layer_offset", "chunk_order") if c in sysm.classes]
        for f in faultgen.draws(a.seeds, seed=0, classes=classes, system=sysm):
            served = tuple(f.served_plan())
            assert served != truth, (f.label, served)                   # a wiring fault: another plan is served
            with tempfile.TemporaryDirectory(prefix="e3f-pid-fault-") as tmp:
                folder = f.draft_copy(Path(tmp) / "draft")
                ids = read_draft_config(folder).nested_layer_ids
                draft = Eagle3Draft.load(folder, sysm.target)
                t = time.perf_counter()
                for k in (1, 2):                                        # identify_stage: 16, then 32 when undecided
                    r = identify_plan(draft, ref[: k * a.prompts], head, config_ids=ids)
                    if r.decision == "identified":
                        break
                sec = time.perf_counter() - t
            row = {"system": name, "seed": f.seed, "class": f.cls, "fault": f.label, "served": list(served),
                   "config_ids": list(ids or []), "decision": r.decision, "plan": None if r.plan is None else
                   list(r.plan), "sequences": r.sequences, "right": r.plan == truth,
                   "wrong": r.plan is not None and r.plan != truth, "margin_ci": [round(x, 4) for x in r.margin_ci],
                   "closest": list(r.closest.plan), "candidates": len(r.scores), "seconds": round(sec, 2),
                   "reference_seconds": round(t_ref, 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print("\n| system | seed | fault | served plan | config ids | result | margin CI (nats) | s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        res = ("right" if r["right"] else "WRONG " + str(r["plan"])) if r["plan"] else "undecided"
        print(f"| {r['system']} | {r['seed']} | {r['fault']} | {', '.join(r['served'])} | {r['config_ids']} | "
              f"{res} ({r['sequences']} seq) | [{r['margin_ci'][0]:+.4f}, {r['margin_ci'][1]:+.4f}] | "
              f"{r['seconds']} |")
    for name in a.systems.split(","):
        rs = [r for r in rows if r["system"] == name]
        print(f"{name}: {len(rs)} wiring faults drawn, {sum(r['right'] for r in rs)} identified right, "
              f"{sum(r['decision'] == 'undecided' for r in rs)} undecided, {sum(r['wrong'] for r in rs)} wrong; "
              f"identification {min(r['seconds'] for r in rs):.1f}-{max(r['seconds'] for r in rs):.1f} s; "
              f"reference {rs[0]['reference_seconds']} s")
    print(json.dumps({"load_end": os.getloadavg()}))
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
