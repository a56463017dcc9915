"""``python -m helpers measure``: measure one server, or run a fixes file (managed mode).

Exit codes (:mod:`helpers.cli.common`): 0 measured with every request answered; 1 the server failed, a request
failed (the measurement is still saved, with ``n_failed``), or a fix could not be measured; 2 bad input (a run
folder whose ledger cannot be read: the new measurement is kept, and the message gives the command that rebuilds the
ledger, ``measure --rebuild-ledger RUN_DIR``: 0 rebuilt, 1 a measurement folder could not be read and was left
out)."""
from __future__ import annotations

import json
import os
import sys
from typing import Sequence

from ..acceptance.fixes import FixFailed, load_fixes, run_fixes
from ..acceptance.ledger import Ledger
from ..acceptance.measure import (
    SUMMARY_COLUMNS,
    _json_default,
    failed_requests,
    format_summary,
    measure,
    rebuild_ledger,
)
from ..acceptance.prompts import load_prompts
from ..budget import Budget
from ..errors import BadInput, RunFailed, printable
from ..runfiles import new_run_dir
from ..server.client import check_url
from ..engines.detect import detect_or
from .common import Parser, failure_guard, out_folder, progress_line, run, run_folder_arg, text_arg

DEFAULT_TIMEOUT = 3600.0


def build_parser() -> Parser:
    ap = Parser(prog="python -m helpers measure",
                description="Accept length / accept rate / per-position acceptance / tok/s with 95% CIs. "
                            "Attach to a server (--url) or run a fixes file (--fixes). The API key is read "
                            "from $SGLANG_API_KEY (never from the command line).")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="server URL, e.g. http://127.0.0.1:30000")
    src.add_argument("--fixes", help="fixes YAML file (managed mode: a server per fix)")
    src.add_argument("--rebuild-ledger", metavar="RUN_DIR",
                     help="rebuild RUN_DIR/ledger.parquet from its measurement folders (fixes/, acceptance/), keeping "
                          "the old file beside it (ledger.parquet.corrupt-<stamp>); measures nothing")
    ap.add_argument("--label", default=None, help="fix name for this measurement (a repeated label gets its own "
                                                  "folder: fixes/<label>-2, ...)")
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
    ap.add_argument("--run-dir", default=None, help="an existing run folder to append to (ledger.parquet)")
    ap.add_argument("--timeout", type=float, default=None,
                    help=f"overall budget in seconds of the whole run: every request, and with --fixes every server "
                         f"start too (default {DEFAULT_TIMEOUT:.0f} with --url; none with --fixes, where each fix's "
                         "startup_timeout and the request timeouts bound the waits)")
    ap.add_argument("--no-save", action="store_true", help="print only, write nothing")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    return ap


def cli_main(argv: Sequence[str]) -> int:
    """``python -m helpers measure ...`` (module docstring)."""

    def body() -> int:
        args = build_parser().parse_args(list(argv))
        for flag, url in (("--url", args.url), ("--baseline-url", args.baseline_url)):
            if url is not None:
                check_url(url, flag)               # before any folder or request
        if args.rebuild_ledger is not None:
            return _rebuild(run_folder_arg(args.rebuild_ledger, "--rebuild-ledger"))
        outputs = out_folder(args.outputs, "--outputs")
        given_run = run_folder_arg(args.run_dir)
        text_arg(args.label, "--label")
        if args.timeout is not None and not args.timeout > 0:
            raise BadInput(f"--timeout must be > 0 seconds, got {args.timeout}")
        if args.fixes:
            fixes = load_fixes(args.fixes)
            run_dir = given_run or new_run_dir(fixes.name, outputs=outputs)
            with failure_guard("measure", run_dir, owned=given_run is None, complete=(FixFailed,)):
                run_fixes(fixes, run_dir=run_dir, progress=not args.quiet, budget=Budget(args.timeout))
                df = Ledger(run_dir / "ledger.parquet").read()
            cols = [c for c in SUMMARY_COLUMNS if c in df.columns]
            print(df[["fix"] + [c for c in cols if c != "label"]].to_string(index=False))
            print(f"run folder: {run_dir}")
            return 0
        prompts = load_prompts(args.prompts, n=args.num_prompts)
        key = os.environ.get("SGLANG_API_KEY") or None
        budget = Budget(args.timeout or DEFAULT_TIMEOUT)   # the command's one deadline: detection, then requests
        show = progress_line("measure")
        adapter = detect_or(args.url, key, budget=budget, on_wait=show)    # the engine, once
        client = adapter.client(args.url, key, budget=budget, on_wait=show)
        try:
            res = measure(client, prompts, max_new_tokens=args.max_new_tokens, concurrency=args.concurrency,
                          temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=args.warmup,
                          flush_cache=not args.no_flush, n_boot=args.bootstrap, baseline=args.baseline_url,
                          label=args.label, requested=args.requested, progress=not args.quiet)
        finally:
            client.close()
        if args.json:
            print(json.dumps(res.summary, indent=1, default=_json_default))
        else:
            print(printable(format_summary(res.summary)))
            if len(res.positions):
                print(res.positions.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
        for w in res.warnings:
            print(f"warning: {printable(w)}", file=sys.stderr)
        if not args.no_save:
            run_dir = given_run or new_run_dir(f"measure-{args.label or 'server'}", outputs=outputs)
            with failure_guard("measure", run_dir, owned=given_run is None):
                saved = res.record(run_dir, args.label or "server")
            print(f"run folder: {run_dir} (this measurement: {saved.relative_to(run_dir)})")
        line = failed_requests(res.per_request)
        if line:
            raise RunFailed(f"{line}; see per_request.parquet, column error; the measurement was saved with n_failed")
        return 0

    return run("measure", body)


def _rebuild(run_dir) -> int:
    """``measure --rebuild-ledger RUN_DIR``: :func:`helpers.acceptance.measure.rebuild_ledger`, one line per folder
    left out (stderr), one line of what was done (stdout); exit 1 when a folder was left out."""
    done = rebuild_ledger(run_dir)
    for line in done.skipped:
        print(f"warning: left out: {printable(line)}", file=sys.stderr)
    old = "" if done.kept_old is None else f"; the ledger it replaces was kept as {done.kept_old.name}"
    print(printable(f"rebuilt {done.path}: {len(done.folders)} row(s) from "
                    f"{', '.join(done.folders) or 'no measurement folder'}{old}"))
    if done.skipped:
        raise RunFailed(f"{len(done.skipped)} measurement folder(s) could not be read and are not in the rebuilt "
                        f"ledger (first: {done.skipped[0]})")
    return 0
