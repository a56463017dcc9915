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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TARGET = "env/models/target"
DEFAULT_DRAFT = "env/models/draft"
DEFAULT_TRAINING = "env/models/data/sample"
DEFAULT_CASE = "env/cases/seeds_hunt.yaml"

VERDICT_COLORS = {"confirmed": "#c62828", "refuted": "#2e7d32", "inconclusive": "#9e9e9e"}
#: rows / columns kept in a figure trace before downsampling (keeps HTML pages small)
MAX_POINTS = 400

# =============================================================================================
# HTML and display
# =============================================================================================


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
.e3f-table th { background: #f5f5f5; }
.e3f-headline { font-size: 17px; border-left: 5px solid #1565c0; padding: 8px 12px; background: #e3f2fd; }
.e3f-step { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.e3f-note { color: #555; font-size: 13px; }
</style>"""

_SETUP_DONE = False


class _OfflineHtmlRenderer:
    """``text/html`` part of a figure: ``plotly.io.to_html`` without plotly.js, without MathJax (both would
    be CDN scripts otherwise), relying on the global ``Plotly`` injected by :func:`setup_notebook`."""

    def __init__(self, height: int = 460):
        self.height = height

    def to_mimebundle(self, fig_dict):
        import plotly.io as pio

        return {"text/html": pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False,
                                         full_html=False, default_width="100%",
                                         default_height=self.height, validate=False,
                                         config={"displaylogo": False, "responsive": True})}


def register_renderer() -> str:
    """Register the ``e3f_html`` plotly renderer and make ``plotly_mimetype+e3f_html`` the default.
    Returns the renderer name. Safe to call repeatedly."""
    import plotly.io as pio
    from plotly.io._base_renderers import MimetypeRenderer

    class E3fHtml(_OfflineHtmlRenderer, MimetypeRenderer):
        pass

    pio.renderers["e3f_html"] = E3fHtml()
    pio.renderers.default = "plotly_mimetype+e3f_html"
    return pio.renderers.default


def plotlyjs_html() -> str:
    """The one inline copy of plotly.js (``<script>`` without ``src``)."""
    from plotly.offline import get_plotlyjs

    return ("<script type=\"text/javascript\">window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script>")


def setup_notebook(*, force: bool = False) -> None:
    """Notebook setup (call once, at the top level of the first code cell): inline plotly.js exactly once,
    the offline renderer, the table CSS. Outside IPython it only registers the renderer."""
    global _SETUP_DONE
    register_renderer()
    if _SETUP_DONE and not force:
        return
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
    except ImportError:  # pragma: no cover - IPython is a dependency
        return
    if get_ipython() is None:
        return
    display(HTML(plotlyjs_html() + _CSS))
    _SETUP_DONE = True


def show(obj: Any) -> None:
    """Display a plotly figure, a DataFrame (escaped table), an HTML string (trusted: built here) or None."""
    from IPython.display import HTML, display

    if obj is None:
        return
    if isinstance(obj, pd.DataFrame):
        display(HTML(table_html(obj)))
    elif isinstance(obj, str):
        display(HTML(obj))
    else:
        display(obj)


def note(text: str) -> str:
    """A grey note paragraph (``text`` is escaped)."""
    return f'<p class="e3f-note">{esc(text)}</p>'


def downsample(n: int, limit: int = MAX_POINTS) -> np.ndarray:
    """Indices that keep at most ``limit`` of ``n`` evenly spaced points (first and last included)."""
    if n <= limit:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, limit).round().astype(int))


def interactive(draw: Callable[..., Any], controls: Mapping[str, Sequence[Any]], *,
                defaults: Optional[Mapping[str, Any]] = None, caption: str = "") -> None:
    """ipywidgets dropdowns that redraw ``draw(**values)`` in place, followed by a static copy of the
    default view (widget state is not exported to HTML, the static copy is).

    Args:
        draw: returns what :func:`show` displays (figure, DataFrame, HTML).
        controls: ``{argument name: options}`` (each a dropdown; options may be ``(label, value)`` pairs).
        defaults: initial values (default: the first option of each control).
        caption: shown above the static copy (escaped).
    """
    from IPython.display import HTML, display

    opts = {k: list(v) for k, v in controls.items() if len(v)}
    values = {k: (defaults or {}).get(k, _opt_value(v[0])) for k, v in opts.items()}
    try:
        import ipywidgets as W
    except ImportError:  # pragma: no cover
        W = None
    if W is not None and opts:
        boxes = {k: W.Dropdown(options=v, value=values[k], description=str(k)) for k, v in opts.items()}
        out = W.Output()

        def redraw(_change=None):
            with out:
                out.clear_output(wait=True)
                show(draw(**{k: b.value for k, b in boxes.items()}))

        for b in boxes.values():
            b.observe(redraw, names="value")
        display(W.VBox([W.HBox(list(boxes.values())), out]))
        redraw()
    label = ", ".join(f"{k} = {_opt_label(opts[k], values[k])}" for k in opts)
    display(HTML(note(f"Static view{' (' + label + ')' if label else ''}{': ' + caption if caption else ''} "
                      "- pick other values with the controls above in JupyterLab.")))
    show(draw(**values))


def _opt_value(o: Any) -> Any:
    return o[1] if isinstance(o, tuple) and len(o) == 2 else o


def _opt_label(options: Sequence[Any], value: Any) -> str:
    for o in options:
        if _opt_value(o) == value:
            return str(o[0] if isinstance(o, tuple) and len(o) == 2 else o)
    return str(value)


# =============================================================================================
# Run context
# =============================================================================================


def as_path(p: Any, base: Path = ROOT) -> Optional[Path]:
    """``p`` as a Path (``~`` expanded; relative to ``base``, default the repository root); None for ""/None."""
    if p in (None, ""):
        return None
    p = Path(os.path.expanduser(str(p)))
    return p if p.is_absolute() else base / p


def latest_run_dir(outputs: Optional[Path] = None, *, need: str = "results") -> Optional[Path]:
    """The newest run folder under ``outputs`` (default ``outputs/``) that has a ``need`` sub-folder."""
    outputs = outputs or ROOT / "outputs"
    if not outputs.is_dir():
        return None
    runs = sorted((p for p in outputs.iterdir() if p.is_dir() and (p / need).exists()),
                  key=lambda p: p.name)
    return runs[-1] if runs else None


def resolve_run_dir(run_dir: Any, *, create: bool = False, name: str = "interactive") -> Path:
    """``run_dir`` when given; else (interactive use) a new run folder when ``create``, else the newest
    run folder under ``outputs/`` with results. Raises FileNotFoundError when there is none."""
    p = as_path(run_dir)
    if p is not None:
        p.mkdir(parents=True, exist_ok=True)
        return p
    if create:
        from .runfiles import new_run_dir

        return new_run_dir(name)
    found = latest_run_dir()
    if found is None:
        raise FileNotFoundError("no run folder given and none under outputs/: run notebooks/00_replay.ipynb "
                                "or `python -m helpers suite run --params env/cases/main.yaml` first")
    return found


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

    @property
    def live(self) -> bool:
        return bool(self.server_url)

    def load_case(self):
        """The validated :class:`helpers.investigation.cases.Case` of ``case_path`` (None without one).

        Raises: helpers.errors.CaseError for an invalid case file."""
        from .investigation.cases import load_case

        return load_case(self.case_path) if self.case_path is not None else None

    @property
    def hidden_size(self) -> Optional[int]:
        cfg = read_json_file(self.target_dir / "config.json") if self.target_dir else None
        return int(cfg["hidden_size"]) if cfg and "hidden_size" in cfg else None


def read_json_file(path: Path) -> Optional[dict]:
    """JSON content of ``path`` (NaN allowed), None when absent or unreadable."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def context(run_dir: Any = "", *, case: Any = "", server_url: str = "", api_key_env: str = "SGLANG_API_KEY",
            target_dir: Any = "", draft_dir: Any = "", training_data: Any = "", repo_root: Any = "",
            create: bool = False) -> RunContext:
    """Resolve a notebook's parameters into a :class:`RunContext`.

    Model paths come from, in order: the explicit parameter, the case file (``case`` or the one recorded
    by 00_replay in ``results/00_replay.json``), the shipped defaults (``env/models/...``). Relative paths
    are relative to ``repo_root`` (default: this checkout).

    Raises:
        helpers.errors.CaseError: a case file that is not YAML or whose ``models`` block is invalid (the
        whole file is validated by :meth:`RunContext.load_case`, i.e. when 00_replay replays it).
    """
    base = as_path(repo_root) or ROOT
    rd = resolve_run_dir(run_dir, create=create)
    ctx = RunContext(run_dir=rd, server_url=str(server_url or ""), api_key_env=api_key_env or "SGLANG_API_KEY")
    rec = read_json_file(rd / "results" / "00_replay.json") or {}
    cp = as_path(case, base) or as_path(rec.get("case_path"), base)
    m = None
    if cp is not None and cp.exists():
        ctx.case_path = cp
        m = _case_models(cp)
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
    return ctx


def _case_models(path: Path):
    """The ``models`` block of a case file (helpers.investigation.cases.Models), read without validating the rest."""
    import yaml
    from pydantic import ValidationError

    from .errors import CaseError
    from .investigation.cases import Models

    try:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        return Models.model_validate(raw.get("models") or {})
    except yaml.YAMLError as exc:
        raise CaseError(f"case file {path} is not valid YAML: {exc}") from None
    except ValidationError as exc:
        raise CaseError(f"case file {path}: field 'models': {exc.errors()[0]['msg']}") from None


def connect(ctx: RunContext):
    """An :class:`helpers.server.client.SGLangClient` for ``ctx.server_url``; the API key is read from the
    environment variable named ``ctx.api_key_env`` (never passed around or written)."""
    from .server.client import SGLangClient

    key = os.environ.get(ctx.api_key_env) or None
    return SGLangClient(ctx.server_url, api_key=key or "")


def write_result(run_dir: Path, notebook: str, doc: Mapping[str, Any]) -> None:
    """Write ``results/<notebook>.json`` (atomic) for the notebooks that follow (returns None, so that a
    notebook cell ending with it shows nothing)."""
    from .runfiles import write_json

    write_json(Path(run_dir) / "results" / f"{notebook}.json", _jsonable(dict(doc)))


def read_result(run_dir: Path, notebook: str) -> Optional[dict]:
    """``results/<notebook>.json`` or None."""
    return read_json_file(Path(run_dir) / "results" / f"{notebook}.json")


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, (np.bool_,)):
        return bool(x)
    if isinstance(x, Path):
        return str(x)
    return x


# =============================================================================================
# 00 replay
# =============================================================================================


def load_replay(run_dir: Path) -> Optional[dict]:
    """The replay document of the run folder (``results/replay-*.json``; the newest if several)."""
    files = sorted(Path(run_dir).glob("results/replay-*.json"), key=lambda p: p.stat().st_mtime)
    return read_json_file(files[-1]) if files else None


def run_or_load_replay(ctx: RunContext, *, rerun: bool = False, progress: bool = False) -> Optional[dict]:
    """Replay the case of ``ctx.case_path`` into ``ctx.run_dir`` (or load a complete replay already there unless ``rerun``);
    record the case path in ``results/00_replay.json``. Returns the replay document, None without a case.
    The API key, if any, is read from the environment variable named by ``ctx.api_key_env``."""
    from .investigation.replay import replay_case

    case = ctx.load_case()
    if case is None:
        return ctx.replay
    doc = ctx.replay
    if rerun or doc is None or not doc.get("complete") or doc.get("case") != case.name:
        key = os.environ.get(ctx.api_key_env) or None
        doc = replay_case(case, ctx.run_dir, progress=progress, api_key=key)
    ctx.replay = doc
    write_result(ctx.run_dir, "00_replay", {
        "case_path": str(ctx.case_path), "case": doc.get("case"), "headline": doc.get("headline"),
        "complete": doc.get("complete"), "wall_s": doc.get("wall_s"),
        "models": {"target": str(ctx.target_dir), "draft": str(ctx.draft_dir), "training": str(ctx.training)},
        "hypotheses": [{"index": s.get("index"), "check": s.get("check"), "label": s.get("label"),
                        "verdict": s.get("verdict"), "expect": s.get("expect"), "as_expected": s.get("as_expected")}
                       for s in doc.get("steps", []) if s.get("kind") == "hypothesis"],
        "errors": [{"index": s.get("index"), "kind": s.get("kind"), "error": s.get("error")}
                   for s in doc.get("steps", []) if s.get("error")]})
    return doc


def headline(doc: Optional[Mapping[str, Any]]) -> str:
    """The replay's one-sentence headline (plain text), or a sentence saying why there is none."""
    if not doc:
        return "No replay in this run folder (no case file was given)."
    return str(doc.get("headline") or "The replay recorded no headline (no step finished).")


def headline_html(doc: Optional[Mapping[str, Any]]) -> str:
    """:func:`headline` in a highlighted, escaped block, with the case title."""
    title = esc((doc or {}).get("title") or "")
    sub = f'<div class="e3f-note">Case: {title}</div>' if title else ""
    return f'<div class="e3f-headline">{esc(headline(doc))}{sub}</div>'


def story_html(doc: Optional[Mapping[str, Any]]) -> str:
    """The case's title and story (free text from the case file), escaped; "" without a story."""
    if not doc or not (doc.get("story") or "").strip():
        return ""
    paras = [p.strip() for p in str(doc["story"]).split("\n\n") if p.strip()]
    return (f'<p><b>{esc(doc.get("title") or doc.get("case") or "")}</b></p>'
            + "".join(f"<p>{esc(' '.join(p.split()))}</p>" for p in paras))


def _num(x: Any) -> float:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return float("nan")
    return v


def fixes_frame(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per fix step: step, fix, accept length / rate / tok/s with 95% CI bounds, requests, error.

    Columns: ``step`` (1-based), ``fix``, ``accept_length``, ``accept_length_lo``, ``accept_length_hi``,
    ``accept_rate``, ``accept_rate_lo``, ``accept_rate_hi``, ``tok_s``, ``tok_s_lo``, ``tok_s_hi``,
    ``n_requests``, ``baseline``, ``error``.
    """
    rows = []
    for s in (doc or {}).get("steps", []):
        if s.get("kind") != "fix":
            continue
        sm = s.get("summary") or {}
        row = {"step": int(s.get("index", 0)) + 1, "fix": s.get("name") or "(fix)"}
        for k in ("accept_length", "accept_rate", "tok_s"):
            for suf in ("", "_lo", "_hi"):
                row[k + suf] = _num(sm.get(k + suf))
        row["n_requests"] = sm.get("n_requests")
        row["baseline"] = bool(s.get("baseline"))
        row["error"] = s.get("error") or s.get("server_error") or ""
        rows.append(row)
    return pd.DataFrame(rows)


def fixes_display(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """:func:`fixes_frame` formatted for reading: ``value [lo, hi]`` strings."""
    df = fixes_frame(doc)
    if df.empty:
        return df

    def ci(r, k, pct=False, nd=2):
        v, lo, hi = r[k], r[k + "_lo"], r[k + "_hi"]
        if not math.isfinite(v):
            return ""
        f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.{nd}f}")
        return f"{f(v)} [{f(lo)}, {f(hi)}]" if math.isfinite(lo) and math.isfinite(hi) else f(v)

    return pd.DataFrame({"step": df["step"], "fix": df["fix"],
                         "accept length [95% CI]": [ci(r, "accept_length") for _, r in df.iterrows()],
                         "accept rate [95% CI]": [ci(r, "accept_rate", pct=True) for _, r in df.iterrows()],
                         "tok/s [95% CI]": [ci(r, "tok_s", nd=1) for _, r in df.iterrows()],
                         "requests": df["n_requests"], "error": df["error"]})


def hypotheses_frame(doc: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """One row per hypothesis step: step, label, check, question, verdict, expected, as_expected, on_fix."""
    rows = []
    for s in (doc or {}).get("steps", []):
        if s.get("kind") != "hypothesis":
            continue
        rows.append({"step": int(s.get("index", 0)) + 1, "label": s.get("label") or "",
                     "check": s.get("check") or "", "question": s.get("question") or "",
                     "verdict": s.get("verdict") or ("error" if s.get("error") else ""),
                     "expected": s.get("expect") or "",
                     "as expected": "" if s.get("as_expected") is None else ("yes" if s["as_expected"] else "NO"),
                     "on fix": s.get("on_fix") or "", "error": s.get("error") or ""})
    return pd.DataFrame(rows)


def step_html(step: Mapping[str, Any]) -> str:
    """Header block of one hypothesis step: label, question, verdict badge, expected verdict, explanation
    (all escaped)."""
    n = int(step.get("index", 0)) + 1
    label = f" &middot; {esc(step['label'])}" if step.get("label") else ""
    exp = step.get("expect")
    expected = ""
    if exp:
        ok = step.get("as_expected")
        mark = "as expected" if ok else "NOT as expected"
        expected = f' &nbsp; expected {verdict_badge(exp)} <span class="e3f-note">({mark})</span>'
    err = f'<p style="color:#c62828">{esc(step["error"])}</p>' if step.get("error") else ""
    return (f'<div class="e3f-step"><b>Step {n}: {esc(step.get("check", ""))}</b>{label}'
            f'<br><i>{esc(step.get("question", ""))}</i>'
            f'<br>verdict {verdict_badge(step.get("verdict") or ("error" if step.get("error") else None))}{expected}'
            f'<p>{esc(step.get("explanation", ""))}</p>{err}'
            f'<span class="e3f-note">on fix: {esc(step.get("on_fix", ""))}; {esc(step.get("wall_s", ""))} s</span></div>')


def evidence_frame(step: Mapping[str, Any]) -> pd.DataFrame:
    """The step's evidence table (records -> DataFrame; empty when none)."""
    ev = step.get("evidence") or []
    return pd.DataFrame(ev) if ev else pd.DataFrame()


def load_figure(run_dir: Path, rel: Optional[str]):
    """A plotly figure saved as JSON in the run folder (``figures/...``), or None."""
    if not rel:
        return None
    p = Path(run_dir) / rel
    if not p.exists():
        return None
    import plotly.io as pio

    return pio.from_json(p.read_text())


def timeline_figure(doc: Optional[Mapping[str, Any]], *, title: str = "Accept rate per fix along the timeline"):
    """Accept rate per fix (points with 95% CI bars, x = timeline step) with every hypothesis as a vertical
    line annotated with its check and coloured by its verdict; accept length on the right axis; sweeps as
    grey bands labelled with the best num_steps.

    Returns a ``plotly.graph_objects.Figure`` (empty axes when there are no steps).
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    steps = list((doc or {}).get("steps", []))
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fx = fixes_frame(doc)
    fx = fx[~fx["baseline"]] if len(fx) else fx
    if len(fx):
        y = 100 * fx["accept_rate"]
        fig.add_trace(go.Scatter(
            x=fx["step"], y=y, mode="markers+lines+text", name="accept rate (95% CI)",
            text=[esc(f) for f in fx["fix"]],
            textposition=["top right" if i == 0 and len(fx) > 1 else "top left" if i == len(fx) - 1 and len(fx) > 1
                          else "top center" for i in range(len(fx))],
            marker=dict(size=12, color="#1565c0"), line=dict(color="#1565c0", width=1, dash="dot"),
            error_y=dict(type="data", array=(100 * (fx["accept_rate_hi"] - fx["accept_rate"])).clip(lower=0)
                         .fillna(0).tolist(),
                         arrayminus=(100 * (fx["accept_rate"] - fx["accept_rate_lo"])).clip(lower=0)
                         .fillna(0).tolist(), visible=True),
            hovertemplate="step %{x}: %{text}<br>accept rate %{y:.1f}%<extra></extra>"), secondary_y=False)
        fig.add_trace(go.Scatter(
            x=fx["step"], y=fx["accept_length"], mode="markers", name="accept length (95% CI)",
            marker=dict(size=9, symbol="diamond", color="#ef6c00"),
            error_y=dict(type="data", array=(fx["accept_length_hi"] - fx["accept_length"]).clip(lower=0)
                         .fillna(0).tolist(),
                         arrayminus=(fx["accept_length"] - fx["accept_length_lo"]).clip(lower=0)
                         .fillna(0).tolist(), visible=True),
            hovertemplate="step %{x}: accept length %{y:.2f}<extra></extra>"), secondary_y=True)
    seen = set()
    for s in steps:
        x = int(s.get("index", 0)) + 1
        if s.get("kind") == "hypothesis":
            v = s.get("verdict") or "inconclusive"
            color = VERDICT_COLORS.get(v, "#616161")
            fig.add_vline(x=x, line=dict(color=color, width=2, dash="dash"))
            fig.add_annotation(x=x, y=1.0, yref="paper", text=esc(s.get("label") or s.get("check")),
                               textangle=-60, showarrow=False, font=dict(color=color, size=10),
                               xanchor="left", yanchor="bottom")
            fig.add_trace(go.Scatter(
                x=[x], y=[0], mode="markers", marker=dict(symbol="triangle-up", size=11, color=color),
                name=v, legendgroup=v, showlegend=v not in seen,
                hovertext=esc(f"step {x}: {s.get('check')}: {v}" + (f" (expected {s['expect']})"
                                                                       if s.get("expect") else "")),
                hoverinfo="text"), secondary_y=False)
            seen.add(v)
        elif s.get("kind") == "sweep":
            fig.add_vrect(x0=x - 0.4, x1=x + 0.4, fillcolor="#9e9e9e", opacity=0.15, line_width=0)
            best = s.get("best_num_steps")
            fig.add_annotation(x=x, y=0.02, yref="paper", showarrow=False,
                               text=f"sweep: best num_steps={esc(best)}", font=dict(size=10))
    fig.update_layout(title=title, template="plotly_white", height=480,
                      margin=dict(l=60, r=60, t=130, b=60), legend=dict(orientation="h", y=-0.18))
    fig.update_xaxes(title_text="timeline step", dtick=1, range=[0.5, max([len(steps), 1]) + 0.5])
    fig.update_yaxes(title_text="accept rate (%)", range=[-5, 105], secondary_y=False)
    top = float(np.nanmax(fx["accept_length_hi"].to_numpy(float))) if len(fx) and \
        np.isfinite(fx["accept_length_hi"].to_numpy(float)).any() else 1.0
    # same -5..105 % frame as the left axis: 0 lines up, and the top leaves room for the CI bar
    fig.update_yaxes(title_text="accept length", secondary_y=True, showgrid=False,
                     range=[-0.05 * top * 1.1, 1.05 * top * 1.1])
    return fig


def sweep_points(doc: Optional[Mapping[str, Any]]) -> list[dict]:
    """Points of the (last) num_steps sweep, each ``{num_steps, tok_s, tok_s_lo, tok_s_hi, accept_length,
    ..., fix}``; empty without a sweep."""
    sweeps = [s for s in (doc or {}).get("steps", []) if s.get("kind") == "sweep" and s.get("points")]
    if not sweeps:
        return []
    s = sweeps[-1]
    return [dict(p, fix=f"{s.get('on_fix')} | num_steps={p.get('num_steps')}", topk=p.get("topk") or 1)
            for p in s["points"]]


def sweep_figure(doc: Optional[Mapping[str, Any]]):
    """tok/s (and accept length) against num_steps for the replay's sweep (:func:`helpers.plots.acceptance.
    tok_s_vs_steps`), or None without a sweep. Points the sweep took from the fix's own measurement
    (``reused``) are included."""
    from .plots.acceptance import tok_s_vs_steps

    pts = sweep_points(doc)
    if not pts:
        return None
    s = [x for x in (doc or {}).get("steps", []) if x.get("kind") == "sweep"][-1]
    return tok_s_vs_steps(pts, title=f"tok/s vs num_steps (sweep on '{esc(s.get('on_fix'))}'; best "
                                     f"num_steps={esc(s.get('best_num_steps'))})")


def hypothesis_steps(doc: Optional[Mapping[str, Any]], check: str) -> list[dict]:
    """The replay's steps that ran ``check``."""
    return [s for s in (doc or {}).get("steps", []) if s.get("kind") == "hypothesis" and s.get("check") == check]


def show_hypothesis(step: Mapping[str, Any], run_dir: Path) -> None:
    """Display one hypothesis step: header (:func:`step_html`), evidence table, figure."""
    show(step_html(step))
    ev = evidence_frame(step)
    if len(ev):
        show(ev)
    fig = load_figure(run_dir, step.get("figure"))
    if fig is not None:
        show(fig)


def show_timeline(doc: Optional[Mapping[str, Any]], run_dir: Path) -> None:
    """Display every step of a replay in order (hypotheses in full, fixes as a one-line summary)."""
    for s in (doc or {}).get("steps", []):
        if s.get("kind") == "hypothesis":
            show_hypothesis(s, run_dir)
        elif s.get("kind") == "fix":
            sm = s.get("summary") or {}
            txt = (f"Step {int(s.get('index', 0)) + 1}: fix '{s.get('name')}'"
                   + (" (target only, baseline)" if s.get("baseline") else "")
                   + (f": accept length {_num(sm.get('accept_length')):.2f}, accept rate "
                      f"{100 * _num(sm.get('accept_rate')):.1f}%, {_num(sm.get('tok_s')):.1f} tok/s"
                      if sm else "")
                   + (f"; server start {s.get('server_startup_s')} s" if s.get("server_startup_s") else ""))
            problem = s.get("error") or s.get("server_error")
            err = f'<p style="color:#c62828">{esc(problem)}</p>' if problem else ""
            show(f'<div class="e3f-step" style="background:#fafafa"><b>{esc(txt)}</b>{err}</div>')
        elif s.get("kind") == "sweep":
            pts = ", ".join(f"{p.get('num_steps')}: {_num(p.get('tok_s')):.1f} tok/s" for p in s.get("points", []))
            show(f'<div class="e3f-step"><b>Step {int(s.get("index", 0)) + 1}: num_steps sweep</b> '
                 f'{esc(pts)}; best num_steps = {esc(s.get("best_num_steps"))}'
                 + (f'<p style="color:#c62828">{esc(s["error"])}</p>' if s.get("error") else "") + "</div>")


# =============================================================================================
# 01 attach
# =============================================================================================

FACT_KEYS = [("version", "SGLang version"), ("model_path", "target"), ("speculative_algorithm", "algorithm"),
             ("speculative_draft_model_path", "draft"), ("speculative_num_steps", "num_steps"),
             ("speculative_eagle_topk", "topk"), ("speculative_num_draft_tokens", "num_draft_tokens"),
             ("tp_size", "TP size"), ("dp_size", "DP size"), ("dtype", "dtype"), ("device", "device"),
             ("attention_backend", "attention backend"), ("max_running_requests", "max running requests"),
             ("enable_return_hidden_states", "--enable-return-hidden-states"),
             ("enable_metrics", "--enable-metrics"), ("forward_hooks", "--forward-hooks"),
             ("disable_cuda_graph", "--disable-cuda-graph")]


def server_facts(info: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """Key facts of a (redacted) ``/server_info`` snapshot: columns ``setting``, ``value`` (values as text;
    the forward-hooks JSON is summarised to the hook names)."""
    info = info or {}
    rows = []
    for k, label in FACT_KEYS:
        if k not in info:
            continue
        v = info[k]
        if k == "forward_hooks" and v:
            try:
                hooks = json.loads(v) if isinstance(v, str) else v
                v = ", ".join(str(h.get("name")) for h in hooks)
            except (ValueError, AttributeError, TypeError):
                v = str(v)[:200]
        rows.append({"setting": label, "value": "" if v is None else str(v)})
    return pd.DataFrame(rows)


def spec_frame(spec: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """Requested vs effective speculative settings of an EffectiveSpecConfig dump."""
    if not spec:
        return pd.DataFrame()
    eff, req = spec.get("effective") or {}, spec.get("requested") or {}
    keys = [k for k in ("algorithm", "num_steps", "topk", "num_draft_tokens", "max_running_requests",
                        "adaptive", "draft_model_path") if k in eff or k in req]
    return pd.DataFrame([{"setting": k, "requested": _s(req.get(k)), "effective": _s(eff.get(k)),
                          "changed": "yes" if req.get(k) is not None and req.get(k) != eff.get(k) else ""}
                         for k in keys])


def _s(v: Any) -> str:
    return "" if v is None else str(v)


def overrides_frame(spec: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """The silent overrides SGLang made (field, requested, effective, message)."""
    ovs = (spec or {}).get("overrides") or []
    return pd.DataFrame([{"field": o.get("field"), "requested": _s(o.get("requested")),
                          "effective": _s(o.get("effective")), "message": o.get("message")} for o in ovs])


def attach_records(ctx: RunContext) -> list[dict]:
    """Per fix of the replay: ``{"fix", "server" (redacted snapshot), "spec", "warnings", "draft_dir"}``
    from ``acceptance/<fix>/summary.json``; the draft folder the fix ran with (``drafts/<fix>/`` for a
    config variant, else the case's draft)."""
    from .runfiles import safe_name

    out = []
    for s in (ctx.replay or {}).get("steps", []):
        if s.get("kind") != "fix" or s.get("baseline"):
            continue
        name = s.get("name") or ""
        doc = read_json_file(ctx.run_dir / "acceptance" / safe_name(name) / "summary.json") or {}
        variant = ctx.run_dir / "drafts" / safe_name(name)
        draft = variant if (variant / "config.json").exists() else ctx.draft_dir
        out.append({"fix": name, "server": doc.get("server") or {}, "spec": doc.get("spec"),
                    "warnings": doc.get("warnings") or [], "draft_dir": draft,
                    "error": s.get("error") or s.get("server_error")})
    return out


def live_attach(ctx: RunContext) -> dict:
    """Probe the live server: redacted ``/server_info``, the effective spec config (with the draft config
    when ``ctx.draft_dir`` holds one), version. Returns ``{"fix": "live", "server", "spec", "warnings",
    "draft_dir"}`` like :func:`attach_records`."""
    from .acceptance.measure import server_snapshot

    client = connect(ctx)
    try:
        info = server_snapshot(client.server_info())
        # the draft the server loaded, when this machine sees that folder; else the notebook's draft_dir
        served = as_path(info.get("speculative_draft_model_path"))
        draft = served if served is not None and (served / "config.json").exists() else ctx.draft_dir
        draft_cfg = draft / "config.json" if draft and (draft / "config.json").exists() else None
        spec = client.effective_spec_config(draft_config=draft_cfg)
    finally:
        client.close()
    return {"fix": f"live server {redact_url_safe(ctx.server_url)}", "server": info,
            "spec": json.loads(spec.model_dump_json()),
            "warnings": [o.message for o in spec.overrides] + list(spec.notes), "draft_dir": draft}


def redact_url_safe(url: str) -> str:
    """``url`` without credentials or query (helpers.server.redaction.redact_url)."""
    from .server.redaction import redact_url

    return redact_url(url)


def static_wiring(draft_dir: Optional[Path], target_dir: Optional[Path], server: Optional[Mapping[str, Any]],
                  training: Optional[Path] = None) -> dict:
    """Static wiring check from configs only (no tensors): :func:`helpers.diagnosis.static.static_check` (the one
    implementation) on the draft the server runs with, the target, the server's version / algorithm and the
    training data's manifest.

    Returns ``{"plans": DataFrame(index, served, training, offset), "findings": [finding dicts], "verdict",
    "served_plan": dict|None, "training_plan": dict|None (with provenance), "notes": [str]}``. Missing configs give
    empty plans and a note (never raises for missing inputs).
    """
    from .diagnosis.static import plans_frame_rows, static_check

    empty = {"plans": pd.DataFrame(), "findings": [], "verdict": None, "served_plan": None, "training_plan": None}
    if not draft_dir or not (Path(draft_dir) / "config.json").exists():
        return {**empty, "notes": [f"no draft config.json at {draft_dir}"]}
    if not target_dir or not (Path(target_dir) / "config.json").exists():
        return {**empty, "notes": [f"no target config.json at {target_dir}"]}
    notes: list[str] = []
    td = None
    if training is not None and Path(training).exists():
        try:
            from .formats.training_data import TrainingData

            td = TrainingData(training, max_samples=1)
        except Exception as exc:  # noqa: BLE001 - a note, the check goes on with the draft config's claim
            notes.append(f"training data not readable ({type(exc).__name__}: {exc}); the draft config's ids are used")
    info = dict(server) if server else {}
    rep = static_check(Path(draft_dir), Path(target_dir), server=info or None, sglang_version=info.get("version"),
                       training=td)
    sp, tp = rep.served_plan, rep.training_plan
    notes += list(sp.notes) + ([] if tp is None else list(tp.notes)) + list(rep.advisories)
    if rep.ambiguity:
        notes.append("ambiguous: " + "; ".join(f"{r['reading']} -> {r['outcome']}" for r in rep.ambiguity["readings"])
                     + ". To settle it: " + rep.ambiguity["settle"])
    return {"plans": pd.DataFrame(plans_frame_rows(rep)), "findings": rep.findings, "verdict": rep.verdict,
            "served_plan": sp.to_json(), "training_plan": None if tp is None else tp.to_json(), "notes": notes}


def findings_frame(findings: Iterable[Mapping[str, Any]]) -> pd.DataFrame:
    """Findings as a table: kind, chunk, detail."""
    return pd.DataFrame([{"kind": f.get("kind"), "chunk": "" if f.get("chunk") is None else f.get("chunk"),
                          "detail": f.get("detail")} for f in findings])


def show_attach(rec: Mapping[str, Any], ctx: RunContext) -> dict:
    """Display one attach record (:func:`attach_records` / :func:`live_attach`): server facts, requested vs
    effective spec settings, silent overrides, and the static wiring check. Returns its JSON summary."""
    show(f"<h3>{esc(rec.get('fix'))}</h3>")
    if rec.get("error"):
        show(f'<p style="color:#c62828">This fix did not run: {esc(rec["error"])}</p>')
    facts = server_facts(rec.get("server"))
    show(facts if len(facts) else note("No server snapshot recorded for this fix."))
    sf = spec_frame(rec.get("spec"))
    if len(sf):
        show("<b>Speculative settings: requested vs effective</b>")
        show(sf)
    ov = overrides_frame(rec.get("spec"))
    show("<b>Silent overrides</b>")
    show(ov if len(ov) else note("SGLang changed none of the requested speculative settings."))
    sw = static_wiring(rec.get("draft_dir"), ctx.target_dir, rec.get("server"), ctx.training)
    show("<b>Static wiring check</b> (configs only: the layers SGLang will capture for this draft vs the "
         "layers the draft was trained on)")
    show(sw["plans"] if len(sw["plans"]) else note("; ".join(sw["notes"]) or "no plans"))
    show(findings_frame(sw["findings"]) if sw["findings"] else
         note("No static finding: by the configs, the served layers equal the trained layers. A fault injected "
              "at run time (hooks, engine bugs) is only visible in the numbers: see 03_compare."))
    return {"fix": rec.get("fix"), "facts": facts.to_dict(orient="records"),
            "overrides": ov.to_dict(orient="records"),
            "static_findings": [f.get("kind") for f in sw["findings"]],
            "served_plan": (sw["served_plan"] or {}).get("tensors"),
            "training_plan": (sw["training_plan"] or {}).get("tensors")}


# =============================================================================================
# 02 dump
# =============================================================================================


def dump_paths(run_dir: Path) -> list[Path]:
    """Every dump folder (``manifest.json``) under ``run_dir/dumps`` (per-rank dumps included), sorted."""
    return sorted(p.parent for p in (Path(run_dir) / "dumps").rglob("manifest.json"))


def dumps_frame(run_dir: Path, hidden_size: Optional[int] = None) -> pd.DataFrame:
    """One row per dump: name (relative to dumps/), kind, TP rank, samples, rows, width, chunks, dtype."""
    from .formats.dumps import read_dump

    rows = []
    for p in dump_paths(run_dir):
        try:
            src = read_dump(p)
        except Exception as exc:  # noqa: BLE001 - shown in the table
            rows.append({"dump": str(p.relative_to(Path(run_dir) / "dumps")), "kind": "unreadable",
                         "error": f"{type(exc).__name__}: {exc}"})
            continue
        H = src.hidden_size or hidden_size
        w = src.width or 0
        rows.append({"dump": str(p.relative_to(Path(run_dir) / "dumps")), "kind": src.kind,
                     "tp rank": "" if src.tp_rank is None else src.tp_rank, "samples": len(src.samples),
                     "rows": sum(s.rows for s in src.samples), "width": w,
                     "chunks": (w // H) if H and w and w % H == 0 else "", "dtype": src.dtype or "",
                     "layers": ", ".join((src.layer_plan or {}).get("tensors", [])[:12])})
    return pd.DataFrame(rows)


def chunk_norms(dump: Path, sample: int = 0, hidden_size: Optional[int] = None) -> dict:
    """Per-row L2 norm of each H-wide chunk of one dump sample.

    Returns ``{"norms": ndarray [chunks, rows] float64, "positions": ndarray [rows], "input_ids": ndarray,
    "chunk_names": [str], "key": str}``. ``hidden_size`` defaults to the dump's; a width that is not a
    multiple of it is shown as one chunk.
    """
    import torch

    from .formats.dumps import read_dump

    src = read_dump(dump)
    s = src.samples[min(int(sample), len(src.samples) - 1)]
    x = s.load().to(torch.float32).numpy().astype(np.float64)
    H = src.hidden_size or hidden_size or x.shape[1]
    C = x.shape[1] // H if x.shape[1] % H == 0 else 1
    H = x.shape[1] // C
    norms = np.sqrt((x.reshape(x.shape[0], C, H) ** 2).sum(-1)).T
    names = list((src.layer_plan or {}).get("tensors") or [])
    if len(names) != C:
        names = [f"chunk {i}" for i in range(C)]
    return {"norms": norms, "positions": s.first_position + np.arange(x.shape[0]),
            "input_ids": np.asarray(s.input_ids) if s.input_ids is not None else None,
            "chunk_names": names, "key": s.key}


def norm_heatmap(dump: Path, sample: int = 0, hidden_size: Optional[int] = None, *, title: str = ""):
    """Heatmap of per-chunk row norms (y = chunk, x = token position) of one dump sample; columns are
    downsampled to :data:`MAX_POINTS`. Returns a plotly Figure."""
    import plotly.graph_objects as go

    d = chunk_norms(dump, sample, hidden_size)
    keep = downsample(d["norms"].shape[1])
    z = d["norms"][:, keep]
    fig = go.Figure(go.Heatmap(z=z, x=d["positions"][keep], y=[esc(n) for n in d["chunk_names"]],
                               colorscale="Viridis", colorbar=dict(title="L2 norm"),
                               hovertemplate="pos %{x}, %{y}: |h| = %{z:.3g}<extra></extra>"))
    fig.update_layout(title=title or f"Per-chunk row norms: {esc(Path(dump).name)}, sample {esc(d['key'])}",
                      xaxis_title="token position", yaxis_title="chunk", template="plotly_white",
                      height=max(260, 60 + 28 * len(d["chunk_names"])), margin=dict(l=90, r=20, t=50, b=50))
    return fig


def dump_samples(dump: Path) -> list[tuple[str, int]]:
    """``(label, index)`` options for a dump's samples (for a dropdown)."""
    from .formats.dumps import read_dump

    src = read_dump(dump)
    return [(f"{i}: {s.key} ({s.rows} rows)", i) for i, s in enumerate(src.samples)]


def capture_live(ctx: RunContext, *, num_samples: int = 4, name: str = "live-served",
                 reference: str = "auto") -> dict:
    """Capture what the live server feeds the draft for the first ``num_samples`` training samples
    (``dumps/<name>``), plus the HF reference of every layer when ``reference`` is ``"hf"`` (or
    ``"auto"`` and the target weights here are small). Returns ``{"served": path, "reference": path|None}``."""
    from .capture import capture_reference_hf, capture_served
    from .formats.training_data import TrainingData

    td = TrainingData(ctx.training, hidden_size=ctx.hidden_size, max_samples=num_samples)
    samples = list(td)[:num_samples]
    client = connect(ctx)
    dumps = ctx.run_dir / "dumps"
    dumps.mkdir(parents=True, exist_ok=True)
    out = dumps / name
    i = 2
    while out.exists():
        out = dumps / f"{name}-{i}"
        i += 1
    try:
        served = capture_served(client, samples, dumps, name=out.name, max_new_tokens=1, progress=False)
    finally:
        client.close()
    ref = None
    if reference == "hf" or (reference == "auto" and _small_model(ctx.target_dir)):
        rp = dumps / "reference-hf"
        ref = rp if (rp / "manifest.json").exists() else capture_reference_hf(ctx.target_dir, samples, dumps,
                                                                              name=rp.name, progress=False)
    return {"served": served, "reference": ref}


def _small_model(path: Optional[Path], limit: int = 2 << 30) -> bool:
    if not path or not Path(path).is_dir():
        return False
    files = list(Path(path).glob("*.safetensors"))
    return bool(files) and sum(f.stat().st_size for f in files) < limit


# =============================================================================================
# 03 compare
# =============================================================================================


def served_dumps(run_dir: Path) -> list[Path]:
    """``kind: served`` dumps of the run folder, in creation order."""
    out = []
    for p in dump_paths(run_dir):
        man = read_json_file(p / "manifest.json") or {}
        if man.get("kind") == "served":
            out.append((man.get("created") or "", p))
    return [p for _, p in sorted(out)]


def reference_dump(run_dir: Path) -> Optional[Path]:
    """The run folder's reference dump (every layer for the same tokens), if any."""
    for p in dump_paths(run_dir):
        man = read_json_file(p / "manifest.json") or {}
        if man.get("kind") == "reference":
            return p
    return None


def run_diagnosis(ctx: RunContext, served: Path, *, reference: Optional[Path] = None,
                  max_samples: Optional[int] = 8):
    """:func:`helpers.diagnosis.diagnose.diagnose` of ``served`` against ``ctx.training`` with the draft/target
    configs (the fix's draft variant when the replay used one) and the reference dump."""
    from .diagnosis.diagnose import diagnose

    return diagnose(ctx.training, [served], draft_config=_draft_for_dump(ctx, served),
                    target_config=ctx.target_dir, reference=reference, max_samples=max_samples)


def _draft_for_dump(ctx: RunContext, served: Path) -> Optional[Path]:
    stem = served.name[:-len("-served")] if served.name.endswith("-served") else ""
    variant = ctx.run_dir / "drafts" / stem
    if stem and (variant / "config.json").exists():
        return variant
    return ctx.draft_dir if ctx.draft_dir and (ctx.draft_dir / "config.json").exists() else None


def chunk_table(diag) -> pd.DataFrame:
    """The diagnosis chunk table with the planned (configured) and trained tensor of each chunk."""
    served = list(diag.served_plan.tensors) if diag.served_plan is not None else []
    trained = list(diag.training_plan.tensors) if diag.training_plan is not None else []
    rows = []
    for ch in diag.chunks:
        i = ch["index"]
        rows.append({"chunk": i, "width": ch["width"], "configured": served[i] if i < len(served) else "",
                     "trained on": trained[i] if i < len(trained) else "",
                     "measured (reference)": ch.get("identified_as") or "",
                     "best training chunk": "" if ch["matched_training_chunk"] is None else ch["matched_training_chunk"],
                     "rel_diff": ch["rel_diff"], "cosine": ch["cosine"]})
    return pd.DataFrame(rows)


def rel_diff_matrix(diag, *, against: str = "training") -> pd.DataFrame:
    """rel_diff of each served chunk (rows) against each training chunk / unit (``against="training"``) or
    each reference tensor (``"reference"``) over all aligned rows. Index ``served chunk i``; columns the
    training plan's tensors (or units) / the reference tensor names. Empty when not available."""
    c = diag.comparison
    if c is None:
        return pd.DataFrame()
    src = c.primary
    if against == "reference":
        if src.ref is None or not c.reference_tensors or src.ref.rows == 0:
            return pd.DataFrame()
        acc, cols = src.ref, list(c.reference_tensors)
    else:
        acc = src.pairs
        trained = list(diag.training_plan.tensors) if diag.training_plan is not None else []
        cols = [f"t{j}: {trained[j]}" if c.shard_factor == 1 and j < len(trained) else u
                for j, u in enumerate(c.training_units)]
    m = np.array([[acc.metrics(i, j, c.tolerance).rel_diff for j in range(acc.nu)] for i in range(acc.ns)])
    return pd.DataFrame(m, index=[f"served chunk {i}" for i in range(acc.ns)], columns=cols)


def rel_diff_heatmap(matrix: pd.DataFrame, *, title: str, tolerance: Optional[float] = None):
    """log10(rel_diff) heatmap of a :func:`rel_diff_matrix` with the values as cell text; cells at or below
    ``tolerance`` are the matches."""
    import plotly.graph_objects as go

    z = np.log10(np.clip(matrix.to_numpy(dtype=float), 1e-12, None))
    text = [[f"{v:.2e}" for v in row] for row in matrix.to_numpy(dtype=float)]
    fig = go.Figure(go.Heatmap(z=z, x=[esc(c) for c in matrix.columns], y=[esc(i) for i in matrix.index],
                               text=text, texttemplate="%{text}", colorscale="RdBu", reversescale=True,
                               zmin=-12, zmax=0, colorbar=dict(title="log10 rel_diff"),
                               hovertemplate="%{y} vs %{x}: rel_diff %{text}<extra></extra>"))
    sub = f" (match: rel_diff <= {tolerance:.0e})" if tolerance else ""
    fig.update_layout(title=title + sub, template="plotly_white",
                      height=max(280, 120 + 40 * len(matrix.index)), margin=dict(l=110, r=20, t=60, b=80))
    fig.update_yaxes(autorange="reversed")
    return fig


def aligned_rows(served: Path, training: Path, hidden_size: int, *, max_samples: int = 8) -> list[dict]:
    """Served rows paired with the training rows of the same tokens.

    A served sample pairs with the training sample whose ``input_ids[first_position:first_position+rows]``
    equal the served ``input_ids``. Returns per pair ``{"key", "positions" [T], "input_ids" [T],
    "served" ndarray [T, Ws], "training" ndarray [T, Wt]}`` (float32). Unpaired samples are skipped.
    """
    import torch

    from .formats.dumps import read_dump
    from .formats.training_data import TrainingData

    src = read_dump(served)
    want = {}
    for s in src.samples:
        if s.input_ids is not None:
            want.setdefault((s.first_position, tuple(int(t) for t in s.input_ids)), s)
    out = []
    for t in TrainingData(training, hidden_size=hidden_size, max_samples=max_samples):
        ids = tuple(int(v) for v in np.asarray(t.input_ids))
        for (fp, sid), s in list(want.items()):
            if ids[fp:fp + len(sid)] == sid and len(sid):
                tr = t.load().to(torch.float32).numpy()[fp:fp + len(sid)]
                out.append({"key": s.key, "positions": fp + np.arange(len(sid)), "input_ids": np.array(sid),
                            "served": s.load().to(torch.float32).numpy(), "training": tr})
                del want[(fp, sid)]
                break
    return out


def per_token_rel_diff(pairs: Sequence[Mapping[str, Any]], hidden_size: int) -> pd.DataFrame:
    """Per token and chunk: rel_diff = |x-y|^2 / (|x|^2+|y|^2) of served chunk i vs training chunk i (what the
    draft's fc reads at that slot vs what it was trained on). Columns ``sample, position, token_id, chunk,
    rel_diff`` (rel_diff in [0, 2]; 0 = identical)."""
    frames = []
    H = int(hidden_size)
    for p in pairs:
        s, t = np.asarray(p["served"], np.float64), np.asarray(p["training"], np.float64)
        C = min(s.shape[1] // H, t.shape[1] // H)
        for c in range(C):
            x, y = s[:, c * H:(c + 1) * H], t[:, c * H:(c + 1) * H]
            den = (x * x).sum(1) + (y * y).sum(1)
            rd = np.where(den > 0, ((x - y) ** 2).sum(1) / np.where(den > 0, den, 1), 0.0)
            frames.append(pd.DataFrame({"sample": p["key"], "position": p["positions"],
                                        "token_id": p["input_ids"], "chunk": c, "rel_diff": rd}))
    if not frames:
        return pd.DataFrame(columns=["sample", "position", "token_id", "chunk", "rel_diff"])
    return pd.concat(frames, ignore_index=True)


def per_token_figure(df: pd.DataFrame, sample: Optional[str] = None, chunk: Optional[int] = None,
                     *, tolerance: Optional[float] = None):
    """rel_diff per token position (log y) for one sample, one line per chunk (or only ``chunk``)."""
    import plotly.graph_objects as go

    from .plots.acceptance import PALETTE

    fig = go.Figure()
    if len(df):
        sample = sample if sample is not None else df["sample"].iloc[0]
        d = df[df["sample"] == sample]
        for c in sorted(d["chunk"].unique()):
            if chunk not in (None, "all") and int(c) != int(chunk):
                continue
            g = d[d["chunk"] == c].sort_values("position")
            keep = downsample(len(g))
            g = g.iloc[keep]
            fig.add_trace(go.Scatter(x=g["position"], y=np.clip(g["rel_diff"], 1e-12, None),
                                     mode="lines+markers", name=f"chunk {c}", marker=dict(size=4),
                                     line=dict(color=PALETTE[int(c) % len(PALETTE)]),
                                     customdata=g["token_id"],
                                     hovertemplate=f"chunk {c}" + ", pos %{x} (token %{customdata}): "
                                                   "%{y:.2e}<extra></extra>"))
        if tolerance:
            fig.add_hline(y=tolerance, line=dict(color="#616161", dash="dash"),
                          annotation_text=f"tolerance {tolerance:.0e}")
    fig.update_layout(title=f"Per-token rel_diff, served chunk i vs training chunk i (sample {esc(sample)})",
                      xaxis_title="token position", yaxis_title="rel_diff (log)", template="plotly_white",
                      height=380, legend=dict(orientation="h", y=-0.25))
    fig.update_yaxes(type="log")
    return fig


def rel_diff_histograms(df: pd.DataFrame, *, bins: int = 40, tolerance: Optional[float] = None):
    """Histogram of log10(per-token rel_diff) per chunk on shared bins (one set of edges for all chunks, so
    the bars compare). Returns a plotly Figure."""
    import plotly.graph_objects as go

    from .plots.acceptance import PALETTE

    fig = go.Figure()
    if len(df):
        v = np.log10(np.clip(df["rel_diff"].to_numpy(float), 1e-12, None))
        edges = np.histogram_bin_edges(v, bins=bins, range=(min(v.min(), -12.0), max(v.max(), 0.5)))
        centers = (edges[:-1] + edges[1:]) / 2
        for c in sorted(df["chunk"].unique()):
            h, _ = np.histogram(v[df["chunk"].to_numpy() == c], bins=edges)
            fig.add_trace(go.Bar(x=centers, y=h, name=f"chunk {c}",
                                 marker_color=PALETTE[int(c) % len(PALETTE)]))
        if tolerance:
            fig.add_vline(x=math.log10(tolerance), line=dict(color="#616161", dash="dash"),
                          annotation_text="tolerance")
    fig.update_layout(title="Per-token rel_diff by chunk (shared bins)", barmode="group",
                      xaxis_title="log10 rel_diff (served chunk i vs training chunk i)",
                      yaxis_title="tokens", template="plotly_white", height=360,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def min_tolerance_frame(diag, per_token: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Per served chunk, the smallest tolerance that would have passed: against the same-index training
    chunk (what the draft reads) and against the best-matching one; plus the tolerance used. Columns
    ``chunk, tolerance used, min rel_diff tol (same slot), min max_abs tol (same slot), max per-token
    rel_diff (same slot), best training chunk, min rel_diff tol (best)``. The last row ("all") is the
    tolerance at which the whole served tensor would pass as wired."""
    c = diag.comparison
    if c is None:
        return pd.DataFrame()
    src = c.primary
    rows = []
    for i in range(src.pairs.ns):
        same = c.metrics(src, i, i) if i < src.pairs.nu else None
        j, best = c.best_match(src, i)
        tok = None
        if per_token is not None and len(per_token):
            sel = per_token[per_token["chunk"] == i]["rel_diff"]
            tok = float(sel.max()) if len(sel) else None
        rows.append({"chunk": str(i), "tolerance used": c.tolerance,
                     "min rel_diff tol (same slot)": None if same is None else same.min_tolerance["rel_diff"],
                     "min max_abs tol (same slot)": None if same is None else same.min_tolerance["max_abs"],
                     "max per-token rel_diff (same slot)": tok,
                     "best training chunk": c.training_units[j],
                     "min rel_diff tol (best)": best.min_tolerance["rel_diff"],
                     "passes now": "yes" if same is not None and same.passed else "no"})
    df = pd.DataFrame(rows)
    if len(df):
        allrow = {"chunk": "all", "tolerance used": c.tolerance,
                  "min rel_diff tol (same slot)": pd.to_numeric(df["min rel_diff tol (same slot)"]).max(),
                  "min max_abs tol (same slot)": pd.to_numeric(df["min max_abs tol (same slot)"]).max(),
                  "max per-token rel_diff (same slot)": pd.to_numeric(df["max per-token rel_diff (same slot)"]).max(),
                  "best training chunk": "", "min rel_diff tol (best)": pd.to_numeric(df["min rel_diff tol (best)"]).max(),
                  "passes now": "yes" if (df["passes now"] == "yes").all() else "no"}
        df = pd.concat([df, pd.DataFrame([allrow])], ignore_index=True)
    return df


# =============================================================================================
# 10-12 hypotheses
# =============================================================================================


def live_check(ctx: RunContext, check: str, *, capture_dir: Any = "", reference: str = "auto",
               label: str = "live", num_samples: int = 4) -> dict:
    """Run ``check`` (a name in :data:`helpers.investigation.checks.CHECKS`) on the live server and save its figure
    to ``figures/live-<check>.json``. Returns a step record like the replay's (``kind``, ``check``,
    ``verdict``, ``explanation``, ``evidence``, ``data``, ``figure``, ``question``, ``label``)."""
    from .investigation.checks import Investigation, run_check

    ref = "hf" if reference == "hf" or (reference == "auto" and _small_model(ctx.target_dir)) else (
        None if reference in ("", "auto", "none", None) else reference)
    client = connect(ctx)
    try:
        inv = Investigation(ctx.run_dir, client, training=ctx.training, draft_dir=ctx.draft_dir,
                            target_dir=ctx.target_dir, capture_dir=as_path(capture_dir), name="live",
                            num_samples=num_samples, reference=ref)
        res = run_check(check, inv, label=label)
    finally:
        client.close()
    d = res.to_dict()
    fig_rel = None
    if res.figure is not None:
        fig_rel = f"figures/live-{check}.json"
        (ctx.run_dir / "figures").mkdir(parents=True, exist_ok=True)
        from .runfiles import atomic_write_text

        atomic_write_text(ctx.run_dir / fig_rel, res.figure.to_json())
    return {"kind": "hypothesis", "index": 0, "check": check, "label": label, "question": res.question,
            "on_fix": "live server", "verdict": res.verdict, "expect": None, "as_expected": None,
            "explanation": res.explanation, "evidence": d["evidence"], "data": d["data"], "figure": fig_rel}


def hypothesis_result(nb: str, check: str, steps: Sequence[Mapping[str, Any]], source: str) -> dict:
    """The ``results/<nb>.json`` document of a hypothesis notebook."""
    return {"notebook": nb, "check": check, "source": source,
            "results": [{k: s.get(k) for k in ("index", "label", "question", "verdict", "expect", "as_expected",
                                                "explanation", "on_fix", "figure", "data")} for s in steps]}


def rank_dumps(run_dir: Path, key: str = "aux") -> dict[int, Path]:
    """``{rank: dump}`` of the per-rank dumps of stash ``key`` (``aux``, ``embedding``, ``embedding_local``)
    in the run folder (the first fix that captured them)."""
    out: dict[int, Path] = {}
    for p in dump_paths(run_dir):
        man = read_json_file(p / "manifest.json") or {}
        if man.get("kind") == "per_rank" and man.get("module") == key and man.get("tp_rank") is not None:
            out.setdefault(int(man["tp_rank"]), p)
    return dict(sorted(out.items()))


def rank_diff_figure(ranks: Mapping[int, Path], rank: int, hidden_size: int, *, sample: int = 0):
    """max |x(rank) - x(rank 0)| per token position and H-wide chunk, for one forward (sample) recorded on
    every rank. All zero = the ranks hold identical (all-reduced) values. Returns a plotly Figure."""
    import plotly.graph_objects as go
    import torch

    from .formats.dumps import read_dump
    from .plots.acceptance import PALETTE

    fig = go.Figure()
    if 0 in ranks and rank in ranks:
        a, b = read_dump(ranks[0]), read_dump(ranks[rank])
        bk = {s.key: s for s in b.samples}
        pairs = [(s, bk[s.key]) for s in a.samples if s.key in bk]
        if pairs:
            sa, sb = pairs[min(int(sample), len(pairs) - 1)]
            x, y = sa.load().to(torch.float32).numpy(), sb.load().to(torch.float32).numpy()
            n = min(len(x), len(y))
            d = np.abs(x[:n] - y[:n])
            H = int(hidden_size) if x.shape[1] % int(hidden_size) == 0 else x.shape[1]
            keep = downsample(n)
            for c in range(x.shape[1] // H):
                fig.add_trace(go.Scatter(x=sa.first_position + keep, y=d[keep, c * H:(c + 1) * H].max(1),
                                         mode="lines+markers", name=f"chunk {c}", marker=dict(size=4),
                                         line=dict(color=PALETTE[c % len(PALETTE)])))
    fig.update_layout(title=f"max |x(rank {int(rank)}) - x(rank 0)| per token", xaxis_title="token position",
                      yaxis_title="max |difference|", template="plotly_white", height=340,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def reference_bars(matrix: pd.DataFrame, chunk: int):
    """rel_diff of one served chunk against every reference tensor (log y): the lowest bar is the layer
    the chunk really holds. ``matrix``: :func:`rel_diff_matrix` ``against="reference"`` (or its dict form
    from ``results/03_compare.json``)."""
    import plotly.graph_objects as go

    m = matrix if isinstance(matrix, pd.DataFrame) else pd.DataFrame(matrix)
    fig = go.Figure()
    if len(m) and 0 <= int(chunk) < len(m):
        row = m.iloc[int(chunk)].astype(float)
        best = row.idxmin()
        fig.add_trace(go.Bar(x=[esc(c) for c in row.index], y=np.clip(row.to_numpy(), 1e-12, None),
                             marker_color=["#c62828" if c == best else "#90a4ae" for c in row.index],
                             hovertemplate="%{x}: rel_diff %{y:.2e}<extra></extra>"))
        fig.update_layout(title=f"Served chunk {int(chunk)} vs every target layer: it holds {esc(best)}")
    fig.update_yaxes(type="log", title_text="rel_diff (log)")
    fig.update_layout(template="plotly_white", height=340, xaxis_title="reference tensor")
    return fig


# =============================================================================================
# 20 acceptance
# =============================================================================================


def ledger_frame(run_dir: Path) -> pd.DataFrame:
    """The run folder's ``ledger.parquet`` (empty frame when absent)."""
    p = Path(run_dir) / "ledger.parquet"
    if not p.exists():
        return pd.DataFrame()
    from .acceptance.ledger import Ledger

    return Ledger(p).read()


def acceptance_table(ledger: pd.DataFrame) -> pd.DataFrame:
    """Ledger rows for reading: fix, accept length / rate / tok/s with 95% CIs, requests, num_steps, topk."""
    if ledger is None or ledger.empty:
        return pd.DataFrame()

    def ci(r, k, pct=False, nd=2):
        v, lo, hi = _num(r.get(k)), _num(r.get(k + "_lo")), _num(r.get(k + "_hi"))
        if not math.isfinite(v):
            return ""
        f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.{nd}f}")
        return f"{f(v)} [{f(lo)}, {f(hi)}]" if math.isfinite(lo) and math.isfinite(hi) else f(v)

    rows = []
    for _, r in ledger.iterrows():
        rows.append({"fix": r.get("fix"), "accept length [95% CI]": ci(r, "accept_length"),
                     "accept rate [95% CI]": ci(r, "accept_rate", pct=True),
                     "tok/s [95% CI]": ci(r, "tok_s", nd=1), "requests": r.get("n_requests"),
                     "num_steps": r.get("num_steps"), "topk": r.get("topk"),
                     "draft tokens": r.get("num_draft_tokens")})
    return pd.DataFrame(rows)


def main_fixes(ledger: pd.DataFrame) -> pd.DataFrame:
    """Ledger rows of the fixes themselves (sweep rows ``<fix> | num_steps=N`` left out)."""
    if ledger is None or ledger.empty or "fix" not in ledger.columns:
        return pd.DataFrame() if ledger is None else ledger
    return ledger[~ledger["fix"].astype(str).str.contains(r" \| num_steps=", regex=True)].reset_index(drop=True)


def sweep_rows(ledger: pd.DataFrame) -> pd.DataFrame:
    """Ledger rows of a num_steps sweep."""
    if ledger is None or ledger.empty or "fix" not in ledger.columns:
        return pd.DataFrame()
    return ledger[ledger["fix"].astype(str).str.contains(r" \| num_steps=", regex=True)].reset_index(drop=True)


def measure_live(ctx: RunContext, label: str, *, count: int = 24, max_new_tokens: int = 64,
                 concurrency: int = 4, prompts: Any = None) -> dict:
    """Measure acceptance on the live server, save ``acceptance/<label>/`` and append to the ledger.
    Returns the summary dict."""
    from .acceptance.prompts import load_prompts
    from .acceptance.measure import measure
    from .acceptance.ledger import Ledger
    from .runfiles import safe_name

    client = connect(ctx)
    try:
        res = measure(client, load_prompts(prompts or None, n=count), max_new_tokens=max_new_tokens,
                      concurrency=concurrency, ignore_eos=True, label=label, progress=False)
    finally:
        client.close()
    res.save(ctx.run_dir / "acceptance" / safe_name(label))
    Ledger(ctx.run_dir / "ledger.parquet").append([res.ledger_row(label)])
    return res.summary


# =============================================================================================
# 99 postmortem
# =============================================================================================


def suite_status(run_dir: Path) -> dict:
    """``suite_status.json`` of the run folder ({} when the notebooks run outside the suite)."""
    return read_json_file(Path(run_dir) / "suite_status.json") or {}


def failures_frame(status: Mapping[str, Any]) -> pd.DataFrame:
    """Failed notebooks: notebook, cell (execution count / index), error (``ename: evalue``)."""
    rows = []
    for nb, e in (status.get("notebooks") or {}).items():
        if e.get("ok"):
            continue
        cell = e.get("exec_count") if e.get("exec_count") is not None else e.get("cell_index")
        err = f"{e.get('ename')}: {e.get('evalue')}" if e.get("ename") else e.get("error", "")
        rows.append({"notebook": nb, "cell": "" if cell is None else cell, "error": str(err)[:1500],
                     "html": e.get("html") or ""})
    return pd.DataFrame(rows)


def failures_html(status: Mapping[str, Any]) -> str:
    """:func:`failures_frame` as an escaped table with links to each failed notebook's HTML."""
    df = failures_frame(status)
    if df.empty:
        return '<p>All notebooks before this one ran without error.</p>' if status.get("notebooks") else \
            note("No suite status (this notebook ran outside the suite runner).")
    rows = "".join(
        f"<tr><td>{_link(r['html'], r['notebook'])}</td><td>{esc(r['cell'])}</td>"
        f"<td><pre style=\"white-space:pre-wrap;margin:0\">{esc(r['error'])}</pre></td></tr>"
        for _, r in df.iterrows())
    return (f'<table class="e3f-table"><tr><th>notebook</th><th>cell</th><th>error</th></tr>{rows}</table>')


def _link(href: str, text: str) -> str:
    return f'<a href="{esc(href)}">{esc(text)}</a>' if href else esc(text)


def notebook_links_html(status: Mapping[str, Any], notebooks: Sequence[str] = ()) -> str:
    """Links to each notebook's HTML page (``html/<nb>.html``) with its status and wall time."""
    entries = status.get("notebooks") or {}
    names = list(entries) + [n for n in notebooks if n not in entries]
    items = []
    for nb in names:
        e = entries.get(nb, {})
        state = "ok" if e.get("ok") else ("FAILED" if e else "")
        href = e.get("html") or f"html/{nb}.html"
        wall = f", {e['wall_s']} s" if e.get("wall_s") is not None else ""
        items.append(f"<li>{_link(href, nb)} <span class=\"e3f-note\">{esc(state)}{esc(wall)}</span></li>")
    return "<ul>" + "".join(items) + "</ul>" if items else note("No notebooks recorded.")


def verdict_summary(run_dir: Path, doc: Optional[Mapping[str, Any]] = None) -> pd.DataFrame:
    """Every hypothesis verdict of the run: the replay's steps, then live results of the hypothesis
    notebooks (``results/1*_hyp_*.json`` with source ``live``). Columns: step, label, check, question,
    verdict, expected, as expected, source."""
    rows = []
    for _, r in hypotheses_frame(doc).iterrows():
        rows.append({"step": r["step"], "label": r["label"], "check": r["check"],
                     "question": r.get("question") or "", "verdict": r["verdict"],
                     "expected": r["expected"], "as expected": r["as expected"], "source": "replay"})
    for p in sorted((Path(run_dir) / "results").glob("1*_hyp_*.json")):
        res = read_json_file(p) or {}
        if res.get("source") != "live":
            continue
        for s in res.get("results", []):
            rows.append({"step": "", "label": s.get("label") or "", "check": res.get("check"),
                         "question": s.get("question") or "", "verdict": s.get("verdict"), "expected": "", "as expected": "",
                         "source": f"live ({p.stem})"})
    return pd.DataFrame(rows)


def before_after(doc: Optional[Mapping[str, Any]] = None, ledger: Optional[pd.DataFrame] = None) -> pd.DataFrame:
    """Accept rate / length / tok/s of the first fix (before) and the last fix (after) with 95% CIs, and
    whether the change is outside both CIs, and the paired CI of the change over the same prompts
    (the replay's ``fix_effect``, :func:`helpers.acceptance.stats.paired_effect`). From the replay (or, without one, the ledger's first and last
    main-fix rows). Empty with fewer than two fixes."""
    fx = fixes_frame(doc)
    if len(fx):
        fx = fx[~fx["baseline"] & (fx["error"] == "")]
    elif ledger is not None and len(main_fixes(ledger)):
        led = main_fixes(ledger)
        fx = pd.DataFrame({k: pd.to_numeric(led.get(k), errors="coerce") for k in
                           ("accept_length", "accept_length_lo", "accept_length_hi", "accept_rate",
                            "accept_rate_lo", "accept_rate_hi", "tok_s", "tok_s_lo", "tok_s_hi")})
        fx["fix"] = led["fix"].astype(str)
    if len(fx) < 2:
        return pd.DataFrame()
    a, b = fx.iloc[0], fx.iloc[-1]
    eff = (doc or {}).get("fix_effect") or {}
    rows = []
    for k, label, pct in (("accept_rate", "accept rate", True), ("accept_length", "accept length", False),
                          ("tok_s", "tok/s", False)):
        f = (lambda x: f"{100 * x:.1f}%") if pct else (lambda x: f"{x:.2f}")
        sep = ""
        if all(math.isfinite(_num(v)) for v in (a[k + "_lo"], a[k + "_hi"], b[k + "_lo"], b[k + "_hi"])):
            sep = "yes" if (b[k + "_lo"] > a[k + "_hi"] or b[k + "_hi"] < a[k + "_lo"]) else "no"
        paired = ""
        d, lo, hi = (_num(eff.get(f"{k}_delta{x}")) for x in ("", "_lo", "_hi"))
        if all(math.isfinite(v) for v in (d, lo, hi)):
            g = (lambda x: f"{100 * x:+.1f}") if pct else (lambda x: f"{x:+.2f}")
            paired = f"{g(d)} [{g(lo)}, {g(hi)}]{' points' if pct else ''} over {eff.get('n_paired')} prompts"
        elif k == "tok_s" and eff:
            paired = "n/a (wall-clock speed of two servers is not paired per prompt)"
        rows.append({"metric": label, f"before: {a['fix']}": _fmt_ci(a, k, f),
                     f"after: {b['fix']}": _fmt_ci(b, k, f),
                     "change": (f"{b[k] - a[k]:+.2f}" if not pct else f"{100 * (b[k] - a[k]):+.1f} points")
                     if math.isfinite(_num(a[k])) and math.isfinite(_num(b[k])) else "",
                     "outside both 95% CIs": sep,
                     "paired 95% CI of the change": paired})
    return pd.DataFrame(rows)


def _fmt_ci(r, k, f) -> str:
    v, lo, hi = _num(r[k]), _num(r[k + "_lo"]), _num(r[k + "_hi"])
    if not math.isfinite(v):
        return ""
    return f"{f(v)} [{f(lo)}, {f(hi)}]" if math.isfinite(lo) and math.isfinite(hi) else f(v)


def postmortem_record(run_dir: Path, doc: Optional[Mapping[str, Any]]) -> dict:
    """The postmortem's data (``results/99_postmortem.json``): headline, verdicts, before/after, failures."""
    return {"headline": headline(doc), "case": (doc or {}).get("case"),
            "verdicts": verdict_summary(run_dir, doc).to_dict(orient="records"),
            "before_after": before_after(doc, ledger_frame(run_dir)).to_dict(orient="records"),
            "fixes": fixes_frame(doc).to_dict(orient="records"),
            "failures": failures_frame(suite_status(run_dir)).to_dict(orient="records")}
