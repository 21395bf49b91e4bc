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
bounded queues (see :mod:`p2pactor.surface.timeline.feed`).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import trio

from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState, Phase, initial_phase, phase_after
from p2pactor.core.ids import ActorId
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.logread import LogReader, read_log
from p2pactor.runtime.peers import PeerRegistry
from p2pactor.surface.replay import open_logs
from p2pactor.surface.status import control_security
from p2pactor.surface.timeline.feed import Feed, FeedFilters, FeedLimits, FeedStats, Subscriber
from p2pactor.surface.timeline.http import HttpRequest
from p2pactor.surface.timeline.messages import (
    Mode,
    encode,
    event_message,
    hello_message,
    peers_message,
    snapshot_chunks,
    snapshot_end_message,
    snapshot_message,
)
from p2pactor.surface.timeline.site import Sender, Site, authority, page_url

__all__ = [
    "FeedSource",
    "NodeRoutes",
    "TimelineServer",
    "open_replay_server",
    "open_timeline_server",
    "page_url",
]

log = logging.getLogger("p2pactor.timeline")


class FeedSource(Protocol):
    """What the live server needs of a node (:class:`p2pactor.runtime.node.Node` is one)."""

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

    @property
    def peers(self) -> PeerRegistry:
        """The node's sessions."""
        ...


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
        self, mode: Mode, host: str, port: int, feed: Feed | None, site: Site | None = None
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
        return f"http://{authority(self.host, self.port)}/"

    @property
    def events_url(self) -> str:
        """The feed: ``ws://HOST:PORT/events``."""
        return f"ws://{authority(self.host, self.port)}/events"

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


class _LiveSite(Site):
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
        self, sender: Sender, filters: FeedFilters, subscriber: Subscriber | None
    ) -> None:
        assert subscriber is not None
        await sender.send(hello_message("live", self._nodes, filters))
        records, subscriber.snapshot = subscriber.snapshot, []
        truncated = subscriber.truncated
        total = len(records)
        for chunk in snapshot_chunks(r.text() for r in records):
            await sender.send(snapshot_message(chunk, truncated))
            truncated = 0  # said once, in the first snapshot message
        del records
        await sender.send(snapshot_end_message(total, subscriber.truncated))
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
            feed.broadcast(peers_message(feed.node, self._node.peers.sessions()))
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


class _ReplaySite(Site):
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
        self, sender: Sender, filters: FeedFilters, subscriber: Subscriber | None
    ) -> None:
        del subscriber
        await sender.send(hello_message("replay", self._nodes, filters))
        problems: list[dict[str, Any]] = []
        counts = [0]
        chunks = snapshot_chunks(self._texts(filters, problems, counts))
        try:
            while True:
                # Reading and encoding a big log takes a while: off the trio thread.
                chunk = await trio.to_thread.run_sync(next, chunks, None)
                if chunk is None:
                    break
                await sender.send(snapshot_message(chunk, 0))
        finally:
            chunks.close()
        await sender.send(snapshot_end_message(counts[0], 0, problems=problems))
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
