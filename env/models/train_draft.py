#!/usr/bin/env python
"""Train the EAGLE-3 draft on SpecForge-format data (make_draft_data.py) with unrolled TTT.

    python env/models/train_draft.py --data env/models/cache/draft_data      # -> env/models/draft

Writes ``--out``: config.json (``LlamaForCausalLMEagle3``, ``eagle_config`` with the SpecForge
layer ids of the data's manifest), model.safetensors (bf16 weights + int64 d2t + bool t2d, SGLang /
SpecForge names, no embeddings) and training_log.json. Deterministic: seeded init and batch order.
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
from e3f_models.draft import Eagle3Draft, ttt_loss  # noqa: E402
from e3f_models.specforge_data import list_records, read_record, read_vocab_mapping  # noqa: E402


def draft_config(target_cfg: dict, draft_vocab: int, layer_ids: list[int]) -> dict:
    """config.json of the draft (SGLang ``LlamaForCausalLMEagle3`` / SpecForge draft config).

    The target's Llama shape with 1 decoder layer, ``draft_vocab_size`` < ``vocab_size``,
    ``tie_word_embeddings: false`` (SGLang would otherwise use the embedding as lm_head) and
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SpecForge's out(i) convention: SGLang
    reads the nested key (model_runner_components/spec_aux_hidden_state.py) and captures at loop
    index i+1 (models/llama.py::set_eagle3_layers_to_capture).
    """
    rope = (target_cfg.get("rope_parameters") or {}).get("rope_theta",
                                                          target_cfg.get("rope_theta", 10000.0))
    h, nh = target_cfg["hidden_size"], target_cfg["num_attention_heads"]
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": target_cfg["intermediate_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": nh,
        "num_key_value_heads": target_cfg["num_key_value_heads"],
        "head_dim": target_cfg.get("head_dim") or h // nh,
        "hidden_act": target_cfg.get("hidden_act", "silu"),
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rms_norm_eps": target_cfg["rms_norm_eps"],
        "rope_theta": rope,
        "rope_parameters": {"rope_theta": rope, "rope_type": "default"},
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": target_cfg["vocab_size"],
        "draft_vocab_size": int(draft_vocab),
        "tie_word_embeddings": False,
        "bos_token_id": target_cfg.get("bos_token_id"),
        "eos_token_id": target_cfg.get("eos_token_id"),
        "pad_token_id": target_cfg.get("pad_token_id"),
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids),
                         "use_aux_hidden_state": True},
    }


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
    cfg = draft_config(tcfg, len(d2t), layer_ids)

    recs = load_dataset(a.data)
    g = torch.Generator().manual_seed(a.seed)
    perm = torch.randperm(len(recs), generator=g).tolist()
    n_val = max(1, int(len(recs) * a.val_frac))
    val = [recs[i] for i in perm[:n_val]]
    train = [recs[i] for i in perm[n_val:]]
    val_batches = [list(range(i, min(i + a.batch_size, len(val))))
                   for i in range(0, len(val), a.batch_size)]
    steps_per_epoch = math.ceil(len(train) / a.batch_size)
    total = steps_per_epoch * a.epochs if a.max_steps is None else a.max_steps
    print(f"[data] {len(train)} train / {len(val)} val samples, layer ids (SpecForge) {layer_ids}, "
          f"draft vocab {len(d2t)}; {total} steps ({a.epochs} epochs x {steps_per_epoch})")

    torch.manual_seed(a.seed)
    draft = Eagle3Draft(cfg, embed, d2t, t2d)
    draft.init_weights(a.seed, lm_head_from=target_head.cpu())
    draft.to(device)
    params = [p for p in draft.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    print(f"[draft] hidden {cfg['hidden_size']}, 1 layer, fc {3 * tcfg['hidden_size']}->"
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
    write_json(a.out / "training_log.json", {
        "trainer": "env/models/train_draft.py (compact re-implementation of SpecForge's offline "
                   "EAGLE-3 TTT trainer; see e3f_models/draft.py)",
        "data": {"path": str(a.data), "manifest": {k: manifest[k] for k in
                                                   ("backend", "samples", "tokens",
                                                    "loss_masked_tokens", "layer_ids",
                                                    "draft_vocab_coverage", "sequences",
                                                    "new_tokens")}},
        "hyper": {k: getattr(a, k) for k in ("epochs", "batch_size", "lr", "min_lr", "warmup",
                                             "weight_decay", "ttt_length", "val_frac", "seed",
                                             "threads")},
        "trainable_params": n_params, "steps": step,
        "val_before": before, "val_final": final,
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
