"""The pure core: events, state, decisions and effects. No I/O, no clock, no trio.

Everything that decides how a request behaves lives here and can be tested by
feeding inputs and looking at outputs, in the sans-IO style of h11:

* :mod:`~p2pactor.core.events`: the immutable event vocabulary;
* :mod:`~p2pactor.core.consumer` and :mod:`~p2pactor.core.producer`: typed state,
  ``evolve(state, event)`` and ``step(state, input, now)`` per role;
* :mod:`~p2pactor.core.effects`: what the runtime does because of an event;
* :mod:`~p2pactor.core.fold`: replay, for either role;
* :mod:`~p2pactor.core.serde`: events as msgpack or JSON.

Time is always an argument (``now``); deadlines are absolute times in the state.
"""

from p2pactor.core.consumer import ConsumerState as ConsumerState
from p2pactor.core.consumer import probe_answer as probe_answer
from p2pactor.core.consumer import step_consumer as step_consumer
from p2pactor.core.fold import fold as fold
from p2pactor.core.ids import ActorId as ActorId
from p2pactor.core.ids import Role as Role
from p2pactor.core.producer import ProducerState as ProducerState
from p2pactor.core.producer import step_producer as step_producer
