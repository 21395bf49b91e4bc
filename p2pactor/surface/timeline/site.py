"""One connection of a timeline server: routing, the websocket handshake, sending.

:class:`Site` answers one TCP connection with one plain response or one
websocket; the live and replay servers (:mod:`p2pactor.surface.timeline.server`)
subclass it for what their websocket session sends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Final
from urllib.parse import urlsplit

import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, wrap_server_stream

from p2pactor.surface.timeline.feed import BadFilter, FeedFilters, FeedFull, Subscriber
from p2pactor.surface.timeline.http import (
    HttpRequest,
    ReplayedStream,
    dashboard_file,
    forbidden,
    read_request,
    send_response,
)

__all__ = ["Sender", "Site", "authority", "page_url"]

log = logging.getLogger("p2pactor.timeline")

_HEAD_TIMEOUT_S: Final = 10.0
_HANDSHAKE_TIMEOUT_S: Final = 10.0
_SHUTDOWN_CLOSE_S: Final = 0.5
_CLIENT_MESSAGE_BYTES: Final = 64 * 1024  # clients have nothing to say; bound what they may


def authority(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})  # noqa: S104 - recognised, not bound


def _relative_page(feeds: Sequence[str], request_host: str) -> str:
    """``/?feeds=...``, wildcard hosts in ``feeds`` replaced by the browser's host."""
    browser_host = urlsplit(f"//{request_host}").hostname or "127.0.0.1"
    named = []
    for url in feeds:
        parts = urlsplit(url)
        if (parts.hostname or "") in _WILDCARDS and parts.port is not None:
            named.append(parts._replace(netloc=authority(browser_host, parts.port)).geturl())
        else:
            named.append(url)
    return page_url("/", named)


def page_url(page: str, feeds: Sequence[str]) -> str:
    """The page at ``page`` (``http://HOST:PORT/``) reading every feed in ``feeds``.

    The page's ``feeds`` parameter lists websocket URLs, comma-separated; see
    ``docs/timeline.md``.
    """
    return f"{page}?feeds={','.join(feeds)}"


class Site:
    """Routes one connection; the mode's websocket session is :meth:`session`."""

    def __init__(self, bound_host: str) -> None:
        self.bound_host = bound_host
        self.page_feeds: list[str] | None = None

    async def handle(self, stream: trio.SocketStream) -> None:
        """Serve one TCP connection: one plain response, or one websocket.

        Never raises: the server runs inside the node's nursery, and nothing a
        browser does may take the node down.
        """
        try:
            request: HttpRequest | None = None
            with trio.move_on_after(_HEAD_TIMEOUT_S):
                request = await read_request(stream)
            if request is not None:  # else not HTTP, too big or too slow: just close
                await self._route(stream, request)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the client went away; nothing to tell anyone
        except Exception:
            log.exception(
                "the timeline server failed on a connection; it goes on (a bug in p2pactor: "
                "please report it with this traceback)"
            )
        finally:
            # One request per connection (responses say Connection: close).
            # aclose never blocks on the peer; it cannot fail but on a cancel.
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await stream.aclose()

    async def _route(self, stream: trio.SocketStream, request: HttpRequest) -> None:
        if await self.answer_node(stream, request):
            return  # /metrics and /status have their own Host/Origin rule (attach)
        problem = forbidden(request, self.bound_host)
        if problem is not None:
            await send_response(stream, 403, problem.encode() + b"\n")
            return
        if request.path == "/events":
            if not request.is_websocket:
                await send_response(
                    stream, 426, b"/events is a websocket\n", headers=[("Upgrade", "websocket")]
                )
                return
            if not request.headers.get("sec-websocket-key"):
                await send_response(stream, 400, b"not a websocket handshake\n")
                return
            await self._websocket(stream, request)
            return
        if request.method not in ("GET", "HEAD"):
            await send_response(stream, 405, b"only GET\n", headers=[("Allow", "GET, HEAD")])
            return
        if request.path == "/" and not request.query and self.page_feeds:
            location = _relative_page(self.page_feeds, request.headers.get("host", ""))
            await send_response(
                stream, 302, f"see {location}\n".encode(), headers=[("Location", location)]
            )
            return
        found = await trio.to_thread.run_sync(dashboard_file, request.path)
        if found is None:
            await send_response(stream, 404, f"no page at {request.path}\n".encode())
            return
        body, content_type = found
        await send_response(stream, 200, body, content_type, head_only=request.method == "HEAD")

    async def _websocket(self, stream: trio.SocketStream, request: HttpRequest) -> None:
        try:
            filters = FeedFilters.from_query(request.query)
        except BadFilter as exc:
            await send_response(stream, 400, f"{exc}\n".encode())
            return
        subscriber: Subscriber | None = None
        try:
            subscriber = self.subscribe(filters)
        except FeedFull as exc:
            await send_response(stream, 503, f"{exc}\n".encode(), headers=[("Retry-After", "5")])
            return
        try:
            async with trio.open_nursery() as nursery:
                ws: WebSocketConnection | None = None
                replayed = ReplayedStream(stream, request.raw)
                with trio.move_on_after(_HANDSHAKE_TIMEOUT_S):
                    handshake = await wrap_server_stream(
                        nursery,
                        replayed,
                        message_queue_size=1,
                        max_message_size=_CLIENT_MESSAGE_BYTES,
                    )
                    ws = await handshake.accept()
                if ws is not None:
                    await self._run_session(Sender(ws, replayed), filters, subscriber)
                nursery.cancel_scope.cancel()  # trio-websocket's reader task
        finally:
            if subscriber is not None:
                self.unsubscribe(subscriber)

    async def _run_session(
        self, sender: Sender, filters: FeedFilters, subscriber: Subscriber | None
    ) -> None:
        ws = sender.ws
        scope = subscriber.scope if subscriber is not None else trio.CancelScope()
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_until_client_leaves, ws, nursery.cancel_scope)
                    with contextlib.suppress(ConnectionClosed):  # the client left mid-send
                        await self.session(sender, filters, subscriber)
                    nursery.cancel_scope.cancel()
        finally:
            if not sender.busy and ws.closed is None:
                # A clean goodbye when the server stops, unless a frame was cut
                # in half by a cancellation (a close after it would garble it).
                with trio.CancelScope(shield=True), trio.move_on_after(_SHUTDOWN_CLOSE_S):
                    await ws.aclose(1001, "the server is shutting down")

    async def answer_node(self, stream: trio.SocketStream, request: HttpRequest) -> bool:
        """Answer ``/metrics`` or ``/status`` if this site serves a node; False otherwise."""
        del stream, request
        return False

    def subscribe(self, filters: FeedFilters) -> Subscriber | None:
        """A live subscriber for a new connection (None in replay mode)."""
        del filters
        return None

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """The connection of ``subscriber`` ended."""
        del subscriber

    async def session(
        self, sender: Sender, filters: FeedFilters, subscriber: Subscriber | None
    ) -> None:
        """Send the feed to one websocket until there is nothing more to send."""
        raise NotImplementedError


class Sender:
    """Sends messages on a websocket, knowing whether a send is half done."""

    def __init__(self, ws: WebSocketConnection, stream: ReplayedStream) -> None:
        self.ws = ws
        self.stream = stream
        self.busy = False

    async def send(self, text: str) -> None:
        """Send one message."""
        self.busy = True
        await self.ws.send_message(text)
        self.busy = False

    async def send_batch(self, texts: list[str]) -> None:
        """Send ``texts`` as as many messages, written to the socket together."""
        self.busy = True
        try:
            async with self.stream.corked():
                for text in texts:
                    await self.ws.send_message(text)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            # The held bytes went straight to the socket: say it as
            # trio-websocket says it when its own write finds the peer gone.
            raise ConnectionClosed(CloseReason(1006, "the connection broke")) from exc
        self.busy = False


async def _until_client_leaves(ws: WebSocketConnection, scope: trio.CancelScope) -> None:
    """Read (and ignore) what the client sends; end the session when it leaves."""
    try:
        while True:
            await ws.get_message()
    except ConnectionClosed:
        pass
    scope.cancel()
