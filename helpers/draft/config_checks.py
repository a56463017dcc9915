"""Draft checks from the two config.json files alone (issue 27): what SGLang 0.5.23 will make of a draft config
against its target's config, before anyone downloads the weights. One implementation, used by the config-only
``python -m helpers diagnose --draft-config D --target-config T`` (:func:`check_configs`, with the static wiring
check) and by the checkpoint checks (:func:`helpers.draft.checks.inspect_draft`, which adds what needs the tensors).

What a finding means here: SGLang will not run the draft as its config describes it -- it cannot load it
(``unsupported_draft``), refuses to start with the target's context (``max_position_short``), drops a flag the config
sets (``draft_flag_ignored``), attends past a window the config turns on (``sliding_window_ignored``), or builds
another rotary embedding than the config's (``rope_mismatch``). The draft config is the record of how the draft was
trained: SpecForge (``specforge/training/model_loading.py::resolve_draft_config``) and speculators build the
draft's attention from it. Where SGLang runs exactly what the draft config says and that merely differs from the
target's config (another rope theta / type / scaling, another vocab size), it is a **note**: the draft runs its own
rotary embedding over its own KV cache, so it needs the rope it was trained with, not the target's. Each note names
the trainers known to ignore the field, for which the config would not be the record.

What SGLang 0.5.23 does with each field (read in the installed source):

* rope theta / type / scaling: the draft's own, from its config alone. transformers 5 folds ``rope_theta`` and
  ``rope_scaling`` into ``rope_parameters`` (a theta inside ``rope_parameters`` / ``rope_scaling`` wins over the
  top-level one), and ``models/llama.py::LlamaDecoderLayer.__init__`` (l. 322-336) passes its theta and the dict to
  ``get_rope``; a top-level ``original_max_position_embeddings`` replaces the dict's (l. 329-334).
  ``models/kimi_k25_eagle3.py::Eagle3MLADecoderLayer.__init__`` (l. 80-89) reads the same ``rope_parameters``.
  Nothing of the target's rope reaches the draft.
* position limit: ``speculative/eagle_worker_v2.py::EagleDraftWorker.__init__`` (l. 229) builds the draft with the
  target's context length ("the draft runs at absolute target positions");
  ``configs/model_config.py::ModelConfig._derive_context_length`` (l. 1291-1329) compares it with the draft's own
  (``utils/hf_transformers/common.py::get_context_length``: the first of ``max_sequence_length``, ``seq_length``,
  ``max_seq_len``, ``model_max_length``, ``max_position_embeddings`` times the rope ``factor``, which is 1 for
  ``llama3`` or when ``original_max_position_embeddings`` is given) and raises ``ValueError`` at start-up when the
  target's is longer, unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`` (or ``SGLANG_IS_IN_CI``): then it sets
  the draft's ``max_position_embeddings`` to the target's context, so the rotary table covers every position.
* sliding window: ``models/llama.py`` reads no ``sliding_window``; ``llama_eagle3.py::LlamaForCausalLMEagle3.__init__``
  (l. 286-299) sets a window on the draft's attention only from ``--speculative-draft-window-size``.
* vocab sizes, ``tie_word_embeddings``, ``draft_vocab_size``, ``target_hidden_size``: the draft's embedding is
  replaced by the target's (``eagle_worker_v2.py::init_lm_head`` -> ``models/llama.py::set_embed`` l. 910-918, kept
  when ``target_hidden_size`` differs from ``hidden_size``); its lm_head is the embedding (tied), the target's
  (``draft_vocab_size`` absent: ``load_lm_head_from_target``), or its own ``draft_vocab_size`` rows
  (``llama_eagle3.py::LlamaForCausalLMEagle3.__init__`` l. 300-320); the logits are cut to ``draft_vocab_size``
  (``layers/logits_processor.py`` l. 1346-1347).
* flags: ``norm_before_fc`` (``eagle_config`` or top level), ``fc_norm`` / ``use_aux_norm`` and ``norm_output`` (top
  level only), ``norm_before_residual`` (read nowhere): ``llama_eagle3.py::LlamaModel.__init__`` l. 151-207.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Sequence

from ..diagnosis import detectors as D
from ..diagnosis.static import StaticReport, static_check
from ..errors import BadInput
from ..formats.configs import TEXT_CONFIG_KEYS, DraftConfig, TargetConfig, read_draft_config, read_target_config
from ..formats.training_data import TrainingData
from ..kinds import sort_findings
from ..layers.sglang import parse_version
from .mtp_checks import MTPRules, MTPSpec, check_mtp, is_mtp_deployment
from .params import (CONFIG_DEFAULTS, DRAFT_CLASSES, L3, LLAMA_CLASS, SGLANG_RULES, SGLangDraftParams, draft_class,
                     sglang_parameters)

_W2 = "sglang/srt/speculative/eagle_worker_v2.py"
_LLAMA = "sglang/srt/models/llama.py"
_CTX_RULE = (f"{_W2}::EagleDraftWorker.__init__ l. 229 (the draft gets the target's context length); "
             "sglang/srt/configs/model_config.py::ModelConfig._derive_context_length l. 1291-1329 (ValueError at "
             "start-up, or with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 the draft's max_position_embeddings is set "
             "to it); sglang/srt/utils/hf_transformers/common.py::get_context_length")
#: the fields SGLang's get_context_length reads, in its order (``CONTEXT_LENGTH_KEYS``)
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")
#: rope types whose frequencies use ``original_max_position_embeddings``
#: (``sglang/srt/layers/rotary_embedding/factory.py::get_rope``)
_USES_ORIGINAL = ("llama3", "yarn", "deepseek_yarn", "longrope")
#: trainers known to build the draft's rope without the config's theta (the config then is not the record)
THETA_IGNORED_BY = ("SpecForge before PR #270 (2025-10-30; issue #265: every draft rotary embedding at base 10000) "
                    "and SafeAILab EAGLE's eagle/traineagle3/cnets.py::LlamaAttention._init_rope (base 10000, "
                    "rope_scaling read only through its 'type' key)")


@dataclass
class ConfigChecks:
    """Result of :func:`check_draft_config`.

    Attributes:
        findings: finding dicts (``kind``, ``chunk`` None, ``detail``, ``evidence`` with ``source`` = the SGLang
            file::function it follows and the config files and fields it read).
        notes: sentences for what SGLang runs as the config says but a reader should know (each names its rule).
        facts: what the checks rest on: ``architecture``, ``sglang``, ``rope``, ``context_length``,
            ``sliding_window``, ``vocab_sizes``, ``lm_head``, ``embedding``, ``fc`` (those that apply).
    """

    findings: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """``{"findings", "notes", "facts"}``."""
        return {"findings": self.findings, "notes": list(self.notes), "facts": self.facts}


# ------------------------------------------------------------------------------------------- reading the configs

def text_config(raw: dict) -> dict:
    """The text sub-config SGLang reads (``utils/hf_transformers/common.py::get_hf_text_config``: thinker_config >
    llm_config > language_config > text_config), else the config itself."""
    sub = next((k for k in TEXT_CONFIG_KEYS if isinstance(raw.get(k), dict)), None)
    return raw[sub] if sub else raw


def draft_text_config(d: DraftConfig) -> tuple[dict, str]:
    """(the dict holding the draft's attention fields, the prefix naming where it sits): the config itself, or a
    speculators config's ``transformer_layer_config`` (what a conversion to SGLang's layout copies)."""
    if d.form == "speculators" and isinstance(d.raw.get("transformer_layer_config"), dict):
        return d.raw["transformer_layer_config"], "transformer_layer_config."
    return d.raw, ""


def config_defaults(cfg: dict) -> dict:
    """transformers 5.19's class defaults for a config of this ``model_type`` (:data:`helpers.draft.params.
    CONFIG_DEFAULTS`), {} for a type not listed here."""
    return CONFIG_DEFAULTS.get(str(cfg.get("model_type")), {})


def _rope_dict(cfg: dict) -> tuple[dict, str]:
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(key), dict):
            return cfg[key], key
    return {}, ""


def _number(v: Any, path: Optional[Path], field: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise BadInput(f"expected a positive number, got {v!r}", path=path, field=field)
    return float(v)


def effective_rope(cfg: dict, path: Optional[Path] = None, prefix: str = "") -> dict:
    """The rope a (text) config gives SGLang's attention, as transformers 5 loads it: ``{"rope_theta", "rope_type",
    "scaling": {the other keys}, "theta_from": the field it came from, "theta_assumed": bool}``.

    transformers 5 folds ``rope_theta`` / ``rope_scaling`` into ``rope_parameters`` (``rope_parameters`` wins; a theta
    inside the dict wins over the top-level one; legacy ``type`` -> ``rope_type``), and ``models/llama.py::
    LlamaDecoderLayer.__init__`` (l. 322-336) reads theta and scaling from it; a theta given nowhere is the config
    class's default (10000 for LlamaConfig / DeepseekV3Config).

    Raises:
        BadInput: a theta that is not a positive number (``path`` and ``prefix`` name the file and sub-config).
    """
    params, key = _rope_dict(cfg)
    if params.get("rope_theta") is not None:
        theta, src = params["rope_theta"], f"{key}.rope_theta"
    elif cfg.get("rope_theta") is not None:
        theta, src = cfg["rope_theta"], "rope_theta"
    else:
        theta, src = config_defaults(cfg).get("rope_theta", 10000.0), "default"
    theta = _number(theta, path, prefix + src)
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")}
    return {"rope_theta": float(theta), "rope_type": rope_type, "scaling": scaling, "theta_from": src,
            "theta_assumed": src == "default"}


def derived_context(cfg: dict, path: Optional[Path] = None, prefix: str = "") -> dict:
    """SGLang's derived context length of a (text) config (``sglang/srt/utils/hf_transformers/common.py::
    get_context_length``): ``{"value", "field", "given", "factor"}`` -- the first of :data:`CONTEXT_LENGTH_KEYS` set
    (else the config class's ``max_position_embeddings`` default, :func:`config_defaults`; else 2048) times the rope
    scaling ``factor`` (1 for ``llama3`` rope or when ``original_max_position_embeddings`` is given).

    Raises:
        BadInput: a context field or rope factor that is not a positive number (``path`` / ``prefix`` name it).
    """
    params, key_ = _rope_dict(cfg)
    factor = 1
    if params:
        factor = params.get("factor", 1) or 1
        if "original_max_position_embeddings" in params or params.get("rope_type") == "llama3":
            factor = 1
        factor = _number(factor, path, f"{prefix}{key_}.factor")
    for key in CONTEXT_LENGTH_KEYS:
        v = cfg.get(key)
        if v is not None:
            v = _number(v, path, prefix + key)
            return {"value": int(factor * v), "field": key, "given": cfg.get(key), "factor": factor}
    default = config_defaults(cfg).get("max_position_embeddings")
    if default is not None:
        return {"value": int(factor * default), "field": f"max_position_embeddings (absent: {cfg.get('model_type')} "
                                                           f"config class default {default})",
                "given": None, "factor": factor}
    return {"value": 2048, "field": "none (get_context_length's fallback 2048)", "given": None, "factor": factor}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) \
            and not isinstance(b, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9)
    return a == b


def rope_differences(a: dict, b: dict) -> dict:
    """``{field: [a's, b's]}`` where two :func:`effective_rope` results differ (theta, type, each scaling key)."""
    diffs = {}
    if not _same(a["rope_theta"], b["rope_theta"]):
        diffs["rope_theta"] = [a["rope_theta"], b["rope_theta"]]
    if a["rope_type"] != b["rope_type"]:
        diffs["rope_type"] = [a["rope_type"], b["rope_type"]]
    for k in sorted(set(a["scaling"]) | set(b["scaling"])):
        x, y = a["scaling"].get(k), b["scaling"].get(k)
        if not _same(x, y):
            diffs[k] = [x, y]
    return diffs


def declared_window(cfg: dict) -> tuple[Optional[int], str]:
    """(the sliding window a config turns on, how): ``sliding_window`` with ``use_sliding_window: true`` or a
    ``layer_types`` entry ``sliding_attention``; (None, why not) otherwise."""
    w = cfg.get("sliding_window")
    if w is None or isinstance(w, bool) or not isinstance(w, (int, float)):
        return None, "no sliding_window"
    if not math.isfinite(w) or w <= 0:
        return None, f"sliding_window {w!r} is not a window size"
    layer_types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    if cfg.get("use_sliding_window") is True:
        return int(w), "use_sliding_window: true"
    if "sliding_attention" in layer_types:
        return int(w), "layer_types names sliding_attention"
    return None, f"sliding_window {w} with use_sliding_window {cfg.get('use_sliding_window')!r}: not turned on"


# ------------------------------------------------------------------------------------------------- the checks

def _position(d: DraftConfig, dcfg: dict, prefix: str, target: TargetConfig, cls: str, findings: list, notes: list,
              facts: dict) -> None:
    """rope, context length and sliding window of the draft against the target's."""
    tcfg = text_config(target.raw)
    dpath, tpath = str(d.path), str(target.path)
    tprefix = "" if tcfg is target.raw else next(f"{k}." for k in TEXT_CONFIG_KEYS if target.raw.get(k) is tcfg)
    dr, tr = effective_rope(dcfg, d.path, prefix), effective_rope(tcfg, target.path, tprefix)
    dctx, tctx = derived_context(dcfg, d.path, prefix), derived_context(tcfg, target.path, tprefix)
    read = draft_class(cls).rope_read
    # -- the position limit: the draft runs at the target's context (eagle_worker_v2.py l. 229)
    short = dctx["value"] < tctx["value"]
    facts["context_length"] = {
        "draft": dctx["value"], "target": tctx["value"], "draft_field": prefix + dctx["field"],
        "target_field": tctx["field"], "draft_max_position_embeddings": dcfg.get("max_position_embeddings"),
        "target_max_position_embeddings": tcfg.get("max_position_embeddings"), "served": tctx["value"],
        "start": ("refused: ValueError unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 or --context-length <= "
                  f"{dctx['value']}") if short else "ok", "rule": _CTX_RULE}
    if short:
        findings.append(D.finding(
            "max_position_short", None,
            f"the target's context length is {tctx['value']} ({tctx['field']} of {tpath}) and SGLang gives the draft "
            f"that context, but the draft's own is {dctx['value']} ({prefix}{dctx['field']} of {dpath}): SGLang "
            f"{SGLANG_RULES} refuses to start (ValueError \"Target model's context_length ({tctx['value']}) is greater "
            f"than the derived context_length ({dctx['value']})\") unless SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1, "
            f"which raises the draft's max_position_embeddings to {tctx['value']}; or start with --context-length "
            f"{dctx['value']} (which caps the target too). How long the draft's training sequences were is not in "
            "the config: past them acceptance may fall",
            draft_context_length=dctx["value"], target_context_length=tctx["value"],
            draft_field=prefix + dctx["field"], target_field=tctx["field"],
            draft_max_position_embeddings=dcfg.get("max_position_embeddings"),
            target_max_position_embeddings=tcfg.get("max_position_embeddings"),
            draft_config=dpath, target_config=tpath, source=_CTX_RULE,
            fix=f"start with --context-length {dctx['value']}, or set SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 "
                "(and check acceptance past the draft's training length, e.g. with python -m helpers ablate)"))
    elif dctx["value"] > tctx["value"]:
        notes.append(f"the draft's context length {dctx['value']} ({prefix}{dctx['field']}) is longer than the "
                     f"target's {tctx['value']} ({tctx['field']}): SGLang builds the draft with the target's "
                     f"({_W2}::EagleDraftWorker.__init__ l. 229), nothing is refused")
    # -- the rope SGLang builds for the draft: its config's, changed only where SGLang itself changes it
    served = dict(dr, scaling=dict(dr["scaling"]))
    changes = {}
    top_orig = dcfg.get("original_max_position_embeddings")
    if draft_class(cls).top_level_original_max_position and top_orig and served["rope_type"] in _USES_ORIGINAL:
        # transformers 5 keeps rope_parameters' value (filled from max_position_embeddings when absent); llama.py
        # l. 329-334 overwrites it with the top-level one
        own = served["scaling"].get("original_max_position_embeddings", dcfg.get("max_position_embeddings"))
        if not _same(own, top_orig):
            changes["original_max_position_embeddings"] = {
                "config": own, "sglang": top_orig,
                "why": f"{_LLAMA}::LlamaDecoderLayer.__init__ l. 329-334 replaces rope_parameters' "
                       f"original_max_position_embeddings by the top-level one"}
            served["scaling"]["original_max_position_embeddings"] = top_orig
    if short and served["rope_type"] == "longrope" and not {"short_mscale", "long_mscale"} & set(served["scaling"]):
        changes["max_position_embeddings"] = {
            "config": dctx["given"], "sglang": tctx["value"],
            "why": "with SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 SGLang raises the draft's max_position_embeddings "
                   "to the target's context, and longrope's mscale is computed from it (layers/rotary_embedding/"
                   "rope_variant.py::Phi3LongRoPEScaledRotaryEmbedding.__init__)"}
    diffs = rope_differences(dr, tr)
    facts["rope"] = {"draft": dr, "target": tr, "sglang_builds": served, "differs_from_target": diffs,
                     "sglang_changes": changes, "rule": read}
    if changes:
        findings.append(D.finding(
            "rope_mismatch", None,
            "SGLang builds another rotary embedding for the draft than its config describes ("
            + "; ".join(f"{k}: {v['config']!r} in the config, {v['sglang']!r} served -- {v['why']}"
                        for k, v in changes.items())
            + "): the draft sees other positions than in training",
            changes=changes, draft=dr, served=served, draft_config=dpath, source=read,
            fix="write the value SGLang uses into rope_parameters (or drop the top-level field) so the config, the "
                "trainer and SGLang agree"))
    if diffs:
        notes.append(
            "the draft's rope differs from the target's ("
            + ", ".join(f"{k} {a!r} vs {b!r}" for k, (a, b) in diffs.items())
            + f"): SGLang runs the draft with its own config's rope ({read}), never the target's, and the draft "
              "attends over its own KV cache, so what matters is the rope it was trained with; SpecForge and "
              "speculators build it from the draft config, so this is not a fault unless the config was edited "
              "after training"
            + ("" if _same(dr["rope_theta"], 10000.0) else
               f", or the trainer ignored its rope_theta {dr['rope_theta']:g}: {THETA_IGNORED_BY} build the draft's "
               "rope at theta 10000"))
    params, key = _rope_dict(dcfg)
    if key and params.get("rope_theta") is not None and dcfg.get("rope_theta") is not None \
            and not _same(params["rope_theta"], dcfg["rope_theta"]):
        notes.append(f"the draft config names two rope thetas: {prefix}{key}.rope_theta {params['rope_theta']!r}, "
                     f"which transformers 5 and SGLang {SGLANG_RULES} use, and {prefix}rope_theta "
                     f"{dcfg['rope_theta']!r}, which a trainer on transformers 4 reads; if that one trained the "
                     "draft, the served rope differs")
    # -- sliding window: SGLang's Llama draft has none unless --speculative-draft-window-size
    dw, how = declared_window(dcfg)
    tw, _ = declared_window(tcfg)
    facts["sliding_window"] = {"draft": dw, "draft_how": how, "target": tw if tw is not None else
                               tcfg.get("sliding_window"), "served_context": tctx["value"]}
    if dw is not None and draft_class(cls).window_flag_ignored and dw < tctx["value"]:
        findings.append(D.finding(
            "sliding_window_ignored", None,
            f"the draft config turns on a sliding window of {dw} tokens ({prefix}{how}); SGLang's {cls} "
            f"ignores it and attends the whole context (up to {tctx['value']}) unless the server gets "
            f"--speculative-draft-window-size {dw}",
            draft_sliding_window=dw, how=prefix + how, served_context=tctx["value"], draft_config=dpath,
            source=f"{L3}::LlamaForCausalLMEagle3.__init__ l. 286-299 (a window only from "
                   f"--speculative-draft-window-size); {_LLAMA} reads no sliding_window",
            trainers="SpecForge's draft (specforge/modeling/draft/llama3_eagle.py) applies no window either: if it "
                     "trained this draft, serving matches training and the flag should go",
            fix=f"start the server with --speculative-draft-window-size {dw} if the draft was trained with the window, "
                "else remove use_sliding_window from the draft config"))
    elif dcfg.get("sliding_window") is not None and dw is None:
        notes.append(f"the draft config has sliding_window {dcfg.get('sliding_window')!r} but does not turn it on "
                     f"({how}): neither SGLang ({L3} l. 286-299) nor transformers' Llama attention applies it")


def _vocab_sizes(arch: SGLangDraftParams, d: DraftConfig, target: Optional[TargetConfig], hin_differs: bool,
                 notes: list, facts: dict) -> None:
    tv = target.vocab_size if target is not None else None
    facts["vocab_sizes"] = {"draft_vocab_size": d.raw.get("draft_vocab_size"), "vocab_size": arch.vocab,
                            "target_vocab_size": tv, "logits_cut_to": arch.draft_vocab,
                            "rule": f"{L3}::LlamaForCausalLMEagle3.__init__ l. 300-320; sglang/srt/layers/"
                                    "logits_processor.py l. 1346-1347 (logits[:, :vocab_size])"}
    if tv is None or arch.vocab == tv:
        return
    if hin_differs:
        notes.append(f"the draft's vocab_size {arch.vocab} differs from the target's {tv} and target_hidden_size "
                     f"differs from hidden_size, so SGLang keeps the draft's own {arch.vocab}-row embedding "
                     f"({_LLAMA}::set_embed l. 910-918): target token ids at or above {arch.vocab} have no row")
    elif arch.lm_from_target:
        notes.append(f"draft_vocab_size is absent, so SGLang borrows the target's lm_head and cuts the logits to the "
                     f"draft's vocab_size {arch.vocab} (the target's is {tv}; {L3} l. 305-308, logits_processor.py "
                     "l. 1346-1347)" + (f": target ids at or above {arch.vocab} can never be drafted"
                                        if arch.vocab < tv else ""))
    else:
        notes.append(f"the draft's vocab_size {arch.vocab} differs from the target's {tv}: SGLang replaces the draft's "
                     f"embedding by the target's ({_W2}::init_lm_head -> {_LLAMA}::set_embed), so the draft's own "
                     "size only sizes a table that is dropped; its drafted ids are mapped to target ids by d2t")


def lm_head_plan(arch: SGLangDraftParams, target_raw: Optional[dict], hin_differs: bool) -> dict:
    """Where SGLang takes the draft's lm_head from, from the configs alone: ``{"from": "embedding" | "target" |
    "checkpoint", "source", "rows", "rule"}`` (``checkpoint``: whether the draft holds it needs the weights,
    :func:`helpers.draft.checks.inspect_draft`)."""
    target_ties = None if target_raw is None else bool(text_config(target_raw).get(
        "tie_word_embeddings", target_raw.get("tie_word_embeddings", False)))
    if arch.tie:
        src = ("the draft's own embed_tokens.weight (target_hidden_size differs from hidden_size: set_embed keeps "
               "the draft's)" if hin_differs else "the target's input embedding (tie_word_embeddings: lm_head is "
               "the draft's embed_tokens, which init_lm_head -> set_embed replaces by the target's)")
        return {"from": "embedding", "source": src, "rows": arch.vocab,
                "rule": f"{L3} l. 303-304; {_W2} l. 356-363; {_LLAMA}::set_embed l. 910-918"}
    if arch.lm_from_target:
        head = ("the target's lm_head.weight" if target_ties is False else
                "the target's input embedding (the target ties its lm_head to it)" if target_ties else
                "the target's lm_head.weight (its embedding if the target ties them; no target config given)")
        return {"from": "target", "source": head, "rows": arch.vocab,
                "rule": f"{L3} l. 305-308 (draft_vocab_size absent -> load_lm_head_from_target); "
                        f"{_W2}::init_lm_head l. 356-361 (set_embed_and_head)"}
    return {"from": "checkpoint", "source": "the draft checkpoint's lm_head.weight (draft_vocab_size rows)",
            "rows": arch.draft_vocab, "rule": f"{L3} l. 309-314, load_weights l. 370-378"}


def _flags(arch: SGLangDraftParams, d: DraftConfig, findings: list) -> None:
    raw = d.raw
    ec = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    ignored = []
    nbr = raw.get("norm_before_residual", ec.get("norm_before_residual"))
    if nbr:
        ignored.append({"flag": "norm_before_residual", "value": nbr,
                        "effect": "SGLang always adds the un-normalised hidden state as the residual of the first "
                                  "layer (a draft trained with norm_before_residual adds the normalised one)",
                        "rule": f"{L3}::LlamaDecoderLayer.forward l. 97-102 (residual = hidden_states before "
                                "hidden_norm); no SGLang file reads norm_before_residual"})
    for flag in ("fc_norm", "use_aux_norm", "norm_output"):
        if ec.get(flag) and not raw.get(flag):
            line = "l. 185-187" if flag != "norm_output" else "l. 207"
            ignored.append({"flag": f"eagle_config.{flag}", "value": ec.get(flag),
                            "effect": f"SGLang reads {flag} only at the top level of the config",
                            "rule": f"{L3}::LlamaModel.__init__ {line} (getattr(config, '{flag}'))"})
    dc = draft_class(arch.cls)
    if not dc.has_input_norm and bool(ec.get("norm_before_fc", raw.get("norm_before_fc", False))):
        ignored.append({"flag": "norm_before_fc", "value": True,
                        "effect": f"{dc.name} has no input_norm: the concatenated aux states reach fc unnormalised",
                        "rule": f"{dc.module}::Eagle3MLAModel.__init__ l. 191-255"})
    if ignored:
        findings.append(D.finding(
            "draft_flag_ignored", None,
            "SGLang ignores draft config flag(s) " + ", ".join(f"{x['flag']}={x['value']!r}" for x in ignored)
            + ": the draft runs without what they ask for -- " + "; ".join(x["effect"] for x in ignored),
            flags=ignored, config=str(d.path)))


def check_draft_config(d: DraftConfig, target: Optional[TargetConfig] = None,
                       sglang_version: str = SGLANG_RULES) -> ConfigChecks:
    """The config-only draft checks (module docstring): architecture, flags, fc / lm_head / vocab facts, and with a
    target its position encoding (rope, context length, sliding window).

    Args:
        d: the draft config (:func:`helpers.formats.configs.read_draft_config`).
        target: the target config (:func:`helpers.formats.configs.read_target_config`), or None (no position checks).
        sglang_version: the server's SGLang; the rules are those of 0.5.23 (``facts["sglang"]["note"]`` says so when
            it differs).

    Returns:
        :class:`ConfigChecks`. For a draft SGLang cannot load (``unsupported_draft``), the position checks still run
        on its attention fields (a speculators config's ``transformer_layer_config``) and their findings become
        notes ("once converted to SGLang's layout ...").

    Raises:
        BadInput: an unreadable version string; a draft config SGLang cannot build (a field of the wrong type,
            ``target_hidden_size: null``, an MLA draft with more than one layer: :func:`helpers.draft.params.
            sglang_parameters`).
    """
    try:
        parse_version(sglang_version)
    except (ValueError, TypeError):
        raise BadInput(f"cannot read an X.Y.Z version from {sglang_version!r}", field="sglang_version") from None
    out = ConfigChecks()
    out.facts["sglang"] = {"given": sglang_version, "rules": SGLANG_RULES,
                           "note": None if parse_version(sglang_version) == parse_version(SGLANG_RULES)
                           else f"rules read from SGLang {SGLANG_RULES}'s source; {sglang_version} may differ"}
    out.facts["architecture"] = d.architectures
    unsupported = D.detect_unsupported_draft(d)
    out.findings += unsupported
    dcfg, prefix = draft_text_config(d)
    if unsupported:
        if target is not None:
            found: list[dict] = []
            _position(d, dcfg, prefix, target, LLAMA_CLASS, found, out.notes, out.facts)
            out.notes += [f"once converted to SGLang's layout ({LLAMA_CLASS}): [{f['kind']}] {f['detail']}"
                          for f in found]
        return out
    arch = sglang_parameters(d)
    hin_differs = "target_hidden_size" in d.raw and arch.hidden_size_in != d.hidden_size
    out.facts["fc"] = {"in_features": arch.hidden_size_in * arch.num_aux, "hidden_size_in": arch.hidden_size_in,
                       "num_aux": arch.num_aux, "norm_before_fc": arch.norm_before_fc, "fc_norm": arch.fc_norm,
                       "norm_output": arch.norm_output, "class": arch.cls, "config_defaults": arch.defaulted,
                       "rule": arch.source}
    out.facts["embedding"] = ("the draft's own embed_tokens.weight (target_hidden_size differs from hidden_size: "
                              f"{_LLAMA}::set_embed l. 912-916 keeps it)" if hin_differs else
                              f"the target's input embedding ({_W2}::init_lm_head -> set_embed)")
    out.facts["lm_head"] = lm_head_plan(arch, None if target is None else target.raw, hin_differs)
    _flags(arch, d, out.findings)
    _vocab_sizes(arch, d, target, hin_differs, out.notes, out.facts)
    if target is not None:
        _position(d, dcfg, prefix, target, arch.cls, out.findings, out.notes, out.facts)
    out.findings = sort_findings(out.findings)
    return out


# ------------------------------------------------------------------------------------------ config-only diagnose

def check_configs(draft_config: str | Path, target_config: str | Path, *, training: Optional[str | Path] = None,
                  sglang_version: Optional[str] = None, algorithm: Optional[str] = None,
                  trained_layer_ids: Optional[Sequence[int]] = None, spec: Optional[MTPSpec] = None,
                  mtp_rules: Optional[MTPRules] = None, loader: Any = None) -> StaticReport:
    """The config-only check of ``python -m helpers diagnose --draft-config D --target-config T`` (no tensors
    compared): the static wiring check (:func:`helpers.diagnosis.static.static_check`, with the training data's
    manifest and layout when ``training`` is given) and the draft config checks (:func:`check_draft_config`), in one
    report: their findings together (verdict ``mismatch`` when any), the notes among the advisories, the draft
    checks' facts under ``draft_checks``.

    Args:
        draft_config / target_config: a config.json or a folder holding one (a draft folder's *.safetensors headers
            are read too: fc width, d2t).
        training: training data (its manifest and layout only).
        sglang_version: the server's SGLang (default 0.5.23, said in the report).
        algorithm: ``--speculative-algorithm`` (default EAGLE3).
        trained_layer_ids: the ids training used, SpecForge out(i).
        spec: the speculative settings asked for (steps, topk, draft tokens; its algorithm wins over
            ``algorithm``).
        mtp_rules: the engine's rules for an MTP / NextN head (``LoaderRules.mtp_rules()``; default SGLang 0.5.23's).
        loader: the serving engine's draft loader rules (``EngineAdapter.loader_rules``: ``diagnose --engine``): the
            EAGLE-3 checks follow its ``plan_rules`` (the served plan: a speculators-format draft read as vLLM reads
            it, :func:`helpers.formats.speculators.vllm_view`) and its ``config_checks``, an MTP head its
            ``mtp_rules``; None: SGLang 0.5.23's.

    An MTP / NextN deployment (the draft config is a family's target or head config, or the algorithm is NEXTN:
    :func:`helpers.draft.mtp_checks.is_mtp_deployment`) is checked by :func:`helpers.draft.mtp_checks.check_mtp`
    instead: it takes no aux hidden states, so the wiring check does not apply.

    Raises:
        BadInput: unreadable configs, weights or training data; a draft config SGLang cannot build; ``mtp_rules``
            given for a draft that is no MTP head (the other checks follow SGLang's rules only).
    """
    spec = spec or MTPSpec(algorithm=algorithm)
    algorithm = spec.algorithm or algorithm
    if is_mtp_deployment(draft_config, target_config, algorithm):
        return check_mtp(draft_config, target_config, spec=spec,
                         rules=mtp_rules or (loader.mtp_rules() if loader is not None else None))
    if mtp_rules is not None:
        raise BadInput("mtp_rules apply to MTP / NextN heads only: pass the engine's loader rules (loader) for an "
                       "EAGLE-3 draft", field="--engine")
    td = TrainingData(training, max_samples=1) if training is not None else None
    rep = static_check(draft_config, target_config, sglang_version=sglang_version, algorithm=algorithm,
                       training=td, trained_layer_ids=trained_layer_ids,
                       rules=loader.plan_rules() if loader is not None else None)
    if (algorithm or "EAGLE3").upper() != "EAGLE3":
        note = (f"draft config checks not run: they follow SGLang's EAGLE-3 draft classes ({', '.join(DRAFT_CLASSES)}) "
                f"and the algorithm is {algorithm}")
        return replace(rep, advisories=list(rep.advisories) + [note], draft_checks={"facts": {}, "notes": [note]})
    dc, tc = read_draft_config(draft_config), read_target_config(target_config)
    cc = loader.config_checks(dc, tc) if loader is not None else check_draft_config(dc, tc,
                                                                                    sglang_version or SGLANG_RULES)
    have = {f["kind"] for f in rep.findings}
    findings = sort_findings(rep.findings + [f for f in cc.findings
                                             if not (f["kind"] == "unsupported_draft" and f["kind"] in have)])
    verdict = "mismatch" if findings else rep.verdict
    return replace(rep, verdict=verdict, findings=findings, advisories=list(rep.advisories) + cc.notes,
                   draft_checks={"facts": cc.facts, "notes": cc.notes})
