"""The thread-safe half of :class:`~p2pactor.runtime.node.Node`.

What engines on their own threads call.

vLLM steps on its own threads and must never wait on trio. These methods hand
work to the node's thread through the engine bridge (:mod:`p2pactor.runtime.engine`)
and read only what that thread has already published (immutable actor states,
load results); none of them blocks. Each is safe from any thread; called on
the node's own thread, the hand-over is applied at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerState, probe_answer, probe_answers
from p2pactor.core.inputs import LookupResult
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.engine import EngineBridge, LoadResult
from p2pactor.runtime.parent import Parent
from p2pactor.runtime.serving import ParentService

__all__ = ["LookupView", "ThreadSafeAPI"]

RETRY = LookupResult.RETRY


@final
class LookupView:
    """A request's lookup answers as of one moment (:meth:`ThreadSafeAPI.lookup_view`).

    Args:
        state: The request's consumer state then; None when it had no actor.
        fetching: A load of the request was on its way to its actor: its
            HITs are stale (the fetch closes the round), so they are RETRY.
        absent: The answer for every key when ``state`` is None: RETRY while
            the actor is being made, MISS when it never will be.
    """

    __slots__ = ("_absent", "_fetching", "_state")

    def __init__(
        self,
        state: ConsumerState | None,
        *,
        fetching: bool = False,
        absent: LookupResult = LookupResult.MISS,
    ) -> None:
        self._state = state
        self._fetching = fetching
        self._absent = absent

    def answer(self, key: bytes) -> LookupResult:
        """HIT, MISS or RETRY for ``key``, as the request stood when the view was taken."""
        state = self._state
        if state is None:
            return self._absent
        answer = probe_answer(state, key)
        if answer is LookupResult.HIT and self._fetching:
            # The engine has fetched this round (the hand-over is on its way):
            # a HIT it did not fetch loses its pin with the round. Ask again.
            return RETRY
        return answer


class ThreadSafeAPI:
    """The sync, thread-safe methods of a node (a base class of :class:`Node`)."""

    _config: NodeConfig
    _bridge: EngineBridge
    _service: ParentService

    def known_consumer(self, peer: str, kv_request_id: str) -> RequestActor | None:
        """The consumer actor of (peer, request), if there is one. Any thread."""
        raise NotImplementedError

    def _has_session(self, peer: str) -> bool:
        """Whether ``peer`` has a live session (read from any thread)."""
        raise NotImplementedError

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
        dialed, no session with it could be opened, or the request's lookup
        failed.
        """
        if not self._config.may_dial(peer):
            return [LookupResult.MISS] * len(keys)
        actor = self.known_consumer(peer, kv_request_id)
        if actor is None:
            unreachable = self._bridge.unreachable(peer, kv_request_id)
            return [LookupResult.MISS if unreachable else RETRY] * len(keys)
        state = actor.state
        assert isinstance(state, ConsumerState)
        answers = probe_answers(state, keys)
        if self._bridge.fetching(peer, kv_request_id):  # see peek_key
            return [RETRY if a is LookupResult.HIT else a for a in answers]
        return answers

    def peek_key(self, peer: str, kv_request_id: str, key: bytes) -> LookupResult:
        """:meth:`peek_lookup` of one key, without the lists (vLLM asks key by key)."""
        return self.lookup_view(peer, kv_request_id).answer(key)

    def lookup_view(self, peer: str, kv_request_id: str) -> LookupView:
        """What is known about the request's keys now, as one snapshot. Thread-safe.

        Its answers are those of :meth:`peek_key` at this moment, whatever the
        node's thread does meanwhile. An engine that asks key by key and acts
        on each answer (vLLM promotes a HIT as soon as it hears it, and scans
        on past a RETRY) asks one view per scan: an answer landing mid-scan
        would otherwise make it fetch the run's tail without its head, and
        the head (unpinned with the round) would need a round of its own.
        """
        if not self._config.may_dial(peer):
            return LookupView(None)
        actor = self.known_consumer(peer, kv_request_id)
        if actor is None:
            unreachable = self._bridge.unreachable(peer, kv_request_id)
            return LookupView(None, absent=LookupResult.MISS if unreachable else RETRY)
        state = actor.state
        assert isinstance(state, ConsumerState)
        return LookupView(state, fetching=self._bridge.fetching(peer, kv_request_id))

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

        Thread-safe, never blocks; a peer that may not be dialed, or that has
        its session already, is ignored.
        """
        if self._config.may_dial(peer) and not self._has_session(peer):
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
        store = inp.AddStore(job_id=job_id, keys=tuple(keys), blocks=tuple(blocks))
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
        service = self._service
        if not service.pending:
            return 0  # the tier-poll thread asks every 1 ms: nothing to do is the rule
        answers = service.serve(parent)
        self._bridge.answers(answers)
        return len(answers)
