"""The seam for drafts that read ONE target hidden state rather than EAGLE-3's aux chunks: the MTP / NextN head
(SGLang ``--speculative-algorithm NEXTN``) and the EAGLE-1 draft (vLLM ``method: eagle``). Both are fed the target's
final hidden state after its final norm, ``norm(out(n-1))``; the stages of :mod:`helpers.investigation.mtp`
(capture, reference, the served state's identification, the checkpoint / draft / wiring / live budget) run for either,
and a :class:`SingleStateDraft` profile carries what differs: the draft's name, the serving engine, where its source
feeds the state, the draft stage (which training log, which metric) and whether the served chain depth is checked
against the trained one.

:data:`EAGLE1` is vLLM 0.32.0's EAGLE-1 draft (the NextN profile, ``helpers.investigation.mtp.NEXTN``, lives beside
the stages it was built with). What vLLM feeds it, read in the installed source:

* ``vllm/model_executor/models/llama.py::LlamaModel.forward`` returns ``self.norm(hidden_states, residual)`` (the
  final norm applied); ``vllm/v1/worker/gpu_model_runner.py`` sets ``use_aux_hidden_state_outputs`` only for eagle3 /
  dflash / extract_hidden_states and otherwise hands ``target_hidden_states = hidden_states[:num_scheduled_tokens]``
  to ``drafter.propose`` (``vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose`` calls
  ``combine_hidden_states`` for eagle3 / dflash only);
* ``vllm/model_executor/models/llama_eagle.py::LlamaModel.forward`` reads it as ``fc(cat(embed(x_{t+1}), h_t))``.

The capture (``helpers.engines.vllm.VLLMAdapter.capture_served``, the worker extension's wrapper of
``drafter.propose``) records that ``target_hidden_states`` per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..draft.eagle1_stage import eagle1_draft_stage


@dataclass(frozen=True)
class SingleStateDraft:
    """What differs between single-state drafts in the stages of :mod:`helpers.investigation.mtp`.

    Attributes:
        kind: ``investigation.json`` ``diagnosis.kind`` / ``acceptance.kind`` (``"mtp"``, ``"eagle1"``).
        who: the draft in the findings' words (``"the NextN head"``); label: its short name in the budget line.
        engine: the serving engine whose rule the expected state is (``"SGLang"``, ``"vLLM"``).
        feed_source: the engine's source where the expected state is fed (file::function chain).
        fix_source: the engine's rule, cited by the proposed fix.
        live_source: where the live per-request counters come from; capture: where the served states come from.
        draft_stage: the draft stage, ``(head, target_dir, steps, *, draft_dir, training, training_log, validation,
            progress) -> dict`` (:func:`helpers.draft.nextn_stage.nextn_draft_stage`'s result).
        steps_check: whether the served chain depth is checked against the depth the draft was trained for (an MTP
            head trained at depth 1; an EAGLE-1 draft is built to chain on its own outputs, as vLLM runs it).
        title: the page's title.
        engine_rule: True when the serving engine's adapter says which state it feeds this kind of head
            (``EngineAdapter.mtp_fed_state``: an MTP head, whose rule differs per engine and family); False when the
            profile's own rule holds (:attr:`expected`, :attr:`feed_source`, :attr:`engine`).
        expected: the served-state candidate the profile's own rule feeds (``norm(out(n-1))``: after the final norm).
        weights_check: whether the draft's weights are the target's MTP layer, checked against what the engine loads
            (``helpers.draft.mtp_weights``: own copies, missing tensors).
    """
    kind: str
    who: str
    label: str
    engine: str
    feed_source: str
    fix_source: str
    live_source: str
    capture: str
    draft_stage: Callable[..., dict]
    steps_check: bool
    title: str
    engine_rule: bool = False
    expected: str = "norm(out(n-1))"
    weights_check: bool = False

    def fed_state(self, adapter: Any, family: Optional[str]) -> tuple[str, str, str]:
        """``(expected candidate, source, engine label)``: what the serving engine feeds this draft. With
        :attr:`engine_rule` the adapter's rule for an MTP head of ``family`` (``adapter.mtp_fed_state(family)``,
        ``adapter.label``); else the profile's own (:attr:`expected`, :attr:`feed_source`, :attr:`engine`)."""
        if self.engine_rule:
            expected, source = adapter.mtp_fed_state(family)
            return expected, source, adapter.label
        return self.expected, self.feed_source, self.engine


#: vLLM 0.32.0's EAGLE-1 draft (``EagleLlamaForCausalLM``, ``method: eagle``; module docstring)
EAGLE1 = SingleStateDraft(
    kind="eagle1", who="the EAGLE-1 draft", label="EAGLE-1", engine="vLLM",
    feed_source=("vllm/model_executor/models/llama_eagle.py::LlamaModel.forward (fc(cat(embed, h))) <- "
                 "vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose (target_hidden_states, no "
                 "combine_hidden_states for method eagle) <- vllm/v1/worker/gpu_model_runner.py (hidden_states, "
                 "use_aux_hidden_state_outputs False) <- vllm/model_executor/models/llama.py::LlamaModel.forward "
                 "(self.norm applied)"),
    fix_source=("vLLM 0.32.0 hands drafter.propose the target's hidden_states after LlamaModel.forward's final norm "
                "(vllm/model_executor/models/llama.py::LlamaModel.forward, vllm/v1/worker/gpu_model_runner.py)"),
    live_source="vLLM per-request spec decode counters (num_spec_steps, num_accepted_draft_tokens) of the same answers",
    capture="the worker extension's capture of drafter.propose's target_hidden_states",
    draft_stage=eagle1_draft_stage, steps_check=False, title="EAGLE-1 draft live investigation")


__all__ = ["EAGLE1", "SingleStateDraft"]
