"""The event vocabulary: immutable facts about one request actor, in the past tense.

Every event carries the actor it belongs to, its sequence number within that
actor (1, 2, 3...) and the monotonic time at which it happened, supplied by the
caller. Events are small, frozen and serialisable (see :mod:`p2pactor.core.serde`);
replaying an actor's events through ``evolve`` rebuilds exactly the state the
live actor had.

Events that imply an action (a message to send, a pin to release) carry all the
data the action needs, so :func:`p2pactor.core.effects.effects_of` can derive the
action from the event alone.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs

from p2pactor.core.ids import ActorId
from p2pactor.errors import ReplayError
from p2pactor.protocol import bool_tuple, bytes_tuple, int_tuple

__all__ = [
    "EVENT_TYPES",
    "AbortAckSent",
    "AbortAcked",
    "AbortReceived",
    "AbortSent",
    "Aborted",
    "AnyEvent",
    "CloseRequested",
    "Closed",
    "ConsumerEvent",
    "ConsumerPhase",
    "ContextClosed",
    "Event",
    "FetchReceived",
    "FetchRefused",
    "FetchSent",
    "FetchSkipped",
    "FinishRequested",
    "Finished",
    "Ignored",
    "KeysPinned",
    "KeysRefused",
    "KeysResolved",
    "LookupAnswered",
    "LookupCancelled",
    "LookupDropped",
    "LookupLimited",
    "LookupReceived",
    "LookupRefused",
    "LookupResp",
    "LookupTimedOut",
    "Opened",
    "ParentExpired",
    "PendingExpired",
    "PendingPolled",
    "PinReleased",
    "Probed",
    "ProducerEvent",
    "Quota",
    "Registered",
    "Rejected",
    "RoundClosed",
    "SessionLost",
    "StoreAdded",
    "TransferCompleted",
    "TransferDone",
    "TransferDoneSent",
    "TransferFailed",
    "TransferStarted",
    "Violation",
    "check_follows",
]

Keys = tuple[bytes, ...]
Ints = tuple[int, ...]


class ConsumerPhase(enum.Enum):
    """Where a consumer request is in its life. Phases only move forward."""

    REGISTERED = "registered"
    """Keys registered, nothing on the wire yet."""
    PROBING = "probing"
    """A lookup went out."""
    FETCH_SENT = "fetch_sent"
    """A fetch (or the terminal empty fetch) went out."""
    DONE = "done"
    """Finished; every load it made completed."""
    FAILED = "failed"
    """Finished; a load failed, the lookup timed out or the session died."""
    ABORTED = "aborted"
    """Finished; a load had to be aborted."""

    @property
    def terminal(self) -> bool:
        """Whether the request has ended."""
        return self in _TERMINAL_PHASES


_TERMINAL_PHASES = frozenset({ConsumerPhase.DONE, ConsumerPhase.FAILED, ConsumerPhase.ABORTED})


class Violation(enum.Enum):
    """Ways a peer can break the protocol inside one request."""

    DUPLICATE_FETCH = "duplicate_fetch"
    """A second fetch for a round that already had one."""
    STALE_ROUND = "stale_round"
    """A lookup or fetch for a round older than one already closed."""
    UNKNOWN_ROUND = "unknown_round"
    """An abort for a round that was never fetched."""
    AFTER_CLOSE = "after_close"
    """A lookup or fetch after the consumer closed the request."""
    MALFORMED = "malformed"
    """Parallel lists of different lengths (the codec rejects these on the wire)."""


class Quota(enum.Enum):
    """The per-peer quotas a node enforces on what a peer may make it hold.

    See :class:`p2pactor.quotas.PeerQuotas` for the limits and their defaults.
    """

    PINNED_BLOCKS = "pinned_blocks"
    """Blocks pinned for the peer's lookups and not yet released."""
    OPEN_LOOKUPS = "open_lookups"
    """Lookups received from the peer and not yet answered."""
    KEYS_PER_LOOKUP = "keys_per_lookup"
    """Keys in one lookup."""
    FETCH_ROUNDS = "fetch_rounds"
    """Fetch rounds of the peer in flight (fetched, not yet ended)."""
    OPEN_REQUESTS = "open_requests"
    """Requests of the peer we serve at once (live producer actors)."""
    ROUNDS_PER_REQUEST = "rounds_per_request"
    """Rounds one request of the peer holds (looked up or fetched, not ended)."""


EVENT_TYPES: dict[str, type[Event]] = {}
"""Every concrete event type by its ``KIND``: the registry used to read logs.

Each subclass of :class:`Event` adds itself as it is defined.
"""


@attrs.frozen(kw_only=True)
class Event:
    """Base of every event.

    Attributes:
        actor: The actor this event belongs to.
        seq: Position in the actor's stream, starting at 1.
        at: Monotonic time (seconds) at which it happened.
    """

    KIND: ClassVar[str]
    """The type's name, as logs spell it: set on each subclass from its name."""
    VERSION: ClassVar[int] = 1
    """The schema version of the type's fields; a reader refuses any other."""

    actor: ActorId
    seq: int
    at: float

    @classmethod
    def __attrs_init_subclass__(cls) -> None:
        kind = cls.__name__
        if kind in EVENT_TYPES:
            raise TypeError(f"two event types are named {kind}")
        cls.KIND = kind
        EVENT_TYPES[kind] = cls


def check_follows(actor: ActorId, seq: int, event: Event) -> None:
    """Check that ``event`` is the next event of ``actor``, whose last was ``seq``.

    Raises:
        ReplayError: It belongs to another actor, or skips or repeats a number.
    """
    # Identity first: a live step's events carry its state's own ActorId.
    if event.actor is not actor and event.actor != actor:
        raise ReplayError(f"event of {event.actor} applied to {actor}")
    if event.seq != seq + 1:
        raise ReplayError(f"{actor}: event seq {event.seq} after seq {seq}")


# --- shared by both roles ---------------------------------------------------------


@attrs.frozen(kw_only=True)
class Ignored(Event):
    """An input changed nothing, typically a late or duplicate message.

    Attributes:
        input: What arrived (a message type or input name).
        reason: Why it changed nothing.
    """

    input: str
    reason: str


@attrs.frozen(kw_only=True)
class Rejected(Event):
    """The peer broke the protocol; the session must disconnect.

    Attributes:
        input: The offending message type.
        violation: Which rule it broke.
        detail: The specifics, for the log.
    """

    input: str
    violation: Violation
    detail: str


@attrs.frozen(kw_only=True)
class SessionLost(Event):
    """The control session to the peer ended; nothing more will be sent to it.

    Attributes:
        reason: Why the session ended.
    """

    reason: str


@attrs.frozen(kw_only=True)
class FinishRequested(Event):
    """The engine finished the request.

    For a consumer, the request is over; for a prefill/decode producer, the
    engine will store no more blocks for it.
    """


# --- consumer ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Opened(Event):
    """A consumer request began.

    Attributes:
        round_seq: Its first round (0 in vLLM's dialect).
    """

    round_seq: int


@attrs.frozen(kw_only=True)
class Registered(Event):
    """The engine asked about keys the peer has not been asked about yet.

    Attributes:
        keys: The new keys, in the order the engine asked.
    """

    keys: Keys = attrs.field(converter=bytes_tuple)


@attrs.frozen(kw_only=True)
class Probed(Event):
    """A lookup went out.

    Attributes:
        round_seq: The round it belongs to.
        keys: The keys asked, in wire order.
        lookup_deadline: When the request fails if no key resolves before.
    """

    round_seq: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    lookup_deadline: float


@attrs.frozen(kw_only=True)
class LookupResp(Event):
    """A lookup answer resolved probes.

    Attributes:
        round_seq: The round the peer stamped on the answer (None from a stock
            vLLM peer, which does not send it).
        keys: The probes it resolved (keys the answer named but that were not
            waiting are left out).
        hits: Parallel to ``keys``.
        lookup_deadline: The new progress deadline, None once nothing waits.
    """

    round_seq: int | None
    keys: Keys = attrs.field(converter=bytes_tuple)
    hits: tuple[bool, ...] = attrs.field(converter=bool_tuple)
    lookup_deadline: float | None


@attrs.frozen(kw_only=True)
class LookupTimedOut(Event):
    """No key resolved for the progress timeout; the request's lookups fail.

    Attributes:
        keys: The probes still waiting; they count as TIMEOUT, answered MISS.
    """

    keys: Keys = attrs.field(converter=bytes_tuple)


@attrs.frozen(kw_only=True)
class FetchSent(Event):
    """A fetch went out: a load of ``keys`` into our ``block_indexes``.

    Attributes:
        round_seq: The round the fetch closes.
        job_id: The engine's load job.
        keys: What to load.
        block_indexes: Where to, in our block pool, parallel to ``keys``.
        load_deadline: When the load is aborted if unanswered.
        next_round: The round that lookups and fetches use from now on.
    """

    round_seq: int
    job_id: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    block_indexes: Ints = attrs.field(converter=int_tuple)
    load_deadline: float
    next_round: int


@attrs.frozen(kw_only=True)
class FetchSkipped(Event):
    """A load was settled without asking the peer.

    Attributes:
        job_id: The engine's load job.
        success: True for an empty load, False for a load that can't be made.
        reason: Why.
    """

    job_id: int
    success: bool
    reason: str


@attrs.frozen(kw_only=True)
class LookupCancelled(Event):
    """The terminal empty fetch went out: the peer may drop the request.

    Attributes:
        round_seq: The current round, stamped on the empty fetch.
    """

    round_seq: int


@attrs.frozen(kw_only=True)
class TransferDone(Event):
    """The peer reported a load finished.

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job.
        success: Whether every block arrived.
    """

    round_seq: int
    job_id: int
    success: bool


@attrs.frozen(kw_only=True)
class AbortSent(Event):
    """We asked the peer to abort a load.

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job.
        reason: Why (timed out, or the request finished first).
        ack_deadline: When the load fails even without the peer's ack.
    """

    round_seq: int
    job_id: int
    reason: str
    ack_deadline: float


@attrs.frozen(kw_only=True)
class AbortAcked(Event):
    """The peer confirmed no write into the load's blocks can still run.

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job, now failed.
    """

    round_seq: int
    job_id: int


@attrs.frozen(kw_only=True)
class Aborted(Event):
    """A load failed without the peer's word (no ack in time, session lost).

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job, now failed.
        reason: Why.
    """

    round_seq: int
    job_id: int
    reason: str


@attrs.frozen(kw_only=True)
class Finished(Event):
    """The consumer request ended. Terminal.

    Attributes:
        phase: DONE, FAILED or ABORTED.
        reason: A summary for people.
    """

    phase: ConsumerPhase
    reason: str


# --- producer ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class LookupReceived(Event):
    """A peer asked which of ``keys`` we hold.

    Attributes:
        lookup_id: Our number for this lookup, unique within the actor.
        round_seq: The round it belongs to.
        keys: The keys in wire order, duplicates included.
        deadline: When keys still pending are answered MISS.
    """

    lookup_id: int
    round_seq: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    deadline: float


@attrs.frozen(kw_only=True)
class KeysResolved(Event):
    """The parent answered about some of a lookup's keys.

    Opens the lookup's synthetic parent request if it was not open yet.

    Attributes:
        lookup_id: Which lookup.
        hits: Keys found and pinned.
        misses: Keys not found.
        pending: Keys HIT_PENDING or RETRY: ask again later.
        next_poll_at: When to ask again about ``pending``.
    """

    lookup_id: int
    hits: Keys = attrs.field(converter=bytes_tuple)
    misses: Keys = attrs.field(converter=bytes_tuple)
    pending: Keys = attrs.field(converter=bytes_tuple)
    next_poll_at: float | None


@attrs.frozen(kw_only=True)
class KeysPinned(Event):
    """The parent pinned blocks for a lookup's hits, as one job.

    Attributes:
        lookup_id: The lookup whose hits these are.
        round_seq: The round they supply.
        job_id: The parent's job; releasing it unpins the blocks.
        keys: The pinned keys.
        blocks: Our block index for each key.
        expires_at: When the pin is released if no fetch uses it.
    """

    lookup_id: int
    round_seq: int
    job_id: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    blocks: Ints = attrs.field(converter=int_tuple)
    expires_at: float


@attrs.frozen(kw_only=True)
class PendingPolled(Event):
    """We asked the parent again about a lookup's pending keys.

    Attributes:
        lookup_id: Which lookup.
        keys: The keys still pending.
        not_after: The parent must not look them up past this time.
    """

    lookup_id: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    not_after: float


@attrs.frozen(kw_only=True)
class ParentExpired(Event):
    """A re-poll reached the parent only after its ``not_after``: nothing was asked.

    Attributes:
        lookup_id: Which lookup.
    """

    lookup_id: int


@attrs.frozen(kw_only=True)
class PendingExpired(Event):
    """Pending keys ran out of time; they count as TIMEOUT and answer MISS.

    Attributes:
        lookup_id: Which lookup.
        keys: The keys that timed out.
    """

    lookup_id: int
    keys: Keys = attrs.field(converter=bytes_tuple)


@attrs.frozen(kw_only=True)
class LookupAnswered(Event):
    """The one answer to a lookup went out.

    Attributes:
        lookup_id: Which lookup.
        round_seq: Its round (sent to p2pactor peers only).
        keys: The lookup's keys in wire order, duplicates included.
        hits: Parallel to ``keys``.
    """

    lookup_id: int
    round_seq: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    hits: tuple[bool, ...] = attrs.field(converter=bool_tuple)


@attrs.frozen(kw_only=True)
class LookupDropped(Event):
    """A lookup will not be answered: the request closed first.

    Attributes:
        lookup_id: Which lookup.
        reason: Why.
    """

    lookup_id: int
    reason: str


@attrs.frozen(kw_only=True)
class ContextClosed(Event):
    """A lookup's synthetic parent request is owed its close.

    Attributes:
        lookup_id: Which lookup.
    """

    lookup_id: int


@attrs.frozen(kw_only=True)
class LookupRefused(Event):
    """A whole lookup was refused because the peer is over a quota.

    It is answered at once, every key MISS; the parent is not asked and nothing
    is pinned. Its round counts as looked up, so a fetch for it fails fast.

    Attributes:
        round_seq: The round it belongs to.
        keys: Its keys in wire order, duplicates included (the answer's keys).
        quota: Which quota the peer is over.
        reason: The specifics, with the numbers, for the log.
    """

    round_seq: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    quota: Quota
    reason: str


@attrs.frozen(kw_only=True)
class LookupLimited(Event):
    """A lookup had more keys than the peer's quota allows: only a prefix is looked up.

    Like :class:`LookupReceived`, but only the first ``admitted`` keys (in wire
    order) go to the parent; the others are answered MISS and never pinned.
    The one answer still lists every key.

    Attributes:
        lookup_id: Our number for this lookup, unique within the actor.
        round_seq: The round it belongs to.
        keys: All its keys in wire order, duplicates included.
        admitted: How many keys, from the first, are looked up.
        deadline: When admitted keys still pending are answered MISS.
        reason: The specifics, with the numbers, for the log.
    """

    lookup_id: int
    round_seq: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    admitted: int
    deadline: float
    reason: str


@attrs.frozen(kw_only=True)
class KeysRefused(Event):
    """Hits of a lookup were not pinned because the peer is over a quota.

    The keys are answered MISS (the :class:`KeysResolved` that follows lists
    them as misses).

    Attributes:
        lookup_id: Which lookup.
        keys: The hits refused.
        quota: Which quota the peer is over.
        reason: The specifics, with the numbers, for the log.
    """

    lookup_id: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    quota: Quota
    reason: str


@attrs.frozen(kw_only=True)
class FetchRefused(Event):
    """A fetch was refused because the peer is over a quota; its round fails.

    Follows the fetch's :class:`FetchReceived`. The round then ends with a
    failed ``transfer_done`` and every pin of the round is released; nothing
    is written.

    Attributes:
        round_seq: The round.
        quota: Which quota the peer is over.
        reason: The specifics, with the numbers, for the log.
    """

    round_seq: int
    quota: Quota
    reason: str


@attrs.frozen(kw_only=True)
class StoreAdded(Event):
    """The engine stored blocks for a prefill/decode request (already pinned).

    Attributes:
        job_id: The engine's store job; releasing it unpins the blocks.
        keys: The stored keys.
        blocks: Our block index for each key.
        expires_at: When the pin is released if no fetch uses it.
    """

    job_id: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    blocks: Ints = attrs.field(converter=int_tuple)
    expires_at: float


@attrs.frozen(kw_only=True)
class FetchReceived(Event):
    """The peer asked us to write ``keys`` into its ``block_indexes``.

    Attributes:
        round_seq: The round it closes.
        keys: What to send.
        block_indexes: Where to, in the peer's pool, parallel to ``keys``.
    """

    round_seq: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    block_indexes: Ints = attrs.field(converter=int_tuple)


@attrs.frozen(kw_only=True)
class TransferStarted(Event):
    """One WRITE of matched blocks into the peer's pool was started.

    Attributes:
        transfer_id: Our number for it, unique within the actor.
        round_seq: The round it serves.
        keys: The keys written.
        local_blocks: Our source blocks, parallel to ``keys``.
        remote_blocks: The peer's destination blocks, parallel to ``keys``.
        job_ids: The pin job holding each source block, parallel to ``keys``.
    """

    transfer_id: int
    round_seq: int
    keys: Keys = attrs.field(converter=bytes_tuple)
    local_blocks: Ints = attrs.field(converter=int_tuple)
    remote_blocks: Ints = attrs.field(converter=int_tuple)
    job_ids: Ints = attrs.field(converter=int_tuple)


@attrs.frozen(kw_only=True)
class TransferCompleted(Event):
    """A WRITE finished; every byte is in the peer's blocks.

    Attributes:
        transfer_id: Which transfer.
    """

    transfer_id: int


@attrs.frozen(kw_only=True)
class TransferFailed(Event):
    """A WRITE failed, and no part of it is still running.

    Attributes:
        transfer_id: Which transfer.
        reason: Why.
    """

    transfer_id: int
    reason: str


@attrs.frozen(kw_only=True)
class TransferDoneSent(Event):
    """A round ended and the peer was told how.

    Attributes:
        round_seq: The round.
        success: Whether every demanded block was written.
        reason: Why it failed, or "" on success.
    """

    round_seq: int
    success: bool
    reason: str


@attrs.frozen(kw_only=True)
class AbortReceived(Event):
    """The peer asked us to abort a round.

    Attributes:
        round_seq: The round.
    """

    round_seq: int


@attrs.frozen(kw_only=True)
class AbortAckSent(Event):
    """We confirmed an abort: no write into the peer for that round can run.

    Attributes:
        round_seq: The round.
    """

    round_seq: int


@attrs.frozen(kw_only=True)
class RoundClosed(Event):
    """A round ended with nothing to tell the peer.

    Attributes:
        round_seq: The round.
        reason: Why.
    """

    round_seq: int
    reason: str


@attrs.frozen(kw_only=True)
class PinReleased(Event):
    """A pin job was released; its blocks may be evicted again.

    Attributes:
        job_id: The parent's job.
        success: Whether its blocks served what they were pinned for.
        reason: Why it was released.
    """

    job_id: int
    success: bool
    reason: str


@attrs.frozen(kw_only=True)
class CloseRequested(Event):
    """The peer closed the whole request (the terminal empty fetch).

    Attributes:
        round_seq: The round stamped on the empty fetch.
        reason: Why, in words.
    """

    round_seq: int
    reason: str


@attrs.frozen(kw_only=True)
class Closed(Event):
    """The producer request holds nothing any more. Terminal.

    Attributes:
        reason: A summary for people.
    """

    reason: str


ConsumerEvent = (
    # either role
    Ignored
    | Rejected
    | SessionLost
    | FinishRequested
    # this role
    | Opened
    | Registered
    | Probed
    | LookupResp
    | LookupTimedOut
    | FetchSent
    | FetchSkipped
    | LookupCancelled
    | TransferDone
    | AbortSent
    | AbortAcked
    | Aborted
    | Finished
)
"""Events of a consumer actor."""

ProducerEvent = (
    # either role
    Ignored
    | Rejected
    | SessionLost
    | FinishRequested
    # this role
    | LookupReceived
    | LookupRefused
    | LookupLimited
    | KeysResolved
    | KeysPinned
    | KeysRefused
    | PendingPolled
    | ParentExpired
    | PendingExpired
    | LookupAnswered
    | LookupDropped
    | ContextClosed
    | StoreAdded
    | FetchReceived
    | FetchRefused
    | TransferStarted
    | TransferCompleted
    | TransferFailed
    | TransferDoneSent
    | AbortReceived
    | AbortAckSent
    | RoundClosed
    | PinReleased
    | CloseRequested
    | Closed
)
"""Events of a producer actor."""

AnyEvent = ConsumerEvent | ProducerEvent
"""Every concrete event type."""
