"""PeerSession: everything between this node and one peer.

A session owns the control connection to its peer, the handshake, the routing of
the peer's messages to request actors, the actors themselves (each a task in the
session's nursery) and the transfers they start. Its life:

1. **Handshake** (PROTOCOL.md "Handshake"): send ``connect`` at once; check the
   peer's ``connect`` (block size, fingerprint, hash seed: a mismatch fails loudly
   with what to align), register the peer's memory off the receive path, and only
   then ``connect_ack``. Our own messages wait until our ``connect`` is acked.
   Not ready within the handshake timeout: dead.
2. **Routing**: lookups, fetches and aborts go to the producer actor of their
   kv_request_id (created on first contact); answers, transfer results and acks
   to the consumer actor. A protocol violation disconnects the session; so do
   ``max_dispatch_errors`` internal errors in a row.
3. **Close**: every live actor is told the session ended; the session waits (up
   to ``drain_timeout``) for them to finish what can't be abandoned (writes in
   flight, parent answers owed), then reports what is still owed in a
   :class:`SessionCloseResult`.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import trio

from p2pactor import protocol as wire
from p2pactor.actor import ActorInput, RequestActor
from p2pactor.config import NodeConfig
from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.effects import context_name
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerState
from p2pactor.errors import ProtocolError, UnknownMessageType
from p2pactor.logsetup import peer_context, request_context
from p2pactor.quotas import QuotaLedger
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
_PEER_MESSAGES = (
    wire.Lookup,
    wire.Fetch,
    wire.AbortFetch,
    wire.LookupResp,
    wire.TransferDone,
    wire.AbortAck,
)

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
    """The control session with one peer, and the request actors on it."""

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
        self._conn = conn
        # The peer's connect, already read by the session this one replaces.
        self._first = first
        # Set when a new session of the peer's took this session's connection:
        # it is then neither told to disconnect nor closed by this session.
        self._handed_over = False
        self._consumers: dict[str, RequestActor] = {}
        self._producers: dict[str, RequestActor] = {}
        # Recently ended ids, so that a reused kv_request_id gets a new
        # incarnation; bounded, and replay copes when an old one is forgotten.
        self._retired: OrderedDict[tuple[Role, str], int] = OrderedDict()
        self._outbox_send, self._outbox_recv = trio.open_memory_channel[bytes](
            self._config.session_outbox
        )
        # Frames in the outbox or in the send loop's hands, not yet sent. While
        # there are none, send() hands a frame to the connection itself (if it
        # offers send_nowait, as ZeroMQ's does), sparing the send loop's
        # wake-up per message; otherwise it queues behind them, in order.
        self._unsent = 0
        self._send_now: Callable[[bytes], bool] | None = None
        self._acked = trio.Event()
        self._peer_accepted = False
        self._peer_registered = trio.Event()
        self._peer_num_blocks = 0
        self._dead = trio.Event()
        self._closed = trio.Event()
        self._send_disconnect = False
        self._dispatch_errors = 0
        self._round_counter = itertools.count(1)
        self._nursery: trio.Nursery | None = None
        self._started = trio.Event()
        self._failed_loads: tuple[int, ...] = ()
        self._failed_requests: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<PeerSession {self.peer_id} #{self.serial} {self.state.value}>"

    # --- what the node asks ------------------------------------------------------

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
        return not self._dead.is_set()

    @property
    def ready(self) -> bool:
        """Whether the handshake completed both ways."""
        return self._acked.is_set() and self._peer_registered.is_set()

    @property
    def unsent(self) -> int:
        """Frames queued for the peer and not yet sent (bounded by ``session_outbox``)."""
        return self._unsent

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
        """The live consumer actor for ``kv_request_id``, created if needed."""
        actor = self._consumers.get(kv_request_id)
        if actor is not None and not actor.done:
            return actor
        actor = self._spawn(Role.CONSUMER, kv_request_id)
        self._consumers[kv_request_id] = actor
        first = next(self._round_counter) if self._session_rounds() else 0
        actor.deliver_nowait(inp.Open(first_round=first))  # the inbox is empty: always fits
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
        return self._conn is None and not self._dead.is_set()

    def close(self, reason: str) -> None:
        """Close the session: tell the peer, end every actor, drain. Idempotent."""
        self._die(reason, disconnect=True)

    async def wait_started(self) -> None:
        """Wait until the session's task runs (it can take actors from then on)."""
        await self._started.wait()

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
                self._started.set()
                task_status.started()
                await self._talk()
                await self._drain()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._finish()

    async def _talk(self) -> None:
        """Connect, handshake and carry messages until the session dies."""
        try:
            first: wire.Connect | None = self._first
            if self._conn is None:
                self._conn = await self._host.control.connect(self.peer_id)
            elif first is None:
                first = await self._first_connect()
                if first is None:
                    return
            await self._conn.send(wire.encode(self._connect_message()))
            if first is not None:
                self._on_connect(first)
            async with trio.open_nursery() as io:
                io.start_soon(self._receive_loop)
                io.start_soon(self._send_loop)
                io.start_soon(self._watch_handshake)
                await self._dead.wait()
                io.cancel_scope.cancel()
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
        with trio.move_on_after(self._config.handshake_timeout):
            await self._acked.wait()
            await self._peer_registered.wait()
            self.state = SessionState.READY
            self._host.handshake_ended(self.peer_id, "ok")
            log.info(
                "session with %s ready (%s dialect)",
                self.peer_id,
                self._dialect(),
                extra=peer_context(self.peer_id, node=self._config.node_id),
            )
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

    async def _send_loop(self) -> None:
        await self._acked.wait()
        assert self._conn is not None
        # Optional in ControlConnection: the in-memory test transport has none.
        send_now = getattr(self._conn, "send_nowait", None)
        self._send_now = send_now if callable(send_now) else None
        async for frame in self._outbox_recv:
            try:
                await self._conn.send(frame)
            except ConnectionLost as exc:
                self._die(exc.reason)
                return
            self._unsent -= 1

    async def _receive_loop(self) -> None:
        assert self._conn is not None
        while True:
            try:
                frame = await self._conn.receive()
            except ConnectionLost as exc:
                self._die(exc.reason)
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
                continue
            except ProtocolError as exc:
                self._violation(f"undecodable message: {exc}")
                return
            try:
                await self._dispatch(msg)
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
            if not self.alive:
                return

    async def _dispatch(self, msg: wire.Message) -> None:
        match msg:
            case wire.Connect():
                self._on_connect(msg)
            case wire.ConnectAck():
                self._acked.set()
                self._dispatch_errors = 0
            case wire.Disconnect():
                self._die("the peer disconnected")
            case _ if not self._peer_accepted:
                self._violation(f"a {msg.TYPE} message before the peer's connect")
            case wire.Lookup() | wire.Fetch() | wire.AbortFetch():
                await self._to_producer(msg)
            case wire.LookupResp() | wire.TransferDone() | wire.AbortAck():
                await self._to_consumer(msg)

    def _on_connect(self, msg: wire.Connect) -> None:
        if self._peer_accepted:
            # The peer started a new session on this connection: its side of
            # this one died (it dialed again, and its new connection took this
            # one's place at our ROUTER). This session ends without a word (a
            # disconnect would end the peer's new one), and a new session takes
            # the connection from this connect on.
            assert self._conn is not None
            self._handed_over = True
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
        if not self.alive:
            return
        assert self._conn is not None
        try:
            await self._conn.send(wire.encode(wire.ConnectAck(peer_id=self._config.node_id)))
        except ConnectionLost as exc:
            self._die(exc.reason)

    async def _to_producer(self, msg: wire.Lookup | wire.Fetch | wire.AbortFetch) -> None:
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
            self._host.producer_opened(self, actor)
        await actor.deliver(msg)

    async def _to_consumer(self, msg: wire.LookupResp | wire.TransferDone | wire.AbortAck) -> None:
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
        await actor.deliver(msg)

    def _spawn(self, role: Role, kv_request_id: str) -> RequestActor:
        previous = self._retired.pop((role, kv_request_id), None)
        incarnation = 0 if previous is None else previous + 1
        actor_id = ActorId(role, self.peer_id, kv_request_id, incarnation)
        actor = RequestActor(actor_id, self, self._config.timings, self._config.actor_inbox)
        assert self._nursery is not None
        self._nursery.start_soon(actor.run, name=str(actor_id))
        self._host.actor_created(actor)
        return actor

    def _retire(self, actor: RequestActor) -> None:
        table = self._consumers if actor.id.role is Role.CONSUMER else self._producers
        if table.get(actor.id.kv_request_id) is actor:
            del table[actor.id.kv_request_id]
        self._retired[actor.id.role, actor.id.kv_request_id] = actor.id.incarnation
        if len(self._retired) > _RETIRED_MEMORY:
            self._retired.popitem(last=False)

    def _session_rounds(self) -> bool:
        ext = self.peer_extension
        return ext is not None and FEATURE_SESSION_ROUNDS in ext.features

    # --- effects -------------------------------------------------------------------

    def admit(self, actor: RequestActor, event_input: ActorInput) -> ActorInput:
        """The quota verdict on a peer's lookup or fetch, just before its actor steps it."""
        if isinstance(event_input, wire.Lookup | wire.Fetch):
            return self._host.quotas.admit(actor, event_input)
        return event_input

    def actor_stepped(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """Log an actor's events, count what they hold, and perform their effects."""
        self._host.quotas.observe(actor, events, trio.current_time())
        self._host.record(actor, events)
        for event in events:
            for effect in fx.effects_of(event):
                self._perform(actor, effect)

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

    def send(self, msg: wire.Message) -> None:
        """Queue a message for the peer (sent once our connect is acked)."""
        if not self.alive:
            return
        self.last_sent = trio.current_time()
        frame = wire.encode(self._to_dialect(msg))
        if self._send_now is not None and not self._unsent:
            try:
                if self._send_now(frame):
                    return
            except ConnectionLost as exc:
                self._die(exc.reason)
                return
        try:
            self._outbox_send.send_nowait(frame)
        except trio.WouldBlock:
            self._die(
                f"the peer is not reading: {self._config.session_outbox} messages queued for it"
            )
        else:
            self._unsent += 1

    def _to_dialect(self, msg: wire.Message) -> wire.Message:
        """Strip p2pactor's extension fields for a peer that speaks vLLM's dialect."""
        features = self.peer_extension.features if self.peer_extension else frozenset()
        if isinstance(msg, wire.Lookup) and FEATURE_DEADLINE not in features:
            return attrs.evolve(msg, deadline_ms=None)
        if isinstance(msg, wire.LookupResp) and FEATURE_RESP_ROUND not in features:
            return attrs.evolve(msg, round_seq=None)
        return msg

    def start_transfer(self, actor: RequestActor, effect: fx.StartTransfer) -> None:
        """Run one WRITE for ``actor``; its result goes back to the actor."""
        assert self._nursery is not None
        self._nursery.start_soon(self._transfer, actor, effect)

    async def _transfer(self, actor: RequestActor, effect: fx.StartTransfer) -> None:
        try:
            await self._host.data.write(self.data_name, effect.local_blocks, effect.remote_blocks)
        except TransferError as exc:
            result = inp.TransferResult(transfer_id=effect.transfer_id, ok=False, reason=str(exc))
        else:
            result = inp.TransferResult(transfer_id=effect.transfer_id, ok=True)
        await actor.deliver(result)

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
        if self._dead.is_set():
            return
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
        if self._send_disconnect and self._conn is not None and not self._handed_over:
            with trio.move_on_after(0.5), contextlib.suppress(ConnectionLost):
                await self._conn.send(wire.encode(wire.Disconnect()))
        if self._conn is not None and not self._handed_over:
            # Close now, not after the drain: a peer that dials again must
            # open a fresh connection, not talk into this dying one.
            await self._conn.aclose()
        self._outbox_send.close()
        for actor in self.live_actors():
            await actor.deliver(inp.SessionEnded(reason))
        with trio.move_on_after(self._config.drain_timeout):
            for actor in self.live_actors():
                await actor.wait_done()

    async def _finish(self) -> None:
        reason = self.death_reason or "closed"
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
