"""Start a variant of a server this tool can restart: the same launch with other flags, another draft, or no draft.

Two kinds of restart (as :func:`helpers.investigation.live.attach` finds them): ``{"kind": "embedded", "launch":
{...}}`` (a server started by ``python -m helpers server start``, its launch settings from
:mod:`helpers.server.registry`) and ``{"kind": "command", "argv": [...]}`` (``--relaunch``: the user's own launch
command, whose ``--flag value`` words are replaced). The variant always listens on 127.0.0.1 (it runs on this
machine and is measured there) on a free port, and is stopped by its PID by the caller (``handle.stop()``).
Flags are SGLang's ``sglang.launch_server`` flags (``sglang/srt/server_args.py::ServerArgs.add_cli_args``).
"""
from __future__ import annotations

import copy
import os
import shlex
import shutil
from pathlib import Path
from typing import Mapping, Optional

from ..budget import Budget
from ..errors import BadInput, printable
from .embedded import pick_port
from .embedded import start as start_embedded
from .listener_flags import refuse_relaunch_listener_flags
from .process import ServerProcess

#: the spec flags the embedded launcher takes as ``spec`` settings (the rest go to ``extra_args``)
SPEC_FLAGS = {"--speculative-algorithm": "algorithm", "--speculative-num-draft-tokens": "num_draft_tokens",
              "--speculative-num-steps": "num_steps", "--speculative-eagle-topk": "topk"}
#: the names of the capture hooks (``helpers.capture``): per-rank aux states, every-layer reference
RANK_HOOK, LAYERS_HOOK = "e3f-capture", "e3f-capture-layers"


def set_flags(argv: list[str], flags: Mapping[str, Optional[str]], drop_prefixes: tuple[str, ...] = ()) -> list[str]:
    """``argv`` with each ``--flag value`` (or ``--flag=value``) of ``flags`` replaced, or appended when absent; a
    ``None`` value is a switch (``--disable-radix-cache``, no value). Flags starting with one of ``drop_prefixes``
    are removed with their value (e.g. ``("--speculative-",)`` turns the draft off)."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags or (drop_prefixes and name.startswith(drop_prefixes)):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            skip = "=" not in a and nxt is not None and not nxt.startswith("--")
            continue
        out.append(a)
    for k, v in flags.items():
        out += [k] if v is None else [k, str(v)]
    return out


def relaunch_argv(relaunch: str) -> list[str]:
    """``--relaunch CMD`` as the argv a restarted copy runs (shell words, ``shlex.split``), checked before any request.

    Raises:
        BadInput (field ``--relaunch``): unbalanced quotes, no words, a program that is neither a file nor on
            ``$PATH``, or a listener flag other than the exact ``--host`` / ``--port`` the tool replaces
            (:func:`helpers.server.listener_flags.refuse_relaunch_listener_flags`: ``--ho``, ``--dist-init-addr``,
            ``--host.x``, vLLM's ``--data_parallel_address``)."""
    try:
        argv = shlex.split(relaunch)
    except ValueError as exc:
        raise BadInput(f"not a command line ({exc}): {printable(relaunch)[:200]!r}", field="--relaunch") from None
    if not argv:
        raise BadInput("an empty command; give the server's launch command", field="--relaunch")
    if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
        raise BadInput(f"the program {printable(argv[0])[:200]!r} is neither a file nor on $PATH", field="--relaunch")
    refuse_relaunch_listener_flags(argv, where="--relaunch")
    return argv


def start_variant(restart: dict, *, log_path: Path, budget: Budget, draft: Optional[Path | str] = None,
                  keep_draft: bool = True, flags: Optional[Mapping[str, Optional[str]]] = None,
                  capture_dir: Optional[Path] = None, api_key: Optional[str] = None,
                  port: int | str | None = None, what: str = "the restarted server",
                  env: Optional[Mapping[str, str]] = None):
    """Start the variant and wait until it is healthy (within ``budget``); returns a handle with ``url`` and
    ``stop()``.

    Args:
        restart: ``{"kind": "embedded", "launch": {...}}`` or ``{"kind": "command", "argv": [...]}``.
        draft: the draft folder of the variant (default: the launch's own when ``keep_draft``).
        keep_draft: False starts the target alone (the non-speculative baseline): every ``--speculative-*`` flag is
            dropped.
        flags: SGLang flags to set (value None: a switch).
        capture_dir: where capture hooks of the launch write (their ``out_dir`` moves to ``capture_dir/layers`` or
            ``capture_dir/ranks``); None keeps the launch's.
        port: a port or a ``"LOW-HIGH"`` range (default: a free one).
        env: environment variables set for the variant on top of the launch's own (``launch.env`` of the registry;
            a launch command: this process's environment), e.g. SGLang's ``SGLANG_INVARIANT_CHECK``.

    Raises:
        helpers.errors.ServerError / ServerTimeout: the variant exits or is not healthy within the budget.
    """
    flags = dict(flags or {})
    if restart["kind"] == "embedded":
        launch = dict(restart["launch"])
        spec = dict(launch.get("spec") or {})
        extra = list(launch.get("extra_args") or [])
        other = {}
        for k, v in flags.items():
            if k in SPEC_FLAGS:
                spec[SPEC_FLAGS[k]] = v
            else:
                other[k] = v
        extra = set_flags(extra, other) if other else extra
        hooks = []
        for h in launch.get("forward_hooks") or []:
            h = copy.deepcopy(h)
            if capture_dir is not None and isinstance(h.get("config"), dict) and "out_dir" in h["config"]:
                sub = "layers" if h.get("name") == LAYERS_HOOK else "ranks"
                h["config"]["out_dir"] = str((Path(capture_dir) / sub).resolve())
            hooks.append(h)
        use_draft = (draft or launch.get("draft")) if keep_draft else None
        return start_embedded(launch["target"], use_draft, tp=int(launch.get("tp") or 1),
                              spec=(spec or None) if keep_draft else None,
                              forward_hooks=hooks or None, extra_args=extra, dtype=launch.get("dtype") or "float32",
                              api_key=api_key, port=port, log_path=log_path, budget=budget,
                              env={**(launch.get("env") or {}), **dict(env or {})} or None)
    argv = list(restart["argv"])
    port = pick_port(port, what="--port")
    host = {"--host": "127.0.0.1", "--port": str(port)}
    if keep_draft and draft is not None:
        host["--speculative-draft-model-path"] = str(draft)
    argv = set_flags(argv, {**host, **flags}, drop_prefixes=() if keep_draft else ("--speculative-",))
    return ServerProcess.launch_healthy(argv, f"http://127.0.0.1:{port}", log_path=log_path, api_key=api_key,
                                        what=what, budget=budget,
                                        env={**os.environ, **dict(env)} if env else None)
