"""The node's directory: what it tells peers it holds, what they claim, and the choice.

:class:`SourceDirectory` runs the summary extension (``kvsum/1``) on the
node's thread. It keeps the core's two halves and does their I/O:

- :class:`~p2pactor.core.holdings.Holdings`, the keys this node's engine
  holds, fed by the parent (an embedded cache tells it exactly), the engine's
  stores and our loads, and corrected when our server answers MISS for a key
  we claimed. Its changes go to every summary peer as deltas, on the node's
  timer; a peer whose session becomes ready, or that asks, gets a snapshot,
  one part per ``part_interval_s`` so its lookups never wait behind it.
- :class:`~p2pactor.core.sources.SourceIndex`, what the peers claim, fed by
  their deltas and snapshots: a small message is applied as it arrives, a
  large one (and any behind it) by :meth:`SourceDirectory.run`, a slice of
  a few milliseconds at a time with the node's other tasks between, so no
  peer's summary holds up anyone's lookups. :meth:`SourceDirectory.choose` picks the peer
  worth a lookup for a request that names none; the lookups it starts are
  followed (:meth:`SourceDirectory.stepped`) so each peer's precision is
  measured, and a key it claimed and missed is dropped from its claims.

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
import msgspec
import trio

from p2pactor.core import events as ev
from p2pactor.core import protocol as wire
from p2pactor.core.choice import Choice
from p2pactor.core.consumer import ConsumerState, probe_answers
from p2pactor.core.holdings import Holdings, Out
from p2pactor.core.inputs import LookupResult
from p2pactor.core.sources import Resync, SourceIndex, fingerprint
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.auto_probe import AutoProbe
from p2pactor.runtime.source_options import SourceOptions
from p2pactor.runtime.sources_calls import (
    Decision,
    Drained,
    Ended,
    Held,
    Lacking,
    Reserved,
    Reused,
    Scrubbed,
    Touched,
)
from p2pactor.runtime.timers import Timers

log = logging.getLogger("p2pactor.sources")

_EPOCH_BYTES = 16
_MAX_DECISIONS = 1 << 16  # a bound, not a policy: every request's finish forgets its own


@attrs.define
class DirectoryCounts:
    """What the directory did, for metrics and the demo's table (totals since start)."""

    chosen: int = 0
    """Requests sent to a peer by automatic choice."""
    unclaimed: int = 0
    """Requests no live peer claimed: a MISS at once."""
    not_worth: int = 0
    """Requests a peer claimed, but not enough to be worth a round trip."""
    probed_keys: int = 0
    """Claimed keys asked of chosen peers."""
    false_claims: int = 0
    """Of those, the keys the peer answered MISS for (or never answered), refusals aside."""
    refused_claims: int = 0
    """Of those, the keys the peer refused over a quota (a p2pactor peer says so)."""
    undelivered_claims: int = 0
    """Of those, the keys the peer answered HIT for and then failed to deliver."""
    deltas_sent: int = 0
    parts_sent: int = 0
    bytes_sent: int = 0
    """Summary bytes sent (fingerprints, 8 per key), to all peers."""
    bytes_received: int = 0
    resyncs_sent: int = 0
    summary_floods: int = 0
    """Times a peer's summary messages came faster than they were applied, and were dropped."""


class SummaryPeer(Protocol):
    """A session summaries go over (a :class:`~p2pactor.runtime.session.PeerSession`)."""

    @property
    def peer_id(self) -> str:
        """The peer's id."""
        ...

    def send(self, msg: wire.Message) -> None:
        """Queue ``msg`` for the peer; never blocks."""


class SourceDirectory:
    """The summaries both ways, and the choice of a source. Made by the node's host.

    Args:
        options: The node's source options.
        capacity: The most keys this node's engine holds (its blocks).
        timers: The node's timer (flushes and paced parts are armed on it).
        clock: The node's clock.
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
        # Read by engine threads (one dict lookup, or a pop: atomic).
        self.decisions: dict[str, Decision] = {}
        self.scrubs: deque[list[bytes]] = deque()
        """Batches of held keys to check with the engine's parent (the engine takes them)."""
        self.checked = False
        """Whether the engine checks held keys with its parent (it took a batch once)."""
        self.frontier: list[bytes] = []
        """The held keys the parent evicts next (the engine checks them after it allocates)."""

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
        self.holdings.stored((key,), self._clock())
        self._arm()

    def went(self, key: bytes) -> None:
        """The engine evicted ``key`` (an embedded cache's exact account)."""
        self.holdings.gone((key,), self._clock())
        self._arm()

    def touched(self, keys: Iterable[bytes]) -> None:
        """The engine reused ``keys``."""
        self.holdings.touched(keys)

    def gone(self, keys: Iterable[bytes]) -> None:
        """This node's engine no longer holds ``keys``."""
        self.holdings.gone(keys, self._clock())
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
            self.gone(claimed)

    def drained(self) -> None:
        """The engine dropped everything: a new epoch, told to every peer at once."""
        self._send(self.holdings.drain(os.urandom(_EPOCH_BYTES), self._clock(), self._peers))
        self._arm()

    def apply(
        self, call: Held | Reused | Ended | Touched | Lacking | Reserved | Drained | Scrubbed
    ) -> None:
        """Apply an engine call about what this node holds; plan the check it makes due."""
        holdings, now = self.holdings, self._clock()
        match call:
            case Held(keys, request, positions, at_once):
                self.stored(keys, request, positions)
                if at_once:  # a peer may ask for them within the step
                    self._send(holdings.flush_all(now))
            case Reused(keys, request, positions):
                holdings.accessed(keys, request, positions)
            case Ended(request):
                holdings.finished(request)
            case Reserved(blocks):
                holdings.reserve(blocks, now)
                self._arm()
            case Touched(keys):
                self.touched(keys)
            case Lacking(keys):
                self.gone(keys)
            case Drained():
                self.drained()
                self.scrubs.clear()
            case Scrubbed(gone, kept):
                holdings.scrubbed(gone, kept, now)
                if gone:  # a claim the parent dropped costs every peer a lookup: tell now
                    self._send(holdings.flush_all(now))
        if self.checked and not isinstance(call, Scrubbed):
            self.frontier = holdings.frontier()
        self._plan_scrub(now)
        self._arm()

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

    # --- choosing a source --------------------------------------------------------------

    def choose(self, keys: Sequence[bytes]) -> Choice:
        """The peer to look up for a request's ``keys`` (in order), and why."""
        choice = self.index.choose([fingerprint(k) for k in keys], self._clock())
        counts = self.counts
        if choice.chosen is not None:
            counts.chosen += 1
        elif choice.claims:
            counts.not_worth += 1
        else:
            counts.unclaimed += 1
        most = self.options.recorded_claims
        if len(choice.claims) > most:
            choice = msgspec.structs.replace(choice, claims=choice.claims[:most])
        return choice

    def decided(self, kv_request_id: str, decision: Decision) -> None:
        """Publish the choice for an engine's request (its thread reads :meth:`decision`)."""
        decisions = self.decisions
        if len(decisions) >= _MAX_DECISIONS:
            del decisions[next(iter(decisions))]
        decisions[kv_request_id] = decision

    def decision(self, kv_request_id: str) -> Decision | None:
        """The choice made for ``kv_request_id``, None while it is being made. Any thread."""
        return self.decisions.get(kv_request_id)

    def finished(self, kv_request_id: str) -> None:
        """The engine is done with ``kv_request_id``: forget its choice."""
        self.decisions.pop(kv_request_id, None)

    def probe_started(self, actor: RequestActor, choice: Choice, keys: Sequence[bytes]) -> None:
        """A lookup of ``keys`` went to ``choice.chosen`` through ``actor``; follow it."""
        assert choice.chosen is not None
        run = choice.claims[0].run if choice.claims else len(keys)
        claimed = tuple(keys[:run])
        if actor in self.auto:
            return  # the request asked again: its first probe is the one measured
        self.auto[actor] = AutoProbe(choice.chosen, claimed)
        self.index.probe_started(choice.chosen)
        self.counts.probed_keys += len(claimed)

    def stepped(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """``actor`` (of :attr:`auto`) stepped: score its answers, then its fetches' outcome."""
        probe = self.auto[actor]
        probe.follow(events)
        if not probe.answered:
            state = actor.state
            assert isinstance(state, ConsumerState)
            answers = probe_answers(state, probe.claimed)
            if LookupResult.RETRY in answers and not actor.done:
                return
            self._answered(probe, answers, state.refused)
        if probe.held > 0 and not (probe.ended or actor.done):
            return  # its hits are scored once their fetches are over
        del self.auto[actor]
        self.counts.undelivered_claims += min(probe.held, probe.failed)
        was = self.index.quarantined(probe.peer, self._clock())
        now = self._clock()
        self.index.score(probe.peer, probe.counted, probe.held_by_deed, now)
        if probe.delivered or probe.failed_jobs:
            self.index.fetches_ended(
                probe.peer, delivered=probe.delivered, failed=probe.failed_jobs, now=now
            )
        if not was and self.index.quarantined(probe.peer, self._clock()):
            log.warning(
                "%s's summary claims keys it does not deliver (%d of %d probed held); not "
                "choosing it automatically for a while (it stays usable as a named source)",
                probe.peer,
                probe.held_by_deed,
                probe.counted,
            )
            self._arm()  # its claims count again when the quarantine ends

    def _answered(
        self, probe: AutoProbe, answers: Sequence[LookupResult], refused: frozenset[bytes]
    ) -> None:
        """The claimed keys are answered: a MISS is a false claim now, a HIT awaits its fetch."""
        probe.answered = True
        # A quota's refusal says nothing of what the peer holds: no false claim.
        missed = [
            fingerprint(k)
            for k, a in zip(probe.claimed, answers, strict=True)
            if a is not LookupResult.HIT and k not in refused
        ]
        spared = sum(1 for k in probe.claimed if k in refused)
        probe.held = answers.count(LookupResult.HIT)
        probe.counted = len(probe.claimed) - spared
        self.counts.false_claims += len(missed)
        self.counts.refused_claims += spared
        self.index.missed(probe.peer, missed)
        self.index.probe_answered(probe.peer)

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

    def _due(self) -> float | None:
        times = (
            self.holdings.next_due(),
            self.holdings.next_scrub() if self.checked else None,
            self.index.next_release(),
        )
        return min((t for t in times if t is not None), default=None)

    def _arm(self) -> None:
        when = self._due()
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
