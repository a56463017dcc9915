"""A recording ``--forward-hooks`` factory for ``bench/bench_oracle_floor.py``: on a server whose draft is the target
itself (SGLang 0.5.23 ``--speculative-algorithm STANDALONE``), both models are ``LlamaForCausalLM`` and both
``logits_processor`` modules get this hook (``sglang/srt/model_executor/hook_manager.py::register_forward_hooks`` runs
once per model runner).

Per call it writes ``out_dir/call{n:06d}.pt`` (``n``: one order over both models; ``torch.save`` of a dict of tensors
and strings, read with ``weights_only=True``):

* ``mode``: ``forward_batch.forward_mode`` name;
* ``spec``: the type name of ``forward_batch.spec_info`` (``None`` for the target's prefill,
  ``EagleDraftExtendInput`` for a draft extend, ``EagleDraftInput`` for a draft decode, ``EagleVerifyInput`` for the
  target's verify);
* ``attn``: the attention backend class; ``dtype``: the processor's input hidden dtype; ``model``: which model;
* ``input_ids`` / ``positions`` int64 ``[N]``, ``seq_lens`` int64 ``[bs]``;
* ``logits`` float32 ``[R, V]``: every row the processor returned.

Bench only (torch alone; importable in SGLang's venv); written while ``out_dir`` exists, at most ``max_calls`` calls.
"""
from __future__ import annotations

import os

import torch


_SEQ = {"n": 0}  # one order over both models' calls (one scheduler process at TP 1)


def factory(config: dict):
    out_dir = config["out_dir"]
    cap = int(config.get("max_calls", 20000))
    state = {"n": 0}
    tag = f"{os.getpid()}-{id(state)}"

    def hook(module, inputs, output):
        logits = getattr(output, "next_token_logits", None)
        fb = inputs[3] if len(inputs) > 3 else None
        if fb is None or not isinstance(logits, torch.Tensor) or state["n"] >= cap or not os.path.isdir(out_dir):
            return None
        attn = getattr(fb, "attn_backend", None)
        rec = {"mode": str(getattr(fb.forward_mode, "name", fb.forward_mode)),
               "spec": type(fb.spec_info).__name__ if fb.spec_info is not None else "None",
               "attn": type(attn).__name__ if attn is not None else "None",
               "dtype": str(inputs[1].dtype) if isinstance(inputs[1], torch.Tensor) else "?",
               "model": tag,
               "input_ids": inputs[0].detach().to("cpu", torch.int64).clone(),
               "positions": fb.positions.detach().to("cpu", torch.int64).clone(),
               "seq_lens": fb.seq_lens.detach().to("cpu", torch.int64).clone(),
               "logits": logits.detach().to("cpu", torch.float32).clone()}
        torch.save(rec, os.path.join(out_dir, f"call{_SEQ['n']:06d}.pt"))
        _SEQ["n"] += 1
        state["n"] += 1
        return None

    return hook
