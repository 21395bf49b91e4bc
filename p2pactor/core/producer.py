"""The producer request: a peer's request, served from our blocks.

Life of a producer (PROTOCOL.md "Lookup", "Fetch, rounds and completion",
"Abort and timeouts"):

* each lookup becomes a parent request: look its distinct keys up and pin the
  hits at once, in one job, inside one hold of the parent; HIT_PENDING and RETRY
  keys are asked again until 5 s after the lookup arrived, then answered MISS
  and never pinned; exactly one answer goes back, keys in wire order;
* a fetch closes its round: its keys are matched against what that round's
  lookups pinned (a key that was not pinned fails the round at once, with no
  partial write) or, for prefill/decode requests, against blocks the engine
  stores, now or later; matched blocks go out in one WRITE per batch;
* the round ends with ``transfer_done``; an abort is acknowledged only once no
  write into the peer's blocks can still be running;
* a pin no fetch used for 30 s is released; the empty fetch closes the whole
  request; every pin is released exactly once and every synthetic parent request
  that was opened is closed exactly once.

The producer never touches the parent: it posts
:class:`~p2pactor.core.effects.ParentLookup` and
:class:`~p2pactor.core.effects.ParentClose` requests and hears back through
:class:`~p2pactor.core.inputs.ParentAnswer`.
"""

from __future__ import annotations

from typing import assert_never

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.builder import Builder
from p2pactor.core.producer_evolve import evolve_producer
from p2pactor.core.producer_lookups import (
    _drop_lookups,
    _on_lookup,
    _on_parent_answer,
    _tick_lookups,
)
from p2pactor.core.producer_rounds import (
    _on_abort,
    _on_fetch,
    _on_store,
    _on_transfer_result,
    _sweep_round,
)
from p2pactor.core.producer_state import _B, _expirable, _expire_pins, _release_stores
from p2pactor.core.producer_state import ProducerPhase as ProducerPhase
from p2pactor.core.producer_state import ProducerState as ProducerState
from p2pactor.core.producer_state import pin_expired as pin_expired
from p2pactor.core.timings import DEFAULT_TIMINGS, Timings

# Everything a producer actor reacts to.
ProducerInput = (
    wire.Lookup
    | wire.Fetch
    | wire.AbortFetch
    | inp.OverQuota
    | inp.ParentAnswer
    | inp.AddStore
    | inp.TransferResult
    | inp.Finish
    | inp.Tick
    | inp.SessionEnded
)


def step_producer(
    state: ProducerState,
    event_input: ProducerInput,
    now: float,
    timings: Timings = DEFAULT_TIMINGS,
) -> tuple[ProducerState, tuple[ev.ProducerEvent, ...]]:
    """Decide what ``event_input`` means for the request at time ``now``.

    Returns:
        The new state and the events that lead to it (possibly none). Folding
        the events over ``state`` with :func:`evolve_producer` gives the same
        state.
    """
    if state.phase is ProducerPhase.CLOSED:
        return state, ()
    b: _B = Builder(state, now, evolve_producer)
    match event_input:
        case wire.Lookup():
            _on_lookup(b, event_input, timings)
        case wire.Fetch():
            _on_fetch(b, event_input)
        case inp.OverQuota():
            if isinstance(event_input.message, wire.Lookup):
                _on_lookup(b, event_input.message, timings, event_input)
            else:
                _on_fetch(b, event_input.message, event_input)
        case wire.AbortFetch():
            _on_abort(b, event_input)
        case inp.ParentAnswer():
            _on_parent_answer(b, event_input, timings)
        case inp.AddStore():
            _on_store(b, event_input, timings)
        case inp.TransferResult():
            _on_transfer_result(b, event_input)
        case inp.Finish():
            _on_local_finish(b)
        case inp.Tick():
            _tick_lookups(b)
            _expire_pins(b, timings)
        case inp.SessionEnded():
            _on_session_ended(b, event_input.reason)
        case _:
            assert_never(event_input)
    _sweep(b)
    return b.state, tuple(b.events)


def _on_local_finish(b: _B) -> None:
    if b.state.finishing:
        return
    b.emit(ev.FinishRequested)
    _drop_lookups(b, "the engine finished the request")


def _on_session_ended(b: _B, reason: str) -> None:
    if b.state.session_lost:
        return
    b.emit(ev.SessionLost, reason=reason)
    _drop_lookups(b, f"session lost: {reason}")


def _sweep(b: _B) -> None:
    """Settle whatever the step made settle-able, then close if nothing is held."""
    if b.state.phase is ProducerPhase.CLOSED:
        return  # the step closed the request whole
    for _, rnd in sorted(b.state.rounds.items()):
        _sweep_round(b, rnd)
    _release_stores(b)
    if b.state.idle:
        reason = b.state.close_reason or "nothing left to serve"
        b.emit(ev.Closed, reason=reason)


def next_producer_deadline(state: ProducerState) -> float | None:
    """When the actor next needs a :class:`~p2pactor.core.inputs.Tick`, if ever."""
    if state.phase is ProducerPhase.CLOSED:
        return None
    times: list[float] = []
    for lookup in state.lookups.values():
        if lookup.answered or lookup.dropped or not lookup.pending:
            continue
        times.append(lookup.deadline)
        if lookup.next_poll_at is not None and not lookup.outstanding:
            times.append(lookup.next_poll_at)
    times.extend(job.expires_at for job in state.jobs.values() if _expirable(state, job))
    return min(times, default=None)
