"""The scripted engine: a tier driven as vLLM's scheduler drives it.

:class:`Engine` makes the calls of vLLM's offloading connector and
``TieringOffloadingManager``, step by step, in the order the docstring of
:mod:`p2pactor.programs.bench._vllm_engine` gives, timing each with a
:class:`~p2pactor.programs.bench._vllm_measure.Meter`; a tier-poll thread makes the
calls of vLLM's.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._vllm_measure import Meter

RUN_TIMEOUT_S = 300.0


class Request:
    """A request on the consumer: its context, what its keys answered, its load."""

    __slots__ = ("answered", "answers", "chunks", "ctx", "done", "spec", "started")

    def __init__(self, spec: shared.RequestSpec, ctx: ReqContext) -> None:
        self.spec = spec
        self.ctx = ctx
        self.answers: list[LookupResult | None] = [None] * len(spec.keys)
        self.chunks: list[int] = []
        self.started = self.answered = self.done = 0  # engine steps


class Engine:
    """The consumer side: a tier driven as vLLM's scheduler drives it."""

    def __init__(self, tier: Any, pool: np.ndarray, args: argparse.Namespace) -> None:
        self.tier = tier
        self.pool = pool
        self.args = args
        self.parent = shared.FakeParent()  # the consumer holds nothing to serve
        self.lock = threading.Lock()
        self.free: deque[int] = deque(range(pool.shape[0]))
        self.jobs: dict[int, Request] = {}
        self.next_job = 1
        self.done: list[Request] = []
        self.counts = {"loads_ok": 0, "loads_failed": 0, "keys_loaded": 0, "bad_blocks": 0}
        self._poll_stop = threading.Event()
        self._poll_thread: threading.Thread | None = None
        self.poll_meter = Meter()
        self.poll_rounds = 0
        self.step = 0

    # the tier-poll thread

    def start_polling(self) -> None:
        """Start the tier-poll thread, as vLLM does for a tier that tolerates it."""
        if self.args.poll_ms <= 0:
            return
        self._poll_thread = threading.Thread(
            target=self._poll_loop, name="vllm_offload_tier_poll", daemon=True
        )
        self._poll_thread.start()

    def stop_polling(self) -> None:
        """Stop and join the tier-poll thread."""
        self._poll_stop.set()
        if self._poll_thread is not None:
            self._poll_thread.join()

    def poll_tid(self) -> int | None:
        """The tier-poll thread's id, if it runs."""
        return self._poll_thread.native_id if self._poll_thread is not None else None

    def _poll_loop(self) -> None:
        interval = self.args.poll_ms / 1000
        while not self._poll_stop.is_set():
            meter = self.poll_meter  # replaced after the warm-up
            with self.lock:
                self._finished(meter.call("get_finished_jobs", self.tier.get_finished_jobs))
                meter.call(
                    "serve_external_requests", self.tier.serve_external_requests, self.parent
                )
                self.poll_rounds += 1
            self._poll_stop.wait(interval)

    # job results (under the lock, from either thread)

    def _finished(self, results: Any) -> None:
        for result in results:
            req = self.jobs.pop(int(result.job_id), None)
            if req is None:
                continue
            if result.success:
                self.counts["loads_ok"] += 1
                self.counts["keys_loaded"] += len(req.chunks)
                for j, chunk in enumerate(req.chunks):
                    head = self.pool[chunk, : shared.STAMP.size].tobytes()
                    if head != shared.stamp(req.spec.index, j):
                        self.counts["bad_blocks"] += 1
            else:
                self.counts["loads_failed"] += 1
            self.done.append(req)

    # one run

    def run(self, requests: Sequence[Request], meter: Meter) -> dict[str, Any]:
        """Drive ``requests`` through the tier until all have finished; the run's wall time."""
        tier, args, lock = self.tier, self.args, self.lock
        step_s = args.step_ms / 1000
        upcoming = deque(requests)
        waiting: list[Request] = []
        finished = 0
        deadline = time.monotonic() + RUN_TIMEOUT_S
        t0 = time.perf_counter_ns()
        while finished < len(requests):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the run did not finish within {RUN_TIMEOUT_S:g} s "
                    f"({finished}/{len(requests)} requests finished)"
                )
            # 1. the engine's liveness check
            meter.acquire(lock)
            try:
                meter.call("has_pending_work", tier.has_pending_work)
            finally:
                lock.release()
            # 2. add_request
            new = [upcoming.popleft() for _ in range(min(args.admit, len(upcoming)))]
            for req in new:
                meter.acquire(lock)
                try:
                    meter.call("on_new_request", tier.on_new_request, req.ctx)
                finally:
                    lock.release()
            for req in new:
                req.started = self.step
            waiting.extend(new)
            # 3. schedule()
            meter.acquire(lock)
            try:
                self._finished(meter.call("get_finished_jobs", tier.get_finished_jobs))
                promotions, still = self._lookups(waiting, meter)
                waiting = still
                meter.call("serve_external_requests", tier.serve_external_requests, self.parent)
                for job in promotions:
                    meter.call("submit_load", tier.submit_load, job)
                context = ScheduleEndContext(
                    new_req_ids=[r.ctx.req_id for r in new], preempted_req_ids=()
                )
                meter.call("on_schedule_end", tier.on_schedule_end, context)
            finally:
                lock.release()
            # 4. the forward pass
            time.sleep(step_s)
            # 5. output processing
            meter.acquire(lock)
            try:
                done, self.done = self.done, []
                for req in done:
                    meter.call("on_request_finished", tier.on_request_finished, req.ctx)
                    self.free.extend(req.chunks)
                    req.done = self.step
                    finished += 1
            finally:
                lock.release()
            meter.end_step()
            self.step += 1
        answer_steps = [r.answered - r.started for r in requests]
        finish_steps = [r.done - r.started for r in requests]
        return {
            "wall_s": (time.perf_counter_ns() - t0) / 1e9,
            "steps_to_answer_mean": statistics.fmean(answer_steps),
            "steps_to_answer_max": max(answer_steps),
            "steps_to_finish_mean": statistics.fmean(finish_steps),
            "steps_to_finish_max": max(finish_steps),
        }

    def _lookups(
        self, waiting: list[Request], meter: Meter
    ) -> tuple[list[TransferJob], list[Request]]:
        """Look up the waiting requests' keys; promotions for those fully answered."""
        tier = self.tier
        promotions: list[TransferJob] = []
        still: list[Request] = []
        for req in waiting:
            retry = False
            for j, key in enumerate(req.spec.keys):
                if req.answers[j] is LookupResult.HIT:
                    continue
                answer = meter.call("lookup", tier.lookup, key, req.ctx)
                if answer is LookupResult.HIT_PENDING:
                    answer = LookupResult.HIT
                req.answers[j] = answer
                if answer is LookupResult.MISS:
                    break
                if answer is LookupResult.RETRY:
                    retry = True
            if retry:
                still.append(req)
                continue
            if not req.answered:
                req.answered = self.step
            hits = 0
            while hits < len(req.answers) and req.answers[hits] is LookupResult.HIT:
                hits += 1
            if hits == 0:
                self.done.append(req)  # nothing to load: the engine prefills it all
                continue
            if len(self.free) < hits:
                still.append(req)  # no room in the primary tier this step
                continue
            req.chunks = [self.free.popleft() for _ in range(hits)]
            job_id, self.next_job = self.next_job, self.next_job + 1
            self.jobs[job_id] = req
            promotions.append(
                TransferJob(
                    job_id=job_id,
                    keys=list(req.spec.keys[:hits]),
                    chunk_ids=np.array(req.chunks, dtype=np.int64),
                    is_promotion=True,
                    req_context=req.ctx,
                )
            )
        return promotions, still


# --- one run of one tier ---------------------------------------------------------------------


def make_requests(
    kind: str, tag: str, specs: Sequence[shared.RequestSpec], port: int
) -> list[Request]:
    """Consumer requests for ``specs``, pulling from the producer on ``port``."""
    out = []
    for spec in specs:
        source = {
            "kv_request_id": f"{kind}-{tag}-{spec.index}",
            "remote_host": shared.HOST,
            "remote_port": port,
        }
        ctx = ReqContext(
            req_id=f"req-{tag}-{spec.index}", kv_transfer_params={"remote_kv_source": source}
        )
        out.append(Request(spec, ctx))
    return out
