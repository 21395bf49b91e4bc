"""The base of the event vocabulary: :class:`Event`, its registry and the shared bits.

Holds what both roles' events build on: the enums their fields name, the
:data:`EVENT_TYPES` registry every subclass joins as it is defined,
:func:`check_follows`, and the events either role may record. Import the whole
vocabulary from :mod:`p2pactor.core.events`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

import msgspec

from p2pactor.core.ids import ActorId, IdentityEnum
from p2pactor.errors import ReplayError

__all__ = [
    "EVENT_TYPES",
    "ConsumerPhase",
    "Event",
    "FinishRequested",
    "Ignored",
    "Ints",
    "Keys",
    "Quota",
    "Rejected",
    "SessionLost",
    "Violation",
    "check_follows",
    "filed_under",
]

Keys = tuple[bytes, ...]
Ints = tuple[int, ...]


class ConsumerPhase(IdentityEnum):
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


class Violation(IdentityEnum):
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


class Quota(IdentityEnum):
    """The per-peer quotas a node enforces on what a peer may make it hold.

    See :class:`p2pactor.runtime.quotas.PeerQuotas` for the limits and their defaults.
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
        actor: The actor this event belongs to.
        seq: Position in the actor's stream, starting at 1.
        at: Monotonic time (seconds) at which it happened.
    """

    KIND: ClassVar[str]
    """The type's name, as logs spell it: set on each subclass from its name."""
    VERSION: ClassVar[int] = 1
    """The schema version of the type's fields, as written."""
    READS_SINCE: ClassVar[int] = 1
    """The oldest version still read: fields added since have defaults, which
    its records take. A reader refuses any other version."""
    TAG: ClassVar[str]
    """``KIND@VERSION``: how a record names its type and its version."""

    actor: ActorId
    seq: int
    at: float

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__name__
        if kind in EVENT_TYPES:
            raise TypeError(f"two event types are named {kind}")
        cls.KIND = kind
        cls.TAG = f"{kind}@{cls.VERSION}"
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


_F = TypeVar("_F", bound=Callable[..., Any])


def filed_under(table: dict[type[Event], _F]) -> Callable[..., Callable[[_F], _F]]:
    """A decorator that files a function in ``table`` under event types.

    ``arm = filed_under(TABLE)``, then ``@arm(ev.A, ev.B)`` on the function
    for those events: the table is the dispatch, and each event type is named
    once, beside the code that handles it.
    """

    def arm(*kinds: type[Event]) -> Callable[[_F], _F]:
        def register(fn: _F) -> _F:
            for kind in kinds:
                table[kind] = fn
            return fn

        return register

    return arm
