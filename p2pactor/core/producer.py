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

import enum
from collections.abc import Mapping
from typing import TypeVar, assert_never

import attrs

from p2pactor import protocol as wire
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.builder import Builder
from p2pactor.core.events import Quota, Violation, check_follows
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.records import replace
from p2pactor.core.timings import DEFAULT_TIMINGS, Timings

__all__ = [
    "PIN_EXPIRED",
    "ActiveLookup",
    "PinJob",
    "ProducerInput",
    "ProducerPhase",
    "ProducerState",
    "RoundState",
    "Supply",
    "Transfer",
    "decide_producer",
    "evolve_producer",
    "next_producer_deadline",
    "pin_expired",
    "step_producer",
]

PIN_EXPIRED = "no fetch used it within"
"""How the reason of a :class:`~p2pactor.core.events.PinReleased` begins when the pin expired."""


def pin_expired(event: ev.PinReleased) -> bool:
    """Whether ``event`` released a pin because no fetch came for it in time."""
    return event.reason.startswith(PIN_EXPIRED)


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
"""Everything a producer actor reacts to."""


class ProducerPhase(enum.Enum):
    """Where a producer request is in its life. Phases only move forward."""

    OPEN = "open"
    """Serving lookups and fetches."""
    CLOSING = "closing"
    """Closed by the peer or by the session's end; draining what is in flight."""
    CLOSED = "closed"
    """Holds nothing any more. Terminal."""


@attrs.frozen
class Supply:
    """A pinned block ready to be sent: which job pins it, and where it is."""

    job_id: int
    block: int


@attrs.frozen(kw_only=True)
class ActiveLookup:
    """A lookup not answered yet.

    Attributes:
        lookup_id: Our number for it.
        round_seq: Its round.
        keys: Its keys in wire order, duplicates included.
        deadline: When pending keys are answered MISS.
        resolved: Answers so far.
        pending: Keys without an answer yet.
        outstanding: A parent request for it is posted and not answered.
        next_poll_at: When to ask the parent again about ``pending``.
        answered: The answer went out at the deadline while the parent still
            had not served a request for it; its late answer is only cleaned up.
        dropped: The request closed; no answer will be sent.
    """

    lookup_id: int
    round_seq: int
    keys: tuple[bytes, ...]
    deadline: float
    resolved: Mapping[bytes, bool] = attrs.field(factory=dict)
    pending: frozenset[bytes] = frozenset()
    outstanding: bool = True
    next_poll_at: float | None = None
    answered: bool = False
    dropped: bool = False


@attrs.frozen(kw_only=True)
class RoundState:
    """One lookup -> fetch round of the request.

    Attributes:
        round_seq: The round.
        lookup_supplied: Lookups pinned supply for it (a symmetric round: keys
            that were not pinned fail the fetch at once).
        supply: Blocks its lookups pinned, by key.
        fetched: Its fetch arrived.
        demand: ``(key, peer block)`` pairs of the fetch not matched yet.
        remaining: Blocks of the fetch not yet written.
        inflight: Transfers of this round still running.
        failure: Why the round failed ("" while it has not).
        cancelled: The peer aborted it.
    """

    round_seq: int
    lookup_supplied: bool = False
    supply: Mapping[bytes, Supply] = attrs.field(factory=dict)
    fetched: bool = False
    demand: tuple[tuple[bytes, int], ...] = ()
    remaining: int = 0
    inflight: frozenset[int] = frozenset()
    failure: str = ""
    cancelled: bool = False


@attrs.frozen(kw_only=True)
class PinJob:
    """A parent job holding pinned blocks; released exactly once.

    Attributes:
        job_id: The parent's job.
        round_seq: The round whose lookup pinned it; None for a store of a
            prefill/decode request (it supplies any round).
        keys: The pinned keys.
        blocks: Our block index for each key.
        expires_at: When it is released if no fetch uses it.
        readers: Transfers reading its blocks right now.
        serving: Rounds not yet ended that its blocks were written for; a
            store job settles with those rounds, as vLLM settles every job of
            a round when the round ends.
        failed: A round it served failed or was aborted.
    """

    job_id: int
    round_seq: int | None
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]
    expires_at: float
    readers: frozenset[int] = frozenset()
    serving: frozenset[int] = frozenset()
    failed: bool = False


@attrs.frozen(kw_only=True)
class Transfer:
    """A WRITE in flight.

    Attributes:
        transfer_id: Our number for it.
        round_seq: The round it serves.
        job_ids: The jobs whose blocks it reads.
        blocks: How many blocks it writes.
    """

    transfer_id: int
    round_seq: int
    job_ids: frozenset[int]
    blocks: int


@attrs.frozen(kw_only=True)
class ProducerState:
    """Everything a producer actor knows, rebuilt exactly by replaying its events.

    Attributes:
        actor: Who this is.
        seq: The sequence number of the last event applied.
        phase: OPEN, CLOSING or CLOSED.
        next_lookup_id: The number of the next lookup.
        next_transfer_id: The number of the next transfer.
        lookups: Lookups not answered yet, by id.
        rounds: Rounds in progress, by round number.
        jobs: Pin jobs held, by job id.
        pool: Stored blocks of a prefill/decode request not sent yet, by key.
        transfers: Transfers in flight, by id.
        open_contexts: Lookups whose synthetic parent request is open.
        closed_through: The highest round closed by a fetch (-1: none).
        looked_up_through: The highest round that had a lookup (-1: none).
        finishing: The engine will store no more blocks for the request.
        session_lost: The session ended; nothing can be sent.
        close_reason: Why the request is closing.
    """

    actor: ActorId
    seq: int = 0
    phase: ProducerPhase = ProducerPhase.OPEN
    next_lookup_id: int = 0
    next_transfer_id: int = 0
    lookups: Mapping[int, ActiveLookup] = attrs.field(factory=dict)
    rounds: Mapping[int, RoundState] = attrs.field(factory=dict)
    jobs: Mapping[int, PinJob] = attrs.field(factory=dict)
    pool: Mapping[bytes, tuple[Supply, ...]] = attrs.field(factory=dict)
    transfers: Mapping[int, Transfer] = attrs.field(factory=dict)
    open_contexts: frozenset[int] = frozenset()
    closed_through: int = -1
    looked_up_through: int = -1
    finishing: bool = False
    session_lost: bool = False
    close_reason: str = ""

    @classmethod
    def new(cls, actor: ActorId) -> ProducerState:
        """The state of a producer before its first event."""
        if actor.role is not Role.PRODUCER:
            raise ValueError(f"{actor} is not a producer")
        return cls(actor=actor)

    @property
    def idle(self) -> bool:
        """Whether the request holds nothing: no lookup, round, pin or transfer."""
        return not (
            self.lookups or self.rounds or self.jobs or self.transfers or self.open_contexts
        )


# --- evolve -------------------------------------------------------------------------


K = TypeVar("K")
V = TypeVar("V")


def _put(mapping: Mapping[K, V], key: K, value: V) -> dict[K, V]:
    out = dict(mapping)
    out[key] = value
    return out


def _drop(mapping: Mapping[K, V], key: K) -> dict[K, V]:
    out = dict(mapping)
    out.pop(key, None)
    return out


def _pool_take(
    pool: Mapping[bytes, tuple[Supply, ...]], key: bytes, job_id: int
) -> dict[bytes, tuple[Supply, ...]]:
    """Remove one entry of ``job_id`` for ``key`` from the pool."""
    out = dict(pool)
    entries = list(out.get(key, ()))
    for i, sup in enumerate(entries):
        if sup.job_id == job_id:
            del entries[i]
            break
    if entries:
        out[key] = tuple(entries)
    else:
        out.pop(key, None)
    return out


def _evolve_transfer_started(s: ProducerState, e: ev.TransferStarted) -> ProducerState:
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
    rounds = dict(s.rounds)
    rounds[e.round_seq] = replace(
        rnd, demand=tuple(demand), inflight=rnd.inflight | {e.transfer_id}
    )
    transfers = dict(s.transfers)
    transfers[e.transfer_id] = Transfer(
        transfer_id=e.transfer_id,
        round_seq=e.round_seq,
        job_ids=frozenset(e.job_ids),
        blocks=len(e.keys),
    )
    return replace(
        s,
        seq=e.seq,
        rounds=rounds,
        jobs=jobs,
        pool=pool,
        transfers=transfers,
        next_transfer_id=e.transfer_id + 1,
    )


def _evolve_transfer_ended(
    s: ProducerState, seq: int, transfer_id: int, failure: str | None
) -> ProducerState:
    t = s.transfers[transfer_id]
    jobs = dict(s.jobs)
    for job_id in t.job_ids:
        job = jobs.get(job_id)
        if job is not None:
            jobs[job_id] = replace(
                job, readers=job.readers - {transfer_id}, failed=job.failed or failure is not None
            )
    rounds = dict(s.rounds)
    rnd = rounds.get(t.round_seq)
    if rnd is not None:
        if failure is None:
            rnd = replace(
                rnd, inflight=rnd.inflight - {transfer_id}, remaining=rnd.remaining - t.blocks
            )
        else:
            rnd = replace(
                rnd, inflight=rnd.inflight - {transfer_id}, failure=rnd.failure or failure
            )
        rounds[t.round_seq] = rnd
    return replace(s, seq=seq, jobs=jobs, rounds=rounds, transfers=_drop(s.transfers, transfer_id))


def _evolve_pin_released(s: ProducerState, seq: int, job_id: int) -> ProducerState:
    job = s.jobs.get(job_id)
    if job is None:
        return replace(s, seq=seq)  # a stray pin released without ever being held
    rounds = s.rounds
    pool = s.pool
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
    asked = frozenset(e.keys[:admitted])
    lookup = ActiveLookup(
        lookup_id=e.lookup_id,
        round_seq=e.round_seq,
        keys=e.keys,
        deadline=e.deadline,
        resolved={k: False for k in e.keys[admitted:] if k not in asked},
        pending=asked,
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


def _round(s: ProducerState, round_seq: int) -> RoundState:
    return s.rounds.get(round_seq) or RoundState(round_seq=round_seq)


def _with_lookup(s: ProducerState, seq: int, lookup: ActiveLookup) -> ProducerState:
    return replace(s, seq=seq, lookups=_put(s.lookups, lookup.lookup_id, lookup))


def evolve_producer(state: ProducerState, event: ev.ProducerEvent) -> ProducerState:
    """Apply one event to a producer state; pure. One copy of the state per event.

    Raises:
        ReplayError: The event belongs to another actor or does not follow the
            last one applied.
    """
    check_follows(state.actor, state.seq, event)
    s = state
    seq = event.seq
    match event:
        case ev.LookupReceived():
            return _evolve_lookup_opened(s, event, len(event.keys))
        case ev.KeysResolved():
            lookup = s.lookups[event.lookup_id]
            resolved = dict(lookup.resolved)
            resolved.update(dict.fromkeys(event.hits, True))
            resolved.update(dict.fromkeys(event.misses, False))
            lookup = replace(
                lookup,
                resolved=resolved,
                pending=frozenset(event.pending),
                outstanding=False,
                next_poll_at=event.next_poll_at,
            )
            return replace(
                s,
                seq=seq,
                lookups=_put(s.lookups, event.lookup_id, lookup),
                open_contexts=s.open_contexts | {event.lookup_id},
            )
        case ev.KeysPinned():
            job = PinJob(
                job_id=event.job_id,
                round_seq=event.round_seq,
                keys=event.keys,
                blocks=event.blocks,
                expires_at=event.expires_at,
            )
            rounds = s.rounds
            if event.round_seq in rounds:
                rnd = rounds[event.round_seq]
                supply = dict(rnd.supply)
                for key, block in zip(event.keys, event.blocks, strict=True):
                    supply[key] = Supply(event.job_id, block)
                rounds = _put(rounds, event.round_seq, replace(rnd, supply=supply))
            return replace(s, seq=seq, jobs=_put(s.jobs, event.job_id, job), rounds=rounds)
        case ev.LookupAnswered():
            answered = s.lookups[event.lookup_id]
            if answered.outstanding:
                # Answered at its deadline with the parent still busy: keep it
                # until the parent's answer, whose pin must be released.
                return _with_lookup(s, seq, replace(answered, answered=True, next_poll_at=None))
            return replace(s, seq=seq, lookups=_drop(s.lookups, event.lookup_id))
        case ev.ContextClosed():
            lookups = s.lookups
            closing = lookups.get(event.lookup_id)
            if closing is not None and (closing.dropped or closing.answered):
                lookups = _drop(lookups, event.lookup_id)
            return replace(
                s, seq=seq, lookups=lookups, open_contexts=s.open_contexts - {event.lookup_id}
            )
        case ev.CloseRequested():
            return replace(s, seq=seq, phase=ProducerPhase.CLOSING, close_reason=event.reason)
        case ev.LookupDropped():
            lookup = s.lookups[event.lookup_id]
            if lookup.outstanding:
                # Keep it until the parent's answer arrives: that answer may
                # carry a pin that must still be released.
                return _with_lookup(s, seq, replace(lookup, dropped=True, next_poll_at=None))
            return replace(s, seq=seq, lookups=_drop(s.lookups, event.lookup_id))
        case ev.PinReleased():
            return _evolve_pin_released(s, seq, event.job_id)
        case ev.TransferDoneSent() | ev.AbortAckSent() | ev.RoundClosed():
            served = isinstance(event, ev.TransferDoneSent) and event.success
            return _evolve_round_ended(s, seq, event.round_seq, served=served)
        case ev.Closed():
            return replace(s, seq=seq, phase=ProducerPhase.CLOSED)
        case ev.FetchReceived():
            rnd = replace(
                _round(s, event.round_seq),
                fetched=True,
                demand=tuple(zip(event.keys, event.block_indexes, strict=True)),
                remaining=len(event.keys),
            )
            return replace(
                s,
                seq=seq,
                rounds=_put(s.rounds, event.round_seq, rnd),
                closed_through=max(s.closed_through, event.round_seq),
            )
        case ev.TransferStarted():
            return _evolve_transfer_started(s, event)
        case ev.TransferCompleted():
            return _evolve_transfer_ended(s, seq, event.transfer_id, None)
        case ev.FinishRequested():
            return replace(s, seq=seq, finishing=True)
        case ev.Ignored() | ev.Rejected() | ev.KeysRefused():
            # KeysRefused: the KeysResolved that follows counts the keys as misses.
            return replace(s, seq=seq)
        case ev.SessionLost():
            return replace(
                s,
                seq=seq,
                phase=ProducerPhase.CLOSING,
                session_lost=True,
                close_reason=event.reason,
            )
        case ev.LookupLimited():
            return _evolve_lookup_opened(s, event, event.admitted)
        case ev.LookupRefused():
            # No lookup opens and nothing is held (so a refused request can
            # close at once), but the round counts as looked up: a fetch for
            # it fails fast instead of waiting for stored blocks.
            return replace(s, seq=seq, looked_up_through=max(s.looked_up_through, event.round_seq))
        case ev.FetchRefused():
            refused = s.rounds[event.round_seq]
            refused = replace(refused, demand=(), failure=refused.failure or event.reason)
            return replace(s, seq=seq, rounds=_put(s.rounds, event.round_seq, refused))
        case ev.PendingPolled():
            lookup = replace(s.lookups[event.lookup_id], outstanding=True, next_poll_at=None)
            return _with_lookup(s, seq, lookup)
        case ev.ParentExpired():
            return _with_lookup(s, seq, replace(s.lookups[event.lookup_id], outstanding=False))
        case ev.PendingExpired():
            lookup = s.lookups[event.lookup_id]
            resolved = dict(lookup.resolved)
            resolved.update(dict.fromkeys(event.keys, False))
            lookup = replace(
                lookup,
                resolved=resolved,
                pending=lookup.pending - frozenset(event.keys),
                next_poll_at=None,
            )
            return _with_lookup(s, seq, lookup)
        case ev.StoreAdded():
            job = PinJob(
                job_id=event.job_id,
                round_seq=None,
                keys=event.keys,
                blocks=event.blocks,
                expires_at=event.expires_at,
            )
            pool = dict(s.pool)
            for key, block in zip(event.keys, event.blocks, strict=True):
                pool[key] = (*pool.get(key, ()), Supply(event.job_id, block))
            return replace(s, seq=seq, jobs=_put(s.jobs, event.job_id, job), pool=pool)
        case ev.TransferFailed():
            return _evolve_transfer_ended(s, seq, event.transfer_id, event.reason)
        case ev.AbortReceived():
            aborted = s.rounds.get(event.round_seq)
            if aborted is None:
                return replace(s, seq=seq)
            jobs = dict(s.jobs)
            for tid in aborted.inflight:
                for job_id in s.transfers[tid].job_ids:
                    jobs[job_id] = replace(jobs[job_id], failed=True)
            aborted = replace(aborted, cancelled=True, demand=())
            return replace(s, seq=seq, rounds=_put(s.rounds, event.round_seq, aborted), jobs=jobs)
        case _:
            assert_never(event)


# --- decide -------------------------------------------------------------------------

_B = Builder[ProducerState, ev.ProducerEvent]


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
            _tick(b, timings)
        case inp.SessionEnded():
            _on_session_ended(b, event_input.reason)
        case _:
            assert_never(event_input)
    _sweep(b)
    return b.state, tuple(b.events)


def decide_producer(
    state: ProducerState,
    event_input: ProducerInput,
    now: float,
    timings: Timings = DEFAULT_TIMINGS,
) -> tuple[ev.ProducerEvent, ...]:
    """The events that ``event_input`` at time ``now`` produces; pure."""
    return step_producer(state, event_input, now, timings)[1]


def _reject(b: _B, msg: wire.Message, violation: Violation, detail: str) -> None:
    b.emit(ev.Rejected(**b.head, input=msg.TYPE, violation=violation, detail=detail))


def _on_lookup(b: _B, msg: wire.Lookup, t: Timings, verdict: inp.OverQuota | None = None) -> None:
    s = b.state
    if s.phase is ProducerPhase.CLOSING:
        _reject(b, msg, Violation.AFTER_CLOSE, "lookup after the request was closed")
        return
    if msg.round_seq <= s.closed_through:
        detail = (
            f"lookup for round {msg.round_seq}, but round {s.closed_through} was already "
            "fetched; rounds only move forward"
        )
        _reject(b, msg, Violation.STALE_ROUND, detail)
        return
    if not msg.keys:
        b.emit(ev.Ignored(**b.head, input=msg.TYPE, reason="a lookup without keys"))
        return
    # A quota refusal is checked after the protocol's own rules: a peer over
    # quota that also breaks the protocol is still disconnected.
    admit = len(msg.keys) if verdict is None else min(verdict.admit, len(msg.keys))
    if verdict is not None and admit <= 0:
        b.emit(
            ev.LookupRefused(
                **b.head,
                round_seq=msg.round_seq,
                keys=msg.keys,
                quota=verdict.quota,
                reason=verdict.reason,
            )
        )
        return
    budget = t.pending_timeout
    if msg.deadline_ms is not None:
        budget = min(budget, msg.deadline_ms / 1000)
    if verdict is not None and admit < len(msg.keys):
        b.emit(
            ev.LookupLimited(
                **b.head,
                lookup_id=s.next_lookup_id,
                round_seq=msg.round_seq,
                keys=msg.keys,
                admitted=admit,
                deadline=b.now + budget,
                reason=verdict.reason,
            )
        )
        return
    b.emit(
        ev.LookupReceived(
            **b.head,
            lookup_id=s.next_lookup_id,
            round_seq=msg.round_seq,
            keys=msg.keys,
            deadline=b.now + budget,
        )
    )


def _pin_refusal(s: ProducerState, lookup: ActiveLookup) -> str:
    """Why a fresh pin for ``lookup`` can't be kept, or "" if it can."""
    if lookup.dropped or s.phase is not ProducerPhase.OPEN:
        return "the request closed before the pin arrived"
    if lookup.answered:
        return "the lookup was answered at its deadline before the parent served it"
    if lookup.round_seq <= s.closed_through:
        return f"round {lookup.round_seq} was fetched before the pin arrived"
    return ""


def _on_parent_answer(b: _B, answer: inp.ParentAnswer, t: Timings) -> None:
    lookup = b.state.lookups.get(answer.lookup_id)
    if lookup is None or not lookup.outstanding:
        reason = f"no lookup {answer.lookup_id} is waiting for the parent"
        b.emit(ev.Ignored(**b.head, input="parent_answer", reason=reason))
        if answer.pin is not None:
            # Whatever went wrong, the pin must not leak.
            b.emit(
                ev.PinReleased(
                    **b.head, job_id=answer.pin.job_id, success=False, reason="stray parent answer"
                )
            )
        return
    if answer.expired:
        b.emit(ev.ParentExpired(**b.head, lookup_id=lookup.lookup_id))
        if answer.pin is not None:  # the runtime never pins past not_after; if it did:
            reason = "an expired parent answer carried a pin"
            b.emit(ev.Ignored(**b.head, input="parent_answer", reason=reason))
            b.emit(ev.PinReleased(**b.head, job_id=answer.pin.job_id, success=False, reason=reason))
    else:
        _resolve(b, lookup, answer, t)
    lookup = b.state.lookups[answer.lookup_id]
    done = lookup.dropped or lookup.answered
    if lookup.pending and not done and b.now >= lookup.deadline:
        b.emit(ev.PendingExpired(**b.head, lookup_id=lookup.lookup_id, keys=_ordered(lookup)))
    _settle_lookup(b, answer.lookup_id)


def _ordered(lookup: ActiveLookup) -> tuple[bytes, ...]:
    """The lookup's pending keys in wire order, once each."""
    return tuple(k for k in dict.fromkeys(lookup.keys) if k in lookup.pending)


def _resolve(b: _B, lookup: ActiveLookup, answer: inp.ParentAnswer, t: Timings) -> None:
    results = dict(answer.results)
    pinned = set(answer.pin.keys) if answer.pin is not None else set()
    if answer.refused:
        refused = set(answer.refused) - pinned
        keys = tuple(k for k in _ordered(lookup) if k in refused)
        if keys:
            b.emit(
                ev.KeysRefused(
                    **b.head,
                    lookup_id=lookup.lookup_id,
                    keys=keys,
                    quota=Quota.PINNED_BLOCKS,
                    reason=answer.refusal or "the peer is over its pinned-blocks quota",
                )
            )
    hits: list[bytes] = []
    misses: list[bytes] = []
    pending: list[bytes] = []
    for key in _ordered(lookup):
        result = results.get(key)
        if result is inp.LookupResult.HIT:
            # A hit the parent could not pin is no hit: it may be evicted.
            (hits if key in pinned else misses).append(key)
        elif result is inp.LookupResult.MISS:
            misses.append(key)
        else:  # HIT_PENDING, RETRY, or not answered: ask again
            pending.append(key)
    next_poll = None
    if pending and b.now < lookup.deadline:
        next_poll = min(b.now + t.pending_poll_interval, lookup.deadline)
    b.emit(
        ev.KeysResolved(
            **b.head,
            lookup_id=lookup.lookup_id,
            hits=hits,
            misses=misses,
            pending=pending,
            next_poll_at=next_poll,
        )
    )
    if answer.pin is None:
        return
    pin = answer.pin
    b.emit(
        ev.KeysPinned(
            **b.head,
            lookup_id=lookup.lookup_id,
            round_seq=lookup.round_seq,
            job_id=pin.job_id,
            keys=pin.keys,
            blocks=pin.blocks,
            expires_at=b.now + t.pin_timeout,
        )
    )
    refusal = _pin_refusal(b.state, lookup)
    if refusal:
        b.emit(ev.PinReleased(**b.head, job_id=pin.job_id, success=False, reason=refusal))


def _settle_lookup(b: _B, lookup_id: int) -> None:
    """Answer (or forget) a lookup once nothing about it is outstanding."""
    lookup = b.state.lookups.get(lookup_id)
    if lookup is None or lookup.outstanding:
        return
    if not (lookup.dropped or lookup.answered):
        if lookup.pending:
            return
        _answer(b, lookup)
    if lookup_id in b.state.open_contexts:
        b.emit(ev.ContextClosed(**b.head, lookup_id=lookup_id))


def _answer(b: _B, lookup: ActiveLookup) -> None:
    """Send the lookup's one answer, keys in wire order, duplicates included."""
    b.emit(
        ev.LookupAnswered(
            **b.head,
            lookup_id=lookup.lookup_id,
            round_seq=lookup.round_seq,
            keys=lookup.keys,
            hits=tuple(lookup.resolved[k] for k in lookup.keys),
        )
    )


def _drop_lookups(b: _B, reason: str) -> None:
    for lookup_id, lookup in sorted(b.state.lookups.items()):
        if not lookup.dropped:
            b.emit(ev.LookupDropped(**b.head, lookup_id=lookup_id, reason=reason))
            if lookup_id in b.state.open_contexts and lookup_id not in b.state.lookups:
                b.emit(ev.ContextClosed(**b.head, lookup_id=lookup_id))


def _plan(s: ProducerState, round_seq: int) -> tuple[list[tuple[bytes, int, Supply]], int]:
    """Match a round's parked demand against its supply and the pool.

    Returns:
        The matched ``(key, peer block, supply)`` triples and how many demanded
        blocks stay unmatched.
    """
    rnd = s.rounds[round_seq]
    taken: dict[bytes, int] = {}
    matched: list[tuple[bytes, int, Supply]] = []
    unmatched = 0
    for key, remote in rnd.demand:
        sup = rnd.supply.get(key)
        if sup is None:
            entries = s.pool.get(key, ())
            used = taken.get(key, 0)
            if used < len(entries):
                sup = entries[used]
                taken[key] = used + 1
        if sup is None:
            unmatched += 1
        else:
            matched.append((key, remote, sup))
    return matched, unmatched


def _start(b: _B, round_seq: int, matched: list[tuple[bytes, int, Supply]]) -> None:
    b.emit(
        ev.TransferStarted(
            **b.head,
            transfer_id=b.state.next_transfer_id,
            round_seq=round_seq,
            keys=[key for key, _, _ in matched],
            local_blocks=[sup.block for _, _, sup in matched],
            remote_blocks=[remote for _, remote, _ in matched],
            job_ids=[sup.job_id for _, _, sup in matched],
        )
    )


def _on_fetch(b: _B, msg: wire.Fetch, verdict: inp.OverQuota | None = None) -> None:
    s = b.state
    r = msg.round_seq
    if s.phase is ProducerPhase.CLOSING:
        if msg.keys:
            _reject(b, msg, Violation.AFTER_CLOSE, f"fetch for round {r} after the request closed")
        else:
            b.emit(ev.Ignored(**b.head, input=msg.TYPE, reason="the request is already closed"))
        return
    if len(msg.keys) != len(msg.block_indexes):
        detail = f"{len(msg.keys)} keys but {len(msg.block_indexes)} block indexes"
        _reject(b, msg, Violation.MALFORMED, detail)
        return
    if not msg.keys:
        reason = "the consumer finished the request (empty fetch)"
        b.emit(ev.CloseRequested(**b.head, round_seq=r, reason=reason))
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
    b.emit(ev.FetchReceived(**b.head, round_seq=r, keys=msg.keys, block_indexes=msg.block_indexes))
    if verdict is not None:
        # The round fails whole and at once; the sweep ends it, releasing its pins.
        b.emit(ev.FetchRefused(**b.head, round_seq=r, quota=verdict.quota, reason=verdict.reason))
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


def _on_abort(b: _B, msg: wire.AbortFetch) -> None:
    s = b.state
    r = msg.round_seq
    rnd = s.rounds.get(r)
    if rnd is not None and rnd.fetched:
        if rnd.cancelled:
            b.emit(ev.Ignored(**b.head, input=msg.TYPE, reason=f"round {r} is already aborting"))
            return
        b.emit(ev.AbortReceived(**b.head, round_seq=r))
        _release_round_jobs(b, r, success=False, reason=f"round {r} aborted", idle_only=True)
    elif r <= s.closed_through:
        # The round ended before the abort arrived (its transfer_done crossed
        # the abort on the wire): nothing of it can still write.
        b.emit(ev.AbortReceived(**b.head, round_seq=r))
        if rnd is None and not s.session_lost:
            b.emit(ev.AbortAckSent(**b.head, round_seq=r))
        # A looked-up round that a later round's fetch skipped is still here,
        # holding its pins: the sweep releases them, then acks.
    else:
        _reject(b, msg, Violation.UNKNOWN_ROUND, f"abort for round {r}, which was never fetched")


def _on_store(b: _B, store: inp.AddStore, t: Timings) -> None:
    b.emit(
        ev.StoreAdded(
            **b.head,
            job_id=store.job_id,
            keys=store.keys,
            blocks=store.blocks,
            expires_at=b.now + t.pin_timeout,
        )
    )
    if b.state.phase is not ProducerPhase.OPEN:
        return  # the sweep releases it
    for r, rnd in sorted(b.state.rounds.items()):
        if rnd.fetched and rnd.demand and not rnd.cancelled and not rnd.failure:
            matched, _ = _plan(b.state, r)
            if matched:
                _start(b, r, matched)


def _on_transfer_result(b: _B, result: inp.TransferResult) -> None:
    if result.transfer_id not in b.state.transfers:
        reason = f"no transfer {result.transfer_id} is in flight"
        b.emit(ev.Ignored(**b.head, input="transfer_result", reason=reason))
    elif result.ok:
        b.emit(ev.TransferCompleted(**b.head, transfer_id=result.transfer_id))
    else:
        reason = result.reason or "the transfer failed"
        b.emit(ev.TransferFailed(**b.head, transfer_id=result.transfer_id, reason=reason))


def _on_local_finish(b: _B) -> None:
    if b.state.finishing:
        return
    b.emit(ev.FinishRequested(**b.head))
    _drop_lookups(b, "the engine finished the request")


def _on_session_ended(b: _B, reason: str) -> None:
    if b.state.session_lost:
        return
    b.emit(ev.SessionLost(**b.head, reason=reason))
    _drop_lookups(b, f"session lost: {reason}")


def _expirable(s: ProducerState, job: PinJob) -> bool:
    """A pin no fetch is using or about to use: it may time out."""
    if job.readers or job.serving:
        return False
    if job.round_seq is None:
        return True
    rnd = s.rounds.get(job.round_seq)
    return rnd is None or not rnd.fetched


def _tick(b: _B, t: Timings) -> None:
    now = b.now
    for lookup_id, lookup in sorted(b.state.lookups.items()):
        if lookup.answered or lookup.dropped or not lookup.pending:
            continue
        if now >= lookup.deadline:
            # The deadline holds even while the parent has not served us (an
            # engine that stopped stepping): answer now, clean up when it does.
            b.emit(ev.PendingExpired(**b.head, lookup_id=lookup_id, keys=_ordered(lookup)))
            if lookup.outstanding:
                _answer(b, b.state.lookups[lookup_id])
            else:
                _settle_lookup(b, lookup_id)
        elif lookup.outstanding:
            continue
        elif lookup.next_poll_at is not None and now >= lookup.next_poll_at:
            b.emit(
                ev.PendingPolled(
                    **b.head, lookup_id=lookup_id, keys=_ordered(lookup), not_after=lookup.deadline
                )
            )
    for job_id, job in sorted(b.state.jobs.items()):
        if now >= job.expires_at and _expirable(b.state, job):
            reason = f"{PIN_EXPIRED} {t.pin_timeout:g} s"
            b.emit(ev.PinReleased(**b.head, job_id=job_id, success=False, reason=reason))


def _release_round_jobs(
    b: _B, round_seq: int, *, success: bool, reason: str, idle_only: bool = False
) -> None:
    for job_id, job in sorted(b.state.jobs.items()):
        if job.round_seq == round_seq and not (idle_only and job.readers):
            b.emit(
                ev.PinReleased(
                    **b.head, job_id=job_id, success=success and not job.failed, reason=reason
                )
            )


def _finalize(b: _B, round_seq: int, *, success: bool, reason: str) -> None:
    """End a fetched round: release its pins and tell the peer, if it can hear."""
    _release_round_jobs(b, round_seq, success=success, reason=reason or "round served")
    if b.state.phase is ProducerPhase.OPEN:
        b.emit(ev.TransferDoneSent(**b.head, round_seq=round_seq, success=success, reason=reason))
    else:
        b.emit(ev.RoundClosed(**b.head, round_seq=round_seq, reason=b.state.close_reason))


def _sweep_round(b: _B, rnd: RoundState) -> None:
    s = b.state
    r = rnd.round_seq
    if rnd.inflight:
        return  # a write may still land in the peer's blocks: wait for it
    if rnd.cancelled:
        _release_round_jobs(b, r, success=False, reason=f"round {r} aborted")
        if s.session_lost:
            b.emit(ev.RoundClosed(**b.head, round_seq=r, reason=s.close_reason))
        else:
            b.emit(ev.AbortAckSent(**b.head, round_seq=r))
    elif not rnd.fetched:
        # A looked-up round waits for its fetch, even once its pins expired, so
        # that a late fetch fails fast instead of parking (vLLM keeps it too).
        # Only the end of the request ends it.
        if s.phase is not ProducerPhase.OPEN:
            _release_round_jobs(b, r, success=False, reason=s.close_reason)
            b.emit(ev.RoundClosed(**b.head, round_seq=r, reason=s.close_reason))
    elif rnd.failure:
        _finalize(b, r, success=False, reason=rnd.failure)
    elif rnd.demand:
        if s.finishing or s.phase is not ProducerPhase.OPEN:
            reason = f"{len(rnd.demand)} demanded blocks were never stored"
            _finalize(b, r, success=False, reason=reason)
    elif rnd.remaining == 0:
        _finalize(b, r, success=True, reason="")


def _sweep(b: _B) -> None:
    """Settle whatever the step made settle-able, then close if nothing is held."""
    for _, rnd in sorted(b.state.rounds.items()):
        _sweep_round(b, rnd)
    s = b.state
    in_pool = {sup.job_id for entries in s.pool.values() for sup in entries}
    # Once the engine stored its last block and every fetch so far was served,
    # leftover stored blocks can serve nobody.
    served_out = s.finishing and s.closed_through >= 0 and not s.rounds
    for job_id, job in sorted(s.jobs.items()):
        # A failed job's outcome is settled; a good one waits for its rounds.
        if job.round_seq is not None or job.readers or (job.serving and not job.failed):
            continue
        if job_id not in in_pool:
            b.emit(
                ev.PinReleased(
                    **b.head, job_id=job_id, success=not job.failed, reason="all blocks served"
                )
            )
        elif s.phase is not ProducerPhase.OPEN:
            b.emit(ev.PinReleased(**b.head, job_id=job_id, success=False, reason=s.close_reason))
        elif served_out:
            reason = "the engine finished and no fetch is waiting for these blocks"
            b.emit(ev.PinReleased(**b.head, job_id=job_id, success=False, reason=reason))
    if b.state.idle:
        reason = b.state.close_reason or "nothing left to serve"
        b.emit(ev.Closed(**b.head, reason=reason))


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
