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

Both deliver what happens the way the real transports do: frames reach a
session on the trio thread, never inside the sender's call; a write's end is
reported to its callback.

Everything here runs on trio's clock, so tests can use ``autojump_clock``.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Sequence

import attrs
import trio

from p2pactor import protocol as wire
from p2pactor.errors import ProtocolError
from p2pactor.transport import ConnectionLost, FrameReceiver, TransferError, WriteDone

__all__ = [
    "FrameRule",
    "MemoryConnection",
    "MemoryControlTransport",
    "MemoryDataPlane",
    "MemoryDataTransport",
    "MemoryNetwork",
    "message_is",
]

log = logging.getLogger("p2pactor.testing")

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
        self._capacity = capacity
        self._send, self._receive = trio.open_memory_channel[bytes](capacity)
        self._receiver: FrameReceiver | None = None
        self._told_lost = False
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

    def send_nowait(self, frame: bytes) -> bool:
        """Put ``frame`` on the network to the peer (after any fault rule); always fits."""
        if self.dead_reason is not None:
            raise ConnectionLost(self.dead_reason)
        self._transport.network.post(self._transport.local_id, self._peer_id, frame)
        return True

    async def send(self, frame: bytes) -> None:
        """:meth:`send_nowait`, as a checkpoint."""
        await trio.lowlevel.checkpoint()
        self.send_nowait(frame)

    def attach(self, receiver: FrameReceiver | None) -> None:
        """Hand frames to ``receiver`` from now on, the buffered ones first (None: buffer)."""
        self._receiver = None
        if receiver is None:
            return
        while True:
            try:
                frame = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            receiver.frame_received(frame)
        self._receiver = receiver
        if self.dead_reason is not None:
            self._tell_lost()

    async def receive(self) -> bytes:
        """The peer's next frame (while no receiver is attached)."""
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise ConnectionLost(self.dead_reason or "connection closed") from None

    async def aclose(self) -> None:
        """Close it (the peer is not told: its own side dies on its own)."""
        self.kill("closed")
        await trio.lowlevel.checkpoint()

    def kill(self, reason: str) -> None:
        """Make the connection dead: pending and future receives fail with ``reason``.

        Frames already sent on the network arrive first.
        """
        self._transport.network.settle()
        if self.dead_reason is None:
            self.dead_reason = reason
            self._send.close()
        if self._transport.connections.get(self._peer_id) is self:
            del self._transport.connections[self._peer_id]
        self._tell_lost()

    def _tell_lost(self) -> None:
        receiver = self._receiver
        if receiver is not None and not self._told_lost:
            self._told_lost = True
            receiver.connection_lost(self.dead_reason or "connection closed")

    def _incoming(self, frame: bytes) -> None:
        if self.dead_reason is not None:
            return
        receiver = self._receiver
        if receiver is not None:
            receiver.frame_received(frame)
            return
        try:
            self._send.send_nowait(frame)
        except trio.WouldBlock:
            self.kill(f"{self._peer_id} sent more frames than we could queue")


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


@attrs.define(eq=False)
class _Link:
    """Frames from one node to another held back by a delay rule, in order."""

    src: str
    dst: str
    held: deque[tuple[float, bytes]] = attrs.field(factory=deque)


class MemoryNetwork:
    """ZeroMQ, in memory: delivers frames between :class:`MemoryControlTransport` s.

    A sent frame reaches its destination on the trio thread soon after, never
    inside the sender's call (as over a socket), in order per direction.

    Args:
        capacity: Frames queued per connection before the receiver counts the
            sender as flooding it (the connection dies).
    """

    def __init__(self, *, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._nodes: dict[str, MemoryControlTransport] = {}
        self.rules: list[FrameRule] = []
        self.frames = 0
        self._in_flight: deque[tuple[str, str, bytes]] = deque()
        self._scheduled = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._links: dict[tuple[str, str], _Link] = {}

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
        """Kill a node: its endpoint dies, and so does every peer's connection to it.

        Frames already sent arrive first (a test's kill comes after what it sent).
        """
        self.settle()
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
        """Hold back frames matching ``predicate`` for ``seconds`` each.

        Later frames on the same direction wait behind a held one.
        """
        rule = FrameRule(predicate, delay=seconds, remaining=count)
        self.rules.append(rule)
        return rule

    async def route(self, src: str, dst: str, frame: bytes) -> None:
        """:meth:`post`, as a checkpoint."""
        await trio.lowlevel.checkpoint()
        self.post(src, dst, frame)

    def post(self, src: str, dst: str, frame: bytes) -> None:
        """Send one frame from ``src`` to ``dst``, applying the fault rules; never blocks."""
        delay = 0.0
        for rule in self.rules:
            if rule.take(src, dst, frame):
                if rule.drop:
                    return
                delay += rule.delay
        link = self._links.get((src, dst))
        if delay or (link is not None and link.held):
            if link is None:
                link = self._links[src, dst] = _Link(src, dst)
            link.held.append((trio.current_time() + delay, frame))
            if len(link.held) == 1:
                trio.lowlevel.spawn_system_task(self._release, link, name=f"delay {src}->{dst}")
            return
        self._enqueue(src, dst, frame)

    async def _release(self, link: _Link) -> None:
        """Let a link's held frames go, each at its time, in order."""
        while link.held:
            when, frame = link.held[0]
            await trio.sleep_until(when)
            link.held.popleft()
            self._enqueue(link.src, link.dst, frame)

    def _enqueue(self, src: str, dst: str, frame: bytes) -> None:
        self._in_flight.append((src, dst, frame))
        if not self._scheduled:
            self._scheduled = True
            if self._token is None:
                self._token = trio.lowlevel.current_trio_token()
            # Delivered from trio's run loop, as a socket's receive task would:
            # never inside the sender's own step.
            self._token.run_sync_soon(self._deliver)

    def settle(self) -> None:
        """Deliver every frame in flight now (held ones excepted)."""
        self._deliver()

    def _deliver(self) -> None:
        self._scheduled = False
        while self._in_flight:
            src, dst, frame = self._in_flight.popleft()
            node = self._nodes.get(dst)
            if node is None:
                continue
            self.frames += 1
            try:
                node._incoming(src, frame)
            except Exception:
                # A crash here would end the whole trio run: log it instead.
                log.exception("delivering a frame from %s to %s failed", src, dst)


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
        self.expected = 0  # peer writes into this pool that may be running

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

    def start_write(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> None:
        """Copy our blocks into the peer's, once the plane's faults have had their say.

        Without a fault the copy happens at once and ``done`` is told before
        this returns; a held write waits for :meth:`MemoryDataPlane.release_writes`.
        """
        entry = self._peers.get(peer_id)
        if entry is None:
            done(f"{peer_id} is not registered")
            return
        remote, remote_blocks_total = entry
        if len(local_blocks) != len(remote_blocks):
            done("local and remote block lists differ in length")
            return
        if any(not 0 <= b < self.num_blocks for b in local_blocks) or any(
            not 0 <= b < remote_blocks_total for b in remote_blocks
        ):
            done("a block index is out of range")
            return
        self._inflight[peer_id] = self._inflight.get(peer_id, 0) + 1
        write = _Pending(self, peer_id, remote, tuple(local_blocks), tuple(remote_blocks), done)
        self._plane.submit(write)

    def _finish(self, write: _Pending, error: str | None = None) -> None:
        """Run a write the plane let through (or failed), then tell its caller."""
        error = error or self._plane.fault_for(write.peer_id)
        if error is None:
            size = self._block_len
            for src, dst in zip(write.local, write.remote, strict=True):
                write.target.memory[dst * size : (dst + 1) * size] = self.memory[
                    src * size : (src + 1) * size
                ]
            self._plane.bytes_written += size * len(write.local)
            self._plane.writes += 1
        self._inflight[write.peer_id] -= 1
        if not self._inflight[write.peer_id]:
            event = self._idle.pop(write.peer_id, None)
            if event is not None:
                event.set()
        write.done(error)

    async def write(
        self, peer_id: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> None:
        """:meth:`start_write`, waiting for the end.

        Raises:
            TransferError: The write failed.
        """
        over = trio.Event()
        outcome: list[str | None] = []

        def done(error: str | None) -> None:
            outcome.append(error)
            over.set()

        self.start_write(peer_id, local_blocks, remote_blocks, done)
        await over.wait()
        if outcome[0] is not None:
            raise TransferError(outcome[0])

    def expect_writes(self, delta: int) -> None:
        """Count peer writes that may be running into this pool (nothing to poll in memory)."""
        self.expected += delta


@attrs.define(eq=False)
class _Pending:
    """A write started and not yet run."""

    source: MemoryDataTransport
    peer_id: str
    target: MemoryDataTransport
    local: tuple[int, ...]
    remote: tuple[int, ...]
    done: WriteDone


class MemoryDataPlane:
    """NIXL, in memory: pools are ``bytearray`` s and writes are copies.

    Attributes:
        registration_delay: Seconds every peer registration takes.
        transfer_timeout: How long a held write waits before it fails.
        writes: Writes completed so far.
        bytes_written: Bytes copied by them.
    """

    def __init__(self) -> None:
        self._pools: dict[bytes, MemoryDataTransport] = {}
        self._faults: list[_WriteFault] = []
        self._holding = False
        self._held: deque[_Pending] = deque()
        self.held = 0
        self.registration_delay = 0.0
        self.transfer_timeout = 30.0
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
        self._holding = True

    def release_writes(self) -> None:
        """Let held writes run (in the order they were started)."""
        self._holding = False
        while self._held and not self._holding:
            write = self._held.popleft()
            self.held -= 1
            write.source._finish(write)

    def submit(self, write: _Pending) -> None:
        """Run a started write now, or hold it while writes are held.

        A held write that is still held ``transfer_timeout`` later fails, as
        NIXL's transport cancels a write that runs past its deadline.
        """
        if self._holding or self._held:
            self._held.append(write)
            self.held += 1
            trio.lowlevel.spawn_system_task(self._expire, write, name="held write")
            return
        write.source._finish(write)

    async def _expire(self, write: _Pending) -> None:
        await trio.sleep(self.transfer_timeout)
        if write in self._held:
            self._held.remove(write)
            self.held -= 1
            write.source._finish(write, f"no completion within {self.transfer_timeout:g} s")

    def fault_for(self, peer_id: str) -> str | None:
        """Why a write to ``peer_id`` fails now (one injected fault used), or None."""
        for fault in self._faults:
            if fault.remaining and (fault.peer is None or peer_id.startswith(fault.peer)):
                fault.remaining -= 1
                return fault.reason
        return None
