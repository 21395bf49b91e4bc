"""Nodes end to end, in one trio run, over the in-memory transports.

Two (or more) real nodes with real sessions and actors share blocks both ways;
bytes must arrive exactly, every pin and synthetic request must be settled, and
replaying each node's log must give exactly the states its actors ended with.
Time is trio's mock clock (``autojump_clock``): nothing sleeps for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from p2pactor.core.consumer import ConsumerState
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.inputs import LookupResult
from p2pactor.core.producer import ProducerPhase, ProducerState
from p2pactor.programs.cli import main
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.node import open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.surface.replay import replay
from tests.cluster import BLOCK_LEN, Cluster, block_bytes, key, node_id, open_cluster

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


def assert_replay_matches(cluster: Cluster) -> None:
    for member in cluster.members.values():
        live = member.live_states()
        assert live, f"{member.name} had no actors"
        assert member.replayed_states() == live


def assert_settled(cluster: Cluster) -> None:
    """Every pin released, every synthetic request closed, on every node."""
    for member in cluster.members.values():
        assert member.cache.held_jobs() == set(), f"{member.name} still pins jobs"
        assert member.cache.opened == set(), f"{member.name} has open synthetic requests"
        assert all(n == 1 for n in member.cache.finished.values())
        assert all(n == 1 for n in member.cache.released.values())


async def pull(member_name: str, cluster: Cluster, peer: str, kv: str, keys: list[bytes]) -> int:
    """Look ``keys`` up on ``peer`` and fetch the hits; return how many arrived."""
    me = cluster[member_name]
    answers = await me.node.lookup(node_id(peer), kv, keys)
    hits = [k for k, a in zip(keys, answers, strict=True) if a is HIT]
    if not hits:
        return 0
    blocks = me.cache.allocate(len(hits))
    result = await me.node.fetch(node_id(peer), kv, hits, blocks)
    assert result.success, result.reason
    for k, block in zip(hits, blocks, strict=True):
        me.cache.commit(k, block)
    return result.blocks


async def test_two_nodes_share_blocks_both_ways(autojump_clock: trio.abc.Clock) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(*[key(i) for i in range(4)])
        b.store(*[key(i) for i in range(10, 14)])
        got: dict[str, int] = {}

        async def a_pulls() -> None:
            keys = [key(i) for i in range(10, 16)]  # 10..13 on b, 14..15 nowhere
            got["a"] = await pull("a", cluster, "b", "req-a", keys)
            a.node.finish("req-a")

        async def b_pulls() -> None:
            keys = [key(i) for i in range(4)]
            got["b"] = await pull("b", cluster, "a", "req-b", keys)
            b.node.finish("req-b")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(a_pulls)
            nursery.start_soon(b_pulls)
        assert got == {"a": 4, "b": 4}
        for i in range(10, 14):
            assert a.cache.read(key(i)) == block_bytes(key(i))
        for i in range(4):
            assert b.cache.read(key(i)) == block_bytes(key(i))
        await trio.sleep(1)  # let the finishes reach the actors
    assert_settled(cluster)
    assert_replay_matches(cluster)
    consumer = next(x for x in cluster["a"].actors if isinstance(x.state, ConsumerState))
    assert consumer.state.phase is ConsumerPhase.DONE
    producer = next(x for x in cluster["b"].actors if isinstance(x.state, ProducerState))
    assert producer.state.phase is ProducerPhase.CLOSED


async def test_lookup_of_a_pending_key_resolves_when_it_is_stored(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(1))
        b.cache.mark_pending(key(2))

        async def store_later() -> None:
            await trio.sleep(2.0)
            b.store(key(2))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store_later)
            start = trio.current_time()
            answers = await a.node.lookup(b.id, "req", [key(1), key(2), key(3)])
            elapsed = trio.current_time() - start
        assert answers == [HIT, HIT, MISS]
        assert 2.0 <= elapsed < 2.1
        a.node.finish("req")
        await trio.sleep(40)  # the unfetched pins expire after 30 s
    assert_settled(cluster)
    assert_replay_matches(cluster)


async def test_pending_key_times_out_as_miss_after_five_seconds(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        b.cache.mark_pending(key(7))
        assert await a.node.lookup(b.id, "warm-up", [key(1)]) == [MISS]
        start = trio.current_time()
        a.node.register_lookup(b.id, "req", [key(7)])
        a.node.flush()
        await trio.sleep(4.999)
        assert a.node.register_lookup(b.id, "req", [key(7)]) == [RETRY]
        answers = await a.node.lookup(b.id, "req", [key(7)])
        assert answers == [MISS]
        assert trio.current_time() - start == pytest.approx(5.0, abs=1e-6)
        # the parent was polled every 5 ms, but only progress is an event
        polls = [e for e in b.log.recent() if e.KIND == "PendingPolled"]
        assert len(polls) == 1
        a.node.finish("req")
        await trio.sleep(1)
    assert_settled(cluster)
    assert_replay_matches(cluster)


async def test_block_size_mismatch_fails_loudly(autojump_clock: trio.abc.Clock) -> None:
    async with open_cluster("a") as cluster:
        cfg = NodeConfig(host="odd", port=5710, num_blocks=8, block_len=BLOCK_LEN * 2)
        cache = EmbeddedCache(cfg.num_blocks, cfg.block_len)
        async with open_node(
            cfg,
            control=cluster.network.transport(cfg.node_id),
            data=cluster.plane.transport(cache.memory, cfg.block_len),
            parent=cache,
        ) as odd:
            answers = await cluster["a"].node.lookup(odd.node_id, "req", [key(1)])
            assert answers == [MISS]
            await trio.sleep(1)  # let the dead session finish closing
            results = cluster["a"].node.peers.closed_sessions()
            rejected = [r for r in results if "block size differs" in r.reason]
            assert len(rejected) == 1
            assert "128-byte blocks" in rejected[0].reason
            # anything else was a stray frame after the close, never answered
            assert all("its first message is a" in r.reason for r in results if r not in rejected)


async def test_written_logs_replay_to_the_live_states_and_pass_check(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with open_cluster("a", "b", log_dir=tmp_path) as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(key(1), key(2))
        b.store(key(3), key(4))
        b.cache.mark_pending(key(5))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pull, "a", cluster, "b", "ra", [key(3), key(4), key(5)])
            nursery.start_soon(pull, "b", cluster, "a", "rb", [key(1), key(2), key(9)])
        a.node.finish("ra")
        b.node.finish("rb")
        await trio.sleep(40)
    paths = [tmp_path / "a.p2plog", tmp_path / "b.p2plog"]
    result = replay(paths, check=True)
    assert result.violations == ()
    assert result.unfinished == ()
    for member in cluster.members.values():
        for actor in member.actors:
            assert result.actor(member.id, actor.id).state == actor.state
    assert main(["replay", "--check", *map(str, paths)]) == 0


async def test_a_slow_trickle_keeps_its_pins_and_loads_every_block(
    autojump_clock: trio.abc.Clock,
) -> None:
    # vLLM #56836: 40 keys of one request looked up one a second, then one fetch of all of
    # them. Without leases the first pins ran out at 30 s and the load failed.
    keys = [key(i) for i in range(40)]
    async with open_cluster("a", "b", num_blocks=256) as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(*keys)
        for k in keys:
            assert await a.node.lookup(b.id, "slow", [k]) == [HIT]
            await trio.sleep(1.0)
        assert trio.current_time() >= 40.0
        blocks = a.cache.allocate(len(keys))
        result = await a.node.fetch(b.id, "slow", keys, blocks)
        assert result.success, result.reason
        assert result.blocks == 40
        for k, block in zip(keys, blocks, strict=True):
            a.cache.commit(k, block)
            assert a.cache.read(k) == block_bytes(k)
        a.node.finish("slow")
        await trio.sleep(1)
    assert_settled(cluster)
    assert_replay_matches(cluster)
    (producer,) = [x for x in cluster["b"].actors if isinstance(x.state, ProducerState)]
    renewed = [e for e in cluster["b"].log.recent() if e.KIND == "PinsRenewed"]
    assert len(renewed) == 39  # each later lookup renewed the pins before it
    assert producer.state.phase is ProducerPhase.CLOSED
