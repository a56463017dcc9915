"""Engine-state faults for tests only: SGLang ``--forward-hooks`` factories that break the engine *after* the aux
hidden states are captured, in a condition a cold greedy probe never sees. They are test fixtures: nothing in
``helpers/`` names them, no flag of the tool reaches them; a test passes them to the embedded server with
``forward_hooks=[spec(...)]``.

What they rely on, in SGLang 0.5.23 (read in the installed package):

* the EAGLE draft's prefill extend runs in ``ForwardMode.EXTEND`` on the draft's own model runner and KV pool with the
  target's ``req_to_token`` slots (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.
  _draft_extend_for_prefill``: "the draft writes the same slots"); the decode-side draft extend is
  ``ForwardMode.DRAFT_EXTEND_V2``. ``forward_batch.extend_prefix_lens`` > 0 in an EXTEND means the request's first
  tokens were already in the KV: a prefix-cache hit, or a later chunk of a chunked prefill;
* the draft's inner ``model`` (``sglang/srt/models/llama_eagle3.py::LlamaModel.forward(input_ids, positions,
  forward_batch, ...)``, called as a module by ``LlamaForCausalLMEagle3.forward``) receives the forward batch as its
  third argument (the root modules' ``forward`` is called directly by the runner,
  ``sglang/srt/model_executor/runner/eager_runner.py``, so hooks on them never fire); the forward batch carries no
  pool, the forward's attention backend does (``sglang/srt/model_executor/forward_context.py::get_attn_backend``, as
  ``sglang/srt/layers/radix_attention.py`` reads it; ``sglang/srt/layers/attention/intel_amx_backend.py::
  IntelAMXAttnBackend.__init__``:
  ``token_to_kv_pool``, ``req_to_token_pool`` of the runner it serves: the draft's own KV pool), whose ``k_buffer`` /
  ``v_buffer`` hold one ``[slots, heads, head_dim]`` tensor per layer (``sglang/srt/mem_cache/memory_pool.py``);
* the target's ``logits_processor`` gets ``(input_ids, hidden_states, lm_head, forward_batch, ...)`` and returns a
  ``LogitsProcessorOutput`` whose ``next_token_logits`` greedy verification takes the argmax of
  (``sglang/srt/speculative/eagle_utils.py``; ``ForwardMode.TARGET_VERIFY``).

Faults (``config["fault"]``), each with a ``seed`` and a strength:

* ``draft_kv_stale`` (``strength`` 0..1: the share of the cached prefix's draft-KV slots replaced by noise of the
  buffer's own scale): after the draft's prefill extend of a request whose prefix was already in the KV, the draft's
  KV of those slots no longer holds what the draft computed (a cache restore that brought back only the target's KV).
  Cold requests (no prefix) are untouched.
* ``verify_swap`` (``strength``: the probability per verified row): in target verify, the target's two best logits
  of a row are swapped, so verification accepts (and emits) the target's runner-up: speculation is no longer lossless.
"""
from __future__ import annotations

from typing import Any

import torch

FACTORY = "tests.support.engine_faults:factory"


def spec(fault: str, *, strength: float, seed: int = 0) -> dict:
    """The ``--forward-hooks`` spec of one fault (the inner ``model`` and the logits processor of both models; the
    hook picks its model)."""
    return {"name": f"e3f-test-{fault}", "target_modules": ["model", "logits_processor"], "hook_factory": FACTORY,
            "config": {"fault": fault, "strength": float(strength), "seed": int(seed)}}


def _is_draft(module: Any) -> bool:
    where = type(module).__module__.lower()
    return "eagle" in where or "nextn" in where


def _is_target_logits(module: Any) -> bool:
    archs = getattr(getattr(module, "config", None), "architectures", None) or []
    return type(module).__name__ == "LogitsProcessor" and bool(archs) and not any(
        t in a for a in archs for t in ("Eagle", "MTP", "NextN"))


def factory(config: dict) -> Any:
    fault = config["fault"]
    strength = float(config.get("strength", 1.0))
    gen = torch.Generator().manual_seed(int(config.get("seed", 0)))

    def draft_kv_stale(module, inputs, output):
        if not _is_draft(module) or len(inputs) < 3:
            return None
        fb = inputs[2]
        mode = getattr(fb, "forward_mode", None)
        if mode is None or mode.name != "EXTEND":
            return None
        prefix = getattr(fb, "extend_prefix_lens", None)
        if prefix is None or int(prefix.max()) <= 0:
            return None
        from sglang.srt.model_executor.forward_context import get_attn_backend  # lazy: only inside SGLang
        backend = get_attn_backend()
        pool = backend.token_to_kv_pool
        table = backend.req_to_token_pool.req_to_token
        with torch.no_grad():
            for i, p in enumerate(prefix.tolist()):
                if p <= 0:
                    continue
                slots = table[fb.req_pool_indices[i], :p].long()
                pick = torch.rand(len(slots), generator=gen) < strength
                slots = slots[pick]
                if not len(slots):
                    continue
                for buf in list(getattr(pool, "k_buffer", [])) + list(getattr(pool, "v_buffer", [])):
                    scale = buf[slots].float().pow(2).mean().sqrt().clamp_min(1e-6)
                    noise = torch.randn(buf[slots].shape, generator=gen) * scale
                    buf[slots] = noise.to(buf.dtype)
        return None

    def verify_swap(module, inputs, output):
        if not _is_target_logits(module) or len(inputs) < 4:
            return None
        mode = getattr(inputs[3], "forward_mode", None)
        if mode is None or mode.name != "TARGET_VERIFY":
            return None
        logits = getattr(output, "next_token_logits", None)
        if logits is None or logits.dim() != 2:
            return None
        with torch.no_grad():
            top = torch.topk(logits, 2, dim=-1).indices
            rows = torch.nonzero(torch.rand(logits.shape[0], generator=gen) < strength).flatten()
            for r in rows.tolist():
                a, b = int(top[r, 0]), int(top[r, 1])
                va, vb = logits[r, a].clone(), logits[r, b].clone()
                logits[r, a], logits[r, b] = vb, va
        return None

    return {"draft_kv_stale": draft_kv_stale, "verify_swap": verify_swap}[fault]
