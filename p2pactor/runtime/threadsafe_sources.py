"""The thread-safe calls an engine makes about what it holds and where to look.

A base of :class:`~p2pactor.runtime.node.Node`, beside
:class:`~p2pactor.runtime.threadsafe.ThreadSafeAPI`. An engine that lends its
cache (vLLM) tells the node what its cache came to hold (:meth:`holds`, for
which request: :meth:`ended`), reused (:meth:`touch`), set aside for loads
(:meth:`reserve`) or dropped (:meth:`drained`), checks held keys while the
cache is lent (:meth:`take_scrub`, :meth:`scrubbed`, :meth:`lacks`), and,
for a request that names no source, asks whether any peer claims its first
key (:meth:`claimed`, one dict lookup), hands over the choice
(:meth:`locate_soon`) and reads it back (:meth:`decision`). None of them
blocks; what changes state is applied on the node's thread.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2pactor.core.sources import fingerprint
from p2pactor.runtime.directory import SourceDirectory
from p2pactor.runtime.engine import EngineBridge
from p2pactor.runtime.sources_calls import (
    Decision,
    Drained,
    Ended,
    Held,
    Lacking,
    LocateWanted,
    Reserved,
    Reused,
    Scrubbed,
    Touched,
)


class ThreadSafeSources:
    """What an engine's threads tell the node about its holdings, and ask of its choices."""

    _bridge: EngineBridge
    _directory: SourceDirectory

    @property
    def shares_summaries(self) -> bool:
        """Whether this node exchanges summaries (``SourceOptions.share``). Any thread."""
        return self._directory.enabled

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
        if keys and self._directory.enabled:
            where = None if positions is None else tuple(positions)
            self._bridge.sources(Held(tuple(keys), request, where, now), wake=wake)

    def reused(self, keys: Sequence[bytes], request: str, positions: Sequence[int | None]) -> None:
        """The engine's ``request`` reused ``keys`` its cache held (at ``positions`` in it)."""
        if keys and self._directory.enabled:
            self._bridge.sources(Reused(tuple(keys), request, tuple(positions)), wake=False)

    def ended(self, request: str, *, wake: bool = False) -> None:
        """The engine's ``request`` finished (the one :meth:`holds` named)."""
        if self._directory.enabled:
            self._bridge.sources(Ended(request), wake=wake)

    def touch(self, keys: Sequence[bytes], *, wake: bool = False) -> None:
        """The engine reused ``keys`` (they are its most recent now)."""
        if keys and self._directory.enabled:
            self._bridge.sources(Touched(tuple(keys)), wake=wake)

    def lacks(self, keys: Sequence[bytes], *, wake: bool = False) -> None:
        """A check with the engine's cache found ``keys`` gone."""
        if keys and self._directory.enabled:
            self._bridge.sources(Lacking(tuple(keys)), wake=wake)

    def reserve(self, blocks: int, *, wake: bool = False) -> None:
        """Loads in flight took ``blocks`` of the engine's cache (negative: gave them back).

        vLLM allocates a promotion's chunks before its keys arrive, evicting
        for them: meanwhile the cache holds that many fewer keys, and so does
        the summary (its oldest go). Give them back when the load ends,
        before :meth:`holds` of what it brought.
        """
        if blocks and self._directory.enabled:
            self._bridge.sources(Reserved(blocks), wake=wake)

    def drained(self) -> None:
        """The engine's cache dropped everything: peers hear of a new epoch."""
        if self._directory.enabled:
            self._bridge.sources(Drained(), wake=True)

    def take_scrub(self) -> list[bytes] | None:
        """Keys to check with the cache now, if any are due (then :meth:`scrubbed`).

        An engine that calls it checks: from then on the node plans batches as
        its cache turns over (:meth:`~p2pactor.core.holdings.Holdings.plan_scrub`).
        """
        directory = self._directory
        directory.checked = True
        try:
            return directory.scrubs.popleft()
        except IndexError:
            return None

    def take_frontier(self) -> list[bytes]:
        """The held keys the cache evicts next, to check once it has allocated for its step.

        Ask them right after the cache made room (in vLLM, the step's serve in
        ``on_schedule_end``), then :meth:`scrubbed` the gone ones (and no kept:
        those were only next in line).
        """
        directory = self._directory
        batch, directory.frontier = directory.frontier, []
        return batch

    def scrubbed(self, gone: Sequence[bytes], kept: Sequence[bytes]) -> None:
        """The answers for a batch of :meth:`take_scrub`: the keys the cache lacks, and holds."""
        if self._directory.enabled:
            self._bridge.sources(Scrubbed(tuple(gone), tuple(kept)), wake=False)

    def claimed(self, key: bytes) -> bool:
        """Whether any peer's summary claims ``key`` now (one dict lookup)."""
        directory = self._directory
        return directory.enabled and directory.index.claimed(fingerprint(key))

    def locate_soon(self, kv_request_id: str, keys: Sequence[bytes], *, wake: bool = False) -> None:
        """Choose a source for ``kv_request_id`` (it names none) and ask it about ``keys``.

        The choice appears in :meth:`decision`; from then on the request is
        that peer's, as if named (``peek_key``, ``submit_load``, ``finish``).
        """
        self._bridge.sources(LocateWanted(kv_request_id, tuple(keys)), wake=wake)

    def decision(self, kv_request_id: str) -> Decision | None:
        """The choice made for ``kv_request_id`` (:meth:`locate_soon`); None until it is."""
        return self._directory.decision(kv_request_id)
