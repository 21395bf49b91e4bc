"""The machinery both roles share: the Builder of one decision, the fold tables, the phase rule.

``decide`` functions emit events one at a time on a :class:`Builder`; each is
applied at once, so the next decision in the same step sees its effect. This
guarantees that what a decision returns is exactly what replaying its events
through ``evolve`` gives. Each role's ``evolve`` is a table of fold arms, one per
event type, made into a checked function by :func:`evolver`. Both apply the one
phase rule, :func:`phase_after`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, Generic, Self, TypeVar, cast, get_args

import msgspec

from p2pactor.core import events as ev
from p2pactor.core.events import ConsumerPhase, Event, Ignored, Phase, ProducerPhase
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.timings import Timings
from p2pactor.errors import P2PActorError, ReplayError


class ActorRecord(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What the state of an actor of either role begins with.

    Attributes:
        ROLE: The role whose state this is.
        actor: Who this is.
        seq: The sequence number of the last event applied.
    """

    ROLE: ClassVar[Role]

    actor: ActorId
    seq: int = 0

    @classmethod
    def new(cls, actor: ActorId) -> Self:
        """The state of ``actor`` before its first event (ValueError: another role's)."""
        if actor.role is not cls.ROLE:
            raise ValueError(f"{actor} is not a {cls.ROLE.value}")
        return cls(actor=actor)


# The phase each event moves an actor to, if that is further on in the actor's role (a consumer's
# SessionLost leaves it as it is). ``Finished`` moves a consumer to the terminal phase it names.
PHASE_AT: Final[Mapping[type[Event], Phase]] = {
    ev.Probed: ConsumerPhase.PROBING,
    ev.FetchSent: ConsumerPhase.FETCH_SENT,
    ev.LookupCancelled: ConsumerPhase.FETCH_SENT,
    ev.SessionLost: ProducerPhase.CLOSING,
    ev.CloseRequested: ProducerPhase.CLOSING,
    ev.Closed: ProducerPhase.CLOSED,
}

# Each role's phases in the order they may be entered. A consumer's running outcome only gets
# worse, in the same order: DONE < FAILED < ABORTED.
PHASE_RANK: Final = {
    p: rank for role in (ConsumerPhase, ProducerPhase) for rank, p in enumerate(role)
}


def phase_after(phase: Phase, event: Event) -> Phase:
    """The phase an actor is in after ``event``, given its phase before it; pure, forward only.

    The phase part of ``evolve``, alone: the feed needs each event's phase
    while a watcher sees only the state after a whole step, and replay serving
    needs it without rebuilding states.
    """
    if isinstance(event, ev.Finished):
        return event.phase
    target = PHASE_AT.get(type(event))
    if target is None or type(target) is not type(phase) or PHASE_RANK[target] <= PHASE_RANK[phase]:
        return phase
    return target


S = TypeVar("S", bound=ActorRecord)
E = TypeVar("E", bound=Event)


class Builder(Generic[S, E]):
    """Accumulates the events of one decision over an evolving state, at ``now``, under ``t``."""

    def __init__(self, state: S, now: float, t: Timings, evolve: Callable[[S, E], S]) -> None:
        self.state = state
        self.now = now
        self.t = t
        self.events: list[E] = []
        self._evolve = evolve

    def emit(self, kind: type[E], /, **fields: Any) -> None:
        """Record the next event, a ``kind`` of ``fields``, and apply it to the state."""
        state = self.state
        event = kind(actor=state.actor, seq=state.seq + 1, at=self.now, **fields)
        self.state = self._evolve(state, event)
        self.events.append(event)

    def ignore(self, input: str, reason: str) -> None:
        """Record that ``input`` (a message type or input name) changed nothing, and why."""
        self.emit(cast("type[E]", Ignored), input=input, reason=reason)  # either role's


K = TypeVar("K")
V = TypeVar("V")


def put(mapping: Mapping[K, V], key: K, value: V) -> dict[K, V]:
    """A copy of ``mapping`` with ``key`` set to ``value``."""
    return {**mapping, key: value}


def drop(mapping: Mapping[K, V], key: K) -> dict[K, V]:
    """A copy of ``mapping`` without ``key`` (there or not)."""
    out = dict(mapping)
    out.pop(key, None)
    return out


def covers(table: Mapping[type, object], union: object) -> None:
    """Check that ``table`` has an entry for each type of ``union`` and nothing else.

    mypy cannot see a table's coverage as it sees a match's (``assert_never``);
    a raise, not an assert, so that ``python -O`` checks it too.
    """
    unmatched = set(table) ^ set(get_args(union))
    if unmatched:
        names = sorted(t.__name__ for t in unmatched)
        raise P2PActorError(f"a dispatch table's types differ from its union's: {names}")


def evolver(
    table: Mapping[type[Event], Callable[[S, Any], S]], events: object
) -> Callable[[S, Any], S]:
    """A role's ``evolve``: apply one event through ``table``; pure, one state copy an event.

    ``table`` must hold an arm for each type of the union ``events`` and nothing
    else (:func:`covers`). The function made raises ReplayError when the event
    belongs to another actor or does not follow the last one applied.
    """
    covers(table, events)

    def evolve(state: S, event: Any) -> S:
        # Identity first: a live step's events carry its state's own ActorId.
        if event.actor is not state.actor and event.actor != state.actor:
            raise ReplayError(f"event of {event.actor} applied to {state.actor}")
        if event.seq != state.seq + 1:
            raise ReplayError(f"{state.actor}: event seq {event.seq} after seq {state.seq}")
        # A table, not a match: a match tries its arms in turn (about 0.1 µs each).
        return table[type(event)](state, event)

    return evolve
