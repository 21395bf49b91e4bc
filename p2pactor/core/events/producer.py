"""The producer's events: what happens to a request a peer sends us.

Re-exported by :mod:`p2pactor.core.events`; import them from there.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

from p2pactor.core.events import Event, Ints, Keys, _OfLookup, _OfRound, _OfTransfer


class LookupReceived(_OfLookup, frozen=True, kw_only=True):
    """A peer asked which of ``keys`` we hold.

    Attributes:
        lookup_id: Our number for this lookup, unique within the actor.
        round_seq: The round it belongs to.
        keys: The keys in wire order, duplicates included.
        deadline: When keys still pending are answered MISS.
    """

    round_seq: int
    keys: Keys
    deadline: float


class KeysResolved(_OfLookup, frozen=True, kw_only=True):
    """The parent answered about some of a lookup's keys.

    Opens the lookup's synthetic parent request if it was not open yet.

    Attributes:
        lookup_id: Which lookup.
        hits: Keys found and pinned.
        misses: Keys not found.
        pending: Keys HIT_PENDING or RETRY: ask again later.
        next_poll_at: When to ask again about ``pending``.
    """

    hits: Keys
    misses: Keys
    pending: Keys
    next_poll_at: float | None


class KeysPinned(_OfLookup, frozen=True, kw_only=True):
    """The parent pinned blocks for a lookup's hits, as one job.

    Attributes:
        lookup_id: The lookup whose hits these are.
        round_seq: The round they supply.
        job_id: The parent's job; releasing it unpins the blocks.
        keys: The pinned keys.
        blocks: Our block index for each key.
        expires_at: When the pin is released if no fetch uses it.
    """

    round_seq: int
    job_id: int
    keys: Keys
    blocks: Ints
    expires_at: float


class PendingPolled(_OfLookup, frozen=True, kw_only=True):
    """We asked the parent again about a lookup's pending keys.

    Attributes:
        lookup_id: Which lookup.
        keys: The keys still pending.
        not_after: The parent must not look them up past this time.
    """

    keys: Keys
    not_after: float


class ParentExpired(_OfLookup, frozen=True, kw_only=True):
    """A re-poll reached the parent only after its ``not_after``: nothing was asked.

    Attributes:
        lookup_id: Which lookup.
    """


class PendingExpired(_OfLookup, frozen=True, kw_only=True):
    """Pending keys ran out of time; they count as TIMEOUT and answer MISS.

    Attributes:
        lookup_id: Which lookup.
        keys: The keys that timed out.
    """

    keys: Keys


class Pinned(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The parent pinned a lookup's hits, as one job (inside :class:`LookupAnswered`).

    Attributes:
        job_id: The parent's job; releasing it unpins the blocks.
        keys: The pinned keys.
        blocks: Our block index for each key.
        expires_at: When the pin is released if no fetch uses it.
    """

    job_id: int
    keys: Keys
    blocks: Ints
    expires_at: float


class LookupAnswered(_OfLookup, frozen=True, kw_only=True, omit_defaults=True):
    """The one answer to a lookup went out.

    Version 2: when the parent's first answer settles every key of the
    lookup, the answer goes out in the same step, and this one event records
    all of it (``resolved``): the parent's answer (a :class:`KeysResolved`),
    the pin of the hits (``pinned``, a :class:`KeysPinned`) and the close of
    the lookup's synthetic parent request (a :class:`ContextClosed`), which
    version 1 recorded apart before and after it.

    Attributes:
        lookup_id: Which lookup.
        round_seq: Its round (sent to p2pactor peers only).
        keys: The lookup's keys in wire order, duplicates included.
        hits: Parallel to ``keys``.
        resolved: The parent's first answer came in this step and settled
            every key; the synthetic request opened and closed with it.
        pinned: The hits the parent pinned in this step, if any.
        refused: Parallel to ``keys`` (empty: none): True where the MISS is a
            quota's refusal (sent as such to p2pactor peers).

    Fields at their defaults are not written (records from before
    ``refused`` wrote ``resolved`` and ``pinned`` always; they read the same).
    """

    VERSION: ClassVar[int] = 2  # 2: resolved, pinned (refused: written only when set)

    round_seq: int
    keys: Keys
    hits: tuple[bool, ...]
    resolved: bool = False
    pinned: Pinned | None = None
    refused: tuple[bool, ...] = ()


class LookupDropped(_OfLookup, frozen=True, kw_only=True):
    """A lookup will not be answered: the request closed first.

    Attributes:
        lookup_id: Which lookup.
        reason: Why.
    """

    reason: str


class ContextClosed(_OfLookup, frozen=True, kw_only=True):
    """A lookup's synthetic parent request is owed its close.

    Attributes:
        lookup_id: Which lookup.
    """


class StoreAdded(Event, frozen=True, kw_only=True):
    """The engine stored blocks for a prefill/decode request (already pinned).

    Attributes:
        job_id: The engine's store job; releasing it unpins the blocks.
        keys: The stored keys.
        blocks: Our block index for each key.
        expires_at: When the pin is released if no fetch uses it.
    """

    job_id: int
    keys: Keys
    blocks: Ints
    expires_at: float


class FetchReceived(_OfRound, frozen=True, kw_only=True):
    """The peer asked us to write ``keys`` into its ``block_indexes``.

    Attributes:
        round_seq: The round it closes.
        keys: What to send.
        block_indexes: Where to, in the peer's pool, parallel to ``keys``.
    """

    keys: Keys
    block_indexes: Ints


class TransferStarted(_OfTransfer, frozen=True, kw_only=True):
    """One WRITE of matched blocks into the peer's pool was started.

    Attributes:
        transfer_id: Our number for it, unique within the actor.
        round_seq: The round it serves.
        keys: The keys written.
        local_blocks: Our source blocks, parallel to ``keys``.
        remote_blocks: The peer's destination blocks, parallel to ``keys``.
        job_ids: The pin job holding each source block, parallel to ``keys``.
    """

    round_seq: int
    keys: Keys
    local_blocks: Ints
    remote_blocks: Ints
    job_ids: Ints


class TransferCompleted(_OfTransfer, frozen=True, kw_only=True):
    """A WRITE finished; every byte is in the peer's blocks.

    Attributes:
        transfer_id: Which transfer.
    """


class TransferFailed(_OfTransfer, frozen=True, kw_only=True):
    """A WRITE failed, and no part of it is still running.

    Attributes:
        transfer_id: Which transfer.
        reason: Why.
    """

    reason: str


class TransferDoneSent(_OfRound, frozen=True, kw_only=True):
    """A round ended and the peer was told how.

    Attributes:
        round_seq: The round.
        success: Whether every demanded block was written.
        reason: Why it failed, or "" on success.
    """

    success: bool
    reason: str


class AbortReceived(_OfRound, frozen=True, kw_only=True):
    """The peer asked us to abort a round.

    Attributes:
        round_seq: The round.
    """


class AbortAckSent(_OfRound, frozen=True, kw_only=True):
    """We confirmed an abort: no write into the peer for that round can run.

    Attributes:
        round_seq: The round.
    """


class RoundClosed(_OfRound, frozen=True, kw_only=True):
    """A round ended with nothing to tell the peer.

    Attributes:
        round_seq: The round.
        reason: Why.
    """

    reason: str


class PinsRenewed(Event, frozen=True, kw_only=True):
    """A lookup or fetch of the request showed it alive: its idle pins' leases were renewed.

    Attributes:
        job_ids: The pin jobs renewed: each one no fetch is using, whose lease ended sooner.
        expires_at: When they are now released if no fetch uses them: ``pin_timeout``
            from now, but never past ``pin_lease_cap`` after the request's first pin.
    """

    job_ids: Ints
    expires_at: float


class PinReleased(Event, frozen=True, kw_only=True):
    """A pin job was released; its blocks may be evicted again.

    Attributes:
        job_id: The parent's job.
        success: Whether its blocks served what they were pinned for.
        reason: Why it was released.
    """

    job_id: int
    success: bool
    reason: str


class CloseRequested(_OfRound, frozen=True, kw_only=True):
    """The peer closed the whole request (the terminal empty fetch).

    Attributes:
        round_seq: The round stamped on the empty fetch.
        reason: Why, in words.
    """

    reason: str


class Closed(Event, frozen=True, kw_only=True):
    """The producer request holds nothing any more. Terminal.

    Version 2: when the peer's empty fetch closes a request that holds only
    pins of rounds it looked up, this one event records the whole close,
    which version 1 recorded as a :class:`CloseRequested`, a
    :class:`PinReleased` per pin and a :class:`RoundClosed` per round before
    it; they all had ``reason`` as their reason.

    Attributes:
        reason: A summary for people.
        requested_round: The round stamped on the peer's empty fetch that
            closed the request in this step, or None.
        released: The pin jobs released in this step (not a success: nothing
            was fetched from them).
        rounds_closed: The rounds that ended in this step, with nothing to
            tell the peer.
    """

    VERSION: ClassVar[int] = 2  # 2: requested_round, released, rounds_closed

    reason: str
    requested_round: int | None = None
    released: Ints = ()
    rounds_closed: Ints = ()
