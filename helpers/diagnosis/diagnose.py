"""Wiring diagnosis: the static check (configs x SGLang rules x training plan with provenance) + the token-aligned
numeric comparison + named findings, and the ``python -m helpers diagnose`` CLI.

CLI::

    python -m helpers diagnose --training PATH --served PATH [--served PATH ...] [--draft-config PATH]
                               [--target-config PATH] [--reference PATH] [--sglang-version V]
                               [--trained-layer-ids I I I] [--json]
    python -m helpers diagnose --draft-config D --target-config T [--training PATH] [--sglang-version V]
                               [--trained-layer-ids I I I] [--json]          # config-only: no tensors read

Several ``--served`` = one per TP rank (in rank order unless the files record their rank). ``--json`` prints
``{"verdict": "ok"|"mismatch"|"ambiguous", "findings": [...], "served_plan", "training_plan", ...}`` (with data
also ``"chunks"``, ``"tolerance"``, ``"noise"``). Exit 0 ok, 1 mismatch or ambiguous, 2 bad input (one-line
reason on stderr).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from ..errors import BadInput
from ..formats.configs import read_target_config
from ..formats.dumps import load_served, read_dump
from ..formats.training_data import TrainingData
from ..kinds import LAYOUT_KINDS, sort_findings
from ..server.settings import ServerSettings
from . import detectors as D
from .compare import compare
from .comparison import Comparison
from .conventions import CapturePlan
from .plan_rules import PlanRules
from .static import StaticReport, load_draft, resolve_training_plan, static_check


@dataclass
class Diagnosis:
    """Result of :func:`diagnose`.

    Attributes:
        findings: finding dicts (``kind``, ``chunk``, ``detail``, ``evidence``).
        chunks: one row per served chunk of the reported source (TP rank 0 / the single source):
            ``index``, ``width``, ``matched_training_chunk`` (None if no training chunk is equal per row),
            ``share_within`` (rows within tolerance against it, else against the same-index chunk),
            ``rel_diff`` / ``cosine`` (global, as SGLang's comparator) and ``row_rel_diff_p50`` / ``row_cosine_p50``,
            ``identified_as`` (reference match, or ``embedding`` from the context-free test, else None).
        served_plan / training_plan: capture plans (None when the configs were not given); the training plan
            carries its provenance.
        static: the :class:`helpers.diagnosis.static.StaticReport` (None without configs).
        comparison: the :class:`helpers.diagnosis.comparison.Comparison`.
        notes: what the data settled or could not settle (one line each).
    """

    findings: list[dict]
    chunks: list[dict]
    served_plan: Optional[CapturePlan] = None
    training_plan: Optional[CapturePlan] = None
    comparison: Optional[Comparison] = None
    static: Optional[StaticReport] = None
    notes: list[str] = field(default_factory=list)
    noise: Optional[dict] = None

    @property
    def verdict(self) -> str:
        return "ok" if not self.findings else "mismatch"

    def to_json(self) -> dict:
        """The CLI's ``--json`` document."""
        c = self.comparison
        doc = {"verdict": self.verdict, "findings": self.findings, "chunks": self.chunks,
               "served_plan": None if self.served_plan is None else self.served_plan.to_json(),
               "training_plan": None if self.training_plan is None else self.training_plan.to_json(),
               "notes": list(self.notes)}
        if c is not None:
            doc["tolerance"] = {"row_rel_diff": c.tolerance, "why": c.tolerance_why, "dtypes": c.dtypes}
            doc["noise"] = self.noise
            doc["alignment"] = {k: v for k, v in c.alignment.to_json().items() if k in (
                "samples_paired", "training_samples_seen", "rows_compared", "decode_rows_compared", "paired_by")}
        if self.static is not None:
            doc["static"] = {"verdict": self.static.verdict, "ambiguity": self.static.ambiguity,
                             "advisories": self.static.advisories, "inputs": self.static.inputs}
        return doc

    def render_text(self) -> str:
        """A human-readable report."""
        lines = [f"verdict: {self.verdict} ({len(self.findings)} finding{'s' if len(self.findings) != 1 else ''})"]
        c = self.comparison
        if c is not None:
            a = c.alignment
            lines.append(f"aligned: {a.samples_paired} sample(s), {a.rows_compared} rows "
                         f"({a.decode_rows_compared} decode rows); hidden {c.hidden_size}; served width "
                         f"{c.served_width}, training width {c.training_width}")
            lines.append(f"tolerance: {c.tolerance_why}")
            if self.noise:
                lines.append(f"measured engine noise (chunk pairs found equal): per-row rel_diff p50 "
                             f"{self.noise['row_rel_diff_p50']:.2g}, p90 {self.noise['row_rel_diff_p90']:.2g}")
        for plan in (self.served_plan, self.training_plan):
            lines += plan.describe_lines() if plan is not None else []
        if self.chunks:
            lines.append("chunks:  index  width  matched  rows within tol  row rel_diff p50  row cosine p50  "
                         "identified_as")
            for ch in self.chunks:
                rd = "-" if ch["row_rel_diff_p50"] is None else f"{ch['row_rel_diff_p50']:.2g}"
                co = "-" if ch["row_cosine_p50"] is None else f"{ch['row_cosine_p50']:.5f}"
                sw = "-" if ch["share_within"] is None else f"{ch['share_within']:.0%}"
                mt = "-" if ch["matched_training_chunk"] is None else str(ch["matched_training_chunk"])
                lines.append(f"         {ch['index']:>5}  {ch['width']:>5}  {mt:>7}  {sw:>15}  {rd:>16}  {co:>14}  "
                             f"{ch['identified_as'] or '-'}")
        for f in self.findings:
            where = "" if f["chunk"] is None else f" chunk {f['chunk']}"
            lines.append(f"[{f['kind']}]{where}: {f['detail']}")
        for n in self.notes:
            lines.append(f"note: {n}")
        if self.static is not None:
            for adv in self.static.advisories:
                lines.append(f"advisory: {adv}")
        return "\n".join(lines)


def _out_ids(tensors) -> Optional[list[int]]:
    """SpecForge output-of-layer ids of a plan made only of ``out(i)`` tensors, else None."""
    ids = []
    for t in tensors:
        if not (t.startswith("out(") and t.endswith(")") and t[4:-1].isdigit()):
            return None
        ids.append(int(t[4:-1]))
    return ids


def _inferred_training_plan(cmp, current):
    """The training plan identified in the data against the reference (provenance ``inferred``), when every
    training chunk is equal to one reference layer; else None."""

    if cmp.training_ref is None or cmp.training_ref.rows == 0:
        return None
    names = []
    for j in range(cmp.num_training_chunks):
        ident = cmp.identify(cmp.training_ref, j)
        if not ident or not ident.passed:
            return None
        names.append(ident.best)
    return CapturePlan(tensors=names, role="training", who="identified in the training data",
                       rules=["each training chunk equals this reference layer on >= 90% of the aligned rows"],
                       provenance="inferred", source="training chunks compared with the every-layer reference",
                       notes=[] if current is None else [f"the {current.provenance} plan said "
                                                         f"[{', '.join(current.tensors)}] ({current.source})"])


def diagnose(training: Optional[str | Path], served: Sequence[str | Path], *,
             draft_config: Optional[str | Path] = None, target_config: Optional[str | Path] = None,
             reference: Optional[str | Path] = None, server: Optional[dict] = None,
             sglang_version: Optional[str] = None, tolerance: Optional[float] = None,
             max_samples: Optional[int] = None, trained_layer_ids: Optional[Sequence[int]] = None,
             rules: Optional[PlanRules] = None) -> Diagnosis:
    """Diagnose the wiring between what a server feeds an EAGLE-3 draft and what it was trained on.

    Args:
        training: SpecForge / speculators / EAGLE data or a training dump (streamed).
        served: one path per TP rank (dump folder, ``/generate`` JSON, or dumper folder).
        draft_config: the draft's config.json or folder (weights are read from a folder only: see
            :func:`helpers.diagnosis.static.load_draft`).
        target_config: the target's config.json or folder.
        reference: a reference dump (``layer_plan.tensors`` naming every H-wide chunk) for the same tokens: an
            every-layer capture from the server's own hooks (``capture --every-layer``) or HF.
        server: server settings (``/server_info`` dict, or ``{"effective", "requested"}``); default: the
            ``server`` block of the first served dump's manifest.
        sglang_version: SGLang version for the capture rules; default: from the server settings / dump.
        tolerance: per-row rel_diff tolerance override (default from the dtypes).
        max_samples: stop after this many training samples.
        trained_layer_ids: the ids training used (run record, SpecForge out(i)); the most trusted source.
        rules: the serving engine's rules (:class:`helpers.diagnosis.plan_rules.PlanRules`, from the engine adapter
            of the server that was captured); None: SGLang's of ``sglang_version``.

    Returns:
        :class:`Diagnosis`.

    Raises:
        BadInput: any unusable input (the message names the file and field).
    """

    draft, weights, weights_note = load_draft(draft_config) if draft_config is not None else (None, None, None)
    target = read_target_config(target_config) if target_config is not None else None
    td = TrainingData(training, hidden_size=target.hidden_size if target else None, max_samples=max_samples)
    H = target.hidden_size if target else td.hidden_size
    sources = []
    multi = len(served) > 1
    for n, p in enumerate(served):
        srcs = load_served(p, tp_rank=n if multi else None)
        sources.extend(srcs)
    if len(sources) > 1:
        for n, s in enumerate(sources):
            if s.tp_rank is None:
                s.tp_rank = n
        ranks = [s.tp_rank for s in sources]
        if len(set(ranks)) != len(ranks):
            raise BadInput(f"several --served files claim the same TP rank(s) {ranks}", path=sources[0].path,
                           field="tp_rank")
    ref = None
    if reference is not None:
        rp = Path(reference)
        if not (rp / "manifest.json").exists():
            raise BadInput("a reference must be a dump folder whose manifest names its layers (layer_plan.tensors)",
                           path=rp)
        ref = read_dump(rp)
    if server is None:
        server = next((s.server for s in sources if s.server), None)
    settings = ServerSettings.from_dict(server, source=str(served[0]))
    version = sglang_version or settings.version or next((s.sglang_version for s in sources if s.sglang_version), None)

    report = None
    sp = tp = None
    static: list[dict] = []
    layout_static: list[dict] = []
    if draft is not None and target is not None:
        report = static_check(draft, target, weights=weights, sglang_version=version, server=settings,
                              training=td, trained_layer_ids=trained_layer_ids, rules=rules)
        if weights_note:
            report.inputs["draft weights"] = weights_note
        sp, tp = report.served_plan, report.training_plan
        for f in report.findings:
            (layout_static if f["evidence"].get("static") and f["kind"] in LAYOUT_KINDS + ("width_mismatch",)
             else static).append(f)
    elif target is not None:

        tp = resolve_training_plan(None, target, training=td, trained_layer_ids=trained_layer_ids)

    served_dtype = next((s.dtype for s in sources if s.dtype), None) or (target.torch_dtype if target else None)
    cmp = compare(td, sources, hidden_size=H, training_width=td.width, training_dtype=td.dtype,
                  served_dtype=served_dtype, reference=ref, tolerance=tolerance)
    notes: list[str] = []
    inferred = _inferred_training_plan(cmp, tp)
    if inferred is not None and (tp is None or tp.provenance not in ("manifest", "identified")):
        tp = inferred
    elif inferred is not None and tp is not None and inferred.tensors != tp.tensors:
        # the data are what the draft was trained on: their plan replaces the manifest's, and the static check is
        # run again against it (a config_ids_mismatch or layer offset read from the manifest alone would be false)
        notes.append(f"the training manifest says [{', '.join(tp.tensors)}] ({tp.source}) but the training chunks "
                     f"equal [{', '.join(inferred.tensors)}] of the reference: the manifest does not describe this "
                     "data; the data's plan is used")
        ids = _out_ids(inferred.tensors)
        if report is not None and ids is not None:
            plan = resolve_training_plan(draft, target, trained_layer_ids=ids)
            plan.provenance, plan.source, plan.who = "inferred", inferred.source, inferred.who
            plan.notes = list(inferred.notes)
            report = static_check(draft, target, weights=weights, sglang_version=version, server=settings,
                                  training=td, rules=rules, training_plan_override=plan)
            if weights_note:
                report.inputs["draft weights"] = weights_note
            sp, tp = report.served_plan, report.training_plan
            static, layout_static = [], []
            for f in report.findings:
                (layout_static if f["evidence"].get("static") and f["kind"] in LAYOUT_KINDS + ("width_mismatch",)
                 else static).append(f)
        else:
            tp = inferred
    ctx = D.Context(cmp=cmp, served_plan=sp, training_plan=tp, draft=draft, weights=weights, target=target,
                    server=settings)
    numeric = D.run_numeric(ctx)
    notes += ctx.notes
    fc_static = any(f["kind"] == "fc_bypassed" for f in static)
    findings = _merge(static, layout_static, numeric, fc_static=fc_static)
    if report is not None and report.ambiguity and not any(f["kind"] in LAYOUT_KINDS for f in findings) \
            and ctx.full_width and ctx.ns == ctx.nt and all(ctx.match.get(i) == i for i in range(ctx.ns)):
        notes.append("the data settle the draft config's ambiguity: the served chunks equal the training chunks")
    if not any(ctx.match.values()) and ctx.full_width and not findings:
        pass
    chunks = _chunk_table(ctx)
    return Diagnosis(findings=findings, chunks=chunks, served_plan=sp, training_plan=tp, comparison=cmp,
                     static=report, notes=notes, noise=ctx.noise)


def _merge(static: list[dict], layout_static: list[dict], numeric: list[dict], *, fc_static: bool) -> list[dict]:
    """Static draft-side findings are kept; static predictions about the served layout are kept only when the
    numeric comparison found the same kind (attached as ``evidence.static_prediction``), since the data
    decide. A numeric fc_bypassed replaces the static one."""
    out = list(numeric)
    for f in static:
        if f["kind"] == "fc_bypassed" and any(g["kind"] == "fc_bypassed" for g in numeric):
            for g in numeric:
                if g["kind"] == "fc_bypassed":
                    g["evidence"]["static_prediction"] = f["evidence"]
            continue
        out.append(f)
    for f in layout_static:
        draft_side = f["kind"] == "width_mismatch" and "sglang_fc_in_features" in f["evidence"]
        if draft_side:
            out.append(f)
            continue
        if fc_static:
            continue
        key = (f["kind"], f["chunk"])
        same = [g for g in numeric if (g["kind"], g["chunk"]) == key] or \
            [g for g in numeric if g["kind"] == f["kind"] and f["chunk"] is None]
        for g in same[:1]:
            g["evidence"].setdefault("static_prediction", {"detail": f["detail"], **f["evidence"]})
    return sort_findings(out)


def _chunk_table(ctx) -> list[dict]:
    c = ctx.cmp
    src = c.primary
    rows = []
    for i in range(src.num_chunks):
        matched = None
        m = None
        if src.chunk_width == c.hidden_size:
            j, best = c.best_match(src, i)
            if best.passed:
                matched, m = j, best
            elif i < c.num_training_chunks:
                m = c.metrics(src, i, i)
        else:
            u, best = c.best_match(src, i)
            if best.passed:
                matched, m = u // c.shard_factor, best
            else:
                m = best
        if m is not None and m.rows == 0:
            m = None                                  # no comparable row: nothing measured
        ident = c.identify(src.ref, i)
        ident_as = ident.best if ident and ident.passed else None
        if ident_as is None and src.stats.context_free(i, c.tolerance) and src.stats.zero[i] == 0:
            ident_as = "embedding"
        r = lambda x: None if x is None else float(f"{x:.6g}")  # noqa: E731
        rows.append({"index": i, "width": src.chunk_width, "matched_training_chunk": matched,
                     "share_within": None if m is None else r(m.share_within),
                     "row_rel_diff_p50": None if m is None else r(m.row_rel_diff.get("p50")),
                     "row_cosine_p50": None if m is None else r(m.median_cosine),
                     "rel_diff": None if m is None else r(m.rel_diff),
                     "cosine": None if m is None else r(m.cosine), "identified_as": ident_as})
    return rows
