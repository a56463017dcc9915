"""Sampled verification (``sampled_verify``, cheap): the live prompts answered at a temperature > 0, and the engine's
accept length of each answer against what the draft, run offline on the served states of that same sampled answer,
says verification must accept.

Why the offline chain predicts the accept length at T > 0 exactly, per request (read in the installed packages):

* SGLang 0.5.23, default (no ``--speculative-use-rejection-sampling``): the draft proposes its top-k / argmax tokens
  whatever the temperature (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.draft_forward`` /
  ``_draft_extend``: ``fast_topk`` / ``argmax``; ``sglang/srt/speculative/spec_utils.py::renorm_draft_probs``: the
  draft's probabilities are temperature-scaled only under rejection sampling, so a tree's top-k does not move with T).
  Verify (``sglang/srt/speculative/eagle_utils.py::eagle_sample``) takes
  ``sglang/kernels/ops/speculative/verify_sampling.py::tree_speculative_sampling_target_only`` with
  ``draft_probs = zeros`` (the proposals one-hot). The kernel (``sglang/kernels/jit/include/sgl_kernel/speculative/
  sampling.cuh::TreeSpeculativeSamplingTargetOnly``): at each depth one coin walks the children of the last accepted
  node in order, accepting child ``x`` when ``coin < prob_acc / threshold_acc`` or ``p(x) >= threshold_single``
  (``prob_acc`` the target's probabilities of the children tried so far); an accepted child is the token emitted at
  that position; a rejected child's target probability is copied into ``draft_probs``, so the final token is sampled
  from ``relu(p - draft_probs)``: never a rejected child. Hence a draft node is accepted **iff it equals the token
  emitted at its position**, for chains and topk > 1 trees, and with relaxed acceptance
  (``--speculative-accept-threshold-single/-acc`` < 1) too (the thresholds change *which* token is emitted, never
  that the accepted one is it). Conditional on the emitted continuation, acceptance is deterministic: the greedy walk
  of :func:`helpers.draft.simulate.simulate_sequences` (drafts compared with the continuation tokens,
  ``verify_tree_greedy_func``'s rule) on the served states of the sampled continuation gives the engine's verify
  steps exactly, as at T = 0.
* SGLang on CPU / XPU (and HIP without rejection sampling): ``eagle_utils.py::_verify_uses_greedy`` is true whatever
  the temperature, so verify commits the target's **argmax** (``verify_tree_greedy_func``) at T > 0 as well: after
  the prefill's first token (sampled at T by the target's sampler) the answer is greedy. The rule above holds
  trivially (the emitted token is the argmax); the probe then checks the greedy verify on a sampled first token,
  and says so (``evidence.greedy_verify``).
* SGLang with ``--speculative-use-rejection-sampling`` (chain only): the draft *samples* its proposals
  (``spec_utils.py::sample_draft_proposal``, ``EagleDraftWorker``): the offline chain's argmax proposals are not the
  server's, so the probe does not apply (``applies`` says so). (The token-by-token verify itself,
  ``sglang/kernels/ops/speculative/reject_sampling.py::speculative_sampling_classic_kernel``, accepts when
  ``coin * q < p``, so a rejected ``x`` has ``p(x) < q(x)``, where the residual ``max(p - q, 0)`` is 0: "accepted iff
  emitted" holds there too; ``--speculative-use-block-verification`` accepts a prefix jointly and does not keep it.)
* vLLM 0.32.0: ``vllm/config/speculative.py::SpeculativeConfig.draft_sample_method`` ``greedy`` (default) with
  ``rejection_sample_method`` ``standard``: ``vllm/v1/sample/rejection_sampler.py::rejection_random_sample_kernel``
  runs with ``NO_DRAFT_PROBS`` (``draft_prob = 1``: accepted when ``p(x) >= u``) and ``sample_recovered_tokens_kernel``
  masks the draft token out of the recovered distribution (``vocab_offset != draft_token_id``): accepted iff emitted,
  a chain. ``probabilistic`` drafts sample their proposals, ``synthetic`` accepts by a calibrated coin and ``block``
  verifies a block jointly: none is predicted by the greedy chain, so the probe does not apply there.
  That rule assumes the verify rows carry the request's own temperature / top-k / top-p
  (``rejection_sampler.py::apply_sampling_constraints`` expands them with ``expand_batch_to_tokens``). On the CPU
  backend without Triton the expand is ``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``, which writes into
  int64 copies and never copies back: the rows get uninitialised values (NaN or uniform target probabilities), a
  rejected draft can be re-drawn as the recovered token, and the identity breaks. The worker extension checks that
  function on known values at every describe (``helpers.engines.vllm_worker._verify_sampling_check``); when it
  fails, the adapter's ``verify_sampling_fault`` makes the probe name ``verify_sampling_params_wrong`` (its
  evidence: the values sent and returned) rather than a verify accept rule it did not observe.

A clean engine therefore gives the offline prediction exactly (an identity, like the budget's engine stage); a
verification that rejects drafts the emitted tokens match (a coin not coupled to the emitted token, a kernel that
compares the wrong node, a lost threshold) shows as accept length lost at T > 0 only, which the greedy budget cannot
see. The gap (offline minus live, paired per prompt, :func:`helpers.investigation.probes.base.paired_condition_loss`)
is decided like a budget stage. An engine that computes the draft differently (the budget's engine stage) loses at
every temperature, so a gap that counts is measured once more at T = 0 on the same prompts (the same capture, greedy:
a clean case costs nothing more): the sampled verify's own loss is the gap at T minus the gap at T = 0, per prompt
(:func:`greedy_adjusted`), and only that counting is ``sampled_verify_loses_acceptance``. The accept length at T = 0
(the budget's live answers, ``ctx.cold``) beside the one at T is evidence only: the sampled text is another text.
"""
from __future__ import annotations

from types import SimpleNamespace

from typing import Optional

import pandas as pd

from ...diagnosis.detectors import finding
from ...draft.budget import _loss
from ...draft.sequences import dump_sequences
from ...draft.simulate import DraftSettings, simulate_sequences, summary
from ...errors import BadInput
from .base import Probe, ProbeContext, ProbeResult, paired_condition_loss
from .oracle import _ci
from .trace import checkpoint_draft

#: the probe's sampling unless ``ctx.sampling`` says otherwise (SGLang names; ``sampling_seed`` + prompt index per
#: request, the same on every run: ``helpers.capture.sampling_params``)
DEFAULT_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "sampling_seed": 0}
SOURCE = ("engine-state probe sampled_verify: the live prompts answered at temperature > 0, the draft run offline on "
          "the served states of each sampled answer (helpers.draft.simulate.simulate_sequences: a draft accepted iff "
          "it is the emitted token, the target-only sampling verify's rule, sglang/kernels/jit/include/sgl_kernel/"
          "speculative/sampling.cuh) against the same answers' spec_verify_ct (helpers.investigation.probes.sampled)")


#: the smallest temperature either engine samples at: below it both decode greedily, so a probe "at temperature > 0"
#: would check the greedy verify. SGLang 0.5.23 turns ``0 <= temperature < 1e-6`` into top-k 1
#: (``sglang/srt/sampling/sampling_params.py::SamplingParams.__init__``, ``_SAMPLING_EPS = 1e-6``); vLLM 0.32.0 takes
#: ``temperature < 1e-5`` as greedy (``vllm/sampling_params.py::SamplingParams.sampling_type`` and ``__post_init__``,
#: ``_SAMPLING_EPS = 1e-5``). The larger of the two.
MIN_TEMPERATURE = 1e-5
#: the largest temperature taken: above it the target's softmax is near uniform over the vocabulary (logits of an LLM
#: span a few tens), so the sampled answers are noise and no acceptance question is asked of them
MAX_TEMPERATURE = 10.0
#: the smallest top-p taken: top-p ``p`` keeps the top token alone wherever its probability is at least ``p``, so a
#: top-p below 1 % samples greedily at nearly every position (the greedy verify again)
MIN_TOP_P = 0.01
#: the largest top-k taken: SGLang 0.5.23's "whole vocabulary" value (``sampling_params.py::TOP_K_ALL = 1 << 30``),
#: more than any vocabulary; a larger one is no vocabulary's (and passes the engines' int32 top-k tensors' range)
MAX_TOP_K = 1 << 30


def probe_sampling(ctx: ProbeContext) -> dict:
    """The sampling the probe sends: :data:`DEFAULT_SAMPLING` with ``ctx.sampling`` laid over it.

    Raises:
        BadInput: naming the flag: a temperature that is not a finite number in [:data:`MIN_TEMPERATURE`,
            :data:`MAX_TEMPERATURE`] (``--probe-temperature``: below, both engines decode greedily), a top-p outside
            [:data:`MIN_TOP_P`, 1] (``--probe-top-p``), a top-k that is neither -1 (off) nor in 2 ..
            :data:`MAX_TOP_K` (``--probe-top-k``: top-k 1 is greedy)."""
    sp = {**DEFAULT_SAMPLING, **(getattr(ctx, "sampling", None) or {})}
    t = sp.get("temperature")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        raise BadInput(f"expected a temperature in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}] for the sampled-verify "
                       f"probe, got {t!r} (below {MIN_TEMPERATURE:g} SGLang and vLLM decode greedily: "
                       "sglang/srt/sampling/sampling_params.py, vllm/sampling_params.py _SAMPLING_EPS; temperature 0 "
                       "is the acceptance budget's own measurement)", field="--probe-temperature")
    p = sp.get("top_p")
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not MIN_TOP_P <= p <= 1:
        raise BadInput(f"expected a top-p in [{MIN_TOP_P:g}, 1] (in (0, 1], and a smaller one keeps the top token "
                       f"alone: greedy), got {p!r}", field="--probe-top-p")
    k = sp.get("top_k")
    if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or 2 <= k <= MAX_TOP_K):
        raise BadInput(f"expected a top-k of -1 (off) or 2 .. {MAX_TOP_K} (top-k 1 is greedy), got {k!r}",
                       field="--probe-top-k")
    return sp


def check_sampling(sampling: Optional[dict]) -> dict:
    """:func:`probe_sampling` of a sampling given on its own (``investigate``'s ``probe_sampling``), before any work.

    Raises:
        BadInput: as :func:`probe_sampling`."""
    return probe_sampling(SimpleNamespace(sampling=sampling))


def _al(df: Optional[pd.DataFrame]) -> Optional[float]:
    if df is None or not len(df) or "verify_ct" not in df:
        return None
    ok = df[df["verify_ct"].fillna(0) > 0]
    return None if not len(ok) else float(summary(ok, 1)["accept_length"])


def per_prompt_gap(offline: pd.DataFrame, live: pd.DataFrame) -> pd.Series:
    """Per prompt (``prompt_id``), the offline accept length minus the live one (tokens per verify step, bonus token
    included), over the prompts both answered with verify steps, sorted by prompt id."""
    def al(df: pd.DataFrame) -> pd.Series:
        ok = df[df["verify_ct"].fillna(0) > 0]
        if "error" in ok:
            ok = ok[ok["error"].isna()]
        return pd.Series((ok["completion_tokens"].astype(float) / ok["verify_ct"].astype(float)).to_numpy(),
                         index=ok["prompt_id"].astype(str))
    a, b = al(offline), al(live)
    common = sorted(set(a.index) & set(b.index))
    return a[common] - b[common]


def greedy_adjusted(offline: pd.DataFrame, live: pd.DataFrame, offline0: pd.DataFrame, live0: pd.DataFrame,
                    temperature: float) -> dict:
    """The sampled verify's own loss: per prompt, the gap at T (:func:`per_prompt_gap` of ``offline`` / ``live``)
    minus the gap at T = 0 (``offline0`` / ``live0``, the same prompts answered greedy), decided like a budget stage
    (bootstrap CI over prompts, :func:`helpers.draft.budget._loss`; the threshold from the offline accept length at
    T); ``gap_at_t`` / ``gap_at_0``: the two mean gaps (tokens per verify step)."""
    g, g0 = per_prompt_gap(offline, live), per_prompt_gap(offline0, live0)
    common = sorted(set(g.index) & set(g0.index))
    per = [float(g[k] - g0[k]) for k in common]
    d, lo, hi = _ci(per) if len(per) >= 2 else (float("nan"),) * 3
    return _loss("sampled_verify", d, lo, hi, f"the gap (offline on the served states minus live, per prompt) at "
                 f"temperature {temperature} minus the same prompts' gap at temperature 0, paired over "
                 f"{len(per)} prompts", _al(offline), n=len(per), unit="prompts", per_sequence=per,
                 gap_at_t=float(g[common].mean()) if common else None,
                 gap_at_0=float(g0[common].mean()) if common else None)


def sampled_result(offline: pd.DataFrame, live: pd.DataFrame, *, sampling: dict, cold: Optional[pd.DataFrame] = None,
                   info: Optional[dict] = None, saved_to: Optional[str] = None,
                   greedy: Optional[tuple[pd.DataFrame, pd.DataFrame]] = None,
                   note: Optional[str] = None, params_fault: Optional[dict] = None) -> ProbeResult:
    """The probe's result from the offline prediction and the live answers of the same sampled requests.

    Args:
        offline: :func:`helpers.draft.simulate.simulate_sequences`'s per-request frame on the sampled answers' served
            states (``prompt_id``, ``completion_tokens``, ``verify_ct``, ...).
        live: the same answers' per-request frame (:data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS`).
        sampling: the sampling sent; cold: the budget's live frame at T = 0 (evidence only) or None; info: the
            server's ``/server_info`` (its accept thresholds and platform, evidence).
        greedy: ``(offline, live)`` of the same prompts at T = 0 (measured by the probe when the gap at T counts):
            the loss decided is then :func:`greedy_adjusted` (the gap at T beyond the one at T = 0), the gap at T
            kept as ``evidence.gap``.
        note: the engine adapter's ``verify_note`` (a platform that verifies with the argmax at any temperature),
            kept as ``evidence.greedy_verify`` and the result's ``why``.
        params_fault: the engine adapter's ``verify_sampling_fault`` (the server's own check shows its verify rows
            scaled by other sampling values than the request's): the finding ``verify_sampling_params_wrong`` with
            that check as evidence, whatever the gap's decision (the gap is then not the accept rule's alone:
            ``sampled_verify_loses_acceptance`` is not named beside it, the measured gap is the finding's loss).

    Returns: decision ``counts`` (``sampled_verify_loses_acceptance``) / ``clear`` / ``undecided`` of the loss
    offline minus live (tokens per verify step, bonus token included; positive = the engine accepted fewer), with
    ``evidence``: the accept lengths (offline, live, at T = 0), the prompts whose verify steps equal the prediction
    exactly, the temperature."""
    p, info = SAMPLED_VERIFY, info or {}
    loss = paired_condition_loss("sampled_verify", offline, live,
                                 f"the draft offline on the served states of the same answers at temperature "
                                 f"{sampling['temperature']} vs their live counters, paired per prompt")
    pair = offline[["prompt_id", "verify_ct"]].merge(live[["prompt_id", "verify_ct"]], on="prompt_id",
                                                     suffixes=("_offline", "_live"))
    exact = int((pair["verify_ct_offline"] == pair["verify_ct_live"]).sum())
    ev = {"sampling": dict(sampling), "offline_accept_length": _al(offline), "live_accept_length": _al(live),
          "greedy_accept_length": _al(cold), "prompts": int(len(live)), "paired": int(len(pair)),
          "exact_prompts": exact, "failed": int(live["error"].notna().sum()) if "error" in live else 0,
          "accept_thresholds": {k: info.get(f"speculative_accept_threshold_{k}") for k in ("single", "acc")},
          "greedy_verify": note,
          "note": "the accept length at temperature 0 (the budget's live answers) is of another text: evidence, not "
                  "a loss"}
    if saved_to:
        ev["saved_to"] = saved_to
    if greedy is not None:
        ev["gap"] = {k: loss.get(k) for k in ("delta", "ci", "decision", "n")}
        loss = greedy_adjusted(offline, live, greedy[0], greedy[1], sampling["temperature"])
        ev["greedy_offline_accept_length"], ev["greedy_live_accept_length"] = _al(greedy[0]), _al(greedy[1])
    res = ProbeResult(p.name, p.cost, p.condition, decision=loss["decision"], loss=loss, evidence=ev,
                      saved_to=[saved_to] if saved_to else [], why=ev["greedy_verify"])
    ok = live["verify_ct"].fillna(0) > 0 if "verify_ct" in live else pd.Series([], dtype=bool)
    if not ok.any():
        errors = live["error"].dropna() if "error" in live else []
        res.status, res.decision = "failed", None
        res.why = ("no sampled request was answered with spec counters"
                   + (f" (first error: {errors.iloc[0]})" if len(errors) else ""))
        return res
    if greedy is not None and loss["decision"] != "counts" and loss.get("gap_at_0") is not None:
        res.why = "; ".join(x for x in (
            f"the gap at temperature {sampling['temperature']} ({loss['gap_at_t']:.2f} tokens per verify step) is "
            f"the engine's at temperature 0 as well ({loss['gap_at_0']:.2f}): the acceptance budget's engine stage, "
            "not the sampled verify", ev["greedy_verify"]) if x)
    if params_fault is not None:
        ev["verify_sampling"] = params_fault["evidence"]
        res.findings.append(finding(
            "verify_sampling_params_wrong", None,
            params_fault["detail"] + f". Measured at temperature {sampling['temperature']} on {loss.get('n')} "
            f"prompts: live {ev['live_accept_length']:.2f} vs offline on the same answers' served states "
            f"{ev['offline_accept_length']:.2f} tokens per verify step (gap {loss['decision']})",
            condition=p.name, loss=loss, probe=ev, temperature=sampling["temperature"],
            source=params_fault["source"] + "; " + SOURCE))
        if loss["decision"] != "counts":
            res.why = "; ".join(x for x in (res.why, "the server's verify rows use other sampling values than the "
                                            "request's (verify_sampling_params_wrong)") if x)
        return res
    if loss["decision"] == "counts":
        lo, hi = loss["ci"]
        res.findings.append(finding(
            "sampled_verify_loses_acceptance", None,
            f"at temperature {sampling['temperature']} the server accepts {ev['live_accept_length']:.2f} tokens per "
            f"verify step where its draft, run offline on the served states of the same answers, matches the emitted "
            f"tokens for {ev['offline_accept_length']:.2f}: {loss['delta']:.2f} [{lo:.2f}, {hi:.2f}] lost on "
            f"{loss['n']} prompts ({exact} of {len(pair)} exact)"
            + (f", beyond the gap of {loss['gap_at_0']:.2f} at temperature 0" if greedy is not None else "")
            + "; verification at temperature > 0 rejects drafts that are the tokens it emits",
            condition=p.name, loss=loss, probe=ev, temperature=sampling["temperature"], source=SOURCE))
    return res


def _settings(ctx: ProbeContext) -> DraftSettings:
    spec = ctx.att.spec or {}
    return DraftSettings(int(spec["num_steps"]), int(spec.get("topk") or 1), int(spec["num_draft_tokens"]))


def _applies(ctx: ProbeContext) -> Optional[str]:
    att = ctx.att
    if getattr(att, "draft_dir", None) is None or getattr(att, "target_dir", None) is None:
        return "the draft checkpoint or the target folder is not readable here: the draft cannot run offline"
    spec = getattr(att, "spec", None) or {}
    if not spec.get("num_steps") or not spec.get("num_draft_tokens"):
        return "the server reports no speculative steps / draft tokens"
    if ctx.max_new_tokens < 2:
        return "fewer than 2 tokens per request: no verify step to count"
    return ctx.adapter.sampled_verify_refusal(ctx.client.server_info())


def _run(ctx: ProbeContext) -> ProbeResult:
    sampling = probe_sampling(ctx)
    settings = _settings(ctx)
    draft = checkpoint_draft(ctx)
    folder = ctx.folder("sampled_verify")
    ctx.progress(f"engine state: sampled verify: {len(ctx.prompts)} prompts x {ctx.max_new_tokens} tokens at "
                 f"temperature {sampling['temperature']}, aux states and counters from the same answers")
    recs: list = []
    dump = ctx.adapter.capture_served(ctx.client, ctx.prompts, folder, name="sampled",
                                      max_new_tokens=ctx.max_new_tokens, records=recs,
                                      max_width=16 * int(draft.arch.target_hidden), sampling=sampling)
    live = pd.DataFrame(recs)
    offline = simulate_sequences(draft, dump_sequences(dump), [settings],
                                 max_new_tokens=ctx.max_new_tokens)["per_request"][settings]
    live.to_parquet(folder / "live.parquet")
    offline.to_parquet(folder / "offline.parquet")
    info, saved = ctx.client.server_info(), str(folder.relative_to(ctx.run_dir))
    fault = ctx.adapter.verify_sampling_fault(info)
    res = sampled_result(offline, live, sampling=sampling, cold=ctx.cold, info=info, saved_to=saved,
                         note=ctx.adapter.verify_note(info), params_fault=fault)
    if res.decision != "counts":
        return res
    ctx.progress("engine state: sampled verify: the gap counts; the same prompts at temperature 0 (is it the "
                 "engine's at every temperature?)")
    recs0: list = []
    dump0 = ctx.adapter.capture_served(ctx.client, ctx.prompts, folder, name="greedy",
                                       max_new_tokens=ctx.max_new_tokens, records=recs0,
                                       max_width=16 * int(draft.arch.target_hidden))
    live0 = pd.DataFrame(recs0)
    offline0 = simulate_sequences(draft, dump_sequences(dump0), [settings],
                                  max_new_tokens=ctx.max_new_tokens)["per_request"][settings]
    live0.to_parquet(folder / "greedy_live.parquet")
    offline0.to_parquet(folder / "greedy_offline.parquet")
    return sampled_result(offline, live, sampling=sampling, cold=ctx.cold, info=info, saved_to=saved,
                          note=ctx.adapter.verify_note(info),
                          greedy=(offline0, live0), params_fault=fault)


SAMPLED_VERIFY = Probe("sampled_verify", "cheap", "at temperature > 0 (sampled answers)",
                       "does verification at temperature > 0 accept exactly the drafts that are the tokens it emits?",
                       _run, applies=_applies,
                       estimate_s=lambda ctx: 3.0 + 0.05 * len(ctx.prompts) * ctx.max_new_tokens,
                       part="verification", mtp="offline head",
                       mtp_why="the head runs offline on the served states of the sampled answers "
                               "(helpers.draft.loader.load_draft -> helpers.draft.nextn.NextNHead, "
                               "sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward); NEXTN verifies as "
                               "EAGLE (sglang/srt/arg_groups/speculative_hook.py::_resolve_speculative_algorithm_alias)")

__all__ = ["DEFAULT_SAMPLING", "SAMPLED_VERIFY", "check_sampling", "greedy_adjusted", "per_prompt_gap",
           "probe_sampling",
           "sampled_result"]
