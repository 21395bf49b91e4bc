"""The protocol's invariants, checked event by event with small per-actor counters.

* a consumer's phase only moves forward, each event comes in a phase that
  allows it, and every load sent ends exactly once and is reported once;
* a producer releases every pin it created exactly once, closes every
  synthetic parent request it opened exactly once, renews only pins it holds,
  ends every fetched round
  exactly once, and never tells the peer a round is over (``transfer_done``,
  ``abort_ack``) nor releases a pin while a write of it is still in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from p2pactor.core import events as ev
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.producer import ProducerState

__all__ = ["ConsumerCheck", "ProducerCheck"]

_RANK: Final = {phase: rank for rank, phase in enumerate(ConsumerPhase)}


class ConsumerCheck:
    """A consumer's invariants, kept as small sets of what is in flight."""

    __slots__ = ("aborting", "loads", "reported")

    def __init__(self) -> None:
        self.loads: dict[int, int] = {}  # round -> job in flight
        self.aborting: set[int] = set()
        self.reported: set[int] = set()

    def _report_job(self, job_id: int, kind: str, problems: list[str]) -> None:
        if job_id in self.reported:
            problems.append(f"job {job_id} is reported to the engine a second time ({kind})")
        self.reported.add(job_id)

    def _end_load(self, round_seq: int, job_id: int, kind: str, problems: list[str]) -> None:
        if self.loads.get(round_seq) != job_id:
            problems.append(
                f"ends the load of round {round_seq} (job {job_id}), which is not in flight: "
                "a load ends exactly once"
            )
            return
        del self.loads[round_seq]
        self.aborting.discard(round_seq)
        self._report_job(job_id, kind, problems)

    def step(
        self,
        event: ev.AnyEvent,
        before: ConsumerState,
        after: ConsumerState,
        prev: ev.AnyEvent | None,
    ) -> list[str]:
        """What ``event`` breaks, in words; ``before`` and ``after`` are the states around it."""
        del prev  # a consumer's rules read its states
        problems: list[str] = []
        needed = _NEEDS.get(type(event))
        if needed is not None and _RANK[before.phase] < _RANK[needed]:
            problems.append(
                f"needs the request to be {needed.value} or later, but it was "
                f"{before.phase.value}: phases only move forward"
            )
        if _RANK[after.phase] < _RANK[before.phase]:
            problems.append(f"the phase went back from {before.phase.value} to {after.phase.value}")
        match event:
            case ev.Opened() if event.seq != 1:
                problems.append("Opened after the request began")
            case ev.FetchSent():
                held = self.loads.get(event.round_seq)
                if held is not None:
                    problems.append(
                        f"a second load for round {event.round_seq} while job {held} is in flight"
                    )
                if event.job_id in self.reported or event.job_id in self.loads.values():
                    problems.append(f"job {event.job_id} is loaded a second time")
                self.loads[event.round_seq] = event.job_id
            case ev.FetchSkipped():
                self._report_job(event.job_id, event.KIND, problems)
            case ev.AbortSent():
                if self.loads.get(event.round_seq) != event.job_id:
                    problems.append(
                        f"aborts round {event.round_seq} (job {event.job_id}), "
                        "which has no load in flight"
                    )
                elif event.round_seq in self.aborting:
                    problems.append(f"round {event.round_seq} is aborted a second time")
                self.aborting.add(event.round_seq)
            case ev.AbortAcked():
                if event.round_seq not in self.aborting:
                    problems.append(f"an ack of an abort of round {event.round_seq} never sent")
                self._end_load(event.round_seq, event.job_id, event.KIND, problems)
            case ev.TransferDone() | ev.Aborted():
                self._end_load(event.round_seq, event.job_id, event.KIND, problems)
            case ev.Finished():
                if (
                    event.cancelled_round is not None
                    and _RANK[before.phase] < _RANK[ConsumerPhase.PROBING]
                ):
                    problems.append(
                        f"an empty fetch while the request was {before.phase.value}: "
                        "no lookup was open"
                    )
                if not event.phase.terminal:
                    problems.append(f"Finished with phase {event.phase.value}, not a final one")
                problems.extend(
                    f"Finished with the load of round {r} (job {j}) in flight: "
                    "the engine never hears of it"
                    for r, j in sorted(self.loads.items())
                )
            case _:
                pass
        return problems

    def open_obligations(self) -> list[str]:
        """What the actor still holds, in words, were its log to stop here."""
        return [f"load of round {r} (job {j}) in flight" for r, j in sorted(self.loads.items())]


_NEEDS: Final[Mapping[type[ev.Event], ConsumerPhase]] = {
    ev.LookupResp: ConsumerPhase.PROBING,
    ev.LookupTimedOut: ConsumerPhase.PROBING,
    ev.LookupCancelled: ConsumerPhase.PROBING,
    ev.TransferDone: ConsumerPhase.FETCH_SENT,
    ev.AbortSent: ConsumerPhase.FETCH_SENT,
    ev.AbortAcked: ConsumerPhase.FETCH_SENT,
    ev.Aborted: ConsumerPhase.FETCH_SENT,
}
"""The phase a consumer must have reached before an event can happen."""


class ProducerCheck:
    """A producer's invariants, kept as small sets of what is held or in flight."""

    __slots__ = ("contexts", "contexts_closed", "ended", "held", "inflight", "released", "rounds")

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.released: set[int] = set()
        self.contexts: set[int] = set()
        self.contexts_closed: set[int] = set()
        self.rounds: set[int] = set()  # fetched, not ended
        self.ended: set[int] = set()
        self.inflight: dict[int, tuple[int, frozenset[int]]] = {}  # transfer -> (round, jobs)

    def _pin(self, job_id: int, problems: list[str]) -> None:
        if job_id in self.held:
            problems.append(f"job {job_id} is pinned again while it is held")
        elif job_id in self.released:
            problems.append(f"job {job_id} is pinned again after its release")
        self.held.add(job_id)

    def _release(self, job_id: int, prev: ev.AnyEvent | None, problems: list[str]) -> None:
        if job_id in self.held:
            self.held.remove(job_id)
            self.released.add(job_id)
            problems.extend(
                f"job {job_id} is released while transfer {tid} still reads its blocks"
                for tid, (_, jobs) in sorted(self.inflight.items())
                if job_id in jobs
            )
        elif job_id in self.released:
            problems.append(f"job {job_id} is released a second time")
        elif not _stray_release(prev):
            problems.append(f"job {job_id} is released but was never pinned")

    def _open_context(self, lookup_id: int, problems: list[str]) -> None:
        if lookup_id in self.contexts_closed:
            problems.append(f"the context of lookup {lookup_id} opens again")
        self.contexts.add(lookup_id)

    def _close_context(self, lookup_id: int, problems: list[str]) -> None:
        if lookup_id in self.contexts:
            self.contexts.remove(lookup_id)
            self.contexts_closed.add(lookup_id)
        elif lookup_id in self.contexts_closed:
            problems.append(f"the context of lookup {lookup_id} is closed a second time")
        else:
            problems.append(f"the context of lookup {lookup_id} is closed but never opened")

    def _end_round(
        self, event: ev.AnyEvent, round_seq: int, prev: ev.AnyEvent | None, problems: list[str]
    ) -> None:
        tells_peer = isinstance(event, ev.TransferDoneSent | ev.AbortAckSent)
        if tells_peer:
            problems.extend(
                f"round {round_seq} is reported over while transfer {tid} still writes into "
                "the peer's blocks, which the peer may then reuse"
                for tid, (rnd, _) in sorted(self.inflight.items())
                if rnd == round_seq
            )
        # An abort that crossed the round's end on the wire is acked again at once.
        crossed_abort = (
            isinstance(event, ev.AbortAckSent)
            and isinstance(prev, ev.AbortReceived)
            and prev.round_seq == round_seq
        )
        if round_seq in self.rounds:
            self.rounds.remove(round_seq)
            self.ended.add(round_seq)
        elif round_seq in self.ended:
            if not crossed_abort:
                problems.append(f"round {round_seq} ends a second time")
        elif isinstance(event, ev.TransferDoneSent):
            problems.append(f"transfer_done for round {round_seq}, which was never fetched")
        elif isinstance(event, ev.AbortAckSent) and not crossed_abort:
            problems.append(f"abort_ack for round {round_seq}, whose abort was not received")
        # A RoundClosed of a round never fetched ends a looked-up round: allowed.

    def step(
        self,
        event: ev.AnyEvent,
        before: ProducerState,
        after: ProducerState,
        prev: ev.AnyEvent | None,
    ) -> list[str]:
        """What ``event`` breaks, in words; ``prev`` is the actor's event before it."""
        del before, after  # a producer's rules read its events
        problems: list[str] = []
        match event:
            case ev.KeysPinned() | ev.StoreAdded():
                self._pin(event.job_id, problems)
            case ev.PinReleased():
                self._release(event.job_id, prev, problems)
            case ev.PinsRenewed():
                problems.extend(
                    f"job {j} is renewed but not held" for j in event.job_ids if j not in self.held
                )
            case ev.KeysResolved():
                self._open_context(event.lookup_id, problems)
            case ev.ContextClosed():
                self._close_context(event.lookup_id, problems)
            case ev.LookupAnswered() if event.resolved:
                # The parent's first answer (its context opening), its pin, the close.
                self._open_context(event.lookup_id, problems)
                if event.pinned is not None:
                    self._pin(event.pinned.job_id, problems)
                self._close_context(event.lookup_id, problems)
            case ev.FetchReceived():
                if event.round_seq in self.rounds or event.round_seq in self.ended:
                    problems.append(f"a second fetch for round {event.round_seq}")
                self.rounds.add(event.round_seq)
            case ev.TransferStarted():
                tid = event.transfer_id
                if tid in self.inflight:
                    problems.append(f"transfer {tid} starts again while in flight")
                if event.round_seq not in self.rounds:
                    problems.append(f"transfer {tid} serves round {event.round_seq}, not fetched")
                jobs = frozenset(event.job_ids)
                problems.extend(
                    f"transfer {tid} reads job {j}, which is not pinned"
                    for j in sorted(jobs - self.held)
                )
                self.inflight[tid] = (event.round_seq, jobs)
            case ev.TransferCompleted() | ev.TransferFailed():
                if self.inflight.pop(event.transfer_id, None) is None:
                    problems.append(
                        f"transfer {event.transfer_id} ends but is not in flight: "
                        "a transfer ends exactly once"
                    )
            case ev.TransferDoneSent() | ev.AbortAckSent() | ev.RoundClosed():
                self._end_round(event, event.round_seq, prev, problems)
            case ev.Closed():
                for job_id in event.released:
                    self._release(job_id, prev, problems)
                for round_seq in event.rounds_closed:
                    self._end_round(event, round_seq, prev, problems)
                problems.extend(f"Closed while {what}" for what in self.open_obligations())
            case _:
                pass
        return problems

    def open_obligations(self) -> list[str]:
        """What the actor still holds, in words, were its log to stop here."""
        return [
            *(f"job {j} is still pinned" for j in sorted(self.held)),
            *(f"the context of lookup {i} is still open" for i in sorted(self.contexts)),
            *(f"round {r} was fetched and never ended" for r in sorted(self.rounds)),
            *(f"transfer {t} is in flight" for t in sorted(self.inflight)),
        ]


def _stray_release(prev: ev.AnyEvent | None) -> bool:
    """Whether a release of a job never pinned is the core's cleanup of a stray pin.

    A parent answer nobody waits for (or one that should not carry a pin) is
    Ignored and its pin released at once, without a KeysPinned.
    """
    return isinstance(prev, ev.Ignored) and prev.input == "parent_answer"
