"""An EAGLE-3 draft checkpoint run offline in pure torch, exactly as SGLang 0.5.23 serves it (the body), with the
tensors the serving engine's loader gives it (below).

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
puts in: :class:`helpers.draft.attention.MLAAttention`. The draft-extend and draft-decode passes run it
weight-absorbed, as SGLang's dispatch does for every draft batch (``deepseek_common/attention_backend_handler.py``:
only a non-speculative extend takes the expanded MHA): ``models/deepseek_common/attention_forward_methods/
forward_mla.py::forward_absorb_prepare`` / ``forward_absorb_core``.

Which tensors the draft runs with -- embedding, lm_head, d2t, and the norms ``norm_before_residual`` / ``fc_norm`` --
is the serving engine's loader rule table (``LoaderRules.TABLE``: SGLang 0.5.23's in :mod:`helpers.draft.checks`,
vLLM 0.32.0's in :mod:`helpers.draft.loader_table`), handed out by the engine adapter (``EngineAdapter.
loader_rules``) and passed to :meth:`Eagle3Draft.load`: on vLLM an own ``embed_tokens`` unlike the target's is kept
(``v1/spec_decode/llm_base_proposer.py::_maybe_share_embeddings``) and ``norm_before_residual`` is read
(``llama_eagle3.py::LlamaDecoderLayer._norm_before_residual``: the first layer's residual is the normed hidden
state). A speculators-format draft (:mod:`helpers.formats.speculators`; only vLLM serves it) runs by default as vLLM
0.32.0 loads it: its flat config (``transformer_layer_config`` + the eagle3 fields; an absent
``norm_before_residual`` read as true).

The architecture picks its attention adapter (:data:`helpers.draft.attention.ATTENTIONS`, by ``architectures[0]`` of
the draft config); the rest of the draft run is the same code for both.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors import safe_open

from ..errors import BadInput
from ..formats.configs import read_draft_config, read_safetensors_index, read_target_config
from ..formats.dumps import PLAIN_FLOAT
from .attention import ATTENTIONS, MLAShape, _mix, _mix_own, _rms, _scores, _scores_own
from ..formats.speculators import EAGLE3_ARCH_MAP
from .loader_table import VLLMLoaderTable
if TYPE_CHECKING:
    from .checks import LoaderRules
from .params import K25, L3, LLAMA_CLASS, SHARD_TENSORS, resolve_name, sglang_parameters, shape_error


#: vLLM's Llama EAGLE-3 draft class, which a speculators-format eagle3 draft with a llama layer config maps to
VLLM_LLAMA_EAGLE3 = EAGLE3_ARCH_MAP["llama"]


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
class DraftArch:
    """The draft's shape as SGLang 0.5.23 builds it from its config.json (``llama_eagle3.py::LlamaModel.__init__``,
    ``kimi_k25_eagle3.py::Eagle3MLAModel.__init__``).

    Attributes: hidden (H), target_hidden (per-chunk width fed to ``fc``), num_aux (chunks), heads, kv_heads,
    head_dim (the MLA draft: its query heads, 1 -- every head attends to the one latent --, ``qk_nope + qk_rope``),
    intermediate, layers, eps, rope_theta, rope_scaling (dict or None), vocab (target vocab), draft_vocab (lm_head
    rows), tie (``tie_word_embeddings``), lm_head_from_target (``draft_vocab_size`` None), norm_before_fc, fc_norm,
    norm_output, fc_bias, max_position (``max_position_embeddings``), architecture (``architectures[0]``: picks the
    attention, :data:`helpers.draft.attention.ATTENTIONS`), mla (:class:`MLAShape` for the MLA draft, else None).
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
    norm_before_residual: bool = False
    architecture: str = LLAMA_CLASS
    mla: Optional[MLAShape] = None

    @classmethod
    def from_config(cls, path: Path, loader: Optional["LoaderRules"] = None) -> "DraftArch":
        """Read ``path`` (draft config.json or its folder); the shapes are the ones SGLang builds
        (:func:`helpers.draft.params.sglang_parameters`: config fields left out get their config class's defaults as
        SGLang's AutoConfig load gives them), the attention's fields from its adapter
        (:data:`helpers.draft.attention.ATTENTIONS`), ``norm_before_residual`` and ``fc_norm`` from the serving
        engine's loader rules (``loader``: ``EngineAdapter.loader_rules``; default :func:`default_loader`).

        Raises:
            BadInput: not an SGLang EAGLE-3 draft this module runs (EAGLE-1 drafts, attention bias, a rope SGLang
                cannot build), a config the engine's loader refuses, or a field of the wrong type.
        """
        dc = read_draft_config(path)
        norms = (loader or default_loader(dc)).draft_norms(dc)
        raw = dc.raw
        arch = (dc.architectures or [""])[0]
        if dc.speculators is not None and dc.speculators.architecture == VLLM_LLAMA_EAGLE3:
            # a speculators-format draft runs as vLLM maps it (helpers.formats.speculators.vllm_view): vLLM's
            # Eagle3LlamaForCausalLM, the same body as SGLang's Llama EAGLE-3 draft plus norm_before_residual
            arch = LLAMA_CLASS
        if arch not in ATTENTIONS:
            raise BadInput(f"architecture {arch!r} is not an EAGLE-3 draft this tool can run offline (expected one of "
                           f"{', '.join(ATTENTIONS)}: {L3}, {K25})", path=dc.path, field="architectures")
        p = sglang_parameters(dc)
        return cls(hidden=dc.hidden_size, target_hidden=p.hidden_size_in, num_aux=p.num_aux,
                   intermediate=p.intermediate, layers=p.layers,
                   eps=float(raw.get("rms_norm_eps") or 1e-6), vocab=p.vocab, draft_vocab=p.draft_vocab,
                   tie=p.tie, lm_head_from_target=p.lm_from_target, norm_before_fc=p.norm_before_fc,
                   fc_norm=norms["fc_norm"], norm_output=p.norm_output, fc_bias=bool(raw.get("bias", False)),
                   norm_before_residual=norms["norm_before_residual"],
                   architecture=arch, **ATTENTIONS[arch].read_config(dc, p))


def default_loader(dc) -> "LoaderRules | VLLMLoaderTable":
    """The loader rules a draft runs under when the caller names no serving engine: vLLM 0.32.0's table for a
    speculators-format draft (only vLLM serves it: :mod:`helpers.formats.speculators`), SGLang 0.5.23's otherwise
    (``EngineAdapter.loader_rules`` of the engine that serves it is what callers with a server pass)."""
    from .checks import LoaderRules      # lazy: checks loads the detectors and the draft checks, not needed otherwise
    return VLLMLoaderTable() if dc.speculators is not None else LoaderRules()


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


#: the weight dtypes the offline run reads as SGLang's unquantised loader does (``default_weight_loader``'s copy_):
#: :data:`helpers.formats.dumps.PLAIN_FLOAT`, the hidden states' too


def _finite(t: torch.Tensor, path: Path, name: str) -> None:
    """Raise :class:`BadInput` naming ``path [name]`` when the weight ``t`` holds NaN or Inf: SGLang would load and
    serve it (every draft logit NaN), so no accept length the offline run gives would say why; or when it is not a
    plain float tensor: an FP8 / integer weight is a quantised checkpoint, whose scales live in a quantization
    config this run does not apply (``sglang/srt/model_loader/weight_utils.py::default_weight_loader`` would copy_
    the raw values into a float parameter, casting them), so any figure computed from it would be of another model."""
    if t.dtype not in PLAIN_FLOAT:
        raise BadInput(f"dtype {str(t.dtype).replace('torch.', '')}: not a plain float weight (a quantised FP8 / "
                       "integer checkpoint, or a mistyped tensor); the offline run reads unquantised float32 / "
                       "bfloat16 / float16 drafts only (dequantise it first, with its scales)", path=path, field=name)
    if not bool(torch.isfinite(t).all()):
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

def _add_rms(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's fused residual add + RMSNorm (``RMSNorm.forward_native`` with ``residual``, as the CUDA
    ``fused_add_rmsnorm`` kernel): the sum is formed in float32 and normalised unrounded; the residual carried on is
    that sum in the input dtype. Returns ``(normed, residual)``, both in ``x``'s dtype."""
    s = x.float() + residual.float()
    return F.rms_norm(s, (s.shape[-1],), w.float(), eps).to(x.dtype), s.to(x.dtype)


@dataclass
class ExtendOutput:
    """The draft-extend pass over one sequence (rows = positions).

    Attributes:
        hidden: ``[T, H]`` the hidden state carried to the next draft step (pre-norm unless ``norm_output``).
        logits: ``[T, V_draft]`` float32 logits over the draft vocabulary.
        kv: per layer, the draft KV cache entry of these rows (:class:`helpers.draft.attention.Attention`: ``(k, v)``
            each ``[T, kv_heads, head_dim]`` for the Llama draft; ``(latent [T, kv_lora], k_pe [T, rope])`` for the MLA
            draft).
    """

    hidden: torch.Tensor
    logits: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: per layer, the keys / values (:meth:`Attention.kv`) in float32 (built once, read by every draft step)
    kv_f32: dict = field(default_factory=dict, repr=False)


class Eagle3Draft:
    """An EAGLE-3 draft (``LlamaForCausalLMEagle3`` or ``Eagle3DeepseekV2ForCausalLM``) with the weights SGLang would
    load, run in pure torch; its attention is the adapter of its architecture
    (:data:`helpers.draft.attention.ATTENTIONS`).

    Build it with :meth:`load`. ``dtype`` is the compute dtype (the server's ``--dtype`` where this device computes it
    natively, else float32: :func:`helpers.draft.precision.choose_dtype`; the embedded CPU server runs ``float32``,
    GPU servers usually ``bfloat16``); norms and softmax are computed in float32 as SGLang's native kernels do.
    """

    #: a subclass that drafts over the target's whole vocabulary (no d2t: EAGLE-1, the MTP heads) names itself here,
    #: as its refusal of a vocab map says it ("an EAGLE-1 draft"); None: an EAGLE-3 draft, which takes one
    WHOLE_VOCAB: Optional[str] = None
    #: a single-state head that reads the target's last decoder layer output BEFORE the final norm (``out(n-1)``: vLLM's
    #: MiMo head, :class:`helpers.draft.mimo_mtp.MiMoMTPHead`) says so here; False: the post-norm state (NextN, EAGLE-1)
    READS_PRE_NORM: bool = False

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
             dtype_reason: str = "", loader: Optional["LoaderRules"] = None) -> "Eagle3Draft":
        """Load the draft of ``draft_dir`` (config.json + safetensors, sharded or not) with the tensors the serving
        engine runs it with, computing in ``dtype`` (pick it with :func:`helpers.draft.precision.choose_dtype`, whose
        reason goes in ``dtype_reason``: ``sources["dtype"]``, the budget document's ``draft_sources``).

        ``loader``: the serving engine's loader rules (``EngineAdapter.loader_rules``; default
        :func:`default_loader`): its ``TABLE`` decides the embedding (SGLang: the target's even when the checkpoint
        carries its own; vLLM: the checkpoint's own unless ``torch.equal`` to the target's), the lm_head, the d2t
        and the norms (``draft_norms``). ``sources`` names each choice and the engine (``sources["loader"]``).

        Only the target's ``embed_tokens`` (and, when the draft borrows it, its ``lm_head``) are read from
        ``target_dir``, through its safetensors index: never the whole target.

        Raises:
            BadInput: unsupported architecture; a tensor the model needs is missing, or its shape does not match the
                config (the file and key are named); the target embedding is needed but ``target_dir`` is None or
                has no ``embed_tokens``; a weight holds NaN / Inf; a draft the engine's loader refuses.
        """
        draft_dir = Path(draft_dir)
        dc = read_draft_config(draft_dir)
        loader = loader or default_loader(dc)
        arch = DraftArch.from_config(draft_dir, loader)
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
                if "lm_head" in key:
                    names["lm_head.weight"] = key      # a tied draft's own lm_head: SGLang drops it, vLLM keeps it
                continue                     # SGLang drops it too (helpers.draft.checks reports it)
            expected = params.params[where][0]
            if tuple(info.shape) != tuple(expected):
                raise shape_error(params, dc, key, info, where[0], where[1], expected)
            filled[where] = (key, info)
        if ("model.embed_tokens.weight", None) in filled:
            names["embed_tokens.weight"] = filled[("model.embed_tokens.weight", None)][0]
        if ("lm_head.weight", None) in filled:
            names["lm_head.weight"] = filled[("lm_head.weight", None)][0]
        index = {k: v.file for k, v in tensors.items()}
        a = arch
        sources: dict = {"draft": str(draft_dir), "dtype": dtype_reason or str(dtype).removeprefix("torch."),
                         "loader": f"{loader.label} {loader.version}"}

        def target_tensor(suffix: str, why: str) -> Optional[tuple[torch.Tensor, str]]:
            if target_dir is None:
                raise BadInput(f"{why}: pass the target folder", field="--target")
            hit = find_target_tensor(Path(target_dir), suffix)
            if hit is None:
                return None
            t = _read_tensor(hit[1], hit[0])
            _finite(t, hit[1], hit[0])
            return t, f"target {hit[1].name}:{hit[0]}"

        own = names.get("embed_tokens.weight")
        mine = _read_tensor(index[own], own) if own is not None else None
        t_embed = None
        if mine is not None and target_dir is not None:
            hit = find_target_tensor(Path(target_dir), "embed_tokens.weight")
            if hit is not None:
                t_embed = (_read_tensor(hit[1], hit[0]), f"target {hit[1].name}:{hit[0]}")
        equal = None if mine is None or t_embed is None else bool(
            mine.shape == t_embed[0].shape and torch.equal(mine.float(), t_embed[0].float()))
        rows = loader.draft_tensors(dc, list(tensors), embed_equal=equal)
        weights: dict[str, torch.Tensor] = {}
        for (param, shard), (shape, _init) in params.params.items():
            if param in ("model.embed_tokens.weight", "lm_head.weight"):
                continue                     # the loader table's choice: below
            if (param, shard) in params.unused:
                continue                     # built, never read by the forward (layers > 0: input_layernorm)
            if (param, shard) not in filled:
                # SGLang keeps the initialised (random / ones) parameter when a name is absent: the draft it serves is
                # then not the trained one. Refuse rather than guess.
                raise BadInput(f"the draft checkpoint has no tensor for {param}{'' if shard is None else f'[{shard}]'} "
                               f"although its config implies one of shape {list(shape)} "
                               f"({ATTENTIONS[arch.architecture].loader} skips missing "
                               "names and serves an untrained parameter)", path=draft_dir,
                               field=_internal_name(param, shard))
            key, info = filled[(param, shard)]
            t = _read_tensor(info.file, key)
            _finite(t, info.file, key)
            weights[_internal_name(param, shard)] = t.to(device=device, dtype=dtype)
        hot = None
        if rows["d2t"] == "checkpoint" and "d2t" in names:
            d2t = _read_tensor(index[names["d2t"]], names["d2t"]).to(torch.long)
            if d2t.ndim != 1 or d2t.shape[0] != a.draft_vocab:
                raise BadInput(f"d2t has shape {list(d2t.shape)}, expected [{a.draft_vocab}] (draft_vocab_size)",
                               path=index[names["d2t"]], field="d2t")
            hot = (d2t + torch.arange(d2t.shape[0])).to(device)
            if int(hot.min()) < 0 or int(hot.max()) >= a.vocab:
                raise BadInput(f"d2t maps draft ids outside the target vocabulary [0, {a.vocab})",
                               path=index[names["d2t"]], field="d2t")
        rule = loader.TABLE["embedding"]
        if rows["embedding"] == "target":
            got = t_embed or target_tensor("embed_tokens.weight", f"the draft uses the target's embedding ({rule})")
            if got is None:
                raise BadInput(f"the target's safetensors hold no '*embed_tokens.weight' (the draft reads the "
                               f"target's embedding: {rule})", path=target_dir)
            embed, sources["embed"] = got
            if got is t_embed:
                _finite(embed, Path(str(target_dir)), "embed_tokens.weight")
            if mine is not None:
                sources["embed"] += (f" ({loader.label} uses it in place of the checkpoint's own {own}"
                                     + (", equal to it)" if equal else ")"))
        else:
            if mine is None:
                raise BadInput(f"{loader.label} keeps the draft's own embedding ({rule}), but the checkpoint has no "
                               "embed_tokens.weight", path=draft_dir, field="embed_tokens.weight")
            _finite(mine, index[own], own)
            embed = mine
            sources["embed"] = (f"draft {index[own].name}:{own}" + (
                f" (not the target's: {loader.label} keeps it)" if t_embed is not None else ""))
        if tuple(embed.shape) != (a.vocab, a.hidden):
            raise BadInput(f"the embedding has shape {list(embed.shape)}, expected [{a.vocab}, {a.hidden}] "
                           "(vocab_size, hidden_size of the draft config)", path=sources["embed"], field="embed_tokens")
        embed = embed.to(device=device, dtype=dtype)
        if rows["lm_head"] == "tied":
            # LogitsProcessor is built with vocab_size = draft_vocab_size and keeps that many logits
            # (layers/logits_processor.py::LogitsProcessor._copy_logits_to_buffer): the first rows of the embedding
            lm_head = embed[: a.draft_vocab]
            sources["lm_head"] = "tied to the embedding (tie_word_embeddings)" + (
                f", its first {a.draft_vocab} rows (draft_vocab_size)" if a.draft_vocab < a.vocab else "")
        elif rows["lm_head"] == "target":
            got = target_tensor("lm_head.weight", f"the draft takes the target's lm_head ({loader.TABLE['lm_head']})")
            if got is None:                                 # a tied target: its embedding is its lm_head
                got = t_embed or target_tensor("embed_tokens.weight", "the draft takes the target's tied embedding")
                lm_head, sources["lm_head"] = got[0].to(device=device, dtype=dtype), "the target's tied embedding"
            else:
                lm_head, sources["lm_head"] = got[0].to(device=device, dtype=dtype), got[1]
            why = (f"draft_vocab_size {'unset' if dc.draft_vocab_size is None else dc.draft_vocab_size}, "
                   f"{'an' if names.get('lm_head.weight') else 'no'} lm_head in the checkpoint")
            sources["lm_head"] += f" ({loader.label}: {why})"
        else:
            key = names.get("lm_head.weight")
            if key is None:
                raise BadInput(f"the draft checkpoint has no lm_head.weight although {loader.label} runs the "
                               f"draft's own ({loader.TABLE['lm_head']}): it would serve the parameter's initial "
                               "values", path=draft_dir, field="lm_head.weight")
            lm_head = _read_tensor(index[key], key)
            _finite(lm_head, index[key], key)
            if tuple(lm_head.shape) != (a.draft_vocab, a.hidden):
                raise BadInput(f"lm_head has shape {list(lm_head.shape)}, expected [{a.draft_vocab}, {a.hidden}] "
                               "(draft_vocab_size, hidden_size)", path=index[key], field=key)
            lm_head, sources["lm_head"] = lm_head.to(device=device, dtype=dtype), f"draft {key}"
        sources["d2t"] = "draft d2t" if hot is not None else "none (draft ids are taken as target ids)"
        return cls(arch, weights, embed, lm_head, hot, dtype=dtype, sources=sources)

    def with_vocab_map(self, d2t: torch.Tensor, source: str) -> "Eagle3Draft":
        """The same draft with another d2t (``hot_token_id = d2t + arange``): a vocab-map fix, run offline.

        Raises:
            BadInput: the draft drafts over the target's whole vocabulary (:attr:`WHOLE_VOCAB`: it has no d2t), or
                ``d2t`` is not ``[draft_vocab]`` or maps outside the target vocabulary."""
        if self.WHOLE_VOCAB:
            raise BadInput(f"{self.WHOLE_VOCAB} drafts over the target's whole vocabulary: it has no d2t", path=source,
                           field="d2t")
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

    def to_draft_id(self, target_id: int) -> int:
        """Target id -> draft-vocab id (the inverse of :meth:`to_target_ids`), -1 for a target id outside the draft's
        vocabulary (no d2t: the same id)."""
        if self.hot_token_id is None:
            return int(target_id)
        hit = (self.hot_token_id == int(target_id)).nonzero()
        return int(hit[0, 0]) if hit.numel() else -1

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
            hn = _rms(h, w[p + "hidden_norm.weight"], a.eps)
            # vLLM llama_eagle3.py::LlamaDecoderLayer._norm_before_residual: the normed state is the residual
            return torch.cat([_rms(embeds, w[p + "input_layernorm.weight"], a.eps), hn], dim=-1), \
                (hn if a.norm_before_residual else h)
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

        Raises:
            BadInput: ``aux`` is not as wide as the draft's fc takes (:meth:`project`), or has not ``T`` rows.
        """
        return self.extend_many(tokens, aux[None], positions)[0]

    @torch.no_grad()
    def extend_many(self, tokens: torch.Tensor, aux: torch.Tensor, positions: Optional[torch.Tensor] = None
                    ) -> list[ExtendOutput]:
        """The draft-extend pass (:meth:`extend`) of one token sequence under ``B`` sets of aux hidden states at once
        (e.g. the same continuation under ``B`` candidate layer plans: :mod:`helpers.draft.plan_id`): the row-wise
        work (embedding, fc, norms, projections, MLP, lm_head) runs on the ``B * T`` rows stacked, the causal
        attention with ``B`` on the batch dim, each set attending only to its own rows (as ``B`` separate requests
        of one draft-extend batch in ``eagle_worker_v2.py::EAGLEWorkerV2._draft_extend``). With ``B`` = 1 it is
        :meth:`extend` itself.

        Args:
            tokens: int64 ``[T]`` target-vocab ids, shared by every set.
            aux: ``[B, T, num_aux * target_hidden]`` (any float dtype).
            positions: int64 ``[T]`` (default 0..T-1).

        Returns:
            ``B`` :class:`ExtendOutput`, one per set (views into the stacked result: ``hidden [T, H]``,
            ``logits [T, V_draft]`` float32, ``kv`` entries of ``T`` rows).

        Raises:
            BadInput: ``aux`` is not ``[B, T, num_aux * target_hidden]``.
        """
        dev = self.device
        tokens, aux = tokens.to(dev), aux.to(dev)
        T = tokens.shape[0]
        if aux.dim() != 3 or aux.shape[1] != T:
            raise BadInput(f"the aux hidden states have shape {list(aux.shape)}, expected [sets, {T}, width] "
                           f"({T} tokens)", field="aux")
        B = aux.shape[0]
        pos = torch.arange(T, device=dev) if positions is None else positions.to(dev)
        pos = pos.repeat(B)
        emb = self.embed[tokens].repeat(B, 1)                                            # [B*T, H]
        h = self.project(aux.reshape(B * T, aux.shape[-1]))
        residual = None
        kv = []
        att = self.attn
        for i in range(self.arch.layers):
            x, residual = self._layer_in(i, emb, h, residual)
            q, entry = att.qkv(i, x, pos)
            kv.append(entry)
            k, v = att.kv(entry)                                                      # [B*T, groups, dk / dv]
            o = F.scaled_dot_product_attention(q.unflatten(0, (B, T)).transpose(1, 2),
                                               k.unflatten(0, (B, T)).transpose(1, 2),
                                               v.unflatten(0, (B, T)).transpose(1, 2), is_causal=True,
                                               scale=att.scale, enable_gqa=k.shape[1] != q.shape[1])
            h, residual = self._layer_out(i, att.out(i, o.transpose(1, 2).flatten(0, 1)), residual)
        hidden, logits = self._finish(h, residual)
        return [ExtendOutput(hidden=hidden[b * T:(b + 1) * T], logits=logits[b * T:(b + 1) * T],
                             kv=[tuple(t[b * T:(b + 1) * T] for t in e) for e in kv]) if B > 1 else
                ExtendOutput(hidden=hidden, logits=logits, kv=kv) for b in range(B)]

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
        per-layer list of entries of ``B`` rows: :class:`helpers.draft.attention.Attention`) and to itself. Scores and
        softmax in float32.

        Returns ``(hidden [B, H], logits [B, V_draft] float32, this step's per-layer cache entries of B rows)``.
        """
        dev = self.device
        tokens, hidden = tokens.to(dev), hidden.to(dev)
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

    def ttt_steps(self, ext: "ExtendOutput", tokens: torch.Tensor, steps: int, start: int = 0
                  ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The teacher-forced unroll after the draft-extend pass ``ext`` over ``tokens`` ``[T]`` (target ids): for
        TTT step ``k`` = 1 .. ``steps`` - 1, every extend row ``t`` from ``start`` whose step-k input token
        ``tokens[t + 1 + k]`` exists takes it and row t's hidden state of step k-1 at position ``t + k``, attending to
        the extend rows up to t and its own earlier steps (:meth:`unroll`; SpecForge's TTT loop,
        ``specforge/core/eagle3.py::OnlineEagle3Model.forward``). Yields ``(k, rows [n] int64, logits [n, V_draft])``
        and stops when no row is left. Used by the drafting replay (:mod:`helpers.draft.simulate`) and the trainers'
        per-step metric (:mod:`helpers.draft.teacher_forced`)."""
        T = int(tokens.shape[0])
        rows = torch.arange(start, max(start, T - 1))
        k = torch.arange(1, max(steps, 1))
        idx = rows[:, None] + 1 + k[None, :]                                    # [R, steps-1]
        inputs = torch.where(idx <= T - 1, tokens[idx.clamp(max=max(T - 1, 0))], torch.full_like(idx, -1))
        yield from self.unroll(ext, rows, inputs)

    def unroll(self, ext: "ExtendOutput", rows: torch.Tensor, inputs: torch.Tensor
               ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The draft decode chain after the draft-extend pass ``ext``, as SGLang's draft loop runs it
        (``eagle_worker_v2.py::EagleDraftWorker.draft_forward``, topk 1): draft step ``k`` (1-based, after the
        extend) of extend row ``rows[j]`` takes the token ``inputs[j, k-1]`` (target ids) and the hidden state of
        step k-1 (the extend row's for k = 1) at position ``rows[j] + k``, attending to the extend rows up to
        ``rows[j]`` and its own earlier steps (:meth:`step`).

        Args:
            ext: the draft-extend pass over the sequence.
            rows: int64 ``[R]`` extend rows (position of the row that proposed step 1).
            inputs: int64 ``[R, K]``; -1 where a row has no input at that step (it then stops; the rows that go on
                at step k must come first: a prefix of ``rows``).
        Yields ``(k, rows [n] int64, logits [n, V_draft] float32)`` for k = 1 .. K (the proposal of draft step
        k + 1) while a row is left. The teacher-forced unroll (:meth:`ttt_steps`) and the served draft's step trace
        (:mod:`helpers.draft.trace`: the served proposals as inputs) are its two uses."""
        hidden, path = ext.hidden[rows], []
        for k in range(1, int(inputs.shape[1]) + 1 if inputs.dim() == 2 else 1):
            n = int((inputs[:, k - 1] >= 0).sum())
            if n == 0:
                return
            path = [[(kk[:n], vv[:n]) for kk, vv in p] for p in path]
            r = rows[:n]
            hidden, logits, kv = self.step(inputs[:n, k - 1], hidden[:n], r + k, r + 1, ext, path)
            path.append(kv)
            yield k, r, logits


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


def target_final_norm(target_dir: str | Path) -> tuple[torch.Tensor, float]:
    """``(model.norm.weight [H] float32, rms_norm_eps)`` of the target folder, read from its safetensors index without
    loading the rest: the final RMSNorm between the last decoder layer's output and lm_head
    (``sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward``, ``llama.py::LlamaModel.forward``).

    Raises:
        BadInput: no ``model.norm.weight`` in the target's safetensors (the folder and field named)."""
    hit = find_target_tensor(Path(target_dir), "model.norm.weight")
    if hit is None:
        raise BadInput("the target's safetensors hold no model.norm.weight (its final norm)", path=target_dir,
                       field="model.norm.weight")
    eps = float(read_target_config(target_dir).raw.get("rms_norm_eps", 1e-6))
    return _read_tensor(hit[1], hit[0]).float(), eps


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
