"""The acceptance budget's draft stage: the checkpoint against its own training log, like with like.

The log's per-step figures (the trainer's teacher-forced accuracy, and loss, per TTT step, on the split it logged) are
compared with the same figures of the checkpoint, computed as that trainer computes them
(:mod:`helpers.draft.teacher_forced`), on rows of the same kind: the same split (validation rows against validation
metrics, training rows against training metrics) and the same text distribution (the target's sampled continuations
against sampled, greedy against greedy). Where the rows given are unlike the log's, the stage says so and is
``undecided`` (no comparison of unlike quantities is ever made); no log, likewise (the stage then names the published
accept lengths measured under the draft's conditions, :mod:`helpers.draft.reference`, or says none matches).

The stage's loss in tokens per verify step is the log's accept length minus the checkpoint's, both from the same
formula over the same kind of accuracy (:func:`helpers.draft.teacher_forced.chain_accept_length`), with the CI of the
checkpoint's side (bootstrap over sequences; the log's figure is taken as exact); the decision is
:func:`helpers.draft.decide.decide`. A checkpoint materially below its log beyond the CI is ``draft_underperforms``
with the per-step table.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..errors import BadInput
from ..formats.rows import RowsKind, rows_kind, split_word
from ..formats.training_data import TrainingData
from .decide import decide, threshold
from .model import Eagle3Draft, target_lm_head
from .reference import Conditions, match_reference, no_match_words
from .teacher_forced import (LOG_TRAINER, TRAINER_SOURCE, SeqRows, accept_length_ci, bootstrap_index,
                             chain_accept_length, per_sequence_accept_length, reduce, run as tf_run, target_view,
                             tf_sequences)
from .training_log import TrainingLog, find_validation_data

#: the most validation rows the draft stage reads (all of a typical shipped validation set; bounded for time)
MAX_DRAFT_ROWS = 256


@dataclass
class Comparability:
    """Whether rows of kind ``rows`` can stand against a log's figures, and why (or why not)."""

    ok: bool
    why: str
    assumed: list


def log_kind(log: TrainingLog) -> RowsKind:
    """What the log's figures were measured on: its split (validation preferred by the reader) and, where the log
    records its data, the text kind."""
    k = RowsKind(split=split_word(log.split or "") if log.split else None, text=log.data_text)
    if k.split:
        k.source["split"] = f"{log.path} ({', '.join(log.source_keys[:1])} ...: split '{log.split}')"
    if k.text:
        k.source["text"] = log.data_text_source or log.path
    return k


def comparable(rows: RowsKind, log: RowsKind) -> Comparability:
    """Rows stand against the log when neither the split nor the text kind is known to differ. What is unknown on
    one side is assumed alike and listed in ``assumed`` (the stage says so)."""
    assumed = []
    for what in ("split", "text"):
        a, b = getattr(rows, what), getattr(log, what)
        if a is not None and b is not None and a != b:
            words = {"split": f"the rows are {a} rows, the log's figures are {b} figures",
                     "text": f"the rows' continuations are {a}, the log's rows were {b}"}
            return Comparability(False, words[what] + f" ({rows.source.get(what)}; {log.source.get(what)})", assumed)
        if a is None or b is None:
            assumed.append(f"{what}: {'the rows' if a is None else 'the log'} say(s) nothing; taken as alike "
                           f"({'rows: ' + a if a else 'log: ' + b if b else 'neither known'})")
    return Comparability(True, "the rows are of the log's kind" + (" (assumed where unknown)" if assumed else ""),
                         assumed)


def draft_stage(rows: Optional[list[SeqRows]], rows_kind: Optional[RowsKind], rows_path: Optional[str],
                log: Optional[TrainingLog], steps: int, *, labels: str = "target",
                idx: Optional[np.ndarray] = None, reference: Optional[Conditions] = None) -> tuple[dict, dict]:
    """The draft stage and its loss.

    Args:
        rows: the teacher-forced pass over the rows (:func:`helpers.draft.teacher_forced.run`), or None.
        rows_kind / rows_path: what the rows are (:func:`helpers.formats.training_data.rows_kind`) and their folder.
        log: the training log, or None.
        steps: the served ``--speculative-num-steps`` (the token figure covers these steps; the table every step the
            log has).
        labels: ``target`` (the data's final hidden states give the target's distribution) or ``recorded``.
        reference: the draft's conditions (names, served settings) matched against the published accept lengths
            (:func:`helpers.draft.reference.match_reference`) when there is no log: the stage stays ``undecided`` and
            its text carries each matching figure with its conditions and source, or says that none matches.

    Returns:
        ``(stage, loss)``: the stage dict for the budget's ladder (``name``, ``accept_length``, ``ci``, ``table``,
        ``trainer``, ``rows``, ``comparable``, ``source``) and the loss dict (``delta``, ``ci``, ``decision``,
        ``threshold``, ``settle``, ``basis``, ``counts``).
    """
    name = "checkpoint (teacher-forced)"
    if log is None:
        stage = {"name": name, "accept_length": None, "ci": [None, None],
                 "source": "no training log: the checkpoint has nothing to be measured against"}
        why = "no training log was found (give --training-log): whether the checkpoint performs as trained cannot be "
        matches = match_reference(reference) if reference is not None else []
        stage["reference"] = [m.to_json() for m in matches]
        if matches:
            why += ("settled; " + "; ".join(m.text() for m in matches) + " (a published figure is no measurement "
                    "of this checkpoint: compare it with the live accept length under the same conditions)")
        else:
            why += f"settled; {no_match_words()}"
        return stage, _undecided(why, None)
    trainer = LOG_TRAINER[log.format]
    lk = log_kind(log)
    if not rows:
        stage = {"name": name, "accept_length": None, "ci": [None, None], "log_kind": lk.to_json(),
                 "source": "no rows to run the checkpoint on"}
        return stage, _undecided("no rows with aux states to measure the checkpoint on", None)
    comp = comparable(rows_kind or RowsKind(), lk)
    rows_info = {"path": rows_path, "sequences": len(rows), "kind": (rows_kind or RowsKind()).to_json(),
                 "labels": labels}
    if labels == "recorded" and (rows_kind is None or rows_kind.text != "greedy"):
        comp = Comparability(False, "the rows hold no target distribution (no final hidden state) and are not known "
                                    "to be greedy continuations, so the target's argmax is unknown", comp.assumed)
    S = min(steps, len(log.per_position))
    n_steps = len(log.per_position)
    idx = bootstrap_index(len(rows)) if idx is None else idx
    res = reduce(rows, trainer, n_steps, idx=idx, labels=labels)
    log_al = chain_accept_length(log.per_position, "joint" if log.kind == "joint" else "marginal", S)
    al, lo, hi, _ = accept_length_ci(res, S, idx)
    table = []
    for k in range(n_steps):
        row = {"step": k, "log_acc": log.per_position[k], "acc": res.acc[k], "acc_ci": res.acc_ci[k],
               "log_loss": (log.per_position_loss[k] if log.per_position_loss and k < len(log.per_position_loss)
                            else None),
               "loss": None if res.loss is None or trainer == "speculators" else res.loss[k],
               "loss_ci": None if res.loss_ci is None or trainer == "speculators" else res.loss_ci[k]}
        if res.cond is not None:
            row["cond"] = res.cond[k]
        table.append(row)
    stage = {"name": name, "accept_length": al, "ci": [lo, hi], "table": table, "trainer": trainer,
             "metric": ("joint accuracy full_acc_k (speculators)" if res.kind == "joint" else
                        "marginal TTT accuracy acc_k"), "kind": res.kind, "rows": rows_info,
             "log_accept_length": log_al, "log_kind": lk.to_json(), "comparable": comp.ok, "why": comp.why,
             "assumed": comp.assumed,
             "source": (f"the checkpoint run teacher-forced on {len(rows)} sequence(s) of {rows_path} "
                        f"({res.rows} loss-masked rows), scored as {TRAINER_SOURCE[trainer]}; accept length = "
                        + ("1 + sum of the joint accuracies" if res.kind == "joint" else
                           "1 + sum of products of the marginal accuracies (the trainers' own estimate)")
                        + f" over {S} step(s), the same formula for the log")}
    thr = threshold(log_al)
    basis = (f"training log {log_al:.2f} vs the checkpoint {al:.2f} on comparable rows (both {stage['metric']}, "
             f"{S} step(s); {len(rows)} sequence(s))")
    if not comp.ok:
        loss = _undecided(f"not comparable: {comp.why}; to settle it, give rows of the log's kind (--validation DIR: "
                          f"{_kind_words(lk)})", thr)
        loss.update(delta=None, basis=basis + " -- not compared")
        return stage, loss
    d = log_al - al
    dec = decide(d, log_al - hi, log_al - lo, thr, n=len(rows), unit="sequences",
                 per_sequence=log_al - per_sequence_accept_length(res, S))
    loss = {"stage": "draft", "delta": d, "basis": basis, **dec,
            "counts": dec["decision"] == "counts", "material": d >= thr, "beyond_ci": dec["ci"][0] > 0,
            "n": len(rows)}
    return stage, loss


def _kind_words(k: RowsKind) -> str:
    return f"{k.split or 'any'} split, {k.text or 'any'} continuations"


def _undecided(why: str, thr: Optional[float]) -> dict:
    return {"stage": "draft", "delta": None, "ci": [None, None], "basis": why, "decision": "undecided",
            "threshold": thr, "settle": {"n": None, "text": why}, "why": why, "counts": False, "material": False,
            "beyond_ci": False}


def draft_rows(draft: Eagle3Draft, *, draft_dir: Path, target_dir: Path, training: str | Path, hidden_size: int,
               log: Optional[TrainingLog], log_path: Optional[Path], validation: Optional[str | Path] = None,
               rows_word: tuple[Optional[str], Optional[str]] = (None, None), max_rows: int = MAX_DRAFT_ROWS,
               progress: Callable[[str], None] = lambda s: None) -> dict:
    """The rows the draft stage measures the checkpoint on, and the checkpoint's teacher-forced pass over them.

    The rows are the draft's validation rows when there are any (:func:`helpers.draft.training_log.
    find_validation_data`), else the training data given; what they are comes from the user's word
    (``rows_word = (split, text)``, ``--rows``), the data's manifest, or is inferred from the data (the share of
    continuation tokens that are the target's own argmax: >= 98 % greedy, <= 90 % sampled).

    Returns ``{"rows": [SeqRows], "seqs": [TFSequence], "kind": RowsKind, "path": str, "labels", "found"}``.

    Raises:
        BadInput: unreadable rows (the file and field named)."""
    path, found = find_validation_data(draft_dir, training=training, given=validation, log_path=log_path)
    src = path if path is not None else Path(training)
    kind = rows_kind(src, split=rows_word[0], text=rows_word[1])
    td = TrainingData(src, hidden_size=hidden_size, max_samples=max_rows)
    try:
        head, _ = target_lm_head(target_dir)
    except BadInput:
        head = None
    skipped: list = []
    seqs = tf_sequences(td, head, skipped=skipped)
    for key, why in skipped:
        progress(f"row {key} left out of the draft stage: {why}")
    labels = "target" if seqs and all(s.has_target for s in seqs) else "recorded"
    if kind.text is None and labels == "target" and seqs:
        same = total = 0
        for s in seqs:
            m = np.asarray(s.loss_mask).reshape(-1) > 0
            arg = target_view(s.final_hidden, s.lm_head, None)[0]
            hit = (arg[:-1] == s.input_ids[1:]).numpy() & m[1:]
            same, total = same + int(hit.sum()), total + int(m[1:].sum())
        share = same / total if total else float("nan")
        if share >= 0.98:
            kind.text = "greedy"
        elif share <= 0.90:
            kind.text = "sampled"
        if kind.text:
            kind.source["text"] = f"inferred: {share:.1%} of the continuation tokens are the target's own argmax"
    steps = max(4, len(log.per_position) if log is not None else 0)
    progress(f"draft stage: the checkpoint teacher-forced on {len(seqs)} row(s) of {src} ({steps} TTT steps)")
    rows = tf_run(draft, seqs, steps)
    return {"rows": rows, "seqs": seqs, "kind": kind, "path": str(src), "labels": labels, "found": found,
            "steps": steps}


def budget_fields(dr: dict, log: Optional[TrainingLog]) -> dict:
    """:func:`draft_rows`' result as the draft-stage fields of :class:`helpers.draft.budget.BudgetInputs`."""
    return {"log": log, "draft_rows": dr["rows"], "draft_rows_kind": dr["kind"], "draft_rows_path": dr["path"],
            "draft_rows_labels": dr["labels"]}
