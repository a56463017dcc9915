"""The acceptance budget: where the accept length goes, from the training log to the live server.

Stages (each an accept length with a 95 % CI, bootstrap over sequences; losses paired where the sequences are the
same; each loss decided by equivalence, :mod:`helpers.draft.decide`: ``counts`` / ``clear`` / ``undecided``):

1. ``training log``: what the training run claims: its per-step figures (the trainer's teacher-forced accuracy per
   TTT step, its validation split) through the trainers' own accept-length formula, bonus token added, cut at the
   server's steps (:func:`helpers.draft.training_log.predicted_accept_length`).
2. ``checkpoint (teacher-forced)``: the checkpoint measured as its trainer measured it, on rows of the log's kind
   (:mod:`helpers.draft.draft_stage`, :mod:`helpers.draft.teacher_forced`); the **draft** loss is the log minus
   this, the same metric through the same formula (like with like). Rows unlike the log's, or no log: undecided.
3. ``offline on training states``: the draft's drafting chain replayed offline on the training data's aux states
   (:mod:`helpers.draft.simulate`): the ladder's first accept length as SGLang counts it (never the draft stage's
   yardstick: a drafting chain on greedy text and a teacher-forced accuracy are different quantities).
4. ``offline on served states``: the same draft on the aux states the server feeds for the same training tokens. The
   **wiring** loss is stage 3 minus stage 4, paired per sequence; with the live prompts' every-layer reference it is
   measured on the live prompts too (``offline on live prompts, training plan``), which decide it unless the training
   samples count a loss they do not (a fault lost on the prompts served is not cleared by the training samples).
5. ``offline on live prompts' served states`` and ``live``: the same ``/generate`` answers give the served aux states
   of the server's own greedy continuation and the server's accept counters; the **engine** loss (after the capture
   point: the draft computed differently inside the engine, positions, KV reuse) is the simulation minus live,
   paired per request.
6. ``best settings``: the simulation on the live prompts' served states at other ``steps`` (chain), each scored by
   ``accept_length / (1 + steps x r)`` with ``r`` one draft forward's cost relative to a verify step (from the
   weights each reads: a decode step at small batch is bound by the bytes it reads). The **settings** loss is in
   accept length like every other stage: the accept length of the *acceptance reference* minus the served
   settings', paired per sequence. The reference (:func:`acceptance_reference`) is the fastest chain by the cost
   model among those that accept more tokens per verify step and are modelled at least as fast as the served
   settings: served settings it dominates give up accepted tokens and buy no modelled throughput for them
   (``--speculative-num-steps 2`` where 3 accepts more and is modelled as fast). Settings that accept fewer tokens but are modelled faster than every
   chain that accepts more are a trade, not a loss: the budget's ``settings_trade`` says what they give up and buy.
   Below :data:`helpers.draft.decide.SMALL_N` sequences the stage is ``undecided`` whatever the estimates say (a
   dominating chain, none, a trade): the chains' order in the cost model is no evidence over so few
   (:func:`_no_reference`).

The cause is the largest loss that ``counts``; ``none`` only when every required stage is ``clear`` (its CI rules a
material loss out); ``undecided`` otherwise, with what would settle each open stage (never "no loss").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import pandas as pd

from ..acceptance.stats import paired_effect
from ..formats.rows import RowsKind
from ..runfiles import jsonable
from .cost import draft_cost  # noqa: F401  (the budget's draft-step cost; callers import it from here)
from .decide import MATERIAL, MIN_TOKENS, SMALL_N, decide, threshold
from .draft_stage import draft_stage
from .model import Eagle3Draft
from .reference import Conditions
from .sequences import (SAME_STATES, dump_sequences, plan_sequences, states_difference,  # noqa: F401
                        training_sequences)
from .simulate import DraftSettings, SimSequence, simulate_sequences, summary
from .teacher_forced import SeqRows, accept_length_ci, bootstrap_index, per_sequence_accept_length, reduce
from .training_log import TrainingLog, predicted_accept_length

#: the wiring loss's basis on the training samples, and measured again on the live prompts' tokens
TRAINING_WIRING = "training states vs served states"
LIVE_WIRING = ("the training data's layer plan (every-layer reference of the same tokens) vs the served states on the "
               "live prompts' tokens")
#: chain steps tried for the settings stage
SETTINGS_STEPS = (1, 2, 3, 4, 5, 6, 7, 8)
#: the cost model's resolution (it counts weight bytes only: no kernel launch, attention or sampling cost): a chain
#: modelled within this share slower than the served settings that accepts materially more is named in the
#: settings trade note (to be measured), never decided on
NEAR_BEST = 0.05
CAUSES = ("none", "draft", "wiring", "engine", "settings", "workload", "undecided")
#: ablation findings that are evidence for a cause (helpers.investigation.ablate)
#: the stages a live budget must clear before its cause is ``none``
REQUIRED_STAGES = ("draft", "wiring", "engine", "settings")
ABLATION_CAUSES = {"engine_feature_costs_acceptance": "engine", "concurrency_loses_acceptance": "engine",
                   "context_loses_acceptance": "workload", "temperature_loses_acceptance": "workload"}


# ------------------------------------------------------------------------------------------------ sequences

# ------------------------------------------------------------------------------------------------ statistics

def _stage(name: str, per_request: Optional[pd.DataFrame], steps: int, *, source: str, **extra) -> dict:
    st: dict[str, Any] = {"name": name, "source": source}
    if per_request is not None and len(per_request):
        s = summary(per_request, steps)
        st.update(accept_length=s["accept_length"], ci=[s["accept_length_lo"], s["accept_length_hi"]],
                  accept_rate=s["accept_rate"], accept_rate_ci=[s["accept_rate_lo"], s["accept_rate_hi"]],
                  p_accept_ge=s["p_accept_ge"], verify_steps=s["verify_steps"], sequences=int(s["n_spec"] or 0))
    st.update(extra)
    return st


def _loss(name: str, delta: float, lo: float, hi: float, basis: str, reference: Optional[float], *, n: Optional[int],
          unit: str = "sequences", per_sequence: Optional[Sequence[float]] = None, **extra) -> dict:
    """One stage's loss with its decision (:func:`helpers.draft.decide.decide`, which also widens the CI over few
    sequences: ``ci`` is the CI decided on); ``reference`` is the accept length the material threshold is a share
    of; ``per_sequence`` the loss on each sequence."""
    dec = decide(delta, lo, hi, threshold(reference), n=n, unit=unit, per_sequence=per_sequence)
    lo = dec["ci"][0]
    return {"stage": name, "delta": delta, "basis": basis, **dec, "n": n,
            "counts": dec["decision"] == "counts", "material": bool(np.isfinite(delta) and delta >= dec["threshold"]),
            "beyond_ci": bool(lo is not None and np.isfinite(lo) and lo > 0), **extra}


def _not_computed(name: str, why: str) -> dict:
    """A stage that could not be computed: undecided, with what would settle it."""
    return {"stage": name, "delta": None, "ci": [None, None], "basis": why, "decision": "undecided",
            "threshold": None, "settle": {"n": None, "text": why}, "why": why, "counts": False, "material": False,
            "beyond_ci": False, "n": None}


def _paired_loss(a: pd.DataFrame, b: pd.DataFrame) -> tuple[float, float, float, int, list[float]]:
    """accept length of ``a`` minus ``b``, paired per request id (``paired_effect`` gives b - a): ``(loss, lo, hi,
    n, the loss on each paired request)``."""
    e = paired_effect(a, b)
    return (-e["accept_length_delta"], -e["accept_length_delta_hi"], -e["accept_length_delta_lo"], e["n_paired"],
            [-x for x in e["accept_length_per_prompt"]])


@dataclass
class BudgetInputs:
    """What the budget is computed from (any may be None: its stage is then undecided, saying why).

    Attributes:
        settings: the served ``(steps, topk, draft_tokens)``.
        log: the draft's training log (:func:`helpers.draft.training_log.read_training_log`), or None.
        draft_rows: the checkpoint's teacher-forced pass (:func:`helpers.draft.teacher_forced.run`) over rows of the
            log's kind (its validation rows), for the draft stage; draft_rows_kind / draft_rows_path /
            draft_rows_labels: what those rows are, where they are, and whether their labels are the target's
            distribution (``target``) or the recorded tokens (``recorded``).
        draft_fix: ``{"label", "rows": [SeqRows], "source"}``: the same pass with a draft-side fix applied (the
            training data's vocab map), paired with ``draft_rows``.
        training: drafting-chain sequences from the training data (:func:`training_sequences`).
        served_training: the served aux states for the same training tokens (:func:`dump_sequences` with starts).
        live_sequences: the served aux states of the live prompts with the server's own continuation.
        live: the live per-request frame of the same answers.
        live_trained: the training data's layer plan on the live prompts' tokens (the every-layer reference of the
            same prompt + continuation tokens as ``live_sequences``, matched by key): the wiring stage is measured on
            the live prompts too (trained plan vs served states, paired per prompt; :func:`_wiring_on_live_prompts`).
        max_new_tokens: the live requests' max_new_tokens.
        fix: ``{"label", "sequences", "plan", "draft"?}``: the proposed fix applied offline: the served plan it yields
            taken from the every-layer reference, and/or the draft it yields (a corrected d2t), or None.
        draft_cost / draft_cost_source: one draft forward's cost relative to one verify step (the settings stage
            picks the steps that maximise ``accept_length / (1 + steps x draft_cost)``) and where it comes from.
        reference: the draft's conditions for the published accept lengths (:mod:`helpers.draft.reference`), read by
            the draft stage when there is no training log.
    """

    settings: DraftSettings
    log: Optional[TrainingLog] = None
    draft_rows: Optional[list[SeqRows]] = None
    draft_rows_kind: Optional[RowsKind] = None
    draft_rows_path: Optional[str] = None
    draft_rows_labels: str = "target"
    draft_fix: Optional[dict] = None
    training: Optional[list[SimSequence]] = None
    served_training: Optional[list[SimSequence]] = None
    live_sequences: Optional[list[SimSequence]] = None
    live: Optional[pd.DataFrame] = None
    live_trained: Optional[list[SimSequence]] = None
    max_new_tokens: Optional[int] = None
    fix: Optional[dict] = None
    draft_cost: Optional[float] = None
    draft_cost_source: str = "not given"
    reference: Optional[Conditions] = None


@dataclass
class _Ladder:
    """The budget being built: the draft, its drafting-chain simulator ``sim(seqs, settings, max_new_tokens=None)`` and
    the draft stage's bootstrap index (what every stage may use), then stages in ladder order, losses by stage, what
    is missing, notes, the frames the later stages pair with."""

    S: int
    draft: Any = None
    sim: Any = None
    idx: Optional[np.ndarray] = None
    stages: list = field(default_factory=list)
    losses: dict = field(default_factory=dict)
    missing: list = field(default_factory=list)
    notes: list = field(default_factory=list)
    train_frame: Optional[pd.DataFrame] = None
    served_frame: Optional[pd.DataFrame] = None
    rec: Optional[dict] = None
    trade: Optional[dict] = None
    settings_table: list = field(default_factory=list)
    fix_offline: Optional[dict] = None


def _log_stage(L: _Ladder, inp: BudgetInputs) -> None:
    """1 -- what the training run claims (its per-step figures, the bonus token added, cut at the served steps)."""
    if inp.log is None:
        L.missing.append("training log: none found (give --training-log; the draft stage needs it)")
        return
    pred = predicted_accept_length(inp.log, L.S)
    L.stages.append({"name": "training log", "accept_length": pred["accept_length"], "ci": [None, None],
                     "p_accept_ge": pred["p_accept_ge"], "kind": inp.log.kind, "split": inp.log.split,
                     "source": f"{inp.log.path} ({inp.log.format}, {inp.log.kind}, split '{inp.log.split}': "
                               f"{', '.join(inp.log.source_keys[:L.S])})", "note": pred["note"]})


def _draft_stage(L: _Ladder, inp: BudgetInputs) -> None:
    """2 -- the checkpoint against its log, like with like (:func:`helpers.draft.draft_stage.draft_stage`); a
    draft-side fix (a vocab map) is run on the same rows and paired."""
    stage, loss = draft_stage(inp.draft_rows, inp.draft_rows_kind, inp.draft_rows_path, inp.log, L.S,
                              labels=inp.draft_rows_labels, idx=L.idx, reference=inp.reference)
    L.stages.append(stage)
    L.losses["draft"] = loss
    df = inp.draft_fix
    if df and df.get("rows") and inp.draft_rows and inp.log is not None and stage.get("accept_length") is not None:
        res = reduce(inp.draft_rows, stage["trainer"], len(inp.log.per_position), idx=L.idx)
        fres = reduce(df["rows"], stage["trainer"], len(inp.log.per_position), idx=L.idx)
        S = min(L.S, len(inp.log.per_position))
        a, _, _, da = accept_length_ci(res, S, L.idx)
        b, blo, bhi, db = accept_length_ci(fres, S, L.idx)
        g = db - da
        lo, hi = (float(x) for x in np.percentile(g, [2.5, 97.5]))
        stage["fix"] = {"label": df["label"], "accept_length": b, "ci": [blo, bhi], "gain": b - a, "gain_ci": [lo, hi],
                        "source": df.get("source", "")}
        if len(inp.draft_rows) < SMALL_N:           # what the decision on few rows needs (decide's Student-t)
            stage["fix"]["gain_per_sequence"] = [float(x) for x in per_sequence_accept_length(fres, S)
                                                 - per_sequence_accept_length(res, S)]


def _training_stage(L: _Ladder, inp: BudgetInputs) -> None:
    """3 -- the draft's drafting chain replayed offline on the training data's aux states."""
    if not inp.training:
        L.missing.append("offline on training states: no training samples")
        return
    r = L.sim(inp.training, [inp.settings])
    L.train_frame = r["per_request"][inp.settings]
    L.stages.append(_stage("offline on training states", L.train_frame, L.S,
                           source=f"the draft's drafting chain replayed offline on {len(inp.training)} training "
                                  "sample(s) (SGLang's drafting and greedy verification)",
                           greedy_share=r["greedy_share"]))


def _wiring_stage(L: _Ladder, inp: BudgetInputs) -> None:
    """4 -- the same draft on the aux states the server fed for the same training tokens, paired per sample; then,
    when the live prompts' every-layer reference is given, on the live prompts too (:func:`_wiring_on_live_prompts`)."""
    if not (inp.served_training and L.train_frame is not None):
        why = ("no served capture of the training tokens" if not inp.served_training else
               "no training samples to pair the served states with")
        L.missing.append(f"offline on served states: {why}")
        L.losses["wiring"] = _not_computed("wiring", why)
    else:
        r = L.sim(inp.served_training, [inp.settings])
        f = L.served_frame = r["per_request"][inp.settings]
        L.stages.append(_stage("offline on served states", f, L.S,
                               source=f"the draft run offline on the aux states the server fed for the same "
                                      f"{len(inp.served_training)} training sample(s)"))
        d, lo, hi, n, per = _paired_loss(L.train_frame, f)
        ref = L.stages[-2].get("accept_length") if len(L.stages) >= 2 else None
        L.losses["wiring"] = _loss("wiring", d, lo, hi, f"{TRAINING_WIRING}, paired over {n} sample(s)",
                                   ref, n=n, unit="training samples", per_sequence=per)
    if inp.live_trained and inp.live_sequences:
        _wiring_on_live_prompts(L, inp, L.sim)


def _blind_identity(per: Optional[Sequence[float]], diff: Optional[float]) -> bool:
    """Both arms gave the same result on every sequence while their aux states differ (:func:`states_difference` at
    least :data:`SAME_STATES`, or unknown): too few verify steps to show a difference, not evidence of none."""
    return bool(per) and all(x == 0 for x in per) and (diff is None or diff >= SAME_STATES)


def _more_tokens(max_new_tokens: Optional[int]) -> dict:
    """The settle of a stage the live requests' token cap leaves undecided."""
    return {"n": None, "text": f"more tokens per prompt (--max-new-tokens, now {max_new_tokens})"}


def _wiring_on_live_prompts(L: _Ladder, inp: BudgetInputs, sim) -> None:
    """4b -- the wiring stage on the live prompts' tokens: the draft on the training data's layer plan (the every-layer
    reference of the same tokens) vs on the states the server fed, paired per prompt, both cut at the live requests'
    max_new_tokens. The wiring loss is a counted one (live prompts' first, then the training samples'); else the live
    prompts' decision (the prompts served), the training samples' measurement kept beside it (``also``).

    An identity of outcomes (every prompt the same accept length in both arms) clears only when the states are the
    same (:func:`states_difference` below :data:`SAME_STATES`): with a few tokens per prompt a layer one off can give
    the same verify steps on every prompt while feeding other tensors; it is then undecided, to be settled with more
    tokens per prompt."""
    keys = {s.key for s in inp.live_trained}
    served = [s for s in inp.live_sequences if s.key in keys]
    if not served:
        return
    # the two arms run apart: they share the prompts' keys, which pair them
    a = sim(inp.live_trained, [inp.settings], inp.max_new_tokens)["per_request"][inp.settings]
    b = sim(served, [inp.settings], inp.max_new_tokens)["per_request"][inp.settings]
    d, lo, hi, n, per = _paired_loss(a, b)
    ref = summary(a, L.S)["accept_length"]
    diff = states_difference(served, inp.live_trained)
    live_loss = _loss("wiring", d, lo, hi, f"{LIVE_WIRING}, paired over {n} prompt(s)", ref, n=n, unit="prompts",
                      per_sequence=per, states_difference=diff)
    if live_loss["decision"] == "clear" and _blind_identity(per, diff):
        steps = int(b["verify_ct"].sum()) if "verify_ct" in b.columns else None
        why = (f"both arms gave the same accept length on each of the {n} prompts, but the served states differ from "
               f"the training plan's by {'?' if diff is None else f'{diff:.2f}'} (relative; the same tensors differ "
               f"by less than {SAME_STATES}): {steps} verify steps could not show a loss; more tokens per prompt "
               f"(--max-new-tokens, now {inp.max_new_tokens}) would settle it")
        live_loss.update(decision="undecided", why=why, counts=False, settle=_more_tokens(inp.max_new_tokens))
    old = L.losses.get("wiring")
    brief = lambda x: {k: x.get(k) for k in ("delta", "ci", "decision", "basis")}  # noqa: E731
    if old is None or old.get("delta") is None:
        L.losses["wiring"] = {**live_loss, "also": [] if old is None else [brief(old)]}
    elif live_loss["decision"] == "counts" or old["decision"] != "counts":
        L.losses["wiring"] = {**live_loss, "also": [brief(old)]}
    else:
        old.setdefault("also", []).append(brief(live_loss))
    L.stages.append(_stage("offline on live prompts, training plan", a, L.S,
                           source=f"the draft run offline on the every-layer reference of the live prompts' tokens "
                                  f"at the training data's layer plan ({len(inp.live_trained)} prompt(s)): the wiring "
                                  "stage measured on the live prompts"))


#: a live measurement whose requests average fewer verify steps than this cannot tell settings or an engine apart:
#: with --max-new-tokens 2 every chain and the server give one verify step of 2 tokens per prompt
MIN_VERIFY_STEPS = 2.0


def _verify_steps_per_sequence(frame: Optional[pd.DataFrame]) -> Optional[float]:
    """Verify steps per sequence of a per-request frame (None when it has none)."""
    if frame is None or not len(frame) or "verify_ct" not in frame.columns:
        return None
    return float(frame["verify_ct"].fillna(0).sum()) / len(frame)


def _too_few_verify_steps(name: str, loss: dict, vs: Optional[float], max_new_tokens: Optional[int]) -> dict:
    """``loss`` made undecided when its sequences average fewer than :data:`MIN_VERIFY_STEPS` verify steps (the
    outcomes are capped by the tokens each request asked for, not decided by the stage)."""
    if vs is None or vs >= MIN_VERIFY_STEPS or loss.get("decision") == "undecided":
        return loss
    why = (f"{vs:.1f} verify step(s) per prompt: the live requests' --max-new-tokens ({max_new_tokens}) caps every "
           f"arm's accept length, so the {name} stage cannot be told from them; more tokens per prompt would settle "
           "it")
    return {**loss, "decision": "undecided", "counts": False, "why": why,
            "settle": _more_tokens(max_new_tokens)}


def _engine_stage(L: _Ladder, inp: BudgetInputs) -> None:
    """5 -- the live prompts: the draft offline on the served states of the server's own continuation, against the
    server's counters for the same answers, paired per request."""
    if not (inp.live_sequences and inp.live is not None):
        L.missing.append("live: no live requests with served states")
        L.losses["engine"] = _not_computed("engine", "no live requests with served states (live measurement off "
                                                     "or failed)")
        return
    r = L.sim(inp.live_sequences, [inp.settings], inp.max_new_tokens)
    live_sim = r["per_request"][inp.settings]
    L.stages.append(_stage("offline on live prompts' served states", live_sim, L.S,
                           source=f"the draft run offline on the aux states of {len(inp.live_sequences)} live "
                                  "request(s), the server's own greedy continuation"))
    L.stages.append(_stage("live", inp.live, L.S, source="the same /generate answers' spec_verify_ct and "
                                                          "spec_num_correct_drafts (SGLang's counters)"))
    d, lo, hi, n, per = _paired_loss(live_sim, inp.live)
    L.losses["engine"] = _too_few_verify_steps("engine", _loss(
        "engine", d, lo, hi, f"offline on served states vs live, paired over {n} request(s) (same prompts, same "
        "tokens)", L.stages[-2].get("accept_length"), n=n, unit="prompts", per_sequence=per),
        _verify_steps_per_sequence(inp.live), inp.max_new_tokens)


def acceptance_reference(table: Sequence[dict], served: dict) -> Optional[dict]:
    """The settings stage's acceptance reference: of the chains (topk 1) in ``table`` that accept more tokens per
    verify step than ``served`` and whose modelled tokens per unit time (``speedup_model``) is at least the served
    settings' (they dominate them, on the point estimates), the one the cost model puts fastest (the higher
    ``accept_length`` on a tie); None when no chain dominates the served settings. It is also what the stage
    recommends when its loss counts, so the loss is what the recommendation is simulated to restore. Below
    :data:`helpers.draft.decide.SMALL_N` sequences a None is not read as clear (:func:`_no_reference`).

    ``table``: rows ``{"steps", "topk", "draft_tokens", "accept_length", "speedup_model", ...}``; ``served`` one of
    them."""
    dom = [t for t in table if t["topk"] == 1 and t is not served and t["speedup_model"] >= served["speedup_model"]
           and t["accept_length"] > served["accept_length"]]
    return max(dom, key=lambda t: (t["speedup_model"], t["accept_length"])) if dom else None


def trade_text(t: dict) -> str:
    """The settings trade (:func:`settings_trade`) in words: what the served settings give up and what the cost model
    says they buy."""
    return (f"the served settings accept {t['accept_length'] - t['served_accept_length']:.2f} fewer tokens per verify "
            f"step than --speculative-num-steps {t['steps']} would ({t['accept_length']:.2f} vs "
            f"{t['served_accept_length']:.2f}, simulated), which the cost model puts "
            f"{t['modelled_speedup_change']:+.1%}: the settings' trade, not a fault (measure tok/s at both to choose)")


def settings_trade(table: Sequence[dict], served: dict, material: float) -> Optional[dict]:
    """What served settings that no chain dominates give up: the chain accepting the most tokens per verify step,
    at least ``material`` more than ``served``, among those modelled at most :data:`NEAR_BEST` slower; None when
    none. ``{"steps", "accept_length", "served_accept_length", "modelled_speedup_change"}``."""
    near = [t for t in table if t["topk"] == 1 and t is not served
            and t["speedup_model"] >= served["speedup_model"] * (1.0 - NEAR_BEST)
            and t["accept_length"] - served["accept_length"] >= material]
    if not near or not served["speedup_model"]:
        return None
    t = max(near, key=lambda x: (x["accept_length"], -x["steps"]))
    return {"steps": t["steps"], "accept_length": t["accept_length"], "served_accept_length": served["accept_length"],
            "modelled_speedup_change": t["speedup_model"] / served["speedup_model"] - 1.0}


def _no_reference(served: dict, table: Sequence[dict], thr: float, n: int) -> dict:
    """The settings loss when no chain dominates the served settings on the estimates (:func:`acceptance_reference`):
    clear from :data:`helpers.draft.decide.SMALL_N` sequences on; below, ``undecided`` (the few-sequence rule of
    :func:`helpers.draft.decide.decide`: on 3 training samples of the Kimi-class draft steps 3 came out 0.04 % slower
    than the served steps 2 in the cost model, a trade, while on 16 live prompts it is 4 % faster and accepts 0.38
    more: the chains' order near the cost model's optimum is no evidence over so few)."""
    more = [t for t in table if t["topk"] == 1 and t is not served and t["accept_length"] > served["accept_length"]]
    if more:
        near = max(more, key=lambda t: t["speedup_model"])
        why = (f"no chain that accepts more tokens per verify step is modelled at least as fast as the served settings "
               f"on the same {n} sequence(s) (the nearest, --speculative-num-steps {near['steps']}, accepts "
               f"{near['accept_length'] - served['accept_length']:+.2f} at modelled tokens per unit time "
               f"{near['speedup_model'] / served['speedup_model'] - 1.0:+.1%})")
    else:
        why = f"no chain accepts more tokens per verify step than the served settings on the same {n} sequence(s)"
    out = {"stage": "settings", "delta": 0.0, "basis": why, "threshold": thr, "n": n, "counts": False,
           "material": False, "beyond_ci": False}
    if n < SMALL_N:
        return {**out, "ci": [None, None], "decision": "undecided",
                "settle": {"n": SMALL_N, "text": f"about {SMALL_N} sequences (now {n}) would settle it"},
                "why": f"{why}; below {SMALL_N} sequences the chains' order in the cost model is no evidence"}
    return {**out, "ci": [0.0, 0.0], "decision": "clear", "settle": None, "why": why}


def _settings_stage(L: _Ladder, inp: BudgetInputs) -> None:
    """6 -- other ``--speculative-num-steps`` simulated on the same states, scored by a cost model; the loss in accept
    length against the acceptance reference (:func:`acceptance_reference`)."""
    st = inp.settings
    grid_src = inp.live_sequences or inp.served_training or inp.training
    if not grid_src:
        L.losses["settings"] = _not_computed("settings", "no sequences to simulate other settings on")
        return
    grid_name = ("live prompts' served states" if grid_src is inp.live_sequences else
                 "served states" if grid_src is inp.served_training else "training states")
    grid = sorted({DraftSettings.chain(s) for s in SETTINGS_STEPS} | {st}, key=lambda x: (x.topk, x.steps))
    r = L.sim(grid_src, grid, inp.max_new_tokens if grid_src is inp.live_sequences else None)
    table = []
    for g in grid:
        s = summary(r["per_request"][g], g.steps)
        table.append({"steps": g.steps, "topk": g.topk, "draft_tokens": g.draft_tokens,
                      "accept_length": s["accept_length"], "ci": [s["accept_length_lo"], s["accept_length_hi"]],
                      "frame": r["per_request"][g]})
    r_cost = inp.draft_cost if inp.draft_cost is not None else 0.0
    for t in table:
        t["speedup_model"] = t["accept_length"] / (1.0 + t["steps"] * r_cost)
    served = next(t for t in table if (t["steps"], t["topk"], t["draft_tokens"]) == (st.steps, st.topk, st.draft_tokens))
    best = max((t for t in table if t["topk"] == 1), key=lambda t: t["speedup_model"])

    def change(t: dict) -> float:
        return t["speedup_model"] / served["speedup_model"] - 1.0 if served["speedup_model"] else 0.0

    n = len(served["frame"])
    ref = acceptance_reference(table, served) if inp.draft_cost is not None else None
    thr = threshold(served["accept_length"])
    if inp.draft_cost is None:
        # without a cost for a draft step more steps always look better: nothing is recommended, nothing decided
        L.missing.append("settings: no draft-step cost (draft_cost); the table is shown, nothing is recommended")
        L.losses["settings"] = _not_computed("settings", "no draft-step cost: no setting can be recommended")
        rec = served
    else:
        if ref is not None:
            d, lo, hi, n, per = _paired_loss(ref["frame"], served["frame"])
            basis = (f"--speculative-num-steps {ref['steps']} (chain) accepts {d:+.2f} tokens per verify step over "
                     f"the served settings, simulated on the same {n} sequence(s) and paired, at modelled tokens per "
                     f"unit time {change(ref):+.1%}: the served settings buy no modelled throughput for the tokens "
                     "they do not accept")
            L.losses["settings"] = _loss("settings", d, lo, hi, basis, served["accept_length"], n=n, per_sequence=per)
            if n < SMALL_N:
                # dominance is an order of chains in the cost model, read on the estimates: over so few sequences it
                # is no evidence either way (on 3 Llama samples steps 5 dominated the served steps 3 by 1.15 tokens,
                # on 16 steps 4 is modelled 3.6 % slower and nothing dominates)
                k = max(SMALL_N, (L.losses["settings"].get("settle") or {}).get("n") or 0)
                L.losses["settings"].update(
                    decision="undecided", counts=False,
                    settle={"n": k, "text": f"about {k} sequences (now {n}) would settle it"},
                    why=f"{basis}; below {SMALL_N} sequences the chains' order in the cost model is no evidence")
        else:
            L.losses["settings"] = _no_reference(served, table, thr, n)
        vs = _verify_steps_per_sequence(served["frame"]) if grid_src is inp.live_sequences else None
        capped = vs is not None and vs < MIN_VERIFY_STEPS and L.losses["settings"]["decision"] != "undecided"
        L.losses["settings"] = _too_few_verify_steps("settings", L.losses["settings"], vs, inp.max_new_tokens)
        if L.losses["settings"]["counts"]:
            rec = ref                                         # accepts more at a throughput the model cannot fault
        elif change(best) >= MATERIAL and not capped:
            rec = best                                        # a material modelled gain (fewer steps: a note below)
        else:
            rec = served
    gain = change(rec)
    L.rec = rec
    L.stages.append({"name": "best settings (simulated)", "accept_length": rec["accept_length"], "ci": rec["ci"],
                     "settings": {k: rec[k] for k in ("steps", "topk", "draft_tokens")}, "grid": grid_name,
                     "served_accept_length": served["accept_length"],
                     "acceptance_reference": None if ref is None else {
                         **{k: ref[k] for k in ("steps", "topk", "draft_tokens", "accept_length")},
                         "modelled_speedup_change": change(ref)},
                     "source": f"the draft run offline on the {grid_name} at other --speculative-num-steps; scored by "
                               f"accept length / (1 + steps x {r_cost:.3f}), the draft forward's cost relative to a "
                               f"verify step ({inp.draft_cost_source}); this row is the recommended setting: the "
                               "acceptance reference (the fastest chain among those that accept more and are modelled "
                               "at least as fast as the served settings) when its loss counts, else the cost model's "
                               f"best chain when it is modelled at least {MATERIAL:.0%} faster, else the served "
                               "settings",
                     "modelled_speedup_gain": gain})
    if rec["steps"] < st.steps:
        L.notes.append(f"the cost model favours --speculative-num-steps {rec['steps']} (fewer than the served "
                       f"{st.steps}: accept length {rec['accept_length']:.2f}, modelled tokens per unit time "
                       f"{gain:+.0%}); it is the recommended setting, to be measured before it is adopted")
    trade = None
    if inp.draft_cost is not None and ref is None and L.losses["settings"]["decision"] == "clear":
        trade = settings_trade(table, served, thr)
        if trade is not None:
            L.notes.append(f"{trade_text(trade)}; within the cost model's resolution ({NEAR_BEST:.0%})")
    L.trade = trade
    for t in table:
        t.pop("frame")
    L.settings_table = table


def _fix_stage(L: _Ladder, inp: BudgetInputs) -> None:
    """The proposed fix, proven offline: the drafting chain on the states the fix would feed, paired with the
    served states on the same samples."""
    if not (inp.fix and inp.fix.get("sequences")):
        return
    st = inp.settings
    fdraft = inp.fix.get("draft") or L.draft
    f = simulate_sequences(fdraft, inp.fix["sequences"], [st])["per_request"][st]
    s = summary(f, L.S)
    fo = {"label": inp.fix.get("label", "proposed fix"), "accept_length": s["accept_length"],
          "ci": [s["accept_length_lo"], s["accept_length_hi"]], "plan": inp.fix.get("plan")}
    if inp.served_training:
        if L.served_frame is None:              # stage 4 did not run (no training frame): simulate them here
            L.served_frame = simulate_sequences(L.draft, inp.served_training, [st])["per_request"][st]
        d, lo, hi, n, per = _paired_loss(f, L.served_frame)
        ref = next((x.get("accept_length") for x in L.stages if x["name"] == "offline on served states"), None)
        dec = decide(d, lo, hi, threshold(ref), n=n, unit="training samples", per_sequence=per)
        lo, hi = dec["ci"]
        decision = dec["decision"]
        diff = states_difference(inp.fix["sequences"], inp.served_training)
        if decision == "clear" and _blind_identity(per, diff):
            decision = "undecided"           # the same verify steps from other states: too few to show a gain
        fo.update(gain=d, gain_ci=[lo, hi], n_paired=n, gain_per_sequence=per, states_difference=diff,
                  proven=bool(np.isfinite(lo) and lo > 0 and d >= MIN_TOKENS), decision=decision)
    L.fix_offline = fo


#: the budget's stages, in ladder order: each ``stage(L, inp)`` adds its rows to ``L.stages`` and its loss to
#: ``L.losses`` (the fix's offline proof last: it pairs with the served frame stage 4 built)
BUDGET_STAGES: tuple[tuple[str, Any], ...] = (
    ("training log", _log_stage), ("draft", _draft_stage), ("training states", _training_stage),
    ("wiring", _wiring_stage), ("engine", _engine_stage), ("settings", _settings_stage), ("fix", _fix_stage))


def acceptance_budget(draft: Eagle3Draft, inp: BudgetInputs, *, progress=None,
                      required: Sequence[str] = REQUIRED_STAGES) -> dict:
    """Compute the budget (module docstring): the stages in ladder order, each loss with its decision, the cause.

    ``required``: the stages that must be ``clear`` before the cause is ``none`` (an offline run without a server
    leaves out ``engine``, and ``wiring`` without a served capture; the budget says which were required).

    Returns ``{"settings", "stages": [{name, accept_length, ci, ...}], "losses": {draft|wiring|engine|settings:
    {delta, ci, decision (counts|clear|undecided), threshold, settle, basis, counts}}, "cause", "sentence",
    "recommended_settings", "settings_table", "settings_trade" (:func:`settings_trade`, or None), "fix_offline",
    "missing": [...], "notes", "draft_sources", "workload"}`` (accept lengths in tokens per verify step, bonus token
    included).
    """
    st = inp.settings.check()

    def sim(seqs, settings, mnt=None):
        return simulate_sequences(draft, seqs, settings, max_new_tokens=mnt, progress=progress)

    L = _Ladder(S=st.steps, draft=draft, sim=sim,
                idx=bootstrap_index(len(inp.draft_rows)) if inp.draft_rows else None)
    for _name, stage in BUDGET_STAGES:
        stage(L, inp)
    names = {x["name"]: x.get("accept_length") for x in L.stages}
    tr, lp = names.get("offline on training states"), names.get("offline on live prompts' served states")
    workload = None
    if tr is not None and lp is not None:
        workload = {"training_samples": tr, "live_prompts": lp, "delta": tr - lp,
                    "note": "the same draft, offline, on the training samples vs on the live prompts: a difference "
                            "in the text (how predictable it is), not a stage of the server"}
    out = {"settings": {"steps": st.steps, "topk": st.topk, "draft_tokens": st.draft_tokens},
           "stages": L.stages, "losses": L.losses, "missing": L.missing, "notes": L.notes,
           "recommended_settings": None if L.rec is None else {k: L.rec[k] for k in ("steps", "topk", "draft_tokens")},
           "settings_table": L.settings_table, "settings_trade": L.trade, "fix_offline": L.fix_offline,
           "draft_sources": draft.sources, "workload": workload, "required": list(required)}
    out["cause"] = cause_of(L.losses, required)
    out["sentence"] = budget_sentence(out)
    return jsonable(out)



def cause_of(losses: dict, required: Sequence[str] = REQUIRED_STAGES) -> str:
    """The cause: the counted loss that is largest; ``none`` only when every required stage
    (:data:`REQUIRED_STAGES`) is ``clear``; else ``undecided`` (never read as "no loss").

    A stage measured on the server (a workload sweep or engine toggle joined by :func:`join_ablation`, a measured fix
    joined by :func:`helpers.investigation.story.reconcile`) is a loss like the others."""
    counted = {k: v for k, v in losses.items() if v.get("decision") == "counts"}
    if counted:
        return max(counted, key=lambda k: counted[k]["delta"])
    if all((losses.get(s) or {}).get("decision") == "clear" for s in required):
        return "none"
    return "undecided"


#: the opening of join_ablation's note when no stage counts (reconcile drops it once a stage does: a fix measured later)
NO_STAGE_COUNTS = "no stage loses a material share on the prompts measured here"

#: the stages a workload sweep (context, concurrency: the requests sent) can speak to; an undecided wiring, draft or
#: settings stage is settled by more training samples or rows, not by sweeping the requests
SWEEPABLE_STAGES = ("engine", "workload")


def sweeps_can_settle(b: dict) -> bool:
    """Whether ``investigate``'s automatic workload sweeps can tell anything the budget ``b`` leaves open: its cause
    is ``undecided`` and one of the undecided stages is one the requests decide (:data:`SWEEPABLE_STAGES`)."""
    if not b or b.get("cause") != "undecided":
        return False
    return any((b.get("losses") or {}).get(s, {}).get("decision") == "undecided" for s in SWEEPABLE_STAGES)


def join_ablation(b: dict, findings: Sequence[dict]) -> dict:
    """Put the evidence of ablations and workload sweeps (findings of :mod:`helpers.investigation.ablate`) into the
    budget ``b`` and return it: each becomes ``b["ablation"][cause]`` evidence. When no stage of the budget counts
    (cause ``undecided`` or ``none``) and the requests' own workload is what the sweep varied, the sweep says which
    requests would lose acceptance: a note, not the server's loss. An engine toggle that recovers acceptance on a
    restarted copy of the server is a measured engine loss: it counts, with the measured paired change (tokens per
    verify step, bonus token included), and the sentence is rewritten."""
    ev: dict[str, list] = {}
    for f in findings:
        c = ABLATION_CAUSES.get(f["kind"])
        if c is not None:
            ev.setdefault(c, []).append(f)
    if not ev:
        return b
    b["ablation"] = {c: [{"kind": f["kind"], "detail": f["detail"]} for f in fs] for c, fs in ev.items()}
    engine = [f for f in ev.get("engine", []) if f["kind"] == "engine_feature_costs_acceptance"]
    if engine and b.get("cause") in ("none", "undecided"):
        eff = engine[0]["evidence"].get("effect") or {}
        d = eff.get("accept_length_delta")
        ci = [eff.get("accept_length_delta_lo"), eff.get("accept_length_delta_hi")]
        if d is not None and None not in ci:
            b.setdefault("losses", {})["engine"] = {
                **(b.get("losses") or {}).get("engine", {}),
                **_loss("engine", d, ci[0], ci[1], f"measured on the server (engine_feature_costs_acceptance): "
                        f"{engine[0]['detail']}", None, n=eff.get("n_paired"), unit="prompts",
                        per_sequence=eff.get("accept_length_per_prompt"))}
            b["cause"] = cause_of(b["losses"], b.get("required") or REQUIRED_STAGES)
            b["sentence"] = budget_sentence(b)
            return jsonable(b)
    b.setdefault("notes", []).append(
        NO_STAGE_COUNTS + "; " + "; ".join(
            f"{f['kind']}: {f['detail']}" for fs in ev.values() for f in fs)
        + " (a cause of low acceptance where production requests are like these, not of a loss measured here)")
    return jsonable(b)


def _fmt(x: Optional[float]) -> str:
    return "n/a" if x is None or not np.isfinite(x) else f"{x:.2f}"


def _open_reason(loss: dict) -> str:
    """Why a stage is undecided and what would settle it, in words."""
    settle = (loss.get("settle") or {}).get("text")
    if loss.get("delta") is None:
        return settle or loss.get("why") or "not computed"
    return f"{loss['delta']:.2f} [{_fmt(loss['ci'][0])}, {_fmt(loss['ci'][1])}] against a material " \
           f"{_fmt(loss.get('threshold'))}; {settle or ''}".rstrip("; ")


def budget_sentence(b: dict) -> str:
    """One sentence: where the accept length goes (each stage's accept length) and the cause, which is never "no
    loss" unless every stage's CI rules a material loss out."""
    parts = [f"{s['name']} {_fmt(s.get('accept_length'))}" for s in b["stages"]]
    cause = b["cause"]
    L = b["losses"]
    if cause == "none":
        req = b.get("required") or REQUIRED_STAGES
        why = "every stage's CI rules out a material loss (" + "; ".join(
            f"{k} < {L[k]['threshold']:.2f}" for k in req if L.get(k, {}).get("threshold") is not None) + ")"
        w = b.get("workload")
        if w and w["delta"] >= MIN_TOKENS:
            why += (f"; the live prompts are less predictable for this draft than its training samples "
                    f"({w['live_prompts']:.2f} vs {w['training_samples']:.2f} offline): the text, not the server")
        if b.get("settings_trade"):
            why += "; " + trade_text(b["settings_trade"])
        r, sv = b.get("recommended_settings"), b.get("settings") or {}
        st = _stage_al(b, "best settings (simulated)") or {}
        if r and sv and (r.get("steps"), r.get("topk")) != (sv.get("steps"), sv.get("topk")) \
                and st.get("modelled_speedup_gain") is not None:
            why += (f"; the cost model puts --speculative-num-steps {r['steps']} {st['modelled_speedup_gain']:+.0%} "
                    f"in tokens per unit time while it accepts {_fmt(st.get('accept_length'))} tokens per verify "
                    f"step against the served {_fmt(st.get('served_accept_length'))}: not a loss of accepted tokens, "
                    "a throughput to measure (tok/s at both)")
    elif cause == "undecided":
        open_ = [k for k in (b.get("required") or REQUIRED_STAGES) if (L.get(k) or {}).get("decision") != "clear"]
        why = ("no stage loses a material share beyond its CI, and a material loss is not ruled out at " + "; ".join(
            f"{k} ({_open_reason(L.get(k) or {})})" for k in open_))
    else:
        l = L[cause]
        why = f"{l['delta']:.2f} tokens per verify step lost at the {cause} stage [{_fmt(l['ci'][0])}, " \
              f"{_fmt(l['ci'][1])}] ({l['basis']})"
        if cause == "settings" and b.get("recommended_settings"):
            r = b["recommended_settings"]
            why += f"; recommended --speculative-num-steps {r['steps']} --speculative-eagle-topk {r['topk']} " \
                   f"--speculative-num-draft-tokens {r['draft_tokens']}"
    pt = engine_parts_text((L.get("engine") or {}).get("parts"))
    return f"Accept length by stage: {'; '.join(parts)}. Cause: {cause}: {why}." + (f" {pt}." if pt else "")


def engine_parts_text(parts: Optional[Sequence[dict]]) -> str:
    """The engine stage's parts (``losses["engine"]["parts"]``: the engine-state probes joined,
    ``helpers.investigation.probes.parts.engine_parts``) in one clause, each with its decision: ``"Engine parts: cold
    greedy clear; verification clear (sampled_verify only; not run: greedy_lossless, oracle); ..."``: a part cleared
    while some of its probes did not run names the probes it rests on and those not run; "" when there are none."""
    if not parts:
        return ""
    return "Engine parts: " + "; ".join(f"{p['part']} {p['decision']}" + (
        f" ({', '.join(p['rests_on'])} only; not run: {', '.join(p['not_run'])})"
        if p["decision"] == "clear" and p.get("not_run") else "") for p in parts)


def _stage_al(b: dict, name: str) -> Optional[dict]:
    return next((s for s in b.get("stages") or [] if s["name"] == name and s.get("accept_length") is not None), None)


def gains(b: dict) -> list[dict]:
    """The losses that are gains (a stage accepts more than the one before it, by at least 0.005 tokens), each
    ``{"stage", "delta", "ci", "text"}`` with why, from the budget's own figures: which two figures are compared, on
    which rows, whether the gain lies beyond its CI, and what the decision says of it."""
    out = []
    for stage, loss in (b.get("losses") or {}).items():
        d = loss.get("delta")
        if d is None or not np.isfinite(d) or d > -0.005:
            continue
        lo, hi = (list(loss.get("ci") or []) + [None, None])[:2]
        beyond = hi is not None and np.isfinite(hi) and hi < 0
        ci = f" [{_fmt(lo)}, {_fmt(hi)}]" if lo is not None and hi is not None else ""
        noise = ("beyond its CI" if beyond else "within its CI (no gain is shown: the CI reaches 0)")
        if loss.get("on_server"):
            why = f"the fix lowered live accept length by {-d:.2f}{ci} ({loss.get('basis', '')})"
        elif stage == "draft":
            ds, log = _stage_al(b, "checkpoint (teacher-forced)"), _stage_al(b, "training log")
            # the log's accept length the draft loss was computed against: the checkpoint stage's own (its basis,
            # draft_stage.py), which a budget without a "training log" stage (NextN / MTP) also carries
            log_al = (ds or {}).get("log_accept_length")
            if log_al is None:
                log_al = (log or {}).get("accept_length")
            rows = (ds or {}).get("rows") or {}
            kind = rows.get("kind") or {}
            steps = [r for r in (ds or {}).get("table") or [] if r.get("acc") is not None and r.get("log_acc")
                     is not None]
            above = [f"step {r['step']}: {r['acc']:.3f} vs the log's {r['log_acc']:.3f}" for r in steps
                     if r["acc"] > r["log_acc"]]
            why = (f"the checkpoint scores {_fmt((ds or {}).get('accept_length'))} teacher-forced on "
                   f"{rows.get('sequences', '?')} sequence(s) of {rows.get('path', 'its rows')} (split "
                   f"{kind.get('split', '?')}, text {kind.get('text', '?')}), above its training log's "
                   f"{_fmt(log_al)} (split {((ds or {}).get('log_kind') or {}).get('split', '?')})"
                   + (f"; per TTT step it is above the log at {'; '.join(above)}" if above else "")
                   + (f" ({ds['why']})" if (ds or {}).get("why") else ""))
        elif stage == "wiring":
            t, s_ = _stage_al(b, "offline on training states"), _stage_al(b, "offline on served states")
            why = (f"the draft accepts {_fmt((s_ or {}).get('accept_length'))} on the states the server fed and "
                   f"{_fmt((t or {}).get('accept_length'))} on the training data's states for the same tokens: the "
                   "served states suit it at least as well")
        elif stage == "engine":
            s_, live = _stage_al(b, "offline on live prompts' served states"), _stage_al(b, "live")
            why = (f"live accepts {_fmt((live or {}).get('accept_length'))}, the draft run offline on the states the "
                   f"server fed for the same answers {_fmt((s_ or {}).get('accept_length'))}: the engine's drafts "
                   "match the target more often than the offline replay's")
        else:
            why = loss.get("basis", "")
        dec = loss.get("why") or loss.get("decision") or ""
        out.append({"stage": stage, "delta": d, "ci": [lo, hi],
                    "text": f"the {stage} stage gains {-d:.2f} tokens per verify step{ci}, {noise}: {why}"
                            + (f"; decision {loss.get('decision')}: {dec}" if dec and dec != loss.get("decision")
                               else f"; decision {loss.get('decision')}")})
    return out
