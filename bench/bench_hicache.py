"""The host-tier probe ``hicache_hit`` (:mod:`helpers.investigation.probes.hicache`) on the embedded CPU server: what
can be shown here.

1. ``host_tier``: a copy of the embedded server (TP ``--tp``, the reference target and draft) started with the flags the
   SGLang adapter gives a GPU server (``host_cache_launch``: ``--enable-hierarchical-cache``, ``--max-total-tokens``,
   ``--hicache-ratio``, ``--hicache-size 0``); on this CPU build it must fail at start, and the frames of the log's
   traceback are quoted (the function the adapter's CPU refusal cites). The probe's ``applies`` on the live CPU server
   is asked too (goal: skipped, saying why).
2. ``device_eviction``: the probe's own request sequence (:func:`helpers.investigation.probes.hicache.evict_and_resend`:
   each prompt for one token, the fillers, each prompt again) on a server *without* the host tier but with the device
   pool the probe would give (``--max-total-tokens``, :func:`helpers.investigation.probes.hicache.sizes`): the
   resent prompts' ``cached_tokens`` show whether the fillers really evict the prompts' KV from the device pool
   (goal: none cached), against the same prompts resent with no filler (``warm_arm``: every prompt but its last token
   cached); the accept lengths of the cold and resent answers (greedy, one at a time: the same verify steps).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_hicache.py --prompts 8 --tokens 16

Prints one line per step and a JSON summary (``<out>/hicache.json``); record the figures in bench/RESULTS.md with the
date and the load (``os.getloadavg``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.budget import Budget  # noqa: E402
from helpers.engines.sglang import SGLangAdapter  # noqa: E402
from helpers.errors import ServerError  # noqa: E402
from helpers.investigation.probes import ProbeContext  # noqa: E402
from helpers.investigation.probes.cache import _al, cold_arm, warm_arm  # noqa: E402
from helpers.investigation.probes.hicache import HICACHE_HIT, evict_and_resend, fillers, sizes  # noqa: E402
from helpers.paths import REFERENCE_DRAFT, REFERENCE_TARGET  # noqa: E402
from helpers.runfiles import new_run_dir  # noqa: E402


def _restart(tp: int) -> dict:
    return {"kind": "embedded", "launch": {"engine": "sglang", "target": str(REFERENCE_TARGET),
                                           "draft": str(REFERENCE_DRAFT), "tp": tp, "spec": None,
                                           "forward_hooks": None, "extra_args": [], "dtype": "float32", "env": {}}}


def host_tier(a, out: Path) -> dict:
    ad = SGLangAdapter()
    rd = new_run_dir("hicache-start", out)
    launch, _ = ad.host_cache_launch({"device": "cuda"}, device_tokens=1024, host_tokens=4096)
    log = rd / "server.log"
    t = time.monotonic()
    try:
        h = ad.start_variant(_restart(a.tp), log_path=log, budget=Budget(600), flags=launch["flags"],
                             what="the host-tier copy")
        h.stop()
        return {"started": True, "flags": launch["flags"], "seconds": round(time.monotonic() - t, 1)}
    except ServerError as exc:
        err = str(exc).splitlines()[0][:300]
    text = log.read_text(errors="replace") if log.exists() else ""
    frames = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("File ") and "sglang" in ln]
    last = next((ln.strip() for ln in reversed(text.splitlines()) if "Error:" in ln and "Traceback" not in ln), None)
    return {"started": False, "flags": launch["flags"], "error": err, "last_error_line": last,
            "sglang_frames": [f.split("site-packages/")[-1] for f in frames[:12]],
            "seconds": round(time.monotonic() - t, 1), "log": str(log)}


def device_eviction(a, out: Path) -> dict:
    ad = SGLangAdapter()
    rd = new_run_dir("hicache-evict", out)
    prompts = load_prompts(None, n=a.prompts)
    dl = Budget(1200)
    t = time.monotonic()
    # the device pool the probe would give: sized from the prompts' token counts (measured on the server first)
    h0 = ad.start_variant(_restart(a.tp), log_path=rd / "server.log", budget=dl, what="the eviction server")
    try:
        c = ad.client(h0.url, None, timeout=300, budget=dl)
        ctx = ProbeContext(client=c, adapter=ad, att=SimpleNamespace(restart=_restart(a.tp)), run_dir=rd,
                           prompts=prompts, max_new_tokens=a.tokens, dl=dl)
        skip = HICACHE_HIT.applies(ctx)
        cold, outs = cold_arm(ctx)
        n = [int(x) for x in cold["prompt_tokens"]]
        sz = sizes(n, a.tokens)
        c.close()
    finally:
        h0.stop()
    start_s = time.monotonic() - t
    h = ad.start_variant(_restart(a.tp), log_path=rd / "server-small.log", budget=dl,
                         flags={"--max-total-tokens": str(sz["device"])}, what="the small-pool server")
    try:
        c = ad.client(h.url, None, timeout=300, budget=dl)
        ctx = ProbeContext(client=c, adapter=ad, att=None, run_dir=rd, prompts=prompts, max_new_tokens=a.tokens,
                           dl=dl)
        small_cold, _ = cold_arm(ctx)
        warm = warm_arm(ctx)                       # no filler: the control
        fill = fillers(outs, sz["filler"], sz["filler_len"])
        t1 = time.monotonic()
        resent = evict_and_resend(c, ad, prompts, fill, a.tokens)
        seq_s = time.monotonic() - t1
        c.close()
    finally:
        h.stop()
    return {"applies_on_cpu": skip, "prompt_tokens": n, "sizes": sz, "fillers": len(fill),
            "warm_cached_tokens": [int(x) for x in warm["cached_tokens"].fillna(-1)],
            "resent_cached_tokens": [int(x) for x in resent["cached_tokens"].fillna(-1)],
            "resent_host_tokens": [None if x is None or x != x else int(x) for x in resent["host_cached_tokens"]],
            "accept_length": {"cold": _al(small_cold), "warm": _al(warm), "resent": _al(resent)},
            "same_verify_steps": bool((small_cold["verify_ct"].values == resent["verify_ct"].values).all()),
            "sequence_s": round(seq_s, 1), "first_start_and_cold_s": round(start_s, 1),
            "seconds": round(time.monotonic() - t, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-hicache"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rec: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tp": a.tp, "prompts": a.prompts,
                 "tokens": a.tokens, "load_before": os.getloadavg()}
    rec["host_tier"] = host_tier(a, out)
    print("host_tier:", json.dumps(rec["host_tier"], default=str), flush=True)
    rec["device_eviction"] = device_eviction(a, out)
    print("device_eviction:", json.dumps(rec["device_eviction"], default=str), flush=True)
    rec["load_after"] = os.getloadavg()
    (out / "hicache.json").write_text(json.dumps(rec, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
