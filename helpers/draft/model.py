"""An SGLang EAGLE-3 draft checkpoint run offline in pure torch, exactly as SGLang 0.5.23 serves it.

What SGLang does, and where (sglang 0.5.23):

* ``sglang/srt/models/llama_eagle3.py::LlamaModel.forward``: when the fed hidden state is wider than the embedding
  (the first draft step, on the target's concatenated aux hidden states), ``input_norm`` (``norm_before_fc``: one
  RMSNorm over the concatenation), then ``fc_norm`` (``fc_norm`` / ``use_aux_norm``: one RMSNorm per chunk), then
  ``fc``; later steps feed the draft's own hidden state, which skips all three.
* ``llama_eagle3.py::LlamaDecoderLayer.forward``: layer 0 takes ``residual = h``,
  ``x = cat([input_layernorm(embeds), hidden_norm(h)])`` (2H wide into qkv); layers > 0 fuse the residual add into
  ``hidden_norm``; then attention, ``post_attention_layernorm`` (fused residual add), MLP (SiLU-gated).
* ``llama_eagle3.py::LlamaModel.forward`` (end): ``(normed, pre) = norm(h, residual)``; logits from ``normed``; the
  hidden state carried to the next draft step is ``pre`` unless ``norm_output``.
* ``llama_eagle3.py::LlamaForCausalLMEagle3.__init__``: ``lm_head`` over ``draft_vocab_size``; tied to the embedding
  with ``tie_word_embeddings``; taken from the target when ``draft_vocab_size`` is None (``load_lm_head_from_target``,
  then ``speculative/eagle_worker_v2.py::EAGLEWorkerV2.init_lm_head`` ``set_embed_and_head``).
* ``llama_eagle3.py::LlamaForCausalLMEagle3.load_weights``: legacy names ``midlayer`` -> ``layers.0``,
  ``aux_norm_low/mid/high`` -> ``fc_norm.0/1/2``; ``d2t`` gives ``hot_token_id = d2t + arange`` (target id = draft id
  + d2t[draft id]); ``t2d`` is ignored; names the model does not have are skipped silently.
* ``sglang/srt/models/llama.py::LlamaForCausalLM.set_embed``: the target's ``embed_tokens`` replaces the draft's,
  unless ``target_hidden_size`` differs from ``hidden_size`` (then the draft's own embedding is used).
* Rotary embedding: ``sglang/srt/layers/rotary_embedding.py::get_rope`` with the draft config's ``rope_theta`` and
  ``rope_scaling`` (neox style, as ``models/llama.py::LlamaAttention``); ``default``, ``linear`` and ``llama3`` are
  implemented here; other scaling types are refused with a clear line.

``Eagle3DeepseekV2ForCausalLM`` (``models/kimi_k25_eagle3.py``, the Kimi-K2.5 MLA draft) shares that body -- fc
(with ``fc_norm``, never ``norm_before_fc``: ``Eagle3MLAModel`` has no ``input_norm``), exactly one decoder layer over
``cat([input_layernorm(embeds), hidden_norm(h)])``, ``post_attention_layernorm``, SiLU MLP (``deepseek_v2.py::
DeepseekV2MLP``), ``norm``, lm_head over the draft vocab or the target's, d2t, the target's embedding
(``Eagle3DeepseekV2ForCausalLM.set_embed``) -- and differs only in its attention, ``deepseek_v2.py::
DeepseekV2AttentionMLA`` with the 2H-wide fused ``q_a`` / ``kv_a`` projection ``Eagle3MLADecoderLayer.__init__``
puts in: :class:`MLAAttention`. The draft-extend and draft-decode passes run it weight-absorbed, as SGLang's
dispatch does for every draft batch (``deepseek_common/attention_backend_handler.py``: only a non-speculative extend
takes the expanded MHA): ``models/deepseek_common/attention_forward_methods/forward_mla.py::forward_absorb_prepare``
/ ``forward_absorb_core``.

The architecture picks its attention adapter (:data:`ATTENTIONS`, by ``architectures[0]`` of the draft config); the
rest of the draft run is the same code for both.
"""
from __future__ import annotations

import math
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..errors import BadInput
from ..formats.configs import DraftConfig, read_draft_config, read_safetensors_index, read_target_config
from .config_checks import effective_rope
from .params import (CONFIG_DEFAULTS, K25, L3, LLAMA_CLASS, MLA_CLASS, SHARD_TENSORS, SGLangDraftParams,
                     resolve_name, sglang_parameters, shape_error)

_DS2 = "sglang/srt/models/deepseek_v2.py"
_ROPE_VARIANT = "sglang/srt/layers/rotary_embedding/rope_variant.py"


def _internal_name(param: str, shard) -> str:
    """SGLang's ``(parameter, shard)`` -> this module's tensor name: ``model.`` dropped, the MLA draft's
    ``midlayer.`` written ``layers.0.`` (its checkpoint name), stacked / fused shards split back into the tensors that
    fill them (:data:`helpers.draft.params.SHARD_TENSORS`: ``qkv_proj`` q/k/v -> ``q_proj`` / ``k_proj`` /
    ``v_proj``, ``gate_up_proj`` 0/1 -> ``gate_proj`` / ``up_proj``, ``fused_qkv_a_proj_with_mqa`` q_a/kv_a ->
    ``q_a_proj`` / ``kv_a_proj_with_mqa``)."""
    n = param[len("model."):] if param.startswith("model.") else param
    if n.startswith("midlayer."):
        n = "layers.0." + n[len("midlayer."):]
    if shard is None:
        return n
    for fused, parts in SHARD_TENSORS.items():
        if f".{fused}." in n:
            return n.replace(f".{fused}.", f".{parts[shard]}.")
    raise ValueError(f"no shard {shard!r} in {param}")


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


@dataclass
class DraftArch:
    """The draft's shape as SGLang 0.5.23 builds it from its config.json (``llama_eagle3.py::LlamaModel.__init__``,
    ``kimi_k25_eagle3.py::Eagle3MLAModel.__init__``).

    Attributes: hidden (H), target_hidden (per-chunk width fed to ``fc``), num_aux (chunks), heads, kv_heads,
    head_dim (the MLA draft: its query heads, 1 -- every head attends to the one latent --, ``qk_nope + qk_rope``),
    intermediate, layers, eps, rope_theta, rope_scaling (dict or None), vocab (target vocab), draft_vocab (lm_head
    rows), tie (``tie_word_embeddings``), lm_head_from_target (``draft_vocab_size`` None), norm_before_fc, fc_norm,
    norm_output, fc_bias, max_position (``max_position_embeddings``), architecture (``architectures[0]``: picks the
    attention, :data:`ATTENTIONS`), mla (:class:`MLAShape` for the MLA draft, else None).
    """

    hidden: int
    target_hidden: int
    num_aux: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    layers: int
    eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    vocab: int
    draft_vocab: int
    tie: bool
    lm_head_from_target: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    fc_bias: bool
    max_position: Optional[int]
    architecture: str = LLAMA_CLASS
    mla: Optional[MLAShape] = None

    @classmethod
    def from_config(cls, path: Path) -> "DraftArch":
        """Read ``path`` (draft config.json or its folder); the shapes are the ones SGLang builds
        (:func:`helpers.draft.params.sglang_parameters`: config fields left out get their config class's defaults as
        SGLang's AutoConfig load gives them), the attention's fields from its adapter (:data:`ATTENTIONS`).

        Raises:
            BadInput: not an SGLang EAGLE-3 draft this module runs (EAGLE-1 drafts, attention bias, a rope SGLang
                cannot build), or a field of the wrong type.
        """
        dc = read_draft_config(path)
        raw = dc.raw
        arch = (dc.architectures or [""])[0]
        if arch not in ATTENTIONS:
            raise BadInput(f"architecture {arch!r} is not an EAGLE-3 draft this tool can run offline (expected one of "
                           f"{', '.join(ATTENTIONS)}: {L3}, {K25})", path=dc.path, field="architectures")
        p = sglang_parameters(dc)
        return cls(hidden=dc.hidden_size, target_hidden=p.hidden_size_in, num_aux=p.num_aux,
                   intermediate=p.intermediate, layers=p.layers,
                   eps=float(raw.get("rms_norm_eps") or 1e-6), vocab=p.vocab, draft_vocab=p.draft_vocab,
                   tie=p.tie, lm_head_from_target=p.lm_from_target, norm_before_fc=p.norm_before_fc,
                   fc_norm=p.fc_norm, norm_output=p.norm_output, fc_bias=bool(raw.get("bias", False)),
                   architecture=arch, **ATTENTIONS[arch].read_config(dc, p))


# ------------------------------------------------------------------------------------------------ tensor reading

def _safetensors_index(folder: Path) -> dict[str, Path]:
    """tensor name -> file, from the headers (:func:`helpers.formats.configs.read_safetensors_index`)."""
    return {k: v.file for k, v in read_safetensors_index(folder).items()}


def _read_tensor(path: Path, key: str) -> torch.Tensor:
    try:
        with safe_open(str(path), framework="pt") as sf:
            return sf.get_tensor(key)
    except Exception as e:
        raise BadInput(f"cannot read tensor {key!r} ({' '.join(str(e).split())})", path=path) from None


def _finite(t: torch.Tensor, path: Path, name: str) -> None:
    """Raise :class:`BadInput` naming ``path [name]`` when the weight ``t`` holds NaN or Inf: SGLang would load and
    serve it (every draft logit NaN), so no accept length the offline run gives would say why."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
        raise BadInput(f"{nan} NaN, {inf} Inf of {t.numel()} values: a damaged checkpoint (expected finite weights)",
                       path=path, field=name)


def find_target_tensor(target_dir: Path, suffix: str) -> Optional[tuple[str, Path]]:
    """``(name, file)`` of the one target tensor whose name ends with ``suffix`` (e.g. ``embed_tokens.weight``),
    read from the safetensors index / headers only; None when there is none.

    Several tensors may end with ``suffix``: a multi-token-prediction layer's own copy next to the model's
    (DeepSeek-V3 / Kimi-K2 checkpoints carry ``model.layers.61.embed_tokens.weight`` beside
    ``model.embed_tokens.weight``; other checkpoints name it ``mtp``), or a wrapper's prefix
    (``language_model.model.embed_tokens.weight``). Names with ``mtp`` or inside a decoder layer (``.layers.<n>.``)
    are left out while another remains; of the rest, the shortest is taken.

    Raises:
        BadInput: no weights in the folder.
    """
    if not any(Path(target_dir).glob("*.safetensors")) and not (Path(target_dir) / "model.safetensors.index.json"
                                                                 ).is_file():
        raise BadInput(f"no safetensors in the target folder: the offline draft run reads the target's "
                       f"'*{suffix}' from them (only that tensor; sglang/srt/models/llama.py::LlamaForCausalLM."
                       "set_embed shares the target's embedding with the draft)", path=target_dir)
    index = _safetensors_index(Path(target_dir))
    hits = sorted((k for k in index if k.endswith(suffix) and "mtp" not in k.lower()), key=len)
    main = [k for k in hits if not re.search(r"(^|\.)layers\.\d+\.", k)]
    hits = main or hits
    if not hits:
        return None
    return hits[0], index[hits[0]]


# ------------------------------------------------------------------------------------------------ the model

def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """SGLang ``RMSNorm.forward_native``: fp32 statistics and weight product, result in the input dtype (one fused
    ``F.rms_norm``)."""
    return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


def _add_rms(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's fused residual add + RMSNorm (``RMSNorm.forward_native`` with ``residual``, as the CUDA
    ``fused_add_rmsnorm`` kernel): the sum is formed in float32 and normalised unrounded; the residual carried on is
    that sum in the input dtype. Returns ``(normed, residual)``, both in ``x``'s dtype."""
    s = x.float() + residual.float()
    return F.rms_norm(s, (s.shape[-1],), w.float(), eps).to(x.dtype), s.to(x.dtype)


def _inv_freq(arch: DraftArch) -> torch.Tensor:
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


def _rope_scale(arch: DraftArch) -> float:
    rs = arch.rope_scaling or {}
    kind = str(rs.get("rope_type") or rs.get("type") or "default")
    return float(rs.get("factor", 1.0)) if kind == "linear" else 1.0


# ------------------------------------------------------------------------------------------------ attention adapters

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
        theta = raw.get("rope_theta")
        if theta is None and isinstance(rope, dict):
            theta = rope.get("rope_theta")
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
        return dict(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim,
                    rope_theta=float(theta if theta is not None else 1e4),
                    rope_scaling=rope if isinstance(rope, dict) else None,
                    max_position=raw.get("max_position_embeddings"))

    def __init__(self, arch: DraftArch, w: dict[str, torch.Tensor], device: torch.device):
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
        q = F.linear(x, w[p + "q_proj.weight"]).view(n, a.heads, a.head_dim)
        k = F.linear(x, w[p + "k_proj.weight"]).view(n, a.kv_heads, a.head_dim)
        v = F.linear(x, w[p + "v_proj.weight"]).view(n, a.kv_heads, a.head_dim)
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

    @classmethod
    def read_config(cls, dc: DraftConfig, p: SGLangDraftParams) -> dict:
        """``heads``, ``kv_heads`` (1), ``head_dim`` (nope + rope), ``rope_theta``, ``rope_scaling``,
        ``max_position`` and ``mla`` (:class:`MLAShape`) of an MLA draft, from the rope as transformers 5 folds it
        (:func:`helpers.draft.config_checks.effective_rope`) and ``Eagle3MLADecoderLayer.__init__`` reads it (l. 80-89:
        ``rope_parameters``; a ``default`` rope type is no scaling).

        Raises:
            BadInput: a rope field that is not a number."""
        raw = dc.raw
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
            if sc.get("apply_yarn_scaling", True) and sc.get("apply_scale", True):   # compute_mla_mscale_scaling
                m = yarn_get_mscale(yarn["factor"], yarn["mscale_all_dim"])
                scaling = scaling * m * m
        mla = MLAShape(q_lora=p.q_lora, kv_lora=p.kv_lora, nope=p.qk_nope, rope=p.qk_rope, v=p.v_head,
                       interleave=bool(raw.get("rope_interleave", True)), yarn=yarn, scaling=scaling)
        return dict(heads=p.heads, kv_heads=p.kv_heads, head_dim=p.head_dim, rope_theta=r["rope_theta"],
                    rope_scaling=None if yarn is None else {"rope_type": "deepseek_yarn", **r["scaling"]},
                    max_position=max_pos, mla=mla)

    def __init__(self, arch: DraftArch, w: dict[str, torch.Tensor], device: torch.device):
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


@dataclass
class ExtendOutput:
    """The draft-extend pass over one sequence (rows = positions).

    Attributes:
        hidden: ``[T, H]`` the hidden state carried to the next draft step (pre-norm unless ``norm_output``).
        logits: ``[T, V_draft]`` float32 logits over the draft vocabulary.
        kv: per layer, the draft KV cache entry of these rows (:class:`Attention`: ``(k, v)`` each ``[T, kv_heads,
            head_dim]`` for the Llama draft; ``(latent [T, kv_lora], k_pe [T, rope])`` for the MLA draft).
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: per layer, the keys / values (:meth:`Attention.kv`) in float32 (built once, read by every draft step)
    kv_f32: dict = field(default_factory=dict, repr=False)


class Eagle3Draft:
    """An EAGLE-3 draft (``LlamaForCausalLMEagle3`` or ``Eagle3DeepseekV2ForCausalLM``) with the weights SGLang would
    load, run in pure torch; its attention is the adapter of its architecture (:data:`ATTENTIONS`).

    Build it with :meth:`load`. ``dtype`` is the compute dtype (the server's ``--dtype`` where this device computes it
    natively, else float32: :func:`helpers.draft.precision.choose_dtype`; the embedded CPU server runs ``float32``,
    GPU servers usually ``bfloat16``); norms and softmax are computed in float32 as SGLang's native kernels do.
    """

    def __init__(self, arch: DraftArch, weights: dict[str, torch.Tensor], embed: torch.Tensor,
                 lm_head: torch.Tensor, hot_token_id: Optional[torch.Tensor], *, dtype: torch.dtype,
                 sources: dict):
        self.arch = arch
        self.w = weights
        self.embed = embed
        self.lm_head = lm_head
        self.hot_token_id = hot_token_id
        self.dtype = dtype
        self.sources = sources
        self.device = embed.device
        self.attn = ATTENTIONS[arch.architecture](arch, weights, self.device)

    # ----------------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, draft_dir: str | Path, target_dir: Optional[str | Path] = None, *,
             dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
             dtype_reason: str = "") -> "Eagle3Draft":
        """Load the draft of ``draft_dir`` (config.json + safetensors, sharded or not) as SGLang would, computing in
        ``dtype`` (pick it with :func:`helpers.draft.precision.choose_dtype`, whose reason goes in ``dtype_reason``:
        ``sources["dtype"]``, the budget document's ``draft_sources``).

        Only the target's ``embed_tokens`` (and, when the draft borrows it, its ``lm_head``) are read from
        ``target_dir``, through its safetensors index: never the whole target.

        Raises:
            BadInput: unsupported architecture; a tensor the model needs is missing, or its shape does not match the
                config (the file and key are named); the target embedding is needed but ``target_dir`` is None or
                has no ``embed_tokens``; a weight holds NaN / Inf.
        """
        draft_dir = Path(draft_dir)
        arch = DraftArch.from_config(draft_dir)
        dc = read_draft_config(draft_dir)
        params = sglang_parameters(dc)
        tensors = read_safetensors_index(draft_dir)
        filled: dict = {}
        names: dict[str, str] = {}
        for key, info in tensors.items():
            where = resolve_name(params, key)
            if where in ("d2t", "t2d"):
                names[where] = key
                continue
            if where is None:
                continue                     # SGLang drops it too (helpers.draft.checks reports it)
            expected = params.params[where][0]
            if tuple(info.shape) != tuple(expected):
                raise shape_error(params, dc, key, info, where[0], where[1], expected)
            filled[where] = (key, info)
        weights: dict[str, torch.Tensor] = {}
        for (param, shard), (shape, _init) in params.params.items():
            if param == "model.embed_tokens.weight":
                continue                     # the target's (set_embed) unless target_hidden_size differs: below
            if param == "lm_head.weight" and arch.lm_head_from_target:
                continue                     # replaced by the target's (set_embed_and_head): below
            if (param, shard) in params.unused:
                continue                     # built, never read by the forward (layers > 0: input_layernorm)
            if (param, shard) not in filled:
                # SGLang keeps the initialised (random / ones) parameter when a name is absent: the draft it serves is
                # then not the trained one. Refuse rather than guess.
                loader = (f"{K25}::Eagle3DeepseekV2ForCausalLM.load_weights" if arch.architecture == MLA_CLASS
                          else f"{L3}::LlamaForCausalLMEagle3.load_weights")
                raise BadInput(f"the draft checkpoint has no tensor for {param}{'' if shard is None else f'[{shard}]'} "
                               f"although its config implies one of shape {list(shape)} ({loader} skips missing "
                               "names and serves an untrained parameter)", path=draft_dir,
                               field=_internal_name(param, shard))
            key, info = filled[(param, shard)]
            t = _read_tensor(info.file, key)
            _finite(t, info.file, key)
            weights[_internal_name(param, shard)] = t.to(device=device, dtype=dtype)
        if ("model.embed_tokens.weight", None) in filled:
            names["embed_tokens.weight"] = filled[("model.embed_tokens.weight", None)][0]
        index = {k: v.file for k, v in tensors.items()}
        a = arch
        hot = None
        if "d2t" in names:
            d2t = _read_tensor(index[names["d2t"]], names["d2t"]).to(torch.long)
            if d2t.ndim != 1 or d2t.shape[0] != a.draft_vocab:
                raise BadInput(f"d2t has shape {list(d2t.shape)}, expected [{a.draft_vocab}] (draft_vocab_size)",
                               path=index[names["d2t"]], field="d2t")
            hot = (d2t + torch.arange(d2t.shape[0])).to(device)
            if int(hot.min()) < 0 or int(hot.max()) >= a.vocab:
                raise BadInput(f"d2t maps draft ids outside the target vocabulary [0, {a.vocab})",
                               path=index[names["d2t"]], field="d2t")
        sources: dict = {"draft": str(draft_dir), "dtype": dtype_reason or str(dtype).removeprefix("torch.")}
        use_target_embed = a.target_hidden == a.hidden or "target_hidden_size" not in dc.raw
        if use_target_embed:
            if target_dir is None:
                raise BadInput("the draft uses the target's embedding (sglang/srt/models/llama.py::"
                               "LlamaForCausalLM.set_embed): pass the target folder", field="--target")
            hit = find_target_tensor(Path(target_dir), "embed_tokens.weight")
            if hit is None:
                raise BadInput("the target's safetensors hold no '*embed_tokens.weight' (the draft reads the target's "
                               "embedding: sglang/srt/models/llama.py::LlamaForCausalLM.set_embed)", path=target_dir)
            embed = _read_tensor(hit[1], hit[0])
            _finite(embed, hit[1], hit[0])
            sources["embed"] = f"target {hit[1].name}:{hit[0]}"
        else:
            key = names.get("embed_tokens.weight")
            if key is None:
                raise BadInput("target_hidden_size differs from hidden_size, so SGLang keeps the draft's own "
                               "embedding, but the checkpoint has no embed_tokens.weight", path=draft_dir,
                               field="embed_tokens.weight")
            embed = _read_tensor(index[key], key)
            sources["embed"] = f"draft {index[key].name}:{key}"
        if tuple(embed.shape) != (a.vocab, a.hidden):
            raise BadInput(f"the embedding has shape {list(embed.shape)}, expected [{a.vocab}, {a.hidden}] "
                           "(vocab_size, hidden_size of the draft config)", path=sources["embed"], field="embed_tokens")
        embed = embed.to(device=device, dtype=dtype)
        if a.tie:
            # LogitsProcessor is built with vocab_size = draft_vocab_size and keeps that many logits
            # (layers/logits_processor.py::LogitsProcessor._copy_logits_to_buffer): the first rows of the embedding
            lm_head = embed[: a.draft_vocab]
            sources["lm_head"] = "tied to the embedding (tie_word_embeddings)" + (
                f", its first {a.draft_vocab} rows (draft_vocab_size)" if a.draft_vocab < a.vocab else "")
        elif a.lm_head_from_target:
            if target_dir is None:
                raise BadInput("draft_vocab_size is unset, so SGLang takes lm_head from the target: pass --target",
                               field="--target")
            hit = find_target_tensor(Path(target_dir), "lm_head.weight")
            if hit is None:                                 # a tied target: its embedding is its lm_head
                lm_head, sources["lm_head"] = embed, "the target's tied embedding (draft_vocab_size unset)"
            else:
                lm_head = _read_tensor(hit[1], hit[0]).to(device=device, dtype=dtype)
                sources["lm_head"] = f"target {hit[1].name}:{hit[0]} (draft_vocab_size unset)"
        else:
            lm_head, sources["lm_head"] = weights.pop("lm_head.weight"), "draft lm_head.weight"
        sources["d2t"] = "draft d2t" if hot is not None else "none (draft ids are taken as target ids)"
        return cls(arch, weights, embed, lm_head, hot, dtype=dtype, sources=sources)

    def with_vocab_map(self, d2t: torch.Tensor, source: str) -> "Eagle3Draft":
        """The same draft with another d2t (``hot_token_id = d2t + arange``): a vocab-map fix, run offline.

        Raises:
            BadInput: ``d2t`` is not ``[draft_vocab]`` or maps outside the target vocabulary."""
        d2t = d2t.to(torch.long).reshape(-1)
        if d2t.shape[0] != self.arch.draft_vocab:
            raise BadInput(f"d2t has {d2t.shape[0]} entries, expected {self.arch.draft_vocab} (draft_vocab_size)",
                           path=source, field="d2t")
        hot = d2t + torch.arange(d2t.shape[0])
        if int(hot.min()) < 0 or int(hot.max()) >= self.arch.vocab:
            raise BadInput(f"d2t maps draft ids outside the target vocabulary [0, {self.arch.vocab})", path=source,
                           field="d2t")
        return Eagle3Draft(self.arch, self.w, self.embed, self.lm_head, hot.to(self.device), dtype=self.dtype,
                           sources={**self.sources, "d2t": source})

    # ----------------------------------------------------------------------------------------- pieces
    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocab ids -> target ids (``hot_token_id[draft_id]``; identity without d2t), any shape, int64."""
        return draft_ids if self.hot_token_id is None else self.hot_token_id[draft_ids]

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """``[T, num_aux * target_hidden]`` target aux hidden states -> ``[T, H]`` (input_norm, fc_norm, fc); as
        ``llama_eagle3.py::LlamaModel.forward`` (l. 238), aux states as wide as the embedding skip all three."""
        a, w = self.arch, self.w
        if aux.shape[-1] != a.target_hidden * a.num_aux:
            raise BadInput(f"the aux hidden states are {aux.shape[-1]} wide but the draft's fc takes "
                           f"{a.target_hidden * a.num_aux} ({a.num_aux} x {a.target_hidden})", field="aux width")
        x = aux.to(self.dtype)
        if x.shape[-1] == a.hidden:
            return x                         # LlamaModel.forward l. 238: as wide as the embedding, fed as is
        if a.norm_before_fc:
            x = _rms(x, w["input_norm.weight"], a.eps)
        if a.fc_norm:
            x = torch.cat([_rms(c, w[f"fc_norm.{i}.weight"], a.eps)
                           for i, c in enumerate(x.chunk(a.num_aux, dim=-1))], dim=-1)
        return F.linear(x, w["fc.weight"], w.get("fc.bias"))

    def _layer_in(self, i: int, embeds: torch.Tensor, h: torch.Tensor, residual: Optional[torch.Tensor]):
        a, w, p = self.arch, self.w, f"layers.{i}."
        if i == 0:
            return torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], a.eps),
                              _rms(h, w[p + "hidden_norm.weight"], a.eps)], dim=-1), h
        return _add_rms(h, residual, w[p + "hidden_norm.weight"], a.eps)

    def _layer_out(self, i: int, attn: torch.Tensor, residual: torch.Tensor):
        a, w, p = self.arch, self.w, f"layers.{i}."
        o = F.linear(attn, w[p + "self_attn.o_proj.weight"])
        y, residual = _add_rms(o, residual, w[p + "post_attention_layernorm.weight"], a.eps)
        m = F.linear(F.silu(F.linear(y, w[p + "mlp.gate_proj.weight"])) * F.linear(y, w[p + "mlp.up_proj.weight"]),
                     w[p + "mlp.down_proj.weight"])
        return m, residual

    def _finish(self, m: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        normed, pre = _add_rms(m, residual, self.w["norm.weight"], self.arch.eps)
        logits = F.linear(normed, self.lm_head).float()
        return (normed if self.arch.norm_output else pre), logits

    # ----------------------------------------------------------------------------------------- passes
    @torch.no_grad()
    def extend(self, tokens: torch.Tensor, aux: torch.Tensor, positions: Optional[torch.Tensor] = None
               ) -> ExtendOutput:
        """The draft-extend pass over one sequence: row t takes ``tokens[t]`` and ``aux[t]`` at ``positions[t]``
        and attends causally to rows 0..t (``speculative/eagle_worker_v2.py::EAGLEWorkerV2._draft_extend``, whose
        input ids are the sequence rotated left by one: row t holds token t+1 with the target's aux state of
        position t; the caller does that shift, see :func:`helpers.draft.simulate.simulate_sequence`).

        Args:
            tokens: int64 ``[T]`` target-vocab ids.
            aux: ``[T, num_aux * target_hidden]`` (any float dtype).
            positions: int64 ``[T]`` (default 0..T-1).
        """
        dev = self.device
        tokens, aux = tokens.to(dev), aux.to(dev)
        T = tokens.shape[0]
        pos = torch.arange(T, device=dev) if positions is None else positions.to(dev)
        emb = self.embed[tokens]
        h = self.project(aux)
        residual = None
        kv = []
        att = self.attn
        for i in range(self.arch.layers):
            x, residual = self._layer_in(i, emb, h, residual)
            q, entry = att.qkv(i, x, pos)
            kv.append(entry)
            k, v = att.kv(entry)                                                      # [T, groups, dk / dv]
            o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True, scale=att.scale,
                                               enable_gqa=k.shape[1] != q.shape[1])[0].transpose(0, 1)
            h, residual = self._layer_out(i, att.out(i, o), residual)
        hidden, logits = self._finish(h, residual)
        return ExtendOutput(hidden=hidden, logits=logits, kv=kv)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx_len: torch.Tensor,
             ext_kv: "ExtendOutput | Sequence[tuple[torch.Tensor, torch.Tensor]]",
             path_kv: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]] = ()
             ) -> tuple[torch.Tensor, torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One draft decode step for ``B`` query nodes at once (``eagle_worker_v2.py::EAGLEWorkerV2.draft_forward``,
        one iteration of its loop): node b takes ``tokens[b]`` (target ids, embedded by the target's embedding)
        and the hidden state ``hidden[b]`` of its parent, at ``positions[b]``; it attends to the extend rows
        ``0 .. ctx_len[b]-1`` of ``ext_kv`` (the :class:`ExtendOutput`, whose float32 keys and values are then built
        once, or its ``kv`` list), to its ancestors' cache entries (``path_kv[j]`` per ancestor, oldest first, each a
        per-layer list of entries of ``B`` rows: :class:`Attention`) and to itself. Scores and softmax in float32.

        Returns ``(hidden [B, H], logits [B, V_draft] float32, this step's per-layer cache entries of B rows)``.
        """
        dev = self.device
        tokens, hidden = tokens.to(dev), hidden.to(dev)
        B = tokens.shape[0]
        emb = self.embed[tokens]
        h, residual = hidden.to(self.dtype), None
        att = self.attn
        cache = ext_kv.kv_f32 if isinstance(ext_kv, ExtendOutput) else None
        if isinstance(ext_kv, ExtendOutput):
            ext_kv = ext_kv.kv
        T = ext_kv[0][0].shape[0] if ext_kv else 0
        mask = torch.arange(T, device=dev)[None, :] < ctx_len.to(dev)[:, None]          # [B, T]
        new_kv = []
        for i in range(self.arch.layers):
            x, residual = self._layer_in(i, emb, h, residual)
            q, entry = att.qkv(i, x, positions.to(dev))
            new_kv.append(entry)
            qf = q.float()                                                             # [B, nh, dk]
            if cache is not None and i in cache:
                ke, ve = cache[i]
            else:
                ke, ve = (t.float() for t in att.kv(ext_kv[i]))                        # [T, groups, dk / dv]
                if cache is not None:
                    cache[i] = (ke, ve)
            s_ext = _scores(qf, ke) * att.scale
            s_ext = s_ext.masked_fill(~mask[:, None, :], float("-inf"))
            anc = [att.kv(p[i]) for p in path_kv] + [att.kv(entry)]                   # [B, groups, dk / dv] each
            anc_k = torch.stack([kk.float() for kk, _ in anc], dim=0)                  # [A, B, groups, dk]
            anc_v = torch.stack([vv.float() for _, vv in anc], dim=0)
            s_anc = _scores_own(qf, anc_k) * att.scale                                 # [B, nh, A]
            wts = torch.softmax(torch.cat([s_ext, s_anc], dim=-1), dim=-1)
            o = _mix(wts[..., :T], ve) + _mix_own(wts[..., T:], anc_v)
            h, residual = self._layer_out(i, att.out(i, o.to(self.dtype)), residual)
        hidden, logits = self._finish(h, residual)
        return hidden, logits, new_kv


def target_lm_head(target_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, str]:
    """The target's output projection ``[vocab, H]`` (``lm_head.weight``, or the embedding when tied), read from the
    safetensors index without loading the rest: the target's own next-token choice from a post-norm hidden state.

    Raises:
        BadInput: neither tensor is in the target's safetensors.
    """
    target_dir = Path(target_dir)
    hit = find_target_tensor(target_dir, "lm_head.weight")
    tied = bool(read_target_config(target_dir).raw.get("tie_word_embeddings"))
    if hit is None or tied:
        hit = find_target_tensor(target_dir, "embed_tokens.weight")
    if hit is None:
        raise BadInput("the target's safetensors hold neither lm_head.weight nor embed_tokens.weight", path=target_dir)
    return _read_tensor(hit[1], hit[0]).to(dtype), f"{hit[1].name}:{hit[0]}"


def target_hidden_size(target_dir: str | Path) -> int:
    """The target's hidden size (its config.json, through :func:`helpers.formats.configs.read_target_config`)."""
    return read_target_config(target_dir).hidden_size


#: below this many multiply-adds per row in the draft's largest matrix, one thread runs the offline draft fastest
SMALL_DRAFT_MACS = 1 << 21


@contextmanager
def compute_threads(work: "Eagle3Draft | int") -> Iterator[int]:
    """Run small offline work on one CPU thread, large work on torch's default. ``work`` is a draft (its hidden x
    intermediate) or a multiply-add count per row (e.g. hidden x vocab for the target's logits); below
    :data:`SMALL_DRAFT_MACS` one thread is used: such per-op work is far below what torch's intra-op threads need to
    pay for their synchronisation, and on a loaded machine (an SGLang server's own processes beside it) each op then
    waits for a second core (measured: 48 sequences x 4 TTT steps of the 128-wide reference draft, 134 s on 2 threads
    against 4 s on 1 at load 18 on 2 cores; bench/RESULTS.md). Yields the thread count used."""
    old = torch.get_num_threads()
    if isinstance(work, Eagle3Draft):
        small = work.device.type == "cpu" and work.arch.hidden * work.arch.intermediate < SMALL_DRAFT_MACS
    else:
        small = int(work) < SMALL_DRAFT_MACS
    n = 1 if small else old
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(old)
