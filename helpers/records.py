"""Typed records the suite writes and reads: diagnosis findings, the replay document and its steps
(discriminated by ``kind``), and what each notebook passes on (discriminated by ``notebook``).

They are JSON documents in a run folder (``results/replay-<case>.json``, ``results/<notebook>.json``); the writers
build these models and dump them, the readers validate them back, so a field renamed on one side fails loudly
instead of reading ``None``. Unknown extra fields are kept (``extra="allow"``) so that older run folders still
open.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter

from .kinds import check_kind

#: a finding kind: a name declared in :data:`helpers.kinds.KINDS` (validated on construction and on read)
KindName = Annotated[str, AfterValidator(check_kind)]


class Record(BaseModel):
    model_config = ConfigDict(extra="allow")

    def get(self, key: str, default: Any = None) -> Any:
        """Mapping-style access for templates and tables (``getattr`` with a default)."""
        return getattr(self, key, default)


class Finding(Record):
    """A diagnosis finding (DESIGN.md "Findings"): ``kind`` declared in :mod:`helpers.kinds`,
    the served ``chunk`` (None for the whole width, a config or the training data), a one-line ``detail`` and the
    ``evidence`` (numbers, identities and where they came from)."""

    kind: KindName
    chunk: Optional[int] = None
    detail: str = ""
    evidence: dict = Field(default_factory=dict)


class ProposedFix(Record):
    """The change that makes the served aux hidden states equal the training data (helpers.investigation.propose).

    ``kind``: ``none`` (nothing to fix), ``config`` (draft config / server flags / draft tensors: ``applicable``, a
    relaunch can apply and measure it), ``engine`` (a change in the engine's capture path, in words), ``mixed``.
    ``draft_config``: overrides deep-merged into the draft's config.json (None removes a key); ``server_args``:
    launch flags to set; ``add_tensors``: ``{tensor: file}`` to add to the draft weights; ``drop_tensors``: draft
    tensors to leave out; ``expected_served``: the served plan after the fix under the server's engine rules; ``why``: where each part comes from;
    ``workaround``: a stopgap config when the real fix is in the engine (untested unless measured)."""

    kind: str = "none"
    summary: str = ""
    parts: list[str] = Field(default_factory=list)
    engine: list[str] = Field(default_factory=list)
    draft_config: dict = Field(default_factory=dict)
    server_args: dict = Field(default_factory=dict)
    add_tensors: dict = Field(default_factory=dict)
    drop_tensors: list[str] = Field(default_factory=list)
    expected_served: Optional[list[str]] = None
    why: list[str] = Field(default_factory=list)
    addresses: list[str] = Field(default_factory=list)
    unaddressed: list[str] = Field(default_factory=list)
    applicable: bool = False
    workaround: Optional[dict] = None


class HypothesisEntry(Record):
    """One check's outcome as an investigation records it (``investigation.json`` ``hypotheses``, and the replay's
    investigate step): the recorded form of :class:`helpers.investigation.checks.HypothesisResult`
    (:meth:`~helpers.investigation.checks.HypothesisResult.entry`). ``short``: the one-line evidence; ``evidence``:
    the check's table as records; ``figure``: the figure's JSON file, relative to the run folder, or None.
    Entries also read as mappings (``entry["verdict"]``)."""

    check: str = ""
    title: str = ""
    question: str = ""
    verdict: Optional[str] = None
    explanation: str = ""
    short: str = ""
    evidence: list = Field(default_factory=list)
    figure: Optional[str] = None

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def as_step(self, *, label: str, on_fix: str) -> "HypothesisStep":
        """This entry as a replay-style :class:`HypothesisStep` (the hypothesis pages show both alike)."""
        return HypothesisStep(check=self.check, label=label, question=self.question or "", on_fix=on_fix,
                              verdict=self.verdict, explanation=self.explanation or "",
                              evidence=self.evidence or [], data={"short": self.short or ""}, figure=self.figure)


class InvestigationDoc(Record):
    """``investigation.json``: one live investigation (helpers.investigation.live.investigate).

    ``verdict``: ``ok`` / ``mismatch`` (None until the diagnosis ran); ``sentence``: the postmortem's opening line;
    ``attach``: what the server runs; ``reference``: ``{how, path, missing}``; ``diagnosis``: the ``diagnose --json``
    document; ``hypotheses``: one :class:`HypothesisEntry` per check (``check``, ``title``, ``question``,
    ``verdict``, ``explanation``, ``short``, ``evidence``, ``figure``), confirmed first; ``measured``: ``{before, after, effect, after_verdict, ...}`` or
    ``{not_measured: why}``; ``acceptance``: the acceptance budget (helpers.draft.budget.acceptance_budget: stages,
    losses, cause, recommended settings, the fix proven offline) or None; ``timings``: seconds per step; ``seconds_to_verdict``: from attach to the diagnosis."""

    url: str = ""
    run_dir: str = ""
    training: str = ""
    engine: str = "sglang"
    engine_version: Optional[str] = None
    verdict: Optional[str] = None
    sentence: str = ""
    samples: int = 0
    attach: dict = Field(default_factory=dict)
    reference: dict = Field(default_factory=dict)
    diagnosis: dict = Field(default_factory=dict)
    findings: list[Finding] = Field(default_factory=list)
    hypotheses: list[HypothesisEntry] = Field(default_factory=list)
    proposed_fix: Optional[ProposedFix] = None
    measured: Optional[dict] = None
    acceptance: Optional[dict] = None
    engine_state: Optional[dict] = None
    timings: dict = Field(default_factory=dict)
    seconds_to_verdict: Optional[float] = None
    wall_s: Optional[float] = None
    error: Optional[str] = None
    notes: list[str] = Field(default_factory=list)


# ------------------------------------------------------------------------------------------------ replay steps

class StepBase(Record):
    index: int = 0
    note: str = ""
    wall_s: Optional[float] = None
    error: Optional[str] = None


class FixStep(StepBase):
    """A server configuration that was started and measured (or whose server did not start:
    ``server_error``)."""

    kind: Literal["fix"] = "fix"
    name: str = ""
    baseline: bool = False
    proposed: bool = False                    # the fix the investigation proposed (not a scripted one)
    faults: list = Field(default_factory=list)
    draft_config: dict = Field(default_factory=dict)
    drop_tensors: list = Field(default_factory=list)
    algorithm: str = "EAGLE3"
    summary: Optional[dict] = None
    server_error: Optional[str] = None
    server_startup_s: Optional[float] = None
    acceptance_dir: Optional[str] = None


class HypothesisStep(StepBase):
    """A named check run on the latest fix's server, with its verdict (and the case's expectation, which only
    the tests compare)."""

    kind: Literal["hypothesis"] = "hypothesis"
    check: str = ""
    label: str = ""
    question: str = ""
    on_fix: str = ""
    verdict: Optional[str] = None
    expect: Optional[str] = None
    as_expected: Optional[bool] = None
    explanation: str = ""
    evidence: list = Field(default_factory=list)
    data: dict = Field(default_factory=dict)
    figure: Optional[str] = None


class SweepStep(StepBase):
    """tok/s per ``num_steps`` on the latest fix's configuration."""

    kind: Literal["sweep"] = "sweep"
    name: str = "num_steps"
    on_fix: str = ""
    points: list = Field(default_factory=list)
    best_num_steps: Optional[int] = None
    best_tok_s: Optional[float] = None


class InvestigationStep(StepBase):
    """The blind investigation of the latest fix's server (``helpers.investigation.investigate``): verdict,
    findings, hypotheses by evidence, the proposed fix, and how long it took to name the fault."""

    kind: Literal["investigate"] = "investigate"
    on_fix: str = ""
    verdict: Optional[str] = None
    sentence: str = ""
    findings: list = Field(default_factory=list)
    proposed_fix: Optional[dict] = None
    hypotheses: list[HypothesisEntry] = Field(default_factory=list)
    seconds_to_verdict: Optional[float] = None
    report: Optional[str] = None
    label: str = ""
    expect_finding: Optional[str] = None
    expect_fix: Optional[dict] = None
    as_expected: Optional[bool] = None


Step = Annotated[Union[FixStep, HypothesisStep, SweepStep, InvestigationStep], Field(discriminator="kind")]


class ReplayDoc(Record):
    """``results/replay-<case>.json``: the case, its steps in order, the headline, the paired fix effect."""

    case: str = ""
    title: str = ""
    story: str = ""
    tp: Optional[int] = None
    steps: list[Step] = Field(default_factory=list)
    complete: bool = False
    headline: str = ""
    fix_effect: Optional[dict] = None
    wall_s: Optional[float] = None

    def of_kind(self, kind: str) -> list:
        """The steps of one kind, in order."""
        return [s for s in self.steps if s.kind == kind]


# ------------------------------------------------------------------------------------------- notebook results

class NotebookResult(Record):
    notebook: str


class AttachResult(NotebookResult):
    notebook: Literal["01_attach"] = "01_attach"
    live: bool = False
    servers: list = Field(default_factory=list)


class DumpResult(NotebookResult):
    notebook: Literal["02_dump"] = "02_dump"
    live: bool = False
    dumps: list = Field(default_factory=list)
    captured: dict = Field(default_factory=dict)


class CompareResult(NotebookResult):
    notebook: Literal["03_compare"] = "03_compare"
    served: Optional[str] = None
    verdict: Optional[str] = None
    findings: list[Finding] = Field(default_factory=list)
    chunks: list = Field(default_factory=list)
    tolerance: Any = None


class HypothesisPageResult(NotebookResult):
    notebook: Literal["10_hyp_tp_sharding", "11_hyp_embedding_allreduce", "12_hyp_layer_offset"]
    check: str = ""
    source: str = ""
    steps: list = Field(default_factory=list)


class AcceptancePageResult(NotebookResult):
    notebook: Literal["20_acceptance"] = "20_acceptance"
    fixes: list = Field(default_factory=list)
    sweep: list = Field(default_factory=list)
    before_after: list = Field(default_factory=list)


class PostmortemResult(NotebookResult):
    notebook: Literal["99_postmortem"] = "99_postmortem"
    headline: str = ""


class ReplayPageResult(NotebookResult):
    notebook: Literal["00_replay"] = "00_replay"
    case_path: Optional[str] = None


AnyNotebookResult = Annotated[Union[ReplayPageResult, AttachResult, DumpResult, CompareResult, HypothesisPageResult,
                                    AcceptancePageResult, PostmortemResult], Field(discriminator="notebook")]
NOTEBOOK_RESULT = TypeAdapter(AnyNotebookResult)
REPLAY_STEP = TypeAdapter(Step)
