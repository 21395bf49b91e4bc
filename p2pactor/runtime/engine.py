"""The engine bridge: how engines on their own threads hand work to a node.

vLLM calls its tier synchronously, under its own lock, from the scheduler
thread and its tier-poll thread; those calls must never wait on trio. The
bridge is the thread-safe half of :class:`~p2pactor.runtime.node.Node`: each call
appends to a deque and returns, and the node's thread applies the items in
order. Keys registered for a lookup are applied at the step's ``flush`` as
*one* input per request (register and send), so an engine step costs each
request one actor step.

Waking the node's thread costs the engine's thread: ``run_sync_soon`` writes
to trio's wake-up socket, and that send hands the GIL to the trio thread,
which then runs its whole batch before the engine thread gets it back (~0.5 ms
per ``on_schedule_end``, measured with ``p2pactor bench --only engine``). So
the engine thread only sets a :class:`threading.Event`; a small waker thread
makes the ``run_sync_soon`` call when the engine thread next lets go of the
GIL. Calls made with ``wake=False`` only append: they are picked up at the
next flush or kick (or within ``engine_poll_interval`` while the node's thread
is awake anyway); an idle node's loop sleeps until woken, so it costs nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Sequence
from typing import Protocol

import msgspec
import trio

from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState
from p2pactor.runtime.actor import RequestActor, Runner
from p2pactor.runtime.sources_calls import LocateWanted, SourcesCall

__all__ = ["EngineBridge", "EngineSide", "LoadResult"]


class LoadResult(msgspec.Struct, frozen=True, gc=False):
    """One of the engine's load jobs finished.

    Attributes:
        job_id: The engine's job.
        success: Whether every block arrived.
        reason: Why not, when not.
    """

    job_id: int
    success: bool
    reason: str = ""


# What the engine's threads hand to the node's thread.
class _Register(msgspec.Struct, frozen=True, gc=False):
    peer: str
    kv_request_id: str
    keys: tuple[bytes, ...]


class _Flush(msgspec.Struct, frozen=True, gc=False):
    pass


class _Load(msgspec.Struct, frozen=True, gc=False):
    peer: str
    kv_request_id: str
    job_id: int
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]


class _Finish(msgspec.Struct, frozen=True, gc=False):
    kv_request_id: str


class _Store(msgspec.Struct, frozen=True, gc=False):
    kv_request_id: str
    store: inp.AddStore


class _Dial(msgspec.Struct, frozen=True, gc=False):
    peer: str


class _Answer(msgspec.Struct, frozen=True):  # holds an actor: tracked by the gc
    actor: RequestActor
    answer: inp.ParentAnswer


class _Sources(msgspec.Struct, frozen=True, gc=False):
    call: SourcesCall


_Item = _Register | _Flush | _Load | _Finish | _Store | _Dial | _Answer | _Sources


class EngineSide(Protocol):
    """What the bridge asks of the node, on the node's thread."""

    @property
    def runner(self) -> Runner:
        """Where inputs are stepped."""
        ...

    def consumer_for(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor of (peer, request), created with its session if need be."""

    def known_consumer(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor of (peer, request) if there is one (any thread)."""

    def submit(
        self, actor: RequestActor, job_id: int, keys: tuple[bytes, ...], blocks: tuple[int, ...]
    ) -> None:
        """Start a load on ``actor``."""

    def report_load(self, job_id: int, *, success: bool, reason: str) -> None:
        """Report a load finished."""

    def finish_request(self, kv_request_id: str) -> None:
        """The engine is done with ``kv_request_id`` (both roles)."""

    def store(self, kv_request_id: str, store: inp.AddStore) -> None:
        """Offer stored blocks to the request's producer."""

    def parent_answered(self, actor: RequestActor, answer: inp.ParentAnswer) -> None:
        """Step a lent parent's ``answer`` on ``actor``."""

    def dial(self, peer: str) -> None:
        """Open the session with ``peer`` now."""

    def sources_call(self, call: SourcesCall) -> None:
        """Apply an engine call about what this node holds, or a choice to make."""


class EngineBridge:
    """The thread-safe hand-over from engine threads to the node's thread.

    Args:
        node: The node (its thread-side operations).
        name: For the waker thread's name.
        inbox_limit: Engine calls queued before the node counts as overloaded.
        poll_interval: How soon calls made without waking are picked up.
    """

    def __init__(
        self,
        node: EngineSide,
        *,
        name: str,
        inbox_limit: int,
        poll_interval: float,
    ) -> None:
        self._node = node
        self._inbox_limit = inbox_limit
        self._poll_interval = poll_interval
        self._inbox: deque[_Item] = deque()
        self._lock = threading.Lock()
        self._registered = False
        # Keys handed over per (peer, request) and not yet delivered to its
        # actor: an engine that asks again every step must not flood the node.
        # A key leaves when its actor is given it (from then on the actor's
        # state answers for it, and a key the actor forgets, as a fetch makes
        # it forget its hits, is asked again), so a key is never held here
        # with nothing on its way to the peer. (By kv_request_id, then peer: a
        # finish forgets its request's at once.)
        self._posted: dict[str, dict[str, set[bytes]]] = {}
        # (kv_request_id, peer) whose actor could not be made (no session may
        # be opened: the peer cap, a shutdown): every key of it is a MISS.
        self._unreachable: set[tuple[str, str]] = set()
        # Loads handed over and not yet given to their actor, by (kv_request_id,
        # peer): the fetch closes the round, and the round's other HITs lose
        # their pins with it, but until the actor takes the fetch its state
        # still answers them HIT.
        self._fetching: dict[tuple[str, str], int] = {}
        # Keys applied on the node's thread, waiting for the step's flush; and
        # actors given their keys early (another input of theirs came first),
        # whose flush is still owed.
        self._unflushed: dict[RequestActor, list[bytes]] = {}
        self._dirty: set[RequestActor] = set()
        self._results: deque[LoadResult] = deque()
        # _Sources items posted (engine threads, under the engine's lock) and
        # applied (the node's thread): each counter has one writer at a time.
        self._sources_posted = 0
        self._sources_applied = 0
        self._token = trio.lowlevel.current_trio_token()
        self._trio_thread = threading.get_ident()
        self._wakeup = trio.Event()
        self._wake_pending = False
        self._waker_event = threading.Event()
        self._waker_stop = False
        self._waker = threading.Thread(
            target=self._waker_loop, name=f"p2pactor-waker {name}", daemon=True
        )
        self._waker.start()

    @property
    def backlog(self) -> int:
        """Engine calls handed over and not yet applied."""
        return len(self._inbox)

    @property
    def pending(self) -> int:
        """Of :attr:`backlog`, the calls the engine must keep stepping for.

        What an engine says about its holdings (a store's keys, a check's
        answers), unlike a choice it waits for, needs no step of it: an idle
        engine may stop with those in the inbox. Any thread; a count read
        while the node's thread applies may be one off for that moment.
        """
        sources = self._sources_posted - self._sources_applied
        return max(0, len(self._inbox) - sources)

    @property
    def overloaded(self) -> bool:
        """Whether the inbox is full (new loads fail at once). Any thread."""
        return len(self._inbox) >= self._inbox_limit

    # --- the engine's side (any thread) ---------------------------------------------

    def ask(self, peer: str, kv_request_id: str, keys: Sequence[bytes]) -> None:
        """Hand over the keys of ``keys`` the request's actor does not know yet.

        A key already on its way (handed over, not yet delivered) is not
        handed over again. The state read here may be a step behind the
        node's thread; a key handed over twice because of it is known to the
        actor by the time the second copy arrives, and asks nothing more.
        """
        actor = self._node.known_consumer(peer, kv_request_id)
        state = actor.state if actor is not None else None
        known = state.probes if isinstance(state, ConsumerState) else {}
        with self._lock:
            posted = self._posted.setdefault(kv_request_id, {}).setdefault(peer, set())
            new = tuple(k for k in dict.fromkeys(keys) if k not in known and k not in posted)
            if not new or len(self._inbox) >= self._inbox_limit:
                return
            posted.update(new)
            self._registered = True
        self.post(_Register(peer, kv_request_id, new), wake=False)

    def unreachable(self, peer: str, kv_request_id: str) -> bool:
        """Whether the request's keys could not be asked of ``peer`` (no session). Any thread."""
        return (kv_request_id, peer) in self._unreachable

    def flush(self) -> None:
        """Send what was registered since the last flush (nothing: post nothing)."""
        with self._lock:
            registered, self._registered = self._registered, False
        if registered:
            self.post(_Flush())
        else:
            self.kick()

    def kick(self) -> None:
        """Wake the node's thread if anything was handed over without waking it."""
        if self._inbox:
            self._wake()

    def load(
        self,
        peer: str,
        kv_request_id: str,
        job_id: int,
        keys: Sequence[bytes],
        blocks: Sequence[int],
        *,
        wake: bool,
    ) -> None:
        """Hand over a load job (or fail it at once when overloaded)."""
        if self.overloaded:
            reason = f"the node is overloaded ({len(self._inbox)} engine calls queued)"
            self._results.append(LoadResult(job_id, success=False, reason=reason))
            return
        with self._lock:
            where = (kv_request_id, peer)
            self._fetching[where] = self._fetching.get(where, 0) + 1
        self.post(_Load(peer, kv_request_id, job_id, tuple(keys), tuple(blocks)), wake=wake)

    def fetching(self, peer: str, kv_request_id: str) -> bool:
        """Whether a load of the request is on its way to its actor. Any thread.

        While it is, the actor's HITs are stale: the fetch closes the round.
        """
        return (kv_request_id, peer) in self._fetching

    def finish(self, kv_request_id: str, *, wake: bool) -> None:
        """Hand over the end of a request (its asked keys are forgotten on the node's thread)."""
        self.post(_Finish(kv_request_id), wake=wake)

    def store(self, kv_request_id: str, store: inp.AddStore, *, wake: bool) -> None:
        """Hand over stored blocks of a prefill/decode request."""
        self.post(_Store(kv_request_id, store), wake=wake)

    def dial(self, peer: str, *, wake: bool) -> None:
        """Hand over a request to open a session now."""
        self.post(_Dial(peer), wake=wake)

    def sources(self, call: SourcesCall, *, wake: bool) -> None:
        """Hand over a call about holdings or a choice (:mod:`p2pactor.runtime.directory`)."""
        if not isinstance(call, LocateWanted):  # a choice to make: the engine waits on it
            self._sources_posted += 1
        self.post(_Sources(call), wake=wake)

    def answers(self, answered: Sequence[tuple[RequestActor, inp.ParentAnswer]]) -> None:
        """Hand over a lent parent's answers (one wake-up for the batch)."""
        for actor, answer in answered:
            self.post(_Answer(actor, answer), wake=False)
        if answered:
            self._wake()

    def result(self, result: LoadResult) -> None:
        """A load finished that no task waits for: keep it for :meth:`finished`."""
        self._results.append(result)

    def finished(self) -> list[LoadResult]:
        """Load results since the last call."""
        out = []
        while True:
            try:
                out.append(self._results.popleft())
            except IndexError:
                return out

    def post(self, item: _Item, *, wake: bool = True) -> None:
        """Hand ``item`` to the node's thread: applied now if this is that thread.

        From another thread it is appended, and the node's thread is woken if
        asked; without ``wake`` the caller's next :meth:`flush` or :meth:`kick`
        does it (or, while the node's thread is awake, its poll interval).
        Not waking is the point: the engine's thread pays for a wake-up (a
        lock, a futex, often losing its CPU to the woken thread), and every
        engine step ends in a flush anyway.
        """
        self._inbox.append(item)
        if threading.get_ident() == self._trio_thread:
            self.apply()  # the caller is on the node's thread: no hop, no wait
            return
        if wake:
            self._wake()

    def _wake(self) -> None:
        if threading.get_ident() == self._trio_thread:
            self._wakeup.set()  # on the node's own thread: no hop needed
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
        self._wakeup.set()

    def stop(self) -> None:
        """Stop the waker thread (the node is closing)."""
        self._waker_stop = True
        self._waker_event.set()

    # --- the node's side (its thread) -----------------------------------------------

    async def run(self) -> None:
        """Apply handed-over items as they come, forever."""
        while True:
            if self._inbox:
                # Items came without a wake-up: pick them up within the interval.
                with trio.move_on_after(self._poll_interval):
                    await self._wakeup.wait()
            else:
                await self._wakeup.wait()
            self._wakeup = trio.Event()
            self.apply()

    def apply(self) -> None:
        """Apply every item handed over so far, in order."""
        inbox = self._inbox
        while inbox:
            self._apply(inbox.popleft())

    def _apply(self, item: _Item) -> None:
        node = self._node
        match item:
            case _Register(peer, kv_id, keys):
                actor = node.consumer_for(peer, kv_id)
                if actor is not None:
                    self._unflushed.setdefault(actor, []).extend(keys)
                else:
                    with self._lock:
                        self._unreachable.add((kv_id, peer))
                    self._delivered(peer, kv_id, keys)
            case _Flush():
                unflushed, self._unflushed = self._unflushed, {}
                dirty, self._dirty = self._dirty, set()
                runner = node.runner
                for actor, asked in unflushed.items():
                    runner.deliver(actor, inp.Register(tuple(asked), flush=True))
                    self._delivered(actor.id.peer, actor.id.kv_request_id, asked)
                for actor in dirty.difference(unflushed):
                    runner.deliver(actor, inp.Flush())
            case _Load(peer, kv_id, job_id, keys, blocks):
                actor = node.consumer_for(peer, kv_id)
                if actor is None:
                    node.report_load(job_id, success=False, reason=f"{peer} is not an allowed peer")
                else:
                    self._register_first(actor)
                    node.submit(actor, job_id, keys, blocks)
                with self._lock:
                    where = (kv_id, peer)
                    left = self._fetching.get(where, 1) - 1
                    if left > 0:
                        self._fetching[where] = left
                    else:
                        self._fetching.pop(where, None)
            case _Finish(kv_id):
                with self._lock:
                    self._posted.pop(kv_id, None)
                    if self._unreachable:
                        self._unreachable = {u for u in self._unreachable if u[0] != kv_id}
                for actor in [a for a in self._unflushed if a.id.kv_request_id == kv_id]:
                    self._register_first(actor)
                if self._dirty:
                    self._dirty = {a for a in self._dirty if a.id.kv_request_id != kv_id}
                node.finish_request(kv_id)
            case _Store(kv_id, store):
                node.store(kv_id, store)
            case _Dial(peer):
                node.dial(peer)
            case _Answer(actor, answer):
                node.parent_answered(actor, answer)
            case _Sources(call):
                if not isinstance(call, LocateWanted):
                    self._sources_applied += 1
                node.sources_call(call)

    def _register_first(self, actor: RequestActor) -> None:
        """Keys registered for ``actor`` before another input of its: they come first."""
        keys = self._unflushed.pop(actor, None)
        if keys:
            self._dirty.add(actor)
            self._node.runner.deliver(actor, inp.Register(tuple(keys)))
            self._delivered(actor.id.peer, actor.id.kv_request_id, keys)

    def _delivered(self, peer: str, kv_request_id: str, keys: Sequence[bytes]) -> None:
        """``keys`` reached the request's actor (or never will): no longer on their way."""
        with self._lock:
            posted = self._posted.get(kv_request_id, {}).get(peer)
            if posted:
                posted.difference_update(keys)
