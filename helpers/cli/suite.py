"""``python -m helpers suite run``: the notebook suite into a new run folder (docs/postmortem.md)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import BadInput
from ..views.common import read_json_or_none
from ..suite.html import HTML_BUDGET_BYTES
from ..suite.runner import run_suite
from .common import Parser, out_folder, run


def cli_main(argv: list[str]) -> int:
    """``python -m helpers suite run --params FILE.yaml [--out DIR] [--only NB ...]``: exit 0 every notebook ran,
    1 one failed (or the run could not be written), 2 bad params; one line ``suite: error: ...``."""

    def body() -> int:
        ap = Parser(prog="python -m helpers suite")
        sub = ap.add_subparsers(dest="cmd", required=True)
        r = sub.add_parser("run", help="run the notebooks into a new run folder")
        r.add_argument("--params", required=True, help="suite params YAML (e.g. env/cases/main.yaml)")
        r.add_argument("--out", default=None, help="parent folder for the run folder (default outputs/)")
        r.add_argument("--only", nargs="+", default=None, help="run only these notebooks")
        args = ap.parse_args(argv)
        if Path(args.params).is_dir():
            raise BadInput("--params must be a YAML file, not a folder", path=args.params)
        out_folder(args.out, "--out")
        run_dir, status = run_suite(args.params, args.out, args.only, argv=argv)
        failed = status["failed"]
        print(f"[suite] run folder: {run_dir}")
        if "99_postmortem" not in status["notebooks"]:
            print("[suite] postmortem: not run (--only); postmortem.html is a runner page listing what ran")
        elif status.get("postmortem_bytes"):
            budget = "over the budget of" if status["postmortem_over_budget"] else "budget"
            print(f"[suite] postmortem: {run_dir / 'postmortem.html'} "
                  f"({status['postmortem_bytes'] / 1e6:.2f} MB, {budget} {HTML_BUDGET_BYTES / 1e6:.0f} MB; "
                  f"suite wall time {status['wall_s']:.0f} s)")
        settings = (read_json_or_none(run_dir / "results" / "99_postmortem.json") or {}).get("settings")
        if settings:  # the page's settings line, word for word (helpers.views.budget.settings_text)
            print(f"[suite] {settings}")
        if failed:
            print(f"[suite] {len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
            return 1
        return 0

    return run("suite", body)
