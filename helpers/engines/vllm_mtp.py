"""vLLM 0.32.0 serving an MTP / NextN head (``--speculative-config {"method": "mtp", "num_speculative_tokens": k}``,
no ``model``: the target's folder is the draft's, ``vllm/config/speculative.py::SpeculativeConfig.__post_init__``)
on its CPU backend, and the state it hands the head.

**What vLLM's CPU backend serves.** An MLA target (DeepSeek-V3 / Kimi-class: ``kv_lora_rank`` set) runs only when its
latent width ``kv_lora_rank + qk_rope_head_dim`` is 576 (DeepSeek-V3's 512 + 64):

* on a CPU with AMX tiles vLLM picks ``AMX_MLA`` (``vllm/platforms/cpu.py::CpuPlatform.get_attn_backend_cls``),
  whose ``vllm/v1/attention/backends/mla/amx_mla.py::AMXMLAImpl.process_weights_after_loading`` packs
  ``kv_b_proj``'s ``W_UK`` with ``torch.ops._C.convert_weight_packed``: at the embedded Kimi-class target
  (``qk_nope_head_dim`` 16) the start fails with ``RuntimeError: invalid weight input features 16``;
* with ``--attention-backend CPU_MLA`` (or on a CPU without AMX) the server starts and the first request fails in
  ``vllm/model_executor/layers/attention/mla_attention.py::MLACommonMetadata.__post_init__``: ``ValueError: Head
  dimension 72 is not supported by MLA.`` (``cpu_mla.py::CPUMLABackend.get_supported_head_sizes`` and
  ``amx_mla.py::AMXMLABackend.get_supported_head_sizes`` return ``[576]``).

Both were run here (docs/mtp.md, "vLLM"). A target with standard attention is served at the head sizes of
:data:`helpers.engines.vllm_server.CPU_HEAD_SIZES`; the MiMo pair (``env/models/make_mimo_pair.py``: the llama_h64
target as ``MiMoForCausalLM`` with one ``model.mtp_layers.0``) is the one run here.

**The state the head reads** (what ``gpu_model_runner.py`` hands ``drafter.propose`` as ``target_hidden_states``
when the method is not eagle3 / dflash: the target model's own return value), per family (:data:`FED_STATE`):

* DeepSeek-V3 / Kimi: ``vllm/model_executor/models/deepseek_v2.py::DeepseekV2Model.forward`` returns
  ``self.norm(hidden_states, residual)``: the state **after** the final norm, ``norm(out(n-1))``, as SGLang's
  ``deepseek_nextn.py`` reads it. The head (``deepseek_mtp.py::DeepSeekMultiTokenPredictorLayer.forward``) then
  returns the pre-norm sum for the logits and ``shared_head.norm`` of it as the state of the next draft step
  (``llm_base_proposer.py::SpecDecodeBaseProposer.model_returns_tuple``), also as SGLang.
* MiMo: ``vllm/model_executor/models/mimo.py::MiMoModel.forward`` returns ``hidden_states + residual``: the state
  **before** the final norm, ``out(n-1)`` (``MiMoForCausalLM.compute_logits`` applies ``model.norm``).

Both heads zero the token embedding at position 0 (``torch.where(positions == 0, 0, inputs_embeds)`` in
``deepseek_mtp.py`` / ``mimo_mtp.py``), so the head's row for the first prompt token reads no embedding.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..errors import BadServerInput
from ..layers.mtp import MTPHead, mtp_head

#: the MLA latent widths (kv_lora_rank + qk_rope_head_dim) vLLM 0.32.0's CPU MLA backends take
#: (``cpu_mla.py::CPUMLABackend.get_supported_head_sizes``, ``amx_mla.py::AMXMLABackend.get_supported_head_sizes``)
CPU_MLA_LATENT = (576,)

_VM = "vllm/model_executor/models"

#: per MTP family (``helpers.layers.mtp.MTPFamily.name``): the tensor vLLM 0.32.0 feeds the head (in the served-state
#: candidates' names: ``norm(out(n-1))`` after the final norm, ``out(n-1)`` before it) and where that is decided
FED_STATE: dict[str, tuple[str, str]] = {
    "deepseek_v3": ("norm(out(n-1))", f"{_VM}/deepseek_v2.py::DeepseekV2Model.forward (returns "
                                      "self.norm(hidden_states, residual))"),
    "mimo": ("out(n-1)", f"{_VM}/mimo.py::MiMoModel.forward (returns hidden_states + residual; "
                         "MiMoForCausalLM.compute_logits applies model.norm)"),
}


#: how vLLM 0.32.0 runs ``num_speculative_tokens`` above the head's layer count: the proposer's loop
#: (``llm_base_proposer.py::SpecDecodeBaseProposer.propose``) calls the head again on the state it returned, with no
#: ``spec_step_idx`` (``deepseek_mtp.py::DeepSeekMultiTokenPredictor.forward``: ``spec_step_idx % num_mtp_layers``;
#: ``mimo_mtp.py::MiMoMTP.forward`` asserts 0)
STEPS_SOURCE = ("vllm/v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose (the MTP layer run again "
                "on its own output at every draft step)")


def fed_state(head: MTPHead) -> Optional[tuple[str, str]]:
    """``(candidate, source)``: the hidden state vLLM 0.32.0 hands ``head`` (:data:`FED_STATE`), None for a family
    whose rule was not read here."""
    return FED_STATE.get(head.family.name)


def speculative_config(num_speculative_tokens: int) -> dict:
    """vLLM's ``--speculative-config`` for the target's own head: ``{"method": "mtp", "num_speculative_tokens": k}``
    (no ``model``: ``SpeculativeConfig.__post_init__`` takes the target's; the per-family names such as
    ``deepseek_mtp`` are deprecated aliases of ``mtp``).

    Raises:
        BadServerInput: ``num_speculative_tokens`` < 1."""
    if int(num_speculative_tokens) < 1:
        raise BadServerInput(f"--steps {num_speculative_tokens}: vLLM's num_speculative_tokens must be >= 1")
    return {"method": "mtp", "num_speculative_tokens": int(num_speculative_tokens)}


def cpu_refusal(cfg: dict, where: str = "target config") -> Optional[str]:
    """Why vLLM 0.32.0's CPU backend cannot serve this target's MTP head (one line naming the field, the vLLM
    function and its error), None when nothing here refuses it.

    ``cfg``: the target's config.json (dict). Refused: no MTP head vLLM maps to a head class
    (:func:`helpers.layers.mtp.mtp_head`; the family's ``architectures``), a head layer count that is absent or 0,
    an MLA latent width other than :data:`CPU_MLA_LATENT` (module docstring)."""
    head = mtp_head(cfg)
    head = head.as_read_by("vLLM") if head is not None else None
    if head is None or head.arch in head.family.vllm_no_head:
        return (f"{where}: architectures={cfg.get('architectures')} is not a target vLLM 0.32.0 maps to an MTP head "
                "(vllm/config/speculative.py::SpeculativeConfig.hf_config_override)")
    if not head.layers:
        return (f"{where}: {head.family.layers_field} is {head.layers!r}: the target has no MTP layer for vLLM's "
                f"{head.vllm_arch} to load")
    kv = cfg.get("kv_lora_rank")
    if kv:
        width = int(kv) + int(cfg.get("qk_rope_head_dim") or 0)
        if width not in CPU_MLA_LATENT:
            return (f"{where}: MLA latent width kv_lora_rank + qk_rope_head_dim = {width}; vLLM 0.32.0's CPU MLA "
                    f"backends take {list(CPU_MLA_LATENT)} only: AMX_MLA fails at start in amx_mla.py::AMXMLAImpl."
                    "process_weights_after_loading (RuntimeError 'invalid weight input features "
                    f"{cfg.get('qk_nope_head_dim')}'), CPU_MLA at the first request in mla_attention.py::"
                    f"MLACommonMetadata.__post_init__ (ValueError 'Head dimension {width} is not supported by MLA.')")
    return None


def check_mtp_target(target: Path) -> tuple[dict, MTPHead]:
    """The target config and its MTP head, checked for what vLLM's CPU backend serves (:func:`cpu_refusal`).

    Raises:
        BadServerInput: the refusal, naming the config file and field."""
    # lazy: the worker extension imports this module inside vLLM's server (describe_mtp) and needs no server helper
    from ..server.embedded import check_model_dir

    cfg = check_model_dir(Path(target), "target")
    why = cpu_refusal(cfg, f"target config {Path(target) / 'config.json'}")
    if why:
        raise BadServerInput(why)
    head = mtp_head(cfg)
    assert head is not None
    return cfg, head


def describe_mtp(drafter: Any) -> dict:
    """What a loaded vLLM MTP drafter is, for the worker extension's ``e3f_describe`` (JSON-able): ``mtp_layers``
    (the head layer ids of the ModuleDict the head class builds, ``mtp_start_layer_idx = num_hidden_layers``),
    ``returns_tuple`` (``llm_base_proposer.py::SpecDecodeBaseProposer.model_returns_tuple``: a separate state for the
    next draft step), ``embed_shared`` / ``lm_head_shared`` read by the caller. Empty for a drafter without them."""
    dm = getattr(drafter, "model", None)
    inner = getattr(dm, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(inner, "mtp_layers", None)
    out: dict = {}
    if layers is not None and hasattr(layers, "keys"):
        out["mtp_layers"] = sorted(int(k) for k in layers.keys())
    f = getattr(drafter, "model_returns_tuple", None)
    if callable(f):
        out["returns_tuple"] = bool(f())
    return out


__all__ = ["CPU_MLA_LATENT", "FED_STATE", "STEPS_SOURCE", "fed_state", "speculative_config", "cpu_refusal", "check_mtp_target",
           "describe_mtp"]
