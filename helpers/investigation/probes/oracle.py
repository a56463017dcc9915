"""The perfect-draft oracle (``oracle``, restart): a restarted copy of the server whose draft is the target itself
(the adapter's ``oracle_flags``; vLLM 0.32.0: ``speculative_config.method: draft_model``,
``vllm/v1/spec_decode/draft_model.py::DraftModelProposer``; SGLang 0.5.23's STANDALONE algorithm,
``sglang/srt/speculative/spec_info.py::SpeculativeAlgorithm.STANDALONE``: any
model drafts through the EAGLE V2 worker, ``sglang/srt/speculative/eagle_worker_v2.py``, and is verified on the same
path as the EAGLE-3 draft; the copy keeps the server's steps, topk and draft tokens). At temperature 0 a draft that is
the target proposes the target's own greedy tokens, so every verify step should accept all of them: per request the
perfect accept length is ``completion / ceil((completion - 1) / (steps + 1))`` (the first token comes from prefill,
the last step may be cut by ``max_new_tokens``). What the oracle accepts less than that is lost by verification and
the KV path whatever the draft does: the engine stage's floor. A draft and target that disagree only where the two
kernels round differently (draft decode one token at a time, verify in one extend) lose a little even so, and the
STANDALONE path computes the draft with the target's own model class, not the EAGLE-3 draft's: on the embedded CPU
server a clean target at steps 3 accepted 3.66 of 4.00 tokens per verify step on 12 prompts (0.32 [0.15, 0.49] lost),
where the EAGLE-3 draft's engine stage (the draft offline on the served states against live) is an identity. So the
oracle's loss is reported as the engine's floor with its CI (``evidence.floor``), not decided as a stage loss and not a
finding by itself: a floor near the budget's engine loss says the loss is the engine's verification path, one far below
it says the EAGLE-3 draft's own computation (the step trace names where).
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
    how = f"{ctx.adapter.label} " + ", ".join(f"{k} {v}" for k, v in (ctx.adapter.oracle_flags() or {}).items())
    floor = _loss("oracle", d, lo, hi, f"a perfect draft (the target drafting for itself, {how}) against every "
                  f"token accepted, steps {steps}, paired per prompt", ev["perfect_accept_length"], n=len(per),
                  unit="prompts", per_sequence=per)
    ev["floor"] = floor
    return ProbeResult(p.name, p.cost, p.condition, decision=None, evidence=ev, saved_to=[ev["saved_to"]],
                       why=(f"the engine's floor: the target drafting for itself accepts {ev['oracle_accept_length']:.2f} "
                            f"tokens per verify step where every token accepted gives "
                            f"{ev['perfect_accept_length']:.2f} ({d:.2f} [{lo:.2f}, {hi:.2f}] lost on {len(per)} "
                            f"prompts; {how}: a floor, not a stage loss)"))


ORACLE = Probe("oracle", "restart", "with a perfect draft (the target drafting for itself)",
               "does verification accept every token of a draft that is the target itself?", _run, applies=_applies,
               estimate_s=lambda ctx: 90.0 + 0.08 * len(ctx.prompts) * ctx.max_new_tokens, part="verification")
