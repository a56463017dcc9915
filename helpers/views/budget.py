"""The acceptance budget as HTML parts (the investigation page and 20_acceptance): the sentence, one row per stage
with its accept length, CI and source, the losses by stage, the settings table and the fix proven offline."""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd

from ..plots.budget import budget_ladder, budget_waterfall, draft_steps
from .common import esc, table_html


def _ci(ci) -> str:
    if not ci or ci[0] is None or ci[1] is None:
        return ""
    lo, hi = (round(x, 2) + 0.0 for x in ci)          # no "-0.00"
    return f"[{lo:.2f}, {hi:.2f}]"


def stages_frame(budget: dict) -> pd.DataFrame:
    """One row per stage: name, accept length, 95 % CI, accept rate, where it comes from."""
    return pd.DataFrame([{"stage": s["name"], "accept length": None if s.get("accept_length") is None
                          else round(s["accept_length"], 2), "95% CI": _ci(s.get("ci")),
                          "accept rate": None if s.get("accept_rate") is None else f"{s['accept_rate']:.0%}",
                          "source": s.get("source", "")} for s in budget.get("stages") or []])


def losses_frame(budget: dict) -> pd.DataFrame:
    """One row per loss: stage, tokens per verify step lost, CI, whether it counts, on what basis."""
    return pd.DataFrame([{"stage": k, "lost (tokens / verify step)": None if v.get("delta") is None
                          else round(v["delta"], 2) + 0.0, "95% CI": _ci([None if x is None else x + 0.0
                                                                          for x in v.get("ci") or [None, None]]),
                          "material from": None if v.get("threshold") is None else round(v["threshold"], 2),
                          "decision": v.get("decision") or ("counts" if v.get("counts") else "n/a"),
                          "counts": "yes" if v.get("counts") else "no",
                          "what would settle it": (v.get("settle") or {}).get("text") or "",
                          "basis": v.get("basis", "")}
                         for k, v in (budget.get("losses") or {}).items()])


def budget_parts(budget: Optional[dict]) -> list[Any]:
    """HTML strings and plotly figures, in page order; one line when there is no budget."""
    if not budget:
        return ["<p>No acceptance budget in this run.</p>"]
    parts: list[Any] = [f"<p><b>{esc(budget.get('sentence', ''))}</b></p>", table_html(stages_frame(budget))]
    for fig in (budget_waterfall(budget), draft_steps(budget), budget_ladder(budget)):
        if fig is not None:
            parts.append(fig)
    parts.append("<h4>Losses by stage</h4>")
    parts.append(table_html(losses_frame(budget)))
    if budget.get("settings_table"):
        parts.append("<h4>Other settings, simulated on the same states</h4>")
        parts.append(table_html(pd.DataFrame([{"steps": t["steps"], "topk": t["topk"],
                                               "draft tokens": t["draft_tokens"],
                                               "accept length": round(t["accept_length"], 2),
                                               "95% CI": _ci(t.get("ci"))} for t in budget["settings_table"]])))
    fo = budget.get("fix_offline")
    if fo:
        gain = "" if fo.get("gain") is None else (f": {fo['gain']:+.2f} tokens per verify step over the served "
                                                  f"states {_ci(fo.get('gain_ci'))}")
        plan = f" (served plan [{', '.join(fo['plan'])}])" if fo.get("plan") else ""
        parts.append(f"<p>The fix, proven offline: {esc(fo['label'])}{esc(plan)} accepts "
                     f"{fo['accept_length']:.2f} {esc(_ci(fo.get('ci')))}{esc(gain)}.</p>")
    for n in budget.get("notes") or []:
        parts.append(f"<p class=\"e3f-note\">note: {esc(n)}</p>")
    if budget.get("missing"):
        parts.append("<p class=\"e3f-note\">missing: " + esc("; ".join(budget["missing"])) + "</p>")
    return parts
