#!/usr/bin/env python
"""Ship a draft's validation rows: the first N records of its training log's validation split.

    python env/models/export_validation.py --data env/models/cache/draft_data \\
        --draft env/models/draft --target env/models/target --num 64 --out env/models/data/validation

Selects the validation split exactly as train_draft.py does (``split_indices``: seeded randperm,
the first ``max(1, int(records * val_frac))``, in that order), evaluates each ``--draft`` on the
whole split and on its first N records with train_draft.py's ``evaluate`` (TTT, batches of
``--batch-size`` in split order: the first N = 64 rows are exactly the log's first two validation
batches), and writes the first N records in SpecForge's offline format (``rows_0-2000/data_{j}.ckpt``,
j = 0..N-1 in split order, the data's ``vocab_mapping/``) with a ``capture.json``: the data's
provenance plus ``"split": "validation"``, which records of the data they are
(``source_records``), and the evaluations (``eval_<draft folder>``). The lead's teacher-forced
comparison of a checkpoint with its log reads these rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from e3f_models import pick_device, seed_everything, write_json  # noqa: E402
from e3f_models.draft_arch import load_draft  # noqa: E402
from e3f_models.specforge_data import (list_records, read_record,  # noqa: E402
                                       read_vocab_mapping, write_record, write_vocab_mapping)
from train_draft import VAL_SPLIT_RULE, evaluate, split_indices  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the draft's full training data")
    ap.add_argument("--draft", type=Path, action="append", required=True,
                    help="draft folder(s) trained on --data (evaluated on the split)")
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--val-frac", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--ttt-length", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    a = ap.parse_args(argv)
    t0 = time.time()
    seed_everything(a.seed, a.threads)
    device = pick_device(a.device)
    if a.out.exists() and any(a.out.iterdir()):
        ap.error(f"--out {a.out}: exists and is not empty (nothing is overwritten)")
    files = list_records(a.data)
    g = torch.Generator().manual_seed(a.seed)
    val_idx, _ = split_indices(len(files), a.val_frac, g)
    if a.num > len(val_idx):
        ap.error(f"--num {a.num}: the validation split has only {len(val_idx)} records")
    val = [read_record(files[i]) for i in val_idx]
    if [int(files[i].stem.split("_")[1]) for i in val_idx] != val_idx:
        raise SystemExit(f"{a.data}: record files are not data_0..data_{len(files) - 1}")
    batches = lambda n: [list(range(i, min(i + a.batch_size, n)))  # noqa: E731
                         for i in range(0, n, a.batch_size)]
    evals = {}
    for d in a.draft:
        draft, head = load_draft(d, a.target)
        draft.to(device)
        head = head.to(device)
        full = evaluate(draft, val, batches(len(val)), head, a.ttt_length, device)
        first = evaluate(draft, val[:a.num], batches(a.num), head, a.ttt_length, device)
        log = d / "training_log.json"
        logged = (json.loads(log.read_text()).get("val_final", {}).get("acc_per_step")
                  if log.exists() else None)
        evals[d.name] = {"draft": str(d), "val_split": full, f"first_{a.num}": first,
                         "training_log_val_final_acc_per_step": logged,
                         "max_abs_diff_vs_log": (max(abs(x - y) for x, y in
                                                     zip(full["acc_per_step"], logged))
                                                 if logged else None)}
        print(f"[eval] {d}: val split ({len(val)}) acc per step "
              f"{[round(x, 4) for x in full['acc_per_step']]}; log {logged}; first {a.num} "
              f"{[round(x, 4) for x in first['acc_per_step']]}", flush=True)

    a.out.mkdir(parents=True, exist_ok=True)
    for j, r in enumerate(val[:a.num]):
        write_record(a.out, j, r["input_ids"], r["loss_mask"], r["aux_hidden_state"],
                     r["hidden_state"], dtype=r["aux_hidden_state"].dtype)
    d2t, t2d = read_vocab_mapping(a.data)
    write_vocab_mapping(a.out, d2t, t2d)
    cap = json.loads((a.data / "capture.json").read_text())
    src = val_idx[:a.num]
    cap.update({
        "split": "validation",
        "records": (f"the first {a.num} records of the training log's validation split "
                    f"({len(val_idx)} of {len(files)} records: {VAL_SPLIT_RULE}, --val-frac "
                    f"{a.val_frac}, --seed {a.seed}), in split order; data_j is record "
                    f"source_records[j] of the training data"),
        "source_records": src,
        "samples": a.num,
        "tokens": int(sum(r["input_ids"].numel() for r in val[:a.num])),
        "loss_masked_tokens": int(sum(int(r["loss_mask"].sum()) for r in val[:a.num])),
        "validation_split_records": len(val_idx),
        "training_data_samples": len(files),
        **{f"eval_{k}": v for k, v in evals.items()},
    })
    write_json(a.out / "capture.json", cap)
    print(f"[done] {a.num} validation records -> {a.out}; wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
