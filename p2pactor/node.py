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
  These never wait on trio: they hand work over and read what trio already
  published.

The parent (the engine's cache) is served continuously when the node is given
one (an in-process cache), or only inside :meth:`Node.serve_parent`, which an
engine calls while it lends its cache.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import attrs
import trio

from p2pactor import protocol as wire
from p2pactor.actor import RequestActor
from p2pactor.config import NodeConfig
from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState, probe_answers
from p2pactor.core.fold import ActorState
from p2pactor.core.inputs import LookupResult
from p2pactor.core.producer import ProducerState
from p2pactor.httpserve import MetricsServer, open_metrics_server
from p2pactor.log import EventLog
from p2pactor.logsetup import parent_request_context, peer_context, request_context
from p2pactor.metrics import NodeMetrics
from p2pactor.parent import Parent, serve_parent_request
from p2pactor.quotas import PeerUsage, QuotaLedger
from p2pactor.session import PeerSession, SessionCloseResult
from p2pactor.timeline import TimelineServer, open_timeline_server
from p2pactor.transport import ControlConnection, ControlTransport, DataTransport

__all__ = ["EventWatcher", "FetchResult", "LoadResult", "Node", "open_node"]

log = logging.getLogger("p2pactor.node")

_CLOSED_KEPT = 1024
"""Closed sessions whose results :meth:`Node.closed_sessions` keeps."""

RETRY = LookupResult.RETRY

EventWatcher = Callable[[Sequence[ev.AnyEvent], ActorState], None]
"""Called with an actor's events of one step and its state after them."""

_REAPED_MEMORY_S = 60.0


@attrs.frozen
class LoadResult:
    """One of the engine's load jobs finished.

    Attributes:
        job_id: The engine's job.
        success: Whether every block arrived.
        reason: Why not, when not.
    """

    job_id: int
    success: bool
    reason: str = ""


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


# What the engine's threads hand to the trio thread.
@attrs.frozen
class _Register:
    peer: str
    kv_request_id: str
    keys: tuple[bytes, ...]


@attrs.frozen
class _Flush:
    pass


@attrs.frozen
class _Load:
    peer: str
    kv_request_id: str
    job_id: int
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]


@attrs.frozen
class _Finish:
    kv_request_id: str


@attrs.frozen
class _Store:
    kv_request_id: str
    job_id: int
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]


@attrs.frozen
class _Dial:
    peer: str


@attrs.frozen
class _Answer:
    actor: RequestActor
    answer: inp.ParentAnswer


_EngineItem = _Register | _Flush | _Load | _Finish | _Store | _Dial | _Answer


@attrs.frozen
class _Release:
    job_id: int
    success: bool


# What actors ask of the parent, in order, with the actor owed the answer.
_ParentItem = tuple[RequestActor | None, fx.ParentRequest | _Release]


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
        self._parent = parent
        self._log = event_log
        self._nursery = nursery
        self._token = trio.lowlevel.current_trio_token()
        self._clock = trio.lowlevel.current_clock()
        self._sessions: dict[str, PeerSession] = {}
        self._closing: set[PeerSession] = set()
        self._consumers: dict[tuple[str, str], RequestActor] = {}
        self._dirty: set[RequestActor] = set()
        self._inbox: deque[_EngineItem] = deque()
        self._lock = threading.Lock()
        self._wake_pending = False
        self._registered = False
        # Engine threads wake the node through this thread, never themselves:
        # run_sync_soon writes to trio's wakeup socket, and that send releases
        # the GIL to the trio thread it wakes, which then runs its whole batch
        # before the engine thread gets the GIL back: ~0.5 ms charged to every
        # on_schedule_end (measured: p2pactor bench --only engine). Setting a
        # threading.Event keeps the GIL; the waker takes it over when the
        # engine thread next lets go of it (its forward pass).
        self._trio_thread = threading.get_ident()
        self._waker_event = threading.Event()
        self._waker_stop = False
        self._waker = threading.Thread(
            target=self._waker_loop, name=f"p2pactor-waker {config.node_id}", daemon=True
        )
        self._waker.start()
        self._posted: dict[tuple[str, str], set[bytes]] = {}
        self._engine_wakeup = trio.Event()
        self._parent_queue: deque[_ParentItem] = deque()
        self._parent_wakeup = trio.Event()
        self._parked: list[tuple[RequestActor, fx.ParentLookup]] = []
        self._results: deque[LoadResult] = deque()
        self._waiters: dict[int, trio.MemorySendChannel[LoadResult]] = {}
        self._job_ids = itertools.count(start=-1, step=-1)  # the async API's own jobs
        self._unbound: dict[str, list[tuple[float, _Store]]] = {}
        self._store_finished: set[str] = set()
        self._bound: dict[str, RequestActor] = {}
        # kv_request_ids whose stored blocks were reaped, and when: nothing can
        # be served under them any more, so a late fetch fails at once and a
        # late store is refused (vLLM keeps these 60 s too).
        self._reaped: dict[str, float] = {}
        # The most recent only: a long-lived node sees peers come and go for
        # ever, and each result holds what its session left owed.
        self._closed_results: deque[SessionCloseResult] = deque(maxlen=_CLOSED_KEPT)
        self._closed_count = 0
        self._actor_watchers: list[Callable[[RequestActor], None]] = []
        self._event_watchers: list[EventWatcher] = []
        self._closing_node = False
        self._quotas = QuotaLedger(config.quotas, config.num_blocks)
        self._started_at = self._clock.current_time()  # for uptime (status reports)
        self._dashboard: TimelineServer | None = None
        self._metrics_server: MetricsServer | None = None
        # Last: it subscribes to this node's events, and reads its state when scraped.
        self._metrics = NodeMetrics(self)

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
    def dashboard(self) -> TimelineServer | None:
        """The live timeline server (``config.dashboard_port``), or None when off."""
        return self._dashboard

    @property
    def metrics(self) -> NodeMetrics:
        """The node's Prometheus metrics (``docs/metrics.md``); always on."""
        return self._metrics

    @property
    def http_url(self) -> str | None:
        """``http://HOST:PORT/`` answering ``/metrics`` and ``/status``, or None when not served.

        The dashboard's port when it is on, else the metrics-only port
        (``config.metrics_port``).
        """
        if self._dashboard is not None:
            return self._dashboard.url
        if self._metrics_server is not None:
            return self._metrics_server.url
        return None

    @property
    def quotas(self) -> QuotaLedger:
        """The per-peer quota counts (see :mod:`p2pactor.quotas`)."""
        return self._quotas

    def peer_usage(self, peer: str) -> PeerUsage:
        """What ``peer`` holds on this node now, and what its quotas refused.

        Safe from any thread (a snapshot; counts may move right after).
        """
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
        return len(self._inbox)

    def sessions(self) -> list[PeerSession]:
        """Live sessions, one per peer."""
        return list(self._sessions.values())

    def replaced_sessions(self) -> list[PeerSession]:
        """Sessions a reconnecting peer replaced, still draining (not in :meth:`sessions`)."""
        return list(self._closing)

    def session(self, peer: str) -> PeerSession | None:
        """The live session with ``peer``, if any."""
        return self._sessions.get(peer)

    def closed_sessions(self) -> list[SessionCloseResult]:
        """What the sessions that closed left behind, oldest first (the last 1,024)."""
        return list(self._closed_results)

    @property
    def closed_session_count(self) -> int:
        """How many sessions have closed since the node started."""
        return self._closed_count

    def has_transfers_in_flight(self) -> bool:
        """Whether a load of ours or a write of ours is still running. Thread-safe."""
        return any(s.has_transfers_in_flight() for s in list(self._sessions.values()))

    def has_pending_work(self) -> bool:
        """Whether anything is really outstanding: handshakes, loads, writes, parent work."""
        if self._parent_queue or self._parked or self._inbox or self._closing:
            return True
        return any(s.has_pending_work() for s in list(self._sessions.values()))

    # --- the async API (trio thread) ---------------------------------------------

    async def lookup(
        self, peer: str, kv_request_id: str, keys: Sequence[bytes]
    ) -> list[LookupResult]:
        """Ask ``peer`` which of ``keys`` it holds, for request ``kv_request_id``.

        Waits until every key is answered: HIT or MISS (MISS for all when the
        peer may not be dialed, or the request's lookup failed).
        """
        actor = await self._consumer(peer, kv_request_id)
        if actor is None:
            return [LookupResult.MISS] * len(keys)
        await actor.deliver(inp.Register(keys))
        await actor.deliver(inp.Flush())
        while True:
            answers = probe_answers(actor.state, keys)  # type: ignore[arg-type]
            if LookupResult.RETRY not in answers:
                return answers
            await actor.wait_changed()

    async def fetch(
        self,
        peer: str,
        kv_request_id: str,
        keys: Sequence[bytes],
        dest_blocks: Sequence[int],
    ) -> FetchResult:
        """Load ``keys`` from ``peer`` into our ``dest_blocks`` and wait for the outcome."""
        job_id = next(self._job_ids)
        send, receive = trio.open_memory_channel[LoadResult](1)
        self._waiters[job_id] = send
        try:
            actor = await self._consumer(peer, kv_request_id)
            if actor is None:
                return FetchResult(success=False, blocks=0, reason=f"{peer} may not be dialed")
            await self._submit(actor, job_id, tuple(keys), tuple(dest_blocks))
            result = await receive.receive()
        finally:
            self._waiters.pop(job_id, None)
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
        actor = self._consumers.get((peer, kv_request_id))
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
        if not keys or not self._config.may_dial(peer):
            return
        actor = self._consumers.get((peer, kv_request_id))
        state = actor.state if actor is not None else None
        known = state.probes if isinstance(state, ConsumerState) else {}
        with self._lock:
            posted = self._posted.setdefault((peer, kv_request_id), set())
            posted.difference_update(k for k in list(posted) if k in known)
            new = tuple(k for k in dict.fromkeys(keys) if k not in known and k not in posted)
            if not new or len(self._inbox) >= self._config.engine_inbox:
                return
            posted.update(new)
            self._registered = True
        self._post(_Register(peer, kv_request_id, new), wake=False)

    def prepare(self, peer: str, *, wake: bool = True) -> None:
        """Open the session with ``peer`` now: its handshake is done when a lookup comes.

        Thread-safe, never blocks; a peer that may not be dialed is ignored.
        """
        if self._config.may_dial(peer):
            self._post(_Dial(peer), wake=wake)

    def flush(self) -> None:
        """Send the lookups of every request that registered new keys. Thread-safe.

        A step that registered nothing posts nothing: an idle engine must not
        look busy to :meth:`has_pending_work`.
        """
        with self._lock:
            registered, self._registered = self._registered, False
        if registered:
            self._inbox.append(_Flush())
        self.kick()

    def kick(self) -> None:
        """Wake the node's thread if anything was handed over without waking it.

        Engines that batch (``wake=False`` on the calls of a step) call this, or
        :meth:`flush`, once per step: one wake-up instead of one per call.
        """
        if self._inbox:
            self._wake()

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
        if len(self._inbox) >= self._config.engine_inbox:
            reason = f"the node is overloaded ({len(self._inbox)} engine calls queued)"
            self._results.append(LoadResult(job_id, success=False, reason=reason))
            return
        self._post(_Load(peer, kv_request_id, job_id, tuple(keys), tuple(dest_blocks)), wake=wake)

    def finish(self, kv_request_id: str, *, wake: bool = True) -> None:
        """The engine is done with ``kv_request_id`` (either role). Thread-safe."""
        with self._lock:
            for key in [k for k in self._posted if k[1] == kv_request_id]:
                del self._posted[key]
        self._post(_Finish(kv_request_id), wake=wake)

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
        self._post(_Store(kv_request_id, job_id, tuple(keys), tuple(blocks)), wake=wake)

    def finished_jobs(self) -> list[LoadResult]:
        """Load results since the last call. Thread-safe, never blocks."""
        out = []
        while True:
            try:
                out.append(self._results.popleft())
            except IndexError:
                return out

    def serve_parent(self, parent: Parent) -> int:
        """Run the parent requests that are waiting, while the engine lends ``parent``.

        Call it from the engine's thread, holding the engine's lock; ``parent``
        is used only during this call and never kept.

        Returns:
            How many requests were served.
        """
        answers = self._serve(parent)
        for actor, answer in answers:
            self._post(_Answer(actor, answer), wake=False)
        if answers:
            self._wake()
        return len(answers)

    # --- internals: hand-over from any thread ----------------------------------

    def _post(self, item: _EngineItem, *, wake: bool = True) -> None:
        self._inbox.append(item)
        if wake:
            self._wake()

    def _wake(self) -> None:
        if threading.get_ident() == self._trio_thread:
            self._engine_wakeup.set()  # on the node's own thread: no hop needed
            return
        with self._lock:
            if self._wake_pending:
                return
            self._wake_pending = True
        self._waker_event.set()

    def _waker_loop(self) -> None:
        while True:
            self._waker_event.wait()
            self._waker_event.clear()
            if self._waker_stop:
                return
            # If the node is gone, nothing will read the inbox again anyway.
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._wake_in_trio)

    def _wake_in_trio(self) -> None:
        with self._lock:
            self._wake_pending = False
        self._engine_wakeup.set()

    async def _engine_loop(self) -> None:
        # Engine calls made with wake=False are picked up within one poll
        # interval even if no flush or kick follows: the engine's thread never
        # pays a wake-up for them.
        poll = self._config.engine_poll_interval
        while True:
            with trio.move_on_after(poll):
                await self._engine_wakeup.wait()
            self._engine_wakeup = trio.Event()
            while self._inbox:
                await self._apply(self._inbox.popleft())

    async def _apply(self, item: _EngineItem) -> None:
        match item:
            case _Register(peer, kv_id, keys):
                actor = await self._consumer(peer, kv_id)
                if actor is not None and await actor.deliver(inp.Register(keys)):
                    self._dirty.add(actor)
            case _Flush():
                dirty, self._dirty = self._dirty, set()
                for actor in dirty:
                    await actor.deliver(inp.Flush())
            case _Load(peer, kv_id, job_id, keys, blocks):
                actor = await self._consumer(peer, kv_id)
                if actor is None:
                    self.report_load(job_id, success=False, reason=f"{peer} is not an allowed peer")
                else:
                    await self._submit(actor, job_id, keys, blocks)
            case _Finish(kv_id):
                await self._finish(kv_id)
            case _Store():
                await self._store(item)
            case _Dial(peer):
                await self._session_for(peer)
            case _Answer(actor, answer):
                if not await actor.deliver(answer):
                    log.error(
                        "%s ended before its parent answer; releasing its pin",
                        actor.id,
                        extra=request_context(
                            actor.id.peer, actor.id.kv_request_id, node=self._config.node_id
                        ),
                    )
                    if answer.pin is not None:
                        self.release_pin(answer.pin.job_id, success=False)

    async def _submit(
        self, actor: RequestActor, job_id: int, keys: tuple[bytes, ...], blocks: tuple[int, ...]
    ) -> None:
        session = self._sessions.get(actor.id.peer)
        next_round = session.next_round() if session is not None else None
        load = inp.SubmitLoad(job_id=job_id, keys=keys, block_indexes=blocks, next_round=next_round)
        if not await actor.deliver(load):
            self.report_load(job_id, success=False, reason="the request already ended")

    async def _finish(self, kv_id: str) -> None:
        for key in [k for k in self._consumers if k[1] == kv_id]:
            actor = self._consumers.pop(key)
            self._dirty.discard(actor)
            await actor.deliver(inp.Finish())
        bound = self._bound.get(kv_id)
        if bound is not None and not bound.done:
            await bound.deliver(inp.Finish())
        elif kv_id in self._unbound:
            self._store_finished.add(kv_id)

    async def _store(self, item: _Store) -> None:
        bound = self._bound.get(item.kv_request_id)
        store = inp.AddStore(job_id=item.job_id, keys=item.keys, blocks=item.blocks)
        if bound is not None and not bound.done and await bound.deliver(store):
            return
        if item.kv_request_id in self._reaped:
            log.warning(
                "%s: refused a store that came after its blocks were released (no fetch "
                "within unbound_store_timeout, %g s); raise it if fetches come this late",
                item.kv_request_id,
                self._config.unbound_store_timeout,
                extra=request_context(None, item.kv_request_id, node=self._config.node_id),
            )
            self.release_pin(item.job_id, success=False)
            return
        self._bound.pop(item.kv_request_id, None)
        parked = self._unbound.setdefault(item.kv_request_id, [])
        parked.append((trio.current_time(), item))

    async def _consumer(self, peer: str, kv_id: str) -> RequestActor | None:
        """The consumer actor for (peer, kv_id), created with its session if needed."""
        actor = self._consumers.get((peer, kv_id))
        if actor is not None:
            return actor  # a finished or failed one answers MISS until the engine finishes
        session = await self._session_for(peer)
        if session is None:
            return None
        actor = self._consumers.get((peer, kv_id))
        if actor is not None:  # created while we waited for the session to start
            return actor
        actor = session.consumer(kv_id)
        self._consumers[peer, kv_id] = actor
        return actor

    async def _session_for(self, peer: str) -> PeerSession | None:
        session = self._sessions.get(peer)
        if session is not None and session.alive:
            await session.wait_started()  # another task may be starting it right now
            return session
        if not self._config.may_dial(peer) or self._closing_node:
            return None
        if len(self._sessions) >= self._config.max_peers:
            log.warning(
                "not dialing %s: already %d peers (max_peers); raise max_peers "
                "(VLLM_P2P_MAX_PEERS) to allow more",
                peer,
                len(self._sessions),
                extra=peer_context(peer, node=self._config.node_id),
            )
            return None
        return await self._start_session(peer, None)

    async def _start_session(self, peer: str, conn: ControlConnection | None) -> PeerSession:
        session = PeerSession(self, peer, conn)
        self._sessions[peer] = session
        await self._nursery.start(self._run_session, session, name=f"session {peer}")
        return session

    async def _run_session(
        self, session: PeerSession, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            await session.run(task_status=task_status)
        finally:
            if self._sessions.get(session.peer_id) is session:
                del self._sessions[session.peer_id]
            self._closing.discard(session)
            if session.result is not None:
                self._session_closed(session.result)

    def session_restarted(
        self, old: PeerSession, conn: ControlConnection, first: wire.Connect
    ) -> None:
        """The peer opened a new session on ``old``'s connection: start one with ``first``."""
        self._closing.add(old)
        if self._closing_node:
            return  # the connection closes with the node
        session = PeerSession(self, old.peer_id, conn, first=first)
        self._sessions[old.peer_id] = session
        self._nursery.start_soon(self._run_session, session, name=f"session {old.peer_id}")

    def _session_closed(self, result: SessionCloseResult) -> None:
        self._closed_results.append(result)
        self._closed_count += 1
        for job_id in result.held_pins:
            log.warning(
                "%s closed holding pin %d; releasing it",
                result.peer_id,
                job_id,
                extra=peer_context(result.peer_id, node=self._config.node_id),
            )
            self.release_pin(job_id, success=False)
        for context in result.open_contexts:
            self._enqueue_parent((None, fx.ParentClose(context)))
        # A session that replaced this one (the peer connected again) keeps its
        # own bound producers; only the ended ones of this peer go.
        replaced = self._sessions.get(result.peer_id) is not None
        for kv_id, actor in list(self._bound.items()):
            if actor.id.peer == result.peer_id and (actor.done or not replaced):
                del self._bound[kv_id]

    async def _accept_loop(self) -> None:
        while True:
            try:
                conn = await self._control.accept()
            except trio.ClosedResourceError:
                return  # the transport was closed under us: no more peers
            peer = conn.peer_id
            existing = self._sessions.get(peer)
            if not self._config.may_dial(peer):
                log.warning(
                    "refused %s: not in allowed_peers; add it to allowed_peers "
                    "(P2PACTOR_ALLOWED_PEERS) to accept it",
                    peer,
                    extra=peer_context(peer, node=self._config.node_id),
                )
                await conn.aclose()
            elif existing is not None and existing.dialing:
                # Both nodes dialed each other at once, and the peer's frame came
                # before this node's session ran its connect(): that connect()
                # takes this very connection from the transport's table. Closing
                # it would lose the peer's `connect`, and the session would never
                # finish its handshake (seen with 16 nodes starting together).
                log.debug(
                    "%s dialed us while we dial it; the session takes its connection",
                    peer,
                    extra=peer_context(peer, node=self._config.node_id),
                )
            elif existing is not None and existing.alive:
                # A transport opens an inbound connection only for a peer it has
                # no live connection with: the session's own connection is gone
                # (the peer restarted or dropped it) and the session is about to
                # notice. The new connection is the peer now; the old session ends.
                log.info(
                    "%s connected again; its old session ends and a new one starts",
                    peer,
                    extra=peer_context(peer, node=self._config.node_id),
                )
                existing.close("the peer connected again: this session's connection is gone")
                self._closing.add(existing)
                await self._start_session(peer, conn)
            elif self._closing_node:
                log.info(
                    "refused %s: this node is shutting down",
                    peer,
                    extra=peer_context(peer, node=self._config.node_id),
                )
                await conn.aclose()
            elif len(self._sessions) >= self._config.max_peers:
                log.warning(
                    "refused %s: at max_peers (%d); raise max_peers (VLLM_P2P_MAX_PEERS) "
                    "to accept more",
                    peer,
                    self._config.max_peers,
                    extra=peer_context(peer, node=self._config.node_id),
                )
                await conn.aclose()
            else:
                if existing is not None:
                    self._closing.add(existing)
                await self._start_session(peer, conn)

    async def _reaper(self) -> None:
        """Expire stored blocks that no fetch came for."""
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            cutoff = now - self._config.unbound_store_timeout
            for kv_id, parked in list(self._unbound.items()):
                if parked and parked[0][0] <= cutoff:
                    del self._unbound[kv_id]
                    self._store_finished.discard(kv_id)
                    self._reaped[kv_id] = now
                    for _, item in parked:
                        log.warning(
                            "no fetch came for %s within unbound_store_timeout (%g s); "
                            "releasing its stored blocks (check that the decode side runs "
                            "and reaches this node)",
                            kv_id,
                            self._config.unbound_store_timeout,
                            extra=request_context(None, kv_id, node=self._config.node_id),
                        )
                        self.release_pin(item.job_id, success=False)
            remembered = now - _REAPED_MEMORY_S
            for kv_id, when in list(self._reaped.items()):
                if when <= remembered:
                    del self._reaped[kv_id]

    # --- what sessions ask of the node (SessionHost) ------------------------------

    def watch_actors(self, watcher: Callable[[RequestActor], None]) -> Callable[[], None]:
        """Call ``watcher`` with every actor created from now on; returns an unsubscribe."""
        self._actor_watchers.append(watcher)
        return lambda: self._actor_watchers.remove(watcher)

    def handshake_ended(self, peer: str, outcome: str) -> None:
        """Count a session's handshake outcome (see :data:`p2pactor.metrics.HANDSHAKE_OUTCOMES`)."""
        self._metrics.handshake(peer, outcome)

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
        """Append an actor's events to the log and show them to the watchers."""
        self._log.append(events)
        for watcher in list(self._event_watchers):
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

    def post_parent(self, actor: RequestActor, request: fx.ParentRequest) -> None:
        """Queue a parent request for the next serve."""
        self._enqueue_parent((actor, request))

    def release_pin(self, job_id: int, *, success: bool) -> None:
        """Queue the release of a pin job for the next serve."""
        self._enqueue_parent((None, _Release(job_id, success)))

    def _enqueue_parent(self, item: _ParentItem) -> None:
        self._parent_queue.append(item)
        self._parent_wakeup.set()

    def report_load(self, job_id: int, *, success: bool, reason: str) -> None:
        """Hand a load result to whoever waits for it."""
        result = LoadResult(job_id, success, reason)
        waiter = self._waiters.get(job_id)
        if waiter is not None:
            waiter.send_nowait(result)
        else:
            self._results.append(result)

    def producer_opened(self, session: PeerSession, actor: RequestActor) -> None:
        """Bind a prefill/decode request's parked stores to the actor that will serve them."""
        del session
        kv_id = actor.id.kv_request_id
        # As vLLM binds a request id to the session its fetch came on: stores
        # for it go to this actor from now on.
        self._bound[kv_id] = actor
        if len(self._bound) % 1024 == 0:
            # An ended actor binds nothing (every use checks `done`): forget
            # them, or a peer flooding fresh request ids piles them up here.
            for ended in [k for k, a in self._bound.items() if a.done]:
                del self._bound[ended]
        parked = self._unbound.pop(kv_id, None)
        # A reaped id can never be served: finished at once, its fetch fails now
        # instead of waiting for the consumer's 30 s load timeout.
        finished = kv_id in self._store_finished or kv_id in self._reaped
        self._store_finished.discard(kv_id)
        if parked or finished:
            self._nursery.start_soon(self._feed_stores, actor, parked or [], finished)

    async def _feed_stores(
        self, actor: RequestActor, parked: list[tuple[float, _Store]], finished: bool
    ) -> None:
        for _, item in parked:
            store = inp.AddStore(job_id=item.job_id, keys=item.keys, blocks=item.blocks)
            if not await actor.deliver(store):
                self.release_pin(item.job_id, success=False)
        if finished:
            await actor.deliver(inp.Finish())

    # --- the parent -----------------------------------------------------------------

    def _serve(self, parent: Parent) -> list[tuple[RequestActor, inp.ParentAnswer]]:
        """Run the parked and the queued parent requests against ``parent`` (any thread).

        A re-poll of pending keys that finds nothing new stays parked and is
        asked again at the next serve, as vLLM re-polls parked lookups: the
        actor hears back only when something changed or time ran out, so a
        key pending for 5 s costs two events, not one per poll.
        """
        answers: list[tuple[RequestActor, inp.ParentAnswer]] = []
        now = self._clock.current_time()
        parked: list[_ParentItem] = list(self._parked)
        self._parked = []
        while True:
            if parked:
                actor, request = parked.pop()
            else:
                try:
                    actor, request = self._parent_queue.popleft()
                except IndexError:
                    return answers
            match request:
                case fx.ParentLookup():
                    assert actor is not None
                    if not _wanted(actor, request):
                        # Dropped (the peer closed the request) or answered at
                        # its deadline: don't ask the parent, don't pin.
                        expired = inp.ParentAnswer(lookup_id=request.lookup_id, expired=True)
                        answers.append((actor, expired))
                        continue
                    # The pinned-blocks quota is checked here, where pins are
                    # made, so that no path (first lookups, re-polls of keys
                    # that were pending) can take a peer over it.
                    peer = actor.id.peer
                    budget = self._quotas.pin_budget(peer)
                    refusal = self._quotas.pin_refusal(peer) if budget < len(request.keys) else ""
                    answer = serve_parent_request(
                        parent, request, now, pin_budget=budget, refusal=refusal
                    )
                    if answer.pin is not None:
                        self._quotas.pinned(peer, answer.pin.job_id, len(answer.pin.blocks))
                    if _no_news(request, answer):
                        self._parked.append((actor, request))
                    else:
                        answers.append((actor, answer))
                case fx.ParentClose(context):
                    try:
                        parent.on_request_finished(context)
                    except Exception:
                        log.exception(
                            "the parent failed to finish %s; a bug in the engine's parent "
                            "(see the traceback)",
                            context,
                            extra=parent_request_context(context, node=self._config.node_id),
                        )
                case _Release(job_id, success):
                    self._quotas.released(job_id)
                    try:
                        parent.release_job(job_id, success=success)
                    except Exception:
                        log.exception(
                            "the parent failed to release job %d; a bug in the engine's "
                            "parent (see the traceback)",
                            job_id,
                            extra=request_context(None, None, node=self._config.node_id),
                        )

    async def _serve_embedded(self, parent: Parent) -> None:
        poll = self._config.timings.pending_poll_interval
        while True:
            with trio.move_on_after(poll if self._parked else math.inf):
                await self._parent_wakeup.wait()
            self._parent_wakeup = trio.Event()
            for actor, answer in self._serve(parent):
                if not await actor.deliver(answer) and answer.pin is not None:
                    self.release_pin(answer.pin.job_id, success=False)

    # --- lifetime -----------------------------------------------------------------

    async def aclose(self) -> None:
        """Close every session (draining them), then the log. Idempotent."""
        self._closing_node = True
        self._waker_stop = True
        self._waker_event.set()
        sessions = [*self._sessions.values(), *self._closing]
        for session in sessions:
            session.close("the node is shutting down")
        for session in sessions:
            await session.wait_closed()
        if self._parent is not None:
            for actor, answer in self._serve(self._parent):
                del actor
                if answer.pin is not None:
                    self._quotas.released(answer.pin.job_id)
                    self._parent.release_job(answer.pin.job_id, success=False)
        self._log.close()


def _wanted(actor: RequestActor, request: fx.ParentLookup) -> bool:
    """Whether the actor still waits for this lookup's answer (any thread)."""
    state = actor.state
    if not isinstance(state, ProducerState):
        return False
    lookup = state.lookups.get(request.lookup_id)
    return lookup is not None and not (lookup.dropped or lookup.answered)


def _no_news(request: fx.ParentLookup, answer: inp.ParentAnswer) -> bool:
    """A re-poll that resolved nothing and has time left: keep it parked."""
    if request.open_context or answer.expired or answer.pin is not None:
        return False
    pending = (LookupResult.HIT_PENDING, LookupResult.RETRY)
    return all(result in pending for _, result in answer.results)


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
        parent: An in-process cache to serve continuously; None when the engine
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
        nursery.start_soon(node._accept_loop)
        nursery.start_soon(node._engine_loop)
        nursery.start_soon(node._reaper)
        if parent is not None:
            nursery.start_soon(node._serve_embedded, parent)
        nursery.start_soon(event_log.flush_periodically)  # returns at once if not needed
        # The dashboard is closed last, so that its subscribers see the node's
        # last events (sessions ending, requests failing) go by.
        async with contextlib.AsyncExitStack() as dashboard:
            try:
                if config.dashboard_port is not None:
                    node._dashboard = await dashboard.enter_async_context(
                        open_timeline_server(
                            node, host=config.dashboard_host, port=config.dashboard_port
                        )
                    )
                if config.metrics_port is not None:
                    node._metrics_server = await dashboard.enter_async_context(
                        open_metrics_server(node, config.metrics_host, config.metrics_port)
                    )
                yield node
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(config.drain_timeout + 5):
                    await node.aclose()
                nursery.cancel_scope.cancel()
