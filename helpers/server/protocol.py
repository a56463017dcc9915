"""Typed models of SGLang's HTTP answers the suite reads (``/generate`` and its ``meta_info``), with the field
aliases of older releases (shared/reference/sglang-facts.md §8).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: Older meta_info names (sglang-facts §8) -> current name in 0.5.23.
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
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    e2e_latency: Optional[float] = None
    spec_verify_ct: Optional[int] = None
    spec_accept_length: Optional[float] = None
    spec_accept_rate: Optional[float] = None
    spec_num_correct_drafts: Optional[int] = None
    spec_num_proposed_drafts: Optional[int] = None
    spec_correct_drafts_histogram: Optional[list[int]] = None

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


class GenerateResult(BaseModel):
    """One ``/generate`` answer plus the client-side wall time.

    ``latency_s``: seconds from sending the request to having parsed the JSON (client view);
    ``meta_info.e2e_latency`` is the server's own view of the same request.
    ``prompt_token_ids``: only with ``return_prompt_token_ids=True``.
    ``hidden_states`` (property): ``meta_info.hidden_states`` when requested: list of length
    ``completion_tokens``; element 0 is the prompt block ``[prompt_len][W]``, the rest are ``[W]``
    rows (sglang-facts §1).
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
