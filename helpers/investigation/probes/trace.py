"""The served draft's own computation, step by step: two cheap probes on a server that runs the draft step trace
(SGLang: :mod:`helpers.trace_hooks`, ``python -m helpers server start --trace-draft DIR``; vLLM: the tool's worker
extension, whose ``drafter.propose`` wrapper records each cycle's proposals, :mod:`helpers.engines.vllm_worker`),
sent through the engine adapter (``trace_requests``).

* ``step_trace``: the live prompts sent greedy, one at a time, the prefix cache flushed before each, with
  ``return_hidden_states`` and the trace armed; every draft step the server proposed is compared with the
  checkpoint's proposal on the very states it fed (:func:`helpers.draft.trace.compare_trace`). A request whose draft
  diverges at step 1 is ``served_draft_differs`` (the served draft's weights or its inputs), one that diverges only
  from step 2 on is ``draft_kv_diverges`` (the draft's own KV or positions).
* ``served_draft``: one short fixed prompt (:data:`FIXED_PROMPT`, a few cycles), the same comparison: the served
  draft against its checkpoint on a known input, cheap enough to run at attach and after a weight sync or a resume.

Tensor-level check: SGLang 0.5.23's ``/get_weights_by_name`` does **not** reach the draft. The route
(``sglang/srt/entrypoints/http_server.py::get_weights_by_name``) goes through
``managers/tokenizer_control_mixin.py::get_weights_by_name`` to the scheduler's
``managers/scheduler_components/weight_updater.py::WeightUpdater.get_weights_by_name``, which asks ``self.tp_worker``
(the target's ``TpModelWorker``, ``managers/tp_worker.py::TpModelWorker.get_weights_by_name`` ->
``model_runner_components/weight_exporter.py::get_weights_by_name`` -> the target model's ``get_weights_by_name``);
``GetWeightsByNameReqInput`` (``managers/io_struct.py``) has only ``name`` and ``truncate_size``, no role, unlike the
weight updates that take ``roles`` and reach ``self.draft_worker``. So the served draft is compared by its
proposals, not its tensors.

Skipped, saying how to enable it, when the server runs no trace hook or its folder is not readable here; both need the
draft checkpoint and the target's embedding on this machine (:meth:`helpers.draft.model.Eagle3Draft.load`).
"""
from __future__ import annotations

import contextlib
from typing import Optional

from ...acceptance.lifecycle import FIXED_NEW_TOKENS, FIXED_PROMPT
from ...acceptance.prompts import Prompt
from ...diagnosis.detectors import finding
from ...draft.loader import load_draft
from ...draft.model import Eagle3Draft
from ...draft.precision import choose_dtype, server_dtype
from ...draft.trace import brief, compare_trace, write_result
from ...formats.configs import read_draft_config
from ...trace_hooks import HOW, trace_dir  # noqa: F401  (re-exported: the probes' callers import them here)
from .base import Probe, ProbeContext, ProbeResult

# the fixed input of ``served_draft`` (FIXED_PROMPT, FIXED_NEW_TOKENS): token ids below every vocabulary this tool
# serves (the reference target's is 4096), the same on every run so two runs of one server compare; ``watch``'s fixed
# probe sends the same (helpers.acceptance.lifecycle)


#: why the trace probes run on an MTP / NextN head with its offline head (SGLang 0.5.23)
MTP_TRACE = ("the trace hook records the head's logits processor (SGLang renames a DeepseekV3ForCausalLM draft "
             "DeepseekV3ForCausalLMNextN: sglang/srt/configs/model_config.py::ModelConfig._config_draft_model; no d2t: "
             "the head drafts in the target's vocabulary), compared with the head run offline "
             "(helpers.draft.loader.load_draft -> helpers.draft.nextn.NextNHead)")


def _applies(ctx: ProbeContext) -> Optional[str]:
    why = ctx.adapter.trace_unavailable(ctx.client)
    if why is not None:
        return why
    if getattr(ctx.att, "draft_dir", None) is None:
        return "the draft checkpoint is not readable here (pass --draft): nothing to compare the served draft with"
    if ctx.max_new_tokens < 2:
        return "fewer than 2 tokens per request: no verify step to trace"
    return None


#: the ``ctx.extra`` key under which a stage that loaded the checkpoint already hands it to the probes, as ``(draft,
#: dtype)`` (the NextN budget's head: :func:`helpers.investigation.mtp.investigate_mtp`): :func:`checkpoint_draft`
#: takes it instead of loading the checkpoint again when its dtype is the one the probes choose
LOADED_DRAFT = "loaded_draft"


def checkpoint_draft(ctx: ProbeContext) -> Eagle3Draft:
    """The draft checkpoint (``ctx.att.draft_dir``, the target's embedding from ``ctx.att.target_dir``) loaded once
    per run at the server's dtype as this CPU runs it, shared by the probes that run it offline (``ctx.extra``); the
    one a stage of the run loaded already at that dtype (``ctx.extra[LOADED_DRAFT]``) is taken as it is.

    Raises:
        BadInput: the checkpoint cannot be run offline (:meth:`helpers.draft.model.Eagle3Draft.load`)."""
    if "trace_draft" not in ctx.extra:
        att = ctx.att
        choice = choose_dtype(server_dtype(ctx.client.server_info(), read_draft_config(att.draft_dir).raw), "cpu")
        given, given_dtype = ctx.extra.get(LOADED_DRAFT) or (None, None)
        ctx.extra["trace_draft"] = given if given is not None and given_dtype == choice.dtype else load_draft(
            att.draft_dir, att.target_dir, dtype=choice.dtype, dtype_reason=choice.reason,
            loader=ctx.adapter.loader_rules(att.version))
    return ctx.extra["trace_draft"]


def traced(ctx: ProbeContext, prompts: list, max_new_tokens: int, tag: str) -> dict:
    """Send ``prompts`` (:class:`helpers.acceptance.prompts.Prompt`: text or token ids) greedy, one at a time, the
    cache flushed before each, with the trace armed (the engine adapter's ``trace_requests``), and compare (see the
    module docstring); returns :func:`helpers.draft.trace.compare_trace`'s result with ``prompt_ids`` (request id
    -> prompt id) added.

    Raises:
        BadInput: the server wrote no trace for them (the folder is not the one it writes to)."""
    folder = ctx.folder(f"{tag}-requests")
    try:
        seqs, records = ctx.adapter.trace_requests(ctx.client, prompts, max_new_tokens=max_new_tokens, tag=tag,
                                                   folder=folder)
    finally:
        with contextlib.suppress(OSError):
            folder.rmdir()                 # this call's own new folder, left only when the engine wrote into it
    out = compare_trace(checkpoint_draft(ctx), seqs, records)
    out["prompt_ids"] = {s.key: str(q.id) for s, q in zip(seqs, prompts)}
    return out


def _result(p: Probe, ctx: ProbeContext, cmp: dict, what: str) -> ProbeResult:
    folder = ctx.folder(p.name)
    write_result(folder / "trace_comparison.json", cmp)
    ev = brief(cmp) | {"saved_to": str(folder.relative_to(ctx.run_dir)), "compared_on": what}
    res = ProbeResult(p.name, p.cost, p.condition, evidence=ev, saved_to=[ev["saved_to"]])
    reqs = cmp["requests"]
    if not reqs:
        res.decision, res.why = "undecided", "no traced request could be aligned with its served states"
        return res
    kind = cmp["mechanism"]
    if kind is None:
        rows = sum(sum(r["compared"].values()) for r in reqs)
        if rows == 0:
            # compare_request leaves out the rows past the served states (the draft runs after the last verify too)
            cycles = sum(int(r.get("cycles") or 0) for r in reqs)
            res.decision, res.why = "undecided", (
                f"no traced draft step could be compared: the {cycles} traced cycle(s) of {len(reqs)} request(s) all "
                "start outside the positions of the states the server returned for them, so nothing was replayed on "
                "the checkpoint; trace longer answers (more new tokens)")
            return res
        res.decision, res.why = "clear", f"{rows} draft steps of {len(reqs)} request(s) equal the checkpoint's"
        return res
    res.decision = "counts"
    bad = [r for r in reqs if r["first"] is not None]
    step1 = [r for r in bad if r["first"]["step"] == 1]
    shown = (step1 or bad)[:3]
    where = "; ".join(f"{cmp['prompt_ids'].get(r['rid'], r['rid'])}: step {r['first']['step']} at position "
                      f"{r['first']['position']} ({r['first']['why']})" for r in shown)
    per_step: dict = {}
    for r in reqs:
        for s, n in r["diverged"].items():
            per_step[s] = per_step.get(s, 0) + n
    common = dict(first_steps=cmp["first_steps"], diverged_per_step=per_step, requests=len(reqs),
                  diverging_requests=len(bad), probe=p.name, trace=ev["saved_to"])
    ct = cmp.get("current_token") or {}
    if kind == "served_draft_differs" and ct.get("named"):
        res.findings.append(finding(
            "draft_extend_ids_unshifted", None,
            f"the served draft's step-1 proposals differ from its checkpoint's on the very states the server fed "
            f"({len(step1)} of {len(reqs)} request(s), {what}), and the checkpoint replayed with the current token's "
            f"id in place of the next one's reproduces {ct['explained']} of the {ct['diverging']} diverging step-1 "
            f"rows (the right ids: {ct['right_ids']}): the engine's draft extend feeds row p the token of p, not "
            f"p + 1: {where}",
            **common, current_token=ct,
            source=f"engine-state probe {p.name}: the draft step trace (helpers.trace_hooks) against "
                   "helpers.draft.trace.compare_trace and its current-token replay "
                   "(helpers.draft.trace.current_token_replay); the shift it lost: sglang/srt/speculative/"
                   "eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill"))
    elif kind == "served_draft_differs":
        res.findings.append(finding(
            kind, None,
            f"the served draft's step-1 proposals differ from its checkpoint's on the very states the server fed "
            f"({len(step1)} of {len(reqs)} request(s), {what}): {where}; its weights or inputs are not the "
            "checkpoint's: reload the draft",
            **common, fix_words="reload the draft from its checkpoint (restart the server with it, or make the weight "
                                "update reach the draft model)",
            source=f"engine-state probe {p.name}: the draft step trace (helpers.trace_hooks) against "
                   "helpers.draft.trace.compare_trace"))
    else:
        res.findings.append(finding(
            kind, None,
            f"the served draft's proposals equal its checkpoint's at step 1 and differ from step 2 on ({len(bad)} of "
            f"{len(reqs)} request(s), {what}): {where}; the draft's own KV or positions in its decode steps, or a "
            "change of its weights too small to move any step-1 proposal (the trace holds proposals, not logits, so "
            "the two leave the same signature; measured on a NextN head: eh_proj x0.995 first changed a step-2 "
            "proposal)",
            **common, source=f"engine-state probe {p.name}: the draft step trace (helpers.trace_hooks) against "
                             "helpers.draft.trace.compare_trace"))
    return res


def _step_trace_run(ctx: ProbeContext) -> ProbeResult:
    prompts = list(ctx.prompts)
    ctx.progress(f"engine state: step trace: {len(prompts)} prompts x {ctx.max_new_tokens} tokens, traced")
    cmp = traced(ctx, prompts, ctx.max_new_tokens, "step-trace")
    return _result(STEP_TRACE, ctx, cmp, f"the {len(prompts)} live prompts")


def _served_draft_run(ctx: ProbeContext) -> ProbeResult:
    ctx.progress(f"engine state: served draft: the fixed prompt ({len(FIXED_PROMPT)} tokens), {FIXED_NEW_TOKENS} new "
                 "tokens, traced")
    cmp = traced(ctx, [Prompt(id="fixed", input_ids=FIXED_PROMPT, kind="fixed")], FIXED_NEW_TOKENS, "served-draft")
    return _result(SERVED_DRAFT, ctx, cmp, "the fixed prompt")


def _served_applies(ctx: ProbeContext) -> Optional[str]:
    why = _applies(ctx)
    if why is not None and why.startswith("fewer than 2"):
        return None                                  # the fixed prompt has its own length
    return why


STEP_TRACE = Probe("step_trace", "cheap", "the served draft step by step on the live prompts",
                   "does the served draft propose, step by step, what its checkpoint proposes on the same states?",
                   _step_trace_run, applies=_applies,
                   estimate_s=lambda ctx: 5.0 + 0.15 * len(ctx.prompts) * ctx.max_new_tokens, part="draft computation",
                   mtp="offline head", mtp_why=MTP_TRACE)
SERVED_DRAFT = Probe("served_draft", "cheap", "the served draft on a fixed input",
                     "is the served draft its checkpoint (its step-1 proposals on a fixed prompt)?",
                     _served_draft_run, applies=_served_applies, estimate_s=lambda ctx: 8.0, part="served weights",
                     mtp="offline head", mtp_why=MTP_TRACE + "; the served weights are the target checkpoint's extra "
                     "layer model.layers.{num_hidden_layers}.* (deepseek_nextn.py::DeepseekV3ForCausalLMNextN."
                     "load_weights), so a weight update of the target reaches them only through the draft worker")

#: the trace findings of a step-1 divergence (the served draft's weights or inputs; the draft-extend ids unshifted is
#: one such input, named when the offline replay explains it: helpers.draft.trace.current_token_hypothesis)
STEP1_KINDS = ("served_draft_differs", "draft_extend_ids_unshifted")


def reconcile(results: list[dict]) -> list[dict]:
    """The trace probes' mechanisms reconciled across one run (``results``: :meth:`ProbeResult.to_json` of the probes
    in run order; returned, the same list, changed in place). A step-1 divergence is the served draft's weights or
    inputs (``served_draft_differs``): the draft's own decode KV is never read at step 1 (the draft-extend rows,
    ``eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill`` / ``_draft_extend_for_decode``, write the
    committed slots and attend over them; ``draft_forward``'s decode steps follow), while changed weights change
    every step, so a request whose first changed top-1 lands at step 2 or later is what a small weights change
    does too (measured on a NextN head: the head's ``eh_proj`` x0.981 changed the fixed prompt's proposals first at
    step 3 and 6 of 12 live prompts' from step 1). So when one trace probe names ``served_draft_differs``, another's
    ``draft_kv_diverges`` is not a second mechanism: that finding is dropped, its decision stays ``counts`` (its
    proposals do differ) and ``why`` says which probe explains it. Each alone is unchanged."""
    trace = [r for r in results if r.get("probe") in (SERVED_DRAFT.name, STEP_TRACE.name)]
    step1 = [r["probe"] for r in trace if any(f.get("kind") in STEP1_KINDS for f in r.get("findings") or [])]
    if not step1:
        return results
    for r in trace:
        kv = [f for f in r.get("findings") or [] if f.get("kind") == "draft_kv_diverges"]
        if kv and r["probe"] not in step1:
            r["findings"] = [f for f in r["findings"] if f.get("kind") != "draft_kv_diverges"]
            r["why"] = (f"its proposals first differ from step 2 on, explained by the served draft's step-1 "
                        f"divergence that {', '.join(step1)} saw (changed weights or inputs change every step; the "
                        "draft's own decode KV never changes step 1): draft_kv_diverges not named")
    return results


__all__ = ["FIXED_PROMPT", "LOADED_DRAFT", "SERVED_DRAFT", "STEP_TRACE", "checkpoint_draft", "reconcile", "trace_dir",
           "traced"]
