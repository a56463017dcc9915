"""A DeepSeek-V3 / Kimi-class target's NextN (MTP) head run offline as SGLang 0.5.23 serves it with
``--speculative-algorithm NEXTN`` (the draft model is the target folder itself, ``DeepseekV3ForCausalLMNextN``).

The head (``sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward``, the CPU ``torch.cat`` branch; the
CUDA ``fused_eh_norm`` computes the same) for a row with next token ``x_{t+1}`` and the target's hidden state ``h_t``
**after** its final norm (``spec_info.hidden_states``)::

    x   = eh_proj(cat(enorm(embed_tokens(x_{t+1})), hnorm(h_t)))          [2H] -> [H], embedding half first
    y   = decoder(x, position t)       one DeepseekV2DecoderLayer(is_nextn=True): MLA attention + MoE
    out = shared_head.norm(y + residual)                                   the hidden state carried on
    logits = out @ lm_head^T                                               the target's lm_head

``embed_tokens`` and the lm_head are the target's (``eagle_worker_v2.py::EagleDraftWorker.init_lm_head`` ->
``deepseek_v2.py::DeepseekV3ForCausalLM.set_embed_and_head``); the checkpoint's ``model.layers.{N}.embed_tokens`` /
``shared_head.head`` copies are not read. The head's own tensors are the extra layer ``model.layers.{N}.*`` with
``N = num_hidden_layers`` (``deepseek_common/deepseek_weight_loader.py::do_load_weights`` with ``is_nextn=True`` maps
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm`` to ``model.*`` and the rest to ``model.decoder.*``).

:class:`NextNHead` is an :class:`helpers.draft.model.Eagle3Draft` whose layer is this one: the draft-extend pass,
the draft decode step with its KV, the teacher-forced unroll and so the drafting replay of
:mod:`helpers.draft.simulate` (chains and topk trees, greedy verification) are the EAGLE-3 draft's, unchanged. SGLang
drafts NEXTN through the same EAGLE worker (``speculative/spec_registry.py``: ``NEXTN`` is a reserved alias of
``EAGLE``): step j feeds the hidden state step j-1 returned (``logits_output.hidden_states``, here ``out``) and step
j-1's top token (``eagle_worker_v2.py::EagleDraftWorker.draft_forward``: ``topk_index`` for topk 1, else
``spec_utils.py::select_top_k_tokens``), the one head reused at every step. The sequences'
``aux`` rows (:class:`helpers.draft.simulate.SimSequence`) are then the target's post-final-norm hidden states.

The attention is :class:`helpers.draft.attention.MLAAttention` (weight-absorbed MLA, as SGLang's draft batches run);
the MoE is transformers' ``DeepseekV3MoE`` (sigmoid gate with the correction bias, grouped top-k, routed scaling,
shared experts), the target's own class.
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from ..errors import BadInput
from ..formats.configs import read_safetensors_index, read_target_config
from ..layers.mtp import deepseek_nextn_shapes, sglang_nextn_layer
from .attention import MLAAttention, _rms
from .model import DraftArch, Eagle3Draft, _add_rms, _finite, _read_tensor, find_target_tensor
from .params import MLA_CLASS

LOADER = "sglang/srt/models/deepseek_common/deepseek_weight_loader.py::do_load_weights"
ATTN_NAMES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")
HEAD_NAMES = ("enorm", "hnorm", "eh_proj", "shared_head.norm")


def nextn_layer_id(cfg: dict) -> int:
    """The checkpoint layer SGLang reads the NextN head from: ``num_hidden_layers``, or 0 for a separate NextN
    checkpoint with ``num_hidden_layers`` 1 (``deepseek_weight_loader.py::_initialize_nextn_conf``, "compatible with
    old design"; :func:`helpers.formats.nextn.export_nextn` writes such a folder)."""
    return sglang_nextn_layer(int(cfg["num_hidden_layers"]))


def nextn_tensor_names(cfg: dict) -> dict[str, tuple[int, ...]]:
    """The ``model.layers.{L}.*`` names (L = :func:`nextn_layer_id`) SGLang's NextN loader fills for a DeepSeek-V3
    config ``cfg`` (config.json dict), with the shape the config implies: :func:`helpers.layers.mtp.
    deepseek_nextn_shapes` (``embed_tokens`` and ``shared_head.head`` left out: the target's are shared)."""
    return deepseek_nextn_shapes(cfg)


class NextNHead(Eagle3Draft):
    """The NextN head of a target folder (see the module docstring), run in pure torch in ``dtype``.

    ``extend(tokens [T], hidden [T, H], positions)`` is the draft-extend pass after the target's prefill / verify
    (row t: token ``x_{t+1}`` with the target's post-norm state at t, causal attention over rows 0..t): returns
    :class:`helpers.draft.model.ExtendOutput` with ``logits [T, V]`` float32 and ``hidden [T, H]`` (``out`` above,
    the next step's ``h``). ``step(tokens [B], hidden [B, H], positions [B], ctx_len [B], ext, path_kv)`` is one draft
    decode step (attending to extend rows ``0..ctx_len-1``, its ancestors and itself) -> ``(hidden [B, H],
    logits [B, V] float32, its cache entries)``. Both inherited from :class:`Eagle3Draft`.
    """

    WHOLE_VOCAB = "a NextN head"

    def __init__(self, arch: DraftArch, weights: dict, embed: torch.Tensor, lm_head: torch.Tensor, moe, *,
                 dtype: torch.dtype, sources: dict):
        super().__init__(arch, weights, embed, lm_head, None, dtype=dtype, sources=sources)
        self.moe = moe

    @classmethod
    def load(cls, target_dir: str | Path, *, draft_dir: Optional[str | Path] = None, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu", dtype_reason: str = "") -> "NextNHead":
        """The NextN head of ``target_dir`` (config.json + safetensors, one file or an index), as SGLang's NEXTN draft
        worker loads it: ``model.layers.{num_hidden_layers}.*`` by ``deepseek_weight_loader.py::do_load_weights``
        (``is_nextn=True``), the target's ``model.embed_tokens`` and ``lm_head`` shared (``set_embed_and_head``).
        Only these tensors are read, never the whole target. ``draft_dir``: a separate NextN checkpoint
        (``--speculative-draft-model-path``; ``model.layers.0.*`` when its ``num_hidden_layers`` is 1:
        :func:`nextn_layer_id`) to read the head from instead; the embedding and lm_head stay the target's.

        Raises:
            BadInput: not a DeepSeek-V3 MLA + MoE config, ``num_nextn_predict_layers`` is not 1, a head tensor is
                missing (the weights file and the key are named), its shape does not match the config, a weight is
                NaN / Inf or not a plain float, or the target has no embedding / lm_head.
        """
        from transformers import DeepseekV3Config  # lazy: transformers is slow to import; only a NextN head needs it
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE  # lazy: as above

        target_dir = Path(target_dir)
        head_dir = target_dir if draft_dir is None else Path(draft_dir)
        cfg = read_target_config(head_dir).raw
        where = head_dir / "config.json"
        for key in ("num_hidden_layers", "hidden_size", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_attention_heads", "vocab_size"):
            if not cfg.get(key):
                raise BadInput(f"missing or null: the NextN head is a DeepSeek-V3 MLA + MoE layer and needs it "
                               f"(sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN)", path=where, field=key)
        if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
            raise BadInput(f"scoring_func {cfg.get('scoring_func')!r}, topk_method {cfg.get('topk_method')!r}: the "
                           "offline NextN head runs DeepSeek-V3's router only (sigmoid scores, the correction bias, "
                           "noaux_tc grouped top-k)", path=where, field="scoring_func")
        if int(cfg.get("num_nextn_predict_layers") or 0) != 1:
            raise BadInput(f"num_nextn_predict_layers is {cfg.get('num_nextn_predict_layers')!r}: SGLang's NEXTN draft "
                           f"loads exactly one NextN layer (expected 1)", path=where, field="num_nextn_predict_layers")
        headers = read_safetensors_index(head_dir)
        index = {k: v.file for k, v in headers.items()}
        index_shapes = {k: v.shape for k, v in headers.items()}
        weights_file = (head_dir / "model.safetensors.index.json") if (
            head_dir / "model.safetensors.index.json").is_file() else next(
            iter(sorted(head_dir.glob("*.safetensors"))), head_dir / "model.safetensors")
        N = nextn_layer_id(cfg)
        p = f"model.layers.{N}."
        raw: dict[str, torch.Tensor] = {}
        for name, want in nextn_tensor_names(cfg).items():
            if name not in index:
                raise BadInput(f"no tensor {name}: the checkpoint has no trained NextN layer {N} ({LOADER} would leave "
                               "the parameter uninitialised)", path=weights_file, field=name)
            if tuple(index_shapes[name]) != want:
                raise BadInput(f"shape {list(index_shapes[name])}, expected {list(want)} (from {where.name}: "
                               "hidden_size, num_attention_heads, the MLA ranks and head dims, n_routed_experts, "
                               "moe_intermediate_size)", path=index[name], field=name)
            t = _read_tensor(index[name], name)
            _finite(t, index[name], name)
            raw[name[len(p):]] = t
        H = int(cfg["hidden_size"])
        sources: dict = {"draft": f"{head_dir} {p}* (NextN)",
                         "dtype": dtype_reason or str(dtype).removeprefix("torch.")}
        hit = find_target_tensor(target_dir, "embed_tokens.weight")
        if hit is None:
            raise BadInput("the target's safetensors hold no model.embed_tokens.weight (the NextN head shares it: "
                           "deepseek_v2.py::DeepseekV3ForCausalLM.set_embed_and_head)", path=target_dir)
        embed = _read_tensor(hit[1], hit[0])
        sources["embed"] = f"target {hit[1].name}:{hit[0]}"
        tied = read_target_config(target_dir).raw.get("tie_word_embeddings")
        hh = None if tied else find_target_tensor(target_dir, "lm_head.weight")
        lm_head = embed if hh is None else _read_tensor(hh[1], hh[0])
        for (name, f), t in (((hit[0], hit[1]), embed), ((hh or hit)[:2], lm_head)):
            _finite(t, f, name)
            if tuple(t.shape) != (int(cfg["vocab_size"]), H):
                raise BadInput(f"shape {list(t.shape)}, expected [{cfg['vocab_size']}, {H}] (the head's vocab_size, "
                               "hidden_size: set_embed_and_head shares it as is)", path=f, field=name)
        sources["lm_head"] = "the target's tied embedding" if hh is None else f"target {hh[1].name}:{hh[0]}"
        sources["d2t"] = "none (the target's vocabulary)"
        # the attention adapter reads the MLA shape and rope as SGLang's DeepseekV2AttentionMLA builds them
        heads = int(cfg["num_attention_heads"])
        shape = SimpleNamespace(heads=heads, kv_heads=1, head_dim=cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
                                q_lora=cfg["q_lora_rank"], kv_lora=cfg["kv_lora_rank"], qk_nope=cfg["qk_nope_head_dim"],
                                qk_rope=cfg["qk_rope_head_dim"], v_head=cfg["v_head_dim"])
        att = MLAAttention.read_config(SimpleNamespace(raw=cfg, path=where), shape)
        arch = DraftArch(hidden=H, target_hidden=H, num_aux=1, heads=att["heads"], kv_heads=att["kv_heads"],
                         head_dim=att["head_dim"], intermediate=int(cfg.get("moe_intermediate_size") or 0) * (
                             int(cfg.get("num_experts_per_tok") or 1) + int(cfg.get("n_shared_experts") or 0)),
                         layers=1, eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=att["rope_theta"],
                         rope_scaling=att["rope_scaling"], vocab=int(cfg["vocab_size"]),
                         draft_vocab=int(cfg["vocab_size"]), tie=bool(cfg.get("tie_word_embeddings")),
                         lm_head_from_target=True, norm_before_fc=False, fc_norm=False, norm_output=True,
                         fc_bias=False, max_position=att["max_position"], architecture=MLA_CLASS,
                         mla=att["mla"])
        w = {("layers.0." + k if not k.startswith(HEAD_NAMES) else k): v.to(device=device, dtype=dtype)
             for k, v in raw.items() if ".experts." not in k and not k.startswith("mlp.")}
        hf = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "auto_map")})
        hf._experts_implementation = "eager"
        moe = DeepseekV3MoE(hf)
        E = int(cfg["n_routed_experts"])
        sd = {"gate.weight": raw["mlp.gate.weight"],
              "gate.e_score_correction_bias": raw.get("mlp.gate.e_score_correction_bias",
                                                      torch.zeros(E, dtype=torch.float32)),
              "experts.gate_up_proj": torch.stack([torch.cat([raw[f"mlp.experts.{e}.gate_proj.weight"],
                                                              raw[f"mlp.experts.{e}.up_proj.weight"]]) for e in range(E)]),
              "experts.down_proj": torch.stack([raw[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)])}
        for n in ("gate", "up", "down"):
            if f"mlp.shared_experts.{n}_proj.weight" in raw:
                sd[f"shared_experts.{n}_proj.weight"] = raw[f"mlp.shared_experts.{n}_proj.weight"]
        moe.load_state_dict({k: v.float() for k, v in sd.items()}, strict=bool(cfg.get("n_shared_experts")))
        moe = moe.to(device=device, dtype=dtype).eval()
        moe.gate.e_score_correction_bias.data = sd["gate.e_score_correction_bias"].float().to(device)
        return cls(arch, w, embed.to(device=device, dtype=dtype), lm_head.to(device=device, dtype=dtype), moe,
                   dtype=dtype, sources=sources)


    # ---- the layer (DeepseekModelNextN.forward; DeepseekV2DecoderLayer.forward with its residual) ----------------
    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's post-final-norm hidden states ``[T, H]``, fed to ``hnorm`` as they are."""
        if aux.shape[-1] != self.arch.hidden:
            raise BadInput(f"the hidden states are {aux.shape[-1]} wide, expected the target's hidden_size "
                           f"{self.arch.hidden} (the NextN head reads its post-final-norm state)", field="hidden")
        return aux.to(self.dtype)

    def _layer_in(self, i: int, embeds: torch.Tensor, h: torch.Tensor, residual: Optional[torch.Tensor]):
        a, w = self.arch, self.w
        x = F.linear(torch.cat([_rms(embeds, w["enorm.weight"], a.eps), _rms(h, w["hnorm.weight"], a.eps)], dim=-1),
                     w["eh_proj.weight"])
        return _rms(x, w["layers.0.input_layernorm.weight"], a.eps), x

    def _layer_out(self, i: int, attn: torch.Tensor, residual: torch.Tensor):
        w = self.w
        o = F.linear(attn, w["layers.0.self_attn.o_proj.weight"])
        y, residual = _add_rms(o, residual, w["layers.0.post_attention_layernorm.weight"], self.arch.eps)
        return self.moe(y[None])[0].to(y.dtype), residual

    def _finish(self, m: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed, _ = _add_rms(m, residual, self.w["shared_head.norm.weight"], self.arch.eps)
        return normed, F.linear(normed, self.lm_head).float()
