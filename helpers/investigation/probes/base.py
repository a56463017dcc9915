"""The types every engine-state probe shares (:class:`Probe`, :class:`ProbeContext`, :class:`ProbeResult`) and the
paired condition loss; the registry and the runner are :mod:`helpers.investigation.probes`."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import pandas as pd

from ...acceptance.requests import record
from ...budget import Budget
from ...draft.budget import _loss, _paired_loss
from ...errors import RequestRejected, SGLangError, ServerTimeout
from ...draft.simulate import summary
from ...runfiles import jsonable

Cost = Literal["cheap", "restart"]
#: every probe request's sampling: greedy, full length (the acceptance budget's live capture sends the same, so its
#: answers are a probe's cold arm: ``helpers.capture.capture_served``)
GREEDY = {"temperature": 0.0, "ignore_eos": True}
#: ``investigate --engine-probes`` values: which probes run
CHOICES = ("none", "cheap", "all")
#: the parts of the acceptance budget's engine stage (after the capture point), each decided from its probes
#: (:mod:`helpers.investigation.probes.parts`), with what it asks
ENGINE_PARTS: dict[str, str] = {
    "verification": "does the target verify the drafts as speculation should (greedy lossless, sampled "
                    "verification, the perfect-draft floor)?",
    "draft computation": "does the served draft compute what its checkpoint computes on the states the server fed, "
                         "step by step?",
    "served weights": "are the served draft's weights its checkpoint's?",
    "cache state": "does the draft accept as well with the prompt's prefix cached (on the device or loaded back from "
                   "host memory), or prefilled in chunks, as cold, and "
                   "do the engine's own KV integrity checks stay silent?",
}


@dataclass
class ProbeContext:
    """What a probe may use: the live server, its adapter, the run folder, the live prompts and their cold answers.

    Attributes:
        client: the server's :class:`helpers.server.client.ServerClient`; adapter: its engine adapter
            (:class:`helpers.engines.base.EngineAdapter`: restarts, flags); att: the
            :class:`helpers.investigation.attach.Attachment` (``restart`` is None when the tool cannot restart it);
        run_dir: the run folder (a probe writes under ``run_dir/engine_state/<probe>/``, a new folder each);
        prompts: the live prompts (:class:`helpers.acceptance.prompts.Prompt`), the budget's own;
        cold: the budget's live per-request frame of those prompts (cold cache: flushed before each request;
            :data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS`), or None (a probe then measures its own);
        max_new_tokens: tokens per request (the budget's); dl: the run's one deadline; progress: a line per step;
        api_key, port: for restarted copies (never written).
        sampling: the ``sampled_verify`` probe's sampling (SGLang names: ``temperature``, ``top_p``, ``top_k``,
            ``sampling_seed``) over its default (:data:`helpers.investigation.probes.sampled.DEFAULT_SAMPLING`), or
            None for the default.
    """

    client: Any
    adapter: Any
    att: Any
    run_dir: Path
    prompts: list
    max_new_tokens: int
    dl: Budget
    progress: Callable[[str], None] = lambda s: None
    cold: Optional[pd.DataFrame] = None
    api_key: Optional[str] = None
    port: int | str | None = None
    extra: dict = field(default_factory=dict)
    sampling: Optional[dict] = None

    def folder(self, name: str) -> Path:
        """A new folder ``run_dir/engine_state/<name>`` (``<name>-2``, ... when it exists: never reused)."""
        base = self.run_dir / "engine_state"
        base.mkdir(parents=True, exist_ok=True)
        path, i = base / name, 1
        while True:
            try:
                path.mkdir()
                return path
            except FileExistsError:
                i += 1
                path = base / f"{name}-{i}"


@dataclass
class ProbeResult:
    """One probe's outcome (``investigation.json`` ``acceptance.engine_state.probes[]``).

    Attributes:
        probe / cost / condition: the probe's name, cost class and the condition in words.
        status: ``ran``, ``skipped`` (``why`` says why: not asked for, no restart, no time) or ``failed`` (``why``:
            the error, one line).
        decision: ``counts`` / ``clear`` / ``undecided`` (``ran`` only).
        loss: for a condition measured in accept length, the budget-style loss (:func:`helpers.draft.budget._loss`:
            ``delta`` tokens per verify step lost in the condition against cold, ``ci``, ``decision``, ``threshold``,
            ``settle``, ``basis``, ``n``), else None.
        findings: finding dicts (:func:`helpers.diagnosis.detectors.finding`) when the decision is ``counts``.
        evidence: what was measured (accept lengths per arm, tokens cached, first divergences, ...).
        seconds: wall time of the probe; saved_to: folders under the run folder it wrote.
        part: the part of the engine stage it speaks to (:data:`ENGINE_PARTS`; set by the runner from its probe).
    """

    probe: str
    cost: str
    condition: str
    status: str = "ran"
    decision: Optional[str] = None
    loss: Optional[dict] = None
    findings: list = field(default_factory=list)
    evidence: dict = field(default_factory=dict)
    why: Optional[str] = None
    seconds: float = 0.0
    saved_to: list = field(default_factory=list)
    part: Optional[str] = None

    def to_json(self) -> dict:
        return jsonable(asdict(self))


@dataclass(frozen=True)
class Probe:
    """One engine-state question.

    Attributes:
        name: the probe's name (``--engine-probes`` lists, ``investigation.json``).
        cost: ``cheap`` (the live server) or ``restart`` (a restarted copy of it).
        condition: the condition it measures, in words (the story's and the page's).
        question: what it asks.
        run: ``run(ctx) -> ProbeResult``; raises :class:`helpers.errors.ServerError` / ``BadInput`` when it cannot.
        applies: ``applies(ctx) -> None`` or why the probe cannot run on this server (then ``skipped``).
        estimate_s: ``estimate_s(ctx) -> seconds`` it is expected to take (a probe is skipped, saying so, when the
            run has less time left).
        part: the part of the engine stage it decides (one of :data:`ENGINE_PARTS`), or None (a note only:
            ``repeatable``).
        mtp: how it stands on a server drafting with an MTP / NextN head (the target's own extra layer, SGLang
            ``--speculative-algorithm NEXTN``: :func:`on_mtp_head`), one of :data:`MTP_USES`: ``as is``, ``offline
            head`` (it runs the draft offline: :func:`helpers.draft.loader.load_draft` gives the head,
            :class:`helpers.draft.nextn.NextNHead`) or ``no`` (the runner skips it there); mtp_why: why, citing the
            engine's code (shown when skipped, kept in the result's ``evidence.mtp`` when run).
    """

    name: str
    cost: Cost
    condition: str
    question: str
    run: Callable[[ProbeContext], ProbeResult]
    applies: Callable[[ProbeContext], Optional[str]] = lambda ctx: None
    estimate_s: Callable[[ProbeContext], float] = lambda ctx: 10.0
    part: Optional[str] = None
    mtp: str = "as is"
    mtp_why: str = ""

    def __post_init__(self) -> None:
        if self.mtp not in MTP_USES:
            raise ValueError(f"probe {self.name}: mtp must be one of {MTP_USES}, got {self.mtp!r}")


#: :attr:`Probe.mtp` values
MTP_USES = ("as is", "offline head", "no")


def on_mtp_head(ctx: Any) -> bool:
    """Whether the probed server drafts with an MTP / NextN head (the attach named one: ``att.draft_head``,
    :func:`helpers.investigation.attach.attach`)."""
    return getattr(getattr(ctx, "att", None), "draft_head", None) is not None


def paired_condition_loss(name: str, cold: pd.DataFrame, cond: pd.DataFrame, basis: str) -> dict:
    """The accept length lost in a condition against cold, paired per prompt (``prompt_id``), decided like every
    budget stage (:func:`helpers.draft.budget._loss`, threshold from the cold accept length): ``delta`` = cold minus
    condition (tokens per verify step, bonus token included; positive = lost in the condition)."""
    d, lo, hi, n, per = _paired_loss(cold, cond)
    ref = summary(cold, 1)["accept_length"] if len(cold) else None
    return _loss(name, d, lo, hi, basis, ref, n=n, unit="prompts", per_sequence=per)




def send_greedy(client: Any, adapter: Any, i: int, p: Any, max_new_tokens: int, *, top_logprobs: int = 0
                ) -> tuple[dict, list[int], Any]:
    """One probe request through the server's engine adapter: prompt ``p`` (:class:`helpers.acceptance.prompts.
    Prompt`) greedy (:data:`GREEDY`), ``max_new_tokens`` tokens, with the ``top_logprobs`` best log-probabilities per
    output position when asked and the engine returns them (``adapter.top_logprobs_fields``; a server refusing those
    fields is asked again without). The same columns for every engine: SGLang's ``/generate`` and vLLM's
    ``/v1/completions`` both come back as a :class:`helpers.server.protocol.GenerateResult` from their clients.

    Returns: ``(row, output ids, answer)``: ``row`` one :data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS` row
    (``cached_tokens``: prompt tokens served from the prefix cache, None when the server does not say), ``answer``
    None and ``row["error"]`` the first line of the error when the request failed.

    Raises: :class:`helpers.errors.ServerTimeout` (the run's own deadline), never another server error."""
    fields = adapter.top_logprobs_fields(top_logprobs) if top_logprobs else None
    res, err = None, None
    try:
        try:
            res = client.generate(**p.request(), sampling_params=GREEDY, max_new_tokens=max_new_tokens,
                                  **({"extra": fields} if fields else {}))
        except RequestRejected:
            if not fields:
                raise
            res = client.generate(**p.request(), sampling_params=GREEDY, max_new_tokens=max_new_tokens)
    except ServerTimeout:
        raise                                   # the run's own deadline: not this request's failure
    except SGLangError as exc:
        err = str(exc).splitlines()[0][:300]
    return record(i, p, res, err), (list(res.output_ids) if res is not None else []), res
