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
  :meth:`Node.submit_store`, and what an engine says of its holdings,
  :meth:`Node.holds` and the others), for engines that step on their own thread
  (vLLM). These never wait on trio: they hand work over through the engine
  bridge (:mod:`p2pactor.runtime.engine`) and read what the node's thread
  already published.

A :class:`Node` is its own host (:class:`~p2pactor.runtime.host.NodeHost`: the
runner and the timer that step actors, the sessions and their accept policy, the
parent service, the store desk, the directory) and its own engine bridge. The
operator surface (metrics, ``/status``, the timeline) attaches from outside
(:mod:`p2pactor.surface.attach`), reading a node and following its streams
(:meth:`~p2pactor.runtime.host.NodeHost.watch_events` and the others).
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
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.host import NodeHost, Waiter
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.parent import Parent
from p2pactor.runtime.quotas import PeerUsage
from p2pactor.runtime.transport import ControlTransport, DataTransport


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


class Node(NodeHost):
    """A p2pactor node. Create it with :func:`open_node`.

    One object: its parts and the streams its operator surface follows are its
    host's (:class:`~p2pactor.runtime.host.NodeHost`), the sync, thread-safe
    calls its engine bridge's (:class:`~p2pactor.runtime.engine.EngineBridge`,
    :class:`~p2pactor.runtime.threadsafe_sources.ThreadSafeSources`); what it
    reads of its state and the async API are here.
    """

    # --- state (read on the node's thread unless said) -----------------------------

    def peer_usage(self, peer: str) -> PeerUsage:
        """What ``peer`` holds on this node now, and what its quotas refused. Any thread."""
        return self.quotas.usage(peer)

    def quota_usage(self) -> dict[str, PeerUsage]:
        """:meth:`peer_usage` of every peer seen so far, by peer id."""
        return self.quotas.usages()

    def now(self) -> float:
        """The node's clock (trio's): session activity times are on it. Any thread."""
        return self.clock.current_time()

    @property
    def uptime(self) -> float:
        """Seconds since the node started. Any thread."""
        return self.clock.current_time() - self.started_at

    def has_transfers_in_flight(self) -> bool:
        """Whether a load of ours or a write of ours is still running. Thread-safe."""
        return any(s.has_transfers_in_flight() for s in self.peers.sessions())

    def has_pending_work(self) -> bool:
        """Whether anything is really outstanding: handshakes, loads, writes, parent work."""
        if self.service.pending or self.engine_pending or self.peers.draining:
            return True
        return any(s.has_pending_work() for s in self.peers.sessions())

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
        self.runner.deliver(actor, inp.Register(tuple(keys), flush=True))
        return await self._answers(actor, keys)

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
        choice, actor = self.choose(kv_request_id, keys)
        if actor is None:
            await trio.lowlevel.checkpoint()
            return Located(peer=None, answers=(LookupResult.MISS,) * len(keys), choice=choice)
        asked = keys[: choice.keys]
        answers = await self._answers(actor, asked)
        rest = (LookupResult.MISS,) * (len(keys) - len(asked))
        return Located(peer=choice.chosen, answers=(*answers, *rest), choice=choice)

    async def _answers(self, actor: RequestActor, keys: Sequence[bytes]) -> list[LookupResult]:
        """Wait until every one of ``keys`` (asked of ``actor``) is answered."""
        waiter = Waiter(keys)
        self.answers.setdefault(actor, []).append(waiter)
        try:
            self.check_answers(actor)  # answered already (known keys, a failed lookup)
            await waiter.ready.wait()
        finally:
            waiting = self.answers[actor]  # only here are waiters added and removed
            waiting.remove(waiter)
            if not waiting:
                del self.answers[actor]
        return probe_answers(actor.state, keys)  # type: ignore[arg-type]

    async def fetch(
        self,
        peer: str,
        kv_request_id: str,
        keys: Sequence[bytes],
        dest_blocks: Sequence[int],
    ) -> FetchResult:
        """Load ``keys`` from ``peer`` into our ``dest_blocks`` and wait for the outcome."""
        job_id = next(self.job_ids)
        waiter = self.loads[job_id] = Waiter()
        try:
            actor = self.consumer_for(peer, kv_request_id)
            if actor is None:
                await trio.lowlevel.checkpoint()
                # The loopback refusal says what to set; the others are the allowlist's.
                why = self.config.dial_refusal(peer) or f"{peer} may not be dialed"
                return FetchResult(success=False, blocks=0, reason=why)
            self.submit(actor, job_id, tuple(keys), tuple(dest_blocks))
            await waiter.ready.wait()
        finally:
            self.loads.pop(job_id, None)
        result = waiter.result
        assert result is not None
        blocks = len(keys) if result.success else 0
        return FetchResult(success=result.success, blocks=blocks, reason=result.reason)

    # --- more of the sync, thread-safe API ------------------------------------------

    def prepare(self, peer: str, *, wake: bool = True) -> None:
        """Open the session with ``peer`` now: its handshake is done when a lookup comes.

        Thread-safe, never blocks; a peer that may not be dialed, or that has
        its session already, is ignored.
        """
        if self.config.may_dial(peer) and self.peers.session(peer) is None:
            self._post((self.dial, (peer,)), wake=wake)

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
        store = inp.AddStore(job_id=job_id, keys=tuple(keys), blocks=tuple(blocks))
        self._post((self.stores.store, (kv_request_id, store)), wake=wake)

    def serve_parent(self, parent: Parent) -> int:
        """Run the parent requests that are waiting, while the engine lends ``parent``.

        Call it from the engine's thread, holding the engine's lock; ``parent``
        is used only during this call and never kept. The answers reach the
        actors on the node's thread, in one batch.

        Returns:
            How many requests were served.
        """
        service = self.service
        if not service.pending:
            return 0  # the tier-poll thread asks every 1 ms: nothing to do is the rule
        answers = service.serve(parent)
        for actor, answer in answers:
            self._post((self.parent_answered, (actor, answer)), wake=False)
        if answers:
            self.kick()
        return len(answers)


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
    async with trio.open_nursery() as nursery:
        node = Node(
            config,
            nursery,
            control=control,
            data=data,
            parent=parent,
            event_log=event_log,
            hash_seed=hash_seed,
        )
        directory = node.directory
        # Peers we may not dial are dropped by the transport itself, before
        # it dials back to the address their frames claim (config.may_dial,
        # and a log line for a peer a loopback-known node cannot serve).
        watch_keys = getattr(parent, "watch_keys", None)
        if watch_keys is not None and config.sources.share:
            # An embedded cache says exactly what it holds: the summary is exact.
            watch_keys(directory.came, directory.went)
        control.accept_only(node.peers.may_accept)
        nursery.start_soon(node.peers.accept, name="accept")
        nursery.start_soon(node.run, name="engine bridge")
        nursery.start_soon(node.timers.run, name="timers")
        if config.sources.share:
            nursery.start_soon(directory.run, name="summaries")
        nursery.start_soon(node.event_log.flush_periodically)  # returns at once if not needed
        for peer in sorted(config.seed_peers):
            node.dial(peer)  # summaries are here before the first request naming no source
        # Added to the run already going, whoever started it (a program's
        # trio.run, the vLLM tier's thread), and removed with the node.
        node.loop_watch.start()
        try:
            yield node
        finally:
            if watch_keys is not None:
                watch_keys(None, None)
            try:
                with trio.CancelScope(shield=True), trio.move_on_after(config.drain_timeout + 5):
                    await node.aclose()
            finally:
                node.loop_watch.stop()  # even if closing failed: the run may go on
            nursery.cancel_scope.cancel()
