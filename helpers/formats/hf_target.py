"""The target as HF transformers loads it, for a reference (``capture_reference_hf``, the plan identification's
continuations): :func:`load_hf_target`."""
from __future__ import annotations

import os
import re
import warnings
from typing import Optional

import torch

from ..errors import BadInput


def load_hf_target(target: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """The target as an HF transformers model (``AutoModelForCausalLM.from_pretrained``, eval mode) for a reference.

    Tensors of the checkpoint past the decoder layers (``model.layers.{>= num_hidden_layers}.*``: an MTP / NextN
    head, which HF's model class does not hold) are expected and dropped without transformers' load report; any
    other unexpected tensor is said in one warning.

    Raises:
        BadInput: the checkpoint lacks tensors the model needs or holds them in another shape (HF would fill them
            with random values and the reference would be wrong); the folder and the first names are given."""
    from transformers import AutoModelForCausalLM  # lazy: transformers takes seconds to import; only HF needs it
    from transformers.utils import logging as hf_logging  # lazy: as above

    old = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        model, info = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, output_loading_info=True)
    finally:
        hf_logging.set_verbosity(old)
    bad = sorted(info.get("missing_keys") or []) + sorted(str(k) for k in info.get("mismatched_keys") or [])
    if bad:
        raise BadInput(f"the target checkpoint lacks or misshapes {len(bad)} tensor(s) HF's "
                       f"{type(model).__name__} needs ({', '.join(bad[:3])}, ...): a reference from it would use "
                       "random weights", path=target)
    n = model.config.num_hidden_layers
    other = [k for k in info.get("unexpected_keys") or []
             if not ((L := layer_index_of_key(k)) is not None and L >= n)]
    if other:
        warnings.warn(f"{target}: {len(other)} checkpoint tensor(s) HF's {type(model).__name__} does not use, ignored "
                      f"({', '.join(sorted(other)[:3])}, ...)", stacklevel=2)
    return model.eval()


def layer_index_of_key(name: str) -> Optional[int]:
    """The decoder layer index of a checkpoint tensor name (``model.layers.8.eh_proj.weight`` -> 8), else None."""
    m = re.match(r"(?:model\.)?layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def every_layer_states(model, ids) -> list[torch.Tensor]:
    """Every layer of ``model`` (from :func:`load_hf_target`) on the token ids ``ids``: ``[embedding, out(0), ...,
    out(n-1)]``, each ``[T, H]`` in the model's dtype. ``hidden_states[k]`` of HF ``output_hidden_states`` is
    out(k-1) (k = 0: the embedding), the pre-norm residual stream for k < n; HF's last entry is *after* the final
    norm, so out(n-1) is the input of ``model.norm``, taken with a forward pre-hook (transformers
    ``models/llama/modeling_llama.py::LlamaModel.forward``)."""
    cap: dict = {}
    hook = model.model.norm.register_forward_pre_hook(lambda m, a: cap.__setitem__("pre", a[0].detach()))
    try:
        with torch.no_grad():
            hs = model(torch.tensor([[int(x) for x in ids]]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    n = model.config.num_hidden_layers
    return [hs[k][0] for k in range(n)] + [cap["pre"][0]]

