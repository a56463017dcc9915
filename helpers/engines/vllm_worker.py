"""A vLLM worker extension that reports what the engine really loaded and records the tensors it feeds the EAGLE-3
draft, on every TP rank. It runs INSIDE vLLM's worker processes, through vLLM's own mechanisms:

* ``--worker-extension-cls helpers.engines.vllm_worker.CaptureExtension`` makes vLLM add this class to its worker's
  bases (``vllm/v1/worker/worker_base.py::WorkerWrapperBase.init_worker``, 0.32.0), so its ``e3f_*`` methods can be
  called on every TP rank through ``collective_rpc``;
* ``POST /collective_rpc {"method": "e3f_describe"|"e3f_capture_start"|"e3f_capture_stop", "args": [json]}`` is the
  API server's route for that (``vllm/entrypoints/serve/dev/rpc/api_router.py::collective_rpc``, registered only
  with ``VLLM_SERVER_DEV_MODE=1``, ``vllm/entrypoints/launchers/api_server/routers.py``); the answer is
  ``{"results": [one dict per rank]}``.

What is recorded while a capture is armed (``e3f_capture_start`` .. ``e3f_capture_stop``), one file per call, in the
capture-folder format of :func:`helpers.hooks.write_forward` (``rank{r}/index.jsonl`` + safetensors):

* ``fwd{n}``: a forward hook on the target model (``LlamaForCausalLM`` of ``vllm/model_executor/models/llama.py``,
  whose ``forward`` returns its decoder stack's ``(hidden_states, aux_hidden_states)``; a hook on the decoder stack
  ``model.model`` itself would never fire: ``@support_torch_compile`` gives it a ``__call__`` that calls ``forward``
  directly, ``vllm/compilation/decorators.py``): ``input_ids`` [T], ``positions`` [T] and ``aux`` [T, k*H] =
  ``torch.cat(aux_hidden_states, -1)``. Each aux chunk is
  ``hidden_states + residual`` taken by ``EagleModelMixin._maybe_add_hidden_state`` at loop index i
  (``vllm/model_executor/models/interfaces.py``): in(i), the pre-norm residual stream entering decoder layer i
  (in(0) = the embedding), in ascending id order. ``mode`` is ``EXTEND`` when a request of the batch is still in
  its prompt (``input_batch.num_computed_tokens_cpu < num_prompt_tokens``), else ``DECODE``. With ``layers`` the
  same file also holds ``embedding`` (``model.embed_tokens`` output, all-reduced) and ``out(L)`` for every decoder
  layer L (``layers[L]`` returns ``(hidden_states, residual)``; their sum is the stream leaving layer L, the very sum
  vLLM's aux capture takes), cloned in the hook because vLLM's fused add-norm of the next layer writes into them.
* ``prop{n}``: the arguments of ``drafter.propose`` (``vllm/v1/spec_decode/llm_base_proposer.py::
  SpecDecodeBaseProposer.propose``): ``input_ids`` = ``target_token_ids``, ``positions`` = ``target_positions`` and
  ``aux`` = ``target_hidden_states``, the tensor the draft's ``combine_hidden_states`` (norms, ``fc``) receives:
  what vLLM feeds the draft, after the runner's row selection (``gpu_model_runner.py::propose_draft_token_ids``);
  and what it returned (the draft step trace, :mod:`helpers.draft.trace`): ``proposals`` int64 ``[B, k]`` (the
  draft tokens of each request, target ids, step 1 first), ``sample_rows`` ``[B]`` (the input row each request's
  draft output is sampled from, :func:`_sample_rows`) and ``next_ids`` ``[B]`` (``next_token_ids``: the token the
  draft's sampled row reads, the inputs being shifted left by one). Mode ``DRAFT_INPUT``.

Both are plain Python wrappers or module hooks: they fire on the eager path only (start the server with
``--enforce-eager``; the embedded server does), and they cost nothing while disarmed (nothing is registered).

This module must import in the vLLM venv: torch, safetensors and the standard library, plus :mod:`helpers.hooks`
(which needs no more). Nothing of vLLM is imported at module level.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any, Optional

import torch

from ..hooks import write_forward

#: the collective_rpc method names this extension adds to vLLM's worker (prefixed: vLLM refuses a name its worker has)
METHODS = ("e3f_describe", "e3f_capture_start", "e3f_capture_stop")


def _sample_rows(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The rows of ``drafter.propose``'s input whose draft output is sampled, one per request (int64 ``[B]``): its
    ``token_indices_to_sample`` when given (a padded batch: the last accepted row), else each request's last row
    (``common_attn_metadata.query_start_loc[1:] - 1``), as ``vllm/v1/spec_decode/llm_base_proposer.py::
    SpecDecodeBaseProposer.set_inputs_first_pass`` picks them (``propose(num_speculative_tokens, target_token_ids,
    target_positions, target_hidden_states, next_token_ids, token_indices_to_sample, common_attn_metadata, ...)``,
    0.32.0); None when neither is readable."""
    names = ("next_token_ids", "token_indices_to_sample", "common_attn_metadata")
    got = dict(zip(names, args)) | {n: kwargs[n] for n in names if n in kwargs}
    idx = got.get("token_indices_to_sample")
    if isinstance(idx, torch.Tensor):
        return idx.detach().to(torch.int64).reshape(-1).clone()
    qsl = getattr(got.get("common_attn_metadata"), "query_start_loc", None)
    if isinstance(qsl, torch.Tensor) and qsl.numel() >= 2:
        return (qsl.detach().to(torch.int64).reshape(-1)[1:] - 1).clone()
    return None


def _rank_and_size() -> tuple[int, int]:
    try:
        # lazy: vLLM is only importable inside the server's venv; this module is also imported by the suite's tests
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except Exception:  # noqa: BLE001  (no model-parallel group: a single process)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return torch.distributed.get_rank(), torch.distributed.get_world_size()
        return 0, 1


def _digest(t: Optional[torch.Tensor]) -> Optional[str]:
    if t is None:
        return None
    return hashlib.sha256(t.detach().to("cpu").contiguous().numpy().tobytes()).hexdigest()[:16]


def _tensor_of(obj: Any, name: str) -> Optional[torch.Tensor]:
    v = getattr(obj, name, None)
    if isinstance(v, torch.nn.Parameter):
        return v.data
    return v if isinstance(v, torch.Tensor) else None


def _settings(cfg: Any) -> dict:
    """The engine settings the ablations and the attach read, from the worker's ``VllmConfig`` (0.32.0 names:
    ``config/cache.py::CacheConfig.enable_prefix_caching`` / ``block_size`` / ``cache_hit_alignment_tokens`` (the
    prefix-hit granularity), ``config/scheduler.py::SchedulerConfig.async_scheduling``,
    ``config/speculative.py::SpeculativeConfig.rejection_sample_method`` / ``draft_sample_method``,
    ``config/model.py::ModelConfig.dtype`` / ``max_model_len``, ``config/device.py::DeviceConfig.device_type``)."""
    def get(obj: Any, name: str) -> Any:
        v = getattr(obj, name, None) if obj is not None else None
        return v if isinstance(v, (bool, int, float, str)) or v is None else str(v)
    sc = getattr(cfg, "speculative_config", None)
    mc = getattr(cfg, "model_config", None)
    dtype = get(mc, "dtype")
    return {"enable_prefix_caching": get(getattr(cfg, "cache_config", None), "enable_prefix_caching"),
            "async_scheduling": get(getattr(cfg, "scheduler_config", None), "async_scheduling"),
            "max_num_seqs": get(getattr(cfg, "scheduler_config", None), "max_num_seqs"),
            "block_size": get(getattr(cfg, "cache_config", None), "block_size"),
            "cache_hit_alignment_tokens": get(getattr(cfg, "cache_config", None), "cache_hit_alignment_tokens"),
            "rejection_sample_method": get(sc, "rejection_sample_method"),
            "draft_sample_method": get(sc, "draft_sample_method"),
            "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
            "max_model_len": get(mc, "max_model_len"),
            "device": get(getattr(cfg, "device_config", None), "device_type")}


#: the per-request sampling values :func:`_verify_sampling_check` expands, in the dtypes vLLM's ``SamplingMetadata``
#: holds them (``vllm/v1/sample/metadata.py``: ``temperature`` / ``top_p`` float32, ``top_k`` int32), and the
#: cumulative draft-token counts of three requests (2, 1 and 3 verify rows)
CHECK_VALUES = {"temperature": ([0.5, 1.25, 2.0], "float32"), "top_k": ([5, 40, 7], "int32"),
                "top_p": ([0.9, 0.95, 0.3], "float32")}
CHECK_CU = [2, 3, 6]


def _verify_sampling_check() -> dict:
    """vLLM's own expansion of each request's sampling values to its verify rows, run in this worker process on known
    values: what the rejection sampler divides the target's logits by, and the top-k / top-p it applies, at
    temperature > 0 (``vllm/v1/sample/rejection_sampler.py::apply_sampling_constraints`` calls
    ``expand_batch_to_tokens`` for ``temperature`` (greedy rows replaced by 1), ``top_k`` and ``top_p``; the expand
    kernel is the platform's: on CPU without Triton ``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``, registered
    by ``vllm/platforms/cpu.py::CpuPlatform.register_triton_kernel_overrides``).

    Returns ``{"function", "cu_num_draft_tokens", "fields": {name: {"sent", "expanded", "expected", "equal"}},
    "equal"}`` (``expanded``: what vLLM's function returned, a list of floats or ints; ``equal``: every field
    expanded exactly), or ``{"error": "..."}`` when the function cannot be run here (another vLLM layout)."""
    try:
        from vllm.v1.sample import rejection_sampler as rs  # noqa: PLC0415  # lazy: vLLM exists only in the worker
        cu = torch.tensor(CHECK_CU, dtype=torch.int32)
        n = CHECK_CU[-1]
        counts = [b - a for a, b in zip([0] + CHECK_CU[:-1], CHECK_CU)]
        fields, ok = {}, True
        for name, (values, dtype) in CHECK_VALUES.items():
            x = torch.tensor(values, dtype=getattr(torch, dtype))
            kw = {"replace_from": rs.GREEDY_TEMPERATURE, "replace_to": 1} if name == "temperature" else {}
            got = rs.expand_batch_to_tokens(x, cu, n, **kw).tolist()
            want = [v for v, c in zip(values, counts) for _ in range(c)]
            same = len(got) == len(want) and all(abs(float(g) - float(w)) <= 1e-6 * max(1.0, abs(float(w)))
                                                 for g, w in zip(got, want))
            shown = [float(g) if math.isfinite(float(g)) else str(float(g)) for g in got]   # JSON: no NaN / inf
            fields[name] = {"sent": values, "dtype": dtype, "expanded": shown, "expected": want,
                            "equal": bool(same)}
            ok = ok and same
        return {"function": "vllm.v1.sample.rejection_sampler.expand_batch_to_tokens",
                "cu_num_draft_tokens": CHECK_CU, "fields": fields, "equal": bool(ok)}
    except Exception as exc:  # noqa: BLE001  (reported, never raised: describe must answer)
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def _mode(runner: Any) -> str:
    ib = getattr(runner, "input_batch", None)
    try:
        n = int(ib.num_reqs)
        computed = ib.num_computed_tokens_cpu[:n]
        prompt = ib.num_prompt_tokens[:n]
        return "EXTEND" if bool((computed < prompt).any()) else "DECODE"
    except Exception:  # noqa: BLE001  (another runner layout: say so rather than guess)
        return "UNKNOWN"


class _Capture:
    """One armed capture on this rank: registered hooks, the counter, the stash of the current target forward."""

    def __init__(self, out_dir: str, layers: bool, max_forwards: int) -> None:
        self.out_dir = out_dir
        self.layers = layers
        self.max_forwards = max_forwards
        self.handles: list[Any] = []
        self.stash: dict[str, torch.Tensor] = {}
        self.forwards = 0
        self.proposes = 0
        self.restore: Optional[tuple[Any, bool]] = None


class CaptureExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self`` is the worker (``self.model_runner``)."""

    # ------------------------------------------------------------------ what the engine loaded
    def e3f_describe(self, *_: Any) -> dict:
        """What this rank's engine really built, read from the loaded modules (JSON-able dict):

        ``tp_rank``, ``tp_size``, ``target_class``, ``num_layers``, ``hidden_size``, ``aux_layer_ids`` (the tuple the
        target holds, vLLM convention in(i): ``EagleModelMixin.aux_hidden_state_layers`` as
        ``_set_aux_hidden_state_layers`` kept it: sorted and de-duplicated from 0.30.0, as read before; captured by
        membership in layer order), ``enforce_eager``, ``compilation_mode`` and, when
        a drafter is loaded, ``draft``: class, ``method``, ``num_speculative_tokens``, ``has_own_embed_tokens`` /
        ``has_own_lm_head`` (``vllm/model_executor/models/utils.py::process_eagle_weight``), ``embed_shared`` /
        ``lm_head_shared`` (the draft's module IS the target's: ``llm_base_proposer.py::_maybe_share_embeddings`` /
        ``_maybe_share_lm_head`` decided to share), ``draft_vocab_size``, ``d2t`` (present, size, digest of the
        loaded ``draft_id_to_target_id``, how many entries are non-zero), ``use_aux_hidden_state``,
        ``norm_before_fc``, ``fc_norm``, ``norm_output``, ``num_aux_hidden_states``, ``fc_input_size``;
        ``verify_sampling``: :func:`_verify_sampling_check` (the per-token sampling values the verify step uses at
        temperature > 0, from vLLM's own function on known values)."""
        runner = self.model_runner
        target = runner.get_model()
        inner = getattr(target, "model", None)
        rank, tp = _rank_and_size()
        cfg = runner.vllm_config
        out: dict[str, Any] = {
            "tp_rank": rank, "tp_size": tp, "target_class": type(target).__name__,
            "num_layers": len(getattr(inner, "layers", []) or []),
            "hidden_size": int(cfg.model_config.get_hidden_size()),
            "aux_layer_ids": [int(i) for i in getattr(inner, "aux_hidden_state_layers", ()) or ()],
            "use_aux_hidden_state_outputs": bool(getattr(runner, "use_aux_hidden_state_outputs", False)),
            "enforce_eager": bool(cfg.model_config.enforce_eager),
            "compilation_mode": str(getattr(cfg.compilation_config, "mode", None)),
            "settings": _settings(cfg),
            "verify_sampling": _verify_sampling_check(),
            "draft": None,
        }
        drafter = getattr(runner, "drafter", None)
        dm = getattr(drafter, "model", None)
        if dm is None:
            return out
        sc = cfg.speculative_config
        dinner = getattr(dm, "model", None)
        d2t = _tensor_of(dm, "draft_id_to_target_id")
        t_lm = getattr(target, "lm_head", None)
        t_emb = getattr(inner, "embed_tokens", None)
        out["draft"] = {
            "class": type(dm).__name__,
            "method": getattr(sc, "method", None),
            "model": getattr(sc, "model", None),
            "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None),
            "has_own_embed_tokens": getattr(dm, "has_own_embed_tokens", None),
            "has_own_lm_head": getattr(dm, "has_own_lm_head", None),
            "embed_shared": t_emb is not None and getattr(dinner, "embed_tokens", None) is t_emb,
            "lm_head_shared": t_lm is not None and getattr(dm, "lm_head", None) is t_lm,
            "draft_vocab_size": getattr(getattr(dm, "config", None), "draft_vocab_size", None),
            "d2t": None if d2t is None else {"size": int(d2t.numel()), "digest": _digest(d2t),
                                             "nonzero": int((d2t != 0).sum())},
            "use_aux_hidden_state": getattr(dinner, "use_aux_hidden_state", None),
            "norm_before_fc": getattr(dinner, "norm_before_fc", None),
            "fc_norm": getattr(dinner, "fc_norm", None) is not None,
            "norm_output": getattr(dinner, "norm_output", None),
            "num_aux_hidden_states": getattr(dinner, "num_aux_hidden_states", None),
            "fc_input_size": getattr(dinner, "fc_input_size", None),
        }
        if getattr(sc, "method", None) == "mtp":
            from .vllm_mtp import describe_mtp  # lazy: an MTP head only (pure Python, imports nothing of vLLM)
            out["draft"].update(describe_mtp(drafter))
            heads = [getattr(getattr(layer, "shared_head", None), "head", None)
                     for layer in (getattr(dinner, "layers", None) or {}).values()] if hasattr(
                getattr(dinner, "layers", None), "values") else []
            if t_lm is not None and heads and all(h is not None for h in heads):
                out["draft"]["lm_head_shared"] = all(h is t_lm for h in heads)   # DeepSeek: shared_head.head
        return out

    # ------------------------------------------------------------------ capture
    def e3f_capture_start(self, config: str = "{}") -> dict:
        """Arm a capture on this rank. ``config`` (a JSON string: ``collective_rpc`` passes strings only):
        ``out_dir`` (required; files go to ``out_dir/rank{r}/``), ``layers`` (also record ``embedding`` and every
        ``out(L)``; default false), ``max_forwards`` (default 512). Returns ``{"tp_rank", "armed": true}``.
        An armed capture is replaced (its hooks removed first)."""
        cfg = json.loads(config) if isinstance(config, str) else dict(config)
        self.e3f_capture_stop()
        cap = _Capture(os.fspath(cfg["out_dir"]), bool(cfg.get("layers", False)), int(cfg.get("max_forwards", 512)))
        runner = self.model_runner
        target = runner.get_model()
        inner = target.model
        rank, tp = _rank_and_size()

        def on_start(module, args, kwargs):
            cap.stash = {}

        def on_embed(module, args, output):
            cap.stash["embedding"] = output.detach().clone()

        def on_layer(index):
            def hook(module, args, output):
                hidden, residual = output
                cap.stash[f"out({index})"] = (hidden + residual).detach().clone()
            return hook

        def on_target(module, args, kwargs, output):
            if cap.forwards >= cap.max_forwards:
                return None
            ids = kwargs.get("input_ids", args[0] if args else None)
            pos = kwargs.get("positions", args[1] if len(args) > 1 else None)
            tensors: dict[str, torch.Tensor] = {}
            if isinstance(ids, torch.Tensor):
                tensors["input_ids"] = ids.detach().to(torch.int64)
            if isinstance(pos, torch.Tensor):
                tensors["positions"] = pos.detach().to(torch.int64)
            if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], list) and output[1]:
                tensors["aux"] = torch.cat([t.detach() for t in output[1]], dim=-1)
            tensors.update(cap.stash)
            n = cap.forwards
            cap.forwards += 1
            write_forward(cap.out_dir, rank, tp, n, tensors, _mode(runner), int(tensors["input_ids"].shape[0])
                          if "input_ids" in tensors else 0)
            return None

        cap.handles.append(target.register_forward_pre_hook(on_start, with_kwargs=True))
        cap.handles.append(target.register_forward_hook(on_target, with_kwargs=True))
        if cap.layers:
            cap.handles.append(inner.embed_tokens.register_forward_hook(on_embed))
            for i, layer in enumerate(inner.layers):
                cap.handles.append(layer.register_forward_hook(on_layer(i)))

        drafter = getattr(runner, "drafter", None)
        if drafter is not None and hasattr(drafter, "propose"):
            original = drafter.propose

            def propose(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states, *a, **k):
                if cap.proposes >= cap.max_forwards:
                    return original(num_speculative_tokens, target_token_ids, target_positions,
                                    target_hidden_states, *a, **k)
                n = cap.proposes
                cap.proposes += 1
                tensors = {"input_ids": target_token_ids.detach().to(torch.int64).clone(),
                           "positions": target_positions.detach().to(torch.int64).clone(),
                           "aux": target_hidden_states.detach().clone()}
                rows = _sample_rows(a, k)          # read before propose: it rewrites the attention metadata
                nxt = k.get("next_token_ids", a[0] if a else None)
                out = original(num_speculative_tokens, target_token_ids, target_positions, target_hidden_states,
                               *a, **k)
                if isinstance(out, torch.Tensor) and out.ndim == 2 and rows is not None \
                        and isinstance(nxt, torch.Tensor):
                    tensors.update(proposals=out.detach().to(torch.int64).clone(), sample_rows=rows,
                                   next_ids=nxt.detach().to(torch.int64).reshape(-1).clone())
                write_forward(cap.out_dir, rank, tp, n, tensors, "DRAFT_INPUT", int(target_token_ids.shape[0]),
                              prefix="prop")
                return out

            cap.restore = (drafter, "propose" in vars(drafter))
            drafter.propose = propose
        self._e3f_capture = cap
        return {"tp_rank": rank, "armed": True, "layers": cap.layers}

    def e3f_capture_stop(self, *_: Any) -> dict:
        """Disarm: remove every hook and the ``propose`` wrapper. Returns ``{"tp_rank", "forwards", "proposes"}``
        (what the capture wrote; zeros when none was armed)."""
        cap: Optional[_Capture] = getattr(self, "_e3f_capture", None)
        rank, _ = _rank_and_size()
        if cap is None:
            return {"tp_rank": rank, "forwards": 0, "proposes": 0}
        for h in cap.handles:
            h.remove()
        if cap.restore is not None:
            drafter, own = cap.restore
            if own:                       # an instance attribute before ours: never the case in vLLM 0.32.0
                raise RuntimeError("drafter.propose was an instance attribute before the capture; not restored")
            del drafter.propose           # the class's method again
        self._e3f_capture = None
        return {"tp_rank": rank, "forwards": cap.forwards, "proposes": cap.proposes}
