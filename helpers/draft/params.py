"""The parameters SGLang 0.5.23 builds for an EAGLE-3 draft config, and where its ``load_weights`` puts each
checkpoint tensor: the model the draft checks (:mod:`helpers.draft.checks`) and the offline draft
(:mod:`helpers.draft.model`) both load against.

Mirrored from ``sglang/srt/models/llama_eagle3.py`` (``LlamaModel.__init__``, ``LlamaDecoderLayer.__init__``,
``LlamaForCausalLMEagle3.__init__`` / ``load_weights``) and ``sglang/srt/models/kimi_k25_eagle3.py``
(``Eagle3MLAModel.__init__``, ``_get_eagle_aux_layer_count``, ``Eagle3MLADecoderLayer.__init__`` with the
``DeepseekV2AttentionMLA`` / ``DeepseekV2MLP`` it builds from ``sglang/srt/models/deepseek_v2.py``,
``Eagle3DeepseekV2ForCausalLM.__init__`` / ``load_weights``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import BadInput
from ..formats.configs import DraftConfig, TensorInfo

#: the SGLang release whose source these rules were read from
SGLANG_RULES = "0.5.23"

L3 = "sglang/srt/models/llama_eagle3.py"
K25 = "sglang/srt/models/kimi_k25_eagle3.py"
LLAMA_CLASS, MLA_CLASS = "LlamaForCausalLMEagle3", "Eagle3DeepseekV2ForCausalLM"

# llama_eagle3.py::LlamaForCausalLMEagle3.load_weights (l. 328-343)
_STACKED = ((".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"), (".qkv_proj", ".v_proj", "v"),
            (".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
_LEGACY = (("midlayer", "layers.0"), ("aux_norm_low", "fc_norm.0"), ("aux_norm_mid", "fc_norm.1"),
           ("aux_norm_high", "fc_norm.2"))
# kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM.load_weights (l. 430-433: gate / up stacked; l. 467-492: q_a_proj and
# kv_a_proj_with_mqa concatenated, q first, into fused_qkv_a_proj_with_mqa once both are read)
_MLA_STACKED = ((".gate_up_proj", ".gate_proj", 0), (".gate_up_proj", ".up_proj", 1))
MLA_FUSED = "fused_qkv_a_proj_with_mqa"
#: a stacked / fused parameter's shard -> the checkpoint tensor that fills it (the inverse of load_weights' mapping)
SHARD_TENSORS = {"qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
                 "gate_up_proj": {0: "gate_proj", 1: "up_proj"},
                 MLA_FUSED: {"q_a": "q_a_proj", "kv_a": "kv_a_proj_with_mqa"}}

#: initial value of a parameter no tensor fills, per SGLang module
INIT_RMSNORM = "ones (layers/layernorm.py::RMSNorm: torch.ones): the trained scale is lost"
INIT_LINEAR = "torch.nn.Linear's random initialisation"
INIT_EMPTY = "uninitialised memory (torch.empty in the layer's create_weights)"


@dataclass
class SGLangDraftParams:
    """The parameters SGLang builds for a draft config: ``{(param, shard): (shape, init)}`` and how it resolves
    checkpoint names."""

    cls: str
    params: dict
    defaulted: dict          # config fields left out, with the LlamaConfig default SGLang then uses
    num_aux: int
    hidden_size_in: int
    fc_norm: bool
    norm_before_fc: bool
    norm_output: bool
    tie: bool
    draft_vocab: int         # the lm_head's rows (draft_vocab_size, or vocab_size when it is absent)
    vocab: int
    lm_from_target: bool     # load_lm_head_from_target
    midlayer_checked: bool   # the decoder layer's tensors are part of params
    source: str
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    intermediate: int = 0
    layers: int = 1
    attn_bias: bool = False
    #: the MLA draft's attention (``DeepseekV2AttentionMLA``): q_lora_rank, kv_lora_rank, qk_nope_head_dim,
    #: qk_rope_head_dim, v_head_dim; all 0 for the Llama draft
    q_lora: int = 0
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    #: parameters SGLang builds but its forward never reads (``layers.{i>0}.input_layernorm``: llama_eagle3.py
    #: ``LlamaDecoderLayer.forward`` l. 103-105 norms layers > 0 with ``hidden_norm`` only): absent, nothing changes
    unused: frozenset = frozenset()


#: transformers 5.19's config-class defaults a draft config gets for a field its config.json leaves out, by
#: ``model_type`` (SGLang loads the draft config through AutoConfig: ``llama`` -> ``LlamaConfig()``; ``kimi_k2`` is
#: SGLang's alias of ``DeepseekV3Config``, ``sglang/srt/utils/hf_transformers/common.py`` ``_KimiK2ConfigAlias``): a
#: draft config without ``num_hidden_layers`` gets 32 layers, one without ``max_position_embeddings`` a context of
#: 2048 (4096 for the DeepSeek-V3 / Kimi class of the MLA draft)
CONFIG_DEFAULTS = {
    "llama": {"vocab_size": 32000, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
              "max_position_embeddings": 2048, "rope_theta": 10000.0},
    "deepseek_v2": {"vocab_size": 102400, "intermediate_size": 11008, "num_hidden_layers": 32,
                    "num_attention_heads": 32, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 2048,
                    "rope_theta": 10000.0},
    "deepseek_v3": {"vocab_size": 129280, "intermediate_size": 18432, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 4096,
                    "rope_theta": 10000.0},
}
CONFIG_DEFAULTS["kimi_k2"] = CONFIG_DEFAULTS["deepseek_v3"]
#: the LlamaConfig defaults that size the draft's parameters (:func:`sglang_parameters`)
LLAMA_DEFAULTS = {k: CONFIG_DEFAULTS["llama"][k] for k in ("vocab_size", "intermediate_size", "num_hidden_layers",
                                                             "num_attention_heads")}
#: the fields that size the MLA draft's parameters; a field left out gets its config class's default (``model_type``
#: ``deepseek_v2`` -> ``DeepseekV2Config``, ``deepseek_v3`` / ``kimi_k2`` -> ``DeepseekV3Config``, another -> the
#: latter)
MLA_FIELDS = ("vocab_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def mla_defaults(raw: dict) -> dict:
    """The config-class defaults of :data:`MLA_FIELDS` for an MLA draft config of this ``model_type``."""
    table = CONFIG_DEFAULTS.get(str(raw.get("model_type")))
    table = table if table is not None and "q_lora_rank" in table else CONFIG_DEFAULTS["deepseek_v3"]
    return {k: table[k] for k in MLA_FIELDS}


def _int(raw: dict, key: str, path: Path, default: Any = None) -> Any:
    v = raw.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise BadInput(f"expected a positive integer, got {v!r}", path=path, field=key)
    return v


# ------------------------------------------------------------------------------------------------ the draft classes

def _llama_inputs(raw: dict, path: Path, H: int, ec: dict, field) -> tuple[int, int, bool, str]:
    """(aux chunks, chunk width, input_norm built, source) of ``LlamaForCausalLMEagle3``."""
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    # llama_eagle3.py::LlamaModel.__init__ l. 151-161: hasattr(config, "target_hidden_size") -- a null counts
    if "target_hidden_size" in raw and raw["target_hidden_size"] is None:
        raise BadInput("target_hidden_size is null: SGLang takes it as set (hasattr) and cannot build fc "
                       f"({L3} l. 151-154); expected an integer or no key", path=path, field="target_hidden_size")
    hin = _int(raw, "target_hidden_size", path, H)
    naux = raw.get("num_aux_hidden_states")
    if naux is None:
        naux = len(ids) if ids else 3
    elif isinstance(naux, bool) or not isinstance(naux, int) or naux <= 0:
        raise BadInput(f"expected a positive integer, got {naux!r}", path=path, field="num_aux_hidden_states")
    norm_before_fc = bool(ec.get("norm_before_fc", raw.get("norm_before_fc", False)))   # l. 173-175
    return naux, hin, norm_before_fc, f"{L3}::LlamaModel.__init__ (l. 122-207), LlamaDecoderLayer.__init__ (l. 46-86)"


def _mla_inputs(raw: dict, path: Path, H: int, ec: dict, field) -> tuple[int, int, bool, str]:
    """(aux chunks, chunk width, input_norm built, source) of ``Eagle3DeepseekV2ForCausalLM``."""
    ids = ec.get("eagle_aux_hidden_state_layer_ids")
    # kimi_k25_eagle3.py::_get_eagle_aux_layer_count (l. 48-59): eagle_config ids, top-level ids, else 3
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    naux = len(ids) if ids is not None else len(top) if top is not None else 3
    hin = raw.get("target_hidden_size") or H                          # l. 208-210
    if field("num_hidden_layers") != 1:
        raise BadInput(f"num_hidden_layers is {field('num_hidden_layers')}"
                       f"{' (the config class default)' if raw.get('num_hidden_layers') is None else ''}: SGLang's "
                       f"{MLA_CLASS} raises 'EAGLE3 currently only supports 1 layer' ({K25} l. 243-244); "
                       "expected 1", path=path, field="num_hidden_layers")
    return naux, hin, False, (f"{K25}::Eagle3MLAModel.__init__ (l. 191-255), Eagle3MLADecoderLayer.__init__ (l. 70-149: "
                              "sglang/srt/models/deepseek_v2.py::DeepseekV2AttentionMLA.__init__, DeepseekV2MLP)")


def _llama_layers(raw: dict, path: Path, H: int, field, params: dict) -> dict:
    """The decoder layers ``LlamaForCausalLMEagle3`` builds (into ``params``) and their sizes."""
    nh = field("num_attention_heads")
    nkv = _int(raw, "num_key_value_heads", path, nh)
    hd = _int(raw, "head_dim", path, H // nh)
    if raw.get("model_type") == "llama4_text":
        inter = _int(raw, "intermediate_size_mlp", path)
        if inter is None:
            raise BadInput("missing integer field (SGLang builds a llama4_text draft's MLP from it)", path=path,
                           field="intermediate_size_mlp")
    else:
        inter = field("intermediate_size")
    attn_bias = bool(raw.get("attention_bias", False) or raw.get("bias", False))   # llama.py l. 339-341
    nlayers = field("num_hidden_layers")
    for layer in range(nlayers):
        pre = f"model.layers.{layer}."
        width = 2 * H if layer == 0 else H                           # llama_eagle3.py l. 62-64
        params[(pre + "self_attn.qkv_proj.weight", "q")] = ((nh * hd, width), INIT_EMPTY)
        params[(pre + "self_attn.qkv_proj.weight", "k")] = ((nkv * hd, width), INIT_EMPTY)
        params[(pre + "self_attn.qkv_proj.weight", "v")] = ((nkv * hd, width), INIT_EMPTY)
        params[(pre + "self_attn.o_proj.weight", None)] = ((H, nh * hd), INIT_EMPTY)
        if attn_bias:
            params[(pre + "self_attn.o_proj.bias", None)] = ((H,), INIT_EMPTY)
        params[(pre + "mlp.gate_up_proj.weight", 0)] = ((inter, H), INIT_EMPTY)
        params[(pre + "mlp.gate_up_proj.weight", 1)] = ((inter, H), INIT_EMPTY)
        params[(pre + "mlp.down_proj.weight", None)] = ((H, inter), INIT_EMPTY)
        for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
            params[(pre + norm + ".weight", None)] = ((H,), INIT_RMSNORM)
    return {"heads": nh, "kv_heads": nkv, "head_dim": hd, "intermediate": inter, "layers": nlayers,
            "attn_bias": attn_bias, "mla": dict(q_lora=0, kv_lora=0, qk_nope=0, qk_rope=0, v_head=0)}


def _mla_layers(raw: dict, path: Path, H: int, field, params: dict) -> dict:
    """The one ``Eagle3MLADecoderLayer`` ``Eagle3DeepseekV2ForCausalLM`` builds (into ``params``) and its sizes."""
    nh, inter = field("num_attention_heads"), field("intermediate_size")
    if "q_lora_rank" in raw and raw["q_lora_rank"] is None:
        raise BadInput(f"q_lora_rank is null: SGLang's {MLA_CLASS} raises 'Eagle3 MLA layer requires q_lora_rank "
                       f"in the draft config' ({K25}::Eagle3MLADecoderLayer.__init__ l. 114-117); expected an "
                       "integer", path=path, field="q_lora_rank")
    mla = dict(q_lora=field("q_lora_rank"), kv_lora=field("kv_lora_rank"), qk_nope=field("qk_nope_head_dim"),
               qk_rope=field("qk_rope_head_dim"), v_head=field("v_head_dim"))
    nkv, hd = 1, mla["qk_nope"] + mla["qk_rope"]     # every head attends to the one latent (MQA over kv_lora)
    pre = "model.midlayer."                           # Eagle3MLAModel.midlayer (load_weights: layers.0. -> it)
    a = pre + "self_attn."
    # Eagle3MLADecoderLayer.__init__ l. 118-124: the fused q_a / kv_a projection takes the 2H-wide input
    params[(a + MLA_FUSED + ".weight", "q_a")] = ((mla["q_lora"], 2 * H), INIT_EMPTY)
    params[(a + MLA_FUSED + ".weight", "kv_a")] = ((mla["kv_lora"] + mla["qk_rope"], 2 * H), INIT_EMPTY)
    # deepseek_v2.py::DeepseekV2AttentionMLA.__init__ (q_lora_rank set)
    params[(a + "q_a_layernorm.weight", None)] = ((mla["q_lora"],), INIT_RMSNORM)
    params[(a + "q_b_proj.weight", None)] = ((nh * hd, mla["q_lora"]), INIT_EMPTY)
    params[(a + "kv_a_layernorm.weight", None)] = ((mla["kv_lora"],), INIT_RMSNORM)
    params[(a + "kv_b_proj.weight", None)] = ((nh * (mla["qk_nope"] + mla["v_head"]), mla["kv_lora"]),
                                               INIT_EMPTY)
    params[(a + "o_proj.weight", None)] = ((H, nh * mla["v_head"]), INIT_EMPTY)
    params[(pre + "mlp.gate_up_proj.weight", 0)] = ((inter, H), INIT_EMPTY)        # deepseek_v2.py::DeepseekV2MLP
    params[(pre + "mlp.gate_up_proj.weight", 1)] = ((inter, H), INIT_EMPTY)
    params[(pre + "mlp.down_proj.weight", None)] = ((H, inter), INIT_EMPTY)
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        params[(pre + norm + ".weight", None)] = ((H,), INIT_RMSNORM)
    return {"heads": nh, "kv_heads": nkv, "head_dim": hd, "intermediate": inter, "layers": 1, "attn_bias": False,
            "mla": mla}


def _llama_resolve(names: set, name: str) -> Any:
    """llama_eagle3.py::LlamaForCausalLMEagle3.load_weights (l. 328-378): legacy names, d2t / t2d, stacked q/k/v and
    gate/up; a name it does not know is dropped silently."""
    for legacy, new in _LEGACY:
        if legacy in name:
            name = name.replace(legacy, new)
    if "d2t" in name:
        return "d2t"
    if "t2d" in name:
        return "t2d"
    for param_name, weight_name, shard in _STACKED:
        if weight_name not in name:
            continue
        name = name.replace(weight_name, param_name)
        param = f"model.{name}" if name not in names else name
        return (param, shard) if param in names else None
    param = name if name in names else f"model.{name}"
    return (param, None) if param in names else None


def _mla_resolve(names: set, name: str) -> Any:
    """kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM.load_weights (l. 436-499), in its order; a name it does not know
    is dropped with a warning."""
    if name == "d2t" or name.endswith(".d2t"):
        return "d2t"
    if name == "t2d" or name.endswith(".t2d"):
        return "t2d"
    mapped = re.sub(r"^layers\.0\.", "midlayer.", name)
    if not mapped.startswith("lm_head."):
        mapped = f"model.{mapped}"
    for param_name, weight_name, shard in _MLA_STACKED:
        if weight_name in mapped and mapped.replace(weight_name, param_name) in names:
            return mapped.replace(weight_name, param_name), shard
    if "q_a_proj" in mapped or "kv_a_proj_with_mqa" in mapped:
        q_name = mapped if "q_a_proj" in mapped else mapped.replace("kv_a_proj_with_mqa", "q_a_proj")
        fused = q_name.replace("q_a_proj", MLA_FUSED)
        return (fused, "q_a" if "q_a_proj" in mapped else "kv_a") if fused in names else None
    return (mapped, None) if mapped in names else None


@dataclass(frozen=True)
class DraftClass:
    """One of SGLang 0.5.23's EAGLE-3 draft classes: what the tool mirrors of it, each fact with its SGLang source.
    The one seam per draft class: the parameter mirror (:func:`sglang_parameters`), the weight-name resolver
    (:func:`resolve_name`), the weight checks (:mod:`helpers.draft.checks`) and the config checks
    (:mod:`helpers.draft.config_checks`) read these instead of comparing class names; the forward is the attention
    adapter's (:data:`helpers.draft.attention.ATTENTIONS`).

    Attributes:
        name: ``architectures[0]``; module: the SGLang file it lives in.
        defaults: the config-class defaults of the fields that size its parameters (``raw`` -> ``{field: value}``).
        inputs / layers / resolve: the construction mirrored (aux chunks and their width; the decoder layers) and
            where ``load_weights`` puts a checkpoint name.
        fc_init: fc's initial value when no tensor fills it.
        lm_head_build / load_skips / unexpected_weight: the lines that build lm_head, skip a missing tensor, and
            drop an unexpected one (and how).
        has_input_norm: ``norm_before_fc`` builds ``model.input_norm`` (else the flag is ignored).
        rope_read: where the decoder layer reads its rope.
        top_level_original_max_position: a top-level ``original_max_position_embeddings`` replaces rope_parameters'
            (``sglang/srt/models/llama.py::LlamaDecoderLayer.__init__`` l. 329-334).
        window_flag_ignored: a config's sliding window is ignored unless ``--speculative-draft-window-size``.
    """

    name: str
    module: str
    defaults: Callable[[dict], dict]
    inputs: Callable[..., tuple[int, int, bool, str]]
    layers: Callable[..., dict]
    resolve: Callable[[set, str], Any]
    fc_init: str
    lm_head_build: str
    load_skips: str
    unexpected_weight: str
    has_input_norm: bool
    rope_read: str
    top_level_original_max_position: bool
    window_flag_ignored: bool


_LLAMA_FILE = "sglang/srt/models/llama.py"
#: SGLang's EAGLE-3 draft classes by ``architectures[0]`` (another name is mirrored as the Llama class; the checks say
#: it is not one of these)
DRAFT_CLASSES = {
    LLAMA_CLASS: DraftClass(
        name=LLAMA_CLASS, module=L3, defaults=lambda raw: LLAMA_DEFAULTS, inputs=_llama_inputs, layers=_llama_layers,
        resolve=_llama_resolve, fc_init=INIT_LINEAR, lm_head_build=f"{L3}::LlamaForCausalLMEagle3.__init__ l. 305-314",
        load_skips=f"{L3} l. 363-378",
        unexpected_weight=f"{L3}::LlamaForCausalLMEagle3.load_weights l. 358-378 (a name not in params_dict is "
                          "skipped)",
        has_input_norm=True, rope_read=f"{_LLAMA_FILE}::LlamaDecoderLayer.__init__ l. 322-336 (rope_parameters -> "
                                       "get_rope)",
        top_level_original_max_position=True, window_flag_ignored=True),
    MLA_CLASS: DraftClass(
        name=MLA_CLASS, module=K25, defaults=mla_defaults, inputs=_mla_inputs, layers=_mla_layers,
        resolve=_mla_resolve, fc_init=INIT_EMPTY,
        lm_head_build=f"{K25}::Eagle3DeepseekV2ForCausalLM.__init__ l. 348-363", load_skips=f"{K25} l. 436-499",
        unexpected_weight=f"{K25}::load_weights l. 494-496 (warning 'skipping unexpected weight')",
        has_input_norm=False,
        rope_read=f"{K25}::Eagle3MLADecoderLayer.__init__ l. 80-89 (rope_parameters -> DeepseekV2AttentionMLA)",
        top_level_original_max_position=False, window_flag_ignored=False),
}


def draft_class(name: str) -> DraftClass:
    """The :class:`DraftClass` of ``architectures[0]`` (the Llama class for a name SGLang does not register as an
    EAGLE-3 draft: the checks report that apart)."""
    return DRAFT_CLASSES.get(name, DRAFT_CLASSES[LLAMA_CLASS])


def sglang_parameters(d: DraftConfig) -> "SGLangDraftParams":
    """Mirror of ``LlamaForCausalLMEagle3`` / ``Eagle3DeepseekV2ForCausalLM`` construction from the config:
    ``{(parameter, shard): (shape, initial value)}`` with the config facts that size it.

    Raises:
        BadInput: a config SGLang cannot build (a size field that is not a positive integer, ``target_hidden_size:
            null`` for the Llama draft, an MLA draft with another layer count than 1 or ``q_lora_rank: null``)."""
    raw, path = d.raw, d.path
    cls = d.architectures[0] if d.architectures else LLAMA_CLASS
    dc = draft_class(cls)
    ec = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    H = d.hidden_size
    defaults = dc.defaults(raw)
    defaulted = {k: v for k, v in defaults.items() if raw.get(k) is None and not (k == "q_lora_rank" and k in raw)}

    def field(key: str) -> int:
        return _int(raw, key, path, defaults[key])

    V = field("vocab_size")
    dv = _int(raw, "draft_vocab_size", path)
    tie = bool(raw.get("tie_word_embeddings", False))     # LlamaConfig / DeepseekV3Config default False
    naux, hin, norm_before_fc, source = dc.inputs(raw, path, H, ec, field)
    fc_norm = bool(raw.get("fc_norm") or raw.get("use_aux_norm", False))                    # l. 185-187
    norm_output = bool(raw.get("norm_output", False))                                       # l. 207
    lm_from_target = not tie and dv is None                                                  # l. 302-308
    draft_vocab = V if dv is None else dv

    params: dict = {}
    params[("model.embed_tokens.weight", None)] = ((V, H), INIT_EMPTY)
    params[("model.fc.weight", None)] = ((H, hin * naux), dc.fc_init)
    if raw.get("bias"):
        params[("model.fc.bias", None)] = ((H,), INIT_LINEAR)
    if norm_before_fc:
        params[("model.input_norm.weight", None)] = ((hin * naux,), INIT_RMSNORM)
    if fc_norm:
        for i in range(naux):
            params[(f"model.fc_norm.{i}.weight", None)] = ((hin,), INIT_RMSNORM)
    params[("model.norm.weight", None)] = ((H,), INIT_RMSNORM)
    if not tie:
        params[("lm_head.weight", None)] = ((draft_vocab, H), INIT_EMPTY)
    L = dc.layers(raw, path, H, field, params)
    nh, nkv, hd, inter, nlayers, attn_bias, mla = (L[k] for k in ("heads", "kv_heads", "head_dim", "intermediate",
                                                                  "layers", "attn_bias", "mla"))
    return SGLangDraftParams(cls=cls, params=params, defaulted=defaulted, num_aux=naux, hidden_size_in=hin,
                             fc_norm=fc_norm, norm_before_fc=norm_before_fc, norm_output=norm_output, tie=tie,
                             draft_vocab=draft_vocab, vocab=V, lm_from_target=lm_from_target,
                             midlayer_checked=True, source=source, heads=nh, kv_heads=nkv, head_dim=hd,
                             intermediate=inter, layers=nlayers, attn_bias=attn_bias,
                             unused=frozenset((f"model.layers.{i}.input_layernorm.weight", None)
                                              for i in range(1, nlayers)), **mla)


def resolve_name(arch: SGLangDraftParams, name: str) -> Any:
    """Where SGLang's ``load_weights`` puts checkpoint tensor ``name``: ``"d2t"``, ``"t2d"``, ``(param, shard)``
    (``shard``: q/k/v, 0/1 of gate/up, ``q_a`` / ``kv_a`` of the MLA draft's fused q_a / kv_a projection, else None),
    or None (dropped: silently for the Llama draft, with a warning for the MLA draft)."""
    return draft_class(arch.cls).resolve({p for p, _ in arch.params}, name)


def shape_error(arch: SGLangDraftParams, d: DraftConfig, key: str, info: TensorInfo, param: str, shard: Any,
                 expected: tuple) -> BadInput:
    """The load-time error SGLang raises for checkpoint tensor ``key`` (``info``: its file and shape) whose shape
    differs from the ``expected`` shape of ``param`` (``shard``: the q/k/v or gate/up slice, else None), as one
    :class:`helpers.errors.BadInput` naming the file and key and, for fc / lm_head / decoder-layer tensors, the config
    fields that size it (the shape assert of ``sglang/srt/model_loader/weight_utils.py::default_weight_loader`` and
    the layers' ``weight_loader``)."""
    why = ""
    if param == "model.fc.weight":
        naux_from = ("num_aux_hidden_states" if d.raw.get("num_aux_hidden_states") is not None
                     else "the eagle_config ids")
        why = (f": SGLang builds fc as Linear({arch.hidden_size_in} x {arch.num_aux} -> {d.hidden_size}) "
               f"(target_hidden_size {'from the config' if 'target_hidden_size' in d.raw else '= hidden_size'}, "
               f"{arch.num_aux} aux chunks from "
               f"{naux_from}"
               f"); the checkpoint's fc takes {info.shape[1] if len(info.shape) == 2 else '?'} "
               f"-- {arch.source}")
    elif param == "lm_head.weight":
        why = (f": SGLang builds lm_head with {arch.draft_vocab} rows ("
               + ("draft_vocab_size is absent, so vocab_size is used" if arch.lm_from_target else "draft_vocab_size")
               + f") -- {L3} l. 305-314")
    elif param.startswith("model.layers."):
        why = (" (hidden_size, num_attention_heads, num_key_value_heads, head_dim, intermediate_size of the config; "
               "layer 0's q/k/v take 2 x hidden_size)")
    elif param.startswith("model.midlayer."):
        why = (" (hidden_size, num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
               "v_head_dim, intermediate_size of the config; q_a_proj and kv_a_proj_with_mqa take 2 x hidden_size: "
               f"{arch.source})")
    shard_txt = f" (shard {shard} of {param})" if shard is not None else ""
    return BadInput(f"shape {list(info.shape)} but SGLang {SGLANG_RULES} loads it into {param}{shard_txt} of shape "
                    f"{list(expected)}{why}; the server fails at load (weight_loader shape assert)",
                    path=info.file, field=key)

