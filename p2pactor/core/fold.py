"""Role-agnostic entry points: initial states, evolve, replay, the phase rule."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any, Final

from p2pactor.core import events as ev
from p2pactor.core.builder import phase_after as phase_after
from p2pactor.core.consumer_state import CONSUMER_FOLDS, ConsumerState, evolve_consumer
from p2pactor.core.events import Phase as Phase
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import PRODUCER_FOLDS, ProducerState, evolve_producer
from p2pactor.errors import ReplayError

# The state of an actor of either role.
ActorState = ConsumerState | ProducerState

# Each role's state type: its events (the kinds its fold table folds) and its evolve.
_ROLES: Final[dict[type, tuple[Collection[type], Callable[[Any, Any], ActorState]]]] = {
    ConsumerState: (CONSUMER_FOLDS.keys(), evolve_consumer),
    ProducerState: (PRODUCER_FOLDS.keys(), evolve_producer),
}


def initial_state(actor: ActorId) -> ActorState:
    """The state of ``actor`` before its first event."""
    return (ConsumerState if actor.role is Role.CONSUMER else ProducerState).new(actor)


def evolve(state: ActorState, event: ev.AnyEvent) -> ActorState:
    """Apply one event of either role to the matching state.

    Raises:
        ReplayError: The event does not belong to this actor, is of the other
            role, or breaks the sequence.
    """
    kinds, evolve_role = _ROLES[type(state)]
    try:
        if type(event) not in kinds:
            raise ReplayError(f"{event.KIND} is not a {state.ROLE.value} event ({state.actor})")
        return evolve_role(state, event)
    except (KeyError, ValueError) as exc:
        # evolve trusts its input; a log that names a lookup, round or job the
        # state never had is corrupt, and says so in one exception type.
        raise ReplayError(
            f"{state.actor}: {event.KIND} #{event.seq} does not fit the state: {exc!r}"
        ) from exc


def fold(events: Iterable[ev.AnyEvent], state: ActorState | None = None) -> ActorState:
    """Replay ``events`` (all of one actor, in order) from ``state`` or the start.

    Raises:
        ReplayError: ``events`` is empty with no starting state, or is not one
            actor's unbroken sequence.
    """
    for event in events:
        if state is None:
            state = initial_state(event.actor)
        state = evolve(state, event)
    if state is None:
        raise ReplayError("nothing to replay: no events and no starting state")
    return state


def initial_phase(actor: ActorId) -> Phase:
    """The phase of ``actor`` before its first event."""
    return initial_state(actor).phase


def is_terminal(state: ActorState) -> bool:
    """Whether the actor has ended (terminal states absorb every input)."""
    return state.phase.terminal
