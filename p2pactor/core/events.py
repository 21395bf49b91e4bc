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

from p2pactor.core.events_base import (
    EVENT_TYPES,
    ConsumerPhase,
    Event,
    FinishRequested,
    Ignored,
    Quota,
    Rejected,
    SessionLost,
    Violation,
    check_follows,
)
from p2pactor.core.events_consumer import (
    AbortAcked,
    Aborted,
    AbortSent,
    FetchSent,
    FetchSkipped,
    Finished,
    LookupCancelled,
    LookupResp,
    LookupTimedOut,
    Opened,
    Probed,
    Registered,
    TransferDone,
)
from p2pactor.core.events_producer import (
    AbortAckSent,
    AbortReceived,
    Closed,
    CloseRequested,
    ContextClosed,
    FetchReceived,
    FetchRefused,
    KeysPinned,
    KeysRefused,
    KeysResolved,
    LookupAnswered,
    LookupDropped,
    LookupLimited,
    LookupReceived,
    LookupRefused,
    ParentExpired,
    PendingExpired,
    PendingPolled,
    Pinned,
    PinReleased,
    RoundClosed,
    StoreAdded,
    TransferCompleted,
    TransferDoneSent,
    TransferFailed,
    TransferStarted,
)

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
    "Pinned",
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
