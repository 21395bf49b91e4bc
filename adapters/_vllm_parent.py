"""The jobs the tier owes vLLM, and vLLM's ParentManager while it lends it.

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

:class:`JobBook` keeps what the tier owes vLLM: every load it was given (until
the node reports it), every store job it pins (a prefill/decode store until
its decoder fetched it, a peer's pin until the fetch of its round was served),
and the results not yet returned by ``get_finished_jobs()``, each with the
transfer time and bytes vLLM's tier metrics read (``docs/vllm.md``).

What vLLM 0.33 reads of a result: ``TieringMetricsTracker`` adds its
``transfer_time`` to ``kv_offload_tiering_read_time`` (loads) or ``write_time``
(stores) for a job that succeeded, and reads neither field of a failed one
(``tiering/metrics.py:205-240``; its byte counters count the job's keys times
the chunk size instead). ``transfer_bytes`` feeds only a successful store's
backpressure detector (``tiering/manager.py:559-576``), which this tier refuses.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from p2pactor.adapters import _vllm_api as api
from p2pactor.core import inputs as inp
from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.runtime.logcontext import request_context
from p2pactor.runtime.node import Node

log = logging.getLogger("p2pactor.vllm")

# The clock of the jobs' transfer_time, bound once: vLLM's own (its
# TransferJob.submit_time is time.monotonic), read on the engine's threads only.
_now = time.monotonic
# Most store jobs (prefill/decode stores and peers' pins) tracked for their
# results at once. Each is released within unbound_store_timeout or the pin
# timeout, so a working node holds far fewer; this bounds the tier's memory if
# releases stop coming (a node that died), at the cost of the oldest jobs'
# transfer fields (None) and their failure line.
_MAX_TRACKED_STORES = 1 << 16


class JobBook:
    """What the tier owes vLLM of its jobs.

    Args:
        node: The tier's node (load results come from it; what a load
            brought is told to its summary).
        block_len: Bytes of one block (a job's ``transfer_bytes``).
    """

    def __init__(self, node: Node, block_len: int) -> None:
        self._node = node
        self._block_len = block_len
        self.finished: list[Any] = []
        """Results for vLLM's next ``get_finished_jobs()``, each job once."""
        # Loads submitted and not yet reported: job id -> (kv_request_id, when
        # submitted (_now), keys, vLLM's request id, the keys' positions). An
        # entry goes when its result is collected; the node reports every load
        # it was handed (its load timeout bounds the wait), and each holds
        # primary chunks of its own until then.
        self.loads: dict[int, tuple[str, float, list[bytes], str, list[int | None] | None]] = {}
        # Store jobs not yet released: job id -> (kv_request_id of a
        # prefill/decode store, None for a peer's pin; when submitted or
        # pinned (_now); blocks). An entry goes at the job's one release
        # (store_released), at shutdown, or past _MAX_TRACKED_STORES.
        self.stores: dict[int, tuple[str | None, float, int]] = {}
        self.failed: set[str] = set()
        """Requests whose load failed: their lookups answer MISS until they finish."""

    def loading(self) -> set[bytes]:
        """The keys of the loads in flight."""
        return {key for entry in self.loads.values() for key in entry[2]}

    def at_once(self, job_id: int, *, success: bool) -> None:
        """A job that ends as it is handed over (nothing moves)."""
        self.finished.append(api.JobResult(job_id, success, transfer_time=0.0, transfer_bytes=0))

    def _report(self, job_id: int, success: bool, since: float | None, blocks: int) -> float:
        """Owe vLLM a job's result: seconds since ``since``, its blocks' bytes if it succeeded.

        With no ``since`` (nothing is known of the job) both are None. Returns the seconds.
        """
        seconds: float | None = None
        size: int | None = None
        if since is not None:
            seconds = _now() - since
            size = blocks * self._block_len if success else 0
        self.finished.append(
            api.JobResult(job_id, success, transfer_time=seconds, transfer_bytes=size)
        )
        return seconds or 0.0

    def load(
        self, job_id: int, kv_request_id: str, keys: list[bytes], ctx: Any, where: Any
    ) -> None:
        """A load was handed to the node; its chunks are vLLM's until it is reported."""
        self.loads[job_id] = (kv_request_id, _now(), keys, ctx.req_id, where)

    def take(self) -> list[Any]:
        """The results since the last call (vLLM's ``get_finished_jobs()``)."""
        finished, self.finished = self.collect(), []
        return finished

    def collect(self) -> list[Any]:
        """Move the node's load results into the list of finished jobs; return that list.

        A load's ``transfer_time`` is the seconds from its ``submit_load`` to
        this call, the first to see its result (so it includes the wait for
        the node's thread, the fetch round trip, the peer's write and the time
        until vLLM polls next). Its ``transfer_bytes`` is its blocks times the
        block size if it succeeded, else 0: a load is all or nothing (no
        ``successful_keys``), so vLLM recomputes every block of a failed one
        and counts none of it (``tiering/metrics.py``).
        """
        for result in self._node.finished_jobs():
            entry = self.loads.pop(result.job_id, None)
            if entry is None:  # submitted before a shutdown: nothing known of it
                self._report(result.job_id, result.success, None, 0)
                continue
            kv_id, submitted, keys, req_id, where = entry
            self._node.reserve(-len(keys))
            if result.success:  # in our CPU tier now, ranked for the request: ours to claim
                self._node.holds(keys, request=req_id, positions=where)
            else:
                self.failed.add(kv_id)  # its lookups answer MISS: prefill locally
            self._report(result.job_id, result.success, submitted, len(keys))
        return self.finished

    def track_store(self, job_id: int, kv_request_id: str | None, blocks: int) -> None:
        """A store job starts: a prefill/decode store (``kv_request_id``) or a peer's pin."""
        stores = self.stores
        if len(stores) >= _MAX_TRACKED_STORES:
            del stores[next(iter(stores))]  # the oldest; see _MAX_TRACKED_STORES
        stores[job_id] = (kv_request_id, _now(), blocks)

    def store_released(self, job_id: int, success: bool) -> None:
        """A store job's one release (through the lent parent): report it to vLLM.

        ``transfer_time`` is the seconds from its ``submit_store`` (a peer's
        pin: from ``create_store_job``) to this release, which comes once the
        fetch was served, or when the job failed or timed out.
        ``transfer_bytes`` is its blocks times the block size if it succeeded
        (a prefill/decode store succeeds once every block of it was written to
        the decoder; a pin, once the fetch of its round was served, counted
        whole as vLLM counts a job's keys), else 0. A job tracked no more (past
        ``_MAX_TRACKED_STORES``) has neither.
        """
        kv_id, since, blocks = self.stores.pop(job_id, (None, None, 0))
        seconds = self._report(job_id, success, since, blocks)
        if not success and kv_id is not None:  # a pin that no fetch used is routine
            config = self._node.config
            log.warning(
                "store job %d of %s failed %.1f s after it was stored, and vLLM unpins its "
                "blocks: the decode side did not fetch them all within "
                "unbound_store_timeout (%g s), or its fetch failed (check that the decoder "
                "runs and reaches this node, and the lines above for this request)",
                job_id,
                kv_id,
                seconds,
                config.unbound_store_timeout,
                extra=request_context(None, kv_id, node=config.node_id),
            )

    def forget(self) -> None:
        """The node stopped: no result can come for the jobs still out."""
        self.loads.clear()
        self.stores.clear()


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
        if not self._node.config.sources.share or len(self._followed) >= _MOST_FOLLOWED:
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
