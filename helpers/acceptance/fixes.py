"""Managed mode (:func:`run_fixes`): a YAML fixes file (validated by :class:`FixesFile`) lists fixes;
for each one a server is started (the embedded reference server through
:func:`helpers.server.embedded.start`, or a raw launch command for a real GPU server run with
``start_new_session`` and waited on ``/health``), measured (:func:`helpers.acceptance.measure.measure`),
stopped by PID (whole process tree, then the process group), and appended to the ledger, with a
tqdm progress bar. Example::

    name: draft-fixes
    measure: {max_new_tokens: 64, concurrency: 2, num_prompts: 24}
    baseline: {launch: {draft: null, tp: 2}}          # target only -> baseline tok/s
    fixes:
      - name: clean
        launch: {tp: 2, spec: {num_steps: 3, topk: 1, num_draft_tokens: 4}}
      - name: steps5
        launch: {tp: 2, spec: {num_steps: 5, topk: 1, num_draft_tokens: 6}}
      - name: gpu-tp8
        command: "python -m sglang.launch_server --model-path /m/target --tp 8 ..."
        url: http://127.0.0.1:30000
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
from pathlib import Path
from typing import Any, Iterator, Literal, Mapping, Optional, Sequence

import pandas as pd
import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from tqdm.auto import tqdm

from ..budget import Budget
from ..errors import BadServerInput, RunFailed, ServerStartError, SGLangError
from ..faults import Fault
from ..plots.acceptance import write_report
from ..runfiles import (  # noqa: F401
    DEFAULT_OUTPUTS,
    atomic_write_bytes,
    atomic_write_text,
    load_yaml_model,
    new_run_dir,
    parquet_bytes,
    read_parquet,
    safe_name,
)
from ..server import embedded
from ..server.client import SGLangClient
from ..server.listener_flags import refuse_listener_flags
from ..server.process import ServerProcess
from ..redaction import redact
from ..server.settings import SpecSettings
from .ledger import Ledger
from .measure import MAX_TEMPERATURE, MIN_BOOT, failed_requests, measure, measure_baseline
from .prompts import MAX_PROMPTS, load_prompts


class LaunchSpec(BaseModel):
    """A reference-server launch (arguments of :func:`helpers.server.embedded.start`).

    ``target`` / ``draft``: model folders; ``"reference"`` means ``env/models/target`` /
    ``env/models/draft``; ``draft: null`` starts a target-only server. Relative paths are relative
    to the fixes file.
    """

    model_config = ConfigDict(extra="forbid")
    target: Optional[str] = "reference"
    draft: Optional[str] = "reference"
    tp: int = Field(2, ge=1)
    spec: Optional[SpecSettings] = None
    extra_args: list[str] = Field(default_factory=list)
    forward_hooks: Optional[list[dict]] = None
    dtype: str = "float32"

    @field_validator("extra_args")
    @classmethod
    def _no_listener_flag(cls, v):
        refuse_listener_flags(v, "sglang", where="extra_args")    # a BadInput is a ValueError: the field is named
        return v
    max_total_tokens: int = 8192
    return_hidden_states: bool = True
    enable_metrics: bool = True
    timeout: float = 600.0
    env: dict[str, str] = Field(default_factory=dict)


class MeasureSettings(BaseModel):
    """How a fix is measured (arguments of :func:`helpers.acceptance.measure.measure`): the one shape, used by
    fixes files, case files (:data:`CASE_MEASURE_DEFAULTS` fill what a case does not set) and a fix's overrides.

    ``count`` (alias ``num_prompts``): prompts to send (None: all of the set); ``prompts``: a prompt file, or
    None / ``"bundled"`` for the bundled set; ``seed``: prompt order and bootstrap seed.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    count: Optional[int] = Field(None, ge=1, le=MAX_PROMPTS, validation_alias=AliasChoices("count", "num_prompts"))
    max_new_tokens: int = Field(128, ge=1)
    concurrency: int = Field(1, ge=1)
    prompts: Optional[str] = None
    seed: int = 0
    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE)
    ignore_eos: bool = False
    warmup: int = Field(1, ge=0)
    n_boot: int = Field(2000, ge=MIN_BOOT)
    flush_cache: bool = True

    @property
    def prompt_source(self) -> Optional[str]:
        """The prompt file, or None for the bundled set."""
        return None if self.prompts in (None, "bundled") else self.prompts

    def merged(self, overrides: Optional[Mapping[str, Any]]) -> "MeasureSettings":
        """These settings with ``overrides`` (field names or aliases) taking precedence, validated."""
        o = dict(overrides or {})
        if "num_prompts" in o:
            o["count"] = o.pop("num_prompts")
        return MeasureSettings.model_validate({**self.model_dump(), **o})


#: what a case file measures when its ``measure:`` block does not say (env/cases/README.md)
CASE_MEASURE_DEFAULTS = {"count": 24, "max_new_tokens": 48, "concurrency": 4, "ignore_eos": True}


class ServerSpec(BaseModel):
    """How to get a server: ``launch`` (the embedded reference server), ``command`` + ``url`` (a raw launch,
    e.g. a TP 8 GPU server), or ``url`` alone (attach to a running server; nothing is started or stopped)."""

    model_config = ConfigDict(extra="forbid")
    launch: Optional[LaunchSpec] = None
    command: Optional[str] = None
    url: Optional[str] = None
    cwd: Optional[str] = None
    env: dict[str, str] = Field(default_factory=dict)
    startup_timeout: float = Field(1800.0, gt=0)

    @model_validator(mode="after")
    def _one_way(self) -> "ServerSpec":
        if self.launch is not None and (self.command or self.url):
            raise ValueError("give either launch: (reference server) or command:/url:, not both")
        if self.command is not None and not self.command.strip():
            raise ValueError("command: is empty")
        if self.command is not None:
            try:
                shlex.split(self.command)
            except ValueError as exc:           # a quote left open: it could never be started
                raise ValueError(f"command: is not a command line ({exc})") from None
        if self.command is not None and not self.url:
            raise ValueError("command: needs url: (where the started server answers)")
        return self

    def require_server(self) -> None:
        """Raise ValueError unless this spec says how to get a server (a fixes file's fixes and baseline must;
        a case file's fixes are launched from the case's models)."""
        if self.launch is None and not self.url:
            raise ValueError("give launch: {...} for the reference server, or url: (with command: to start it)")

    @property
    def mode(self) -> str:
        return "launch" if self.launch is not None else ("command" if self.command else "attach")


class Fix(ServerSpec):
    """One fix: a server configuration measured as a unit, in a fixes file or on a case's timeline.

    ``name``; how to get its server (:class:`ServerSpec`; in a case file ``launch`` holds only overrides of the
    case's ``server`` block); the wiring changes of a reference launch: ``faults`` (:class:`helpers.faults.Fault`
    fields, served through ``--forward-hooks``), ``draft_config`` (deep-merged into a copy of the draft's
    config.json; ``null`` deletes a key), ``drop_tensors`` (draft weights left out), ``algorithm``, ``spec``,
    ``baseline`` (target only), ``add_tensors`` (``{tensor: torch file holding it}``, e.g. d2t from SpecForge's
    vocab_mapping.pt), ``proposed`` (in a case: apply the fix the latest investigate step proposed on top of this
    one); and ``measure`` overrides (:class:`MeasureSettings` fields).
    """

    name: str
    measure: dict[str, Any] = Field(default_factory=dict)
    faults: list[dict[str, Any]] = Field(default_factory=list)
    draft_config: dict[str, Any] = Field(default_factory=dict)
    drop_tensors: list[str] = Field(default_factory=list)
    algorithm: Literal["EAGLE3", "EAGLE"] = "EAGLE3"
    spec: Optional[SpecSettings] = None
    baseline: bool = False
    add_tensors: dict[str, str] = Field(default_factory=dict)
    proposed: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("fix name is empty")
        return v

    @field_validator("measure")
    @classmethod
    def _measure(cls, v: dict) -> dict:
        MeasureSettings(**v)  # validates keys / values
        return v

    @field_validator("faults")
    @classmethod
    def _faults_valid(cls, v):

        for f in v:
            Fault(**f)  # raises ValueError naming the missing field / unknown kind
        return v


class FixesFile(BaseModel):
    """The fixes YAML: ``name``, shared ``measure`` settings, optional ``baseline`` server
    (target only, for baseline tok/s), and ``fixes`` (unique names, at least one)."""

    model_config = ConfigDict(extra="forbid")
    name: str = "fixes"
    measure: MeasureSettings = Field(default_factory=MeasureSettings)
    baseline: Optional[ServerSpec] = None
    fixes: list[Fix] = Field(min_length=1)
    base_dir: Optional[str] = Field(None, exclude=True)

    @model_validator(mode="after")
    def _unique(self) -> "FixesFile":
        names = [f.name for f in self.fixes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"duplicate fix names: {dup}")
        for f in self.fixes:
            f.require_server()
        if self.baseline is not None:
            self.baseline.require_server()
        return self


def load_fixes(path_or_data: Path | str | Mapping | Sequence) -> FixesFile:
    """Read and validate a fixes YAML file (or already-parsed data; a bare list is the ``fixes`` list) with the
    suite's one YAML loader (:func:`helpers.runfiles.load_yaml_model`).

    Raises:
        BadInput: missing or invalid file; one line naming the file and the field.
    """
    ff = load_yaml_model(path_or_data, FixesFile, what="fixes file",
                         prepare=lambda d: {"fixes": d} if isinstance(d, list) else d)
    if isinstance(path_or_data, (str, Path)):
        ff.base_dir = str(Path(path_or_data).resolve().parent)
    return ff


class FixFailed(RunFailed):
    """One or more fixes could not be measured (their rows hold ``error``); ``run_dir`` attribute."""


def _resolve_model(value: Optional[str], default: Path, base: Optional[str]) -> Optional[Path]:
    if value is None:
        return None
    if value == "reference":
        return default
    p = Path(os.path.expandvars(os.path.expanduser(value)))
    if not p.is_absolute() and base:
        p = Path(base) / p
    return p


@contextlib.contextmanager
def serve(spec: ServerSpec, *, log_path: Path, base_dir: Optional[str] = None,
          api_key: Optional[str] = None, budget: Optional[Budget] = None) -> Iterator[tuple[SGLangClient, Any]]:
    """Start (or attach to) the server of ``spec``; yield ``(client, handle)``; stop it after.

    ``handle`` is a :class:`helpers.server.process.ServerProcess` (embedded server or launch command), or None
    (attach mode: nothing is stopped). ``budget`` (the run's :class:`helpers.budget.Budget`) bounds the wait for the
    server and every request of the client.
    """
    budget = budget if budget is not None else Budget()

    handle: Any = None
    client: Optional[SGLangClient] = None
    try:
        if spec.mode == "launch":
            ls = spec.launch
            target = _resolve_model(ls.target, embedded.REFERENCE_TARGET, base_dir)
            draft = _resolve_model(ls.draft, embedded.REFERENCE_DRAFT, base_dir)
            try:
                handle = embedded.start(target, draft, tp=ls.tp, spec=ls.spec, extra_args=ls.extra_args,
                                        forward_hooks=ls.forward_hooks, dtype=ls.dtype,
                                        max_total_tokens=ls.max_total_tokens,
                                        return_hidden_states=ls.return_hidden_states,
                                        enable_metrics=ls.enable_metrics, api_key=api_key,
                                        log_path=log_path, timeout=ls.timeout, env=ls.env or None, budget=budget)
            except (BadServerInput, ServerStartError) as exc:
                raise FixFailed(str(exc)) from None
            client = SGLangClient(handle.url, api_key=api_key or "", budget=budget)
        elif spec.mode == "command":
            client = SGLangClient(spec.url, api_key=api_key, budget=budget)
            argv = [os.path.expandvars(a) for a in shlex.split(spec.command)]
            key = client.secrets[0] if client.secrets else None       # $SGLANG_API_KEY too: redacted from the log
            try:
                handle = ServerProcess.launch_healthy(argv, spec.url, log_path=log_path, api_key=key,
                                                      what="server of the launch command", budget=budget,
                                                      timeout=spec.startup_timeout,
                                                      env={**os.environ, **(spec.env or {})}, cwd=spec.cwd or base_dir)
            except ServerStartError as exc:
                raise FixFailed(str(exc)) from None
        else:
            client = SGLangClient(spec.url, api_key=api_key, budget=budget)
            client.wait_healthy(timeout=min(spec.startup_timeout, 60))
        yield client, handle
    finally:
        if client is not None:
            client.close()
        if handle is not None:
            handle.stop()


def run_fixes(fixes: FixesFile | Path | str | Mapping, *, outputs: Path | str | None = None,
              run_dir: Path | str | None = None, progress: bool = True,
              api_key: Optional[str] = None, figures: bool = True, budget: Optional[Budget] = None) -> Path:
    """Managed mode: for each fix start its server, measure, stop it, append to the ledger.

    Args:
        fixes: a :class:`FixesFile`, a path to the YAML, or parsed data.
        outputs: where the new run folder goes (default ``<repo>/outputs``).
        run_dir: append into this existing run folder instead of a new one.
        progress: tqdm bars (fixes and requests).
        api_key: bearer token for the servers (default ``$SGLANG_API_KEY``); reference servers
            are started with it.
        figures: write ``figures.html`` (plotly, offline) at the end.
        budget: the run's :class:`helpers.budget.Budget` (``measure --fixes --timeout``), shared by every server
            start and request of every fix (default: no overall limit).

    Layout: ``<run>/fixes.yaml`` (the input, secrets redacted), ``<run>/logs/<fix>.log`` (server
    logs, secrets redacted), ``<run>/fixes/<fix>/`` (:meth:`AcceptanceResult.save`),
    ``<run>/ledger.parquet``, ``<run>/figures.html``.

    Returns the run folder. Raises :class:`FixFailed` after all fixes ran if any failed (their
    ledger rows carry ``error``) or was measured with failed requests (kept with ``n_failed``; each failed request's
    ``error`` in its ``per_request.parquet``: a server down mid-run, counters that break an identity).
    """


    ff = fixes if isinstance(fixes, FixesFile) else load_fixes(fixes)
    key = api_key if api_key is not None else (os.environ.get("SGLANG_API_KEY") or None)
    run = Path(run_dir) if run_dir else new_run_dir(ff.name, outputs=outputs)
    run.mkdir(parents=True, exist_ok=True)
    dump = ff.model_dump(mode="json", exclude_none=True)
    dump = redact(dump, [key] if key else [])    # also the --api-key values of every command:
    atomic_write_text(run / "fixes.yaml", yaml.safe_dump(dump, sort_keys=False))
    ledger = Ledger(run / "ledger.parquet")
    base = {"tok_s": float("nan"), "tok_s_lo": float("nan"), "tok_s_hi": float("nan")}
    failed: list[str] = []
    partial: list[str] = []         # fixes measured with failed requests

    if ff.baseline is not None:
        m = ff.measure
        try:
            with serve(ff.baseline, log_path=run / "logs" / "baseline.log", base_dir=ff.base_dir,
                       api_key=key, budget=budget) as (client, handle):
                prompts = load_prompts(_prompt_source(m.prompt_source, ff.base_dir), n=m.count)
                sp = {"temperature": m.temperature}
                if m.ignore_eos:
                    sp["ignore_eos"] = True
                base = measure_baseline(client, prompts, max_new_tokens=m.max_new_tokens,
                                        concurrency=m.concurrency, sampling_params=sp,
                                        warmup=m.warmup, n_boot=m.n_boot, progress=progress)
                base["server_pid"] = handle.pid if handle is not None else None
                base["server_mode"] = ff.baseline.mode
            atomic_write_text(run / "baseline.json", json.dumps(base, indent=1, default=str))
        except (FixFailed, SGLangError) as exc:
            failed.append("baseline")
            atomic_write_text(run / "baseline.json", json.dumps({"error": str(exc)}, indent=1))

    bar = tqdm(ff.fixes, desc=f"fixes ({ff.name})", disable=not progress)
    for fix in bar:
        bar.set_postfix_str(fix.name)
        settings = ff.measure.merged(fix.measure)
        log = run / "logs" / f"{safe_name(fix.name)}.log"
        started = pd.Timestamp.now(tz="UTC").isoformat()
        try:
            with serve(fix, log_path=log, base_dir=ff.base_dir, api_key=key, budget=budget) as (client, handle):
                res = measure(client, _prompt_source(settings.prompt_source, ff.base_dir),
                              max_new_tokens=settings.max_new_tokens, concurrency=settings.concurrency,
                              num_prompts=settings.count, temperature=settings.temperature,
                              ignore_eos=settings.ignore_eos, warmup=settings.warmup,
                              flush_cache=settings.flush_cache, n_boot=settings.n_boot,
                              baseline=None, label=fix.name, progress=progress,
                              requested=_requested(fix))
                if handle is not None:
                    res.summary["server_pid"] = handle.pid
            s = res.summary
            s["baseline_tok_s"], s["baseline_tok_s_lo"], s["baseline_tok_s_hi"] = (
                base["tok_s"], base["tok_s_lo"], base["tok_s_hi"])
            s["speedup"] = s["tok_s"] / base["tok_s"] if base["tok_s"] == base["tok_s"] and base["tok_s"] else float("nan")
            s["server_mode"] = fix.mode
            s["started_at"] = started
            res.record(run, fix.name, error=None)
            line = failed_requests(res.per_request)
            if line:                            # measured and kept, but not every answer counted
                partial.append(f"{fix.name}: {line}")
        except (FixFailed, SGLangError, RuntimeError, OSError) as exc:
            failed.append(fix.name)
            ledger.append({"fix": fix.name, "server_mode": fix.mode, "started_at": started,
                           "timestamp": pd.Timestamp.now(tz="UTC").isoformat(),
                           "error": f"{type(exc).__name__}: {exc}"[:4000]})
    bar.close()
    if figures:

        try:
            write_report(ledger.read(), run / "figures.html", title=f"Fixes: {ff.name}")
        except Exception as exc:  # noqa: BLE001 - figures must not lose the measurements
            atomic_write_text(run / "figures.error.txt", f"{type(exc).__name__}: {exc}\n")
    if failed or partial:
        what = [f"{len(failed)} fix(es) failed: {failed}"] if failed else []
        what += [f"requests failed in fix {p} (the measurement is saved with n_failed)" for p in partial]
        raise FixFailed(f"{'; '.join(what)}; see {run / 'ledger.parquet'} and {run / 'logs'}", run_dir=run)
    return run


def _prompt_source(prompts: Optional[str], base: Optional[str]) -> Optional[str]:
    if prompts is None:
        return None
    p = Path(prompts)
    if not p.is_absolute() and base:
        p = Path(base) / p
    return str(p)


def _requested(fix: Fix) -> Any:
    """What the fix asked for, for the override check (None: use the server's launch_command)."""
    if fix.command:
        return fix.command
    return None
