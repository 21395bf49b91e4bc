"""One peer's claims as its summary messages make them: in order, a bounded slice at a time.

A peer's ``kvsum/1`` messages (deltas, and snapshots in parts) are queued
and applied strictly in the order they came, never more than a slice of
fingerprints in one call (:meth:`PeerClaims.step`), within bounded bytes
(``docs/sources.md``, "Work a slice at a time").

What a message means is decided when it reaches the head of the queue,
exactly as if it were applied on arrival: its epoch (a new one drops the old
summary whole), its sequence number (in order, a gap, or already covered),
whether a snapshot is being assembled. Then its fingerprints go in slices:
a delta's (removes, then adds), or a snapshot's parts, each a sorted run
(:class:`Assembly`), all merged once it is whole and installed as the claims.
Each such job is a generator, one slice a ``send``.

Sans-IO: no clock, no I/O. Every fingerprint a peer may claim is capped by
its capacity (what it registered, within the node's budget for it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator

import attrs
import msgspec

from p2pactor.core.choice import PeerTrust
from p2pactor.core.sources.claims import (
    ClaimSet,
    Compaction,
    FpArray,
    MergeRuns,
    Raw,
    as_fps,
    unique,
)
from p2pactor.core.sources.filter import ClaimFilter
from p2pactor.core.work_budget import WorkBudget

# Deltas kept while a snapshot is assembled; past that the snapshot is given up.
MAX_BUFFERED_DELTAS = 256
# Deltas buffered during a snapshot carry at most a fingerprint for this many claims.
BUFFERED_SHARE = 4
# Fingerprints buffered during a snapshot past that share.
BUFFERED_SLACK = 64
# Deltas a gap may last before its resync is asked again (the first may be lost).
RESYNC_AFTER_DELTAS = 64
# Fingerprints merged (a snapshot's parts, a compaction) for the work of one applied.
MERGE_RATIO = 8
# What a queued message costs besides its fingerprints (its record and fields).
MESSAGE_BYTES = 128


class Resync(msgspec.Struct, frozen=True, gc=False):
    """Ask ``peer`` for a snapshot: its summary has a gap (or we have none)."""

    peer: str
    epoch: bytes
    from_seq: int


class Delta:
    """A delta as it came, waiting for its turn."""

    __slots__ = ("add", "epoch", "nbytes", "remove", "seq")

    def __init__(self, epoch: bytes, seq: int, add: Raw, remove: Raw) -> None:
        self.epoch, self.seq, self.add, self.remove = epoch, seq, add, remove
        self.nbytes = int(add.nbytes + remove.nbytes) + MESSAGE_BYTES


class Part:
    """A snapshot's part as it came, waiting for its turn."""

    __slots__ = ("epoch", "fps", "nbytes", "part", "parts", "upto")

    def __init__(self, epoch: bytes, upto: int, part: int, parts: int, fps: Raw) -> None:
        self.epoch, self.upto, self.part, self.parts, self.fps = epoch, upto, part, parts, fps
        self.nbytes = int(fps.nbytes) + MESSAGE_BYTES


@attrs.define(eq=False)
class Assembly:
    """A snapshot being put together from its parts: sorted runs, merged once it is whole."""

    upto: int
    parts: int
    # The filter's column for ``runs``, filled as they come.
    column: FpArray
    # Deltas after ``upto`` that came meanwhile: applied once it is whole.
    buffered: list[Delta] = attrs.Factory(list)
    seen: set[int] = attrs.Factory(set)
    # Each sorted, each value once within it.
    runs: list[FpArray] = attrs.Factory(list)
    # Fingerprints in ``runs`` (one in two runs counts twice).
    held: int = 0
    # It claimed more than it may: cut back to its capacity.
    cut: bool = False
    # Its runs being merged, once it is whole.
    merge: MergeRuns | None = None


# A summary message as it waits for its turn.
Incoming = Delta | Part
# Work under way: each ``send(most)`` does a slice and yields the work done and a
# Resync to send; it takes itself off the queue before its last slice.
_Job = Generator[tuple[int, Resync | None], int, None]


@attrs.define(eq=False)
class PeerClaims(PeerTrust):
    """What one peer claims, its summary messages not applied yet, its work budget and trust.

    Args:
        peer: The peer's id (named in the resyncs it is asked).
        capacity: The most fingerprints it may claim.
        filter: The index's filter; this peer's claims go in ``column`` of it.
        column: This peer's column.
        max_queued_bytes: What its queued messages may hold; past it they are
            dropped as a flood.
        budget: How much of the node's thread its summaries may take.
    """

    peer: str
    capacity: int
    _filter: ClaimFilter
    column: int
    max_queued_bytes: int
    budget: WorkBudget
    epoch: bytes = b""
    seq: int = 0
    # A whole snapshot arrived for this epoch.
    synced: bool = False
    # A Resync is out and no snapshot came since.
    resync_asked: bool = False
    # Deltas the gap has lasted since the resync was asked.
    gap_deltas: int = 0
    claims: ClaimSet = attrs.Factory(ClaimSet)
    assembly: Assembly | None = None
    queue: deque[Incoming | Compaction | _Job] = attrs.Factory(deque)
    # Bytes of the messages in ``queue``.
    queued_bytes: int = 0
    # Messages that claimed more than it may.
    strikes: int = 0
    # Times its queued messages were dropped.
    floods: int = 0

    @property
    def nbytes(self) -> int:
        """What this peer's summary makes the node hold, about (its share of the filter aside)."""
        total = self.claims.nbytes + self.queued_bytes
        assembly = self.assembly
        if assembly is not None:
            total += sum(int(r.nbytes) for r in assembly.runs) + int(assembly.column.nbytes)
            total += 8 * _looked_at(assembly.buffered, self.capacity)
            if assembly.merge is not None:
                total += assembly.merge.nbytes  # the runs it merges and its output
        return total

    # --- messages in ----------------------------------------------------------------------

    def receive(self, message: Incoming) -> Resync | None:
        """Queue ``message``; a Resync to send if it overflowed the queue (a flood)."""
        if self.queued_bytes + message.nbytes <= self.max_queued_bytes or not self.queue:
            self.queue.append(message)
            self.queued_bytes += message.nbytes
            return None
        # Its messages come faster than they are applied: drop them, and ask again.
        self.floods += 1
        self.strikes += 1
        self.claims.cancel_compaction()  # it was queued: its steps are dropped with the rest
        self.queue.clear()
        self.queued_bytes = 0
        self.assembly = None
        # What was applied of a message cut short is no summary we can vouch
        # for: the claims stay (capped, they only steer) until a snapshot.
        self.synced = False
        return None if self.resync_asked else self.resync()

    def resync(self) -> Resync:
        """Ask the peer for a snapshot, from where its summary stands here."""
        self.resync_asked, self.gap_deltas = True, 0
        return Resync(self.peer, self.epoch, self.seq + 1 if self.synced else 0)

    # --- applying, a slice at a time ------------------------------------------------------

    def step(self, most: int) -> tuple[int, Resync | None]:
        """Apply the next slice of queued work, at most ``most`` fingerprints of it.

        Returns the work done (at least 1 while anything is queued) and a
        Resync to send, if the message it decided asks for one.
        """
        queue = self.queue
        if not queue:
            return 0, None
        job = queue[0]
        if isinstance(job, Delta | Part):
            queue.popleft()
            self.queued_bytes -= job.nbytes
            return 1, self._delta(job) if isinstance(job, Delta) else self._part(job)
        # Merging costs about an eighth of applying, a fingerprint: a slice
        # merges that many more, and counts for as much work.
        if isinstance(job, Compaction):
            if job.step(most * MERGE_RATIO):
                queue.popleft()
            return max(1, job.work // MERGE_RATIO), None
        return job.send(most)

    def _push(self, job: _Job) -> None:
        """``job`` goes first; it starts at its first ``yield``."""
        next(job)
        self.queue.appendleft(job)

    def _delta(self, msg: Delta) -> Resync | None:
        epoch = msg.epoch
        seq = msg.seq
        most = self.capacity
        if epoch != self.epoch:
            # A restarted peer: its old summary goes whole, its new one starts
            # with a snapshot (asked once, however often the epoch flips).
            self.new_epoch(epoch)
            return None if self.resync_asked else self.resync()
        # More than it may claim: struck, and the rest is never looked at.
        self.strikes += max(len(msg.add), len(msg.remove)) > most
        assembly = self.assembly
        if assembly is not None and seq > assembly.upto:
            size = _looked_at([*assembly.buffered, msg], most)
            limit = most // BUFFERED_SHARE + BUFFERED_SLACK
            if len(assembly.buffered) >= MAX_BUFFERED_DELTAS or size > limit:
                # It is not coming whole, or the deltas meanwhile weigh more
                # than their share of the claims the peer may make (applying
                # them once it is whole must stay bounded): give it up, ask
                # again below.
                self.strikes += size > limit
                self.assembly = None
                self.resync_asked = False
            else:
                assembly.buffered.append(msg)
        if seq <= self.seq:
            return None  # already folded in (a snapshot covered it)
        if seq == self.seq + 1 and self.synced:
            self.seq = seq
            self._push(self._apply(msg.add[:most], msg.remove[:most]))
            return None
        # A gap (or no snapshot yet): ask once, and again if it lasts.
        self.gap_deltas += 1
        if self.resync_asked and self.gap_deltas < RESYNC_AFTER_DELTAS:
            return None
        return self.resync()

    def _part(self, msg: Part) -> Resync | None:
        part, parts, upto = msg.part, msg.parts, msg.upto
        if not 0 <= part < parts:
            return None
        if parts > self.capacity + 1:
            self.strikes += 1  # more parts than keys it may claim: never whole
            return None
        if msg.epoch != self.epoch:
            self.new_epoch(msg.epoch)
        assembly = self.assembly
        if assembly is not None and upto < assembly.upto:
            return None  # an older snapshot's part: the newer one is being assembled
        if assembly is None or upto > assembly.upto or parts != assembly.parts:
            if self.synced and upto < self.seq:
                return None  # a new snapshot older than what deltas already brought
            kept = [] if assembly is None else [d for d in assembly.buffered if d.seq > upto]
            assembly = self.assembly = Assembly(upto, parts, self._filter.scratch(), kept)
        if part in assembly.seen:
            return None
        assembly.seen.add(part)
        self._push(self._fill(assembly, msg.fps))
        return None

    def _fill(self, assembly: Assembly, fps: Raw) -> _Job:
        """A part's fingerprints going into its assembly a slice at a time.

        A peer claiming more than it may (what it registered, or this node's
        budget for it) keeps what fits, struck once a snapshot; what does not
        fit is never even converted.
        """
        most = yield 0, None
        while True:
            take = min(most, len(fps), max(0, self.capacity - assembly.held))
            if take:
                run = unique(as_fps(fps, take))
                assembly.runs.append(run)
                assembly.held += len(run)
                self._filter.fill(assembly.column, run)
            if take < min(most, len(fps)):
                self.strikes += not assembly.cut
                assembly.cut = True
                fps = fps[:0]
            fps = fps[take:]
            if not len(fps):
                self.queue.popleft()
                if len(assembly.seen) == assembly.parts and assembly is self.assembly:
                    self._push(self._complete(assembly))
            most = yield max(1, take), None

    def _complete(self, assembly: Assembly) -> _Job:
        """A whole snapshot's runs merged into one (merging counts as in :meth:`step`)."""
        merge = assembly.merge = MergeRuns(assembly.runs)
        assembly.runs = []  # the merge holds them now
        most = yield 0, None
        while True:
            used = max(1, merge.step(most * MERGE_RATIO) // MERGE_RATIO)
            if merge.done:
                break
            most = yield used, None
        self.queue.popleft()
        yield used, self._install(assembly, merge.result())

    def _install(self, assembly: Assembly, merged: FpArray) -> Resync | None:
        """The merged snapshot becomes the claims; the deltas buffered meanwhile follow it."""
        most = self.capacity
        if self.assembly is assembly:
            self.assembly = None
        held = merged[:most]
        self.claims = ClaimSet(held)
        self._filter.install(self.column, assembly.column, len(held))
        self.seq, self.synced = assembly.upto, True
        self.resync_asked, self.gap_deltas = False, 0
        follow: list[_Job] = []
        later = False
        for delta in sorted(assembly.buffered, key=lambda d: d.seq):
            if delta.seq == self.seq + 1:
                self.seq = delta.seq
                follow.append(self._apply(delta.add[:most], delta.remove[:most]))
            elif delta.seq > self.seq:
                later = True
        for job in reversed(follow):  # ahead of the messages that came since
            self._push(job)
        return self.resync() if later else None  # a delta after it was lost

    def _apply(self, add: Raw, remove: Raw) -> _Job:
        """A delta's removes, then its adds, going into the claims a slice at a time."""
        struck = False
        most = yield 0, None
        while True:
            claims, filt = self.claims, self._filter
            used = min(most, len(remove))
            if used:
                claims.remove(as_fps(remove, used))
                remove = remove[used:]
            take = min(most - used, len(add))
            if take:
                new, refused = claims.add(as_fps(add, take), self.capacity - len(claims))
                add = add[take:]
                used += take
                if refused and not struck:
                    # More than it registered blocks for: keep what fits (work in
                    # proportion to the message, never to the whole summary).
                    self.strikes += 1
                    struck = True
                filt.add(self.column, new)
            if filt.due(self.column, len(claims)):
                filt.rebuild(self.column, claims.superset, max(1, most))
            if not (len(add) or len(remove)):
                self.queue.popleft()
            if claims.compact_due:
                self.queue.appendleft(Compaction(claims))  # before the rest of the queue
            most = yield max(1, used), None

    # --- from outside -------------------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether messages or their work wait."""
        return bool(self.queue)

    def new_epoch(self, epoch: bytes) -> None:
        """The peer restarted: its old summary goes whole."""
        # A resync asked stays asked: it is answered with the peer's epoch of
        # the moment, whichever that is, and one that flips its epoch on every
        # message would otherwise have each of them ask another.
        self.claims = ClaimSet()
        self._filter.clear(self.column)
        self.epoch, self.seq, self.synced = epoch, 0, False
        self.assembly, self.gap_deltas = None, 0

    def cut(self, capacity: int) -> None:
        """It may claim ``capacity`` now: keep that many (its column stays a superset)."""
        self.capacity = capacity
        if len(self.claims) > capacity:
            self.claims.truncate(capacity)
            self.strikes += 1

    def missed(self, fps: Raw) -> None:
        """It answered MISS for ``fps``: it no longer holds them."""
        self.strikes += len(fps) > self.capacity
        self.claims.remove(as_fps(fps, self.capacity))


def _looked_at(deltas: list[Delta], most: int) -> int:
    """Fingerprints of ``deltas`` looked at, for a peer that may claim ``most``."""
    return sum(min(len(d.add), most) + min(len(d.remove), most) for d in deltas)
