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

from p2pactor.core.events.base import (
    EVENT_TYPES as EVENT_TYPES,
    ConsumerPhase as ConsumerPhase,
    Event as Event,
    FetchRefused as FetchRefused,
    FinishRequested as FinishRequested,
    Ignored as Ignored,
    KeysRefused as KeysRefused,
    LookupLimited as LookupLimited,
    LookupRefused as LookupRefused,
    Quota as Quota,
    Rejected as Rejected,
    SessionLost as SessionLost,
    Violation as Violation,
)
from p2pactor.core.events.consumer import (
    AbortAcked as AbortAcked,
    Aborted as Aborted,
    AbortSent as AbortSent,
    FetchSent as FetchSent,
    FetchSkipped as FetchSkipped,
    Finished as Finished,
    LookupCancelled as LookupCancelled,
    LookupResp as LookupResp,
    LookupTimedOut as LookupTimedOut,
    Opened as Opened,
    Probed as Probed,
    Registered as Registered,
    TransferDone as TransferDone,
)
from p2pactor.core.events.producer import (
    AbortAckSent as AbortAckSent,
    AbortReceived as AbortReceived,
    Closed as Closed,
    CloseRequested as CloseRequested,
    ContextClosed as ContextClosed,
    FetchReceived as FetchReceived,
    KeysPinned as KeysPinned,
    KeysResolved as KeysResolved,
    LookupAnswered as LookupAnswered,
    LookupDropped as LookupDropped,
    LookupReceived as LookupReceived,
    ParentExpired as ParentExpired,
    PendingExpired as PendingExpired,
    PendingPolled as PendingPolled,
    Pinned as Pinned,
    PinReleased as PinReleased,
    RoundClosed as RoundClosed,
    StoreAdded as StoreAdded,
    TransferCompleted as TransferCompleted,
    TransferDoneSent as TransferDoneSent,
    TransferFailed as TransferFailed,
    TransferStarted as TransferStarted,
)

# Events of a consumer actor.
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

# Events of a producer actor.
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

# Every concrete event type.
AnyEvent = ConsumerEvent | ProducerEvent
