"""What does the live timeline cost a node: publishing with 0 and with 10 subscribers.

Two measurements, each repeated (median, min and max reported):

* **publish**: ``Feed.watch`` (what ``Node.watch_events`` calls after every actor
  step) fed the steps a real run recorded (two nodes on the in-memory
  transports, requests that look up and fetch 8 blocks), replayed in a loop in
  one trio run. Subscribers: none; 10 that read everything (each takes its
  messages in batches as the websocket writer does, JSON included, on the same
  thread, as in the server; their queues hold the whole run, so that every
  event is delivered); 10 that never read (their queues of 1,000 fill; events
  are dropped and counted). Reported: events/s over the whole loop (publishing plus
  the subscribers' reading), and the longest single step's ``watch`` call: the
  most the feed can hold up the node's loop at once.
* **node**: two nodes (in-memory transports) run requests, 16 at a time, with
  each node's dashboard on (real TCP on loopback) and 0 or 10 real websocket
  subscribers per node, in a separate client process that reads and discards.
  Reported: requests/s, events/s (both nodes' events), the nodes' process CPU
  time per request (the client process's is not in it), the loop stall (how
  late a 1 ms ticker in the nodes' trio run woke, p99 and max), and the events
  dropped for subscribers.

Run it from the repository root: ``.venv/bin/python benchmarks/timeline_cost.py``
(about a minute on two cores); ``--quick`` is smaller; ``--json PATH`` also
writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio
import trio.lowlevel

# Run as a script from the repository root: make p2pactor and tests importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState
from p2pactor.runtime.quotas import PeerQuotas
from p2pactor.surface.timeline import Feed, FeedFilters, FeedLimits, Subscriber
from tests.cluster import Cluster, key, open_cluster
from tests.test_node import pull

ROOT = Path(__file__).resolve().parent.parent
KEYS = 8
CONCURRENCY = 16
# Every block of b may be pinned by a at once: 16 requests of 8 blocks in flight.
NODES: dict[str, Any] = {"num_blocks": 256, "quotas": PeerQuotas(pinned_blocks_fraction=1.0)}

Step = tuple[Sequence[ev.AnyEvent], ActorState]


def say(line: str) -> None:
    """Print one line of the report."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def show(label: str, figures: dict[str, float], unit: str, scale: float = 1.0) -> str:
    """``label median unit (min, max)``."""
    return (
        f"{label} {figures['median'] * scale:,.1f} {unit} "
        f"(min {figures['min'] * scale:,.1f}, max {figures['max'] * scale:,.1f})"
    )


# --- the workload ---------------------------------------------------------------------


async def run_requests(cluster: Cluster, count: int, prefix: str) -> None:
    """``count`` requests from a to b, ``CONCURRENCY`` at a time."""
    limiter = trio.CapacityLimiter(CONCURRENCY)

    async def one(i: int) -> None:
        async with limiter:
            keys = [key(i % 4 * KEYS + k) for k in range(KEYS)]
            assert await pull("a", cluster, "b", f"{prefix}-{i}", keys) == KEYS
            cluster["a"].node.finish(f"{prefix}-{i}")

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)


async def record_steps(requests: int) -> list[Step]:
    """The steps (events and state after them) node a took in a real run."""
    steps: list[Step] = []
    async with open_cluster("a", "b", **NODES) as cluster:
        cluster["b"].store(*[key(i) for i in range(4 * KEYS)])
        cluster["a"].node.watch_events(lambda events, state: steps.append((tuple(events), state)))
        await run_requests(cluster, requests, "rec")
    return steps


# --- publish --------------------------------------------------------------------------


async def publish_once(steps: list[Step], total: int, subscribers: str) -> dict[str, float]:
    """Replay ``steps`` through a fresh feed until ``total`` events went by."""
    # Readers get a queue that holds a whole run: this measures what delivering
    # every event costs (the publisher here outpaces any real node).
    queue = total + 1000 if subscribers == "reading" else FeedLimits().queue
    feed = Feed("a:5710", block_len=4096, limits=FeedLimits(queue=queue))
    subs: list[Subscriber] = []
    count = 0 if subscribers == "none" else 10
    received = [0]

    async def drain(subscriber: Subscriber) -> None:
        # As the server's writer does: take what is queued, then (caught up)
        # let events gather for batch_interval_s.
        limits = feed.limits
        while (batch := await subscriber.next_batch()) is not None:
            received[0] += len(batch)
            if len(batch) < limits.queue // 2:
                await trio.sleep(limits.batch_interval_s)

    worst = 0.0
    published = 0
    async with trio.open_nursery() as nursery:
        for _ in range(count):
            subscriber = feed.subscribe(FeedFilters())
            subs.append(subscriber)
            if subscribers == "reading":
                nursery.start_soon(drain, subscriber)
        await trio.lowlevel.checkpoint()
        start = time.perf_counter()
        while published < total:
            for events, state in steps:
                t0 = time.perf_counter()
                feed.watch(events, state)
                worst = max(worst, time.perf_counter() - t0)
                published += len(events)
                await trio.lowlevel.checkpoint()  # the node's loop runs the writers
        for subscriber in subs:
            feed.unsubscribe(subscriber)  # readers finish what is queued, then stop
    elapsed = time.perf_counter() - start
    stats = feed.stats()
    return {
        "events_per_s": published / elapsed,
        "worst_step_s": worst,
        "dropped_per_subscriber": stats.dropped / max(count, 1),
        "received_per_subscriber": received[0] / max(count, 1),
    }


def publish(steps: list[Step], total: int, repeats: int) -> dict[str, Any]:
    """:func:`publish_once` for each kind of subscribers, ``repeats`` times."""
    report: dict[str, Any] = {}
    for subscribers in ("none", "reading", "stalled"):
        runs = [trio.run(publish_once, steps, total, subscribers) for _ in range(repeats)]
        report[subscribers] = {name: spread([r[name] for r in runs]) for name in runs[0]}
    return report


# --- through a node -------------------------------------------------------------------


def clients_main(urls: list[str], per_feed: int) -> None:
    """The client process: ``per_feed`` websockets on each URL, read and discarded."""
    from trio_websocket import ConnectionClosed, open_websocket_url  # noqa: PLC0415

    async def client(url: str, counts: list[int]) -> None:
        try:
            async with open_websocket_url(url) as ws:
                while True:
                    await ws.get_message()
                    counts[0] += 1
        except ConnectionClosed:
            pass

    async def main() -> None:
        counts = [0]
        async with trio.open_nursery() as nursery:
            for url in urls:
                for _ in range(per_feed):
                    nursery.start_soon(client, url, counts)
            say("CONNECTING")
        say(f"RECEIVED {counts[0]}")

    trio.run(main)


async def ticker(lateness: list[float], stop: trio.Event) -> None:
    """Sleep 1 ms again and again; record how late each wake-up was."""
    while not stop.is_set():
        asked = trio.current_time() + 0.001
        await trio.sleep_until(asked)
        lateness.append(trio.current_time() - asked)


async def node_once(requests: int, per_feed: int) -> dict[str, float]:
    """One run of two nodes with ``per_feed`` websocket subscribers on each."""
    lateness: list[float] = []
    async with open_cluster("a", "b", dashboard_port=0, **NODES) as cluster:
        cluster["b"].store(*[key(i) for i in range(4 * KEYS)])
        boards = [cluster[n].surface.dashboard for n in ("a", "b")]
        assert all(b is not None for b in boards)
        feeds = [b.feed for b in boards if b is not None and b.feed is not None]
        process: trio.Process | None = None
        if per_feed:
            urls = [b.events_url for b in boards if b is not None]
            process = await trio.lowlevel.open_process(
                [sys.executable, __file__, "--clients", str(per_feed), *urls],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
            )
            with trio.fail_after(60):
                while sum(f.stats().subscribers for f in feeds) < per_feed * len(feeds):  # noqa: ASYNC110
                    await trio.sleep(0.05)
        await run_requests(cluster, 20, "warm")  # sessions up, caches warm
        before = sum(f.stats().events for f in feeds)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker, lateness, stop)
            start = time.perf_counter()
            cpu = time.process_time()
            await run_requests(cluster, requests, "run")
            cpu = time.process_time() - cpu
            elapsed = time.perf_counter() - start
            stop.set()
        events = sum(f.stats().events for f in feeds) - before
        dropped = sum(f.stats().dropped for f in feeds)
        if process is not None:
            process.terminate()
            await process.wait()
    lateness.sort()
    return {
        "requests_per_s": requests / elapsed,
        "cpu_per_request_s": cpu / requests,
        "events_per_s": events / elapsed,
        "stall_p99_s": lateness[int(0.99 * (len(lateness) - 1))],
        "stall_max_s": lateness[-1],
        "dropped": float(dropped),
    }


def through_node(requests: int, repeats: int) -> dict[str, Any]:
    """:func:`node_once` with 0 and 10 subscribers per node, ``repeats`` times."""
    report: dict[str, Any] = {}
    for per_feed in (0, 10):
        runs = [trio.run(node_once, requests, per_feed) for _ in range(repeats)]
        report[f"{per_feed}_subscribers"] = {
            name: spread([r[name] for r in runs]) for name in runs[0]
        }
    return report


# --- main -----------------------------------------------------------------------------


def main() -> None:
    """Run the benchmark and print (and optionally save) its figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller runs, 3 repeats")
    parser.add_argument("--repeats", type=int, help="repeats per configuration (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    parser.add_argument("--clients", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.clients:
        clients_main(args.clients[1:], int(args.clients[0]))
        return
    repeats = args.repeats or (3 if args.quick else 5)
    recorded = 100 if args.quick else 300
    total = 50_000 if args.quick else 200_000
    requests = 200 if args.quick else 600
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

    say(f"timeline cost: {repeats} repeats; median (min, max)")
    steps = trio.run(record_steps, recorded)
    per_step = sum(len(e) for e, _ in steps) / len(steps)
    say(f"recorded {len(steps)} steps of node a ({per_step:.2f} events per step)")
    say(f"\npublish: Feed.watch on those steps, {total:,} events per run")
    pub = publish(steps, total, repeats)
    labels = {"none": "0 subscribers", "reading": "10 reading", "stalled": "10 never reading"}
    for name, label in labels.items():
        r = pub[name]
        say(
            f"  {label:<17} {show('', r['events_per_s'], 'events/s').strip()}; "
            f"worst step {show('', r['worst_step_s'], 'us', 1e6).strip()}; "
            f"dropped/subscriber {r['dropped_per_subscriber']['median']:,.0f}"
        )
    none = pub["none"]["events_per_s"]["median"]
    reading = pub["reading"]["events_per_s"]["median"]
    say(
        f"  per event: {1e6 / none:.2f} us with 0 subscribers, {1e6 / reading:.2f} us with "
        f"10 reading (+{1e6 / reading - 1e6 / none:.2f} us)"
    )

    say(f"\nnode: {requests} requests a -> b ({KEYS} blocks each, {CONCURRENCY} at a time)")
    node = through_node(requests, repeats)
    for name, r in node.items():
        say(
            f"  {name.replace('_', ' '):<15} "
            f"{show('', r['requests_per_s'], 'requests/s').strip()}; "
            f"{show('', r['events_per_s'], 'events/s').strip()}; "
            f"CPU {show('', r['cpu_per_request_s'], 'ms/request', 1e3).strip()}; "
            f"stall p99 {show('', r['stall_p99_s'], 'ms', 1e3).strip()}, "
            f"max {show('', r['stall_max_s'], 'ms', 1e3).strip()}; "
            f"dropped {r['dropped']['max']:,.0f}"
        )
    report = {
        "config": {
            "repeats": repeats,
            "recorded_requests": recorded,
            "publish_events": total,
            "node_requests": requests,
            "keys": KEYS,
            "concurrency": CONCURRENCY,
            "cpus": os.cpu_count(),
        },
        "publish": pub,
        "node": node,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
