"""The source index and the summaries: which peers claim which keys, what we tell them we hold.

This package is the pure half of how a node finds a source for a request
that names none (the runtime's half is :mod:`p2pactor.runtime.directory`,
:mod:`p2pactor.runtime.sources` and :mod:`p2pactor.runtime.threadsafe_sources`).
Here, :class:`SourceIndex`, what the peers claim; beside it ``peer`` (one
peer's summary messages applied a slice at a time), ``claims`` (its claims,
exactly), ``filter`` (every peer's claims in one Bloom filter), ``arrays``
(fingerprints as arrays), and our own side: ``mirror`` (what our engine's
tier holds, in its LRU's order) and ``holdings`` (the summary our peers are
told of it). The choice itself and the trust in each peer are
:mod:`p2pactor.core.choice`'s.

Each p2pactor peer tells us the keys its engine's CPU tier holds: sequenced
deltas of 64-bit fingerprints (:func:`fingerprint`), and snapshots in parts.
:class:`SourceIndex` keeps each peer's claims exactly
(:class:`~p2pactor.core.sources.claims.ClaimSet`) and all of them in one Bloom
filter with a column per peer (:class:`~p2pactor.core.sources.filter.ClaimFilter`),
each peer's epoch, sequence and trust, and chooses
(:class:`~p2pactor.core.choice.Trust`) the peer worth one lookup. Sans-IO:
``now`` is an argument, and what the runtime must do comes back as data (a
:class:`Resync`, a :class:`Choice`). Claims only steer performance: a false
one costs a lookup that answers MISS, never wrong bytes, and a peer whose
claims keep missing is quarantined for automatic choice only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from p2pactor.core.choice import ChoicePolicy, Trust
from p2pactor.core.sources.claims import Fingerprints, raw
from p2pactor.core.sources.filter import ClaimFilter
from p2pactor.core.sources.peer import Delta, Incoming, Part, PeerClaims, Resync
from p2pactor.core.work_budget import WorkBudget

_MASK64 = (1 << 64) - 1
_GROUP_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads group indexes over all bits


def fingerprint(key: bytes) -> int:
    """The 64-bit fingerprint a summary carries for an offload key.

    vLLM's key is the block hash followed by a 4-byte big-endian KV-cache group
    index. The fingerprint is the hash's low 64 bits (what vLLM's KV events
    publish as an int hash) mixed with the group, so group 0 keeps them as they
    are. A key shorter than 12 bytes (never one of vLLM's) counts as if
    zero-padded in front.
    """
    low = int.from_bytes(key[-12:-4], "big")
    group = int.from_bytes(key[-4:], "big")
    return low ^ ((group * _GROUP_MIX) & _MASK64)


# What one claim a peer may make costs this node, at most (``tracemalloc``,
# ``docs/sources.md``): 9 bytes packed and up to 5 in the recent changes; 3 to 11
# of the filter's column; in a snapshot being assembled 8, its merge 8 and its
# column 3; the deltas buffered meanwhile 2. A node's budget for a peer (less its
# queued messages' share) divided by this is how many claims it keeps.
BYTES_PER_CLAIM = 48
# Fingerprints of summary work one :meth:`SourceIndex.work` call does (under a millisecond).
SLICE_FPS = 2048
# Fingerprints of a message applied as it arrives, when nothing of its peer waits.
INLINE_FPS = 1024


class SourceIndex(Trust):
    """Every peer's claims, and the choice of a source per request.

    What a peer sends costs work in proportion to the message, done a slice
    at a time (:meth:`work`), and memory within the claims it may make and
    the bytes its queued messages may hold (a snapshot that never completes
    is given up); a peer that claims more than it may is truncated and
    struck. Fingerprints come packed (a summary's field, as the wire carries
    it) or as ints.

    Args:
        policy: How claims are trusted and when a lookup is worth it.
        max_queued_bytes: What one peer's messages not applied yet may hold.
        inline_fps: Work a message may take as it arrives (none of its peer's waits).
        work_fps_per_s: Fingerprints of one peer's summaries applied a second,
            at most (None: no limit). Its messages wait past it, and are
            dropped as a flood once they hold ``max_queued_bytes``. The
            limit counts only where the caller says the time (``now``).
    """

    def __init__(
        self,
        policy: ChoicePolicy | None = None,
        *,
        max_queued_bytes: int = 4 << 20,
        inline_fps: int = INLINE_FPS,
        work_fps_per_s: float | None = None,
    ) -> None:
        self.policy = policy or ChoicePolicy()
        self.max_queued_bytes = max_queued_bytes
        self.inline_fps = inline_fps
        self.work_fps_per_s = work_fps_per_s
        self._peers: dict[str, PeerClaims] = {}
        self._filter = ClaimFilter()
        self._columns: dict[int, str] = {}  # the filter's column -> its peer
        self._busy: deque[str] = deque()  # peers with work queued, in turn
        self._excluded: frozenset[str] = frozenset()  # see Trust
        self._nobody = self._record("", 0, -1)  # see Trust

    def _record(self, peer: str, capacity: int, column: int) -> PeerClaims:
        budget = WorkBudget(self.work_fps_per_s)
        return PeerClaims(peer, capacity, self._filter, column, self.max_queued_bytes, budget)

    # --- what the index holds ---------------------------------------------------------

    @property
    def peers(self) -> tuple[str, ...]:
        """The peers with a summary here, in the order they came."""
        return tuple(self._peers)

    def __len__(self) -> int:
        """Claims held: (peer, fingerprint) pairs, a fingerprint two peers claim twice."""
        return sum(len(p.claims) for p in list(self._peers.values()))

    @property
    def nbytes(self) -> int:
        """What the index holds in memory: claims, filter, snapshots and messages waiting."""
        return self._filter.nbytes + sum(p.nbytes for p in list(self._peers.values()))

    @property
    def column_bytes(self) -> int:
        """What one peer's column of the filter holds (and a snapshot being assembled's)."""
        return 8 * self._filter.words

    def peer(self, peer: str) -> PeerClaims:
        """What is held of ``peer``: its ``claims``, ``strikes``, ``floods``, ``nbytes``...

        A peer with no summary here reads as one that claims nothing.
        """
        return self._peers.get(peer, self._nobody)

    def claimed_by(self, fp: int) -> frozenset[str]:
        """The peers that claim ``fp``."""
        return frozenset(self._holders(fp, frozenset()))

    def claimed(self, fp: int) -> bool:
        """Whether any peer not quarantined claims ``fp``. Safe from another thread.

        The filter names the peers that may; each is checked until one does.
        A structure the node's thread changes meanwhile counts as claimed
        (the node's choice then decides).
        """
        try:
            return next(self._holders(fp, self._excluded), None) is not None
        except (RuntimeError, IndexError, KeyError):  # changed under us
            return True

    def _holders(self, fp: int, excluded: frozenset[str]) -> Iterator[str]:
        peers, columns = self._peers, self._columns
        for column in self._filter.holders(fp):
            peer = columns.get(column)
            record = None if peer is None or peer in excluded else peers.get(peer)
            if record is not None and fp in record.claims:
                yield record.peer

    def position(self, peer: str) -> tuple[bytes, int, bool] | None:
        """``peer``'s epoch, last sequence and whether a whole snapshot arrived."""
        found = self._peers.get(peer)
        return None if found is None else (found.epoch, found.seq, found.synced)

    # --- membership -----------------------------------------------------------------

    def add_peer(self, peer: str, capacity: int) -> Resync:
        """A session with ``peer`` is ready: it may claim at most ``capacity`` keys.

        Returns the snapshot request to send (a peer sends one on session ready
        anyway; asking costs nothing and covers a lost one). A peer added again
        (a new session) keeps its summary until its epoch says otherwise; the
        probes of its old session are over.
        """
        found = self._peers.get(peer)
        if found is None:
            column = self._filter.open()
            found = self._peers[peer] = self._record(peer, capacity, column)
            self._columns[column] = peer
        else:
            found.cut(capacity)
            found.in_flight = 0
        return found.resync()

    def remove_peer(self, peer: str) -> None:
        """``peer`` is gone (its session ended): forget its claims."""
        found = self._peers.pop(peer, None)
        if found is not None:
            del self._columns[found.column]
            self._filter.close(found.column)
            self._excluded = self._excluded - {peer}

    # --- summaries --------------------------------------------------------------------

    def delta(
        self,
        peer: str,
        epoch: bytes,
        seq: int,
        add: Fingerprints,
        remove: Fingerprints,
        *,
        now: float | None = None,
    ) -> Resync | None:
        """``peer``'s delta number ``seq``: applied in turn; a Resync to send if it asks one.

        Applied at once if it is small and nothing of the peer's waits (and,
        at ``now``, its work budget allows); otherwise by :meth:`work`.
        """
        return self._received(peer, Delta(epoch, seq, raw(add), raw(remove)), now)

    def snapshot(
        self,
        peer: str,
        epoch: bytes,
        upto_seq: int,
        *,
        part: int,
        parts: int,
        fps: Fingerprints,
        now: float | None = None,
    ) -> Resync | None:
        """Part ``part`` of ``parts`` of ``peer``'s snapshot as of ``upto_seq``, applied in turn.

        The claims change only once the last missing part is in: they become
        the snapshot's keys, then every delta after ``upto_seq`` that came
        meanwhile, in order. A part older than what is held or assembled is
        dropped; a newer snapshot replaces the one being assembled. Returns a
        Resync if applying it showed a gap (or it came as a flood).
        """
        return self._received(peer, Part(epoch, upto_seq, part, parts, raw(fps)), now)

    def _received(self, peer: str, message: Incoming, now: float | None) -> Resync | None:
        found = self._peers.get(peer)
        if found is None:
            return None  # no session: nothing to keep it for
        first = not found.pending
        resync = found.receive(message)
        if first and found.budget.ready(now):
            resync = self._run(found, self.inline_fps, now) or resync
        if found.pending and peer not in self._busy:
            self._busy.append(peer)
        return resync

    @property
    def pending(self) -> bool:
        """Whether summary messages wait for :meth:`work` (now, or once a budget allows)."""
        return bool(self._busy)

    def ready_at(self, now: float) -> float | None:
        """When :meth:`work` has work it may do: ``now``, later (budgets), or None (none waits)."""
        peers = self._peers
        times = [peers[p].budget.ready_at(now) for p in self._busy if p in peers]
        return min(times, default=None)

    def work(self, most: int = SLICE_FPS, now: float | None = None) -> list[Resync]:
        """Apply about ``most`` fingerprints of the next waiting peer's messages.

        Peers take turns, a call each: one that sends a lot never holds up
        the others, and one past its work budget at ``now`` waits for it
        (:meth:`ready_at`). Returns the resyncs to send.
        """
        busy = self._busy
        for _ in range(len(busy)):
            peer = busy.popleft()
            found = self._peers.get(peer)
            if found is None or not found.pending:
                continue
            if not found.budget.ready(now):
                busy.append(peer)
                continue
            resync = self._run(found, most, now)
            if found.pending:
                busy.append(peer)
            return [] if resync is None else [resync]
        return []

    def _run(self, found: PeerClaims, most: int, now: float | None) -> Resync | None:
        """Up to ``most`` of a peer's waiting work; the last resync it asked."""
        resync = None
        used = 0
        while used < most and found.pending:
            done, asked = found.step(most - used)
            used += done
            resync = asked or resync
        found.budget.spend(used, now)
        return resync

    def missed(self, peer: str, fps: Fingerprints) -> None:
        """``peer`` answered MISS for keys it claimed: it no longer holds them."""
        found = self._peers.get(peer)
        if found is not None:
            found.missed(raw(fps))
