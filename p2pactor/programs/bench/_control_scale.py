"""The ``scale`` section's measurements, each in a fresh interpreter (for peak RSS).

``python -m p2pactor.programs.bench._control_scale requests --requests N --dir D``: two
nodes in this process over the in-memory transports of :mod:`p2pactor.testing`
(the network is not what is measured; the actors are), each writing a real
:class:`~p2pactor.runtime.log.EventLog` on disk. Node ``a`` starts N requests at once
against node ``b`` (which holds every key in an embedded cache); each looks up
:data:`KEYS_PER_REQUEST` keys, fetches the hits into blocks of ``a``'s cache
and finishes. Prints one JSON line: seconds until all were done, events
appended to both logs, requests that failed, peak RSS and its growth.

``python -m p2pactor.programs.bench._control_scale write --events M --from A B --out L``:
writes a log of about M events to ``L`` by repeating the events of the logs
``A`` and ``B`` (a real run's actors) under fresh request ids.

``python -m p2pactor.programs.bench._control_scale replay MODE LOG``: reads (``read``) or
replays (``replay``, ``replay --check``) ``LOG`` and prints seconds, events and
peak RSS growth.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

KEYS_PER_REQUEST = 4
"""Keys per request: the producer holds all but the last (3 hits, 1 miss)."""
BLOCK_LEN = 256
"""Bytes per block: small, the copy is not what is measured."""


def _peak_kib() -> int:
    from p2pactor.programs.bench._control_common import peak_rss_kib  # noqa: PLC0415

    return peak_rss_kib()


def _say(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _requests(n: int, folder: str) -> dict[str, Any]:
    import trio  # noqa: PLC0415

    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.log import Durability, EventLog  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415
    from p2pactor.testing import MemoryDataPlane, MemoryNetwork  # noqa: PLC0415

    held = 4096
    keys = [f"scale-key-{i}".encode().ljust(36, b".") for i in range(held + 1)]
    missing = keys[held]  # never stored: every request's last key misses
    producer_cache = EmbeddedCache(held, BLOCK_LEN)
    for i, key in enumerate(keys[:held]):
        producer_cache.store(key, bytes([i % 256]) * BLOCK_LEN)
    consumer_blocks = n * (KEYS_PER_REQUEST - 1) + 16
    consumer_cache = EmbeddedCache(consumer_blocks, BLOCK_LEN)
    # Nothing may be refused: the point is N requests at once from one peer.
    quotas = PeerQuotas(
        max_pinned_blocks=10**9,
        max_open_lookups=10**7,
        max_fetch_rounds=10**7,
        max_open_requests=10**7,
    )
    network, plane = MemoryNetwork(capacity=10 * n + 1000), MemoryDataPlane()

    def config(name: str, blocks: int) -> Any:
        return NodeConfig(
            host=name,
            port=5710,
            num_blocks=blocks,
            block_len=BLOCK_LEN,
            quotas=quotas,
            engine_inbox=10 * n + 1000,
            session_outbox=10 * n + 1000,
        )

    logs = [
        EventLog(
            f"{name}:5710",
            path=f"{folder}/{name}.log",
            durability=Durability.interval(),
            keep=0,
            overwrite=True,
        )
        for name in ("a", "b")
    ]
    failed = 0
    rss0 = _peak_kib()
    async with (
        open_node(
            config("b", held),
            control=network.transport("b:5710"),
            data=plane.transport(producer_cache.memory, BLOCK_LEN),
            parent=producer_cache,
            event_log=logs[1],
        ),
        open_node(
            config("a", consumer_blocks),
            control=network.transport("a:5710"),
            data=plane.transport(consumer_cache.memory, BLOCK_LEN),
            parent=consumer_cache,
            event_log=logs[0],
        ) as a,
    ):

        async def one(i: int) -> None:
            nonlocal failed
            kv = f"scale-{i}"
            start = (i * 7) % (held - KEYS_PER_REQUEST)
            wanted = [*keys[start : start + KEYS_PER_REQUEST - 1], missing]
            answers = await a.lookup("b:5710", kv, wanted)
            hits = [k for k, x in zip(wanted, answers, strict=True) if x is LookupResult.HIT]
            if hits:
                blocks = consumer_cache.allocate(len(hits))
                result = await a.fetch("b:5710", kv, hits, blocks)
                if result.success:
                    for key, block in zip(hits, blocks, strict=True):
                        consumer_cache.commit(key, block)
                else:
                    consumer_cache.free(blocks)
                    failed += 1
            else:
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
        peak = _peak_kib()
    events = sum(log.statistics().events_appended for log in logs)
    return {
        "requests": n,
        "seconds": seconds,
        "events": events,
        "failed": failed,
        "peak_rss_kib": peak,
        "rss_growth_kib": peak - rss0,
    }


def _repeat(paths: Sequence[str], total: int) -> Iterator[Any]:
    from msgspec.structs import replace  # noqa: PLC0415

    from p2pactor.runtime.logread import read_log  # noqa: PLC0415

    pattern = [e for path in paths for e in read_log(path)]
    if not pattern:
        return
    produced = 0
    cycle = 0
    while produced < total:
        for e in pattern:
            actor = replace(e.actor, kv_request_id=f"{e.actor.kv_request_id}/{cycle}")
            yield replace(e, actor=actor)
            produced += 1
            if produced >= total:
                return
        cycle += 1


def _write(paths: Sequence[str], total: int, out: str) -> dict[str, Any]:
    from p2pactor.runtime.log import Durability, EventLog  # noqa: PLC0415

    t0 = time.perf_counter()
    with EventLog(
        "replay:5710", path=out, durability=Durability.interval(), keep=0, overwrite=True
    ) as log:
        batch: list[Any] = []
        for event in _repeat(paths, total):
            batch.append(event)
            if len(batch) == 64:
                log.append(batch)
                batch = []
        if batch:
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

    before = _peak_kib()
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
        "growth_kib": _peak_kib() - before,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run one measurement and print it as one JSON line."""
    parser = argparse.ArgumentParser(description="a measurement of the scale benchmark")
    sub = parser.add_subparsers(dest="what", required=True)
    r = sub.add_parser("requests")
    r.add_argument("--requests", type=int, required=True)
    r.add_argument("--dir", required=True)
    w = sub.add_parser("write")
    w.add_argument("--events", type=int, required=True)
    w.add_argument("--from", dest="sources", nargs="+", required=True)
    w.add_argument("--out", required=True)
    p = sub.add_parser("replay")
    p.add_argument("mode", choices=("read", "replay", "replay --check"))
    p.add_argument("log")
    args = parser.parse_args(argv)
    if args.what == "requests":
        import trio  # noqa: PLC0415

        _say(trio.run(_requests, args.requests, args.dir))
    elif args.what == "write":
        _say(_write(args.sources, args.events, args.out))
    else:
        _say(_replay(args.mode, args.log))
    return 0


if __name__ == "__main__":
    sys.exit(main())
