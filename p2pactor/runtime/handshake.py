"""The handshake with a peer, the dialect it agrees, and the control connection it opens.

Each side sends ``connect`` at once, checks the peer's, registers its memory
off the receive path, and only then sends ``connect_ack``; our own messages
wait until both connects are acked (``docs/protocol.md``, "Handshake"). What
our ``connect`` offers, and what a peer of each dialect may hear: "Extensions".
"""

from __future__ import annotations

import abc
import contextlib
import enum
import itertools
import logging
from collections import deque
from typing import TYPE_CHECKING

import trio
from msgspec.structs import replace

from p2pactor.core import protocol as wire
from p2pactor.errors import ProtocolError
from p2pactor.runtime.logcontext import peer_context
from p2pactor.runtime.process import ProcessWatch, this_process, watch
from p2pactor.runtime.transport import ConnectionLost, ControlConnection, TransferError

if TYPE_CHECKING:
    from p2pactor.runtime.host import NodeHost


log = logging.getLogger("p2pactor.session")  # a session's lines, wherever they are written


def _to_dialect(msg: wire.Message, features: frozenset[str]) -> wire.Message:
    """``msg`` without the extension fields a peer speaking only ``features`` does not speak."""
    if isinstance(msg, wire.Lookup) and wire.FEATURE_DEADLINE not in features:
        return replace(msg, deadline_ms=wire.UNSET)
    if isinstance(msg, wire.LookupResp):
        if wire.FEATURE_RESP_ROUND not in features:
            msg = replace(msg, round_seq=wire.UNSET)
        if wire.FEATURE_REFUSED not in features and msg.refused is not wire.UNSET:
            msg = replace(msg, refused=wire.UNSET)
    return msg


class SessionState(enum.Enum):
    """Where a session is in its life."""

    CONNECTING = "connecting"
    """Dialing, or waiting for the handshake to complete."""
    READY = "ready"
    """Both connects accepted and acked: requests flow both ways."""
    CLOSING = "closing"
    """Dead; actors are finishing what can't be abandoned."""
    CLOSED = "closed"
    """Gone. Its result says what was still owed."""


class ControlLink(abc.ABC):
    """The control connection to one peer: its handshake, and our messages queued for it.

    The base of :class:`~p2pactor.runtime.session.PeerSession`, which routes what the peer says.
    """

    _serials = itertools.count(1)

    def __init__(
        self,
        host: NodeHost,
        peer_id: str,
        conn: ControlConnection | None,
        first: wire.Connect | None,
    ) -> None:
        self.peer_id = peer_id
        self.serial = next(self._serials)
        self.state = SessionState.CONNECTING
        self.death_reason: str | None = None
        self.peer_extension: wire.ConnectExtension | None = None
        # The extensions both sides speak, from the peer's connect on (none: vLLM's dialect).
        self.features: frozenset[str] = frozenset()
        # The peer's process, where only this kernel lies between us (runtime/process.py).
        self.peer_process: ProcessWatch | None = None
        self.last_activity = 0.0
        # When send() last queued a message (trio clock, as last_activity); None: never.
        self.last_sent: float | None = None
        self._host = host
        self._config = host.config
        self._conn = conn
        # The peer's connect, already read by the session this one replaces.
        self._first = first
        # A new session of the peer's took the connection: this one must not close it.
        self._handed_over = False
        self._log_extra = peer_context(peer_id, node=host.config.node_id)
        # Frames for the peer wait here, under session_outbox: until both connects
        # are acked, then only while the connection's queue is full.
        self._backlog: deque[bytes] = deque()
        self._ack_sent = False
        self._acked = False
        self._established = trio.Event()  # both connects acked: READY, our messages go out
        self._peer_accepted = False
        self._peer_registered = False
        self._peer_num_blocks = 0
        self._dead = trio.Event()
        self._send_disconnect = False
        self._nursery: trio.Nursery  # the session's task's, from its start

    @property
    def data_name(self) -> str:
        """The peer's name on the data transport, per session (never an old session's)."""
        return f"{self.peer_id}#{self.serial}"

    @property
    def alive(self) -> bool:
        """Whether the session can still carry requests."""
        return not self._dead.is_set()

    @property
    def ready(self) -> bool:
        """Whether the handshake completed both ways."""
        return self._acked and self._peer_registered

    @property
    def extended(self) -> bool:
        """Whether the peer speaks p2pactor's extensions (else: vLLM's dialect)."""
        return self.peer_extension is not None

    @property
    def dialing(self) -> bool:
        """Whether it has no connection yet: it will dial, or take the one the peer opened."""
        return self._conn is None and self.alive

    @property
    def unsent(self) -> int:
        """Frames queued for the peer and not yet sent (bounded by ``session_outbox``)."""
        return len(self._backlog)

    def handshake_steps(self) -> dict[str, bool]:
        """Which steps of the handshake are done, by name (for status reports). Any thread."""
        return {
            "connected": self._conn is not None,
            "peer_connect_accepted": self._peer_accepted,
            "our_connect_acked": self._acked,
            "peer_memory_registered": self._peer_registered,
        }

    @abc.abstractmethod
    def frame_received(self, frame: wire.Frame) -> None:
        """Step one frame of the peer's (the transport calls it once the handshake began)."""

    def connection_lost(self, reason: str) -> None:
        """The connection died: so does the session."""
        self._die(reason)

    @property
    def summaries(self) -> bool:
        """Whether both sides offered the summary extension (so its messages may flow)."""
        return wire.FEATURE_SUMMARIES in self.features

    # --- the handshake's steps -----------------------------------------------------

    async def _talk(self) -> None:
        """Connect, handshake, and let frames flow until the session dies."""
        try:
            first: wire.Connect | None = self._first
            if not self.alive:
                return  # closed before its task ran
            if self._conn is None:
                self._conn = await self._host.control.connect(self.peer_id)
            elif first is None:
                first = await self._first_connect()
            if self._dead.is_set():
                return  # closed while it dialed, or no connect came first
            await self._conn.send(wire.encode(self._connect_message()))
            if first is not None:
                self._accept(first)
            self._nursery.start_soon(self._watch_handshake)
            # From here on the transport steps each frame as it arrives.
            self._conn.attach(self)
            await self._dead.wait()
        except ConnectionLost as exc:
            self._die(exc.reason)

    async def _first_connect(self) -> wire.Connect | None:
        """Read an inbound peer's first message, which must be its ``connect`` (else: dead)."""
        assert self._conn is not None
        with trio.move_on_after(self._config.handshake_timeout):
            frame = await self._conn.receive()
            self.last_activity = trio.current_time()
            try:
                msg = wire.decode(frame, limits=self._config.limits)
            except ProtocolError as exc:
                self._die(f"its first message is undecodable: {exc}")
                return None
            if isinstance(msg, wire.Connect):
                return msg
            if isinstance(msg, wire.Disconnect):
                self._die("its first message is a disconnect, not a connect; not answering")
            else:
                self._die(
                    f"its first message is a {msg.TYPE}, not a connect: it talks in a "
                    "session that ended here; told it to disconnect",
                    disconnect=True,
                )
            return None
        self._host.handshake_ended(self.peer_id, "timeout")
        self._die(f"no connect within {self._config.handshake_timeout:g} s of its first frame")
        return None

    async def _watch_handshake(self) -> None:
        """The handshake's deadline: not complete within ``handshake_timeout``, dead."""
        with trio.move_on_after(self._config.handshake_timeout):
            await self._established.wait()
            return
        self._host.handshake_ended(self.peer_id, "timeout")
        what = (
            "our connect was not acknowledged"
            if not self._acked
            else "the peer's connect never arrived or its memory never registered"
        )
        self._die(
            f"handshake not complete after {self._config.handshake_timeout:g} s ({what}); "
            f"check that {self.peer_id} runs p2pactor or vLLM's P2P tier at exactly that address"
        )

    def _offered(self) -> frozenset[str]:
        summaries = {wire.FEATURE_SUMMARIES} if self._config.sources.share else set()
        return wire.EXTENSION.features | summaries

    def _connect_message(self) -> wire.Connect:
        """This node's ``connect``: its memory, its configuration, and what it speaks."""
        config = self._config
        data = self._host.data
        return wire.Connect(
            peer_id=config.node_id,
            agent_metadata=data.agent_metadata,
            base_addr=data.base_addr,
            num_blocks=data.num_blocks,
            block_len=data.block_len,
            config_fingerprint=config.fingerprint,
            hash_seed=self._host.hash_seed,
            extension=replace(wire.EXTENSION, features=self._offered(), process=this_process())
            if config.round_extension
            else wire.UNSET,
        )

    def _incompatibility(self, msg: wire.Connect) -> tuple[str, str]:
        """``(outcome, problem)``: why the peer can't be talked to (``("", "")``: it can)."""
        peer_id = self.peer_id
        config = self._config
        hash_seed = self._host.hash_seed
        if msg.peer_id != peer_id:
            return "identity_mismatch", (
                f"it connected as {msg.peer_id!r} but its connection says {peer_id!r}; "
                "a peer's id must be the host:port it bound"
            )
        if msg.block_len != config.block_len:
            return "block_size_mismatch", (
                f"block size differs: {peer_id} uses {msg.block_len}-byte blocks, this node "
                f"{config.block_len}; every peer must use the same KV block layout"
            )
        ours = config.fingerprint
        if msg.config_fingerprint and ours and msg.config_fingerprint != ours:
            return "fingerprint_mismatch", (
                f"config fingerprint differs ({msg.config_fingerprint} vs {ours}): "
                "the peers run different models, dtypes or block sizes; align them"
            )
        if msg.hash_seed != hash_seed:
            return "seed_mismatch", (
                f"hash seed differs ({msg.hash_seed!r} vs {hash_seed!r}): the same tokens "
                "would get different keys; set PYTHONHASHSEED to the same value on every node"
            )
        return "", ""

    def _accept(self, msg: wire.Connect) -> None:
        """Check the peer's ``connect``; register its memory if it is compatible."""
        outcome, problem = self._incompatibility(msg)
        if problem:
            self._host.handshake_ended(self.peer_id, outcome)
            log.error("rejected %s: %s", self.peer_id, problem, extra=self._log_extra)
            self._die(f"incompatible peer: {problem}", disconnect=True)
            return
        self._peer_accepted = True
        self._peer_num_blocks = msg.num_blocks
        if isinstance(msg.extension, wire.ConnectExtension):
            self.peer_process = watch(msg.extension.process)
        if self._config.round_extension:
            self.peer_extension = msg.extension or None
        theirs = self.peer_extension
        self.features = self._offered() & theirs.features if theirs else frozenset()
        if self.summaries:
            self._host.directory.peer_accepted(self, msg.num_blocks)
        self._nursery.start_soon(self._register_peer, msg)

    async def _register_peer(self, msg: wire.Connect) -> None:
        # O(num_blocks) on a real data plane: never on the receive path.
        try:
            await self._host.data.add_peer(
                self.data_name, msg.agent_metadata, msg.base_addr, msg.num_blocks, msg.block_len
            )
        except TransferError as exc:
            self._die(f"could not register the peer's memory: {exc}", disconnect=True)
            return
        self._peer_registered = True
        if not self.alive:
            return
        assert self._conn is not None
        try:
            await self._conn.send(wire.encode(wire.ConnectAck(peer_id=self._config.node_id)))
        except ConnectionLost as exc:
            self._die(exc.reason)
            return
        self._ack_sent = True
        self._open_gate()

    def _open_gate(self) -> None:
        """Once both connects are acked the session is ready: send what waited, in order."""
        if not (self._acked and self._ack_sent and self.alive) or self._established.is_set():
            return
        self.state = SessionState.READY
        self._established.set()
        self._host.handshake_ended(self.peer_id, "ok")
        dialect = "p2pactor" if self.extended else "vLLM base"
        log.info("session with %s ready (%s dialect)", self.peer_id, dialect, extra=self._log_extra)
        self._flush()  # what waited for the gate goes first, in order
        if self.summaries:
            self._host.directory.peer_ready(self)

    # --- sending ---------------------------------------------------------------------

    def send(self, msg: wire.Message) -> None:
        """Queue a message for the peer (sent once our connect is acked). Never blocks."""
        if not self.alive:
            return
        self.last_sent = trio.current_time()
        frame = wire.encode(_to_dialect(msg, self.features))
        if self.unsent >= self._config.session_outbox:
            self._die(
                f"the peer is not reading: {self._config.session_outbox} messages queued for it"
            )
            return
        # Before the gate opens, or behind frames that found the connection's queue full.
        self._backlog.append(frame)
        if self._established.is_set() and len(self._backlog) == 1:
            self._flush()

    def _flush(self) -> None:
        """Hand the connection the queued frames that fit now; a sender task waits for the rest."""
        assert self._conn is not None
        try:
            while self._backlog and self._conn.send_nowait(self._backlog[0]):
                self._backlog.popleft()
        except ConnectionLost as exc:
            self._die(exc.reason)
            return
        if self._backlog:
            self._nursery.start_soon(self._send_backlog)

    async def _send_backlog(self) -> None:
        """Send the frames that found the connection's queue full, in order, as room comes."""
        assert self._conn is not None
        while self._backlog and self.alive:
            try:
                await self._conn.send(self._backlog[0])
            except ConnectionLost as exc:
                self._die(exc.reason)
                return
            self._backlog.popleft()

    def _die(self, reason: str, *, disconnect: bool = False) -> None:
        """The session is dead: ``disconnect`` tells the peer so as it drains."""
        if self._dead.is_set():
            return
        self._dead.set()
        self.death_reason = reason
        self._send_disconnect = disconnect
        self.state = SessionState.CLOSING
        log.info("session with %s ended: %s", self.peer_id, reason, extra=self._log_extra)

    async def _hang_up(self) -> None:
        """Detach and close the connection, with a ``disconnect`` if the death asked for one."""
        conn = None if self._handed_over else self._conn
        if conn is not None:
            conn.attach(None)  # frames from now on are the next session's, or nobody's
            if self._send_disconnect:
                with trio.move_on_after(0.5), contextlib.suppress(ConnectionLost):
                    await conn.send(wire.encode(wire.Disconnect()))
            # Close now, not after the drain: a peer that dials again must
            # open a fresh connection, not talk into this dying one.
            await conn.aclose()
        self._backlog.clear()

    async def _let_go(self) -> None:
        """Close the connection (if :meth:`_hang_up` never ran) and forget the peer's memory."""
        if self._conn is not None and not self._handed_over:
            await self._conn.aclose()  # idempotent
        if self.peer_process is not None:
            self.peer_process.close()
        if self._peer_accepted:
            await self._host.data.remove_peer(self.data_name)
