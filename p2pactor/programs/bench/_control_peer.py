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
  line of counters (pins still held, synthetic requests still open, and per
  peer the most blocks pinned at once and those still pinned: see
  :class:`PinCountingCache`). With ``--default-quotas`` (the ``flood``
  section) our node keeps its default per-peer quotas instead of limits no
  workload reaches.
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
from collections import Counter
from collections.abc import Sequence
from typing import Any

from p2pactor.core.inputs import Pin
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


def control_key(i: int) -> bytes:
    """Key ``i``: a vLLM OffloadKey (a 32-byte block hash, then the 4-byte group index)."""
    return hashlib.sha256(f"p2pactor-bench-control/{i}".encode()).digest() + bytes(4)


KEYS: tuple[bytes, ...] = tuple(control_key(i) for i in range(NUM_KEYS))
"""Every key the producer holds, in order."""


def key_window(n: int, count: int) -> list[bytes]:
    """The keys of lookup number ``n``: ``count`` consecutive keys from a spot that moves."""
    start = (n * 97) % NUM_KEYS
    return [KEYS[(start + j) % NUM_KEYS] for j in range(count)]


def ready() -> None:
    """Say READY, once set up: the startup heap is frozen first, on both sides alike.

    What is left from importing and setting up (modules, the cache, the keys)
    never needs collecting, and a full collection that scans it pauses a node
    for tens of milliseconds, which is every lookup's latency then (vLLM's
    engine freezes its heap the same way once it has started).
    """
    gc.collect()
    gc.freeze()
    say("READY")


def cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _result(latencies: list[float], elapsed: float, hits: int, misses: int, cpu: float) -> Any:
    return {
        "lookups": len(latencies),
        "elapsed_s": elapsed,
        "p50_s": percentile(latencies, 0.5) if latencies else 0.0,
        "p99_s": percentile(latencies, 0.99) if latencies else 0.0,
        "mean_s": sum(latencies) / len(latencies) if latencies else 0.0,
        "hits": hits,
        "misses": misses,
        "cpu_s": cpu,
    }


def begin_cell(cmd: dict[str, Any]) -> tuple[int, int, Tally, float, float, float]:
    """A cell command's keys and concurrency, its tally, the CPU and time now, its end."""
    tally, cpu0 = Tally(), cpu_s()
    start = tally.last = time.perf_counter()
    return int(cmd["keys"]), int(cmd["conc"]), tally, cpu0, start, start + float(cmd["seconds"])


class Tally:
    """What one cell's lookups measured so far."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.hits = self.misses = 0
        self.last = 0.0

    def add(self, latency: float, at: float, hits: int, keys: int) -> None:
        self.latencies.append(latency)
        self.last = at
        self.hits += hits
        self.misses += keys - hits

    def result(self, start: float, cpu: float) -> Any:
        return _result(self.latencies, self.last - start, self.hits, self.misses, cpu)


def block_content(i: int, block_len: int = BLOCK_LEN) -> bytes:
    """The bytes the producer stores under key ``i``: what a fetch of it must read."""
    return i.to_bytes(8, "little") * (block_len // 8)


def fill(cache: Any) -> None:
    for i, key in enumerate(KEYS):
        cache.store(key, block_content(i))


class PinCountingCache(EmbeddedCache):
    """An :class:`~p2pactor.runtime.parent.EmbeddedCache` that counts the blocks each peer pins.

    Both producers (ours and vLLM's, through ``CacheParent``) pin through
    :meth:`create_store_job` with the synthetic request's name as context,
    ``p2p:{peer}:{kv_request_id}:lu{n}`` on both sides, so the peer is read from
    it. A peer's count is the sum of the blocks of its jobs not yet released
    (what our pinned-blocks quota counts); ``peak_by_peer`` is the most it
    ever reached.
    """

    def __init__(
        self, num_blocks: int, block_len: int, memory: bytearray | memoryview | None = None
    ) -> None:
        """The cache, with nothing pinned by anyone."""
        super().__init__(num_blocks, block_len, memory)
        self.held_by_peer: Counter[str] = Counter()
        self.peak_by_peer: Counter[str] = Counter()
        self._job_peer: dict[int, tuple[str, int]] = {}

    def create_store_job(self, keys: Sequence[bytes], context: str) -> Pin:
        """Pin as the cache does, and count the blocks against the context's peer."""
        pin = super().create_store_job(keys, context)
        peer = _peer_of(context)
        self._job_peer[pin.job_id] = (peer, len(pin.blocks))
        self.held_by_peer[peer] += len(pin.blocks)
        self.peak_by_peer[peer] = max(self.peak_by_peer[peer], self.held_by_peer[peer])
        return pin

    def release_job(self, job_id: int, *, success: bool) -> None:
        """Unpin as the cache does, and take the blocks off the peer's count."""
        super().release_job(job_id, success=success)
        peer, blocks = self._job_peer.pop(job_id, ("", 0))
        if peer:
            self.held_by_peer[peer] -= blocks


def _peer_of(context: str) -> str:
    # "p2p:HOST:PORT:kv_request_id:luN"; every bench process binds an IPv4
    # address, so the peer is the two fields after the prefix.
    parts = context.split(":", 3)
    return f"{parts[1]}:{parts[2]}" if len(parts) > 3 and parts[0] == "p2p" else context


def producer_counters(cache: Any) -> dict[str, Any]:
    """What the producer prints when it stops (``pinned``, ``held_jobs``, ``open`` must be 0)."""
    return {
        "pinned": cache.pinned(),
        "held_jobs": len(cache.held_jobs()),
        "open": len(cache.opened),
        "peak_pinned_by_peer": dict(cache.peak_by_peer),
        "pinned_by_peer": {p: n for p, n in cache.held_by_peer.items() if n},
    }


# --- ours -------------------------------------------------------------------------------


async def _ours(args: argparse.Namespace) -> None:
    import trio  # noqa: PLC0415

    from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    producer = args.role == "producer"
    blocks = NUM_KEYS if producer else CONSUMER_BLOCKS
    pool = bytearray(blocks * BLOCK_LEN)
    cache = PinCountingCache(blocks, BLOCK_LEN, memory=memoryview(pool))
    if producer:
        fill(cache)
    # No quota may refuse: 64 lookups of 256 keys pin 16,384 blocks at once,
    # and vLLM's tier has no quotas to compare with. The flood keeps the
    # defaults: they are what protects the node from the hostile peer.
    quotas = (
        PeerQuotas()
        if args.default_quotas
        else PeerQuotas(
            max_pinned_blocks=10**9, max_open_lookups=100_000, max_open_requests=100_000
        )
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
            keys, conc, tally, cpu0, start, deadline = begin_cell(cmd)

            async def worker(tally: Tally, keys: int, deadline: float) -> None:
                while time.perf_counter() < deadline:
                    n = next(counter)
                    kv = f"bench-{n}"
                    wanted = key_window(n, keys)
                    t0 = time.perf_counter()
                    answers = await node.lookup(peer, kv, wanted)
                    t1 = time.perf_counter()
                    node.finish(kv)
                    tally.add(t1 - t0, t1, sum(1 for a in answers if a.name == "HIT"), len(answers))

            async with trio.open_nursery() as nursery:
                for _ in range(conc):
                    nursery.start_soon(worker, tally, keys, deadline)
            say(tally.result(start, cpu_s() - cpu0))


def main(argv: Sequence[str] | None = None) -> int:
    """Run one producer or consumer until its stdin closes."""
    parser = argparse.ArgumentParser(description="a process of the control benchmark")
    parser.add_argument("--side", choices=("ours", "vllm"), required=True)
    parser.add_argument("--role", choices=("producer", "consumer"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--peer-port", type=int, default=0)
    parser.add_argument(
        "--default-quotas",
        action="store_true",
        help="ours: keep the node's default per-peer quotas (the flood section)",
    )
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
