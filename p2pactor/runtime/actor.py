"""Request actors: records stepped where their inputs arrive, and the queue that steps them.

An actor is one (peer, kv_request_id, role): its state, its next deadline and
nothing else. It has no task and no inbox of its own. Whoever has an input for
it (the session a frame arrived on, the engine bridge, the parent service, a
transfer's completion, the node's timer) hands it to the node's
:class:`Runner`, which steps actors one input at a time, to completion, in
arrival order: an input that arrives while another is being stepped (an
embedded parent answering inside the step that asked it) waits until that step
and its effects are done. Stepping is the h11 driver loop without the loop:
admit the input, ``step = decide + evolve`` in the pure core, hand the events
to the host (which logs them and performs their effects), note the next
deadline for the timer.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, Protocol

import attrs
import trio

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerInput, next_consumer_deadline, step_consumer
from p2pactor.core.fold import ActorState, initial_state, is_terminal
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerInput, next_producer_deadline, step_producer
from p2pactor.core.timings import Timings
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.logcontext import actor_context
from p2pactor.runtime.timers import Timers

log = logging.getLogger("p2pactor.actor")

# Anything an actor of either role reacts to.
ActorInput = ConsumerInput | ProducerInput

# A role's step with its timings (and first round) bound: state, input, now.
_Decide = Callable[[Any, Any, float], tuple[Any, tuple[ev.AnyEvent, ...]]]


class ActorHost(Protocol):
    """What an actor needs from its owner (the session): judge before a step, act after it."""

    runner: Runner
    """The node's runner, through which every input reaches the actor."""

    def admit(self, actor: RequestActor, event_input: ActorInput) -> ActorInput | None:
        """The input the core steps for ``event_input``: itself, or a quota verdict on it.

        Called just before the step, so that the verdict sees the counts of
        every earlier step; None: not stepped (the actor has ended, and
        whatever the input carries is undone). Must not block.
        """

    def stepped(
        self, actor: RequestActor, event_input: ActorInput, events: Sequence[ev.AnyEvent] | None
    ) -> None:
        """Log ``events``, perform their effects and arm the timer if the deadline moved.

        ``events`` None: stepping ``event_input`` or performing its effects
        failed (a bug, logged); the input was dropped. Must not block.
        """


class RequestActor:
    """One (peer, kv_request_id, role): its state and when it next needs a tick.

    Attributes:
        id: Who this actor is.
        state: Its current state; replaced, never mutated, after every step.
        deadline: When it next needs a :class:`~p2pactor.core.inputs.Tick`
            (``next_deadline(state)``), or None.
        moved: Whether the last step moved ``deadline`` (the timer must know).
        done: Whether it reached a terminal state or was abandoned (its session
            closed without it ending): it takes no input any more.

    A consumer's ``first_round`` is the round its first lookup or fetch takes
    (its session numbers them); a producer's rounds are the peer's.
    """

    __slots__ = (
        "_decide",
        "_host",
        "_next_deadline",
        "deadline",
        "done",
        "id",
        "moved",
        "state",
    )

    def __init__(
        self, actor_id: ActorId, host: ActorHost, timings: Timings, *, first_round: int = 0
    ) -> None:
        self.id = actor_id
        self.state: ActorState = initial_state(actor_id)
        self.deadline: float | None = None
        self.moved = False
        self.done = False
        self._host = host
        # The role's core functions, bound once: a step does no dispatch of its own.
        self._decide: _Decide
        if actor_id.role is Role.CONSUMER:
            self._decide = partial(step_consumer, timings=timings, first_round=first_round)
            self._next_deadline: Callable[[Any], float | None] = next_consumer_deadline
        else:
            self._decide = partial(step_producer, timings=timings)
            self._next_deadline = next_producer_deadline

    def __repr__(self) -> str:
        return f"<RequestActor {self.id} seq={self.state.seq}>"

    def step(self, event_input: ActorInput, now: float) -> None:
        """Feed one input through the core at ``now`` and hand its events to the host.

        Call it through a :class:`Runner`, never from inside another step.
        """
        host = self._host
        admitted = host.admit(self, event_input)
        if admitted is None or self.done:
            return
        events: tuple[ev.AnyEvent, ...] | None = None
        try:
            self.state, events = self._decide(self.state, admitted, now)
            self.moved = False
            if events:
                self.done = is_terminal(self.state)
                deadline = self._next_deadline(self.state)
                self.moved, self.deadline = deadline != self.deadline, deadline
            host.stepped(self, event_input, events)
        except Exception:  # a bug in the core, or in its effects, must not take the node down
            what = (
                f"the core failed on {event_input!r}; input dropped"
                if events is None
                else f"performing the effects of {[e.KIND for e in events]} failed"
            )
            log.exception(
                "%s: %s (a bug in p2pactor: please report it with this traceback)",
                self.id,
                what,
                extra=actor_context(self.id),
            )
            host.stepped(self, event_input, None)

    def expire(self) -> None:
        """Its deadline passed: hand it a tick (the node's timer calls this)."""
        self._host.runner.deliver(self, inp.Tick())

    def abandon(self) -> None:
        """Take no input any more (its session closed without it ending)."""
        self.done = True
        self.deadline = None


class Runner:
    """Steps actors one input at a time, to completion, in arrival order.

    There is one per node, on the node's thread. :meth:`deliver` steps the
    input at once unless a step is already running, in which case it queues
    behind it: a step's effects never see another step begin halfway through.

    Args:
        clock: The time each step is given (trio's clock on a node; tests
            that step actors with no trio run pass their own).

    Attributes:
        running: Whether a step is under way (an input delivered now waits for it).
    """

    __slots__ = ("_clock", "_queue", "running")

    def __init__(self, clock: Callable[[], float] = trio.current_time) -> None:
        self._clock = clock
        self._queue: deque[tuple[RequestActor, ActorInput]] = deque()
        self.running = False

    def deliver(self, actor: RequestActor, event_input: ActorInput) -> None:
        """Step ``event_input`` on ``actor`` now, or right after the steps under way."""
        self._queue.append((actor, event_input))
        if self.running:
            return
        self.running = True
        queue = self._queue
        clock = self._clock
        try:
            while queue:
                target, item = queue.popleft()
                target.step(item, clock())
        finally:
            self.running = False


@attrs.frozen
class Ground:
    """What every part of a node stands on: its configuration, runner, timer and clock.

    Given once to each part its host makes (the parent service, the store
    desk, the directory), which read their own options from ``config``.
    """

    config: NodeConfig
    runner: Runner
    timers: Timers
    clock: Callable[[], float]
