"""Engine-thread cost of a P2P secondary tier: p2pactor's vLLM adapter against vLLM's own tier.

vLLM calls a secondary tier synchronously from its scheduler thread, under the
offloading manager's lock: whatever the tier does there delays the step. This drives
p2pactor's ``P2PActorTierManager`` and vLLM 0.33's ``P2PSecondaryTierManager`` through
the same scripted scheduler calls and times them on the engine thread, per method and
per step. Per tier class and repeat: a producer tier in a subprocess
(:mod:`~p2pactor.programs.bench._vllm_tier`, serving every 1 ms as vLLM's tier-poll
thread does, over a pool holding every HIT key) and a consumer tier here; real ZeroMQ
and NIXL on 127.0.0.1, 4 KiB blocks.

The scripted engine (:mod:`~p2pactor.programs.bench._vllm_scheduler`), one step at a
time, as vLLM's offloading connector and ``TieringOffloadingManager`` call:

1. ``has_pending_work()``, under a short lock;
2. ``--admit`` new requests (``remote_kv_source`` naming the producer, ``--keys`` keys,
   a prefix of K/2..K on the producer) get ``on_new_request()``;
3. ``schedule()``, under the step lock: ``get_finished_jobs()``, then ``lookup()`` of
   each waiting request's keys in order (past HIT and RETRY, up to the first MISS); a
   request with no RETRY left has its HIT prefix queued as one promotion; then
   ``serve_external_requests(parent)``, a ``submit_load()`` per promotion,
   ``on_schedule_end()``;
4. the forward pass: ``--step-ms`` of sleep, lock released, while the tier-poll thread
   (``--poll-ms``) calls ``get_finished_jobs()`` and ``serve_external_requests()``;
5. each request whose load finished gets ``on_request_finished()``.

A scripted engine, not vLLM's stack, so that each tier's own calls are timed alone
(vLLM's CPU tier, evictions and cascades are left out; a whole engine is
``engine-real``'s). Same requests and rules for both tiers; only how many steps the
answers take differs, so call counts come with the times. Measured: ``perf_counter_ns``
around every tier call on the engine and tier-poll threads, the lock waits, every
thread's CPU (schedstat) by role, the producer's CPU; each repeat runs both tiers
(alternating), fresh processes each.

``p2pactor bench --only engine`` reports the headline figures; every figure:
``python -m p2pactor.programs.bench._vllm_engine`` (``--requests N``, ``--repeats R``,
``--json PATH``, ``--help``), about two minutes. A tier that falls behind shows in the
"steps from admission" rows (waiting keys are looked up again each step, as vLLM does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._control_common import LineProcess, free_port
from p2pactor.programs.bench._vllm_measure import Meter, say, thread_cpu, thread_names
from p2pactor.programs.bench._vllm_report import LABEL, provenance, table
from p2pactor.programs.bench._vllm_scheduler import Engine, make_requests
from p2pactor.programs.bench._vllm_spawn import (
    make_parser,
    spawn_producer,
)

WARMUP_REQUESTS = 8


def run_tier(
    kind: str,
    rep: int,
    args: argparse.Namespace,
    spawned: tuple[LineProcess, int] | None = None,
) -> dict[str, Any]:
    """One producer and one consumer of ``kind``: warm up, measure, tear down.

    ``spawned``: a producer already started, ready and stopped (SIGSTOP), and its port.
    """
    specs = shared.workload(args.requests, args.keys, args.seed)
    consumer_port = free_port()
    if spawned is None:
        producer_port = free_port()
        producer = spawn_producer(kind, producer_port, args)
        producer.wait_ready()
    else:
        # Started, made ready and stopped by main(): let it run again.
        producer, producer_port = spawned
        producer.pause(paused=False)
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
        producer_report = producer.close(timeout=60)

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


def main(
    argv: Sequence[str] | None = None,
    prespawned: dict[str, tuple[LineProcess, int]] | None = None,
) -> int:
    """Run the benchmark and print the table.

    ``prespawned``: the first repeat's producers, already started (and their
    ports) by :mod:`p2pactor.programs.bench._vllm_spawn` while this module imported.
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
        spawned: dict[str, tuple[LineProcess, int]] = {}
        if rep == 0 and prespawned:
            spawned = dict(prespawned)
        elif args.prestart:
            for kind in order:
                port = free_port()
                spawned[kind] = (spawn_producer(kind, port, args), port)
        # A producer waiting for its turn must not run beside the measured
        # one (vLLM's NIXL progress thread spins): ready, then stopped until
        # run_tier continues it.
        for proc, _ in spawned.values():
            proc.wait_ready()
            proc.pause(paused=True)
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

    say(table(runs))
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
            json.dumps({"args": vars(args), "tree": tree, "runs": runs}, indent=2)
        )
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
