"""Capture plans: the physical tensors an engine feeds the draft, or a trainer captured, built from the layer
vocabulary (:mod:`helpers.layers.ids`: ``embedding``, ``out(L)``, ``final_norm``, ids with their convention) and
SGLang's rules per release (:mod:`helpers.layers.sglang`).

The two plan functions are :func:`served_plan` (what an engine will feed the draft, in concatenation order)
and :func:`training_plan` (what a trainer captured). Every rule below names the SGLang 0.5.23 file it
mirrors; version-dependent rules also name the oldest version where they were checked (0.5.14 and 0.5.23
were both read for this module).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..layers.ids import (
    EMBEDDING,
    FINAL_NORM,
    LayerIds,
    eagle3_ids,
    layer_of,
    out,
    physical,
    specforge_default_ids,
    vllm_default_ids,
)
from ..layers.sglang import (
    DEEPSEEK_CONDITIONAL_SINCE,
    EMBEDDING_AT_INDEX0_SINCE,
    GPT_OSS_BOUNDARY_SINCE,
    OLDEST_READ,
    PACKER_SINCE,
    RULE_TEXT,
    TABLE_VERSION,
    parse_version,
    target_rule,
)

TRAINERS = ("specforge", "speculators", "eagle3", "eagle12")

#: The newest SGLang release whose source this module was checked against.
VERIFIED_SGLANG = (0, 5, 23)
#: Releases whose source was read for the version-dependent rules.
READ_SGLANG_VERSIONS = ("0.5.14", "0.5.23")


@dataclass
class CapturePlan:
    """The ordered physical tensors an engine feeds the draft, or a trainer captured.

    Attributes:
        tensors: physical tensor names in concatenation order (each chunk H wide).
        role: ``"served"`` or ``"training"``.
        who: engine or trainer (``"sglang"``, ``"vllm"``, ``"specforge"``, ...), with version if known.
        config_ids: the ids as read from the config, with their convention (None = no ids found).
        engine_ids: the ids as the engine stores them (e.g. SGLang ``layers_to_capture``), if different.
        rules: the rules applied, each citing the file it mirrors.
        notes: silent behaviours worth knowing (ids ignored, duplicates dropped, order changed, ...).
        problems: ``{"kind", "detail"}`` dicts using the finding vocabulary (e.g. ``missing_chunk`` for an
            unreachable id, ``embedding_in_place_of_layer`` for an id that captures the embedding).
        fatal: set when the engine would raise instead of serving (message + source), else None.
        provenance: where the plan comes from: ``rule`` (a config read with the engine's rules of a named
            version), ``manifest`` (recorded by the tool that wrote the training data, or the run's own record
            given by the user), ``inferred`` (identified in the data against an every-layer reference),
            ``claimed`` (read from a draft config that may have been edited after training), ``default`` (no
            ids anywhere: the trainer's default was assumed), ``identified`` (no training data: the plan under which
            the draft checkpoint does best on the target's own continuations, :mod:`helpers.draft.plan_id`).
        source: the file / field / rule the plan was read from (one line).
        ambiguity: when the ids can mean two things: ``{"readings": [{"reading", "tensors"}...], "settle": str}``.
    """

    tensors: list[str]
    role: str
    who: str
    config_ids: LayerIds | None = None
    engine_ids: LayerIds | None = None
    rules: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    problems: list[dict] = field(default_factory=list)
    fatal: str | None = None
    provenance: str = "rule"
    source: str = ""
    ambiguity: dict | None = None

    @property
    def num_chunks(self) -> int:
        return len(self.tensors)

    def describe_lines(self) -> list[str]:
        """The plan as text lines for ``diagnose``'s report: ``<role> plan [<provenance>]: [tensors]  ids [...]``,
        then its source, notes and fatal error, indented."""
        ids = self.engine_ids or self.config_ids
        lines = [f"{self.role} plan [{self.provenance}]: [{', '.join(self.tensors)}]" + (f"  ids {ids}" if ids else "")]
        lines += [f"  from: {self.source}"] if self.source else []
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  FATAL: {self.fatal}"] if self.fatal else []
        return lines

    def to_json(self) -> dict:
        return {"tensors": list(self.tensors), "role": self.role, "who": self.who,
                "config_ids": None if self.config_ids is None else str(self.config_ids),
                "engine_ids": None if self.engine_ids is None else str(self.engine_ids),
                "rules": list(self.rules), "notes": list(self.notes), "problems": list(self.problems),
                "fatal": self.fatal, "provenance": self.provenance, "source": self.source,
                "ambiguity": self.ambiguity}


def sglang_layers_to_capture(layer_ids: Sequence[int] | None, num_layers: int, family: str,
                             version: Sequence[int] | None) -> tuple[list[int], list[str]]:
    """SGLang ``set_eagle3_layers_to_capture``: config ids -> ``layers_to_capture`` (capture indices).

    Args:
        layer_ids: ``eagle_config.eagle_aux_hidden_state_layer_ids`` as SGLang read it, or None.
        num_layers: target ``num_hidden_layers``.
        family: the id rule (:func:`helpers.layers.sglang.target_rule`).
        version: parsed SGLang version, or None for the newest verified release.

    Returns:
        (layers_to_capture in the order SGLang stores it, rules applied with their sources).
    """

    n = int(num_layers)
    v = tuple(version) if version is not None else VERIFIED_SGLANG
    vs = ".".join(map(str, v))
    rules: list[str] = []
    if layer_ids is None:
        base = [2, n // 2, n - 3]
        if family == "plus_one_default":
            rules.append(f"no ids: default [2, n//2, n-3] then +1 (SGLang {vs}) -- " + FAMILY_SOURCES["plus_one_default"])
            return [x + 1 for x in base], rules
        rules.append(f"no ids: layers_to_capture = [2, n//2, n-3], no +1 (SGLang {vs}) -- "
                     "sglang/srt/models/llama.py::set_eagle3_layers_to_capture (layer_ids is None; same default in "
                     "every model file)")
        return base, rules
    ids = [int(x) for x in layer_ids]
    if family == "deepseek":
        if v < DEEPSEEK_CONDITIONAL_SINCE:
            rules.append(f"DeepSeek family, SGLang {vs} < 0.5.13: +1 for every explicit id -- "
                         "sglang/srt/models/deepseek_v2.py::set_eagle3_layers_to_capture (read in the 0.5.12 wheel; "
                         "the conditional rule of PR 25454 arrived in 0.5.13)")
            return [x + 1 for x in ids], rules
        if ids and ids[0] == 1:
            rules.append(f"first id is 1: +1 (SGLang {vs}) -- " + FAMILY_SOURCES["deepseek"])
            return [x + 1 for x in ids], rules
        rules.append(f"first id is {ids[0] if ids else None} (not 1): ids used as capture indices, NO +1 "
                     f"(SGLang {vs}) -- " + FAMILY_SOURCES["deepseek"])
        return list(ids), rules
    if family == "gpt_oss" and v >= GPT_OSS_BOUNDARY_SINCE and ids and max(ids) == n:
        rules.append(f"max id == num_layers: ids kept as capture boundaries, no +1 (SGLang {vs}) -- "
                     + FAMILY_SOURCES["gpt_oss"])
        return list(ids), rules
    src = FAMILY_SOURCES["gpt_oss" if family == "gpt_oss" else "plus_one"]
    rules.append(f"+1 for explicit ids (SGLang {vs}) -- " + src)
    return [x + 1 for x in ids], rules


FAMILY_SOURCES = {
    "plus_one": "sglang/srt/models/llama.py::LlamaForCausalLM.set_eagle3_layers_to_capture "
                "(layers_to_capture = [val + 1 for val in layer_ids]; same in qwen2/qwen3/glm4_moe/gemma/...)",
    "deepseek": "sglang/srt/models/deepseek_v2.py::DeepseekV2ForCausalLM.set_eagle3_layers_to_capture "
                "(+1 only `if layer_ids and layer_ids[0] == 1`, else ids as-is; PR #25454, since 0.5.13)",
    "gpt_oss": "sglang/srt/models/gpt_oss.py::GptOssForCausalLM.set_eagle3_layers_to_capture "
               "(since 0.5.17: ids kept as-is when max(layer_ids) == num_layers, the final boundary; else +1)",
    "plus_one_default": "sglang/srt/models/minimax_m3_vl.py::set_eagle3_layers_to_capture "
                        "(+1 applied to the default [2, n//2, n-3] too)",
}


def _sglang_capture_to_tensors(ltc: Sequence[int], n: int, rule: Any, v: tuple[int, ...],
                               plan: CapturePlan) -> None:
    """Fill ``plan.tensors``/notes/problems/fatal from ``layers_to_capture`` (ascending, deduplicated).

    ``rule`` is a :class:`helpers.layers.sglang.TargetRule` (its ``rule`` and ``last_layer``)."""

    family = rule.rule
    vs = ".".join(map(str, v))
    reachable_max = n - 1
    # capture index n = the last layer's output, pre-norm: gpt_oss.py (since 0.5.17), and the models whose forward
    # captures it after the loop in 0.5.23 (gemma3/gemma4/minimax_m3; the release that added it was not read)
    final_boundary = rule.last_layer == "boundary" and (family != "gpt_oss" or v >= GPT_OSS_BOUNDARY_SINCE)
    # Models that flag layers instead of testing `i in self.layers_to_capture` (qwen2_moe.py
    # Qwen2MoeModel.set_eagle3_layers_to_capture: `setattr(self.layers[layer_id], "_is_layer_to_capture", True)`;
    # the same in qwen3_next.py / qwen3_5.py; Qwen3MoeModel inherits it) index an nn.ModuleList: a negative
    # index wraps (Python indexing) to layer n+k, which then captures in(n+k); k >= n or k < -n is an IndexError.
    flags = rule.last_layer == "index_error"
    # DeepSeek family (deepseek_v2.py::DeepseekV2Model.forward): the captures fill AuxHiddenStatePacker(len(ids)); an
    # index the loop never reaches leaves it short and finalize() raises RuntimeError at the first forward, which is
    # SGLang's start-up warm-up: the server never becomes healthy (checked live on 0.5.23). Not silently missing.
    packs = rule.last_layer == "runtime_error" and v >= PACKER_SINCE
    never = (": AuxHiddenStatePacker.finalize raises RuntimeError ('captured k of m aux hidden states') at the first "
             "forward, SGLang's start-up warm-up -- sglang/srt/layers/aux_hidden_states.py") if packs else None
    effective: list[tuple[int, int]] = []          # (capture index as the loop sees it, index as stored)
    for k in ltc:
        if flags and -n <= k < 0:
            effective.append((n + k, k))
            plan.notes.append(f"capture index {k} is negative: {rule.source} flags self.layers[{k}] "
                              f"(nn.ModuleList, Python negative indexing) = layer {n + k}, which captures "
                              f"{EMBEDDING if n + k == 0 else out(n + k - 1)} -- sglang/srt/models/qwen2_moe.py::"
                              "Qwen2MoeModel.set_eagle3_layers_to_capture")
        else:
            effective.append((k, k))
    order = sorted(set(e for e, _ in effective))
    if [e for e, _ in effective] != sorted(e for e, _ in effective):
        loop = ("sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward (the captures fill an "
                "AuxHiddenStatePacker in loop order)" if family == "deepseek" else
                "sglang/srt/models/llama.py::LlamaModel.forward")
        plan.notes.append(f"layers_to_capture {list(ltc)} is not ascending in the layer loop: SGLang captures inside "
                          f"its layer loop (`if i in self.layers_to_capture` / a per-layer flag), so chunks come in "
                          f"ascending layer order {order} -- {loop}")
    if len(set(e for e, _ in effective)) != len(ltc):
        plan.notes.append(f"layers_to_capture {list(ltc)} has duplicates: each index is captured once "
                          "(membership test in the layer loop), so fewer chunks than ids come back")
    tensors: list[str] = []
    for k in order:
        if flags and (k < -n or k > n):
            plan.fatal = plan.fatal or (
                f"capture index {k}: {rule.source} flags self.layers[{k}] of a {n}-layer model without a range "
                f"check: IndexError at start-up (SGLang {vs}) -- sglang/srt/models/qwen2_moe.py::"
                "Qwen2MoeModel.set_eagle3_layers_to_capture")
            plan.problems.append({"kind": "missing_chunk",
                                  "detail": f"capture index {k} does not exist (layers 0..{n - 1}): IndexError at "
                                            "start-up"})
            continue
        if k < 0:
            if rule.last_layer == "unknown":
                plan.problems.append({"kind": "missing_chunk",
                                      "detail": f"capture index {k} is negative: whether it wraps (a per-layer flag "
                                                f"on self.layers[{k}]) or is never reached (`i in layers_to_capture`) "
                                                f"depends on the text model SGLang builds ({rule.source}); a live "
                                                "capture settles it"})
                continue
            plan.problems.append({"kind": "missing_chunk",
                                  "detail": f"capture index {k} is never reached (negative; the layer loop tests "
                                            "`i in self.layers_to_capture` for i in range(0, n))"
                                            + (never or "; that chunk is missing")})
            continue
        if k == 0:
            if family != "deepseek" and v < EMBEDDING_AT_INDEX0_SINCE and family != "gpt_oss":
                plan.fatal = (f"capture index 0 on a Llama-style target: SGLang {vs} (< 0.5.22) computes "
                              "`hidden_states + residual` with residual None (TypeError at the first forward) "
                              "-- sglang/srt/models/llama.py::LlamaModel.forward (read in the 0.5.21 wheel)")
                continue
            tensors.append(EMBEDDING)
            plan.problems.append({"kind": "embedding_in_place_of_layer",
                                  "detail": "capture index 0 captures the embedding output (id -1 with the +1 rule, "
                                            "or id 0 without it); no trainer captures the embedding by default -- "
                                            "0.5.23 layers/layer_boundary/stage.py (residual None at layer 0: the "
                                            "embedding) / layers/communicator.py (DeepSeek family)"})
            continue
        if 1 <= k <= reachable_max:
            tensors.append(out(k - 1))
            continue
        if k == n and final_boundary:
            tensors.append(out(n - 1))
            plan.rules.append(f"capture index n = the last layer's output out(n-1), pre-norm, captured after the layer "
                              f"loop -- {rule.source} (the model's forward: `num_layers` / `end_layer in "
                              "layers_to_capture`)")
            continue
        if k == n and rule.last_layer == "unknown":
            plan.problems.append({"kind": "missing_chunk",
                                  "detail": f"capture index {k} = num_layers: whether this model captures the last "
                                            f"layer depends on the text model SGLang builds for it ({rule.source}); "
                                            "a live capture settles it"})
            continue
        if k == n and rule.last_layer == "index_error":
            plan.fatal = (f"capture index {k} = num_layers: {rule.source} flags self.layers[{k}] without a range "
                          f"check: IndexError at start-up (SGLang {vs}); the id names out({n - 1}), which no "
                          "+1 rule can capture")
            plan.problems.append({"kind": "missing_chunk",
                                  "detail": f"capture index {k} does not exist (layers 0..{n - 1}): IndexError at "
                                            "start-up"})
            continue
        plan.problems.append({"kind": "missing_chunk",
                              "detail": f"capture index {k} is never reached: the layer loop runs i in range(0, {n})"
                                        + (" and only gpt_oss.py (>= 0.5.17) captures the final boundary"
                                           if k == n else "")
                                        + (never or "; that chunk is silently missing")})
    plan.tensors = tensors
    if packs and tensors and len(tensors) != len(ltc) and plan.fatal is None:
        plan.fatal = (f"the DeepSeek family (SGLang {vs}) packs the aux states into AuxHiddenStatePacker("
                      f"len(layers_to_capture)={len(ltc)}) but the layer loop captures {len(tensors)} of them "
                      f"(capture indices {list(ltc)} of a {n}-layer target; each index once): RuntimeError 'captured "
                      f"{len(tensors)} of {len(ltc)} aux hidden states' at the first forward, SGLang's start-up "
                      "warm-up, so the server never becomes healthy -- sglang/srt/models/deepseek_v2.py::"
                      "DeepseekV2Model.forward, sglang/srt/layers/aux_hidden_states.py::AuxHiddenStatePacker.finalize")
    if not tensors and plan.fatal is None:
        # set_eagle3_layers_to_capture set capture_aux_hidden_states = True, but nothing is captured: the model
        # returns the bare hidden states (`if len(aux_hidden_states) == 0: return hidden_states`) and the CausalLM
        # unpacks `hidden_states, aux_hidden_states = hidden_states` from a [tokens, H] tensor.
        plan.fatal = (f"layers_to_capture {list(ltc)} captures nothing, yet capture_aux_hidden_states is True: the "
                      "model returns the bare hidden states and the forward unpacks `hidden_states, "
                      "aux_hidden_states = hidden_states` from a [tokens, H] tensor: ValueError at the first forward "
                      f"(any batch other than exactly 2 tokens; SGLang {vs}) -- sglang/srt/models/llama.py::"
                      "LlamaModel.forward / LlamaForCausalLM.forward (same in deepseek_v2.py, qwen2_moe.py, "
                      "gpt_oss.py)")


def served_plan(draft: Any, target: Any, engine: str = "sglang", version: str | Sequence[int] | None = None,
                algorithm: str = "EAGLE3") -> CapturePlan:
    """The exact ordered list of physical tensors the engine feeds the draft (concatenation order).

    Args:
        draft: a :class:`helpers.formats.configs.DraftConfig` (or an object with ``nested_layer_ids``,
            ``top_level_layer_ids``, ``use_aux_hidden_state``).
        target: a :class:`helpers.formats.configs.TargetConfig` (``num_hidden_layers``, ``architectures``,
            ``model_type``).
        engine: ``"sglang"`` (another engine's plan is its adapter's rules:
            :class:`helpers.diagnosis.plan_rules.PlanRules`).
        version: SGLang version (``"0.5.23"``); None = the newest verified SGLang (0.5.23), noted in the plan.
        algorithm: ``--speculative-algorithm`` (``EAGLE3``, ``EAGLE``, ``NEXTN``).

    Returns:
        A served :class:`CapturePlan` (``provenance`` ``rule``). A target whose SGLang model class has no
        ``set_eagle3_layers_to_capture`` gets ``fatal`` set (EAGLE-3 refused at start-up) and no tensors.

    Raises:
        ValueError: an engine other than SGLang, or an unknown algorithm.

    SGLang rules mirrored (0.5.23; version gates in :mod:`helpers.layers.sglang`):
      * ids are read ONLY from the nested ``eagle_config.eagle_aux_hidden_state_layer_ids``, inside a bare
        ``try/except``; a missing key means None (default) silently
        (``sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py::_resolve_eagle_aux_hidden_state``);
      * ``use_aux_hidden_state: false`` or algorithm EAGLE/NEXTN: no aux capture, the target's final normed
        hidden state is fed (``layers/logits_processor.py::_get_hidden_states_to_store``);
      * ids -> ``layers_to_capture`` per architecture (:func:`sglang_layers_to_capture`);
      * capture happens in the layer loop before layer i (in(i) = out(i-1)), so chunks are ascending and
        deduplicated; index 0 is the embedding (>= 0.5.22) or a TypeError (Llama, older); index n is never
        reached except gpt-oss's final boundary, and crashes models that flag ``self.layers[i]`` (qwen2_moe.py,
        qwen3_moe.py, qwen3_next.py, qwen3_5.py).
    """

    algo = (algorithm or "EAGLE3").upper()
    if algo not in ("EAGLE3", "EAGLE", "NEXTN"):
        raise ValueError(f"unsupported speculative algorithm {algorithm!r} (expected EAGLE3, EAGLE or NEXTN)")
    if engine != "sglang":
        raise ValueError(f"served_plan holds SGLang's rules; the {engine!r} plan comes from its engine adapter's "
                         "rules (helpers.diagnosis.plan_rules.PlanRules; vLLM: helpers.engines.vllm.VLLMRules)")
    n = int(target.num_hidden_layers)
    rule = target_rule(getattr(target, "architectures", None), getattr(target, "model_type", None))
    family = rule.rule
    v = parse_version(version)
    who = f"sglang {'.'.join(map(str, v)) if v else '(version unknown)'}"
    plan = CapturePlan(tensors=[], role="served", who=who, provenance="rule")
    if v is None:
        v = VERIFIED_SGLANG
        plan.notes.append("SGLang version unknown: the rules of 0.5.23 (the release checked) are assumed")
    elif v > VERIFIED_SGLANG:
        plan.notes.append(f"SGLang {'.'.join(map(str, v))} is newer than the release checked (0.5.23); "
                          "its rules are assumed")
    elif v < OLDEST_READ:
        plan.notes.append(f"SGLang {'.'.join(map(str, v))} is older than any release read (0.5.6); the rules of "
                          "0.5.6-0.5.12 are assumed")
    if v != TABLE_VERSION and family not in ("none", "unregistered"):
        plan.notes.append(f"{rule.architecture}: its id rule ({family}) is taken from SGLang 0.5.23's model "
                          "file; version-dependent rules use the release given")
    vs = ".".join(map(str, v))
    if algo in ("EAGLE", "NEXTN"):
        plan.tensors = [FINAL_NORM]
        plan.rules.append(f"algorithm {algo}: no aux capture (only EAGLE3 sets layers_to_capture -- "
                          "spec_aux_hidden_state.py `if spec_algorithm.is_eagle3()`); the target's final normed "
                          "hidden state (width H) is fed -- layers/logits_processor.py::_get_hidden_states_to_store")
        plan.source = f"--speculative-algorithm {algo} (SGLang {vs} rule)"
        return plan
    nested = getattr(draft, "nested_layer_ids", None)
    top = getattr(draft, "top_level_layer_ids", None)
    if getattr(draft, "use_aux_hidden_state", True) is False:
        plan.tensors = [FINAL_NORM]
        plan.rules.append("eagle_config.use_aux_hidden_state is false: no aux capture, final normed hidden "
                          "state fed -- spec_aux_hidden_state.py / attention_backend_setup.py")
        plan.source = "draft config eagle_config.use_aux_hidden_state=false"
        return plan
    if not rule.supports_eagle3:
        plan.fatal = (f"target architecture {rule.architecture or '(none given)'}: "
                      + ("its SGLang model class has no set_eagle3_layers_to_capture"
                         if family == "none" else "not a model class of SGLang 0.5.23 (the Transformers "
                         "fallback backend has no set_eagle3_layers_to_capture)")
                      + f": ValueError at start-up, EAGLE-3 refused -- {rule.source}; "
                      "model_executor/model_runner_components/attention_backend_setup.py::"
                      "configure_aux_hidden_state_capture")
        plan.rules.append(RULE_TEXT["none"])
        plan.source = f"target architecture {rule.architecture} ({rule.source})"
        return plan
    if nested is None and top is not None:
        plan.notes.append(f"the draft config has a top-level eagle_aux_hidden_state_layer_ids {list(top)} but no "
                          "nested eagle_config: SGLang reads only eagle_config[...] and silently falls back to "
                          "its default -- spec_aux_hidden_state.py::_resolve_eagle_aux_hidden_state "
                          "(eagle_utils.py::get_draft_input_from_target_hidden_dim does read the top-level key "
                          "for the draft input buffer width)")
    plan.config_ids = None if nested is None else LayerIds(tuple(int(i) for i in nested), "specforge")
    ltc, rules = sglang_layers_to_capture(nested, n, family, v)
    plan.rules.extend(rules)
    plan.rules.append("ids read from eagle_config.eagle_aux_hidden_state_layer_ids only -- "
                      "sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py")
    plan.engine_ids = LayerIds(tuple(ltc), "sglang_capture")
    _sglang_capture_to_tensors(ltc, n, rule, v, plan)
    ids_txt = "no ids (default)" if nested is None else f"ids {list(nested)}"
    plan.source = (f"draft config eagle_config ({ids_txt}) + SGLang {vs} rule for {rule.architecture} "
                   f"({RULE_TEXT.get(family, family)}) -- {rule.source}")
    if family == "deepseek" and nested and nested[0] != 1 and v >= (0, 5, 13):
        plan.notes.append(f"DeepSeek-family ids {list(nested)} do not start with 1: SGLang {vs} takes them as "
                          "capture indices (in(i)). Drafts are published under both conventions (PR 25454): "
                          "whether this matches training depends on the convention the trainer wrote")
    return plan


def training_plan(draft: Any, target: Any, trainer: str = "specforge",
                  override_ids: LayerIds | Sequence[int] | None = None) -> CapturePlan:
    """The ordered physical tensors a trainer captured (concatenation order of its aux features).

    Args:
        draft: draft config (``nested_layer_ids``, ``top_level_layer_ids``) or None.
        target: target config (``num_hidden_layers``).
        trainer: ``specforge`` | ``speculators`` | ``eagle3`` | ``eagle12``.
        override_ids: ids the run really used, when known (SpecForge run YAML
            ``model.aux_hidden_state_layer_ids`` is NOT persisted in the exported config). Plain ints are read
            in the trainer's own convention.

    Returns:
        A training :class:`CapturePlan` (tensors may be empty when an id names nothing; see ``problems``).

    Rules mirrored:
      * SpecForge: run override, else draft ``eagle_config.eagle_aux_hidden_state_layer_ids``, else
        ``[1, n//2-1, n-4]``; id i = out(i); captured through SGLang, so ascending order
        (``specforge/algorithms/model_providers.py::resolve_eagle_capture_layers``; the older HF backend used
        list order);
      * speculators: top-level ``eagle_aux_hidden_state_layer_ids`` (or nested), else ``[2, n//2, n-3]``;
        in(i); the final slot is dropped by training (``src/speculators/train/data.py``: ``hs[:, :-1]``);
      * original EAGLE-3: in(2), in(n//2), in(n-3);
      * EAGLE-1/2: HF ``hidden_states[-1]`` = final_norm (one chunk).
    """
    n = int(target.num_hidden_layers)
    plan = CapturePlan(tensors=[], role="training", who=trainer)
    if trainer == "eagle12":
        plan.tensors = [FINAL_NORM]
        plan.rules.append("EAGLE-1/2 ge_data saves HF hidden_states[-1] (final normed) -- eagle/ge_data/ge_data_all_llama3.py")
        return plan
    if trainer == "eagle3":
        lids = eagle3_ids(n)
        plan.config_ids = lids
        plan.rules.append("hard-coded in(2), in(n//2), in(n-3) -- eagle/traineagle3/modeling_llama_kv.py")
    elif trainer == "specforge":
        if override_ids is not None:
            lids = override_ids if isinstance(override_ids, LayerIds) else LayerIds(tuple(override_ids), "specforge")
            plan.rules.append(f"run override {lids}")
        elif getattr(draft, "nested_layer_ids", None) is not None:
            lids = LayerIds(tuple(int(i) for i in draft.nested_layer_ids), "specforge")
            plan.rules.append("draft eagle_config.eagle_aux_hidden_state_layer_ids (out(i)) -- "
                              "specforge/algorithms/model_providers.py::resolve_eagle_capture_layers")
        elif getattr(draft, "top_level_layer_ids", None) is not None:
            # what the config claims (the same reading as detectors.detect_config_ids_ignored: an SGLang-form
            # config's ids are out(i)); SpecForge itself reads only eagle_config
            lids = LayerIds(tuple(int(i) for i in draft.top_level_layer_ids), "specforge")
            plan.rules.append("draft top-level eagle_aux_hidden_state_layer_ids, read as out(i) (the convention of "
                              "an SGLang-form config)")
            plan.notes.append(f"the ids {list(lids.ids)} sit at the top level of the draft config, which neither "
                              "SGLang nor SpecForge reads (both read eagle_config): they are what the config claims "
                              "training used; a SpecForge run without an override would have used its default "
                              f"{list(specforge_default_ids(n).ids)}")
        else:
            lids = specforge_default_ids(n)
            plan.rules.append("no ids in the draft config: SpecForge default [1, n//2-1, n-4] -- "
                              "specforge/algorithms/model_providers.py::resolve_eagle_capture_layers")
            plan.notes.append("the draft config carries no layer ids, so the ids training used are not recorded: "
                              "a SpecForge run override (model.aux_hidden_state_layer_ids) is not persisted into "
                              "the exported config.json")
        plan.config_ids = lids
    elif trainer == "speculators":
        ids = getattr(draft, "top_level_layer_ids", None)
        if override_ids is not None:
            lids = override_ids if isinstance(override_ids, LayerIds) else LayerIds(tuple(override_ids), "vllm")
        elif ids is None and getattr(draft, "nested_layer_ids", None) is not None:
            lids = LayerIds(tuple(int(i) for i in draft.nested_layer_ids), "vllm")
        elif ids is not None:
            lids = LayerIds(tuple(int(i) for i in ids), "vllm")
        else:
            lids = vllm_default_ids(n)
        plan.rules.append("speculators ids are in(i), verbatim -- src/speculators/models/utils.py")
        plan.config_ids = lids
    else:
        raise ValueError(f"unknown trainer {trainer!r}; expected one of {TRAINERS}")
    if list(lids.ids) != sorted(lids.ids):
        plan.notes.append(f"{lids} is not ascending: SGLang-based capture concatenates in ascending order; "
                          "SpecForge's old HF backend (Dec 2025 - Jun 2026) concatenated in list order")
    if trainer == "specforge":
        plan.tensors = _specforge_tensors(lids, target, plan)
        return plan
    tensors = []
    for i in sorted(set(lids.ids)):
        try:
            tensors.append(physical(i, lids.convention, n))
        except ValueError as e:       # the id alone: the whole list in each detail was quadratic in the ids
            plan.problems.append({"kind": "missing_chunk", "detail": f"id {i} of {lids.convention} ids "
                                                                     f"({len(lids.ids)} given): {e}"})
    plan.tensors = tensors
    return plan


def _specforge_tensors(lids: LayerIds, target: Any, plan: CapturePlan) -> list[str]:
    """The tensors of SpecForge-style ids, never dropping an id silently.

    Readings tried in order; the first that names every id is the plan:

    1. output-of-layer ``out(i)``, 0 <= i < n (SpecForge: exactly three distinct non-negative ids,
       ``specforge/application/planning.py``);
    2. capture index / boundary ``in(i)`` = out(i-1), index n = the final boundary out(n-1) (an id n cannot be
       out(n): only this reading names it; gpt_oss.py keeps such ids as boundaries since 0.5.17, vLLM /
       speculators write ids this way);
    3. through SGLang's own capture of this target (a trainer that passes the ids to SGLang 0.5.23's
       ``set_eagle3_layers_to_capture`` unchecked, e.g. id -1 -> capture index 0 = the embedding on
       llama.py, a negative index wrapping on qwen2_moe.py's per-layer flags): kept, but uncertain
       (SpecForge rejects negative ids), so ``plan.ambiguity`` holds this reading and the other.

    When none names every id, the plan is empty (unknown) with a ``missing_chunk`` problem: a plan that drops
    an id would contradict the draft's fc (one chunk per id).
    """
    n = int(target.num_hidden_layers)
    ids = sorted(set(lids.ids))
    dup = sorted(i for i, c in Counter(lids.ids).items() if c > 1)
    if dup:
        plan.notes.append(f"id{'s' if len(dup) > 1 else ''} {', '.join(map(str, dup))} repeated in {list(lids.ids)}: "
                          "SpecForge trains on exactly three distinct ids (specforge/application/planning.py), so the "
                          f"training plan names each once ({len(ids)} chunks) while the draft's fc takes "
                          f"{len(lids.ids)}; the config was edited after training")
    if all(0 <= i <= n - 1 for i in ids):
        return [physical(i, "specforge", n) for i in ids]
    odd = [i for i in ids if not 0 <= i <= n - 1]
    why = (f"id{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} name{'' if len(odd) > 1 else 's'} no "
           "output-of-layer tensor of "
           f"a {n}-layer target (out(i) exists for 0 <= i <= {n - 1}; SpecForge accepts exactly three distinct "
           "non-negative ids -- specforge/application/planning.py)")
    if all(0 <= i <= n for i in ids):
        plan.config_ids = LayerIds(lids.ids, "sglang_capture")
        plan.rules.append("ids read as capture boundaries in(i) = out(i-1), index n = out(n-1) (pre-norm): the only "
                          "reading that names every id")
        plan.notes.append(f"{why}: only the capture-boundary reading (in(i) = out(i-1); index {n} = the final "
                          f"boundary out({n - 1}), as sglang/srt/models/gpt_oss.py keeps ids whose max is n since "
                          "0.5.17, and as vLLM / speculators write ids) names all of them, so training is read that "
                          "way")
        return [physical(i, "sglang_capture", n) for i in ids]
    rule = target_rule(getattr(target, "architectures", None), getattr(target, "model_type", None))
    via = None
    if rule.supports_eagle3:
        ltc, _ = sglang_layers_to_capture(list(lids.ids), n, rule.rule, VERIFIED_SGLANG)
        scratch = CapturePlan(tensors=[], role="training", who="sglang")
        _sglang_capture_to_tensors(ltc, n, rule, VERIFIED_SGLANG, scratch)
        if scratch.fatal is None and len(scratch.tensors) == len(ids) and not any(
                p["kind"] == "missing_chunk" for p in scratch.problems):
            via = scratch.tensors
    if via is not None:
        plan.rules.append(f"ids passed through SGLang 0.5.23's capture of {rule.architecture} ({rule.source})")
        plan.notes.append(f"{why}: a trainer that passed them to SGLang 0.5.23's set_eagle3_layers_to_capture "
                          f"unchecked captured {describe(via)} ({rule.source}); SpecForge would have refused them, so "
                          "this reading is uncertain")
        plan.ambiguity = {"readings": [
            {"reading": f"trained through SGLang's own capture of {rule.architecture} (ids passed to "
                        f"set_eagle3_layers_to_capture unchecked, SGLang >= 0.5.22)", "tensors": list(via)},
            {"reading": f"trained with SpecForge (non-negative ids only, specforge/application/planning.py): "
                        f"id{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} cannot be what training used; "
                        "the config was edited after training",
             "tensors": [physical(i, "specforge", n) if 0 <= i <= n - 1 else f"<id {i}: unknown>" for i in ids]}],
            "odd_ids": odd}
        return list(via)
    plan.problems.append({"kind": "missing_chunk",
                          "detail": f"{lids}: {why}, nor a capture index, nor anything SGLang's capture of this "
                                    f"target returns one chunk for: the training plan is unknown (the draft's fc "
                                    f"takes one chunk per id, {len(lids.ids)}); the config was edited after "
                                    "training or belongs to another target"})
    plan.notes.append(f"training plan unknown: {why}, and no other reading names every id; no id is dropped "
                      "silently")
    return []


def compare_plans(served: CapturePlan, trained: CapturePlan) -> list[dict]:
    """Position-wise comparison of two plans: ``[{"index", "served", "training", "offset"}]``.

    ``offset`` is served layer minus training layer when both are ``out(L)``/``embedding`` (embedding = -1),
    else None. Positions present on one side only have None on the other.
    """
    rows = []
    for i in range(max(len(served.tensors), len(trained.tensors))):
        s = served.tensors[i] if i < len(served.tensors) else None
        t = trained.tensors[i] if i < len(trained.tensors) else None
        off = None
        if s is not None and t is not None:
            ls, lt = layer_of(s), layer_of(t)
            if ls is not None and lt is not None:
                off = ls - lt
        rows.append({"index": i, "served": s, "training": t, "offset": off})
    return rows


def describe(tensors: Iterable[str]) -> str:
    """``"[out(1), out(3), out(4)]"``."""
    return "[" + ", ".join(tensors) + "]"
