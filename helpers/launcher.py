"""Start and stop the embedded reference server: real SGLang 0.5.23 on CPU, optionally with EAGLE-3.

The server runs in the dedicated venv made by ``env/reference/install.sh`` with the pure-torch
``sgl_kernel`` stand-in (``env/reference/standin``). :func:`start` sets what SGLang needs on a CPU
(see ``env/reference/README.md`` and ``shared/reference/sglang-cpu.md``):

* ``SGLANG_USE_CPU_ENGINE=1`` (``sglang/srt/utils/common.py::is_cpu``),
* ``E3F_STANDIN_AMX=1`` so SGLang selects its ``intel_amx`` backend, the only CPU attention
  backend it allows for EAGLE (``sglang/srt/speculative/draft_utils.py``),
* ``SGLANG_CPU_OMP_THREADS_BIND`` with one CPU set per TP rank (``sglang/srt/utils/numa_utils.py``),
* ``TORCHDYNAMO_DISABLE=1``: SGLang wraps a few helpers in ``torch.compile``
  (e.g. ``sglang/srt/speculative/spec_utils.py``); on 2 cores inductor's C++ build costs ~40 s of
  startup for no benefit at this size,
* ``E3F_STANDIN_THREADS`` / ``OMP_NUM_THREADS``: one torch thread per rank by default,
* ``SGLANG_DISABLED_MODEL_ARCHS``: for a Llama target, every model module but ``llama`` and
  ``llama_eagle3`` (SGLang otherwise imports ~250 model files in each process at startup),
* ``--max-total-tokens`` (otherwise the KV pool is sized from RAM: tens of seconds),
  ``--disable-cuda-graph``, ``--sampling-backend pytorch``, ``--attention-backend intel_amx``.

It binds 127.0.0.1 only, picks a free port when none is given, waits on ``/health`` with a timeout,
and on failure raises :class:`ServerStartError` carrying the log tail. :meth:`ServerHandle.stop`
ends the whole process tree (SIGTERM to the launcher, then SIGKILL to any survivor) and verifies
that no process of the tree is left. An ``atexit`` hook stops servers the caller forgot.

The server's stdout/stderr are pumped into ``log_path`` by a thread; an API key passed with
``api_key=`` is replaced by ``<redacted>`` before anything reaches the file.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SGLANG_PYTHON = ROOT / "env" / "reference" / ".venv" / "bin" / "python"
REFERENCE_TARGET = ROOT / "env" / "models" / "target"
REFERENCE_DRAFT = ROOT / "env" / "models" / "draft"
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
SPEC_ALGORITHMS = ("EAGLE3", "EAGLE")


class ServerStartError(RuntimeError):
    """The server could not be started; ``str(err)`` ends with the last lines of its log."""

    def __init__(self, message: str, log_tail: str = "", log_path: Optional[Path] = None):
        self.log_tail = log_tail
        self.log_path = log_path
        text = message
        if log_path is not None:
            text += f"\nserver log: {log_path}"
        if log_tail:
            text += "\n--- last lines of the server log ---\n" + log_tail
        super().__init__(text)


class BadServerInput(ValueError):
    """Invalid launcher input (missing model, wrong draft architecture, port in use, ...)."""


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings passed as ``--speculative-*`` flags.

    ``algorithm`` is ``EAGLE3`` (aux hidden states, fc over 3 chunks) or ``EAGLE`` (last hidden
    state only; with an EAGLE-3 draft this is the ``fc_bypassed`` fault). ``num_steps`` draft
    steps, ``topk`` branching, ``num_draft_tokens`` tokens per verify step (SGLang forces
    ``num_steps + 1`` when ``topk == 1``: ``sglang/srt/speculative/spec_info.py``).
    """

    algorithm: str = "EAGLE3"
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def args(self) -> list[str]:
        return ["--speculative-algorithm", self.algorithm,
                "--speculative-num-steps", str(self.num_steps),
                "--speculative-eagle-topk", str(self.topk),
                "--speculative-num-draft-tokens", str(self.num_draft_tokens)]


def free_port(host: str = "127.0.0.1", low: int = 12000, high: int = 20000) -> int:
    """A TCP port in ``[low, high)`` that is free on ``host`` right now.

    The range lies below the kernel's ephemeral range (32768+), where outgoing connections take
    ports, and below the 22000-29999 range SGLang draws its own internal ports from
    (``sglang/srt/utils/network.py::get_free_port_below_ephemeral``), so a port picked now is
    unlikely to be taken while the server starts (which can take a minute on 2 cores).
    """
    import random

    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if not port_in_use(port, host):
            return port
    raise RuntimeError(f"no free TCP port in [{low}, {high}) on {host}")


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``host:port`` cannot be bound (another process listens there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def cpu_bind_spec(tp: int, cpus: Optional[Sequence[int]] = None) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` value: one CPU set per TP rank, joined by ``|``.

    With at least as many CPUs as ranks the CPUs are split into ``tp`` contiguous groups; with
    fewer, ranks share CPUs round-robin (``tp=8`` on 2 CPUs -> ``0|1|0|1|0|1|0|1``).
    """
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if tp <= 0:
        raise BadServerInput(f"tp must be >= 1, got {tp}")
    if tp >= len(cpus):
        return "|".join(str(cpus[r % len(cpus)]) for r in range(tp))
    per = len(cpus) // tp
    groups = []
    for r in range(tp):
        chunk = cpus[r * per:(r + 1) * per] if r < tp - 1 else cpus[r * per:]
        groups.append(",".join(str(c) for c in chunk))
    return "|".join(groups)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise BadServerInput(f"{what}: {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise BadServerInput(f"{what}: {path} is not valid JSON ({exc})") from None


def check_model_dir(path: Path, what: str) -> dict:
    """Validate a HF model folder (exists, has config.json with ``architectures``); return config."""
    path = Path(path)
    if not path.is_dir():
        raise BadServerInput(f"{what} path {path} is not a directory")
    cfg = _read_json(path / "config.json", f"{what} config")
    if not cfg.get("architectures"):
        raise BadServerInput(f"{what} config {path / 'config.json'}: field 'architectures' is missing")
    return cfg


def check_draft_dir(path: Path, algorithm: str) -> dict:
    """Validate the draft folder for ``algorithm``; an EAGLE3 server needs an EAGLE-3 draft."""
    cfg = check_model_dir(path, "draft")
    archs = cfg.get("architectures") or []
    if algorithm == "EAGLE3" and not any(a in EAGLE3_ARCHITECTURES for a in archs):
        raise BadServerInput(
            f"draft config {Path(path) / 'config.json'}: architectures={archs} is not an EAGLE-3 "
            f"draft; --speculative-algorithm EAGLE3 needs one of {list(EAGLE3_ARCHITECTURES)}")
    return cfg


class ServerHandle:
    """A running reference server. Use as a context manager or call :meth:`stop`.

    Attributes: ``url`` (``http://127.0.0.1:PORT``), ``port``, ``pid`` (launcher process),
    ``log_path``, ``command`` (argv, API key redacted), ``tp``, ``spec`` (or None), ``target``,
    ``draft``.
    """

    def __init__(self, proc: subprocess.Popen, *, port: int, log_path: Path, command: list[str],
                 tp: int, spec: Optional[SpecConfig], target: Path, draft: Optional[Path],
                 pump: threading.Thread, secrets: Iterable[str] = ()):
        self.proc = proc
        self.pid = proc.pid
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.command = command
        self.tp = tp
        self.spec = spec
        self.target = target
        self.draft = draft
        self._pump = pump
        self._secrets = [s for s in secrets if s]
        self._known: dict[int, psutil.Process] = {}
        self._stopped = False
        self._remember_tree()

    def _remember_tree(self) -> None:
        try:
            root = psutil.Process(self.pid)
            for p in [root] + root.children(recursive=True):
                self._known.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def is_alive(self) -> bool:
        """True while the launcher process runs."""
        return self.proc.poll() is None

    def processes(self) -> list[psutil.Process]:
        """The launcher and every descendant seen so far that is still running."""
        self._remember_tree()
        alive = []
        for p in self._known.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
            except psutil.Error:
                pass
        return alive

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server log (secrets already redacted)."""
        return tail(self.log_path, lines)

    def stop(self, timeout: float = 20.0) -> None:
        """Stop the server and every process it started; idempotent.

        SIGTERM goes to the launcher (SGLang then stops its schedulers and detokenizer); after
        ``timeout`` seconds, or if anything survives the launcher, SIGKILL goes to the rest.
        Raises RuntimeError if a process of the tree is still alive afterwards.
        """
        if self._stopped:
            return
        self._remember_tree()
        if self.is_alive():
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        survivors = self.processes()
        for p in survivors:
            try:
                p.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(survivors, timeout=10)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self._pump.join(timeout=5)
        self._stopped = True
        _LIVE.discard(self)
        left = self.processes()
        if left:
            raise RuntimeError(f"processes of server pid {self.pid} survived stop(): "
                               f"{[p.pid for p in left]}")

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else "stopped"
        return f"<ServerHandle {self.url} pid={self.pid} tp={self.tp} {state}>"


_LIVE: set[ServerHandle] = set()


@atexit.register
def _stop_all() -> None:
    for handle in list(_LIVE):
        try:
            handle.stop(timeout=5)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


def tail(path: Path, lines: int = 40) -> str:
    """Last ``lines`` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as fh:
            data = deque(fh, maxlen=lines)
    except OSError:
        return ""
    return b"".join(data).decode("utf-8", "replace")


def _pump_output(stream, log_path: Path, secrets: list[str]) -> None:
    with open(log_path, "ab", buffering=0) as out:
        for raw in iter(stream.readline, b""):
            line = raw
            for s in secrets:
                line = line.replace(s.encode(), b"<redacted>")
            out.write(line)
    stream.close()


KEEP_MODEL_MODULES = {"llama": ("llama", "llama_eagle3")}


def disabled_model_modules(python: Path, model_type: Optional[str]) -> Optional[str]:
    """Value for ``SGLANG_DISABLED_MODEL_ARCHS``: every module of ``sglang/srt/models`` except the
    ones a ``model_type`` needs, or None when the model type is not known here.

    SGLang's model registry imports all ~250 model modules at startup in every process
    (``sglang/srt/models/registry.py::import_model_classes``), unless listed in this env var;
    skipping them saves most of the per-process import time on 2 cores.
    """
    keep = KEEP_MODEL_MODULES.get(model_type or "")
    if keep is None:
        return None
    lib = Path(python).resolve().parent.parent / "lib"
    found = sorted(lib.glob("python3*/site-packages/sglang/srt/models"))
    if not found:
        return None
    names = sorted(p.stem for p in found[0].glob("*.py") if p.stem not in keep and p.stem != "__init__")
    return ",".join(names)


def build_command(python: Path, target: Path, *, draft: Optional[Path], tp: int,
                  spec: Optional[SpecConfig], port: int, dtype: str, max_total_tokens: int,
                  return_hidden_states: bool, enable_metrics: bool,
                  forward_hooks: Optional[list[dict]], api_key: Optional[str],
                  extra_args: Sequence[str]) -> list[str]:
    """The ``sglang.launch_server`` argv for the CPU reference server (see module docstring)."""
    cmd = [os.fspath(python), "-m", "sglang.launch_server",
           "--model-path", os.fspath(target), "--device", "cpu", "--dtype", dtype,
           "--attention-backend", "intel_amx", "--sampling-backend", "pytorch",
           "--disable-cuda-graph", "--max-total-tokens", str(max_total_tokens),
           "--tp-size", str(tp), "--host", "127.0.0.1", "--port", str(port)]
    if draft is not None:
        spec = spec or SpecConfig()
        cmd += ["--speculative-draft-model-path", os.fspath(draft)] + spec.args()
    if return_hidden_states:
        cmd.append("--enable-return-hidden-states")
    if enable_metrics:
        cmd.append("--enable-metrics")
    if forward_hooks:
        cmd += ["--forward-hooks", json.dumps(forward_hooks)]
    if api_key:
        cmd += ["--api-key", api_key]
    cmd += list(extra_args)
    return cmd


def start(target: os.PathLike | str | None = None, draft: os.PathLike | str | None = None,
          tp: int = 2, spec: SpecConfig | dict | None = None, extra_args: Sequence[str] = (),
          forward_hooks: Optional[list[dict]] = None, port: Optional[int] = None,
          **kwargs: Any) -> "ServerHandle":
    """Start the CPU reference server and wait until ``/health`` answers 200.

    Args:
        target: HF folder of the target model (default: the shipped ``env/models/target``).
        draft: EAGLE-3 draft folder, or None for a target-only server (default: no draft).
        tp: tensor-parallel size (1, 2 and 8 are tested; heads must divide by it).
        spec: :class:`SpecConfig` or dict of its fields (default EAGLE3, 3 steps, topk 1,
            4 draft tokens); ignored without a draft.
        extra_args: further ``sglang.launch_server`` flags, appended last.
        forward_hooks: SGLang ``--forward-hooks`` specs (list of dicts with ``name``,
            ``target_modules``, ``hook_factory``, ``config``), e.g. from :mod:`helpers.hooks`.
        port: TCP port on 127.0.0.1 (default: a free one).
        dtype: model dtype flag (``float32`` makes greedy output equal HF's fp32 output).
        max_total_tokens: KV pool size in tokens.
        return_hidden_states: add ``--enable-return-hidden-states`` (needed for captures).
        enable_metrics: add ``--enable-metrics`` (Prometheus ``/metrics``).
        api_key: passed as ``--api-key``; redacted from the log file.
        log_path: where the server log goes (default: a new temp file).
        timeout: seconds to wait for ``/health`` before giving up.
        python: interpreter of the SGLang venv (default ``env/reference/.venv/bin/python`` or
            ``$E3F_SGLANG_PYTHON``).
        env: extra environment variables for the server.
        cpus: CPUs to bind ranks to (default: this process's affinity).
        threads_per_rank: torch/OpenMP threads per TP rank (default 1). The reference models
            are tiny: a second thread buys nothing and, when the CPU is shared, OpenMP barrier
            waits made a TP 1 server 5x slower (bench/RESULTS.md).

    When the port was picked automatically and the server lost it to another process while
    starting ("address already in use" in its log), a new port is tried (3 attempts in all).

    Returns: a :class:`ServerHandle`.

    Raises:
        BadServerInput: missing model folder, a draft that is not EAGLE-3 under EAGLE3, port in
            use, missing SGLang venv.
        ServerStartError: the server died during startup or missed ``timeout``; the message
            holds the log tail. No process of the attempt survives.
    """
    attempts = 1 if port is not None else 3
    for attempt in range(attempts):
        try:
            return _start_once(target, draft, tp, spec, extra_args, forward_hooks, port, **kwargs)
        except ServerStartError as exc:
            if attempt + 1 < attempts and "address already in use" in exc.log_tail:
                continue
            raise
    raise AssertionError("unreachable")


def _start_once(target: os.PathLike | str | None = None, draft: os.PathLike | str | None = None,
          tp: int = 2, spec: SpecConfig | dict | None = None, extra_args: Sequence[str] = (),
          forward_hooks: Optional[list[dict]] = None, port: Optional[int] = None, *,
          dtype: str = "float32", max_total_tokens: int = 8192, return_hidden_states: bool = True,
          enable_metrics: bool = True, api_key: Optional[str] = None,
          log_path: os.PathLike | str | None = None, timeout: float = 300.0,
          python: os.PathLike | str | None = None, env: Optional[dict[str, str]] = None,
          cpus: Optional[Sequence[int]] = None, threads_per_rank: int = 1) -> ServerHandle:
    """One start attempt (see :func:`start`)."""
    target = Path(target) if target is not None else REFERENCE_TARGET
    target_cfg = check_model_dir(target, "target")
    if isinstance(spec, dict):
        spec = SpecConfig(**spec)
    draft_path = Path(draft) if draft is not None else None
    if draft_path is not None:
        spec = spec or SpecConfig()
        if spec.algorithm not in SPEC_ALGORITHMS:
            raise BadServerInput(f"spec.algorithm={spec.algorithm!r}; expected one of {SPEC_ALGORITHMS}")
        check_draft_dir(draft_path, spec.algorithm)
    else:
        spec = None
    python = Path(python or os.environ.get("E3F_SGLANG_PYTHON") or DEFAULT_SGLANG_PYTHON)
    if not Path(python).exists():
        raise BadServerInput(f"SGLang interpreter {python} not found; run env/reference/install.sh "
                             "(or set E3F_SGLANG_PYTHON)")
    if port is None:
        port = free_port()
    elif port_in_use(port):
        raise BadServerInput(f"port {port} on 127.0.0.1 is already in use; pass another port or "
                             "port=None to pick a free one")
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="e3f-server-")) / f"sglang-{port}.log"
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)

    cmd = build_command(python, target, draft=draft_path, tp=tp, spec=spec, port=port, dtype=dtype,
                        max_total_tokens=max_total_tokens, return_hidden_states=return_hidden_states,
                        enable_metrics=enable_metrics, forward_hooks=forward_hooks, api_key=api_key,
                        extra_args=extra_args)
    shown = [("<redacted>" if api_key and a == api_key else a) for a in cmd]
    server_env = dict(os.environ)
    for k in ("SGLANG_API_KEY",):
        server_env.pop(k, None)
    server_env.update({
        "SGLANG_USE_CPU_ENGINE": "1", "E3F_STANDIN_AMX": "1", "TORCHDYNAMO_DISABLE": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
        "SGLANG_CPU_OMP_THREADS_BIND": cpu_bind_spec(tp, cpus),
        "E3F_STANDIN_THREADS": str(threads_per_rank), "OMP_NUM_THREADS": str(threads_per_rank),
        "E3F_SHM_KEY": f"{os.getpid()}-{port}-{int(time.time() * 1e3) % 10**9}",
    })
    disabled = disabled_model_modules(python, target_cfg.get("model_type"))
    if disabled and "SGLANG_DISABLED_MODEL_ARCHS" not in os.environ:
        server_env["SGLANG_DISABLED_MODEL_ARCHS"] = disabled
    server_env.update(env or {})
    with open(log_path, "ab") as fh:
        fh.write(("$ " + " ".join(shown) + "\n").encode())
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=server_env, cwd=os.fspath(ROOT),
                            start_new_session=True)
    secrets = [api_key] if api_key else []
    pump = threading.Thread(target=_pump_output, args=(proc.stdout, log_path, secrets),
                            name=f"sglang-log-{port}", daemon=True)
    pump.start()
    handle = ServerHandle(proc, port=port, log_path=log_path, command=shown, tp=tp, spec=spec,
                          target=target, draft=draft_path, pump=pump, secrets=secrets)
    _LIVE.add(handle)
    try:
        _wait_healthy(handle, timeout, api_key)
    except BaseException:
        try:
            handle.stop(timeout=5)
        finally:
            pass
        raise
    return handle


def _wait_healthy(handle: ServerHandle, timeout: float, api_key: Optional[str]) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, headers=headers) as client:
        while True:
            if not handle.is_alive():
                time.sleep(0.5)  # let the pump flush the last lines
                raise ServerStartError(
                    f"SGLang server (pid {handle.pid}) exited with code {handle.proc.returncode} "
                    "during startup", handle.log_tail(), handle.log_path)
            handle._remember_tree()
            try:
                if client.get(handle.url + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"SGLang server (pid {handle.pid}) not healthy after "
                                       f"{timeout:.0f} s", handle.log_tail(), handle.log_path)
            time.sleep(1.0)


def stop_pid(pid: int, timeout: float = 20.0) -> list[int]:
    """Stop a server tree started elsewhere by its launcher PID; return the PIDs that were ended."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    procs = [root] + root.children(recursive=True)
    root.send_signal(signal.SIGTERM)
    gone, alive = psutil.wait_procs([root], timeout=timeout)
    rest = [p for p in procs if p.is_running()]
    for p in rest:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(rest, timeout=10)
    return [p.pid for p in procs]


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
            from .capture import every_layer_hook_specs
            from .formats.configs import read_target_config

            n = read_target_config(args.target or REFERENCE_TARGET).num_hidden_layers
            hooks = (hooks or []) + every_layer_hook_specs(Path(args.capture_layers).resolve(), n)
        handle = start(args.target, draft, tp=args.tp, port=args.port,
                       spec=SpecConfig(args.algorithm, args.steps, args.topk, args.draft_tokens),
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
