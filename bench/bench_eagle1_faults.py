"""Generated EAGLE-1 faults through the single-state budget offline (issue 38 part 2): each seed draws a fault
(``tests/support/eagle1_faults.py``: the fc halves swapped or one scaled, the draft's residual dropped by the engine,
the pre-norm state fed), the budget's stages run with no server (the faulty draft teacher-forced on the committed
validation rows against its training log; the served state identified on HF-recorded states of the live prompts;
the offline chains on reference and served states against the "live" chains the engine runs), and the table says
which stage named it.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_eagle1_faults.py --seeds 20
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from support.eagle1_faults import TARGET, draw, offline_budget  # noqa: E402
from support.mtp_faults import served_world  # noqa: E402


def _ci(x: dict) -> str:
    ci = x.get("ci") or [None, None]
    if x.get("delta") is None or None in ci:
        return f"- {x.get('decision')}"
    return f"{x['delta']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] {x['decision']}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=8, help="live prompts (greedy, 32 new tokens each)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        world = served_world(Path(tmp) / "ref", n_prompts=a.prompts, new_tokens=32, target=TARGET)
        print(f"[world] {a.prompts} prompts ({time.monotonic() - t0:.0f} s)", flush=True)
        for seed in range(a.first, a.first + a.seeds):
            f = draw(seed)
            r = offline_budget(f, Path(tmp), world)
            hit = ("yes" if r["named"] == ["none"] else "NO") if f.stage == "none" else \
                ("yes" if r["named"] == [f.stage] else "also " + ",".join(r["named"]) if f.stage in r["named"]
                 else "NO")
            r["hit"] = hit
            rows.append(r)
            strength = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in f.params.items())
            print(f"seed {seed}: {f.kind}{' (' + strength + ')' if strength else ''} -> named {r['named']} "
                  f"{r['findings'] or ''} [{hit}]; draft {_ci(r['losses']['draft'])}; wiring "
                  f"{_ci(r['losses']['wiring'])}; engine {_ci(r['losses']['engine'])}; served {r['served_state']} "
                  f"({r['seconds']:.1f} s)", flush=True)
    hits = sum(r["hit"] == "yes" for r in rows)
    print(f"[done] {hits}/{len(rows)} named in their stage alone; {time.monotonic() - t0:.0f} s")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
