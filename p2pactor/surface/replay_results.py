"""What a replay reports: actors' results, timelines, violations, summaries.

Plain frozen values, built by :mod:`p2pactor.surface.replay` and re-exported from it.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from p2pactor.core.fold import ActorState, is_terminal
from p2pactor.core.ids import ActorId
from p2pactor.runtime.logread import LogHeader, LogProblem

__all__ = [
    "ActorResult",
    "InvariantViolation",
    "LogInfo",
    "ReplayResult",
    "Summary",
    "TimelineRow",
    "Unfinished",
]


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
            (``{"pinned_blocks": 3}``; see :class:`p2pactor.runtime.quotas.PeerQuotas`).
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
