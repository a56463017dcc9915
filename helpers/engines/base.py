"""The engine seam: one :class:`EngineAdapter` per serving engine, and the typed results every adapter returns, so that
attach, capture, the acceptance figures and the notebooks read one shape whatever the engine.

Definitions shared by every engine (DESIGN.md "Words"): a **verify step** is one target forward that checks a
request's drafts; **accept length** is tokens per verify step, the bonus token included, over a measurement =
generated tokens / verify steps (SGLang's per-request ``spec_accept_length = completion_tokens / spec_verify_ct``,
which also counts the prefill's token); **accept rate** is accepted drafts / proposed drafts.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
import math
from typing import TYPE_CHECKING, Any, ClassVar, Mapping, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field

from ..errors import BadInput
from ..server.client import HTTPClient
from ..server.process import ServerProcess

if TYPE_CHECKING:          # annotations only: both import torch, and `measure` detects the engine without it
    from ..diagnosis.plan_rules import PlanRules
    from ..draft.checks import LoaderRules


class SpecConfig(BaseModel):
    """The speculative config a server really runs, as its engine reports it (``sources`` says where each field came
    from: an endpoint, the worker extension, or an engine rule with its file::function)."""

    model_config = ConfigDict(extra="allow")

    engine: str
    version: str
    tp_size: Optional[int] = None
    method: Optional[str] = None
    target: Optional[str] = None
    draft: Optional[str] = None
    num_speculative_tokens: Optional[int] = Field(None, description="draft tokens per verify step (chain)")
    aux_layer_ids: Optional[list[int]] = None
    aux_layer_convention: Optional[str] = None
    aux_tensors: Optional[list[Optional[str]]] = Field(None, description="physical tensor of each aux chunk")
    rule_aux_layer_ids: Optional[list[int]] = Field(None, description="the ids the engine's rules give for the draft "
                                                                      "config (compare with aux_layer_ids)")
    loaded: Optional[dict[str, Any]] = Field(None, description="what the engine built, as it reports it")
    overrides: list[str] = Field(default_factory=list, description="silent overrides the engine made")
    sources: dict[str, str] = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)


class AcceptanceCounters(BaseModel):
    """Cumulative speculative-decoding counters read from a server's ``/metrics`` (one snapshot); subtract two with
    :meth:`delta` around a measurement. None where the engine exports no such counter."""

    engine: str
    verify_steps: float = 0.0
    generation_tokens: Optional[float] = None
    requests: Optional[float] = None
    draft_tokens: Optional[float] = None
    accepted_tokens: Optional[float] = None
    accepted_per_position: Optional[list[float]] = None

    def delta(self, before: "AcceptanceCounters") -> "AcceptanceCounters":
        """``self - before`` field by field (None where either lacks the counter).

        Raises:
            ValueError: the snapshots are of different engines, or a counter went down (the server restarted or
                reset its counters between them)."""
        if before.engine != self.engine:
            raise ValueError(f"counters of {before.engine} and {self.engine} cannot be subtracted")

        def sub(a: Optional[float], b: Optional[float], name: str) -> Optional[float]:
            if a is None or b is None:
                return None
            if a < b:
                raise ValueError(f"counter {name} went down ({b} -> {a}): the server restarted or reset its counters")
            return a - b

        pos = None
        if self.accepted_per_position is not None and before.accepted_per_position is not None:
            if len(self.accepted_per_position) != len(before.accepted_per_position):
                raise ValueError("the number of draft positions changed between the two snapshots")
            pos = [sub(a, b, f"accepted_per_position[{i}]") for i, (a, b)
                   in enumerate(zip(self.accepted_per_position, before.accepted_per_position))]
        return AcceptanceCounters(
            engine=self.engine, verify_steps=sub(self.verify_steps, before.verify_steps, "verify_steps") or 0.0,
            generation_tokens=sub(self.generation_tokens, before.generation_tokens, "generation_tokens"),
            requests=sub(self.requests, before.requests, "requests"),
            draft_tokens=sub(self.draft_tokens, before.draft_tokens, "draft_tokens"),
            accepted_tokens=sub(self.accepted_tokens, before.accepted_tokens, "accepted_tokens"),
            accepted_per_position=pos)

    def summary(self) -> dict[str, Optional[float]]:
        """The figures of a delta, with the suite's definitions: ``accept_length`` = generated tokens / verify steps
        (bonus and prefill token included, as SGLang's ``spec_accept_length``); ``accept_length_drafts`` = 1 +
        accepted drafts / verify steps (vLLM's "mean acceptance length"); ``accept_rate`` = accepted / proposed
        drafts; ``p_accept_ge`` = [P(accepted >= i + 1)] per draft position. None where a counter is missing or
        there was no verify step."""
        v = self.verify_steps
        ok = v and v > 0
        return {
            "verify_steps": v,
            "accept_length": (self.generation_tokens / v) if ok and self.generation_tokens is not None else None,
            "accept_length_drafts": (1 + self.accepted_tokens / v) if ok and self.accepted_tokens is not None
            else None,
            "accept_rate": (self.accepted_tokens / self.draft_tokens) if self.accepted_tokens is not None
            and self.draft_tokens else None,
            "p_accept_ge": [a / v for a in self.accepted_per_position] if ok and self.accepted_per_position
            is not None else None,
        }


#: the fields of a ``watch`` snapshot (:meth:`EngineAdapter.watch_snapshot`): cumulative counters (tokens, steps,
#: requests since the server started), then gauges (their value now, over a window the engine chooses)
WATCH_COUNTERS = ("generation_tokens", "verify_steps", "requests", "prompt_tokens", "cached_tokens", "draft_tokens",
                  "accepted_tokens")
WATCH_GAUGES = ("running_reqs", "queue_reqs", "kv_cache_use", "cache_hit_rate_gauge", "accept_length_gauge",
                "accept_rate_gauge", "start_time", "weight_load_s")


def prometheus_sums(metrics_text: str, names: Sequence[str]) -> dict[str, float]:
    """The sum over label sets of each sample named in ``names`` found in one Prometheus text (absent names left
    out). ``process_start_time_seconds`` (prometheus_client's ProcessCollector: the serving process's start, Unix
    seconds) is read as is, never summed twice."""
    want = set(names)
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name in want and math.isfinite(float(s.value)):
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    return sums


def watch_fields(sums: Mapping[str, float], names: Mapping[str, str], *, mean_of: Mapping[str, int] = {}) -> dict:
    """A ``watch`` snapshot from ``sums`` (:func:`prometheus_sums`): field -> value for each ``names`` entry (field ->
    sample name) found, None otherwise, and ``sources`` (field -> the sample name read). ``mean_of``: fields whose
    sum over label sets is divided by a count (a gauge exported once per engine / DP rank)."""
    out: dict[str, Any] = {}
    sources = {}
    for fld, sample in names.items():
        v = sums.get(sample)
        if v is not None and fld in mean_of and mean_of[fld] > 0:
            v = v / mean_of[fld]
        out[fld] = v
        if v is not None:
            sources[fld] = sample
    out["sources"] = sources
    return out


@dataclass(frozen=True)
class Continuation:
    """One prompt's continuation as the server generated it (:meth:`EngineAdapter.continuations`): ``id`` the
    prompt's id, ``prompt_ids`` the prompt's token ids as the server tokenized it, ``output_ids`` the generated token
    ids (``max_new_tokens`` of them, EOS ignored). Token ids only: no hidden states."""

    id: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]

    @property
    def tokens(self) -> list[int]:
        """Prompt then output token ids (what an every-layer capture replays)."""
        return [*self.prompt_ids, *self.output_ids]


@dataclass(frozen=True)
class ContextRule:
    """What a server does with a request longer than its context (:meth:`EngineAdapter.context_rule`): ``tokens`` its
    context length (tokens), ``reserved`` the token slots it keeps per request on top of the prompt (counted against
    the context), ``max_prompt`` the longest prompt (tokens) it takes, ``clamps`` True when it cuts
    ``max_new_tokens`` to ``tokens - reserved - prompt`` (False: it refuses a request past the context),
    ``source`` the engine function that does it, ``prompt_source`` the engine function that sets ``max_prompt`` when
    another one does (None: ``source``), ``no_room_source`` the engine function that refuses a prompt leaving no room
    for one generated token, when another one does (None: ``source``)."""

    tokens: int
    reserved: int
    max_prompt: int
    clamps: bool
    source: str
    prompt_source: Optional[str] = None
    no_room_source: Optional[str] = None


#: requests in flight of :meth:`EngineAdapter.continuations` by default
CONTINUATION_CONCURRENCY = 8

#: the state SGLang 0.5.23 hands a NextN head: ``sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward``
#: reads ``spec_info.hidden_states``, ``sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward``'s output after
#: ``final_norm`` (``EngineAdapter.mtp_fed_state``)
MTP_FEED_DEFAULT = ("norm(out(n-1))", "sglang/srt/models/deepseek_nextn.py::DeepseekModelNextN.forward "
                    "(spec_info.hidden_states) <- sglang/srt/models/deepseek_v2.py::DeepseekV2Model.forward "
                    "(final_norm applied)")


class EngineAdapter(ABC):
    """Everything engine-specific behind one contract (one subclass per engine; ``helpers.engines.detect`` picks
    one from a URL). Callers (attach, capture, the budget, ablations, notebooks) never branch on the engine."""

    #: short name (``sglang`` | ``vllm``), as in ``server start --engine``
    name: ClassVar[str]
    #: the name in messages (``SGLang`` | ``vLLM``)
    label: ClassVar[str]

    @classmethod
    @abstractmethod
    def supported(cls) -> str:
        """The releases whose rules this adapter knows, for messages (``"vLLM 0.32.0"``)."""

    @classmethod
    def version_refusal(cls, version: str, where: str) -> Optional[str]:
        """Why a server of this engine answering ``version`` (at ``where``, e.g. ``GET /version``) cannot be worked
        with -- a release whose rules are not known, a version that is not one -- or None to go on. Detection
        (:func:`helpers.engines.detect.detect`) turns it into one line of bad input, exit 2."""
        return None

    @classmethod
    @abstractmethod
    def probe(cls, http: HTTPClient) -> Optional[tuple[str, dict]]:
        """``(version, evidence)`` when the server at ``http.url`` is this engine (asked through its own
        endpoints), None when it answers as something else. Never guesses: an answer that names this engine but
        no version raises :class:`helpers.errors.BadInput`."""

    @abstractmethod
    def client(self, url: str, api_key: Optional[str] = None, **kwargs: Any) -> HTTPClient:
        """This engine's HTTP client for ``url``."""

    @abstractmethod
    def start(self, target: str | Path, draft: str | Path | None, *, tp: int = 1, **kwargs: Any) -> ServerProcess:
        """Start the embedded reference server of this engine on 127.0.0.1 (stopped by PID: ``handle.stop()``)."""

    @abstractmethod
    def spec_config(self, client: HTTPClient, *, draft: str | Path | None = None) -> SpecConfig:
        """The effective speculative config (``draft``: the draft folder when the server does not tell it)."""

    @abstractmethod
    def counters(self, client: HTTPClient) -> AcceptanceCounters:
        """A snapshot of the acceptance counters of ``/metrics``."""

    @abstractmethod
    def watch_snapshot(self, metrics_text: str) -> dict:
        """What ``watch`` samples from one ``/metrics`` text: a dict of :data:`WATCH_COUNTERS` (cumulative, tokens /
        steps / requests; None where the engine exports no such counter) and :data:`WATCH_GAUGES` (``running_reqs``,
        ``queue_reqs``: requests; ``kv_cache_use``: the share 0-1 of the KV pool in use; the engine's own
        ``cache_hit_rate_gauge``, ``accept_length_gauge``, ``accept_rate_gauge`` over a window it chooses;
        ``start_time``: the serving process's start in Unix seconds when the engine reports it; ``weight_load_s``: the
        seconds of the last in-place weight update, summed over its sources, None before any), with ``engine``
        and ``sources`` (field -> the metric read, with the engine file that defines it)."""

    @abstractmethod
    def capture_served(self, client: HTTPClient, prompts: Sequence[Any], out_dir: str | Path, *,
                       name: str = "served", max_new_tokens: int = 1, records: Optional[list] = None,
                       rank_dir: str | Path | None = None, max_width: Optional[int] = None,
                       progress: bool = False, sampling: Optional[dict] = None) -> Path:
        """Dump the aux hidden states the server feeds its draft for ``prompts`` (token-id sequences, text prompts or
        training samples) into ``out_dir/name`` (``helpers.formats.dumps`` format, kind ``served``, one row per token:
        the prompt's, then each generated token's but the last, as the server computed them while generating
        ``max_new_tokens`` greedy tokens, the prefix cache emptied before each prompt).

        ``records``: a list that gets one row of ``helpers.acceptance.requests.PER_REQUEST_COLUMNS`` per prompt, from
        the same answer (the budget's live stage pairs the states and the counters of one request).
        ``rank_dir``: the per-TP-rank capture folder (``rank<r>/index.jsonl``, ``helpers.capture.per_rank_dumps``):
        where the engine's capture writes every rank while this runs, when it can.
        ``max_width``: the widest row accepted (16 x the hidden size).
        ``sampling``: SGLang-named sampling params laid over the greedy default (``temperature``, ``top_p``,
        ``top_k``, ``sampling_seed``: seed + prompt index per request, :func:`helpers.capture.sampling_params`): the
        states and the counters of the *sampled* continuation."""

    def continuations(self, client: HTTPClient, prompts: Sequence[Any], *, max_new_tokens: int,
                      sampling: Optional[dict] = None, concurrency: int = CONTINUATION_CONCURRENCY,
                      timeout_s: float = 300.0) -> list[Continuation]:
        """The server's own continuations of ``prompts`` (:class:`helpers.acceptance.prompts.Prompt`, token-id
        sequences, text, dicts; :func:`helpers.capture.prompt_fields`), token ids only, ``concurrency`` requests in
        flight (at most; 1 sends them one at a time), each with a read deadline of ``timeout_s`` seconds (and the
        client's own budget). ``sampling``: SGLang-named sampling params over the greedy default, a
        ``sampling_seed`` becoming seed + prompt index (:func:`helpers.capture.sampling_params`), so that where the
        engine honours it a prompt's answer does not depend on the order the requests are served in (vLLM 0.32.0
        does per request; SGLang 0.5.23 only with ``--enable-deterministic-inference``:
        ``sglang/srt/sampling/sampling_batch_info.py::SamplingBatchInfo.from_schedule_batch`` builds the seed tensor
        only then, so without it each run draws anew). Returns one :class:`Continuation` per prompt, in the prompts'
        order.

        The prefix cache is emptied once, before the first request, not before each: a cache hit changes which
        positions a forward computes, not what they are (SGLang 0.5.23: the prefill of a hit extends from the cached
        KV, ``sglang/srt/managers/schedule_batch.py::Req.init_next_round_input`` -> ``match_kv_cache``, the same
        K and V of the same tokens; vLLM 0.32.0: ``vllm/v1/core/kv_cache_manager.py::KVCacheManager.
        get_computed_blocks``, whole blocks of the same tokens), so the tokens are the target's own either way; the
        flush before each request that :meth:`capture_served` does is for its hidden-state rows (the prompt block
        covers the whole prompt only without a hit: ``helpers.capture.capture_served``), which this method does not
        return. Measured on the embedded SGLang TP 2 server (bench/bench_plan_id_concurrent.py, greedy): 8 and 16 in
        flight gave the same tokens as ``capture_served`` one request at a time with the cache flushed before each, 32
        of 32 prompts x 96 tokens in three runs, 2.0-3.4x faster with the every-layer reference and the offline pass
        (bench/RESULTS.md).

        Raises:
            helpers.errors.ServerTimeout: a request past ``timeout_s``.
            helpers.errors.SGLangError / RequestRejected: an answer that is an error or malformed (the first one
                of the requests in flight)."""
        from ..acceptance.requests import _in_workers  # lazy: pandas (measure detects the engine without it)
        from ..capture import prompt_fields  # lazy: torch
        if concurrency < 1:
            raise BadInput(f"concurrency must be >= 1, got {concurrency}", field="concurrency")
        items = [prompt_fields(p, i) for i, p in enumerate(prompts)]
        out: list[Optional[Continuation]] = [None] * len(items)

        def one(i: int) -> None:
            pid, ids, text = items[i]
            out[i] = self.continuation(client, pid, ids, text, i, max_new_tokens=max_new_tokens, sampling=sampling,
                                       timeout_s=timeout_s)

        if items:
            client.flush_cache()
            _in_workers(one, len(items), min(int(concurrency), len(items)), on_done=lambda: None)
        return [c for c in out if c is not None]

    @abstractmethod
    def continuation(self, client: HTTPClient, prompt_id: str, input_ids: Optional[Sequence[int]],
                     text: Optional[str], index: int, *, max_new_tokens: int, sampling: Optional[dict],
                     timeout_s: float) -> Continuation:
        """One request of :meth:`continuations`: prompt ``index`` (token ids, else ``text``), ``max_new_tokens``
        tokens, EOS ignored, ``sampling`` as there, its read deadline ``timeout_s`` seconds; the prompt's token ids
        as the server tokenized it."""

    def context_rule(self, client: HTTPClient) -> Optional[ContextRule]:
        """How this server treats a request whose prompt tokens + ``max_new_tokens`` exceed its context length
        (:class:`ContextRule`), or None when this tool has not read the engine's rule or the server does not tell its
        context length."""
        return None

    #: MTP family -> ``(candidate, source)``: the target tensor this engine hands the family's MTP / NextN head, in
    #: the served-state candidates' names (``norm(out(n-1))``: after the final norm; ``out(n-1)``: before it); a
    #: family not listed gets :data:`MTP_FEED_DEFAULT`. vLLM's: ``helpers.engines.vllm_mtp.FED_STATE``.
    mtp_feed: Mapping[str, tuple[str, str]] = {}
    #: where this engine runs an MTP head for more draft steps than it has layers (None: the suite's SGLang source,
    #: ``helpers.draft.nextn_stage.STEPS_SOURCE``); the settings finding cites it
    mtp_steps_source: Optional[str] = None

    def mtp_fed_state(self, family: Optional[str]) -> tuple[str, str]:
        """``(candidate, source)`` of :attr:`mtp_feed` for an MTP head of ``family`` (``attach.draft_head['family']``),
        else :data:`MTP_FEED_DEFAULT` (SGLang 0.5.23's DeepSeek-V3 rule, the state after the final norm)."""
        return self.mtp_feed.get(family or "", MTP_FEED_DEFAULT)

    def draft_checksum(self, client: HTTPClient) -> Optional[dict]:
        """The served draft's weights as the engine hashes them (one call; ``check-draft``'s and ``watch``'s weight
        evidence): ``{"per_engine_checksum": str, "ranks": [{"role", "tp_rank", "tensors", "checksum"}], "source"}``,
        or None when the engine has no such endpoint (the default; vLLM 0.32.0 has none).

        Raises: :class:`helpers.errors.ServerError` when the endpoint exists and fails."""
        return None

    @abstractmethod
    def rank_capture_dir(self, hooks_ranks_dir: Optional[Path], run_dir: Path, name: str) -> Optional[Path]:
        """Where the per-TP-rank states of a capture are written (``capture_served(rank_dir=...)``): the folder of
        the server's own per-rank capture hooks (``hooks_ranks_dir``, from what it reports), or a new folder of the
        run that the engine's capture writes, or None when the server records no rank."""

    @abstractmethod
    def rules(self, version: Optional[str]) -> PlanRules:
        """This engine's rules for what it feeds the draft (:class:`helpers.diagnosis.plan_rules.PlanRules`), of
        ``version``."""

    @abstractmethod
    def loader_rules(self, version: Optional[str]) -> LoaderRules:
        """This engine's draft loader rules (:class:`helpers.draft.checks.LoaderRules`: lm_head, embedding, d2t,
        the weights and the config) of ``version``, for the server-free draft checks."""

    @abstractmethod
    def every_layer_source(self, client: HTTPClient, hooks_layers_dir: Optional[Path]) -> Optional[str]:
        """How the server itself can record every layer of the target for given tokens (its every-layer capture),
        or None when it cannot."""

    @abstractmethod
    def capture_every_layer(self, client: HTTPClient, prompts: Sequence[Any], out_dir: str | Path, *, name: str,
                            num_layers: int, hooks_layers_dir: Optional[Path]) -> Path:
        """A reference dump ``out_dir/name`` (chunks ``embedding, out(0) .. out(n-1)``) recorded by the server for
        ``prompts`` (only when :meth:`every_layer_source` says it can)."""

    def chunked_prefill_flags(self, tokens: int) -> Optional[dict]:
        """The launch flags that make this engine prefill a prompt in chunks of ``tokens`` tokens (the engine-state
        probe ``chunked_prefill``), or None when this tool has not read the engine's flag (the probe is skipped,
        saying so)."""
        return None

    def oracle_flags(self) -> Optional[dict]:
        """The launch flags that serve a model as its own draft (the perfect-draft oracle of the engine-state probe
        ``oracle``: the target drafting for itself), or None when this tool has not read how this engine does it."""
        return None

    def oracle_caveat(self) -> Optional[str]:
        """Why this engine's self-drafting path is not a perfect draft by construction (the draft sees other tokens
        than the target: the oracle's loss then includes the draft's own misses), or None when it drafts on the
        target's own sequence. One line for the ``oracle`` probe's report."""
        return None

    def prefix_cache_off(self, info: dict) -> Optional[str]:
        """Why the server (its ``server_info``, the suite's vocabulary) keeps no prefix cache, or None when it keeps
        one (the engine-state probe ``radix_hit`` is skipped with this reason)."""
        return None

    def prefix_hit_tokens(self, info: dict, prompt_tokens: int) -> Optional[int]:
        """How many prompt tokens of a prompt of ``prompt_tokens`` tokens, sent again unchanged, this engine serves from
        its prefix cache (tokens), or None when this tool has not read the engine's hit granularity."""
        return None

    def host_cache_launch(self, info: dict, *, device_tokens: int, host_tokens: int
                          ) -> tuple[Optional[dict], Optional[str]]:
        """The launch of a restarted copy of this server (``info``: its ``server_info``) whose prefix cache has a
        host-memory tier (the engine-state probe ``hicache_hit``): a device KV pool of ``device_tokens`` tokens and a
        host pool of at least ``host_tokens`` tokens. Returns ``({"flags": {flag: value or None}, "env": {...}},
        None)``, or ``(None, why)`` when this engine or this server has no such tier this tool can start (the probe is
        skipped with ``why``)."""
        return None, f"{self.label}: this tool has not read a host-memory tier of its prefix cache"

    def top_logprobs_fields(self, n: int) -> Optional[dict]:
        """The request fields (``client.generate(extra=...)``) that make an answer carry the ``n`` best
        log-probabilities of each output position as SGLang's ``meta_info.output_top_logprobs`` (per position a list
        of ``[logprob (nats), token id, text]``), or None when the engine returns none."""
        return None

    def sampled_verify_refusal(self, info: dict) -> Optional[str]:
        """Why this server's verification at temperature > 0 is not the rule the probe ``sampled_verify`` predicts
        offline (a draft token is accepted exactly when it equals the token the verify emits, the draft proposing its
        argmax: ``helpers.investigation.probes.sampled``), or None when it is."""
        return None

    def verify_sampling_fault(self, info: dict) -> Optional[dict]:
        """When the server's own check shows its verify step scaling the target's logits by other per-token sampling
        values (temperature, top-k, top-p) than each request's, ``{"detail": one sentence with the values and the
        engine function, "evidence": the check, "source": where it was read}``; None when the check passed or this
        engine has none."""
        return None

    def verify_note(self, info: dict) -> Optional[str]:
        """A note when this server's platform verifies with the target's argmax at any temperature, else None."""
        return None

    def trace_unavailable(self, client: HTTPClient) -> Optional[str]:
        """None when this server can record the draft step trace (:meth:`trace_requests`), else why not and how to
        get it (one line)."""
        return f"the draft step trace was not built for {self.label}"

    def trace_requests(self, client: HTTPClient, prompts: Sequence[Any], *, max_new_tokens: int, tag: str,
                       folder: Path) -> tuple[list, list[dict]]:
        """Send ``prompts`` (:class:`helpers.acceptance.prompts.Prompt`) greedy, one at a time, the prefix cache
        emptied before each, with the draft step trace armed; returns ``(sequences, records)``: one
        :class:`helpers.draft.simulate.SimSequence` per answer (prompt + output tokens, the aux states the server fed,
        keyed by the request id the records carry) and the trace records (:func:`helpers.draft.trace.
        request_cycles`' format). ``folder``: this call's new folder (raw captures).

        Raises:
            BadInput: the server recorded no trace (:meth:`trace_unavailable` says why beforehand)."""
        raise BadInput(self.trace_unavailable(client) or "no draft step trace on this engine")

    def integrity_launch(self, switch: str) -> Optional[dict]:
        """The launch flags and environment that turn one of this engine's own integrity switches on in a restarted
        copy (``switch``: ``kv_canary`` | ``invariant_check``, the engine-state probes of
        :mod:`helpers.investigation.probes.integrity`): ``{"flags": {flag: value or None}, "env": {name: value}}``,
        or None when this engine has no such switch this tool has read (the probe is skipped, saying so)."""
        return None

    def integrity_refusal(self, switch: str, info: dict) -> Optional[str]:
        """Why ``switch`` (:meth:`integrity_launch`) cannot run on a copy of this server (``info``: its
        ``server_info``; e.g. a switch that needs a device the server does not run on), or None."""
        return None

    @abstractmethod
    def start_variant(self, restart: dict, *, log_path: Path, budget: Any, draft: Optional[Path | str] = None,
                      keep_draft: bool = True, flags: Optional[dict] = None, capture_dir: Optional[Path] = None,
                      api_key: Optional[str] = None, port: int | str | None = None,
                      what: str = "the restarted server", env: Optional[dict] = None) -> ServerProcess:
        """Start a copy of a server this tool can restart (``restart``: ``{"kind": "embedded", "launch": ...}`` of
        the registry, or ``{"kind": "command", "argv": [...]}``) with another draft, without the draft, or with
        ``flags`` (this engine's launch flags) and ``env`` (environment variables on top of the launch's), on
        127.0.0.1; wait until it is healthy within ``budget``."""

    @abstractmethod
    def toggles(self) -> tuple[Any, ...]:
        """This engine's ablation toggles (``helpers.acceptance.ablations.Toggle``: flags, the report, the skip rule
        read from :meth:`helpers.server.client.ServerClient.server_info`)."""

    @abstractmethod
    def capture_caveats(self, info: dict, architectures: Optional[Sequence[str]], model_type: Optional[str]
                        ) -> list[str]:
        """The capture paths this server runs that the CPU reference could not verify, one sentence each, from its
        ``server_info`` and the target's architectures / model type ([] when none is known)."""

    @abstractmethod
    def sampling_rule(self, info: dict) -> str:
        """How this engine verifies sampled draft tokens at temperature > 0, with its file::function (the temperature
        sweep's finding says it), from the server's ``server_info``."""

    @abstractmethod
    def cli_refusal(self, args: Any) -> Optional[str]:
        """Why ``server start`` cannot start this engine's embedded server with these arguments (options of another
        engine, a missing target), or None."""

    @abstractmethod
    def start_from_cli(self, args: Any, draft: Optional[str], extra: list[str]) -> tuple[ServerProcess, dict]:
        """``server start``'s embedded server of this engine from its parsed arguments: ``(handle, launch)``, where
        ``launch`` (with ``engine``) is what the registry keeps so that :meth:`start_variant` can restart it."""

    @abstractmethod
    def fix_flags(self, fix: Any) -> dict:
        """The launch flags (this engine's) a proposed fix's ``server_args`` (SGLang's vocabulary:
        ``--speculative-num-steps`` ...) become when the fixed server is started."""
