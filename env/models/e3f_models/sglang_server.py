"""Minimal start/stop of the embedded SGLang 0.5.23 CPU reference server for env/models scripts.

A stop-gap for the model scripts and tests until the project's launcher (``helpers/launcher.py``)
is merged; same launch recipe (shared/reference/sglang-cpu.md): ``SGLANG_USE_CPU_ENGINE=1``,
``E3F_STANDIN_AMX=1`` (selects the ``intel_amx`` backend, the only CPU backend EAGLE accepts),
``SGLANG_CPU_OMP_THREADS_BIND`` one CPU set per TP rank, ``--attention-backend intel_amx
--sampling-backend pytorch --disable-cuda-graph --max-total-tokens 8192 --dtype float32``.

The server binds 127.0.0.1 only, gets its own process group, and ``stop()`` terminates the whole
group (SIGTERM, then SIGKILL) and checks with psutil that no process of the tree survives. An
``atexit`` hook stops servers a caller forgot. The SGLang interpreter is ``$E3F_SGLANG_PYTHON`` or
``<repo>/env/reference/.venv/bin/python``.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import REPO_ROOT


def sglang_python() -> Path:
    """The interpreter of the SGLang server venv."""
    p = os.environ.get("E3F_SGLANG_PYTHON") or str(REPO_ROOT / "env/reference/.venv/bin/python")
    return Path(p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server: ``url``, ``pid``, ``log_path``; ``stop()``; context manager."""

    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, argv: list[str]):
        self.proc, self.pid, self.port = proc, proc.pid, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path, self.argv = log_path, argv
        self._stopped = False
        _LIVE.add(self)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _tree(self):
        import psutil
        try:
            root = psutil.Process(self.pid)
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the process group, SIGKILL what is left; raise if anything survives."""
        import psutil
        if self._stopped:
            return
        procs = self._tree()
        try:
            os.killpg(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        procs += self._tree()
        alive = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in alive:
            try:
                p.kill()
            except psutil.Error:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        psutil.wait_procs(alive, timeout=10)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._stopped = True
        _LIVE.discard(self)
        left = [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if left:
            raise RuntimeError(f"server {self.pid}: processes survived stop(): {left}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


_LIVE: set = set()


@atexit.register
def _stop_all():
    for s in list(_LIVE):
        try:
            s.stop(timeout=5)
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def start(target, draft=None, *, tp: int = 1, num_steps: int = 3, topk: int = 1,
          num_draft_tokens: int = 4, extra_args: list[str] | None = None,
          port: int | None = None, timeout: float = 600.0, log_path: Path | None = None) -> Server:
    """Start SGLang on ``target`` (EAGLE-3 with ``draft`` when given) and wait for ``/health``."""
    port = port or free_port()
    argv = [str(sglang_python()), "-m", "sglang.launch_server", "--model-path", str(target),
            "--device", "cpu", "--dtype", "float32", "--attention-backend", "intel_amx",
            "--sampling-backend", "pytorch", "--disable-cuda-graph", "--max-total-tokens", "8192",
            "--tp-size", str(tp), "--host", "127.0.0.1", "--port", str(port),
            "--skip-server-warmup"]
    if draft is not None:
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                 "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", str(topk),
                 "--speculative-num-draft-tokens", str(num_draft_tokens)]
    argv += list(extra_args or [])
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", E3F_STANDIN_AMX="1",
               TORCHDYNAMO_DISABLE="1",
               SGLANG_CPU_OMP_THREADS_BIND="|".join(str(i % (os.cpu_count() or 1))
                                                    for i in range(tp)) if tp > 1 else "0-1")
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="e3f-sglang-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, cwd=str(REPO_ROOT))
    srv = Server(proc, port, Path(log_path), argv)
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            tail = srv.log_tail()
            srv.stop()
            raise RuntimeError(f"SGLang exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
                if r.status == 200:
                    return srv
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(2)
    tail = srv.log_tail()
    srv.stop()
    raise TimeoutError(f"SGLang not healthy after {timeout:.0f} s:\n{tail}")
