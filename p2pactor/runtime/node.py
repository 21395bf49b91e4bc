"""Node: the public API of p2pactor.

A node owns its peer sessions, their request actors, the transports and the event
log, all under one trio nursery::

    async with open_node(config, control=..., data=..., parent=cache) as node:
        answers = await node.lookup(peer, "req-1", keys)
        result = await node.fetch(peer, "req-1", hits, dest_blocks)
        node.finish("req-1")

Two ways in, for two kinds of engines:

* **async** (:meth:`Node.lookup`, :meth:`Node.fetch`, and :meth:`Node.locate` for a
  request that names no source), for engines written on trio;
* **sync and thread-safe** (:meth:`Node.register_lookup`, :meth:`Node.flush`,
  :meth:`Node.submit_load`, :meth:`Node.finish`, :meth:`Node.finished_jobs`,
  :meth:`Node.submit_store`), for engines that step on their own thread (vLLM).
  These never wait on trio: they hand work over (:mod:`p2pactor.runtime.engine`) and
  read what the node's thread already published (:mod:`p2pactor.runtime.threadsafe`).

The node is a facade over its parts, each in its module: the runner and the
timer that step actors (:mod:`p2pactor.runtime.actor`, :mod:`p2pactor.runtime.timers`), the
sessions and their accept policy (:mod:`p2pactor.runtime.peers`), the parent service
(:mod:`p2pactor.runtime.serving`), the stores of prefill/decode requests
(:mod:`p2pactor.runtime.stores`) and the
engine bridge (:mod:`p2pactor.runtime.engine`, :mod:`p2pactor.runtime.threadsafe`). The
operator surface (metrics, ``/status``, the timeline) attaches from outside
(:mod:`p2pactor.surface.attach`).
A lookup goes from :meth:`Node.lookup` to the socket and back without a
channel or another task: the caller steps its actor (which sends the lookup),
the transport's receive task steps the answer where it arrives, and the caller
is woken once, when every key is answered.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from p2pactor.core import inputs as inp
from p2pactor.core.choice import Choice
from p2pactor.core.consumer import probe_answers
from p2pactor.core.inputs import LookupResult
from p2pactor.runtime.actor import RequestActor, Runner
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.directory import SourceDirectory
from p2pactor.runtime.engine import LoadResult
from p2pactor.runtime.host import Answers, Load, NodeHost
from p2pactor.runtime.ledger import QuotaLedger
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.loopwatch import LoopWatch
from p2pactor.runtime.parent import Parent
from p2pactor.runtime.quotas import PeerUsage
from p2pactor.runtime.session import PeerSession, SessionCloseResult
from p2pactor.runtime.threadsafe import ThreadSafeAPI
from p2pactor.runtime.threadsafe_sources import ThreadSafeSources
from p2pactor.runtime.timers import Timers
from p2pactor.runtime.transport import ControlTransport, DataTransport
from p2pactor.runtime.view import EventWatcher, HandshakeWatcher

__all__ = ["EventWatcher", "FetchResult", "LoadResult", "Located", "Node", "open_node"]


@attrs.frozen(kw_only=True)
class Located:
    """What :meth:`Node.locate` found for a request that names no source.

    Attributes:
        peer: The peer that was asked (fetch the hits from it), or None:
            no peer claimed enough of the keys, and nothing was asked.
        answers: HIT or MISS for every key, in order.
        choice: Which peers claimed what, and why ``peer`` was chosen.
    """

    peer: str | None
    answers: tuple[LookupResult, ...]
    choice: Choice


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


class Node(ThreadSafeAPI, ThreadSafeSources):
    """A p2pactor node. Create it with :func:`open_node`.

    A facade over its :class:`~p2pactor.runtime.host.NodeHost`: the async API, the
    sync and thread-safe one (:class:`~p2pactor.runtime.threadsafe.ThreadSafeAPI`,
    :class:`~p2pactor.runtime.threadsafe_sources.ThreadSafeSources`),
    and a read-only view of its state (:class:`~p2pactor.runtime.view.NodeView`).
    """

    def __init__(self, host: NodeHost) -> None:
        self._host = host
        self._config = host.config
        self._bridge = host.bridge
        self._service = host.service
        self._directory = host.directory

    # --- identity and state ------------------------------------------------------

    @property
    def config(self) -> NodeConfig:
        """The node's configuration."""
        return self._host.config

    @property
    def node_id(self) -> str:
        """``host:port``: this node's id on the wire."""
        return self._host.config.node_id

    @property
    def hash_seed(self) -> str:
        """The hash seed this node advertises and requires of peers.

        Resolved on first use when the node was given a source for it: vLLM
        knows its seed only once the engine has started, after the tier exists.
        """
        return self._host.hash_seed

    @property
    def control(self) -> ControlTransport:
        """The control transport."""
        return self._host.control

    @property
    def data(self) -> DataTransport:
        """The data transport."""
        return self._host.data

    @property
    def event_log(self) -> EventLog:
        """The node's event log."""
        return self._host.log

    @property
    def sources(self) -> SourceDirectory:
        """What this node tells peers it holds, what they claim, and the choices made."""
        return self._host.directory

    @property
    def runner(self) -> Runner:
        """The runner that steps every actor of the node (node's thread only)."""
        return self._host.runner

    @property
    def timers(self) -> Timers:
        """The node's one timer (node's thread only)."""
        return self._host.timers

    @property
    def quotas(self) -> QuotaLedger:
        """The per-peer quota counts (see :mod:`p2pactor.runtime.quotas`)."""
        return self._host.quotas

    def peer_usage(self, peer: str) -> PeerUsage:
        """What ``peer`` holds on this node now, and what its quotas refused. Any thread."""
        return self._host.quotas.usage(peer)

    def quota_usage(self) -> dict[str, PeerUsage]:
        """:meth:`peer_usage` of every peer seen so far, by peer id."""
        return self._host.quotas.usages()

    def now(self) -> float:
        """The node's clock (trio's): session activity times are on it. Any thread."""
        return self._host.clock.current_time()

    @property
    def loop_watch(self) -> LoopWatch:
        """The slow-step watch on the node's trio thread (its counts: ``snapshot()``)."""
        return self._host.loop_watch

    @property
    def uptime(self) -> float:
        """Seconds since the node started. Any thread."""
        return self._host.clock.current_time() - self._host.started_at

    @property
    def engine_backlog(self) -> int:
        """Engine calls handed over and not yet applied (bounded by ``engine_inbox``)."""
        return self._host.bridge.backlog

    def sessions(self) -> list[PeerSession]:
        """Live sessions, one per peer."""
        return self._host.peers.sessions()

    def replaced_sessions(self) -> list[PeerSession]:
        """Sessions a reconnecting peer replaced, still draining (not in :meth:`sessions`)."""
        return self._host.peers.replaced_sessions()

    def session(self, peer: str) -> PeerSession | None:
        """The live session with ``peer``, if any."""
        return self._host.peers.session(peer)

    def closed_sessions(self) -> list[SessionCloseResult]:
        """What the sessions that closed left behind, oldest first (the last 1,024)."""
        return self._host.peers.closed_sessions()

    @property
    def closed_session_count(self) -> int:
        """How many sessions have closed since the node started."""
        return self._host.peers.closed_count

    def has_transfers_in_flight(self) -> bool:
        """Whether a load of ours or a write of ours is still running. Thread-safe."""
        return any(s.has_transfers_in_flight() for s in self._host.peers.sessions())

    def has_pending_work(self) -> bool:
        """Whether anything is really outstanding: handshakes, loads, writes, parent work."""
        host = self._host
        if host.service.pending or host.bridge.pending or host.peers.draining:
            return True
        return any(s.has_pending_work() for s in host.peers.sessions())

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
        return await self._ask(peer, kv_request_id, keys)

    async def locate(self, kv_request_id: str, keys: Sequence[bytes]) -> Located:
        """Look ``keys`` up at the peer that claims most of them, for a request naming none.

        The peers' summaries say who holds what: when no live peer claims the
        first key, or no claimed run is worth a round trip, every key is a
        MISS at once and nothing is sent. Otherwise one ordinary lookup goes
        to the best peer (its claimed run, plus a few keys past it), and from
        then on the request is that peer's, as if it had been named: fetch
        the hits from ``Located.peer``, then :meth:`finish` it. The choice is
        recorded with the lookup (the ``source`` of its ``Probed`` event).
        """
        host = self._host
        choice, actor = host.locate(kv_request_id, keys)
        if actor is None:
            await trio.lowlevel.checkpoint()
            return Located(peer=None, answers=(LookupResult.MISS,) * len(keys), choice=choice)
        asked = keys[: choice.keys]
        answers = await self._answers(actor, asked)
        rest = (LookupResult.MISS,) * (len(keys) - len(asked))
        return Located(peer=choice.chosen, answers=(*answers, *rest), choice=choice)

    async def _ask(
        self, peer: str, kv_request_id: str, keys: Sequence[bytes]
    ) -> list[LookupResult]:
        host = self._host
        actor = host.consumer_for(peer, kv_request_id)
        if actor is None:
            await trio.lowlevel.checkpoint()
            return [LookupResult.MISS] * len(keys)
        host.runner.deliver(actor, inp.Register(tuple(keys), flush=True))
        return await self._answers(actor, keys)

    async def _answers(self, actor: RequestActor, keys: Sequence[bytes]) -> list[LookupResult]:
        """Wait until every one of ``keys`` (asked of ``actor``) is answered."""
        host = self._host
        waiter = Answers(keys)
        host.answers.setdefault(actor, []).append(waiter)
        try:
            host.check_answers(actor)  # answered already (known keys, a failed lookup)
            await waiter.ready.wait()
        finally:
            waiting = host.answers.get(actor)
            if waiting is not None and waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del host.answers[actor]
        return probe_answers(actor.state, keys)  # type: ignore[arg-type]

    async def fetch(
        self,
        peer: str,
        kv_request_id: str,
        keys: Sequence[bytes],
        dest_blocks: Sequence[int],
    ) -> FetchResult:
        """Load ``keys`` from ``peer`` into our ``dest_blocks`` and wait for the outcome."""
        host = self._host
        job_id = next(host.job_ids)
        waiter = host.loads[job_id] = Load()
        try:
            actor = host.consumer_for(peer, kv_request_id)
            if actor is None:
                await trio.lowlevel.checkpoint()
                # The loopback refusal says what to set; the others are the allowlist's.
                why = host.config.dial_refusal(peer) or f"{peer} may not be dialed"
                return FetchResult(success=False, blocks=0, reason=why)
            host.submit(actor, job_id, tuple(keys), tuple(dest_blocks))
            await waiter.ready.wait()
        finally:
            host.loads.pop(job_id, None)
        result = waiter.result
        assert result is not None
        blocks = len(keys) if result.success else 0
        return FetchResult(success=result.success, blocks=blocks, reason=result.reason)

    def known_consumer(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor of (peer, request), if there is one. Any thread."""
        return self._host.known_consumer(peer, kv_request_id)

    def _has_session(self, peer: str) -> bool:
        return self._host.peers.session(peer) is not None

    # --- following it (NodeView) ----------------------------------------------------

    def watch_actors(self, watcher: Callable[[RequestActor], None]) -> Callable[[], None]:
        """Call ``watcher`` with every actor created from now on; returns an unsubscribe."""
        return self._host.watch_actors(watcher)

    def watch_handshakes(self, watcher: HandshakeWatcher) -> Callable[[], None]:
        """Call ``watcher(peer, outcome)`` as each handshake ends; returns an unsubscribe.

        ``outcome`` is ``ok`` or why not (``timeout``, ``seed_mismatch``, ...).
        """
        return self._host.watch_handshakes(watcher)

    def watch_events(self, watcher: EventWatcher) -> Callable[[], None]:
        """Call ``watcher(events, state)`` after every actor step; returns an unsubscribe.

        ``state`` is the actor's state after ``events``. Watchers run on the
        node's thread inside the step: they must be quick and must not block
        (the live timeline queues and returns). An exception in a watcher is
        logged and otherwise ignored.
        """
        return self._host.watch_events(watcher)

    async def aclose(self) -> None:
        """Close every session (draining them), then the log. Idempotent."""
        await self._host.aclose()


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
        host = NodeHost(
            config,
            control=control,
            data=data,
            parent=parent,
            event_log=event_log,
            nursery=nursery,
            hash_seed=hash_seed,
        )
        node = Node(host)
        # Peers we may not dial are dropped by the transport itself, before
        # it dials back to the address their frames claim (config.may_dial,
        # and a log line for a peer a loopback-known node cannot serve).
        watch_keys = getattr(parent, "watch_keys", None)
        if watch_keys is not None and host.directory.enabled:
            # An embedded cache says exactly what it holds: the summary is exact.
            watch_keys(host.directory.came, host.directory.went)
        control.accept_only(host.peers.may_accept)
        nursery.start_soon(host.peers.accept, name="accept")
        nursery.start_soon(host.bridge.run, name="engine bridge")
        nursery.start_soon(host.timers.run, name="timers")
        if host.directory.enabled:
            nursery.start_soon(host.directory.run, name="summaries")
        nursery.start_soon(event_log.flush_periodically)  # returns at once if not needed
        for peer in sorted(config.seed_peers):
            host.dial(peer)  # summaries are here before the first request naming no source
        # Added to the run already going, whoever started it (a program's
        # trio.run, the vLLM tier's thread), and removed with the node.
        host.loop_watch.start()
        try:
            yield node
        finally:
            if watch_keys is not None:
                watch_keys(None, None)
            try:
                with trio.CancelScope(shield=True), trio.move_on_after(config.drain_timeout + 5):
                    await node.aclose()
            finally:
                host.loop_watch.stop()  # even if closing failed: the run may go on
            nursery.cancel_scope.cancel()
