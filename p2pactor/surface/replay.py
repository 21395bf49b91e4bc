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
the invariants of the protocol (:mod:`p2pactor.surface.replay_checks`).

Obligations still open when a log ends before its actor did are reported as
*unfinished*, not as violations: the log simply stops there.

:class:`Replayer` is the pure engine (events in, results out);
:func:`replay_logs` streams files through it; :func:`replay` collects
everything into one :class:`ReplayResult` (the result types live in
:mod:`p2pactor.surface.replay_results`, :func:`describe` in
:mod:`p2pactor.surface.replay_describe`; all are re-exported here). Nothing here prints.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator

from msgspec.structs import replace

from p2pactor.core import events as ev
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.fold import evolve
from p2pactor.core.ids import ActorId
from p2pactor.core.producer import ProducerState
from p2pactor.runtime.logread import LogReader, read_log
from p2pactor.surface.replay_describe import describe as describe
from p2pactor.surface.replay_live import COUNTERS, REFUSED, TERMINAL, EndedKey, Live, ended_key
from p2pactor.surface.replay_results import ActorResult as ActorResult
from p2pactor.surface.replay_results import InvariantViolation as InvariantViolation
from p2pactor.surface.replay_results import LogInfo as LogInfo
from p2pactor.surface.replay_results import ReplayResult as ReplayResult
from p2pactor.surface.replay_results import Summary as Summary
from p2pactor.surface.replay_results import TimelineRow as TimelineRow
from p2pactor.surface.replay_results import Unfinished as Unfinished


class Replayer:
    """The replay engine: feed it events in log order, get actors' results out.

    Pure: it reads no file and no clock. :func:`replay_logs` feeds it files.

    Args:
        check: Also check the protocol's invariants (:mod:`p2pactor.surface.replay_checks`).
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
        self._live: dict[tuple[str, ActorId], Live] = {}
        # Actors that ended, with their terminal event, to catch events after it.
        self._ended: dict[EndedKey, str] = {}
        self._seen = 0
        self._kinds: dict[type[ev.Event], int] = {}
        self._counts: Counter[str] = Counter()
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
        kind = type(event)
        kinds = self._kinds
        kinds[kind] = kinds.get(kind, 0) + 1
        counter = COUNTERS.get(kind)
        if counter is not None:
            counter(self._counts, event)
        key = (node_id, actor)
        live = self._live.get(key)
        if live is None or (event.seq == 1 and live.state.seq >= 1):
            live = self._begin(node_id, event, live)
            if live is None:
                return None
        state = live.state
        if live.fast and event.seq == state.seq + 1:
            # The common case, inline: the next event of an actor (found by its
            # id and in sequence: evolve's own checks are made) with no timeline.
            try:
                after = live.folds[kind](state, event)
            except Exception:
                self._apply(live, event)
                state = live.state
            else:
                if live.check_step is not None:
                    problems = live.check_step(event, state, after, live.prev)
                    for message in problems:
                        self._violation(node_id, event, message)
                    live.violations += len(problems)
                live.state = state = after
                live.events += 1
                live.last_at = event.at
                live.prev = event
        else:
            self._apply(live, event)
            state = live.state
        if state.phase not in TERMINAL:
            return None
        del self._live[key]
        self._ended[ended_key(node_id, actor)] = event.KIND
        return self._result(live, ())

    def _begin(self, node_id: str, event: ev.AnyEvent, old: Live | None) -> Live | None:
        """The actor ``event`` begins (None: it must not), replacing ``old``."""
        actor = event.actor
        if old is not None:
            # The same id began a new life (a reused kv_request_id on a new
            # session) while the old one never ended: it was abandoned.
            self._abandon(old)
        ended = self._ended.get(ended_key(node_id, actor))
        if ended is not None and event.seq != 1:
            self._violation(
                node_id, event, f"recorded after {ended}: nothing follows a request's end"
            )
            return None
        keep_rows = self._timelines is None or self._seen < self._timelines
        self._seen += 1
        live = Live(node_id, actor, check=self._check, rows=keep_rows)
        live.first_at = event.at
        self._live[node_id, actor] = live
        return live

    def end(self) -> list[ActorResult]:
        """The logs are over: the results of actors that did not end, as unfinished."""
        results = [self._abandon(live) for live in list(self._live.values())]
        self._live.clear()
        return results

    def _abandon(self, live: Live) -> ActorResult:
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
        k = Counter({kind.KIND: n for kind, n in self._kinds.items()})
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
            pins_created=k["KeysPinned"] + k["StoreAdded"] + c["pins_answered"],
            pins_released=k["PinReleased"] + c["pins_closed"],
            rejected=k["Rejected"],
            quota_refusals={
                name.removeprefix(REFUSED): n
                for name, n in sorted(c.items())
                if name.startswith(REFUSED)
            },
            violations=len(self.violations),
            by_kind=dict(sorted(k.items())),
        )

    def _violation(self, node_id: str, event: ev.AnyEvent, message: str) -> None:
        self.violations.append(
            InvariantViolation(
                node_id=node_id, actor=event.actor, seq=event.seq, kind=event.KIND, message=message
            )
        )

    def _apply(self, live: Live, event: ev.AnyEvent) -> None:
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
            before = replace(before, seq=event.seq - 1)
        try:
            after = evolve(before, event)
        except Exception as exc:
            # A broken log can make evolve fail in any way; replay reports, never crashes.
            problems.append(f"evolve refused it: {type(exc).__name__}: {exc}")
            after = replace(before, seq=event.seq)
        live.state = after
        live.events += 1
        live.last_at = event.at
        if live.rows is not None:
            live.rows.append(
                TimelineRow(event.at - live.first_at, event.seq, event.KIND, describe(event))
            )
        if live.check_step is not None:
            problems.extend(live.check_step(event, before, after, live.prev))
        live.prev = event
        for message in problems:
            self._violation(live.node_id, event, message)
        live.violations += len(problems)

    def _result(self, live: Live, unfinished: tuple[str, ...]) -> ActorResult:
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
