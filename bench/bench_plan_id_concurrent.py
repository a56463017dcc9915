"""Plan identification without training data (``investigate``'s ``identify_stage``) with the server's continuations
written one request at a time (as before: :meth:`helpers.engines.base.EngineAdapter.capture_served`, hidden states
returned, the prefix cache flushed before each request) and concurrently (token ids only, ``IDENTIFY_CONCURRENCY``
requests in flight, the cache flushed once: :meth:`~helpers.engines.base.EngineAdapter.continuations`, what
``identify_stage`` runs now), side by side on one running server, in the same rounds as ``identify_stage``: 16 seeded
prompts, then 16 more when undecided. Each arm: continuations, the server's every-layer reference of its tokens,
``identify_plan`` (the second round with the first round's memo). Optionally a third arm: tokens only, one request at
a time (``--one``), to tell the gain of dropping the hidden states from that of concurrency.

Compared: every prompt's tokens (prompt and continuation) and, per round, the identification (decision, plan, every
candidate's per-sequence loss and hits, margins and CIs): equal, or exit 1.

    # a server with the every-layer capture (as investigate's live test starts it)
    .venv/bin/python -m helpers server start --draft DRAFT --tp 2 --detach --capture-layers /tmp/x/layers
    PYTHONPATH=$PWD .venv/bin/python bench/bench_plan_id_concurrent.py --url URL --layers-dir /tmp/x/layers \
        --draft DRAFT [--rounds 2] [--one]

Prints one JSON line per arm and round, then the totals (one round: a plan decided on the first prompts; two rounds:
undecided on them) and the ratio sequential / concurrent; the figures go in bench/RESULTS.md."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.draft.model import Eagle3Draft  # noqa: E402
from helpers.draft.plan_id import TargetHead, identify_plan, reference_from_dump  # noqa: E402
from helpers.draft.sequences import dump_sequences  # noqa: E402
from helpers.engines.detect import detect  # noqa: E402
from helpers.formats.configs import read_draft_config, read_target_config  # noqa: E402
from helpers.investigation import identify  # noqa: E402

M = ROOT / "env" / "models"


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def same(a, b) -> bool:
    """The same decision, plan, margins, CIs, and every candidate's figures bit for bit (its own run time aside)."""
    ja, jb = a.to_json(), b.to_json()
    ja.pop("offline_seconds"), jb.pop("offline_seconds")
    return ja == jb and all(np.array_equal(x.loss_sum, y.loss_sum) and np.array_equal(x.hits, y.hits)
                            for x, y in zip(a.scores, b.scores))


def sequential(r, first: int, n: int, name: str):
    """The continuations as identify_stage wrote them before: capture_served, one request at a time, hidden states
    returned, the cache flushed before each; then the same every-layer reference."""
    dumps = r.req.run_dir / "dumps"
    ps = load_prompts(None, n=first + n)[first:]
    sampling = {**identify.IDENTIFY_SAMPLING, "sampling_seed": identify.IDENTIFY_SAMPLING["sampling_seed"] + first}
    t0 = time.perf_counter()
    served = r.adapter.capture_served(r.client, ps, dumps, name=f"{name}-continuations",
                                      max_new_tokens=identify.IDENTIFY_TOKENS, sampling=sampling,
                                      max_width=16 * r.tcfg.hidden_size)
    seqs = dump_sequences(served)
    t_cont = time.perf_counter() - t0
    toks = [{"id": s.key, "input_ids": [int(x) for x in s.tokens]} for s in seqs]
    ref, _, _ = identify.every_layer_reference(r.adapter, r.att, r.client, toks, r.req.run_dir,
                                               r.tcfg.num_hidden_layers, name=f"{name}-reference")
    return reference_from_dump(ref, starts={s.key: s.start for s in seqs}), toks, t_cont


def concurrent(r, first: int, n: int, name: str, concurrency: int):
    """identify_stage's own continuations (identify._continuations) at ``concurrency`` requests in flight."""
    old = identify.IDENTIFY_CONCURRENCY
    identify.IDENTIFY_CONCURRENCY = concurrency
    try:
        t0 = time.perf_counter()
        refs, _, served = identify._continuations(r, first, n, name)
        total = time.perf_counter() - t0
    finally:
        identify.IDENTIFY_CONCURRENCY = old
    doc = json.loads(Path(served).read_text())
    toks = [{"id": c["id"], "input_ids": c["prompt_ids"] + c["output_ids"]} for c in doc["continuations"]]
    return refs, toks, total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--layers-dir", required=True, help="the server's --capture-layers folder")
    ap.add_argument("--draft", required=True, help="the draft folder the server runs")
    ap.add_argument("--target", default=str(M / "target"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=identify.IDENTIFY_CONCURRENCY)
    ap.add_argument("--one", action="store_true", help="also tokens only, one request at a time")
    ap.add_argument("--also", type=int, action="append", default=[], metavar="N",
                    help="also tokens only at N requests in flight (arm concurrentN; repeatable)")
    ap.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    ap.add_argument("--temperature", type=float, default=None,
                    help="override identify's temperature (0: greedy, to compare the tokens themselves: SGLang 0.5.23 "
                         "ignores sampling_seed without --enable-deterministic-inference, so the sampled first token "
                         "of each answer differs between any two runs)")
    a = ap.parse_args()
    if a.temperature is not None:
        identify.IDENTIFY_SAMPLING = {**identify.IDENTIFY_SAMPLING, "temperature": a.temperature}
    print(json.dumps({"uptime": load(), "prompts": identify.IDENTIFY_PROMPTS, "new_tokens": identify.IDENTIFY_TOKENS,
                      "concurrency": a.concurrency, "rounds": a.rounds, "sampling": identify.IDENTIFY_SAMPLING}),
          flush=True)
    adapter = detect(a.url).adapter
    client = adapter.client(a.url, generate_timeout=600.0)
    out = Path(a.out or tempfile.mkdtemp(prefix="bench-plan-id-concurrent-"))
    target, draft_dir = Path(a.target), Path(a.draft)
    att = SimpleNamespace(layers_dir=Path(a.layers_dir), target_dir=target, draft_dir=draft_dir)
    tcfg = read_target_config(target)
    draft = Eagle3Draft.load(draft_dir, target)
    ids, head = read_draft_config(draft_dir).nested_layer_ids, TargetHead.load(target)
    arms = ["sequential", "concurrent"] + (["one"] if a.one else []) + [f"concurrent{n}" for n in a.also]
    flight = {"concurrent": a.concurrency, "one": 1, **{f"concurrent{n}": n for n in a.also}}
    state = {arm: {"refs": [], "memo": {}, "secs": [], "ident": None} for arm in arms}
    bad = 0
    for k in range(a.rounds):
        first, n = k * identify.IDENTIFY_PROMPTS, identify.IDENTIFY_PROMPTS
        toks: dict = {}
        for arm in arms:
            r = SimpleNamespace(req=SimpleNamespace(run_dir=out / arm), adapter=adapter, client=client, att=att,
                                tcfg=tcfg)
            t0 = time.perf_counter()
            if arm == "sequential":
                more, toks[arm], t_cont = sequential(r, first, n, f"identify-{k}")
            else:
                more, toks[arm], _ = concurrent(r, first, n, f"identify-{k}", flight[arm])
                t_cont = None       # timed with its reference (identify._continuations does both)
            t_ref = time.perf_counter() - t0
            st = state[arm]
            st["refs"] = st["refs"] + more
            t1 = time.perf_counter()
            st["ident"] = identify_plan(draft, st["refs"], head, config_ids=ids, memo=st["memo"])
            t_id = time.perf_counter() - t1
            st["secs"].append(t_ref + t_id)
            print(json.dumps({"arm": arm, "round": k, "continuations_s": None if t_cont is None else round(t_cont, 2),
                              "continuations_and_reference_s": round(t_ref, 2), "identify_plan_s": round(t_id, 2),
                              "round_s": round(t_ref + t_id, 2), "decision": st["ident"].decision,
                              "plan": st["ident"].plan, "sentence": st["ident"].sentence(), "load": os.getloadavg()}),
                  flush=True)
        for arm in arms[1:]:
            eq_t = toks[arm] == toks["sequential"]
            eq_i = same(state[arm]["ident"], state["sequential"]["ident"])
            diff = [x["id"] for x, y in zip(toks[arm], toks["sequential"]) if x != y]
            print(json.dumps({"round": k, "compare": f"{arm} vs sequential", "same_tokens": eq_t,
                              "prompts_differing": diff, "same_identification": eq_i}), flush=True)
            bad += (not eq_t) + (not eq_i)
    for arm in arms:
        s = state[arm]["secs"]
        print(json.dumps({"arm": arm, "one_round_s": round(s[0], 2),
                          "two_rounds_s": round(sum(s[:2]), 2) if len(s) > 1 else None}), flush=True)
    s0, c0 = state["sequential"]["secs"], state["concurrent"]["secs"]
    print(json.dumps({"ratio_one_round": round(s0[0] / c0[0], 2),
                      "ratio_two_rounds": round(sum(s0[:2]) / sum(c0[:2]), 2) if len(s0) > 1 else None,
                      "uptime_end": load(), "differences": bad}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
