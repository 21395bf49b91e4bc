"""Inputs to the pure core that are not wire messages.

An actor's inputs are: the engine's calls (:class:`Register`, :class:`Flush`,
:class:`SubmitLoad`, :class:`Finish`, :class:`AddStore`), the parent's answers
(:class:`ParentAnswer`), the data plane's reports (:class:`TransferResult`), the
passage of time (:class:`Tick`), the end of the session (:class:`SessionEnded`),
decoded wire messages from :mod:`p2pactor.core.protocol`, and the runtime's quota
verdicts on such messages (:class:`OverQuota`).
"""

from __future__ import annotations

import msgspec

from p2pactor.core import protocol as wire
from p2pactor.core.choice import Choice
from p2pactor.core.events import Quota
from p2pactor.core.ids import IdentityEnum


class LookupResult(IdentityEnum):
    """What a cache says about one key (the same four answers as vLLM's).

    Attributes:
        HIT: Present and readable now.
        MISS: Not present.
        HIT_PENDING: Present but not readable yet (a write or promotion in flight).
        RETRY: Not known yet; ask again later.
    """

    HIT = "hit"
    MISS = "miss"
    HIT_PENDING = "hit_pending"
    RETRY = "retry"


class Register(msgspec.Struct, frozen=True, gc=False):
    """The engine wants to know whether the peer holds ``keys``.

    With ``flush``, the lookup goes out in the same step (what a
    :class:`Flush` right after would do): one input per engine lookup.
    ``choice``: the request named no source, and this peer was chosen for
    it (recorded with the lookup).
    """

    keys: tuple[bytes, ...]
    flush: bool = False
    choice: Choice | None = None


class Flush(msgspec.Struct, frozen=True, gc=False):
    """The engine step ended: put newly registered keys on the wire."""


class SubmitLoad(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The engine wants ``keys`` written into its ``block_indexes``.

    Attributes:
        job_id: The engine's job, reported back exactly once.
        keys: What to load.
        block_indexes: Destination blocks in our pool, parallel to ``keys``.
        next_round: The round to use after this fetch; None means the next
            integer (vLLM's dialect). p2pactor peers may use a session-wide
            counter so that a round number never repeats.
    """

    job_id: int
    keys: tuple[bytes, ...]
    block_indexes: tuple[int, ...]
    next_round: int | None = None


class Finish(msgspec.Struct, frozen=True, gc=False):
    """The engine is done with the request.

    For a consumer: abort what is in flight and close the peer's side. For a
    prefill/decode producer: no more blocks will be stored for it.
    """


class Tick(msgspec.Struct, frozen=True, gc=False):
    """Time passed: act on every deadline at or before ``now``."""


class SessionEnded(msgspec.Struct, frozen=True, gc=False):
    """The control session to the peer is gone; nothing can be sent any more.

    Attributes:
        reason: Why.
        write_grace: How long a write of the peer's into our pool may still
            land (the data path's own bound, once the peer is silent); a
            consumer keeps the blocks of its loads in flight that long.
    """

    reason: str
    write_grace: float = 0.0


class WritesSettled(msgspec.Struct, frozen=True, gc=False):
    """No write of the peer's can land in our pool any more, though the hold has not run out.

    The runtime knows it when the data path can show it: the peer's process
    has exited and only this kernel lay between us, and our side of the data
    path has let the peer go. A consumer's loads held since its session was
    lost then fail at once.

    Attributes:
        reason: How the runtime knows, for the loads' failure.
    """

    reason: str


class Pin(msgspec.Struct, frozen=True, gc=False):
    """A parent job that pins blocks: release it exactly once.

    Attributes:
        job_id: The parent's job id.
        keys: The pinned keys.
        blocks: Our block index for each key, parallel to ``keys``.
    """

    job_id: int
    keys: tuple[bytes, ...]
    blocks: tuple[int, ...]


class ParentAnswer(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The parent served one :class:`~p2pactor.core.effects.ParentLookup`.

    Attributes:
        lookup_id: The lookup it was for.
        results: ``(key, result)`` for each key looked up.
        pin: The job pinning the hits, if any hit.
        expired: The request arrived after its ``not_after`` and the parent
            was not asked at all.
        refused: Hits left unpinned because the peer is over its
            :attr:`~p2pactor.core.events.Quota.PINNED_BLOCKS` quota; they are
            answered MISS.
        refusal: Why, with the numbers, when ``refused`` is not empty.
    """

    lookup_id: int
    results: tuple[tuple[bytes, LookupResult], ...] = ()
    pin: Pin | None = None
    expired: bool = False
    refused: tuple[bytes, ...] = ()
    refusal: str = ""


class OverQuota(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The runtime's verdict: a peer's lookup or fetch goes over one of its quotas.

    The runtime counts what each peer makes the node hold, across all of the
    peer's requests, and hands the core this instead of the bare message when
    a limit is reached; the core records the refusal and answers safely. A
    message within every quota arrives bare.

    * a lookup is answered at once, every key MISS, with nothing pinned
      (``admit`` 0), or, over :attr:`~p2pactor.core.events.Quota.KEYS_PER_LOOKUP`,
      only its first ``admit`` keys are looked up and the rest answered MISS;
    * a (non-empty) fetch fails its round: ``transfer_done(false)``, every pin
      of the round released, nothing written.

    Attributes:
        message: The peer's lookup or fetch.
        quota: Which quota it goes over.
        reason: The specifics, with the numbers, for the log.
        admit: For a lookup: how many of its keys, from the first, may still
            be looked up (0: none).
    """

    message: wire.Lookup | wire.Fetch
    quota: Quota
    reason: str
    admit: int = 0


class AddStore(Pin, frozen=True, kw_only=True, gc=False):
    """The engine stored (and pinned) blocks of a prefill/decode request: a pin of its own.

    Its ``job_id`` is the engine's store job, released exactly once.
    """


class TransferResult(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The data plane finished a transfer, and no part of it is still running.

    Attributes:
        transfer_id: The transfer.
        ok: Whether every byte arrived.
        reason: Why not, when not.
    """

    transfer_id: int
    ok: bool
    reason: str = ""
