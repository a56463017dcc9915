"""Engine-state faults for tests only: SGLang ``--forward-hooks`` factories that break the engine *after* the aux
hidden states are captured, in a condition a cold greedy probe never sees. They are test fixtures: nothing in
``helpers/`` names them, no flag of the tool reaches them; a test passes them to the embedded server with
``forward_hooks=[spec(...)]``.

What they rely on, in SGLang 0.5.23 (read in the installed package):

* the EAGLE draft's prefill extend runs in ``ForwardMode.EXTEND`` on the draft's own model runner and KV pool with the
  target's ``req_to_token`` slots (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.
  _draft_extend_for_prefill``: "the draft writes the same slots"); the decode-side draft extend is
  ``ForwardMode.DRAFT_EXTEND_V2``. ``forward_batch.extend_prefix_lens`` > 0 in an EXTEND means the request's first
  tokens were already in the KV: a prefix-cache hit, or a later chunk of a chunked prefill;
* the draft's inner ``model`` (``sglang/srt/models/llama_eagle3.py::LlamaModel.forward(input_ids, positions,
  forward_batch, ...)``, called as a module by ``LlamaForCausalLMEagle3.forward``) receives the forward batch as its
  third argument (the root modules' ``forward`` is called directly by the runner,
  ``sglang/srt/model_executor/runner/eager_runner.py``, so hooks on them never fire); the forward batch carries no
  pool, the forward's attention backend does (``sglang/srt/model_executor/forward_context.py::get_attn_backend``, as
  ``sglang/srt/layers/radix_attention.py`` reads it; ``sglang/srt/layers/attention/intel_amx_backend.py::
  IntelAMXAttnBackend.__init__``:
  ``token_to_kv_pool``, ``req_to_token_pool`` of the runner it serves: the draft's own KV pool), whose ``k_buffer`` /
  ``v_buffer`` hold one ``[slots, heads, head_dim]`` tensor per layer (``sglang/srt/mem_cache/memory_pool.py``);
* the target's ``logits_processor`` gets ``(input_ids, hidden_states, lm_head, forward_batch, ...)`` and returns a
  ``LogitsProcessorOutput`` whose ``next_token_logits`` greedy verification takes the argmax of
  (``sglang/srt/speculative/eagle_utils.py``; ``ForwardMode.TARGET_VERIFY``).

Faults (``config["fault"]``), each with a ``seed`` and a strength:

* ``draft_kv_stale`` (``strength`` 0..1: the share of the cached prefix's draft-KV slots replaced by noise of the
  buffer's own scale): after the draft's prefill extend of a request whose prefix was already in the KV, the draft's
  KV of those slots no longer holds what the draft computed (a cache restore that brought back only the target's KV).
  Cold requests (no prefix) are untouched. The draft is found by its module (``eagle`` / ``nextn`` in its
  path), so a NextN head's ``DeepseekModelNextN`` (``sglang/srt/models/deepseek_nextn.py``, same ``forward(input_ids,
  positions, forward_batch)``) is hit as well, its MLA pool's ``kv_buffer`` replaced (:func:`kv_buffers`).
* ``verify_swap`` (``strength``: the share of verified rows, picked by position): in target verify, the target's two
  best logits of a row are swapped, so verification accepts (and emits) the target's runner-up: speculation is no
  longer lossless.
* ``chunk_boundary_token`` (``strength``: the share of chunk boundaries, picked by the boundary's position;
  ``span``: how many rows from the boundary, 1 by default, 0 the whole chunk): wrong draft input ids from the first
  row of a later chunk of a chunked prefill. The draft's prefill extend feeds the request's input ids shifted left by
  one (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill``: per request
  ``cat(input_ids[1:], tail)``, the tail of a non-final chunk the next prompt token,
  ``sglang/srt/speculative/eagle_utils.py::_eagle_prefill_tail_tokens``); with ``--chunked-prefill-size C`` below
  the prompt length the scheduler prefills C tokens per extend (``sglang/srt/managers/scheduler.py::Scheduler.
  init_chunked_prefill`` reads ``sglang/srt/runtime_context.py::get_schedule().chunked_prefill_size``), so a later
  chunk is an ``EXTEND`` whose ``extend_prefix_lens`` is a multiple of C. The fault: the ``span`` rows from such a
  boundary get the id one position early (the shift lost at the border; the first row's own unshifted id is the
  previous chunk's last token, not in this extend, so it gets a seeded wrong id: with ``span`` 1 exactly "a wrong
  token at the chunk's first row"). The hook (on the draft's inner ``model``, a forward hook: it cannot change the
  input, so it runs ``LlamaModel.forward`` again with those ids, which rewrites the draft KV of those slots, and
  returns that output) touches no other extend: a cold unchunked request (prefix 0) and a prefix-cache hit (a prefix
  that is no multiple of C; a server without chunked prefill has C <= 0) are untouched. Picks and wrong ids are
  hashes of the position and the seed (the same prompt gets the same fault on every run, both TP ranks alike).

* ``embed_current_token`` (``strength``: the share of draft-extend rows hit, :func:`pick` of the row's position):
  the draft's extend rows get the **current** token's id instead of the next one's, the MTP / NextN head fed
  ``enorm(embed(x_t))`` with ``hnorm(h_t)`` where ``embed(x_{t+1})`` belongs (``deepseek_nextn.py::DeepseekModelNextN.
  forward``; an EAGLE-3 draft likewise, ``llama_eagle3.py::LlamaModel.forward``): the left rotation of the ids lost.
  SGLang's prefill draft extend rotates the ids left by one (``eagle_worker_v2.py::EagleDraftWorker.
  _draft_extend_for_prefill``: per request ``cat(input_ids[1:], tail)``), its decode-side draft extend
  (``_draft_extend_for_decode`` -> ``eagle_worker_common.py::prepare_for_draft_extend``, ``DRAFT_EXTEND_V2``) feeds
  ``next_token_ids``, the tokens verification emitted, so the row of position q holds x_{q+1} in both. The fault
  gives a hit row of position q the token x_q: the id of the row before it in the same request's extend (which holds
  x_q), or for a request's first row the id the target's own forward of that extend had at position q (the target's
  ``EXTEND`` / ``TARGET_VERIFY`` input ids, recorded by the same hook on the target's inner ``model``: the prompt
  token, or the verify step's first id); a first row whose x_q was never seen gets a seeded wrong id, as
  ``chunk_boundary_token`` does. Like ``chunk_boundary_token`` it re-runs the draft's inner ``model`` with those
  ids (rewriting the draft KV of the extend's slots) and returns that output; the outer model's ``input_ids`` (what
  the step trace records) are unchanged. ``arm``: a file path; the fault acts only while it exists, and a JSON
  object in it (``{"strength", "seed"}``) replaces the config's (one server, many draws).

Fault factories armed by a file (the draft step trace's faults, ``helpers.draft.trace``):

* :func:`scaled_weights_factory`: the draft's ``fc`` weight (a NextN head's ``eh_proj``, the same place: the linear
  that mixes the target's hidden state into the draft's one layer, :data:`DRAFT_MODULES`) multiplied in place by
  ``scale`` once more than
  ``after_requests`` prefills have been drafted since ``arm`` appeared (a draft damaged after N requests, as an RL
  weight sync or a resume that scrambles the draft would). Two specs share one state: ``mode: "count"`` on the draft's
  ``logits_processor`` (counts ``EXTEND`` forwards' requests and scales the weight; the first damaged request's own
  prefill step is still clean) and ``mode: "fc"`` on ``model.fc`` / ``model.eh_proj`` (only the draft has it:
  records the module).
  ``arm`` None: counting from the server's start (the generated ``draft_decay`` class).
* :func:`kv_wrong_slot_factory`: on the draft's ``model.layers.0.self_attn.attn`` (``RadixAttention``; a NextN
  head's ``model.decoder.self_attn.attn_mqa``, the MLA decode attention of its one layer, :data:`DRAFT_MODULES`), in
  ``DECODE`` forwards only (the draft's decode steps: ``eagle_worker_v2.py::EagleDraftWorker.draft_forward``; the
  target never decodes on a speculative server, it verifies), while ``arm`` exists: the KV this step wrote to its
  slot (``forward_batch.out_cache_loc``) is also written over the slot of the position before it
  (``req_to_token[req, position - 1]``: the last context token's slot for the first decode step), the attention is
  recomputed from the pool (``RadixAttention.forward(..., save_kv_cache=False)``) and the overwritten slot restored
  afterwards. Draft step 1 (the draft-extend rows) is untouched; steps 2 .. see a wrong KV: "draft KV written to
  the wrong slot from step 2". On MLA's pool (``MLATokenToKVPool``) the key buffer is the layer's latent
  ``kv_buffer`` and the value buffer a view of its first ``kv_lora_rank`` columns (``get_key_buffer`` /
  ``get_value_buffer``), so the copy moves the whole latent row. ``strength`` (default 1): the share of decode rows
  it acts on, picked by position;
  only in the draft's decode (``forward_batch.spec_info`` set: ``eagle_worker_v2.py::EagleDraftWorker.
  draft_forward`` reads it; a target decoding alone, the greedy-lossless copy, has none). Pool access through ``sglang/srt/model_executor/forward_context.py::
  get_token_to_kv_pool`` / ``get_req_to_token_pool`` (the forward context every model forward publishes).

The generated ``sampled_verify`` class is the fault of ``tests/support/verify_faults.py`` (at temperature > 0 a draft
is accepted only when an independent sample of the target equals it; greedy batches untouched) loaded with ``arm``
None: on for the server's whole life, on a share ``strength`` of each sampled verify step's rows.

Importable in SGLang's venv: torch only (SGLang itself lazily, inside the hook).
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import torch

from . import verify_faults

FACTORY = "tests.support.engine_faults:factory"


def pick(position: int, seed: int, strength: float) -> bool:
    """Whether the row at ``position`` is hit by a fault of ``strength`` (a share, 0..1) and ``seed``: a fixed hash
    of the two, so a prompt's rows are hit the same way on every request and every TP rank (two arms of a probe see
    the same fault)."""
    h = (int(position) * 2654435761 + int(seed) * 40503 + 12345) % 1000003
    return h < float(strength) * 1000003


def wrong_id(position: int, seed: int, vocab: int, right: int) -> int:
    """A token id other than ``right`` in ``[0, vocab)``, fixed by ``position`` and ``seed``."""
    t = (int(position) * 7919 + int(seed) * 104729 + 17) % int(vocab)
    return t if t != int(right) else (t + 1) % int(vocab)


def boundary_rows(prefix_lens: list[int], seq_lens: list[int], chunk: int | None, *, strength: float,
                  seed: int, span: int = 1) -> list[tuple[int, int]]:
    """The ``(first flat row, rows)`` of an ``EXTEND`` batch that ``chunk_boundary_token`` corrupts: per request
    (``prefix_lens`` tokens already in the KV, ``seq_lens`` tokens extended now, in order) that is a later chunk of a
    chunked prefill (prefix > 0 and a multiple of ``chunk``; ``chunk`` None: any prefix > 0) and that :func:`pick`
    of its position (the prefix length) hits, its first ``span`` rows (0: all of them)."""
    rows, start = [], 0
    for p, n in zip(prefix_lens, seq_lens):
        later = p > 0 and (chunk is None or p % chunk == 0)
        if later and n > 0 and pick(p, seed, strength):
            rows.append((start, n if span <= 0 else min(span, n)))
        start += n
    return rows


def _chunk_size() -> int | None:
    try:
        from sglang.srt.runtime_context import get_schedule  # lazy: only inside SGLang
        c = get_schedule().chunked_prefill_size
    except Exception:  # noqa: BLE001 - another SGLang: act on every later extend
        return None
    return int(c) if c and int(c) > 0 else 0


def kv_buffers(pool: Any) -> list:
    """The per-layer KV tensors of a KV pool: ``k_buffer`` + ``v_buffer`` (``MHATokenToKVPool``: an EAGLE-3 draft's),
    or ``kv_buffer`` (``sglang/srt/mem_cache/memory_pool.py::MLATokenToKVPool``, the latent KV of an MLA layer: a
    DeepSeek-V3 / Kimi NextN head's own decoder layer)."""
    return [b for name in ("k_buffer", "v_buffer", "kv_buffer") for b in (getattr(pool, name, None) or [])]


def spec(fault: str, *, strength: float, seed: int = 0, **extra: Any) -> dict:
    """The ``--forward-hooks`` spec of one fault (the inner ``model`` and the logits processor of both models; the
    hook picks its model); ``extra``: more config (``span`` of ``chunk_boundary_token``)."""
    return {"name": f"e3f-test-{fault}", "target_modules": ["model", "logits_processor"], "hook_factory": FACTORY,
            "config": {"fault": fault, "strength": float(strength), "seed": int(seed), **extra}}


def _is_draft(module: Any) -> bool:
    where = type(module).__module__.lower()
    return "eagle" in where or "nextn" in where


def _is_target_logits(module: Any) -> bool:
    archs = getattr(getattr(module, "config", None), "architectures", None) or []
    return type(module).__name__ == "LogitsProcessor" and bool(archs) and not any(
        t in a for a in archs for t in ("Eagle", "MTP", "NextN"))


def factory(config: dict) -> Any:
    fault = config["fault"]
    strength = float(config.get("strength", 1.0))
    seed = int(config.get("seed", 0))
    span = int(config.get("span", 1))
    arm = config.get("arm")            # draft_kv_stale, verify_swap: act only while this file exists (None: always)
    gen = torch.Generator().manual_seed(seed)

    def draft_kv_stale(module, inputs, output):
        if not _is_draft(module) or len(inputs) < 3 or (arm is not None and not os.path.exists(arm)):
            return None
        fb = inputs[2]
        mode = getattr(fb, "forward_mode", None)
        if mode is None or mode.name != "EXTEND":
            return None
        prefix = getattr(fb, "extend_prefix_lens", None)
        if prefix is None or int(prefix.max()) <= 0:
            return None
        from sglang.srt.model_executor.forward_context import get_attn_backend  # lazy: only inside SGLang
        backend = get_attn_backend()
        pool = backend.token_to_kv_pool
        table = backend.req_to_token_pool.req_to_token
        with torch.no_grad():
            for i, p in enumerate(prefix.tolist()):
                if p <= 0:
                    continue
                slots = table[fb.req_pool_indices[i], :p].long()
                pick = torch.rand(len(slots), generator=gen) < strength
                slots = slots[pick]
                if not len(slots):
                    continue
                for buf in kv_buffers(pool):
                    scale = buf[slots].float().pow(2).mean().sqrt().clamp_min(1e-6)
                    noise = torch.randn(buf[slots].shape, generator=gen) * scale
                    buf[slots] = noise.to(buf.dtype)
        return None

    def verify_swap(module, inputs, output):
        if not _is_target_logits(module) or len(inputs) < 4 or (arm is not None and not os.path.exists(arm)):
            return None
        mode = getattr(inputs[3], "forward_mode", None)
        if mode is None or mode.name != "TARGET_VERIFY":
            return None
        logits = getattr(output, "next_token_logits", None)
        if logits is None or logits.dim() != 2:
            return None
        pos = getattr(inputs[3], "positions", None)
        with torch.no_grad():
            top = torch.topk(logits, 2, dim=-1).indices
            if pos is not None and pos.shape[0] == logits.shape[0]:
                rows = torch.tensor([r for r, q in enumerate(pos.tolist()) if pick(q, seed, strength)],
                                    dtype=torch.long)
            else:
                rows = torch.nonzero(torch.rand(logits.shape[0], generator=gen) < strength).flatten()
            for r in rows.tolist():
                a, b = int(top[r, 0]), int(top[r, 1])
                va, vb = logits[r, a].clone(), logits[r, b].clone()
                logits[r, a], logits[r, b] = vb, va
        return None

    def chunk_boundary_token(module, inputs, output):
        if not _is_draft(module) or len(inputs) < 3:
            return None
        ids, positions, fb = inputs[:3]
        if getattr(getattr(fb, "forward_mode", None), "name", None) != "EXTEND":
            return None
        prefix, lens = getattr(fb, "extend_prefix_lens", None), getattr(fb, "extend_seq_lens", None)
        if prefix is None or lens is None or int(prefix.max()) <= 0:
            return None
        chunk = _chunk_size()
        if chunk == 0:                                    # no chunked prefill on this server
            return None
        rows = boundary_rows(prefix.tolist(), lens.tolist(), chunk, strength=strength, seed=seed, span=span)
        if not rows:
            return None
        vocab = int(getattr(module.embed_tokens, "org_vocab_size", None) or module.embed_tokens.num_embeddings)
        bad = ids.clone()
        for r, k in rows:
            bad[r + 1:r + k] = ids[r:r + k - 1]               # the id one position early: the shift lost
            bad[r] = wrong_id(int(positions[r]), seed, vocab, int(ids[r]))
        with torch.no_grad():
            return module.forward(bad, positions, fb, *inputs[3:])


    known = _KNOWN                     # embed_current_token: shared by the target's and the draft's hooks

    def _row_reqs(fb, n: int) -> list | None:
        """Per row of a forward of ``n`` rows: (request pool index, index of the row in its request), or None."""
        rpi = getattr(fb, "req_pool_indices", None)
        if rpi is None or int(rpi.shape[0]) == 0:
            return None
        lens = getattr(fb, "extend_seq_lens", None)
        lens = [int(x) for x in lens.tolist()] if lens is not None and int(lens.shape[0]) == int(rpi.shape[0]) \
            else None
        if lens is None or sum(lens) != n:
            per, rem = divmod(n, int(rpi.shape[0]))
            if rem:
                return None
            lens = [per] * int(rpi.shape[0])
        return [(int(r), j) for r, k in zip(rpi.tolist(), lens) for j in range(k)]

    def _armed() -> tuple[float, int] | None:
        if arm is None:
            return strength, seed
        try:
            with open(arm) as f:
                text = f.read()
        except OSError:
            return None
        import json
        try:
            c = json.loads(text) if text.strip() else {}
        except ValueError:
            c = {}
        return float(c.get("strength", strength)), int(c.get("seed", seed))

    def embed_current_token(module, inputs, output):
        if len(inputs) < 3:
            return None
        ids, positions, fb = inputs[:3]
        mode = getattr(getattr(fb, "forward_mode", None), "name", None)
        if not torch.is_tensor(ids) or not torch.is_tensor(positions) or ids.dim() != 1 or positions.dim() != 1 \
                or ids.shape[0] != positions.shape[0]:
            return None
        if not _is_draft(module):                  # the target's inner model: remember its ids per position
            if mode in ("EXTEND", "TARGET_VERIFY"):
                rows = _row_reqs(fb, int(ids.shape[0]))
                if rows is not None:
                    if len(known) > 200000:
                        known.clear()
                    for (r, _), q, t in zip(rows, positions.tolist(), ids.tolist()):
                        known[(r, int(q))] = int(t)
            return None
        if mode not in ("EXTEND", "DRAFT_EXTEND_V2"):
            return None
        on = _armed()
        if on is None:
            return None
        s, sd = on
        rows = _row_reqs(fb, int(ids.shape[0]))
        if rows is None:
            return None
        vocab = int(getattr(module.embed_tokens, "org_vocab_size", None) or module.embed_tokens.num_embeddings)
        bad, hit = ids.clone(), False
        for i, ((r, j), q) in enumerate(zip(rows, positions.tolist())):
            if not pick(q, sd, s):
                continue
            cur = int(ids[i - 1]) if j > 0 else known.get((r, int(q)))
            bad[i] = cur if cur is not None else wrong_id(int(q), sd, vocab, int(ids[i]))
            hit = True
        if not hit:
            return None
        with torch.no_grad():
            return module.forward(bad, positions, fb, *inputs[3:])

    return {"draft_kv_stale": draft_kv_stale, "verify_swap": verify_swap,
            "chunk_boundary_token": chunk_boundary_token, "embed_current_token": embed_current_token}[fault]


#: ``embed_current_token``: (request pool index, position) -> the target's input id there. Module-level: SGLang calls
#: a hook factory once per model runner (``sglang/srt/model_executor/hook_manager.py::register_forward_hooks``), so
#: the target's hook and the draft's are two closures of one process that share this.
_KNOWN: dict = {}
_STATE: dict = {"requests": 0, "fc": None, "scaled": False}

#: the draft architectures whose modules the draft-state fixtures hook (``hf_config.architectures`` of the draft's
#: model runner), and the SGLang 0.5.23 module names of each draft kind: ``weights`` the linear that mixes the
#: target's hidden state into the draft's layer (``sglang/srt/models/llama_eagle3.py::LlamaModel.fc``;
#: ``sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.eh_proj``), ``attn`` the ``RadixAttention`` of the
#: draft's first (only) layer that its decode steps run (``llama_eagle3.py::LlamaDecoderLayer.self_attn.attn``;
#: the NextN head's ``DeepseekV2DecoderLayer`` is ``model.decoder``, its ``DeepseekV2AttentionMLA`` decodes through
#: ``attn_mqa``: ``sglang/srt/models/deepseek_common/attention_forward_methods/forward_mla.py`` and
#: ``forward_mla_fused_rope_cpu.py`` call ``self.attn_mqa``; ``attn_mha`` is its prefill-only MHA path)
DRAFT_ARCHS = {"LlamaForCausalLMEagle3": "eagle3", "DeepseekV3ForCausalLMNextN": "nextn"}
DRAFT_MODULES = {"eagle3": {"weights": "model.fc", "attn": "model.layers.0.self_attn.attn"},
                 "nextn": {"weights": "model.eh_proj", "attn": "model.decoder.self_attn.attn_mqa"}}
#: the tags of a draft's architecture name (as ``helpers/trace_hooks.py::DRAFT_ARCH_TAGS``): its logits processor
DRAFT_TAGS = ("Eagle", "MTP", "NextN")


def draft_kind(architectures) -> str:
    """The draft kind (a key of :data:`DRAFT_MODULES`) of a draft served with ``architectures`` (the draft model
    runner's ``hf_config.architectures``: ``LlamaForCausalLMEagle3``; a DeepSeek-V3 / Kimi target's own NextN layer
    is served as ``DeepseekV3ForCausalLMNextN``, ``sglang/srt/configs/model_config.py::ModelConfig.
    _config_draft_model``). Raises ValueError naming the architectures this fixture knows for any other."""
    kinds = {DRAFT_ARCHS[a] for a in (architectures or []) if a in DRAFT_ARCHS}
    if len(kinds) != 1:
        raise ValueError(f"draft architectures {list(architectures or [])}: expected one of "
                         f"{', '.join(DRAFT_ARCHS)} (the drafts whose modules tests/support/engine_faults.py knows)")
    return kinds.pop()


def draft_modules(draft: str = "eagle3") -> dict:
    """``{"weights": module name, "attn": module name}`` of draft kind ``draft`` (:data:`DRAFT_MODULES`). Raises
    ValueError for an unknown kind."""
    if draft not in DRAFT_MODULES:
        raise ValueError(f"unknown draft kind {draft!r}; expected one of {', '.join(DRAFT_MODULES)}")
    return DRAFT_MODULES[draft]


def scaled_weights_factory(config: dict) -> Any:
    """``config``: ``mode`` (``count`` | ``fc``), ``arm`` (file path; None: counting from the start),
    ``after_requests`` (N), ``scale``."""
    mode = config.get("mode", "count")
    arm = config.get("arm")
    after = int(config.get("after_requests", 1))
    scale = float(config.get("scale", 0.25))

    def fc_hook(module, inputs, output):
        _STATE["fc"] = module
        return None

    def count_hook(module, inputs, output):
        archs = getattr(getattr(module, "config", None), "architectures", None) or []
        if not any(t in a for a in archs for t in DRAFT_TAGS) or (arm is not None and not os.path.exists(arm)):
            return None
        fb = inputs[3] if len(inputs) > 3 else None
        if getattr(getattr(fb, "forward_mode", None), "name", None) != "EXTEND":
            return None
        _STATE["requests"] += int(fb.extend_seq_lens.shape[0])
        fc = _STATE["fc"]
        if _STATE["requests"] > after and not _STATE["scaled"] and fc is not None:
            with torch.no_grad():
                fc.weight.mul_(scale)
            _STATE["scaled"] = True
        return None

    return fc_hook if mode == "fc" else count_hook


def kv_wrong_slot_factory(config: dict) -> Any:
    """``config``: ``arm`` (file path; the fault acts only while it exists; None: always), ``strength`` (the share
    of decode rows, :func:`pick` of the position; default 1), ``seed``."""
    arm = config.get("arm")
    strength, seed = float(config.get("strength", 1.0)), int(config.get("seed", 0))

    def hook(module, inputs, output):
        if len(inputs) < 4 or (arm is not None and not os.path.exists(arm)):
            return None
        q, k, v, fb = inputs[:4]
        if getattr(getattr(fb, "forward_mode", None), "name", None) != "DECODE" or \
                getattr(fb, "spec_info", None) is None:           # the draft's decode steps only
            return None
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        pool, r2t = get_token_to_kv_pool(), get_req_to_token_pool().req_to_token
        lid = module.layer_id
        kb, vb = pool.get_key_buffer(lid), pool.get_value_buffer(lid)
        loc = fb.out_cache_loc.long()
        n = loc.shape[0]
        per = max(n // int(fb.req_pool_indices.shape[0]), 1)
        req = fb.req_pool_indices.long().repeat_interleave(per)
        prev = (fb.positions.long() - 1).clamp(min=0)
        wrong = r2t[req, prev].long()
        if strength < 1.0:
            hit = torch.tensor([pick(q, seed, strength) for q in fb.positions.tolist()], dtype=torch.bool)
            if not bool(hit.any()):
                return None
            loc, wrong = loc[hit], wrong[hit]
        with torch.no_grad():
            old_k, old_v = kb[wrong].clone(), vb[wrong].clone()
            kb[wrong], vb[wrong] = kb[loc], vb[loc]
            out = module.forward(q, k, v, fb, save_kv_cache=False)
            kb[wrong], vb[wrong] = old_k, old_v
        return out

    return hook


def specs(folder: str, *, after_requests: int = 2, scale: float = 0.25,
          draft: str = "eagle3") -> tuple[list[dict], str, str]:
    """``(--forward-hooks specs, weights arm file, KV arm file)`` for both faults, armed by files in ``folder``, on
    the modules of draft kind ``draft`` (:func:`draft_modules`)."""
    w, kv = os.path.join(folder, "ARM_WEIGHTS"), os.path.join(folder, "ARM_KV")
    fac = "tests.support.engine_faults:"
    mods = draft_modules(draft)
    return ([{"name": "test-weights-fc", "target_modules": [mods["weights"]],
              "hook_factory": fac + "scaled_weights_factory", "config": {"mode": "fc", "arm": w}},
             {"name": "test-weights-count", "target_modules": ["logits_processor"],
              "hook_factory": fac + "scaled_weights_factory",
              "config": {"mode": "count", "arm": w, "after_requests": after_requests, "scale": scale}},
             {"name": "test-kv-slot", "target_modules": [mods["attn"]],
              "hook_factory": fac + "kv_wrong_slot_factory", "config": {"arm": kv}}], w, kv)


# ------------------------------------------------------------------------------------------ the fault generator
#: generated class -> the finding the engine-state probes must name for it (None: no finding, every probe clear)
#: and the probes whose mechanism it is (``helpers.investigation.probes``: cache.py, trace.py, lossless.py, sampled.py)
EXPECTED: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "clean": (None, ()),
    "draft_kv_stale": ("cache_state_loses_acceptance", ("radix_hit", "chunked_prefill")),
    "chunk_boundary_token": ("cache_state_loses_acceptance", ("chunked_prefill",)),
    "kv_wrong_slot": ("draft_kv_diverges", ("step_trace", "served_draft")),
    "draft_decay": ("served_draft_differs", ("served_draft", "step_trace")),
    "verify_swap": ("speculation_not_lossless", ("greedy_lossless",)),
    "sampled_verify": ("sampled_verify_loses_acceptance", ("sampled_verify",)),
}
#: classes reserved for a fault that lands elsewhere, with where: drawn only once listed in :data:`EXPECTED` (none
#: now: ``sampled_verify`` was the last)
PENDING: dict[str, str] = {}
CLASSES = tuple(EXPECTED)
FAULTS = tuple(c for c in CLASSES if c != "clean")
#: class -> (strong range, weak range) of its strength: the share of slots / boundaries / rows it hits; for
#: ``draft_decay`` the factor the draft's fc is scaled by (weak: near 1). ``sampled_verify``: the share of sampled
#: verify rows cut; on the reference pair (TP 2, 16 prompts x 32 tokens at temperature 1.0, one server, sweep of
#: ``bench/bench_sampled_verify.py --strengths``, bench/RESULTS.md) a share of 0.02 / 0.05 lost 0.03 / 0.08 tokens per
#: verify step (clear), 0.1 / 0.2 0.15 / 0.19 (undecided), 0.4 / 1.0 0.35 [0.25, 0.47] / 1.37 [1.18, 1.59] (counts)
STRENGTH = {"draft_kv_stale": ((0.3, 1.0), (0.005, 0.02)),
            "chunk_boundary_token": ((0.6, 1.0), (0.05, 0.15)),
            "kv_wrong_slot": ((0.3, 1.0), (0.01, 0.05)),
            "draft_decay": ((0.1, 0.5), (0.97, 0.995)),
            "verify_swap": ((0.1, 0.3), (0.005, 0.01)),
            "sampled_verify": ((0.5, 1.0), (0.02, 0.08))}
#: ``draft_decay``: the draft's weights are scaled once more than N draft prefills have run, N in this range (the
#: probes' first requests: repeatable sends 2, served_draft 1, step_trace one per live prompt)
DECAY_AFTER = (0, 6)
#: ``chunk_boundary_token``: tier -> rows from the boundary (0: the whole later chunk, the shift lost at the border;
#: 1: its first row alone, which on the reference pair cost 0.08 [-0.01, 0.19] tokens per verify step at strength
#: 0.68 on 16 prompts, 7-token chunks: below the material threshold, bench/RESULTS.md)
SPAN = {"strong": 0, "weak": 1}


@dataclass(frozen=True)
class EngineFault:
    """One generated engine-state fault: ``cls`` (:data:`CLASSES`), ``tier`` (``strong`` / ``weak`` / ``-`` for
    clean), ``strength`` (see :data:`STRENGTH`), ``seed`` (the hook's), ``after`` (``draft_decay``: N requests),
    ``span`` (``chunk_boundary_token``: rows from the boundary, 0 the whole chunk: :data:`SPAN`), ``draft`` (the
    draft kind whose modules the hooks target, :data:`DRAFT_MODULES`: ``eagle3`` or ``nextn``)."""

    cls: str
    tier: str = "-"
    strength: float = 0.0
    seed: int = 0
    after: int = 0
    span: int = 1
    draft: str = "eagle3"

    @property
    def expected(self) -> str | None:
        """The finding kind the probes must name (None: ``ok``)."""
        return EXPECTED[self.cls][0]

    @property
    def label(self) -> str:
        if self.cls == "clean":
            return f"clean (seed {self.seed})"
        extra = f" after {self.after}" if self.cls == "draft_decay" else \
            (f" span {self.span or 'chunk'}" if self.cls == "chunk_boundary_token" else "")
        return f"{self.cls} {self.tier} {self.strength:g}{extra}"

    def to_json(self) -> dict:
        return {"cls": self.cls, "tier": self.tier, "strength": self.strength, "seed": self.seed,
                "after": self.after, "span": self.span, "expected": self.expected, "label": self.label,
                "draft": self.draft}

    def hook_specs(self) -> list[dict]:
        """SGLang ``--forward-hooks`` specs of the fault (none for clean)."""
        fac = "tests.support.engine_faults:"
        if self.cls == "clean":
            return []
        mods = draft_modules(self.draft)
        if self.cls == "draft_decay":
            return [{"name": "e3f-test-decay-fc", "target_modules": [mods["weights"]],
                     "hook_factory": fac + "scaled_weights_factory", "config": {"mode": "fc", "arm": None}},
                    {"name": "e3f-test-decay-count", "target_modules": ["logits_processor"],
                     "hook_factory": fac + "scaled_weights_factory",
                     "config": {"mode": "count", "arm": None, "after_requests": self.after, "scale": self.strength}}]
        if self.cls == "kv_wrong_slot":
            return [{"name": "e3f-test-kv-wrong-slot", "target_modules": [mods["attn"]],
                     "hook_factory": fac + "kv_wrong_slot_factory",
                     "config": {"arm": None, "strength": self.strength, "seed": self.seed}}]
        if self.cls == "chunk_boundary_token":
            return [spec(self.cls, strength=self.strength, seed=self.seed, span=self.span)]
        if self.cls == "sampled_verify":                  # arm None: on for the server's whole life
            return [verify_faults.spec(None, strength=self.strength, seed=self.seed)]
        return [spec(self.cls, strength=self.strength, seed=self.seed)]


def draw(seed: int, cls: str, tier: str = "strong", *, draft: str = "eagle3") -> EngineFault:
    """One fault of ``cls`` drawn from ``seed``: its strength uniform in the tier's range, the hook's seed, N for a
    decay; its hooks on the modules of draft kind ``draft`` (:data:`DRAFT_MODULES`; the draw itself does not depend
    on it). Raises ValueError for a class unknown (or pending: :data:`PENDING`), a tier not ``strong`` / ``weak`` or
    an unknown draft kind."""
    draft_modules(draft)
    if cls in PENDING:
        raise ValueError(f"fault class {cls!r} is not available yet: {PENDING[cls]}")
    if cls not in EXPECTED:
        raise ValueError(f"unknown engine fault class {cls!r}; expected one of {', '.join(CLASSES)}")
    r = random.Random(seed)
    if cls == "clean":
        return EngineFault("clean", "-", 0.0, r.randrange(1 << 16), draft=draft)
    if tier not in ("strong", "weak"):
        raise ValueError(f"unknown tier {tier!r}; expected strong or weak")
    lo, hi = STRENGTH[cls][0 if tier == "strong" else 1]
    s = round(r.uniform(lo, hi), 3)
    after = r.randint(*DECAY_AFTER) if cls == "draft_decay" else 0
    return EngineFault(cls, tier, s, r.randrange(1 << 16), after, SPAN[tier] if cls == "chunk_boundary_token" else 1,
                       draft)


def draws(n: int, seed: int = 0, *, clean: int = 3, classes=FAULTS, draft: str = "eagle3") -> list[EngineFault]:
    """``n`` cases from ``seed``: ``clean`` clean servers first (each its own seed), then the fault ``classes`` in a
    shuffled turn (every class once ``n >= clean + len(classes)``), the first turn strong, the second weak (a weak
    strength should come out ``undecided``, ``ok`` or its own class, never another), and so on; hooks on the modules
    of draft kind ``draft`` (the same draws for every kind)."""
    r = random.Random(seed)
    out = [draw(r.randrange(1 << 31), "clean", draft=draft) for _ in range(min(clean, n))]
    order = list(classes)
    r.shuffle(order)
    for i in range(n - len(out)):
        tier = "strong" if (i // len(order)) % 2 == 0 else "weak"
        out.append(draw(r.randrange(1 << 31), order[i % len(order)], tier, draft=draft))
    return out


def named(probes: list[dict]) -> str:
    """What the engine-state probes (``run_probes(...)["probes"]``) name together: the finding kinds of the probes
    that count (``+``-joined when several), else ``failed`` when a probe failed, ``undecided`` when one is undecided,
    ``ok`` when every decision is clear."""
    kinds = sorted({f["kind"] for p in probes for f in p.get("findings") or []})
    if kinds:
        return "+".join(kinds)
    if any(p.get("status") == "failed" for p in probes):
        return "failed"
    if any(p.get("decision") == "undecided" for p in probes):
        return "undecided"
    return "ok"
