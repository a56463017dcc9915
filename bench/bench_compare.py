"""Comparison throughput on Kimi-K2.5-shaped data (H 7168, 3 aux chunks, bf16).

Generates SpecForge-layout training files (``rows_0-2000/data_{i}.ckpt``: input_ids, loss_mask,
aux_hidden_state [1, L, 3H], hidden_state [1, L, H]) and a served dump (``e3f-dump``, the same rows plus bf16
noise) under ``bench/data/`` (git-ignored), then measures, each pass in a fresh child process:

* ``baseline``: a plain read + dot-product pass over the same files (same readers; per row <served, training>
  over the full 3H width, in float32 blocks);
* ``compare``: the diagnosis (``helpers.diagnosis.diagnose.diagnose``: every served chunk x training chunk with
  per-row rel_diff / cosine / norm-ratio histograms and exact within-tolerance counts, global sums, max-abs with
  coordinate for near pairs, context-free / zero-row / outlier-row stats, the fit reservoir, detectors; on both
  cores through its block pipeline unless ``E3F_COMPARE_THREADS=1``);

at two data sizes (half and all samples), with the data files' pages dropped from the page cache before each
pass (``cold``: the multi-GB case, reads come from disk) and read into it first (``warm``). It prints rows/s,
the throughput ratio compare/baseline (same size, same run; wall clock, and CPU time which is robust to other
load on a shared machine) and each child's peak RSS (VmHWM), then deletes the data (unless ``--keep``).

``--profile N`` instead says where the time of one warm comparison of N samples goes: the pass runs in one thread
(``E3F_COMPARE_THREADS=1``) under cProfile, and the CPU seconds are split by stage (the tensor work a worker
thread does per block, and the ordered part the calling thread does) and by the costliest functions.

    nice -n 10 .venv/bin/python bench/bench_compare.py [--samples 12] [--rows 2048] [--threads 1] [--repeat 2]
    .venv/bin/python bench/bench_compare.py --profile 6 --keep
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def generate(data: Path, samples: int, rows: int, hidden: int, seed: int = 0) -> None:
    import numpy as np
    import torch

    from helpers.formats.dumps import write_dump

    stamp = data / "params.json"
    params = {"samples": samples, "rows": rows, "hidden": hidden, "seed": seed}
    if stamp.exists() and json.loads(stamp.read_text()) == params:
        return
    shutil.rmtree(data, ignore_errors=True)
    (data / "train" / "rows_0-2000").mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    served = []
    for i in range(samples):
        ids = torch.from_numpy(rng.integers(0, 160000, rows)).long()
        aux = torch.randn(rows, 3 * hidden, generator=g).bfloat16()
        lm = torch.ones(rows, dtype=torch.long)
        torch.save({"input_ids": ids, "loss_mask": lm, "aux_hidden_state": aux[None],
                    "hidden_state": torch.randn(1, rows, hidden, generator=g).bfloat16()},
                   data / "train" / "rows_0-2000" / f"data_{i}.ckpt")
        noisy = (aux.float() + 0.01 * torch.randn(rows, 3 * hidden, generator=g)).bfloat16()
        served.append({"key": f"req{i}", "sample_id": f"data_{i}", "input_ids": ids.numpy(), "hidden": noisy,
                       "num_prompt_tokens": rows})
        del aux
    write_dump(data / "served", served, {"kind": "served", "hidden_size": hidden,
                                         "source": {"generator": "bench/bench_compare.py"}})
    stamp.write_text(json.dumps(params))


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM, per address space; ``ru_maxrss`` would include the parent's
    peak, which Linux carries across fork/exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child(mode: str, data: Path, max_samples: int, threads: int) -> dict:
    import torch

    from helpers.diagnosis.diagnose import diagnose      # imports outside the timed region
    from helpers.formats.dumps import read_dump
    from helpers.formats.training_data import TrainingData

    torch.set_num_threads(threads)
    c0 = time.process_time()
    t0 = time.perf_counter()
    rows = 0
    if mode == "baseline":
        served = {s.sample_id: s for s in read_dump(data / "served").samples}
        acc = 0.0
        sb = tb = None
        for tr in TrainingData(data / "train", max_samples=max_samples):
            sv = served[tr.sample_id]
            t = tr.load()
            s = sv.load()
            if sb is None:
                sb, tb = torch.empty(64, s.shape[1]), torch.empty(64, t.shape[1])
            for a in range(0, t.shape[0], 64):   # float32 copies into reused buffers, like the comparison
                b = min(t.shape[0], a + 64) - a
                sb[:b].copy_(s[a:a + b])
                tb[:b].copy_(t[a:a + b])
                acc += float(torch.linalg.vecdot(sb[:b], tb[:b]).sum())
            rows += t.shape[0]
            del t, s
        extra = {"checksum": acc}
    else:
        d = diagnose(data / "train", [data / "served"], max_samples=max_samples)
        rows = d.comparison.alignment.rows_compared
        extra = {"findings": sorted({f["kind"] for f in d.findings}),
                 "rel_diff": [c["rel_diff"] for c in d.chunks]}
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    return {"mode": mode, "samples": max_samples, "rows": rows, "seconds": dt, "rows_per_s": rows / dt,
            "cpu_seconds": cpu, "cpu_rows_per_s": rows / cpu, "peak_rss_mb": peak_rss_mb(), **extra}


def profile(data: Path, max_samples: int) -> str:
    """One warm pass in one thread: CPU seconds per stage and the costliest functions (cProfile)."""
    import cProfile
    import io
    import pstats
    from collections import defaultdict

    import torch

    import helpers.diagnosis.compare as C
    from helpers.diagnosis.diagnose import diagnose

    torch.set_num_threads(1)
    spent: dict = defaultdict(float)

    def timed(owner, name, label):
        f = getattr(owner, name)

        def w(*args, **kw):
            t0 = time.thread_time()
            try:
                return f(*args, **kw)
            finally:
                spent[label] += time.thread_time() - t0
        setattr(owner, name, w)

    stages = [(C, "_prepare", "worker: _prepare, the tensor work of a block (kernels: see the table below)"),
              (C.PairAccumulator, "measure", "  of which the pairs' numpy part (near pairs, their coordinates)"),
              (C.ChunkStats, "update", "ordered: per-chunk stats (energies, outlier rows, context-free test)"),
              (C.RowReservoir, "add", "ordered: reservoir"),
              (C.PairAccumulator, "apply", "ordered: pair apply (histograms, sums, extrema)")]
    for owner, name, label in stages:
        timed(owner, name, label)
    diagnose(data / "train", [data / "served"], max_samples=1)          # imports and first-call costs
    spent.clear()
    prof = cProfile.Profile()
    c0 = time.process_time()
    prof.enable()
    diagnose(data / "train", [data / "served"], max_samples=max_samples)
    prof.disable()
    total = time.process_time() - c0
    lines = [f"one thread, {max_samples} samples: {total:.3f} CPU s (under cProfile)"]
    for _, _, label in stages:
        lines.append(f"  {spent[label]:7.3f} s {spent[label] / total:6.1%}  {label}")
    rest = total - sum(v for k, v in spent.items() if not k.startswith("  "))
    lines.append(f"  {rest:7.3f} s {rest / total:6.1%}  rest (reading, pairing, detectors, fits, profiler)")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    return "\n".join(lines) + "\n" + buf.getvalue()


def set_cache(data: Path, state: str) -> None:
    """'cold': drop our data files' pages from the page cache (posix_fadvise DONTNEED: only these files,
    no root needed); 'warm': read every file once so the pass reads from memory."""
    for f in sorted(data.rglob("*")):
        if not f.is_file():
            continue
        if state == "cold":
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        else:
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass


def run_child(mode: str, data: Path, n: int, threads: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", mode, "--data", str(data), "--max-samples", str(n),
                        "--threads", str(threads)], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        raise SystemExit(f"child {mode} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "bench" / "data"))
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep bench/data afterwards")
    ap.add_argument("--cache", default="cold,warm", help="page-cache states to measure: cold, warm or both")
    ap.add_argument("--profile", type=int, metavar="N", help="where the time of one warm pass over N samples goes")
    ap.add_argument("--child", choices=["baseline", "compare", "generate", "profile"])
    ap.add_argument("--max-samples", type=int)
    a = ap.parse_args()
    data = Path(a.data)
    if a.child == "generate":
        generate(data, a.samples, a.rows, a.hidden)
        return
    if a.child == "profile":
        print(profile(data, a.max_samples))
        return
    if a.child:
        print(json.dumps(child(a.child, data, a.max_samples, a.threads)))
        return
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--child", "generate", "--data", str(data), "--samples", str(a.samples),
                    "--rows", str(a.rows), "--hidden", str(a.hidden)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    size = sum(f.stat().st_size for f in data.rglob("*") if f.is_file())
    print(f"data: {a.samples} samples x {a.rows} rows x 3x{a.hidden} bf16, {size / 2**30:.2f} GiB on disk "
          f"(generated in {time.perf_counter() - t0:.0f} s); threads {a.threads}")
    if a.profile:
        set_cache(data, "warm")
        r = subprocess.run([sys.executable, __file__, "--child", "profile", "--data", str(data), "--max-samples",
                            str(a.profile)], capture_output=True, text=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": str(ROOT), "E3F_COMPARE_THREADS": "1"})
        print(r.stdout if r.returncode == 0 else r.stderr)
        if not a.keep:
            shutil.rmtree(data, ignore_errors=True)
        return
    print(f"load average at the start: {os.getloadavg()}")
    results = []
    summary = []
    for cache in a.cache.split(","):
        for n in (a.samples // 2, a.samples):
            best = {}
            for _ in range(a.repeat):
                for mode in ("baseline", "compare"):
                    set_cache(data, cache)
                    r = run_child(mode, data, n, a.threads)
                    r["cache"] = cache
                    results.append(r)
                    if mode not in best or r["rows_per_s"] > best[mode]["rows_per_s"]:
                        best[mode] = r
            b, c = best["baseline"], best["compare"]
            row = {"cache": cache, "samples": n, "gib_per_pass": n * a.rows * 3 * a.hidden * 2 * 2 / 2**30,
                   "baseline_rows_per_s": b["rows_per_s"], "compare_rows_per_s": c["rows_per_s"],
                   "ratio_wall": c["rows_per_s"] / b["rows_per_s"],
                   "ratio_cpu": c["cpu_rows_per_s"] / b["cpu_rows_per_s"],
                   "peak_rss_baseline_mib": b["peak_rss_mb"], "peak_rss_compare_mib": c["peak_rss_mb"],
                   "findings": c["findings"]}
            summary.append(row)
            print(f"{cache:4s} samples {n:>3} ({row['gib_per_pass']:.2f} GiB read per pass): baseline "
                  f"{b['rows_per_s']:7.0f} rows/s, compare {c['rows_per_s']:7.0f} rows/s, ratio {row['ratio_wall']:.2f} "
                  f"(CPU-time ratio {row['ratio_cpu']:.2f}); peak RSS baseline {b['peak_rss_mb']:.0f} MiB, compare "
                  f"{c['peak_rss_mb']:.0f} MiB; findings {c['findings']}", flush=True)
    print(f"load average at the end: {os.getloadavg()}")
    print(json.dumps({"summary": summary, "runs": results}))
    if not a.keep:
        shutil.rmtree(data, ignore_errors=True)
        print(f"deleted {data}")


if __name__ == "__main__":
    main()
