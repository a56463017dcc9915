"""The draft stage of an MTP / NextN head's acceptance budget: the head against its own training log, like with like,
and the settings check of the served chain against the depth the head was trained for.

Where the log is read from (:func:`find_nextn_log`): ``--training-log FILE`` if given; else
``nextn_training_log.json`` (:data:`NEXTN_LOG`, the name ``env/models/train_nextn.py`` writes) in the ``--training``
folder (or its parent) if one is given; else in the NextN checkpoint folder (a separate NextN checkpoint,
``--speculative-draft-model-path``), else in the target folder (where DeepSeek-V3 / Kimi ship the head, as the extra
layer ``model.layers.{num_hidden_layers}.*``).

What is compared (:func:`nextn_draft_stage`): the log's per-step accuracy (the head's argmax == the target's argmax for
token t+2 from token t+1 and the target's post-norm state at t; step k >= 1 the head fed its own output, the chain
SGLang's draft decode runs) against the same accuracy of the head as served (:func:`helpers.draft.loader.load_draft`)
run teacher-forced (:func:`helpers.draft.teacher_forced.run`, the ``e3f`` reduction: the head's argmax against the
target's full-vocabulary argmax on the loss-masked rows, the last row of a sample left out) on rows whose aux is the
data's post-norm final hidden state (SpecForge ``hidden_state``: ``sglang/srt/models/deepseek_nextn.py::
DeepseekModelNextN.forward`` reads ``spec_info.hidden_states``, the target's output after ``final_norm``). A head
that reads the target's last layer output before the final norm (:attr:`helpers.draft.model.Eagle3Draft.
READS_PRE_NORM`: vLLM's MiMo head, ``vllm/model_executor/models/mimo.py::MiMoModel.forward``) runs on the rows' one
``aux_hidden_state`` chunk instead, recorded as ``out(n-1)`` by their ``capture.json`` (:func:`pre_norm_sequences`).
The comparison itself, its CI and decision are :func:`helpers.draft.draft_stage.draft_stage`'s (the EAGLE-3 budget's).

Which figure of the log: a log may hold the figure of its own validation split (``val_final``, on the training
data's rows) and the figure on a named set of rows (``validation_rows``: ``path``, ``rows``, ``acc_per_step``). When
the rows the head can be run on here are those very rows (:func:`same_rows`), the ``validation_rows`` figure is
compared: same metric, positions and rows. Otherwise the log's main figure is compared on other rows of the kind
the rows' manifests say; the stage says so and a material loss there never counts (rows differ): it can only be
cleared (the CI rules the loss out) or stay ``undecided``.

The settings (:func:`steps_check`): ``hyper.train_steps`` of the log is the chain depth the head was trained for
(DeepSeek-V3 trains its MTP module at depth 1). SGLang serves a NextN head for ``--speculative-num-steps`` steps,
the one head reused at every step (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.draft_forward``);
with no steps given ``sglang/srt/arg_groups/speculative_hook.py::handle_speculative_decoding`` ->
``_auto_choose_speculative_params`` picks 3 for DeepSeek. Steps beyond the trained depth are a setting the head was
never trained for: named with the per-step accuracy at those steps.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import BadInput
from ..formats.rows import RowsKind, rows_kind
from ..formats.configs import read_target_config
from ..formats.training_data import TrainingData, recorded_layer_ids
from ..runfiles import regular_file
from .decide import threshold
from .draft_stage import MAX_DRAFT_ROWS, draft_stage
from .model import Eagle3Draft, target_lm_head
from .teacher_forced import run as tf_run, tf_sequences
from .training_log import TrainingLog, find_validation_data, read_training_log, validation_rows_checked

#: the NextN training log's file name (``env/models/train_nextn.py`` LOG_NAME)
NEXTN_LOG = "nextn_training_log.json"
#: the trainer whose metric the log's figures are in (the ``e3f`` reduction of :mod:`helpers.draft.teacher_forced`)
NEXTN_TRAINER_SOURCE = "env/models/e3f_models/nextn.py::nextn_loss (acc per chain step)"
#: where SGLang reuses the one head at every draft step
STEPS_SOURCE = "sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.draft_forward"


def find_nextn_log(target_dir: str | Path, *, draft_dir: Optional[str | Path] = None,
                   training: Optional[str | Path] = None, given: Optional[str | Path] = None,
                   name: str = NEXTN_LOG, search_target: bool = True) -> Optional[Path]:
    """The NextN head's training log (module docstring: ``given``, the ``--training`` folder or its parent, the
    NextN checkpoint folder, the target folder), or None. ``name``: the log's file name (another single-state draft's
    trainer writes another, e.g. :data:`helpers.draft.eagle1_stage.EAGLE1_LOG`); ``search_target`` False: not the
    target folder (where that name is the target's own log).

    Raises:
        BadInput: ``given`` is not a regular file (``--training-log`` named)."""
    if given is not None:
        try:
            return regular_file(Path(given), "training log")
        except BadInput as exc:
            raise BadInput(exc.message, path=given, field="--training-log") from None
    places = []
    if training is not None:
        t = Path(training)
        places += [t if t.is_dir() else t.parent, (t if t.is_dir() else t.parent).parent]
    if draft_dir is not None:
        places.append(Path(draft_dir))
    if search_target:
        places.append(Path(target_dir))
    for folder in places:
        if (folder / name).is_file():
            return folder / name
    return None


def _raw_log(path: Path) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BadInput(f"not readable JSON ({exc})", path=path) from None
    if not isinstance(doc, dict):
        raise BadInput("expected a JSON object (the NextN trainer's log)", path=path)
    vr = validation_rows_checked(doc, path)
    return doc if vr is None else {**doc, "validation_rows": vr}


def _recorded_rows_path(doc: dict, log_path: Path) -> Optional[Path]:
    vr = doc.get("validation_rows")
    p = vr.get("path") if isinstance(vr, dict) else None
    if not isinstance(p, str) or not p:
        return None
    q = Path(p)
    return q if q.is_absolute() else (log_path.parent / q)


#: how many folders above the log's are searched for its relocated validation rows (:func:`relocated_rows`)
RELOCATE_DEPTH = 4


def relocated_rows(doc: dict, log_path: Path) -> Optional[Path]:
    """The log's ``validation_rows.path`` if it exists; else the same data set in this checkout: the path's last
    three components (e.g. ``kimi/data/validation``) under the log's folder or one of its :data:`RELOCATE_DEPTH`
    parents (a log written in another checkout records its absolute path). None when neither exists."""
    rec = _recorded_rows_path(doc, log_path)
    if rec is None:
        return None
    if rec.is_dir():
        return rec
    tail = Path(*rec.parts[-3:]) if len(rec.parts) >= 3 else None
    if tail is None:
        return None
    for up in [log_path.parent, *list(log_path.resolve().parent.parents)[:RELOCATE_DEPTH]]:
        if (up / tail).is_dir():
            return up / tail
    return None


def same_rows(rows_path: Path, doc: dict, log_path: Path, n_rows: int) -> tuple[bool, str]:
    """Whether ``rows_path`` holds the rows the log's ``validation_rows`` figure was measured on: the same folder
    (resolved), or a folder with the same last three path components (the same data set in another checkout) and the
    same number of rows. Returns ``(same, why)``."""
    vr = doc.get("validation_rows")
    if not isinstance(vr, dict) or not vr.get("acc_per_step"):
        return False, f"the log has no validation_rows figure ({log_path})"
    rec = _recorded_rows_path(doc, log_path)
    if rec is None:
        return False, "the log's validation_rows name no path"
    if rec.exists() and rec.resolve() == rows_path.resolve():
        return True, f"the log's validation_rows are these rows ({rec})"
    tail = lambda p: Path(p).resolve().parts[-3:] if Path(p).exists() else Path(p).parts[-3:]  # noqa: E731
    if tail(rec) == tail(rows_path) and int(vr.get("rows") or -1) == n_rows:
        return True, (f"the log's validation_rows were measured on {rec} ({vr.get('rows')} rows): the same data set "
                      f"name ({'/'.join(tail(rec))}) and row count here (assumed the same rows)")
    return False, (f"the log's validation_rows were measured on {rec} ({vr.get('rows')} rows), not on "
                   f"{rows_path} ({n_rows} rows)")


def rows_log(doc: dict, log_path: Path, kind: RowsKind) -> TrainingLog:
    """The log's ``validation_rows`` figures as a :class:`TrainingLog` of the rows' own kind (they were measured on
    these rows).

    Raises:
        BadInput: the block or its figures malformed (:func:`helpers.draft.training_log.validation_rows_checked`),
            or no ``acc_per_step``."""
    vr = validation_rows_checked(doc, log_path)
    if vr is None or not vr.get("acc_per_step"):
        raise BadInput("expected an acc_per_step list (one accuracy in [0, 1] per draft step)", path=log_path,
                       field="validation_rows.acc_per_step")
    acc = list(vr["acc_per_step"])
    loss = list(vr.get("loss_per_step") or []) or None
    return TrainingLog(path=str(log_path), format="e3f", kind="marginal", per_position=acc,
                       source_keys=[f"validation_rows/acc_per_step[{k}]" for k in range(len(acc))],
                       split=kind.split or "val", per_position_loss=loss,
                       loss_keys=[f"validation_rows/loss_per_step[{k}]" for k in range(len(loss or []))],
                       data_text=kind.text, data_text_source=f"{log_path} (validation_rows: these rows)")


def trained_steps(doc: dict, path: str | Path) -> Optional[int]:
    """The chain depth the head was trained for (``hyper.train_steps`` of the log at ``path``: an int >= 1, as
    ``env/models/train_nextn.py`` writes it), or None when the log does not say (no ``hyper`` object or no
    ``train_steps`` in it, or null).

    Raises:
        BadInput: ``hyper.train_steps`` present but not an int >= 1 (a bool, a float such as ``Infinity`` or 1.0, a
            string, 0 or below), naming the file and the field: a depth the log states wrongly is never guessed."""
    hyper = doc.get("hyper")
    v = hyper.get("train_steps") if isinstance(hyper, dict) else None
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise BadInput(f"expected an integer >= 1 (the chain depth the head was trained for), got {v!r}"[:200],
                       path=path, field="hyper.train_steps")
    return v


def pre_norm_sequences(seqs: list, rows_path: Path, target_dir: str | Path, who: str) -> list:
    """The teacher-forced sequences of a head that reads the target's last decoder layer output before the final norm
    (:attr:`helpers.draft.model.Eagle3Draft.READS_PRE_NORM`: vLLM's MiMo head, ``vllm/model_executor/models/mimo.py::
    MiMoModel.forward``): each row's aux is the data's one ``aux_hidden_state`` chunk, which the rows' ``capture.json``
    must record as ``layer_ids.specforge_out_i`` = ``[num_hidden_layers - 1]`` (out(n-1)); the labels stay the
    post-norm ``hidden_state``'s. ``seqs``: :func:`helpers.draft.teacher_forced.tf_sequences` of the rows.

    Raises:
        BadInput: the rows record no layer ids or other ones than ``[n-1]``, or a row's aux is not one hidden state
            wide (the manifest / field named)."""
    tcfg = read_target_config(Path(target_dir))
    n = int(tcfg.num_hidden_layers)
    got = recorded_layer_ids(rows_path)
    if got is None or got[0] != [n - 1]:
        raise BadInput(f"{who} reads the target's out({n - 1}) before the final norm; the rows must carry it as their "
                       f"one aux_hidden_state chunk with capture.json layer_ids.specforge_out_i = [{n - 1}] (found "
                       f"{None if got is None else got[0]})", path=rows_path if got is None else got[1],
                       field="layer_ids.specforge_out_i")
    H = int(tcfg.hidden_size)
    bad = [s.key for s in seqs if s.aux.shape[1] != H]
    if bad:
        raise BadInput(f"aux_hidden_state of {bad[0]} is not one hidden state ({H}) wide", path=rows_path,
                       field="aux_hidden_state")
    return [s for s in seqs if s.final_hidden is not None]


def nextn_draft_stage(head: Eagle3Draft, target_dir: str | Path, steps: int, *, draft_dir: Optional[str | Path] = None,
                      training: Optional[str | Path] = None, training_log: Optional[str | Path] = None,
                      validation: Optional[str | Path] = None, max_rows: int = MAX_DRAFT_ROWS,
                      progress: Callable[[str], None] = lambda s: None, log_name: str = NEXTN_LOG,
                      trainer_source: str = NEXTN_TRAINER_SOURCE, who: str = "the NextN head",
                      search_target: bool = True) -> dict:
    """The NextN head's draft stage (module docstring).

    Args:
        head: the offline head (:func:`helpers.draft.loader.load_draft` of the served draft folder).
        target_dir: the target folder (its lm_head gives the target's argmax from the rows' final hidden states).
        steps: the served ``--speculative-num-steps`` (the accept length covers min(steps, the log's steps)).
        draft_dir / training / training_log: where the log is looked for (:func:`find_nextn_log`).
        log_name / trainer_source / who / search_target: the log's file name, the trainer whose metric it holds, the
            draft's name in the stage's words, whether the target folder is searched for the log (defaults: the
            NextN head's; an EAGLE-1 draft's: :mod:`helpers.draft.eagle1_stage`).
        validation: the rows (``--validation DIR``, SpecForge format with ``hidden_state``); else the log's
            ``validation_rows.path`` (:func:`relocated_rows`), else
            :func:`helpers.draft.training_log.find_validation_data` (a ``validation`` folder beside the
            ``--training`` data or in the draft folder).

    Returns:
        ``{"stage", "loss", "log" (path or None), "rows" (path or None), "same_rows", "why_rows", "trained_steps",
        "log_steps", "table"}``: ``stage`` / ``loss`` as :func:`helpers.draft.draft_stage.draft_stage` returns them
        (``loss["decision"]`` ``counts`` / ``clear`` / ``undecided``).

    Raises:
        BadInput: an unreadable log or rows (the file named)."""
    target_dir = Path(target_dir)
    log_path = find_nextn_log(target_dir, draft_dir=draft_dir, training=training, given=training_log, name=log_name,
                              search_target=search_target)
    out: dict[str, Any] = {"log": None if log_path is None else str(log_path), "rows": None, "same_rows": False,
                           "trained_steps": None}
    if log_path is None:
        stage, loss = draft_stage(None, None, None, None, steps)
        loss["why"] = loss["basis"] = (f"no training log of {who} ({log_name} in the target folder, the draft "
                                       "folder or the --training folder; or --training-log FILE): "
                                       f"whether {who} performs as trained cannot be settled")
        loss["settle"] = {"n": None, "text": loss["why"]}
        return {**out, "stage": stage, "loss": loss, "why_rows": "no log"}
    doc = _raw_log(log_path)
    out["trained_steps"] = trained_steps(doc, log_path)
    rows_path = Path(validation) if validation is not None else None
    if rows_path is not None and not rows_path.exists():
        raise BadInput("validation rows not found", path=rows_path, field="--validation")
    if rows_path is None:
        rows_path = relocated_rows(doc, log_path)
        if rows_path is None:
            rows_path, _ = find_validation_data(Path(draft_dir or target_dir), training=training)
    if rows_path is None:
        log = read_training_log(log_path)
        stage, loss = draft_stage(None, None, None, log, steps)
        rec = _recorded_rows_path(doc, log_path)
        loss["why"] = loss["basis"] = ("no rows to run the head on: give --validation DIR"
                                       + (f" (the log's validation_rows were measured on {rec})" if rec else ""))
        loss["settle"] = {"n": None, "text": loss["why"]}
        return {**out, "stage": stage, "loss": loss, "why_rows": "no rows"}
    kind = rows_kind(rows_path)
    td = TrainingData(rows_path, hidden_size=head.arch.hidden, max_samples=max_rows)
    lm_head, _ = target_lm_head(target_dir)
    seqs = tf_sequences(td, lm_head)
    if head.READS_PRE_NORM:
        seqs = pre_norm_sequences(seqs, rows_path, target_dir, who)
    else:
        # the NextN head reads the target's post-norm final state (the data's hidden_state), not the EAGLE-3 aux chunks
        seqs = [dataclasses.replace(s, aux=s.final_hidden) for s in seqs if s.final_hidden is not None]
    if not seqs:
        raise BadInput(f"no row holds the target's final hidden state (SpecForge hidden_state): {who}'s input",
                       path=rows_path, field="hidden_state")
    same, why = same_rows(rows_path, doc, log_path, len(seqs))
    log = rows_log(doc, log_path, kind) if same else read_training_log(log_path)
    n_steps = max(steps, len(log.per_position))
    progress(f"draft stage: {who} teacher-forced on {len(seqs)} row(s) of {rows_path} ({n_steps} steps)")
    rows = tf_run(head, seqs, n_steps)
    stage, loss = draft_stage(rows, kind, str(rows_path), log, steps, labels="target")
    stage["trainer"] = trainer_source
    stage["rows_vs_log"] = why
    if not same:
        stage["assumed"] = list(stage.get("assumed") or []) + [why]
        if loss.get("decision") == "counts":
            thr = loss.get("threshold") or threshold(stage.get("log_accept_length"))
            loss.update(decision="undecided", counts=False,
                        why=f"{why}: a loss on other rows than the log's is no measurement of this head against its "
                            "training; give --validation with the log's own rows to settle it",
                        settle={"n": None, "text": "the log's own rows (--validation)"}, threshold=thr)
    return {**out, "stage": stage, "loss": loss, "rows": str(rows_path), "same_rows": same, "why_rows": why,
            "log_steps": len(log.per_position)}


def steps_check(served_steps: int, trained: Optional[int], stage: Optional[dict]) -> Optional[dict]:
    """The settings check: ``None`` when the served chain is within the trained depth (or the log does not say);
    else ``{"served_steps", "trained_steps", "untrained": [{"step", "log_acc", "acc", "acc_ci"}], "source"}`` with
    the draft stage's teacher-forced per-step accuracies at the steps beyond the trained depth (``stage``: the
    ``stage`` of :func:`nextn_draft_stage`, or None)."""
    if trained is None or served_steps <= trained:
        return None
    table = (stage or {}).get("table") or []
    untrained = [{k: r.get(k) for k in ("step", "log_acc", "acc", "acc_ci")} for r in table
                 if trained <= r["step"] < served_steps]
    return {"served_steps": served_steps, "trained_steps": trained, "untrained": untrained,
            "source": f"the log's hyper.train_steps; {STEPS_SOURCE} reuses the one head at every step"}


__all__ = ["NEXTN_LOG", "NEXTN_TRAINER_SOURCE", "RELOCATE_DEPTH", "STEPS_SOURCE", "find_nextn_log", "nextn_draft_stage",
           "pre_norm_sequences", "relocated_rows", "rows_log",
           "same_rows", "steps_check", "trained_steps"]
