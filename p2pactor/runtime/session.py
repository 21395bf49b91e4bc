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

import logging

import attrs
import trio
from msgspec.structs import replace

from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.effects import context_name
from p2pactor.core.ids import Role
from p2pactor.core.producer import ProducerState
from p2pactor.errors import ProtocolError, UnknownMessageType
from p2pactor.runtime.handshake import SessionState
from p2pactor.runtime.process import ProcessWatch
from p2pactor.runtime.session_actors import TO_CONSUMER, TO_PRODUCER, SessionActors

log = logging.getLogger("p2pactor.session")

_LOCAL_DRAIN = 0.1  # s: what a dead peer on this kernel sent drains (loopback, memory speed)
_ENDED_PER_TURN = 32  # actors told their session ended before the drain lets others run


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


class PeerSession(SessionActors):
    """The control session with one peer, and the request actors on it.

    Implements :class:`~p2pactor.runtime.transport.FrameReceiver` (for its connection)
    and :class:`~p2pactor.runtime.actor.ActorHost` (for its actors).
    """

    def __repr__(self) -> str:
        return f"<PeerSession {self.peer_id} #{self.serial} {self.state.value}>"

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
        if not self.alive:
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
        accepted = self._peer_accepted
        if accepted and isinstance(msg, TO_PRODUCER):
            self._to_producer(msg)
        elif accepted and isinstance(msg, TO_CONSUMER):
            self._to_consumer(msg)
        elif isinstance(msg, wire.Connect):
            (self._hand_over if accepted else self._accept)(msg)
        elif isinstance(msg, wire.ConnectAck):
            self._dispatch_errors = 0
            self._acked = True
            self._open_gate()
        elif isinstance(msg, wire.Disconnect):
            self._die("the peer disconnected")
        elif accepted and self.summaries and isinstance(msg, wire.SummaryMessage):
            self._host.directory.received(self, msg)
        else:  # after the peer's connect, only summaries it did not agree to come here
            self._violation(
                f"a {msg.TYPE} message, but summaries ({wire.FEATURE_SUMMARIES}) were "
                "not agreed in the handshake"
                if accepted
                else f"a {msg.TYPE} message before the peer's connect"
            )

    def _hand_over(self, msg: wire.Connect) -> None:
        # A second connect: the peer's side of this session died (it dialed
        # again, and its new connection took this one's place at our ROUTER).
        # This session ends without a word (a disconnect would end the peer's
        # new one), and a new session takes the connection from this connect on.
        assert self._conn is not None
        self._handed_over = True
        self._conn.attach(None)  # frames wait for the new session
        self._die("the peer started a new session on this connection")
        if msg.extension:  # a p2pactor peer: it can take our way to it afresh (see renew)
            self._conn.renew()
        self._host.peers.restarted(self, self._conn, msg)

    def _to_producer(self, msg: wire.Lookup | wire.Fetch | wire.AbortFetch) -> None:
        kv_id = msg.kv_request_id
        fetch = isinstance(msg, wire.Fetch)
        top = max(msg.block_indexes, default=-1) if isinstance(msg, wire.Fetch) else -1
        if top >= self._peer_num_blocks:
            self._violation(
                f"fetch for {kv_id} writes block {top}, but the peer has "
                f"{self._peer_num_blocks} blocks"
            )
        elif actor := self._live_actor(Role.PRODUCER, kv_id):
            self.runner.deliver(actor, msg)
        elif isinstance(msg, wire.AbortFetch):
            # Nothing of ours can be writing for a request we no longer
            # serve: its transfer_done crossed this abort. Ack it.
            self.send(wire.AbortAck(kv_request_id=kv_id, round_seq=msg.round_seq))
        elif not fetch or msg.keys:  # (an empty fetch closes a request we hold nothing for)
            actor = self._spawn(Role.PRODUCER, kv_id)
            # Counted before its first step; a request over the peer's quota
            # still gets an actor, so that its refusal is in the event log,
            # and that actor closes after the one step.
            self._host.quotas.open_request(self.peer_id, actor)
            self.runner.deliver(actor, msg)
            # After its first message: stores waiting for the request (and an
            # engine's finish) follow the fetch that binds them.
            self._host.stores.bind(actor)

    def _to_consumer(self, msg: wire.LookupResp | wire.TransferDone | wire.AbortAck) -> None:
        actor = self._live_actor(Role.CONSUMER, msg.kv_request_id)
        if actor is None:
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
        self.runner.deliver(actor, msg)

    # --- close ---------------------------------------------------------------------

    async def _drain(self) -> None:
        reason = self.death_reason or "closed"
        consumers = [s for a in self.live_actors() if isinstance(s := a.state, ConsumerState)]
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
            self.runner.deliver(actor, ended)
            if i % _ENDED_PER_TURN == 0:
                # A peer that leaves thousands of requests open must not stall
                # every other session while they wind down.
                await trio.lowlevel.checkpoint()
        gone = self.peer_process
        if grace and self._failed_loads and gone is not None:
            self._nursery.start_soon(self._settle_when_gone, gone, reason)
        if self._actors:
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
                self.runner.deliver(actor, settled)

    async def _finish(self) -> None:
        reason = self.death_reason or "closed"
        self._closing = True
        # No actor outlives its session: those the drain gave up on take no
        # more input, and what they still hold is reported below.
        live = [s for a in self.live_actors() if isinstance(s := a.state, ConsumerState)]
        loads = [job.job_id for s in live for job in s.loads.values()]
        why = f"session lost: {reason}; the drain gave up on the load"
        for job_id in loads:  # the engine must hear of each
            self._host.report_load(job_id, success=False, reason=why)
        # Whatever the peer's requests still held here is no longer theirs:
        # the node releases their pins (counted until released) below.
        for actor in self._actors.values():
            actor.abandon()
            self._host.quotas.forget(actor)
        if loads:
            self._loading -= len(loads)
            self._host.data.expect_writes(-len(loads))
        self._busy.clear()
        self._writing.clear()
        producers = [s for a in self._actors.values() if isinstance(s := a.state, ProducerState)]
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
