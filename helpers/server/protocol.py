"""Typed models of SGLang's HTTP answers the suite reads (``/server_info``, ``/generate`` and its ``meta_info``),
with the field aliases of older releases and the ranges a real server stays in: a count that sizes an array here
(draft steps, TP ranks, histogram bins) is checked before it sizes anything, and spec counters no server can
produce are named (:meth:`MetaInfo.spec_problem`).
"""
from __future__ import annotations

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
    spec_accept_length: Optional[float] = None
    spec_accept_rate: Optional[float] = None
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

    def spec_problem(self, num_steps: Optional[int]) -> Optional[str]:
        """Why these spec counters cannot come from a server running ``num_steps`` draft steps (None: unknown), or
        None when they can. Counts are already non-negative (the field types).

        Each verify step accepts at most ``num_steps`` draft tokens (the chain length for topk 1, the tree depth
        otherwise) and emits those plus one bonus token; the prefill samples one more token before any verify step
        (``batch_result_processor.py``: ``spec_verify_ct += 1`` and ``update_spec_correct_drafts_histogram`` per
        verify step; ``tokenizer_manager.py::_calculate_spec_decoding_metrics``). So: correct drafts <= proposed
        drafts, correct drafts <= verify steps x num_steps, completion tokens <= verify steps x (num_steps + 1) + 1,
        and the histogram has at most num_steps + 1 bins.
        """
        v, c, p = self.spec_verify_ct, self.spec_num_correct_drafts, self.spec_num_proposed_drafts
        if not v:
            return None
        if c is not None and p is not None and c > p:
            return (f"spec_num_correct_drafts {c} > spec_num_proposed_drafts {p} (more draft tokens accepted than "
                    "proposed)")
        if num_steps is None:
            return None
        hist = self.spec_correct_drafts_histogram
        if hist is not None and len(hist) > num_steps + 1:
            return (f"spec_correct_drafts_histogram has {len(hist)} bins, more than num_steps + 1 = {num_steps + 1} "
                    "(a verify step accepts at most num_steps draft tokens)")
        if c is not None and c > v * num_steps:
            return (f"spec_num_correct_drafts {c} > {v} verify steps x {num_steps} draft steps (a verify step "
                    "accepts at most num_steps draft tokens)")
        ct = self.completion_tokens
        if ct is not None and ct > v * (num_steps + 1) + 1:
            return (f"{ct} completion tokens from {v} verify steps (at most {num_steps + 1} tokens each with "
                    f"num_steps {num_steps}, plus the prefill token: {v * (num_steps + 1) + 1})")
        return None


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
