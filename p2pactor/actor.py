"""RequestActor: one request on one side of one session, as a trio task.

The actor is the driver loop around the pure core, in the manner of h11's
``next_event()`` loop: wait for the next input on a bounded channel, or for the
state's next deadline (then the input is a tick); step the core; hand the events
to the host (which logs them and performs their effects); repeat until the state
is terminal. All the deciding happens in :mod:`p2pactor.core`; all the doing
happens in the host. The actor itself never blocks on anything but its inbox.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import trio

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer import ConsumerInput, ConsumerState, step_consumer
from p2pactor.core.fold import ActorState, initial_state, is_terminal, next_deadline
from p2pactor.core.ids import ActorId
from p2pactor.core.producer import ProducerInput, ProducerState, step_producer
from p2pactor.core.timings import Timings
from p2pactor.logsetup import request_context

__all__ = ["ActorHost", "ActorInput", "RequestActor"]

log = logging.getLogger("p2pactor.actor")

ActorInput = ConsumerInput | ProducerInput
"""Anything an actor of either role reacts to."""


class ActorHost(Protocol):
    """What an actor needs from its owner (the session): judge, record and act."""

    def admit(self, actor: RequestActor, event_input: ActorInput) -> ActorInput:
        """The input the core steps for ``event_input``: itself, or a quota verdict on it.

        Called just before the step, so that the verdict sees the counts of
        every earlier step. Must not block.
        """

    def actor_stepped(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """Log ``events`` and perform their effects. Must not block."""

    def actor_failed(self, actor: RequestActor, event_input: ActorInput, exc: Exception) -> None:
        """The core raised on ``event_input`` (a bug); the input was dropped."""

    def actor_handled(self, actor: RequestActor, event_input: ActorInput) -> None:
        """The core handled ``event_input`` without error."""


class RequestActor:
    """One (peer, kv_request_id, role): its state, its inbox and its loop.

    Attributes:
        id: Who this actor is.
        state: Its current state; replaced, never mutated, after every step.
    """

    def __init__(self, actor_id: ActorId, host: ActorHost, timings: Timings, inbox: int) -> None:
        self.id = actor_id
        self.state: ActorState = initial_state(actor_id)
        self._host = host
        self._timings = timings
        self._send, self._receive = trio.open_memory_channel[ActorInput](inbox)
        self._changed = trio.Event()
        self._done = trio.Event()

    def __repr__(self) -> str:
        return f"<RequestActor {self.id} seq={self.state.seq}>"

    @property
    def done(self) -> bool:
        """Whether the actor reached a terminal state (its task has ended or is ending)."""
        return is_terminal(self.state)

    async def deliver(self, event_input: ActorInput) -> bool:
        """Queue an input, waiting while the inbox is full.

        Returns:
            False if the actor has ended and will never read it.
        """
        if self.done:
            return False
        try:
            await self._send.send(event_input)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def deliver_nowait(self, event_input: ActorInput) -> bool:
        """Queue an input if there is room now.

        Returns:
            False if the inbox is full or the actor has ended.
        """
        if self.done:
            return False
        try:
            self._send.send_nowait(event_input)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    async def wait_changed(self) -> None:
        """Wait until the next step that recorded events (or the actor's end)."""
        await self._changed.wait()

    async def wait_done(self) -> None:
        """Wait until the actor's task has ended."""
        await self._done.wait()

    async def run(self) -> None:
        """The actor's task: step inputs and deadlines until the state is terminal."""
        try:
            async with self._receive:
                while not self.done:
                    deadline = next_deadline(self.state)
                    event_input: ActorInput = inp.Tick()
                    if deadline is None:  # no cancel scope to pay for (one per step)
                        event_input = await self._receive.receive()
                    else:
                        with trio.move_on_at(deadline):
                            event_input = await self._receive.receive()
                    self.step(event_input)
        finally:
            self._send.close()
            self._done.set()
            self._notify()

    def step(self, event_input: ActorInput) -> None:
        """Feed one input through the core now and hand its events to the host."""
        now = trio.current_time()
        try:
            admitted = self._host.admit(self, event_input)
            if isinstance(self.state, ConsumerState):
                self.state, events = step_consumer(
                    self.state,
                    admitted,  # type: ignore[arg-type]
                    now,
                    self._timings,
                )
            else:
                assert isinstance(self.state, ProducerState)
                self.state, producer_events = step_producer(
                    self.state,
                    admitted,  # type: ignore[arg-type]
                    now,
                    self._timings,
                )
                events = producer_events  # type: ignore[assignment]
        except Exception as exc:  # a bug in the core must not take the node down
            log.exception(
                "%s: the core failed on %r; input dropped (a bug in p2pactor: please report "
                "it with this traceback)",
                self.id,
                event_input,
                extra=request_context(self.id.peer, self.id.kv_request_id),
            )
            self._host.actor_failed(self, event_input, exc)
            return
        self._host.actor_handled(self, event_input)
        if events:
            self._host.actor_stepped(self, events)
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
