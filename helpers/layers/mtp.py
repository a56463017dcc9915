"""MTP / NextN heads: the draft family a DeepSeek / GLM / Qwen-Next / MiMo target carries in its own checkpoint
(``num_nextn_predict_layers`` extra layers after the last decoder layer), as SGLang 0.5.23 and vLLM 0.32.0 load it.
One entry of :data:`MTP_FAMILIES` per model family; the config checks (``helpers.draft.mtp_checks``), the draft config
reader (``helpers.formats.configs.read_draft_config``: ``form == "mtp"``) and the attach (``helpers.investigation.
attach``) read these entries instead of comparing class names. Imports nothing of ``helpers``.

What the two engines do with such a head (read in the installed source):

* SGLang: ``--speculative-algorithm NEXTN`` is an alias of ``EAGLE``
  (``sglang/srt/arg_groups/speculative_hook.py::_resolve_speculative_algorithm_alias`` l. 81-117). The draft's
  config is the target's (``configs/model_config.py::ModelConfig.from_server_args`` l. 956: ``model_path or
  cfg.model_path``; for the DeepSeek / GLM targets ``_handle_eagle_family`` l. 1120-1157 also sets
  ``speculative_draft_model_path = model_path``, so ``/server_info`` names it), and a draft whose
  ``architectures[0]`` is the target's class is rewritten to the family's head class
  (``configs/model_config.py::ModelConfig._config_draft_model`` l. 1010-1200). The head's own tensors sit under a
  checkpoint prefix (:attr:`MTPFamily.prefix`); its embedding and lm_head are the target's
  (``speculative/eagle_worker_v2.py::EagleDraftWorker.init_lm_head`` l. 371-378: ``set_embed_and_head``).
  ``--speculative-num-steps`` runs the one head that many times on its own output hidden state
  (``eagle_worker_v2.py::EagleDraftWorker.draft_forward`` l. 742-830: one model, ``for i in range(num_steps)``).
* vLLM: ``method: mtp`` (the per-family names such as ``deepseek_mtp`` are deprecated aliases,
  ``vllm/config/speculative.py::SpeculativeConfig.__post_init__`` l. 1141-1145); without ``model`` the target's
  folder is the draft's (l. 1147-1163); ``hf_config_override`` (l. 661-1074) maps the target's config to the head's
  class with ``n_predict`` = the layer field; ``num_speculative_tokens`` defaults to ``n_predict`` and must be a
  multiple of it when larger (l. 1478-1501), and the head layers are reused round-robin
  (``model_executor/models/deepseek_mtp.py::DeepSeekMultiTokenPredictor.forward`` l. 217: ``spec_step_idx %
  num_mtp_layers``), with the warning "Enabling num_speculative_tokens > 1 will run multiple times of forward on same
  MTP layer" (``speculative.py`` l. 1375-1385).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Optional, Sequence

_SG = "sglang/srt"
_VL = "vllm/model_executor/models"
#: where SGLang rewrites the draft's architecture (and, for some families, its layer count)
REWRITE = f"{_SG}/configs/model_config.py::ModelConfig._config_draft_model"
#: where SGLang sets the draft path to the target's for the DeepSeek / GLM targets
DRAFT_PATH_RULE = f"{_SG}/arg_groups/speculative_hook.py::_handle_eagle_family l. 1120-1157"
#: where SGLang falls back to the target's folder when no draft path is given
DRAFT_CONFIG_FALLBACK = (f"{_SG}/configs/model_config.py::ModelConfig.from_server_args l. 956 "
                         "(model_path or cfg.model_path)")
#: the algorithm alias
ALIAS_RULE = f"{_SG}/arg_groups/speculative_hook.py::_resolve_speculative_algorithm_alias l. 81-117 (NEXTN -> EAGLE)"
#: the one head run once per draft step
STEPS_RULE = (f"{_SG}/speculative/eagle_worker_v2.py::EagleDraftWorker.draft_forward l. 742-830 (the one draft model "
              "run speculative_num_steps times, each step on the hidden state the head itself produced)")
VLLM_CONFIG = "vllm/config/speculative.py::SpeculativeConfig"
#: where vLLM refuses ``method: mtp`` for a target whose config it does not map to an MTP head
VLLM_NO_HEAD_RULE = (f"{VLLM_CONFIG}.hf_config_override l. 661-1074 (no rewrite for this target) and __post_init__ "
                     "l. 1325-1391 (draft model_type not in MTPModelTypes: NotImplementedError)")
#: The head layers SGLang 0.5.23 builds for the draft, whatever the config declares (0, absent or several): the
#: DeepSeek / GLM loaders accept exactly 1 (``deepseek_weight_loader.py::_initialize_nextn_conf`` l. 566); Qwen3.5 /
#: Qwen3-Next / MiMo get ``num_nextn_predict_layers = 1`` from ``configs/model_config.py::ModelConfig.
#: _config_draft_model`` and one decoder layer (``qwen3_5_mtp.py::Qwen3_5ForCausalLMMTP.__init__``: ``mtp_config.
#: num_hidden_layers = 1``; ``mimo_mtp.py::MiMoMultiTokenPredictorLayer.__init__``: one ``mtp_block``); LongCat-Flash /
#: MiMo-V2 one decoder layer (``longcat_flash_nextn.py::LongcatFlashModelNextN.__init__``: one ``decoder``;
#: ``mimo_v2_nextn.py::MiMoV2ModelNextN``: one ``mtp_block``).
SGLANG_BUILT_LAYERS = 1
#: The most head layers a config may declare (``num_nextn_predict_layers``). Neither engine states a bound: SGLang's
#: DeepSeek / GLM loaders accept exactly 1 (``sglang/srt/models/deepseek_common/deepseek_weight_loader.py::
#: DeepseekV2WeightLoaderMixin._initialize_nextn_conf`` l. 566: ``assert num_nextn_layers == 1``); vLLM builds one
#: decoder layer per head layer (``vllm/model_executor/models/deepseek_mtp.py::DeepSeekMultiTokenPredictor.__init__``
#: l. 152-164: a ModuleDict over ``range(num_hidden_layers, num_hidden_layers + num_nextn_predict_layers)``), so a
#: count past a handful is a config error that ends in an out-of-memory at load. Released heads have 1 (DeepSeek-V3,
#: GLM-4.5, Qwen3-Next, MiMo-7B); past this bound the checks refuse the config rather than list its layers.
MAX_MTP_LAYERS = 64
#: The most routed experts a config may declare (``n_routed_experts``): this tool's bound, not an engine's (neither
#: SGLang 0.5.23 nor vLLM 0.32.0 states one). :func:`deepseek_nextn_shapes` names every expert's tensors, so a count
#: of 1e9 would build 3e9 names; released MoE heads have 256 (DeepSeek-V3) to 384 (Kimi-K2) experts.
MAX_EXPERTS = 4096
#: The most decoder layers a config may declare (``num_hidden_layers``): this tool's bound, not an engine's; the
#: head's prefix ``model.layers.{num_hidden_layers}.`` is built from it (released targets: 61 for DeepSeek-V3).
MAX_HIDDEN_LAYERS = 100_000
#: The config sizes :func:`deepseek_nextn_shapes` reads, as ``(field, minimum, maximum or None, null allowed)``:
#: ``helpers.formats.configs.read_mtp_head`` refuses a present one of the wrong type or range (one line naming it)
#: instead of dropping it. ``q_lora_rank`` may be null (DeepSeek-V2-Lite: no q LoRA; the names then are not expanded).
DEEPSEEK_SIZE_FIELDS = (
    ("hidden_size", 1, None, False), ("num_attention_heads", 1, None, False), ("q_lora_rank", 1, None, True),
    ("kv_lora_rank", 1, None, False), ("qk_nope_head_dim", 1, None, False), ("qk_rope_head_dim", 0, None, False),
    ("v_head_dim", 1, None, False), ("n_routed_experts", 1, MAX_EXPERTS, True),
    ("moe_intermediate_size", 1, None, True), ("n_shared_experts", 0, None, True))


def _after_last(n: int, i: int) -> str:
    """``model.layers.{n + i}.`` (vLLM: ``mtp_start_layer_idx = num_hidden_layers``)."""
    return f"model.layers.{n + i}."


def sglang_nextn_layer(n: int) -> int:
    """The checkpoint layer SGLang's DeepSeek / GLM NextN loader reads the head from, for a config with
    ``num_hidden_layers`` ``n``: ``n``, or 0 for a separate NextN checkpoint whose ``num_hidden_layers`` is 1
    (``deepseek_weight_loader.py::_initialize_nextn_conf``: ``nextn_layer_id = 0 if num_hidden_layers == 1 else
    num_hidden_layers``)."""
    return 0 if n == 1 else n


def _sglang_nextn(n: int, i: int) -> str:
    """SGLang's DeepSeek / GLM NextN prefix: ``model.layers.{sglang_nextn_layer(n)}.``."""
    return f"model.layers.{sglang_nextn_layer(n)}."


def deepseek_nextn_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor SGLang's DeepSeek-V3 NextN loader fills, ``model.layers.{L}.<name>`` with ``L =``
    :func:`sglang_nextn_layer` of ``num_hidden_layers``, per expert as checkpoints store them, with the shape the
    config.json dict ``cfg`` implies (``sglang/srt/models/deepseek_v2.py::DeepseekV2AttentionMLA.__init__`` /
    ``DeepseekV2MoE.__init__``, unquantised; ``deepseek_nextn.py::DeepseekModelNextN.__init__``: ``enorm``, ``hnorm``,
    ``eh_proj`` [H, 2H], ``shared_head.norm``). The NextN layer's ``embed_tokens`` / ``shared_head.head`` copies are
    left out: SGLang skips them and binds the target's (``deepseek_common/deepseek_weight_loader.py::
    DeepseekV2WeightLoaderMixin.do_load_weights``: "Use shared head and embed weights from target model").

    Raises:
        KeyError / TypeError / ValueError: a field the MLA + MoE layer needs is absent, not an int, or out of the
            range of :data:`DEEPSEEK_SIZE_FIELDS` (``n_routed_experts`` over :data:`MAX_EXPERTS`)."""
    for k, lo, hi, _ in DEEPSEEK_SIZE_FIELDS:
        v = cfg.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi)):
            raise ValueError(f"{k} {v!r} is not an integer {lo}-{hi if hi is not None else 'inf'}")
    p = f"model.layers.{sglang_nextn_layer(int(cfg['num_hidden_layers']))}."
    H, nh = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    ql, kl, nope, rope, v = (int(cfg[k]) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                                    "qk_rope_head_dim", "v_head_dim"))
    E, inter = int(cfg["n_routed_experts"]), int(cfg.get("moe_intermediate_size") or 0)
    out = {f"{p}{n}.weight": (H,) for n in ("enorm", "hnorm", "shared_head.norm")}
    out[f"{p}eh_proj.weight"] = (H, 2 * H)
    out.update({f"{p}input_layernorm.weight": (H,), f"{p}post_attention_layernorm.weight": (H,)})
    attn = {"q_a_proj": (ql, H), "q_a_layernorm": (ql,), "q_b_proj": (nh * (nope + rope), ql),
            "kv_a_proj_with_mqa": (kl + rope, H), "kv_a_layernorm": (kl,), "kv_b_proj": (nh * (nope + v), kl),
            "o_proj": (H, nh * v)}
    out.update({f"{p}self_attn.{n}.weight": s for n, s in attn.items()})
    out[f"{p}mlp.gate.weight"] = (E, H)
    if cfg.get("topk_method", "noaux_tc") == "noaux_tc":
        out[f"{p}mlp.gate.e_score_correction_bias"] = (E,)
    for e in range(E):
        out.update({f"{p}mlp.experts.{e}.gate_proj.weight": (inter, H), f"{p}mlp.experts.{e}.up_proj.weight": (inter, H),
                    f"{p}mlp.experts.{e}.down_proj.weight": (H, inter)})
    ns = int(cfg.get("n_shared_experts") or 0)
    if ns:
        out.update({f"{p}mlp.shared_experts.gate_proj.weight": (inter * ns, H),
                    f"{p}mlp.shared_experts.up_proj.weight": (inter * ns, H),
                    f"{p}mlp.shared_experts.down_proj.weight": (H, inter * ns)})
    return out


def _deepseek_expected(cfg: dict) -> tuple[str, ...]:
    """:func:`deepseek_nextn_shapes`' names relative to the layer prefix; () when the config lacks the MLA / MoE
    fields (a config these checks cannot expand: the family's :attr:`MTPFamily.layer_tensors` stand in)."""
    try:
        names = deepseek_nextn_shapes(cfg)
    except (KeyError, TypeError, ValueError):
        return ()
    return tuple(n.split(".", 3)[3] for n in names)


@dataclass(frozen=True)
class Refusal:
    """An engine's start-up refusal over the head's tensors (raised by the head class's ``load_weights``).

    Attributes:
        when: ``any_missing`` (any head parameter left unfilled: Step-3.5's ``params_need_to_load != loaded_params``)
            or ``none_present`` (no tensor of the head at all: ERNIE-4.5's ``mtp_layer_found``; a partial head starts),
            or ``any_present`` (any tensor of the head's layers: :attr:`MTPFamily.sglang_single_layer_refusal`).
        error: the exception as raised.
        source: file::function and line of the raise.
    """

    when: str
    error: str
    source: str


@dataclass(frozen=True)
class MTPFamily:
    """One model family's MTP / NextN head, as SGLang 0.5.23 and vLLM 0.32.0 load it.

    Attributes:
        name: the family (``deepseek_v3``, ``glm4_moe``, ``glm4_moe_lite``, ``qwen3_5``, ``qwen3_next``, ``mimo``,
            ``longcat_flash``, ``mimo_v2``, ``step3p5``, ``ernie4_5_moe``, ``qwen3_moe``,
            ``bailing_moe``).
        target_archs: the target ``architectures[0]`` SGLang rewrites into :attr:`head_arch` for the draft.
        head_arch / head_file: SGLang's head class and the file defining it (also the ``architectures`` of a
            separate head checkpoint).
        layers_field: the config field the engines read for the number of head layers.
        config_default: the value the family's transformers config class (5.19, both engines' venvs) gives the field
            when config.json leaves it out (``DeepseekV3Config`` / ``Glm4MoeConfig``: 1), None when the class has no
            such field (the engines then see it absent).
        sglang_layers: the value SGLang writes into that field for the draft (None: read as the config says).
        sglang_loader: SGLang's function that reads the field and the head's tensors (with its refusals).
        sglang_exactly_one: SGLang's loader refuses any layer count but 1 (ValueError when the field is absent,
            AssertionError "Only 1 nextn layer is supported" otherwise).
        draft_path_default: SGLang sets ``speculative_draft_model_path`` to the target's folder
            (:data:`DRAFT_PATH_RULE`); otherwise it is left None and ``/server_info`` reports null.
        sglang_prefix / vllm_prefix: ``(num_hidden_layers, head layer i) -> checkpoint prefix`` of the head layer.
        head_tensors: the head's own tensors (beyond the decoder layer) under the prefix.
        layer_tensors: tensors of the head's decoder layer under the prefix (one suffices to show it is there).
        vllm_arch / vllm_file: vLLM's head class (after ``hf_config_override``) and its file.
        vllm_layers_default: what vLLM's head assumes when the field is absent (None: ``n_predict`` is None).
        vllm_reuse: the line where vLLM picks the head layer of a draft step.
        expected: ``config.json dict -> every tensor name of a head layer relative to its prefix`` when the family's
            layer can be expanded from the config (DeepSeek-V3: :func:`deepseek_nextn_shapes`), else None (the
            presence check then reads :attr:`head_tensors` and one of :attr:`layer_tensors`).
        own_copies: the head's own copies of the target's lm_head / embedding under its prefix
            (``shared_head.head.weight``, ``embed_tokens.weight``), which neither engine serves
            (``helpers.draft.mtp_weights``); () when the family's checkpoints carry none.
        sglang_later_layers: what SGLang does with the checkpoint's head layers past the first, for a config that
            declares more than one (SGLang builds one head layer for every family: :data:`SGLANG_BUILT_LAYERS`).
        vllm_n_predict: the ``n_predict`` vLLM's ``hf_config_override`` writes whatever the config declares (MiMo-V2:
            ``_MIMO_V2_FLASH_NUM_MTP_LAYERS`` = 1), None: the layer field's value.
        vllm_built: the head layers vLLM's head class builds whatever ``n_predict`` is (LongCat-Flash / MiMo-V2:
            ``num_mtp_layers = 1``), None: ``n_predict`` of them.
        vllm_n_predict_absent: the ``n_predict`` vLLM's ``hf_config_override`` writes when the layer field is absent
            (Step-3.5: ``getattr(hf_config, "num_nextn_predict_layers", 1)``), None: n_predict stays None.
        sglang_layer_per_step: the ``--speculative-algorithm`` values, as typed, for which SGLang builds one head model
            per draft step (multi-layer EAGLE), step ``i`` reading head layer ``i`` (:attr:`sglang_prefix` ``(n, i)``;
            steps past the checkpoint's layers find no tensors). SGLang's model override
            (``arg_groups/overrides.py::_step3p_overrides`` l. 346-350, ``arg_groups/model_overrides/mimo_v2.py::
            _mimo_v2_overrides`` l. 23-25) tests ``speculative_algorithm == "EAGLE"`` in
            ``model_hook.py::handle_model_specific_adjustments`` (``arg_groups/pipeline.py`` l. 225), before
            ``speculative_hook.py::handle_speculative_decoding`` (l. 306) upper-cases it and aliases NEXTN to EAGLE:
            ``NEXTN`` (or ``eagle``) keeps one head model. () for the families SGLang never runs so.
        sglang_single_layer_refusal: the start-up error of this family's head when SGLang builds it once (no
            multi-layer EAGLE: ``managers/tp_worker.py`` l. 498 passes ``draft_model_idx=None``) over a checkpoint
            holding its layers (Step-3.5: ``Step3p5MTP.load_weights`` l. 211-213 adds ``None`` to an int); None: the
            single head model starts.
        sglang_refusal / vllm_refusal: the engine's own refusal over missing head tensors (:class:`Refusal`), None:
            the engine's general rule (SGLang starts with those parameters as allocated; vLLM's default loader refuses).
        sglang_serves_own / vllm_serves_own: the :attr:`own_copies` the engine serves instead of the target's tensor
            (the draft's logits / embedding come from the checkpoint's copy), with :attr:`serves_own_source`;
            () for the families whose copies are replaced by the target's.
        serves_own_source: ``{engine label: file::function l. ...}`` saying where each engine serves the copy.
        vllm_no_head: the target ``architectures[0]`` vLLM 0.32.0 has no MTP head for: ``hf_config_override`` leaves
            their ``model_type`` outside ``MTPModelTypes`` and ``SpeculativeConfig.__post_init__`` raises
            NotImplementedError("Unsupported speculative method: 'mtp'") (:data:`VLLM_NO_HEAD_RULE`).
        vllm_by_target: ``(target architectures[0], vLLM head class, its file, its reuse line)`` for a family whose
            vLLM head class depends on the target class (Bailing: V2.5 and V3); the target classes not listed use
            :attr:`vllm_arch` / :attr:`vllm_file` / :attr:`vllm_reuse` (read through :class:`MTPHead`).
        size_fields: the config sizes :attr:`expected` reads (:data:`DEEPSEEK_SIZE_FIELDS`), checked by
            ``helpers.formats.configs.read_mtp_head``; () when the family's layer is not expanded.
        hidden_layers_default: the ``num_hidden_layers`` the engines' config class gives a config.json that leaves it
            out (transformers 5.19, both venvs: ``DeepseekV3Config`` 61, ``Glm4MoeConfig`` 46, ``Glm4MoeLiteConfig``
            47, ``models/<type>/configuration_<type>.py`` l. 86 / 94 / 86); None: no default the checks rely on (a
            family whose prefix is built from it is then refused by ``read_mtp_head``).
        layers_read: ``(engine label, places)``: where each engine reads :attr:`layers_field`, in order, ``top``
            (config.json's top level) or ``text`` (the text sub-config, :func:`text_config`); the first place holding
            an int wins. Engines not listed read ``("text",)``. Qwen3.5 on vLLM: ``("top", "text")``
            (``vllm/config/speculative.py::SpeculativeConfig.hf_config_override`` l. 917-935: ``getattr(hf_config,
            "mtp_num_hidden_layers")`` first, then ``get_hf_text_config``'s).
        vllm_built_text_default: the head class builds the text config's :attr:`layers_field` layers (this value when
            the text config lacks it) rather than ``n_predict`` (Qwen3.5: ``qwen3_5_mtp.py::Qwen3_5MultiTokenPredictor.
            __init__`` l. 82, ``getattr(hf_text_config, "mtp_num_hidden_layers", 1)``); None: ``n_predict``.
        layer_index_re: a regex whose one group is the MTP layer index of a checkpoint tensor name (MiMo:
            ``model.mtp_layers.<i>.``), for the families whose loaders map the index themselves; "" for the others.
        sglang_folds_layers: SGLang's loader maps every layer index into its one head block (MiMo / MiMo-V2:
            ``map_model_name_to_mtp_param_name``), each layer read overwriting the one before: a checkpoint with a
            layer other than 0 is served with whichever comes last in the read order.
        vllm_extra_layer_refusal: vLLM's refusal of a checkpoint layer index >= the declared count that its mapper
            leaves outside the layers built (MiMo: ``mimo_mtp.py::MiMoMTP`` ``hf_to_vllm_mapper`` remaps
            ``model.mtp_layers.<i>.`` for ``i < num_nextn_predict_layers`` only, l. 182-184, and
            ``vllm/model_executor/models/utils.py::AutoWeightsLoader._load_module`` l. 441-448 raises on the rest).
        vllm_extra_layers_note: what vLLM does instead with such an index when it does not refuse it ("" : nothing to
            say).
        vllm_warns_reuse: vLLM logs "Enabling num_speculative_tokens > 1 will run multiple times of forward on same
            MTP layer" for this head (``vllm/config/speculative.py::SpeculativeConfig.__post_init__`` l. 1375-1385:
            every MTP model type but ``step3p5_mtp`` / ``inkling_mtp``).
    """

    name: str
    target_archs: tuple[str, ...]
    head_arch: str
    head_file: str
    layers_field: str
    config_default: Optional[int]
    sglang_layers: Optional[int]
    sglang_loader: str
    sglang_exactly_one: bool
    draft_path_default: bool
    sglang_prefix: Callable[[int, int], str]
    vllm_prefix: Callable[[int, int], str]
    head_tensors: tuple[str, ...]
    layer_tensors: tuple[str, ...]
    vllm_arch: str
    vllm_file: str
    vllm_layers_default: Optional[int]
    vllm_reuse: str
    expected: Optional[Callable[[dict], tuple[str, ...]]] = None
    own_copies: tuple[str, ...] = ()
    sglang_later_layers: str = "not read"
    vllm_n_predict: Optional[int] = None
    vllm_built: Optional[int] = None
    vllm_n_predict_absent: Optional[int] = None
    sglang_layer_per_step: tuple[str, ...] = ()
    sglang_single_layer_refusal: Optional[Refusal] = None
    sglang_refusal: Optional[Refusal] = None
    vllm_refusal: Optional[Refusal] = None
    sglang_serves_own: tuple[str, ...] = ()
    vllm_serves_own: tuple[str, ...] = ()
    serves_own_source: tuple[tuple[str, str], ...] = ()
    vllm_no_head: tuple[str, ...] = ()
    vllm_by_target: tuple[tuple[str, str, str, str], ...] = ()
    vllm_warns_reuse: bool = True
    size_fields: tuple[tuple[str, int, Optional[int], bool], ...] = ()
    hidden_layers_default: Optional[int] = None
    layers_read: tuple[tuple[str, tuple[str, ...]], ...] = ()
    vllm_built_text_default: Optional[int] = None
    layer_index_re: str = ""
    sglang_folds_layers: bool = False
    vllm_extra_layer_refusal: Optional[Refusal] = None
    vllm_extra_layers_note: str = ""

    def per_step_on_sglang(self, algorithm: Optional[str]) -> bool:
        """Whether SGLang builds one head model per draft step for ``algorithm`` as typed on its command line (None:
        SGLang's ``--speculative-algorithm`` NEXTN, the default the checks assume): :attr:`sglang_layer_per_step`."""
        return (algorithm or "NEXTN") in self.sglang_layer_per_step

    def checkpoint_layer_indices(self, names: Optional[set[str]]) -> list[int]:
        """The MTP layer indices the checkpoint's tensor names carry (:attr:`layer_index_re`), sorted; [] when the
        family has no such pattern or no names are at hand."""
        if not self.layer_index_re or not names:
            return []
        rx = re.compile(self.layer_index_re)
        return sorted({int(m.group(1)) for n in names if (m := rx.match(n))})

    def layers_places(self, label: str) -> tuple[str, ...]:
        """Where the engine ``label`` reads :attr:`layers_field`, in order (:attr:`layers_read`)."""
        return dict(self.layers_read).get(label, ("text",))

    def prefix_uses_num_hidden_layers(self) -> bool:
        """Whether the head's checkpoint prefix is built from ``num_hidden_layers`` (``model.layers.{n}.``)."""
        return any(f(7, 0) != f(8, 0) for f in (self.sglang_prefix, self.vllm_prefix))

    def serves_own(self, label: str) -> tuple[str, ...]:
        """The own copies the engine named ``label`` (``SGLang`` / ``vLLM``) serves instead of the target's."""
        return {"SGLang": self.sglang_serves_own, "vLLM": self.vllm_serves_own}.get(label, ())

    def refusal(self, label: str) -> Optional[Refusal]:
        """The engine's own refusal over missing head tensors (:attr:`sglang_refusal` / :attr:`vllm_refusal`)."""
        return {"SGLang": self.sglang_refusal, "vLLM": self.vllm_refusal}.get(label)


_DS_LOADER = (f"{_SG}/models/deepseek_common/deepseek_weight_loader.py::DeepseekV2WeightLoaderMixin."
              "_initialize_nextn_conf l. 552-584 and do_load_weights l. 316-335")
_NEXTN_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
_DECODER = ("input_layernorm.weight", "post_attention_layernorm.weight")
#: the DeepSeek / GLM NextN layer's copies of the target's lm_head and embedding
_OWN_COPIES = ("shared_head.head.weight", "embed_tokens.weight")

#: the families, one entry each
MTP_FAMILIES: tuple[MTPFamily, ...] = (
    MTPFamily(
        name="deepseek_v3", target_archs=("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM"),
        head_arch="DeepseekV3ForCausalLMNextN", head_file=f"{_SG}/models/deepseek_nextn.py",
        layers_field="num_nextn_predict_layers", config_default=1, sglang_layers=None, sglang_loader=_DS_LOADER,
        sglang_exactly_one=True, draft_path_default=True, sglang_prefix=_sglang_nextn, vllm_prefix=_after_last,
        head_tensors=_NEXTN_TENSORS, layer_tensors=_DECODER, vllm_arch="DeepSeekMTPModel",
        vllm_file=f"{_VL}/deepseek_mtp.py", vllm_layers_default=None,
        vllm_reuse=f"{_VL}/deepseek_mtp.py::DeepSeekMultiTokenPredictor.forward l. 217 "
                   "(spec_step_idx % num_mtp_layers)", expected=_deepseek_expected,
        own_copies=_OWN_COPIES, size_fields=DEEPSEEK_SIZE_FIELDS, hidden_layers_default=61),
    MTPFamily(
        name="glm4_moe", target_archs=("Glm4MoeForCausalLM",), head_arch="Glm4MoeForCausalLMNextN",
        head_file=f"{_SG}/models/glm4_moe_nextn.py", layers_field="num_nextn_predict_layers", config_default=1,
        sglang_layers=None,
        sglang_loader=f"{_SG}/models/glm4_moe.py::Glm4MoeForCausalLM.load_weights l. 1074-1088",
        sglang_exactly_one=True, draft_path_default=True, sglang_prefix=_sglang_nextn, vllm_prefix=_after_last,
        head_tensors=_NEXTN_TENSORS, layer_tensors=_DECODER, vllm_arch="Glm4MoeMTPModel",
        vllm_file=f"{_VL}/glm4_moe_mtp.py", vllm_layers_default=None,
        vllm_reuse=f"{_VL}/glm4_moe_mtp.py l. 172 (spec_step_idx % num_mtp_layers)", own_copies=_OWN_COPIES,
        hidden_layers_default=46),
    MTPFamily(
        # GLM-4.7-Flash: a DeepSeek-V3-like MLA + MoE layer, loaded by the DeepSeek NextN loader mixin
        name="glm4_moe_lite", target_archs=("Glm4MoeLiteForCausalLM",), head_arch="Glm4MoeLiteForCausalLMNextN",
        head_file=f"{_SG}/models/glm4_moe_lite_nextn.py", layers_field="num_nextn_predict_layers", config_default=None,
        sglang_layers=None,
        sglang_loader=(f"{_SG}/models/glm4_moe_lite.py::Glm4MoeLiteForCausalLM.load_weights l. 834-935 (is_nextn: "
                       "ValueError without the field, 'Only 1 nextn layer is supported', model.layers.{n}.*, "
                       "shared_head.head / embed_tokens skipped)"),
        sglang_exactly_one=True, draft_path_default=True, sglang_prefix=_sglang_nextn, vllm_prefix=_after_last,
        head_tensors=_NEXTN_TENSORS, layer_tensors=_DECODER, vllm_arch="Glm4MoeLiteMTPModel",
        vllm_file=f"{_VL}/glm4_moe_lite_mtp.py", vllm_layers_default=None,
        vllm_reuse=f"{_VL}/glm4_moe_lite_mtp.py::Glm4MoeLiteMultiTokenPredictor l. 198 (spec_step_idx % "
                   "num_mtp_layers)", expected=_deepseek_expected, own_copies=_OWN_COPIES,
        size_fields=DEEPSEEK_SIZE_FIELDS, hidden_layers_default=47),
    MTPFamily(
        # Qwen3.5 (dense and MoE, the multimodal wrapper or the text model): the layer count is
        # text_config.mtp_num_hidden_layers; SGLang builds one layer whatever it says
        name="qwen3_5", target_archs=("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
                                      "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
        head_arch="Qwen3_5ForCausalLMMTP", head_file=f"{_SG}/models/qwen3_5_mtp.py",
        layers_field="mtp_num_hidden_layers", config_default=None, sglang_layers=1,
        # vLLM's hf_config_override reads the top level first, then the text config (speculative.py l. 917-935);
        # SGLang reads neither (it writes num_nextn_predict_layers = 1 and builds one layer, model_config.py
        # l. 1179-1181, qwen3_5_mtp.py::Qwen3_5ForCausalLMMTP.__init__): its notes quote the count vLLM would read
        layers_read=(("vLLM", ("top", "text")), ("SGLang", ("top", "text"))), vllm_built_text_default=1,
        sglang_loader=(f"{_SG}/models/qwen3_5_mtp.py::Qwen3_5ForCausalLMMTP.load_weights l. 261-370 (only names "
                       "with 'mtp'; mtp.* read as model.*); configs/model_config.py::ModelConfig._config_draft_model "
                       "l. 1159-1181 sets num_nextn_predict_layers = 1"),
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=lambda n, i: "mtp.",
        vllm_prefix=lambda n, i: "mtp.",
        head_tensors=("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"),
        layer_tensors=("layers.0.input_layernorm.weight",), vllm_arch="Qwen3_5MTP / Qwen3_5MoeMTP",
        vllm_file=f"{_VL}/qwen3_5_mtp.py", vllm_layers_default=1,
        vllm_reuse=f"{_VL}/qwen3_5_mtp.py l. 170 (spec_step_idx % num_mtp_layers; num_mtp_layers = "
                   "mtp_num_hidden_layers, default 1, l. 82)"),
    MTPFamily(
        name="qwen3_next", target_archs=("Qwen3NextForCausalLM",), head_arch="Qwen3NextForCausalLMMTP",
        head_file=f"{_SG}/models/qwen3_next_mtp.py", layers_field="num_nextn_predict_layers", config_default=None,
        sglang_layers=1,
        sglang_loader=f"{_SG}/models/qwen3_next.py::Qwen3NextForCausalLM.load_weights l. 1139-1190 (is_mtp: only "
                      "names with 'mtp')",
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=lambda n, i: "mtp.",
        vllm_prefix=lambda n, i: "mtp.",
        head_tensors=("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"),
        layer_tensors=("layers.0.input_layernorm.weight",), vllm_arch="Qwen3NextMTP",
        vllm_file=f"{_VL}/qwen3_next_mtp.py", vllm_layers_default=1,
        vllm_reuse=f"{_VL}/qwen3_next_mtp.py l. 141 (spec_step_idx % num_mtp_layers)"),
    MTPFamily(
        name="mimo", target_archs=("MiMoForCausalLM",), head_arch="MiMoMTP", head_file=f"{_SG}/models/mimo_mtp.py",
        layers_field="num_nextn_predict_layers", config_default=None, sglang_layers=None,
        sglang_loader=f"{_SG}/models/mimo_mtp.py::MiMoMTP.load_weights / map_model_name_to_mtp_param_name "
                      "l. 130-192 (every model.mtp_layers.<i>. goes into the one mtp_block)",
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=lambda n, i: f"model.mtp_layers.{i}.",
        vllm_prefix=lambda n, i: f"model.mtp_layers.{i}.",
        head_tensors=("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight",
                      "final_layernorm.weight"),
        layer_tensors=_DECODER, vllm_arch="MiMoMTPModel", vllm_file=f"{_VL}/mimo_mtp.py", vllm_layers_default=None,
        vllm_reuse=f"{_VL}/mimo_mtp.py l. 135 (mtp_layers[start + spec_step_idx])",
        sglang_later_layers=(f"loaded into the same one block, each overwriting the layer read before it ({_SG}/"
                             "models/mimo_mtp.py::MiMoMTP.map_model_name_to_mtp_param_name maps every "
                             "model.mtp_layers.<i>. to model.mtp_block. / model.; load_weights copies each in turn): "
                             "the head served is the last layer in the checkpoint's read order, not layer 0"),
        layer_index_re=r"model\.mtp_layers\.(\d+)\.", sglang_folds_layers=True,
        vllm_extra_layer_refusal=Refusal(
            "index_ge_declared",
            "ValueError(\"There is no module or parameter named 'model.mtp_layers.<i>' in MiMoMTP ...\")",
            f"{_VL}/mimo_mtp.py::MiMoMTP hf_to_vllm_mapper l. 182-184 (remaps model.mtp_layers.<i>. for i < "
            "num_nextn_predict_layers only) and vllm/model_executor/models/utils.py::AutoWeightsLoader._load_module "
            "l. 441-448")),
    MTPFamily(
        # LongCat-Flash: one MLA + dense-MLP NextN layer stored under model.mtp.*; both engines build one layer and
        # read model.mtp.layers.0.* only (their name maps list layer 0 alone)
        name="longcat_flash", target_archs=("LongcatFlashForCausalLM",), head_arch="LongcatFlashForCausalLMNextN",
        head_file=f"{_SG}/models/longcat_flash_nextn.py", layers_field="num_nextn_predict_layers",
        # SGLang's own LongcatFlashConfig (sglang/srt/configs/longcat_flash.py::LongcatFlashConfig.__init__ l. 55,
        # registered over transformers' in utils/hf_transformers/common.py) defaults it to 1; vLLM reads it with
        # getattr(hf_config, "num_nextn_predict_layers", 1) (config/speculative.py::hf_config_override l. 962-966)
        config_default=1, sglang_layers=None,
        sglang_loader=(f"{_SG}/models/longcat_flash_nextn.py::LongcatFlashForCausalLMNextN.load_weights l. 492-600 "
                       "(only names with '.mtp.'; weight_names_mapping maps model.mtp.layers.0.* and model.mtp.norm; "
                       "embed_tokens skipped); configs/model_config.py::ModelConfig._config_draft_model l. 1085-1090 "
                       "sets num_hidden_layers = num_nextn_predict_layers"),
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=lambda n, i: "model.mtp.layers.0.",
        vllm_prefix=lambda n, i: "model.mtp.layers.0.",
        head_tensors=("enorm.m.weight", "hnorm.m.weight", "eh_proj.weight"), layer_tensors=_DECODER,
        vllm_arch="LongCatFlashMTP (LongCatFlashMTPModel)", vllm_file=f"{_VL}/longcat_flash_mtp.py",
        vllm_layers_default=1,
        vllm_reuse=f"{_VL}/longcat_flash_mtp.py::LongCatMultiTokenPredictor.forward l. 116 (spec_step_idx % "
                   "num_mtp_layers; num_mtp_layers = 1, l. 86)",
        sglang_later_layers="not read (LongcatFlashForCausalLMNextN.load_weights maps model.mtp.layers.0.* only)",
        vllm_built=1),
    MTPFamily(
        # MiMo-V2 (Flash / Pro): NextN layers under model.mtp.layers.<i>.*; SGLang with EAGLE runs multi-layer EAGLE
        # (one MiMoV2MTP per step, step i reading layer i, as Step-3.5); with NEXTN it builds one and folds every
        # layer into its one mtp_block (as MiMo-7B's loader); vLLM writes n_predict = 1 and builds one layer
        name="mimo_v2", target_archs=("MiMoV2FlashForCausalLM", "MiMoV2ForCausalLM"), head_arch="MiMoV2MTP",
        head_file=f"{_SG}/models/mimo_v2_nextn.py", layers_field="num_nextn_predict_layers", config_default=None,
        sglang_layers=1,
        sglang_loader=(f"{_SG}/models/mimo_v2_nextn.py::MiMoV2MTP.load_weights l. 278-360 / "
                       "map_model_name_to_mtp_param_name l. 362-382 (every model.mtp.layers.<i>. into model.mtp_block. "
                       "/ model.); configs/model_config.py::ModelConfig._config_draft_model l. 1094-1096 sets "
                       "num_nextn_predict_layers = 1; with EAGLE, arg_groups/model_overrides/mimo_v2.py::"
                       "_mimo_v2_overrides l. 23-25 enables multi-layer EAGLE: managers/tp_worker.py::"
                       "_init_multi_layer_eagle_model_runners l. 502-523 builds one draft model per step and "
                       "model_loader/loader.py::DefaultModelLoader._filter_mtp_weights l. 740-757 gives draft model i "
                       "model.mtp.layers.<i>. only"),
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=lambda n, i: f"model.mtp.layers.{i}.",
        vllm_prefix=lambda n, i: f"model.mtp.layers.{i}.",
        head_tensors=("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"),
        layer_tensors=("input_layernorm.weight", "pre_mlp_layernorm.weight"),
        vllm_arch="MiMoV2MTP (MiMoV2MTPModel)", vllm_file=f"{_VL}/mimo_v2_mtp.py", vllm_layers_default=None,
        vllm_reuse=f"{_VL}/mimo_v2_mtp.py::MiMoV2MultiTokenPredictor.forward l. 209 (spec_step_idx % "
                   "num_mtp_layers; num_mtp_layers = 1, l. 177; n_predict = _MIMO_V2_FLASH_NUM_MTP_LAYERS = 1 from "
                   "vllm/config/speculative.py::SpeculativeConfig.hf_config_override l. 736-779)",
        sglang_later_layers=(f"loaded into the same one block, each overwriting the layer read before it ({_SG}/"
                             "models/mimo_v2_nextn.py::MiMoV2MTP.map_model_name_to_mtp_param_name maps every "
                             "model.mtp.layers.<i>. to model.mtp_block. / model.): the head served is the last layer "
                             "in the checkpoint's read order, not layer 0"),
        vllm_n_predict=1, vllm_built=1,
        layer_index_re=r"model\.mtp\.layers\.(\d+)\.", sglang_folds_layers=True, sglang_layer_per_step=("EAGLE",),
        vllm_extra_layers_note=(f"not loaded: vLLM builds layer 0 only and {_VL}/mimo_v2_mtp.py::MiMoV2MTP."
                                "load_weights l. 376 skips names outside its parameters")),
    MTPFamily(
        # Step-3.5 (Flash; Step-3.7's text model): NextN layers model.layers.{n + i}.*, each with its own
        # shared_head.output (the lm_head copy it was trained with). SGLang runs multi-layer EAGLE for this target
        # (one Step3p5MTP per draft step, step i reading layer n + i) and serves each layer's own head; vLLM builds
        # n_predict layers, reused round-robin, and keeps their own heads when they differ from the target's.
        name="step3p5", target_archs=("Step3p5ForCausalLM",), head_arch="Step3p5MTP",
        head_file=f"{_SG}/models/step3p5_mtp.py", layers_field="num_nextn_predict_layers",
        # SGLang's own Step3p5Config (sglang/srt/configs/step3p5.py::Step3p5Config.__init__ l. 10-108) has no such
        # parameter: absent, SGLang's get_spec_layer_idx_from_weight_name (step3p5_mtp.py l. 26-41) finds no head layer
        config_default=None, sglang_layers=None,
        sglang_loader=(f"{_SG}/models/step3p5_mtp.py::Step3p5MTP.load_weights l. 189-295 (only model.layers."
                       "{num_hidden_layers + draft_model_idx}.* and embed_tokens; shared_head.output read as "
                       "shared_head.head); configs/model_config.py::ModelConfig._config_draft_model l. 1097-1098; "
                       "arg_groups/overrides.py::_step3p_overrides l. 346-350 (enable_multi_layer_eagle for EAGLE); "
                       "managers/tp_worker.py::_init_multi_layer_eagle_model_runners l. 502-523 (one draft model per "
                       "step, draft_model_idx = i)"),
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=_after_last, vllm_prefix=_after_last,
        head_tensors=_NEXTN_TENSORS, layer_tensors=_DECODER, vllm_arch="Step3p5MTP",
        vllm_file=f"{_VL}/step3p5_mtp.py", vllm_layers_default=1,
        vllm_reuse=(f"{_VL}/step3p5_mtp.py::Step3p5AMultiTokenPredictor.forward l. 133 (spec_step_idx % "
                    "num_mtp_layers; vllm/v1/spec_decode/step3p5.py passes spec_step_idx = token_index + 1, l. 388)"),
        own_copies=("shared_head.output.weight", "shared_head.head.weight", "embed_tokens.weight"),
        sglang_later_layers="read by the draft models of the later steps (one per step: draft_model_idx)",
        vllm_n_predict_absent=1, sglang_layer_per_step=("EAGLE",), vllm_warns_reuse=False,
        sglang_single_layer_refusal=Refusal(
            "any_present", 'TypeError("unsupported operand type(s) for +: \'int\' and \'NoneType\'")',
            f"{_SG}/models/step3p5_mtp.py::Step3p5MTP.load_weights l. 211-213 (num_hidden_layers + draft_model_idx, "
            "None without multi-layer EAGLE: managers/tp_worker.py l. 498)"),
        sglang_refusal=Refusal(
            "any_missing",
            'RuntimeError("Some parameters like <name> are not in the checkpoint and will falsely use random '
            'initialization")',
            f"{_SG}/models/step3p5_mtp.py::Step3p5MTP.load_weights l. 287-295"),
        vllm_refusal=Refusal(
            "any_missing",
            'RuntimeError("Some parameters like <name> are not in the checkpoint and will falsely use random '
            'initialization")',
            f"{_VL}/step3p5_mtp.py::Step3p5MTP.load_weights l. 302-320 (with the MTP completeness check on, "
            "model_loader/mtp_validation.py::is_mtp_completeness_check_enabled)"),
        sglang_serves_own=("shared_head.output.weight", "shared_head.head.weight", "embed_tokens.weight"),
        vllm_serves_own=("shared_head.output.weight", "shared_head.head.weight"),
        serves_own_source=(
            ("SGLang", f"{_SG}/models/step3p5_mtp.py::Step3p5MTP.set_embed_and_head l. 186-187 is a no-op: the draft "
                       "keeps the shared_head.head and embed_tokens it loaded (load_weights l. 274-281: the layer's "
                       "shared_head.output; model.embed_tokens.weight or the layer's embed_tokens copy, whichever the "
                       "loader reads last)"),
            ("vLLM", f"{_VL}/step3p5_mtp.py::Step3p5MTP.has_own_lm_head l. 160 and compute_logits l. 142-150 (each "
                     "layer's shared_head.head): vllm/v1/spec_decode/llm_base_proposer.py::_maybe_share_lm_head "
                     "l. 1508-1573 replaces it by the target's only when equal; the embedding is the target's "
                     "(_maybe_share_embeddings l. 1466-1472, 'Detected MTP model')"))),
    MTPFamily(
        # ERNIE-4.5 MoE: one MTP layer stored flat as model.mtp_emb_norm.0 / mtp_hidden_norm.0 / mtp_linear_proj.0 /
        # mtp_block.0.*; both engines read index 0 only and bind the target's embedding and lm_head
        name="ernie4_5_moe", target_archs=("Ernie4_5_MoeForCausalLM",), head_arch="Ernie4_5_MoeForCausalLMMTP",
        head_file=f"{_SG}/models/ernie4_eagle.py", layers_field="num_nextn_predict_layers",
        # transformers 5.19's Ernie4_5_MoeConfig (models/ernie4_5_moe/configuration_ernie4_5_moe.py l. 59-107) has
        # no such field; vLLM reads getattr(hf_config, "num_nextn_predict_layers", None) (speculative.py l. 810-816)
        config_default=None, sglang_layers=None,
        sglang_loader=(f"{_SG}/models/ernie4_eagle.py::Ernie4_5_MoeForCausalLMMTP.load_weights l. 143-186 (only "
                       "names with mtp_block.0 / mtp_emb_norm.0 / mtp_hidden_norm.0 / mtp_linear_proj.0, mtp_layer_id "
                       "0); configs/model_config.py::ModelConfig._config_draft_model l. 1128-1132"),
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=lambda n, i: "model.",
        vllm_prefix=lambda n, i: "model.",
        head_tensors=("mtp_emb_norm.0.weight", "mtp_hidden_norm.0.weight", "mtp_linear_proj.0.weight"),
        layer_tensors=("mtp_block.0.input_layernorm.weight", "mtp_block.0.post_attention_layernorm.weight"),
        vllm_arch="ErnieMTPModel (ErnieMTP)", vllm_file=f"{_VL}/ernie_mtp.py", vllm_layers_default=None,
        vllm_reuse=(f"{_VL}/ernie_mtp.py::ErnieMultiTokenPredictor.forward l. 125 (layers[mtp_start_layer_idx + "
                    "spec_step_idx]; the MTP proposer passes no spec_step_idx, so every step runs layer 0; ErnieMTP."
                    "forward l. 194 asserts spec_step_idx == 0)"),
        sglang_later_layers=("not read (Ernie4_5_MoeForCausalLMMTP.load_weights matches the index-0 names only, "
                             "mtp_layer_id 0)"),
        sglang_refusal=Refusal(
            "none_present", 'KeyError("MTP layers \'mtp_*.0.*\' not found in weights.")',
            f"{_SG}/models/ernie4_eagle.py::Ernie4_5_MoeForCausalLMMTP.load_weights l. 183-186")),
    MTPFamily(
        # Qwen3-MoE with an MTP module (Qwen3-Next's layout: mtp.fc, mtp.pre_fc_norm_*, mtp.layers.0.*); SGLang only,
        # vLLM 0.32.0 has no Qwen3-MoE MTP head
        name="qwen3_moe", target_archs=("Qwen3MoeForCausalLM",), head_arch="Qwen3MoeForCausalLMMTP",
        head_file=f"{_SG}/models/qwen3_moe_mtp.py", layers_field="num_nextn_predict_layers",
        # transformers 5.19's Qwen3MoeConfig (models/qwen3_moe/configuration_qwen3_moe.py l. 48-105) has no such field
        config_default=None, sglang_layers=1,
        sglang_loader=(f"{_SG}/models/qwen3_moe.py::Qwen3MoeForCausalLM.load_weights l. 1157-1204 (is_mtp: only "
                       "names with 'mtp'; mtp.fc / mtp.pre_fc_norm_* read as fc / pre_fc_norm_*, other mtp.* as "
                       "model.*; layer ids past the one layer skipped); qwen3_moe_mtp.py::Qwen3MoeForCausalLMMTP."
                       "__init__ l. 47 (num_hidden_layers = 1); configs/model_config.py::ModelConfig."
                       "_config_draft_model l. 1155-1157 sets num_nextn_predict_layers = 1"),
        sglang_exactly_one=False, draft_path_default=False, sglang_prefix=lambda n, i: "mtp.",
        vllm_prefix=lambda n, i: "mtp.",
        head_tensors=("fc.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"),
        layer_tensors=("layers.0.input_layernorm.weight",), vllm_arch="none", vllm_file="",
        vllm_layers_default=None, vllm_reuse="",
        sglang_later_layers=(f"not read (mtp.layers.<i>. for i >= 1 maps to model.layers.<i>., outside the one layer "
                             f"built: {_SG}/models/qwen3_moe.py::Qwen3MoeForCausalLM.load_weights l. 1195-1204)"),
        vllm_no_head=("Qwen3MoeForCausalLM",)),
    MTPFamily(
        # Bailing / Ling (V1, V2 = Ling-2.0, V2.5 hybrid linear, V3): SGLang's one BailingMoeForCausalLMNextN for all
        # four, each loaded by its target's load_weights(is_nextn=True) with DeepSeek's rule (exactly one layer,
        # model.layers.{n}., final_layernorm / eh_proj / enorm / hnorm beside the decoder, shared_head.head and
        # embed_tokens skipped for the target's); vLLM has heads for V2.5 and V3 only
        name="bailing_moe", target_archs=("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
                                          "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM"),
        head_arch="BailingMoeForCausalLMNextN", head_file=f"{_SG}/models/bailing_moe_nextn.py",
        layers_field="num_nextn_predict_layers",
        # SGLang's own BailingMoeV2Config (sglang/srt/configs/bailing_moe_v2.py l. 19-92) has no such field
        config_default=None, sglang_layers=None,
        sglang_loader=(f"{_SG}/models/bailing_moe_nextn.py::BailingMoeForCausalLMNextN.load_weights l. 291-292 -> "
                       "bailing_moe.py::BailingMoEForCausalLM.load_weights l. 945-1030 (V1 / V2), bailing_moe_linear.py"
                       "::BailingMoELinearForCausalLM.load_weights l. 1367-1440 (V2.5), bailing_moe_v3.py::"
                       "resolve_nextn_layer_id / rewrite_nextn_weight_name l. 260-280 (V3), is_nextn: ValueError "
                       "without the field, 'Only 1 nextn layer is supported', model.layers.{n}.*, shared_head.head / "
                       "embed_tokens skipped; configs/model_config.py::ModelConfig._config_draft_model l. 1121-1127"),
        sglang_exactly_one=True, draft_path_default=False, sglang_prefix=_sglang_nextn, vllm_prefix=_after_last,
        head_tensors=("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_layernorm.weight"),
        layer_tensors=_DECODER, vllm_arch="none", vllm_file="", vllm_layers_default=None, vllm_reuse="",
        own_copies=_OWN_COPIES,
        # V1 / V2 (model_type bailing_moe / bailing_moe_v2) are not rewritten by hf_config_override l. 868-900,
        # which maps BailingMoeV2_5ForCausalLM (or model_type bailing_hybrid) and BailingMoeV3ForCausalLM only
        vllm_no_head=("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM"),
        vllm_by_target=(
            ("BailingMoeV2_5ForCausalLM", "BailingMoeV25MTPModel", f"{_VL}/bailing_moe_mtp.py",
             f"{_VL}/bailing_moe_mtp.py::BailingMoeV25MultiTokenPredictor.forward l. 177 (spec_step_idx % "
             "num_mtp_layers; n_predict from vllm/config/speculative.py::SpeculativeConfig.hf_config_override "
             "l. 881-893)"),
            ("BailingMoeV3ForCausalLM", "BailingMoeV3MTPModel", f"{_VL}/bailing_moe_v3_mtp.py",
             f"{_VL}/bailing_moe_v3_mtp.py::BailingMoeV3MultiTokenPredictor.forward l. 201 (spec_step_idx % "
             "num_mtp_layers; n_predict from hf_config_override l. 876-900)"))),
)

_BY_ARCH = {a: f for f in MTP_FAMILIES for a in (*f.target_archs, f.head_arch)}


def family_of(architectures: Optional[Sequence[str]]) -> Optional[MTPFamily]:
    """The :class:`MTPFamily` whose target class or head class is ``architectures[0]`` (what SGLang's rewrite reads),
    None for another class."""
    archs = [a for a in (architectures or []) if a]
    return _BY_ARCH.get(archs[0]) if archs else None


def text_config(raw: dict) -> dict:
    """The sub-config holding the layer fields (``text_config`` / ``language_config`` / ``llm_config`` /
    ``thinker_config`` when present), else ``raw``."""
    for k in ("thinker_config", "llm_config", "language_config", "text_config"):
        if isinstance(raw.get(k), dict):
            return raw[k]
    return raw


@dataclass(frozen=True)
class MTPHead:
    """An MTP / NextN head found in a config (:func:`mtp_head`).

    Attributes:
        family: its :class:`MTPFamily`.
        form: ``target`` (a target's config: the head is its extra layer(s)) or ``checkpoint`` (a separate NextN
            checkpoint whose ``architectures[0]`` is the head class).
        layers: the layer count the engines see: :attr:`MTPFamily.layers_field` as config.json gives it, else the
            config class's default (:attr:`MTPFamily.config_default`); None: absent from both.
        num_hidden_layers: the config's ``num_hidden_layers`` (where the head's layer sits after).
        layers_defaulted: config.json leaves the field out and ``layers`` is the config class's default.
        expected: every tensor name of one head layer relative to its prefix (:attr:`MTPFamily.expected` of the
            text config), () when the family or the config does not say.
        arch: the config's ``architectures[0]`` (the target or head class).
        text_layers: :attr:`MTPFamily.layers_field` as the text sub-config (or the config, when it has none) gives
            it, None when absent or not an int.
        top_layers: the field at config.json's top level when the config has a text sub-config, else None.
        hidden_layers_defaulted: ``num_hidden_layers`` is absent and :attr:`num_hidden_layers` is the config class's
            default (:attr:`MTPFamily.hidden_layers_default`).
    """

    family: MTPFamily
    form: str
    layers: Optional[int]
    num_hidden_layers: Optional[int]
    layers_defaulted: bool = False
    expected: tuple[str, ...] = ()
    arch: str = ""
    text_layers: Optional[int] = None
    top_layers: Optional[int] = None
    hidden_layers_defaulted: bool = False

    def as_read_by(self, label: str) -> "MTPHead":
        """This head with :attr:`layers` as the engine ``label`` (``SGLang`` / ``vLLM``) reads it: the first of
        :meth:`MTPFamily.layers_places` holding an int (Qwen3.5 on vLLM: the top level before the text config),
        else as :func:`mtp_head` read it. When both places hold different counts the first one read wins, as in the
        engine."""
        for place in self.family.layers_places(label):
            v = self.top_layers if place == "top" else self.text_layers
            if v is not None:
                return replace(self, layers=v, layers_defaulted=False)
        return self

    def _vllm_head(self) -> tuple[str, str, str]:
        for arch, cls, file, reuse in self.family.vllm_by_target:
            if arch == self.arch:
                return cls, file, reuse
        return self.family.vllm_arch, self.family.vllm_file, self.family.vllm_reuse

    @property
    def vllm_arch(self) -> str:
        """vLLM's head class for this target (:attr:`MTPFamily.vllm_by_target`, else :attr:`MTPFamily.vllm_arch`)."""
        return self._vllm_head()[0]

    @property
    def vllm_file(self) -> str:
        """The file of :attr:`vllm_arch`."""
        return self._vllm_head()[1]

    @property
    def vllm_reuse(self) -> str:
        """Where :attr:`vllm_arch` picks the head layer of a draft step."""
        return self._vllm_head()[2]

    @property
    def sglang_layers(self) -> Optional[int]:
        """The layer count SGLang's loader sees (the family's override, else the declared one)."""
        return self.family.sglang_layers if self.family.sglang_layers is not None else self.layers

    @property
    def vllm_n_predict(self) -> Optional[int]:
        """vLLM's ``n_predict`` (``hf_config_override``: the layer field, None when absent; the family's fixed value
        :attr:`MTPFamily.vllm_n_predict` when it writes one)."""
        fam = self.family
        if fam.vllm_n_predict is not None:
            return fam.vllm_n_predict
        return self.layers if self.layers is not None else fam.vllm_n_predict_absent

    @property
    def vllm_built(self) -> int:
        """The head layers vLLM builds and reads: :attr:`MTPFamily.vllm_built` when the head class fixes it, else
        ``n_predict``, else the family's default, else 1."""
        fam = self.family
        if fam.vllm_built_text_default is not None:     # the head class reads the text config's field itself
            return fam.vllm_built or self.text_layers or fam.vllm_built_text_default
        return fam.vllm_built or self.vllm_n_predict or fam.vllm_layers_default or 1

    def sglang_prefixes(self) -> list[str]:
        """The checkpoint prefixes SGLang reads the head from (one: SGLang builds one head layer)."""
        return [self.family.sglang_prefix(self.num_hidden_layers or 0, 0)]

    def vllm_prefixes(self) -> list[str]:
        """The checkpoint prefixes vLLM reads, one per head layer it builds (:attr:`vllm_built`).

        Raises:
            ValueError: more than :data:`MAX_MTP_LAYERS` layers (the config readers refuse such a config first:
                ``helpers.formats.configs.read_mtp_head``)."""
        n = self.vllm_built
        if n > MAX_MTP_LAYERS:
            raise ValueError(f"{self.family.layers_field} {n} is over {MAX_MTP_LAYERS}")
        return list(dict.fromkeys(self.family.vllm_prefix(self.num_hidden_layers or 0, i) for i in range(n)))


def mtp_head(raw: dict) -> Optional[MTPHead]:
    """The MTP / NextN head a config.json describes (its ``architectures[0]`` is a family's target or head class),
    else None. A target config with no head layers (``num_nextn_predict_layers`` absent or 0) is still returned
    (``layers`` None / 0): whether an engine serves it is the config checks' answer, not this function's.

    Fields of the wrong type or range are not checked here (a field that is not an int counts as unknown, never as
    defaulted): read a config.json file with ``helpers.formats.configs.read_mtp_head``, which refuses them."""
    fam = family_of(raw.get("architectures") if isinstance(raw.get("architectures"), list) else None)
    if fam is None:
        return None
    tc = text_config(raw)
    given = tc.get(fam.layers_field)
    given = given if isinstance(given, int) and not isinstance(given, bool) else None
    layers = given if given is not None else (fam.config_default if fam.layers_field not in tc else None)
    top = raw.get(fam.layers_field) if tc is not raw else None
    top = top if isinstance(top, int) and not isinstance(top, bool) else None
    n = tc.get("num_hidden_layers")
    n = n if isinstance(n, int) and not isinstance(n, bool) else None
    n_defaulted = n is None and "num_hidden_layers" not in tc and fam.hidden_layers_default is not None
    if n_defaulted:
        n = fam.hidden_layers_default
    arch = raw["architectures"][0]
    exp_cfg = tc if not n_defaulted else {**tc, "num_hidden_layers": n}
    return MTPHead(family=fam, form="checkpoint" if arch == fam.head_arch else "target", layers=layers,
                   num_hidden_layers=n, layers_defaulted=fam.layers_field not in tc and layers is not None,
                   expected=fam.expected(exp_cfg) if fam.expected else (), arch=arch, text_layers=given,
                   top_layers=top, hidden_layers_defaulted=n_defaulted)
