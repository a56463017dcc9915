"""Secrets out of everything the suite keeps or shows: server answers (``/server_info`` holds ``api_key`` and
``launch_command`` holds ``--api-key VALUE`` in clear text), launch commands, URLs (credentials, query).
"""
from __future__ import annotations

import re
import shlex
from typing import Any, Iterable, Mapping, Sequence
from urllib.parse import urlsplit, urlunsplit

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
