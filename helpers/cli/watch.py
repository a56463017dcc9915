"""``python -m helpers watch``: acceptance over time on a running server (:mod:`helpers.acceptance.watch`).

Every ``--interval`` seconds: one light probe (a short greedy request on the bundled prompts, in turn) and the
server's ``/metrics`` through its engine adapter; one terminal line and one line of ``<run>/watch.jsonl`` per sample;
the decay detector (:mod:`helpers.acceptance.decay`) on the window. ``--on-drop investigate`` starts the live
investigation (``helpers.investigation.live.investigate``, the fix only proposed) into ``<run>/investigation-N`` once
per drop. Each sample also observes what can change the served draft (:mod:`helpers.acceptance.lifecycle`: a
restart, a weight version or model path, an in-place weight load, the draft checksum with ``--draft-checksum``, the
fixed probe's answer); ``--on-event check-draft`` runs ``investigate --check-draft``
(:func:`helpers.investigation.check_draft.check_draft`) into ``<run>/check-draft-N`` on each sample with events.

Exit codes (:mod:`helpers.cli.common`): 0 stopped by ``--samples`` / ``--duration``; 2 bad input (a flag, a run
folder to resume that is not one, a server that is neither SGLang nor vLLM); 1 the server failed (``/metrics``
unreadable at the start, or ``--max-failures`` samples in a row); 130 / 143 on SIGINT / SIGTERM, after a ``stop``
line: every sample taken is in the log."""
from __future__ import annotations

import itertools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..acceptance.lifecycle import for_server
from ..acceptance.prompts import load_prompts
from ..acceptance.watch import FORMAT, LOG_NAME, MAX_PROBE_TOKENS, Watcher, WatchLog, WatchSettings, check_record, \
    iter_log, probe_once, read_snapshot, run_loop, start_record
from ..budget import Budget
from ..draft.decide import threshold
from ..engines.detect import detect
from ..errors import BadInput, Interrupted
from ..redaction import redact_url
from ..runfiles import new_run_dir
from .common import Parser, failure_guard, input_path_arg, out_folder, progress_line, run, run_folder_arg, text_arg

PROG = "watch"
#: the upper bounds of the numeric flags (seconds unless said): beyond them a value is a typo, not a setting
MAX_INTERVAL_S = 86400.0
MAX_TIMEOUT_S = 86400.0
MAX_WINDOW = 100_000
MAX_COUNT = 10 ** 9


def build_parser() -> Parser:
    p = Parser(prog="python -m helpers watch",
               description="Sample a running SGLang / vLLM server's own acceptance counters (/metrics) and a light "
                           "probe at an interval, with uptime, KV-cache use, cache hit rate and running requests; "
                           "append them to <run>/watch.jsonl; find a change point in the accept length with its CI, "
                           "and optionally start the investigation on a drop. The API key is read from the "
                           "environment variable --api-key-env names.")
    p.add_argument("--url", help="the server's base URL (with --resume: default the run's own)")
    p.add_argument("--resume", metavar="RUN_DIR", help="append to this watch run folder (its watch.jsonl)")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between samples (default 30)")
    p.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    p.add_argument("--samples", type=int, help="stop after this many samples (default: until Ctrl-C)")
    p.add_argument("--prompts", help="prompt file for the probe (.jsonl/.json; default: the bundled set)")
    p.add_argument("--probe-tokens", type=int, default=16, help="tokens the probe generates (default 16; 0: no "
                   "probe)")
    p.add_argument("--probe-timeout", type=float, default=20.0, help="seconds the probe may take (default 20)")
    p.add_argument("--request-timeout", type=float, default=10.0, help="seconds per /metrics read (default 10)")
    p.add_argument("--window", type=int, default=240, help="samples the detector sees (default 240: 2 h at 30 s)")
    p.add_argument("--baseline", type=int, default=10, help="first samples whose mean is the run's baseline "
                   "(default 10)")
    p.add_argument("--drop-below", type=float, metavar="X", help="a drop counts when the accept length after the "
                   "change point is below X")
    p.add_argument("--drop-frac", type=float, metavar="F", help="a drop counts when the accept length after the "
                   "change point lost at least F (0-1) of the baseline")
    p.add_argument("--on-drop", choices=("record", "investigate"), default="record",
                   help="on a drop: record it (default), or also start the investigation (needs --training)")
    p.add_argument("--cooldown", type=float, default=1800.0, help="seconds between two triggered drops, and between "
                   "two --on-event checks started by the fixed probe's answer alone (default 1800)")
    p.add_argument("--on-event", choices=("record", "check-draft"), default="record",
                   help="on a lifecycle event (a restart, a weight version / model path / weight load, the draft "
                   "checksum, the fixed probe's answer changed): record it (default), or also run `investigate "
                   "--check-draft` into <run>/check-draft-N and record its verdict")
    p.add_argument("--no-events", action="store_true", help="observe no lifecycle events (no /server_info, "
                   "/model_info or fixed-probe request per interval)")
    p.add_argument("--draft-checksum", action="store_true", help="also hash the served draft's weights each "
                   "interval (SGLang's POST /weights_checker, selector draft: one pass over the draft's tensors in the "
                   "scheduler's loop; needs the admin key where the server has one)")
    p.add_argument("--check-timeout", type=float, default=300.0, help="budget in seconds of each --on-event "
                   "check-draft (default 300)")
    p.add_argument("--training", help="the draft's training data, for --on-drop investigate")
    p.add_argument("--draft", help="the draft folder, for --on-drop investigate (when the server's is not readable)")
    p.add_argument("--target", help="the target folder, for --on-drop investigate")
    p.add_argument("--investigate-timeout", type=float, default=900.0, help="budget in seconds of each "
                   "investigation (default 900)")
    p.add_argument("--max-failures", type=int, default=3, help="samples failing in a row before exit 1 (default 3)")
    p.add_argument("--out", "--outputs", dest="out", metavar="DIR",
                   help="folder under which the run folder is created (default outputs/); --outputs: the old name")
    p.add_argument("--api-key-env", default="SGLANG_API_KEY", help="NAME of the environment variable holding the "
                   "API key (never the key)")
    p.add_argument("--quiet", action="store_true", help="no line per sample")
    return p


def _check(args: Any) -> None:
    """Every flag checked before any work (one line, exit 2): each number finite and within its bounds, and the
    paths ``--on-event check-draft`` / ``--on-drop investigate`` read, with the checks ``investigate`` makes."""
    secs = {"--interval": (args.interval, MAX_INTERVAL_S), "--probe-timeout": (args.probe_timeout, MAX_TIMEOUT_S),
            "--request-timeout": (args.request_timeout, MAX_TIMEOUT_S),
            "--investigate-timeout": (args.investigate_timeout, MAX_TIMEOUT_S),
            "--check-timeout": (args.check_timeout, MAX_TIMEOUT_S)}
    for flag, (v, most) in secs.items():
        if not (math.isfinite(v) and 0 < v <= most):
            raise BadInput(f"{flag} must be > 0 and <= {most:g} seconds, got {v}")
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        raise BadInput(f"--duration must be > 0 seconds (finite), got {args.duration}")
    for flag, v, low, most in (("--samples", args.samples, 1, MAX_COUNT), ("--window", args.window, 10, MAX_WINDOW),
                               ("--baseline", args.baseline, 1, MAX_WINDOW),
                               ("--max-failures", args.max_failures, 1, MAX_COUNT),
                               ("--probe-tokens", args.probe_tokens, 0, MAX_PROBE_TOKENS)):
        if v is not None and not low <= v <= most:
            raise BadInput(f"{flag} must be >= {low} and <= {most}, got {v}")
    if not (math.isfinite(args.cooldown) and 0 <= args.cooldown <= 30 * MAX_INTERVAL_S):
        raise BadInput(f"--cooldown must be >= 0 and <= {30 * MAX_INTERVAL_S:g} seconds, got {args.cooldown}")
    if args.drop_frac is not None and not 0 < args.drop_frac < 1:
        raise BadInput(f"--drop-frac must be between 0 and 1 (a share of the baseline), got {args.drop_frac}")
    if args.drop_below is not None and not (math.isfinite(args.drop_below) and args.drop_below > 1):
        raise BadInput(f"--drop-below must be an accept length > 1 (tokens per verify step), got {args.drop_below}")
    if args.on_drop == "investigate" and not args.training:
        raise BadInput("--on-drop investigate needs --training (the draft's training data)")
    if args.no_events and (args.on_event != "record" or args.draft_checksum):
        raise BadInput("--no-events observes no lifecycle event: --on-event check-draft and --draft-checksum need them")
    for flag in ("--training", "--draft", "--target", "--prompts"):
        text_arg(getattr(args, flag[2:].replace("-", "_")), flag)
    if args.on_drop == "investigate" or args.on_event == "check-draft":
        # lazy: cli.investigate imports the investigation (torch); only these handlers need its --draft / --target checks
        from .investigate import _folders
        _folders(args)
    if args.on_drop == "investigate":
        training = input_path_arg(args.training, "--training")
        if training is not None and training.is_dir() and not any(training.iterdir()):
            raise BadInput("an empty folder: expected the draft's training data", path=training, field="--training")


def _resumed_start(run_dir: Path) -> dict:
    """The run's first ``start`` line (checked: :func:`helpers.acceptance.watch.check_record`).

    Raises:
        BadInput: the log has no ``start`` line of this tool's format (an unrelated file), naming the file."""
    path = run_dir / LOG_NAME
    for line, rec in iter_log(path, numbered=True):
        if rec.get("kind") == "start":
            if rec.get("format") != FORMAT["format"]:
                raise BadInput(f"line {line}: field 'format' is {str(rec.get('format'))[:40]!r}; expected "
                               f"{FORMAT['format']!r} (not a watch log)", path=path, field="format")
            return check_record(rec, path=path, line=line, now=time.time())
    raise BadInput(f"no start line of format {FORMAT['format']!r}: not a watch log (python -m helpers watch)",
                   path=path)


def _investigator(args: Any, url: str, key: Optional[str], run_dir: Path, show: Any):
    """The ``on_drop`` handler of ``--on-drop investigate``: the live investigation into ``run_dir/investigation-N``
    (the fix only proposed: a monitor never restarts the server), returning what the log records."""

    def on_drop(n: int, decision: Any) -> dict:
        # lazy: the investigation imports torch and the whole diagnosis; a watch without --on-drop never needs it
        from ..investigation import live

        out = run_dir / f"investigation-{n}"
        show(f"drop #{n}: {decision.reason}; investigating into {out}")
        with failure_guard(f"{PROG} investigation-{n}", out):   # a signal or an error: the folder says FAILED
            doc = live.investigate(url, training=args.training, run_dir=out, draft=args.draft, target=args.target,
                                   api_key=key, timeout=args.investigate_timeout, apply_fix=False,
                                   not_applied="started by watch on a drop: the fix is only proposed",
                                   progress=lambda line: show(f"investigation-{n}: {line}"))
        return {"run_dir": str(out), "verdict": getattr(doc, "verdict", None),
                "sentence": getattr(doc, "sentence", None)}

    return on_drop


def _checker(args: Any, url: str, key: Optional[str], run_dir: Path, show: Any):
    """The ``on_event`` handler of ``--on-event check-draft``: ``investigate --check-draft`` into
    ``run_dir/check-draft-N``, returning what the log records (run folder, verdict, reason, exit, seconds)."""

    def on_event(n: int, evs: list, rec: dict) -> dict:
        # lazy: the check imports torch and the draft model; a watch without --on-event check-draft never needs it
        from ..investigation.check_draft import check_draft, verdict_line

        out = run_dir / f"check-draft-{n}"
        # the draft checksum before the event (the sample's own is already the new one)
        before = next((e["before"] for e in evs if e.get("field") == "draft_checksum"),
                      (rec.get("lifecycle") or {}).get("draft_checksum"))
        show(f"event #{n}: {', '.join(e['event'] for e in evs)}; checking the served draft into {out}")
        with failure_guard(f"{PROG} check-draft-{n}", out):     # a signal or an error: the folder says FAILED
            doc = check_draft(url, run_dir=out, draft=args.draft, target=args.target, api_key=key,
                              timeout=args.check_timeout, previous_checksum=before,
                              progress=lambda line: show(f"check-draft-{n}: {line}"))
        show(f"check-draft-{n}: {verdict_line(doc)}")
        return {"run_dir": str(out), "verdict": doc["verdict"], "reason": doc["reason"], "exit": doc["exit"],
                "findings": [f.get("kind") for f in doc["findings"]], "check_seconds": doc["seconds"]}

    return on_event


def cli_main(argv: Sequence[str]) -> int:
    """``python -m helpers watch ...`` (module docstring)."""

    def body() -> int:
        args = build_parser().parse_args(list(argv))
        _check(args)
        outputs = out_folder(args.out, "--out")
        resume = run_folder_arg(args.resume, "--resume")
        if resume is not None and not os.path.lexists(resume / LOG_NAME):
            raise BadInput(f"--resume: no {LOG_NAME} in this folder (not a watch run folder)", path=resume)
        first = _resumed_start(resume) if resume is not None else None
        url = args.url or (first["url"] if first is not None else None)
        if not url:
            raise BadInput("--url is required (or --resume a run folder whose watch.jsonl names its server)")
        if resume is not None and args.url is None and "<redacted>" in url:
            raise BadInput("the run's URL was recorded without its credentials: give --url", field="--url")
        prompts = load_prompts(args.prompts) if args.probe_tokens else []
        key = os.environ.get(args.api_key_env) or None
        found = detect(url, key, timeout=args.request_timeout, deadline_s=max(30.0, 3 * args.request_timeout))
        client = found.adapter.client(url, key, timeout=args.request_timeout, retries=0,
                                      generate_timeout=args.probe_timeout, budget=Budget(None))
        show = progress_line(PROG) if not args.quiet else (lambda line: None)
        try:
            # /metrics readable and the server's settings read (they bound a probe's counters: the client checks
            # every answer against them), before any folder and before the first probe
            client.budget, client.timeout_flag = Budget(2 * args.request_timeout, flag="--request-timeout"), \
                "--request-timeout"
            read_snapshot(found.adapter, client.metrics_text())
            client.server_info()
            client.budget = Budget(None)
            run_dir = resume or new_run_dir("watch", outputs=outputs)
            with failure_guard(PROG, run_dir, owned=resume is None, complete=(Interrupted,)):
                return _watch(args, url, key, found, client, prompts, run_dir, resume is not None, argv, show)
        finally:
            client.close()

    return run(PROG, body)


def _watch(args: Any, url: str, key: Optional[str], found: Any, client: Any, prompts: list, run_dir: Path,
           resumed: bool, argv: Sequence[str], show: Any) -> int:
    settings = WatchSettings(window=args.window, baseline_n=args.baseline, drop_below=args.drop_below,
                             drop_frac=args.drop_frac, cooldown_s=args.cooldown, material=threshold)
    cycle = itertools.cycle(prompts) if prompts else None

    def bounded(fn: Any, seconds: float, flag: str) -> Any:
        """``fn`` under its own overall deadline (a fresh budget of the client per request: a server trickling
        bytes never holds a sample past it)."""
        def call() -> Any:
            client.budget, client.timeout_flag = Budget(seconds, flag=flag), flag
            return fn()
        return call

    probe = bounded(lambda: probe_once(client, next(cycle), max_new_tokens=args.probe_tokens,
                                       timeout=args.probe_timeout), args.probe_timeout + 1.0,
                    "--probe-timeout") if cycle else None
    snapshot = bounded(lambda: read_snapshot(found.adapter, client.metrics_text()), 2 * args.request_timeout,
                       "--request-timeout")
    log = WatchLog(run_dir)
    on_drop = _investigator(args, url, key, run_dir, show) if args.on_drop == "investigate" else None
    life = None if args.no_events else for_server(client, found.adapter, probe_timeout=args.probe_timeout,
                                                  request_timeout=args.request_timeout,
                                                  draft_checksum=args.draft_checksum, bounded=bounded)
    on_event = _checker(args, url, key, run_dir, show) if life is not None and args.on_event == "check-draft" else None
    watcher = Watcher(log, snapshot=snapshot, probe=probe, settings=settings, on_drop=on_drop, lifecycle=life,
                      on_event=on_event)
    try:
        if resumed:
            n = watcher.resume(log.path)
            show(f"resuming {run_dir}: {n} sample(s) read" + (f", {watcher.skipped_on_resume} torn line(s) skipped"
                                                               if watcher.skipped_on_resume else ""))
        log.append(start_record(url=redact_url(url), engine=found.engine, version=found.version, settings=settings,
                                interval=args.interval, resumed=resumed, argv=argv,
                                probe={"max_new_tokens": args.probe_tokens, "timeout_s": args.probe_timeout,
                                       "prompts": args.prompts or "bundled", "temperature": 0.0} if probe else None,
                                extra={"server_settings": {k: (client.server_info() or {}).get(k) for k in (
                                           "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                                           "speculative_num_draft_tokens")},
                                       "on_drop": args.on_drop, "on_event": None if life is None else args.on_event,
                                       "draft_checksum": bool(args.draft_checksum), "accept_length": "delta generation tokens / delta "
                                       "verify steps between samples (counters), else the probe's, else the "
                                       "engine's gauge; each sample says which"}))
        print(f"run folder: {run_dir} ({LOG_NAME})", file=sys.stderr, flush=True)
        why = "stopped"
        try:
            why = run_loop(watcher, interval=args.interval, samples=args.samples, duration=args.duration, show=show,
                           max_failures=args.max_failures, sleep=Budget(None).sleep)
        except BaseException as exc:         # noqa: BLE001 - the stop line says why, then the error goes on
            why = str(exc) or type(exc).__name__
            raise
        finally:
            log.append({"kind": "stop", "t": watcher.clock(), "reason": why[:300], "samples": watcher.n_samples,
                        "drops": watcher.n_drops})
    finally:
        log.close()
    print(f"run folder: {run_dir}: {watcher.n_samples} sample(s), {watcher.n_drops} drop(s), {watcher.n_events} "
          f"sample(s) with lifecycle events; {why}")
    return 0
