"""PeerSession: everything between this node and one peer.

A session owns the control connection to its peer (its base,
:class:`~p2pactor.runtime.handshake.ControlLink`, shakes hands and queues what we
send), the routing of the peer's messages to request actors, the actors
themselves (records it steps, through the node's runner, when their inputs
arrive) and the transfers they start. It has one task, which dials, shakes
hands, waits for the end and then drains; its frames are stepped where they
arrive, on the transport's receive path, not in a task of its own. Its life:

1. **Handshake**: see :mod:`p2pactor.runtime.handshake`.
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

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Final

import attrs
import trio
from msgspec.structs import replace

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.effects import context_name
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerState, pin_expired
from p2pactor.errors import ProtocolError, UnknownMessageType
from p2pactor.runtime.actor import ActorInput, RequestActor, Runner
from p2pactor.runtime.handshake import EXTENSION, ControlLink, SessionState
from p2pactor.runtime.logcontext import ExpiryWarnings, request_context
from p2pactor.runtime.process import ProcessWatch
from p2pactor.runtime.transport import ControlConnection

if TYPE_CHECKING:
    from p2pactor.runtime.host import NodeHost

__all__ = ["EXTENSION", "PeerSession", "SessionCloseResult", "SessionState"]

log = logging.getLogger("p2pactor.session")

_RETIRED_MEMORY = 4096
_LOCAL_DRAIN = 0.1  # s: what a dead peer on this kernel sent drains (loopback, memory speed)
_ENDED_PER_TURN = 32  # actors told their session ended before the drain lets others run
_TO_PRODUCER: Final = (wire.Lookup, wire.Fetch, wire.AbortFetch)
_TO_CONSUMER: Final = (wire.LookupResp, wire.TransferDone, wire.AbortAck)
_PEER_MESSAGES: Final = (*_TO_PRODUCER, *_TO_CONSUMER)
_SUMMARIES: Final = (wire.KvsumDelta, wire.KvsumSnapshot, wire.KvsumResync)

# How each consumer event changes the loads in flight (writes a peer may be
# making into our pool): the data transport polls for progress only while any is.
_LOADS: Final[dict[type[ev.Event], int]] = {
    ev.FetchSent: 1,
    ev.TransferDone: -1,
    ev.AbortAcked: -1,
    ev.Aborted: -1,
}


def _mark(marked: set[RequestActor], actor: RequestActor, now: bool) -> None:
    """Keep ``actor`` in ``marked`` exactly while ``now`` holds."""
    if now:
        marked.add(actor)
    else:
        marked.discard(actor)


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


class PeerSession(ControlLink):
    """The control session with one peer, and the request actors on it.

    Implements :class:`~p2pactor.runtime.transport.FrameReceiver` (for its connection)
    and :class:`~p2pactor.runtime.actor.ActorHost` (for its actors).
    """

    def __init__(
        self,
        host: NodeHost,
        peer_id: str,
        conn: ControlConnection | None = None,
        *,
        first: wire.Connect | None = None,
        on_restart: Callable[[PeerSession, ControlConnection, wire.Connect], None],
    ) -> None:
        super().__init__(host, peer_id, conn, first)
        # Whoever made the session starts its successor when the peer starts a
        # new one on this connection (the node's registry).
        self._on_restart = on_restart
        self.result: SessionCloseResult | None = None
        self._runner = host.runner
        self._consumers: dict[str, RequestActor] = {}
        self._producers: dict[str, RequestActor] = {}
        self._live = 0  # actors spawned and not retired (the drain waits for 0)
        # What has_pending_work reads from engine threads, kept as each step
        # changes it: loads in flight (a peer may be writing into our pool), and
        # the producers that are looking up or writing (and, of those, writing).
        self._loading = 0
        self._busy: set[RequestActor] = set()
        self._writing: set[RequestActor] = set()
        self._expiries = ExpiryWarnings(peer_id, host.config.node_id)
        # Recently ended ids, so that a reused kv_request_id gets a new
        # incarnation; bounded, and replay copes when an old one is forgotten.
        self._retired: OrderedDict[tuple[Role, str], int] = OrderedDict()
        self._closing = False
        self._node_closing = False
        self._quiet = trio.Event()  # closing, and every actor has ended
        self._closed = trio.Event()
        self._dispatch_errors = 0
        self._round_counter = itertools.count(1)
        self._failed_loads: tuple[int, ...] = ()
        self._failed_requests: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"<PeerSession {self.peer_id} #{self.serial} {self.state.value}>"

    # --- what the node asks ------------------------------------------------------

    @property
    def runner(self) -> Runner:
        """The node's runner (the actors' host hands their inputs to it)."""
        return self._runner

    def has_pending_work(self) -> bool:
        """True only while something is really outstanding on this session.

        Safe from any thread, and O(1): it reads counts each step keeps.
        """
        state = self.state
        if state is SessionState.CLOSED:
            return False
        if state is SessionState.CLOSING or not self.ready:
            return True
        return self._loading > 0 or bool(self._busy)

    def has_transfers_in_flight(self) -> bool:
        """Whether a load or a write of this session is still running. Thread-safe."""
        return self._loading > 0 or bool(self._writing)

    def consumer(self, kv_request_id: str) -> RequestActor:
        """The live consumer actor for ``kv_request_id``, created if needed."""
        actor = self._consumers.get(kv_request_id)
        if actor is not None and not actor.done:
            return actor
        first = next(self._round_counter) if self._session_rounds() else 0
        actor = self._spawn(Role.CONSUMER, kv_request_id, first_round=first)
        self._consumers[kv_request_id] = actor
        return actor

    def next_round(self) -> int | None:
        """The round to use after a fetch: session-wide with p2pactor peers."""
        return next(self._round_counter) if self._session_rounds() else None

    def live_actors(self) -> list[RequestActor]:
        """Every actor of this session that has not ended."""
        return [a for a in (*self._consumers.values(), *self._producers.values()) if not a.done]

    def close(self, reason: str, *, node_closing: bool = False) -> None:
        """Close the session: tell the peer, end every actor, drain. Idempotent.

        ``node_closing``: our node is shutting down. Its loads then fail at
        once, without the ``late_write_window`` hold: the pool goes with the
        node's NIXL agent, whose connections close with it.
        """
        self._node_closing = self._node_closing or node_closing
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

    # --- frames, as the transport hands them over (FrameReceiver) -------------------

    def frame_received(self, frame: wire.Frame) -> None:
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
                extra=self._log_extra,
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
                extra=self._request_extra(getattr(msg, "kv_request_id", None)),
            )
            self._count_error()

    def _dispatch(self, msg: wire.Message) -> None:
        if isinstance(msg, _TO_PRODUCER) and self._peer_accepted:
            self._to_producer(msg)
        elif isinstance(msg, _TO_CONSUMER) and self._peer_accepted:
            self._to_consumer(msg)
        elif isinstance(msg, wire.Connect):
            if self._peer_accepted:
                self._hand_over(msg)
            else:
                self._accept(msg)
        elif isinstance(msg, wire.ConnectAck):
            self._dispatch_errors = 0
            self._on_ack()
        elif isinstance(msg, wire.Disconnect):
            self._die("the peer disconnected")
        elif isinstance(msg, _SUMMARIES) and self._peer_accepted:
            if self.summaries:
                self._host.directory.received(self, msg)
            else:
                self._violation(
                    f"a {msg.TYPE} message, but summaries ({wire.FEATURE_SUMMARIES}) were "
                    "not agreed in the handshake"
                )
        else:
            self._violation(f"a {msg.TYPE} message before the peer's connect")

    def _hand_over(self, msg: wire.Connect) -> None:
        # A second connect: the peer's side of this session died (it dialed
        # again, and its new connection took this one's place at our ROUTER).
        # This session ends without a word (a disconnect would end the peer's
        # new one), and a new session takes the connection from this connect on.
        assert self._conn is not None
        self._handed_over = True
        self._conn.attach(None)  # frames wait for the new session
        self._die("the peer started a new session on this connection")
        self._on_restart(self, self._conn, msg)

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
            self._host.producer_opened(actor)
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
                extra=self._request_extra(msg.kv_request_id),
            )
            return
        if not self.extended and isinstance(msg, wire.LookupResp):
            msg = replace(msg, round_seq=wire.UNSET)
        self._runner.deliver(actor, msg)

    def _spawn(self, role: Role, kv_request_id: str, *, first_round: int = 0) -> RequestActor:
        previous = self._retired.pop((role, kv_request_id), None)
        incarnation = 0 if previous is None else previous + 1
        actor_id = ActorId(role, self.peer_id, kv_request_id, incarnation)
        actor = RequestActor(actor_id, self, self._config.timings, first_round=first_round)
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
            state = actor.state
            assert isinstance(state, ProducerState)
            host.quotas.observe(actor, events, state, trio.current_time())
            _mark(self._busy, actor, bool(state.transfers or state.lookups))
            _mark(self._writing, actor, bool(state.transfers))
        host.record(actor, events)
        loads = 0
        for event in events:
            if not producer:
                loads += _LOADS.get(type(event), 0)
            elif type(event) is ev.PinReleased and pin_expired(event):
                self._expiries.pin_expired(actor.id.kv_request_id, event)
            for effect in fx.effects_of(event):
                self._perform(actor, effect)
        if loads:
            self._loading += loads
            host.data.expect_writes(loads)

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
                extra=self._request_extra(actor.id.kv_request_id),
            )
            self._host.release_pin(event_input.pin.job_id, success=False)

    def deadline_changed(self, actor: RequestActor) -> None:
        """Arm the node's timer for the actor's new deadline."""
        self._host.timers.arm(actor)

    def start_transfer(self, actor: RequestActor, effect: fx.StartTransfer) -> None:
        """Start one WRITE for ``actor``; its end comes back to the actor as an input."""
        self._host.data.start_write(
            self.data_name,
            effect.local_blocks,
            effect.remote_blocks,
            partial(self._transfer_ended, actor, effect.transfer_id),
        )

    def _transfer_ended(self, actor: RequestActor, transfer_id: int, error: str | None) -> None:
        ended = inp.TransferResult(transfer_id=transfer_id, ok=error is None, reason=error or "")
        self._runner.deliver(actor, ended)

    # --- errors and death ----------------------------------------------------------

    def _count_error(self) -> None:
        self._dispatch_errors += 1
        if self._dispatch_errors >= self._config.max_dispatch_errors:
            self._die(
                f"{self._dispatch_errors} handler errors in a row (see the log above)",
                disconnect=True,
            )

    def _request_extra(self, kv_request_id: str | None) -> dict[str, str]:
        """The ``extra=`` of a line about one request of this session's."""
        return request_context(self.peer_id, kv_request_id, node=self._config.node_id)

    # --- close ---------------------------------------------------------------------

    async def _drain(self) -> None:
        reason = self.death_reason or "closed"
        consumers = [
            s
            for a in self._consumers.values()
            if not a.done and isinstance(s := a.state, ConsumerState)
        ]
        self._failed_loads = tuple(load.job_id for s in consumers for load in s.loads.values())
        self._failed_requests = tuple(
            s.actor.kv_request_id for s in consumers if s.loads or s.waiting_keys()
        )
        await self._hang_up()
        self._closing = True
        # A load's blocks go back to the engine when it fails; a peer's write
        # still on the wire must not land in them after that.
        grace = 0.0 if self._node_closing else self._host.data.late_write_window
        ended = inp.SessionEnded(reason, write_grace=grace)
        for i, actor in enumerate(self.live_actors(), start=1):
            self._runner.deliver(actor, ended)
            if i % _ENDED_PER_TURN == 0:
                # A peer that leaves thousands of requests open must not stall
                # every other session while they wind down.
                await trio.lowlevel.checkpoint()
        gone = self.peer_process
        if grace and self._failed_loads and gone is not None:
            assert self._nursery is not None
            self._nursery.start_soon(self._settle_when_gone, gone, reason)
        if self._live:
            # Held loads end on their own deadline: the drain outlasts it.
            held = grace + 1.0 if self._failed_loads and grace > 0 else 0.0
            with trio.move_on_after(max(self._config.drain_timeout, held)):
                await self._quiet.wait()

    async def _settle_when_gone(self, gone: ProcessWatch, reason: str) -> None:
        """End the loads held for a late write soon after the peer's process has exited.

        It writes nothing once it has exited, and only this kernel lies between
        us (no link to hold a write): what it had in flight lands at memory
        speed, within the drain below (shared memory and cross-memory attach
        copy as the writer runs, so they have nothing in flight at all).
        """
        await gone.wait()
        await trio.sleep(_LOCAL_DRAIN)
        settled = inp.WritesSettled(
            f"session lost: {reason}; the peer's process exited, so no write of its can "
            "land any more"
        )
        log.info(
            "%s: its process exited: the loads held for its writes fail now",
            self.peer_id,
            extra=self._log_extra,
        )
        for actor in self.live_actors():
            if actor.id.role is Role.CONSUMER:
                self._runner.deliver(actor, settled)

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
                    why = f"session lost: {reason}; the drain gave up on the load"
                    for load in state.loads.values():  # the engine must hear of each
                        self._host.report_load(load.job_id, success=False, reason=why)
                actor.abandon()
        if abandoned_loads:
            self._loading -= abandoned_loads
            self._host.data.expect_writes(-abandoned_loads)
        self._busy.clear()
        self._writing.clear()
        # Whatever the peer's requests still held here is no longer theirs:
        # the node releases their pins (counted until released) below.
        self._host.quotas.forget_all(self._producers.values())
        producers = [s for a in self._producers.values() if isinstance(s := a.state, ProducerState)]
        self.result = SessionCloseResult(
            peer_id=self.peer_id,
            reason=reason,
            failed_loads=self._failed_loads,
            failed_requests=self._failed_requests,
            held_pins=tuple(job for s in producers for job in s.jobs),
            open_contexts=tuple(
                context_name(s.actor, lookup_id) for s in producers for lookup_id in s.open_contexts
            ),
        )
        await self._let_go()
        self.state = SessionState.CLOSED
        self._closed.set()
