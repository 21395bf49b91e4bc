"""A mirror of a parent's CPU tier: what it holds, in the order its LRU evicts.

A secondary tier never hears of an eviction from its parent (vLLM 0.33.0
cascades stores to every tier, and nothing else). So :class:`Mirror` keeps
what the parent holds from what the tier does see, in the order the parent's
LRU keeps it, and evicts as that LRU would when the tier is full.

vLLM's LRU (``cpu/policies/lru.py``) is not plain recency. A chunk a request
stores or loads takes the rank ``(the request's rank, -its position)``, so
within a request the tail ranks below the head; when the request finishes,
its chunks are ranked afresh tail first, so that its head is the most
recent. A full tier therefore evicts a prompt's **tail first** and keeps its
head. The mirror ranks the same way from what the tier sees: the stores
cascaded to it and its own loads, each with the request and the positions
vLLM records on the request (:meth:`Mirror.stored`), the keys a request
reuses of what the tier held (:meth:`Mirror.accessed`: vLLM asks a tier only
past them), and the end of each request (:meth:`Mirror.finished`). Keys the
parent has pinned for a peer are passed over, as its LRU passes them over.

Checks with the parent keep it honest where it cannot see (another tier's
promotions evict too; a ranking it got wrong):
:meth:`~p2pactor.core.sources.holdings.Holdings.plan_scrub` offers what it
would evict next, and what it dropped for room that the parent may still
hold, as often as the tier turns over; :meth:`Mirror.frontier`, the very
next to go, to ask right after the parent allocated. The answers come back
as :meth:`Mirror.gone` and :meth:`Mirror.kept`.

Pure, like the rest of the core: ``now`` is an argument. What changes is
reported to :meth:`Mirror._changed`, which
:class:`~p2pactor.core.sources.holdings.Holdings` turns into the summary it
tells its peers.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from p2pactor.core.sources.holdings import SummaryOptions

_Rank = tuple[int, int]
_MAX_REQUESTS = 4096  # requests whose keys are kept for their finish; older ones lose it
_SUSPECTS = 4096  # keys dropped for room that the parent may still hold, to check


class Mirror:
    """What a parent holds, in its LRU's order; the checks that keep it so.

    Args:
        capacity: The most keys the parent's tier can hold (its blocks).
        options: Its ``scrub_*`` fields pace the checks.
    """

    def __init__(self, capacity: int, options: SummaryOptions) -> None:
        self.capacity = capacity
        self.options = options
        # key -> its rank (lowest evicted first); the heap holds (rank, key)
        # entries, some stale (the key moved or went): skipped when popped.
        self._ranks: dict[bytes, _Rank] = {}
        self._heap: list[tuple[_Rank, bytes]] = []
        self._next_rank = 0
        # Requests' ranks, and the keys each stored or loaded (key -> position),
        # for its finish; oldest first.
        self._requests: OrderedDict[str, tuple[int, dict[bytes, int]]] = OrderedDict()
        # Keys dropped for room that the parent may still hold (their ranks), to check.
        self._suspects: OrderedDict[bytes, _Rank] = OrderedDict()
        # Keys a check found held: key -> the churn count then. Not checked
        # again, and those the mirror had dropped (it was wrong) not evicted
        # either, until the tier turned over a quarter since.
        self._checked: dict[bytes, int] = {}
        self._verified: dict[bytes, int] = {}
        self._churned = 0  # keys that came to be held, ever
        self._since_frontier = 0  # _churned at the last frontier()
        # Keys the parent cannot evict: pinned for a peer's fetch (by job).
        self._pins: dict[int, tuple[bytes, ...]] = {}
        self._pinned: Counter[bytes] = Counter()
        self._reserved = 0  # the parent's blocks taken by loads in flight
        self._churn = 0  # keys that came to be held since the last scrub
        self._changed_at: float | None = None  # the last change

    def _changed(self, key: bytes, now: float, *, held: bool) -> None:
        """``key`` came to be held, or stopped: the subclass tells whom it concerns."""

    def clear(self) -> None:
        """The parent dropped everything (its cache was reset)."""
        for part in (self._ranks, self._requests, self._suspects, self._checked, self._verified):
            part.clear()
        self._pins = {}
        self._pinned = Counter()
        self._heap = []
        self._churn = 0
        self._changed_at = None
        self._since_frontier = self._churned

    def __len__(self) -> int:
        """Keys held."""
        return len(self._ranks)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held."""
        return key in self._ranks

    @property
    def churn(self) -> int:
        """Keys that came to be held since the last :meth:`scrub` (what the parent evicted for)."""
        return self._churn

    def stored(
        self,
        keys: Iterable[bytes],
        now: float,
        *,
        request: str | None = None,
        positions: Sequence[int | None] | None = None,
    ) -> None:
        """The parent now holds ``keys`` (a store, or a load of ours).

        With ``request`` and each key's ``positions`` (vLLM's end-token
        positions on the request), a key ranks as vLLM's LRU ranks it: under
        the request, tail below head, until :meth:`finished`. Without them,
        each key is the most recent, the last one most of all.
        """
        if request is None:
            for key in keys:
                self._rank_afresh(key, now)
        else:
            keys = list(keys)
            self._under(request, keys, positions or [None] * len(keys), now)
        self._fit(now)

    def accessed(
        self, keys: Sequence[bytes], request: str, positions: Sequence[int | None]
    ) -> None:
        """``request`` used ``keys`` the parent held (reused them): ranked as its own until it ends.

        What vLLM's LRU does for a chunk a request loads from the CPU tier.
        Keys not held are passed over (the parent did not have them either).
        """
        self._under(request, keys, positions, None)

    def _under(
        self, request: str, keys: Sequence[bytes], at: Sequence[int | None], now: float | None
    ) -> None:
        """Rank ``keys`` under ``request`` at their positions ``at``; with ``now``, a store.

        A store holds the keys not held yet, and ranks afresh one with no
        position; otherwise (reused) both are passed over.
        """
        ranks = self._ranks
        rank_of, seen = self._request(request)
        for key, position in zip(keys, at, strict=True):
            if position is None or (now is None and key not in ranks):
                if now is not None:
                    self._rank_afresh(key, now)
                continue
            seen[key] = position
            rank = (rank_of, -position)
            old = ranks.get(key)
            if old is None and now is not None:
                self._add(key, rank, now)
            elif old is not None and rank > old:  # vLLM's on_request_access: it only moves up
                self._set(key, rank)

    def finished(self, request: str) -> None:
        """``request`` ended: its keys are the most recent, its head most of all.

        vLLM's LRU ranks a finished request's keys afresh, tail first.
        """
        entry = self._requests.pop(request, None)
        if entry is not None:
            seen = entry[1]
            self.touched(sorted(seen, key=seen.__getitem__, reverse=True))

    def touched(self, keys: Iterable[bytes]) -> None:
        """The engine reused ``keys``: they are the most recent now, the last one most of all."""
        ranks = self._ranks
        for key in keys:
            if key in ranks:
                self._set(key, self._fresh())

    def kept(self, keys: Iterable[bytes], now: float) -> None:
        """A check found ``keys`` still in the parent.

        A held key stays as it ranks (the lowest are held until the parent
        needs their room) and is not asked about again until the tier has
        turned over a quarter of its capacity (16 keys at least). A key the
        mirror dropped for room (a suspect) was not evicted after all: it
        comes back, where it ranked, and is not dropped again for as long;
        the lowest other key leaves in its place (the parent evicted another).
        """
        suspects, stamp = self._suspects, self._churned
        for key in keys:
            if key in self._ranks:
                self._checked[key] = stamp
            elif key in suspects:
                self._add(key, suspects.pop(key), now, churn=False)
                self._checked[key] = self._verified[key] = stamp
        self._fit(now)

    def _fresh_in(self, marks: dict[bytes, int], key: bytes) -> bool:
        """Whether ``key``'s mark in ``marks`` still holds (it expires with the churn)."""
        stamp = marks.get(key)
        if stamp is not None and self._churned - stamp >= max(16, self.capacity // 4):
            del marks[key]
            stamp = None
        return stamp is not None

    def pinned(self, job: int, keys: Sequence[bytes]) -> None:
        """The parent pinned ``keys`` for a peer's fetch (job ``job``): it evicts others first."""
        self._pins[job] = tuple(keys)
        self._pinned.update(keys)

    def released(self, job: int, now: float) -> None:
        """The pin ``job`` was released: its keys may be evicted again."""
        pinned = self._pinned
        for key in self._pins.pop(job, ()):
            pinned[key] -= 1
            if pinned[key] <= 0:
                del pinned[key]
        self._fit(now)

    def reserve(self, blocks: int, now: float) -> None:
        """Loads in flight took ``blocks`` more of the parent's blocks (negative: gave back).

        The parent evicts for a load before its keys arrive (vLLM allocates a
        promotion's chunks up front), so while loads are in flight the parent
        holds that many fewer keys: the lowest ranked go from the summary too.
        """
        self._reserved = max(0, self._reserved + blocks)
        self._fit(now)

    @property
    def room(self) -> int:
        """Keys the parent can hold now: its capacity less the blocks loads took."""
        return max(0, self.capacity - self._reserved)

    def gone(self, keys: Iterable[bytes], now: float) -> None:
        """The parent no longer holds ``keys`` (a MISS we answered, a failed check)."""
        for key in keys:
            self._suspects.pop(key, None)
            self._drop(key, now)
        self._compact()

    def scrub(self, most: int) -> list[bytes]:
        """Up to ``most`` keys to check with the parent: what it would lose next, first.

        A third at most are suspects (dropped for room, perhaps still held);
        then the held keys the mirror would evict next that no check found
        held lately (each answer moves the key: :meth:`gone`, :meth:`kept`);
        if those run short, the very next to go, checked or not (the parent
        may evict them unseen: another tier's promotion).
        """
        self._churn = 0
        suspects = list(itertools.islice(self._suspects, max(1, most // 3))) if most > 0 else []
        out = suspects + self._lowest(most - len(suspects))
        if len(out) < most:
            listed = set(out)
            more = self._lowest(most, checked=True)
            out += [k for k in more if k not in listed][: most - len(out)]
        return out

    def frontier(self) -> list[bytes]:
        """The held keys the parent evicts next, to check right after it made room.

        As many as twice what came to be held since the last call (what the
        parent evicted room for lately), 16 at least, ``scrub_most`` at most:
        the lowest ranked that are not pinned, checked or not. Ask them while
        the parent has just allocated for its step's stores (vLLM's
        ``on_schedule_end``), and a key it evicted leaves the peers' claims
        before the step's forward pass is over.
        """
        since, self._since_frontier = self._since_frontier, self._churned
        n = min(self.options.scrub_most, max(16, 2 * (self._churned - since)))
        return self._lowest(n, checked=True)

    def _lowest(self, n: int, *, checked: bool = False) -> list[bytes]:
        """The ``n`` lowest-ranked held keys, lowest first (the heap is left as it was).

        Pinned keys are held (nothing to ask); so, unless ``checked``, are keys
        a check found held lately.
        """
        heap, ranks = self._heap, self._ranks
        taken: list[tuple[_Rank, bytes]] = []
        out: dict[bytes, None] = {}
        pinned = self._pinned
        while heap and len(out) < n and len(taken) < 4 * n + 64:
            entry = heapq.heappop(heap)
            rank, key = entry
            if ranks.get(key) != rank or key in out:
                continue  # stale (dropped for good), or a key back at its old rank
            taken.append(entry)
            if key not in pinned and (checked or not self._fresh_in(self._checked, key)):
                out[key] = None
        for entry in taken:
            heapq.heappush(heap, entry)
        return list(out)

    def _fresh(self) -> _Rank:
        self._next_rank += 1
        return (self._next_rank, 0)

    def _request(self, request: str) -> tuple[int, dict[bytes, int]]:
        entry = self._requests.get(request)
        if entry is None:
            self._next_rank += 1
            entry = (self._next_rank, {})
            self._requests[request] = entry
            if len(self._requests) > _MAX_REQUESTS:
                self._requests.popitem(last=False)  # never finished (lost): forget it
        return entry

    def _rank_afresh(self, key: bytes, now: float) -> None:
        if key in self._ranks:
            self._set(key, self._fresh())
        else:
            self._add(key, self._fresh(), now)

    def _add(self, key: bytes, rank: _Rank, now: float, *, churn: bool = True) -> None:
        self._ranks[key] = rank
        heapq.heappush(self._heap, (rank, key))
        self._suspects.pop(key, None)
        if churn:  # a key come back from the suspects was no new store
            self._churn += 1
            self._churned += 1
        self._changed_at = now
        self._changed(key, now, held=True)

    def _set(self, key: bytes, rank: _Rank) -> None:
        self._ranks[key] = rank
        self._unmark(key)  # it moved: what it ranks is known again
        heapq.heappush(self._heap, (rank, key))
        self._compact()

    def _compact(self) -> None:
        """Rebuild the heap when stale entries outnumber the live ones."""
        if len(self._heap) > 2 * len(self._ranks) + 64:
            self._heap = [(rank, key) for key, rank in self._ranks.items()]
            heapq.heapify(self._heap)

    def _fit(self, now: float) -> None:
        """Evict the lowest ranked while more keys are held than the parent has room for.

        A pinned key is passed over, as the parent's LRU passes it over, and
        so is one a check found held after the mirror had dropped it (the
        parent evicted another); only when nothing else is left does one of
        those go.
        """
        heap, ranks, room = self._heap, self._ranks, self.room
        pinned, passed = self._pinned, []
        while len(ranks) > room and heap:
            entry = heapq.heappop(heap)
            rank, key = entry
            if ranks.get(key) != rank:
                continue
            if key in pinned or self._fresh_in(self._verified, key):
                passed.append(entry)
                continue
            self._evict(key, rank, now)
        for entry in passed:  # the verified, lowest first, if there is still too much
            rank, key = entry
            if len(ranks) > room and key not in pinned and ranks.get(key) == rank:
                self._evict(key, rank, now)
            else:
                heapq.heappush(heap, entry)

    def _unmark(self, key: bytes) -> None:
        self._checked.pop(key, None)
        self._verified.pop(key, None)

    def _drop(self, key: bytes, now: float) -> None:
        self._unmark(key)
        if self._ranks.pop(key, None) is not None:
            self._changed(key, now, held=False)

    def _evict(self, key: bytes, rank: _Rank, now: float) -> None:
        self._drop(key, now)
        suspects = self._suspects
        suspects[key] = rank
        if len(suspects) > _SUSPECTS:
            suspects.popitem(last=False)
