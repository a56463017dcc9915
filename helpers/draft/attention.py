"""The attention of each EAGLE-3 draft architecture SGLang 0.5.23 serves, as one adapter behind one seam
(:class:`Attention`), for the offline draft run (:class:`helpers.draft.model.Eagle3Draft`): ``LlamaForCausalLMEagle3``
(:class:`LlamaAttention`: ``sglang/srt/models/llama.py::LlamaAttention``) and ``Eagle3DeepseekV2ForCausalLM``
(:class:`MLAAttention`: ``sglang/srt/models/kimi_k25_eagle3.py::Eagle3MLADecoderLayer`` with
``sglang/srt/models/deepseek_v2.py::DeepseekV2AttentionMLA``, run weight-absorbed as SGLang runs every draft batch).
:data:`ATTENTIONS` maps a draft config's ``architectures[0]`` to its adapter; the rest of the draft run is shared.

The ``DraftArch`` the adapters read is :class:`helpers.draft.model.DraftArch` (duck-typed here: this module is
imported by it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..errors import BadInput
from ..formats.configs import DraftConfig
from .config_checks import effective_rope
from .params import CONFIG_DEFAULTS, K25, L3, LLAMA_CLASS, MLA_CLASS, SGLangDraftParams


@dataclass
class MLAShape:
    """The MLA draft's attention as SGLang 0.5.23 builds it (``kimi_k25_eagle3.py::Eagle3MLADecoderLayer.__init__``
    -> ``deepseek_v2.py::DeepseekV2AttentionMLA.__init__``).

    Attributes:
        q_lora / kv_lora: ``q_lora_rank`` / ``kv_lora_rank`` (the cached latent's width).
        nope / rope / v: ``qk_nope_head_dim`` / ``qk_rope_head_dim`` / ``v_head_dim``.
        interleave: the rotary embedding pairs (x[2i], x[2i+1]) (``rope_interleave``, default true: ``is_neox_style =
            not rope_interleave``), else neox halves.
        yarn: None (``rope_type`` default: plain rope) or the DeepSeek-yarn parameters every other rope type becomes
            (``DeepseekV2AttentionMLA.__init__`` sets ``rope_scaling["rope_type"] = "deepseek_yarn"``;
            ``rotary_embedding/factory.py::get_rope`` -> ``DeepseekScalingRotaryEmbedding``): ``factor``,
            ``original_max_position`` (``original_max_position_embeddings``, default ``max_position_embeddings``),
            ``beta_fast``, ``beta_slow``, ``mscale``, ``mscale_all_dim``, ``extrapolation_factor``, ``attn_factor``.
        scaling: the softmax scale, ``(nope + rope) ** -0.5`` times ``yarn_get_mscale(factor, mscale_all_dim) ** 2``
            for yarn unless ``apply_yarn_scaling`` / ``apply_scale`` is false (``configs/model_config.py::
            compute_mla_mscale_scaling``).
    """

    q_lora: int
    kv_lora: int
    nope: int
    rope: int
    v: int
    interleave: bool
    yarn: Optional[dict]
    scaling: float



def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """SGLang ``RMSNorm.forward_native``: fp32 statistics and weight product, result in the input dtype (one fused
    ``F.rms_norm``)."""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)



def _inv_freq(arch: Any) -> torch.Tensor:
    """Rotary inverse frequencies (``sglang/srt/layers/rotary_embedding.py``: ``RotaryEmbedding``,
    ``LinearScalingRotaryEmbedding`` is applied to positions, ``Llama3RotaryEmbedding._compute_inv_freq``; missing
    keys default as ``rotary_embedding/factory.py::get_rope`` defaults them: factor 1, low 1, high 4, original max
    position = ``max_position_embeddings``, 8192 when unset, as ``models/llama.py::LlamaDecoderLayer``)."""
    hd = arch.head_dim
    inv = 1.0 / (arch.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    rs = arch.rope_scaling or {}
    kind = str(rs.get("rope_type") or rs.get("type") or "default")
    if kind == "llama3":
        # rotary_embedding/factory.py::_get_rope_param: a missing key takes SGLang's default (with a warning there)
        factor = float(rs.get("factor", 1.0))
        low, high = float(rs.get("low_freq_factor", 1.0)), float(rs.get("high_freq_factor", 4.0))
        old = float(rs.get("original_max_position_embeddings", arch.max_position or 8192))
        low_wl, high_wl = old / low, old / high
        wl = 2 * math.pi / inv
        smooth = (old / wl - low) / (high - low)
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        mid = (1 - smooth) * inv / factor + smooth * inv
        is_mid = (wl <= low_wl) & (wl >= high_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv.float()


def _rope_scale(arch: Any) -> float:
    rs = arch.rope_scaling or {}
    kind = str(rs.get("rope_type") or rs.get("type") or "default")
    return float(rs.get("factor", 1.0)) if kind == "linear" else 1.0


def _number(sc: dict, key: str, default: float, dc: DraftConfig, where: str) -> float:
    v = sc.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadInput(f"expected a number, got {v!r}", path=dc.path, field=f"{where}.{key}")
    return float(v)


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    """``sglang/srt/layers/rotary_embedding/yarn.py::yarn_get_mscale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_inv_freq(m: MLAShape, rope_theta: float) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rope // 2] float32, cos/sin multiplier)`` of the MLA draft's rotary embedding, computed in float32
    as SGLang computes it: plain (``rotary_embedding/base.py::RotaryEmbedding._compute_inv_freq``, multiplier 1) or
    DeepSeek-yarn (``rope_variant.py::DeepseekScalingRotaryEmbedding._compute_inv_freq`` and its ``mscale``;
    ``yarn.py::yarn_find_correction_range`` / ``yarn_linear_ramp_mask``)."""
    rd = m.rope
    pos_freqs = rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd)
    if m.yarn is None:
        return 1.0 / pos_freqs, 1.0
    y = m.yarn

    def corr_dim(rot: float) -> float:
        return (rd * math.log(y["original_max_position"] / (rot * 2 * math.pi))) / (2 * math.log(rope_theta))

    low = max(math.floor(corr_dim(y["beta_fast"])), 0)
    high = min(math.ceil(corr_dim(y["beta_slow"])), rd - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rd // 2, dtype=torch.float) - low) / (high - low), 0, 1)
    mask = (1 - ramp) * y["extrapolation_factor"]
    inv = (1.0 / (y["factor"] * pos_freqs)) * (1 - mask) + (1.0 / pos_freqs) * mask
    mscale = float(yarn_get_mscale(y["factor"], y["mscale"]) / yarn_get_mscale(y["factor"], y["mscale_all_dim"])
                   * y["attn_factor"])
    return inv, mscale


class Attention:
    """The seam between the shared EAGLE-3 draft body (:class:`Eagle3Draft`) and one architecture's attention.

    An adapter reads its part of the draft config (:meth:`read_config`: the :class:`DraftArch` fields it owns), is built
    from the loaded weights (internal names, :func:`_internal_name`), and computes, for rows ``x [N, 2H or H]`` at
    positions ``pos [N]``: the queries in the space the keys are scored in and the rows' draft-KV-cache entry
    (:meth:`qkv`), the keys and values of cache entries (:meth:`kv`: ``[N, groups, dk]`` and ``[N, groups, dv]``; query
    head h reads group ``h // (heads / groups)``), and the per-head attention output mapped to ``o_proj``'s input
    (:meth:`out`). The softmax runs in :class:`Eagle3Draft` with :attr:`scale`. A cache entry is a pair of tensors
    indexed by row on dim 0 (the drafting replay slices and gathers it).
    """

    architecture = ""
    #: the SGLang function that loads this architecture's checkpoint (cited where a tensor is missing)
    loader = ""
    scale = 1.0

    @classmethod
    def read_config(cls, dc: DraftConfig, p: SGLangDraftParams) -> dict:   # pragma: no cover - abstract
        raise NotImplementedError

    def qkv(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple]:  # pragma: no cover
        raise NotImplementedError

    def kv(self, entry: tuple) -> tuple[torch.Tensor, torch.Tensor]:         # pragma: no cover
        raise NotImplementedError

    def out(self, i: int, o: torch.Tensor) -> torch.Tensor:                  # pragma: no cover
        raise NotImplementedError


class LlamaAttention(Attention):
    """``LlamaForCausalLMEagle3``'s attention (``models/llama.py::LlamaAttention``): q / k / v projections, neox rotary
    embedding (:func:`_inv_freq`), GQA over ``kv_heads`` groups, scale ``head_dim ** -0.5``. Cache entry: ``(k, v)``
    each ``[N, kv_heads, head_dim]`` (keys roped)."""

    architecture = LLAMA_CLASS
    loader = f"{L3}::LlamaForCausalLMEagle3.load_weights"

    @classmethod
    def read_config(cls, dc: DraftConfig, p: SGLangDraftParams) -> dict:
        """``heads``, ``kv_heads``, ``head_dim``, ``rope_theta``, ``rope_scaling``, ``max_position`` of a Llama draft.

        Raises:
            BadInput: attention bias, or a rope SGLang's ``get_rope`` cannot build or this module does not run."""
        raw = dc.raw
        if p.attn_bias:
            raise BadInput("attention_bias / bias is set: the offline draft run has no attention bias (the EAGLE-3 "
                           "drafts SGLang serves have none)", path=dc.path, field="attention_bias")
        rope = raw.get("rope_parameters") if raw.get("rope_parameters") is not None else raw.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):
            raise BadInput(f"expected an object {{rope_type, ...}} or null, got {rope!r} (sglang/srt/layers/"
                           "rotary_embedding/factory.py::get_rope indexes it)", path=dc.path, field="rope_scaling")
        if isinstance(rope, dict) and not (rope.get("rope_type") or rope.get("type")):
            raise BadInput(f"no rope_type / type in {rope!r}: SGLang raises 'Unknown RoPE scaling type' (sglang/srt/"
                           "layers/rotary_embedding/factory.py::get_rope)", path=dc.path, field="rope_scaling")
        kind = str(rope.get("rope_type") or rope.get("type")) if isinstance(rope, dict) else "default"
        if isinstance(rope, dict) and raw.get("original_max_position_embeddings") is not None:
            rope = {**rope, "original_max_position_embeddings": raw["original_max_position_embeddings"]}  # llama.py
        if kind not in ("default", "linear", "llama3"):
            raise BadInput(f"rope type {kind!r}: the offline draft run implements default, linear and llama3 "
                           "(sglang/srt/layers/rotary_embedding.py::get_rope has more)", path=dc.path,
                           field="rope_scaling")
        # the theta SGLang's LlamaDecoderLayer reads (one rule, shared with the config checks: a theta inside
        # rope_parameters / rope_scaling wins over the top-level one; a non-number is bad input naming the field)
        theta = effective_rope(raw, dc.path)["rope_theta"]
        return dict(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, rope_theta=theta,
                    rope_scaling=rope if isinstance(rope, dict) else None,
                    max_position=raw.get("max_position_embeddings"))

    def __init__(self, arch: Any, w: dict[str, torch.Tensor], device: torch.device):
        self.arch, self.w = arch, w
        self._inv = _inv_freq(arch).to(device)
        self._pos_scale = _rope_scale(arch)
        self.scale = 1.0 / math.sqrt(arch.head_dim)

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Neox-style rotary embedding of ``x [N, heads, hd]`` at positions ``pos [N]``."""
        ang = (pos.to(torch.float32) / self._pos_scale)[:, None] * self._inv[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        xf = x.float()
        x1, x2 = xf[..., : xf.shape[-1] // 2], xf[..., xf.shape[-1] // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    def qkv(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """``(q [N, heads, hd] roped, (k [N, kv_heads, hd] roped, v [N, kv_heads, hd]))``."""
        a, w, p = self.arch, self.w, f"layers.{i}.self_attn."
        n = x.shape[0]
        # q/k/v biases only where the weights carry them (a MiMo / Qwen2 MTP head: helpers.draft.mimo_mtp)
        q = F.linear(x, w[p + "q_proj.weight"], w.get(p + "q_proj.bias")).view(n, a.heads, a.head_dim)
        k = F.linear(x, w[p + "k_proj.weight"], w.get(p + "k_proj.bias")).view(n, a.kv_heads, a.head_dim)
        v = F.linear(x, w[p + "v_proj.weight"], w.get(p + "v_proj.bias")).view(n, a.kv_heads, a.head_dim)
        return self._rope(q, pos), (self._rope(k, pos), v)

    def kv(self, entry: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        return entry[0], entry[1]

    def out(self, i: int, o: torch.Tensor) -> torch.Tensor:
        return o.reshape(o.shape[0], -1)


class MLAAttention(Attention):
    """``Eagle3DeepseekV2ForCausalLM``'s attention: ``deepseek_v2.py::DeepseekV2AttentionMLA`` with the 2H-wide fused
    q_a / kv_a projection (``kimi_k25_eagle3.py::Eagle3MLADecoderLayer.__init__``), run weight-absorbed as SGLang runs
    every draft batch (``forward_mla.py::DeepseekMLAForwardMixin.forward_absorb_prepare`` / ``forward_absorb_core``):

    * ``[q_a, latent, k_pe] = fused_qkv_a_proj_with_mqa(x)`` (``q_a_proj`` and ``kv_a_proj_with_mqa`` concatenated,
      q first, as ``load_weights`` fuses them); ``q = q_b_proj(q_a_layernorm(q_a))`` split per head into
      ``[q_nope, q_pe]``; ``latent = kv_a_layernorm(latent)`` (``k_pe`` is not normed);
    * ``q_nope_out = bmm(q_nope, w_kc)`` (``w_kc [heads, nope, kv_lora]``, ``w_vc [heads, kv_lora, v]``: ``kv_b_proj``
      split per head by ``Eagle3DeepseekV2ForCausalLM.post_load_weights``);
    * ``q_pe``, ``k_pe`` rotated (:func:`mla_inv_freq`: interleaved unless ``rope_interleave`` is false, cos / sin times
      the yarn multiplier, in float32);
    * MQA: every head's ``[q_nope_out, q_pe]`` against each row's ``[latent, k_pe]`` times :attr:`MLAShape.scaling`,
      the values the latents; then ``bmm(attn, w_vc)`` into ``o_proj``.

    Cache entry: ``(latent [N, kv_lora], k_pe [N, rope])``, what SGLang's ``MLATokenToKVPool`` holds per token.
    """

    architecture = MLA_CLASS
    loader = f"{K25}::Eagle3DeepseekV2ForCausalLM.load_weights"

    @classmethod
    def read_config(cls, dc: DraftConfig, p: SGLangDraftParams) -> dict:
        """``heads``, ``kv_heads`` (1), ``head_dim`` (nope + rope), ``rope_theta``, ``rope_scaling``,
        ``max_position`` and ``mla`` (:class:`MLAShape`) of an MLA draft, from the rope as transformers 5 folds it
        (:func:`helpers.draft.config_checks.effective_rope`) and ``Eagle3MLADecoderLayer.__init__`` reads it (l. 80-89:
        ``rope_parameters``; a ``default`` rope type is no scaling).

        Raises:
            BadInput: a rope field that is not a number."""
        raw = dc.raw
        for key in ("rope_parameters", "rope_scaling"):
            if raw.get(key) is not None and not isinstance(raw[key], dict):
                raise BadInput(f"expected an object {{rope_type, ...}} or null, got {raw[key]!r} (sglang/srt/layers/"
                               "rotary_embedding/factory.py::get_rope indexes it)", path=dc.path, field=key)
        r = effective_rope(raw, dc.path)
        max_pos = raw.get("max_position_embeddings")
        if max_pos is None:
            max_pos = CONFIG_DEFAULTS.get(str(raw.get("model_type")), CONFIG_DEFAULTS["deepseek_v3"]).get(
                "max_position_embeddings", 4096)
        scaling = (p.qk_nope + p.qk_rope) ** -0.5           # DeepseekV2AttentionMLA.__init__: qk_head_dim ** -0.5
        yarn = None
        where = "rope_parameters" if isinstance(raw.get("rope_parameters"), dict) else "rope_scaling"
        if r["rope_type"] != "default":
            sc = r["scaling"]
            yarn = {"factor": _number(sc, "factor", 1.0, dc, where),
                    "original_max_position": _number(sc, "original_max_position_embeddings", max_pos, dc, where),
                    "beta_fast": _number(sc, "beta_fast", 32, dc, where),
                    "beta_slow": _number(sc, "beta_slow", 1, dc, where),
                    "mscale": _number(sc, "mscale", 1, dc, where),
                    "mscale_all_dim": _number(sc, "mscale_all_dim", 0, dc, where),
                    "extrapolation_factor": _number(sc, "extrapolation_factor", 1, dc, where),
                    "attn_factor": _number(sc, "attn_factor", 1, dc, where)}
            for key in ("factor", "original_max_position"):   # yarn divides by both (yarn.py, rope_variant.py)
                if yarn[key] <= 0:
                    raise BadInput(f"expected a positive number, got {yarn[key]:g} (DeepSeek-yarn divides by it: "
                                   "sglang/srt/layers/rotary_embedding/rope_variant.py::DeepseekScalingRotaryEmbedding"
                                   "._compute_inv_freq)", path=dc.path,
                                   field=f"{where}.{'factor' if key == 'factor' else 'original_max_position_embeddings'}")
            if sc.get("apply_yarn_scaling", True) and sc.get("apply_scale", True):   # compute_mla_mscale_scaling
                m = yarn_get_mscale(yarn["factor"], yarn["mscale_all_dim"])
                scaling = scaling * m * m
        mla = MLAShape(q_lora=p.q_lora, kv_lora=p.kv_lora, nope=p.qk_nope, rope=p.qk_rope, v=p.v_head,
                       interleave=bool(raw.get("rope_interleave", True)), yarn=yarn, scaling=scaling)
        return dict(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, rope_theta=r["rope_theta"],
                    rope_scaling=None if yarn is None else {"rope_type": "deepseek_yarn", **r["scaling"]},
                    max_position=max_pos, mla=mla)

    def __init__(self, arch: Any, w: dict[str, torch.Tensor], device: torch.device):
        self.arch, self.w, self.m = arch, w, arch.mla
        p = "layers.0.self_attn."
        # Eagle3DeepseekV2ForCausalLM.load_weights: cat([q_a_proj, kv_a_proj_with_mqa]) -> fused_qkv_a_proj_with_mqa
        self.fused = torch.cat([w[p + "q_a_proj.weight"], w[p + "kv_a_proj_with_mqa.weight"]], dim=0)
        # post_load_weights: kv_b_proj.unflatten(0, (-1, nope + v)).split([nope, v], 1); w_vc transposed
        w_kc, w_vc = w[p + "kv_b_proj.weight"].unflatten(0, (-1, self.m.nope + self.m.v)).split(
            [self.m.nope, self.m.v], dim=1)
        self.w_kc, self.w_vc = w_kc.contiguous(), w_vc.transpose(1, 2).contiguous()   # [nh, nope, c], [nh, c, v]
        inv, self._mscale = mla_inv_freq(self.m, arch.rope_theta)
        self._inv = inv.to(device)
        self.scale = self.m.scaling

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x [N, heads, rope]`` at ``pos [N]`` in float32 (``rope_variant.py::
        DeepseekScalingRotaryEmbedding.forward_native`` math, cos / sin from the float32 cache), result in x's
        dtype."""
        ang = pos.to(torch.float32)[:, None] * self._inv[None, :]
        cos, sin = ang.cos() * self._mscale, ang.sin() * self._mscale
        xf = x.float()
        if self.m.interleave:                                      # rotate_gptj
            cos, sin = cos.repeat_interleave(2, dim=-1)[:, None], sin.repeat_interleave(2, dim=-1)[:, None]
            rot = torch.stack((-xf[..., 1::2], xf[..., ::2]), dim=-1).flatten(-2)
        else:                                                      # rotate_neox
            cos, sin = cos.repeat(1, 2)[:, None], sin.repeat(1, 2)[:, None]
            half = xf.shape[-1] // 2
            rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        return (xf * cos + rot * sin).to(x.dtype)

    def qkv(self, i: int, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """``(q [N, heads, kv_lora + rope], (latent [N, kv_lora], k_pe [N, rope]))``."""
        m, w, p, eps = self.m, self.w, "layers.0.self_attn.", self.arch.eps
        n = x.shape[0]
        q, cache = F.linear(x, self.fused).split([m.q_lora, m.kv_lora + m.rope], dim=-1)
        latent = _rms(cache[..., : m.kv_lora], w[p + "kv_a_layernorm.weight"], eps)
        q = F.linear(_rms(q, w[p + "q_a_layernorm.weight"], eps), w[p + "q_b_proj.weight"]).view(
            n, self.arch.heads, m.nope + m.rope)
        q_nope, q_pe = q.split([m.nope, m.rope], dim=-1)
        q_nope_out = torch.bmm(q_nope.transpose(0, 1), self.w_kc).transpose(0, 1)          # [N, heads, kv_lora]
        q_pe = self._rope(q_pe, pos)
        k_pe = self._rope(cache[..., m.kv_lora:][:, None, :], pos)[:, 0]
        return torch.cat([q_nope_out, q_pe], dim=-1), (latent, k_pe)

    def kv(self, entry: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        latent, k_pe = entry
        return torch.cat([latent, k_pe], dim=-1)[:, None], latent[:, None]

    def out(self, i: int, o: torch.Tensor) -> torch.Tensor:
        """``[N, heads, kv_lora]`` -> ``bmm(., w_vc)`` -> ``[N, heads * v]``."""
        return torch.bmm(o.transpose(0, 1), self.w_vc).transpose(0, 1).reshape(o.shape[0], -1)


#: the attention adapter of each draft architecture SGLang 0.5.23 serves for EAGLE-3 (``architectures[0]``)
ATTENTIONS: dict[str, type[Attention]] = {c.architecture: c for c in (LlamaAttention, MLAAttention)}
#: the draft architectures this module runs
SUPPORTED_ARCHITECTURES = tuple(ATTENTIONS)


def _scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [B, heads, d]`` against ``k [T, groups, d]`` (query head h reads group ``h // (heads / groups)``) ->
    ``[B, heads, T]``."""
    B, nh, d = q.shape
    g = k.shape[1]
    if g == nh:
        return torch.einsum("bhd,thd->bht", q, k)
    return torch.einsum("bgrd,tgd->bgrt", q.view(B, g, nh // g, d), k).reshape(B, nh, -1)


def _scores_own(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [B, heads, d]`` against each row's own keys ``k [A, B, groups, d]`` (its ancestors and itself) ->
    ``[B, heads, A]``."""
    B, nh, d = q.shape
    g = k.shape[2]
    if g == nh:
        return torch.stack([(q * kk).sum(-1) for kk in k], dim=-1)
    return torch.einsum("bgrd,abgd->bgra", q.view(B, g, nh // g, d), k).reshape(B, nh, -1)


def _mix_own(wts: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Weights ``[B, heads, A]`` over each row's own values ``v [A, B, groups, dv]`` -> ``[B, heads, dv]``."""
    B, nh, A = wts.shape
    g = v.shape[2]
    if g == nh:
        return torch.einsum("bha,abhd->bhd", wts, v)
    return torch.einsum("bgra,abgd->bgrd", wts.view(B, g, nh // g, A), v).reshape(B, nh, -1)


def _mix(wts: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Weights ``[B, heads, T]`` over values ``v [T, groups, dv]`` -> ``[B, heads, dv]``."""
    B, nh, T = wts.shape
    g = v.shape[1]
    if g == nh:
        return torch.einsum("bht,thd->bhd", wts, v)
    return torch.einsum("bgrt,tgd->bgrd", wts.view(B, g, nh // g, T), v).reshape(B, nh, -1)
