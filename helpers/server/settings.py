"""Speculative settings in one shape (:class:`SpecSettings`), what a server was asked for vs what it runs with,
and SGLang's silent overrides.
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Any, ClassVar, Literal, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

from ..errors import BadInput
from ..layers.sglang import eagle3_draft_classes, parse_version
from ..redaction import is_secret_key


class SpecSettings(BaseModel):
    """Speculative settings, the one shape used everywhere (what a server runs with, what a launch asks for,
    a case or fixes file's ``spec:``). None: not set / not reported.

    ``algorithm`` is ``EAGLE3`` (aux hidden states, fc over the chunks) or ``EAGLE`` (last hidden state only;
    with an EAGLE-3 draft this is the ``fc_bypassed`` fault); ``num_steps`` draft steps, ``topk`` branching,
    ``num_draft_tokens`` tokens per verify step (SGLang forces ``num_steps + 1`` when ``topk == 1``:
    ``sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family``).
    """

    model_config = ConfigDict(extra="forbid")
    algorithm: Optional[str] = None
    draft_model_path: Optional[str] = None
    num_steps: Optional[int] = Field(None, ge=1)
    topk: Optional[int] = Field(None, ge=1)
    num_draft_tokens: Optional[int] = Field(None, ge=1)
    max_running_requests: Optional[int] = Field(None, ge=1)
    adaptive: Optional[bool] = None

    #: what the embedded server launches with when a field is not given
    LAUNCH_DEFAULTS: ClassVar[dict] = {"algorithm": "EAGLE3", "num_steps": 3, "topk": 1, "num_draft_tokens": 4}

    def with_launch_defaults(self) -> "SpecSettings":
        """A copy with unset ``algorithm`` / ``num_steps`` / ``topk`` / ``num_draft_tokens`` filled from
        :attr:`LAUNCH_DEFAULTS` (EAGLE3, 3, 1, 4)."""
        return self.model_copy(update={k: v for k, v in self.LAUNCH_DEFAULTS.items() if getattr(self, k) is None})

    def merged(self, other: "SpecSettings | dict | None") -> "SpecSettings":
        """A copy with the fields ``other`` sets (not None) taking precedence."""
        if other is None:
            return self.model_copy()
        o = other if isinstance(other, SpecSettings) else SpecSettings(**other)
        return self.model_copy(update={k: v for k, v in o.model_dump().items() if v is not None})

    def args(self) -> list[str]:
        """``--speculative-*`` flags for the fields that are set."""
        flags = {"algorithm": "--speculative-algorithm", "num_steps": "--speculative-num-steps",
                 "topk": "--speculative-eagle-topk", "num_draft_tokens": "--speculative-num-draft-tokens"}
        out: list[str] = []
        for k, flag in flags.items():
            v = getattr(self, k)
            if v is not None:
                out += [flag, str(v)]
        return out


class Override(BaseModel):
    """A setting SGLang changed, or filled in, differently from what was asked.

    ``kind``: ``forced`` (a rule replaced an explicit value), ``auto_chosen`` (unset, SGLang picked
    it), ``default_forced`` (unset, a speculative rule set it), ``mismatch`` (differs, no known
    rule), ``algorithm`` (algorithm does not match the draft). ``finding`` names the diagnosis
    finding kind where one exists (DESIGN.md vocabulary). ``source``: the SGLang code that does it.
    """

    field: str
    requested: Any = None
    effective: Any = None
    kind: Literal["forced", "auto_chosen", "default_forced", "mismatch", "algorithm"]
    finding: Optional[str] = None
    message: str
    source: str = ""


class EffectiveSpecConfig(BaseModel):
    """What :meth:`SGLangClient.effective_spec_config` returns.

    ``effective``: the speculative settings the server runs with (``/server_info``, i.e. after
    SGLang's resolution); ``requested``: what was asked (from the argument, else the server's own
    ``launch_command``, else nothing: ``requested_from``); ``overrides``: see :class:`Override`.
    ``draft_positions``: the most draft tokens one verify step can accept (``num_steps``: the
    chain length for topk 1, the tree depth for topk > 1) = per-position curve length.
    """

    effective: SpecSettings
    requested: SpecSettings
    requested_from: Literal["argument", "launch_command", "none"]
    overrides: list[Override] = Field(default_factory=list)
    target_architectures: Optional[list[str]] = None
    draft_architectures: Optional[list[str]] = None
    sglang_version: Optional[str] = None
    tp_size: Optional[int] = None
    dp_size: Optional[int] = None
    enable_return_hidden_states: Optional[bool] = None
    return_hidden_states_mode: Optional[str] = None
    enable_metrics: Optional[bool] = None
    notes: list[str] = Field(default_factory=list)

    @property
    def spec_enabled(self) -> bool:
        return bool(self.effective.algorithm)

    @property
    def draft_positions(self) -> Optional[int]:
        return self.effective.num_steps if self.spec_enabled else None

    def override_fields(self) -> list[str]:
        return [o.field for o in self.overrides]


#: SGLang flag aliases (``sglang/srt/arg_groups/fields/{spec,model,parallel}.py``).
FLAG_ALIASES = {
    "speculative_draft_model": "speculative_draft_model_path",
    "model": "model_path",
    "tensor_parallel_size": "tp_size",
    "data_parallel_size": "dp_size",
    "pipeline_parallel_size": "pp_size",
}


#: Short names accepted in a mapping (``SpecSettings`` fields and friends).
SHORT_NAMES = {
    "algorithm": "speculative_algorithm",
    "draft": "speculative_draft_model_path",
    "draft_model_path": "speculative_draft_model_path",
    "num_steps": "speculative_num_steps",
    "steps": "speculative_num_steps",
    "topk": "speculative_eagle_topk",
    "eagle_topk": "speculative_eagle_topk",
    "num_draft_tokens": "speculative_num_draft_tokens",
    "draft_tokens": "speculative_num_draft_tokens",
    "adaptive": "speculative_adaptive",
    "tp": "tp_size",
    "target": "model_path",
}


_INT_FIELDS = {"speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
               "max_running_requests", "tp_size", "dp_size", "pp_size"}


_BOOL_FLAGS = {"speculative_adaptive", "enable_return_hidden_states", "enable_metrics"}


def default_draft_tokens(steps: int, topk: int) -> int:
    """The draft-token count this tool uses when none is given (``server start``, ``simulate``): ``steps + 1`` for a
    chain (topk 1: what SGLang runs whatever is asked, ``sglang/srt/arg_groups/speculative_hook.py::
    _handle_eagle_family``), else ``2 x steps`` (at least the ``steps + 1`` a tree needs: SGLang 0.5.23 fails on fewer
    at the first verify step, ``sglang/srt/speculative/eagle_worker_common.py::_compact_accept_to_front``)."""
    return steps + 1 if topk == 1 else 2 * steps


def _field_name(name: str) -> str:
    n = name.lstrip("-").replace("-", "_")
    n = FLAG_ALIASES.get(n, n)
    return SHORT_NAMES.get(n, n)


def parse_launch_args(launch: str | Sequence[str] | Mapping[str, Any] | Any) -> dict[str, Any]:
    """Requested ``ServerArgs`` values from a launch command, argv, mapping or dataclass.

    * command string / argv: ``python -m sglang.launch_server --speculative-num-steps 3 ...``
      (``--flag value`` and ``--flag=value``; store-true flags become True). Tokens before the
      first flag (interpreter, module) are ignored.
    * mapping: ServerArgs names (``speculative_num_steps``), flags (``--speculative-num-steps``)
      or short names (``num_steps``, ``topk``, ``num_draft_tokens``, ``algorithm``, ``draft``,
      ``tp``); a nested ``spec`` mapping (as in a fixes file) is merged.
    * a dataclass (e.g. :class:`helpers.server.settings.SpecSettings`) is read as a mapping.

    Returns ``{ServerArgs field: value}`` with ints for the speculative counts. Secrets are not
    returned (:func:`is_secret_key`).
    """

    if isinstance(launch, BaseModel):
        launch = launch.model_dump(exclude_none=True)
    if dataclasses.is_dataclass(launch) and not isinstance(launch, type):
        launch = dataclasses.asdict(launch)
    out: dict[str, Any] = {}
    if isinstance(launch, Mapping):
        for k, v in launch.items():
            if k == "spec" and isinstance(v, Mapping):
                out.update(parse_launch_args(v))
                continue
            if k == "spec" and (dataclasses.is_dataclass(v) or isinstance(v, BaseModel)):
                out.update(parse_launch_args(v))
                continue
            out[_field_name(str(k))] = v
    else:
        argv = shlex.split(launch) if isinstance(launch, str) else [str(a) for a in launch]
        i = 0
        while i < len(argv):
            a = argv[i]
            if not a.startswith("--"):
                i += 1
                continue
            if "=" in a:
                name, value = a.split("=", 1)
                out[_field_name(name)] = value
                i += 1
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[_field_name(a)] = argv[i + 1]
                i += 2
            else:
                out[_field_name(a)] = True
                i += 1
    for k in list(out):
        if is_secret_key(k):
            del out[k]
        elif k in _INT_FIELDS and out[k] is not None and not isinstance(out[k], bool):
            try:
                out[k] = int(out[k])
            except (TypeError, ValueError):
                pass
        elif k in _BOOL_FLAGS and isinstance(out[k], str):
            out[k] = out[k].lower() in ("1", "true", "yes")
    if isinstance(out.get("speculative_algorithm"), str):
        out["speculative_algorithm"] = out["speculative_algorithm"].upper()
    return out


def spec_settings(args: Mapping[str, Any]) -> SpecSettings:
    """:class:`SpecSettings` from ServerArgs-named values (``/server_info`` or parsed launch)."""
    algo = args.get("speculative_algorithm")
    return SpecSettings(
        algorithm=str(algo).upper() if algo else None,
        draft_model_path=(str(args["speculative_draft_model_path"])
                          if args.get("speculative_draft_model_path") else None),
        num_steps=args.get("speculative_num_steps"),
        topk=args.get("speculative_eagle_topk"),
        num_draft_tokens=args.get("speculative_num_draft_tokens"),
        max_running_requests=args.get("max_running_requests"),
        adaptive=args.get("speculative_adaptive"),
    )


_HOOK = "sglang/srt/arg_groups/speculative_hook.py"


#: ``_auto_choose_speculative_params``: (steps, topk, draft tokens) by target architecture.
AUTO_PARAMS_BY_ARCH = {
    "LlamaForCausalLM": (5, 4, 8),
    "Grok1ForCausalLM": (5, 4, 8),
    "Grok1VForCausalLM": (5, 4, 8),
}


AUTO_PARAMS_DEFAULT = (3, 1, 4)  # DeepSeek/GptOss/GLM/Bailing/Mistral-Large3/MiMo, STANDALONE, rest


#: Algorithms handled by ``_handle_eagle_family`` (NEXTN resolves to EAGLE).
EAGLE_FAMILY = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE")


def auto_spec_params(target_arch: Optional[str], algorithm: Optional[str]) -> tuple[int, int, int]:
    """(num_steps, topk, num_draft_tokens) SGLang picks when all three are unset."""
    if (algorithm or "").upper() == "STANDALONE":
        return AUTO_PARAMS_DEFAULT
    return AUTO_PARAMS_BY_ARCH.get(target_arch or "", AUTO_PARAMS_DEFAULT)


def detect_overrides(requested: Mapping[str, Any], effective: Mapping[str, Any], *,
                     target_arch: Optional[str] = None,
                     draft_archs: Optional[Sequence[str]] = None) -> list[Override]:
    """Compare requested with effective ``ServerArgs`` values; name every silent change.

    Args:
        requested: ServerArgs-named values that were asked for (:func:`parse_launch_args`); a
            missing key means "not given on the command line".
        effective: the server's resolved values (``/server_info``).
        target_arch: target ``architectures[0]`` (``/model_info``), for the auto-choose table.
        draft_archs: the draft's ``architectures`` when known (for the EAGLE vs EAGLE-3 check).

    Rules (``sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family``):

    1. ``max_running_requests`` unset + speculative decoding -> forced to 48.
    2. steps, topk, draft tokens all unset -> ``_auto_choose_speculative_params``
       (``LlamaForCausalLM``/Grok: (5, 4, 8); others (3, 1, 4)).
    3. ``topk == 1`` and ``num_draft_tokens != num_steps + 1`` -> ``num_draft_tokens = steps + 1``
       (only a warning in the server log). Finding ``num_draft_tokens_overridden``.
    4. algorithm ``EAGLE`` (or NEXTN) with an EAGLE-3 draft: the draft gets the last hidden state
       instead of the 3 aux chunks (finding ``fc_bypassed``); ``EAGLE3`` with a non-EAGLE-3 draft.
    5. any other requested speculative value that differs: ``mismatch``.
    """
    out: list[Override] = []
    algo = (effective.get("speculative_algorithm") or "")
    algo = str(algo).upper() if algo else ""
    if not algo:
        req_algo = requested.get("speculative_algorithm")
        if req_algo:
            out.append(Override(field="speculative_algorithm", requested=req_algo, effective=None,
                                kind="mismatch", message=(
                                    f"speculative decoding was requested ({req_algo}) but the server "
                                    "reports none")))
        return out
    handled: set[str] = set()
    eagle_family = algo in EAGLE_FAMILY

    # 1. max_running_requests
    eff_mrr = effective.get("max_running_requests")
    if eagle_family and requested.get("max_running_requests") is None and eff_mrr == 48:
        out.append(Override(
            field="max_running_requests", requested=None, effective=48, kind="default_forced",
            message="max_running_requests was not set; SGLang set it to 48 for speculative decoding "
                    "(pass --max-running-requests to choose)",
            source=f"{_HOOK}::_handle_eagle_family"))
        handled.add("max_running_requests")

    # 2. auto-chosen steps / topk / draft tokens
    steps_req = requested.get("speculative_num_steps")
    eff_steps = effective.get("speculative_num_steps")
    eff_topk = effective.get("speculative_eagle_topk")
    eff_ndt = effective.get("speculative_num_draft_tokens")
    if eagle_family and steps_req is None and not effective.get("speculative_adaptive"):
        auto = auto_spec_params(target_arch, algo)
        names = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
        for name, value in zip(names, (eff_steps, eff_topk, eff_ndt)):
            out.append(Override(
                field=name, requested=requested.get(name), effective=value, kind="auto_chosen",
                message=(f"{name} was not set; SGLang auto-chose {value} "
                         f"(table value for {target_arch or 'this architecture'}: "
                         f"{dict(zip(names, auto))[name]})"),
                source=f"{_HOOK}::_auto_choose_speculative_params"))
            handled.add(name)

    # 3. num_draft_tokens forced to steps + 1 for topk 1
    ndt_req = requested.get("speculative_num_draft_tokens")
    if (eagle_family and ndt_req is not None and eff_topk == 1 and eff_steps is not None
            and ndt_req != eff_ndt and eff_ndt == eff_steps + 1):
        out.append(Override(
            field="speculative_num_draft_tokens", requested=ndt_req, effective=eff_ndt, kind="forced",
            finding="num_draft_tokens_overridden",
            message=(f"--speculative-num-draft-tokens {ndt_req} was replaced by num_steps + 1 = "
                     f"{eff_ndt} because topk == 1 (logged only as a warning: 'speculative_num_draft_"
                     "tokens is adjusted to speculative_num_steps + 1 when speculative_eagle_topk == 1')"),
            source=f"{_HOOK}::_handle_eagle_family"))
        handled.add("speculative_num_draft_tokens")

    # 4. algorithm vs draft architecture
    if draft_archs:
        is_e3 = any(a in eagle3_draft_classes() for a in draft_archs)
        if is_e3 and algo in ("EAGLE", "NEXTN"):
            out.append(Override(
                field="speculative_algorithm", requested=requested.get("speculative_algorithm"),
                effective=algo, kind="algorithm", finding="fc_bypassed",
                message=(f"algorithm {algo} with an EAGLE-3 draft {list(draft_archs)}: the target "
                         "does not capture aux hidden states, so the draft's fc over 3 chunks is "
                         "bypassed (it gets the last hidden state); use --speculative-algorithm EAGLE3"),
                source="sglang/srt/model_executor/model_runner_components/spec_aux_hidden_state.py"))
            handled.add("speculative_algorithm")
        elif not is_e3 and algo == "EAGLE3":
            out.append(Override(
                field="speculative_algorithm", requested=requested.get("speculative_algorithm"),
                effective=algo, kind="algorithm",
                message=f"algorithm EAGLE3 with a draft of architectures {list(draft_archs)} "
                        "(not an EAGLE-3 draft)",
                source="sglang/srt/models/llama_eagle3.py"))
            handled.add("speculative_algorithm")

    # 5. anything else that differs
    for name in ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
                 "speculative_num_draft_tokens", "max_running_requests", "tp_size", "dp_size"):
        if name in handled or name not in requested or requested[name] is None:
            continue
        req, eff = requested[name], effective.get(name)
        if name == "speculative_algorithm" and str(req).upper() == "NEXTN" and eff == "EAGLE":
            continue  # documented alias
        if req != eff:
            out.append(Override(field=name, requested=req, effective=eff, kind="mismatch",
                                message=f"{name}: requested {req!r}, server runs {eff!r}"))
    return out


_SPEC_KEYS = ("speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk",
              "speculative_num_draft_tokens", "tp_size", "speculative_draft_model_path", "model_path")


class ServerSettings(SpecSettings):
    """A server's effective speculative settings (``/server_info``, after SGLang's auto-adjustment: the
    :class:`SpecSettings` fields) plus its TP size, SGLang version and, when known, the values requested at
    launch (``requested``: ServerArgs names; absent = not passed)."""

    tp_size: Optional[int] = None
    version: Optional[str] = None
    requested: dict = Field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Optional[dict], *, source: str = "server settings") -> "ServerSettings":
        """Build from a ``/server_info`` dict or a dump manifest's ``server`` block.

        Accepted shapes: flat ServerArgs keys; ``{"effective": {...}, "requested": {...}}``; ``version`` or
        ``sglang_version``. Unknown keys are ignored. Without a ``requested`` block, a flat ``/server_info`` that
        carries SGLang's own ``launch_command`` (the argv as typed, SGLang >= 0.5.2x) gives the requested values
        (:func:`parse_launch_args`, as :meth:`helpers.server.client.SGLangClient.effective_spec_config` reads it),
        so a silent override such as ``num_draft_tokens_overridden`` is seen from ``/server_info`` alone.

        Raises:
            BadInput: ``d`` is not an object or a numeric field is not an integer (names ``source`` and the key).
        """

        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise BadInput(f"expected an object, got {type(d).__name__}", path=source, field="server")
        eff = d.get("effective") if isinstance(d.get("effective"), dict) else d
        req = d.get("requested") if isinstance(d.get("requested"), dict) else {}
        if not req and eff is d and isinstance(d.get("launch_command"), (str, list)):
            try:
                req = parse_launch_args(d["launch_command"])
            except ValueError:        # an unclosed quote: nothing is known of what was asked
                req = {}
            req = {k: v for k, v in req.items()          # a count typed as no integer is not known to be asked
                   if k not in _INT_FIELDS or (isinstance(v, int) and not isinstance(v, bool))}

        def num(src: dict, k: str) -> Optional[int]:
            v = src.get(k)
            if v is None:
                return None
            if isinstance(v, bool) or not isinstance(v, int):
                raise BadInput(f"expected an integer, got {v!r}", path=source, field=k)
            return v

        algo = eff.get("speculative_algorithm")
        return cls(algorithm=str(algo).upper() if algo else None, num_steps=num(eff, "speculative_num_steps"),
                   topk=num(eff, "speculative_eagle_topk"),
                   num_draft_tokens=num(eff, "speculative_num_draft_tokens"), tp_size=num(eff, "tp_size"),
                   version=d.get("version") or d.get("sglang_version") or eff.get("version"),
                   requested={k: req.get(k) for k in _SPEC_KEYS if k in req})

    @property
    def parsed_version(self) -> Optional[tuple[int, ...]]:
        """``version`` as a tuple (``(0, 5, 23)``), None when absent or unreadable."""

        try:
            return parse_version(self.version)
        except ValueError:
            return None
