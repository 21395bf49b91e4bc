"""The vLLM side of the vLLM comparisons (``engine``, ``control``): tiers, producers, an engine.

:func:`make_tier` makes p2pactor's or vLLM 0.33's P2P tier over a pool from a real
``TieringOffloadingSpec``; :func:`serve` is a producer, its tier serving peers from an
:class:`~p2pactor.runtime.parent.EmbeddedCache` until its stdin closes. Run as ``python -m
p2pactor.programs.bench._vllm_tier JSON`` (:func:`main`) it is the ``engine`` section's
producer. The consumer is the scripted :class:`Engine`, making the calls vLLM's
offloading connector and ``TieringOffloadingManager`` make of a secondary tier (numbered
in :meth:`Engine.run`), each timed by a :class:`Meter`.

Importing it sets the environment vLLM sets (unless set) and seeds vLLM's ``NONE_HASH``
as an engine does at start-up: import it only where vLLM is.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("PYTHONHASHSEED", "0")
# What vLLM sets before it imports NIXL; set here so that both tiers run UCX
# alike whichever of them imports NIXL first in a process.
os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")

import numpy as np
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.base import (
    LookupResult,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob

from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.programs.bench._control_common import (
    free_port,
    held,
    offload_key,
    percentile,
    say,
)
from p2pactor.programs.vllmstack import StackOptions, spec_of, tier_entry
from p2pactor.runtime.parent import EmbeddedCache

init_none_hash(sha256)


HOST = "127.0.0.1"
"""Every benchmark process binds here."""
STAMP = struct.Struct("<II")
"""(request, key) at the head of every producer block, checked after each load."""
BLOCK_BYTES = 4096
"""Bytes per block of the engine section's pools."""


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: its keys, of which the first ``hits`` are on the producer."""

    index: int
    keys: tuple[bytes, ...]
    hits: int


def workload(requests: int, keys_per_request: int) -> list[RequestSpec]:
    """The deterministic workload: each request's HIT prefix is uniform in [K/2, K] (75% hit)."""
    rng, k = random.Random(0), keys_per_request  # noqa: S311 - reproducible, not a secret
    keys = [
        tuple(offload_key(f"p2pactor-bench/{i}/{j}") for j in range(k)) for i in range(requests)
    ]
    return [RequestSpec(i, keys[i], rng.randint(k // 2, k)) for i in range(requests)]


_AS_VLLM = {answer: LookupResult[answer.name] for answer in Answer}
"""Our cache's answers as vLLM's (a dict: as cheap per key as the lookup itself)."""


class CacheParent(ParentManager):  # type: ignore[misc] # vLLM's types are Any to mypy
    """VLLM's ``ParentManager`` over an :class:`~p2pactor.runtime.parent.EmbeddedCache`.

    Our producer node serves from the same class: both sides do the same work per key.
    """

    def __init__(self, cache: EmbeddedCache) -> None:
        self.cache = cache

    def on_new_request(self, req_context: Any) -> Any:
        """Open the synthetic request of a peer's lookup."""
        self.cache.on_new_request(req_context.req_id)
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: Any) -> Any:
        """The cache's answer, as vLLM's LookupResult."""
        return _AS_VLLM[self.cache.lookup(bytes(key), req_context.req_id)]

    def create_store_job(self, keys: Any, req_context: Any) -> Any:
        """Pin the blocks of ``keys``; the tier reports the job when it lets go."""
        keys = [bytes(k) for k in keys]
        pin = self.cache.create_store_job(keys, req_context.req_id)
        chunks = np.array(pin.blocks, dtype=np.int64)
        return TransferJob(
            job_id=pin.job_id,
            keys=keys,
            chunk_ids=chunks,
            is_promotion=False,
            req_context=req_context,
        )

    def on_request_finished(self, req_context: Any) -> None:
        """Close the synthetic request."""
        self.cache.on_request_finished(req_context.req_id)


def make_tier(kind: str, pool: Any, port: int) -> Any:
    """A tier over ``pool`` (a row per chunk) on ``HOST:port``: ``ours``, else vLLM 0.33's."""
    entry = tier_entry("ours" if kind == "ours" else "stock", HOST, port)
    options = StackOptions(
        tiers=[entry],
        num_chunks=pool.shape[0],
        chunk_bytes=pool.shape[1],
        engine_id="p2pactor-bench",
    )
    spec = spec_of(options)  # what vLLM hands its tiers: one full-attention group, TP=1
    if kind == "ours":
        from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415

        return P2PActorTierManager(spec, memoryview(pool), host=HOST, port=port)
    from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager  # noqa: PLC0415

    return P2PSecondaryTierManager(spec, memoryview(pool), host=HOST, port=port)


def serve(tier: Any, cache: EmbeddedCache, wait: Callable[[], object]) -> None:
    """Serve peers from ``cache`` after each ``wait()`` until stdin closes; say :func:`held`."""
    parent = CacheParent(cache)
    stop = threading.Event()

    def watch() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    while not stop.is_set():
        wait()
        for result in tier.get_finished_jobs():
            cache.release_job(int(result.job_id), success=bool(result.success))
        tier.serve_external_requests(parent)
    tier.shutdown()
    say(held(cache))


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

    def __init__(self, spec: RequestSpec, kind: str, tag: str, port: int) -> None:
        self.spec = spec
        source = {"remote_host": HOST, "remote_port": port}
        source["kv_request_id"] = f"{kind}-{tag}-{spec.index}"
        params = {"remote_kv_source": source}
        self.ctx = ReqContext(req_id=f"req-{tag}-{spec.index}", kv_transfer_params=params)
        self.answers: list[LookupResult | None] = [None] * len(spec.keys)
        self.chunks: list[int] = []


class Engine:
    """The consumer side: a tier driven as vLLM's scheduler drives it."""

    def __init__(self, tier: Any, pool: np.ndarray, args: argparse.Namespace) -> None:
        self.tier, self.pool, self.args = tier, pool, args
        self.parent = CacheParent(EmbeddedCache(1, 1))  # it holds nothing to serve
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
                stamp = STAMP.pack(req.spec.index, j)
                self.bad += self.pool[chunk, : STAMP.size].tobytes() != stamp
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
            time.sleep(args.step_ms / 1000)  # 4. the forward pass (the poll thread runs)
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

    The figures: engine and poll threads' ms in tier calls, the steps' p99 in them (us),
    ``bad``: failed loads and blocks with wrong bytes.
    """
    specs = workload(args.requests, args.keys)
    try:
        pool = np.zeros((4096, BLOCK_BYTES), dtype=np.uint8)
        tier = make_tier(kind, pool, free_port())
        engine = Engine(tier, pool, args)
        engine.poller.start()
        try:
            engine.run([Request(s, kind, "warm", port) for s in specs[:8]], Meter())
            engine.bad, engine.poll_meter, meter = 0, Meter(), Meter()
            engine.run([Request(s, kind, "run", port) for s in specs], meter)
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
        "bad": engine.bad,
    }


def main() -> int:
    """The engine section's producer (JSON: ``tier``, ``port``, the workload), until EOF."""
    args = json.loads(sys.argv[1])
    requests = workload(args["requests"], args["keys"])
    pool = np.zeros((max(1, sum(r.hits for r in requests)), BLOCK_BYTES), dtype=np.uint8)
    cache = EmbeddedCache(pool.shape[0], BLOCK_BYTES, memory=pool.data.cast("B"))
    for r in requests:
        for j in range(r.hits):
            cache.store(r.keys[j], STAMP.pack(r.index, j).ljust(BLOCK_BYTES, b"\0"))
    tier = make_tier(args["tier"], pool, args["port"])
    say("READY")
    serve(tier, cache, lambda: time.sleep(args["poll_ms"] / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
