"""Plan identification (helpers.draft.plan_id.identify_plan) with the candidate plans of a sequence run one draft-extend
pass each (``batch=False``) and stacked in one pass (``batch=True``, the default), side by side in one run, on the
reference drafts with their training data withheld: the HF every-layer reference of the target's sampled continuations
of held-out prompts (as many as ``investigate`` without ``--training`` takes: 16 x 96), the draft's config ids and a
layer-offset fault's. The two are timed alternately (``--repeats`` each, the median reported) and their figures
compared (every candidate's per-sequence loss and hits, each reported accept length: equal, or exit 1).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_plan_id_batch.py [--repeats 3] [--prompts 16] [--new-tokens 96]

Prints one JSON line per case and the ratio sequential / batched; the figures go in bench/RESULTS.md."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.draft.model import Eagle3Draft  # noqa: E402
from helpers.draft.plan_id import TargetHead, identify_plan, reference_from_hf  # noqa: E402
from helpers.investigation.identify import IDENTIFY_PROMPTS, IDENTIFY_TOKENS  # noqa: E402

M = ROOT / "env" / "models"


def prompts(target: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [tok(p)["input_ids"] for p in json.loads((M / "prompts.json").read_text())["prompts"][:n]]


def same(a, b) -> bool:
    """Every candidate's figures equal, bit for bit, and the same decision."""
    return (a.decision, a.plan, [s.plan for s in a.scores]) == (b.decision, b.plan, [s.plan for s in b.scores]) and all(
        np.array_equal(x.loss_sum, y.loss_sum) and np.array_equal(x.hits, y.hits)
        and x.accept_length == y.accept_length for x, y in zip(a.scores, b.scores))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=IDENTIFY_PROMPTS)
    ap.add_argument("--new-tokens", type=int, default=IDENTIFY_TOKENS)
    a = ap.parse_args()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"uptime": uptime, "prompts": a.prompts, "new_tokens": a.new_tokens, "repeats": a.repeats}),
          flush=True)
    cases = [("target", "draft", [1, 3, 4]), ("target", "draft", [2, 4, 5]),
             ("llama_h64/target", "llama_h64/draft", [2, 4, 5]), ("llama_h64/target", "llama_h64/draft", [1, 2, 3])]
    refs: dict = {}
    bad = 0
    totals = {False: 0.0, True: 0.0}
    for target, folder, ids in cases:
        if target not in refs:
            refs[target] = reference_from_hf(M / target, prompts(M / target, a.prompts), new_tokens=a.new_tokens,
                                             temperature=1.0, seed=0)
        ref, head, draft = refs[target], TargetHead.load(M / target), Eagle3Draft.load(M / folder, M / target)
        secs: dict = {False: [], True: []}
        res: dict = {}
        for _ in range(a.repeats):
            for batch in (False, True):
                t = time.perf_counter()
                res[batch] = identify_plan(draft, ref, head, config_ids=ids, batch=batch)
                secs[batch].append(time.perf_counter() - t)
        s, b = statistics.median(secs[False]), statistics.median(secs[True])
        totals[False] += s
        totals[True] += b
        ok = same(res[False], res[True])
        bad += not ok
        r = res[True]
        print(json.dumps({"draft": folder, "config_ids": ids, "candidates": len(r.scores), "sequences": r.sequences,
                          "rows_per_plan": r.rows, "decision": r.decision, "plan": r.plan,
                          "sequential_s": [round(x, 2) for x in secs[False]],
                          "batched_s": [round(x, 2) for x in secs[True]], "sequential_median_s": round(s, 2),
                          "batched_median_s": round(b, 2), "ratio": round(s / b, 2), "identical": ok}), flush=True)
    print(f"total of medians: sequential {totals[False]:.2f} s, batched {totals[True]:.2f} s, ratio "
          f"{totals[False] / totals[True]:.2f}; identical figures in {len(cases) - bad}/{len(cases)} cases")
    print(json.dumps({"uptime_end": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
                      "load_end": os.getloadavg()}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
