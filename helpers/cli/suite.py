"""``python -m helpers suite run``: the notebook suite into a new run folder (README "What `make postmortem` does")."""
from __future__ import annotations

import argparse
import sys

from ..errors import BadParams
from ..suite.html import HTML_BUDGET_BYTES
from ..suite.runner import run_suite


def cli_main(argv: list[str]) -> int:
    """``python -m helpers suite run --params FILE.yaml [--out DIR] [--only NB ...]``."""
    ap = argparse.ArgumentParser(prog="python -m helpers suite")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the notebooks into a new run folder")
    r.add_argument("--params", required=True, help="suite params YAML (e.g. env/cases/main.yaml)")
    r.add_argument("--out", default=None, help="parent folder for the run folder (default outputs/)")
    r.add_argument("--only", nargs="+", default=None, help="run only these notebooks")
    args = ap.parse_args(argv)
    try:
        run_dir, status = run_suite(args.params, args.out, args.only, argv=argv)
    except BadParams as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    failed = status["failed"]
    print(f"[suite] run folder: {run_dir}")
    budget = "over the budget of" if status["postmortem_over_budget"] else "budget"
    print(f"[suite] postmortem: {run_dir / 'postmortem.html'} "
          f"({status['postmortem_bytes'] / 1e6:.2f} MB, {budget} {HTML_BUDGET_BYTES / 1e6:.0f} MB; "
          f"suite wall time {status['wall_s']:.0f} s)")
    if failed:
        print(f"[suite] {len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
