"""What this node's engine holds, kept as the summary it tells its peers.

A secondary tier never hears of an eviction from its parent (vLLM 0.33.0
cascades stores to every tier, and nothing else). So :class:`Holdings` mirrors
the parent's CPU tier from what the tier does see: every store, our own
successful loads (now in the parent too), and touches for recency, bounded by
the tier's capacity in LRU order. It is kept honest from outside: a key our
server answered MISS for, or that the background check (:meth:`Holdings.scrub`)
found gone, is removed at once; a drain starts a new epoch.

Sans-IO like the rest of the core: ``now`` is an argument. The node asks
:meth:`Holdings.next_flush` when to call :meth:`Holdings.flush`, which turns
the changes since the last flush into one :class:`SummaryDelta` for every peer
(a key added and removed within one window is never sent);
:meth:`Holdings.snapshot` gives the whole summary in parts
(:class:`SummaryPart`) for a peer whose session just became ready or that
asked for a resync.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable

import attrs
import msgspec

from p2pactor.core import checks
from p2pactor.core.sources import fingerprint
from p2pactor.errors import ConfigError

__all__ = [
    "MAX_DELTA_KEYS",
    "Holdings",
    "Snapshot",
    "SummaryDelta",
    "SummaryOptions",
    "SummaryPart",
]

MAX_DELTA_KEYS = 65_536
"""Most keys one delta carries (the wire's bound on a summary field)."""


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
    """

    flush_keys: int = attrs.field(default=1000, validator=checks.positive_int)
    flush_s: float = attrs.field(default=0.05, validator=checks.positive(finite=True))
    part_keys: int = attrs.field(default=8192, validator=_part_keys)


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


class Holdings:
    """The keys this node's engine holds, in LRU order, and the summary of them.

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
        self._epoch = epoch
        self._seq = 0
        self._held: OrderedDict[bytes, None] = OrderedDict()
        # Keys changed since the last flush: True came to be held, False stopped.
        self._pending: dict[bytes, bool] = {}
        self._since: float | None = None  # when the first unflushed change came
        self._scrub: deque[bytes] = deque()
        self._reserved = 0  # the parent's blocks taken by loads in flight

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
        return len(self._held)

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held."""
        return key in self._held

    # --- what the tier sees -------------------------------------------------------

    def stored(self, keys: Iterable[bytes], now: float) -> None:
        """The parent now holds ``keys`` (a store, or a load of ours), as its most recent."""
        held = self._held
        for key in keys:
            if key in held:
                held.move_to_end(key)
                continue
            held[key] = None
            self._changed(key, now, held=True)
        self._fit(now)

    def reserve(self, blocks: int, now: float) -> None:
        """Loads in flight took ``blocks`` more of the parent's blocks (negative: gave back).

        The parent evicts for a load before its keys arrive (vLLM allocates a
        promotion's chunks up front), so while loads are in flight the parent
        holds that many fewer keys: the oldest go from the summary too.
        """
        self._reserved = max(0, self._reserved + blocks)
        self._fit(now)

    @property
    def room(self) -> int:
        """Keys the parent can hold now: its capacity less the blocks loads took."""
        return max(0, self.capacity - self._reserved)

    def _fit(self, now: float) -> None:
        held, room = self._held, self.room
        while len(held) > room:
            old, _ = held.popitem(last=False)
            self._changed(old, now, held=False)

    def touched(self, keys: Iterable[bytes]) -> None:
        """The engine reused ``keys``: they are the most recent now."""
        held = self._held
        for key in keys:
            if key in held:
                held.move_to_end(key)

    def gone(self, keys: Iterable[bytes], now: float) -> None:
        """The parent no longer holds ``keys`` (a MISS we answered, a failed check)."""
        held = self._held
        for key in keys:
            if key in held:
                del held[key]
                self._changed(key, now, held=False)

    def reset(self, epoch: bytes, now: float) -> Snapshot:
        """The parent was drained: nothing is held, and a new epoch begins.

        Returns the new epoch's (empty) summary, for every peer: until they
        hear of the new epoch they would claim the old one's keys for us.
        """
        self._held.clear()
        self._pending.clear()
        self._scrub.clear()
        self._since = None
        self._epoch, self._seq = epoch, 0
        return self.snapshot(now)

    def scrub(self, most: int) -> list[bytes]:
        """Up to ``most`` held keys to check with the parent, oldest first, each in turn."""
        out: list[bytes] = []
        queue = self._scrub
        if not queue:
            queue.extend(self._held)
        while queue and len(out) < most:
            key = queue.popleft()
            if key in self._held:
                out.append(key)
        return out

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
        fps = [fingerprint(k) for k in self._held]
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
