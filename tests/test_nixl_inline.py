"""Inline posting of quick NIXL writes (``NixlOptions.inline_post_budget``).

A write whose ``transfer()`` is predicted (from earlier posts' time per byte)
to return within the budget is posted on the trio thread, skipping the worker
thread's hop; the first write, and writes predicted slower, use the thread.
These tests check the choice and that the bytes land either way; they make no
timing claim.
"""

from __future__ import annotations

import hashlib

import pytest
import trio

from p2pactor.adapters.nixl import NixlOptions, import_nixl, open_nixl_transport
from p2pactor.errors import ConfigError, DataPlaneError

try:
    import_nixl()
except DataPlaneError as exc:
    pytest.skip(f"no NIXL wheel imports: {exc}", allow_module_level=True)

BL = 64 * 1024
N = 16


def pattern(seed: int) -> bytearray:
    """A pool whose every block is different and recognisable."""
    out = bytearray()
    for i in range(N):
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest() * (BL // 32)
    return out


async def writes(options: NixlOptions, count: int) -> tuple[int, int]:
    """``count`` writes a -> b of 4 blocks each; (posted inline, done). Checks the bytes."""
    pool_a, pool_b = pattern(1), bytearray(N * BL)
    with trio.fail_after(30):
        async with (
            open_nixl_transport(pool_a, BL, name="a", options=options) as a,
            open_nixl_transport(pool_b, BL, name="b", options=options) as b,
        ):
            await a.add_peer("b", b.agent_metadata, b.base_addr, b.num_blocks, b.block_len)
            await b.add_peer("a", a.agent_metadata, a.base_addr, a.num_blocks, a.block_len)
            for i in range(count):
                blocks = [(4 * i + j) % N for j in range(4)]
                await a.write("b", blocks, blocks)
            stats = a.statistics()
    assert pool_b[: min(N, 4 * count) * BL] == pool_a[: min(N, 4 * count) * BL]
    return stats.posted_inline, stats.writes_done


async def test_quick_writes_after_the_first_are_posted_inline() -> None:
    # A generous budget: 256 KiB writes are predicted quick on any machine.
    inline, done = await writes(NixlOptions(inline_post_budget=0.5), 6)
    assert done == 6
    assert inline == 5  # the first write has no prediction yet: the thread


async def test_a_zero_budget_always_posts_from_the_worker_thread() -> None:
    inline, done = await writes(NixlOptions(inline_post_budget=0.0), 4)
    assert (inline, done) == (0, 4)


async def test_writes_predicted_slower_than_the_budget_use_the_thread() -> None:
    # No real post of 256 KiB returns within a picosecond.
    inline, done = await writes(NixlOptions(inline_post_budget=1e-12), 4)
    assert (inline, done) == (0, 4)


def test_the_budget_must_be_a_number_at_least_zero() -> None:
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError):
            NixlOptions(inline_post_budget=bad)
