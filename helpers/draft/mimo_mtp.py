"""A MiMo target's MTP head (``MiMoForCausalLM`` with ``num_nextn_predict_layers``, the checkpoint's
``model.mtp_layers.0.*``) run offline as vLLM 0.32.0 serves it with ``--speculative-config {"method": "mtp"}``.

vLLM's layer (``vllm/model_executor/models/mimo_mtp.py::MiMoMultiTokenPredictorLayer.forward``) for a row at position
t with next token ``x_{t+1}`` and the target's state ``h_t``::

    e   = embed(x_{t+1}), zeroed at position 0         torch.where(positions == 0, 0, inputs_embeds)
    x   = input_proj(cat(hidden_layernorm(h_t), token_layernorm(e)))      [2H] -> [H], **hidden half first**
    y   = Qwen2DecoderLayer(x, position t)          input_layernorm, attention with q/k/v biases, neox rope, MLP
    out = final_layernorm(y + residual)             logits = out @ lm_head^T; ``out`` is also the next step's h

``h_t`` is the target's state **before** its final norm: ``mimo.py::MiMoModel.forward`` returns
``hidden_states + residual`` and ``MiMoForCausalLM.compute_logits`` applies ``model.norm`` itself, so
``gpu_model_runner.py`` hands ``drafter.propose`` the pre-norm ``out(n-1)`` (unlike DeepSeek-V3's head, fed the
post-norm state: ``helpers.engines.vllm_mtp.FED_STATE``). The embedding and lm_head are the target's
(``llm_base_proposer.py::_maybe_share_embeddings`` / ``_maybe_share_lm_head``: "Detected MTP model"). Weights:
``mimo_mtp.py::MiMoMTP.hf_to_vllm_mapper`` maps ``model.mtp_layers.{i}.`` to head layer ``num_hidden_layers + i``
and the layer's ``self_attn`` / ``mlp`` / ``input_layernorm`` / ``post_attention_layernorm`` into its
``mtp_block``. Later draft steps run the same layer (``MiMoMTP.forward`` asserts ``spec_step_idx == 0``; the
proposer's loop passes none) on the ``out`` of the step before.

:class:`MiMoMTPHead` is an :class:`helpers.draft.model.Eagle3Draft` whose layer entry and finish are these (the
extend pass, decode step, teacher-forced unroll and drafting replay of :mod:`helpers.draft.simulate` unchanged); a
sequence's ``aux`` rows are the target's pre-norm last-layer states.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import BadInput
from ..formats.configs import read_config_json, read_safetensors_index
from .attention import LLAMA_CLASS, _rms
from .config_checks import effective_rope
from .model import DraftArch, Eagle3Draft, ExtendOutput, _add_rms, _finite, _read_tensor, find_target_tensor

LOADER = "vllm/model_executor/models/mimo_mtp.py::MiMoMTP.load_weights"
HEAD_NAMES = ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm")


def mimo_mtp_tensor_names(cfg: dict, i: int = 0) -> dict[str, tuple[int, ...]]:
    """The checkpoint names (``model.mtp_layers.{i}.*``) vLLM's MiMo head loads for a target config dict ``cfg``,
    with the shapes ``MiMoMultiTokenPredictorLayer.__init__`` builds (Qwen2: q/k/v biases)."""
    H, I = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    nh = int(cfg["num_attention_heads"])
    nkv = int(cfg.get("num_key_value_heads") or nh)
    hd = int(cfg.get("head_dim") or H // nh)
    p = f"model.mtp_layers.{i}."
    return {p + "token_layernorm.weight": (H,), p + "hidden_layernorm.weight": (H,),
            p + "input_proj.weight": (H, 2 * H), p + "final_layernorm.weight": (H,),
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.q_proj.bias": (nh * hd,),
            p + "self_attn.k_proj.weight": (nkv * hd, H), p + "self_attn.k_proj.bias": (nkv * hd,),
            p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.v_proj.bias": (nkv * hd,),
            p + "self_attn.o_proj.weight": (H, nh * hd), p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)}


class MiMoMTPHead(Eagle3Draft):
    """The MTP head of a MiMo target folder, run in pure torch in ``dtype`` (see the module docstring).

    ``extend(tokens [T], hidden [T, H], positions)``: row t takes token ``x_{t+1}`` and the target's **pre-norm**
    state at t -> :class:`helpers.draft.model.ExtendOutput` (``logits [T, V]`` float32, ``hidden [T, H]`` = ``out``,
    post ``final_layernorm``); rows at position 0 read a zero embedding. ``step(...)``: one draft decode step. Both
    from :class:`Eagle3Draft`.
    """

    WHOLE_VOCAB = "an MTP head"
    READS_PRE_NORM = True     # mimo.py::MiMoModel.forward hands the drafter hidden_states + residual, before model.norm

    _zero_rows: Optional[torch.Tensor] = None

    @classmethod
    def load(cls, target_dir: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             dtype_reason: str = "") -> "MiMoMTPHead":
        """The head of ``target_dir`` (config.json + safetensors, one file or an index) with the tensors vLLM gives
        it: ``model.mtp_layers.0.*``, the target's ``model.embed_tokens`` and lm_head (tied: the embedding).

        Raises:
            BadInput: ``num_nextn_predict_layers`` is not 1 (the offline head runs one layer), a rope type other than
                default, a missing / misshapen / non-finite tensor (file and key named), a target without an
                embedding / lm_head of ``[vocab_size, hidden_size]``."""
        target_dir = Path(target_dir)
        where = target_dir / "config.json"
        cfg = read_config_json(where, "target config")
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise BadInput(f"expected a positive int, got {cfg.get(key)!r} ({LOADER} builds the head from it)",
                               path=where, field=key)
        if cfg.get("num_nextn_predict_layers") != 1:
            raise BadInput(f"num_nextn_predict_layers is {cfg.get('num_nextn_predict_layers')!r}: the offline MiMo "
                           "head runs exactly one MTP layer (expected 1)", path=where, field="num_nextn_predict_layers")
        rope = effective_rope(cfg, where)
        if rope["rope_type"] != "default":
            raise BadInput(f"rope type {rope['rope_type']!r}: the offline MiMo head implements default rope only",
                           path=where, field="rope_parameters")
        headers = read_safetensors_index(target_dir)
        p = "model.mtp_layers.0."
        w: dict[str, torch.Tensor] = {}
        for name, want in mimo_mtp_tensor_names(cfg).items():
            if name not in headers:
                raise BadInput(f"no tensor {name} ({LOADER} would leave the parameter uninitialised)",
                               path=target_dir, field=name)
            if tuple(headers[name].shape) != want:
                raise BadInput(f"shape {list(headers[name].shape)}, expected {list(want)} (from config.json)",
                               path=headers[name].file, field=name)
            t = _read_tensor(headers[name].file, name)
            _finite(t, headers[name].file, name)
            short = name[len(p):]
            w[short if short.startswith(HEAD_NAMES) else "layers.0." + short] = t.to(device=device, dtype=dtype)
        H, V = int(cfg["hidden_size"]), int(cfg["vocab_size"])
        hit = find_target_tensor(target_dir, "embed_tokens.weight")
        if hit is None:
            raise BadInput("the target's safetensors hold no model.embed_tokens.weight (vLLM shares it with the MTP "
                           "head: llm_base_proposer.py::_maybe_share_embeddings)", path=target_dir)
        embed = _read_tensor(hit[1], hit[0])
        hh = None if cfg.get("tie_word_embeddings") else find_target_tensor(target_dir, "lm_head.weight")
        lm_head = embed if hh is None else _read_tensor(hh[1], hh[0])
        for name, t in (("embed_tokens.weight", embed), ("lm_head.weight", lm_head)):
            _finite(t, target_dir, name)
            if tuple(t.shape) != (V, H):
                raise BadInput(f"shape {list(t.shape)}, expected [{V}, {H}] (vocab_size, hidden_size)",
                               path=target_dir, field=name)
        sources = {"draft": f"{target_dir} {p}* (MiMo MTP, {LOADER})", "embed": f"target {hit[1].name}:{hit[0]}",
                   "lm_head": "the target's tied embedding" if hh is None else f"target {hh[1].name}:{hh[0]}",
                   "d2t": "none (the target's vocabulary)", "dtype": dtype_reason or str(dtype).removeprefix("torch.")}
        nh = int(cfg["num_attention_heads"])
        arch = DraftArch(hidden=H, target_hidden=H, num_aux=1, heads=nh,
                         kv_heads=int(cfg.get("num_key_value_heads") or nh),
                         head_dim=int(cfg.get("head_dim") or H // nh), intermediate=int(cfg["intermediate_size"]),
                         layers=1, eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]),
                         rope_scaling=None, vocab=V, draft_vocab=V, tie=bool(cfg.get("tie_word_embeddings")),
                         lm_head_from_target=True, norm_before_fc=False, fc_norm=False, norm_output=True,
                         fc_bias=False, max_position=cfg.get("max_position_embeddings"),
                         architecture=LLAMA_CLASS)   # the Llama attention adapter (q/k/v biases read when present)
        return cls(arch, w, embed.to(device=device, dtype=dtype), lm_head.to(device=device, dtype=dtype), None,
                   dtype=dtype, sources=sources)


    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's pre-final-norm states ``[T, H]``, fed to ``hidden_layernorm`` as they are."""
        if aux.shape[-1] != self.arch.hidden:
            raise BadInput(f"the hidden states are {aux.shape[-1]} wide, expected the target's hidden_size "
                           f"{self.arch.hidden} (the MiMo head reads its pre-final-norm state)", field="hidden")
        return aux.to(self.dtype)

    @torch.no_grad()
    def extend_many(self, tokens: torch.Tensor, aux: torch.Tensor, positions: Optional[torch.Tensor] = None
                    ) -> list[ExtendOutput]:
        """:meth:`Eagle3Draft.extend_many` with the embedding of rows at position 0 zeroed, as vLLM's layer does."""
        T = tokens.shape[0]
        pos = torch.arange(T) if positions is None else positions.cpu()
        self._zero_rows = (pos == 0).to(self.device)
        try:
            return super().extend_many(tokens, aux, positions)
        finally:
            self._zero_rows = None

    def _layer_in(self, i: int, embeds: torch.Tensor, h: torch.Tensor, residual: Optional[torch.Tensor]):
        a, w = self.arch, self.w
        e = embeds.to(self.dtype)
        z = self._zero_rows
        if z is not None and bool(z.any()):
            e = e.masked_fill(z.repeat(e.shape[0] // z.shape[0])[:, None], 0.0)
        x = F.linear(torch.cat([_rms(h, w["hidden_layernorm.weight"], a.eps),
                                _rms(e, w["token_layernorm.weight"], a.eps)], dim=-1), w["input_proj.weight"])
        return _rms(x, w["layers.0.input_layernorm.weight"], a.eps), x

    def _finish(self, m: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, _ = _add_rms(m, residual, self.w["final_layernorm.weight"], self.arch.eps)
        return out, F.linear(out, self.lm_head).float()


__all__ = ["MiMoMTPHead", "mimo_mtp_tensor_names"]
