"""SGLang behind the engine seam: the existing ``helpers.server`` client and embedded server and
``helpers.capture.capture_served``, unchanged, under :class:`helpers.engines.base.EngineAdapter`'s contract.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Sequence

from prometheus_client.parser import text_string_to_metric_families

from ..acceptance.ablations import TOGGLES, Toggle
from ..capture import capture_every_layer, capture_served, server_hook_specs
from ..faults import Fault
from ..formats.configs import read_draft_config, read_target_config
from ..runfiles import loads_json
from ..server.settings import SpecSettings
from ..diagnosis.plan_rules import PlanRules
from ..draft.checks import LoaderRules
from ..hooks import ARM_FILE
from ..errors import BadInput, SGLangError
from ..layers.sglang import OLDEST_READ, TABLE_VERSION
from ..server import embedded
from ..server.client import HTTPClient, SGLangClient
from ..server.process import ServerProcess
from ..server.restart import start_variant
from .base import AcceptanceCounters, EngineAdapter, SpecConfig

#: ServerArgs fields only SGLang's /server_info carries (with a top-level "version")
SERVER_INFO_MARKERS = ("tp_size", "speculative_algorithm", "model_path")


def sglang_env() -> dict[str, str]:
    """The ``SGLANG_*`` environment variables of this launch (they change SGLang's behaviour, e.g.
    ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``), so that a restart of the server gets them too; names that look
    like secrets (``KEY``, ``TOKEN``, ``SECRET``, ``PASSWORD``) are never recorded."""
    secret = ("KEY", "TOKEN", "SECRET", "PASSWORD")
    return {k: v for k, v in os.environ.items() if k.startswith("SGLANG_") and not any(s in k for s in secret)}


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


class SGLangAdapter(EngineAdapter):
    """SGLang (id rules read from 0.5.23 back to 0.5.6; older releases are assumed to follow 0.5.6, and the plans
    say so: :mod:`helpers.layers.sglang`)."""

    name = "sglang"
    label = "SGLang"

    @classmethod
    def supported(cls) -> str:
        return f"SGLang {_v(OLDEST_READ)}-{_v(TABLE_VERSION)} (rules read; other releases assumed as the nearest)"

    @classmethod
    def probe(cls, http: HTTPClient) -> Optional[tuple[str, dict]]:
        """SGLang when ``GET /server_info`` (fallback ``/get_server_info``) answers a JSON object with a ``version``
        and ServerArgs fields (:data:`SERVER_INFO_MARKERS`)."""
        for path in ("/server_info", "/get_server_info"):
            resp = http._request("GET", path, retries=0)
            if resp.status_code != 200:
                continue
            try:
                data = http._json(resp, f"GET {path}", path)
            except SGLangError:
                return None
            if isinstance(data, dict) and isinstance(data.get("version"), str) and \
                    any(k in data for k in SERVER_INFO_MARKERS):
                return data["version"], {path: f"version {data['version']}"}
            return None
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

    def capture_served(self, client: SGLangClient, prompts: Sequence[Any], out_dir: str | Path, *,
                       name: str = "served", max_new_tokens: int = 1, records: Optional[list] = None,
                       rank_dir: str | Path | None = None, max_width: Optional[int] = None,
                       progress: bool = False) -> Path:
        """``helpers.capture.capture_served`` (``/generate`` with ``return_hidden_states``, the cache flushed before
        each prompt); ``rank_dir``: the folder of the server's per-rank capture hooks, armed while it runs
        (``helpers.hooks.ARM_FILE``)."""
        flag = Path(rank_dir) / ARM_FILE if rank_dir is not None else None
        if flag is not None:
            flag.parent.mkdir(parents=True, exist_ok=True)
            flag.write_text("armed by helpers.engines.sglang\n")
        try:
            return capture_served(client, prompts, out_dir, name=name, max_new_tokens=max_new_tokens,
                                  progress=progress, max_width=max_width, records=records)
        finally:
            if flag is not None and flag.exists():
                flag.unlink()

    def rank_capture_dir(self, hooks_ranks_dir: Optional[Path], run_dir: Path, name: str) -> Optional[Path]:
        """The folder of the server's per-rank capture hooks (``server start --capture-ranks DIR``), or None."""
        return hooks_ranks_dir

    def rules(self, version: Optional[str]) -> PlanRules:
        """SGLang's id rules of ``version`` (:class:`helpers.diagnosis.plan_rules.PlanRules`)."""
        return PlanRules(version)

    def loader_rules(self, version: Optional[str]) -> LoaderRules:
        """SGLang 0.5.23's draft loader (:class:`helpers.draft.checks.LoaderRules`)."""
        return LoaderRules(version)

    def every_layer_source(self, client: HTTPClient, hooks_layers_dir: Optional[Path]) -> Optional[str]:
        """The server's every-layer capture hooks (``server start --capture-layers DIR``), when it runs them."""
        return None if hooks_layers_dir is None else f"the server's own every-layer capture ({hooks_layers_dir})"

    def capture_every_layer(self, client: HTTPClient, prompts: Sequence[Any], out_dir: str | Path, *, name: str,
                            num_layers: int, hooks_layers_dir: Optional[Path]) -> Path:
        """``helpers.capture.capture_every_layer`` through the server's every-layer hooks."""
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

    def sampling_rule(self, info: dict) -> str:
        return ("SGLang verifies sampled tokens against the draft's proposals (tree speculative sampling, "
                "sglang/srt/speculative/eagle_worker_v2.py), and fewer match at a higher temperature")

    def cli_refusal(self, args: Any) -> Optional[str]:
        """None: every ``server start`` option applies to SGLang."""
        return None

    def start_from_cli(self, args: Any, draft: Optional[str], extra: list[str]) -> tuple[ServerProcess, dict]:
        """The embedded SGLang server with ``--forward-hooks``, ``--faults`` and the capture hooks of ``server start``
        (:func:`helpers.server.embedded.start`); ``launch`` holds the ``SGLANG_*`` environment (:func:`sglang_env`)."""
        hooks = loads_json(args.forward_hooks) if args.forward_hooks else None
        faults = [Fault(**f) for f in loads_json(args.faults)] if args.faults else []
        if faults or args.capture_layers or args.capture_ranks:
            n = read_target_config(args.target or embedded.REFERENCE_TARGET).num_hidden_layers
            hooks = (hooks or []) + (server_hook_specs(n, faults=faults, rank_capture_dir=args.capture_ranks,
                                                       layers_dir=args.capture_layers) or [])
        spec = SpecSettings(algorithm=args.algorithm, num_steps=args.steps, topk=args.topk,
                            num_draft_tokens=args.draft_tokens)
        handle = embedded.start(args.target, draft, tp=args.tp, port=args.port, spec=spec, dtype=args.dtype,
                                forward_hooks=hooks, log_path=args.log, timeout=args.timeout, extra_args=extra)
        launch = {"engine": "sglang", "target": str(Path(handle.target).resolve()),
                  "draft": None if draft is None else str(Path(draft).resolve()), "tp": args.tp,
                  "spec": spec.model_dump(mode="json") if draft is not None else None, "forward_hooks": hooks,
                  "extra_args": extra, "dtype": args.dtype, "env": sglang_env()}
        return handle, launch

    def fix_flags(self, fix: Any) -> dict:
        """The fix's ``server_args``, which are SGLang flags already."""
        return {k: str(v) for k, v in (fix.server_args or {}).items()}
