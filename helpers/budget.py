"""One time budget for a command's whole run (``--timeout``), shared by every wait of that run: each request of
:class:`helpers.server.client.SGLangClient`, every ``/health`` poll of a server being started or restarted
(:meth:`helpers.server.process.ServerProcess.wait_healthy`), the steps of an investigation and the worker threads
of a measurement.

A budget also ends early: :meth:`Budget.cancel` (a measurement's main thread interrupted while its workers wait),
or :func:`interrupt` (SIGINT / SIGTERM reached a command, :func:`helpers.cli.common.run`): every wait of every
budget then ends at its next check, and servers this process started are stopped with a 0.3 s grace
(:meth:`helpers.server.process.ServerProcess.stop`).
"""
from __future__ import annotations

import threading
import time
from typing import Optional

from .errors import ServerTimeout

_INTERRUPTED = threading.Event()
_REASON = [""]


def interrupt(reason: str) -> None:
    """Mark this process as stopping (a signal arrived): every budget counts as spent from now on."""
    _REASON[0] = reason
    _INTERRUPTED.set()


def interrupted() -> Optional[str]:
    """The reason given to :func:`interrupt` (e.g. ``"interrupted by SIGTERM"``), or None while running normally."""
    return _REASON[0] if _INTERRUPTED.is_set() else None


def reset_interrupt() -> None:
    """Forget an earlier :func:`interrupt` (a new command starts in this process)."""
    _REASON[0] = ""
    _INTERRUPTED.clear()


class Budget:
    """An overall budget of ``seconds`` from now (None: no limit, but still cancellable).

    Args:
        seconds: the budget in seconds, or None.
        flag: the option that sets it, named in messages (``--timeout``).

    Attributes: ``seconds``, ``t0`` (``time.monotonic()`` at creation), ``deadline`` (monotonic seconds or None).
    """

    def __init__(self, seconds: Optional[float] = None, *, flag: str = "--timeout"):
        self.seconds = None if seconds is None else float(seconds)
        self.flag = flag
        self.t0 = time.monotonic()
        self.deadline = None if self.seconds is None else self.t0 + self.seconds
        self._cancelled: Optional[str] = None

    def __repr__(self) -> str:
        left = "no limit" if self.seconds is None else f"{self.remaining():.0f} of {self.seconds:.0f} s left"
        return f"<Budget {left}{'; cancelled' if self.stopped() else ''}>"

    def elapsed(self) -> float:
        """Seconds since the budget started."""
        return time.monotonic() - self.t0

    def remaining(self) -> Optional[float]:
        """Seconds left (may be negative; 0 once cancelled or interrupted); None without a limit."""
        if self.stopped():
            return 0.0
        return None if self.deadline is None else self.deadline - time.monotonic()

    def cap(self, seconds: float) -> float:
        """``seconds`` capped at what is left (never below 0): the longest a single wait may take."""
        r = self.remaining()
        return max(0.0, float(seconds) if r is None else min(float(seconds), r))

    def spent(self) -> bool:
        """True once the time is up, or the budget was cancelled, or the process is being interrupted."""
        r = self.remaining()
        return r is not None and r <= 0

    def cancel(self, reason: str = "interrupted") -> None:
        """End every wait of this budget at its next check (waits raise :class:`helpers.errors.ServerTimeout`)."""
        self._cancelled = reason

    def stopped(self) -> Optional[str]:
        """Why the budget was ended early (:meth:`cancel` or :func:`interrupt`), or None."""
        return self._cancelled or interrupted()

    def error(self, what: str, endpoint: str = "") -> ServerTimeout:
        """The error for a wait on ``what`` (``"POST http://host:port/generate"``, ``"the fixed server"``) that
        the budget ended: the deadline with the time elapsed and the option that raises it, or why it was
        cancelled."""
        why = self.stopped()
        if why:
            return ServerTimeout(f"{what}: {why}", endpoint=endpoint)
        return ServerTimeout(f"{what}: the overall deadline of {self.seconds:.0f} s passed ({self.elapsed():.0f} s "
                             f"elapsed; raise it with {self.flag})", endpoint=endpoint)

    def check(self, what: str, endpoint: str = "") -> None:
        """Raise :meth:`error` when the budget is spent; else return."""
        if self.spent():
            raise self.error(what, endpoint)

    def sleep(self, seconds: float) -> None:
        """Sleep ``seconds``, at most what is left; returns early (within 0.1 s) once the budget is cancelled."""
        end = time.monotonic() + self.cap(seconds)
        while (left := end - time.monotonic()) > 0 and not self.stopped():
            time.sleep(min(left, 0.1))
