"""Batch runner for the notebook suite: papermill into a new run folder, offline HTML, postmortem.

``python -m helpers suite run --params FILE.yaml [--out DIR]``

1. creates a new run folder ``outputs/<YYYYmmdd-HHMMSS>-<name>/`` (a suffix is added rather than
   overwrite; ``--out`` chooses another parent), copies the validated params to ``params.yaml`` and
   writes ``command.txt`` with the exact command that reproduces the run;
2. starts the managed reference server when the params ask for one (``server.managed``: target,
   draft, TP, spec, fault hooks) or attaches to ``server.url``; with only a ``case``, no server is
   started here: ``00_replay`` replays the case, starting one reference server per fix;
3. executes the notebooks in order with papermill (``notebooks/<name>.ipynb``, parameters
   ``run_dir``, ``server_url``, ``repo_root``, ``api_key_env``, ``case`` and the model paths when
   set, then ``common`` and the per-notebook overrides), keeps going when one fails and records its
   failing cell and error; kernels get this checkout on ``PYTHONPATH`` so they import its helpers;
   while ``00_replay`` runs, each finished replay step is printed. ``00_replay`` (first) and
   ``99_postmortem`` (last) run alone; without a live server the views between them only read the
   run folder and run ``jobs`` at a time (default 2), in order, each after the notebooks it
   ``needs`` (:data:`NEEDS`); with a live server (``server.url`` / ``server.managed``) they run one
   at a time, so that measurements never overlap;
4. exports each executed notebook to self-contained offline HTML (``html/<name>.html``; no CDN:
   see ``helpers/templates/e3f``), and the postmortem notebook to ``postmortem.html``; checks each
   page (:func:`check_html`: no external script, plotly.js exactly once) and the postmortem's size
   against :data:`HTML_BUDGET_BYTES`;
5. writes ``suite_status.json`` (per notebook: ok, failing cell and error, wall time, HTML size) and
   exits 1 if any notebook failed, 2 on bad params.

Notebooks exchange results through files in the run folder: ``results/<notebook>.json``
(verdicts, numbers), ``figures/*.json`` (plotly), ``dumps/``, ``ledger.parquet``. No secret is ever
passed as a parameter: the API key stays in the environment variable named by
``server.api_key_env`` (default ``SGLANG_API_KEY``).
"""
from __future__ import annotations

import contextlib
import html
import json
import multiprocessing
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
import weakref
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Optional

import papermill as pm
import yaml
from jupyter_client.manager import KernelManager
from tqdm import tqdm

from ..acceptance.sweeps import steps_sweep_verdict
from ..capture import server_hook_specs
from ..errors import BadParams, describe
from ..formats.configs import read_target_config
from ..hooks import model_family
from ..paths import NOTEBOOK_DIR, ROOT, outputs_dir
from ..records import ReplayDoc
from ..runfiles import atomic_write_text, mark_failed, new_run_dir, write_json
from ..server.embedded import start
from ..server.registry import register, state_path, unregister
from .html import HTML_BUDGET_BYTES, check_html, export_html
from .params import INVESTIGATE, POSTMORTEM, REPLAY, ManagedServer, load_params, plain_name

#: notebooks that read what another one writes (they start after it finishes): the served dump of
#: 02_dump (live mode), the reference comparison in results/03_compare.json


class IpcKernelManager(KernelManager):
    """Kernels talk to papermill over local IPC sockets instead of TCP ports on 127.0.0.1: nothing listens on the
    network, and ipykernel no longer warns once per notebook that "Kernel is running over TCP without encryption"
    (``ipykernel/kernelapp.py::init_sockets``).

    Each kernel gets its own socket folder: jupyter_client 8.10 names IPC endpoints ``kernel-ipc-1..5`` relative to
    the working directory when no ``ip`` is given (``jupyter_client/connect.py::_ip_default``), so two notebooks
    running at once (``jobs: 2``) bound the same sockets and read each other's messages ("Invalid Signature",
    "Kernel didn't respond in 60 seconds"). The folder is removed when the manager is collected or at exit."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("transport", "ipc")
        if "ip" not in kwargs:
            folder = tempfile.mkdtemp(prefix="e3f-kernel-")
            kwargs["ip"] = os.path.join(folder, "k")
            weakref.finalize(self, shutil.rmtree, folder, True)
        super().__init__(*args, **kwargs)


class _ReplayProgress:
    """Prints each replay step as it lands in ``run_dir/results/replay-*.json`` (polls every ``every``
    seconds in a daemon thread while 00_replay runs)."""

    def __init__(self, run_dir: Path, every: float = 2.0):
        self.run_dir, self.every = run_dir, every
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="e3f-replay-progress", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=5)
        self._poll()

    def _loop(self):
        while not self._stop.wait(self.every):
            self._poll()

    def _poll(self):
        files = sorted(self.run_dir.glob("results/replay-*.json"))
        if not files:
            return
        try:
            doc = ReplayDoc.model_validate_json(files[-1].read_text())
        except (OSError, ValueError):
            return
        for st in doc.steps[self.seen:]:
            what = getattr(st, "check", None) or getattr(st, "name", None) or getattr(st, "label", None) or st.kind
            if st.error:
                res = "ERROR " + str(st.error)[:160]
            elif st.kind == "hypothesis":
                res = f"{st.verdict} (expected {st.expect or '-'})"
            elif st.kind == "investigate":
                res = f"{st.verdict}: {st.sentence[:160]}"
            elif st.kind == "fix":
                sm = st.summary or {}
                res = (f"accept length {sm.get('accept_length') or float('nan'):.2f}, "
                       f"{(sm.get('tok_s') or float('nan')):.1f} tok/s")
            else:
                res = _sweep_line(st)
            kind = "" if what == st.kind or str(what).lower().startswith(f"{st.kind}:") else f"{st.kind} "
            print(f"[suite]   replay step {st.index + 1}: {kind}{what}: {res} ({st.wall_s} s)", flush=True)
        self.seen = len(doc.steps)


def _sweep_line(st) -> str:
    """The console's word on a num_steps sweep: :func:`helpers.acceptance.sweeps.steps_sweep_verdict` (the rule the
    page's settings line and sweep figure use: a fastest num_steps only beyond every other point's CI, else not
    distinguishable)."""
    v = steps_sweep_verdict(st.points or [])
    return v["text"] if v is not None else "no point measured"


def _start_managed(m: ManagedServer, run_dir: Path):
    """Start the managed reference server with the per-rank and every-layer capture hooks (so the investigation
    has its own reference) and register it (helpers.server.registry), so the investigation may restart a copy of
    it with the proposed fix. Returns ``(handle, state file)``."""
    target = (ROOT / m.target) if not Path(m.target).is_absolute() else Path(m.target)
    draft = None
    if m.draft:
        draft = (ROOT / m.draft) if not Path(m.draft).is_absolute() else Path(m.draft)
    tcfg = read_target_config(target)
    hooks = server_hook_specs(tcfg.num_hidden_layers, faults=m.faults,
                              rank_capture_dir=run_dir / "capture" / "managed" / "ranks",
                              layers_dir=run_dir / "capture" / "managed" / "layers",
                              family=model_family(tcfg.architectures, tcfg.model_type))
    spec = m.spec if draft else None
    handle = start(target, draft, tp=m.tp, spec=spec, extra_args=m.extra_args, forward_hooks=hooks,
                   timeout=m.timeout, log_path=run_dir / "logs" / "server.log")
    launch = {"target": str(target.resolve()), "draft": None if draft is None else str(draft.resolve()), "tp": m.tp,
              "spec": None if spec is None else spec.model_dump(mode="json"), "forward_hooks": hooks,
              "extra_args": list(m.extra_args), "dtype": "float32"}
    state = register(state_path(handle.port), url=handle.url, pid=os.getpid(), server_pid=handle.pid,
                     log=str(handle.log_path), launch=launch)
    return handle, state


def _confined(params, params_path, notebooks: list[str], parent: Path) -> None:
    """A run writes into its own run folder only (issue 40): every notebook name plain (:func:`plain_name`, as
    :func:`load_params` checked, for params built another way), the run folder's parent (``--out``) not inside a
    notebook folder (``notebooks/`` or the params' ``notebook_dir``).

    Raises:
        BadParams: naming the name or ``--out``, before the run folder exists."""
    for nb in notebooks:
        plain_name(Path(params_path), "notebooks", nb)
    where = parent.resolve()
    for folder in {NOTEBOOK_DIR.resolve(), *([Path(params.notebook_dir).resolve()] if params.notebook_dir else [])}:
        if where == folder or folder in where.parents:
            raise BadParams(f"--out {parent}: inside the notebook folder {folder}; a suite run writes nothing there "
                            "(give another folder for the run folders)")


def _failure(exc: BaseException) -> dict:
    info = {"error": f"{type(exc).__name__}: {exc}"[:4000]}
    for attr in ("cell_index", "exec_count", "ename", "evalue"):
        if hasattr(exc, attr):
            info[attr] = getattr(exc, attr)
    return info


def _stages(notebooks: list[str]) -> list[list[str]]:
    """00_replay and 00_investigate when they come first, and 99_postmortem when it is last, run alone; the
    notebooks between them form one stage that may run concurrently."""
    nbs = list(notebooks)
    head = []
    while nbs and nbs[0] in (REPLAY, INVESTIGATE):
        head.append([nbs.pop(0)])
    tail = [[nbs.pop()]] if nbs and nbs[-1] == POSTMORTEM else []
    return head + ([nbs] if nbs else []) + tail


def _run_parallel(stage: list[str], submit, record, jobs: int, needs: dict[str, list[str]]) -> None:
    """Run the stage ``jobs`` notebooks at a time, in list order, each starting once the notebooks it
    ``needs`` (those in this stage) have finished. ``submit(pool, nb)`` returns a future of the
    notebook's status entry; ``record(nb, entry)`` stores it. Each notebook runs in its own spawned
    process: papermill/nbclient clients sharing one process's ZMQ context from several threads can
    deadlock (seen: a kernel idle, its client never told)."""

    pending = list(stage)
    done: set[str] = set()
    running: dict = {}
    with _pool(jobs) as pool:
        while pending or running:
            for nb in list(pending):
                if len(running) >= jobs:
                    break
                if all(d in done or d not in stage for d in needs.get(nb, [])):
                    pending.remove(nb)
                    running[submit(pool, nb)] = nb
            if not running:  # unsatisfiable needs (a cycle): run the next one anyway
                nb = pending.pop(0)
                running[submit(pool, nb)] = nb
            finished, _ = wait(list(running), return_when=FIRST_COMPLETED)
            for f in finished:
                nb = running.pop(f)
                done.add(nb)
                try:
                    entry = f.result()
                except Exception as exc:  # noqa: BLE001 - the child process itself died
                    entry = {"notebook": nb, "ok": False, **_failure(exc)}
                record(nb, entry)


@contextlib.contextmanager
def _pool(jobs: int) -> Iterator[ProcessPoolExecutor]:
    """A spawn-context process pool, shut down with the block; on Ctrl-C / SIGTERM (a KeyboardInterrupt) not waited
    for: its notebooks are left to :func:`helpers.server.process.stop_descendants`, the command ends at once (an
    executor's own ``with`` waits until every running notebook finished)."""
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"))
    interrupted = False
    try:
        yield pool
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        pool.shutdown(wait=not interrupted, cancel_futures=interrupted)


def _execute_child(nb: str, src: str, run_dir: str, nb_params: dict, timeout: int) -> dict:
    """:func:`_execute` in a child process (imports papermill there)."""

    return _execute(nb, Path(src), Path(run_dir), nb_params, timeout, pm)


def _execute(nb: str, src: Path, run_dir: Path, nb_params: dict, timeout: int, pm) -> dict:
    """Execute one notebook with papermill into ``run_dir/notebooks`` and export its HTML; never raises.
    Returns its status entry (ok, failing cell and error, wall time, HTML size and check)."""
    dst = run_dir / "notebooks" / f"{nb}.ipynb"
    t0 = time.monotonic()
    entry: dict[str, Any] = {"notebook": nb}
    watch = _ReplayProgress(run_dir) if nb == REPLAY else contextlib.nullcontext()
    try:
        with watch:
            pm.execute_notebook(str(src), str(dst), parameters=nb_params, kernel_name="python3",
                                cwd=str(ROOT), progress_bar=False, log_output=False,
                                execution_timeout=timeout, kernel_manager_class=IpcKernelManager)
        entry["ok"] = True
    except Exception as exc:  # noqa: BLE001 - keep going, report in the postmortem
        entry["ok"] = False
        entry.update(_failure(exc))
        print(f"[suite] {nb} FAILED: {entry.get('ename', type(exc).__name__)}: "
              f"{str(entry.get('evalue', exc))[:300]}", flush=True)
    entry["wall_s"] = round(time.monotonic() - t0, 1)
    html_path = run_dir / ("postmortem.html" if nb == POSTMORTEM else f"html/{nb}.html")
    if dst.exists():
        try:
            entry["html"] = str(html_path.relative_to(run_dir))
            entry["html_bytes"] = export_html(dst, html_path)
            entry["html_check"] = check_html(html_path)
        except Exception as exc:  # noqa: BLE001 - a page nobody can open is a failure of the run
            entry.pop("html", None)
            entry["html_error"] = f"{type(exc).__name__}: {exc}"
            if entry["ok"]:
                entry.update(ok=False, ename="HTMLExportError", evalue=entry["html_error"],
                             error=f"HTML export failed: {entry['html_error']}")
                print(f"[suite] {nb}: HTML export FAILED: {entry['html_error'][:300]}", flush=True)
    return entry


def run_suite(params_path: str | os.PathLike, out: Optional[str | os.PathLike] = None,
              only: Optional[list[str]] = None, argv: Optional[list[str]] = None) -> tuple[Path, dict]:
    """Run the suite; return ``(run_dir, status)``. See the module docstring.

    Raises BadParams for an invalid params file (nothing is started then).
    """

    params = load_params(params_path)
    holder: dict[str, Any] = {}
    try:
        return _run_suite(params, params_path, out, only, argv, holder)
    except BaseException as exc:
        run_dir = holder.get("run_dir")
        if run_dir is not None:   # a run that broke off (a full disk, Ctrl-C): never left looking like a result
            mark_failed(run_dir, f"suite: {describe(exc)}"[:2000])
        raise


def _run_suite(params, params_path, out, only, argv, holder: dict) -> tuple[Path, dict]:
    """:func:`run_suite` once the params are valid; ``holder["run_dir"]`` is set as soon as the folder exists."""
    # kernels import this checkout's helpers (not another install of the package)
    pp = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([pp] if pp else []))
    if only:
        unknown = [nb for nb in only if nb not in params.notebooks]
        if unknown:
            raise BadParams(f"--only: unknown notebook(s) {unknown}; the params file "
                            f"{params_path} runs {list(params.notebooks)}")
    notebooks = [nb for nb in params.notebooks if not only or nb in only]
    _confined(params, params_path, notebooks, Path(out) if out else outputs_dir())
    skipped = {}
    if (params.server.url or params.server.managed) and not params.case and REPLAY in notebooks:
        notebooks.remove(REPLAY)   # never replay a bundled case on a live run unless the params name one
        skipped[REPLAY] = ("a live run (server.url / server.managed) replays a case only when the params file names "
                           "one (case: ...)")
        print(f"[suite] {REPLAY} skipped: {skipped[REPLAY]}", flush=True)
    run_dir = new_run_dir(params.name, Path(out) if out else None)
    holder["run_dir"] = run_dir
    for sub in ("notebooks", "html", "results", "figures", "logs"):
        (run_dir / sub).mkdir(exist_ok=True)
    atomic_write_text(run_dir / "params.yaml", yaml.safe_dump(params.model_dump(), sort_keys=False))
    cmd = ["python", "-m", "helpers", "suite", "run", "--params", str(run_dir / "params.yaml"),
           "--out", str(run_dir.parent)]
    atomic_write_text(run_dir / "command.txt",
                      f"cd {shlex.quote(str(ROOT))} && .venv/bin/{shlex.join(cmd)}\n"
                      f"# original invocation: python -m helpers suite {shlex.join(argv or [])}\n")
    status: dict[str, Any] = {"run_dir": str(run_dir), "name": params.name,
                              "started": datetime.now().isoformat(timespec="seconds"),
                              "notebooks": {}, "server": None, "skipped": skipped}
    t_run = time.monotonic()
    server = server_state = None
    server_url = params.server.url
    try:
        if server_url is None and params.server.managed is not None:
            print(f"[suite] starting the reference server (TP {params.server.managed.tp}) ...",
                  flush=True)
            t0 = time.monotonic()
            try:
                server, server_state = _start_managed(params.server.managed, run_dir)
            except Exception as exc:  # noqa: BLE001 - reported in the postmortem
                status["server"] = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
            else:
                server_url = server.url
                status["server"] = {"url": server.url, "pid": server.pid, "tp": server.tp,
                                    "startup_s": round(time.monotonic() - t0, 1),
                                    "managed": params.server.managed.model_dump(),
                                    "log": str(server.log_path.relative_to(run_dir))}
        elif server_url:
            status["server"] = {"url": server_url, "managed": None}
        write_json(run_dir / "server.json", status["server"] or {
            "url": None, "managed": None,
            "note": "no server attached: the case replay (00_replay) starts and stops its own "
                    "servers, one per fix; their logs are in logs/"})
        base_params = {"run_dir": str(run_dir), "server_url": server_url or "",
                       "repo_root": str(ROOT), "api_key_env": params.server.api_key_env}
        for key in ("case", "target_dir", "draft_dir", "training_data"):
            if getattr(params, key):
                base_params[key] = getattr(params, key)
        base_params.update(params.common)
        entries: dict[str, dict] = {}
        lock = threading.Lock()
        bar = tqdm(total=len(notebooks), desc="notebooks", unit="nb", file=sys.stdout, dynamic_ncols=True)

        def record(nb: str, entry: dict) -> None:
            with lock:
                entries[nb] = entry
                status["notebooks"] = {n: entries[n] for n in notebooks if n in entries}
                write_json(run_dir / "suite_status.json", status)
                bar.update(1)
                bar.set_postfix_str(nb)

        def nb_params_of(nb: str) -> dict:
            # the common parameters a notebook declares (a page does not list what it does not use), then its own
            declared = pm.inspect_notebook(str(params.notebook_path(nb)))
            p = {k: v for k, v in base_params.items() if k in declared}
            p.update(params.notebook_params.get(nb, {}))
            return p

        def run_one(nb: str) -> None:
            record(nb, _execute(nb, params.notebook_path(nb), run_dir, nb_params_of(nb),
                                params.timeout_per_notebook, pm))

        def submit(pool, nb: str):
            return pool.submit(_execute_child, nb, str(params.notebook_path(nb)), str(run_dir),
                               nb_params_of(nb), params.timeout_per_notebook)

        for stage in _stages(notebooks):
            if stage == [POSTMORTEM]:
                with lock:
                    status["wall_s_before_postmortem"] = round(time.monotonic() - t_run, 1)
                    write_json(run_dir / "suite_status.json", status)
            # with a live server the notebooks send it requests: one at a time, so that the
            # acceptance / tok/s measurements never overlap with other traffic
            if len(stage) == 1 or params.jobs == 1 or server_url:
                for nb in stage:
                    run_one(nb)
            else:
                _run_parallel(stage, submit, record, params.jobs, params.needs)
        bar.close()
    finally:
        if server is not None:
            server.stop()
        if server_state is not None:
            unregister(server_state)
    status["wall_s"] = round(time.monotonic() - t_run, 1)
    status["failed"] = [nb for nb, e in status["notebooks"].items() if not e.get("ok")]
    if not (run_dir / "postmortem.html").exists() or POSTMORTEM in status["failed"]:
        _fallback_postmortem(run_dir, status)
    size = (run_dir / "postmortem.html").stat().st_size
    status["postmortem_bytes"] = size
    status["postmortem_budget_bytes"] = HTML_BUDGET_BYTES
    status["postmortem_over_budget"] = size > HTML_BUDGET_BYTES
    status["postmortem_check"] = check_html(run_dir / "postmortem.html")
    write_json(run_dir / "suite_status.json", status)
    return run_dir, status


def _fallback_postmortem(run_dir: Path, status: dict) -> None:
    """Minimal postmortem.html written by the runner when the postmortem notebook did not run."""
    rows = []
    for nb, e in status["notebooks"].items():
        link = f'<a href="{html.escape(e["html"])}">{html.escape(nb)}</a>' if e.get("html") else html.escape(nb)
        state = "ok" if e.get("ok") else "FAILED"
        detail = "" if e.get("ok") else html.escape(
            f"cell {e.get('exec_count', '?')}: {e.get('ename', '')}: {e.get('evalue', e.get('error', ''))}")
        rows.append(f"<tr><td>{link}</td><td>{state}</td><td>{e.get('wall_s', '')}</td>"
                    f"<td><pre>{detail}</pre></td></tr>")
    server = status.get("server") or {}
    body = f"""<!DOCTYPE html><html><head><meta charset="utf-8"><title>postmortem {html.escape(status['name'])}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{border:1px solid #ccc;padding:4px 8px;vertical-align:top}} pre{{white-space:pre-wrap;margin:0}}</style></head>
<body><h1>Postmortem: {html.escape(status['name'])}</h1>
<p>The postmortem notebook did not complete; this page lists what ran.</p>
<p>Server: {html.escape(json.dumps(server)[:2000])}</p>
<table><tr><th>notebook</th><th>status</th><th>wall s</th><th>error</th></tr>{''.join(rows)}</table>
</body></html>"""
    atomic_write_text(run_dir / "postmortem.html", body)
