"""The acceptance budget on faults it was not shaped on (issue 27 item 6): generated faults (``tests/support/
faultgen.py``: damaged draft tensors, d2t permutations, shifted draft config ids, chunk orders, speculative settings,
draft-side engine hooks, clean draws), offline and on embedded servers, and the confusion table true stage x named
cause with the goal checks.

Offline (``--offline N``): each draw through the budget with no server (``tests/support/fault_offline.py``): the
draft stage on the validation rows, the drafting chain on greedy sequences with every layer of the target (the
served plan of a wiring fault taken from them), an engine fault emulated; the true loss = the drafting chain of the
clean server minus the faulty one, paired per sequence.

Live (``--live N``): per TP size (``--tp 1,2``), one clean embedded server (a clean draw, and the pairing reference
for the live loss), then each fault on its own server (``python -m helpers server start --detach``, stopped by PID),
``investigate`` (python API, no sweeps; ``--apply-wiring K``: the first K wiring faults with the fix applied and
measured), and per fault: true stage, named cause, verdict, the live loss (live accept length of the faulty server vs
the clean server's on the same prompts, paired per prompt), every budget loss with its decision, wall times. The run
stops starting faults once ``--minutes`` are spent.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_faults.py --offline 40 --seed 1
    PYTHONPATH=$PWD .venv/bin/python bench/bench_faults.py --live 16 --tp 1,2 --minutes 50 --seed 2

Writes ``<out>/faults-{offline|live}.jsonl`` (one record per fault, as it finishes) and ``<out>/summary.md`` (the
tables and the goal checks); record them in bench/RESULTS.md with the date and the load.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support.fault_offline import (MATERIAL_LIVE, confusion, dominated_loss, fmt, goal_checks, record,  # noqa: E402
                                   table_markdown)
from support.faultgen import CLASSES, CLEAN_SETTINGS, SYSTEMS, GenFault, System, draws  # noqa: E402

PY = str(ROOT / ".venv" / "bin" / "python")


def log(msg: str) -> None:
    print(f"[bench_faults {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def line(r: dict) -> str:
    L = r.get("losses") or {}
    dec = " ".join(f"{k}:{(v.get('decision') or '?')[:2]}:{fmt(v.get('delta'))}" for k, v in L.items())
    return (f"{r['stage']:8} {r['label'][:48]:48} loss {fmt(r.get('loss'))} -> {str(r.get('cause')):9} "
            f"{('verdict ' + r['verdict']) if r.get('verdict') else ''} {dec} ({r['wall_s']} s)")


def live_settings_loss(r: dict) -> Optional[float]:
    """A live settings draw's loss in the budget's own terms: the live accept length it loses against the clean
    server's chain (steps 3) when that chain dominates it in the cost model the settings stage uses (accept length /
    (1 + steps x draft cost)), from the two servers' LIVE accept lengths (the faulty one, and the clean one = faulty +
    live loss) and the cost the budget applied to each setting (its settings table: accept length / modelled
    speedup); 0 for settings modelled faster (a trade: the budget notes it). None for another class or a record
    without its run folder."""
    if r.get("class") != "settings" or r.get("loss") is None or not r.get("run_dir"):
        return None
    try:
        doc = json.loads((Path(r["run_dir"]) / "investigation.json").read_text())
    except (OSError, ValueError):
        return None
    table = {(x["steps"], x["topk"], x["draft_tokens"]): x for x in (doc.get("acceptance") or {}).get(
        "settings_table") or []}
    served, clean = tuple(r["params"]["settings"]), CLEAN_SETTINGS
    if served not in table or clean not in table or not (r.get("stages") or {}).get("live"):
        return None
    cost = {k: table[k]["accept_length"] / table[k]["speedup_model"] for k in (served, clean)}
    al_f = r["stages"]["live"]
    return dominated_loss(al_f + r["loss"], al_f, cost[clean], cost[served])


def summary(rows: list[dict], title: str) -> str:
    for r in rows:                          # a live settings draw: the loss the budget answers for
        if r.get("settings_loss") is None and r.get("class") == "settings":
            r["settings_loss"] = live_settings_loss(r)
    g = goal_checks(rows)
    out = [f"### {title}", "", f"{len(rows)} faults; load {load()} at the end", "",
           table_markdown(confusion(rows)), "",
           f"* wrong cause: {len(g['wrong_cause'])}",
           f"* false alarms on clean draws: {len(g['false_alarm'])}",
           f"* `none` on a true loss >= {MATERIAL_LIVE}: {len(g['none_on_material_loss'])}",
           f"* undecided: {len(g['undecided'])}"]
    if "verdict" in (rows[0] if rows else {}):
        ok_loss = [r for r in rows if r.get("verdict") == "ok" and (r.get("loss") or 0) >= MATERIAL_LIVE]
        out.append(f"* verdict `ok` on a live loss >= {MATERIAL_LIVE}: {len(ok_loss)}")
    for r in rows:
        if r.get("class") == "settings":
            out.append(f"  * settings draw {r['label']} (TP {r.get('tp')}): accept-length loss {fmt(r.get('loss'))}, "
                       f"of it lost to settings the clean chain dominates in the budget's cost model "
                       f"{fmt(r.get('settings_loss'))} -> {r.get('cause')}")
    for name in ("wrong_cause", "false_alarm", "none_on_material_loss", "undecided"):
        for r in g[name]:
            out.append(f"  * {name}: {r['label']} (seed {r['seed']}): true loss {fmt(r.get('loss'))}, cause "
                       f"{r['cause']}; " + "; ".join(f"{k} {fmt(v.get('delta'))} {v.get('ci')} {v.get('decision')}"
                                                    for k, v in (r.get('losses') or {}).items()))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------ offline

def offline(n: int, seed: int, out: Path, classes=CLASSES) -> list[dict]:
    from support.fault_offline import OfflineMatrix

    t0 = time.monotonic()
    m = OfflineMatrix(out / "offline")
    log(f"offline setup {time.monotonic() - t0:.0f} s (load {load()})")
    rows = []
    with open(out / "faults-offline.jsonl", "a") as fh:
        for f in draws(n, seed, classes):
            try:
                r = m.run(f)
            except Exception as exc:            # a draw the budget cannot run is a result too
                r = record(f, None, loss=None, loss_ci=None, wall_s=0.0, error=repr(exc))
            rows.append(r)
            fh.write(json.dumps(r) + "\n")
            fh.flush()
            log(line(r))
    return rows


def wiring_sweep(out: Path) -> list[dict]:
    """Every wiring fault of the generator's space (all config-id triples, all chunk orders): the wiring stage as a
    live run computes it (the draft on the training data's samples, their trained plan vs the served plan, both taken
    from an every-layer HF reference of the training tokens; paired, decided by ``helpers.draft.decide``) against the
    true loss on the 64 greedy sequences of the offline matrix."""
    import itertools

    from helpers.capture import capture_reference_hf
    from helpers.draft.budget import _loss, _paired_loss, plan_sequences, training_sequences
    from helpers.draft.model import compute_threads
    from helpers.draft.simulate import simulate_sequences, summary
    from helpers.formats.training_data import TrainingData
    from helpers.paths import REFERENCE_TARGET, REFERENCE_TRAINING
    from support.fault_offline import CLEAN, OfflineMatrix
    from support.faultgen import TRAINED_IDS

    m = OfflineMatrix(out / "sweep")
    train = training_sequences(TrainingData(REFERENCE_TRAINING, hidden_size=128))
    with compute_threads(1):
        ref = capture_reference_hf(REFERENCE_TARGET, [{"id": s.key, "input_ids": s.tokens.tolist()} for s in train],
                                   out / "sweep", name="training-every-layer", progress=False)
    faults = [GenFault(0, "layer_offset", {"ids": list(ids)}) for ids in itertools.combinations(range(-1, 7), 3)
              if ids != TRAINED_IDS]
    faults += [GenFault(0, "chunk_order", {"order": list(o)}) for o in itertools.permutations(range(3))
               if list(o) != [0, 1, 2]]
    st = CLEAN
    t_frame = simulate_sequences(m.draft, plan_sequences(ref, ["out(1)", "out(3)", "out(4)"], train),
                                 [st])["per_request"][st]
    ref_al = summary(t_frame, st.steps)["accept_length"]
    rows = []
    with open(out / "wiring-sweep.jsonl", "a") as fh:
        for f in faults:
            plan = f.served_plan()
            truth = simulate_sequences(m.draft, m.states(plan), [st])["per_request"][st]
            e = __import__("helpers.acceptance.stats", fromlist=["paired_effect"]).paired_effect(m.clean_frame, truth)
            s_frame = simulate_sequences(m.draft, plan_sequences(ref, plan, train), [st])["per_request"][st]
            d, lo, hi, n, per = _paired_loss(t_frame, s_frame)
            w = _loss("wiring", d, lo, hi, "sweep", ref_al, n=n, unit="training samples", per_sequence=per)
            r = {"label": f.label, "plan": plan, "loss": -e["accept_length_delta"],
                 "loss_ci": [-e["accept_length_delta_hi"], -e["accept_length_delta_lo"]],
                 "wiring": {k: w.get(k) for k in ("delta", "ci", "decision", "threshold", "settle", "small_n")},
                 "n": n}
            rows.append(r)
            fh.write(json.dumps(r) + "\n")
            log(f"{f.label:24} plan {plan}: true loss {fmt(r['loss'])} [{fmt(r['loss_ci'][0])}, "
                f"{fmt(r['loss_ci'][1])}]; wiring stage on {n} training samples {fmt(d)} [{fmt(w['ci'][0])}, "
                f"{fmt(w['ci'][1])}] (bootstrap [{fmt(lo)}, {fmt(hi)}]) {w['decision']}")
    return rows


# ------------------------------------------------------------------------------------------------ live

def _cli(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "helpers", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def start_server(tmp: Path, draft: Path, tp: int, args: list[str]) -> tuple[str, int]:
    out = _cli("server", "start", "--draft", str(draft), "--tp", str(tp), "--detach", "--timeout", "1200", *args)
    if out.returncode:
        raise RuntimeError(f"server start failed (exit {out.returncode}): {out.stderr[-1500:]}")
    url = re.search(r"ready: (http://127\.0\.0\.1:\d+)", out.stdout).group(1)
    pid = int(re.search(r"\(pid (\d+)", out.stdout).group(1))
    return url, pid


class LiveSpy:
    """Keeps the live per-request frame ``run_budget`` measured (the same /generate answers the engine stage used),
    for the pairing with the clean server's."""

    def __init__(self):
        import helpers.investigation.live as live

        self.mod, self.orig, self.last = live, live.run_budget, None

        def wrapped(**kw):
            br = self.orig(**kw)
            self.last = br.live
            return br

        live.run_budget = wrapped


def live_run(n: int, seed: int, tps: list[int], minutes: float, apply_wiring: int, out: Path,
             classes=CLASSES, refs_dir: Path | None = None, system: System = SYSTEMS["llama"]) -> list[dict]:
    from helpers.acceptance.stats import paired_effect
    from helpers.investigation.live import investigate
    from helpers.server.process import stop_pid

    os.environ["E3F_SERVER_REGISTRY"] = str(out / "registry")
    spy = LiveSpy()
    deadline = time.monotonic() + minutes * 60
    faults = [f for f in draws(n, seed, classes, system) if f.cls != "clean"]
    rows: list[dict] = []
    applied = 0
    fh = open(out / "faults-live.jsonl", "a")
    import pandas as pd

    refs: dict[int, object] = {}
    for tp in tps:                       # a clean reference measured by an earlier run (--refs): no clean server
        f = (refs_dir or out) / f"ref-tp{tp}.parquet"
        if refs_dir is not None and f.exists():
            refs[tp] = pd.read_parquet(f)
            log(f"TP {tp}: the clean server's live frame from {f}")
    # the clean server of every TP size first (the pairing reference), then the faults in turn over the TP sizes
    # (the TP size shifts by one every round of the classes, so every class meets every TP size)
    k = max(1, len([c for c in classes if c != "clean" and c in system.classes]))
    plan = [(tp, GenFault(seed * 1000 + tp, "clean", {}, system)) for tp in tps if tp not in refs]
    # the c-th class of round r at TP (c + r): every class meets every TP over the rounds (one class alternates)
    plan += [(tps[(i % k + i // k) % len(tps)], f) for i, f in enumerate(faults)]
    for tp, f in plan:
        if time.monotonic() > deadline:
            log(f"time is up ({minutes} min): {f.label} at TP {tp} not started")
            continue
        if f.cls != "clean" and refs.get(tp) is None:
            log(f"no clean reference at TP {tp}: {f.label} not run")
            continue
        tmp = Path(tempfile.mkdtemp(prefix=f"faults-{f.seed}-", dir=out))
        t0 = time.monotonic()
        pid = None
        rec: dict = {}
        try:
            draft = f.draft_copy(tmp / "draft")
            url, pid = start_server(tmp, draft, tp, f.server_args())
            t_start = time.monotonic() - t0
            log(f"TP {tp} {f.label}: server up in {t_start:.0f} s (load {load()})")
            apply = f.stage == "wiring" and applied < apply_wiring
            spy.last = None
            doc = investigate(url, training=system.training, run_dir=tmp / "run", apply_fix=apply, measure_prompts=16,
                              max_new_tokens=32, sweeps=(), timeout=1500)
            applied += int(apply)
            live = spy.last
            b = doc.acceptance
            if f.cls == "clean" and live is not None:
                refs[tp] = live
                live.to_parquet(out / f"ref-tp{tp}.parquet")
            loss = ci = None
            if live is not None and refs.get(tp) is not None:
                e = paired_effect(refs[tp], live)
                loss, ci = -e["accept_length_delta"], [-e["accept_length_delta_hi"], -e["accept_length_delta_lo"]]
            st = {s["name"]: s.get("accept_length") for s in (b or {}).get("stages", [])}
            rec = record(f, b, loss=loss, loss_ci=ci, wall_s=time.monotonic() - t0, tp=tp, system=system.name,
                         verdict=doc.verdict, findings=[x.kind for x in doc.findings],
                         proposed_fix=doc.proposed_fix.summary if doc.proposed_fix else None,
                         measured={k: (doc.measured or {}).get(k) for k in ("effect", "after_verdict")}
                         if apply else None, server_start_s=round(t_start, 1),
                         investigate_s=doc.wall_s, stages=st, applied=apply, run_dir=str(tmp / "run"))
        except Exception as exc:
            rec = record(f, None, loss=None, loss_ci=None, wall_s=time.monotonic() - t0, tp=tp, system=system.name,
                         error=f"{type(exc).__name__}: {str(exc)[-800:]}")
            log(traceback.format_exc(limit=3))
        finally:
            if pid is not None:
                stop_pid(pid)
        rows.append(rec)
        fh.write(json.dumps(rec, default=str) + "\n")
        fh.flush()
        log(f"TP {tp} " + line(rec) + (f" ERROR {rec['error'][:300]}" if rec.get("error") else ""))
    fh.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--offline", type=int, default=0, help="offline draws")
    p.add_argument("--live", type=int, default=0, help="live faults (clean servers come on top, one per TP)")
    p.add_argument("--wiring-sweep", action="store_true", help="every wiring fault of the generator's space: the "
                   "wiring stage on the training samples vs the true loss")
    p.add_argument("--tp", default="1,2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=50.0, help="no live fault is started after this")
    p.add_argument("--apply-wiring", type=int, default=2, help="wiring faults investigated with the fix applied")
    p.add_argument("--classes", default=",".join(CLASSES), help="fault classes to draw")
    p.add_argument("--refs", default=None, help="a folder of an earlier live run: its clean servers' live frames "
                   "(ref-tp<N>.parquet) are the pairing reference, no clean server is started")
    p.add_argument("--system", default="llama", choices=sorted(SYSTEMS),
                   help="the served system faults are drawn for (tests/support/faultgen.py SYSTEMS): llama (the "
                        "reference, SGLang), kimi / kimi-mla (the Kimi-class target with its Llama-style / MLA draft, "
                        "SGLang), vllm (the head_dim-64 pair on vLLM 0.32.0); --offline and --wiring-sweep: llama only")
    p.add_argument("--report", nargs="+", default=None, metavar="DIR",
                   help="no run: the tables of earlier live runs' folders (their faults-live.jsonl) together")
    p.add_argument("--out", default=None, help="output folder (default: a new one under outputs/)")
    a = p.parse_args()
    if a.report:
        rows = []
        for d in a.report:
            f = Path(d) / "faults-live.jsonl"
            if not f.is_file():
                p.error(f"--report {d}: no faults-live.jsonl there (expected the folder of a live run)")
            for i, x in enumerate(f.read_text().splitlines(), 1):
                try:
                    rows += [json.loads(x)] if x.strip() else []
                except ValueError as exc:
                    p.error(f"--report {f}:{i}: not a JSON record ({exc})")
        if not rows:
            p.error(f"--report {', '.join(a.report)}: no fault records")
        print(summary(rows, f"live, {len(rows)} servers from {', '.join(Path(d).name for d in a.report)}"))
        return 0
    out = Path(a.out or ROOT / "outputs" / f"{time.strftime('%Y%m%d-%H%M%S')}-bench-faults")
    out.mkdir(parents=True, exist_ok=True)
    system = SYSTEMS[a.system]
    if system.name != "llama" and (a.offline or a.wiring_sweep):
        p.error(f"--offline and --wiring-sweep run on the Llama reference only (not --system {a.system})")
    log(f"out {out}; load {load()}; system {system.name} ({system.engine}, target {system.target}, draft "
        f"{system.draft}); classes {', '.join(c for c in a.classes.split(',') if c in system.classes)}")
    parts = []
    t0 = time.monotonic()
    if a.offline:
        rows = offline(a.offline, a.seed, out, a.classes.split(","))
        parts.append(summary(rows, f"offline, {len(rows)} draws, seed {a.seed}, {time.monotonic() - t0:.0f} s"))
    if a.wiring_sweep:
        rows = wiring_sweep(out)
        bad = [r for r in rows if r["wiring"]["decision"] == "clear" and r["loss"] >= MATERIAL_LIVE]
        parts.append(f"### wiring sweep\n\n{len(rows)} wiring faults; the wiring stage on the training samples says "
                     + ", ".join(f"{k} {sum(r['wiring']['decision'] == k for r in rows)}"
                                 for k in ("counts", "clear", "undecided"))
                     + f"; clear on a true loss >= {MATERIAL_LIVE}: {len(bad)} ("
                     + "; ".join(f"{r['label']}: {fmt(r['loss'])} vs {fmt(r['wiring']['delta'])}" for r in bad) + ")")
    if a.live:
        t1 = time.monotonic()
        rows = live_run(a.live, a.seed, [int(x) for x in a.tp.split(",")], a.minutes, a.apply_wiring, out,
                        a.classes.split(","), Path(a.refs) if a.refs else None, system)
        parts.append(summary(rows, f"live, {system.name} ({system.engine}), TP {a.tp}, seed {a.seed}, "
                                   f"{time.monotonic() - t1:.0f} s"))
    text = "\n\n".join(parts)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
