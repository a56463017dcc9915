"""The live investigation of a server whose fault nobody wrote down (``python -m helpers investigate``).

Steps, each timed and reported as a progress line:

1. **attach** -- ``/server_info``: SGLang version, TP size, speculative algorithm and settings, the draft and target
   folders the server really runs (``speculative_draft_model_path``, ``model_path``), and the forward hooks it runs
   (this tool's capture hooks give the per-rank capture folder and the every-layer reference folder; other hooks are
   listed). A ``--draft`` that differs from the server's draft is a finding (``served_draft_differs``). Then the
   ``--requests`` file is checked (:func:`.workload.workload_check`) before any request, then the training data (none:
   the layer plan identified from the draft on the server's continuations, :func:`.identify.identify_stage`).
2. **capture** -- what the draft receives for the training samples' tokens (one row per token).
3. **reference** -- every layer of the target for the same tokens: the server's own every-layer capture when its
   hooks are on (same numerics as the served tensors), else HF transformers on the target folder when the weights
   are there and fit in memory, else none, with what is missing and what it would settle.
4. **diagnosis** -- :func:`helpers.diagnosis.diagnose.diagnose` (static check with provenance + numeric comparison).
5. **hypotheses** -- every check of :data:`helpers.investigation.catalog.CHECK_SPECS` marked ``live``,
   ordered by the evidence (confirmed, then inconclusive, then refuted).
6. **proposed fix** -- :func:`helpers.investigation.propose.propose_fix`.
7. **relaunch** (optional) -- when the server is one this tool can restart (an embedded server started by
   ``python -m helpers server start``, found in :mod:`helpers.server.registry`, or a launch command given), the fix
   is applied on a fresh server; the same prompts are measured on both servers (paired CIs) and the fixed server's
   aux states are captured and diagnosed again.

The document written (``investigation.json``) is a :class:`helpers.records.InvestigationDoc`; its ``sentence`` opens
the postmortem.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from ..acceptance.machine import speed_change
from ..acceptance.measure import measure
from ..acceptance.prompts import load_prompts
from ..acceptance.stats import paired_effect
from ..budget import Budget
from ..errors import BadInput, describe
from ..draft.eagle1 import is_eagle1
from ..formats.configs import read_config_json, read_draft_config, read_target_config
from ..formats.training_data import TrainingData
from ..kinds import ACCEPTANCE_KINDS, CHECK_FINDINGS, DRAFT_KINDS, TENSOR_KINDS, kind_words
from ..records import Finding, HypothesisEntry, InvestigationDoc, ProposedFix
from ..runfiles import atomic_write_text, new_run_dir, safe_name, write_json
from ..diagnosis.plan_rules import PlanRules
from ..engines.base import EngineAdapter
from ..engines.detect import detect
from ..server.client import ServerClient
from ..server.embedded import parse_ports
from ..server.hosts import is_local_url
from ..draft.checks import draft_checks
from ..draft.simulate import DraftSettings
from .ablate import ablate as run_ablation, ablation_text
from .acceptance import BudgetRequest, BudgetServer, run_budget
from ..draft.budget import join_ablation, sweeps_can_settle
from .catalog import LIVE_CHECKS
from .checks import run_check, static_findings
from .inputs import Investigation
from .attach import Attachment, attach, capture_hooks, require_draft
from .identify import PROVENANCE, every_layer_reference as _reference, identify_stage
from .engine_stage import budget_line, final_budget_line, run_engine_state
from .probes import check_choice, join_engine_state
from .probes.sampled import check_sampling
from .mtp import algorithm_text, investigate_mtp, mtp_sentence
from .single_state import EAGLE1
from .propose import draft_variant, propose_fix
from .workload import workload_check, workload_stage
from .story import measured_text, no_fix_text, provenance, reconcile as tell_one_story

Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


@dataclass
class Request:
    """What was asked of an investigation (the arguments of :func:`investigate`, documented there)."""

    url: str
    training: Optional[str | Path]
    run_dir: Path
    draft: Optional[str | Path] = None
    target: Optional[str | Path] = None
    relaunch: Optional[str] = None
    api_key: Optional[str] = None
    timeout: Optional[float] = 900.0
    num_samples: int = 4
    measure_prompts: int = 16
    max_new_tokens: int = 32
    concurrency: int = 4
    apply_fix: bool = True
    not_applied: str = "--no-apply: the fix was only proposed"
    measured_by: Optional[str] = None
    port: int | str | None = None
    acceptance_budget: bool = True
    live_measure: bool = True
    training_log: Optional[str | Path] = None
    sweeps: str | Sequence[str] = "auto"
    sweep_budget: float = 120.0
    validation: Optional[str | Path] = None
    rows_word: tuple[Optional[str], Optional[str]] = (None, None)
    draft_cost: Optional[float] = None
    engine_probes: str = "cheap"
    probe_sampling: Optional[dict] = None
    requests: tuple[Optional[str | Path], Optional[str | Path]] = (None, None)   # --requests FILE, --tokenizer DIR


@dataclass
class Run:
    """The one state the stages of :func:`investigate` fill, in order (each stage reads what earlier ones left).

    Attributes:
        req: the request; doc: the document being written; dl: the run's one deadline; client: the server's client
            (its engine's :class:`helpers.server.client.ServerClient`); progress: the progress callback; adapter: the
            server's engine adapter (:mod:`helpers.engines`, detected once from its own endpoints: every engine-
            specific step goes through it); timings: seconds per step; rules: the engine's id rules of the server's
            version (set at attach).
        att: the attachment (:func:`helpers.investigation.attach.attach`); tcfg: the target config; td: the training
            data; inv: the :class:`helpers.investigation.inputs.Investigation` of the server; samples: the training
            samples captured; ref: the every-layer reference dump or None; diag: the diagnosis; extra: findings from
            outside the diagnosis (attach, draft checks); fix: the proposed fix; withdrawn: why the acceptance
            budget withdrew it (its offline proof ruled a material gain out), else None; live: the budget's live
            per-request frame (the engine-state probes' cold arm).
    """

    req: Request
    doc: InvestigationDoc
    dl: Budget
    progress: Progress
    client: Optional[ServerClient] = None
    adapter: Optional[EngineAdapter] = None
    timings: dict = field(default_factory=dict)
    rules: Optional[PlanRules] = None
    att: Optional[Attachment] = None
    tcfg: Any = None
    td: Optional[TrainingData] = None
    inv: Optional[Investigation] = None
    samples: list = field(default_factory=list)
    ref: Optional[Path] = None
    diag: Any = None
    extra: list = field(default_factory=list)
    fix: Optional[ProposedFix] = None
    workload: Any = None                           # the --requests file read at attach (workload.workload_check)
    withdrawn: Optional[str] = None
    live: Any = None

    def step(self, name: str) -> float:
        self.dl.check(f"before the {name} step")
        self.progress(f"{name} ...")
        return time.monotonic()

    def done(self, name: str, t: float, note: str = "") -> None:
        self.timings[name] = round(time.monotonic() - t, 2)
        self.progress(f"{name}: {note} ({self.timings[name]:.1f} s)" if note else
                      f"{name}: done ({self.timings[name]:.1f} s)")


def _sweeps(r: Run) -> None:
    """The investigation's workload sweeps (``investigate``'s ``sweeps``), their findings, and the budget they join."""
    doc, req = r.doc, r.req
    b = doc.acceptance or {}
    if req.sweeps == "auto":
        # only when the budget leaves open a stage the requests decide (not wiring / draft: more samples or rows)
        chosen = ["context", "concurrency"] if sweeps_can_settle(b) else []
        if b.get("cause") == "undecided" and not chosen:
            doc.notes.append("workload sweeps not run: the budget's undecided stages are settled by what each says "
                             "(more samples, rows, prompts or tokens per prompt), not by sweeping the requests "
                             "(--sweeps context,concurrency runs them)")
    else:
        chosen = list(req.sweeps)
    if not chosen:
        return
    left = r.dl.remaining()
    secs = req.sweep_budget if left is None else min(req.sweep_budget, left - 60)
    if secs < 20:
        doc.notes.append(f"workload sweeps ({', '.join(chosen)}) skipped: {max(0, left or 0):.0f} s left of the run")
        return
    t = r.step("workload sweeps")
    ab = run_ablation(r.client.url, run_dir=req.run_dir, sweeps=chosen, toggles=(), budget=Budget(secs, flag="--timeout"),
                      budget_s=secs, client=r.client, adapter=r.adapter, draft=r.att.draft_dir, target=r.att.target_dir,
                      training_log=req.training_log, api_key=req.api_key,
                      num_prompts=max(2, min(req.measure_prompts, 10)), max_new_tokens=req.max_new_tokens,
                      progress=r.progress)
    have = {f.kind for f in doc.findings}
    new = [f for f in ab["findings"] if f["kind"] not in have]
    doc.findings += [Finding(**f) for f in new]
    before = b.get("cause")
    doc.acceptance = join_ablation(b, ab["findings"])
    doc.notes += [f"workload sweeps: {s}" for s in ab["skipped"]]
    r.done("workload sweeps", t, ablation_text(ab) + (f"; the budget's cause is now {doc.acceptance['cause']}"
                                                      if doc.acceptance.get("cause") != before else ""))


# ------------------------------------------------------------------------------------------------ the stages

def _connect(r: Run) -> None:
    """The server's engine, detected once from its own endpoints (:func:`helpers.engines.detect.detect`: one line
    and exit 2 for a server that is neither SGLang nor a known vLLM), and its client."""
    req = r.req
    r.adapter = detect(req.url, req.api_key, budget=r.dl).adapter     # the run's one deadline covers detection
    r.client = r.adapter.client(req.url, req.api_key, timeout=min(600.0, req.timeout or 600.0), budget=r.dl,
                                on_wait=r.progress if r.progress is not _noop else None)


def _stage_attach(r: Run) -> None:
    """What the server runs; the target config and training data it is compared with."""
    req, doc = r.req, r.doc
    t = r.step("attach")
    att = r.att = attach(r.client, draft=req.draft, target=req.target, relaunch=req.relaunch,
                         caveats=r.adapter.capture_caveats)
    r.rules = r.adapter.rules(att.version)
    doc.attach = att.to_json()
    doc.engine, doc.engine_version = r.adapter.name, att.version
    head = att.draft_head
    algo = algorithm_text(att.algorithm, head) if head else (att.algorithm or "no speculative algorithm")
    r.done("attach", t, f"{r.adapter.label} {att.version}, TP {att.tp}, {algo}, draft {att.draft_dir or 'none'} "
                        f"[{att.draft_source}]" + (f" = MTP head {head['class']} ({head['source']})" if head else "")
                        + f", target {att.target_dir} [{att.target_source}]")
    if att.draft_head is not None:                 # an MTP / NextN head: its own stages (helpers.investigation.mtp)
        investigate_mtp(r, _reference)
        raise _Stopped
    if att.draft_dir is not None and is_eagle1(read_config_json(att.draft_dir / "config.json", "draft config")):
        # an EAGLE-1 draft (vLLM method eagle) reads one target state, as an MTP head: the same stages, its profile
        investigate_mtp(r, _reference, EAGLE1)
        raise _Stopped
    for caveat in att.caveats:                     # never silence: the capture path this run cannot vouch for
        doc.notes.append(caveat)
        r.progress("caveat: " + caveat)
    require_draft(att)
    r.tcfg = read_target_config(att.target_dir)
    r.extra = list(att.findings)


def _stage_training(r: Run) -> None:
    """The training data the served states are compared with: ``--training``, else the layer plan identified from
    the draft itself on the server's continuations (:func:`.identify.identify_stage`: requests, so after the
    ``requests`` stage has checked the ``--requests`` file), and the training samples to capture."""
    req, doc, att = r.req, r.doc, r.att
    identify_stage(r)                              # no training data: the plan identified from the draft itself
    r.td = TrainingData(req.training, hidden_size=r.tcfg.hidden_size, max_samples=req.num_samples)
    if r.td.hidden_size is not None and r.td.hidden_size != r.tcfg.hidden_size:
        raise BadInput(f"the training data is {r.td.hidden_size} wide per chunk but the target's hidden size is "
                       f"{r.tcfg.hidden_size}", path=req.training)
    r.inv = Investigation(req.run_dir, r.client, training=req.training, draft_dir=att.draft_dir,
                          target_dir=att.target_dir, name="server", num_samples=req.num_samples, reference=None,
                          algorithm=att.algorithm, adapter=r.adapter, rules=r.rules,
                          capture_dir=r.adapter.rank_capture_dir(att.rank_capture_dir, req.run_dir, "server"))
    r.samples = r.inv.training_samples()
    if len(r.samples) < req.num_samples:
        doc.notes.append(f"{req.num_samples} training samples were asked for; the training data hold "
                         f"{len(r.samples)}, all of which were used")
        r.progress("note: " + doc.notes[-1])
    doc.samples = len(r.samples)


class _Stopped(Exception):
    """The run ends here with its findings recorded (the engine cannot serve the draft: nothing to capture)."""


def _stage_capture(r: Run) -> None:
    """What the draft receives for the training samples' tokens. When the engine's rules say the server fails at
    the first forward (the served plan is ``fatal``: e.g. vLLM feeding the draft's fc fewer chunks than it takes,
    ``VLLMRules.served_plan``), no request is sent (it would stop the engine: vLLM answers HTTP 500 and its
    EngineCore dies) and the run ends with the static check's findings (``server_fatal``)."""
    t = r.step("capture")
    rep = static_findings(r.inv)
    if rep.served_plan is not None and rep.served_plan.fatal:
        doc = r.doc
        doc.findings = [Finding(**f) for f in _measured_first(rep.findings + r.extra)]
        doc.diagnosis = rep.to_json()
        doc.verdict = "mismatch"
        doc.seconds_to_verdict = round(r.dl.elapsed(), 1)
        doc.notes.append(f"nothing was captured: {r.adapter.label} {r.att.version} cannot run this draft "
                         f"({rep.served_plan.fatal}); a request would fail in the draft, so none was sent")
        r.progress("note: " + doc.notes[-1])
        r.done("capture", t, "not sent: " + ", ".join(dict.fromkeys(f.kind for f in doc.findings)))
        raise _Stopped
    served, stand_in = r.inv.served_dump(), PROVENANCE in r.doc.training         # stand_in: no --training given
    what = "the server's states of {} plan-identification sample(s) (the stand-in for training data)" if stand_in \
        else "{} training sample(s)"
    r.done("capture", t, f"{what.format(len(r.samples))} -> {served.relative_to(r.req.run_dir)}")


def _stage_reference(r: Run) -> None:
    """Every layer of the target for the same tokens (the server's own capture, else HF, else none)."""
    t = r.step("reference")
    r.ref, how, missing = _reference(r.adapter, r.att, r.client, r.samples, r.req.run_dir,
                                     r.tcfg.num_hidden_layers)
    r.inv.reference_spec = r.ref                       # drops the reference resolved before
    r.doc.reference = {"how": how, "path": None if r.ref is None else str(r.ref), "missing": missing}
    r.done("reference", t, how if r.ref is not None else f"none ({missing})")


def _stage_diagnosis(r: Run) -> None:
    """The static check and the numeric comparison: the findings on the wiring."""
    doc = r.doc
    t = r.step("diagnosis")
    r.diag = r.inv.diagnosis(reference=r.ref is not None)
    for n in getattr(r.diag, "notes", None) or []:
        if "the manifest does not describe this data" in n:       # the plan every later step uses: say it
            r.doc.notes.append(n)
            r.progress("note: " + n)
    doc.findings = [Finding(**f) for f in _measured_first(r.diag.findings + r.extra)]
    doc.diagnosis = r.diag.to_json()
    doc.verdict = "ok" if not doc.findings else "mismatch"
    doc.seconds_to_verdict = round(r.dl.elapsed(), 1)
    r.done("diagnosis", t, f"{doc.verdict}: " + (", ".join(dict.fromkeys(f.kind for f in doc.findings))
                                                 or "no finding"))


def _stage_draft_checks(r: Run) -> None:
    """The draft checkpoint and its config against the target, no server needed."""
    doc = r.doc
    t = r.step("draft checks")
    try:
        dc = draft_checks(r.att.draft_dir, r.att.target_dir, training=Path(r.req.training),
                          loader=r.adapter.loader_rules(r.att.version))
    except BadInput as exc:
        dc = []
        doc.notes.append(f"draft checks not run: {exc}")
    have = {f.kind for f in doc.findings}
    new = [f for f in dc if f["kind"] not in have]
    r.extra += new
    doc.findings += [Finding(**f) for f in new]
    if new:
        doc.verdict = "mismatch"
    r.done("draft checks", t, ", ".join(f["kind"] for f in new) or "no finding")


def _stage_hypotheses(r: Run) -> None:
    """Every live check, ordered by the evidence."""
    t = r.step("hypotheses")
    r.doc.hypotheses = _hypotheses(r.inv, r.req.run_dir)
    r.done("hypotheses", t, ", ".join(f"{h['check']} {h['verdict']}" for h in r.doc.hypotheses
                                      if h["verdict"] == "confirmed") or "none confirmed")


def _stage_propose(r: Run) -> None:
    """The fix the findings imply, under the server's engine rules."""
    t = r.step("proposed fix")
    td = r.td
    r.fix = propose_fix(r.diag, draft=read_draft_config(r.att.draft_dir / "config.json"), target=r.tcfg,
                        version=r.att.version, algorithm=r.att.algorithm,
                        training_dir=td.path if td.path.is_dir() else td.path.parent, extra_findings=r.extra,
                        hooks=r.att.other_hooks, rules=r.rules)
    r.doc.proposed_fix = r.fix
    r.done("proposed fix", t, r.fix.summary)


#: the launch flags of the speculative settings (a fix made only of these is superseded by the settings stage's)
SPEC_FLAGS = ("--speculative-num-steps", "--speculative-eagle-topk", "--speculative-num-draft-tokens")


def _settings_fix(fix: ProposedFix, budget: dict) -> None:
    """The settings stage's recommendation as the fix (flags a relaunch applies and measures) when nothing else is,
    or when the fix proposed so far only requests speculative flags (e.g. the draft tokens SGLang already runs, for
    ``num_draft_tokens_overridden``): the recommended settings replace those flags (a chain's draft tokens are
    steps + 1, so they also answer the override) and the fix keeps its other parts' findings."""
    rec = budget.get("recommended_settings")
    if budget["cause"] != "settings" or not rec:
        return
    only_spec = fix.kind == "config" and fix.server_args and set(fix.server_args) <= set(SPEC_FLAGS) \
        and not (fix.draft_config or fix.add_tensors or fix.drop_tensors)
    if fix.kind != "none" and not only_spec:
        return
    flags = {"--speculative-num-steps": rec["steps"], "--speculative-eagle-topk": rec["topk"],
             "--speculative-num-draft-tokens": rec["draft_tokens"]}
    part = " ".join(f"{k} {v}" for k, v in flags.items())
    if only_spec:
        fix.why.append(f"the settings stage's recommendation replaces the requested {fix.server_args} (it sets the "
                       "same flags)")
    fix.server_args = flags
    fix.kind, fix.applicable = "config", True
    fix.parts = [f"launch with {part}"]
    fix.summary = fix.parts[0] + " (the acceptance budget's settings stage, simulated)"
    fix.why.append(budget["losses"]["settings"]["basis"])
    fix.addresses.append("spec_settings_low")


def _stage_budget(r: Run) -> None:
    """The acceptance budget (and the workload sweeps that join it)."""
    req, doc, att = r.req, r.doc, r.att
    spec = att.spec or {}
    if not req.acceptance_budget:
        return
    if not all(spec.get(k) for k in ("num_steps", "topk", "num_draft_tokens")):
        doc.notes.append("no acceptance budget: the server reports no speculative settings (num_steps, topk, "
                         "num_draft_tokens: the client's server_info)")
        return
    t = r.step("acceptance budget")
    missing: list[str] = []

    def live_reference(prompts, name):
        path, _, why = _reference(r.adapter, att, r.client, prompts, req.run_dir, r.tcfg.num_hidden_layers, name=name)
        if path is None and why and why not in missing:
            missing.append(why)            # why the wiring stage is not measured on the live prompts: said
        return path

    try:
        br = run_budget(BudgetRequest(
            draft_dir=att.draft_dir, target_dir=att.target_dir, training=req.training,
            hidden_size=r.tcfg.hidden_size, num_samples=req.num_samples, served_dump=r.inv.served_dump(),
            reference=r.ref, run_dir=req.run_dir,
            settings=DraftSettings(int(spec["num_steps"]), int(spec["topk"]), int(spec["num_draft_tokens"])),
            fix=r.fix, findings=r.diag.findings + r.extra,
            training_tensors=None if r.diag.training_plan is None else list(r.diag.training_plan.tensors),
            training_log=req.training_log, validation=req.validation, rows_word=req.rows_word,
            draft_cost=req.draft_cost, prompts=req.measure_prompts, max_new_tokens=req.max_new_tokens,
            measure=req.live_measure),
            BudgetServer(r.client, att.info, r.adapter, live_reference), progress=r.progress)
    except BadInput as exc:
        # the draft cannot run on what the server feeds (H-wide states, a checkpoint unlike its config): say why
        doc.notes.append(f"acceptance budget not computed: {exc}")
        r.done("acceptance budget", t, f"not computed: {exc}")
        return
    doc.acceptance, r.live = br.budget, br.live
    doc.notes += [f"wiring on the live prompts not measured: {m}" for m in missing]
    if br.withdraw_fix:
        r.withdrawn = br.withdraw_fix
        doc.notes.append(br.withdraw_fix)
        r.fix.applicable = False
        r.fix.summary = "none proven: " + br.withdraw_fix
    _settings_fix(r.fix, br.budget)
    r.done("acceptance budget", t, budget_line(r, f"cause {br.budget['cause']}: " + ", ".join(
        f"{s['name']} {s['accept_length']:.2f}" for s in br.budget["stages"] if s.get("accept_length") is not None)))
    _sweeps(r)


def _stage_engine_state(r: Run) -> None:
    """The engine-state probes (:func:`helpers.investigation.engine_stage.run_engine_state`): the live prompts in
    conditions a cold greedy probe never sees (a prefix-cache hit; with ``--engine-probes all`` restarted copies:
    chunked prefill, the target alone at temperature 0), folded into the budget's engine stage; each probe not run
    says why."""
    state = run_engine_state(r)
    if state is None:
        return
    have = {f.kind for f in r.doc.findings}
    r.doc.findings += [Finding(**f) for f in state["findings"] if f["kind"] not in have]
    r.doc.acceptance = join_engine_state(r.doc.acceptance, state)
    final_budget_line(r, r.doc.acceptance)


def _stage_caveats(r: Run) -> None:
    """What this run could not see (one TP rank's states only)."""
    att = r.att
    if att.tp > 1 and r.inv.capture_dir is None:
        hooks = (f"; it runs {len(att.other_hooks)} forward hook(s) that are not capture hooks "
                 f"({', '.join(str(h.get('name')) for h in att.other_hooks)}), whose effect on other ranks was "
                 "not seen") if att.other_hooks else ""
        r.doc.notes.append(f"only TP rank 0's aux states were compared (what /generate returns) on this TP {att.tp} "
                           f"server{hooks}; to compare every rank, start the server with the per-rank capture hooks "
                           "(`python -m helpers server start --capture-ranks DIR`, env/gpu/launch_tp8.sh with "
                           "HOOKS_DIR) and investigate again")


def _stage_measure_fix(r: Run) -> None:
    """The fix applied on a restarted copy and measured before / after on the same prompts, or why not."""
    req, doc, fix = r.req, r.doc, r.fix
    doc.hypotheses = reconcile(doc.hypotheses, doc.findings)
    doc.measured = not_measured(doc, fix, withdrawn=r.withdrawn, apply_fix=req.apply_fix,
                                measured_by=req.measured_by, not_applied=req.not_applied,
                                restartable=r.att.restart is not None)
    if doc.measured is None:
        t = r.step("relaunch")
        doc.measured = _apply_and_measure(r, fix)
        r.done("relaunch", t, _measured_text(doc.measured))


#: what a before / after measurement of a fix keeps of the summary of :func:`helpers.acceptance.measure` (the EAGLE-3
#: relaunch here and the NextN one, :func:`helpers.investigation.mtp_fix.measure_fix`)
MEASURE_KEEP = ("accept_length", "accept_length_lo", "accept_length_hi", "accept_rate", "accept_rate_lo",
                "accept_rate_hi", "tok_s", "tok_s_lo", "tok_s_hi", "n_requests", "n_failed", "num_steps", "topk",
                "num_draft_tokens", "algorithm", "machine")


def not_measured(doc: InvestigationDoc, fix: ProposedFix, *, withdrawn: Optional[str], apply_fix: bool,
                 measured_by: Optional[str], not_applied: str, restartable: bool) -> Optional[dict]:
    """``investigation.json`` ``measured`` when the fix is not measured, saying why; None when it is to be applied
    and measured. A fix the acceptance budget withdrew (its offline proof ruled a material gain out) says so, whatever
    its kind: it is neither "nothing to fix" nor an engine change."""
    if withdrawn:
        return {"not_measured": "the proposed fix was withdrawn before any restart (its offline proof rules a material "
                                "gain out)", "withdrawn": withdrawn}
    if fix.kind == "none":
        return {"not_measured": no_fix_text(doc)}
    if not fix.applicable:
        return {"not_measured": "the fix is a change in the engine's capture path, which this tool cannot apply; apply "
                                "it and run investigate again"}
    if not apply_fix:
        return {"measured_by": measured_by} if measured_by else {"not_measured": not_applied}
    if not restartable:
        return {"not_measured": "this server cannot be restarted by the tool: pass --relaunch '<launch command>' (or "
                                "start it with `python -m helpers server start`)"}
    return None


def _stage_story(r: Run) -> None:
    """Cause, findings, verdict, measured fix and sentence agree (:func:`helpers.investigation.story.reconcile`)."""
    tell_one_story(r.doc, budget_expected=r.req.acceptance_budget)
    r.doc.hypotheses = reconcile(r.doc.hypotheses, r.doc.findings)


#: the stages of an investigation, in order
STAGES: tuple[tuple[str, Callable[[Run], None]], ...] = (
    ("attach", _stage_attach), ("requests", workload_check), ("training data", _stage_training),
    ("capture", _stage_capture), ("reference", _stage_reference),
    ("diagnosis", _stage_diagnosis), ("draft checks", _stage_draft_checks), ("hypotheses", _stage_hypotheses),
    ("proposed fix", _stage_propose), ("acceptance budget", _stage_budget),
    ("engine state", _stage_engine_state), ("workload", workload_stage), ("caveats", _stage_caveats),
    ("measure the fix", _stage_measure_fix), ("one story", _stage_story))


def investigate(url: str, *, training: Optional[str | Path], run_dir: str | Path, draft: Optional[str | Path] = None,
                target: Optional[str | Path] = None, relaunch: Optional[str] = None, api_key: Optional[str] = None,
                timeout: Optional[float] = 900.0, num_samples: int = 4, measure_prompts: int = 16,
                max_new_tokens: int = 32, concurrency: int = 4, apply_fix: bool = True,
                not_applied: str = "--no-apply: the fix was only proposed", measured_by: Optional[str] = None,
                port: int | str | None = None, acceptance_budget: bool = True,
                live_measure: bool = True, training_log: Optional[str | Path] = None,
                sweeps: str | Sequence[str] = "auto", sweep_budget: float = 120.0,
                validation: Optional[str | Path] = None, rows_word: tuple[Optional[str], Optional[str]] = (None, None),
                draft_cost: Optional[float] = None, engine_probes: str = "cheap",
                probe_sampling: Optional[dict] = None, requests: Optional[str | Path] = None,
                tokenizer: Optional[str | Path] = None, progress: Progress = _noop) -> InvestigationDoc:
    """Investigate the server at ``url`` blind (no case file, no expectation) and write ``run_dir``.

    Args:
        url: base URL of a running SGLang server with an EAGLE-3 draft and ``--enable-return-hidden-states``.
        training: the draft's training data (SpecForge folder, ...; :mod:`helpers.formats.training_data`), or None:
            the layer plan is then identified from the draft itself (:func:`.identify.identify_stage`).
        run_dir: the run folder to fill (``investigation.json``, ``dumps/``, ``acceptance/``, ``drafts/``, ``logs/``).
        draft / target: folders to use when the server's are not readable here (the server's win when both are).
        relaunch: a launch command for the server (shell words); the tool replaces its draft path / port / flags
            with the proposed fix. Without it, an embedded server of this tool is restarted from its state file.
        api_key: the server's API key (never written).
        timeout: overall budget in seconds (None: none).
        num_samples: training samples to capture and compare.
        measure_prompts / max_new_tokens / concurrency: the before / after acceptance measurement.
        apply_fix: False to only propose (no restart, no measurement).
        port: the port of the fixed server (relaunch), or a range ``"LOW-HIGH"`` to take a free one from (default: a
            free port of ``$E3F_PORT_RANGE``, else 12000-19999; :func:`helpers.server.embedded.pick_port`).
        acceptance_budget: compute the acceptance budget (:mod:`helpers.investigation.acceptance`): the draft run
            offline on training states, the served states and the live prompts' states, against the training log.
        live_measure: send the live prompts for the budget (``--no-measure`` skips them: no engine stage).
        requests / tokenizer: ``--requests`` / ``--tokenizer`` (:func:`helpers.investigation.workload.workload_stage`).
        training_log: the draft's training log (default: looked for in the draft folder).
        validation: rows of the training log's kind for the draft stage (default: the draft's validation rows found
            beside the training data or the draft, else the training data; :func:`helpers.investigation.acceptance.
            draft_rows`).
        rows_word: ``(split, text)`` the user's word on what those rows are (``--rows``), each None when not given.
        draft_cost: one draft forward's cost relative to one verify step for the settings stage (None: from the
            parameter counts, :func:`helpers.draft.budget.draft_cost`).
        sweeps: workload sweeps after the acceptance budget (:mod:`helpers.investigation.ablate`, no restart):
            ``"auto"`` runs the context and concurrency sweeps only when the budget leaves the loss unexplained (cause
            ``unknown``) and the run's time allows; a list (e.g. ``["context"]``) runs those; ``()`` none. A sweep that
            shows a CI-supported fall is a finding; when the budget's loss was unexplained it makes the cause
            ``workload`` or ``engine`` (:func:`helpers.draft.budget.join_ablation`).
        sweep_budget: seconds the sweeps may take at most (also capped by what the run has left, less 60 s).
        engine_probes: the engine-state probes to run (:data:`helpers.investigation.probes.CHOICES`): ``"cheap"``
            (default: on the live server, e.g. the prefix-cache hit), ``"all"`` (also those that restart a copy of
            the server: chunked prefill, greedy losslessness), ``"none"``; each probe not run is listed with why.
        probe_sampling: the ``sampled_verify`` probe's sampling over its default (``temperature`` 1.0, ``top_p``,
            ``top_k``; :func:`helpers.investigation.probes.sampled.probe_sampling`, checked before any work).
        not_applied: with ``apply_fix=False``, why the fix is not measured (the opening sentence says it).
        measured_by: with ``apply_fix=False``, who measures the fix instead (a replay's later step): recorded as
            ``measured = {"measured_by": ...}`` and said once, in place of a "not measured" note.
        progress: called with one line per step.

    Returns:
        :class:`helpers.records.InvestigationDoc` (also written to ``run_dir/investigation.json``).

    Raises:
        BadInput: unusable training data, draft or target folders; a ``run_dir`` that already holds an
            investigation (checked before any work: nothing is overwritten).
        ServerError: the server does not answer, or the budget ran out.
    """
    req = Request(url=url, training=training, run_dir=Path(run_dir), draft=draft, target=target, relaunch=relaunch,
                  api_key=api_key, timeout=timeout, num_samples=num_samples, measure_prompts=measure_prompts,
                  max_new_tokens=max_new_tokens, concurrency=concurrency, apply_fix=apply_fix,
                  not_applied=not_applied, measured_by=measured_by, port=port, acceptance_budget=acceptance_budget,
                  live_measure=live_measure, training_log=training_log, sweeps=sweeps, sweep_budget=sweep_budget,
                  validation=validation, rows_word=rows_word, draft_cost=draft_cost, requests=(requests, tokenizer),
                  engine_probes=check_choice(engine_probes), probe_sampling=probe_sampling)
    check_sampling(probe_sampling)          # a bad probe temperature is bad input before any work
    parse_ports(port, what="--port")        # a bad port is bad input before any work
    if (req.run_dir / "investigation.json").exists():
        raise BadInput("the run folder already holds an investigation (investigation.json); investigate into a new "
                       "run folder", path=req.run_dir)
    for sub in ("dumps", "acceptance", "drafts", "logs", "figures"):
        (req.run_dir / sub).mkdir(parents=True, exist_ok=True)
    dl = Budget(timeout)       # the one budget of the run: every request, restart and health poll below
    r = Run(req=req, doc=InvestigationDoc(url=url, run_dir=str(req.run_dir),
                                          training=str(Path(training).resolve()) if training else ""),
            dl=dl, progress=progress)
    stage_name = "attach"
    try:
        _connect(r)
        for stage_name, stage in STAGES:
            stage(r)
    except _Stopped:
        pass
    except BaseException as exc:          # a server, a budget, a full disk, a signal: the record says why
        r.doc.error = describe(exc)
        _unfinished(r.doc, stage_name)
        raise
    finally:
        if r.client is not None:
            r.client.close()
        r.doc.timings = r.timings
        r.doc.wall_s = round(dl.elapsed(), 1)
        r.doc.sentence = (f"[{PROVENANCE}] " if PROVENANCE in r.doc.training else "") + sentence(r.doc)
        write_json(req.run_dir / "investigation.json", r.doc.model_dump(mode="json"))
    return r.doc


def _unfinished(doc: InvestigationDoc, stage: str) -> None:
    """A run stopped in ``stage`` (a signal, the deadline, a server failure) never reports ``ok``: the diagnosis's
    ``ok`` says only that the wiring is right, and the stages after it (the acceptance budget, the engine-state probes)
    did not rule a loss out, so the verdict becomes ``undecided`` and a note says where it stopped. A ``mismatch`` is
    kept: its findings stand on their own evidence."""
    if doc.verdict == "ok":
        doc.verdict = "undecided"
    doc.notes.append(f"the investigation stopped in its '{stage}' stage ({doc.error}); the stages from there on did "
                     "not run, so no stage after it is ruled clear")


_ORDER = {"confirmed": 0, "inconclusive": 1, "refuted": 2}

def _measured_first(findings: list[dict]) -> list[dict]:
    """The findings with the measured tensor faults first (what the draft really receives), then the config
    findings that explain them (stable otherwise): the opening sentence names what is wrong, then why."""
    return sorted(findings, key=lambda f: 0 if f["kind"] in TENSOR_KINDS and not f["evidence"].get("static") else 1)


def contradicting_finding(check: str, findings: Sequence[Any]) -> Optional[tuple[str, str]]:
    """``(kind, detail)`` of the first finding of ``findings`` (:class:`helpers.records.Finding` or dicts) whose kind
    says what check ``check`` asks (:data:`helpers.kinds.CHECK_FINDINGS`, declared by ``Kind.checks``), or None: the
    one rule by which :func:`reconcile` withholds a refutation, and by which the postmortem says why a check's verdict
    in the blind investigation differs from the replay's (``helpers.views.postmortem.verdict_differences``)."""
    kinds: dict[str, str] = {}
    for f in findings:
        k = f.kind if hasattr(f, "kind") else f["kind"]
        kinds.setdefault(k, f.detail if hasattr(f, "detail") else f.get("detail", ""))
    hit = [k for k in CHECK_FINDINGS.get(check, ()) if k in kinds]
    return (hit[0], kinds[hit[0]]) if hit else None


def reconcile(hypotheses: Sequence[HypothesisEntry | dict], findings: Sequence[Any]) -> list[HypothesisEntry]:
    """Hypotheses that a finding of the same run contradicts (:func:`contradicting_finding`) are not reported as
    refuted: their verdict becomes ``inconclusive`` with the finding named (hypotheses:
    :class:`helpers.records.HypothesisEntry` or dicts of its fields; findings: :class:`helpers.records.Finding` or
    dicts)."""
    out = []
    for h in hypotheses:
        h = h if isinstance(h, HypothesisEntry) else HypothesisEntry.model_validate(h)
        hit = contradicting_finding(h.check, findings)
        if h.verdict == "refuted" and hit:
            h = h.model_copy(update={
                "verdict": "inconclusive",
                "short": f"contradicted by the finding {hit[0]} of this run: {hit[1]}",
                "explanation": (h.explanation or "") + f" -- but the finding {hit[0]} of the same run says "
                               f"otherwise ({hit[1]}); the two measurements disagree, so no verdict."})
        out.append(h)
    return sorted(out, key=lambda x: _ORDER.get(x.verdict, 3))


def _hypotheses(inv: Investigation, run_dir: Path) -> list[HypothesisEntry]:
    out = []
    for name in LIVE_CHECKS:
        res = run_check(name, inv)
        fig = None
        if res.figure is not None:
            path = run_dir / "figures" / f"investigate-{name}.json"
            atomic_write_text(path, res.figure.to_json())
            fig = str(path.relative_to(run_dir))
        out.append(res.entry(name, fig))
    return sorted(out, key=lambda h: _ORDER.get(h.verdict, 3))


def _apply_and_measure(r: Run, fix: ProposedFix) -> dict:
    """Start a fresh server with the fix (the engine adapter's restart), measure both servers on the same prompts,
    diagnose the fixed one."""
    att, req, dl, progress, run_dir = r.att, r.req, r.dl, r.progress, r.req.run_dir
    fixed_draft = draft_variant(att.draft_dir, fix.draft_config, run_dir / "drafts" / "proposed",
                                add_tensors=fix.add_tensors or None, drop_tensors=fix.drop_tensors or None)
    ps = load_prompts(None, n=req.measure_prompts)
    progress(f"measure before: {req.measure_prompts} prompts x {req.max_new_tokens} tokens on {att.url}")
    kw = dict(max_new_tokens=req.max_new_tokens, concurrency=req.concurrency, progress=False, seed=0)
    before = measure(r.client, ps, label="before (as served)", **kw)
    saved_before = before.save(run_dir / "acceptance" / "before")
    dl.check("before starting the fixed server")
    progress("starting the fixed server ...")
    handle = r.adapter.start_variant(att.restart, draft=fixed_draft, flags=r.adapter.fix_flags(fix),
                                     capture_dir=run_dir / "capture" / "fixed", api_key=req.api_key, port=req.port,
                                     log_path=run_dir / "logs" / "fixed-server.log", budget=dl,
                                     what="the fixed server (--relaunch)")
    try:
        fixed = r.adapter.client(handle.url, req.api_key, timeout=r.client.timeout, budget=dl)
        progress(f"fixed server up at {handle.url}; measure after")
        after = measure(fixed, ps, label="after (proposed fix)", **kw)
        saved_after = after.save(run_dir / "acceptance" / "after")
        effect = paired_effect(before.per_request, after.per_request)
        dl.check("before diagnosing the fixed server")
        diag2 = _diagnose_fixed(r, fixed, fixed_draft)
        fixed.close()
    finally:
        handle.stop()
    keep = MEASURE_KEEP
    local = is_local_url(att.url) and is_local_url(handle.url)
    return {"before": {k: before.summary.get(k) for k in keep}, "after": {k: after.summary.get(k) for k in keep},
            "effect": effect, "prompts": req.measure_prompts, "max_new_tokens": req.max_new_tokens,
            "labels": ["before (as served)", "after (proposed fix)"],
            "speed": speed_change(before.summary, after.summary, before.per_request, after.per_request, local=local),
            "saved_to": [str(saved_before.relative_to(run_dir)), str(saved_after.relative_to(run_dir))],
            "after_verdict": diag2.verdict, "after_findings": [f["kind"] for f in diag2.findings],
            "fixed_server": {"url": handle.url, "draft": str(fixed_draft), "server_args": fix.server_args,
                             "log": str(getattr(handle, "log_path", ""))}}


def _diagnose_fixed(r: Run, fixed: ServerClient, fixed_draft: Path) -> Any:
    """The fixed server's aux states diagnosed against the training data (with its own every-layer reference when it
    records one, else the first server's)."""
    run_dir = r.req.run_dir
    info = fixed.server_info()
    ranks, layers, _ = capture_hooks(info)
    inv2 = Investigation(run_dir, fixed, training=r.req.training, draft_dir=fixed_draft, target_dir=r.att.target_dir,
                         capture_dir=r.adapter.rank_capture_dir(ranks, run_dir, "fixed-server"), name="fixed",
                         num_samples=r.req.num_samples, reference=None, algorithm=info.get("speculative_algorithm"),
                         adapter=r.adapter, rules=r.adapter.rules(info.get("version")))
    ref = None
    if r.adapter.every_layer_source(fixed, layers) is not None:
        ref = r.adapter.capture_every_layer(fixed, inv2.training_samples(), run_dir / "dumps",
                                            name="fixed-reference-server", hooks_layers_dir=layers,
                                            num_layers=read_target_config(r.att.target_dir).num_hidden_layers)
    elif r.inv.reference_dump() is not None:
        ref = r.inv.reference_dump()
    inv2.reference_spec = ref
    return inv2.diagnosis(reference=ref is not None)


# ------------------------------------------------------------------------------------------------ the sentence

def _measured_text(m: Optional[dict]) -> str:
    if not m:
        return "not measured"
    if "measured_by" in m and not ("before" in m and "after" in m and "effect" in m):
        return f"measured by {m['measured_by']}"
    if "not_measured" in m:
        return f"not measured: {m['not_measured']}"
    if "error" in m:
        return f"not measured: {m['error']}"
    after_note = ("" if "after_verdict" not in m else
                  "; the fixed server's aux states equal the training data" if m.get("after_verdict") == "ok" else
                  f"; the fixed server still shows {', '.join(m.get('after_findings') or [])}")
    by = f"by {m['measured_by']}" if m.get("measured_by") else f"on {m['prompts']} prompts"
    return f"measured {by}: {measured_text(m)[0]}{after_note}"


def sentence(doc: InvestigationDoc) -> str:
    """The opening sentence: what is wrong, the evidence, the fix, its measured effect (or why not measured)."""
    if doc.error and doc.verdict in (None, "undecided"):
        return f"The investigation did not finish: {doc.error}"
    if doc.verdict is None:
        return "The investigation did not reach a verdict."
    if (doc.diagnosis or {}).get("kind") in ("mtp", EAGLE1.kind):
        return mtp_sentence(doc)
    ref, wl = (doc.reference or {}).get("how") or "none", [x for x in doc.findings if x.kind == "requests_accept_less"]
    budget_text = ((" " + doc.acceptance["sentence"]) if doc.acceptance else "") + "".join(
        f" Your requests (--requests): {x.detail}." for x in wl)
    wiring = [x for x in doc.findings if x.kind not in ACCEPTANCE_KINDS]
    if not wiring:
        chunks = (doc.diagnosis or {}).get("chunks") or []
        head = {"ok": "No wiring fault", "undecided": "No wiring fault found, but a material acceptance loss is not "
                "ruled out"}.get(doc.verdict, "No wiring fault, but acceptance is lost elsewhere")
        return (f"{head}: the {len(chunks)} aux chunks the server feeds equal the training data on the "
                f"aligned rows ({doc.samples} sample(s); reference: {ref}).{budget_text} "
                + _measured_text(doc.measured).capitalize() + ".")
    f = wiring[0]
    what = kind_words(f.kind, f.evidence)
    where = "" if f.chunk is None or f.kind in ("layer_offset", "chunk_order") else f" (chunk {f.chunk})"
    more = [k for k in dict.fromkeys(x.kind for x in wiring[1:]) if k != f.kind]
    also = f" Also found: {', '.join(more)}." if more else ""
    fix = doc.proposed_fix
    fix_text = fix.summary if fix is not None else "none"
    head = "Draft checkpoint fault" if f.kind in DRAFT_KINDS else "Wrong wiring"
    return (f"{head}: {what}{where} -- {f.detail} [evidence: {provenance(f, doc)}].{also} Proposed fix: {fix_text}. "
            + _measured_text(doc.measured).capitalize() + "." + budget_text)


def default_run_dir(out: Optional[str | Path], url: str) -> Path:
    """A new run folder ``<out or outputs>/<YYYYmmdd-HHMMSS>-investigate-<host-port>/`` (never an existing one); the
    name holds no credentials of the URL (:func:`helpers.redaction.url_label`)."""
    from ..redaction import url_label  # lazy: the one function of this module the reliability round may edit
    host = safe_name(url_label(url))
    return new_run_dir(f"investigate-{host}", out)


