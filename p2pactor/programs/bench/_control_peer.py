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
  :class:`CacheParent`, a vLLM ``ParentManager`` over the same cache class.
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
import threading
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


# --- vLLM's ------------------------------------------------------------------------------


def run_vllm(args: argparse.Namespace) -> None:
    """Run vLLM's producer or consumer until its stdin closes."""
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    import numpy as np  # noqa: PLC0415
    import zmq  # noqa: PLC0415

    from p2pactor.programs.bench import _vllm_tier as shared  # noqa: PLC0415 - imports vLLM

    vbase = sys.modules["vllm.v1.kv_offload.base"]
    tbase = sys.modules["vllm.v1.kv_offload.tiering.base"]
    LookupResult, ReqContext = vbase.LookupResult, vbase.ReqContext  # noqa: N806
    ScheduleEndContext = vbase.ScheduleEndContext  # noqa: N806

    producer = args.role == "producer"
    blocks = NUM_KEYS if producer else CONSUMER_BLOCKS
    pool = np.zeros((blocks, BLOCK_LEN), dtype=np.uint8)
    cache = EmbeddedCache(blocks, BLOCK_LEN, memory=pool.data.cast("B"))
    if producer:
        fill(cache)
    tier = shared.make_tier("vllm", pool, args.port)
    poller = zmq.Poller()
    poller.register(tier._control._router, zmq.POLLIN)
    stop = threading.Event()

    def watch() -> None:
        if producer:
            sys.stdin.read()
            stop.set()

    ready()
    if producer:
        parent = CacheParent(cache, tbase.TransferJob, vbase.RequestOffloadingContext, LookupResult)
        threading.Thread(target=watch, daemon=True).start()
        while not stop.is_set():
            poller.poll(1)  # vLLM's tier-poll interval, unless a message arrives first
            for result in tier.get_finished_jobs():
                cache.release_job(int(result.job_id), success=bool(result.success))
            tier.serve_external_requests(parent)
        tier.shutdown()
        say(producer_counters(cache))
        return

    source = {"remote_host": HOST, "remote_port": args.peer_port}
    counter = iter(range(10**12))
    retry, hit = LookupResult.RETRY, LookupResult.HIT
    while True:
        line = sys.stdin.readline()
        if not line:
            tier.shutdown()
            return
        cmd = json.loads(line)
        if "idle" in cmd:  # as vLLM's tier-poll thread calls an idle engine's tier
            end = time.perf_counter() + float(cmd["idle"])
            while time.perf_counter() < end:
                poller.poll(1)
                tier.has_pending_work()
                tier.get_finished_jobs()
            say({})
            continue
        tally = Tally(cmd)
        # in flight: (context, keys, start time)
        flight: list[tuple[Any, list[bytes], float]] = []
        new_ids: list[str] = []

        def begin(
            keys: int,
            flight: list[tuple[Any, list[bytes], float]],
            new_ids: list[str],
        ) -> None:
            n = next(counter)
            ctx = ReqContext(
                req_id=f"req-{n}",
                kv_transfer_params={"remote_kv_source": {**source, "kv_request_id": f"bench-{n}"}},
            )
            wanted = key_window(n, keys)
            t0 = time.perf_counter()
            tier.on_new_request(ctx)
            for key in wanted:
                tier.lookup(key, ctx)  # registers the key: RETRY until the answer comes
            flight.append((ctx, wanted, t0))
            new_ids.append(ctx.req_id)

        for _ in range(tally.conc):
            begin(tally.keys, flight, new_ids)
        while flight:
            tier.on_schedule_end(
                ScheduleEndContext(new_req_ids=list(new_ids), preempted_req_ids=())
            )
            new_ids.clear()
            poller.poll(1)
            tier.get_finished_jobs()
            still = []
            for ctx, wanted, t0 in flight:
                # One LookupResp answers every key of the request at once.
                if tier.lookup(wanted[0], ctx) is retry:
                    still.append((ctx, wanted, t0))
                    continue
                answers = [tier.lookup(k, ctx) for k in wanted]
                t1 = time.perf_counter()
                tally.add(t1 - t0, t1, sum(1 for a in answers if a is hit), len(answers))
                tier.on_request_finished(ctx)
            done = len(flight) - len(still)
            flight = still
            if time.perf_counter() < tally.deadline:
                for _ in range(done):
                    begin(tally.keys, flight, new_ids)
        say(tally.result())


class CacheParent:
    """VLLM's ``ParentManager`` over an :class:`~p2pactor.runtime.parent.EmbeddedCache`.

    The same cache class our producer serves from, so both producers do the
    same work per key (a dict lookup, a pin per job). Built on the fly (vLLM's
    classes are passed in) so that this module imports without vLLM; the tier
    only calls these four methods.
    """

    def __init__(self, cache: Any, job_cls: Any, ctx_cls: Any, results: Any) -> None:
        self._cache = cache
        self._job = job_cls
        self._ctx = ctx_cls
        self._results = {
            "HIT": results.HIT,
            "MISS": results.MISS,
            "HIT_PENDING": results.HIT_PENDING,
            "RETRY": results.RETRY,
        }

    def on_new_request(self, req_context: Any) -> Any:
        """Open the synthetic request of a peer's lookup."""
        self._cache.on_new_request(req_context.req_id)
        return self._ctx()

    def lookup(self, key: Any, req_context: Any) -> Any:
        """The cache's answer, as vLLM's LookupResult."""
        return self._results[self._cache.lookup(bytes(key), req_context.req_id).name]

    def create_store_job(self, keys: Any, req_context: Any) -> Any:
        """Pin the blocks of ``keys``; the tier reports the job when it lets go."""
        import numpy as np  # noqa: PLC0415

        keys = [bytes(k) for k in keys]
        pin = self._cache.create_store_job(keys, req_context.req_id)
        return self._job(
            job_id=pin.job_id,
            keys=keys,
            chunk_ids=np.array(pin.blocks, dtype=np.int64),
            is_promotion=False,
            req_context=req_context,
        )

    def on_request_finished(self, req_context: Any) -> None:
        """Close the synthetic request."""
        self._cache.on_request_finished(req_context.req_id)


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
        run_vllm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
