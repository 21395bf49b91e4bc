"""In-memory transports with fault injection, for tests of nodes in one trio run.

* :class:`MemoryNetwork` stands in for ZeroMQ: each node gets a
  :class:`MemoryControlTransport` with the same shape as the real one (one
  connection per peer; a peer's first frame opens an inbound connection that
  "dials back"). Faults: drop or delay frames that match a predicate, kill a node
  (its peers see their connections die, as after a heartbeat timeout), restart it
  under the same id.
* :class:`MemoryDataPlane` stands in for NIXL: each node's block pool is a
  ``bytearray``; a write copies blocks into the peer's pool. Faults: fail the
  next writes, hold writes in flight until released, slow registration down.

Everything here runs on trio's clock, so tests can use ``autojump_clock``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import attrs
import trio

from p2pactor import protocol as wire
from p2pactor.errors import ProtocolError
from p2pactor.transport import ConnectionLost, TransferError

__all__ = [
    "FrameRule",
    "MemoryConnection",
    "MemoryControlTransport",
    "MemoryDataPlane",
    "MemoryDataTransport",
    "MemoryNetwork",
    "message_is",
]

FramePredicate = Callable[[str, str, bytes], bool]
"""``(source id, destination id, frame) -> matches?``"""


def message_is(
    *types: type[wire.Message], src: str | None = None, dst: str | None = None
) -> FramePredicate:
    """A predicate matching frames that decode to one of ``types`` (any, if none)."""

    def match(source: str, destination: str, frame: bytes) -> bool:
        if src is not None and source != src:
            return False
        if dst is not None and destination != dst:
            return False
        if not types:
            return True
        try:
            return isinstance(wire.decode(frame), types)
        except ProtocolError:
            return False

    return match


@attrs.define
class FrameRule:
    """A fault applied to frames in flight: drop them, or hold them back.

    Attributes:
        predicate: Which frames it applies to.
        drop: Drop matching frames.
        delay: Seconds to hold each matching frame (keeps order: later frames
            on the same connection wait behind it).
        remaining: How many more frames it applies to (None: all).
        hits: How many frames it applied to so far.
    """

    predicate: FramePredicate
    drop: bool = False
    delay: float = 0.0
    remaining: int | None = None
    hits: int = 0

    def take(self, src: str, dst: str, frame: bytes) -> bool:
        """Whether the rule applies to this frame (and count it if so)."""
        if self.remaining == 0 or not self.predicate(src, dst, frame):
            return False
        self.hits += 1
        if self.remaining is not None:
            self.remaining -= 1
        return True


class MemoryConnection:
    """One node's connection to one peer, in memory."""

    def __init__(self, transport: MemoryControlTransport, peer_id: str, capacity: int) -> None:
        self._transport = transport
        self._peer_id = peer_id
        self._send, self._receive = trio.open_memory_channel[bytes](capacity)
        self.dead_reason: str | None = None
        self.claimed = False

    def __repr__(self) -> str:
        return f"<MemoryConnection {self._transport.local_id} -> {self._peer_id}>"

    @property
    def peer_id(self) -> str:
        """The peer's id."""
        return self._peer_id

    @property
    def alive(self) -> bool:
        """Whether the connection still works."""
        return self.dead_reason is None

    async def send(self, frame: bytes) -> None:
        """Deliver ``frame`` to the peer (after any delay rule)."""
        if self.dead_reason is not None:
            raise ConnectionLost(self.dead_reason)
        await self._transport.network.route(self._transport.local_id, self._peer_id, frame)
        await trio.lowlevel.checkpoint()

    async def receive(self) -> bytes:
        """The peer's next frame."""
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise ConnectionLost(self.dead_reason or "connection closed") from None

    async def aclose(self) -> None:
        """Close it (the peer is not told: its own side dies on its own)."""
        self.kill("closed")
        await trio.lowlevel.checkpoint()

    def kill(self, reason: str) -> None:
        """Make the connection dead: pending and future receives fail with ``reason``."""
        if self.dead_reason is None:
            self.dead_reason = reason
            self._send.close()
        if self._transport.connections.get(self._peer_id) is self:
            del self._transport.connections[self._peer_id]

    def _incoming(self, frame: bytes) -> None:
        try:
            self._send.send_nowait(frame)
        except trio.WouldBlock:
            self.kill(f"{self._peer_id} sent more frames than we could queue")
        except trio.ClosedResourceError:
            pass


class MemoryControlTransport:
    """A node's control endpoint on a :class:`MemoryNetwork`."""

    def __init__(self, network: MemoryNetwork, local_id: str) -> None:
        self.network = network
        self._local_id = local_id
        self.connections: dict[str, MemoryConnection] = {}
        self._accept_send, self._accept_receive = trio.open_memory_channel[MemoryConnection](
            network.capacity
        )
        self.dead = False
        self._allowed: Callable[[str], bool] | None = None
        self.refused = 0  # first frames dropped by accept_only

    @property
    def local_id(self) -> str:
        """This node's id."""
        return self._local_id

    async def connect(self, peer_id: str) -> MemoryConnection:
        """The connection to ``peer_id``: the live one, or a new one."""
        await trio.lowlevel.checkpoint()
        conn = self.connections.get(peer_id)
        if conn is not None and conn.alive:
            conn.claimed = True
            return conn
        conn = self._new(peer_id)
        conn.claimed = True
        if not self.network.listening(peer_id):
            conn.kill(f"connection refused: nothing listens at {peer_id}")
        return conn

    async def accept(self) -> MemoryConnection:
        """The next connection a new peer opened by sending a frame."""
        while True:
            conn = await self._accept_receive.receive()
            if conn.alive and not conn.claimed:
                conn.claimed = True
                return conn

    def accept_only(self, allowed: Callable[[str], bool]) -> None:
        """Drop first frames of peers for which ``allowed`` is False."""
        self._allowed = allowed

    def _new(self, peer_id: str) -> MemoryConnection:
        conn = MemoryConnection(self, peer_id, self.network.capacity)
        self.connections[peer_id] = conn
        return conn

    def _incoming(self, src: str, frame: bytes) -> None:
        if self.dead:
            return
        conn = self.connections.get(src)
        if conn is None or not conn.alive:
            if self._allowed is not None and not self._allowed(src):
                self.refused += 1
                return
            conn = self._new(src)
            self._accept_send.send_nowait(conn)
        conn._incoming(frame)

    def kill(self, reason: str) -> None:
        """Kill this endpoint and every connection it has."""
        self.dead = True
        for conn in list(self.connections.values()):
            conn.kill(reason)


class MemoryNetwork:
    """ZeroMQ, in memory: delivers frames between :class:`MemoryControlTransport` s.

    Args:
        capacity: Frames queued per connection before the receiver counts the
            sender as flooding it (the connection dies).
    """

    def __init__(self, *, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._nodes: dict[str, MemoryControlTransport] = {}
        self.rules: list[FrameRule] = []
        self.frames = 0

    def transport(self, node_id: str) -> MemoryControlTransport:
        """The endpoint of ``node_id`` (a fresh one after :meth:`kill`: a restart)."""
        current = self._nodes.get(node_id)
        if current is not None and not current.dead:
            raise ValueError(f"{node_id} is already on the network")
        transport = MemoryControlTransport(self, node_id)
        self._nodes[node_id] = transport
        return transport

    def listening(self, node_id: str) -> bool:
        """Whether a live endpoint has ``node_id``."""
        node = self._nodes.get(node_id)
        return node is not None and not node.dead

    def kill(self, node_id: str, reason: str | None = None) -> None:
        """Kill a node: its endpoint dies, and so does every peer's connection to it."""
        why = reason or f"{node_id} went away (no heartbeat)"
        node = self._nodes.get(node_id)
        if node is not None:
            node.kill(why)
        for other in self._nodes.values():
            conn = other.connections.get(node_id)
            if conn is not None:
                conn.kill(why)

    def drop(self, predicate: FramePredicate, *, count: int | None = None) -> FrameRule:
        """Drop frames matching ``predicate`` (the next ``count`` of them, or all)."""
        rule = FrameRule(predicate, drop=True, remaining=count)
        self.rules.append(rule)
        return rule

    def delay(
        self, predicate: FramePredicate, seconds: float, *, count: int | None = None
    ) -> FrameRule:
        """Hold back frames matching ``predicate`` for ``seconds`` each."""
        rule = FrameRule(predicate, delay=seconds, remaining=count)
        self.rules.append(rule)
        return rule

    async def route(self, src: str, dst: str, frame: bytes) -> None:
        """Deliver one frame from ``src`` to ``dst``, applying the fault rules."""
        for rule in self.rules:
            if rule.take(src, dst, frame):
                if rule.drop:
                    return
                await trio.sleep(rule.delay)
        node = self._nodes.get(dst)
        if node is not None:
            self.frames += 1
            node._incoming(src, frame)


@attrs.define
class _WriteFault:
    remaining: int
    reason: str
    peer: str | None


class MemoryDataTransport:
    """A node's data endpoint on a :class:`MemoryDataPlane`: its pool is ``memory``."""

    _serials = itertools.count(1)

    def __init__(
        self, plane: MemoryDataPlane, memory: bytearray | memoryview, block_len: int
    ) -> None:
        if len(memory) % block_len:
            raise ValueError("the pool must be a whole number of blocks")
        self._plane = plane
        self.memory = memory
        self._block_len = block_len
        self._serial = next(self._serials)
        self._name = f"mem-agent-{self._serial}"
        self._peers: dict[str, tuple[MemoryDataTransport, int]] = {}
        self._inflight: dict[str, int] = {}
        self._idle: dict[str, trio.Event] = {}
        self.closed = False

    @property
    def agent_metadata(self) -> bytes:
        """The agent name peers use to find this pool."""
        return self._name.encode()

    @property
    def base_addr(self) -> int:
        """A fake address, distinct per pool."""
        return self._serial << 32

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self.memory) // self._block_len

    @property
    def block_len(self) -> int:
        """Bytes per block."""
        return self._block_len

    def registered(self) -> list[str]:
        """Names of the peers currently registered."""
        return list(self._peers)

    def inflight(self, peer_id: str | None = None) -> int:
        """Writes in flight (to one peer, or to all)."""
        if peer_id is not None:
            return self._inflight.get(peer_id, 0)
        return sum(self._inflight.values())

    async def add_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register a peer's pool (after the plane's registration delay)."""
        del base_addr
        await trio.sleep(self._plane.registration_delay)
        remote = self._plane.find(agent_metadata)
        if remote is None:
            raise TransferError(f"no pool for agent {agent_metadata[:64]!r}")
        if block_len != self._block_len or num_blocks != remote.num_blocks:
            raise TransferError("the peer's advertised pool does not match its memory")
        self._peers[peer_id] = (remote, num_blocks)

    async def remove_peer(self, peer_id: str) -> None:
        """Forget a peer once its writes in flight have ended."""
        while self._inflight.get(peer_id, 0):
            await self._idle.setdefault(peer_id, trio.Event()).wait()
        self._peers.pop(peer_id, None)
        await trio.lowlevel.checkpoint()

    async def write(
        self, peer_id: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> None:
        """Copy our blocks into the peer's, after the plane's faults have had their say."""
        entry = self._peers.get(peer_id)
        if entry is None:
            raise TransferError(f"{peer_id} is not registered")
        remote, remote_blocks_total = entry
        if len(local_blocks) != len(remote_blocks):
            raise TransferError("local and remote block lists differ in length")
        if any(not 0 <= b < self.num_blocks for b in local_blocks) or any(
            not 0 <= b < remote_blocks_total for b in remote_blocks
        ):
            raise TransferError("a block index is out of range")
        self._inflight[peer_id] = self._inflight.get(peer_id, 0) + 1
        try:
            await self._plane.before_write(peer_id)
            size = self._block_len
            for src, dst in zip(local_blocks, remote_blocks, strict=True):
                remote.memory[dst * size : (dst + 1) * size] = self.memory[
                    src * size : (src + 1) * size
                ]
            self._plane.bytes_written += size * len(local_blocks)
            self._plane.writes += 1
        finally:
            self._inflight[peer_id] -= 1
            if not self._inflight[peer_id]:
                event = self._idle.pop(peer_id, None)
                if event is not None:
                    event.set()


class MemoryDataPlane:
    """NIXL, in memory: pools are ``bytearray`` s and writes are copies.

    Attributes:
        registration_delay: Seconds every peer registration takes.
        writes: Writes completed so far.
        bytes_written: Bytes copied by them.
    """

    def __init__(self) -> None:
        self._pools: dict[bytes, MemoryDataTransport] = {}
        self._faults: list[_WriteFault] = []
        self._gate: trio.Event | None = None
        self.held = 0
        self.registration_delay = 0.0
        self.writes = 0
        self.bytes_written = 0

    def transport(self, memory: bytearray | memoryview, block_len: int) -> MemoryDataTransport:
        """A data endpoint over ``memory`` (a node's block pool)."""
        transport = MemoryDataTransport(self, memory, block_len)
        self._pools[transport.agent_metadata] = transport
        return transport

    def find(self, agent_metadata: bytes) -> MemoryDataTransport | None:
        """The pool a peer advertised."""
        return self._pools.get(agent_metadata)

    def fail_writes(
        self, count: int = 1, *, reason: str = "injected failure", peer: str | None = None
    ) -> None:
        """Make the next ``count`` writes (to ``peer``, or any) fail without copying."""
        self._faults.append(_WriteFault(count, reason, peer))

    def hold_writes(self) -> None:
        """Keep every write from now on in flight until :meth:`release_writes`."""
        if self._gate is None:
            self._gate = trio.Event()

    def release_writes(self) -> None:
        """Let held writes run."""
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    async def before_write(self, peer_id: str) -> None:
        """Apply the faults to one write: wait at the gate, or fail."""
        gate = self._gate
        if gate is not None:
            self.held += 1
            try:
                await gate.wait()
            finally:
                self.held -= 1
        else:
            await trio.lowlevel.checkpoint()
        for fault in self._faults:
            if fault.remaining and (fault.peer is None or peer_id.startswith(fault.peer)):
                fault.remaining -= 1
                raise TransferError(fault.reason)
