"""Control plane: lookup throughput and latency, ours against vLLM 0.33.0's P2P sessions.

Per side a producer and a consumer, each its own process (``python -m
p2pactor.programs.bench.control '{"side": "ours"|"vllm", "role": "producer"|"consumer",
"port": N, "peer_port": M}'``, real ZeroMQ and NIXL) speaking
:class:`~p2pactor.programs.bench._control_common.LineProcess`'s protocol. The producer
serves :data:`NUM_KEYS` blocks of an :class:`~p2pactor.runtime.parent.EmbeddedCache`
until its stdin closes, then says its counters (all 0). The consumer answers ``{"keys":
K, "conc": C, "seconds": T}`` with :meth:`Tally.result` of C concurrent lookup loops of
K held keys for T seconds. All four start together; every repeat runs every cell on both
sides in turn, the other side stopped.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

from p2pactor.programs.bench._control_common import (
    LineProcess,
    free_port,
    held,
    offload_key,
    open_bench_node,
    percentile,
    say,
    take_turns,
    vllm_missing,
)
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat
from p2pactor.runtime.parent import EmbeddedCache

TITLE = "lookup throughput and latency over ZeroMQ vs vLLM 0.33.0's P2P sessions"
"""One line saying what is measured."""

CELLS = [(k, c) for k in (1, 16, 256) for c in (1, 8, 64)]
"""(keys per lookup, concurrent lookups) of a full run."""
QUICK_CELLS = [(16, 1), (16, 8)]
"""(keys, concurrent) cells of a quick run."""


def _side(side: str) -> dict[str, LineProcess]:
    """One side's producer and consumer, by role, started."""
    ports = free_port(), free_port()
    return {
        role: LineProcess(
            __name__,
            json.dumps({"side": side, "role": role, "port": port, "peer_port": ports[0]}),
            PYTHONHASHSEED="0",
        )
        for role, port in zip(("producer", "consumer"), ports, strict=True)
    }


def run(options: BenchOptions) -> SectionResult:
    """Measure every cell on both sides, side by side, and tabulate."""
    missing = vllm_missing()
    sides = ["ours"] if missing else ["ours", "vllm"]
    cells = QUICK_CELLS if options.quick else CELLS
    seconds = 0.5 if options.quick else 2.0
    repeats = max(1, options.repeats)
    procs = {s: _side(s) for s in sides}  # all start at once: their imports overlap
    every = {side: list(p.values()) for side, p in procs.items()}
    results: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    leftovers: dict[str, dict[str, Any]] = {}
    try:
        for proc in itertools.chain(*every.values()):
            proc.wait_ready()
        for p in procs.values():  # the handshake, and the first lookups' one-off costs
            p["consumer"].ask({"keys": 16, "conc": 1, "seconds": 0.3})
        for rep in range(repeats):
            for keys, conc in cells:
                for side in take_turns(rep, every):
                    cell = {"keys": keys, "conc": conc, "seconds": seconds}
                    r = procs[side]["consumer"].ask(cell)
                    results.setdefault((side, keys, conc), []).append(r)
        for proc in itertools.chain(*every.values()):
            proc.pause(paused=False)
        for side, p in procs.items():
            p["consumer"].close()
            leftovers[side] = p["producer"].close()
    finally:
        for proc in itertools.chain(*every.values()):
            proc.kill()
    rows: list[dict[str, Cell]] = []
    missed = []
    per_cell: dict[str, list[list[float]]] = {"throughput": [], "p99": []}  # by cell, repeat
    for keys, conc in cells:
        ours = results["ours", keys, conc]
        row: dict[str, Cell] = {"keys": keys, "concurrent": conc, **_figures("ours", ours)}
        if "vllm" in sides:
            theirs = results["vllm", keys, conc]
            pairs = list(zip(ours, theirs, strict=True))
            per_cell["throughput"].append([_rate(a) / _rate(b) for a, b in pairs])
            per_cell["p99"].append([a["p99_s"] / b["p99_s"] for a, b in pairs])
            t, q = (statistics.median(per[-1]) for per in per_cell.values())
            row |= _figures("vLLM", theirs) | {"tput ours/vLLM": t, "p99 ours/vLLM": q}
            if t < 1.0 or q > 1.0:
                missed.append(f"{keys}x{conc}: tput x{t:.2f}, p99 x{q:.2f}")
        rows.append(row)
    ratios = {  # per repeat, over the cells
        f"{name} ours/vLLM (geomean of cells)": Stat.of(
            map(statistics.geometric_mean, zip(*per, strict=True))
        )
        for name, per in per_cell.items()
        if per
    }
    notes = []
    if missing:
        notes.append(f"vLLM side skipped: {missing}")
    if misses := sum(
        r["misses"] for (side, *_), rs in results.items() if side == "ours" for r in rs
    ):
        notes.append(f"ours answered {misses} MISS for keys the producer holds (should be 0)")
    for side, counters in leftovers.items():
        if still := {k: n for k, n in counters.items() if n}:
            notes.append(f"{side} producer still held after the run: {still}")
    if "vllm" in sides:
        notes.append(
            "targets (throughput >= vLLM, p99 <= vLLM): "
            + ("met in every cell" if not missed else "missed in " + "; ".join(missed))
        )
    return SectionResult(rows=rows, ratios=ratios, notes=notes)


def _rate(r: dict[str, Any]) -> float:
    return float(r["lookups"]) / float(r["elapsed_s"])


def _figures(who: str, rs: list[dict[str, Any]]) -> dict[str, Cell]:
    return {
        f"{who} lookups/s": Stat.of(_rate(r) for r in rs),
        f"{who} p50 ms": Stat.of(r["p50_s"] * 1e3 for r in rs),
        f"{who} p99 ms": Stat.of(r["p99_s"] * 1e3 for r in rs),
    }


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


KEYS = tuple(offload_key(f"p2pactor-bench-control/{i}") for i in range(NUM_KEYS))
"""Every key the producer holds, in order."""


def key_window(n: int, count: int) -> list[bytes]:
    """The keys of lookup number ``n``: ``count`` consecutive keys from a spot that moves."""
    start = (n * 97) % NUM_KEYS
    return [KEYS[(start + j) % NUM_KEYS] for j in range(count)]


def ready() -> None:
    """Say READY, once set up: the startup heap is frozen first, on both sides alike.

    A full collection scanning it would pause a node for tens of milliseconds, every
    lookup's latency then (vLLM's engine freezes its heap the same way once started).
    """
    gc.collect()
    gc.freeze()
    say("READY")


def cache_of(role: str, memory: memoryview) -> EmbeddedCache:
    """The role's cache over ``memory``; a producer's holds every key, block ``i`` filled with i."""
    blocks = len(memory) // BLOCK_LEN
    cache = EmbeddedCache(blocks, BLOCK_LEN, memory=memory)
    if role == "producer":
        for i, key in enumerate(KEYS):
            cache.store(key, i.to_bytes(8, "little") * (BLOCK_LEN // 8))
    return cache


class Tally:
    """What one cell's lookups measured so far (a cell command: ``keys``, ``conc``, ``seconds``)."""

    def __init__(self, cmd: dict[str, Any]) -> None:
        self.keys, self.conc = int(cmd["keys"]), int(cmd["conc"])
        self.latencies: list[float] = []
        self.misses = 0
        self.start = time.perf_counter()
        self.last, self.deadline = self.start, self.start + float(cmd["seconds"])

    def add(self, t0: float, misses: int) -> None:
        """One lookup started at ``t0`` and answered now, ``misses`` of its keys not HIT."""
        self.last = time.perf_counter()
        self.latencies.append(self.last - t0)
        self.misses += misses

    def result(self) -> dict[str, Any]:
        """The cell's answer: lookups, elapsed s, latency p50/p99 s, misses."""
        xs = self.latencies
        return {
            "lookups": len(xs),
            "elapsed_s": self.last - self.start,
            "p50_s": percentile(xs, 0.5),
            "p99_s": percentile(xs, 0.99),
            "misses": self.misses,
        }


async def _ours(args: argparse.Namespace) -> None:
    import trio  # noqa: PLC0415

    from p2pactor.runtime.quotas import PeerQuotas  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    producer = args.role == "producer"
    pool = bytearray((NUM_KEYS if producer else CONSUMER_BLOCKS) * BLOCK_LEN)
    cache = cache_of(args.role, memoryview(pool))
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
        open_operator_surface(node),  # as deployed (serve, the vLLM adapter): with its metrics
    ):
        ready()
        if producer:
            await trio.to_thread.run_sync(sys.stdin.read)
            say(held(cache))
            return
        peer = f"{HOST}:{args.peer_port}"
        counter = itertools.count()

        async def worker(tally: Tally) -> None:
            while time.perf_counter() < tally.deadline:
                n = next(counter)
                kv = f"bench-{n}"
                t0 = time.perf_counter()
                answers = await node.lookup(peer, kv, key_window(n, tally.keys))
                tally.add(t0, sum(1 for a in answers if a.name != "HIT"))
                node.finish(kv)

        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            tally = Tally(json.loads(line))
            async with trio.open_nursery() as nursery:
                for _ in range(tally.conc):
                    nursery.start_soon(worker, tally)
            say(tally.result())


def _vllm(args: argparse.Namespace) -> None:
    os.environ["PYTHONHASHSEED"] = HASH_SEED
    import numpy as np  # noqa: PLC0415
    import zmq  # noqa: PLC0415

    from p2pactor.programs.bench import _vllm_tier as shared  # noqa: PLC0415 - imports vLLM

    vbase = sys.modules["vllm.v1.kv_offload.base"]
    producer = args.role == "producer"
    pool = np.zeros((NUM_KEYS if producer else CONSUMER_BLOCKS, BLOCK_LEN), dtype=np.uint8)
    cache = cache_of(args.role, pool.data.cast("B"))
    tier = shared.make_tier("vllm", pool, args.port)
    poller = zmq.Poller()
    poller.register(tier._control._router, zmq.POLLIN)
    ready()
    if producer:  # polled every 1 ms (vLLM's tier-poll interval) unless a message comes first
        shared.serve(tier, cache, lambda: poller.poll(1))
        return
    source = {"remote_host": HOST, "remote_port": args.peer_port}
    counter = itertools.count()
    flight: list[tuple[Any, list[bytes], float]] = []  # (context, keys, start time)
    new_ids: list[str] = []

    def begin(keys: int) -> None:
        n = next(counter)
        kv = {"remote_kv_source": {**source, "kv_request_id": f"bench-{n}"}}
        ctx = vbase.ReqContext(req_id=f"req-{n}", kv_transfer_params=kv)
        wanted = key_window(n, keys)
        t0 = time.perf_counter()
        tier.on_new_request(ctx)
        for key in wanted:
            tier.lookup(key, ctx)  # registers the key: RETRY until the answer comes
        flight.append((ctx, wanted, t0))
        new_ids.append(ctx.req_id)

    while line := sys.stdin.readline():
        tally = Tally(json.loads(line))
        for _ in range(tally.conc):
            begin(tally.keys)
        while flight:
            end_ctx = vbase.ScheduleEndContext(new_req_ids=list(new_ids), preempted_req_ids=())
            tier.on_schedule_end(end_ctx)
            new_ids.clear()
            poller.poll(1)
            tier.get_finished_jobs()
            still = []
            for ctx, wanted, t0 in flight:
                # One LookupResp answers every key of the request at once.
                if tier.lookup(wanted[0], ctx) is vbase.LookupResult.RETRY:
                    still.append((ctx, wanted, t0))
                    continue
                answers = [tier.lookup(k, ctx) for k in wanted]
                tally.add(t0, sum(1 for a in answers if a is not vbase.LookupResult.HIT))
                tier.on_request_finished(ctx)
            done, flight[:] = len(flight) - len(still), still
            for _ in range(done if time.perf_counter() < tally.deadline else 0):
                begin(tally.keys)
        say(tally.result())
    tier.shutdown()


def main() -> int:
    """Run one producer or consumer (its argument: the JSON of ``side``, ``role``, ports)."""
    args = argparse.Namespace(**json.loads(sys.argv[1]))
    if args.side == "ours":
        import trio  # noqa: PLC0415

        trio.run(_ours, args)
    else:
        _vllm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
