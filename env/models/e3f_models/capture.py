"""Aux / final hidden states of the reference target, two ways, in SpecForge's convention.

Layer ids are SpecForge's: ``out(i)`` = the pre-norm residual stream leaving 0-based decoder layer
``i``. The two capture paths:

(b) ``hf_capture``: HF transformers ``output_hidden_states=True``; ``out(i) = hidden_states[i + 1]``
    (index 0 is the embedding output), as SpecForge's old HF backend did
    (``94de9f8a^:specforge/modeling/target/eagle3_target_model.py``: "output_hidden_states = True
    will return the embedding output as well so we have an offset of 1"). The final state is
    ``last_hidden_state`` (after ``model.norm``).

(a) ``sglang_capture``: a real SGLang 0.5.23 server. Aux states come from a server started with
    ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3
    --return-aux-hidden-state-layer-ids <ids>`` (capture-only mode, no draft); SGLang's
    ``LlamaForCausalLM.set_eagle3_layers_to_capture`` stores ``ids + 1`` and ``LlamaModel.forward``
    appends ``hidden_states + residual`` *before* running loop index ``i + 1``, i.e. out(i)
    (sglang/srt/models/llama.py). The final post-norm state comes from a second server started with
    ``--enable-return-hidden-states`` (without aux capture ``LogitsProcessor`` stores the normed
    ``hidden_states``; sglang/srt/layers/logits_processor.py::_get_hidden_states_to_store). Each
    sample is sent as ``input_ids`` with ``max_new_tokens=1, return_hidden_states=True``;
    ``meta_info.hidden_states[0]`` is then the ``[L][W]`` block of the prompt positions.
    Both servers run with ``--disable-radix-cache`` so no prefix hit shortens that block.
"""
from __future__ import annotations

import json
import urllib.request

import torch


@torch.no_grad()
def hf_capture(model, input_ids: torch.Tensor, layer_ids: list[int]):
    """HF capture of a same-length batch.

    Args:
      model: HF ``LlamaForCausalLM`` (fp32, eval).
      input_ids: int64 ``[B, L]``.
      layer_ids: SpecForge ids (out(i) convention); concatenated in ascending order, as SGLang's
        layer loop does.
    Returns:
      ``(aux [B, L, len(ids)*H], last [B, L, H])`` fp32 on the model's device; ``last`` is after
      the final RMSNorm.
    """
    dev = next(model.parameters()).device
    out = model.model(input_ids=input_ids.to(dev), output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    n = model.config.num_hidden_layers
    assert len(hs) == n + 1, f"expected {n + 1} hidden states, got {len(hs)}"
    for i in layer_ids:
        if not 0 <= i < n - 1:  # out(n-1) is only reachable post-norm in HF and never in SGLang
            raise ValueError(f"layer id {i} (SpecForge out(i)) outside [0, {n - 2}]")
    aux = torch.cat([hs[i + 1] for i in sorted(layer_ids)], dim=-1)
    return aux.float(), out.last_hidden_state.float()


def _post(url: str, payload: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def sglang_prompt_hidden_states(base_url: str, input_ids: list[int]) -> torch.Tensor:
    """``meta_info.hidden_states[0]`` of one request: fp32 ``[L, W]`` for the ``L`` input ids.

    The server must run with ``--enable-return-hidden-states`` (or
    ``--enable-return-aux-hidden-states``) and ``--disable-radix-cache``.
    """
    res = _post(base_url.rstrip("/") + "/generate",
                {"input_ids": list(map(int, input_ids)), "return_hidden_states": True,
                 "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    hs = res["meta_info"]["hidden_states"]
    block = torch.tensor(hs[0], dtype=torch.float32)
    if block.dim() != 2 or block.shape[0] != len(input_ids):
        raise RuntimeError(f"prompt hidden-state block has shape {tuple(block.shape)}, expected "
                           f"[{len(input_ids)}, W] (radix cache on? chunked prefill?)")
    return block


def sglang_launch_kwargs(kind: str, layer_ids: list[int]) -> dict:
    """``helpers.server.embedded.start`` keyword arguments of a capture server: ``kind`` = "aux" (aux
    hidden states at SpecForge ``layer_ids``) or "final" (post-norm last hidden state). Both
    disable the radix cache so every request's prompt block has all ``L`` rows."""
    if kind == "aux":
        return {"return_hidden_states": False, "extra_args": [
            "--disable-radix-cache", "--enable-return-aux-hidden-states",
            "--speculative-algorithm", "EAGLE3",
            "--return-aux-hidden-state-layer-ids", *map(str, layer_ids)]}
    if kind == "final":
        return {"return_hidden_states": True, "extra_args": ["--disable-radix-cache"]}
    raise ValueError(kind)
