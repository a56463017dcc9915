"""Accept length of the Kimi-class target's own NextN / MTP head on the embedded SGLang server, and token parity.

For each ``--tp`` and ``--steps`` (one server each, ``--speculative-algorithm NEXTN`` with no draft path: SGLang loads
the draft from the target's extra layer ``model.layers.8.*``; topk 1, draft tokens steps + 1), greedy, the first
``--num`` bundled prompts x ``--new-tokens`` tokens (EOS ignored): accept length and accept rate with 95 % bootstrap
CIs (:func:`helpers.acceptance.measure.measure`: accept length = completion tokens / verify steps, bonus included),
the server's start time, and whether the output tokens equal HF transformers' greedy output of the target alone (fp32).
``--draft DIR`` serves a separate NextN checkpoint instead (:func:`helpers.formats.nextn.export_nextn`).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_nextn.py --tp 1 2 --steps 1 3
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.acceptance.measure import measure  # noqa: E402
from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.server.embedded import start  # noqa: E402
from helpers.server.settings import SpecSettings  # noqa: E402

KIMI_TARGET = ROOT / "env" / "models" / "kimi" / "target"


def hf_greedy(target: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """HF transformers' greedy continuation (fp32, the target alone) of each prompt, ``n`` tokens, EOS ignored."""
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            g = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
            out.append(g[0, len(ids):].tolist())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--target", type=Path, default=KIMI_TARGET)
    ap.add_argument("--draft", type=Path, default=None, help="a separate NextN checkpoint (default: the target's layer)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--num", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(args.target))
    prompts = [list(p.input_ids) if p.input_ids else tok(p.text)["input_ids"] for p in load_prompts(None, n=args.num)]
    ref = hf_greedy(args.target, prompts, args.new_tokens)
    rows = []
    load0 = os.getloadavg()
    for tp in args.tp:
        for steps in args.steps:
            spec = SpecSettings(algorithm="NEXTN", num_steps=steps, topk=1, num_draft_tokens=steps + 1)
            t0 = time.monotonic()
            with start(args.target, args.draft, tp=tp, spec=spec, timeout=1200) as srv:
                start_s = time.monotonic() - t0
                res = measure(srv.url, [{"input_ids": p} for p in prompts], max_new_tokens=args.new_tokens,
                              ignore_eos=True, keep_raw=True, progress=False, warmup=1)
                import httpx
                same = 0
                for p, r in zip(prompts, ref):
                    body = {"input_ids": p, "sampling_params": {"max_new_tokens": args.new_tokens, "temperature": 0,
                                                                "ignore_eos": True}}
                    got = httpx.post(srv.url + "/generate", json=body, timeout=600).json()["output_ids"]
                    same += got == r
            s = res.summary
            row = {"tp": tp, "steps": steps, "draft_tokens": steps + 1, "start_s": round(start_s, 1),
                   "accept_length": s["accept_length"],
                   "accept_length_ci": [round(s["accept_length_lo"], 3), round(s["accept_length_hi"], 3)],
                   "accept_rate": s["accept_rate"],
                   "accept_rate_ci": [round(s["accept_rate_lo"], 3), round(s["accept_rate_hi"], 3)],
                   "tokens_equal_hf": f"{same}/{len(prompts)}"}
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)
    print(f"load average before {load0}, after {os.getloadavg()}")
    print("| TP | steps | draft tokens | accept length [95 % CI] | accept rate [95 % CI] | tokens = HF greedy | start s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['tp']} | {r['steps']} | {r['draft_tokens']} | {r['accept_length']:.3f} {r['accept_length_ci']} | "
              f"{r['accept_rate']:.3f} {r['accept_rate_ci']} | {r['tokens_equal_hf']} | {r['start_s']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
