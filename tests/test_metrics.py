"""Prometheus metrics: exact counts from known lookups, real HTTP, and the demo's own figures.

* Unit: two in-memory nodes (mock clock) run lookups with known answers (hits,
  misses, a pending key that resolves, one that expires); both nodes' exposition,
  parsed with prometheus-client's parser, must say exactly that.
* HTTP: the metrics-only port over a real socket: 200s with the right content
  types, 404 elsewhere, 405 for POST, 403 for a foreign Host or Origin.
* Demo: ``run_demo`` with real processes, ZeroMQ and NIXL; ``/metrics`` of every
  node scraped over HTTP while requests run and after (during the linger); the
  sums must equal the demo summary's hits, misses, blocks and bytes.
"""

from __future__ import annotations

import io
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import trio
from prometheus_client.parser import text_string_to_metric_families

from p2pactor.core.inputs import LookupResult
from p2pactor.programs.demo.run import run_demo
from p2pactor.programs.demo.workload import DemoPlan
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.node import open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.runtime.quotas import PeerQuotas
from p2pactor.surface.attach import open_operator_surface
from p2pactor.surface.metrics import CONTENT_TYPE
from p2pactor.testing import MemoryDataPlane
from tests.cluster import BLOCK_LEN, Cluster, key, node_id, open_cluster

HIT = LookupResult.HIT

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str | bytes) -> Samples:
    """Every sample of an exposition, by (name, labels)."""
    if isinstance(text, bytes):
        text = text.decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name, frozenset(s.labels.items())] = s.value
    return out


def value(found: Samples, name: str, **labels: str) -> float:
    """One sample's value (0 when absent, as Prometheus would treat a missing series)."""
    return found.get((name, frozenset(labels.items())), 0.0)


def total(found: Samples, name: str, **labels: str) -> float:
    """The sum of ``name`` over every series whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in found.items() if n == name and want <= ls)


async def pull(cluster: Cluster, me: str, peer: str, kv: str, keys: list[bytes]) -> int:
    member = cluster[me]
    answers = await member.node.lookup(node_id(peer), kv, keys)
    hits = [k for k, a in zip(keys, answers, strict=True) if a is HIT]
    prefix = []
    for k, a in zip(keys, answers, strict=True):
        if a is not HIT:
            break
        prefix.append(k)
    fetched = 0
    if prefix:
        blocks = member.cache.allocate(len(prefix))
        result = await member.node.fetch(node_id(peer), kv, prefix, blocks)
        assert result.success, result.reason
        fetched = result.blocks
        for k, block in zip(prefix, blocks, strict=True):
            member.cache.commit(k, block)
    member.node.finish(kv)
    del hits
    return fetched


async def test_counters_equal_what_the_lookups_and_fetches_did(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(*[key(i) for i in range(4)])
        a.cache.mark_pending(key(4))  # stored 1 s later: a pending hit
        a.cache.mark_pending(key(5))  # never stored: expires, answered miss

        async def store_later() -> None:
            await trio.sleep(1.0)
            a.store(key(4))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store_later)
            # 6 hits (0..4, then 0..3 again), 1 pending hit, 1 expired, 3 plain misses
            first = await pull(cluster, "b", "a", "r1", [key(i) for i in range(7)])
            second = await pull(cluster, "b", "a", "r2", [key(i) for i in (0, 1, 2, 3, 8, 9)])
        assert (first, second) == (5, 4)
        await trio.sleep(1.0)  # let the producers close

        got_b = samples(b.surface.metrics.exposition())
        peer_a = a.node.node_id
        assert value(got_b, "p2pactor_lookups_total", peer=peer_a) == 2
        assert value(got_b, "p2pactor_lookup_keys_total", peer=peer_a, outcome="hit") == 9
        assert value(got_b, "p2pactor_lookup_keys_total", peer=peer_a, outcome="miss") == 4
        assert value(got_b, "p2pactor_lookup_keys_total", peer=peer_a, outcome="timeout") == 0
        assert value(got_b, "p2pactor_blocks_received_total", peer=peer_a) == 9
        assert value(got_b, "p2pactor_received_bytes_total", peer=peer_a) == 9 * BLOCK_LEN
        assert value(got_b, "p2pactor_keys_per_lookup_count") == 2
        assert value(got_b, "p2pactor_keys_per_lookup_sum") == 13
        assert value(got_b, "p2pactor_fetch_seconds_count") == 2
        assert value(got_b, "p2pactor_lookup_seconds_count") == 2
        # the expiring key held the first lookup the 5 s pending timeout (mock clock)
        assert 5.0 <= value(got_b, "p2pactor_lookup_seconds_sum") < 5.5
        assert value(got_b, "p2pactor_handshakes_total", peer=peer_a, outcome="ok") == 1

        got_a = samples(a.surface.metrics.exposition())
        peer_b = b.node.node_id
        served = "p2pactor_served_lookup_keys_total"
        assert value(got_a, "p2pactor_served_lookups_total", peer=peer_b) == 2
        assert value(got_a, served, peer=peer_b, outcome="hit") == 8
        assert value(got_a, served, peer=peer_b, outcome="pending_resolved") == 1
        assert value(got_a, served, peer=peer_b, outcome="pending_expired") == 1
        assert value(got_a, served, peer=peer_b, outcome="miss") == 3
        assert value(got_a, served, peer=peer_b, outcome="refused") == 0
        assert value(got_a, "p2pactor_blocks_written_total", peer=peer_b) == 9
        assert value(got_a, "p2pactor_written_bytes_total", peer=peer_b) == 9 * BLOCK_LEN
        assert total(got_a, "p2pactor_transfers_failed_total") == 0
        assert value(got_a, "p2pactor_peers") == 1
        assert value(got_a, "p2pactor_sessions", state="ready") == 1
        assert value(got_a, "p2pactor_pinned_blocks", peer=peer_b) == 0
        stats = a.log.statistics()
        assert value(got_a, "p2pactor_event_log_events_total") == stats.events_appended > 0
        assert value(got_a, "p2pactor_event_log_appends_total") == stats.appends > 0
        assert value(got_a, "p2pactor_event_log_appended_bytes_total") == stats.bytes_appended

        totals = b.surface.metrics.totals()
        assert totals["lookups_hit"] == 9
        assert totals["lookups_miss"] == 4
        assert totals["keys_looked_up"] == 13
        assert totals["blocks_received"] == 9
        assert totals["bytes_received"] == 9 * BLOCK_LEN
        assert totals["sessions_alive"] == 1
        assert a.surface.metrics.totals()["served_pending_resolved"] == 1


async def test_each_node_has_its_own_registry(autojump_clock: trio.abc.Clock) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(key(0))
        await pull(cluster, "b", "a", "r", [key(0)])
        assert a.surface.metrics.registry is not b.surface.metrics.registry
        got_a = samples(a.surface.metrics.exposition())
        assert total(got_a, "p2pactor_lookups_total") == 0  # b's lookups are not a's
        assert total(got_a, "p2pactor_served_lookups_total") == 1


async def test_a_seed_mismatch_is_counted(autojump_clock: trio.abc.Clock) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        b.node.hash_seed = "another seed"  # a cached property: set, it stays
        answers = await b.node.lookup(a.id, "r", [key(0)])
        assert answers != [HIT]
        await trio.sleep(1.0)
        got = samples(a.surface.metrics.exposition())
        assert value(got, "p2pactor_handshakes_total", peer=b.id, outcome="seed_mismatch") == 1
        assert value(got, "p2pactor_handshakes_total", peer=b.id, outcome="ok") == 0


async def test_keys_over_a_quota_are_counted_refused(autojump_clock: trio.abc.Clock) -> None:
    async with open_cluster("a", "b", quotas=PeerQuotas(max_keys_per_lookup=2)) as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(*[key(i) for i in range(4)])
        answers = await b.node.lookup(a.id, "r", [key(i) for i in range(4)])
        assert answers[:2] == [HIT, HIT]
        assert HIT not in answers[2:]
        b.node.finish("r")
        await trio.sleep(1.0)
        got = samples(a.surface.metrics.exposition())
        served = "p2pactor_served_lookup_keys_total"
        assert value(got, served, peer=b.id, outcome="hit") == 2
        assert value(got, served, peer=b.id, outcome="refused") == 2
        assert value(got, served, peer=b.id, outcome="miss") == 0
        refusals = "p2pactor_quota_refusals_total"
        assert value(got, refusals, peer=b.id, quota="keys_per_lookup") == 1
        assert a.surface.metrics.totals()["quota_refusals"] == 1


async def test_peers_without_a_session_fold_into_other_past_the_bound(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        await pull(cluster, "b", "a", "r", [key(0)])  # a live session with a
        metrics = b.surface.metrics
        metrics._remembered_peers = 3  # as if max_peers were tiny
        for peer in ("x:1", "y:1", "z:1"):  # strangers that came and went
            metrics.handshake(peer, "timeout")
        got = samples(metrics.exposition())
        handshakes = "p2pactor_handshakes_total"
        assert value(got, handshakes, peer=a.id, outcome="ok") == 1  # live: kept
        assert value(got, handshakes, peer="other", outcome="timeout") == 2  # x and y
        assert value(got, handshakes, peer="z:1", outcome="timeout") == 1
        assert total(got, handshakes) == 4  # nothing lost
        assert value(got, "p2pactor_lookups_total", peer=a.id) == 1


async def test_peers_the_transport_refuses_unauthenticated_are_counted(tmp_path: Path) -> None:
    from p2pactor.adapters.zmq import generate_keypair, open_zmq_transport  # noqa: PLC0415 - pyzmq only here
    from p2pactor.runtime.keys import CurveSecurity  # noqa: PLC0415

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"127.0.0.1:{port}"
    (tmp_path / "trusted").mkdir()
    _, secret = generate_keypair(tmp_path / "trusted" / "a", address)
    config = NodeConfig(
        host="127.0.0.1",
        port=port,
        curve_secret_key=str(secret),
        curve_trusted=str(tmp_path / "trusted"),
    )
    curve = CurveSecurity.load(secret, tmp_path / "trusted")
    cache = EmbeddedCache(config.num_blocks, config.block_len)
    with trio.fail_after(60):
        async with (
            open_zmq_transport(address, port=port, curve=curve) as control,
            open_node(
                config, control=control, data=MemoryDataPlane().transport(cache.memory, 4096)
            ) as node,
            open_operator_surface(node) as surface,
            open_zmq_transport("127.0.0.1:0", port=0) as plain,  # no CURVE: refused
        ):
            conn = await plain.connect(address)
            await conn.send(b"let me in")
            while surface.metrics.totals()["handshakes_failed"] < 1:  # noqa: ASYNC110 - libzmq's
                await trio.sleep(0.01)
            got = samples(surface.metrics.exposition())
            handshakes = "p2pactor_handshakes_total"
            assert value(got, handshakes, peer="unknown", outcome="unauthenticated") >= 1
            assert total(got, handshakes, outcome="ok") == 0


# --- HTTP ----------------------------------------------------------------------------


def http(
    url: str, *, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    """(status, content type, body) of one request; HTTP errors are answers too."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


async def in_thread(url: str, **kwargs: object) -> tuple[int, str, bytes]:
    return await trio.to_thread.run_sync(lambda: http(url, **kwargs))  # type: ignore[arg-type]


def raw_get(port: int, head: str) -> int:
    """Send a hand-written request head; return the status code."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode())
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ", 2)[1])


async def test_the_metrics_port_serves_metrics_and_status_only() -> None:
    async with open_cluster("a", metrics_port=0) as cluster:
        url = cluster["a"].surface.http_url
        assert url is not None
        assert url.startswith("http://127.0.0.1:")
        port = int(url.rsplit(":", 1)[1].strip("/"))
        server = cluster["a"].surface.metrics_server
        assert server is not None
        assert (server.host, server.port) == ("127.0.0.1", port)
        status, ctype, body = await in_thread(url + "metrics")
        assert (status, ctype) == (200, CONTENT_TYPE)
        assert "p2pactor_handshakes_total" in body.decode()
        status, ctype, body = await in_thread(url + "status")
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body)["node_id"] == cluster["a"].node.node_id
        assert (await in_thread(url))[0] == 404
        assert (await in_thread(url + "events"))[0] == 404
        assert (await in_thread(url + "metrics", method="POST"))[0] == 405
        assert (await in_thread(url + "nothing", method="POST"))[0] == 405
        status, _, body = await in_thread(url + "metrics", method="HEAD")
        assert (status, body) == (200, b"")
        # A loopback server answers loopback names only (DNS rebinding)...
        head = "GET /metrics HTTP/1.1\r\nHost: {}\r\n{}\r\n"
        assert await trio.to_thread.run_sync(raw_get, port, head.format("evil.example", "")) == 403
        assert await trio.to_thread.run_sync(raw_get, port, head.format("localhost", "")) == 200
        # ...and never to a page of another origin.
        cross = head.format("127.0.0.1", "Origin: http://evil.example\r\n")
        assert await trio.to_thread.run_sync(raw_get, port, cross) == 403
        same = head.format(f"127.0.0.1:{port}", f"Origin: http://127.0.0.1:{port}\r\n")
        assert await trio.to_thread.run_sync(raw_get, port, same) == 200


async def test_a_wildcard_bound_port_answers_any_host_but_not_foreign_pages() -> None:
    async with open_cluster("a", metrics_port=0, metrics_host="0.0.0.0") as cluster:
        url = cluster["a"].surface.http_url
        assert url is not None
        port = int(url.rsplit(":", 1)[1].strip("/"))
        head = "GET /metrics HTTP/1.1\r\nHost: {}\r\n{}\r\n"
        named = head.format(f"node7.example:{port}", "")
        assert await trio.to_thread.run_sync(raw_get, port, named) == 200
        cross = head.format(f"node7.example:{port}", "Origin: http://evil.example\r\n")
        assert await trio.to_thread.run_sync(raw_get, port, cross) == 403


async def test_the_dashboard_port_serves_metrics_and_status() -> None:
    async with open_cluster("a", dashboard_port=0) as cluster:
        node = cluster["a"].surface
        assert node.dashboard is not None
        assert node.http_url == node.dashboard.url
        status, ctype, body = await in_thread(node.dashboard.url + "metrics")
        assert (status, ctype) == (200, CONTENT_TYPE)
        assert samples(body)  # parses
        status, ctype, body = await in_thread(node.dashboard.url + "status")
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body)["node_id"] == node.node_id
        cross = {"Origin": "http://evil.example"}
        assert (await in_thread(node.dashboard.url + "metrics", headers=cross))[0] == 403


# --- the demo, scraped ---------------------------------------------------------------


class _Captured(io.StringIO):
    """What the demo prints, readable from another thread while it runs."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            return super().write(text)

    def text(self) -> str:
        with self._lock:
            return self.getvalue()


def _scrape_all(urls: list[str]) -> list[Samples]:
    return [samples(http(url)[2]) for url in urls]


def _sum(scrapes: list[Samples], name: str, **labels: str) -> float:
    return sum(total(found, name, **labels) for found in scrapes)


class _Scraper:
    """Scrapes every node the demo prints while it runs (a thread: the demo needs the main one)."""

    def __init__(self, out: _Captured, nodes: int) -> None:
        self.out = out
        self.nodes = nodes
        self.during: list[float] = []  # hits all nodes had seen, while the requests ran
        self.after: list[Samples] = []  # scraped during the linger
        self.statuses: list[tuple[int, str, bytes]] = []
        self.problem = ""
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self._scrape()
        except Exception as exc:
            self.problem = repr(exc)

    def _scrape(self) -> None:
        deadline = time.monotonic() + 90
        urls: list[str] = []
        while len(urls) < self.nodes and time.monotonic() < deadline:
            urls = re.findall(r"metrics: (http://\S+/metrics)", self.out.text())
            time.sleep(0.05)
        while "stay up" not in (text := self.out.text()) and time.monotonic() < deadline:
            if "Running requests" in text and "total " not in text:
                found = _scrape_all(urls)
                self.during.append(_sum(found, "p2pactor_lookup_keys_total", outcome="hit"))
            time.sleep(0.05)
        if "stay up" in self.out.text():
            self.after = _scrape_all(urls)  # everything is counted by now
            self.statuses = [http(url.removesuffix("metrics") + "status") for url in urls]


def test_the_demos_metrics_equal_its_summary(tmp_path: Path) -> None:
    # Named sources: every key of a request is looked up, so the lookup
    # metrics count every key the summary does (a request naming none asks
    # only the keys its peer claims, and a few past them).
    plan = DemoPlan(nodes=2, requests=4, block_len=4096, named=True)
    out = _Captured()
    scraper = _Scraper(out, plan.nodes)
    scraper.thread.start()
    report = run_demo(plan, log_dir=tmp_path, out=out, timeout=90, linger=3.0, pace=0.4)
    scraper.thread.join(timeout=30)
    assert not scraper.problem, scraper.problem
    assert scraper.after, out.text()
    after, during = scraper.after, scraper.during
    assert report.ok, out.text()
    row = next(line for line in out.text().splitlines() if line.startswith("total "))
    _, _, _, hits, misses, _, _, blocks, *_ = row.split()
    hits_, misses_, blocks_ = int(hits), int(misses), int(blocks)
    assert hits_ > 0
    assert blocks_ > 0
    # What the consumers saw equals the summary...
    assert _sum(after, "p2pactor_lookup_keys_total", outcome="hit") == hits_
    missed = _sum(after, "p2pactor_lookup_keys_total", outcome="miss")
    assert missed + _sum(after, "p2pactor_lookup_keys_total", outcome="timeout") == misses_
    assert _sum(after, "p2pactor_blocks_received_total") == blocks_
    assert _sum(after, "p2pactor_received_bytes_total") == blocks_ * plan.block_len
    assert _sum(after, "p2pactor_lookups_total") == plan.nodes * plan.requests
    # ...and so does what the producers served.
    served = "p2pactor_served_lookup_keys_total"
    assert _sum(after, served, outcome="hit") + _sum(after, served, outcome="pending_resolved") == (
        hits_
    )
    assert _sum(after, "p2pactor_blocks_written_total") == blocks_
    assert _sum(after, "p2pactor_written_bytes_total") == blocks_ * plan.block_len
    assert _sum(after, "p2pactor_transfers_failed_total") == 0
    assert _sum(after, "p2pactor_handshakes_total", outcome="ok") == plan.nodes * (plan.nodes - 1)
    assert _sum(after, "p2pactor_peers") == plan.nodes * (plan.nodes - 1)
    # Scraped while requests ran: counts only grow, and some scrape saw them midway.
    assert during, "no scrape while the requests ran"
    assert during == sorted(during)
    assert during[-1] <= hits_
    assert any(0 < seen < hits_ for seen in during), during
    node_ids = re.findall(r"node \d+: (\S+)", out.text())
    assert len(scraper.statuses) == plan.nodes
    for (status, ctype, body), node in zip(scraper.statuses, node_ids, strict=False):
        assert (status, ctype) == (200, "application/json")
        assert json.loads(body)["node_id"] == node


async def test_failed_transfers_are_counted_by_reason(autojump_clock: trio.abc.Clock) -> None:
    # A scripted peer: one fetch it never answers (aborted at 30 s: "timeout"),
    # one it answers transfer_done(success=False) ("peer_failed").
    from p2pactor.core import protocol as wire  # noqa: PLC0415
    from tests.test_node_flows import wait_results  # noqa: PLC0415
    from tests.test_session import PEER, node_and_peer  # noqa: PLC0415

    async with node_and_peer() as (node, _, peer), open_operator_surface(node) as surface:
        node.submit_load(PEER, "silent", 7, [key(1)], [3])
        await peer.handshake_as_server()
        await peer.expect(wire.Fetch)
        abort = await peer.expect(wire.AbortFetch)
        assert isinstance(abort, wire.AbortFetch)
        await peer.send(wire.AbortAck(kv_request_id="silent", round_seq=abort.round_seq))
        (first,) = await wait_results(node, 1)
        node.submit_load(PEER, "refused", 8, [key(2)], [4])
        fetch = await peer.expect(wire.Fetch)
        assert isinstance(fetch, wire.Fetch)
        await peer.send(
            wire.TransferDone(kv_request_id="refused", success=False, round_seq=fetch.round_seq)
        )
        (second,) = await wait_results(node, 1)
        assert not first.success
        assert not second.success
        found = samples(surface.metrics.exposition())
        failed = "p2pactor_transfers_failed_total"
        assert value(found, failed, peer=PEER, reason="timeout") == 1
        assert value(found, failed, peer=PEER, reason="peer_failed") == 1
        assert total(found, failed) == 2
        assert total(found, "p2pactor_blocks_received_total") == 0
        assert surface.metrics.totals()["transfers_failed"] == 2
