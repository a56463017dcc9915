"""Start and stop the embedded reference server: real SGLang 0.5.23 on CPU, optionally with EAGLE-3.

The server runs in the dedicated venv made by ``env/reference/install.sh`` with the pure-torch
``sgl_kernel`` stand-in (``env/reference/standin``). :func:`start` sets what SGLang needs on a CPU
(see ``env/reference/README.md``):

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

It binds 127.0.0.1 only (the HTTP port, SGLang's ZMQ and gloo sockets, and, through the stand-in's start hook
``E3F_LOOPBACK_STORE``, torch's TCPStore of the distributed init, which would otherwise listen on every interface),
picks a free port when none is given, waits on ``/health`` with a timeout,
and on failure raises :class:`helpers.errors.ServerStartError` carrying the log tail. :meth:`helpers.server.process.ServerProcess.stop`
ends the whole process tree (SIGTERM to the launcher, then SIGKILL to any survivor) and verifies
that no process of the tree is left. An ``atexit`` hook stops servers the caller forgot.

The server's stdout/stderr are pumped into ``log_path`` by a thread; an API key passed with
``api_key=`` is replaced by ``<redacted>`` before anything reaches the file.
"""
from __future__ import annotations

import json
import os
import random
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from ..budget import Budget
from ..errors import BadServerInput, ServerStartError
from ..formats.configs import TEXT_CONFIG_KEYS, read_config_json
from ..layers.mtp import MTP_FAMILIES, mtp_head
from ..layers.sglang import eagle3_draft_classes, target_rule
from ..paths import DEFAULT_SGLANG_PYTHON, REFERENCE_DRAFT, REFERENCE_TARGET, ROOT  # noqa: F401 (re-exported)
from .listener_flags import refuse_listener_flags
from .process import ServerProcess
from .settings import SpecSettings

#: the pure-torch sgl_kernel stand-in and the process start hook of the SGLang venv (env/reference/install.sh)
STANDIN = ROOT / "env" / "reference" / "standin"

#: the speculative algorithms the embedded server starts: EAGLE3 / EAGLE with an EAGLE draft; STANDALONE with any causal
#: LM of the target's vocabulary as its own draft (sglang/srt/speculative/spec_info.py::SpeculativeAlgorithm, the
#: EAGLE V2 worker's verify path; the engine-state probe ``oracle`` serves the target as its own draft); NEXTN with a
#: DeepSeek-V3-class target's own NextN / MTP layer (no draft folder) or a separate NextN checkpoint
#: (``helpers.formats.nextn.export_nextn``): SGLang resolves NEXTN to EAGLE and, for ``DeepseekV3ForCausalLM``
#: without ``--speculative-draft-model-path``, loads the draft from the target's folder
#: (sglang/srt/arg_groups/speculative_hook.py::_resolve_speculative_algorithm, handle_speculative_decoding)
SPEC_ALGORITHMS = ("EAGLE3", "EAGLE", "STANDALONE", "NEXTN")

#: the architectures a NEXTN draft folder may name on the embedded server: the DeepSeek-V3 family of
#: :data:`helpers.layers.mtp.MTP_FAMILIES` (a separate NextN checkpoint, or a target with its extra layer, which
#: sglang/srt/configs/model_config.py::ModelConfig._config_draft_model renames to the head class for a draft)
NEXTN_DRAFT_ARCHS = tuple(a for f in MTP_FAMILIES if f.name == "deepseek_v3" for a in (f.head_arch, *f.target_archs))


#: the environment variable that sets the port range of every server this tool starts ("LOW-HIGH", inclusive)
PORT_RANGE_ENV = "E3F_PORT_RANGE"

#: below the kernel's ephemeral range (32768+) and SGLang's internal 22000-29999 (see :func:`free_port`)
DEFAULT_PORT_RANGE = (12000, 19999)


def parse_ports(spec: Any, *, what: str = "port") -> Optional[tuple[int, int]]:
    """A port or an inclusive port range as ``(low, high)``: ``30000`` / ``"30000"`` -> ``(30000, 30000)``,
    ``"30000-30010"`` -> ``(30000, 30010)``; None / "" -> None.

    Raises:
        BadServerInput: not a port or ``LOW-HIGH`` within 1-65535 (the message names ``what``)."""
    if spec is None or spec == "":
        return None
    text = str(spec).strip()
    try:
        low, _, high = text.partition("-")
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise BadServerInput(f"{what}: expected a port (30000) or a range (30000-30010), got {text!r}") from None
    if not 1 <= lo <= hi <= 65535:
        raise BadServerInput(f"{what}: expected ports within 1-65535 with LOW <= HIGH, got {text!r}")
    return lo, hi


def port_range() -> tuple[int, int]:
    """The range servers take their port from when none is given: ``$E3F_PORT_RANGE`` or 12000-19999."""
    return parse_ports(os.environ.get(PORT_RANGE_ENV), what=PORT_RANGE_ENV) or DEFAULT_PORT_RANGE


def free_port(host: str = "127.0.0.1", low: Optional[int] = None, high: Optional[int] = None) -> int:
    """A TCP port in ``[low, high]`` (default :func:`port_range`) that is free on ``host`` right now.

    The default range lies below the kernel's ephemeral range (32768+), where outgoing connections take
    ports, and below the 22000-29999 range SGLang draws its own internal ports from
    (``sglang/srt/utils/network.py::get_free_port_below_ephemeral``), so a port picked now is
    unlikely to be taken while the server starts (which can take a minute on 2 cores).

    Raises:
        BadServerInput: no free port in the range.
    """
    if low is None or high is None:
        low, high = port_range()
    rng = random.Random()
    candidates = list(range(low, high + 1))
    rng.shuffle(candidates)
    for port in candidates[:200]:
        if not port_in_use(port, host):
            return port
    raise BadServerInput(f"no free TCP port in {low}-{high} on {host}")


def pick_port(spec: Any, *, what: str = "port") -> int:
    """The port a server is started on: ``spec`` itself when it names one port, a free one of the range it names
    (:func:`parse_ports`), else a free one of :func:`port_range`."""
    ports = parse_ports(spec, what=what)
    if ports is not None and ports[0] == ports[1]:
        return ports[0]
    return free_port(low=ports[0], high=ports[1]) if ports else free_port()


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


def check_model_dir(path: Path, what: str) -> dict:
    """Validate a HF model folder (exists, has config.json with ``architectures``); return config."""
    path = Path(path)
    if not path.is_dir():
        raise BadServerInput(f"{what} path {path} is not a directory")
    cfg = read_config_json(path, f"{what} config", error=BadServerInput)
    if not cfg.get("architectures"):
        raise BadServerInput(f"{what} config {path / 'config.json'}: field 'architectures' is missing")
    return cfg


#: the MLA EAGLE-3 draft class (sglang/srt/models/kimi_k25_eagle3.py)
MLA_DRAFT = "Eagle3DeepseekV2ForCausalLM"


def _rope_type(cfg: dict) -> tuple[str, Any]:
    """(field, rope type) of a config: ``rope_parameters.rope_type`` (transformers 5), else the legacy
    ``rope_scaling.rope_type`` / ``.type``; the type is None when neither names one."""
    for key in ("rope_parameters", "rope_scaling"):
        d = cfg.get(key)
        if isinstance(d, dict):
            for sub in ("rope_type", "type"):
                if sub in d:
                    return f"{key}.{sub}", d[sub]
    return "rope_parameters.rope_type", None


def check_cpu_config(cfg: dict, path: Path, role: str) -> None:
    """Refuse, before anything is launched, a DeepSeek-family config that SGLang 0.5.23 would refuse on this CPU
    server (at start-up, after a minute of loading), with one line naming the file and the field.

    ``role`` is ``"target"`` (any architecture of the DeepSeek id rule: ``sglang/srt/models/deepseek_v2.py``, or
    Kimi-K2.5's ``text_config``) or ``"draft"`` (checked only for the MLA draft ``Eagle3DeepseekV2ForCausalLM``).

    * RoPE: DeepSeek attention builds its rotary embedding from ``rope_parameters`` unless its type is ``default``
      (``deepseek_v2.py::DeepseekV2DecoderLayer.__init__``), renames any other type to ``deepseek_yarn``
      (``DeepseekV2AttentionMLA.__init__``), and on CPU ``layers/rotary_embedding/factory.py::get_rope_cpu`` asserts
      ``rope_scaling is not None and rope_type == "deepseek_yarn"``: a missing or ``default`` type fails there
      (use yarn with ``factor: 1.0`` for plain RoPE).
    * target with routed experts: ``moe_layer_freq`` (read by ``DeepseekV2DecoderLayer._is_layer_sparse``) and
      ``topk_method`` (``MoEGate.__init__``) are not fields of transformers' ``DeepseekV3Config``: without them
      SGLang raises AttributeError.
    * MLA draft: ``q_lora_rank`` must be set and ``num_hidden_layers`` must be 1
      (``kimi_k25_eagle3.py::Eagle3MLADecoderLayer`` / ``Eagle3MLAModel.__init__`` raise ValueError).

    Raises:
        BadServerInput: ``<role> config <path>/config.json: field <name>: <what SGLang does> (<where>)``.
    """
    file = Path(path) / "config.json"
    archs = cfg.get("architectures") or []
    if role == "draft":
        if MLA_DRAFT not in archs:
            return
        text = cfg
    else:
        if target_rule(archs, cfg.get("model_type")).rule != "deepseek":
            return
        sub = next((k for k in TEXT_CONFIG_KEYS if isinstance(cfg.get(k), dict)), None)
        text = cfg[sub] if sub else cfg
    where = f"{role} config {file}: field " + ("" if role == "draft" or text is cfg else f"{sub}.")

    def refuse(field: str, what: str) -> None:
        raise BadServerInput(where + field + ": " + what)

    field, rope = _rope_type(text)
    if rope in (None, "default"):
        refuse(field, f"is {rope!r}; SGLang 0.5.23 on CPU builds DeepSeek/MLA RoPE only as deepseek_yarn (any non-"
                      "default type becomes deepseek_yarn; give rope_type 'yarn', with factor 1.0 for plain RoPE) -- "
                      "sglang/srt/layers/rotary_embedding/factory.py::get_rope_cpu asserts it at start-up")
    if role == "draft":
        if text.get("q_lora_rank") is None:
            refuse("q_lora_rank", "is missing or null; the MLA draft needs it (ValueError 'Eagle3 MLA layer requires "
                                  "q_lora_rank') -- sglang/srt/models/kimi_k25_eagle3.py::Eagle3MLADecoderLayer")
        if text.get("num_hidden_layers") != 1:
            refuse("num_hidden_layers", f"is {text.get('num_hidden_layers')!r}; the MLA draft has exactly 1 layer "
                                        "(ValueError 'EAGLE3 currently only supports 1 layer') -- "
                                        "sglang/srt/models/kimi_k25_eagle3.py::Eagle3MLAModel")
        return
    if text.get("n_routed_experts") is not None:
        if "moe_layer_freq" not in text:
            refuse("moe_layer_freq", "is missing; SGLang reads it for every layer (AttributeError; transformers' "
                                     "DeepseekV3Config has no default for it: add 1) -- sglang/srt/models/"
                                     "deepseek_v2.py::DeepseekV2DecoderLayer._is_layer_sparse")
        if "topk_method" not in text:
            refuse("topk_method", "is missing; SGLang's MoE gate reads it (AttributeError; 'noaux_tc' is DeepSeek-V3's "
                                  "sigmoid router with e_score_correction_bias) -- sglang/srt/models/deepseek_v2.py::"
                                  "MoEGate.__init__")


def check_nextn_target(target: Path, cfg: dict) -> None:
    """A NEXTN server without a draft folder loads the target's own NextN layer. The embedded CPU server serves the
    DeepSeek-V3 family's head only (``helpers.layers.mtp`` family ``deepseek_v3``), whose SGLang loader takes exactly
    one layer (``deepseek_common/deepseek_weight_loader.py::_initialize_nextn_conf``); the layer count is the one the
    engines see (:func:`helpers.layers.mtp.mtp_head`: config.json's ``num_nextn_predict_layers``, else
    ``DeepseekV3Config``'s default 1).

    Raises:
        BadServerInput: naming the config field and what was expected."""
    head = mtp_head(cfg)
    if head is None or head.family.name != "deepseek_v3" or head.form != "target":
        raise BadServerInput(f"target config {Path(target) / 'config.json'}: architectures="
                             f"{cfg.get('architectures') or []}; --speculative-algorithm NEXTN without a draft folder "
                             "needs a DeepSeek-V3 target (DeepseekV3ForCausalLM) with its NextN layer")
    if head.sglang_layers != 1:
        raise BadServerInput(f"target config {Path(target) / 'config.json'}: field {head.family.layers_field} is "
                             f"{cfg.get(head.family.layers_field)!r}; SGLang's NextN loader needs 1")


def check_draft_dir(path: Path, algorithm: str) -> dict:
    """Validate the draft folder for ``algorithm``; an EAGLE3 server needs an EAGLE-3 draft, a NEXTN server a NextN
    checkpoint (or a DeepSeek-V3 target folder with its NextN layer)."""
    cfg = check_model_dir(path, "draft")
    if algorithm == "NEXTN":
        head = mtp_head(cfg)
        if head is None or head.family.name != "deepseek_v3":
            raise BadServerInput(f"draft config {Path(path) / 'config.json'}: architectures="
                                 f"{cfg.get('architectures') or []} is not a NextN checkpoint; --speculative-algorithm "
                                 f"NEXTN here needs one of {list(NEXTN_DRAFT_ARCHS)}")
        return cfg
    archs = cfg.get("architectures") or []
    if algorithm == "EAGLE3" and not any(a in eagle3_draft_classes() for a in archs):
        raise BadServerInput(
            f"draft config {Path(path) / 'config.json'}: architectures={archs} is not an EAGLE-3 "
            f"draft; --speculative-algorithm EAGLE3 needs one of {eagle3_draft_classes()}")
    check_cpu_config(cfg, path, "draft")
    return cfg


#: model_type -> the ``sglang/srt/models`` modules its server imports: the target's and both EAGLE-3 draft classes'
#: (``llama_eagle3``; ``kimi_k25_eagle3``, the MLA draft, which imports ``deepseek_v2`` itself) and, for DeepSeek, the
#: NextN head's (``deepseek_nextn``: ``DeepseekV3ForCausalLMNextN``)
KEEP_MODEL_MODULES = {"llama": ("llama", "llama_eagle3"),
                      "deepseek_v3": ("deepseek_v2", "llama", "llama_eagle3", "kimi_k25_eagle3", "deepseek_nextn")}


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
    # the venv's own lib/, so the interpreter path is not resolved: a venv's bin/python is a symlink to the base
    # interpreter (e.g. ~/.pyenv/versions/3.11.7/bin/python3.11), whose lib/ holds no sglang
    lib = Path(os.path.abspath(python)).parent.parent / "lib"
    found = sorted(lib.glob("python3*/site-packages/sglang/srt/models"))
    if not found:
        return None
    names = sorted(p.stem for p in found[0].glob("*.py") if p.stem not in keep and p.stem != "__init__")
    return ",".join(names)


def build_command(python: Path, target: Path, *, draft: Optional[Path], tp: int,
                  spec: Optional[SpecSettings], port: int, dtype: str, max_total_tokens: int,
                  return_hidden_states: bool, enable_metrics: bool,
                  forward_hooks: Optional[list[dict]], api_key: Optional[str],
                  extra_args: Sequence[str]) -> list[str]:
    """The ``sglang.launch_server`` argv for the CPU reference server (see module docstring).

    Raises:
        BadServerInput: a flag of ``extra_args`` that would move a listener off 127.0.0.1 or off ``port``
            (:func:`helpers.server.listener_flags.refuse_listener_flags`)."""
    refuse_listener_flags(extra_args, "sglang")
    cmd = [os.fspath(python), "-m", "sglang.launch_server",
           "--model-path", os.fspath(target), "--device", "cpu", "--dtype", dtype,
           "--attention-backend", "intel_amx", "--sampling-backend", "pytorch",
           "--disable-cuda-graph", "--max-total-tokens", str(max_total_tokens),
           "--tp-size", str(tp), "--host", "127.0.0.1", "--port", str(port),
           # idle schedulers otherwise busy-poll: a TP 2 server at rest took 1.5 of 2 cores (bench/RESULTS.md);
           # sglang/srt/managers/scheduler_components/idle_sleeper.py (zmq.Poller on the request sockets)
           "--sleep-on-idle"]
    if draft is not None:
        spec = (spec or SpecSettings()).with_launch_defaults()
        cmd += ["--speculative-draft-model-path", os.fspath(draft)] + spec.args()
    elif spec is not None and spec.algorithm == "NEXTN":    # the target's own NextN layer is the draft
        cmd += spec.args()
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
          tp: int = 2, spec: SpecSettings | dict | None = None, extra_args: Sequence[str] = (),
          forward_hooks: Optional[list[dict]] = None, port: int | str | None = None,
          **kwargs: Any) -> ServerProcess:
    """Start the CPU reference server and wait until ``/health`` answers 200.

    Args:
        target: HF folder of the target model (default: the shipped ``env/models/target``).
        draft: EAGLE-3 draft folder (NEXTN: a NextN checkpoint), or None for a target-only server (default: no
            draft); with ``spec.algorithm`` NEXTN and no draft, the target's own NextN layer drafts.
        tp: tensor-parallel size (1, 2 and 8 are tested; heads must divide by it).
        spec: :class:`helpers.server.settings.SpecSettings` or a dict of its fields; unset fields default
            to EAGLE3, 3 steps, topk 1, 4 draft tokens; ignored without a draft unless the algorithm is NEXTN.
        extra_args: further ``sglang.launch_server`` flags, appended last; none may set a listener's address or
            port (:func:`helpers.server.listener_flags.refuse_listener_flags`).
        forward_hooks: SGLang ``--forward-hooks`` specs (list of dicts with ``name``,
            ``target_modules``, ``hook_factory``, ``config``), e.g. from :mod:`helpers.hooks`.
        port: TCP port on 127.0.0.1, or a range ``"LOW-HIGH"`` to take a free one from (default: a free one of
            ``$E3F_PORT_RANGE``, else 12000-19999).
        dtype: model dtype flag (``float32`` makes greedy output equal HF's fp32 output).
        max_total_tokens: KV pool size in tokens.
        return_hidden_states: add ``--enable-return-hidden-states`` (needed for captures).
        enable_metrics: add ``--enable-metrics`` (Prometheus ``/metrics``).
        api_key: passed as ``--api-key``; redacted from the log file.
        log_path: where the server log goes (default: a new temp file).
        timeout: seconds to wait for ``/health`` before giving up.
        budget: the command's :class:`helpers.budget.Budget`: the wait for ``/health`` ends when it is spent,
            whatever ``timeout`` says.
        python: interpreter of the SGLang venv (default ``env/reference/.venv/bin/python`` or
            ``$E3F_SGLANG_PYTHON``).
        env: extra environment variables for the server.
        cpus: CPUs to bind ranks to (default: this process's affinity).
        threads_per_rank: torch/OpenMP threads per TP rank (default 1). The reference models
            are tiny: a second thread buys nothing and, when the CPU is shared, OpenMP barrier
            waits made a TP 1 server 5x slower (bench/RESULTS.md).

    When the port was picked automatically (or from a range) and the server lost it to another process while
    starting ("address already in use" in its log), a new port is tried (3 attempts in all).

    Returns: a :class:`helpers.server.process.ServerProcess` (``url``, ``pid``, ``port``, ``log_path``,
    ``command``, ``tp``, ``spec``, ``target``, ``draft``).

    Raises:
        BadServerInput: missing model folder, a draft that is not EAGLE-3 under EAGLE3, a DeepSeek-family
            config SGLang would refuse on CPU (:func:`check_cpu_config`), port in
            use, missing SGLang venv, a listener flag among ``extra_args``.
        ServerStartError: the server died during startup or missed ``timeout``; the message
            holds the log tail. No process of the attempt survives.
    """
    refuse_listener_flags(extra_args, "sglang")
    ports = parse_ports(port)
    fixed = ports is not None and ports[0] == ports[1]
    attempts = 1 if fixed else 3
    for attempt in range(attempts):
        try:
            chosen = ports[0] if fixed else (free_port(low=ports[0], high=ports[1]) if ports else None)
            return _start_once(target, draft, tp, spec, extra_args, forward_hooks, chosen, **kwargs)
        except ServerStartError as exc:
            if attempt + 1 < attempts and "address already in use" in exc.log_tail:
                continue
            raise
    raise AssertionError("unreachable")


def _start_once(target: os.PathLike | str | None = None, draft: os.PathLike | str | None = None,
          tp: int = 2, spec: SpecSettings | dict | None = None, extra_args: Sequence[str] = (),
          forward_hooks: Optional[list[dict]] = None, port: Optional[int] = None, *,
          dtype: str = "float32", max_total_tokens: int = 8192, return_hidden_states: bool = True,
          enable_metrics: bool = True, api_key: Optional[str] = None,
          log_path: os.PathLike | str | None = None, timeout: float = 300.0, budget: Optional[Budget] = None,
          python: os.PathLike | str | None = None, env: Optional[dict[str, str]] = None,
          cpus: Optional[Sequence[int]] = None, threads_per_rank: int = 1) -> ServerProcess:
    """One start attempt (see :func:`start`)."""
    target = Path(target) if target is not None else REFERENCE_TARGET
    target_cfg = check_model_dir(target, "target")
    check_cpu_config(target_cfg, target, "target")
    if isinstance(spec, dict):
        spec = SpecSettings(**spec)
    draft_path = Path(draft) if draft is not None else None
    if draft_path is not None:
        spec = (spec or SpecSettings()).with_launch_defaults()
        if spec.algorithm not in SPEC_ALGORITHMS:
            raise BadServerInput(f"spec.algorithm={spec.algorithm!r}; expected one of {SPEC_ALGORITHMS}")
        check_draft_dir(draft_path, spec.algorithm)
    elif spec is not None and spec.algorithm == "NEXTN":
        spec = spec.with_launch_defaults()
        check_nextn_target(target, target_cfg)
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
    server_env = dict(os.environ)
    for k in ("SGLANG_API_KEY",):
        server_env.pop(k, None)
    server_env.update({
        "SGLANG_USE_CPU_ENGINE": "1", "E3F_STANDIN_AMX": "1", "TORCHDYNAMO_DISABLE": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
        "SGLANG_CPU_OMP_THREADS_BIND": cpu_bind_spec(tp, cpus),
        "E3F_STANDIN_THREADS": str(threads_per_rank), "OMP_NUM_THREADS": str(threads_per_rank),
        "E3F_SHM_KEY": f"{os.getpid()}-{port}-{int(time.time() * 1e3) % 10**9}",
        # torch's TCPStore of the distributed init listens on 127.0.0.1 too (env/reference/standin/e3f_boot.py)
        "E3F_LOOPBACK_STORE": "1",
        # a scheduler that dies (e.g. SGLang's RuntimeError for an aux layer id it never reaches) would otherwise make
        # the launcher sleep 65 s for py-spy dumps and CUDA coredumps this CPU server cannot take
        # (sglang/srt/managers/tokenizer_manager.py, SGLANG_PYSPY_DUMP_BEFORE_CRASH / SGLANG_CUDA_COREDUMP_BEFORE_CRASH)
        "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
        # this checkout's stand-in (sgl_kernel, e3f_boot) ahead of the one the SGLang venv was installed from
        "PYTHONPATH": os.pathsep.join([str(STANDIN)] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    })
    disabled = disabled_model_modules(python, target_cfg.get("model_type"))
    if disabled and "SGLANG_DISABLED_MODEL_ARCHS" not in os.environ:
        server_env["SGLANG_DISABLED_MODEL_ARCHS"] = disabled
    server_env.update(env or {})
    return ServerProcess.launch_healthy(cmd, f"http://127.0.0.1:{port}", log_path=log_path, api_key=api_key,
                                        what="SGLang server", budget=budget, timeout=timeout, env=server_env,
                                        cwd=os.fspath(ROOT), port=port, tp=tp, spec=spec, target=target,
                                        draft=draft_path)
