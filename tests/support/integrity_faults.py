"""A test-only fault that SGLang's own KV page invariant must catch (the liveness half of the engine-state probe
``invariant_check``, :mod:`helpers.investigation.probes.integrity`): an SGLang ``--forward-hooks`` factory. A test
fixture: nothing in ``helpers/`` names it, no flag of the tool reaches it; a test or a bench passes :func:`spec` to
the embedded server, and the fault acts only while its ``arm`` file exists (so one server shows the clean and the
faulty log).

``req_to_token_use_after_free``: on the target's inner ``model`` (``LlamaModel.forward(input_ids, positions,
forward_batch, ...)``: the forward batch is its third argument, as ``tests/support/engine_faults.py`` reads it), in
one target forward while ``arm`` exists, the first request's ``req_to_token`` entry of position 0 is pointed at the
pool's last slot (``KVCache.size``: the allocator hands out ``free_pages`` from the front, ``sglang/srt/mem_cache/
allocator/token.py::TokenToKVPoolAllocator.clear`` / ``alloc``, so on a lightly used server that slot is free). The
request then owns a slot that is also in the free pool: what ``sglang/srt/managers/scheduler_components/
invariant_checker.py::SchedulerInvariantChecker._check_kv_page_invariants`` (``SGLANG_CHECK_KV_PAGE_INVARIANTS``,
after every batch with ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY``) reports as ``KV page use-after-free: 1 owner
page refs are in the free pool, sample pages=[...]``. The entry is put back at the next target forward (the check runs
between the two: ``sglang/srt/managers/scheduler.py`` calls it after each batch's result). The pools' token counts are
untouched (the accounting check ``Full Pool Mem Leak Detected!`` holds); the request's first position attends to the
free slot's K/V for that one step.

``kv_bytes_overwrite`` (the KV canary's liveness, on a CPU server only with the test-only ``E3F_TEST_CANARY_CPU=1`` of
``env/reference/standin/e3f_boot.py``): on the same module, in one target forward while ``arm`` exists that does not write that slot (the canary brackets the model's forward
and records a written slot's hash after it, ``sglang/srt/kv_canary/single_forward_manager/manager.py``), the layer-0
K of the first request's position-0 slot (``k_buffer[0][req_to_token[row, 0]]``: the bytes the canary's real-data hash
reads, ``sglang/srt/kv_canary/pool_patcher/adapters/mha.py::attach_mha``, ``real_kv_sources_k`` of ``k_buffer[0]``)
is overwritten with other values (its negation plus one), and left so: the slot no longer holds what was written for
its token, which ``--kv-canary-real-data`` must report (``fail_reason=verify_real_kv_hash``) when the slot is next
read or swept.

Pool access through ``sglang/srt/model_executor/forward_context.py::get_token_to_kv_pool`` /
``get_req_to_token_pool`` (the forward context every model forward publishes). Importable in SGLang's venv: torch only
(SGLang itself lazily, inside the hook).
"""
from __future__ import annotations

import os
from typing import Any

FACTORY = "tests.support.integrity_faults:factory"
_STATE: dict = {"undo": None, "fired": 0}


FAULTS = ("req_to_token_use_after_free", "kv_bytes_overwrite")


def spec(arm: str, fault: str = "req_to_token_use_after_free") -> dict:
    """The ``--forward-hooks`` spec of ``fault`` (:data:`FAULTS`), armed by the file ``arm``."""
    return {"name": f"e3f-test-{fault}", "target_modules": ["model"], "hook_factory": FACTORY,
            "config": {"fault": fault, "arm": str(arm)}}


def _is_target(module: Any) -> bool:
    where = type(module).__module__.lower()
    return not ("eagle" in where or "nextn" in where)


def factory(config: dict) -> Any:
    """``config``: ``fault`` (``req_to_token_use_after_free``), ``arm`` (file path; the fault acts while it exists,
    once per server process, the entry put back at the next target forward)."""
    fault = config.get("fault")
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}")
    arm = config["arm"]

    def overwrite(module, inputs, output):
        if not _is_target(module) or len(inputs) < 3 or _STATE["fired"] or not os.path.exists(arm):
            return None
        idx = getattr(inputs[2], "req_pool_indices", None)
        if idx is None or not len(idx):
            return None
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        slot = int(get_req_to_token_pool().req_to_token[int(idx[0]), 0])
        loc = getattr(inputs[2], "out_cache_loc", None)
        if loc is not None and slot in set(loc.tolist()):
            return None                 # the forward that writes the slot: the canary records it after the forward
        buf = get_token_to_kv_pool().k_buffer[0]
        buf[slot] = -buf[slot] + 1
        _STATE["fired"] += 1
        return None

    if fault == "kv_bytes_overwrite":
        return overwrite

    def hook(module, inputs, output):
        if not _is_target(module) or len(inputs) < 3:
            return None
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool, get_token_to_kv_pool

        r2t = get_req_to_token_pool().req_to_token
        if _STATE["undo"] is not None:                      # put the previous forward's entry back
            row, old = _STATE["undo"]
            r2t[row, 0] = old
            _STATE["undo"] = None
            return None
        fb = inputs[2]
        idx = getattr(fb, "req_pool_indices", None)
        if idx is None or not len(idx) or not os.path.exists(arm) or _STATE["fired"]:
            return None
        row = int(idx[0])
        _STATE["undo"] = (row, r2t[row, 0].clone())
        r2t[row, 0] = int(get_token_to_kv_pool().size)
        _STATE["fired"] += 1
        return None

    return hook
