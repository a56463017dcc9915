"""Benchmark of the acceptance measurement, side by side in one run against the reference server.

1. Requests needed for a ±0.05 accept-length CI: per-request variance from a real measurement,
   bootstrap CI half-width at several n (:func:`helpers.acceptance.stats.requests_for_half_width`).
2. Client overhead as a fraction of request time: client wall latency vs the server's own
   ``meta_info.e2e_latency`` for (a) a bare ``httpx.post`` and (b) :meth:`SGLangClient.generate`
   (parsing into pydantic models), interleaved on the same prompts; plus the cost of
   :func:`helpers.acceptance.measure.summarize` (bootstrap) relative to the measurement.
3. Capture overhead on tok/s: ``return_hidden_states`` on vs off, interleaved (ABBA) on the same
   prompts; answer size too.

Usage::

    python bench/bench_acceptance.py                      # reference models if built, else tiny random ones
    python bench/bench_acceptance.py --target T --draft D --tp 2 --num-prompts 48 --max-new-tokens 64
    python bench/bench_acceptance.py --write-results      # also update bench/RESULTS.md

Prints every figure; ``--write-results`` replaces the section
``## Acceptance measurement (bench_acceptance.py)`` of bench/RESULTS.md (other sections are kept).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from helpers.server import embedded  # noqa: E402
from helpers.server.settings import SpecSettings  # noqa: E402
from helpers.acceptance.prompts import load_prompts
from helpers.acceptance.measure import measure, summarize
from helpers.acceptance.stats import requests_for_half_width
from helpers.runfiles import atomic_write_text  # noqa: E402
from helpers.server.client import SGLangClient

SECTION = "## Acceptance measurement (bench_acceptance.py)"


def models(args) -> tuple[Path, Path, str]:
    if args.target and args.draft:
        return Path(args.target), Path(args.draft), "given"
    if (embedded.REFERENCE_TARGET / "config.json").exists() and (embedded.REFERENCE_DRAFT / "config.json").exists():
        return embedded.REFERENCE_TARGET, embedded.REFERENCE_DRAFT, "reference (env/models)"
    from support.tinymodels import build_eagle3_draft, build_target

    tmp = Path(tempfile.mkdtemp(prefix="e3f-bench-"))
    t = build_target(tmp / "target")
    d = build_eagle3_draft(tmp / "draft", t, layer_ids=[1, 3, 4])
    return t, d, "tiny random (tests/support/tinymodels.py; the trained reference models are not built yet)"


def client_overhead(url: str, prompts, max_new_tokens: int) -> dict:
    """Interleave bare httpx and SGLangClient on the same prompts; overhead = 1 - e2e / wall."""
    out = {"raw": [], "client": [], "parse_s": []}
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    with httpx.Client(timeout=600) as raw, SGLangClient(url, api_key="") as cl:
        for i, p in enumerate(prompts):
            order = ("raw", "client") if i % 2 == 0 else ("client", "raw")
            for who in order:
                if who == "raw":
                    t0 = time.perf_counter()
                    r = raw.post(url + "/generate", json={**p.request(), "sampling_params": sp})
                    meta = r.json()["meta_info"]
                    wall = time.perf_counter() - t0
                    from helpers.server.protocol import GenerateResult
                    t1 = time.perf_counter()
                    GenerateResult.model_validate({**r.json(), "latency_s": wall})
                    out["parse_s"].append(time.perf_counter() - t1)
                else:
                    res = cl.generate(**p.request(), sampling_params=sp)
                    meta, wall = res.meta_info.model_dump(), res.latency_s
                out[who].append((wall, meta["e2e_latency"]))
    res = {}
    for who in ("raw", "client"):
        walls = np.array([w for w, _ in out[who]])
        e2e = np.array([e for _, e in out[who]])
        res[who] = {"wall_mean_s": float(walls.mean()), "e2e_mean_s": float(e2e.mean()),
                    "overhead_frac_mean": float(np.mean(1 - e2e / walls)),
                    "overhead_ms_mean": float(np.mean(walls - e2e) * 1000)}
    res["parse_ms_mean"] = float(np.mean(out["parse_s"]) * 1000)
    res["parse_frac_of_wall"] = float(np.mean(out["parse_s"]) / res["client"]["wall_mean_s"])
    return res


def capture_overhead(url: str, prompts, max_new_tokens: int) -> dict:
    """tok/s with return_hidden_states off vs on, ABBA-interleaved per prompt."""
    sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    acc = {False: [0, 0.0, 0], True: [0, 0.0, 0]}  # tokens, seconds, bytes
    with httpx.Client(timeout=600) as c:
        for i, p in enumerate(prompts):
            order = (False, True, True, False) if i % 2 == 0 else (True, False, False, True)
            for hs in order:
                body = {**p.request(), "sampling_params": sp}
                if hs:
                    body["return_hidden_states"] = True
                t0 = time.perf_counter()
                r = c.post(url + "/generate", json=body)
                r.raise_for_status()
                data = r.json()
                dt = time.perf_counter() - t0
                acc[hs][0] += data["meta_info"]["completion_tokens"]
                acc[hs][1] += dt
                acc[hs][2] += len(r.content)
    off, on = acc[False], acc[True]
    n = 2 * len(prompts)
    return {"tok_s_off": off[0] / off[1], "tok_s_on": on[0] / on[1],
            "slowdown_frac": 1 - (on[0] / on[1]) / (off[0] / off[1]),
            "kb_per_answer_off": off[2] / n / 1024, "kb_per_answer_on": on[2] / n / 1024}


def reading(s, need, over, cap, summarize_s, measure_s, kind, loads, target) -> str:
    """A plain-words reading of the measured numbers (no number in it is hard-coded)."""
    c = over["client"]
    diff = c["overhead_ms_mean"] - over["raw"]["overhead_ms_mean"]
    txt = (f"Reading: wall minus server e2e_latency is {c['overhead_ms_mean']:.1f} ms per request with "
           f"SGLangClient and {over['raw']['overhead_ms_mean']:.1f} ms with a bare httpx.post; both "
           "hold the server's HTTP/JSON layer and the loopback, so this client's own share is the "
           f"difference, {diff:+.1f} ms (pydantic parsing alone: {over['parse_ms_mean']:.2f} ms). "
           "As a fraction it is "
           f"{100 * c['overhead_frac_mean']:.2f} % here because CPU requests take seconds; on a GPU "
           f"server with ~1 s requests the same {c['overhead_ms_mean']:.0f} ms would be "
           f"~{c['overhead_ms_mean'] / 10:.1f} %. The bootstrap costs {1000 * summarize_s:.0f} ms. "
           f"return_hidden_states costs {100 * cap['slowdown_frac']:.0f} % of tok/s and "
           f"{cap['kb_per_answer_on'] / max(cap['kb_per_answer_off'], 1e-9):.0f}x the answer size "
           "(every row serialised as JSON floats). "
           f"Load average (1 min) during measure / overhead / capture phases: "
           f"{loads[0]:.1f} / {loads[1]:.1f} / {loads[2]:.1f} on a shared box, so tok/s figures of "
           "different phases are not comparable with each other; each comparison above is "
           "interleaved within one phase. ")
    if "random" in kind:
        txt += (f"The per-request spread of the accept length (sd {need.get('sd', float('nan')):.3f}) comes "
                f"from a random draft (accept length ~1), so {need['n_needed']} requests for ±{target} is "
                "a floor, not a planning figure: re-run with the trained reference models "
                "(`python bench/bench_acceptance.py --write-results` picks them up from env/models).")
    else:
        txt += (f"With this draft, ±{target} on the accept length needs about {need['n_needed']} requests "
                "of this length (scale by 1/√n for other targets).")
    return txt


def write_results(text: str) -> Path:
    path = ROOT / "bench" / "RESULTS.md"
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    lines = old.splitlines()
    if SECTION in lines:
        i = lines.index(SECTION)
        j = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("## ")), len(lines))
        new = lines[:i] + text.rstrip().splitlines() + ([""] + lines[j:] if j < len(lines) else [])
    else:
        new = lines + [""] + text.rstrip().splitlines()
    return atomic_write_text(path, "\n".join(new).rstrip() + "\n")


def results_text(raw: dict, args) -> str:
    """The RESULTS.md section from the raw numbers (also used by ``--from-json``)."""
    s, need, over, cap = raw["summary"], raw["need"], raw["client_overhead"], raw["capture"]
    kind, startup, few = raw["models"], raw["startup_s"], raw["overhead_prompts"]
    summarize_s, measure_s, loads = raw["summarize_s"], raw["measure_s"], raw["loads"]
    lines = [
        SECTION, "",
        f"Run {raw['when']} on {platform.machine()} ({os.cpu_count()} CPUs, shared), "
        f"SGLang {s['sglang_version']} CPU reference server, TP {s['tp_size']}, EAGLE3 steps {s['num_steps']} "
        f"topk {s['topk']} draft tokens {s['num_draft_tokens']}; models: {kind}. "
        f"{s['n_requests']} bundled prompts, max_new_tokens {s['max_new_tokens']}, greedy, concurrency 1. "
        f"Server startup {startup:.0f} s.", "",
        "| figure | value |", "|---|---|",
        f"| accept length (Σcompletion/Σverify), 95% CI | {s['accept_length']:.3f} "
        f"[{s['accept_length_lo']:.3f}, {s['accept_length_hi']:.3f}] |",
        f"| per-request accept length: mean / sd | {raw['per_request_mean']:.3f} / {need['sd']:.3f} |",
        f"| accept rate, 95% CI | {s['accept_rate']:.3f} [{s['accept_rate_lo']:.3f}, {s['accept_rate_hi']:.3f}] |",
        f"| CI half-width at n = {need['n_obs']} (measured) | {need['half_width_obs']:.4f} |",
        "| CI half-width by n (resampled from the measured requests) | " +
        ", ".join(f"n={n}: {w:.4f}" for n, w in need["by_n"].items()) + " |",
        f"| **requests for a ±{args.target_half_width} accept-length CI** | **{need['n_needed']}** "
        f"(= n_obs·(hw/{args.target_half_width})²) |",
        f"| tok/s per request (server without capture) | {s['tok_s']:.1f} [{s['tok_s_lo']:.1f}, {s['tok_s_hi']:.1f}] |",
        f"| client overhead, bare httpx: 1 − e2e/wall | {100 * over['raw']['overhead_frac_mean']:.2f} % "
        f"({over['raw']['overhead_ms_mean']:.1f} ms of {1000 * over['raw']['wall_mean_s']:.0f} ms) |",
        f"| client overhead, SGLangClient.generate | {100 * over['client']['overhead_frac_mean']:.2f} % "
        f"({over['client']['overhead_ms_mean']:.1f} ms of {1000 * over['client']['wall_mean_s']:.0f} ms) |",
        f"| response parsing (pydantic) per request | {over['parse_ms_mean']:.3f} ms "
        f"({100 * over['parse_frac_of_wall']:.3f} % of request time) |",
        f"| summarize() with 2000 bootstrap resamples | {summarize_s * 1000:.0f} ms "
        f"({100 * summarize_s / measure_s:.2f} % of the {measure_s:.1f} s measurement) |",
        f"| tok/s return_hidden_states off / on (ABBA, {2 * few} requests each) | "
        f"{cap['tok_s_off']:.1f} / {cap['tok_s_on']:.1f} |",
        f"| capture overhead on tok/s | {100 * cap['slowdown_frac']:.1f} % slower |",
        f"| answer size off / on | {cap['kb_per_answer_off']:.1f} KiB / {cap['kb_per_answer_on']:.1f} KiB |",
        "",
        reading(s, need, over, cap, summarize_s, measure_s, kind, loads, args.target_half_width),
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--overhead-prompts", type=int, default=12)
    ap.add_argument("--target-half-width", type=float, default=0.05)
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--from-json", default=None,
                    help="re-render the section from a saved bench/data/bench_acceptance.json (no server)")
    args = ap.parse_args(argv)
    if args.from_json:
        text = results_text(json.loads(Path(args.from_json).read_text()), args)
        print(text)
        if args.write_results:
            print(f"\nwrote {write_results(text)}")
        return 0

    target, draft, kind = models(args)
    print(f"models: {kind}\n  target {target}\n  draft  {draft}", flush=True)
    t0 = time.perf_counter()
    spec = SpecSettings(num_steps=args.steps, topk=1, num_draft_tokens=args.steps + 1)
    with embedded.start(target, draft, tp=args.tp, spec=spec, timeout=900) as srv:
        startup = time.perf_counter() - t0
        print(f"server up in {startup:.1f} s: {srv.url} (tp {args.tp})", flush=True)
        prompts = load_prompts(n=args.num_prompts)
        loads = []
        t1 = time.perf_counter()
        res = measure(srv.url, prompts, max_new_tokens=args.max_new_tokens, concurrency=1,
                      n_boot=2000, progress=False, label="bench")
        measure_s = time.perf_counter() - t1
        loads.append(os.getloadavg()[0])
        t2 = time.perf_counter()
        summarize(res.per_request, positions=args.steps, wall_s=res.summary["wall_s"], n_boot=2000)
        summarize_s = time.perf_counter() - t2
        need = requests_for_half_width(res.per_request, target=args.target_half_width,
                                       sizes=(10, 20, 40, 80, 160, 320), n_boot=1000)
        few = prompts[:args.overhead_prompts]
        over = client_overhead(srv.url, few, args.max_new_tokens)
        loads.append(os.getloadavg()[0])
        cap = capture_overhead(srv.url, few, args.max_new_tokens)
        loads.append(os.getloadavg()[0])
    s = res.summary
    pr = res.per_request[res.per_request["has_spec"]]
    per_req_al = (pr["completion_tokens"] / pr["verify_ct"]).to_numpy(float)
    need["sd"] = float(per_req_al.std(ddof=1))

    raw = {"summary": s, "need": need, "client_overhead": over, "capture": cap, "startup_s": startup,
           "measure_s": measure_s, "summarize_s": summarize_s, "models": kind, "loads": loads,
           "overhead_prompts": len(few), "per_request_mean": float(per_req_al.mean()),
           "when": time.strftime("%Y-%m-%d %H:%M")}
    text = results_text(raw, args)
    print("\n" + text)
    data = ROOT / "bench" / "data"
    data.mkdir(parents=True, exist_ok=True)
    atomic_write_text(data / "bench_acceptance.json", json.dumps(raw, indent=1, default=str))
    if args.write_results:
        print(f"\nwrote {write_results(text)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
