"""One process of the ``control`` section: a producer or a consumer, ours or vLLM's.

``python -m p2pactor.programs.bench._control_peer --side ours|vllm --role producer|consumer
--port N [--peer-port M]``, over real ZeroMQ (and a NIXL agent each, since both
handshakes exchange NIXL metadata) on 127.0.0.1:

* **producer**: holds :data:`NUM_KEYS` blocks in an
  :class:`~p2pactor.runtime.parent.EmbeddedCache` and serves lookups from it. ``ours``:
  a p2pactor node with the cache as its embedded parent. ``vllm``: vLLM
  0.33.0's ``P2PSecondaryTierManager`` (its ``P2PSession`` per peer, its
  ``ZmqTransport``), driven by an event loop that wakes when its ROUTER socket
  is readable (or every 1 ms, like vLLM's tier-poll thread) and then calls
  ``get_finished_jobs()`` and ``serve_external_requests(parent)`` with
  ``CacheParent`` (:mod:`~p2pactor.programs.bench._control_vllm`), a vLLM
  ``ParentManager`` over the same cache class.
  It prints ``READY``, serves until its stdin closes, then prints one JSON
  line of counters (pins, jobs and synthetic requests still held: all 0).
* **consumer**: prints ``READY``, then reads one JSON command per line:
  ``{"keys": K, "conc": C, "seconds": T}`` runs C concurrent lookup loops for
  T seconds (each: a fresh request id, a lookup of K keys the producer holds,
  wait for every answer, finish the request) and answers one JSON line:
  lookups done, elapsed seconds, latency p50/p99/mean (seconds), hits, misses
  and this process's CPU seconds. ``ours``: ``Node.lookup`` then
  ``Node.finish`` in C trio tasks. ``vllm``: the tier driven as vLLM's
  scheduler drives it (``on_new_request``, ``lookup`` of every key, which
  registers it and answers RETRY, ``on_schedule_end`` to send the lookups, then
  polling until ``lookup`` answers HIT or MISS, ``on_request_finished``), one
  loop over the C requests in flight, waking when its ROUTER is readable.
  ``{"idle": T}`` answers ``{}`` after T seconds of nothing (ours) or of the
  calls vLLM's tier-poll thread makes every 1 ms for an idle engine (vLLM's).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from p2pactor.programs.bench._control_common import open_bench_node, percentile, say
from p2pactor.runtime.parent import EmbeddedCache

HOST = "127.0.0.1"
"""Every process binds here."""
NUM_KEYS = 4096
"""Blocks the producer holds; lookups ask for windows of these keys (all hits)."""
BLOCK_LEN = 1024
"""Bytes per block: the data plane is not measured here, only registered."""
HASH_SEED = "0"
"""Both sides' hash seed (vLLM's comes from PYTHONHASHSEED, set to this)."""
CONSUMER_BLOCKS = 64
"""The consumer's own pool (nothing is fetched into it)."""


KEYS: tuple[bytes, ...] = tuple(
    hashlib.sha256(f"p2pactor-bench-control/{i}".encode()).digest() + bytes(4)
    for i in range(NUM_KEYS)
)
"""Every key the producer holds, in order: vLLM OffloadKeys (a 32-byte block hash, then
the 4-byte group index)."""


def key_window(n: int, count: int) -> list[bytes]:
    """The keys of lookup number ``n``: ``count`` consecutive keys from a spot that moves."""
    start = (n * 97) % NUM_KEYS
    return [KEYS[(start + j) % NUM_KEYS] for j in range(count)]


def ready() -> None:
    """Say READY, once set up: the startup heap is frozen first, on both sides alike.

    What is left from importing and setting up never needs collecting, and a full
    collection that scans it pauses a node for tens of milliseconds, which is every
    lookup's latency then (vLLM's engine freezes its heap the same way once started).
    """
    gc.collect()
    gc.freeze()
    say("READY")


def cpu_s() -> float:
    """This process's CPU seconds so far."""
    t = os.times()
    return t.user + t.system


class Tally:
    """What one cell's lookups measured so far (a cell command: ``keys``, ``conc``, ``seconds``)."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        self.keys, self.conc = int(cmd["keys"]), int(cmd["conc"])
        self.latencies: list[float] = []
        self.hits = self.misses = 0
        self.cpu0, self.start = cpu_s(), time.perf_counter()
        self.last, self.deadline = self.start, self.start + float(cmd["seconds"])

    def add(self, latency: float, at: float, hits: int, keys: int) -> None:
        """One lookup: its latency, when it was answered, its hits of ``keys``."""
        self.latencies.append(latency)
        self.last = at
        self.hits += hits
        self.misses += keys - hits

    def result(self) -> dict[str, Any]:
        """The cell's answer line."""
        xs = self.latencies
        return {
            "lookups": len(xs),
            "elapsed_s": self.last - self.start,
            "p50_s": percentile(xs, 0.5) if xs else 0.0,
            "p99_s": percentile(xs, 0.99) if xs else 0.0,
            "hits": self.hits,
            "misses": self.misses,
            "cpu_s": cpu_s() - self.cpu0,
        }


def fill(cache: EmbeddedCache) -> None:
    """Store every key's block (key ``i``'s bytes: ``i``, little-endian, repeated)."""
    for i, key in enumerate(KEYS):
        cache.store(key, i.to_bytes(8, "little") * (BLOCK_LEN // 8))


def producer_counters(cache: EmbeddedCache) -> dict[str, Any]:
    """What the producer prints when it stops (``pinned``, ``held_jobs``, ``open`` must be 0)."""
    return {
        "pinned": cache.pinned(),
        "held_jobs": len(cache.held_jobs()),
        "open": len(cache.opened),
    }


# --- ours -------------------------------------------------------------------------------


async def _ours(args: argparse.Namespace) -> None:
    import trio  # noqa: PLC0415

    from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    producer = args.role == "producer"
    blocks = NUM_KEYS if producer else CONSUMER_BLOCKS
    pool = bytearray(blocks * BLOCK_LEN)
    cache = EmbeddedCache(blocks, BLOCK_LEN, memory=memoryview(pool))
    if producer:
        fill(cache)
    # No quota may refuse: 64 lookups of 256 keys pin 16,384 blocks at once,
    # and vLLM's tier has no quotas to compare with.
    quotas = PeerQuotas(
        max_pinned_blocks=10**9, max_open_lookups=100_000, max_open_requests=100_000
    )
    async with (
        open_bench_node(
            args.port,
            pool,
            BLOCK_LEN,
            name=f"bench-{args.role}",
            parent=cache if producer else None,
            hash_seed=HASH_SEED,
            quotas=quotas,
        ) as node,
        # As deployed (serve, the vLLM adapter): with its metrics.
        open_operator_surface(node),
    ):
        ready()
        if producer:
            await trio.to_thread.run_sync(sys.stdin.read)
            say(producer_counters(cache))
            return
        peer = f"{HOST}:{args.peer_port}"
        counter = iter(range(10**12))
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            if "idle" in cmd:  # nothing calls the node meanwhile
                await trio.sleep(float(cmd["idle"]))
                say({})
                continue
            tally = Tally(cmd)

            async def worker(tally: Tally) -> None:
                while time.perf_counter() < tally.deadline:
                    n = next(counter)
                    kv = f"bench-{n}"
                    wanted = key_window(n, tally.keys)
                    t0 = time.perf_counter()
                    answers = await node.lookup(peer, kv, wanted)
                    t1 = time.perf_counter()
                    node.finish(kv)
                    tally.add(t1 - t0, t1, sum(1 for a in answers if a.name == "HIT"), len(answers))

            async with trio.open_nursery() as nursery:
                for _ in range(tally.conc):
                    nursery.start_soon(worker, tally)
            say(tally.result())


def main(argv: Sequence[str] | None = None) -> int:
    """Run one producer or consumer until its stdin closes."""
    parser = argparse.ArgumentParser(description="a process of the control benchmark")
    parser.add_argument("--side", choices=("ours", "vllm"), required=True)
    parser.add_argument("--role", choices=("producer", "consumer"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--peer-port", type=int, default=0)
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.side == "ours":
        import trio  # noqa: PLC0415

        trio.run(_ours, args)
    else:
        from p2pactor.programs.bench._control_vllm import run_vllm  # noqa: PLC0415

        run_vllm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
