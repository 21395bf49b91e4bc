"""The node's source index on its thread: the summaries (``kvsum/1``) both ways, and the choice.

:class:`SourceDirectory` does the I/O of the core's two halves on the node's
thread: :class:`~p2pactor.core.sources.holdings.Holdings` (what this node's engine
holds, fed by the parent, the engine's stores and our loads, corrected when
our server answers MISS for a key we claimed; it says which deltas and
snapshot parts are due, sent here on the node's timer) and
:class:`~p2pactor.core.sources.SourceIndex` (what the peers claim: a small
message applied as it arrives, a large one by :meth:`SourceDirectory.run`, a
slice of a few milliseconds at a time, so no peer's summary holds up anyone's
lookups). It chooses a source for a request that names none and follows
the lookups it starts (:class:`~p2pactor.runtime.sources.AutoProbe`).
Only sessions where both sides offered the feature take part: a stock vLLM
peer is never sent a summary message and is never chosen.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable, Sequence

import trio

from p2pactor.core import events as ev
from p2pactor.core import protocol as wire
from p2pactor.core.choice import Choice
from p2pactor.core.consumer import ConsumerState, probe_answers
from p2pactor.core.inputs import LookupResult, ParentAnswer
from p2pactor.core.sources import SourceIndex, fingerprint
from p2pactor.core.sources.holdings import Holdings, Out
from p2pactor.core.sources.peer import Resync
from p2pactor.runtime.actor import Ground, RequestActor
from p2pactor.runtime.sources import AutoProbe, DirectoryCounts, SummaryPeer

log = logging.getLogger("p2pactor.sources")

_EPOCH_BYTES = 16


class SourceDirectory:
    """The summaries both ways, and the choice of a source. Made by the node's host.

    Args:
        ground: The node's (its ``sources`` options; its ``num_blocks``, the
            most keys its engine holds; flushes and paced parts are armed on
            its timer).

    Attributes:
        auto: The lookups the choice started, followed, by their request's actor.
        decisions: The choices published, by ``kv_request_id`` (read by engine
            threads: one dict lookup, or a pop, atomic; the engine's finish
            pops its own); one of nobody when the chosen peer may not be dialed.
        scrub: Held keys to check with the engine's parent (the engine takes them).
        checked: Whether the engine checks held keys with its parent (it took a batch once).
        frontier: The held keys the parent evicts next (checked after it allocates).
        deadline: When :meth:`expire` runs next (the node's timer reads it).
    """

    def __init__(self, ground: Ground) -> None:
        self.options = options = ground.config.sources
        self.holdings = Holdings(
            ground.config.num_blocks,
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
        self.decisions: dict[str, Choice] = {}
        self._timers = ground.timers
        self._clock = ground.clock
        self._peers: dict[str, SummaryPeer] = {}
        self._warned: set[tuple[str, str]] = set()  # (peer, what) told once in the log
        self._work_wanted = trio.Event()  # set when summary messages wait for :meth:`run`
        self.deadline: float | None = None
        # One batch at most; a deque, as the engine's thread takes it (popleft is atomic).
        self.scrub: deque[list[bytes]] = deque()
        self.checked = False
        self.frontier: list[bytes] = []

    # --- what this node holds ---------------------------------------------------------

    def came(self, key: bytes) -> None:
        """The engine stored ``key`` (an embedded cache's exact account)."""
        self.holdings.stored((key,), self._clock())
        self.arm()

    def went(self, key: bytes) -> None:
        """The engine evicted ``key`` (an embedded cache's exact account)."""
        self.holdings.gone((key,), self._clock())
        self.arm()

    def released(self, job: int) -> None:
        """A pin of our server's was released."""
        self.holdings.released(job, self._clock())

    def answered(self, answer: ParentAnswer) -> None:
        """Our server's parent answered a peer's lookup: what it pinned, what it lacks.

        The parent evicts around pinned keys until they are released; a key we
        claimed that it answered MISS for, we don't hold.
        """
        held = self.holdings
        if answer.pin is not None:
            held.pinned(answer.pin.job_id, answer.pin.keys)
        claimed = [k for k, result in answer.results if result is LookupResult.MISS and k in held]
        if claimed:
            held.gone(claimed, self._clock())
            self.arm()

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
        self.arm()

    def drained(self, now: float) -> None:
        """The engine dropped everything it held: a new epoch, told to every peer at once.

        A change for :meth:`told` (``Node.drained``).
        """
        self.scrub.clear()
        self._send(self.holdings.drain(os.urandom(_EPOCH_BYTES), now, self._peers))

    # --- sessions ---------------------------------------------------------------------

    def peer_accepted(self, session: SummaryPeer, capacity: int) -> None:
        """``session``'s peer offered summaries and registered ``capacity`` blocks.

        From now on its summary messages are read (they may arrive before our
        side of the handshake is done).
        """
        peer = session.peer_id
        most = self.options.max_claims_per_peer
        if capacity > most and self._first(peer, "cut back"):
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
            self.arm()

    def peer_closed(self, peer: str, current: SummaryPeer | None) -> None:
        """A session of ``peer`` closed; ``current`` is its session now, if it has one."""
        found = self._peers.get(peer)
        if found is not None and found is not current:
            del self._peers[peer]
            self.holdings.forget(peer)
        if current is None:
            self.index.remove_peer(peer)

    def received(self, session: SummaryPeer, msg: wire.SummaryMessage) -> None:
        """Take one of ``session``'s summary messages: applied now if small, else by :meth:`run`."""
        peer = session.peer_id
        index = self.index
        now = self._clock()
        if self._peers.get(peer) is not session:
            return  # an ended session's last frames
        floods = index.peer(peer).floods
        resync = None
        match msg:
            case wire.KvsumDelta():
                self.counts.bytes_received += len(msg.add) + len(msg.remove)
                resync = index.delta(peer, msg.epoch, msg.seq, msg.add, msg.remove, now=now)
            case wire.KvsumSnapshot():
                self.counts.bytes_received += len(msg.fps)
                resync = index.snapshot(
                    peer,
                    msg.epoch,
                    msg.upto_seq,
                    part=msg.part,
                    parts=msg.parts,
                    fps=msg.fps,
                    now=now,
                )
            case wire.KvsumResync():
                self._send(self.holdings.asked(peer, now))
                self.arm()
        if resync is not None:
            self._resync(resync)
        floods = index.peer(peer).floods - floods
        self.counts.summary_floods += floods
        if floods and self._first(peer, "flooded"):
            log.warning(
                "%s sends summary messages faster than this node applies them (more than %d "
                "bytes waiting): they were dropped and its summary asked again "
                "(SourceOptions.peer_budget_bytes bounds what may wait)",
                peer,
                self.options.max_queued_bytes_per_peer,
            )
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

    def _first(self, peer: str, what: str) -> bool:
        """Whether ``peer`` is told of ``what`` for the first time (the log says it once)."""
        first = (peer, what) not in self._warned
        self._warned.add((peer, what))
        return first

    # --- the timer: flushes and paced snapshot parts ---------------------------------

    def expire(self) -> None:
        """Flush what is due, start a refresh when due, send the parts due (from the timer).

        It may run early (what was due moved later): then nothing is due yet,
        and it is armed again for when something is.
        """
        self.deadline = None
        now = self._clock()
        self.index.release(now)
        self._send(self.holdings.due(now, self._peers))
        self._plan_scrub(now)
        self.arm()

    def _plan_scrub(self, now: float) -> None:
        """A batch of held keys for the engine to check, if one is due and none is out."""
        if self.checked and not self.scrub and (batch := self.holdings.plan_scrub(now)):
            self.scrub.append(batch)

    def arm(self) -> None:
        """Arm the timer for what is due first: a flush, a part, a check, a quarantine's end."""
        times = (
            self.holdings.next_due(),
            self.holdings.next_scrub() if self.checked else None,
            self.index.next_release(),
        )
        when = min((t for t in times if t is not None), default=None)
        if when is not None and (self.deadline is None or when < self.deadline):
            self.deadline = when
            self._timers.arm(self)

    def _send(self, out: list[Out]) -> None:
        """Send what :attr:`holdings` returned: a delta to every summary peer, a part to one."""
        counts = self.counts
        peers = self._peers
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

    # --- the choice, and the lookups it starts ---------------------------------------

    def choose(self, keys: Sequence[bytes]) -> Choice:
        """The peer to look up for a request's ``keys`` (in order), and why."""
        most = self.options.recorded_claims
        choice = self.index.choose([fingerprint(k) for k in keys], self._clock(), most=most)
        counts = self.counts
        if choice.chosen is not None:
            counts.chosen += 1
        elif choice.claims:
            counts.not_worth += 1
        else:
            counts.unclaimed += 1
        return choice

    def probe_started(self, actor: RequestActor, choice: Choice, keys: Sequence[bytes]) -> None:
        """A lookup of ``keys`` went to ``choice.chosen`` through ``actor``; follow it."""
        assert choice.chosen is not None
        if actor in self.auto:
            return  # the request asked again: its first probe is the one measured
        claimed = tuple(keys[: choice.claims[0].run if choice.claims else len(keys)])
        self.auto[actor] = AutoProbe(choice.chosen, claimed)
        self.index.probe_started(choice.chosen)
        self.counts.probed_keys += len(claimed)

    def stepped(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """``actor`` (of :attr:`auto`) stepped: score its answers, then its fetches' outcome.

        A few failed fetches in a row quarantine the peer whatever its
        precision (``ChoicePolicy.max_failed_fetches``).
        """
        probe, counts, index = self.auto[actor], self.counts, self.index
        probe.follow(events)
        if not probe.answered:
            state = actor.state
            assert isinstance(state, ConsumerState)
            answers = probe_answers(state, probe.claimed)
            if LookupResult.RETRY in answers and not actor.done:
                return
            missed = probe.answer(answers, state.refused)
            counts.false_claims += len(missed)
            counts.refused_claims += len(probe.claimed) - probe.counted
            index.missed(probe.peer, missed)
            index.probe_answered(probe.peer)
        if probe.held > 0 and not (probe.ended or actor.done):
            return  # its hits are scored once their fetches are over
        del self.auto[actor]
        counts.undelivered_claims += min(probe.held, probe.failed)
        now = self._clock()
        quarantined = index.score(probe.peer, probe.counted, probe.held_by_deed, now)
        if probe.delivered or probe.failed_jobs:
            quarantined |= index.fetches_ended(
                probe.peer, delivered=probe.delivered, failed=probe.failed_jobs, now=now
            )
        if quarantined:
            log.warning(
                "%s's summary claims keys it does not deliver (%d of %d probed held); not "
                "choosing it automatically for a while (it stays usable as a named source)",
                probe.peer,
                probe.held_by_deed,
                probe.counted,
            )
            self.arm()  # its claims count again when the quarantine ends
