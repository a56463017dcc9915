"""The layer vocabulary every part of the tool speaks (DESIGN.md "Words"): physical tensor names and layer ids
written with their convention. Imports nothing of ``helpers``: formats, server and diagnosis all read it.

Physical tensors:

* ``embedding``   -- the embedding output (HF ``hidden_states[0]``), width H.
* ``out(L)``      -- the pre-norm residual stream leaving 0-based decoder layer L (= input of layer L+1 =
                     HF ``hidden_states[L+1]`` for L < n-1), width H.
* ``final_norm``  -- ``model.norm(out(n-1))``: what a target returns when no aux capture is active
                     (``sglang/srt/layers/logits_processor.py::LogitsProcessor._get_hidden_states_to_store``, FULL
                     mode without ``aux_hidden_states``), and HF ``hidden_states[n]`` (transformers 5.19
                     ``models/llama/modeling_llama.py::LlamaModel.forward`` records the last entry after
                     ``self.norm``: verified by running it).

A layer id is always carried with its convention (:class:`LayerIds`):

================  ===========================================  ==============================================
convention        id i means                                   source mirrored
================  ===========================================  ==============================================
sglang_capture    index in SGLang's layer loop: in(i) =        ``sglang/srt/models/llama.py::LlamaModel.forward``
                  out(i-1); 0 = embedding; n = final boundary  (``capture_output`` before layer i), 0.5.23
                  out(n-1) (gpt-oss only, >= 0.5.23)
specforge         out(i)                                       SpecForge ``specforge/algorithms/model_providers.py``
                                                               ``resolve_eagle_capture_layers`` (ids go through
                                                               SGLang ``set_eagle3_layers_to_capture``, +1)
vllm              in(i) = out(i-1), verbatim; n = out(n-1)     speculators ``src/speculators/models/utils.py``
                  (speculators' appended final slot, pre-norm)  ``resolve_target_layer_ids``; vLLM
                                                               ``set_aux_hidden_state_layers`` (no +1)
eagle3            in(i), hard-coded {2, n//2, n-3}             SafeAILab ``eagle/traineagle3/modeling_llama_kv.py``
hf                hidden_states[k]: k=0 embedding, 1..n-1 =    transformers ``LlamaModel`` (``_can_record_outputs``)
                  out(k-1), k=n final_norm
================  ===========================================  ==============================================

What SGLang does with a draft's ids (its rules per release and architecture) is :mod:`helpers.layers.sglang`; the
capture plans built from both are :mod:`helpers.diagnosis.conventions`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

EMBEDDING = "embedding"
FINAL_NORM = "final_norm"
CONVENTIONS = ("sglang_capture", "specforge", "vllm", "eagle3", "hf")

_OUT_RE = re.compile(r"^out\((-?\d+)\)$")


def out(layer: int) -> str:
    """Name of the residual stream leaving 0-based decoder layer ``layer``: ``"out(L)"``."""
    return f"out({int(layer)})"


def parse_tensor(name: str) -> tuple[str, int | None]:
    """Split a physical tensor name into (kind, layer).

    Returns ``("embedding", None)``, ``("final_norm", None)`` or ``("out", L)``.

    Raises:
        ValueError: ``name`` is not one of the names above.
    """
    if name in (EMBEDDING, FINAL_NORM):
        return name, None
    m = _OUT_RE.match(name)
    if not m:
        raise ValueError(f"not a physical tensor name: {name!r} (expected 'embedding', 'final_norm' or 'out(L)')")
    return "out", int(m.group(1))


def layer_of(name: str) -> int | None:
    """The decoder layer L of ``"out(L)"``; -1 for ``embedding`` (the output "before layer 0"); None otherwise."""
    kind, layer = parse_tensor(name)
    if kind == "out":
        return layer
    if kind == EMBEDDING:
        return -1
    return None


def layer_index(name: Any) -> int | None:
    """Lenient :func:`layer_of` for tables and figures: None for anything that is not ``embedding`` / ``out(L)``
    (None, NaN -- pandas 3 stores a missing string cell as NaN --, ``final_norm``, other text)."""
    if not isinstance(name, str):
        return None
    try:
        return layer_of(name)
    except ValueError:
        return None


@dataclass(frozen=True)
class LayerIds:
    """A list of layer ids together with the convention they are written in.

    ``str(LayerIds((3, 31, 59), "sglang_capture"))`` is ``"sglang_capture=[3, 31, 59]"``.
    """

    ids: tuple[int, ...]
    convention: str

    def __post_init__(self):
        if self.convention not in CONVENTIONS:
            raise ValueError(f"unknown layer-id convention {self.convention!r}; expected one of {CONVENTIONS}")

    def __str__(self) -> str:
        return f"{self.convention}=[{', '.join(str(i) for i in self.ids)}]"

    def tensors(self, num_layers: int) -> list[str]:
        """The physical tensor of each id, in list order (see :func:`physical`)."""
        return [physical(i, self.convention, num_layers) for i in self.ids]


def physical(layer_id: int, convention: str, num_layers: int) -> str:
    """Map one layer id written in ``convention`` to the physical tensor it names.

    Args:
        layer_id: the id as written.
        convention: one of :data:`CONVENTIONS`.
        num_layers: the target's ``num_hidden_layers`` (n).

    Returns:
        ``"embedding"``, ``"out(L)"`` (0 <= L < n) or ``"final_norm"`` (``hf`` index n only).

    Raises:
        ValueError: the id names nothing in a target with ``num_layers`` layers (e.g. specforge id n, or a
            negative capture index).
    """
    n = int(num_layers)
    i = int(layer_id)
    if convention == "specforge":
        # out(i); -1 would be "the output before layer 0" = the embedding.
        if -1 <= i <= n - 1:
            return EMBEDDING if i == -1 else out(i)
    elif convention in ("sglang_capture", "vllm", "eagle3"):
        # in(i) = out(i-1); in(0) = embedding; in(n) = the final boundary out(n-1) (pre-norm).
        if 0 <= i <= n:
            return EMBEDDING if i == 0 else out(i - 1)
    elif convention == "hf":
        if 0 <= i <= n:
            return EMBEDDING if i == 0 else (FINAL_NORM if i == n else out(i - 1))
    else:
        raise ValueError(f"unknown layer-id convention {convention!r}; expected one of {CONVENTIONS}")
    raise ValueError(f"{convention} id {i} names no tensor of a {n}-layer target")


def layer_id(tensor: str, convention: str, num_layers: int) -> int:
    """Inverse of :func:`physical`: the id that names ``tensor`` in ``convention``.

    Raises:
        ValueError: ``tensor`` cannot be named in ``convention`` (e.g. ``final_norm`` outside ``hf``).
    """
    n = int(num_layers)
    kind, layer = parse_tensor(tensor)
    if kind == FINAL_NORM:
        if convention == "hf":
            return n
        raise ValueError(f"final_norm has no id in the {convention} convention")
    L = -1 if kind == EMBEDDING else int(layer)
    if not -1 <= L <= n - 1:
        raise ValueError(f"{tensor} does not exist in a {n}-layer target")
    if convention == "specforge":
        return L
    if convention in ("sglang_capture", "vllm", "eagle3", "hf"):
        if convention == "hf" and L == n - 1:
            raise ValueError(f"HF hidden_states has no pre-norm {tensor}: index {n} is final_norm")
        return L + 1
    raise ValueError(f"unknown layer-id convention {convention!r}; expected one of {CONVENTIONS}")


def convert(ids: LayerIds, to_convention: str, num_layers: int) -> LayerIds:
    """Rewrite ``ids`` in another convention, naming the same physical tensors.

    Raises:
        ValueError: an id has no counterpart in ``to_convention``.
    """
    return LayerIds(tuple(layer_id(physical(i, ids.convention, num_layers), to_convention, num_layers)
                          for i in ids.ids), to_convention)


# ---------------------------------------------------------------------------------------------- defaults

def specforge_default_ids(num_layers: int) -> LayerIds:
    """SpecForge's default ``[1, n//2-1, n-4]`` (out(i)).

    Mirrors SpecForge ``specforge/algorithms/model_providers.py::resolve_eagle_capture_layers``.
    """
    n = int(num_layers)
    return LayerIds((1, n // 2 - 1, n - 4), "specforge")


def vllm_default_ids(num_layers: int) -> LayerIds:
    """vLLM / speculators default ``[2, n//2, n-3]`` (in(i), verbatim).

    Mirrors speculators ``src/speculators/models/utils.py::resolve_target_layer_ids`` and vLLM
    ``get_eagle3_aux_hidden_state_layers``. speculators' datagen also appends
    ``n`` (the final boundary), a slot that training drops.
    """
    n = int(num_layers)
    return LayerIds((2, n // 2, n - 3), "vllm")


def eagle3_ids(num_layers: int) -> LayerIds:
    """Original EAGLE-3's hard-coded in(2), in(n//2), in(n-3).

    Mirrors SafeAILab ``eagle/traineagle3/modeling_llama_kv.py`` ``LlamaModel.forward``
    (``idx==len(self.layers)-3 or idx==len(self.layers)//2 or idx==2``).
    """
    n = int(num_layers)
    return LayerIds((2, n // 2, n - 3), "eagle3")


def sglang_default_capture(num_layers: int) -> LayerIds:
    """SGLang's fallback ``layers_to_capture = [2, n//2, n-3]`` (no +1), used when the draft has no ids.

    Mirrors ``sglang/srt/models/llama.py::LlamaForCausalLM.set_eagle3_layers_to_capture`` (``layer_ids is
    None`` branch; the same in deepseek_v2.py, gpt_oss.py, qwen2/3.py, ...).
    """
    n = int(num_layers)
    return LayerIds((2, n // 2, n - 3), "sglang_capture")
