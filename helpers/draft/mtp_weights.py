"""The weights check of an MTP / NextN head (issue 37 part 4): what the engine will make of the checkpoint's tensors,
read from the safetensors (the index or headers for the names; the few tensors compared, in row blocks).

Two questions, each one finding:

* ``mtp_weights_missing``: the checkpoint the engine loads lacks some of the head's tensors (the names only:
  :meth:`helpers.draft.mtp_checks.MTPRules.weights`). SGLang 0.5.23 starts anyway and serves those parameters as
  they were allocated (:func:`helpers.draft.mtp_checks.sglang_missing_effect`); vLLM 0.32.0 refuses to start.
* ``lm_head_replaced`` / ``embedding_replaced``: the head's own ``shared_head.head`` / ``embed_tokens`` copy (under
  the head's prefix, :attr:`helpers.layers.mtp.MTPFamily.own_copies`) differs from the target's. Neither engine serves
  it (:attr:`helpers.draft.mtp_checks.MTPRules.own_copies_rule`): SGLang skips those names at load
  (``sglang/srt/models/deepseek_common/deepseek_weight_loader.py::DeepseekV2WeightLoaderMixin.do_load_weights``,
  ``glm4_moe.py::Glm4MoeForCausalLM.load_weights``: "Use shared head and embed weights from target model") and binds
  the target's (``speculative/eagle_worker_v2.py::EagleDraftWorker.init_lm_head`` -> ``set_embed_and_head``); vLLM
  loads them and replaces both by the target's for an MTP model (``vllm/v1/spec_decode/llm_base_proposer.py::
  _maybe_share_embeddings`` / ``_maybe_share_lm_head``: "Detected MTP model. Sharing target model ..."; at pipeline
  parallel size 1). A copy that is only stale costs nothing; a head trained with its own head or embedding loses what
  it learned with them, and the draft stage (the head run offline with the target's, as the engine runs it, against
  its training log) prices that. A family whose engine serves the checkpoint's own copy instead
  (:meth:`helpers.layers.mtp.MTPFamily.serves_own`: Step-3.5's ``shared_head.output`` on both engines, its
  ``embed_tokens`` on SGLang) gets no such finding: the copy is what is served (``facts["own_copies"]``: ``served``).

Used by ``diagnose --draft-config`` (:func:`helpers.draft.mtp_checks.check_mtp`), the NextN investigation's attach
and the generated faults' bench.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError, safe_open

from ..diagnosis import detectors as D
from ..errors import BadInput
from ..formats.configs import read_config_json, read_mtp_head, read_safetensors_index
from ..layers.mtp import MTPHead
from .model import find_target_tensor

#: the target tensor each own copy stands for (the lm_head: ``lm_head.weight``, the embedding when tied)
#: (Step-3.5 stores its lm_head copy as ``shared_head.output``, read as ``shared_head.head``:
#: ``sglang/srt/models/step3p5_mtp.py::Step3p5MTP.load_weights`` l. 274-275)
TARGET_OF = {"shared_head.head.weight": "lm_head.weight", "shared_head.output.weight": "lm_head.weight",
             "embed_tokens.weight": "embed_tokens.weight"}
#: the finding kind per own copy
KIND_OF = {"shared_head.head.weight": "lm_head_replaced", "shared_head.output.weight": "lm_head_replaced",
           "embed_tokens.weight": "embedding_replaced"}
#: rows compared at a time (a DeepSeek-V3 head is 129280 x 7168: read in blocks, never whole)
BLOCK_ROWS = 8192


def compare_tensors(a: tuple[Path, str], b: tuple[Path, str], *, block_rows: int = BLOCK_ROWS) -> dict:
    """Whether two safetensors tensors are equal, read ``block_rows`` rows at a time as float32.

    Args:
        a, b: ``(file, tensor name)``.

    Returns:
        ``{"equal": bool (every element equal; shapes too), "shape": [a's], "other_shape": [b's],
        "rel_diff": ||a - b||_F / ||b||_F (None when the shapes differ or a value is not finite), "max_abs": max
        |a - b|, "nonfinite": [NaN / inf count in a, in b]}``; a tensor with a NaN / inf is never equal.

    Raises:
        BadInput: a file or tensor that cannot be read (the file and name named).
    """
    try:
        with safe_open(str(a[0]), framework="pt") as fa, safe_open(str(b[0]), framework="pt") as fb:
            sa, sb = fa.get_slice(a[1]), fb.get_slice(b[1])
            shape_a, shape_b = list(sa.get_shape()), list(sb.get_shape())
            if shape_a != shape_b:
                return {"equal": False, "shape": shape_a, "other_shape": shape_b, "rel_diff": None, "max_abs": None,
                        "nonfinite": [0, 0]}
            num = den = 0.0
            mx = 0.0
            bad = [0, 0]
            for r in range(0, shape_a[0] if shape_a else 1, block_rows):
                x = (sa[r:r + block_rows] if shape_a else sa[:]).float()
                y = (sb[r:r + block_rows] if shape_b else sb[:]).float()
                bad[0] += int((~torch.isfinite(x)).sum())
                bad[1] += int((~torch.isfinite(y)).sum())
                d = x - y
                num += float(d.pow(2).sum())
                den += float(y.pow(2).sum())
                mx = max(mx, float(d.abs().max()) if d.numel() else 0.0)
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as e:
        raise BadInput(f"cannot compare {a[1]} with {b[1]} ({' '.join(str(e).split())[:200]})", path=a[0]) from None
    if any(bad):
        return {"equal": False, "shape": shape_a, "other_shape": shape_b, "rel_diff": None, "max_abs": None,
                "nonfinite": bad}
    return {"equal": num == 0.0, "shape": shape_a, "other_shape": shape_b,
            "rel_diff": (num ** 0.5) / (den ** 0.5) if den > 0 else None, "max_abs": mx, "nonfinite": bad}


def own_copy_findings(head: MTPHead, draft_dir: Path, target_dir: Path, rules, facts: Optional[dict] = None,
                      prefixes: Optional[list[str]] = None) -> list[dict]:
    """``lm_head_replaced`` / ``embedding_replaced`` for each own copy of the head (module docstring) that differs
    from the target's tensor; ``facts["own_copies"]`` says what was compared. A copy the engine serves itself
    (:meth:`helpers.layers.mtp.MTPFamily.serves_own`, Step-3.5's ``shared_head.output``) gets no finding: its
    comparison is listed with ``served`` (what the engine serves and where).

    Args:
        head: the head (:func:`helpers.formats.configs.read_mtp_head` of the draft config).
        draft_dir / target_dir: the folders (the same for a head that is the target's extra layer).
        rules: the engine's :class:`helpers.draft.mtp_checks.MTPRules` (its ``own_copies_rule`` and label).
        prefixes: the head's checkpoint prefixes (default: SGLang's, :meth:`MTPHead.sglang_prefixes`).

    Raises:
        BadInput: unreadable safetensors."""
    facts = {} if facts is None else facts
    fam = head.family
    if not fam.own_copies or not Path(draft_dir).is_dir() or not Path(target_dir).is_dir():
        facts["own_copies"] = "not compared (the family ships none, or no folders given)"
        return []
    names = read_safetensors_index(draft_dir)
    tied = bool(read_config_json(Path(target_dir) / "config.json", "target config").get("tie_word_embeddings"))
    out, seen = [], []
    for p in prefixes or head.sglang_prefixes():
        for own in fam.own_copies:
            if p + own not in names:
                continue
            want = "embed_tokens.weight" if tied else TARGET_OF[own]
            hit = find_target_tensor(Path(target_dir), want)
            if hit is None:
                continue
            cmp = compare_tensors((names[p + own].file, p + own), (hit[1], hit[0]))
            if own in fam.serves_own(rules.label):
                from .mtp_checks import own_served  # lazy: mtp_checks imports this module
                # the engine serves this copy itself (Step-3.5): a difference is what the head was trained with and
                # is served, not a replacement
                seen.append({"tensor": p + own, "target": hit[0], **cmp,
                             "served": own_served(fam, rules.label)})
                continue
            seen.append({"tensor": p + own, "target": hit[0], **cmp})
            if cmp["equal"]:
                continue
            what = "lm_head" if own.startswith("shared_head") else "embedding"
            diff = (f"non-finite values (NaN / inf): {cmp['nonfinite'][0]} in the head's copy, "
                    f"{cmp['nonfinite'][1]} in the target's" if any(cmp.get("nonfinite") or ()) else
                    f"rel. difference {cmp['rel_diff']:.3g}" if cmp["rel_diff"] is not None else
                    f"shape {cmp['shape']} vs {cmp['other_shape']}")
            out.append(D.finding(
                KIND_OF[own], None,
                f"the head's own {p + own} differs from the target's {hit[0]} ({diff}): {rules.label} "
                f"{rules.version} serves the head with the target's {what}, never this copy ({rules.own_copies_rule}). "
                f"A stale copy costs nothing; a head trained with its own {what} loses what it learned there: the "
                "draft stage (the head offline with the target's, against its training log) prices it",
                engine=f"{rules.label} {rules.version}", tensor=p + own, target_tensor=hit[0], **cmp,
                source=rules.own_copies_rule,
                fix=f"train (or fine-tune) the head with the target's {what} frozen, as DeepSeek-V3's MTP module "
                    f"shares it; or serve a target whose {what} is the one the head was trained with"))
    facts["own_copies"] = seen
    return out


def head_weight_findings(draft_dir: str | Path, target_dir: str | Path, rules=None,
                         facts: Optional[dict] = None) -> list[dict]:
    """The weights check of the MTP head served from ``draft_dir`` (the target folder itself, or a separate NextN
    checkpoint) next to ``target_dir``: ``mtp_weights_missing`` (the engine's prefixes, names only) and the own
    copies' findings (:func:`own_copy_findings`). [] for a folder that is no MTP head or holds no safetensors.

    Args:
        rules: the engine's :class:`helpers.draft.mtp_checks.MTPRules` (default SGLang 0.5.23's).

    Raises:
        BadInput: unreadable config or safetensors."""
    from .mtp_checks import MTPRules, weight_names  # lazy: mtp_checks imports this module for diagnose
    rules = rules or MTPRules()
    facts = {} if facts is None else facts
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    cfg = draft_dir / "config.json"
    head = read_mtp_head(read_config_json(cfg, "draft config"), cfg)
    if head is None:
        return []
    names, where = weight_names(draft_dir)
    facts["weights_read_from"] = where
    if names is None:
        return []
    findings: list[dict] = []
    prefixes = rules.head_prefixes(head)
    rules.weights(head, names, prefixes, findings, facts)
    findings += own_copy_findings(head, draft_dir, target_dir, rules, facts, prefixes)
    return findings


__all__ = ["BLOCK_ROWS", "KIND_OF", "compare_tensors", "head_weight_findings", "own_copy_findings"]
