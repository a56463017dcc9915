"""EAGLE-3 draft with DeepSeek multi-latent attention (SGLang ``Eagle3DeepseekV2ForCausalLM``).

Mirrors sglang 0.5.23 ``srt/models/kimi_k25_eagle3.py`` (the ``kimi-k2.5-eagle3-mla`` layout) and the
MLA it reuses from ``srt/models/deepseek_v2.py``; no trainer for it exists upstream (SpecForge and HF
have none), so this module is trained with the same TTT loop as the Llama-style draft
(``e3f_models.draft.ttt_loss``). Every tensor, with the SGLang code that defines or reads it
(checkpoint names as ``kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM.load_weights`` reads them;
it maps ``layers.0.X`` to ``model.midlayer.X`` and prefixes everything but ``lm_head`` with
``model.``):

======================================================  ==========================  =============================================================
checkpoint name (module name)                           shape (H hidden, n aux)     SGLang
======================================================  ==========================  =============================================================
``fc.weight`` (``fc.weight``)                           ``[H, n*H_t]``              ``Eagle3MLAModel.__init__`` (``ColumnParallelLinear``), applied
                                                                                    in ``Eagle3MLAModel.forward`` when the incoming hidden is wider
                                                                                    than the embedding (the target's concatenated aux states)
``fc_norm.{i}.weight`` (optional, config ``fc_norm``)   ``[H_t]``                   ``Eagle3MLAModel.__init__`` / ``forward``: RMSNorm of each aux
                                                                                    chunk before ``fc`` (eagle3.1); ``norm_before_fc`` is not read
``layers.0.input_layernorm.weight``                     ``[H]``                     ``Eagle3MLADecoderLayer.forward``: ``input_layernorm(embeds)``
``layers.0.hidden_norm.weight``                         ``[H]``                     ``Eagle3MLADecoderLayer.forward``: ``hidden_norm(hidden)``;
                                                                                    attention input = ``cat([embeds, hidden], -1)`` (2H wide)
``layers.0.self_attn.q_a_proj.weight``                  ``[q_lora, 2H]``            ``Eagle3MLADecoderLayer.__init__`` replaces
``layers.0.self_attn.kv_a_proj_with_mqa.weight``        ``[kv_lora + rope, 2H]``    ``fused_qkv_a_proj_with_mqa`` by a 2H-input ``ReplicatedLinear``;
                                                                                    ``load_weights`` concatenates the two (q first) into it
``layers.0.self_attn.q_a_layernorm.weight``             ``[q_lora]``                ``deepseek_v2.py::DeepseekV2AttentionMLA.__init__``
``layers.0.self_attn.q_b_proj.weight``                  ``[heads*(nope+rope), q_lora]``  same; q = q_b_proj(q_a_layernorm(q_a)) split [nope, rope]
``layers.0.self_attn.kv_a_layernorm.weight``            ``[kv_lora]``               same; normalises the latent ``kv_a = fused[q_lora:q_lora+kv_lora]``
``layers.0.self_attn.kv_b_proj.weight``                 ``[heads*(nope+v), kv_lora]``    same; ``Eagle3DeepseekV2ForCausalLM.post_load_weights``
                                                                                    splits it per head into ``w_kc`` ``[heads, nope, kv_lora]`` and
                                                                                    ``w_vc`` ``[heads, kv_lora, v]`` for the absorbed MLA
``layers.0.self_attn.o_proj.weight``                    ``[H, heads*v]``            same (``RowParallelLinear``)
``layers.0.post_attention_layernorm.weight``            ``[H]``                     ``Eagle3MLADecoderLayer.forward`` (fused add: residual = h + attn)
``layers.0.mlp.{gate,up}_proj.weight``                  ``[I, H]``                  ``deepseek_v2.py::DeepseekV2MLP`` (stacked into ``gate_up_proj``
``layers.0.mlp.down_proj.weight``                       ``[H, I]``                  by ``load_weights``), SiLU
``norm.weight``                                         ``[H]``                     ``Eagle3MLAModel.forward``: ``norm(h, residual)``; logits from the
                                                                                    normed state, the pre-norm sum is the next step's hidden
                                                                                    (``norm_output`` false, the default)
``lm_head.weight``                                      ``[V_draft, H]``            ``Eagle3DeepseekV2ForCausalLM.__init__`` (``ParallelLMHead`` over
                                                                                    ``draft_vocab_size``; ``tie_word_embeddings`` must be false)
``d2t`` int64                                           ``[V_draft]``               ``load_weights``: ``hot_token_id = d2t + arange``
``t2d`` bool                                            ``[V]``                     ``load_weights`` skips it (SpecForge writes it; the trainer uses it)
(no ``embed_tokens``)                                                               ``set_embed`` shares the target's embedding
======================================================  ==========================  =============================================================

Attention (``MLAMidLayer.forward``), with ``x = cat(input_layernorm(e), hidden_norm(h))``:
``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` -> ``[q_nope, q_pe]`` per head;
``[kv_a, k_pe] = kv_a_proj_with_mqa(x)``, ``kv_a = kv_a_layernorm(kv_a)`` (the cached latent);
``q_pe, k_pe`` rotated by interleaved (GPT-J) RoPE with DeepSeek-yarn frequencies
(``rotary_embedding/rope_variant.py::DeepseekScalingRotaryEmbedding``; ``rope_interleave`` true:
``deepseek_v2.py::DeepseekV2AttentionMLA.__init__`` builds it with ``is_neox_style = not
rope_interleave``; on CPU ``forward_cpu`` hard-codes interleaved); ``k_pe`` is shared by all heads;
``[k_nope, v] = kv_b_proj(kv_a)``; scores ``(q_nope . k_nope + q_pe . k_pe) * scaling`` with
``scaling = (nope + rope) ** -0.5 * mscale**2`` (``configs/model_config.py::
compute_mla_mscale_scaling``), softmax, ``o_proj``. This is the expanded form SGLang's MHA prefill
uses (``models/deepseek_common/attention_forward_methods/forward_mha.py``); decode, verify and
draft-extend use the weight-absorbed form (``forward_mla.py``: ``q_nope @ w_kc`` against the latent,
``(attn @ latent) @ w_vc``), the same function up to rounding (``absorbed_attention`` computes it
for the check in the tests).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .draft import Eagle3Draft, RMSNorm, ttt_attend


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """sglang/srt/layers/rotary_embedding/yarn.py::yarn_get_mscale."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rope: dict, rotary_dim: int, max_position: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim // 2] fp32, cos/sin multiplier)`` of DeepSeek-yarn RoPE.

    Mirrors ``rope_variant.py::DeepseekScalingRotaryEmbedding._compute_inv_freq`` and its
    ``mscale`` (``factory.py::get_rope_cpu`` passes ``original_max_position_embeddings``, default the
    model's ``max_position_embeddings``, and the ``beta_*`` / ``mscale*`` / ``attn_factor`` keys).
    With ``factor`` 1 the frequencies are plain RoPE's and the multiplier is 1.
    """
    base = float(rope.get("rope_theta", 10000.0))
    factor = float(rope.get("factor", 1.0))
    orig = int(rope.get("original_max_position_embeddings", max_position))
    beta_fast, beta_slow = rope.get("beta_fast", 32), rope.get("beta_slow", 1)
    extrapolation = float(rope.get("extrapolation_factor", 1.0))
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)

    def corr_dim(rot):
        return (rotary_dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr_dim(beta_fast)), 0)
    high = min(math.ceil(corr_dim(beta_slow)), rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mask = (1 - ramp) * extrapolation
    inv = inv_inter * (1 - mask) + inv_extra * mask
    mscale = (yarn_get_mscale(factor, float(rope.get("mscale", 1)))
              / yarn_get_mscale(factor, float(rope.get("mscale_all_dim", 0)))
              * float(rope.get("attn_factor", 1)))
    return inv, float(mscale)


def mla_softmax_scale(cfg: dict) -> float:
    """``(nope + rope) ** -0.5``, times ``yarn_get_mscale(factor, mscale_all_dim) ** 2`` for
    non-default rope (``configs/model_config.py::compute_mla_mscale_scaling``)."""
    scale = (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]) ** -0.5
    rope = cfg.get("rope_parameters") or {}
    if rope.get("rope_type", "default") == "default":
        return scale
    if not rope.get("apply_yarn_scaling", True) or not rope.get("apply_scale", True):
        return scale
    m = yarn_get_mscale(float(rope.get("factor", 1.0)), float(rope.get("mscale_all_dim", 0) or 0))
    return scale * m * m


def rope_gptj(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, mscale: float):
    """Interleaved RoPE of ``x [B, T, heads, r]`` at positions ``pos [T]``: pairs
    ``(x[2i], x[2i+1])`` rotate by ``pos * inv_freq[i]`` (``rope_variant.py::
    DeepseekScalingRotaryEmbedding.forward_native`` with ``rotate_gptj``)."""
    ang = pos.to(torch.float32)[:, None] * inv_freq.to(x.device)[None, :]  # [T, r/2]
    cos = (ang.cos() * mscale).repeat_interleave(2, dim=-1)[None, :, None, :].to(x.dtype)
    sin = (ang.sin() * mscale).repeat_interleave(2, dim=-1)[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    rot = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return x * cos + rot * sin


class MLAMidLayer(nn.Module):
    """The single EAGLE-3 decoder layer with MLA (``kimi_k25_eagle3.py::Eagle3MLADecoderLayer``),
    same call signature as ``draft.MidLayer`` so ``ttt_loss`` drives either."""

    def __init__(self, cfg: dict):
        super().__init__()
        if cfg.get("q_lora_rank") is None:
            raise ValueError("draft config.json: q_lora_rank is required for the MLA draft "
                             "(kimi_k25_eagle3.py::Eagle3MLADecoderLayer raises without it)")
        h, nh, eps = cfg["hidden_size"], cfg["num_attention_heads"], cfg["rms_norm_eps"]
        self.nh = nh
        self.nope, self.rope, self.vd = (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                         cfg["v_head_dim"])
        self.q_lora, self.kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
        self.scaling = mla_softmax_scale(cfg)
        inv, self.rope_mscale = yarn_inv_freq(cfg.get("rope_parameters") or {}, self.rope,
                                              cfg["max_position_embeddings"])
        self.register_buffer("inv_freq", inv, persistent=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        attn = nn.Module()
        attn.q_a_proj = nn.Linear(2 * h, self.q_lora, bias=False)
        attn.q_a_layernorm = RMSNorm(self.q_lora, eps)
        attn.q_b_proj = nn.Linear(self.q_lora, nh * (self.nope + self.rope), bias=False)
        attn.kv_a_proj_with_mqa = nn.Linear(2 * h, self.kv_lora + self.rope, bias=False)
        attn.kv_a_layernorm = RMSNorm(self.kv_lora, eps)
        attn.kv_b_proj = nn.Linear(self.kv_lora, nh * (self.nope + self.vd), bias=False)
        attn.o_proj = nn.Linear(nh * self.vd, h, bias=False)
        self.self_attn = attn
        mlp = nn.Module()
        inter = cfg["intermediate_size"]
        mlp.gate_proj = nn.Linear(h, inter, bias=False)
        mlp.up_proj = nn.Linear(h, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, h, bias=False)
        self.mlp = mlp

    def qkv_latent(self, x: torch.Tensor, pos: torch.Tensor):
        """``x [B, T, 2H]`` -> ``(q_nope [B,T,nh,nope], q_pe [B,T,nh,r] roped, kv_a [B,T,kv_lora]
        normed latent, k_pe [B,T,1,r] roped)``."""
        B, T, _ = x.shape
        a = self.self_attn
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))).view(B, T, self.nh, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_a, k_pe = a.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope], dim=-1)
        kv_a = a.kv_a_layernorm(kv_a)
        q_pe = rope_gptj(q_pe, pos, self.inv_freq, self.rope_mscale)
        k_pe = rope_gptj(k_pe[:, :, None, :], pos, self.inv_freq, self.rope_mscale)
        return q_nope, q_pe, kv_a, k_pe

    def forward(self, embeds, hidden, cache: list, pos, causal_bias):
        """One TTT step (see ``draft.MidLayer.forward``); returns the pre-norm output [B, T, H]."""
        B, T, _ = hidden.shape
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        q_nope, q_pe, kv_a, k_pe = self.qkv_latent(x, pos)
        a = self.self_attn
        k_nope, v = a.kv_b_proj(kv_a).view(B, T, self.nh, self.nope + self.vd).split(
            [self.nope, self.vd], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)  # [B, nh, T, nope + r]
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.nh, -1)], dim=-1).transpose(1, 2)
        out = ttt_attend(q, k, v.transpose(1, 2), cache, self.scaling, causal_bias)
        out = out.transpose(1, 2).reshape(B, T, self.nh * self.vd)
        h = residual + a.o_proj(out)
        m = self.mlp
        y = self.post_attention_layernorm(h)
        return h + m.down_proj(F.silu(m.gate_proj(y)) * m.up_proj(y))

    def absorbed_weights(self):
        """``(w_kc [nh, nope, kv_lora], w_vc [nh, kv_lora, v])`` as
        ``kimi_k25_eagle3.py::Eagle3DeepseekV2ForCausalLM.post_load_weights`` splits
        ``kv_b_proj`` (``w.unflatten(0, (-1, nope + v)).split([nope, v], 1)``, w_vc transposed)."""
        w = self.self_attn.kv_b_proj.weight
        w_kc, w_vc = w.unflatten(0, (-1, self.nope + self.vd)).split([self.nope, self.vd], dim=1)
        return w_kc, w_vc.transpose(1, 2)

    def absorbed_attention(self, x: torch.Tensor, pos: torch.Tensor, causal_bias) -> torch.Tensor:
        """Plain causal MLA of ``x [B, T, 2H]`` in SGLang's weight-absorbed form (``forward_mla.py``:
        ``q_nope_out = bmm(q_nope, w_kc)``, MQA over the cached ``[kv_a, k_pe]`` with the latent as
        value, then ``bmm(., w_vc)``), before ``o_proj``: ``[B, T, nh * v]``. For checks only."""
        B, T, _ = x.shape
        q_nope, q_pe, kv_a, k_pe = self.qkv_latent(x, pos)
        w_kc, w_vc = self.absorbed_weights()
        q_lat = torch.einsum("bthn,hnc->bthc", q_nope, w_kc)  # [B, T, nh, kv_lora]
        qf = torch.cat([q_lat, q_pe], dim=-1).transpose(1, 2)  # [B, nh, T, kv_lora + r]
        kf = torch.cat([kv_a, k_pe[:, :, 0]], dim=-1)[:, None]  # [B, 1, T, kv_lora + r]
        s = torch.matmul(qf, kf.transpose(-1, -2)) * self.scaling + causal_bias
        lat = torch.matmul(torch.softmax(s.float(), dim=-1).to(x.dtype), kv_a[:, None])
        out = torch.einsum("bhtc,hcv->bthv", lat, w_vc)
        return out.reshape(B, T, self.nh * self.vd)


class Eagle3MLADraft(Eagle3Draft):
    """EAGLE-3 MLA draft (``Eagle3DeepseekV2ForCausalLM``): ``Eagle3Draft`` with ``MLAMidLayer``,
    optional per-chunk ``fc_norm``, and checkpoint names ``layers.0.*`` for the decoder layer."""

    midlayer_cls = MLAMidLayer
    architecture = "Eagle3DeepseekV2ForCausalLM"

    def __init__(self, cfg: dict, embed_weight: torch.Tensor, d2t: torch.Tensor,
                 t2d: torch.Tensor):
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("draft config.json: num_hidden_layers must be 1 "
                             "(kimi_k25_eagle3.py::Eagle3MLAModel: 'EAGLE3 currently only "
                             "supports 1 layer')")
        if cfg.get("norm_before_fc"):
            raise ValueError("draft config.json: norm_before_fc is not read by "
                             "kimi_k25_eagle3.py (use fc_norm)")
        super().__init__(cfg, embed_weight, d2t, t2d)
        th = cfg.get("target_hidden_size") or cfg["hidden_size"]
        self.fc_norm = (nn.ModuleList([RMSNorm(th, cfg["rms_norm_eps"])
                                       for _ in range(self.n_aux)])
                        if (cfg.get("fc_norm") or cfg.get("use_aux_norm")) else None)

    def aux_to_hidden(self, aux: torch.Tensor) -> torch.Tensor:
        """``fc`` over the aux chunks, each RMS-normed first when ``fc_norm``
        (``Eagle3MLAModel.forward``)."""
        if self.fc_norm is not None:
            chunks = aux.chunk(self.n_aux, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """``midlayer.X`` -> ``layers.0.X`` (the Kimi MLA checkpoint layout that
        ``load_weights`` maps back to ``model.midlayer.X``); other names unchanged."""
        return "layers.0." + name[len("midlayer."):] if name.startswith("midlayer.") else name


# Target config keys an MLA draft copies (its attention, RoPE and the MoE layout it does not use,
# so a parser that fills DeepseekV3Config defaults sees the target's numbers, not 256 experts).
_MLA_TARGET_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
                    "rope_interleave", "attention_bias", "moe_intermediate_size",
                    "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                    "first_k_dense_replace", "moe_layer_freq", "n_group", "topk_group",
                    "topk_method", "scoring_func", "routed_scaling_factor", "norm_topk_prob",
                    "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")


def mla_draft_config(target_cfg: dict, draft_vocab: int, layer_ids: list[int],
                     fc_norm: bool = False) -> dict:
    """config.json of the MLA draft (``Eagle3DeepseekV2ForCausalLM``, ``model_type``
    ``deepseek_v3`` as the Kimi MLA drafts ship) for an MLA target's config.json dict.

    The target's MLA dims, yarn ``rope_parameters`` (factory.py::get_rope_cpu needs yarn on CPU)
    and dense ``intermediate_size``; ``num_hidden_layers`` 1 (Eagle3MLAModel requires it);
    ``num_nextn_predict_layers`` 1 (model_runner_components/spec_aux_hidden_state.py sizes the
    draft KV pool from it for a deepseek_v3 draft; 0 would give a 0-layer pool);
    ``tie_word_embeddings`` false (else Eagle3DeepseekV2ForCausalLM uses the embedding as
    lm_head); ``draft_vocab_size``; the nested ``eagle_config`` ids (SpecForge out(i)); ``fc_norm``
    only when asked (eagle3.1). Raises ValueError when the target has no ``q_lora_rank`` /
    ``kv_lora_rank``.
    """
    missing = [k for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                           "v_head_dim") if target_cfg.get(k) is None]
    if missing:
        raise ValueError(f"target config.json: {missing} missing; the MLA draft takes its "
                         f"attention dims from an MLA (DeepSeek / Kimi) target")
    cfg = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v3"}
    cfg.update({k: target_cfg[k] for k in _MLA_TARGET_KEYS if k in target_cfg})
    cfg.update({
        "num_hidden_layers": 1,
        "num_key_value_heads": target_cfg["num_attention_heads"],
        "num_nextn_predict_layers": 1,
        "draft_vocab_size": int(draft_vocab),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids),
                         "use_aux_hidden_state": True},
    })
    if fc_norm:
        cfg["fc_norm"] = True
    return cfg
