"""Views of a run folder for the notebook suite: everything the notebooks show, as tested functions.

The notebooks in ``notebooks/`` are thin (prose + calls into this module). They work in two modes:

* **replay** (the default batch run): ``00_replay`` replays a case file (:func:`helpers.investigation.replay.replay_case`)
  into the run folder; the other notebooks render what it recorded there (``results/replay-<case>.json``,
  ``acceptance/<fix>/summary.json``, ``ledger.parquet``, ``dumps/``, ``figures/``, ``drafts/``).
* **live**: with ``server_url`` set, the notebooks probe / capture / measure that server (e.g. a real TP 8
  GPU server) and write the same kinds of files into the run folder.

Results pass between notebooks only through files in the run folder: each notebook writes
``results/<notebook>.json`` (:func:`write_result`); the postmortem reads them with the suite's
``suite_status.json``.

HTML safety: every string that may come from a server, a file or a config is escaped before it is put in
HTML (:func:`esc`, :func:`table_html` uses ``DataFrame.to_html(escape=True)``); plotly JSON is escaped by
plotly itself. No API key is ever read here except through the environment variable *named* by
``api_key_env`` (:func:`connect`), and nothing writes it.

Plotly: :func:`setup_notebook` puts plotly.js into the notebook exactly once (inline, no CDN) and installs
the ``plotly_mimetype+e3f_html`` renderer: JupyterLab renders the plotly mimetype, nbconvert's HTML uses
the ``text/html`` part, which references the global ``Plotly`` (no require.js, no MathJax CDN).
"""
from __future__ import annotations

import html
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import ipywidgets as W
import numpy as np
import pandas as pd
import plotly.io as pio
from IPython import get_ipython
from IPython.display import HTML, display
from plotly.basedatatypes import BaseFigure
from plotly.io._base_renderers import MimetypeRenderer
from plotly.offline import get_plotlyjs
from pydantic import ValidationError

from ..errors import BadInput, CaseError
from ..formats.configs import read_config_json
from ..investigation.cases import Models, load_case
from ..paths import ROOT, outputs_dir
from ..records import NOTEBOOK_RESULT, ReplayDoc
from ..runfiles import (atomic_write_new, jsonable, load_yaml_text, new_run_dir, read_file_text, read_json_file,
                        write_json)
from ..engines.detect import adapter as engine_adapter, detect

DEFAULT_TARGET = "env/models/target"


DEFAULT_DRAFT = "env/models/draft"


DEFAULT_TRAINING = "env/models/data/sample"


DEFAULT_CASE = "env/cases/seeds_hunt.yaml"


VERDICT_COLORS = {"confirmed": "#c62828", "refuted": "#2e7d32", "inconclusive": "#9e9e9e"}


#: rows / columns kept in a figure trace before downsampling (keeps HTML pages small)
MAX_POINTS = 400


def esc(x: Any) -> str:
    """``html.escape(str(x))`` (None -> empty string)."""
    return "" if x is None else html.escape(str(x), quote=True)


def verdict_badge(verdict: Optional[str]) -> str:
    """An HTML badge for a verdict, coloured by :data:`VERDICT_COLORS` (unknown text is escaped, grey)."""
    v = str(verdict or "not run")
    color = VERDICT_COLORS.get(v, "#616161")
    return (f'<span class="e3f-verdict" style="background:{color};color:#fff;padding:1px 8px;'
            f'border-radius:9px;font-weight:600">{esc(v)}</span>')


def table_html(df: pd.DataFrame, *, max_rows: int = 60, verdict_cols: Sequence[str] = ("verdict", "expected"),
               float_format: str = "{:.4g}") -> str:
    """Escaped HTML table of ``df`` (``to_html(escape=True)``), at most ``max_rows`` rows (a note says how many
    were left out). Cells of ``verdict_cols`` holding a verdict word are coloured after escaping."""
    if df is None or len(df) == 0:
        return '<p class="e3f-empty"><i>(no rows)</i></p>'
    shown = df.head(max_rows)

    def fmt(v):
        if isinstance(v, float):
            return "" if not math.isfinite(v) else float_format.format(v)
        return v

    shown = shown.apply(lambda col: col.map(fmt)) if len(shown.columns) else shown
    out = shown.to_html(index=False, escape=True, border=0, classes="e3f-table", na_rep="")
    for v, color in VERDICT_COLORS.items():
        out = out.replace(f"<td>{v}</td>", f'<td style="color:{color};font-weight:600">{v}</td>')
    if len(df) > max_rows:
        out += f"<p><i>{len(df) - max_rows} more rows not shown (see the run folder files).</i></p>"
    return out


_CSS = """<style>
.e3f-table { border-collapse: collapse; font-size: 13px; margin: 4px 0 12px 0; }
.e3f-table th, .e3f-table td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
.jp-RenderedHTMLCommon .e3f-table th, .jp-RenderedHTMLCommon .e3f-table td { text-align: left; }
.e3f-table th { background: #f5f5f5; }
.e3f-headline { font-size: 17px; border-left: 5px solid #1565c0; padding: 8px 12px; background: #e3f2fd; }
.e3f-step { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.e3f-note { color: #555; font-size: 13px; }
.e3f-run { border-left: 4px solid #757575; padding: 4px 10px; margin: 4px 0 10px 0; background: #fafafa; }
.e3f-story { font-size: 14px; }
.e3f-hl-part { margin: 1px 0 4px 0; }
.e3f-src { color: #555; font-size: 11px; margin-left: 1em; }
.e3f-first .e3f-table { font-size: 12px; margin: 2px 0 6px 0; }
.e3f-first .e3f-table th, .e3f-first .e3f-table td { padding: 1px 6px; }
.e3f-flags { border-left: 5px solid #ef6c00; background: #fff3e0; padding: 6px 12px; font-size: 13px; margin: 6px 0; }
.e3f-flags ol { margin: 4px 0; padding-left: 20px; }
h3.e3f-h { margin: 12px 0 4px 0; font-size: 16px; }
</style>"""


_SETUP_DONE = False


class _OfflineHtmlRenderer:
    """``text/html`` part of a figure: ``plotly.io.to_html`` without plotly.js, without MathJax (both would
    be CDN scripts otherwise), relying on the global ``Plotly`` injected by :func:`setup_notebook`."""

    def __init__(self, height: int = 460):
        self.height = height

    def to_mimebundle(self, fig_dict):

        return {"text/html": pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False,
                                         full_html=False, default_width="100%",
                                         default_height=self.height, validate=False,
                                         config={"displaylogo": False, "responsive": True})}


def register_renderer() -> str:
    """Register the ``e3f_html`` plotly renderer and make ``plotly_mimetype+e3f_html`` the default.
    Returns the renderer name. Safe to call repeatedly."""

    class E3fHtml(_OfflineHtmlRenderer, MimetypeRenderer):
        pass

    pio.renderers["e3f_html"] = E3fHtml()
    pio.renderers.default = "plotly_mimetype+e3f_html"
    return pio.renderers.default


def plotlyjs_html() -> str:
    """The one inline copy of plotly.js (``<script>`` without ``src``)."""

    return ("<script type=\"text/javascript\">window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script>")


def setup_notebook(*, force: bool = False) -> None:
    """Notebook setup (call once, at the top level of the first code cell): inline plotly.js exactly once,
    the offline renderer, the table CSS. Outside IPython it only registers the renderer."""
    global _SETUP_DONE
    register_renderer()
    if _SETUP_DONE and not force:
        return

    if get_ipython() is None:
        return
    display(HTML(plotlyjs_html() + _CSS))
    _SETUP_DONE = True


def show(obj: Any) -> None:
    """Display a plotly figure, a DataFrame (escaped table), an HTML string (trusted: built here) or None."""
    if obj is not None:
        display(displayable(obj))


class StepProgress:
    """Progress of a long cell: one line per step (``attach ...``, ``capture: ... (0.5 s)``), shown as one block that
    is updated in place while the cell runs, with the time since the first line; printed outside IPython. Pass it
    as the ``progress`` callback of :func:`helpers.investigation.live.investigate` (via
    :func:`helpers.views.investigation.ensure`)."""

    def __init__(self, title: str):
        self._clock = time.monotonic
        self.title, self.lines, self.t0 = title, [], self._clock()
        self.handle = display(HTML(self._html("starting ...")), display_id=True) if get_ipython() else None

    def _html(self, current: str) -> str:
        body = "\n".join(esc(x) for x in self.lines) or esc(current)
        return (f'<div class="e3f-progress"><b>{esc(self.title)}</b> <span class="e3f-note">'
                f'({self._clock() - self.t0:.0f} s)</span><pre style="margin:2px 0">{body}</pre></div>')

    def __call__(self, line: str) -> None:
        self.lines.append(str(line))
        if self.handle is not None:
            self.handle.update(HTML(self._html(line)))
        else:
            print(f"[{self.title}] {line}", flush=True)

    def done(self) -> None:
        """Fold the lines into a closed "steps" box (the page's results follow it)."""
        if self.handle is not None and self.lines:
            body = "\n".join(esc(x) for x in self.lines)
            self.handle.update(HTML(f'<details class="e3f-progress"><summary class="e3f-note">{esc(self.title)}: '
                                    f'{len(self.lines)} steps in {self._clock() - self.t0:.0f} s</summary>'
                                    f'<pre style="margin:2px 0">{body}</pre></details>'))


def headline_box(parts: list[dict]) -> str:
    """A story's headline as one box (``parts``: ``{"label", "text", "source"}``, e.g.
    :func:`helpers.investigation.story.headline_parts`): each part on its line, its source under it (escaped)."""
    if not parts:
        return '<div class="e3f-headline">No investigation and no replay in this run folder.</div>'
    rows = "".join(
        f'<div class="e3f-hl-part"><b>{esc(p["label"])}:</b> {esc(p["text"])}'
        + (f'<div class="e3f-src">source: {esc(p["source"])}</div>' if p.get("source") else "") + "</div>"
        for p in parts)
    return f'<div class="e3f-headline e3f-story">{rows}</div>'


def note(text: str) -> str:
    """A grey note paragraph (``text`` is escaped)."""
    return f'<p class="e3f-note">{esc(text)}</p>'


def downsample(n: int, limit: int = MAX_POINTS) -> np.ndarray:
    """Indices that keep at most ``limit`` of ``n`` evenly spaced points (first and last included)."""
    if n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(int))


class _Bundle:
    """A ready mime bundle as a displayable object (``_repr_mimebundle_`` only)."""

    def __init__(self, bundle: dict):
        self.bundle = bundle

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        return self.bundle


def displayable(obj: Any) -> Any:
    """What :func:`show` displays, as one object for ``display(..., display_id=True)`` and its in-place updates: a
    DataFrame or HTML string becomes ``IPython.display.HTML``, a plotly figure its mime bundle (a figure displays
    itself through ``_ipython_display_``, which drops the ``display_id``, so it could not be updated)."""
    if obj is None:
        return HTML("")
    if isinstance(obj, pd.DataFrame):
        return HTML(table_html(obj))
    if isinstance(obj, str):
        return HTML(obj)
    if isinstance(obj, BaseFigure):
        return _Bundle(obj._repr_mimebundle_())
    return obj


def interactive(draw: Callable[..., Any], controls: Mapping[str, Sequence[Any]], *,
                defaults: Optional[Mapping[str, Any]] = None, caption: str = "") -> None:
    """ipywidgets dropdowns above one view that they redraw in place.

    The view is drawn once, as an ordinary output (what papermill stores and the exported HTML shows: widget state is
    not exported), and each change of a dropdown replaces that same output (``display_id`` updates), so each chart is
    on the page once (it stays where it is). A caption above the view names the values it shows.

    Args:
        draw: returns what :func:`show` displays (figure, DataFrame, HTML).
        controls: ``{argument name: options}`` (each a dropdown; options may be ``(label, value)`` pairs).
        defaults: initial values (default: the first option of each control).
        caption: what the default view is (escaped), e.g. "first fix".
    """

    opts = {k: list(v) for k, v in controls.items() if len(v)}
    values = {k: (defaults or {}).get(k, _opt_value(v[0])) for k, v in opts.items()}

    def label(vals: Mapping[str, Any]) -> str:
        shown = ", ".join(f"{k} = {_opt_label(opts[k], vals[k])}" for k in opts)
        return note(f"Showing {shown or 'the view'}{' (' + caption + ')' if caption else ''}; in JupyterLab the "
                    "controls above redraw it, the exported page keeps this view.")

    boxes = {k: W.Dropdown(options=v, value=values[k], description=str(k)) for k, v in opts.items()}
    if boxes:
        display(W.HBox(list(boxes.values())))
    head = display(HTML(label(values)), display_id=True)
    view = display(displayable(draw(**values)), display_id=True)

    def redraw(_change=None):
        vals = {k: b.value for k, b in boxes.items()}
        if head is not None:
            head.update(HTML(label(vals)))
        if view is not None:
            new = displayable(draw(**vals))
            if isinstance(new, _Bundle):
                # JupyterLab's plotly renderer ignores a new figure of the same mime type
                # (jupyterlab-plotly renderModel: "if (this.hasGraphElement()) return"); a different mime type in
                # between makes JupyterLab replace the renderer
                view.update(HTML(""))
            view.update(new)

    for b in boxes.values():
        b.observe(redraw, names="value")


def _opt_value(o: Any) -> Any:
    return o[1] if isinstance(o, tuple) and len(o) == 2 else o


def _opt_label(options: Sequence[Any], value: Any) -> str:
    for o in options:
        if _opt_value(o) == value:
            return str(o[0] if isinstance(o, tuple) and len(o) == 2 else o)
    return str(value)


def as_path(p: Any, base: Path = ROOT) -> Optional[Path]:
    """``p`` as a Path (``~`` expanded; relative to ``base``, default the repository root); None for ""/None."""
    if p in (None, ""):
        return None
    p = Path(os.path.expanduser(str(p)))
    return p if p.is_absolute() else base / p


#: what makes a folder under outputs/ a run folder: a suite run or replay (results/), an interactive
#: investigation (investigation.json), a measurement (ledger.parquet), the suite's status
RUN_MARKERS = ("results", "investigation.json", "ledger.parquet", "suite_status.json")

#: what marks a run folder as finished: a postmortem page or the suite's status (nothing is added to it unless the
#: user names it in ``run_dir``)
FINISHED_MARKERS = ("postmortem.html", "suite_status.json")


def latest_run_dir(outputs: Optional[Path] = None) -> Optional[Path]:
    """The newest run folder under ``outputs`` (default ``outputs/`` or ``$E3F_OUTPUTS``): suite runs, replays and
    interactive investigations alike (a folder holding one of :data:`RUN_MARKERS`), newest by its
    ``YYYYmmdd-HHMMSS`` name prefix. None when there is none."""
    outputs = Path(outputs) if outputs is not None else outputs_dir()
    if not outputs.is_dir():
        return None
    runs = sorted((p for p in outputs.iterdir() if p.is_dir() and any((p / m).exists() for m in RUN_MARKERS)),
                  key=lambda p: p.name)
    return runs[-1] if runs else None


def finished(run_dir: Path) -> str:
    """Why ``run_dir`` is a finished run (``"it has postmortem.html"``), or "" when it is not."""
    marks = [m for m in FINISHED_MARKERS if (Path(run_dir) / m).exists()]
    return f"it has {' and '.join(marks)}" if marks else ""


def resolve_run_dir(run_dir: Any, *, create: bool = False, name: str = "interactive") -> tuple[Path, str]:
    """The run folder a notebook works on and how it was chosen: ``(path, origin)``.

    ``origin`` is ``"given"`` (``run_dir`` named by the user; it must exist unless ``create``), ``"new"`` (empty
    ``run_dir`` and ``create``: a fresh ``outputs/<stamp>-<name>``), or ``"newest"`` (empty ``run_dir``: the newest
    run folder, :func:`latest_run_dir`).

    Raises:
        helpers.errors.BadInput: a named folder that does not exist (and not ``create``), or no run folder at all.
    """
    p = as_path(run_dir)
    if p is not None:
        if not p.is_dir():
            if not create:
                raise BadInput("run folder does not exist (check run_dir, or leave it empty for the newest run)",
                               path=p, field="run_dir")
            p.mkdir(parents=True)
        return p, "given"
    if create:
        return new_run_dir(name), "new"
    found = latest_run_dir()
    if found is None:
        raise BadInput("no run folder given and none under outputs/: run notebooks/00_investigate.ipynb with "
                       "server_url, notebooks/00_replay.ipynb, or `python -m helpers suite run --params "
                       "env/cases/main.yaml` first", field="run_dir")
    return found, "newest"


@dataclass
class RunContext:
    """What a notebook works on (see :func:`context`).

    Attributes:
        run_dir: the run folder (results, dumps, ledger...).
        server_url: live server URL, or "" (replay mode: render the run folder's records).
        api_key_env: name of the environment variable holding the server's API key (value never stored).
        case_path: the case file, when there is one; :meth:`load_case` validates it (views only read its
            ``models`` block, without importing torch: the hypothesis library loads with the validation).
        target_dir / draft_dir / training: model and training-data paths (case, params, or defaults).
        replay: the replay document (``results/replay-*.json``) or None.
        origin: how the run folder was chosen (:func:`resolve_run_dir`: ``given``, ``new`` or ``newest``).
        finished: why the run folder is finished (:func:`finished`), "" when it is not.
    """

    run_dir: Path
    server_url: str = ""
    api_key_env: str = "SGLANG_API_KEY"
    case_path: Optional[Path] = None
    target_dir: Optional[Path] = None
    draft_dir: Optional[Path] = None
    training: Optional[Path] = None
    replay: Optional[dict] = None
    notes: list = field(default_factory=list)
    origin: str = "given"
    finished: str = ""

    @property
    def writable(self) -> bool:
        """False for a finished run folder the user did not name (found as the newest): pages only read it."""
        return not (self.origin == "newest" and self.finished)

    def require_writable(self, what: str) -> None:
        """Raise :class:`helpers.errors.BadInput` (before any work) when this page may not write ``what`` here."""
        if not self.writable:
            raise BadInput(f"{what} would write into the newest run folder, a finished run ({self.finished}); "
                           f"name it to add to it (run_dir = \"{self.run_dir}\"), or run 00_investigate for a "
                           "new run folder", path=self.run_dir, field="run_dir")

    @property
    def live(self) -> bool:
        return bool(self.server_url)

    @property
    def api_key(self) -> Optional[str]:
        """The API key from the environment variable ``api_key_env`` (read when needed, never stored)."""
        return os.environ.get(self.api_key_env) or None

    def load_case(self):
        """The validated :class:`helpers.investigation.cases.Case` of ``case_path`` (None without one).

        Raises: helpers.errors.CaseError for an invalid case file."""

        return load_case(self.case_path) if self.case_path is not None else None

    @property
    def hidden_size(self) -> Optional[int]:
        try:
            cfg = read_config_json(self.target_dir, "target config") if self.target_dir else None
        except BadInput:
            cfg = None
        return int(cfg["hidden_size"]) if cfg and "hidden_size" in cfg else None


def read_json_or_none(path: Path) -> Any:
    """JSON content of ``path`` as :func:`helpers.runfiles.read_json_file` parses it (NaN allowed, depth bounded), or
    None when the file is absent, unreadable, empty, not JSON or nested too deeply: a page shows what a run folder
    holds and skips what it does not."""
    try:
        return read_json_file(path, "JSON file")
    except BadInput:
        return None


def context(run_dir: Any = "", *, case: Any = "", server_url: str = "", api_key_env: str = "SGLANG_API_KEY",
            target_dir: Any = "", draft_dir: Any = "", training_data: Any = "", repo_root: Any = "",
            create: bool = False, name: str = "interactive") -> RunContext:
    """Resolve a notebook's parameters into a :class:`RunContext`.

    Model paths come from, in order: the explicit parameter, the case file (``case`` or the one recorded
    by 00_replay in ``results/00_replay.json``), the shipped defaults (``env/models/...``). Relative paths
    are relative to ``repo_root`` (default: this checkout).

    With ``create`` and an empty ``run_dir``, a new run folder ``outputs/<stamp>-<name>`` is made
    (:func:`resolve_run_dir`).

    Raises:
        helpers.errors.CaseError: a case file that is not YAML or whose ``models`` block is invalid (the
        whole file is validated by :meth:`RunContext.load_case`, i.e. when 00_replay replays it).
    """
    base = as_path(repo_root) or ROOT
    rd, origin = resolve_run_dir(run_dir, create=create, name=name)
    ctx = RunContext(run_dir=rd, server_url=str(server_url or ""), api_key_env=api_key_env or "SGLANG_API_KEY",
                     origin=origin, finished=finished(rd))
    rec = read_json_or_none(result_path(rd, "00_replay")) or {}
    cp = as_path(case, base) or as_path(rec.get("case_path"), base)
    m = None
    if cp is not None and cp.exists():
        ctx.case_path = cp
        m = case_models(cp)
    elif cp is not None:
        ctx.notes.append(f"case file {cp} not found")

    def pick(explicit, from_case, default):
        p = as_path(explicit, base)
        if p is not None:
            return p
        if from_case:
            return as_path(from_case)  # case files' model paths are relative to the repository root
        return as_path(default, base)

    ctx.target_dir = pick(target_dir, m.target if m else None, DEFAULT_TARGET)
    ctx.draft_dir = pick(draft_dir, m.draft if m else None, DEFAULT_DRAFT)
    ctx.training = pick(training_data, m.training_data if m else None, DEFAULT_TRAINING)
    ctx.replay = load_replay(rd)
    # one draft / target / training data across the pages: the investigation's (the folders the server runs)
    inv = read_json_or_none(rd / "investigation.json") or {}
    att = inv.get("attach") or {}
    for attr, explicit in (("draft_dir", draft_dir), ("target_dir", target_dir)):
        used = as_path(att.get(attr))
        if used is not None and used.exists():
            given = getattr(ctx, attr)
            if given is not None and given.resolve() != used.resolve() and as_path(explicit, base):
                ctx.notes.append(f"{attr} {given} differs from the folder the server runs ({used}, "
                                 "investigation.json): the server's is used")
            setattr(ctx, attr, used)
    if inv.get("training") and not training_data:
        ctx.training = Path(inv["training"])
    return ctx


def run_dir_line(run_dir: Path) -> str:
    """The parameter line to paste into a notebook's parameters cell: ``run_dir = "/abs/path"``."""
    return f'run_dir = {json.dumps(str(Path(run_dir).resolve()))}'


def run_banner(ctx: RunContext) -> str:
    """The top of every page: the run folder it reads (and writes), how it was chosen, the line to paste into the
    next notebooks, and whether this page may write there (escaped HTML)."""
    how = {"given": "named in run_dir", "new": "a new run folder (run_dir was empty)",
           "newest": "the newest run folder under outputs/ (run_dir was empty)"}.get(ctx.origin, ctx.origin)
    out = (f'<div class="e3f-run"><b>Run folder</b> <code>{esc(ctx.run_dir.resolve())}</code> '
           f'<span class="e3f-note">({esc(how)})</span><br>'
           f'<span class="e3f-note">other notebooks on this run: paste</span> <code>{esc(run_dir_line(ctx.run_dir))}'
           "</code>")
    if not ctx.writable:
        out += (f'<br><b>Read only:</b> this run is finished ({esc(ctx.finished)}); this page saves nothing here. '
                "Name it in run_dir to add to it, or run 00_investigate for a new run folder.")
    out += "".join(f'<br><span class="e3f-note">note: {esc(n)}</span>' for n in ctx.notes)
    return out + "</div>"


def load_replay(run_dir: Path) -> Optional[ReplayDoc]:
    """The replay document of the run folder (``results/replay-*.json``; the newest if several), typed
    (:class:`helpers.records.ReplayDoc`); None without one or when it cannot be read."""
    files = sorted(Path(run_dir).glob("results/replay-*.json"), key=lambda p: p.stat().st_mtime)
    raw = read_json_or_none(files[-1]) if files else None
    return None if raw is None else ReplayDoc.model_validate(raw)


def case_models(path: Path):
    """The ``models`` block of a case file (helpers.investigation.cases.Models), read without validating the rest."""


    try:
        raw = load_yaml_text(read_file_text(path, "case file", error=CaseError, expected="YAML"), "case file", path=path,
                              error=CaseError) or {}
        return Models.model_validate((raw.get("models") if isinstance(raw, dict) else None) or {})
    except ValidationError as exc:
        raise CaseError(f"case file {path}: field 'models': {exc.errors()[0]['msg']}") from None


def connect(ctx: RunContext):
    """The client of ``ctx.server_url``'s engine (:class:`helpers.server.client.ServerClient`, the engine detected
    from the server's own endpoints: ``helpers.engines.detect``); the API key is read from the environment variable
    named ``ctx.api_key_env`` (never passed around or written)."""

    key = os.environ.get(ctx.api_key_env) or None
    return detect(ctx.server_url, key).adapter.client(ctx.server_url, api_key=key or "")


def engine_label(name: Optional[str]) -> str:
    """``SGLang`` / ``vLLM`` for an engine name recorded in a run folder (``investigation.json`` ``engine``, a
    measurement's or an ablation's ``engine``; default ``sglang``, as run folders made before vLLM say nothing)."""
    return engine_adapter(name or "sglang").label


def result_path(run_dir: Path, notebook: str) -> Path:
    """The newest ``results/<notebook>.json`` of the run folder: a rerun of a notebook in the same run folder writes
    ``<notebook>-2.json``, ``-3``, ... (:func:`write_result` never overwrites); the highest number wins. The plain
    name when there is none (it may not exist)."""
    folder = Path(run_dir) / "results"
    pat = re.compile(re.escape(notebook) + r"(?:-(\d+))?\.json")
    found = [(int(m.group(1) or 1), f) for f in (folder.glob(f"{notebook}*.json") if folder.is_dir() else [])
             if (m := pat.fullmatch(f.name))]
    return max(found)[1] if found else folder / f"{notebook}.json"


def write_result(where: "RunContext | Path", notebook: str, doc: Mapping[str, Any]) -> None:
    """Write ``results/<notebook>.json`` for the notebooks that follow, under a new name when one exists
    (``<notebook>-2.json``; :func:`result_path` reads the newest). Nothing is written into a finished run folder
    that the user did not name (``where`` a :class:`RunContext` that is not writable; :func:`run_banner` says so).
    The document is validated as that notebook's record (:data:`helpers.records.NOTEBOOK_RESULT`) first, so a
    misnamed field fails here, not in a later page. Returns None (a notebook cell ending with it shows nothing);
    :func:`result_path` finds what was written.

    Raises ``pydantic.ValidationError`` when ``doc`` does not fit the record of ``notebook``."""
    record = NOTEBOOK_RESULT.validate_python({**jsonable(dict(doc)), "notebook": notebook})
    if isinstance(where, RunContext) and not where.writable:
        return None
    run_dir = where.run_dir if isinstance(where, RunContext) else Path(where)
    text = json.dumps(jsonable(record.model_dump(mode="json")), indent=2, default=str) + "\n"
    atomic_write_new(run_dir / "results" / f"{notebook}.json", text.encode())


def read_result(run_dir: Path, notebook: str):
    """The newest ``results/<notebook>.json`` (:func:`result_path`) as its typed record
    (:data:`helpers.records.NOTEBOOK_RESULT`; mapping-style ``.get`` works on it), or None when the file is absent,
    unreadable or from another schema."""
    raw = read_json_or_none(result_path(run_dir, notebook))
    if not isinstance(raw, dict):
        return None
    try:
        return NOTEBOOK_RESULT.validate_python({**raw, "notebook": notebook})
    except ValidationError:
        return None


def findings_frame(findings: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Findings as a table: kind, chunk, detail."""
    return pd.DataFrame([{"kind": f.get("kind"), "chunk": "" if f.get("chunk") is None else f.get("chunk"),
                          "detail": f.get("detail")} for f in findings])
