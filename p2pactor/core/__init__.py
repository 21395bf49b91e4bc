"""The pure core: events, state, decisions and effects. No I/O, no clock, no trio.

Everything that decides how a request behaves lives here and can be tested by
feeding inputs and looking at outputs, in the sans-IO style of h11:

* :mod:`~p2pactor.core.events`: the immutable event vocabulary;
* :mod:`~p2pactor.core.consumer` and :mod:`~p2pactor.core.producer`: typed state,
  ``evolve(state, event)`` and ``step``/``decide(state, input, now)`` per role;
* :mod:`~p2pactor.core.effects`: what the runtime does because of an event;
* :mod:`~p2pactor.core.fold`: replay, for either role;
* :mod:`~p2pactor.core.serde`: events as msgpack or JSON.

Time is always an argument (``now``); deadlines are absolute times in the state.
"""

from p2pactor.core.consumer import (
    ConsumerState,
    decide_consumer,
    evolve_consumer,
    probe_answer,
    probe_answers,
    step_consumer,
)
from p2pactor.core.effects import effects_of
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.fold import ActorState, evolve, fold, initial_state, is_terminal, next_deadline
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.inputs import LookupResult
from p2pactor.core.producer import (
    ProducerPhase,
    ProducerState,
    decide_producer,
    evolve_producer,
    step_producer,
)
from p2pactor.core.timings import DEFAULT_TIMINGS, Timings

__all__ = [
    "DEFAULT_TIMINGS",
    "ActorId",
    "ActorState",
    "ConsumerPhase",
    "ConsumerState",
    "LookupResult",
    "ProducerPhase",
    "ProducerState",
    "Role",
    "Timings",
    "decide_consumer",
    "decide_producer",
    "effects_of",
    "evolve",
    "evolve_consumer",
    "evolve_producer",
    "fold",
    "initial_state",
    "is_terminal",
    "next_deadline",
    "probe_answer",
    "probe_answers",
    "step_consumer",
    "step_producer",
]
