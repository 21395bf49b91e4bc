"""The consumer's events: what happens to a request we send to a peer.

Re-exported by :mod:`p2pactor.core.events`; import them from there.
"""

from __future__ import annotations

import attrs

from p2pactor.core.events_base import ConsumerPhase, Event, Ints, Keys
from p2pactor.core.protocol import bool_tuple, bytes_tuple, int_tuple

__all__ = [
    "AbortAcked",
    "AbortSent",
    "Aborted",
    "FetchSent",
    "FetchSkipped",
    "Finished",
    "LookupCancelled",
    "LookupResp",
    "LookupTimedOut",
    "Opened",
    "Probed",
    "Registered",
    "TransferDone",
]


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
