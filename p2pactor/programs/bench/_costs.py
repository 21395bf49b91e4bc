"""The ``scale`` section's in-process costs (the old ``benchmarks`` scripts'): one JSON line.

``python -m p2pactor.programs.bench._costs --lives N LOG...``, where the logs are a
real run's (the ``scale`` requests' two nodes), measures:

* **event cost** of the pure core, no I/O: a consumer and a producer stepped, as the
  runtime steps them, through N lives of each kind (a lookup answered then closed, a
  lookup then a fetch of its hits; 1 and 16 keys): the median of each input's step
  (decide, and evolve once per event it emits) and the mean per life and role;
* **log append** under each durability policy: the logs' events appended 3 at a time
  from a trio task that goes back to its loop between appends (as an actor step does):
  append p50/p99 and the longest trip through the loop (where the flusher writes);
* **timeline publish**: the logs' events (each with its actor's state after it) fed to
  :meth:`~p2pactor.surface.timeline.Feed.watch` with no subscriber, 10 that read
  everything as the websocket writer does, and 10 that never read: events/s and the
  longest single ``watch`` call.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from itertools import islice
from typing import Any

import trio

from p2pactor.programs.bench._control_common import say

PEER = "10.0.0.2:5710"
EVENTS = 60_000
"""Events (from the logs, cycled) per durability policy and per timeline run."""


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + bytes(4)


def _life(kv: str, nkeys: int, *, fetch: bool, job: int, out: list[Any]) -> None:
    """One request on both sides, each step timed: ``(role, input, seconds)`` to ``out``."""
    from p2pactor.core import effects as fx  # noqa: PLC0415
    from p2pactor.core import inputs as inp  # noqa: PLC0415
    from p2pactor.core.consumer import ConsumerState, step_consumer  # noqa: PLC0415
    from p2pactor.core.ids import ActorId, Role  # noqa: PLC0415
    from p2pactor.core.producer import ProducerState, step_producer  # noqa: PLC0415

    keys = tuple(_key(i) for i in range(nkeys))
    state = {
        "consumer": ConsumerState.new(ActorId(Role.CONSUMER, PEER, kv)),
        "producer": ProducerState.new(ActorId(Role.PRODUCER, PEER, kv)),
    }
    steppers: dict[str, Any] = {"consumer": step_consumer, "producer": step_producer}

    def step(role: str, item: Any) -> list[Any]:
        t0 = time.perf_counter()
        state[role], events = steppers[role](state[role], item, 1.0)
        out.append((role, type(item).__name__, time.perf_counter() - t0))
        return [e for x in events for e in fx.effects_of(x)]

    def sent(effects: list[Any]) -> list[Any]:
        return [e.message for e in effects if isinstance(e, fx.Send)]

    if (open_round := getattr(inp, "Open", None)) is not None:
        step("consumer", open_round(first_round=0))
    (lookup,) = sent(step("consumer", inp.Register(keys, flush=True)))
    ask = next(e for e in step("producer", lookup) if isinstance(e, fx.ParentLookup))
    pin = inp.Pin(job, ask.keys, tuple(range(len(ask.keys))))
    hits = tuple((k, inp.LookupResult.HIT) for k in ask.keys)
    (resp,) = sent(
        step("producer", inp.ParentAnswer(lookup_id=ask.lookup_id, results=hits, pin=pin))
    )
    step("consumer", resp)
    if fetch:
        load = inp.SubmitLoad(job_id=job, keys=keys, block_indexes=tuple(range(nkeys)))
        (fetch_msg,) = sent(step("consumer", load))
        write = next(e for e in step("producer", fetch_msg) if isinstance(e, fx.StartTransfer))
        (done,) = sent(step("producer", inp.TransferResult(transfer_id=write.transfer_id, ok=True)))
        step("consumer", done)
        step("consumer", inp.Finish())
    else:
        (close,) = sent(step("consumer", inp.Finish()))
        step("producer", close)


def event_cost(lives: int) -> dict[str, Any]:
    """Median us per (role, input), and mean us per life and role."""
    steps: list[Any] = []
    gc.disable()  # a collection would land in whichever step runs then
    for r in range(lives):
        for nkeys in (1, 16):
            for fetch in (False, True):
                _life(f"r{r}-{nkeys}-{fetch:d}", nkeys, fetch=fetch, job=1000 + r, out=steps)
        if r % 100 == 0:
            gc.collect()
    gc.enable()
    by_input: dict[str, list[float]] = defaultdict(list)
    per_role: dict[str, float] = defaultdict(float)
    for role, name, took in steps:
        by_input[f"{role} {name}"].append(took)
        per_role[role] += took
    return {
        "inputs": {k: statistics.median(v) * 1e6 for k, v in sorted(by_input.items())},
        "lives": {k: v / (4 * lives) * 1e6 for k, v in per_role.items()},
    }


async def _append_all(log: Any, batches: Sequence[Any]) -> tuple[list[int], int]:
    latencies, stall = [], 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.flush_periodically)
        for batch in batches:
            t0 = time.perf_counter_ns()
            log.append(batch)
            t1 = time.perf_counter_ns()
            await trio.lowlevel.checkpoint()  # the flusher gets its turn here
            latencies.append(t1 - t0)
            stall = max(stall, time.perf_counter_ns() - t1)
        log.close()
    return latencies, stall


def durability(events: Sequence[Any]) -> dict[str, Any]:
    """Append p50/p99 (us) and the longest loop trip (us) per policy."""
    from p2pactor.runtime.log import Durability, EventLog  # noqa: PLC0415

    batches = [events[i : i + 3] for i in range(0, len(events), 3)]
    policies = {
        "ON_CLOSE": (Durability.on_close(), batches),
        "INTERVAL 50 ms": (Durability.interval(0.05), batches),
        "EVERY_EVENT": (Durability.every_event(), batches),
        "INTERVAL 50 ms + fsync": (Durability.interval(0.05, fsync=True), batches[:2000]),
        "EVERY_EVENT + fsync": (Durability.every_event(fsync=True), batches[:2000]),
    }
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (policy, work)) in enumerate(policies.items()):
            log = EventLog("bench", path=f"{tmp}/{i}.log", durability=policy, keep=0)
            lat, stall = trio.run(_append_all, log, work)
            cuts = statistics.quantiles(lat, n=100)
            out[name] = {"p50": cuts[49] / 1e3, "p99": cuts[98] / 1e3, "stall": stall / 1e3}
    return out


async def _publish(steps: Sequence[Any], subscribers: str) -> dict[str, float]:
    from p2pactor.surface.timeline import Feed, FeedFilters, FeedLimits  # noqa: PLC0415

    total = sum(len(events) for events, _ in steps)
    limits = FeedLimits(queue=total + 1000) if subscribers == "reading" else FeedLimits()
    feed = Feed("a:5710", block_len=4096, limits=limits)

    async def drain(sub: Any) -> None:  # as the server's websocket writer does
        while (batch := await sub.next_batch()) is not None:
            if len(batch) < limits.queue // 2:
                await trio.sleep(limits.batch_interval_s)

    worst = 0.0
    async with trio.open_nursery() as nursery:
        subs = [feed.subscribe(FeedFilters()) for _ in range(0 if subscribers == "none" else 10)]
        if subscribers == "reading":
            for sub in subs:
                nursery.start_soon(drain, sub)
        await trio.lowlevel.checkpoint()
        start = time.perf_counter()
        for events, state in steps:
            t0 = time.perf_counter()
            feed.watch(events, state)
            worst = max(worst, time.perf_counter() - t0)
            await trio.lowlevel.checkpoint()  # the node's loop runs the writers
        for sub in subs:
            feed.unsubscribe(sub)  # readers finish what is queued, then stop
    return {"events_per_s": total / (time.perf_counter() - start), "worst_ms": worst * 1e3}


def timeline(events: Sequence[Any]) -> dict[str, Any]:
    """Publishing through a feed with none, 10 reading and 10 stalled subscribers."""
    from p2pactor.core.fold import evolve, initial_state  # noqa: PLC0415

    states: dict[Any, Any] = {}
    steps = []
    for e in events:
        states[e.actor] = evolve(states.get(e.actor) or initial_state(e.actor), e)
        steps.append(((e,), states[e.actor]))
    return {s: trio.run(_publish, steps, s) for s in ("none", "reading", "stalled")}


def main(argv: Sequence[str] | None = None) -> int:
    """Measure all three, print one JSON line."""
    from msgspec.structs import replace  # noqa: PLC0415

    from p2pactor.runtime.logread import read_log  # noqa: PLC0415

    parser = argparse.ArgumentParser(description="the scale section's in-process costs")
    parser.add_argument("--lives", type=int, default=2000, help="lives of each kind")
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args(argv)
    pattern = [e for path in args.logs for e in read_log(path)]

    def cycled(n: int) -> list[Any]:  # fresh request ids each time round
        return [
            replace(e, actor=replace(e.actor, kv_request_id=f"{e.actor.kv_request_id}/{i}"))
            for i in range(n // max(1, len(pattern)) + 1)
            for e in pattern
        ][:n]

    events = cycled(EVENTS)
    say(
        {
            "events": event_cost(args.lives),
            "durability": durability(events),
            "timeline": timeline(list(islice(events, EVENTS))),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
