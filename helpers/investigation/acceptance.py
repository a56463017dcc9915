"""The acceptance budget inside a live investigation: inputs gathered from the run (training data, the served capture,
live requests that return both aux states and SGLang's counters, the every-layer reference, the proposed fix), the
budget computed by :func:`helpers.draft.budget.acceptance_budget`, and the findings it implies.

The live requests go through the engine adapter's capture (SGLang: greedy ``/generate`` calls with
``return_hidden_states``; vLLM: ``/v1/completions`` with the worker extension's capture and the per-request
``metrics.speculative_decoding``), the prefix cache emptied before each so the prompt block is complete: one answer
gives the aux states the server fed for its own continuation and the same request's verify steps and accepted drafts,
so the offline run and the live counters are paired on identical tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pandas as pd
import torch

from ..acceptance.prompts import load_prompts
from ..diagnosis.detectors import finding
from ..draft.budget import LIVE_WIRING, acceptance_budget, dump_sequences, plan_sequences, training_sequences
from ..draft.model import Eagle3Draft
from ..draft.precision import choose_dtype, server_dtype
from ..draft.simulate import DraftSettings
from ..draft.teacher_forced import run as tf_run
from ..draft.offline import offline_inputs
from ..engines.base import EngineAdapter
from ..engines.sglang import SGLangAdapter
from ..formats.configs import read_draft_config
from ..formats.training_data import TrainingData
from ..kinds import PLAN_KINDS
from ..records import ProposedFix

#: cause -> finding kind
CAUSE_KINDS = {"draft": "draft_underperforms", "wiring": "wiring_loses_acceptance",
               "engine": "engine_after_capture", "settings": "spec_settings_low",
               "workload": "workload_loses_acceptance"}


@dataclass
class BudgetRun:
    """What :func:`run_budget` produced: the budget document, its findings, and the live counters it measured."""

    budget: dict
    findings: list = field(default_factory=list)
    live: Optional[pd.DataFrame] = None
    withdraw_fix: Optional[str] = None


def fix_plan(fix: Optional[ProposedFix], findings: list[dict], training_tensors: Optional[list[str]]
             ) -> Optional[tuple[str, list[str]]]:
    """``(label, served plan after the fix)`` to prove offline, or None when the fix does not change the plan.

    A config fix carries its plan (``expected_served``, SGLang's rules). An engine fix that feeds the all-reduced
    embedding (``embedding_not_all_reduced``) yields the embedding in that chunk; another engine change is taken to
    feed the training plan."""
    if fix is None or fix.kind == "none" or not training_tensors:
        return None
    if not fix.expected_served and not PLAN_KINDS & {f["kind"] for f in findings}:
        return None
    if fix.expected_served:
        return "the proposed fix", list(fix.expected_served)
    plan = list(training_tensors)
    touched = False
    for f in findings:
        if f["kind"] == "embedding_not_all_reduced" and f.get("chunk") is not None and f["chunk"] < len(plan):
            plan[f["chunk"]] = "embedding"
            touched = True
    return ("the proposed engine change" if touched else "the training plan (the engine change, done right)"), plan


#: the most training samples the wiring stage grows to, and live prompts the engine stage grows to, when undecided
MAX_WIRING_SAMPLES = 32
MAX_LIVE_PROMPTS = 64


def run_budget(*, client, info: dict, draft_dir: Path, target_dir: Path, training: str | Path, hidden_size: int,
               num_samples: int, served_dump: Optional[Path], reference: Optional[Path], run_dir: Path,
               settings: DraftSettings, fix: Optional[ProposedFix], findings: list[dict],
               training_tensors: Optional[list[str]], training_log: Optional[str | Path] = None,
               validation: Optional[str | Path] = None, rows_word: tuple[Optional[str], Optional[str]] = (None, None),
               draft_cost: Optional[float] = None,
               prompts: int = 16, max_new_tokens: int = 32, measure: bool = True,
               progress: Callable[[str], None] = lambda s: None,
               adapter: Optional[EngineAdapter] = None,
               live_reference: Optional[Callable[[list[dict], str], Optional[Path]]] = None) -> BudgetRun:
    """Gather the budget's inputs from the live run and compute it; a stage left ``undecided`` by too few samples
    is measured again on more (training samples captured from the server up to :data:`MAX_WIRING_SAMPLES`; live
    prompts up to :data:`MAX_LIVE_PROMPTS` for the engine and settings stages) when the data holds them, once. ``adapter``: the server's engine adapter
    (its ``capture_served`` gives the live stage's states and per-request counters of the same answers; default
    SGLang's). ``live_reference(prompts, name)``: an every-layer reference dump of ``prompts`` (``{"id",
    "input_ids"}``), or None; with it the wiring stage is measured on the live prompts' tokens too, at the training
    data's layer plan (``training_tensors``) from that reference (:func:`helpers.draft.budget._wiring_on_live_prompts`).

    Raises:
        BadInput: the draft checkpoint cannot be run offline (keys or shapes unlike its config, a missing target
            embedding, an unsupported architecture), unreadable training log or rows.
    """
    choice = choose_dtype(server_dtype(info, _raw(draft_dir)), "cpu")     # what this CPU runs natively
    progress(f"offline draft run: compute dtype {choice.reason}")
    off = offline_inputs(draft_dir, target_dir, training, hidden_size=hidden_size, choice=choice, samples=num_samples,
                         served=served_dump, training_log=training_log, validation=validation, rows_word=rows_word,
                         draft_cost=draft_cost,
                         progress=progress)
    draft, dr, train_seqs, served = off.draft, off.rows, off.training, off.served
    for where, why in off.skipped:
        progress(f"training sample {where} left out: {why}")
    adapter = adapter or SGLangAdapter()
    live_seqs = live = None
    if measure:
        live_seqs, live = _live(adapter, client, run_dir, 0, prompts, max_new_tokens, hidden_size, progress)
    fix_in, draft_fix = _fix_inputs(fix, findings, training_tensors, reference, train_seqs, served, draft, dr)

    def compute_with(live_trained: Optional[list] = None) -> dict:
        return acceptance_budget(draft, off.budget_inputs(
            settings, draft_fix=draft_fix, training=train_seqs, served_training=served, live_sequences=live_seqs,
            live=live, live_trained=live_trained, max_new_tokens=max_new_tokens, fix=fix_in), progress=None)

    def trained_on_live() -> tuple[Optional[list], Optional[str]]:
        if not (live_seqs and live_reference is not None and training_tensors):
            return None, None
        name, k = "reference-live", 2            # a new dump per call (the reference adds -hf or -server)
        while any((run_dir / "dumps" / f"{name}-{x}").exists() for x in ("hf", "server")):
            name, k = f"reference-live-{k}", k + 1
        return _live_trained(live_reference, live_seqs, training_tensors, progress, name)

    grown, notes = [], []
    live_trained, why = trained_on_live()
    if why:
        notes.append(why)
    b = compute_with(live_trained)
    need_w = _settle_n(b, "wiring")
    on_live = LIVE_WIRING in ((b["losses"].get("wiring") or {}).get("basis") or "")
    if need_w and not on_live and served is not None and len(train_seqs) < min(need_w, MAX_WIRING_SAMPLES):
        more = _more_training(adapter, client, training, hidden_size, len(train_seqs), min(need_w, MAX_WIRING_SAMPLES),
                              run_dir, progress)
        if more is not None:
            train_seqs, served = more
            grown.append(f"wiring: measured again on {len(train_seqs)} training samples (undecided on fewer)")
    # the engine stage pairs the live prompts; the settings stage simulates on their served states; the wiring stage,
    # when the live prompts decide it, pairs them too: any of them grows the live prompts
    open_live = {st: n for st in ("engine", "settings") if (n := _settle_n(b, st))}
    if need_w and on_live:
        open_live["wiring"] = need_w
    need_e = max(open_live.values(), default=None)
    if need_e and live is not None and len(live) < min(need_e, MAX_LIVE_PROMPTS):
        extra_n = min(need_e, MAX_LIVE_PROMPTS) - len(live)
        s2, l2 = _live(adapter, client, run_dir, len(live), extra_n, max_new_tokens, hidden_size, progress)
        live_seqs, live = live_seqs + s2, pd.concat([live, l2], ignore_index=True)
        grown.append(f"{' and '.join(open_live)}: measured again on {len(live)} live prompts (undecided on fewer)")
        if live_trained is not None:
            live_trained, _ = trained_on_live()
    if grown:
        b = compute_with(live_trained)
    if grown or notes:
        b.setdefault("notes", []).extend(notes + grown)
    out = BudgetRun(budget=b, live=live)
    cause = b["cause"]
    if cause in CAUSE_KINDS and not (cause == "wiring" and any(f["kind"] != "config_ids_mismatch" for f in findings)):
        loss = b["losses"].get(cause) or {}
        ds = next((s for s in b["stages"] if s["name"] == "checkpoint (teacher-forced)"), {})
        out.findings.append(finding(CAUSE_KINDS[cause], None, b["sentence"], stage=cause, loss=loss,
                                    stages=[{k: s.get(k) for k in ("name", "accept_length", "ci")}
                                            for s in b["stages"]],
                                    per_step=ds.get("table") if cause == "draft" else None,
                                    recommended_settings=b.get("recommended_settings"),
                                    source="simulation: the draft checkpoint run offline as SGLang runs it "
                                           "(helpers.draft), live counters from the same /generate answers"))
    out.withdraw_fix = fix_withdrawal(b.get("fix_offline"))
    return out


def fix_withdrawal(fo: Optional[dict]) -> Optional[str]:
    """Why the proposed fix is withdrawn, or None to keep it: only when its offline proof (``fix_offline`` of
    :func:`helpers.draft.budget.acceptance_budget`: the gain, its paired CI and its decision) rules a material gain
    out (decision ``clear``). A gain that is small but undecided (its CI still holds a material gain, e.g. on a few
    samples) is not "nil": the fix stays, unproven, to be measured."""
    if not fo or fo.get("gain") is None or fo.get("decision") != "clear":
        return None
    ci = fo.get("gain_ci") or [None, None]
    ci_txt = f" [{ci[0]:+.2f}, {ci[1]:+.2f}]" if None not in ci else ""
    return (f"{fo['label']} (served plan [{', '.join(fo.get('plan') or [])}]) was run offline on the every-layer "
            f"reference: accept length {fo['accept_length']:.2f}, a gain of {fo['gain']:+.2f}{ci_txt} over the served "
            f"states on {fo.get('n_paired')} sample(s), which rules out a material gain, so it is not proposed")


def _settle_n(b: dict, stage: str) -> Optional[int]:
    """The sample count that would settle an undecided stage (None when decided or not estimable)."""
    loss = (b.get("losses") or {}).get(stage) or {}
    if loss.get("decision") != "undecided":
        return None
    return (loss.get("settle") or {}).get("n")


def _live(adapter: EngineAdapter, client, run_dir: Path, first: int, n: int, max_new_tokens: int, hidden_size: int,
          progress: Callable[[str], None]) -> tuple[list, pd.DataFrame]:
    """``n`` live prompts (from the ``first``-th): their served states (the server's own continuation) and the
    server's counters, from the same answers (the engine adapter's ``capture_served`` with ``records``)."""
    progress(f"live: {n} prompts x {max_new_tokens} tokens, aux states and counters from the same answers")
    recs: list = []
    ps = load_prompts(None, n=first + n)[first:]
    dump = adapter.capture_served(client, ps, run_dir / "dumps", name=_free(run_dir / "dumps", "live-continuations"),
                                  max_new_tokens=max_new_tokens, records=recs, max_width=16 * hidden_size)
    return dump_sequences(dump), pd.DataFrame(recs)


def _live_trained(live_reference: Callable[[list[dict], str], Optional[Path]], live_seqs: list,
                  training_tensors: list[str], progress: Callable[[str], None],
                  name: str = "reference-live") -> tuple[Optional[list], Optional[str]]:
    """The training data's layer plan on the live prompts' tokens (prompt and the server's continuation), from an
    every-layer reference of those tokens, and why not (None and the reason when none can be made or it lacks a
    tensor of the plan)."""
    progress(f"wiring on the live prompts: every-layer reference of {len(live_seqs)} live prompts")
    path = live_reference([{"id": s.key, "input_ids": [int(t) for t in s.tokens]} for s in live_seqs],
                          name)
    if path is None:
        return None, "wiring on the live prompts not measured: no every-layer reference of their tokens"
    try:
        return plan_sequences(path, training_tensors, live_seqs), None
    except KeyError as exc:
        why = (f"wiring on the live prompts not measured: the training data's layer plan "
               f"[{', '.join(training_tensors)}] names a tensor the target does not have ({exc.args[0]})")
        progress(why)
        return None, why


def _more_training(adapter: EngineAdapter, client, training: str | Path, hidden_size: int, have: int, want: int,
                   run_dir: Path, progress: Callable[[str], None]) -> Optional[tuple[list, list]]:
    """``want`` training samples and their served states (captured now), or None when the data holds no more."""
    td = TrainingData(training, hidden_size=hidden_size, max_samples=want)
    samples = list(td)
    if len(samples) <= have:
        return None
    progress(f"wiring undecided on {have} training sample(s): capturing {len(samples)}")
    dump = adapter.capture_served(client, samples, run_dir / "dumps", name=_free(run_dir / "dumps", "served-more"),
                                  max_width=16 * hidden_size)
    seqs = training_sequences(TrainingData(training, hidden_size=hidden_size, max_samples=want))
    return seqs, dump_sequences(dump, starts={s.key: s.start for s in seqs})


def _fix_inputs(fix: Optional[ProposedFix], findings: list[dict], training_tensors: Optional[list[str]],
                reference: Optional[Path], train_seqs: list, served: Optional[list], draft: Eagle3Draft,
                dr: dict) -> tuple[Optional[dict], Optional[dict]]:
    """The proposed fix applied offline, every part of it: the served plan it yields (from the every-layer reference)
    for the drafting chain, and its vocab map (a d2t it adds) for both the drafting chain and the draft stage's
    teacher-forced rows (a fix that rewires the ids and replaces the d2t gets both; the draft stage's rows are the
    training data's own states, so the vocab map is measured there whatever the plan)."""
    fix_in = draft_fix = fixed = None
    if fix is not None and "d2t" in (fix.add_tensors or {}):
        src = fix.add_tensors["d2t"]
        obj = torch.load(src, map_location="cpu", weights_only=True)
        if isinstance(obj, dict) and "d2t" in obj:
            fixed = draft.with_vocab_map(obj["d2t"], src)
            if dr.get("seqs"):
                draft_fix = {"label": "the proposed vocab map", "source": str(src),
                             "rows": tf_run(fixed, dr["seqs"], dr["steps"])}
    fp = fix_plan(fix, findings, training_tensors)
    if fp is not None and reference is not None:
        try:
            fix_in = {"label": fp[0], "plan": fp[1], "sequences": plan_sequences(reference, fp[1], train_seqs)}
            if fixed is not None:
                fix_in.update(label=f"{fp[0]} with the proposed vocab map", draft=fixed)
        except KeyError:
            fix_in = None
    elif fixed is not None and served:
        fix_in = {"label": "the proposed vocab map", "plan": None, "sequences": served, "draft": fixed}
    return fix_in, draft_fix


def _raw(draft_dir: Path) -> dict:
    return read_draft_config(draft_dir).raw


def _free(parent: Path, name: str) -> str:
    n, k = name, 2
    while (parent / n).exists():
        n, k = f"{name}-{k}", k + 1
    return n


def live_summary(live: pd.DataFrame) -> dict[str, Any]:
    """accept length / rate of the live frame (no CI), for the progress line."""
    ok = live[live["verify_ct"].fillna(0) > 0]
    if not len(ok):
        return {"accept_length": None, "accept_rate": None}
    return {"accept_length": float(ok["completion_tokens"].sum() / ok["verify_ct"].sum()),
            "accept_rate": float(ok["correct_drafts"].sum() / max(1, ok["proposed_drafts"].sum()))}
