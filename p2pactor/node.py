"""Node: the public API of p2pactor.

A node owns its peer sessions, their request actors, the transports and the event
log, all under one trio nursery::

    async with open_node(config, control=..., data=..., parent=cache) as node:
        answers = await node.lookup(peer, "req-1", keys)
        result = await node.fetch(peer, "req-1", hits, dest_blocks)
        node.finish("req-1")

Two ways in, for two kinds of engines:

* **async** (:meth:`Node.lookup`, :meth:`Node.fetch`), for engines written on trio;
* **sync and thread-safe** (:meth:`Node.register_lookup`, :meth:`Node.flush`,
  :meth:`Node.submit_load`, :meth:`Node.finish`, :meth:`Node.finished_jobs`,
  :meth:`Node.submit_store`), for engines that step on their own thread (vLLM).
  These never wait on trio: they hand work over (:mod:`p2pactor.engine`) and
  read what the node's thread already published.

The node is a facade over its parts, each in its module: the runner and the
timer that step actors (:mod:`p2pactor.actor`, :mod:`p2pactor.timers`), the
sessions and their accept policy (:mod:`p2pactor.peers`), the parent service
(:mod:`p2pactor.serving`), the store book of prefill/decode requests
(:mod:`p2pactor.core.stores`) and the engine bridge (:mod:`p2pactor.engine`).
A lookup goes from :meth:`Node.lookup` to the socket and back without a
channel or another task: the caller steps its actor (which sends the lookup),
the transport's receive task steps the answer where it arrives, and the caller
is woken once, when every key is answered.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from p2pactor import protocol as wire
from p2pactor.actor import RequestActor, Runner
from p2pactor.config import NodeConfig
from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState, probe_answers
from p2pactor.core.inputs import LookupResult
from p2pactor.core.stores import StoreBook, StoreRefused, Unbound
from p2pactor.engine import EngineBridge, LoadResult
from p2pactor.log import EventLog
from p2pactor.logsetup import peer_context, request_context
from p2pactor.parent import Parent
from p2pactor.peers import PeerRegistry
from p2pactor.quotas import PeerUsage, QuotaLedger
from p2pactor.serving import ParentService
from p2pactor.session import PeerSession, SessionCloseResult
from p2pactor.timers import Timers
from p2pactor.transport import ControlConnection, ControlTransport, DataTransport
from p2pactor.view import EventWatcher, HandshakeWatcher

__all__ = ["EventWatcher", "FetchResult", "LoadResult", "Node", "open_node"]

log = logging.getLogger("p2pactor.node")

RETRY = LookupResult.RETRY


@attrs.frozen(kw_only=True)
class FetchResult:
    """The outcome of :meth:`Node.fetch`.

    Attributes:
        success: Whether every block arrived.
        blocks: How many blocks were written into ours.
        reason: Why not, when not.
    """

    success: bool
    blocks: int
    reason: str = ""


@attrs.define(eq=False)
class _Answers:
    """A caller of :meth:`Node.lookup` waiting for every key's answer."""

    keys: Sequence[bytes]
    ready: trio.Event = attrs.field(factory=trio.Event)


@attrs.define(eq=False)
class _Load:
    """A caller of :meth:`Node.fetch` waiting for its load's result."""

    ready: trio.Event = attrs.field(factory=trio.Event)
    result: LoadResult | None = None


@attrs.define(eq=False)
class _Reaper:
    """The store book's timer entry: reap stores nobody fetched, at the book's deadline."""

    node: Node
    deadline: float | None = None

    def expire(self) -> None:
        self.deadline = None
        self.node._reap()


class Node:
    """A p2pactor node. Create it with :func:`open_node`."""

    def __init__(
        self,
        config: NodeConfig,
        *,
        control: ControlTransport,
        data: DataTransport,
        parent: Parent | None,
        event_log: EventLog,
        nursery: trio.Nursery,
        hash_seed: Callable[[], str] | None = None,
    ) -> None:
        self._config = config
        self._hash_seed_source = hash_seed
        self._hash_seed: str | None = None if hash_seed is not None else config.hash_seed
        self._control = control
        self._data = data
        self._log = event_log
        self._nursery = nursery
        self._clock = trio.lowlevel.current_clock()
        self._started_at = self._clock.current_time()  # for uptime (status reports)
        self._runner = Runner()
        self._timers = Timers()
        self._quotas = QuotaLedger(config.quotas, config.num_blocks)
        self._service = ParentService(
            node_id=config.node_id,
            quotas=self._quotas,
            runner=self._runner,
            timers=self._timers,
            poll_interval=config.timings.pending_poll_interval,
            clock=self._clock.current_time,
            embedded=parent,
        )
        self._stores: StoreBook[RequestActor] = StoreBook(
            config.unbound_store_timeout, alive=lambda actor: not actor.done
        )
        self._reaper = _Reaper(self)
        self._peers = PeerRegistry(self, config, control, nursery, self._session_closed)
        self._bridge = EngineBridge(
            self,
            name=config.node_id,
            inbox_limit=config.engine_inbox,
            poll_interval=config.engine_poll_interval,
        )
        # Consumer actors by kv_request_id, then peer: a finish finds its own at once.
        self._consumers: dict[str, dict[str, RequestActor]] = {}
        self._answers: dict[RequestActor, list[_Answers]] = {}
        self._loads: dict[int, _Load] = {}
        self._job_ids = itertools.count(start=-1, step=-1)  # the async API's own jobs
        self._actor_watchers: list[Callable[[RequestActor], None]] = []
        self._event_watchers: list[EventWatcher] = []
        self._handshake_watchers: list[HandshakeWatcher] = []

    # --- identity and state ------------------------------------------------------

    @property
    def config(self) -> NodeConfig:
        """The node's configuration."""
        return self._config

    @property
    def node_id(self) -> str:
        """``host:port``: this node's id on the wire."""
        return self._config.node_id

    @property
    def hash_seed(self) -> str:
        """The hash seed this node advertises and requires of peers.

        Resolved on first use when the node was given a source for it: vLLM
        knows its seed only once the engine has started, after the tier exists.
        """
        if self._hash_seed is None:
            assert self._hash_seed_source is not None
            self._hash_seed = self._hash_seed_source()
        return self._hash_seed

    @property
    def control(self) -> ControlTransport:
        """The control transport."""
        return self._control

    @property
    def data(self) -> DataTransport:
        """The data transport."""
        return self._data

    @property
    def event_log(self) -> EventLog:
        """The node's event log."""
        return self._log

    @property
    def runner(self) -> Runner:
        """The runner that steps every actor of the node (node's thread only)."""
        return self._runner

    @property
    def timers(self) -> Timers:
        """The node's one timer (node's thread only)."""
        return self._timers

    @property
    def quotas(self) -> QuotaLedger:
        """The per-peer quota counts (see :mod:`p2pactor.quotas`)."""
        return self._quotas

    def peer_usage(self, peer: str) -> PeerUsage:
        """What ``peer`` holds on this node now, and what its quotas refused. Any thread."""
        return self._quotas.usage(peer)

    def quota_usage(self) -> dict[str, PeerUsage]:
        """:meth:`peer_usage` of every peer seen so far, by peer id."""
        return self._quotas.usages()

    def now(self) -> float:
        """The node's clock (trio's): session activity times are on it. Any thread."""
        return self._clock.current_time()

    @property
    def uptime(self) -> float:
        """Seconds since the node started. Any thread."""
        return self._clock.current_time() - self._started_at

    @property
    def engine_backlog(self) -> int:
        """Engine calls handed over and not yet applied (bounded by ``engine_inbox``)."""
        return self._bridge.backlog

    def sessions(self) -> list[PeerSession]:
        """Live sessions, one per peer."""
        return self._peers.sessions()

    def replaced_sessions(self) -> list[PeerSession]:
        """Sessions a reconnecting peer replaced, still draining (not in :meth:`sessions`)."""
        return self._peers.replaced_sessions()

    def session(self, peer: str) -> PeerSession | None:
        """The live session with ``peer``, if any."""
        return self._peers.session(peer)

    def closed_sessions(self) -> list[SessionCloseResult]:
        """What the sessions that closed left behind, oldest first (the last 1,024)."""
        return self._peers.closed_sessions()

    @property
    def closed_session_count(self) -> int:
        """How many sessions have closed since the node started."""
        return self._peers.closed_count

    def has_transfers_in_flight(self) -> bool:
        """Whether a load of ours or a write of ours is still running. Thread-safe."""
        return any(s.has_transfers_in_flight() for s in self._peers.sessions())

    def has_pending_work(self) -> bool:
        """Whether anything is really outstanding: handshakes, loads, writes, parent work."""
        if self._service.pending or self._bridge.backlog or self._peers.draining:
            return True
        return any(s.has_pending_work() for s in self._peers.sessions())

    # --- the async API (trio thread) ---------------------------------------------

    async def lookup(
        self, peer: str, kv_request_id: str, keys: Sequence[bytes]
    ) -> list[LookupResult]:
        """Ask ``peer`` which of ``keys`` it holds, for request ``kv_request_id``.

        Waits until every key is answered: HIT or MISS (MISS for all when the
        peer may not be dialed, or the request's lookup failed). The lookup
        goes out from this call; the caller is woken once, when the answer is
        complete.
        """
        actor = self.consumer_for(peer, kv_request_id)
        if actor is None:
            await trio.lowlevel.checkpoint()
            return [LookupResult.MISS] * len(keys)
        waiter = _Answers(keys)
        self._answers.setdefault(actor, []).append(waiter)
        try:
            self._runner.deliver(actor, inp.Register(keys, flush=True))
            self._check_answers(actor)
            await waiter.ready.wait()
        finally:
            waiting = self._answers.get(actor)
            if waiting is not None and waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del self._answers[actor]
        return probe_answers(actor.state, keys)  # type: ignore[arg-type]

    async def fetch(
        self,
        peer: str,
        kv_request_id: str,
        keys: Sequence[bytes],
        dest_blocks: Sequence[int],
    ) -> FetchResult:
        """Load ``keys`` from ``peer`` into our ``dest_blocks`` and wait for the outcome."""
        job_id = next(self._job_ids)
        waiter = self._loads[job_id] = _Load()
        try:
            actor = self.consumer_for(peer, kv_request_id)
            if actor is None:
                await trio.lowlevel.checkpoint()
                return FetchResult(success=False, blocks=0, reason=f"{peer} may not be dialed")
            self.submit(actor, job_id, tuple(keys), tuple(dest_blocks))
            await waiter.ready.wait()
        finally:
            self._loads.pop(job_id, None)
        result = waiter.result
        assert result is not None
        blocks = len(keys) if result.success else 0
        return FetchResult(success=result.success, blocks=blocks, reason=result.reason)

    # --- the sync, thread-safe API ------------------------------------------------

    def register_lookup(
        self, peer: str, kv_request_id: str, keys: Sequence[bytes]
    ) -> list[LookupResult]:
        """Answer what is known about ``keys`` now; ask the peer about the rest.

        Returns HIT or MISS for keys already answered and RETRY for keys still
        being asked (newly registered keys go out at the next :meth:`flush`).
        Never blocks; safe from any thread.
        """
        answers = self.peek_lookup(peer, kv_request_id, keys)
        self.ask(peer, kv_request_id, [k for k, a in zip(keys, answers, strict=True) if a is RETRY])
        return answers

    def peek_lookup(
        self, peer: str, kv_request_id: str, keys: Sequence[bytes]
    ) -> list[LookupResult]:
        """What is known about ``keys`` now, without asking anything. Thread-safe.

        HIT or MISS for keys answered; RETRY for keys being asked or never
        asked (see :meth:`ask`); MISS for everything when ``peer`` may not be
        dialed or the request's lookup failed.
        """
        if not self._config.may_dial(peer):
            return [LookupResult.MISS] * len(keys)
        actor = self._consumers.get(kv_request_id, {}).get(peer)
        if actor is None:
            return [RETRY] * len(keys)
        state = actor.state
        assert isinstance(state, ConsumerState)
        return probe_answers(state, keys)

    def ask(self, peer: str, kv_request_id: str, keys: Sequence[bytes]) -> None:
        """Ask ``peer`` about ``keys`` at the next :meth:`flush`. Thread-safe, never blocks.

        A key is handed to the node's thread once, however often the engine
        asks about it before the answer comes: an engine that re-asks every
        step must not flood the node (and the node must not fall behind).
        """
        if keys and self._config.may_dial(peer):
            self._bridge.ask(peer, kv_request_id, keys)

    def prepare(self, peer: str, *, wake: bool = True) -> None:
        """Open the session with ``peer`` now: its handshake is done when a lookup comes.

        Thread-safe, never blocks; a peer that may not be dialed is ignored.
        """
        if self._config.may_dial(peer):
            self._bridge.dial(peer, wake=wake)

    def flush(self) -> None:
        """Send the lookups of every request that registered new keys. Thread-safe.

        A step that registered nothing posts nothing: an idle engine must not
        look busy to :meth:`has_pending_work`.
        """
        self._bridge.flush()

    def kick(self) -> None:
        """Wake the node's thread if anything was handed over without waking it.

        Engines that batch (``wake=False`` on the calls of a step) call this, or
        :meth:`flush`, once per step: one wake-up instead of one per call.
        """
        self._bridge.kick()

    def submit_load(
        self,
        peer: str,
        kv_request_id: str,
        job_id: int,
        keys: Sequence[bytes],
        dest_blocks: Sequence[int],
        *,
        wake: bool = True,
    ) -> None:
        """Load ``keys`` from ``peer`` into our ``dest_blocks`` as the engine's ``job_id``.

        The result arrives in :meth:`finished_jobs`. Thread-safe, never blocks;
        with ``wake=False`` the node's thread picks it up at the next
        :meth:`flush` or :meth:`kick`.
        """
        self._bridge.load(peer, kv_request_id, job_id, keys, dest_blocks, wake=wake)

    def finish(self, kv_request_id: str, *, wake: bool = True) -> None:
        """The engine is done with ``kv_request_id`` (either role). Thread-safe."""
        self._bridge.finish(kv_request_id, wake=wake)

    def submit_store(
        self,
        kv_request_id: str,
        job_id: int,
        keys: Sequence[bytes],
        blocks: Sequence[int],
        *,
        wake: bool = True,
    ) -> None:
        """Offer pinned blocks of a prefill/decode request to the peer that will fetch them.

        ``job_id`` is released through the parent exactly once. Thread-safe.
        """
        store = inp.AddStore(job_id=job_id, keys=keys, blocks=blocks)
        self._bridge.store(kv_request_id, store, wake=wake)

    def finished_jobs(self) -> list[LoadResult]:
        """Load results since the last call. Thread-safe, never blocks."""
        return self._bridge.finished()

    def serve_parent(self, parent: Parent) -> int:
        """Run the parent requests that are waiting, while the engine lends ``parent``.

        Call it from the engine's thread, holding the engine's lock; ``parent``
        is used only during this call and never kept. The answers reach the
        actors on the node's thread, in one batch.

        Returns:
            How many requests were served.
        """
        answers = self._service.serve(parent)
        self._bridge.answers(answers)
        return len(answers)

    # --- the node's thread: what the bridge and the API apply (EngineSide) --------

    def consumer_for(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor for (peer, request), created with its session if needed."""
        mine = self._consumers.get(kv_request_id)
        actor = None if mine is None else mine.get(peer)
        if actor is not None:
            return actor  # a finished or failed one answers MISS until the engine finishes
        session = self._peers.session_for(peer)
        if session is None:
            return None
        actor = session.consumer(kv_request_id)
        self._consumers.setdefault(kv_request_id, {})[peer] = actor
        return actor

    def known_consumer(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor of (peer, request), if there is one. Any thread."""
        return self._consumers.get(kv_request_id, {}).get(peer)

    def submit(
        self, actor: RequestActor, job_id: int, keys: tuple[bytes, ...], blocks: tuple[int, ...]
    ) -> None:
        """Start the load ``job_id`` on ``actor``."""
        session = self._peers.session(actor.id.peer)
        next_round = session.next_round() if session is not None else None
        if actor.done:
            self.report_load(job_id, success=False, reason="the request already ended")
            return
        load = inp.SubmitLoad(job_id=job_id, keys=keys, block_indexes=blocks, next_round=next_round)
        self._runner.deliver(actor, load)

    def finish_request(self, kv_request_id: str) -> None:
        """The engine is done with ``kv_request_id``: finish its consumers and its producer."""
        for actor in self._consumers.pop(kv_request_id, {}).values():
            self._runner.deliver(actor, inp.Finish())
        bound = self._stores.finish(kv_request_id)
        if bound is not None:
            self._runner.deliver(bound, inp.Finish())

    def store(self, kv_request_id: str, store: inp.AddStore) -> None:
        """Give stored blocks to the request's producer, or keep them until its fetch."""
        verdict = self._stores.store(kv_request_id, store, self._clock.current_time())
        if isinstance(verdict, StoreRefused):
            log.warning(
                "%s",
                verdict.reason,
                extra=request_context(None, kv_request_id, node=self._config.node_id),
            )
            self.release_pin(store.job_id, success=False)
        elif isinstance(verdict, Unbound):
            self._arm_reaper()
        else:
            self._runner.deliver(verdict, store)

    def dial(self, peer: str) -> None:
        """Open the session with ``peer`` now."""
        self._peers.session_for(peer)

    def _arm_reaper(self) -> None:
        deadline = self._stores.next_deadline()
        if deadline is not None and (
            self._reaper.deadline is None or deadline < self._reaper.deadline
        ):
            self._reaper.deadline = deadline
            self._timers.arm(self._reaper)

    def _reap(self) -> None:
        """Release the stores no fetch came for within ``unbound_store_timeout``."""
        for reaped in self._stores.reap(self._clock.current_time()):
            log.warning(
                "no fetch came for %s within unbound_store_timeout (%g s); releasing its "
                "stored blocks (check that the decode side runs and reaches this node)",
                reaped.kv_request_id,
                self._config.unbound_store_timeout,
                extra=request_context(None, reaped.kv_request_id, node=self._config.node_id),
            )
            self.release_pin(reaped.job_id, success=False)
        self._arm_reaper()

    # --- what sessions ask of the node (SessionHost) ------------------------------

    def watch_actors(self, watcher: Callable[[RequestActor], None]) -> Callable[[], None]:
        """Call ``watcher`` with every actor created from now on; returns an unsubscribe."""
        self._actor_watchers.append(watcher)
        return lambda: self._actor_watchers.remove(watcher)

    def watch_handshakes(self, watcher: HandshakeWatcher) -> Callable[[], None]:
        """Call ``watcher(peer, outcome)`` as each handshake ends; returns an unsubscribe.

        ``outcome`` is ``ok`` or why not (``timeout``, ``seed_mismatch``, ...).
        """
        self._handshake_watchers.append(watcher)
        return lambda: self._handshake_watchers.remove(watcher)

    def handshake_ended(self, peer: str, outcome: str) -> None:
        """Tell the handshake watchers how a session's handshake ended."""
        for watcher in list(self._handshake_watchers):
            watcher(peer, outcome)

    def actor_created(self, actor: RequestActor) -> None:
        """Tell the watchers about a new actor."""
        for watcher in list(self._actor_watchers):
            watcher(actor)

    def watch_events(self, watcher: EventWatcher) -> Callable[[], None]:
        """Call ``watcher(events, state)`` after every actor step; returns an unsubscribe.

        ``state`` is the actor's state after ``events``. Watchers run on the
        node's thread inside the step: they must be quick and must not block
        (the live timeline queues and returns). An exception in a watcher is
        logged and otherwise ignored.
        """
        self._event_watchers.append(watcher)
        return lambda: self._event_watchers.remove(watcher)

    def record(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """Append an actor's events to the log, show them to the watchers, wake its callers."""
        self._log.append(events)
        for watcher in self._event_watchers:
            try:
                watcher(events, actor.state)
            except Exception:
                log.exception(
                    "an event watcher failed on %s; it keeps its subscription (fix the "
                    "watcher: see the traceback)",
                    actor.id,
                    extra=request_context(
                        actor.id.peer, actor.id.kv_request_id, node=self._config.node_id
                    ),
                )
        if actor in self._answers:
            self._check_answers(actor)

    def _check_answers(self, actor: RequestActor) -> None:
        """Wake the callers of :meth:`lookup` on ``actor`` whose keys are all answered."""
        state = actor.state
        assert isinstance(state, ConsumerState)
        for waiter in self._answers.get(actor, ()):
            if not waiter.ready.is_set() and RETRY not in probe_answers(state, waiter.keys):
                waiter.ready.set()

    def post_parent(self, actor: RequestActor, request: fx.ParentRequest) -> None:
        """Have the parent service run ``request`` (now, or at the next serve)."""
        self._service.post(actor, request)

    def release_pin(self, job_id: int, *, success: bool) -> None:
        """Release a pin job through the parent service (now, or at the next serve)."""
        self._service.release(job_id, success=success)

    def report_load(self, job_id: int, *, success: bool, reason: str) -> None:
        """Hand a load result to whoever waits for it."""
        result = LoadResult(job_id, success, reason)
        waiter = self._loads.get(job_id)
        if waiter is not None:
            waiter.result = result
            waiter.ready.set()
        else:
            self._bridge.result(result)

    def producer_opened(self, session: PeerSession, actor: RequestActor) -> None:
        """Bind a prefill/decode request's waiting stores to the actor that will serve them."""
        del session
        # As vLLM binds a request id to the session its fetch came on: stores
        # for it go to this actor from now on. A reaped id can never be
        # served: finished at once, its fetch fails now instead of waiting
        # for the consumer's 30 s load timeout.
        stores, finished = self._stores.bind(actor.id.kv_request_id, actor)
        for store in stores:
            self._runner.deliver(actor, store)
        if finished:
            self._runner.deliver(actor, inp.Finish())

    def session_restarted(
        self, old: PeerSession, conn: ControlConnection, first: wire.Connect
    ) -> None:
        """The peer opened a new session on ``old``'s connection: start one with ``first``."""
        self._peers.restarted(old, conn, first)

    def _session_closed(self, result: SessionCloseResult) -> None:
        for job_id in result.held_pins:
            log.warning(
                "%s closed holding pin %d; releasing it",
                result.peer_id,
                job_id,
                extra=peer_context(result.peer_id, node=self._config.node_id),
            )
            self.release_pin(job_id, success=False)
        for context in result.open_contexts:
            self._service.post_close(context)
        # A session that replaced this one (the peer connected again) keeps its
        # own bound producers; only the ended ones of this peer go.
        replaced = self._peers.session(result.peer_id) is not None
        self._stores.unbind(
            lambda actor: actor.id.peer == result.peer_id and (actor.done or not replaced)
        )

    # --- lifetime -----------------------------------------------------------------

    async def aclose(self) -> None:
        """Close every session (draining them), then the log. Idempotent."""
        self._bridge.stop()
        await self._peers.close_all("the node is shutting down")
        self._service.drain()
        self._log.close()


@asynccontextmanager
async def open_node(
    config: NodeConfig,
    *,
    control: ControlTransport,
    data: DataTransport,
    parent: Parent | None = None,
    event_log: EventLog | None = None,
    hash_seed: Callable[[], str] | None = None,
) -> AsyncIterator[Node]:
    """Start a node; close it (draining its sessions) when the block exits.

    Args:
        config: The node's configuration.
        control: Its control transport (ZeroMQ, or in-memory for tests).
        data: Its data transport (NIXL, or in-memory for tests).
        parent: An in-process cache to serve inline; None when the engine
            lends its cache through :meth:`Node.serve_parent`.
        event_log: Where events go; by default an in-memory log.
        hash_seed: Where to read the hash seed from, on first need, instead of
            ``config.hash_seed``.
    """
    event_log = event_log or EventLog(config.node_id)
    async with trio.open_nursery() as nursery:
        node = Node(
            config,
            control=control,
            data=data,
            parent=parent,
            event_log=event_log,
            nursery=nursery,
            hash_seed=hash_seed,
        )
        # Peers we may not dial are dropped by the transport itself, before
        # it dials back to the address their frames claim.
        control.accept_only(config.may_dial)
        nursery.start_soon(node._peers.accept, name="accept")
        nursery.start_soon(node._bridge.run, name="engine bridge")
        nursery.start_soon(node._timers.run, name="timers")
        nursery.start_soon(event_log.flush_periodically)  # returns at once if not needed
        try:
            yield node
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(config.drain_timeout + 5):
                await node.aclose()
            nursery.cancel_scope.cancel()
