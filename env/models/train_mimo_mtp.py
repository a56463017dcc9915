#!/usr/bin/env python
"""Train a MiMo MTP head (vLLM ``mimo_mtp.py::MiMoMTP``, one ``model.mtp_layers.0``) for the ``llama_h64`` target.

    python env/models/train_mimo_mtp.py   # -> llama_h64/mimo_mtp/{model.safetensors, nextn_training_log.json}

``make_mimo_pair.py`` assembles the MiMo pair vLLM serves from the target and these weights, and writes the log and
its validation rows beside it.

Data: the EAGLE-1 draft's (``train_eagle1.py::make_data``, same arguments and seed: 512 sequences of BOS + 112 tokens
sampled from the target at temperature 1.0; the first 32 are the validation split, the EAGLE-1 draft's committed
``llama_h64/draft_eagle1/validation`` ids, checked), with the target's states from :func:`e3f_models.mimo_mtp.
target_states`: the pre-norm ``out(7)`` the head reads and the post-norm state that gives the target's distribution.
The token ids are cached in ``cache/h64_sampled_ids.pt`` (sampling: ~5-10 min on 2 busy cores).

Head (:class:`e3f_models.mimo_mtp.MiMoMTPModule`): decoder started from a copy of the target's layer 7 (q/k/v biases
zero), ``hidden_layernorm`` from the target's final norm, ``input_proj`` Normal(0, 0.02); embedding and lm_head the
target's, frozen. Loss: soft cross-entropy against the target's distribution for token t+2 (row t: token t+1 and the
target's pre-norm state at t), one step (MiMo's MTP module predicts one token; ``train_steps`` 1). Metric, as the
NextN trainer's (``train_nextn.py``): accuracy of the head's argmax against the target's argmax for token t+2 on rows
0..L-3 of each sequence (every row is loss-masked: sampled text from BOS), position 0's embedding zeroed as vLLM does.
AdamW 3e-3 -> 1e-4 cosine, batch 32, clip 0.5, seed 0. Writes bf16 weights (``model.mtp_layers.0.*``) and
``nextn_training_log.json`` (the name ``helpers.draft.nextn_stage`` reads) with ``val_final`` (fp32 weights),
``val_final_checkpoint`` (the saved bf16 weights) and ``validation_rows`` (the saved weights on the rows
``make_mimo_pair.py`` writes, ``path`` ``validation``: relative to the pair folder the log is copied into).
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

from e3f_models import CACHE_DIR, LLAMA_H64_DIR, seed_everything, write_json  # noqa: E402
from e3f_models.mimo_mtp import MiMoMTPModule, mtp_loss, target_states  # noqa: E402
from e3f_models.target import load_target  # noqa: E402

LOG_NAME = "nextn_training_log.json"
IDS_CACHE = CACHE_DIR / "h64_sampled_ids.pt"
EAGLE1_VAL = LLAMA_H64_DIR / "draft_eagle1" / "validation"


def sampled_ids(target, n: int, length: int, seed: int) -> torch.Tensor:
    """``[n, length + 1]`` token ids from ``train_eagle1.make_data`` (cached in :data:`IDS_CACHE`)."""
    if IDS_CACHE.is_file():
        ids = torch.load(IDS_CACHE, weights_only=True)["ids"]
        if ids.shape == (n, length + 1):
            return ids
    from train_eagle1 import make_data
    seed_everything(seed, None)
    ids = make_data(target, n, length, 256, seed)["ids"]
    IDS_CACHE.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"ids": ids}, IDS_CACHE)
    return ids


def eagle1_validation_ids(folder: Path = EAGLE1_VAL) -> torch.Tensor:
    """The committed EAGLE-1 validation rows' ``input_ids`` ``[N, L]`` in row order."""
    files = sorted((folder).glob("rows_*/data_*.ckpt"), key=lambda p: int(p.stem.split("_")[1]))
    return torch.stack([torch.load(p, weights_only=True)["input_ids"] for p in files])


@torch.no_grad()
def evaluate(head, ids, pre, post, batch: int = 32) -> dict:
    """Mean accuracy / loss over rows 0..L-3 of every sequence (equal lengths: the row mean), 1 step."""
    head.eval()
    n, acc, loss = 0, 0.0, 0.0
    for s in range(0, ids.shape[0], batch):
        b = slice(s, s + batch)
        _, m = mtp_loss(head, ids[b], pre[b], post[b])
        k = ids[b].shape[0]
        acc, loss, n = acc + m["acc"] * k, loss + m["loss"] * k, n + k
    head.train()
    a = acc / n
    return {"acc_per_step": [a], "loss_per_step": [loss / n], "proxy_accept_length_1_step": 1.0 + a}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=LLAMA_H64_DIR / "target")
    ap.add_argument("--out", type=Path, default=LLAMA_H64_DIR / "mimo_mtp")
    ap.add_argument("--sequences", type=int, default=480)
    ap.add_argument("--val", type=int, default=32)
    ap.add_argument("--length", type=int, default=112)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    t0 = time.time()
    seed_everything(a.seed, a.threads)
    tcfg = json.loads((a.target / "config.json").read_text())
    target = load_target(a.target)
    cached = IDS_CACHE.is_file()
    ids = sampled_ids(target, a.sequences + a.val, a.length, a.seed)
    gen_s = time.time() - t0
    val_ids = eagle1_validation_ids()
    if not torch.equal(ids[:a.val], val_ids[:a.val]):
        raise SystemExit(f"the first {a.val} sampled sequences differ from {EAGLE1_VAL}'s ids")
    pre, post = target_states(target, ids)
    embed = target.model.embed_tokens.weight.detach().float()
    lm_head = target.lm_head.weight.detach().float()
    torch.manual_seed(a.seed)
    head = MiMoMTPModule(tcfg, embed, lm_head)
    head.init_from_target(target.model.layers[-1], target.model.norm.weight, a.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    tr = slice(a.val, None)
    va = slice(0, a.val)
    steps_per_epoch = math.ceil(a.sequences / a.batch_size)
    total = steps_per_epoch * a.epochs
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        t = (s - a.warmup) / max(1, total - a.warmup)
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * t))

    before = evaluate(head, ids[va], pre[va], post[va])
    print(f"[head] {n_params / 1e6:.3f} M params; {total} steps; before: {before}", flush=True)
    g = torch.Generator().manual_seed(a.seed + 1)
    log, step = [], 0
    t1 = time.time()
    for ep in range(a.epochs):
        for idx in torch.randperm(a.sequences, generator=g).split(a.batch_size):
            idx = idx + a.val
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
            loss, m = mtp_loss(head, ids[idx], pre[idx], post[idx])
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            log.append({"step": step, **m, "grad_norm": float(gn), "lr": lr_at(step - 1)})
        ev = evaluate(head, ids[va], pre[va], post[va])
        log[-1]["val"] = ev
        print(f"[eval] epoch {ep + 1} step {step}: val {ev} ({time.time() - t1:.0f} s)", flush=True)
    train_s = time.time() - t1
    from safetensors.torch import save_file
    a.out.mkdir(parents=True, exist_ok=True)
    sd = head.state_dict_mimo(torch.bfloat16)
    save_file(sd, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    saved = MiMoMTPModule(tcfg, embed, lm_head).load_mimo(sd)      # the bf16 checkpoint, upcast to fp32
    ckpt = evaluate(saved, ids[va], pre[va], post[va])
    vpre, vpost = target_states(target, val_ids)                 # as make_mimo_pair.py writes the rows
    rows = evaluate(saved, val_ids, vpre, vpost)
    write_json(a.out / LOG_NAME, {
        "trainer": "env/models/train_mimo_mtp.py (MiMo MTP head = vllm/model_executor/models/mimo_mtp.py::"
                   "MiMoMultiTokenPredictorLayer; e3f_models/mimo_mtp.py)",
        "metric": "accuracy of the head's argmax against the target's argmax for token t+2 (step 0: token t+1 and "
                  "the target's PRE-norm state out(7) at t, position 0's embedding zeroed), rows 0..L-3",
        "data": {"sequences": a.sequences, "validation_sequences": a.val, "length": a.length,
                 "sampled": "from BOS at temperature 1.0 by the target (torch.multinomial, seeded; "
                            "train_eagle1.py::make_data, the EAGLE-1 draft's data)",
                 "hidden_state": "out(7), the target's last decoder layer output before the final norm",
                 "manifest": {"sequences": "sampled at temperature 1.0"},
                 "validation_split": {"records": a.val, "rule": f"the first {a.val} sampled sequences (the EAGLE-1 "
                                                                 "draft's validation split)"},
                 "generation_wall_s": round(gen_s, 1),
                 "ids_from_cache": cached},
        "architecture": "MiMoMTP",
        "checkpoint": f"{a.out.name}/model.safetensors model.mtp_layers.0.* ({len(sd)} tensors)",
        "hyper": {"epochs": a.epochs, "batch_size": a.batch_size, "lr": a.lr, "min_lr": a.min_lr,
                  "warmup": a.warmup, "train_steps": 1, "eval_steps": 1, "seed": a.seed, "threads": a.threads},
        "trainable_params": n_params, "steps": step,
        "val_before": before, "val_final": log[-1]["val"],
        "val_final_checkpoint": {**ckpt, "note": "the saved bf16 layer (upcast to fp32) on the same split"},
        "validation_rows": {"path": "validation", "rows": int(val_ids.shape[0]), **rows,
                            "source": "the saved bf16 layer on the rows make_mimo_pair.py writes (the validation "
                                      "split's ids, the target's states recomputed: e3f_models/mimo_mtp.py::"
                                      "target_states)"},
        "train_loss_last20": sum(r["loss"] for r in log[-20:]) / min(20, len(log)),
        "train_acc_last20": sum(r["acc"] for r in log[-20:]) / min(20, len(log)),
        "train_wall_s": round(train_s, 1), "device": f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "log_every_10": log[::10],
    })
    print(f"[done] -> {a.out}; val {log[-1]['val']}; checkpoint {ckpt}; train {train_s:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
