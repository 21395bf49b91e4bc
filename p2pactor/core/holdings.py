"""What this node's engine holds, kept as the summary it tells its peers.

:class:`Holdings` is a :class:`~p2pactor.core.mirror.Mirror` of the engine's
CPU tier (what it holds, in the order its LRU evicts, kept honest by checks
with it; ``mirror.py`` says how) that turns every change into the summary
its peers are told. A key our server answered MISS for is dropped at once;
a drain starts a new epoch.

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

import attrs
import msgspec

from p2pactor.core import checks
from p2pactor.core.mirror import SCRUB_LOST_S, Mirror
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


class Holdings(Mirror):
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
        super().__init__(
            capacity,
            scrub_per_key=options.scrub_per_key,
            scrub_most=options.scrub_most,
            scrub_base_per_s=options.scrub_base_per_s,
            scrub_idle_s=options.scrub_idle_s,
        )
        self.flush_keys = options.flush_keys
        self.flush_s = options.flush_s
        self.part_keys = options.part_keys
        self._epoch = epoch
        self._seq = 0
        # Keys changed since the last flush: True came to be held, False stopped.
        self._pending: dict[bytes, bool] = {}
        self._since: float | None = None  # when the first unflushed change came

    @property
    def epoch(self) -> bytes:
        """This life's id."""
        return self._epoch

    @property
    def seq(self) -> int:
        """The last delta's number (0: none yet in this epoch)."""
        return self._seq

    # --- what the tier sees -------------------------------------------------------

    def reset(self, epoch: bytes, now: float) -> Snapshot:
        """The parent was drained: nothing is held, and a new epoch begins.

        Returns the new epoch's (empty) summary, for every peer: until they
        hear of the new epoch they would claim the old one's keys for us.
        """
        self.clear()
        self._pending.clear()
        self._since = None
        self._epoch, self._seq = epoch, 0
        return self.snapshot(now)

    # --- ranks ---------------------------------------------------------------------

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
