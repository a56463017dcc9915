"""``python -m helpers server start|stop``: the embedded SGLang CPU reference server from the shell."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path

from ..capture import every_layer_hook_specs
from ..errors import BadServerInput, ServerStartError
from ..formats.configs import read_target_config
from ..server.embedded import REFERENCE_DRAFT, REFERENCE_TARGET, SPEC_ALGORITHMS, start
from ..server.process import stop_pid
from ..server.settings import SpecSettings


def cli_main(argv: list[str]) -> int:
    """``python -m helpers server start|stop ...`` (start runs in the foreground until Ctrl-C)."""
    ap = argparse.ArgumentParser(prog="python -m helpers server",
                                 description="Embedded SGLang CPU reference server")
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start a server and keep it running until Ctrl-C")
    s.add_argument("--target", default=None, help="target model folder (default: env/models/target)")
    s.add_argument("--draft", default=None, help="EAGLE-3 draft folder (default: none)")
    s.add_argument("--reference-draft", action="store_true", help="use env/models/draft")
    s.add_argument("--tp", type=int, default=2)
    s.add_argument("--port", type=int, default=None)
    s.add_argument("--algorithm", default="EAGLE3", choices=SPEC_ALGORITHMS)
    s.add_argument("--steps", type=int, default=3)
    s.add_argument("--topk", type=int, default=1)
    s.add_argument("--draft-tokens", type=int, default=4)
    s.add_argument("--dtype", default="float32")
    s.add_argument("--forward-hooks", default=None, help="JSON list of SGLang hook specs")
    s.add_argument("--capture-layers", default=None, metavar="DIR",
                   help="add the every-layer capture hooks writing to DIR (armed by `capture --every-layer DIR`)")
    s.add_argument("--log", default=None, help="log file path")
    s.add_argument("--timeout", type=float, default=300.0)
    s.add_argument("extra", nargs=argparse.REMAINDER, help="-- then extra sglang flags")
    t = sub.add_parser("stop", help="stop a server tree by its launcher PID")
    t.add_argument("pid", type=int)
    args = ap.parse_args(argv)
    if args.cmd == "stop":
        ended = stop_pid(args.pid)
        print(f"stopped {len(ended)} process(es): {ended}" if ended else f"no process {args.pid}")
        return 0
    draft = args.draft or (REFERENCE_DRAFT if args.reference_draft else None)
    extra = [a for a in (args.extra or []) if a != "--"]
    try:
        hooks = json.loads(args.forward_hooks) if args.forward_hooks else None
        if args.capture_layers:

            n = read_target_config(args.target or REFERENCE_TARGET).num_hidden_layers
            hooks = (hooks or []) + every_layer_hook_specs(Path(args.capture_layers).resolve(), n)
        handle = start(args.target, draft, tp=args.tp, port=args.port,
                       spec=SpecSettings(algorithm=args.algorithm, num_steps=args.steps, topk=args.topk,
                                         num_draft_tokens=args.draft_tokens),
                       dtype=args.dtype, forward_hooks=hooks, log_path=args.log,
                       timeout=args.timeout, extra_args=extra)
    except (BadServerInput, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ServerStartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"SGLang reference server ready: {handle.url} (pid {handle.pid}, tp {handle.tp}, "
          f"log {handle.log_path}); Ctrl-C stops it", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set() and handle.is_alive():
        stop.wait(1.0)
    handle.stop()
    print("stopped", flush=True)
    return 0
