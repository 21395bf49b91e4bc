"""Actor scale: 10,000 concurrent requests on one node; replay speed.

Each measurement runs in a fresh interpreter (its peak RSS its own): ``python -m
p2pactor.programs.bench.scale WHAT ARGS...`` says one ``RESULT {...}`` line
(:data:`MEASURES`: N requests at once between two nodes over :mod:`p2pactor.testing`'s
in-memory transports, logging to disk; writing a long log from theirs; replaying it).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import trio

from p2pactor.programs.bench._control_common import child_result, memory_kib, say
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat

TITLE = "N concurrent requests on one node (in-memory network, logs on disk); replay speed"
"""One line saying what is measured."""

REPLAY_MODES = ("read", "replay", "replay --check")
"""Reading the log only; replaying it; replaying it with invariant checks."""


def run(options: BenchOptions) -> SectionResult:
    """Run the requests and the replays; tabulate medians over repeats."""
    n = 1_000 if options.quick else 10_000
    events = 100_000 if options.quick else 1_000_000
    repeats = 1 if options.quick else max(1, min(options.repeats, 3))
    work = options.work_dir

    def measure(what: str, *args: str, timeout: float) -> dict[str, Any]:
        err = os.path.join(work, f"scale-{what}.err")
        found: dict[str, Any] = child_result(__name__, what, *args, stderr=err, timeout=timeout)
        return found

    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        folder = os.path.join(work, f"scale-{rep}")
        os.makedirs(folder, exist_ok=True)
        runs.append(measure("requests", str(n), folder, timeout=600 + n / 10))
    first = [os.path.join(work, "scale-0", f"{x}.log") for x in "ab"]
    big = os.path.join(work, "replay.log")
    w = measure("write", str(events), big, *first, timeout=1200)
    # One replay each: a million events take minutes to replay with checks.
    replays = {m: [measure("replay", m, big, timeout=1200)] for m in REPLAY_MODES}
    os.remove(big)

    def stat(key: str, scale: float = 1.0, rs: list[dict[str, Any]] = runs) -> Stat:
        return Stat.of(float(r[key]) * scale for r in rs)

    def per_s(rs: list[dict[str, Any]], what: str = "events") -> Stat:
        return Stat.of(float(r[what]) / r["seconds"] for r in rs)

    table: list[tuple[str, Cell, str]] = [
        ("concurrent requests", n, "requests"),
        ("time until all done", stat("seconds"), "s"),
        ("requests per second", per_s(runs, "requests"), "1/s"),
        ("events logged (both nodes)", stat("events"), "events"),
        ("events through decide/evolve/log", per_s(runs), "events/s"),
        ("peak RSS", stat("peak_rss_kib", 1 / 1024), "MiB"),
        ("RSS growth during the run", stat("rss_growth_kib", 1 / 1024), "MiB"),
        ("RSS growth per request", stat("rss_growth_kib", 1 / n), "KiB"),
        ("failed requests", stat("failed"), "requests"),
        ("replay log", int(w["events"]), "events"),
        ("replay log size", w["bytes"] / 2**20, "MiB"),
        ("writing the replay log", w["events"] / w["seconds"], "events/s"),
    ]
    for mode, rs in replays.items():
        table += [(f"{mode}: speed", per_s(rs), "events/s")]
        table += [(f"{mode}: peak RSS growth", stat("growth_kib", 1 / 1024, rs), "MiB")]
    rows: list[dict[str, Cell]] = [{"figure": f, "value": v, "unit": u} for f, v, u in table]
    violations = sum(int(r["violations"]) for r in replays["replay --check"])
    bad = f"replay --check found {violations} violation(s) in the repeated log"
    return SectionResult(rows=rows, notes=[bad] if violations else [])


KEYS_PER_REQUEST = 4
"""Keys per request: the producer holds all but the last (3 hits, 1 miss)."""
BLOCK_LEN = 256
"""Bytes per block: small, the copy is not what is measured."""


def _log(node_id: str, path: str) -> Any:
    """A new event log on disk at ``path``, written out on an interval, nothing kept in memory."""
    from p2pactor.runtime.log import Durability, EventLog  # noqa: PLC0415

    return EventLog(node_id, path=path, durability=Durability.interval(), keep=0, overwrite=True)


async def _requests(n: int, folder: str) -> dict[str, Any]:
    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415
    from p2pactor.testing import MemoryDataPlane, MemoryNetwork  # noqa: PLC0415

    held, room = 4096, 10 * n + 1000
    keys = [f"scale-key-{i}".encode().ljust(36, b".") for i in range(held + 1)]
    missing = keys[held]  # never stored: every request's last key misses
    caches = {"a": EmbeddedCache(n * (KEYS_PER_REQUEST - 1) + 16, BLOCK_LEN)}
    caches["b"] = EmbeddedCache(held, BLOCK_LEN)
    for i, key in enumerate(keys[:held]):
        caches["b"].store(key, bytes([i % 256]) * BLOCK_LEN)
    # Nothing may be refused: the point is N requests at once from one peer.
    quotas = PeerQuotas(
        max_pinned_blocks=10**9,
        max_open_lookups=10**7,
        max_fetch_rounds=10**7,
        max_open_requests=10**7,
    )
    network, plane = MemoryNetwork(capacity=room), MemoryDataPlane()
    logs = [_log(f"{x}:5710", f"{folder}/{x}.log") for x in "ab"]

    def node(name: str, log: Any) -> Any:
        cache = caches[name]
        config = NodeConfig(
            host=name,
            port=5710,
            num_blocks=cache.num_blocks,
            block_len=BLOCK_LEN,
            quotas=quotas,
            engine_inbox=room,
            session_outbox=room,
        )
        control, data = network.transport(f"{name}:5710"), plane.transport(cache.memory, BLOCK_LEN)
        return open_node(config, control=control, data=data, parent=cache, event_log=log)

    failed = 0
    rss0 = memory_kib()[1]
    async with node("b", logs[1]), node("a", logs[0]) as a:

        async def one(i: int) -> None:
            nonlocal failed
            kv, start, cache = f"scale-{i}", (i * 7) % (held - KEYS_PER_REQUEST), caches["a"]
            wanted = [*keys[start : start + KEYS_PER_REQUEST - 1], missing]
            answers = await a.lookup("b:5710", kv, wanted)
            hits = [k for k, x in zip(wanted, answers, strict=True) if x is LookupResult.HIT]
            blocks = cache.allocate(len(hits))
            if hits and (await a.fetch("b:5710", kv, hits, blocks)).success:
                for key, block in zip(hits, blocks, strict=True):
                    cache.commit(key, block)
            else:
                cache.free(blocks)
                failed += 1
            a.finish(kv)

        # The handshake first: the N requests measure the actors, not a pile-up
        # of frames queued behind a session that is not up yet.
        await a.lookup("b:5710", "scale-warmup", keys[:1])
        a.finish("scale-warmup")
        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
        seconds = time.perf_counter() - t0
        peak = memory_kib()[1]
    return {
        "requests": n,
        "seconds": seconds,
        "events": sum(log.statistics().events_appended for log in logs),
        "failed": failed,
        "peak_rss_kib": peak,
        "rss_growth_kib": peak - rss0,
    }


def _repeat(paths: Sequence[str], total: int) -> Iterator[Any]:
    """``total`` events: the logs' events, again and again under fresh request ids."""
    from msgspec.structs import replace  # noqa: PLC0415

    from p2pactor.runtime.logread import read_log  # noqa: PLC0415

    pattern = [e for path in paths for e in read_log(path)]
    for n in range(total if pattern else 0):
        e = pattern[n % len(pattern)]
        kv = f"{e.actor.kv_request_id}/{n // len(pattern)}"
        yield replace(e, actor=replace(e.actor, kv_request_id=kv))


def _write(paths: Sequence[str], total: int, out: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    with _log("replay:5710", out) as log:
        events = _repeat(paths, total)
        while batch := list(itertools.islice(events, 64)):
            log.append(batch)
        stats = log.statistics()
    return {
        "events": stats.events_appended,
        "bytes": stats.bytes_written,
        "seconds": time.perf_counter() - t0,
    }


def _replay(mode: str, path: str) -> dict[str, Any]:
    from p2pactor.runtime.logread import read_log  # noqa: PLC0415
    from p2pactor.surface.replay import replay_logs  # noqa: PLC0415

    before = memory_kib()[1]
    t0 = time.perf_counter()
    violations = 0
    if mode == "read":
        events = sum(1 for _ in read_log(path))
    else:
        run = replay_logs([path], check=mode.endswith("--check"), timelines=0)
        for _ in run:
            pass
        events = run.summary().events
        violations = len(run.violations)
    return {
        "mode": mode,
        "seconds": time.perf_counter() - t0,
        "events": events,
        "violations": violations,
        "growth_kib": memory_kib()[1] - before,
    }


MEASURES: dict[str, Callable[..., dict[str, Any]]] = {
    "requests": lambda n, folder: trio.run(_requests, int(n), folder),
    "write": lambda total, out, *logs: _write(logs, int(total), out),
    "replay": _replay,
}
"""Each measurement by its name, from its arguments (strings, as given)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run one measurement; print it as one ``RESULT {...}`` line."""
    what, *args = sys.argv[1:] if argv is None else argv
    say(f"RESULT {json.dumps(MEASURES[what](*args))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
