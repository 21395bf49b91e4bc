"""The tier's jobs until vLLM hears they finished (a part of the vLLM adapter).

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

import logging
import time
from typing import Any

from p2pactor.adapters._vllm_api import JobResult
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
        self.finished.append(JobResult(job_id, success, transfer_time=0.0, transfer_bytes=0))

    def _report(self, job_id: int, success: bool, since: float | None, blocks: int) -> float:
        """Owe vLLM a job's result: seconds since ``since``, its blocks' bytes if it succeeded.

        With no ``since`` (nothing is known of the job) both are None. Returns the seconds.
        """
        seconds = None if since is None else _now() - since
        size = None if since is None else (blocks * self._block_len if success else 0)
        self.finished.append(JobResult(job_id, success, transfer_time=seconds, transfer_bytes=size))
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
