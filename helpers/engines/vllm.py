"""vLLM behind the engine seam: its HTTP client, engine and version detection, the effective speculative config, the
acceptance counters of ``/metrics`` and per request, and the capture of the aux hidden states it feeds the draft.
Rules and endpoints as read in vLLM 0.32.0 (``env/vllm/README.md``; the id rules are :mod:`helpers.layers.vllm`).
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence


from ..acceptance.ablations import Toggle
from ..errors import (
    BadInput,
    RequestRejected,
    SGLangError,
)
from ..layers import vllm as rules
from ..server.client import HTTPClient
from ..server.embedded import pick_port
from ..server.process import ServerProcess
from ..server.restart import set_flags
from . import vllm_mtp, vllm_server
from .base import AcceptanceCounters, ContextRule, Continuation, EngineAdapter, SpecConfig
from .vllm_answers import (
    checked,
    meta_info,
    sampling_rule,
    verify_sampling_fault,
    parse_counters,
    parse_watch,
    record,
)
from .vllm_client import EXTENSION_HINT, VLLMClient, _read_config
from .vllm_server import relaunch_command

if TYPE_CHECKING:          # annotations only (torch)
    from ..diagnosis.plan_rules import PlanRules
    from ..draft.checks import LoaderRules

#: names re-exported from :mod:`.vllm_rules`, imported when first asked for (it imports torch)
_FROM_RULES = ("TOGGLES", "VLLMLoaderRules", "VLLMRules", "draft_view")

__all__ = ["VLLMAdapter", "VLLMClient", "VLLMRules", "VLLMLoaderRules", "TOGGLES", "draft_view", "meta_info",
           "parse_counters", "record", "relaunch_command"]

def __getattr__(name: str) -> Any:
    """``VLLMRules``, ``VLLMLoaderRules``, ``TOGGLES``, ``draft_view`` from :mod:`.vllm_rules` on first use."""
    if name in _FROM_RULES:
        from . import vllm_rules  # lazy: torch (measure detects the engine without it)
        return getattr(vllm_rules, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")








class VLLMAdapter(EngineAdapter):
    """vLLM (rules of :data:`helpers.layers.vllm.KNOWN_VERSIONS`)."""

    name = "vllm"
    label = "vLLM"
    mtp_feed = vllm_mtp.FED_STATE           # what vLLM 0.32.0 hands each MTP family's head (vllm_mtp's docstring)
    mtp_steps_source = vllm_mtp.STEPS_SOURCE   # how it runs more draft steps than the head has layers

    @classmethod
    def supported(cls) -> str:
        return f"vLLM {rules.known_versions_text()}"

    @classmethod
    def version_refusal(cls, version: str, where: str) -> Optional[str]:
        """vLLM's rules are read per release: another is refused."""
        return None if rules.is_known(version) else f"is vLLM {version} (GET /version), whose rules this tool does not know"

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
            except (SGLangError, AttributeError, TypeError):
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

    def rank_capture_dir(self, hooks_ranks_dir: Optional[Path], run_dir: Path, name: str) -> Optional[Path]:
        """``run_dir/capture/<name>`` (a new folder): the worker extension writes every TP rank there."""
        path, k = Path(run_dir) / "capture" / name, 2
        while path.exists():
            path, k = Path(run_dir) / "capture" / f"{name}-{k}", k + 1
        return path

    def rules(self, version: Optional[str]) -> PlanRules:
        """vLLM's id rules (:class:`VLLMRules`)."""
        from .vllm_rules import VLLMRules  # lazy: torch (measure detects the engine without it)
        return VLLMRules(version)

    def loader_rules(self, version: Optional[str]) -> LoaderRules:
        """vLLM's draft loader (:class:`VLLMLoaderRules`)."""
        from .vllm_rules import VLLMLoaderRules  # lazy: torch (measure detects the engine without it)
        return VLLMLoaderRules(version)

    def every_layer_source(self, client: VLLMClient, hooks_layers_dir: Optional[Path]) -> Optional[str]:
        """The worker extension's forward hooks record ``embedding`` and every ``out(L)`` of the prefill, when the
        server runs the extension."""
        return ("the server's own every-layer capture (the worker extension's forward hooks, TP rank 0)"
                if client.describe() else None)

    def capture_every_layer(self, client: VLLMClient, prompts: Sequence[Any], out_dir: str | Path, *, name: str,
                            num_layers: int, hooks_layers_dir: Optional[Path] = None) -> Path:
        """A reference dump ``out_dir/name`` from the worker extension's every-layer capture of each prompt's
        prefill (the served dump it records on the way is dropped)."""
        out_dir = Path(out_dir)
        tmp = Path(tempfile.mkdtemp(prefix=".e3f-vllm-layers-", dir=out_dir))
        try:
            self.capture_served(client, prompts, tmp, name="served", layers=True)
            (tmp / "served-layers").rename(out_dir / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out_dir / name

    def start_variant(self, restart: dict, *, log_path: Path, budget: Any, draft: Optional[Path | str] = None,
                      keep_draft: bool = True, flags: Optional[dict] = None, capture_dir: Optional[Path] = None,
                      api_key: Optional[str] = None, port: int | str | None = None,
                      what: str = "the restarted server", env: Optional[dict] = None) -> ServerProcess:
        """A copy of a vLLM server with another draft, without it, or with other flags. ``flags``: vLLM launch flags
        (value None: a switch such as ``--no-enable-prefix-caching``) and ``speculative_config.<field>`` entries
        merged into ``--speculative-config`` (``num_speculative_tokens``, ``draft_sample_method``, ...). An embedded
        server (``{"kind": "embedded", "launch": ...}``, ``launch.engine`` vllm) restarts through
        :func:`helpers.engines.vllm_server.start`; a launch command (``{"kind": "command", "argv"}``) gets
        ``--host 127.0.0.1``, the chosen port, and its ``--speculative-config`` JSON rewritten."""
        flags = dict(flags or {})
        spec = {k.split(".", 1)[1]: v for k, v in flags.items() if k.startswith("speculative_config.")}
        other = {k: v for k, v in flags.items() if not k.startswith("speculative_config.")}
        if restart["kind"] == "embedded":
            launch = dict(restart["launch"])
            k = int(spec.pop("num_speculative_tokens", launch.get("num_speculative_tokens") or 3))
            extra = set_flags(list(launch.get("extra_args") or []), other) if other else \
                list(launch.get("extra_args") or [])
            use_draft = (draft or launch.get("draft")) if keep_draft else None
            return vllm_server.start(launch["target"], use_draft, tp=int(launch.get("tp") or 1),
                                     num_speculative_tokens=k, port=port, dtype=launch.get("dtype") or "float32",
                                     extra_args=extra, api_key=api_key, log_path=log_path, timeout=1800.0,
                                     budget=budget, speculative={**dict(launch.get("speculative") or {}), **spec},
                                     what=what, env=dict(env) if env else None, python=launch.get("python"))
        argv = relaunch_command(list(restart["argv"]), draft=draft, keep_draft=keep_draft, flags=other, spec=spec,
                                port=pick_port(port, what="--port"))
        return ServerProcess.launch_healthy(argv, f"http://127.0.0.1:{argv[argv.index('--port') + 1]}",
                                            log_path=log_path, api_key=api_key, what=what, budget=budget,
                                            env={**vllm_server.server_env(1), **dict(env or {})})

    def toggles(self) -> tuple[Toggle, ...]:
        """vLLM 0.32.0's toggles (:data:`TOGGLES`)."""
        from .vllm_rules import TOGGLES  # lazy: torch (measure detects the engine without it)
        return TOGGLES

    def capture_caveats(self, info: dict, architectures: Optional[Sequence[str]], model_type: Optional[str]
                        ) -> list[str]:
        """None known: the capture path read and checked here is vLLM 0.32.0's Llama target on the CPU backend
        (``llama.py::LlamaModel.forward``, env/vllm/README.md); SGLang's DeepSeek-family caveats do not apply."""
        return []

    def sampling_rule(self, info: dict) -> str:
        """:func:`helpers.engines.vllm_answers.sampling_rule` of this server's ``info``."""
        return sampling_rule(info)

    def cli_refusal(self, args: Any) -> Optional[str]:
        """SGLang's options (hooks, faults, capture hooks, algorithm, topk, draft tokens, the head_dim-16 reference
        draft) do not apply; a target is required (vLLM's CPU attention refuses the reference target's head_dim
        16)."""
        bad = [f for f, v in (("--forward-hooks", args.forward_hooks), ("--faults", args.faults),
                              ("--capture-ranks", args.capture_ranks), ("--capture-layers", args.capture_layers),
                              ("--trace-draft", getattr(args, "trace_draft", None)),
                              ("--algorithm", args.algorithm != ("NEXTN" if getattr(args, "nextn", 0) else "EAGLE3")),
                              ("--topk", args.topk != 1), ("--draft-tokens", args.draft_tokens is not None),
                              ("--reference-draft", args.reference_draft)) if v]
        if bad:
            return f"{', '.join(bad)} apply to SGLang only (vLLM captures through its worker extension)"
        if args.target is None:
            return "--target is required (vLLM's CPU attention refuses the reference target's head_dim 16)"
        return None

    def start_from_cli(self, args: Any, draft: Optional[str], extra: list[str]) -> tuple[ServerProcess, dict]:
        """The embedded vLLM server (:func:`helpers.engines.vllm_server.start`, ``--steps`` =
        ``num_speculative_tokens``; ``--vllm-venv``: another release's venv, kept in the launch for restarts;
        ``--nextn``: the target's own MTP head, ``method: mtp``, ``vllm_mtp``)."""
        return vllm_server.start_from_cli(args, draft, extra)

    def chunked_prefill_flags(self, tokens: int) -> Optional[dict]:
        """``--enable-chunked-prefill --max-num-batched-tokens N --max-num-seqs 1``: a step schedules at most N tokens
        and a longer prompt is prefilled in chunks of the budget left (``config/scheduler.py::SchedulerConfig``,
        ``v1/core/sched/scheduler.py::Scheduler.schedule``); ``long_prefill_token_threshold`` is not applied to a
        request alone in the batch, as the probe's are. N >= ``max_num_seqs`` is required (``SchedulerConfig``'s
        check): one sequence, the probe sends one request at a time."""
        return {"--enable-chunked-prefill": None, "--max-num-batched-tokens": str(int(tokens)), "--max-num-seqs": "1"}

    def oracle_flags(self) -> Optional[dict]:
        """``speculative_config.method: draft_model`` (the restart gives the target as ``model``): vLLM 0.32.0's
        ``v1/spec_decode/draft_model.py::DraftModelProposer`` runs a model of the target's vocabulary as a separate
        draft with its own KV (``v1/worker/cpu_model_runner.py::CPUModelRunner.initialize_kv_cache``), verified by the
        same rejection sampler as an EAGLE-3 draft: the closest counterpart of SGLang's STANDALONE."""
        return {"speculative_config.method": "draft_model"}

    def prefix_cache_off(self, info: dict) -> Optional[str]:
        """``enable_prefix_caching`` False (``--no-enable-prefix-caching``; on by default, ``engine/arg_utils.py``)."""
        return ("the server runs without a prefix cache (--no-enable-prefix-caching): no hit to probe"
                if info.get("enable_prefix_caching") is False else None)

    def host_cache_launch(self, info: dict, *, device_tokens: int, host_tokens: int
                          ) -> tuple[Optional[dict], Optional[str]]:
        """None: vLLM 0.32.0 offloads KV to CPU memory through a KV connector (``--kv-offloading-size`` GiB,
        ``--kv-offloading-backend native|lmcache``: ``config/cache.py::CacheConfig.kv_offloading_size``), but this tool
        has not read how a copy forces the eviction and whether an answer says which prompt tokens came back from CPU
        memory (the probe's proof), so the probe ``hicache_hit`` is not built for it."""
        return None, ("the host-tier probe is not built for vLLM: its CPU KV offloading (--kv-offloading-size, "
                      "config/cache.py::CacheConfig.kv_offloading_size) was not read by this tool, nor whether an "
                      "answer says which prompt tokens came back from CPU memory")

    def prefix_hit_tokens(self, info: dict, prompt_tokens: int) -> Optional[int]:
        """A resent prompt of n tokens hits whole units of A tokens (``cache_hit_alignment_tokens``, else
        ``block_size``: 128 by default on the CPU backend, ``platforms/cpu.py::CpuPlatform.check_and_update_config``)
        up to n - 1, less one unit with an EAGLE draft (its last block is recomputed for the draft's hidden states):
        ``v1/core/single_type_kv_cache_manager.py::FullAttentionManager.find_longest_cache_hit``,
        ``v1/core/kv_cache_coordinator.py::replay_boundaries``. Measured on the embedded server (B 128): 300 and 257
        tokens hit 128, 256 hit 0. None when the worker does not report the block size."""
        unit = info.get("cache_hit_alignment_tokens") or info.get("block_size")
        if not isinstance(unit, int) or unit < 1:
            return None
        eagle = str(info.get("speculative_algorithm") or "").startswith(("EAGLE", "MTP"))
        return max(0, (int(prompt_tokens) - 1) // unit * unit - (unit if eagle else 0))

    def top_logprobs_fields(self, n: int) -> Optional[dict]:
        """``logprobs: n`` with ``return_tokens_as_token_ids`` (``choices[0].logprobs.top_logprobs`` keyed
        ``token_id:<id>``, ``entrypoints/openai/completion/serving.py::_create_completion_logprobs``), mapped to
        ``output_top_logprobs`` by :func:`helpers.engines.vllm_answers.meta_info`."""
        return {"logprobs": int(n), "return_tokens_as_token_ids": True}

    def fix_flags(self, fix: Any) -> dict:
        """A fix's ``server_args`` (the suite's vocabulary: ``--speculative-num-steps`` N, ``--speculative-algorithm``)
        as vLLM flags: ``speculative_config.num_speculative_tokens`` N (vLLM drafts a chain; a topk above 1 or a
        draft-token count other than N + 1 has no vLLM 0.32.0 counterpart and is left out, said in the fix's
        ``why``), ``speculative_config.method``; other flags as given."""
        out: dict = {}
        for k, v in (fix.server_args or {}).items():
            if k == "--speculative-num-steps":
                out["speculative_config.num_speculative_tokens"] = int(v)
            elif k == "--speculative-algorithm":
                out["speculative_config.method"] = str(v).lower()
            elif k in ("--speculative-eagle-topk", "--speculative-num-draft-tokens"):
                continue
            else:
                out[k] = None if v is None else str(v)
        return out

    def spec_config(self, client: VLLMClient, *, draft: str | Path | None = None) -> SpecConfig:
        """The effective speculative config: the worker extension's report (rank 0; ranks must agree), else
        ``/server_info`` (dev mode), else ``/metrics`` and ``/v1/models`` (pass ``draft``). Aux ids: the captured
        chunks of the ids the engine holds (``loaded.stored_aux_layer_ids``, :func:`helpers.layers.vllm.chunk_ids`),
        or computed from the draft config by the release's rules; a mismatch of either is listed in ``overrides``."""
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
            stored = [int(i) for i in r0.get("aux_layer_ids") or []]     # held as read before 0.30.0
            cfg.aux_layer_ids = list(rules.chunk_ids(stored))
            notes += [f"vLLM {version} holds the aux ids {stored} ({rules.SOURCES['aux_set']}): the draft gets the "
                      f"chunks of {cfg.aux_layer_ids} (membership, layer order)"] if stored != cfg.aux_layer_ids else []
            n_layers = r0.get("num_layers")
            cfg.tp_size, cfg.method = r0.get("tp_size"), d.get("method")
            cfg.num_speculative_tokens = d.get("num_speculative_tokens")
            cfg.draft = cfg.draft or d.get("model")
            cfg.loaded = {"draft": d, "target_class": r0.get("target_class"), "num_layers": n_layers,
                          "enforce_eager": r0.get("enforce_eager"), "stored_aux_layer_ids": stored}
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
            rv = rules.rule_version(version)
            ids, src = rules.aux_layer_ids(dcfg, int(n_layers), rv)
            cfg.rule_aux_layer_ids = list(ids)
            sources["rule_aux_layer_ids"] = f"{src} ({rules.SOURCES['aux_ids']}, vLLM {version})"
            if cfg.aux_layer_ids is None:
                cfg.aux_layer_ids = list(ids)
                sources["aux_layer_ids"] = sources["rule_aux_layer_ids"]
            elif list(ids) != cfg.aux_layer_ids:
                cfg.overrides.append(f"aux ids: the draft config gives {list(ids)} by vLLM's rules, the engine "
                                     f"captures {cfg.aux_layer_ids}")
            if msg := rules.held_mismatch(dcfg, int(n_layers), rv, (cfg.loaded or {}).get("stored_aux_layer_ids")):
                cfg.overrides.append(msg)
        elif cfg.draft is None:
            notes.append("the draft folder is unknown (vLLM reports it only in dev mode): pass --draft")
        if cfg.aux_layer_ids is not None and n_layers:
            cfg.aux_tensors = rules.captured(cfg.aux_layer_ids, int(n_layers), rules.rule_version(version))
        return cfg

    def counters(self, client: HTTPClient) -> AcceptanceCounters:
        return parse_counters(client.metrics_text())

    def watch_snapshot(self, metrics_text: str) -> dict:
        return parse_watch(metrics_text)

    def capture_served(self, client: VLLMClient, prompts: Sequence[Any], out_dir: str | Path, *,
                       name: str = "served", max_new_tokens: int = 1, records: Optional[list] = None,
                       rank_dir: str | Path | None = None, max_width: Optional[int] = None, progress: bool = False,
                       layers: bool = False, capture_dir: str | Path | None = None,
                       sampling: Optional[dict] = None) -> Path:
        """Dump what the server feeds its draft for ``prompts`` (token ids, text, training samples): the worker
        extension is armed on every rank for the capture; for each prompt the prefix cache is reset
        (``/reset_prefix_cache``) and one completion of ``max_new_tokens`` greedy tokens runs. The sample's row at
        position p is the last row rank 0's ``drafter.propose`` received for p (its ``target_hidden_states`` = the
        concatenated aux states in ascending id order; the prefill gives the prompt's rows, each verify step the rows
        of its tokens, and the last forward that covers a position always holds its final token on the final
        prefix), else the target forward's own aux rows (a position no propose call received): rows = the prompt's,
        then each generated token's but the last, as SGLang's ``meta_info.hidden_states`` lays them out
        (``first_position`` = the first position). With ``layers`` a second dump ``<name>-layers`` holds the prefill
        forward's ``embedding, out(0) .. out(n-1)`` (a reference dump). Manifest: ``engine: vllm``,
        ``engine_version``, the loaded config (``e3f_describe``), ``kind: served``.

        ``records``: when a list, one per-request row (:func:`record`) per prompt is appended.
        ``sampling``: SGLang-named sampling params (``temperature``, ``top_p``, ``top_k``, ``sampling_seed`` -> vLLM's
        ``seed``, seed + prompt index per request), greedy when None.
        ``rank_dir`` (or ``capture_dir``): keep every rank's raw capture there (``rank<r>/index.jsonl`` + files, the
        format ``helpers.capture.per_rank_dumps`` reads: one dump per TP rank); default a temporary folder, removed.

        Raises:
            helpers.errors.RequestRejected: the server lacks the worker extension / dev mode (one line, how to start
                it).
            helpers.errors.SGLangError: the server recorded no draft input for a prompt, or rows wider than
                ``max_width``.
            FileExistsError: the dump exists."""
        from ..formats.dumps import write_dump  # lazy: torch (measure detects the engine without it)
        from .vllm_capture import _assemble, _now, _send, write_layers  # lazy: torch (measure detects the engine without it)
        ranks = client.describe(required=True)
        version = client.version()
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        keep_dir = rank_dir if rank_dir is not None else capture_dir
        keep = keep_dir is not None
        cap = Path(keep_dir) if keep else Path(tempfile.mkdtemp(prefix=".e3f-vllm-capture-", dir=out_dir))
        if keep and cap.exists() and any(cap.iterdir()):
            raise BadInput("the capture folder is not empty (captures are never overwritten)", path=cap)
        try:
            sent = _send(client, prompts, cap, max_new_tokens, layers, records, sampling)
            samples, ref = _assemble(client, cap, sent, layers, max_width)
        finally:
            if not keep:
                shutil.rmtree(cap, ignore_errors=True)
        r0 = ranks[0]
        hidden, chunks = r0.get("hidden_size"), rules.chunk_ids(r0.get("aux_layer_ids") or [])  # held -> captured
        extra = {"kind": "served", "engine": "vllm", "engine_version": version,
                 "source": {"type": "vllm_worker_extension", "url": client._shown_url, "captured": _now(),
                            "tensor": "drafter.propose target_hidden_states (torch.cat of the target's aux hidden "
                                      "states, ascending ids, pre-norm residual stream in(i)), TP rank 0; the last "
                                      "row received per position",
                            "reset_prefix_cache": True, "max_new_tokens": max_new_tokens},
                 "server": client.server_info(),      # the suite's vocabulary (engine, version, draft path, ...)
                 "tp_size": r0.get("tp_size"), "hidden_size": hidden,
                 "layer_plan": {"tensors": rules.captured(chunks, r0.get("num_layers") or 0), "ids": list(chunks),
                                "convention": "vllm", "stored_ids": r0.get("aux_layer_ids")}}
        path = write_dump(out_dir / name, samples, extra)
        if layers and ref:
            write_layers(out_dir / f"{name}-layers", ref, r0, version, client)
        return path

    def continuation(self, client: VLLMClient, prompt_id: str, input_ids: Optional[Sequence[int]],
                     text: Optional[str], index: int, *, max_new_tokens: int, sampling: Optional[dict],
                     timeout_s: float) -> Continuation:
        """``POST /v1/completions`` with ``return_token_ids`` (prompt and generated ids), ``ignore_eos``, sampling of
        :func:`helpers.engines.vllm_capture.vllm_sampling` (``sampling_seed`` + ``index`` -> ``seed``: vLLM 0.32.0
        gives a seeded request its own generator, ``vllm/v1/worker/gpu_input_batch.py::InputBatch.add_request``
        ``generators``, whatever else shares its batch).

        Raises: :class:`helpers.errors.SGLangError` when the answer has fewer than ``max_new_tokens`` tokens or no
        prompt ids."""
        from .vllm_capture import _answer_ids, vllm_sampling  # lazy: torch (measure detects the engine without it)
        temperature, extra = vllm_sampling(sampling, index)
        ans = client.complete(input_ids if input_ids is not None else (text or ""), max_tokens=max_new_tokens,
                              temperature=temperature, extra=extra, timeout=timeout_s)
        prompt, out = _answer_ids(ans)
        prompt = prompt or (list(input_ids) if input_ids is not None else None)
        if not prompt or len(out) != int(max_new_tokens):
            raise SGLangError(f"POST {client._shown_url}/v1/completions ({prompt_id}): expected the prompt's token ids "
                              f"and {max_new_tokens} generated tokens, got {len(prompt or [])} and {len(out)}",
                              endpoint="/v1/completions")
        return Continuation(prompt_id, tuple(int(t) for t in prompt), tuple(int(t) for t in out))

    def context_rule(self, client: VLLMClient) -> Optional[ContextRule]:
        """vLLM 0.32.0 cuts ``max_tokens`` to ``max_model_len`` - the prompt's tokens
        (``vllm/entrypoints/serve/utils/api_utils.py::get_max_tokens``) and refuses a prompt longer than
        ``max_model_len`` (the same function, and ``vllm/renderers/params.py::TokenizeParams._token_len_check``); a
        prompt of exactly ``max_model_len`` tokens is cut to ``max_tokens`` 0, which ``vllm/sampling_params.py::
        SamplingParams._verify_args`` refuses ("max_tokens must be at least 1"), so the longest prompt is
        ``max_model_len - 1``; no slot is reserved. The context length: ``/v1/models`` ``max_model_len``."""
        ctx = client.server_info().get("context_length")
        if not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 2:
            return None
        return ContextRule(tokens=ctx, reserved=0, max_prompt=ctx - 1, clamps=True,
                           source="vllm/entrypoints/serve/utils/api_utils.py::get_max_tokens",
                           no_room_source="vllm/sampling_params.py::SamplingParams._verify_args, 'max_tokens must "
                                          "be at least 1' once max_tokens is cut to 0,")

    def sampled_verify_refusal(self, info: dict) -> Optional[str]:
        """A ``draft_sample_method`` other than greedy (the draft samples its proposals) or a
        ``rejection_sample_method`` other than standard (``vllm/config/speculative.py::SpeculativeConfig``)."""
        dsm = info.get("draft_sample_method")
        if dsm not in (None, "greedy"):
            return (f"the server's draft_sample_method is {dsm!r}: the draft samples its proposals "
                    "(vllm/config/speculative.py::SpeculativeConfig.draft_sample_method); the offline chain proposes "
                    "argmax")
        rsm = info.get("rejection_sample_method")
        if rsm not in (None, "standard"):
            return (f"the server's rejection_sample_method is {rsm!r}, not token-by-token rejection sampling "
                    "(vllm/config/speculative.py::SpeculativeConfig.rejection_sample_method): acceptance is not "
                    "decided by the emitted token alone")
        return None

    def verify_sampling_fault(self, info: dict) -> Optional[dict]:
        """:func:`helpers.engines.vllm_answers.verify_sampling_fault` of this server's ``info``."""
        return verify_sampling_fault(info)

    def trace_unavailable(self, client: VLLMClient) -> Optional[str]:
        """None when the server runs the tool's worker extension (its ``drafter.propose`` wrapper records what the
        draft proposed: :mod:`helpers.engines.vllm_worker`), else how to start it."""
        try:
            client.describe(required=True)
        except (RequestRejected, SGLangError) as exc:
            return f"the draft step trace needs the tool's worker extension: {str(exc).splitlines()[0]}"
        return None

    def trace_requests(self, client: VLLMClient, prompts: Sequence[Any], *, max_new_tokens: int, tag: str,
                       folder: Path) -> tuple[list, list[dict]]:
        """:meth:`EngineAdapter.trace_requests` on vLLM (:func:`helpers.engines.vllm_capture.traced_capture`: one
        capture's served states and its ``drafter.propose`` records: proposals, not vLLM's internal positions)."""
        from .vllm_capture import traced_capture  # lazy: torch
        return traced_capture(self, client, prompts, max_new_tokens=max_new_tokens, folder=folder)




