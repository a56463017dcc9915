#!/usr/bin/env python
"""Offline check of how much the reference draft depends on correctly wired aux hidden states.

The target continues the held-out prompts greedily (HF); the draft then runs its TTT unroll
(e3f_models/draft.py::ttt_loss, 4 steps) on those sequences with aux hidden states built
correctly and with classic wiring faults, all expressed as physical tensors (SpecForge out(i),
``emb`` = embedding output). Per-step accuracy = share of continuation rows where the draft's
argmax equals the target's greedy token; ``proxy accept length`` = 1 + a0 + a0*a1 + a0*a1*a2
(steps 3, topk 1). This is an offline proxy: the real number comes from measure_acceptance.py.

    python env/models/eval_draft_faults.py [--draft DIR] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from e3f_models import (DRAFT_DIR, PROMPTS_FILE, REPO_ROOT, TARGET_DIR,  # noqa: E402
                        pick_device, seed_everything, write_json)

# name -> chunks in concat order; int i = out(i) (HF hidden_states[i+1]), "emb" = hidden_states[0]
FAULTS = {
    "correct: out(1), out(3), out(4)": [1, 3, 4],
    "ids read verbatim as in(i) (vLLM-style): out(0), out(2), out(3)": [0, 2, 3],
    "ids shifted +1: out(2), out(4), out(5)": [2, 4, 5],
    "chunk order reversed: out(4), out(3), out(1)": [4, 3, 1],
    "embedding prepended, last chunk dropped: emb, out(1), out(3)": ["emb", 1, 3],
    "embedding in place of out(1): emb, out(3), out(4)": ["emb", 3, 4],
    "no aux (zeros)": None,
}


def load_draft(draft_dir: Path, target_dir: Path):
    """``(draft, target lm_head)``: ``e3f_models.draft_arch.load_draft`` (strict except the
    shared embedding; either draft architecture)."""
    from e3f_models.draft_arch import load_draft as _load
    return _load(draft_dir, target_dir)


@torch.no_grad()
def fault_table(draft, head, model, seqs: list[tuple[list[int], list[int]]], faults=FAULTS,
                ttt_length: int = 4) -> dict:
    """``{fault: {"acc_per_step", "proxy_accept_length"}}`` over ``seqs`` = (ids, loss_mask)."""
    from e3f_models.draft import ttt_loss
    dev = next(model.parameters()).device
    draft = draft.to(dev)
    head = head.to(dev)
    T = max(len(s) for s, _ in seqs)
    B = len(seqs)
    ids = torch.zeros(B, T, dtype=torch.long, device=dev)
    mask = torch.zeros(B, T, dtype=torch.long, device=dev)
    for j, (s, m) in enumerate(seqs):
        ids[j, :len(s)] = torch.tensor(s)
        mask[j, :len(s)] = torch.tensor(m)
        mask[j, len(s) - 1] = 0
    out = model.model(input_ids=ids, output_hidden_states=True)  # right padding: causal, harmless
    hs = out.hidden_states
    bf = lambda x: x.to(torch.bfloat16).float()  # noqa: E731  (stored training data is bf16)
    res = {}
    for name, chunks in faults.items():
        if chunks is None:
            aux = torch.zeros_like(torch.cat([hs[2], hs[4], hs[5]], -1))
        else:
            aux = torch.cat([hs[0] if c == "emb" else hs[c + 1] for c in chunks], -1)
        batch = {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": bf(aux),
                 "hidden_state": bf(out.last_hidden_state)}
        _, m = ttt_loss(draft, batch, head, ttt_length)
        a = m["acc"]
        res[name] = {"acc_per_step": [round(x, 4) for x in a],
                     "proxy_accept_length": round(1 + a[0] + a[0] * a[1] + a[0] * a[1] * a[2], 3)}
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=TARGET_DIR)
    ap.add_argument("--draft", type=Path, default=DRAFT_DIR)
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    seed_everything(0, 2)
    dev = pick_device(a.device)
    from transformers import AutoTokenizer

    from e3f_models.target import greedy_continue, load_target
    tok = AutoTokenizer.from_pretrained(str(a.target))
    prompts = [tok(t)["input_ids"] for t in json.loads(PROMPTS_FILE.read_text())["prompts"]][: a.num]
    model = load_target(a.target).to(dev)
    gens = greedy_continue(model, prompts, a.new_tokens, batch_size=16, stop_at_eos=False)
    seqs = [(p + g, [0] * len(p) + [1] * len(g)) for p, g in zip(prompts, gens)]
    draft, head = load_draft(a.draft, a.target)
    res = fault_table(draft, head, model, seqs)
    width = max(map(len, res))
    for k, v in res.items():
        print(f"{k:{width}s}  acc/step {v['acc_per_step']}  proxy accept length "
              f"{v['proxy_accept_length']}")
    if a.json:
        draft_name = os.path.relpath(a.draft.resolve(), REPO_ROOT)
        write_json(a.json, {"draft": draft_name, "device": str(dev), "prompts": len(seqs),
                            "new_tokens": a.new_tokens, "faults": res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
