"""A scratch pad for one decision: emit events and keep the evolved state in step.

``decide`` functions emit events one at a time; each is applied at once, so the
next decision in the same step sees its effect. This guarantees that what a
decision returns is exactly what replaying its events through ``evolve`` gives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypedDict, TypeVar

from p2pactor.core.events import Event
from p2pactor.core.ids import ActorId

__all__ = ["Builder", "Head"]


class _HasSeq(Protocol):
    @property
    def actor(self) -> ActorId: ...
    @property
    def seq(self) -> int: ...


S = TypeVar("S", bound=_HasSeq)
E = TypeVar("E", bound=Event)


class Head(TypedDict):
    """The fields every event shares, for ``Event(**builder.head, ...)``."""

    actor: ActorId
    seq: int
    at: float


class Builder(Generic[S, E]):
    """Accumulates the events of one decision over an evolving state."""

    def __init__(self, state: S, now: float, evolve: Callable[[S, E], S]) -> None:
        self.state = state
        self.now = now
        self.events: list[E] = []
        self._evolve = evolve

    @property
    def head(self) -> Head:
        """The shared fields of the next event."""
        return Head(actor=self.state.actor, seq=self.state.seq + 1, at=self.now)

    def emit(self, event: E) -> None:
        """Record ``event`` and apply it to the state."""
        self.state = self._evolve(self.state, event)
        self.events.append(event)
