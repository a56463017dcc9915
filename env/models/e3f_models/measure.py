"""Greedy generation against a running SGLang server and EAGLE-3 acceptance summaries.

Definitions (DESIGN.md "Words"; computed by ``helpers.acceptance.stats.accept_length`` / ``accept_rate``, the suite's
one implementation; SpecForge ``benchmarks/benchmarker/utils.py::compute_metrics``):
  accept length = sum(completion_tokens) / sum(spec_verify_ct): tokens emitted per verify step,
                  bonus token included (the prefill-sampled first token is counted too);
  accept rate   = sum(spec_num_correct_drafts) / sum(spec_num_proposed_drafts) (drafts only;
                  falls back to spec_verify_ct * (num_draft_tokens - 1) when a field is absent).
``meta_info`` field names are SGLang 0.5.23's (shared/reference/sglang-facts.md section 1).
"""
from __future__ import annotations

import json
import time
import urllib.request


def generate(url: str, input_ids: list[int], max_new_tokens: int, ignore_eos: bool = True,
             timeout: float = 600.0) -> dict:
    """One greedy (temperature 0) ``/generate`` call with token ids; returns the response plus
    ``wall_s`` (client-side latency in seconds)."""
    payload = {"input_ids": list(map(int, input_ids)),
               "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0,
                                   "ignore_eos": bool(ignore_eos)}}
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        res = json.loads(r.read())
    res["wall_s"] = time.perf_counter() - t
    return res


def run_prompts(url: str, prompts: list[list[int]], max_new_tokens: int, warmup: bool = True,
                progress: bool = True) -> list[dict]:
    """Send prompts one at a time (batch size 1). Returns per-request records: ``output_ids``,
    ``completion_tokens``, ``wall_s`` and the ``spec_*`` meta_info fields when present."""
    from tqdm import tqdm
    if warmup:  # first request pays lazy initialisation; not counted
        generate(url, prompts[0], 4)
    out = []
    for p in tqdm(prompts, desc="generate", disable=not progress, mininterval=5):
        r = generate(url, p, max_new_tokens)
        mi = r["meta_info"]
        rec = {"prompt_tokens": mi.get("prompt_tokens"), "completion_tokens":
               mi["completion_tokens"], "output_ids": r["output_ids"], "wall_s": r["wall_s"]}
        for k, v in mi.items():
            if k.startswith("spec_"):
                rec[k] = v
        out.append(rec)
    return out


def summarize(records: list[dict], num_draft_tokens: int = 4) -> dict:
    """Aggregate per-request records: tokens, tok/s (sum tokens / sum latency, batch size 1) and,
    for speculative runs, accept length, accept rate and the correct-drafts histogram."""
    tokens = sum(r["completion_tokens"] for r in records)
    wall = sum(r["wall_s"] for r in records)
    s = {"requests": len(records), "completion_tokens": tokens, "wall_s": round(wall, 3),
         "tok_per_s": tokens / wall if wall else None}
    verify = sum(r.get("spec_verify_ct", 0) for r in records)
    if verify:
        correct = sum(r.get("spec_num_correct_drafts", r.get("spec_accepted_drafts", 0))
                      for r in records)
        proposed = sum(r.get("spec_num_proposed_drafts",
                             r.get("spec_verify_ct", 0) * (num_draft_tokens - 1))
                       for r in records)
        hist: list[int] = []
        for r in records:
            h = r.get("spec_correct_drafts_histogram") or r.get("spec_accept_histogram") or []
            hist += [0] * (len(h) - len(hist))
            for i, c in enumerate(h):
                hist[i] += c
        from helpers.acceptance.stats import accept_length, accept_rate   # the suite's one definition

        rate = accept_rate([correct], [proposed])
        s.update({"spec_verify_ct": verify, "accept_length": accept_length([tokens], [verify]),
                  "accept_rate": None if rate != rate else rate,
                  "correct_drafts": correct, "proposed_drafts": proposed,
                  "correct_drafts_histogram": hist,
                  "per_request_accept_length_mean":
                      sum(r["completion_tokens"] / r["spec_verify_ct"] for r in records
                          if r.get("spec_verify_ct")) / len(records)})
    return s
