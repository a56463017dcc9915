"""The live investigation as HTML: the opening sentence, findings, hypotheses by evidence, the proposed fix and its
measured effect. :func:`sections_html` is shown by the notebooks (00_investigate, 99_postmortem);
:func:`write_report` writes ``postmortem.html`` for ``python -m helpers investigate`` (one self-contained page,
plotly.js inline once, every server-provided string escaped)."""
from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio

from ..errors import BadInput
from ..investigation.live import investigate
from ..records import HypothesisStep, InvestigationDoc
from ..runfiles import atomic_write_text, read_json_file
from .budget import budget_parts
from .common import (_CSS, RunContext, as_path, engine_label, esc, findings_frame, headline_box, plotlyjs_html,
                     run_dir_line, table_html)
from .draft_kind import draft_kind
from .story import first_screen, story_parts


def load_investigation(run_dir: Path) -> Optional[InvestigationDoc]:
    """``run_dir/investigation.json`` typed, or None when absent / unreadable."""
    p = Path(run_dir) / "investigation.json"
    try:
        return InvestigationDoc.model_validate(read_json_file(p, "investigation record"))
    except (OSError, ValueError):
        return None


def ensure(ctx: RunContext, *, samples: int = 4, apply_fix: bool = False, relaunch: str = "",
           timeout: Optional[float] = 900.0, prompts: int = 16, max_new_tokens: int = 32, draft: Any = "",
           target: Any = "", port: Any = "", progress: Optional[Callable[[str], None]] = None,
           acceptance_budget: bool = True) -> Optional[InvestigationDoc]:
    """The run folder's investigation of ``ctx.server_url``: the one ``00_investigate`` wrote, else (live) a new one
    run now with :func:`helpers.investigation.live.investigate` (so every live page reads the same capture, the
    same draft and the same verdicts). Without a live server: the recorded one or None. ``draft`` / ``target``:
    folders to use when the server's are not readable here (empty: the server's); ``port``: port or ``LOW-HIGH`` range
    of the fixed server; ``progress``: called with one line per step (:class:`helpers.views.common.StepProgress`);
    ``acceptance_budget``: compute the acceptance budget (the draft run offline; see
    :func:`helpers.investigation.live.investigate`).

    Raises:
        helpers.errors.BadInput: the run folder holds the investigation of another server, or is a finished run
            the user did not name (before any work).
    """
    doc = load_investigation(ctx.run_dir)
    if doc is not None and (not ctx.live or doc.url.rstrip("/") == ctx.server_url.rstrip("/")):
        return doc
    if not ctx.live:
        return None
    if (ctx.run_dir / "investigation.json").exists():
        raise BadInput(f"this run folder holds the investigation of another server ({doc.url if doc else 'unreadable'}"
                       f"), not of server_url {ctx.server_url}: run 00_investigate with this server_url (a new run "
                       "folder) and paste its run_dir line here", path=ctx.run_dir, field="run_dir")
    ctx.require_writable("the live investigation")
    doc = investigate(ctx.server_url, training=ctx.training, run_dir=ctx.run_dir, draft=as_path(draft),
                      target=as_path(target), relaunch=relaunch or None, api_key=ctx.api_key, timeout=timeout,
                      num_samples=samples, measure_prompts=prompts, max_new_tokens=max_new_tokens,
                      apply_fix=apply_fix, port=port or None, acceptance_budget=acceptance_budget,
                      **({"progress": progress} if progress is not None else {}))
    if callable(getattr(progress, "done", None)):
        progress.done()
    return doc


def hypothesis_steps(doc: Optional[InvestigationDoc], check: str) -> list[HypothesisStep]:
    """The investigation's verdict on ``check`` as a replay-style step (for the hypothesis pages)."""
    if doc is None:
        return []
    return [h.as_step(label="live investigation", on_fix="live server") for h in doc.hypotheses if h.check == check]


def headline_html(doc: InvestigationDoc, replay: Any = None) -> str:
    """The headline box (:func:`helpers.views.common.headline_box`: what is wrong, the fix, its measured effect, each
    with its source) with a verdict badge; ``replay``: the run folder's replay, whose step times the investigation."""
    label, color = {"ok": ("no fault", "#2e7d32"), "mismatch": ("fault named", "#c62828")}.get(
        doc.verdict or "", ("no verdict", "#616161"))
    badge = (f'<span class="e3f-verdict" style="background:{color};color:#fff;padding:1px 8px;border-radius:9px;'
             f'font-weight:600">{esc(label)}</span>')
    return badge + headline_box(story_parts(replay, doc))


def hypotheses_frame(doc: InvestigationDoc) -> pd.DataFrame:
    """One row per hypothesis, confirmed first: check, verdict, what the evidence says."""
    return pd.DataFrame([{"hypothesis": h.get("title") or h.get("check"), "verdict": h.get("verdict"),
                          "evidence": h.get("short") or h.get("explanation")} for h in doc.hypotheses])


def fix_html(doc: InvestigationDoc, *, summary: bool = True) -> str:
    """The proposed fix: parts, engine changes, config overrides / flags / tensors, and where each comes from
    (``summary=False``: without its one-line summary, which the headline above already says)."""
    fix = doc.proposed_fix
    if fix is None:
        return "<p><i>No fix was proposed (the investigation stopped before).</i></p>"
    items = "".join(f"<li>{esc(p)}</li>" for p in fix.parts)
    items += "".join(f"<li><b>engine:</b> {esc(p)}</li>" for p in fix.engine)
    out = (f"<p><b>{esc(fix.kind)}</b>: {esc(fix.summary)}</p>" if summary else
           f"<p><b>{esc(fix.kind)}</b> (the headline's proposed fix):</p>") + f"<ul>{items}</ul>"
    if fix.draft_config:
        out += (f"<p>file to edit: <code>{esc(config_to_edit(doc))}</code>; the keys to set:</p>"
                f"<pre>{esc(json.dumps(fix.draft_config, indent=1))}</pre>")
        patched = Path(doc.run_dir) / "drafts" / "proposed" / "config.json"
        if doc.run_dir and patched.exists():
            out += f"<p class=\"e3f-note\">the patched copy the fix was measured with: <code>{esc(patched)}</code></p>"
    if fix.server_args:
        out += "<p>server flags: <code>" + esc(" ".join(f"{k} {v}" for k, v in fix.server_args.items())) + "</code></p>"
    if fix.add_tensors:
        out += "<p>draft tensors to add: " + esc(", ".join(f"{k} from {v}" for k, v in fix.add_tensors.items())) + "</p>"
    if fix.drop_tensors:
        out += "<p>draft tensors to leave out: " + esc(", ".join(fix.drop_tensors)) + "</p>"
    if fix.expected_served:
        out += (f"<p>served after the fix ({esc(engine_label(doc.engine))} rules): "
                f"[{esc(', '.join(fix.expected_served))}]</p>")
    if fix.workaround:
        out += f"<p>stopgap (untested): <code>{esc(json.dumps(fix.workaround.get('draft_config')))}</code> -- " \
               f"{esc(fix.workaround.get('why'))}</p>"
    if fix.why:
        out += "<p class=\"e3f-note\">where it comes from:</p><ul class=\"e3f-note\">" + \
               "".join(f"<li>{esc(w)}</li>" for w in fix.why) + "</ul>"
    return out


def config_to_edit(doc: InvestigationDoc) -> str:
    """The draft config file the proposed fix edits: ``config.json`` of the draft folder the server was started with
    (``speculative_draft_model_path``, a path on the server's machine), else of the draft folder the investigation
    read."""
    a = doc.attach or {}
    folder = a.get("served_draft") or a.get("draft_dir")
    return str(Path(folder) / "config.json") if folder else "the draft's config.json"


def measured_figure(doc: InvestigationDoc) -> Optional[go.Figure]:
    """Accept rate before / after the proposed fix with 95% CIs, or None when not measured."""
    m = doc.measured or {}
    if "before" not in m or "after" not in m:
        return None
    xs, ys, lo, hi = [], [], [], []
    for name in ("before", "after"):
        s = m[name]
        xs.append({"before": "as served", "after": "proposed fix"}[name])
        ys.append(s.get("accept_rate"))
        lo.append((s.get("accept_rate") or 0) - (s.get("accept_rate_lo") or s.get("accept_rate") or 0))
        hi.append((s.get("accept_rate_hi") or s.get("accept_rate") or 0) - (s.get("accept_rate") or 0))
    fig = go.Figure(go.Bar(x=xs, y=ys, marker_color=["#c62828", "#2e7d32"],
                           error_y=dict(type="data", symmetric=False, array=hi, arrayminus=lo)))
    fig.update_layout(title="Accept rate before / after the proposed fix (95% CI)", yaxis_tickformat=".0%",
                      height=320, margin=dict(l=60, r=20, t=50, b=40))
    return fig


def _budget_samples(doc: InvestigationDoc) -> Optional[int]:
    """How many training samples (an MTP head: live prompts) the acceptance budget's wiring stage ran on (it may grow
    past the diagnosis's)."""
    wiring = draft_kind(doc).loss_at["wiring"]
    st = next((s for s in (doc.acceptance or {}).get("stages") or [] if s.get("name") == wiring),
              None) or next((s for s in (doc.acceptance or {}).get("stages") or []
                             if s.get("name") == "offline on training states"), None)
    return None if st is None else st.get("sequences")


def facts_frame(doc: InvestigationDoc) -> pd.DataFrame:
    """What the server runs and what the investigation used (attach + reference + timings)."""
    a, kind = doc.attach or {}, draft_kind(doc)
    rows = [("server", doc.url), (f"{engine_label(doc.engine)} version", a.get("version")), ("TP size", a.get("tp")),
            ("speculative algorithm", kind.algorithm(a)), ("spec settings", json.dumps(a.get("spec"))),
            ("draft used", f"{a.get('draft_dir')} [{a.get('draft_source')}]"),
            ("target used", f"{a.get('target_dir')} [{a.get('target_source')}]"),
            ("per-rank capture", a.get("rank_capture_dir") or "none"),
            ("every-layer capture", a.get("layers_dir") or "none"),
            ("other forward hooks", ", ".join(str(h.get("name")) for h in a.get("other_hooks") or []) or "none"),
            ("reference", (doc.reference or {}).get("how") or "none"),
            (kind.samples_label, doc.samples),
            (kind.budget_samples_label, _budget_samples(doc)),
            ("timings (s)", ", ".join(f"{k} {v}" for k, v in (doc.timings or {}).items()))]
    if (doc.reference or {}).get("missing"):
        rows.append(("missing", doc.reference["missing"]))
    rows += [("note", n) for n in doc.notes]
    return pd.DataFrame([{"fact": k, "value": "" if v is None else str(v)} for k, v in rows])


def sections_html(doc: InvestigationDoc, *, with_headline: bool = True, replay: Any = None,
                  run_dir: Optional[Path] = None, ladder: Optional[bool] = None) -> list[Any]:
    """The investigation as a list of displayable parts (HTML strings and plotly figures), in page order: with the
    headline, the first screen (:func:`helpers.views.story.first_screen`: headline, before / after, the ladder, the
    flags), then findings, hypotheses, the proposed fix, the measurement, the acceptance budget's details, the server.
    ``replay``: the run folder's replay (its investigation step's time, its sweep); ``run_dir``: where the measurements
    are (default the investigation's); ``ladder``: show the ladder table in the budget's section (default: only
    without the first screen, which shows it)."""
    parts: list[Any] = []
    if with_headline:
        label, color = {"ok": ("no fault", "#2e7d32"), "mismatch": ("fault named", "#c62828")}.get(
            doc.verdict or "", ("no verdict", "#616161"))
        parts.append(f'<span class="e3f-verdict" style="background:{color};color:#fff;padding:1px 8px;'
                     f'border-radius:9px;font-weight:600">{esc(label)}</span>')
        parts += first_screen(run_dir or (Path(doc.run_dir) if doc.run_dir else None), replay, doc)
    parts.append("<h3>Findings</h3>")
    parts.append(table_html(findings_frame([f.model_dump() for f in doc.findings])) if doc.findings
                 else f"<p>{esc(draft_kind(doc).no_finding(doc))}</p>")
    parts.append("<h3>Hypotheses, by evidence</h3>")
    parts.append(table_html(hypotheses_frame(doc)))
    parts.append("<h3>Proposed fix</h3>")
    parts.append(fix_html(doc, summary=not with_headline))
    parts.append("<h3>Measured</h3>")
    fig = measured_figure(doc)
    m = doc.measured or {}
    if fig is not None:
        parts.append(fig)
        parts.append(f"<p>{esc(_effect_line(m))}</p>")
    elif m.get("measured_by"):
        parts.append(f"<p>Measured by {esc(m['measured_by'])}.</p>")
    else:
        parts.append(f"<p>Not measured: {esc(m.get('not_measured') or m.get('error') or 'no measurement')}</p>")
    parts.append("<h3>Acceptance budget: where the accept length goes</h3>")
    parts += budget_parts(doc.acceptance, with_ladder=(not with_headline) if ladder is None else ladder, doc=replay)
    parts.append("<h3>What the server runs</h3>")
    parts.append(table_html(facts_frame(doc), max_rows=40))
    if doc.error:
        parts.append(f"<p><b>Stopped:</b> {esc(doc.error)}</p>")
    return parts


def _effect_line(m: dict) -> str:
    e = m.get("effect") or {}
    after = ("" if "after_verdict" not in m else
             "; after the fix the served aux states equal the training data" if m.get("after_verdict") == "ok"
             else f"; after the fix the diagnosis still finds {', '.join(m.get('after_findings') or [])}")
    return (f"{e.get('n_paired')} prompts paired: accept rate change {e.get('accept_rate_delta', float('nan')):+.1%} "
            f"[{e.get('accept_rate_delta_lo', float('nan')):+.1%}, {e.get('accept_rate_delta_hi', float('nan')):+.1%}], "
            f"accept length change {e.get('accept_length_delta', float('nan')):+.2f} tokens per verify step{after}.")


def page_html(doc: InvestigationDoc, title: Optional[str] = None) -> str:
    """One self-contained HTML page of the investigation; ``title`` defaults to the draft kind's
    (:func:`helpers.views.draft_kind.draft_kind`: an EAGLE-3 draft's or an MTP head's live investigation)."""
    title = title or draft_kind(doc).title
    body = []
    for p in sections_html(doc):
        if isinstance(p, go.Figure):
            body.append(pio.to_html(p, include_plotlyjs=False, include_mathjax=False, full_html=False,
                                    default_width="100%", config={"displaylogo": False, "responsive": True}))
        else:
            body.append(p)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title>{_CSS}{plotlyjs_html()}</head>\n<body style=\"font-family:sans-serif;"
            f"max-width:1100px;margin:auto\">\n<h1>{esc(title)}</h1>\n<p class=\"e3f-note\">{esc(doc.url)} -- run "
            f"folder {esc(doc.run_dir)}</p>\n" + "\n".join(body) + "\n</body></html>\n")


def write_report(run_dir: Path, doc: InvestigationDoc) -> Path:
    """Write ``run_dir/postmortem.html`` (atomic) and return its path."""
    return atomic_write_text(Path(run_dir) / "postmortem.html", page_html(doc))


def where_html(run_dir: Path, doc: Optional[InvestigationDoc], command: str = "") -> str:
    """Where the investigation's files are, for the end of a page: the run folder (and the line to paste into the
    next notebooks), ``investigation.json``, the patched draft (``drafts/proposed``), the postmortem page, and the
    command that reproduces the investigation (escaped HTML list)."""
    run_dir = Path(run_dir).resolve()
    rows = [("run folder", str(run_dir)), ("next notebooks", run_dir_line(run_dir))]
    inv = run_dir / "investigation.json"
    rows.append(("investigation", str(inv) if inv.exists() else "not written (no investigation in this run folder)"))
    drafts = run_dir / "drafts" / "proposed"
    rows.append(("patched draft", str(drafts) if (drafts / "config.json").exists() else
                 "none (the fix was not applied)"))
    pm = run_dir / "postmortem.html"
    rows.append(("postmortem", str(pm) if pm.exists() else
                 "not written yet: 99_postmortem shows it with the run_dir line above "
                 "(`python -m helpers investigate` writes postmortem.html)"))
    if command:
        rows.append(("reproduce", command))
    return "<ul class=\"e3f-where\">" + "".join(f"<li><b>{esc(k)}:</b> <code>{esc(v)}</code></li>" for k, v in rows) + \
        "</ul>"


def reproduce_command(ctx: RunContext, *, samples: int, prompts: int, timeout: Optional[float], apply_fix: bool,
                      relaunch: str = "", draft: Any = "", target: Any = "", port: Any = "") -> str:
    """The ``python -m helpers investigate`` command that runs the same investigation into a new run folder."""
    words = ["python", "-m", "helpers", "investigate", "--url", ctx.server_url, "--training", str(ctx.training),
             "--samples", str(samples), "--prompts", str(prompts)]
    words += ["--timeout", f"{timeout:g}"] if timeout else []
    words += [] if apply_fix else ["--no-apply"]
    words += ["--relaunch", relaunch] if relaunch else []
    words += ["--draft", str(as_path(draft))] if draft else []
    words += ["--target", str(as_path(target))] if target else []
    words += ["--port", str(port)] if port else []
    if ctx.api_key_env != "SGLANG_API_KEY":
        words += ["--api-key-env", ctx.api_key_env]
    return shlex.join(words)
