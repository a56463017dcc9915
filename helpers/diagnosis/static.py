"""The static wiring check: from configs alone (no tensors, no server), will SGLang feed the draft the tensors
it was trained on? One implementation, used by ``python -m helpers diagnose`` (with or without data), the
``01_attach`` notebook and the ``static_wiring`` hypothesis.

Inputs: the draft config (the one the server runs with), the target config, the SGLang version and
algorithm, optionally the draft weights (fc shape, d2t) and what is known of training. Output: a
:class:`StaticReport` with a verdict ``ok`` / ``mismatch`` / ``ambiguous``, findings (the diagnosis
vocabulary), the served plan (SGLang's rules for that version: :mod:`helpers.diagnosis.sglang_rules`) and the
training plan **with its provenance**, most trusted first:

1. ``manifest``: the ids the caller passes from the run's own record (``trained_layer_ids``: SpecForge's run
   YAML ``model.aux_hidden_state_layer_ids`` is not written into the exported draft config), or what the
   tool that wrote the training data recorded (a training dump's ``layer_plan``, the ``capture.json``
   ``layer_ids.specforge_out_i`` of this project's data);
2. ``inferred``: identified in the data against an every-layer reference (set by
   :func:`helpers.diagnosis.diagnose.diagnose`, which has the data);
3. ``claimed``: the draft config's own ids, read in the convention of the config's form (what a deployment
   may have edited after training);
4. ``default``: no ids anywhere, the trainer's default.

When the draft config's ids can mean two things under the given SGLang version (DeepSeek-family targets with
a first id other than 1: SGLang >= 0.5.13 takes them as capture indices, while SpecForge writes
output-of-layer ids) and no manifest settles it, the verdict is ``ambiguous``, with both readings and what
would settle it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import BadInput
from ..formats.configs import (
    DraftConfig,
    TargetConfig,
    read_draft_config,
    read_draft_weights,
    read_target_config,
)
from ..formats.training_data import TrainingData, recorded_layer_ids
from ..kinds import LAYOUT_KINDS, sort_findings
from ..server.settings import ServerSettings
from . import detectors as D
from ..layers.sglang import parse_version
from .conventions import (
    CapturePlan,
    compare_plans,
    describe,
    training_plan,
)
from .plan_rules import SETTLE, PlanRules

VERDICTS = ("ok", "mismatch", "ambiguous")


@dataclass
class StaticReport:
    """Result of :func:`static_check`.

    Attributes:
        verdict: ``ok`` | ``mismatch`` (a finding) | ``ambiguous`` (no finding, but the ids can mean two things).
        findings: finding dicts (``kind``, ``chunk``, ``detail``, ``evidence``); each evidence says where the
            plans came from (``served_plan_source``, ``training_plan_provenance``).
        served_plan / training_plan: :class:`helpers.diagnosis.conventions.CapturePlan` (training may be None).
        ambiguity: ``{"readings": [...], "settle": str}`` or None.
        advisories: silent behaviours worth knowing that are not faults (e.g. SGLang's fallback ids).
        inputs: what was read (config paths, weights files or why not, SGLang version and its origin).
        draft_checks: set by the config-only check (:func:`helpers.draft.config_checks.check_configs`):
            ``{"facts", "notes"}`` of the draft config checks, whose findings and notes are in ``findings`` and
            ``advisories``; None otherwise.
    """

    verdict: str
    findings: list[dict]
    served_plan: Optional[CapturePlan]
    training_plan: Optional[CapturePlan]
    ambiguity: Optional[dict] = None
    advisories: list[str] = field(default_factory=list)
    inputs: dict = field(default_factory=dict)
    draft_checks: Optional[dict] = None

    def to_json(self) -> dict:
        """``{"verdict", "findings", "served_plan", "training_plan", "ambiguity", "advisories", "inputs"}``, and
        ``"draft_checks"`` when set."""
        doc = {"verdict": self.verdict, "findings": self.findings,
               "served_plan": None if self.served_plan is None else self.served_plan.to_json(),
               "training_plan": None if self.training_plan is None else self.training_plan.to_json(),
               "ambiguity": self.ambiguity, "advisories": list(self.advisories), "inputs": self.inputs}
        if self.draft_checks is not None:
            doc["draft_checks"] = self.draft_checks
        return doc

    def render_text(self) -> str:
        """The human-readable report of the config-only check."""
        lines = [f"verdict: {self.verdict} ({len(self.findings)} finding{'s' if len(self.findings) != 1 else ''})"]
        for k, v in self.inputs.items():
            lines.append(f"{k}: {v}")
        for plan in (self.served_plan, self.training_plan):
            lines += plan.describe_lines() if plan is not None else []
        facts = (self.draft_checks or {}).get("facts") or {}
        c, r = facts.get("context_length"), facts.get("rope")
        if c is not None and "draft_field" in c:            # SGLang's facts (helpers.draft.config_checks)
            lines.append(f"context length: draft {c['draft']} ({c['draft_field']}), target {c['target']} "
                         f"({c['target_field']}); SGLang serves the draft at the target's; start-up: {c['start']}")
        elif c is not None:                                 # another engine's: the values and its rule
            lines.append(f"context length: draft {c.get('draft')}, target {c.get('target')} ({c.get('rule')})")
        if r is not None and "sglang_changes" in r:
            lines.append("rope: draft " + _rope_text(r["draft"]) + ", target " + _rope_text(r["target"])
                         + ("; SGLang builds " + _rope_text(r["sglang_builds"]) if r["sglang_changes"] else
                            "; SGLang builds the draft's own"))
        elif r is not None:
            lines.append(f"rope: draft {r.get('draft')}, target {r.get('target')} ({r.get('rule')})")
        if "speculators" in facts:
            sp = facts["speculators"]
            lines.append(f"speculators draft read as vLLM reads it: {sp.get('vllm_class')}, norm_before_residual "
                         f"{sp.get('norm_before_residual')}, draft_vocab_size {sp.get('draft_vocab_size')}"
                         + (f" (defaulted: {sp['defaulted']})" if sp.get("defaulted") else ""))
        if self.training_plan is None and self.served_plan is not None:
            lines.append("training plan: unknown (no ids anywhere and no training data given)")
        for f in self.findings:
            where = "" if f["chunk"] is None else f" chunk {f['chunk']}"
            lines.append(f"[{f['kind']}]{where}: {f['detail']}")
        if self.ambiguity:
            lines.append("ambiguous: the draft config's ids can mean two things:")
            for r in self.ambiguity["readings"]:
                lines.append(f"  - {r['reading']}: training used [{', '.join(r['training'])}] -> {r['outcome']}")
            lines.append(f"  to settle it: {self.ambiguity['settle']}")
        notes = (self.draft_checks or {}).get("notes") or []
        for a in self.advisories:
            lines.append(f"{'note' if a in notes else 'advisory'}: {a}")
        return "\n".join(lines)


def _rope_text(r: dict) -> str:
    """``theta 500000 llama3 {factor: 8.0, ...}`` for a :func:`helpers.draft.config_checks.effective_rope` dict."""
    scaling = ", ".join(f"{k}: {v}" for k, v in r.get("scaling", {}).items())
    return f"theta {r['rope_theta']:g} {r['rope_type']}" + (f" {{{scaling}}}" if scaling else "")


# ------------------------------------------------------------------------------------------ inputs

def load_draft(path: str | Path, *, read_weights: bool = True) -> tuple[DraftConfig, Any, str]:
    """(draft config, draft weights or None, a line saying which weights were read or why not).

    Weights are read only from a folder: ``path`` is a folder (its ``*.safetensors``), never the folder of a
    config file named directly (that file may be an edited copy beside other weights).

    Raises:
        BadInput: unreadable config or weights.
    """
    p = Path(path)
    draft = read_draft_config(p)
    if not read_weights:
        return draft, None, "draft weights not read"
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if not files:
            return draft, None, f"no *.safetensors in {p}: fc width and d2t not checked"
        weights = read_draft_weights(p)
        return draft, weights, f"draft weights read: {', '.join(f.name for f in files)} in {p}"
    return draft, None, (f"draft weights not read: --draft-config names the file {p.name}; pass its folder to also "
                         "check fc.weight and d2t")


def resolve_training_plan(draft: Optional[DraftConfig], target: TargetConfig, *, training: Any = None,
                          trained_layer_ids: Optional[Sequence[int]] = None,
                          trainer: Optional[str] = None) -> Optional[CapturePlan]:
    """The training plan with its provenance (module docstring), or None when nothing says what training used.

    Args:
        draft: the draft config (its ids are the ``claimed`` fallback).
        target: the target config (n).
        training: the training data folder / file, or a :class:`helpers.formats.training_data.TrainingData`.
        trained_layer_ids: ids from the run's own record, SpecForge output-of-layer convention.
        trainer: ``specforge`` | ``speculators`` | ``eagle3`` | ``eagle12`` (default: from the data layout or
            the draft config's form).

    Raises:
        BadInput: a manifest that exists but cannot be read.
    """

    td = None
    if training is not None:
        td = training if isinstance(training, TrainingData) else None
        path = Path(td.path if td is not None else training)
    else:
        path = None
    if trainer is None:
        if td is not None:
            trainer = {"speculators": "speculators", "eagle12": "eagle12"}.get(td.sample_layout, "specforge")
        elif draft is not None and draft.form == "speculators":
            trainer = "speculators"
        else:
            trainer = "specforge"
    if trained_layer_ids is not None:
        plan = training_plan(draft, target, "specforge", override_ids=[int(i) for i in trained_layer_ids])
        plan.provenance, plan.source = "manifest", (f"the run's record given by the caller (trained_layer_ids "
                                                    f"{list(trained_layer_ids)}, SpecForge out(i))")
        return plan
    if td is not None and isinstance(td.layer_plan, dict) and td.layer_plan.get("tensors"):
        if td.layer_plan.get("provenance") == "identified":      # helpers.draft.plan_id.write_plan_dump
            return CapturePlan(tensors=list(td.layer_plan["tensors"]), role="training", who="plan identification",
                               rules=[str(td.layer_plan.get("note"))], provenance="identified",
                               source=f"{td.path}/manifest.json layer_plan ({td.layer_plan.get('note')})")
        return CapturePlan(tensors=list(td.layer_plan["tensors"]), role="training", who="training dump",
                           rules=["layer_plan recorded in the training dump manifest"], provenance="manifest",
                           source=f"{td.path}/manifest.json layer_plan.tensors")
    if path is not None and path.exists() and trainer == "specforge":
        rec = recorded_layer_ids(path)
        if rec is not None:
            plan = training_plan(draft, target, "specforge", override_ids=rec[0])
            plan.provenance, plan.source = "manifest", f"{rec[1]} layer_ids.specforge_out_i {rec[0]}"
            return plan
    has_ids = draft is not None and (draft.nested_layer_ids is not None or draft.top_level_layer_ids is not None)
    if draft is None and trainer == "specforge":
        return None
    plan = training_plan(draft, target, trainer)
    if has_ids or trainer in ("eagle3", "eagle12"):
        plan.provenance = "claimed" if has_ids else "default"
        how = trainer
        if has_ids and plan.config_ids is not None and plan.config_ids.convention == "sglang_capture" \
                and trainer == "specforge":
            how = "capture boundaries in(i): the only reading that names every id"
        plan.source = (f"the draft config {draft.path} ({'nested eagle_config' if draft.nested_layer_ids is not None else 'top-level'} "
                       f"ids, read as {how})" if has_ids else f"{trainer}'s fixed capture")
    else:
        plan.provenance = "default"
        plan.source = f"no ids in the draft config nor a training manifest: {trainer}'s default assumed"
    return plan


# ------------------------------------------------------------------------------------------- check

def _plan_readings(tp: CapturePlan, sp: CapturePlan) -> Optional[dict]:
    """The training plan's own two readings (ids no SpecForge run can have used, e.g. a negative id: see
    :func:`helpers.diagnosis.conventions._specforge_tensors`) against the served plan; None when both readings
    lead to the same outcome."""
    readings = []
    for r in tp.ambiguity.get("readings", []):
        same = list(r["tensors"]) == list(sp.tensors)
        readings.append({"reading": r["reading"], "training": list(r["tensors"]),
                         "outcome": "the server feeds exactly these" if same else
                         f"the server feeds {describe(sp.tensors)}: mismatch"})
    if len(readings) < 2 or all("mismatch" in r["outcome"] for r in readings) \
            or not any("mismatch" in r["outcome"] for r in readings):
        return None
    return {"readings": readings, "settle": SETTLE}


def static_check(draft: DraftConfig | str | Path, target: TargetConfig | str | Path, *,
                 weights: Any = "auto", sglang_version: Optional[str] = None, algorithm: Optional[str] = None,
                 server: Optional[ServerSettings | dict] = None, training: Any = None,
                 trained_layer_ids: Optional[Sequence[int]] = None, rules: Optional[PlanRules] = None,
                 training_plan_override: Optional[CapturePlan] = None) -> StaticReport:
    """Run the static wiring check (module docstring).

    Args:
        draft: the draft config the server runs with (config.json, its folder, or a parsed
            :class:`~helpers.formats.configs.DraftConfig`).
        target: the target config (file, folder or :class:`~helpers.formats.configs.TargetConfig`).
        weights: ``"auto"`` (read from the draft folder when a folder is given), a
            :class:`~helpers.formats.configs.DraftWeights`, or None.
        sglang_version: the server's SGLang version (default: the server settings', else 0.5.23 assumed, noted).
        algorithm: ``--speculative-algorithm`` (default: the server settings', else EAGLE3).
        server: the server's settings (``/server_info`` dict or :class:`ServerSettings`) for the override check.
        training: training data folder / file / TrainingData (only its manifest and layout are read).
        trained_layer_ids: ids from the run's record (SpecForge out(i)); the most trusted training source.
        rules: the serving engine's rules (:class:`helpers.diagnosis.plan_rules.PlanRules`, from the engine adapter
            of the attached server); None: SGLang's of ``sglang_version`` (or the server settings' version).
        training_plan_override: the training plan to check against instead of resolving one (the plan identified
            in the training data when it contradicts the data's manifest: :func:`helpers.diagnosis.diagnose.diagnose`).

    Returns:
        :class:`StaticReport`.

    Raises:
        BadInput: unreadable configs or weights, an unknown algorithm or version string.
    """

    inputs: dict = {}
    if isinstance(draft, DraftConfig):
        d = draft
        w = None if weights == "auto" else weights
        inputs["draft"] = str(d.path)
    else:
        d, w, note = load_draft(draft, read_weights=weights == "auto")
        if weights not in ("auto", None):
            w = weights
        inputs["draft"] = str(d.path)
        inputs["draft weights"] = note
    t = target if isinstance(target, TargetConfig) else read_target_config(target)
    inputs["target"] = f"{t.path} ({', '.join(t.architectures) or t.model_type}, {t.num_hidden_layers} layers, " \
                       f"hidden {t.hidden_size})"
    odd = {k: v for k, v in (t.fields or {}).items() if v != k}
    if odd:
        inputs["target"] += " read from " + ", ".join(f"{v}" for v in odd.values())
    settings = server if isinstance(server, ServerSettings) else ServerSettings.from_dict(server, source="server")
    if sglang_version is not None and not str(sglang_version).strip():
        raise BadInput("empty SGLang version (expected X.Y.Z, e.g. 0.5.23, or leave the option out)",
                       field="--sglang-version")
    version = sglang_version or settings.version
    if version is not None:
        try:
            parse_version(version)
        except ValueError as e:
            raise BadInput(str(e), field="sglang version") from None
    rules = rules or PlanRules(version)
    whence = ("given" if sglang_version else "from the server" if settings.version
              else "the release whose rules are read")
    inputs[f"{rules.engine} version"] = (f"{rules.version} ({whence})" if rules.version
                                         else f"not given: the newest {rules.label} rules read are assumed")
    algo = (algorithm or settings.algorithm or "EAGLE3").upper()
    inputs["algorithm"] = algo
    try:
        sp = rules.served_plan(d, t, algo)
    except ValueError as e:
        raise BadInput(str(e), field="speculative algorithm") from None
    tp = training_plan_override or resolve_training_plan(d, t, training=training, trained_layer_ids=trained_layer_ids)
    findings: list[dict] = []

    findings += rules.setup_findings(d, t, sp, algo)
    if tp is not None and tp.provenance in ("manifest", "inferred") and d.nested_layer_ids is not None \
            and tp.config_ids is not None \
            and list(d.nested_layer_ids) != list(tp.config_ids.ids) and sp.tensors != tp.tensors:
        # (equal tensors under other numbers = another convention, e.g. DeepSeek capture indices: not an edit)
        findings.append(D.finding(
            "config_ids_mismatch", None,
            f"the draft config's layer ids {list(d.nested_layer_ids)} are not the ids training used "
            f"{list(tp.config_ids.ids)} ({tp.source}): the config was edited after training or belongs to another run",
            config_ids=list(d.nested_layer_ids), training_ids=list(tp.config_ids.ids), config=str(d.path),
            training_plan_source=tp.source))
    findings += D.detect_vocab_map_missing(d, w)
    findings += D.detect_num_draft_tokens_overridden(settings)
    fc = D.detect_fc_bypassed(d, settings if settings.algorithm else ServerSettings(algorithm=algo), None, w, t)
    fed_crash = next((f["evidence"]["fatal"] for f in fc if f["kind"] == "width_mismatch"), None)
    findings += fc
    fatal = sp.fatal or fed_crash
    if rules.supports_target(t) and not fc:
        layer = D.static_layer_findings(sp, tp, d, w, t)
        for f in layer:
            f["evidence"]["served_plan_source"] = sp.source
            f["evidence"]["training_plan_provenance"] = None if tp is None else tp.provenance
            f["evidence"]["training_plan_source"] = None if tp is None else tp.source
        findings += layer
    if fatal:
        # the server does not serve: nothing is fed, so no finding may describe fed chunks (layout, or the served
        # width); one finding says why it stops, with the SGLang source (fc-vs-config width findings stay)
        findings = [f for f in findings if not (f["kind"] in LAYOUT_KINDS or
                                                (f["kind"] == "width_mismatch" and "served_width" in f["evidence"]))]
        if sp.fatal and not any(f["kind"] == "unsupported_target" for f in findings):
            m = re.search(r"(sglang/srt|vllm)/\S+", sp.fatal)
            src = sp.fatal.rsplit(" -- ", 1)[1] if " -- " in sp.fatal else m.group(0) if m else sp.source
            findings.append(D.finding("server_fatal", None, f"the server will not serve this draft: {sp.fatal}",
                                      static=True, fatal=sp.fatal, served_plan=sp.tensors, rules=sp.rules,
                                      source=src, served_plan_source=sp.source))
    ambiguity = None
    if not fatal and (tp is None or tp.provenance != "manifest"):
        ambiguity = rules.readings(d, t, sp)
    if not fatal and ambiguity is None and tp is not None and tp.ambiguity:
        ambiguity = _plan_readings(tp, sp)
    if ambiguity is not None:
        # the config alone cannot tell; the layer findings derived from one reading are not facts
        findings = [f for f in findings if not (f["evidence"].get("static") and f["kind"] in LAYOUT_KINDS)]
    advisories = rules.advisories(d, t, sp, tp, findings, algo)
    if tp is not None and tp.provenance == "claimed":
        advisories.append("the training layers are what the draft config claims (no manifest): a config edited after "
                          "training cannot be told from the original; " + SETTLE)
    verdict = "mismatch" if findings else ("ambiguous" if ambiguity else "ok")
    findings = sort_findings(findings)
    return StaticReport(verdict, findings, sp, tp, ambiguity, advisories, inputs)


def plans_frame_rows(report: StaticReport) -> list[dict]:
    """Position-wise rows ``{"index", "served", "training", "offset"}`` of the two plans (for tables)."""
    if report.served_plan is None or report.training_plan is None:
        return []
    return compare_plans(report.served_plan, report.training_plan)
