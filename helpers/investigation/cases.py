"""Case files: an investigation as a timeline of fixes (server configurations, measured) and
hypotheses (named checks with an expected verdict), replayed on data.

Format (YAML, validated with pydantic; documented in env/cases/README.md)::

    name: seeds-hunt                       # letters, digits, - _ .
    title: one line shown at the top of the postmortem
    story: |                               # optional prose (markdown)
    models:                                # defaults: the shipped reference models
      target: env/models/target
      draft: env/models/draft
      training_data: env/models/data/sample
    server: {tp: 2, spec: {num_steps: 3, topk: 1, num_draft_tokens: 4}}
    measure: {count: 24, max_new_tokens: 48, concurrency: 4}
    effect_test: cis                       # how a fix is judged to help: cis (the two 95% CIs are
                                           # disjoint) or paired (the paired 95% CI of the change,
                                           # same prompts, excludes 0: for faults costing a few %)
    slow: false                            # true: replayed only in the slow test tier
    timeline:
      - fix:                               # start a server with this configuration, measure it
          name: as deployed (embedding in place of out(1))
          faults: [{kind: embedding_in_place_of_layer, chunk: 0}]   # helpers.hooks.Fault fields
          draft_config: {...}              # optional overrides merged into the draft config.json
          drop_tensors: [d2t, t2d]         # optional: draft weights left out of the variant
          algorithm: EAGLE3                # or EAGLE (fc bypass)
          spec: {...}                      # optional, overrides server.spec
          launch: {tp: 2, extra_args: []}  # optional, overrides server
      - hypothesis:
          check: embedding_all_reduce      # a name in helpers.investigation.checks.CHECKS
          label: embedding all-reduce      # free text (e.g. where the idea came from)
          question: does VocabParallelEmbedding all-reduce?
          params: {}                       # passed to the check
        expect: refuted                    # confirmed | refuted | inconclusive (optional)
      - investigate:                       # the blind live investigation of the latest fix's server
          label: blind investigation       # (helpers.investigation.live: no expectation is read)
          samples: 4
        expect_finding: embedding_in_place_of_layer   # optional; compared by the tests only
        expect_fix: {draft_config: {...}}  # optional; subset of the proposed fix, compared by the tests only
      - fix:
          name: "fix: the tool's proposal"
          proposed: true                   # apply the fix the latest investigation proposed
      - sweep: {name: num_steps, values: [2, 3, 4]}   # tok/s per num_steps (topk 1)

Hypotheses run against the server of the latest fix before them. Exactly one step must be a fix
before the first hypothesis.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..acceptance.fixes import CASE_MEASURE_DEFAULTS, Fix, MeasureSettings
from ..errors import CaseError
from ..paths import ROOT
from ..runfiles import load_yaml_model
from ..server.listener_flags import refuse_listener_flags
from ..server.settings import SpecSettings
from .catalog import CATALOG

VERDICTS = ("confirmed", "refuted", "inconclusive")

def case_name(v: str) -> str:
    """A case's ``name`` (it names run folders and results files): letters, digits, '-', '_' and '.' only.

    Raises: ValueError (pydantic names the field)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", v):
        raise ValueError("use letters, digits, '-', '_' and '.' only")
    return v


def repo_path(path: str | os.PathLike) -> Path:
    """``path`` relative to the repository root (an absolute path is kept as it is)."""
    p = Path(path)
    return p if p.is_absolute() else ROOT / p

class Models(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: str = "env/models/target"
    draft: str = "env/models/draft"
    training_data: Optional[str] = "env/models/data/sample"


class ServerDefaults(BaseModel):
    """The case's server block: TP size, speculative settings (unset fields: SGLang's launch defaults of the
    embedded server, EAGLE3 3/1/4) and extra flags; a fix's ``spec`` / ``launch`` override them."""

    model_config = ConfigDict(extra="forbid")
    tp: int = Field(2, ge=1)
    spec: SpecSettings = Field(default_factory=lambda: SpecSettings(num_steps=3, topk=1, num_draft_tokens=4))
    extra_args: list[str] = Field(default_factory=list)

    @field_validator("extra_args")
    @classmethod
    def _no_listener_flag(cls, v):
        refuse_listener_flags(v, "sglang", where="extra_args")    # a BadInput is a ValueError: the field is named
        return v


class Hypothesis(BaseModel):
    model_config = ConfigDict(extra="forbid")
    check: str
    label: str = ""
    question: str = ""
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("check")
    @classmethod
    def _known(cls, v):

        if v not in CATALOG:
            raise ValueError(f"unknown check '{v}'; expected one of {sorted(CATALOG)}")
        return v


class Sweep(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Literal["num_steps"] = "num_steps"
    values: list[Annotated[int, Field(ge=1)]] = Field(min_length=1)


class Investigate(BaseModel):
    """A blind live investigation of the latest fix's server (helpers.investigation.live.investigate)."""

    model_config = ConfigDict(extra="forbid")
    label: str = "blind investigation"
    samples: int = Field(4, ge=1)


STEP_KINDS = ("fix", "hypothesis", "sweep", "investigate")


class Step(BaseModel):
    model_config = ConfigDict(extra="forbid")
    fix: Optional[Fix] = None
    hypothesis: Optional[Hypothesis] = None
    sweep: Optional[Sweep] = None
    investigate: Optional[Investigate] = None
    expect: Optional[Literal["confirmed", "refuted", "inconclusive"]] = None
    expect_finding: Optional[str] = None
    expect_fix: Optional[dict[str, Any]] = None
    note: str = ""

    @model_validator(mode="after")
    def _one_kind(self):
        kinds = [k for k in STEP_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"a step is exactly one of {' / '.join(STEP_KINDS)}, got {kinds or 'none'}")
        if self.expect is not None and self.hypothesis is None:
            raise ValueError("'expect' only applies to a hypothesis step")
        if (self.expect_finding is not None or self.expect_fix is not None) and self.investigate is None:
            raise ValueError("'expect_finding' / 'expect_fix' only apply to an investigate step")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in STEP_KINDS if getattr(self, k) is not None)


class Case(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    title: str
    story: str = ""
    models: Models = Field(default_factory=Models)
    server: ServerDefaults = Field(default_factory=ServerDefaults)
    measure: MeasureSettings = Field(default_factory=lambda: MeasureSettings(**CASE_MEASURE_DEFAULTS))
    timeline: list[Step] = Field(min_length=1)
    slow: bool = False  # replayed only in the slow test tier
    effect_test: Literal["cis", "paired"] = "cis"  # how the tests judge that the fix helped

    @field_validator("measure", mode="before")
    @classmethod
    def _measure_defaults(cls, v):
        return {**CASE_MEASURE_DEFAULTS, **(v or {})} if isinstance(v, dict) else v

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return case_name(v)

    @model_validator(mode="after")
    def _fix_first(self):
        for i, step in enumerate(self.timeline):
            if step.kind == "fix":
                break
            raise ValueError(f"timeline[{i}]: a {step.kind} before any fix has no server to run on")
        seen_investigation = False
        for i, step in enumerate(self.timeline):
            seen_investigation |= step.kind == "investigate"
            if step.kind == "fix" and step.fix.proposed and not seen_investigation:
                raise ValueError(f"timeline[{i}]: a fix with proposed: true needs an investigate step before it")
        return self

    def resolve(self, path: str) -> Path:
        """A models path relative to the repository root (:func:`repo_path`)."""
        return repo_path(path)


def load_case(path: str | os.PathLike) -> Case:
    """Read and validate a case file with the suite's one YAML loader (:func:`helpers.runfiles.load_yaml_model`).

    Raises:
        CaseError: missing file, invalid YAML, or an invalid field (named with its timeline index).
    """
    return load_yaml_model(path, Case, what="case file", error=CaseError)


class RecordedInvestigate(BaseModel):
    """The ``investigate`` run a recorded case records (:func:`helpers.investigation.live.investigate` arguments)."""

    model_config = ConfigDict(extra="forbid")
    prompts: int = Field(16, ge=1)
    max_new_tokens: int = Field(32, ge=1)


class RecordedCase(BaseModel):
    """A case recorded once on a live server and replayed offline from its recording (no server started): what the
    README's main job shows beside its live case without a server start of its own. Format (YAML)::

        name: mtp-embedding
        title: one line shown above the case on the postmortem
        story: |                               # optional prose
        target: env/models/kimi/target         # the server's target (its own NextN layer drafts)
        server: {tp: 1, spec: {algorithm: NEXTN, num_steps: 1, topk: 1, num_draft_tokens: 2}}
        faults: [{kind: embedding_in_place_of_layer, chunk: 0}]   # helpers.faults.Fault fields, served through
                                                                 # --forward-hooks on the target's logits processor
        investigate: {prompts: 16, max_new_tokens: 32}
        recording: env/cases/recordings/mtp_embedding      # investigation.json + recording.json
        expect_finding: wrong_layer            # compared by the tests only

    :func:`helpers.investigation.recorded.record_case` writes the recording, :func:`~.recorded.replay_recorded`
    reads it back."""

    model_config = ConfigDict(extra="forbid")
    name: str
    title: str
    story: str = ""
    target: str
    server: ServerDefaults = Field(default_factory=lambda: ServerDefaults(tp=1, spec=SpecSettings(
        algorithm="NEXTN", num_steps=1, topk=1, num_draft_tokens=2)))
    faults: list[dict[str, Any]] = Field(default_factory=list)
    investigate: RecordedInvestigate = Field(default_factory=RecordedInvestigate)
    recording: str
    expect_finding: Optional[str] = None

    @field_validator("name")
    @classmethod
    def _name(cls, v):
        return case_name(v)

    @field_validator("faults")
    @classmethod
    def _faults(cls, v):
        from ..faults import Fault  # lazy: the fault table only when a case lists faults
        for f in v:
            Fault(**f)          # a ValueError names the kind and the missing field
        return v

    def resolve(self, path: str) -> Path:
        """A path relative to the repository root (:func:`repo_path`)."""
        return repo_path(path)


def load_recorded_case(path: str | os.PathLike) -> RecordedCase:
    """Read and validate a recorded case file (:class:`RecordedCase`) with :func:`helpers.runfiles.load_yaml_model`.

    Raises:
        CaseError: missing file, invalid YAML, or an invalid field (named)."""
    return load_yaml_model(path, RecordedCase, what="recorded case file", error=CaseError)
