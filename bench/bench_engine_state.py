"""The engine-state probes (helpers.investigation.probes) on generated engine faults they were not shaped on (issue 36
item 7).

Each case is one embedded SGLang server (``python -m helpers server start --reference-draft --trace-draft DIR
--detach``, stopped by its PID) with a fault drawn by ``tests/support/engine_faults.py::draws`` (classes x seeds x
strengths, strong and weak tiers, clean servers first): ``draft_kv_stale`` (the draft KV of a cached prefix replaced
by noise), ``chunk_boundary_token`` (a wrong draft input id at later chunks' first rows), ``kv_wrong_slot`` (the
draft's decode KV over the previous slot: wrong from step 2), ``draft_decay`` (the draft's fc scaled after N
requests), ``verify_swap`` (target verify emits its runner-up), ``sampled_verify`` (at temperature > 0 a share of
verify steps accepts a draft only when an independent sample of the target equals it: ``tests/support/
verify_faults.py``, on for the server's life), ``clean``; then every probe the way ``investigate --engine-probes
all`` runs them (:func:`helpers.investigation.probes.run_probes`: repeatable, served_draft, step_trace, radix_hit and
sampled_verify (16 prompts at temperature 1.0) on the server; chunked_prefill and greedy_lossless on restarted copies;
the oracle restart has no decision, a floor, and is left out unless ``--with-oracle``). Every case must have run
sampled_verify (a case where it did not is reported ``failed``): a clean server and every other class must leave it
clear. Per case: what the probes name together (:func:`engine_faults.named`: the finding kinds, else failed /
undecided / ok) against the class's expected finding.

The table: true class (and tier) x named. Goals: a clean server is ``ok``; a strong fault is named by its class's
finding; a weak one is its finding, ``undecided`` or ``ok``, never another finding.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_engine_state.py --draws 12 --seed 1 --tp 2 --minutes 50

``--classes sampled_verify,verify_swap --clean 1 --draws 5``: a clean server, then those classes strong, then weak.
The draws of the runs recorded before ``sampled_verify`` was a class are reproduced with ``--classes
draft_kv_stale,chunk_boundary_token,kv_wrong_slot,draft_decay,verify_swap`` (the default is every class).

Writes ``<out>/engine-state.jsonl`` (one record per case, as it finishes) and prints the table; record it in
bench/RESULTS.md with the date and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import helpers.investigation.probes as probes_mod  # noqa: E402
from helpers.acceptance.prompts import load_prompts  # noqa: E402
from helpers.budget import Budget  # noqa: E402
from helpers.engines.detect import detect  # noqa: E402
from helpers.investigation.attach import attach  # noqa: E402
from helpers.investigation.probes import ProbeContext, run_probes  # noqa: E402
from helpers.runfiles import new_run_dir  # noqa: E402
from tests.support.engine_faults import FAULTS, EngineFault, draws, named  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")


def verdict(f: EngineFault, name: str) -> str:
    """``right`` (clean -> ok; a fault -> its finding alone), ``weak-open`` (a weak fault undecided / ok / failed),
    ``missed`` (a strong fault not named: ok / undecided / failed), ``wrong`` (another finding, or a clean server
    not ok)."""
    want = f.expected or "ok"
    if name == want:
        return "right"
    if f.cls == "clean":
        return "wrong"
    if name in ("ok", "undecided", "failed"):
        return "weak-open" if f.tier == "weak" else "missed"
    return "wrong"


def one(f: EngineFault, i: int, out: Path, tp: int, prompts: int, only=None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix=f"e3f-es-{i}-"))
    state, trace = tmp / "srv.json", tmp / "trace"
    trace.mkdir()
    cmd = [PY, "-m", "helpers", "server", "start", "--reference-draft", "--tp", str(tp), "--detach",
           "--state-file", str(state), "--log", str(out / f"server-{i}.log"), "--trace-draft", str(trace)]
    if f.hook_specs():
        cmd += ["--forward-hooks", json.dumps(f.hook_specs())]
    t0 = time.monotonic()
    rec = {**f.to_json(), "i": i, "tp": tp, "load_start": os.getloadavg(), "only": only}
    try:
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    except subprocess.CalledProcessError as exc:
        why = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or ["?"]
        return {**rec, "named": "failed", "verdict": verdict(f, "failed"), "why": f"server start: {why[0]}",
                "probes": {}, "wall_s": round(time.monotonic() - t0, 1)}
    info = json.loads(state.read_text())
    try:
        ad = detect(info["url"], None, deadline_s=30).adapter
        dl = Budget(1200)
        c = ad.client(info["url"], None, timeout=180, budget=dl)
        att = attach(c, caveats=ad.capture_caveats)
        rd = new_run_dir(f"engine-state-{i}", out)
        ctx = ProbeContext(client=c, adapter=ad, att=att, run_dir=rd, prompts=load_prompts(None, n=prompts),
                           max_new_tokens=32, dl=dl,
                           progress=lambda s: print(f"  [{time.strftime('%H:%M:%S')}] {s}", flush=True))
        st = run_probes(ctx, "all", only=only)
        c.close()
    finally:
        subprocess.run([PY, "-m", "helpers", "server", "stop", str(info["pid"])], cwd=ROOT, capture_output=True,
                       timeout=120)
    probes = {p["probe"]: {"status": p["status"], "decision": p["decision"],
                           "delta": (p.get("loss") or {}).get("delta"), "ci": (p.get("loss") or {}).get("ci"),
                           "why": p.get("why"), "kinds": sorted({x["kind"] for x in p.get("findings") or []}),
                           "seconds": p.get("seconds")}
              for p in st["probes"]}
    name = named(st["probes"])
    if probes.get("sampled_verify", {}).get("status") != "ran":   # every case must have asked the sampled question
        sv = probes.get("sampled_verify", {})
        name = "failed" if name in ("ok", "undecided") else name
        rec["why"] = f"sampled_verify {sv.get('status', 'absent')}: {sv.get('why')}"
    return {**rec, "named": name, "verdict": verdict(f, name), "probes": probes, "run_dir": str(rd),
            "wall_s": round(time.monotonic() - t0, 1), "load_end": os.getloadavg()}


def table(recs: list[dict]) -> str:
    """The confusion table, markdown: rows true class (tier), columns what the probes named."""
    cols = sorted({r["named"] for r in recs}, key=lambda c: (c in ("ok", "undecided", "failed"), c))
    rows: dict = {}
    for r in recs:
        key = r["cls"] if r["cls"] == "clean" else f"{r['cls']} ({r['tier']})"
        rows.setdefault(key, {}).setdefault(r["named"], 0)
        rows[key][r["named"]] += 1
    out = ["| true class (expected) | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    exp = {(r["cls"] if r["cls"] == "clean" else f"{r['cls']} ({r['tier']})"): r["expected"] or "ok" for r in recs}
    for k in sorted(rows):
        out.append(f"| {k} ({exp[k]}) | " + " | ".join(str(rows[k].get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def line(r: dict) -> str:
    ps = " ".join(f"{k}:{v['decision'] or v['status']}" + ("" if v["delta"] is None else f":{v['delta']:.2f}")
                  for k, v in r["probes"].items() if k != "repeatable")
    return f"{r['label']:38} tp={r['tp']} -> {r['named']} [{r['verdict']}] {ps} ({r['wall_s']} s)"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draws", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--clean", type=int, default=3, help="clean servers first")
    ap.add_argument("--classes", default=",".join(FAULTS))
    ap.add_argument("--skip", type=int, default=0, help="cases of the draw to leave out (already run)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=50.0)
    ap.add_argument("--with-oracle", action="store_true")
    ap.add_argument("--probes", default=None, help="comma-separated probes to run (run_probes' only; it must hold "
                    "sampled_verify), e.g. the cheap ones and greedy_lossless on a loaded machine (default: all)")
    ap.add_argument("--out", default=str(ROOT / "outputs" / "bench-engine-state"))
    a = ap.parse_args()
    if not a.with_oracle:          # a floor without a decision: it names nothing, and costs a restart per case
        probes_mod.PROBES = tuple(p for p in probes_mod.PROBES if p.name != "oracle")
    only = a.probes.split(",") if a.probes else None
    if only is not None and "sampled_verify" not in only:
        ap.error("--probes: expected a list holding sampled_verify (every case asks the sampled question)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + 60 * a.minutes
    cases = draws(a.draws, a.seed, clean=a.clean, classes=tuple(a.classes.split(",")))
    recs = []
    for i, f in enumerate(cases):
        if i < a.skip:
            continue
        if time.monotonic() > t_end:
            print(f"stopping: {a.minutes} min spent; {len(cases) - i} case(s) not run", flush=True)
            break
        print(f"[{time.strftime('%H:%M:%S')}] case {i}: {f.label}" + ("" if f.cls == "clean" else f" (seed {f.seed})") +
              ", load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        r = one(f, i, out, a.tp, a.prompts, only)
        recs.append(r)
        with open(out / "engine-state.jsonl", "a") as fh:
            fh.write(json.dumps(r) + "\n")
        print(line(r), flush=True)
    print(table(recs))
    v = [r["verdict"] for r in recs]
    print(f"cases {len(recs)}: right {v.count('right')}, wrong {v.count('wrong')}, missed (strong) "
          f"{v.count('missed')}, weak open {v.count('weak-open')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
