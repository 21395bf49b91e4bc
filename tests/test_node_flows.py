"""Node-level flows: timers, dead peers, prefill/decode, rounds, the sync API.

Real nodes and sessions on the in-memory transports; a scripted raw peer where
the test must control exactly what the other side does. Timer tests run on
trio's mock clock; the thread test runs on the real clock with a deadline.
"""

from __future__ import annotations

import threading
import time

import pytest
import trio

from p2pactor.core import protocol as wire
from p2pactor.core.events import FetchSent
from p2pactor.core.ids import Role
from p2pactor.core.inputs import LookupResult
from p2pactor.runtime.engine import LoadResult
from p2pactor.testing import message_is
from tests.cluster import block_bytes, key, open_cluster
from tests.test_node import assert_replay_matches, assert_settled, pull
from tests.test_session import PEER, RawPeer, closed_reason, node_and_peer

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


async def wait_results(node: object, count: int) -> list[LoadResult]:
    results: list[LoadResult] = []
    with trio.fail_after(120):
        while len(results) < count:
            results.extend(node.finished_jobs())  # type: ignore[attr-defined]
            await trio.sleep(0.01)
    return results


class TestTimers:
    async def test_unanswered_load_is_aborted_at_30s_and_failed_10s_later(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, _, peer):
            node.submit_load(PEER, "r", 7, [key(1)], [3])  # prefill/decode: no lookup
            await peer.handshake_as_server()
            fetch = await peer.expect(wire.Fetch)
            sent_at = trio.current_time()
            abort = await peer.expect(wire.AbortFetch)  # the peer says nothing
            assert isinstance(fetch, wire.Fetch)
            assert isinstance(abort, wire.AbortFetch)
            assert abort.round_seq == fetch.round_seq
            assert trio.current_time() - sent_at == pytest.approx(30.0, abs=0.01)
            results = await wait_results(node, 1)
            assert trio.current_time() - sent_at == pytest.approx(40.0, abs=0.05)
            assert results == [LoadResult(7, False, "no abort_ack within 10 s")]

    async def test_abort_ack_fails_the_load_at_once(self, autojump_clock: trio.abc.Clock) -> None:
        async with node_and_peer() as (node, _, peer):
            node.submit_load(PEER, "r", 7, [key(1)], [3])
            await peer.handshake_as_server()
            fetch = await peer.expect(wire.Fetch)
            abort = await peer.expect(wire.AbortFetch)
            assert isinstance(fetch, wire.Fetch)
            assert isinstance(abort, wire.AbortFetch)
            await peer.send(wire.AbortAck(kv_request_id="r", round_seq=abort.round_seq))
            (result,) = await wait_results(node, 1)
            assert result.job_id == 7
            assert not result.success

    async def test_a_lookup_with_no_progress_fails_only_its_request(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(2), block_bytes(key(2)))
            await peer.dial()  # the raw peer will ignore the lookup
            await peer.send(peer.connect_msg())
            await peer.expect(wire.Connect)
            await peer.expect(wire.ConnectAck)
            await peer.send(wire.ConnectAck(peer_id=PEER))
            start = trio.current_time()
            answers = await node.lookup(PEER, "stuck", [key(1)])
            assert answers == [MISS]
            assert trio.current_time() - start == pytest.approx(30.0, abs=0.01)
            # the session lives on: the peer can still be served
            await peer.send(wire.Lookup(kv_request_id="other", keys=(key(2),), round_seq=0))
            resp = await peer.expect(wire.Lookup)  # our stuck lookup went out first
            del resp
            resp = await peer.expect(wire.LookupResp)
            assert isinstance(resp, wire.LookupResp)
            assert resp.hits == (True,)
            assert node.peers.session(PEER) is not None

    async def test_pins_nobody_fetches_are_released_after_30s(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (_, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            await peer.expect(wire.LookupResp)
            assert cache.pinned() == 1
            await trio.sleep(29.9)
            assert cache.pinned() == 1
            await trio.sleep(0.2)
            assert cache.pinned() == 0
            assert cache.opened == set()


class TestDeadPeers:
    async def test_a_dead_producer_fails_the_consumers_loads_with_a_reason(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b", "c") as cluster:
            a, b, c = cluster["a"], cluster["b"], cluster["c"]
            b.store(key(1))
            c.store(key(2))
            assert await a.node.lookup(b.id, "rb", [key(1)]) == [HIT]
            cluster.plane.hold_writes()  # b's write into a will never finish
            blocks = a.cache.allocate(1)
            a.node.submit_load(b.id, "rb", 11, [key(1)], blocks)
            await trio.sleep(1)
            cluster.network.kill(b.id)
            cluster.plane.release_writes()
            (result,) = await wait_results(a.node, 1)
            assert result.job_id == 11
            assert not result.success
            assert "session lost" in result.reason
            assert "went away" in result.reason
            # a's other session is unaffected
            assert await pull("a", cluster, "c", "rc", [key(2)]) == 1
            assert a.cache.read(key(2)) == block_bytes(key(2))

    @pytest.mark.parametrize("drain_timeout", [30.0, 1.0])
    async def test_a_dead_producers_loads_fail_only_once_its_late_writes_cannot_land(
        self, autojump_clock: trio.abc.Clock, drain_timeout: float
    ) -> None:
        """Also with a drain shorter than the hold (vLLM's adapter drains 3 s): it outlasts it."""
        async with open_cluster("a", "b", drain_timeout=drain_timeout) as cluster:
            a, b = cluster["a"], cluster["b"]
            cluster.plane.late_write_window = 5.0
            b.store(key(1))
            assert await a.node.lookup(b.id, "rb", [key(1)]) == [HIT]
            cluster.plane.hold_writes()
            a.node.submit_load(b.id, "rb", 11, [key(1)], a.cache.allocate(1))
            await trio.sleep(1)
            cluster.network.kill(b.id)
            killed = trio.current_time()
            (result,) = await wait_results(a.node, 1)
            held = trio.current_time() - killed
            assert not result.success
            assert "held until no write could land" in result.reason
            assert 5.0 <= held < 6.0, held  # the engine got the blocks back only then
            cluster.plane.release_writes()

    async def test_a_restarted_peer_gets_a_fresh_session(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            network = peer.transport.network
            network.kill(PEER)
            assert "went away" in await closed_reason(node)
            reborn = RawPeer(network, peer.data._plane)
            await reborn.handshake_as_client()
            await reborn.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            resp = await reborn.expect(wire.LookupResp)
            assert isinstance(resp, wire.LookupResp)
            assert resp.hits == (True,)

    async def test_ten_reconnects_in_a_row(self, autojump_clock: trio.abc.Clock) -> None:
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            network, plane = peer.transport.network, peer.data._plane
            for i in range(10):
                flapping = RawPeer(network, plane) if i else peer
                await flapping.handshake_as_client()
                await flapping.send(wire.Lookup(kv_request_id=f"r{i}", keys=(key(1),), round_seq=0))
                await flapping.expect(wire.LookupResp)
                network.kill(PEER)
                await closed_reason(node)
            await trio.sleep(40)
            assert len(node.peers.closed_sessions()) == 10
            assert cache.held_jobs() == set()
            assert cache.opened == set()


class TestPrefillDecode:
    async def test_stores_offered_before_the_fetch_are_served(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("prefill", "decode") as cluster:
            p, d = cluster["prefill"], cluster["decode"]
            keys = [key(i) for i in range(4)]
            p.store(*keys)
            pin = p.cache.pin(keys)
            p.node.submit_store("req", pin.job_id, keys, pin.blocks)
            p.node.finish("req")  # the prefill request ends before the decode side asks
            blocks = d.cache.allocate(4)
            result = await d.node.fetch(p.id, "req", keys, blocks)  # no lookup: all HIT
            assert result.success
            for k, block in zip(keys, blocks, strict=True):
                d.cache.commit(k, block)
                assert d.cache.read(k) == block_bytes(k)
            d.node.finish("req")
            await trio.sleep(1)
        assert_settled(cluster)
        assert_replay_matches(cluster)

    async def test_a_fetch_before_the_store_waits_for_it(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("prefill", "decode") as cluster:
            p, d = cluster["prefill"], cluster["decode"]
            keys = [key(i) for i in range(3)]
            blocks = d.cache.allocate(3)
            outcome = {}

            async def decode_side() -> None:
                outcome["r"] = await d.node.fetch(p.id, "req", keys, blocks)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(decode_side)
                await trio.sleep(2)  # the fetch parks on the prefill node
                p.store(*keys)
                pin = p.cache.pin(keys)
                p.node.submit_store("req", pin.job_id, keys, pin.blocks)
            assert outcome["r"].success
            assert all(
                d.cache.memory[b * 64 : (b + 1) * 64] == block_bytes(k)
                for k, b in zip(keys, blocks, strict=True)
            )
            p.node.finish("req")
            d.node.finish("req")
            await trio.sleep(1)
        assert_replay_matches(cluster)

    async def test_stores_no_fetch_comes_for_are_released_after_60s(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("prefill") as cluster:
            p = cluster["prefill"]
            p.store(key(1))
            pin = p.cache.pin([key(1)])
            p.node.submit_store("req", pin.job_id, [key(1)], pin.blocks)
            await trio.sleep(59)
            assert p.cache.held_jobs() == {pin.job_id}
            await trio.sleep(2)
            assert p.cache.held_jobs() == set()


class TestRounds:
    async def test_several_rounds_on_one_request_between_p2pactor_nodes(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(*[key(i) for i in range(7)])
            assert await pull("a", cluster, "b", "warm-up", [key(6)]) == 1
            assert await pull("a", cluster, "b", "req", [key(0), key(1)]) == 2
            assert await pull("a", cluster, "b", "req", [key(2), key(3)]) == 2
            assert await pull("a", cluster, "b", "req", [key(4), key(5)]) == 2
            a.node.finish("req")
            await trio.sleep(1)
            rounds = {
                x.id.kv_request_id: [
                    e.round_seq for e in a.log.recent(x.id) if isinstance(e, FetchSent)
                ]
                for x in a.actors
                if x.id.role is Role.CONSUMER
            }
            assert len(rounds["req"]) == 3
            assert rounds["req"] == sorted(set(rounds["req"]))
            # a session-wide counter: no round repeats across requests (no ABA)
            assert not set(rounds["req"]) & set(rounds["warm-up"])
        assert_settled(cluster)
        assert_replay_matches(cluster)

    async def test_a_stale_answer_is_ignored_by_a_p2pactor_consumer(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, _, peer):
            node.register_lookup(PEER, "r", [key(1)])
            node.flush()
            await peer.accept()
            await peer.expect(wire.Connect)
            ext = wire.ConnectExtension(version=1, features=frozenset({"lookup_resp_round"}))
            await peer.send(peer.connect_msg(extension=ext))
            await peer.send(wire.ConnectAck(peer_id=PEER))
            await peer.expect(wire.ConnectAck)
            lookup = await peer.expect(wire.Lookup)
            assert isinstance(lookup, wire.Lookup)
            stale = wire.LookupResp(
                kv_request_id="r", keys=(key(1),), hits=(True,), round_seq=lookup.round_seq + 5
            )
            await peer.send(stale)
            await trio.sleep(1)
            assert node.register_lookup(PEER, "r", [key(1)]) == [RETRY]
            fresh = wire.LookupResp(
                kv_request_id="r", keys=(key(1),), hits=(True,), round_seq=lookup.round_seq
            )
            await peer.send(fresh)
            await trio.sleep(1)
            assert node.register_lookup(PEER, "r", [key(1)]) == [HIT]


class TestSyncApi:
    async def test_an_engine_on_its_own_thread_drives_two_nodes(self) -> None:
        # Both nodes lend their caches only from their engines' threads, as vLLM
        # does; nothing on those threads ever waits for trio.
        async with open_cluster("a", "b", lent=["a", "b"]) as cluster:
            a, b = cluster["a"], cluster["b"]
            keys = [key(i) for i in range(8)]
            b.store(*keys[:6])
            stop = threading.Event()
            outcome: dict[str, object] = {}

            def engine_b() -> None:
                while not stop.is_set():
                    b.node.serve_parent(b.cache)
                    time.sleep(0.001)

            def engine_a() -> None:
                answers: list[LookupResult] = []
                for _ in range(5000):
                    answers = a.node.register_lookup(b.id, "req", keys)
                    a.node.flush()
                    a.node.serve_parent(a.cache)
                    if RETRY not in answers:
                        break
                    time.sleep(0.001)
                outcome["answers"] = answers
                hits = [k for k, x in zip(keys, answers, strict=True) if x is HIT]
                blocks = a.cache.allocate(len(hits))
                a.node.submit_load(b.id, "req", 42, hits, blocks)
                for _ in range(5000):
                    results = a.node.finished_jobs()
                    a.node.serve_parent(a.cache)
                    if results:
                        outcome["results"] = results
                        break
                    time.sleep(0.001)
                for k, block in zip(hits, blocks, strict=True):
                    a.cache.commit(k, block)
                a.node.finish("req")

            with trio.fail_after(30):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(trio.to_thread.run_sync, engine_b)
                    await trio.to_thread.run_sync(engine_a)
                    await trio.sleep(0.2)
                    b.node.serve_parent(b.cache)
                    stop.set()
            assert outcome["answers"] == [HIT] * 6 + [MISS] * 2
            assert outcome["results"] == [LoadResult(42, True, "")]
            for k in keys[:6]:
                assert a.cache.read(k) == block_bytes(k)
            # serve what the finish left owed, then everything is settled
            with trio.fail_after(10):
                while b.cache.held_jobs() or b.cache.opened:
                    b.node.serve_parent(b.cache)
                    await trio.sleep(0.01)
        assert_settled(cluster)
        assert_replay_matches(cluster)


class TestPendingWork:
    async def test_pending_work_only_while_something_is_outstanding(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1))
            assert not a.node.has_pending_work()
            assert await a.node.lookup(b.id, "req", [key(1)]) == [HIT]
            await trio.sleep(1)
            assert not a.node.has_pending_work(), "a ready, idle session is no work"
            cluster.plane.hold_writes()
            blocks = a.cache.allocate(1)
            a.node.submit_load(b.id, "req", 5, [key(1)], blocks)
            await trio.sleep(1)
            assert a.node.has_pending_work(), "a load in flight"
            assert b.node.has_pending_work(), "a write in flight"
            cluster.plane.release_writes()
            (result,) = await wait_results(a.node, 1)
            assert result.success
            await trio.sleep(1)
            assert not a.node.has_pending_work()
            assert not b.node.has_pending_work()


class TestFaultInjection:
    async def test_a_dropped_answer_fails_the_lookup_after_30s_and_only_it(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1), key(2))
            assert await a.node.lookup(b.id, "warm-up", [key(9)]) == [MISS]
            rule = cluster.network.drop(message_is(wire.LookupResp), count=1)
            start = trio.current_time()
            assert await a.node.lookup(b.id, "lost", [key(1)]) == [MISS]
            assert trio.current_time() - start == pytest.approx(30.0, abs=0.01)
            assert rule.hits == 1
            assert await a.node.lookup(b.id, "next", [key(2)]) == [HIT]

    async def test_a_slow_link_delays_but_loses_nothing(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            b = cluster["b"]
            b.store(*[key(i) for i in range(4)])
            cluster.network.delay(message_is(src=b.id), 2.0)
            start = trio.current_time()
            assert await pull("a", cluster, "b", "req", [key(i) for i in range(4)]) == 4
            assert trio.current_time() - start >= 4.0  # the answer and the done were held

    async def test_a_failed_write_fails_the_load_and_releases_the_pin(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1))
            assert await a.node.lookup(b.id, "req", [key(1)]) == [HIT]
            cluster.plane.fail_writes(1, reason="NIXL_ERR_REMOTE_DISCONNECT")
            result = await a.node.fetch(b.id, "req", [key(1)], a.cache.allocate(1))
            assert not result.success
            assert result.reason == "the peer reported the transfer failed"
            await trio.sleep(1)
            assert b.cache.held_jobs() == set()
            failed = [e for e in b.log.recent() if e.KIND == "TransferFailed"]
            assert [e.reason for e in failed] == ["NIXL_ERR_REMOTE_DISCONNECT"]  # type: ignore[attr-defined]


class TestClosingAParkedLookup:
    async def test_the_empty_fetch_closes_a_lookup_whose_re_poll_is_parked(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        # The re-poll of a pending key waits at the parent for news; the peer's
        # close must not wait for it (it did, until the 5 s deadline).
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            b.store(key(1))
            b.cache.mark_pending(key(2))
            a.node.register_lookup(b.id, "req", [key(1), key(2)])
            a.node.flush()
            await trio.sleep(1.0)  # answered? no: key 2 is pending, re-polls parked
            assert a.node.register_lookup(b.id, "req", [key(1), key(2)]) == [RETRY, RETRY]
            assert b.cache.pinned() == 1
            closed_at = trio.current_time()
            a.node.finish("req")  # the consumer's terminal empty fetch
            with trio.fail_after(60):
                while b.cache.pinned() or b.cache.opened:  # noqa: ASYNC110 - cache has no event
                    await trio.sleep(0.001)
            assert trio.current_time() - closed_at < 0.1
            assert b.cache.held_jobs() == set()
