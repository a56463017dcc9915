"""The ablation page (``21_ablate``): the workload sweeps and engine toggles of the run folder
(``results/ablate.json``, written by ``python -m helpers ablate``, by the investigation's sweep step, or by this page
against a live server), as findings, one figure and table per sweep, the toggles with their paired CIs, and what was
skipped and why."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import pandas as pd

from ..acceptance.ablations import flag_text
from ..acceptance.stats import format_ci
from ..acceptance.sweeps import SWEEPS
from ..investigation.ablate import ablate
from ..plots.sweeps import sweep_figure
from .common import RunContext, engine_label, esc, findings_frame, read_json_or_none, table_html


def results_path(run_dir: Path) -> Path:
    """``<run>/results/ablate.json``."""
    return Path(run_dir) / "results" / "ablate.json"


def load_ablation(run_dir: Path) -> Optional[dict]:
    """The run folder's ablation document, or None when it has none."""
    return read_json_or_none(results_path(run_dir))


def run_live(ctx: RunContext, *, sweeps: Sequence[str] = SWEEPS, toggles: Optional[Sequence[str]] = (),
             budget_s: float = 120.0, num_prompts: int = 10, max_new_tokens: int = 32, temperature: float = 1.0
             ) -> dict:
    """Run :func:`helpers.investigation.ablate.ablate` against the page's live server into its run folder.

    Raises:
        helpers.errors.BadInput: the run folder is a finished run the user did not name, or holds ablation results
            already (before any request: nothing is overwritten)."""
    ctx.require_writable("running ablations")
    return ablate(ctx.server_url, run_dir=ctx.run_dir, sweeps=list(sweeps), toggles=toggles, budget_s=budget_s,
                  num_prompts=num_prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                  api_key=ctx.api_key, progress=print)


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def points_frame(sweep: dict) -> pd.DataFrame:
    """One row per point: label, accept length / rate and tok/s with CIs, the paired change against the reference
    point, or why it was skipped."""
    rows = []
    for p in sweep.get("points") or []:
        s, e = p.get("summary") or {}, p.get("effect") or {}
        rows.append({"point": p["label"], "accept length [95% CI]": format_ci(s, "accept_length", missing="n/a"),
                     "accept rate": "n/a" if s.get("accept_rate") is None else f"{s['accept_rate']:.0%}",
                     "tok/s per request": format_ci(s, "tok_s", digits=1, missing="n/a"),
                     "tok/s all requests": "n/a" if s.get("throughput_tok_s") is None
                     else f"{s['throughput_tok_s']:.1f}",
                     "paired change vs reference": "reference" if not e and not p.get("skipped") else
                     format_ci(e, "accept_length_delta", signed=True),
                     "skipped": p.get("skipped") or ""})
    return pd.DataFrame(rows)


def toggles_frame(doc: dict) -> pd.DataFrame:
    """One row per toggle: flags, status (measured / skipped / failed) with the reason, the paired change, the
    report it comes from."""
    rows = []
    for r in doc.get("toggles") or []:
        flags = flag_text(r.get("flags") or {}) or \
            ("(no draft)" if not r.get("speculative", True) else "")
        e = r.get("effect") or {}
        if r["status"] == "measured" and e:
            change = format_ci(e, "accept_length_delta", signed=True)
        elif r["status"] == "measured":
            change = f"tok/s {r['before']['tok_s']:.1f} with the draft, {r['after']['tok_s']:.1f} without"
        else:
            change = ""
        rows.append({"toggle": r["name"], "flags": flags, "status": r["status"], "reason": r.get("reason", ""),
                     "accept length change [95% CI]": change, "report": r.get("report", "")})
    return pd.DataFrame(rows)


def ablation_parts(doc: Optional[dict]) -> list[Any]:
    """HTML strings and plotly figures in page order; one line when the run folder has no ablation."""
    if not doc:
        return ["<p>No ablation in this run folder (run <code>python -m helpers ablate --url URL</code>, or this page "
                "with <code>server_url</code> set).</p>"]
    secs = {k: f"{doc[k]:.0f}" if _num(doc.get(k)) else "?" for k in ("wall_s", "budget_s")}
    parts: list[Any] = [f"<p>{esc(doc.get('url', ''))}: {esc(engine_label(doc.get('engine')))} "
                        f"{esc(doc.get('engine_version') or doc.get('sglang_version'))} on "
                        f"{esc(doc.get('device'))}, {esc(doc.get('prompts'))} prompts x "
                        f"{esc(doc.get('max_new_tokens'))} tokens per point, {secs['wall_s']} s of a "
                        f"{secs['budget_s']} s budget.</p>"]
    if doc.get("stopped"):
        parts.append(f"<p class=\"e3f-note\"><b>cut short</b> ({esc(doc['stopped'])}): what was measured before is "
                     f"shown; what did not run is listed under skipped.</p>")
    if doc.get("findings"):
        parts.append(table_html(findings_frame(doc["findings"])))
    else:
        parts.append("<p>No sweep or toggle shows a CI-supported loss of acceptance.</p>")
    lim = doc.get("limits") or {}
    for name, sw in (doc.get("sweeps") or {}).items():
        parts.append(f"<h4>{esc(name)} sweep</h4>")
        fig = sweep_figure(name, sw, lim)
        if fig is not None:
            parts.append(fig)
        parts.append(table_html(points_frame(sw)))
    if doc.get("toggles"):
        parts.append("<h4>Engine toggles (a restarted copy vs the unchanged server, same prompts)</h4>")
        parts.append(table_html(toggles_frame(doc)))
    if doc.get("skipped"):
        parts.append("<p class=\"e3f-note\">skipped: " + esc("; ".join(doc["skipped"])) + "</p>")
    return parts
