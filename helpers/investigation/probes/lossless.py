"""Greedy losslessness (``greedy_lossless``, restart): at temperature 0 speculative decoding must emit the target's
own greedy tokens. The same prompts are sent greedy to the server (the cold arm of
:func:`helpers.investigation.probes.cache.cold_arm`) and to a restarted copy without the draft (every
``--speculative-*`` flag dropped: the target alone), and the two outputs are compared token by token.

Verification computes the target's logits of the drafted positions in one extend pass (SGLang 0.5.23:
``sglang/srt/speculative/eagle_worker_v2.py::EAGLEWorkerV2.verify``, greedy acceptance in
``sglang/srt/speculative/eagle_utils.py`` / ``verify_tree_greedy``), the target alone one position per decode step:
the two are different kernels, so a token whose two best logits are within rounding of each other (a near tie) can
come out either way without any fault. The copy is therefore asked for its top-2 log-probabilities at each output
position (SGLang ``return_logprob`` / ``top_logprobs_num``, ``meta_info.output_top_logprobs``,
``sglang/srt/managers/tokenizer_manager.py::TokenizerManager.convert_logprob_style``; vLLM 0.32.0: ``logprobs: 2``
with ``return_tokens_as_token_ids``, the adapter's ``top_logprobs_fields``, mapped to the same field by
``helpers.engines.vllm_answers.meta_info``): a divergence where the
speculative token is the target's runner-up within :data:`NEAR_TIE` nats is a near tie (said, not a finding); any
other divergence is ``speculation_not_lossless``, naming the first differing token of each prompt. A divergence whose
margin the copy did not return is ``undecided``.
"""
from __future__ import annotations

from typing import Any, Optional

from ...diagnosis.detectors import finding
from ...errors import ServerError
from ...runfiles import write_json
from .base import Probe, ProbeContext, ProbeResult, send_greedy
from .cache import cold_arm

#: log-probability gap (nats) between the target's two best tokens under which a divergence is a near tie
NEAR_TIE = 0.01


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """The first output position where ``a`` and ``b`` differ (one ending before the other counts at its end), or
    None when they are the same."""
    for j, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return j
    return None if len(a) == len(b) else min(len(a), len(b))


def top2(meta: Any, j: int) -> Optional[list[tuple[float, int]]]:
    """``[(logprob, token id), ...]`` of output position ``j`` from a ``meta_info`` with ``output_top_logprobs``
    (each entry ``[logprob, token_id, text]``: SGLang's, or vLLM's as its adapter maps them), or None when absent."""
    extra = getattr(meta, "model_extra", None) or (meta if isinstance(meta, dict) else {})
    tops = extra.get("output_top_logprobs")
    if not isinstance(tops, list) or j >= len(tops) or not isinstance(tops[j], list):
        return None
    out = []
    for e in tops[j]:
        if isinstance(e, (list, tuple)) and len(e) >= 2 and isinstance(e[0], (int, float)) and isinstance(e[1], int):
            out.append((float(e[0]), int(e[1])))
    return out or None


def classify(spec: list[int], base: list[int], tops: Optional[list[tuple[float, int]]], j: int) -> dict:
    """One prompt's divergence at ``j``: ``{"position", "speculative", "target", "margin", "near_tie"}``;
    ``near_tie`` None when the margin is unknown."""
    s = spec[j] if j < len(spec) else None
    t = base[j] if j < len(base) else None
    out = {"position": j, "speculative": s, "target": t, "margin": None, "near_tie": None}
    if tops and s is not None:
        lp = dict((tok, v) for v, tok in tops)
        best = max(v for v, _ in tops)
        if s in lp:
            out["margin"] = round(best - lp[s], 6)
            out["near_tie"] = out["margin"] < NEAR_TIE
        elif len(tops) >= 2:
            out["margin"] = None
            out["near_tie"] = False       # not even the target's runner-up
    return out


def _run(ctx: ProbeContext) -> ProbeResult:
    p = GREEDY_LOSSLESS
    cold, spec_out = cold_arm(ctx)
    folder = ctx.folder("greedy_lossless")
    ctx.progress("engine state: greedy losslessness: starting a copy without the draft ...")
    handle = ctx.adapter.start_variant(ctx.att.restart, keep_draft=False, api_key=ctx.api_key, port=ctx.port,
                                       log_path=folder / "server.log", budget=ctx.dl,
                                       what="the target alone (--engine-probes all)")
    base_out, metas = [], []
    try:
        client = ctx.adapter.client(handle.url, ctx.api_key, timeout=ctx.client.timeout, budget=ctx.dl)
        try:
            for i, q in enumerate(ctx.prompts):
                client.flush_cache()
                row, out, res = send_greedy(client, ctx.adapter, i, q, ctx.max_new_tokens, top_logprobs=2)
                if res is None:
                    raise ServerError(f"the target alone did not answer prompt {q.id}: {row['error']}")
                base_out.append(out)
                metas.append(res.meta_info)
        finally:
            client.close()
    finally:
        handle.stop()
    rows, div = [], []
    for q, s, b, m in zip(ctx.prompts, spec_out, base_out, metas):
        j = first_divergence(s, b)
        rows.append({"prompt_id": q.id, "speculative": s, "target_alone": b, "first_divergence": j})
        if j is not None and s:
            div.append({"prompt_id": q.id, **classify(s, b, top2(m, j), j)})
    write_json(folder / "outputs.json", rows)
    real = [d for d in div if d["near_tie"] is False]
    unknown = [d for d in div if d["near_tie"] is None]
    ties = [d for d in div if d["near_tie"]]
    ev = {"prompts": len(rows), "diverging": len(div), "near_ties": ties, "divergences": real + unknown,
          "near_tie_nats": NEAR_TIE, "saved_to": str(folder.relative_to(ctx.run_dir))}
    res = ProbeResult(p.name, p.cost, p.condition, evidence=ev, saved_to=[ev["saved_to"]])
    if real:
        res.decision = "counts"
        first = "; ".join(f"{d['prompt_id']}: output token {d['position']} is {d['speculative']} with speculation, "
                          f"{d['target']} for the target alone" for d in real[:4])
        res.findings.append(finding(
            "speculation_not_lossless", None,
            f"at temperature 0 the tokens with speculation differ from the target's own greedy tokens on "
            f"{len(real)} of {len(rows)} prompts beyond a near tie (margin >= {NEAR_TIE} nats): {first}",
            divergences=real, near_ties=len(ties),
            source="engine-state probe greedy_lossless: the server's greedy answers against a restarted copy "
                   "without the draft, top-2 log-probabilities of the copy (helpers.investigation.probes.lossless)"))
    elif unknown:
        res.decision = "undecided"
        res.why = (f"{len(unknown)} prompt(s) diverge where the copy returned no top-2 log-probabilities: a near "
                   "tie is not ruled out")
    else:
        res.decision = "clear"
        if ties:
            res.why = (f"{len(ties)} prompt(s) diverge only at near ties of the target (margin < {NEAR_TIE} nats): "
                       "verify and decode are different kernels")
    return res


def _applies(ctx: ProbeContext) -> Optional[str]:
    return None if ctx.max_new_tokens >= 2 else "fewer than 2 tokens per request: nothing to compare"


GREEDY_LOSSLESS = Probe("greedy_lossless", "restart", "against the target alone at temperature 0",
                        "does speculation at temperature 0 emit the target's own greedy tokens?", _run,
                        applies=_applies, estimate_s=lambda ctx: 90.0 + 0.05 * len(ctx.prompts) * ctx.max_new_tokens,
                        part="verification",
                        mtp_why="the copy drops every --speculative-* flag, the head with them: the target alone "
                                "decodes (a NextN head is no model of its own: sglang/srt/models/deepseek_nextn.py::"
                                "DeepseekV3ForCausalLMNextN is built only for the draft runner)")

__all__ = ["GREEDY_LOSSLESS", "NEAR_TIE", "classify", "first_divergence", "top2"]
