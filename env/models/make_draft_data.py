#!/usr/bin/env python
"""Draft training data in SpecForge's offline format, from the target's own greedy continuations.

1. Regenerate (SpecForge's "regenerate" step; skipped with --records-from): ``--num`` prompts are
   cut from training-corpus paragraphs (``<s>`` + 4..48 tokens, seeded) and the target continues
   each for ``--new-tokens`` tokens with HF transformers (EOS is not a stop, as with SGLang
   ``ignore_eos``): the last ``--sampled-frac`` of them sampled at ``--temperature`` (default: all,
   at 1.0), the others greedily. Sample = prompt + continuation; ``loss_mask`` = 1 on the
   continuation. (Sampled continuations make the draft rely on the aux hidden states instead of
   the greedy text's repetitions; see README "Wiring sensitivity".)
2. Capture aux hidden states (SpecForge default layer ids [1, n//2-1, n-4], out(i) convention)
   and the post-norm last hidden state, either
     --backend hf      HF ``output_hidden_states`` (out(i) = hidden_states[i+1]), or
     --backend sglang  a real SGLang 0.5.23 CPU server (--enable-return-aux-hidden-states ... and
                       a second server with --enable-return-hidden-states), TP 1.
3. Write ``rows_*/data_{i}.ckpt``, ``vocab_mapping/vocab_mapping.pt`` and ``capture.json``
   (provenance; not named manifest.json, which helpers/formats/training_data.py reads as an e3f dump).

    python env/models/make_draft_data.py --out env/models/cache/draft_data        # full set (hf)
    python env/models/make_draft_data.py --backend sglang --records-from A --out B --num 3
"""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[2]))  # repo root: helpers.server.embedded

import torch  # noqa: E402

from e3f_models import (CACHE_DIR, TARGET_DIR, pick_device, seed_everything,  # noqa: E402
                        specforge_default_layer_ids, write_json)
from e3f_models.capture import (hf_capture, sglang_launch_kwargs,  # noqa: E402
                                sglang_prompt_hidden_states)
from e3f_models.specforge_data import (build_vocab_mapping, list_records, read_record,  # noqa: E402
                                       read_vocab_mapping, write_record, write_vocab_mapping)
from e3f_models.target import greedy_continue, load_target  # noqa: E402


def make_prompts(docs: list[str], tok, num: int, seed: int, min_len: int = 4,
                 max_len: int = 48) -> list[list[int]]:
    """``num`` prompts: ``<s>`` + the first k in [min_len, max_len] tokens of a random paragraph
    (of >= 12 words) of a random training document; seeded and order-independent of threads."""
    rng = random.Random(seed)
    out = []
    while len(out) < num:
        d = docs[rng.randrange(len(docs))]
        paras = [p for p in d.split("\n") if len(p.split()) >= 12]
        if not paras:
            continue
        p = paras[rng.randrange(len(paras))]
        k = rng.randint(min_len, max_len)
        ids = tok(p)["input_ids"]  # starts with <s>
        if len(ids) < k + 1:
            continue
        out.append(ids[: k + 1])
    return out


def sequences_label(n_greedy: int, n_sampled: int, temperature: float) -> str:
    """How the continuations were chosen, in the words capture.json and the draft's training log
    share: ``greedy``, ``sampled at temperature T`` or ``G greedy + S sampled at temperature T``."""
    if n_sampled == 0:
        return "greedy"
    if n_greedy == 0:
        return f"sampled at temperature {temperature}"
    return f"{n_greedy} greedy + {n_sampled} sampled at temperature {temperature}"


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_vocab_from(path: Path):
    """(d2t, t2d) from a data dir (vocab_mapping/vocab_mapping.pt) or a draft dir (safetensors)."""
    path = Path(path)
    if (path / "vocab_mapping" / "vocab_mapping.pt").exists():
        return read_vocab_mapping(path)
    from safetensors.torch import load_file
    w = load_file(str(path / "model.safetensors"))
    return w["d2t"], w["t2d"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=CACHE_DIR / "draft_data")
    ap.add_argument("--target", type=Path, default=TARGET_DIR)
    ap.add_argument("--backend", choices=("hf", "sglang"), default="hf")
    ap.add_argument("--num", type=int, default=4000)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--records-from", type=Path, default=None,
                    help="reuse input_ids/loss_mask of an existing data dir (first --num samples)")
    ap.add_argument("--vocab-from", type=Path, default=None,
                    help="take d2t/t2d from a data dir or a draft dir instead of counting tokens")
    ap.add_argument("--draft-vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--tp", type=int, default=1, help="SGLang TP size (sglang backend)")
    ap.add_argument("--sampled-frac", type=float, default=1.0,
                    help="share of samples whose continuation is sampled at --temperature "
                         "instead of greedy (the last ones)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--text-len", type=int, default=None,
                    help="no generation: each sequence is <s> + TEXT_LEN tokens of a training paragraph "
                         "(teacher-forced; loss_mask 0 on the first 8 tokens), e.g. for a CPU-only run")
    ap.add_argument("--layer-ids", type=int, nargs=3, default=None,
                    help="aux layers in SpecForge's out(i) convention (default: SpecForge's "
                         "[1, n//2-1, n-4]); e.g. 4 5 6 for the fallback-ids case's second draft")
    a = ap.parse_args(argv)
    t0 = time.time()
    seed_everything(a.seed, a.threads)
    device = pick_device(a.device)
    tcfg = json.loads((a.target / "config.json").read_text())
    n_layers, target_vocab = tcfg["num_hidden_layers"], tcfg["vocab_size"]
    layer_ids = list(a.layer_ids) if a.layer_ids else specforge_default_layer_ids(n_layers)
    assert len(set(layer_ids)) == 3 and max(layer_ids) < n_layers - 1, layer_ids
    timings = {}

    # 1. regenerate (or reuse) the token sequences
    if a.records_from is not None:
        samples = []
        for p in list_records(a.records_from)[: a.num]:
            r = read_record(p)
            samples.append((r["input_ids"].tolist(), r["loss_mask"].tolist()))
        print(f"[records] {len(samples)} samples from {a.records_from}")
        rec_cap = a.records_from / "capture.json"
        sequences = (json.loads(rec_cap.read_text()).get("sequences", "as recorded there")
                     if rec_cap.exists() else "as recorded there")
        gen_source = f"records of {a.records_from}"
    else:
        import gzip

        from transformers import AutoTokenizer
        corpus = json.loads(gzip.decompress((CACHE_DIR / "corpus.json.gz").read_bytes()))
        tok = AutoTokenizer.from_pretrained(str(a.target))
        if a.text_len:
            rows = make_prompts(corpus["train"], tok, a.num, a.seed, min_len=a.text_len, max_len=a.text_len)
            samples = [(r, [0] * 8 + [1] * (len(r) - 8)) for r in rows]
            sequences, gen_source = "corpus text (teacher-forced, no generation)", "corpus"
            prompts = None
        else:
            prompts = make_prompts(corpus["train"], tok, a.num, a.seed)
    if a.records_from is None and prompts is not None:
        model = load_target(a.target).to(device)
        t = time.time()
        n_greedy = a.num - int(round(a.num * a.sampled_frac))
        gens = greedy_continue(model, prompts[:n_greedy], a.new_tokens, batch_size=a.batch_size,
                               stop_at_eos=False, progress=True)
        if n_greedy < a.num:
            gens += greedy_continue(model, prompts[n_greedy:], a.new_tokens,
                                    batch_size=a.batch_size, stop_at_eos=False, progress=True,
                                    temperature=a.temperature, seed=a.seed)
        timings["regenerate_s"] = round(time.time() - t, 1)
        samples = [(p + g, [0] * len(p) + [1] * len(g)) for p, g in zip(prompts, gens)]
        sequences = sequences_label(n_greedy, a.num - n_greedy, a.temperature)
        gen_source = f"HF on {device}"
        print(f"[regenerate] {len(samples)} continuations ({sequences}) of {a.new_tokens} tokens on "
              f"{device} in {timings['regenerate_s']} s")

    # 2. capture
    a.out.mkdir(parents=True, exist_ok=True)
    t = time.time()
    if a.backend == "hf":
        from tqdm import tqdm
        model = load_target(a.target).to(device)
        by_len: dict[int, list[int]] = {}
        for i, (ids, _) in enumerate(samples):
            by_len.setdefault(len(ids), []).append(i)
        batches = [idx[j:j + a.batch_size] for L in sorted(by_len)
                   for idx in [by_len[L]] for j in range(0, len(idx), a.batch_size)]
        for b in tqdm(batches, desc="hf capture", mininterval=5):
            x = torch.tensor([samples[i][0] for i in b], dtype=torch.long)
            aux, last = hf_capture(model, x, layer_ids)
            for j, i in enumerate(b):
                write_record(a.out, i, samples[i][0], samples[i][1], aux[j].cpu(), last[j].cpu())
    else:
        from tqdm import tqdm

        from helpers.server import embedded
        blocks: dict[str, list[torch.Tensor]] = {}
        for kind in ("aux", "final"):
            print(f"[sglang] starting capture server ({kind}) ...", flush=True)
            with embedded.start(a.target.resolve(), None, tp=a.tp, enable_metrics=False,
                                timeout=600, **sglang_launch_kwargs(kind, layer_ids)) as srv:
                blocks[kind] = [sglang_prompt_hidden_states(srv.url, ids)
                                for ids, _ in tqdm(samples, desc=f"sglang {kind}", mininterval=5)]
        for i, (ids, mask) in enumerate(samples):
            write_record(a.out, i, ids, mask, blocks["aux"][i], blocks["final"][i])
    timings["capture_s"] = round(time.time() - t, 1)

    # 3. vocab mapping + manifest
    if a.vocab_from is not None:
        d2t, t2d = load_vocab_from(a.vocab_from)
        coverage = None
    else:
        d2t, t2d, coverage = build_vocab_mapping(samples, target_vocab, a.draft_vocab)
    write_vocab_mapping(a.out, d2t, t2d)
    n_tok = sum(len(ids) for ids, _ in samples)
    write_json(a.out / "capture.json", {
        "format": "specforge_hidden_states_v1 (rows_{g}-{g+2000}/data_{i}.ckpt)",
        "backend": a.backend,
        "capture": ("HF transformers output_hidden_states, out(i) = hidden_states[i+1]"
                    if a.backend == "hf" else
                    "SGLang 0.5.23 --enable-return-aux-hidden-states --speculative-algorithm "
                    "EAGLE3 --return-aux-hidden-state-layer-ids (+ --enable-return-hidden-states "
                    f"for hidden_state), TP {a.tp}, --dtype float32"),
        "layer_ids": {"specforge_out_i": layer_ids,
                      "sglang_capture_index": [i + 1 for i in layer_ids],
                      "hf_hidden_states_index": [i + 1 for i in layer_ids]},
        "aux_order": "ascending layer id",
        "hidden_state": "after the target's final RMSNorm",
        "dtype": "bfloat16",
        "target": {"path": str(a.target.name), "architecture": (tcfg.get("architectures")
                                                                 or [None])[0],
                   "num_hidden_layers": n_layers,
                   "hidden_size": tcfg["hidden_size"], "vocab_size": target_vocab,
                   "model_safetensors_sha256": file_sha256(a.target / "model.safetensors")},
        "samples": len(samples), "tokens": n_tok,
        "loss_masked_tokens": sum(sum(m) for _, m in samples),
        "sequences": sequences, "generated_by": gen_source, "new_tokens": a.new_tokens,
        "seed": a.seed,
        "draft_vocab": int(len(d2t)), "draft_vocab_coverage": coverage,
        "timings_s": timings, "device": str(device),
    })
    print(f"[done] {len(samples)} samples ({n_tok} tokens) -> {a.out} via {a.backend}; "
          f"draft vocab {len(d2t)} covers {coverage if coverage is None else round(coverage, 4)} "
          f"of the continuation tokens; wall {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
