"""One managed server process: start a launch command in its own session, pump its output into a log with
secrets redacted, wait for ``/health`` with a deadline, stop it by PID (the whole process tree, then the
process group), and verify nothing survived. Used for the embedded reference server
(:mod:`helpers.server.embedded`) and for raw launch commands (a TP 8 GPU server in a fixes file); every live
instance is stopped at interpreter exit.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import httpx
import psutil

from ..budget import Budget, interrupted
from ..errors import ServerStartError
from ..redaction import argv_secrets, redact_argv, remember, scrub_bytes


def tail(path: Path, lines: int = 40) -> str:
    """Last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            data = deque(fh, maxlen=lines)
    except OSError:
        return ""
    return b"".join(data).decode("utf-8", "replace")


def _pump(stream, log_path: Path, secrets: list[str]) -> None:
    with open(log_path, "ab", buffering=0) as out:
        for raw in iter(stream.readline, b""):
            out.write(scrub_bytes(raw, secrets))
    stream.close()


#: while a command is interrupted: seconds a server's leader gets after SIGTERM before every process of its tree and
#: group gets SIGKILL, and the longest wait for them to be gone after that (:meth:`ServerProcess.stop`,
#: :func:`stop_descendants`); the two keep a signal's exit within 2 s (bench/bench_signal.py, bench/RESULTS.md)
INTERRUPT_GRACE_S = 0.3
INTERRUPT_REAP_S = 0.5
#: processes (PID, start time) a stop() sent SIGKILL: being torn down by the kernel, no more code of theirs runs
_KILLED: set[tuple[int, float]] = set()


def _identity(p: psutil.Process) -> tuple[int, float]:
    """``(pid, start time)``: one process, whatever later reuses its PID."""
    try:
        return p.pid, p.create_time()
    except psutil.Error:
        return p.pid, -1.0


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class ServerProcess:
    """A server started from an argv, stopped by PID. Use as a context manager or call :meth:`stop`.

    Args:
        argv: the command (no shell).
        url: the server's base URL once up.
        log_path: the log file (created; appended to); its first line is the command with the values of its secret
            flags redacted (:func:`helpers.redaction.redact_argv`).
        env / cwd: environment and working folder of the process.
        secrets: strings replaced by ``<redacted>`` in the log as it is written, besides the values of ``argv``'s
            secret flags (``--api-key K``, ``--admin-api-key=K2``, ...) and every secret remembered by
            :mod:`helpers.redaction`.
        info: extra attributes set on the handle (``port``, ``tp``, ``spec``, ``target``, ``draft`` ...).

    Attributes: ``url``, ``pid`` (the leader), ``log_path``, ``command`` (argv, secrets redacted), plus ``info``.
    """

    def __init__(self, argv: Sequence[str], url: str, *, log_path: Path,
                 env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None, secrets: Iterable[str] = (),
                 **info: Any):
        self.argv = [str(a) for a in argv]
        self.secrets = sorted({s for s in secrets if s} | set(argv_secrets(self.argv)), key=len, reverse=True)
        remember(*self.secrets)
        self.command = redact_argv(self.argv)
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        for k, v in info.items():
            setattr(self, k, v)
        with open(self.log_path, "ab") as fh:
            fh.write(("$ " + " ".join(self.command) + "\n").encode())
        self._known: dict[int, psutil.Process] = {}
        self._stopped = False
        self._pump: Optional[threading.Thread] = None
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=dict(env) if env is not None else None,
                                     cwd=cwd, start_new_session=True)
        self.pid = self.proc.pid
        _LIVE.add(self)                  # at once: a signal from here on finds it (stop_all) and stops it
        try:
            self._pump = threading.Thread(target=_pump, args=(self.proc.stdout, self.log_path, self.secrets),
                                          daemon=True, name=f"server-log-{self.pid}")
            self._pump.start()
            self._remember_tree()
        except BaseException:
            self.stop(timeout=1)
            raise

    def _remember_tree(self) -> None:
        try:
            root = psutil.Process(self.pid)
            for p in [root] + root.children(recursive=True):
                self._known.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def is_alive(self) -> bool:
        """True while the leader process runs."""
        return self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """The leader and every descendant seen so far that is still running."""
        self._remember_tree()
        return [p for p in self._known.values() if _running(p)]

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log (secrets already redacted)."""
        return tail(self.log_path, lines)

    def wait_healthy(self, timeout: float, *, api_key: Optional[str] = None, what: str = "server",
                     budget: Optional[Budget] = None) -> None:
        """Poll ``GET /health`` (5 s per request at most) until it answers 200, for ``timeout`` seconds and never past
        ``budget`` (the command's :class:`helpers.budget.Budget`, e.g. ``investigate --timeout``).

        Raises:
            ServerStartError: the process exited, ``timeout`` seconds passed or the budget was spent; the message
                holds the log tail.
        """
        budget = budget if budget is not None else Budget()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0, headers=headers) as client:
            while True:
                if not self.is_alive():
                    time.sleep(0.5)  # let the pump flush the last lines
                    raise ServerStartError(f"{what} (pid {self.pid}) exited with code {self.proc.returncode} "
                                           "during startup", self.log_tail(), self.log_path)
                self._remember_tree()
                try:
                    if client.get(self.url + "/health", timeout=max(0.05, budget.cap(5.0))).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if budget.spent():
                    raise ServerStartError(str(budget.error(f"{what} (pid {self.pid}) not healthy at "
                                                            f"{self.url}/health")), self.log_tail(), self.log_path)
                if time.monotonic() > deadline:
                    raise ServerStartError(f"{what} (pid {self.pid}) not healthy at {self.url}/health after "
                                           f"{timeout:.0f} s", self.log_tail(), self.log_path)
                budget.sleep(1.0)

    @classmethod
    def launch_healthy(cls, argv: Sequence[str], url: str, *, log_path: Path, api_key: Optional[str] = None,
                       what: str = "server", budget: Optional[Budget] = None, timeout: float = 1800,
                       env: Optional[Mapping[str, str]] = None, cwd: Optional[str] = None,
                       **info: Any) -> "ServerProcess":
        """Start ``argv`` (serving ``url``; ``api_key`` redacted from its log; ``cwd`` and ``info`` as the
        constructor takes them) and wait until it is healthy (:meth:`wait_healthy`, ``timeout`` seconds, never past
        ``budget``); a server that does not come up is stopped before the error propagates. What every start of an
        embedded server does (SGLang: :func:`helpers.server.embedded.start`, its restarts
        :func:`helpers.server.restart.start_variant`; vLLM: :func:`helpers.engines.vllm_server.start`,
        ``VLLMAdapter.start_variant``)."""
        handle = cls(argv, url, log_path=log_path, secrets=[api_key] if api_key else [], env=env, cwd=cwd, **info)
        try:
            handle.wait_healthy(timeout, api_key=api_key, what=what, budget=budget)
        except BaseException:
            handle.stop(timeout=5)
            raise
        return handle

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the process and every process it started; idempotent.

        SIGTERM goes to the leader (SGLang then stops its schedulers and detokenizer); after ``timeout``
        seconds, or if anything survives the leader, SIGKILL goes to the rest and to the process group, and the
        processes are waited for (10 s).

        While this process is being interrupted (:func:`helpers.budget.interrupted`: SIGINT / SIGTERM reached the
        command, which must end within 2 s), the grace is :data:`INTERRUPT_GRACE_S` and the wait after SIGKILL
        :data:`INTERRUPT_REAP_S`: SGLang's own shutdown takes 8 s on 2 loaded cores (a longer grace only
        delays the SIGKILL), and a killed scheduler's memory takes the kernel up to ~1 s to free there. A process
        still being torn down after that has been sent SIGKILL -- it runs no more code -- and is not waited for.

        Raises:
            RuntimeError: a process of the tree is still alive afterwards (not while interrupted).
        """
        if self._stopped:
            return
        hurry = interrupted() is not None
        grace = min(timeout, INTERRUPT_GRACE_S) if hurry else timeout
        reap = INTERRUPT_REAP_S if hurry else 10.0
        self._remember_tree()
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        survivors = self.processes()
        for p in survivors:
            with contextlib.suppress(psutil.Error):
                p.kill()
                _KILLED.add(_identity(p))
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        t = time.monotonic()
        psutil.wait_procs(survivors, timeout=reap)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, reap - (time.monotonic() - t)) if hurry else 5)
        if self._pump is not None:
            self._pump.join(timeout=0.1 if hurry else min(timeout, 5))
        self._stopped = True
        _LIVE.discard(self)
        left = self.processes()
        if left and not hurry:
            raise RuntimeError(f"processes of server pid {self.pid} survived stop(): {[p.pid for p in left]}")

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        return f"<ServerProcess {self.url} pid={self.pid} {state}>"


#: the embedded reference server's handle is a ServerProcess (name kept for readers of older docs)
ServerHandle = ServerProcess

_LIVE: set[ServerProcess] = set()


@atexit.register
def stop_all(timeout: float = 5.0) -> None:
    """Stop every server this process started and has not stopped yet (at interpreter exit, and after a signal:
    :func:`helpers.cli.common.run`); best effort, never raises."""
    for handle in list(_LIVE):
        try:
            handle.stop(timeout=timeout)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def stop_descendants(timeout: float = INTERRUPT_GRACE_S, reap: float = INTERRUPT_REAP_S) -> list[int]:
    """Stop every process this process started that still runs -- children and their descendants, by PID, and the
    process groups those lead -- SIGTERM, then SIGKILL after ``timeout`` seconds, then a wait of at most ``reap``
    seconds for them to be gone; returns their PIDs. What a command does after SIGINT / SIGTERM, once its own
    clean-up ran (:func:`helpers.__main__.exit_with`): notebook workers and their kernels, a server whose handle
    was never returned. Processes already being torn down (killed by a server's :meth:`ServerProcess.stop`) are
    left to the kernel."""
    try:
        procs = [p for p in psutil.Process().children(recursive=True) if _identity(p) not in _KILLED and _running(p)]
    except psutil.Error:
        return []
    leaders = []
    for p in procs:
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == p.pid:
                leaders.append(p.pid)
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    for pgid in leaders:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
    psutil.wait_procs(alive, timeout=reap)
    return [p.pid for p in procs]


def stop_pid(pid: int, timeout: float = 20.0) -> list[int]:
    """Stop a server tree started elsewhere by its leader PID; return the PIDs that were ended."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    procs = [root] + root.children(recursive=True)
    root.send_signal(signal.SIGTERM)
    psutil.wait_procs([root], timeout=timeout)
    rest = [p for p in procs if _running(p)]
    for p in rest:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(rest, timeout=10)
    return [p.pid for p in procs]
