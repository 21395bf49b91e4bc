"""What an engine's threads tell a node about what it holds, and the choices it waits for.

:class:`ThreadSafeSources`, a base of :class:`~p2pactor.runtime.node.Node`
(through its host): an engine that lends its cache (vLLM) tells the node what
its cache came to hold (:meth:`~ThreadSafeSources.holds`, for which request:
:meth:`~ThreadSafeSources.ended`), reused (:meth:`~ThreadSafeSources.touch`),
set aside for loads (:meth:`~ThreadSafeSources.reserve`) or dropped
(:meth:`~ThreadSafeSources.drained`), checks held keys while the cache is lent
(:meth:`~ThreadSafeSources.take_scrub`, :meth:`~ThreadSafeSources.scrubbed`,
:meth:`~ThreadSafeSources.lacks`), and, for a request that names no source,
asks whether any peer claims its first key (:meth:`~ThreadSafeSources.claimed`,
one dict lookup), hands over the choice (:meth:`~ThreadSafeSources.locate_soon`)
and reads it back (:meth:`~ThreadSafeSources.decision`). None of them blocks:
what changes state is handed to the node's thread as a call of the
:class:`~p2pactor.runtime.directory.SourceDirectory` (through the engine
bridge), and applied there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from p2pactor.core import inputs as inp
from p2pactor.core.choice import Choice
from p2pactor.core.sources import fingerprint
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.directory import SourceDirectory
from p2pactor.runtime.engine import EngineBridge

__all__ = ["ThreadSafeSources"]

_OFF = Choice(None, 0, (), "summaries are off (SourceOptions.share)")
_NOBODY = Choice(None, 0, (), "the chosen peer may not be dialed")
_MAX_DECISIONS = 1 << 16  # a bound, not a policy: every request's finish forgets its own


class ThreadSafeSources(EngineBridge):
    """What an engine's threads tell the node about its holdings, and ask of its choices."""

    directory: SourceDirectory

    def holds(
        self,
        keys: Sequence[bytes],
        *,
        request: str | None = None,
        positions: Sequence[int | None] | None = None,
        now: bool = False,
        wake: bool = False,
    ) -> None:
        """The engine's cache now holds ``keys`` (it stored them, or loaded them from a peer).

        An engine whose cache ranks a request's keys by their place in it
        (vLLM's LRU) names the ``request`` and each key's ``positions``; it
        then tells :meth:`ended` when the request ends. With ``now``, the
        peers hear of them at once, not with the next batched delta (another
        engine may ask for them within the step).
        """
        if keys:
            where = None if positions is None else tuple(positions)
            stored = partial(self.directory.holdings.stored, tuple(keys))
            self._change(partial(stored, request=request, positions=where), wake, flush=now)

    def reused(self, keys: Sequence[bytes], request: str, positions: Sequence[int | None]) -> None:
        """The engine's ``request`` reused ``keys`` its cache held (at ``positions`` in it)."""
        if keys:
            where = tuple(positions)
            accessed = partial(self.directory.holdings.accessed, tuple(keys), request, where)
            self._change(lambda _: accessed(), wake=False)

    def ended(self, request: str, *, wake: bool = False) -> None:
        """The engine's ``request`` finished (the one :meth:`holds` named)."""
        finished = self.directory.holdings.finished
        self._change(lambda _: finished(request), wake)

    def touch(self, keys: Sequence[bytes], *, wake: bool = False) -> None:
        """The engine reused ``keys`` (they are its most recent now)."""
        if keys:
            touched = partial(self.directory.holdings.touched, tuple(keys))
            self._change(lambda _: touched(), wake)

    def lacks(self, keys: Sequence[bytes], *, wake: bool = False) -> None:
        """A check with the engine's cache found ``keys`` gone."""
        if keys:
            self._change(partial(self.directory.holdings.gone, tuple(keys)), wake)

    def reserve(self, blocks: int, *, wake: bool = False) -> None:
        """Loads in flight took ``blocks`` of the engine's cache (negative: gave them back).

        vLLM allocates a promotion's chunks before its keys arrive, evicting
        for them: meanwhile the cache holds that many fewer keys, and so does
        the summary (its oldest go). Give them back when the load ends,
        before :meth:`holds` of what it brought.
        """
        if blocks:
            self._change(partial(self.directory.holdings.reserve, blocks), wake)

    def drained(self) -> None:
        """The engine's cache dropped everything: peers hear of a new epoch."""
        self._change(self.directory.drained, wake=True)

    def take_scrub(self) -> list[bytes] | None:
        """Keys to check with the cache now, if any are due (then :meth:`scrubbed`).

        An engine that calls it checks: from then on the node plans batches as
        its cache turns over (:meth:`~p2pactor.core.sources.holdings.Holdings.plan_scrub`).
        """
        directory = self.directory
        directory.checked = True
        try:
            return directory.scrub.popleft()
        except IndexError:
            return None

    def take_frontier(self) -> list[bytes]:
        """The held keys the cache evicts next, to check once it has allocated for its step.

        Ask them right after the cache made room (in vLLM, the step's serve in
        ``on_schedule_end``), then :meth:`scrubbed` the gone ones (and no kept:
        those were only next in line).
        """
        batch, self.directory.frontier = self.directory.frontier, []
        return batch

    def scrubbed(self, gone: Sequence[bytes], kept: Sequence[bytes]) -> None:
        """The answers for a batch of :meth:`take_scrub`: the keys the cache lacks, and holds."""
        checked = partial(self.directory.holdings.scrubbed, tuple(gone), tuple(kept))
        # A claim the parent dropped costs every peer a lookup: tell them now.
        self._change(checked, wake=False, flush=bool(gone), scrub=True)

    def _change(
        self,
        change: Callable[[float], object],
        wake: bool,
        flush: bool = False,
        scrub: bool = False,
    ) -> None:
        """Hand a change of the holdings over (``SourceDirectory.told``), if summaries are on."""
        if self.config.sources.share:
            self._tell((self.directory.told, (change, flush, scrub)), wake=wake)

    def claimed(self, key: bytes) -> bool:
        """Whether any peer's summary claims ``key`` now (one dict lookup)."""
        return self.config.sources.share and self.directory.index.claimed(fingerprint(key))

    def locate_soon(self, kv_request_id: str, keys: Sequence[bytes], *, wake: bool = False) -> None:
        """Choose a source for ``kv_request_id`` (it names none) and ask it about ``keys``.

        The choice appears in :meth:`decision`; from then on the request is
        that peer's, as if named (``lookup_view``, ``submit_load``, ``finish``).
        The engine waits on it: it counts in :meth:`has_pending_work`.
        """
        self._post((self.choose, (kv_request_id, tuple(keys))), wake=wake)

    def decision(self, kv_request_id: str) -> Choice | None:
        """The choice made for ``kv_request_id`` (:meth:`locate_soon`); None until it is.

        Its ``chosen`` peer is asked about its first ``keys`` keys; None: nobody is.
        """
        return self.directory.decisions.get(kv_request_id)

    def choose(
        self, kv_request_id: str, keys: Sequence[bytes]
    ) -> tuple[Choice, RequestActor | None]:
        """Choose a source for ``kv_request_id`` and send it the lookup; publish the choice.

        Returns the choice and the consumer actor asked (None: nobody was).
        """
        directory = self.directory
        choice = directory.choose(keys) if self.config.sources.share else _OFF
        chosen = choice.chosen
        actor = None if chosen is None else self.consumer_for(chosen, kv_request_id)
        if actor is not None:
            asked = tuple(keys[: choice.keys])
            directory.probe_started(actor, choice, asked)
            self.runner.deliver(actor, inp.Register(asked, flush=True, choice=choice))
        # Published after the lookup is registered: an engine that reads the
        # choice finds the request's actor asking already.
        decisions = directory.decisions
        if len(decisions) >= _MAX_DECISIONS:
            del decisions[next(iter(decisions))]
        decisions[kv_request_id] = _NOBODY if actor is None else choice
        return choice, actor
