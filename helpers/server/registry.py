"""State files of the embedded servers this tool started (``python -m helpers server start``): URL, PIDs, log and
the launch settings, so that ``investigate`` can recognise a server it may restart with a proposed fix.

One JSON file per server, ``outputs/servers/<port>.json`` (``$E3F_SERVER_REGISTRY`` moves the folder), written
atomically when the server is healthy and removed when the CLI stops it. An entry whose supervising process is gone
is stale and ignored. The launch settings are the keyword arguments of :func:`helpers.server.embedded.start`
(``target``, ``draft``, ``tp``, ``spec``, ``forward_hooks``, ``extra_args``, ``dtype``, ``env``: the launch's ``SGLANG_*``
variables, secrets left out); an API key is never
stored (the server is restarted with the key from the environment variable the caller names).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

import psutil

from ..paths import OUTPUTS
from ..runfiles import loads_json, write_json


def registry_dir() -> Path:
    """The folder of the state files (``$E3F_SERVER_REGISTRY`` or ``outputs/servers``)."""
    return Path(os.environ.get("E3F_SERVER_REGISTRY") or OUTPUTS / "servers")


def state_path(port: int) -> Path:
    """``<registry>/<port>.json``."""
    return registry_dir() / f"{int(port)}.json"


def register(path: Path, *, url: str, pid: int, server_pid: int, log: str, launch: dict[str, Any]) -> Path:
    """Write the state file ``path`` (atomic). ``pid`` is the supervising process (stopping it stops the server
    tree), ``server_pid`` the SGLang launcher. Returns ``path``."""
    return write_json(path, {"url": url.rstrip("/"), "pid": int(pid), "server_pid": int(server_pid), "log": log,
                             "launch": launch})


def _port(url: str) -> Optional[int]:
    try:
        return urlsplit(url).port
    except ValueError:
        return None


def lookup(url: str) -> Optional[dict]:
    """The live state entry of the embedded server at ``url`` (same host and port, supervisor alive), or None.
    The returned dict carries ``state_file`` too."""
    port = _port(url)
    if port is None:
        return None
    path = state_path(port)
    try:
        doc = loads_json(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or _port(str(doc.get("url", ""))) != port:
        return None
    if urlsplit(str(doc["url"])).hostname not in {urlsplit(url).hostname, "127.0.0.1", "localhost"}:
        return None
    try:
        if not psutil.Process(int(doc.get("pid", -1))).is_running():
            return None
    except (psutil.Error, ValueError):
        return None
    return {**doc, "state_file": str(path)}


def unregister(path: Path) -> None:
    """Remove a state file (no error when it is already gone)."""
    try:
        Path(path).unlink()
    except FileNotFoundError:
        pass
