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

# ruff: noqa: F403, F405
from __future__ import annotations

# The vocabulary is what its modules define: every event type, and the enums its fields name.
from p2pactor.core.events.base import *
from p2pactor.core.events.consumer import *
from p2pactor.core.events.producer import *

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
