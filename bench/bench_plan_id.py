"""Plan identification (helpers.draft.plan_id) on the shipped reference models, training data withheld: the HF
every-layer reference of the target's sampled continuations of held-out prompts, then ``identify_plan`` for each draft
with its own config ids and with every config-id fault the fault generator draws (``layer_offset``), timed.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_plan_id.py [--prompts 8] [--new-tokens 64] [--faults 40]

Prints one JSON line per run and a summary; the figures go in bench/RESULTS.md."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from helpers.draft.model import Eagle3Draft
from helpers.draft.plan_id import TargetHead, identify_plan, reference_from_hf

ROOT = Path(__file__).resolve().parents[1]
M = ROOT / "env" / "models"


def prompts(target: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [tok(p)["input_ids"] for p in json.loads((M / "prompts.json").read_text())["prompts"][:n]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--faults", type=int, default=40, help="fault-generator draws of class layer_offset")
    a = ap.parse_args()
    import sys
    sys.path.insert(0, str(ROOT))
    from tests.support import faultgen

    fault_ids = []
    for seed in range(1000):
        ids = faultgen.draw(seed, "layer_offset").params["ids"]
        if ids not in fault_ids:
            fault_ids.append(ids)
        if len(fault_ids) == a.faults:
            break
    print(json.dumps({"load": os.getloadavg(), "prompts": a.prompts, "new_tokens": a.new_tokens}), flush=True)
    systems = [("llama", M / "target", [("draft", [1, 3, 4], ("out(1)", "out(3)", "out(4)")),
                                        ("draft_alt", [4, 5, 6], ("out(4)", "out(5)", "out(6)"))]),
               ("kimi", M / "kimi" / "target", [("kimi/draft", [1, 3, 4], ("out(1)", "out(3)", "out(4)")),
                                                ("kimi/draft_mla", [1, 3, 4], ("out(1)", "out(3)", "out(4)"))])]
    summary = []
    for name, target, drafts in systems:
        t = time.perf_counter()
        ref = reference_from_hf(target, prompts(target, a.prompts), new_tokens=a.new_tokens, temperature=1.0)
        t_ref = time.perf_counter() - t
        head = TargetHead.load(target)
        for folder, ids, truth in drafts:
            d = Eagle3Draft.load(M / folder, target)
            runs = [ids] + ([x for x in fault_ids] if name == "llama" else [[2, 4, 5]])
            for cfg in runs:
                r = identify_plan(d, ref, head, config_ids=cfg)
                row = {"draft": folder, "config_ids": cfg, "decision": r.decision, "plan": r.plan,
                       "right": r.plan == truth, "wrong": r.plan is not None and r.plan != truth,
                       "margin": round(r.margin, 5), "margin_ci": [round(x, 5) for x in r.margin_ci],
                       "closest": list(r.closest.plan), "closest_ci": [round(x, 5) for x in r.closest_ci],
                       "candidates": len(r.scores), "rounds": r.rounds, "seconds": round(r.seconds, 2),
                       "reference_seconds": round(t_ref, 1)}
                print(json.dumps(row), flush=True)
                summary.append(row)
    for folder in sorted({r["draft"] for r in summary}):
        rs = [r for r in summary if r["draft"] == folder]
        print(f"{folder}: {sum(r['right'] for r in rs)}/{len(rs)} identified right, "
              f"{sum(r['wrong'] for r in rs)} wrong, {sum(r['decision'] == 'undecided' for r in rs)} undecided; "
              f"identify_plan {min(r['seconds'] for r in rs):.1f}-{max(r['seconds'] for r in rs):.1f} s; "
              f"reference {rs[0]['reference_seconds']} s")
    print(json.dumps({"load_end": os.getloadavg()}))


if __name__ == "__main__":
    main()
