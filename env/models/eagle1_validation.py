#!/usr/bin/env python
"""Write the EAGLE-1 draft's held-out validation rows (the ones ``train_eagle1.py`` measured ``val_final`` on) and
record them in its training log, so the investigation's draft stage compares the draft with its log on the log's own
rows (``helpers.draft.eagle1_stage``).

    python env/models/eagle1_validation.py      # -> env/models/llama_h64/draft_eagle1/validation

``train_eagle1.py`` samples ``--sequences + --val`` sequences in batches of ``--gen-batch`` with one seeded
generator and holds out the first ``--val``: with the defaults (480 + 32, batch 256, seed 0) they are the first 32 of
the first batch, re-made here by the trainer's own ``make_data`` on that batch alone (the generator draws the same
numbers: 149 s on 2 cores). Rows: EAGLE-1's own layout (``rows_0-32/data_{j}.ckpt``: ``input_ids [113]``,
``hidden_state [113, H]`` the target's post-final-norm state, float32: the one state an EAGLE-1 draft reads,
``loss_mask`` all ones: the trainer scores every row; ``helpers.formats.training_data`` reads it) and
``capture.json``. The log gets
``validation_rows`` (``path``, ``rows``, ``acc_per_step`` = ``[val_final.acc]``: the trainer's figure on these rows)
and ``val_final.acc_per_step`` (the same figure in the per-step form ``helpers.draft.training_log`` reads).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from e3f_models import LLAMA_H64_DIR, seed_everything, write_json  # noqa: E402
from e3f_models.target import load_target  # noqa: E402


def write_rows(out: Path, ids: torch.Tensor, feat: torch.Tensor, meta: dict) -> Path:
    """``ids [N, L]``, ``feat [N, L, H]`` -> ``out/rows_0-N/data_{j}.ckpt`` + ``out/capture.json``."""
    n = int(ids.shape[0])
    rows = out / f"rows_0-{n}"
    rows.mkdir(parents=True, exist_ok=True)
    for j in range(n):
        f = feat[j].float().contiguous()[None]
        torch.save({"input_ids": ids[j].clone(), "hidden_state": f[0].clone(), "loss_mask": torch.ones_like(ids[j])},
                   rows / f"data_{j}.ckpt")
    write_json(out / "capture.json", {"format": "eagle1 data_{i}.ckpt (rows_{g}-{g+N}/)",
                                      "hidden_state": "after the target's final RMSNorm",
                                      "dtype": "float32", "samples": n, "tokens": int(ids.numel()),
                                      "split": "validation", **meta})
    return out


def main(argv=None) -> int:
    from train_eagle1 import make_data  # lazy: the trainer module, imported only to re-make its data
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=LLAMA_H64_DIR / "target")
    ap.add_argument("--draft", type=Path, default=LLAMA_H64_DIR / "draft_eagle1")
    a = ap.parse_args(argv)
    log_path = a.draft / "training_log.json"
    log = json.loads(log_path.read_text())
    hy, data = log["hyper"], log["data"]
    val, length, seed = int(data["validation_sequences"]), int(data["length"]), int(hy["seed"])
    batch = 256                                        # train_eagle1.py --gen-batch default
    if val > batch:
        raise SystemExit(f"{log_path}: {val} validation sequences span more than the first batch of {batch}")
    t0 = time.time()
    seed_everything(seed, int(hy.get("threads") or 2))
    d = make_data(load_target(a.target), batch, length, batch, seed)
    out = write_rows(a.draft / "validation", d["ids"][:val], d["feat"][:val],
                     {"sequences": data["sampled"], "records": f"the first {val} sequences of train_eagle1.py's "
                      f"sampled set (its validation split), re-made by eagle1_validation.py (seed {seed})",
                      "seconds": round(time.time() - t0, 1)})
    acc = float(log["val_final"]["acc"])
    log["val_final"]["acc_per_step"] = [acc]
    log["validation_rows"] = {"path": "validation", "rows": val, "acc_per_step": [acc],
                              "source": "val_final.acc: train_eagle1.py's figure on these rows (float32 weights)"}
    write_json(log_path, log)
    print(f"[done] {out} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
