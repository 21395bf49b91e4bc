"""What a producer request knows: its state records, and how its pins, rounds and transfers fold.

Also the copy helpers of those records, and the one way a pin is released
(:func:`_release`): a pin is released exactly once, and only a release that
ends a round its job served with no failure counts as a success. The lookups'
folds are in :mod:`~p2pactor.core.producer_lookups`; :mod:`~p2pactor.core.producer`
joins the two into :func:`~p2pactor.core.producer.evolve_producer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final

import msgspec
from msgspec.structs import replace

from p2pactor.core import events as ev
from p2pactor.core.builder import ActorRecord, Builder, drop, phase_after, put
from p2pactor.core.events import ProducerPhase
from p2pactor.core.ids import Role


class Transfer(msgspec.Struct, frozen=True, gc=False):
    """A write in flight: the round it serves, how many blocks it writes, the pin jobs it reads.

    Which round and which jobs a write holds up is known from these alone: a
    round or a job keeps no set of its own writes.
    """

    round_seq: int
    blocks: int
    jobs: frozenset[int]


class Supply(msgspec.Struct, frozen=True, gc=False):
    """A pinned block ready to be sent: which job pins it, and where it is."""

    job_id: int
    block: int


class ActiveLookup(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A lookup not answered yet.

    Attributes:
        lookup_id: Our number for it.
        keys: In wire order, duplicates included.
        admitted: How many of ``keys``, from the first, are looked up; the others are over the
            peer's keys-per-lookup quota and answer MISS (a refusal), even one that repeats an
            admitted key. No state is kept per key past them, so that a lookup's cost follows what
            the quota admits, not what the peer sent.
        deadline: When pending keys are answered MISS.
        resolved: Answers so far.
        pending: Keys without an answer yet.
        outstanding: A parent request for it is posted and not answered.
        next_poll_at: When to ask the parent again about ``pending``.
        answered: The answer went out at the deadline while the parent still had not served a
            request for it; its late answer is only cleaned up.
        dropped: The request closed; no answer will be sent.
        refused: Admitted keys answered MISS because the peer is over its pinned-blocks quota (not
            because we lack them).
    """

    lookup_id: int
    round_seq: int
    keys: tuple[bytes, ...]
    admitted: int
    deadline: float
    resolved: Mapping[bytes, bool] = msgspec.field(default_factory=dict)
    pending: frozenset[bytes] = frozenset()
    outstanding: bool = True
    next_poll_at: float | None = None
    answered: bool = False
    dropped: bool = False
    refused: frozenset[bytes] = frozenset()

    @property
    def waiting(self) -> bool:
        """Whether keys still wait for an answer: it was neither answered nor dropped."""
        return bool(self.pending) and not (self.answered or self.dropped)


class RoundState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One lookup -> fetch round of the request.

    Attributes:
        lookup_supplied: Lookups pinned supply for it (a symmetric round: keys that were not pinned
            fail the fetch at once).
        supply: Blocks its lookups pinned, by key.
        demand: ``(key, peer block)`` pairs of the fetch not matched yet.
        remaining: Blocks of the fetch not yet written.
        failure: Why the round failed ("" while it has not).
        cancelled: The peer aborted it.
    """

    round_seq: int
    lookup_supplied: bool = False
    supply: Mapping[bytes, Supply] = msgspec.field(default_factory=dict)
    fetched: bool = False
    demand: tuple[tuple[bytes, int], ...] = ()
    remaining: int = 0
    failure: str = ""
    cancelled: bool = False


class PinJob(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A parent job holding pinned blocks; released exactly once.

    Attributes:
        round_seq: The round whose lookup pinned it; None for a store of a prefill/decode request
            (it supplies any round).
        blocks: Our block index for each key.
        expires_at: When it is released if no fetch uses it.
        serving: Rounds not yet ended that its blocks were written for; a store job settles with
            those rounds, as vLLM settles every job of a round when the round ends.
        failed: A round it served failed or was aborted.
    """

    job_id: int
    round_seq: int | None
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]
    expires_at: float
    serving: frozenset[int] = frozenset()
    failed: bool = False


class ProducerState(ActorRecord, frozen=True, kw_only=True, gc=False):
    """Everything a producer actor knows, rebuilt exactly by replaying its events.

    Attributes:
        seq: The sequence number of the last event applied.
        lookups: Lookups not answered yet, by id.
        rounds: Rounds in progress, by round number.
        jobs: Pin jobs held, by job id.
        pool: Stored blocks of a prefill/decode request not sent yet, by key.
        transfers: Transfers in flight, by id.
        open_contexts: Lookups whose synthetic parent request is open.
        closed_through: The highest round closed by a fetch (-1: none).
        looked_up_through: The highest round that had a lookup (-1: none).
        first_pinned_at: When the request's first pin was taken: its leases end by
            ``pin_lease_cap`` after it.
        finishing: The engine will store no more blocks for the request.
        session_lost: The session ended; nothing can be sent.
        close_reason: Why the request is closing.
    """

    ROLE: ClassVar[Role] = Role.PRODUCER

    phase: ProducerPhase = ProducerPhase.OPEN
    next_lookup_id: int = 0
    next_transfer_id: int = 0
    lookups: Mapping[int, ActiveLookup] = msgspec.field(default_factory=dict)
    rounds: Mapping[int, RoundState] = msgspec.field(default_factory=dict)
    jobs: Mapping[int, PinJob] = msgspec.field(default_factory=dict)
    pool: Mapping[bytes, tuple[Supply, ...]] = msgspec.field(default_factory=dict)
    transfers: Mapping[int, Transfer] = msgspec.field(default_factory=dict)
    open_contexts: frozenset[int] = frozenset()
    closed_through: int = -1
    looked_up_through: int = -1
    first_pinned_at: float | None = None
    finishing: bool = False
    session_lost: bool = False
    close_reason: str = ""

    @property
    def idle(self) -> bool:
        """Whether the request holds nothing: no lookup, round, pin or transfer."""
        return not (
            self.lookups or self.rounds or self.jobs or self.transfers or self.open_contexts
        )

    def reading(self) -> set[int]:
        """The pin jobs whose blocks a transfer in flight reads."""
        return set().union(*(t.jobs for t in self.transfers.values())) if self.transfers else set()

    def writing(self) -> set[int]:
        """The rounds that a transfer in flight writes for."""
        return {t.round_seq for t in self.transfers.values()} if self.transfers else set()


# The builder every producer decision emits its events through.
_B = Builder[ProducerState, ev.ProducerEvent]


def _pool_take(
    pool: Mapping[bytes, tuple[Supply, ...]], key: bytes, job_id: int
) -> dict[bytes, tuple[Supply, ...]]:
    """Remove one entry of ``job_id`` for ``key`` from the pool."""
    out = dict(pool)
    entries = out.pop(key, ())
    at = next((i for i, sup in enumerate(entries) if sup.job_id == job_id), len(entries))
    if rest := entries[:at] + entries[at + 1 :]:
        out[key] = rest
    return out


def _round(s: ProducerState, round_seq: int) -> RoundState:
    return s.rounds.get(round_seq) or RoundState(round_seq=round_seq)


# How the reason of a :class:`~p2pactor.core.events.PinReleased` begins when the pin expired.
PIN_EXPIRED = "no fetch used it within"


def pin_expired(event: ev.PinReleased) -> bool:
    """Whether ``event`` released a pin because no fetch came for it in time."""
    return event.reason.startswith(PIN_EXPIRED)


def _release(b: _B, job_id: int, reason: str, *, served: bool = False) -> None:
    """Release ``job_id``: a success only if it ``served`` and no round it served failed.

    A job the state does not hold (a stray pin) is released too: it must not leak.
    """
    job = b.state.jobs.get(job_id)
    success = served and job is not None and not job.failed
    b.emit(ev.PinReleased, job_id=job_id, success=success, reason=reason)


def _set_round(s: ProducerState, e: ev.Event, rnd: RoundState, **changes: object) -> ProducerState:
    """``s`` after ``e``, with ``rnd`` as its round and the other ``changes``."""
    return replace(s, seq=e.seq, rounds=put(s.rounds, rnd.round_seq, rnd), **changes)


def _transfer_ended(s: ProducerState, e: Any, failure: str | None) -> ProducerState:
    t = s.transfers[e.transfer_id]
    jobs = dict(s.jobs)
    if failure is not None:
        for job_id in t.jobs & jobs.keys():
            jobs[job_id] = replace(jobs[job_id], failed=True)
    transfers = drop(s.transfers, e.transfer_id)
    rnd = s.rounds.get(t.round_seq)
    if rnd is None:
        return replace(s, seq=e.seq, jobs=jobs, transfers=transfers)
    # A failed write leaves its blocks unwritten: the round failed.
    if failure is None:
        rnd = replace(rnd, remaining=rnd.remaining - t.blocks)
    else:
        rnd = replace(rnd, failure=rnd.failure or failure)
    return _set_round(s, e, rnd, jobs=jobs, transfers=transfers)


def _pin_released(s: ProducerState, seq: int, job_id: int) -> ProducerState:
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
        rounds = put(rounds, job.round_seq, replace(rnd, supply=supply))
    return replace(s, seq=seq, jobs=drop(s.jobs, job_id), rounds=rounds, pool=pool)


def _round_ended(s: ProducerState, seq: int, round_seq: int, *, served: bool) -> ProducerState:
    jobs = dict(s.jobs)
    for job_id, job in s.jobs.items():
        if round_seq in job.serving:
            jobs[job_id] = replace(
                job, serving=job.serving - {round_seq}, failed=job.failed or not served
            )
    return replace(s, seq=seq, rounds=drop(s.rounds, round_seq), jobs=jobs)


def _pinned(
    s: ProducerState,
    e: ev.Event,
    round_seq: int | None,
    pin: ev.Pinned | ev.KeysPinned | ev.StoreAdded,
) -> ProducerState:
    """Blocks pinned in ``e``: the job held, its blocks a looked-up round's supply or the pool."""
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
        supply = {**rnd.supply, **{k: Supply(job_id, b) for k, b in zip(keys, blocks, strict=True)}}
        rounds = put(rounds, round_seq, replace(rnd, supply=supply))
    first = e.at if s.first_pinned_at is None else s.first_pinned_at
    jobs = put(s.jobs, job_id, job)
    return replace(s, seq=e.seq, jobs=jobs, rounds=rounds, pool=pool, first_pinned_at=first)


def _closed(s: ProducerState, e: ev.Closed) -> ProducerState:
    if e.requested_round is not None:
        s = replace(s, close_reason=e.reason)
    for job_id in e.released:
        s = _pin_released(s, e.seq, job_id)
    for round_seq in e.rounds_closed:
        s = _round_ended(s, e.seq, round_seq, served=False)
    return replace(s, seq=e.seq, phase=phase_after(s.phase, e))


def _fetch_received(s: ProducerState, e: ev.FetchReceived) -> ProducerState:
    demand = tuple(zip(e.keys, e.block_indexes, strict=True))
    rnd = replace(_round(s, e.round_seq), fetched=True, demand=demand, remaining=len(e.keys))
    return _set_round(s, e, rnd, closed_through=max(s.closed_through, e.round_seq))


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
    t = Transfer(e.round_seq, len(e.keys), frozenset(e.job_ids))
    jobs = dict(s.jobs)
    for job_id in t.jobs:
        jobs[job_id] = replace(jobs[job_id], serving=jobs[job_id].serving | {e.round_seq})
    rnd = replace(rnd, demand=tuple(demand))
    transfers = put(s.transfers, e.transfer_id, t)
    n = e.transfer_id + 1
    return _set_round(s, e, rnd, jobs=jobs, pool=pool, transfers=transfers, next_transfer_id=n)


def _fetch_refused(s: ProducerState, e: ev.FetchRefused) -> ProducerState:
    rnd = s.rounds[e.round_seq]
    return _set_round(s, e, replace(rnd, demand=(), failure=rnd.failure or e.reason))


def _abort_received(s: ProducerState, e: ev.AbortReceived) -> ProducerState:
    aborted = s.rounds.get(e.round_seq)
    if aborted is None:
        return replace(s, seq=e.seq)
    jobs = dict(s.jobs)
    for job_id in set().union(
        *(t.jobs for t in s.transfers.values() if t.round_seq == e.round_seq)
    ):
        jobs[job_id] = replace(jobs[job_id], failed=True)
    return _set_round(s, e, replace(aborted, cancelled=True, demand=()), jobs=jobs)


def _phase_moved(s: ProducerState, e: ev.SessionLost | ev.CloseRequested) -> ProducerState:
    return replace(s, seq=e.seq, phase=phase_after(s.phase, e), close_reason=e.reason)


# How each event of the pins, rounds and transfers (and of the request itself) changes the state:
# one part of ``evolve_producer``'s table (the lookups' part is in producer_lookups).
STATE_FOLDS: Final[dict[type[ev.Event], Callable[[ProducerState, Any], ProducerState]]] = {
    ev.Ignored: lambda s, e: replace(s, seq=e.seq),
    ev.Rejected: lambda s, e: replace(s, seq=e.seq),
    ev.SessionLost: lambda s, e: replace(_phase_moved(s, e), session_lost=True),
    ev.CloseRequested: _phase_moved,
    ev.Closed: _closed,
    ev.FinishRequested: lambda s, e: replace(s, seq=e.seq, finishing=True),
    ev.KeysPinned: lambda s, e: _pinned(s, e, e.round_seq, e),
    ev.StoreAdded: lambda s, e: _pinned(s, e, None, e),
    ev.PinsRenewed: lambda s, e: replace(
        s,
        seq=e.seq,
        jobs={**s.jobs, **{j: replace(s.jobs[j], expires_at=e.expires_at) for j in e.job_ids}},
    ),
    ev.PinReleased: lambda s, e: _pin_released(s, e.seq, e.job_id),
    ev.FetchReceived: _fetch_received,
    ev.FetchRefused: _fetch_refused,
    ev.TransferStarted: _transfer_started,
    ev.TransferCompleted: lambda s, e: _transfer_ended(s, e, None),
    ev.TransferFailed: lambda s, e: _transfer_ended(s, e, e.reason),
    ev.TransferDoneSent: lambda s, e: _round_ended(s, e.seq, e.round_seq, served=e.success),
    ev.AbortReceived: _abort_received,
    ev.AbortAckSent: lambda s, e: _round_ended(s, e.seq, e.round_seq, served=False),
    ev.RoundClosed: lambda s, e: _round_ended(s, e.seq, e.round_seq, served=False),
}
