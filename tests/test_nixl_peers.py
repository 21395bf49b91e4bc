"""What a peer's advertised pool costs a NIXL transport, against real NIXL agents.

A peer chooses the ``num_blocks`` of its ``connect`` (up to 2**31 - 1), and
registering blocks it never touches costs it nothing. The transport prepares
every pool, its own and each peer's, as one strided descriptor row, so what
adding a peer costs does not grow with the blocks it advertises (issue 30):
these tests check what the transport hands NIXL and what the process
allocates meanwhile, and that writes anywhere in such a pool land byte-exact.
They assert outcomes, never durations. The rules of ``tests/test_nixl.py``
hold here too: real agents in this process, real clock, bounded waits.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import tracemalloc
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import pytest
import trio

from p2pactor.adapters import _nixl_agent
from p2pactor.adapters.nixl import NixlDataTransport, import_nixl, open_nixl_transport
from p2pactor.errors import DataPlaneError
from p2pactor.runtime.transport import TransferError

try:
    import_nixl()
except DataPlaneError as exc:
    pytest.skip(f"no NIXL wheel imports: {exc}", allow_module_level=True)

BL = 256
N = 32
HUGE = 4_000_000
"""Blocks the hostile peer advertises: 274 MiB of the victim's memory with per-block lists."""
MIB = 1 << 20
RSS_BOUND = 64 * MIB
"""Issue 30's bound on what one hostile peer may cost a node, whatever it registers."""
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # named only from Python 3.13


def pattern(seed: int, num_blocks: int = N) -> bytearray:
    """A pool whose every block is different and recognisable."""
    out = bytearray()
    for i in range(num_blocks):
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest() * (BL // 32)
    return out


def block(pool: bytes | bytearray | memoryview, i: int) -> bytes:
    return bytes(pool[i * BL : (i + 1) * BL])


def lazy_pool(num_blocks: int) -> memoryview:
    """A region mapped but never touched: no page of it is resident until written."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
    return memoryview(mmap.mmap(-1, num_blocks * BL, flags=flags))


def spy_on_preparation(agent: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every descriptor list ``agent`` is asked to prepare from now on."""
    rows: list[int] = []
    real = agent.prep_xfer_dlist

    def prep_xfer_dlist(agent_name: str, xfer_list: Any, mem_type: str) -> object:
        rows.append(len(xfer_list))
        return real(agent_name, xfer_list, mem_type=mem_type)

    monkeypatch.setattr(agent, "prep_xfer_dlist", prep_xfer_dlist)
    return rows


def _resident_peak() -> int | None:
    """The process's peak resident set since the last reset, in bytes; None off Linux."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextmanager
def allocations() -> Iterator[dict[str, int | None]]:
    """Measure the block: Python's peak allocations (numpy's arrays among them), and the
    growth of the process's peak resident set, which NIXL's own allocations count in
    (None where Linux cannot reset the peak)."""
    out: dict[str, int | None] = {"python_peak": None, "rss_growth": None}
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # restart VmHWM from the current resident set
        before = _resident_peak()
    except OSError:
        before = None
    tracemalloc.start()
    try:
        yield out
        out["python_peak"] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    after = _resident_peak()
    if before is not None and after is not None:
        out["rss_growth"] = after - before


async def test_a_peer_advertising_millions_of_blocks_costs_a_bounded_amount(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source, huge = pattern(1), lazy_pool(HUGE)
    # (our block, the peer's): far apart, at both ends of its pool
    moves = [(0, HUGE - 1), (1, HUGE - 2), (2, HUGE // 2), (3, 70_000), (31, 0), (5, HUGE - 3)]
    with trio.fail_after(30):
        async with (
            open_nixl_transport(source, BL, name="victim") as a,
            open_nixl_transport(huge, BL, name="hostile") as b,
        ):
            rows = spy_on_preparation(a._agent, monkeypatch)
            with allocations() as cost:
                await a.add_peer("hostile", b.agent_metadata, b.base_addr, b.num_blocks, BL)
            b.expect_writes(1)
            await a.write("hostile", [src for src, _ in moves], [dst for _, dst in moves])
    if cost["rss_growth"] is not None:
        assert cost["rss_growth"] < RSS_BOUND, cost
    assert cost["python_peak"] is not None
    assert cost["python_peak"] < MIB, cost
    assert rows == [1]  # one strided row, not HUGE rows
    for src, dst in moves:
        assert block(huge, dst) == block(source, src)
    for untouched in (1, 69_999, 70_001, HUGE // 2 - 1, HUGE - 4):
        assert block(huge, untouched) == bytes(BL)


async def test_an_ordinary_peer_is_one_strided_row_too(monkeypatch: pytest.MonkeyPatch) -> None:
    pool_a, pool_b = pattern(1), pattern(2)
    with trio.fail_after(20):
        async with (
            open_nixl_transport(pool_a, BL, name="a") as a,
            open_nixl_transport(pool_b, BL, name="b") as b,
        ):
            rows = spy_on_preparation(a._agent, monkeypatch)
            await a.add_peer("b", b.agent_metadata, b.base_addr, b.num_blocks, BL)
            b.expect_writes(1)
            await a.write("b", list(range(N)), list(range(N))[::-1])
    assert rows == [1]
    for i in range(N):
        assert block(pool_b, N - 1 - i) == block(pool_a, i)


class SplitPeer:
    """A bare NIXL agent whose pool is registered as two regions (neither vLLM nor
    p2pactor does this): NIXL will not take the pool as one strided row."""

    def __init__(self, num_blocks: int) -> None:
        api = import_nixl()
        config = api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        # The progress thread lands our writes; woken every 0.1 s, it does not spin.
        self.agent: Any = _nixl_agent._new_agent(api, f"split-{uuid.uuid4()}", config, 0.1)
        self.num_blocks = num_blocks
        self.pool = bytearray(num_blocks * BL)
        self._array = (ctypes.c_char * len(self.pool)).from_buffer(self.pool)
        self.base_addr = ctypes.addressof(self._array)
        half = num_blocks // 2 * BL
        self.registration = self.agent.register_memory(
            [(self.base_addr, half, 0, ""), (self.base_addr + half, len(self.pool) - half, 0, "")],
            mem_type="DRAM",
        )
        self.metadata: bytes = self.agent.get_agent_metadata()

    async def add_to(self, data: NixlDataTransport, peer_id: str) -> None:
        await data.add_peer(peer_id, self.metadata, self.base_addr, self.num_blocks, BL)

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)
        del self._array  # the bytearray's buffer is exported while this lives


async def test_a_pool_registered_as_several_regions_is_prepared_block_by_block_if_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = pattern(3)
    peer = SplitPeer(N)
    try:
        with trio.fail_after(20):
            async with open_nixl_transport(source, BL, name="a") as a:
                rows = spy_on_preparation(a._agent, monkeypatch)
                await peer.add_to(a, "split")
                await a.write("split", [0, 1, 2, 3], [0, N // 2 - 1, N // 2, N - 1])
                # Past the limit a pool that needs a row per block is refused.
                monkeypatch.setattr(_nixl_agent, "PER_BLOCK_LIMIT", N - 1)
                with pytest.raises(TransferError, match="more than 31 blocks is not prepared"):
                    await peer.add_to(a, "split-again")
                stats = a.statistics()
                assert (stats.peers, stats.remote_agents) == (1, 1)
                await a.write("split", [4], [1])  # the first registration is untouched
    finally:
        peer.close()
    assert rows == [1, N, 1]  # strided (refused), per block; strided (refused), nothing more
    for src, dst in [(0, 0), (1, N // 2 - 1), (2, N // 2), (3, N - 1), (4, 1)]:
        assert block(peer.pool, dst) == block(source, src)


async def test_a_pool_past_the_end_of_the_address_space_is_refused() -> None:
    with trio.fail_after(20):
        async with (
            open_nixl_transport(pattern(1), BL, name="a") as a,
            open_nixl_transport(pattern(2), BL, name="b") as b,
        ):
            with pytest.raises(TransferError, match="advertised an impossible pool"):
                await a.add_peer("wraps", b.agent_metadata, 2**64 - N * BL + 1, N, BL)
            await a.add_peer("fits", b.agent_metadata, b.base_addr, N, BL)
            assert a.statistics().peers == 1
