"""Figures of the acceptance budget (:func:`helpers.draft.budget.acceptance_budget`).

* :func:`budget_waterfall`: accept length by stage in three like-with-like runs, each starting a new bar: the training
  log -> the checkpoint teacher-forced (the draft stage: the same metric and formula); the drafting chain offline on
  training states -> on served states (wiring); on the live prompts' served states -> live (engine); each bar with its
  95 % CI; the settings stage's recommended accept length last.
* :func:`budget_ladder`: P(accepted >= j) per draft position j, one line per stage (the per-position ladder).
* :func:`draft_steps`: the draft stage's per-step teacher-forced accuracy, the log's against the checkpoint's.
"""
from __future__ import annotations

from typing import Optional, Sequence

import plotly.graph_objects as go

from .acceptance import PALETTE

#: the stages in ladder order (the settings stage is drawn apart: it is another configuration)
ORDER = ("training log", "checkpoint (teacher-forced)", "offline on training states", "offline on served states",
         "offline on live prompts, training plan", "offline on live prompts' served states", "live")
#: stages that start a new run of bars: another quantity (a drafting chain, not a teacher-forced formula) or other
#: prompts or states, so the step from the bar before is not a loss (the wiring stage measured again on the live
#: prompts is its own run: its loss is in the wiring row's note)
NEW_RUN = ("offline on training states", "offline on live prompts, training plan",
           "offline on live prompts' served states")
#: the stage row each loss is measured at (the loss is the step from the row before it, within one run)
LOSS_AT = {"draft": "checkpoint (teacher-forced)", "wiring": "offline on served states", "engine": "live",
           "settings": "best settings (simulated)"}
#: what each run of like-with-like stages compares (the runs start at ORDER[0] and at each NEW_RUN stage)
RUNS = ("trainer's formula (teacher-forced)", "drafting chain, training tokens",
        "drafting chain, live prompts, training plan", "drafting chain, live prompts")


def run_of(name: str) -> Optional[str]:
    """The like-with-like run a stage belongs to (:data:`RUNS`); ``"other settings"`` for the settings stage, None
    for a stage not in :data:`ORDER`."""
    if name == LOSS_AT["settings"]:
        return "other settings"
    if name not in ORDER:
        return None
    return RUNS[sum(1 for n in NEW_RUN if ORDER.index(n) <= ORDER.index(name))]


def _stages(budget: dict, order: Sequence[str] = ORDER) -> list[dict]:
    by = {s["name"]: s for s in budget.get("stages") or [] if s.get("accept_length") is not None}
    return [by[n] for n in order if n in by]


def budget_waterfall(budget: dict, order: Sequence[str] = ORDER) -> Optional[go.Figure]:
    """Accept length by stage as a waterfall (tokens per verify step, bonus token included); None without stages.
    ``order``: the stages drawn, in ladder order (an MTP head's budget has stages of its own,
    :func:`helpers.views.draft_kind.draft_kind`)."""
    st = _stages(budget, order)
    if not st:
        return None
    names = [s["name"] for s in st]
    vals = [s["accept_length"] for s in st]
    # another quantity or another prompt set is not a loss: such a stage starts a new bar (a total), not a step down
    measure = ["absolute" if i == 0 or n in NEW_RUN else "relative" for i, n in enumerate(names)]
    deltas = [v if m == "absolute" else v - vals[i - 1] for i, (v, m) in enumerate(zip(vals, measure))]
    text = [f"{v:.2f}" for v in vals]
    fig = go.Figure(go.Waterfall(x=names, y=deltas, measure=measure, text=text, textposition="outside",
                                 decreasing={"marker": {"color": "#c62828"}},
                                 increasing={"marker": {"color": "#2e7d32"}},
                                 totals={"marker": {"color": "#1f77b4"}}, connector={"line": {"color": "#9e9e9e"}},
                                 name="accept length"))
    lo = [s["accept_length"] - s["ci"][0] if s.get("ci") and s["ci"][0] is not None else 0 for s in st]
    hi = [s["ci"][1] - s["accept_length"] if s.get("ci") and s["ci"][1] is not None else 0 for s in st]
    fig.add_trace(go.Scatter(x=names, y=vals, mode="markers", marker={"color": "#212121", "size": 6},
                             error_y={"type": "data", "symmetric": False, "array": hi, "arrayminus": lo},
                             name="95% CI", hovertemplate="%{x}: %{y:.2f}<extra></extra>"))
    settings = next((s for s in budget.get("stages") or [] if s["name"] == "best settings (simulated)"), None)
    if settings is not None and settings.get("accept_length") is not None:
        r = settings.get("settings") or {}
        fig.add_trace(go.Scatter(x=[f"steps {r.get('steps')} (simulated)"], y=[settings["accept_length"]],
                                 mode="markers", marker={"symbol": "diamond", "size": 11, "color": "#ff7f0e"},
                                 name="recommended settings"))
    top = max(vals + [settings["accept_length"] if settings and settings.get("accept_length") else 0])
    fig.update_layout(title=f"Where the accept length goes (cause: {budget.get('cause')})", height=380,
                      yaxis={"title": "accept length (tokens per verify step)", "range": [0, top * 1.2],
                             "dtick": 0.5}, margin={"l": 60, "r": 20, "t": 60, "b": 90}, showlegend=True,
                      legend={"orientation": "h", "y": -0.3})
    return fig


def budget_ladder(budget: dict, order: Sequence[str] = ORDER) -> Optional[go.Figure]:
    """P(accepted >= j) per draft position, one line per stage (``order`` as :func:`budget_waterfall`'s); None when
    no stage has per-position figures."""
    st = [s for s in _stages(budget, order) if s.get("p_accept_ge")]
    if not st:
        return None
    fig = go.Figure()
    for i, s in enumerate(st):
        p = s["p_accept_ge"]
        fig.add_trace(go.Scatter(x=list(range(1, len(p) + 1)), y=p, mode="lines+markers", name=s["name"],
                                 line={"color": PALETTE[i % len(PALETTE)],
                                       "dash": "dash" if s["name"] == "training log" else "solid"}))
    fig.update_layout(title="P(accepted >= j) per draft position, by stage", height=340,
                      xaxis={"title": "draft position j", "dtick": 1}, yaxis={"title": "P(accepted >= j)",
                                                                               "range": [0, 1], "dtick": 0.2},
                      margin={"l": 60, "r": 20, "t": 50, "b": 40})
    return fig


def draft_steps(budget: dict) -> Optional[go.Figure]:
    """The draft stage's teacher-forced accuracy per TTT step: the training log's and the checkpoint's (95 % CI), on
    rows of the log's kind; None when the stage has no table."""
    ds = next((s for s in budget.get("stages") or [] if s["name"] == "checkpoint (teacher-forced)"), None)
    table = (ds or {}).get("table")
    if not table:
        return None
    x = [f"step {r['step']}" for r in table]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=[r["log_acc"] for r in table], name="training log", marker={"color": "#9e9e9e"}))
    acc = [r["acc"] for r in table]
    fig.add_trace(go.Bar(x=x, y=acc, name="checkpoint, teacher-forced", marker={"color": PALETTE[0]},
                         error_y={"type": "data", "symmetric": False,
                                  "array": [r["acc_ci"][1] - r["acc"] for r in table],
                                  "arrayminus": [r["acc"] - r["acc_ci"][0] for r in table]}))
    comp = "" if ds.get("comparable", True) else " (rows NOT of the log's kind: not compared)"
    fig.update_layout(barmode="group", height=320, title=f"Draft stage: {ds.get('metric', 'accuracy')} per TTT step"
                      + comp, yaxis={"title": "accuracy", "range": [0, 1]}, margin={"l": 60, "r": 20, "t": 50, "b": 40})
    return fig
