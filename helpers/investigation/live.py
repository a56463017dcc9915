"""The live investigation of a server whose fault nobody wrote down (``python -m helpers investigate``).

Steps, each timed and reported as a progress line:

1. **attach** -- ``/server_info``: SGLang version, TP size, speculative algorithm and settings, the draft and target
   folders the server really runs (``speculative_draft_model_path``, ``model_path``), and the forward hooks it runs
   (this tool's capture hooks give the per-rank capture folder and the every-layer reference folder; other hooks are
   listed). A ``--draft`` that differs from the server's draft is a finding (``served_draft_differs``).
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

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import psutil

from ..acceptance.measure import measure, server_snapshot
from ..acceptance.prompts import load_prompts
from ..acceptance.stats import format_ci, paired_effect
from ..budget import Budget
from ..capture import capture_every_layer, capture_reference_hf
from ..diagnosis.detectors import finding
from ..errors import BadInput, describe
from ..formats.configs import read_config_json, read_draft_config, read_target_config
from ..formats.training_data import TrainingData
from ..kinds import ACCEPTANCE_KINDS, CHECK_FINDINGS, DRAFT_KINDS, KIND_TEXT, TENSOR_KINDS
from ..records import Finding, HypothesisEntry, InvestigationDoc, ProposedFix
from ..runfiles import atomic_write_text, new_run_dir, safe_name, write_json
from ..server.client import SGLangClient
from ..server.embedded import parse_ports
from ..server.registry import lookup
from ..server.restart import LAYERS_HOOK, relaunch_argv, start_variant
from ..draft.checks import draft_checks
from ..draft.simulate import DraftSettings
from .ablate import ablate as run_ablation, ablation_text
from .acceptance import run_budget
from ..draft.budget import join_ablation
from .catalog import LIVE_CHECKS
from .checks import run_check
from .inputs import Investigation
from .propose import draft_variant, propose_fix
from .story import no_fix_text, reconcile as tell_one_story

HOOK_FACTORY_PREFIX = "helpers.hooks:"


@dataclass
class Attachment:
    """What the server runs, read from ``/server_info`` (and the folders this machine sees).

    Attributes:
        url / version / tp / algorithm / spec: the server's URL, SGLang version, TP size, speculative algorithm and
            ``{num_steps, topk, num_draft_tokens}``.
        served_draft / served_target: the folders the server was started with (paths on the server's machine).
        draft_dir / target_dir: the folders used here, with ``draft_source`` / ``target_source`` saying which
            (``server`` or the given ``--draft`` / ``--target``).
        rank_capture_dir / layers_dir: this tool's per-rank and every-layer capture folders (from the server's
            ``forward_hooks``), None when not installed.
        other_hooks: forward hooks that are not capture hooks (``name``, ``target_modules``): anything they do to the
            residual stream is invisible to the config.
        restart: how the server can be restarted with a fix (``{"kind": "embedded", ...registry entry}`` or
            ``{"kind": "command", "argv": [...]}``), or None.
        findings: attach findings (the given draft differs from the served one).
        info: the redacted ``/server_info``.
    """

    url: str
    version: Optional[str]
    tp: int
    algorithm: Optional[str]
    spec: dict
    served_draft: Optional[str]
    served_target: Optional[str]
    draft_dir: Optional[Path]
    draft_source: str
    target_dir: Path
    target_source: str
    rank_capture_dir: Optional[Path] = None
    layers_dir: Optional[Path] = None
    other_hooks: list = field(default_factory=list)
    restart: Optional[dict] = None
    findings: list = field(default_factory=list)
    info: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"url": self.url, "version": self.version, "tp": self.tp, "algorithm": self.algorithm,
                "spec": self.spec, "served_draft": self.served_draft, "served_target": self.served_target,
                "draft_dir": None if self.draft_dir is None else str(self.draft_dir), "draft_source": self.draft_source,
                "target_dir": str(self.target_dir), "target_source": self.target_source,
                "rank_capture_dir": None if self.rank_capture_dir is None else str(self.rank_capture_dir),
                "layers_dir": None if self.layers_dir is None else str(self.layers_dir),
                "other_hooks": self.other_hooks,
                "restart": None if self.restart is None else {"kind": self.restart["kind"]},
                "findings": self.findings}


def capture_hooks(info: dict) -> tuple[Optional[Path], Optional[Path], list[dict]]:
    """``(per-rank capture folder, every-layer capture folder, other hooks)`` from ``/server_info``'s
    ``forward_hooks`` (SGLang 0.5.23 reports the ``--forward-hooks`` list there: ``sglang/srt/arg_groups/fields/
    observability.py`` ``forward_hooks``). Hook names and ``config`` values may be redacted by SGLang; the folder
    (``config.out_dir``) and the factory survive."""
    ranks = layers = None
    others = []
    for h in info.get("forward_hooks") or []:
        if not isinstance(h, dict):
            continue
        factory = str(h.get("hook_factory") or "")
        name = str(h.get("name") or "")
        out_dir = (h.get("config") or {}).get("out_dir") if isinstance(h.get("config"), dict) else None
        if factory == HOOK_FACTORY_PREFIX + "capture_factory" and out_dir:
            if name == LAYERS_HOOK:
                layers = Path(out_dir)
            else:
                ranks = Path(out_dir)
        elif factory == HOOK_FACTORY_PREFIX + "stash_factory":
            continue                                     # read-only stashes of this tool's hooks
        else:
            others.append({"name": name, "target_modules": h.get("target_modules"), "hook_factory": factory})
    return ranks, layers, others


def _same_draft(a: Path, b: Path) -> Optional[dict]:
    """None when the two draft folders hold the same config and weight files (by size and name), else what differs."""
    try:
        ca, cb = (read_config_json(p, "draft config") for p in (a, b))
    except (OSError, ValueError):
        return None
    diff = {}
    if ca != cb:
        keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        diff["config_keys"] = keys
        ea, eb = (c.get("eagle_config") or {} for c in (ca, cb))
        if ea != eb:
            diff["eagle_config"] = {"server": eb, "given": ea}
    wa = {p.name: p.stat().st_size for p in a.glob("*.safetensors")}
    wb = {p.name: p.stat().st_size for p in b.glob("*.safetensors")}
    if wa != wb:
        diff["weights"] = {"server": wb, "given": wa}
    return diff or None


def attach(client: SGLangClient, *, draft: Optional[str | Path] = None, target: Optional[str | Path] = None,
           relaunch: Optional[str] = None) -> Attachment:
    """Read what the server runs (see :class:`Attachment`).

    Raises:
        ServerError: ``/server_info`` unreachable or not JSON.
        BadInput: neither the server's target folder nor ``target`` is readable here; a given folder lacks
            config.json.
    """
    info = client.server_info()
    served_draft = info.get("speculative_draft_model_path")
    served_target = info.get("model_path") or info.get("tokenizer_path")
    findings: list[dict] = []

    def readable(p: Any) -> Optional[Path]:
        return Path(p) if p and (Path(p) / "config.json").is_file() else None

    if target is not None:
        target_dir, target_source = Path(target), "--target"
        if not (target_dir / "config.json").is_file():
            raise BadInput("no config.json in the target folder", path=target_dir)
    elif readable(served_target):
        target_dir, target_source = Path(served_target), "server (model_path)"
    else:
        raise BadInput(f"the server's target folder {served_target!r} is not readable on this machine: pass --target "
                       "DIR (a folder with the target's config.json; weights optional)", path=served_target)
    given = Path(draft) if draft is not None else None
    if given is not None and not (given / "config.json").is_file():
        raise BadInput("no config.json in the draft folder", path=given)
    server_draft = readable(served_draft)
    if server_draft is not None:
        draft_dir, draft_source = server_draft, "server (speculative_draft_model_path)"
        if given is not None and given.resolve() != server_draft.resolve():
            diff = _same_draft(given, server_draft)
            if diff is not None:
                findings.append(finding(
                    "served_draft_differs", None,
                    f"the server runs the draft in {server_draft}, which differs from --draft {given} "
                    f"({', '.join(sorted(diff))}); the investigation uses the server's",
                    served=str(server_draft), given=str(given), differences=diff,
                    source="/server_info speculative_draft_model_path"))
    elif given is not None:
        draft_dir, draft_source = given, "--draft (the server's draft folder is not readable here)"
    else:
        draft_dir, draft_source = None, "none"
    ranks, layers, others = capture_hooks(info)
    restart = None
    entry = lookup(client.url)
    if relaunch:
        restart = {"kind": "command", "argv": relaunch_argv(relaunch)}
    elif entry is not None:
        restart = {"kind": "embedded", **entry}
    spec = {"num_steps": info.get("speculative_num_steps"), "topk": info.get("speculative_eagle_topk"),
            "num_draft_tokens": info.get("speculative_num_draft_tokens")}
    return Attachment(url=client.url, version=info.get("version"), tp=int(info.get("tp_size") or 1),
                      algorithm=info.get("speculative_algorithm"), spec=spec, served_draft=served_draft,
                      served_target=served_target, draft_dir=draft_dir, draft_source=draft_source,
                      target_dir=target_dir, target_source=target_source, rank_capture_dir=ranks, layers_dir=layers,
                      other_hooks=others, restart=restart, findings=findings, info=server_snapshot(info))


def hf_reference_fits(target_dir: Path, *, share: float = 0.5) -> tuple[bool, str]:
    """Whether HF transformers can load the target here (fp32 weights within ``share`` of available memory).

    Returns ``(fits, why)``; ``why`` names the sizes (or the missing weights)."""
    files = list(target_dir.glob("*.safetensors")) + list(target_dir.glob("*.bin"))
    if not files:
        return False, f"no weights in {target_dir} (config only)"
    size = sum(f.stat().st_size for f in files)
    dtype = read_target_config(target_dir).torch_dtype or "bfloat16"
    fp32 = size * (2 if "16" in str(dtype) else 1)
    avail = psutil.virtual_memory().available
    if fp32 > share * avail:
        return False, (f"the target's weights need about {fp32 / 2**30:.1f} GiB in fp32, more than {share:.0%} of the "
                       f"{avail / 2**30:.1f} GiB available here")
    return True, f"{fp32 / 2**30:.2f} GiB in fp32"


Progress = Callable[[str], None]


def _noop(_: str) -> None:
    pass


def _sweeps(doc: InvestigationDoc, sweeps: str | Sequence[str], seconds: float, *, client: SGLangClient, run_dir: Path,
            dl: Budget, step, done, progress: Progress, **kw: Any) -> None:
    """The investigation's workload sweeps (``investigate``'s ``sweeps``), their findings and the budget's cause."""
    b = doc.acceptance or {}
    if sweeps == "auto":
        # only when the budget cannot decide: the sweeps then say which requests lose acceptance
        chosen = ["context", "concurrency"] if b.get("cause") == "undecided" and doc.acceptance else []
    else:
        chosen = list(sweeps)
    if not chosen:
        return
    left = dl.remaining()
    secs = seconds if left is None else min(seconds, left - 60)
    if secs < 20:
        doc.notes.append(f"workload sweeps ({', '.join(chosen)}) skipped: {max(0, left or 0):.0f} s left of the run")
        return
    t = step("workload sweeps")
    ab = run_ablation(client.url, run_dir=run_dir, sweeps=chosen, toggles=(), budget=Budget(secs, flag="--timeout"),
                      budget_s=secs, client=client, draft=kw["draft"], target=kw["target"],
                      training_log=kw["training_log"], api_key=kw["api_key"], num_prompts=max(2, min(kw["prompts"], 10)),
                      max_new_tokens=kw["max_new_tokens"], progress=progress)
    have = {f.kind for f in doc.findings}
    new = [f for f in ab["findings"] if f["kind"] not in have]
    doc.findings += [Finding(**f) for f in new]
    before = b.get("cause")
    doc.acceptance = join_ablation(b, ab["findings"])
    doc.notes += [f"workload sweeps: {s}" for s in ab["skipped"]]
    done("workload sweeps", t, ablation_text(ab) + (f"; the budget's cause is now {doc.acceptance['cause']}"
                                                   if doc.acceptance.get("cause") != before else ""))


def investigate(url: str, *, training: str | Path, run_dir: str | Path, draft: Optional[str | Path] = None,
                target: Optional[str | Path] = None, relaunch: Optional[str] = None, api_key: Optional[str] = None,
                timeout: Optional[float] = 900.0, num_samples: int = 4, measure_prompts: int = 16,
                max_new_tokens: int = 32, concurrency: int = 4, apply_fix: bool = True,
                not_applied: str = "--no-apply: the fix was only proposed", measured_by: Optional[str] = None,
                port: int | str | None = None, acceptance_budget: bool = True,
                live_measure: bool = True, training_log: Optional[str | Path] = None,
                sweeps: str | Sequence[str] = "auto", sweep_budget: float = 120.0,
                validation: Optional[str | Path] = None,
                rows_word: tuple[Optional[str], Optional[str]] = (None, None),
                progress: Progress = _noop) -> InvestigationDoc:
    """Investigate the server at ``url`` blind (no case file, no expectation) and write ``run_dir``.

    Args:
        url: base URL of a running SGLang server with an EAGLE-3 draft and ``--enable-return-hidden-states``.
        training: the draft's training data (SpecForge folder, ...; :mod:`helpers.formats.training_data`).
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
            offline on
            training states, the served states and the live prompts' states, against the training log and live.
        live_measure: send the live prompts for the budget (``--no-measure`` skips them: no engine stage).
        training_log: the draft's training log (default: looked for in the draft folder).
        validation: rows of the training log's kind for the draft stage (default: the draft's validation rows found
            beside the training data or the draft, else the training data; :func:`helpers.investigation.acceptance.
            draft_rows`).
        rows_word: ``(split, text)`` the user's word on what those rows are (``--rows``), each None when not given.
        sweeps: workload sweeps after the acceptance budget (:mod:`helpers.investigation.ablate`, no restart):
            ``"auto"`` runs the context and concurrency sweeps only when the budget leaves the loss unexplained (cause
            ``unknown``) and the run's time allows; a list (e.g. ``["context"]``) runs those; ``()`` none. A sweep that
            shows a CI-supported fall is a finding; when the budget's loss was unexplained it makes the cause
            ``workload`` or ``engine`` (:func:`helpers.draft.budget.join_ablation`).
        sweep_budget: seconds the sweeps may take at most (also capped by what the run has left, less 60 s).
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
    run_dir = Path(run_dir)
    parse_ports(port, what="--port")        # a bad port is bad input before any work
    if (run_dir / "investigation.json").exists():
        raise BadInput("the run folder already holds an investigation (investigation.json); investigate into a new "
                       "run folder", path=run_dir)
    for sub in ("dumps", "acceptance", "drafts", "logs", "figures"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    dl = Budget(timeout)       # the one budget of the run: every request, restart and health poll below
    timings: dict[str, float] = {}
    doc = InvestigationDoc(url=url, run_dir=str(run_dir), training=str(Path(training).resolve()))

    def step(name: str):
        dl.check(f"before the {name} step")
        progress(f"{name} ...")
        return time.monotonic()

    def done(name: str, t: float, note: str = "") -> None:
        timings[name] = round(time.monotonic() - t, 2)
        progress(f"{name}: {note} ({timings[name]:.1f} s)" if note else f"{name}: done ({timings[name]:.1f} s)")

    client = SGLangClient(url, api_key, timeout=min(600.0, timeout or 600.0), budget=dl,
                          on_wait=progress if progress is not _noop else None)
    try:
        t = step("attach")
        att = attach(client, draft=draft, target=target, relaunch=relaunch)
        doc.attach = att.to_json()
        done("attach", t, f"SGLang {att.version}, TP {att.tp}, {att.algorithm}, draft {att.draft_dir} "
                          f"[{att.draft_source}], target {att.target_dir} [{att.target_source}]")
        if att.draft_dir is None:
            raise BadInput("the server runs no draft this machine can read and no --draft was given "
                           "(speculative_draft_model_path)", path=att.served_draft, field="--draft")
        tcfg = read_target_config(att.target_dir)
        td = TrainingData(training, hidden_size=tcfg.hidden_size, max_samples=num_samples)
        if td.hidden_size is not None and td.hidden_size != tcfg.hidden_size:
            raise BadInput(f"the training data is {td.hidden_size} wide per chunk but the target's hidden size is "
                           f"{tcfg.hidden_size}", path=training)
        inv = Investigation(run_dir, client, training=training, draft_dir=att.draft_dir, target_dir=att.target_dir,
                            capture_dir=att.rank_capture_dir, name="server", num_samples=num_samples,
                            reference=None, algorithm=att.algorithm)
        samples = inv.training_samples()
        if len(samples) < num_samples:
            doc.notes.append(f"{num_samples} training samples were asked for; the training data hold {len(samples)}, "
                             "all of which were used")
            progress("note: " + doc.notes[-1])
        doc.samples = len(samples)

        t = step("capture")
        served = inv.served_dump()
        done("capture", t, f"{len(samples)} training sample(s) -> {served.relative_to(run_dir)}")

        t = step("reference")
        ref, how, missing = _reference(att, client, samples, run_dir, tcfg.num_hidden_layers)
        inv.reference_spec = ref                       # drops the reference resolved before
        doc.reference = {"how": how, "path": None if ref is None else str(ref), "missing": missing}
        done("reference", t, how if ref is not None else f"none ({missing})")

        t = step("diagnosis")
        diag = inv.diagnosis(reference=ref is not None)
        extra = list(att.findings)
        doc.findings = [Finding(**f) for f in _measured_first(diag.findings + extra)]
        doc.diagnosis = diag.to_json()
        doc.verdict = "ok" if not doc.findings else "mismatch"
        doc.seconds_to_verdict = round(dl.elapsed(), 1)
        done("diagnosis", t, f"{doc.verdict}: " + (", ".join(dict.fromkeys(f.kind for f in doc.findings))
                                                   or "no finding"))

        t = step("draft checks")
        try:
            dc = draft_checks(att.draft_dir, att.target_dir, training=Path(training),
                              sglang_version=att.version or "0.5.23")
        except BadInput as exc:
            dc = []
            doc.notes.append(f"draft checks not run: {exc}")
        have = {f.kind for f in doc.findings}
        new = [f for f in dc if f["kind"] not in have]
        extra += new
        doc.findings += [Finding(**f) for f in new]
        if new:
            doc.verdict = "mismatch"
        done("draft checks", t, ", ".join(f["kind"] for f in new) or "no finding")

        t = step("hypotheses")
        doc.hypotheses = _hypotheses(inv, run_dir)
        done("hypotheses", t, ", ".join(f"{h['check']} {h['verdict']}" for h in doc.hypotheses
                                        if h["verdict"] == "confirmed") or "none confirmed")

        t = step("proposed fix")
        draft_cfg = read_draft_config(att.draft_dir / "config.json")
        fix = propose_fix(diag, draft=draft_cfg, target=tcfg, version=att.version, algorithm=att.algorithm,
                          training_dir=td.path if td.path.is_dir() else td.path.parent, extra_findings=extra,
                          hooks=att.other_hooks)
        doc.proposed_fix = fix
        done("proposed fix", t, fix.summary)

        spec = att.spec or {}
        withdrawn: Optional[str] = None
        if acceptance_budget and all(spec.get(k) for k in ("num_steps", "topk", "num_draft_tokens")):
            t = step("acceptance budget")
            try:
                br = run_budget(client=client, info=att.info, draft_dir=att.draft_dir, target_dir=att.target_dir,
                                training=training, hidden_size=tcfg.hidden_size, num_samples=num_samples,
                                served_dump=inv.served_dump(), reference=ref, run_dir=run_dir,
                                settings=DraftSettings(int(spec["num_steps"]), int(spec["topk"]),
                                                       int(spec["num_draft_tokens"])),
                                fix=fix, findings=diag.findings + extra,
                                training_tensors=(None if diag.training_plan is None
                                                  else list(diag.training_plan.tensors)),
                                training_log=training_log, validation=validation, rows_word=rows_word,
                                prompts=measure_prompts, max_new_tokens=max_new_tokens,
                                measure=live_measure, progress=progress)
                doc.acceptance = br.budget
                if br.withdraw_fix:
                    withdrawn = br.withdraw_fix
                    doc.notes.append(br.withdraw_fix)
                    fix.applicable = False
                    fix.summary = "none proven: " + br.withdraw_fix
                rec = br.budget.get("recommended_settings")
                if br.budget["cause"] == "settings" and rec and fix.kind == "none":
                    # the settings stage's recommendation is the fix: flags a relaunch applies and measures
                    fix.server_args = {"--speculative-num-steps": rec["steps"], "--speculative-eagle-topk": rec["topk"],
                                       "--speculative-num-draft-tokens": rec["draft_tokens"]}
                    fix.kind, fix.applicable = "config", True
                    fix.parts = [f"launch with --speculative-num-steps {rec['steps']} --speculative-eagle-topk "
                                 f"{rec['topk']} --speculative-num-draft-tokens {rec['draft_tokens']}"]
                    fix.summary = fix.parts[0] + " (the acceptance budget's settings stage, simulated)"
                    fix.why.append(br.budget["losses"]["settings"]["basis"])
                    fix.addresses.append("spec_settings_low")
                done("acceptance budget", t, f"cause {br.budget['cause']}: " + ", ".join(
                    f"{s['name']} {s['accept_length']:.2f}" for s in br.budget["stages"]
                    if s.get("accept_length") is not None))
                _sweeps(doc, sweeps, sweep_budget, client=client, run_dir=run_dir, dl=dl, draft=att.draft_dir,
                        target=att.target_dir, training_log=training_log, api_key=api_key, step=step, done=done,
                        progress=progress, prompts=measure_prompts, max_new_tokens=max_new_tokens)
            except BadInput as exc:
                # the draft cannot be run on what the server feeds (an EAGLE-served draft gets H-wide states, a
                # checkpoint unlike its config): the wiring diagnosis stands, the budget says why it is missing
                doc.notes.append(f"acceptance budget not computed: {exc}")
                done("acceptance budget", t, f"not computed: {exc}")
        elif acceptance_budget:
            doc.notes.append("no acceptance budget: the server reports no speculative settings (speculative_num_steps, "
                             "speculative_eagle_topk, speculative_num_draft_tokens in /server_info)")
        if att.tp > 1 and att.rank_capture_dir is None:
            hooks = (f"; it runs {len(att.other_hooks)} forward hook(s) that are not capture hooks "
                     f"({', '.join(str(h.get('name')) for h in att.other_hooks)}), whose effect on other ranks was "
                     "not seen") if att.other_hooks else ""
            doc.notes.append(f"only TP rank 0's aux states were compared (what /generate returns) on this TP {att.tp} "
                             f"server{hooks}; to compare every rank, start the server with the per-rank capture hooks "
                             "(`python -m helpers server start --capture-ranks DIR`, env/gpu/launch_tp8.sh with "
                             "HOOKS_DIR) and investigate again")

        doc.hypotheses = reconcile(doc.hypotheses, doc.findings)
        doc.measured = not_measured(doc, fix, withdrawn=withdrawn, apply_fix=apply_fix, measured_by=measured_by,
                                    not_applied=not_applied, restartable=att.restart is not None)
        if doc.measured is None:
            t = step("relaunch")
            doc.measured = _apply_and_measure(att, client, fix, inv, run_dir, training=training, api_key=api_key,
                                              num_samples=num_samples, prompts=measure_prompts,
                                              max_new_tokens=max_new_tokens, concurrency=concurrency, dl=dl,
                                              progress=progress, port=port)
            done("relaunch", t, _measured_text(doc.measured))
        tell_one_story(doc, budget_expected=acceptance_budget)
        doc.hypotheses = reconcile(doc.hypotheses, doc.findings)
    except BaseException as exc:          # a server, a budget, a full disk, a signal: the record says why
        doc.error = describe(exc)
        raise
    finally:
        client.close()
        doc.timings = timings
        doc.wall_s = round(dl.elapsed(), 1)
        doc.sentence = sentence(doc)
        write_json(run_dir / "investigation.json", doc.model_dump(mode="json"))
    return doc


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


def _reference(att: Attachment, client: SGLangClient, samples: Sequence[Any], run_dir: Path, num_layers: int
               ) -> tuple[Optional[Path], str, Optional[str]]:
    """(reference dump, how it was made, what is missing when there is none)."""
    if att.layers_dir is not None:
        path = capture_every_layer(client, samples, att.layers_dir, run_dir / "dumps", num_layers=num_layers,
                                   name="reference-server", progress=False)
        return path, f"the server's own every-layer capture ({att.layers_dir})", None
    fits, why = hf_reference_fits(att.target_dir)
    if fits:
        path = capture_reference_hf(att.target_dir, samples, run_dir / "dumps", name="reference-hf", progress=False)
        return path, f"HF transformers on {att.target_dir} ({why})", None
    return None, "none", (f"no every-layer reference: the server has no every-layer capture hooks and HF cannot load "
                          f"the target here ({why}). Without one, which layer each chunk holds cannot be measured (a "
                          "layer offset looks like a rotated basis or a wrong layer); restart the server with "
                          "`python -m helpers server start --capture-layers DIR` (embedded) or "
                          "env/gpu/launch_tp8.sh with LAYERS_DIR (GPU) to settle it")


_ORDER = {"confirmed": 0, "inconclusive": 1, "refuted": 2}

def _measured_first(findings: list[dict]) -> list[dict]:
    """The findings with the measured tensor faults first (what the draft really receives), then the config
    findings that explain them (stable otherwise): the opening sentence names what is wrong, then why."""
    return sorted(findings, key=lambda f: 0 if f["kind"] in TENSOR_KINDS and not f["evidence"].get("static") else 1)


def reconcile(hypotheses: Sequence[HypothesisEntry | dict], findings: Sequence[Any]) -> list[HypothesisEntry]:
    """Hypotheses that a finding of the same run contradicts are not reported as refuted: their verdict becomes
    ``inconclusive`` with the finding named (hypotheses: :class:`helpers.records.HypothesisEntry` or dicts of its
    fields; findings: :class:`helpers.records.Finding` or dicts)."""
    kinds = {}
    for f in findings:
        k = f.kind if hasattr(f, "kind") else f["kind"]
        kinds.setdefault(k, f.detail if hasattr(f, "detail") else f.get("detail", ""))
    out = []
    for h in hypotheses:
        h = h if isinstance(h, HypothesisEntry) else HypothesisEntry.model_validate(h)
        hit = [k for k in CHECK_FINDINGS.get(h.check, ()) if k in kinds]
        if h.verdict == "refuted" and hit:
            h = h.model_copy(update={
                "verdict": "inconclusive",
                "short": f"contradicted by the finding {hit[0]} of this run: {kinds[hit[0]]}",
                "explanation": (h.explanation or "") + f" -- but the finding {hit[0]} of the same run says "
                               f"otherwise ({kinds[hit[0]]}); the two measurements disagree, so no verdict."})
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


def _apply_and_measure(att: Attachment, client: SGLangClient, fix: ProposedFix, inv: Investigation, run_dir: Path, *,
                       training: Any, api_key: Optional[str], num_samples: int, prompts: int, max_new_tokens: int,
                       concurrency: int, dl: Budget, progress: Progress, port: int | str | None = None) -> dict:
    """Start a fresh server with the fix, measure both servers on the same prompts, diagnose the fixed one."""
    fixed_draft = draft_variant(att.draft_dir, fix.draft_config, run_dir / "drafts" / "proposed",
                                add_tensors=fix.add_tensors or None)
    ps = load_prompts(None, n=prompts)
    progress(f"measure before: {prompts} prompts x {max_new_tokens} tokens on {att.url}")
    before = measure(client, ps, max_new_tokens=max_new_tokens, concurrency=concurrency, label="before (as served)",
                     progress=False, seed=0)
    saved_before = before.save(run_dir / "acceptance" / "before")
    dl.check("before starting the fixed server")
    progress("starting the fixed server ...")
    handle = _start_fixed(att, fix, fixed_draft, run_dir, api_key, dl, port)
    try:
        fixed = SGLangClient(handle.url, api_key, timeout=client.timeout, budget=dl)
        progress(f"fixed server up at {handle.url}; measure after")
        after = measure(fixed, ps, max_new_tokens=max_new_tokens, concurrency=concurrency, label="after (proposed fix)",
                        progress=False, seed=0)
        saved_after = after.save(run_dir / "acceptance" / "after")
        effect = paired_effect(before.per_request, after.per_request)
        dl.check("before diagnosing the fixed server")
        info = fixed.server_info()
        ranks, layers, _ = capture_hooks(info)
        inv2 = Investigation(run_dir, fixed, training=training, draft_dir=fixed_draft, target_dir=att.target_dir,
                             capture_dir=ranks, name="fixed", num_samples=num_samples, reference=None,
                             algorithm=info.get("speculative_algorithm"))
        ref = None
        if layers is not None:
            ref = capture_every_layer(fixed, inv2.training_samples(), layers, run_dir / "dumps",
                                      num_layers=read_target_config(att.target_dir).num_hidden_layers,
                                      name="fixed-reference-server", progress=False)
        elif inv.reference_dump() is not None:
            ref = inv.reference_dump()
        inv2.reference_spec = ref
        diag2 = inv2.diagnosis(reference=ref is not None)
        fixed.close()
    finally:
        handle.stop()
    keep = ("accept_length", "accept_length_lo", "accept_length_hi", "accept_rate", "accept_rate_lo",
            "accept_rate_hi", "tok_s", "n_requests", "n_failed")
    return {"before": {k: before.summary.get(k) for k in keep}, "after": {k: after.summary.get(k) for k in keep},
            "effect": effect, "prompts": prompts, "max_new_tokens": max_new_tokens,
            "saved_to": [str(saved_before.relative_to(run_dir)), str(saved_after.relative_to(run_dir))],
            "after_verdict": diag2.verdict, "after_findings": [f["kind"] for f in diag2.findings],
            "fixed_server": {"url": handle.url, "draft": str(fixed_draft), "server_args": fix.server_args,
                             "log": str(getattr(handle, "log_path", ""))}}


def _start_fixed(att: Attachment, fix: ProposedFix, draft: Path, run_dir: Path, api_key: Optional[str],
                 budget: Budget, port: int | str | None = None):
    """A fresh server like the attached one, with the fix applied, on ``port`` (a port or a range; default a free
    one); capture hooks write into this run folder. Waits for it within ``budget`` (the investigation's)."""
    return start_variant(att.restart, draft=draft, flags={k: str(v) for k, v in fix.server_args.items()},
                         capture_dir=run_dir / "capture" / "fixed", api_key=api_key, port=port,
                         log_path=run_dir / "logs" / "fixed-server.log", budget=budget,
                         what="the fixed server (--relaunch)")


# ------------------------------------------------------------------------------------------------ the sentence

def _measured_text(m: Optional[dict]) -> str:
    if not m:
        return "not measured"
    if "measured_by" in m:
        return f"measured by {m['measured_by']}"
    if "not_measured" in m:
        return f"not measured: {m['not_measured']}"
    if "error" in m:
        return f"not measured: {m['error']}"
    b, a, e = m["before"], m["after"], m["effect"]
    delta = format_ci(e, "accept_rate_delta", pct=True, signed=True, unit="") + " points"
    after_note = ("the fixed server's aux states equal the training data" if m.get("after_verdict") == "ok" else
                  f"the fixed server still shows {', '.join(m.get('after_findings') or [])}")
    return (f"measured on {m['prompts']} prompts: accept rate {b['accept_rate']:.0%} -> {a['accept_rate']:.0%} "
            f"(paired change {delta}), accept length {b['accept_length']:.2f} -> {a['accept_length']:.2f} tokens per "
            f"verify step; {after_note}")


def sentence(doc: InvestigationDoc) -> str:
    """The postmortem's opening sentence: what is wrong, the evidence, the proposed fix, its measured effect (or
    why it was not measured)."""
    if doc.error and doc.verdict is None:
        return f"The investigation did not finish: {doc.error}"
    if doc.verdict is None:
        return "The investigation did not reach a verdict."
    ref = (doc.reference or {}).get("how") or "none"
    budget_text = (" " + doc.acceptance["sentence"]) if doc.acceptance else ""
    wiring = [x for x in doc.findings if x.kind not in ACCEPTANCE_KINDS]
    if not wiring:
        chunks = (doc.diagnosis or {}).get("chunks") or []
        head = {"ok": "No wiring fault", "undecided": "No wiring fault found, but a material acceptance loss is not "
                "ruled out"}.get(doc.verdict, "No wiring fault, but acceptance is lost elsewhere")
        return (f"{head}: the {len(chunks)} aux chunks the server feeds equal the training data on the "
                f"aligned rows ({doc.samples} sample(s); reference: {ref}).{budget_text} "
                + _measured_text(doc.measured).capitalize() + ".")
    f = wiring[0]
    what = KIND_TEXT.get(f.kind, f.kind)
    where = "" if f.chunk is None or f.kind in ("layer_offset", "chunk_order") else f" (chunk {f.chunk})"
    more = [k for k in dict.fromkeys(x.kind for x in wiring[1:]) if k != f.kind]
    also = f" Also found: {', '.join(more)}." if more else ""
    fix = doc.proposed_fix
    fix_text = fix.summary if fix is not None else "none"
    head = "Draft checkpoint fault" if f.kind in DRAFT_KINDS else "Wrong wiring"
    return (f"{head}: {what}{where} -- {f.detail} [evidence: {_provenance(f)}].{also} Proposed fix: {fix_text}. "
            + _measured_text(doc.measured).capitalize() + "." + budget_text)


def _provenance(f: Finding) -> str:
    ev = f.evidence or {}
    if ev.get("static"):
        return "configs + SGLang rules"
    if "reference" in json.dumps(ev) or ev.get("identified_as"):
        return "served tensors vs training data and the every-layer reference"
    return "served tensors vs training data"


def default_run_dir(out: Optional[str | Path], url: str) -> Path:
    """A new run folder ``<out or outputs>/<YYYYmmdd-HHMMSS>-investigate-<host-port>/`` (never an existing one)."""
    host = safe_name(url.split("://", 1)[-1].replace(":", "-").strip("/"))
    return new_run_dir(f"investigate-{host}", out)


