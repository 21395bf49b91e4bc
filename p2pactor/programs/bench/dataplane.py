"""``p2pactor bench`` section ``dataplane``: a fetch end to end against the physical limit.

Per batch of B blocks of S bytes, a consumer node here and a producer in another process
(:func:`serve`), per repeat: **ours** (``Node.lookup`` then ``Node.fetch``, bytes checked),
**raw NIXL** (the same WRITE from bare agents in the same processes: the machine's limit)
and **memcpy**. :func:`measure` is the ``hosts`` section's too (``python -m
p2pactor.programs.bench.dataplane SPEC`` says its figures as ``RESULT {json}``).
"""

from __future__ import annotations

import functools
import itertools
import json
import statistics
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np
import trio
import trio.lowlevel

from p2pactor.programs.bench._control_common import (
    LineProcess,
    child_result,
    nixl_missing,
    open_bench_node,
    say,
)
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat
from p2pactor.runtime.quotas import PeerQuotas
from p2pactor.runtime.samples import block_bytes, preload_keys

TITLE = "fetch B x S from a node in another process, end to end, vs raw NIXL and memcpy"
"""What the section measures."""

KIB, MIB = 1024, 1024 * 1024
SIZES: tuple[tuple[int, int], ...] = ((64, 64 * KIB), (64, 256 * KIB), (64, MIB), (256, MIB))
"""(blocks, bytes per block) of a run, ``--quick``'s too (fewer operations)."""
TARGET = 0.9
"""ours / raw NIXL wanted for batches of 64 x 256 KiB and up."""
HASH_SEED = "p2pactor-bench"
"""The hash seed both nodes of the benchmark advertise."""
CONFIG: dict[str, Any] = {"hash_seed": HASH_SEED, "quotas": PeerQuotas(pinned_blocks_fraction=1.0)}
"""Both nodes' :class:`~p2pactor.runtime.config.NodeConfig` fields beyond the pool's.

A peer may pin every block: the bench fetches whole pools at once."""


class RawAgent:
    """A bare NIXL agent over a pool: the raw-NIXL reference (no trio), on either side."""

    def __init__(self, pool_addr: int, num_blocks: int, block_len: int) -> None:
        """Register the pool and its per-block descriptors."""
        from p2pactor.adapters.nixl import import_nixl  # noqa: PLC0415

        api = import_nixl()
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent: Any = api.nixl_agent(f"bench-raw-{uuid.uuid4()}", config)
        self.block_len = block_len
        nbytes = num_blocks * block_len
        self.registration = self.agent.register_memory([(pool_addr, nbytes, 0, "")], "DRAM")
        self.metadata: bytes = bytes(self.agent.get_agent_metadata())
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _descs(pool_addr, num_blocks, block_len), "DRAM"
        )
        self.remote: Any = None

    def add_peer(self, metadata: bytes, base_addr: int, num_blocks: int) -> None:
        """Register the consumer's bare agent and its per-block descriptors."""
        name = self.agent.add_remote_agent(metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self.remote = self.agent.prep_xfer_dlist(
            name, _descs(base_addr, num_blocks, self.block_len), "DRAM"
        )
        self.agent.make_connection(name)

    def write(self, local: Sequence[int], remote: Sequence[int]) -> float:
        """One WRITE, posted and polled to DONE in a tight loop; its seconds."""
        agent = self.agent
        li = np.asarray(local, dtype=np.int32)
        ri = np.asarray(remote, dtype=np.int32)
        start = time.perf_counter()
        handle = agent.make_prepped_xfer("WRITE", self.local, li, self.remote, ri)
        state = agent.transfer(handle)
        while state in ("PROC", "PEND"):
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - start
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL write ended {state}")
        return elapsed

    def close(self) -> None:
        """Release the descriptors and the pool."""
        for dlist in (self.local, self.remote):
            if dlist is not None:
                self.agent.release_dlist_handle(dlist)
        self.agent.deregister_memory(self.registration)


def _descs(base: int, num_blocks: int, block_len: int) -> Any:
    rows = np.zeros((num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = np.uint64(base) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_len)
    rows[:, 1] = block_len
    return rows


async def _progress_until(raw: RawAgent, done: trio.Event) -> None:
    """Drive the raw writes' target's progress, without pause, while they run.

    Over TCP its UCX receives only when progressed: every 1 ms paced "raw" below the link.
    """
    while not done.is_set():
        raw.agent.get_new_notifs()
        await trio.lowlevel.checkpoint()


def _gbps(nbytes: int, seconds: Iterable[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


async def measure(
    block_len: int,
    counts: Sequence[int],
    repeats: int,
    iters: int,
    work_dir: str,
    *,
    address: str = "127.0.0.1",
    host: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Every batch of ``block_len`` blocks against one producer process: by count, GB/s of each.

    The producer runs here, or on ``host`` (a ``Host``'s fields); we are at ``address``.
    """
    import torch  # noqa: PLC0415 - heavy; only this section needs it

    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.programs.hosts import Host  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415

    most = max(counts)
    keys = preload_keys(HASH_SEED, most)
    expected = np.stack([np.frombuffer(block_bytes(k, block_len), np.uint8) for k in keys])
    pool = torch.zeros(most * block_len, dtype=torch.uint8)
    blocks_view = pool.numpy().reshape(most, block_len)
    on = None if host is None else Host(**host)
    producer = LineProcess(
        "p2pactor.programs.bench.dataplane",
        *("producer", str(most), str(block_len), on.address if on else address),
        stderr=f"{work_dir}/dataplane-producer-{block_len}-{address}.stderr",
        host=on,
    )

    async def ask(cmd: dict[str, Any]) -> dict[str, Any]:
        return await trio.to_thread.run_sync(producer.ask, cmd, 120.0)

    raw_target = RawAgent(pool.data_ptr(), most, block_len)
    figures: dict[int, dict[str, Any]] = {
        c: {k: [] for k in ("ours", "fetch", "raw", "memcpy")} for c in counts
    }
    try:
        with trio.fail_after(120 + 30 * len(counts) * repeats):
            ready = await trio.to_thread.run_sync(producer.wait_ready, 120.0)
            peer: str = ready["node_id"]
            source: list[int] = ready["blocks"]
            target = {"metadata": raw_target.metadata.hex(), "base_addr": pool.data_ptr()}
            await ask({"cmd": "raw_peer", **target, "num_blocks": most})
            cache = EmbeddedCache(most, block_len, memory=pool.numpy().data)
            async with open_bench_node(
                0, pool, block_len, name="bench-consumer", parent=cache, host=address, **CONFIG
            ) as node:
                dest = cache.allocate(most)  # blocks 0..most-1: the pool's view checks them
                ids = itertools.count()

                async def ours(count: int) -> tuple[float, float, float]:
                    """One lookup and fetch: (start, looked up, fetched)."""
                    rid = f"bench-{next(ids)}"
                    t0 = time.perf_counter()
                    answers = await node.lookup(peer, rid, keys[:count])
                    t1 = time.perf_counter()
                    if any(a is not LookupResult.HIT for a in answers):
                        raise RuntimeError(f"lookup answered {answers[:4]}...")
                    result = await node.fetch(peer, rid, keys[:count], dest[:count])
                    t2 = time.perf_counter()
                    node.finish(rid)
                    if not result.success:
                        raise RuntimeError(f"fetch failed: {result.reason}")
                    return t0, t1, t2

                async def raw(count: int, n: int) -> list[float]:
                    done = trio.Event()
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_progress_until, raw_target, done)
                        cmd = {"cmd": "raw", "local": source[:count], "remote": dest[:count]}
                        reply = await ask({**cmd, "iters": n})
                        done.set()
                    times: list[float] = reply["times"]
                    return times

                def check(count: int, what: str) -> None:
                    if not np.array_equal(blocks_view[:count], expected[:count]):
                        raise RuntimeError(f"{what}: the fetched bytes differ from the source")

                # Warm up both paths: sessions, NIXL connections, first-touch pages.
                await ours(most)
                await raw(most, 1)
                for count in counts:
                    m, nbytes = figures[count], count * block_len
                    for _ in range(repeats):
                        blocks_view[:count] = 0
                        m["raw"].append(_gbps(nbytes, await raw(count, iters)))
                        check(count, "raw NIXL")
                        blocks_view[:count] = 0
                        spans = [await ours(count) for _ in range(iters)]
                        check(count, "p2pactor")
                        copies = []
                        for _ in range(iters):
                            t = time.perf_counter()
                            np.copyto(blocks_view[:count], expected[:count])
                            copies.append(time.perf_counter() - t)
                        m["ours"].append(_gbps(nbytes, (c - a for a, _, c in spans)))
                        m["fetch"].append(_gbps(nbytes, (c - b for _, b, c in spans)))
                        m["memcpy"].append(_gbps(nbytes, copies))
        await trio.to_thread.run_sync(producer.close)
    finally:
        producer.kill()
        raw_target.close()
    return {str(c): m for c, m in figures.items()}


def label(count: int, block_len: int) -> str:
    """``64 x 256 KiB``."""
    size = f"{block_len // MIB} MiB" if block_len >= MIB else f"{block_len // KIB} KiB"
    return f"{count} x {size}"


def measure_sizes(
    sizes: Sequence[tuple[int, int]],
    iters: int | None,
    options: BenchOptions,
    hosts: Sequence[Any] = (),
) -> SectionResult:
    """``sizes`` measured (:func:`measure`) a block size at a time: the section.

    ``iters``: operations each (None: by block size); ``hosts``: the consumer's
    :class:`~p2pactor.programs.hosts.Host` and the producer's (else both here, and memcpy).
    """
    across = " across hosts" if hosts else ""
    groups: dict[int, list[int]] = defaultdict(list)
    for count, block_len in sizes:
        groups[block_len].append(count)
    ops = {b: iters or (15 if not options.quick else 3 if b >= MIB else 8) for b in groups}
    measured: dict[tuple[int, int], dict[str, Any]] = {}
    for block_len, counts in groups.items():
        spec: dict[str, Any] = {"block_len": block_len, "counts": counts, "iters": ops[block_len]}
        spec |= {"repeats": options.repeats, "work_dir": options.work_dir}
        if not hosts:
            found = trio.run(functools.partial(measure, **spec))
        else:
            spec |= {"address": hosts[0].address, "host": attrs.asdict(hosts[1])}
            found = child_result(
                __name__,
                json.dumps(spec),
                stderr=f"{options.work_dir}/hosts-consumer-{block_len}.stderr",
                host=hosts[0],
                timeout=120 if options.quick else 400,
            )
        measured.update({(c, block_len): found[str(c)] for c in counts})
    rows: list[dict[str, Cell]] = []
    ratios: dict[str, Stat] = {}
    missed: list[str] = []
    target_bytes = 64 * (MIB if across else 256 * KIB)
    for count, block_len in sizes:
        m, name = measured[count, block_len], label(count, block_len)
        row: dict[str, Cell] = {"batch": name, "MiB": count * block_len / MIB}
        row |= {"ours GB/s": Stat.of(m["ours"]), "fetch only GB/s": Stat.of(m["fetch"])}
        row["raw NIXL GB/s"] = Stat.of(m["raw"])
        ratios[f"ours/raw{across} {name}"] = ours_raw = _per(m, "ours", "raw")
        if not across:
            row["memcpy GB/s"] = Stat.of(m["memcpy"])
            ratios[f"ours/memcpy {name}"] = _per(m, "ours", "memcpy")
        ratios[f"fetch only/raw{across} {name}"] = _per(m, "fetch", "raw")
        rows.append(row)
        if count * block_len >= target_bytes and ours_raw.median < TARGET:
            missed.append(f"{name} at {ours_raw.median:.2f} ({TARGET - ours_raw.median:.2f} short)")
    least = f"target ours/raw >= {TARGET} for {label(64, target_bytes // 64)} and up"
    note = f"{least} missed: " + "; ".join(missed) if missed else f"{least}: met"
    targeted = any(count * block_len >= target_bytes for count, block_len in sizes)
    notes = [note] if targeted else []
    return SectionResult(rows=rows, ratios=ratios, notes=notes)


def _per(m: dict[str, Any], ours: str, reference: str) -> Stat:
    return Stat.of(a / b for a, b in zip(m[ours], m[reference], strict=True))


def run(options: BenchOptions) -> SectionResult:
    """Measure every size of :data:`SIZES` (fewer operations with ``--quick``)."""
    if missing := nixl_missing():
        return SectionResult(skipped=missing)
    return measure_sizes(SIZES, None, options)


async def serve(num_blocks: int, block_len: int, address: str) -> None:
    """The producer process (``python -m ...dataplane producer NUM_BLOCKS BLOCK_LEN ADDRESS``).

    A node holding ``NUM_BLOCKS`` blocks and a bare :class:`RawAgent` over them; after
    ``READY {"node_id", "blocks"}``, ``raw_peer`` adds the consumer's bare agent, ``raw``
    times ``iters`` raw WRITEs (the node's loop blocked meanwhile on purpose).
    """
    import torch  # noqa: PLC0415 - only the benchmark's processes need torch

    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    pool = torch.zeros(num_blocks * block_len, dtype=torch.uint8)
    cache = EmbeddedCache(num_blocks, block_len, memory=pool.numpy().data)
    keys = preload_keys(HASH_SEED, num_blocks)
    for key in keys:
        cache.store(key, block_bytes(key, block_len))
    raw = RawAgent(pool.data_ptr(), num_blocks, block_len)
    async with (
        open_bench_node(
            0, pool, block_len, name="bench-producer", parent=cache, host=address, **CONFIG
        ) as node,
        open_operator_surface(node),  # as deployed: with its metrics
    ):
        blocks = [cache.block_of(k) for k in keys]
        say("READY " + json.dumps({"node_id": node.node_id, "blocks": blocks}))
        while line := await trio.to_thread.run_sync(sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["cmd"] == "raw_peer":
                raw.add_peer(bytes.fromhex(cmd["metadata"]), cmd["base_addr"], cmd["num_blocks"])
                say({})
            else:
                say(
                    {"times": [raw.write(cmd["local"], cmd["remote"]) for _ in range(cmd["iters"])]}
                )
    raw.close()


def main() -> None:
    """``SPEC``, :func:`measure`'s keywords as JSON; ``producer N L ADDRESS``: :func:`serve`."""
    if sys.argv[1] == "producer":
        trio.run(serve, int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        say("RESULT " + json.dumps(trio.run(functools.partial(measure, **json.loads(sys.argv[1])))))


if __name__ == "__main__":
    main()
