"""The one error contract of every command: one line on stderr, ``<command>: error: <reason>``, exit 2 for bad
input (:class:`helpers.errors.BadInput`, argparse usage errors, a file given for a folder and the like), 1 for a
server or run failure (:class:`helpers.errors.ServerError`, :class:`helpers.errors.RunFailed`, OSError such as a
full disk), 130 for Ctrl-C (SIGINT) and 143 for SIGTERM; ``E3F_DEBUG=1`` re-raises for the traceback.

Signals: while a command runs, SIGINT and SIGTERM raise :class:`helpers.errors.Interrupted` in the main thread, so
that every ``finally`` runs -- the servers the command started are stopped (0.3 s after SIGTERM their whole process
tree and group get SIGKILL: :meth:`helpers.server.process.ServerProcess.stop`), its run folder is marked FAILED with
the signal -- and every budget counts as spent, so worker threads stop waiting; a second signal during that clean-up
is ignored. The command ends within 2 s (about 1.1 s measured with an embedded server on 2 loaded cores:
bench/bench_signal.py)."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import stat
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from ..budget import interrupt, reset_interrupt
from ..errors import BadInput, E3FError, Interrupted, describe, printable
from ..formats.rows import SPLITS, TEXT_KINDS, split_word
from ..redaction import scrub
from ..runfiles import file_kind, mark_failed
from ..server.process import stop_all


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT / SIGTERM raise :class:`Interrupted` (once) while the block runs; handlers restored after. Only in
    the main thread (signal handlers can only be set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired = []

    def handler(signum, _frame):
        if fired:                      # already stopping: let the clean-up finish
            return
        fired.append(signum)
        exc = Interrupted(signum)
        interrupt(str(exc))
        raise exc

    reset_interrupt()
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


class _Scrubbed:
    """A text stream whose writes are scrubbed of secrets (:func:`helpers.redaction.scrub`: remembered keys, URL
    credentials) before they reach ``stream``; everything else is the stream's."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(scrub(text) if isinstance(text, str) else text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _streams_scrubbed() -> Iterator[None]:
    """``sys.stdout`` / ``sys.stderr`` scrubbed of secrets while the block runs (a URL's ``user:password@`` never
    reaches the terminal, whichever line echoes it); restored after."""
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Scrubbed(old[0]), _Scrubbed(old[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old


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
    if isinstance(exc, Interrupted):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return unexpected


def run(prog: str, body: Callable[[], int], *, unexpected_exit: int = 1) -> int:
    """Run a command body under the error contract and the signal handling (module docstring); returns its exit
    code. Whatever it prints is scrubbed of secrets (:func:`_streams_scrubbed`)."""
    with _signals_raise(), _streams_scrubbed():
        try:
            return int(body() or 0)
        except SystemExit as e:          # --help / --version
            return int(e.code or 0)
        except BaseException as exc:     # noqa: BLE001 - the contract: one line, never a bare traceback
            if isinstance(exc, KeyboardInterrupt):
                interrupt(describe(exc))
                stop_all(timeout=1.0)    # whatever a finally did not stop
            return _report(prog, exc, unexpected_exit)


def _report(prog: str, exc: BaseException, unexpected_exit: int) -> int:
    if os.environ.get("E3F_DEBUG") and not isinstance(exc, KeyboardInterrupt):
        raise exc
    print(f"{prog}: error: {describe(exc)}" + ("" if isinstance(exc, (E3FError, OSError, KeyboardInterrupt))
                                               else " (set E3F_DEBUG=1 for the traceback)"), file=sys.stderr)
    return exit_code(exc, unexpected_exit)


def text_arg(value: Optional[str], flag: str) -> Optional[str]:
    """``value`` (a name or path given on the command line) when it is valid UTF-8, checked before any work: a
    name that is not (bytes that only decode with surrogates) cannot be written into the JSON, Parquet and HTML of
    a run folder.

    Raises:
        BadInput: not UTF-8; the message shows the value escaped.
    """
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise BadInput(f"{flag} {ascii(value)[1:-1]} is not valid UTF-8: give a name or path in UTF-8") from None
    return value


def out_folder(value: Optional[str], flag: str) -> Optional[Path]:
    """The folder a command creates its run folder in (``--out``, ``--outputs``), checked before any work: UTF-8
    (:func:`text_arg`), and a folder or nothing yet. None when not given.

    Raises:
        BadInput: not UTF-8, or an existing file.
    """
    if text_arg(value, flag) is None:
        return None
    if Path(value).exists() and not Path(value).is_dir():
        raise BadInput(f"{flag} must be a folder (the run folder is created inside it)", path=value)
    return Path(value)


def run_folder_arg(value: Optional[str], flag: str = "--run-dir") -> Optional[Path]:
    """An existing run folder to add to (``--run-dir``), checked before any work. None when not given.

    Raises:
        BadInput: not UTF-8, or not an existing folder.
    """
    if text_arg(value, flag) is None:
        return None
    if not Path(value).is_dir():
        raise BadInput(f"{flag} must be an existing run folder (omit it for a new one)", path=value)
    return Path(value)


def input_path_arg(value: Optional[str], flag: str, *, folder: Optional[bool] = None) -> Optional[Path]:
    """A path the command reads (``--training``, ``--draft``, ``--target``, ``--training-log`` ...), checked before
    any work: UTF-8 (:func:`text_arg`), present, not a symlink loop, and a folder (``folder=True``), a regular file
    (``False``) or either (None): a FIFO or a device is refused by name (:func:`helpers.runfiles.file_kind`). None
    when not given.

    Raises:
        BadInput: naming the path and ``flag``."""
    if text_arg(value, flag) is None:
        return None
    p = Path(value)
    try:
        mode = os.stat(p).st_mode
    except FileNotFoundError:
        raise BadInput("not found", path=p, field=flag) from None
    except OSError as exc:                       # ELOOP (a symlink loop), EACCES, ENAMETOOLONG ...
        raise BadInput(f"cannot be read: {exc.strerror or exc}", path=p, field=flag) from None
    is_dir, is_file = stat.S_ISDIR(mode), stat.S_ISREG(mode)
    if folder is True and not is_dir:
        raise BadInput(f"expected a folder, got {'a file' if is_file else file_kind(mode)}", path=p, field=flag)
    if folder is False and not is_file:
        raise BadInput(f"expected a file, got {file_kind(mode)}", path=p, field=flag)
    if folder is None and not (is_dir or is_file):
        raise BadInput(f"expected a file or a folder, got {file_kind(mode)}", path=p, field=flag)
    return p


@contextlib.contextmanager
def failure_guard(prog: str, run_dir: Path, *, owned: bool = True,
                  complete: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Whatever fails inside the block -- a server, a full disk on the last write, a signal -- a run folder this
    command created (``owned``) is marked FAILED with the one-line reason (:func:`helpers.runfiles.mark_failed`;
    removed instead when it holds no file), so it is never mistaken for a result; the error goes on. Errors of the
    ``complete`` types end a run whose folder is complete (e.g. fixes that failed, each with its ledger row)."""
    try:
        yield
    except BaseException as exc:
        if owned and not isinstance(exc, complete):
            mark_failed(run_dir, f"{prog}: {describe(exc)}")
        raise


def subset_arg(value: Optional[str], known: Sequence[str], flag: str) -> Optional[list[str]]:
    """A comma-separated subset of ``known`` (``--sweeps context,temperature``), in the order given; ``none`` is the
    empty list; None when not given. A name given twice counts once.

    Raises:
        BadInput: a name not in ``known`` (the message lists them).
    """
    if value is None:
        return None
    if value.strip().lower() == "none":
        return []
    names = list(dict.fromkeys(n.strip() for n in value.split(",") if n.strip()))   # once each, in order
    bad = [n for n in names if n not in known]
    if bad or not names:
        what = f"unknown {bad[0]!r}" if bad else "an empty list"
        raise BadInput(f"{what}; expected a comma-separated subset of {','.join(known)} (or none)", field=flag)
    return names


def progress_line(prog: str) -> Callable[[str], None]:
    """A progress printer: ``[prog] <line>`` on stderr, flushed, without control characters (:func:`printable`)."""
    def show(line: str) -> None:
        print(f"[{prog}] {printable(line)}", file=sys.stderr, flush=True)
    return show



def rows_arg(value: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """``--rows SPLIT[,TEXT]`` (either part, any order) as ``(split, text)``.

    Raises:
        BadInput: an empty value, two splits or two text kinds, or a part that is neither a split (validation / training / val / eval / test / train) nor a text kind
            (sampled / greedy / mixed / dataset)."""
    if value is None:
        return None, None
    parts = [p.strip() for p in str(value).split(",") if p.strip()]
    if not parts:
        raise BadInput(f"{value!r} names nothing: expected SPLIT[,TEXT], e.g. validation,sampled", field="--rows")
    split = text = None
    for part in parts:
        if split_word(part):
            if split is not None:
                raise BadInput(f"{value!r} names two splits ({split}, {part}): expected one SPLIT and at most one "
                               "TEXT", field="--rows")
            split = part
        elif part in TEXT_KINDS:
            if text is not None:
                raise BadInput(f"{value!r} names two text kinds ({text}, {part}): expected one SPLIT and at most "
                               "one TEXT", field="--rows")
            text = part
        else:
            raise BadInput(f"{part!r} is neither a split ({', '.join(SPLITS)}) nor a text kind "
                           f"({', '.join(TEXT_KINDS)})", field="--rows")
    return split, text
