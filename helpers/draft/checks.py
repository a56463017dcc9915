"""Draft checks that need no server (issue 18, deliverable 5): what SGLang 0.5.23 will make of a draft checkpoint.

Each check follows a line of SGLang's loader, read from the installed source (``sglang/srt/...``, 0.5.23):

* the lm_head: the draft's own, borrowed (``tie_word_embeddings`` -> the embedding, which the worker replaces by the
  target's; ``draft_vocab_size`` absent -> the target's head), or left uninitialised
  (``models/llama_eagle3.py::LlamaForCausalLMEagle3.__init__`` l. 300-314, ``load_weights`` l. 370-378,
  ``speculative/eagle_worker_v2.py::EAGLEWorkerV2.init_lm_head`` l. 336-379, ``models/llama.py::set_embed`` l. 910-918);
* the vocab map d2t: missing, trivial (all zeros), out of range, or unlike the training data's
  ``vocab_mapping/*.pt`` (``load_weights`` l. 350-356: ``hot_token_id = d2t + arange``; ``eagle_worker_v2.py``
  l. 757-758: ``topk_index = hot_token_id[topk_index]``), and the share of the user's target tokens outside the
  draft vocab (a token outside can never be drafted: a ceiling on acceptance);
* from the configs alone (:mod:`helpers.draft.config_checks`, the same code as the config-only ``diagnose``): the
  architecture, the flags SGLang ignores, the rope / context length / sliding window against the target's, where the
  lm_head and embedding come from;
* fc / norm flags against the tensors present: every parameter SGLang builds from the config
  (``llama_eagle3.py::LlamaModel.__init__`` l. 151-207, ``LlamaDecoderLayer.__init__`` l. 46-86) against every tensor
  in the checkpoint, resolved the way ``load_weights`` resolves names (legacy ``midlayer`` / ``aux_norm_*`` names,
  stacked q/k/v and gate/up, the ``model.`` prefix): a shape SGLang cannot load is :class:`helpers.errors.BadInput`
  (``default_weight_loader`` / ``weight_loader`` assert, the server dies at load); a parameter no tensor fills keeps
  its initial value and a tensor no parameter takes is dropped silently -- both are findings.

Only safetensors headers and the small ``d2t`` tensor are read from the draft; from the target only its config.json.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from safetensors import safe_open

from ..diagnosis import detectors as D
from ..diagnosis.plan_rules import PlanRules
from ..errors import BadInput
from ..formats.configs import (
    DraftConfig,
    TensorInfo,
    read_draft_config,
    read_draft_weights,
    read_target_config,
)
from ..formats.dumps import safe_torch_load
from ..formats.training_data import TrainingData
from .config_checks import check_draft_config, lm_head_plan
from .mtp_checks import MTPRules
from .params import (
    INIT_EMPTY,
    K25,
    L3,
    SGLANG_RULES,
    SGLangDraftParams,
    draft_class,
    resolve_name,
    sglang_parameters,
    shape_error,
)

#: a finding when more than this share of the user's target tokens lies outside the draft vocab
OUTSIDE_SHARE_LIMIT = 0.10
#: the order findings are reported in (the draft's own faults first, then its position encoding)
KIND_ORDER = ("unsupported_draft", "lm_head_missing", "lm_head_replaced", "vocab_map_missing", "vocab_map_trivial",
              "vocab_map_differs", "draft_vocab_coverage", "draft_weight_missing", "draft_weight_ignored",
              "draft_flag_ignored", "fc_bypassed", "width_mismatch", "rope_mismatch", "max_position_short",
              "sliding_window_ignored")

_W2 = "sglang/srt/speculative/eagle_worker_v2.py"


# ------------------------------------------------------------------------------------------------ readers

def _read_tensor(info: TensorInfo, key: str) -> torch.Tensor:
    try:
        with safe_open(str(info.file), framework="pt") as sf:
            return sf.get_tensor(key)
    except Exception as e:
        raise BadInput(f"cannot read tensor ({' '.join(str(e).split())[:200]})", path=info.file, field=key) from None


# -------------------------------------------------------------------------------------------- the checks

def _lm_head(arch: SGLangDraftParams, d: DraftConfig, tensors: dict, target_raw: Optional[dict], hin_differs: bool,
             findings: list, facts: dict) -> None:
    lm_keys = [k for k in tensors if re.search(r"(^|\.)lm_head\.weight$", k)]
    used = [k for k in lm_keys if resolve_name(arch, k) == ("lm_head.weight", None)]
    plan = lm_head_plan(arch, target_raw, hin_differs)
    if plan["from"] != "checkpoint":
        facts["lm_head"] = {k: plan[k] for k in ("source", "rows", "rule")}
    if arch.tie:
        src = plan["source"]
        if lm_keys:
            findings.append(D.finding(
                "lm_head_replaced", None,
                f"the checkpoint has its own {lm_keys[0]} {list(tensors[lm_keys[0]].shape)} but tie_word_embeddings "
                f"is true: SGLang uses {src.split(' (')[0]} as lm_head and never loads the trained head",
                tensors=lm_keys, shape=list(tensors[lm_keys[0]].shape), used_instead=src, config=str(d.path),
                source=f"{L3}::LlamaForCausalLMEagle3.__init__ l. 303-304 (lm_head = model.embed_tokens); "
                       f"load_weights l. 370-378 (no lm_head parameter: dropped)",
                fix="set tie_word_embeddings to false (and draft_vocab_size) so the trained lm_head is loaded"))
        return
    if arch.lm_from_target:
        head = plan["source"]
        if used:
            findings.append(D.finding(
                "lm_head_replaced", None,
                f"draft_vocab_size is absent from the draft config, so SGLang loads the checkpoint's {used[0]} and "
                f"then replaces it by {head}: the trained lm_head is not used",
                tensors=used, shape=list(tensors[used[0]].shape), used_instead=head, config=str(d.path),
                source=f"{L3}::LlamaForCausalLMEagle3.__init__ l. 305-308; {_W2}::init_lm_head l. 356-361",
                fix=f"set draft_vocab_size: {tensors[used[0]].shape[0]} in the draft config"))
        return
    if used:
        facts["lm_head"] = {"source": "the draft checkpoint", "tensor": used[0], "rows": arch.draft_vocab,
                            "rule": f"{L3} l. 309-314, load_weights l. 370-378"}
        return
    build = draft_class(arch.cls).lm_head_build
    facts["lm_head"] = {"source": "none: left uninitialised", "rows": arch.draft_vocab,
                        "rule": f"{build} (load_lm_head_from_target only when draft_vocab_size is absent)"}
    unread = f" ({', '.join(lm_keys)} is there, under a name load_weights does not map to lm_head)" if lm_keys else ""
    findings.append(D.finding(
        "lm_head_missing", None,
        f"no lm_head.weight in the draft checkpoint{unread}, tie_word_embeddings false and draft_vocab_size "
        f"{arch.draft_vocab} set: SGLang builds a {arch.draft_vocab} x {d.hidden_size} lm_head, nothing fills it and "
        "it is not borrowed from the target -- the draft's logits are garbage (accept length about 1)",
        draft_vocab_size=arch.draft_vocab, tie_word_embeddings=False, lm_head_keys=lm_keys, config=str(d.path),
        init=INIT_EMPTY,
        source=f"{build}; load_weights (a missing parameter is not an error); {_W2}::init_lm_head l. 356-363 "
               "(set_embed only)",
        fix="add the trained lm_head.weight to the checkpoint, or (full-vocab draft trained on the target's head) "
            "remove draft_vocab_size so SGLang borrows the target's"))


def _find_vocab_mapping(training: Path) -> list[Path]:
    """SpecForge's ``vocab_mapping/*.pt`` beside the training data (the folder, its parent or grandparent), or the
    file itself."""
    if training.is_file() and training.suffix == ".pt":
        return [training]
    folder = training if training.is_dir() else training.parent
    for cand in (folder, folder.parent, folder.parent.parent):
        vm = cand / "vocab_mapping"
        if vm.is_dir():
            files = sorted(vm.glob("*.pt"))
            if files:
                return files
    return []


def _load_mapping(path: Path) -> torch.Tensor:
    doc = safe_torch_load(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("d2t"), torch.Tensor):
        raise BadInput("expected a dict with a d2t tensor (SpecForge vocab_mapping: {'d2t', 't2d'})", path=path,
                       field="d2t")
    t = doc["d2t"]
    if t.dim() != 1 or t.is_floating_point():
        raise BadInput(f"expected a 1-D integer tensor, got {tuple(t.shape)} {t.dtype}", path=path, field="d2t")
    return t.to(torch.int64)


def _vocab(loader: "LoaderRules", d: DraftConfig, tensors: dict, vocab: int, training: Optional[Path],
           findings: list, facts: dict) -> np.ndarray:
    """The d2t checks; returns the target ids the draft can propose (SGLang's hot_token_id, or 0..dv-1)."""
    dv = loader.draft_vocab(d)
    d2t_keys = loader.d2t_keys(d, tensors)
    facts["vocab"] = {"vocab_size": vocab, "draft_vocab_size": dv, "d2t": d2t_keys[0] if d2t_keys else None}
    mapping_files = _find_vocab_mapping(training) if training is not None else []
    if not d2t_keys:
        if dv < vocab:
            facts["vocab"]["map"] = "missing: draft id i is proposed as target id i"
        else:
            facts["vocab"]["map"] = "none needed: the draft drafts over the whole vocabulary"
        return np.arange(min(dv, vocab))
    key = d2t_keys[-1]
    info = tensors[key]
    d2t = _read_tensor(info, key)
    if d2t.dim() != 1 or d2t.is_floating_point():
        raise BadInput(f"expected a 1-D integer tensor, got {list(d2t.shape)} {d2t.dtype}", path=info.file, field=key)
    d2t = d2t.to(torch.int64)
    if d2t.numel() != dv:
        raise BadInput(f"{d2t.numel()} entries but the lm_head has {dv} rows "
                       f"({loader.draft_vocab_field(d)}); {loader.label} maps each drafted id through it "
                       f"({loader.d2t_source}), so it must have {dv}", path=info.file, field=key)
    hot = d2t + torch.arange(dv)
    bad = ((hot < 0) | (hot >= vocab)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise BadInput(f"maps draft id {i} to target id {int(hot[i])}, outside the target vocab [0, {vocab}) "
                       f"({bad.numel()} such entries; target id = draft id + d2t[draft id], {loader.d2t_source})",
                       path=info.file, field=key)
    hot_np = hot.numpy()
    n_unique = int(np.unique(hot_np).size)
    facts["vocab"].update({"map": "d2t", "distinct_target_ids": n_unique})
    if dv < vocab and not bool(d2t.any()):
        facts["vocab"]["map"] = "trivial: all zeros"
        findings.append(D.finding(
            "vocab_map_trivial", None,
            f"d2t is all zeros while the draft vocab ({dv}) is smaller than the target's ({vocab}): {loader.label} "
            f"proposes draft id i as target id i, i.e. only target ids 0..{dv - 1} (the d2t buffer was saved before "
            "the vocab mapping was loaded into it)",
            tensor=key, file=str(info.file), draft_vocab_size=dv, vocab_size=vocab, source=loader.d2t_source,
            fix="write the training run's vocab_mapping d2t into the checkpoint"
                + (f" ({mapping_files[0]})" if mapping_files else "")))
    if mapping_files:
        best = None
        for f in mapping_files:
            t = _load_mapping(f)
            if t.numel() != dv:
                share = 1.0
                only_train = only_draft = None
            else:
                share = float((t != d2t).double().mean())
                th = set((t + torch.arange(dv)).tolist())
                dh = set(hot_np.tolist())
                only_train, only_draft = len(th - dh), len(dh - th)
            if best is None or share < best[1]:
                best = (f, share, t.numel(), only_train, only_draft)
        f, share, n, only_train, only_draft = best
        facts["vocab"].update({"training_mapping": str(f), "differing_share": share})
        if share > 0 and facts["vocab"]["map"] == "d2t":
            detail = (f"the checkpoint's d2t differs from the training data's vocab mapping {f.name} on "
                      f"{share:.1%} of the draft ids" if n == dv else
                      f"the training data's vocab mapping {f.name} has {n} entries, the checkpoint's d2t {dv}")
            findings.append(D.finding(
                "vocab_map_differs", None,
                detail + ": those drafted ids are proposed as other target tokens than the draft was trained on",
                tensor=key, file=str(info.file), training_mapping=str(f), differing_share=share,
                draft_ids=dv, training_entries=n, target_ids_only_in_training=only_train,
                target_ids_only_in_checkpoint=only_draft, candidates=[str(x) for x in mapping_files],
                source=f"{loader.d2t_source}; SpecForge vocab_mapping (d2t, t2d)",
                fix=f"write d2t from {f} into the checkpoint"))
    elif training is not None:
        facts["vocab"]["training_mapping"] = None
    return hot_np


def _tokens(training: Optional[Path], target_tokens: Optional[Sequence[int]], vocab: int,
            hidden_size: Optional[int]) -> Optional[tuple[list[tuple[np.ndarray, np.ndarray]], str]]:
    """[(ids, mask)] sequences: the training data's loss-masked tokens, else the given target tokens."""
    if training is not None:
        seqs = []
        no_mask = False
        td = TrainingData(training, hidden_size=hidden_size)
        for s in td:
            ids = np.asarray(s.input_ids, dtype=np.int64)
            lm = s.meta.get("loss_mask")
            if lm is None:
                no_mask = True
                mask = np.ones_like(ids, dtype=bool)
            else:
                mask = np.asarray(lm) != 0
            if ids.size and (ids.min() < 0 or ids.max() >= vocab):
                raise BadInput(f"token id {int(ids.max() if ids.max() >= vocab else ids.min())} outside the target "
                               f"vocab [0, {vocab})", path=s.meta.get("path", training), field="input_ids")
            seqs.append((ids, mask))
        what = f"training data {training} ({len(seqs)} samples, " + (
            "all tokens: no loss mask)" if no_mask else "loss-masked tokens)")
        return seqs, what
    if target_tokens is None:
        return None
    ids = np.asarray(list(target_tokens))
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise BadInput("expected a flat sequence of integer token ids", field="target_tokens")
    ids = ids.astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        raise BadInput(f"token id {int(ids.max() if ids.max() >= vocab else ids.min())} outside the target vocab "
                       f"[0, {vocab})", field="target_tokens")
    return [(ids, np.ones_like(ids, dtype=bool))], f"{ids.size} given target tokens"


def _coverage(hot: np.ndarray, vocab: int, seqs: list, what: str, steps: int, limit: float, dv: int,
              findings: list, facts: dict) -> None:
    """Share of target tokens outside the draft vocab and the acceptance ceiling it sets: P(N >= k) <= the share
    of positions whose next k tokens are all in the draft vocab (and all target tokens of the same span)."""
    inside = np.zeros(vocab, dtype=bool)
    inside[hot] = True
    n = outside = 0
    counts: dict[int, int] = {}
    runs_at: list[np.ndarray] = []
    for ids, mask in seqs:
        ok = mask & inside[ids]
        # run[t] = how many consecutive positions from t are masked and inside the draft vocab (distance to the next
        # position that is not)
        pos = np.arange(ids.size)
        next_bad = np.minimum.accumulate(np.where(ok, ids.size, pos)[::-1])[::-1]
        runs_at.append((next_bad - pos)[mask])
        tok = ids[mask]
        n += tok.size
        out_tok = tok[~inside[tok]]
        outside += out_tok.size
        for t in out_tok.tolist():
            counts[t] = counts.get(t, 0) + 1
    if n == 0:
        facts["coverage"] = {"tokens": 0, "from": what}
        return
    runs = np.concatenate(runs_at)
    p_ge = [float((runs >= k).mean()) for k in range(1, steps + 1)]
    share = outside / n
    top = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:10]
    cov = {"from": what, "tokens": n, "outside": outside, "outside_share": share,
           "distinct_outside": len(counts), "top_outside": [{"token": t, "count": c} for t, c in top],
           "ceiling_p_accept_ge": p_ge, "ceiling_accept_length": 1.0 + sum(p_ge), "steps": steps,
           "draft_vocab_size": dv}
    facts["coverage"] = cov
    if share > limit:
        findings.append(D.finding(
            "draft_vocab_coverage", None,
            f"{share:.1%} of the target tokens ({outside} of {n}, {what}) are outside the draft's {dv}-token vocab "
            f"and can never be drafted: P(accept >= 1) <= {p_ge[0]:.3f}, accept length <= {1 + sum(p_ge):.3f} for "
            f"{steps} steps",
            limit=limit, **cov,
            source=f"{_W2} l. 757-758 (a drafted id is hot_token_id[draft id]: only the draft vocab can be proposed)",
            fix="build the draft vocab (SpecForge vocab_mapping) from tokens like these and retrain the lm_head"))


def _weights(arch: SGLangDraftParams, d: DraftConfig, tensors: dict, hin_differs: bool, findings: list,
             facts: dict) -> None:
    """Every checkpoint tensor resolved as ``load_weights`` resolves it: shape errors raise, missing parameters and
    dropped tensors are findings."""
    filled: set = set()
    ignored = []
    for key, info in tensors.items():
        where = resolve_name(arch, key)
        if where in ("d2t", "t2d", "midlayer"):
            continue
        if where is None:
            if key.endswith("rotary_emb.inv_freq") or re.search(r"(^|\.)lm_head\.weight$", key):
                continue       # buffers; lm_head is the lm_head check's
            ignored.append(key)
            continue
        expected, _init = arch.params[where]
        if tuple(info.shape) != tuple(expected):
            raise shape_error(arch, d, key, info, where[0], where[1], expected)
        filled.add(where)
    missing = []
    for (param, shard), (shape, init) in arch.params.items():
        if (param, shard) in filled or param == "lm_head.weight" or (param, shard) in arch.unused:
            continue
        if param == "model.embed_tokens.weight" and not hin_differs:
            continue          # replaced by the target's embedding (set_embed)
        missing.append({"param": param if shard is None else f"{param}[{shard}]", "shape": list(shape), "init": init})
    facts["weights"] = {"files": sorted({str(i.file) for i in tensors.values()}), "tensors": len(tensors),
                        "parameters": len(arch.params), "class": arch.cls,
                        "decoder_layer_checked": arch.midlayer_checked, "rule": arch.source}
    if missing:
        names = [m["param"] for m in missing]
        findings.append(D.finding(
            "draft_weight_missing", None,
            f"{len(missing)} parameter(s) SGLang builds from the draft config have no tensor in the checkpoint and "
            f"keep their initial value: " + ", ".join(f"{m['param']} ({m['init'].split(' (')[0]})"
                                                      for m in missing[:6]) + (" ..." if len(missing) > 6 else ""),
            missing=missing, config=str(d.path), files=facts["weights"]["files"],
            source=f"{arch.source}; load_weights skips what it does not find ("
                   + draft_class(arch.cls).load_skips + ": no error)",
            hint=_missing_hint(arch, names)))
    if ignored:
        findings.append(D.finding(
            "draft_weight_ignored", None,
            f"{len(ignored)} tensor(s) of the checkpoint match no parameter SGLang builds from the draft config and "
            f"are dropped without a word: " + ", ".join(ignored[:6]) + (" ..." if len(ignored) > 6 else "")
            + _ignored_hint(arch, d, ignored),
            tensors=ignored, config=str(d.path), files=facts["weights"]["files"],
            source=draft_class(arch.cls).unexpected_weight))


def _missing_hint(arch: SGLangDraftParams, names: list[str]) -> str:
    if any(n.startswith("model.input_norm") for n in names):
        return ("norm_before_fc is set but the checkpoint has no input_norm.weight: unset it if training had no "
                "such norm")
    if any(".fused_qkv_a_proj_with_mqa." in n for n in names):
        return ("SGLang fills fused_qkv_a_proj_with_mqa only once both q_a_proj and kv_a_proj_with_mqa are read "
                f"({K25}::load_weights l. 467-492): with one missing, neither is loaded")
    if any(n.startswith("model.fc_norm") for n in names):
        return "fc_norm / use_aux_norm is set but the checkpoint has no fc_norm.<i>.weight: unset it if training " \
               "had no per-chunk norms"
    return "the config describes another model than the checkpoint holds"


def _ignored_hint(arch: SGLangDraftParams, d: DraftConfig, keys: list[str]) -> str:
    hints = []
    if any(re.search(r"(^|\.)(fc_norm\.\d+|aux_norm_(low|mid|high))\.weight$", k) for k in keys) and not arch.fc_norm:
        hints.append("per-chunk fc norms are in the checkpoint but fc_norm / use_aux_norm is not set at the top level "
                     f"of the config ({L3} l. 185-188)")
    if any(re.search(r"(^|\.)input_norm\.weight$", k) for k in keys) and not arch.norm_before_fc:
        hints.append(f"input_norm.weight is in the checkpoint but norm_before_fc is not set ({L3} l. 173-182)")
    if any(k.startswith("model.model.") or k.startswith("model.lm_head") for k in keys):
        hints.append("a doubled 'model.' prefix")
    return (" (" + "; ".join(hints) + ")") if hints else ""


# ------------------------------------------------------------------------------------------------ entry

class LoaderRules:
    """An engine's draft loader, as the server-free draft checks need it: SGLang 0.5.23's here (the module
    docstring's lines); one subclass per engine (``helpers.engines.vllm.VLLMLoaderRules``), handed out by the engine
    adapter (``EngineAdapter.loader_rules``), so :func:`inspect_draft` never asks which engine it checks for.

    Attributes: ``label`` (``SGLang``), ``version``, ``d2t_source`` (where the engine maps draft ids through d2t)."""

    label = "SGLang"
    d2t_source = f"{L3}::load_weights l. 350-353 (hot_token_id = d2t + arange); {_W2} l. 757-758"
    #: the loader rule table: which tensors the engine runs the draft with, row by row (:meth:`draft_tensors`,
    #: :meth:`draft_norms` apply it; the offline draft run asks them: :meth:`helpers.draft.model.Eagle3Draft.load`)
    TABLE = {
        "embedding": "the target's embed_tokens, whether or not the checkpoint carries its own, unless the config's "
                     "target_hidden_size differs from hidden_size (then the checkpoint's) "
                     f"({_W2}::EAGLEWorkerV2.init_lm_head -> sglang/srt/models/llama.py::LlamaForCausalLM.set_embed)",
        "lm_head": "tie_word_embeddings: the embedding in use, its first draft_vocab_size rows; draft_vocab_size "
                   "absent: the target's lm_head, even when the checkpoint carries one (load_lm_head_from_target -> "
                   f"set_embed_and_head); else the checkpoint's ({L3}::LlamaForCausalLMEagle3.__init__)",
        "d2t": "the checkpoint's d2t whenever present (hot_token_id = d2t + arange); none: draft ids are target ids "
               f"({L3}::LlamaForCausalLMEagle3.load_weights)",
        "t2d": f"ignored ({L3}::LlamaForCausalLMEagle3.load_weights)",
        "norm_before_residual": "not read: the first layer's residual is the hidden state before hidden_norm "
                                f"({L3}::LlamaDecoderLayer.forward)",
        "fc_norm": f"fc_norm or the legacy use_aux_norm ({L3}::LlamaModel.__init__)",
    }

    def __init__(self, version: Optional[str] = None) -> None:
        self.version = version or SGLANG_RULES

    def draft_norms(self, d: DraftConfig) -> dict[str, bool]:
        """The :data:`TABLE` norm rows for draft config ``d``: ``{"norm_before_residual": bool, "fc_norm": bool}``.

        Raises:
            BadInput: a config the engine refuses to build (:func:`helpers.draft.params.sglang_parameters`)."""
        return {"norm_before_residual": False, "fc_norm": sglang_parameters(d).fc_norm}

    def draft_tensors(self, d: DraftConfig, names: Sequence[str], *, embed_equal: Optional[bool] = None
                      ) -> dict[str, str]:
        """The :data:`TABLE` tensor rows for draft config ``d`` and checkpoint tensor ``names``: ``{"embedding":
        "target"|"draft", "lm_head": "draft"|"target"|"tied", "d2t": "checkpoint"|"none"}`` (``embed_equal``,
        whether the checkpoint's own embed_tokens equals the target's, is not read by SGLang's loader)."""
        p = sglang_parameters(d)
        embed = "draft" if ("target_hidden_size" in d.raw and p.hidden_size_in != d.hidden_size) else "target"
        head = "tied" if p.tie else ("target" if p.lm_from_target else "draft")
        d2t = "checkpoint" if any(resolve_name(p, k) == "d2t" for k in names) else "none"
        return {"embedding": embed, "lm_head": head, "d2t": d2t}

    def config_checks(self, d: DraftConfig, target: Any) -> Any:
        """The config-only checks (:func:`helpers.draft.config_checks.check_draft_config`)."""
        return check_draft_config(d, target, self.version)

    def plan_rules(self) -> PlanRules:
        """The engine's id rules (the served width check)."""
        return PlanRules(self.version)

    def mtp_rules(self) -> MTPRules:
        """The engine's rules for an MTP / NextN head (:class:`helpers.draft.mtp_checks.MTPRules`)."""
        return MTPRules(self.version)

    def draft_vocab(self, d: DraftConfig) -> int:
        """Rows of the draft's lm_head as the engine builds it."""
        return sglang_parameters(d).draft_vocab

    def draft_vocab_field(self, d: DraftConfig) -> str:
        return "draft_vocab_size" if not sglang_parameters(d).lm_from_target else \
            "vocab_size: draft_vocab_size absent"

    def d2t_keys(self, d: DraftConfig, tensors: dict) -> list[str]:
        """The checkpoint tensors the engine loads as d2t."""
        arch = sglang_parameters(d)
        return [k for k in tensors if resolve_name(arch, k) == "d2t"]

    def weights(self, d: DraftConfig, weights: Any, target: Any, target_dir: Optional[Path], findings: list,
                facts: dict) -> None:
        """Every checkpoint tensor against the parameters the engine builds, the lm_head, the vocab map's presence
        and the fc flags (findings and facts appended)."""
        arch = sglang_parameters(d)
        hin_differs = "target_hidden_size" in d.raw and arch.hidden_size_in != d.hidden_size
        _weights(arch, d, weights.tensors, hin_differs, findings, facts)
        _lm_head(arch, d, weights.tensors, None if target is None else target.raw, hin_differs, findings, facts)
        findings += D.detect_vocab_map_missing(d, weights)
        findings += D.detect_fc_bypassed(d, None, None, weights, target)


def inspect_draft(draft_dir: Path, target_dir: Optional[Path] = None, training: Optional[Path] = None,
                  target_tokens: Optional[Sequence[int]] = None, sglang_version: str = SGLANG_RULES, *,
                  steps: int = 3, outside_share_limit: float = OUTSIDE_SHARE_LIMIT,
                  loader: Optional[LoaderRules] = None) -> dict:
    """All the server-free checks of a draft, and the facts they rest on.

    Args:
        draft_dir: the draft's folder (config.json + safetensors, sharded through ``model.safetensors.index.json``
            or not).
        target_dir: the target's folder or config.json (only the config is read, and by an engine whose loader
            compares the draft's tensors with the target's, the target's embed_tokens / lm_head): rope, context
            length, sliding window, vocab size and its lm_head tying.
        training: training data (SpecForge ``rows_*/data_*.ckpt``, speculators ``hs_*.safetensors``, a dump):
            its loss-masked token ids for the vocab coverage, its ``vocab_mapping/*.pt`` for d2t.
        target_tokens: the user's target token ids (used when ``training`` is None).
        sglang_version: the server's SGLang when ``loader`` is None; the rules are those of 0.5.23
            (``facts["sglang"]`` says so when it differs).
        steps: draft steps for the acceptance ceiling.
        outside_share_limit: a ``draft_vocab_coverage`` finding above this share of tokens outside the draft vocab.
        loader: the serving engine's loader rules (:class:`LoaderRules`, from the engine adapter); default SGLang's.

    Returns:
        ``{"findings": [finding dicts, in :data:`KIND_ORDER`], "facts": {"sglang", "architecture", "lm_head",
        "embedding", "vocab", "vocab_sizes", "coverage", "rope", "context_length", "sliding_window", "fc",
        "weights"}, "notes": [sentences]}`` (facts only for what was checked; the config-only part and the notes
        are the loader's ``config_checks``).

    Raises:
        BadInput: unreadable config / weights / training data; a tensor whose shape the engine cannot load (file,
            key, expected shape); a d2t of the wrong length or out of the target vocab; token ids outside the vocab.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise BadInput(f"expected a positive number of draft steps, got {steps!r}", field="steps")
    loader = loader or LoaderRules(sglang_version)
    draft_dir = Path(draft_dir)
    if not draft_dir.is_dir():
        raise BadInput("expected the draft's folder (config.json and *.safetensors)", path=draft_dir)
    d = read_draft_config(draft_dir)
    target = read_target_config(target_dir) if target_dir is not None else None
    cc = loader.config_checks(d, target)          # the config-only part: the same code as diagnose's
    findings: list[dict] = list(cc.findings)
    facts: dict[str, Any] = dict(cc.facts)
    if any(f["kind"] == "unsupported_draft" for f in findings):
        return {"findings": findings, "facts": facts, "notes": cc.notes}
    weights = read_draft_weights(draft_dir)
    tensors = weights.tensors
    vocab = target.vocab_size if target is not None and target.vocab_size else (d.vocab_size or loader.draft_vocab(d))

    loader.weights(d, weights, target, None if target_dir is None else Path(target_dir), findings, facts)
    training = Path(training) if training is not None else None
    hot = _vocab(loader, d, tensors, vocab, training, findings, facts)
    seqs = _tokens(training, target_tokens, vocab, None if target is None else target.hidden_size)
    if seqs is not None:
        _coverage(hot, vocab, seqs[0], seqs[1], steps, outside_share_limit, len(np.unique(hot)), findings, facts)
    if target is not None:
        sp = loader.plan_rules().served_plan(d, target, "EAGLE3")
        if not sp.fatal and d.use_aux_hidden_state is not False:
            findings += [f for f in D.static_layer_findings(sp, None, d, weights, target)
                         if f["kind"] == "width_mismatch" and "served_width" in f["evidence"]]
    order = {k: i for i, k in enumerate(KIND_ORDER)}
    findings.sort(key=lambda f: order.get(f["kind"], len(order)))
    return {"findings": findings, "facts": facts, "notes": cc.notes}


def draft_checks(draft_dir: Path, target_dir: Path | None = None, training: Path | None = None,
                 target_tokens: Sequence[int] | None = None, sglang_version: str = "0.5.23",
                 loader: Optional[LoaderRules] = None) -> list[dict]:
    """The findings of :func:`inspect_draft` (``{"kind", "chunk": None, "detail", "evidence"}``, DESIGN.md
    "Findings"); an empty list for a draft the engine will serve as it was trained.

    Raises:
        BadInput: as :func:`inspect_draft`.
    """
    return inspect_draft(draft_dir, target_dir, training, target_tokens, sglang_version, loader=loader)["findings"]
