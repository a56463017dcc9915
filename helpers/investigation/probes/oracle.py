"""The perfect-draft oracle (``oracle``, restart): a restarted copy of the server whose draft is the target itself
(the adapter's ``oracle_flags``; vLLM 0.32.0: ``speculative_config.method: draft_model``,
``vllm/v1/spec_decode/draft_model.py::DraftModelProposer``; SGLang 0.5.23's STANDALONE algorithm,
``sglang/srt/speculative/spec_info.py::SpeculativeAlgorithm.STANDALONE``: any
model drafts through the EAGLE V2 worker, ``sglang/srt/speculative/eagle_worker_v2.py``, and is verified on the same
path as the EAGLE-3 draft; the copy keeps the server's steps, topk and draft tokens). At temperature 0 a draft that is
the target proposes the target's own greedy tokens, so every verify step should accept all of them: per request the
perfect accept length is ``completion / ceil((completion - 1) / (steps + 1))`` (the first token comes from prefill,
the last step may be cut by ``max_new_tokens``). What the oracle accepts less than that is lost by verification and
the KV path whatever the draft does: the engine stage's floor.

Why it stays a floor and is not decided as a stage loss: an engine's self-drafting path need not give its draft the
target's own sequence (the adapter's ``oracle_caveat``, shown in the report). SGLang 0.5.23's does not: the EAGLE V2
worker feeds every draft the EAGLE layout, ids rotated left by one
(``eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill``, ``_draft_extend_for_decode``: draft row p holds
the token of p + 1), so the target drafting for itself runs on the sequence without its first token (the BOS) and
proposes other tokens where the target's top two are close. Measured on the embedded CPU server (reference Llama, TP 1,
fp32, steps 3, 12 prompts x 32 tokens, bench/bench_oracle_floor.py): 3.66 of 4.00 per verify step (0.32 [0.15, 0.49]
lost); the draft's logits equal the target's on the shorter sequence to 5e-6 (its dtype, fp32, and attention backend,
intel_amx, are the target's) and differ from the target's own by up to 1.5; a chain simulated with that draft gives
every prompt's live verify steps exactly (12 of 12), one with the whole sequence gives 4.00: the loss is the draft's
input, not verification's nor KV's. STANDALONE's radix tree is keyed by single tokens while its draft rows hold pairs
(``sglang/srt/mem_cache/kv_cache_builder.py``: ``is_eagle=spec_algorithm.is_eagle()``, STANDALONE excluded), so a
prefix hit also hands a request another request's draft row (3.43 with the cache on the same prompts): the adapter's
flags turn the cache off in the copy. vLLM's draft model drafts on the target's own sequence and accepted 4.00 of 4.00.
So the oracle's loss is reported with its CI as the engine's floor (``evidence.floor``), an upper bound on what
verification and KV lose where the adapter names a caveat: a floor near the budget's engine loss says the loss may be
the engine's path, one far below it says the EAGLE-3 draft's own computation (the step trace names where).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import pandas as pd

from ...draft.budget import _loss
from .base import Probe, ProbeContext, ProbeResult
from .cache import on_copy


def perfect_accept_length(completion: int, steps: int) -> float:
    """Tokens per verify step of a draft every token of which is accepted: ``completion`` tokens, the first from
    prefill, then ``steps + 1`` per verify step (the last one cut short by the request's length)."""
    verify = max(1, math.ceil((completion - 1) / (steps + 1)))
    return completion / verify


def oracle_losses(frame: pd.DataFrame, steps: int) -> list[float]:
    """Per answered request: the perfect accept length minus the oracle's (tokens per verify step; >= 0 when every
    verify step accepted all)."""
    ok = frame[(frame["verify_ct"].fillna(0) > 0) & frame["error"].isna()]
    return [perfect_accept_length(int(c), steps) - int(c) / int(v)
            for c, v in zip(ok["completion_tokens"], ok["verify_ct"])]


def _ci(values: list[float], seed: int = 0, n_boot: int = 2000) -> tuple[float, float, float]:
    v = np.asarray(values, dtype=np.float64)
    rng = np.random.default_rng(seed)
    boots = v[rng.integers(0, len(v), size=(n_boot, len(v)))].mean(axis=1)
    return float(v.mean()), float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


#: why the oracle does not apply to an MTP / NextN head's server (its DeepSeek-V3-family target)
SELF_DRAFT_IS_HEAD = ("the oracle serves the target as its own draft, and SGLang 0.5.23 loads a DeepseekV3ForCausalLM "
                      "draft as DeepseekV3ForCausalLMNextN (sglang/srt/configs/model_config.py::ModelConfig."
                      "_config_draft_model, whatever the algorithm): the copy would draft with the NextN head again, "
                      "not a perfect draft")


def _applies(ctx: ProbeContext) -> Optional[str]:
    if ctx.adapter.oracle_flags() is None:
        return f"{ctx.adapter.label}'s self-drafting algorithm was not read by this tool"
    if getattr(ctx.att, "target_dir", None) is None:
        return "the target folder is not readable here (the oracle serves it as its own draft)"
    if int((ctx.att.spec or {}).get("topk") or 1) != 1:
        return "the server drafts a tree (topk > 1): the oracle's perfect accept length is that of a chain"
    return None


def _run(ctx: ProbeContext) -> ProbeResult:
    p = ORACLE
    steps = int((ctx.att.spec or {}).get("num_steps") or 0)
    folder = ctx.folder("oracle")
    frame = on_copy(ctx, folder, draft=ctx.att.target_dir, flags=ctx.adapter.oracle_flags(),
                    what="the perfect-draft oracle: the target as its own draft (--engine-probes all)")
    frame.to_parquet(folder / "oracle.parquet")
    per = oracle_losses(frame, steps)
    ev = {"steps": steps, "prompts": int(len(frame)), "answered": len(per),
          "saved_to": str(folder.relative_to(ctx.run_dir))}
    if len(per) < 2:
        return ProbeResult(p.name, p.cost, p.condition, status="failed", evidence=ev, saved_to=[ev["saved_to"]],
                           why=f"the oracle answered {len(per)} request(s) with spec counters")
    d, lo, hi = _ci(per)
    ok = frame[frame["verify_ct"].fillna(0) > 0]
    ev["oracle_accept_length"] = float(ok["completion_tokens"].sum() / ok["verify_ct"].sum())
    ev["perfect_accept_length"] = float(np.mean([perfect_accept_length(int(c), steps)
                                                 for c in ok["completion_tokens"]]))
    how = f"{ctx.adapter.label} " + ", ".join(k if v is None else f"{k} {v}"
                                              for k, v in (ctx.adapter.oracle_flags() or {}).items())
    caveat = ctx.adapter.oracle_caveat()
    ev["engine_caveat"] = caveat
    floor = _loss("oracle", d, lo, hi, f"a perfect draft (the target drafting for itself, {how}) against every "
                  f"token accepted, steps {steps}, paired per prompt", ev["perfect_accept_length"], n=len(per),
                  unit="prompts", per_sequence=per)
    ev["floor"] = floor
    return ProbeResult(p.name, p.cost, p.condition, decision=None, evidence=ev, saved_to=[ev["saved_to"]],
                       why=(f"the engine's floor: the target drafting for itself accepts {ev['oracle_accept_length']:.2f} "
                            f"tokens per verify step where every token accepted gives "
                            f"{ev['perfect_accept_length']:.2f} ({d:.2f} [{lo:.2f}, {hi:.2f}] lost on {len(per)} "
                            f"prompts; {how}: a floor, not a stage loss)" + (f"; {caveat}" if caveat else "")))


ORACLE = Probe("oracle", "restart", "with a perfect draft (the target drafting for itself)",
               "does verification accept every token of a draft that is the target itself?", _run, applies=_applies,
               estimate_s=lambda ctx: 90.0 + 0.08 * len(ctx.prompts) * ctx.max_new_tokens, part="verification",
               mtp="no", mtp_why=SELF_DRAFT_IS_HEAD)
