"""An EAGLE-1 draft (vLLM 0.32.0 ``--speculative-config {"method": "eagle"}``, ``EagleLlamaForCausalLM``) run offline
as vLLM serves it.

vLLM 0.32.0, where each part is:

* ``vllm/model_executor/models/llama_eagle.py::LlamaModel.forward`` for a row with next token ``x_{t+1}`` and the fed
  hidden state ``h_t``::

      x   = fc(cat(embed_tokens(x_{t+1}), h_t))          [2H] -> [H]; ReplicatedLinear, bias=False, no norm
      y, residual = layers(x)                            Llama decoder layers at position t; layer 0's
                                                         input_layernorm is nn.Identity (``LlamaDecoderLayer.__init__``
                                                         with ``disable_input_layernorm``), later ones RMSNorm
      out = y + residual                                 no final norm; ``return hidden_states, hidden_states``
      logits = out @ lm_head^T                           ``LlamaForCausalLM.compute_logits`` with the target's lm_head

  Every draft step runs ``fc`` (unlike EAGLE-3, whose later steps skip it); step j feeds ``out`` of step j-1.
* ``h_t`` on the first pass is the target's hidden state **after** its final norm: ``models/llama.py::LlamaModel.
  forward`` returns ``self.norm(hidden_states, residual)``; ``v1/worker/gpu_model_runner.py`` sets
  ``use_aux_hidden_state_outputs`` only for eagle3 / dflash / extract_hidden_states and otherwise passes
  ``target_hidden_states = hidden_states[:num_scheduled_tokens]`` to ``drafter.propose``
  (``v1/spec_decode/llm_base_proposer.py::SpecDecodeBaseProposer.propose``: ``combine_hidden_states`` is for eagle3 /
  dflash only).
* Weights: ``EagleLlamaForCausalLM.load_weights`` prefixes ``model.`` to every name but ``lm_head``: the checkpoint
  holds ``fc.weight`` and ``layers.{i}.*`` (q/k/v/o_proj, gate/up/down_proj, post_attention_layernorm, and
  input_layernorm for i > 0). ``llm_base_proposer.py::_maybe_share_embeddings`` / ``_maybe_share_lm_head`` give the
  draft the target's ``embed_tokens`` when the checkpoint has none (``has_own_embed_tokens``), or when its own equals
  the target's, and the target's lm_head (``EagleLlamaForCausalLM`` builds no lm_head of its own). No d2t: the draft
  vocabulary is the target's.
* Method: ``vllm/config/speculative.py::SpeculativeConfig.__post_init__`` wraps the draft config in
  ``transformers_utils/configs/eagle.py::EAGLEConfig(method="eagle")``, which names the architecture
  ``Eagle{arch}`` (an ``Eagle`` prefix kept), i.e. ``EagleLlamaForCausalLM`` (``registry.py``: ``llama_eagle``).

:class:`Eagle1Draft` is an :class:`helpers.draft.model.Eagle3Draft` whose ``project`` / layer entry / finish are
these; the draft-extend pass, the draft decode step with its KV, the teacher-forced unroll and the drafting replay of
:mod:`helpers.draft.simulate` are the EAGLE-3 draft's, unchanged (the ``aux`` rows of a sequence are then the
target's post-final-norm hidden states, as for the NextN head).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import BadInput
from ..formats.configs import read_config_json, read_safetensors_index, read_target_config
from .attention import LLAMA_CLASS
from .config_checks import effective_rope
from .model import DraftArch, Eagle3Draft, _add_rms, _finite, _read_tensor, find_target_tensor

LOADER = "vllm/model_executor/models/llama_eagle.py::EagleLlamaForCausalLM.load_weights"
#: the draft architectures this module runs (vLLM 0.32.0 ``registry.py``: ``llama_eagle``)
EAGLE1_CLASSES = ("EagleLlamaForCausalLM",)


#: vLLM 0.32.0's rule for checkpoint tensors the draft has no parameter for
#: (``vllm/model_executor/models/utils.py::AutoWeightsLoader``, through ``llama_eagle.py::LlamaModel.load_weights``)
UNEXPECTED_RULE = "vllm/model_executor/models/utils.py::AutoWeightsLoader._load_module"
#: name parts vLLM drops before loading (``AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``)
ROTARY_DROPPED = ("rotary_pos_emb.inv_freq", "rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def unexpected_tensor_effect(name: str) -> Optional[str]:
    """What vLLM 0.32.0 does with a draft checkpoint tensor ``name`` that ``EagleLlamaForCausalLM`` has no parameter
    for: the reason it is dropped (a rotary cache: ``AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER``; a name
    ending ``.bias``: ``AutoWeightsLoader.load_weights`` adds ``.bias`` to ``ignore_unexpected_suffixes``, "Ignore
    unexpected biases (typically from GPTQ models)", so e.g. an ``fc.bias`` is not served), or None: vLLM raises
    ``ValueError("There is no module or parameter named ...")`` at start-up (:data:`UNEXPECTED_RULE`). Checked by
    running vLLM 0.32.0's ``AutoWeightsLoader`` on a module tree with the draft's names."""
    if any(r in name for r in ROTARY_DROPPED):
        return "dropped (AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER)"
    if name.endswith(".bias"):
        return ("ignored: vLLM serves the draft without it (AutoWeightsLoader.load_weights: ignore_unexpected_suffixes "
                "'.bias')")
    return None


def is_eagle1(cfg: dict) -> bool:
    """The draft config.json dict ``cfg`` names an EAGLE-1 class (:data:`EAGLE1_CLASSES`)."""
    return any(a in EAGLE1_CLASSES for a in (cfg.get("architectures") or []))


def eagle1_tensor_names(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The checkpoint names ``EagleLlamaForCausalLM.load_weights`` fills for a draft config dict ``cfg``, with the
    shapes ``llama_eagle.py::LlamaModel.__init__`` builds (unquantised, no biases); ``embed_tokens`` left out."""
    H, I = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or H // nh)
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, 2 * H)}
    for i in range(int(cfg["num_hidden_layers"])):
        p = f"layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                    p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                    p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                    p + "mlp.down_proj.weight": (H, I), p + "post_attention_layernorm.weight": (H,)})
        if i > 0:
            out[p + "input_layernorm.weight"] = (H,)
    return out


class Eagle1Draft(Eagle3Draft):
    """An EAGLE-1 draft folder run in pure torch in ``dtype`` (see the module docstring).

    ``extend(tokens [T], hidden [T, H], positions)``: the draft-extend pass (row t: token ``x_{t+1}`` with the target's
    post-norm state at t, causal over rows 0..t) -> :class:`helpers.draft.model.ExtendOutput` (``logits [T, V]``
    float32 over the target vocabulary, ``hidden [T, H]`` = ``out``). ``step(...)``: one draft decode step. Both
    inherited from :class:`Eagle3Draft`.
    """

    WHOLE_VOCAB = "an EAGLE-1 draft"

    @classmethod
    def load(cls, draft_dir: str | Path, target_dir: Optional[str | Path], *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", dtype_reason: str = "", loader=None) -> "Eagle1Draft":
        """The draft of ``draft_dir`` (config.json + safetensors) with the tensors vLLM 0.32.0 gives it: its own
        ``fc`` / ``layers.*``, the embedding it ships unless absent (then the target's), the target's lm_head.

        Raises:
            BadInput: no ``target_dir`` (the lm_head is the target's), a missing / misshapen / non-finite tensor (file
                and key named), a tensor vLLM has no parameter for and refuses (:func:`unexpected_tensor_effect`;
                one it ignores, a ``.bias`` or a rotary cache, is left out as vLLM does and listed in
                ``sources["ignored"]``), a rope type other than default, attention or MLP bias, or a target without
                an embedding / lm_head of ``[vocab_size, hidden_size]``.
        """
        draft_dir = Path(draft_dir)
        where = draft_dir / "config.json"
        cfg = read_config_json(where, "draft config")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise BadInput(f"expected a positive int, got {cfg.get(key)!r} ({LOADER} builds the draft from it)",
                               path=where, field=key)
        if cfg.get("attention_bias") or cfg.get("mlp_bias"):
            raise BadInput("attention_bias / mlp_bias set: the offline EAGLE-1 run has no biases", path=where,
                           field="attention_bias")
        rope = effective_rope(cfg, where)
        if rope["rope_type"] != "default":
            raise BadInput(f"rope type {rope['rope_type']!r}: the offline EAGLE-1 run implements default rope only",
                           path=where, field="rope_parameters")
        if target_dir is None:
            raise BadInput("an EAGLE-1 draft runs with the target's lm_head (llm_base_proposer.py::"
                           "_maybe_share_lm_head): the target folder is needed", path=draft_dir, field="--target")
        target_dir = Path(target_dir)
        headers = read_safetensors_index(draft_dir)
        raw: dict[str, torch.Tensor] = {}
        for name, want in eagle1_tensor_names(cfg).items():
            if name not in headers:
                raise BadInput(f"no tensor {name} ({LOADER} would leave the parameter uninitialised)",
                               path=draft_dir, field=name)
            if tuple(headers[name].shape) != want:
                raise BadInput(f"shape {list(headers[name].shape)}, expected {list(want)} (from config.json: "
                               "hidden_size, intermediate_size, heads, head_dim)", path=headers[name].file, field=name)
            t = _read_tensor(headers[name].file, name)
            _finite(t, headers[name].file, name)
            raw[name] = t
        known = set(eagle1_tensor_names(cfg)) | {"embed_tokens.weight"}
        ignored: dict[str, str] = {}
        for name in sorted(set(headers) - known):
            why = unexpected_tensor_effect(name)
            if why is None:
                raise BadInput(f"unexpected tensor: EagleLlamaForCausalLM has no parameter {name} (fc has no bias, "
                               f"no final norm, no lm_head of its own): vLLM 0.32.0 refuses the draft at start-up "
                               f"({UNEXPECTED_RULE}: ValueError 'There is no module or parameter named ...')",
                               path=headers[name].file, field=name)
            ignored[name] = why
        H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        sources: dict = {"draft": f"{draft_dir} fc + layers.* (EAGLE-1, {LOADER})",
                         "dtype": dtype_reason or str(dtype).removeprefix("torch.")}
        if ignored:
            sources["ignored"] = ignored
        tcfg = read_target_config(target_dir).raw
        hit = find_target_tensor(target_dir, "embed_tokens.weight")
        if hit is None:
            raise BadInput("the target's safetensors hold no embed_tokens.weight (vLLM shares it with the draft: "
                           "llm_base_proposer.py::_maybe_share_embeddings)", path=target_dir)
        if "embed_tokens.weight" in headers:
            embed = _read_tensor(headers["embed_tokens.weight"].file, "embed_tokens.weight")
            _finite(embed, headers["embed_tokens.weight"].file, "embed_tokens.weight")
            sources["embed"] = "the draft's own embed_tokens (vLLM keeps it when it differs from the target's)"
        else:
            embed = _read_tensor(hit[1], hit[0])
            sources["embed"] = f"target {hit[1].name}:{hit[0]}"
        hh = None if tcfg.get("tie_word_embeddings") else find_target_tensor(target_dir, "lm_head.weight")
        lm_head = _read_tensor(hit[1], hit[0]) if hh is None else _read_tensor(hh[1], hh[0])
        sources["lm_head"] = "the target's tied embedding" if hh is None else f"target {hh[1].name}:{hh[0]}"
        for name, t in (("embed_tokens.weight", embed), ("lm_head.weight", lm_head)):
            _finite(t, target_dir, name)
            if tuple(t.shape) != (V, H):
                raise BadInput(f"shape {list(t.shape)}, expected [{V}, {H}] (the draft's vocab_size, hidden_size)",
                               path=target_dir, field=name)
        sources["d2t"] = "none (the target's vocabulary)"
        nh = int(cfg["num_attention_heads"])
        arch = DraftArch(hidden=H, target_hidden=H, num_aux=1, heads=nh,
                         kv_heads=int(cfg.get("num_key_value_heads") or nh),
                         head_dim=int(cfg.get("head_dim") or H // nh), intermediate=int(cfg["intermediate_size"]),
                         layers=int(cfg["num_hidden_layers"]), eps=float(cfg.get("rms_norm_eps", 1e-6)),
                         rope_theta=float(rope["rope_theta"]), rope_scaling=None, vocab=V, draft_vocab=V, tie=False,
                         lm_head_from_target=True, norm_before_fc=False, fc_norm=False, norm_output=False,
                         fc_bias=False, max_position=cfg.get("max_position_embeddings"),
                         architecture=LLAMA_CLASS)   # LLAMA_CLASS picks the Llama attention adapter
        w = {k: v.to(device=device, dtype=dtype) for k, v in raw.items()}
        return cls(arch, w, embed.to(device=device, dtype=dtype), lm_head.to(device=device, dtype=dtype), None,
                   dtype=dtype, sources=sources)


    # ---- llama_eagle.py::LlamaModel.forward ------------------------------------------------------------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's post-final-norm hidden states ``[T, H]``, as they are (``fc`` runs in the layer entry, at
        every draft step)."""
        if aux.shape[-1] != self.arch.hidden:
            raise BadInput(f"the hidden states are {aux.shape[-1]} wide, expected the target's hidden_size "
                           f"{self.arch.hidden} (an EAGLE-1 draft reads its post-final-norm state)", field="hidden")
        return aux.to(self.dtype)

    def _layer_in(self, i: int, embeds: torch.Tensor, h: torch.Tensor, residual: Optional[torch.Tensor]):
        a, w = self.arch, self.w
        if i == 0:
            x = F.linear(torch.cat([embeds.to(self.dtype), h], dim=-1), w["fc.weight"])
            return x, x                                   # input_layernorm = nn.Identity, residual = x
        return _add_rms(h, residual, w[f"layers.{i}.input_layernorm.weight"], a.eps)

    def _finish(self, m: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = (m.float() + residual.float()).to(m.dtype)
        return out, F.linear(out, self.lm_head).float()


__all__ = ["Eagle1Draft", "EAGLE1_CLASSES", "ROTARY_DROPPED", "UNEXPECTED_RULE", "eagle1_tensor_names", "is_eagle1",
           "unexpected_tensor_effect"]
