"""vLLM's ParentManager as the node sees it, while vLLM lends it (a part of the vLLM adapter).

:class:`LentParent` runs the node's parent requests (peers' lookups, pins,
releases) against the parent vLLM lends to ``serve_external_requests``;
:func:`scrub` checks, in the same call, that keys this engine's summary
claims are still in its CPU tier (a tier hears of no eviction), so a summary
drifts no further than the check's pace.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Protocol

from p2pactor.adapters._vllm_api import (
    PRIMARY_ONLY,
    ParentManager,
    ReqContext,
    VllmLookup,
    from_vllm,
    job_ids,
)
from p2pactor.adapters._vllm_jobs import JobBook
from p2pactor.core import inputs as inp
from p2pactor.core.inputs import LookupResult as Answer

_scrub_ids = itertools.count(1)


class TierBooks(Protocol):
    """What the lent parent keeps in the tier across serves."""

    _contexts: dict[str, ReqContext]
    """Synthetic requests by p2pactor's name, open across serves."""

    @property
    def jobs(self) -> JobBook:
        """The tier's jobs (a peer's pin starts one here; its release ends it)."""
        ...


class LentParent:
    """vLLM's ParentManager, lent for one ``serve_external_requests`` call, as a p2pactor Parent.

    Synthetic requests are named by p2pactor and live across serves, so their
    vLLM ``ReqContext`` objects are kept by the tier, not here.
    """

    def __init__(self, books: TierBooks, parent: ParentManager) -> None:
        self._books = books
        self._parent = parent

    def on_new_request(self, context: str) -> None:
        ctx = ReqContext(req_id=context, kv_transfer_params=None)
        self._books._contexts[context] = ctx
        self._parent.on_new_request(ctx)

    def lookup(self, key: bytes, context: str) -> Answer:
        ctx = self._books._contexts[context]
        return from_vllm(self._parent.lookup(key, ctx))

    def create_store_job(self, keys: Sequence[bytes], context: str) -> inp.Pin:
        ctx = self._books._contexts[context]
        job = self._parent.create_store_job(list(keys), ctx)
        job_id = int(job.job_id)
        self._books.jobs.track_store(job_id, None, len(job.keys))
        return inp.Pin(job_id, tuple(job.keys), tuple(job_ids(job)))

    def on_request_finished(self, context: str) -> None:
        ctx = self._books._contexts.pop(context)
        self._parent.on_request_finished(ctx)

    def release_job(self, job_id: int, *, success: bool) -> None:
        # vLLM unpins a job when the tier reports it in get_finished_jobs().
        self._books.jobs.store_released(job_id, success)


def scrub(
    parent: ParentManager, keys: Sequence[bytes], node_id: str
) -> tuple[list[bytes], list[bytes]]:
    """Which of ``keys`` the CPU tier no longer holds, and which it does, asked of it alone.

    One synthetic request, opened and finished around the lookups; with the
    primary-only filter nothing is promoted, and the CPU tier's lookup does
    not touch its LRU order.
    """
    if not keys:
        return [], list(keys)
    ctx = ReqContext(
        req_id=f"p2pactor-scrub-{node_id}-{next(_scrub_ids)}",
        kv_transfer_params=None,
        load_tier_filter=PRIMARY_ONLY,
    )
    gone: list[bytes] = []
    kept: list[bytes] = []
    parent.on_new_request(ctx)
    try:
        for key in keys:
            (kept if _held(parent.lookup(key, ctx)) else gone).append(key)
    finally:
        parent.on_request_finished(ctx)
    return gone, kept


def _held(result: Any) -> bool:
    # HIT_PENDING: being written into the primary, so held by the time a peer asks.
    return result is not VllmLookup.MISS
