"""vLLM 0.32.0's answers in the suite's shapes: one ``/v1/completions`` answer as SGLang's ``meta_info`` fields and as a
per-request row (:data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS`), the spec counters of ``/metrics``. The
definitions are the suite's (DESIGN.md "Words"): accept length = completion tokens / verify steps, the prefill's and the
bonus tokens included; ``env/vllm/README.md`` "Acceptance figures" says where each vLLM field comes from.
"""
from __future__ import annotations

import json
from typing import Any, Mapping, Optional

from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..acceptance.requests import PER_REQUEST_COLUMNS
from ..errors import SGLangError
from ..server.client import answer_error
from ..server.protocol import MAX_NUM_STEPS, MAX_PARALLEL, Count
from .base import AcceptanceCounters, prometheus_sums, watch_fields

#: ``watch`` field -> vLLM 0.32.0 sample (``v1/metrics/loggers.py::PrometheusStatLogger``: ``generation_tokens``,
#: ``request_success``, ``prefix_cache_queries`` / ``prefix_cache_hits`` (tokens queried / found in the prefix
#: cache), ``num_requests_running`` / ``_waiting``, ``kv_cache_usage_perc`` (1 = 100 %); the spec counters of
#: ``v1/spec_decode/metrics.py::SpecDecodingProm``). ``process_start_time_seconds`` is prometheus_client's
#: ProcessCollector of the API server, present unless ``PROMETHEUS_MULTIPROC_DIR`` makes the registry multiprocess
#: (``v1/metrics/prometheus.py::get_prometheus_registry``). vLLM has no accept-length gauge.
WATCH_METRICS = {"generation_tokens": "vllm:generation_tokens_total",
                 "verify_steps": "vllm:spec_decode_num_drafts_total", "requests": "vllm:request_success_total",
                 "prompt_tokens": "vllm:prefix_cache_queries_total", "cached_tokens": "vllm:prefix_cache_hits_total",
                 "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
                 "running_reqs": "vllm:num_requests_running", "queue_reqs": "vllm:num_requests_waiting",
                 "kv_cache_use": "vllm:kv_cache_usage_perc", "start_time": "process_start_time_seconds"}


def parse_watch(metrics_text: str) -> dict:
    """``EngineAdapter.watch_snapshot`` of vLLM (:data:`WATCH_METRICS`): summed over engines, ``kv_cache_usage_perc``
    averaged over them; no gauge of the hit rate, accept length or rate (None)."""
    engines = sum(1 for fam in text_string_to_metric_families(metrics_text) for s in fam.samples
                  if s.name == "vllm:kv_cache_usage_perc")
    snap = watch_fields(prometheus_sums(metrics_text, list(WATCH_METRICS.values())), WATCH_METRICS,
                        mean_of={"kv_cache_use": engines})
    snap.update(engine="vllm", cache_hit_rate_gauge=None, accept_length_gauge=None, accept_rate_gauge=None)
    snap["sources"] = {k: f"{v} (vllm/v1/metrics/loggers.py)" for k, v in snap["sources"].items()}
    return snap

#: the most decoder layers a worker may report (the deepest open models have ~126: Llama 3.1 405B); a count past it,
#: or one unlike the target's config.json, is a broken answer, never the size of a list built here
MAX_LAYERS = 1024
#: the widest hidden size a worker may report (open models stay below 32768)
MAX_HIDDEN = 1 << 20


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class SpecDecoding(_Answer):
    """``metrics.speculative_decoding`` of one answer (``v1/metrics/stats.py::RequestSpecDecodeMetrics.to_dict``)."""

    num_spec_steps: Optional[Count] = None
    num_accepted_draft_tokens: Optional[Count] = None
    num_draft_tokens: Optional[Count] = None
    num_spec_tokens: Optional[int] = Field(None, ge=0, le=MAX_NUM_STEPS)
    acceptance_histogram: Optional[list[Count]] = Field(None, max_length=MAX_NUM_STEPS + 1)
    mean_acceptance_length: Optional[float] = Field(None, allow_inf_nan=False)
    draft_acceptance_rate: Optional[float] = Field(None, allow_inf_nan=False)


class _Metrics(_Answer):
    speculative_decoding: Optional[SpecDecoding] = None


class _Details(_Answer):
    cached_tokens: Optional[Count] = None


class _Usage(_Answer):
    prompt_tokens: Optional[Count] = None
    completion_tokens: Optional[Count] = None
    prompt_tokens_details: Optional[_Details] = None


class _Choice(_Answer):
    text: Optional[str] = None
    token_ids: Optional[list[Count]] = None
    prompt_token_ids: Optional[list[Count]] = None


class Completion(_Answer):
    """The fields of a ``/v1/completions`` answer read here (``entrypoints/openai/completion/protocol.py::
    CompletionResponse``, ``return_token_ids``): at least one choice, token ids and counts that are non-negative
    integers, ratios that are finite numbers."""

    choices: list[_Choice] = Field(min_length=1)
    usage: Optional[_Usage] = None
    metrics: Optional[_Metrics] = None
    prompt_token_ids: Optional[list[Count]] = None


class ModelCard(_Answer):
    """One ``/v1/models`` entry (``entrypoints/serve/engine/protocol.py::ModelCard``): ``id`` and ``root`` (the
    target's path) are strings, ``max_model_len`` a positive integer."""

    id: str
    root: Optional[str] = None
    owned_by: Optional[str] = None
    max_model_len: Optional[int] = Field(None, ge=1)


class DraftReport(_Answer):
    """``draft`` of the worker extension's ``e3f_describe`` (:meth:`helpers.engines.vllm_worker.CaptureExtension.
    e3f_describe`)."""

    method: Optional[str] = None
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = Field(None, ge=1, le=MAX_NUM_STEPS)


class RankReport(_Answer):
    """One TP rank's ``e3f_describe``: rank and size within :data:`helpers.server.protocol.MAX_PARALLEL`, layers within
    :data:`MAX_LAYERS`, aux ids integers, ``settings`` an object."""

    tp_rank: Optional[int] = Field(None, ge=0, lt=MAX_PARALLEL)
    tp_size: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL)
    num_layers: Optional[int] = Field(None, ge=0, le=MAX_LAYERS)
    hidden_size: Optional[int] = Field(None, ge=1, le=MAX_HIDDEN)
    aux_layer_ids: Optional[list[int]] = Field(None, max_length=MAX_LAYERS)
    target_class: Optional[str] = None
    settings: Optional[dict] = None
    draft: Optional[DraftReport] = None


class _DevSpec(_Answer):
    method: Optional[str] = None
    model: Optional[str] = None
    num_speculative_tokens: Optional[int] = Field(None, ge=1, le=MAX_NUM_STEPS)


class _DevParallel(_Answer):
    tensor_parallel_size: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL)


class _DevConfig(_Answer):
    speculative_config: Optional[_DevSpec] = None
    parallel_config: Optional[_DevParallel] = None


class DevServerInfo(_Answer):
    """The part of vLLM's dev-mode ``/server_info?config_format=json`` read here (``vllm_config``: the speculative
    config's method / draft path / token count, the TP size; ``entrypoints/serve/dev/server_info/api_router.py``)."""

    vllm_config: Optional[_DevConfig] = None


def checked(model: type[BaseModel], data: Any, where: str, endpoint: str) -> Any:
    """``data`` when ``model`` accepts it (its own values, unchanged).

    Raises:
        helpers.errors.SGLangError: ``<where>: field <name>: <what was expected>, got <value>`` (the first field).
    """
    try:
        model.model_validate(data)
    except ValidationError as exc:
        raise answer_error(exc, where, endpoint) from None
    return data


def checked_ranks(ranks: list, where: str, target_layers: Optional[int], target: Optional[str]) -> list[dict]:
    """The worker extension's ``e3f_describe`` answer (one dict per TP rank), checked: at least one rank, each a
    :class:`RankReport`, and each rank's ``num_layers`` equal to the target config's ``num_hidden_layers`` when that
    config is readable here (``target_layers``; vLLM's model holds every layer of it, PP placeholders included:
    ``models/llama.py::LlamaModel.__init__``, ``make_layers``).

    Raises:
        helpers.errors.SGLangError: no rank, a field of another type or out of range (named with the rank), a layer
            count unlike the target's."""
    if not ranks:
        raise SGLangError(f"{where}: no rank answered (expected one object per TP rank)", endpoint="/collective_rpc")
    for i, r in enumerate(ranks):
        checked(RankReport, r, f"{where} (rank {i})", "/collective_rpc")
        n = r.get("num_layers")
        if target_layers is not None and n is not None and n != target_layers:
            raise SGLangError(f"{where} (rank {i}): field num_layers: {n} layers, but the target's config.json "
                              f"({target}) has num_hidden_layers {target_layers}", endpoint="/collective_rpc")
    return ranks


def meta_info(answer: Mapping[str, Any]) -> dict:
    """SGLang's ``meta_info`` fields (:class:`helpers.server.protocol.MetaInfo`) from one vLLM ``/v1/completions``
    answer: ``prompt_tokens`` / ``completion_tokens`` / ``cached_tokens`` from ``usage``, ``finish_reason``, and from
    ``metrics.speculative_decoding`` (``entrypoints/generate/base/protocol.py::SpeculativeDecodingMetrics``, present
    with ``--per-request-spec-decode-metrics``): ``spec_verify_ct`` = ``num_spec_steps``, ``spec_num_correct_drafts``
    = ``num_accepted_draft_tokens``, ``spec_num_proposed_drafts`` = ``num_draft_tokens``,
    ``spec_correct_drafts_histogram`` = ``acceptance_histogram`` (index j: verify steps that accepted exactly j
    drafts), ``spec_accept_length`` = completion tokens / verify steps (SGLang's definition; vLLM's own
    ``mean_acceptance_length`` = 1 + accepted / steps is kept as ``vllm_mean_acceptance_length``); with ``logprobs``
    and ``return_tokens_as_token_ids`` asked for, ``output_top_logprobs`` in SGLang's shape (:func:`top_logprobs`)."""
    usage = answer.get("usage") or {}
    choice = (answer.get("choices") or [{}])[0]
    sd = ((answer.get("metrics") or {}).get("speculative_decoding")) or None
    ct = usage.get("completion_tokens")
    m: dict[str, Any] = {"id": answer.get("id"), "finish_reason": choice.get("finish_reason"),
                         "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": ct,
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
    tops = top_logprobs(choice)
    if tops is not None:
        m["output_top_logprobs"] = tops
    if sd:
        steps = int(sd.get("num_spec_steps") or 0)
        m.update(spec_verify_ct=steps, spec_num_correct_drafts=sd.get("num_accepted_draft_tokens"),
                 spec_num_proposed_drafts=sd.get("num_draft_tokens"),
                 spec_correct_drafts_histogram=sd.get("acceptance_histogram"),
                 spec_accept_length=(ct / steps) if steps and ct is not None else None,
                 spec_accept_rate=sd.get("draft_acceptance_rate"),
                 vllm_mean_acceptance_length=sd.get("mean_acceptance_length"))
    return m


def top_logprobs(choice: Mapping[str, Any]) -> Optional[list]:
    """A choice's ``logprobs.top_logprobs`` (per output position a ``{"token_id:<id>": logprob}`` object, the sampled
    token and the ``logprobs`` best: ``entrypoints/openai/completion/serving.py::_create_completion_logprobs`` with
    ``return_tokens_as_token_ids``) as SGLang's ``output_top_logprobs``: per position ``[[logprob, token id, None],
    ...]``, best first; a position vLLM left empty, or a key that is not ``token_id:<int>`` (tokens returned as text),
    is None. None when the answer has no log-probabilities."""
    lp = choice.get("logprobs") if isinstance(choice, Mapping) else None
    tops = lp.get("top_logprobs") if isinstance(lp, Mapping) else None
    if not isinstance(tops, list):
        return None
    out: list = []
    for pos in tops:
        row = []
        for key, v in (pos.items() if isinstance(pos, Mapping) else ()):
            tid = str(key).removeprefix("token_id:")
            if not str(key).startswith("token_id:") or not tid.isdigit() or not isinstance(v, (int, float)):
                row = None
                break
            row.append([float(v), int(tid), None])
        out.append(sorted(row, key=lambda e: -e[0]) if row else None)
    return out


def record(i: int, prompt_id: str, answer: Mapping[str, Any], kind: str = "measure") -> dict:
    """One row of ``helpers.acceptance.requests.PER_REQUEST_COLUMNS`` from a vLLM ``/v1/completions`` answer, with
    SGLang's definitions: ``verify_ct`` = ``num_spec_steps``, ``correct_drafts`` = ``num_accepted_draft_tokens``,
    ``proposed_drafts`` = ``num_draft_tokens``, ``histogram`` = ``acceptance_histogram`` (index j: verify steps that
    accepted j drafts), ``accept_length`` = completion tokens / verify steps (the prefill's token and the bonus
    tokens included, as SGLang's ``spec_accept_length``), ``server_accept_length`` = vLLM's
    ``mean_acceptance_length`` (1 + accepted / steps). Spec fields stay None when the server was started without
    ``--per-request-spec-decode-metrics`` (``has_spec`` False)."""
    row = {c: None for c in PER_REQUEST_COLUMNS}
    usage = answer.get("usage") or {}
    choice = (answer.get("choices") or [{}])[0]
    sd = ((answer.get("metrics") or {}).get("speculative_decoding")) or None
    ct = usage.get("completion_tokens")
    lat = answer.get("latency_s")
    details = usage.get("prompt_tokens_details") or {}
    row.update(idx=i, prompt_id=prompt_id, kind=kind, prompt_tokens=usage.get("prompt_tokens"),
               completion_tokens=ct, cached_tokens=details.get("cached_tokens"),
               finish_reason=choice.get("finish_reason"),
               latency_s=lat, tok_s=(ct / lat) if ct and lat else None, has_spec=sd is not None)
    if sd:
        steps = int(sd.get("num_spec_steps") or 0)
        hist = [int(x) for x in sd.get("acceptance_histogram") or []]
        row.update(verify_ct=steps, correct_drafts=sd.get("num_accepted_draft_tokens"),
                   proposed_drafts=sd.get("num_draft_tokens"),
                   hist_correct_drafts=sum(j * c for j, c in enumerate(hist)) if hist else None,
                   histogram=json.dumps(hist) if hist else None,
                   accept_length=(ct / steps) if steps and ct is not None else None,
                   accept_rate=(sd["num_accepted_draft_tokens"] / sd["num_draft_tokens"])
                   if sd.get("num_draft_tokens") else None,
                   server_accept_length=sd.get("mean_acceptance_length"))
    return row


def parse_counters(metrics_text: str) -> AcceptanceCounters:
    """The ``vllm:spec_decode_*`` counters (summed over engines), ``vllm:generation_tokens_total`` and
    ``vllm:request_success_total`` of one ``/metrics`` text (``v1/spec_decode/metrics.py::SpecDecodingProm``,
    ``v1/metrics/loggers.py``). A server without speculative decoding has no spec counters: ``verify_steps`` 0 and
    None for the others."""
    sums: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
                p = int(s.labels.get("position", -1))
                per_pos[p] = per_pos.get(p, 0.0) + float(s.value)
            elif s.name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                            "vllm:spec_decode_num_accepted_tokens_total", "vllm:generation_tokens_total",
                            "vllm:request_success_total"):
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    spec = "vllm:spec_decode_num_drafts_total" in sums
    return AcceptanceCounters(
        engine="vllm", verify_steps=sums.get("vllm:spec_decode_num_drafts_total", 0.0),
        generation_tokens=sums.get("vllm:generation_tokens_total"), requests=sums.get("vllm:request_success_total"),
        draft_tokens=sums.get("vllm:spec_decode_num_draft_tokens_total") if spec else None,
        accepted_tokens=sums.get("vllm:spec_decode_num_accepted_tokens_total") if spec else None,
        accepted_per_position=[per_pos[p] for p in sorted(per_pos)] if per_pos else None)


def verify_sampling_fault(info: Mapping[str, Any]) -> Optional[dict]:
    """The worker extension's ``verify_sampling`` check (``info["verify_sampling"]``, rank 0: vLLM's own
    ``rejection_sampler.py::expand_batch_to_tokens`` run in the worker on known per-request values) when a field
    came back other than sent. On vLLM 0.32.0's CPU backend without Triton the expand kernel is
    ``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``, which hands the C++ kernel int64 copies of the float32
    / int32 tensors (``_ensure_int64``) and never copies the result back, so ``expand_batch_to_tokens`` returns
    the uninitialised tensor it allocated: ``apply_sampling_constraints`` then divides each verify row's logits by
    garbage and applies a garbage top-k / top-p (the sampled verify's target distribution is not the request's).
    Greedy requests never read it (``all_greedy`` returns the logits untouched)."""
    chk = info.get("verify_sampling")
    if not isinstance(chk, dict) or chk.get("equal") is not False:
        return None
    fields = chk.get("fields") or {}
    bad = {k: v for k, v in fields.items() if isinstance(v, dict) and v.get("equal") is False}
    shown = "; ".join(f"{k} {v.get('sent')} -> {v.get('expanded')} (expected {v.get('expected')})"
                      for k, v in bad.items())
    detail = (f"vLLM {info.get('version')} on {info.get('device') or 'this device'}: its own "
              f"{chk.get('function')}, run in the worker on known per-request values, returned other per-token "
              f"values than it was given: {shown}. At temperature > 0 the verify step divides each draft row's "
              "target logits by the expanded temperature and applies the expanded top-k / top-p "
              "(vllm/v1/sample/rejection_sampler.py::apply_sampling_constraints), so sampled requests are verified "
              "against another distribution than the request's")
    if (info.get("device") or "cpu") == "cpu":
        detail += ("; on the CPU backend without Triton the expand is vllm/utils/cpu_triton_utils.py::"
                   "_expand_kernel_impl, which writes into int64 copies of the float32 / int32 tensors and never "
                   "copies them back")
    return {"detail": detail, "evidence": chk,
            "source": "worker extension e3f_describe verify_sampling (helpers.engines.vllm_worker."
                      "_verify_sampling_check), TP rank 0"}


def sampling_rule(info: Mapping[str, Any]) -> str:
    """The server's ``draft_sample_method`` / ``rejection_sample_method`` (its worker's ``SpeculativeConfig``), and
    :func:`verify_sampling_fault` when the server's own check failed."""
    dsm, rsm = info.get("draft_sample_method") or "greedy", info.get("rejection_sample_method") or "standard"
    how = ("the draft's probabilities count as one-hot, so a draft token is accepted with the target's "
           "probability of it (strict), not min(1, p/q)" if dsm == "greedy" else
           "the draft samples from its distribution and a token is accepted with min(1, p/q)")
    rule = (f"vLLM {info.get('version')} runs rejection_sample_method {rsm!r} with draft_sample_method {dsm!r}: "
            f"{how} (vllm/config/speculative.py::SpeculativeConfig.draft_sample_method; "
            "vllm/v1/sample/rejection_sampler.py::rejection_random_sample_kernel: draft_prob = 1 without draft "
            "probs); at temperature 0 verification is greedy")
    fault = verify_sampling_fault(info)
    if fault is not None:       # the fall with temperature is then not the rule's alone: say so, name no share
        rule += ("; but on this server the verify step does not use the request's sampling values at "
                 "temperature > 0 (verify_sampling_params_wrong: " + fault["detail"] + "), so how much of the fall "
                 "is the rule's is not measured here")
    return rule
