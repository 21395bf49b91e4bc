"""The live timeline: a real websocket client against real nodes' feeds.

Nodes run on the in-memory transports (``tests/cluster.py``); the dashboard
server, its HTTP side and every websocket are real TCP on loopback, and the
client is trio-websocket's. The last test runs ``p2pactor demo --dashboard 0``
as a user would and reads its printed URL's feeds.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
    wrap_client_stream,
)

from p2pactor.core import events as ev
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.logread import read_log
from p2pactor.surface.attach import OperatorSurface
from p2pactor.surface.status import control_security
from p2pactor.surface.timeline import (
    BadFilter,
    Feed,
    FeedFilters,
    FeedLimits,
    open_replay_server,
    open_timeline_server,
)
from tests.cluster import Cluster, key, node_id, open_cluster
from tests.test_directory import linked, until
from tests.test_directory import pull as locate_and_pull
from tests.test_node import pull

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 60  # generous: the test machine may be loaded


# --- a websocket client ----------------------------------------------------------------


async def receive(ws: WebSocketConnection) -> dict[str, Any]:
    """The next message, decoded."""
    with trio.fail_after(WAIT_S):
        message = json.loads(await ws.get_message())
    assert isinstance(message, dict)
    return message


async def opening(ws: WebSocketConnection) -> tuple[dict[str, Any], list[dict[str, Any]], dict]:
    """``hello``, the snapshot's events (every ``snapshot`` message), ``snapshot_end``."""
    hello = await receive(ws)
    assert hello["type"] == "hello", hello
    events: list[dict[str, Any]] = []
    while True:
        message = await receive(ws)
        if message["type"] == "snapshot_end":
            return hello, events, message
        assert message["type"] == "snapshot", message
        events.extend(message["events"])


async def events_until(
    ws: WebSocketConnection, done: Any, *, into: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """Collect ``event`` (and ``gap``) messages until ``done(collected)`` is true."""
    collected = [] if into is None else into
    while not done(collected):
        message = await receive(ws)
        if message["type"] in ("event", "gap"):
            collected.append(message)
    return collected


def finished(request: str) -> Any:
    """A ``done`` for :func:`events_until`: the consumer of ``request`` has finished."""
    return lambda got: any(
        e["type"] == "event" and e["kind"] == "Finished" and e["request"] == request for e in got
    )


async def rejection(
    url: str, headers: list[tuple[bytes, bytes]] | None = None
) -> ConnectionRejected:
    """How the server refuses a websocket handshake (on a stream we close ourselves:
    trio-websocket leaves a refused connection's socket to the garbage collector)."""
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    refusals: list[ConnectionRejected] = []
    async with stream:
        try:
            with trio.fail_after(WAIT_S):
                async with trio.open_nursery() as nursery:
                    authority = f"{parts.hostname}:{parts.port}"
                    await wrap_client_stream(
                        nursery, stream, authority, target, extra_headers=headers
                    )
                    nursery.cancel_scope.cancel()
        except* ConnectionRejected as group:
            refusals.extend(e for e in group.exceptions if isinstance(e, ConnectionRejected))
    if refusals:
        return refusals[0]
    pytest.fail(f"{url} accepted the handshake")


def feed_url(node: OperatorSurface, query: str = "") -> str:
    assert node.dashboard is not None
    return node.dashboard.events_url + (f"?{query}" if query else "")


def logged(cluster: Cluster, name: str) -> list[tuple[str, int]]:
    """(actor, seq) of every event in ``name``'s log, in the order it was written."""
    return [(str(e.actor), e.seq) for e in cluster[name].log.recent()]


def ids(events: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(e["actor"], e["seq"]) for e in events if e["type"] == "event"]


@asynccontextmanager
async def dashboards(**config: Any) -> AsyncIterator[Cluster]:
    """Nodes a and b, each serving its timeline on a free loopback port."""
    async with open_cluster("a", "b", dashboard_port=0, **config) as cluster:
        yield cluster


async def http(
    port: int, target: str, *, host: str = "127.0.0.1", method: str = "GET", extra: str = ""
) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 request; the status, headers (lower-case) and body."""
    with trio.fail_after(WAIT_S):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            head = f"{method} {target} HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n"
            await stream.send_all(head.encode())
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
    raw_head, _, body = data.partition(b"\r\n\r\n")
    lines = raw_head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def task_count() -> int:
    """Tasks alive in this trio run."""

    def walk(task: trio.lowlevel.Task) -> int:
        return 1 + sum(walk(t) for n in task.child_nurseries for t in n.child_tasks)

    return walk(trio.lowlevel.current_root_task())


async def wait_for(condition: Any, what: str) -> None:
    """Poll ``condition`` (state of the server, which has no event to wait on)."""
    with trio.fail_after(WAIT_S):
        while not condition():  # noqa: ASYNC110 - nothing to wait on but the state
            await trio.sleep(0.01)
    assert condition(), what


async def until_closed(ws: WebSocketConnection) -> ConnectionClosed:
    """Read until the connection closes; how it closed."""
    with trio.fail_after(WAIT_S):
        while True:
            try:
                await ws.get_message()
            except ConnectionClosed as closed:
                return closed


# --- snapshot, then live ---------------------------------------------------------------


async def test_a_subscriber_gets_hello_then_the_snapshot_then_live_events_in_order() -> None:
    async with dashboards() as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(*[key(i) for i in range(8)])
        assert await pull("a", cluster, "b", "req-1", [key(i) for i in range(6)]) == 6
        a.node.finish("req-1")
        async with open_websocket_url(feed_url(a.surface)) as ws:
            hello, snapshot, end = await opening(ws)
            assert hello["version"] == 1
            assert hello["mode"] == "live"
            assert hello["filters"] == {"peer": None, "request": None, "kinds": None}
            [info] = hello["nodes"]
            assert info["node"] == a.id
            assert info["security"] == "none"  # the in-memory transport claims nothing
            assert isinstance(info["created_wall"], float)
            assert isinstance(info["created_mono"], float)
            # The snapshot is req-1's whole history, in the order the node logged it.
            assert snapshot
            assert {e["request"] for e in snapshot} == {"req-1"}
            assert end == {"type": "snapshot_end", "events": len(snapshot), "truncated": 0}
            first = snapshot[0]
            assert first["type"] == "event"
            assert first["node"] == a.id
            assert first["role"] == "consumer"
            assert first["peer"] == b.id
            assert first["seq"] == 1  # seqs start at 1
            assert {"at", "kind", "phase", "detail", "data", "incarnation"} <= first.keys()
            assert ids(snapshot) == logged(cluster, "a")
            assert snapshot[-1]["phase"] == "done"

            # Now live: a second request, event by event.
            assert await pull("a", cluster, "b", "req-2", [key(i) for i in range(4, 8)]) == 4
            a.node.finish("req-2")
            live = await events_until(ws, finished("req-2"))
            assert all(e["type"] == "event" for e in live)  # nothing lost: no gap
            assert ids(snapshot + live) == logged(cluster, "a")
            phases = [e["phase"] for e in live]
            assert phases[0] in ("registered", "probing")
            assert "fetch_sent" in phases
            assert phases[-1] == "done"
            kinds = [e["kind"] for e in live]
            assert kinds.index("Probed") < kinds.index("LookupResp") < kinds.index("FetchSent")
            resp = live[kinds.index("LookupResp")]
            assert resp["data"]["hits"] == 4  # lists become counts
            assert "4 hits" in resp["detail"] or "hits" in resp["detail"]

            # Status messages come every second, to everyone.
            seen: dict[str, dict[str, Any]] = {}
            with trio.fail_after(WAIT_S):
                while not {"peers", "counters"} <= seen.keys():
                    message = await receive(ws)
                    seen[message["type"]] = message
            assert seen["counters"]["node"] == a.id
            assert seen["counters"]["lookups"] == 2
            assert seen["counters"]["keys_hit"] == 10
            assert seen["counters"]["bytes"] == 10 * a.node.config.block_len
            assert seen["counters"]["failures"] == 0
            assert [p["peer"] for p in seen["peers"]["peers"]] == [b.id]
        stats = a.surface.dashboard.stats() if a.surface.dashboard else None
        assert stats is not None
        assert stats.dropped == 0


async def test_a_late_subscriber_sees_a_request_in_flight_from_its_first_event() -> None:
    async with dashboards() as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(1), key(2))
        await a.node.lookup(b.id, "open-req", [key(1), key(2)])  # looked up, not yet fetched
        async with open_websocket_url(feed_url(a.surface)) as ws:
            _, snapshot, _ = await opening(ws)
            mine = [e for e in snapshot if e["request"] == "open-req"]
            assert mine
            assert mine[0]["seq"] == 1
            assert mine[-1]["phase"] == "probing"
            a.node.finish("open-req")  # nothing fetched: it ends here
            live = await events_until(ws, finished("open-req"))
            assert ids(snapshot + live) == logged(cluster, "a")


async def test_the_peer_a_node_chose_reaches_the_feed_with_its_claims() -> None:
    async with open_cluster("a", "b", "c", dashboard_port=0) as cluster:
        a, b, c = cluster["a"], cluster["b"], cluster["c"]
        b.store(*[key(i) for i in range(5)])
        c.store(key(0), key(1))  # a shorter run of the same prefix
        await linked(b, a)
        await linked(c, a)
        await until(lambda: len(a.node.directory.index.peer(b.id).claims) == 5)
        await until(lambda: len(a.node.directory.index.peer(c.id).claims) == 2)
        peer, hits = await locate_and_pull(a, "auto-req", [key(i) for i in range(7)])
        assert (peer, len(hits)) == (b.id, 5)
        assert await pull("a", cluster, "c", "named-req", [key(0)]) == 1  # names its peer
        a.node.finish("named-req")
        async with open_websocket_url(feed_url(a.surface)) as ws:
            _, snapshot, _ = await opening(ws)
        probed = {e["request"]: e for e in snapshot if e["kind"] == "Probed"}
        assert sorted(probed) == ["auto-req", "named-req"]
        source = probed["auto-req"]["data"]["source"]
        assert source["chosen"] == b.id == probed["auto-req"]["peer"]
        assert source["keys"] == 7  # its run of 5 and the 2 keys past it
        assert [(claim["peer"], claim["run"]) for claim in source["claims"]] == [
            (b.id, 5),
            (c.id, 2),
        ]
        assert source["reason"] == "longest worthwhile run: 5 of 7 keys"
        [logged_probed] = [
            e
            for e in a.log.recent()
            if isinstance(e, ev.Probed) and e.actor.kv_request_id == "auto-req"
        ]
        assert logged_probed.source is not None
        assert source["claims"][0]["score"] == logged_probed.source.claims[0].score
        # A request that named its peer: no source, as before sources existed.
        assert "source" not in probed["named-req"]["data"]
        assert probed["named-req"]["data"]["keys"] == 1


# --- filters ---------------------------------------------------------------------------


async def test_filters_by_request_peer_and_kind_apply_to_snapshot_and_live() -> None:
    async with open_cluster("a", "b", "c", dashboard_port=0) as cluster:
        a, b, c = cluster["a"], cluster["b"], cluster["c"]
        b.store(*[key(i) for i in range(4)])
        c.store(*[key(i) for i in range(10, 14)])
        assert await pull("a", cluster, "b", "from-b", [key(0), key(1)]) == 2
        a.node.finish("from-b")
        assert await pull("a", cluster, "c", "from-c", [key(10), key(11)]) == 2
        a.node.finish("from-c")
        async with (
            open_websocket_url(feed_url(a.surface, "request=from-c")) as by_request,
            open_websocket_url(feed_url(a.surface, f"peer={b.id}")) as by_peer,
            open_websocket_url(feed_url(a.surface, "kinds=LookupResp,%20FetchSent")) as by_kind,
        ):
            hello, snapshot, _ = await opening(by_request)
            assert hello["filters"] == {"peer": None, "request": "from-c", "kinds": None}
            assert snapshot
            assert {e["request"] for e in snapshot} == {"from-c"}
            hello, snapshot, _ = await opening(by_peer)
            assert hello["filters"]["peer"] == b.id
            assert snapshot
            assert {e["peer"] for e in snapshot} == {b.id}
            hello, snapshot, _ = await opening(by_kind)
            assert hello["filters"]["kinds"] == ["FetchSent", "LookupResp"]
            assert sorted(e["kind"] for e in snapshot) == ["FetchSent"] * 2 + ["LookupResp"] * 2

            # Live: one more request to each peer; each feed passes only its own.
            assert await pull("a", cluster, "b", "again-b", [key(2)]) == 1
            a.node.finish("again-b")
            assert await pull("a", cluster, "c", "again-c", [key(12)]) == 1
            a.node.finish("again-c")
            await pull("a", cluster, "c", "from-c", [key(13)])  # from-c again, a new actor
            a.node.finish("from-c")
            got = await events_until(
                by_request, lambda got: sum(e["kind"] == "Finished" for e in got) == 1
            )
            assert {e["request"] for e in got} == {"from-c"}
            got = await events_until(by_peer, finished("again-b"))
            assert {e["peer"] for e in got} == {b.id}
            got = await events_until(
                by_kind, lambda got: sum(e["kind"] == "FetchSent" for e in got) == 3
            )
            assert {e["kind"] for e in got} <= {"LookupResp", "FetchSent"}
            assert {e["request"] for e in got} == {"again-b", "again-c", "from-c"}


async def test_an_unknown_event_kind_is_refused_with_the_known_ones() -> None:
    async with dashboards() as cluster:
        refused = await rejection(feed_url(cluster["a"].surface, "kinds=LookupResp,Nope"))
        assert refused.status_code == 400
        body = (refused.body or b"").decode()
        assert "unknown event kinds Nope" in body
        assert "LookupResp" in body  # the known kinds are listed
    with pytest.raises(BadFilter, match="Nope"):
        FeedFilters.from_query("kinds=Nope")
    assert FeedFilters.from_query("kinds=&peer=") == FeedFilters()


# --- the slow subscriber -------------------------------------------------------------------


@asynccontextmanager
async def stalled_client(url: str) -> AsyncIterator[WebSocketConnection]:
    """A websocket whose TCP receive buffer is tiny; the test decides when it reads.

    trio-websocket reads one message ahead; while the test does not call
    ``get_message``, the server's sends soon block on a full socket.
    """
    parts = urlsplit(url)
    assert parts.hostname is not None
    assert parts.port is not None
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((parts.hostname, parts.port))
    stream = trio.SocketStream(sock)
    async with trio.open_nursery() as nursery:
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        ws = await wrap_client_stream(
            nursery, stream, f"{parts.hostname}:{parts.port}", target, receive_buffer_size=1024
        )
        try:
            yield ws
        finally:
            with trio.move_on_after(5):
                await ws.aclose()
            await stream.aclose()
            nursery.cancel_scope.cancel()


async def many_requests(cluster: Cluster, count: int) -> None:
    """``count`` small requests from a to b, one after another."""
    cluster["b"].store(key(1), key(2), key(3))
    for i in range(count):
        assert await pull("a", cluster, "b", f"many-{i}", [key(1), key(2), key(3)]) == 3
        cluster["a"].node.finish(f"many-{i}")


async def test_a_subscriber_that_never_reads_gets_a_gap_and_never_slows_the_node() -> None:
    async with dashboards() as cluster:
        a = cluster["a"]
        limits = FeedLimits(queue=8, max_behind_s=600, status_interval_s=600)
        async with (
            open_timeline_server(a.node, limits=limits) as server,
            stalled_client(server.events_url) as ws,
        ):
            assert server.feed is not None
            # The node runs all its requests while the subscriber reads nothing.
            with trio.fail_after(WAIT_S):
                await many_requests(cluster, 150)
            published = len(logged(cluster, "a"))
            stats = server.feed.stats()
            assert stats.events == published
            assert stats.subscribers == 1
            assert stats.dropped > 0  # dropped for the subscriber, never waited for
            # Now it reads: everything up to the last event, with the losses counted.
            hello = await receive(ws)
            assert hello["type"] == "hello"
            messages: list[dict[str, Any]] = []
            with trio.fail_after(WAIT_S):
                while True:
                    message = await receive(ws)
                    messages.append(message)
                    if message["type"] in ("event", "gap"):
                        got = [m for m in messages if m["type"] == "event"]
                        missed = sum(m["missed"] for m in messages if m["type"] == "gap")
                        # Every event the node logged so far is either here or counted.
                        if len(got) + missed == len(logged(cluster, "a")):
                            break
            gaps = [m for m in messages if m["type"] == "gap"]
            assert gaps
            assert all(g["missed"] > 0 for g in gaps)
            assert sum(g["missed"] for g in gaps) == server.feed.stats().dropped
            # What did arrive is in the node's order.
            got_ids = ids(messages)
            order = {pair: i for i, pair in enumerate(logged(cluster, "a"))}
            assert [order[p] for p in got_ids] == sorted(order[p] for p in got_ids)


async def test_a_subscriber_behind_for_too_long_is_closed() -> None:
    async with dashboards() as cluster:
        a = cluster["a"]
        # An eager writer (batch_interval_s), so the socket is what stops it.
        limits = FeedLimits(queue=16, max_behind_s=0.5, close_timeout_s=0.5, batch_interval_s=0.001)
        async with open_timeline_server(a.node, limits=limits) as server:
            assert server.feed is not None
            feed = server.feed
            async with stalled_client(server.events_url) as ws:
                with trio.fail_after(WAIT_S):
                    await many_requests(cluster, 150)
                await wait_for(lambda: feed.stats().evicted == 1, "the laggard was evicted")
                await wait_for(lambda: feed.stats().subscribers == 0, "and forgotten")
                closed = await until_closed(ws)
                # Code 1013 when the close frame got through; 1006 when it was cut.
                assert closed.reason.code in (1013, 1006)
            # The node still serves everyone else.
            async with open_websocket_url(server.events_url) as fresh:
                hello, _, _ = await opening(fresh)
                assert hello["mode"] == "live"


async def test_a_feed_with_no_reader_drops_and_counts_without_blocking() -> None:
    feed = Feed("n:1", block_len=64, limits=FeedLimits(queue=2))
    subscriber = feed.subscribe(FeedFilters())
    async with open_cluster("a", "b") as cluster:
        cluster["a"].node.watch_events(feed.watch)
        await many_requests(cluster, 3)
    published = feed.stats().events
    assert published > 4
    texts = []
    while True:
        with trio.move_on_after(0.1):
            text = await subscriber.next_message()
            texts.append(text)
            continue
        break
    messages = [json.loads(t) for t in texts if t is not None]
    # The queue's two events, then the gap owed for the rest.
    assert [m["type"] for m in messages] == ["event", "event", "gap"]
    assert messages[-1]["missed"] == published - 2 == subscriber.dropped


# --- disconnects -----------------------------------------------------------------------


async def test_clients_that_leave_mid_stream_leave_no_task_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with dashboards() as cluster:
        a = cluster["a"]
        assert a.surface.dashboard is not None
        assert a.surface.dashboard.feed is not None
        feed = a.surface.dashboard.feed
        await many_requests(cluster, 1)  # the session and its tasks are up
        await trio.sleep(0.5)
        baseline = task_count()

        async def traffic(count: int) -> None:
            for i in range(count):
                await pull("a", cluster, "b", f"t-{i}", [key(1), key(2), key(3)])
                a.node.finish(f"t-{i}")

        # A polite goodbye, mid-stream.
        async with open_websocket_url(feed_url(a.surface)) as ws:
            await opening(ws)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(traffic, 5)
                await events_until(ws, lambda got: len(got) >= 3)
        # A rude one: the TCP connection just closes.
        stream = await trio.open_tcp_stream("127.0.0.1", a.surface.dashboard.port)
        async with trio.open_nursery() as nursery:
            ws = await wrap_client_stream(nursery, stream, "127.0.0.1", "/events")
            await ws.get_message()  # hello
            nursery.start_soon(traffic, 5)
            await stream.aclose()
            nursery.cancel_scope.cancel()
        # A client that never finishes its handshake, then leaves.
        raw = await trio.open_tcp_stream("127.0.0.1", a.surface.dashboard.port)
        await raw.send_all(b"GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        await raw.aclose()

        await wait_for(lambda: feed.stats().subscribers == 0, "every subscriber forgotten")
        await wait_for(lambda: task_count() == baseline, "every connection's task ended")
        await many_requests(cluster, 2)  # the node goes on as before
    # Clients leaving is ordinary: nothing logged as an error.
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def test_closing_the_node_says_goodbye_to_its_subscribers() -> None:
    async with trio.open_nursery() as nursery:
        async with dashboards() as cluster:
            assert cluster["a"].surface.dashboard is not None
            stream = await trio.open_tcp_stream("127.0.0.1", cluster["a"].surface.dashboard.port)
            ws = await wrap_client_stream(nursery, stream, "127.0.0.1", "/events")
            await opening(ws)
        closed = await until_closed(ws)
        assert closed.reason.code == 1001
        await stream.aclose()  # a client waits for the server's TCP close; we don't


# --- HTTP ------------------------------------------------------------------------------


async def test_the_page_is_served_at_the_root_and_nothing_else_is() -> None:
    async with dashboards() as cluster:
        board = cluster["a"].surface.dashboard
        assert board is not None
        port = board.port
        status, headers, body = await http(port, "/")
        assert status == 200
        assert headers["content-type"].startswith("text/html")
        assert b"<html" in body.lower()
        scripts = re.findall(rb'(?:src|href)="/?(static/[^"]+)"', body)
        assert scripts, body
        for script in scripts:
            status, headers, _ = await http(port, "/" + script.decode())
            assert status == 200
            assert headers["content-type"].startswith(("text/javascript", "text/css"))
        status, _, body = await http(port, "/nope")
        assert status == 404
        assert b"/nope" in body
        for sneaky in ("/static/../../config.py", "/static/.hidden", "/static/%2e%2e/x"):
            assert (await http(port, sneaky))[0] == 404
        assert (await http(port, "/", method="POST"))[0] == 405
        status, headers, _ = await http(port, "/events")
        assert status == 426
        assert headers["upgrade"] == "websocket"
        status, _, body = await http(port, "/", method="HEAD")
        assert status == 200
        assert body == b""


async def test_only_loopback_names_and_pages_may_reach_a_loopback_dashboard() -> None:
    async with dashboards() as cluster:
        node = cluster["a"].surface
        assert node.dashboard is not None
        port = node.dashboard.port
        # A DNS name rebound to 127.0.0.1 by some web page: refused.
        status, _, body = await http(port, "/", host=f"evil.example:{port}")
        assert status == 403
        assert b"loopback" in body
        assert (await http(port, "/", host=f"localhost:{port}"))[0] == 200
        assert (await http(port, "/", host=f"[::1]:{port}"))[0] == 200
        # A websocket opened by a page from elsewhere: refused.
        refused = await rejection(feed_url(node), [(b"Origin", b"http://evil.example")])
        assert refused.status_code == 403
        assert b"evil.example" in (refused.body or b"")
        # A page from a loopback origin on another port (the demo's, say): welcome.
        async with open_websocket_url(
            feed_url(node), extra_headers=[(b"Origin", b"http://localhost:9999")]
        ) as ws:
            hello, _, _ = await opening(ws)
            assert hello["mode"] == "live"


async def test_the_bare_page_url_can_name_every_feed() -> None:
    async with dashboards() as cluster:
        a, b = cluster["a"].surface, cluster["b"].surface
        assert a.dashboard is not None
        assert b.dashboard is not None
        feeds = [a.dashboard.events_url, b.dashboard.events_url, "ws://0.0.0.0:1234/events"]
        a.dashboard.set_page_feeds(feeds)
        status, headers, _ = await http(a.dashboard.port, "/", host=f"localhost:{a.dashboard.port}")
        assert status == 302
        location = urlsplit(headers["location"])
        assert location.path == "/"
        named = parse_qs(location.query)["feeds"][0].split(",")
        # A wildcard address becomes the host the browser used.
        assert named == [*feeds[:2], "ws://localhost:1234/events"]
        # With a query, the page is served as is.
        assert (await http(a.dashboard.port, "/?feeds=x"))[0] == 200
        a.dashboard.set_page_feeds(None)
        assert (await http(a.dashboard.port, "/"))[0] == 200


# --- binding ---------------------------------------------------------------------------


async def test_the_dashboard_binds_loopback_unless_told_otherwise() -> None:
    assert NodeConfig().dashboard_host == "127.0.0.1"
    assert NodeConfig().dashboard_port is None
    async with open_cluster("a", "quiet", dashboard_port=0) as cluster:
        board = cluster["a"].surface.dashboard
        assert board is not None
        assert board.host == "127.0.0.1"
        assert board.url == f"http://127.0.0.1:{board.port}/"
        assert board.events_url == f"ws://127.0.0.1:{board.port}/events"
        # Nothing answers on the machine's other addresses.
        other = _non_loopback_address()
        if other is not None:
            with pytest.raises(OSError, match=r"refused|Connection|connect"):
                await trio.open_tcp_stream(other, board.port)
    async with open_cluster("off") as cluster:
        assert cluster["off"].surface.dashboard is None


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # no packet is sent
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") or address == "0.0.0.0" else address


def test_control_security_comes_from_the_transport() -> None:
    class Transport:
        def __init__(self, security: str) -> None:
            self.security = security

    class Holder:
        def __init__(self, control: object) -> None:
            self.control = control

    assert control_security(Holder(Transport("curve"))) == "curve"
    assert control_security(Holder(Transport("none"))) == "none"
    assert control_security(Holder(object())) == "none"  # says nothing: unauthenticated
    assert control_security(object()) == "none"


# --- replay ----------------------------------------------------------------------------


async def test_the_replay_server_serves_every_recorded_event(tmp_path: Path) -> None:
    async with open_cluster("a", "b", log_dir=tmp_path) as cluster:
        cluster["b"].store(key(1), key(2))
        cluster["a"].store(key(5))
        assert await pull("a", cluster, "b", "rec-1", [key(1), key(2)]) == 2
        cluster["a"].node.finish("rec-1")
        assert await pull("b", cluster, "a", "rec-2", [key(5)]) == 1
        cluster["b"].node.finish("rec-2")
    paths = [tmp_path / "a.p2plog", tmp_path / "b.p2plog"]
    recorded = [
        (node_id(name), str(e.actor), e.seq, e.KIND)
        for name, path in zip("ab", paths, strict=True)
        for e in read_log(path)
    ]
    async with open_replay_server(paths) as server:
        assert server.mode == "replay"
        assert server.host == "127.0.0.1"
        assert server.feed is None
        assert server.stats() is None
        async with open_websocket_url(server.events_url) as ws:
            hello, events, end = await opening(ws)
            assert hello["mode"] == "replay"
            assert [n["node"] for n in hello["nodes"]] == [node_id("a"), node_id("b")]
            assert [n["path"] for n in hello["nodes"]] == [str(p) for p in paths]
            assert all(n["security"] is None for n in hello["nodes"])  # not recorded
            headers = [read_log(p).header for p in paths]
            assert [n["created_mono"] for n in hello["nodes"]] == [h.created_mono for h in headers]
            assert [(e["node"], e["actor"], e["seq"], e["kind"]) for e in events] == recorded
            assert all(isinstance(e["at"], float) for e in events)
            assert end == {"type": "snapshot_end", "events": len(recorded), "truncated": 0,
                           "problems": []}  # fmt: skip
            consumers = [e for e in events if e["role"] == "consumer" and e["kind"] == "Finished"]
            assert {(e["request"], e["phase"]) for e in consumers} == {
                ("rec-1", "done"),
                ("rec-2", "done"),
            }
            # Replay mode sends nothing more: no peers, no counters.
            with trio.move_on_after(1.5) as quiet:
                await ws.get_message()
            assert quiet.cancelled_caught
        async with open_websocket_url(server.events_url + "?request=rec-2") as ws:
            _, events, end = await opening(ws)
            assert events
            assert {e["request"] for e in events} == {"rec-2"}
            assert end["events"] == len(events)
        status, headers, _ = await http(server.port, "/")
        assert status == 200
        assert headers["content-type"].startswith("text/html")


# --- the command line ------------------------------------------------------------------


def test_replay_serve_refuses_check_and_a_missing_log(tmp_path: Path) -> None:
    missing = subprocess.run(
        [sys.executable, "-m", "p2pactor", "replay", str(tmp_path / "no.p2plog"), "--serve", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 2
    assert "no such file" in missing.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="the demo needs NIXL, on Linux")
async def test_demo_with_a_dashboard_prints_a_url_whose_feeds_show_every_request(
    tmp_path: Path,
) -> None:
    pytest.importorskip("nixl")
    from p2pactor.programs.demo.workload import DemoPlan, requests_of  # noqa: PLC0415

    plan = DemoPlan(nodes=2, requests=2, block_len=4096)
    expected = {r.kv_request_id for r in requests_of(plan)}
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"}
    args = [sys.executable, "-m", "p2pactor", "demo", "--dashboard", "0", "--nodes", "2"]
    args += ["--requests", "2", "--block-size", "4096", "--linger", "120"]
    args += ["--log-dir", str(tmp_path)]
    output: list[str] = []
    async with trio.open_nursery() as nursery:
        process = await nursery.start(
            functools.partial(
                trio.run_process,
                args,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=env,
                check=False,
            )
        )
        lines = _lines(process.stdout, output)
        url = ""
        with trio.fail_after(120):
            async for line in lines:
                found = re.match(r"dashboard: (https?://(127\.0\.0\.1|localhost)(:\d+)?/\S*)", line)
                if found:
                    url = found.group(1)
                    break
        assert url, "\n".join(output)
        page = urlsplit(url)
        feeds = parse_qs(page.query)["feeds"][0].split(",")
        assert len(feeds) == 2
        assert all(f.startswith("ws://127.0.0.1:") for f in feeds)
        assert page.port is not None
        # The bare URL names every feed (once node 0 has been told them, right after).
        with trio.fail_after(WAIT_S):
            while (await http(page.port, "/"))[0] != 302:  # noqa: ASYNC110
                await trio.sleep(0.05)
        # Every request of the demo ends done, on the feed of the node that ran it.
        done: dict[str, str] = {}
        for feed in feeds:
            async with open_websocket_url(feed) as ws:
                hello, snapshot, _ = await opening(ws)
                assert hello["nodes"][0]["security"] == "none"
                mine = {
                    r.kv_request_id
                    for r in requests_of(plan)
                    if hello["nodes"][0]["node"].endswith(f":{_port(output, r.consumer)}")
                }

                def all_mine(got: list[dict[str, Any]], mine: set[str] = mine) -> bool:
                    return mine <= {
                        e["request"]
                        for e in got
                        if e["type"] == "event" and e["kind"] == "Finished"
                    }

                got = await events_until(ws, all_mine, into=list(snapshot))
                for e in got:
                    if e["type"] == "event" and e["kind"] == "Finished":
                        done[e["request"]] = e["phase"]
        assert set(done) == expected
        assert set(done.values()) == {"done"}
        # Ctrl-C ends the linger early, and the demo finishes as usual.
        await _wait_line(lines, "The dashboard stays up")
        process.send_signal(signal.SIGINT)
        with trio.fail_after(120):
            async for _ in lines:
                pass
            await process.wait()
    text = "\n".join(output)
    assert process.returncode == 0, text
    assert "Demo OK" in text
    assert "Event logs:" in text


def _port(output: list[str], index: int) -> str:
    found = re.search(rf"node {index}: \S+:(\d+)", "\n".join(output))
    assert found is not None, output
    return found.group(1)


async def _wait_line(lines: AsyncIterator[str], start: str) -> None:
    with trio.fail_after(120):
        async for line in lines:
            if line.startswith(start):
                return
    pytest.fail(f"no line starting {start!r}")


async def _lines(stream: Any, into: list[str]) -> AsyncIterator[str]:
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            line = raw.decode(errors="replace")
            into.append(line)
            yield line
    if buffer:
        into.append(buffer.decode(errors="replace"))
        yield into[-1]


def test_events_have_a_kind_for_every_event_type() -> None:
    # The feed's kinds are the event classes' KIND: what filters and the page name.
    assert {cls.KIND for cls in ev.EVENT_TYPES.values()} == set(ev.EVENT_TYPES)
