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
* a pin no fetch used for 30 s is released; each lookup or fetch of the request
  renews its pins' 30 s (a lease, for at most 10 minutes after its first pin);
  the empty fetch closes the whole request; every pin is released exactly once
  and every synthetic parent request that was opened is closed exactly once.

The producer never touches the parent: it posts
:class:`~p2pactor.core.effects.ParentLookup` and
:class:`~p2pactor.core.effects.ParentClose` requests and hears back through
:class:`~p2pactor.core.inputs.ParentAnswer`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.builder import Builder, covers, evolver
from p2pactor.core.events import ProducerPhase as ProducerPhase
from p2pactor.core.events import Violation
from p2pactor.core.producer_lookups import (
    LOOKUP_FOLDS,
    _drop_lookups,
    _expirable,
    _on_lookup,
    _on_parent_answer,
    _reject,
    _renew,
    _tick_lookups,
)
from p2pactor.core.producer_state import (
    _B,
    PIN_EXPIRED,
    STATE_FOLDS,
    RoundState,
    Supply,
    _release,
)
from p2pactor.core.producer_state import ProducerState as ProducerState
from p2pactor.core.producer_state import pin_expired as pin_expired
from p2pactor.core.timings import DEFAULT_TIMINGS, Timings

# How each producer event changes the state: ``evolve_producer``'s table, without its checks of
# actor and sequence (for a caller that made them: replay).
PRODUCER_FOLDS: Final = {**STATE_FOLDS, **LOOKUP_FOLDS}

# Apply one event to a producer state; pure (ReplayError if it does not follow).
evolve_producer: Callable[[ProducerState, ev.ProducerEvent], ProducerState] = evolver(
    PRODUCER_FOLDS, ev.ProducerEvent
)

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
    b: _B = Builder(state, now, timings, evolve_producer)
    _ON[type(event_input)](b, event_input)
    _sweep(b)
    return b.state, tuple(b.events)


def _on_transfer_result(b: _B, result: inp.TransferResult) -> None:
    tid = result.transfer_id
    if tid not in b.state.transfers:
        b.ignore("transfer_result", f"no transfer {tid} is in flight")
    elif result.ok:
        b.emit(ev.TransferCompleted, transfer_id=tid)
    else:
        b.emit(ev.TransferFailed, transfer_id=tid, reason=result.reason or "the transfer failed")


def _on_finish(b: _B, _: inp.Finish) -> None:
    if not b.state.finishing:
        b.emit(ev.FinishRequested)
        _drop_lookups(b, "the engine finished the request")


def _on_session_ended(b: _B, ended: inp.SessionEnded) -> None:
    if not b.state.session_lost:
        b.emit(ev.SessionLost, reason=ended.reason)
        _drop_lookups(b, f"session lost: {ended.reason}")


def _tick(b: _B, _: inp.Tick) -> None:
    _tick_lookups(b)
    for job_id, job in sorted(b.state.jobs.items()):
        if b.now >= job.expires_at and _expirable(b.state, job):
            _release(b, job_id, f"{PIN_EXPIRED} {b.t.pin_timeout:g} s")


def _sweep(b: _B) -> None:
    """Settle whatever the step made settle-able, then close if nothing is held."""
    if b.state.phase is ProducerPhase.CLOSED:
        return  # the step closed the request whole
    writing = b.state.writing()  # a sweep starts no write and sees none end
    for _, rnd in sorted(b.state.rounds.items()):
        if rnd.round_seq not in writing:  # else a write may still land in the peer's blocks
            _sweep_round(b, rnd)
    _release_stores(b)
    if b.state.idle:
        b.emit(ev.Closed, reason=b.state.close_reason or "nothing left to serve")


def next_producer_deadline(state: ProducerState) -> float | None:
    """When the actor next needs a :class:`~p2pactor.core.inputs.Tick`, if ever."""
    if state.phase is ProducerPhase.CLOSED:
        return None
    times: list[float] = []
    for lookup in state.lookups.values():
        if not lookup.waiting:
            continue
        times.append(lookup.deadline)
        if lookup.next_poll_at is not None and not lookup.outstanding:
            times.append(lookup.next_poll_at)
    times.extend(job.expires_at for job in state.jobs.values() if _expirable(state, job))
    return min(times, default=None)


def _plan(s: ProducerState, round_seq: int) -> tuple[list[tuple[bytes, int, Supply]], int]:
    """Match a round's parked demand against its supply and the pool.

    Returns:
        The matched ``(key, peer block, supply)`` triples and how many demanded
        blocks stay unmatched.
    """
    rnd = s.rounds[round_seq]
    taken: Counter[bytes] = Counter()  # pool blocks handed out so far, by key
    matched: list[tuple[bytes, int, Supply]] = []
    for key, remote in rnd.demand:
        sup = rnd.supply.get(key)
        if sup is None and taken[key] < len(entries := s.pool.get(key, ())):
            sup = entries[taken[key]]
            taken[key] += 1
        if sup is not None:
            matched.append((key, remote, sup))
    return matched, len(rnd.demand) - len(matched)


def _start(b: _B, round_seq: int, matched: list[tuple[bytes, int, Supply]]) -> None:
    b.emit(
        ev.TransferStarted,
        transfer_id=b.state.next_transfer_id,
        round_seq=round_seq,
        keys=tuple(key for key, _, _ in matched),
        local_blocks=tuple(sup.block for _, _, sup in matched),
        remote_blocks=tuple(remote for _, remote, _ in matched),
        job_ids=tuple(sup.job_id for _, _, sup in matched),
    )


def _on_fetch(b: _B, msg: wire.Fetch, verdict: inp.OverQuota | None = None) -> None:
    s = b.state
    r = msg.round_seq
    if s.phase is ProducerPhase.CLOSING:
        if msg.keys:
            _reject(b, msg, Violation.AFTER_CLOSE, f"fetch for round {r} after the request closed")
        else:
            b.ignore(msg.TYPE, "the request is already closed")
        return
    if not msg.keys:
        reason = "the consumer finished the request (empty fetch)"
        if _close_at_once(b, r, reason):
            return
        b.emit(ev.CloseRequested, round_seq=r, reason=reason)
        _drop_lookups(b, reason)
        return
    existing = s.rounds.get(r)
    if (existing is not None and existing.fetched) or r == s.closed_through:
        _reject(b, msg, Violation.DUPLICATE_FETCH, f"a second fetch for round {r}")
        return
    if r < s.closed_through:
        detail = f"fetch for round {r} after round {s.closed_through}; rounds only move forward"
        _reject(b, msg, Violation.STALE_ROUND, detail)
        return
    b.emit(ev.FetchReceived, round_seq=r, keys=msg.keys, block_indexes=msg.block_indexes)
    if verdict is not None:
        # The round fails whole and at once; the sweep ends it, releasing its pins.
        b.emit(ev.FetchRefused, round_seq=r, quota=verdict.quota, reason=verdict.reason)
        return
    matched, unmatched = _plan(b.state, r)
    symmetric = b.state.rounds[r].lookup_supplied or r <= b.state.looked_up_through
    if unmatched and (symmetric or b.state.finishing):
        # Fail fast and whole: the consumer learns now instead of after 30 s,
        # and never gets half a prefix.
        what = "were not pinned by a lookup" if symmetric else "were never stored"
        _finalize(b, r, success=False, reason=f"{unmatched} of {len(msg.keys)} keys {what}")
    elif matched:
        _start(b, r, matched)
    _renew(b)  # after the writes started: a pin they read needs no lease


def _close_at_once(b: _B, round_seq: int, reason: str) -> bool:
    """Close in one event if the request holds only pins of rounds it looked up; whether it did.

    The common case of the empty fetch: nothing is being looked up, fetched
    or written, and no stored block waits. What the close and the sweep after
    it would record as a :class:`~p2pactor.core.events.CloseRequested`, a
    release per pin, a ``RoundClosed`` per round and the ``Closed`` is then one
    :class:`~p2pactor.core.events.Closed`.
    """
    s = b.state
    if s.lookups or s.transfers or s.pool or s.open_contexts:
        return False
    rounds = s.rounds
    if any(rnd.fetched for rnd in rounds.values()):
        return False
    if any(job.round_seq not in rounds for job in s.jobs.values()):
        return False  # a store's job (no round)
    closed = tuple(sorted(rounds))
    released = tuple(sorted(s.jobs, key=lambda job_id: (s.jobs[job_id].round_seq, job_id)))
    b.emit(
        ev.Closed, reason=reason, requested_round=round_seq, released=released, rounds_closed=closed
    )
    return True


def _on_abort(b: _B, msg: wire.AbortFetch) -> None:
    s = b.state
    r = msg.round_seq
    rnd = s.rounds.get(r)
    if rnd is not None and rnd.fetched:
        if rnd.cancelled:
            b.ignore(msg.TYPE, f"round {r} is already aborting")
            return
        b.emit(ev.AbortReceived, round_seq=r)
        _release_round_jobs(b, r, f"round {r} aborted", idle_only=True)
    elif r <= s.closed_through:
        # The round ended before the abort arrived (its transfer_done crossed
        # the abort on the wire): nothing of it can still write.
        b.emit(ev.AbortReceived, round_seq=r)
        if rnd is None and not s.session_lost:
            b.emit(ev.AbortAckSent, round_seq=r)
        # A looked-up round that a later round's fetch skipped is still here,
        # holding its pins: the sweep releases them, then acks.
    else:
        _reject(b, msg, Violation.UNKNOWN_ROUND, f"abort for round {r}, which was never fetched")


def _on_store(b: _B, store: inp.AddStore) -> None:
    b.emit(ev.StoreAdded, **msgspec.structs.asdict(store), expires_at=b.now + b.t.pin_timeout)
    if b.state.phase is not ProducerPhase.OPEN:
        return  # the sweep releases it
    for r, rnd in sorted(b.state.rounds.items()):
        if rnd.fetched and rnd.demand and not rnd.cancelled and not rnd.failure:
            matched, _ = _plan(b.state, r)
            if matched:
                _start(b, r, matched)


def _finalize(b: _B, round_seq: int, *, success: bool, reason: str) -> None:
    """End a fetched round: release its pins and tell the peer, if it can hear."""
    _release_round_jobs(b, round_seq, reason or "round served", served=success)
    if b.state.phase is ProducerPhase.OPEN:
        b.emit(ev.TransferDoneSent, round_seq=round_seq, success=success, reason=reason)
    else:
        b.emit(ev.RoundClosed, round_seq=round_seq, reason=b.state.close_reason)


def _sweep_round(b: _B, rnd: RoundState) -> None:
    s = b.state
    r = rnd.round_seq
    if rnd.cancelled:
        _release_round_jobs(b, r, f"round {r} aborted")
        if s.session_lost:
            b.emit(ev.RoundClosed, round_seq=r, reason=s.close_reason)
        else:
            b.emit(ev.AbortAckSent, round_seq=r)
    elif not rnd.fetched:
        # A looked-up round waits for its fetch, even once its pins expired, so
        # that a late fetch fails fast instead of parking (vLLM keeps it too).
        # Only the end of the request ends it.
        if s.phase is not ProducerPhase.OPEN:
            _release_round_jobs(b, r, s.close_reason)
            b.emit(ev.RoundClosed, round_seq=r, reason=s.close_reason)
    elif rnd.failure:
        _finalize(b, r, success=False, reason=rnd.failure)
    elif rnd.demand:
        if s.finishing or s.phase is not ProducerPhase.OPEN:
            reason = f"{len(rnd.demand)} demanded blocks were never stored"
            _finalize(b, r, success=False, reason=reason)
    elif rnd.remaining == 0:
        _finalize(b, r, success=True, reason="")


def _release_round_jobs(
    b: _B, round_seq: int, reason: str, *, served: bool = False, idle_only: bool = False
) -> None:
    busy = b.state.reading() if idle_only else set()
    for job_id, job in sorted(b.state.jobs.items()):
        if job.round_seq == round_seq and job_id not in busy:
            _release(b, job_id, reason, served=served)


def _release_stores(b: _B) -> None:
    """Release each store job once its rounds settled it or the request ended."""
    s = b.state
    in_pool = {sup.job_id for entries in s.pool.values() for sup in entries}
    busy = s.reading()
    # Once the engine stored its last block and every fetch so far was served,
    # leftover stored blocks can serve nobody.
    served_out = s.finishing and s.closed_through >= 0 and not s.rounds
    for job_id, job in sorted(s.jobs.items()):
        # A failed job's outcome is settled; a good one waits for its rounds.
        if job.round_seq is not None or job_id in busy or (job.serving and not job.failed):
            continue
        if job_id not in in_pool:
            _release(b, job_id, "all blocks served", served=True)
        elif s.phase is not ProducerPhase.OPEN:
            _release(b, job_id, s.close_reason)
        elif served_out:
            _release(b, job_id, "the engine finished and no fetch is waiting for these blocks")


def _on_over_quota(b: _B, verdict: inp.OverQuota) -> None:
    """The verdict on a lookup or fetch over a quota: the message, refused."""
    if isinstance(verdict.message, wire.Lookup):
        _on_lookup(b, verdict.message, verdict)
    else:
        _on_fetch(b, verdict.message, verdict)


# What each input does: a table, not a match (a match tries its arms in turn).
_ON: Final[Mapping[type, Callable[[_B, Any], None]]] = {
    wire.Lookup: _on_lookup,
    wire.Fetch: _on_fetch,
    inp.OverQuota: _on_over_quota,
    wire.AbortFetch: _on_abort,
    inp.ParentAnswer: _on_parent_answer,
    inp.AddStore: _on_store,
    inp.TransferResult: _on_transfer_result,
    inp.Finish: _on_finish,
    inp.Tick: _tick,
    inp.SessionEnded: _on_session_ended,
}
covers(_ON, ProducerInput)
