"""Finding a source with no router: summaries between nodes, and the automatic choice.

Real nodes over the in-memory transports, on trio's mock clock: each node's
embedded cache tells its summary exactly, the summaries cross the session as
``kvsum/1`` messages, and ``Node.locate`` asks the peer that claims the keys.
Outcomes are asserted (bytes, answers, claims, pins released); waits are for
conditions, never for time alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import attrs
import msgspec
import pytest
import trio

from p2pactor.core import events as ev
from p2pactor.core import protocol as wire
from p2pactor.core.choice import ChoicePolicy
from p2pactor.core.inputs import LookupResult
from p2pactor.core.sources import BYTES_PER_CLAIM, fingerprint
from p2pactor.runtime.sources import SourceOptions
from tests.cluster import Cluster, Member, block_bytes, key, open_cluster

HIT, MISS = LookupResult.HIT, LookupResult.MISS
SUMMARY_TYPES = ("kvsum_delta", "kvsum_snapshot", "kvsum_resync")


async def until(condition: Callable[[], bool], within: float = 10.0) -> None:
    """Wait (mock clock) until ``condition`` holds; fail after ``within`` seconds."""
    with trio.fail_after(within):
        while not condition():  # noqa: ASYNC110 -- the nodes' own state: no event to wait on
            await trio.sleep(0.001)


def tap(cluster: Cluster) -> list[tuple[float, str, str, wire.Message]]:
    """Every frame sent from now on, decoded: (time, source, destination, message)."""
    seen: list[tuple[float, str, str, wire.Message]] = []

    def record(src: str, dst: str, frame: bytes) -> bool:
        seen.append((trio.current_time(), src, dst, wire.decode(frame)))
        return False  # a tap: nothing is dropped

    cluster.network.drop(record)
    return seen


async def linked(a: Member, b: Member) -> None:
    """Open the session between ``a`` and ``b`` and wait until both ends are ready."""
    b.node.prepare(a.id)
    await until(lambda: (s := b.node.peers.session(a.id)) is not None and s.ready)
    await until(lambda: (s := a.node.peers.session(b.id)) is not None and s.ready)


async def pull(me: Member, kv: str, keys: list[bytes]) -> tuple[str | None, list[bytes]]:
    """Locate ``keys``, fetch the hits into our cache, finish; the peer and the keys fetched."""
    located = await me.node.locate(kv, keys)
    hits = [k for k, a in zip(keys, located.answers, strict=True) if a is HIT]
    if hits:
        assert located.peer is not None
        blocks = me.cache.allocate(len(hits))
        result = await me.node.fetch(located.peer, kv, hits, blocks)
        assert result.success, result.reason
        for k, block in zip(hits, blocks, strict=True):
            me.cache.commit(k, block)
    me.node.finish(kv)
    return located.peer, hits


def assert_settled(cluster: Cluster) -> None:
    for member in cluster.members.values():
        assert member.cache.held_jobs() == set(), f"{member.name} still pins jobs"
        assert member.cache.opened == set(), f"{member.name} has open synthetic requests"


async def test_a_request_naming_no_source_is_served_by_the_peer_that_holds_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b", "c") as cluster:
        a, b, c = cluster["a"], cluster["b"], cluster["c"]
        a.store(*[key(i) for i in range(6)])
        c.store(key(0), key(1))  # c claims a shorter run of the same prefix
        await linked(a, b)
        await linked(c, b)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 6)
        await until(lambda: len(b.node.directory.index.peer(c.id).claims) == 2)
        peer, hits = await pull(b, "req-1", [key(i) for i in range(8)])
        assert peer == a.id
        assert hits == [key(i) for i in range(6)]
        for k in hits:
            assert b.cache.read(k) == block_bytes(k)
        await trio.sleep(1)  # the finish reaches a's producer
        assert_settled(cluster)
    probed = [e for e in b.log.recent() if isinstance(e, ev.Probed)]
    assert len(probed) == 1
    source = probed[0].source
    assert source is not None
    assert source.chosen == a.id
    assert [(claim.peer, claim.run) for claim in source.claims] == [(a.id, 6), (c.id, 2)]
    assert probed[0].keys == tuple(key(i) for i in range(8))  # its run and 2 keys past it
    assert b.node.directory.counts.chosen == 1
    assert b.node.directory.counts.false_claims == 0


async def test_a_key_nobody_claims_is_a_miss_at_once_and_nothing_is_sent(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(key(1))
        await linked(a, b)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 1)
        seen = tap(cluster)
        actors = len(b.actors)
        start = trio.current_time()
        located = await b.node.locate("req", [key(7), key(1)])  # the first key: nobody
        assert trio.current_time() == start
        assert located.peer is None
        assert located.answers == (MISS, MISS)
        assert located.choice.reason == "no peer claims the first key"
        await trio.sleep(1)
        assert len(b.actors) == actors
        assert not [m for _, src, _, m in seen if src == b.id and m.TYPE == "lookup"]
        assert b.node.directory.counts.unclaimed == 1


async def test_what_a_node_evicts_leaves_its_peers_claims(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b", num_blocks=4) as cluster:
        a, b = cluster["a"], cluster["b"]
        await linked(a, b)
        a.store(*[key(i) for i in range(4)])
        index = b.node.directory.index
        await until(lambda: len(index.peer(a.id).claims) == 4)
        assert index.claimed_by(fingerprint(key(0))) == {a.id}
        a.store(key(4), key(5))  # evicts key(0) and key(1), the least recently used
        await until(lambda: index.claimed_by(fingerprint(key(5))) == {a.id})
        assert index.claimed_by(fingerprint(key(0))) == frozenset()
        assert index.claimed_by(fingerprint(key(1))) == frozenset()
        assert len(index.peer(a.id).claims) == 4


async def test_a_snapshot_goes_in_parts_paced_apart(autojump_clock: trio.abc.Clock) -> None:
    options = SourceOptions(summary=attrs.evolve(SourceOptions().summary, part_keys=4))
    async with open_cluster("a", "b", num_blocks=16, sources=options) as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(*[key(i) for i in range(10)])
        seen = tap(cluster)
        await linked(a, b)
        await until(lambda: b.node.directory.index.position(a.id) is not None)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 10)
    parts = [(t, m) for t, src, _, m in seen if src == a.id and isinstance(m, wire.KvsumSnapshot)]
    assert [m.part for _, m in parts] == [0, 1, 2]
    assert all(m.parts == 3 for _, m in parts)
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(parts)]
    assert all(gap >= options.part_interval_s for gap in gaps), gaps
    assert sum(len(m.fps) for _, m in parts) == 8 * 10


async def test_summaries_flow_only_where_both_sides_offered_them(
    autojump_clock: trio.abc.Clock,
) -> None:
    off = {"sources": SourceOptions(share=False)}
    async with open_cluster("a", "b", "c", per_node={"c": off}) as cluster:
        a, b, c = cluster["a"], cluster["b"], cluster["c"]
        seen = tap(cluster)
        a.store(key(1))
        c.store(key(1))
        await linked(a, b)
        await linked(c, b)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 1)
        a.store(key(2))  # a delta, to b only
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 2)
        await trio.sleep(1)
    connects = {src: m for _, src, _, m in seen if isinstance(m, wire.Connect)}
    offered = {
        src: isinstance(m.extension, wire.ConnectExtension)
        and wire.FEATURE_SUMMARIES in m.extension.features
        for src, m in connects.items()
    }
    assert offered == {a.id: True, b.id: True, c.id: False}
    summaries = {(src, dst) for _, src, dst, m in seen if m.TYPE in SUMMARY_TYPES}
    assert summaries == {(a.id, b.id), (b.id, a.id)}
    assert c.id not in b.node.directory.index.peers


async def test_a_summary_nobody_agreed_to_is_a_protocol_violation(
    autojump_clock: trio.abc.Clock,
) -> None:
    off = {"sources": SourceOptions(share=False)}
    async with open_cluster("a", "b", per_node={"b": off}) as cluster:
        a, b = cluster["a"], cluster["b"]
        await linked(a, b)
        delta = wire.KvsumDelta(epoch=b"e", seq=1, add=wire.packed([1]), remove=b"")
        cluster.network.post(a.id, b.id, wire.encode(delta))
        await until(lambda: b.node.peers.closed_count == 1)
        reason = b.node.peers.closed_sessions()[0].reason
        assert "kvsum_delta" in reason
        assert "not agreed" in reason


async def test_keys_an_engine_says_it_lacks_leave_its_peers_claims(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b", num_blocks=16) as cluster:
        a, b = cluster["a"], cluster["b"]
        await linked(a, b)
        held = [key(100 + i) for i in range(6)]
        a.node.holds(held)  # an engine that lends its cache says what it holds
        index = b.node.directory.index
        await until(lambda: len(index.peer(a.id).claims) == 6)
        a.node.lacks(held[:2], wake=True)  # a check with its cache found these gone
        await until(lambda: len(index.peer(a.id).claims) == 4)
        assert index.claimed_by(fingerprint(held[0])) == frozenset()
        assert index.claimed_by(fingerprint(held[1])) == frozenset()
        assert index.claimed_by(fingerprint(held[2])) == {a.id}
        assert len(a.node.directory.holdings) == 4


async def test_a_peer_whose_claims_keep_missing_is_quarantined_but_still_named(
    autojump_clock: trio.abc.Clock,
) -> None:
    policy = ChoicePolicy(min_probed_keys=40)
    options = SourceOptions(choice=policy)
    async with open_cluster("a", "b", num_blocks=256, sources=options) as cluster:
        a, b = cluster["a"], cluster["b"]
        await linked(a, b)
        lies = [key(1000 + i) for i in range(200)]
        a.node.holds(lies)  # claims keys its cache never held
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 200)
        now = trio.current_time
        asked = 0
        while not b.node.directory.index.quarantined(a.id, now()):
            peer, hits = await pull(b, f"req-{asked}", lies[asked * 10 : asked * 10 + 10])
            assert peer == a.id
            assert hits == []
            asked += 1
            assert asked < 20, "never quarantined"
        assert asked * 10 >= policy.min_probed_keys
        counts = b.node.directory.counts
        assert counts.false_claims == counts.probed_keys == asked * 10
        # Its claims on what it was asked are gone; the rest is quarantined.
        assert len(b.node.directory.index.peer(a.id).claims) == 200 - asked * 10
        located = await b.node.locate("after", lies[-10:])
        assert located.peer is None
        assert "quarantined" in located.choice.reason
        b.node.finish("after")
        # Named, it is asked as ever.
        a.store(key(1))
        assert await b.node.lookup(a.id, "named", [key(1)]) == [HIT]
        b.node.finish("named")
        await trio.sleep(1)
        assert_settled(cluster)


async def test_a_peer_that_answers_hit_and_fails_every_fetch_is_quarantined(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Issue 30: precision was fed by lookup answers only, so a peer that
    # answered HIT to everything and failed every fetch misrouted 80 requests
    # of 80 and kept a precision of 1.0.
    policy = ChoicePolicy(min_probed_keys=40)
    async with open_cluster("a", "b", num_blocks=256, sources=SourceOptions(choice=policy)) as (
        cluster
    ):
        a, b = cluster["a"], cluster["b"]
        await linked(a, b)
        held = [key(1000 + i) for i in range(200)]
        a.store(*held)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 200)
        cluster.plane.fail_writes(10_000, reason="a liar's write", peer=b.id)
        now = trio.current_time
        misrouted = 0
        while not b.node.directory.index.quarantined(a.id, now()):
            kv, keys = f"req-{misrouted}", held[misrouted * 10 : misrouted * 10 + 10]
            located = await b.node.locate(kv, keys)
            assert located.peer == a.id
            assert list(located.answers) == [HIT] * 10
            result = await b.node.fetch(a.id, kv, keys, b.cache.allocate(10))
            assert not result.success
            b.node.finish(kv)
            misrouted += 1
            assert misrouted <= 10, "never quarantined"
        counts = b.node.directory.counts
        assert counts.false_claims == 0  # its every answer was HIT
        assert counts.undelivered_claims == counts.probed_keys == misrouted * 10
        located = await b.node.locate("after", held[-10:])
        assert located.peer is None
        assert "quarantined" in located.choice.reason
        b.node.finish("after")
        await trio.sleep(1)
        assert_settled(cluster)


async def test_a_load_the_engine_gives_up_first_says_nothing_of_the_peer(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b", num_blocks=256) as cluster:
        a, b = cluster["a"], cluster["b"]
        await linked(a, b)
        held = [key(2000 + i) for i in range(40)]
        a.store(*held)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 40)
        cluster.plane.hold_writes()
        for i in range(4):
            kv, keys = f"given-up-{i}", held[i * 10 : i * 10 + 10]
            located = await b.node.locate(kv, keys)
            assert list(located.answers) == [HIT] * 10
            async with trio.open_nursery() as nursery:
                nursery.start_soon(b.node.fetch, a.id, kv, keys, b.cache.allocate(10))
                await trio.sleep(0.01)
                b.node.finish(kv)  # while the write is in flight
        cluster.plane.release_writes()
        await until(lambda: not b.node.directory.auto)
        counts = b.node.directory.counts
        assert counts.undelivered_claims == 0
        assert b.node.directory.index.precision(a.id) == 1.0
        await trio.sleep(1)
        assert_settled(cluster)


async def test_resyncs_are_answered_once_an_interval_from_one_shared_snapshot(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Issue 30: 105,200 resyncs of 37 bytes were each answered with a snapshot
    # part (every held key fingerprinted again), saturating the node thread.
    options = SourceOptions(resync_interval_s=1.0)
    async with open_cluster("a", "b", "c", num_blocks=256, sources=options) as cluster:
        a, b, c = cluster["a"], cluster["b"], cluster["c"]
        a.store(*[key(i) for i in range(100)])
        await linked(a, b)
        await linked(a, c)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 100)
        seen = tap(cluster)
        built = a.node.directory.holdings.built
        resync = wire.encode(wire.KvsumResync(epoch=b"", from_seq=0))
        for _ in range(300):  # 3 s, 100 a second, from b and from c
            cluster.network.post(b.id, a.id, resync)
            cluster.network.post(c.id, a.id, resync)
            await trio.sleep(0.01)
        await trio.sleep(1.5)
        for peer in (b, c):
            sent = [m for _, src, dst, m in seen if (src, dst) == (a.id, peer.id)]
            snapshots = [m for m in sent if isinstance(m, wire.KvsumSnapshot)]
            assert 3 <= len(snapshots) <= 4  # one a second (one part each: 100 keys)
            assert len(peer.node.directory.index.peer(a.id).claims) == 100
        assert a.node.directory.holdings.built == built  # nothing changed: the same snapshot


async def test_a_peer_is_kept_to_this_nodes_budget_whatever_it_registered(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    options = SourceOptions(peer_budget_bytes=50 * BYTES_PER_CLAIM)
    most = options.max_claims_per_peer  # what is left once its waiting messages have their share
    assert most == (50 * BYTES_PER_CLAIM - options.max_queued_bytes_per_peer) // BYTES_PER_CLAIM
    async with open_cluster("a", "b", num_blocks=256, sources=options) as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(*[key(i) for i in range(120)])
        await linked(a, b)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == most)
        index = b.node.directory.index
        assert len(index.peer(a.id).claims) == most
        assert index.peer(a.id).strikes >= 1
        said = [r.getMessage() for r in caplog.records if "peer_budget_bytes" in r.getMessage()]
        told = [m for m in said if m.startswith(a.id)]  # b of a (a says the same of b)
        assert len(told) == 1
        assert "registered 256 blocks" in told[0]
        assert f"at most {most}" in told[0]


async def test_a_choice_is_recorded_in_the_request_log_and_replays(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(key(1), key(2))
        await linked(a, b)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 2)
        await pull(b, "req", [key(1), key(2)])
        await trio.sleep(1)
    # open_cluster checked that b's log replays to its live states; the
    # record's own bytes carry the choice.
    probed = next(e for e in b.log.recent() if isinstance(e, ev.Probed))
    record = msgspec.json.decode(msgspec.json.encode(probed))
    assert record["source"]["chosen"] == a.id
    assert record["source"]["claims"][0]["run"] == 2


async def test_a_periodic_snapshot_repairs_a_copy_that_drifted_with_no_gap_to_show(
    autojump_clock: trio.abc.Clock,
) -> None:
    options = SourceOptions(refresh_s=5.0)
    async with open_cluster("a", "b", sources=options) as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(1), key(2))
        await linked(a, b)
        index = a.node.directory.index
        await until(lambda: len(index.peer(b.id).claims) == 2)
        seen = tap(cluster)
        # a dropped a claim b still holds (as after a lookup that missed in a
        # race): no delta of b's will ever bring it back.
        index.missed(b.id, [fingerprint(key(1))])
        assert len(index.peer(b.id).claims) == 1
        await until(lambda: len(index.peer(b.id).claims) == 2, within=6.0)
    refreshes = [m for _, src, _, m in seen if src == b.id and isinstance(m, wire.KvsumSnapshot)]
    assert refreshes, "b sent no snapshot after the first"


async def test_a_quota_refusal_is_no_false_claim_and_leaves_the_claims(
    autojump_clock: trio.abc.Clock,
) -> None:
    from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415 -- one use

    # a pins at most 2 blocks for b: of the 6 keys it holds and claims, the
    # first lookup gets 2 HITs and 4 refusals. A refusal says nothing of what
    # a holds: b counts no false claim, keeps a's claims and its precision.
    async with open_cluster(
        "a", "b", per_node={"a": {"quotas": PeerQuotas(max_pinned_blocks=2)}}
    ) as cluster:
        a, b = cluster["a"], cluster["b"]
        keys = [key(i) for i in range(6)]
        a.store(*keys)
        await linked(a, b)
        await until(lambda: len(b.node.directory.index.peer(a.id).claims) == 6)
        seen = tap(cluster)
        peer, hits = await pull(b, "req", keys)
        assert (peer, hits) == (a.id, keys[:2])
        (resp,) = [m for _, src, _, m in seen if src == a.id and isinstance(m, wire.LookupResp)]
        assert resp.refused == (False, False, True, True, True, True)
        counts = b.node.directory.counts
        assert (counts.false_claims, counts.refused_claims) == (0, 4)
        index = b.node.directory.index
        assert len(index.peer(a.id).claims) == 6
        assert index.precision(a.id) == 1.0
        await trio.sleep(1)
        assert_settled(cluster)


async def test_summaries_that_come_faster_than_they_are_applied_are_dropped_and_asked_again(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 30: what a peer's summary messages make a node hold while they
    # wait is bounded by the node's budget for it (an eighth: here 128 KiB).
    options = SourceOptions(peer_budget_bytes=1 << 20)
    async with open_cluster("a", "b", num_blocks=8192, sources=options) as cluster:
        a, b = cluster["a"], cluster["b"]
        seen = tap(cluster)
        b.store(key(0))
        await linked(b, a)
        index = a.node.directory.index
        await until(lambda: len(index.peer(b.id).claims) == 1)
        position = index.position(b.id)
        assert position is not None
        epoch, seq, _ = position

        def resyncs() -> int:
            return sum(
                isinstance(m, wire.KvsumResync) and (src, dst) == (a.id, b.id)
                for _, src, dst, m in seen
            )

        asked = resyncs()
        # Deltas "from b" of 4,096 keys each (32 KiB: more than is applied as
        # it arrives), all delivered before the node's summary task runs.
        big = wire.packed(range(1, 4097))
        for i in range(1, 11):
            delta = wire.KvsumDelta(epoch=epoch, seq=seq + i, add=big, remove=b"")
            cluster.network.post(b.id, a.id, wire.encode(delta))
        await until(lambda: index.peer(b.id).floods >= 1)
        assert index.peer(b.id).nbytes <= options.peer_budget_bytes
        # b is asked for its snapshot, and its true one (1 key) replaces the rest.
        await until(lambda: resyncs() > asked)
        await until(lambda: not index.pending and len(index.peer(b.id).claims) == 1)
        assert index.claimed_by(fingerprint(key(0))) == {b.id}
        assert a.node.directory.counts.summary_floods == index.peer(b.id).floods
        said = [r.getMessage() for r in caplog.records if "faster than this node" in r.getMessage()]
        assert len(said) == 1
        assert said[0].startswith(b.id)
        # And a keeps serving b: a request naming no source still finds b's key.
        peer, hits = await pull(a, "after-flood", [key(0)])
        assert (peer, hits) == (b.id, [key(0)])
