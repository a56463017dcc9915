"""Cache state as a condition: the same prompts measured cold (the prefix cache flushed before each request) and

* ``radix_hit`` (cheap, the live server): each prompt sent once to fill the prefix cache (one token), then measured
  with its whole prompt but the last token served from the cache. SGLang 0.5.23 matches the new request against the
  radix tree (``sglang/srt/mem_cache/radix_cache.py::RadixCache.match_prefix``) and reuses the KV of the matched
  slots for the target *and* the draft: the EAGLE draft's KV pool is indexed by the same ``req_to_token`` slots
  (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker``, the draft runner built with the target's
  ``req_to_token_pool``), so a draft KV that is not what the draft would compute for those tokens (a hierarchical
  cache or a storage backend restoring only the target's KV; a draft slot written one position off) costs accepted
  tokens only on a hit. The answer's ``meta_info.cached_tokens`` says the hit happened
  (``sglang/srt/managers/schedule_batch.py::Req.cached_tokens``); a measured arm with no cached token is no evidence
  and the probe says so.
* ``chunked_prefill`` (restart): a restarted copy of the server with a prefill chunk shorter than the prompts
  (SGLang ``--chunked-prefill-size``, ``sglang/srt/managers/scheduler.py`` splitting an extend into chunks; the
  draft's extend must keep the aux states and the shifted input ids across each border), measured on the same
  prompts, cold.

On vLLM 0.32.0 (the adapter's ``prefix_cache_off`` / ``prefix_hit_tokens`` / ``chunked_prefill_flags``) the prefix
cache is on by default and the EAGLE draft's attention layers are KV cache layers of the same manager (its KV cache
groups, ``v1/core/kv_cache_coordinator.py::KVCacheCoordinator.__init__``: ``eagle_group_ids``), so a hit reuses the
draft's KV with the target's; a hit covers whole blocks (128 tokens on the CPU backend) and the last
matched block is recomputed for the draft (``v1/core/single_type_kv_cache_manager.py::FullAttentionManager.
find_longest_cache_hit``): prompts shorter than two blocks and a token get no hit, and the probe says so instead of
measuring. ``usage.prompt_tokens_details.cached_tokens`` needs ``--enable-prompt-tokens-details`` (the embedded
server sets it). A chunk is ``--max-num-batched-tokens`` with one sequence.

Greedy at temperature 0 on both arms, one request at a time (the batch a request shares changes kernels, not the
tokens' order): a clean engine gives the same verify steps per prompt, so the loss (cold minus condition, paired per
prompt, :func:`helpers.investigation.probes.base.paired_condition_loss`) is an exact identity; a fault of the
condition shows as a loss with its CI.
"""
from __future__ import annotations

from typing import Callable, Optional

import pandas as pd

from ...diagnosis.detectors import finding
from ...draft.simulate import summary
from .base import Probe, ProbeContext, ProbeResult, paired_condition_loss, send_greedy


#: why the cache probes apply to an MTP / NextN head as they are (SGLang 0.5.23)
MTP_KV = ("the head's KV is its own decoder layer's (sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN: one "
          "DeepseekV2DecoderLayer, layer id 0 of the draft runner's MLA pool), allocated on the target's "
          "req_to_token slots (sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.alloc_memory_pool): a prefix "
          "hit reuses it with the target's, as an EAGLE-3 draft's")


def cold_arm(ctx: ProbeContext) -> tuple[pd.DataFrame, list[list[int]]]:
    """The live prompts measured cold on the server: ``/flush_cache`` before each request, greedy, one at a time;
    ``(per-request frame, output ids per prompt)``. Kept in ``ctx.extra["cold"]`` so the probes of one run share it
    (one cold arm per run: the conditions are compared with the same answers)."""
    if "cold" in ctx.extra:
        return ctx.extra["cold"]
    ctx.progress(f"engine state: cold arm: {len(ctx.prompts)} prompts x {ctx.max_new_tokens} tokens, the prefix "
                 "cache flushed before each")
    rows, outs = [], []
    for i, p in enumerate(ctx.prompts):
        ctx.client.flush_cache()
        row, out, _ = send_greedy(ctx.client, ctx.adapter, i, p, ctx.max_new_tokens)
        rows.append(row)
        outs.append(out)
    ctx.extra["cold"] = (pd.DataFrame(rows), outs)
    return ctx.extra["cold"]


def on_copy(ctx: ProbeContext, folder, *, what: str, flags: Optional[dict] = None, draft=None,
            env: Optional[dict] = None, then: Optional[Callable[[ProbeContext], None]] = None) -> pd.DataFrame:
    """The live prompts' cold arm (:func:`cold_arm`) measured on a restarted copy of the server (the engine adapter's
    ``start_variant``: ``flags``, ``env``, another ``draft``; its log ``folder/server.log`` and capture hooks under
    ``folder``), the copy stopped whatever happens. ``then(sub)``: more requests on the copy after the cold arm
    (``sub``: the copy's context). Raises what the start and the requests raise (``ServerError``: the probe is
    ``failed``)."""
    ctx.progress(f"engine state: starting {what} ...")
    handle = ctx.adapter.start_variant(ctx.att.restart, draft=draft, flags=flags, capture_dir=folder / "capture",
                                       api_key=ctx.api_key, port=ctx.port, log_path=folder / "server.log",
                                       budget=ctx.dl, what=what, env=env)
    try:
        client = ctx.adapter.client(handle.url, ctx.api_key, timeout=ctx.client.timeout, budget=ctx.dl)
        try:
            sub = ProbeContext(client=client, adapter=ctx.adapter, att=ctx.att, run_dir=ctx.run_dir,
                               prompts=ctx.prompts, max_new_tokens=ctx.max_new_tokens, dl=ctx.dl,
                               progress=ctx.progress)
            frame, _ = cold_arm(sub)
            if then is not None:
                then(sub)
        finally:
            client.close()
    finally:
        handle.stop()
    return frame


def warm_arm(ctx: ProbeContext) -> pd.DataFrame:
    """The live prompts measured with their prefix in the prefix cache: the cache flushed once, then each prompt sent
    for one token (its KV fills the cache) and sent again greedy for ``max_new_tokens`` (served from the cache:
    ``cached_tokens`` of the answer); the per-request frame of the second sends
    (:data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS`)."""
    ctx.client.flush_cache()
    rows = []
    for i, p in enumerate(ctx.prompts):
        send_greedy(ctx.client, ctx.adapter, i, p, 1)        # fills the prefix cache with the prompt's KV
        rows.append(send_greedy(ctx.client, ctx.adapter, i, p, ctx.max_new_tokens)[0])
    return pd.DataFrame(rows)


def _radix_applies(ctx: ProbeContext) -> Optional[str]:
    off = ctx.adapter.prefix_cache_off(ctx.client.server_info())
    if off:
        return off
    if ctx.max_new_tokens < 2:
        return "fewer than 2 tokens per request: no verify step to count"
    return None


def _radix_run(ctx: ProbeContext) -> ProbeResult:
    # the cold arm: the acceptance budget's live answers of the same prompts when the run has them (greedy, the
    # prefix cache flushed before each, one at a time: this probe's own cold arm in all but the aux states they also
    # returned, which SGLang copies out of the forward and the draft never reads back), else measured here
    ids = {p.id for p in ctx.prompts}
    given = ctx.cold if ctx.cold is not None and len(ctx.cold) and "prompt_id" in ctx.cold else None
    if given is not None and ids <= set(given["prompt_id"]):
        cold = given[given["prompt_id"].isin(ids)].reset_index(drop=True)
        ctx.extra["cold_source"] = "the acceptance budget's live answers (cache flushed before each)"
    else:
        cold, _ = cold_arm(ctx)
        ctx.extra["cold_source"] = "measured by the probe (cache flushed before each)"
    expected = _expected_hits(ctx, cold)
    if expected is not None and max(expected) == 0:
        n = int(cold["prompt_tokens"].max())
        return ProbeResult(RADIX_HIT.name, RADIX_HIT.cost, RADIX_HIT.condition, status="skipped",
                           why=f"{ctx.adapter.label} serves no token of these prompts from its prefix cache: the "
                               f"longest has {n} tokens, a resent prompt needs {_shortest_hit(ctx)} for a hit "
                               "(whole cache blocks, the last one recomputed for the EAGLE draft)")
    ctx.progress(f"engine state: radix hit: {len(ctx.prompts)} prompts, each sent once to fill the cache, then "
                 "measured with its prefix cached")
    warm = warm_arm(ctx)
    folder = ctx.folder("radix_hit")
    cold.to_parquet(folder / "cold.parquet")
    warm.to_parquet(folder / "radix_hit.parquet")
    return condition_result(RADIX_HIT, ctx, cold, warm, folder, "radix_hit",
                            basis="the same prompts cold (flushed) vs their prefix in the radix cache, paired per "
                                  "prompt, greedy",
                            cached_rule=True, extra={"cold_arm": ctx.extra["cold_source"],
                                                     "expected_cached_tokens": expected})


def _expected_hits(ctx: ProbeContext, cold: pd.DataFrame) -> Optional[list[int]]:
    """Per cold answer, the prompt tokens the engine serves from its prefix cache when the prompt is sent again
    (``adapter.prefix_hit_tokens``), or None when the adapter does not know its hit granularity."""
    info = ctx.client.server_info()
    n = [int(x) for x in cold["prompt_tokens"].dropna()]
    hits = [ctx.adapter.prefix_hit_tokens(info, k) for k in n]
    return None if not hits or any(h is None for h in hits) else hits


def _shortest_hit(ctx: ProbeContext, limit: int = 1 << 17) -> str:
    """The fewest prompt tokens a resent prompt needs for a prefix hit (words), searched up to ``limit``."""
    info = ctx.client.server_info()
    k = next((k for k in range(2, limit) if (ctx.adapter.prefix_hit_tokens(info, k) or 0) > 0), None)
    return f"{k}" if k is not None else f"more than {limit}"


def condition_result(probe: Probe, ctx: ProbeContext, cold: pd.DataFrame, cond: pd.DataFrame, folder, name: str, *,
                     basis: str, cached_rule: bool = False, extra: Optional[dict] = None) -> ProbeResult:
    """The result of a condition measured on the same prompts as the cold arm: the paired loss, decided; the
    finding ``cache_state_loses_acceptance`` when it counts. ``cached_rule``: the condition is a prefix hit, so a
    measured arm without a cached token is no evidence (undecided, saying so)."""
    loss = paired_condition_loss(name, cold, cond, basis)
    ok = cond["verify_ct"].fillna(0) > 0
    reported = cond.loc[ok, "cached_tokens"].notna() if "cached_tokens" in cond else pd.Series([], dtype=bool)
    cached = [int(x) for x in cond.loc[ok, "cached_tokens"].fillna(0)] if "cached_tokens" in cond else []
    ev = {"cold_accept_length": _al(cold), "condition_accept_length": _al(cond), "prompts": int(len(cond)),
          "failed": int(cond["error"].notna().sum()), "saved_to": str(folder.relative_to(ctx.run_dir)),
          **(extra or {})}
    if cached_rule:
        ev["cached_tokens"] = {"min": min(cached, default=0), "max": max(cached, default=0),
                               "prompts_with_hit": sum(1 for c in cached if c > 0)}
    res = ProbeResult(probe.name, probe.cost, probe.condition, decision=loss["decision"], loss=loss, evidence=ev,
                      saved_to=[ev["saved_to"]])
    if not ok.any():                        # the server answered none of the condition's requests
        errors = cond["error"].dropna()
        res.status, res.decision = "failed", None
        res.why = (f"no request of the condition was answered with spec counters"
                   + (f" (first error: {errors.iloc[0]})" if len(errors) else ""))
        return res
    if cached_rule and ev["cached_tokens"]["prompts_with_hit"] == 0:
        text = ("no measured request was served from the prefix cache (meta_info.cached_tokens 0): the hit did not "
                "happen") if reported.any() else (
                "the server's answers carry no cached-token count (vLLM reports usage.prompt_tokens_details."
                "cached_tokens only with --enable-prompt-tokens-details): whether the hit happened is unknown")
        loss.update(decision="undecided", counts=False, settle={"n": None, "text": text})
        res.decision = "undecided"
        return res
    if loss["decision"] == "counts":
        res.findings.append(finding(
            "cache_state_loses_acceptance", None,
            f"{probe.condition}: accept length {ev['condition_accept_length']:.2f} against {ev['cold_accept_length']:.2f} "
            f"cold on the same {loss['n']} prompts, {loss['delta']:.2f} [{loss['ci'][0]:.2f}, {loss['ci'][1]:.2f}] "
            "tokens per verify step lost",
            condition=probe.name, loss=loss, probe=ev,
            source=f"engine-state probe {probe.name}: the same greedy prompts measured on the server cold and "
                   f"{probe.condition} (helpers.investigation.probes.cache)"))
    return res


def _al(df: pd.DataFrame) -> Optional[float]:
    ok = df[df["verify_ct"].fillna(0) > 0]
    return None if not len(ok) else float(summary(ok, 1)["accept_length"])


def _chunk_size(cold: pd.DataFrame, least: int = 2) -> Optional[int]:
    """A prefill chunk shorter than every measured prompt (half the shortest, at least ``least`` and 2 tokens), or
    None. ``least``: the tokens one verify step schedules (the server's draft tokens + 1): a budget below it would
    trim the drafts of every step (vLLM's token budget is the chunk, ``Scheduler.schedule``), a loss of its own."""
    n = cold["prompt_tokens"].dropna()
    if not len(n) or int(n.min()) < 4:
        return None
    size = max(2, int(least), int(n.min()) // 2)
    return size if size < int(n.min()) else None


def _chunked_applies(ctx: ProbeContext) -> Optional[str]:
    if ctx.adapter.chunked_prefill_flags(16) is None:
        return f"{ctx.adapter.label}'s chunked-prefill flag was not read by this tool"
    return None


def _chunked_run(ctx: ProbeContext) -> ProbeResult:
    cold, _ = cold_arm(ctx)
    steps = int((getattr(ctx.att, "spec", None) or {}).get("num_steps") or 0)
    size = _chunk_size(cold, steps + 1)
    if size is None:
        return ProbeResult(CHUNKED_PREFILL.name, CHUNKED_PREFILL.cost, CHUNKED_PREFILL.condition, status="skipped",
                           why=f"the prompts are too short to split (fewer than {max(4, steps + 2)} tokens: a chunk "
                               f"holds at least the {steps + 1} tokens of a verify step)")
    flags = ctx.adapter.chunked_prefill_flags(size)
    folder = ctx.folder("chunked_prefill")
    cond = on_copy(ctx, folder, flags=flags, what="the chunked-prefill copy (--engine-probes all)")
    cold.to_parquet(folder / "cold.parquet")
    cond.to_parquet(folder / "chunked_prefill.parquet")
    return condition_result(CHUNKED_PREFILL, ctx, cold, cond, folder, "chunked_prefill",
                            basis=f"the same prompts cold on the server vs on a copy prefilling {size}-token chunks, "
                                  "paired per prompt, greedy",
                            extra={"chunk_tokens": size, "flags": flags})


RADIX_HIT = Probe("radix_hit", "cheap", "with the prompt's prefix in the radix cache",
                  "does the draft accept less when the prompt's KV comes from the prefix cache?", _radix_run,
                  applies=_radix_applies,
                  estimate_s=lambda ctx: 3.0 + 0.1 * len(ctx.prompts) * ctx.max_new_tokens, part="cache state",
                  mtp_why=MTP_KV)
CHUNKED_PREFILL = Probe("chunked_prefill", "restart", "with the prompt prefilled in chunks shorter than it",
                        "does the draft accept less when the prompt crosses prefill chunk borders?", _chunked_run,
                        applies=_chunked_applies,
                        estimate_s=lambda ctx: 90.0 + 0.05 * len(ctx.prompts) * ctx.max_new_tokens, part="cache state",
                        mtp_why=MTP_KV + "; its prefill extend feeds the head the ids shifted left by one across each "
                                "chunk as for EAGLE (NEXTN runs as EAGLE: eagle_worker_v2.py::EagleDraftWorker."
                                "_draft_extend_for_prefill)")
