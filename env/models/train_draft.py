#!/usr/bin/env python
"""Train an EAGLE-3 draft on SpecForge-format data (make_draft_data.py) with unrolled TTT.

    python env/models/train_draft.py --data env/models/cache/draft_data      # -> env/models/draft
    python env/models/train_draft.py --arch mla --target env/models/kimi/target \
        --data env/models/cache/kimi_data --out env/models/kimi/draft_mla   # MLA draft (Kimi)

Writes ``--out``: config.json (``--arch llama``: ``LlamaForCausalLMEagle3``; ``--arch mla``:
``Eagle3DeepseekV2ForCausalLM``; ``eagle_config`` with the SpecForge layer ids of the data's
manifest), model.safetensors (bf16 weights + int64 d2t + bool t2d, the names SGLang's
``load_weights`` reads, no embeddings) and training_log.json. Deterministic: seeded init and
batch order.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from e3f_models import (CACHE_DIR, DRAFT_DIR, TARGET_DIR, pick_device,  # noqa: E402
                        seed_everything, write_json)
from e3f_models.draft import ttt_loss  # noqa: E402
from e3f_models.draft_arch import DRAFT_ARCHS, load_draft  # noqa: E402
from e3f_models.specforge_data import list_records, read_record, read_vocab_mapping  # noqa: E402


def split_indices(n: int, val_frac: float, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """``(val, train)`` record indices: ``torch.randperm(n, generator=gen)``, the first
    ``max(1, int(n * val_frac))`` for validation (in that order), the rest for training. ``gen``
    goes on to order the training batches, as in every run of this script."""
    perm = torch.randperm(n, generator=gen).tolist()
    n_val = max(1, int(n * val_frac))
    return perm[:n_val], perm[n_val:]


VAL_SPLIT_RULE = ("train_draft.py split_indices: torch.randperm(records, generator seeded --seed)"
                  "[:max(1, int(records * --val-frac))], in that order")


def load_dataset(root: Path) -> list[dict]:
    """All records (weights_only loads), bf16 tensors kept as stored."""
    from tqdm import tqdm
    return [read_record(p) for p in tqdm(list_records(root), desc="load data", mininterval=5)]


def make_batches(recs: list[dict], batch_size: int, gen: torch.Generator) -> list[list[int]]:
    """Length-sorted buckets of ``batch_size`` (little padding), in a seeded random order."""
    order = sorted(range(len(recs)), key=lambda i: (recs[i]["input_ids"].numel(), i))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def collate(recs: list[dict], idx: list[int], device) -> dict:
    """Right-pad to the longest sample (ids 0, loss_mask 0); zero the last valid loss-mask entry
    (SpecForge ``normalize_offline_sample``)."""
    T = max(recs[i]["input_ids"].numel() for i in idx)
    B = len(idx)
    H3 = recs[idx[0]]["aux_hidden_state"].shape[-1]
    H = recs[idx[0]]["hidden_state"].shape[-1]
    ids = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    aux = torch.zeros(B, T, H3)
    last = torch.zeros(B, T, H)
    for j, i in enumerate(idx):
        r = recs[i]
        L = r["input_ids"].numel()
        ids[j, :L] = r["input_ids"]
        mask[j, :L] = r["loss_mask"]
        mask[j, L - 1] = 0
        aux[j, :L] = r["aux_hidden_state"][0].float()
        last[j, :L] = r["hidden_state"][0].float()
    return {"input_ids": ids.to(device), "loss_mask": mask.to(device),
            "aux_hidden_state": aux.to(device), "hidden_state": last.to(device)}


@torch.no_grad()
def evaluate(draft, recs, idx_batches, target_head, length, device) -> dict:
    draft.eval()
    accs, losses, n = None, None, 0
    for b in idx_batches:
        _, m = ttt_loss(draft, collate(recs, b, device), target_head, length)
        accs = m["acc"] if accs is None else [x + y for x, y in zip(accs, m["acc"])]
        losses = m["loss"] if losses is None else [x + y for x, y in zip(losses, m["loss"])]
        n += 1
    draft.train()
    acc = [x / n for x in accs]
    # expected accept length of a chain of `length` drafts if step-k accuracy were the
    # conditional accept probability (a rough proxy for SGLang's accept length)
    exp_len, run = 1.0, 1.0
    for x in acc[:3]:
        run *= x
        exp_len += run
    return {"acc_per_step": acc, "loss_per_step": [x / n for x in losses],
            "proxy_accept_length_3_steps": exp_len}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--data", type=Path, default=CACHE_DIR / "draft_data")
    ap.add_argument("--target", type=Path, default=TARGET_DIR)
    ap.add_argument("--out", type=Path, default=DRAFT_DIR)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--ttt-length", type=int, default=4)
    ap.add_argument("--val-frac", type=float, default=0.03)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-steps", type=int, default=None, help="stop early (smoke runs)")
    ap.add_argument("--arch", choices=sorted(DRAFT_ARCHS), default="llama",
                    help="llama: LlamaForCausalLMEagle3 | mla: Eagle3DeepseekV2ForCausalLM (needs "
                         "an MLA target)")
    ap.add_argument("--fc-norm", action="store_true",
                    help="--arch mla: per-chunk RMSNorm before fc (eagle3.1 fc_norm)")
    a = ap.parse_args(argv)
    t0 = time.time()
    seed_everything(a.seed, a.threads)
    device = pick_device(a.device)
    from safetensors.torch import load_file, save_file
    tcfg = json.loads((a.target / "config.json").read_text())
    manifest = json.loads((a.data / "capture.json").read_text())
    layer_ids = manifest["layer_ids"]["specforge_out_i"]
    d2t, t2d = read_vocab_mapping(a.data)
    tw = load_file(str(a.target / "model.safetensors"))
    embed = tw["model.embed_tokens.weight"].float()
    target_head = (tw.get("lm_head.weight", embed)).float().to(device)  # tied: lm_head = embed
    arch = DRAFT_ARCHS[a.arch]
    try:
        cfg = arch.make_config(tcfg, len(d2t), layer_ids,
                               **({"fc_norm": True} if a.fc_norm else {}))
    except (TypeError, ValueError) as e:
        ap.error(f"--arch {a.arch} with --target {a.target}: {e}")

    recs = load_dataset(a.data)
    g = torch.Generator().manual_seed(a.seed)
    val_idx, train_idx = split_indices(len(recs), a.val_frac, g)
    val = [recs[i] for i in val_idx]
    train = [recs[i] for i in train_idx]
    val_batches = [list(range(i, min(i + a.batch_size, len(val))))
                   for i in range(0, len(val), a.batch_size)]
    steps_per_epoch = math.ceil(len(train) / a.batch_size)
    total = steps_per_epoch * a.epochs if a.max_steps is None else a.max_steps
    print(f"[data] {len(train)} train / {len(val)} val samples, layer ids (SpecForge) {layer_ids}, "
          f"draft vocab {len(d2t)}; {total} steps ({a.epochs} epochs x {steps_per_epoch})")

    torch.manual_seed(a.seed)
    draft = arch.module(cfg, embed, d2t, t2d)
    draft.init_weights(a.seed, lm_head_from=target_head.cpu())
    draft.to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    print(f"[draft] {arch.architecture}: hidden {cfg['hidden_size']}, 1 layer, fc "
          f"{3 * tcfg['hidden_size']}->"
          f"{cfg['hidden_size']}, lm_head {len(d2t)}: {n_params / 1e6:.2f} M trainable params "
          f"on {device}")
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=a.weight_decay)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        t = (s - a.warmup) / max(1, total - a.warmup)
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * t))

    from tqdm import tqdm
    log, step = [], 0
    before = evaluate(draft, val, val_batches, target_head, a.ttt_length, device)
    print(f"[eval] before training: acc per step "
          f"{[round(x, 3) for x in before['acc_per_step']]}")
    bar = tqdm(total=total, desc="draft train", mininterval=5)
    for ep in range(a.epochs):
        for b in make_batches(train, a.batch_size, g):
            if step >= total:
                break
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
            loss, m = ttt_loss(draft, collate(train, b, device), target_head, a.ttt_length)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc0=f"{m['acc'][0]:.2f}",
                            acc2=f"{m['acc'][min(2, a.ttt_length - 1)]:.2f}")
            log.append({"step": step, "loss": float(loss), "acc": m["acc"],
                        "grad_norm": float(gn), "lr": lr_at(step - 1)})
        ev = evaluate(draft, val, val_batches, target_head, a.ttt_length, device)
        log[-1]["val"] = ev
        print(f"[eval] epoch {ep + 1}: val acc per step {[round(x, 3) for x in ev['acc_per_step']]}"
              f", proxy accept length {ev['proxy_accept_length_3_steps']:.2f}", flush=True)
    bar.close()
    train_s = time.time() - t0

    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(draft.sglang_state_dict(torch.bfloat16), str(a.out / "model.safetensors"),
              metadata={"format": "pt"})
    final = log[-1]["val"]
    saved, _ = load_draft(a.out, a.target)  # the bf16 checkpoint, upcast to fp32
    ckpt = evaluate(saved.to(device), val, val_batches, target_head, a.ttt_length, device)
    print(f"[eval] saved bf16 checkpoint: val acc per step "
          f"{[round(x, 4) for x in ckpt['acc_per_step']]}", flush=True)
    write_json(a.out / "training_log.json", {
        "trainer": "env/models/train_draft.py (compact re-implementation of SpecForge's offline "
                   "EAGLE-3 TTT trainer; see e3f_models/draft.py)",
        "data": {"path": str(a.data), "manifest": {k: manifest[k] for k in
                                                   ("backend", "samples", "tokens",
                                                    "loss_masked_tokens", "layer_ids",
                                                    "draft_vocab_coverage", "sequences",
                                                    "new_tokens", "generated_by")
                                                   if k in manifest},
                 "validation_split": {"records": len(val), "rule": VAL_SPLIT_RULE}},
        "architecture": arch.architecture,
        "hyper": {k: getattr(a, k) for k in ("epochs", "batch_size", "lr", "min_lr", "warmup",
                                             "weight_decay", "ttt_length", "val_frac", "seed",
                                             "threads", "arch", "fc_norm")},
        "trainable_params": n_params, "steps": step,
        "val_before": before, "val_final": final,
        "val_final_checkpoint": {**ckpt, "note": "the saved bf16 model.safetensors (upcast to "
                                                 "fp32) on the same split; val_final is the fp32 "
                                                 "weights at the end of training"},
        "train_loss_last20": sum(r["loss"] for r in log[-20:]) / min(20, len(log)),
        "train_wall_s": round(train_s, 1),
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda"
                                 else f" ({torch.get_num_threads()} threads)"),
        "torch": torch.__version__,
    })
    write_json(CACHE_DIR / "draft_train_records.json", log)
    print(f"[done] draft -> {a.out}; val acc per step "
          f"{[round(x, 3) for x in final['acc_per_step']]}; wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
