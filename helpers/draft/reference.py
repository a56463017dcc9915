"""Published EAGLE-3 accept lengths, each with the conditions it was measured under: the draft stage's reference when
the draft has no training log.

The table (``data/reference_accept_lengths.yaml``, shipped with the package) holds figures read in public sources:
engines' CI golden values (SGLang's EAGLE-3 tests assert the server's ``avg_spec_accept_length`` above a threshold:
``kind: lower_bound``; vLLM's acceptance-length regression test asserts it within ``rtol`` of an expected value:
``kind: expected``) and model cards (``kind: reported``), each with its source (URL, or repository + path + commit
or release) and a short quote. A condition the source does not state is ``null`` (unknown), never filled in.

:func:`match_reference` returns the rows whose *known* conditions equal the caller's known ones: a condition known on
both sides and different excludes the row; one unknown on either side is listed as unknown in the match (never taken
as equal). A row matches only when the draft or the target is named on both sides and equal: settings alone are no
reference for a draft. A figure is never returned bare: every match carries its conditions and source.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import BadInput
from ..formats.configs import read_config_json
from ..runfiles import load_yaml_model

#: the shipped table
TABLE_PATH = Path(__file__).with_name("data") / "reference_accept_lengths.yaml"
#: the conditions a row is matched on, in the order the text names them
MATCHED = ("target_model", "draft_model", "benchmark", "steps", "topk", "draft_tokens", "temperature",
           "chat_template", "engine")
#: the engines a row can name
ENGINES = ("sglang", "vllm")
#: the conditions that name what is measured (one must match on both sides)
IDENTITY = ("target_model", "draft_model")


class Conditions(BaseModel):
    """What an accept length was measured under; ``None`` is unknown.

    Attributes:
        target_model / draft_model: Hugging Face ids (``meta-llama/Llama-3.1-8B-Instruct``) or folder names; compared
            case-insensitively: two ids on the whole id, a local path or bare name on its last component.
        benchmark: the prompts (``gsm8k (200 examples)``); compared case-insensitively on the first word.
        steps / topk / draft_tokens: SGLang's ``--speculative-num-steps`` / ``--speculative-eagle-topk`` /
            ``--speculative-num-draft-tokens`` (a vLLM ``num_speculative_tokens`` K is a chain of K steps).
        temperature: the sampling temperature (0 = greedy).
        chat_template: ``target`` (the target's chat template applied: an OpenAI chat endpoint) or ``none`` (raw
            text: SGLang ``/generate`` or ``/v1/completions``).
        engine: ``sglang`` or ``vllm``.
    """

    model_config = ConfigDict(extra="forbid")
    target_model: Optional[str] = None
    draft_model: Optional[str] = None
    benchmark: Optional[str] = None
    steps: Optional[int] = Field(default=None, ge=1)
    topk: Optional[int] = Field(default=None, ge=1)
    draft_tokens: Optional[int] = Field(default=None, ge=2)
    temperature: Optional[float] = Field(default=None, ge=0)
    chat_template: Optional[Literal["target", "none"]] = None
    engine: Optional[Literal["sglang", "vllm"]] = None


class Source(BaseModel):
    """Where a figure was read: a ``url``, or a ``repo`` + ``path`` (+ ``commit`` or ``release``); ``quote`` is the
    source's own words holding the figure."""

    model_config = ConfigDict(extra="forbid")
    url: Optional[str] = None
    repo: Optional[str] = None
    path: Optional[str] = None
    commit: Optional[str] = None
    release: Optional[str] = None
    date: Optional[str] = None
    quote: str = Field(min_length=1)

    @model_validator(mode="after")
    def _cited(self) -> "Source":
        if not self.url and not (self.repo and self.path):
            raise ValueError("a source needs a url, or a repo and a path")
        if self.repo and not self.url and not (self.commit or self.release):
            raise ValueError("a repository source needs a commit or a release")
        return self

    def words(self) -> str:
        """One line: the URL, or ``repo path @ commit`` / ``(release)``, and the date when known."""
        where = self.url or (f"{self.repo} {self.path}" + (f" @ {self.commit[:12]}" if self.commit else "")
                             + (f" ({self.release})" if self.release else ""))
        return where + (f", {self.date}" if self.date else "")


class Reference(BaseModel):
    """One published accept length (tokens per verify step, bonus included) with its conditions and source."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)
    accept_length: float = Field(ge=1)
    kind: Literal["lower_bound", "expected", "reported"]
    rtol: Optional[float] = Field(default=None, gt=0, lt=1)
    conditions: Conditions
    dtype: Optional[str] = None
    source: Source
    note: Optional[str] = None

    @model_validator(mode="after")
    def _named(self) -> "Reference":
        if not any(getattr(self.conditions, c) for c in IDENTITY):
            raise ValueError("a row must name its draft or its target")
        if (self.kind == "expected") != (self.rtol is not None):
            raise ValueError("an expected value needs its rtol, and only an expected value has one")
        return self


class ReferenceTable(BaseModel):
    """The table: ``rows`` with unique ids."""

    model_config = ConfigDict(extra="forbid")
    rows: list[Reference] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> "ReferenceTable":
        ids = [r.id for r in self.rows]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"duplicate row id(s): {', '.join(dup)}")
        return self


@dataclass(frozen=True)
class Match:
    """A row whose known conditions equal the query's: which conditions were equal (``matched``), which are unknown
    in the row (``unknown_in_reference``) or in the query (``unknown_in_query``)."""

    reference: Reference
    matched: tuple[str, ...]
    unknown_in_reference: tuple[str, ...]
    unknown_in_query: tuple[str, ...]

    def text(self) -> str:
        """One sentence: the figure, what it is, its conditions, what is unknown, its source."""
        r = self.reference
        c = r.conditions
        what = {"lower_bound": "above ", "expected": "expected "}.get(r.kind, "") + f"{r.accept_length:g}" + (
            f" (+/- {r.rtol:.0%})" if r.rtol else "")
        kind = {"lower_bound": "an engine's CI golden value: its test asserts the accept length is above it",
                "expected": "an engine's regression golden value: its test asserts the accept length within the "
                            "tolerance", "reported": "a published mean"}[r.kind]
        conds = ", ".join(f"{k} {getattr(c, k)}" for k in MATCHED if getattr(c, k) is not None)
        unknown = sorted(set(self.unknown_in_reference) | set(self.unknown_in_query))
        return (f"published accept length {what} tokens per verify step ({kind}; row {r.id}) under {conds}"
                + (f"; matched on {', '.join(self.matched)}" if self.matched else "")
                + (f"; unknown on one side: {', '.join(unknown)}" if unknown else "")
                + f"; source: {r.source.words()}")

    def to_json(self) -> dict:
        return {"id": self.reference.id, "accept_length": self.reference.accept_length, "kind": self.reference.kind,
                "rtol": self.reference.rtol,
                "conditions": self.reference.conditions.model_dump(), "source": self.reference.source.model_dump(),
                "matched": list(self.matched), "unknown_in_reference": list(self.unknown_in_reference),
                "unknown_in_query": list(self.unknown_in_query), "text": self.text()}


@lru_cache(maxsize=4)
def load_table(path: str | Path = TABLE_PATH) -> ReferenceTable:
    """The reference table at ``path`` (default: the shipped one), validated.

    Raises:
        BadInput: unreadable YAML or a row against the schema (the file and field named)."""
    return load_yaml_model(Path(path), ReferenceTable, what="reference accept-length table")


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def _name_equal(a: str, b: str) -> bool:
    """Two Hugging Face ids (``owner/name``) are equal when the whole id is; a local path or a bare name is compared
    on its last component (``/models/sglang-EAGLE3-LLaMA3.1-Instruct-8B`` is ``lmsys/sglang-EAGLE3-...``)."""
    a, b = a.strip().rstrip("/").lower(), b.strip().rstrip("/").lower()
    if a == b:
        return True
    if _HUB_ID.fullmatch(a) and _HUB_ID.fullmatch(b):
        return False
    return a.rsplit("/", 1)[-1] == b.rsplit("/", 1)[-1]


def _equal(key: str, a, b) -> bool:
    if key in IDENTITY:
        return _name_equal(a, b)
    if key == "benchmark":
        return a.split()[0].lower() == b.split()[0].lower()
    if key == "temperature":
        return math.isclose(a, b, abs_tol=1e-6)
    return a == b


def match_reference(query: Conditions, table: Optional[ReferenceTable] = None) -> list[Match]:
    """The rows of ``table`` (default: the shipped table) whose known conditions equal the query's known ones.

    A row is left out when any condition known on both sides differs, or when neither the draft nor the target is
    known on both sides and equal. Each match names the conditions that matched and those unknown on either side.

    Args:
        query: the conditions of the draft under investigation (unknown ones ``None``).
        table: the table to match in (default :func:`load_table`).

    Returns:
        The matches, in table order (possibly empty: no published figure for these conditions).
    """
    table = table or load_table()
    out = []
    for row in table.rows:
        matched, unk_ref, unk_q = [], [], []
        for key in MATCHED:
            a, b = getattr(row.conditions, key), getattr(query, key)
            if a is None:
                unk_ref.append(key)
            elif b is None:
                unk_q.append(key)
            elif _equal(key, a, b):
                matched.append(key)
            else:
                break
        else:
            if any(k in matched for k in IDENTITY):
                out.append(Match(row, tuple(matched), tuple(unk_ref), tuple(unk_q)))
    return out


def model_name(folder: Optional[str | Path]) -> Optional[str]:
    """The name a model folder goes by: its config.json ``_name_or_path`` when it holds one, else the folder's name
    (None for no folder). A config that cannot be read falls back to the folder name (the loader reports it)."""
    if folder is None:
        return None
    folder = Path(folder)
    try:
        name = read_config_json(folder, "model config").get("_name_or_path")
    except BadInput:
        name = None
    return name.strip() if isinstance(name, str) and name.strip() else folder.resolve().name


def no_match_words() -> str:
    """What the draft stage says when no published figure matches."""
    return ("no published figure matches these conditions (model, draft, steps/topk/draft tokens, temperature, "
            "engine): the draft stage cannot be settled")
