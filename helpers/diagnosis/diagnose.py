"""Wiring diagnosis: static checks (configs only) + token-aligned numeric comparison + named findings, and
the ``python -m helpers diagnose`` CLI.

CLI::

    python -m helpers diagnose --training PATH --served PATH [--served PATH ...] [--draft-config PATH]
                               [--target-config PATH] [--reference PATH] [--json]

Several ``--served`` = one per TP rank (in rank order unless the files record their rank). ``--json`` prints
``{"verdict": "ok"|"mismatch", "findings": [...], "chunks": [...]}``. Exit 0 when there is no finding, 1 when
there are findings, 2 on bad input (one-line reason on stderr).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from ..errors import BadInput, one_line

LAYOUT_KINDS = ("chunk_order", "layer_offset", "wrong_layer", "embedding_in_place_of_layer", "missing_chunk",
                "extra_chunk")


@dataclass
class Diagnosis:
    """Result of :func:`diagnose`.

    Attributes:
        findings: finding dicts (``kind``, ``chunk``, ``detail``, ``evidence``).
        chunks: one row per served chunk of the reported source (TP rank 0 / the single source):
            ``index``, ``width``, ``matched_training_chunk`` (None if no training chunk passes the tolerance),
            ``rel_diff`` / ``cosine`` (against the matched chunk, else the same-index training chunk),
            ``identified_as`` (reference match, or ``embedding`` from the context-free test, else None).
        served_plan / training_plan: capture plans (None when the configs were not given).
        comparison: the :class:`helpers.diagnosis.compare.Comparison`.
    """

    findings: list[dict]
    chunks: list[dict]
    served_plan: Any = None
    training_plan: Any = None
    comparison: Any = None

    @property
    def verdict(self) -> str:
        return "ok" if not self.findings else "mismatch"

    def to_json(self) -> dict:
        """The CLI's ``--json`` document."""
        return {"verdict": self.verdict, "findings": self.findings, "chunks": self.chunks}

    def render_text(self) -> str:
        """A human-readable report."""
        lines = [f"verdict: {self.verdict} ({len(self.findings)} finding{'s' if len(self.findings) != 1 else ''})"]
        c = self.comparison
        if c is not None:
            a = c.alignment
            lines.append(f"aligned: {a['samples_paired']} sample(s), {a['rows_compared']} rows "
                         f"({a['decode_rows_compared']} decode rows); hidden {c.hidden_size}; served width "
                         f"{c.served_width}, training width {c.training_width}; rel_diff tolerance {c.tolerance:g}")
        for plan in (self.served_plan, self.training_plan):
            if plan is not None:
                ids = f"  ids {plan.engine_ids or plan.config_ids}" if (plan.engine_ids or plan.config_ids) else ""
                lines.append(f"{plan.role} plan ({plan.who}): [{', '.join(plan.tensors)}]{ids}")
                for n in plan.notes:
                    lines.append(f"  note: {n}")
                if plan.fatal:
                    lines.append(f"  FATAL: {plan.fatal}")
        if self.chunks:
            lines.append("chunks:  index  width  matched  rel_diff     cosine    identified_as")
            for ch in self.chunks:
                rd = "-" if ch["rel_diff"] is None else f"{ch['rel_diff']:.3e}"
                co = "-" if ch["cosine"] is None else f"{ch['cosine']:.5f}"
                mt = "-" if ch["matched_training_chunk"] is None else str(ch["matched_training_chunk"])
                lines.append(f"         {ch['index']:>5}  {ch['width']:>5}  {mt:>7}  {rd:>10}  {co:>9}    "
                             f"{ch['identified_as'] or '-'}")
        for f in self.findings:
            where = "" if f["chunk"] is None else f" chunk {f['chunk']}"
            lines.append(f"[{f['kind']}]{where}: {f['detail']}")
        return "\n".join(lines)


def _draft_inputs(path: Optional[str | Path]):
    from ..formats.configs import read_draft_config, read_draft_weights

    if path is None:
        return None, None
    p = Path(path)
    draft = read_draft_config(p)
    folder = p if p.is_dir() else p.parent
    weights = read_draft_weights(folder) if any(folder.glob("*.safetensors")) else None
    return draft, weights


def _training_plan_for(td, draft, target):
    from .conventions import CapturePlan, training_plan

    lp = td.layer_plan
    if isinstance(lp, dict) and lp.get("tensors"):
        return CapturePlan(tensors=list(lp["tensors"]), role="training", who="training dump layer_plan",
                           rules=["layer_plan recorded in the training dump manifest"])
    if target is None:
        return None
    trainer = {"specforge": "specforge", "speculators": "speculators", "eagle12": "eagle12"}.get(td.sample_layout)
    if trainer is None:
        return None
    if trainer == "specforge":
        from ..formats.training_data import recorded_layer_ids

        rec = recorded_layer_ids(td.path)
        if rec is not None:  # what the data was captured with beats a config edited after training
            plan = training_plan(draft, target, trainer, override_ids=rec[0])
            plan.notes.append(f"trained ids from the training data manifest {rec[1]}")
            return plan
    return training_plan(draft, target, trainer)


def diagnose(training: str | Path, served: Sequence[str | Path], *, draft_config: Optional[str | Path] = None,
             target_config: Optional[str | Path] = None, reference: Optional[str | Path] = None,
             server: Optional[dict] = None, sglang_version: Optional[str] = None,
             tolerance: Optional[float] = None, max_samples: Optional[int] = None) -> Diagnosis:
    """Diagnose the wiring between what a server feeds an EAGLE-3 draft and what it was trained on.

    Args:
        training: SpecForge / speculators / EAGLE data or a training dump (streamed).
        served: one path per TP rank (dump folder, ``/generate`` JSON, or dumper folder).
        draft_config: the draft's config.json or folder (weights are read from the same folder).
        target_config: the target's config.json or folder.
        reference: a reference dump (``layer_plan.tensors`` naming every H-wide chunk) for the same tokens.
        server: server settings (``/server_info`` dict, or ``{"effective", "requested"}``); default: the
            ``server`` block of the first served dump's manifest.
        sglang_version: SGLang version for the capture rules; default: from the server settings / dump.
        tolerance: rel_diff tolerance override (default from the dtypes).
        max_samples: stop after this many training samples.

    Returns:
        :class:`Diagnosis`.

    Raises:
        BadInput: any unusable input (the message names the file and field).
    """
    from . import detectors as D
    from .compare import compare
    from ..formats.configs import ServerSettings, read_target_config
    from .conventions import served_plan as make_served_plan
    from ..formats.dumps import load_served, read_dump
    from ..formats.training_data import TrainingData

    draft, weights = _draft_inputs(draft_config)
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

    sp = tp = None
    if draft is not None and target is not None:
        try:
            sp = make_served_plan(draft, target, "sglang", version, settings.algorithm or "EAGLE3")
        except ValueError as e:
            raise BadInput(str(e), field="server speculative_algorithm") from None
    tp = _training_plan_for(td, draft, target)

    static: list[dict] = []
    static += D.detect_config_ids_ignored(draft, target, sp)
    static += D.detect_vocab_map_missing(draft, weights)
    static += D.detect_num_draft_tokens_overridden(settings)
    static_fc = D.detect_fc_bypassed(draft, settings, None, weights)
    static += static_fc
    layout_static = D.static_layer_findings(sp, tp, draft, weights, target) if sp is not None else []

    served_dtype = next((s.dtype for s in sources if s.dtype), None) or (target.torch_dtype if target else None)
    cmp = compare(td, sources, hidden_size=H, training_width=td.width, training_dtype=td.dtype,
                  served_dtype=served_dtype, reference=ref, tolerance=tolerance)
    ctx = D.Context(cmp=cmp, served_plan=sp, training_plan=tp, draft=draft, weights=weights, target=target,
                    server=settings)
    numeric = D.run_numeric(ctx)

    findings = _merge(static, layout_static, numeric, fc_static=bool(static_fc))
    chunks = _chunk_table(ctx)
    return Diagnosis(findings=findings, chunks=chunks, served_plan=sp, training_plan=tp, comparison=cmp)


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
    order = {k: n for n, k in enumerate(("config_ids_ignored", "fc_bypassed", "num_draft_tokens_overridden",
                                         "vocab_map_missing", "token_mismatch", "nan_or_inf", "width_mismatch",
                                         "tp_sharded_width", "tp_partial_sum", "embedding_not_all_reduced",
                                         "layer_offset", "embedding_in_place_of_layer", "chunk_order",
                                         "rotated_basis", "norm_mismatch", "wrong_layer", "extra_chunk",
                                         "missing_chunk"))}
    return sorted(out, key=lambda f: (order.get(f["kind"], 99), -1 if f["chunk"] is None else f["chunk"]))


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
        ident = c.identify(src.ref, i)
        ident_as = ident["best"] if ident and ident["passed"] else None
        if ident_as is None and src.stats.context_free(i, c.tolerance) and src.stats.zero[i] == 0:
            ident_as = "embedding"
        rows.append({"index": i, "width": src.chunk_width, "matched_training_chunk": matched,
                     "rel_diff": None if m is None else float(f"{m.rel_diff:.6g}"),
                     "cosine": None if m is None else float(f"{m.cosine:.6g}"), "identified_as": ident_as})
    return rows


# -------------------------------------------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2
        raise BadInput(f"usage: {message}")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m helpers diagnose",
                description="Compare the aux hidden states a server feeds an EAGLE-3 draft with its training data "
                            "and name the wiring faults.")
    p.add_argument("--training", required=True, help="training data: SpecForge data_*.ckpt[.gz] folder, speculators "
                   "hs_*.safetensors folder, EAGLE data_*.ckpt, or a training dump folder")
    p.add_argument("--served", required=True, action="append", help="served aux hidden states: dump folder, SGLang "
                   "/generate response JSON (or a JSON list of them), or SGLang dumper folder; repeat once per TP rank")
    p.add_argument("--draft-config", help="draft config.json (or its folder, whose safetensors are read too)")
    p.add_argument("--target-config", help="target config.json (or its folder)")
    p.add_argument("--reference", help="reference dump with all layers' hidden states for the same tokens")
    p.add_argument("--json", action="store_true", help="print the JSON document instead of the text report")
    return p


def cli_main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m helpers diagnose ...``: exit 0 ok, 1 findings, 2 bad input (one-line reason on stderr)."""
    try:
        args = build_parser().parse_args(list(argv) if argv is not None else None)
        diag = diagnose(args.training, args.served, draft_config=args.draft_config,
                        target_config=args.target_config, reference=args.reference)
    except BadInput as e:
        print(f"diagnose: bad input: {one_line(e)}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    except Exception as e:  # never a bare traceback
        if os.environ.get("E3F_DEBUG"):
            raise
        print(f"diagnose: error: {type(e).__name__}: {one_line(e)} (set E3F_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(diag.to_json(), indent=1))
    else:
        print(diag.render_text())
    return 0 if diag.verdict == "ok" else 1
