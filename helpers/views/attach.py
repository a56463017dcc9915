"""The attach page (``01_attach``): server facts, requested vs effective speculative settings, silent overrides,
and the static wiring check of the configs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

import pandas as pd

from ..acceptance.measure import server_snapshot
from ..diagnosis.static import plans_frame_rows, static_check
from ..formats.training_data import TrainingData
from ..runfiles import loads_json, safe_name
from ..redaction import redact_url
from ..engines.detect import adapter as engine_adapter
from .common import (
    RunContext,
    as_path,
    connect,
    esc,
    findings_frame,
    note,
    read_json_or_none,
    show,
)
from .replay import as_replay

FACT_KEYS = [("engine", "engine"), ("version", "version"), ("model_path", "target"),
             ("speculative_algorithm", "algorithm"),
             ("speculative_draft_model_path", "draft"), ("speculative_num_steps", "num_steps"),
             ("speculative_eagle_topk", "topk"), ("speculative_num_draft_tokens", "num_draft_tokens"),
             ("tp_size", "TP size"), ("dp_size", "DP size"), ("dtype", "dtype"), ("device", "device"),
             ("attention_backend", "attention backend"), ("max_running_requests", "max running requests"),
             ("enable_return_hidden_states", "--enable-return-hidden-states"),
             ("enable_metrics", "--enable-metrics"), ("forward_hooks", "--forward-hooks"),
             ("disable_cuda_graph", "--disable-cuda-graph")]


def server_facts(info: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """Key facts of a (redacted) ``/server_info`` snapshot: columns ``setting``, ``value`` (values as text;
    the forward-hooks JSON is summarised to the hook names)."""
    info = info or {}
    rows = []
    for k, label in FACT_KEYS:
        if k not in info:
            continue
        v = info[k]
        if k == "forward_hooks" and v:
            try:
                hooks = loads_json(v) if isinstance(v, str) else v
                v = ", ".join(str(h.get("name")) for h in hooks)
            except (ValueError, AttributeError, TypeError):
                v = str(v)[:200]
        rows.append({"setting": label, "value": "" if v is None else str(v)})
    return pd.DataFrame(rows)


def spec_frame(spec: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """Requested vs effective speculative settings of an EffectiveSpecConfig dump."""
    if not spec:
        return pd.DataFrame()
    eff, req = spec.get("effective") or {}, spec.get("requested") or {}
    keys = [k for k in ("algorithm", "num_steps", "topk", "num_draft_tokens", "max_running_requests",
                        "adaptive", "draft_model_path") if k in eff or k in req]
    return pd.DataFrame([{"setting": k, "requested": _s(req.get(k)), "effective": _s(eff.get(k)),
                          "changed": "yes" if req.get(k) is not None and req.get(k) != eff.get(k) else ""}
                         for k in keys])


def _s(v: Any) -> str:
    return "" if v is None else str(v)


def overrides_frame(spec: Optional[Mapping[str, Any]]) -> pd.DataFrame:
    """The silent overrides the engine made (field, requested, effective, message)."""
    ovs = (spec or {}).get("overrides") or []
    return pd.DataFrame([{"field": o.get("field"), "requested": _s(o.get("requested")),
                          "effective": _s(o.get("effective")), "message": o.get("message")} for o in ovs])


def attach_records(ctx: RunContext) -> list[dict]:
    """Per fix of the replay: ``{"fix", "server" (redacted snapshot), "spec", "warnings", "draft_dir"}``
    from ``acceptance/<fix>/summary.json``; the draft folder the fix ran with (``drafts/<fix>/`` for a
    config variant, else the case's draft)."""


    out = []
    doc_replay = as_replay(ctx.replay)
    for s in (doc_replay.of_kind("fix") if doc_replay else []):
        if s.baseline:
            continue
        name = s.name or ""
        doc = read_json_or_none(ctx.run_dir / "acceptance" / safe_name(name) / "summary.json") or {}
        variant = ctx.run_dir / "drafts" / safe_name(name)
        draft = variant if (variant / "config.json").exists() else ctx.draft_dir
        out.append({"fix": name, "server": doc.get("server") or {}, "spec": doc.get("spec"),
                    "warnings": doc.get("warnings") or [], "draft_dir": draft,
                    "error": s.error or s.server_error})
    return out


def live_attach(ctx: RunContext) -> dict:
    """Probe the live server: redacted ``/server_info``, the effective spec config (with the draft config
    when ``ctx.draft_dir`` holds one), version. Returns ``{"fix": "live", "server", "spec", "warnings",
    "draft_dir"}`` like :func:`attach_records`."""

    client = connect(ctx)
    try:
        info = server_snapshot(client.server_info())
        # the draft the server loaded, when this machine sees that folder; else the notebook's draft_dir
        served = as_path(info.get("speculative_draft_model_path"))
        draft = served if served is not None and (served / "config.json").exists() else ctx.draft_dir
        draft_cfg = draft / "config.json" if draft and (draft / "config.json").exists() else None
        spec = client.effective_spec_config(draft_config=draft_cfg)
    finally:
        client.close()
    return {"fix": f"live server {redact_url_safe(ctx.server_url)}", "server": info,
            "spec": json.loads(spec.model_dump_json()),
            "warnings": [o.message for o in spec.overrides] + list(spec.notes), "draft_dir": draft}


def redact_url_safe(url: str) -> str:
    """``url`` without credentials or query (helpers.redaction.redact_url)."""

    return redact_url(url)


def static_wiring(draft_dir: Optional[Path], target_dir: Optional[Path], server: Optional[Mapping[str, Any]],
                  training: Optional[Path] = None) -> dict:
    """Static wiring check from configs only (no tensors): :func:`helpers.diagnosis.static.static_check` (the one
    implementation) on the draft the server runs with, the target, the server's version / algorithm and the
    training data's manifest.

    Returns ``{"plans": DataFrame(index, served, training, offset), "findings": [finding dicts], "verdict",
    "served_plan": dict|None, "training_plan": dict|None (with provenance), "notes": [str]}``. Missing configs give
    empty plans and a note (never raises for missing inputs).
    """

    empty = {"plans": pd.DataFrame(), "findings": [], "verdict": None, "served_plan": None, "training_plan": None}
    if not draft_dir or not (Path(draft_dir) / "config.json").exists():
        return {**empty, "notes": [f"no draft config.json at {draft_dir}"]}
    if not target_dir or not (Path(target_dir) / "config.json").exists():
        return {**empty, "notes": [f"no target config.json at {target_dir}"]}
    notes: list[str] = []
    td = None
    if training is not None and Path(training).exists():
        try:

            td = TrainingData(training, max_samples=1)
        except Exception as exc:  # noqa: BLE001 - a note, the check goes on with the draft config's claim
            notes.append(f"training data not readable ({type(exc).__name__}: {exc}); the draft config's ids are used")
    info = dict(server) if server else {}
    rules = engine_adapter(info.get("engine") or "sglang").rules(info.get("version"))   # the server's own engine
    rep = static_check(Path(draft_dir), Path(target_dir), server=info or None, training=td, rules=rules)
    sp, tp = rep.served_plan, rep.training_plan
    notes += list(sp.notes) + ([] if tp is None else list(tp.notes)) + list(rep.advisories)
    if rep.ambiguity:
        notes.append("ambiguous: " + "; ".join(f"{r['reading']} -> {r['outcome']}" for r in rep.ambiguity["readings"])
                     + ". To settle it: " + rep.ambiguity["settle"])
    return {"plans": pd.DataFrame(plans_frame_rows(rep)), "findings": rep.findings, "verdict": rep.verdict,
            "served_plan": sp.to_json(), "training_plan": None if tp is None else tp.to_json(), "notes": notes}


def show_attach(rec: Mapping[str, Any], ctx: RunContext) -> dict:
    """Display one attach record (:func:`attach_records` / :func:`live_attach`): server facts, requested vs
    effective spec settings, silent overrides, and the static wiring check. Returns its JSON summary."""
    show(f"<h3>{esc(rec.get('fix'))}</h3>")
    if rec.get("error"):
        show(f'<p style="color:#c62828">This fix did not run: {esc(rec["error"])}</p>')
    facts = server_facts(rec.get("server"))
    show(facts if len(facts) else note("No server snapshot recorded for this fix."))
    sf = spec_frame(rec.get("spec"))
    if len(sf):
        show("<b>Speculative settings: requested vs effective</b>")
        show(sf)
    ov = overrides_frame(rec.get("spec"))
    show("<b>Silent overrides</b>")
    show(ov if len(ov) else note("The engine changed none of the requested speculative settings."))
    sw = static_wiring(rec.get("draft_dir"), ctx.target_dir, rec.get("server"), ctx.training)
    show("<b>Static wiring check</b> (configs only: the layers the engine will capture for this draft vs the "
         "layers the draft was trained on)")
    show(sw["plans"] if len(sw["plans"]) else note("; ".join(sw["notes"]) or "no plans"))
    show(findings_frame(sw["findings"]) if sw["findings"] else
         note("No static finding: by the configs, the served layers equal the trained layers. A fault injected "
              "at run time (hooks, engine bugs) is only visible in the numbers: see 03_compare."))
    return {"fix": rec.get("fix"), "facts": facts.to_dict(orient="records"),
            "overrides": ov.to_dict(orient="records"),
            "static_findings": [f.get("kind") for f in sw["findings"]],
            "served_plan": (sw["served_plan"] or {}).get("tensors"),
            "training_plan": (sw["training_plan"] or {}).get("tensors")}
