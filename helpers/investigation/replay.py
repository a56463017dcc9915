"""Replay a case file (helpers.investigation.cases) on the embedded reference server.

For each timeline step, in order:

* **fix**: start the reference server with the fix's configuration (draft-config variant written
  to ``run_dir/drafts/<fix>/``, fault hooks, algorithm, spec, TP) plus the per-rank capture hooks
  (armed only while a hypothesis captures), measure acceptance (``helpers.acceptance.measure.measure``),
  append to ``run_dir/ledger.parquet``, and keep the server for the hypotheses that follow;
* **hypothesis**: run the named check (``helpers.investigation.checks``) on that server and its data;
  record verdict, explanation, evidence, figure, and whether it matches ``expect``;
* **sweep**: for each ``num_steps`` value, a server of the last fix's configuration with
  ``topk 1`` and ``num_draft_tokens = num_steps + 1``; measure tok/s; pick the best.

Everything is written to ``run_dir/results/replay-<case>.json`` after every step (a crashed replay
keeps the steps it finished) with figures in ``run_dir/figures/``. Servers are stopped by PID
when the next fix starts or the replay ends, whatever happens.
"""
from __future__ import annotations

import copy
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

from tqdm.auto import tqdm

from ..acceptance.fixes import Fix, LaunchSpec, ServerSpec, serve
from ..acceptance.machine import speed_change
from ..acceptance.measure import measure
from ..acceptance.prompts import load_prompts
from ..acceptance.stats import paired_effect
from ..capture import server_hook_specs
from ..errors import RunFailed
from ..formats.configs import read_target_config
from ..hooks import model_family
from ..records import REPLAY_STEP, FixStep, HypothesisStep, InvestigationStep, ReplayDoc, SweepStep
from ..runfiles import atomic_write_text, read_parquet, safe_name, write_json
from ..server.settings import SpecSettings
from .cases import Case, load_case
from .checks import run_check
from .inputs import Investigation
from .live import investigate, sentence
from .propose import draft_variant
from .story import (headline_parts as story_parts, headline_text, measured_text, named_text, naming_seconds,
                    record_measured_fix, verdict_words)


class Replay:
    """State of one replay (see module docstring). Use :func:`replay_case`."""

    def __init__(self, case: Case, run_dir: Path, *, progress: bool = True, api_key: Optional[str] = None):
        self.case = case
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.api_key = api_key
        self.target = case.resolve(case.models.target)
        self.draft = case.resolve(case.models.draft)
        self.training = case.resolve(case.models.training_data) if case.models.training_data else None
        tcfg = read_target_config(self.target)
        self.num_layers = tcfg.num_hidden_layers
        self.family = model_family(tcfg.architectures, tcfg.model_type)
        self.steps: list = []          # typed steps (helpers.records)
        self.server_cm = None   # the context manager of the running server
        self.server = None      # (client, handle)
        self.current: Optional[dict] = None  # info about the current fix
        self.baseline: Optional[dict] = None
        self.proposed = None    # the latest investigation's ProposedFix
        self.inv_doc = None     # the latest investigation (InvestigationDoc), told again once its fix is measured
        self.investigated: Optional[dict] = None  # the fix that investigation ran on: step, name, summary
        self.results_path = self.run_dir / "results" / f"replay-{safe_name(case.name)}.json"
        self.t0 = time.monotonic()
        for sub in ("results", "figures", "logs", "acceptance", "drafts", "capture", "dumps"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)

    # -- servers --------------------------------------------------------------------------------
    def _stop(self) -> None:
        if self.server_cm is not None:
            cm, self.server_cm, self.server = self.server_cm, None, None
            cm.__exit__(None, None, None)

    def _server_spec(self, fix: Fix, *, spec_override: Optional[dict] = None, capture_dir: Optional[Path] = None):

        launch = dict(tp=self.case.server.tp, extra_args=list(self.case.server.extra_args))
        if fix.launch is not None:       # a case's fix launch holds overrides of the case's server block
            launch.update(fix.launch.model_dump(include=fix.launch.model_fields_set))
        if fix.baseline:
            return ServerSpec(launch=LaunchSpec(target=str(self.target), draft=None, **launch)), None
        slug = safe_name(fix.name)
        draft = draft_variant(self.draft, fix.draft_config, self.run_dir / "drafts" / slug,
                              fix.drop_tensors, add_tensors={k: str(self.case.resolve(v)) for k, v in
                                                             fix.add_tensors.items()} or None)
        spec = self.case.server.spec.merged(fix.spec).merged(spec_override).merged({"algorithm": fix.algorithm})
        hooks = server_hook_specs(self.num_layers, faults=fix.faults, rank_capture_dir=capture_dir,
                                  layers_dir=None if capture_dir is None else capture_dir / "layers", family=self.family)
        ls = LaunchSpec(target=str(self.target), draft=str(draft), spec=spec.with_launch_defaults(),
                        forward_hooks=hooks, **launch)
        return ServerSpec(launch=ls), draft

    def _start(self, fix: Fix, *, spec_override: Optional[dict] = None, capture: bool = True,
               log_name: Optional[str] = None):

        slug = safe_name(log_name or fix.name)
        capture_dir = (self.run_dir / "capture" / slug) if capture and not fix.baseline else None
        spec, draft = self._server_spec(fix, spec_override=spec_override, capture_dir=capture_dir)
        cm = serve(spec, log_path=self.run_dir / "logs" / f"{slug}.log", api_key=self.api_key)
        client, handle = cm.__enter__()
        self.server_cm, self.server = cm, (client, handle)
        return client, handle, draft, capture_dir, spec

    def _measure(self, client, label: str, requested: Any) -> dict:

        m = self.case.measure
        prompts = load_prompts(m.prompt_source, n=m.count)
        res = measure(client, prompts, max_new_tokens=m.max_new_tokens, concurrency=m.concurrency,
                      ignore_eos=m.ignore_eos, label=label, progress=self.progress, seed=m.seed,
                      requested=requested, baseline=(self.baseline or {}).get("tok_s"))
        saved = res.record(self.run_dir, label, under="acceptance")
        return {**res.summary, "saved_to": str(saved.relative_to(self.run_dir))}

    # -- steps ----------------------------------------------------------------------------------
    def with_proposal(self, fix: Fix) -> Fix:
        """``fix`` with the latest investigation's proposed fix applied on top (``proposed: true``).

        Raises:
            RunFailed: no investigation proposed an applicable fix (an engine change cannot be replayed)."""
        p = self.proposed
        if p is None or not p.applicable:
            raise RunFailed("no applicable proposed fix to apply: " + (p.summary if p is not None else
                                                                      "the investigation did not propose one"))
        algorithm = p.server_args.get("--speculative-algorithm", fix.algorithm)
        spec = fix.spec
        if "--speculative-num-draft-tokens" in p.server_args:
            spec = (spec or SpecSettings()).merged({"num_draft_tokens": int(p.server_args["--speculative-num-draft-tokens"])})
        return fix.model_copy(update={"draft_config": _merge_config(fix.draft_config, p.draft_config),
                                      "algorithm": algorithm, "spec": spec,
                                      "add_tensors": {**fix.add_tensors, **p.add_tensors}})

    def run_fix(self, i: int, fix: Fix) -> FixStep:
        self._stop()
        self.current = None
        t = time.monotonic()
        if fix.proposed:
            fix = self.with_proposal(fix)
        rec = FixStep(index=i, name=fix.name, baseline=fix.baseline, faults=fix.faults, draft_config=fix.draft_config,
                      drop_tensors=fix.drop_tensors, algorithm=fix.algorithm, proposed=fix.proposed)
        try:
            client, handle, draft, capture_dir, spec = self._start(fix)
        except Exception as exc:  # noqa: BLE001 - a fix whose server cannot start is a result too
            spec, draft = self._server_spec(fix)
            self.current = {"fix": fix, "client": None, "draft": draft, "capture_dir": None,
                            "requested": _requested_args(spec), "summary": None, "index": i,
                            "inv": None}
            rec.server_error, rec.summary = _tail(str(exc)), None
            return rec
        startup = time.monotonic() - t
        requested = _requested_args(spec)
        summary = self._measure(client, fix.name, requested)
        if fix.baseline:
            self.baseline = summary
        self.current = {"fix": fix, "client": client, "draft": draft, "capture_dir": capture_dir,
                        "requested": requested, "summary": summary, "index": i, "inv": None}
        rec.server_startup_s, rec.summary = round(startup, 1), _slim(summary)
        rec.acceptance_dir = summary.get("saved_to") or f"acceptance/{safe_name(fix.name)}"
        if fix.proposed and self.inv_doc is not None and self.investigated is not None:
            try:
                self.tell_measured_fix(i, fix.name, summary)
            except Exception as exc:  # noqa: BLE001 - the fix's measurement stands; the record says why it is alone
                self.inv_doc.notes.append(f"this replay's measurement of the fix (step {i + 1}) could not be put "
                                          f"into the investigation: {type(exc).__name__}: {exc}")
                write_json(self.run_dir / "investigation.json", self.inv_doc.model_dump(mode="json"))
        return rec

    def pair(self, a: dict, b: dict) -> dict:
        """Two measurements of this replay (summaries with ``saved_to``) compared over the same prompts: the paired
        change of accept length / rate (:func:`helpers.acceptance.stats.paired_effect`) and whether tok/s moved
        with it (:func:`helpers.acceptance.machine.speed_change`; the replay's servers run on this machine)."""
        frames = [read_parquet(self.run_dir / s["saved_to"] / "per_request.parquet") for s in (a, b)]
        return {**paired_effect(*frames), "speed": speed_change(a, b, *frames, local=True)}

    def tell_measured_fix(self, i: int, name: str, summary: dict) -> None:
        """The fix the investigation proposed, measured at step ``i``: put the measurement (against the fix the
        investigation ran on, the same prompts) into the investigation and tell its story again
        (:func:`helpers.investigation.story.record_measured_fix`): the stage's loss is now this measured change.
        ``investigation.json`` is rewritten with it (the ladder's estimate and ``measured_by`` kept), and so is the
        replay's investigation step."""
        a = self.investigated
        pair = self.pair(a["summary"], summary)
        speed = pair.pop("speed")
        record_measured_fix(self.inv_doc, {
            "measured_by": f"this replay's step {i + 1} ('{name}') against step {a['index'] + 1} ('{a['name']}'), "
                           f"the same {pair.get('n_paired')} prompts",
            "labels": [a["name"], name], "before": _slim(a["summary"]), "after": _slim(summary), "effect": pair,
            "speed": speed,
            "prompts": pair.get("n_paired"), "saved_to": [a["summary"]["saved_to"], summary["saved_to"]]})
        self.inv_doc.sentence = sentence(self.inv_doc)
        write_json(self.run_dir / "investigation.json", self.inv_doc.model_dump(mode="json"))
        for s in self.steps:
            if s.kind == "investigate" and s.index == a.get("inv_step"):
                s.verdict, s.sentence = self.inv_doc.verdict, self.inv_doc.sentence
                s.findings = [f.model_dump(mode="json") for f in self.inv_doc.findings]

    def fix_effect(self) -> Optional[dict]:
        """Paired change (same prompts) from the first to the last measured fix
        (:func:`helpers.acceptance.stats.paired_effect`), or None with fewer than two."""

        fixes = [s for s in self.steps if s.kind == "fix" and not s.baseline and s.summary and s.acceptance_dir]
        if len(fixes) < 2:
            return None
        a, b = fixes[0], fixes[-1]
        return {"before": a.name, "after": b.name, **self.pair({**a.summary, "saved_to": a.acceptance_dir},
                                                              {**b.summary, "saved_to": b.acceptance_dir})}

    def investigation(self):

        cur = self.current
        if cur["inv"] is None:
            if self.training is None:
                raise RuntimeError("the case names no training data (models.training_data)")
            cur["inv"] = Investigation(self.run_dir, cur["client"], training=self.training,
                                       draft_dir=cur["draft"] or self.draft, target_dir=self.target,
                                       capture_dir=cur["capture_dir"], requested=cur["requested"],
                                       name=safe_name(cur["fix"].name),
                                       acceptance=cur["summary"], baseline=self.baseline,
                                       algorithm=cur["fix"].algorithm)
        return cur["inv"]

    def run_hypothesis(self, i: int, step) -> HypothesisStep:

        h = step.hypothesis
        if self.current is None or self.current["fix"].baseline:
            raise RuntimeError("a hypothesis needs a (non-baseline) fix before it")
        res = run_check(h.check, self.investigation(), label=h.label, question=h.question,
                        params=h.params)
        fig_path = None
        if res.figure is not None:
            fig_path = self.run_dir / "figures" / f"step{i + 1:02d}-{h.check}.json"
            atomic_write_text(fig_path, res.figure.to_json())
        return res.step(index=i, check=h.check, label=h.label, on_fix=self.current["fix"].name, expect=step.expect,
                        figure=None if fig_path is None else str(fig_path.relative_to(self.run_dir)))

    def _measured_by(self, i: int) -> Optional[str]:
        """Where the fix proposed by the investigation at timeline step ``i`` is measured (a later step of this
        replay), or None when the case applies none."""
        later = [s for s in self.case.timeline[i + 1:] if s.kind == "fix" and s.fix.proposed]
        if later:
            return f"this replay as its step '{later[0].fix.name}' (before and after the fix, on this page)"
        return None

    def run_investigation(self, i: int, step) -> InvestigationStep:
        """The blind investigation of the current server (no case expectation is passed to it)."""
        if self.current is None or self.current["client"] is None or self.current["fix"].baseline:
            raise RuntimeError("an investigation needs a running (non-baseline) fix before it")
        if self.training is None:
            raise RuntimeError("the case names no training data (models.training_data)")
        spec = step.investigate
        client = self.current["client"]
        doc = investigate(client.url, training=self.training, run_dir=self.run_dir, api_key=self.api_key,
                          num_samples=spec.samples, apply_fix=False, timeout=None,
                          not_applied="the case applies no proposed fix after this investigation",
                          measured_by=self._measured_by(i))
        self.proposed = doc.proposed_fix
        self.inv_doc = doc
        self.investigated = {"index": self.current["index"], "name": self.current["fix"].name,
                             "summary": self.current["summary"], "inv_step": i} if self.current.get("summary") else None
        rec = InvestigationStep(index=i, on_fix=self.current["fix"].name, verdict=doc.verdict, sentence=doc.sentence,
                                findings=[f.model_dump(mode="json") for f in doc.findings],
                                proposed_fix=None if doc.proposed_fix is None else doc.proposed_fix.model_dump(mode="json"),
                                hypotheses=doc.hypotheses, seconds_to_verdict=doc.seconds_to_verdict,
                                report="investigation.json", label=spec.label,
                                expect_finding=step.expect_finding, expect_fix=step.expect_fix)
        if step.expect_finding is not None or step.expect_fix is not None:
            rec.as_expected = investigation_as_expected(rec)
        return rec

    def run_sweep(self, i: int, sweep) -> SweepStep:
        if self.current is None:
            raise RuntimeError("a sweep needs a fix before it")
        fix = self.current["fix"]
        done = self.current.get("summary") or {}
        self._stop()
        self.current = None
        points = []
        for v in sweep.values:
            if done and done.get("num_steps") == v and done.get("topk") == 1:
                # the fix itself ran this configuration: reuse its measurement
                points.append({"num_steps": v, "reused": fix.name, **_slim(done)})
                continue
            label = f"{fix.name} | num_steps={v}"
            spec_over = {"num_steps": v, "topk": 1, "num_draft_tokens": v + 1}
            t = time.monotonic()
            client, handle, draft, _, spec = self._start(fix, spec_override=spec_over, capture=False,
                                                        log_name=f"sweep-steps{v}")
            startup = time.monotonic() - t
            summary = self._measure(client, label, _requested_args(spec))
            self._stop()
            points.append({"num_steps": v, "server_startup_s": round(startup, 1), **_slim(summary)})
        best = max(points, key=lambda p: (p.get("tok_s") or 0))
        return SweepStep(index=i, name=sweep.name, on_fix=fix.name, points=points, best_num_steps=best["num_steps"],
                         best_tok_s=best.get("tok_s"))

    def run(self) -> ReplayDoc:

        doc = ReplayDoc(case=self.case.name, title=self.case.title, story=self.case.story, tp=self.case.server.tp,
                        steps=self.steps, complete=False)
        try:
            for i, step in enumerate(tqdm(self.case.timeline, desc=f"replay {self.case.name}",
                                          unit="step", disable=not self.progress)):
                t = time.monotonic()
                try:
                    if step.kind == "fix":
                        rec = self.run_fix(i, step.fix)
                    elif step.kind == "hypothesis":
                        rec = self.run_hypothesis(i, step)
                    elif step.kind == "investigate":
                        rec = self.run_investigation(i, step)
                    else:
                        rec = self.run_sweep(i, step.sweep)
                except Exception as exc:  # noqa: BLE001 - recorded; the replay goes on when it can
                    rec = REPLAY_STEP.validate_python({"kind": step.kind, "error": f"{type(exc).__name__}: {exc}"[:4000]})
                    if step.kind == "fix":
                        self._stop()
                        self.current = None
                rec.index, rec.note, rec.wall_s = i, step.note, round(time.monotonic() - t, 1)
                self.steps.append(rec)
                doc.steps = self.steps
                doc.headline = headline(self.case, self.steps, inv=self.inv_doc)
                write_json(self.results_path, doc.model_dump(mode="json"))
            doc.complete = True
            try:
                doc.fix_effect = self.fix_effect()
            except Exception as exc:  # noqa: BLE001 - the replay's own records stand without it
                doc.fix_effect = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self._stop()
            doc.steps = self.steps
            doc.wall_s = round(time.monotonic() - self.t0, 1)
            doc.headline = headline(self.case, self.steps, doc.fix_effect, inv=self.inv_doc)
            write_json(self.results_path, doc.model_dump(mode="json"))
        return doc


def _merge_config(base: dict, over: dict) -> dict:
    """Deep merge of draft config overrides (``over`` wins; None values kept: they delete the key later)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge_config(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _subset(want: Any, got: Any) -> bool:
    """``want`` is contained in ``got`` (dict keys recursively; other values equal)."""
    if isinstance(want, dict):
        return isinstance(got, dict) and all(k in got and _subset(v, got[k]) for k, v in want.items())
    return want == got


def investigation_as_expected(rec: InvestigationStep) -> bool:
    """The investigation named the expected finding kind first and proposed a fix containing ``expect_fix``."""
    ok = True
    if rec.expect_finding is not None:
        ok &= bool(rec.findings) and rec.findings[0]["kind"] == rec.expect_finding
    if rec.expect_fix is not None:
        ok &= _subset(rec.expect_fix, rec.proposed_fix or {})
    return ok


def _tail(text: str, lines: int = 12) -> str:
    """The last lines of an error (server startup errors end with the server log tail)."""
    return "\n".join(text.strip().splitlines()[-lines:])[-3000:]


def _requested_args(spec) -> list[str]:
    """The sglang flags the launcher was asked for (for the override check)."""
    ls = spec.launch
    out = ["--tp-size", str(ls.tp)]
    if ls.spec is not None:
        out += ls.spec.args()
    return out + list(ls.extra_args)


SUMMARY_KEYS = ("accept_length", "accept_length_lo", "accept_length_hi", "accept_rate",
                "accept_rate_lo", "accept_rate_hi", "tok_s", "tok_s_lo", "tok_s_hi", "n_requests",
                "completion_tokens", "speedup", "baseline_tok_s", "num_steps", "topk",
                "num_draft_tokens", "algorithm", "machine")


def _slim(summary: dict) -> dict:
    out = {}
    for k in SUMMARY_KEYS:
        v = summary.get(k)
        if isinstance(v, float) and not math.isfinite(v):
            v = None
        out[k] = v
    return out


def headline_parts(steps: list, effect: Optional[dict] = None, inv: Any = None) -> list[dict]:
    """The replay's story in three parts, each ``{"label", "text", "source"}``: what is wrong, the fix, its measured
    effect. With an investigation step and its record ``inv`` (:class:`helpers.records.InvestigationDoc`, told again
    once its fix is measured): :func:`helpers.investigation.story.headline_parts`, named in the step's wall-clock
    time. Without one: the confirmed hypothesis, the last fix, and ``effect`` (:meth:`Replay.fix_effect`)."""
    fixes = [s for s in steps if s.kind == "fix" and not s.baseline and s.summary]
    inv_step = next((s for s in steps if s.kind == "investigate" and s.verdict), None)
    if inv_step is not None and inv is not None:
        secs, out = naming_seconds(inv, inv_step.wall_s)
        parts = story_parts(inv, named=named_text(secs, inv_step.seconds_to_verdict, step=inv_step.index + 1,
                                                  left_out=out, verdict=verdict_words(inv)))
        m = inv.measured or {}
        if not (m.get("before") and m.get("after")) and len(fixes) >= 2 and effect:
            parts[2] = _fix_effect_part(fixes, effect)
        return parts
    found = next((s for s in steps if s.kind == "hypothesis" and s.verdict == "confirmed"), None)
    if found is not None:
        what = (found.data or {}).get("short") or found.explanation.split(". ")[0].rstrip(".")
        lab = f" ({found.label})" if found.label else ""
        wrong = {"label": "What is wrong", "text": what,
                 "source": f"step {found.index + 1}{lab}: check '{found.check}' confirmed"}
    else:
        wrong = {"label": "What is wrong", "text": "no hypothesis was confirmed" if steps else "no step finished",
                 "source": ""}
    parts = [wrong]
    if len(fixes) >= 2:
        b = fixes[-1]
        parts.append({"label": "The fix", "text": b.name, "source": f"the case file's step {b.index + 1}"})
        parts.append(_fix_effect_part(fixes, effect))
    return parts


def _fix_effect_part(fixes: list, effect: Optional[dict]) -> dict:
    """The first and last fixes' change (with the paired CI of ``effect`` when the replay computed it)."""
    a, b = fixes[0], fixes[-1]
    src = f"this replay's step {b.index + 1} ('{b.name}') against step {a.index + 1} ('{a.name}')"
    if effect and effect.get("n_paired"):
        text, src = measured_text({"before": a.summary, "after": b.summary, "effect": effect, "measured_by": src})
        return {"label": "Measured effect", "text": text, "source": src}
    keys = ("accept_rate", "accept_length")
    if any(x.summary.get(k) is None for x in (a, b) for k in keys):
        return {"label": "Measured effect", "text": "not measured: a fix has no accept figures", "source": src}
    return {"label": "Measured effect", "source": src,
            "text": f"accept rate {a.summary['accept_rate']:.0%} -> {b.summary['accept_rate']:.0%}, accept length "
                    f"{a.summary['accept_length']:.2f} -> {b.summary['accept_length']:.2f}"}


def headline(case: Case, steps: list, effect: Optional[dict] = None, *, inv: Any = None) -> str:
    """One plain-text headline: :func:`headline_parts` joined (what is wrong, the fix, its measured effect, each
    with its source)."""
    parts = headline_parts(steps, effect, inv)
    return headline_text(parts) if steps else ""


def replay_case(case: Case | str | os.PathLike, run_dir: str | os.PathLike, *, progress: bool = True,
                api_key: Optional[str] = None) -> ReplayDoc:
    """Replay ``case`` (a :class:`~helpers.investigation.cases.Case` or a case-file path) into ``run_dir``.

    Returns the result document (also in ``run_dir/results/replay-<case>.json``): ``case``,
    ``title``, ``headline`` (one sentence), ``steps`` (one record per timeline step: fixes with
    their acceptance summary, hypotheses with verdict / expected verdict / explanation /
    evidence / figure path, sweeps with per-``num_steps`` tok/s), ``complete``, ``wall_s``.
    Raises CaseError for an invalid case file.
    """
    if not isinstance(case, Case):
        case = load_case(case)
    return Replay(case, Path(run_dir), progress=progress, api_key=api_key).run()
