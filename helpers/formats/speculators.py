"""speculators-format drafts (``speculators_model_type``, ``transformer_layer_config``, ``speculators_config``; the
``Eagle3Speculator`` checkpoints the speculators library writes, e.g. the RedHatAI EAGLE-3 drafts), read the way vLLM
0.32.0 reads them, and the conversion of an SGLang / SpecForge EAGLE-3 draft into that format the way speculators'
converter does it.

What vLLM 0.32.0 does with such a draft (``--speculative-config '{"method": "eagle3", "model": DRAFT}'``):

* ``vllm/transformers_utils/config.py::HFConfigParser.parse``: a config.json without ``model_type`` but with
  ``speculators_config`` is parsed as ``model_type = "speculators"`` -> ``vllm/transformers_utils/configs/speculators/
  base.py::SpeculatorsConfig.from_pretrained``.
* ``SpeculatorsConfig.extract_transformers_pre_trained_config``: the config vLLM's draft model reads is
  ``transformer_layer_config`` (every key), updated by the algorithm's function of ``SUPPORTED_SPECULATORS_TYPES``
  (an unknown ``speculators_model_type`` raises ``ValueError``).
* ``vllm/transformers_utils/configs/speculators/algos.py::update_eagle3``: ``draft_vocab_size`` (None when absent;
  ``model_executor/models/llama_eagle3.py::Eagle3LlamaForCausalLM.__init__`` then takes ``vocab_size``),
  ``target_hidden_size`` (only when not None), ``norm_before_residual`` (**default True**), ``norm_before_fc``,
  ``fc_norm``, ``norm_output`` (default False), ``architectures`` from ``transformer_layer_config.model_type``
  (``llama`` -> ``Eagle3LlamaForCausalLM``, ``qwen3`` -> ``Eagle3Qwen3ForCausalLM``, default ``llama``, another
  raises ``ValueError``), and a truthy top-level ``eagle_aux_hidden_state_layer_ids`` copied as is (vLLM's
  convention: id i captured as in(i), verbatim: :mod:`helpers.layers.vllm`).
* ``vllm/config/speculative.py::SpeculativeConfig.__post_init__``: a ``SpeculatorsConfig`` is kept as the draft's
  hf_config (no ``EAGLEConfig`` wrapper), so no ``eagle_config`` exists unless ``transformer_layer_config`` holds
  one; ``llama_eagle3.py::LlamaModel.__init__`` then takes ``num_aux_hidden_states`` 3 and ``use_aux_hidden_state``
  True.
* Weights (``llama_eagle3.py::Eagle3LlamaForCausalLM.load_weights``): ``t2d`` skipped, ``d2t`` ->
  ``draft_id_to_target_id``, ``lm_head.*`` as is, every other name under ``model.`` (``layers.0.*``, ``fc.weight``,
  ``norm.weight``, ``embed_tokens.weight``; a legacy ``midlayer.`` is mapped to ``layers.0.`` by
  ``LlamaModel.hf_to_vllm_mapper``); ``embed_tokens`` / ``lm_head`` present mark the draft's own
  (``model_executor/models/utils.py::process_eagle_weight``), shared with the target's when equal
  (``v1/spec_decode/llm_base_proposer.py::_maybe_share_embeddings`` / ``_maybe_share_lm_head``).
* ``speculators_config`` (``proposal_methods[0].speculative_tokens``, ``verifier.name_or_path``) is read only when the
  speculators checkpoint is given as the served *model* (``transformers_utils/config.py::
  maybe_override_with_speculators``), not as ``--speculative-config`` ``model``.

SGLang 0.5.23 reads none of this: its draft config class is chosen by ``architectures`` through
``sglang/srt/models/registry.py`` (``Eagle3Speculator`` is no SGLang model class), and no SGLang file names
``speculators_model_type`` (:func:`helpers.diagnosis.sglang_rules.draft_servable` says so, with the conversion).
"""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from safetensors import safe_open

from ..errors import BadInput

#: vLLM 0.32.0's ``update_eagle3`` architecture map (``transformer_layer_config.model_type`` -> draft class)
EAGLE3_ARCH_MAP = {"qwen3": "Eagle3Qwen3ForCausalLM", "llama": "Eagle3LlamaForCausalLM"}
#: the ``speculators_model_type`` values vLLM 0.32.0 registers (``algos.py`` ``SUPPORTED_SPECULATORS_TYPES``)
VLLM_SPECULATORS_TYPES = ("eagle3", "peagle", "dflash", "dflash2", "dspark")
SOURCES = {
    "parse": "vllm/transformers_utils/config.py::HFConfigParser.parse (model_type 'speculators' when "
             "speculators_config is set)",
    "extract": "vllm/transformers_utils/configs/speculators/base.py::SpeculatorsConfig."
               "extract_transformers_pre_trained_config",
    "eagle3": "vllm/transformers_utils/configs/speculators/algos.py::update_eagle3",
    "load": "vllm/model_executor/models/llama_eagle3.py::Eagle3LlamaForCausalLM.load_weights",
    "converter": "vllm-project/speculators src/speculators/convert/converters/eagle3.py::Eagle3SpeculatorConverter"
                 " (convert_config_state_dict, _speculator_config, _pretrained_config, _speculator_state_dict)",
    "config": "vllm-project/speculators src/speculators/models/eagle3/config.py::Eagle3SpeculatorConfig",
}


def is_speculators(raw: Mapping[str, Any]) -> bool:
    """True for a speculators-format config: ``speculators_model_type`` set, or (vLLM's own test, :data:`SOURCES`
    ``parse``) ``speculators_config`` set with no ``model_type``."""
    return "speculators_model_type" in raw or (raw.get("speculators_config") is not None
                                               and raw.get("model_type") is None)


@dataclass
class SpeculatorsDraft:
    """A speculators-format draft config as vLLM 0.32.0 reads it.

    Attributes:
        model_type: ``speculators_model_type`` (``eagle3`` ...).
        view: the flat config dict vLLM's draft model reads (``transformer_layer_config`` + the fields
            ``update_eagle3`` sets, :func:`vllm_view`); the tool's draft code reads it as an EAGLE-3 config.
        architecture: the vLLM draft class it maps to (``Eagle3LlamaForCausalLM``), None when vLLM refuses it.
        problem: why vLLM refuses it (one sentence naming the rule), or None.
        defaulted: the eagle3 fields the file leaves out, with the value vLLM then uses.
        verifier: ``speculators_config.verifier.name_or_path`` (None when absent).
        speculative_tokens: ``speculators_config.proposal_methods[0].speculative_tokens`` (None when absent).
    """

    model_type: str
    view: dict
    architecture: Optional[str]
    problem: Optional[str]
    defaulted: dict = field(default_factory=dict)
    verifier: Optional[str] = None
    speculative_tokens: Optional[int] = None


def vllm_view(raw: Mapping[str, Any], path: Optional[Path] = None) -> SpeculatorsDraft:
    """The draft config vLLM 0.32.0 builds from a speculators-format config.json (:data:`SOURCES` ``extract`` and
    ``eagle3``): a copy of ``transformer_layer_config`` with ``draft_vocab_size``, ``target_hidden_size`` (when not
    None), ``norm_before_residual`` (default True), ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` (default False),
    ``architectures`` and a truthy ``eagle_aux_hidden_state_layer_ids`` from the top level.

    Args:
        raw: the parsed config.json. path: the file, for error messages.

    Raises:
        BadInput: ``transformer_layer_config`` present but not an object (vLLM: "'transformer_layer_config' must be a
            dictionary"), ``speculators_model_type`` not a string, ``norm_before_residual`` / ``norm_before_fc`` /
            ``fc_norm`` / ``norm_output`` present but not true / false.
    """
    smt = raw.get("speculators_model_type")
    if smt is not None and not isinstance(smt, str):
        raise BadInput(f"expected a string, got {smt!r}", path=path, field="speculators_model_type")
    tl = raw.get("transformer_layer_config")
    if tl is not None and not isinstance(tl, dict):
        raise BadInput(f"expected an object (vLLM: 'transformer_layer_config' must be a dictionary), got "
                       f"{type(tl).__name__}", path=path, field="transformer_layer_config")
    view = dict(tl or {})
    sc = raw.get("speculators_config") if isinstance(raw.get("speculators_config"), Mapping) else {}
    methods = sc.get("proposal_methods") if isinstance(sc.get("proposal_methods"), list) else []
    tokens = methods[0].get("speculative_tokens") if methods and isinstance(methods[0], Mapping) else None
    verifier = sc.get("verifier") if isinstance(sc.get("verifier"), Mapping) else {}
    out = SpeculatorsDraft(model_type=str(smt), view=view, architecture=None, problem=None,
                           verifier=verifier.get("name_or_path") if isinstance(verifier.get("name_or_path"), str)
                           else None,
                           speculative_tokens=tokens if isinstance(tokens, int) and not isinstance(tokens, bool)
                           else None)
    if smt != "eagle3":
        out.problem = (f"speculators_model_type {smt!r} is not an EAGLE-3 draft: vLLM 0.32.0 reads "
                       f"{list(VLLM_SPECULATORS_TYPES)} ({SOURCES['extract']}) and this tool reads eagle3 only")
        for k in ("draft_vocab_size", "target_hidden_size"):
            if raw.get(k) is not None:
                view[k] = raw[k]
        return out
    view["draft_vocab_size"] = raw.get("draft_vocab_size")
    if raw.get("target_hidden_size") is not None:
        view["target_hidden_size"] = raw["target_hidden_size"]
    for key, default in (("norm_before_residual", True), ("norm_before_fc", False), ("fc_norm", False),
                         ("norm_output", False)):
        if key in raw and not isinstance(raw[key], bool):
            raise BadInput(f"expected true or false, got {str(raw[key])[:40]!r}: vLLM 0.32.0 tests it for truth "
                           "(vllm/model_executor/models/llama_eagle3.py::LlamaDecoderLayer.__init__: getattr(config, "
                           f"'{key}', False)), so any non-empty string, 'false' included, reads as true",
                           path=path, field=key)
        view[key] = raw.get(key, default)
        if key not in raw:
            out.defaulted[key] = default
    model_type = view.get("model_type", "llama")
    if model_type not in EAGLE3_ARCH_MAP:
        out.problem = (f"transformer_layer_config.model_type {model_type!r}: vLLM 0.32.0 raises 'Unsupported "
                       f"model_type {model_type} for Eagle3 speculator' (it maps {sorted(EAGLE3_ARCH_MAP)}: "
                       f"{SOURCES['eagle3']})")
    else:
        out.architecture = EAGLE3_ARCH_MAP[model_type]
        view["architectures"] = [out.architecture]
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        view["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
    return out


def vllm_weight_name(name: str) -> Optional[str]:
    """Where vLLM 0.32.0's ``Eagle3LlamaForCausalLM.load_weights`` puts checkpoint tensor ``name`` (:data:`SOURCES`
    ``load``): ``"draft_id_to_target_id"`` for ``d2t``, None for ``t2d`` (skipped), ``lm_head.*`` as is, every other
    name under ``model.`` with ``midlayer.`` -> ``layers.0.`` (``LlamaModel.hf_to_vllm_mapper``), e.g.
    ``layers.0.self_attn.q_proj.weight`` -> ``model.layers.0.self_attn.q_proj.weight`` (stacked into ``qkv_proj``
    by the loader)."""
    if "t2d" in name:
        return None
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id")
    if "lm_head" in name:
        return name
    return "model." + name.replace("midlayer.", "layers.0.")


# ------------------------------------------------------------------------------------------------ the converter

def _llama_layer_config(orig: Mapping[str, Any], verifier: Mapping[str, Any], target_vocab: int) -> dict:
    """``Eagle3SpeculatorConverter._pretrained_config``: the LlamaConfig fields it forwards from the EAGLE-3 config,
    with its defaults; ``max_position_embeddings`` the larger of draft and verifier; ``rope_theta`` forwarded (as
    transformers 5 writes it, also as ``rope_parameters``), ``rope_scaling`` not (the converter drops it)."""
    theta = orig.get("rope_theta")
    if theta is None and isinstance(orig.get("rope_parameters"), Mapping):
        theta = orig["rope_parameters"].get("rope_theta")
    theta = float(theta if theta is not None else 10000.0)
    hidden = int(orig.get("hidden_size", 4096))
    heads = int(orig.get("num_attention_heads", 32))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": int(target_vocab),
            "hidden_size": hidden, "intermediate_size": int(orig.get("intermediate_size", 11008)),
            "num_hidden_layers": 1, "num_attention_heads": heads,
            "num_key_value_heads": int(orig.get("num_key_value_heads", 8)), "head_dim": hidden // heads,
            "hidden_act": orig.get("hidden_act", "silu"),
            "max_position_embeddings": max(int(orig.get("max_position_embeddings", 4096)),
                                           int(verifier.get("max_position_embeddings", 4096))),
            "initializer_range": orig.get("initializer_range", 0.02), "rms_norm_eps": orig.get("rms_norm_eps", 1e-6),
            "use_cache": True, "attention_bias": bool(orig.get("attention_bias", False)), "rope_theta": theta,
            "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
            "mlp_bias": bool(orig.get("mlp_bias", False)), "tie_word_embeddings": False}


def convert_eagle3_to_speculators(draft_dir: str | Path, out_dir: str | Path, verifier_dir: str | Path, *,
                                  norm_before_residual: bool = False, keep_layer_ids: bool = True,
                                  speculative_tokens: int = 5) -> Path:
    """Write ``out_dir`` (config.json + model.safetensors): the SGLang / SpecForge EAGLE-3 draft of ``draft_dir`` in
    the speculators format, as speculators' converter writes it (:data:`SOURCES` ``converter`` and ``config``).

    Config: ``architectures ["Eagle3Speculator"]``, ``speculators_model_type "eagle3"``, ``transformer_layer_config``
    (:func:`_llama_layer_config`, ``vocab_size`` = the ``t2d`` length when the checkpoint has one, as the converter
    patches ``target_vocab_size``), ``draft_vocab_size`` (converter default 32000), ``norm_before_residual``
    (written explicitly: vLLM reads an absent one as True), ``target_hidden_size`` (null when absent),
    ``speculators_config`` (algorithm eagle3, one greedy proposal method of ``speculative_tokens``, the verifier's
    path and architectures). With ``keep_layer_ids`` the draft's layer ids (``eagle_config`` or top level) go to the
    top-level ``eagle_aux_hidden_state_layer_ids`` (the ``Eagle3SpeculatorConfig`` field vLLM reads; the converter
    read does not forward them, so its output falls back to vLLM's default ids).

    Weights (``_speculator_state_dict``): ``model.`` stripped, ``midlayer.*`` -> ``layers.0.*``; ``d2t``, ``t2d``,
    ``embed_tokens.*``, ``fc.*``, ``lm_head.*``, ``norm.*`` kept; other tensors dropped; ``embed_tokens.weight`` taken
    from the verifier (``model.embed_tokens.weight`` or ``embed_tokens.weight``) when the draft has none. Tensors are
    written bit for bit (same dtype).

    Raises:
        BadInput: no draft config / weights, or the draft has no embedding and the verifier has none either.
    """
    from safetensors.torch import load_file, save_file   # lazy: loads torch; reading a config must not
    from .configs import read_config_json, read_safetensors_index   # lazy: configs imports this module

    draft_dir, out_dir, verifier_dir = Path(draft_dir), Path(out_dir), Path(verifier_dir)
    orig = read_config_json(draft_dir, "draft config")
    vcfg = read_config_json(verifier_dir, "verifier (target) config")
    tensors = read_safetensors_index(draft_dir)
    state: dict = {}
    for f in sorted({i.file for i in tensors.values()}):
        state.update(load_file(str(f)))
    target_vocab = int(state["t2d"].shape[0]) if "t2d" in state else int(orig.get("vocab_size", 128000))
    converted: dict = {}
    for name, t in state.items():
        n = name[len("model."):] if name.startswith("model.") else name
        if n.startswith("midlayer."):
            converted["layers.0." + n[len("midlayer."):]] = t
        elif n.startswith(("d2t", "t2d", "embed_tokens.", "fc.", "lm_head.", "norm.", "layers.0.")):
            converted[n] = t
    if "embed_tokens.weight" not in converted:
        vt = read_safetensors_index(verifier_dir)
        key = next((k for k in ("model.embed_tokens.weight", "embed_tokens.weight") if k in vt), None)
        if key is None:
            raise BadInput("embed_tokens.weight not found in the EAGLE-3 checkpoint or the verifier", path=verifier_dir)
        with safe_open(str(vt[key].file), framework="pt") as sf:
            converted["embed_tokens.weight"] = sf.get_tensor(key)
    ec = orig.get("eagle_config") if isinstance(orig.get("eagle_config"), Mapping) else {}
    ids = orig.get("eagle_aux_hidden_state_layer_ids") or ec.get("eagle_aux_hidden_state_layer_ids")
    config: dict = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "transformer_layer_config": _llama_layer_config(orig, vcfg, target_vocab),
        "draft_vocab_size": int(orig.get("draft_vocab_size", 32000)), "norm_before_residual": bool(norm_before_residual),
        "target_hidden_size": orig.get("target_hidden_size"),
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"proposal_type": "greedy",
                                                     "speculative_tokens": int(speculative_tokens)}],
                               "verifier": {"name_or_path": str(verifier_dir),
                                            "architectures": list(vcfg.get("architectures") or
                                                                  ["LlamaForCausalLM"])}},
        "torch_dtype": orig.get("torch_dtype") or orig.get("dtype") or "bfloat16",
    }
    if keep_layer_ids and ids:
        config["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in ids]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file({k: v.contiguous() for k, v in converted.items()}, str(out_dir / "model.safetensors"))
    for extra in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (draft_dir / extra).is_file():
            shutil.copy2(draft_dir / extra, out_dir / extra)
    return out_dir


def sglang_conversion(draft: Any) -> tuple[dict, str]:
    """``(config, text)``: the SGLang / SpecForge EAGLE-3 config.json a speculators-format ``draft``
    (:class:`helpers.formats.configs.DraftConfig` of form ``speculators``) converts to for SGLang 0.5.23, and the
    fix in words. The weights need no change (SGLang's ``llama_eagle3.py::LlamaForCausalLMEagle3.load_weights`` reads
    ``layers.0.*`` / ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``; it ignores ``t2d`` and
    ``embed_tokens``, taking the target's embedding).

    The config: vLLM's flat view (``transformer_layer_config`` + the eagle3 fields) with ``architectures
    ["LlamaForCausalLMEagle3"]`` and the layer ids moved to ``eagle_config.eagle_aux_hidden_state_layer_ids`` in
    SGLang's numbering (vLLM id i captures in(i) = out(i-1); SGLang's Llama capture adds 1 to a config id, so out(i-1)
    is SGLang id i-1: ``sglang/srt/models/llama.py::LlamaForCausalLM.set_eagle3_layers_to_capture``)."""
    view = dict(draft.raw)
    view.pop("eagle_aux_hidden_state_layer_ids", None)
    view["architectures"] = ["LlamaForCausalLMEagle3"]
    ids = draft.top_level_layer_ids
    if ids:
        view["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in ids],
                                "use_aux_hidden_state": True}
    text = ("convert the config to SGLang's EAGLE-3 layout (the weights load as they are): the fields of "
            "transformer_layer_config at the top level, architectures [\"LlamaForCausalLMEagle3\"], draft_vocab_size"
            + (f", the vLLM ids {list(ids)} (in(i)) as eagle_config.eagle_aux_hidden_state_layer_ids "
               f"{[int(i) - 1 for i in ids]} (SGLang adds 1)" if ids else
               ", no ids (SGLang then captures its default, vLLM's default differs)"))
    if view.get("norm_before_residual"):
        text += ("; norm_before_residual is true and SGLang has no such option (llama_eagle3.py::LlamaDecoderLayer "
                 "adds the un-normed hidden state): the converted draft runs unlike its training on SGLang")
    return view, text
