"""The acceptance budget as HTML parts (the investigation page, 20_acceptance, the postmortem's first screen): the
cause, the ladder as one table (stage, accept length, the loss measured at it with its decision), the settings line
consistent with ``recommended_settings``, the gains with why, the figures, the losses' decisions, the settings
simulated and the fix proven offline."""
from __future__ import annotations

from typing import Any, Optional

import pandas as pd

from ..acceptance.stats import format_ci
from ..acceptance.sweeps import steps_sweep_verdict
from ..draft.budget import LIVE_WIRING, TRAINING_WIRING, gains, trade_text
from ..draft.decide import MATERIAL
from ..plots.budget import LOSS_AT, budget_ladder, budget_waterfall, draft_steps
from .common import esc, table_html
from .draft_kind import draft_kind
from ..investigation.probes.parts import COLD
from .replay import sweep_points


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
                         for k, v in (budget.get("losses") or {}).items()]
                        + [{"stage": f"engine: {p['part']}", "lost (tokens / verify step)": _r(p.get("delta")),
                            "95% CI": _ci(p.get("ci")), "material from": None, "decision": p["decision"],
                            "counts": "yes" if p["decision"] == "counts" else "no",
                            "what would settle it": p.get("why") if p["decision"] in ("undecided", "not measured")
                            else ("not run: " + ", ".join(p["not_run"])) if p.get("not_run") else "",
                            "basis": ", ".join(p.get("rests_on") or p.get("probes") or []) or "no probe"}
                           for p in ((budget.get("losses") or {}).get("engine") or {}).get("parts") or []
                           if p["part"] != COLD])


def _r(x: Any) -> Any:
    """``x`` rounded to 2 decimals, without a negative zero ("-0.00" reads as a loss of a sign)."""
    return x if x is None else round(float(x), 2) + 0.0


def _ci_of(v: Any, ci: Any, *, signed: bool = False) -> str:
    lo, hi = (list(ci) + [None, None])[:2] if ci else (None, None)
    return format_ci({"x": _r(v), "x_lo": _r(lo), "x_hi": _r(hi)}, "x", signed=signed)


def ladder_frame(budget: dict) -> pd.DataFrame:
    """The ladder as one table, in stage order: which like-with-like run the stage belongs to (a new run starts where
    the quantity or the prompts change: the step into it is not a loss), its accept length with the 95 % CI, the loss
    measured at it (from the stage before it in the same run; the settings stage: recommended vs served) with its CI
    and decision, and a note: measured on the server (with the ladder's offline estimate), a gain, what would settle
    an undecided loss. The stages each loss is measured at are the draft kind's (:func:`helpers.views.draft_kind.
    draft_kind` of the budget: an MTP head's budget has stages of its own)."""
    kind = draft_kind(budget=budget)
    at = {v: k for k, v in kind.loss_at.items()}
    losses = budget.get("losses") or {}
    gained = {g["stage"] for g in gains(budget)}
    rows, last = [], None
    for s in budget.get("stages") or []:
        name = s["name"]
        run = kind.run_of(name) or ""
        loss = losses.get(at.get(name, "")) or {}
        note = []
        if loss.get("on_server"):
            lad = loss.get("ladder") or {}
            note.append("measured on the server" + (f" (offline estimate {_ci_of(lad.get('delta'), lad.get('ci'))})"
                                                    if lad.get("delta") is not None else ""))
        if name == LOSS_AT["wiring"] and any(LIVE_WIRING in (x.get("basis") or "") for x in
                                              [loss, loss.get("ladder") or {}, *(loss.get("also") or [])]):
            tr = next((a for a in [loss.get("ladder") or {}, *(loss.get("also") or [])]
                       if (a.get("basis") or "").startswith(TRAINING_WIRING)), None)
            note.append("measured on the live prompts' tokens too (the row 'offline on live prompts, training "
                        "plan')" + (f"; on the training samples {_ci_of(tr['delta'], tr.get('ci'))} "
                                    f"{tr.get('decision')}" if tr else ""))
        if at.get(name) in gained:
            note.append("a gain (see the flags)")
        if loss.get("decision") == "undecided":
            note.append((loss.get("settle") or {}).get("text") or loss.get("why") or "")
        if name == LOSS_AT["settings"] and s.get("settings"):
            r, sv = s["settings"], budget.get("settings") or {}
            note.append(f"steps {r.get('steps')} topk {r.get('topk')} draft tokens {r.get('draft_tokens')} (served "
                        f"{sv.get('steps')} / {sv.get('topk')} / {sv.get('draft_tokens')})")
        rows.append({"like with like": "" if run == last else run, "stage": name,
                     "accept length [95% CI]": _ci_of(s.get("accept_length"), s.get("ci")),
                     "lost at this stage [95% CI]": _ci_of(loss.get("delta"), loss.get("ci")) if loss else "",
                     "decision": loss.get("decision") or "", "note": "; ".join(n for n in note if n)})
        if at.get(name) == "engine":
            rows += part_rows(loss)
        last = run
    return pd.DataFrame(rows)


def part_rows(engine: dict) -> list[dict]:
    """The engine stage's parts (``engine["parts"]``, the engine-state probes joined:
    ``helpers.investigation.probes.parts.engine_parts``) as ladder rows under the engine stage's row, the cold
    comparison left out (it is the engine row itself): ``engine: <part>``, its loss with the CI where it has one,
    its decision, and why (the probes that decided it, or why none ran)."""
    out = []
    for p in engine.get("parts") or []:
        if p["part"] == COLD:
            continue
        floor = p.get("floor") or {}
        note = [p.get("why") or ""]
        if floor.get("accept_length") is not None:
            note.append(f"floor: a perfect draft accepts {floor['accept_length']:.2f} of {floor.get('perfect') or 0:.2f}")
        out.append({"like with like": "", "stage": f"engine: {p['part']}", "accept length [95% CI]": "",
                    "lost at this stage [95% CI]": _ci_of(p.get("delta"), p.get("ci")) if p.get("delta") is not None
                    else "", "decision": p["decision"], "note": "; ".join(n for n in note if n)})
    return out


def settings_text(budget: Optional[dict], doc: Any = None) -> tuple[str, Optional[str]]:
    """The one settings advice of a run (the postmortem's first screen, the budget section, the suite's console
    summary): what the budget recommends over the served settings, modelled how and on which states; what the
    replay's ``num_steps`` sweep (``doc``, the replay document) measured (:func:`helpers.acceptance.sweeps.
    steps_sweep_verdict`, the rule every sweep label uses); and one ``Advice:``: the modelled steps when the sweep
    measured them fastest beyond every other CI, no num_steps from the sweep when its CIs overlap (not
    distinguishable), ``undecided`` (plus a flag) when the sweep measured other steps faster beyond both CIs.
    ``("", None)`` without a budget."""
    b = budget or {}
    served, rec = b.get("settings") or {}, b.get("recommended_settings")
    if not b:
        return "", None
    if not rec:
        why = "; ".join(m for m in b.get("missing") or [] if m.startswith("settings")) or "no settings stage"
        return f"Settings: none recommended ({why}).", None
    st = next((s for s in b.get("stages") or [] if s["name"] == LOSS_AT["settings"]), {})
    on = f" on the {st['grid']}" if st.get("grid") else ""
    gain = st.get("modelled_speedup_gain")
    flags = f"--speculative-num-steps {rec['steps']} --speculative-eagle-topk {rec['topk']} " \
            f"--speculative-num-draft-tokens {rec['draft_tokens']}"
    same = all(rec.get(k) == served.get(k) for k in ("steps", "topk", "draft_tokens"))
    if same:
        text = (f"Settings: the acceptance budget keeps the served {flags}: no chain accepts more tokens per verify "
                f"step at a modelled throughput at least the served settings', and none is modelled a material share "
                f"faster (at least {MATERIAL:.0%}; simulated{on})")
        if b.get("settings_trade"):
            text += "; " + trade_text(b["settings_trade"])
    else:
        al = _ci_of(st.get("accept_length"), st.get("ci"))
        sal = st.get("served_accept_length")
        text = (f"Settings: the acceptance budget recommends {flags} over the served {served.get('steps')} steps: "
                f"accept length {al}" + (f" vs {sal:.2f}" if sal is not None else "")
                + (f", modelled tokens per unit time {gain:+.0%}" if gain is not None else "")
                + f" (simulated{on}; to be measured before it is adopted)")
        if b.get("cause") in ("wiring", "draft") and "served" in on:
            text += (f"; it was simulated on the states before the fix of the {b['cause']} stage, which the fix "
                     "changes")
    flag = None
    pts = [p for p in sweep_points(doc) if (p.get("topk") or 1) == 1]
    v = steps_sweep_verdict(pts)
    got = {p["num_steps"]: p for p in (v or {}).get("points") or []}
    s_, modelled = got.get(served.get("steps")), rec["steps"]
    if v is None or len(got) < 2 or s_ is None:
        return text + ".", None
    text += f". The replay's num_steps sweep: {v['text']}"
    fastest = v["fastest"]
    if not v["ci"]:
        text += ". Advice: none from the sweep (no CIs to compare); the budget's word is modelled only"
    elif fastest is None:
        text += (". Advice: the sweep recommends no num_steps (not distinguishable); "
                 + ("nothing measured favours a change from the served settings" if same else
                    f"the budget's {modelled} steps stay modelled only, to be measured before they are adopted"))
    elif fastest == modelled:
        text += f". Advice: {modelled} steps, modelled and measured" + ("" if same else " (a change from the served)")
    elif modelled not in got:
        text += (f". Advice: undecided: the sweep did not measure the budget's {modelled} steps, and measured "
                 f"{fastest} steps fastest")
    else:
        r, f = got[modelled], got[fastest]
        tr, tf = format_ci(r, "tok_s", digits=1), format_ci(f, "tok_s", digits=1)
        loads = "; ".join(f"{n} steps: {_load(p)}" for n, p in ((fastest, f), (modelled, r)))
        word = f"keeps the served {modelled}" if same else f"recommends {modelled}"
        flag = (f"the budget {word} steps (modelled), the sweep measured {fastest} steps faster beyond both tok/s "
                f"CIs ({tf} vs {tr}); the machine's load during the two: {loads}")
        text += (f". Advice: undecided between {modelled} steps (modelled) and {fastest} steps (measured faster): "
                 "see the flags, and measure both again on an idle machine before changing")
    return text + ".", flag


def _load(p: dict) -> str:
    m = p.get("machine") or {}
    r = m.get("runnable_mean")
    return f"{r:.1f} runnable task(s) on {m.get('cpu_count')} core(s)" if r is not None else "not recorded"


def cause_html(budget: dict) -> str:
    """One line: the budget's cause and the loss that makes it (or why there is none), escaped."""
    cause, losses = budget.get("cause"), budget.get("losses") or {}
    loss = losses.get(cause) or {}
    if loss.get("delta") is not None:
        how = "" if loss.get("on_server") else "estimated offline: "        # a measured basis says "measured"
        why = (f"{_ci_of(loss['delta'], loss.get('ci'))} tokens per verify step lost at the {cause} stage "
               f"({loss.get('decision')}; {how}{loss.get('basis', '')})")
    elif cause == "none":
        why = "every required stage's CI rules out a material loss"
    else:
        why = "a material loss is not ruled out at " + "; ".join(
            f"{k} ({(v.get('settle') or {}).get('text') or v.get('why') or 'not computed'})"
            for k, v in losses.items() if v.get("decision") == "undecided")
    return f"<p><b>Cause: {esc(cause)}</b>: {esc(why)}</p>"


def budget_parts(budget: Optional[dict], *, with_ladder: bool = True, doc: Any = None) -> list[Any]:
    """HTML strings and plotly figures, in page order: the cause, the ladder table (:func:`ladder_frame`; left out
    with ``with_ladder=False`` where the page's first screen shows it), the settings line (:func:`settings_text`,
    ``doc`` the replay for its sweep), the gains with why, the waterfall, the draft stage per step, P(accepted >= j)
    per stage, each loss's decision, the settings simulated, the fix proven offline, notes and what is missing. One
    line when there is no budget."""
    if not budget:
        return ["<p>No acceptance budget in this run.</p>"]
    parts: list[Any] = [cause_html(budget)]
    if with_ladder:
        parts.append(table_html(ladder_frame(budget)))
        text, flag = settings_text(budget, doc)
        parts.append(f'<p class="e3f-note">{esc(text)}</p>')
        items = [g["text"] for g in gains(budget)] + ([flag] if flag else [])
        if items:
            parts.append("<p><b>Figures that do not fit the story</b></p><ul>"
                         + "".join(f"<li>{esc(t)}</li>" for t in items) + "</ul>")
    order = draft_kind(budget=budget).stage_order
    for fig in (budget_waterfall(budget, order), draft_steps(budget), budget_ladder(budget, order)):
        if fig is not None:
            parts.append(fig)
    parts.append("<h4>Losses by stage: how each is decided</h4>")
    parts.append(table_html(losses_frame(budget)))
    if budget.get("settings_table"):
        parts.append("<h4>Other settings, simulated on the same states</h4>")
        parts.append(table_html(pd.DataFrame([{"steps": t["steps"], "topk": t["topk"],
                                               "draft tokens": t["draft_tokens"],
                                               "accept length": round(t["accept_length"], 2),
                                               "95% CI": _ci(t.get("ci")),
                                               "modelled tokens per unit time": None if t.get("speedup_model") is None
                                               else round(t["speedup_model"], 3)} for t in budget["settings_table"]])))
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
    src = budget.get("draft_sources") or {}
    if src:
        how = "; ".join(f"{k}: {v}" for k, v in src.items() if k != "dtype")
        parts.append("<p class=\"e3f-note\">the draft run offline computed in " + esc(str(src.get("dtype", "?")))
                     + (f" ({esc(how)})" if how else "") + "</p>")
    return parts
