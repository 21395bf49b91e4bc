"""Engine-thread cost of a P2P secondary tier: p2pactor's vLLM adapter against vLLM's own tier.

vLLM calls a secondary tier synchronously from its scheduler (engine) thread,
under the offloading manager's lock; whatever the tier does inside those calls
delays the step. This drives p2pactor's ``P2PActorTierManager`` and vLLM
0.33's ``P2PSecondaryTierManager`` through the same scripted sequence of
scheduler calls and reports the time spent inside tier calls on the engine
thread, per method and per step, both tiers side by side.

Setup, per tier class and per repeat: a *producer* tier in a subprocess
(``python -m p2pactor.bench._vllm_tier``: it only serves, calling
``get_finished_jobs()`` and ``serve_external_requests(parent)`` every 1 ms like
vLLM's tier-poll thread, over a pool holding every HIT key), and a *consumer*
tier of the same class in this process. Real ZeroMQ and NIXL (UCX) on
127.0.0.1; 4 KiB blocks so that the data plane is not what is measured.

The scripted engine, one step at a time, in the order vLLM's offloading
connector and ``TieringOffloadingManager`` make the calls:

1. ``has_pending_work()`` (the engine's liveness check), under a short lock;
2. ``add_request``: ``--admit`` new requests (``remote_kv_source`` naming the
   producer, ``--keys`` keys, of which a prefix of K/2..K, 75% on average, is on
   the producer) get ``on_new_request()``, each under a short lock;
3. ``schedule()``, under the step lock: ``get_finished_jobs()`` once, then
   ``lookup()`` of each waiting request's keys in order, skipping keys already
   answered HIT (the primary tier holds them once promoted), going on past
   RETRY and stopping at the first MISS; a request with no RETRY left gets
   its HIT prefix queued as one promotion (chunks from a free list);
   then ``serve_external_requests(parent)``, one ``submit_load()`` per queued
   promotion, and ``on_schedule_end()``;
4. the model's forward pass: ``--step-ms`` of sleep with the lock released,
   while the tier-poll thread (``--poll-ms``, 0 to turn it off) calls
   ``get_finished_jobs()`` and ``serve_external_requests()`` under the lock;
5. output processing: each request whose load finished (or that had nothing
   to load) gets ``on_request_finished()``, under a short lock, and frees its
   chunks.

The run ends when every request has finished. The sequence is the same for
both tiers (same requests, same admission schedule, same rules); only how many
steps the answers and loads take depends on the tier, so call counts are
reported with the times. A few warm-up requests go first (the handshake); they
are reported apart.

Measured: ``time.perf_counter_ns`` around every tier call on the engine thread
(and, apart, on the tier-poll thread), plus the engine's waits for the lock;
the CPU time of every thread of this process from
``/proc/self/task/*/schedstat`` (ns), split into the engine thread, the
tier-poll thread, the threads the consumer tier started (p2pactor's trio
thread, NIXL/UCX threads, vLLM's registration executor) and the rest; the
producer process's CPU time. Each repeat runs both tiers (alternating which
goes first), each with a fresh producer and consumer; the table gives the
median across repeats and, in brackets, the min and max.

``p2pactor bench --only engine`` runs it (in a subprocess) and reports its
headline figures; for every figure, run it with vLLM installed:
``python -m p2pactor.bench._vllm_engine`` (or the wrapper
``benchmarks/vllm_engine_thread.py``) (``--requests N``,
``--repeats R``, ``--json PATH``; ``--help`` for the rest). About two minutes
at the defaults on two cores (longer when a tier falls behind). The default
load is 2 new requests per 10 ms step: 200 requests/s, 3,200 keys/s; raise
``--admit`` for more. A tier that falls behind shows it in the "steps from
admission" rows: like vLLM's scheduler, the script looks every waiting
request's unanswered keys up again each step, so a tier's engine-thread time
grows with its backlog, as it would in an engine.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import TransferJob

from p2pactor.bench import _vllm_tier as shared
from p2pactor.bench._control_common import TIER_METHODS, free_port
from p2pactor.bench._vllm_spawn import make_parser, spawn_producer

LABEL = {"ours": "p2pactor", "vllm": "vLLM"}
WARMUP_REQUESTS = 8
RUN_TIMEOUT_S = 300.0


def say(line: str = "") -> None:
    """Print one line of the report."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


# --- CPU accounting -------------------------------------------------------------------


def thread_cpu(pid: int | str = "self") -> dict[int, int]:
    """Nanoseconds on CPU of every thread of ``pid``, by thread id."""
    out: dict[int, int] = {}
    base = Path(f"/proc/{pid}/task")
    try:
        tids = os.listdir(base)
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = int((base / tid / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
    return out


def thread_names() -> dict[int, str]:
    """Names of this process's threads: Python's where it knows them, else the kernel's."""
    names: dict[int, str] = {}
    for tid in thread_cpu():
        try:
            names[tid] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except FileNotFoundError:
            continue
    for t in threading.enumerate():
        if t.native_id is not None:
            names[t.native_id] = t.name
    return names


# --- measurement ------------------------------------------------------------------------


class Meter:
    """Wall time of tier calls made by one thread, by method, per call and per step."""

    def __init__(self) -> None:
        self.calls: dict[str, array[int]] = {m: array("q") for m in TIER_METHODS}
        self.steps: list[dict[str, int]] = []
        self._step: dict[str, int] = dict.fromkeys(TIER_METHODS, 0)
        self.lock_wait: array[int] = array("q")

    def call(self, method: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)``, timing it as ``method``."""
        t0 = time.perf_counter_ns()
        result = fn(*args)
        dt = time.perf_counter_ns() - t0
        self.calls[method].append(dt)
        self._step[method] += dt
        return result

    def acquire(self, lock: threading.Lock) -> None:
        """Take ``lock``, timing the wait."""
        t0 = time.perf_counter_ns()
        lock.acquire()
        self.lock_wait.append(time.perf_counter_ns() - t0)

    def end_step(self) -> None:
        """Close the current step."""
        self.steps.append(self._step)
        self._step = dict.fromkeys(TIER_METHODS, 0)

    def summary(self) -> dict[str, Any]:
        """Totals and distributions, in microseconds (totals in milliseconds)."""
        per_step = [sum(s.values()) / 1e3 for s in self.steps]
        methods: dict[str, dict[str, float]] = {}
        for m in TIER_METHODS:
            calls = self.calls[m]
            steps = [s[m] / 1e3 for s in self.steps]
            methods[m] = {
                "calls": len(calls),
                "total_ms": sum(calls) / 1e6,
                "call_mean_us": (sum(calls) / len(calls) / 1e3) if calls else 0.0,
                "call_p50_us": pct(calls, 0.5) / 1e3,
                "call_p99_us": pct(calls, 0.99) / 1e3,
                "call_max_us": max(calls, default=0) / 1e3,
                "step_mean_us": statistics.fmean(steps) if steps else 0.0,
                "step_p99_us": pct(steps, 0.99),
                "step_max_us": max(steps, default=0.0),
            }
        return {
            "steps": len(self.steps),
            "tier_ms": sum(sum(c) for c in self.calls.values()) / 1e6,
            "step_mean_us": statistics.fmean(per_step) if per_step else 0.0,
            "step_p50_us": pct(per_step, 0.5),
            "step_p99_us": pct(per_step, 0.99),
            "step_max_us": max(per_step, default=0.0),
            "lock_wait_ms": sum(self.lock_wait) / 1e6,
            "lock_wait_max_us": max(self.lock_wait, default=0) / 1e3,
            "methods": methods,
        }


# --- the scripted engine -------------------------------------------------------------------


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


def start_producer(kind: str, port: int, args: argparse.Namespace) -> subprocess.Popen[str]:
    """Start the producer process and wait until its tier is up."""
    return wait_ready(kind, spawn_producer(kind, port, args))


def wait_ready(kind: str, proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """Wait until the producer ``proc`` says READY; kill it if it says anything else."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"the {kind} producer did not start (it said {line!r})")
    return proc


def stop_producer(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Close the producer's stdin and collect its counters."""
    try:
        out, _ = proc.communicate(input="", timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {}
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    return {}


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


def run_tier(
    kind: str,
    rep: int,
    args: argparse.Namespace,
    spawned: tuple[subprocess.Popen[str], int] | None = None,
) -> dict[str, Any]:
    """One producer and one consumer of ``kind``: warm up, measure, tear down.

    ``spawned``: a producer already started, ready and stopped (SIGSTOP), and its port.
    """
    specs = shared.workload(args.requests, args.keys, args.seed)
    consumer_port = free_port()
    if spawned is None:
        producer_port = free_port()
        producer = start_producer(kind, producer_port, args)
    else:
        # Started, made ready and stopped by main(): let it run again.
        producer, producer_port = spawned
        os.kill(producer.pid, signal.SIGCONT)
    try:
        before_tier = set(thread_cpu())
        pool = shared.make_pool(args.consumer_blocks, args.block_bytes)
        t0 = time.perf_counter()
        tier = shared.make_tier(kind, pool, consumer_port)
        construct_s = time.perf_counter() - t0
        engine = Engine(tier, pool, args)
        engine.start_polling()
        try:
            warm = Meter()
            warm_specs = specs[:WARMUP_REQUESTS]
            warm_run = engine.run(
                make_requests(kind, f"warm{rep}", warm_specs, producer_port), warm
            )
            engine.counts = dict.fromkeys(engine.counts, 0)
            engine.poll_meter = Meter()
            engine.poll_rounds = 0
            requests = make_requests(kind, f"run{rep}", specs, producer_port)

            cpu0, prod0, times0 = thread_cpu(), thread_cpu(producer.pid), os.times()
            meter = Meter()
            result = engine.run(requests, meter)
            cpu1, prod1, times1 = thread_cpu(), thread_cpu(producer.pid), os.times()
            names = thread_names()
        finally:
            engine.stop_polling()
            t1 = time.perf_counter()
            tier.shutdown()
            shutdown_s = time.perf_counter() - t1
    finally:
        producer_report = stop_producer(producer)

    engine_tid = threading.main_thread().native_id
    poll_tid = engine.poll_tid()
    delta = {tid: cpu1[tid] - cpu0.get(tid, 0) for tid in cpu1}
    groups = {"engine": 0, "poll": 0, "tier": 0, "other": 0}
    tier_threads: dict[str, float] = {}
    for tid, ns in delta.items():
        if tid == engine_tid:
            groups["engine"] += ns
        elif tid == poll_tid:
            groups["poll"] += ns
        elif tid not in before_tier:
            groups["tier"] += ns
            name = names.get(tid, str(tid))
            tier_threads[name] = tier_threads.get(name, 0.0) + ns / 1e6
        else:
            groups["other"] += ns
    process_cpu_ms = ((times1.user - times0.user) + (times1.system - times0.system)) * 1e3
    return {
        "tier": kind,
        "repeat": rep,
        "wall_s": result["wall_s"],
        "latency_steps": {k: v for k, v in result.items() if k.startswith("steps_")},
        "construct_s": construct_s,
        "shutdown_s": shutdown_s,
        "engine": meter.summary(),
        "poll": {**engine.poll_meter.summary(), "rounds": engine.poll_rounds},
        "cpu_ms": {
            "engine_thread": groups["engine"] / 1e6,
            "poll_thread": groups["poll"] / 1e6,
            "tier_threads": groups["tier"] / 1e6,
            "other_threads": groups["other"] / 1e6,
            "process": process_cpu_ms,
            "producer_process": (sum(prod1.values()) - sum(prod0.get(t, 0) for t in prod1)) / 1e6,
        },
        "tier_threads_cpu_ms": dict(sorted(tier_threads.items(), key=lambda kv: -kv[1])),
        "counts": engine.counts,
        "warmup": {
            "requests": len(warm_specs),
            "wall_s": warm_run["wall_s"],
            "steps": len(warm.steps),
            "tier_ms": warm.summary()["tier_ms"],
            "step_max_us": warm.summary()["step_max_us"],
        },
        "producer": producer_report,
    }


# --- the report -------------------------------------------------------------------------------


def _get(run: dict[str, Any], path: str) -> float:
    value: Any = run
    for part in path.split("."):
        value = value[part]
    return float(value)


ROWS: list[tuple[str, str, str]] = [
    ("steps", "engine.steps", "{:.0f}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
    ("steps from admission to answers, mean", "latency_steps.steps_to_answer_mean", "{:.2f}"),
    ("steps from admission to answers, max", "latency_steps.steps_to_answer_max", "{:.0f}"),
    ("steps from admission to finish, mean", "latency_steps.steps_to_finish_mean", "{:.2f}"),
    ("steps from admission to finish, max", "latency_steps.steps_to_finish_max", "{:.0f}"),
    ("ENGINE THREAD: time in tier calls (ms)", "engine.tier_ms", "{:.1f}"),
    ("  per step, mean (us)", "engine.step_mean_us", "{:.0f}"),
    ("  per step, p50 (us)", "engine.step_p50_us", "{:.0f}"),
    ("  per step, p99 (us)", "engine.step_p99_us", "{:.0f}"),
    ("  per step, max (us)", "engine.step_max_us", "{:.0f}"),
    *[
        row
        for m in TIER_METHODS
        for row in (
            (f"  {m}: total (ms)", f"engine.methods.{m}.total_ms", "{:.2f}"),
            (f"  {m}: calls", f"engine.methods.{m}.calls", "{:.0f}"),
            (f"  {m}: mean per call (us)", f"engine.methods.{m}.call_mean_us", "{:.1f}"),
            (f"  {m}: p99 per call (us)", f"engine.methods.{m}.call_p99_us", "{:.1f}"),
            (f"  {m}: max per call (us)", f"engine.methods.{m}.call_max_us", "{:.0f}"),
        )
    ],
    ("  waiting for the lock (ms)", "engine.lock_wait_ms", "{:.2f}"),
    ("  longest lock wait (us)", "engine.lock_wait_max_us", "{:.0f}"),
    ("POLL THREAD: time in tier calls (ms)", "poll.tier_ms", "{:.1f}"),
    ("  rounds", "poll.rounds", "{:.0f}"),
    ("  get_finished_jobs (ms)", "poll.methods.get_finished_jobs.total_ms", "{:.1f}"),
    ("  serve_external_requests (ms)", "poll.methods.serve_external_requests.total_ms", "{:.1f}"),
    ("CPU (ms): engine thread, all of it", "cpu_ms.engine_thread", "{:.0f}"),
    ("  tier-poll thread", "cpu_ms.poll_thread", "{:.0f}"),
    ("  the tier's own threads", "cpu_ms.tier_threads", "{:.0f}"),
    ("  other threads of this process", "cpu_ms.other_threads", "{:.0f}"),
    ("  this process (os.times)", "cpu_ms.process", "{:.0f}"),
    ("  producer process", "cpu_ms.producer_process", "{:.0f}"),
    ("loads ok", "counts.loads_ok", "{:.0f}"),
    ("loads failed", "counts.loads_failed", "{:.0f}"),
    ("keys loaded", "counts.keys_loaded", "{:.0f}"),
    ("blocks with wrong bytes", "counts.bad_blocks", "{:.0f}"),
    ("warm-up: wall (ms)", "warmup.wall_s", "{:.0f}"),
    ("warm-up: engine time in tier calls (ms)", "warmup.tier_ms", "{:.1f}"),
    ("consumer construction (s)", "construct_s", "{:.2f}"),
    ("consumer shutdown (s)", "shutdown_s", "{:.2f}"),
]
SCALE = {"warmup.wall_s": 1e3}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max across repeats of every row."""
    out: dict[str, dict[str, float]] = {}
    for _, path, _ in ROWS:
        values = [_get(r, path) * SCALE.get(path, 1.0) for r in runs]
        out[path] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
    return out


def table(summary: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """Median [min..max] per tier, side by side, and the ratio of the medians ours/vLLM."""

    def cell(stats: dict[str, float], fmt: str) -> str:
        med, lo, hi = (fmt.format(stats[k]) for k in ("median", "min", "max"))
        return med if lo == hi else f"{med} [{lo}..{hi}]"

    tiers = [t for t in shared.TIERS if t in summary]
    both = len(tiers) == len(shared.TIERS)
    header = f"{'':42}" + "".join(f" {LABEL[t]:>26}" for t in tiers)
    header += f" {'ours/vLLM':>10}" if both else ""
    lines = [header, "-" * len(header)]
    for label, path, fmt in ROWS:
        line = f"{label:42}" + "".join(f" {cell(summary[t][path], fmt):>26}" for t in tiers)
        if both:
            ours, theirs = summary["ours"][path]["median"], summary["vllm"][path]["median"]
            ratio = f"{ours / theirs:.2f}" if theirs else ("-" if not ours else "inf")
            line += f" {ratio:>10}"
        lines.append(line)
    return lines


def provenance() -> dict[str, str]:
    """The commit, whether the tree differs from it, and digests of the files measured."""
    import p2pactor.adapters.vllm as adapter  # noqa: PLC0415
    from p2pactor import node  # noqa: PLC0415

    root = Path(__file__).resolve().parents[2]
    out: dict[str, str] = {}
    for key, cmd in (
        ("commit", ["git", "rev-parse", "--short", "HEAD"]),
        ("dirty", ["git", "status", "--porcelain", "--untracked-files=no"]),
    ):
        try:
            done = subprocess.run(  # noqa: S603 - fixed git commands
                cmd, cwd=root, capture_output=True, text=True, check=False
            )
            out[key] = done.stdout.strip()
        except OSError:
            out[key] = "?"
    out["dirty"] = "yes" if out["dirty"] not in ("", "?") else "no"
    for name, module in (("adapters/vllm.py", adapter), ("p2pactor/node.py", node)):
        path = Path(str(module.__file__))
        if path.exists():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return out


def main(
    argv: Sequence[str] | None = None,
    prespawned: dict[str, tuple[subprocess.Popen[str], int]] | None = None,
) -> int:
    """Run the benchmark and print the table.

    ``prespawned``: the first repeat's producers, already started (and their
    ports) by :mod:`p2pactor.bench._vllm_launch` while this module imported.
    """
    parser = make_parser()
    args = parser.parse_args(argv)
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if any(t not in shared.TIERS for t in tiers):
        parser.error(f"--tiers takes a list of {shared.TIERS}")

    specs = shared.workload(args.requests, args.keys, args.seed)
    hit_keys = sum(s.hits for s in specs)
    say(
        f"{args.requests} requests x {args.keys} keys ({hit_keys} HIT = "
        f"{hit_keys / (args.requests * args.keys):.0%}), {args.block_bytes} B blocks, "
        f"{args.admit} admitted per step, {args.step_ms:g} ms forward pass, tier-poll "
        f"{'every ' + format(args.poll_ms, 'g') + ' ms' if args.poll_ms > 0 else 'off'}; "
        f"{args.repeats} repeats, {os.cpu_count()} CPUs, PYTHONHASHSEED="
        f"{os.environ['PYTHONHASHSEED']}"
    )
    runs: dict[str, list[dict[str, Any]]] = {t: [] for t in tiers}
    started = time.perf_counter()
    for rep in range(args.repeats):
        order = tiers if rep % 2 == 0 else list(reversed(tiers))
        # --prestart (quick runs): every producer of the repeat starts at once,
        # so their imports overlap; an idle producer then polls beside the run.
        spawned: dict[str, tuple[subprocess.Popen[str], int]] = {}
        if rep == 0 and prespawned:
            spawned = dict(prespawned)
        elif args.prestart:
            for kind in order:
                port = free_port()
                spawned[kind] = (spawn_producer(kind, port, args), port)
        # A producer waiting for its turn must not run beside the measured
        # one (vLLM's NIXL progress thread spins): ready, then stopped until
        # run_tier continues it.
        for kind, (proc, _) in spawned.items():
            wait_ready(kind, proc)
            os.kill(proc.pid, signal.SIGSTOP)
        for kind in order:
            run = run_tier(kind, rep, args, spawned.get(kind))
            runs[kind].append(run)
            e = run["engine"]
            say(
                f"  repeat {rep + 1} {LABEL[kind]:>8}: {e['steps']} steps, "
                f"{run['wall_s']:.2f} s, engine thread in tier calls {e['tier_ms']:.1f} ms "
                f"(step p99 {e['step_p99_us']:.0f} us), loads ok {run['counts']['loads_ok']}"
                f"/failed {run['counts']['loads_failed']}, tier threads "
                f"{run['cpu_ms']['tier_threads']:.0f} ms CPU"
            )
    say(f"({time.perf_counter() - started:.0f} s in all)")
    say()

    summary = {t: aggregate(rs) for t, rs in runs.items()}
    for line in table(summary):
        say(line)
    for kind, rs in runs.items():
        threads: dict[str, list[float]] = {}
        for r in rs:
            for name, ms in r["tier_threads_cpu_ms"].items():
                threads.setdefault(name, []).append(ms)
        listed = ", ".join(f"{n} {statistics.median(v):.0f}" for n, v in threads.items())
        say(f"{LABEL[kind]} tier threads, CPU ms (median): {listed or 'none'}")
    tree = provenance()
    say("measured: " + ", ".join(f"{k} {v}" for k, v in tree.items()))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "tree": tree, "summary": summary, "runs": runs}, indent=2
            )
        )
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
