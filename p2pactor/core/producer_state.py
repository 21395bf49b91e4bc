"""What a producer request knows: its state records, rebuilt by replaying its events.

Also the copy helpers of those records, and pin releases: every
:class:`~p2pactor.core.events.PinReleased` is decided here. A pin is released
exactly once, and only a release that ends a round its job served with no
failure counts as a success.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar, Final, TypeVar

import msgspec

from p2pactor.core import events as ev
from p2pactor.core.builder import ActorRecord, Builder
from p2pactor.core.ids import IdentityEnum, Role
from p2pactor.core.timings import Timings


class ProducerPhase(IdentityEnum):
    """Where a producer request is in its life. Phases only move forward.

    Attributes:
        OPEN: Serving lookups and fetches.
        CLOSING: Closed by the peer or by the session's end; draining what is in flight.
        CLOSED: Holds nothing any more. Terminal.
    """

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"

    @property
    def terminal(self) -> bool:
        """Whether the request has ended."""
        return self is ProducerPhase.CLOSED


# The phase each event moves a producer to; any other event leaves it as it is.
PRODUCER_PHASE_AT: Final[Mapping[type[ev.Event], ProducerPhase]] = {
    ev.SessionLost: ProducerPhase.CLOSING,
    ev.CloseRequested: ProducerPhase.CLOSING,
    ev.Closed: ProducerPhase.CLOSED,
}


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
        inflight: Transfers of this round still running.
        failure: Why the round failed ("" while it has not).
        cancelled: The peer aborted it.
    """

    round_seq: int
    lookup_supplied: bool = False
    supply: Mapping[bytes, Supply] = msgspec.field(default_factory=dict)
    fetched: bool = False
    demand: tuple[tuple[bytes, int], ...] = ()
    remaining: int = 0
    inflight: frozenset[int] = frozenset()
    failure: str = ""
    cancelled: bool = False


class PinJob(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A parent job holding pinned blocks; released exactly once.

    Attributes:
        round_seq: The round whose lookup pinned it; None for a store of a prefill/decode request
            (it supplies any round).
        blocks: Our block index for each key.
        expires_at: When it is released if no fetch uses it.
        readers: Transfers reading its blocks right now.
        serving: Rounds not yet ended that its blocks were written for; a store job settles with
            those rounds, as vLLM settles every job of a round when the round ends.
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


class ProducerState(ActorRecord, frozen=True, kw_only=True, gc=False):
    """Everything a producer actor knows, rebuilt exactly by replaying its events.

    Attributes:
        seq: The sequence number of the last event applied.
        lookups: Lookups not answered yet, by id.
        rounds: Rounds in progress, by round number.
        jobs: Pin jobs held, by job id.
        pool: Stored blocks of a prefill/decode request not sent yet, by key.
        transfers: Transfers in flight, by id: each as its start recorded it.
        open_contexts: Lookups whose synthetic parent request is open.
        closed_through: The highest round closed by a fetch (-1: none).
        looked_up_through: The highest round that had a lookup (-1: none).
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
    transfers: Mapping[int, ev.TransferStarted] = msgspec.field(default_factory=dict)
    open_contexts: frozenset[int] = frozenset()
    closed_through: int = -1
    looked_up_through: int = -1
    finishing: bool = False
    session_lost: bool = False
    close_reason: str = ""

    @property
    def idle(self) -> bool:
        """Whether the request holds nothing: no lookup, round, pin or transfer."""
        return not (
            self.lookups or self.rounds or self.jobs or self.transfers or self.open_contexts
        )


# The builder every producer decision emits its events through.
_B = Builder[ProducerState, ev.ProducerEvent]


K = TypeVar("K")
V = TypeVar("V")


def _put(mapping: Mapping[K, V], key: K, value: V) -> dict[K, V]:
    return {**mapping, key: value}


def _drop(mapping: Mapping[K, V], key: K) -> dict[K, V]:
    out = dict(mapping)
    out.pop(key, None)
    return out


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


def _release_round_jobs(
    b: _B, round_seq: int, reason: str, *, served: bool = False, idle_only: bool = False
) -> None:
    for job_id, job in sorted(b.state.jobs.items()):
        if job.round_seq == round_seq and not (idle_only and job.readers):
            _release(b, job_id, reason, served=served)


def _expirable(s: ProducerState, job: PinJob) -> bool:
    """A pin no fetch is using or about to use: it may time out."""
    if job.readers or job.serving:
        return False
    rnd = None if job.round_seq is None else s.rounds.get(job.round_seq)
    return rnd is None or not rnd.fetched


def _expire_pins(b: _B, t: Timings) -> None:
    for job_id, job in sorted(b.state.jobs.items()):
        if b.now >= job.expires_at and _expirable(b.state, job):
            _release(b, job_id, f"{PIN_EXPIRED} {t.pin_timeout:g} s")


def _release_stores(b: _B) -> None:
    """Release each store job once its rounds settled it or the request ended."""
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
            _release(b, job_id, "all blocks served", served=True)
        elif s.phase is not ProducerPhase.OPEN:
            _release(b, job_id, s.close_reason)
        elif served_out:
            _release(b, job_id, "the engine finished and no fetch is waiting for these blocks")
