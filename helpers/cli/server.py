"""``python -m helpers server start|stop``: the embedded SGLang (default) or vLLM (``--engine vllm``) CPU reference
server from the shell."""
from __future__ import annotations

import argparse
import errno
import json
import os
import stat
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..engines.detect import adapter as engine_adapter
from ..engines.detect import detect
from ..errors import BadInput, BadServerInput, ServerStartError
from ..faults import parse_faults
from ..paths import ROOT
from ..server.embedded import REFERENCE_DRAFT, SPEC_ALGORITHMS, parse_ports, pick_port
from ..server.listener_flags import refuse_listener_flags
from ..server.process import stop_pid
from ..server.protocol import MAX_DRAFT_TOKENS, MAX_NUM_STEPS, MAX_PARALLEL, MAX_TOPK
from ..server.registry import register, state_path, unregister
from ..server.settings import default_draft_tokens
from ..runfiles import file_kind
from .common import Parser, run, text_arg



def _python() -> str:
    """The interpreter to name in a printed command: ``.venv/bin/python`` when it is this checkout's venv (run from
    the repository root, as the README does), else this interpreter's path."""
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(ROOT)) if exe.parent.parent == ROOT / ".venv" else str(exe)
    except ValueError:
        return str(exe)

def cli_main(argv: list[str]) -> int:
    """``python -m helpers server start|stop ...`` (start runs in the foreground until Ctrl-C, or returns once the
    server is healthy with ``--detach``). One line ``server: error: ...`` on failure: exit 2 bad input, 1 the server
    did not start."""
    return run("server", lambda: _body(argv))


def _body(argv: list[str]) -> int:
    ap = Parser(prog="python -m helpers server",
                                 description="Embedded SGLang CPU reference server")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a server and keep it running until Ctrl-C")
    s.add_argument("--engine", default="sglang", choices=("sglang", "vllm"),
                   help="sglang (env/reference/.venv, default) or vllm (env/vllm/.venv: vLLM 0.32.0's CPU backend; "
                        "needs --target with a head size it supports, e.g. 64)")
    s.add_argument("--vllm-venv", default=None, metavar="DIR",
                   help="vLLM only: the venv of another vLLM release, e.g. env/vllm/.venv-0.29.0 (built by "
                        "VLLM_VERSION=0.29.0 env/vllm/install.sh); default $E3F_VLLM_PYTHON, else env/vllm/.venv")
    s.add_argument("--target", default=None, help="target model folder (default: env/models/target)")
    s.add_argument("--draft", default=None, help="EAGLE-3 draft folder (default: none)")
    s.add_argument("--reference-draft", action="store_true", help="use env/models/draft")
    s.add_argument("--tp", type=int, default=2)
    s.add_argument("--port", default=None, metavar="PORT|LOW-HIGH",
                   help="port on 127.0.0.1, or a range to take a free one from (default: a free port of "
                        "$E3F_PORT_RANGE, else 12000-19999)")
    s.add_argument("--algorithm", default="EAGLE3", choices=SPEC_ALGORITHMS,
                   help="NEXTN: a DeepSeek-V3-class target's NextN / MTP head (--nextn, or --draft DIR with a separate "
                        "NextN checkpoint)")
    s.add_argument("--nextn", action="store_true",
                   help="serve the target's own NextN layer as the draft (--algorithm NEXTN, no --draft; the target "
                        "config needs num_nextn_predict_layers 1), e.g. --target env/models/kimi/target --nextn")
    s.add_argument("--steps", type=int, default=3, help="draft steps (vLLM: num_speculative_tokens)")
    s.add_argument("--topk", type=int, default=1)
    s.add_argument("--draft-tokens", type=int, default=None,
                   help="speculative draft tokens per verify step (default: steps + 1 with topk 1, which SGLang runs "
                        "whatever is asked; else 2 x steps)")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--forward-hooks", default=None, help="JSON list of SGLang hook specs")
    s.add_argument("--faults", default=None, metavar="JSON",
                   help='wiring faults to inject (helpers.faults.Fault dicts), e.g. '
                        '\'[{"kind": "layer_offset", "shift": 1, "layers": [1, 3, 4]}]\'')
    s.add_argument("--capture-ranks", default=None, metavar="DIR",
                   help="add the per-rank capture hooks writing to DIR (armed while a capture runs)")
    s.add_argument("--capture-layers", default=None, metavar="DIR",
                   help="add the every-layer capture hooks writing to DIR (armed by `capture --every-layer DIR`)")
    s.add_argument("--trace-draft", default=None, metavar="DIR",
                   help="add the draft step trace hook writing the served draft's proposals per draft forward to DIR "
                        "(armed while a probe traces: `investigate` probes step_trace / served_draft)")
    s.add_argument("--log", default=None, help="log file path")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the server to be healthy")
    s.add_argument("--detach", action="store_true",
                   help="start the server in the background, print its URL and PID, write the state file and return")
    s.add_argument("--state-file", default=None, metavar="PATH",
                   help="also write the URL, PIDs and launch settings to PATH (they always go to the registry, "
                        "outputs/servers/<port>.json, where `investigate` finds them to restart this server with a "
                        "proposed fix)")
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra sglang flags")
    t = sub.add_parser("stop", help="stop a server tree by the PID `start` printed")
    t.add_argument("pid", type=int)
    d = sub.add_parser("detect", help="print the engine and release serving --url (exit 2: neither SGLang nor a "
                                      "known vLLM)")
    d.add_argument("--url", required=True)
    d.add_argument("--timeout", type=float, default=30.0, help="seconds for the whole detection")
    args = ap.parse_args(argv)
    if args.cmd == "detect":
        found = detect(args.url, timeout=min(10.0, args.timeout), deadline_s=args.timeout)
        print(f"{found.adapter.label} {found.version} at {args.url}")
        return 0
    if args.cmd == "stop":
        ended = stop_pid(args.pid)
        print(f"stopped {len(ended)} process(es): {ended}" if ended else f"no process {args.pid}")
        return 0
    if args.nextn:
        if args.draft or args.reference_draft or args.algorithm not in ("EAGLE3", "NEXTN"):
            print("server: error: --nextn serves the target's own NextN layer: it takes no --draft / "
                  "--reference-draft / other --algorithm (a separate NextN checkpoint: --algorithm NEXTN --draft DIR)",
                  file=sys.stderr)
            return 2
        args.algorithm = "NEXTN"
    draft = args.draft or (REFERENCE_DRAFT if args.reference_draft else None)
    extra = [a for a in (args.extra or []) if a != "--"]
    engine = engine_adapter(args.engine)
    why = engine.cli_refusal(args)
    if why:
        print(f"server: error: --engine {args.engine}: {why}", file=sys.stderr)
        return 2
    check_start_flags(args)                                 # all before any server (or supervisor) starts
    if getattr(args, "trace_draft", None) and draft is None and args.algorithm != "NEXTN":   # NextN: the target's head
        print("server: error: --trace-draft traces the served draft's proposals: give the draft too (--draft DIR, "
              "--reference-draft or --nextn); without one the server runs no speculative decoding", file=sys.stderr)
        return 2
    refuse_listener_flags(extra, args.engine, where=f"the extra {args.engine} flags after --")
    if args.state_file and not args.detach:
        refuse_existing_state(Path(args.state_file), out_too=False)
    if args.draft_tokens is None:
        args.draft_tokens = default_draft_tokens(args.steps, args.topk)
    if args.detach:
        return _detach(argv, args)
    try:
        handle, launch = engine.start_from_cli(args, draft, extra)
    except (BadServerInput, json.JSONDecodeError, TypeError, ValueError) as exc:
        print(f"server: error: {exc}", file=sys.stderr)
        return 2
    except ServerStartError as exc:
        print(f"server: error: {exc}", file=sys.stderr)
        return 1
    states = list(dict.fromkeys([state_path(handle.port)] + ([Path(args.state_file)] if args.state_file else [])))
    for state in states:
        register(state, url=handle.url, pid=os.getpid(), server_pid=handle.pid, log=str(handle.log_path),
                 launch=launch)
    print(f"{engine.label} reference server ready: {handle.url} (pid {os.getpid()}, tp {handle.tp}, "
          f"log {handle.log_path}, state {states[-1]}); Ctrl-C or `python -m helpers server stop {os.getpid()}` "
          "stops it", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.is_set() and handle.is_alive():
            stop.wait(1.0)
    finally:
        handle.stop()
        for state in states:
            unregister(state)
        if os.environ.get(DETACHED_OUT_ENV):     # the output file a detaching `server start` made for this supervisor
            unregister(Path(os.environ[DETACHED_OUT_ENV]))    # (kept only when a start failed)
    print("stopped", flush=True)
    return 0


#: the environment variable naming the output file of a detached supervisor (removed when it stops normally)
DETACHED_OUT_ENV = "E3F_DETACHED_OUT"

#: the ``--dtype`` values both engines take: SGLang 0.5.23's ``choices`` (sglang/srt/arg_groups/fields/model.py::
#: dtype) and vLLM 0.32.0's ``ModelDType`` (vllm/config/model.py) are the same six
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def check_start_flags(args: argparse.Namespace) -> None:
    """``server start``'s own flags, checked before any server starts: ``--tp``, ``--steps``, ``--topk`` and
    ``--draft-tokens`` at least 1 and at most the counts the tool's own ``/server_info`` check takes
    (:data:`helpers.server.protocol.MAX_PARALLEL`, ``MAX_NUM_STEPS``, ``MAX_TOPK``, ``MAX_DRAFT_TOKENS``: one rule; a
    ``--tp 100000`` built an argument list the OS refused) (SGLang's ``SpecSettings`` fields are ``ge=1``; vLLM 0.32.0 refuses
    ``num_speculative_tokens`` <= 0: vllm/config/speculative.py::SpeculativeConfig.__post_init__, and a TP of 0
    divides by zero in :func:`helpers.engines.vllm_server.omp_bind`), ``--dtype`` one of :data:`DTYPES`,
    ``--timeout`` a finite number of seconds above 0 (not nan / inf), ``--port`` a port or ``LOW-HIGH``, ``--faults`` a
    JSON list of faults :func:`helpers.faults.parse_faults` takes.

    Raises:
        BadServerInput: one line naming the flag and what it takes (exit 2)."""
    for flag, value, most in (("--tp", args.tp, MAX_PARALLEL), ("--steps", args.steps, MAX_NUM_STEPS),
                              ("--topk", args.topk, MAX_TOPK), ("--draft-tokens", args.draft_tokens, MAX_DRAFT_TOKENS)):
        if value is not None and value < 1:
            raise BadServerInput(f"{flag} must be at least 1, got {value}")
        if value is not None and value > most:
            raise BadServerInput(f"{flag} must be at most {most}, got {value} (the most this tool measures: its "
                                 "/server_info check refuses a server reporting more)")
    if args.dtype not in DTYPES:
        raise BadServerInput(f"--dtype {args.dtype!r} is not one {args.engine} takes: expected one of "
                             f"{', '.join(DTYPES)}")
    if not (args.timeout > 0 and args.timeout != float("inf")):
        raise BadServerInput(f"--timeout must be a finite number of seconds above 0, got {args.timeout}")
    parse_ports(args.port, what="--port")
    if getattr(args, "faults", None):
        try:
            parse_faults(args.faults)
        except ValueError as exc:
            raise BadServerInput(str(exc)) from None
    for flag, attr in (("--trace-draft", "trace_draft"), ("--capture-ranks", "capture_ranks"),
                       ("--capture-layers", "capture_layers")):
        if getattr(args, attr, None):
            setattr(args, attr, str(hook_folder(getattr(args, attr), flag)))


def hook_folder(path: str, flag: str) -> Path:
    """The folder a server hook writes into (``--trace-draft``, ``--capture-ranks``, ``--capture-layers``), made
    here before any server starts and returned absolute: the hooks run in the server's processes, which write it only
    once armed, and the probes read it on this machine (a folder that did not exist yet was reported "not readable on
    this machine" by the trace probes; a relative one would be read against the server's working directory).

    A folder that already holds a trace (``rank*/`` with files, an earlier server's) is taken as it is and nothing in
    it is lost: the trace hook numbers its files on after those there (:func:`helpers.trace_hooks.
    next_trace_number`), so the old index lines keep pointing at the old files, and the probes read only the lines
    written after they armed it (:func:`helpers.draft.trace.trace_counts`). Refusing the folder would lose nothing
    either, but would stop every restart of a server on its own folder.

    Raises:
        BadServerInput: one line naming the flag: a path that is not UTF-8 (the run's JSON could not hold it, as
            :func:`helpers.cli.common.text_arg`), a file where a folder is needed (the component named: the path
            itself or a parent), a symlink loop, or a folder that cannot be made or written (exit 2)."""
    try:
        text_arg(path, flag)
    except BadInput as exc:
        raise BadServerInput(str(exc)) from None
    p = Path(path).expanduser().absolute()
    try:
        p.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadServerInput(f"{flag} {path}: {_why_no_folder(p, exc)}") from None
    if not p.is_dir() or not os.access(p, os.W_OK | os.X_OK):
        raise BadServerInput(f"{flag} {path}: not a writable folder (the server's hook writes its files there)")
    return p


def _why_no_folder(p: Path, exc: OSError) -> str:
    """Why ``p`` cannot be a folder, naming the first component of it that is in the way (itself or a parent)."""
    for q in [*reversed(p.parents), p]:
        try:
            mode = os.stat(q).st_mode
        except FileNotFoundError:
            break                                   # made from here on: the error is the making's own
        except OSError as e:                        # ELOOP: a symlink loop; EACCES ...
            return (f"not a folder: {q} is a symlink loop (a link that leads back to itself); name a folder"
                    if e.errno == errno.ELOOP else f"the folder cannot be made: {q} cannot be read "
                                                   f"({e.strerror or e})")
        if not stat.S_ISDIR(mode):
            if q != p:
                return (f"not a folder: its parent {q} is {'a file' if stat.S_ISREG(mode) else file_kind(mode)}; "
                        "name a folder under a folder")
            return ("not a folder (a file of that name exists); name a folder" if stat.S_ISREG(mode) else
                    f"not a folder ({file_kind(mode)}); name a folder")
    return f"the folder cannot be made ({exc.strerror or exc})"


def refuse_existing_state(state: Path, *, out_too: bool) -> None:
    """``--state-file PATH`` must name no file yet (and, with ``--detach``, neither may its ``.out`` sibling, the
    background server's output): this command never deletes nor overwrites a file the user has, even one it wrote
    for an earlier server (``server stop`` and a foreground start's exit remove those themselves).

    Raises:
        BadServerInput: one line naming the file (exit 2), before any server starts."""
    if out_too and state.suffix == ".out":
        raise BadServerInput(f"--state-file {state}: a name ending in .out is the background server's output file "
                             "(PATH with .out for its suffix); pick a state file name with another suffix (.json)")
    for path, what in ((state, "--state-file"),) + (((state.with_suffix(".out"), "the output file of --detach"),)
                                                    if out_too else ()):
        if os.path.lexists(path):
            raise BadServerInput(f"{path} exists ({what}): a state file and its output are never overwritten nor "
                                 "deleted; remove it (a server it names is stopped with `server stop PID`) or pick "
                                 "another --state-file")


def _without_port(argv: list[str]) -> list[str]:
    """``argv`` without its ``--port X`` / ``--port=X`` (up to a ``--`` that starts SGLang's own flags)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if a == "--":
            return out + argv[i:]
        if skip:
            skip = False
        elif a == "--port":
            skip = True
        elif not a.startswith("--port="):
            out.append(a)
    return out


def _detach(argv: list[str], args: argparse.Namespace) -> int:
    """Run ``server start`` (without ``--detach``) as a background supervisor in its own session; return once the
    server is healthy (its state file exists) with the URL and PID printed, or with the supervisor's error."""
    try:
        port = pick_port(args.port, what="--port")
    except BadServerInput as exc:
        print(f"server: error: {exc}", file=sys.stderr)
        return 2
    if args.state_file:
        state = Path(args.state_file)
        refuse_existing_state(state, out_too=True)           # the user's path: never deleted nor overwritten
    else:
        state = state_path(port)
        if state.exists():
            unregister(state)    # the registry's stale file of an earlier server on this port (it is free again)
    rest = _without_port([a for a in argv[1:] if a != "--detach"])          # argv[0] is "start"
    child = ["start", "--port", str(port)] + rest
    state.parent.mkdir(parents=True, exist_ok=True)
    out_path = state.with_suffix(".out")
    with open(out_path, "xb" if args.state_file else "wb") as out:     # "x": never over a file of the user's
        proc = subprocess.Popen([sys.executable, "-m", "helpers", "server", *child],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=str(ROOT),
                                env={**os.environ, DETACHED_OUT_ENV: str(out_path)})
    deadline = time.monotonic() + args.timeout + 30
    while time.monotonic() < deadline:
        if state.exists():
            doc = json.loads(state.read_text())
            label = engine_adapter((doc.get("launch") or {}).get("engine") or "sglang").label
            print(f"{label} reference server ready: {doc['url']} (pid {doc['pid']}; stop it with "
                  f"`{_python()} -m helpers server stop {doc['pid']}`)\nstate file: {state}\nlog: {doc['log']}", flush=True)
            return 0
        if proc.poll() is not None:
            tail = out_path.read_text(errors="replace").strip().splitlines()
            msg = next((ln for ln in reversed(tail) if "error" in ln.lower()), tail[-1] if tail else "no output")
            print(f"server: error: the background server exited ({proc.returncode}): {msg} (output: {out_path})",
                  file=sys.stderr)
            return proc.returncode if proc.returncode in (1, 2) else 1
        time.sleep(0.5)
    stop_pid(proc.pid)
    print(f"server: error: the server was not healthy after {args.timeout + 30:.0f} s (output: {out_path})",
          file=sys.stderr)
    return 1

