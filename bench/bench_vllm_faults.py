"""vLLM-specific generated faults (issue 38, part 4; ``tests/support/vllm_faultgen.py``: a speculators-format
conversion that drops ``norm_before_fc`` or the rope scaling the draft was trained with, a draft's own
``embed_tokens`` unlike the target's, the layer ids lost from the config) checked OFFLINE, no server:

* ``diagnose --engine vllm --draft-config SERVED --target-config T --training D --json`` (config-only: the served
  plan by vLLM 0.32.0's id rules against the training plan) and the draft checks with vLLM's loader rules
  (``inspect_draft(..., loader=VLLMAdapter().loader_rules("0.32.0"))``: the checkpoint's tensors);
* the draft stage: the served (converted) checkpoint loaded with vLLM's loader rules
  (``VLLMAdapter.loader_rules``), teacher-forced on the validation rows against the training log, as
  ``investigate`` measures it; the draft as trained beside it (its own config: the fault's absence).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_vllm_faults.py --n 20 --seed 0

Writes ``<out>/vllm-faults.jsonl`` (one record per draw) and prints the hit table (fault, strength -> finding /
stage); record it in bench/RESULTS.md with the date and the load.
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
sys.path.insert(0, str(ROOT / "tests"))

from support.vllm_faultgen import DRAFT, TARGET, VALIDATION, draws  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")
WIRING = {"wrong_layer", "layer_offset", "embedding_in_place_of_layer", "unidentified_chunk"}


def draft_stage_of(folder: Path, training: Path, log, rules) -> dict:
    """The checkpoint stage of ``folder`` (vLLM's loader rules) against ``log``: accept length, loss, CI, decision."""
    from helpers.draft.draft_stage import draft_rows, draft_stage
    from helpers.draft.model import Eagle3Draft

    d = Eagle3Draft.load(folder, TARGET, loader=rules)
    dr = draft_rows(d, draft_dir=folder, target_dir=TARGET, training=training, hidden_size=128, log=log,
                    log_path=DRAFT / "training_log.json", validation=VALIDATION)
    st, loss = draft_stage(dr["rows"], dr["kind"], dr["path"], log, 3, labels=dr["labels"])
    return {"accept_length": st["accept_length"], "loss": loss["delta"], "ci": loss["ci"],
            "decision": loss["decision"]}


def diagnose(served: Path, training: Path, rules) -> dict:
    """Config-only ``diagnose --engine vllm`` (its findings, the fallback note) and the draft checks with vLLM's
    loader rules (:func:`helpers.draft.checks.inspect_draft`, the checkpoint's tensors against the target's)."""
    from helpers.draft.checks import inspect_draft

    out = subprocess.run([PY, "-m", "helpers", "diagnose", "--engine", "vllm", "--draft-config", str(served),
                          "--target-config", str(TARGET), "--training", str(training), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    if out.returncode not in (0, 1):
        raise RuntimeError(out.stderr[-2000:])
    doc = json.loads(out.stdout)
    checks = inspect_draft(served, TARGET, training, loader=rules)["findings"]
    return {"config": sorted({f["kind"] for f in doc["findings"]}), "checks": sorted({f["kind"] for f in checks}),
            "fallback": any("falls back" in n for n in (doc.get("served_plan") or {}).get("notes", []))}


def named(r: dict) -> tuple[str, str]:
    """``(finding, stage)`` the offline tools name for record ``r``."""
    kinds = r["diagnose"]["config"] + r["diagnose"]["checks"]
    wiring = sorted(WIRING & set(kinds))
    stage = "wiring" if wiring else ("draft" if (set(kinds) - WIRING or r["served"]["decision"] == "counts")
                                      else "none")
    what = ", ".join(kinds) or "-"
    if r["served"]["decision"] == "counts":
        what += f"; checkpoint stage loses {r['served']['loss']:+.2f} [{r['served']['ci'][0]:+.2f}, " \
                f"{r['served']['ci'][1]:+.2f}]"
    elif r["stage"] == "draft":
        what += f"; checkpoint stage {r['served']['decision']} ({r['served']['loss']:+.2f})"
    return what, stage


def outcome(r: dict) -> str:
    """``hit`` (named at the true stage), ``undecided`` (the checkpoint stage could not decide: no false clear),
    ``mild`` (the checkpoint stage is clear and the fault's own cost, as trained minus served, is under 0.1 tokens per
    verify step), ``MISS`` otherwise."""
    if r["named_stage"] == r["stage"]:
        return "hit"
    if r["stage"] == "draft" and r["served"]["decision"] == "undecided":
        return "undecided"
    if r["stage"] == "draft" and r["served"]["decision"] == "clear" and r["trained"] and \
            r["trained"]["accept_length"] - r["served"]["accept_length"] < 0.1:
        return "mild"
    return "MISS"


def table(rows: list[dict]) -> str:
    """The hit table (markdown): class, strength, the fault's own cost offline (the draft as trained minus the served
    conversion, teacher-forced on the same rows), what is named and at which stage."""
    lines = ["| class | strength | own cost (as trained - served) | named offline | stage named / true | outcome |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cost = (f"{r['trained']['accept_length'] - r['served']['accept_length']:+.2f}" if r["trained"] else "-")
        lines.append(f"| {r['class']} | {r['label']} | {cost} | {r['named']} | {r['named_stage']} / {r['stage']} | "
                     f"{outcome(r)} |")
    n = {k: sum(outcome(r) == k for r in rows) for k in ("hit", "undecided", "mild", "MISS")}
    lines.append(f"\n{n['hit']} of {len(rows)} named at their true stage, {n['undecided']} undecided, {n['mild']} "
                 f"mild (clear, own cost < 0.1), {n['MISS']} missed")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--table", type=Path, default=None, help="print the hit table of a vllm-faults.jsonl and stop")
    a = ap.parse_args()
    if a.table:
        print(table([json.loads(x) for x in a.table.read_text().splitlines() if x.strip()]))
        return 0
    from helpers.draft.training_log import read_training_log
    from helpers.engines.vllm import VLLMAdapter

    out = a.out or Path(tempfile.mkdtemp(prefix="e3f-vllm-faults-"))
    out.mkdir(parents=True, exist_ok=True)
    log = read_training_log(DRAFT / "training_log.json")
    rules = VLLMAdapter().loader_rules("0.32.0")
    t0, rows = time.time(), []
    print(f"load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for i, f in enumerate(draws(a.n, a.seed)):
        t = time.time()
        b = f.build(out / f"{i:02d}-{f.cls}")
        r = {**f.to_json(), "diagnose": diagnose(b.served, b.training, rules),
             "served": draft_stage_of(b.served, b.training, log, rules),
             "trained": draft_stage_of(b.trained, b.training, log, rules) if f.stage == "draft" else None}
        r["named"], r["named_stage"] = named(r)
        r["hit"] = r["named_stage"] == r["stage"]
        r["seconds"] = round(time.time() - t, 1)
        rows.append(r)
        with open(out / "vllm-faults.jsonl", "a") as fh:
            fh.write(json.dumps(r) + "\n")
        tr = f" (as trained {r['trained']['accept_length']:.2f})" if r["trained"] else ""
        print(f"{f.seed:>10} {f.label:72} -> {r['named']} / {r['named_stage']} [{'hit' if r['hit'] else 'MISS'}] "
              f"served {r['served']['accept_length']:.2f}{tr} ({r['seconds']} s)", flush=True)
    print(table(rows))
    print(f"{time.time() - t0:.0f} s; load {' / '.join(f'{x:.1f}' for x in os.getloadavg())}; {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
