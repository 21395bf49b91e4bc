"""PeerSession: everything between this node and one peer.

A session owns the control connection to its peer, the handshake, the routing of
the peer's messages to request actors, the actors themselves (records it steps,
through the node's runner, when their inputs arrive) and the transfers they
start. It has one task, which dials, shakes hands, waits for the end and then
drains; its frames are stepped where they arrive, on the transport's receive
path, not in a task of its own. Its life:

1. **Handshake** (PROTOCOL.md "Handshake"): send ``connect`` at once; check the
   peer's ``connect`` (block size, fingerprint, hash seed: a mismatch fails loudly
   with what to align), register the peer's memory off the receive path, and only
   then ``connect_ack``. Our own messages wait until our ``connect`` is acked
   and our ``connect_ack`` has gone out.
   Not ready within the handshake timeout: dead.
2. **Routing**: the transport hands each frame to :meth:`PeerSession.frame_received`,
   which decodes it and steps it at once: lookups, fetches and aborts on the
   producer actor of their kv_request_id (created on first contact), answers,
   acks and transfer_done on the consumer actor. A protocol violation
   disconnects the session; so do ``max_dispatch_errors`` internal errors in a row.
3. **Close**: every live actor is told the session ended; the session waits (up
   to ``drain_timeout``) for them to finish what can't be abandoned (writes in
   flight, parent answers owed), then reports what is still owed in a
   :class:`SessionCloseResult`. No actor outlives its session: one still
   running when the drain gives up is abandoned (it takes no more input) and
   what it held is in the result, for the node to release.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import math
from collections import OrderedDict, deque
from collections.abc import Sequence
from functools import partial
from typing import Final, Protocol

import attrs
import trio

from p2pactor import protocol as wire
from p2pactor.actor import ActorInput, RequestActor, Runner
from p2pactor.config import NodeConfig
from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.effects import context_name
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerState, pin_expired
from p2pactor.errors import ProtocolError, UnknownMessageType
from p2pactor.logsetup import peer_context, request_context
from p2pactor.quotas import QuotaLedger
from p2pactor.timers import Timers
from p2pactor.transport import (
    ConnectionLost,
    ControlConnection,
    ControlTransport,
    DataTransport,
    TransferError,
)

__all__ = [
    "EXTENSION",
    "PeerSession",
    "SessionCloseResult",
    "SessionHost",
    "SessionState",
]

log = logging.getLogger("p2pactor.session")

_RETIRED_MEMORY = 4096
_EXPIRY_LOG_INTERVAL_S = 10.0  # pins expired: at most one WARNING per session this often
_ENDED_PER_TURN = 32  # actors told their session ended before the drain lets others run
_PEER_MESSAGES = (
    wire.Lookup,
    wire.Fetch,
    wire.AbortFetch,
    wire.LookupResp,
    wire.TransferDone,
    wire.AbortAck,
)

# How each consumer event changes the loads in flight (writes a peer may be
# making into our pool): the data transport polls for progress only while any is.
_LOADS: Final[dict[type[ev.Event], int]] = {
    ev.FetchSent: 1,
    ev.TransferDone: -1,
    ev.AbortAcked: -1,
    ev.Aborted: -1,
}

FEATURE_RESP_ROUND = "lookup_resp_round"
FEATURE_SESSION_ROUNDS = "session_rounds"
FEATURE_DEADLINE = "lookup_deadline"
EXTENSION = wire.ConnectExtension(
    version=1, features=frozenset({FEATURE_RESP_ROUND, FEATURE_SESSION_ROUNDS, FEATURE_DEADLINE})
)
"""What this p2pactor offers peers in its ``connect``."""


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


@attrs.frozen(kw_only=True)
class SessionCloseResult:
    """What a closed session leaves behind.

    Attributes:
        peer_id: The peer.
        reason: Why the session ended.
        failed_loads: Load jobs of this node that failed because it ended.
        failed_requests: Our kv_request_ids that lost their answers.
        held_pins: Pin jobs still held when the drain gave up; the node
            releases them.
        open_contexts: Synthetic parent requests still owed a close; the node
            closes them at the next serve.
    """

    peer_id: str
    reason: str
    failed_loads: tuple[int, ...] = ()
    failed_requests: tuple[str, ...] = ()
    held_pins: tuple[int, ...] = ()
    open_contexts: tuple[str, ...] = ()


class SessionHost(Protocol):
    """What a session needs from its node."""

    @property
    def config(self) -> NodeConfig:
        """The node's configuration."""
        ...

    @property
    def data(self) -> DataTransport:
        """The node's data transport."""
        ...

    @property
    def hash_seed(self) -> str:
        """The hash seed to advertise and require."""
        ...

    @property
    def control(self) -> ControlTransport:
        """The node's control transport."""
        ...

    @property
    def quotas(self) -> QuotaLedger:
        """The node's per-peer quota counts."""
        ...

    @property
    def runner(self) -> Runner:
        """The node's runner: every input reaches an actor through it."""
        ...

    @property
    def timers(self) -> Timers:
        """The node's timer: actors' deadlines are armed on it."""
        ...

    def record(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """Append ``events`` to the node's event log."""

    def post_parent(self, actor: RequestActor, request: fx.ParentRequest) -> None:
        """Queue a parent request; its answer goes back to ``actor``."""

    def release_pin(self, job_id: int, *, success: bool) -> None:
        """Release a pin job (through the parent, when it is lent)."""

    def report_load(self, job_id: int, *, success: bool, reason: str) -> None:
        """Report one of the engine's load jobs finished."""

    def producer_opened(self, session: PeerSession, actor: RequestActor) -> None:
        """A producer actor was created (the node binds parked stores to it)."""

    def actor_created(self, actor: RequestActor) -> None:
        """An actor was created (observers may watch it)."""

    def handshake_ended(self, peer: str, outcome: str) -> None:
        """The handshake with ``peer`` ended: ``ok`` or why not (for metrics)."""

    def session_restarted(
        self, old: PeerSession, conn: ControlConnection, first: wire.Connect
    ) -> None:
        """The peer opened a new session on ``old``'s connection: start one with ``first``."""


class PeerSession:
    """The control session with one peer, and the request actors on it.

    Implements :class:`~p2pactor.transport.FrameReceiver` (for its connection)
    and :class:`~p2pactor.actor.ActorHost` (for its actors).
    """

    _serials = itertools.count(1)

    def __init__(
        self,
        host: SessionHost,
        peer_id: str,
        conn: ControlConnection | None = None,
        *,
        first: wire.Connect | None = None,
    ) -> None:
        self.peer_id = peer_id
        self.serial = next(self._serials)
        self.state = SessionState.CONNECTING
        self.death_reason: str | None = None
        self.result: SessionCloseResult | None = None
        self.peer_extension: wire.ConnectExtension | None = None
        self.last_activity = 0.0
        # trio clock, as last_activity (the session's start or its last frame
        # received): when send() last queued a message; None before the first.
        self.last_sent: float | None = None
        self._host = host
        self._config = host.config
        self._runner = host.runner
        self._conn = conn
        # The peer's connect, already read by the session this one replaces.
        self._first = first
        # Set when a new session of the peer's took this session's connection:
        # it is then neither told to disconnect nor closed by this session.
        self._handed_over = False
        self._consumers: dict[str, RequestActor] = {}
        self._producers: dict[str, RequestActor] = {}
        self._live = 0  # actors spawned and not retired (the drain waits for 0)
        self._expiry_logged_at = -math.inf
        self._expiries_unlogged = 0
        # Recently ended ids, so that a reused kv_request_id gets a new
        # incarnation; bounded, and replay copes when an old one is forgotten.
        self._retired: OrderedDict[tuple[Role, str], int] = OrderedDict()
        # Frames for the peer: until both connects are acked they wait in _early;
        # afterwards each goes straight to the connection (send_nowait), unless
        # its queue is full, and then they wait in _backlog for a sender task.
        # Both together stay under session_outbox.
        self._early: deque[bytes] = deque()
        self._backlog: deque[bytes] = deque()
        self._alive = True
        self._flowing = False  # our messages go out (both connects acked)
        self._ack_sent = False
        self._acked = trio.Event()
        self._established = trio.Event()  # both connects acked: READY
        self._peer_accepted = False
        self._peer_registered = trio.Event()
        self._peer_num_blocks = 0
        self._dead = trio.Event()
        self._closing = False
        self._quiet = trio.Event()  # closing, and every actor has ended
        self._closed = trio.Event()
        self._send_disconnect = False
        self._dispatch_errors = 0
        self._round_counter = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._failed_loads: tuple[int, ...] = ()
        self._failed_requests: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<PeerSession {self.peer_id} #{self.serial} {self.state.value}>"

    # --- what the node asks ------------------------------------------------------

    @property
    def runner(self) -> Runner:
        """The node's runner (the actors' host hands their inputs to it)."""
        return self._runner

    @property
    def data_name(self) -> str:
        """This session's name for the peer on the data transport.

        Unique per session, so a reconnecting peer's new registration never
        collides with an old session's writes still draining.
        """
        return f"{self.peer_id}#{self.serial}"

    @property
    def alive(self) -> bool:
        """Whether the session can still carry requests."""
        return self._alive

    @property
    def ready(self) -> bool:
        """Whether the handshake completed both ways."""
        return self._acked.is_set() and self._peer_registered.is_set()

    @property
    def unsent(self) -> int:
        """Frames queued for the peer and not yet sent (bounded by ``session_outbox``)."""
        return len(self._early) + len(self._backlog)

    def handshake_steps(self) -> dict[str, bool]:
        """Which steps of the handshake are done, by name (for status reports). Any thread."""
        return {
            "connected": self._conn is not None,
            "peer_connect_accepted": self._peer_accepted,
            "our_connect_acked": self._acked.is_set(),
            "peer_memory_registered": self._peer_registered.is_set(),
        }

    @property
    def extended(self) -> bool:
        """Whether the peer speaks p2pactor's extensions (else: vLLM's dialect)."""
        return self.peer_extension is not None

    def has_pending_work(self) -> bool:
        """True only while something is really outstanding on this session.

        Safe from any thread: it reads snapshots of immutable states.
        """
        if self.state is SessionState.CLOSED:
            return False
        if self.state is SessionState.CLOSING or not self.ready:
            return True
        # list() copies in one step under the GIL, while the trio thread may
        # be adding actors; states themselves are immutable.
        for actor in list(self._consumers.values()):
            state = actor.state
            if isinstance(state, ConsumerState) and state.loads and not state.phase.terminal:
                return True
        for actor in list(self._producers.values()):
            state = actor.state
            if isinstance(state, ProducerState) and (state.transfers or state.lookups):
                return True
        return False

    def has_transfers_in_flight(self) -> bool:
        """Whether a load or a write of this session is still running. Thread-safe."""
        for actor in list(self._consumers.values()):
            state = actor.state
            if isinstance(state, ConsumerState) and state.loads and not state.phase.terminal:
                return True
        return any(
            isinstance(actor.state, ProducerState) and actor.state.transfers
            for actor in list(self._producers.values())
        )

    def consumer(self, kv_request_id: str) -> RequestActor:
        """The live consumer actor for ``kv_request_id``, created (and opened) if needed."""
        actor = self._consumers.get(kv_request_id)
        if actor is not None and not actor.done:
            return actor
        actor = self._spawn(Role.CONSUMER, kv_request_id)
        self._consumers[kv_request_id] = actor
        first = next(self._round_counter) if self._session_rounds() else 0
        self._runner.deliver(actor, inp.Open(first_round=first))
        return actor

    def next_round(self) -> int | None:
        """The round to use after a fetch: session-wide with p2pactor peers."""
        return next(self._round_counter) if self._session_rounds() else None

    def live_actors(self) -> list[RequestActor]:
        """Every actor of this session that has not ended."""
        return [a for a in (*self._consumers.values(), *self._producers.values()) if not a.done]

    @property
    def dialing(self) -> bool:
        """Whether the session has no connection yet (it is about to dial the peer).

        Its ``control.connect()`` takes the peer's live connection from the
        transport, so a connection the peer opened meanwhile becomes this
        session's, not a second one.
        """
        return self._conn is None and self._alive

    def close(self, reason: str) -> None:
        """Close the session: tell the peer, end every actor, drain. Idempotent."""
        self._die(reason, disconnect=True)

    async def wait_closed(self) -> SessionCloseResult:
        """Wait until the session has closed and return what it left owed."""
        await self._closed.wait()
        assert self.result is not None
        return self.result

    # --- the session's task --------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the session until it dies, then drain it. Owns all its tasks."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.last_activity = trio.current_time()
                task_status.started()
                await self._talk()
                await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._finish()

    async def _talk(self) -> None:
        """Connect, handshake, and let frames flow until the session dies."""
        try:
            first: wire.Connect | None = self._first
            if not self._alive:
                return  # closed before its task ran
            if self._conn is None:
                self._conn = await self._host.control.connect(self.peer_id)
            elif first is None:
                first = await self._first_connect()
                if first is None:
                    return
            if self._dead.is_set():
                return  # closed while it dialed
            await self._conn.send(wire.encode(self._connect_message()))
            if first is not None:
                self._on_connect(first)
            assert self._nursery is not None
            self._nursery.start_soon(self._watch_handshake)
            # From here on the transport steps each frame as it arrives.
            self._conn.attach(self)
            await self._dead.wait()
        except ConnectionLost as exc:
            self._die(exc.reason)

    async def _first_connect(self) -> wire.Connect | None:
        """Read an inbound peer's first message, which must be its ``connect``.

        No ``connect`` goes to a peer whose first word is anything else:
        answering a stray frame (a ``disconnect`` that crossed our own close,
        say) with a ``connect`` would open a session it never asked for, and two
        nodes could bounce such sessions back and forth forever. A request
        (a lookup, say) means the peer still talks in a session whose connection
        died on this side only: it gets a ``disconnect``, so that its session
        ends now and its next request dials afresh, instead of its requests
        waiting out their deadlines. A ``disconnect`` is never answered, so
        this cannot bounce either.
        """
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

    def _connect_message(self) -> wire.Connect:
        data = self._host.data
        return wire.Connect(
            peer_id=self._config.node_id,
            agent_metadata=data.agent_metadata,
            base_addr=data.base_addr,
            num_blocks=data.num_blocks,
            block_len=data.block_len,
            config_fingerprint=self._config.fingerprint,
            hash_seed=self._host.hash_seed,
            extension=EXTENSION if self._config.round_extension else None,
        )

    async def _watch_handshake(self) -> None:
        """The handshake's deadline: not complete within ``handshake_timeout``, dead."""
        with trio.move_on_after(self._config.handshake_timeout):
            await self._established.wait()
            return
        self._host.handshake_ended(self.peer_id, "timeout")
        what = (
            "our connect was not acknowledged"
            if not self._acked.is_set()
            else ("the peer's connect never arrived or its memory never registered")
        )
        self._die(
            f"handshake not complete after {self._config.handshake_timeout:g} s ({what}); "
            f"check that {self.peer_id} runs p2pactor or vLLM's P2P tier at exactly that address"
        )

    def _dialect(self) -> str:
        return "p2pactor" if self.extended else "vLLM base"

    # --- frames, as the transport hands them over (FrameReceiver) -------------------

    def frame_received(self, frame: bytes) -> None:
        """Decode one frame of the peer's and step it now (on the transport's receive path)."""
        if not self._alive:
            return
        self.last_activity = trio.current_time()
        try:
            msg = wire.decode(frame, limits=self._config.limits)
        except UnknownMessageType as exc:
            # A newer peer may add message types; vLLM drops them too.
            log.warning(
                "%s: dropped a message: %s; harmless, but upgrade p2pactor on this node "
                "if the peer needs what it says",
                self.peer_id,
                exc,
                extra=peer_context(self.peer_id, node=self._config.node_id),
            )
            self._dispatch_errors = 0
            return
        except ProtocolError as exc:
            self._violation(f"undecodable message: {exc}")
            return
        try:
            self._dispatch(msg)
        except Exception:
            log.exception(
                "%s: failed to handle a %s message; a bug in p2pactor, please report it "
                "with this traceback (the session ends after %d such errors in a row)",
                self.peer_id,
                msg.TYPE,
                self._config.max_dispatch_errors,
                extra=request_context(
                    self.peer_id, getattr(msg, "kv_request_id", None), node=self._config.node_id
                ),
            )
            self._count_error()

    def connection_lost(self, reason: str) -> None:
        """The connection died: so does the session."""
        self._die(reason)

    def _dispatch(self, msg: wire.Message) -> None:
        match msg:
            case wire.Lookup() | wire.Fetch() | wire.AbortFetch() if self._peer_accepted:
                self._to_producer(msg)
            case wire.LookupResp() | wire.TransferDone() | wire.AbortAck() if self._peer_accepted:
                self._to_consumer(msg)
            case wire.Connect():
                self._on_connect(msg)
            case wire.ConnectAck():
                self._on_ack()
            case wire.Disconnect():
                self._die("the peer disconnected")
            case _:
                self._violation(f"a {msg.TYPE} message before the peer's connect")

    def _on_ack(self) -> None:
        self._dispatch_errors = 0
        if self._acked.is_set():
            return
        self._acked.set()
        self._open_gate()

    def _open_gate(self) -> None:
        """Once both connects are acked the session is ready: send what waited, in order."""
        if not (self._acked.is_set() and self._ack_sent) or self._flowing or not self._alive:
            return
        self._flowing = True
        self.state = SessionState.READY
        self._established.set()
        self._host.handshake_ended(self.peer_id, "ok")
        log.info(
            "session with %s ready (%s dialect)",
            self.peer_id,
            self._dialect(),
            extra=peer_context(self.peer_id, node=self._config.node_id),
        )
        early, self._early = self._early, deque()
        for frame in early:
            self._put(frame)

    def _on_connect(self, msg: wire.Connect) -> None:
        if self._peer_accepted:
            # The peer started a new session on this connection: its side of
            # this one died (it dialed again, and its new connection took this
            # one's place at our ROUTER). This session ends without a word (a
            # disconnect would end the peer's new one), and a new session takes
            # the connection from this connect on.
            assert self._conn is not None
            self._handed_over = True
            self._conn.attach(None)  # frames wait for the new session
            self._die("the peer started a new session on this connection")
            self._host.session_restarted(self, self._conn, msg)
            return
        outcome, problem = self._incompatibility(msg)
        if problem:
            self._host.handshake_ended(self.peer_id, outcome)
            log.error(
                "rejected %s: %s",
                self.peer_id,
                problem,
                extra=peer_context(self.peer_id, node=self._config.node_id),
            )
            self._die(f"incompatible peer: {problem}", disconnect=True)
            return
        self._peer_accepted = True
        self._peer_num_blocks = msg.num_blocks
        if self._config.round_extension:
            self.peer_extension = msg.extension
        assert self._nursery is not None
        self._nursery.start_soon(self._register_peer, msg)

    def _incompatibility(self, msg: wire.Connect) -> tuple[str, str]:
        """``(outcome, problem)``: why the peer can't be talked to (for metrics, for people).

        ``("", "")`` when it can.
        """
        cfg = self._config
        if msg.peer_id != self.peer_id:
            return "identity_mismatch", (
                f"it connected as {msg.peer_id!r} but its connection says {self.peer_id!r}; "
                "a peer's id must be the host:port it bound"
            )
        if msg.block_len != cfg.block_len:
            return "block_size_mismatch", (
                f"block size differs: {self.peer_id} uses {msg.block_len}-byte blocks, this node "
                f"{cfg.block_len}; every peer must use the same KV block layout"
            )
        if msg.config_fingerprint and cfg.fingerprint and msg.config_fingerprint != cfg.fingerprint:
            return "fingerprint_mismatch", (
                f"config fingerprint differs ({msg.config_fingerprint} vs {cfg.fingerprint}): "
                "the peers run different models, dtypes or block sizes; align them"
            )
        seed = self._host.hash_seed
        if msg.hash_seed != seed:
            return "seed_mismatch", (
                f"hash seed differs ({msg.hash_seed!r} vs {seed!r}): the same tokens "
                "would get different keys; set PYTHONHASHSEED to the same value on every node"
            )
        return "", ""

    async def _register_peer(self, msg: wire.Connect) -> None:
        # O(num_blocks) on a real data plane: never on the receive path.
        try:
            await self._host.data.add_peer(
                self.data_name, msg.agent_metadata, msg.base_addr, msg.num_blocks, msg.block_len
            )
        except TransferError as exc:
            self._die(f"could not register the peer's memory: {exc}", disconnect=True)
            return
        self._peer_registered.set()
        if not self._alive:
            return
        assert self._conn is not None
        try:
            await self._conn.send(wire.encode(wire.ConnectAck(peer_id=self._config.node_id)))
        except ConnectionLost as exc:
            self._die(exc.reason)
            return
        self._ack_sent = True
        self._open_gate()

    def _to_producer(self, msg: wire.Lookup | wire.Fetch | wire.AbortFetch) -> None:
        kv_id = msg.kv_request_id
        if isinstance(msg, wire.Fetch) and msg.block_indexes:
            top = max(msg.block_indexes)
            if top >= self._peer_num_blocks:
                self._violation(
                    f"fetch for {kv_id} writes block {top}, but the peer has "
                    f"{self._peer_num_blocks} blocks"
                )
                return
        actor = self._producers.get(kv_id)
        if actor is None or actor.done:
            if isinstance(msg, wire.Fetch) and not msg.keys:
                return  # closing a request we hold nothing for
            if isinstance(msg, wire.AbortFetch):
                # Nothing of ours can be writing for a request we no longer
                # serve: its transfer_done crossed this abort. Ack it.
                self.send(wire.AbortAck(kv_request_id=kv_id, round_seq=msg.round_seq))
                return
            actor = self._spawn(Role.PRODUCER, kv_id)
            self._producers[kv_id] = actor
            # Counted before its first step; a request over the peer's quota
            # still gets an actor, so that its refusal is in the event log,
            # and that actor closes after the one step.
            self._host.quotas.open_request(self.peer_id, actor)
            self._runner.deliver(actor, msg)
            # After its first message: stores waiting for the request (and an
            # engine's finish) follow the fetch that binds them.
            self._host.producer_opened(self, actor)
            return
        self._runner.deliver(actor, msg)

    def _to_consumer(self, msg: wire.LookupResp | wire.TransferDone | wire.AbortAck) -> None:
        actor = self._consumers.get(msg.kv_request_id)
        if actor is None or actor.done:
            log.debug(
                "%s: late %s for %s ignored",
                self.peer_id,
                msg.TYPE,
                msg.kv_request_id,
                extra=request_context(self.peer_id, msg.kv_request_id, node=self._config.node_id),
            )
            return
        if not self.extended and isinstance(msg, wire.LookupResp):
            msg = attrs.evolve(msg, round_seq=None)
        self._runner.deliver(actor, msg)

    def _spawn(self, role: Role, kv_request_id: str) -> RequestActor:
        previous = self._retired.pop((role, kv_request_id), None)
        incarnation = 0 if previous is None else previous + 1
        actor_id = ActorId(role, self.peer_id, kv_request_id, incarnation)
        actor = RequestActor(actor_id, self, self._config.timings)
        self._live += 1
        self._host.actor_created(actor)
        return actor

    def _retire(self, actor: RequestActor) -> None:
        table = self._consumers if actor.id.role is Role.CONSUMER else self._producers
        if table.get(actor.id.kv_request_id) is actor:
            del table[actor.id.kv_request_id]
        self._retired[actor.id.role, actor.id.kv_request_id] = actor.id.incarnation
        if len(self._retired) > _RETIRED_MEMORY:
            self._retired.popitem(last=False)
        self._live -= 1
        if self._closing and not self._live:
            self._quiet.set()

    def _session_rounds(self) -> bool:
        ext = self.peer_extension
        return ext is not None and FEATURE_SESSION_ROUNDS in ext.features

    # --- the actors' host (ActorHost) ---------------------------------------------

    def admit(self, actor: RequestActor, event_input: ActorInput) -> ActorInput:
        """The quota verdict on a peer's lookup or fetch, just before its actor steps it."""
        if isinstance(event_input, wire.Lookup | wire.Fetch):
            return self._host.quotas.admit(actor, event_input)
        return event_input

    def actor_stepped(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """Log an actor's events, count what they hold, and perform their effects."""
        host = self._host
        producer = actor.id.role is Role.PRODUCER
        if producer:
            host.quotas.observe(actor, events, trio.current_time())
        host.record(actor, events)
        loads = 0
        for event in events:
            if not producer:
                loads += _LOADS.get(type(event), 0)
            elif type(event) is ev.PinReleased and pin_expired(event):
                self._pin_expired(actor, event)
            for effect in fx.effects_of(event):
                self._perform(actor, effect)
        if loads:
            host.data.expect_writes(loads)

    def _pin_expired(self, actor: RequestActor, event: ev.PinReleased) -> None:
        """Say at WARNING that a peer never fetched what its lookup pinned (a line per 10 s)."""
        now = event.at
        if now < self._expiry_logged_at + _EXPIRY_LOG_INTERVAL_S:
            self._expiries_unlogged += 1
            return
        more, self._expiries_unlogged = self._expiries_unlogged, 0
        self._expiry_logged_at = now
        log.warning(
            "%s never fetched the blocks its lookup for %s pinned: released pin %d (%s)%s; "
            "a peer that looks up and does not fetch holds blocks for nothing (check that it "
            "runs p2pactor or vLLM's tier, and that its fetches reach this node)",
            self.peer_id,
            actor.id.kv_request_id,
            event.job_id,
            event.reason,
            f"; {more} more such releases since the last line" if more else "",
            extra=request_context(self.peer_id, actor.id.kv_request_id, node=self._config.node_id),
        )

    def _perform(self, actor: RequestActor, effect: fx.Effect) -> None:
        host = self._host
        match effect:
            case fx.Send(message):
                self.send(message)
            case fx.StartTransfer():
                self.start_transfer(actor, effect)
            case fx.ParentLookup() | fx.ParentClose():
                host.post_parent(actor, effect)
            case fx.ReleasePin(job_id=job_id, success=success):
                host.release_pin(job_id, success=success)
            case fx.ReportLoad(job_id=job_id, success=success, reason=reason):
                host.report_load(job_id, success=success, reason=reason)
            case fx.Disconnect(reason):
                self._violation(reason)
            case fx.Retire():
                self._retire(actor)

    def actor_failed(self, actor: RequestActor, event_input: ActorInput, exc: Exception) -> None:
        """The core raised on an input of ``actor``: count it against the session."""
        del actor, event_input, exc
        self._count_error()

    def actor_handled(self, actor: RequestActor, event_input: ActorInput) -> None:
        """A peer's message was handled: the run of errors is over (vLLM's rule)."""
        del actor
        if isinstance(event_input, _PEER_MESSAGES):
            self._dispatch_errors = 0

    def input_dropped(self, actor: RequestActor, event_input: ActorInput) -> None:
        """An input reached ``actor`` after it ended: release a pin it carries."""
        if isinstance(event_input, inp.ParentAnswer) and event_input.pin is not None:
            log.error(
                "%s ended before its parent answer; releasing its pin",
                actor.id,
                extra=request_context(
                    actor.id.peer, actor.id.kv_request_id, node=self._config.node_id
                ),
            )
            self._host.release_pin(event_input.pin.job_id, success=False)

    def deadline_changed(self, actor: RequestActor) -> None:
        """Arm the node's timer for the actor's new deadline."""
        self._host.timers.arm(actor)

    # --- sending ---------------------------------------------------------------------

    def send(self, msg: wire.Message) -> None:
        """Queue a message for the peer (sent once our connect is acked). Never blocks."""
        if not self._alive:
            return
        self.last_sent = trio.current_time()
        frame = wire.encode(self._to_dialect(msg))
        if self._flowing:
            self._put(frame)
        elif self._room():
            self._early.append(frame)

    def _room(self) -> bool:
        if len(self._early) + len(self._backlog) < self._config.session_outbox:
            return True
        self._die(f"the peer is not reading: {self._config.session_outbox} messages queued for it")
        return False

    def _put(self, frame: bytes) -> None:
        """Hand ``frame`` to the connection now, or behind the frames waiting for room."""
        if not self._backlog:
            assert self._conn is not None
            try:
                if self._conn.send_nowait(frame):
                    return
            except ConnectionLost as exc:
                self._die(exc.reason)
                return
        if not self._room():
            return
        self._backlog.append(frame)
        if len(self._backlog) == 1 and self._nursery is not None:
            self._nursery.start_soon(self._send_backlog)

    async def _send_backlog(self) -> None:
        """Send the frames that found the connection's queue full, in order, as room comes."""
        assert self._conn is not None
        while self._backlog and self._alive:
            try:
                await self._conn.send(self._backlog[0])
            except ConnectionLost as exc:
                self._die(exc.reason)
                return
            self._backlog.popleft()

    def _to_dialect(self, msg: wire.Message) -> wire.Message:
        """Strip p2pactor's extension fields for a peer that speaks vLLM's dialect."""
        features = self.peer_extension.features if self.peer_extension else frozenset()
        if isinstance(msg, wire.Lookup) and FEATURE_DEADLINE not in features:
            return attrs.evolve(msg, deadline_ms=None)
        if isinstance(msg, wire.LookupResp) and FEATURE_RESP_ROUND not in features:
            return attrs.evolve(msg, round_seq=None)
        return msg

    def start_transfer(self, actor: RequestActor, effect: fx.StartTransfer) -> None:
        """Start one WRITE for ``actor``; its end comes back to the actor as an input."""
        self._host.data.start_write(
            self.data_name,
            effect.local_blocks,
            effect.remote_blocks,
            partial(self._transfer_ended, actor, effect.transfer_id),
        )

    def _transfer_ended(self, actor: RequestActor, transfer_id: int, error: str | None) -> None:
        if error is None:
            result = inp.TransferResult(transfer_id=transfer_id, ok=True)
        else:
            result = inp.TransferResult(transfer_id=transfer_id, ok=False, reason=error)
        self._runner.deliver(actor, result)

    # --- errors and death ----------------------------------------------------------

    def _violation(self, what: str) -> None:
        log.warning(
            "%s broke the protocol: %s; disconnecting (check that both nodes run compatible "
            "p2pactor or vLLM versions)",
            self.peer_id,
            what,
            extra=peer_context(self.peer_id, node=self._config.node_id),
        )
        self._die(f"protocol violation: {what}", disconnect=True)

    def _count_error(self) -> None:
        self._dispatch_errors += 1
        if self._dispatch_errors >= self._config.max_dispatch_errors:
            self._die(
                f"{self._dispatch_errors} handler errors in a row (see the log above)",
                disconnect=True,
            )

    def _die(self, reason: str, *, disconnect: bool = False) -> None:
        if not self._alive:
            return
        self._alive = False
        self.death_reason = reason
        self._send_disconnect = disconnect
        self.state = SessionState.CLOSING
        log.info(
            "session with %s ended: %s",
            self.peer_id,
            reason,
            extra=peer_context(self.peer_id, node=self._config.node_id),
        )
        self._dead.set()

    # --- close ---------------------------------------------------------------------

    async def _drain(self) -> None:
        reason = self.death_reason or "closed"
        consumers = [a.state for a in self._consumers.values() if not a.done]
        self._failed_loads = tuple(
            load.job_id
            for s in consumers
            if isinstance(s, ConsumerState)
            for load in s.loads.values()
        )
        self._failed_requests = tuple(
            s.actor.kv_request_id
            for s in consumers
            if isinstance(s, ConsumerState) and (s.loads or s.waiting_keys())
        )
        conn = None if self._handed_over else self._conn
        if conn is not None:
            conn.attach(None)  # frames from now on are the next session's, or nobody's
            if self._send_disconnect:
                with trio.move_on_after(0.5), contextlib.suppress(ConnectionLost):
                    await conn.send(wire.encode(wire.Disconnect()))
            # Close now, not after the drain: a peer that dials again must
            # open a fresh connection, not talk into this dying one.
            await conn.aclose()
        self._early.clear()
        self._backlog.clear()
        self._closing = True
        ended = inp.SessionEnded(reason)
        for i, actor in enumerate(self.live_actors(), start=1):
            self._runner.deliver(actor, ended)
            if i % _ENDED_PER_TURN == 0:
                # A peer that leaves thousands of requests open must not stall
                # every other session while they wind down.
                await trio.lowlevel.checkpoint()
        if self._live:
            with trio.move_on_after(self._config.drain_timeout):
                await self._quiet.wait()

    async def _finish(self) -> None:
        reason = self.death_reason or "closed"
        self._closing = True
        # No actor outlives its session: those the drain gave up on take no
        # more input, and what they still hold is reported below.
        abandoned_loads = 0
        for actor in (*self._consumers.values(), *self._producers.values()):
            if not actor.done:
                state = actor.state
                if isinstance(state, ConsumerState):
                    abandoned_loads += len(state.loads)
                actor.abandon()
        if abandoned_loads:
            self._host.data.expect_writes(-abandoned_loads)
        # Whatever the peer's requests still held here is no longer theirs:
        # the node releases their pins (counted until released) below.
        self._host.quotas.forget_all(self._producers.values())
        producers = [a.state for a in self._producers.values()]
        self.result = SessionCloseResult(
            peer_id=self.peer_id,
            reason=reason,
            failed_loads=self._failed_loads,
            failed_requests=self._failed_requests,
            held_pins=tuple(
                job for s in producers if isinstance(s, ProducerState) for job in s.jobs
            ),
            open_contexts=tuple(
                context_name(s.actor, lookup_id)
                for s in producers
                if isinstance(s, ProducerState)
                for lookup_id in s.open_contexts
            ),
        )
        if self._conn is not None and not self._handed_over:
            await self._conn.aclose()  # idempotent; the drain may not have run
        if self._peer_accepted:
            await self._host.data.remove_peer(self.data_name)
        self.state = SessionState.CLOSED
        self._closed.set()
