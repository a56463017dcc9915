#!/usr/bin/env python
"""Train a tiny EAGLE-1 draft (vLLM ``method: eagle``, ``EagleLlamaForCausalLM``) for a Llama target on CPU.

    python env/models/train_eagle1.py      # -> env/models/llama_h64/draft_eagle1

Data: ``--sequences`` continuations sampled from the target at temperature 1.0 from BOS (as the EAGLE-3 drafts'
data, "sampled at temperature 1.0"), with the target's post-final-norm hidden states (``last_hidden_state``, what
vLLM feeds an EAGLE-1 draft) and its next-token logits, made here in memory (small enough). Loss per row t (token
t+1 with the target state at t, predicting the state and distribution at t+1): EAGLE-1's
``SmoothL1(out_t, f_{t+1}) + 0.1 * softCE(lm_head(out_t), softmax(target_logits_{t+1}))`` with uniform input-feature
noise U(-0.1, 0.1) (SafeAILab/EAGLE ``eagle/train/main.py``: ``p_w 0.1``, ``v_w 1.0``, uniform noise). Writes
config.json (``EagleLlamaForCausalLM``), model.safetensors (bf16, the names vLLM's ``llama_eagle.py::
EagleLlamaForCausalLM.load_weights`` reads; no embed_tokens / lm_head: the target's are shared) and
training_log.json. Deterministic: seeded sampling, init and batch order.
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
import torch.nn.functional as F  # noqa: E402

from e3f_models import LLAMA_H64_DIR, seed_everything, write_json  # noqa: E402
from e3f_models.eagle1 import Eagle1Module, eagle1_config  # noqa: E402
from e3f_models.target import load_target  # noqa: E402
from eagle1_validation import write_rows  # noqa: E402


@torch.no_grad()
def make_data(target, n: int, length: int, batch: int, seed: int) -> dict:
    """``ids [n, length+1]`` (BOS then sampled tokens), ``feat [n, length+1, H]`` post-norm states,
    ``logits [n, length+1, V]`` (bf16 to save memory)."""
    g = torch.Generator().manual_seed(seed)
    ids_all, feat_all, log_all = [], [], []
    for s in range(0, n, batch):
        b = min(batch, n - s)
        ids = torch.zeros(b, 1, dtype=torch.long)
        past = None
        cur = ids
        for _ in range(length):
            out = target(input_ids=cur, past_key_values=past, use_cache=True)
            past = out.past_key_values
            p = torch.softmax(out.logits[:, -1].float(), dim=-1)
            cur = torch.multinomial(p, 1, generator=g)
            ids = torch.cat([ids, cur], dim=1)
        o = target.model(input_ids=ids)
        feat = o.last_hidden_state
        ids_all.append(ids)
        feat_all.append(feat)
        log_all.append(target.lm_head(feat).to(torch.bfloat16))
        print(f"[data] {s + b}/{n} sequences", flush=True)
    return {"ids": torch.cat(ids_all), "feat": torch.cat(feat_all), "logits": torch.cat(log_all)}


def losses(draft, ids, feat, logits, noise: float, gen=None):
    """Per-batch EAGLE-1 loss and top-1 agreement with the target's argmax (rows 0..T-2)."""
    x_in = feat[:, :-1]
    if noise:
        x_in = x_in + (torch.rand(x_in.shape, generator=gen) * 2 - 1) * noise
    out, lg = draft(ids[:, 1:], x_in)
    tgt_f, tgt_l = feat[:, 1:], logits[:, 1:].float()
    vloss = F.smooth_l1_loss(out, tgt_f)
    ploss = -(torch.softmax(tgt_l, -1) * torch.log_softmax(lg, -1)).sum(-1).mean()
    acc = (lg.argmax(-1) == tgt_l.argmax(-1)).float().mean()
    return vloss + 0.1 * ploss, {"vloss": float(vloss), "ploss": float(ploss), "acc": float(acc)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=LLAMA_H64_DIR / "target")
    ap.add_argument("--out", type=Path, default=LLAMA_H64_DIR / "draft_eagle1")
    ap.add_argument("--sequences", type=int, default=480)
    ap.add_argument("--length", type=int, default=112)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--noise", type=float, default=0.1)
    ap.add_argument("--val", type=int, default=32, help="sequences held out for validation")
    ap.add_argument("--gen-batch", type=int, default=256, help="sequences sampled at once")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    t0 = time.time()
    seed_everything(a.seed, a.threads)
    tcfg = json.loads((a.target / "config.json").read_text())
    target = load_target(a.target)
    data = make_data(target, a.sequences + a.val, a.length, a.gen_batch, a.seed)
    gen_s = time.time() - t0
    embed = target.model.embed_tokens.weight.detach().float()
    lm_head = target.lm_head.weight.detach().float()
    cfg = eagle1_config(tcfg)
    torch.manual_seed(a.seed)
    draft = Eagle1Module(cfg, embed, lm_head)
    for p in draft.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    params = [p for p in draft.parameters()]
    n_params = sum(p.numel() for p in params)
    tr = {k: v[a.val:] for k, v in data.items()}
    va = {k: v[:a.val] for k, v in data.items()}
    steps_per_epoch = math.ceil(a.sequences / a.batch_size)
    total = steps_per_epoch * a.epochs
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def lr_at(s):
        if s < a.warmup:
            return a.lr * (s + 1) / a.warmup
        t = (s - a.warmup) / max(1, total - a.warmup)
        return a.min_lr + 0.5 * (a.lr - a.min_lr) * (1 + math.cos(math.pi * t))

    @torch.no_grad()
    def evaluate():
        draft.eval()
        _, m = losses(draft, va["ids"], va["feat"], va["logits"], 0.0)
        draft.train()
        return m

    g = torch.Generator().manual_seed(a.seed + 1)
    before = evaluate()
    print(f"[draft] {n_params / 1e6:.3f} M params; {total} steps; before: {before}", flush=True)
    log, step = [], 0
    t1 = time.time()
    for ep in range(a.epochs):
        for idx in torch.randperm(a.sequences, generator=g).split(a.batch_size):
            for grp in opt.param_groups:
                grp["lr"] = lr_at(step)
            loss, m = losses(draft, tr["ids"][idx], tr["feat"][idx], tr["logits"][idx], a.noise, g)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            log.append({"step": step, "loss": float(loss), **m, "grad_norm": float(gn)})
        ev = evaluate()
        log[-1]["val"] = ev
        print(f"[eval] epoch {ep + 1} step {step}: val {ev} ({time.time() - t1:.0f} s)", flush=True)
    train_s = time.time() - t1
    a.out.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file
    write_rows(a.out / "validation", va["ids"], va["feat"],      # the held-out rows val_final was measured on
               {"sequences": "from BOS at temperature 1.0 by the target (torch.multinomial, seeded)",
                "records": f"the first {a.val} sampled sequences (the validation split), seed {a.seed}"})
    (a.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(draft.vllm_state_dict(torch.bfloat16), str(a.out / "model.safetensors"), metadata={"format": "pt"})
    write_json(a.out / "training_log.json", {
        "trainer": "env/models/train_eagle1.py (EAGLE-1 loss: SmoothL1 on the target's post-norm state + 0.1 x "
                   "soft CE, uniform feature noise)",
        "architecture": cfg["architectures"][0],
        "data": {"sequences": a.sequences, "validation_sequences": a.val, "length": a.length,
                 "sampled": "from BOS at temperature 1.0 by the target (torch.multinomial, seeded)",
                 "generation_wall_s": round(gen_s, 1)},
        "hyper": {k: getattr(a, k) for k in ("epochs", "batch_size", "lr", "min_lr", "warmup", "noise", "seed",
                                             "threads")},
        "trainable_params": n_params, "steps": step, "val_before": before,
        "val_final": {**log[-1]["val"], "acc_per_step": [log[-1]["val"]["acc"]]},
        "validation_rows": {"path": "validation", "rows": a.val, "acc_per_step": [log[-1]["val"]["acc"]],
                            "source": "val_final.acc: the figure on these rows (float32 weights)"},
        "train_loss_last20": sum(r["loss"] for r in log[-20:]) / min(20, len(log)),
        "train_wall_s": round(train_s, 1), "device": f"cpu ({torch.get_num_threads()} threads)",
        "torch": torch.__version__, "log_every_10": log[::10],
    })
    print(f"[done] -> {a.out}; val {log[-1]['val']}; data {gen_s:.0f} s, train {train_s:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
