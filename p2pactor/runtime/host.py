"""The node's host: its parts, and what its sessions and its engine bridge ask of it.

:class:`NodeHost` owns the node's parts (runner, timer, quota ledger, parent
service, store desk, peer registry, directory) and does what they ask of the
node: what a :class:`~p2pactor.runtime.session.PeerSession` needs (record a
step's events, ask the parent, release a pin, report a load) and what the
engine bridge it extends needs (find or open a consumer, start a load, finish
a request). :class:`~p2pactor.runtime.node.Node`, the public API, is a
:class:`NodeHost`; nothing here is API of its own.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence

import attrs
import trio

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState, probe_answers
from p2pactor.core.fold import ActorState
from p2pactor.core.inputs import LookupResult
from p2pactor.runtime.actor import Ground, RequestActor, Runner
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.directory import SourceDirectory
from p2pactor.runtime.engine import LoadResult
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.logcontext import actor_context, peer_context
from p2pactor.runtime.loopwatch import LoopWatch
from p2pactor.runtime.parent import Parent
from p2pactor.runtime.peers import PeerRegistry, SeedRedial
from p2pactor.runtime.quotas import QuotaLedger
from p2pactor.runtime.serving import ParentService
from p2pactor.runtime.session import SessionCloseResult
from p2pactor.runtime.stores import StoreDesk
from p2pactor.runtime.threadsafe_sources import ThreadSafeSources
from p2pactor.runtime.timers import Timers
from p2pactor.runtime.transport import ControlTransport, DataTransport

__all__ = ["EventWatcher", "HandshakeWatcher", "NodeHost"]

log = logging.getLogger("p2pactor.node")

RETRY = LookupResult.RETRY

EventWatcher = Callable[[Sequence[ev.AnyEvent], ActorState], None]
"""Called with an actor's events of one step and its state after them."""

HandshakeWatcher = Callable[[str, str], None]
"""Called with a peer and how its handshake ended: ``ok``, or why not."""


@attrs.define(eq=False)
class Waiter:
    """A caller waiting: of ``Node.lookup``, for its ``keys``' answers; of ``fetch``, its result."""

    keys: Sequence[bytes] = ()
    ready: trio.Event = attrs.field(factory=trio.Event)
    result: LoadResult | None = None


class NodeHost(ThreadSafeSources):
    """The parts of one node and what they ask of it. Made by ``open_node``.

    Attributes:
        config: The node's configuration.
        control: The control transport.
        data: The data transport.
        event_log: The node's event log.
        runner: The runner that steps every actor of the node (node's thread only).
        timers: The node's one timer (node's thread only).
        quotas: The per-peer quota counts (see :mod:`p2pactor.runtime.quotas`).
        loop_watch: The slow-step watch on the node's trio thread (its counts: ``snapshot()``).
        peers: The sessions, one per peer (``sessions()``, ``session(peer)``,
            ``closed_sessions()``: :class:`~p2pactor.runtime.peers.PeerRegistry`).
        directory: What this node tells peers it holds, what they claim, and
            the choices made (:class:`~p2pactor.runtime.directory.SourceDirectory`).
    """

    def __init__(
        self,
        config: NodeConfig,
        nursery: trio.Nursery,
        *,
        control: ControlTransport,
        data: DataTransport,
        parent: Parent | None,
        event_log: EventLog | None,
        hash_seed: Callable[[], str] | None,
    ) -> None:
        super().__init__(config)
        self._hash_seed_source = hash_seed
        self.control = control
        self.data = data
        self.event_log = event_log or EventLog(config.node_id)  # by default in memory only
        self.clock = trio.lowlevel.current_clock()
        self.started_at = self.clock.current_time()  # for uptime (status reports)
        self.loop_watch = LoopWatch(config.slow_step_s, node_id=config.node_id)
        self.runner = Runner()
        self.timers = Timers()
        self.quotas = QuotaLedger(config.quotas, config.num_blocks)
        clock = self.clock.current_time
        ground = Ground(config, self.runner, self.timers, clock)
        self.directory = SourceDirectory(ground)
        self.service = ParentService(ground, self.quotas, parent)
        self.stores = StoreDesk(ground, lambda job_id: self.release_pin(job_id, success=False))
        self.peers = PeerRegistry(self, nursery)
        self.seeds = SeedRedial(config.seed_peers, self.dial, timers=self.timers, clock=clock)
        # Consumer actors by kv_request_id, then peer: a finish finds its own at once.
        self.consumers: dict[str, dict[str, RequestActor]] = {}
        self.answers: dict[RequestActor, list[Waiter]] = {}
        self.loads: dict[int, Waiter] = {}  # the async API's fetches, by their job
        self.job_ids = itertools.count(start=-1, step=-1)  # the async API's own jobs
        self._actor_watchers: tuple[Callable[[RequestActor], None], ...] = ()
        self._event_watchers: tuple[EventWatcher, ...] = ()
        self._handshake_watchers: tuple[HandshakeWatcher, ...] = ()

    @property
    def node_id(self) -> str:
        """``host:port``: this node's id on the wire."""
        return self.config.node_id

    @functools.cached_property
    def hash_seed(self) -> str:
        """The hash seed this node advertises and requires of peers.

        Resolved on first use when the node was given a source for it: vLLM
        knows its seed only once the engine has started, after the tier exists.
        """
        source = self._hash_seed_source
        return self.config.hash_seed if source is None else source()

    # --- the engine's requests (the node's thread) -----------------------------------

    def consumer_for(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor for (peer, request), created with its session if needed."""
        if (actor := self.known_consumer(peer, kv_request_id)) is not None:
            return actor  # a finished or failed one answers MISS until the engine finishes
        session = self.peers.session_for(peer)
        if session is None:
            return None
        actor = session.consumer(kv_request_id)
        self.consumers.setdefault(kv_request_id, {})[peer] = actor
        return actor

    def known_consumer(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor of (peer, request), if there is one. Any thread."""
        mine = self.consumers.get(kv_request_id)
        return None if mine is None else mine.get(peer)

    def submit(
        self, actor: RequestActor, job_id: int, keys: tuple[bytes, ...], blocks: tuple[int, ...]
    ) -> None:
        """Start the load ``job_id`` on ``actor``."""
        session = self.peers.session(actor.id.peer)
        next_round = session.next_round() if session is not None else None
        if actor.done:
            self.report_load(job_id, success=False, reason="the request already ended")
            return
        load = inp.SubmitLoad(job_id=job_id, keys=keys, block_indexes=blocks, next_round=next_round)
        self.runner.deliver(actor, load)

    def finish_request(self, kv_request_id: str) -> None:
        """The engine is done with ``kv_request_id``: finish its consumers and its producer."""
        for actor in self.consumers.pop(kv_request_id, {}).values():
            self.runner.deliver(actor, inp.Finish())
        self.stores.finish(kv_request_id)
        self.directory.decisions.pop(kv_request_id, None)

    def dial(self, peer: str) -> None:
        """Open the session with ``peer`` now."""
        self.peers.session_for(peer)

    def parent_answered(self, actor: RequestActor, answer: inp.ParentAnswer) -> None:
        """Step a lent parent's answer; a key it says we lack leaves our summary at once."""
        if self.config.sources.share:
            self.directory.answered(answer)
        self.runner.deliver(actor, answer)

    # --- following the node (the operator surface) -----------------------------------

    def _subscribe(self, watchers: str, watcher: object) -> Callable[[], None]:
        """Add ``watcher`` to the tuple named ``watchers``; returns the unsubscribe.

        A new tuple each time, never an edit of the one a call may be going
        through: a watcher that unsubscribes (itself or another) makes none miss
        that call. Unsubscribing twice is harmless.
        """
        setattr(self, watchers, (*getattr(self, watchers), watcher))
        return lambda: setattr(
            self, watchers, tuple(w for w in getattr(self, watchers) if w is not watcher)
        )

    def watch_actors(self, watcher: Callable[[RequestActor], None]) -> Callable[[], None]:
        """Call ``watcher`` with every actor created from now on; returns an unsubscribe."""
        return self._subscribe("_actor_watchers", watcher)

    def watch_handshakes(self, watcher: HandshakeWatcher) -> Callable[[], None]:
        """Call ``watcher(peer, outcome)`` as each handshake ends; returns an unsubscribe.

        ``outcome`` is ``ok`` or why not (``timeout``, ``seed_mismatch``, ...).
        """
        return self._subscribe("_handshake_watchers", watcher)

    def watch_events(self, watcher: EventWatcher) -> Callable[[], None]:
        """Call ``watcher(events, state)`` after every actor step; returns an unsubscribe.

        ``state`` is the actor's state after ``events``. Watchers run on the
        node's thread inside the step: they must be quick and must not block
        (the live timeline queues and returns). An exception in a watcher is
        logged and otherwise ignored.
        """
        return self._subscribe("_event_watchers", watcher)

    # --- what sessions ask (the node's thread) ---------------------------------------

    def handshake_ended(self, peer: str, outcome: str) -> None:
        """Tell the handshake watchers how a session's handshake ended."""
        if outcome == "ok":
            self.seeds.connected(peer)
        for watcher in self._handshake_watchers:
            watcher(peer, outcome)

    def actor_created(self, actor: RequestActor) -> None:
        """Tell the watchers about a new actor."""
        for watcher in self._actor_watchers:
            watcher(actor)

    def record(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """Append an actor's events to the log, show them to the watchers, wake its callers."""
        self.event_log.append(events)
        for watcher in self._event_watchers:
            try:
                watcher(events, actor.state)
            except Exception:
                log.exception(
                    "an event watcher failed on %s; it keeps its subscription (fix the "
                    "watcher: see the traceback)",
                    actor.id,
                    extra=actor_context(actor.id, node=self.config.node_id),
                )
        if actor in self.answers:
            self.check_answers(actor)
        directory = self.directory
        if directory.auto and actor in directory.auto:
            directory.stepped(actor, events)

    def check_answers(self, actor: RequestActor) -> None:
        """Wake the callers of ``Node.lookup`` on ``actor`` whose keys are all answered."""
        state = actor.state
        assert isinstance(state, ConsumerState)
        for waiter in self.answers.get(actor, ()):
            if not waiter.ready.is_set() and RETRY not in probe_answers(state, waiter.keys):
                waiter.ready.set()

    def release_pin(self, job_id: int, *, success: bool) -> None:
        """Release a pin job through the parent service (now, or at the next serve)."""
        self.service.post(None, fx.ReleasePin(job_id=job_id, success=success))
        if self.config.sources.share:
            self.directory.released(job_id)

    def report_load(self, job_id: int, *, success: bool, reason: str) -> None:
        """Hand a load result to whoever waits for it (a ``fetch``, or the engine's poll)."""
        result = LoadResult(job_id, success, reason)
        waiter = self.loads.get(job_id)
        if waiter is None:
            self._results.append(result)
        else:
            waiter.result = result
            waiter.ready.set()

    def session_closed(self, result: SessionCloseResult) -> None:
        """Release what a closed session left held; forget its bindings."""
        for job_id in result.held_pins:
            log.warning(
                "%s closed holding pin %d; releasing it",
                result.peer_id,
                job_id,
                extra=peer_context(result.peer_id, node=self.config.node_id),
            )
            self.release_pin(job_id, success=False)
        for context in result.open_contexts:
            self.service.post(None, fx.ParentClose(context))
        # A session that replaced this one (the peer connected again) keeps its
        # own bound producers; only the ended ones of this peer go.
        current = self.peers.session(result.peer_id)
        replaced = current is not None
        self.directory.peer_closed(result.peer_id, current)
        if not replaced and not self.peers.shutting_down:
            self.seeds.lost(result.peer_id)  # a seed is dialed again, after a back-off
        self.stores.forget(
            lambda actor: actor.id.peer == result.peer_id and (actor.done or not replaced)
        )

    async def aclose(self) -> None:
        """Close every session (draining them), then the log. Idempotent."""
        self._wakeup.stop()
        self.seeds.stop()
        await self.peers.close_all("the node is shutting down")
        self.service.drain()
        self.event_log.close()
