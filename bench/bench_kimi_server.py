"""Start time of the Kimi-class reference server next to the Llama reference's, at TP 1 / 2 / 8, and where it goes.

For each TP size, ``--runs`` rounds; each round starts the Llama reference (env/models target + EAGLE-3 draft) and
the Kimi-class target (DeepseekV3ForCausalLM) with its MLA EAGLE-3 draft, in alternating order (so a load change
hits both), and records the seconds from ``start()`` to a healthy ``/health``, split by the server log's timestamps
into: **spawn + imports** (launch to the first rank's "Init parallel begin": the launcher, tokenizer manager and
scheduler processes importing SGLang and its model modules), **model init + weights** (to the last "Load weight end":
building the modules, MoE included, and loading both models), and **ready** (KV pools, warm-up request, HTTP up).
Prints a markdown table with the medians, the ratio Kimi / Llama per TP, and the load average before and after.

    .venv/bin/python bench/bench_kimi_server.py                      # TP 1 2 8, 2 rounds (1 at TP 8)
    .venv/bin/python bench/bench_kimi_server.py --tp 2 --runs 3

Kimi-class models: env/models/kimi/{target,draft_mla} when present, else random ones of the same shapes built in a
temporary folder (tests/support/kimi.py; start time does not depend on the weights' values).
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from helpers.server.embedded import REFERENCE_DRAFT, REFERENCE_TARGET, start  # noqa: E402

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")


def _stamps(log: Path, marker: str) -> list[float]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if m and marker in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp())
    return out


def one_start(target: Path, draft: Path, tp: int, log: Path) -> dict:
    t0 = time.time()
    with start(target, draft, tp=tp, timeout=1800, log_path=log):
        total = time.time() - t0
    init = _stamps(log, "Init parallel begin")
    loaded = _stamps(log, "Load weight end")
    phases = {"total": total}
    if init and loaded:
        phases["imports"] = min(init) - t0
        phases["init_weights"] = max(loaded) - min(init)
        phases["ready"] = total - (max(loaded) - t0)
    return phases


def kimi_models(scratch: Path) -> tuple[Path, Path]:
    trained = ROOT / "env" / "models" / "kimi"
    if (trained / "target" / "config.json").is_file() and (trained / "draft_mla" / "config.json").is_file():
        return trained / "target", trained / "draft_mla"
    from support.kimi import build_deepseek_target, build_mla_draft

    target = build_deepseek_target(scratch / "target")
    return target, build_mla_draft(scratch / "mla-draft", target)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--runs", type=int, default=2, help="rounds per TP size (TP 8: at most 1 unless --runs-tp8)")
    ap.add_argument("--runs-tp8", type=int, default=1)
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="e3f-bench-kimi-"))
    kimi_target, kimi_draft = kimi_models(scratch)
    configs = {"llama": (REFERENCE_TARGET, REFERENCE_DRAFT), "kimi": (kimi_target, kimi_draft)}
    load0 = os.getloadavg()
    results: dict[tuple[int, str], list[dict]] = {}
    for tp in args.tp:
        for r in range(args.runs_tp8 if tp == 8 else args.runs):
            order = ("llama", "kimi") if r % 2 == 0 else ("kimi", "llama")
            for name in order:
                ph = one_start(*configs[name], tp, scratch / f"{name}-tp{tp}-{r}.log")
                results.setdefault((tp, name), []).append(ph)
                print(f"tp={tp} {name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in ph.items()), flush=True)
    load1 = os.getloadavg()
    med = lambda rows, k: statistics.median(x[k] for x in rows if k in x) if any(k in x for x in rows) else float("nan")  # noqa: E731
    print(f"\n{datetime.now():%Y-%m-%d %H:%M}, {os.cpu_count()} CPUs, load average {load0[0]:.1f} before, "
          f"{load1[0]:.1f} after; Kimi-class: {kimi_target}")
    print("\n| TP | server | start s (median) | spawn + imports | model init + weights | ready | Kimi / Llama |")
    print("|---|---|---|---|---|---|---|")
    for tp in args.tp:
        ll, kk = results[(tp, "llama")], results[(tp, "kimi")]
        for name, rows in (("Llama reference + EAGLE-3", ll), ("Kimi-class + MLA EAGLE-3", kk)):
            ratio = f"{med(kk, 'total') / med(ll, 'total'):.2f}" if rows is kk else ""
            each = ", ".join(f"{x['total']:.0f}" for x in rows)
            print(f"| {tp} | {name} | {med(rows, 'total'):.1f} ({each}) | "
                  f"{med(rows, 'imports'):.1f} | {med(rows, 'init_weights'):.1f} | {med(rows, 'ready'):.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
