"""Where SGLang's STANDALONE oracle (the target drafting for itself, the ``oracle`` engine-state probe) loses its
tokens: one embedded SGLang server (reference Llama target, TP 1, fp32, steps 3 / topk 1 / 4 draft tokens) with
``--speculative-algorithm STANDALONE`` and the target's folder as ``--speculative-draft-model-path``, the recording
hook of ``bench/oracle_rows_hook.py`` on both models' ``logits_processor``; greedy answers of ``--prompts`` bundled
prompts one at a time; then, offline with the target in HF transformers (fp32):

* the live accept length per prompt (``completion_tokens / spec_verify_ct``) against two simulated chains of the same
  greedy answer, verified by its greedy tokens: ``aligned`` (the draft runs the target on the whole sequence: a
  perfect draft) and ``rotated`` (the draft runs the target on the sequence without its first token, the BOS: what
  ``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill`` feeds any draft, ids
  rotated left by one, and ``_draft_extend_for_decode`` after each verify, the target's next tokens at the verify
  window's positions);
* the hook's rows: the draft's prefill extend (``EagleDraftExtendInput``) input ids and positions against the prompt,
  its last row's logits against HF on the whole sequence and on the sequence without its first token (max abs diff);
  the target's own prefill (no spec input) against HF on the prompt; row 0 of every draft extend after a verify
  (``DRAFT_EXTEND_V2``) against the answer's token at its position and the one after; the draft's and target's
  dtype and attention backend;
* at each simulated first mismatch of the rotated chain: the rotated draft's margin (its proposal's logit minus the
  target's greedy token's) and the target's own top-1 margin there.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_oracle_floor.py --prompts 12 --max-new-tokens 32

Prints the figures and writes ``<out>/oracle-floor.json``; record them in bench/RESULTS.md with the date and load.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.investigation.probes.oracle import _ci, perfect_accept_length  # noqa: E402
from helpers.paths import REFERENCE_TARGET  # noqa: E402
from helpers.server import embedded  # noqa: E402
from helpers.server.client import SGLangClient  # noqa: E402
from helpers.server.settings import SpecSettings  # noqa: E402


def hook_spec(out_dir: Path) -> list[dict]:
    return [{"name": "e3f-oracle-rows", "target_modules": ["logits_processor"],
             "hook_factory": "bench.oracle_rows_hook:factory", "config": {"out_dir": str(out_dir)}}]


class Target:
    """The target in HF transformers (fp32), logits of the last position of a token list."""

    def __init__(self, folder: Path):
        from transformers import AutoModelForCausalLM
        torch.set_num_threads(1)
        self.m = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    @torch.no_grad()
    def last(self, ids: list[int]) -> torch.Tensor:
        return self.m(torch.tensor([ids])).logits[0, -1].float()


def draft_view(ctx: list[int], mode: str, cached: Optional[list[int]] = None) -> list[int]:
    """What the draft runs on for a context ``ctx`` (the tokens whose next one it proposes): ``aligned`` all of it;
    ``rotated`` all but the first (draft position p holds token p + 1); ``rotated_cached``: as rotated, but the draft
    rows of a prefix-cache hit are ``cached`` (per cached position, the token the request that wrote that slot had
    at the next position: the radix tree's keys are the tokens, not the pairs the draft's rows hold)."""
    if mode == "aligned":
        return ctx
    if mode == "rotated" or not cached:
        return ctx[1:]
    return list(cached) + ctx[len(cached) + 1:]


def simulate(t: Target, prompt: list[int], answer: list[int], steps: int, mode: str,
             cached: Optional[list[int]] = None) -> dict:
    """The chain a draft proposes (greedy, ``steps`` tokens per verify step, on :func:`draft_view`) and the greedy
    verify of ``answer``: verify steps and, per first mismatch, (answer index, draft step, draft margin, target
    margin, max |draft - target logits|)."""
    s = prompt + answer
    end, c, verify, miss = len(s), len(prompt) + 1, 0, []
    while c < end:
        verify += 1
        d: list[int] = []
        for _ in range(steps):
            ctx = s[:c] + d
            d.append(int(t.last(draft_view(ctx, mode, cached)).argmax()))
        a = 0
        while a < steps and c + a < end and d[a] == s[c + a]:
            a += 1
        if a < steps and c + a < end:
            ctx = s[:c] + d[:a]
            dl, tl = t.last(draft_view(ctx, mode, cached)), t.last(ctx)
            top2 = tl.topk(2).values
            miss.append({"answer_index": c + a - len(prompt), "draft_step": a + 1,
                         "draft_margin": float(dl[d[a]] - dl[s[c + a]]),
                         "target_top1_margin": float(top2[0] - top2[1]),
                         "max_abs_logit_diff": float((dl - tl).abs().max())})
        c += a + 1
    return {"verify": verify, "accept_length": len(answer) / verify, "mismatches": miss}


def load_calls(folder: Path) -> list[dict]:
    return [torch.load(p, weights_only=True) for p in sorted(folder.glob("call*.pt"))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-oracle-floor"))
    ap.add_argument("--extra", default="", help="further sglang flags of the server, space separated, e.g. "
                    "--disable-radix-cache")
    ap.add_argument("--analyse-only", action="store_true", help="reuse <out>/rows and <out>/live.json")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_dir = out / "rows"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(REFERENCE_TARGET)
    prompts = [tok(p.text)["input_ids"] for p in load_prompts(None)[: a.prompts]]
    spec = SpecSettings(algorithm="STANDALONE", num_steps=a.steps, topk=1, num_draft_tokens=a.steps + 1)
    if a.analyse_only:
        saved = json.loads((out / "live.json").read_text())
        live, info, server_s = saved["live"], saved["info"], saved["server_s"]
    else:
        live, info, server_s = serve(a, prompts, spec, rows_dir, out)
    analyse(a, out, prompts, live, info, server_s, load_calls(rows_dir))
    return 0


def serve(a, prompts, spec, rows_dir: Path, out: Path):
    shutil.rmtree(rows_dir, ignore_errors=True)
    rows_dir.mkdir(parents=True)
    t0 = time.monotonic()
    srv = embedded.start(REFERENCE_TARGET, REFERENCE_TARGET, tp=1, spec=spec, forward_hooks=hook_spec(rows_dir),
                         extra_args=a.extra.split(),
                         log_path=out / "server.log", timeout=600)
    live = []
    try:
        client = SGLangClient(srv.url)
        info = client.server_info()
        for ids in prompts:
            r = client.generate(input_ids=ids, max_new_tokens=a.max_new_tokens, timeout=300)
            live.append({"answer": list(r.output_ids), "completion": r.meta_info.completion_tokens,
                         "verify": r.meta_info.spec_verify_ct})
    finally:
        srv.stop()
    server_s = time.monotonic() - t0
    (out / "live.json").write_text(json.dumps({"live": live, "info": info, "server_s": server_s}))
    return live, info, server_s


def analyse(a, out: Path, prompts, live, info, server_s, calls) -> None:
    t = Target(REFERENCE_TARGET)

    # the hook's rows, in call order (requests ran one at a time; the server's own warm-up request came first): a
    # request's calls run from its target prefill (EXTEND, no spec input, input ids = the prompt) to the next one
    req_of, k = [], None
    for c in calls:
        if c["mode"] == "EXTEND" and c["spec"] == "None":
            ids, h = c["input_ids"].tolist(), int(c["positions"][0])  # a prefix-cache hit of h tokens extends the rest
            k = next((i for i, p in enumerate(prompts) if p[h:] == ids and len(p) == h + len(ids)), None)
        req_of.append(k)
    # per request: the prefix-cache hit h (its target prefill's first position) and the token the draft row at
    # position h - 1 holds: the radix tree keeps the slots of the first request that computed that position (a later
    # duplicate is freed), whose draft row there holds *its* token of position h (rotated). Requests in call order,
    # the server's own (warm-up, health check) included with the prefill they ran.
    seen: list[tuple[list[int], int]] = []  # (sequence, hit) of each request, in order
    hits, stales = {}, {}
    for j, (c, k) in enumerate(zip(calls, req_of)):
        if not (c["mode"] == "EXTEND" and c["spec"] == "None"):
            continue
        h = int(c["positions"][0])
        if k is not None:
            seq = prompts[k] + live[k]["answer"]
        else:  # the server's own request: its prefill and the next token (the draft prefill's last id)
            d = next((x for x in calls[j + 1:] if x["mode"] == "EXTEND"), None)
            seq = c["input_ids"].tolist() + ([int(d["input_ids"][-1])] if d is not None and d["spec"] != "None"
                                             else [])
            seq = ([None] * h) + seq if h else seq
        def shares(sq, n):
            return len(sq) >= n and len(seq) >= n and all(a is None or a == b for a, b in zip(sq[:n], seq[:n]))
        # an earlier request sharing more than h tokens with this one is not in the tree (else the hit were longer;
        # SGLang matches at most all but the last prompt token, which must run for the next token's logits)
        if h + 1 < h + len(c["input_ids"]):
            seen = [(sq, hw) for sq, hw in seen if not shares(sq, h + 1)]
        if k is not None and k not in hits:
            hits[k] = h
            rows = []
            for q in range(h):  # the slot of cached position q: the first surviving request that computed it
                w = next((sq for sq, hw in seen if hw <= q and len(sq) > q + 1 and shares(sq, q + 1)), None)
                rows.append(w[q + 1] if w is not None else None)
            stales[k] = rows if h and None not in rows else None
        seen.append((seq, h))
    per = []
    for i, (ids, lv) in enumerate(zip(prompts, live)):
        h = hits.get(i, 0)
        sim = {m: simulate(t, ids, lv["answer"], a.steps, m, stales.get(i))
               for m in ("aligned", "rotated", "rotated_cached")}
        per.append({"prompt_tokens": len(ids), **lv, "live_accept_length": lv["completion"] / lv["verify"],
                    "perfect": perfect_accept_length(lv["completion"], a.steps), "cache_hit": h,
                    "cached_draft_rows": stales.get(i), "stale_rows": None if stales.get(i) is None else sum(
                        int(x != y) for x, y in zip(stales[i], (ids + lv["answer"])[1:h + 1])), "sim": sim})
    pre = []
    for i, (ids, lv) in enumerate(zip(prompts, live)):
        mine = [c for c, k in zip(calls, req_of) if k == i]
        tg = next((c for c in mine if c["mode"] == "EXTEND" and c["spec"] == "None"), None)
        d = next((c for c in mine if c["mode"] == "EXTEND" and c["spec"] == "EagleDraftExtendInput"), None)
        if tg is None or d is None:
            continue
        seq = ids + lv["answer"][:1]
        pre.append({
            "draft_ids_are_prompt_rotated": d["input_ids"].tolist() == seq[1:][int(d["positions"][0]):],
            "draft_ids_are_prompt": d["input_ids"].tolist() == ids[int(d["positions"][0]):],
            "draft_positions_h_to_L-1": d["positions"].tolist() == list(range(int(d["positions"][0]), len(ids))),
            "draft_vs_hf_whole": float((d["logits"][-1] - t.last(seq)).abs().max()),
            "draft_vs_hf_without_first": float((d["logits"][-1] - t.last(seq[1:])).abs().max()),
            "draft_vs_hf_rotated_cached": float((d["logits"][-1] - t.last(
                draft_view(seq, "rotated_cached", stales.get(i)))).abs().max()),
            "target_vs_hf_prompt": float((tg["logits"][-1] - t.last(ids)).abs().max())})
    # row 0 of each draft extend after a verify: its position p holds the answer's token of p + 1 (rotated) or p
    seqs = [ids + lv["answer"] for ids, lv in zip(prompts, live)]
    rot = same = n0 = 0
    for c, k in zip(calls, req_of):
        if c["mode"] != "DRAFT_EXTEND_V2" or k is None:
            continue
        p, tok0, s = int(c["positions"][0]), int(c["input_ids"][0]), seqs[k]
        if p + 1 < len(s):
            n0 += 1
            rot += tok0 == s[p + 1]
            same += tok0 == s[p]
    kinds = sorted({(c["mode"], c["spec"], c["attn"], c["dtype"], c["model"]) for c in calls})

    losses = [r["perfect"] - r["live_accept_length"] for r in per]
    res = {"prompts": len(per), "steps": a.steps, "max_new_tokens": a.max_new_tokens,
           "live_accept_length": sum(r["completion"] for r in per) / sum(r["verify"] for r in per),
           "perfect": float(np.mean([r["perfect"] for r in per])),
           "live_loss_ci": _ci(losses),
           "sim_aligned_accept_length": sum(r["completion"] for r in per) / sum(r["sim"]["aligned"]["verify"]
                                                                                for r in per),
           "sim_rotated_accept_length": sum(r["completion"] for r in per) / sum(r["sim"]["rotated"]["verify"]
                                                                                for r in per),
           "sim_rotated_cached_accept_length": sum(r["completion"] for r in per) / sum(
               r["sim"]["rotated_cached"]["verify"] for r in per),
           "prompts_live_equals_rotated": sum(r["verify"] == r["sim"]["rotated"]["verify"] for r in per),
           "prompts_live_equals_rotated_cached": sum(r["verify"] == r["sim"]["rotated_cached"]["verify"] for r in per),
           "prompts_with_cache_hit": sum(r["cache_hit"] > 0 for r in per), "extra": a.extra,
           "prompts_live_equals_aligned": sum(r["verify"] == r["sim"]["aligned"]["verify"] for r in per),
           "prefill_rows": pre, "draft_extend_v2_row0": {"rows": n0, "holds_token_of_p_plus_1": rot,
                                                         "holds_token_of_p": same},
           "call_kinds": [list(x) for x in kinds], "server_s": server_s,
           "server_spec": {k2: info.get(k2) for k2 in ("speculative_algorithm", "speculative_num_steps",
                                                       "speculative_eagle_topk", "speculative_num_draft_tokens",
                                                       "dtype", "attention_backend",
                                                       "speculative_draft_attention_backend", "page_size")},
           "per_prompt": per}
    (out / "oracle-floor.json").write_text(json.dumps(res, indent=1))
    lo = res["live_loss_ci"]
    print(f"live: {res['live_accept_length']:.2f} of a perfect {res['perfect']:.2f} per verify step "
          f"({lo[0]:.2f} [{lo[1]:.2f}, {lo[2]:.2f}] lost, {len(per)} prompts; server {server_s:.0f} s)")
    print(f"simulated: aligned {res['sim_aligned_accept_length']:.2f}, rotated {res['sim_rotated_accept_length']:.2f},"
          f" rotated_cached {res['sim_rotated_cached_accept_length']:.2f}; verify steps equal per prompt: rotated "
          f"{res['prompts_live_equals_rotated']}/{len(per)}, rotated_cached "
          f"{res['prompts_live_equals_rotated_cached']}/{len(per)}, aligned {res['prompts_live_equals_aligned']}/"
          f"{len(per)}; prompts with a prefix-cache hit {res['prompts_with_cache_hit']} "
          f"(hits {sorted({r['cache_hit'] for r in per})}, stale draft rows per prompt "
          f"{[r['stale_rows'] for r in per]})")
    print(f"draft prefill extend rows: ids = prompt rotated left by one "
          f"{sum(r['draft_ids_are_prompt_rotated'] for r in pre)}"
          f"/{len(pre)}, positions h..L-1 {sum(r['draft_positions_h_to_L-1'] for r in pre)}/{len(pre)}; last-row "
          f"logits max |diff| vs HF whole sequence {max((r['draft_vs_hf_whole'] for r in pre), default=math.nan):.3g}"
          f", vs HF without the first token {max((r['draft_vs_hf_without_first'] for r in pre), default=math.nan):.3g}"
          f", vs HF on the rotated sequence with the cached row "
          f"{max((r['draft_vs_hf_rotated_cached'] for r in pre), default=math.nan):.3g}"
          f"; target prefill vs HF {max((r['target_vs_hf_prompt'] for r in pre), default=math.nan):.3g}")
    print(f"draft extend after verify, row 0: token of p+1 {rot}/{n0}, token of p {same}/{n0}")
    ms = [m for r in per for m in r["sim"]["rotated"]["mismatches"]]
    if ms:
        print(f"rotated mismatches: {len(ms)}; draft margin median {np.median([m['draft_margin'] for m in ms]):.3f}, "
              f"target top-1 margin median {np.median([m['target_top1_margin'] for m in ms]):.3f}, "
              f"max |draft - target logits| median {np.median([m['max_abs_logit_diff'] for m in ms]):.3f}")
    for x in kinds:
        print("call kind:", x)
    print("server:", res["server_spec"])


if __name__ == "__main__":
    raise SystemExit(main())
