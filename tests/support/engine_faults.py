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

Fault factories armed by a file (the draft step trace's faults, ``helpers.draft.trace``):

* :func:`scaled_weights_factory`: the draft's ``fc`` weight multiplied in place by ``scale`` once more than
  ``after_requests`` prefills have been drafted since ``arm`` appeared (a draft damaged after N requests, as an RL
  weight sync or a resume that scrambles the draft would). Two specs share one state: ``mode: "count"`` on the draft's
  ``logits_processor`` (counts ``EXTEND`` forwards' requests and scales the weight; the first damaged request's own
  prefill step is still clean) and ``mode: "fc"`` on ``model.fc`` (only the draft has it: records the module).
* :func:`kv_wrong_slot_factory`: on the draft's ``model.layers.0.self_attn.attn`` (``RadixAttention``), in
  ``DECODE`` forwards only (the draft's decode steps: ``eagle_worker_v2.py::EagleDraftWorker.draft_forward``; the
  target never decodes on a speculative server, it verifies), while ``arm`` exists: the KV this step wrote to its
  slot (``forward_batch.out_cache_loc``) is also written over the slot of the position before it
  (``req_to_token[req, position - 1]``: the last context token's slot for the first decode step), the attention is
  recomputed from the pool (``RadixAttention.forward(..., save_kv_cache=False)``) and the overwritten slot restored
  afterwards. Draft step 1 (the draft-extend rows) is untouched; steps 2 .. see a wrong KV: "draft KV written to
  the wrong slot from step 2". Pool access through ``sglang/srt/model_executor/forward_context.py::
  get_token_to_kv_pool`` / ``get_req_to_token_pool`` (the forward context every model forward publishes).

Importable in SGLang's venv: torch only (SGLang itself lazily, inside the hook).
"""
from __future__ import annotations

import os
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


_STATE: dict = {"requests": 0, "fc": None, "scaled": False}


def scaled_weights_factory(config: dict) -> Any:
    """``config``: ``mode`` (``count`` | ``fc``), ``arm`` (file path), ``after_requests`` (N), ``scale``."""
    mode = config.get("mode", "count")
    arm = config["arm"]
    after = int(config.get("after_requests", 1))
    scale = float(config.get("scale", 0.25))

    def fc_hook(module, inputs, output):
        _STATE["fc"] = module
        return None

    def count_hook(module, inputs, output):
        archs = getattr(getattr(module, "config", None), "architectures", None) or []
        if not any("Eagle" in a for a in archs) or not os.path.exists(arm):
            return None
        fb = inputs[3] if len(inputs) > 3 else None
        if getattr(getattr(fb, "forward_mode", None), "name", None) != "EXTEND":
            return None
        _STATE["requests"] += int(fb.extend_seq_lens.shape[0])
        fc = _STATE["fc"]
        if _STATE["requests"] > after and not _STATE["scaled"] and fc is not None:
            with torch.no_grad():
                fc.weight.mul_(scale)
            _STATE["scaled"] = True
        return None

    return fc_hook if mode == "fc" else count_hook


def kv_wrong_slot_factory(config: dict) -> Any:
    """``config``: ``arm`` (file path; the fault acts only while it exists)."""
    arm = config["arm"]

    def hook(module, inputs, output):
        if len(inputs) < 4 or not os.path.exists(arm):
            return None
        q, k, v, fb = inputs[:4]
        if getattr(getattr(fb, "forward_mode", None), "name", None) != "DECODE":
            return None
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        pool, r2t = get_token_to_kv_pool(), get_req_to_token_pool().req_to_token
        lid = module.layer_id
        kb, vb = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        loc = fb.out_cache_loc.long()
        n = loc.shape[0]
        per = max(n // int(fb.req_pool_indices.shape[0]), 1)
        req = fb.req_pool_indices.long().repeat_interleave(per)
        prev = (fb.positions.long() - 1).clamp(min=0)
        wrong = r2t[req, prev].long()
        with torch.no_grad():
            old_k, old_v = kb[wrong].clone(), vb[wrong].clone()
            kb[wrong], vb[wrong] = kb[loc], vb[loc]
            out = module.forward(q, k, v, fb, save_kv_cache=False)
            kb[wrong], vb[wrong] = old_k, old_v
        return out

    return hook


def specs(folder: str, *, after_requests: int = 2, scale: float = 0.25) -> tuple[list[dict], str, str]:
    """``(--forward-hooks specs, weights arm file, KV arm file)`` for both faults, armed by files in ``folder``."""
    w, kv = os.path.join(folder, "ARM_WEIGHTS"), os.path.join(folder, "ARM_KV")
    fac = "tests.support.engine_faults:"
    return ([{"name": "test-weights-fc", "target_modules": ["model.fc"], "hook_factory": fac + "scaled_weights_factory",
              "config": {"mode": "fc", "arm": w}},
             {"name": "test-weights-count", "target_modules": ["logits_processor"],
              "hook_factory": fac + "scaled_weights_factory",
              "config": {"mode": "count", "arm": w, "after_requests": after_requests, "scale": scale}},
             {"name": "test-kv-slot", "target_modules": ["model.layers.0.self_attn.attn"],
              "hook_factory": fac + "kv_wrong_slot_factory", "config": {"arm": kv}}], w, kv)
