"""The live page of ``watch`` (``30_watch``): a watch run folder's ``watch.jsonl`` read as it grows
(:func:`helpers.acceptance.watch.iter_log`: a torn last line skipped), drawn as plotly figures -- accept length over
time with the detector's latest change point and its CI band, the probe's, the drops; the covariates (KV-cache use,
cache hit rate, running requests, the watch's own load) -- and a summary. :func:`live` draws them once and adds a
Refresh button that redraws them in place (or re-run the cell).

Shapes: :func:`load` returns a :class:`WatchData` whose ``samples`` is a DataFrame, one row per sample: ``i`` (int),
``time`` (datetime64, UTC), ``accept_length`` / ``probe_accept_length`` (tokens per verify step, float, NaN when not
measured), ``accept_length_source`` (str), ``uptime_s`` (s), ``kv_cache_use`` / ``cache_hit_rate`` /
``probe_token_share`` / ``probe_time_share`` (0-1), ``running_reqs`` (requests).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ipywidgets as W
import pandas as pd
import plotly.graph_objects as go
from IPython.display import HTML, display
from plotly.subplots import make_subplots

from ..acceptance.decay import ALPHA
from ..acceptance.watch import LOG_NAME, iter_log
from ..errors import BadInput
from ..paths import outputs_dir
from .common import as_path, displayable, esc, note, table_html

COLUMNS = ("i", "time", "accept_length", "probe_accept_length", "accept_length_source", "uptime_s", "kv_cache_use",
           "cache_hit_rate", "running_reqs", "probe_token_share", "probe_time_share")


@dataclass
class WatchData:
    """One watch run as read: ``samples`` (module docstring), ``last_change``: the change point shown, the newest
    sample's when significant, else the last drop's, else the newest sample's (the detector's dict: ``i``, ``t``,
    ``t_ci``, ``before``, ``after``, ``effect``, ``effect_ci``, ``p_value``,
    ``moves_with``, ``shape``), the ``drops`` and ``investigations`` records, the lifecycle ``events`` and the
    ``checks`` they started (``check_draft`` lines), the ``starts``, the ``errors`` count,
    the lines ``skipped`` (torn or not JSON) and the ``stop`` record (None while it runs)."""

    run_dir: Path
    samples: pd.DataFrame
    last_change: Optional[dict] = None
    last_decision: Optional[dict] = None
    drops: list = field(default_factory=list)
    investigations: list = field(default_factory=list)
    events: list = field(default_factory=list)
    checks: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    errors: int = 0
    skipped: int = 0
    stop: Optional[dict] = None


def newest_watch_run(outputs: Optional[Path] = None) -> Optional[Path]:
    """The newest folder under ``outputs`` (default outputs/) holding a ``watch.jsonl``, by its stamped name."""
    out = Path(outputs) if outputs is not None else outputs_dir()
    runs = sorted((p for p in out.iterdir() if (p / LOG_NAME).is_file()), key=lambda p: p.name) if out.is_dir() \
        else []
    return runs[-1] if runs else None


def resolve(run_dir: Any, repo_root: Any = "") -> Path:
    """The watch run folder the page shows: ``run_dir`` when given (relative to ``repo_root``, default this
    checkout), else the newest one.

    Raises:
        BadInput: a folder without ``watch.jsonl``, or none under outputs/."""
    base = as_path(repo_root) if repo_root else None
    p = (as_path(run_dir, base) if base is not None else as_path(run_dir)) if run_dir else newest_watch_run()
    if p is None:
        raise BadInput("no watch run folder under outputs/: start `python -m helpers watch --url URL` first",
                       field="run_dir")
    if not (p / LOG_NAME).is_file():
        raise BadInput(f"no {LOG_NAME} in this folder: give a watch run folder", path=p, field="run_dir")
    return p


def load(run_dir: Any, repo_root: Any = "") -> WatchData:
    """Read a watch run folder (module docstring; :func:`resolve` picks it)."""
    p = resolve(run_dir, repo_root)
    rows, skipped = [], []
    data = WatchData(p, pd.DataFrame())
    for rec in iter_log(p / LOG_NAME, skipped):
        k = rec.get("kind")
        if k == "sample":
            probe, loadr = rec.get("probe") or {}, rec.get("load") or {}
            rows.append({"i": rec.get("i"), "time": rec.get("t"), "accept_length": rec.get("accept_length"),
                         "probe_accept_length": probe.get("accept_length"),
                         "accept_length_source": rec.get("accept_length_source"), "uptime_s": rec.get("uptime_s"),
                         "kv_cache_use": rec.get("kv_cache_use"), "cache_hit_rate": rec.get("cache_hit_rate"),
                         "running_reqs": rec.get("running_reqs"),
                         "probe_token_share": loadr.get("probe_token_share"),
                         "probe_time_share": loadr.get("probe_time_share")})
            if rec.get("change"):
                data.last_change, data.last_decision = rec["change"], rec.get("decision")
        elif k == "drop":
            data.drops.append(rec)
        elif k == "investigation":
            data.investigations.append(rec)
        elif k == "event":
            data.events.append(rec)
        elif k == "check_draft":
            data.checks.append(rec)
        elif k == "start":
            data.starts.append(rec)
            data.stop = None
        elif k == "error":
            data.errors += 1
        elif k == "stop":
            data.stop = rec
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    df["time"] = pd.to_datetime(df["time"], unit="s", utc=True)
    for c in COLUMNS:
        if c not in ("i", "time", "accept_length_source"):
            df[c] = pd.to_numeric(df[c], errors="coerce")
    data.samples, data.skipped = df, len(skipped)
    # the change the page shows: the newest sample's when it is significant, else the last drop's (after a drop the
    # detector's window restarts at the change, so its newest change point is of the new level)
    newest = data.last_change
    if data.drops and not (newest and newest.get("p_value", 1) <= ALPHA
                           and (newest.get("t") or 0) > (data.drops[-1]["change"].get("t") or 0)):
        data.last_change = data.drops[-1]["change"]
        data.last_decision = {**(data.drops[-1].get("decision") or {}), "reason": (data.drops[-1].get("decision")
                                                                                  or {}).get("reason")}
    return data


def _ts(t: Any) -> Optional[pd.Timestamp]:
    return None if t is None else pd.to_datetime(float(t), unit="s", utc=True)


def accept_length_figure(data: WatchData) -> go.Figure:
    """Accept length per interval (markers by source) and the probe's, the detector's latest change point with its
    CI band (shaded: the location's interval; dashed: the two segment means), each triggered drop marked."""
    df = data.samples
    fig = go.Figure()
    for src, part in df.groupby(df["accept_length_source"].fillna("none")):
        fig.add_trace(go.Scatter(x=part["time"], y=part["accept_length"], mode="lines+markers", name=f"accept "
                                 f"length ({src})", line={"width": 1}, marker={"size": 5}))
    fig.add_trace(go.Scatter(x=df["time"], y=df["probe_accept_length"], mode="markers", name="probe",
                             marker={"size": 4, "symbol": "x", "color": "#888"}))
    ch = data.last_change
    if ch:
        lo, hi = (_ts(t) for t in ch.get("t_ci") or [ch.get("t"), ch.get("t")])
        at = _ts(ch.get("t"))
        fig.add_vrect(x0=lo, x1=hi, fillcolor="#d62728", opacity=0.15, line_width=0,
                      annotation_text=f"change p {ch.get('p_value', 1):.3g}", annotation_position="top left")
        fig.add_vline(x=at, line={"color": "#d62728", "dash": "dot"})
        first, last = df["time"].min(), df["time"].max()
        if "before" in ch and "after" in ch:
            fig.add_trace(go.Scatter(x=[first, at], y=[ch["before"]] * 2, mode="lines", name="mean before",
                                     line={"dash": "dash", "color": "#1f77b4"}))
            e = ch.get("effect_ci") or [None, None]
            fig.add_trace(go.Scatter(x=[at, last], y=[ch["after"]] * 2, mode="lines", line={"dash": "dash",
                                     "color": "#d62728"}, name=f"mean after (effect {ch['effect']:+.2f}, CI "
                                     f"[{e[0]:+.2f}, {e[1]:+.2f}])" if e[0] is not None else "mean after"))
    for d in data.drops:
        fig.add_vline(x=_ts(d.get("t")), line={"color": "black", "width": 2},
                      annotation_text=f"drop #{d.get('n')}", annotation_position="bottom right")
    fig.update_layout(title="Accept length over time (tokens per verify step, bonus included)", height=420,
                      xaxis_title="time (UTC)", yaxis_title="accept length", legend={"orientation": "h", "y": -0.25})
    return fig


def covariates_figure(data: WatchData) -> go.Figure:
    """KV-cache use and cache hit rate (0-1), running requests, and the watch's own load (the probe's share of the
    server's tokens and of the interval), on one time axis."""
    df = data.samples
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=("KV-cache use and cache hit rate", "running requests",
                                        "the watch's own load (probe / server tokens, probe / interval seconds)"))
    fig.add_trace(go.Scatter(x=df["time"], y=df["kv_cache_use"], name="KV-cache use"), 1, 1)
    fig.add_trace(go.Scatter(x=df["time"], y=df["cache_hit_rate"], name="cache hit rate"), 1, 1)
    fig.add_trace(go.Scatter(x=df["time"], y=df["running_reqs"], name="running requests"), 2, 1)
    fig.add_trace(go.Scatter(x=df["time"], y=df["probe_token_share"], name="probe token share"), 3, 1)
    fig.add_trace(go.Scatter(x=df["time"], y=df["probe_time_share"], name="probe time share"), 3, 1)
    if data.last_change:
        for row in (1, 2, 3):
            fig.add_vline(x=_ts(data.last_change.get("t")), line={"color": "#d62728", "dash": "dot"}, row=row, col=1)
    fig.update_yaxes(tickformat=".0%", row=1, col=1)
    fig.update_yaxes(tickformat=".2%", row=3, col=1)
    fig.update_layout(height=620, title="Covariates", legend={"orientation": "h", "y": -0.12})
    return fig


def _span(d: Any) -> str:
    """A watch's span as ``1h02m03s`` / ``49.9 s`` (a pandas Timedelta printed itself as ``0 days 00:00:49.958``)."""
    sec = float(pd.Timedelta(d).total_seconds())
    if sec < 60:
        return f"{sec:.1f} s"
    h, rest = divmod(int(round(sec)), 3600)
    return f"{h}h{rest // 60:02d}m{rest % 60:02d}s"


def summary_html(data: WatchData) -> str:
    """One table: samples and span, the baseline and the latest level, the latest change point with its CIs, what
    moves with it, drops and investigations, the watch's load, skipped lines."""
    df = data.samples
    ch, dec = data.last_change or {}, data.last_decision or {}
    start = data.starts[0] if data.starts else {}
    share = df["probe_token_share"].median() if len(df) else None
    rows = [("server", f"{start.get('url', '?')} ({start.get('engine', '?')} {start.get('engine_version') or ''})"),
            ("samples", f"{len(df)} over {_span(df['time'].max() - df['time'].min()) if len(df) > 1 else '-'}"
                        + (" (stopped: " + str(data.stop.get("reason")) + ")" if data.stop else " (running)")),
            ("accept length now", f"{df['accept_length'].dropna().iloc[-1]:.3f}" if df["accept_length"].notna().any()
             else "-"),
            ("baseline", f"{dec.get('baseline'):.3f}" if dec.get("baseline") is not None else "-"),
            ("latest change point", (f"sample #{ch.get('i')} (CI #{ch['i_ci'][0]}-#{ch['i_ci'][1]}): "
                                     f"{ch['before']:.3f} -> {ch['after']:.3f}, effect {ch['effect']:+.3f} "
                                     f"[{ch['effect_ci'][0]:+.3f}, {ch['effect_ci'][1]:+.3f}], p {ch['p_value']:.3g}")
             if ch else "-"),
            ("moves with it", (", ".join(f"{k} (r {ch['covariates'][k]['r']:+.2f})" for k in ch.get("moves_with", []))
                               or "no covariate") + (f"; shape: {ch['shape']}" if ch.get("shape") else "")
             if ch else "-"),
            ("decision", dec.get("reason") or "-"),
            ("drops", str(len(data.drops))),
            ("investigations", "; ".join(f"#{r.get('n')}: {r.get('verdict') or r.get('error') or '?'} "
                                         f"({r.get('run_dir') or ''})" for r in data.investigations) or "-"),
            ("lifecycle events", "; ".join(
                f"#{e.get('i')}: {', '.join(x.get('event', '?') for x in e.get('events') or [])}"
                + next((f" -> check-draft {c.get('verdict') or c.get('error') or '?'} ({c.get('run_dir') or ''})"
                        for c in data.checks if c.get("n") == e.get("n")), "") for e in data.events) or "-"),
            ("load on the server", f"probe {100 * share:.3f} % of its generated tokens (median)" if share is not None
             and share == share else "-"),
            ("lines skipped", f"{data.skipped} (torn or not JSON)"), ("failed samples", str(data.errors))]
    return table_html(pd.DataFrame(rows, columns=["", "value"]), verdict_cols=())


def parts(data: WatchData) -> list:
    """What the page shows, in order: the summary, the accept-length figure, the covariates figure (a note and two
    empty places while there is no sample yet, so a refresh fills them)."""
    if data.samples.empty:
        return [note(f"{esc(str(data.run_dir))}: no sample yet"), "", ""]
    return [summary_html(data), accept_length_figure(data), covariates_figure(data)]


def live(run_dir: Any, repo_root: Any = "") -> WatchData:
    """Draw the page once and a Refresh button that re-reads the log and redraws it in place (JupyterLab); in an
    exported page the drawn state stays. Returns what it read."""
    data = load(run_dir, repo_root)
    shown = [display(displayable(x), display_id=True) for x in parts(data)]
    button = W.Button(description="Refresh", icon="refresh")
    status = W.HTML(note(f"{esc(str(data.run_dir))}: {len(data.samples)} sample(s) read"))

    def refresh(_b=None):
        new = load(data.run_dir)
        for handle, x in zip(shown, parts(new)):
            if handle is not None:
                handle.update(HTML(""))       # JupyterLab's plotly renderer ignores a same-type update otherwise
                handle.update(displayable(x))
        status.value = note(f"{esc(str(new.run_dir))}: {len(new.samples)} sample(s) read")

    button.on_click(refresh)
    display(W.HBox([button, status]))
    return data
