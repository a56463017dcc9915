"""Config-only checks of an MTP / NextN head (issue 37 part 5): what the engine will load for the head and from where,
the refusals it will give, draft steps beyond the layers the head has, and the settings it silently changes -- from
the config.json files (and a safetensors index's tensor names, when one is at hand: no weights are read).

The head is a family of :data:`helpers.layers.mtp.MTP_FAMILIES` (a target config with ``num_nextn_predict_layers``,
or a separate NextN checkpoint); the engine's rules are one object (:class:`MTPRules`: SGLang 0.5.23 here, vLLM
0.32.0's ``helpers.engines.vllm_rules.VLLMMTPRules``, handed out by ``LoaderRules.mtp_rules``), so nothing here asks
which engine it checks for. Used by ``python -m helpers diagnose --draft-config D --target-config T`` when D is an MTP
head (:func:`check_mtp`) and by the attach of ``investigate`` (:func:`describe_head`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..diagnosis import detectors as D
from ..diagnosis.static import StaticReport
from ..errors import BadInput
from ..formats.configs import read_config_json, read_mtp_head, read_safetensors_index
from ..kinds import sort_findings
from ..layers.mtp import (ALIAS_RULE, DRAFT_CONFIG_FALLBACK, DRAFT_PATH_RULE, MAX_MTP_LAYERS, MTP_FAMILIES, REWRITE,
                          SGLANG_BUILT_LAYERS, STEPS_RULE, MTPFamily, MTPHead, family_of, text_config)
from ..runfiles import read_json_file
from ..server.settings import AUTO_PARAMS_BY_ARCH, AUTO_PARAMS_DEFAULT, ServerSettings, detect_overrides
from .params import SGLANG_RULES

_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
#: the algorithms SGLang serves an MTP head with (NEXTN is an alias of EAGLE)
MTP_ALGORITHMS = ("NEXTN", "EAGLE")


@dataclass(frozen=True)
class MTPSpec:
    """The speculative settings asked for (None: not given; the engine's defaults apply).

    Attributes:
        algorithm: SGLang's ``--speculative-algorithm`` (vLLM: the ``method``).
        num_steps: ``--speculative-num-steps`` (vLLM: ``num_speculative_tokens``).
        topk: ``--speculative-eagle-topk``.
        num_draft_tokens: ``--speculative-num-draft-tokens``.
    """

    algorithm: Optional[str] = None
    num_steps: Optional[int] = None
    topk: Optional[int] = None
    num_draft_tokens: Optional[int] = None


def _config_file(path: str | Path) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def weight_names(folder: Path) -> tuple[Optional[set[str]], str]:
    """(the checkpoint's tensor names, where they were read) without reading any tensor: the
    ``model.safetensors.index.json`` weight map (the shards need not be here), else the ``*.safetensors`` headers
    (:func:`helpers.formats.configs.read_safetensors_index`); (None, why not) when the folder holds neither.

    Raises:
        BadInput: an index without a ``weight_map`` object, an unreadable safetensors header."""
    if not folder.is_dir():
        return None, "a config.json file was given (no folder): the weights were not looked at"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        doc = read_json_file(index, "safetensors index")
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise BadInput("expected a weight_map object {tensor: shard file}", path=index, field="weight_map")
        return set(wm), f"{index.name} (tensor names only)"
    if any(folder.glob("*.safetensors")):
        return set(read_safetensors_index(folder)), "the *.safetensors headers"
    return None, "no model.safetensors.index.json nor *.safetensors in the folder: the head's tensors were not checked"


#: The tensor names that stand for a module's ``.weight`` in a quantised checkpoint (the parameters the engines'
#: quantised linear methods register in place of ``weight``): ``qweight`` (GPTQ / AWQ: vllm/model_executor/layers/
#: quantization/auto_gptq.py, auto_awq.py; sglang/srt/layers/quantization/awq/schemes/awq_linear.py), ``weight_packed``
#: (compressed-tensors WNA16: vllm/model_executor/layers/quantization/compressed_tensors/schemes/
#: compressed_tensors_wNa16.py::CompressedTensorsWNA16.create_weights l. 223). Scales
#: (``weight_scale``, ``weight_scale_inv``, ``scales``, ``qzeros``) come beside a weight, never instead of one: a
#: checkpoint with only those has no weight for the module, so they do not count.
WEIGHT_STAND_INS = ("qweight", "weight_packed")


def missing_tensors(prefixes: list[str], head_tensors: tuple[str, ...], layer_tensors: tuple[str, ...],
                    names: set[str], expected: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """``{prefix: [missing tensor names]}`` for each head prefix. With ``expected`` (every tensor of a head layer
    relative to its prefix, :attr:`helpers.layers.mtp.MTPHead.expected`) each one is looked for; else the head's own
    tensors (``head_tensors``) and its decoder layer (``layer_tensors``; any one of them present counts as the layer
    being there, as the names vary with the attention / MoE kind). A ``<module>.weight`` counts as present when the
    checkpoint has it or one of :data:`WEIGHT_STAND_INS` of that module (a quantised checkpoint's packed weight);
    a ``.bias`` or any other tensor of the module does not stand for its weight. Prefixes with nothing missing are
    left out."""
    def there(name: str) -> bool:
        if name in names:
            return True
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        return base is not None and any(f"{base}.{s}" in names for s in WEIGHT_STAND_INS)

    out = {}
    for p in prefixes:
        if expected:
            miss = [p + t for t in expected if not there(p + t)]
        else:
            miss = [p + t for t in head_tensors if not there(p + t)]
            if layer_tensors and not any(there(p + t) for t in layer_tensors):
                miss += [p + layer_tensors[0]]
        if miss:
            out[p] = miss
    return out


def sglang_missing_effect(name: str) -> str:
    """What SGLang 0.5.23 serves for a NextN parameter the checkpoint lacks (nothing checks after loading:
    ``sglang/srt/model_loader/loader.py::DefaultModelLoader.load_weights_and_postprocess`` calls the model's
    ``load_weights``, which only fills what it is given): an RMSNorm weight keeps ``torch.ones``
    (``sglang/srt/layers/layernorm.py::RMSNorm.__init__``); ``eh_proj`` / ``fc`` is a plain ``nn.Linear``
    (``deepseek_nextn.py::DeepseekModelNextN.__init__``, ``qwen3_5_mtp.py::Qwen3_5ForCausalLMMTP.__init__``,
    ERNIE-4.5's ``mtp_linear_proj``, ``ernie4_eagle.py::Ernie4ModelMTP.__init__`` l. 56: torch's random init); every
    other parameter (the parallel
    linears, the experts, the router) is allocated with ``torch.empty``: whatever memory it got."""
    parts = name.split(".")[:-1]
    if len(parts) > 1 and parts[-1].isdigit():  # ERNIE-4.5 stores mtp_emb_norm.0 / mtp_linear_proj.0 (layer index last)
        parts = parts[:-1]
    if len(parts) > 1 and parts[-1] == "m":     # LongCat-Flash stores its NextN norms as enorm.m / hnorm.m
        parts = parts[:-1]                      # (longcat_flash_nextn.py::load_weights weight_names_mapping l. 518-519)
    leaf = parts[-1] if parts else name
    if leaf.endswith(("norm", "layernorm")):
        return "ones (RMSNorm init)"
    if leaf in ("eh_proj", "fc", "mtp_linear_proj"):    # ernie4_eagle.py::Ernie4ModelMTP.__init__ l. 56: nn.Linear
        return "torch's nn.Linear random init"
    return "uninitialised memory (torch.empty)"


def _any_head_tensor(fam: MTPFamily, prefixes: list[str], names: set[str]) -> bool:
    """Whether the checkpoint has any tensor of the head's modules (``<prefix><module>.<index>``, the first two parts of
    each of the family's head / layer tensors), as ERNIE-4.5's loader asks before raising KeyError
    (``sglang/srt/models/ernie4_eagle.py::Ernie4_5_MoeForCausalLMMTP.load_weights`` l. 144-158: any name containing
    ``mtp_block.0`` / ``mtp_emb_norm.0`` / ``mtp_hidden_norm.0`` / ``mtp_linear_proj.0``)."""
    roots = {p + ".".join(t.split(".")[:2]) + "." for p in prefixes for t in (*fam.head_tensors, *fam.layer_tensors)}
    return any(n.startswith(r) for n in names for r in roots)


def own_served(fam: MTPFamily, label: str) -> str:
    """What the engine ``label`` serves as the draft's embedding / lm_head for a family that keeps the checkpoint's own
    copies (:meth:`helpers.layers.mtp.MTPFamily.serves_own`), with the source."""
    src = dict(fam.serves_own_source).get(label, "")
    return (f"the checkpoint's own {', '.join(fam.serves_own(label))} under the head's prefix, not the target's"
            + (f" ({src})" if src else ""))


class MTPRules:
    """SGLang 0.5.23's rules for an MTP / NextN head (the module docstring of :mod:`helpers.layers.mtp`); one subclass
    per engine (``helpers.engines.vllm_rules.VLLMMTPRules``). ``label``: the engine's name for messages."""

    label = "SGLang"

    def __init__(self, version: Optional[str] = None) -> None:
        self.version = version or SGLANG_RULES

    def check(self, head: MTPHead, spec: MTPSpec, target_raw: dict, names: Optional[set[str]], draft_is_target: bool,
              findings: list, notes: list, facts: dict) -> None:
        """What SGLang will load and refuse for ``head`` under ``spec`` (findings, notes and facts appended).

        Args:
            head: the head (:func:`helpers.layers.mtp.mtp_head` of the draft config).
            spec: the settings asked for.
            target_raw: the target's config.json.
            names: the draft checkpoint's tensor names (:func:`weight_names`), None when not at hand.
            draft_is_target: the draft config is the target's (no separate draft path, or the same folder).
        """
        fam = head.family
        algo = (spec.algorithm or "NEXTN").upper()
        tarch = (target_raw.get("architectures") or [None])[0]
        facts["algorithm"] = {"requested": spec.algorithm, "as_run": "EAGLE" if algo in MTP_ALGORITHMS else algo,
                              "rule": ALIAS_RULE}
        facts["loads"] = {
            "class": fam.head_arch, "file": fam.head_file,
            "from": ("the target's folder: the head is its extra layer" if draft_is_target else
                     "the separate draft folder"),
            "draft_path": (f"/server_info speculative_draft_model_path = the target's model_path ({DRAFT_PATH_RULE})"
                           if fam.draft_path_default else
                           f"/server_info speculative_draft_model_path stays null; the draft config and weights "
                           f"come from model_path ({DRAFT_CONFIG_FALLBACK})") if draft_is_target else
                          "--speculative-draft-model-path",
            "rewrite": f"{REWRITE}: architectures[0] -> {fam.head_arch}"
                       + (f", {fam.layers_field} = {fam.sglang_layers}" if fam.sglang_layers is not None else ""),
            "prefixes": head.sglang_prefixes(), "head_tensors": list(fam.head_tensors),
            "embedding_and_lm_head": (own_served(fam, self.label) if fam.serves_own(self.label) else
                                      "the target's (sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker."
                                      "init_lm_head l. 371-378: set_embed_and_head)"),
            "loader": fam.sglang_loader, "layers_declared": head.layers,
            "layers_loaded": self.built_layers(head, spec.algorithm or "NEXTN"),
            "multi_layer_eagle": fam.per_step_on_sglang(spec.algorithm)}
        if algo not in MTP_ALGORITHMS:
            findings.append(D.finding(
                "mtp_head_refused", None,
                f"--speculative-algorithm {algo} with an MTP / NextN head: SGLang serves the head ({fam.head_arch}: "
                f"the target's last hidden state in) with NEXTN (an alias of EAGLE); {algo} expects another draft "
                "kind (EAGLE3: an EAGLE-3 draft class fed the target's aux hidden states through fc)",
                engine=f"{self.label} {self.version}", algorithm=algo, head_class=fam.head_arch,
                source=f"{ALIAS_RULE}; {fam.head_file}", fix="--speculative-algorithm NEXTN"))
            return
        if fam.sglang_exactly_one and head.layers != 1:
            err = ('ValueError("num_nextn_predict_layers is not in the config")' if head.layers is None else
                   'AssertionError("Only 1 nextn layer is supported")')
            findings.append(D.finding(
                "mtp_head_refused", None,
                f"{fam.layers_field} is {'absent' if head.layers is None else head.layers} in the "
                f"{'target' if head.form == 'target' else 'NextN checkpoint'}'s config: SGLang's {fam.head_arch} "
                f"loader raises {err} at start-up"
                + (" (the target ships no MTP head to serve)" if not head.layers else ""),
                engine=f"{self.label} {self.version}", field=fam.layers_field, value=head.layers, error=err,
                source=fam.sglang_loader,
                fix=("serve this target without NEXTN, or with a draft that exists (an EAGLE-3 draft)"
                     if not head.layers else f"SGLang loads exactly one NextN layer: set {fam.layers_field} to 1 "
                     "in a copy of the config if the first layer is the one to serve")))
            return
        if fam.per_step_on_sglang(spec.algorithm):  # one draft model per step: the steps decide the layers read
            self._settings(head, spec, tarch, findings, notes, facts, names)
            steps = facts["settings"]["num_steps"]
            prefixes = [fam.sglang_prefix(head.num_hidden_layers or 0, i) for i in range(steps)]
            facts["loads"].update(prefixes=prefixes, layers_loaded=min(steps, head.layers or 0))
            if not any(f["kind"] == "mtp_head_refused" for f in findings):
                self._weights(head, names, prefixes, findings, facts, f"{self.label}'s {fam.head_arch}",
                              fam.sglang_loader)
            return
        if self._single_layer_refused(head, spec, names, findings):
            return
        built = self.built_layers(head, spec.algorithm or "NEXTN")
        if (head.layers or 0) > built:
            notes.append(f"{fam.layers_field} is {head.layers}, but SGLang builds {built} head layer ({fam.head_arch}, "
                         f"{fam.head_file}): it runs that one layer at every draft step; the checkpoint's MTP layers past "
                         f"the first are {fam.sglang_later_layers}")
        if head.layers == 0:
            notes.append(f"{fam.layers_field} is 0: the config declares no MTP layer, and SGLang builds one "
                         f"{fam.head_arch} layer anyway ({REWRITE} rewrites the class whatever the count; "
                         f"{fam.head_file}); only the checkpoint's tensors (below) say whether "
                         "a trained head is there")
        self.layer_indices(head, names, findings, notes, facts)
        self._weights(head, names, head.sglang_prefixes(), findings, facts, f"{self.label}'s {fam.head_arch}",
                      fam.sglang_loader)
        self._settings(head, spec, tarch, findings, notes, facts, names)

    def _single_layer_refused(self, head: MTPHead, spec: MTPSpec, names: Optional[set[str]], findings: list) -> bool:
        """``mtp_head_refused`` (True) when SGLang builds ``head`` once under ``spec.algorithm`` (no multi-layer EAGLE:
        :meth:`helpers.layers.mtp.MTPFamily.per_step_on_sglang`) and the family's head then fails to load
        (:attr:`helpers.layers.mtp.MTPFamily.sglang_single_layer_refusal`, Step-3.5: a TypeError for any tensor of its
        declared layers; with no tensor names at hand the declared layers are taken as present)."""
        fam = head.family
        ref = fam.sglang_single_layer_refusal
        if ref is None or not head.layers:
            return False
        prefixes = [fam.sglang_prefix(head.num_hidden_layers or 0, i) for i in range(min(head.layers, MAX_MTP_LAYERS))]
        if names is not None and not any(n.startswith(tuple(prefixes)) for n in names):
            return False
        per_step = " / ".join(f"--speculative-algorithm {a}" for a in fam.sglang_layer_per_step)
        findings.append(D.finding(
            "mtp_head_refused", None,
            f"--speculative-algorithm {spec.algorithm or 'NEXTN'} with {fam.head_arch}: SGLang's model override "
            "enables "
            f"multi-layer EAGLE for {per_step} only (tested before NEXTN is aliased to EAGLE), so it builds one "
            f"{fam.head_arch} with no draft model index, and its loader raises {ref.error} on the first tensor of "
            f"{', '.join(prefixes)}* at start-up",
            engine=f"{self.label} {self.version}", algorithm=spec.algorithm or "NEXTN", head_class=fam.head_arch,
            error=ref.error, source=f"{ref.source}; {fam.sglang_loader}",
            fix=f"{per_step} (one {fam.head_arch} per draft step), or add --enable-multi-layer-eagle"))
        return True

    def layer_indices(self, head: MTPHead, names: Optional[set[str]], findings: list, notes: list,
                      facts: dict) -> None:
        """The checkpoint's MTP layer indices (:meth:`helpers.layers.mtp.MTPFamily.checkpoint_layer_indices`) against
        what SGLang serves: for a family whose loader folds every index into its one block
        (:attr:`helpers.layers.mtp.MTPFamily.sglang_folds_layers`), a checkpoint with any layer other than 0 gives
        ``mtp_layer_folded`` (the layer served is the last one read, which the names cannot tell: a head trained for
        a later step may be served at step 1). Nothing for the other families or without names."""
        fam = head.family
        idx = fam.checkpoint_layer_indices(names)
        if not idx:
            return
        facts["checkpoint_layers"] = idx
        if fam.sglang_folds_layers and idx != [0]:
            findings.append(D.finding(
                "mtp_layer_folded", None,
                f"the checkpoint holds MTP layers {idx} ({fam.layers_field} {head.layers}); SGLang's {fam.head_arch} "
                f"loads every one of them into its one head block, each overwriting the one read before "
                f"({fam.sglang_loader}): the layer served at every draft step is the last one read, not layer 0, "
                "and whether it is the layer trained for step 1 is not known from the names",
                engine=f"{self.label} {self.version}", checkpoint_layers=idx, declared=head.layers,
                source=fam.sglang_loader,
                fix="serve a checkpoint holding only the step-1 MTP layer (index 0): drop the other model.mtp "
                    "layers from a copy of the index / shards"))

    #: what the engine does when the head's tensors are missing (SGLang: no check after loading, found in
    #: ``model_loader/`` and the DeepSeek / GLM loaders)
    missing_effect = ("SGLang starts anyway: those parameters keep their initial values (the loader only skips "
                      "names outside the prefix; nothing checks that the head was filled)")

    #: where SGLang drops the head's own lm_head / embedding copies and binds the target's
    own_copies_rule = ("sglang/srt/models/deepseek_common/deepseek_weight_loader.py::DeepseekV2WeightLoaderMixin."
                       "do_load_weights, glm4_moe.py::Glm4MoeForCausalLM.load_weights and glm4_moe_lite.py::"
                       "Glm4MoeLiteForCausalLM.load_weights skip shared_head.head and "
                       "embed_tokens under the NextN prefix; speculative/eagle_worker_v2.py::EagleDraftWorker."
                       "init_lm_head binds the target's (set_embed_and_head)")

    def built_layers(self, head: MTPHead, algorithm: Optional[str] = "EAGLE") -> int:
        """The head layers SGLang builds and runs for ``head``: :data:`helpers.layers.mtp.SGLANG_BUILT_LAYERS` (1)
        for every family, whatever the config declares (0, absent or several; a DeepSeek / GLM config declaring
        another count is refused before this is asked). Draft steps past it rerun that layer. A family whose head is
        built once per draft step (:attr:`helpers.layers.mtp.MTPFamily.sglang_layer_per_step`, Step-3.5: multi-layer
        EAGLE) has as many trained layers as the config declares; more steps than that find no head layer.

        ``algorithm``: ``--speculative-algorithm`` as typed (:meth:`helpers.layers.mtp.MTPFamily.per_step_on_sglang`;
        default EAGLE, the algorithm of the per-step families' published commands, for an attached server whose
        flag is not at hand)."""
        if head.family.per_step_on_sglang(algorithm):
            return head.layers or 0
        return SGLANG_BUILT_LAYERS

    def head_prefixes(self, head: MTPHead, algorithm: Optional[str] = "EAGLE") -> list[str]:
        """The checkpoint prefixes this engine reads ``head`` from (SGLang: one, :meth:`MTPHead.sglang_prefixes`; a
        family built once per draft step under ``algorithm`` (as in :meth:`built_layers`), Step-3.5 / MiMo-V2 with
        EAGLE: one per declared layer, each read by the step of its index)."""
        fam = head.family
        if fam.per_step_on_sglang(algorithm) and head.layers:
            return [fam.sglang_prefix(head.num_hidden_layers or 0, i) for i in range(min(head.layers, MAX_MTP_LAYERS))]
        return head.sglang_prefixes()

    def weights(self, head: MTPHead, names: set[str], prefixes: list[str], findings: list, facts: dict) -> None:
        """``mtp_weights_missing`` for the head's tensors absent from ``names`` under ``prefixes`` (appended to
        ``findings``; ``facts["head_weights"]`` says what was looked for)."""
        self._weights(head, names, prefixes, findings, facts, f"{self.label}'s {head.family.head_arch}",
                      head.family.sglang_loader)

    def effect_of(self, missing: list[str]) -> str:
        """What the engine serves or refuses for these missing tensors (SGLang: :func:`sglang_missing_effect` of
        each, grouped); the one line of :attr:`missing_effect` for an engine that refuses them."""
        by: dict[str, list[str]] = {}
        for m in missing:
            label = m.rsplit(".", 1)[0].split(".", 3)[-1]
            if label.isdigit():                  # a flat indexed name (ERNIE-4.5: model.mtp_emb_norm.0.weight)
                label = m.rsplit(".", 1)[0].removeprefix("model.")
            by.setdefault(sglang_missing_effect(m), []).append(label)
        return (self.missing_effect + "; served as: " + "; ".join(
            f"{', '.join(v[:4])}{' ...' if len(v) > 4 else ''} -> {k}" for k, v in by.items()))

    def _weights(self, head: MTPHead, names: Optional[set[str]], prefixes: list[str], findings: list, facts: dict,
                 who: str, source: str) -> None:
        fam = head.family
        if names is None:
            facts["head_weights"] = "not checked (no index or safetensors at hand)"
            return
        miss = missing_tensors(prefixes, fam.head_tensors, fam.layer_tensors, names, head.expected)
        facts["head_weights"] = {"prefixes": prefixes, "missing": miss}
        if miss:
            flat = [m for ms in miss.values() for m in ms]
            ref = fam.refusal(self.label)
            refused = ref is not None and (ref.when == "any_missing" or not _any_head_tensor(fam, prefixes, names))
            extra = {"refused": ref.error} if refused else {}
            effect = (f"{self.label} refuses to start: {ref.error} ({ref.source})" if refused else
                      self.effect_of(flat))
            findings.append(D.finding(
                "mtp_weights_missing", None,
                f"{who} reads the head from {', '.join(prefixes)}*, but the checkpoint has no "
                f"{', '.join(flat[:6])}{' ...' if len(flat) > 6 else ''} ({len(flat)} tensor(s)): {effect}",
                engine=f"{self.label} {self.version}", prefixes=prefixes, missing=miss, **extra,
                tensors_in_checkpoint=len(names), source=ref.source if refused else source,
                fix="serve a checkpoint that ships the head (the target's full release, or a separate NextN checkpoint "
                    "passed as the draft path), or rename its tensors to the prefix this engine reads"))

    def _settings(self, head: MTPHead, spec: MTPSpec, tarch: Optional[str], findings: list, notes: list,
                  facts: dict, names: Optional[set[str]] = None) -> None:
        fam = head.family
        auto = spec.num_steps is None and spec.topk is None and spec.num_draft_tokens is None
        steps, topk, ndt = (AUTO_PARAMS_BY_ARCH.get(tarch or "", AUTO_PARAMS_DEFAULT) if auto else
                            (spec.num_steps, spec.topk, spec.num_draft_tokens))
        if not auto and (steps is None or topk is None):
            raise BadInput("give --speculative-num-steps and --speculative-eagle-topk together (SGLang 0.5.23 asserts "
                           "that topk and draft tokens are unset when steps is: speculative_hook.py::"
                           "_handle_eagle_family)", field="--speculative-num-steps")
        eff_ndt = steps + 1 if topk == 1 else (ndt if ndt is not None else steps + 1)
        facts["settings"] = {"num_steps": steps, "topk": topk, "num_draft_tokens": eff_ndt,
                             "requested": {"num_steps": spec.num_steps, "topk": spec.topk,
                                           "num_draft_tokens": spec.num_draft_tokens},
                             "rule": f"{_HOOK}::_handle_eagle_family"
                                     + (" -> _auto_choose_speculative_params l. 1430-1461" if auto else "")}
        if auto:
            notes.append(f"no --speculative-num-steps / topk / draft tokens: SGLang picks ({steps}, {topk}, {eff_ndt}) "
                         f"for {tarch} ({_HOOK}::_auto_choose_speculative_params l. 1430-1461)")
        srv = ServerSettings(algorithm="EAGLE", num_steps=steps, topk=topk, num_draft_tokens=eff_ndt,
                             requested={"speculative_algorithm": spec.algorithm or "NEXTN",
                                        "speculative_num_steps": spec.num_steps, "speculative_eagle_topk": spec.topk,
                                        "speculative_num_draft_tokens": spec.num_draft_tokens})
        findings += D.detect_num_draft_tokens_overridden(srv)
        trained = self.built_layers(head, spec.algorithm or "NEXTN")
        declared = ("absent" if head.layers is None else f"{head.layers}") + (
            " (config class default)" if head.layers_defaulted else "")
        if fam.per_step_on_sglang(spec.algorithm):
            self._per_step_refusals(head, steps, topk, eff_ndt, findings, names)
        elif steps > trained:
            findings.append(D.finding(
                "mtp_steps_beyond_head", None,
                f"{steps} draft steps with the {trained} head layer SGLang builds ({fam.layers_field} {declared}): "
                f"SGLang runs its one {fam.head_arch} layer {steps} times, steps 2-{steps} on the hidden state the "
                f"head itself produced, where it was trained on the target's: what those steps keep of acceptance is "
                "not known from the configs",
                engine=f"{self.label} {self.version}", num_steps=steps, head_layers=trained, layers_loaded=trained,
                layers_declared=head.layers,
                source=f"{STEPS_RULE}; {fam.head_file}",
                fix=f"--speculative-num-steps {trained} --speculative-eagle-topk 1 --speculative-num-draft-tokens "
                    f"{trained + 1}, or measure acceptance per draft position (P(accepted >= j)) before keeping "
                    f"{steps} steps"))

    def _per_step_refusals(self, head: MTPHead, steps: int, topk: int, ndt: int, findings: list,
                           names: Optional[set[str]] = None) -> None:
        """``mtp_head_refused`` for a head SGLang builds once per draft step (multi-layer EAGLE,
        :attr:`helpers.layers.mtp.MTPFamily.sglang_layer_per_step`): more steps than head layers (the draft model of
        step ``i`` reads head layer ``i``; past the declared layers none of its parameters is filled and the family's
        refusal fires), or draft tokens other than steps + 1 (``sglang/srt/speculative/multi_layer_eagle_worker_v2.py``
        l. 150-154: AssertionError "multi-layer EAGLE requires speculative_num_draft_tokens == speculative_num_steps +
        1"). A family with no refusal (MiMo-V2: the loader checks nothing) starts with those steps' head parameters
        at their initial values: ``mtp_steps_beyond_head`` when the tensor names are not at hand (with them, the
        weights check names what is missing)."""
        fam, who = head.family, f"{self.label} {self.version}"
        layers = head.layers or 0
        ref = fam.refusal(self.label)
        if steps > layers and ref is None:
            if names is None:
                findings.append(D.finding(
                    "mtp_steps_beyond_head", None,
                    f"{steps} draft steps with {fam.layers_field} {'absent' if head.layers is None else layers}: "
                    "SGLang "
                    f"builds one {fam.head_arch} per step (multi-layer EAGLE), step i reading head layer i; steps "
                    f"{layers + 1}-{steps} read {fam.sglang_prefix(head.num_hidden_layers or 0, layers)}* and past, "
                    "outside the declared head layers: if the checkpoint lacks them SGLang starts anyway with those "
                    "steps' head parameters at their initial values (nothing checks the load); the tensor names "
                    "(the model folder's index) decide",
                    engine=who, num_steps=steps, head_layers=layers, layers_declared=head.layers,
                    layers_loaded=layers, source=fam.sglang_loader,
                    fix=(f"--speculative-num-steps {layers} --speculative-eagle-topk 1 --speculative-num-draft-tokens "
                         f"{layers + 1}" if layers else "serve this target without speculative decoding")))
        elif steps > layers:
            findings.append(D.finding(
                "mtp_head_refused", None,
                f"{steps} draft steps with {fam.layers_field} {'absent' if head.layers is None else layers}: SGLang "
                f"builds one {fam.head_arch} per step (multi-layer EAGLE), step i reading head layer i; step "
                f"{layers + 1} reads {fam.sglang_prefix(head.num_hidden_layers or 0, layers)}*, outside the declared "
                f"head layers, so none of its parameters is filled and the loader raises "
                f"{ref.error if ref else 'an error'} at start-up",
                engine=who, num_steps=steps, head_layers=layers, layers_declared=head.layers,
                error=ref.error if ref else None, source=f"{fam.sglang_loader}; {ref.source if ref else ''}",
                fix=(f"--speculative-num-steps {layers} --speculative-eagle-topk 1 --speculative-num-draft-tokens "
                     f"{layers + 1}" if layers else "serve this target without speculative decoding (it declares no "
                     "MTP layer)")))
            return
        if ndt != steps + 1:
            findings.append(D.finding(
                "mtp_head_refused", None,
                f"--speculative-num-draft-tokens {ndt} with {steps} steps (topk {topk}): SGLang's multi-layer EAGLE "
                f"worker for {fam.head_arch} asserts speculative_num_draft_tokens == speculative_num_steps + 1 at "
                "start-up (AssertionError)",
                engine=who, num_steps=steps, topk=topk, num_draft_tokens=ndt,
                error='AssertionError("multi-layer EAGLE requires speculative_num_draft_tokens == '
                      'speculative_num_steps + 1, ...")',
                source="sglang/srt/speculative/multi_layer_eagle_worker_v2.py l. 150-154",
                fix=f"--speculative-eagle-topk 1 --speculative-num-draft-tokens {steps + 1}"))


def _head_or_refusal(draft_raw: dict, target_raw: dict, draft_is_target: bool, rules: MTPRules,
                     findings: list, path: Path) -> Optional[MTPHead]:
    """The head of the draft config (``path``), or None with ``mtp_head_refused`` when the target has no MTP family
    SGLang / vLLM rewrite into a head class.

    Raises:
        BadInput: a layer field of the wrong type or range (:func:`helpers.formats.configs.read_mtp_head`)."""
    head = read_mtp_head(draft_raw, path)
    if head is not None:
        return head.as_read_by(rules.label)
    arch = (draft_raw.get("architectures") or [None])[0]
    inner = (text_config(draft_raw).get("architectures") or [None])[0] if text_config(draft_raw) is not draft_raw \
        else None
    findings.append(D.finding(
        "mtp_head_refused", None,
        f"{'the target' if draft_is_target else 'the draft'} {arch} is no MTP / NextN family {rules.label} "
        f"{rules.version} serves a head of: its draft rewrite reads architectures[0] only"
        + (f" (the text config's {inner} is one, but the wrapper is not rewritten)" if family_of([inner]) else "")
        + f"; families read: {', '.join(a for f in MTP_FAMILIES for a in f.target_archs)}",
        engine=f"{rules.label} {rules.version}", architecture=arch, source=REWRITE,
        fix="serve the target without NEXTN, or with an EAGLE-3 draft"))
    return None


def check_mtp(draft_config: str | Path, target_config: str | Path, *, spec: MTPSpec = MTPSpec(),
              rules: Optional[MTPRules] = None) -> StaticReport:
    """The config-only check of an MTP / NextN deployment (module docstring): ``diagnose --draft-config D
    --target-config T`` where D is the target itself (the head is its extra layer) or a separate NextN checkpoint.

    Args:
        draft_config / target_config: a config.json or its folder (a folder's ``model.safetensors.index.json`` or
            ``*.safetensors`` headers give the tensor names; no weights are read).
        spec: the settings asked for (:class:`MTPSpec`).
        rules: the engine's :class:`MTPRules` (default SGLang 0.5.23's).

    Returns:
        :class:`helpers.diagnosis.static.StaticReport` with no plans (an MTP head takes no aux hidden states), the
        findings, notes as advisories, and ``draft_checks = {"facts", "notes"}``.

    Raises:
        BadInput: unreadable configs or index; steps given without topk; a layer field of the wrong type or range
            (:func:`helpers.formats.configs.read_mtp_head`: ``num_nextn_predict_layers`` 0-64, ``num_hidden_layers``
            positive).
    """
    rules = rules or MTPRules()
    dfile, tfile = _config_file(draft_config), _config_file(target_config)
    draft_raw, target_raw = read_config_json(dfile, "draft config"), read_config_json(tfile, "target config")
    same = dfile.resolve() == tfile.resolve() or draft_raw == target_raw
    findings: list[dict] = []
    notes: list[str] = []
    facts: dict = {"engine": f"{rules.label} {rules.version}"}
    head = _head_or_refusal(draft_raw, target_raw, same, rules, findings, dfile)
    inputs = {"draft": f"{dfile}" + (" (the target's config: the head is its extra layer)" if same else ""),
              "target": str(tfile), "engine": f"{rules.label} {rules.version}"}
    if head is not None:
        names, where = weight_names(Path(draft_config))
        inputs["draft weights"] = where
        fam = head.family
        facts["head"] = {"family": fam.name, "form": head.form, "layers_field": fam.layers_field,
                         "layers": head.layers, "num_hidden_layers": head.num_hidden_layers}
        facts["head"]["layers_defaulted"] = head.layers_defaulted
        facts["head"]["num_hidden_layers_defaulted"] = head.hidden_layers_defaulted
        if head.hidden_layers_defaulted:
            notes.append(f"num_hidden_layers is not in the config: the config class's default {head.num_hidden_layers} "
                         "applies (transformers 5.19, the class both engines load the config with), so the head sits "
                         f"at model.layers.{head.num_hidden_layers}.")
        if head.layers_defaulted:
            notes.append(f"{fam.layers_field} is not in the config: the config class's default {head.layers} applies "
                         "(transformers 5.19, the class both engines load the config with)")
        inputs["mtp head"] = (f"{fam.name} family, {fam.layers_field} = {head.layers}"
                              f"{' (config class default)' if head.layers_defaulted else ''}, "
                              + ("the target's extra layer" if head.form == "target" else
                                 "a separate NextN checkpoint"))
        rules.check(head, spec, target_raw, names, same, findings, notes, facts)
        if names is not None and Path(target_config).is_dir():
            from .mtp_weights import own_copy_findings  # lazy: torch; only a folder with the tensors needs it
            try:
                findings += own_copy_findings(head, Path(draft_config), Path(target_config), rules, facts,
                                              rules.head_prefixes(head, spec.algorithm or "NEXTN"))
            except BadInput as e:
                facts["own_copies"] = f"not compared: {e}"
        loads = facts.get("loads")
        if loads:
            inputs[f"{rules.label} loads"] = (f"{loads['class']} ({loads['file']}) from {loads['from']}, tensors "
                                             f"under {', '.join(loads['prefixes'])}*; {loads['draft_path']}")
        if facts.get("settings"):
            s = facts["settings"]
            inputs["settings as run"] = (f"algorithm {facts['algorithm']['as_run']}, steps {s['num_steps']}, topk "
                                         f"{s['topk']}, draft tokens {s['num_draft_tokens']}")
    verdict = "mismatch" if findings else "ok"
    if head is not None and head.layers == 0 and not findings and not isinstance(facts.get("head_weights"), dict):
        # the config declares no MTP layer, yet the engine builds one and starts: only the checkpoint's tensors say
        # whether a trained head is there, and they were not at hand (never ok: undecided)
        verdict = "ambiguous"
        notes.append(f"{head.family.layers_field} is 0 and {rules.label} builds {rules.built_layers(head)} head "
                     "layer anyway: whether the checkpoint holds a trained head is undecided without its tensor "
                     "names (pass the model folder with its model.safetensors.index.json)")
    findings = sort_findings(findings)
    return StaticReport(verdict=verdict, findings=findings, served_plan=None,
                        training_plan=None, advisories=list(notes), inputs=inputs,
                        draft_checks={"facts": facts, "notes": notes})


def is_mtp_deployment(draft_config: str | Path, target_config: str | Path, algorithm: Optional[str]) -> bool:
    """Whether ``diagnose --draft-config D --target-config T`` is about an MTP / NextN head: D is a family's target or
    head config (:func:`helpers.layers.mtp.mtp_head`), or the algorithm is NEXTN and D is the target itself."""
    dfile = _config_file(draft_config)
    draft_raw = read_config_json(dfile, "draft config")
    if read_mtp_head(draft_raw, dfile) is not None:
        return True
    return (algorithm or "").upper() == "NEXTN"


def engine_head_layers(draft_dir: Path, rules: MTPRules, algorithm: Optional[str] = "EAGLE") -> Optional[int]:
    """The head layers ``rules``' engine builds for the MTP / NextN head whose config.json is in ``draft_dir``
    (:meth:`MTPRules.built_layers`: SGLang 0.5.23 one for every family whatever the config declares, vLLM 0.32.0
    ``n_predict`` or its head class's fixed count): the depth draft steps run before they reuse a layer, which the live
    investigation takes as the trained depth when no training log says. None when the folder's config is no MTP head.
    ``algorithm``: SGLang's ``--speculative-algorithm`` as typed (:meth:`MTPRules.built_layers`).

    Raises:
        BadInput: an unreadable config.json, a layer field of the wrong type or range
            (:func:`helpers.formats.configs.read_mtp_head`)."""
    f = _config_file(draft_dir)
    head = read_mtp_head(read_config_json(f, "draft config"), f)
    return None if head is None else rules.built_layers(head.as_read_by(rules.label), algorithm)


def describe_head(draft_dir: Path, target_dir: Path, info: dict) -> Optional[dict]:
    """What an attached server runs as its draft when that is an MTP / NextN head (None otherwise): the family, the
    draft's source, and the effective spec config (algorithm as requested and as run, steps, topk, draft tokens,
    from ``/server_info`` and its ``launch_command``: :class:`helpers.server.settings.ServerSettings`; ``overrides``:
    what the engine changed silently, :func:`helpers.server.settings.detect_overrides`)."""
    try:
        raw = read_config_json(_config_file(draft_dir), "draft config")
        head = read_mtp_head(raw, _config_file(draft_dir))
    except BadInput:
        return None
    if head is None:
        return None
    same = Path(draft_dir).resolve() == Path(target_dir).resolve()
    srv = ServerSettings.from_dict(info, source="/server_info")
    fam = head.family
    try:
        tarch = (read_config_json(_config_file(target_dir), "target config").get("architectures") or [None])[0]
    except BadInput:
        tarch = None
    overrides = [o.model_dump() for o in detect_overrides(srv.requested, info, target_arch=tarch)]
    return {"kind": "mtp", "family": fam.name, "class": fam.head_arch, "file": fam.head_file,
            "layers_field": fam.layers_field, "layers": head.layers,
            "source": (f"the target's NextN layer(s) {', '.join(head.sglang_prefixes())}* in {draft_dir}" if same else
                       f"a separate NextN checkpoint in {draft_dir} ({head.form})"),
            "spec": {"algorithm_requested": srv.requested.get("speculative_algorithm"),
                     "algorithm_as_run": srv.algorithm, "num_steps": srv.num_steps, "topk": srv.topk,
                     "num_draft_tokens": srv.num_draft_tokens,
                     "requested": {k: v for k, v in srv.requested.items() if k.startswith("speculative_")},
                     "overrides": overrides}}
