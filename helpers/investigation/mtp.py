"""The live investigation of an MTP / NextN head (``investigate`` on a server run with ``--speculative-algorithm
NEXTN``): what hidden state the head reads, the head run offline on it, and the live accept length.

What SGLang 0.5.23 feeds the head (read in the installed source):

* the head reads ``forward_batch.spec_info.hidden_states`` (``sglang/srt/models/deepseek_nextn.py::
  DeepseekModelNextN.forward``: ``hnorm(previous_hidden_states)`` concatenated after ``enorm(embed(x_{t+1}))``);
* that tensor is the target's ``logits_output.hidden_states``: ``sglang/srt/models/deepseek_v2.py::
  DeepseekV2Model.forward`` ends with ``residual_batch.final_norm(hidden_states, forward_batch, self.norm)`` (the
  final RMSNorm applied), ``DeepseekV2ForCausalLM.forward`` passes it to the logits processor with no aux hidden
  states (NEXTN is EAGLE, not EAGLE-3: ``capture_aux_hidden_states`` stays False) and no ``hidden_states_before_norm``,
  and ``sglang/srt/layers/logits_processor.py::LogitsProcessor._get_hidden_states_to_store`` stores
  ``hidden_states`` as is (FULL / LAST capture mode of the EAGLE worker);
* ``/generate`` with ``return_hidden_states`` returns that same tensor per token (prompt rows, then one row per
  generated token): the **target's final hidden state after its final norm**, ``norm(out(n-1))`` below.

Measured on the embedded Kimi-class target (``env/models/kimi/target``, TP 1, float32): the served rows equal
``norm(out(n-1))`` of the HF every-layer reference of the same tokens to 4e-7 relative (Frobenius), ``out(n-1)``
(pre-norm) is 0.73-0.80 away, ``out(n-2)`` 0.84-0.93, the final norm applied twice 0.02 (this target's final-norm
weight is near uniform: 1.80 +- 0.04) (:func:`identify_state`).

The stages (:func:`mtp_budget`), each accept length (tokens per verify step, bonus included) with its bootstrap CI:

* ``checkpoint (teacher-forced)`` -- the head against its own training log, same metric, steps and rows
  (:func:`helpers.draft.nextn_stage.nextn_draft_stage`): the ``draft`` loss, log - checkpoint.

then on the same live prompts (the server's own greedy continuation):

* ``draft`` -- the head run offline (:func:`helpers.draft.loader.load_draft`, the engine's chain replayed by
  :func:`helpers.draft.simulate.simulate_sequences`) on the reference states ``norm(out(n-1))``: what the head can
  do when fed right.
* ``wiring`` -- the same on the served states: the paired loss reference - served decides whether what the server
  feeds costs acceptance (:func:`helpers.draft.decide.decide`).
* ``engine`` -- the live counters (``meta_info`` ``spec_verify_ct``, ``completion_tokens``) against the offline run
  on the served states: a loss after the capture point.

The same stages run for vLLM's EAGLE-1 draft (``method: eagle``), which also reads the one post-norm state: the
functions take a :class:`helpers.investigation.single_state.SingleStateDraft` profile (None: :data:`NEXTN`, the
wording and sources above; :data:`helpers.investigation.single_state.EAGLE1`: vLLM's).
"""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd
import torch

from ..acceptance.prompts import load_prompts
from ..acceptance.stats import format_ci
from ..diagnosis.detectors import finding
from ..draft.loader import OFFLINE_HEADS, load_draft
from ..draft.mtp_checks import engine_head_layers
from ..draft.mtp_weights import head_weight_findings
from ..draft.nextn_stage import STEPS_SOURCE, nextn_draft_stage, steps_check
from ..draft.precision import choose_dtype, server_dtype
from ..records import Finding
from ..draft.budget import _loss, _not_computed, _paired_loss, _stage, cause_of, engine_parts_text
from ..draft.decide import threshold
from ..draft.attention import _rms
from ..draft.model import target_final_norm
from ..draft.sequences import SAME_STATES, dump_sequences, reference_sequences as ref_sequences
from ..draft.simulate import DraftSettings, SimSequence, simulate_sequences
from ..errors import BadInput
from ..formats.configs import read_config_json, read_target_config
from ..formats.dumps import read_dump
from .attach import mtp_not_supported
from .engine_stage import budget_line, final_budget_line, run_engine_state
from .probes import join_engine_state
from .probes.trace import LOADED_DRAFT
from .single_state import EAGLE1, SingleStateDraft

#: the candidate the head should read (SGLang 0.5.23: the target's final hidden state after the final norm)
POST_NORM = "norm(out(n-1))"
#: the final norm applied twice (a capture path that norms the already normed state): near POST_NORM when the norm's
#: weight is near uniform, so it is a candidate of its own, never left to the threshold
TWICE = "norm(norm(out(n-1)))"
#: the budget's stage names (:func:`mtp_budget`), and the stage each loss is measured at (the ladder's rows, as
#: :data:`helpers.plots.budget.LOSS_AT` for an EAGLE-3 draft)
DRAFT_STAGE, WIRING_STAGE, LIVE_STAGE = "draft (offline, reference states)", "wiring (offline, served states)", "live"
#: the head against its training log (:func:`helpers.draft.nextn_stage.nextn_draft_stage`; the EAGLE-3 budget's name)
CHECKPOINT_STAGE = "checkpoint (teacher-forced)"
LOSS_AT = {"draft": CHECKPOINT_STAGE, "wiring": WIRING_STAGE, "engine": LIVE_STAGE}
#: where SGLang turns the requested NEXTN into the EAGLE it runs (and reports in /server_info)
ALIAS_SOURCE = "sglang/srt/arg_groups/speculative_hook.py::_resolve_speculative_algorithm_alias"
FEED_SOURCE = ("sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward (spec_info.hidden_states) <- "
               "sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward (final_norm applied) <- "
               "sglang/srt/layers/logits_processor.py::LogitsProcessor._get_hidden_states_to_store")


def state_candidates(rows: torch.Tensor, names: Sequence[str], weight: torch.Tensor,
                     eps: float) -> dict[str, torch.Tensor]:
    """The tensors a served NextN input could be, from one every-layer reference sample: each of ``names`` (the dump's
    ``layer_plan.tensors``: ``embedding``, ``out(0)`` .. ``out(n-1)``) and :data:`POST_NORM` (the final norm applied
    to the last one) and :data:`TWICE` (applied twice). ``rows``: ``[T, len(names) * H]``; returns
    ``{name: [T, H] float32}``.

    Raises:
        ValueError: ``rows`` is not ``len(names)`` chunks wide."""
    k = len(names)
    if rows.dim() != 2 or k == 0 or rows.shape[1] % k:
        raise ValueError(f"reference rows {tuple(rows.shape)} are not {k} equal chunks wide")
    H = rows.shape[1] // k
    out = {n: rows[:, i * H:(i + 1) * H].float() for i, n in enumerate(names)}
    out[POST_NORM] = _rms(out[names[-1]], weight, eps)
    out[TWICE] = _rms(out[POST_NORM], weight, eps)
    return out


def identify_state(served: Sequence[SimSequence], reference: str | Path, weight: torch.Tensor, eps: float, *,
                   same: float = SAME_STATES, expected: str = POST_NORM, source: str = FEED_SOURCE,
                   engine: str = "SGLang") -> dict:
    """Which tensor of the target the served NextN input is: the relative difference (Frobenius over every aligned
    row of every sequence, ``||served - c|| / ||c||``) to each candidate of :func:`state_candidates`, paired with the
    reference dump's samples by sample id.

    Returns:
        ``{"rel_error": {candidate: float}, "best", "best_rel_error", "expected", "matches": bool (the
        closest candidate is the expected one and within ``same``), "identified": the closest candidate when within
        ``same`` else None, "sequences", "rows", "source", "engine"}``. ``expected`` / ``source`` / ``engine``: the
        serving engine's rule for this head (``EngineAdapter.mtp_fed_state``: SGLang 0.5.23 and vLLM's DeepSeek-V3
        head read :data:`POST_NORM`; vLLM's MiMo head reads ``out(n-1)``, ``helpers.engines.vllm_mtp``).

    Raises:
        BadInput: no served sequence has a reference sample of the same id, or the widths differ (the dump named)."""
    src = read_dump(reference)
    names = list((src.layer_plan or {}).get("tensors") or [])
    by_id = {str(s.sample_id or s.key): s for s in src.samples}
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    n_seq = n_rows = 0
    for seq in served:
        s = by_id.get(seq.key)
        if s is None:
            continue
        cands = state_candidates(s.load(), names, weight, eps)
        n = min(int(seq.aux.shape[0]), next(iter(cands.values())).shape[0])
        got = seq.aux[:n].float()
        if got.shape[1] != next(iter(cands.values())).shape[1]:
            raise BadInput(f"served rows are {got.shape[1]} wide, the reference's chunks "
                           f"{next(iter(cands.values())).shape[1]}: not one hidden state", path=reference)
        for c, v in cands.items():
            num[c] = num.get(c, 0.0) + float((got - v[:n]).pow(2).sum())
            den[c] = den.get(c, 0.0) + float(v[:n].pow(2).sum())
        n_seq, n_rows = n_seq + 1, n_rows + n
    if not n_seq:
        raise BadInput("no served sequence has a reference sample of the same id", path=reference)
    rel = {c: float(np.sqrt(num[c] / den[c])) if den[c] else float("inf") for c in num}
    best = min(rel, key=rel.get)
    expected = names[-1] if expected == "out(n-1)" and names else expected      # the last layer's own name
    return {"rel_error": rel, "best": best, "best_rel_error": rel[best], "expected": expected,
            "matches": best == expected and rel[best] < same, "identified": best if rel[best] < same else None,
            "threshold": same,
            "sequences": n_seq, "rows": n_rows, "source": source, "engine": engine}


def reference_sequences(reference: str | Path, like: Sequence[SimSequence], weight: torch.Tensor,
                        eps: float, expected: str = POST_NORM) -> list[SimSequence]:
    """The sequences ``like`` with their states replaced by ``expected`` (default :data:`POST_NORM`; ``out(n-1)``: the
    last layer's output) of the every-layer reference of the same tokens (what a correct server feeds the head;
    :func:`helpers.draft.sequences.reference_sequences`)."""
    def pick(rows, names, H):
        c = state_candidates(rows, names, weight, eps)
        return c[names[-1] if expected == "out(n-1)" else expected]
    return ref_sequences(reference, like, pick, keep_targets=False)


def mtp_budget(head: Any, served: Sequence[SimSequence], reference: Optional[Sequence[SimSequence]],
               live: Optional[pd.DataFrame], settings: DraftSettings, *, max_new_tokens: int,
               draft: Optional[dict] = None, head_layers: Optional[int] = None,
               profile: Optional[SingleStateDraft] = None) -> dict:
    """The head's acceptance budget (module docstring): stages ``checkpoint (teacher-forced)`` (the head against its
    training log, :func:`helpers.draft.nextn_stage.nextn_draft_stage`), ``draft`` (offline on the reference states of
    the live prompts), ``wiring`` (offline on the served states), ``live``; losses ``draft`` (log - checkpoint, from
    ``draft``; undecided when not given), ``wiring`` (reference - served, paired per prompt) and ``engine`` (offline
    served - live, paired), each decided by :func:`helpers.draft.decide.decide`. ``cause`` by
    :func:`helpers.draft.budget.cause_of` over all three: ``none`` (a clean head) only when every loss is ``clear``.
    ``settings_check``: :func:`helpers.draft.nextn_stage.steps_check` of the served steps against the log's trained
    depth (None: within it, or not known).

    Args:
        head: the offline head (:func:`helpers.draft.loader.load_draft`); served / reference: the live prompts'
            sequences with the served / reference states (reference None: not measured); live: the live per-request
            counters (:func:`helpers.acceptance.requests.record` rows) of the same answers, or None.
        settings: the served chain; max_new_tokens: the live requests' cap (the simulation cuts there).
        draft: :func:`helpers.draft.nextn_stage.nextn_draft_stage`'s result, or None (not measured).
        head_layers: the head layers the serving engine builds (:func:`head_depth`, not the declared
            ``num_nextn_predict_layers``): the trained depth when the log does not give ``hyper.train_steps``.
        profile: the single-state draft (:class:`helpers.investigation.single_state.SingleStateDraft`; None: the
            NextN head, :data:`NEXTN`): the words, sources, ``kind`` and whether the steps are checked.

    Returns:
        ``{"stages": [...], "losses": {"draft", "wiring", "engine"}, "cause", "sentence", "settings",
        "settings_check", "draft_stage"}``.
    """
    p = profile or NEXTN
    steps = settings.steps
    sim_s = simulate_sequences(head, served, [settings], max_new_tokens=max_new_tokens)["per_request"][settings]
    sim_r = None if not reference else simulate_sequences(head, reference, [settings],
                                                          max_new_tokens=max_new_tokens)["per_request"][settings]
    stages = [draft["stage"] if draft else {"name": CHECKPOINT_STAGE, "accept_length": None, "ci": [None, None],
                                            "source": "not measured (no training log or rows)"}]
    src = (f"simulation: {p.who} offline as {p.engine} runs it (helpers.draft.loader.load_draft, "
           "helpers.draft.simulate)")
    if sim_r is not None:
        stages.append(_stage(DRAFT_STAGE, sim_r, steps, source=src + " on norm(out(n-1)) of "
                             "the every-layer reference of the same tokens"))
    stages.append(_stage(WIRING_STAGE, sim_s, steps, source=src + " on the served states "
                         f"({p.capture})"))
    live_ok = live is not None and len(live) and live["verify_ct"].notna().any()
    if live_ok:
        stages.append(_stage(LIVE_STAGE, live, steps, source=p.live_source))
    ref_al = stages[1].get("accept_length")
    losses: dict = {"draft": draft["loss"] if draft else _not_computed(
        "draft", f"{p.who} was not compared with its training log (none found, or no rows to run it on)")}
    if sim_r is not None:
        d, lo, hi, n, per = _paired_loss(sim_r, sim_s)
        losses["wiring"] = _loss("wiring", d, lo, hi, "reference states (norm(out(n-1))) vs served states, paired "
                                 "per live prompt", ref_al, n=n, unit="prompts", per_sequence=per)
    else:
        losses["wiring"] = _not_computed("wiring", "no every-layer reference of the live prompts")
    if live_ok:
        d, lo, hi, n, per = _paired_loss(sim_s, live)
        losses["engine"] = _loss("engine", d, lo, hi, "offline on the served states vs the live counters, paired per "
                                 "prompt", ref_al, n=n, unit="prompts", per_sequence=per)
    else:
        losses["engine"] = _not_computed("engine", "no live counters (--no-measure or the server returned none)")
    cause = cause_of(losses, ("draft", "wiring", "engine"))
    b = {"kind": p.kind, "label": p.label, "settings": settings.label, "stages": stages, "losses": losses,
         "cause": cause, "required": ("draft", "wiring", "engine"),    # the stages cause_of decides (join_engine_state)
         "threshold": threshold(ref_al),
         "settings_check": None if not p.steps_check else steps_check(
             steps, (draft or {}).get("trained_steps") or head_layers, (draft or {}).get("stage")),
         "draft_stage": None if not draft else {k: draft.get(k) for k in ("log", "rows", "same_rows", "why_rows",
                                                                           "trained_steps", "log_steps")}}
    b["sentence"] = budget_sentence(b)
    return b


def _al(st: dict) -> str:
    if st.get("accept_length") is None:
        return f"{st['name']} -"
    return f"{st['name']} {loss_text(st['accept_length'], st.get('ci'))}"


def loss_text(delta: Optional[float], ci: Any = None) -> str:
    """``"0.04 [0.01, 0.07]"``: a loss (or an accept length) with its 95 % CI, 2 decimals, rounded before it is printed
    so that a loss of -0.001 reads ``0.00``, never ``-0.00`` (:func:`helpers.acceptance.stats.format_ci`); ``""``
    when ``delta`` is None."""
    def r(x: Any) -> Optional[float]:
        return None if x is None else round(float(x), 2) + 0.0          # + 0.0: no negative zero
    lo, hi = (list(ci or []) + [None, None])[:2]
    return format_ci({"x": r(delta), "x_lo": r(lo), "x_hi": r(hi)}, "x")


def budget_sentence(b: dict) -> str:
    """One line: the stages' accept lengths and each loss's decision (:func:`loss_text`)."""
    parts = "; ".join(_al(s) for s in b["stages"])
    loss = "; ".join(f"{k} loss {loss_text(v['delta'], v['ci'])} {v['decision']}"
                     if v.get("delta") is not None and None not in (v.get("ci") or [None, None])
                     else f"{k} {v['decision']} ({v.get('why') or v.get('basis')})" for k, v in b["losses"].items())
    pt = engine_parts_text((b["losses"].get("engine") or {}).get("parts"))    # the engine-state probes' parts
    return (f"{b.get('label') or 'NextN'} accept length ({b['settings']}): {parts}. {loss}. Cause: {b['cause']}."
            + (f" {pt}." if pt else ""))


def ranked(ident: dict) -> list[tuple[str, float]]:
    """The candidates of :func:`identify_state` closest first: ``[(name, rel. error)]``."""
    return sorted((ident.get("rel_error") or {}).items(), key=lambda kv: kv[1])


def state_line(ident: dict) -> str:
    """What the served state is, in one line: the candidate identified (or the closest, when none is within the
    threshold) with its rel. error, the runner-up (the next-closest candidate: how far the nearest wrong answer is),
    and, when the served state is not :data:`POST_NORM`, that candidate's rel. error. ``ident``: :func:`identify_state`
    (or ``investigation.json`` ``diagnosis.served_state``)."""
    top = ranked(ident)
    best, err = top[0]
    head = (f"{ident['identified']} (rel. error {err:.2g}" if ident.get("identified") else
            f"none of the candidates (closest {best}, rel. error {err:.2g} >= {ident.get('threshold')}")
    text = head + (f"; runner-up {top[1][0]} {top[1][1]:.2g}" if len(top) > 1 else "")
    exp = ident.get("expected") or POST_NORM
    if best != exp and exp in (ident.get("rel_error") or {}):
        text += f"; {exp}, what {ident.get('engine') or 'SGLang'} feeds, {ident['rel_error'][exp]:.2g}"
    return text + ")"


def algorithm_text(algorithm: Optional[str], head: Optional[dict]) -> str:
    """The speculative algorithm of an MTP head's server: what the launch asked for and what SGLang runs (it reports
    the run one in ``/server_info`` ``speculative_algorithm``: NEXTN is an alias that
    :data:`ALIAS_SOURCE` resolves to EAGLE). ``head``: ``attach.draft_head``; ``algorithm``: ``attach.algorithm``."""
    spec = (head or {}).get("spec") or {}
    asked, run = spec.get("algorithm_requested"), spec.get("algorithm_as_run") or algorithm
    if asked and asked != run:
        return f"{asked} requested, run as {run} ({ALIAS_SOURCE}: {asked} is an alias of {run})"
    return f"{run or '?'} (requested: {asked or 'not in /server_info'})"


def head_text(head: dict) -> str:
    """The MTP head in a few words: its class, how many NextN layers (and the config field that says so), where its
    weights are (``attach.draft_head``, :func:`helpers.draft.mtp_checks`)."""
    n, built = head.get("layers"), head.get("layers_built")
    return (f"{head.get('class')} ({head.get('file')}): the target's own NextN / MTP head, {n} layer"
            f"{'' if n == 1 else 's'} ({head.get('layers_field')} = {n}"
            + (f"; the engine builds {built}" if built is not None and built != n else "")
            + f"), {head.get('source')}")


def state_findings(ident: dict, wiring_loss: Optional[dict], profile: Optional[SingleStateDraft] = None) -> list[dict]:
    """The findings of :func:`identify_state`: none when the served state is :data:`POST_NORM`; ``norm_mismatch``
    when it is the last layer's output before the final norm; ``wrong_layer`` when it is another layer's output or the
    embedding; ``unidentified_chunk`` when no candidate is within the threshold. The wiring loss (if measured) rides
    along as evidence, never as the cause. ``profile``: the draft's words (None: the NextN head's)."""
    p = profile or NEXTN
    who, eng = p.who, p.engine
    if ident["matches"]:
        return []
    rel = ident["rel_error"]
    exp, eng = ident.get("expected") or POST_NORM, ident.get("engine") or "SGLang"
    top = dict(sorted(rel.items(), key=lambda kv: kv[1])[:4])
    ev = {"rel_error": top, "expected": exp, "expected_rel_error": rel[exp],
          "threshold": ident["threshold"], "sequences": ident["sequences"], "rows": ident["rows"],
          "source": ident["source"], "wiring_loss": None if wiring_loss is None else
          {k: wiring_loss.get(k) for k in ("delta", "ci", "decision")},
          "kind_text": f"{who} is fed another tensor than the engine's own rule feeds it",
          "who": who, "engine": eng, "fix_source": p.fix_source if exp == POST_NORM else ident["source"]}
    got = ident["identified"]
    names = [n for n in rel if n not in (POST_NORM, TWICE)]
    cost = ""
    wl = wiring_loss or {}
    if wl.get("delta") is not None and None not in (wl.get("ci") or [None]):
        cost = (f"; what it costs {who} on these prompts: {loss_text(wl['delta'], wl['ci'])} accept length, "
                f"{wl['decision']}")
    if exp != POST_NORM and got in (POST_NORM, TWICE):
        return [finding("norm_mismatch", 0, "the MTP head is fed the target's final hidden state AFTER the final "
                        f"norm, {got} (rel. error {rel[got]:.2g}); {eng} feeds this head the last layer output {exp} "
                        f"before the final norm (rel. error {rel[exp]:.2g}){cost}", **ev)]
    if got == names[-1]:
        return [finding("norm_mismatch", 0, f"{who} is fed the target's last layer output {got} BEFORE the "
                        f"final norm (rel. error {rel[got]:.2g}); {eng} feeds it after the final norm, {POST_NORM} "
                        f"(rel. error {rel[POST_NORM]:.2g}){cost}", **ev)]
    if got == TWICE:
        return [finding("norm_mismatch", 0, f"{who} is fed the target's final hidden state with the final "
                        f"norm applied TWICE, {TWICE} (rel. error {rel[got]:.2g}); {eng} feeds it normed once, "
                        f"{POST_NORM} (rel. error {rel[POST_NORM]:.2g}){cost}", **ev)]
    if got is not None:
        shown = "the token embedding" if got == "embedding" else got
        what = ("target's final hidden state after the final norm" if exp == POST_NORM else
                f"state {eng} feeds this head")
        return [finding("wrong_layer", 0, f"{who} is fed {shown} (rel. error {rel[got]:.2g}), not the "
                        f"{what} {exp} (rel. error {rel[exp]:.2g}){cost}", **ev)]
    return [finding("unidentified_chunk", 0, f"{who}'s input is none of the target's layer outputs nor "
                    f"{exp} (closest {ident['best']}, rel. error {ident['best_rel_error']:.2g} >= "
                    f"{ident['threshold']}){cost}", **ev)]



# ------------------------------------------------------------------------------------------------ the live run

#: budget cause -> the finding it implies (as :data:`helpers.investigation.acceptance.CAUSE_KINDS` for EAGLE-3)
CAUSE_FINDINGS = {"draft": "draft_underperforms", "wiring": "wiring_loses_acceptance",
                  "engine": "engine_after_capture"}
FIX_SOURCE = ("SGLang 0.5.23 feeds the head logits_output.hidden_states = DeepseekV2Model.forward's output after "
              "final_norm (sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward)")
#: the MTP / NextN head on SGLang 0.5.23 (the profile the stages below were built with; EAGLE-1 on vLLM:
#: :data:`helpers.investigation.single_state.EAGLE1`)
NEXTN = SingleStateDraft(
    kind="mtp", who="the NextN head", label="NextN", engine="SGLang", feed_source=FEED_SOURCE, fix_source=FIX_SOURCE,
    live_source="SGLang meta_info (spec_verify_ct, completion_tokens) of the same /generate answers",
    capture="/generate return_hidden_states", draft_stage=nextn_draft_stage, steps_check=True,
    title="MTP / NextN head live investigation", engine_rule=True, weights_check=True)


def profile_of(kind: Optional[str]) -> SingleStateDraft:
    """The single-state draft profile of an ``investigation.json`` ``diagnosis.kind`` (``"eagle1"`` -> EAGLE-1 on
    vLLM; else the NextN head)."""
    return EAGLE1 if kind == EAGLE1.kind else NEXTN


def investigate_mtp(r: Any, reference: Any, profile: Optional[SingleStateDraft] = None) -> None:
    """The stages of ``investigate`` for an MTP / NextN head (module docstring), filling ``r.doc``
    (:class:`helpers.investigation.live.Run`; its attach has run and named the head):

    1. **capture** -- the live prompts (``--prompts`` x ``--max-new-tokens``, greedy, cache flushed) through the engine
       adapter's ``capture_served``: per token the hidden state the head reads and the request's live counters.
    2. **reference** -- every layer of the target for the same tokens (``reference(adapter, att, client, prompts,
       run_dir, num_layers, name=) -> (path, how, missing)``, :func:`helpers.investigation.live._reference`: the
       server's own every-layer capture, else HF transformers).
    3. **diagnosis** -- :func:`identify_state` and :func:`state_findings`.
    4. **acceptance budget** -- :func:`mtp_budget` with the head of :func:`helpers.draft.loader.load_draft` and its
       draft stage (:func:`helpers.draft.nextn_stage.nextn_draft_stage`: the log from ``--training-log``, the
       ``--training`` folder, the draft or the target folder; the rows from ``--validation`` or the log's own);
       the served steps beyond the trained depth are ``mtp_steps_beyond_head``
       (:func:`helpers.draft.nextn_stage.steps_check`).
    5. **engine state** -- the engine-state probes (:func:`helpers.investigation.engine_stage.run_engine_state`, the
       capture's answers their cold arm; each probe declares whether it applies to a head: ``Probe.mtp``), joined
       into the budget's engine stage (:func:`helpers.investigation.probes.join_engine_state`); their findings join.
       The budget's head is handed to them (:data:`helpers.investigation.probes.trace.LOADED_DRAFT`): a probe that
       runs the head offline (``sampled_verify``) does not load it again.

    ``profile``: the single-state draft (None: the NextN head, :data:`NEXTN`; an EAGLE-1 draft on vLLM:
    :data:`helpers.investigation.single_state.EAGLE1`, attached without a ``draft_head``).

    Verdict: ``mismatch`` when the served state is not :data:`POST_NORM` (the finding says what it is) or a loss
    counts; ``ok`` only when every stage of the budget is ``clear``; else ``undecided``.

    Raises:
        BadInput: a family with no offline head (:data:`helpers.draft.loader.OFFLINE_HEADS`: the attach's line,
            :func:`helpers.investigation.attach.mtp_not_supported`), the head cannot be run offline
            (:func:`helpers.draft.loader.load_draft`), served states not one target hidden state wide; ServerError:
            the server fails or the run's deadline runs out."""
    req, doc, att = r.req, r.doc, r.att
    p = profile or NEXTN
    if p is NEXTN and att.draft_head.get("family") not in OFFLINE_HEADS:
        raise BadInput(mtp_not_supported(att.draft_head, att.draft_dir, att.target_dir), field="draft")
    r.tcfg = read_target_config(att.target_dir)
    spec = att.spec or {}
    settings = DraftSettings(int(spec.get("num_steps") or 1), int(spec.get("topk") or 1),
                             int(spec.get("num_draft_tokens") or 2))
    t = r.step("capture")
    recs: list = []
    prompts = load_prompts(None, n=req.measure_prompts)
    H = int(read_target_config(att.target_dir).hidden_size)
    dump = r.adapter.capture_served(r.client, prompts, req.run_dir / "dumps", name="live-continuations",
                                    max_new_tokens=req.max_new_tokens, records=recs, max_width=16 * H)
    served = dump_sequences(dump)
    widths = {int(s.aux.shape[1]) for s in served}
    if widths != {H}:
        raise BadInput(f"the served hidden states are {sorted(widths)} wide, the target's hidden size is {H}: not "
                       f"the one state {p.who} reads", path=dump)
    doc.samples = len(served)
    r.done("capture", t, f"{len(served)} live prompt(s) x {req.max_new_tokens} tokens -> "
                         f"{Path(dump).relative_to(req.run_dir)}")
    t = r.step("reference")
    asked = [{"id": s.key, "input_ids": s.tokens.tolist()} for s in served]
    ref, how, missing = reference(r.adapter, att, r.client, asked, req.run_dir, r.tcfg.num_hidden_layers,
                                  name="reference-live")
    doc.reference = {"how": how, "path": None if ref is None else str(ref), "missing": missing}
    r.done("reference", t, how if ref is not None else f"none ({missing})")
    t = r.step("diagnosis")
    weight, eps = target_final_norm(att.target_dir)
    expected, feed_src, engine = p.fed_state(r.adapter, (att.draft_head or {}).get("family"))
    ident = identify_state(served, ref, weight, eps, expected=expected, source=feed_src,
                           engine=engine) if ref is not None else None
    doc.diagnosis = {"kind": p.kind, "served_state": ident}
    r.done("diagnosis", t, "no reference: the served state is not identified" if ident is None else
           f"served state = {state_line(ident)}")
    b = None
    weights = _head_weights(r, p)
    unloadable = [f for f in weights if f["kind"] == "mtp_weights_missing"]
    if req.acceptance_budget and not unloadable:
        t = r.step("acceptance budget")
        choice = choose_dtype(server_dtype(att.info, read_config_json(att.draft_dir / "config.json", "draft config")),
                              "cpu")
        head = load_draft(att.draft_dir, att.target_dir, dtype=choice.dtype, dtype_reason=choice.reason)
        refs = reference_sequences(ref, served, weight, eps, expected) if ref is not None else None
        ds = p.draft_stage(head, att.target_dir, settings.steps, draft_dir=att.draft_dir, training=req.training,
                           training_log=req.training_log, validation=req.validation, progress=r.progress)
        b = mtp_budget(head, served, refs, pd.DataFrame(recs) if req.live_measure else None, settings,
                       max_new_tokens=req.max_new_tokens, draft=ds,
                       head_layers=head_depth(att, r.adapter.loader_rules(att.version).mtp_rules()), profile=p)
        b["dtype"] = choice.reason
        doc.acceptance = b
        r.done("acceptance budget", t, budget_line(r, b["sentence"]))
    r.live = pd.DataFrame(recs) if req.live_measure else None     # the engine-state probes' cold arm
    # each probe says whether it applies to a head; the budget's head is theirs (not loaded again)
    state = run_engine_state(r, {LOADED_DRAFT: (head, choice.dtype)} if b is not None else None)
    if state is not None and b is not None:
        b = doc.acceptance = join_engine_state(b, state)
        b["sentence"] = budget_sentence(b)
        final_budget_line(r, b)
    found = state_findings(ident, (b or {}).get("losses", {}).get("wiring"), p) if ident is not None else []
    found = _every_rank(r, found, ref, how, weight, eps, H, (b or {}).get("losses", {}).get("wiring"))
    cause = (b or {}).get("cause")
    if cause in CAUSE_FINDINGS:
        found.append(finding(CAUSE_FINDINGS[cause], None, b["sentence"], stage=cause, loss=b["losses"][cause],
                             stages=[{k: s.get(k) for k in ("name", "accept_length", "ci")} for s in b["stages"]],
                             source=f"simulation: {p.who} offline as {p.engine} runs it; live counters from the "
                                    "same answers"))
    sc = (b or {}).get("settings_check")
    if sc:
        found.append(_steps_finding(r, sc))
    found += weights
    found += [f for f in (state or {}).get("findings") or [] if f["kind"] not in {g["kind"] for g in found}]
    doc.findings = [Finding(**f) for f in found]
    doc.verdict = ("mismatch" if found else "ok" if cause == "none" and ident is not None and ident["matches"]
                   else "undecided")
    doc.seconds_to_verdict = round(r.dl.elapsed(), 1)     # the verdict needs the budget and probes, not the relaunch
    from .mtp_fix import fix_stage  # lazy: it imports this module (and helpers.investigation.live's not_measured)
    fix_stage(r, found, b, head if b else None, (refs or served) if b else None)
    if ident is None:
        doc.notes.append(f"the served state is not identified: {missing}")


#: the findings that say the head is fed a wrong state (rank 0's, or another rank's: :mod:`.mtp_ranks`)
STATE_KINDS = ("norm_mismatch", "wrong_layer", "unidentified_chunk", "tp_partial_sum", "tp_sharded_width")


def _head_weights(r: Any, p: SingleStateDraft) -> list[dict]:
    """What the engine made of the head's checkpoint (:func:`helpers.draft.mtp_weights.head_weight_findings` under the
    serving engine's loader rules), for a profile whose draft is the target's MTP head (:attr:`SingleStateDraft.
    weights_check`); a note when it cannot be checked, and one when missing tensors leave no budget to run."""
    if not p.weights_check:
        return []
    att = r.att
    try:
        weights = head_weight_findings(att.draft_dir, att.target_dir, r.adapter.loader_rules(att.version).mtp_rules())
    except BadInput as e:
        r.doc.notes.append(f"the head's weights were not checked: {e}")
        return []
    if any(f["kind"] == "mtp_weights_missing" for f in weights):
        r.doc.notes.append("no acceptance budget: the engine serves the head's missing tensors as allocated (the "
                           "finding says how), which the offline head cannot reproduce")
    return weights


def head_depth(att: Any, rules: Any) -> Optional[int]:
    """The head depth the served steps are checked against when the training log gives none: the layers the serving
    engine builds for the attached head (:func:`helpers.draft.mtp_checks.engine_head_layers` under ``rules``, the
    engine's :class:`helpers.draft.mtp_checks.MTPRules`: SGLang 0.5.23 builds one head layer for Qwen3.5 / Qwen3-Next
    / MiMo whatever ``num_nextn_predict_layers`` / ``mtp_num_hidden_layers`` declares, and one per draft step for
    Step-3.5 / MiMo-V2 when ``att.info['enable_multi_layer_eagle']`` (/server_info) is on or absent, one when off),
    not the declared count. ``att``: the :class:`helpers.investigation.attach.Attachment` (its ``draft_dir``,
    ``draft_head`` and ``info``);
    ``att.draft_head['layers_built']`` is set to the answer. None: no MTP head config in the draft folder (then the
    declared ``att.draft_head['layers']``, if any).

    Raises:
        BadInput: the draft folder's config.json unreadable or its layer field malformed."""
    # /server_info holds the resolved enable_multi_layer_eagle (entrypoints/engine.py::Engine.get_server_info:
    # server_args.resolved_dict()): on, SGLang built one head model per step (the per-step families' EAGLE); off, one
    mle = (getattr(att, "info", None) or {}).get("enable_multi_layer_eagle")
    algo = "EAGLE" if mle is None or mle else "NEXTN"
    n = engine_head_layers(att.draft_dir, rules, algo) if att.draft_dir is not None else None
    if n is None:
        return (att.draft_head or {}).get("layers")
    if att.draft_head is not None:
        att.draft_head["layers_built"] = n
    return n


def _steps_finding(r: Any, sc: dict) -> dict:
    """``mtp_steps_beyond_head`` of the settings check ``sc`` (:func:`helpers.draft.nextn_stage.steps_check`), its
    source and fix in the serving engine's own rule and flags (vLLM: ``num_speculative_tokens``)."""
    if r.adapter.mtp_steps_source:                     # the serving engine's rule, not SGLang's
        sc = {**sc, "source": sc["source"].replace(STEPS_SOURCE, r.adapter.mtp_steps_source)}
    n = sc["trained_steps"]
    flags = r.adapter.fix_flags(SimpleNamespace(server_args={"--speculative-num-steps": n,
                                                             "--speculative-eagle-topk": 1,
                                                             "--speculative-num-draft-tokens": n + 1}))
    return finding("mtp_steps_beyond_head", None, steps_text(sc), stage="settings",
                   fix=" ".join(f"{k} {v}" for k, v in flags.items()), **sc)


def _every_rank(r: Any, found: list[dict], ref: Any, how: str, weight: torch.Tensor, eps: float, H: int,
                wiring: Optional[dict]) -> list[dict]:
    """At TP > 1, every rank's state (:func:`helpers.investigation.mtp_ranks.identify_ranks`, from the server's own
    every-layer capture) into ``doc.diagnosis["ranks"]``: ``found`` (rank 0's findings) with the ranks' findings
    after them, or in place of rank 0's ``unidentified_chunk`` when the ranks explain it (a partial sum, a shard).
    Without that capture folder (no reference from the server itself, or a server that records rank 0 only: vLLM
    0.32.0's worker extension, ``att.layers_dir`` None), ``found`` unchanged and a note that only rank 0 was compared
    and what would compare every rank (:func:`helpers.investigation.mtp_ranks.per_rank_note`)."""
    from .mtp_ranks import identify_ranks, per_rank_note, rank_findings, rank_line  # lazy: it imports this module
    att = r.att
    own = ref is not None and how == r.adapter.every_layer_source(r.client, att.layers_dir)   # the server's own
    note = per_rank_note(att.tp, att.layers_dir if own else None)
    if note:
        r.doc.notes.append(note)
        r.progress("caveat: " + note)
    if att.tp <= 1 or not own or att.layers_dir is None:     # no per-rank capture folder to read: rank 0 only
        return found
    ir = identify_ranks(att.layers_dir, ref, weight, eps, H)
    r.doc.diagnosis["ranks"] = ir
    r.progress(f"per TP rank: {rank_line(ir)}")
    more = rank_findings(ir, wiring)
    if any(f["kind"].startswith("tp_") for f in more):
        found = [f for f in found if f["kind"] != "unidentified_chunk"]
    return more + found


def steps_text(sc: dict) -> str:
    """The settings finding in one line (``sc``: :func:`helpers.draft.nextn_stage.steps_check`)."""
    per = ", ".join(f"step {r['step']}: {r['acc']:.3f} (log {r['log_acc']:.3f})" for r in sc.get("untrained") or []
                    if r.get("acc") is not None and r.get("log_acc") is not None)
    return (f"the NextN head is served with {sc['served_steps']} draft steps (--speculative-num-steps) but was trained "
            f"for {sc['trained_steps']} (its training log's hyper.train_steps, else the head layers the engine builds): steps {sc['trained_steps'] + 1}.."
            f"{sc['served_steps']} run the one head on its own outputs, a depth it never learned"
            + (f"; teacher-forced accuracy there {per}" if per else "") + f" ({sc['source']})")


def mtp_sentence(doc: Any) -> str:
    """The opening sentence of an MTP investigation (``investigation.json`` ``sentence``), ending with the fix as
    measured after a restart, or why it was not (:func:`helpers.investigation.mtp_fix.fix_tail`)."""
    from .mtp_fix import fix_tail  # lazy: it imports this module
    return _sentence(doc) + fix_tail(doc)


def _sentence(doc: Any) -> str:
    ident = (doc.diagnosis or {}).get("served_state")
    p = profile_of((doc.diagnosis or {}).get("kind"))
    b = doc.acceptance
    tail = (" " + b["sentence"]) if b else " No acceptance budget."
    ref = (doc.reference or {}).get("how") or "none"
    if doc.findings and doc.findings[0].kind in STATE_KINDS:
        f = doc.findings[0]
        return (f"Wrong wiring: {f.detail} [evidence: {doc.samples} live prompt(s), reference {ref}]. Proposed fix: "
                f"{doc.proposed_fix.summary if doc.proposed_fix else 'none'}.{tail}")
    kinds = [f.kind for f in doc.findings or []]
    if "draft_underperforms" in kinds:
        d = (b or {}).get("losses", {}).get("draft") or {}
        who = p.who[0].upper() + p.who[1:]
        return (f"{who} scores below its training log: {loss_text(d.get('delta'), d.get('ci'))} accept "
                f"length lost at the checkpoint ({d.get('basis')}).{tail}")
    if "mtp_steps_beyond_head" in kinds:
        f = doc.findings[kinds.index("mtp_steps_beyond_head")]
        return f"Settings: {f.detail}.{tail}"
    for k in ("mtp_weights_missing", "lm_head_replaced", "embedding_replaced"):     # helpers.draft.mtp_weights
        if k in kinds:
            return f"The head's checkpoint: {doc.findings[kinds.index(k)].detail}.{tail}"
    probed = {f["kind"] for f in (doc.engine_state or {}).get("findings") or []}    # the engine-state probes'
    if probed & set(kinds):
        f = next(f for f in doc.findings if f.kind in probed)
        return f"Engine state: {f.detail}.{tail}"
    if ident is None:
        return f"The hidden state {p.who} is fed was not identified (no reference: {ref}).{tail}"
    head = {"ok": "No fault", "undecided": "No wiring fault found, but a material acceptance loss is not ruled out",
            "mismatch": "Acceptance is lost"}.get(doc.verdict or "undecided", "No wiring fault")
    exp = ident.get("expected") or POST_NORM
    what = ("the target's final hidden state after its final norm" if exp == POST_NORM else
            "the target's last layer output before its final norm")
    return (f"{head}: {p.who} is fed {exp}, {what}, as {ident.get('engine') or 'SGLang'} does (rel. error "
            f"{ident['rel_error'][exp]:.2g} on {ident['rows']} rows of "
            f"{ident['sequences']} live prompt(s); reference: {ref}).{tail}")


__all__ = ["NEXTN", "profile_of",
           "ALIAS_SOURCE", "CAUSE_FINDINGS", "DRAFT_STAGE", "FEED_SOURCE", "LIVE_STAGE", "LOSS_AT", "POST_NORM",
           "TWICE", "WIRING_STAGE", "CHECKPOINT_STAGE", "algorithm_text", "budget_sentence", "head_depth", "head_text",
           "identify_state",
           "investigate_mtp", "loss_text", "mtp_budget", "mtp_sentence", "ranked", "reference_sequences",
           "state_candidates", "state_findings", "state_line", "steps_text"]
