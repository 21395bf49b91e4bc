"""A session's request actors: their table, what they hold, and the session as their host.

:class:`SessionActors` is the middle of a session (between its control link,
:class:`~p2pactor.runtime.handshake.ControlLink`, and the routing and close of
:class:`~p2pactor.runtime.session.PeerSession`): it spawns one actor per
(role, kv_request_id), a new incarnation when an ended id comes back, counts
what they hold for the node's threads, and, as their
:class:`~p2pactor.runtime.actor.ActorHost`, records their steps and performs
their effects.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Final

import trio

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerState, pin_expired
from p2pactor.runtime.actor import ActorInput, RequestActor, Runner
from p2pactor.runtime.handshake import ControlLink, SessionState
from p2pactor.runtime.logcontext import Throttle, actor_context, request_context
from p2pactor.runtime.transport import ControlConnection

if TYPE_CHECKING:
    from p2pactor.runtime.host import NodeHost
    from p2pactor.runtime.session import SessionCloseResult


log = logging.getLogger("p2pactor.session")

_RETIRED_MEMORY = 4096
# At most one line per session this often: a peer that never fetches expires many pins.
_EXPIRY_LOG_INTERVAL_S: Final = 10.0
TO_PRODUCER: Final = (wire.Lookup, wire.Fetch, wire.AbortFetch)
"""The peer's messages for the producer of their kv_request_id."""
TO_CONSUMER: Final = (wire.LookupResp, wire.TransferDone, wire.AbortAck)
"""The peer's messages for the consumer of their kv_request_id."""
_FROM_PEER: Final = (*TO_PRODUCER, *TO_CONSUMER)

# How each consumer event changes the loads in flight (writes a peer may be
# making into our pool): the data transport polls for progress only while any is.
_LOADS: Final[dict[type[ev.Event], int]] = {
    ev.FetchSent: 1,
    ev.TransferDone: -1,
    ev.AbortAcked: -1,
    ev.Aborted: -1,
}


class SessionActors(ControlLink):
    """The request actors on one session, and the session as their host (ActorHost)."""

    def __init__(
        self,
        host: NodeHost,
        peer_id: str,
        conn: ControlConnection | None,
        first: wire.Connect | None,
    ) -> None:
        super().__init__(host, peer_id, conn, first)
        self.runner: Runner = host.runner  # the actors' host hands their inputs to it
        # The latest actor of each (role, kv_request_id), until it retires: the
        # drain waits for none to be left.
        self._actors: dict[tuple[Role, str], RequestActor] = {}
        # What has_pending_work reads from engine threads, kept as each step
        # changes it: loads in flight (a peer may be writing into our pool), and
        # the producers that are looking up or writing (and, of those, writing).
        self._loading = 0
        self._busy: set[RequestActor] = set()
        self._writing: set[RequestActor] = set()
        self._expiries = Throttle(_EXPIRY_LOG_INTERVAL_S)
        # Recently ended ids, so that a reused kv_request_id gets a new
        # incarnation; bounded, and replay copes when an old one is forgotten.
        self._retired: OrderedDict[tuple[Role, str], int] = OrderedDict()
        # The close (PeerSession's): what it left owed, once closed.
        self.result: SessionCloseResult | None = None
        self._node_closing = False
        self._closing = False
        self._quiet = trio.Event()  # closing, and every actor has ended
        self._closed = trio.Event()
        self._failed_loads: tuple[int, ...] = ()
        self._failed_requests: tuple[str, ...] = ()
        self._dispatch_errors = 0
        self._round_counter = itertools.count(1)

    # --- what the node asks ------------------------------------------------------

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
        actor = self._live_actor(Role.CONSUMER, kv_request_id)
        return actor or self._spawn(
            Role.CONSUMER, kv_request_id, first_round=self.next_round() or 0
        )

    def next_round(self) -> int | None:
        """The round to use after a fetch: session-wide with p2pactor peers."""
        return next(self._round_counter) if wire.FEATURE_SESSION_ROUNDS in self.features else None

    def live_actors(self) -> list[RequestActor]:
        """Every actor of this session that has not ended."""
        return [a for a in self._actors.values() if not a.done]

    # --- the actors ------------------------------------------------------------------

    def _live_actor(self, role: Role, kv_request_id: str) -> RequestActor | None:
        actor = self._actors.get((role, kv_request_id))
        return None if actor is None or actor.done else actor

    def _spawn(self, role: Role, kv_request_id: str, *, first_round: int = 0) -> RequestActor:
        key = role, kv_request_id
        previous = self._retired.pop(key, None)
        incarnation = 0 if previous is None else previous + 1
        actor_id = ActorId(role, self.peer_id, kv_request_id, incarnation)
        actor = RequestActor(actor_id, self, self._config.timings, first_round=first_round)
        self._actors[key] = actor
        self._host.actor_created(actor)
        return actor

    def _retire(self, actor: RequestActor) -> None:
        key = actor.id.role, actor.id.kv_request_id
        if self._actors.get(key) is actor:
            del self._actors[key]
        self._retired[key] = actor.id.incarnation
        if len(self._retired) > _RETIRED_MEMORY:
            self._retired.popitem(last=False)
        if self._closing and not self._actors:
            self._quiet.set()

    # --- the actors' host (ActorHost) ---------------------------------------------

    def admit(self, actor: RequestActor, event_input: ActorInput) -> ActorInput | None:
        """The quota verdict on a peer's lookup or fetch; None after the actor ended.

        An input for an ended actor is dropped, and a pin it carries released.
        """
        if actor.done:
            if isinstance(event_input, inp.ParentAnswer) and event_input.pin is not None:
                log.error(
                    "%s ended before its parent answer; releasing its pin",
                    actor.id,
                    extra=actor_context(actor.id, node=self._config.node_id),
                )
                self._host.release_pin(event_input.pin.job_id, success=False)
            return None
        if isinstance(event_input, wire.Lookup | wire.Fetch):
            return self._host.quotas.admit(actor, event_input)
        return event_input

    def stepped(
        self, actor: RequestActor, event_input: ActorInput, events: Sequence[ev.AnyEvent] | None
    ) -> None:
        """Count a failed step against the session; else log, count and perform ``events``.

        A peer's message handled ends the run of errors (vLLM's rule).
        """
        if events is None:
            self._count_error()
            return
        host = self._host
        if isinstance(event_input, _FROM_PEER):
            self._dispatch_errors = 0
        if actor.moved:
            host.timers.arm(actor)
        if not events:
            return
        producer = actor.id.role is Role.PRODUCER
        if producer:
            state = actor.state
            assert isinstance(state, ProducerState)
            host.quotas.observe(actor, events, state, trio.current_time())
            (self._busy.add if state.transfers or state.lookups else self._busy.discard)(actor)
            (self._writing.add if state.transfers else self._writing.discard)(actor)
        host.record(actor, events)
        loads = 0
        for event in events:
            if not producer:
                loads += _LOADS.get(type(event), 0)
            elif type(event) is ev.PinReleased and pin_expired(event):
                self._pin_expired(actor.id.kv_request_id, event)
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
            case fx.StartTransfer(transfer_id=transfer_id):
                # One WRITE; its end comes back to the actor as an input.
                ended = partial(self._transfer_ended, actor, transfer_id)
                host.data.start_write(
                    self.data_name, effect.local_blocks, effect.remote_blocks, ended
                )
            case fx.ParentLookup() | fx.ParentClose():
                host.service.post(actor, effect)  # now, or at the next serve
            case fx.ReleasePin(job_id=job_id, success=success):
                host.release_pin(job_id, success=success)
            case fx.ReportLoad(job_id=job_id, success=success, reason=reason):
                host.report_load(job_id, success=success, reason=reason)
            case fx.Disconnect(reason):
                self._violation(reason)
            case fx.Retire():
                self._retire(actor)

    def _transfer_ended(self, actor: RequestActor, transfer_id: int, error: str | None) -> None:
        ended = inp.TransferResult(transfer_id=transfer_id, ok=error is None, reason=error or "")
        self.runner.deliver(actor, ended)

    # --- errors and death ----------------------------------------------------------

    def _violation(self, what: str) -> None:
        """The peer broke the protocol: say so, and disconnect."""
        log.warning(
            "%s broke the protocol: %s; disconnecting (check that both nodes run compatible "
            "p2pactor or vLLM versions)",
            self.peer_id,
            what,
            extra=self._log_extra,
        )
        self._die(f"protocol violation: {what}", disconnect=True)

    def _count_error(self) -> None:
        self._dispatch_errors += 1
        if self._dispatch_errors >= self._config.max_dispatch_errors:
            self._die(
                f"{self._dispatch_errors} handler errors in a row (see the log above)",
                disconnect=True,
            )

    def _pin_expired(self, kv_request_id: str, event: ev.PinReleased) -> None:
        """Say that the peer never fetched the blocks ``event`` released (or only count it)."""
        if (more := self._expiries.due(event.at)) is None:
            return
        log.warning(
            "%s never fetched the blocks its lookup for %s pinned: released pin %d (%s)%s; "
            "a peer that looks up and does not fetch holds blocks for nothing (check that it "
            "runs p2pactor or vLLM's tier, and that its fetches reach this node)",
            self.peer_id,
            kv_request_id,
            event.job_id,
            event.reason,
            f"; {more} more such releases since the last line" if more else "",
            extra=self._request_extra(kv_request_id),
        )

    def _request_extra(self, kv_request_id: str | None) -> dict[str, str]:
        """The ``extra=`` of a line about one request of this session's."""
        return request_context(self.peer_id, kv_request_id, node=self._config.node_id)
