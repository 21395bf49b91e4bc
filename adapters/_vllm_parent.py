"""vLLM's ParentManager while vLLM lends it: peers' requests run on it, the CPU tier checked.

:class:`LentParent` runs the node's parent requests (peers' lookups, pins,
releases) against the parent vLLM lends to ``serve_external_requests``. In the
same call the CPU tier alone is asked about keys (:func:`_primary_lookups`):
:func:`scrub` checks that keys this engine's summary claims are still there (a
tier hears of no eviction), so a summary drifts no further than the check's
pace, and :class:`Watch` claims what vLLM has begun to write.

The watch: vLLM cascades a store to its tiers one step after the store
completed in its CPU tier: told only then, a peer hears of a block a step after
the engine holds it, and a request for it on another engine in between
prefills what this one just computed (in the fleet benchmark, most of what
automatic choice missed of an oracle's). The tier knows earlier what its
engine will hold: vLLM asks it about a request's keys only past the CPU tier's
hits, and every key from the first it asks is one the engine computes or
loads. So :class:`Watch` follows each such request's keys, in prompt order. At
each step's serve (vLLM's ``on_schedule_end``, right after it prepared the
step's stores and allocated its promotions), it looks the next unclaimed key
of every followed request up in the CPU tier alone: from there, the run the
tier holds or is writing (HIT_PENDING) is claimed at once, ranked as the
request's, and the summary's delta goes out now. A peer that asks meanwhile
hears HIT_PENDING from vLLM's own CPU tier until the write completes, then
HIT; a write that fails leaves a MISS, which drops the claim as any other. A
key no store comes for (the request ended first, its store was skipped) is
never claimed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager

from p2pactor.adapters import _vllm_api as api
from p2pactor.adapters._vllm_jobs import JobBook
from p2pactor.core import inputs as inp
from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.runtime.node import Node

_MOST_FOLLOWED = 4096  # requests at once; a request past that is claimed at its cascade only
_ids = itertools.count(1)


class LentParent:
    """vLLM's ParentManager, lent for one ``serve_external_requests`` call, as a p2pactor Parent.

    Synthetic requests are named by p2pactor and live across serves, so their
    vLLM ``ReqContext`` objects are kept by the tier (``contexts``), not here;
    a peer's pin starts a job in the tier's ``jobs``, and its release ends it.
    """

    def __init__(
        self, contexts: dict[str, api.ReqContext], jobs: JobBook, parent: api.ParentManager
    ) -> None:
        self._contexts = contexts
        self._jobs = jobs
        self._parent = parent

    def on_new_request(self, context: str) -> None:
        ctx = self._contexts[context] = api.ReqContext(req_id=context, kv_transfer_params=None)
        self._parent.on_new_request(ctx)

    def lookup(self, key: bytes, context: str) -> Answer:
        return api.from_vllm(self._parent.lookup(key, self._contexts[context]))

    def create_store_job(self, keys: Sequence[bytes], context: str) -> inp.Pin:
        job = self._parent.create_store_job(list(keys), self._contexts[context])
        self._jobs.track_store(int(job.job_id), None, len(job.keys))
        return inp.Pin(int(job.job_id), tuple(job.keys), tuple(api.job_ids(job)))

    def on_request_finished(self, context: str) -> None:
        self._parent.on_request_finished(self._contexts.pop(context))

    def release_job(self, job_id: int, *, success: bool) -> None:
        # vLLM unpins a job when the tier reports it in get_finished_jobs().
        self._jobs.store_released(job_id, success)


@contextmanager
def _primary_lookups(parent: api.ParentManager, name: str) -> Iterator[Callable[[bytes], bool]]:
    """Whether the CPU tier alone holds a key, asked in one synthetic request.

    With the primary-only filter nothing is promoted, and the CPU tier's lookup
    does not touch its LRU order. HIT_PENDING (vLLM is writing the key: its
    store, or a promotion) counts as held: it is, by the time a peer asks.
    """
    ctx = api.ReqContext(
        req_id=f"{name}-{next(_ids)}", kv_transfer_params=None, load_tier_filter=api.PRIMARY_ONLY
    )
    parent.on_new_request(ctx)
    try:
        yield lambda key: parent.lookup(key, ctx) is not api.VllmLookup.MISS
    finally:
        parent.on_request_finished(ctx)


def scrub(
    parent: api.ParentManager, keys: Sequence[bytes], node_id: str
) -> tuple[list[bytes], list[bytes]]:
    """Which of ``keys`` the CPU tier no longer holds, and which it does, asked of it alone."""
    if not keys:
        return [], list(keys)
    gone: list[bytes] = []
    kept: list[bytes] = []
    with _primary_lookups(parent, f"p2pactor-scrub-{node_id}") as held:
        for key in keys:
            (kept if held(key) else gone).append(key)
    return gone, kept


class Watch:
    """The requests whose keys are claimed as vLLM writes them.

    Args:
        node: The tier's node (its summary).
    """

    def __init__(self, node: Node) -> None:
        self._node = node
        # Each followed request's (position, key) not claimed yet, the next one last.
        self._followed: dict[str, list[tuple[int, bytes]]] = {}

    def __len__(self) -> int:
        return len(self._followed)

    def follow(self, req_id: str, record: Mapping[bytes, int], first: int) -> None:
        """Follow ``req_id``'s keys from end-token position ``first`` on (the first it asked)."""
        if not self._node.shares_summaries or len(self._followed) >= _MOST_FOLLOWED:
            return
        if ahead := sorted(((p, k) for k, p in record.items() if p >= first), reverse=True):
            self._followed[req_id] = ahead

    def finished(self, req_id: str) -> None:
        """The request ended: its cascade, if any, has come (vLLM finishes it after)."""
        self._followed.pop(req_id, None)

    def check(self, parent: api.ParentManager, loading: Collection[bytes] = ()) -> None:
        """Claim what the CPU tier now holds or writes of every followed request (lent parent).

        One CPU-tier lookup per followed request, and one more per key passed.
        Keys in ``loading`` (this tier's own loads in flight) are passed over
        unclaimed: the load's end claims them, and until then the chunks it
        took are counted apart (``Node.reserve``).
        """
        if not self._followed:
            return
        with _primary_lookups(parent, f"p2pactor-watch-{self._node.node_id}") as held:
            for req_id, ahead in list(self._followed.items()):
                claim: list[tuple[int, bytes]] = []
                while ahead and held(ahead[-1][1]):
                    if (passed := ahead.pop())[1] not in loading:
                        claim.append(passed)
                if claim:
                    keys = [k for _, k in claim]
                    self._node.holds(
                        keys, request=req_id, positions=[p for p, _ in claim], now=True
                    )
                if not ahead:
                    del self._followed[req_id]
