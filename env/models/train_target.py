#!/usr/bin/env python
"""Train a reference target on the offline docstring/docs corpus (tiny Llama by default).

    nice -n 10 python env/models/train_target.py            # ~23 min on 2 idle cores, ~1 min on a GPU
    python env/models/train_target.py --steps 20 --out /tmp/t  # smoke run
    python env/models/train_target.py --family kimi --tokenizer-from env/models/target \
        --out env/models/kimi/target                        # Kimi-class DeepseekV3 (MLA + MoE)
    python env/models/train_target.py --num-heads 2 --num-kv-heads 2 \
        --tokenizer-from env/models/target --out env/models/llama_h64/target   # head_dim 64

Writes ``--out`` (default env/models/target/): tokenizer, config.json, model.safetensors (bf16),
training_log.json (loss, held-out loss / ppl, distinct-4-gram ratio of greedy continuations,
sample continuations), and env/models/prompts.json (held-out prompts; only for the default --out).
Deterministic: seeded data order and init, fixed thread count (--threads).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from e3f_models import (CACHE_DIR, PROMPTS_FILE, TARGET_DIR, pick_device,  # noqa: E402
                        seed_everything, write_json)
from e3f_models.corpus import build_corpus  # noqa: E402
from e3f_models.target import (FAMILIES, distinct_n, eval_loss, greedy_continue,  # noqa: E402
                               load_target, pack_documents, train_target)
from e3f_models.tok import train_tokenizer  # noqa: E402


def load_or_build_corpus(rebuild: bool = False):
    """The cleaned corpus, cached in cache/corpus.json.gz (rebuilt in ~2 min when absent)."""
    path = CACHE_DIR / "corpus.json.gz"
    if path.exists() and not rebuild:
        d = json.loads(gzip.decompress(path.read_bytes()))
        print(f"[corpus] cached {path} ({len(d['train'])} train / {len(d['heldout'])} held-out "
              f"documents, sha256 {d['sha256'][:16]})")
        return d
    c = build_corpus()
    d = {"train": c.train, "heldout": c.heldout, "sources": c.sources, "sha256": c.sha256}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(json.dumps(d).encode(), compresslevel=6, mtime=0))
    print(f"[corpus] built: {len(c.train)} train / {len(c.heldout)} held-out documents, "
          f"{sum(map(len, c.train)) / 1e6:.1f} M chars, sha256 {c.sha256[:16]}")
    return d


def heldout_prompts(heldout_docs: list[str], n: int = 64) -> list[str]:
    """Deterministic held-out prompts: the first 8-16 words of held-out paragraphs of >= 24 words
    (paragraphs ordered by a hash of their text; at most 2 per document)."""
    cands = []
    for d in heldout_docs:
        paras = [p for p in d.split("\n") if len(p.split()) >= 24]
        paras.sort(key=lambda p: hashlib.sha256(p.encode()).hexdigest())
        cands.extend(paras[:2])
    cands.sort(key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    out = []
    for p in cands[:n]:
        k = 8 + int(hashlib.sha256(p.encode()).hexdigest()[:4], 16) % 9
        out.append(" ".join(p.split()[:k]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=TARGET_DIR)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--rebuild-corpus", action="store_true")
    ap.add_argument("--device", default="auto", help="auto (cuda if available) | cpu | cuda")
    ap.add_argument("--hidden-size", type=int, default=None, help="override TARGET_SHAPE")
    ap.add_argument("--intermediate-size", type=int, default=None, help="override TARGET_SHAPE")
    ap.add_argument("--num-heads", type=int, default=None,
                    help="override num_attention_heads (e.g. 2: head_dim 64 for vLLM's CPU backend)")
    ap.add_argument("--num-kv-heads", type=int, default=None, help="override num_key_value_heads")
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                    help="llama (LlamaForCausalLM) | kimi (DeepseekV3ForCausalLM: MLA + MoE)")
    ap.add_argument("--tokenizer-from", type=Path, default=None,
                    help="copy this target folder's tokenizer instead of training one (the kimi "
                         "and head_dim-64 targets reuse env/models/target's 4096-id BPE)")
    a = ap.parse_args(argv)
    t_start = time.time()
    seed_everything(a.seed, a.threads)

    corpus = load_or_build_corpus(a.rebuild_corpus)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.tokenizer_from is not None:
        import shutil

        from transformers import AutoTokenizer
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (a.tokenizer_from / name).exists():
                shutil.copyfile(a.tokenizer_from / name, a.out / name)
        tok = AutoTokenizer.from_pretrained(str(a.out))
        print(f"[tokenizer] {len(tok)} ids: files copied from {a.tokenizer_from} -> {a.out}")
    else:
        tok = train_tokenizer(corpus["train"], a.out, a.vocab_size)
        print(f"[tokenizer] byte-level BPE, vocab {len(tok)} -> {a.out}")
    enc = lambda docs: tok(docs, add_special_tokens=True)["input_ids"]  # noqa: E731
    train_ids, held_ids = enc(corpus["train"]), enc(corpus["heldout"])
    rows = pack_documents(train_ids, a.seq_len)
    held_rows = pack_documents(held_ids, a.seq_len)[:64]
    print(f"[data] {rows.numel() / 1e6:.2f} M train tokens in {len(rows)} rows of {a.seq_len}; "
          f"{held_rows.numel()} held-out tokens; {a.steps * a.batch_size * a.seq_len / 1e6:.2f} M "
          f"tokens will be seen ({a.steps * a.batch_size / len(rows):.2f} epochs)")

    family = FAMILIES[a.family]
    torch.manual_seed(a.seed)
    over = {k: v for k, v in (("hidden_size", a.hidden_size),
                              ("intermediate_size", a.intermediate_size),
                              ("num_attention_heads", a.num_heads),
                              ("num_key_value_heads", a.num_kv_heads)) if v}
    cfg = family.config(vocab_size=len(tok), **over)
    model = family.new_model(cfg)  # initialised on CPU: same init on every device
    device = pick_device(a.device)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {family.describe(cfg, n_params)}")
    balancer = family.balancer(model)
    records = train_target(model, rows, steps=a.steps, batch_size=a.batch_size, lr=a.lr,
                           min_lr=a.min_lr, warmup=a.warmup, weight_decay=a.weight_decay,
                           seed=a.seed, heldout_rows=held_rows, eval_every=a.eval_every,
                           after_step=balancer.after_step if balancer else None)
    if balancer is not None:
        balancer.remove()
    t_train = time.time() - t_start

    # Save in bf16, then evaluate what was saved (bf16 weights upcast to fp32).
    model.config.use_cache = True
    family.save(model, a.out)
    saved = load_target(a.out, torch.float32).to(device)
    held_loss = eval_loss(saved, held_rows)
    train_loss = eval_loss(saved, rows[:64])
    prompts = heldout_prompts(corpus["heldout"])
    p_ids = [tok(p)["input_ids"] for p in prompts]
    # EOS is not a stop here (as with SGLang ignore_eos, used by the acceptance runs)
    gens = greedy_continue(saved, p_ids, a.gen_tokens, stop_at_eos=False)
    d4 = distinct_n(gens, 4)
    eos_frac = sum(1 for g in gens if 1 in g) / len(gens)
    samples = [{"prompt": p, "continuation": tok.decode(g, skip_special_tokens=False)}
               for p, g in zip(prompts[:8], gens[:8])]
    summary = {
        "shape": {k: getattr(cfg, k) for k in family.shape_keys},
        "params": n_params,
        "corpus": {"sources": corpus["sources"], "sha256": corpus["sha256"],
                   "train_documents": len(corpus["train"]),
                   "heldout_documents": len(corpus["heldout"]),
                   "train_tokens": int(rows.numel())},
        "hyper": {k: getattr(a, k) for k in ("steps", "batch_size", "seq_len", "lr", "min_lr",
                                             "warmup", "weight_decay", "seed", "threads")},
        "tokens_seen": records[-1]["tokens"],
        "final_train_loss_last20": sum(r["loss"] for r in records[-20:]) / 20,
        "saved_bf16": {"train_rows_loss": train_loss, "heldout_loss": held_loss,
                       "heldout_ppl": math.exp(held_loss)},
        "greedy": {"prompts": len(prompts), "new_tokens": a.gen_tokens, "eos_ignored": True,
                   "fraction_with_eos": eos_frac,
                   "distinct_4": d4, "distinct_2": distinct_n(gens, 2)},
        "samples": samples,
        **({"family": family.name, "architecture": type(model).__name__,
            "expert_balancing": balancer.stats()} if balancer is not None else {}),
        **({"tokenizer_from": str(a.tokenizer_from)} if a.tokenizer_from is not None else {}),
        "train_wall_s": round(t_train, 1),
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda"
                                 else f" ({torch.get_num_threads()} threads)"),
        "torch": torch.__version__,
    }
    write_json(a.out / "training_log.json", summary)
    write_json(CACHE_DIR / "target_train_records.json", records)
    if a.out.resolve() == TARGET_DIR.resolve():
        write_json(PROMPTS_FILE, {"source": "held-out corpus documents (train_target.py "
                                            "heldout_prompts)", "prompts": prompts})
    print(f"[done] held-out loss {held_loss:.3f} (ppl {math.exp(held_loss):.1f}); distinct-4 "
          f"pooled {d4['pooled']:.3f} / mean {d4['mean']:.3f} over {len(gens)} greedy "
          f"continuations of {a.gen_tokens} tokens; wall {time.time() - t_start:.0f} s")
    for s in samples[:4]:
        print(f"  {s['prompt']!r} -> {s['continuation']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
