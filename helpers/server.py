"""HTTP client for a running SGLang server: probe, effective speculative config, silent overrides.

Mirrors SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``) and keeps working against older
servers (``shared/reference/sglang-facts.md`` §8):

=====================  ==========================================================================
``GET /health``        200 once a 1-token health generation came back (``health_generate``); 503
                       while starting or shutting down. No API key needed.
``GET /server_info``   every resolved ``ServerArgs`` field + ``launch_command`` (the argv as typed,
                       ``sglang/srt/utils/common.py::build_server_info``) + scheduler info +
                       ``internal_states`` (one dict per DP rank) + ``version``. Falls back to the
                       deprecated ``/get_server_info`` on servers older than #13273 (2025-11).
                       **Holds ``api_key`` / ``admin_api_key`` in clear text, and ``launch_command``
                       holds ``--api-key VALUE``**: :func:`redact` removes both before anything is
                       kept (:meth:`SGLangClient.server_info` never returns the raw answer).
``GET /model_info``    ``model_path``, ``architectures``, ... (fallback ``/get_model_info``).
``GET /metrics``       Prometheus text, only with ``--enable-metrics`` (404 otherwise); parsed with
                       ``prometheus_client.parser``.
``POST /flush_cache``  200 only when the server is idle, 400 otherwise (``flush_cache`` in
                       http_server.py -> ``Scheduler.flush_cache``): :meth:`SGLangClient.flush_cache`
                       retries until idle. Also zeroes the lifetime spec counters behind
                       ``avg_spec_accept_length``.
``POST /generate``     ``GenerateReqInput`` (``sglang/srt/managers/io_struct.py``); non-streaming
                       here, so the single answer is the final chunk and carries the spec fields.
=====================  ==========================================================================

The API key comes from ``api_key=`` or ``$SGLANG_API_KEY`` and is sent as ``Authorization: Bearer``.
It is held in a private attribute, never shown by ``repr``, and scrubbed from every error message.

Silent overrides (:meth:`SGLangClient.effective_spec_config`, rules in :func:`detect_overrides`)
mirror ``sglang/srt/arg_groups/speculative_hook.py::_handle_eagle_family`` and
``_auto_choose_speculative_params`` of 0.5.23.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import time
from pathlib import Path
from typing import Any, Iterable, Literal, Mapping, Optional, Sequence
from urllib.parse import urlsplit, urlunsplit

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class SGLangError(RuntimeError):
    """A request to the SGLang server failed. ``endpoint`` and ``status`` (HTTP code or None)."""

    def __init__(self, message: str, *, endpoint: str = "", status: Optional[int] = None):
        super().__init__(message)
        self.endpoint = endpoint
        self.status = status


class ServerUnavailable(SGLangError):
    """Could not connect (or kept getting 502/503/504) after all retries."""


class ServerTimeout(SGLangError):
    """The server accepted the connection but did not answer within the timeout."""


class AuthError(SGLangError):
    """401/403: the server runs with ``--api-key`` and the key is missing or wrong."""


class EndpointMissing(SGLangError):
    """404 on an endpoint (and on its older name, where one exists)."""


class MetricsDisabled(EndpointMissing):
    """``/metrics`` is 404: the server was started without ``--enable-metrics``."""


class RequestRejected(SGLangError):
    """The server refused the request (400/422); the message quotes its reason."""


class HiddenStatesDisabled(RequestRejected):
    """``return_hidden_states`` sent to a server started without ``--enable-return-hidden-states``."""


class CacheBusy(SGLangError):
    """``/flush_cache`` kept answering 400 (requests running) until the deadline."""


# --------------------------------------------------------------------------------------------
# Redaction
# --------------------------------------------------------------------------------------------

#: ServerArgs fields (and any dict key) whose value is a secret. ``api_key``/``admin_api_key``
#: are returned in clear text by ``/server_info`` (``dataclasses.asdict(server_args)``);
#: ``watermark_*`` SGLang already masks. Matched on the lower-cased key.
SECRET_KEY_RE = re.compile(
    r"(^|_)(api_key|admin_api_key|key|key_b|password|passwd|secret|credentials?|authorization|"
    r"(hf|access|auth|api|bearer|secret|refresh)_token|private_key|watermark_config|"
    r"watermark_key(_b)?)$")
#: Command-line flags whose value is a secret (``--api-key X`` / ``--api-key=X``).
SECRET_FLAG_RE = re.compile(
    r"^--?([A-Za-z0-9_-]*[-_])?(api[-_]key|key|password|passwd|secret|credentials?|"
    r"(hf|access|auth|api|bearer|refresh)[-_]token|watermark[-_]config|watermark[-_]key([-_]b)?)$",
    re.I)
REDACTED = "<redacted>"


def is_secret_key(name: str) -> bool:
    """True when a dict key / ServerArgs field name names a secret (see :data:`SECRET_KEY_RE`)."""
    return bool(SECRET_KEY_RE.search(str(name).lower()))


def redact_argv(argv: Sequence[str] | str) -> list[str]:
    """Replace the value of every secret flag (``--api-key X``, ``--api-key=X``) by ``<redacted>``.

    Accepts an argv list or a command string (split with :func:`shlex.split`).
    """
    args = shlex.split(argv) if isinstance(argv, str) else list(argv)
    out: list[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if a.startswith("-") and "=" in a and SECRET_FLAG_RE.match(a.split("=", 1)[0]):
            out.append(a.split("=", 1)[0] + "=" + REDACTED)
        elif a.startswith("-") and SECRET_FLAG_RE.match(a):
            out.append(a)
            hide_next = True
        else:
            out.append(a)
    return out


def redact_command(command: str) -> str:
    """A command string with secret flag values replaced (see :func:`redact_argv`)."""
    try:
        return " ".join(a if REDACTED in a else shlex.quote(a) for a in redact_argv(command))
    except ValueError:  # unbalanced quotes: fall back to a regex on the raw text
        return re.sub(r"(--?[\w-]*(?:api[-_]key|password|secret|token)[= ]+)(\S+)", r"\1" + REDACTED,
                      command, flags=re.I)


def redact(obj: Any, secrets: Iterable[str] = ()) -> Any:
    """Deep copy of ``obj`` without secrets.

    * dict keys matching :func:`is_secret_key` are dropped (their string values are also
      scrubbed from every other string, e.g. from ``launch_command``);
    * ``launch_command`` / ``command`` strings and argv lists get :func:`redact_argv`;
    * every string has each value of ``secrets`` (e.g. the client's API key) replaced by
      ``<redacted>``.
    """
    found: set[str] = {s for s in secrets if s}

    def collect(o: Any) -> None:
        if isinstance(o, Mapping):
            for k, v in o.items():
                if is_secret_key(k) and isinstance(v, str) and len(v) >= 4 and v != REDACTED:
                    found.add(v)
                else:
                    collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(obj)
    ordered = sorted(found, key=len, reverse=True)

    def scrub(s: str) -> str:
        for secret in ordered:
            s = s.replace(secret, REDACTED)
        return s

    def walk(o: Any, key: str = "") -> Any:
        if isinstance(o, Mapping):
            return {k: walk(v, str(k)) for k, v in o.items() if not is_secret_key(k)}
        if isinstance(o, (list, tuple)):
            if key in ("launch_command", "command", "argv") and all(isinstance(x, str) for x in o):
                return [scrub(x) for x in redact_argv(list(o))]
            return [walk(v) for v in o]
        if isinstance(o, str):
            if key in ("launch_command", "command"):
                o = redact_command(o)
            return scrub(o)
        return o

    return walk(obj)


def redact_url(url: str) -> str:
    """URL without ``user:password@`` and without query string (may hold tokens)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


# --------------------------------------------------------------------------------------------
# Typed parts of the responses
# --------------------------------------------------------------------------------------------

#: Older meta_info names (sglang-facts §8) -> current name in 0.5.23.
META_ALIASES = {
    "spec_accepted_drafts": "spec_num_correct_drafts",      # #23530 (2026-04), alias kept by #25014
    "spec_accept_token_num": "spec_num_correct_drafts",     # #11441 (2025-10)
    "spec_proposed_drafts": "spec_num_proposed_drafts",
    "spec_draft_token_num": "spec_num_proposed_drafts",
    "spec_accept_histogram": "spec_correct_drafts_histogram",  # #18332 (2026-02)
}


class MetaInfo(BaseModel):
    """``meta_info`` of one finished ``/generate`` answer.

    Built by ``TokenizerManager._handle_batch_output`` and, for the spec fields,
    ``TokenizerManager._calculate_spec_decoding_metrics`` (``sglang/srt/managers/tokenizer_manager.py``):
    the spec fields are set **only on the finished chunk and only when spec_verify_ct > 0**
    (a request with ``max_new_tokens=1`` never verifies and has none).

    * ``spec_verify_ct``: verify steps (target forward passes over the draft) of this request.
    * ``spec_accept_length`` = ``completion_tokens / spec_verify_ct``: tokens per verify step,
      bonus token included; the prefill-sampled first token is in the numerator too.
    * ``spec_num_correct_drafts``: draft tokens accepted; ``spec_num_proposed_drafts`` =
      ``spec_verify_ct * (speculative_num_draft_tokens - 1)`` (static server arg).
    * ``spec_correct_drafts_histogram[n]``: verify steps that accepted exactly n draft tokens
      (grown on demand, so shorter than ``num_steps + 1`` when long runs never happened).

    Older field names (:data:`META_ALIASES`) are mapped to these. Unknown fields (``hidden_states``,
    timing fields, ...) are kept as extras.
    """

    model_config = ConfigDict(extra="allow")

    id: Optional[str] = None
    finish_reason: Any = None
    prompt_tokens: Optional[int] = None
    completion_tokens: Optional[int] = None
    cached_tokens: Optional[int] = None
    e2e_latency: Optional[float] = None
    spec_verify_ct: Optional[int] = None
    spec_accept_length: Optional[float] = None
    spec_accept_rate: Optional[float] = None
    spec_num_correct_drafts: Optional[int] = None
    spec_num_proposed_drafts: Optional[int] = None
    spec_correct_drafts_histogram: Optional[list[int]] = None

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            data = dict(data)
            for old, new in META_ALIASES.items():
                if data.get(new) is None and data.get(old) is not None:
                    data[new] = data[old]
        return data

    @property
    def has_spec_fields(self) -> bool:
        """True when the answer carries a positive ``spec_verify_ct`` (see class docstring)."""
        return bool(self.spec_verify_ct)


class GenerateResult(BaseModel):
    """One ``/generate`` answer plus the client-side wall time.

    ``latency_s``: seconds from sending the request to having parsed the JSON (client view);
    ``meta_info.e2e_latency`` is the server's own view of the same request.
    ``prompt_token_ids``: only with ``return_prompt_token_ids=True``.
    ``hidden_states`` (property): ``meta_info.hidden_states`` when requested: list of length
    ``completion_tokens``; element 0 is the prompt block ``[prompt_len][W]``, the rest are ``[W]``
    rows (sglang-facts §1).
    """

    model_config = ConfigDict(extra="allow")

    text: Optional[str] = None
    output_ids: list[int] = Field(default_factory=list)
    meta_info: MetaInfo
    prompt_token_ids: Optional[list[int]] = None
    latency_s: float = float("nan")

    @property
    def hidden_states(self) -> Optional[list]:
        return (self.meta_info.model_extra or {}).get("hidden_states")


class SpecSettings(BaseModel):
    """Speculative settings as ``ServerArgs`` names them (None: not set / not reported)."""

    algorithm: Optional[str] = None
    draft_model_path: Optional[str] = None
    num_steps: Optional[int] = None
    topk: Optional[int] = None
    num_draft_tokens: Optional[int] = None
    max_running_requests: Optional[int] = None
    adaptive: Optional[bool] = None


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


# --------------------------------------------------------------------------------------------
# Requested settings: from a launch command or a ServerArgs-like mapping
# --------------------------------------------------------------------------------------------

#: SGLang flag aliases (``sglang/srt/arg_groups/fields/{spec,model,parallel}.py``).
FLAG_ALIASES = {
    "speculative_draft_model": "speculative_draft_model_path",
    "model": "model_path",
    "tensor_parallel_size": "tp_size",
    "data_parallel_size": "dp_size",
    "pipeline_parallel_size": "pp_size",
}
#: Short names accepted in a mapping (``launcher.SpecConfig`` fields and friends).
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
    * a dataclass (e.g. :class:`helpers.launcher.SpecConfig`) is read as a mapping.

    Returns ``{ServerArgs field: value}`` with ints for the speculative counts. Secrets are not
    returned (:func:`is_secret_key`).
    """
    import dataclasses

    if dataclasses.is_dataclass(launch) and not isinstance(launch, type):
        launch = dataclasses.asdict(launch)
    out: dict[str, Any] = {}
    if isinstance(launch, Mapping):
        for k, v in launch.items():
            if k == "spec" and isinstance(v, Mapping):
                out.update(parse_launch_args(v))
                continue
            if k == "spec" and dataclasses.is_dataclass(v):
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


# --------------------------------------------------------------------------------------------
# Override rules (SGLang 0.5.23, sglang/srt/arg_groups/speculative_hook.py)
# --------------------------------------------------------------------------------------------

_HOOK = "sglang/srt/arg_groups/speculative_hook.py"
#: ``_auto_choose_speculative_params``: (steps, topk, draft tokens) by target architecture.
AUTO_PARAMS_BY_ARCH = {
    "LlamaForCausalLM": (5, 4, 8),
    "Grok1ForCausalLM": (5, 4, 8),
    "Grok1VForCausalLM": (5, 4, 8),
}
AUTO_PARAMS_DEFAULT = (3, 1, 4)  # DeepSeek/GptOss/GLM/Bailing/Mistral-Large3/MiMo, STANDALONE, rest
#: Draft architectures that are EAGLE-3 drafts (``sglang/srt/models/llama_eagle3.py`` & co).
EAGLE3_DRAFT_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "KimiK25ForCausalLMEagle3",
                      "Qwen3ForCausalLMEagle3", "Eagle3Speculator")
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
        is_e3 = any(a in EAGLE3_DRAFT_ARCHS or "eagle3" in a.lower() for a in draft_archs)
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


# --------------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------------

HIDDEN_STATES_FLAG = "--enable-return-hidden-states"
_RETRY_STATUS = (502, 503, 504)


class SGLangClient:
    """Synchronous httpx client for one SGLang server (thread-safe: share it between threads).

    Args:
        url: ``http://host:port`` of the server (a trailing ``/`` is fine).
        api_key: bearer token; default ``$SGLANG_API_KEY``; None/empty: no header.
        timeout: seconds for probe requests (connect and read).
        generate_timeout: read timeout in seconds for ``/generate`` (long generations on CPU).
        retries: extra attempts after a connection error, a connect/read timeout on idempotent
            probes, or 502/503/504; waits ``backoff * 2**attempt`` seconds in between.
        transport: optional httpx transport (tests).

    Errors (all :class:`SGLangError`): :class:`ServerUnavailable`, :class:`ServerTimeout`,
    :class:`AuthError`, :class:`EndpointMissing` (:class:`MetricsDisabled`),
    :class:`RequestRejected` (:class:`HiddenStatesDisabled`), :class:`CacheBusy`. Messages name
    the endpoint and what to do; they never contain the API key.
    """

    def __init__(self, url: str, api_key: Optional[str] = None, *, timeout: float = 30.0,
                 generate_timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 transport: Optional[httpx.BaseTransport] = None):
        if not url or "://" not in url:
            raise ValueError(f"url must look like http://host:port, got {redact_url(str(url))!r}")
        self.url = url.rstrip("/")
        self._shown_url = redact_url(self.url)
        key = api_key if api_key is not None else os.environ.get("SGLANG_API_KEY")
        self._api_key: Optional[str] = key or None
        self.timeout = float(timeout)
        self.generate_timeout = float(generate_timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout,
                                  transport=transport)
        self._server_info: Optional[dict] = None
        self._model_info: Optional[dict] = None

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def has_api_key(self) -> bool:
        return self._api_key is not None

    @property
    def secrets(self) -> list[str]:
        """Values to scrub from anything written (for :func:`redact`); do not print."""
        return [self._api_key] if self._api_key else []

    def _scrub(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, REDACTED)
        return text

    def __repr__(self) -> str:
        return f"<SGLangClient {self._shown_url} api_key={'set' if self._api_key else 'none'}>"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SGLangClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, *, json_body: Any = None,
                 params: Optional[dict] = None, timeout: Optional[httpx.Timeout | float] = None,
                 idempotent: bool = True, retries: Optional[int] = None) -> httpx.Response:
        """Send with retries; return the response for 2xx/4xx; raise for transport failures.

        Retries: connection errors always (nothing reached the server), timeouts and
        502/503/504 only when ``idempotent``. 401/403 raise :class:`AuthError` here.
        """
        tries = 1 + (self.retries if retries is None else retries)
        where = f"{method} {self._shown_url}{path}"
        last: str = ""
        for attempt in range(tries):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                resp = self._http.request(method, path, json=json_body, params=params,
                                          timeout=timeout if timeout is not None else self.timeout)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = f"cannot connect ({type(exc).__name__}: {self._scrub(str(exc))})"
                continue
            except httpx.TimeoutException as exc:
                if idempotent and attempt + 1 < tries:
                    last = f"timed out ({type(exc).__name__})"
                    continue
                t = timeout if timeout is not None else self.timeout
                raise ServerTimeout(
                    f"{where}: no answer within {t} s ({type(exc).__name__}); the server may be "
                    "overloaded or the generation long: raise the timeout "
                    "(SGLangClient(timeout=..., generate_timeout=...))", endpoint=path) from None
            except httpx.TransportError as exc:
                last = f"transport error ({type(exc).__name__}: {self._scrub(str(exc))})"
                if idempotent:
                    continue
                raise ServerUnavailable(f"{where}: {last}", endpoint=path) from None
            if resp.status_code in (401, 403):
                hint = ("the API key given was refused" if self._api_key else
                        "the server was started with --api-key; pass api_key=... or set SGLANG_API_KEY")
                raise AuthError(f"{where}: HTTP {resp.status_code} ({hint})", endpoint=path,
                                status=resp.status_code)
            if resp.status_code in _RETRY_STATUS and idempotent and attempt + 1 < tries:
                last = f"HTTP {resp.status_code}"
                continue
            if resp.status_code in _RETRY_STATUS:
                raise ServerUnavailable(
                    f"{where}: HTTP {resp.status_code} after {attempt + 1} attempt(s) (503 means "
                    f"starting, shutting down or unhealthy): {self._body(resp)}",
                    endpoint=path, status=resp.status_code)
            return resp
        raise ServerUnavailable(
            f"{where}: {last} after {tries} attempt(s); is the server running and reachable "
            "(check the URL / port, and the server log)?", endpoint=path)

    def _body(self, resp: httpx.Response, limit: int = 400) -> str:
        try:
            text = resp.text
        except Exception:  # noqa: BLE001
            text = "<unreadable body>"
        text = self._scrub(text.strip())
        return text[:limit] + ("..." if len(text) > limit else "")

    def _get_json(self, paths: Sequence[str], what: str) -> dict:
        """GET the first of ``paths`` that is not 404 (newer name first); parse JSON."""
        tried = []
        for path in paths:
            resp = self._request("GET", path)
            if resp.status_code == 404:
                tried.append(path)
                continue
            if resp.status_code >= 400:
                raise RequestRejected(f"GET {self._shown_url}{path}: HTTP {resp.status_code}: "
                                      f"{self._body(resp)}", endpoint=path, status=resp.status_code)
            try:
                return resp.json()
            except json.JSONDecodeError:
                raise SGLangError(f"GET {self._shown_url}{path}: answer is not JSON: "
                                  f"{self._body(resp)}", endpoint=path) from None
        raise EndpointMissing(f"{self._shown_url}: none of {tried} exists ({what}); is this an SGLang "
                              "server?", endpoint=paths[0], status=404)

    # -- probes -----------------------------------------------------------------------------

    def health(self) -> bool:
        """``GET /health``: True on 200, False on 503 (starting / unhealthy). Raises when unreachable."""
        resp = self._request("GET", "/health", retries=0)
        return resp.status_code == 200

    def wait_healthy(self, timeout: float = 300.0, poll: float = 1.0) -> None:
        """Poll ``/health`` until 200 or ``timeout`` seconds; raise :class:`ServerUnavailable`."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                if self.health():
                    return
                last = "HTTP 503"
            except (ServerUnavailable, ServerTimeout) as exc:
                last = str(exc).split(": ", 1)[-1]
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"{self._shown_url}/health not 200 after {timeout:.0f} s "
                                        f"(last: {last})", endpoint="/health")
            time.sleep(poll)

    def server_info(self, refresh: bool = False) -> dict:
        """``/server_info`` (fallback ``/get_server_info``), **redacted** (:func:`redact`).

        Cached after the first call (the resolved ServerArgs do not change); ``refresh=True``
        fetches again (``internal_states`` do change).
        """
        if self._server_info is None or refresh:
            raw = self._get_json(["/server_info", "/get_server_info"], "server info")
            self._server_info = redact(raw, self.secrets)
        return self._server_info

    def model_info(self, refresh: bool = False) -> dict:
        """``/model_info`` (fallback ``/get_model_info``): model_path, architectures, ..."""
        if self._model_info is None or refresh:
            self._model_info = redact(self._get_json(["/model_info", "/get_model_info"],
                                                     "model info"), self.secrets)
        return self._model_info

    def version(self) -> Optional[str]:
        """SGLang version string from ``/server_info``."""
        return self.server_info().get("version")

    def metrics_text(self) -> str:
        """Raw Prometheus text of ``/metrics``; :class:`MetricsDisabled` without ``--enable-metrics``."""
        resp = self._request("GET", "/metrics")
        if resp.status_code == 404:
            raise MetricsDisabled(f"GET {self._shown_url}/metrics: 404; start the server with "
                                  "--enable-metrics", endpoint="/metrics", status=404)
        if resp.status_code >= 400:
            raise RequestRejected(f"GET {self._shown_url}/metrics: HTTP {resp.status_code}: "
                                  f"{self._body(resp)}", endpoint="/metrics", status=resp.status_code)
        return resp.text

    def metrics(self, prefix: str = "") -> "Any":
        """``/metrics`` parsed with ``prometheus_client.parser`` into a DataFrame.

        Columns: ``family``, ``type``, ``sample`` (sample name, e.g. ``..._total``), ``labels``
        (dict), ``value`` (float). ``prefix`` keeps only families whose name starts with it
        (e.g. ``"sglang:spec_"``). Names: ``sglang/srt/observability/metrics_collector.py``
        (``sglang:spec_verify_calls_total`` counter: verify steps of finished requests;
        ``sglang:spec_accept_length`` gauge: last log window only).
        """
        import pandas as pd
        from prometheus_client.parser import text_string_to_metric_families

        rows = []
        for fam in text_string_to_metric_families(self.metrics_text()):
            if prefix and not fam.name.startswith(prefix):
                continue
            for s in fam.samples:
                rows.append({"family": fam.name, "type": fam.type, "sample": s.name,
                             "labels": dict(s.labels), "value": float(s.value)})
        return pd.DataFrame(rows, columns=["family", "type", "sample", "labels", "value"])

    def metric_value(self, sample: str, **labels: str) -> Optional[float]:
        """Sum of the samples named ``sample`` whose labels include ``labels`` (None if absent)."""
        df = self.metrics()
        if df.empty:
            return None
        sel = df[df["sample"] == sample]
        if labels:
            sel = sel[sel["labels"].map(lambda d: all(d.get(k) == v for k, v in labels.items()))]
        return float(sel["value"].sum()) if len(sel) else None

    def flush_cache(self, timeout: float = 120.0, poll: float = 0.5) -> float:
        """``POST /flush_cache``, retried while the server is busy (400); returns seconds waited.

        SGLang flushes only when no request runs or waits (``Scheduler.flush_cache``), answering
        400 otherwise. A flush also clears the radix cache (so a repeated prompt gets its full
        prompt block of hidden states) and zeroes the lifetime spec counters
        (``avg_spec_accept_length`` in ``/server_info``), which this package never uses.
        Raises :class:`CacheBusy` after ``timeout`` seconds.
        """
        t0 = time.monotonic()
        while True:
            resp = self._request("POST", "/flush_cache", params={"timeout": 0})
            if resp.status_code == 200:
                return time.monotonic() - t0
            if resp.status_code == 404:
                raise EndpointMissing(f"POST {self._shown_url}/flush_cache: 404", endpoint="/flush_cache",
                                      status=404)
            if time.monotonic() - t0 > timeout:
                raise CacheBusy(f"POST {self._shown_url}/flush_cache still HTTP {resp.status_code} "
                                f"after {timeout:.0f} s (requests running?): {self._body(resp)}",
                                endpoint="/flush_cache", status=resp.status_code)
            time.sleep(poll)

    # -- generation -------------------------------------------------------------------------

    def generate(self, input_ids: Optional[Sequence[int]] = None, text: Optional[str] = None, *,
                 sampling_params: Optional[Mapping[str, Any]] = None, max_new_tokens: Optional[int] = None,
                 return_hidden_states: bool = False, return_prompt_token_ids: bool = False,
                 rid: Optional[str] = None, extra: Optional[Mapping[str, Any]] = None,
                 timeout: Optional[float] = None) -> GenerateResult:
        """``POST /generate`` (non-streaming): exactly one of ``input_ids`` / ``text``.

        ``max_new_tokens`` is a shortcut merged into ``sampling_params`` (default temperature 0).
        ``return_hidden_states`` needs the server flag ``--enable-return-hidden-states``
        (otherwise :class:`HiddenStatesDisabled`, mirroring the ValueError of
        ``TokenizerManager``). Non-streaming on purpose: the spec fields exist only on the final
        chunk (``_calculate_spec_decoding_metrics`` runs when the request finished).

        Returns :class:`GenerateResult` (``latency_s`` = client wall seconds).
        Raises :class:`RequestRejected` for 400/422 with the server's reason,
        :class:`ServerTimeout` past ``timeout`` (default ``generate_timeout``).
        """
        if (input_ids is None) == (text is None):
            raise ValueError("generate(): pass exactly one of input_ids= or text=")
        if extra and extra.get("stream"):
            raise ValueError("generate(): streaming is not supported here (the spec fields come only "
                             "with the final chunk); leave stream unset")
        sp = {"temperature": 0.0}
        sp.update(dict(sampling_params or {}))
        if max_new_tokens is not None:
            sp["max_new_tokens"] = int(max_new_tokens)
        body: dict[str, Any] = {"sampling_params": sp, "stream": False}
        if input_ids is not None:
            body["input_ids"] = [int(t) for t in input_ids]
        else:
            body["text"] = text
        if return_hidden_states:
            body["return_hidden_states"] = True
        if return_prompt_token_ids:
            body["return_prompt_token_ids"] = True
        if rid is not None:
            body["rid"] = rid
        body.update(dict(extra or {}))
        read = self.generate_timeout if timeout is None else float(timeout)
        t0 = time.perf_counter()
        resp = self._request("POST", "/generate", json_body=body, idempotent=False,
                             timeout=httpx.Timeout(self.timeout, read=read))
        if resp.status_code >= 400:
            msg = self._body(resp)
            if return_hidden_states and ("hidden states" in msg.lower() or HIDDEN_STATES_FLAG in msg):
                raise HiddenStatesDisabled(
                    f"POST {self._shown_url}/generate: the server refuses return_hidden_states "
                    f"(HTTP {resp.status_code}): restart it with {HIDDEN_STATES_FLAG} (SGLang "
                    f"0.5.2x also accepts --return-hidden-states-mode full; 'last' returns only the "
                    f"last token, too little for a capture); reference server: "
                    f"helpers.launcher.start(..., return_hidden_states=True). "
                    f"Server said: {msg}", endpoint="/generate", status=resp.status_code)
            raise RequestRejected(f"POST {self._shown_url}/generate: HTTP {resp.status_code}: {msg}",
                                  endpoint="/generate", status=resp.status_code)
        try:
            data = resp.json()
        except json.JSONDecodeError:
            raise SGLangError(f"POST {self._shown_url}/generate: answer is not JSON: {self._body(resp)}",
                              endpoint="/generate") from None
        latency = time.perf_counter() - t0
        if isinstance(data, list):  # a batch answer: only one prompt is sent here
            data = data[0]
        return GenerateResult.model_validate({**data, "latency_s": latency})

    # -- configuration ----------------------------------------------------------------------

    def effective_spec_config(self, requested: str | Sequence[str] | Mapping[str, Any] | Any = None,
                              *, draft_config: Mapping[str, Any] | os.PathLike | str | None = None
                              ) -> EffectiveSpecConfig:
        """The speculative config the server really runs, and the silent overrides SGLang made.

        Args:
            requested: what was asked for: a launch command (string or argv), a ServerArgs-like
                mapping (``{"speculative_num_draft_tokens": 6, ...}`` or short names), or a
                :class:`helpers.launcher.SpecConfig`. Default: the server's own
                ``launch_command`` from ``/server_info`` (SGLang >= 0.5.2x records the argv as
                typed); on older servers nothing is known, and only rules that need no request
                (none) can fire, which ``notes`` says.
            draft_config: the draft's ``config.json`` (mapping, file, or folder) for the
                algorithm check; default: read from ``speculative_draft_model_path`` when that
                path exists on this machine.

        Returns: :class:`EffectiveSpecConfig`; see :func:`detect_overrides` for the rules.
        """
        info = self.server_info()
        notes: list[str] = []
        if requested is not None:
            req = parse_launch_args(requested)
            source = "argument"
        elif info.get("launch_command"):
            req = parse_launch_args(info["launch_command"])
            source = "launch_command"
        else:
            req = {}
            source = "none"
            notes.append("the server does not report its launch_command (SGLang older than the "
                         "Annotated ServerArgs); pass requested= to detect overrides")
        target_archs = None
        try:
            target_archs = self.model_info().get("architectures")
        except SGLangError as exc:
            notes.append(f"model_info unavailable: {exc}")
        draft_archs = _draft_architectures(draft_config, info.get("speculative_draft_model_path"))
        if info.get("speculative_algorithm") and draft_archs is None:
            notes.append("draft config.json not readable here: the EAGLE vs EAGLE-3 check was skipped "
                         "(pass draft_config=)")
        if info.get("speculative_adaptive"):
            notes.append("adaptive speculative decoding is on: num_steps / draft tokens change at run "
                         "time, so spec_num_proposed_drafts (verify_ct x static width) is not exact")
        if info.get("speculative_eagle_topk") and info["speculative_eagle_topk"] > 1:
            notes.append("topk > 1: spec_accept_rate's denominator counts tree nodes "
                         "(num_draft_tokens - 1 per verify), not chain positions")
        overrides = detect_overrides(req, info, target_arch=(target_archs or [None])[0],
                                     draft_archs=draft_archs)
        return EffectiveSpecConfig(
            effective=spec_settings(info), requested=spec_settings(req), requested_from=source,
            overrides=overrides, target_architectures=target_archs, draft_architectures=draft_archs,
            sglang_version=info.get("version"), tp_size=info.get("tp_size"),
            dp_size=info.get("dp_size"), enable_return_hidden_states=info.get("enable_return_hidden_states"),
            return_hidden_states_mode=info.get("return_hidden_states_mode"),
            enable_metrics=info.get("enable_metrics"), notes=notes)


def _draft_architectures(draft_config: Any, draft_path: Optional[str]) -> Optional[list[str]]:
    cfg: Optional[Mapping] = None
    if isinstance(draft_config, Mapping):
        cfg = draft_config
    else:
        path = Path(draft_config) if draft_config is not None else (Path(draft_path) if draft_path else None)
        if path is not None:
            if path.is_dir():
                path = path / "config.json"
            try:
                cfg = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError):
                cfg = None
    if cfg is None:
        return None
    archs = cfg.get("architectures")
    return list(archs) if archs else None


def as_client(client_or_url: "SGLangClient | str", api_key: Optional[str] = None,
              **kwargs: Any) -> "SGLangClient":
    """Return ``client_or_url`` if it is a client, else a new :class:`SGLangClient` for the URL.

    Also accepts an object with a ``url`` attribute (``helpers.launcher.ServerHandle``).
    """
    if isinstance(client_or_url, SGLangClient):
        return client_or_url
    url = getattr(client_or_url, "url", client_or_url)
    return SGLangClient(str(url), api_key=api_key, **kwargs)
