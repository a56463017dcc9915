"""The draft checkpoint's offline inputs, gathered in one place for every caller that runs the draft without a server:
``python -m helpers simulate``, the acceptance budget of a live investigation
(:func:`helpers.investigation.acceptance.run_budget`) and the standalone draft test
(:func:`helpers.investigation.checks.check_draft_standalone`, the seeds' "standalone test" of the draft).

What is gathered, in this order (bad input is found before the long parts): the draft's architecture
(:class:`helpers.draft.model.DraftArch`), its training log (:func:`helpers.draft.training_log.find_training_log`),
the checkpoint loaded with the tensors the serving engine's loader rules give it (``loader``; default
:func:`helpers.draft.model.default_loader`) in the compute dtype chosen by the caller
(:func:`helpers.draft.precision.choose_dtype`), the draft stage's teacher-forced pass over rows of the log's kind
(:func:`helpers.draft.draft_stage.draft_rows`), the drafting-chain sequences of the training data
(:func:`helpers.draft.budget.training_sequences`), those of a served capture of the same tokens when one is given
(:func:`helpers.draft.budget.dump_sequences`, aligned on the training samples' first continuation row), and one
draft forward's cost relative to a verify step (:func:`helpers.draft.budget.draft_cost`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import BadInput
from ..formats.training_data import TrainingData
from .budget import BudgetInputs
from .cost import draft_cost as step_cost
from .sequences import dump_sequences, training_sequences
from .draft_stage import budget_fields, draft_rows
from .loader import load_draft
from .model import DraftArch, Eagle3Draft
from .precision import DtypeChoice
from .reference import ENGINES, Conditions, model_name
from .simulate import DraftSettings, SimSequence
from .training_log import TrainingLog, find_training_log, read_training_log


@dataclass
class OfflineInputs:
    """The draft run offline and what it runs on (module docstring).

    Attributes:
        draft: the checkpoint as SGLang serves it (:class:`~helpers.draft.model.Eagle3Draft`).
        log / log_path: its training log (None when none was found).
        rows: :func:`~helpers.draft.draft_stage.draft_rows`' result (the draft stage's rows and teacher-forced pass).
        training: drafting-chain sequences of the first ``samples`` training samples.
        served: the same tokens' served aux states (:func:`~helpers.draft.budget.dump_sequences`), or None.
        cost / cost_source: one draft forward's cost relative to a verify step, and where it comes from.
        skipped: ``(sample, why)`` for training samples left out (too short, no continuation).
        names: ``(draft, target)`` names (config ``_name_or_path`` or folder name,
            :func:`helpers.draft.reference.model_name`): with the served settings, the conditions the draft stage
            matches published accept lengths on when there is no training log.
    """

    draft: Eagle3Draft
    log: Optional[TrainingLog]
    log_path: Optional[Path]
    rows: dict
    training: list[SimSequence]
    served: Optional[list[SimSequence]]
    cost: float
    cost_source: str
    skipped: list = field(default_factory=list)
    names: tuple = (None, None)

    def budget_inputs(self, settings: DraftSettings, *, engine: Optional[str] = None, **extra: Any) -> BudgetInputs:
        """:class:`~helpers.draft.budget.BudgetInputs` of these inputs at ``settings`` (served ``(steps, topk,
        draft_tokens)``); ``extra`` adds the live fields (``live_sequences``, ``live``, ``max_new_tokens``, ``fix``,
        ``draft_fix``) or replaces ``training`` / ``served_training``. ``engine`` (``sglang`` / ``vllm``, the server's
        adapter; another name is unknown) joins the names and settings in the conditions published accept lengths are
        matched on."""
        reference = Conditions(target_model=self.names[1], draft_model=self.names[0], steps=settings.steps,
                               topk=settings.topk, draft_tokens=settings.draft_tokens,
                               engine=engine if engine in ENGINES else None)
        base = dict(settings=settings, **budget_fields(self.rows, self.log), training=self.training,
                    served_training=self.served, draft_cost=self.cost, draft_cost_source=self.cost_source,
                    reference=reference)
        return BudgetInputs(**{**base, **extra})


def offline_inputs(draft_dir: str | Path, target_dir: str | Path, training: str | Path, *, hidden_size: int,
                   choice: DtypeChoice, samples: int, served: Optional[str | Path] = None,
                   training_log: Optional[str | Path] = None, log: Optional[TrainingLog] = None,
                   validation: Optional[str | Path] = None,
                   rows_word: tuple[Optional[str], Optional[str]] = (None, None), device: Any = "cpu",
                   draft_cost: Optional[float] = None, progress: Callable[[str], None] = lambda s: None,
                   loader: Any = None) -> OfflineInputs:
    """Gather the draft's offline inputs (module docstring).

    Args:
        draft_dir / target_dir: the draft folder (config.json + safetensors) and the target folder (config.json and
            the safetensors holding ``embed_tokens``; only that tensor, and the lm_head a draft borrows, is read).
        training: the draft's training data (SpecForge, speculators, EAGLE, or an e3f dump).
        hidden_size: the target's hidden size H (each aux chunk is H wide).
        choice: the compute dtype and why (:func:`helpers.draft.precision.choose_dtype`).
        samples: training samples turned into drafting-chain sequences (the first ``samples``).
        served: a served capture of the same training tokens (an e3f dump folder), or None.
        training_log / log / validation / rows_word: the log's path (default: looked for in the draft folder) and,
            when the caller has read it already, the log itself; the draft stage's rows (default: a ``validation`` folder beside the training data or in the draft folder), and what the
            rows are when their capture.json does not say (``(split, text)``).
        device: torch device of the offline run.
        draft_cost: one draft forward's cost relative to one verify step (None: from the parameter counts).
        progress: called with one line per step.
        loader: the serving engine's draft loader rules (``EngineAdapter.loader_rules``: which embedding, lm_head, d2t
            and norms the engine runs the draft with; default :func:`helpers.draft.model.default_loader`): the
            offline run, the draft stage's teacher-forced pass included, runs the draft as that engine does.

    Raises:
        BadInput: a draft config of no EAGLE-3 class SGLang serves, a checkpoint whose keys or shapes do not match its
            config, a missing target embedding, a training log in an unknown format, unreadable rows or dumps (the
            file and field named).
    """
    draft_dir, target_dir = Path(draft_dir), Path(target_dir)
    if draft_cost is not None and not (0 < draft_cost < 10):
        raise BadInput(f"{draft_cost} is no ratio in (0, 10) (a draft forward's cost over a verify step's, "
                       "e.g. 0.05)", field="--draft-cost")
    DraftArch.from_config(draft_dir, loader)                            # the draft is checked before its log
    log_path = Path(training_log) if log is not None and training_log is not None else \
        find_training_log(draft_dir, training_log)
    if log is None and log_path is not None:
        log = read_training_log(log_path)
    draft = load_draft(draft_dir, target_dir, dtype=choice.dtype, device=device, dtype_reason=choice.reason,
                       loader=loader)
    progress(f"draft {draft_dir}: {draft.arch.architecture}, hidden {draft.arch.hidden}, {draft.arch.num_aux} aux "
             f"chunks; embedding from {draft.sources['embed']}; lm_head {draft.sources['lm_head']}; "
             f"d2t {draft.sources['d2t']}")
    rows = draft_rows(draft, draft_dir=draft_dir, target_dir=target_dir, training=training, hidden_size=hidden_size,
                      log=log, log_path=log_path, validation=validation, rows_word=rows_word, progress=progress)
    skipped: list = []
    train = training_sequences(TrainingData(training, hidden_size=hidden_size, max_samples=samples), skipped=skipped)
    for where, why in skipped:
        progress(f"training sample {where} left out: {why}")
    served_seqs = dump_sequences(served, starts={s.key: s.start for s in train}) if served is not None else None
    cost, cost_src = step_cost(draft_dir, target_dir, draft_cost=draft_cost)
    return OfflineInputs(draft=draft, log=log, log_path=log_path, rows=rows, training=train, served=served_seqs,
                         cost=cost, cost_source=cost_src, skipped=skipped,
                         names=(model_name(draft_dir), model_name(target_dir)))
