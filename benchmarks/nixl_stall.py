"""How NIXL writes behave under trio: loop stalls, throughput, idle CPU.

Two NIXL agents in this process, UCX, DRAM to DRAM (shared memory on one box):

1. **Idle CPU** of two :class:`NixlDataTransport` s (progress thread off, the
   pump idling at ``idle_poll_interval``), and, for comparison, of two bare
   agents with NIXL's default progress thread (``--prog-thread``; it spins).
2. **Loop stall**: the longest gap of the trio loop (a task doing
   ``await trio.lowlevel.checkpoint()`` and recording ``trio.current_time()`` deltas) while
   32 writes of 64 x 256 KiB (and 8 of 64 x 1 MiB) run one after another, posted

   * through :meth:`NixlDataTransport.write` (``make_prepped_xfer`` +
     ``transfer()`` in a worker thread, completion from the pump), and
   * inline, for comparison: the same NIXL calls on the trio thread, polling
     with a checkpoint between polls (what a naive adapter would do).

3. **Throughput** (GB/s, median of ``--reps``) of one write of B blocks of S
   bytes, from 64 x 64 KiB to 256 x 1 MiB: raw NIXL (a blocking loop without
   trio: post, then poll both agents until DONE) against
   :meth:`NixlDataTransport.write`, one write at a time.

Run it with p2pactor installed (``./scripts/test`` makes ``.venv``), from the
repository root: ``.venv/bin/python benchmarks/nixl_stall.py``. It takes about
half a minute and a 512 MiB pool per agent at the largest size; ``--quick``
skips the largest size. NIXL's INFO lines are muted (``NIXL_LOG_LEVEL=WARN``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import numpy as np
import trio
import trio.lowlevel

from p2pactor.adapters.nixl import (
    NixlDataTransport,
    NixlOptions,
    import_nixl,
    open_nixl_transport,
)

KIB = 1024
MIB = 1024 * KIB
SIZES = [(64, 64 * KIB), (64, 256 * KIB), (64, MIB), (256, MIB)]


def say(line: str = "") -> None:
    """Print one line of the report."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def cpu_seconds() -> float:
    """CPU time of this process (every thread), user + system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def pools(num_blocks: int, block_len: int) -> tuple[bytearray, bytearray]:
    """A source pool with recognisable bytes and an empty destination pool."""
    size = num_blocks * block_len
    src = bytearray(np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8).tobytes())
    return src, bytearray(size)


# --- 1. idle CPU ---------------------------------------------------------------------


async def idle_cpu_transports(seconds: float) -> float:
    """Cores used by two connected, idle transports."""
    a_pool, b_pool = pools(16, 4 * KIB)
    async with (
        open_nixl_transport(a_pool, 4 * KIB, name="a") as a,
        open_nixl_transport(b_pool, 4 * KIB, name="b") as b,
    ):
        await connect(a, b)
        await a.write("b", [0], [0])
        await trio.sleep(0.3)
        start, cpu = time.monotonic(), cpu_seconds()
        await trio.sleep(seconds)
        return (cpu_seconds() - cpu) / (time.monotonic() - start)


def idle_cpu_prog_thread(seconds: float) -> float:
    """Cores used by two bare agents with NIXL's default progress thread."""
    api = import_nixl()
    agents = [api.nixl_agent(str(uuid.uuid4()), api.nixl_agent_config()) for _ in range(2)]
    time.sleep(0.3)
    start, cpu = time.monotonic(), cpu_seconds()
    time.sleep(seconds)
    used = (cpu_seconds() - cpu) / (time.monotonic() - start)
    del agents
    return used


# --- 2. loop stall -------------------------------------------------------------------


async def connect(a: NixlDataTransport, b: NixlDataTransport) -> None:
    """Register each transport with the other (as ``"a"`` and ``"b"``)."""
    await a.add_peer("b", b.agent_metadata, b.base_addr, b.num_blocks, b.block_len)
    await b.add_peer("a", a.agent_metadata, a.base_addr, a.num_blocks, a.block_len)


async def gaps_during(work: Callable[[], Awaitable[None]]) -> tuple[list[float], float]:
    """Run ``work`` beside a ticker; return (the loop's gaps, elapsed), in seconds."""
    gaps: list[float] = []
    done = trio.Event()

    async def ticker() -> None:
        last = trio.current_time()
        while not done.is_set():
            await trio.lowlevel.checkpoint()
            now = trio.current_time()
            gaps.append(now - last)
            last = now

    async with trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        start = trio.current_time()
        await work()
        elapsed = trio.current_time() - start
        done.set()
    return sorted(gaps), elapsed


def raw_write(agent: Any, local: Any, remote: Any, idx: Any) -> Any:
    """Make and post one WRITE of blocks ``idx`` to the same indexes; the handle."""
    handle = agent.make_prepped_xfer("WRITE", local, idx, remote, idx)
    state = agent.transfer(handle)
    if state == "ERR":
        raise RuntimeError("transfer() returned ERR")
    return handle


async def loop_stall(writes: int, num_blocks: int, block_len: int) -> None:
    """Longest trio loop gap over ``writes`` writes, threaded (ours) and inline."""
    src, dst = pools(num_blocks, block_len)
    idx = np.arange(num_blocks, dtype=np.int32)
    blocks = list(range(num_blocks))
    async with (
        open_nixl_transport(src, block_len, name="a") as a,
        open_nixl_transport(dst, block_len, name="b") as b,
    ):
        await connect(a, b)
        await a.write("b", blocks, blocks)  # warm: connection set up

        async def ours() -> None:
            for _ in range(writes):
                await a.write("b", blocks, blocks)

        async def inline() -> None:
            # Same NIXL calls, on the trio thread, under the transport's lock.
            agent, peer = a._agent, a._peers["b"]
            assert agent is not None
            for _ in range(writes):
                async with a._lock:
                    handle = raw_write(agent, a._local_dlist, peer.dlist, idx)
                while True:
                    async with a._lock:
                        state = agent.check_xfer_state(handle)
                    if state == "DONE":
                        break
                    await trio.lowlevel.checkpoint()
                async with a._lock:
                    agent.release_xfer_handle(handle)

        total = writes * num_blocks * block_len
        what = f"{writes} writes of {num_blocks} x {block_len // KIB} KiB"
        for name, work in (("NixlDataTransport.write (thread)", ours), ("inline on trio", inline)):
            gaps, elapsed = await gaps_during(work)
            p999 = gaps[int(len(gaps) * 0.999)]
            say(
                f"  {what}, {name:32}: loop gap max {gaps[-1] * 1e3:6.2f} ms, "
                f"p99.9 {p999 * 1e3:5.2f} ms; {total / elapsed / 1e9:5.2f} GB/s"
            )
        assert dst == src


# --- 3. throughput -------------------------------------------------------------------


def raw_throughput(sizes: list[tuple[int, int]], reps: int) -> dict[tuple[int, int], float]:
    """GB/s of raw NIXL writes (no trio), median of ``reps``, per size."""
    api = import_nixl()
    config = api.nixl_agent_config(enable_prog_thread=False)
    result = {}
    for num_blocks, block_len in sizes:
        src, dst = pools(num_blocks, block_len)
        a = api.nixl_agent(str(uuid.uuid4()), config)
        b = api.nixl_agent(str(uuid.uuid4()), config)
        descs = {}
        regs = []
        for agent, buf in ((a, src), (b, dst)):
            addr = np.frombuffer(buf, dtype=np.uint8).ctypes.data
            regs.append((agent, agent.register_memory([(addr, len(buf), 0, "")], mem_type="DRAM")))
            rows = np.zeros((num_blocks, 3), dtype=np.uint64)
            rows[:, 0] = addr + np.arange(num_blocks, dtype=np.uint64) * block_len
            rows[:, 1] = block_len
            descs[id(buf)] = rows
        remote = a.add_remote_agent(b.get_agent_metadata())
        local_dlist = a.prep_xfer_dlist("NIXL_INIT_AGENT", descs[id(src)], mem_type="DRAM")
        remote_dlist = a.prep_xfer_dlist(remote, descs[id(dst)], mem_type="DRAM")
        idx = np.arange(num_blocks, dtype=np.int32)
        rates = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            handle = raw_write(a, local_dlist, remote_dlist, idx)
            while a.check_xfer_state(handle) != "DONE":
                b.get_new_notifs()  # the target's progress (connection setup)
            elapsed = time.perf_counter() - start
            a.release_xfer_handle(handle)
            if rep:  # the first one sets the connection up
                rates.append(num_blocks * block_len / elapsed / 1e9)
        assert dst == src
        result[num_blocks, block_len] = statistics.median(rates)
        a.release_dlist_handle(local_dlist)
        a.release_dlist_handle(remote_dlist)
        a.remove_remote_agent(remote)
        for agent, reg in regs:
            agent.deregister_memory(reg)
        del a, b
    return result


async def our_throughput(sizes: list[tuple[int, int]], reps: int) -> dict[tuple[int, int], float]:
    """GB/s of :meth:`NixlDataTransport.write`, median of ``reps``, per size."""
    result = {}
    for num_blocks, block_len in sizes:
        src, dst = pools(num_blocks, block_len)
        blocks = list(range(num_blocks))
        async with (
            open_nixl_transport(src, block_len, name="a", options=NixlOptions()) as a,
            open_nixl_transport(dst, block_len, name="b") as b,
        ):
            await connect(a, b)
            await a.write("b", blocks, blocks)
            rates = []
            for _ in range(reps):
                start = time.perf_counter()
                await a.write("b", blocks, blocks)
                rates.append(num_blocks * block_len / (time.perf_counter() - start) / 1e9)
            assert dst == src
            result[num_blocks, block_len] = statistics.median(rates)
    return result


def main() -> None:
    """Run the three measurements and print the report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7, help="writes per size (median)")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of idle measured")
    parser.add_argument(
        "--prog-thread", action="store_true", help="also measure NIXL's spinning progress thread"
    )
    parser.add_argument("--quick", action="store_true", help="skip 256 x 1 MiB")
    args = parser.parse_args()
    sizes = SIZES[:-1] if args.quick else SIZES

    say(f"NIXL API: {import_nixl().__name__}; {os.cpu_count()} CPUs")
    say("1. idle CPU, two agents")
    cores = trio.run(idle_cpu_transports, args.idle)
    say(f"  NixlDataTransport x2 (progress thread off, pump idles at 1 ms): {cores:.3f} cores")
    if args.prog_thread:
        cores = idle_cpu_prog_thread(min(args.idle, 1.0))
        say(f"  bare agents x2, NIXL default progress thread (pthrDelay=0): {cores:.3f} cores")
    say("2. trio loop stall")
    trio.run(loop_stall, 32, 64, 256 * KIB)
    trio.run(loop_stall, 8, 64, MIB)
    say("3. throughput, one write at a time (GB/s, median)")
    raw = raw_throughput(sizes, args.reps)
    ours = trio.run(our_throughput, sizes, args.reps)
    say(f"  {'write':>14}  {'raw NIXL':>9}  {'ours':>7}  {'ours/raw':>8}")
    for num_blocks, block_len in sizes:
        r, o = raw[num_blocks, block_len], ours[num_blocks, block_len]
        label = f"{num_blocks} x {block_len // KIB} KiB"
        say(f"  {label:>14}  {r:9.2f}  {o:7.2f}  {o / r:8.2f}")


if __name__ == "__main__":
    main()
