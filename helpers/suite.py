"""Batch runner for the notebook suite: papermill into a new run folder, offline HTML, postmortem.

``python -m helpers suite run --params FILE.yaml [--out DIR]``

1. creates a new run folder ``outputs/<YYYYmmdd-HHMMSS>-<name>/`` (a suffix is added rather than
   overwrite; ``--out`` chooses another parent), copies the validated params to ``params.yaml`` and
   writes ``command.txt`` with the exact command that reproduces the run;
2. starts the managed reference server when the params ask for one (``server.managed``: target,
   draft, TP, spec, fault hooks) or attaches to ``server.url``;
3. executes the notebooks in order with papermill (``notebooks/<name>.ipynb``, parameters
   ``run_dir``, ``server_url``, ``repo_root`` and the per-notebook overrides), keeps going when
   one fails and records its failing cell and error;
4. exports each executed notebook to self-contained offline HTML (``html/<name>.html``; no CDN:
   see ``helpers/templates/e3f``), and the postmortem notebook to ``postmortem.html``;
5. exits 1 if any notebook failed, 2 on bad params.

Notebooks exchange results through files in the run folder: ``results/<notebook>.json``
(verdicts, numbers), ``figures/*.json`` (plotly), ``dumps/``, ``ledger.parquet``. No secret is ever
passed as a parameter: the API key stays in the environment variable named by
``server.api_key_env`` (default ``SGLANG_API_KEY``).
"""
from __future__ import annotations

import argparse
import html
import json
import os
import shlex
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .runfiles import atomic_write_text, new_run_dir, write_json

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_DIR = ROOT / "notebooks"
DEFAULT_NOTEBOOKS = ["01_attach", "02_dump", "03_compare", "10_hyp_tp_sharding",
                     "11_hyp_embedding_allreduce", "12_hyp_layer_offset", "20_acceptance",
                     "30_replay", "99_postmortem"]
POSTMORTEM = "99_postmortem"
HTML_BUDGET_BYTES = 8_000_000  # postmortem.html should stay below this (plotly.js is ~3.6 MB)


class ManagedServer(BaseModel):
    """The embedded reference server the runner starts (helpers.launcher.start)."""

    model_config = ConfigDict(extra="forbid")
    target: str = "env/models/target"
    draft: Optional[str] = "env/models/draft"
    tp: int = 2
    spec: dict[str, Any] = Field(default_factory=lambda: {"num_steps": 3, "topk": 1,
                                                          "num_draft_tokens": 4})
    faults: list[dict[str, Any]] = Field(default_factory=list)
    extra_args: list[str] = Field(default_factory=list)
    timeout: float = 600.0


class ServerParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: Optional[str] = None
    api_key_env: str = "SGLANG_API_KEY"
    managed: Optional[ManagedServer] = None


class SuiteParams(BaseModel):
    """Validated suite params file (YAML). See env/cases/main.yaml for a documented example."""

    model_config = ConfigDict(extra="forbid")
    name: str = "postmortem"
    server: ServerParams = Field(default_factory=ServerParams)
    target_config: Optional[str] = None
    draft_config: Optional[str] = None
    training_data: Optional[str] = None
    case: Optional[str] = None
    notebooks: list[str] = Field(default_factory=lambda: list(DEFAULT_NOTEBOOKS))
    common: dict[str, Any] = Field(default_factory=dict)
    notebook_params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    timeout_per_notebook: int = 1200


class BadParams(ValueError):
    """The params file is missing, unreadable or invalid; the message names the field."""


def load_params(path: str | os.PathLike) -> SuiteParams:
    """Read and validate a suite params YAML file.

    Raises:
        BadParams: file missing, not YAML, or a field invalid (the message names it).
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise BadParams(f"params file {path} does not exist") from None
    except yaml.YAMLError as exc:
        raise BadParams(f"params file {path} is not valid YAML: {exc}") from None
    try:
        params = SuiteParams.model_validate(raw or {})
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise BadParams(f"params file {path}: field '{where}': {first['msg']}") from None
    if params.server.url is None and params.server.managed is None:
        raise BadParams(f"params file {path}: set server.url (attach) or server.managed "
                        "(start the embedded reference server)")
    missing = [nb for nb in params.notebooks if not (NOTEBOOK_DIR / f"{nb}.ipynb").exists()]
    if missing:
        raise BadParams(f"params file {path}: field 'notebooks': no notebook {missing} in "
                        f"{NOTEBOOK_DIR}")
    return params


def export_html(notebook: Path, out: Path) -> int:
    """Export an executed notebook to offline HTML (template ``helpers/templates/e3f``).

    Returns the size in bytes. Output cells keep their HTML as produced by the notebook (the
    notebooks escape server-provided text); code is hidden behind a toggle button.
    """
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(notebook, as_version=4)
    nb.metadata.pop("widgets", None)  # widget state needs a CDN manager; static figures follow each widget
    exporter = HTMLExporter(template_name="e3f",
                            extra_template_basedirs=[str(ROOT / "helpers" / "templates")])
    body, _ = exporter.from_notebook_node(nb)
    atomic_write_text(out, body)
    return out.stat().st_size


def _start_managed(m: ManagedServer, run_dir: Path):
    from .hooks import hook_specs
    from .launcher import SpecConfig, start

    target = (ROOT / m.target) if not Path(m.target).is_absolute() else Path(m.target)
    draft = None
    if m.draft:
        draft = (ROOT / m.draft) if not Path(m.draft).is_absolute() else Path(m.draft)
    hooks = None
    if m.faults:
        n = json.loads((target / "config.json").read_text())["num_hidden_layers"]
        hooks = hook_specs(m.faults, num_layers=n)
    return start(target, draft, tp=m.tp, spec=SpecConfig(**m.spec) if draft else None,
                 extra_args=m.extra_args, forward_hooks=hooks, timeout=m.timeout,
                 log_path=run_dir / "logs" / "server.log")


def _failure(exc: BaseException) -> dict:
    info = {"error": f"{type(exc).__name__}: {exc}"[:4000]}
    for attr in ("cell_index", "exec_count", "ename", "evalue"):
        if hasattr(exc, attr):
            info[attr] = getattr(exc, attr)
    return info


def run_suite(params_path: str | os.PathLike, out: Optional[str | os.PathLike] = None,
              only: Optional[list[str]] = None, argv: Optional[list[str]] = None) -> tuple[Path, dict]:
    """Run the suite; return ``(run_dir, status)``. See the module docstring.

    Raises BadParams for an invalid params file (nothing is started then).
    """
    import papermill as pm
    from tqdm.auto import tqdm

    params = load_params(params_path)
    notebooks = [nb for nb in params.notebooks if not only or nb in only]
    run_dir = new_run_dir(params.name, Path(out) if out else None)
    for sub in ("notebooks", "html", "results", "figures", "logs"):
        (run_dir / sub).mkdir(exist_ok=True)
    atomic_write_text(run_dir / "params.yaml", yaml.safe_dump(params.model_dump(), sort_keys=False))
    cmd = ["python", "-m", "helpers", "suite", "run", "--params", str(run_dir / "params.yaml")]
    atomic_write_text(run_dir / "command.txt",
                      f"cd {shlex.quote(str(ROOT))} && .venv/bin/{shlex.join(cmd)}\n"
                      f"# original invocation: python -m helpers suite {shlex.join(argv or [])}\n")
    status: dict[str, Any] = {"run_dir": str(run_dir), "name": params.name,
                              "started": datetime.now().isoformat(timespec="seconds"),
                              "notebooks": {}, "server": None}
    t_run = time.monotonic()
    server = None
    server_url = params.server.url
    try:
        if server_url is None and params.server.managed is not None:
            print(f"[suite] starting the reference server (TP {params.server.managed.tp}) ...",
                  flush=True)
            t0 = time.monotonic()
            try:
                server = _start_managed(params.server.managed, run_dir)
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
        write_json(run_dir / "server.json", status["server"])
        bar = tqdm(notebooks, desc="notebooks", unit="nb", file=sys.stdout)
        for nb in bar:
            bar.set_postfix_str(nb)
            src = NOTEBOOK_DIR / f"{nb}.ipynb"
            dst = run_dir / "notebooks" / f"{nb}.ipynb"
            nb_params = {"run_dir": str(run_dir), "server_url": server_url or "",
                         "repo_root": str(ROOT), "api_key_env": params.server.api_key_env}
            nb_params.update(params.common)
            nb_params.update(params.notebook_params.get(nb, {}))
            if nb == POSTMORTEM:
                status["wall_s_before_postmortem"] = round(time.monotonic() - t_run, 1)
                write_json(run_dir / "suite_status.json", status)
            t0 = time.monotonic()
            entry: dict[str, Any] = {"notebook": nb}
            try:
                pm.execute_notebook(str(src), str(dst), parameters=nb_params, kernel_name="python3",
                                    cwd=str(ROOT), progress_bar=False, log_output=False,
                                    execution_timeout=params.timeout_per_notebook)
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
                except Exception as exc:  # noqa: BLE001
                    entry["html_error"] = f"{type(exc).__name__}: {exc}"
            status["notebooks"][nb] = entry
            write_json(run_dir / "suite_status.json", status)
    finally:
        if server is not None:
            server.stop()
    status["wall_s"] = round(time.monotonic() - t_run, 1)
    status["failed"] = [nb for nb, e in status["notebooks"].items() if not e.get("ok")]
    if not (run_dir / "postmortem.html").exists() or POSTMORTEM in status["failed"]:
        _fallback_postmortem(run_dir, status)
    size = (run_dir / "postmortem.html").stat().st_size
    status["postmortem_bytes"] = size
    status["postmortem_over_budget"] = size > HTML_BUDGET_BYTES
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


def cli_main(argv: list[str]) -> int:
    """``python -m helpers suite run --params FILE.yaml [--out DIR] [--only NB ...]``."""
    ap = argparse.ArgumentParser(prog="python -m helpers suite")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the notebooks into a new run folder")
    r.add_argument("--params", required=True, help="suite params YAML (e.g. env/cases/main.yaml)")
    r.add_argument("--out", default=None, help="parent folder for the run folder (default outputs/)")
    r.add_argument("--only", nargs="+", default=None, help="run only these notebooks")
    args = ap.parse_args(argv)
    try:
        run_dir, status = run_suite(args.params, args.out, args.only, argv=argv)
    except BadParams as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = status["failed"]
    print(f"[suite] run folder: {run_dir}")
    print(f"[suite] postmortem: {run_dir / 'postmortem.html'} "
          f"({status['postmortem_bytes'] / 1e6:.1f} MB; {status['wall_s']:.0f} s)")
    if failed:
        print(f"[suite] {len(failed)} notebook(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
