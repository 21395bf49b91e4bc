"""The engine section's scripted engine: a tier driven as vLLM's scheduler drives it, timed.

:class:`Engine` makes these calls, one step at a time, as vLLM's offloading connector
and ``TieringOffloadingManager`` make them of a secondary tier, each timed by a
:class:`Meter`:

1. ``has_pending_work()``, under the lock;
2. ``admit`` new requests (``remote_kv_source`` naming the producer, ``keys``
   keys, a prefix of K/2..K on the producer) get ``on_new_request()``;
3. ``schedule()``, under the lock: ``get_finished_jobs()``, then ``lookup()`` of
   each waiting request's keys in order (past HIT and RETRY, up to the first MISS); a
   request with no RETRY left has its HIT prefix queued as one promotion; then
   ``serve_external_requests(parent)``, a ``submit_load()`` per promotion,
   ``on_schedule_end()``;
4. the forward pass: ``step_ms`` of sleep, lock released, while the tier-poll
   thread (``poll_ms``) calls ``get_finished_jobs()`` and ``serve_external_requests()``;
5. each request whose load finished gets ``on_request_finished()``.

:func:`measure` runs one tier's engine against its producer. Importing it needs vLLM.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._control_common import free_port, percentile, process_cpu_s
from p2pactor.runtime.parent import EmbeddedCache


class Meter:
    """Wall time of the tier calls one thread makes, in all and per step."""

    def __init__(self) -> None:
        self.ns = 0
        self.steps: list[int] = []  # ns in tier calls, per step
        self._step_start = 0

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)``, timing it."""
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            self.ns += time.perf_counter_ns() - t0

    def end_step(self) -> None:
        """Close the current step."""
        self.steps.append(self.ns - self._step_start)
        self._step_start = self.ns


class Request:
    """A request on the consumer: its context (naming the producer on ``port``), answers, load."""

    __slots__ = ("answers", "chunks", "ctx", "spec")

    def __init__(self, spec: shared.RequestSpec, kind: str, tag: str, port: int) -> None:
        self.spec = spec
        source = {"remote_host": shared.HOST, "remote_port": port}
        source["kv_request_id"] = f"{kind}-{tag}-{spec.index}"
        params = {"remote_kv_source": source}
        self.ctx = ReqContext(req_id=f"req-{tag}-{spec.index}", kv_transfer_params=params)
        self.answers: list[LookupResult | None] = [None] * len(spec.keys)
        self.chunks: list[int] = []


class Engine:
    """The consumer side: a tier driven as vLLM's scheduler drives it."""

    def __init__(self, tier: Any, pool: np.ndarray, args: argparse.Namespace) -> None:
        self.tier, self.pool, self.args = tier, pool, args
        self.parent = shared.CacheParent(EmbeddedCache(1, 1))  # it holds nothing to serve
        self.lock = threading.Lock()
        self.free: deque[int] = deque(range(pool.shape[0]))
        self.jobs: dict[int, Request] = {}
        self.next_job = 1
        self.done: list[Request] = []
        self.bad = 0  # loads failed, blocks with wrong bytes
        self.poll_meter = Meter()
        self.stop = threading.Event()
        # The tier-poll thread, as vLLM runs it for a tier that tolerates it.
        self.poller = threading.Thread(target=self._poll, name="vllm_offload_tier_poll")

    def _poll(self) -> None:
        while not self.stop.wait(self.args.poll_ms / 1000):
            meter = self.poll_meter  # replaced after the warm-up
            with self.lock:
                self._finished(meter.call(self.tier.get_finished_jobs))
                meter.call(self.tier.serve_external_requests, self.parent)

    def _finished(self, results: Any) -> None:
        """Job results (under the lock, from either thread): check every loaded block."""
        for result in results:
            req = self.jobs.pop(int(result.job_id))
            if not result.success:
                self.bad += 1
            for j, chunk in enumerate(req.chunks if result.success else ()):
                stamp = shared.STAMP.pack(req.spec.index, j)
                self.bad += self.pool[chunk, : shared.STAMP.size].tobytes() != stamp
            self.done.append(req)

    def run(self, requests: Sequence[Request], meter: Meter) -> None:
        """Drive ``requests`` until all have finished."""
        tier, args, lock = self.tier, self.args, self.lock
        upcoming, waiting, finished = deque(requests), list[Request](), 0
        while finished < len(requests):
            with lock:  # 1. the engine's liveness check
                meter.call(tier.has_pending_work)
            new = [upcoming.popleft() for _ in range(min(args.admit, len(upcoming)))]
            for req in new:  # 2. add_request
                with lock:
                    meter.call(tier.on_new_request, req.ctx)
            waiting.extend(new)
            with lock:  # 3. schedule()
                self._finished(meter.call(tier.get_finished_jobs))
                promotions, waiting = self._lookups(waiting, meter)
                meter.call(tier.serve_external_requests, self.parent)
                for job in promotions:
                    meter.call(tier.submit_load, job)
                end = ScheduleEndContext(
                    new_req_ids=[r.ctx.req_id for r in new], preempted_req_ids=()
                )
                meter.call(tier.on_schedule_end, end)
            time.sleep(args.step_ms / 1000)  # 4. the forward pass
            with lock:  # 5. output processing
                done, self.done = self.done, []
                for req in done:
                    meter.call(tier.on_request_finished, req.ctx)
                    self.free.extend(req.chunks)
                    finished += 1
            meter.end_step()

    def _lookups(
        self, waiting: list[Request], meter: Meter
    ) -> tuple[list[TransferJob], list[Request]]:
        """Look the waiting requests' keys up; a promotion for each one fully answered."""
        promotions: list[TransferJob] = []
        still: list[Request] = []
        for req in waiting:
            retry = False
            for j, key in enumerate(req.spec.keys):
                if req.answers[j] is LookupResult.HIT:
                    continue
                answer = meter.call(self.tier.lookup, key, req.ctx)
                if answer is LookupResult.HIT_PENDING:
                    answer = LookupResult.HIT
                req.answers[j] = answer
                if answer is LookupResult.MISS:
                    break
                retry = retry or answer is LookupResult.RETRY
            if retry:
                still.append(req)
                continue
            answers = req.answers
            hits = next(
                (j for j, a in enumerate(answers) if a is not LookupResult.HIT), len(answers)
            )
            if hits == 0:
                self.done.append(req)  # nothing to load: the engine prefills it all
            elif len(self.free) < hits:
                still.append(req)  # no room in the primary tier this step
            else:
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


def measure(kind: str, args: argparse.Namespace, producer: Any, port: int) -> dict[str, float]:
    """One consumer of ``kind`` against its producer (on ``port``): warm up, measure, tear down.

    The figures: milliseconds of the engine and poll threads in tier calls, the engine
    steps' p99 in tier calls (us), CPU ms of this process and the producer's, and
    ``bad``: failed loads and blocks with wrong bytes.
    """
    specs = shared.workload(args.requests, args.keys)
    try:
        pool = np.zeros((4096, shared.BLOCK_BYTES), dtype=np.uint8)
        tier = shared.make_tier(kind, pool, free_port())
        engine = Engine(tier, pool, args)
        engine.poller.start()
        try:
            engine.run([Request(s, kind, "warm", port) for s in specs[:8]], Meter())
            engine.bad, engine.poll_meter, meter = 0, Meter(), Meter()
            cpu0, prod0 = sum(os.times()[:2]), process_cpu_s(producer.pid)
            engine.run([Request(s, kind, "run", port) for s in specs], meter)
            cpu1, prod1 = sum(os.times()[:2]), process_cpu_s(producer.pid)
        finally:
            engine.stop.set()
            engine.poller.join()
            tier.shutdown()
    finally:
        producer.close(timeout=60)
    return {
        "engine_ms": meter.ns / 1e6,
        "step_p99_us": percentile(meter.steps, 0.99) / 1e3,
        "poll_ms": engine.poll_meter.ns / 1e6,
        "process_cpu_ms": (cpu1 - cpu0) * 1e3,
        "producer_cpu_ms": (prod1 - prod0) * 1e3,
        "bad": engine.bad,
    }
