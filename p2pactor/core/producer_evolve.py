"""Folding a producer's events into its state: :func:`evolve_producer` and its helpers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from msgspec.structs import replace

from p2pactor.core import events as ev
from p2pactor.core.builder import evolver
from p2pactor.core.producer_state import (
    PRODUCER_PHASE_AT,
    ActiveLookup,
    PinJob,
    ProducerState,
    Supply,
    _drop,
    _pool_take,
    _put,
    _round,
)


def _evolve_transfer_ended(
    s: ProducerState, seq: int, transfer_id: int, failure: str | None
) -> ProducerState:
    t = s.transfers[transfer_id]
    jobs = dict(s.jobs)
    for job_id in set(t.job_ids):
        job = jobs.get(job_id)
        if job is not None:
            jobs[job_id] = replace(
                job, readers=job.readers - {transfer_id}, failed=job.failed or failure is not None
            )
    rounds = dict(s.rounds)
    rnd = rounds.get(t.round_seq)
    if rnd is not None:
        # A failed write leaves its blocks unwritten: the round failed.
        written = len(t.keys) if failure is None else 0
        rounds[t.round_seq] = replace(
            rnd,
            inflight=rnd.inflight - {transfer_id},
            remaining=rnd.remaining - written,
            failure=rnd.failure or failure or "",
        )
    return replace(s, seq=seq, jobs=jobs, rounds=rounds, transfers=_drop(s.transfers, transfer_id))


def _evolve_pin_released(s: ProducerState, seq: int, job_id: int) -> ProducerState:
    job = s.jobs.get(job_id)
    if job is None:
        return replace(s, seq=seq)  # a stray pin released without ever being held
    rounds, pool = s.rounds, s.pool
    if job.round_seq is None:
        for key in job.keys:
            while any(sup.job_id == job_id for sup in pool.get(key, ())):
                pool = _pool_take(pool, key, job_id)
    elif job.round_seq in rounds:
        rnd = rounds[job.round_seq]
        supply = {k: v for k, v in rnd.supply.items() if v.job_id != job_id}
        rounds = _put(rounds, job.round_seq, replace(rnd, supply=supply))
    return replace(s, seq=seq, jobs=_drop(s.jobs, job_id), rounds=rounds, pool=pool)


def _evolve_round_ended(
    s: ProducerState, seq: int, round_seq: int, *, served: bool
) -> ProducerState:
    jobs = dict(s.jobs)
    for job_id, job in s.jobs.items():
        if round_seq in job.serving:
            jobs[job_id] = replace(
                job, serving=job.serving - {round_seq}, failed=job.failed or not served
            )
    return replace(s, seq=seq, rounds=_drop(s.rounds, round_seq), jobs=jobs)


def _evolve_lookup_opened(
    s: ProducerState, e: ev.LookupReceived | ev.LookupLimited, admitted: int
) -> ProducerState:
    """Open a lookup whose first ``admitted`` keys go to the parent; the rest answer MISS."""
    lookup = ActiveLookup(
        lookup_id=e.lookup_id,
        round_seq=e.round_seq,
        keys=e.keys,
        admitted=admitted,
        deadline=e.deadline,
        pending=frozenset(e.keys[:admitted]),
    )
    rnd = replace(_round(s, e.round_seq), lookup_supplied=True)
    return replace(
        s,
        seq=e.seq,
        lookups=_put(s.lookups, e.lookup_id, lookup),
        rounds=_put(s.rounds, e.round_seq, rnd),
        next_lookup_id=e.lookup_id + 1,
        looked_up_through=max(s.looked_up_through, e.round_seq),
    )


def _pinned(
    s: ProducerState,
    seq: int,
    round_seq: int | None,
    pin: ev.Pinned | ev.KeysPinned | ev.StoreAdded,
) -> ProducerState:
    """Blocks pinned: the job held, its blocks a looked-up round's supply or the store's pool."""
    job_id, keys, blocks = pin.job_id, pin.keys, pin.blocks
    job = PinJob(
        job_id=job_id, round_seq=round_seq, keys=keys, blocks=blocks, expires_at=pin.expires_at
    )
    rounds, pool = s.rounds, s.pool
    if round_seq is None:
        pool = dict(pool)
        for key, block in zip(keys, blocks, strict=True):
            pool[key] = (*pool.get(key, ()), Supply(job_id, block))
    elif round_seq in rounds:
        rnd = rounds[round_seq]
        supply = dict(rnd.supply)
        for key, block in zip(keys, blocks, strict=True):
            supply[key] = Supply(job_id, block)
        rounds = _put(rounds, round_seq, replace(rnd, supply=supply))
    return replace(s, seq=seq, jobs=_put(s.jobs, job_id, job), rounds=rounds, pool=pool)


def _lookup(s: ProducerState, e: Any, **changes: Any) -> ProducerState:
    """``s`` after ``e``, with the changes to the lookup ``e`` names."""
    lookup = replace(s.lookups[e.lookup_id], **changes)
    return replace(s, seq=e.seq, lookups=_put(s.lookups, e.lookup_id, lookup))


def _keys_resolved(s: ProducerState, e: ev.KeysResolved) -> ProducerState:
    hits, misses = dict.fromkeys(e.hits, True), dict.fromkeys(e.misses, False)
    resolved = {**s.lookups[e.lookup_id].resolved, **hits, **misses}
    pending = frozenset(e.pending)
    s = _lookup(
        s, e, resolved=resolved, pending=pending, outstanding=False, next_poll_at=e.next_poll_at
    )
    return replace(s, open_contexts=s.open_contexts | {e.lookup_id})


def _lookup_answered(s: ProducerState, e: ev.LookupAnswered) -> ProducerState:
    if e.resolved:
        # The parent's answer, its pin and the answer in one step: the lookup
        # is over, its synthetic request closed with it.
        if e.pinned is not None:
            s = _pinned(s, e.seq, e.round_seq, e.pinned)
        return replace(
            s,
            seq=e.seq,
            lookups=_drop(s.lookups, e.lookup_id),
            open_contexts=s.open_contexts - {e.lookup_id},
        )
    return _lookup_ended(s, e, answered=True)  # at its deadline


def _context_closed(s: ProducerState, e: ev.ContextClosed) -> ProducerState:
    lookups = s.lookups
    closing = lookups.get(e.lookup_id)
    if closing is not None and (closing.dropped or closing.answered):
        lookups = _drop(lookups, e.lookup_id)
    return replace(s, seq=e.seq, lookups=lookups, open_contexts=s.open_contexts - {e.lookup_id})


def _lookup_ended(s: ProducerState, e: Any, **how: bool) -> ProducerState:
    """The lookup ``e`` names answered or dropped: forgotten, or marked ``how`` for the parent.

    A lookup the parent has not served yet is kept for its answer, whose pin must be released.
    """
    if s.lookups[e.lookup_id].outstanding:
        return _lookup(s, e, next_poll_at=None, **how)
    return replace(s, seq=e.seq, lookups=_drop(s.lookups, e.lookup_id))


def _closed(s: ProducerState, e: ev.Closed) -> ProducerState:
    if e.requested_round is not None:
        s = replace(s, phase=PRODUCER_PHASE_AT[ev.CloseRequested], close_reason=e.reason)
    for job_id in e.released:
        s = _evolve_pin_released(s, e.seq, job_id)
    for round_seq in e.rounds_closed:
        s = _evolve_round_ended(s, e.seq, round_seq, served=False)
    return replace(s, seq=e.seq, phase=PRODUCER_PHASE_AT[ev.Closed])


def _fetch_received(s: ProducerState, e: ev.FetchReceived) -> ProducerState:
    rnd = replace(
        _round(s, e.round_seq),
        fetched=True,
        demand=tuple(zip(e.keys, e.block_indexes, strict=True)),
        remaining=len(e.keys),
    )
    return replace(
        s,
        seq=e.seq,
        rounds=_put(s.rounds, e.round_seq, rnd),
        closed_through=max(s.closed_through, e.round_seq),
    )


def _transfer_started(s: ProducerState, e: ev.TransferStarted) -> ProducerState:
    rnd = s.rounds[e.round_seq]
    demand = list(rnd.demand)
    pool = s.pool
    for key, remote, job_id in zip(e.keys, e.remote_blocks, e.job_ids, strict=True):
        demand.remove((key, remote))
        in_round = rnd.supply.get(key)
        # Round supply is pinned for this round's one fetch and may be read more
        # than once; pool blocks are handed out once each, as vLLM does.
        if in_round is None or in_round.job_id != job_id:
            pool = _pool_take(pool, key, job_id)
    jobs = dict(s.jobs)
    for job_id in set(e.job_ids):
        job = jobs[job_id]
        jobs[job_id] = replace(
            job, readers=job.readers | {e.transfer_id}, serving=job.serving | {e.round_seq}
        )
    rnd = replace(rnd, demand=tuple(demand), inflight=rnd.inflight | {e.transfer_id})
    rounds, transfers = _put(s.rounds, e.round_seq, rnd), _put(s.transfers, e.transfer_id, e)
    n = e.transfer_id + 1
    return replace(
        s, seq=e.seq, rounds=rounds, jobs=jobs, pool=pool, transfers=transfers, next_transfer_id=n
    )


def _fetch_refused(s: ProducerState, e: ev.FetchRefused) -> ProducerState:
    refused = s.rounds[e.round_seq]
    refused = replace(refused, demand=(), failure=refused.failure or e.reason)
    return replace(s, seq=e.seq, rounds=_put(s.rounds, e.round_seq, refused))


def _pending_expired(s: ProducerState, e: ev.PendingExpired) -> ProducerState:
    lookup = s.lookups[e.lookup_id]
    resolved = {**lookup.resolved, **dict.fromkeys(e.keys, False)}
    return _lookup(
        s, e, resolved=resolved, pending=lookup.pending - frozenset(e.keys), next_poll_at=None
    )


def _abort_received(s: ProducerState, e: ev.AbortReceived) -> ProducerState:
    aborted = s.rounds.get(e.round_seq)
    if aborted is None:
        return replace(s, seq=e.seq)
    jobs = dict(s.jobs)
    for tid in aborted.inflight:
        for job_id in set(s.transfers[tid].job_ids):
            jobs[job_id] = replace(jobs[job_id], failed=True)
    aborted = replace(aborted, cancelled=True, demand=())
    return replace(s, seq=e.seq, rounds=_put(s.rounds, e.round_seq, aborted), jobs=jobs)


# How each producer event changes the state: ``evolve_producer``'s table, without its checks of
# actor and sequence (for a caller that made them: replay).
PRODUCER_FOLDS: Final[dict[type[ev.Event], Callable[[ProducerState, Any], ProducerState]]] = {
    ev.Ignored: lambda s, e: replace(s, seq=e.seq),
    ev.Rejected: lambda s, e: replace(s, seq=e.seq),
    ev.SessionLost: lambda s, e: replace(
        s, seq=e.seq, phase=PRODUCER_PHASE_AT[type(e)], session_lost=True, close_reason=e.reason
    ),
    ev.FinishRequested: lambda s, e: replace(s, seq=e.seq, finishing=True),
    ev.LookupReceived: lambda s, e: _evolve_lookup_opened(s, e, len(e.keys)),
    ev.LookupLimited: lambda s, e: _evolve_lookup_opened(s, e, e.admitted),
    # No lookup opens and nothing is held (so a refused request can close at once), but the round
    # counts as looked up: a fetch for it fails fast instead of waiting for stored blocks.
    ev.LookupRefused: lambda s, e: replace(
        s, seq=e.seq, looked_up_through=max(s.looked_up_through, e.round_seq)
    ),
    ev.KeysResolved: _keys_resolved,
    ev.KeysPinned: lambda s, e: _pinned(s, e.seq, e.round_seq, e),
    # The KeysResolved that follows counts the keys as misses; the answer says why.
    ev.KeysRefused: lambda s, e: _lookup(
        s, e, refused=s.lookups[e.lookup_id].refused | frozenset(e.keys)
    ),
    ev.PendingPolled: lambda s, e: _lookup(s, e, outstanding=True, next_poll_at=None),
    ev.ParentExpired: lambda s, e: _lookup(s, e, outstanding=False),
    ev.PendingExpired: _pending_expired,
    ev.LookupAnswered: _lookup_answered,
    ev.LookupDropped: lambda s, e: _lookup_ended(s, e, dropped=True),
    ev.ContextClosed: _context_closed,
    ev.StoreAdded: lambda s, e: _pinned(s, e.seq, None, e),
    ev.FetchReceived: _fetch_received,
    ev.FetchRefused: _fetch_refused,
    ev.TransferStarted: _transfer_started,
    ev.TransferCompleted: lambda s, e: _evolve_transfer_ended(s, e.seq, e.transfer_id, None),
    ev.TransferFailed: lambda s, e: _evolve_transfer_ended(s, e.seq, e.transfer_id, e.reason),
    ev.TransferDoneSent: lambda s, e: _evolve_round_ended(s, e.seq, e.round_seq, served=e.success),
    ev.AbortReceived: _abort_received,
    ev.AbortAckSent: lambda s, e: _evolve_round_ended(s, e.seq, e.round_seq, served=False),
    ev.RoundClosed: lambda s, e: _evolve_round_ended(s, e.seq, e.round_seq, served=False),
    ev.PinReleased: lambda s, e: _evolve_pin_released(s, e.seq, e.job_id),
    ev.CloseRequested: lambda s, e: replace(
        s, seq=e.seq, phase=PRODUCER_PHASE_AT[type(e)], close_reason=e.reason
    ),
    ev.Closed: _closed,
}

# Apply one event to a producer state; pure (ReplayError if it does not follow).
evolve_producer: Callable[[ProducerState, ev.ProducerEvent], ProducerState] = evolver(
    PRODUCER_FOLDS, ev.ProducerEvent
)
