"""SGLang behind the engine seam: the existing ``helpers.server`` client and embedded server and
``helpers.capture.capture_served``, unchanged, under :class:`helpers.engines.base.EngineAdapter`'s contract.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from ..acceptance.ablations import TOGGLES, Toggle
from ..faults import parse_faults
from ..formats.configs import read_draft_config, read_target_config
from ..runfiles import armed_file, loads_json
from ..server.settings import SpecSettings
from ..errors import BadInput, SGLangError
from ..layers.sglang import OLDEST_READ, TABLE_VERSION, parse_version, target_rule
from ..server import embedded
from ..server.client import HTTPClient, SGLangClient, answer_kind, checked_server_info
from ..server.process import ServerProcess
from ..server.restart import start_variant
from .base import (AcceptanceCounters, ContextRule, Continuation, EngineAdapter, SpecConfig, prometheus_sums,
                   watch_fields)

if TYPE_CHECKING:          # annotations only (torch)
    from ..diagnosis.plan_rules import PlanRules
    from ..draft.checks import LoaderRules

#: ServerArgs fields only SGLang's /server_info carries (with a top-level "version")
SERVER_INFO_MARKERS = ("tp_size", "speculative_algorithm", "model_path")


def sglang_env() -> dict[str, str]:
    """The ``SGLANG_*`` environment variables of this launch (they change SGLang's behaviour, e.g.
    ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``), so that a restart of the server gets them too; names that look
    like secrets (``KEY``, ``TOKEN``, ``SECRET``, ``PASSWORD``) are never recorded."""
    secret = ("KEY", "TOKEN", "SECRET", "PASSWORD")
    return {k: v for k, v in os.environ.items() if k.startswith("SGLANG_") and not any(s in k for s in secret)}


def sglang_elsewhere(http: HTTPClient) -> Optional[str]:
    """Where a server says it is SGLang other than ``/server_info``: ``GET /model_info`` (fallback
    ``/get_model_info``) answering a JSON object with ``model_path`` (SGLang's own endpoint,
    ``sglang/srt/entrypoints/http_server.py::model_info``; vLLM has none), or ``GET /v1/models`` naming ``owned_by:
    "sglang"`` (``sglang/srt/entrypoints/openai/protocol.py::ModelCard``); None when neither does."""
    for path in ("/model_info", "/get_model_info"):
        resp = http._request("GET", path, retries=0)
        if resp.status_code == 404:
            continue
        try:
            data = http._json(resp, f"GET {path}", path) if resp.status_code == 200 else None
        except SGLangError:
            data = None
        if isinstance(data, dict) and isinstance(data.get("model_path"), str):
            return f"GET {path} (SGLang's model info, model_path)"
        break
    resp = http._request("GET", "/v1/models", retries=0)
    try:
        data = http._json(resp, "GET /v1/models", "/v1/models") if resp.status_code == 200 else None
    except SGLangError:
        data = None
    models = data.get("data") if isinstance(data, dict) else None
    if isinstance(models, list) and any(isinstance(m, dict) and m.get("owned_by") == "sglang" for m in models):
        return 'GET /v1/models (owned_by "sglang")'
    return None


def _v(t: tuple[int, ...]) -> str:
    return ".".join(str(x) for x in t)


def parse_counters(metrics_text: str) -> AcceptanceCounters:
    """SGLang's cumulative counters of one ``/metrics`` text (``sglang/srt/observability/metrics_collector.py``):
    ``sglang:spec_verify_calls_total`` (verify steps of finished requests), ``sglang:generation_tokens_total``,
    ``sglang:num_requests_total``, summed over label sets. SGLang exports no accepted / proposed draft counters:
    those stay None (per request they are in ``meta_info``)."""
    sums: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name in ("sglang:spec_verify_calls_total", "sglang:generation_tokens_total",
                          "sglang:num_requests_total"):
                sums[s.name] = sums.get(s.name, 0.0) + float(s.value)
    return AcceptanceCounters(engine="sglang", verify_steps=sums.get("sglang:spec_verify_calls_total", 0.0),
                              generation_tokens=sums.get("sglang:generation_tokens_total"),
                              requests=sums.get("sglang:num_requests_total"))


#: ``watch`` field -> SGLang 0.5.23 sample (``sglang/srt/observability/metrics_collector.py``: the counters are
#: ``TokenizerMetricsCollector``'s, incremented once per finished request in ``observe_one_finished_request``, where
#: ``prompt_tokens`` counts the whole prompt, cached part included, and ``cached_tokens_total`` the cached part;
#: the gauges are ``SchedulerMetricsCollector``'s, set by ``log_stats`` each logging window: ``token_usage`` is the
#: share of the KV pool in use, ``spec_accept_length`` / ``cache_hit_rate`` the last window's). SGLang exports no
#: accepted / proposed draft counter and, its registry being multiprocess (``utils/common.py``
#: ``MultiProcessCollector``), no ``process_start_time_seconds``.
WATCH_METRICS = {"generation_tokens": "sglang:generation_tokens_total",
                 "verify_steps": "sglang:spec_verify_calls_total", "requests": "sglang:num_requests_total",
                 "prompt_tokens": "sglang:prompt_tokens_total", "cached_tokens": "sglang:cached_tokens_total",
                 "running_reqs": "sglang:num_running_reqs", "queue_reqs": "sglang:num_queue_reqs",
                 "kv_cache_use": "sglang:token_usage", "cache_hit_rate_gauge": "sglang:cache_hit_rate",
                 "accept_length_gauge": "sglang:spec_accept_length", "accept_rate_gauge": "sglang:spec_accept_rate",
                 "start_time": "process_start_time_seconds",
                 # a gauge set at the end of each update_weights_from_{disk,distributed,tensor,ipc}, labelled by source
                 # (scheduler_components/weight_updater.py::_observe_weight_load): absent until the first update
                 "weight_load_s": "sglang:weight_load_duration_seconds"}
#: gauges exported once per scheduler (TP / DP rank label sets): averaged, not summed
_SGLANG_MEAN = ("kv_cache_use", "cache_hit_rate_gauge", "accept_length_gauge", "accept_rate_gauge")


def parse_watch(metrics_text: str) -> dict:
    """:meth:`EngineAdapter.watch_snapshot` of SGLang (:data:`WATCH_METRICS`): counters and the running / queued
    requests summed over label sets, the ratio gauges averaged over the label sets that export them."""
    # one pass counting the label sets of each ratio gauge, so a DP server's per-rank gauges are averaged
    counts: dict[str, int] = {}
    ratio = {WATCH_METRICS[f]: f for f in _SGLANG_MEAN}
    for fam in text_string_to_metric_families(metrics_text):
        for s_ in fam.samples:
            if s_.name in ratio:
                counts[ratio[s_.name]] = counts.get(ratio[s_.name], 0) + 1
    snap = watch_fields(prometheus_sums(metrics_text, list(WATCH_METRICS.values())), WATCH_METRICS, mean_of=counts)
    snap.update(engine="sglang", draft_tokens=None, accepted_tokens=None)
    snap["sources"] = {k: f"{v} (sglang/srt/observability/metrics_collector.py)" for k, v in snap["sources"].items()}
    return snap


#: what a GPU server of the DeepSeek family may run that the CPU reference cannot, each with the capture path it
#: takes there (SGLang 0.5.23 line numbers; env/reference/README.md "What the DeepSeek family cannot show on CPU")
UNVERIFIED_CAPTURE_PATHS = {
    "two_batch_overlap": (
        "two-batch overlap (enable_two_batch_overlap): on a TBO batch the layer loop stops at first_k_dense_replace "
        "and the later layers run through batch_overlap/two_batch_overlap.py::model_forward_stages, which is passed no "
        "aux collector (sglang/srt/models/deepseek_v2.py:3166-3173, 3202-3210, DeepseekV2Model.forward); an aux layer "
        "id at or past first_k_dense_replace is then not captured on that batch and AuxHiddenStatePacker.finalize "
        "would come up short (layers/aux_hidden_states.py). Whether EAGLE-3 target batches run under TBO was not "
        "verified: the CPU reference cannot run TBO (with DP attention it reaches model_forward_stages at the "
        "warm-up and fails in batch_overlap/operations_strategy.py:106, torch.cuda.get_device_properties)"),
    "dp_attention": (
        "DP attention with more than one attention-TP rank per DP group (tp_size / attn_dp_size > 1): the aux capture "
        "then reads the stage input through the attention-TP gather (layers/layer_boundary/stage.py:461-480, "
        "StageBoundary._prepare_attention with entry.input_move = attn_tp_gather_input; "
        "layers/layer_boundary/boundary.py:582-614, the TokenAxis.ATTN_TP entry step), a branch the CPU reference "
        "did not run: it served DP attention only with one attention-TP rank per DP group (TP 2, attn_dp_size 2: "
        "aux states equal to HF's layers), where that gather is a no-op"),
    "ep_all_to_all": (
        "expert parallelism (moe_a2a_backend / ep_size > 1): the MoE output comes back through the all-to-all "
        "combine (deepseek_v2.py:1074 `if not self._enable_a2a_moe` -> DeepseekV2MoE.forward_deepep, l.1524) or "
        "from rank-local experts, not as the TP partial sums the CPU reference verified; the aux states are still "
        "read at the next layer's attention entry, but that path, and what this tool's per-rank `mlp_partial` hook "
        "records there, are unverified (the CPU reference cannot run EP: its fp32 MoE, "
        "layers/moe/fused_moe_native.py:77 moe_forward_native, fails on the -1 ids of other ranks' experts; the "
        "all-to-all backends are CUDA/ROCm/NPU libraries)"),
    "cuda_graph": (
        "CUDA graphs: decode / target-verify forwards replay a captured graph, so --forward-hooks (this tool's "
        "per-rank, every-layer and fault hooks) do not run on them, and the packed aux tensor the draft reads is the "
        "graph's static output of AuxHiddenStatePacker (deepseek_v2.py:3175); the CPU reference runs eager only "
        "(--disable-cuda-graph), so the graph path is unverified: capture on a replica started with "
        "--disable-cuda-graph (env/gpu/launch_tp8.sh with LAYERS_DIR)"),
}


def capture_caveats(info: dict, architectures: Optional[Sequence[str]], model_type: Optional[str]) -> list[str]:
    """The capture paths this server runs that the CPU reference could not verify, one sentence each (the
    :data:`UNVERIFIED_CAPTURE_PATHS` entry), for a DeepSeek-family target (SGLang's ``deepseek`` id rule:
    ``models/deepseek_v2.py`` and the models built on it, Kimi-K2.5 included); [] for any other target or a server
    running none of them.

    Read from ``/server_info`` (SGLang 0.5.23 field names): ``enable_two_batch_overlap``; DP attention
    (``enable_dp_attention`` or ``attn_dp_size`` > 1) with ``tp_size`` / ``attn_dp_size`` > 1 (one attention-TP rank
    per DP group was verified on the CPU reference); ``moe_a2a_backend`` other than ``none`` or ``ep_size`` > 1; CUDA
    graphs on a non-CPU ``device`` unless ``disable_cuda_graph`` (or every ``cuda_graph_config`` phase's backend is
    ``disabled``).
    """
    if target_rule(architectures, model_type).rule != "deepseek":
        return []

    def count(key: str) -> int:
        v = info.get(key)
        return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 1

    on = []
    if info.get("enable_two_batch_overlap") is True:
        on.append("two_batch_overlap")
    attn_dp = count("attn_dp_size") if count("attn_dp_size") > 1 else count("dp_size")
    if (info.get("enable_dp_attention") is True or count("attn_dp_size") > 1) and count("tp_size") // attn_dp > 1:
        on.append("dp_attention")
    if str(info.get("moe_a2a_backend") or "none").lower() != "none" or count("ep_size") > 1:
        on.append("ep_all_to_all")
    graphs = info.get("cuda_graph_config")
    phases = [p for p in graphs.values() if isinstance(p, dict)] if isinstance(graphs, dict) else []
    all_disabled = bool(phases) and all(str(p.get("backend")) == "disabled" for p in phases)
    if str(info.get("device") or "cuda") != "cpu" and info.get("disable_cuda_graph") is not True and not all_disabled:
        on.append("cuda_graph")
    return [f"unverified capture path on this DeepSeek-family server: {UNVERIFIED_CAPTURE_PATHS[k]}" for k in on]


class SGLangAdapter(EngineAdapter):
    """SGLang (id rules read from 0.5.23 back to 0.5.6; older releases are assumed to follow 0.5.6, and the plans
    say so: :mod:`helpers.layers.sglang`)."""

    name = "sglang"
    label = "SGLang"

    @classmethod
    def supported(cls) -> str:
        return f"SGLang {_v(OLDEST_READ)}-{_v(TABLE_VERSION)} (rules read; other releases assumed as the nearest)"

    @classmethod
    def version_refusal(cls, version: str, where: str) -> Optional[str]:
        """SGLang's rules are taken from the nearest release read, which needs an ``X.Y[.Z]`` version: one that is
        not (``"banana"``) is refused here, before anything is captured."""
        try:
            parse_version(version)
        except ValueError:
            return f"is SGLang by its answers, but its version {version!r} ({where}) is not an X.Y.Z release"
        return None

    @classmethod
    def probe(cls, http: HTTPClient) -> Optional[tuple[str, dict]]:
        """SGLang when ``GET /server_info`` (fallback ``/get_server_info``) answers a JSON object with a ``version``
        and ServerArgs fields (:data:`SERVER_INFO_MARKERS`); that answer is then checked as the client checks it
        (:func:`helpers.server.client.checked_server_info`). None when the server is not SGLang.

        What tells "SGLang with a malformed answer" (a server error, exit 1) from "not SGLang" (None: detection's
        "neither", exit 2): a ``/server_info`` object with a ``version`` key and a ServerArgs field is SGLang's
        (``sglang/srt/utils/common.py::build_server_info``), whatever the types inside; any other ``/server_info``
        answer (HTML, a JSON list, JSON nested too deeply, an object without those fields) is SGLang's only when
        SGLang's other endpoints say so (:func:`sglang_elsewhere`: ``/model_info``, ``/v1/models``), else the server
        is not taken for SGLang and detection names what each endpoint answered.

        Raises:
            helpers.errors.SGLangError: SGLang by its answers, and ``/server_info`` is malformed: one line naming the
                endpoint and the field (``field tp_size: ...``, ``field version: ...``) or what it answered."""
        for path in ("/server_info", "/get_server_info"):
            resp = http._request("GET", path, retries=0)
            if resp.status_code != 200:
                continue
            where = f"GET {http._shown_url}{path}"
            try:
                data = http._json(resp, where, path)
            except SGLangError as exc:           # not JSON (HTML, text), nested too deeply
                return cls._malformed(http, str(exc), path)
            if isinstance(data, dict) and "version" in data and any(k in data for k in SERVER_INFO_MARKERS):
                version = checked_server_info(data, where, path).version
                if not version:
                    raise SGLangError(f"{where}: field version: expected SGLang's release (X.Y.Z), got "
                                      f"{version!r}", endpoint=path)
                return version, {path: f"version {version}"}
            return cls._malformed(http, f"{where}: expected SGLang's server info (a JSON object with a version and "
                                        f"its ServerArgs fields), got {answer_kind(data)}", path)
        return None

    @classmethod
    def _malformed(cls, http: HTTPClient, message: str, path: str) -> None:
        """Raise ``message`` as a server error when SGLang's other endpoints say the server is SGLang; else None (the
        server is not taken for SGLang)."""
        why = sglang_elsewhere(http)
        if why:
            raise SGLangError(f"{message} (the server is SGLang by {why})", endpoint=path)
        return None

    def client(self, url: str, api_key: Optional[str] = None, **kwargs: Any) -> SGLangClient:
        return SGLangClient(url, api_key=api_key, **kwargs)

    def start(self, target: str | Path, draft: str | Path | None, *, tp: int = 2, **kwargs: Any) -> ServerProcess:
        return embedded.start(target, draft, tp=tp, **kwargs)

    def spec_config(self, client: SGLangClient, *, draft: str | Path | None = None) -> SpecConfig:
        """``SGLangClient.effective_spec_config`` in the common shape, with the aux ids SGLang's rules of the server's
        version give for the draft config (``sglang_capture`` convention, the physical tensor of each:
        :class:`helpers.diagnosis.plan_rules.PlanRules`) when the draft and target configs are readable here."""
        eff = client.effective_spec_config(draft_config=draft)
        info = client.server_info()
        e = eff.effective
        cfg = SpecConfig(engine="sglang", version=str(eff.sglang_version), tp_size=eff.tp_size,
                         method=e.algorithm, target=info.get("model_path"),
                         draft=os.fspath(draft) if draft else info.get("speculative_draft_model_path"),
                         num_speculative_tokens=(e.num_draft_tokens - 1) if e.num_draft_tokens else None,
                         overrides=[str(o) for o in eff.overrides], aux_layer_convention="sglang_capture",
                         sources={"*": "GET /server_info"}, notes=list(eff.notes))
        try:
            d, t = read_draft_config(Path(cfg.draft)), read_target_config(Path(cfg.target))
            plan = self.rules(cfg.version).served_plan(d, t, e.algorithm or "EAGLE3")
        except (BadInput, OSError, TypeError, ValueError) as exc:
            cfg.notes.append(f"aux ids not computed: the draft / target configs are not readable here ({exc})")
            return cfg
        if plan.engine_ids is not None:
            cfg.aux_layer_ids = cfg.rule_aux_layer_ids = list(plan.engine_ids.ids)
        cfg.aux_tensors = list(plan.tensors)
        cfg.sources["aux_layer_ids"] = f"{plan.source} (SGLang's rules on the draft config)"
        return cfg

    def counters(self, client: HTTPClient) -> AcceptanceCounters:
        return parse_counters(client.metrics_text())

    def watch_snapshot(self, metrics_text: str) -> dict:
        return parse_watch(metrics_text)

    def capture_served(self, client: SGLangClient, prompts: Sequence[Any], out_dir: str | Path, *,
                       name: str = "served", max_new_tokens: int = 1, records: Optional[list] = None,
                       rank_dir: str | Path | None = None, max_width: Optional[int] = None,
                       progress: bool = False, sampling: Optional[dict] = None) -> Path:
        """``helpers.capture.capture_served`` (``/generate`` with ``return_hidden_states``, the cache flushed before
        each prompt); ``rank_dir``: the folder of the server's per-rank capture hooks, armed while it runs
        (``helpers.hooks.ARM_FILE``)."""
        from ..capture import capture_served  # lazy: torch (measure detects the engine without it)
        from ..hooks import ARM_FILE  # lazy: torch (measure detects the engine without it)
        arm = contextlib.nullcontext()
        if rank_dir is not None:
            Path(rank_dir).mkdir(parents=True, exist_ok=True)
            arm = armed_file(Path(rank_dir) / ARM_FILE, f"armed by helpers.engines.sglang ({name}, pid {os.getpid()})\n",
                             what="per-rank capture arm file")
        with arm:
            return capture_served(client, prompts, out_dir, name=name, max_new_tokens=max_new_tokens,
                                  progress=progress, max_width=max_width, records=records, sampling=sampling)

    def continuation(self, client: SGLangClient, prompt_id: str, input_ids: Optional[Sequence[int]],
                     text: Optional[str], index: int, *, max_new_tokens: int, sampling: Optional[dict],
                     timeout_s: float) -> Continuation:
        """``POST /generate`` with ``return_prompt_token_ids`` and no hidden states, ``sampling_params`` of
        :func:`helpers.capture.sampling_params` (``ignore_eos``; ``sampling_seed`` + ``index``: SGLang 0.5.23 draws
        a seeded request's token from its own seed and position, ``sglang/srt/layers/sampler.py::
        multinomial_with_seed``, whatever else shares its batch).

        Raises: :class:`helpers.errors.SGLangError` when the answer has fewer than ``max_new_tokens`` tokens or no
        prompt ids."""
        from ..capture import sampling_params  # lazy: torch (measure detects the engine without it)
        res = client.generate(input_ids=input_ids, text=text if input_ids is None else None,
                              max_new_tokens=max_new_tokens, return_prompt_token_ids=True,
                              sampling_params=sampling_params(sampling, index), timeout=timeout_s)
        prompt = res.prompt_token_ids if res.prompt_token_ids else (list(input_ids) if input_ids is not None else None)
        if not prompt or len(res.output_ids) != int(max_new_tokens):
            raise SGLangError(f"POST {client._shown_url}/generate ({prompt_id}): expected the prompt's token ids and "
                              f"{max_new_tokens} generated tokens, got {len(prompt or [])} and "
                              f"{len(res.output_ids)}", endpoint="/generate")
        return Continuation(prompt_id, tuple(int(t) for t in prompt), tuple(int(t) for t in res.output_ids))

    def context_rule(self, client: SGLangClient) -> Optional[ContextRule]:
        """SGLang 0.5.23's check of each request (``sglang/srt/managers/tokenizer_manager.py::TokenizerManager.
        _validate_one_request``): the prompt plus ``num_reserved_tokens`` (``sglang/srt/managers/utils.py::
        compute_num_reserved_tokens``: on an EAGLE-family server max(topk x steps, the draft tokens per verify), the
        draft tokens kept in the output slots; else 0) at or past the context length, or that plus ``max_new_tokens``
        past it, is refused (HTTP 400) unless the server runs ``--allow-auto-truncate``, which cuts the prompt or
        ``max_new_tokens`` instead. The context length: ``GET /v1/models`` ``max_model_len`` (the server's
        ``model_config.context_len``), else ``/server_info`` ``context_length``; None when neither says it.

        Its scheduler checks the prompt a second time (``sglang/srt/managers/scheduler.py::Scheduler`` ->
        ``managers/utils.py::validate_input_length``): a prompt of ``max_req_input_len`` tokens or more is refused
        (cut with ``--allow-auto-truncate``), ``max_req_input_len = min(context_len - 1, KV pool tokens - 1) - 5``
        (``managers/tp_worker.py::TpModelWorker.get_worker_info``). ``/server_info`` carries the scheduler's
        ``max_req_input_len`` (``utils/common.py::build_server_info`` lays ``scheduler.py::Scheduler.get_init_info``
        over the server args), read as it is; a server without it gives ``max_total_num_tokens`` and the formula is
        applied to it (the pool's tokens as the scheduler reports them; the worker's page-interleaved capacity is the
        same without decode context parallelism); neither: the first check alone. ``max_prompt`` is the smaller
        bound; ``prompt_source`` names the function of the second when it is the one that bites (506 on the embedded
        server: context 512, so ``max_req_input_len`` 506 and prompts up to 505 tokens, below the first check's
        507)."""
        info = client.server_info()
        ctx = info.get("context_length")
        try:
            models = client._get_json(["/v1/models"], "model list").get("data") or []
            ctx = next((m.get("max_model_len") for m in models if isinstance(m, dict)
                        and isinstance(m.get("max_model_len"), int)), ctx)
        except SGLangError:
            pass
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
            return None
        reserved = 0
        if str(info.get("speculative_algorithm") or "").upper() in ("EAGLE", "EAGLE3", "FROZEN_KV_MTP"):
            def n(key: str) -> int:
                v = info.get(key)
                return int(v) if isinstance(v, int) and not isinstance(v, bool) else 0
            reserved = max(n("speculative_eagle_topk") * n("speculative_num_steps"), n("speculative_num_draft_tokens"))
        max_prompt, prompt_source = ctx - reserved - 1, None

        def count(key: str) -> Optional[int]:
            v = info.get(key)
            return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
        limit, pool = count("max_req_input_len"), count("max_total_num_tokens")
        how = "/server_info max_req_input_len"
        if limit is None and pool is not None:
            limit = min(ctx - 1, pool - 1) - 5
            how = f"min(context {ctx} - 1, /server_info max_total_num_tokens {pool} - 1) - 5"
        if limit is not None and limit - 1 < max_prompt:
            max_prompt = max(limit - 1, 0)
            prompt_source = (f"sglang/srt/managers/utils.py::validate_input_length, a prompt of max_req_input_len = "
                             f"{limit} tokens or more ({how})")
        return ContextRule(tokens=ctx, reserved=reserved, max_prompt=max_prompt,
                           clamps=bool(info.get("allow_auto_truncate")),
                           source="sglang/srt/managers/tokenizer_manager.py::TokenizerManager._validate_one_request",
                           prompt_source=prompt_source)

    def draft_checksum(self, client: HTTPClient) -> Optional[dict]:
        """SGLang 0.5.23's ``POST /weights_checker`` ``{"action": "checksum", "selector": "draft"}``
        (``entrypoints/http_server.py::check_weights`` -> ``managers/tokenizer_control_mixin.py::check_weights``, its
        ``per_engine_checksum`` = sha256 over the ranks' ``per_gpu_checksum`` -> the scheduler's
        ``scheduler_components/weight_updater.py::WeightUpdater.check_weights``, whose ``_select_runners("draft")``
        reaches ``self.draft_worker.weight_update_runners()`` -> ``utils/weight_checker.py::WeightChecker.
        _compute_checksum``: per parameter and buffer of the draft runner, the first 8 bytes of sha256 over its bytes
        as loaded, rotary caches skipped). Unlike ``/get_weights_by_name`` (target only) it reaches the draft, but
        hashes the tensors as the engine holds them (fused, TP-sharded, its dtype), so it is compared with itself
        over time, not with the checkpoint's files. None when the server has no such route (404: an older SGLang).

        Raises: :class:`helpers.errors.SGLangError` for another status or an answer of another shape."""
        where = "/weights_checker"
        resp = client._request("POST", where, json_body={"action": "checksum", "selector": "draft"},
                               idempotent=True)
        if resp.status_code == 404:
            return None
        body = client._json(resp, f"POST {where}", where)
        if resp.status_code >= 400 or not isinstance(body, dict) or not body.get("success"):
            msg = body.get("message") if isinstance(body, dict) else None
            raise SGLangError(f"POST {where}: HTTP {resp.status_code}: {str(msg or body)[:200]}", endpoint=where)
        ranks = body.get("ranks") or []
        if not isinstance(body.get("per_engine_checksum"), str) or not isinstance(ranks, list):
            raise SGLangError(f"POST {where}: expected per_engine_checksum (text) and ranks (a list)", endpoint=where)
        rows = []
        for r in ranks:
            par = r.get("parallelism_info") if isinstance(r, dict) else None
            for info in (par if isinstance(par, list) else [par]):
                if isinstance(info, dict):
                    rows.append({"role": info.get("role"), "tp_rank": info.get("tp_rank"),
                                 "tensors": len(r.get("checksums") or {}), "checksum": r.get("per_gpu_checksum")})
        return {"per_engine_checksum": body["per_engine_checksum"], "ranks": rows,
                "source": "POST /weights_checker selector=draft (sglang/srt/utils/weight_checker.py)"}

    def rank_capture_dir(self, hooks_ranks_dir: Optional[Path], run_dir: Path, name: str) -> Optional[Path]:
        """The folder of the server's per-rank capture hooks (``server start --capture-ranks DIR``), or None."""
        return hooks_ranks_dir

    def rules(self, version: Optional[str]) -> PlanRules:
        """SGLang's id rules of ``version`` (:class:`helpers.diagnosis.plan_rules.PlanRules`)."""
        from ..diagnosis.plan_rules import PlanRules  # lazy: torch (measure detects the engine without it)
        return PlanRules(version)

    def loader_rules(self, version: Optional[str]) -> LoaderRules:
        """SGLang 0.5.23's draft loader (:class:`helpers.draft.checks.LoaderRules`)."""
        from ..draft.checks import LoaderRules  # lazy: torch (measure detects the engine without it)
        return LoaderRules(version)

    def every_layer_source(self, client: HTTPClient, hooks_layers_dir: Optional[Path]) -> Optional[str]:
        """The server's every-layer capture hooks (``server start --capture-layers DIR``), when it runs them."""
        return None if hooks_layers_dir is None else f"the server's own every-layer capture ({hooks_layers_dir})"

    def capture_every_layer(self, client: HTTPClient, prompts: Sequence[Any], out_dir: str | Path, *, name: str,
                            num_layers: int, hooks_layers_dir: Optional[Path]) -> Path:
        """``helpers.capture.capture_every_layer`` through the server's every-layer hooks."""
        from ..capture import capture_every_layer  # lazy: torch (measure detects the engine without it)
        if hooks_layers_dir is None:
            raise ValueError("the server runs no every-layer capture hooks")
        return capture_every_layer(client, prompts, hooks_layers_dir, out_dir, num_layers=num_layers, name=name,
                                   progress=False)

    def start_variant(self, restart: dict, **kwargs: Any) -> ServerProcess:
        """``helpers.server.restart.start_variant`` (SGLang's flags, the embedded launcher of the registry)."""
        return start_variant(restart, **kwargs)

    def toggles(self) -> tuple[Toggle, ...]:
        """SGLang 0.5.23's toggles (:data:`helpers.acceptance.ablations.TOGGLES`)."""
        return TOGGLES

    def capture_caveats(self, info: dict, architectures: Optional[Sequence[str]], model_type: Optional[str]
                        ) -> list[str]:
        """SGLang 0.5.23's DeepSeek-family paths the CPU reference could not run (:func:`capture_caveats`)."""
        return capture_caveats(info, architectures, model_type)

    def sampling_rule(self, info: dict) -> str:
        return ("SGLang verifies sampled tokens against the draft's proposals (tree speculative sampling, "
                "sglang/srt/speculative/eagle_worker_v2.py), and fewer match at a higher temperature")

    def cli_refusal(self, args: Any) -> Optional[str]:
        """Every ``server start`` option applies to SGLang but ``--vllm-venv``."""
        return "--vllm-venv applies to vLLM only" if getattr(args, "vllm_venv", None) else None

    def start_from_cli(self, args: Any, draft: Optional[str], extra: list[str]) -> tuple[ServerProcess, dict]:
        """The embedded SGLang server with ``--forward-hooks``, ``--faults``, the capture hooks and the draft step trace
        (``--trace-draft``) of ``server start``
        (:func:`helpers.server.embedded.start`); ``launch`` holds the ``SGLANG_*`` environment (:func:`sglang_env`)."""
        from ..capture import server_hook_specs  # lazy: torch (measure detects the engine without it)
        from ..hooks import model_family  # lazy: torch (measure detects the engine without it)
        hooks = loads_json(args.forward_hooks) if args.forward_hooks else None
        faults = parse_faults(args.faults) if args.faults else []
        trace = getattr(args, "trace_draft", None)
        if faults or args.capture_layers or args.capture_ranks or trace:
            tcfg = read_target_config(args.target or embedded.REFERENCE_TARGET)
            hooks = (hooks or []) + (server_hook_specs(tcfg.num_hidden_layers, faults=faults,
                                                       rank_capture_dir=args.capture_ranks,
                                                       layers_dir=args.capture_layers,
                                                       family=model_family(tcfg.architectures, tcfg.model_type),
                                                       trace_dir=trace, draft_dir=draft if trace else None)
                                     or [])
        spec = SpecSettings(algorithm=args.algorithm, num_steps=args.steps, topk=args.topk,
                            num_draft_tokens=args.draft_tokens)
        handle = embedded.start(args.target, draft, tp=args.tp, port=args.port, spec=spec, dtype=args.dtype,
                                forward_hooks=hooks, log_path=args.log, timeout=args.timeout, extra_args=extra)
        launch = {"engine": "sglang", "target": str(Path(handle.target).resolve()),
                  "draft": None if draft is None else str(Path(draft).resolve()), "tp": args.tp,
                  "spec": (spec.model_dump(mode="json") if draft is not None or spec.algorithm == "NEXTN"
                           else None), "forward_hooks": hooks,
                  "extra_args": extra, "dtype": args.dtype, "env": sglang_env()}
        return handle, launch

    def chunked_prefill_flags(self, tokens: int) -> Optional[dict]:
        """``--chunked-prefill-size N`` (``sglang/srt/server_args.py::ServerArgs.chunked_prefill_size``: the scheduler
        splits an extend longer than N tokens into chunks, ``sglang/srt/managers/scheduler.py``)."""
        return {"--chunked-prefill-size": str(int(tokens))}

    def oracle_flags(self) -> Optional[dict]:
        """``--speculative-algorithm STANDALONE`` (``sglang/srt/speculative/spec_info.py::SpeculativeAlgorithm.
        STANDALONE``: any model drafts, no hidden states, the EAGLE V2 worker's verify path; the restart gives the
        target's folder as ``--speculative-draft-model-path``) and ``--disable-radix-cache``: STANDALONE's draft rows
        hold the next position's token (:meth:`oracle_caveat`) but its radix tree is keyed by single tokens
        (``sglang/srt/mem_cache/kv_cache_builder.py``: ``is_eagle=spec_algorithm.is_eagle()``, which excludes
        STANDALONE, so no bigram keys as for EAGLE / EAGLE3), so a prefix hit hands a request the draft row of the
        request that cached that prefix, stale at the hit's last position (on the embedded CPU server, 12 prompts
        sharing their first 1-6 tokens after SGLang's warm-up: 3.43 of 4.00 with the cache, 3.66 without;
        bench/bench_oracle_floor.py). The probe's cold arm flushes the cache before each request anyway; the flag keeps
        the oracle free of it whatever a flush leaves."""
        return {"--speculative-algorithm": "STANDALONE", "--disable-radix-cache": None}

    def oracle_caveat(self) -> Optional[str]:
        """SGLang 0.5.23's STANDALONE draft is not the target on the same tokens: the EAGLE V2 worker feeds every draft
        the EAGLE layout, ids rotated left by one (``sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker.
        _draft_extend_for_prefill``: ``cat(input_ids[1:], tail_token)``; after each verify ``_draft_extend_for_decode``
        writes the target's next tokens at the verify window's positions), so the draft row at position p holds the
        token of p + 1 and a draft that is the target runs on the sequence without its first token (the BOS). Measured
        on the embedded CPU server (bench/bench_oracle_floor.py): its logits equal the target's on that shorter sequence
        to 5e-6 and differ from the target's own by up to 1.5; a chain simulated with it gives each prompt's live verify
        steps exactly (12 of 12)."""
        return ("SGLang's STANDALONE draft runs on the sequence rotated left by one, the target without its first "
                "token (sglang/srt/speculative/eagle_worker_v2.py::EagleDraftWorker._draft_extend_for_prefill, "
                "_draft_extend_for_decode: the EAGLE layout, row p holds token p + 1), so it proposes other tokens "
                "where the target's top two are close: the floor includes that draft's own misses, not verification's "
                "and KV's alone")

    def prefix_cache_off(self, info: dict) -> Optional[str]:
        """``--disable-radix-cache`` (``sglang/srt/server_args.py::ServerArgs.disable_radix_cache``)."""
        return ("the server runs without a prefix cache (--disable-radix-cache): no hit to probe"
                if info.get("disable_radix_cache") else None)

    def host_cache_launch(self, info: dict, *, device_tokens: int, host_tokens: int
                          ) -> tuple[Optional[dict], Optional[str]]:
        """SGLang 0.5.23's hierarchical cache (HiCache): ``--enable-hierarchical-cache`` (``sglang/srt/arg_groups/
        fields/memory.py``), ``--max-total-tokens device_tokens`` (the device KV pool) and ``--hicache-ratio`` (the host
        pool as a multiple of the device pool, at least SGLang's default 2.0, ``fields/memory.py::hicache_ratio``;
        ``--hicache-size 0`` so that a size in GB the server set does not override it); the server's own other
        ``--hicache-*`` settings are kept. Refused (``(None, why)``) on a server without a prefix
        cache (``--disable-radix-cache`` and ``--enable-hierarchical-cache`` are mutually exclusive:
        ``sglang/srt/arg_groups/kv_cache_hook.py``) and on a CPU server, where HiCache cannot start: the host pool
        pins its buffer through CUDA (``sglang/srt/mem_cache/pool_host/common.py::alloc_with_host_register`` ->
        ``_cuda_host_register`` -> ``torch.cuda.cudart()``; ``MHATokenToKVPoolHost`` is built with
        ``pin_memory=True``) and the host<->device transfer ops ``transfer_kv_*`` are bound only on CUDA / ROCm
        (``sgl_kernel.kvcacheio``) and XPU (``sglang/srt/mem_cache/pool_host/mha.py``, module level)."""
        if info.get("disable_radix_cache"):
            return None, ("the server runs without a prefix cache (--disable-radix-cache), which SGLang refuses "
                          "with --enable-hierarchical-cache (sglang/srt/arg_groups/kv_cache_hook.py)")
        if str(info.get("device") or "").lower() == "cpu":
            return None, ("SGLang's hierarchical cache cannot start on a CPU server (device cpu): its host pool pins "
                          "memory through CUDA (sglang/srt/mem_cache/pool_host/common.py::alloc_with_host_register -> "
                          "_cuda_host_register: torch.cuda.cudart()) and its host<->device transfer ops are bound "
                          "only on CUDA, ROCm and XPU (sglang/srt/mem_cache/pool_host/mha.py)")
        ratio = max(2.0, -(-int(host_tokens) // max(1, int(device_tokens))))
        return {"flags": {"--enable-hierarchical-cache": None, "--max-total-tokens": str(int(device_tokens)),
                          "--hicache-ratio": f"{ratio:g}", "--hicache-size": "0"}, "env": {}}, None

    def top_logprobs_fields(self, n: int) -> Optional[dict]:
        """``return_logprob`` + ``top_logprobs_num`` (``meta_info.output_top_logprobs``, entries ``[logprob,
        token_id, text]``: ``sglang/srt/managers/tokenizer_manager.py::TokenizerManager.convert_logprob_style``)."""
        return {"return_logprob": True, "top_logprobs_num": int(n)}

    def sampled_verify_refusal(self, info: dict) -> Optional[str]:
        """``--speculative-use-rejection-sampling``: the draft samples its proposals
        (``sglang/srt/speculative/spec_utils.py::sample_draft_proposal``), not the offline chain's argmax."""
        if info.get("speculative_use_rejection_sampling"):
            return ("the server samples its draft proposals (--speculative-use-rejection-sampling: sglang/srt/"
                    "speculative/spec_utils.py::sample_draft_proposal), so the offline chain's argmax proposals are "
                    "not its own")
        return None

    def verify_note(self, info: dict) -> Optional[str]:
        """SGLang on CPU / XPU verifies with the argmax at every temperature
        (``sglang/srt/speculative/eagle_utils.py::_verify_uses_greedy``)."""
        dev = str(info.get("device") or "").lower()
        if dev in ("cpu", "xpu"):
            return (f"SGLang on {info['device']} verifies with the target's argmax at every temperature "
                    "(sglang/srt/speculative/eagle_utils.py::_verify_uses_greedy): only the first token of each answer "
                    "is sampled, and this probe checks the greedy verify on that sampled prefix")
        return None

    def trace_unavailable(self, client: SGLangClient) -> Optional[str]:
        """None when the server runs the draft step trace hook (:mod:`helpers.trace_hooks`, its ``/server_info``
        ``forward_hooks``) and its folder is readable here; else why not."""
        from ..trace_hooks import HOW, trace_dir  # lazy: torch (measure detects the engine without it)
        d = trace_dir(client.server_info())
        if d is None:
            return HOW
        if not d.is_dir():
            return f"the trace folder {d} is not readable on this machine (the probe reads the server's trace files)"
        return None

    def trace_requests(self, client: SGLangClient, prompts: Sequence[Any], *, max_new_tokens: int, tag: str,
                       folder: Path) -> tuple[list, list[dict]]:
        """:meth:`EngineAdapter.trace_requests` on SGLang: the hook's folder armed (``helpers.hooks.ARM_FILE``),
        each prompt sent to ``/generate`` with ``return_hidden_states``, ``return_prompt_token_ids`` and a request id
        of its own (``rid``: the trace's ``ForwardBatch.rids``), the records written after the arm read back
        (:func:`helpers.draft.trace.read_trace`).

        The arm file is created exclusively (:func:`helpers.runfiles.armed_file`: ``O_EXCL | O_NOFOLLOW``) and removed
        only if it is still the one created: an ``ARMED`` already there (another check tracing this server now, or a
        file or symlink this tool did not make) is refused naming it, never written through nor deleted.

        Raises:
            BadInput: no trace hook, the arm file exists or cannot be made, a damaged trace folder
                (:func:`helpers.draft.trace.read_trace`), no record written while armed."""
        from ..draft.trace import read_trace, served_sequence, trace_counts  # lazy: torch
        from ..hooks import ARM_FILE  # lazy: torch (measure detects the engine without it)
        from ..runfiles import read_file_text
        from ..trace_hooks import trace_dir  # lazy: torch
        d = trace_dir(client.server_info())
        if d is None:
            raise BadInput(self.trace_unavailable(client) or "no draft step trace")
        since = trace_counts(d)
        seqs = []
        with armed_file(d / ARM_FILE, f"armed by helpers.engines.sglang ({tag}, pid {os.getpid()})\n",
                        what="trace arm file"):
            for i, q in enumerate(prompts):
                client.flush_cache()
                res = client.generate(**q.request(), max_new_tokens=max_new_tokens, return_hidden_states=True,
                                      return_prompt_token_ids=True, rid=f"e3f-{tag}-{i}-{folder.name}"[:120],
                                      sampling_params={"temperature": 0.0, "ignore_eos": True})
                seqs.append(served_sequence(res, None if q.input_ids is None else list(q.input_ids)))
        records = read_trace(d, since=since)
        if not records:
            err = d / "ERROR"
            try:
                said = read_file_text(err, "the trace hook's ERROR file").strip().splitlines()[-1][:300] \
                    if os.path.lexists(err) else ""
            except (BadInput, IndexError):
                said = ""
            raise BadInput(f"the server wrote no trace records under {d} while it was armed: " +
                           (said if said else "is this the folder it writes to?"), path=d)
        return seqs, records

    def integrity_launch(self, switch: str) -> Optional[dict]:
        """SGLang 0.5.23's own integrity switches (read in the installed package; the probe module
        :mod:`helpers.investigation.probes.integrity` says what each checks and logs):

        * ``kv_canary``: ``--kv-canary log`` (``sglang/srt/arg_groups/fields/observability.py::kv_canary``: ``log``
          reports a violation as a WARNING and keeps serving, ``raise`` fails the scheduler), ``--kv-canary-real-data
          all`` (hash every real KV slot, ``RealKvHashMode.ALL``), ``--kv-canary-sweep-interval 4`` (every 4th
          forward also verifies every radix-held slot), ``--cuda-graph-backend-prefill disabled``
          (``sglang/srt/kv_canary/api.py::install_canary`` refuses piecewise prefill graphs), and the environment
          ``SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS=1`` (the ``[canary] step=... protected_tokens=...`` line every
          forward: the proof it ran) and ``SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT=1`` (the stored token ids
          checked against each request's ``origin_input_ids + output_ids``), ``sglang/srt/environ.py``;
        * ``invariant_check``: the environment ``SGLANG_INVARIANT_CHECK=1`` (``InvariantCheckLevel.WARN``: log every
          invariant hit, never crash, ``sglang/srt/utils/invariants.py::expect``), ``SGLANG_ENABLE_STRICT_MEM_CHECK_
          DURING_BUSY=2`` (the scheduler's KV pool accounting checked, and logged, after every batch:
          ``sglang/srt/managers/scheduler_components/invariant_checker.py::SchedulerInvariantChecker.
          self_check_during_busy``), ``SGLANG_CHECK_KV_PAGE_INVARIANTS=1`` (no request's slot in the free pool, no
          page freed twice: ``_check_kv_page_invariants``) and ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=0`` (those
          page checks and the idle leak checks warn instead of raising, ``sglang/srt/utils/common.py::
          raise_error_or_warn``, so the copy keeps answering after a hit)."""
        if switch == "kv_canary":
            return {"flags": {"--kv-canary": "log", "--kv-canary-real-data": "all", "--kv-canary-sweep-interval": "4",
                              "--cuda-graph-backend-prefill": "disabled"},
                    "env": {"SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS": "1",
                            "SGLANG_KV_CANARY_ENABLE_VERIFY_TOKEN_ASSERT": "1"}}
        if switch == "invariant_check":
            return {"flags": {}, "env": {"SGLANG_INVARIANT_CHECK": "1", "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY": "2",
                                         "SGLANG_CHECK_KV_PAGE_INVARIANTS": "1",
                                         "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}}
        return None

    def integrity_refusal(self, switch: str, info: dict) -> Optional[str]:
        """The KV canary on a CPU server (``server_info`` ``device`` ``cpu``): SGLang 0.5.23's canary has a torch
        reference for every kernel off CUDA (``sglang/kernels/ops/kv_canary/_dispatch.py::use_torch_reference``) but
        cannot start there: ``sglang/srt/kv_canary/runner/canary_manager.py::CanaryManager.__init__`` creates its
        copy stream with ``sglang/srt/utils/common.py::create_device_stream`` (``torch.cpu.Stream`` takes no
        ``device``) and ``runner/future_tensor.py::FutureTensors.device_to_host`` copies into pinned host memory
        (``pin_memory`` needs CUDA), and it steps ``sglang/srt/utils/phase_checker.py::SimplePhaseChecker.update``,
        a Triton kernel with no CPU driver, around every forward."""
        if switch == "kv_canary" and str(info.get("device") or "").lower() == "cpu":
            return ("SGLang's KV canary cannot start on a CPU server (device cpu): CanaryManager.__init__ creates a "
                    "device stream (sglang/srt/utils/common.py::create_device_stream: torch.cpu.Stream takes no "
                    "device), FutureTensors.device_to_host pins host memory (needs CUDA) and its phase checker is a "
                    "Triton kernel (sglang/srt/utils/phase_checker.py)")
        return None

    def fix_flags(self, fix: Any) -> dict:
        """The fix's ``server_args``, which are SGLang flags already."""
        return {k: str(v) for k, v in (fix.server_args or {}).items()}
