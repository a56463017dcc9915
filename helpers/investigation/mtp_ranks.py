"""What every TP rank's NextN (MTP) head reads, on a server at TP > 1: ``/generate`` returns only TP rank 0's state,
so a per-rank partial sum or a sharded width fed to the head shows only across ranks.

Where the per-rank states come from: the server's every-layer capture (``server start --capture-layers DIR``,
:func:`helpers.capture.every_layer_hook_specs`) runs on the target's logits processor of **every** TP rank (SGLang
0.5.23 registers ``--forward-hooks`` on the target model runner of each rank:
``sglang/srt/model_executor/hook_manager.py::register_forward_hooks``), and each rank writes, beside the layer
outputs, ``aux`` = ``LogitsProcessorOutput.hidden_states``: the tensor that rank's NextN head reads
(``sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward`` reads ``spec_info.hidden_states``, which the
EAGLE worker takes from the target's ``logits_output.hidden_states`` on the same rank:
``sglang/srt/speculative/eagle_worker_v2.py``). The reference dump of the investigation (rank 0's every-layer
capture of the live prompts' tokens, :func:`helpers.capture.capture_every_layer`) gives the candidates
(:func:`helpers.investigation.mtp.state_candidates`); each rank's ``aux`` of the same forward (same token ids) is
identified against them with the one rule of :func:`helpers.investigation.mtp.identify_state`.

The comparison mirrors the EAGLE-3 diagnosis's per-rank detectors (``helpers.diagnosis.detectors.served``:
``detect_tp_sharded_width``, ``detect_tp_partial_sum``) on the NextN head's one chunk:

* every rank ``H / tp`` wide: ``tp_sharded_width`` (the ranks' states gathered in rank order identified);
* ranks that disagree, none of them a candidate, their sum one: ``tp_partial_sum`` (each rank fed its un-reduced
  share, e.g. ``helpers.hooks`` fault ``tp_partial_sum``);
* a rank other than 0 fed another candidate than rank 0: that rank's own finding
  (:func:`helpers.investigation.mtp.state_findings`, ``tp_rank`` in its evidence).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from ..capture import read_rank_capture
from ..diagnosis.detectors import finding
from ..draft.sequences import SAME_STATES
from ..draft.simulate import SimSequence
from ..errors import BadInput
from ..formats.dumps import read_dump
from .mtp import identify_state, state_findings

#: where each rank's state comes from (the doc of this module says why it is the head's input on that rank)
RANK_SOURCE = ("the server's every-layer capture on every TP rank (helpers.hooks capture on the target's "
               "logits_processor: aux = LogitsProcessorOutput.hidden_states, which that rank's "
               "sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward reads as spec_info.hidden_states)")


def rank_states(capture_dir: str | Path, reference: str | Path) -> dict[int, list[SimSequence]]:
    """Each TP rank's ``aux`` (the state its NextN head read) for the samples of the reference dump ``reference``:
    per rank, the **last** prefill (``EXTEND``) forward recorded under ``capture_dir`` whose token ids equal the
    sample's (the reference capture of this run sent them last; a reused server keeps earlier runs' forwards).

    Returns:
        ``{rank: [SimSequence(key=sample id, tokens [T] int64, aux [T, W] float32, start=0)]}``, ranks ascending;
        a sample no rank recorded is left out of every rank (all ranks hold the same keys, in the dump's order).

    Raises:
        BadInput: no ``rank*/index.jsonl`` under ``capture_dir``, or no sample of the dump found on every rank."""
    try:
        index = read_rank_capture(capture_dir)
    except FileNotFoundError as exc:
        raise BadInput(str(exc), path=capture_dir) from None
    samples = read_dump(reference).samples
    want = {tuple(int(x) for x in s.input_ids.tolist()): str(s.sample_id or s.key) for s in samples
            if s.input_ids is not None}
    found: dict[int, dict[str, torch.Tensor]] = {}
    ids_of: dict[str, torch.Tensor] = {}
    for rank, recs in sorted(index.items()):
        got: dict[str, torch.Tensor] = {}
        for rec in reversed(recs):
            if rec.get("mode") != "EXTEND" or "aux" not in rec.get("keys", []) or int(rec.get("tokens") or 0) \
                    not in {len(k) for k in want}:
                continue
            t = load_file(str(Path(capture_dir) / f"rank{rank}" / rec["file"]))
            ids = tuple(int(x) for x in t["input_ids"].tolist())
            key = want.get(ids)
            if key is not None and key not in got:
                got[key] = t["aux"].float()
                ids_of[key] = t["input_ids"].to(torch.int64)
            if len(got) == len(want):
                break
        found[rank] = got
    keys = [k for k in want.values() if all(k in g for g in found.values())]
    if not keys:
        raise BadInput(f"no sample of the reference dump {reference} was recorded on every TP rank "
                       f"({sorted(found)}): was the every-layer capture armed for this run's prompts?", path=capture_dir)
    return {rank: [SimSequence(key=k, tokens=ids_of[k], aux=g[k], start=0) for k in keys]
            for rank, g in found.items()}


def _rank_vs_rank0(ranks: dict[int, list[SimSequence]]) -> dict[int, float]:
    """``||aux_r - aux_0|| / ||aux_0||`` (Frobenius over every row of every sample) per rank r > 0; ``inf`` when the
    widths differ."""
    out = {}
    r0 = ranks[min(ranks)]
    for r, seqs in ranks.items():
        if r == min(ranks):
            continue
        num = den = 0.0
        for a, b in zip(seqs, r0):
            if a.aux.shape != b.aux.shape:
                num = float("inf")
                break
            num += float((a.aux - b.aux).pow(2).sum())
            den += float(b.aux.pow(2).sum())
        out[r] = float(np.sqrt(num / den)) if den and np.isfinite(num) else float("inf")
    return out


def _combined(ranks: dict[int, list[SimSequence]], how: str) -> list[SimSequence]:
    """The ranks' states summed (``sum``) or concatenated in rank order along the width (``gather``), per sample."""
    order = sorted(ranks)
    out = []
    for i, s in enumerate(ranks[order[0]]):
        parts = [ranks[r][i].aux for r in order]
        aux = torch.stack(parts).sum(0) if how == "sum" else torch.cat(parts, dim=1)
        out.append(SimSequence(key=s.key, tokens=s.tokens, aux=aux, start=0))
    return out


def identify_ranks(capture_dir: str | Path, reference: str | Path, weight: torch.Tensor, eps: float,
                   hidden_size: int, *, same: float = SAME_STATES) -> dict:
    """Every TP rank's NextN input identified (module docstring).

    Args:
        capture_dir: the every-layer capture folder (``attach``'s ``layers_dir``: ``rank<r>/index.jsonl``).
        reference: the investigation's every-layer reference dump of the live prompts (rank 0's, same tokens).
        weight / eps: the target's final norm (:func:`helpers.draft.model.target_final_norm`).
        hidden_size: the target's hidden size H (a rank ``H / tp`` wide is a shard).

    Returns:
        ``{"tp": number of ranks recorded, "width": {rank: W}, "per_rank": {rank: identify_state result},
        "rank_vs_rank0": {rank: rel. diff}, "ranks_agree": bool, "sum": identify_state of the sum over ranks or
        None, "gathered": identify_state of the ranks concatenated or None, "sharded": bool, "samples": n,
        "source": RANK_SOURCE}``.

    Raises:
        BadInput: :func:`rank_states`'s; a width that is neither H nor H / tp."""
    ranks = rank_states(capture_dir, reference)
    tp = len(ranks)
    width = {r: int(s[0].aux.shape[1]) for r, s in ranks.items()}
    sharded = tp > 1 and all(w * tp == hidden_size for w in width.values())
    if not sharded and any(w != hidden_size for w in width.values()):
        raise BadInput(f"the ranks' NextN states are {sorted(set(width.values()))} wide: neither the hidden size "
                       f"{hidden_size} nor a 1/{tp} shard of it", path=capture_dir)
    out: dict[str, Any] = {"tp": tp, "width": width, "sharded": sharded, "samples": len(ranks[min(ranks)]),
                           "threshold": same, "source": RANK_SOURCE, "per_rank": {}, "sum": None, "gathered": None}
    if sharded:
        out["gathered"] = identify_state(_combined(ranks, "gather"), reference, weight, eps, same=same)
        out["rank_vs_rank0"], out["ranks_agree"] = {}, False
        return out
    out["per_rank"] = {r: identify_state(s, reference, weight, eps, same=same) for r, s in ranks.items()}
    out["rank_vs_rank0"] = _rank_vs_rank0(ranks)
    out["ranks_agree"] = all(v < same for v in out["rank_vs_rank0"].values())
    if not out["ranks_agree"]:
        out["sum"] = identify_state(_combined(ranks, "sum"), reference, weight, eps, same=same)
    return out


def rank_findings(ir: dict, wiring_loss: Optional[dict] = None) -> list[dict]:
    """The findings of :func:`identify_ranks` (none when every rank feeds rank 0's state, which
    :func:`helpers.investigation.mtp.state_findings` already judged): ``tp_sharded_width``, ``tp_partial_sum``, or a
    rank's own wrong state (:func:`helpers.investigation.mtp.state_findings` with ``tp_rank``)."""
    ev = {"tp_size": ir["tp"], "widths": ir["width"], "rank_vs_rank0_rel_diff": ir.get("rank_vs_rank0"),
          "source": ir["source"], "samples": ir["samples"]}
    if ir["sharded"]:
        g = ir["gathered"]
        what = g["identified"] or f"none of the candidates (closest {g['best']}, {g['best_rel_error']:.2g})"
        return [finding("tp_sharded_width", None, f"each of the {ir['tp']} TP ranks feeds its NextN head "
                        f"{ir['width'][0]} of the {ir['width'][0] * ir['tp']} columns of its input (captured before "
                        f"the gather); gathered in rank order they are {what} (rel. error {g['best_rel_error']:.2g})",
                        gathered=g["rel_error"], **ev)]
    if ir["ranks_agree"]:
        return []
    per = {r: (i["identified"], i["best_rel_error"]) for r, i in ir["per_rank"].items()}
    s = ir.get("sum") or {}
    if s.get("identified") and not any(i["identified"] for i in ir["per_rank"].values()):
        return [finding("tp_partial_sum", 0, f"the {ir['tp']} TP ranks feed their NextN heads different states, none "
                        f"of them a tensor of the target, but their sum is {s['identified']} (rel. error "
                        f"{s['best_rel_error']:.2g}): each rank feeds its un-reduced partial sum (before the "
                        "all-reduce)", sum_identified=s["identified"], sum_rel_error=s["rel_error"],
                        per_rank=per, **ev)]
    out = []
    for r, i in ir["per_rank"].items():
        if r == min(ir["per_rank"]) or i["matches"]:
            continue
        for f in state_findings(i, wiring_loss):
            f["detail"] = f"TP rank {r}: " + f["detail"]
            f["evidence"].update(tp_rank=r, **ev)
            out.append(f)
    if not out:      # the ranks differ but each is one candidate (or none is, nor their sum): said as it is
        out.append(finding("unidentified_chunk", 0, f"the {ir['tp']} TP ranks feed their NextN heads different states "
                           f"(rel. diff to rank 0 {', '.join(f'{k}: {v:.2g}' for k, v in ir['rank_vs_rank0'].items())}"
                           f"); per rank: {per}; their sum is {s.get('identified') or 'none of the candidates'}",
                           per_rank=per, **ev))
    return out


def rank_line(ir: dict) -> str:
    """The per-rank result in one line (the console and the page)."""
    if ir["sharded"]:
        return f"{ir['tp']} ranks, each {ir['width'][0]} wide (sharded)"
    if ir["ranks_agree"]:
        worst = max(ir["rank_vs_rank0"].values(), default=0.0)
        return f"all {ir['tp']} TP ranks feed rank 0's state (max rel. diff to rank 0 {worst:.2g})"
    per = ", ".join(f"rank {r}: {i['identified'] or 'none'}" for r, i in ir["per_rank"].items())
    return f"the {ir['tp']} TP ranks differ ({per}; sum {(ir.get('sum') or {}).get('identified') or 'none'})"


def per_rank_note(tp: int, layers_dir: Optional[Any]) -> Optional[str]:
    """Why only rank 0 was compared on a TP > 1 server (None at TP 1 or when the ranks were compared)."""
    if tp <= 1 or layers_dir is not None:
        return None
    return (f"only TP rank 0's state was compared on this TP {tp} server (it records no per-rank every-layer capture "
            "folder: the per-rank check was skipped); to compare every rank's NextN input, serve the target on the "
            "embedded SGLang server with the every-layer capture hooks (`python -m helpers server start --nextn "
            "--capture-layers DIR`; vLLM's worker extension records TP rank 0 only) and investigate again")


__all__ = ["RANK_SOURCE", "identify_ranks", "per_rank_note", "rank_findings", "rank_line", "rank_states"]
