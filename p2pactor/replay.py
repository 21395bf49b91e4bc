"""Replay recorded event logs: rebuild every actor's state, its timeline, and check it.

Replaying folds each actor's events through :func:`p2pactor.core.fold.evolve`,
one event at a time, keeping only the actor's current state: logs of any size
stream through in memory bounded by the actors alive at once (plus the
timeline rows asked for). An actor's result comes out as soon as its terminal
event (``Finished`` or ``Closed``) is replayed; actors a log leaves running (the
node was killed) come out at the end, unfinished.

Actors are told apart by ``(node id, actor id)``: the same request seen by two
nodes is two actors, a consumer on one and a producer on the other.

Replay always reports what makes a log unreplayable (sequence gaps, events
after the end, events ``evolve`` refuses). With ``check=True`` it also checks
the invariants of the protocol, event by event, with small per-actor counters:

* a consumer's phase only moves forward, each event comes in a phase that
  allows it, and every load sent ends exactly once and is reported once;
* a producer releases every pin it created exactly once, closes every
  synthetic parent request it opened exactly once, ends every fetched round
  exactly once, and never tells the peer a round is over (``transfer_done``,
  ``abort_ack``) nor releases a pin while a write of it is still in flight.

Obligations still open when a log ends before its actor did are reported as
*unfinished*, not as violations: the log simply stops there.

:class:`Replayer` is the pure engine (events in, results out);
:func:`replay_logs` streams files through it; :func:`replay` collects
everything into one :class:`ReplayResult`. Nothing here prints.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Final, assert_never

import attrs

from p2pactor.core import events as ev
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.fold import ActorState, evolve, initial_state, is_terminal
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerState
from p2pactor.logread import LogHeader, LogProblem, LogReader, read_log

__all__ = [
    "ActorResult",
    "InvariantViolation",
    "LogInfo",
    "ReplayResult",
    "ReplayRun",
    "Replayer",
    "Summary",
    "TimelineRow",
    "Unfinished",
    "describe",
    "open_logs",
    "replay",
    "replay_logs",
]

_RANK: Final = {phase: rank for rank, phase in enumerate(ConsumerPhase)}


# --- results ------------------------------------------------------------------------


@attrs.frozen
class TimelineRow:
    """One event of an actor's timeline.

    Attributes:
        t: Seconds since the actor's first event.
        seq: The event's sequence number.
        kind: The event type (``Probed``, ``FetchSent``...).
        detail: A short description: rounds, key counts, hits, jobs, outcome.
    """

    t: float
    seq: int
    kind: str
    detail: str


@attrs.frozen(kw_only=True)
class InvariantViolation:
    """An event that breaks an invariant of the protocol or of the log.

    Attributes:
        node_id: The node whose log holds it.
        actor: The actor it belongs to.
        seq: The offending event's sequence number.
        kind: The offending event's type.
        message: What is wrong, in words.
    """

    node_id: str
    actor: ActorId
    seq: int
    kind: str
    message: str

    def __str__(self) -> str:
        return (
            f"{self.node_id} {self.actor.kv_request_id} ({self.actor}) "
            f"#{self.seq} {self.kind}: {self.message}"
        )


@attrs.frozen(kw_only=True)
class Unfinished:
    """An obligation an actor still held when its log ended.

    Attributes:
        node_id: The node whose log it is.
        actor: The actor.
        seq: The actor's last recorded event.
        what: The obligation (a pin held, a context open, a round not ended...).
    """

    node_id: str
    actor: ActorId
    seq: int
    what: str

    def __str__(self) -> str:
        return f"{self.node_id} {self.actor.kv_request_id} ({self.actor}): {self.what}"


@attrs.frozen(kw_only=True)
class ActorResult:
    """One actor, replayed.

    Attributes:
        node_id: The node whose log it came from.
        actor: Who it is.
        state: Its state after its last event.
        events: How many events it recorded.
        first_at: The time of its first event (monotonic seconds).
        last_at: The time of its last event.
        outcome: The reason its terminal event gave, or "" if it has none.
        timeline: Its events as rows, or None if its timeline was not kept.
        unfinished: Obligations open when the log ended (check mode, actors
            that did not end).
        violations: How many violations it has.
    """

    node_id: str
    actor: ActorId
    state: ActorState
    events: int
    first_at: float
    last_at: float
    outcome: str
    timeline: tuple[TimelineRow, ...] | None
    unfinished: tuple[str, ...]
    violations: int

    @property
    def terminal(self) -> bool:
        """Whether the actor reached its terminal event."""
        return is_terminal(self.state)

    @property
    def phase(self) -> str:
        """Its final phase: a consumer or producer phase's value."""
        return str(self.state.phase.value)

    @property
    def duration(self) -> float:
        """Seconds from its first event to its last."""
        return self.last_at - self.first_at


@attrs.frozen(kw_only=True)
class LogInfo:
    """One replayed log file.

    Attributes:
        path: The file.
        header: What the file says about itself.
        events: Events read from it.
        problem: Why reading stopped early, or None.
    """

    path: str
    header: LogHeader
    events: int
    problem: LogProblem | None


@attrs.frozen(kw_only=True)
class Summary:
    """Counts over everything replayed.

    Consumer-side counts are what our requests did and got; producer-side
    counts are what we served. One request between two recorded nodes counts
    on both sides.

    Attributes:
        events: Events replayed.
        actors: Actors replayed.
        phases: Actors by role, then by final phase (``{"consumer": {"done": 3}}``).
        unfinished_actors: Actors whose log ended before they did.
        lookups_sent: Lookups our requests sent (``Probed``).
        lookups_received: Lookups peers sent us (``LookupReceived``, and
            ``LookupLimited`` and ``LookupRefused`` for lookups over a quota).
        keys_hit: Keys peers answered HIT.
        keys_missed: Keys peers answered MISS.
        keys_timed_out: Keys whose lookup timed out on our side.
        keys_served_hit: Keys we found and pinned for peers.
        keys_served_missed: Keys we did not hold.
        keys_served_timed_out: Keys still pending at the lookup's deadline.
        fetches_sent: Fetches our requests sent.
        fetches_received: Fetches peers sent us.
        loads_done: Our loads that completed.
        loads_failed: Our loads that failed, were aborted or were refused.
        transfers_started: WRITEs we started.
        transfers_completed: WRITEs that completed.
        transfers_failed: WRITEs that failed.
        aborts_sent: Aborts our requests sent.
        aborts_received: Aborts peers sent us.
        pins_created: Pin jobs created (lookup pins and stores).
        pins_released: Pin jobs released.
        rejected: Protocol violations by peers (``Rejected``).
        quota_refusals: Refusals of peers over a quota, by quota
            (``{"pinned_blocks": 3}``; see :class:`p2pactor.quotas.PeerQuotas`).
        violations: Invariant violations found.
        by_kind: Events by type.
    """

    events: int = 0
    actors: int = 0
    phases: Mapping[str, Mapping[str, int]] = attrs.field(factory=dict)
    unfinished_actors: int = 0
    lookups_sent: int = 0
    lookups_received: int = 0
    keys_hit: int = 0
    keys_missed: int = 0
    keys_timed_out: int = 0
    keys_served_hit: int = 0
    keys_served_missed: int = 0
    keys_served_timed_out: int = 0
    fetches_sent: int = 0
    fetches_received: int = 0
    loads_done: int = 0
    loads_failed: int = 0
    transfers_started: int = 0
    transfers_completed: int = 0
    transfers_failed: int = 0
    aborts_sent: int = 0
    aborts_received: int = 0
    pins_created: int = 0
    pins_released: int = 0
    rejected: int = 0
    quota_refusals: Mapping[str, int] = attrs.field(factory=dict)
    violations: int = 0
    by_kind: Mapping[str, int] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class ReplayResult:
    """Everything a replay found.

    Attributes:
        logs: The files read, in order.
        actors: Every actor, in the order they ended; unfinished ones last.
        summary: Counts over everything.
        violations: Every invariant violation, in log order.
        unfinished: Every obligation left open by actors the logs cut short.
    """

    logs: tuple[LogInfo, ...]
    actors: tuple[ActorResult, ...]
    summary: Summary
    violations: tuple[InvariantViolation, ...]
    unfinished: tuple[Unfinished, ...]

    @property
    def ok(self) -> bool:
        """No violation, and no log damaged before its tail."""
        return not self.violations and not any(
            log.problem is not None and log.problem.fatal for log in self.logs
        )

    def actor(self, node_id: str, actor: ActorId) -> ActorResult:
        """The result of one actor.

        Raises:
            KeyError: No such actor was replayed.
        """
        for result in self.actors:
            if result.node_id == node_id and result.actor == actor:
                return result
        raise KeyError((node_id, actor))


# --- timeline details ---------------------------------------------------------------


def _n(count: int, noun: str) -> str:
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun}es" if noun.endswith("s") else f"{count} {noun}s"


def _ok(success: bool) -> str:
    return "success" if success else "failed"


def describe(event: ev.AnyEvent) -> str:
    """A short description of ``event`` for a timeline row."""
    match event:
        case ev.Ignored():
            return f"{event.input}: {event.reason}"
        case ev.Rejected():
            return f"{event.input} {event.violation.value}: {event.detail}"
        case ev.SessionLost():
            return event.reason
        case ev.FinishRequested():
            return ""
        case ev.Opened():
            return f"round {event.round_seq}"
        case ev.Registered():
            return _n(len(event.keys), "key")
        case ev.Probed():
            return f"round {event.round_seq}, {_n(len(event.keys), 'key')}"
        case ev.LookupResp():
            hits = sum(event.hits)
            rnd = "?" if event.round_seq is None else event.round_seq
            return f"round {rnd}, {_n(hits, 'hit')}, {_n(len(event.hits) - hits, 'miss')}"
        case ev.LookupTimedOut():
            return f"{_n(len(event.keys), 'key')} timed out"
        case ev.FetchSent():
            return (
                f"round {event.round_seq}, job {event.job_id}, "
                f"{_n(len(event.keys), 'block')}, next round {event.next_round}"
            )
        case ev.FetchSkipped():
            return f"job {event.job_id}, {_ok(event.success)}: {event.reason}"
        case ev.LookupCancelled():
            return f"round {event.round_seq}, empty fetch"
        case ev.TransferDone():
            return f"round {event.round_seq}, job {event.job_id}, {_ok(event.success)}"
        case ev.AbortSent():
            return f"round {event.round_seq}, job {event.job_id}: {event.reason}"
        case ev.AbortAcked():
            return f"round {event.round_seq}, job {event.job_id}"
        case ev.Aborted():
            return f"round {event.round_seq}, job {event.job_id}: {event.reason}"
        case ev.Finished():
            return f"{event.phase.value}: {event.reason}"
        case ev.LookupReceived():
            return (
                f"lookup {event.lookup_id}, round {event.round_seq}, {_n(len(event.keys), 'key')}"
            )
        case ev.LookupLimited():
            return (
                f"lookup {event.lookup_id}, round {event.round_seq}, "
                f"{event.admitted}/{_n(len(event.keys), 'key')} looked up: {event.reason}"
            )
        case ev.LookupRefused():
            return (
                f"round {event.round_seq}, {_n(len(event.keys), 'key')} answered MISS, "
                f"over {event.quota.value}: {event.reason}"
            )
        case ev.KeysRefused():
            return (
                f"lookup {event.lookup_id}, {_n(len(event.keys), 'hit')} not pinned, "
                f"over {event.quota.value}: {event.reason}"
            )
        case ev.FetchRefused():
            return f"round {event.round_seq}, over {event.quota.value}: {event.reason}"
        case ev.KeysResolved():
            return (
                f"lookup {event.lookup_id}: {_n(len(event.hits), 'hit')}, "
                f"{_n(len(event.misses), 'miss')}, {len(event.pending)} pending"
            )
        case ev.ParentExpired():
            return f"lookup {event.lookup_id}: the parent was not asked, too late"
        case ev.KeysPinned():
            return (
                f"lookup {event.lookup_id}, round {event.round_seq}, job {event.job_id}, "
                f"{_n(len(event.keys), 'block')}"
            )
        case ev.PendingPolled():
            return f"lookup {event.lookup_id}, {_n(len(event.keys), 'key')}"
        case ev.PendingExpired():
            return f"lookup {event.lookup_id}, {_n(len(event.keys), 'key')} timed out"
        case ev.LookupAnswered():
            hits = sum(event.hits)
            return (
                f"lookup {event.lookup_id}, round {event.round_seq}, {hits}/{len(event.hits)} hits"
            )
        case ev.LookupDropped():
            return f"lookup {event.lookup_id}: {event.reason}"
        case ev.ContextClosed():
            return f"lookup {event.lookup_id}"
        case ev.StoreAdded():
            return f"job {event.job_id}, {_n(len(event.keys), 'block')}"
        case ev.FetchReceived():
            return f"round {event.round_seq}, {_n(len(event.keys), 'block')}"
        case ev.TransferStarted():
            jobs = ",".join(str(j) for j in sorted(set(event.job_ids)))
            return (
                f"transfer {event.transfer_id}, round {event.round_seq}, "
                f"{_n(len(event.keys), 'block')}, jobs {jobs}"
            )
        case ev.TransferCompleted():
            return f"transfer {event.transfer_id}"
        case ev.TransferFailed():
            return f"transfer {event.transfer_id}: {event.reason}"
        case ev.TransferDoneSent():
            tail = f": {event.reason}" if event.reason else ""
            return f"round {event.round_seq}, {_ok(event.success)}{tail}"
        case ev.AbortReceived() | ev.AbortAckSent():
            return f"round {event.round_seq}"
        case ev.RoundClosed():
            return f"round {event.round_seq}: {event.reason}"
        case ev.PinReleased():
            return f"job {event.job_id}, {_ok(event.success)}: {event.reason}"
        case ev.CloseRequested():
            return f"round {event.round_seq}: {event.reason}"
        case ev.Closed():
            return event.reason
        case _:
            assert_never(event)


# --- invariant checks ---------------------------------------------------------------


class _ConsumerCheck:
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

    def step(self, event: ev.AnyEvent, before: ConsumerState, after: ConsumerState) -> list[str]:
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


class _ProducerCheck:
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

    def _release(
        self, event: ev.PinReleased, prev: ev.AnyEvent | None, problems: list[str]
    ) -> None:
        job_id = event.job_id
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

    def step(self, event: ev.AnyEvent, prev: ev.AnyEvent | None) -> list[str]:
        problems: list[str] = []
        match event:
            case ev.KeysPinned() | ev.StoreAdded():
                self._pin(event.job_id, problems)
            case ev.PinReleased():
                self._release(event, prev, problems)
            case ev.KeysResolved():
                if event.lookup_id in self.contexts_closed:
                    problems.append(f"the context of lookup {event.lookup_id} opens again")
                self.contexts.add(event.lookup_id)
            case ev.ContextClosed():
                lookup_id = event.lookup_id
                if lookup_id in self.contexts:
                    self.contexts.remove(lookup_id)
                    self.contexts_closed.add(lookup_id)
                elif lookup_id in self.contexts_closed:
                    problems.append(f"the context of lookup {lookup_id} is closed a second time")
                else:
                    problems.append(f"the context of lookup {lookup_id} is closed but never opened")
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
                problems.extend(f"Closed while {what}" for what in self.open_obligations())
            case _:
                pass
        return problems

    def open_obligations(self) -> list[str]:
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


# --- the engine ---------------------------------------------------------------------


class _Live:
    """What replay keeps about one actor while it runs."""

    __slots__ = (
        "actor",
        "check",
        "events",
        "first_at",
        "last_at",
        "node_id",
        "prev",
        "rows",
        "state",
        "violations",
    )

    def __init__(self, node_id: str, actor: ActorId, *, check: bool, rows: bool) -> None:
        self.node_id = node_id
        self.actor = actor
        self.state: ActorState = initial_state(actor)
        self.events = 0
        self.first_at = 0.0
        self.last_at = 0.0
        self.prev: ev.AnyEvent | None = None
        self.rows: list[TimelineRow] | None = [] if rows else None
        self.violations = 0
        self.check: _ConsumerCheck | _ProducerCheck | None = None
        if check:
            self.check = _ConsumerCheck() if actor.role is Role.CONSUMER else _ProducerCheck()


_EndedKey = tuple[str, Role, str, str, int]


def _ended_key(node_id: str, actor: ActorId) -> _EndedKey:
    # The only memory replay keeps per ended actor: flat, with the peer shared
    # by all its actors, it is a third of the decoded ActorId it stands for.
    return (node_id, actor.role, sys.intern(actor.peer), actor.kv_request_id, actor.incarnation)


class Replayer:
    """The replay engine: feed it events in log order, get actors' results out.

    Pure: it reads no file and no clock. :func:`replay_logs` feeds it files.

    Args:
        check: Also check the protocol's invariants (see the module docs).
        request: Replay only actors whose kv_request_id is this.
        timelines: Keep timeline rows for at most this many actors, the first
            ones seen; None keeps them for every actor, 0 for none.
    """

    def __init__(
        self, *, check: bool = False, request: str | None = None, timelines: int | None = None
    ) -> None:
        self._check = check
        self._request = request
        self._timelines = timelines
        self._live: dict[tuple[str, ActorId], _Live] = {}
        # Actors that ended, with their terminal event, to catch events after it.
        self._ended: dict[_EndedKey, str] = {}
        self._seen = 0
        self._kinds: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._refusals: Counter[str] = Counter()
        self._phases: dict[str, Counter[str]] = {}
        self._unfinished_actors = 0
        self.violations: list[InvariantViolation] = []
        """Every violation found so far, in log order."""
        self.unfinished: list[Unfinished] = []
        """Obligations open in actors the logs cut short (filled by :meth:`end`)."""

    def feed(self, node_id: str, event: ev.AnyEvent) -> ActorResult | None:
        """Replay one event of ``node_id``'s log.

        Returns:
            The actor's result if this event ended it, else None.
        """
        actor = event.actor
        if self._request is not None and actor.kv_request_id != self._request:
            return None
        self._kinds[event.KIND] += 1
        self._count(event)
        key = (node_id, actor)
        live = self._live.get(key)
        if live is not None and event.seq == 1 and live.state.seq >= 1:
            # The same id began a new life (a reused kv_request_id on a new
            # session) while the old one never ended: it was abandoned.
            self._abandon(live)
            live = None
        if live is None:
            ended = self._ended.get(_ended_key(node_id, actor))
            if ended is not None and event.seq != 1:
                self._violation(
                    node_id, event, f"recorded after {ended}: nothing follows a request's end"
                )
                return None
            keep_rows = self._timelines is None or self._seen < self._timelines
            self._seen += 1
            live = _Live(node_id, actor, check=self._check, rows=keep_rows)
            live.first_at = event.at
            self._live[key] = live
        self._apply(live, event)
        if not is_terminal(live.state):
            return None
        del self._live[key]
        self._ended[_ended_key(node_id, actor)] = event.KIND
        return self._result(live, ())

    def end(self) -> list[ActorResult]:
        """The logs are over: the results of actors that did not end, as unfinished."""
        results = [self._abandon(live) for live in list(self._live.values())]
        self._live.clear()
        return results

    def _abandon(self, live: _Live) -> ActorResult:
        """Report an actor whose events stop before its end, and forget it."""
        open_now = live.check.open_obligations() if live.check is not None else []
        self.unfinished.extend(
            Unfinished(node_id=live.node_id, actor=live.actor, seq=live.state.seq, what=what)
            for what in open_now
        )
        self._unfinished_actors += 1
        self._live.pop((live.node_id, live.actor), None)
        return self._result(live, tuple(open_now))

    def summary(self) -> Summary:
        """The counts over everything fed so far."""
        c = self._counts
        k = self._kinds
        return Summary(
            events=sum(k.values()),
            actors=sum(sum(p.values()) for p in self._phases.values()) + len(self._live),
            phases={role: dict(sorted(p.items())) for role, p in sorted(self._phases.items())},
            unfinished_actors=self._unfinished_actors,
            lookups_sent=k["Probed"],
            lookups_received=k["LookupReceived"] + k["LookupLimited"] + k["LookupRefused"],
            keys_hit=c["keys_hit"],
            keys_missed=c["keys_missed"],
            keys_timed_out=c["keys_timed_out"],
            keys_served_hit=c["keys_served_hit"],
            keys_served_missed=c["keys_served_missed"],
            keys_served_timed_out=c["keys_served_timed_out"],
            fetches_sent=k["FetchSent"],
            fetches_received=k["FetchReceived"],
            loads_done=c["loads_done"],
            loads_failed=c["loads_failed"],
            transfers_started=k["TransferStarted"],
            transfers_completed=k["TransferCompleted"],
            transfers_failed=k["TransferFailed"],
            aborts_sent=k["AbortSent"],
            aborts_received=k["AbortReceived"],
            pins_created=k["KeysPinned"] + k["StoreAdded"],
            pins_released=k["PinReleased"],
            rejected=k["Rejected"],
            quota_refusals=dict(sorted(self._refusals.items())),
            violations=len(self.violations),
            by_kind=dict(sorted(k.items())),
        )

    def _count(self, event: ev.AnyEvent) -> None:
        c = self._counts
        match event:
            case ev.LookupResp():
                hits = sum(event.hits)
                c["keys_hit"] += hits
                c["keys_missed"] += len(event.hits) - hits
            case ev.LookupTimedOut():
                c["keys_timed_out"] += len(event.keys)
            case ev.KeysResolved():
                c["keys_served_hit"] += len(event.hits)
                c["keys_served_missed"] += len(event.misses)
            case ev.PendingExpired():
                c["keys_served_timed_out"] += len(event.keys)
            case ev.TransferDone():
                c["loads_done" if event.success else "loads_failed"] += 1
            case ev.AbortAcked() | ev.Aborted():
                c["loads_failed"] += 1
            case ev.FetchSkipped() if not event.success:
                c["loads_failed"] += 1
            case ev.LookupRefused() | ev.KeysRefused() | ev.FetchRefused():
                self._refusals[event.quota.value] += 1
            case ev.LookupLimited():
                self._refusals[ev.Quota.KEYS_PER_LOOKUP.value] += 1
            case _:
                pass

    def _violation(self, node_id: str, event: ev.AnyEvent, message: str) -> None:
        self.violations.append(
            InvariantViolation(
                node_id=node_id, actor=event.actor, seq=event.seq, kind=event.KIND, message=message
            )
        )

    def _apply(self, live: _Live, event: ev.AnyEvent) -> None:
        before = live.state
        problems: list[str] = []
        if event.seq <= before.seq:
            self._violation(
                live.node_id,
                event,
                f"seq {event.seq} repeats or goes back (after seq {before.seq}); event skipped",
            )
            live.violations += 1
            return
        if event.seq != before.seq + 1:
            problems.append(
                f"seq gap: seq {event.seq} after seq {before.seq}, "
                f"{event.seq - before.seq - 1} events missing"
            )
            # Resynchronise so that one gap is one violation, not one per event.
            before = attrs.evolve(before, seq=event.seq - 1)
        try:
            after = evolve(before, event)
        except Exception as exc:
            # A broken log can make evolve fail in any way; replay reports, never crashes.
            problems.append(f"evolve refused it: {type(exc).__name__}: {exc}")
            after = attrs.evolve(before, seq=event.seq)
        live.state = after
        live.events += 1
        live.last_at = event.at
        if live.rows is not None:
            live.rows.append(
                TimelineRow(event.at - live.first_at, event.seq, event.KIND, describe(event))
            )
        check = live.check
        if isinstance(check, _ConsumerCheck):
            assert isinstance(before, ConsumerState)
            assert isinstance(after, ConsumerState)
            problems.extend(check.step(event, before, after))
        elif isinstance(check, _ProducerCheck):
            problems.extend(check.step(event, live.prev))
        live.prev = event
        for message in problems:
            self._violation(live.node_id, event, message)
        live.violations += len(problems)

    def _result(self, live: _Live, unfinished: tuple[str, ...]) -> ActorResult:
        state = live.state
        role = live.actor.role.value
        self._phases.setdefault(role, Counter())[state.phase.value] += 1
        outcome = ""
        prev = live.prev
        if isinstance(prev, ev.Finished | ev.Closed):
            outcome = prev.reason
        elif isinstance(state, ConsumerState):
            outcome = state.problem
        elif isinstance(state, ProducerState):
            outcome = state.close_reason
        return ActorResult(
            node_id=live.node_id,
            actor=live.actor,
            state=state,
            events=live.events,
            first_at=live.first_at,
            last_at=live.last_at,
            outcome=outcome,
            timeline=None if live.rows is None else tuple(live.rows),
            unfinished=unfinished,
            violations=live.violations,
        )


# --- files --------------------------------------------------------------------------


def open_logs(paths: Iterable[str | os.PathLike[str]]) -> list[LogReader]:
    """Open every log and check its header before anything is replayed.

    Raises:
        LogFormatError: A file is not a p2pactor event log this version reads.
        OSError: A file can't be opened.
    """
    return [read_log(path) for path in paths]


class ReplayRun:
    """A replay streaming through log files; iterate it for actors' results.

    Iterating yields each actor's :class:`ActorResult` as soon as its
    terminal event is read (files in the order given, each from start to
    end), then the actors the logs left unfinished. Afterwards :attr:`logs`,
    :meth:`summary`, :attr:`violations` and :attr:`unfinished` hold the rest.
    A run streams once: iterate it a single time. Build one with
    :func:`replay_logs`.
    """

    def __init__(self, readers: list[LogReader], replayer: Replayer) -> None:
        self._readers = readers
        self._replayer = replayer
        self.logs: list[LogInfo] = []
        """The files read so far, with their problems."""

    @property
    def violations(self) -> list[InvariantViolation]:
        """Every violation found so far."""
        return self._replayer.violations

    @property
    def unfinished(self) -> list[Unfinished]:
        """Obligations left open by actors the logs cut short (after iteration)."""
        return self._replayer.unfinished

    def summary(self) -> Summary:
        """The counts over everything replayed so far."""
        return self._replayer.summary()

    def __iter__(self) -> Iterator[ActorResult]:
        replayer = self._replayer
        for reader in self._readers:
            node_id = reader.node_id
            feed = replayer.feed
            for event in reader:
                result = feed(node_id, event)
                if result is not None:
                    yield result
            self.logs.append(
                LogInfo(
                    path=reader.path,
                    header=reader.header,
                    events=reader.events_read,
                    problem=reader.problem,
                )
            )
        yield from replayer.end()


def replay_logs(
    paths: Iterable[str | os.PathLike[str]],
    *,
    check: bool = False,
    request: str | None = None,
    timelines: int | None = None,
) -> ReplayRun:
    """Stream the logs at ``paths`` through a :class:`Replayer`.

    Every header is read and checked now; events are read as the run is
    iterated. Arguments are the :class:`Replayer`'s.

    Raises:
        LogFormatError: A file is not a p2pactor event log this version reads.
        OSError: A file can't be opened.
    """
    readers = open_logs(paths)
    return ReplayRun(readers, Replayer(check=check, request=request, timelines=timelines))


def replay(
    paths: Iterable[str | os.PathLike[str]],
    *,
    check: bool = False,
    request: str | None = None,
    timelines: int | None = None,
) -> ReplayResult:
    """Replay the logs at ``paths`` and collect everything into one result.

    Holds every actor's final state (and timeline rows, unless ``timelines``
    limits them); for logs too big for that, iterate :func:`replay_logs`.

    Raises:
        LogFormatError: A file is not a p2pactor event log this version reads.
        OSError: A file can't be opened.
    """
    run = replay_logs(paths, check=check, request=request, timelines=timelines)
    actors = tuple(run)
    return ReplayResult(
        logs=tuple(run.logs),
        actors=actors,
        summary=run.summary(),
        violations=tuple(run.violations),
        unfinished=tuple(run.unfinished),
    )
