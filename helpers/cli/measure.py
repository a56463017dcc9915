"""``python -m helpers measure``: measure one server, or run a fixes file (managed mode)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from ..acceptance.fixes import FixFailed, load_fixes, run_fixes
from ..acceptance.ledger import Ledger
from ..acceptance.measure import SUMMARY_COLUMNS, _json_default, format_summary, measure
from ..acceptance.prompts import load_prompts
from ..errors import SGLangError
from ..runfiles import new_run_dir, safe_name


def cli_main(argv: Sequence[str]) -> int:
    """``python -m helpers measure ...``: measure one server, or run a fixes file (managed mode).

    Exit codes: 0 ok, 1 measurement failed (server errors), 2 bad input.
    """
    ap = argparse.ArgumentParser(
        prog="python -m helpers measure",
        description="Accept length / accept rate / per-position acceptance / tok/s with 95% CIs. "
                    "Attach to a server (--url) or run a fixes file (--fixes). The API key is read "
                    "from $SGLANG_API_KEY (never from the command line).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="server URL, e.g. http://127.0.0.1:30000")
    src.add_argument("--fixes", help="fixes YAML file (managed mode: a server per fix)")
    ap.add_argument("--label", default=None, help="fix name for this measurement")
    ap.add_argument("--prompts", default=None, help="prompt file (.jsonl/.json); default: bundled set")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-flush", action="store_true", help="do not flush the cache first")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--baseline-url", default=None, help="server without the draft, for baseline tok/s")
    ap.add_argument("--requested", default=None,
                    help="launch command as typed, for the override check (default: the server's own)")
    ap.add_argument("--outputs", default=None, help="outputs folder (default: <repo>/outputs)")
    ap.add_argument("--run-dir", default=None, help="existing run folder to append to (ledger.parquet)")
    ap.add_argument("--no-save", action="store_true", help="print only, write nothing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    try:
        args = ap.parse_args(list(argv))
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2

    if args.fixes:
        try:
            fixes = load_fixes(args.fixes)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        try:
            run_dir = run_fixes(fixes, outputs=args.outputs, run_dir=args.run_dir,
                                           progress=not args.quiet)
        except FixFailed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        df = Ledger(Path(run_dir) / "ledger.parquet").read()
        cols = [c for c in SUMMARY_COLUMNS if c in df.columns]
        print(df[["fix"] + [c for c in cols if c != "label"]].to_string(index=False))
        print(f"run folder: {run_dir}")
        return 0
    try:
        prompts = load_prompts(args.prompts, n=args.num_prompts)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        res = measure(args.url, prompts, max_new_tokens=args.max_new_tokens,
                      concurrency=args.concurrency, temperature=args.temperature,
                      ignore_eos=args.ignore_eos, warmup=args.warmup, flush_cache=not args.no_flush,
                      n_boot=args.bootstrap, baseline=args.baseline_url, label=args.label,
                      requested=args.requested, progress=not args.quiet)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except SGLangError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res.summary, indent=1, default=_json_default))
    else:
        print(format_summary(res.summary))
        if len(res.positions):
            print(res.positions.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    for w in res.warnings:
        print(f"warning: {w}", file=sys.stderr)
    if not args.no_save:
        run_dir = Path(args.run_dir) if args.run_dir else new_run_dir(
            f"measure-{args.label or 'server'}", outputs=args.outputs)
        fix = args.label or "server"
        res.save(run_dir / "fixes" / safe_name(fix))
        Ledger(run_dir / "ledger.parquet").append(res.ledger_row(fix))
        print(f"run folder: {run_dir}")
    return 0
