"""The machinery both roles share: the Builder of one decision and the fold tables.

``decide`` functions emit events one at a time on a :class:`Builder`; each is
applied at once, so the next decision in the same step sees its effect. This
guarantees that what a decision returns is exactly what replaying its events
through ``evolve`` gives. Each role's ``evolve`` is a table of fold arms, one per
event type (:func:`filed_under`), made into a checked function by :func:`evolver`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Generic, Self, TypeVar, get_args

import msgspec

from p2pactor.core.events import Event
from p2pactor.core.ids import ActorId, Role
from p2pactor.errors import ReplayError


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


S = TypeVar("S", bound=ActorRecord)
E = TypeVar("E", bound=Event)
_F = TypeVar("_F", bound=Callable[..., Any])


class Builder(Generic[S, E]):
    """Accumulates the events of one decision over an evolving state."""

    def __init__(self, state: S, now: float, evolve: Callable[[S, E], S]) -> None:
        self.state = state
        self.now = now
        self.events: list[E] = []
        self._evolve = evolve

    def emit(self, kind: type[E], /, **fields: Any) -> None:
        """Record the next event, a ``kind`` of ``fields``, and apply it to the state."""
        state = self.state
        event = kind(actor=state.actor, seq=state.seq + 1, at=self.now, **fields)
        self.state = self._evolve(state, event)
        self.events.append(event)


def check_follows(actor: ActorId, seq: int, event: Event) -> None:
    """Check that ``event`` is the next event of ``actor``, whose last was ``seq``.

    Raises:
        ReplayError: It belongs to another actor, or skips or repeats a number.
    """
    # Identity first: a live step's events carry its state's own ActorId.
    if event.actor is not actor and event.actor != actor:
        raise ReplayError(f"event of {event.actor} applied to {actor}")
    if event.seq != seq + 1:
        raise ReplayError(f"{actor}: event seq {event.seq} after seq {seq}")


def filed_under(table: dict[type[Event], _F]) -> Callable[..., Callable[[_F], _F]]:
    """A decorator that files a function in ``table`` under event types.

    ``arm = filed_under(TABLE)``, then ``@arm(ev.A, ev.B)`` on the function
    for those events: the table is the dispatch, and each event type is named
    once, beside the code that handles it.
    """

    def arm(*kinds: type[Event]) -> Callable[[_F], _F]:
        def register(fn: _F) -> _F:
            for kind in kinds:
                table[kind] = fn
            return fn

        return register

    return arm


def evolver(
    table: Mapping[type[Event], Callable[[S, Any], S]], events: object
) -> Callable[[S, Any], S]:
    """A role's ``evolve``: apply one event through ``table``; pure, one state copy an event.

    ``table`` must hold an arm for each type of the union ``events`` and nothing
    else (mypy cannot see a table's coverage as it sees a match's). The function
    made raises ReplayError when the event belongs to another actor or does not
    follow the last one applied.
    """
    unmatched = set(table) ^ set(get_args(events))
    assert not unmatched, unmatched

    def evolve(state: S, event: Any) -> S:
        check_follows(state.actor, state.seq, event)
        # A table, not a match: a match tries its arms in turn (about 0.1 µs each).
        return table[type(event)](state, event)

    return evolve
