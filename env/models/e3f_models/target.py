"""The reference target: a small Llama (HF ``LlamaForCausalLM``) trained on the offline corpus.

Shapes (``target_config``): hidden 128, 8 decoder layers, 8 attention heads and 8 KV heads
(head_dim 16; both divisible by 8 so SGLang TP 1/2/4/8 all shard evenly), MLP 384, vocab 4096 with
tied input/output embeddings, RoPE theta 10000, max 512 positions. About 2.2 M parameters; saved in
bf16 safetensors (~4.5 MB), served by SGLang with ``--dtype float32``. (At equal CPU compute, ~23 min
on 2 cores, this shape reached held-out ppl 48 vs 55 for hidden 192 and 93 for hidden 256: the
corpus and budget are small, so a narrower model trained on more tokens is the better LM.)

Everything downstream (self-distillation, hidden-state capture, draft training) loads the *saved*
bf16 weights upcast to fp32, so training data and serving see the same numbers.
"""
from __future__ import annotations

import math
import time

import torch

from .tok import BOS_ID, EOS_ID, PAD_ID

TARGET_SHAPE = dict(hidden_size=128, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=8, intermediate_size=384, vocab_size=4096,
                    max_position_embeddings=512)


def target_config(**overrides):
    """``transformers.LlamaConfig`` of the reference target (``TARGET_SHAPE`` + overrides)."""
    from transformers import LlamaConfig

    kw = dict(TARGET_SHAPE)
    kw.update(overrides)
    return LlamaConfig(**kw, hidden_act="silu", rms_norm_eps=1e-5, rope_theta=10000.0,
                       tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
                       bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                       initializer_range=0.02)


def load_target(path, dtype=torch.float32):
    """Load a saved target with HF transformers, in ``dtype`` (fp32 by default), eval mode."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    m.eval()
    return m


def pack_documents(token_lists: list[list[int]], seq_len: int) -> torch.Tensor:
    """Concatenate ``<s> doc </s>`` streams and cut into ``[N, seq_len]`` int64 rows (tail dropped).

    ``token_lists`` must already start with ``<s>`` (the tokenizer's post-processor adds it).
    """
    flat: list[int] = []
    for ids in token_lists:
        flat.extend(ids)
        flat.append(EOS_ID)
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


@torch.no_grad()
def eval_loss(model, rows: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-token cross-entropy (nats/token) of ``model`` over ``rows [N, T]``."""
    model.eval()
    tot, cnt = 0.0, 0
    dev = next(model.parameters()).device
    for i in range(0, len(rows), batch_size):
        x = rows[i:i + batch_size].to(dev)
        logits = model(input_ids=x).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    return tot / max(cnt, 1)


def train_target(model, rows: torch.Tensor, *, steps: int, batch_size: int, lr: float,
                 min_lr: float, warmup: int, weight_decay: float, seed: int,
                 heldout_rows: torch.Tensor | None = None, eval_every: int = 100,
                 log=print) -> list[dict]:
    """AdamW + linear warmup + cosine decay on shuffled ``rows``; returns a list of log records.

    Runs on the model's device. Deterministic for a fixed seed, device, thread count and torch
    build (the data order comes from a seeded CPU ``torch.Generator``).
    """
    from tqdm import tqdm

    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(s):
        if s < warmup:
            return lr * (s + 1) / warmup
        t = (s - warmup) / max(1, steps - warmup)
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))

    order = torch.randperm(len(rows), generator=g)
    pos = 0
    records = []
    t0 = time.time()
    ema = None
    bar = tqdm(range(steps), desc="target train", mininterval=5)
    for s in bar:
        model.train()
        if pos + batch_size > len(order):
            order = torch.randperm(len(rows), generator=g)
            pos = 0
        x = rows[order[pos:pos + batch_size]].to(dev)
        pos += batch_size
        for grp in opt.param_groups:
            grp["lr"] = lr_at(s)
        out = model(input_ids=x, labels=x)
        out.loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        li = out.loss.item()
        ema = li if ema is None else 0.95 * ema + 0.05 * li
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr_at(s):.2e}")
        rec = {"step": s + 1, "loss": li, "grad_norm": float(gn), "lr": lr_at(s),
               "tokens": (s + 1) * x.numel(), "elapsed_s": time.time() - t0}
        if heldout_rows is not None and ((s + 1) % eval_every == 0 or s + 1 == steps):
            rec["heldout_loss"] = eval_loss(model, heldout_rows)
            log(f"step {s + 1}/{steps}: train loss (ema) {ema:.3f}, held-out loss "
                f"{rec['heldout_loss']:.3f} (ppl {math.exp(rec['heldout_loss']):.1f}), "
                f"{rec['tokens'] / rec['elapsed_s']:.0f} tok/s")
        records.append(rec)
    return records


@torch.no_grad()
def greedy_continue(model, prompts: list[list[int]], max_new_tokens: int,
                    batch_size: int = 64, stop_at_eos: bool = True, progress: bool = False,
                    temperature: float = 0.0, seed: int = 0):
    """Greedy (argmax) continuations of token-id prompts with a KV cache (HF transformers).

    Prompts are grouped by length so no padding is ever needed. No logit is masked (unlike HF
    ``generate(min_new_tokens=...)``), so this is the same argmax rule as SGLang at temperature 0.
    Returns a list of generated id lists (without the prompt), truncated after the first ``</s>``
    when ``stop_at_eos`` (what SGLang does by default). ``temperature > 0`` samples instead
    (seeded ``torch.Generator`` on the model's device; used for draft-data diversity only).
    """
    from tqdm import tqdm

    model.eval()
    dev = next(model.parameters()).device
    out: list[list[int] | None] = [None] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    batches = []
    for L in sorted(by_len):
        idx = by_len[L]
        for j in range(0, len(idx), batch_size):
            batches.append(idx[j:j + batch_size])
    rng = torch.Generator(device=dev).manual_seed(seed)

    def pick(logits):
        if temperature <= 0:
            return logits.float().argmax(-1)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=rng)[:, 0]

    for b in tqdm(batches, desc="greedy" if temperature <= 0 else "sample", disable=not progress):
        x = torch.tensor([prompts[i] for i in b], dtype=torch.long, device=dev)
        res = model(input_ids=x, use_cache=True)
        past = res.past_key_values
        nxt = pick(res.logits[:, -1])
        gen_t = [nxt]
        for _ in range(max_new_tokens - 1):
            res = model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = pick(res.logits[:, -1])
            gen_t.append(nxt)
        gen = torch.stack(gen_t, 1).tolist()
        for i, g in zip(b, gen):
            if stop_at_eos and EOS_ID in g:
                g = g[: g.index(EOS_ID) + 1]
            out[i] = g
    return out


def distinct_n(seqs: list[list[int]], n: int = 4) -> dict:
    """Distinct-n of token sequences: ``pooled`` = unique / total n-grams over all sequences,
    ``mean`` = mean per-sequence ratio (sequences shorter than n are skipped)."""
    per, allg, tot = [], set(), 0
    for s in seqs:
        grams = [tuple(s[i:i + n]) for i in range(len(s) - n + 1)]
        if not grams:
            continue
        per.append(len(set(grams)) / len(grams))
        allg.update(grams)
        tot += len(grams)
    return {"pooled": len(allg) / max(tot, 1), "mean": sum(per) / max(len(per), 1),
            "n": n, "sequences": len(per)}
