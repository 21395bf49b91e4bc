"""The two transports a node runs on, as small interfaces.

The runtime depends only on these; adapters implement them (ZeroMQ for control,
NIXL for data) and :mod:`p2pactor.testing` implements them in memory, with fault
injection, for tests.

* :class:`ControlTransport` / :class:`ControlConnection` carry frames (encoded
  protocol messages) between this node and each peer, in order, per direction.
  A session *attaches* a :class:`FrameReceiver` to its connection: from then on
  the transport hands it each frame synchronously, on the node's thread, where
  the frame arrives (no channel, no task in between).
* :class:`DataTransport` writes blocks of this node's pool into a peer's pool;
  a write is started without waiting and its end is reported to a callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from p2pactor.core.protocol_checks import Frame
from p2pactor.errors import P2PActorError


class ConnectionLost(P2PActorError):
    """The control connection to a peer is gone; the reason says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class TransferError(P2PActorError):
    """A write into a peer's blocks failed; no part of it is still running."""


class FrameReceiver(Protocol):
    """Who a connection hands its frames to once attached (a session)."""

    def frame_received(self, frame: Frame) -> None:
        """One frame from the peer, in order. Must not block; exceptions are logged."""

    def connection_lost(self, reason: str) -> None:
        """The connection died (after its last frame was handed over). Called once."""


WriteDone = Callable[[str | None], None]
"""How a write's end is reported: ``None`` when every byte arrived, else why not."""


class ControlConnection(Protocol):
    """One peer's control channel: frames to it and frames from it."""

    @property
    def peer_id(self) -> str:
        """The peer's id, ``host:port``."""

    def send_nowait(self, frame: bytes) -> bool:
        """Queue ``frame`` for the peer now if there is room; never blocks.

        Returns:
            Whether it was queued; False when the connection's queue is full
            (:meth:`send` then waits for room).

        Raises:
            ConnectionLost: The connection is dead.
        """

    async def send(self, frame: bytes) -> None:
        """Queue ``frame`` for the peer, in order, waiting for room if need be.

        Raises:
            ConnectionLost: The connection is dead, or the peer stopped reading
                (its queue stayed full).
        """

    def attach(self, receiver: FrameReceiver | None) -> None:
        """Hand every frame from now on to ``receiver`` (None: buffer them again).

        Frames that arrived before are handed over at once, in order, before
        this returns; so is the death of a connection that already died.
        """

    def renew(self) -> None:
        """The peer started a new session on this connection: reach it afresh.

        What was queued for the peer and not yet sent is dropped. A transport
        whose way to the peer can go stale unnoticed (a TCP connection the
        peer closed behind a cut link) opens it anew; if it cannot, the
        connection dies. Only for a p2pactor peer: a stock vLLM one may ignore
        the new way while the old one is still open at its end.
        """

    async def receive(self) -> Frame:
        """Wait for the peer's next frame, while no receiver is attached.

        Raises:
            ConnectionLost: The connection died; no frame will come.
        """

    async def aclose(self) -> None:
        """Close the connection. Idempotent."""


class ControlTransport(Protocol):
    """The node's control endpoint: dials peers and hears from new ones."""

    @property
    def local_id(self) -> str:
        """This node's id, ``host:port``, as peers dial it."""

    async def connect(self, peer_id: str) -> ControlConnection:
        """Open (or return the existing) connection to ``peer_id``.

        Raises:
            ConnectionLost: The peer cannot be dialed at all.
        """

    async def accept(self) -> ControlConnection:
        """Wait for a peer this node has no connection with to send a frame.

        The connection is returned once, with that first frame buffered.
        """

    def accept_only(self, allowed: Callable[[str], bool]) -> None:
        """From now on, drop the first frame of any peer for which ``allowed`` is False.

        The transport must decide before it spends anything on the peer: a
        ZeroMQ transport would otherwise dial back to whatever address the
        frame claims, which lets any sender steer this node's outbound
        connections (``allowed_peers``, CURVE keys).
        """


class DataTransport(Protocol):
    """Moves blocks from this node's pool into peers' pools (one-sided WRITE)."""

    @property
    def agent_metadata(self) -> bytes:
        """What a peer needs to register this node (sent in ``connect``)."""

    @property
    def base_addr(self) -> int:
        """Address of block 0 of this node's pool, as peers must name it."""

    @property
    def num_blocks(self) -> int:
        """Blocks in this node's pool."""

    @property
    def block_len(self) -> int:
        """Bytes per block."""

    @property
    def late_write_window(self) -> float:
        """How long after a peer went silent its write into our pool may still land.

        The data path's own bound (seconds): bytes already on the network,
        or a stalled write a link that comes back resumes. A consumer keeps
        the blocks of a load whose session was lost for this long before the
        engine may reuse them. 0: nothing lands once the session is gone.
        """

    async def add_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register a peer's pool so blocks can be written into it.

        May take a while (O(num_blocks)); it never blocks the event loop.

        Raises:
            TransferError: The peer's pool cannot be registered.
        """

    async def remove_peer(self, peer_id: str) -> None:
        """Forget a peer. Writes to it that are still running are waited for."""

    def start_write(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> None:
        """Start writing our ``local_blocks`` into the peer's ``remote_blocks``; never blocks.

        ``done`` is called exactly once, on the node's thread, possibly before
        this returns: with None once every byte has arrived, or with the reason
        it failed once no part of it can still be running (so the peer may
        reuse its blocks).
        """

    def expect_writes(self, delta: int) -> None:
        """Say that ``delta`` more (or, negative, fewer) peer writes into our pool may be running.

        A one-sided write may need its target's agent to make progress too; a
        transport that polls for progress (rather than waking on the data
        path's own events) polls only while a write of its own or an expected
        one may be running, so an idle node costs nothing.
        """
