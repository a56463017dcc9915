"""The draft stage of an EAGLE-1 draft's acceptance budget (vLLM ``method: eagle``): the draft against its own
training log, like with like. The comparison is the NextN head's (:func:`helpers.draft.nextn_stage.nextn_draft_stage`:
both drafts read one target state, the post-final-norm hidden state, rather than aux chunks) with the EAGLE-1
trainer's log and metric:

* **the log**: ``--training-log FILE``; else :data:`EAGLE1_LOG` in the ``--training`` folder (or its parent), else in
  the draft folder (where ``env/models/train_eagle1.py`` writes it). Never the target folder's: a file of that name
  there is the target's own log.
* **the metric** (``env/models/train_eagle1.py::losses``, :data:`EAGLE1_TRAINER_SOURCE`): the draft's argmax against
  the target's argmax for token t+2, from token t+1 and the target's post-norm state at t (what vLLM 0.32.0 hands
  ``drafter.propose`` for ``method: eagle``: ``vllm/v1/worker/gpu_model_runner.py`` passes ``hidden_states`` when
  ``use_aux_hidden_state_outputs`` is False), teacher-forced, every row but the last of each sequence. The trainer
  logs step 0 only (``val_final.acc_per_step``, one entry), so the stage compares the accept length of one step,
  ``1 + a0``, whatever the served chain.
* **the rows**: the log's ``validation_rows.path`` (``llama_h64/draft_eagle1/validation``: the trainer's own held-out
  sequences, SpecForge layout with ``hidden_state`` = the post-norm state) when they exist here: then a loss can count.
  Other rows (``--validation``) are compared against the log's split figure and a loss there never counts.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from .draft_stage import MAX_DRAFT_ROWS
from .model import Eagle3Draft
from .nextn_stage import nextn_draft_stage

#: the EAGLE-1 trainer's log name (``env/models/train_eagle1.py`` writes it into the draft folder)
EAGLE1_LOG = "training_log.json"
#: the trainer whose metric the log's figures are in
EAGLE1_TRAINER_SOURCE = "env/models/train_eagle1.py::losses (acc: step 0, teacher-forced, every row)"
#: the draft's name in the stage's words
WHO = "the EAGLE-1 draft"


def eagle1_draft_stage(head: Eagle3Draft, target_dir: str | Path, steps: int, *,
                       draft_dir: Optional[str | Path] = None, training: Optional[str | Path] = None,
                       training_log: Optional[str | Path] = None, validation: Optional[str | Path] = None,
                       max_rows: int = MAX_DRAFT_ROWS, progress: Callable[[str], None] = lambda s: None) -> dict:
    """The EAGLE-1 draft's draft stage (module docstring): :func:`helpers.draft.nextn_stage.nextn_draft_stage` with
    the EAGLE-1 trainer's log (:data:`EAGLE1_LOG`, not searched in the target folder) and metric.

    Args:
        head: the offline draft (:func:`helpers.draft.loader.load_draft` -> :class:`helpers.draft.eagle1.Eagle1Draft`).
        target_dir: the target folder (its lm_head: the target's argmax from the rows' post-norm states, float32).
        steps: the served chain length (``num_speculative_tokens``).
        draft_dir / training / training_log / validation / max_rows / progress: as ``nextn_draft_stage``.

    Returns:
        ``nextn_draft_stage``'s dict (``stage``, ``loss`` with ``decision`` counts / clear / undecided, ``log``,
        ``rows``, ``same_rows``, ``why_rows``, ``trained_steps``, ``log_steps``).

    Raises:
        BadInput: an unreadable log or rows (the file named)."""
    return nextn_draft_stage(head, target_dir, steps, draft_dir=draft_dir, training=training,
                             training_log=training_log, validation=validation, max_rows=max_rows, progress=progress,
                             log_name=EAGLE1_LOG, trainer_source=EAGLE1_TRAINER_SOURCE, who=WHO,
                             search_target=False)


__all__ = ["EAGLE1_LOG", "EAGLE1_TRAINER_SOURCE", "WHO", "eagle1_draft_stage"]
