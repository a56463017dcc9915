"""Running the CLI as a separate process against the fake servers of :mod:`support.fakeserver` (issue 21): the
models an investigation of a fake server needs (a config-only target and a draft 16 wide), a command run in the
background with its stderr in a file, waits on what it prints or on its connections, and a small tmpfs.

Every process started here is stopped by its PID (and its descendants by theirs) in :meth:`Cli.close`.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from helpers.formats.dumps import write_dump

from . import ROOT
from .fakeserver import H
from .tinymodels import build_eagle3_draft


def write_training(out: Path) -> Path:
    """A 3-chunk, ``H``-wide training dump of two samples (the fake server's width) recording that training
    captured out(1), out(3), out(4)."""
    g = torch.Generator().manual_seed(0)
    samples = [{"key": f"s{i}", "input_ids": torch.arange(5) + i, "hidden": torch.randn(5, 3 * H, generator=g)}
               for i in range(2)]
    return write_dump(out, samples, {"kind": "training", "hidden_size": H,
                                     "layer_plan": {"tensors": ["out(1)", "out(3)", "out(4)"]}})


def write_models(out: Path) -> tuple[Path, Path]:
    """``(target, draft)``: a config-only 8-layer Llama target ``H`` wide, and an EAGLE-3 draft for it whose config
    names the aux layer ids ``[-1, 1, 3]`` (the seeds' edit), so that an investigation of the fake server proposes a
    config fix it can apply (ids ``[1, 3, 4]``) and goes on to restart the server."""
    target = Path(out) / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": 8,
        "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 32, "vocab_size": 384,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "torch_dtype": "float32"}))
    draft = build_eagle3_draft(Path(out) / "draft", target, layer_ids=[-1, 1, 3])
    return target, draft


class Cli:
    """``python -m helpers ARGS`` in the background (umask 022, this checkout first on the path); stderr and stdout
    go to files under ``folder``."""

    def __init__(self, args: list[str], folder: Path, *, name: str = "cli"):
        self.err_path = Path(folder) / f"{name}.stderr"
        self.out_path = Path(folder) / f"{name}.stdout"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
        with open(self.err_path, "wb") as err, open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "helpers", *args], cwd=ROOT, env=env, stdout=out,
                                         stderr=err, stdin=subprocess.DEVNULL, preexec_fn=lambda: os.umask(0o022))
        self.seen: dict[int, psutil.Process] = {}

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        """Until ``text`` appears on stderr; AssertionError when the process ends or ``timeout`` passes first."""
        end = time.monotonic() + timeout
        while text not in self.stderr:
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {text!r}:\n{self.stderr}"
            assert time.monotonic() < end, f"no {text!r} after {timeout} s:\n{self.stderr}"
            time.sleep(0.1)

    def wait_connected(self, port: int, timeout: float = 60.0) -> None:
        """Until this process holds an established TCP connection to 127.0.0.1:``port`` (a request in flight)."""
        end = time.monotonic() + timeout
        me = psutil.Process(self.proc.pid)
        while not any(c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
                      for c in me.net_connections(kind="tcp")):
            assert self.proc.poll() is None, f"exited {self.proc.returncode}:\n{self.stderr}"
            assert time.monotonic() < end, f"no connection to port {port} after {timeout} s:\n{self.stderr}"
            time.sleep(0.1)

    def children(self) -> list[psutil.Process]:
        """Every descendant process alive now (remembered for :meth:`close`)."""
        kids = psutil.Process(self.proc.pid).children(recursive=True)
        self.seen.update({p.pid: p for p in kids})
        return kids

    def interrupt(self, sig: int, timeout: float = 30.0) -> tuple[int, float]:
        """Send ``sig`` and wait for the command to end: ``(exit code, seconds from the signal to the end)``."""
        t = time.monotonic()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=timeout)
        return rc, time.monotonic() - t

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        """Stop the command and every descendant seen, by PID."""
        with contextlib.suppress(psutil.Error):
            self.children()
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                p.kill()


def run_cli(args: list[str], folder: Path, *, timeout: float = 120.0, name: str = "cli") -> tuple[int, Cli]:
    """Run ``python -m helpers ARGS`` to its end (:class:`Cli`); ``(exit code, the Cli with its stderr)``."""
    cli = Cli(args, folder, name=name)
    try:
        return cli.wait(timeout=timeout), cli
    finally:
        cli.close()


def gone(p: psutil.Process) -> bool:
    """True when ``p`` no longer runs (ended, or a zombie waiting for its parent)."""
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def group_gone(pgid: int) -> bool:
    """True when no process of the process group ``pgid`` is left (zombies aside)."""
    return all(gone(p) for p in psutil.process_iter() if _pgid(p) == pgid)


def _pgid(p: psutil.Process) -> int | None:
    try:
        return os.getpgid(p.pid)
    except OSError:
        return None


@contextlib.contextmanager
def small_tmpfs(folder: Path, size: str):
    """A tmpfs of ``size`` (mount syntax, e.g. ``"3m"``) mounted at ``folder``; None when it cannot be mounted (not
    root). Unmounted after."""
    folder.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                      capture_output=True).returncode:
        yield None
        return
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def fill(folder: Path, leave: int = 0) -> None:
    """Fill the file system of ``folder`` until at most ``leave`` bytes are free."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with open(folder / "filler", "wb") as fh:
        with contextlib.suppress(OSError):
            fh.write(b"\0" * max(0, free - leave))


SIGNALS = {"SIGINT": (signal.SIGINT, 130), "SIGTERM": (signal.SIGTERM, 143)}
