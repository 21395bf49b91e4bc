"""What this node's engine holds, kept as the summary it tells its peers.

A secondary tier never hears of an eviction from its parent (vLLM 0.33.0
cascades stores to every tier, and nothing else). So :class:`Holdings`
mirrors the parent's CPU tier from what the tier does see, in the order the
parent's LRU keeps it, and evicts as that LRU would when the tier is full.

vLLM's LRU (``cpu/policies/lru.py``) is not plain recency. A chunk a request
stores or loads takes the rank ``(the request's rank, -its position)``, so
within a request the tail ranks below the head; when the request finishes,
its chunks are ranked afresh tail first, so that its head is the most
recent. A full tier therefore evicts a prompt's **tail first** and keeps its
head. The mirror ranks the same way from what the tier sees: the stores
cascaded to it and its own loads, each with the request and the positions
vLLM records on the request (:meth:`Holdings.stored`), and the end of each
request (:meth:`Holdings.finished`). What it cannot see, a request's reuse of
chunks the CPU tier already held (vLLM asks a tier only past them), the
check corrects: :meth:`Holdings.scrub` offers the keys the mirror would
evict next, and any it dropped for room that the parent may still hold;
the parent's answers come back as :meth:`Holdings.gone` (dropped) and
:meth:`Holdings.kept` (held after all: reused, so recent). A key our server
answered MISS for is dropped at once; a drain starts a new epoch.

Sans-IO like the rest of the core: ``now`` is an argument. The node asks
:meth:`Holdings.next_flush` when to call :meth:`Holdings.flush`, which turns
the changes since the last flush into one :class:`SummaryDelta` for every peer
(a key added and removed within one window is never sent);
:meth:`Holdings.snapshot` gives the whole summary in parts
(:class:`SummaryPart`) for a peer whose session just became ready or that
asked for a resync.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

import attrs
import msgspec

from p2pactor.core import checks
from p2pactor.core.sources import fingerprint
from p2pactor.errors import ConfigError

__all__ = [
    "MAX_DELTA_KEYS",
    "SCRUB_LOST_S",
    "Holdings",
    "Snapshot",
    "SummaryDelta",
    "SummaryOptions",
    "SummaryPart",
]

MAX_DELTA_KEYS = 65_536
"""Most keys one delta carries (the wire's bound on a summary field)."""
SCRUB_LOST_S = 5.0
"""A batch to check whose answers have not come by then is taken as lost."""


def _part_keys(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    checks.positive_int(instance, attribute, value)
    if isinstance(value, int) and value > MAX_DELTA_KEYS:
        raise ConfigError(
            f"SummaryOptions.part_keys is {value}; one message carries at most "
            f"{MAX_DELTA_KEYS} keys, so set it to that or less"
        )


@attrs.frozen
class SummaryOptions:
    """How a node batches what it tells its peers about its holdings.

    Attributes:
        flush_keys: Flush as soon as this many keys changed.
        flush_s: Otherwise flush this long after the first unflushed change.
        part_keys: Keys per snapshot part at most (a part is one message: a
            lookup on the same socket never waits behind a whole snapshot).
        scrub_per_key: Where the parent is checked (a vLLM tier), keys checked
            for every key that came to be held: a full tier evicts one for
            each, and the check asks first about what the mirror would evict.
        scrub_most: Keys checked in one batch at most (one batch is asked
            while the engine lends its parent, on its thread).
        scrub_base_per_s: Keys checked a second besides, while the tier is
            in use (a change within ``scrub_idle_s``): evictions a tier cannot
            see (another tier's promotions) are found at this pace.
        scrub_idle_s: With no change for this long, only changes bring checks.
    """

    flush_keys: int = attrs.field(default=1000, validator=checks.positive_int)
    flush_s: float = attrs.field(default=0.05, validator=checks.positive(finite=True))
    part_keys: int = attrs.field(default=8192, validator=_part_keys)
    scrub_per_key: float = attrs.field(default=2.0, validator=checks.non_negative(finite=True))
    scrub_most: int = attrs.field(default=256, validator=checks.positive_int)
    scrub_base_per_s: float = attrs.field(default=500.0, validator=checks.non_negative(finite=True))
    scrub_idle_s: float = attrs.field(default=10.0, validator=checks.non_negative(finite=True))


class SummaryDelta(msgspec.Struct, frozen=True, gc=False):
    """Keys this node came to hold, and stopped holding, since delta ``seq - 1``."""

    epoch: bytes
    seq: int
    add: tuple[int, ...]
    remove: tuple[int, ...]


class SummaryPart(msgspec.Struct, frozen=True, gc=False):
    """Part ``part`` of ``parts`` of everything this node holds as of delta ``upto_seq``."""

    epoch: bytes
    upto_seq: int
    part: int
    parts: int
    fps: tuple[int, ...]


class Snapshot(msgspec.Struct, frozen=True, gc=False):
    """A whole summary: first the delta that brings every peer up to it, then its parts.

    Attributes:
        delta: The changes not yet flushed (for every peer), or None.
        parts: The summary as of ``delta`` (for the peer that needs it).
    """

    delta: SummaryDelta | None
    parts: tuple[SummaryPart, ...]


_Rank = tuple[int, int]
_MAX_REQUESTS = 4096  # requests whose keys are kept for their finish; older ones lose it
_SUSPECTS = 4096  # keys dropped for room that the parent may still hold, to check


class Holdings:
    """The keys this node's engine holds, in its LRU's order, and the summary of them.

    Args:
        capacity: The most keys the parent's tier can hold (its blocks).
        epoch: This life's id: a peer that sees a new one drops the old summary.
        options: How changes are batched.

    Raises:
        ConfigError: ``capacity`` is not a positive integer.
    """

    def __init__(
        self, capacity: int, *, epoch: bytes, options: SummaryOptions | None = None
    ) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ConfigError(f"Holdings capacity must be a positive integer, got {capacity!r}")
        options = options or SummaryOptions()
        self.capacity = capacity
        self.flush_keys = options.flush_keys
        self.flush_s = options.flush_s
        self.part_keys = options.part_keys
        self.scrub_per_key = options.scrub_per_key
        self.scrub_most = options.scrub_most
        self.scrub_base_per_s = options.scrub_base_per_s
        self.scrub_idle_s = options.scrub_idle_s
        self._epoch = epoch
        self._seq = 0
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
        # Keys changed since the last flush: True came to be held, False stopped.
        self._pending: dict[bytes, bool] = {}
        self._since: float | None = None  # when the first unflushed change came
        self._reserved = 0  # the parent's blocks taken by loads in flight
        self._churn = 0  # keys that came to be held since the last scrub
        self._scrub_owed = 0.0  # keys due for a check, not yet in a batch
        self._scrub_out: float | None = None  # when the batch being checked was planned
        self._scrub_at: float | None = None  # when the base pace last accrued
        self._changed_at: float | None = None  # the last change

    @property
    def epoch(self) -> bytes:
        """This life's id."""
        return self._epoch

    @property
    def seq(self) -> int:
        """The last delta's number (0: none yet in this epoch)."""
        return self._seq

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

    # --- what the tier sees -------------------------------------------------------

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
        ranks = self._ranks
        if request is None:
            for key in keys:
                self._rank_afresh(key, now)
        else:
            rank_of, seen = self._request(request)
            for i, key in enumerate(keys):
                position = None if positions is None else positions[i]
                if position is None:
                    self._rank_afresh(key, now)
                    continue
                seen[key] = position
                rank = (rank_of, -position)
                old = ranks.get(key)
                if old is None:
                    self._add(key, rank, now)
                elif rank > old:  # vLLM's on_request_access: it only moves up
                    self._set(key, rank)
        self._fit(now)

    def accessed(
        self, keys: Sequence[bytes], request: str, positions: Sequence[int | None]
    ) -> None:
        """``request`` used ``keys`` the parent held (reused them): ranked as its own until it ends.

        What vLLM's LRU does for a chunk a request loads from the CPU tier.
        Keys not held are passed over (the parent did not have them either).
        """
        ranks = self._ranks
        rank_of, seen = self._request(request)
        for key, position in zip(keys, positions, strict=True):
            if position is None or key not in ranks:
                continue
            seen[key] = position
            rank = (rank_of, -position)
            if rank > ranks[key]:
                self._set(key, rank)

    def finished(self, request: str) -> None:
        """``request`` ended: its keys are the most recent, its head most of all.

        vLLM's LRU ranks a finished request's keys afresh, tail first.
        """
        entry = self._requests.pop(request, None)
        if entry is None:
            return
        _, seen = entry
        ranks = self._ranks
        for key, _pos in sorted(seen.items(), key=lambda kp: -kp[1]):
            if key in ranks:
                self._set(key, self._fresh())

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
        if stamp is None:
            return False
        if self._churned - stamp >= max(16, self.capacity // 4):
            del marks[key]
            return False
        return True

    def pinned(self, job: int, keys: Sequence[bytes]) -> None:
        """The parent pinned ``keys`` for a peer's fetch (job ``job``): it evicts others first."""
        self._pins[job] = tuple(keys)
        self._pinned.update(keys)

    def released(self, job: int, now: float) -> None:
        """The pin ``job`` was released: its keys may be evicted again."""
        keys = self._pins.pop(job, ())
        pinned = self._pinned
        for key in keys:
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
        ranks, suspects = self._ranks, self._suspects
        for key in keys:
            suspects.pop(key, None)
            self._checked.pop(key, None)
            self._verified.pop(key, None)
            if key in ranks:
                del ranks[key]
                self._changed(key, now, held=False)
        self._compact()

    def reset(self, epoch: bytes, now: float) -> Snapshot:
        """The parent was drained: nothing is held, and a new epoch begins.

        Returns the new epoch's (empty) summary, for every peer: until they
        hear of the new epoch they would claim the old one's keys for us.
        """
        self._ranks.clear()
        self._heap.clear()
        self._requests.clear()
        self._suspects.clear()
        self._checked.clear()
        self._verified.clear()
        self._pins.clear()
        self._pinned.clear()
        self._pending.clear()
        self._since = None
        self._churn = 0
        self._scrub_owed, self._scrub_out = 0.0, None
        self._scrub_at = self._changed_at = None
        self._since_frontier = self._churned
        self._epoch, self._seq = epoch, 0
        return self.snapshot(now)

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

    def plan_scrub(self, now: float) -> list[bytes]:
        """The next batch to check with the parent, if one is due; one batch at a time.

        What is due grows with the churn (``scrub_per_key`` keys for every key
        that came to be held); a batch is at most ``scrub_most`` keys, and the
        next comes once :meth:`scrubbed` gave this one's answers (or
        :data:`SCRUB_LOST_S` after it was planned: its answers are lost).
        """
        out = self._scrub_out
        if out is not None and now < out + SCRUB_LOST_S:
            return []
        if self._scrub_at is not None and self._in_use(now):
            self._scrub_owed += self.scrub_base_per_s * min(1.0, max(0.0, now - self._scrub_at))
        self._scrub_at = now
        self._scrub_owed += self.scrub_per_key * self._churn
        most = int(min(self._scrub_owed, self.scrub_most))
        if most < 1:
            return []
        batch = self.scrub(most)
        self._scrub_owed = max(0.0, self._scrub_owed - max(len(batch), most))
        self._scrub_out = now if batch else None
        return batch

    def next_scrub(self) -> float | None:
        """When the base pace has a batch due (None: it does not, until a change)."""
        if self._scrub_out is not None or not self.scrub_base_per_s or not self._ranks:
            return None
        if self._changed_at is None:
            return None
        start = self._scrub_at if self._scrub_at is not None else self._changed_at
        due = start + max(0.01, min(1.0, 1.0 / self.scrub_base_per_s * 16))
        return due if due <= self._changed_at + self.scrub_idle_s else None

    def _in_use(self, now: float) -> bool:
        return self._changed_at is not None and now <= self._changed_at + self.scrub_idle_s

    def scrubbed(self, gone: Iterable[bytes], kept: Iterable[bytes], now: float) -> None:
        """The answers to the batch :meth:`plan_scrub` gave: the next may be planned."""
        self._scrub_out = None
        self.gone(gone, now)
        self.kept(kept, now)

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
        n = min(self.scrub_most, max(16, 2 * (self._churned - since)))
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

    # --- ranks ---------------------------------------------------------------------

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
        self._checked.pop(key, None)  # it moved: what it ranks is known again
        self._verified.pop(key, None)
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

    def _evict(self, key: bytes, rank: _Rank, now: float) -> None:
        del self._ranks[key]
        self._checked.pop(key, None)
        self._verified.pop(key, None)
        self._changed(key, now, held=False)
        suspects = self._suspects
        suspects[key] = rank
        if len(suspects) > _SUSPECTS:
            suspects.popitem(last=False)

    # --- what the peers are told ----------------------------------------------------

    def next_flush(self) -> float | None:
        """When :meth:`flush` has something to send (None: nothing changed)."""
        if not self._pending or self._since is None:
            return None
        if len(self._pending) >= self.flush_keys:
            return self._since
        return self._since + self.flush_s

    def flush(self, now: float, *, force: bool = False) -> SummaryDelta | None:
        """The delta of the changes since the last flush, if due (or ``force``).

        A delta carries at most :data:`MAX_DELTA_KEYS` changes (what one
        message may); the rest stay pending, due at once.
        """
        pending = self._pending
        if not pending:
            self._since = None  # every change there was cancelled out
            return None
        due = self._since is not None and now >= self._since + self.flush_s
        if not (force or due or len(pending) >= self.flush_keys):
            return None
        if len(pending) <= MAX_DELTA_KEYS:
            taken = list(pending.items())
            pending.clear()
            self._since = None
        else:
            taken = list(itertools.islice(pending.items(), MAX_DELTA_KEYS))
            for key, _ in taken:
                del pending[key]
        add = tuple(fingerprint(k) for k, held in taken if held)
        remove = tuple(fingerprint(k) for k, held in taken if not held)
        self._seq += 1
        return SummaryDelta(self._epoch, self._seq, add, remove)

    def snapshot(self, now: float) -> Snapshot:
        """Everything held, in parts, after flushing what is pending."""
        delta = self.flush(now, force=True)
        fps = [fingerprint(k) for k in self._ranks]
        size = self.part_keys
        count = max(1, -(-len(fps) // size))
        parts = tuple(
            SummaryPart(self._epoch, self._seq, i, count, tuple(fps[i * size : (i + 1) * size]))
            for i in range(count)
        )
        return Snapshot(delta, parts)

    def _changed(self, key: bytes, now: float, *, held: bool) -> None:
        pending = self._pending
        if key in pending:
            # Back to what the peers were last told: nothing to say about it.
            del pending[key]
            if not pending:
                self._since = None  # the window starts again with the next change
        else:
            pending[key] = held
            if self._since is None:
                self._since = now
