"""The engine section's scripted engine: a tier driven as vLLM's scheduler drives it, timed.

:class:`Engine` makes these calls, one step at a time, as vLLM's offloading connector
and ``TieringOffloadingManager`` make them of a secondary tier, each timed by a
:class:`Meter`:

1. ``has_pending_work()``, under a short lock;
2. ``admit`` new requests (``remote_kv_source`` naming the producer, ``keys``
   keys, a prefix of K/2..K on the producer) get ``on_new_request()``;
3. ``schedule()``, under the step lock: ``get_finished_jobs()``, then ``lookup()`` of
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
import contextlib
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._control_common import (
    TIER_METHODS,
    free_port,
    percentile,
    thread_cpu_ns,
)
from p2pactor.runtime.parent import EmbeddedCache

RUN_TIMEOUT_S = 300.0


class Meter:
    """Wall time of the tier calls one thread makes, by method and per step, and its lock waits."""

    def __init__(self) -> None:
        self.total = dict.fromkeys(TIER_METHODS, 0)  # ns
        self.steps: list[int] = []  # ns in tier calls, per step
        self._step = 0
        self.lock_wait = 0

    def call(self, method: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)``, timing it as ``method``."""
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            dt = time.perf_counter_ns() - t0
            self.total[method] += dt
            self._step += dt

    @contextlib.contextmanager
    def locked(self, lock: threading.Lock) -> Iterator[None]:
        """Hold ``lock``, timing the wait for it."""
        t0 = time.perf_counter_ns()
        with lock:
            self.lock_wait += time.perf_counter_ns() - t0
            yield

    def end_step(self) -> None:
        """Close the current step."""
        self.steps.append(self._step)
        self._step = 0

    def summary(self) -> dict[str, Any]:
        """Totals (ms) and the per-step distribution (us)."""
        return {
            "steps": len(self.steps),
            "tier_ms": sum(self.total.values()) / 1e6,
            "step_p99_us": percentile(self.steps, 0.99) / 1e3 if self.steps else 0.0,
            "step_max_us": max(self.steps, default=0) / 1e3,
            "lock_wait_ms": self.lock_wait / 1e6,
            "methods": {m: ns / 1e6 for m, ns in self.total.items()},
        }


class Request:
    """A request on the consumer: its context (naming the producer on ``port``), answers, load."""

    __slots__ = ("answered", "answers", "chunks", "ctx", "spec", "started")

    def __init__(self, spec: shared.RequestSpec, kind: str, tag: str, port: int) -> None:
        self.spec = spec
        source = {"remote_host": shared.HOST, "remote_port": port}
        source["kv_request_id"] = f"{kind}-{tag}-{spec.index}"
        params = {"remote_kv_source": source}
        self.ctx = ReqContext(req_id=f"req-{tag}-{spec.index}", kv_transfer_params=params)
        self.answers: list[LookupResult | None] = [None] * len(spec.keys)
        self.chunks: list[int] = []
        self.started = self.answered = 0  # engine steps


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
        self.counts = {"loads_ok": 0, "loads_failed": 0, "keys_loaded": 0, "bad_blocks": 0}
        self.poll_meter = Meter()
        self.step = 0
        self._stop = threading.Event()
        self.poller = threading.Thread(target=self._poll, name="vllm_offload_tier_poll")

    def _poll(self) -> None:
        while not self._stop.wait(self.args.poll_ms / 1000):
            meter = self.poll_meter  # replaced after the warm-up
            with self.lock:
                self._finished(meter.call("get_finished_jobs", self.tier.get_finished_jobs))
                meter.call(
                    "serve_external_requests", self.tier.serve_external_requests, self.parent
                )

    @contextlib.contextmanager
    def polling(self) -> Iterator[None]:
        """The tier-poll thread runs, as vLLM runs it for a tier that tolerates it."""
        if self.args.poll_ms > 0:
            self.poller.start()
        try:
            yield
        finally:
            self._stop.set()
            if self.poller.is_alive():
                self.poller.join()

    def _finished(self, results: Any) -> None:
        """Job results (under the lock, from either thread): check every loaded block."""
        for result in results:
            req = self.jobs.pop(int(result.job_id), None)
            if req is None:
                continue
            if result.success:
                self.counts["loads_ok"] += 1
                self.counts["keys_loaded"] += len(req.chunks)
                for j, chunk in enumerate(req.chunks):
                    stamp = shared.STAMP.pack(req.spec.index, j)
                    if self.pool[chunk, : shared.STAMP.size].tobytes() != stamp:
                        self.counts["bad_blocks"] += 1
            else:
                self.counts["loads_failed"] += 1
            self.done.append(req)

    def run(self, requests: Sequence[Request], meter: Meter) -> dict[str, Any]:
        """Drive ``requests`` until all have finished; the wall time and steps to an answer."""
        tier, args, lock = self.tier, self.args, self.lock
        upcoming, waiting, finished = deque(requests), list[Request](), 0
        deadline = time.monotonic() + RUN_TIMEOUT_S
        t0 = time.perf_counter_ns()
        while finished < len(requests):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{finished}/{len(requests)} requests in {RUN_TIMEOUT_S:g} s")
            with meter.locked(lock):  # 1. the engine's liveness check
                meter.call("has_pending_work", tier.has_pending_work)
            new = [upcoming.popleft() for _ in range(min(args.admit, len(upcoming)))]
            for req in new:  # 2. add_request
                with meter.locked(lock):
                    meter.call("on_new_request", tier.on_new_request, req.ctx)
                req.started = self.step
            waiting.extend(new)
            with meter.locked(lock):  # 3. schedule()
                self._finished(meter.call("get_finished_jobs", tier.get_finished_jobs))
                promotions, waiting = self._lookups(waiting, meter)
                meter.call("serve_external_requests", tier.serve_external_requests, self.parent)
                for job in promotions:
                    meter.call("submit_load", tier.submit_load, job)
                end = ScheduleEndContext(
                    new_req_ids=[r.ctx.req_id for r in new], preempted_req_ids=()
                )
                meter.call("on_schedule_end", tier.on_schedule_end, end)
            time.sleep(args.step_ms / 1000)  # 4. the forward pass
            with meter.locked(lock):  # 5. output processing
                done, self.done = self.done, []
                for req in done:
                    meter.call("on_request_finished", tier.on_request_finished, req.ctx)
                    self.free.extend(req.chunks)
                    finished += 1
            meter.end_step()
            self.step += 1
        return {
            "wall_s": (time.perf_counter_ns() - t0) / 1e9,
            "steps_to_answer_mean": statistics.fmean(r.answered - r.started for r in requests),
        }

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
                answer = meter.call("lookup", self.tier.lookup, key, req.ctx)
                if answer is LookupResult.HIT_PENDING:
                    answer = LookupResult.HIT
                req.answers[j] = answer
                if answer is LookupResult.MISS:
                    break
                retry = retry or answer is LookupResult.RETRY
            if retry:
                still.append(req)
                continue
            req.answered = req.answered or self.step
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


def measure(kind: str, args: argparse.Namespace, producer: Any, port: int) -> dict[str, Any]:
    """One consumer of ``kind`` against its stopped producer: warm up, measure, tear down."""
    specs = shared.workload(args.requests, args.keys)
    producer.pause(paused=False)
    try:
        me = os.getpid()
        before = set(thread_cpu_ns(me))
        pool = np.zeros((4096, shared.BLOCK_BYTES), dtype=np.uint8)
        tier = shared.make_tier(kind, pool, free_port())
        engine = Engine(tier, pool, args)
        try:
            with engine.polling():
                engine.run([Request(s, kind, "warm", port) for s in specs[:8]], Meter())
                engine.counts = dict.fromkeys(engine.counts, 0)
                engine.poll_meter, meter = Meter(), Meter()
                cpu0, prod0, times0 = thread_cpu_ns(me), thread_cpu_ns(producer.pid), os.times()
                result = engine.run([Request(s, kind, "run", port) for s in specs], meter)
                cpu1, prod1, times1 = thread_cpu_ns(me), thread_cpu_ns(producer.pid), os.times()
        finally:
            tier.shutdown()
    finally:
        producer.close(timeout=60)
    role = {
        threading.main_thread().native_id: "engine_thread",
        engine.poller.native_id: "poll_thread",
    }
    cpu_ms = dict.fromkeys(("engine_thread", "poll_thread", "tier_threads", "other_threads"), 0.0)
    for tid, (_, ns) in cpu1.items():
        group = role.get(tid) or ("other_threads" if tid in before else "tier_threads")
        cpu_ms[group] += (ns - cpu0.get(tid, ("", 0))[1]) / 1e6
    cpu_ms["process"] = sum(times1[:2]) * 1e3 - sum(times0[:2]) * 1e3
    cpu_ms["producer_process"] = sum(ns - prod0.get(t, ("", 0))[1] for t, (_, ns) in prod1.items())
    cpu_ms["producer_process"] /= 1e6
    figures = {"engine": meter.summary(), "poll": engine.poll_meter.summary(), "cpu_ms": cpu_ms}
    return {**result, **figures, "counts": engine.counts}
