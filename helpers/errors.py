"""The one error family of the suite, and the one-line form every command prints.

Every error the suite raises on purpose derives from :class:`E3FError` and carries the exit code a command
returns for it (DESIGN.md "CLI"):

* :class:`BadInput` (exit 2): a file, field, argument or setting the user gave cannot be used. The message
  names the file (and the field) and says what was expected. Subclasses keep older names readable:
  ``CaseError`` (case files), ``BadParams`` (suite params), ``BadServerInput`` (embedded-server arguments).
* :class:`ServerError` (exit 1): the server misbehaved or could not be reached. :class:`SGLangError` and its
  subclasses name the endpoint and the HTTP status; :class:`ServerStartError` carries the server log's tail.
* :class:`RunFailed` (exit 1): the work ran and failed (a fix that could not be measured, a notebook that
  failed, a ledger that lost rows).

``cli/`` turns them into ``<command>: error: <one line>`` on stderr (:func:`one_line`); ``E3F_DEBUG=1`` prints
the traceback instead.
"""
from __future__ import annotations

import errno
import re
import signal
from pathlib import Path
from typing import Optional


class E3FError(Exception):
    """Base of the suite's own errors; ``exit_code`` is what a command returns for it."""

    exit_code = 1


class BadInput(E3FError, ValueError):
    """An input the suite cannot use (missing, truncated, wrong shape, unsafe payload, invalid field...).

    Args:
        message: what is wrong and what was expected.
        path: the file concerned, if any (prefixed to the message).
        field: the field / key / tensor name concerned, if any.
    """

    exit_code = 2

    def __init__(self, message: str, *, path: str | Path | None = None, field: str | None = None):
        self.message = message           # without the path / field prefix (to say it again under another name)
        self.path = None if path is None else str(path)
        self.field = field
        where = ""
        if self.path is not None:
            where = self.path
            if field:
                where += f" [{field}]"
            where += ": "
        elif field:
            where = f"[{field}]: "
        super().__init__(f"{where}{message}")


class CaseError(BadInput):
    """A case file is missing or invalid; the message names the file and the field."""


class BadParams(BadInput):
    """A suite params file is missing or invalid; the message names the file and the field."""


class BadServerInput(BadInput):
    """Invalid embedded-server input (missing model, wrong draft architecture, port in use, ...)."""


class ServerError(E3FError, RuntimeError):
    """The server could not be reached, refused, or answered something unusable."""


class SGLangError(ServerError):
    """A request to the SGLang server failed. ``endpoint`` and ``status`` (HTTP code or None)."""

    def __init__(self, message: str, *, endpoint: str = "", status: Optional[int] = None):
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


class ServerUnavailable(SGLangError):
    """Could not connect (or kept getting 502/503/504) after all retries."""


class ServerTimeout(SGLangError):
    """The server accepted the connection but did not answer within the timeout."""


class AuthError(SGLangError):
    """401/403: the server runs with ``--api-key`` and the key is missing or wrong."""


class EndpointMissing(SGLangError):
    """404 on an endpoint (and on its older name, where one exists)."""


class MetricsDisabled(EndpointMissing):
    """``/metrics`` is 404: the server was started without ``--enable-metrics``."""


class RequestRejected(SGLangError):
    """The server refused the request (400/422); the message quotes its reason."""


class HiddenStatesDisabled(RequestRejected):
    """``return_hidden_states`` sent to a server started without ``--enable-return-hidden-states``."""


class CacheBusy(SGLangError):
    """``/flush_cache`` kept answering 400 (requests running) until the deadline."""


class ServerStartError(ServerError):
    """A server could not be started; ``str(err)`` ends with the last lines of its log."""

    def __init__(self, message: str, log_tail: str = "", log_path: Optional[Path] = None):
        self.log_tail = log_tail
        self.log_path = log_path
        text = message
        if log_path is not None:
            text += f"\nserver log: {log_path}"
        if log_tail:
            text += "\n--- last lines of the server log ---\n" + log_tail
        super().__init__(text)


class RunFailed(E3FError, RuntimeError):
    """Work that ran and failed (a fix not measured, a ledger write that would lose rows); ``run_dir`` when
    there is one."""

    def __init__(self, message: str, run_dir: Optional[Path] = None):
        super().__init__(message)
        self.run_dir = run_dir


#: terminal escape sequences: OSC (window title, OSC 52 clipboard writes, hyperlinks; ended by BEL or ST), CSI
#: (cursor moves, screen clears, colours; 7-bit ``ESC [`` and 8-bit ``0x9b``) and the other two-byte ESC forms
_ESCAPE_SEQUENCE = re.compile(r"(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                              r"|(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]?|\x1b[ -~]?")
#: the other C0 controls (tab and newline kept), DEL and the C1 controls
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` without terminal escape sequences and control characters (tab and newline kept): what a server or
    a file says is shown on a terminal only through this (an error body must not clear the screen, retitle the
    window or write the clipboard with OSC 52)."""
    return _CONTROL.sub("", _ESCAPE_SEQUENCE.sub("", text))


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached a command (:func:`helpers.cli.common.run`); ``signum`` is the signal, ``exit_code``
    128 + signum (130 / 143). A KeyboardInterrupt, so code that stops on Ctrl-C stops on SIGTERM the same way."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (newlines folded, control characters and escape sequences removed:
    :func:`printable`), for a CLI's stderr."""
    text = str(exc) or type(exc).__name__
    return " ".join(printable(text).split())


def describe(exc: BaseException) -> str:
    """One line for ``exc`` (what a command prints after ``<command>: error:``, what a run folder's FAILED and an
    investigation's ``error`` say): the suite's own errors as they are, OS errors with the path and what went wrong
    (``<path>: no space left on the device``), a signal as ``interrupted by SIGTERM``, anything else with its type."""
    if isinstance(exc, OSError) and not isinstance(exc, E3FError):
        what = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EISDIR: "is a folder, a file was expected", errno.ENOTDIR: "is not a folder",
                errno.ENOENT: "does not exist", errno.EACCES: "permission denied",
                errno.EROFS: "read-only file system"}.get(exc.errno or 0, exc.strerror or type(exc).__name__)
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {what}" if where else what
    if isinstance(exc, KeyboardInterrupt):
        return str(exc) or "interrupted by SIGINT"
    text = one_line(exc)
    return text if isinstance(exc, E3FError) else f"{type(exc).__name__}: {text}"
