"""The timeline server: the dashboard page and its websocket feed on one port.

:func:`open_timeline_server` serves a live node; :func:`open_replay_server`
serves recorded event logs to the same page. Both listen on one TCP port
(``127.0.0.1`` unless told otherwise) and answer:

* ``GET /`` and ``GET /static/...``: the page's files (package data);
* ``GET /events`` upgraded to a websocket: the feed of ``docs/timeline.md``;
* anything else: 404.

Each websocket is one task group owned by the server's nursery: a writer that
sends the subscriber's messages in order, and a reader that notices the client
leaving. Neither ever makes the node wait: the node's watcher only appends to
bounded queues (see :mod:`p2pactor.timeline.feed`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Final, Literal, Protocol
from urllib.parse import urlsplit

import trio
from trio_websocket import CloseReason, ConnectionClosed, WebSocketConnection, wrap_server_stream

from p2pactor.config import NodeConfig
from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState, Phase, initial_phase, phase_after
from p2pactor.core.ids import ActorId
from p2pactor.logread import LogReader, read_log
from p2pactor.replay import open_logs
from p2pactor.session import PeerSession
from p2pactor.timeline.feed import (
    FEED_VERSION,
    BadFilter,
    Feed,
    FeedFilters,
    FeedFull,
    FeedLimits,
    FeedStats,
    Subscriber,
    encode,
    event_message,
    peers_message,
)
from p2pactor.timeline.http import (
    HttpRequest,
    ReplayedStream,
    dashboard_file,
    forbidden,
    read_request,
    send_response,
)
from p2pactor.view import control_security

__all__ = [
    "FeedSource",
    "NodeRoutes",
    "TimelineServer",
    "open_replay_server",
    "open_timeline_server",
    "page_url",
]

log = logging.getLogger("p2pactor.timeline")

Mode = Literal["live", "replay"]

_HEAD_TIMEOUT_S: Final = 10.0
_HANDSHAKE_TIMEOUT_S: Final = 10.0
_SHUTDOWN_CLOSE_S: Final = 0.5
_CLIENT_MESSAGE_BYTES: Final = 64 * 1024  # clients have nothing to say; bound what they may
_SNAPSHOT_CHUNK_EVENTS: Final = 500
_SNAPSHOT_CHUNK_BYTES: Final = 256 * 1024  # well under trio-websocket's 1 MiB default


class FeedSource(Protocol):
    """What the live server needs of a node (:class:`p2pactor.node.Node` is one)."""

    @property
    def node_id(self) -> str:
        """The node's id."""
        ...

    @property
    def config(self) -> NodeConfig:
        """The node's configuration (for its block size)."""
        ...

    def watch_events(
        self, watcher: Callable[[Sequence[ev.AnyEvent], ActorState], None]
    ) -> Callable[[], None]:
        """Call ``watcher`` after every actor step; returns an unsubscribe."""
        ...

    def sessions(self) -> list[PeerSession]:
        """The node's live sessions."""
        ...


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_WILDCARDS: Final = frozenset({"0.0.0.0", "::", ""})  # noqa: S104 - recognised, not bound


def _relative_page(feeds: Sequence[str], request_host: str) -> str:
    """``/?feeds=...``, wildcard hosts in ``feeds`` replaced by the browser's host."""
    browser_host = urlsplit(f"//{request_host}").hostname or "127.0.0.1"
    named = []
    for url in feeds:
        parts = urlsplit(url)
        if (parts.hostname or "") in _WILDCARDS and parts.port is not None:
            named.append(parts._replace(netloc=_authority(browser_host, parts.port)).geturl())
        else:
            named.append(url)
    return page_url("/", named)


def page_url(page: str, feeds: Sequence[str]) -> str:
    """The page at ``page`` (``http://HOST:PORT/``) reading every feed in ``feeds``.

    The page's ``feeds`` parameter lists websocket URLs, comma-separated; see
    ``docs/timeline.md``.
    """
    return f"{page}?feeds={','.join(feeds)}"


class TimelineServer:
    """A running timeline server.

    Create it with :func:`open_timeline_server` or :func:`open_replay_server`.

    Attributes:
        mode: ``"live"`` (a node's feed) or ``"replay"`` (recorded logs).
        host: The address it is bound to.
        port: The port it is bound to.
        feed: The live feed (None in replay mode).
    """

    def __init__(
        self, mode: Mode, host: str, port: int, feed: Feed | None, site: _Site | None = None
    ) -> None:
        self.mode: Mode = mode
        self.host = host
        self.port = port
        self.feed = feed
        self._site = site

    def __repr__(self) -> str:
        return f"<TimelineServer {self.mode} {self.url}>"

    @property
    def url(self) -> str:
        """The dashboard page: ``http://HOST:PORT/``."""
        return f"http://{_authority(self.host, self.port)}/"

    @property
    def events_url(self) -> str:
        """The feed: ``ws://HOST:PORT/events``."""
        return f"ws://{_authority(self.host, self.port)}/events"

    def stats(self) -> FeedStats | None:
        """The live feed's counts (None in replay mode)."""
        return None if self.feed is None else self.feed.stats()

    def set_page_feeds(self, feeds: Sequence[str] | None) -> None:
        """Make ``GET /`` (without a query) redirect to the page reading ``feeds``.

        ``p2pactor demo --dashboard`` runs one server per node process and
        gives the first one every node's feed URL, so that the bare
        ``http://HOST:PORT/`` shows every node. A feed URL whose host is a
        wildcard address (``0.0.0.0``, ``::``) gets the host the browser used.
        None (the default) serves the page as is: it reads this server's feed.
        """
        if self._site is not None:
            self._site.page_feeds = None if feeds is None else list(feeds)


# --- connections ----------------------------------------------------------------------


class _Site:
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
            return  # /metrics and /status have their own Host/Origin rule (httpserve)
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
                    await self._run_session(_Sender(ws, replayed), filters, subscriber)
                nursery.cancel_scope.cancel()  # trio-websocket's reader task
        finally:
            if subscriber is not None:
                self.unsubscribe(subscriber)

    async def _run_session(
        self, sender: _Sender, filters: FeedFilters, subscriber: Subscriber | None
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
        self, sender: _Sender, filters: FeedFilters, subscriber: Subscriber | None
    ) -> None:
        """Send the feed to one websocket until there is nothing more to send."""
        raise NotImplementedError


class _Sender:
    """Sends messages on a websocket, knowing whether a send is half done."""

    def __init__(self, ws: WebSocketConnection, stream: ReplayedStream) -> None:
        self.ws = ws
        self.stream = stream
        self.busy = False

    async def send(self, text: str) -> None:
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


def _hello(mode: Mode, nodes: list[dict[str, Any]], filters: FeedFilters) -> str:
    return encode(
        {
            "type": "hello",
            "version": FEED_VERSION,
            "mode": mode,
            "nodes": nodes,
            "filters": filters.as_json(),
        }
    )


def _snapshot(texts: list[str], truncated: int) -> str:
    return f'{{"type":"snapshot","events":[{",".join(texts)}],"truncated":{truncated}}}'


def _chunks(texts: Iterator[str]) -> Generator[list[str], None, None]:
    """Group encoded events into snapshot messages of bounded size."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        if chunk and (
            len(chunk) >= _SNAPSHOT_CHUNK_EVENTS or size + len(text) > _SNAPSHOT_CHUNK_BYTES
        ):
            yield chunk
            chunk, size = [], 0
        chunk.append(text)
        size += len(text) + 1
    if chunk:
        yield chunk


async def _listen(host: str, port: int) -> tuple[list[trio.SocketListener], int]:
    """Bind ``host:port``; returns the listeners and the port they got."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len(listeners) > 1:
        # One name, several addresses: each would get its own ephemeral port.
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    return listeners, listeners[0].socket.getsockname()[1]


# --- live -----------------------------------------------------------------------------


NodeRoutes = Callable[[trio.SocketStream, HttpRequest, str], Awaitable[bool]]
"""``(stream, request, bound host) -> answered?``: more routes a live site serves."""


class _LiveSite(_Site):
    def __init__(
        self,
        bound_host: str,
        node: FeedSource,
        feed: Feed,
        origin: tuple[float, float],
        routes: NodeRoutes | None,
    ):
        super().__init__(bound_host)
        self._node = node
        self._feed = feed
        self._routes = routes
        wall, mono = origin
        self._nodes = [
            {
                "node": node.node_id,
                "created_wall": wall,
                "created_mono": mono,
                "security": control_security(node),
            }
        ]

    async def answer_node(self, stream: trio.SocketStream, request: HttpRequest) -> bool:
        if self._routes is None:
            return False  # served without a node's /metrics and /status
        return await self._routes(stream, request, self.bound_host)

    def subscribe(self, filters: FeedFilters) -> Subscriber | None:
        return self._feed.subscribe(filters)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self._feed.unsubscribe(subscriber)

    async def session(
        self, sender: _Sender, filters: FeedFilters, subscriber: Subscriber | None
    ) -> None:
        assert subscriber is not None
        await sender.send(_hello("live", self._nodes, filters))
        records, subscriber.snapshot = subscriber.snapshot, []
        truncated = subscriber.truncated
        total = len(records)
        for chunk in _chunks(r.text() for r in records):
            await sender.send(_snapshot(chunk, truncated))
            truncated = 0  # said once, in the first snapshot message
        del records
        await sender.send(_snapshot_end(total, subscriber.truncated))
        limits = self._feed.limits
        while (batch := await subscriber.next_batch()) is not None:
            await sender.send_batch(batch)
            if len(batch) < limits.queue // 2:
                # Caught up: let events gather for a moment, then send them
                # together. Waking for every event, with every subscriber, is
                # what would cost the node's loop the most.
                await trio.sleep(limits.batch_interval_s)
        if subscriber.evicted:
            limit = self._feed.limits.max_behind_s
            await sender.ws.aclose(
                1013, f"this subscriber fell behind for over {limit:g} s; reconnect"
            )

    async def tick(self) -> None:
        """Send ``peers`` and ``counters`` every interval, to everyone."""
        feed = self._feed
        while True:
            await trio.sleep(feed.limits.status_interval_s)
            feed.broadcast(peers_message(feed.node, self._node.sessions()))
            feed.broadcast(feed.counters.message(feed.node))

    async def watch_laggards(self) -> None:
        """Evict subscribers that stay behind too long."""
        feed = self._feed
        period = min(1.0, feed.limits.max_behind_s / 4)
        while True:
            await trio.sleep(period)
            for subscriber in feed.evict_laggards(trio.current_time()):
                log.warning(
                    "closing a timeline subscriber of %s: behind for over %g s, %d events "
                    "dropped; the page reconnects (if this repeats, the browser or its "
                    "network is too slow for this node's event rate)",
                    feed.node,
                    feed.limits.max_behind_s,
                    subscriber.dropped,
                    extra={"node": feed.node},
                )


def _snapshot_end(events: int, truncated: int, **extra: Any) -> str:
    return encode({"type": "snapshot_end", "events": events, "truncated": truncated, **extra})


@asynccontextmanager
async def open_timeline_server(
    node: FeedSource,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    limits: FeedLimits | None = None,
    routes: NodeRoutes | None = None,
) -> AsyncIterator[TimelineServer]:
    """Serve ``node``'s live timeline and the dashboard page until the block exits.

    Args:
        node: The node to watch.
        host: The address to bind; anything but loopback is an explicit choice
            (the feed shows peers, request ids and timings).
        port: The port; 0 picks a free one (see :attr:`TimelineServer.port`).
        limits: Queue, history and eviction bounds.
        routes: The node's own routes (``/metrics``, ``/status``) to serve on
            the same port; the operator surface passes them.

    Raises:
        OSError: The address can't be bound (the port is taken, say).
    """
    feed = Feed(node.node_id, block_len=node.config.block_len, limits=limits)
    origin = (time.time(), trio.current_time())
    site = _LiveSite(host, node, feed, origin, routes)
    unwatch = node.watch_events(feed.watch)
    try:
        listeners, bound = await _listen(host, port)
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, site.handle, listeners)
            nursery.start_soon(site.tick)
            nursery.start_soon(site.watch_laggards)
            server = TimelineServer("live", host, bound, feed, site)
            log.info("timeline of %s at %s", node.node_id, server.url, extra={"node": node.node_id})
            yield server
            nursery.cancel_scope.cancel()
    finally:
        unwatch()


# --- replay ---------------------------------------------------------------------------


class _ReplaySite(_Site):
    def __init__(self, bound_host: str, paths: list[str], readers: list[LogReader]):
        super().__init__(bound_host)
        self._paths = paths
        self._nodes = [
            {
                "node": r.header.node_id,
                "created_wall": r.header.created_wall,
                "created_mono": r.header.created_mono,
                "security": None,  # logs do not record it
                "path": r.path,
            }
            for r in readers
        ]

    async def session(
        self, sender: _Sender, filters: FeedFilters, subscriber: Subscriber | None
    ) -> None:
        del subscriber
        await sender.send(_hello("replay", self._nodes, filters))
        problems: list[dict[str, Any]] = []
        counts = [0]
        chunks = _chunks(self._texts(filters, problems, counts))
        try:
            while True:
                # Reading and encoding a big log takes a while: off the trio thread.
                chunk = await trio.to_thread.run_sync(next, chunks, None)
                if chunk is None:
                    break
                await sender.send(_snapshot(chunk, 0))
        finally:
            chunks.close()
        await sender.send(_snapshot_end(counts[0], 0, problems=problems))
        await trio.sleep_forever()  # until the client leaves or the server stops

    def _texts(
        self, filters: FeedFilters, problems: list[dict[str, Any]], counts: list[int]
    ) -> Iterator[str]:
        """Every accepted event of every log, encoded, file by file (a worker thread)."""
        for path in self._paths:
            reader = read_log(path)
            node = reader.node_id
            phases: dict[ActorId, Phase] = {}
            for event in reader:
                actor = event.actor
                phase = phase_after(phases.get(actor) or initial_phase(actor), event)
                if isinstance(event, ev.Finished | ev.Closed):
                    phases.pop(actor, None)  # replay's memory stays bounded by actors alive
                else:
                    phases[actor] = phase
                if filters.accepts(event):
                    counts[0] += 1
                    yield encode(event_message(node, event, phase))
            if reader.problem is not None:
                problems.append(
                    {
                        "node": node,
                        "path": path,
                        "problem": str(reader.problem),
                        "fatal": reader.problem.fatal,
                    }
                )


@asynccontextmanager
async def open_replay_server(
    paths: Sequence[str | os.PathLike[str]], *, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[TimelineServer]:
    """Serve recorded event logs to the dashboard page until the block exits.

    Every subscriber gets ``hello`` (mode ``replay``, each log's clock origin),
    then every event of every log as ``snapshot`` messages, then
    ``snapshot_end``, and nothing more. Logs are read again for each
    subscriber, streamed: their size does not matter.

    Raises:
        LogFormatError: A file is not a p2pactor event log this version reads.
        OSError: A file can't be opened, or the address can't be bound.
    """
    names = [os.fspath(p) for p in paths]
    site = _ReplaySite(host, names, open_logs(names))
    listeners, bound = await _listen(host, port)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, site.handle, listeners)
        server = TimelineServer("replay", host, bound, None, site)
        log.info("replay of %d logs at %s", len(names), server.url)
        yield server
        nursery.cancel_scope.cancel()
