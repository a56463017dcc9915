"""Cache state with a host-memory tier (``hicache_hit``, restart): the live prompts' prefixes restored from host memory.

A server with a hierarchical prefix cache keeps KV evicted from the device pool in host memory and loads it back when
a request matches it. The EAGLE draft has its own KV pool indexed by the target's slots, so a restore that brings back
the target's KV but not the draft's (the public report: the draft's KV stale after a hierarchical-cache hit restored
only the target's) leaves the draft attending to whatever its slots held before: it loses accepted tokens only on a
host hit, never cold and never on a plain device hit (``radix_hit``).

The probe starts a copy of the server with the host tier on (the engine adapter's ``host_cache_launch``: a small device
pool and a host pool large enough to keep every prompt and filler), measures the live prompts on it cold (the cache
flushed before each: :func:`helpers.investigation.probes.cache.on_copy`), then:

1. flushes once and sends each prompt for one token (its prompt KV enters the prefix cache and is written to host);
2. sends filler prompts (token ids of the cold answers, rotated, sharing no prefix with the prompts beyond their first
   token) for one token each, more tokens in all than the device pool holds, so the prompts' device KV is evicted;
3. sends each prompt again, greedy, ``max_new_tokens`` tokens: its prefix comes back from host memory.

Only prompts whose measured answer says so count as host hits: the answer's ``meta_info.cached_tokens_details.host``
(prompt tokens loaded back from host memory, the server's own split of ``cached_tokens``) must be > 0; the loss (cold
minus host-restored, paired per prompt, :func:`helpers.investigation.probes.base.paired_condition_loss`) is computed
on those prompts alone, and with none the probe is ``undecided`` saying the host path did not happen (or the server
did not say), never ``clear``.

What SGLang 0.5.23 does (read in the installed package):

* ``--enable-hierarchical-cache`` (``sglang/srt/arg_groups/fields/memory.py``) makes the tree cache a
  ``UnifiedRadixCache`` with a HiCache controller (``sglang/srt/mem_cache/registry.py::create_unified_radix_cache`` ->
  ``unified_radix_cache.py::UnifiedRadixCache.init_hicache``); the host pool is ``--hicache-ratio`` x the device pool
  (default 2.0) or ``--hicache-size`` GB, and it must fit the host's free memory less a 10 GiB reserve
  (``sglang/srt/mem_cache/pool_host/base.py::host_memory_budget_bytes``, else the copy fails to start);
  ``--hicache-write-policy write_through`` (default) backs a node up to host once it is inserted
  (``write_through_threshold`` 1: ``sglang/srt/mem_cache/unified_cache/unified_tree_core.py::UnifiedTreeCore.
  _inc_hit_count_and_check``).
* Device eviction (``UnifiedRadixCache._evict_components``, reached from ``evict_for_alloc`` when a new request needs
  device slots) demotes a node already backed up on host (``_demote``: device slots freed, host copy kept;
  ``write_back`` backs it up first, ``_execute_and_commit_kv_backup``). There is no endpoint that evicts the device
  tier alone (``/flush_cache`` empties the whole tree), hence the fillers.
* A request matching a host-only node loads it back before its prefill: ``UnifiedRadixCache.init_load_back`` ->
  ``load_back`` -> ``_load_back_transfers`` -> ``HiCacheController.load`` (``sglang/srt/managers/cache_controller.py``),
  skipped below ``load_back_threshold`` (10 tokens). The EAGLE-3 draft's KV pool rides along as a host *sidecar*
  (``sglang/srt/speculative/base_spec_worker.py::BaseSpecWorker._build_hicache_draft_plan``: ``HiCacheDraftMode.
  SIDECAR`` for EAGLE-3, the first draft runner's pool; ``sglang/srt/mem_cache/kv_cache_builder.py::
  maybe_register_hicache_draft`` registers it; ``UnifiedRadixCache._build_sidecar_transfers`` adds it to every backup
  and load-back): this probe is what shows that restore in the draft's accept length.
* The answer's ``meta_info.cached_tokens_details`` = ``{"device": ..., "host": ...}``
  (``sglang/srt/managers/scheduler_components/output_streamer.py::get_cached_tokens_details``, from
  ``Req.cached_tokens_host``: ``sglang/srt/managers/schedule_batch.py`` ``split_cached_prefix_by_tier`` with
  ``req.materialized_host_hit_len()``, computed once at the request's first prefill chunk).
* On a CPU server HiCache cannot start: the host pool pins its buffer with CUDA
  (``sglang/srt/mem_cache/pool_host/common.py::alloc_with_host_register`` -> ``_cuda_host_register`` ->
  ``torch.cuda.cudart()``, ``MHATokenToKVPoolHost`` is built with ``pin_memory=True``), and its host<->device transfer
  ops (``transfer_kv_*``) are bound only on CUDA / ROCm (``sgl_kernel.kvcacheio``) and XPU
  (``sglang/srt/mem_cache/pool_host/mha.py``, module level): the probe is skipped there (the adapter says why).
"""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd

from .base import Probe, ProbeContext, ProbeResult, send_greedy
from .cache import _al, cold_arm, condition_result, on_copy

#: the smallest device pool the copy is given (tokens): room for a few requests with their draft slots
MIN_DEVICE_TOKENS = 1024
#: filler tokens sent for each device-pool token: enough to evict every prompt's device KV (LRU) with margin
FILL_FACTOR = 3
#: the shortest prompt whose host hit SGLang loads back (``UnifiedRadixCache.load_back_threshold`` = 10 tokens)
MIN_PROMPT_TOKENS = 12


def host_tokens(answer: Any) -> Optional[int]:
    """Prompt tokens of one answer (:class:`helpers.server.protocol.GenerateResult`) loaded back from host memory:
    ``meta_info.cached_tokens_details.host`` (SGLang 0.5.23, ``output_streamer.py::get_cached_tokens_details``),
    0 when the answer says no token was cached at all (``cached_tokens`` 0, the details omitted), None when the
    server does not say."""
    if answer is None:
        return None
    meta = answer.meta_info
    details = (meta.model_extra or {}).get("cached_tokens_details")
    if isinstance(details, dict) and details.get("host") is not None:
        return int(details["host"])
    return 0 if meta.cached_tokens == 0 else None


def sizes(prompt_tokens: list[int], max_new_tokens: int) -> dict:
    """The copy's pools (tokens) for prompts of ``prompt_tokens`` tokens answered with ``max_new_tokens`` tokens:
    ``device`` (the device KV pool: at least :data:`MIN_DEVICE_TOKENS` and 4 x the longest request), ``filler``
    (tokens of filler prompts: :data:`FILL_FACTOR` x the device pool), ``filler_len`` (tokens per filler: a quarter of
    the device pool) and ``host`` (the host pool: every prompt and filler twice over)."""
    longest = max(prompt_tokens) + max_new_tokens + 64
    device = max(MIN_DEVICE_TOKENS, 4 * longest)
    filler = FILL_FACTOR * device
    return {"device": device, "filler": filler, "filler_len": device // 4,
            "host": 2 * (sum(prompt_tokens) + len(prompt_tokens) * max_new_tokens + filler)}


def fillers(outputs: list[list[int]], total: int, length: int) -> list[list[int]]:
    """Filler prompts (token-id lists) of ``length`` tokens, ``total`` tokens in all, drawn from ``outputs`` (the cold
    answers' token ids: ids the tokenizer knows), each a different rotation so that no two share a prefix beyond
    chance. Raises ValueError when the answers hold no token."""
    pool = [t for out in outputs for t in out]
    if not pool:
        raise ValueError("the cold answers hold no token to build filler prompts from")
    n = -(-total // length)
    out = []
    for j in range(n):
        start = (j * 7919) % len(pool)
        seq = [pool[(start + k) % len(pool)] for k in range(length)]
        out.append(seq)
    return out


def evict_and_resend(client: Any, adapter: Any, prompts: list, fill: list[list[int]], max_new_tokens: int
                     ) -> pd.DataFrame:
    """The host arm on one server: the prefix cache flushed once, each prompt (:class:`helpers.acceptance.prompts.
    Prompt`) sent for one token (its KV enters the cache), the filler prompts ``fill`` (token-id lists,
    :func:`fillers`) sent for one token each (their KV evicts the prompts' from the device pool), then each prompt sent
    again greedy for ``max_new_tokens`` tokens. Returns the resends' per-request frame
    (:data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS` + ``host_cached_tokens``: :func:`host_tokens`).
    Raises what the filler requests raise (:class:`helpers.errors.ServerError`); a prompt's own failure is its
    ``error`` column (:func:`helpers.investigation.probes.base.send_greedy`)."""
    client.flush_cache()
    for i, p in enumerate(prompts):
        send_greedy(client, adapter, i, p, 1)
    for ids in fill:
        client.generate(input_ids=ids, sampling_params={"temperature": 0.0}, max_new_tokens=1)
    rows = []
    for i, p in enumerate(prompts):
        row, _, res = send_greedy(client, adapter, i, p, max_new_tokens)
        row["host_cached_tokens"] = host_tokens(res)
        rows.append(row)
    return pd.DataFrame(rows)


def _applies(ctx: ProbeContext) -> Optional[str]:
    info = ctx.client.server_info()
    off = ctx.adapter.prefix_cache_off(info)
    if off:
        return off
    if ctx.max_new_tokens < 2:
        return "fewer than 2 tokens per request: no verify step to count"
    _, why = ctx.adapter.host_cache_launch(info, device_tokens=MIN_DEVICE_TOKENS, host_tokens=2 * MIN_DEVICE_TOKENS)
    return why


def _run(ctx: ProbeContext) -> ProbeResult:
    cold_live, outs = cold_arm(ctx)           # the live server's cold answers: prompt lengths, filler token ids
    n = [int(x) for x in cold_live["prompt_tokens"].dropna()]
    if not n or max(n) < MIN_PROMPT_TOKENS:
        return ProbeResult(HICACHE_HIT.name, HICACHE_HIT.cost, HICACHE_HIT.condition, status="skipped",
                           why=f"the prompts are too short for a host load-back (the longest has {max(n, default=0)} "
                               f"tokens; SGLang loads back host hits of {MIN_PROMPT_TOKENS - 2} tokens or more: "
                               "UnifiedRadixCache.load_back_threshold)")
    sz = sizes(n, ctx.max_new_tokens)
    launch, why = ctx.adapter.host_cache_launch(ctx.client.server_info(), device_tokens=sz["device"],
                                                host_tokens=sz["host"])
    if launch is None:
        return ProbeResult(HICACHE_HIT.name, HICACHE_HIT.cost, HICACHE_HIT.condition, status="skipped", why=why)
    fill = fillers(outs, sz["filler"], sz["filler_len"])
    folder = ctx.folder("hicache_hit")
    got: dict = {}

    def host_arm(sub: ProbeContext) -> None:
        sub.progress(f"engine state: host tier: {len(sub.prompts)} prompts cached, {len(fill)} fillers "
                     f"({sz['filler']} tokens) to evict them from a {sz['device']}-token device pool, then resent")
        got["frame"] = evict_and_resend(sub.client, sub.adapter, sub.prompts, fill, sub.max_new_tokens)

    cold = on_copy(ctx, folder, flags=launch.get("flags"), env=launch.get("env") or None,
                   what="the host-tier (hierarchical cache) copy (--engine-probes all)", then=host_arm)
    cond = got["frame"]
    cold.to_parquet(folder / "cold.parquet")
    cond.to_parquet(folder / "hicache_hit.parquet")
    said = cond["host_cached_tokens"].dropna()
    hit_ids = set(cond.loc[cond["host_cached_tokens"].fillna(0) > 0, "prompt_id"])
    ev = {"device_tokens": sz["device"], "host_tokens": sz["host"], "filler_prompts": len(fill),
          "filler_tokens": len(fill) * sz["filler_len"], "flags": launch.get("flags"),
          "host_cached_tokens": {"min": int(said.min()) if len(said) else None,
                                 "max": int(said.max()) if len(said) else None,
                                 "prompts_with_host_hit": len(hit_ids), "prompts_reported": int(len(said))},
          "all_prompts_accept_length": _al(cond)}
    if not hit_ids:
        text = ("no measured answer was served from host memory (meta_info.cached_tokens_details.host 0): the "
                "host path did not happen" if len(said) else
                "the answers carry no per-tier cached-token split (meta_info.cached_tokens_details): whether the "
                "prefix came back from host memory is unknown")
        res = condition_result(HICACHE_HIT, ctx, cold, cond, folder, "hicache_hit",
                               basis="the same prompts cold vs resent after eviction to host memory", extra=ev)
        if res.status == "ran":
            res.decision = "undecided"
            res.findings = []
            res.loss.update(decision="undecided", counts=False, settle={"n": None, "text": text})
            res.why = text
        return res
    keep = lambda df: df[df["prompt_id"].isin(hit_ids)].reset_index(drop=True)   # noqa: E731
    return condition_result(HICACHE_HIT, ctx, keep(cold), keep(cond), folder, "hicache_hit",
                            basis=f"the same prompts cold vs with their prefix loaded back from host memory (the "
                                  f"{len(hit_ids)} whose answers say so: meta_info.cached_tokens_details.host > 0), "
                                  "on one copy with a host tier, paired per prompt, greedy",
                            extra=ev)


HICACHE_HIT = Probe("hicache_hit", "restart", "with the prompt's prefix loaded back from the host-memory cache tier",
                    "does the draft accept less when the prompt's KV was evicted to host memory and loaded back?",
                    _run, applies=_applies,
                    estimate_s=lambda ctx: 120.0 + 0.15 * len(ctx.prompts) * ctx.max_new_tokens, part="cache state",
                    mtp_why="a NextN head's KV pool is backed up and loaded back PACKED with the target's pages, not "
                            "as an EAGLE-3 sidecar (sglang/srt/speculative/base_spec_worker.py::_can_pack_hicache_mtp, "
                            "BaseSpecWorker._build_hicache_draft_plan: HiCacheDraftMode.PACKED): the same question, "
                            "another restore path")
