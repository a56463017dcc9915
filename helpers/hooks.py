"""Forward hooks that SGLang loads through its own ``--forward-hooks`` flag: per-rank capture and
fault injection on the tensors the target feeds the EAGLE-3 draft.

How SGLang runs them (``sglang/srt/model_executor/hook_manager.py::register_forward_hooks``, called
from ``model_runner_components/cuda_graph_setup.py::finalize_cuda_graph_capture`` for the target
*and* the draft model runner of every TP rank): each spec ``{"name", "target_modules": [glob...],
"hook_factory": "helpers.hooks:<factory>", "config": {...}}`` calls ``factory(config)`` once per
model and registers the returned hook with ``module.register_forward_hook`` on every module whose
name matches. Hooks fire only on the eager path (the reference server runs without CUDA graphs;
on a GPU server add ``--disable-cuda-graph``).

What this module relies on, verified in SGLang 0.5.23 (``sglang/srt/models/llama.py``,
``sglang/srt/layers/logits_processor.py``, ``sglang/srt/layers/vocab_parallel_embedding.py``) and by
probing the running reference server:

* the target's ``logits_processor`` is called with ``(input_ids, hidden_states, lm_head,
  forward_batch, aux_hidden_states)`` and returns a ``LogitsProcessorOutput`` whose
  ``hidden_states`` is ``torch.cat(aux_hidden_states, -1)`` ``[tokens, num_aux * H]``; that tensor
  feeds the draft (``speculative/eagle_worker_v2.py``) **and** ``return_hidden_states``. Replacing
  it in a forward hook therefore changes both, exactly like a wiring bug would.
* ``LogitsProcessor.config.architectures`` tells the target (``LlamaForCausalLM``) from the draft
  (``LlamaForCausalLMEagle3``); the target forward always completes (embedding ... logits) before
  the draft forward that consumes it, in the same process.
* ``model.layers.{i}.input_layernorm`` (i >= 1) and ``model.norm`` are called with
  ``(hidden, residual)`` and return ``(normed, residual + hidden)``: element 1 is ``out(i-1)``
  (resp. ``out(n-1)``), the pre-norm residual stream SGLang captures as aux hidden state.
  ``post_attention_layernorm`` element 1 is the residual after the attention add.
* with TP > 1, ``o_proj`` / ``down_proj`` (RowParallelLinear) return **per-rank partial sums**: the
  all-reduce is deferred to the next add-norm. ``VocabParallelEmbedding`` returns the all-reduced
  embedding; its ``_embed_local_shard(input_ids)`` gives this rank's pre-all-reduce embedding
  (rows of ids outside the rank's vocab shard are zero).

The same hook points hold on SGLang 0.5.23's DeepSeek-V2/V3 family (``sglang/srt/models/deepseek_v2.py``), probed
on the running reference server at TP 2 against HF transformers (every ``out(L)``, ``resid_mid(L)`` and the sum over
ranks of every partial equal HF's to ~1e-6 rel): its stage boundaries call ``input_layernorm`` / ``model.norm`` /
``post_attention_layernorm`` as modules with ``(hidden, residual)``
(``sglang/srt/layers/layer_boundary/residual/add_norm.py``). What differs is one :class:`ModelFamily` each
(:func:`model_family`): a MoE layer has no ``mlp.down_proj`` (``DeepseekV2MoE`` with ``reduce_results=False``: the
``mlp`` module's own output is this rank's un-reduced partial, on dense and MoE layers alike); Kimi-K2.5 nests the
text model under ``language_model.`` (``sglang/srt/models/kimi_k25.py::KimiK25ForConditionalGeneration``); and
the aux hidden states reach the logits processor as ONE packed ``[tokens, K * H]`` tensor
(``AuxHiddenStatePacker``, ``sglang/srt/layers/aux_hidden_states.py``) where Llama passes a list of K tensors
(:func:`aux_chunk_count` reads both).

Tensors are stashed per process (one scheduler process = one TP rank) together with a forward
sequence number; a fault or capture hook only uses entries written during the same forward.

Fault names equal the diagnosis finding they cause (DESIGN.md): ``chunk_order``,
``embedding_in_place_of_layer``, ``embedding_not_all_reduced``, ``wrong_layer``, ``layer_offset``,
``tp_partial_sum``, ``rotated_basis``, ``norm_mismatch``, ``nan_or_inf``.

This module must import in SGLang's venv (torch + safetensors only; no suite dependencies).
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch

from .layers.ids import layer_index
from .faults import FAULT_KINDS, Fault  # noqa: F401  (helpers.hooks.Fault is the public path)
from .layers.sglang import target_rule
from .paths import shared_mode

HOOK_PREFIX = "helpers.hooks"
ARM_FILE = "ARMED"  # with armed_by_file, the capture hook writes only while out_dir/ARMED exists
TARGET_ARCH_EXCLUDE = ("Eagle", "MTP", "NextN")


# --------------------------------------------------------------------------- model families
@dataclass(frozen=True)
class ModelFamily:
    """Where one target family keeps, in SGLang's module tree (``named_modules()`` of the model SGLang builds), the
    tensors the stash hooks record, and how its aux hidden states reach the logits processor.

    Module templates take ``{L}`` (0-based decoder layer) and get :attr:`prefix` put in front.

    Attributes:
        name: ``llama`` | ``deepseek`` | ``kimi_k25``.
        prefix: the text model's module prefix (``language_model.`` for a wrapper that nests it).
        embedding: the (vocab-parallel) embedding; its output is the all-reduced embedding.
        layer_input_norm: layer L's input add-norm; its output[1] is ``out(L-1)``.
        final_norm: the final add-norm; its output[1] is ``out(n-1)``.
        post_attention_norm: layer L's post-attention add-norm; output[1] is ``resid_mid(L)``.
        mlp_partial: the module whose output is layer L's MLP output before the TP all-reduce.
        attn_partial: the module whose output is layer L's attention output before the TP all-reduce.
        logits_processor: the target's logits processor (inputs: ids, hidden, lm_head, forward batch, aux).
        aux: ``list`` (one [T, H] tensor per capture) or ``packed`` (one [T, K*H] tensor), as SGLang passes them.
        source: the SGLang file the names were read from.
    """

    name: str
    source: str
    prefix: str = ""
    embedding: str = "model.embed_tokens"
    layer_input_norm: str = "model.layers.{L}.input_layernorm"
    final_norm: str = "model.norm"
    post_attention_norm: str = "model.layers.{L}.post_attention_layernorm"
    mlp_partial: str = "model.layers.{L}.mlp.down_proj"
    attn_partial: str = "model.layers.{L}.self_attn.o_proj"
    logits_processor: str = "logits_processor"
    aux: str = "list"

    def module(self, part: str, layer: Optional[int] = None) -> str:
        """The full module name of ``part`` (a field name above), for decoder layer ``layer``."""
        return self.prefix + getattr(self, part).format(L=layer)


LLAMA = ModelFamily("llama", "sglang/srt/models/llama.py (LlamaModel, LlamaDecoderLayer, LlamaMLP.down_proj, "
                             "AuxHiddenStateList)")
DEEPSEEK = ModelFamily("deepseek", "sglang/srt/models/deepseek_v2.py (DeepseekV2Model, DeepseekV2DecoderLayer: "
                                   "DeepseekV2MoE / DeepseekV2MLP with reduce_results=False; AuxHiddenStatePacker)",
                       mlp_partial="model.layers.{L}.mlp", aux="packed")
KIMI_K25 = ModelFamily("kimi_k25", "sglang/srt/models/kimi_k25.py (KimiK25ForConditionalGeneration.language_model = "
                                   "DeepseekV3ForCausalLM) + deepseek_v2.py",
                       prefix="language_model.", mlp_partial="model.layers.{L}.mlp", aux="packed")

#: the SGLang model file of a target (the 0.5.23 architecture table's ``file``) -> its module family; every other
#: registered target is taken to be Llama-shaped (verified on llama.py only)
FAMILY_BY_FILE = {"sglang/srt/models/deepseek_v2.py": DEEPSEEK, "sglang/srt/models/kimi_k25.py": KIMI_K25}


def model_family(architectures: Optional[list[str]] = None, model_type: Optional[str] = None) -> ModelFamily:
    """The :class:`ModelFamily` of a target config's ``architectures`` / ``model_type`` (SGLang 0.5.23's model file
    for it, :func:`helpers.layers.sglang.target_rule`); :data:`LLAMA` for any other or unknown architecture."""
    source = target_rule(architectures, model_type).source      # "sglang/srt/models/<file>.py::<Class>.<method>"
    return FAMILY_BY_FILE.get(source.split("::", 1)[0].split(" ", 1)[0], LLAMA)


def aux_chunk_count(aux: Any, hidden_states: torch.Tensor) -> int:
    """How many H-wide aux chunks the logits processor received: ``len(aux)`` for a list
    (``AuxHiddenStateList``), ``aux.shape[-1] // H`` for one packed ``[T, K*H]`` tensor (``AuxHiddenStatePacker``),
    where H is the width of ``hidden_states`` (the final hidden states, ``[T, H]``); 0 for None / empty. Mirrors
    ``sglang/srt/layers/aux_hidden_states.py::pack_aux_hidden_states`` (the two representations of 0.5.23)."""
    if aux is None:
        return 0
    if isinstance(aux, torch.Tensor):
        h = int(hidden_states.shape[-1]) if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() else 0
        return aux.shape[-1] // h if h and aux.dim() == 2 else 0
    return len(aux)



# --------------------------------------------------------------------------- per-process stash
class _Stash:
    def __init__(self) -> None:
        self.seq = 0  # incremented by the embedding hook: one value per model forward
        self.tensors: dict[str, tuple[int, torch.Tensor]] = {}
        self.input_ids: Optional[torch.Tensor] = None
        self.forwards = 0  # target forwards seen by the capture hook

    def put(self, key: str, value: torch.Tensor) -> None:
        self.tensors[key] = (self.seq, value.detach().clone())

    def get(self, key: str) -> torch.Tensor:
        seq, value = self.tensors.get(key, (-1, None))
        if value is None or seq != self.seq:
            raise RuntimeError(
                f"eagle3-forensics hook: tensor '{key}' was not recorded during this forward "
                f"(have: {sorted(k for k, (s, _) in self.tensors.items() if s == self.seq)}); "
                "the hook specs lack the stash hook for it (use helpers.hooks.hook_specs)")
        return value

    def current(self) -> dict[str, torch.Tensor]:
        return {k: v for k, (s, v) in self.tensors.items() if s == self.seq}


STASH = _Stash()


def _rank_and_size() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _is_target_logits(module: torch.nn.Module) -> bool:
    archs = getattr(getattr(module, "config", None), "architectures", None) or []
    return bool(archs) and not any(tag in a for a in archs for tag in TARGET_ARCH_EXCLUDE)


# --------------------------------------------------------------------------- stash hooks
def stash_factory(config: dict) -> Any:
    """Hook recording one tensor of the current forward under ``config["tensor"]`` (not ``key``: a field named
    ``key`` reads as a secret to redaction, which would then scrub its value, e.g. "embedding", from every string of
    ``/server_info``; ``key`` is still read from older specs).

    ``config["pick"]``: ``"output"`` (the module output), ``"output[1]"`` (second element, the
    residual of a fused add-norm), or ``"embedding"`` (for ``model.embed_tokens``: records the
    all-reduced output as ``embedding``, this rank's pre-all-reduce ``embedding_local``, the
    input ids, and starts a new forward sequence number).
    """
    key = config.get("tensor", config.get("key"))
    pick = config.get("pick", "output")

    def hook(module, inputs, output):
        if pick == "embedding":
            STASH.seq += 1
            ids = inputs[0]
            STASH.input_ids = ids.detach().clone()
            STASH.put("embedding", output)
            local = getattr(module, "_embed_local_shard", None)
            if local is not None and _rank_and_size()[1] > 1:
                with torch.no_grad():
                    STASH.put("embedding_local", local(ids))
            else:
                STASH.put("embedding_local", output)
            return None
        if pick == "output[1]":
            if not isinstance(output, (tuple, list)) or len(output) < 2:
                return None  # e.g. a norm called without residual (first layer, draft)
            value = output[1]
        else:
            value = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(value, torch.Tensor):
            STASH.put(key, value)
        return None

    return hook


# --------------------------------------------------------------------------- faults
def _orthogonal(h: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(h, h, generator=g, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r))[None, :]
    return q.to(dtype)


def apply_fault(fault: Fault, chunks: list[torch.Tensor], stash: Optional[_Stash] = None,
                rank: int = 0, tp: int = 1) -> list[torch.Tensor]:
    """Return the aux chunks (each ``[tokens, H]``) with ``fault`` applied.

    Pure function of its inputs except for stashed tensors (``embedding``, ``out(L)``, ...);
    shapes and dtypes are preserved so nothing downstream crashes, as with a real wiring bug.
    """
    stash = stash or STASH
    out = list(chunks)
    c = fault.chunk
    like = chunks[c] if c is not None else chunks[0]

    def fetch(key: str) -> torch.Tensor:
        value = stash.get(key)
        if value.shape != like.shape:
            raise RuntimeError(f"stashed '{key}' has shape {tuple(value.shape)}, aux chunk has "
                               f"{tuple(like.shape)}")
        return value.to(like.dtype)

    k = fault.kind
    if k == "chunk_order":
        if sorted(fault.order) != list(range(len(chunks))):
            raise ValueError(f"chunk_order {fault.order} is not a permutation of "
                             f"{list(range(len(chunks)))}")
        out = [chunks[i] for i in fault.order]
    elif k == "embedding_in_place_of_layer":
        out[c] = fetch("embedding")
    elif k == "embedding_not_all_reduced":
        out[c] = fetch("embedding_local")
    elif k == "wrong_layer":
        out[c] = fetch(f"out({fault.layer})")
    elif k == "layer_offset":
        out = [fetch(f"out({L + fault.shift})") for L in fault.layers]
    elif k == "tp_partial_sum":
        # rank r holds residual/tp + its own un-reduced MLP partial: per-rank values differ and
        # sum over ranks to out(L) exactly (the reduced MLP output is the sum of the partials).
        out[c] = fetch(f"resid_mid({fault.layer})") / tp + fetch(f"mlp_partial({fault.layer})")
    elif k == "rotated_basis":
        q = _orthogonal(like.shape[-1], fault.seed, torch.float32)
        out[c] = (like.to(torch.float32) @ q).to(like.dtype)
    elif k == "norm_mismatch":
        x = like.to(torch.float32)
        out[c] = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + fault.eps)).to(like.dtype)
    elif k == "nan_or_inf":
        x = like.clone()
        x[:: max(1, fault.every)] = float("nan")
        out[c] = x
    return out


def fault_factory(config: dict) -> Any:
    """Hook for the target's ``logits_processor`` replacing its aux hidden states.

    ``config["faults"]``: list of :class:`Fault` dicts applied in order. The draft's logits
    processor is left untouched.
    """
    faults = [Fault(**f) for f in config.get("faults", [])]

    def hook(module, inputs, output):
        if not faults or not _is_target_logits(module):
            return None
        hs = getattr(output, "hidden_states", None)
        aux = inputs[4] if len(inputs) > 4 else None
        n = aux_chunk_count(aux, inputs[1] if len(inputs) > 1 else None)
        if n == 0 and hs is not None and hs.dim() == 2 and len(inputs) > 1 and isinstance(inputs[1], torch.Tensor) \
                and hs.shape[-1] == inputs[1].shape[-1]:
            n = 1        # no aux (EAGLE / NEXTN): the one H-wide state is the target's final hidden state, the chunk
        if hs is None or hs.dim() != 2 or n == 0:
            return None
        h = hs.shape[1] // n
        chunks = list(hs.split(h, dim=1))
        rank, tp = _rank_and_size()
        for fault in faults:
            chunks = apply_fault(fault, chunks, STASH, rank, tp)
        output.hidden_states = torch.cat(chunks, dim=1).contiguous()
        return output

    return hook


def perturb_factory(config: dict) -> Any:
    """Hook that alters a module's output inside the engine: ``output * scale + noise * rms(output) * N(0, 1)``
    (a fixed ``seed`` per call count). Registered on a draft module (e.g. ``model.fc`` of the EAGLE-3 draft, which the
    target does not have) it makes the engine compute the draft differently after the capture point, which no aux
    hidden state shows: the acceptance budget's engine stage must find it. Tensor outputs only; tuples: element 0."""
    scale = float(config.get("scale", 1.0))
    noise = float(config.get("noise", 0.0))
    gen = torch.Generator().manual_seed(int(config.get("seed", 0)))

    def hook(module, inputs, output):
        t = output[0] if isinstance(output, tuple) else output
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return None
        x = t * scale
        if noise:
            rms = t.float().pow(2).mean(-1, keepdim=True).sqrt()
            x = x + (noise * rms * torch.randn(t.shape, generator=gen)).to(t.dtype)
        return (x,) + tuple(output[1:]) if isinstance(output, tuple) else x

    return hook


# --------------------------------------------------------------------------- per-rank capture
def _atomic_save(tensors: dict[str, torch.Tensor], path: str) -> None:
    # lazy: this module is imported by every SGLang TP worker; only capturing ones write
    from safetensors.torch import save_file

    d = os.path.dirname(path)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    os.close(fd)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, tmp)
    os.chmod(tmp, shared_mode())       # safetensors writes 0600; the capture lands in a shared run folder
    os.replace(tmp, path)


def capture_factory(config: dict) -> Any:
    """Hook for the target's ``logits_processor`` writing one file per target forward per rank.

    ``config``: ``out_dir`` (folder; files go to ``out_dir/rank{r}/fwd{n:06d}.safetensors``),
    ``keys`` (stash keys to save, default all recorded this forward), ``max_forwards``
    (default 512), ``armed_by_file`` (write only while ``out_dir/ARMED`` exists, so a long-running
    server records just the forwards of a capture). Each file holds ``input_ids`` ``[T]``, ``positions`` ``[T]``, ``aux`` = the
    aux hidden states the draft receives (after any fault) ``[T, num_aux*H]``, and the stashed
    tensors ``[T, H]``; ``rank{r}/index.jsonl`` lists forwards with their forward mode.
    """
    out_dir = config["out_dir"]
    keys = config.get("keys")
    max_forwards = int(config.get("max_forwards", 512))
    arm = os.path.join(out_dir, ARM_FILE) if config.get("armed_by_file") else None

    def hook(module, inputs, output):
        if not _is_target_logits(module):
            return None
        if STASH.forwards >= max_forwards or (arm is not None and not os.path.exists(arm)):
            return None
        rank, tp = _rank_and_size()
        fb = inputs[3] if len(inputs) > 3 else None
        tensors = {"input_ids": inputs[0]}
        positions = getattr(fb, "positions", None)
        if isinstance(positions, torch.Tensor):
            tensors["positions"] = positions
        hs = getattr(output, "hidden_states", None)
        if isinstance(hs, torch.Tensor):
            tensors["aux"] = hs
        for key, value in STASH.current().items():
            if keys is None or key in keys:
                tensors[key] = value
        n = STASH.forwards
        STASH.forwards += 1
        mode = getattr(getattr(fb, "forward_mode", None), "name", None)
        write_forward(out_dir, rank, tp, n, tensors, mode, int(inputs[0].shape[0]))
        return None

    return hook


def write_forward(out_dir: str, rank: int, tp: int, n: int, tensors: dict[str, torch.Tensor], mode: Optional[str],
                  tokens: int, prefix: str = "fwd") -> str:
    """Write one recorded forward of TP rank ``rank``: ``out_dir/rank{rank}/{prefix}{n:06d}.safetensors`` (atomic) and
    its line in ``out_dir/rank{rank}/index.jsonl`` (``forward``, ``file``, ``mode``, ``tokens``, ``tp_rank``,
    ``tp_size``, ``keys``): the one capture-folder format :func:`helpers.capture.read_rank_capture` reads, written by
    the SGLang hooks here and by the vLLM worker extension (``helpers.engines.vllm_worker``). Returns the file's
    path."""
    path = os.path.join(out_dir, f"rank{rank}", f"{prefix}{n:06d}.safetensors")
    _atomic_save(tensors, path)
    with open(os.path.join(out_dir, f"rank{rank}", "index.jsonl"), "a") as fh:
        fh.write(json.dumps({"forward": n, "file": os.path.basename(path), "mode": mode,
                             "tokens": int(tokens), "tp_rank": rank,
                             "tp_size": tp, "keys": sorted(tensors)}) + "\n")
    return path


# --------------------------------------------------------------------------- spec builder
_RESID_RE = re.compile(r"^resid_mid\((\d+)\)$")
_MLP_RE = re.compile(r"^mlp_partial\((\d+)\)$")
_ATTN_RE = re.compile(r"^attn_partial\((\d+)\)$")


def _stash_spec(key: str, num_layers: int, family: ModelFamily = LLAMA) -> dict:
    """The SGLang hook spec that records stash ``key`` on the target (module names of ``family``)."""
    if key in ("embedding", "embedding_local"):
        module, pick = family.module("embedding"), "embedding"
    elif (L := layer_index(key)) is not None and L >= 0:
        if not 0 <= L < num_layers:
            raise ValueError(f"{key}: layer outside 0..{num_layers - 1}")
        module = family.module("final_norm") if L == num_layers - 1 else family.module("layer_input_norm", L + 1)
        pick = "output[1]"
    elif m := _RESID_RE.match(key):
        module, pick = family.module("post_attention_norm", int(m.group(1))), "output[1]"
    elif m := _MLP_RE.match(key):
        module, pick = family.module("mlp_partial", int(m.group(1))), "output"
    elif m := _ATTN_RE.match(key):
        module, pick = family.module("attn_partial", int(m.group(1))), "output"
    else:
        raise ValueError(f"unknown stash key '{key}' (embedding, embedding_local, out(L), "
                         "resid_mid(L), mlp_partial(L), attn_partial(L))")
    return {"name": f"e3f-stash-{key}", "target_modules": [module],
            "hook_factory": f"{HOOK_PREFIX}:stash_factory", "config": {"tensor": key, "pick": pick}}


def every_layer_keys(num_layers: int) -> list[str]:
    """Stash keys of every decoder layer's residual stream: ``embedding`` (all-reduced), ``embedding_local``
    (this rank's shard before the all-reduce), ``out(0)`` .. ``out(n-1)`` (pre-norm, after each layer's
    all-reduce: the stream SGLang's aux capture reads). For :func:`helpers.capture.capture_every_layer`."""
    return ["embedding", "embedding_local"] + [f"out({L})" for L in range(int(num_layers))]


@dataclass
class CaptureConfig:
    """Per-rank capture: which stash ``keys`` to write into ``out_dir`` (see capture_factory)."""

    out_dir: str
    keys: list[str] = field(default_factory=lambda: ["embedding", "embedding_local"])
    max_forwards: int = 512
    armed_by_file: bool = False


def hook_specs(faults: list[Fault | dict] = (), capture: Optional[CaptureConfig] = None, *,
               num_layers: int, family: Optional[ModelFamily] = None) -> list[dict]:
    """The ``--forward-hooks`` list for faults and/or per-rank capture on a target.

    Args:
        faults: :class:`Fault` objects or dicts, applied in order to the aux hidden states.
        capture: per-rank capture settings, or None.
        num_layers: the target's ``num_hidden_layers`` (to place ``out(n-1)`` on ``model.norm``).
        family: the target's :class:`ModelFamily` (:func:`model_family` of its config; default :data:`LLAMA`).
    Returns: JSON-serialisable hook specs for ``helpers.server.embedded.start(forward_hooks=...)`` or
        ``--forward-hooks`` on a GPU server (which must then run with ``--disable-cuda-graph``).
    """
    faults = [f if isinstance(f, Fault) else Fault(**f) for f in faults]
    keys = ["embedding"]  # the embedding hook also advances the forward sequence number
    for f in faults:
        keys += f.stash_keys()
    if capture is not None:
        keys += list(capture.keys)
    family = family or LLAMA
    specs, seen = [], set()
    for key in keys:
        spec = _stash_spec(key, num_layers, family)
        if spec["target_modules"][0] == family.module("embedding"):
            spec = _stash_spec("embedding", num_layers, family)
        if spec["name"] in seen:
            continue
        seen.add(spec["name"])
        specs.append(spec)
    logits = family.module("logits_processor")
    if faults:
        specs.append({"name": "e3f-faults", "target_modules": [logits],
                      "hook_factory": f"{HOOK_PREFIX}:fault_factory",
                      "config": {"faults": [asdict(f) for f in faults]}})
    if capture is not None:
        specs.append({"name": "e3f-capture", "target_modules": [logits],
                      "hook_factory": f"{HOOK_PREFIX}:capture_factory",
                      "config": {"out_dir": os.fspath(capture.out_dir), "keys": list(capture.keys) + ["aux"],
                                 "max_forwards": capture.max_forwards,
                                 "armed_by_file": capture.armed_by_file}})
    return specs
