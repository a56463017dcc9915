"""The draft checkpoint measured as its trainer measured it: teacher-forced per-step (TTT step k) accuracy and loss
over every loss-masked position of a data set, with CIs by bootstrap over sequences.

The forward is the one SGLang serves (:class:`helpers.draft.model.Eagle3Draft`: the same weights, the target's
embedding, the checkpoint's d2t), unrolled as every EAGLE-3 trainer unrolls it in training-time test (TTT): row t of
step 0 takes token ``x[t+1]`` with the target's aux state of position t; step k > 0 takes the recorded token
``x[t+1+k]`` (teacher forcing: the data's tokens, never the draft's own guesses) with the hidden state step k-1 left at
the same row, at position ``t+k``, attending to the step-0 rows ``0..t`` and to its own row of every earlier step. Row
t of step k is scored against the target's distribution at position ``t+1+k`` (the token ``x[t+2+k]``), which comes
from the data's post-norm final hidden state times the target's lm_head (SpecForge ``hidden_state``).

What differs between trainers is which rows count and what counts as right (each function cited):

=============  ===========================================================================================
trainer        per-step metric
=============  ===========================================================================================
``specforge``  ``acc_k`` = sum over rows with ``loss_mask[t+k]`` (the last position of a sample zeroed) of
               [d2t-mapped draft argmax == the target's argmax over the FULL vocabulary] / those rows (a target
               token outside the draft vocabulary counts wrong); ``ploss_k`` = soft cross-entropy against the target's
               distribution restricted to the draft vocabulary, on rows whose target argmax is in the draft
               vocabulary, summed and divided by all positions of the batch (here: by the sample's length, a batch of
               one; padding in a batched run lowers it). ``specforge/algorithms/eagle3/model.py::Eagle3Model.
               _acc_and_loss``, ``::_compute_target_p``, ``specforge/core/loss.py::_compute_loss``,
               ``specforge/algorithms/eagle3/data.py::normalize_offline_sample`` (last loss-mask entry zeroed),
               ``specforge/eval/evaluator.py`` (token-weighted over the eval set).
``torchspec``  accuracy and loss over the rows of ``position_mask`` only (loss mask AND target argmax in the draft
               vocabulary: an out-of-vocabulary target is left out, not counted wrong), loss averaged over those rows.
               ``torchspec/models/eagle3.py::Eagle3Model._calculate_loss`` / ``forward``.
``eagle``      SafeAILab EAGLE-3: [draft argmax == argmax of the target restricted to the draft vocabulary] on
               ``position_mask`` rows, divided by all loss-mask rows (so equal to ``specforge``'s accuracy); ploss as
               SpecForge's. ``eagle/traineagle3/cnets.py::Model.forward``.
``e3f``        this project's trainer (``env/models/e3f_models/draft.py::ttt_loss``): accuracy as SpecForge's, loss
               averaged over the ``position_mask`` rows.
``speculators``  ``full_acc_k`` = rows (loss mask of the predicted position, ``loss_mask[t+1+k]``) whose steps 0..k
               were all right, over those rows (= P(N >= k+1), the joint accuracy); ``cond_acc_k`` = the same count
               over the rows right through step k-1; right = draft argmax == the target's argmax over the draft
               vocabulary. ``src/speculators/models/eagle3/metrics.py::compute_metrics``, ``align_for_step``;
               ``src/speculators/models/metrics.py::compute_accuracy_single_step``;
               ``src/speculators/models/eagle3/data.py::shift_batch``.
=============  ===========================================================================================

Accuracies are pooled over all rows of all sequences (SpecForge's evaluator; EAGLE and this project's trainer average
per-batch ratios, which differ from the pooled value by well under a point for similar batch sizes); the CI is a
percentile bootstrap over sequences.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Literal, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import BadInput
from .model import Eagle3Draft, compute_threads

Trainer = Literal["specforge", "torchspec", "eagle", "e3f", "speculators"]
TRAINERS: tuple[str, ...] = ("specforge", "torchspec", "eagle", "e3f", "speculators")
#: the trainer each training-log format comes from (helpers.draft.training_log.TrainingLog.format)
LOG_TRAINER: dict[str, str] = {"specforge": "specforge", "torchspec": "torchspec", "eagle": "eagle", "e3f": "e3f",
                               "speculators": "speculators"}
#: where each trainer's per-step metric is computed (for the budget's ``source`` lines)
TRAINER_SOURCE: dict[str, str] = {
    "specforge": "specforge/algorithms/eagle3/model.py::Eagle3Model._acc_and_loss (acc_k, ploss_k)",
    "torchspec": "torchspec/models/eagle3.py::Eagle3Model._calculate_loss (acc over position_mask)",
    "eagle": "eagle/traineagle3/cnets.py::Model.forward (acces, plosses)",
    "e3f": "env/models/e3f_models/draft.py::ttt_loss (acc_per_step, loss_per_step)",
    "speculators": "src/speculators/models/eagle3/metrics.py::compute_metrics (full_acc_k, cond_acc_k)",
}


@dataclass
class TFSequence:
    """One data row for the teacher-forced pass.

    Attributes:
        key: sample id.
        input_ids: int64 ``[T]`` the recorded tokens (prompt, then the continuation the data holds).
        loss_mask: ``[T]`` 0/1 as recorded (before any trainer's own zeroing).
        aux: ``[T, W]`` the aux hidden states of the data (row t = position t).
        final_hidden: ``[T, H]`` the target's post-norm final hidden state (SpecForge ``hidden_state``), or None: then
            the recorded next token stands in for the target's argmax (only right for greedy rows) and no loss can be
            computed.
        lm_head: ``[V, H]`` the target's output projection (shared by every sequence of a data set), with
            ``final_hidden``; the target's logits ``final_hidden @ lm_head.T`` are computed in row chunks when the
            sequence is run, never kept whole (a 163840-token vocabulary x 2,000 rows would be 1.3 GB).
    """

    key: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux: torch.Tensor
    final_hidden: Optional[torch.Tensor] = None
    lm_head: Optional[torch.Tensor] = None

    @property
    def has_target(self) -> bool:
        return self.final_hidden is not None and self.lm_head is not None


@dataclass
class SeqRows:
    """Per-row results of one sequence (rows t of step k; arrays indexed by t from 0)."""

    key: str
    T: int
    loss_mask: np.ndarray                   # [T] int
    hit_full: list[np.ndarray]              # per step: [T-1-k] bool, d2t-mapped argmax == full-vocab target argmax
    hit_restr: list[np.ndarray]             # per step: == target argmax over the draft vocabulary
    invocab: list[np.ndarray]               # per step: target argmax (full vocab) is in the draft vocabulary
    ce: list[Optional[np.ndarray]]          # per step: soft cross-entropy against the restricted target distribution


@dataclass
class TFResult:
    """The teacher-forced pass over a data set, reduced for one trainer.

    Attributes:
        trainer: see :data:`TRAINERS`.
        kind: ``marginal`` (``specforge`` / ``torchspec`` / ``eagle`` / ``e3f``) or ``joint`` (``speculators``'
            ``full_acc_k``).
        acc: per step, the pooled accuracy in [0, 1]; acc_ci: per step ``[lo, hi]`` (95 %, bootstrap over sequences).
        cond: ``speculators`` only: ``cond_acc_k`` per step (else None).
        loss / loss_ci: per step, the trainer's loss (nats), None where the data has no target distribution.
        acc_num / acc_den: ``[n_seq, steps]`` per-sequence counts behind ``acc`` (for paired comparisons).
        loss_num / loss_den: the same for the loss (or None).
        rows: loss-masked rows scored at step 0 over all sequences; sequences: their count.
        labels: ``target`` (the target's distribution from the data's final hidden state) or ``recorded`` (the next
            recorded token; no target distribution in the data).
        keys: sequence ids, in the order of the count arrays.
    """

    trainer: str
    kind: str
    acc: list[float]
    acc_ci: list[list[float]]
    cond: Optional[list[float]]
    loss: Optional[list[float]]
    loss_ci: Optional[list[list[float]]]
    acc_num: np.ndarray
    acc_den: np.ndarray
    loss_num: Optional[np.ndarray]
    loss_den: Optional[np.ndarray]
    rows: int
    sequences: int
    labels: str
    keys: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"trainer": self.trainer, "kind": self.kind, "acc": self.acc, "acc_ci": self.acc_ci,
                "cond": self.cond, "loss": self.loss, "loss_ci": self.loss_ci, "rows": self.rows,
                "sequences": self.sequences, "labels": self.labels, "source": TRAINER_SOURCE[self.trainer]}


# ------------------------------------------------------------------------------------------------ the pass

#: rows of target logits computed at once (a chunk is rows x vocab float32)
LOGIT_CHUNK = 256


def target_view(final_hidden: torch.Tensor, lm_head: torch.Tensor, hot: Optional[torch.Tensor], *,
                chunk: int = LOGIT_CHUNK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the trainers read of the target's distribution at each position, from its post-norm final hidden states
    ``[T, H]`` and lm_head ``[V, H]`` (SpecForge's ``target_head``: ``hidden_state @ lm_head.T``), computed in row
    chunks so the ``[T, V]`` logits never exist whole.

    Returns ``(full_arg [T] int64, restr_arg [T] int64 target ids, inv [T] bool, restr_p [T, Vd] float32)``: the argmax
    over the full vocabulary, the argmax over the draft vocabulary ``hot`` (target ids in draft-id order; None: the
    full vocabulary), whether the full argmax is in the draft vocabulary, and the distribution restricted to it
    (softmax over ``hot``: SpecForge ``_compute_target_p``'s ``target_p``)."""
    w = lm_head
    full, restr, inv, probs = [], [], [], []
    member = None
    if hot is not None:
        member = torch.zeros(w.shape[0], dtype=torch.bool)
        member[hot.cpu()] = True
    with compute_threads(w.shape[0] * w.shape[1]):
        for i in range(0, final_hidden.shape[0], chunk):
            lg = (final_hidden[i:i + chunk].to(w.dtype) @ w.T).float()
            fa = lg.argmax(-1)
            full.append(fa)
            if hot is None:
                restr.append(fa)
                inv.append(torch.ones_like(fa, dtype=torch.bool))
                probs.append(torch.softmax(lg, dim=-1))
            else:
                rl = lg[:, hot]
                restr.append(hot[rl.argmax(-1)])
                inv.append(member[fa])
                probs.append(torch.softmax(rl, dim=-1))
    return torch.cat(full), torch.cat(restr), torch.cat(inv), torch.cat(probs)


@torch.no_grad()
def run_sequence(draft: Eagle3Draft, seq: TFSequence, steps: int) -> SeqRows:
    """Unroll the draft ``steps`` TTT steps over one sequence (module docstring) and score every row.

    Raises:
        BadInput: fewer than 3 tokens, aux rows fewer than tokens, or target logits of the wrong shape."""
    ids = seq.input_ids.to(torch.long).cpu().reshape(-1)
    T = int(ids.shape[0])
    if T < 3:
        raise BadInput(f"sequence {seq.key}: {T} token(s), expected at least 3", field="input_ids")
    if seq.aux.shape[0] < T - 1:
        raise BadInput(f"sequence {seq.key}: {seq.aux.shape[0]} aux rows for {T} tokens", field="aux_hidden_state")
    hot = draft.hot_token_id.cpu() if draft.hot_token_id is not None else None
    if hot is None and draft.arch.draft_vocab < draft.arch.vocab:
        # no d2t over a smaller draft vocabulary: draft id i is target id i (``to_target_ids`` is the identity;
        # eagle_worker_v2.py::init_lm_head keeps ``hot_token_id`` None), so the draft's vocabulary is the first draft_vocab target ids
        hot = torch.arange(draft.arch.draft_vocab)
    if seq.has_target:
        if seq.final_hidden.shape[0] != T or seq.lm_head.shape[0] != draft.arch.vocab:
            raise BadInput(f"sequence {seq.key}: final hidden states {tuple(seq.final_hidden.shape)} and lm_head "
                           f"{tuple(seq.lm_head.shape)}, expected [{T}, H] and [{draft.arch.vocab}, H]",
                           field="hidden_state")
        full_arg, restr_arg, inv, restr_p = target_view(seq.final_hidden, seq.lm_head,
                                                        None if hot is None else hot.to(torch.long))
    else:                                     # no target distribution: the recorded next token is the label
        full_arg = torch.cat([ids[1:], ids[-1:]])
        restr_arg = full_arg
        if hot is None:
            inv = torch.ones(T, dtype=torch.bool)
        else:
            member = torch.zeros(draft.arch.vocab, dtype=torch.bool)
            member[hot] = True
            inv = member[full_arg]
        restr_p = None
    ext = draft.extend(ids[1:], seq.aux[: T - 1])
    out = SeqRows(seq.key, T, np.asarray(seq.loss_mask, dtype=np.int64).reshape(-1)[:T], [], [], [], [])

    def score(logits: torch.Tensor, k: int) -> None:
        n = logits.shape[0]                                    # rows 0..n-1, label positions k+1 .. k+n
        lab = torch.arange(n) + k + 1
        pred = draft.to_target_ids(logits.argmax(-1)).cpu()
        out.hit_full.append((pred == full_arg[lab]).numpy())
        out.hit_restr.append((pred == restr_arg[lab]).numpy())
        out.invocab.append(inv[lab].numpy())
        if restr_p is None:
            out.ce.append(None)
        else:
            out.ce.append((-(restr_p[lab] * F.log_softmax(logits.float().cpu(), dim=-1)).sum(-1)).numpy())

    # step 0: rows 0..T-2 (row T-1 would score position T, which does not exist)
    score(ext.logits, 0)
    for k, _, logits in draft.ttt_steps(ext, ids, steps):     # rows 0 .. T-2-k: step-k input x[t+1+k] exists
        score(logits, k)
    return out


# ------------------------------------------------------------------------------------------------ trainers

def _sf_mask(lm: np.ndarray) -> np.ndarray:
    """SpecForge / EAGLE / TorchSpec / ours: the loss mask with the sample's last entry zeroed
    (``normalize_offline_sample``); step k row t reads ``m[t+k]``."""
    m = (lm > 0).astype(bool).copy()
    m[-1] = False
    return m


def _counts(rows: SeqRows, trainer: str, steps: int) -> tuple[np.ndarray, ...]:
    """Per-step ``(acc_num, acc_den, loss_num, loss_den, cond_num, cond_den)`` of one sequence."""
    an, ad, ln, ld, cn, cd = (np.zeros(steps) for _ in range(6))
    T = rows.T
    if trainer == "speculators":
        lm = rows.loss_mask > 0
        prev = None
        for k in range(min(steps, len(rows.hit_restr))):
            n = rows.hit_restr[k].shape[0]
            mask = lm[k + 1: k + 1 + n]                             # loss_mask of the predicted position t+1+k
            right = rows.hit_restr[k].astype(bool)
            if prev is None:
                prev = lm[1:1 + n].copy()                          # prev_correct = the (shifted) loss mask
                cd[k] = float(mask.sum())
            else:
                prev = prev[:n]
                cd[k] = float(prev.sum())
            prev = prev & right
            an[k] = float((prev & mask).sum())
            ad[k] = float(mask.sum())
            cn[k] = an[k]
            if rows.ce[k] is not None:
                ln[k] = float(rows.ce[k][mask].sum())
                ld[k] = float(mask.sum())
        return an, ad, ln, ld, cn, cd
    m = _sf_mask(rows.loss_mask)
    for k in range(min(steps, len(rows.hit_full))):
        n = rows.hit_full[k].shape[0]
        mk = m[k:k + n]
        pm = mk & rows.invocab[k]
        if trainer == "torchspec":
            an[k] = float((rows.hit_restr[k] & pm).sum())
            ad[k] = float(pm.sum())
        elif trainer == "eagle":
            an[k] = float((rows.hit_restr[k] & pm).sum())
            ad[k] = float(mk.sum())
        else:                                                       # specforge, e3f
            an[k] = float((rows.hit_full[k] & mk).sum())
            ad[k] = float(mk.sum())
        if rows.ce[k] is not None:
            ln[k] = float(rows.ce[k][pm].sum())
            ld[k] = float(T if trainer in ("specforge", "eagle") else pm.sum())
    return an, ad, ln, ld, cn, cd


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.maximum(den, 1e-12), np.nan)


def bootstrap_index(n: int, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """``[n_boot, n]`` resampling indices over ``n`` sequences (one seeded generator: every statistic of a run is
    bootstrapped on the same resamples, so paired differences are paired)."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n)) if n > 0 else np.zeros((n_boot, 0), int)


def pooled_ci(num: np.ndarray, den: np.ndarray, idx: np.ndarray) -> list[list[float]]:
    """Per column of ``num / den`` pooled over rows, the 95 % percentile CI over the resamples ``idx``."""
    if num.shape[0] < 2:
        return [[float("nan"), float("nan")] for _ in range(num.shape[1])]
    r = _ratio(num[idx].sum(1), den[idx].sum(1))                  # [B, steps]
    lo, hi = np.nanpercentile(r, [2.5, 97.5], axis=0)
    return [[float(a), float(b)] for a, b in zip(lo, hi)]


def reduce(rows: Sequence[SeqRows], trainer: str, steps: int, *, idx: Optional[np.ndarray] = None,
           labels: str = "target") -> TFResult:
    """Reduce per-row results to one trainer's per-step metrics (module docstring table).

    Raises:
        BadInput: an unknown trainer, or no loss-masked row at step 0."""
    if trainer not in TRAINERS:
        raise BadInput(f"unknown trainer {trainer!r} (expected one of {', '.join(TRAINERS)})", field="trainer")
    c = [_counts(r, trainer, steps) for r in rows]
    an, ad, ln, ld, cn, cd = (np.array([x[i] for x in c]).reshape(len(c), steps) for i in range(6))
    if not len(c) or ad[:, 0].sum() <= 0:
        raise BadInput("no loss-masked row to score: expected samples whose loss_mask marks a continuation",
                       field="loss_mask")
    idx = bootstrap_index(len(c)) if idx is None else idx
    acc = _ratio(an.sum(0), ad.sum(0))
    have_loss = all(r.ce and r.ce[0] is not None for r in rows)
    loss = _ratio(ln.sum(0), ld.sum(0)) if have_loss else None
    return TFResult(trainer=trainer, kind="joint" if trainer == "speculators" else "marginal",
                    acc=[float(x) for x in acc], acc_ci=pooled_ci(an, ad, idx),
                    cond=[float(x) for x in _ratio(cn.sum(0), cd.sum(0))] if trainer == "speculators" else None,
                    loss=None if loss is None else [float(x) for x in loss],
                    loss_ci=pooled_ci(ln, ld, idx) if have_loss else None,
                    acc_num=an, acc_den=ad, loss_num=ln if have_loss else None, loss_den=ld if have_loss else None,
                    rows=int(ad[:, 0].sum()), sequences=len(c), labels=labels, keys=[r.key for r in rows])


def run(draft: Eagle3Draft, seqs: Iterable[TFSequence], steps: int, *,
        progress: Optional[Callable[[str], None]] = None) -> list[SeqRows]:
    """:func:`run_sequence` over every sequence (``progress`` gets one line per sequence)."""
    out = []
    with compute_threads(draft):
        for s in seqs:
            out.append(run_sequence(draft, s, steps))
            if progress is not None:
                progress(f"teacher-forced {s.key} ({out[-1].T} tokens)")
    return out


# ------------------------------------------------------------------------------------------------ accept length

def chain_accept_length(acc: Sequence[float], kind: str, steps: int) -> float:
    """The accept length (tokens per verify step, bonus token included) a chain of ``steps`` drafts gets from per-step
    accuracies: marginal ``1 + sum_k prod_{j<=k} a_j`` (the trainers' own estimate: SpecForge ``simulated_acc_len``
    plus the bonus token; an independence product), joint ``1 + sum_k full_acc_k`` (exact for teacher forcing)."""
    a = [float(x) for x in list(acc)[:steps]]
    if kind == "joint":
        return 1.0 + sum(a)
    total, prod = 1.0, 1.0
    for x in a:
        prod *= x
        total += prod
    return total


def accept_length_ci(res: TFResult, steps: int, idx: np.ndarray) -> tuple[float, float, float, np.ndarray]:
    """``(point, lo, hi, draws)`` of :func:`chain_accept_length` over ``res``'s sequences, bootstrapped on ``idx``
    (``draws`` ``[n_boot]``, for paired differences on the same resamples)."""
    S = min(steps, res.acc_num.shape[1])
    point = chain_accept_length(res.acc[:S], res.kind, S)
    if res.acc_num.shape[0] < 2:
        return point, float("nan"), float("nan"), np.full(idx.shape[0], point)
    r = _ratio(res.acc_num[idx][:, :, :S].sum(1), res.acc_den[idx][:, :, :S].sum(1))   # [B, S]
    if res.kind == "joint":
        draws = 1.0 + np.nansum(r, axis=1)
    else:
        draws = 1.0 + np.nansum(np.cumprod(np.nan_to_num(r, nan=0.0), axis=1), axis=1)
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return point, float(lo), float(hi), draws


def per_sequence_accept_length(res: TFResult, steps: int) -> np.ndarray:
    """Each sequence's own accept length: :func:`accept_length_ci`'s formula on that sequence's rows alone ``[n]``
    (for the decision on few sequences, :func:`helpers.draft.decide.decide`)."""
    n = res.acc_num.shape[0]
    if n < 2:
        return np.full(n, accept_length_ci(res, steps, np.zeros((1, n), int))[0])
    return accept_length_ci(res, steps, np.arange(n)[:, None])[3]


def tf_sequences(samples, lm_head: Optional[torch.Tensor], *, skipped: Optional[list] = None) -> list[TFSequence]:
    """Training-data samples (:class:`helpers.formats.training_data.TrainingData` items) as :class:`TFSequence`:
    each sample's post-norm ``final_hidden`` with the target's ``lm_head [V, H]`` when both exist (else the labels fall
    back to the recorded tokens). A sample with no loss mask, or fewer than 3 tokens, is left out (``skipped`` gets
    ``(key, why)``). The one row reader of the draft stages (:func:`helpers.draft.draft_stage.draft_rows`,
    :func:`helpers.draft.nextn_stage.nextn_draft_stage`): with ``lm_head`` given, every token id must be one of its
    ``V`` rows (the target's vocabulary, which the draft's embedding shares).

    Raises:
        BadInput: a token id >= ``V`` (``input_ids``, the file and the vocabulary size named); aux hidden states that
            hold NaN / Inf (the file named)."""
    out = []
    vocab = None if lm_head is None else int(lm_head.shape[0])
    for s in samples:
        meta = s.meta or {}
        key = str(s.sample_id or s.key)
        mask = meta.get("loss_mask")
        ids = torch.as_tensor(np.asarray(s.input_ids), dtype=torch.long)
        if vocab is not None and len(ids) and int(ids.max()) >= vocab:
            j = int((ids >= vocab).nonzero()[0, 0])
            raise BadInput(f"token id {int(ids[j])} at row {j} is past the target's vocabulary ({vocab} ids: its "
                           f"lm_head rows)", path=meta.get("path") or key, field="input_ids")
        if mask is None or len(ids) < 3 or not (np.asarray(mask) > 0).any():
            if skipped is not None:
                skipped.append((key, "no loss-masked continuation" if len(ids) >= 3 else f"{len(ids)} token(s)"))
            continue
        aux = s.load()
        if not bool(torch.isfinite(aux).all()):
            raise BadInput(f"{int((~torch.isfinite(aux)).sum())} NaN / Inf values in the aux hidden states",
                           path=meta.get("path"), field="aux_hidden_state")
        final = meta.get("final_hidden")
        out.append(TFSequence(key, ids, torch.as_tensor(np.asarray(mask)), aux,
                              final if lm_head is not None else None, lm_head if final is not None else None))
    return out
