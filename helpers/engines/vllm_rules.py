"""vLLM 0.32.0's rules behind the engine seam, as objects the engine-neutral code calls: :class:`VLLMRules` (which
tensor lands in which aux chunk, where a fix writes the layer ids), :class:`VLLMLoaderRules` (what the loader makes
of a draft checkpoint: embedding / lm_head sharing, d2t, the draft's rope and max length) and :data:`TOGGLES` (the
engine features an ablation turns off). The rules themselves are :mod:`helpers.layers.vllm` (each with its vLLM
file::function); ``env/vllm/README.md`` has the notes.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import torch
from safetensors import safe_open

from ..acceptance.ablations import Toggle
from ..diagnosis.conventions import CapturePlan
from ..diagnosis.detectors import finding
from ..diagnosis.plan_rules import PlanRules
from ..draft.checks import LoaderRules
from ..draft.loader_table import VLLMLoaderTable
from ..draft.config_checks import ConfigChecks
from ..draft.mtp_checks import MTPRules, MTPSpec, own_served
from ..layers.mtp import VLLM_NO_HEAD_RULE, MTPHead
from .vllm_mtp import cpu_refusal, fed_state
from ..formats import speculators
from ..layers import vllm as rules
from ..layers.ids import LayerIds
from . import vllm_server


def draft_view(draft: Any) -> dict:
    """The draft config as vLLM reads it (``transformers_utils/configs/eagle.py::EAGLEConfig`` copies every key of
    ``config.json``), with the layer-id fields of a :class:`helpers.formats.configs.DraftConfig` as the truth (a copy
    made by :meth:`VLLMRules.with_ids` changes only those fields)."""
    view = dict(draft.raw or {})
    top, nested = draft.top_level_layer_ids, draft.nested_layer_ids
    view["eagle_aux_hidden_state_layer_ids"] = None if top is None else [int(i) for i in top]
    ec = view.get("eagle_config")
    if nested is not None:
        ec = dict(ec) if isinstance(ec, Mapping) else {}
        ec["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in nested]
    elif isinstance(ec, Mapping):
        ec = {k: v for k, v in ec.items() if k != "eagle_aux_hidden_state_layer_ids"}
    if isinstance(ec, Mapping):
        if draft.use_aux_hidden_state and ec.get("use_aux_hidden_state") is False:
            ec["use_aux_hidden_state"] = True          # a copy made to try ids (with_ids) turns the capture on
        view["eagle_config"] = ec
    return view


class VLLMRules(PlanRules):
    """vLLM's rules for what it feeds an EAGLE-3 draft (:mod:`helpers.layers.vllm`, read in vLLM 0.32.0): ids from
    the draft config (top-level first, else ``eagle_config``), verbatim as in(i), sorted and de-duplicated, the
    target's default ``(2, n // 2, n - 3)`` when none is found. Given to the engine-neutral code by
    :meth:`VLLMAdapter.rules`."""

    engine = "vllm"
    label = "vLLM"
    convention = "vllm"
    d2t_rule = (f"{rules.SOURCES['d2t']}: target id = draft id + d2t[draft id]; a checkpoint without d2t leaves the "
                "parameter's zeros (target id = draft id) without a word")

    def served_plan(self, draft: Any, target: Any, algorithm: Optional[str] = "EAGLE3") -> CapturePlan:
        """The ordered physical tensors vLLM feeds the draft. ``EAGLE3`` with ``use_aux_hidden_state`` true: the ids
        of :func:`helpers.layers.vllm.aux_layer_ids` as in(i) (an id the layer loop never meets is a
        ``missing_chunk`` problem, and the draft's ``fc`` then gets fewer chunks than it takes: ``fatal``); ``EAGLE``
        or ``use_aux_hidden_state`` false: the target's final normed hidden state. Raises ValueError for another
        algorithm."""
        algo = (algorithm or "EAGLE3").upper()
        if algo not in ("EAGLE3", "EAGLE"):
            raise ValueError(f"unsupported speculative method {algorithm!r} for vLLM's EAGLE plans (eagle3, eagle)")
        n = int(target.num_hidden_layers)
        plan = CapturePlan(tensors=[], role="served", who=f"vllm {self.version or '(version unknown)'}",
                           provenance="rule")
        view = draft_view(draft)
        if algo == "EAGLE" or not rules.use_aux_hidden_state(view, rules.rule_version(self.version)):
            plan.tensors = ["final_norm"]
            plan.rules.append("no aux capture: the draft gets the target's final normed hidden state -- "
                              + rules.SOURCES["use_aux"])
            plan.source = ("method eagle" if algo == "EAGLE" else "draft config eagle_config.use_aux_hidden_state "
                           "false") + f" (vLLM {self.version} rule)"
            return plan
        ids, src = rules.aux_layer_ids(view, n, rules.rule_version(self.version))
        lids = LayerIds(tuple(ids), "vllm")
        plan.config_ids = None if src.startswith("default") else lids
        plan.engine_ids = lids
        plan.rules += [f"ids from the {src} -- {rules.SOURCES['aux_ids']}",
                       (f"kept as tuple(sorted(set(ids))) -- {rules.SOURCES['aux_set']}"
                        if rules.parse_version(rules.rule_version(self.version) or "0.32")[:3] >= rules.SORTED_IDS_SINCE
                        else f"kept verbatim; captured by membership in layer order (same chunks) -- "
                             f"{rules.SOURCES['aux_set']}"),
                       f"id i captured as in(i) = out(i-1), verbatim (0 = the embedding), before layer i -- "
                       f"{rules.SOURCES['aux_capture']}"]
        tensors = rules.captured(ids, n, rules.rule_version(self.version))
        for i, t in zip(ids, tensors):
            if t is None:
                plan.problems.append({"kind": "missing_chunk", "detail": f"vllm id {i} names no tensor of a {n}-layer "
                                      f"target: vLLM's layer loop never meets it and captures nothing there"})
            elif t == "embedding":
                plan.problems.append({"kind": "embedding_in_place_of_layer",
                                      "detail": "vllm id 0 captures the token embedding (in(0))"})
        plan.tensors = [t for t in tensors if t is not None]
        want = rules.num_aux_hidden_states(view, rules.rule_version(self.version))
        if len(plan.tensors) != want:
            read = view.get("eagle_aux_hidden_state_layer_ids") or (view.get("eagle_config") or {}).get(
                "eagle_aux_hidden_state_layer_ids") or []
            rep = sorted({int(i) for i in read if list(read).count(i) > 1})
            held = rules.parse_version(rules.rule_version(self.version) or "0.32")[:3] >= rules.SORTED_IDS_SINCE
            how = (f"vLLM keeps each once, {rules.SOURCES['aux_set']}" if held else
                   f"vLLM {self.version} holds them as read ({rules.SOURCES['aux_set']}) but captures each id once, "
                   f"by membership in layer order, {rules.SOURCES['aux_capture']}")
            why = f" (the ids {list(read)} repeat {rep}: {how}; give {want} distinct ids)" if rep else ""
            plan.fatal = (f"the draft's fc takes {want} chunks ({rules.SOURCES['num_aux']}) but vLLM captures "
                          f"{len(plan.tensors)}{why}: the first request fails in the draft's fc (shape mismatch) -- "
                          f"{rules.SOURCES['num_aux']}")
        plan.source = f"{src} {list(ids)} + vLLM {self.version} rule (in(i), verbatim)"
        if src.startswith("default"):
            plan.notes.append(f"the draft config names no ids vLLM reads (top-level eagle_aux_hidden_state_layer_ids, "
                              f"eagle_config.eagle_aux_hidden_state_layer_ids): vLLM falls back to the target's "
                              f"default {list(ids)} -- {rules.SOURCES['aux_default']}")
        if draft.top_level_layer_ids and draft.nested_layer_ids is not None \
                and sorted(set(draft.top_level_layer_ids)) != sorted(set(draft.nested_layer_ids)):
            plan.notes.append(f"the draft config has top-level ids {list(draft.top_level_layer_ids)} and "
                              f"eagle_config ids {list(draft.nested_layer_ids)}: vLLM reads the top-level ones "
                              f"(SGLang the nested ones) -- {rules.SOURCES['aux_ids']}")
        return plan

    def _reads_top(self, draft: Any) -> bool:
        return bool(draft.top_level_layer_ids)

    def with_ids(self, draft: Any, ids: Sequence[int]) -> Any:
        """A copy of the draft config with ``ids`` where vLLM reads them: the top-level key when it is set (it wins),
        else ``eagle_config.eagle_aux_hidden_state_layer_ids``."""
        ids = tuple(int(i) for i in ids)
        if self._reads_top(draft):
            return dataclasses.replace(draft, top_level_layer_ids=ids, use_aux_hidden_state=True)
        return dataclasses.replace(draft, nested_layer_ids=ids, use_aux_hidden_state=True)

    def ids_override(self, draft: Any, ids: Sequence[int], kinds: Sequence[str]) -> tuple[dict, str]:
        """``(config override, text)``: ``ids`` written where vLLM reads them (:meth:`with_ids`), in vLLM's
        convention (in(i), verbatim)."""
        ids = [int(i) for i in ids]
        if self._reads_top(draft):
            return ({"eagle_aux_hidden_state_layer_ids": ids},
                    f"set the top-level eagle_aux_hidden_state_layer_ids to {ids} in the draft config (now "
                    f"{list(draft.top_level_layer_ids)}; vLLM reads it first and takes id i as in(i), verbatim)")
        now = list(draft.nested_layer_ids) if draft.nested_layer_ids is not None else "absent: vLLM's default"
        return ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}},
                f"set eagle_config.eagle_aux_hidden_state_layer_ids to {ids} in the draft config (now {now}; vLLM "
                f"{self.version} takes id i as in(i) = out(i-1), verbatim: no +1)")

    def id_candidates(self, layer: int, num_layers: int) -> list[int]:
        """out(L) is vLLM id L + 1 (in(L+1)); the neighbours follow."""
        return [c for c in dict.fromkeys((layer + 1, layer, layer + 2, layer - 1)) if 0 <= c <= num_layers]

    def setup_findings(self, draft: Any, target: Any, plan: CapturePlan, algorithm: str) -> list[dict]:
        """``unsupported_draft`` for a draft class vLLM 0.32.0 does not map to an Eagle3 model
        (``model_executor/models/registry.py`` ``_SPECULATIVE_DECODING_MODELS``); a speculators-format draft is
        mapped first as vLLM maps it (:func:`helpers.formats.speculators.vllm_view`: ``update_eagle3``'s
        ``model_type`` -> class), and refused with vLLM's reason when it cannot be. vLLM reads ids at both places, so
        no id is ignored. An MTP / NextN head (``form == "mtp"``) is another draft family: :class:`VLLMMTPRules`."""
        archs = list(draft.architectures or [])
        spec = getattr(draft, "speculators", None)
        if spec is not None:
            if algorithm != "EAGLE3" or spec.problem is None:
                return []
            return [finding("unsupported_draft", None, f"vLLM {self.version} cannot serve this speculators-format "
                            f"draft as EAGLE-3: {spec.problem}", architectures=archs, form="speculators",
                            config=str(draft.path), source=speculators.SOURCES["eagle3"])]
        if algorithm != "EAGLE3" or any(a in vllm_server.EAGLE3_DRAFT_CLASSES for a in archs) or draft.form == "mtp":
            return []
        return [finding("unsupported_draft", None,
                        f"draft architectures {archs} is not an EAGLE-3 draft class vLLM {self.version} maps to "
                        f"its Eagle3 models {list(vllm_server.EAGLE3_DRAFT_CLASSES)}",
                        architectures=archs, config=str(draft.path),
                        source="vllm/model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS")]

    def supports_target(self, target: Any) -> bool:
        return True

    def readings(self, draft: Any, target: Any, plan: CapturePlan) -> Optional[dict]:
        return None

    def advisories(self, draft: Any, target: Any, plan: CapturePlan, training: Optional[CapturePlan],
                   findings: list[dict], algorithm: str) -> list[str]:
        return list(plan.notes)



# ------------------------------------------------------------------------------------------------ ablation toggles

def _already(key: str, value: Any, text: str):
    def check(info: Mapping) -> Optional[str]:
        return text if info.get(key) == value else None
    return check


def _no_spec(info: Mapping) -> Optional[str]:
    return None if info.get("speculative_algorithm") else "the server runs without a draft already"


#: vLLM 0.32.0's engine toggles (flags: ``vllm/engine/arg_utils.py::EngineArgs.add_cli_args``; speculative fields:
#: ``vllm/config/speculative.py::SpeculativeConfig``), each skipped with the reason read from
#: :meth:`VLLMClient.server_info` (the worker's own config) when it does not apply
TOGGLES: tuple[Toggle, ...] = (
    Toggle("prefix_caching_off", {"--no-enable-prefix-caching": None},
           "https://github.com/vllm-project/vllm/issues/41838 (3.07 -> 2.8 after hours of traffic); "
           "vllm/config/cache.py::CacheConfig.enable_prefix_caching",
           "prefix-cache KV reuse: the draft's KV of a cached prefix may not be the one it would compute",
           _already("enable_prefix_caching", False, "prefix caching is already off (CacheConfig.enable_prefix_caching "
                                                    "False)")),
    Toggle("async_scheduling_off", {"--no-async-scheduling": None},
           "https://github.com/vllm-project/vllm/issues/37150 (acceptance with async scheduling); "
           "vllm/config/scheduler.py::SchedulerConfig.async_scheduling",
           "the async scheduler schedules step N+1 before step N's rejected drafts are known",
           _already("async_scheduling", False, "async scheduling is already off on this server "
                                               "(SchedulerConfig.async_scheduling False, as vLLM resolved it)")),
    Toggle("draft_sample_probabilistic", {"speculative_config.draft_sample_method": "probabilistic"},
           "vllm/config/speculative.py::SpeculativeConfig.draft_sample_method ('greedy': the draft probabilities "
           "are one-hot in rejection sampling, so at temperature > 0 a draft token is accepted with the target's "
           "probability of it); https://github.com/vllm-project/vllm/issues/40551",
           "strict (one-hot draft) vs probabilistic rejection sampling at the requests' temperature",
           _already("draft_sample_method", "probabilistic", "the draft is sampled probabilistically already"),
           sampled=True),
    Toggle("rejection_block", {"speculative_config.rejection_sample_method": "block"},
           "vllm/config/speculative.py::SpeculativeConfig.rejection_sample_method ('block': block verification, "
           "the drafts verified jointly)",
           "token-by-token vs block verification at the requests' temperature",
           _already("rejection_sample_method", "block", "block verification is on already"), sampled=True),
    Toggle("draft_off", {}, "https://github.com/sgl-project/sglang/issues/15307 (accept length unchanged, tok/s "
           "129 -> 114: compare with the target alone)",
           "the non-speculative baseline: does speculation pay at all", _no_spec, speculative=False),
)


# ------------------------------------------------------------------------------------------------ the loader

class VLLMLoaderRules(VLLMLoaderTable, LoaderRules):
    """vLLM 0.32.0's draft loader for the server-free draft checks (:func:`helpers.draft.checks.inspect_draft`):
    embedding and lm_head sharing decided from the checkpoint's tensor names and equality with the target's
    (:func:`helpers.layers.vllm.weight_sharing`), the d2t map (:func:`helpers.layers.vllm.d2t_rule`), the draft's
    own rope and max length against the target's; the loader rule table the offline draft run follows
    (:class:`helpers.draft.loader_table.VLLMLoaderTable`: ``TABLE``, ``draft_tensors``, ``draft_norms``)."""

    label = "vLLM"
    d2t_source = rules.SOURCES["d2t"]

    def config_checks(self, d: Any, target: Any) -> ConfigChecks:
        """``unsupported_draft`` for a class vLLM does not map to its Eagle3 models; notes: the draft's max length
        is cut to the target's (``config/speculative.py`` "Overriding draft model max model len"), the draft runs its
        own rope (``model_executor/models/llama_eagle3.py::LlamaDecoderLayer``)."""
        findings = VLLMRules(self.version).setup_findings(d, target, CapturePlan([], "served", "vllm"), "EAGLE3")
        notes: list[str] = []
        facts: dict = {"engine": f"vLLM {self.version}"}
        spec = getattr(d, "speculators", None)
        if spec is not None:
            facts["speculators"] = {"speculators_model_type": spec.model_type, "vllm_class": spec.architecture,
                                    "norm_before_residual": d.raw.get("norm_before_residual"),
                                    "draft_vocab_size": d.raw.get("draft_vocab_size"),
                                    "target_hidden_size": d.raw.get("target_hidden_size"),
                                    "defaulted": spec.defaulted, "verifier": spec.verifier,
                                    "rule": f"{speculators.SOURCES['extract']}; {speculators.SOURCES['eagle3']}"}
            if "norm_before_residual" in spec.defaulted:
                notes.append("the speculators config has no norm_before_residual: vLLM reads it as true "
                             f"({speculators.SOURCES['eagle3']}; speculators' Eagle3SpeculatorConfig defaults to "
                             "false and writes the field), so the draft's first layer adds the normed hidden state "
                             "as its residual (llama_eagle3.py::LlamaDecoderLayer._norm_before_residual)")
        if target is not None:
            dm, tm = d.raw.get("max_position_embeddings"), target.raw.get("max_position_embeddings")
            facts["context_length"] = {"draft": dm, "target": tm, "rule": "vllm/config/speculative.py::"
                                       "SpeculativeConfig.__post_init__ (the draft's max model len is cut to the "
                                       "target's --max-model-len)"}
            if isinstance(dm, int) and isinstance(tm, int) and dm < tm:
                notes.append(f"the draft config's max_position_embeddings {dm} is below the target's {tm}: vLLM "
                             "serves the draft up to the server's --max-model-len anyway (it only ever cuts the "
                             f"draft's length down), so requests past {dm} tokens run the draft beyond its config")
            dr, tr = _rope(d.raw), _rope(target.raw)
            facts["rope"] = {"draft": dr, "target": tr, "rule": "vllm/model_executor/models/llama_eagle3.py::"
                             "LlamaDecoderLayer (the draft config's own rope_parameters)"}
            if dr != tr:
                notes.append(f"the draft's rope {dr} differs from the target's {tr}: vLLM runs the draft with its own "
                             "config's rope (llama_eagle3.py::LlamaDecoderLayer), as SpecForge trains it")
        return ConfigChecks(findings=findings, notes=notes, facts=facts)

    def plan_rules(self) -> PlanRules:
        return VLLMRules(self.version)

    def mtp_rules(self) -> "VLLMMTPRules":
        """vLLM's rules for an MTP / NextN head (:class:`VLLMMTPRules`)."""
        return VLLMMTPRules(self.version)

    def draft_vocab(self, d: Any) -> int:
        """``draft_vocab_size``, default the draft config's ``vocab_size`` (``llama_eagle3.py::
        Eagle3LlamaForCausalLM.__init__``)."""
        return int(d.draft_vocab_size or d.vocab_size or 0)

    def draft_vocab_field(self, d: Any) -> str:
        return "draft_vocab_size" if d.draft_vocab_size else "vocab_size: draft_vocab_size absent"

    def d2t_keys(self, d: Any, tensors: dict) -> list[str]:
        """Every tensor whose name contains ``d2t`` (``load_weights`` renames it to ``draft_id_to_target_id``)."""
        return [k for k in tensors if "d2t" in k]

    def weights(self, d: Any, weights: Any, target: Any, target_dir: Optional[Path], findings: list,
                facts: dict) -> None:
        """Embedding and lm_head sharing, the vocab map's presence, missing core tensors."""
        names = list(weights.tensors)
        t_embed, t_head = _target_tensors(target_dir, target)
        own_e = [k for k in names if "embed_tokens" in k]
        own_h = [k for k in names if "lm_head" in k]
        e_eq = _equal(weights, own_e, t_embed)
        h_eq = _equal(weights, own_h, t_head)
        share = rules.weight_sharing(names, embed_equal=e_eq, lm_head_equal=h_eq,
                                     version=rules.rule_version(self.version))
        facts["embedding"] = {"source": share["embedding"], "tensor": own_e[0] if own_e else None,
                              "rule": rules.SOURCES["embed_share"]}
        facts["lm_head"] = {"source": share["lm_head"], "tensor": own_h[0] if own_h else None,
                            "rule": rules.SOURCES["lm_head_share"]}
        if own_e and share["embedding"] == "draft":
            diff = _rel_diff(weights, own_e[0], t_embed)
            findings.append(finding(
                "embedding_not_shared", None,
                f"the checkpoint carries its own {own_e[0]}, which is not the target's embedding (rel. diff "
                f"{diff:.3g}): vLLM keeps it for the draft ('distinct embed_tokens weights'), where SGLang and the "
                "trainers that freeze the target's embedding use the target's",
                tensors=own_e, rel_diff=diff, config=str(d.path), tensors_to_drop=own_e,
                source=f"{rules.SOURCES['own_weights']}; {rules.SOURCES['embed_share']}",
                fix=f"drop {own_e[0]} from the draft checkpoint so vLLM shares the target's embedding"))
        dv = self.draft_vocab(d)
        vocab = int((target.vocab_size if target is not None else None) or d.vocab_size or dv)
        if not own_h:
            fatal = dv != vocab
            findings.append(finding(
                "lm_head_missing", None,
                f"no lm_head in the draft checkpoint: vLLM gives the draft the target's lm_head ({vocab} rows)"
                + (f", and the draft's d2t scatter of {dv} draft ids then fails at the first request "
                   "(Eagle3LlamaForCausalLM.compute_logits: logits_new[:, targets] = logits)" if fatal else
                   ": the draft proposes from the target's head, not a head trained with it"),
                draft_vocab_size=dv, vocab_size=vocab, fatal=fatal, config=str(d.path),
                source=f"{rules.SOURCES['own_weights']}; {rules.SOURCES['lm_head_share']}",
                fix="add the trained lm_head.weight to the checkpoint"))
        how = rules.d2t_rule(names, d.draft_vocab_size, vocab, rules.rule_version(self.version))
        facts["d2t"] = {"rule": how, "source": rules.SOURCES["d2t"]}
        if how == "zeros":
            findings.append(finding(
                "vocab_map_missing", None,
                f"draft_vocab_size {dv} < the target's {vocab} but the checkpoint has no d2t: vLLM keeps its "
                "draft_id_to_target_id zeros, so draft id i is proposed as target id i, without a word",
                draft_vocab_size=dv, vocab_size=vocab, config=str(d.path), source=rules.SOURCES["d2t"]))
        # load_weights maps "input_norm." to None unless norm_before_fc builds model.input_norm: the tensor is
        # dropped without a word (a conversion that forwards the weight but not the flag)
        dropped = [k for k in names if re.search(r"(^|\.)input_norm\.", k)] if not d.norm_before_fc else []
        if dropped:
            findings.append(finding(
                "draft_weight_ignored", None,
                f"{len(dropped)} tensor(s) of the checkpoint are dropped by vLLM without a word: "
                f"{', '.join(dropped)} (input_norm.weight is in the checkpoint but norm_before_fc is not set: the "
                "draft was trained with an RMSNorm over the aux hidden states before fc, which vLLM then skips)",
                tensors=dropped, config=str(d.path),
                source=f"{rules.SOURCES['d2t'].split(' / ')[0]} (orig_to_new_substr['input_norm.'] = None when "
                       "LlamaModel.norm_before_fc is false); llama_eagle3.py::LlamaModel.__init__ (norm_before_fc "
                       "from eagle_config, else the config's top level)",
                fix="set norm_before_fc: true in the draft config (a speculators config: at its top level, "
                    "vllm/transformers_utils/configs/speculators/algos.py::update_eagle3)"))
        need = [p for p in ("fc.weight", "norm.weight") if not any(k.endswith(p) and "midlayer" not in k
                                                                      for k in names)]
        if not any(("midlayer." in k or "layers.0." in k) for k in names):
            need.append("midlayer.* (the decoder layer)")
        if need:
            findings.append(finding(
                "draft_weight_missing", None,
                f"{len(need)} tensor group(s) vLLM builds have no tensor in the checkpoint and keep their initial "
                f"values: {', '.join(need)}",
                missing=[{"param": n} for n in need], config=str(d.path),
                source=f"{rules.SOURCES['d2t']} (load_weights returns None, so model_loader/default_loader.py::"
                       "DefaultModelLoader.load_weights never checks for missing weights)"))


def _rope(raw: Mapping[str, Any]) -> dict:
    rp = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = (rp.get("rope_theta") if isinstance(rp, Mapping) else None) or raw.get("rope_theta") or 10000.0
    kind = (rp.get("rope_type") or rp.get("type")) if isinstance(rp, Mapping) else None
    return {"rope_theta": float(theta), "rope_type": kind or "default"}


def _target_tensors(target_dir: Optional[Path], target: Any) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The target's ``embed_tokens`` and ``lm_head`` (the embedding when tied) from its safetensors, None when the
    weights are not here."""
    if target_dir is None:
        return None, None
    folder = Path(target_dir) if Path(target_dir).is_dir() else Path(target_dir).parent
    embed = head = None
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                if k.endswith("embed_tokens.weight") and embed is None:
                    embed = sf.get_tensor(k)
                elif k.endswith("lm_head.weight") and head is None:
                    head = sf.get_tensor(k)
    tied = bool((target.raw if target is not None else {}).get("tie_word_embeddings"))
    return embed, (head if head is not None else (embed if tied else None))


def _equal(weights: Any, keys: list[str], ref: Optional[torch.Tensor]) -> Optional[bool]:
    """``torch.equal`` of the checkpoint's tensor with the target's, in the dtype the server computes in (float32
    here), as ``_maybe_share_*`` compares the loaded modules; None when either is missing."""
    if not keys or ref is None:
        return None
    t = _load_tensor(weights, keys[0])
    return bool(t.shape == ref.shape and torch.equal(t.to(torch.float32), ref.to(torch.float32)))


def _rel_diff(weights: Any, key: str, ref: Optional[torch.Tensor]) -> float:
    if ref is None:
        return float("nan")
    t = _load_tensor(weights, key).to(torch.float32)
    if t.shape != ref.shape:
        return float("inf")
    r = ref.to(torch.float32)
    return float((t - r).norm() / max(float(r.norm()), 1e-12))


def _load_tensor(weights: Any, key: str) -> torch.Tensor:
    with safe_open(str(weights.tensors[key].file), framework="pt") as sf:
        return sf.get_tensor(key)


_SPEC = "vllm/config/speculative.py::SpeculativeConfig.__post_init__"
#: the ``method`` names vLLM 0.32.0 takes for an MTP head (``MTPModelTypes``, ``config/speculative.py`` l. 38-66;
#: each but ``mtp`` is a deprecated alias of it, l. 1141-1145)
VLLM_MTP_METHODS = ("mtp", "deepseek_mtp", "glm4_moe_mtp", "qwen3_next_mtp", "mimo_mtp", "mimo_v2_mtp", "ernie_mtp",
                    "longcat_flash_mtp", "glm4_moe_lite_mtp", "dots3_note_mtp", "pangu_ultra_moe_mtp")


class VLLMMTPRules(MTPRules):
    """vLLM 0.32.0's rules for an MTP / NextN head (``helpers.layers.mtp``'s docstring): ``method: mtp``, the target's
    folder as the draft's, ``n_predict`` from the layer field, ``num_speculative_tokens`` defaulted to it or a multiple
    of it, the head layers reused round-robin past ``n_predict``."""

    label = "vLLM"
    missing_effect = ('vLLM refuses to start: ValueError("Following weights were not initialized from checkpoint: '
                      '...") (vllm/model_executor/model_loader/default_loader.py l. 562-567, unquantized checkpoints)')

    def __init__(self, version: Optional[str] = None) -> None:
        self.version = version if rules.is_known(version) else rules.known_versions_text()

    own_copies_rule = ("vllm/model_executor/models/deepseek_mtp.py::DeepSeekMTP.load_weights loads them, then "
                       "vllm/v1/spec_decode/llm_base_proposer.py::_maybe_share_embeddings / _maybe_share_lm_head "
                       "replace both by the target's for an MTP model (pipeline parallel size 1)")

    def effect_of(self, missing: list) -> str:
        """vLLM refuses the load (:attr:`missing_effect`), whatever the tensors."""
        return self.missing_effect

    def built_layers(self, head: MTPHead, algorithm=None) -> int:
        """The head layers vLLM 0.32.0 builds and runs for ``head`` (:attr:`helpers.layers.mtp.MTPHead.vllm_built`):
        ``n_predict`` of them (``deepseek_mtp.py::DeepSeekMultiTokenPredictor.__init__``: one per head layer), or the
        fixed count of a head class that builds one whatever it is given (LongCat-Flash, MiMo-V2). Draft steps past
        it rerun the layers round-robin (:attr:`helpers.layers.mtp.MTPFamily.vllm_reuse`). ``algorithm`` is not read
        (vLLM's head class does not depend on the method name)."""
        return head.vllm_built

    def head_prefixes(self, head: MTPHead, algorithm=None) -> list:
        """vLLM reads one prefix per head layer (:meth:`MTPHead.vllm_prefixes`); ``algorithm`` is not read."""
        return head.vllm_prefixes()

    def weights(self, head: MTPHead, names: set, prefixes: list, findings: list, facts: dict) -> None:
        """As :meth:`helpers.draft.mtp_checks.MTPRules.weights`, for vLLM's head class."""
        self._weights(head, names, prefixes, findings, facts, f"vLLM's {head.vllm_arch}",
                      f"{head.vllm_file} (mtp_start_layer_idx = num_hidden_layers)")

    def layer_indices(self, head: MTPHead, names: Optional[set], findings: list, notes: list, facts: dict) -> None:
        """The checkpoint's MTP layer indices against what vLLM loads: an index ``i >= n_predict`` that the family's
        mapper leaves outside the layers built (``model.mtp_layers.<i>`` with ``i`` not in ``[num_hidden_layers,
        num_hidden_layers + n_predict)``) is ``mtp_head_refused`` with the family's
        :attr:`helpers.layers.mtp.MTPFamily.vllm_extra_layer_refusal`; a family that skips such indices gets a note
        (:attr:`helpers.layers.mtp.MTPFamily.vllm_extra_layers_note`)."""
        fam = head.family
        idx = fam.checkpoint_layer_indices(names)
        if not idx:
            return
        facts["checkpoint_layers"] = idx
        d = head.vllm_n_predict or 0
        if fam.vllm_extra_layer_refusal is not None:
            start = head.num_hidden_layers or 0
            extra = [i for i in idx if i >= d and not start <= i < start + d]
            if extra:
                ref = fam.vllm_extra_layer_refusal
                findings.append(finding(
                    "mtp_head_refused", None,
                    f"the checkpoint holds MTP layers {idx} but {fam.layers_field} is {d}: vLLM's {head.vllm_arch} "
                    f"remaps layers below {d} only, so layer {extra[0]} reaches no module and loading raises "
                    f"{ref.error.replace('<i>', str(extra[0]))} at start-up",
                    engine=f"{self.label} {self.version}", checkpoint_layers=idx, declared=d, unmapped=extra,
                    error=ref.error, source=ref.source,
                    fix=f"set {fam.layers_field} to {max(idx) + 1} in a copy of the config, or drop layers "
                        f"{extra} from a copy of the index / shards"))
        elif fam.vllm_extra_layers_note and any(i >= (fam.vllm_built or d) for i in idx):
            notes.append(f"the checkpoint holds MTP layers {idx}: those past the {fam.vllm_built or d} vLLM builds "
                         f"are {fam.vllm_extra_layers_note}")

    def check(self, head: MTPHead, spec: MTPSpec, target_raw: dict, names: Optional[set], draft_is_target: bool,
              findings: list, notes: list, facts: dict) -> None:
        """What vLLM will load and refuse for ``head`` (see :meth:`helpers.draft.mtp_checks.MTPRules.check`)."""
        fam = head.family
        who = f"{self.label} {self.version}"
        method = (spec.algorithm or "mtp").lower()
        facts["algorithm"] = {"requested": spec.algorithm, "as_run": "mtp",
                              "rule": f"{_SPEC} l. 1141-1145 (a per-family method is a deprecated alias of mtp)"}
        if head.arch in fam.vllm_no_head:
            findings.append(finding(
                "mtp_head_refused", None,
                f"vLLM {self.version} has no MTP head for {head.arch}: its config is not rewritten into an MTP model "
                "type, so method 'mtp' ends in NotImplementedError(\"Unsupported speculative method: 'mtp'\") at "
                f"start-up (SGLang serves it as {fam.head_arch})",
                engine=who, target_arch=head.arch, error="NotImplementedError(\"Unsupported speculative method: "
                "'mtp'\")", source=VLLM_NO_HEAD_RULE,
                fix=f"serve this target's MTP head with SGLang ({fam.head_arch}), or use an EAGLE-3 draft on vLLM"))
            return
        n = head.vllm_n_predict
        facts["loads"] = {
            "class": head.vllm_arch, "file": head.vllm_file,
            "from": "the target's folder: the head is its extra layer" if draft_is_target else
                    "the separate draft folder",
            "draft_path": (f"speculative_config model unset: the target's model ({_SPEC} l. 1147-1163)"
                           if draft_is_target else "speculative_config model"),
            "rewrite": "vllm/config/speculative.py::SpeculativeConfig.hf_config_override l. 661-1074: "
                       f"architectures -> {head.vllm_arch}, n_predict = {fam.layers_field} ({n})",
            "prefixes": head.vllm_prefixes(), "head_tensors": list(fam.head_tensors),
            "layers_declared": head.layers, "n_predict": n}
        if fam.serves_own(self.label):
            facts["loads"]["embedding_and_lm_head"] = own_served(fam, self.label)
        fed = fed_state(head)
        if fed is not None:
            facts["loads"]["fed_state"] = {"candidate": fed[0], "source": fed[1]}
        cpu = cpu_refusal(target_raw) if target_raw else None
        if cpu:
            notes.append(f"on vLLM {self.version}'s CPU backend (the embedded server) this target is not served: {cpu}")
        if method not in VLLM_MTP_METHODS:
            findings.append(finding(
                "mtp_head_refused", None,
                f"speculative method {method!r} with an MTP / NextN head: vLLM loads the head ({head.vllm_arch}) with "
                "method 'mtp'; another method builds another proposer for this folder",
                engine=who, method=method, source=f"{_SPEC} l. 1141-1145, 1375-1400", fix='"method": "mtp"'))
            return
        k = spec.num_steps
        if n == 0:
            findings.append(finding(
                "mtp_head_refused", None,
                f"{fam.layers_field} is 0: vLLM's {head.vllm_arch} has no layer to run (n_predict 0; a "
                "num_speculative_tokens above it fails the divisibility check with ZeroDivisionError)",
                engine=who, field=fam.layers_field, value=0, source=f"{_SPEC} l. 1489-1501; {head.vllm_file}",
                fix="serve this target without MTP, or with an EAGLE-3 draft"))
            return
        if k is None and n is None:
            findings.append(finding(
                "mtp_head_refused", None,
                f"{fam.layers_field} is absent, so n_predict is None and num_speculative_tokens has no default: vLLM "
                'raises ValueError("A speculative model was provided, but `num_speculative_tokens` was not provided")',
                engine=who, field=fam.layers_field, source=f"{_SPEC} l. 1503-1507",
                fix='give "num_speculative_tokens" in --speculative-config'))
            return
        if k is None:
            k = n
            notes.append(f"num_speculative_tokens not given: vLLM uses n_predict = {n} ({_SPEC} l. 1489-1492)")
        elif n is not None and k > n and k % n:
            findings.append(finding(
                "mtp_head_refused", None,
                f"num_speculative_tokens {k} with n_predict {n}: vLLM raises ValueError(\"num_speculative_tokens:{k} "
                f"must be divisible by n_predict={n}\") at start-up",
                engine=who, num_speculative_tokens=k, n_predict=n, source=f"{_SPEC} l. 1493-1501",
                fix=f'"num_speculative_tokens": {n * max(1, k // n)} (a multiple of {n})'))
            return
        facts["settings"] = {"num_steps": k, "topk": 1, "num_draft_tokens": k + 1,
                             "requested": {"num_speculative_tokens": spec.num_steps},
                             "rule": f"{_SPEC} l. 1489-1507"}
        if spec.topk not in (None, 1):
            notes.append(f"topk {spec.topk} is SGLang's flag: vLLM's MTP proposer drafts one chain of "
                         f"num_speculative_tokens = {k} tokens")
        self._weights(head, names, head.vllm_prefixes(), findings, facts, f"vLLM's {head.vllm_arch}",
                      f"{head.vllm_file} (mtp_start_layer_idx = num_hidden_layers)")
        self.layer_indices(head, names, findings, notes, facts)
        trained = self.built_layers(head)
        facts["loads"]["layers_loaded"] = trained
        if k > trained:
            findings.append(finding(
                "mtp_steps_beyond_head", None,
                f"num_speculative_tokens {k} with {trained} MTP layer{'s' if trained > 1 else ''}: vLLM runs the head "
                f"layers again from step {trained + 1} on, on the hidden state the head itself produced ("
                + ("it logs 'Enabling num_speculative_tokens > 1 will run multiple times of forward on same MTP "
                   "layer'" if fam.vllm_warns_reuse else "without the warning other MTP heads get: "
                   f"{_SPEC} l. 1376-1379 exempts step3p5_mtp") + "): what "
                "those steps keep of acceptance is not known from the configs",
                engine=who, num_steps=k, head_layers=trained, source=f"{head.vllm_reuse}; {_SPEC} l. 1375-1385",
                fix=f'"num_speculative_tokens": {trained}, or measure acceptance per draft position before keeping '
                    f'{k}'))
