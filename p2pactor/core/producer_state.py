"""What a producer request knows: its state records, rebuilt by replaying its events."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

from p2pactor.core import events as ev
from p2pactor.core.builder import Builder
from p2pactor.core.ids import ActorId, IdentityEnum, Role


class ProducerPhase(IdentityEnum):
    """Where a producer request is in its life. Phases only move forward."""

    OPEN = "open"
    """Serving lookups and fetches."""
    CLOSING = "closing"
    """Closed by the peer or by the session's end; draining what is in flight."""
    CLOSED = "closed"
    """Holds nothing any more. Terminal."""


PRODUCER_PHASE_AT: Final[Mapping[type[ev.Event], ProducerPhase]] = {
    ev.SessionLost: ProducerPhase.CLOSING,
    ev.CloseRequested: ProducerPhase.CLOSING,
    ev.Closed: ProducerPhase.CLOSED,
}
"""The phase each event moves a producer to; any other event leaves it as it is."""


class Supply(msgspec.Struct, frozen=True, gc=False):
    """A pinned block ready to be sent: which job pins it, and where it is."""

    job_id: int
    block: int


class ActiveLookup(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A lookup not answered yet."""

    lookup_id: int
    """Our number for it."""
    round_seq: int
    keys: tuple[bytes, ...]
    """In wire order, duplicates included."""
    admitted: int
    """How many of ``keys``, from the first, are looked up; the others are over
    the peer's keys-per-lookup quota and answer MISS (a refusal), even one that
    repeats an admitted key. No state is kept per key past them, so that a
    lookup's cost follows what the quota admits, not what the peer sent."""
    deadline: float
    """When pending keys are answered MISS."""
    resolved: Mapping[bytes, bool] = msgspec.field(default_factory=dict)
    """Answers so far."""
    pending: frozenset[bytes] = frozenset()
    """Keys without an answer yet."""
    outstanding: bool = True
    """A parent request for it is posted and not answered."""
    next_poll_at: float | None = None
    """When to ask the parent again about ``pending``."""
    answered: bool = False
    """The answer went out at the deadline while the parent still had not served
    a request for it; its late answer is only cleaned up."""
    dropped: bool = False
    """The request closed; no answer will be sent."""
    refused: frozenset[bytes] = frozenset()
    """Admitted keys answered MISS because the peer is over its pinned-blocks quota
    (not because we lack them)."""


class RoundState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One lookup -> fetch round of the request."""

    round_seq: int
    lookup_supplied: bool = False
    """Lookups pinned supply for it (a symmetric round: keys that were not
    pinned fail the fetch at once)."""
    supply: Mapping[bytes, Supply] = msgspec.field(default_factory=dict)
    """Blocks its lookups pinned, by key."""
    fetched: bool = False
    demand: tuple[tuple[bytes, int], ...] = ()
    """``(key, peer block)`` pairs of the fetch not matched yet."""
    remaining: int = 0
    """Blocks of the fetch not yet written."""
    inflight: frozenset[int] = frozenset()
    """Transfers of this round still running."""
    failure: str = ""
    """Why the round failed ("" while it has not)."""
    cancelled: bool = False
    """The peer aborted it."""


class PinJob(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A parent job holding pinned blocks; released exactly once."""

    job_id: int
    round_seq: int | None
    """The round whose lookup pinned it; None for a store of a prefill/decode
    request (it supplies any round)."""
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]
    """Our block index for each key."""
    expires_at: float
    """When it is released if no fetch uses it."""
    readers: frozenset[int] = frozenset()
    """Transfers reading its blocks right now."""
    serving: frozenset[int] = frozenset()
    """Rounds not yet ended that its blocks were written for; a store job
    settles with those rounds, as vLLM settles every job of a round when the
    round ends."""
    failed: bool = False
    """A round it served failed or was aborted."""


class Transfer(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A WRITE in flight."""

    transfer_id: int
    round_seq: int
    job_ids: frozenset[int]
    """The jobs whose blocks it reads."""
    blocks: int
    """How many blocks it writes."""


class ProducerState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Everything a producer actor knows, rebuilt exactly by replaying its events."""

    actor: ActorId
    seq: int = 0
    """The sequence number of the last event applied."""
    phase: ProducerPhase = ProducerPhase.OPEN
    next_lookup_id: int = 0
    next_transfer_id: int = 0
    lookups: Mapping[int, ActiveLookup] = msgspec.field(default_factory=dict)
    """Lookups not answered yet, by id."""
    rounds: Mapping[int, RoundState] = msgspec.field(default_factory=dict)
    """Rounds in progress, by round number."""
    jobs: Mapping[int, PinJob] = msgspec.field(default_factory=dict)
    """Pin jobs held, by job id."""
    pool: Mapping[bytes, tuple[Supply, ...]] = msgspec.field(default_factory=dict)
    """Stored blocks of a prefill/decode request not sent yet, by key."""
    transfers: Mapping[int, Transfer] = msgspec.field(default_factory=dict)
    """Transfers in flight, by id."""
    open_contexts: frozenset[int] = frozenset()
    """Lookups whose synthetic parent request is open."""
    closed_through: int = -1
    """The highest round closed by a fetch (-1: none)."""
    looked_up_through: int = -1
    """The highest round that had a lookup (-1: none)."""
    finishing: bool = False
    """The engine will store no more blocks for the request."""
    session_lost: bool = False
    """The session ended; nothing can be sent."""
    close_reason: str = ""
    """Why the request is closing."""

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


_B = Builder[ProducerState, ev.ProducerEvent]
"""The builder every producer decision emits its events through."""
