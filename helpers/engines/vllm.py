"""vLLM behind the engine seam: its HTTP client, engine and version detection, the effective speculative config, the
acceptance counters of ``/metrics`` and per request, and the capture of the aux hidden states it feeds the draft.
Rules and endpoints as read in vLLM 0.32.0 (``env/vllm/README.md``; the id rules are :mod:`helpers.layers.vllm`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from ..acceptance.requests import PER_REQUEST_COLUMNS
from ..capture import _prompt_fields, _safe_key, read_rank_capture
from ..errors import BadInput, RequestRejected, SGLangError
from ..formats.configs import read_config_json
from ..formats.dumps import write_dump
from ..layers import vllm as rules
from ..redaction import redact
from ..server.client import HTTPClient
from ..server.process import ServerProcess
from . import vllm_server
from .base import AcceptanceCounters, EngineAdapter, SpecConfig

#: the worker-extension route and what the tool needs the server started with to use it
EXTENSION_HINT = ("start it with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls "
                  f"{vllm_server.WORKER_EXTENSION} with this checkout on PYTHONPATH "
                  "(python -m helpers server start --engine vllm does)")


class VLLMClient(HTTPClient):
    """:class:`helpers.server.client.HTTPClient` for a vLLM OpenAI-compatible server (deadlines, byte limits, the API
    key ``$VLLM_API_KEY`` kept out of messages) with vLLM 0.32.0's endpoints (``env/vllm/README.md``)."""

    ENGINE = "vLLM"
    API_KEY_ENV = "VLLM_API_KEY"
    METRICS_HINT = "vLLM serves /metrics by default: is this a vLLM server?"

    def version(self) -> str:
        """``GET /version`` -> ``{"version": ...}`` (``entrypoints/serve/instrumentator/basic.py::show_version``).

        Raises: :class:`helpers.errors.SGLangError` (a server error) when it is missing or has no version string."""
        v = self._get_json(["/version"], "version").get("version")
        if not isinstance(v, str) or not v:
            raise SGLangError(f"GET {self._shown_url}/version: no version string", endpoint="/version")
        return v

    def models(self) -> list[dict]:
        """``GET /v1/models`` ``data`` (``id``, ``root`` = the target path, ``max_model_len``, ``owned_by``)."""
        data = self._get_json(["/v1/models"], "models").get("data")
        return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []

    def server_info(self) -> Optional[dict]:
        """``GET /server_info?config_format=json`` (dev mode only: ``VLLM_SERVER_DEV_MODE=1``), redacted; None when
        the server does not serve it. The first call gathers the host's environment (``collect_env``: 10+ s on a
        busy machine), hence a 120 s read timeout."""
        resp = self._request("GET", "/server_info", params={"config_format": "json"}, timeout=httpx_timeout(120.0))
        if resp.status_code == 404:
            return None
        if resp.status_code >= 400:
            raise RequestRejected(f"GET {self._shown_url}/server_info: HTTP {resp.status_code}: {self._body(resp)}",
                                  endpoint="/server_info", status=resp.status_code)
        data = self._json(resp, f"GET {self._shown_url}/server_info", "/server_info")
        return redact(data, self.secrets) if isinstance(data, dict) else None

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

    def complete(self, prompt_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 ignore_eos: bool = True, model: Optional[str] = None, extra: Optional[Mapping[str, Any]] = None,
                 timeout: Optional[float] = None) -> dict:
        """``POST /v1/completions`` for one prompt of token ids (non-streaming, ``return_token_ids``). Returns the
        answer's JSON with ``latency_s`` added.

        Raises: :class:`helpers.errors.RequestRejected` for an HTTP error (the message quotes the server)."""
        if model is None:
            if getattr(self, "_model_id", None) is None:
                models = self.models()
                self._model_id = models[0]["id"] if models else ""
            model = self._model_id
        body = {"model": model, "prompt": [int(t) for t in prompt_ids], "max_tokens": int(max_tokens),
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
        try:
            return client.rpc("e3f_describe")
        except RequestRejected:
            return None

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
            info = client.server_info()
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
