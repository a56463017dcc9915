"""vLLM behind the engine seam: its HTTP client, engine and version detection, the effective speculative config, the
acceptance counters of ``/metrics`` and per request, and the capture of the aux hidden states it feeds the draft.
Rules and endpoints as read in vLLM 0.32.0 (``env/vllm/README.md``; the id rules are :mod:`helpers.layers.vllm`).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import httpx
from pydantic import ValidationError
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from ..acceptance.requests import PER_REQUEST_COLUMNS
from ..capture import _prompt_fields, _safe_key, read_rank_capture
from ..diagnosis.conventions import CapturePlan
from ..diagnosis.detectors import finding
from ..diagnosis.plan_rules import PlanRules
from ..layers.ids import LayerIds
from ..errors import BadInput, EndpointMissing, HiddenStatesDisabled, RequestRejected, SGLangError
from ..formats.configs import read_config_json
from ..formats.dumps import write_dump
from ..layers import vllm as rules
from ..redaction import redact
from ..server.client import HTTPClient, ServerClient
from ..server.protocol import GenerateResult
from ..server.settings import EffectiveSpecConfig, SpecSettings, spec_settings
from ..server.process import ServerProcess
from . import vllm_server
from .base import AcceptanceCounters, EngineAdapter, SpecConfig

#: the worker-extension route and what the tool needs the server started with to use it
EXTENSION_HINT = ("start it with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                  f"{vllm_server.WORKER_EXTENSION} with this checkout on PYTHONPATH "
                  "(python -m helpers server start --engine vllm does)")


class VLLMClient(ServerClient):
    """The suite's client contract (:class:`helpers.server.client.ServerClient`) for a vLLM OpenAI-compatible server:
    deadlines, byte limits, the API key ``$VLLM_API_KEY`` kept out of messages, and vLLM 0.32.0's endpoints
    (``env/vllm/README.md``) behind the methods measurement and capture call:

    * :meth:`server_info` -- the effective settings in the suite's vocabulary, from what the engine reports: the
      worker extension's ``e3f_describe`` (what it built), else the dev-mode ``/server_info`` ``vllm_config``, else
      ``/v1/models`` and ``/metrics``;
    * :meth:`generate` -- ``/v1/completions`` with the per-request ``metrics.speculative_decoding`` mapped to SGLang's
      ``meta_info`` names (``num_spec_steps`` -> ``spec_verify_ct`` ...: :func:`meta_info`);
    * :meth:`flush_cache` -- ``POST /reset_prefix_cache``;
    * :meth:`effective_spec_config` -- the speculative settings (vLLM makes no silent override of them: a chain of
      ``num_speculative_tokens`` drafts, topk 1).
    """

    ENGINE = "vLLM"
    ENGINE_NAME = "vllm"
    API_KEY_ENV = "VLLM_API_KEY"
    METRICS_HINT = "vLLM serves /metrics by default: is this a vLLM server?"

    def version(self) -> str:
        """``GET /version`` -> ``{"version": ...}`` (``entrypoints/serve/instrumentator/basic.py::show_version``).

        Raises: :class:`helpers.errors.SGLangError` (a server error) when it is missing or has no version string."""
        if getattr(self, "_version", None) is None:
            v = self._get_json(["/version"], "version").get("version")
            if not isinstance(v, str) or not v:
                raise SGLangError(f"GET {self._shown_url}/version: no version string", endpoint="/version")
            self._version = v
        return self._version

    def models(self) -> list[dict]:
        """``GET /v1/models`` ``data`` (``id``, ``root`` = the target path, ``max_model_len``, ``owned_by``)."""
        data = self._get_json(["/v1/models"], "models").get("data")
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def dev_server_info(self) -> Optional[dict]:
        """vLLM's own ``GET /server_info?config_format=json`` (dev mode only: ``VLLM_SERVER_DEV_MODE=1``), redacted;
        None when the server does not serve it. The first call gathers the host's environment (``collect_env``: 10+ s
        on a busy machine), hence a 120 s read timeout."""
        resp = self._request("GET", "/server_info", params={"config_format": "json"}, timeout=httpx_timeout(120.0))
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            raise RequestRejected(f"GET {self._shown_url}/server_info: HTTP {resp.status_code}: {self._body(resp)}",
                                  endpoint="/server_info", status=resp.status_code)
        data = self._json(resp, f"GET {self._shown_url}/server_info", "/server_info")
        return redact(data, self.secrets) if isinstance(data, dict) else None

    def describe(self) -> Optional[list[dict]]:
        """The worker extension's ``e3f_describe`` per TP rank (cached), or None when the server lacks it."""
        if getattr(self, "_ranks", None) is None:
            try:
                self._ranks = self.rpc("e3f_describe")
            except RequestRejected:
                self._ranks = []
        return self._ranks or None

    def server_info(self, refresh: bool = False) -> dict:
        """The server's effective settings in the suite's vocabulary (:class:`helpers.server.client.ServerClient`),
        redacted and cached (``refresh`` asks again). Keys: ``engine`` ``vllm``, ``version``, ``sglang_version``
        None, ``model_path`` (``/v1/models`` ``root``), ``context_length`` (``max_model_len``),
        ``speculative_algorithm`` (vLLM's ``method`` upper-cased: ``EAGLE3``), ``speculative_draft_model_path``,
        ``speculative_num_steps`` = ``num_speculative_tokens``, ``speculative_eagle_topk`` 1 and
        ``speculative_num_draft_tokens`` = ``num_speculative_tokens`` + 1 (vLLM drafts a chain: ``v1/spec_decode/
        llm_base_proposer.py::SpecDecodeBaseProposer.propose``), ``tp_size``, ``device``, ``dtype``; vLLM's own:
        ``enable_prefix_caching``, ``async_scheduling``, ``rejection_sample_method``, ``draft_sample_method``,
        ``max_num_seqs``, ``worker_extension`` (the tool's extension answers), ``aux_layer_ids`` (vLLM convention
        in(i)), ``loaded`` (rank 0's ``e3f_describe``), ``sources`` (where each came from)."""
        if getattr(self, "_info", None) is not None and not refresh:
            return self._info
        models = self.models()
        m0 = models[0] if models else {}
        info: dict[str, Any] = {"engine": "vllm", "version": self.version(), "sglang_version": None,
                                "model_path": m0.get("root"), "context_length": m0.get("max_model_len"),
                                "worker_extension": False, "sources": {"version": "GET /version",
                                                                       "model_path": "GET /v1/models root"}}
        ranks = self.describe()
        method = k = draft = tp = None
        settings: dict[str, Any] = {}
        if ranks:
            r0 = ranks[0]
            d = r0.get("draft") or {}
            method, k, draft, tp = d.get("method"), d.get("num_speculative_tokens"), d.get("model"), r0.get("tp_size")
            settings = dict(r0.get("settings") or {})
            info.update(worker_extension=True, aux_layer_ids=r0.get("aux_layer_ids"), loaded=r0,
                        enforce_eager=r0.get("enforce_eager"))
            info["sources"]["settings"] = "worker extension e3f_describe (the worker's VllmConfig, TP rank 0)"
        else:
            dev = self.dev_server_info()
            vc = (dev or {}).get("vllm_config") or {}
            if vc:
                sc = vc.get("speculative_config") or {}
                method, k, draft = sc.get("method"), sc.get("num_speculative_tokens"), sc.get("model")
                tp = (vc.get("parallel_config") or {}).get("tensor_parallel_size")
                settings = {"enable_prefix_caching": (vc.get("cache_config") or {}).get("enable_prefix_caching"),
                            "async_scheduling": (vc.get("scheduler_config") or {}).get("async_scheduling"),
                            "rejection_sample_method": sc.get("rejection_sample_method"),
                            "draft_sample_method": sc.get("draft_sample_method"),
                            "dtype": (vc.get("model_config") or {}).get("dtype"),
                            "device": (vc.get("device_config") or {}).get("device_type")}
                info["sources"]["settings"] = "GET /server_info (VLLM_SERVER_DEV_MODE) vllm_config"
            else:
                per_pos = parse_counters(self.metrics_text()).accepted_per_position
                k = len(per_pos) if per_pos else None
                method = "eagle3" if k else None
                info["sources"]["settings"] = ("GET /metrics (positions of vllm:spec_decode_num_accepted_tokens_per_pos;"
                                               " the method and draft are not reported without dev mode)")
        info.update({"speculative_algorithm": str(method).upper() if method else None,
                     "speculative_draft_model_path": draft, "speculative_num_steps": k,
                     "speculative_eagle_topk": 1 if k else None,
                     "speculative_num_draft_tokens": (int(k) + 1) if k else None, "tp_size": tp or 1})
        info.update({key: settings.get(key) for key in ("enable_prefix_caching", "async_scheduling",
                                                         "rejection_sample_method", "draft_sample_method", "dtype",
                                                         "device", "max_num_seqs")})
        self._info = redact(info, self.secrets)
        return self._info

    def flush_cache(self, timeout: float = 120.0, poll: float = 0.5) -> float:
        """``POST /reset_prefix_cache`` (dev mode); returns the seconds it took.

        Raises: :class:`helpers.errors.EndpointMissing` without dev mode (no such route)."""
        t0 = time.monotonic()
        resp = self._request("POST", "/reset_prefix_cache", idempotent=False)
        if resp.status_code == 404:
            raise EndpointMissing(f"POST {self._shown_url}/reset_prefix_cache: 404 (vLLM serves it only with "
                                  "VLLM_SERVER_DEV_MODE=1)", endpoint="/reset_prefix_cache", status=404)
        if resp.status_code != 200:
            raise RequestRejected(f"POST {self._shown_url}/reset_prefix_cache: HTTP {resp.status_code}: "
                                  f"{self._body(resp)}", endpoint="/reset_prefix_cache", status=resp.status_code)
        return time.monotonic() - t0

    def generate(self, input_ids: Optional[Sequence[int]] = None, text: Optional[str] = None, *,
                 sampling_params: Optional[Mapping[str, Any]] = None, max_new_tokens: Optional[int] = None,
                 return_hidden_states: bool = False, timeout: Optional[float] = None, **_: Any) -> GenerateResult:
        """One ``/v1/completions`` request (token ids or text; SGLang's ``sampling_params`` names: ``max_new_tokens``
        -> ``max_tokens``, the rest as vLLM's ``temperature`` / ``top_p`` / ``top_k`` / ``ignore_eos`` / ``seed``)
        as a :class:`helpers.server.protocol.GenerateResult` (:func:`meta_info`).

        Raises:
            helpers.errors.HiddenStatesDisabled: ``return_hidden_states`` (vLLM returns no hidden states over HTTP:
                the adapter's ``capture_served`` reads them through the worker extension).
            helpers.errors.RequestRejected / SGLangError: an HTTP error, or spec counters no server can produce."""
        if (input_ids is None) == (text is None):
            raise ValueError("generate(): pass exactly one of input_ids= or text=")
        if return_hidden_states:
            raise HiddenStatesDisabled(f"{self._shown_url}: vLLM returns no hidden states in its answers; capture them "
                                       "with the vLLM adapter's capture_served (the worker extension)",
                                       endpoint="/v1/completions")
        sp = {"temperature": 0.0, **dict(sampling_params or {})}
        if max_new_tokens is not None:
            sp["max_new_tokens"] = int(max_new_tokens)
        n = int(sp.pop("max_new_tokens", 16))
        temperature = float(sp.pop("temperature", 0.0))
        ignore_eos = bool(sp.pop("ignore_eos", False))
        ans = self.complete(input_ids if input_ids is not None else text, max_tokens=n, temperature=temperature,
                            ignore_eos=ignore_eos, extra=sp, timeout=timeout)
        try:
            result = GenerateResult.model_validate({"text": ans["choices"][0].get("text"),
                                                    "output_ids": ans["choices"][0].get("token_ids") or [],
                                                    "meta_info": meta_info(ans), "latency_s": ans["latency_s"],
                                                    "prompt_token_ids": ans.get("prompt_token_ids")})
        except ValidationError as exc:
            raise SGLangError(f"POST {self._shown_url}/v1/completions: {str(exc).splitlines()[0]}",
                              endpoint="/v1/completions") from None
        info = getattr(self, "_info", None) or {}
        problem = result.meta_info.spec_problem(info.get("speculative_num_steps"))
        if problem:
            raise SGLangError(f"POST {self._shown_url}/v1/completions: impossible spec counters: {problem}",
                              endpoint="/v1/completions")
        return result

    def effective_spec_config(self, requested: Any = None, *, draft_config: Any = None) -> EffectiveSpecConfig:
        """The speculative settings the server runs (:meth:`server_info`); vLLM 0.32.0 runs the
        ``num_speculative_tokens`` it was given as a chain (``config/speculative.py::SpeculativeConfig``), so no
        override of these is detected; ``notes`` say where the settings came from."""
        info = self.server_info()
        return EffectiveSpecConfig(effective=spec_settings(info), requested=SpecSettings(), requested_from="none",
                                   sglang_version=None, tp_size=info.get("tp_size"),
                                   notes=[f"vLLM {info.get('version')}: settings from {info['sources']['settings']}"])

    def rpc(self, method: str, *args: Any, timeout: float = 120.0) -> list[dict]:
        """``POST /collective_rpc`` calling ``method`` of the worker extension on every TP rank (arguments sent as
        JSON strings: the route passes strings only). Returns one dict per rank.

        Raises:
            helpers.errors.RequestRejected: no such route (not dev mode) or method (no extension): one line saying
                how to start the server."""
        body = {"method": method, "args": [a if isinstance(a, str) else json.dumps(a) for a in args],
                "timeout": timeout}
        resp = self._request("POST", "/collective_rpc", json_body=body, idempotent=False,
                             timeout=httpx_timeout(timeout))
        if resp.status_code != 200:
            raise RequestRejected(f"POST {self._shown_url}/collective_rpc {method}: HTTP {resp.status_code} "
                                  f"({self._body(resp, 160)}); the tool's worker extension is not reachable: "
                                  + EXTENSION_HINT, endpoint="/collective_rpc", status=resp.status_code)
        res = self._json(resp, f"POST {self._shown_url}/collective_rpc", "/collective_rpc").get("results")
        if not isinstance(res, list) or not all(isinstance(r, dict) for r in res):
            raise SGLangError(f"POST {self._shown_url}/collective_rpc {method}: expected one object per rank, got "
                              f"{str(res)[:120]}", endpoint="/collective_rpc")
        return res

    def reset_prefix_cache(self) -> bool:
        """``POST /reset_prefix_cache`` (dev mode); True when the cache was reset, False when the route is missing."""
        resp = self._request("POST", "/reset_prefix_cache", idempotent=False)
        return resp.status_code == 200

    def complete(self, prompt_ids: Sequence[int] | str, *, max_tokens: int, temperature: float = 0.0,
                 ignore_eos: bool = True, model: Optional[str] = None, extra: Optional[Mapping[str, Any]] = None,
                 timeout: Optional[float] = None) -> dict:
        """``POST /v1/completions`` for one prompt of token ids, or a text (non-streaming, ``return_token_ids``).
        Returns the answer's JSON with ``latency_s`` added.

        Raises: :class:`helpers.errors.RequestRejected` for an HTTP error (the message quotes the server)."""
        if model is None:
            if getattr(self, "_model_id", None) is None:
                models = self.models()
                self._model_id = models[0]["id"] if models else ""
            model = self._model_id
        prompt = prompt_ids if isinstance(prompt_ids, str) else [int(t) for t in prompt_ids]
        body = {"model": model, "prompt": prompt, "max_tokens": int(max_tokens),
                "temperature": float(temperature), "ignore_eos": bool(ignore_eos), "return_token_ids": True,
                **dict(extra or {})}
        t0 = time.monotonic()
        resp = self._request("POST", "/v1/completions", json_body=body, idempotent=False,
                             timeout=httpx_timeout(timeout or self.generate_timeout),
                             max_bytes=self.max_generate_bytes)
        if resp.status_code != 200:
            raise RequestRejected(f"POST {self._shown_url}/v1/completions: HTTP {resp.status_code}: "
                                  f"{self._body(resp)}", endpoint="/v1/completions", status=resp.status_code)
        out = self._json(resp, f"POST {self._shown_url}/v1/completions", "/v1/completions")
        if not isinstance(out, dict) or not out.get("choices"):
            raise SGLangError(f"POST {self._shown_url}/v1/completions: no choices in the answer",
                              endpoint="/v1/completions")
        out["latency_s"] = time.monotonic() - t0
        return out


def httpx_timeout(read: float) -> httpx.Timeout:
    """A timeout whose read part is ``read`` seconds (generation on CPU), connect 10 s."""
    return httpx.Timeout(read, connect=10.0)


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


class VLLMAdapter(EngineAdapter):
    """vLLM (rules of :data:`helpers.layers.vllm.KNOWN_VERSIONS`)."""

    name = "vllm"
    label = "vLLM"

    @classmethod
    def supported(cls) -> str:
        return f"vLLM {rules.known_versions_text()}"

    @classmethod
    def probe(cls, http: HTTPClient) -> Optional[tuple[str, dict]]:
        """vLLM when ``GET /v1/models`` names ``owned_by: "vllm"`` or ``GET /version`` answers ``{"version"}`` while
        ``/server_info`` is not SGLang's; returns ``(version, evidence)``."""
        evidence: dict[str, Any] = {}
        resp = http._request("GET", "/v1/models", retries=0)
        owned = None
        if resp.status_code == 200:
            try:
                data = http._json(resp, "GET /v1/models", "/v1/models").get("data") or []
                owned = sorted({str(m.get("owned_by")) for m in data if isinstance(m, dict)})
            except (SGLangError, AttributeError):
                owned = None
        evidence["/v1/models owned_by"] = owned if owned is not None else f"HTTP {resp.status_code}"
        resp = http._request("GET", "/version", retries=0)
        version = None
        if resp.status_code == 200:
            try:
                v = http._json(resp, "GET /version", "/version")
                version = v.get("version") if isinstance(v, dict) else None
            except SGLangError:
                version = None
        evidence["/version"] = version if version is not None else f"HTTP {resp.status_code}"
        if owned is not None and "vllm" in owned:
            if not isinstance(version, str) or not version:
                raise BadInput(f"{http._shown_url}: /v1/models says owned_by vllm but GET /version gives no version "
                               f"({evidence['/version']}); cannot tell which vLLM rules apply", field="--url")
            return version, evidence
        return None

    def client(self, url: str, api_key: Optional[str] = None, **kwargs: Any) -> VLLMClient:
        return VLLMClient(url, api_key=api_key, **kwargs)

    def start(self, target: str | Path, draft: str | Path | None, *, tp: int = 1, **kwargs: Any) -> ServerProcess:
        return vllm_server.start(target, draft, tp=tp, **kwargs)

    def describe(self, client: VLLMClient) -> Optional[list[dict]]:
        """The worker extension's report per TP rank (``e3f_describe``), or None when the server lacks it."""
        return client.describe()

    def spec_config(self, client: VLLMClient, *, draft: str | Path | None = None) -> SpecConfig:
        """The effective speculative config: the worker extension's report when the server has it (what the engine
        built, rank 0; every rank's ``aux_layer_ids`` must agree), else ``/server_info`` (dev mode), else
        ``/metrics`` and ``/v1/models`` (no draft path: pass ``draft``). Aux ids: reported, or computed from the draft
        config with vLLM's rules (:func:`helpers.layers.vllm.aux_layer_ids`), each with its source; a mismatch between
        the two is an override the engine made, listed in ``overrides``."""
        version = client.version()
        models = client.models()
        cfg = SpecConfig(engine="vllm", version=version, target=models[0].get("root") if models else None,
                         draft=os.fspath(draft) if draft else None, aux_layer_convention="vllm",
                         sources={"version": "GET /version", "target": "GET /v1/models root"})
        sources, notes = cfg.sources, cfg.notes     # the model's own (pydantic copies what it is given)
        ranks = self.describe(client)
        n_layers = None
        if ranks:
            r0 = ranks[0]
            ids = {tuple(r.get("aux_layer_ids") or ()) for r in ranks}
            if len(ids) > 1:
                notes.append(f"TP ranks capture different aux ids: {sorted(ids)}")
            d = r0.get("draft") or {}
            cfg.aux_layer_ids = list(r0.get("aux_layer_ids") or [])
            n_layers = r0.get("num_layers")
            cfg.tp_size, cfg.method = r0.get("tp_size"), d.get("method")
            cfg.num_speculative_tokens = d.get("num_speculative_tokens")
            cfg.draft = cfg.draft or d.get("model")
            cfg.loaded = {"draft": d, "target_class": r0.get("target_class"), "num_layers": n_layers,
                          "enforce_eager": r0.get("enforce_eager")}
            for f in ("aux_layer_ids", "tp_size", "method", "num_speculative_tokens"):
                sources[f] = "worker extension e3f_describe (the loaded modules; aux ids: aux_hidden_state_layers)"
            sources.setdefault("draft", "worker extension e3f_describe (speculative_config.model)")
        else:
            notes.append("no worker extension on this server: aux ids computed from the draft config with vLLM's "
                         "rules, not read from the engine (" + EXTENSION_HINT + ")")
            counters = self.counters(client)
            k = len(counters.accepted_per_position) if counters.accepted_per_position is not None else None
            cfg.num_speculative_tokens, cfg.method = k, ("eagle3" if k else None)
            if k:
                sources["num_speculative_tokens"] = ("GET /metrics: positions of "
                                                     "vllm:spec_decode_num_accepted_tokens_per_pos")
            info = client.dev_server_info()
            if info:
                sc = (info.get("vllm_config") or {}).get("speculative_config") or {}
                pc = (info.get("vllm_config") or {}).get("parallel_config") or {}
                cfg.method = sc.get("method", cfg.method)
                cfg.num_speculative_tokens = sc.get("num_speculative_tokens", cfg.num_speculative_tokens)
                cfg.draft = cfg.draft or sc.get("model")
                cfg.tp_size = pc.get("tensor_parallel_size")
                for f in ("method", "num_speculative_tokens", "tp_size", "draft"):
                    sources[f] = "GET /server_info (VLLM_SERVER_DEV_MODE) vllm_config"
        dcfg = _read_config(cfg.draft)
        tcfg = _read_config(cfg.target)
        if n_layers is None and tcfg:
            n_layers = tcfg.get("num_hidden_layers")
        if dcfg is not None and n_layers:
            ids, src = rules.aux_layer_ids(dcfg, int(n_layers))
            cfg.rule_aux_layer_ids = list(ids)
            sources["rule_aux_layer_ids"] = f"{src} ({rules.SOURCES['aux_ids']}, vLLM {version})"
            if cfg.aux_layer_ids is None:
                cfg.aux_layer_ids = list(ids)
                sources["aux_layer_ids"] = sources["rule_aux_layer_ids"]
            elif list(ids) != cfg.aux_layer_ids:
                cfg.overrides.append(f"aux ids: the draft config gives {list(ids)} by vLLM's rules, the engine "
                                     f"captures {cfg.aux_layer_ids}")
        elif cfg.draft is None:
            notes.append("the draft folder is unknown (vLLM reports it only in dev mode): pass --draft")
        if cfg.aux_layer_ids is not None and n_layers:
            cfg.aux_tensors = rules.captured(cfg.aux_layer_ids, int(n_layers))
        return cfg

    def counters(self, client: HTTPClient) -> AcceptanceCounters:
        return parse_counters(client.metrics_text())

    def capture_served(self, client: VLLMClient, prompts: Sequence[Any], out_dir: str | Path, *,
                       name: str = "served", max_new_tokens: int = 1, layers: bool = False,
                       records: Optional[list] = None, progress: bool = False,
                       capture_dir: str | Path | None = None) -> Path:
        """Dump what the server feeds its draft for ``prompts`` (token ids, training samples): the worker extension is
        armed on every rank for the capture; for each prompt the prefix cache is reset (``/reset_prefix_cache``), one
        completion of ``max_new_tokens`` greedy tokens runs, and rank 0's ``drafter.propose`` input of its prefill (its
        ``target_hidden_states`` = the concatenated aux states, one row per prompt token, ascending id order) becomes
        the sample (``first_position`` = its first position). With ``layers`` a second dump ``<name>-layers`` holds
        the target forward's ``embedding, out(0) .. out(n-1)`` (a reference dump). Manifest: ``engine: vllm``,
        ``engine_version``, the loaded config (``e3f_describe``), ``kind: served``.

        ``records``: when a list, one per-request row (:func:`record`) per prompt is appended.
        ``capture_dir``: keep every rank's raw capture there (``rank<r>/index.jsonl`` + files, the format
        ``helpers.capture.per_rank_dumps`` reads: one dump per TP rank); default a temporary folder, removed.

        Raises:
            helpers.errors.RequestRejected: the server lacks the worker extension / dev mode (one line, how to start
                it).
            helpers.errors.SGLangError: the server recorded no draft input for a prompt.
            FileExistsError: the dump exists."""
        ranks = client.rpc("e3f_describe")
        version = client.version()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        keep = capture_dir is not None
        cap = Path(capture_dir) if keep else Path(tempfile.mkdtemp(prefix=".e3f-vllm-capture-", dir=out_dir))
        if keep and cap.exists() and any(cap.iterdir()):
            raise BadInput("the capture folder is not empty (captures are never overwritten)", path=cap)
        sent: list[tuple[str, list[int], dict]] = []
        samples, ref = [], []
        try:
            client.rpc("e3f_capture_start", {"out_dir": os.fspath(cap), "layers": bool(layers)})
            try:
                for i, p in enumerate(prompts):
                    pid, ids, _ = _prompt_fields(p, i)
                    if ids is None:
                        raise BadInput(f"prompt {pid}: the vLLM capture needs token ids", field="prompts")
                    client.reset_prefix_cache()
                    ans = client.complete(ids, max_tokens=max_new_tokens)
                    sent.append((pid, ids, ans))
                    if records is not None:
                        records.append(record(len(records), pid, ans, kind="capture"))
            finally:
                client.rpc("e3f_capture_stop")
            fed_recs, fwd_recs = _Records(cap, "DRAFT_INPUT"), _Records(cap, "EXTEND")
            for pid, ids, ans in sent:
                key = _safe_key(pid)
                fed = fed_recs.next_for(ids)
                if fed is None:
                    raise SGLangError(f"{client._shown_url}: the draft received no input for prompt {pid} (is "
                                      "speculative decoding on?)", endpoint="/collective_rpc")
                samples.append({"key": key, "sample_id": pid, "input_ids": fed["input_ids"],
                                "hidden": fed["aux"].to(torch.float32), "first_position": int(fed["positions"][0]),
                                "num_prompt_tokens": len(ids),
                                "output_ids": ans["choices"][0].get("token_ids") or None})
                fwd = fwd_recs.next_for(ids) if layers else None
                if fwd is not None:
                    n = sum(1 for k in fwd if k.startswith("out("))
                    need = ["embedding"] + [f"out({L})" for L in range(n)]
                    ref.append({"key": key, "sample_id": pid, "input_ids": fwd["input_ids"],
                                "hidden": torch.cat([fwd[k] for k in need], -1).to(torch.float32),
                                "first_position": int(fwd["positions"][0])})
        finally:
            if not keep:
                shutil.rmtree(cap, ignore_errors=True)
        r0 = ranks[0]
        hidden = r0.get("hidden_size")
        extra = {"kind": "served", "engine": "vllm", "engine_version": version,
                 "source": {"type": "vllm_worker_extension", "url": client._shown_url, "captured": _now(),
                            "tensor": "drafter.propose target_hidden_states (torch.cat of the target's aux hidden "
                                      "states, ascending ids, pre-norm residual stream in(i)), TP rank 0",
                            "reset_prefix_cache": True, "max_new_tokens": max_new_tokens},
                 "server": {"engine": "vllm", "version": version, "loaded": redact(r0, client.secrets)},
                 "tp_size": r0.get("tp_size"), "hidden_size": hidden,
                 "layer_plan": {"tensors": rules.captured(r0.get("aux_layer_ids") or [], r0.get("num_layers") or 0),
                                "ids": r0.get("aux_layer_ids"), "convention": "vllm"}}
        path = write_dump(out_dir / name, samples, extra)
        if layers and ref:
            n = r0.get("num_layers") or 0
            write_dump(out_dir / f"{name}-layers", ref,
                       {"kind": "reference", "engine": "vllm", "engine_version": version, "hidden_size": hidden,
                        "source": {"type": "vllm_worker_extension", "url": client._shown_url, "captured": _now(),
                                   "tensor": "model.embed_tokens output; layers[L] output hidden + residual"},
                        "tp_size": r0.get("tp_size"),
                        "layer_plan": {"tensors": ["embedding"] + [f"out({L})" for L in range(n)]}})
        return path


class _Records:
    """Rank 0's records of one ``mode`` in a capture folder, consumed in order: :meth:`next_for` returns the next
    one whose token ids are the prompt or its uncached tail (a prefill), skipping others (decode steps)."""

    def __init__(self, capture_dir: Path, mode: str) -> None:
        self.dir = capture_dir
        try:
            recs = read_rank_capture(capture_dir).get(0, [])
        except FileNotFoundError:
            recs = []
        self.recs = [r for r in recs if r.get("mode") == mode]
        self.pos = 0

    def next_for(self, ids: Sequence[int]) -> Optional[dict[str, torch.Tensor]]:
        want = [int(t) for t in ids]
        while self.pos < len(self.recs):
            rec = self.recs[self.pos]
            self.pos += 1
            t = load_file(str(self.dir / "rank0" / rec["file"]))
            got = [int(x) for x in t["input_ids"].tolist()]
            if got and len(got) <= len(want) and want[len(want) - len(got):] == got:
                return t
        return None


def _read_config(folder: Optional[str]) -> Optional[dict]:
    if not folder or not Path(folder).is_dir():
        return None
    try:
        return read_config_json(Path(folder), "config")
    except (OSError, ValueError):
        return None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# ------------------------------------------------------------------------------------------------ vLLM's id rules

def draft_view(draft: Any) -> dict:
    """The draft config as vLLM reads it (``transformers_utils/configs/eagle.py::EAGLEConfig`` copies every key of
    ``config.json``), with the layer-id fields of a :class:`helpers.formats.configs.DraftConfig` as the truth (a copy
    made by :meth:`VLLMRules.with_ids` changes only those fields)."""
    view = dict(draft.raw or {})
    top, nested = draft.top_level_layer_ids, draft.nested_layer_ids
    view["eagle_aux_hidden_state_layer_ids"] = None if top is None else [int(i) for i in top]
    ec = view.get("eagle_config")
    if nested is not None:
        ec = dict(ec) if isinstance(ec, Mapping) else {}
        ec["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in nested]
    elif isinstance(ec, Mapping):
        ec = {k: v for k, v in ec.items() if k != "eagle_aux_hidden_state_layer_ids"}
    if isinstance(ec, Mapping):
        if draft.use_aux_hidden_state and ec.get("use_aux_hidden_state") is False:
            ec["use_aux_hidden_state"] = True          # a copy made to try ids (with_ids) turns the capture on
        view["eagle_config"] = ec
    return view


class VLLMRules(PlanRules):
    """vLLM's rules for what it feeds an EAGLE-3 draft (:mod:`helpers.layers.vllm`, read in vLLM 0.32.0): ids from
    the draft config (top-level first, else ``eagle_config``), verbatim as in(i), sorted and de-duplicated, the
    target's default ``(2, n // 2, n - 3)`` when none is found. Given to the engine-neutral code by
    :meth:`VLLMAdapter.rules`."""

    engine = "vllm"
    label = "vLLM"
    convention = "vllm"
    d2t_rule = (f"{rules.SOURCES['d2t']}: target id = draft id + d2t[draft id]; a checkpoint without d2t leaves the "
                "parameter's zeros (target id = draft id) without a word")

    def served_plan(self, draft: Any, target: Any, algorithm: Optional[str] = "EAGLE3") -> CapturePlan:
        """The ordered physical tensors vLLM feeds the draft. ``EAGLE3`` with ``use_aux_hidden_state`` true: the ids
        of :func:`helpers.layers.vllm.aux_layer_ids` as in(i) (an id the layer loop never meets is a
        ``missing_chunk`` problem, and the draft's ``fc`` then gets fewer chunks than it takes: ``fatal``); ``EAGLE``
        or ``use_aux_hidden_state`` false: the target's final normed hidden state. Raises ValueError for another
        algorithm."""
        algo = (algorithm or "EAGLE3").upper()
        if algo not in ("EAGLE3", "EAGLE"):
            raise ValueError(f"unsupported speculative method {algorithm!r} for vLLM's EAGLE plans (eagle3, eagle)")
        n = int(target.num_hidden_layers)
        plan = CapturePlan(tensors=[], role="served", who=f"vllm {self.version or '(version unknown)'}",
                           provenance="rule")
        view = draft_view(draft)
        if algo == "EAGLE" or not rules.use_aux_hidden_state(view):
            plan.tensors = ["final_norm"]
            plan.rules.append("no aux capture: the draft gets the target's final normed hidden state -- "
                              + rules.SOURCES["use_aux"])
            plan.source = ("method eagle" if algo == "EAGLE" else "draft config eagle_config.use_aux_hidden_state "
                           "false") + f" (vLLM {self.version} rule)"
            return plan
        ids, src = rules.aux_layer_ids(view, n)
        lids = LayerIds(tuple(ids), "vllm")
        plan.config_ids = None if src.startswith("default") else lids
        plan.engine_ids = lids
        plan.rules += [f"ids from the {src} -- {rules.SOURCES['aux_ids']}",
                       f"kept as tuple(sorted(set(ids))) -- {rules.SOURCES['aux_set']}",
                       f"id i captured as in(i) = out(i-1), verbatim (0 = the embedding), before layer i -- "
                       f"{rules.SOURCES['aux_capture']}"]
        tensors = rules.captured(ids, n)
        for i, t in zip(ids, tensors):
            if t is None:
                plan.problems.append({"kind": "missing_chunk", "detail": f"vllm id {i} names no tensor of a {n}-layer "
                                      f"target: vLLM's layer loop never meets it and captures nothing there"})
            elif t == "embedding":
                plan.problems.append({"kind": "embedding_in_place_of_layer",
                                      "detail": "vllm id 0 captures the token embedding (in(0))"})
        plan.tensors = [t for t in tensors if t is not None]
        want = rules.num_aux_hidden_states(view)
        if len(plan.tensors) != want:
            plan.fatal = (f"the draft's fc takes {want} chunks ({rules.SOURCES['num_aux']}) but vLLM captures "
                          f"{len(plan.tensors)}: the first request fails in the draft's fc (shape mismatch) -- "
                          f"{rules.SOURCES['num_aux']}")
        plan.source = f"{src} {list(ids)} + vLLM {self.version} rule (in(i), verbatim)"
        if src.startswith("default"):
            plan.notes.append(f"the draft config names no ids vLLM reads (top-level eagle_aux_hidden_state_layer_ids, "
                              f"eagle_config.eagle_aux_hidden_state_layer_ids): vLLM falls back to the target's "
                              f"default {list(ids)} -- {rules.SOURCES['aux_default']}")
        if draft.top_level_layer_ids and draft.nested_layer_ids is not None \
                and sorted(set(draft.top_level_layer_ids)) != sorted(set(draft.nested_layer_ids)):
            plan.notes.append(f"the draft config has top-level ids {list(draft.top_level_layer_ids)} and "
                              f"eagle_config ids {list(draft.nested_layer_ids)}: vLLM reads the top-level ones "
                              f"(SGLang the nested ones) -- {rules.SOURCES['aux_ids']}")
        return plan

    def _reads_top(self, draft: Any) -> bool:
        return bool(draft.top_level_layer_ids)

    def with_ids(self, draft: Any, ids: Sequence[int]) -> Any:
        """A copy of the draft config with ``ids`` where vLLM reads them: the top-level key when it is set (it wins),
        else ``eagle_config.eagle_aux_hidden_state_layer_ids``."""
        ids = tuple(int(i) for i in ids)
        if self._reads_top(draft):
            return dataclasses.replace(draft, top_level_layer_ids=ids, use_aux_hidden_state=True)
        return dataclasses.replace(draft, nested_layer_ids=ids, use_aux_hidden_state=True)

    def ids_override(self, draft: Any, ids: Sequence[int], kinds: Sequence[str]) -> tuple[dict, str]:
        """``(config override, text)``: ``ids`` written where vLLM reads them (:meth:`with_ids`), in vLLM's
        convention (in(i), verbatim)."""
        ids = [int(i) for i in ids]
        if self._reads_top(draft):
            return ({"eagle_aux_hidden_state_layer_ids": ids},
                    f"set the top-level eagle_aux_hidden_state_layer_ids to {ids} in the draft config (now "
                    f"{list(draft.top_level_layer_ids)}; vLLM reads it first and takes id i as in(i), verbatim)")
        now = list(draft.nested_layer_ids) if draft.nested_layer_ids is not None else "absent: vLLM's default"
        return ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}},
                f"set eagle_config.eagle_aux_hidden_state_layer_ids to {ids} in the draft config (now {now}; vLLM "
                f"{self.version} takes id i as in(i) = out(i-1), verbatim: no +1)")

    def id_candidates(self, layer: int, num_layers: int) -> list[int]:
        """out(L) is vLLM id L + 1 (in(L+1)); the neighbours follow."""
        return [c for c in dict.fromkeys((layer + 1, layer, layer + 2, layer - 1)) if 0 <= c <= num_layers]

    def setup_findings(self, draft: Any, target: Any, plan: CapturePlan, algorithm: str) -> list[dict]:
        """``unsupported_draft`` for a draft class vLLM 0.32.0 does not map to an Eagle3 model
        (``model_executor/models/registry.py`` ``_SPECULATIVE_DECODING_MODELS``); vLLM reads ids at both places, so
        no id is ignored."""
        archs = list(draft.architectures or [])
        if algorithm != "EAGLE3" or any(a in vllm_server.EAGLE3_DRAFT_CLASSES for a in archs):
            return []
        return [finding("unsupported_draft", None,
                        f"draft architectures {archs} is not an EAGLE-3 draft class vLLM {self.version} maps to "
                        f"its Eagle3 models {list(vllm_server.EAGLE3_DRAFT_CLASSES)}",
                        architectures=archs, config=str(draft.path),
                        source="vllm/model_executor/models/registry.py _SPECULATIVE_DECODING_MODELS")]

    def supports_target(self, target: Any) -> bool:
        return True

    def readings(self, draft: Any, target: Any, plan: CapturePlan) -> Optional[dict]:
        return None

    def advisories(self, draft: Any, target: Any, plan: CapturePlan, training: Optional[CapturePlan],
                   findings: list[dict], algorithm: str) -> list[str]:
        return list(plan.notes)
