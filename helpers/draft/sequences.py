"""The sequences the acceptance budget simulates on (:mod:`helpers.draft.budget`): the training data's samples, a
project dump's samples (served states), a plan of tensors taken from an every-layer reference on other sequences'
tokens, and how far two sets of aux states are apart."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import BadInput
from ..formats.dumps import read_dump
from ..formats.training_data import TrainingData
from .simulate import SimSequence


def _start_from_mask(mask: Any, n: int) -> int:
    if mask is None:
        return 1
    m = np.asarray(mask).reshape(-1)[:n]
    nz = np.nonzero(m > 0)[0]
    return int(nz[0]) if len(nz) else n


def training_sequences(td: TrainingData, *, lm_head: Optional[torch.Tensor] = None,
                       skipped: Optional[list] = None) -> list[SimSequence]:
    """The training data's samples as sequences: aux rows as recorded, the continuation from the first loss-masked
    token; when the sample records the target's final (post-norm) hidden state and ``lm_head [V, H]`` is given, the
    target's own greedy token at each position (else the recorded tokens are taken as the target's).

    A sample with no continuation to draft on (fewer than 3 tokens, an all-zero ``loss_mask``, a mask starting on
    the last two tokens) is left out, as it adds nothing to a trainer's loss either; ``skipped`` (when given)
    receives ``(file, why)`` for each.

    Raises:
        BadInput: a sample's aux hidden states hold NaN / Inf (the file and key named), or no sample is usable (the
            first file named).
    """
    out, left = [], []
    for s in td:
        ids = torch.as_tensor(np.asarray(s.input_ids), dtype=torch.long)
        where = (s.meta or {}).get("path") or str(s.sample_id or s.key)
        mask = (s.meta or {}).get("loss_mask")
        start = max(1, _start_from_mask(mask, len(ids)))
        if start > len(ids) - 2:
            all_zero = mask is not None and not (np.asarray(mask).reshape(-1) > 0).any()
            why, fld = ((f"{len(ids)} token(s), expected at least 3", "input_ids") if len(ids) < 3 else
                        ("loss_mask is all zero", "loss_mask") if all_zero else
                        (f"the loss mask starts at token {start} of {len(ids)}: expected a prompt token and at "
                         "least 2 loss-masked tokens", "loss_mask"))
            left.append((where, why, fld))
            continue
        aux = s.load()
        if not bool(torch.isfinite(aux).all()):
            raise BadInput(f"{int((~torch.isfinite(aux)).sum())} NaN / Inf values in the aux hidden states "
                           "(expected finite)", path=where, field=str((s.meta or {}).get("aux_key") or
                                                                       "aux_hidden_state"))
        out.append(SimSequence(str(s.sample_id or s.key), ids, aux, start, None))
    if skipped is not None:
        skipped.extend((w, why) for w, why, _ in left)
    if left and not out:
        w, why, fld = left[0]
        raise BadInput(f"no sample has a continuation to draft on ({len(left)} sample(s); this one: {why})",
                       path=w, field=fld)
    return out


def dump_sequences(path, *, starts: Optional[dict[str, int]] = None) -> list[SimSequence]:
    """A project dump's samples as sequences. Row t of a served dump is position t of ``input_ids`` followed by
    ``output_ids[:-1]``; the continuation starts at ``num_prompt_tokens`` (a capture with a greedy continuation) or
    at ``starts[sample_id]`` (the training tokens replayed with ``max_new_tokens=1``; with ``starts``, samples whose id
    is not in it are left out).

    Raises:
        BadInput: ``starts`` is given and no sample id of the dump is in it (the manifest named)."""
    src = read_dump(path)
    out = []
    if starts is not None:
        ids = [str(s.sample_id or s.key) for s in src.samples]
        if not set(ids) & set(starts):
            raise BadInput(f"none of the dump's sample ids ({', '.join(ids[:4])}{' ...' if len(ids) > 4 else ''}) "
                           f"is a training sample ({', '.join(list(starts)[:4])}{' ...' if len(starts) > 4 else ''}"
                           "): expected a capture of the same training tokens", path=Path(path) / "manifest.json",
                           field="sample_id")
    for s in src.samples:
        if starts is not None and str(s.sample_id or s.key) not in starts:
            continue                        # not one of these training samples: nothing to pair it with
        ids = np.asarray(s.input_ids).reshape(-1)
        outs = np.asarray(s.output_ids).reshape(-1) if s.output_ids is not None else np.zeros(0, dtype=np.int64)
        sid = str(s.sample_id or s.key)
        if starts is not None and sid in starts:
            tokens, start = ids, starts[sid]
        else:
            tokens = np.concatenate([ids[: s.num_prompt_tokens or len(ids)], outs]) if len(outs) else ids
            start = int(s.num_prompt_tokens or len(ids))
        if s.first_position:
            continue                        # a cached / chunked prefix: the rows do not start at position 0
        out.append(SimSequence(sid, torch.as_tensor(tokens, dtype=torch.long), s.load(), start))
    return out


def reference_sequences(reference_path, like: Sequence[SimSequence], select, *,
                        keep_targets: bool = True) -> list[SimSequence]:
    """Sequences ``like`` (matched to the reference's samples by sample id) with their states replaced by
    ``select(rows, names, H)`` of the every-layer reference dump at ``reference_path``: ``rows`` one sample's
    ``[T, len(names) * H]`` tensor, ``names`` its tensors (``embedding, out(0), ...``), ``H`` the hidden size; the
    result's ``[T, W]`` rows are cut to the shorter of the two sequences. ``keep_targets``: carry ``like``'s sampled
    targets over. Sequences too short to draft from (fewer than two tokens after ``start``) are dropped."""
    src = read_dump(reference_path)
    names = list((src.layer_plan or {}).get("tensors") or [])
    H = src.hidden_size or (src.width // max(1, len(names)))
    by_id = {str(s.sample_id or s.key): s for s in src.samples}
    out = []
    for seq in like:
        s = by_id.get(seq.key)
        if s is None:
            continue
        aux = select(s.load(), names, H)
        n = min(aux.shape[0], int(seq.tokens.shape[0]))
        targets = None if seq.targets is None or not keep_targets else seq.targets[:n]
        out.append(SimSequence(seq.key, seq.tokens[:n], aux[:n], seq.start, targets))
    return [s for s in out if s.start <= int(s.tokens.shape[0]) - 2]


def plan_sequences(reference_path, plan: Sequence[str], like: Sequence[SimSequence]) -> list[SimSequence]:
    """Sequences whose aux states are the every-layer reference's tensors ``plan`` (e.g. ``["out(1)", "out(3)",
    "out(4)"]``: the served plan a proposed fix yields), on the tokens of ``like`` (matched by sample id).

    Raises: KeyError: a tensor of ``plan`` the reference dump does not hold."""
    def select(rows, names, H):
        missing = [t for t in plan if t not in names]
        if missing:
            raise KeyError(f"the reference dump holds no {missing[0]!r} (it has {', '.join(names[:6])}, ...)")
        return torch.cat([rows[:, names.index(t) * H:(names.index(t) + 1) * H] for t in plan], dim=-1)
    return reference_sequences(reference_path, like, select)


#: relative difference (Frobenius, over every position from the first generated token) under which the served aux
#: states are the training plan's tensors up to rounding (measured on the embedded TP 2 server's live capture against
#: the HF every-layer reference of the same tokens: 0.000 for the chunks at the right layer; a layer one off 0.28 and
#: more)
SAME_STATES = 0.05


def states_difference(a: Sequence[SimSequence], b: Sequence[SimSequence]) -> Optional[float]:
    """The largest relative difference ``||a - b||_F / ||b||_F`` between the aux states of sequences paired by key, over
    the rows both hold from ``start - 1`` on (float32); None when none pair or widths differ."""
    by = {s.key: s for s in b}
    worst = None
    for s in a:
        t = by.get(s.key)
        if t is None or s.aux.shape[-1] != t.aux.shape[-1]:
            continue
        r0, r1 = max(s.start - 1, 0), min(int(s.aux.shape[0]), int(t.aux.shape[0]))
        if r1 <= r0:
            continue
        x, y = s.aux[r0:r1].float(), t.aux[r0:r1].float()
        den = float(torch.linalg.vector_norm(y)) or 1.0
        d = float(torch.linalg.vector_norm(x - y)) / den
        worst = d if worst is None else max(worst, d)
    return worst
