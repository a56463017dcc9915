"""The proposed fix: from a diagnosis, the concrete change that makes what the server feeds the draft equal what the
draft was trained on, and how to apply it to a draft folder.

* :func:`ids_for_plan` -- the draft config ids that make SGLang's served plan equal a wanted plan, found by running the
  one served-plan implementation (:func:`helpers.diagnosis.conventions.served_plan`, SGLang's
  ``set_eagle3_layers_to_capture`` rules per version) over candidate ids, so no inverse rule is written twice.
* :func:`propose_fix` -- a :class:`helpers.records.ProposedFix`: draft config overrides, server flags, draft tensors
  to add (the d2t / t2d vocab map from the training folder), or, when the fault is in the engine's capture path
  (a per-rank partial sum, a sharded width, a rotated basis, a missing norm, a layer the rules do not explain), the
  engine change in words with ``applicable=False``. Every part says where it comes from (rule + version, data,
  training manifest).
* :func:`draft_variant` -- a copy of a draft folder with config overrides, tensors dropped or added (symlinks for
  untouched files).
"""
from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from safetensors.torch import load_file

from ..diagnosis.conventions import CapturePlan, describe
from ..diagnosis.plan_rules import PlanRules, rules_or_default
from ..formats.configs import read_config_json
from ..kinds import BY_NAME, ENGINE_FIXES, ID_KINDS, VOCAB_MAP_KINDS
from ..layers.ids import layer_index
from ..records import ProposedFix
from ..runfiles import atomic_write_text, write_safetensors

def ids_for_plan(wanted: Sequence[str], draft: Any, target: Any, version: Optional[str] = None,
                 rules: Optional[PlanRules] = None) -> tuple[Optional[list[int]], Optional[CapturePlan], str]:
    """Draft config ids under which the serving engine feeds exactly ``wanted`` (physical tensor names, concatenation
    order).

    Candidates per chunk come from the engine's rules (:meth:`helpers.diagnosis.plan_rules.PlanRules.id_candidates`:
    the SpecForge out(L) id L first, then L-1, L+1, L+2); each combination is written where the engine reads ids
    (:meth:`~helpers.diagnosis.plan_rules.PlanRules.with_ids`) and run through the engine's own served plan, and the
    first whose plan equals ``wanted`` with no problem and no fatal error wins -- so no inverse rule is written twice.

    Args:
        wanted: e.g. ``["out(1)", "out(3)", "out(4)"]``.
        draft: :class:`helpers.formats.configs.DraftConfig` (its other fields are kept).
        target: :class:`helpers.formats.configs.TargetConfig`.
        version: SGLang version string when ``rules`` is None (None: newest verified rules).
        rules: the serving engine's rules (default: SGLang's of ``version``).

    Returns:
        ``(ids, plan, why)``: ids and the served plan they give, or ``(None, None, why)`` with the reason no id list
        can (a tensor the engine cannot capture, an order it never produces).
    """
    rules = rules_or_default(rules, version)
    layers = [layer_index(t) for t in wanted]
    if any(L is None for L in layers):
        bad = [t for t, L in zip(wanted, layers) if L is None]
        return None, None, f"{rules.label}'s aux capture cannot feed {', '.join(bad)} (only the embedding and out(L))"
    if list(layers) != sorted(set(layers)):
        return None, None, (f"the wanted order [{', '.join(wanted)}] is not ascending: {rules.label} captures inside "
                            "its layer loop, so chunks always come in ascending layer order")
    n = int(target.num_hidden_layers)
    cands = [rules.id_candidates(L, n) for L in layers]
    for combo in itertools.product(*cands):
        plan = rules.served_plan(rules.with_ids(draft, combo), target, "EAGLE3")
        problems = [p for p in plan.problems if not (p["kind"] == "embedding_in_place_of_layer" and
                                                     "embedding" in wanted)]
        if list(plan.tensors) == list(wanted) and plan.fatal is None and not problems:
            return list(combo), plan, plan.source
    return None, None, f"no id list of the form L-1..L+2 gives [{', '.join(wanted)}] under {rules.who}"


def _measured(diag: Any) -> Optional[list[Optional[str]]]:
    """What each served chunk holds, identified against the every-layer reference (None per unidentified chunk);
    None without identifications at all."""
    names = [ch.get("identified_as") for ch in (diag.chunks or [])]
    return names if any(names) else None


def propose_fix(diag: Any, *, draft: Any = None, target: Any = None, version: Optional[str] = None,
                algorithm: Optional[str] = None, training_dir: Optional[str | Path] = None,
                extra_findings: Sequence[dict] = (), hooks: Sequence[dict] = (),
                rules: Optional[PlanRules] = None) -> ProposedFix:
    """The fix for the findings of ``diag`` (a :class:`helpers.diagnosis.diagnose.Diagnosis`).

    Args:
        diag: the diagnosis (findings, served / training plans with provenance, chunks identified against a
            reference when one was given).
        draft / target: :class:`helpers.formats.configs.DraftConfig` / ``TargetConfig`` (None: no config fix).
        version: the server's SGLang version (the id rules of that release).
        algorithm: the server's ``speculative_algorithm``.
        training_dir: the training data folder (its ``vocab_mapping/vocab_mapping.pt`` provides d2t / t2d).
        extra_findings: findings of the attach step (e.g. a draft folder that differs from the server's).
        hooks: forward hooks the server runs that are not capture hooks (``name``, ``target_modules``): named as the
            first suspects when the fault is in the capture path.
        rules: the serving engine's rules (:class:`helpers.diagnosis.plan_rules.PlanRules`; default SGLang's of
            ``version``): the ids and where they are written.

    Returns:
        :class:`helpers.records.ProposedFix`; ``kind`` ``none`` when no finding calls for a fix (the acceptance budget
        may still place a loss: :func:`helpers.investigation.story.no_fix_text`).
    """
    findings = list(diag.findings) + list(extra_findings)
    kinds = [f["kind"] for f in findings]
    fix = ProposedFix()
    if not findings:
        fix.kind, fix.summary = "none", ("no fix for the wiring: the served aux hidden states equal the training "
                                         "data, and the draft checks find nothing")
        return fix
    tplan, splan = diag.training_plan, diag.served_plan
    measured = _measured(diag)
    engine_parts: list[str] = []

    _fix_fc(fix, kinds, draft, algorithm)
    _fix_ids(fix, kinds, tplan, splan, measured, draft, target, rules_or_default(rules, version), engine_parts)
    _fix_vocab_map(fix, kinds, training_dir, engine_parts, rules_or_default(rules, version))
    _fix_tensors(fix, findings)
    _fix_settings(fix, findings)
    _fix_engine(fix, findings, hooks, engine_parts)
    fix.engine = list(dict.fromkeys(engine_parts))
    fix.applicable = bool(fix.draft_config or fix.server_args or fix.add_tensors or fix.drop_tensors)
    fix.kind = ("config" if fix.applicable and not fix.engine else "engine" if not fix.applicable else "mixed")
    head = "; ".join(fix.parts) if fix.parts else ""
    tail = "; ".join(fix.engine) if fix.engine else ""
    fix.summary = (head + (" -- and in the engine: " + tail if tail else "")) if head else "engine change: " + tail
    fix.addresses = list(dict.fromkeys(fix.addresses))
    fix.unaddressed = list(dict.fromkeys(fix.unaddressed))
    return fix


def _fix_fc(fix: ProposedFix, kinds: list[str], draft: Any, algorithm: Optional[str]) -> None:
    """The draft's fc bypassed: the algorithm flag, or the draft config flag."""
    if "fc_bypassed" not in kinds:
        return
    algo = (algorithm or "").upper()
    if algo in ("EAGLE", "NEXTN"):
        fix.server_args["--speculative-algorithm"] = "EAGLE3"
        fix.parts.append(f"serve with --speculative-algorithm EAGLE3 (the server runs {algo}, which feeds the "
                         "final normed hidden state and skips the draft's fc)")
        fix.why.append("sglang/srt/models/llama_eagle3.py::LlamaModel.forward applies fc only when the input "
                       "width differs from the embedding width; spec_aux_hidden_state.py captures aux states "
                       "only for EAGLE3")
        fix.addresses.append("fc_bypassed")
    elif draft is not None and draft.use_aux_hidden_state is False:
        _merge(fix.draft_config, {"eagle_config": {"use_aux_hidden_state": True}})
        fix.parts.append("set eagle_config.use_aux_hidden_state to true in the draft config")
        fix.addresses.append("fc_bypassed")


def _fix_ids(fix: ProposedFix, kinds: list[str], tplan: Any, splan: Any, measured: Any, draft: Any, target: Any,
             rules: PlanRules, engine_parts: list[str]) -> None:
    """Which tensors go in which chunk: the draft config ids the engine's rules turn into the training plan, or why
    none can (the capture path does not follow the rules)."""
    id_kinds = [k for k in kinds if k in ID_KINDS]
    if id_kinds and tplan is not None and tplan.tensors and draft is not None and target is not None:
        predicted = list(splan.tensors) if splan is not None else None
        follows_rules = measured is None or predicted is None or list(measured) == predicted
        if not follows_rules:
            shown = ", ".join(m or "?" for m in measured)
            engine_parts.append(
                f"the server feeds [{shown}] where {rules.who}'s rule for the deployed ids gives "
                f"[{', '.join(predicted)}]: something in the capture path (a patched model file, a forward hook) "
                f"changes which tensor goes in which chunk; no draft config change under {rules.label}'s rules fixes "
                "that")
            fix.why.append("data: each served chunk identified against the every-layer reference for the same tokens")
            comp = _compensating_ids(draft, measured, tplan.tensors)
            if comp is not None:
                fix.workaround = {"draft_config": rules.ids_override(draft, comp, kinds)[0],
                                  "why": "ids shifted by the measured offset of each chunk; only a stopgap while the "
                                         "capture path is wrong, and valid only if the offset does not depend on ids"}
            fix.unaddressed.extend(id_kinds)
        else:
            ids, plan, why = ids_for_plan(tplan.tensors, draft, target, rules=rules)
            want = getattr(draft, "sglang_num_aux", None)
            if ids is not None and isinstance(want, int) and len(tplan.tensors) != want:
                ids, plan, why = None, None, (
                    f"it has {len(tplan.tensors)} chunks while the draft reads {want} (its fc takes {want} x the "
                    f"hidden size: {draft.path}), so ids that feed it would not serve")
            if ids is None:
                engine_parts.append(f"the training plan [{', '.join(tplan.tensors)}] cannot be served by "
                                    f"{rules.label}: {why}")
                fix.unaddressed.extend(id_kinds)
            else:
                overrides, text = rules.ids_override(draft, ids, kinds)
                _merge(fix.draft_config, overrides)
                fix.parts.append(text)
                fix.expected_served = list(plan.tensors)
                fix.why.append(f"{why} -> [{describe(plan.tensors)}]")
                fix.why.append(f"training plan [{describe(tplan.tensors)}] ({tplan.provenance}: {tplan.source})")
                fix.addresses.extend(id_kinds)


def _fix_vocab_map(fix: ProposedFix, kinds: list[str], training_dir: Any, engine_parts: list[str],
                   rules: PlanRules) -> None:
    """The training data's d2t / t2d for a missing, trivial or different vocab map."""
    vocab_kinds = [k for k in VOCAB_MAP_KINDS if k in kinds]
    if vocab_kinds:
        vm = Path(training_dir) / "vocab_mapping" / "vocab_mapping.pt" if training_dir else None
        if vm is not None and vm.is_file():
            fix.add_tensors = {"d2t": str(vm), "t2d": str(vm)}
            fix.parts.append(f"{'add' if 'vocab_map_missing' in vocab_kinds else 'replace'} the d2t / t2d vocab map "
                             f"from {vm} {'to' if 'vocab_map_missing' in vocab_kinds else 'in'} the draft weights")
            fix.why.append(rules.d2t_rule)
            fix.addresses.extend(vocab_kinds)
        else:
            engine_parts.append("ship the d2t map with the draft (SpecForge writes it to "
                                "<output>/vocab_mapping/vocab_mapping.pt); none was found in the training folder")
            fix.unaddressed.extend(vocab_kinds)


def _fix_tensors(fix: ProposedFix, findings: list[dict]) -> None:
    """Draft tensors the engine's loader must not see (a finding's ``evidence.tensors_to_drop``, e.g. an embedding
    vLLM would keep instead of sharing the target's)."""
    for f in findings:
        drop = (f.get("evidence") or {}).get("tensors_to_drop")
        if f["kind"] in BY_NAME and BY_NAME[f["kind"]].fix == "drop_tensors" and drop:
            fix.drop_tensors += [t for t in drop if t not in fix.drop_tensors]
            fix.parts.append(f"drop {', '.join(drop)} from the draft weights")
            fix.why.append(str(f["evidence"].get("source")))
            fix.addresses.append(f["kind"])


def _fix_settings(fix: ProposedFix, findings: list[dict]) -> None:
    """Speculative settings SGLang overrides."""
    for f in findings:
        if f["kind"] == "num_draft_tokens_overridden":
            ev = f["evidence"]
            fix.server_args["--speculative-num-draft-tokens"] = ev.get("effective")
            fix.parts.append(f"request --speculative-num-draft-tokens {ev.get('effective')} (what SGLang runs with "
                             f"topk 1 anyway), or topk > 1 for {ev.get('requested')}")
            fix.why.append(str(ev.get("source")))
            fix.addresses.append("num_draft_tokens_overridden")


def _fix_engine(fix: ProposedFix, findings: list[dict], hooks: Any, engine_parts: list[str]) -> None:
    """What no config fixes: the engine change, in words, with the first suspects."""
    for f in findings:
        k = f["kind"]
        if k in fix.addresses or k in fix.unaddressed:
            continue
        if k in ENGINE_FIXES:
            where = "" if f.get("chunk") is None else f" (chunk {f['chunk']})"
            engine_parts.append(ENGINE_FIXES[k] + where)
            fix.unaddressed.append(k)
        elif k in BY_NAME and BY_NAME[k].fix in ("config_ids", "detail"):
            engine_parts.append(f"{k}: {f['detail']}")
            fix.unaddressed.append(k)
        elif k not in fix.addresses:
            fix.unaddressed.append(k)
    if engine_parts and hooks:
        names = ", ".join(f"{h.get('name')} on {', '.join(h.get('target_modules') or [])}" for h in hooks)
        engine_parts.append(f"first suspects: the server runs forward hooks that are not capture hooks ({names}; "
                            "/server_info forward_hooks)")


def _compensating_ids(draft: Any, measured: Sequence[Optional[str]], trained: Sequence[str]) -> Optional[list[int]]:
    ids = list(draft.nested_layer_ids or [])
    if len(ids) != len(measured) or len(measured) != len(trained):
        return None
    out = []
    for i, m, t in zip(ids, measured, trained):
        lm, lt = layer_index(m), layer_index(t)
        if lm is None or lt is None:
            return None
        out.append(i + (lt - lm))
    return out


def _merge(base: dict, over: dict) -> dict:
    """Deep-merge ``over`` into ``base`` in place (a None value removes the key); returns ``base``."""
    for k, v in over.items():
        if v is None:
            base[k] = None
        elif isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = copy.deepcopy(v)
    return base


def _apply_overrides(cfg: dict, over: dict) -> dict:
    out = copy.deepcopy(cfg)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _apply_overrides(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def draft_variant(draft_dir: Path, overrides: Optional[dict], out_dir: Path, drop_tensors: Optional[Sequence[str]] = None,
                  add_tensors: Optional[dict[str, str]] = None) -> Path:
    """A copy of ``draft_dir`` whose config.json is deep-merged with ``overrides`` (a key set to None is removed),
    whose weights lack ``drop_tensors`` and gain ``add_tensors`` (``{name: path of a torch file holding a dict with
    that name}``, read with ``weights_only=True``, e.g. SpecForge's ``vocab_mapping.pt``); untouched files are
    symlinked. Returns ``draft_dir`` itself when nothing changes, else ``out_dir``.

    Raises:
        ValueError: none of ``drop_tensors`` is present; an added tensor is not in its file.
    """
    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    if not overrides and not drop_tensors and not add_tensors:
        return draft_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    weight_files = sorted(draft_dir.glob("*.safetensors"))
    added: dict[str, torch.Tensor] = {}
    for name, src in (add_tensors or {}).items():
        obj = torch.load(src, map_location="cpu", weights_only=True)
        if not isinstance(obj, dict) or name not in obj:
            raise ValueError(f"{src}: no tensor {name!r} to add to the draft weights")
        added[name] = obj[name]
    for f in draft_dir.iterdir():
        if f.name == "config.json" or (out_dir / f.name).exists():
            continue
        first_weights = bool(weight_files) and f == weight_files[0]
        if f.suffix == ".safetensors" and (drop_tensors or (added and first_weights)):
            weights = load_file(str(f))
            if drop_tensors:
                missing = [k for k in drop_tensors if k not in weights]
                if len(missing) == len(drop_tensors) and len(weight_files) == 1:
                    raise ValueError(f"{f}: none of the tensors {list(drop_tensors)} to drop is present")
                weights = {k: v for k, v in weights.items() if k not in drop_tensors}
            if added and first_weights:
                weights.update({k: v.contiguous() for k, v in added.items()})
            write_safetensors(out_dir / f.name, weights)
            continue
        (out_dir / f.name).symlink_to(f.resolve())
    cfg = read_config_json(draft_dir, "draft config")
    atomic_write_text(out_dir / "config.json", json.dumps(_apply_overrides(cfg, overrides or {}), indent=2))
    return out_dir
