"""What kind of draft a run investigated, asked in one place by the views: an EAGLE-3 draft (the default), the
target's own MTP / NextN head (``investigation.json`` ``diagnosis.kind == "mtp"`` or ``attach.draft_head``; an
acceptance budget of its own: ``acceptance.kind == "mtp"``) or an EAGLE-1 draft on vLLM (``"eagle1"``: the same
single-state stages, :mod:`helpers.investigation.single_state`). Each kind answers the questions whose wording differs:
the page title, the speculative algorithm, the draft's description, the ladder's stages per loss and the line under
Findings when there is none. The MTP wording is :mod:`helpers.investigation.mtp`'s."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ..investigation.mtp import (DRAFT_STAGE, LOSS_AT as MTP_LOSS_AT, POST_NORM, algorithm_text, head_text,
                                 profile_of, state_line)
from ..investigation.single_state import EAGLE1 as EAGLE1_PROFILE
from ..plots.budget import LOSS_AT, ORDER, run_of

MTP = "mtp"
EAGLE3 = "eagle3"
EAGLE1 = EAGLE1_PROFILE.kind


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft (:func:`draft_kind`). ``name``: ``"eagle3"``, ``"mtp"`` or ``"eagle1"``; ``head``:
    ``attach.draft_head``
    (None for an EAGLE-3 draft, or a budget read without its investigation)."""
    name: str
    head: Optional[dict] = None

    @property
    def mtp(self) -> bool:
        return self.name == MTP

    @property
    def single_state(self) -> bool:
        """A draft that reads one target state (an MTP head, an EAGLE-1 draft): the stages of
        :mod:`helpers.investigation.mtp` on live prompts."""
        return self.name in (MTP, EAGLE1)

    @property
    def title(self) -> str:
        """The page title."""
        return profile_of(self.name).title if self.single_state else "EAGLE-3 live investigation"

    @property
    def samples_label(self) -> str:
        """What ``investigation.json`` ``samples`` counts."""
        return "live prompts compared (diagnosis)" if self.single_state else "training samples compared (diagnosis)"

    @property
    def budget_samples_label(self) -> str:
        """What the acceptance budget's wiring stage ran on (its ``sequences``)."""
        return ("live prompts in the acceptance budget" if self.single_state else
                "training samples in the acceptance budget")

    @property
    def draft_source(self) -> str:
        """Where :meth:`draft` read the draft's description, when not from the draft folder's config.json."""
        return ("; the head: /server_info and the target's config.json (attach.draft_head, "
                "helpers.draft.mtp_checks)") if self.mtp and self.head else ""

    @property
    def loss_at(self) -> Mapping[str, str]:
        """Loss name -> the budget stage it is measured at (a ladder row)."""
        return MTP_LOSS_AT if self.single_state else LOSS_AT

    @property
    def stage_order(self) -> tuple[str, ...]:
        """The budget's stages in ladder order (the figures draw these): an MTP head's draft, wiring, live."""
        return ((MTP_LOSS_AT["draft"], DRAFT_STAGE, MTP_LOSS_AT["wiring"], MTP_LOSS_AT["engine"]) if self.single_state
                else ORDER)

    def run_of(self, stage: str) -> Optional[str]:
        """The like-with-like run of a budget stage (:func:`helpers.plots.budget.run_of`); every stage of an MTP head's
        budget runs on the same live prompts (:func:`helpers.investigation.mtp.mtp_budget`) but the checkpoint stage, run
        teacher-forced on the rows of the head's training log (:func:`helpers.draft.nextn_stage.nextn_draft_stage`)."""
        if self.single_state:
            return "teacher-forced, the log's rows" if stage == MTP_LOSS_AT["draft"] else "drafting chain, live prompts"
        return run_of(stage)

    def algorithm(self, attach: Mapping[str, Any]) -> str:
        """The speculative algorithm: the server's (``attach.algorithm``); for an MTP head what the launch asked for
        and what SGLang runs (:func:`helpers.investigation.mtp.algorithm_text`)."""
        return algorithm_text(attach.get("algorithm"), self.head) if self.mtp else str(attach.get("algorithm") or "")

    def draft(self, folder: Any, architecture: Callable[[Any], str]) -> str:
        """The draft in a few words: its architecture (``architecture(folder)``, from its config.json); for an MTP
        head the head itself (:func:`helpers.investigation.mtp.head_text`): the draft folder is the target's, whose
        config describes the whole target, not the head."""
        return head_text(self.head) if self.mtp and self.head else architecture(folder)

    def no_finding(self, doc: Any) -> str:
        """The line under Findings when there is none: an EAGLE-3 draft's served chunks equal the training chunks; an
        MTP head's served hidden state is the one it should read (which candidate, its rel. error and the runner-up,
        :func:`helpers.investigation.mtp.state_line`) against the named reference."""
        if not self.single_state:
            return "No finding: every served chunk equals its training chunk."
        p = profile_of(self.name)
        ident = (getattr(doc, "diagnosis", None) or {}).get("served_state")
        ref = (getattr(doc, "reference", None) or {}).get("how") or "none"
        if not ident:
            return f"No finding, and the served hidden state is not identified (reference: {ref})."
        return (f"No finding: the served hidden state is {state_line(ident)}, the one {p.who} should read "
                f"({POST_NORM}: the target's final hidden state after its final norm, as {p.engine} feeds it), on "
                f"{ident.get('rows')} rows of {ident.get('sequences')} live prompt(s); reference: {ref}.")


def draft_kind(doc: Any = None, budget: Optional[Mapping[str, Any]] = None) -> DraftKind:
    """The kind of draft the run investigated: ``doc`` an :class:`helpers.records.InvestigationDoc` (its
    ``diagnosis.kind`` or ``attach.draft_head.kind``), else ``budget`` an acceptance budget (its ``kind``). An EAGLE-3
    draft when neither says ``"mtp"`` (or ``"eagle1"``: an EAGLE-1 draft)."""
    diag = (getattr(doc, "diagnosis", None) or {}) if doc is not None else {}
    head = ((getattr(doc, "attach", None) or {}) if doc is not None else {}).get("draft_head")
    if diag.get("kind") == MTP or (head or {}).get("kind") == MTP or (budget or {}).get("kind") == MTP:
        return DraftKind(MTP, head)
    if EAGLE1 in (diag.get("kind"), (budget or {}).get("kind"),
                  ((getattr(doc, "acceptance", None) or {}) if doc is not None else {}).get("kind")):
        return DraftKind(EAGLE1)
    return DraftKind(EAGLE3)


__all__ = ["DraftKind", "EAGLE1", "EAGLE3", "MTP", "draft_kind"]
