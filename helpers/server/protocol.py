"""Typed models of SGLang's HTTP answers the suite reads (``/server_info``, ``/generate`` and its ``meta_info``),
with the field aliases of older releases and the ranges a real server stays in: a count that sizes an array here
(draft steps, TP ranks, histogram bins) is checked before it sizes anything, and spec counters no server can
produce are named (:meth:`MetaInfo.spec_problem`).
"""
from __future__ import annotations

import math
from typing import Annotated, Any, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..errors import printable

#: Sane ranges of the counts a server reports (SGLang's own configs stay far below: num_steps <= 10, topk <= 10,
#: draft tokens <= 64, TP 8-16): past them the answer is broken, not a server this suite can measure.
MAX_NUM_STEPS = 64
MAX_TOPK = 64
MAX_DRAFT_TOKENS = 1024
MAX_PARALLEL = 1024

Count = Annotated[int, Field(ge=0)]


class ServerInfo(BaseModel):
    """The ``/server_info`` fields this suite reads, typed and range-checked; every other field is kept as is.

    Built by ``sglang/srt/utils/common.py::build_server_info`` (``ServerArgs.resolved_dict()`` + ``launch_command``
    + scheduler info); the types are those of the ServerArgs fields (``sglang/srt/arg_groups/fields/spec.py``,
    ``parallel.py``, ``observability.py``). Counts are ints within :data:`MAX_NUM_STEPS`, :data:`MAX_TOPK`,
    :data:`MAX_DRAFT_TOKENS`, :data:`MAX_PARALLEL` (a JSON ``3e6`` is the int 3000000, then out of range); text
    fields shown to the user lose control characters (:func:`helpers.errors.printable`).
    """

    model_config = ConfigDict(extra="allow")

    version: Optional[str] = None
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    speculative_algorithm: Optional[str] = None
    speculative_draft_model_path: Optional[str] = None
    speculative_num_steps: Optional[int] = Field(None, ge=0, le=MAX_NUM_STEPS)
    speculative_eagle_topk: Optional[int] = Field(None, ge=0, le=MAX_TOPK)
    speculative_num_draft_tokens: Optional[int] = Field(None, ge=0, le=MAX_DRAFT_TOKENS)
    speculative_adaptive: Optional[bool] = None
    tp_size: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL)
    dp_size: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL)
    pp_size: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL)
    max_running_requests: Optional[int] = Field(None, ge=0)
    enable_return_hidden_states: Optional[bool] = None
    enable_metrics: Optional[bool] = None
    launch_command: Optional[Union[str, list[str]]] = None
    forward_hooks: Optional[Union[list[dict[str, Any]], str]] = None
    internal_states: Optional[list] = None

    @field_validator("version", "model_path", "tokenizer_path", "speculative_algorithm",
                     "speculative_draft_model_path")
    @classmethod
    def _printable(cls, v: Optional[str]) -> Optional[str]:
        return None if v is None else printable(v)

#: Older meta_info names -> current name in 0.5.23 (set in
#: ``sglang/srt/managers/tokenizer_manager.py::TokenizerManager._calculate_spec_decoding_metrics``); each renaming
#: is the sgl-project/sglang pull request named on its line (https://github.com/sgl-project/sglang/pull/<number>).
META_ALIASES = {
    "spec_accepted_drafts": "spec_num_correct_drafts",      # #23530 (2026-04), alias kept by #25014
    "spec_accept_token_num": "spec_num_correct_drafts",     # #11441 (2025-10)
    "spec_proposed_drafts": "spec_num_proposed_drafts",
    "spec_draft_token_num": "spec_num_proposed_drafts",
    "spec_accept_histogram": "spec_correct_drafts_histogram",  # #18332 (2026-02)
}


class MetaInfo(BaseModel):
    """``meta_info`` of one finished ``/generate`` answer.

    Built by ``TokenizerManager._handle_batch_output`` and, for the spec fields,
    ``TokenizerManager._calculate_spec_decoding_metrics`` (``sglang/srt/managers/tokenizer_manager.py``):
    the spec fields are set **only on the finished chunk and only when spec_verify_ct > 0**
    (a request with ``max_new_tokens=1`` never verifies and has none).

    * ``spec_verify_ct``: verify steps (target forward passes over the draft) of this request.
    * ``spec_accept_length`` = ``completion_tokens / spec_verify_ct``: tokens per verify step,
      bonus token included; the prefill-sampled first token is in the numerator too.
    * ``spec_num_correct_drafts``: draft tokens accepted; ``spec_num_proposed_drafts`` =
      ``spec_verify_ct * (speculative_num_draft_tokens - 1)`` (static server arg).
    * ``spec_correct_drafts_histogram[n]``: verify steps that accepted exactly n draft tokens
      (grown on demand, so shorter than ``num_steps + 1`` when long runs never happened).

    Older field names (:data:`META_ALIASES`) are mapped to these. Unknown fields (``hidden_states``,
    timing fields, ...) are kept as extras.
    """

    model_config = ConfigDict(extra="allow")

    id: Optional[str] = None
    finish_reason: Any = None
    prompt_tokens: Optional[Count] = None
    completion_tokens: Optional[Count] = None
    cached_tokens: Optional[Count] = None
    e2e_latency: Optional[float] = Field(None, ge=0)
    spec_verify_ct: Optional[Count] = None
    spec_accept_length: Optional[float] = Field(None, allow_inf_nan=False)
    spec_accept_rate: Optional[float] = Field(None, allow_inf_nan=False)
    spec_num_correct_drafts: Optional[Count] = None
    spec_num_proposed_drafts: Optional[Count] = None
    spec_correct_drafts_histogram: Optional[list[Count]] = Field(None, max_length=MAX_NUM_STEPS + 1)

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            data = dict(data)
            for old, new in META_ALIASES.items():
                if data.get(new) is None and data.get(old) is not None:
                    data[new] = data[old]
        return data

    @property
    def has_spec_fields(self) -> bool:
        """True when the answer carries a positive ``spec_verify_ct`` (see class docstring)."""
        return bool(self.spec_verify_ct)

    def spec_problem(self, num_steps: Optional[int] = None, *, num_draft_tokens: Optional[int] = None,
                     adaptive: bool = False, proposed_exact: bool = True,
                     histogram_bins: Optional[int] = None, context_len: Optional[int] = None) -> Optional[str]:
        """The first identity of SGLang's per-request spec counters these counters break, with the numbers, or None
        when they satisfy every one that can be checked. Counts are already non-negative (the field types).

        Args:
            num_steps: the server's ``speculative_num_steps`` (None: unknown; the checks that need it are skipped).
            num_draft_tokens: its ``speculative_num_draft_tokens`` (None: unknown).
            adaptive: ``speculative_adaptive`` (the steps change at run time: the checks on the static steps and
                draft tokens are skipped).
            proposed_exact: the engine proposes ``num_draft_tokens - 1`` drafts at every verify step (SGLang); False:
                at most that many (vLLM 0.32.0 trims a step's drafts to the token budget and leaves out drafts a
                grammar invalidated: ``v1/core/sched/scheduler.py::Scheduler.schedule``, ``update_from_output``).
            histogram_bins: the histogram's exact length when the engine writes it dense (vLLM:
                ``num_speculative_tokens + 1``, ``v1/metrics/stats.py::RequestSpecDecodeMetrics.new``); None: SGLang's
                grows on demand.
            context_len: the context length (tokens) of an engine whose last step before the context is a plain
                decode step, no verify step (vLLM 0.32.0: ``v1/core/sched/scheduler.py::Scheduler.schedule`` caps a
                running request's new tokens at ``max_model_len - num_computed_tokens - 1``, so once the request holds
                ``max_model_len - 1`` tokens only the last sampled token is scheduled, no draft;
                ``Scheduler.update_from_output`` observes the per-request spec counters only for a step with
                scheduled drafts; that step's token ends the request, ``v1/core/sched/utils.py::check_stop``
                ``num_tokens >= max_model_len``): an answer whose prompt + completion tokens reach it may hold one
                token more than the identity below. None: no such step (SGLang refuses a request past its context,
                reserving the draft slots).

        The identities (:data:`SPEC_IDENTITIES`), from SGLang 0.5.23's counting: per verify step of a request
        ``scheduler_components/batch_result_processor.py`` adds 1 to ``spec_verify_ct``, the step's accepted draft
        tokens n (at most ``num_steps``: the chain for topk 1, the tree depth for topk > 1) to
        ``spec_num_correct_drafts`` and 1 to histogram bin n (``schedule_batch.py::Req.
        update_spec_correct_drafts_histogram``), and emits n + 1 tokens (the bonus), fewer when the request ends
        inside the run; the prefill emits one token before any step, one more after each retraction
        (``num_retractions``). ``tokenizer_manager.py::TokenizerManager._calculate_spec_decoding_metrics`` sets the
        fields only when ``spec_verify_ct > 0``, with ``spec_num_proposed_drafts = spec_verify_ct x
        (speculative_num_draft_tokens - 1)``, ``spec_accept_rate = correct / proposed`` and ``spec_accept_length =
        completion_tokens / spec_verify_ct``. An answer with ``spec_verify_ct`` 0 (servers of 2025 sent it on every
        answer) accepted and proposed nothing.
        """
        v, c, p = self.spec_verify_ct, self.spec_num_correct_drafts, self.spec_num_proposed_drafts
        hist = self.spec_correct_drafts_histogram or None
        ct, r = self.completion_tokens, self._retractions()

        def broken(name: str, detail: str) -> str:
            return f"identity '{name}' broken: {detail}"

        if v is None:
            return None
        if v == 0:
            for field, value in (("spec_num_correct_drafts", c), ("spec_num_proposed_drafts", p),
                                 ("spec_correct_drafts_histogram", sum(hist or []) or None),
                                 ("spec_accept_length", self.spec_accept_length or None)):
                if value:
                    return broken("no verify step, no draft", f"{field} {value} with spec_verify_ct 0")
            return None
        if c is not None and p is not None and c > p:
            return broken("accepted <= proposed", f"spec_num_correct_drafts {c} > spec_num_proposed_drafts {p} "
                                                   "(more draft tokens accepted than proposed)")
        static = not adaptive
        if static and num_draft_tokens and p is not None and proposed_exact and p != v * (num_draft_tokens - 1):
            return broken("proposed = verify steps x (draft tokens - 1)",
                          f"spec_num_proposed_drafts {p} != spec_verify_ct {v} x (speculative_num_draft_tokens "
                          f"{num_draft_tokens} - 1) = {v * (num_draft_tokens - 1)}")
        if static and num_draft_tokens and p is not None and not proposed_exact and p > v * (num_draft_tokens - 1):
            return broken("proposed <= verify steps x (draft tokens - 1)",
                          f"spec_num_proposed_drafts {p} > spec_verify_ct {v} x (speculative_num_draft_tokens "
                          f"{num_draft_tokens} - 1) = {v * (num_draft_tokens - 1)}")
        if static and histogram_bins is not None and hist is not None and len(hist) != histogram_bins:
            return broken("dense histogram of num_steps + 1 bins",
                          f"spec_correct_drafts_histogram has {len(hist)} bins, the engine writes num_steps + 1 = "
                          f"{histogram_bins}")
        # a verify step accepts at most num_steps draft tokens (the chain for topk 1, the tree's depth for topk > 1) and
        # at most num_draft_tokens - 1 (the tree's nodes but its root: eagle_utils.py::build_tree_kernel_efficient)
        depth = num_steps if not (num_steps is not None and num_draft_tokens) else min(num_steps, num_draft_tokens - 1)
        if static and num_steps is not None:
            if hist is not None and len(hist) > num_steps + 1:
                return broken("histogram bins <= num_steps + 1",
                              f"spec_correct_drafts_histogram has {len(hist)} bins, more than num_steps + 1 = "
                              f"{num_steps + 1} (a verify step accepts at most num_steps draft tokens)")
            if c is not None and c > v * depth:
                return broken("accepted <= verify steps x num_steps",
                              f"spec_num_correct_drafts {c} > {v} verify steps x {depth} "
                              + ("draft steps (a verify step accepts at most num_steps draft tokens)"
                                 if depth == num_steps else "draft tokens (a verify step accepts at most "
                                 f"speculative_num_draft_tokens {num_draft_tokens} - 1 < num_steps {num_steps})"))
        if ct is not None and (c is not None or (static and num_steps is not None)):
            at_ctx = bool(context_len) and self.prompt_tokens is not None and self.prompt_tokens + ct >= context_len
            most = 1 + r + v + (c if c is not None else v * depth) + at_ctx
            if ct > most:
                accepted = f"{c} accepted draft tokens" if c is not None else f"at most {depth} draft tokens each"
                return broken("completion tokens <= 1 + retractions + verify steps + accepted",
                              f"{ct} completion tokens from {v} verify steps ({accepted}, a bonus token each, plus "
                              f"the prefill token{f' and {r} after retractions' if r else ''}"
                              f"{' and the plain decode step at the context' if at_ctx else ''}: at most {most})")
        if hist is not None:
            if sum(hist) != v:
                return broken("histogram sums to the verify steps",
                              f"spec_correct_drafts_histogram {hist} sums to {sum(hist)}, spec_verify_ct is {v}")
            weighted = sum(n * h for n, h in enumerate(hist))
            if c is not None and weighted != c:
                return broken("histogram weights to the accepted drafts",
                              f"sum n x spec_correct_drafts_histogram[n] = {weighted}, spec_num_correct_drafts is {c}")
        if self.spec_accept_length is not None and ct is not None and not _same(self.spec_accept_length, ct / v):
            return broken("spec_accept_length = completion_tokens / spec_verify_ct",
                          f"the server reported spec_accept_length {self.spec_accept_length:g}, completion_tokens "
                          f"{ct} / spec_verify_ct {v} = {ct / v:g}")
        if self.spec_accept_rate is not None and c is not None and p and not _same(self.spec_accept_rate, c / p):
            return broken("spec_accept_rate = correct / proposed",
                          f"the server reported spec_accept_rate {self.spec_accept_rate:g}, spec_num_correct_drafts "
                          f"{c} / spec_num_proposed_drafts {p} = {c / p:g}")
        return None

    def _retractions(self) -> int:
        """``num_retractions`` of the answer (SGLang 0.5.23 sets it on every answer), 0 when absent or not a count."""
        r = (self.model_extra or {}).get("num_retractions")
        return r if isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 1 << 31 else 0


#: the identities :meth:`MetaInfo.spec_problem` checks, in its order (each message starts ``identity '<name>'``); the
#: 4th and 5th are vLLM's form of the 3rd (``proposed_exact=False``, ``histogram_bins``)
SPEC_IDENTITIES = (
    "no verify step, no draft", "accepted <= proposed", "proposed = verify steps x (draft tokens - 1)",
    "proposed <= verify steps x (draft tokens - 1)", "dense histogram of num_steps + 1 bins",
    "histogram bins <= num_steps + 1", "accepted <= verify steps x num_steps",
    "completion tokens <= 1 + retractions + verify steps + accepted", "histogram sums to the verify steps",
    "histogram weights to the accepted drafts", "spec_accept_length = completion_tokens / spec_verify_ct",
    "spec_accept_rate = correct / proposed")


def _same(reported: float, recomputed: float) -> bool:
    """A reported ratio equals the one recomputed from the counters (JSON carries doubles: up to rounding)."""
    return math.isclose(reported, recomputed, rel_tol=1e-9, abs_tol=1e-12)


class GenerateResult(BaseModel):
    """One ``/generate`` answer plus the client-side wall time.

    ``latency_s``: seconds from sending the request to having parsed the JSON (client view);
    ``meta_info.e2e_latency`` is the server's own view of the same request.
    ``prompt_token_ids``: only with ``return_prompt_token_ids=True``.
    ``hidden_states`` (property): ``meta_info.hidden_states`` when requested: list of length
    ``completion_tokens``; element 0 is the prompt block ``[prompt_len][W]``, the rest are ``[W]``
    rows (``sglang/srt/managers/scheduler_components/batch_result_processor.py::_append_prefill_hidden_states`` and
    ``_append_decode_hidden_states``).
    """

    model_config = ConfigDict(extra="allow")

    text: Optional[str] = None
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo
    prompt_token_ids: Optional[list[int]] = None
    latency_s: float = float("nan")

    @property
    def hidden_states(self) -> Optional[list]:
        return (self.meta_info.model_extra or {}).get("hidden_states")
