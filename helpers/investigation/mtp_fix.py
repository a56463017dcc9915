"""The proposed fix of an MTP / NextN investigation, proven offline and measured after a restart: the NextN adapter
of the EAGLE-3 path's propose / prove / relaunch / measure seam (``helpers.investigation.live``: ``propose_fix``,
the settings stage's ``_settings_fix``, ``not_measured``, ``_apply_and_measure``).

* **A wrong state** (the head fed another tensor than SGLang feeds it, on rank 0 or on any TP rank:
  :data:`helpers.investigation.mtp.STATE_KINDS`): the fix is in the engine's capture path
  (``sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward`` applies the final norm before the logits processor
  stores the state), which no launch flag changes: proposed only (``applicable=False``), never relaunched.
* **Steps beyond the trained depth** (``mtp_steps_beyond_head``): SGLang reuses the one head at every draft step
  (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.draft_forward``), so a head trained for ``t`` steps
  served with ``s > t`` runs ``s - t`` forwards a step it never learned. The fix is a launch flag:
  ``--speculative-num-steps t --speculative-eagle-topk 1 --speculative-num-draft-tokens t + 1``. Its offline proof
  (:func:`steps_proof`): the head replayed on the live prompts at both depths (accept length per verify step, paired
  per prompt) and the trade priced by the cost model of the EAGLE-3 settings stage (``helpers.draft.budget``:
  tokens per unit time = accept length / (1 + steps x c)) with ``c`` the head's cost (:func:`nextn_draft_cost`).
  A proof whose CI rules a gain out withdraws the fix (no restart), as the EAGLE-3 budget's ``withdraw_fix`` does.
* **The relaunch** (:func:`measure_fix`): the same prompts measured on the server as served and on a restarted copy
  with the flags (the engine adapter's ``start_variant``: an embedded server from the registry, or ``--relaunch``),
  paired; the fixed server's steps checked again; and the head's cost **measured** from the two servers' tok/s and
  accept lengths (:func:`measured_cost`).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ..acceptance.machine import speed_change
from ..acceptance.measure import measure
from ..acceptance.prompts import load_prompts
from ..acceptance.stats import paired_effect
from ..draft.budget import _paired_loss
from ..draft.cost import _parameter_counts
from ..draft.nextn_stage import steps_check
from ..draft.simulate import DraftSettings, SimSequence, simulate_sequences, summary
from ..formats.configs import read_target_config
from ..records import ProposedFix
from ..server.hosts import is_local_url
from .live import MEASURE_KEEP, not_measured
from .mtp import FIX_SOURCE, POST_NORM, STATE_KINDS

#: where the one head reused at every draft step is read (the settings fix's evidence)
STEPS_SOURCE = "sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.draft_forward"


def nextn_draft_cost(target_dir: Any, *, draft_cost: Optional[float] = None) -> tuple[float, str]:
    """One NextN head forward's cost relative to one target verify forward, and where the figure comes from.

    As the EAGLE-3 cost (:func:`helpers.draft.cost.draft_cost`): at the small batches where speculative decoding pays
    a forward is bound by the weight bytes it reads, so the ratio of the parameters each forward multiplies by, from
    the safetensors headers of the target folder (the head ships there as the extra layer
    ``model.layers.{num_hidden_layers}.*``, ``sglang/srt/models/deepseek_nextn.py``). Per token a MoE layer reads
    its ``num_experts_per_tok`` routed experts of ``n_routed_experts`` (plus the shared ones), so routed experts
    count for that share; embeddings are lookups and left out (the head's own ``embed_tokens`` copy too). The head
    multiplies by its layer (``eh_proj``, norms, attention, MoE) and by the output head, which SGLang shares with the
    target (``DeepseekV3ForCausalLMNextN`` reads ``shared_head.head`` or the target's ``lm_head``: counted once). The
    relaunch measures the cost too (:func:`measured_cost`).

    Args:
        target_dir: the target folder holding the head; draft_cost: a given cost (``--draft-cost``) wins.

    Returns:
        ``(c, source)``.

    Raises:
        BadInput: an unreadable config or safetensors header (names the file)."""
    if draft_cost is not None:
        return float(draft_cost), "given (--draft-cost)"
    tc = read_target_config(target_dir)
    raw = tc.raw
    n = int(tc.num_hidden_layers)
    routed = int(raw.get("n_routed_experts") or 0)
    share = (int(raw.get("num_experts_per_tok") or 0) / routed) if routed else 1.0
    head = target = 0.0
    lm = 0.0
    for k, v in _parameter_counts(target_dir).items():
        if "embed_tokens" in k:
            continue
        w = share if ".mlp.experts." in k else 1.0
        parts = k.split(".")
        layer = int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None
        if layer is None:
            if k.startswith("lm_head"):
                lm += v
            elif not k.startswith("model.norm"):
                target += v
            continue
        if layer < n:
            target += v * w
        elif "shared_head.head" not in k:      # the head's own copy of the output head is the shared one
            head += v * w
    target, head = target + lm, head + lm
    if not head or not target:
        return 0.1, "unknown (no NextN layer in the target's weights): 0.1 assumed"
    return head / target, (f"active parameters per token: head {head / 1e6:.3f} M (its layer, {share:.2f} of the "
                           f"routed experts, the shared output head) / target {target / 1e6:.3f} M (safetensors "
                           "headers)")


def modelled_change(served_al: float, delta: float, lo: float, hi: float, served_steps: int, fix_steps: int,
                    cost: float) -> tuple[float, float, float, Optional[bool]]:
    """The cost model's change in tokens per unit time from ``served_steps`` to ``fix_steps`` head forwards per verify
    step (tokens per unit time = accept length / (1 + steps x c), the EAGLE-3 settings stage's model,
    ``helpers.draft.budget``): ``(change, change at lo, change at hi, pays)`` for an accept length ``served_al`` that
    changes by ``delta`` [``lo``, ``hi``] (paired CI); ``pays`` True when the change's CI lies above 0, False below,
    None (undecided) otherwise. ``cost``: one head forward over one verify forward (unitless)."""
    k = (1 + served_steps * cost) / (1 + fix_steps * cost)

    def change(x: float) -> float:
        return (served_al + x) / served_al * k - 1.0 if served_al else 0.0
    mc, mlo, mhi = change(delta), change(lo), change(hi)
    return mc, mlo, mhi, (True if mlo > 0 else False if mhi < 0 else None)


def repriced(proof: dict, measured: Optional[dict]) -> Optional[dict]:
    """The offline steps proof (:func:`steps_proof`) priced again at the head's cost the relaunch measured
    (:func:`measured_cost`), since the parameter model (:func:`nextn_draft_cost`) can be far from this machine's (the
    embedded CPU server: 0.06-0.27 measured against 0.41 modelled, bench/RESULTS.md): ``{"cost", "source",
    "modelled_change", "modelled_ci", "pays"}``, or None when no positive cost was measured. The fix was decided on
    the parameter model (the measured cost exists only after the restart); this says what the measured cost
    predicts, beside the relaunch's own measured speed."""
    c = (measured or {}).get("cost")
    if not c or not proof:
        return None
    lo, hi = proof["delta_ci"]
    mc, mlo, mhi, pays = modelled_change(proof["served"]["accept_length"], proof["delta"], lo, hi,
                                         proof["served"]["steps"], proof["trained"]["steps"], float(c))
    return {"cost": float(c), "source": f"measured by the relaunch: {measured.get('source')}", "modelled_change": mc,
            "modelled_ci": [mlo, mhi], "pays": pays}


def steps_proof(head: Any, sequences: Sequence[SimSequence], served: DraftSettings, trained: int, cost: float,
                cost_source: str, *, max_new_tokens: int) -> dict:
    """The offline evidence for serving the head at its trained depth: the head replayed
    (:func:`helpers.draft.simulate.simulate_sequences`) on ``sequences`` (the live prompts, their reference states
    when measured) at the served chain and at ``trained`` steps (topk 1, ``trained + 1`` draft tokens).

    Returns:
        ``{"served", "trained": {"steps", "accept_length", "ci", "head_forwards_per_verify", "modelled_rate"},
        "delta": trained - served accept length with its paired CI "delta_ci" and "n", "cost", "cost_source",
        "modelled_change": the modelled tokens per unit time at trained / served - 1 with "modelled_ci" (the CI of
        the accept length's paired change carried through the cost model), "pays": True (the modelled change's CI
        lies above 0), False (below 0: the fix is withdrawn), None (undecided), "basis": one line; and the keys of
        the EAGLE-3 budget's ``fix_offline`` ("label", "accept_length" and "ci" at the trained depth, "gain" =
        "delta", "gain_ci", "n_paired")}``."""
    fix = DraftSettings.chain(trained)
    sims = simulate_sequences(head, sequences, [served, fix], max_new_tokens=max_new_tokens)["per_request"]
    rows = {}
    for name, st in (("served", served), ("trained", fix)):
        s = summary(sims[st], st.steps)
        rows[name] = {"steps": st.steps, "topk": st.topk, "draft_tokens": st.draft_tokens,
                      "accept_length": s["accept_length"], "ci": [s["accept_length_lo"], s["accept_length_hi"]],
                      "head_forwards_per_verify": st.steps, "modelled_rate": s["accept_length"] / (1 + st.steps * cost)}
    d, lo, hi, n, _ = _paired_loss(sims[fix], sims[served])         # trained - served, paired per prompt
    a_s = rows["served"]["accept_length"]
    mc, mlo, mhi, pays = modelled_change(a_s, d, lo, hi, served.steps, fix.steps, cost)
    basis = (f"offline on {n} live prompt(s): {served.steps} steps accept {a_s:.2f} per verify step with {served.steps} "
             f"head forwards, {fix.steps} step(s) {rows['trained']['accept_length']:.2f} ({d:+.2f} [{lo:+.2f}, "
             f"{hi:+.2f}], paired) with {fix.steps}; at a head forward = {cost:.3f} verify forward ({cost_source}) the "
             f"modelled tokens per unit time change by {mc:+.1%} [{mlo:+.1%}, {mhi:+.1%}]: "
             + {True: "the cost model says the trade pays (the relaunch measures it)",
                False: "the cost model says the extra steps pay for themselves: no gain from the fix",
                None: "undecided in the cost model"}[pays])
    return {**rows, "delta": d, "delta_ci": [lo, hi], "n": n, "cost": cost, "cost_source": cost_source,
            "modelled_change": mc, "modelled_ci": [mlo, mhi], "pays": pays, "basis": basis,
            # the keys of the EAGLE-3 budget's fix_offline (helpers.views.budget shows them)
            "label": f"--speculative-num-steps {fix.steps} (the trained depth)",
            "accept_length": rows["trained"]["accept_length"], "ci": rows["trained"]["ci"], "gain": d,
            "gain_ci": [lo, hi], "n_paired": n}


def state_fix(f: dict) -> ProposedFix:
    """A wrong state's fix: the engine's capture path, proposed only (no launch flag changes it). The finding's
    evidence says which draft (``who``), which state its engine feeds (``expected``), the engine and its source
    (:func:`helpers.investigation.mtp.state_findings`); a TP rank's finding (:mod:`helpers.investigation.mtp_ranks`)
    is the NextN head's on SGLang."""
    exp = f.get("expected") or POST_NORM
    what = ("the target's final hidden state after its final norm" if exp == POST_NORM else
            "the target's last layer output before its final norm")
    return ProposedFix(kind="engine", summary=f"feed {f.get('who') or 'the NextN head'} {what}, {exp}, as "
                       f"{f.get('engine') or 'SGLang'} does" + (", on every TP rank (all-reduced, full width)"
                                                               if f["kind"].startswith("tp_") else ""),
                       parts=[f.get("fix_source") or FIX_SOURCE], why=[f["detail"]], addresses=[f["kind"]],
                       applicable=False)


def steps_fix(sc: dict, proof: Optional[dict]) -> ProposedFix:
    """``mtp_steps_beyond_head``'s fix: the launch flags of the trained depth (``sc``:
    :func:`helpers.draft.nextn_stage.steps_check`; ``proof``: :func:`steps_proof` or None)."""
    t = int(sc["trained_steps"])
    flags = {"--speculative-num-steps": t, "--speculative-eagle-topk": 1, "--speculative-num-draft-tokens": t + 1}
    part = "launch with " + " ".join(f"{k} {v}" for k, v in flags.items())
    why = [f"the head was trained for {t} step(s) and is served with {sc['served_steps']}: {STEPS_SOURCE} reuses the "
           "one head at every draft step"] + ([proof["basis"]] if proof else [])
    return ProposedFix(kind="config", summary=part + " (the NextN head's trained depth)", parts=[part],
                       server_args=flags, why=why, addresses=["mtp_steps_beyond_head"], applicable=True)


def propose(found: Sequence[dict], proof: Optional[dict]) -> tuple[ProposedFix, Optional[str]]:
    """The fix for the findings (a wrong state first: it is what the head reads) and, when the offline proof rules a
    gain out, why the fix is withdrawn (the EAGLE-3 budget's ``withdraw_fix``)."""
    if found and found[0]["kind"] in STATE_KINDS:
        fix = state_fix(found[0])
        more = [f for f in found if f["kind"] == "mtp_steps_beyond_head"]
        if more:
            fix.unaddressed.append("mtp_steps_beyond_head")
            fix.why.append("the steps beyond the head's depth are fixed by a launch flag once the state is right "
                           f"({steps_fix(more[0]['evidence'], proof).parts[0]})")
        return fix, None
    sc = next((f["evidence"] for f in found if f["kind"] == "mtp_steps_beyond_head"), None)
    if sc is None:
        return ProposedFix(kind="none", summary="none: no fault in what the head is fed"), None
    fix = steps_fix(sc, proof)
    if proof is not None and proof["pays"] is False:
        return fix, f"the offline proof rules a gain out: {proof['basis']}"
    return fix, None


def measured_cost(before: dict, after: dict) -> Optional[dict]:
    """The head's cost per forward relative to a verify forward, from two servers of one head at two depths: the
    time per token is ``(1 + s c) T_verify / accept length``, so ``Q = tok/s_a x AL_b / (tok/s_b x AL_a) =
    (1 + s_b c) / (1 + s_a c)`` gives ``c = (Q - 1) / (s_b - Q s_a)``. None when the depths are equal, a figure is
    missing or the solution is not positive and finite (the cost model does not describe the two servers)."""
    try:
        sa, sb = int(before["num_steps"]), int(after["num_steps"])
        q = float(before["tok_s"]) * float(after["accept_length"]) / (float(after["tok_s"]) * float(before["accept_length"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    den = sb - q * sa
    if sa == sb or den == 0:
        return None
    c = (q - 1.0) / den
    if not np.isfinite(c) or c <= 0:
        return {"cost": None, "q": q, "why": f"the two servers' tok/s give no positive cost (c = {c:.3g}): "
                                             "overheads other than the head's forwards dominate"}
    return {"cost": c, "q": q, "steps": [sa, sb], "source": "tok/s and accept length of the two servers "
            "(time per token = (1 + steps x c) / accept length)"}


def speed_decision(speed: dict) -> dict:
    """Whether the fixed server is faster per token than the one as served: the paired time per token ratio
    (fixed / served, :func:`helpers.acceptance.machine.speed_change`'s ``token_time``) with its CI; ``undecided``
    when the CI holds 1, or when the machine's load changed between the two measurements enough to move tok/s by
    itself (``predicted`` off 1 by more than 10 %: the two arms were not measured under the same load;
    ``bench/bench_mtp_steps_fix.py`` interleaves them)."""
    tt = speed.get("token_time") or {}
    lo, hi, ratio = tt.get("ratio_lo"), tt.get("ratio_hi"), tt.get("ratio")
    if None in (lo, hi, ratio):
        return {"decision": "undecided", "why": "no paired time per token"}
    pred = speed.get("predicted")
    d = "faster" if hi < 1 else "slower" if lo > 1 else "undecided"
    why = f"time per token fixed / served {ratio:.2f} [{lo:.2f}, {hi:.2f}], paired over {tt.get('n_paired')} prompts"
    if d != "undecided" and pred is not None and abs(pred - 1.0) > 0.10:
        return {"decision": "undecided", "ratio": [ratio, lo, hi], "predicted": pred,
                "why": f"{why}; but the machine's load changed between the two measurements (it alone predicts a "
                       f"ratio of {pred:.2f}): not the fix's effect alone"}
    return {"decision": d, "ratio": [ratio, lo, hi], "predicted": pred, "why": why}


def fix_tail(doc: Any) -> str:
    """The measured fix in one sentence for the opening sentence (empty when nothing was measured)."""
    m = doc.measured or {}
    if not (m.get("before") and m.get("after") and m.get("effect")):
        return f" The fix is not measured: {m['not_measured']}." if doc.proposed_fix and \
            doc.proposed_fix.kind != "none" and m.get("not_measured") else ""
    b, a, e, sd = m["before"], m["after"], m["effect"], m.get("speed_decision") or {}
    return (f" Fix measured after a restart ({doc.proposed_fix.summary}): accept length {b['accept_length']:.2f} -> "
            f"{a['accept_length']:.2f} ({e['accept_length_delta']:+.2f} [{e['accept_length_delta_lo']:+.2f}, "
            f"{e['accept_length_delta_hi']:+.2f}] per verify step, paired over {e['n_paired']} prompts), tok/s "
            f"{b['tok_s']:.1f} [{b['tok_s_lo']:.1f}, {b['tok_s_hi']:.1f}] -> {a['tok_s']:.1f} [{a['tok_s_lo']:.1f}, "
            f"{a['tok_s_hi']:.1f}]: {sd.get('decision', 'undecided')} ({sd.get('why', '')}).")


def measure_fix(r: Any, fix: ProposedFix) -> dict:
    """The fix's flags on a restarted copy of the server (``r.adapter.start_variant`` of ``r.att.restart``: the
    registry's embedded launch or ``--relaunch``), the live prompts measured before and after (paired, as
    ``helpers.investigation.live._apply_and_measure`` does) and the fixed server's served steps checked again.

    Raises:
        ServerError / ServerTimeout: a server fails or the run's deadline runs out (the fixed server is stopped)."""
    att, req, dl = r.att, r.req, r.dl
    ps = load_prompts(None, n=req.measure_prompts)
    kw = dict(max_new_tokens=req.max_new_tokens, concurrency=req.concurrency, progress=False, seed=0)
    r.progress(f"measure before: {req.measure_prompts} prompts x {req.max_new_tokens} tokens on {att.url}")
    before = measure(r.client, ps, label="before (as served)", **kw)
    saved_b = before.save(req.run_dir / "acceptance" / "before")
    dl.check("before starting the fixed server")
    r.progress("starting the fixed server ...")
    handle = r.adapter.start_variant(att.restart, flags=r.adapter.fix_flags(fix),
                                     capture_dir=req.run_dir / "capture" / "fixed", api_key=req.api_key,
                                     port=req.port, log_path=req.run_dir / "logs" / "fixed-server.log", budget=dl,
                                     what="the fixed server (--relaunch)")
    try:
        fixed = r.adapter.client(handle.url, req.api_key, timeout=r.client.timeout, budget=dl)
        r.progress(f"fixed server up at {handle.url}; measure after")
        after = measure(fixed, ps, label="after (proposed fix)", **kw)
        saved_a = after.save(req.run_dir / "acceptance" / "after")
        steps_after = (fixed.server_info(refresh=True) or {}).get("speculative_num_steps")
        fixed.close()
    finally:
        handle.stop()
    b, a = {k: before.summary.get(k) for k in MEASURE_KEEP}, {k: after.summary.get(k) for k in MEASURE_KEEP}
    trained = next((f.evidence.get("trained_steps") for f in r.doc.findings if f.kind == "mtp_steps_beyond_head"),
                   None)
    again = steps_check(int(steps_after), trained, None) if steps_after is not None else None
    speed = speed_change(before.summary, after.summary, before.per_request, after.per_request,
                         local=is_local_url(att.url) and is_local_url(handle.url))
    return {"before": b, "after": a, "effect": paired_effect(before.per_request, after.per_request),
            "prompts": req.measure_prompts, "max_new_tokens": req.max_new_tokens,
            "labels": ["before (as served)", "after (proposed fix)"], "speed": speed,
            "speed_decision": speed_decision(speed),
            "saved_to": [str(saved_b.relative_to(req.run_dir)), str(saved_a.relative_to(req.run_dir))],
            "after_verdict": "ok" if again is None and steps_after is not None else "mismatch",
            "after_findings": [] if again is None else ["mtp_steps_beyond_head"],
            "measured_cost": measured_cost(b, a),
            "fixed_server": {"url": handle.url, "server_args": fix.server_args, "steps": steps_after,
                             "log": str(getattr(handle, "log_path", ""))}}


def fix_stage(r: Any, found: list[dict], budget: Optional[dict], head: Any,
              sequences: Optional[Sequence[SimSequence]]) -> None:
    """Propose, prove offline, and (when the fix is a flag, the server restartable and ``--no-apply`` not given)
    relaunch and measure: fills ``r.doc.proposed_fix``, ``r.doc.measured`` and the budget's ``fix_offline`` (the
    steps proof when the steps fix is proposed; ``steps_fix_offline`` when a wrong state's fix comes first).
    ``sequences``: the live prompts' sequences the proof replays (reference states when measured, else served)."""
    req, doc = r.req, r.doc
    sc = (budget or {}).get("settings_check")
    proof = None
    if sc and head is not None and sequences:
        t = r.step("proposed fix")
        cost, src = nextn_draft_cost(r.att.target_dir, draft_cost=req.draft_cost)
        spec = r.att.spec or {}
        served = DraftSettings(int(spec.get("num_steps") or sc["served_steps"]), int(spec.get("topk") or 1),
                               int(spec.get("num_draft_tokens") or sc["served_steps"] + 1))
        proof = steps_proof(head, sequences, served, int(sc["trained_steps"]), cost, src,
                            max_new_tokens=req.max_new_tokens)
        r.done("proposed fix", t, proof["basis"])
    fix, withdrawn = propose(found, proof)
    if proof is not None:       # the proof of the proposed fix (the page shows it), else kept aside
        budget["fix_offline" if "mtp_steps_beyond_head" in fix.addresses else "steps_fix_offline"] = proof
    if withdrawn:
        doc.notes.append(withdrawn)
    doc.proposed_fix = fix
    doc.measured = not_measured(doc, fix, withdrawn=withdrawn, apply_fix=req.apply_fix, measured_by=req.measured_by,
                                not_applied=req.not_applied, restartable=r.att.restart is not None)
    if fix.kind == "engine":
        doc.measured = {"not_measured": "an engine change (the capture path) is not applied by this tool"}
    if doc.measured is None:
        t = r.step("relaunch")
        doc.measured = measure_fix(r, fix)
        m = doc.measured
        r.done("relaunch", t, f"accept length {m['before']['accept_length']:.2f} -> {m['after']['accept_length']:.2f}, "
                              f"tok/s {m['before']['tok_s']:.1f} -> {m['after']['tok_s']:.1f}")
        again = repriced(proof, m.get("measured_cost")) if proof is not None else None
        if again is not None:
            proof["at_measured_cost"] = again
            doc.notes.append(f"the head's cost measured by the relaunch is c = {again['cost']:.3f} (the proof used "
                             f"{proof['cost']:.3f}, {proof['cost_source']}); at c = {again['cost']:.3f} the cost model "
                             f"predicts {again['modelled_change']:+.1%} [{again['modelled_ci'][0]:+.1%}, "
                             f"{again['modelled_ci'][1]:+.1%}] tokens per unit time for the fix: "
                             + {True: "it pays", False: "it costs", None: "undecided"}[again["pays"]])


__all__ = ["STEPS_SOURCE", "fix_stage", "fix_tail", "measure_fix", "speed_decision", "measured_cost", "modelled_change",
           "nextn_draft_cost", "propose", "repriced", "state_fix", "steps_fix", "steps_proof"]
