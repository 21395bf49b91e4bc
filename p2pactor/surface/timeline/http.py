"""The plain-HTTP side of the timeline server: request heads, the page's files, checks.

The server reads each connection's request head itself (with h11), serves the
dashboard page's static files with plain responses, and hands websocket
upgrades of ``/events`` to trio-websocket with the bytes already read replayed
in front (:class:`ReplayedStream`). Everything else gets a 404.

The dashboard's files are package data under ``p2pactor/surface/dashboard/``:
``index.html`` at ``/`` and ``static/*`` at ``/static/...``.
"""

from __future__ import annotations

import ipaddress
import string
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Final
from urllib.parse import urlsplit

import attrs
import h11
import trio

__all__ = [
    "HttpRequest",
    "ReplayedStream",
    "dashboard_file",
    "forbidden",
    "read_request",
    "send_response",
]

CORK_BYTES: Final = 256 * 1024
"""The most a corked :class:`ReplayedStream` holds before it writes anyway."""

MAX_HEAD_BYTES: Final = 16 * 1024
"""The largest request head accepted; a browser's is a few hundred bytes."""

_CONTENT_TYPES: Final = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".woff2": "font/woff2",
    ".txt": "text/plain; charset=utf-8",
}
_SAFE_PART_CHARS: Final = frozenset(string.ascii_letters + string.digits + "._-")


@attrs.frozen(kw_only=True)
class HttpRequest:
    """A request head, as read off a connection.

    Attributes:
        method: ``GET``, ``HEAD``...
        path: The target's path, undecoded (``/events``).
        query: The target's query string, without ``?``.
        headers: Header values by lower-case name (the last one wins).
        raw: Every byte read from the connection so far, head first.
    """

    method: str
    path: str
    query: str
    headers: dict[str, str]
    raw: bytes

    @property
    def is_websocket(self) -> bool:
        """Whether it asks to upgrade to a websocket."""
        return self.headers.get("upgrade", "").lower() == "websocket"


async def read_request(stream: trio.abc.ReceiveStream) -> HttpRequest | None:
    """Read one request head; None if the peer closed or sent something that isn't HTTP.

    Never reads more than :data:`MAX_HEAD_BYTES` of head (h11 enforces it).
    """
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    raw = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return None
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            if not data:
                return None
            raw += data
            conn.receive_data(bytes(data))
            continue
        if not isinstance(event, h11.Request):
            return None
        target = event.target.decode("latin-1")
        path, _, query = target.partition("?")
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in event.headers}
        return HttpRequest(
            method=event.method.decode("latin-1"),
            path=path,
            query=query,
            headers=headers,
            raw=bytes(raw),
        )


async def send_response(
    stream: trio.abc.SendStream,
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    *,
    head_only: bool = False,
    headers: Sequence[tuple[str, str]] = (),
) -> None:
    """Send one complete response and mark the connection for closing."""
    conn = h11.Connection(h11.SERVER)
    # h11 writes only after it has seen a request: give it a minimal one (a
    # HEAD for a head-only answer, whose Content-Length announces no body).
    method = b"HEAD" if head_only else b"GET"
    conn.receive_data(method + b" / HTTP/1.1\r\nHost: x\r\n\r\n")
    conn.next_event()
    all_headers = [
        ("Content-Type", content_type),
        ("Content-Length", str(len(body))),
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        ("Connection", "close"),
        *headers,
    ]
    out = conn.send(h11.Response(status_code=status, headers=all_headers)) or b""
    if not head_only:
        out += conn.send(h11.Data(data=body)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(out)


class ReplayedStream(trio.abc.Stream):
    """A stream that gives back ``prefix`` before anything else it receives.

    The server reads a request head to route it; trio-websocket must then see
    the connection from its first byte.
    """

    def __init__(self, stream: trio.SocketStream, prefix: bytes) -> None:
        self.stream = stream
        self._prefix = prefix
        self._corked = False
        self._held = bytearray()

    @asynccontextmanager
    async def corked(self) -> AsyncIterator[None]:
        """Hold what is sent in the block and write it at once at the end.

        Many small websocket messages then cost one system call, not one each
        (writes are still flushed every :data:`CORK_BYTES`).
        """
        self._corked = True
        try:
            yield
        finally:
            self._corked = False
            if self._held:
                data, self._held = bytes(self._held), bytearray()
                await self.stream.send_all(data)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:  # noqa: D102
        if self._prefix:
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            await trio.lowlevel.checkpoint()
            return data
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:  # noqa: D102
        if self._corked:
            self._held += data
            if len(self._held) < CORK_BYTES:
                return
            data, self._held = bytes(self._held), bytearray()
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:  # noqa: D102
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:  # noqa: D102
        await self.stream.aclose()


def _dashboard_root() -> Traversable:
    return resources.files("p2pactor.surface") / "dashboard"


def dashboard_file(path: str) -> tuple[bytes, str] | None:
    """The page's file served at ``path`` and its content type, or None.

    ``/`` is ``index.html``; ``/static/A/B`` is ``static/A/B``. Path parts may
    hold only letters, digits, ``.``, ``_`` and ``-``, and may not start with a
    dot: nothing outside the folder (or hidden in it) can be named.
    """
    if path in ("/", "/index.html"):
        parts = ["index.html"]
    elif path.startswith("/static/"):
        parts = ["static", *path.removeprefix("/static/").split("/")]
    else:
        return None
    if not all(p and p[0] != "." and set(p) <= _SAFE_PART_CHARS for p in parts):
        return None
    node = _dashboard_root().joinpath(*parts)
    if not node.is_file():
        return None
    suffix = "." + parts[-1].rsplit(".", 1)[-1] if "." in parts[-1] else ""
    return node.read_bytes(), _CONTENT_TYPES.get(suffix.lower(), "application/octet-stream")


def _hostname(authority: str) -> str:
    """``host`` of ``host:port``, ``[v6]:port``, ``host`` (lower-case)."""
    return (urlsplit(f"//{authority}").hostname or "").lower()


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def forbidden(request: HttpRequest, bound_host: str) -> str | None:
    """Why ``request`` must be refused (HTTP 403), or None.

    A server bound to a loopback address answers only requests addressed to a
    loopback name, so that a web page elsewhere can't reach it through a DNS
    name rebound to 127.0.0.1. A browser's websocket must come from a page of
    the same host (any port: the demo's page reads every node's feed), or both
    must be loopback names.
    """
    host = _hostname(request.headers.get("host", ""))
    if _loopback(bound_host) and not _loopback(host):
        return f"this dashboard answers only on loopback addresses, not {host or 'no host'!r}"
    origin = request.headers.get("origin")
    if request.is_websocket and origin is not None:
        origin_host = (urlsplit(origin).hostname or "").lower()
        if origin_host != host and not (_loopback(origin_host) and _loopback(host)):
            return f"a page from {origin!r} may not read this feed"
    return None
