"""Collectives and CPU-binding ops of SGLang's CPU engine.

SGLang calls ``torch.ops.sgl_kernel.shm_allreduce`` / ``shm_allgather`` from
``sglang/srt/distributed/parallel_state.py::GroupCoordinator.all_reduce`` / ``all_gather`` when
``is_shm_available`` holds (all ranks on one host), after ``initialize(tp_size, tp_rank)``
(``sglang/srt/distributed/bootstrap.py``). Like the C++ kernels (``sgl-kernel/csrc/cpu/shm.cpp``)
the stand-in then uses a shared-memory segment (:mod:`.shm`: 0.13-0.17 ms per all-reduce
at TP 2 and 1.7-1.9 ms at TP 8 on 2 cores, 9-14x faster than gloo: ``bench/bench_allreduce.py``). Without ``initialize`` (or for a tensor larger than a slot, or with
``E3F_STANDIN_SHM=0``) it falls back to ``torch.distributed`` on the default process group, which
for the tensor-parallel-only servers this project starts is exactly the TP group.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

_state = {"size": 1, "rank": 0, "cpus": None, "shm": None}


def _shm_key(size: int) -> str:
    """Segment name shared by the ranks of one server: ``$E3F_SHM_KEY`` (the launcher sets a
    fresh one per server), else SGLang's ``MASTER_ADDR``/``MASTER_PORT`` (what shm.cpp uses)."""
    key = os.environ.get("E3F_SHM_KEY") or (
        f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}")
    return f"{key}-tp{size}".replace("/", "_")


def initialize(size: int, rank: int) -> None:
    """Record the TP size and rank and open the shared-memory segment of this TP group."""
    _state["size"], _state["rank"] = int(size), int(rank)
    if int(size) > 1 and os.environ.get("E3F_STANDIN_SHM", "1") != "0":
        from .shm import ShmGroup

        group = ShmGroup(_shm_key(int(size)), int(size), int(rank))
        group.barrier()  # every rank has mapped the segment: its name is no longer needed
        if int(rank) == 0:
            group.unlink()
        _state["shm"] = group


def init_cpu_threads_env(cpu_ids: str) -> str:
    """Bind this rank to ``cpu_ids`` ("0", "0-1", "0,2") and use one torch thread per CPU
    (at most ``$E3F_STANDIN_THREADS`` when set).

    Mirrors the thread binding of ``sgl-kernel/csrc/cpu/numa_utils.cpp::init_cpu_threads_env`` with
    ``os.sched_setaffinity`` and ``torch.set_num_threads``. Returns a one-line description.
    """
    cpus: list[int] = []
    for part in str(cpu_ids).split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    available = os.sched_getaffinity(0)
    cpus = [c for c in cpus if c in available] or sorted(available)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        pass
    threads = len(cpus)
    if os.environ.get("E3F_STANDIN_THREADS"):
        threads = max(1, min(threads, int(os.environ["E3F_STANDIN_THREADS"])))
    torch.set_num_threads(threads)
    _state["cpus"] = cpus
    return f"sgl_kernel stand-in: pid {os.getpid()} bound to CPUs {cpus}, {threads} thread(s)"


def _group_ready() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def shm_allreduce(data: torch.Tensor, reduce_op: int) -> None:
    """In-place sum over all ranks (``reduce_op`` 0 = SUM, the only op SGLang passes)."""
    if reduce_op != 0:
        raise NotImplementedError(f"shm_allreduce: reduce_op {reduce_op} (only SUM=0)")
    shm = _state["shm"]
    if shm is not None and shm.fits(data):
        shm.all_reduce_(data)
        return
    if not _group_ready():
        return
    if data.dtype in (torch.bfloat16, torch.float16):
        buf = data.to(torch.float32)
        dist.all_reduce(buf)
        data.copy_(buf.to(data.dtype))
    else:
        dist.all_reduce(data)


def shm_allgather(data: torch.Tensor, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``data`` along ``dim`` (rank order)."""
    shm = _state["shm"]
    if shm is not None and shm.fits(data):
        return shm.all_gather(data, dim)
    if not _group_ready():
        return data.clone()
    parts = [torch.empty_like(data) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, data.contiguous())
    return torch.cat(parts, dim=dim)
