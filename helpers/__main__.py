"""Command line: ``python -m helpers <command> ...``.

Each command is ``cli_main(argv) -> int`` in its module of :mod:`helpers.cli` (argument parsing and exit codes;
the work is the library's), imported only when that command runs, so ``diagnose`` stays fast and needs no server
environment:

  investigate  name the fault of a live server, propose and measure the fix        (helpers.cli.investigate)
  diagnose     offline wiring diagnosis: served aux hidden states vs training data  (helpers.cli.diagnose)
  server       start / stop the embedded SGLang or vLLM CPU reference server      (helpers.cli.server)
  capture      dump the aux hidden states a live server feeds the draft            (helpers.cli.capture)
  simulate     the draft run offline as SGLang runs it: accept length by stage      (helpers.cli.simulate)
  measure      accept length / accept rate / tok/s per fix                         (helpers.cli.measure)
  ablate       workload sweeps and engine toggles, each with a paired CI            (helpers.cli.ablate)
  compare-engines  one draft on two servers (SGLang / vLLM), paired per prompt      (helpers.cli.compare_engines)
  replay       replay a case file (fixes, hypotheses, sweep) into a run folder       (helpers.cli.replay)
  watch        acceptance over time: counters + a light probe, a decay detector      (helpers.cli.watch)
  suite        run the notebook suite with papermill, write postmortem.html        (helpers.cli.suite)
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import NoReturn

USAGE = """usage: python -m helpers <command> [options]      (python -m helpers <command> --help)

commands:
  investigate  name the fault of a live server, propose the fix, measure it before/after
  diagnose   offline wiring diagnosis: served aux hidden states vs training data
  server     start / stop the embedded SGLang or vLLM CPU reference server
  capture    dump the aux hidden states a live server feeds the draft
  simulate   run the draft offline as SGLang does: accept length on training / served states
  measure    accept length / accept rate / tok/s per fix
  ablate     acceptance vs context / temperature / concurrency; engine features toggled on a restarted copy
  compare-engines  the same draft on two servers (SGLang / vLLM): paired accept length, the stage a difference
             comes from
  replay     replay a case file (fixes, hypotheses, sweep) into a run folder
  watch      acceptance over time on a running server: a line per interval, a change point with its CI,
             --on-drop investigate
  suite      run the notebook suite with papermill, write postmortem.html

exit codes: 0 ok, 1 findings / failed notebooks / unexpected verdicts, 2 bad input"""

COMMANDS = {
    "investigate": "helpers.cli.investigate",
    "diagnose": "helpers.cli.diagnose",
    "server": "helpers.cli.server",
    "capture": "helpers.cli.capture",
    "simulate": "helpers.cli.simulate",
    "measure": "helpers.cli.measure",
    "ablate": "helpers.cli.ablate",
    "compare-engines": "helpers.cli.compare_engines",
    "replay": "helpers.cli.replay",
    "watch": "helpers.cli.watch",
    "suite": "helpers.cli.suite",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"unknown command '{cmd}'; expected one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd])
    return int(module.cli_main(rest) or 0)


def cli() -> NoReturn:
    """The process entry point (``python -m helpers``, the ``eagle3-forensics`` script): :func:`main`, then
    :func:`exit_with` its code."""
    exit_with(main())


def exit_with(code: int) -> NoReturn:
    """End the process with ``code``. After SIGINT / SIGTERM (130 / 143) the command has already stopped the servers
    it started and marked its run folder (:func:`helpers.cli.common.run`); what else it started still running
    (notebook workers, kernels) is stopped by PID (:func:`helpers.server.process.stop_descendants`), and the process
    ends at once (``os._exit`` after flushing stdout and stderr) instead of tearing down torch, pandas and the like,
    which takes 1-2 s on 2 loaded cores: a signal ends the command within 2 s."""
    if code in (130, 143):
        # lazy: only after a signal (process imports psutil and httpx, which `--help` does not need)
        from .server.process import stop_descendants

        stop_descendants()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()
