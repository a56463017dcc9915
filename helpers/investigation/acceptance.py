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


@dataclass
class BudgetRequest:
    """What one server's acceptance budget is computed from (:func:`run_budget`): one typed record.

    Attributes:
        draft_dir / target_dir: the served draft's and target's folders (config.json, weights).
        training: the training data (a SpecForge / EAGLE dump folder or file); hidden_size: the target's hidden size.
        settings: the served ``(steps, topk, draft_tokens)``; run_dir: the run folder (dumps go to ``run_dir/dumps``).
        num_samples: training samples for the wiring stage; served_dump: the server's capture of them (None: the
            wiring stage on the training samples is not measured); reference: the every-layer reference of them (the
            fix's offline proof), or None.
        fix / findings / training_tensors: the proposed fix, the diagnosis' findings, the training data's layer plan
            (tensor names, e.g. ``["hidden_states.3", ...]``) for the fix's proof and the wiring on the live prompts.
        training_log / validation / rows_word: the draft stage's log and rows (paths, or None: found beside the
            draft); draft_cost: one draft forward's cost relative to a verify step (None: from the weights).
        prompts / max_new_tokens / measure: the live prompts sent (cold, greedy) and their tokens; ``measure=False``
            sends none (the engine stage is then undecided, saying why).
    """

    draft_dir: Path
    target_dir: Path
    training: str | Path
    hidden_size: int
    settings: DraftSettings
    run_dir: Path
    num_samples: int = 4
    served_dump: Optional[Path] = None
    reference: Optional[Path] = None
    fix: Optional[ProposedFix] = None
    findings: list = field(default_factory=list)
    training_tensors: Optional[list[str]] = None
    training_log: Optional[str | Path] = None
    validation: Optional[str | Path] = None
    rows_word: tuple[Optional[str], Optional[str]] = (None, None)
    draft_cost: Optional[float] = None
    prompts: int = 16
    max_new_tokens: int = 32
    measure: bool = True


@dataclass
class BudgetServer:
    """The server a budget measures: its client (``helpers.server.client``), ``/server_info`` (``info``; its
    ``version`` picks the adapter's draft loader rules, which the offline run follows), engine adapter (its
    ``capture_served`` gives the live stage's states and per-request counters of the same answers) and
    ``live_reference(prompts, name) -> Path | None``: an every-layer reference dump of ``prompts`` (``{"id",
    "input_ids"}``), or None (the wiring stage is then not measured on the live prompts)."""

    client: Any
    info: dict
    adapter: EngineAdapter = field(default_factory=SGLangAdapter)
    live_reference: Optional[Callable[[list[dict], str], Optional[Path]]] = None


@dataclass
class _State:
    """What :func:`run_budget`'s stages build, in order (each stage reads what the ones before it set)."""

    req: BudgetRequest
    server: BudgetServer
    progress: Callable[[str], None]
    off: Any = None
    train_seqs: list = field(default_factory=list)
    served: Optional[list] = None
    live_seqs: Optional[list] = None
    live: Optional[pd.DataFrame] = None
    live_trained: Optional[list] = None
    fix_in: Optional[dict] = None
    draft_fix: Optional[dict] = None
    b: Optional[dict] = None
    grown: list = field(default_factory=list)
    notes: list = field(default_factory=list)

    def compute(self) -> dict:
        r = self.req
        return acceptance_budget(self.off.draft, self.off.budget_inputs(
            r.settings, draft_fix=self.draft_fix, training=self.train_seqs, served_training=self.served,
            live_sequences=self.live_seqs, live=self.live, live_trained=self.live_trained,
            max_new_tokens=r.max_new_tokens, fix=self.fix_in, engine=getattr(self.server.adapter, "name", None)),
            progress=None)

    def trained_on_live(self) -> tuple[Optional[list], Optional[str]]:
        r, lr = self.req, self.server.live_reference
        if not (self.live_seqs and lr is not None and r.training_tensors):
            return None, None
        name, k = "reference-live", 2            # a new dump per call (the reference adds -hf or -server)
        while any((r.run_dir / "dumps" / f"{name}-{x}").exists() for x in ("hf", "server")):
            name, k = f"reference-live-{k}", k + 1
        return _live_trained(lr, self.live_seqs, r.training_tensors, self.progress, name)


def _s_offline(s: _State) -> None:
    """The draft checkpoint loaded to run as the engine runs it (the server's loader rules: its embedding, lm_head, d2t
    and norms, so a loss the loader causes lands in the draft stage, not the engine stage), its rows and training
    samples, the served states."""
    r = s.req
    choice = choose_dtype(server_dtype(s.server.info, _raw(r.draft_dir)), "cpu")     # what this CPU runs natively
    s.progress(f"offline draft run: compute dtype {choice.reason}")
    s.off = offline_inputs(r.draft_dir, r.target_dir, r.training, hidden_size=r.hidden_size, choice=choice,
                           samples=r.num_samples, served=r.served_dump, training_log=r.training_log,
                           validation=r.validation, rows_word=r.rows_word, draft_cost=r.draft_cost,
                           progress=s.progress, loader=s.server.adapter.loader_rules(s.server.info.get("version")))
    s.train_seqs, s.served = s.off.training, s.off.served
    for where, why in s.off.skipped:
        s.progress(f"training sample {where} left out: {why}")


def _s_live(s: _State) -> None:
    """The live prompts: served states and counters of the same answers (none with ``measure=False``)."""
    r = s.req
    if r.measure:
        s.live_seqs, s.live = _live(s.server.adapter, s.server.client, r.run_dir, 0, r.prompts, r.max_new_tokens,
                                    r.hidden_size, s.progress)


def _s_fix(s: _State) -> None:
    """The proposed fix applied offline (:func:`_fix_inputs`)."""
    r = s.req
    s.fix_in, s.draft_fix = _fix_inputs(r.fix, r.findings, r.training_tensors, r.reference, s.train_seqs, s.served,
                                        s.off.draft, s.off.rows)


def _s_compute(s: _State) -> None:
    """The training data's plan on the live prompts' tokens, and the budget computed once."""
    s.live_trained, why = s.trained_on_live()
    if why:
        s.notes.append(why)
    s.b = s.compute()


def _s_grow(s: _State) -> None:
    """A stage left undecided by too few samples measured again on more, once: training samples up to
    :data:`MAX_WIRING_SAMPLES` (the wiring stage on the training samples), live prompts up to
    :data:`MAX_LIVE_PROMPTS` (engine, settings, and the wiring stage when the live prompts decide it)."""
    r, b = s.req, s.b
    need_w = _settle_n(b, "wiring")
    on_live = LIVE_WIRING in ((b["losses"].get("wiring") or {}).get("basis") or "")
    if need_w and not on_live and s.served is not None and len(s.train_seqs) < min(need_w, MAX_WIRING_SAMPLES):
        more = _more_training(s.server.adapter, s.server.client, r.training, r.hidden_size, len(s.train_seqs),
                              min(need_w, MAX_WIRING_SAMPLES), r.run_dir, s.progress)
        if more is not None:
            s.train_seqs, s.served = more
            s.grown.append(f"wiring: measured again on {len(s.train_seqs)} training samples (undecided on fewer)")
    open_live = {st: n for st in ("engine", "settings") if (n := _settle_n(b, st))}
    if need_w and on_live:
        open_live["wiring"] = need_w
    need_e = max(open_live.values(), default=None)
    if need_e and s.live is not None and len(s.live) < min(need_e, MAX_LIVE_PROMPTS):
        extra_n = min(need_e, MAX_LIVE_PROMPTS) - len(s.live)
        s2, l2 = _live(s.server.adapter, s.server.client, r.run_dir, len(s.live), extra_n, r.max_new_tokens,
                       r.hidden_size, s.progress)
        s.live_seqs, s.live = s.live_seqs + s2, pd.concat([s.live, l2], ignore_index=True)
        s.grown.append(f"{' and '.join(open_live)}: measured again on {len(s.live)} live prompts (undecided on fewer)")
        if s.live_trained is not None:
            s.live_trained, _ = s.trained_on_live()
    if s.grown:
        s.b = s.compute()
    if s.grown or s.notes:
        s.b.setdefault("notes", []).extend(s.notes + s.grown)


#: :func:`run_budget`'s stages, in order
RUN_STAGES: tuple[tuple[str, Callable[[_State], None]], ...] = (
    ("offline inputs", _s_offline), ("live prompts", _s_live), ("fix offline", _s_fix), ("budget", _s_compute),
    ("more samples", _s_grow))


def run_budget(req: BudgetRequest, server: BudgetServer, *,
               progress: Callable[[str], None] = lambda s: None) -> BudgetRun:
    """Gather the budget's inputs from the live run and compute it (:data:`RUN_STAGES`, in order): the draft
    checkpoint offline, the live prompts' states and counters of the same answers, the proposed fix applied offline,
    the budget (:func:`helpers.draft.budget.acceptance_budget`, with the wiring stage measured on the live prompts'
    tokens when ``server.live_reference`` gives their every-layer reference at the training data's plan), and a
    stage left ``undecided`` by too few samples measured again on more, once; then the cause's finding.

    Raises:
        BadInput: the draft checkpoint cannot be run offline (keys or shapes unlike its config, a missing target
            embedding, an unsupported architecture), unreadable training log or rows.
    """
    s = _State(req, server, progress)
    for _name, stage in RUN_STAGES:
        stage(s)
    b, findings = s.b, req.findings
    out = BudgetRun(budget=b, live=s.live)
    cause = b["cause"]
    if cause in CAUSE_KINDS and not (cause == "wiring" and any(f["kind"] != "config_ids_mismatch" for f in findings)):
        loss = b["losses"].get(cause) or {}
        ds = next((x for x in b["stages"] if x["name"] == "checkpoint (teacher-forced)"), {})
        out.findings.append(finding(CAUSE_KINDS[cause], None, b["sentence"], stage=cause, loss=loss,
                                    stages=[{k: x.get(k) for k in ("name", "accept_length", "ci")}
                                            for x in b["stages"]],
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
