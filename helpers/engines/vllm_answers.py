"""vLLM 0.32.0's answers in the suite's shapes: one ``/v1/completions`` answer as SGLang's ``meta_info`` fields and as a
per-request row (:data:`helpers.acceptance.requests.PER_REQUEST_COLUMNS`), the spec counters of ``/metrics``. The
definitions are the suite's (DESIGN.md "Words"): accept length = completion tokens / verify steps, the prefill's and the
bonus tokens included; ``env/vllm/README.md`` "Acceptance figures" says where each vLLM field comes from.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from prometheus_client.parser import text_string_to_metric_families

from ..acceptance.requests import PER_REQUEST_COLUMNS
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


def meta_info(answer: Mapping[str, Any]) -> dict:
    """SGLang's ``meta_info`` fields (:class:`helpers.server.protocol.MetaInfo`) from one vLLM ``/v1/completions``
    answer: ``prompt_tokens`` / ``completion_tokens`` / ``cached_tokens`` from ``usage``, ``finish_reason``, and from
    ``metrics.speculative_decoding`` (``entrypoints/generate/base/protocol.py::SpeculativeDecodingMetrics``, present
    with ``--per-request-spec-decode-metrics``): ``spec_verify_ct`` = ``num_spec_steps``, ``spec_num_correct_drafts``
    = ``num_accepted_draft_tokens``, ``spec_num_proposed_drafts`` = ``num_draft_tokens``,
    ``spec_correct_drafts_histogram`` = ``acceptance_histogram`` (index j: verify steps that accepted exactly j
    drafts), ``spec_accept_length`` = completion tokens / verify steps (SGLang's definition; vLLM's own
    ``mean_acceptance_length`` = 1 + accepted / steps is kept as ``vllm_mean_acceptance_length``)."""
    usage = answer.get("usage") or {}
    choice = (answer.get("choices") or [{}])[0]
    sd = ((answer.get("metrics") or {}).get("speculative_decoding")) or None
    ct = usage.get("completion_tokens")
    m: dict[str, Any] = {"id": answer.get("id"), "finish_reason": choice.get("finish_reason"),
                         "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": ct,
                         "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
    if sd:
        steps = int(sd.get("num_spec_steps") or 0)
        m.update(spec_verify_ct=steps, spec_num_correct_drafts=sd.get("num_accepted_draft_tokens"),
                 spec_num_proposed_drafts=sd.get("num_draft_tokens"),
                 spec_correct_drafts_histogram=sd.get("acceptance_histogram"),
                 spec_accept_length=(ct / steps) if steps and ct is not None else None,
                 spec_accept_rate=sd.get("draft_acceptance_rate"),
                 vllm_mean_acceptance_length=sd.get("mean_acceptance_length"))
    return m


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
