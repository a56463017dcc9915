"""The draft step trace: a forward hook on the EAGLE-3 draft's ``logits_processor`` inside SGLang's scheduler
processes (loaded through SGLang's own ``--forward-hooks``, as :mod:`helpers.hooks`) recording, per draft forward,
what the served draft proposed.

Why a hook: SGLang 0.5.23's ``return_spec_tokens_details`` returns per-request counters only (accept rate / length,
verify count, histograms: ``sglang/srt/entrypoints/openai/protocol.py::SpecTokensDetails``,
``sglang/srt/entrypoints/openai/utils.py::spec_tokens_details_from_meta_info``), never the proposed tokens.

What is called per verify step (``sglang/srt/speculative/eagle_worker_v2.py``, eager path, chain or tree), each a
call of the draft's ``LogitsProcessor`` (``sglang/srt/models/llama_eagle3.py::LlamaForCausalLMEagle3`` ->
``llama.py::LlamaForCausalLM.forward``) with ``(input_ids, hidden_states, lm_head, forward_batch, aux)``:

* ``EXTEND`` (``EagleDraftWorker._draft_extend_for_prefill``): the prompt, ids rotated left by one (row at position
  ``p`` holds token ``x[p+1]`` with the target's aux state of ``p``); the logits processor keeps the last row per
  request (``layers/logits_processor.py::LogitsProcessor._get_pruned_states``, ``cumsum(extend_seq_lens) - 1``):
  its top-k is the first verify step's **step-1** proposal.
* ``DECODE`` (``EagleDraftWorker.draft_forward``, ``speculative_num_steps - 1`` calls): draft decode step ``i``
  (0-based) at ``positions = seq_lens + i`` (``eagle_worker_common.py::prepare_for_draft``; ``positions.add_(1)``
  after each call), input the previous step's proposal: its top-k is the **step i+2** proposal.
* ``DRAFT_EXTEND_V2`` (``EagleDraftWorker._draft_extend_for_decode``): ``num_draft_tokens`` rows per request after a
  verify (the accepted tokens re-extended with the target's aux states); every row's logits come back and the row
  ``accept_len - 1`` of each request (``select_index``) is the next verify step's **step-1** proposal. The hook reads
  ``forward_batch.spec_info.num_accept_tokens`` (``EagleDraftExtendInput``) to keep that row.

The top-k is taken on the draft vocabulary and mapped to target ids through the hot-token map as the worker does
after its ``fast_topk`` / ``argmax`` (``eagle_worker_v2.py::EagleDraftWorker.draft_forward``:
``topk_index = self.hot_token_id[topk_index]``); ``hot_token_id = d2t + arange`` from the draft checkpoint
(``llama_eagle3.py::LlamaForCausalLMEagle3.load_weights``). The worker's own ``hot_token_id`` is not reachable from
a module hook, so the hook reads ``d2t`` from the draft folder it is given (the one the server loaded).

Every position a file names is the **draft row's** position ``p``: the row holds the token of position ``p + 1`` and
proposes the token of position ``p + 2`` (EXTEND, DECODE and DRAFT_EXTEND_V2 alike).

Files: ``out_dir/rank{r}/trace{n:06d}.safetensors`` + ``rank{r}/index.jsonl`` (:func:`helpers.hooks.write_forward`),
written only while ``out_dir/ARMED`` exists. Tensors: ``positions`` int64 ``[R]`` (the proposing rows),
``input_ids`` int64 ``[R]``, ``topk`` int64 ``[R, k]`` (target ids, best first), ``topk_draft`` int64 ``[R, k]``
(draft ids), ``row_req`` int64 ``[R]`` (the request index in the batch of each row), ``req_pool_indices`` int64
``[bs]``, ``seq_lens`` int64 ``[bs]``. The index line adds ``rids`` (SGLang's request ids, ``ForwardBatch.rids``).

This module must import in SGLang's venv (torch + safetensors only; no suite dependencies).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch

from .hooks import ARM_FILE, _rank_and_size, write_forward

TRACE_HOOK = "e3f-trace-draft"
TRACE_FACTORY = "helpers.trace_hooks:draft_trace_factory"
TRACE_PREFIX = "trace"
#: the draft's logits processor in SGLang's module tree of ``LlamaForCausalLMEagle3`` (the target has one of the same
#: name: the hook keeps only draft calls, by the config's architecture)
TRACE_MODULE = "logits_processor"
DRAFT_ARCH_TAGS = ("Eagle", "MTP", "NextN")


#: how to get the trace when a server runs none
HOW = ("the server runs no draft step trace: start it with `python -m helpers server start --trace-draft DIR` (or "
       "add helpers.trace_hooks.trace_hook_specs(DIR, DRAFT) to --forward-hooks; GPUs: --disable-cuda-graph)")


def trace_dir(info: dict) -> Optional[Path]:
    """The trace folder of a server running this module's hook (its ``/server_info`` ``forward_hooks``: the hook's
    ``config.out_dir``), or None."""
    for h in info.get("forward_hooks") or []:
        if isinstance(h, dict) and str(h.get("hook_factory") or "") == TRACE_FACTORY:
            out = (h.get("config") or {}).get("out_dir") if isinstance(h.get("config"), dict) else None
            if out:
                return Path(out)
    return None


def _is_draft_logits(module: torch.nn.Module) -> bool:
    archs = getattr(getattr(module, "config", None), "architectures", None) or []
    return any(tag in a for a in archs for tag in DRAFT_ARCH_TAGS)


def load_hot_token_id(draft_dir: Optional[str]) -> Optional[torch.Tensor]:
    """``d2t + arange`` of the draft folder's safetensors (the tensor whose name contains ``d2t``), int64, or None
    (no folder, no d2t: draft ids are target ids). Mirrors ``llama_eagle3.py::LlamaForCausalLMEagle3.load_weights``."""
    if not draft_dir:
        return None
    from safetensors import safe_open  # lazy: only a tracing process reads it

    for f in sorted(Path(draft_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if "d2t" in k:
                    d2t = fh.get_tensor(k).to(torch.int64)
                    return d2t + torch.arange(d2t.shape[0])
    return None


def _rows(mode: str, fb: Any, n_logits: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row indices into the forward's tokens, request index of each)`` of the rows whose logits propose a token:
    see the module docstring. Rows are the logits' rows; ``positions`` are the forward's ``[tokens]``."""
    bs = int(fb.batch_size) if getattr(fb, "batch_size", None) is not None else int(fb.seq_lens.shape[0])
    if mode == "EXTEND":
        lens = fb.extend_seq_lens.to(torch.int64).cpu()
        last = torch.cumsum(lens, 0) - 1
        return last, torch.arange(bs)
    if mode == "DRAFT_EXTEND_V2":
        per = n_logits // max(bs, 1)
        acc = getattr(getattr(fb, "spec_info", None), "num_accept_tokens", None)
        if acc is None:
            idx = torch.arange(n_logits)
            return idx, idx // max(per, 1)
        sel = torch.arange(bs) * per + acc.to(torch.int64).cpu() - 1
        return sel, torch.arange(bs)
    idx = torch.arange(n_logits)                    # DECODE: bs * topk rows, request-major
    return idx, idx // max(n_logits // max(bs, 1), 1)


_TRACE_FILE = re.compile(re.escape(TRACE_PREFIX) + r"(\d+)\.safetensors")


def next_trace_number(rank_dir: str) -> int:
    """The number of the next trace file in ``rank_dir``: one past the highest ``trace<n>.safetensors`` there (0 in a
    new folder). A folder that already holds a trace (an earlier server's, a restarted copy's) is continued, never
    renumbered from 0: its files and index lines keep pointing at what they recorded, and the readers take the lines
    after the count they saw before arming (:func:`helpers.draft.trace.trace_counts`)."""
    try:
        names = os.listdir(rank_dir)
    except OSError:
        return 0
    return max((int(m.group(1)) + 1 for f in names if (m := _TRACE_FILE.fullmatch(f))), default=0)


def draft_trace_factory(config: dict) -> Any:
    """Hook for the draft's ``logits_processor`` writing one trace file per draft forward per rank (see the module
    docstring). ``config``: ``out_dir``, ``topk`` (ids kept per row, default 4), ``max_forwards`` (default 100000),
    ``draft_dir`` (where ``d2t`` is read), ``armed_by_file`` (default True). Files are numbered on after those
    already in the rank folder (:func:`next_trace_number`); ``max_forwards`` counts this process's. An error while
    recording never reaches the server: it is written once to ``out_dir/ERROR`` and the trace stays off in that
    process (the probes then find no records and say so)."""
    out_dir = config["out_dir"]
    k_keep = int(config.get("topk", 4))
    max_forwards = int(config.get("max_forwards", 100000))
    arm = os.path.join(out_dir, ARM_FILE) if config.get("armed_by_file", True) else None
    state = {"n": 0, "next": None, "hot": None, "hot_read": False}

    def hook(module, inputs, output):
        if not _is_draft_logits(module) or state["n"] >= max_forwards or state.get("failed"):
            return None
        if arm is not None and not os.path.exists(arm):
            return None
        try:
            return _record(inputs, output)
        except Exception as exc:              # never take the server down: say why once, then stay off
            state["failed"] = True
            try:
                os.makedirs(out_dir, exist_ok=True)
                with open(os.path.join(out_dir, "ERROR"), "a") as fh:
                    fh.write(f"helpers.trace_hooks: {type(exc).__name__}: {exc}; the trace is off in this process\n")
            except OSError:
                pass
            return None

    def _record(inputs, output):
        logits = getattr(output, "next_token_logits", None)
        fb = inputs[3] if len(inputs) > 3 else None
        mode = getattr(getattr(fb, "forward_mode", None), "name", None)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or mode not in (
                "EXTEND", "DECODE", "DRAFT_EXTEND_V2"):
            return None
        if not state["hot_read"]:
            state["hot"], state["hot_read"] = load_hot_token_id(config.get("draft_dir")), True
        rank, tp = _rank_and_size()
        positions = fb.positions.detach().to("cpu", torch.int64).clone()
        ids = inputs[0].detach().to("cpu", torch.int64).clone()
        with torch.no_grad():
            rows, req = _rows(mode, fb, int(logits.shape[0]), positions)
            if int(logits.shape[0]) == int(positions.shape[0]):
                sel_logits = logits[rows.to(logits.device)]  # every row's logits (DECODE, DRAFT_EXTEND_V2 eager)
            elif int(logits.shape[0]) == int(rows.shape[0]):
                sel_logits = logits                          # already the proposing rows (EXTEND: the last per request)
            else:
                return None                                  # a layout this hook does not know: record nothing
            top = sel_logits.float().topk(min(k_keep, int(logits.shape[-1])), dim=-1).indices.to("cpu", torch.int64)
        tok_rows = rows
        hot = state["hot"]
        tgt = hot[top] if hot is not None else top.clone()     # no d2t: its own tensor (safetensors refuses sharing)
        tensors = {"positions": positions[tok_rows], "input_ids": ids[tok_rows], "topk": tgt, "topk_draft": top,
                   "row_req": req.to(torch.int64),
                   "req_pool_indices": fb.req_pool_indices.detach().to("cpu", torch.int64),
                   "seq_lens": fb.seq_lens.detach().to("cpu", torch.int64)}
        if state["next"] is None:      # numbered on after the files there: an earlier trace is never overwritten
            state["next"] = next_trace_number(os.path.join(out_dir, f"rank{rank}"))
        n = state["next"]
        state["next"] += 1
        state["n"] += 1
        write_forward(out_dir, rank, tp, n, tensors, mode, int(positions.shape[0]), prefix=TRACE_PREFIX)
        rids = getattr(fb, "rids", None)
        if rids is not None:
            with open(os.path.join(out_dir, f"rank{rank}", "rids.jsonl"), "a") as fh:
                fh.write(json.dumps({"forward": n, "rids": [str(r) for r in rids]}) + "\n")
        return None

    return hook


def trace_hook_specs(out_dir: str | os.PathLike, draft_dir: Optional[str | os.PathLike] = None, *,
                     topk: int = 4) -> list[dict]:
    """The ``--forward-hooks`` spec of the draft step trace writing into ``out_dir`` (armed by ``out_dir/ARMED``);
    ``draft_dir``: the served draft folder (its ``d2t``). For ``server start --trace-draft DIR`` and
    :func:`helpers.capture.server_hook_specs`."""
    return [{"name": TRACE_HOOK, "target_modules": [TRACE_MODULE], "hook_factory": TRACE_FACTORY,
             "config": {"out_dir": os.fspath(Path(out_dir).resolve()), "topk": int(topk), "armed_by_file": True,
                        "draft_dir": None if draft_dir is None else os.fspath(Path(draft_dir).resolve())}}]
