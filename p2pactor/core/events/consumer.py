"""The consumer's events: what happens to a request we send to a peer.

Re-exported by :mod:`p2pactor.core.events`; import them from there.
"""

from __future__ import annotations

from typing import ClassVar

from p2pactor.core.choice import Choice
from p2pactor.core.events import ConsumerPhase, Event, Ints, Keys, _OfLoad, _OfRound


class Opened(_OfRound, frozen=True, kw_only=True):
    """A consumer request began (read from older logs; no longer written).

    Since :class:`Probed` 2 the request's first lookup or fetch carries its
    first round, and nothing records the start alone.

    Attributes:
        round_seq: Its first round (0 in vLLM's dialect).
    """


class Registered(Event, frozen=True, kw_only=True):
    """The engine asked about keys the peer has not been asked about yet.

    Attributes:
        keys: The new keys, in the order the engine asked.
    """

    keys: Keys


class Probed(_OfRound, frozen=True, kw_only=True, omit_defaults=True):
    """A lookup went out; the keys it asks are registered with it.

    Version 2: the keys need no :class:`Registered` before (an engine's
    lookup registers and sends in one step), and the first lookup (or fetch)
    sets the request's round, with no :class:`Opened` before. Version 1
    records, which follow those events, fold the same way.

    Attributes:
        round_seq: The round it belongs to.
        keys: The keys asked, in wire order.
        lookup_deadline: When the request fails if no key resolves before.
        source: Why this peer was asked, when the request named no source
            and the node chose it (which peers claimed how much of it); None
            (and absent from the record) for a named source.
    """

    VERSION: ClassVar[int] = 2  # 2: registers its keys, sets the first round

    keys: Keys
    lookup_deadline: float
    source: Choice | None = None


class LookupResp(Event, frozen=True, kw_only=True, omit_defaults=True):
    """A lookup answer resolved probes.

    Attributes:
        round_seq: The round the peer stamped on the answer (None from a stock
            vLLM peer, which does not send it).
        keys: The probes it resolved (keys the answer named but that were not
            waiting are left out).
        hits: Parallel to ``keys``.
        lookup_deadline: The new progress deadline, None once nothing waits.
        refused: Parallel to ``keys`` (empty: none): True where the MISS was a
            quota's refusal (a p2pactor peer says so; a stock one never does).
            Written only when set: records with no refusal are what they were.
    """

    round_seq: int | None
    keys: Keys
    hits: tuple[bool, ...]
    lookup_deadline: float | None
    refused: tuple[bool, ...] = ()


class LookupTimedOut(Event, frozen=True, kw_only=True):
    """No key resolved for the progress timeout; the request's lookups fail.

    Attributes:
        keys: The probes still waiting; they count as TIMEOUT, answered MISS.
    """

    keys: Keys


class FetchSent(_OfLoad, frozen=True, kw_only=True):
    """A fetch went out: a load of ``keys`` into our ``block_indexes``.

    Attributes:
        round_seq: The round the fetch closes.
        job_id: The engine's load job.
        keys: What to load.
        block_indexes: Where to, in our block pool, parallel to ``keys``.
        load_deadline: When the load is aborted if unanswered.
        next_round: The round that lookups and fetches use from now on.
    """

    keys: Keys
    block_indexes: Ints
    load_deadline: float
    next_round: int


class FetchSkipped(Event, frozen=True, kw_only=True):
    """A load was settled without asking the peer.

    Attributes:
        job_id: The engine's load job.
        success: True for an empty load, False for a load that can't be made.
        reason: Why.
    """

    job_id: int
    success: bool
    reason: str


class LookupCancelled(_OfRound, frozen=True, kw_only=True):
    """The terminal empty fetch went out: the peer may drop the request.

    Attributes:
        round_seq: The current round, stamped on the empty fetch.
    """


class TransferDone(_OfLoad, frozen=True, kw_only=True):
    """The peer reported a load finished.

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job.
        success: Whether every block arrived.
    """

    success: bool


class AbortSent(_OfLoad, frozen=True, kw_only=True):
    """We asked the peer to abort a load.

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job.
        reason: Why (timed out, or the request finished first).
        ack_deadline: When the load fails even without the peer's ack.
    """

    reason: str
    ack_deadline: float


class AbortAcked(_OfLoad, frozen=True, kw_only=True):
    """The peer confirmed no write into the load's blocks can still run.

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job, now failed.
    """


class Aborted(_OfLoad, frozen=True, kw_only=True):
    """A load failed without the peer's word (no ack in time, session lost).

    Attributes:
        round_seq: The load's round.
        job_id: The engine's load job, now failed.
        reason: Why.
    """

    reason: str


class Finished(Event, frozen=True, kw_only=True):
    """The consumer request ended. Terminal.

    Version 2: when the engine's finish ends the request at once (no load in
    flight), this one event says so, with what version 1 recorded apart
    before it: the engine's finish (:class:`FinishRequested`) and the terminal
    empty fetch (:class:`LookupCancelled`).

    Attributes:
        phase: DONE, FAILED or ABORTED.
        reason: A summary for people.
        requested: The engine finished the request in this step.
        cancelled_round: The terminal empty fetch went out in this step,
            stamped with this round (a lookup was still open); None if not.
    """

    VERSION: ClassVar[int] = 2  # 2: requested, cancelled_round

    phase: ConsumerPhase
    reason: str
    requested: bool = False
    cancelled_round: int | None = None
