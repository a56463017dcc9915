"""All-reduce latency of the sgl_kernel stand-in: shared memory vs gloo, side by side in one run.

SGLang's CPU engine all-reduces after every attention and MLP block of every rank
(``sglang/srt/distributed/parallel_state.py::GroupCoordinator.all_reduce`` ->
``torch.ops.sgl_kernel.shm_allreduce``). The stand-in implements that op over a shared-memory
segment (``env/reference/standin/sgl_kernel/shm.py``, like ``sgl-kernel/csrc/cpu/shm.cpp``) and falls
back to ``torch.distributed`` gloo without it (``E3F_STANDIN_SHM=0``). This script starts ``world``
spawned ranks, runs ``--iters`` all-reduces of a ``[rows, hidden]`` float32 tensor through the
same torch op with the shared-memory group and with gloo (alternating blocks, so both see the same
machine load), and prints the median latency per call and the ratio.

    .venv/bin/python bench/bench_allreduce.py                      # TP 2 and 8, rows 1 / 4 / 64
    .venv/bin/python bench/bench_allreduce.py --tp 2 --rows 4 --iters 500
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _worker(rank: int, world: int, port: int, shapes: list, iters: int, blocks: int, q) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "env" / "reference" / "standin"))
    import sgl_kernel  # noqa: F401  (registers torch.ops.sgl_kernel.*)
    from sgl_kernel import comm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), E3F_SHM_KEY=f"bench-{port}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.ops.sgl_kernel.initialize(world, rank)
    shm = comm._state["shm"]
    out = {}
    for rows, hidden in shapes:
        x = torch.randn(rows, hidden)
        times = {"shm": [], "gloo": []}
        for _ in range(blocks):
            for mode in ("shm", "gloo"):
                comm._state["shm"] = shm if mode == "shm" else None
                for _ in range(5):  # warm-up
                    torch.ops.sgl_kernel.shm_allreduce(x, 0)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    torch.ops.sgl_kernel.shm_allreduce(x, 0)
                times[mode].append((time.perf_counter() - t0) / iters)
                x.div_(world)  # keep values bounded
        out[(rows, hidden)] = {m: statistics.median(v) for m, v in times.items()}
    comm._state["shm"] = shm
    q.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, shapes: list, iters: int, blocks: int) -> dict:
    """Median seconds per all-reduce ``{(rows, hidden): {"shm": s, "gloo": s}}`` (rank 0's view)."""
    import torch.multiprocessing as mp

    from helpers.server.embedded import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, shapes, iters, blocks, q))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=1800) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return results[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 64],
                    help="tokens per all-reduce (1: decode, 4: a verify step of 4 draft tokens)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden size (reference target: 128)")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=3, help="alternating shm/gloo blocks")
    args = ap.parse_args()
    shapes = [(r, args.hidden) for r in args.rows]
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.2f}")
    print("\n| TP | tensor | shared memory (median) | gloo (median) | gloo / shm |")
    print("|---|---|---|---|---|")
    for world in args.tp:
        res = run(world, shapes, args.iters, args.blocks)
        for (rows, hidden), r in res.items():
            print(f"| {world} | [{rows}, {hidden}] fp32 | {1e3 * r['shm']:.3f} ms | "
                  f"{1e3 * r['gloo']:.3f} ms | {r['gloo'] / r['shm']:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
