"""vLLM's HTTP client (:class:`VLLMClient`): the suite's client contract for a vLLM OpenAI-compatible server, vLLM
0.32.0's endpoints (``/version``, ``/v1/models``, ``/metrics``, ``/v1/completions``, the worker extension's
``/collective_rpc``) with deadlines and byte limits. The adapter is :class:`helpers.engines.vllm.VLLMAdapter`.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import httpx
from pydantic import ValidationError

from ..errors import (
    EndpointMissing,
    HiddenStatesDisabled,
    RequestRejected,
    ServerError,
    SGLangError,
    printable,
)
from ..formats.configs import read_config_json
from ..redaction import redact
from ..server.client import ServerClient, answer_error
from ..server.protocol import GenerateResult
from ..server.settings import EffectiveSpecConfig, SpecSettings, spec_settings
from . import vllm_server
from .vllm_answers import (
    Completion,
    DevServerInfo,
    ModelCard,
    checked,
    checked_ranks,
    meta_info,
    parse_counters,
)

__all__ = ["EXTENSION_HINT", "VLLMClient", "httpx_timeout"]

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
        """``GET /v1/models`` ``data`` (``id``, ``root`` = the target path, ``max_model_len``, ``owned_by``), each
        entry checked (:class:`helpers.engines.vllm_answers.ModelCard`).

        Raises: :class:`helpers.errors.SGLangError` naming the entry and the field (``data.0.root``: a number for a
        path, ...), or ``data`` that is not a list."""
        data = self._get_json(["/v1/models"], "models").get("data")
        where = f"GET {self._shown_url}/v1/models"
        if data is None:
            return []
        if not isinstance(data, list):
            raise SGLangError(f"{where}: field data: expected a list of models, got {str(data)[:60]!r}",
                              endpoint="/v1/models")
        return [checked(ModelCard, m, f"{where} (data.{i})", "/v1/models") for i, m in enumerate(data)]

    def target_layers(self) -> Optional[int]:
        """``num_hidden_layers`` of the target's ``config.json`` (``/v1/models`` ``root``) when that folder is readable
        here, else None."""
        models = self.models()
        cfg = _read_config(models[0].get("root")) if models else None
        n = (cfg or {}).get("num_hidden_layers")
        return n if isinstance(n, int) and not isinstance(n, bool) else None

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
        if not isinstance(data, dict):
            return None
        checked(DevServerInfo, data, f"GET {self._shown_url}/server_info", "/server_info")
        return redact(data, self.secrets)

    def describe(self, required: bool = False) -> Optional[list[dict]]:
        """The worker extension's ``e3f_describe`` per TP rank (cached, checked:
        :func:`helpers.engines.vllm_answers.checked_ranks`, the layer count against the target's config), or None
        when the server lacks it.

        Raises:
            helpers.errors.RequestRejected: ``required`` and the server lacks the extension (how to start it).
            helpers.errors.SGLangError: an answer of another shape (no rank, a field of another type or out of
                range, more layers than the target has)."""
        if getattr(self, "_ranks", None) is None:
            try:
                ranks = self.rpc("e3f_describe")
            except RequestRejected as exc:
                self._ranks, self._no_extension = [], exc
            else:
                layers = self.target_layers()
                models = self.models()
                self._ranks = checked_ranks(ranks, f"POST {self._shown_url}/collective_rpc e3f_describe", layers,
                                            models[0].get("root") if models else None)
        if required and not self._ranks:
            raise self._no_extension
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
        ``max_num_seqs``, ``worker_extension`` (the tool's extension answers), ``aux_layer_ids`` (as held, in(i);
        chunks: :meth:`VLLMAdapter.spec_config`), ``loaded`` (rank 0's ``e3f_describe``), ``verify_sampling`` (rank
        0's check of the per-token sampling values its verify step uses:
        :func:`helpers.engines.vllm_worker._verify_sampling_check`), ``sources`` (where each came from)."""
        if getattr(self, "_info", None) is not None and not refresh:
            return self._info
        try:
            return self._vllm_server_info()
        except (TypeError, AttributeError, ValueError, KeyError) as exc:
            # a field of another type than vLLM writes it (a string for speculative_config, a list for vllm_config,
            # "three" tokens, ...): the server's answer is unusable, said in one line naming where it came from
            raise ServerError(f"{self._shown_url}: the server's GET /v1/models, /server_info, /metrics or worker answers "
                              f"are not what vLLM 0.32.0 writes ({type(exc).__name__}: {exc})") from None

    def _vllm_server_info(self) -> dict:
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
                        enforce_eager=r0.get("enforce_eager"), verify_sampling=r0.get("verify_sampling"))
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
                            "device": (vc.get("device_config") or {}).get("device_type"),
                            "block_size": (vc.get("cache_config") or {}).get("block_size")}
                info["sources"]["settings"] = "GET /server_info (VLLM_SERVER_DEV_MODE) vllm_config"
            else:
                per_pos = parse_counters(self.metrics_text()).accepted_per_position
                k = len(per_pos) if per_pos else None
                method = "eagle3" if k else None
                info["sources"]["settings"] = ("GET /metrics (positions of vllm:spec_decode_num_accepted_tokens_per_"
                                               "pos; the method and draft are not reported without dev mode)")
        info.update({"speculative_algorithm": str(method).upper() if method else None,
                     "speculative_draft_model_path": draft, "speculative_num_steps": k,
                     "speculative_eagle_topk": 1 if k else None,
                     "speculative_num_draft_tokens": (int(k) + 1) if k else None, "tp_size": tp or 1})
        info.update({key: settings.get(key) for key in ("enable_prefix_caching", "async_scheduling",
                                                         "rejection_sample_method", "draft_sample_method", "dtype",
                                                         "device", "max_num_seqs", "block_size",
                                                         "cache_hit_alignment_tokens")})
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
                 return_hidden_states: bool = False, timeout: Optional[float] = None,
                 extra: Optional[Mapping[str, Any]] = None, **_: Any) -> GenerateResult:
        """One ``/v1/completions`` request (token ids or text; SGLang's ``sampling_params`` names: ``max_new_tokens``
        -> ``max_tokens``, the rest as vLLM's ``temperature`` / ``top_p`` / ``top_k`` / ``ignore_eos`` / ``seed``)
        as a :class:`helpers.server.protocol.GenerateResult` (:func:`meta_info`); ``extra``: further request fields
        (``logprobs``, ``return_tokens_as_token_ids``: :meth:`VLLMAdapter.top_logprobs_fields`).

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
                            ignore_eos=ignore_eos, extra={**sp, **dict(extra or {})}, timeout=timeout)
        try:
            result = GenerateResult.model_validate({"text": ans["choices"][0].get("text"),
                                                    "output_ids": ans["choices"][0].get("token_ids") or [],
                                                    "meta_info": meta_info(ans), "latency_s": ans["latency_s"],
                                                    "prompt_token_ids": ans.get("prompt_token_ids")})
        except ValidationError as exc:
            raise answer_error(exc, f"POST {self._shown_url}/v1/completions", "/v1/completions") from None
        problem = result.meta_info.spec_problem(**self._spec_limits())
        if problem:
            rid = result.meta_info.id
            which = f" (request {printable(str(rid))[:80]})" if rid is not None else ""
            source = (getattr(self, "_info", None) or {}).get("sources", {}).get("settings")
            raise SGLangError(f"POST {self._shown_url}/v1/completions{which}: impossible spec counters: {problem}"
                              + (f" (num_speculative_tokens from {source})" if source else ""),
                              endpoint="/v1/completions")
        return result

    def _spec_limits(self) -> dict:
        """What :meth:`helpers.server.protocol.MetaInfo.spec_problem` checks a vLLM answer against once
        :meth:`server_info` was read with speculative decoding on: ``num_steps`` = ``num_speculative_tokens`` k, a
        chain of k drafts per verify step at most (``proposed_exact`` False: the scheduler trims a step's drafts to the
        token budget, ``v1/core/sched/scheduler.py::Scheduler.schedule``), and the dense histogram of k + 1 bins
        (``v1/metrics/stats.py::RequestSpecDecodeMetrics.new``), and the context length (``context_len``: a request that
        reaches ``max_model_len`` ends with one plain decode step that no spec counter counts,
        ``v1/core/sched/scheduler.py::Scheduler.schedule`` leaving no room for a draft there); else nothing."""
        info = getattr(self, "_info", None) or {}
        k = info.get("speculative_num_steps")
        if not info.get("speculative_algorithm") or not isinstance(k, int):
            return {}
        ctx = info.get("context_length")
        return {"num_steps": k, "num_draft_tokens": k + 1, "proposed_exact": False, "histogram_bins": k + 1,
                "context_len": ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else None}

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
        checked(Completion, out, f"POST {self._shown_url}/v1/completions", "/v1/completions")
        out["latency_s"] = time.monotonic() - t0
        return out


def httpx_timeout(read: float) -> httpx.Timeout:
    """A timeout whose read part is ``read`` seconds (generation on CPU), connect 10 s."""
    return httpx.Timeout(read, connect=10.0)


def _read_config(folder: Optional[str]) -> Optional[dict]:
    try:
        return read_config_json(Path(folder), "config") if folder and Path(folder).is_dir() else None
    except (OSError, ValueError):
        return None
