"""Test-only engine-state faults on the EAGLE-3 draft inside SGLang, loaded through SGLang's ``--forward-hooks`` by a
test (never by the product: no flag, no spec builder of ``helpers`` names this module). Off until armed by a file.

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
