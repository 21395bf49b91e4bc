"""The engine bridge: how engines on their own threads hand work to a node.

vLLM calls its tier synchronously, under its own lock, from the scheduler
thread and its tier-poll thread; those calls must never wait on trio.
:class:`EngineBridge`, a base of :class:`~p2pactor.runtime.node.Node`, is what
they call: each reads what the node's thread already published (immutable
actor states, load results) or appends a ``(method, arguments)`` pair to a
deque, and the node's thread applies the pairs in order (at once, when called
on it). Keys registered for a lookup are applied at the step's ``flush`` as
*one* input per request (register and send): one actor step per request.

Calls made with ``wake=False`` only append: they are picked up at the next
flush or kick (or within ``engine_poll_interval`` while the node's thread is
awake anyway); an idle node sleeps until woken (:mod:`p2pactor.runtime.wakeup`).
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any, final

import attrs
import msgspec

from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState, probe_answers
from p2pactor.core.inputs import LookupResult
from p2pactor.runtime.actor import RequestActor, Runner
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.wakeup import Wakeup

RETRY = LookupResult.RETRY
_Call = tuple[Callable[..., object], tuple[Any, ...]]


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


@final
@attrs.define
class LookupView:
    """A request's lookup answers as of one moment (:meth:`EngineBridge.lookup_view`).

    Attributes:
        state: The request's consumer state then; None when it had no actor.
        absent: The answer for every key when ``state`` is None: RETRY while
            the actor is being made, MISS when it never will be.
        fetching: A load of the request was on its way to its actor: its
            HITs are stale (the fetch closes the round), so they are RETRY.
    """

    _state: ConsumerState | None
    _absent: LookupResult = LookupResult.MISS
    _fetching: bool = False

    def answer(self, key: bytes) -> LookupResult:
        """HIT, MISS or RETRY for ``key``, as the request stood when the view was taken."""
        return self.answers((key,))[0]

    def answers(self, keys: Sequence[bytes]) -> list[LookupResult]:
        """:meth:`answer` for every key of ``keys``, the request-wide checks made once."""
        if self._state is None:
            return [self._absent] * len(keys)
        answers = probe_answers(self._state, keys)
        if self._fetching:
            # The engine has fetched this round (the hand-over is on its way):
            # a HIT it did not fetch loses its pin with the round. Ask again.
            return [RETRY if a is LookupResult.HIT else a for a in answers]
        return answers


_NO_ACTOR = LookupView(None)
_NO_ACTOR_YET = LookupView(None, RETRY)


class EngineBridge:
    """The sync, thread-safe half of a node: what engines on their own threads call.

    None of its methods blocks; each is safe from any thread. The node's thread
    runs :meth:`run`, which applies what was handed over.

    Args:
        config: The node's configuration (its ``engine_inbox``: engine calls
            queued before the node counts as overloaded; its
            ``engine_poll_interval``: how soon calls made without waking are
            picked up).
    """

    runner: Runner
    # What the node's host provides (:class:`~p2pactor.runtime.host.NodeHost`).
    known_consumer: Callable[[str, str], RequestActor | None]
    consumer_for: Callable[[str, str], RequestActor | None]
    submit: Callable[[RequestActor, int, tuple[bytes, ...], tuple[int, ...]], None]
    finish_request: Callable[[str], None]
    report_load: Callable[..., None]

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self._inbox: deque[_Call] = deque()
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
        self._fetching: Counter[tuple[str, str]] = Counter()
        # Keys applied on the node's thread, waiting for the step's flush; and
        # actors given their keys early (another input of theirs came first),
        # whose flush is still owed.
        self._unflushed: dict[RequestActor, list[bytes]] = {}
        self._dirty: set[RequestActor] = set()
        self._results: deque[LoadResult] = deque()
        # Calls about holdings posted (engine threads, under the engine's lock)
        # and applied (the node's thread): each counter has one writer at a time.
        self._told_posted = 0
        self._told_applied = 0
        self._wakeup = Wakeup(config.node_id)

    @property
    def engine_backlog(self) -> int:
        """Engine calls handed over and not yet applied (bounded by ``engine_inbox``)."""
        return len(self._inbox)

    @property
    def engine_pending(self) -> int:
        """Of :attr:`engine_backlog`, the calls the engine must keep stepping for.

        What an engine says about its holdings, unlike a choice it waits for,
        needs no step of it: an idle engine may stop with those in the inbox.
        A count read while the node's thread applies may be one off then.
        """
        return max(0, len(self._inbox) - (self._told_posted - self._told_applied))

    # --- lookups and loads (any thread) ----------------------------------------------

    def register_lookup(
        self, peer: str, kv_request_id: str, keys: Sequence[bytes]
    ) -> list[LookupResult]:
        """Answer what is known about ``keys`` now; ask the peer about the rest.

        Returns HIT or MISS for keys already answered and RETRY for keys still
        being asked (newly registered keys go out at the next :meth:`flush`).
        """
        answers = self.lookup_view(peer, kv_request_id).answers(keys)
        self.ask(peer, kv_request_id, [k for k, a in zip(keys, answers, strict=True) if a is RETRY])
        return answers

    def lookup_view(self, peer: str, kv_request_id: str) -> LookupView:
        """What is known about the request's keys now, as one snapshot, asking nothing.

        HIT or MISS for keys answered; RETRY for keys being asked or never
        asked (see :meth:`ask`); MISS for everything when ``peer`` may not be
        dialed, no session with it could be opened, or the request's lookup
        failed: at this moment, whatever the node's thread does meanwhile.
        An engine that asks key by key and acts on each answer (vLLM
        promotes a HIT as soon as it hears it, and scans on past a RETRY)
        asks one view per scan: an answer landing mid-scan
        would otherwise make it fetch the run's tail without its head, and
        the head (unpinned with the round) would need a round of its own.
        """
        if not self.config.may_dial(peer):
            return _NO_ACTOR
        actor = self.known_consumer(peer, kv_request_id)
        if actor is None:
            return _NO_ACTOR if (kv_request_id, peer) in self._unreachable else _NO_ACTOR_YET
        state = actor.state
        assert isinstance(state, ConsumerState)
        return LookupView(state, RETRY, (kv_request_id, peer) in self._fetching)

    def ask(self, peer: str, kv_request_id: str, keys: Sequence[bytes]) -> None:
        """Ask ``peer`` about the ``keys`` not known yet, at the next :meth:`flush`.

        A key is handed to the node's thread once, however often the engine
        asks about it before the answer comes: an engine that re-asks every
        step must not flood the node (and the node must not fall behind). The
        state read here may be a step behind the node's thread; a key handed
        over twice because of it is known to the actor by the time the second
        copy arrives, and asks nothing more.
        """
        if not keys or not self.config.may_dial(peer):
            return
        actor = self.known_consumer(peer, kv_request_id)
        state = actor.state if actor is not None else None
        known = state.probes if isinstance(state, ConsumerState) else {}
        with self._lock:
            posted = self._posted.setdefault(kv_request_id, {}).setdefault(peer, set())
            new = tuple(k for k in dict.fromkeys(keys) if k not in known and k not in posted)
            if not new or len(self._inbox) >= self.config.engine_inbox:
                return
            posted.update(new)
            self._registered = True
        self._post((self._register, (peer, kv_request_id, new)), wake=False)

    def flush(self) -> None:
        """Send the lookups of every request that registered new keys.

        A step that registered nothing posts nothing: an idle engine must not
        look busy to ``has_pending_work``.
        """
        with self._lock:
            registered, self._registered = self._registered, False
        if registered:
            self._post((self._flush, ()), wake=True)
        else:
            self.kick()

    def kick(self) -> None:
        """Wake the node's thread if anything was handed over without waking it.

        Engines that batch (``wake=False`` on the calls of a step) call this, or
        :meth:`flush`, once per step: one wake-up instead of one per call.
        """
        if self._inbox:
            self._wakeup.set()

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

        The result arrives in :meth:`finished_jobs` (at once, failed, when the
        node is overloaded); with ``wake=False`` the node's thread picks it up
        at the next :meth:`flush` or :meth:`kick`.
        """
        if len(self._inbox) >= self.config.engine_inbox:
            reason = f"the node is overloaded ({len(self._inbox)} engine calls queued)"
            self._results.append(LoadResult(job_id, success=False, reason=reason))
            return
        with self._lock:
            self._fetching[kv_request_id, peer] += 1
        load = (peer, kv_request_id, job_id, tuple(keys), tuple(dest_blocks))
        self._post((self._load, load), wake=wake)

    def finish(self, kv_request_id: str, *, wake: bool = True) -> None:
        """The engine is done with ``kv_request_id`` (either role)."""
        self._post((self._finish, (kv_request_id,)), wake=wake)

    def finished_jobs(self) -> list[LoadResult]:
        """Load results since the last call."""
        out = []
        while True:
            try:
                out.append(self._results.popleft())
            except IndexError:
                return out

    def _post(self, call: _Call, *, wake: bool) -> None:
        """Hand ``call`` to the node's thread: applied now if this is that thread.

        From another thread it is appended, and the node's thread is woken if
        asked; without ``wake`` the caller's next :meth:`flush` or :meth:`kick`
        does it. Not waking is the point: the engine's thread pays for a
        wake-up, and every engine step ends in a flush anyway.
        """
        self._inbox.append(call)
        if threading.get_ident() == self._wakeup.trio_thread:
            self._apply()  # the caller is on the node's thread: no hop, no wait
        elif wake:
            self._wakeup.set()

    def _tell(self, call: _Call, *, wake: bool) -> None:
        """:meth:`_post` a call about holdings (not counted in :attr:`engine_pending`)."""
        self._told_posted += 1
        self._post((self._told, call), wake=wake)

    # --- the node's thread -----------------------------------------------------------

    async def run(self) -> None:
        """Apply handed-over calls as they come, forever."""
        while True:
            # Calls that came without a wake-up are picked up within the interval.
            await self._wakeup.wait(self.config.engine_poll_interval if self._inbox else math.inf)
            self._apply()

    def _apply(self) -> None:
        inbox = self._inbox
        while inbox:
            method, args = inbox.popleft()
            method(*args)

    def _told(self, method: Callable[..., object], args: tuple[Any, ...]) -> None:
        self._told_applied += 1
        method(*args)

    def _register(self, peer: str, kv_id: str, keys: tuple[bytes, ...]) -> None:
        actor = self.consumer_for(peer, kv_id)
        if actor is not None:
            self._unflushed.setdefault(actor, []).extend(keys)
        else:
            with self._lock:
                self._unreachable.add((kv_id, peer))
            self._delivered(peer, kv_id, keys)

    def _flush(self) -> None:
        unflushed, self._unflushed = self._unflushed, {}
        dirty, self._dirty = self._dirty, set()
        deliver = self.runner.deliver
        for actor, asked in unflushed.items():
            deliver(actor, inp.Register(tuple(asked), flush=True))
            self._delivered(actor.id.peer, actor.id.kv_request_id, asked)
        for actor in dirty.difference(unflushed):
            deliver(actor, inp.Flush())

    def _load(
        self, peer: str, kv_id: str, job_id: int, keys: tuple[bytes, ...], blocks: tuple[int, ...]
    ) -> None:
        actor = self.consumer_for(peer, kv_id)
        if actor is None:
            self.report_load(job_id, success=False, reason=f"{peer} is not an allowed peer")
        else:
            self._register_first(actor)
            self.submit(actor, job_id, keys, blocks)
        with self._lock:  # never 0 while present: lookup_view reads it without the lock
            if self._fetching[kv_id, peer] > 1:
                self._fetching[kv_id, peer] -= 1
            else:
                del self._fetching[kv_id, peer]

    def _finish(self, kv_id: str) -> None:
        with self._lock:
            self._posted.pop(kv_id, None)
            if self._unreachable:
                self._unreachable = {u for u in self._unreachable if u[0] != kv_id}
        for actor in [a for a in self._unflushed if a.id.kv_request_id == kv_id]:
            self._register_first(actor)
        if self._dirty:
            self._dirty = {a for a in self._dirty if a.id.kv_request_id != kv_id}
        self.finish_request(kv_id)

    def _register_first(self, actor: RequestActor) -> None:
        """Keys registered for ``actor`` before another input of its: they come first."""
        keys = self._unflushed.pop(actor, None)
        if keys:
            self._dirty.add(actor)
            self.runner.deliver(actor, inp.Register(tuple(keys)))
            self._delivered(actor.id.peer, actor.id.kv_request_id, keys)

    def _delivered(self, peer: str, kv_request_id: str, keys: Sequence[bytes]) -> None:
        """``keys`` reached the request's actor (or never will): no longer on their way."""
        with self._lock:
            posted = self._posted.get(kv_request_id, {}).get(peer)
            if posted:
                posted.difference_update(keys)
