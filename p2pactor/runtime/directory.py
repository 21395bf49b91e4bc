"""The node's directory: the summaries (``kvsum/1``) both ways, and the choice.

:class:`SourceDirectory` does the I/O of the core's two halves on the node's
thread: :class:`~p2pactor.core.sources.holdings.Holdings` (what this node's engine
holds, fed by the parent, the engine's stores and our loads, corrected when
our server answers MISS for a key we claimed; it says which deltas and
snapshot parts are due, sent here on the node's timer) and
:class:`~p2pactor.core.sources.SourceIndex` (what the peers claim: a small
message applied as it arrives, a large one by :meth:`SourceDirectory.run`, a
slice of a few milliseconds at a time, so no peer's summary holds up anyone's
lookups). The choice and its lookups are :mod:`p2pactor.runtime.sources`'s.
Only sessions where both sides offered the feature take part: a stock vLLM
peer is never sent a summary message and is never chosen.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import attrs
import trio

from p2pactor.core import protocol as wire
from p2pactor.core.sources import SourceIndex
from p2pactor.core.sources.holdings import Holdings, Out
from p2pactor.core.sources.peer import Resync
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.sources import AutoChoice, AutoProbe, Decision, SourceOptions
from p2pactor.runtime.timers import Timers

log = logging.getLogger("p2pactor.sources")

_EPOCH_BYTES = 16


@attrs.define
class DirectoryCounts:
    """What the directory did, for metrics and the demo's table (totals since start).

    Attributes:
        chosen: Requests sent to a peer by automatic choice.
        unclaimed: Requests no live peer claimed: a MISS at once.
        not_worth: Requests a peer claimed, but not enough to be worth a round trip.
        probed_keys: Claimed keys asked of chosen peers.
        false_claims: Of those, the keys the peer answered MISS for (or never
            answered), refusals aside.
        refused_claims: Of those, the keys the peer refused over a quota.
        undelivered_claims: Of those, the keys answered HIT and then not delivered.
        bytes_sent: Summary bytes sent (fingerprints, 8 per key), to all peers.
        summary_floods: Times a peer's summary messages came faster than they
            were applied, and were dropped.
    """

    chosen: int = 0
    unclaimed: int = 0
    not_worth: int = 0
    probed_keys: int = 0
    false_claims: int = 0
    refused_claims: int = 0
    undelivered_claims: int = 0
    deltas_sent: int = 0
    parts_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    resyncs_sent: int = 0
    summary_floods: int = 0


class SummaryPeer(Protocol):
    """A session summaries go over (a :class:`~p2pactor.runtime.session.PeerSession`)."""

    @property
    def peer_id(self) -> str:
        """The peer's id."""
        ...

    def send(self, msg: wire.Message) -> None:
        """Queue ``msg`` for the peer; never blocks."""


class SourceDirectory(AutoChoice):
    """The summaries both ways, and the choice of a source. Made by the node's host.

    Args:
        options: The node's source options.
        capacity: The most keys this node's engine holds (its blocks).
        timers: The node's timer (flushes and paced parts are armed on it).
        clock: The node's clock.

    Attributes:
        scrubs: Batches of held keys to check with the engine's parent (the engine takes them).
        checked: Whether the engine checks held keys with its parent (it took a batch once).
        frontier: The held keys the parent evicts next (checked after it allocates).
    """

    def __init__(
        self,
        options: SourceOptions,
        *,
        capacity: int,
        timers: Timers,
        clock: Callable[[], float],
    ) -> None:
        self.options = options
        self.holdings = Holdings(
            capacity,
            epoch=os.urandom(_EPOCH_BYTES),
            options=options.summary,
            part_interval_s=options.part_interval_s,
            resync_interval_s=options.resync_interval_s,
            refresh_s=options.refresh_s,
        )
        self.index = SourceIndex(
            options.choice,
            max_queued_bytes=options.max_queued_bytes_per_peer,
            work_fps_per_s=options.peer_work_fps_per_s,
        )
        self.counts = DirectoryCounts()
        self.auto: dict[RequestActor, AutoProbe] = {}
        self._timers = timers
        self._clock = clock
        self._peers: dict[str, SummaryPeer] = {}
        self._cut_back: set[str] = set()  # peers told (in the log) they are kept to the budget
        self._flooded: set[str] = set()  # peers told (in the log) their summaries came too fast
        self._floods: dict[str, int] = {}  # each peer's floods counted so far
        self._work_wanted = trio.Event()  # set when summary messages wait for :meth:`run`
        self._armed: float | None = None
        self.decisions: dict[str, Decision] = {}
        self.scrubs: deque[list[bytes]] = deque()
        self.checked = False
        self.frontier: list[bytes] = []

    @property
    def enabled(self) -> bool:
        """Whether summaries are exchanged at all (``SourceOptions.share``)."""
        return self.options.share

    @property
    def peers(self) -> tuple[str, ...]:
        """The peers summaries are exchanged with now."""
        return tuple(self._peers)

    # --- what this node holds ---------------------------------------------------------

    def stored(
        self,
        keys: Iterable[bytes],
        request: str | None = None,
        positions: Sequence[int | None] | None = None,
    ) -> None:
        """This node's engine now holds ``keys`` (a store, or a load of ours)."""
        self.holdings.stored(keys, self._clock(), request=request, positions=positions)
        self._arm()

    def came(self, key: bytes) -> None:
        """The engine stored ``key`` (an embedded cache's exact account)."""
        self.stored((key,))

    def went(self, key: bytes) -> None:
        """The engine evicted ``key`` (an embedded cache's exact account)."""
        self.holdings.gone((key,), self._clock())
        self._arm()

    def pinned(self, job: int, keys: Sequence[bytes]) -> None:
        """Our server pinned ``keys`` for a peer (parent job ``job``)."""
        self.holdings.pinned(job, keys)

    def released(self, job: int) -> None:
        """A pin of our server's was released."""
        self.holdings.released(job, self._clock())

    def answered_miss(self, keys: Iterable[bytes]) -> None:
        """Our server answered MISS for ``keys``: any of them we claimed, we don't hold."""
        held = self.holdings
        claimed = [k for k in keys if k in held]
        if claimed:
            held.gone(claimed, self._clock())
            self._arm()

    def told(
        self, change: Callable[[float], object], flush: bool = False, scrub: bool = False
    ) -> None:
        """Apply an engine call about what this node holds (``Node.holds`` and the others).

        ``change`` is a :attr:`holdings` method given all but the time; with
        ``flush``, the peers hear of it at once, not with the next batched
        delta; ``scrub``: it answers a check (the frontier stays as it was).
        Then the check it makes due is planned.
        """
        now = self._clock()
        change(now)
        if flush:
            self._send(self.holdings.flush_all(now))
        if self.checked and not scrub:
            self.frontier = self.holdings.frontier()
        self._plan_scrub(now)
        self._arm()

    def drained(self) -> None:
        """The engine dropped everything it held: a new epoch, told to every peer at once."""
        self.scrubs.clear()
        self.told(
            lambda now: self._send(self.holdings.drain(os.urandom(_EPOCH_BYTES), now, self._peers))
        )

    # --- sessions ---------------------------------------------------------------------

    def peer_accepted(self, session: SummaryPeer, capacity: int) -> None:
        """``session``'s peer offered summaries and registered ``capacity`` blocks.

        From now on its summary messages are read (they may arrive before our
        side of the handshake is done).
        """
        peer, most = session.peer_id, self.options.max_claims_per_peer
        if capacity > most and peer not in self._cut_back:
            self._cut_back.add(peer)
            log.warning(
                "%s registered %d blocks; this node keeps at most %d of its claims "
                "(SourceOptions.peer_budget_bytes, %d bytes): raise it if the peer is "
                "legitimate and this node has the memory",
                peer,
                capacity,
                most,
                self.options.peer_budget_bytes,
            )
        self._peers[peer] = session
        self.index.add_peer(peer, min(capacity, most))  # its snapshot is on its way

    def peer_ready(self, session: SummaryPeer) -> None:
        """``session`` is ready both ways: send the peer our snapshot."""
        if self._peers.get(session.peer_id) is session:
            self._send(self.holdings.started(session.peer_id, self._clock()))
            self._arm()

    def peer_closed(self, peer: str, current: SummaryPeer | None) -> None:
        """A session of ``peer`` closed; ``current`` is its session now, if it has one."""
        found = self._peers.get(peer)
        if found is not None and found is not current:
            del self._peers[peer]
            self.holdings.forget(peer)
        if current is None:
            self.index.remove_peer(peer)
            self._floods.pop(peer, None)  # its count starts over with its next session

    def received(self, session: SummaryPeer, msg: wire.SummaryMessage) -> None:
        """Take one of ``session``'s summary messages: applied now if small, else by :meth:`run`."""
        peer = session.peer_id
        if self._peers.get(peer) is not session:
            return  # an ended session's last frames
        index = self.index
        resync = None
        match msg:
            case wire.KvsumDelta():
                self.counts.bytes_received += len(msg.add) + len(msg.remove)
                resync = index.delta(
                    peer, msg.epoch, msg.seq, msg.add, msg.remove, now=self._clock()
                )
            case wire.KvsumSnapshot():
                self.counts.bytes_received += len(msg.fps)
                resync = index.snapshot(
                    peer,
                    msg.epoch,
                    msg.upto_seq,
                    part=msg.part,
                    parts=msg.parts,
                    fps=msg.fps,
                    now=self._clock(),
                )
            case wire.KvsumResync():
                self._send(self.holdings.asked(peer, self._clock()))
                self._arm()
        if resync is not None:
            self._resync(resync)
        floods = index.floods(peer)
        if floods != self._floods.get(peer, 0):
            self._flood(peer, floods)
        if index.pending:
            self._work_wanted.set()

    async def run(self) -> None:
        """Apply the summary messages that wait, a slice at a time (the node runs this task).

        Between two slices the node's other tasks run: a peer that sends a
        snapshot of a million keys, or deltas as fast as it can, costs
        everyone else at most a slice's wait, and peers take turns. A peer
        past its work budget (``SourceOptions.peer_work_fps_per_s``) waits
        for it, while the others go on.
        """
        index = self.index
        while True:
            await self._work_wanted.wait()
            self._work_wanted = trio.Event()
            while (ready := index.ready_at(now := self._clock())) is not None:
                if ready > now:
                    # Every peer with work waits for its budget: until the first
                    # may go on, or a message of another peer comes.
                    with trio.move_on_at(ready):
                        await self._work_wanted.wait()
                    self._work_wanted = trio.Event()
                    continue
                for resync in index.work(now=now):
                    self._resync(resync)
                await trio.lowlevel.checkpoint()

    def _resync(self, resync: Resync) -> None:
        """Ask ``resync.peer`` for a snapshot."""
        session = self._peers.get(resync.peer)
        if session is not None:
            self.counts.resyncs_sent += 1
            session.send(wire.KvsumResync(epoch=resync.epoch, from_seq=resync.from_seq))

    def _flood(self, peer: str, floods: int) -> None:
        """``peer``'s messages came faster than they were applied (again): count it, say once."""
        self.counts.summary_floods += floods - self._floods.get(peer, 0)
        self._floods[peer] = floods
        if peer not in self._flooded:
            self._flooded.add(peer)
            log.warning(
                "%s sends summary messages faster than this node applies them (more than %d "
                "bytes waiting): they were dropped and its summary asked again "
                "(SourceOptions.peer_budget_bytes bounds what may wait)",
                peer,
                self.options.max_queued_bytes_per_peer,
            )

    # --- the timer: flushes and paced snapshot parts ---------------------------------

    @property
    def deadline(self) -> float | None:
        """When :meth:`expire` runs next (the node's timer reads it)."""
        return self._armed

    def expire(self) -> None:
        """Flush what is due, start a refresh when due, send the parts due (from the timer).

        It may run early (what was due moved later): then nothing is due yet,
        and it is armed again for when something is.
        """
        self._armed = None
        now = self._clock()
        self.index.release(now)
        self._send(self.holdings.due(now, self._peers))
        self._plan_scrub(now)
        self._arm()

    def _plan_scrub(self, now: float) -> None:
        """A batch of held keys for the engine to check, if one is due and none is out."""
        if self.checked and not self.scrubs:
            batch = self.holdings.plan_scrub(now)
            if batch:
                self.scrubs.append(batch)

    def _arm(self) -> None:
        times = (
            self.holdings.next_due(),
            self.holdings.next_scrub() if self.checked else None,
            self.index.next_release(),
        )
        when = min((t for t in times if t is not None), default=None)
        if when is not None and (self._armed is None or when < self._armed):
            self._armed = when
            self._timers.arm(self)

    def _send(self, out: list[Out]) -> None:
        """Send what :attr:`holdings` returned: a delta to every summary peer, a part to one."""
        counts, peers = self.counts, self._peers
        for peer, msg in out:
            if isinstance(msg, wire.KvsumDelta):
                for each in peers.values():
                    each.send(msg)
                counts.deltas_sent += len(peers)
                counts.bytes_sent += (len(msg.add) + len(msg.remove)) * len(peers)
            elif peer is not None and (session := peers.get(peer)) is not None:
                session.send(msg)
                counts.parts_sent += 1
                counts.bytes_sent += len(msg.fps)
