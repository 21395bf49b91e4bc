"""What this node's engine holds, kept as the summary it tells its peers.

:class:`Holdings` is a :class:`~p2pactor.core.sources.mirror.Mirror` of the engine's
CPU tier (what it holds, in the order its LRU evicts, kept honest by checks
with it; ``mirror.py`` says how) that turns every change into the summary
its peers are told. A key our server answered MISS for is dropped at once;
a drain starts a new epoch.

Sans-IO like the rest of the core: ``now`` is an argument. Holdings also
paces the checks (:meth:`Holdings.plan_scrub`) and says what goes to whom:
each change batched into one :class:`~p2pactor.core.protocol.KvsumDelta`
for every peer (a key added and removed within one window is never sent),
and the whole summary in parts, packed once and shared, for a peer whose
session just became ready, that asked (at most one an interval), or at a
refresh. The runtime (:mod:`p2pactor.runtime.directory`) only sends.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Collection, Iterable

import attrs
import msgspec

from p2pactor.core import checks
from p2pactor.core import protocol as wire
from p2pactor.core.sources import fingerprint
from p2pactor.core.sources.mirror import Mirror
from p2pactor.errors import ConfigError

SCRUB_LOST_S = 5.0  # a batch to check whose answers have not come by then is taken as lost
MAX_DELTA_KEYS = 65_536  # most keys one delta carries (the wire's bound on a summary field)


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


# A message to send, and to whom (None: every summary peer).
Out = tuple[str | None, wire.KvsumDelta | wire.KvsumSnapshot]


class Snapshot(msgspec.Struct, frozen=True, gc=False):
    """A whole summary: first the delta that brings every peer up to it, then its parts.

    Attributes:
        delta: The changes not yet flushed (for every peer), or None.
        parts: The summary as of ``delta`` (for the peer that needs it), packed once.
    """

    delta: wire.KvsumDelta | None
    parts: tuple[wire.KvsumSnapshot, ...]


class Holdings(Mirror):
    """The keys this node's engine holds, in its LRU's order, and what its peers are told.

    Args:
        capacity: The most keys the parent's tier can hold (its blocks).
        epoch: This life's id: a peer that sees a new one drops the old summary.
        options: How changes are batched.
        part_interval_s: Seconds between two parts of one snapshot to one peer.
        resync_interval_s: The least time between two snapshots a peer asked for.
        refresh_s: Seconds between two whole snapshots to every peer (0: none).

    Attributes:
        epoch: This life's id.
        seq: The last delta's number (0: none yet in this epoch).
        built: Snapshots built (fingerprinting every held key), for the tests and the bench.

    Raises:
        ConfigError: ``capacity`` is not a positive integer.
    """

    def __init__(
        self,
        capacity: int,
        *,
        epoch: bytes,
        options: SummaryOptions | None = None,
        part_interval_s: float = 0.01,
        resync_interval_s: float = 1.0,
        refresh_s: float = 0.0,
    ) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ConfigError(f"Holdings capacity must be a positive integer, got {capacity!r}")
        super().__init__(capacity, options or SummaryOptions())
        self.part_interval_s = part_interval_s
        self.resync_interval_s = resync_interval_s
        self.refresh_s = refresh_s
        self.epoch = epoch
        self.seq = 0
        self.built = 0
        # Keys changed since the last flush: True came to be held, False stopped.
        self._pending: dict[bytes, bool] = {}
        self._since = 0.0  # when the first unflushed change came (while there is one)
        self._cached: tuple[bytes, int, tuple[wire.KvsumSnapshot, ...]] | None = None
        self._queues: dict[str, deque[wire.KvsumSnapshot]] = {}  # parts still to send
        self._answered: dict[str, float] = {}  # when each peer's last resync was answered
        self._wanted: dict[str, float] = {}  # resyncs that wait: when their interval ends
        self._next_part: float | None = None
        self._next_refresh: float | None = None
        self._scrub_owed = 0.0  # keys due for a check, not yet in a batch
        self._scrub_out: float | None = None  # when the batch being checked was planned
        self._scrub_at: float | None = None  # when the base pace last accrued

    def reset(self, epoch: bytes, now: float) -> Snapshot:
        """The parent was drained: nothing is held, and a new epoch begins.

        Returns the new epoch's (empty) summary, for every peer: until they
        hear of the new epoch they would claim the old one's keys for us.
        """
        self.clear()
        self._pending.clear()
        self._scrub_out = self._scrub_at = None
        self._scrub_owed = 0.0
        self.epoch, self.seq = epoch, 0
        return self.snapshot(now)

    # --- checks with the parent ------------------------------------------------------

    def plan_scrub(self, now: float) -> list[bytes]:
        """The next batch to check with the parent, if one is due; one batch at a time.

        What is due grows with the churn (``scrub_per_key`` keys for every key
        that came to be held); a batch is at most ``scrub_most`` keys, and the
        next comes once :meth:`scrubbed` gave this one's answers (or
        :data:`SCRUB_LOST_S` after it was planned: its answers are lost).
        """
        out, options = self._scrub_out, self.options
        if out is not None and now < out + SCRUB_LOST_S:
            return []
        changed = self._changed_at
        in_use = changed is not None and now <= changed + options.scrub_idle_s
        if self._scrub_at is not None and in_use:
            self._scrub_owed += options.scrub_base_per_s * min(1.0, max(0.0, now - self._scrub_at))
        self._scrub_at = now
        self._scrub_owed += options.scrub_per_key * self._churn
        most = int(min(self._scrub_owed, options.scrub_most))
        if most < 1:
            return []
        batch = self.scrub(most)
        self._scrub_owed = max(0.0, self._scrub_owed - max(len(batch), most))
        self._scrub_out = now if batch else None
        return batch

    def next_scrub(self) -> float | None:
        """When the base pace has a batch due (None: it does not, until a change)."""
        changed, pace = self._changed_at, self.options.scrub_base_per_s
        if changed is None or self._scrub_out is not None or not pace or not self._ranks:
            return None
        start = self._scrub_at if self._scrub_at is not None else changed
        due = start + max(0.01, min(1.0, 1.0 / pace * 16))
        return due if due <= changed + self.options.scrub_idle_s else None

    def scrubbed(self, gone: Iterable[bytes], kept: Iterable[bytes], now: float) -> None:
        """The answers to the batch :meth:`plan_scrub` gave: the next may be planned."""
        self._scrub_out = None
        self.gone(gone, now)
        self.kept(kept, now)

    # --- deltas and snapshots ---------------------------------------------------------

    def next_flush(self) -> float | None:
        """When :meth:`flush` has something to send (None: nothing changed)."""
        if not self._pending:
            return None
        if len(self._pending) >= self.options.flush_keys:
            return self._since
        return self._since + self.options.flush_s

    def flush(self, now: float, *, force: bool = False) -> wire.KvsumDelta | None:
        """The delta of the changes since the last flush, if due (or ``force``).

        A delta carries at most :data:`MAX_DELTA_KEYS` changes (what one
        message may); the rest stay pending, due at once.
        """
        pending = self._pending
        due = now >= self._since + self.options.flush_s or len(pending) >= self.options.flush_keys
        if not pending or not (force or due):
            return None
        taken = list(itertools.islice(pending.items(), MAX_DELTA_KEYS))
        for key, _ in taken:
            del pending[key]
        add = [fingerprint(k) for k, held in taken if held]
        remove = [fingerprint(k) for k, held in taken if not held]
        self.seq += 1
        return wire.KvsumDelta(
            epoch=self.epoch, seq=self.seq, add=wire.packed(add), remove=wire.packed(remove)
        )

    def snapshot(self, now: float) -> Snapshot:
        """Everything held, in parts, after flushing what is pending.

        The parts are built (and packed) once per epoch and delta number, and
        shared: a hundred resyncs in a row cost one fingerprinting of the keys.
        """
        delta = self.flush(now, force=True)
        cached = self._cached
        if cached is not None and cached[:2] == (self.epoch, self.seq):
            return Snapshot(delta, cached[2])
        fps = [fingerprint(k) for k in self._ranks]
        size = self.options.part_keys
        count = max(1, -(-len(fps) // size))
        parts = tuple(
            wire.KvsumSnapshot(
                epoch=self.epoch,
                upto_seq=self.seq,
                part=i,
                parts=count,
                fps=wire.packed(fps[i * size : (i + 1) * size]),
            )
            for i in range(count)
        )
        self.built += 1
        self._cached = (self.epoch, self.seq, parts)
        return Snapshot(delta, parts)

    def _changed(self, key: bytes, now: float, *, held: bool) -> None:
        pending = self._pending
        if pending.pop(key, None) is None:  # else back to what the peers were last told
            if not pending:
                self._since = now  # the window starts with this change
            pending[key] = held

    # --- to whom, and when ------------------------------------------------------------
    # Every method below returns the messages to send now, each with its peer
    # (None: every summary peer). What a peer's asking costs is bounded: a
    # resync while a snapshot to it is under way is answered by that one, one
    # sooner than ``resync_interval_s`` after the last answered waits for the
    # interval's end, and parts go one a peer every ``part_interval_s``.

    def started(self, peer: str, now: float) -> list[Out]:
        """``peer``'s session is ready: a snapshot to it, its first part now."""
        if self._next_refresh is None and self.refresh_s:
            self._next_refresh = now + self.refresh_s
        return self._start(peer, now)

    def asked(self, peer: str, now: float) -> list[Out]:
        """``peer`` asked for a snapshot: now, at its interval's end, or by the one under way."""
        if peer in self._queues:
            return []  # the one being sent answers it
        ends = self._answered.get(peer, now) + self.resync_interval_s
        if peer in self._answered and now < ends:
            self._wanted[peer] = ends
            return []
        self._answered[peer] = now
        return self._start(peer, now)

    def _start(self, peer: str, now: float) -> list[Out]:
        out: list[Out] = []
        self._queues[peer] = deque(self._parts(now, out))
        self._send(now, (peer,), out, only=peer)
        return out

    def drain(self, epoch: bytes, now: float, peers: Collection[str]) -> list[Out]:
        """The engine dropped everything: the new epoch to every peer, busy or not, at once."""
        parts = self.reset(epoch, now).parts
        for peer in peers:
            self._queues[peer] = deque(parts)
        out: list[Out] = []
        self._send(now, peers, out)
        return out

    def forget(self, peer: str) -> None:
        """``peer``'s session is gone: nothing more to send it."""
        self._queues.pop(peer, None)
        self._wanted.pop(peer, None)
        self._answered.pop(peer, None)

    def flush_all(self, now: float, *, force: bool = True) -> list[Out]:
        """Every pending change, now (a peer may ask for it within the engine's step).

        Without ``force``, only the deltas due.
        """
        out: list[Out] = []
        while (delta := self.flush(now, force=force)) is not None:
            out.append((None, delta))
        return out

    def next_due(self) -> float | None:
        """When :meth:`due` has something to send next."""
        times = (self.next_flush(), self._parts_due(), self._next_refresh)
        return min((t for t in times if t is not None), default=None)

    def _parts_due(self) -> float | None:
        times = [*self._wanted.values(), self._next_part]
        return min((t for t in times if t is not None), default=None)

    def due(self, now: float, peers: Collection[str]) -> list[Out]:
        """The deltas due, a refresh when due, the resyncs whose interval ended, the parts due.

        Deltas are flushed with no peer too: the changes would pile up otherwise.
        """
        out = self.flush_all(now, force=False)
        if self._next_refresh is not None and now >= self._next_refresh:
            self._next_refresh = now + self.refresh_s if peers else None
            parts = self._parts(now, out)
            for peer in peers:
                self._queues.setdefault(peer, deque(parts))
            self._next_part = now
        parts_due = self._parts_due()
        if parts_due is not None and now >= parts_due:
            self._send(now, peers, out)
        return out

    def _parts(self, now: float, out: list[Out]) -> tuple[wire.KvsumSnapshot, ...]:
        """The snapshot as of now, after the deltas that bring everyone else up to it."""
        out += self.flush_all(now)
        return self.snapshot(now).parts

    def _send(
        self, now: float, peers: Collection[str], out: list[Out], only: str | None = None
    ) -> None:
        """The resyncs whose interval ended, then one part to each peer with parts queued.

        With ``only``: one part to ``only``, nothing else.
        """
        if only is None:
            for peer in [p for p, ends in self._wanted.items() if now >= ends]:
                del self._wanted[peer]
                if peer in peers and peer not in self._queues:
                    self._answered[peer] = now
                    self._queues[peer] = deque(self._parts(now, out))
        for peer in [only] if only is not None else list(self._queues):
            queue = self._queues.get(peer)
            if not queue or peer not in peers:
                self._queues.pop(peer, None)
                continue
            out.append((peer, queue.popleft()))
            if not queue:
                del self._queues[peer]
        self._next_part = now + self.part_interval_s if self._queues else None
