"""The consumer request: our request, pulling blocks from one peer.

Life of a consumer (PROTOCOL.md "Lookup", "Fetch, rounds and completion"):

* the engine registers keys; each step's new keys go out as one lookup; until the
  answer comes a key answers RETRY, afterwards HIT or MISS from the cached answer;
* a fetch loads hits into our blocks and closes the round; cached HITs are
  forgotten (both sides unpin), MISSes kept (the engine computes them: asking
  again could only cost a round trip), and later lookups belong to the next
  round;
* the peer answers each fetch with ``transfer_done``; a load unanswered for 30 s
  is aborted, an abort unacknowledged for 10 s fails the load anyway;
* a lookup that resolves nothing for 30 s fails this request only;
* when the engine finishes the request: loads in flight are aborted, and a lookup
  still open is closed with the terminal empty fetch.

The phase only moves forward: REGISTERED -> PROBING -> FETCH_SENT -> DONE, FAILED
or ABORTED (the rule: :mod:`~p2pactor.core.consumer_state`, with the state,
re-exported here, and its fold). Everything here is pure: time is the ``now`` argument.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.builder import Builder, covers
from p2pactor.core.consumer_state import ConsumerState as ConsumerState
from p2pactor.core.consumer_state import evolve_consumer
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.timings import DEFAULT_TIMINGS, Timings

# Everything a consumer actor reacts to.
ConsumerInput = (
    inp.Register
    | inp.Flush
    | inp.SubmitLoad
    | inp.Finish
    | inp.Tick
    | inp.SessionEnded
    | inp.WritesSettled
    | wire.LookupResp
    | wire.TransferDone
    | wire.AbortAck
)


class _B(Builder[ConsumerState, ev.ConsumerEvent]):
    """The builder every consumer decision emits its events through.

    Attributes:
        rnd: The round a lookup or fetch of this step belongs to.
    """

    rnd: int


def step_consumer(
    state: ConsumerState,
    event_input: ConsumerInput,
    now: float,
    timings: Timings = DEFAULT_TIMINGS,
    *,
    first_round: int = 0,
) -> tuple[ConsumerState, tuple[ev.ConsumerEvent, ...]]:
    """Decide what ``event_input`` means for the request at time ``now``.

    ``first_round`` is the round the request's first lookup or fetch takes (0
    in vLLM's dialect; p2pactor peers number rounds per session, so that a
    reused kv_request_id never repeats one); it is read only until then.

    Returns:
        The new state and the events that lead to it (possibly none). Folding
        the events over ``state`` with :func:`evolve_consumer` gives the same
        state.
    """
    if state.phase.terminal:
        return state, ()
    b = _B(state, now, timings, evolve_consumer)
    b.rnd = first_round if state.round_seq is None else state.round_seq
    _ON[type(event_input)](b, event_input)
    return b.state, tuple(b.events)


def _ask(b: _B, register: inp.Register) -> None:
    """Register keys; with ``flush``, put every key registered and unsent on the wire."""
    s = b.state
    if not s.asking:
        return  # every key answers MISS now; nothing to ask
    new = tuple(k for k in dict.fromkeys(register.keys) if k not in s.probes)
    if not register.flush:
        if new:
            b.emit(ev.Registered, keys=new)
        return
    if asked := s.unsent + new:
        # The progress deadline is armed by the first lookup and only moved by
        # answers, so a request that keeps asking can't keep itself alive forever.
        deadline = s.lookup_deadline
        if deadline is None:
            deadline = b.now + b.t.lookup_progress_timeout
        b.emit(
            ev.Probed, round_seq=b.rnd, keys=asked, lookup_deadline=deadline, source=register.choice
        )


def _on_lookup_resp(b: _B, msg: wire.LookupResp) -> None:
    s = b.state
    waiting = set(s.waiting_keys())
    applied: dict[bytes, bool] = {}
    refused: dict[bytes, bool] = {}
    if not s.asking:
        ignored = "the request no longer looks up"
    elif msg.round_seq is not wire.UNSET and msg.round_seq != s.round_seq:
        ignored = f"answer for round {msg.round_seq}, the request is in round {s.round_seq}"
    else:
        said = msg.refused if msg.refused is not wire.UNSET else (False,) * len(msg.keys)
        for key, hit, no in zip(msg.keys, msg.hits, said, strict=True):
            if key in waiting and key not in applied:
                applied[key] = hit
                refused[key] = no and not hit
        ignored = "" if applied else "it answers no key that is waiting"
    if ignored:
        b.ignore(msg.TYPE, ignored)
        return
    b.emit(
        ev.LookupResp,
        round_seq=None if msg.round_seq is wire.UNSET else msg.round_seq,
        keys=tuple(applied),
        hits=tuple(applied.values()),
        lookup_deadline=b.now + b.t.lookup_progress_timeout
        if len(waiting) > len(applied)
        else None,
        refused=tuple(refused.values()) if any(refused.values()) else (),
    )


def _submit_load(b: _B, load: inp.SubmitLoad) -> None:
    s = b.state
    rnd = b.rnd
    reason = ""
    success = False
    if s.finishing:
        reason = "the request already finished"
    elif s.session_lost:
        reason = "the session to the peer is gone; look the keys up again"
    elif len(load.keys) != len(load.block_indexes):
        reason = (
            f"{len(load.keys)} keys but {len(load.block_indexes)} block indexes; "
            "pass one destination block per key"
        )
    elif not load.keys:
        reason = "nothing to load"
        success = True
    elif load.next_round is not None and load.next_round <= rnd:
        reason = f"next_round {load.next_round} must be above round {rnd}"
    if reason:
        b.emit(ev.FetchSkipped, job_id=load.job_id, success=success, reason=reason)
        return
    b.emit(
        ev.FetchSent,
        round_seq=rnd,
        job_id=load.job_id,
        keys=load.keys,
        block_indexes=load.block_indexes,
        load_deadline=b.now + b.t.load_timeout,
        next_round=rnd + 1 if load.next_round is None else load.next_round,
    )


def _on_transfer_done(b: _B, msg: wire.TransferDone) -> None:
    load = b.state.loads.get(msg.round_seq)
    if load is None:
        b.ignore(msg.TYPE, f"no load in flight for round {msg.round_seq}")
        return
    # A transfer_done that crosses our abort is still the truth: the write ended.
    b.emit(ev.TransferDone, round_seq=msg.round_seq, job_id=load.job_id, success=msg.success)
    _maybe_finished(b)


def _on_abort_ack(b: _B, msg: wire.AbortAck) -> None:
    load = b.state.loads.get(msg.round_seq)
    if load is None or not load.aborting or load.held:
        # An unsolicited ack must not release blocks a write may still reach.
        b.ignore(msg.TYPE, f"no abort of round {msg.round_seq} is waiting for an ack")
        return
    b.emit(ev.AbortAcked, round_seq=msg.round_seq, job_id=load.job_id)
    _maybe_finished(b)


def _finish(b: _B, _: inp.Finish) -> None:
    s = b.state
    if s.finishing:
        return
    if not s.loads:
        # Nothing in flight: the request ends now, in one event.
        reason = s.problem or "finished"
        cancelled = _open_round(s)
        b.emit(
            ev.Finished, phase=s.outcome, reason=reason, requested=True, cancelled_round=cancelled
        )
        return
    b.emit(ev.FinishRequested)
    for round_seq, load in sorted(b.state.loads.items()):
        if not load.aborting:
            _send_abort(b, round_seq, "the request finished while its load was in flight")
    if (cancelled := _open_round(b.state)) is not None:
        b.emit(ev.LookupCancelled, round_seq=cancelled)
    _maybe_finished(b)


def _send_abort(b: _B, round_seq: int, reason: str) -> None:
    """Ask the peer to abort the load of ``round_seq``; it fails anyway if no ack comes in time."""
    job_id = b.state.loads[round_seq].job_id
    deadline = b.now + b.t.abort_ack_timeout
    b.emit(ev.AbortSent, round_seq=round_seq, job_id=job_id, reason=reason, ack_deadline=deadline)


def _open_round(s: ConsumerState) -> int | None:
    """The round of a lookup still open that the peer can be told to drop, if any."""
    return s.round_seq if s.lookup_open and not s.session_lost else None


def _tick(b: _B, _: inp.Tick) -> None:
    now = b.now
    t = b.t
    for round_seq, load in sorted(b.state.loads.items()):
        if load.ack_deadline is not None:
            if now >= load.ack_deadline:
                reason = load.held or f"no abort_ack within {t.abort_ack_timeout:g} s"
                b.emit(ev.Aborted, round_seq=round_seq, job_id=load.job_id, reason=reason)
        elif now >= load.deadline:
            _send_abort(b, round_seq, f"no transfer_done within {t.load_timeout:g} s")
    deadline = b.state.lookup_deadline
    if deadline is not None and now >= deadline:
        b.emit(ev.LookupTimedOut, keys=b.state.waiting_keys())
    _maybe_finished(b)


def _session_ended(b: _B, ended: inp.SessionEnded) -> None:
    if b.state.session_lost:
        return  # its loads are held: the session ended once already
    reason = ended.reason
    if b.state.loads and ended.write_grace > 0:
        # A failed load gives its blocks back to the engine at once; a write
        # still on the wire would land in whatever the engine put there.
        b.emit(ev.SessionLost, reason=reason, loads_held_until=b.now + ended.write_grace)
        return  # the loads fail at the deadline (_tick), then the request ends
    waiting = bool(b.state.waiting_keys())
    b.emit(ev.SessionLost, reason=reason)
    _abort(b, list(b.state.loads), f"session lost: {reason}", finish=False)
    s = b.state
    # A lookup still waiting fails with its session, though no load did.
    phase = ConsumerPhase.FAILED if s.outcome is ConsumerPhase.DONE and waiting else s.outcome
    b.emit(ev.Finished, phase=phase, reason=s.problem or f"session lost: {reason}")


def _abort(b: _B, rounds: list[int], reason: str, *, finish: bool = True) -> None:
    """Fail the loads of ``rounds`` without the peer's word (then end, if it may)."""
    for round_seq in sorted(rounds):
        job_id = b.state.loads[round_seq].job_id
        b.emit(ev.Aborted, round_seq=round_seq, job_id=job_id, reason=reason)
    if rounds and finish:
        _maybe_finished(b)


def _maybe_finished(b: _B) -> None:
    s = b.state
    if (s.finishing or s.session_lost) and not s.loads:
        b.emit(ev.Finished, phase=s.outcome, reason=s.problem or "finished")


# What each input does: a table, not a match (a match tries its arms in turn).
_ON: Final[Mapping[type, Callable[[_B, Any], None]]] = {
    inp.Register: _ask,
    inp.Flush: lambda b, _: _ask(b, inp.Register((), flush=True)),  # no new key, sent at once
    inp.SubmitLoad: _submit_load,
    inp.Finish: _finish,
    inp.Tick: _tick,
    inp.SessionEnded: _session_ended,
    # The loads held for a late write fail now: none can land any more.
    inp.WritesSettled: lambda b, m: _abort(
        b, [r for r, load in b.state.loads.items() if load.held], m.reason
    ),
    wire.LookupResp: _on_lookup_resp,
    wire.TransferDone: _on_transfer_done,
    wire.AbortAck: _on_abort_ack,
}
covers(_ON, ConsumerInput)


def next_consumer_deadline(state: ConsumerState) -> float | None:
    """When the actor next needs a :class:`~p2pactor.core.inputs.Tick`, if ever."""
    if state.phase.terminal:
        return None
    times = [
        load.ack_deadline if load.ack_deadline is not None else load.deadline
        for load in state.loads.values()
    ]
    if state.lookup_deadline is not None:
        times.append(state.lookup_deadline)
    return min(times, default=None)


def probe_answers(state: ConsumerState, keys: Sequence[bytes]) -> list[inp.LookupResult]:
    """:func:`probe_answer` for every key of ``keys``, in order.

    The request-wide checks are made once, not once per key: an engine asks
    about hundreds of keys at a time, after every step of the request.
    """
    if state.phase.terminal or not state.asking:
        return [inp.LookupResult.MISS] * len(keys)
    probes = state.probes
    answer = _ANSWER.__getitem__
    return [answer(probes.get(k)) for k in keys]


_ANSWER: Final[Mapping[bool | None, inp.LookupResult]] = {
    None: inp.LookupResult.RETRY,
    True: inp.LookupResult.HIT,
    False: inp.LookupResult.MISS,
}


def probe_answer(state: ConsumerState, key: bytes) -> inp.LookupResult:
    """What the engine's lookup of ``key`` answers now: HIT, MISS or RETRY.

    RETRY means "not known yet": the key is being asked (or must be registered
    first). Once the request has finished, failed its lookup or lost its
    session, every key is a MISS: the engine computes it locally.
    """
    return probe_answers(state, (key,))[0]
