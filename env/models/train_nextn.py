#!/usr/bin/env python
"""Train the Kimi-class target's NextN / MTP head (DeepSeek-V3's extra layer) on SpecForge-format data.

    python env/models/train_nextn.py --target env/models/kimi/target --data env/models/cache/kimi_data

The head (``e3f_models/nextn.py``, SGLang's ``deepseek_nextn.py::DeepseekModelNextN``) reads the token t+1
and the target's post-norm last hidden state at t (the data's ``hidden_state``: what SGLang hands the head)
and is trained, as the EAGLE-3 drafts are, on the target's own distribution for token t+2 (soft
cross-entropy over the full vocabulary, rows with loss mask 1) for one step (DeepSeek-V3 trains its MTP
module for depth 1). The validation split is train_draft.py's (``split_indices``, seed 0, 3 %), so the
committed validation rows of the Kimi drafts (``kimi/data/validation``, the first 48 of that split) are the
head's too. Evaluation runs a 3-step chain (the head fed its own output, as SGLang's draft decode does with
``--speculative-num-steps 3``) and reports accuracy per step.

Writes the head into ``--target``'s model.safetensors as ``model.layers.{num_hidden_layers}.*`` (every
existing tensor unchanged; bf16, the gate's correction bias fp32) and ``nextn_training_log.json`` beside it.
The MoE gate's ``e_score_correction_bias`` is trained as the target's was (``ExpertBalancer``). Deterministic:
seeded init (decoder copied from the target's last layer, ``eh_proj`` Normal(0, 0.02)) and batch order.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from e3f_models import CACHE_DIR, KIMI_DIR, pick_device, seed_everything, write_json  # noqa: E402
from e3f_models.nextn import NextNHead, load_nextn, nextn_loss, nextn_state_dict  # noqa: E402
from e3f_models.specforge_data import list_records, read_record  # noqa: E402
from e3f_models.target import ExpertBalancer, load_target  # noqa: E402
from train_draft import VAL_SPLIT_RULE, collate, load_dataset, make_batches, split_indices  # noqa: E402

LOG_NAME = "nextn_training_log.json"


@torch.no_grad()
def evaluate(head, recs, idx_batches, target_head, steps, device) -> dict:
    """Mean per-batch accuracy / loss per chain step (``nextn_loss``) and the proxy accept length
    ``1 + a0 + a0 a1 + ...`` over the ``steps`` steps."""
    head.eval()
    accs, losses, n = None, None, 0
    for b in idx_batches:
        _, m = nextn_loss(head, collate(recs, b, device), target_head, steps=steps, train_steps=0)
        accs = m["acc"] if accs is None else [x + y for x, y in zip(accs, m["acc"])]
        losses = m["loss"] if losses is None else [x + y for x, y in zip(losses, m["loss"])]
        n += 1
    head.train()
    acc = [x / n for x in accs]
    exp_len, run = 1.0, 1.0
    for x in acc:
        run *= x
        exp_len += run
    return {"acc_per_step": acc, "loss_per_step": [x / n for x in losses],
            f"proxy_accept_length_{steps}_steps": exp_len,
            "proxy_accept_length_1_step": 1.0 + acc[0]}


def write_into_target(target_dir: Path, sd: dict) -> None:
    """Add ``sd`` (``model.layers.{N}.*``) to ``target_dir/model.safetensors``, replacing an earlier head;
    every other tensor is rewritten unchanged."""
    from safetensors.torch import load_file, save_file
    path = target_dir / "model.safetensors"
    w = load_file(str(path))
    prefix = next(iter(sd)).split(".")[:3]
    prefix = ".".join(prefix) + "."
    w = {k: v for k, v in w.items() if not k.startswith(prefix)}
    w.update(sd)
    save_file(w, str(path), metadata={"format": "pt"})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, default=CACHE_DIR / "kimi_data")
    ap.add_argument("--target", type=Path, default=KIMI_DIR / "target")
    ap.add_argument("--validation-rows", type=Path, default=KIMI_DIR / "data" / "validation",
                    help="committed validation rows (the first N of the split): evaluated and logged")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--train-steps", type=int, default=1, help="chain steps trained (DeepSeek-V3: 1)")
    ap.add_argument("--eval-steps", type=int, default=3, help="chain steps evaluated")
    ap.add_argument("--val-frac", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-steps", type=int, default=None, help="stop early (smoke runs)")
    a = ap.parse_args(argv)
    t0 = time.time()
    seed_everything(a.seed, a.threads)
    device = pick_device(a.device)
    from safetensors.torch import load_file
    tcfg = json.loads((a.target / "config.json").read_text())
    if tcfg.get("model_type") != "deepseek_v3" or int(tcfg.get("num_nextn_predict_layers", 0)) != 1:
        ap.error(f"--target {a.target}/config.json: expected model_type deepseek_v3 with "
                 f"num_nextn_predict_layers 1 (SGLang's NextN loader asserts 1)")
    manifest = json.loads((a.data / "capture.json").read_text())
    tw = load_file(str(a.target / "model.safetensors"))
    embed, lm_head = tw["model.embed_tokens.weight"].float(), tw["lm_head.weight"].float()
    target_head = lm_head.to(device)

    recs = load_dataset(a.data)
    g = torch.Generator().manual_seed(a.seed)
    val_idx, train_idx = split_indices(len(recs), a.val_frac, g)
    val = [recs[i] for i in val_idx]
    train = [recs[i] for i in train_idx]
    val_batches = [list(range(i, min(i + a.batch_size, len(val))))
                   for i in range(0, len(val), a.batch_size)]
    steps_per_epoch = math.ceil(len(train) / a.batch_size)
    total = steps_per_epoch * a.epochs if a.max_steps is None else a.max_steps
    print(f"[data] {len(train)} train / {len(val)} val samples; {total} steps "
          f"({a.epochs} epochs x {steps_per_epoch})")

    torch.manual_seed(a.seed)
    head = NextNHead(tcfg, embed, lm_head)
    target = load_target(a.target)
    head.init_from_target(target.model.layers[-1], a.seed)
    del target
    head.to(device)
    balancer = ExpertBalancer(SimpleNamespace(model=SimpleNamespace(layers=[head.decoder])))
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    print(f"[head] {NextNHead.architecture}: layer model.layers.{head.layer_id}, "
          f"{n_params / 1e6:.2f} M trainable params on {device}")
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        t = (s - a.warmup) / max(1, total - a.warmup)
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * t))

    from tqdm import tqdm
    log, step = [], 0
    before = evaluate(head, val, val_batches, target_head, a.eval_steps, device)
    print(f"[eval] before training: acc per step {[round(x, 3) for x in before['acc_per_step']]}")
    bar = tqdm(total=total, desc="nextn train", mininterval=5)
    for ep in range(a.epochs):
        for b in make_batches(train, a.batch_size, g):
            if step >= total:
                break
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
            loss, m = nextn_loss(head, collate(train, b, device), target_head, steps=a.train_steps,
                                 train_steps=a.train_steps)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            balancer.after_step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{m['acc'][0]:.2f}")
            log.append({"step": step, "loss": float(loss), "acc": m["acc"], "grad_norm": float(gn),
                        "lr": lr_at(step - 1)})
        ev = evaluate(head, val, val_batches, target_head, a.eval_steps, device)
        log[-1]["val"] = ev
        print(f"[eval] epoch {ep + 1}: val acc per step {[round(x, 3) for x in ev['acc_per_step']]}",
              flush=True)
    bar.close()
    balancer.remove()
    train_s = time.time() - t0

    sd = nextn_state_dict(head.cpu(), torch.bfloat16)
    write_into_target(a.target, sd)
    saved = load_nextn(a.target).to(device)  # the bf16 checkpoint, upcast to fp32
    ckpt = evaluate(saved, val, val_batches, target_head, a.eval_steps, device)
    rows = {}
    if a.validation_rows is not None and (a.validation_rows / "capture.json").exists():
        vr = [read_record(p) for p in list_records(a.validation_rows)]
        vcap = json.loads((a.validation_rows / "capture.json").read_text())
        same = [i < len(recs) and torch.equal(r["input_ids"], recs[i]["input_ids"])
                for r, i in zip(vr, vcap["source_records"])]
        vb = [list(range(i, min(i + a.batch_size, len(vr)))) for i in range(0, len(vr), a.batch_size)]
        train_ids = {tuple(recs[i]["input_ids"].tolist()) for i in train_idx}
        train_prompts = {tuple(recs[i]["input_ids"][recs[i]["loss_mask"] == 0].tolist()) for i in train_idx}
        rows = {"path": str(a.validation_rows), "rows": len(vr),
                "input_ids_equal_to_this_data": all(same),
                "rows_in_this_training_set": sum(tuple(r["input_ids"].tolist()) in train_ids for r in vr),
                "row_prompts_in_this_training_set": sum(
                    tuple(r["input_ids"][r["loss_mask"] == 0].tolist()) in train_prompts for r in vr),
                **evaluate(saved, vr, vb, target_head, a.eval_steps, device)}
    print(f"[eval] saved bf16 head: val acc per step {[round(x, 4) for x in ckpt['acc_per_step']]}; "
          f"committed rows {[round(x, 4) for x in rows.get('acc_per_step', [])]}", flush=True)
    write_json(a.target / LOG_NAME, {
        "trainer": "env/models/train_nextn.py (NextN head = sglang/srt/models/deepseek_nextn.py::"
                   "DeepseekModelNextN; e3f_models/nextn.py)",
        "metric": "accuracy of the head's argmax against the target's argmax for token t+2 (step 0: token "
                  "t+1 and the target's post-norm state at t); steps >= 1: the head fed its own output "
                  "(chain), token t+k+2",
        "data": {"path": str(a.data), "manifest": {k: manifest[k] for k in
                                                   ("backend", "samples", "tokens", "loss_masked_tokens",
                                                    "sequences", "new_tokens", "generated_by",
                                                    "hidden_state", "corpus") if k in manifest},
                 "validation_split": {"records": len(val), "rule": VAL_SPLIT_RULE}},
        "corpus_sha256": (json.loads(__import__("gzip").decompress((CACHE_DIR / "corpus.json.gz").read_bytes()))
                          .get("sha256") if (CACHE_DIR / "corpus.json.gz").exists() else None),
        "architecture": NextNHead.architecture,
        "checkpoint": f"{a.target.name}/model.safetensors model.layers.{head.layer_id}.* "
                      f"({len(sd)} tensors)",
        "hyper": {k: getattr(a, k) for k in ("epochs", "batch_size", "lr", "min_lr", "warmup",
                                             "train_steps", "eval_steps", "val_frac", "seed", "threads")},
        "trainable_params": n_params, "steps": step,
        "val_before": before, "val_final": log[-1]["val"],
        "val_final_checkpoint": {**ckpt, "note": "the saved bf16 layer (upcast to fp32) on the same split"},
        "validation_rows": rows,
        "expert_balance": balancer.stats(),
        "train_loss_last20": sum(r["loss"] for r in log[-20:]) / min(20, len(log)),
        "train_acc_last20": sum(r["acc"][0] for r in log[-20:]) / min(20, len(log)),
        "train_wall_s": round(train_s, 1),
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda"
                                 else f" ({torch.get_num_threads()} threads)"),
        "torch": torch.__version__,
    })
    write_json(CACHE_DIR / "nextn_train_records.json", log)
    print(f"[done] head -> {a.target}/model.safetensors model.layers.{head.layer_id}.*; wall "
          f"{time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
