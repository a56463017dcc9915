"""The one error contract of every command: one line on stderr, ``<command>: error: <reason>``, exit 2 for bad
input (:class:`helpers.errors.BadInput`, argparse usage errors, a file given for a folder and the like), 1 for a
server or run failure (:class:`helpers.errors.ServerError`, :class:`helpers.errors.RunFailed`, OSError such as a
full disk), 130 for Ctrl-C; ``E3F_DEBUG=1`` re-raises for the traceback."""
from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import Callable

from ..errors import BadInput, E3FError, one_line, printable


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors raise :class:`BadInput` (one line, exit 2) instead of printing usage + exit."""

    def error(self, message):
        raise BadInput(f"usage: {message} (see {self.prog} --help)")


def exit_code(exc: BaseException, unexpected: int = 1) -> int:
    """The exit code for an exception (module docstring); ``unexpected`` for anything not classified (a command
    that only reads local files, such as ``diagnose``, treats those as bad input: 2)."""
    if isinstance(exc, E3FError):
        return exc.exit_code
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, FileNotFoundError, PermissionError)):
        return 2
    if isinstance(exc, OSError):
        return 1
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return unexpected


def describe(exc: BaseException) -> str:
    """One line for ``exc``: the suite's own errors as they are, OS errors with the path and what went wrong."""
    if isinstance(exc, OSError) and not isinstance(exc, E3FError):
        what = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EISDIR: "is a folder, a file was expected", errno.ENOTDIR: "is not a folder",
                errno.ENOENT: "does not exist", errno.EACCES: "permission denied",
                errno.EROFS: "read-only file system"}.get(exc.errno or 0, exc.strerror or type(exc).__name__)
        where = exc.filename if exc.filename is not None else ""
        return f"{where}: {what}" if where else what
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    text = one_line(exc)
    return text if isinstance(exc, E3FError) else f"{type(exc).__name__}: {text}"


def run(prog: str, body: Callable[[], int], *, unexpected_exit: int = 1) -> int:
    """Run a command body under the error contract; returns its exit code."""
    try:
        return int(body() or 0)
    except SystemExit as e:          # --help / --version
        return int(e.code or 0)
    except BaseException as exc:     # noqa: BLE001 - the contract: one line, never a bare traceback
        if os.environ.get("E3F_DEBUG") and not isinstance(exc, KeyboardInterrupt):
            raise
        print(f"{prog}: error: {describe(exc)}" + ("" if isinstance(exc, (E3FError, OSError, KeyboardInterrupt))
                                                   else " (set E3F_DEBUG=1 for the traceback)"), file=sys.stderr)
        return exit_code(exc, unexpected_exit)


def progress_line(prog: str) -> Callable[[str], None]:
    """A progress printer: ``[prog] <line>`` on stderr, flushed, without control characters (:func:`printable`)."""
    def show(line: str) -> None:
        print(f"[{prog}] {printable(line)}", file=sys.stderr, flush=True)
    return show

