"""An engine's rules for what it feeds an EAGLE-3 draft, as one object the engine-neutral code calls
(:class:`PlanRules`): the served plan for a draft config (which physical tensor lands in which chunk), where the
engine reads the draft config's layer ids (so a proposed fix writes them there), the setup findings and notes that
only that engine's loader explains. The static check, the diagnosis, the proposed fix and the draft checks take a
``rules`` argument and never ask which engine they run for.

:class:`PlanRules` itself holds SGLang's rules (the default everywhere a server is not attached: the config-only
``diagnose``, a replay); the engine adapters (``helpers.engines``) hand out the rules of the server they attached to:
``SGLangAdapter.rules(version)`` is this class, ``VLLMAdapter.rules(version)`` is ``helpers.engines.vllm.VLLMRules``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

from ..layers.ids import physical
from ..layers.sglang import target_rule
from . import detectors as D
from .conventions import CapturePlan, describe, served_plan

#: how to settle a reading the configs alone cannot decide (the static check's ambiguity)
SETTLE = ("record what training used: pass --trained-layer-ids (SpecForge run YAML model.aux_hidden_state_layer_ids, "
          "SpecForge output-of-layer ids) or keep the data's capture.json; or compare live: python -m helpers capture "
          "(served aux states) and diagnose --training DATA --served DUMP (--reference every-layer capture)")


class PlanRules:
    """SGLang's rules (subclass per engine). ``version``: the engine release whose rules apply (None: the newest
    read, which the plan's notes say).

    Attributes: ``engine`` (``sglang``), ``label`` (``SGLang``), ``convention`` (the convention the engine stores
    its ids in, :mod:`helpers.layers.ids`)."""

    engine = "sglang"
    label = "SGLang"
    convention = "sglang_capture"
    #: how the engine maps draft ids to target ids (the proposed vocab-map fix cites it)
    d2t_rule = ("sglang/srt/models/llama_eagle3.py::LlamaForCausalLMEagle3.load_weights reads d2t from the draft "
                "weights (hot_token_id = d2t + arange); without it draft ids are read as target ids")

    def __init__(self, version: Optional[str] = None) -> None:
        self.version = version

    @property
    def who(self) -> str:
        """``"SGLang 0.5.23"`` (``"(version unknown)"`` without one), for messages."""
        return f"{self.label} {self.version or '(version unknown)'}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.version!r})"

    # ------------------------------------------------------------------------------------------- the plan
    def served_plan(self, draft: Any, target: Any, algorithm: Optional[str] = "EAGLE3") -> CapturePlan:
        """The ordered physical tensors the engine feeds the draft (:func:`helpers.diagnosis.conventions.served_plan`
        for SGLang). Raises ValueError for an unknown algorithm."""
        return served_plan(draft, target, "sglang", self.version, algorithm or "EAGLE3")

    def with_ids(self, draft: Any, ids: Sequence[int]) -> Any:
        """A copy of the draft config (:class:`helpers.formats.configs.DraftConfig`) whose layer ids are ``ids``
        where this engine reads them (SGLang: ``eagle_config.eagle_aux_hidden_state_layer_ids`` only)."""
        return dataclasses.replace(draft, nested_layer_ids=tuple(int(i) for i in ids), use_aux_hidden_state=True)

    def ids_override(self, draft: Any, ids: Sequence[int], kinds: Sequence[str]) -> tuple[dict, str]:
        """``(config override, text)`` writing ``ids`` where this engine reads them (a deep merge into the draft's
        config.json, None removes a key): SGLang reads only the nested ``eagle_config`` key, and a top-level key it
        ignores goes away when it was the finding (``config_ids_ignored``)."""
        over: dict = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(ids)}}
        if draft.top_level_layer_ids is not None and "config_ids_ignored" in kinds:
            over["eagle_aux_hidden_state_layer_ids"] = None
        current = None if draft.nested_layer_ids is None else list(draft.nested_layer_ids)
        return over, (f"set eagle_config.eagle_aux_hidden_state_layer_ids to {list(ids)} in the draft config (now "
                      f"{current if current is not None else f'absent: {self.label} default'})")

    def id_candidates(self, layer: int, num_layers: int) -> list[int]:
        """Candidate config ids for a chunk that must hold out(``layer``) (the SpecForge id first, then the +1 / no +1
        / boundary neighbours); :func:`helpers.investigation.propose.ids_for_plan` runs each through
        :meth:`served_plan`, so no inverse rule is written twice."""
        return [c for c in dict.fromkeys((layer, layer - 1, layer + 1, layer + 2)) if -1 <= c <= num_layers]

    # -------------------------------------------------------------------------- what only this engine explains
    def setup_findings(self, draft: Any, target: Any, plan: CapturePlan, algorithm: str) -> list[dict]:
        """Findings about whether the engine serves this draft and reads its ids: ``unsupported_draft`` (a draft
        class SGLang does not register), ``unsupported_target`` (no ``set_eagle3_layers_to_capture``),
        ``config_ids_ignored`` (top-level ids SGLang never reads)."""
        out: list[dict] = []
        if algorithm == "EAGLE3":
            out += D.detect_unsupported_draft(draft)
        rule = target_rule(target.architectures, target.model_type)
        if not rule.supports_eagle3 and algorithm == "EAGLE3":
            out.append(D.finding("unsupported_target", None, plan.fatal or f"target {rule.architecture} refuses "
                                 "EAGLE-3", architecture=rule.architecture, rule=rule.rule, source=rule.source))
        return out + D.detect_config_ids_ignored(draft, target, plan)

    def supports_target(self, target: Any) -> bool:
        """Whether the engine captures aux states for this target's architecture."""
        return target_rule(target.architectures, target.model_type).supports_eagle3

    def readings(self, draft: Any, target: Any, plan: CapturePlan) -> Optional[dict]:
        """Two readings of the draft config's ids the configs alone cannot decide (SGLang >= 0.5.13's DeepSeek
        family: ids whose first is not 1 are capture indices, SpecForge writes output-of-layer ids), or None."""
        ids = list(draft.nested_layer_ids or [])
        n = target.num_hidden_layers
        if not ids or ids[0] == 1 or target_rule(target.architectures, target.model_type).rule != "deepseek":
            return None
        readings = []
        for conv, name in (("specforge", "output-of-layer ids (SpecForge's convention: id i = out(i))"),
                           ("sglang_capture", "capture indices (in(i) = out(i-1): written for SGLang >= 0.5.13 / PR "
                                              "25454, or vLLM-style)")):
            try:
                tensors = [physical(i, conv, n) for i in sorted(set(ids))]
            except ValueError as e:
                tensors = [f"<{e}>"]
            same = tensors == plan.tensors
            readings.append({"reading": name, "training": tensors,
                             "outcome": "the server feeds exactly these" if same else
                             f"the server feeds {describe(plan.tensors)}: mismatch"})
        if all("mismatch" in r["outcome"] for r in readings) or not any("mismatch" in r["outcome"] for r in readings):
            return None
        return {"readings": readings, "settle": SETTLE}

    def advisories(self, draft: Any, target: Any, plan: CapturePlan, training: Optional[CapturePlan],
                   findings: list[dict], algorithm: str) -> list[str]:
        """Silent behaviours worth knowing that are not faults: ids SGLang ignores that name what it captures
        anyway, a draft config without ids (SGLang's fallback)."""
        out: list[str] = []
        if not self.supports_target(target) or draft.use_aux_hidden_state is False or algorithm != "EAGLE3":
            return out
        if (draft.nested_layer_ids is None and draft.top_level_layer_ids is not None
                and not any(f["kind"] == "config_ids_ignored" for f in findings)):
            out.append(f"SGLang ignores the top-level eagle_aux_hidden_state_layer_ids "
                       f"{list(draft.top_level_layer_ids)} (it reads only eagle_config; spec_aux_hidden_state.py) and "
                       f"falls back to {plan.engine_ids} = {describe(plan.tensors)}, which is what those ids name: "
                       "nothing is wrong today, but move them under eagle_config before anyone changes them")
        if draft.nested_layer_ids is None and draft.top_level_layer_ids is None:
            out.append(f"the draft config has no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang falls back to "
                       f"{plan.engine_ids} = {describe(plan.tensors)}"
                       + (" (the same layers as SpecForge's default [1, n//2-1, n-4])"
                          if training is not None and training.tensors == plan.tensors else "")
                       + "; if training used other layers (a SpecForge run override is not written into the "
                         "exported config), write them under eagle_config")
        return out


#: the default rules (no server attached): SGLang's newest release read
DEFAULT_RULES = PlanRules()


def rules_or_default(rules: Optional[PlanRules], version: Optional[str] = None) -> PlanRules:
    """``rules`` when given, else SGLang's rules of ``version``."""
    return rules if rules is not None else PlanRules(version)
