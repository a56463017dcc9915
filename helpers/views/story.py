"""The first screen of the postmortem and of the investigation page: one story.

* one headline in three parts (what is wrong, the fix, its measured effect), each with its source
  (:func:`helpers.investigation.story.headline_parts`; a replay's: :func:`helpers.investigation.replay.headline_parts`);
* one before / after table with 95 % CIs (accept rate, accept length, tok/s) of the fix's measurement;
* the acceptance budget's ladder as a table (:func:`helpers.views.budget.ladder_frame`) with the settings line;
* every figure that does not fit the story, flagged with why, computed from the run's own data: tok/s moving
  against the accept length (:func:`helpers.acceptance.machine.speed_change`: the machine's load recorded around each
  measurement), a stage that gains instead of losing (:func:`helpers.draft.budget.gains`), a stage's offline estimate
  whose CI misses the measured loss, a recommended setting the sweep measured otherwise.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional

import pandas as pd

from ..acceptance.machine import speed_change
from ..acceptance.stats import format_ci
from ..draft.budget import gains
from ..errors import BadInput
from ..formats.configs import describe_architecture
from ..investigation import replay as replay_run
from ..investigation.story import headline_parts, named_text, naming_seconds, verdict_words
from ..paths import ROOT
from ..records import InvestigationDoc
from ..runfiles import read_parquet
from .budget import ladder_frame, settings_text
from .common import case_models, engine_label, esc, headline_box, read_json_or_none, result_path, table_html
from .draft_kind import draft_kind
from .replay import as_replay

METRICS = (("accept_rate", "accept rate", True), ("accept_length", "accept length", False), ("tok_s", "tok/s", False))


def story_parts(doc: Any, inv: Optional[InvestigationDoc]) -> list[dict]:
    """The headline's parts (``{"label", "text", "source"}``) of a run folder: the replay's when there is one (its
    investigation step timed by the step's wall clock, as the console printed it), else the investigation's."""
    d = as_replay(doc)
    if d is not None and d.steps:
        return replay_run.headline_parts(list(d.steps), d.fix_effect, inv)
    if inv is not None:
        secs, out = naming_seconds(inv)
        return headline_parts(inv, named=named_text(secs, inv.seconds_to_verdict, left_out=out,
                                                    verdict=verdict_words(inv)))
    return []


def _num(x: Any) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def measured_pair(run_dir: Optional[Path], doc: Any = None, inv: Optional[InvestigationDoc] = None,
                  ledger: Optional[pd.DataFrame] = None) -> Optional[dict]:
    """The fix's before / after: ``{"labels": [before, after], "before": summary, "after": summary, "effect":
    paired change or {}, "speed": speed_change(...) or None, "source"}``; None with fewer than two measurements.

    The investigation's measurement of its proposed fix first (a replay records it there once its step has measured
    the fix, :meth:`helpers.investigation.replay.Replay.tell_measured_fix`), else the replay's first and last fixes,
    else the first and last rows of ``ledger`` (the ledger's fixes without sweep rows:
    :func:`helpers.views.acceptance.main_fixes`; no paired change). The speed check is computed from the run folder's
    ``per_request.parquet`` files and the summaries' recorded load (a run from before the load was recorded: without
    it), else the recorded one."""
    m = (inv.measured or {}) if inv is not None else {}
    if m.get("before") and m.get("after"):
        labels = m.get("labels") or ["before (as served)", "after (proposed fix)"]
        return {"labels": labels, "before": m["before"], "after": m["after"], "effect": m.get("effect") or {},
                "speed": _speed_from_files(run_dir, m.get("saved_to"), m["before"], m["after"]) or m.get("speed"),
                "source": m.get("measured_by") or "the investigation's before / after"}
    d = as_replay(doc)
    fixes = [s for s in (d.of_kind("fix") if d else []) if not s.baseline and s.summary and not
             (s.error or s.server_error)]
    if len(fixes) >= 2:
        a, b = fixes[0], fixes[-1]
        eff = {k: v for k, v in (d.fix_effect or {}).items() if k not in ("before", "after", "speed", "error")}
        speed = _speed_from_files(run_dir, [a.acceptance_dir, b.acceptance_dir], a.summary, b.summary) or \
            (d.fix_effect or {}).get("speed")
        return {"labels": [a.name, b.name], "before": a.summary, "after": b.summary, "effect": eff, "speed": speed,
                "source": f"this replay's step {b.index + 1} against step {a.index + 1}"}
    if ledger is not None and len(ledger) >= 2 and "fix" in ledger.columns:
        a, b = ledger.iloc[0].to_dict(), ledger.iloc[-1].to_dict()
        return {"labels": [str(a["fix"]), str(b["fix"])], "before": a, "after": b, "effect": {}, "speed": None,
                "source": "the ledger's first and last fixes"}
    return None


def _speed_from_files(run_dir: Optional[Path], saved: Any, a: Mapping, b: Mapping) -> Optional[dict]:
    if run_dir is None or not saved or len(saved) < 2 or not all(saved):
        return None
    try:
        frames = [read_parquet(Path(run_dir) / s / "per_request.parquet") for s in saved[:2]]
    except (OSError, ValueError):
        return None
    return speed_change(a, b, *frames, local=True)


def before_after_frame(pair: Optional[dict]) -> pd.DataFrame:
    """One row per metric (accept rate, accept length, tok/s): before and after with 95 % CIs, the change with its
    paired 95 % CI over the same prompts, whether the change lies outside both CIs, and a note where the figure does
    not fit the story (tok/s against the accept length). Empty without a pair."""
    if not pair:
        return pd.DataFrame()
    a, b, eff, speed = pair["before"], pair["after"], pair.get("effect") or {}, pair.get("speed") or {}
    rows = []
    for k, label, pct in METRICS:
        sep = ""
        bounds = [_num(x.get(k + s)) for x in (a, b) for s in ("_lo", "_hi")]
        if all(math.isfinite(v) for v in bounds):
            sep = "yes" if (bounds[2] > bounds[1] or bounds[3] < bounds[0]) else "no"
        paired = ""
        if all(math.isfinite(_num(eff.get(f"{k}_delta{x}"))) for x in ("", "_lo", "_hi")):
            paired = (format_ci(eff, f"{k}_delta", pct=pct, signed=True, unit="")
                      + f"{' points' if pct else ''} ({eff.get('n_paired')} prompts)")
        elif k == "tok_s" and math.isfinite(_num(a.get(k))) and math.isfinite(_num(b.get(k))):
            paired = f"{_num(b.get(k)) - _num(a.get(k)):+.1f} (wall clock of two servers: not paired)"
        va, vb = _num(a.get(k)), _num(b.get(k))
        change = ((f"{vb - va:+.2f}" if not pct else f"{100 * (vb - va):+.1f} points")
                  if math.isfinite(va) and math.isfinite(vb) else "")
        note = ""
        if k == "tok_s" and speed.get("contradicts"):
            note = ("moves against the accept length: "
                    + ("the machine's load explains it" if speed.get("explained") else "not attributable to the fix")
                    + " (see the flags below)")
        elif k == "tok_s" and speed.get("lags"):
            note = "does not follow the accept length (see the flags below)"
        digits = 1 if k == "tok_s" else 2
        rows.append({"metric": label, f"before: {pair['labels'][0]}": format_ci(a, k, pct=pct, digits=digits),
                     f"after: {pair['labels'][1]}": format_ci(b, k, pct=pct, digits=digits),
                     "change (paired 95% CI)": paired or change, "outside both 95% CIs": sep, "note": note})
    return pd.DataFrame(rows)


def _disjoint(a: Any, b: Any) -> bool:
    if not a or not b or None in list(a)[:2] or None in list(b)[:2]:
        return False
    return a[0] > b[1] or b[0] > a[1]


def flags(pair: Optional[dict], budget: Optional[dict], doc: Any = None) -> list[dict]:
    """Every figure of the first screen that does not fit the story, each ``{"figure", "text"}`` (the text computed
    from the run's data): tok/s against the accept length (or not following it), a stage that gains, a stage whose offline estimate's CI
    misses the loss measured on the server, a recommended setting the replay's sweep measured otherwise."""
    out = []
    speed = (pair or {}).get("speed") or {}
    if speed.get("contradicts") or speed.get("lags"):
        out.append({"figure": "tok/s", "text": speed["text"]})
    b = budget or {}
    for g in gains(b):
        out.append({"figure": f"{g['stage']} loss {g['delta']:+.2f}", "text": g["text"]})
    for stage, loss in (b.get("losses") or {}).items():
        lad = loss.get("ladder") or {}
        if loss.get("on_server") and lad.get("delta") is not None and _disjoint(loss.get("ci"), lad.get("ci")):
            out.append({"figure": f"{stage} loss", "text": (
                f"the {stage} stage's loss measured on the server, {loss['delta']:.2f} [{loss['ci'][0]:.2f}, "
                f"{loss['ci'][1]:.2f}] over {loss.get('n')} live prompts, lies outside the CI of the budget's offline "
                f"estimate {lad['delta']:.2f} [{lad['ci'][0]:.2f}, {lad['ci'][1]:.2f}] ({lad.get('basis')}): "
                "other text (the live prompts vs the training samples), the same fault")})
    _, flag = settings_text(b, doc)
    if flag:
        out.append({"figure": "recommended settings", "text": flag})
    return out


def flags_html(items: list[dict]) -> str:
    """The flags as a numbered list (escaped), or a line saying none was found."""
    if not items:
        return '<p class="e3f-note">No figure on this screen contradicts the story.</p>'
    return ('<div class="e3f-flags"><b>Figures that do not fit the story</b><ol>'
            + "".join(f"<li><b>{esc(f['figure'])}</b>: {esc(f['text'])}</li>" for f in items) + "</ol></div>")


def measurement_parts(run_dir: Optional[Path], doc: Any = None, inv: Optional[InvestigationDoc] = None,
                      ledger: Optional[pd.DataFrame] = None) -> list[str]:
    """The before / after table and the flags, for a page that shows the measurements but not the headline
    (``20_acceptance``): a heading, the table, the flags; ``[]`` with fewer than two measurements."""
    pair = measured_pair(run_dir, doc, inv, ledger)
    ba = before_after_frame(pair)
    if not len(ba):
        return []
    return [f'<h3 class="e3f-h">Before and after the fix <span class="e3f-note">(95% CIs; {esc(pair["source"])})'
            "</span></h3>", table_html(ba), flags_html(flags(pair, inv.acceptance if inv is not None else None, doc))]


def _architecture(path: Any) -> str:
    try:
        return describe_architecture(path)
    except BadInput as exc:
        return f"{path} ({exc})"


def what_ran(run_dir: Optional[Path], doc: Any = None, inv: Optional[InvestigationDoc] = None) -> str:
    """One line saying what ran: the target's and the draft's architecture (from their config.json,
    :func:`helpers.formats.configs.describe_architecture`), the engine version, TP, algorithm and speculative settings,
    and where that was read: the server the investigation attached to (``investigation.json`` ``attach``), else the
    models of the case the replay ran (``results/00_replay.json`` ``case_path``). ``""`` when neither is there."""
    att = (inv.attach if inv is not None else None) or {}
    target, draft = att.get("served_target") or att.get("target_dir"), att.get("served_draft") or att.get("draft_dir")
    source = "the investigated server's model_path and speculative_draft_model_path, their config.json"
    tp = att.get("tp")
    if not target and run_dir is not None:
        cp = (read_json_or_none(result_path(Path(run_dir), "00_replay")) or {}).get("case_path")
        try:
            m = case_models(Path(cp)) if cp and Path(cp).exists() else None
        except Exception:  # noqa: BLE001 - an unreadable case file leaves the line out, the replay page says why
            m = None
        if m is not None:
            target, draft = ROOT / m.target, ROOT / m.draft
            source = f"the models of the case file {cp}, their config.json"
            tp = tp or getattr(as_replay(doc), "tp", None)
    if not target:
        return ""
    kind = draft_kind(inv)
    text = f"Target {_architecture(target)}"
    if draft:
        text += f"; draft {kind.draft(draft, _architecture)}"
    engine = [f"{engine_label(getattr(inv, 'engine', None))} {att['version']}" if att.get("version") else "",
              f"TP {tp}" if tp else ""]
    spec = att.get("spec") or {}
    if att.get("algorithm"):
        engine.append(kind.algorithm(att) + (f" (steps {spec.get('num_steps')}, topk {spec.get('topk')}, draft tokens "
                                          f"{spec.get('num_draft_tokens')})" if spec else ""))
    engine = [e for e in engine if e]
    return text + (f"; {', '.join(engine)}" if engine else "") + f" [source: {source}{kind.draft_source}]."


def first_screen(run_dir: Optional[Path], doc: Any = None, inv: Optional[InvestigationDoc] = None,
                 ledger: Optional[pd.DataFrame] = None) -> list[str]:
    """The first screen as one HTML block (a list of one string, ``<div class="e3f-first">``): the headline, what ran
    (:func:`what_ran`: the architectures), the before / after table, the flags, the ladder with the settings line."""
    parts = [headline_box(story_parts(doc, inv))]
    ran = what_ran(run_dir, doc, inv)
    if ran:
        parts.append(f'<p class="e3f-note e3f-ran"><b>What ran:</b> {esc(ran)}</p>')
    pair = measured_pair(run_dir, doc, inv, ledger)
    ba = before_after_frame(pair)
    if len(ba):
        parts.append(f'<h3 class="e3f-h">Before and after the fix <span class="e3f-note">(95% CIs; {esc(pair["source"])})'
                     "</span></h3>")
        parts.append(table_html(ba))
    budget = inv.acceptance if inv is not None else None
    parts.append(flags_html(flags(pair, budget, doc)))
    if budget:
        parts.append('<h3 class="e3f-h">Where the accept length goes <span class="e3f-note">(the acceptance budget, '
                     f'cause: {esc(budget.get("cause"))})</span></h3>')
        parts.append(table_html(ladder_frame(budget)))
        text, _ = settings_text(budget, doc)
        if text:
            parts.append(f'<p class="e3f-note">{esc(text)}</p>')
    return ['<div class="e3f-first">' + "".join(parts) + "</div>"]
