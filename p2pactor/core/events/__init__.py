"""The event vocabulary: immutable facts about one request actor, in the past tense.

Every event carries the actor it belongs to, its sequence number within that
actor (1, 2, 3...) and the monotonic time at which it happened, supplied by the
caller. Events are small, frozen and serialisable (see :mod:`p2pactor.core.serde`);
replaying an actor's events through ``evolve`` rebuilds exactly the state the
live actor had.

Events that imply an action (a message to send, a pin to release) carry all the
data the action needs, so :func:`p2pactor.core.effects.effects_of` can derive the
action from the event alone.

Here: what both roles' events build on (:class:`Event`, the :data:`EVENT_TYPES`
registry every subclass joins as it is defined, the enums their fields name, the
private bases that give the events about one round, load, lookup or write their
first field), the events either role may record and the quota refusals; each
role's own events are in :mod:`~p2pactor.core.events.consumer` and
:mod:`~p2pactor.core.events.producer`, and are imported from here.
"""

# ruff: noqa: E402, F403, F405
from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from p2pactor.core.ids import ActorId, IdentityEnum

Keys = tuple[bytes, ...]
Ints = tuple[int, ...]


class _Phase(IdentityEnum):
    """Where a request of either role is in its life. Phases only move forward."""

    @property
    def terminal(self) -> bool:
        """Whether the request has ended."""
        return self in _TERMINAL_PHASES


class ConsumerPhase(_Phase):
    """Where a consumer request is in its life. Phases only move forward.

    Attributes:
        REGISTERED: Keys registered, nothing on the wire yet.
        PROBING: A lookup went out.
        FETCH_SENT: A fetch (or the terminal empty fetch) went out.
        DONE: Finished; every load it made completed.
        FAILED: Finished; a load failed, the lookup timed out or the session died.
        ABORTED: Finished; a load had to be aborted.
    """

    REGISTERED = "registered"
    PROBING = "probing"
    FETCH_SENT = "fetch_sent"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


class ProducerPhase(_Phase):
    """Where a producer request is in its life. Phases only move forward.

    Attributes:
        OPEN: Serving lookups and fetches.
        CLOSING: Closed by the peer or by the session's end; draining what is in flight.
        CLOSED: Holds nothing any more. Terminal.
    """

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


# A phase of either role.
Phase = ConsumerPhase | ProducerPhase

_TERMINAL_PHASES = frozenset(
    {ConsumerPhase.DONE, ConsumerPhase.FAILED, ConsumerPhase.ABORTED, ProducerPhase.CLOSED}
)


class Violation(IdentityEnum):
    """Ways a peer can break the protocol inside one request.

    Attributes:
        DUPLICATE_FETCH: A second fetch for a round that already had one.
        STALE_ROUND: A lookup or fetch for a round older than one already closed.
        UNKNOWN_ROUND: An abort for a round that was never fetched.
        AFTER_CLOSE: A lookup or fetch after the consumer closed the request.
        MALFORMED: Parallel lists of different lengths (read from older logs:
            the codec rejects these, so the core never sees one).
    """

    DUPLICATE_FETCH = "duplicate_fetch"
    STALE_ROUND = "stale_round"
    UNKNOWN_ROUND = "unknown_round"
    AFTER_CLOSE = "after_close"
    MALFORMED = "malformed"


class Quota(IdentityEnum):
    """The per-peer quotas a node enforces on what a peer may make it hold.

    See :class:`p2pactor.runtime.quotas.PeerQuotas` for the limits and their defaults.

    Attributes:
        PINNED_BLOCKS: Blocks pinned for the peer's lookups and not yet released.
        OPEN_LOOKUPS: Lookups received from the peer and not yet answered.
        KEYS_PER_LOOKUP: Keys in one lookup.
        FETCH_ROUNDS: Fetch rounds of the peer in flight (fetched, not yet ended).
        OPEN_REQUESTS: Requests of the peer we serve at once (live producer actors).
        ROUNDS_PER_REQUEST: Rounds one request of the peer holds (looked up or
            fetched, not ended).
    """

    PINNED_BLOCKS = "pinned_blocks"
    OPEN_LOOKUPS = "open_lookups"
    KEYS_PER_LOOKUP = "keys_per_lookup"
    FETCH_ROUNDS = "fetch_rounds"
    OPEN_REQUESTS = "open_requests"
    ROUNDS_PER_REQUEST = "rounds_per_request"


# Every concrete event type by its ``KIND`` (each subclass adds itself): the registry used to read
# logs.
EVENT_TYPES: dict[str, type[Event]] = {}


def _tag(name: str) -> str:
    # msgspec asks for a class's tag once the class exists, so it is registered
    # by then (the base Event itself is not: it is never written).
    cls = EVENT_TYPES.get(name)
    return name if cls is None else cls.TAG


class Event(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="kind", tag=_tag):
    """Base of every event: a frozen record (a :class:`msgspec.Struct`).

    Subclasses say ``frozen=True, kw_only=True`` again (msgspec applies
    ``kw_only`` per class, to the fields each defines, and mypy wants both);
    ``gc=False`` is inherited: an event holds no references back to anything,
    so the collector need not track it. Encoded, an event is a map with
    ``"kind"`` (its :attr:`TAG`) first, then its fields: a tagged union, so one
    decoder reads any kind (:mod:`p2pactor.core.serde`).

    Attributes:
        KIND: The type's name, as logs spell it: set on each subclass from its name.
        VERSION: The schema version of the type's fields, as written.
        READS_SINCE: The oldest version still read: fields added since have
            defaults, which its records take. A reader refuses any other version.
        TAG: ``KIND@VERSION``: how a record names its type and its version.
        actor: The actor this event belongs to.
        seq: Position in the actor's stream, starting at 1.
        at: Monotonic time (seconds) at which it happened.
    """

    KIND: ClassVar[str]
    VERSION: ClassVar[int] = 1
    READS_SINCE: ClassVar[int] = 1
    TAG: ClassVar[str]

    actor: ActorId
    seq: int
    at: float

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__name__
        if kind.startswith("_"):
            return  # a base that gives its events their first fields: never written
        if kind in EVENT_TYPES:
            raise TypeError(f"two event types are named {kind}")
        cls.KIND = kind
        cls.TAG = f"{kind}@{cls.VERSION}"
        EVENT_TYPES[kind] = cls


# --- the first fields of events about one round, load, lookup or transfer ----------
# Each event's fields are written in order, its base's first: these say them once.


class _OfRound(Event, frozen=True, kw_only=True):
    """An event about one round of a request: ``round_seq`` comes first."""

    round_seq: int


class _OfLoad(_OfRound, frozen=True, kw_only=True):
    """An event about one of a consumer's loads: its round, then the engine's load job."""

    job_id: int


class _OfLookup(Event, frozen=True, kw_only=True):
    """An event about one of a producer's lookups: ``lookup_id`` comes first."""

    lookup_id: int


class _OfTransfer(Event, frozen=True, kw_only=True):
    """An event about one of a producer's writes: ``transfer_id`` comes first."""

    transfer_id: int


# --- shared by both roles ---------------------------------------------------------


class Ignored(Event, frozen=True, kw_only=True):
    """An input changed nothing, typically a late or duplicate message.

    Attributes:
        input: What arrived (a message type or input name).
        reason: Why it changed nothing.
    """

    input: str
    reason: str


class Rejected(Event, frozen=True, kw_only=True):
    """The peer broke the protocol; the session must disconnect.

    Attributes:
        input: The offending message type.
        violation: Which rule it broke.
        detail: The specifics, for the log.
    """

    input: str
    violation: Violation
    detail: str


class SessionLost(Event, frozen=True, kw_only=True):
    """The control session to the peer ended; nothing more will be sent to it.

    Attributes:
        reason: Why the session ended.
        loads_held_until: Consumer only: when the loads still in flight fail.
            Until then their blocks stay the load's, not the engine's: the
            peer's write into them may still be on the wire (a link that
            comes back resumes it). None: they failed with the session.
    """

    VERSION: ClassVar[int] = 2  # 2 added loads_held_until

    reason: str
    loads_held_until: float | None = None


class FinishRequested(Event, frozen=True, kw_only=True):
    """The engine finished the request.

    For a consumer, the request is over; for a prefill/decode producer, the
    engine will store no more blocks for it.
    """


# --- refusals: the peer is over a quota ----------------------------------------


class LookupRefused(_OfRound, frozen=True, kw_only=True):
    """A whole lookup was refused because the peer is over a quota.

    It is answered at once, every key MISS; the parent is not asked and nothing
    is pinned. Its round counts as looked up, so a fetch for it fails fast.

    Attributes:
        round_seq: The round it belongs to.
        keys: Its keys in wire order, duplicates included (the answer's keys).
        quota: Which quota the peer is over.
        reason: The specifics, with the numbers, for the log.
    """

    keys: Keys
    quota: Quota
    reason: str


class LookupLimited(_OfLookup, frozen=True, kw_only=True):
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

    round_seq: int
    keys: Keys
    admitted: int
    deadline: float
    reason: str


class KeysRefused(_OfLookup, frozen=True, kw_only=True):
    """Hits of a lookup were not pinned because the peer is over a quota.

    The keys are answered MISS (the :class:`KeysResolved` that follows lists
    them as misses).

    Attributes:
        lookup_id: Which lookup.
        keys: The hits refused.
        quota: Which quota the peer is over.
        reason: The specifics, with the numbers, for the log.
    """

    keys: Keys
    quota: Quota
    reason: str


class FetchRefused(_OfRound, frozen=True, kw_only=True):
    """A fetch was refused because the peer is over a quota; its round fails.

    Follows the fetch's :class:`FetchReceived`. The round then ends with a
    failed ``transfer_done`` and every pin of the round is released; nothing
    is written.

    Attributes:
        round_seq: The round.
        quota: Which quota the peer is over.
        reason: The specifics, with the numbers, for the log.
    """

    quota: Quota
    reason: str


# Each role's events, defined on this base; the vocabulary is all they define.
from p2pactor.core.events.consumer import *
from p2pactor.core.events.producer import *

# Events either role may record.
_EitherRole = Ignored | Rejected | SessionLost | FinishRequested

# Events of a consumer actor.
ConsumerEvent = (
    _EitherRole
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

# Events of a producer actor.
ProducerEvent = (
    _EitherRole
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
    | PinsRenewed
    | PinReleased
    | CloseRequested
    | Closed
)

# Every concrete event type.
AnyEvent = ConsumerEvent | ProducerEvent
