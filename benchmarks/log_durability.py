"""Measure what each event-log durability policy costs a node's trio thread.

A node appends each actor step's events (a few at a time) from its trio thread
and then goes back to its event loop. This script does the same with a
realistic mix of events (every scenario of ``tests/test_replay.py``, both
roles), under each policy, and prints per-append latency (what an actor step
pays), the longest trip through the event loop between two appends (where the
INTERVAL flusher's writes stall the loop), and throughput (events per second,
closing the log included).

Run it from the repository root: ``python benchmarks/log_durability.py``
(``--dir`` picks the file system to measure, ``--appends`` the run length).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import trio

# Run as a script from the repository root: make the test scenarios importable.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from p2pactor.core.events import AnyEvent
from p2pactor.runtime.log import Durability, EventLog
from tests.test_replay import event_mix


def say(line: str) -> None:
    """Print one line of the report."""
    sys.stdout.write(line + "\n")


BATCH = 3
"""Events per append: one actor step records one to five."""


async def run_policy(
    path: Path | None, durability: Durability, batches: Sequence[Sequence[AnyEvent]]
) -> tuple[list[int], list[int], float, EventLog]:
    """Append every batch as a node would.

    Returns:
        Each append's latency (ns), each trip through the event loop (ns: the
        flusher's writes stall the loop there), total seconds, and the log.
    """
    log = EventLog("bench", path=path, durability=durability, keep=1000)
    latencies = []
    stalls = []
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(log.flush_periodically)
        for batch in batches:
            t0 = time.perf_counter_ns()
            log.append(batch)
            t1 = time.perf_counter_ns()
            # Back to the event loop between steps, so the flusher gets its turn.
            await trio.lowlevel.checkpoint()
            latencies.append(t1 - t0)
            stalls.append(time.perf_counter_ns() - t1)
        log.close()
    return latencies, stalls, time.perf_counter() - start, log


def main() -> None:
    """Run every policy and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--appends", type=int, default=20_000, help="appends per policy")
    parser.add_argument("--fsync-appends", type=int, default=2_000, help="appends with fsync")
    args = parser.parse_args()

    mix = event_mix()
    pool = [mix[i : i + BATCH] for i in range(0, len(mix), BATCH)]

    def batches(count: int) -> list[Sequence[AnyEvent]]:
        return [pool[i % len(pool)] for i in range(count)]

    policies: list[tuple[str, Durability | None, int]] = [
        ("memory only (no file)", None, args.appends),
        ("ON_CLOSE", Durability.on_close(), args.appends),
        ("INTERVAL 50 ms", Durability.interval(0.05), args.appends),
        ("EVERY_EVENT", Durability.every_event(), args.appends),
        ("INTERVAL 50 ms + fsync", Durability.interval(0.05, fsync=True), args.fsync_appends),
        ("EVERY_EVENT + fsync", Durability.every_event(fsync=True), args.fsync_appends),
    ]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        say(f"event mix: {len(mix)} events, {BATCH} per append; files in {tmp}")
        say(
            f"{'policy':<24} {'appends':>8} {'events/s':>10} {'p50 us':>8} {'p99 us':>8} "
            f"{'max us':>9} {'stall us':>9} {'writes':>7} {'MB':>6}"
        )
        for i, (name, durability, count) in enumerate(policies):
            path = None if durability is None else Path(tmp) / f"{i}.log"
            work = batches(count)
            latencies, stalls, seconds, log = trio.run(
                run_policy, path, durability or Durability.on_close(), work
            )
            events = sum(len(b) for b in work)
            stats = log.statistics()
            cuts = statistics.quantiles(latencies, n=100)
            say(
                f"{name:<24} {count:>8} {events / seconds:>10,.0f} {cuts[49] / 1e3:>8.1f} "
                f"{cuts[98] / 1e3:>8.1f} {max(latencies) / 1e3:>9.1f} "
                f"{max(stalls) / 1e3:>9.1f} {stats.flushes:>7} "
                f"{stats.bytes_written / 1e6:>6.1f}"
            )


if __name__ == "__main__":
    main()
