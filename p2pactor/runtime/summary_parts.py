"""Snapshots to summary peers: built once, shared, paced, and never on a peer's say-so alone.

A part of the source directory (:mod:`p2pactor.runtime.directory`). A snapshot
goes to a peer when its session is ready, on a new epoch, at each refresh, and
when the peer asks (``kvsum_resync``). What it costs this node is bounded
whatever a peer sends:

- the snapshot is built once per change of what is held (its epoch and delta
  number) and shared by every peer it goes to: a hundred resyncs in a row cost
  one fingerprinting of the held keys, not a hundred;
- a resync that comes while a snapshot to that peer is still being sent is
  answered by it; one that comes sooner than ``resync_interval_s`` after the
  last one answered waits for the interval's end: at most one snapshot a peer
  an interval, however often it asks;
- parts go one per peer every ``part_interval_s``, so the lookups sharing a
  session never wait behind a whole snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from p2pactor.core import protocol as wire
from p2pactor.core.holdings import Holdings, Snapshot, SummaryDelta, SummaryPart
from p2pactor.runtime.source_options import SourceOptions

__all__ = ["SnapshotParts", "SummaryPeer"]


class SummaryPeer(Protocol):
    """A session summaries go over (a :class:`~p2pactor.runtime.session.PeerSession`)."""

    @property
    def peer_id(self) -> str:
        """The peer's id."""
        ...

    def send(self, msg: wire.Message) -> None:
        """Queue ``msg`` for the peer; never blocks."""


class SnapshotParts:
    """The snapshot parts still to send, to whom, and when.

    Args:
        holdings: What this node holds.
        options: The node's source options (the intervals).
        sessions: The summary peers' sessions, by peer (the directory's own).
        broadcast: Sends a delta to every summary peer.
        sent: Called with each part's fingerprint bytes (the directory counts them).
    """

    def __init__(
        self,
        holdings: Holdings,
        options: SourceOptions,
        sessions: Mapping[str, SummaryPeer],
        broadcast: Callable[[SummaryDelta], None],
        sent: Callable[[int], None],
    ) -> None:
        self._holdings = holdings
        self._options = options
        self._sessions = sessions
        self._broadcast = broadcast
        self._sent = sent
        self._queues: dict[str, deque[SummaryPart]] = {}
        self._cached: tuple[bytes, int, tuple[SummaryPart, ...]] | None = None
        self._answered: dict[str, float] = {}  # when each peer's last resync was answered
        self._wanted: set[str] = set()  # resyncs that wait for their interval's end
        self.next_part: float | None = None
        self.built = 0
        """Snapshots built (fingerprinting every held key), for the tests and the bench."""

    def sending(self, peer: str) -> bool:
        """Whether a snapshot to ``peer`` is being sent."""
        return peer in self._queues

    def start(self, peer: str, now: float) -> None:
        """A snapshot to ``peer``, its first part now (ahead of any later delta)."""
        self._queues[peer] = deque(self._parts(now))
        self.send(now, only=peer)

    def asked(self, peer: str, now: float) -> None:
        """``peer`` asked for a snapshot: now, at its interval's end, or by the one under way."""
        if peer in self._queues:
            return  # the one being sent answers it
        last = self._answered.get(peer)
        if last is not None and now < last + self._options.resync_interval_s:
            self._wanted.add(peer)
            return
        self._answered[peer] = now
        self.start(peer, now)

    def to_all(self, now: float, *, fresh: Snapshot | None = None, busy_too: bool = False) -> None:
        """A snapshot to every summary peer (``fresh``: one a new epoch just made).

        A peer a snapshot is being sent to keeps that one, unless ``busy_too``.
        """
        parts = self._parts(now) if fresh is None else fresh.parts
        for peer in self._sessions:
            if busy_too or peer not in self._queues:
                self._queues[peer] = deque(parts)
        self.next_part = now  # the first parts go now

    def forget(self, peer: str) -> None:
        """``peer``'s session is gone: nothing more to send it."""
        self._queues.pop(peer, None)
        self._wanted.discard(peer)
        self._answered.pop(peer, None)

    def next_due(self) -> float | None:
        """When :meth:`send` has something to do next."""
        interval = self._options.resync_interval_s
        due = [self._answered[p] + interval for p in self._wanted]  # wanted: answered before
        if self.next_part is not None:
            due.append(self.next_part)
        return min(due, default=None)

    def send(self, now: float, only: str | None = None) -> None:
        """The resyncs whose interval ended, then one part to each peer with parts queued."""
        if only is None and self._wanted:
            self._answer_waiting(now)
        for peer in [only] if only is not None else list(self._queues):
            queue = self._queues.get(peer)
            session = self._sessions.get(peer)
            if not queue or session is None:
                self._queues.pop(peer, None)
                continue
            part = queue.popleft()
            msg = wire.KvsumSnapshot(
                epoch=part.epoch,
                upto_seq=part.upto_seq,
                part=part.part,
                parts=part.parts,
                fps=wire.packed(part.fps),
            )
            session.send(msg)
            self._sent(len(msg.fps))
            if not queue:
                del self._queues[peer]
        self.next_part = now + self._options.part_interval_s if self._queues else None

    def _answer_waiting(self, now: float) -> None:
        interval = self._options.resync_interval_s
        due = [p for p in self._wanted if now >= self._answered[p] + interval]
        for peer in due:
            self._wanted.discard(peer)
            if peer in self._sessions and peer not in self._queues:
                self._answered[peer] = now
                self._queues[peer] = deque(self._parts(now))

    def _parts(self, now: float) -> Iterable[SummaryPart]:
        """The snapshot as of now: built again only if what is held changed since."""
        holdings = self._holdings
        delta = holdings.flush(now, force=True)
        if delta is not None:
            self._broadcast(delta)  # everyone else is brought up to it first
        cached = self._cached
        if cached is not None and cached[:2] == (holdings.epoch, holdings.seq):
            return cached[2]
        snapshot = holdings.snapshot(now)
        assert snapshot.delta is None  # flushed just now
        self.built += 1
        self._cached = (holdings.epoch, holdings.seq, snapshot.parts)
        return snapshot.parts
