"""HTTP client for a running SGLang server: probe, effective speculative config, silent overrides.

Mirrors SGLang 0.5.23 (``sglang/srt/entrypoints/http_server.py``: ``server_info``, ``get_server_info``, ...) and
keeps working against older servers (each fallback names the sgl-project/sglang pull request that changed the
endpoint, https://github.com/sgl-project/sglang/pull/<number>):

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
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence
from urllib.parse import urlsplit

import httpx
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from ..budget import Budget
from ..errors import (
    AuthError,
    BadInput,
    CacheBusy,
    EndpointMissing,
    HiddenStatesDisabled,
    MetricsDisabled,
    RequestRejected,
    ServerTimeout,
    ServerUnavailable,
    SGLangError,
    printable,
)
from ..formats.configs import read_config_json
from ..redaction import redact, redact_url, remember, remember_url, scrub, shown_url
from ..runfiles import JSONTooDeep, loads_json
from .hosts import canonical_host
from .protocol import GenerateResult, ServerInfo
from .settings import (
    EffectiveSpecConfig,
    detect_overrides,
    parse_launch_args,
    spec_settings,
)

HIDDEN_STATES_FLAG = "--enable-return-hidden-states"


_RETRY_STATUS = (502, 503, 504)

#: Largest answer kept from a probe endpoint (/server_info, /model_info, /metrics, ...): 8 MiB. A real 0.5.23
#: /server_info is about 30 KiB.
MAX_INFO_BYTES = 8 << 20
#: Largest /generate answer: 1 GiB. A TP 8 capture of 3 x 7168-wide rows for a 2k-token prompt is about 500 MiB of
#: JSON; the width itself is checked against the target by the capture.
MAX_GENERATE_BYTES = 1 << 30


def _cap_timeout(t: Any, remaining: float) -> Any:
    """``t`` (seconds or httpx.Timeout) with every phase capped at ``remaining`` seconds (at least 0.05)."""
    r = max(0.05, remaining)
    if isinstance(t, httpx.Timeout):
        return httpx.Timeout(connect=min(t.connect or r, r), read=min(t.read or r, r), write=min(t.write or r, r),
                             pool=min(t.pool or r, r))
    return min(float(t), r)


class _Waiting:
    """While a request is in flight, calls ``on_wait`` every ``every`` seconds with a progress line, so a slow
    server is never mistaken for a hang."""

    def __init__(self, on_wait: Optional[Callable[[str], None]], where: str, every: float, budget: Budget):
        self.on_wait, self.where, self.every, self.budget = on_wait, where, every, budget
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self):
        if self.on_wait is not None:
            self._start = time.monotonic()
            self._thread = threading.Thread(target=self._loop, daemon=True, name="e3f-waiting")
            self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            waited = time.monotonic() - self._start
            rem = self.budget.remaining()
            left = "" if rem is None else f"; deadline in {max(0.0, rem):.0f} s"
            try:
                self.on_wait(f"still waiting for {self.where} ({waited:.0f} s{left})")
            except Exception:  # noqa: BLE001 - progress must never break a request
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)


def check_url(url: Optional[str], field: str = "--url") -> str:
    """``url`` when it is ``http(s)://host[:port][/path]`` (a host, a numeric port, no whitespace, no query string or
    fragment: the server's base URL).

    Credentials in it (``http://user:pw@host``, also in a URL that fails the check: ``u:pw@host:1``,
    ``http:/u:pw@host``) are remembered as secrets (:func:`helpers.redaction.remember_url`): from here on no file this
    process writes and no line it prints holds them; the message of a refused URL shows it without them
    (:func:`helpers.redaction.shown_url`).

    Raises:
        BadInput: naming ``field``, the URL shown without credentials, query or fragment."""
    remember_url(str(url or ""))
    try:
        parts = urlsplit(url or "")
        parts.port                       # raises ValueError on a port that is not a number in 0-65535
    except ValueError:
        parts = None
    shown = printable(shown_url(str(url or "")))[:200]
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or any(c.isspace() for c in str(url))):
        raise BadInput(f"url must look like http://host:port, got {shown!r}", field=field)
    if "?" in str(url) or "#" in str(url):
        raise BadInput(f"give the server's base URL (http://host:port[/path]), without a query string or fragment; "
                       f"got {shown!r} followed by one", field=field)
    return str(url)


#: host names of this machine's loopback interface: one server whichever of them a URL names
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "ip6-localhost", "0.0.0.0")


def server_key(url: str) -> tuple:
    """What identifies the server a checked URL (:func:`check_url`) names: ``(scheme, host, port, path)`` with the
    host in one spelling (:func:`canonical_host`) and loopback names as one (:data:`LOOPBACK_HOSTS`), the scheme's
    default port made explicit,
    trailing ``/`` and credentials dropped; two URLs with equal keys reach the same server."""
    parts = urlsplit(url)
    host = canonical_host(parts.hostname or "")
    host = "127.0.0.1" if host in LOOPBACK_HOSTS else host
    return parts.scheme.lower(), host, parts.port or (443 if parts.scheme.lower() == "https" else 80), \
        parts.path.rstrip("/")


class HTTPClient:
    """Synchronous httpx client for one inference server (thread-safe: share it between threads): the plumbing every
    engine's client shares (deadlines, retries, byte limits, redirects refused, the API key kept out of messages,
    ``/health``, ``/metrics``). :class:`SGLangClient` adds SGLang's endpoints; ``helpers.engines.vllm.VLLMClient``
    vLLM's. Class attributes name the engine in messages: ``ENGINE``, ``API_KEY_ENV`` (the default key's variable),
    ``METRICS_HINT`` (how to turn ``/metrics`` on).

    Args:
        url: ``http://host:port`` of the server (a trailing ``/`` is fine).
        api_key: bearer token; default ``$<API_KEY_ENV>`` (``$SGLANG_API_KEY`` for SGLang); None/empty: no header.
        timeout: seconds for probe requests (connect and read).
        generate_timeout: read timeout in seconds for ``/generate`` (long generations on CPU).
        retries: extra attempts after a connection error, a connect/read timeout on idempotent
            probes, or 502/503/504; waits ``backoff * 2**attempt`` seconds in between.
        transport: optional httpx transport (tests).
        deadline_s: overall budget in seconds for everything this client sends, from now (a new :class:`Budget`).
        budget: the command's :class:`helpers.budget.Budget` instead (shared with its other waits; wins over
            ``deadline_s``). Every request ends (:class:`ServerTimeout`) once it is spent, not only per read (a
            server that trickles one byte every few seconds never trips a read timeout), or cancelled.
        on_wait: called with a progress line every ``wait_every`` seconds while a request is in flight.
        max_info_bytes / max_generate_bytes: the largest answer read from a probe endpoint / from ``/generate``.

    Errors (all :class:`SGLangError`): :class:`ServerUnavailable`, :class:`ServerTimeout`,
    :class:`AuthError`, :class:`EndpointMissing` (:class:`MetricsDisabled`),
    :class:`RequestRejected` (:class:`HiddenStatesDisabled`), :class:`CacheBusy`. Messages name
    the endpoint and what to do; they never contain the API key.
    """

    ENGINE = "SGLang"
    API_KEY_ENV = "SGLANG_API_KEY"
    METRICS_HINT = "start the server with --enable-metrics"

    def __init__(self, url: str, api_key: Optional[str] = None, *, timeout: float = 30.0,
                 generate_timeout: float = 600.0, retries: int = 3, backoff: float = 0.5,
                 transport: Optional[httpx.BaseTransport] = None, deadline_s: Optional[float] = None,
                 budget: Optional[Budget] = None, on_wait: Optional[Callable[[str], None]] = None,
                 wait_every: float = 15.0,
                 max_info_bytes: int = MAX_INFO_BYTES, max_generate_bytes: int = MAX_GENERATE_BYTES):
        check_url(url)
        self.url = url.rstrip("/")
        self._shown_url = redact_url(self.url)
        key = api_key if api_key is not None else os.environ.get(self.API_KEY_ENV)
        self._api_key: Optional[str] = key or None
        remember(self._api_key)
        self.timeout = float(timeout)
        #: the option named when a request times out (a command whose timeout flag is another sets it)
        self.timeout_flag = "--timeout"
        self.generate_timeout = float(generate_timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        headers = {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout,
                                  transport=transport)
        self._server_info: Optional[dict] = None
        self._model_info: Optional[dict] = None
        self.budget = budget if budget is not None else Budget(deadline_s)
        self.on_wait = on_wait
        self.wait_every = float(wait_every)
        self.max_info_bytes = int(max_info_bytes)
        self.max_generate_bytes = int(max_generate_bytes)

    def remaining(self) -> Optional[float]:
        """Seconds left of the overall budget (None without one; 0 once it was cancelled)."""
        return self.budget.remaining()

    def _expired(self, where: str, path: str) -> ServerTimeout:
        return self.budget.error(where, path)

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def has_api_key(self) -> bool:
        return self._api_key is not None

    @property
    def secrets(self) -> list[str]:
        """Values to scrub from anything written (for :func:`redact`); do not print."""
        return [self._api_key] if self._api_key else []

    def _scrub(self, text: str) -> str:
        return scrub(text, self.secrets)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._shown_url} api_key={'set' if self._api_key else 'none'}>"

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "HTTPClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, *, json_body: Any = None,
                 params: Optional[dict] = None, timeout: Optional[httpx.Timeout | float] = None,
                 idempotent: bool = True, retries: Optional[int] = None,
                 max_bytes: Optional[int] = None) -> httpx.Response:
        """Send with retries; return the response for 2xx/4xx; raise for transport failures.

        Retries: connection errors always (nothing reached the server), timeouts and
        502/503/504 only when ``idempotent``. 401/403 raise :class:`AuthError` here, a 3xx redirect
        :class:`SGLangError` (its body is no answer of the endpoint asked). The body is read in
        chunks: past ``max_bytes`` (default :attr:`max_info_bytes`) the request ends with :class:`SGLangError`
        naming the limit; past the overall deadline (:attr:`budget`) with :class:`ServerTimeout`. While a
        request is in flight longer than ``wait_every`` seconds, ``on_wait`` gets a progress line.
        """
        tries = 1 + (self.retries if retries is None else retries)
        where = f"{method} {self._shown_url}{path}"
        limit = self.max_info_bytes if max_bytes is None else int(max_bytes)
        last: str = ""
        for attempt in range(tries):
            if attempt:
                pause = self.backoff * 2 ** (attempt - 1)
                rem = self.remaining()
                if rem is not None and rem <= pause:
                    raise self._expired(where, path)
                self.budget.sleep(pause)
            rem = self.remaining()
            if rem is not None and rem <= 0:
                raise self._expired(where, path)
            t = timeout if timeout is not None else self.timeout
            if rem is not None:
                t = _cap_timeout(t, rem)
            try:
                with _Waiting(self.on_wait, where, self.wait_every, self.budget):
                    resp = self._read(method, path, json_body, params, t, limit, where)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last = f"cannot connect ({type(exc).__name__}: {self._scrub(str(exc))})"
                continue
            except httpx.TimeoutException as exc:
                rem = self.remaining()
                if rem is not None and rem <= 0.5:
                    raise self._expired(where, path) from None
                if idempotent and attempt + 1 < tries:
                    last = f"timed out ({type(exc).__name__})"
                    continue
                shown_t = t.read if isinstance(t, httpx.Timeout) else t
                raise ServerTimeout(
                    f"{where}: no answer within {shown_t} s ({type(exc).__name__}); the server may be "
                    f"overloaded or the generation long: raise the timeout ({self.timeout_flag})",
                    endpoint=path) from None
            except httpx.TransportError as exc:
                last = f"transport error ({type(exc).__name__}: {self._scrub(str(exc))})"
                if idempotent:
                    continue
                raise ServerUnavailable(f"{where}: {last}", endpoint=path) from None
            if resp.status_code in (401, 403):
                hint = ("the API key given was refused" if self._api_key else
                        f"the server was started with --api-key; pass api_key=... or set {self.API_KEY_ENV}")
                raise AuthError(f"{where}: HTTP {resp.status_code} ({hint})", endpoint=path,
                                status=resp.status_code)
            if 300 <= resp.status_code < 400:
                loc = resp.headers.get("location")
                raise SGLangError(f"{where}: HTTP {resp.status_code} redirect"
                                  + (f" to {printable(redact_url(loc))}" if loc else "")
                                  + "; this tool does not follow redirects: give the server's own address (--url)",
                                  endpoint=path, status=resp.status_code)
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

    def _read(self, method: str, path: str, json_body: Any, params: Optional[dict], timeout: Any, limit: int,
              where: str) -> httpx.Response:
        """One request, body streamed in chunks with the byte limit and the overall deadline checked between
        chunks. Returns a complete (read) response."""
        with self._http.stream(method, path, json=json_body, params=params, timeout=timeout) as resp:
            declared = resp.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise SGLangError(f"{where}: the answer is {int(declared) / 2**20:.1f} MiB, over the limit of "
                                  f"{limit / 2**20:.1f} MiB for this endpoint", endpoint=path)
            chunks, size = [], 0
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > limit:
                    raise SGLangError(f"{where}: the answer exceeds the limit of {limit / 2**20:.1f} MiB for this "
                                      "endpoint (read stopped there)", endpoint=path)
                chunks.append(chunk)
                if self.budget.spent():
                    raise self._expired(where, path)
            headers = [(k, v) for k, v in resp.headers.multi_items()
                       if k.lower() not in ("content-encoding", "content-length", "transfer-encoding")]
            return httpx.Response(resp.status_code, headers=headers, content=b"".join(chunks), request=resp.request)

    def _body(self, resp: httpx.Response, limit: int = 400) -> str:
        try:
            text = resp.text
        except Exception:  # noqa: BLE001
            text = "<unreadable body>"
        text = printable(self._scrub(text.strip()))
        return text[:limit] + ("..." if len(text) > limit else "")

    def _json(self, resp: httpx.Response, where: str, path: str) -> Any:
        """The answer's JSON (:func:`helpers.runfiles.loads_json`: nesting bounded); :class:`SGLangError` naming
        ``where`` when it is not JSON or nested too deeply."""
        try:
            return loads_json(resp.content)
        except JSONTooDeep as exc:
            raise SGLangError(f"{where}: the answer {exc}", endpoint=path) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SGLangError(f"{where}: answer is not JSON: {self._body(resp)}", endpoint=path) from None

    def _get_json(self, paths: Sequence[str], what: str) -> dict:
        """GET the first of ``paths`` that is not 404 (newer name first); its JSON object (:class:`SGLangError`
        for anything else)."""
        tried = []
        for path in paths:
            resp = self._request("GET", path)
            if resp.status_code == 404:
                tried.append(path)
                continue
            if resp.status_code >= 400:
                raise RequestRejected(f"GET {self._shown_url}{path}: HTTP {resp.status_code}: "
                                      f"{self._body(resp)}", endpoint=path, status=resp.status_code)
            data = self._json(resp, f"GET {self._shown_url}{path}", path)
            if not isinstance(data, dict):
                raise SGLangError(f"GET {self._shown_url}{path}: expected a JSON object ({what}), got a "
                                  f"{_json_type(data)}", endpoint=path)
            return data
        raise EndpointMissing(f"{self._shown_url}: none of {tried} exists ({what}); is this an {self.ENGINE} "
                              "server?", endpoint=paths[0], status=404)

    # -- probes -----------------------------------------------------------------------------

    def health(self) -> bool:
        """``GET /health``: True on 200, False on 503 (starting / unhealthy). Raises when unreachable."""
        resp = self._request("GET", "/health", retries=0)
        return resp.status_code == 200

    def wait_healthy(self, timeout: float = 300.0, poll: float = 1.0) -> None:
        """Poll ``/health`` until 200, for ``timeout`` seconds at most and never past the client's :attr:`budget`.

        Raises:
            ServerUnavailable: not healthy after ``timeout`` seconds.
            ServerTimeout: the budget was spent (or cancelled) first.
        """
        deadline = time.monotonic() + timeout
        last = "no answer"
        while True:
            try:
                if self.health():
                    return
                last = "HTTP 503"
            except ServerTimeout as exc:
                if self.budget.spent():
                    raise
                last = str(exc).split(": ", 1)[-1]
            except ServerUnavailable as exc:
                last = str(exc).split(": ", 1)[-1]
            self.budget.check(f"{self._shown_url}/health not 200 (last: {last})", "/health")
            if time.monotonic() > deadline:
                raise ServerUnavailable(f"{self._shown_url}/health not 200 after {timeout:.0f} s "
                                        f"(last: {last})", endpoint="/health")
            self.budget.sleep(poll)

    def metrics_text(self) -> str:
        """Raw Prometheus text of ``/metrics``; :class:`MetricsDisabled` without ``--enable-metrics``."""
        resp = self._request("GET", "/metrics")
        if resp.status_code == 404:
            raise MetricsDisabled(f"GET {self._shown_url}/metrics: 404; {self.METRICS_HINT}", endpoint="/metrics",
                                  status=404)
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


class ServerClient(HTTPClient):
    """The client contract every engine's client keeps (what measurement, sweeps, capture of the training tokens and
    the investigation call), so that code above the engine seam never branches on the engine:

    * :meth:`server_info` -- the server's effective settings in the suite's vocabulary (SGLang's ServerArgs names:
      ``version``, ``model_path``, ``speculative_algorithm``, ``speculative_draft_model_path``,
      ``speculative_num_steps``, ``speculative_eagle_topk``, ``speculative_num_draft_tokens``, ``tp_size``,
      ``device``, ``dtype``, ...) plus ``engine`` (``sglang`` | ``vllm``); an engine's own settings under their own
      names;
    * :meth:`generate` -- one non-streaming request, a :class:`helpers.server.protocol.GenerateResult` whose
      ``meta_info`` carries the per-request spec counters with SGLang's definitions;
    * :meth:`flush_cache` -- empty the prefix cache (every request then prefills its whole prompt);
    * :meth:`effective_spec_config` -- :class:`helpers.server.settings.EffectiveSpecConfig`.

    Subclasses: :class:`SGLangClient` here, ``helpers.engines.vllm.VLLMClient``.
    """

    #: the engine name in :meth:`server_info` ``engine``
    ENGINE_NAME = "sglang"

    def server_info(self, refresh: bool = False) -> dict:  # pragma: no cover - abstract
        raise NotImplementedError

    def flush_cache(self, timeout: float = 120.0, poll: float = 0.5) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def generate(self, input_ids: Optional[Sequence[int]] = None, text: Optional[str] = None, **kw: Any
                 ) -> GenerateResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def effective_spec_config(self, requested: Any = None, *, draft_config: Any = None
                              ) -> EffectiveSpecConfig:  # pragma: no cover - abstract
        raise NotImplementedError

    def version(self) -> Optional[str]:
        """The engine's version string (``server_info()["version"]``)."""
        return self.server_info().get("version")


class SGLangClient(ServerClient):
    """Synchronous httpx client for one SGLang server (thread-safe: share it between threads): the plumbing of
    :class:`HTTPClient` plus SGLang's ``/server_info``, ``/model_info``, ``/flush_cache``, ``/generate`` and the
    effective speculative config.
    """

    def server_info(self, refresh: bool = False) -> dict:
        """``/server_info`` (fallback ``/get_server_info``), checked and **redacted** (:func:`redact`).

        The fields this suite reads are typed and range-checked first (:class:`helpers.server.protocol.ServerInfo`:
        a count that would size arrays, such as ``speculative_num_steps``, within sane bounds; text without control
        characters); their checked values replace the raw ones. Cached after the first call (the resolved
        ServerArgs do not change); ``refresh=True`` fetches again (``internal_states`` do change).

        Raises:
            SGLangError: not a JSON object, a field of the wrong type or out of range (one line naming the endpoint
                and the field), a redirect, or the transport errors of :meth:`_request`.
        """
        if self._server_info is None or refresh:
            raw = self._get_json(["/server_info", "/get_server_info"], "server info")
            checked_server_info(raw, f"GET {self._shown_url}/server_info", "/server_info")
            raw.setdefault("engine", self.ENGINE_NAME)
            self._server_info = redact(raw, self.secrets)
        return self._server_info

    def model_info(self, refresh: bool = False) -> dict:
        """``/model_info`` (fallback ``/get_model_info``): model_path, architectures (a list of names), ...

        Raises: SGLangError when it is not a JSON object or ``architectures`` is not a list of strings."""
        if self._model_info is None or refresh:
            info = self._get_json(["/model_info", "/get_model_info"], "model info")
            archs = info.get("architectures")
            if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
                raise SGLangError(f"GET {self._shown_url}/model_info: field architectures: expected a list of "
                                  f"names, got {printable(repr(archs))[:80]}", endpoint="/model_info")
            self._model_info = redact(info, self.secrets)
        return self._model_info

    def flush_cache(self, timeout: float = 120.0, poll: float = 0.5) -> float:
        """``POST /flush_cache``, retried while the server is busy (400); returns seconds waited.

        SGLang flushes only when no request runs or waits (``Scheduler.flush_cache``), answering
        400 otherwise. A flush also clears the radix cache (so a repeated prompt gets its full
        prompt block of hidden states) and zeroes the lifetime spec counters
        (``avg_spec_accept_length`` in ``/server_info``), which this package never uses.
        Raises :class:`CacheBusy` after ``timeout`` seconds, :class:`RequestRejected` at once for any other
        status, :class:`ServerTimeout` once the :attr:`budget` is spent.
        """
        t0 = time.monotonic()
        while True:
            resp = self._request("POST", "/flush_cache", params={"timeout": 0})
            if resp.status_code == 200:
                return time.monotonic() - t0
            if resp.status_code == 404:
                raise EndpointMissing(f"POST {self._shown_url}/flush_cache: 404", endpoint="/flush_cache",
                                      status=404)
            if resp.status_code != 400:          # only 400 means "requests running"
                raise RequestRejected(f"POST {self._shown_url}/flush_cache: HTTP {resp.status_code}: "
                                      f"{self._body(resp)}", endpoint="/flush_cache", status=resp.status_code)
            if time.monotonic() - t0 > timeout:
                raise CacheBusy(f"POST {self._shown_url}/flush_cache still HTTP {resp.status_code} "
                                f"after {timeout:.0f} s (requests running?): {self._body(resp)}",
                                endpoint="/flush_cache", status=resp.status_code)
            self.budget.sleep(poll)

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
        :class:`ServerTimeout` past ``timeout`` (default ``generate_timeout``), :class:`SGLangError` for an answer
        that is not a JSON object, has a field of the wrong type or out of range (negative counts, a histogram
        longer than 65 bins), or spec counters that break an identity of SGLang's per-request counters
        (:meth:`helpers.server.protocol.MetaInfo.spec_problem`, with the ``speculative_num_steps`` /
        ``_num_draft_tokens`` / ``_adaptive`` of :meth:`server_info` once it was read: a measurement reads it first, so
        they fail that request; the message names the server's request id and the identity, with the numbers).
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
                             timeout=httpx.Timeout(self.timeout, read=read), max_bytes=self.max_generate_bytes)
        if resp.status_code >= 400:
            msg = self._body(resp)
            if return_hidden_states and ("hidden states" in msg.lower() or HIDDEN_STATES_FLAG in msg):
                raise HiddenStatesDisabled(
                    f"POST {self._shown_url}/generate: the server refuses return_hidden_states "
                    f"(HTTP {resp.status_code}): restart it with {HIDDEN_STATES_FLAG} (SGLang "
                    f"0.5.2x also accepts --return-hidden-states-mode full; 'last' returns only the "
                    f"last token, too little for a capture); reference server: "
                    f"helpers.server.embedded.start(..., return_hidden_states=True). "
                    f"Server said: {msg}", endpoint="/generate", status=resp.status_code)
            raise RequestRejected(f"POST {self._shown_url}/generate: HTTP {resp.status_code}: {msg}",
                                  endpoint="/generate", status=resp.status_code)
        data = self._json(resp, f"POST {self._shown_url}/generate", "/generate")
        latency = time.perf_counter() - t0
        if isinstance(data, list) and data:  # a batch answer: only one prompt is sent here
            data = data[0]
        if not isinstance(data, dict):
            raise SGLangError(f"POST {self._shown_url}/generate: expected a JSON object, got "
                              f"{type(data).__name__}", endpoint="/generate")
        try:
            result = GenerateResult.model_validate({**data, "latency_s": latency})
        except ValidationError as exc:
            raise answer_error(exc, f"POST {self._shown_url}/generate", "/generate") from None
        problem = result.meta_info.spec_problem(**self._spec_limits())
        if problem:
            rid = result.meta_info.id
            which = f" (request {printable(str(rid))[:80]})" if rid is not None else ""
            raise SGLangError(f"POST {self._shown_url}/generate{which}: impossible spec counters: {problem}",
                              endpoint="/generate")
        return result

    def _spec_limits(self) -> dict:
        """What :meth:`helpers.server.protocol.MetaInfo.spec_problem` checks counters against: the server's
        ``speculative_num_steps``, ``speculative_num_draft_tokens`` and ``speculative_adaptive`` when ``/server_info``
        was read (checked) and speculative decoding is on, else nothing."""
        info = self._server_info or {}
        if not info.get("speculative_algorithm"):
            return {}
        return {"num_steps": info.get("speculative_num_steps"),
                "num_draft_tokens": info.get("speculative_num_draft_tokens"),
                "adaptive": bool(info.get("speculative_adaptive"))}

    # -- configuration ----------------------------------------------------------------------

    def effective_spec_config(self, requested: str | Sequence[str] | Mapping[str, Any] | Any = None,
                              *, draft_config: Mapping[str, Any] | os.PathLike | str | None = None
                              ) -> EffectiveSpecConfig:
        """The speculative config the server really runs, and the silent overrides SGLang made.

        Args:
            requested: what was asked for: a launch command (string or argv), a ServerArgs-like
                mapping (``{"speculative_num_draft_tokens": 6, ...}`` or short names), or a
                :class:`helpers.server.settings.SpecSettings`. Default: the server's own
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


def _json_type(x: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(x), "number")


def answer_error(exc: ValidationError, where: str, endpoint: str) -> SGLangError:
    """One line for a pydantic error in a server answer: the endpoint, the first field, what was expected, the value
    (shortened, printable)."""
    err = exc.errors()[0]
    field = ".".join(str(x) for x in err.get("loc", ())) or "(top level)"
    got = printable(repr(err.get("input")))
    more = f" ({len(exc.errors())} problem(s) in the answer)" if len(exc.errors()) > 1 else ""
    return SGLangError(f"{where}: field {field}: {err.get('msg')}, got {got[:80]}{more}", endpoint=endpoint)


def checked_server_info(raw: dict, where: str, endpoint: str) -> ServerInfo:
    """SGLang's ``/server_info`` object ``raw`` checked (:class:`helpers.server.protocol.ServerInfo`: the fields this
    suite reads typed and range-checked, text without control characters); the checked values replace the raw ones
    in ``raw``. The one check of that answer: :meth:`SGLangClient.server_info` and the engine detection
    (``helpers.engines.sglang.SGLangAdapter.probe``).

    Raises:
        SGLangError: a field of the wrong type or out of range: ``<where>: field <name>: <what was expected>, got
            <value>``."""
    checked = _validated(ServerInfo, raw, where, endpoint)
    raw.update({k: getattr(checked, k) for k in ServerInfo.model_fields if k in raw})
    return checked


def answer_kind(data: Any) -> str:
    """What a JSON answer is, for messages: ``a JSON list``, ``a JSON object with keys [...]`` (the first 6)."""
    if isinstance(data, dict):
        keys = [printable(str(k))[:40] for k in list(data)[:6]]
        return f"a JSON object with keys {keys}{' ...' if len(data) > 6 else ''}"
    return f"a JSON {_json_type(data)}"


def _validated(model: Any, data: Any, where: str, endpoint: str) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise answer_error(exc, where, endpoint) from None


def _draft_architectures(draft_config: Any, draft_path: Optional[str]) -> Optional[list[str]]:
    cfg: Optional[Mapping] = None
    if isinstance(draft_config, Mapping):
        cfg = draft_config
    else:
        path = Path(draft_config) if draft_config is not None else (Path(draft_path) if draft_path else None)
        if path is not None:
            try:
                cfg = read_config_json(path, "draft config")
            except (OSError, ValueError):            # BadInput is a ValueError
                cfg = None
    archs = cfg.get("architectures") if isinstance(cfg, Mapping) else None
    return [str(a) for a in archs] if isinstance(archs, list) and archs else None


def as_client(client_or_url: "ServerClient | str", api_key: Optional[str] = None,
              **kwargs: Any) -> "ServerClient":
    """Return ``client_or_url`` if it is a client (any engine's :class:`ServerClient`), else a new
    :class:`SGLangClient` for the URL.

    Also accepts an object with a ``url`` attribute (``helpers.server.process.ServerProcess``).
    """
    if isinstance(client_or_url, ServerClient):
        return client_or_url
    url = getattr(client_or_url, "url", client_or_url)
    return SGLangClient(str(url), api_key=api_key, **kwargs)
