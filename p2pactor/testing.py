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

import logging
from collections import deque
from collections.abc import Callable

import attrs
import trio

from p2pactor.core import protocol as wire
from p2pactor.errors import ProtocolError
from p2pactor.runtime.transport import ConnectionLost, FrameReceiver
from p2pactor.testing_data import MemoryDataPlane, MemoryDataTransport

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

    def renew(self) -> None:
        """Nothing to do: the network in memory has no way to the peer that could go stale."""

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
