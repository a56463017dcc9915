"""Which engine serves a URL, and which release: asked through the server's own endpoints, never guessed.

SGLang answers ``GET /server_info`` with a ``version`` and its ServerArgs (``sglang/srt/entrypoints/http_server.py``);
vLLM answers ``GET /version`` and names itself in ``GET /v1/models`` (``owned_by: "vllm"``; vLLM's ``/server_info``
exists only in dev mode and has no top-level ``version``: ``env/vllm/README.md``). A server that is neither, or a
vLLM release whose rules were not read, is bad input: one line naming what each endpoint answered and what is
supported, exit 2. A server that is SGLang by its answers but whose ``/server_info`` is malformed is a server error
naming the endpoint and the field, exit 1 (:meth:`helpers.engines.sglang.SGLangAdapter.probe` says what tells the
two apart).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..budget import Budget
from ..errors import BadInput, SGLangError, printable
from ..server.client import HTTPClient, answer_kind
from .base import EngineAdapter
from .sglang import SGLangAdapter
from .vllm import VLLMAdapter

#: every adapter, probed in this order (vLLM first: its ``/version`` answers at once, while its dev-mode
#: ``/server_info``, which the SGLang probe asks, gathers the host's environment on the first call: 10+ s)
ADAPTERS: tuple[type[EngineAdapter], ...] = (VLLMAdapter, SGLangAdapter)
BY_NAME = {a.name: a for a in ADAPTERS}


@dataclass
class Detected:
    """A detected server: ``adapter`` (an :class:`EngineAdapter` instance), ``engine`` (its name), ``version``
    (as the server reports it), ``evidence`` (endpoint -> what it answered)."""

    adapter: EngineAdapter
    engine: str
    version: str
    evidence: dict[str, Any] = field(default_factory=dict)


def supported_text() -> str:
    """``"SGLang 0.5.6-0.5.23 (...); vLLM 0.32.0"``, for messages."""
    return "; ".join(a.supported() for a in ADAPTERS)


def adapter(name: str) -> EngineAdapter:
    """The adapter named ``sglang`` or ``vllm``.

    Raises:
        BadInput: another name (field ``--engine``)."""
    if name not in BY_NAME:
        raise BadInput(f"unknown engine {name!r}; expected one of {sorted(BY_NAME)}", field="--engine")
    return BY_NAME[name]()


def detect(url: str, api_key: Optional[str] = None, *, timeout: float = 10.0, deadline_s: float = 60.0,
           budget: Optional[Budget] = None) -> Detected:
    """Detect the engine and release serving ``url`` (every request with a deadline: ``timeout`` per read,
    ``deadline_s`` in all, or the command's ``budget`` when given: then detection spends the command's one
    ``--timeout`` like its other waits).

    Raises:
        helpers.errors.BadInput: the server is neither SGLang nor vLLM, or a vLLM release whose rules are not known
            (one line: what each endpoint answered, what is supported).
        helpers.errors.SGLangError: the server cannot be reached (a server error, exit 1), or it is SGLang by its
            answers and its ``/server_info`` is malformed (:meth:`SGLangAdapter.probe`: the endpoint and the field).
    """
    http = HTTPClient(url, api_key=api_key, timeout=timeout, retries=0, deadline_s=deadline_s, budget=budget)
    evidence: dict[str, Any] = {}
    try:
        for a in ADAPTERS:
            found = a.probe(http)
            if found is None:
                continue
            version, ev = found
            evidence.update(ev)
            _refuse_version(http, a, version, ev)
            return Detected(a(), a.name, version, evidence)
        for path in ("/server_info", "/model_info", "/version", "/v1/models"):
            resp = http._request("GET", path, retries=0)
            evidence[path] = f"HTTP {resp.status_code}"
            if resp.status_code == 200 and path == "/v1/models":
                evidence[path] += f" owned_by {_owned_by(http, resp)}"
            elif resp.status_code == 200:
                evidence[path] += f" {_answered(http, resp, path)}"
    finally:
        http.close()
    found_text = ", ".join(f"{k} -> {v}" for k, v in evidence.items())
    raise BadInput(f"{http._shown_url} is neither SGLang nor vLLM ({found_text}); supported: {supported_text()}",
                   field="--url")


def _refuse_version(http: HTTPClient, adapter: type[EngineAdapter], version: str, evidence: dict) -> None:
    """BadInput (one line, ``--url``) when ``adapter`` cannot work with the ``version`` its probe found
    (:meth:`EngineAdapter.version_refusal`); nothing otherwise."""
    why = adapter.version_refusal(version, ", ".join(evidence) or "its version endpoint")
    if why:
        raise BadInput(f"{http._shown_url} {why}; supported: {supported_text()}", field="--url")


def detect_or(url: str, api_key: Optional[str] = None, *, default: str = "sglang", timeout: float = 10.0,
              deadline_s: float = 60.0, budget: Optional[Budget] = None, on_wait: Any = None) -> EngineAdapter:
    """The adapter of the engine serving ``url`` when an engine other than ``default`` recognises it through its own
    endpoints, else ``default``'s, unchecked: for the commands that read every answer of the server through their
    client anyway (``measure``, ``capture``), so a malformed answer stays a server error naming its endpoint and
    field (exit 1) rather than "neither engine". ``budget``: the command's :class:`helpers.budget.Budget` (its one
    ``--timeout``, shared with the client the command builds next: detection is part of the command's time, and the
    elapsed time a deadline message gives counts it); else ``deadline_s`` of its own. ``on_wait``: the command's
    progress line while a probe is in flight.

    Raises:
        helpers.errors.BadInput: the server is vLLM of a release whose rules are not known.
        helpers.errors.ServerTimeout: ``budget`` was spent (or the command interrupted) during detection.
    (A server that cannot be reached, or answers a probe with an error, gets ``default``: its client reports it.)"""
    http = HTTPClient(url, api_key=api_key, timeout=timeout, retries=0, deadline_s=deadline_s, budget=budget,
                      on_wait=on_wait)
    try:
        for a in ADAPTERS:
            if a.name == default:
                continue
            try:
                found = a.probe(http)
            except SGLangError:          # unreachable, a redirect, an oversized answer: the client says it
                if http.budget.spent():  # ... unless the command's time is up: then that is the error
                    raise
                found = None
            if found is not None:
                _refuse_version(http, a, *found)
                return a()
    finally:
        http.close()
    return BY_NAME[default]()


def _answered(http: HTTPClient, resp: Any, path: str) -> str:
    """What a 200 answer of ``path`` was, for the "neither" line: its JSON kind (``a JSON list``, ``a JSON object with
    keys [...]``) or, not JSON, its content type and first 60 characters."""
    try:
        return answer_kind(http._json(resp, f"GET {path}", path))
    except SGLangError as exc:
        if "too deeply" in str(exc):
            return "JSON nested too deeply"
        kind = str(resp.headers.get("content-type") or "no content type").split(";")[0]
        return f"not JSON ({printable(kind)[:40]}): {http._body(resp, 60)}"


def _owned_by(http: HTTPClient, resp: Any) -> str:
    try:
        data = http._json(resp, "GET /v1/models", "/v1/models").get("data") or []
        return str(sorted({str(m.get("owned_by")) for m in data if isinstance(m, dict)}))
    except (SGLangError, AttributeError):
        return "(unreadable)"
