"""Secrets out of everything the suite keeps or shows: the one redaction, used for server answers (``/server_info``
holds ``api_key`` / ``admin_api_key`` in clear text, ``launch_command`` holds ``--api-key VALUE``, and any field may
use a key as a dict key), launch commands and argv (:func:`redact_argv`, :func:`argv_secrets`), server logs
(:func:`scrub_bytes`), error messages (:func:`scrub`), every text file the suite writes
(``helpers.runfiles.atomic_write_text`` scrubs :func:`known_secrets`) and URLs (credentials, query).

Credentials in a URL (``http://user:secret@host``) are never kept: :func:`scrub` replaces the ``user:secret`` of any
``scheme://user:secret@`` it meets by ``<redacted>`` (whatever their length), :func:`remember_url` (called by
``helpers.server.client.check_url``, which every command runs on each URL before using it) adds the password, the
``user:password`` pair and its HTTP Basic form to the remembered secrets, and :func:`url_label` gives the
credential-free ``host-port`` that run-folder names are made of.

Every secret value met once (the client's API key, a secret flag's value in a launch command, a value held under a
secret key of a server answer) is remembered for the life of the process (:func:`remember`), so a key that shows up
later somewhere else (a server's own log line, a dict key, an error body) is scrubbed there too.
"""
from __future__ import annotations

import base64
import re
import shlex
import threading
from typing import Any, Iterable, Mapping, Optional, Sequence
from urllib.parse import unquote, urlsplit, urlunsplit

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

#: Shorter values are not scrubbed from free text (a 1-3 character "secret" would be replaced inside every word); the
#: flag and field rules still hide them where they stand.
MIN_SECRET_LEN = 4

_KNOWN: set[str] = set()

#: the ``user:password@`` of a URL in free text (after a ``://``, everything up to the netloc's last ``@``; no
#: whitespace, quote, ``/``, ``?``, ``#`` or angle bracket in between, so a JSON string or an HTML attribute is never
#: crossed; the look-behind keeps a 5 MB page at ~0.1 s)
URL_USERINFO_RE = re.compile(r"""(?<=://)[^\s/?#"'<>@]*(?:@[^\s/?#"'<>@]*)*@""")

_LOCK = threading.Lock()


def remember(*secrets: str | None) -> None:
    """Add secret values (strings of at least :data:`MIN_SECRET_LEN` characters; others are ignored) to those scrubbed
    from every text by :func:`scrub`, for the life of the process."""
    new = {s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_LEN and s != REDACTED}
    if new - _KNOWN:
        with _LOCK:
            _KNOWN.update(new)


def known_secrets() -> list[str]:
    """The secrets remembered so far, longest first (do not print)."""
    return sorted(_KNOWN, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every remembered secret and every one of ``secrets`` replaced by ``<redacted>``, and the
    credentials of every URL in it (``http://user:pw@host`` -> ``http://<redacted>@host``: :data:`URL_USERINFO_RE`)."""
    if "://" in text and "@" in text:
        text = URL_USERINFO_RE.sub(REDACTED + "@", text)
    extra = [s for s in secrets if s]
    for secret in sorted(set(extra) | _KNOWN, key=len, reverse=True) if (extra or _KNOWN) else ():
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub_bytes(data: bytes, secrets: Iterable[str] = ()) -> bytes:
    """Bytes version of :func:`scrub` (a server's log output; secrets as UTF-8)."""
    if b"://" in data and b"@" in data:
        data = _URL_USERINFO_BYTES.sub(REDACTED.encode() + b"@", data)
    extra = [s for s in secrets if s]
    for secret in sorted(set(extra) | _KNOWN, key=len, reverse=True) if (extra or _KNOWN) else ():
        raw = secret.encode()
        if raw in data:
            data = data.replace(raw, REDACTED.encode())
    return data


_URL_USERINFO_BYTES = re.compile(URL_USERINFO_RE.pattern.encode())


def is_secret_key(name: str) -> bool:
    """True when a dict key / ServerArgs field name names a secret (see :data:`SECRET_KEY_RE`)."""
    return bool(SECRET_KEY_RE.search(str(name).lower()))


def _split_secret_flags(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(argv with secret flag values replaced, the values replaced)."""
    out: list[str] = []
    values: list[str] = []
    hide_next = False
    for a in args:
        if hide_next:
            out.append(REDACTED)
            values.append(a)
            hide_next = False
            continue
        if a.startswith("-") and "=" in a and SECRET_FLAG_RE.match(a.split("=", 1)[0]):
            name, value = a.split("=", 1)
            out.append(name + "=" + REDACTED)
            values.append(value)
        elif a.startswith("-") and SECRET_FLAG_RE.match(a):
            out.append(a)
            hide_next = True
        else:
            out.append(a)
    return out, values


def _args(argv: Sequence[str] | str) -> list[str]:
    return shlex.split(argv) if isinstance(argv, str) else [str(a) for a in argv]


def redact_argv(argv: Sequence[str] | str) -> list[str]:
    """Replace the value of every secret flag (``--api-key X``, ``--api-key=X``, ``--admin-api-key X``,
    ``--hf-token=X``, ...: :data:`SECRET_FLAG_RE`) by ``<redacted>``; remembered secrets are scrubbed from the other
    words too.

    Accepts an argv list or a command string (split with :func:`shlex.split`; ValueError on unbalanced quotes).
    """
    out, values = _split_secret_flags(_args(argv))
    remember(*values)
    return [a if a == REDACTED else scrub(a) for a in out]


def argv_secrets(argv: Sequence[str] | str) -> list[str]:
    """The values of the secret flags of ``argv`` (what :func:`redact_argv` hides); remembered for :func:`scrub`.
    A command string that does not split (unbalanced quotes) gives the values the fallback of
    :func:`redact_command` finds."""
    try:
        values = _split_secret_flags(_args(argv))[1]
    except ValueError:
        values = [m.group(2) for m in _FALLBACK_RE.finditer(str(argv))]
    remember(*values)
    return values


_FALLBACK_RE = re.compile(r"(--?[\w-]*(?:api[-_]key|password|secret|token)[= ]+)(\S+)", re.I)


def redact_command(command: str) -> str:
    """A command string with secret flag values replaced (see :func:`redact_argv`)."""
    try:
        return " ".join(a if REDACTED in a else shlex.quote(a) for a in redact_argv(command))
    except ValueError:  # unbalanced quotes: fall back to a regex on the raw text
        argv_secrets(command)
        return scrub(_FALLBACK_RE.sub(r"\1" + REDACTED, command))


#: fields of a server answer or a record that hold a launch command (a string or an argv list)
COMMAND_FIELDS = ("launch_command", "command", "argv")


def _values(o: Any) -> Iterable[str]:
    """Every string value held in ``o`` (nested; dict keys are names, not values)."""
    if isinstance(o, str):
        yield o
    elif isinstance(o, Mapping):
        for v in o.values():
            yield from _values(v)
    elif isinstance(o, (list, tuple, set)):
        for v in o:
            yield from _values(v)


def redact(obj: Any, secrets: Iterable[str] = ()) -> Any:
    """Deep copy of ``obj`` (mappings, lists, tuples, strings, numbers; nested) without secrets.

    * dict entries whose key matches :func:`is_secret_key` are dropped, and every string held under them (nested too)
      is remembered (:func:`remember`) and scrubbed from every other string and dict key;
    * ``launch_command`` / ``command`` / ``argv`` strings and argv lists get :func:`redact_argv`, and their secret flag
      values are scrubbed everywhere else too;
    * every string and every string dict key has each value of ``secrets`` (e.g. the client's API key) and each
      remembered secret replaced by ``<redacted>`` (a key that becomes equal to another gets ``-2``, ``-3``, ...).
    """
    found: set[str] = {s for s in secrets if s}

    def collect(o: Any) -> None:
        if isinstance(o, Mapping):
            for k, v in o.items():
                if is_secret_key(k):
                    found.update(_values(v))
                elif str(k) in COMMAND_FIELDS and (isinstance(v, str) or
                                                   (isinstance(v, (list, tuple)) and
                                                    all(isinstance(x, str) for x in v))):
                    found.update(argv_secrets(v))
                else:
                    collect(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                collect(v)

    collect(obj)
    remember(*found)
    found = {s for s in found if len(s) >= MIN_SECRET_LEN and s != REDACTED} | set(secrets or ())

    def key_of(k: Any, taken: dict) -> Any:
        if not isinstance(k, str):
            return k
        new = scrub(k, found)
        i = 1
        while new in taken:
            i += 1
            new = f"{scrub(k, found)}-{i}"
        return new

    def walk(o: Any, key: str = "") -> Any:
        if isinstance(o, Mapping):
            out: dict = {}
            for k, v in o.items():
                if not is_secret_key(k):
                    out[key_of(k, out)] = walk(v, str(k))
            return out
        if isinstance(o, (list, tuple)):
            if key in COMMAND_FIELDS and all(isinstance(x, str) for x in o):
                return [scrub(x, found) for x in redact_argv(list(o))]
            return [walk(v) for v in o]
        if isinstance(o, str):
            if key in ("launch_command", "command"):
                o = redact_command(o)
            return scrub(o, found)
        return o

    return walk(obj)


#: the scheme-like start of a URL given for a server, well-formed or not (``http://``, ``http:/``, ``https//``,
#: ``http:``, ``ftp://``): what precedes its authority (``host`` or ``user:pw@host``)
_URL_START_RE = re.compile(r"(?i:https?)(?::/*|/+)|[A-Za-z][A-Za-z0-9+.-]*:/+")


def url_userinfo(url: str) -> Optional[str]:
    """The ``user:password`` part of ``url`` (before the authority's last ``@``), also when ``url`` is malformed
    (``u:pw@host:1``, ``http:/u:pw@host``, ``https//u:pw@host:1``, ``http://u:pw@[::1``), so that an error message
    that echoes it can hide it; None without one.

    A URL with an authority (``scheme://host...``, as :func:`urllib.parse.urlsplit` reads it) has credentials only
    there; one without (malformed): after a scheme-like start (:data:`_URL_START_RE`), what precedes the last ``@``
    before the first ``/``, ``?`` or ``#``, else everything before the last ``@``."""
    text = str(url)
    try:
        netloc = urlsplit(text).netloc
    except ValueError:                  # an unbalanced [ of an IPv6 host: no netloc to trust
        netloc = ""
    if netloc:
        return netloc.rpartition("@")[0] or None if "@" in netloc else None
    if "@" not in text:
        return None
    start = _URL_START_RE.match(text)
    rest = text[start.end():] if start else text
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    return (authority if "@" in authority else rest).rpartition("@")[0] or None


def shown_url(url: str) -> str:
    """``url`` as a message may echo it: its credentials (:func:`url_userinfo`, also of a malformed URL) replaced by
    ``<redacted>``, no query string or fragment (they may hold tokens), every remembered secret scrubbed
    (:func:`scrub`): ``u:pw@127.0.0.1:1`` -> ``<redacted>@127.0.0.1:1``."""
    text = str(url)
    info = url_userinfo(text)
    if info:
        i = text.find(info + "@")
        text = text[:i] + REDACTED + text[i + len(info):]
    text = re.split(r"[?#]", text, maxsplit=1)[0]
    return scrub(text, url_secrets(url))


def has_url_credentials(text: str) -> bool:
    """True when ``text`` holds a URL with credentials (``scheme://user:pw@host``, anywhere in it: the rule
    :func:`scrub` hides them by, :data:`URL_USERINFO_RE`; an empty ``http://@host`` is not one)."""
    return "://" in text and any(len(m.group(0)) > 1 for m in URL_USERINFO_RE.finditer(text))


def url_secrets(url: str) -> list[str]:
    """The credentials a URL carries (``http://user:pw@host``, or a malformed ``u:pw@host``: :func:`url_userinfo`):
    the ``user:pw`` as written, the password as written and percent-decoded, and the HTTP Basic token (base64 of
    ``user:pw``) a client sends for them; [] without any."""
    userinfo = url_userinfo(url)
    if not userinfo:
        return []
    user, _, password = userinfo.partition(":")
    plain = f"{unquote(user)}:{unquote(password)}"
    found = [userinfo, plain, password, unquote(password), base64.b64encode(plain.encode()).decode()]
    return [s for s in dict.fromkeys(found) if s]


def remember_url(url: str) -> str:
    """Remember the credentials of ``url`` (:func:`url_secrets`) so that every text written or shown after is scrubbed
    of them (:func:`scrub`); returns ``url`` unchanged (the client needs them)."""
    remember(*url_secrets(url))
    return url


def url_label(url: str) -> str:
    """``url`` without credentials, query and fragment, as a name part: ``http://user:pw@127.0.0.1:8000/v1`` ->
    ``127.0.0.1-8000-v1`` (what follows the scheme of :func:`redact_url`, ``:`` as ``-``, no ``/`` at the ends;
    the caller still passes it through ``helpers.runfiles.safe_name``)."""
    try:
        shown = redact_url(str(url))
    except ValueError:
        shown = URL_USERINFO_RE.sub("", str(url)).split("?", 1)[0].split("#", 1)[0]
    return shown.split("://", 1)[-1].replace(":", "-").strip("/")


def redact_url(url: str) -> str:
    """URL without ``user:password@`` and without query string (may hold tokens)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))
