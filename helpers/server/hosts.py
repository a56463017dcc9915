"""One spelling per host address, for telling two URLs of one server apart (``compare-engines --a`` / ``--b``:
:func:`helpers.server.client.server_key`). No DNS lookup: two names of one address stay two names."""
from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

#: what an IPv4 address in one of the C resolver's other spellings can hold (digits, hex digits, ``x``, dots)
_IPV4_SPELLING = re.compile(r"[0-9a-fA-FxX.]+")


def canonical_host(host: str) -> str:
    """``host`` in one spelling per address, without any DNS lookup: lower-cased, a trailing ``.`` dropped; an IPv4
    address in any form the C resolver takes (``127.1``, ``2130706433``, ``0x7f.0.0.1``: :func:`socket.inet_aton`,
    which is how a client resolves such a host) as its dotted quad; an IPv6 address compressed (:mod:`ipaddress`),
    an IPv4-mapped one (``::ffff:127.0.0.1``) as its IPv4 address. A name is only lower-cased.

    Args / returns: a URL's host (``urlsplit(url).hostname``: no brackets) -> str."""
    host = host.lower()
    if len(host) > 1:
        host = host.rstrip(".")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ip.ipv4_mapped) if ip.ipv4_mapped is not None else str(ip)
    if ip is not None:
        return str(ip)
    if _IPV4_SPELLING.fullmatch(host) and any(c.isdigit() for c in host):
        try:
            return socket.inet_ntoa(socket.inet_aton(host))
        except OSError:
            pass
    return host


def is_local_url(url: str) -> bool:
    """The server at ``url`` runs on this machine (a loopback host: its load is the one a measurement records)."""
    host = (urlsplit(url).hostname or "").lower()
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
