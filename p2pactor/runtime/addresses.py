"""The addresses a node binds, is known by and may dial: wildcards, loopback, hosts.

A node binds one address and is known by another (``docs/deploy.md``):
``bind_host`` is where the ROUTER binds (``0.0.0.0``, the pod's interface), ``host``
the address peers dial back, half of the node's id. A wildcard ``host`` is refused
when the config is made, and a node known by a loopback ``host`` never dials (nor
accepts) a peer on another host (:func:`dial_refusal`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable


def _bare_host(host: str) -> str:
    # An IPv6 literal may come bracketed, as in a URL or a ZeroMQ endpoint.
    host = host.strip()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None  # a name


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is a bind-anything address (``0.0.0.0``, ``::``, ``*``, empty).

    Such an address can be bound but never dialed: a node must not be known by one.
    """
    host = _bare_host(host)
    return host in ("", "*") or bool((ip := _address(host)) and ip.is_unspecified)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, ``127.x``, ``::1``)."""
    host = _bare_host(host).lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):  # RFC 6761: always loopback
        return True
    return bool((ip := _address(host)) and ip.is_loopback)  # another name may resolve anywhere


def node_id_port(address: str) -> int | None:
    """The port of a node id (``host:port``), or None if ``address`` is not one.

    The host is not empty and holds no space nor any of ``,"'#/;`` (separators
    of address lists, key files and ZeroMQ endpoints); the port is digits, at
    most 65535. Port 0 is for callers to refuse: only a node yet to bind has it.
    """
    host, _, port = address.rpartition(":")  # no ":": no host
    valid = host and port.isascii() and port.isdigit() and int(port) <= 65535
    return int(port) if valid and not any(c.isspace() or c in ",\"'#/;" for c in host) else None


def peer_ids(value: str | Iterable[str]) -> frozenset[str]:
    """Peer ids (``host:port``) from a collection, or from one comma-separated string.

    The string is what a flag, a variable or a tier option gives (``"a:1, b:2"``).
    Each id is stripped; blank ones are dropped. Not checked (:func:`node_id_port`).
    """
    items = value.split(",") if isinstance(value, str) else value
    return frozenset(stripped for p in items if (stripped := p.strip()))


def peer_host(peer_id: str) -> str:
    """The host half of a node id (``host:port``)."""
    return peer_id.rpartition(":")[0]
