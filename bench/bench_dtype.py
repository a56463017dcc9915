#!/usr/bin/env python
"""How far the offline draft run's results move between float32 and bfloat16 compute, on the reference drafts.

The same draft checkpoint (bf16 weights) is run offline (helpers.draft) once in float32 and once in bfloat16 on the
same inputs; the figure goes into :data:`helpers.draft.precision.FP32_VS_BF16`, the reason the offline run gives when
a CPU without native bf16 makes it compute in float32.

Inputs, per draft:
  * ``training``: its 3 training samples (env/models/data/sample for env/models/draft, data/sample_alt for
    env/models/draft_alt: the aux layers each was trained on), the budget's ``offline, training states`` stage;
  * ``held-out``: the 64 held-out prompts (env/models/prompts.json) continued greedily by the target in float32
    (HF transformers, as the embedded server computes), ``--new-tokens`` tokens each, aux states captured by HF at the
    draft's layers (float32): more rows than the 3 samples.

Printed per (draft, inputs, dtype): the teacher-forced accuracy per draft step (simulate's ``marginal``), the accept
length at ``--speculative-num-steps 3`` (chain) with its CI, and between the two dtypes: the share of rows whose draft
argmax (target id) agrees per teacher-forced step (each dtype following its own hidden chain), the share of requests
whose verify-step count differs, and the largest per-step accuracy difference.

    .venv/bin/python bench/bench_dtype.py [--new-tokens 64] [--prompts 64] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "env" / "models"))

from helpers.draft.budget import training_sequences  # noqa: E402
from helpers.draft.model import Eagle3Draft, target_lm_head  # noqa: E402
from helpers.draft.precision import CpuCapability  # noqa: E402
from helpers.draft.simulate import DraftSettings, SimSequence, simulate_sequences, summary  # noqa: E402
from helpers.formats.configs import read_draft_config  # noqa: E402
from helpers.formats.training_data import TrainingData  # noqa: E402

MODELS = ROOT / "env" / "models"
TARGET = MODELS / "target"
DRAFTS = {"draft": MODELS / "data" / "sample", "draft_alt": MODELS / "data" / "sample_alt"}
STEPS = 3
DTYPES = (torch.float32, torch.bfloat16)


@torch.no_grad()
def teacher_forced_ids(draft: Eagle3Draft, seq: SimSequence, steps: int) -> list[np.ndarray]:
    """Per draft step k, the draft's argmax (target ids) at each continuation row t: step k takes the target's
    token ``y[t+1+k]`` and the hidden state of step k-1 at the same row (the chain
    :func:`helpers.draft.simulate.simulate_sequences` scores as ``marginal``); rows whose step-k input exists."""
    T = int(seq.tokens.shape[0])
    y = (seq.tokens if seq.targets is None else seq.targets).to(torch.long)
    ext = draft.extend(seq.tokens[1:], seq.aux[: T - 1])
    r0 = seq.start - 1
    out = [draft.to_target_ids(ext.logits.argmax(-1))[r0:].numpy()]
    for _, _, logits in draft.ttt_steps(ext, y, steps, r0):
        out.append(draft.to_target_ids(logits.argmax(-1)).numpy())
    return out


def held_out_sequences(draft_dir: Path, n_prompts: int, new_tokens: int) -> list[SimSequence]:
    """The held-out prompts continued greedily by the float32 target, with HF aux states at the draft's layers."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (bench only)

    from e3f_models.capture import hf_capture  # noqa: PLC0415
    from e3f_models.target import greedy_continue, load_target  # noqa: PLC0415
    ids = read_draft_config(draft_dir).raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    tok = AutoTokenizer.from_pretrained(str(TARGET))
    prompts = [tok(t)["input_ids"] for t in json.loads((MODELS / "prompts.json").read_text())["prompts"]][:n_prompts]
    model = load_target(TARGET).eval()
    gens = greedy_continue(model, prompts, new_tokens, batch_size=16, stop_at_eos=False)
    out = []
    for i, (p, g) in enumerate(zip(prompts, gens)):
        toks = torch.tensor(p + g, dtype=torch.long)
        aux, _ = hf_capture(model, toks[None], ids)
        out.append(SimSequence(f"prompt-{i}", toks, aux[0], len(p)))
    return out


def compare(draft_dir: Path, seqs: list[SimSequence]) -> dict:
    """Both dtypes' figures and their agreement on ``seqs``."""
    st = DraftSettings.chain(STEPS)
    res, ids = {}, {}
    for dt in DTYPES:
        d = Eagle3Draft.load(draft_dir, TARGET, dtype=dt)
        t = time.perf_counter()
        sim = simulate_sequences(d, seqs, [st])
        s = summary(sim["per_request"][st], STEPS)
        name = str(dt).removeprefix("torch.")
        res[name] = {"marginal": sim["marginal"], "marginal_rows": sim["marginal_rows"],
                     "accept_length": s["accept_length"],
                     "ci": [s["accept_length_lo"], s["accept_length_hi"]],
                     "verify_ct": sim["per_request"][st]["verify_ct"].tolist(), "seconds": time.perf_counter() - t}
        ids[name] = [teacher_forced_ids(d, q, STEPS) for q in seqs]
    a, b = (str(dt).removeprefix("torch.") for dt in DTYPES)
    agree = []
    for k in range(STEPS):
        same = sum(int((x[k] == y[k]).sum()) for x, y in zip(ids[a], ids[b]) if len(x) > k)
        rows = sum(len(x[k]) for x in ids[a] if len(x) > k)
        agree.append({"rows": rows, "agree": same / rows if rows else float("nan")})
    vc = [(x, y) for x, y in zip(res[a]["verify_ct"], res[b]["verify_ct"])]
    return {"sequences": len(seqs), "dtypes": res, "argmax_agreement": agree,
            "requests_with_other_verify_ct": sum(x != y for x, y in vc),
            "max_marginal_diff": max(abs(x - y) for x, y in zip(res[a]["marginal"], res[b]["marginal"])),
            "accept_length_diff": res[b]["accept_length"] - res[a]["accept_length"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    cap = CpuCapability.detect()
    print(f"[bench_dtype] {cap.describe()}, load {os.getloadavg()}", flush=True)
    head, _ = target_lm_head(TARGET)
    out = {"capability": cap.describe(), "load_avg": os.getloadavg(), "runs": []}
    for name, data in DRAFTS.items():
        draft_dir = MODELS / name
        sets = {"training": training_sequences(TrainingData(data, hidden_size=128), lm_head=head)}
        print(f"[bench_dtype] {name}: greedy continuations of {a.prompts} held-out prompts ...", flush=True)
        sets["held-out"] = held_out_sequences(draft_dir, a.prompts, a.new_tokens)
        for which, seqs in sets.items():
            r = compare(draft_dir, seqs)
            r.update(draft=name, inputs=which)
            out["runs"].append(r)
            f32, b16 = r["dtypes"]["float32"], r["dtypes"]["bfloat16"]
            print(f"[bench_dtype] {name} on {which} ({r['sequences']} sequences, {f32['marginal_rows'][0]} rows):\n"
                  f"  marginal fp32 {[round(x, 4) for x in f32['marginal']]} bf16 "
                  f"{[round(x, 4) for x in b16['marginal']]} (max diff {r['max_marginal_diff']:.4f})\n"
                  f"  accept length fp32 {f32['accept_length']:.3f} [{f32['ci'][0]:.2f}, {f32['ci'][1]:.2f}] bf16 "
                  f"{b16['accept_length']:.3f} [{b16['ci'][0]:.2f}, {b16['ci'][1]:.2f}] "
                  f"(diff {r['accept_length_diff']:+.3f}; {r['requests_with_other_verify_ct']} of {r['sequences']} "
                  "requests with another verify-step count)\n"
                  "  argmax agreement per step " + ", ".join(f"{x['agree']:.4f} of {x['rows']}"
                                                             for x in r["argmax_agreement"]), flush=True)
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
