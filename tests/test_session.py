"""PeerSession at the wire: a real node against a scripted raw peer.

The raw peer speaks frames directly on the in-memory network, so tests can play
a stock vLLM peer, a buggy one or a hostile one, and check exactly what the node
sends back and when: the handshake and its checks, queuing until the ack,
routing, the error policy, and closing. Time is trio's mock clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
import pytest
import trio

import p2pactor.runtime.actor
from p2pactor.core import protocol as wire
from p2pactor.core.events import AnyEvent
from p2pactor.core.fold import fold
from p2pactor.core.ids import ActorId
from p2pactor.core.inputs import LookupResult
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.handshake import SessionState
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.node import Node, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.testing import MemoryConnection, MemoryDataPlane, MemoryNetwork
from tests.cluster import BLOCK_LEN, block_bytes, key, open_cluster

NODE = "node:5710"
PEER = "peer:5710"
HIT, MISS = LookupResult.HIT, LookupResult.MISS


class RawPeer:
    """A peer scripted frame by frame: sends what the test says, records what arrives."""

    def __init__(self, network: MemoryNetwork, plane: MemoryDataPlane, peer_id: str = PEER):
        self.transport = network.transport(peer_id)
        self.memory = bytearray(16 * BLOCK_LEN)
        self.data = plane.transport(self.memory, BLOCK_LEN)
        self.peer_id = peer_id
        self.conn: MemoryConnection | None = None

    def connect_msg(self, **changes: object) -> wire.Connect:
        fields: dict[str, object] = {
            "peer_id": self.peer_id,
            "agent_metadata": self.data.agent_metadata,
            "base_addr": self.data.base_addr,
            "num_blocks": self.data.num_blocks,
            "block_len": BLOCK_LEN,
            "config_fingerprint": "",
            "hash_seed": "vllm-none-hash",
        }
        fields.update(changes)
        return wire.Connect(**fields)  # type: ignore[arg-type]

    async def dial(self, node_id: str = NODE) -> None:
        self.conn = await self.transport.connect(node_id)

    async def accept(self) -> None:
        self.conn = await self.transport.accept()

    async def send(self, msg: wire.Message) -> None:
        await self.send_raw(wire.encode(msg))

    async def send_raw(self, frame: bytes) -> None:
        assert self.conn is not None
        await self.conn.send(frame)

    async def receive(self) -> wire.Message:
        assert self.conn is not None
        with trio.fail_after(60):
            return wire.decode(await self.conn.receive())

    async def expect(self, cls: type[wire.Message]) -> wire.Message:
        msg = await self.receive()
        assert isinstance(msg, cls), f"expected {cls.__name__}, got {msg}"
        return msg

    async def handshake_as_server(self) -> wire.Connect:
        """The node dialed us: accept, read its connect, send ours, ack its."""
        await self.accept()
        connect = await self.expect(wire.Connect)
        await self.send(self.connect_msg())
        await self.send(wire.ConnectAck(peer_id=self.peer_id))
        await self.expect(wire.ConnectAck)
        assert isinstance(connect, wire.Connect)
        return connect

    async def handshake_as_client(self) -> wire.Connect:
        """We dial the node: send connect, read its connect and ack, ack it."""
        await self.dial()
        await self.send(self.connect_msg())
        connect = await self.expect(wire.Connect)
        await self.expect(wire.ConnectAck)
        await self.send(wire.ConnectAck(peer_id=self.peer_id))
        assert isinstance(connect, wire.Connect)
        return connect


@asynccontextmanager
async def node_and_peer(**config: object) -> AsyncIterator[tuple[Node, EmbeddedCache, RawPeer]]:
    network = MemoryNetwork()
    plane = MemoryDataPlane()
    settings: dict[str, object] = {"num_blocks": 16, "block_len": BLOCK_LEN, **config}
    cfg = NodeConfig(host="node", port=5710, **settings)  # type: ignore[arg-type]
    cache = EmbeddedCache(cfg.num_blocks, cfg.block_len)
    peer = RawPeer(network, plane)
    event_log = EventLog(cfg.node_id, keep=None)
    actors: list[RequestActor] = []
    async with open_node(
        cfg,
        control=network.transport(cfg.node_id),
        data=plane.transport(cache.memory, cfg.block_len),
        parent=cache,
        event_log=event_log,
    ) as node:
        node.watch_actors(actors.append)
        yield node, cache, peer
    # replay rebuilds exactly the states the actors ended in
    by_actor: dict[ActorId, list[AnyEvent]] = {}
    for event in event_log.recent():
        by_actor.setdefault(event.actor, []).append(event)
    assert {a: fold(e) for a, e in by_actor.items()} == {a.id: a.state for a in actors}


async def closed_reason(node: Node) -> str:
    with trio.fail_after(60):
        while not node.peers.closed_sessions():  # noqa: ASYNC110 - no event to wait on
            await trio.sleep(0.01)
    return node.peers.closed_sessions()[-1].reason


class TestHandshake:
    async def test_connect_is_sent_first_and_advertises_the_node(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer(fingerprint="abcd") as (node, _, peer):
            node.register_lookup(PEER, "r", [key(1)])
            node.flush()
            connect = await peer.handshake_as_server()
            assert connect.peer_id == NODE
            assert connect.block_len == BLOCK_LEN
            assert connect.num_blocks == 16
            assert connect.config_fingerprint == "abcd"
            assert connect.hash_seed == "vllm-none-hash"
            assert connect.extension is not None  # p2pactor offers its extensions

    async def test_messages_wait_for_the_ack_of_our_connect(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, _, peer):
            node.register_lookup(PEER, "r", [key(1)])
            node.flush()
            await peer.accept()
            await peer.expect(wire.Connect)
            await peer.send(peer.connect_msg())
            await peer.expect(wire.ConnectAck)  # the node acks ours...
            with trio.move_on_after(5):  # ...but holds its lookup until we ack its connect
                msg = await peer.receive()
                pytest.fail(f"sent {msg} before its connect was acked")
            await peer.send(wire.ConnectAck(peer_id=PEER))
            lookup = await peer.expect(wire.Lookup)
            assert isinstance(lookup, wire.Lookup)
            assert lookup.keys == (key(1),)
            assert lookup.deadline_ms is wire.UNSET  # a stock peer sees vLLM's dialect

    async def test_ack_comes_only_after_the_peer_is_registered(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, _, peer):
            # registration takes 3 s on this data plane
            peer.data._plane.registration_delay = 3.0
            await peer.dial()
            start = trio.current_time()
            await peer.send(peer.connect_msg())
            await peer.expect(wire.Connect)
            await peer.expect(wire.ConnectAck)
            assert trio.current_time() - start >= 3.0
            del node

    @pytest.mark.parametrize(
        ("change", "words"),
        [
            ({"block_len": BLOCK_LEN * 2}, "block size differs"),
            ({"hash_seed": "42"}, "set PYTHONHASHSEED to the same value"),
            ({"config_fingerprint": "ffff"}, "config fingerprint differs"),
            ({"peer_id": "evil:1"}, "a peer's id must be the host:port it bound"),
        ],
    )
    async def test_incompatible_peer_is_rejected_without_an_ack(
        self, autojump_clock: trio.abc.Clock, change: dict[str, object], words: str
    ) -> None:
        async with node_and_peer(fingerprint="abcd") as (node, _, peer):
            await peer.dial()
            await peer.send(peer.connect_msg(**change))
            await peer.expect(wire.Connect)
            await peer.expect(wire.Disconnect)  # no ack, a disconnect
            assert words in await closed_reason(node)
            assert peer.data.registered() == []

    async def test_missing_fingerprint_is_accepted(self, autojump_clock: trio.abc.Clock) -> None:
        async with node_and_peer(fingerprint="abcd") as (_, _, peer):
            await peer.handshake_as_client()  # config_fingerprint="" on our side

    async def test_handshake_times_out_after_thirty_seconds(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, _, peer):
            await peer.dial()
            await peer.send(peer.connect_msg())
            start = trio.current_time()
            # never ack: the node gives up at exactly the handshake timeout
            reason = await closed_reason(node)
            assert "handshake not complete after 30 s" in reason
            assert trio.current_time() - start == pytest.approx(30.0, abs=0.05)

    async def test_a_second_connect_starts_a_new_session_on_the_connection(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        # The peer's side of the session died and it started a new one, whose
        # connection took the old one's place: the old session ends without a
        # disconnect (that would end the new one) and a new one shakes hands.
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            (old,) = node.peers.sessions()
            await peer.send(peer.connect_msg())
            assert isinstance(await peer.expect(wire.Connect), wire.Connect)  # not a disconnect
            await peer.expect(wire.ConnectAck)
            await peer.send(wire.ConnectAck(peer_id=peer.peer_id))
            assert "started a new session" in await closed_reason(node)
            (new,) = node.peers.sessions()
            assert new is not old
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            resp = await peer.expect(wire.LookupResp)
            assert isinstance(resp, wire.LookupResp)
            assert new.ready

    @pytest.mark.parametrize("offers", [False, True])
    async def test_a_quota_refusal_is_said_only_to_a_peer_that_offered_to_hear_it(
        self, autojump_clock: trio.abc.Clock, offers: bool
    ) -> None:
        from p2pactor.core.protocol import EXTENSION  # noqa: PLC0415 -- one use
        from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415

        async with node_and_peer(quotas=PeerQuotas(max_pinned_blocks=1)) as (_, cache, peer):
            for i in (1, 2):
                cache.store(key(i), block_bytes(key(i)))
            await peer.dial()
            await peer.send(peer.connect_msg(extension=EXTENSION if offers else wire.UNSET))
            await peer.expect(wire.Connect)
            await peer.expect(wire.ConnectAck)
            await peer.send(wire.ConnectAck(peer_id=peer.peer_id))
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1), key(2)), round_seq=0))
            assert peer.conn is not None
            frame = await peer.conn.receive()
            resp = wire.decode(frame)
            assert isinstance(resp, wire.LookupResp)
            assert resp.hits == (True, False)  # one pin allowed: key 2 is refused
            if offers:
                assert resp.refused == (False, True)
            else:  # vLLM's dialect exactly: a MISS, and no field it does not know
                assert resp.refused is wire.UNSET
                assert b"refused" not in frame

    async def test_a_duplicate_ack_does_no_harm(self, autojump_clock: trio.abc.Clock) -> None:
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            await peer.send(wire.ConnectAck(peer_id=PEER))
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            resp = await peer.expect(wire.LookupResp)
            assert isinstance(resp, wire.LookupResp)
            assert resp.hits == (True,)
            assert node.peers.session(PEER) is not None


class TestErrorPolicy:
    async def test_undecodable_frame_disconnects(self, autojump_clock: trio.abc.Clock) -> None:
        async with node_and_peer() as (node, _, peer):
            await peer.handshake_as_client()
            await peer.send_raw(b"\x93\x01\x02")  # msgpack, but not a map
            await peer.expect(wire.Disconnect)
            assert "undecodable message" in await closed_reason(node)

    async def test_unknown_message_type_is_dropped_not_fatal(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            await peer.send_raw(msgspec.msgpack.encode({"type": "teleport", "x": 1}))
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            await peer.expect(wire.LookupResp)
            assert node.peers.session(PEER) is not None

    async def test_a_first_message_that_is_a_request_gets_a_disconnect(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        # The peer talks in a session that ended on this side only: it must
        # learn so now, not wait out its requests' deadlines.
        async with node_and_peer() as (node, _, peer):
            await peer.dial()
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            assert "its first message is a lookup, not a connect" in await closed_reason(node)
            assert await peer.receive() == wire.Disconnect()  # not a connect, not an answer

    async def test_a_stray_disconnect_opens_no_session(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        # Answering it with a connect is how two nodes bounce sessions forever.
        async with node_and_peer() as (node, _, peer):
            await peer.dial()
            await peer.send(wire.Disconnect())
            assert "its first message is a disconnect" in await closed_reason(node)
            with trio.move_on_after(5):
                msg = await peer.receive()
                pytest.fail(f"the node answered a stray disconnect with {msg}")

    async def test_message_before_connect_on_an_outbound_session_disconnects(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, _, peer):
            node.register_lookup(PEER, "r", [key(1)])
            node.flush()
            await peer.accept()
            await peer.expect(wire.Connect)
            await peer.send(wire.Lookup(kv_request_id="x", keys=(key(1),), round_seq=0))
            await peer.expect(wire.Disconnect)
            assert "before the peer's connect" in await closed_reason(node)

    async def test_fetch_outside_the_peers_pool_disconnects(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            await peer.expect(wire.LookupResp)
            await peer.send(
                wire.Fetch(kv_request_id="r", keys=(key(1),), block_indexes=(16,), round_seq=0)
            )
            await peer.expect(wire.Disconnect)
            assert "writes block 16, but the peer has 16 blocks" in await closed_reason(node)
            await trio.sleep(1)
            assert cache.held_jobs() == set()
            assert cache.opened == set()

    async def test_duplicate_fetch_disconnects_after_the_write_in_flight_ends(
        self, autojump_clock: trio.abc.Clock
    ) -> None:
        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            await peer.send(wire.Lookup(kv_request_id="r", keys=(key(1),), round_seq=0))
            await peer.expect(wire.LookupResp)
            plane = peer.data._plane
            plane.hold_writes()
            fetch = wire.Fetch(kv_request_id="r", keys=(key(1),), block_indexes=(0,), round_seq=0)
            await peer.send(fetch)
            await peer.send(fetch)
            await peer.expect(wire.Disconnect)
            await trio.sleep(5)
            # the session is dead but still draining: the write may still land
            assert node.peers.closed_sessions() == []
            assert cache.pinned() == 1
            plane.release_writes()
            assert "duplicate_fetch" in await closed_reason(node)
            assert peer.memory[:BLOCK_LEN] == block_bytes(key(1))
            assert cache.held_jobs() == set()
            assert cache.opened == set()


class TestDispatchErrors:
    async def test_five_internal_errors_in_a_row_disconnect_one_success_resets(
        self, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        real = p2pactor.runtime.actor.step_producer

        def buggy(state, event_input, now, timings):  # type: ignore[no-untyped-def]
            if isinstance(event_input, wire.Lookup) and event_input.keys == (b"boom",):
                raise RuntimeError("a bug in the core")
            return real(state, event_input, now, timings)

        monkeypatch.setattr(p2pactor.runtime.actor, "step_producer", buggy)

        async def boom(n: int) -> None:
            await peer.send(wire.Lookup(kv_request_id=f"b{n}", keys=(b"boom",), round_seq=0))

        async with node_and_peer() as (node, cache, peer):
            cache.store(key(1), block_bytes(key(1)))
            await peer.handshake_as_client()
            for n in range(4):
                await boom(n)
            await peer.send(wire.Lookup(kv_request_id="ok", keys=(key(1),), round_seq=0))
            await peer.expect(wire.LookupResp)  # alive after 4; the success resets
            for n in range(4):
                await boom(10 + n)
            await trio.sleep(1)
            assert node.peers.session(PEER) is not None, "4 in a row after a reset is survivable"
            await boom(20)
            await peer.expect(wire.Disconnect)
            assert "5 handler errors in a row" in await closed_reason(node)


async def test_a_pin_no_fetch_came_for_is_released_with_one_warning(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    async with node_and_peer() as (node, cache, peer):
        for i in range(3):
            cache.store(key(i), block_bytes(key(i)))
        await peer.handshake_as_client()
        for i in range(3):  # three lookups in a row, never fetched
            await peer.send(wire.Lookup(kv_request_id=f"r{i}", keys=(key(i),), round_seq=0))
            await peer.expect(wire.LookupResp)
        assert cache.pinned() == 3
        with caplog.at_level("WARNING", logger="p2pactor.session"):
            while cache.pinned():  # noqa: ASYNC110 - the cache has no event to wait on
                await trio.sleep(1)
        lines = [r for r in caplog.records if "never fetched" in r.getMessage()]
        assert len(lines) == 1  # one line for the burst, the rest counted
        assert getattr(lines[0], "peer", None) == PEER
        assert getattr(lines[0], "kv_request_id", None) == "r0"
        assert "no fetch used it within 30 s" in lines[0].getMessage()
        assert node.peer_usage(PEER).pinned_blocks == 0


async def test_a_burst_at_session_start_goes_out_when_the_gate_opens() -> None:
    """Frames queued before the gate leave at once, so a burst after it does not overflow.

    300 lookups wait for the handshake, 150 more come right after it: 450 frames
    over ``session_outbox=400``, but the connection takes the 300 as the gate
    opens, so the peer is reading and the session lives.
    """
    async with open_cluster("a", "b", session_outbox=400) as cluster:
        a, b = cluster["a"], cluster["b"]
        answers: list[list[LookupResult]] = []

        async def ask(name: str, k: bytes) -> None:
            answers.append(await a.node.lookup(b.id, name, [k]))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(ask, f"r{i}", key(i))
                while getattr(a.node.peers.session(b.id), "state", None) is not SessionState.READY:
                    await trio.lowlevel.checkpoint()
                for i in range(150):
                    nursery.start_soon(ask, f"s{i}", key(1000 + i))
        assert a.node.peers.closed_sessions() == []
        assert answers == [[MISS]] * 450
