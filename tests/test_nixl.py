"""The NIXL data transport, against real NIXL agents (UCX, DRAM to DRAM, this host).

Rules of this module:

* Everything runs on real NIXL: two agents in this process, or one in a
  subprocess (``tests/nixl_peer.py``). Nothing is mocked except, where a test
  says so, what an agent *reports* (a transfer that stays "running"), to reach
  the timeout paths deterministically; the bytes still move for real.
* The clock is real (NIXL and worker threads do not run on trio's mock clock):
  every wait is bounded with ``trio.fail_after``, and sleeps are short. No
  test asserts how fast anything is (``p2pactor bench`` measures that): a
  bound on a wait only says "it hangs". A fixed sleep stands only before a
  check that something does *not* happen (documented where it stands).
* The module is skipped, with the reason, only when no NIXL wheel imports.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import attrs
import pytest
import trio
import trio.testing

from p2pactor.adapters.nixl import (
    NixlDataTransport,
    NixlOptions,
    import_nixl,
    open_nixl_transport,
)
from p2pactor.core.events import TransferFailed
from p2pactor.core.inputs import LookupResult
from p2pactor.errors import ConfigError, DataPlaneError
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.node import FetchResult, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.runtime.transport import TransferError, WriteDone
from p2pactor.testing import MemoryNetwork

try:
    import_nixl()
except DataPlaneError as exc:
    pytest.skip(f"no NIXL wheel imports: {exc}", allow_module_level=True)

BL = 4096
N = 32
PEER_SCRIPT = Path(__file__).with_name("nixl_peer.py")


def pattern(seed: int, num_blocks: int = N, block_len: int = BL) -> bytearray:
    """A pool whose every block is different and recognisable."""
    out = bytearray()
    for i in range(num_blocks):
        out += hashlib.sha256(f"{seed}:{i}".encode()).digest() * (block_len // 32)
    return out


def block(pool: bytes | bytearray | memoryview, i: int, block_len: int = BL) -> bytes:
    return bytes(pool[i * block_len : (i + 1) * block_len])


async def register(x: NixlDataTransport, y: NixlDataTransport, name: str) -> None:
    """Register ``y`` with ``x`` under ``name``; ``y`` expects ``x``'s writes from now on.

    A one-sided WRITE may need its target's agent to make progress; a node's
    transport does so while the node has loads in flight, and these raw
    transports say so here, as a node would.
    """
    await x.add_peer(name, y.agent_metadata, y.base_addr, y.num_blocks, y.block_len)
    y.expect_writes(1)


@asynccontextmanager
async def pair(
    options: NixlOptions | None = None,
) -> AsyncIterator[tuple[NixlDataTransport, NixlDataTransport, bytearray, bytearray]]:
    """Two transports over patterned pools, each registered with the other."""
    pool_a, pool_b = pattern(1), pattern(2)
    with trio.fail_after(20):
        async with (
            open_nixl_transport(pool_a, BL, name="a", options=options) as a,
            open_nixl_transport(pool_b, BL, name="b", options=options) as b,
        ):
            await register(a, b, "b")
            await register(b, a, "a")
            yield a, b, pool_a, pool_b


class Stuck:
    """Make an agent *report* every write running until :attr:`held` is cleared.

    The WRITE itself still runs for real (it is done long before the test looks);
    only ``transfer()`` and ``check_xfer_state`` say "PROC" while held, and
    ``release_xfer_handle`` refuses (as NIXL does for a transfer it cannot
    cancel) unless ``refuse`` is False.
    """

    def __init__(self, agent: Any, monkeypatch: pytest.MonkeyPatch, *, refuse: bool) -> None:
        self.held = True
        self.refused = 0
        self.released = 0
        real_transfer = agent.transfer
        real_check = agent.check_xfer_state
        real_release = agent.release_xfer_handle

        def transfer(handle: Any) -> str:
            state = real_transfer(handle)
            return "PROC" if state != "ERR" else state

        def check(handle: Any) -> str:
            return "PROC" if self.held else real_check(handle)

        def release(handle: Any) -> None:
            if self.held and refuse:
                self.refused += 1
                raise RuntimeError("NIXL_ERR_REPOST_ACTIVE (refused by the test)")
            real_release(handle)
            self.released += 1

        monkeypatch.setattr(agent, "transfer", transfer)
        monkeypatch.setattr(agent, "check_xfer_state", check)
        monkeypatch.setattr(agent, "release_xfer_handle", release)


async def wait_for(condition: Callable[[], bool], limit: float = 5.0) -> None:
    """Poll ``condition`` until it holds (NIXL's side has no event to wait on)."""
    with trio.fail_after(limit):
        while True:
            if condition():
                return
            await trio.sleep(0.005)


async def loop_turns(n: int) -> None:
    """A window for a check that the pump does *not* poll: ``n`` turns of the trio loop.

    Each turn lets at least 1 ms pass on trio's clock, the pump's
    ``idle_poll_interval``: a pump that drove progress while it should rest
    polls within the window however slow the machine (a slow machine makes
    the window longer, never emptier).
    """
    for _ in range(n):
        await trio.sleep(0.001)


# --- writes --------------------------------------------------------------------------


async def test_write_lands_at_the_given_indexes_and_nowhere_else() -> None:
    async with pair() as (a, _b, pool_a, pool_b):
        before = bytes(pool_b)
        with trio.fail_after(5):
            await a.write("b", [0, 3, 5, 31], [7, 1, 2, 30])
        for src, dst in [(0, 7), (3, 1), (5, 2), (31, 30)]:
            assert block(pool_b, dst) == block(pool_a, src)
        for i in set(range(N)) - {7, 1, 2, 30}:
            assert block(pool_b, i) == block(before, i)
        assert pool_a == pattern(1)  # the source is only read
        stats = a.statistics()
        assert (stats.writes_done, stats.bytes_written, stats.writes_in_flight) == (1, 4 * BL, 0)
        with pytest.raises(attrs.exceptions.FrozenInstanceError):  # a copy, frozen
            stats.writes_done = 0  # type: ignore[misc]


async def test_torch_tensor_pools() -> None:
    torch = pytest.importorskip("torch")
    src = torch.arange(N * BL, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(N, BL)
    dst = torch.zeros(N, BL, dtype=torch.uint8)
    with trio.fail_after(20):
        async with (
            open_nixl_transport(src, BL) as a,
            open_nixl_transport(dst.view(-1), BL) as b,
        ):
            assert (a.num_blocks, a.block_len, a.base_addr) == (N, BL, src.data_ptr())
            await register(a, b, "b")
            await a.write("b", [4, 5], [0, 9])
    assert torch.equal(dst[0], src[4])
    assert torch.equal(dst[9], src[5])
    assert int(dst[1:9].sum()) == 0


async def test_many_concurrent_writes_in_both_directions() -> None:
    async with pair() as (a, b, pool_a, pool_b):
        src_a, src_b = bytes(pool_a), bytes(pool_b)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                for i in range(16):
                    # a's blocks 0..15 -> b's 16..31; b's 0..15 -> a's 16..31.
                    nursery.start_soon(a.write, "b", [i], [16 + i])
                    nursery.start_soon(b.write, "a", [i], [16 + i])
        for i in range(16):
            assert block(pool_b, 16 + i) == block(src_a, i)
            assert block(pool_a, 16 + i) == block(src_b, i)
        assert a.statistics().writes_done == b.statistics().writes_done == 16


async def test_a_batch_is_one_write_of_many_blocks() -> None:
    async with pair() as (a, _b, pool_a, pool_b):
        blocks = list(range(N))
        with trio.fail_after(5):
            await a.write("b", blocks, blocks[::-1])
        for i in blocks:
            assert block(pool_b, N - 1 - i) == block(pool_a, i)
        assert a.statistics().writes_done == 1


async def test_an_empty_write_does_nothing() -> None:
    async with pair() as (a, _b, _pool_a, pool_b):
        before = bytes(pool_b)
        await a.write("b", [], [])
        assert pool_b == before
        assert a.statistics().writes_done == 0


async def test_a_write_refused_at_once_is_still_a_checkpoint() -> None:
    """Trio's rule for an async call holds when ``start_write`` reports before returning."""
    async with pair() as (a, _b, _pool_a, _pool_b):
        with trio.testing.assert_checkpoints(), pytest.raises(TransferError, match="registered"):
            await a.write("nobody", [0], [0])
        with trio.testing.assert_checkpoints():
            await a.write("b", [], [])
        with trio.CancelScope() as scope:
            scope.cancel()
            await a.write("b", [], [])
        assert scope.cancelled_caught


# --- refused writes ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "local", "remote", "message"),
    [
        ("nobody", [0], [0], "nobody is not registered"),
        ("b", [N], [0], "local block index 32 is out of range"),
        ("b", [0], [N], "b's block index 32 is out of range"),
        ("b", [-1], [0], "local block index -1 is out of range"),
        ("b", [0, 1], [0], "2 local blocks but 1 remote blocks"),
        ("b", [0.5], [0], "must be ints"),
    ],
)
async def test_bad_writes_are_refused_before_nixl(
    peer: str, local: list[Any], remote: list[Any], message: str
) -> None:
    async with pair() as (a, _b, _pool_a, pool_b):
        before = bytes(pool_b)
        with pytest.raises(TransferError, match=message):
            await a.write(peer, local, remote)
        assert pool_b == before
        stats = a.statistics()
        assert (stats.writes_done, stats.writes_failed, stats.writes_in_flight) == (0, 0, 0)


async def test_a_peer_with_other_blocks_or_garbage_metadata_is_refused() -> None:
    async with pair() as (a, b, _pool_a, _pool_b):
        with pytest.raises(TransferError, match="uses 8192-byte blocks, this node 4096"):
            await a.add_peer("odd", b.agent_metadata, b.base_addr, N, 2 * BL)
        with pytest.raises(TransferError, match="cannot register junk's pool with NIXL"):
            await a.add_peer("junk", b"not nixl metadata", b.base_addr, N, BL)
        with pytest.raises(TransferError, match="already registered"):
            await register(a, b, "b")
        stats = a.statistics()
        assert (stats.peers, stats.remote_agents) == (1, 1)
        await a.write("b", [0], [0])  # the good registration is untouched


async def test_remove_then_write_fails_and_adding_again_works() -> None:
    async with pair() as (a, b, pool_a, pool_b):
        await a.write("b", [1], [1])
        await a.remove_peer("b")
        assert (a.statistics().peers, a.statistics().remote_agents) == (0, 0)
        with pytest.raises(TransferError, match="b is not registered"):
            await a.write("b", [2], [2])
        assert block(pool_b, 2) == block(pattern(2), 2)
        await a.remove_peer("b")  # idempotent
        await register(a, b, "b")
        with trio.fail_after(5):
            await a.write("b", [2], [2])
        assert block(pool_b, 2) == block(pool_a, 2)


async def test_one_agent_under_two_names_survives_removing_either() -> None:
    """The reconnect-while-draining case: session #1 drains while #2 is live."""
    async with pair() as (a, b, pool_a, pool_b):
        await register(a, b, "b#2")
        assert (a.statistics().peers, a.statistics().remote_agents) == (2, 1)
        with trio.fail_after(5):
            await a.write("b", [1], [1])
            await a.write("b#2", [2], [2])
            await a.remove_peer("b")
            await a.write("b#2", [3], [3])  # NIXL still knows b's agent
        assert (a.statistics().peers, a.statistics().remote_agents) == (1, 1)
        for i in (1, 2, 3):
            assert block(pool_b, i) == block(pool_a, i)
        await a.remove_peer("b#2")
        assert (a.statistics().peers, a.statistics().remote_agents) == (0, 0)
        await register(a, b, "b#3")
        with trio.fail_after(5):
            await a.write("b#3", [4], [4])
        assert block(pool_b, 4) == block(pool_a, 4)


# --- writes that do not finish ------------------------------------------------------


async def test_a_write_past_its_deadline_fails_only_once_nixl_lets_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pair(NixlOptions(transfer_timeout=0.2)) as (a, _b, _pool_a, _pool_b):
        await a.write("b", [0], [0])  # connection set up for real
        stuck = Stuck(a._agent, monkeypatch, refuse=True)
        failed: list[tuple[float, str]] = []

        async def writer() -> None:
            with pytest.raises(TransferError) as info:
                await a.write("b", [1], [1])
            failed.append((trio.current_time(), str(info.value)))

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                # Past its deadline, NIXL refuses to cancel it, again and again.
                await wait_for(lambda: stuck.refused >= 3)
                assert failed == []  # never while NIXL says it is running
                stats = a.statistics()
                assert (stats.writes_in_flight, stats.zombies) == (1, 1)
                let_go = trio.current_time()
                stuck.held = False
        [(when, message)] = failed
        assert when >= let_go
        assert "no completion within 0.2 s; it completed only afterwards" in message
        stats = a.statistics()
        assert (stats.writes_in_flight, stats.zombies, stats.writes_failed) == (0, 0, 1)
        assert stuck.released == 1  # the zombie's handle, and nothing else


async def test_a_write_past_its_deadline_is_cancelled_through_nixl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pair(NixlOptions(transfer_timeout=0.2)) as (a, _b, _pool_a, _pool_b):
        await a.write("b", [0], [0])
        stuck = Stuck(a._agent, monkeypatch, refuse=False)
        start = trio.current_time()
        with (
            trio.fail_after(5),
            pytest.raises(TransferError, match=r"no completion within 0\.2 s; NIXL cancelled it"),
        ):
            await a.write("b", [1], [1])
        assert trio.current_time() - start >= 0.2  # not before its deadline
        assert stuck.released == 1
        assert a.statistics().writes_in_flight == 0


async def test_remove_peer_waits_for_the_writes_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pair() as (a, _b, pool_a, pool_b):
        await a.write("b", [0], [0])
        stuck = Stuck(a._agent, monkeypatch, refuse=True)
        events: list[str] = []

        async def writer() -> None:
            await a.write("b", [5], [6])
            events.append("written")

        async def remover() -> None:
            await a.remove_peer("b")
            events.append("removed")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                await wait_for(lambda: a.statistics().writes_in_flight == 1)
                nursery.start_soon(remover)
                # Negative check: neither ends while NIXL says the write runs (a
                # remove_peer that did not wait would end in milliseconds).
                await trio.sleep(0.3)
                assert events == []
                with pytest.raises(TransferError, match="not registered"):
                    await a.write("b", [7], [7])  # a peer being removed takes no new writes
                stuck.held = False
        assert events == ["written", "removed"]
        assert block(pool_b, 6) == block(pool_a, 5)
        assert (a.statistics().peers, a.statistics().remote_agents) == (0, 0)


async def test_a_cancelled_write_is_still_seen_through_by_the_pump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with pair() as (a, _b, _pool_a, _pool_b):
        await a.write("b", [0], [0])
        stuck = Stuck(a._agent, monkeypatch, refuse=True)
        with trio.move_on_after(0.2) as scope:
            await a.write("b", [1], [1])
        assert scope.cancelled_caught
        await wait_for(lambda: a.statistics().zombies == 1)
        assert a.statistics().writes_in_flight == 1  # tracked, not forgotten
        stuck.held = False
        await wait_for(lambda: a.statistics().writes_in_flight == 0)
        assert stuck.released == 1
        await a.remove_peer("b")


async def test_closing_with_a_zombie_releases_it_after_close_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    options = NixlOptions(transfer_timeout=0.1, close_timeout=0.3)
    outcome: list[str] = []
    with trio.fail_after(60):  # generous: two busy cores can stretch agent setup
        async with trio.open_nursery() as nursery, pair(options) as (a, _b, _pool_a, _pool_b):
            await a.write("b", [0], [0])
            Stuck(a._agent, monkeypatch, refuse=True)

            async def writer() -> None:
                with pytest.raises(TransferError) as info:
                    await a.write("b", [1], [1])
                outcome.append(str(info.value))

            nursery.start_soon(writer)
            await wait_for(lambda: a.statistics().zombies == 1)
        # The pair exited first: the zombie got close_timeout, then went with the agent.
    assert outcome == ["the NIXL transport closed while it was in flight"]


# --- setup --------------------------------------------------------------------------


async def test_pools_that_cannot_be_registered_are_refused() -> None:
    with pytest.raises(ConfigError, match="whole, non-zero number of 4096-byte blocks"):
        async with open_nixl_transport(bytearray(BL + 1), BL):
            pass
    with pytest.raises(ConfigError, match="writable"):
        async with open_nixl_transport(memoryview(bytes(BL)), BL):
            pass
    with pytest.raises(ConfigError, match="not str"):
        async with open_nixl_transport("pool", BL):  # type: ignore[arg-type]
            pass


async def test_agent_names_are_unique_and_the_pool_is_released_on_exit() -> None:
    pool = bytearray(N * BL)
    async with (
        open_nixl_transport(pool, BL, name="same") as x,
        open_nixl_transport(bytearray(N * BL), BL, name="same") as y,
    ):
        assert x.agent_name != y.agent_name
        assert x.agent_name.startswith("same-")
        with pytest.raises(BufferError):
            pool.extend(b"x")  # registered: it must not move
    pool.extend(b"x")  # deregistered and released on exit


# --- across processes ---------------------------------------------------------------


class PeerProcess:
    """``tests/nixl_peer.py`` in a subprocess, talked to line by line."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self._buffer = b""

    async def line(self, keyword: str) -> list[str]:
        """The next protocol line starting with ``keyword`` (NIXL's logs skipped)."""
        assert self.process.stdout is not None
        while True:
            while b"\n" not in self._buffer:
                chunk = await self.process.stdout.receive_some()
                if not chunk:
                    raise AssertionError("the peer process exited")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\n", 1)
            words = raw.decode().split()
            if words and words[0] == keyword:
                return words[1:]

    async def ask(self, command: str, keyword: str) -> list[str]:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(command.encode() + b"\n")
        return await self.line(keyword)


@pytest.mark.parametrize("progress", ["thread", "pump"])
async def test_write_into_another_process(progress: str) -> None:
    """The target's agent progresses by NIXL's thread alone, or by its pump alone."""
    num_blocks, block_len = 64, 64 * 1024
    pool = pattern(3, num_blocks, block_len)
    with trio.fail_after(60):
        process = await trio.lowlevel.open_process(
            [sys.executable, str(PEER_SCRIPT), str(num_blocks), str(block_len), progress],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        peer = PeerProcess(process)
        try:
            metadata, base_addr, blocks, length = await peer.line("READY")
            async with open_nixl_transport(pool, block_len, name="test") as data:
                await data.add_peer(
                    "peer:1#1", bytes.fromhex(metadata), int(base_addr), int(blocks), int(length)
                )
                local, remote = [0, 5, 63, 17], [63, 0, 10, 11]
                await data.write("peer:1#1", local, remote)
                await data.write("peer:1#1", list(range(32, 40)), list(range(20, 28)))
                expected = hashlib.sha256(
                    b"".join(block(pool, i, block_len) for i in local)
                ).hexdigest()
                got = await peer.ask("SUM " + " ".join(map(str, remote)), "SUM")
                assert got == [expected]
                expected = hashlib.sha256(
                    b"".join(block(pool, i, block_len) for i in range(32, 40))
                ).hexdigest()
                got = await peer.ask("SUM " + " ".join(map(str, range(20, 28))), "SUM")
                assert got == [expected]
                assert await peer.ask("ZEROS", "ZEROS") == [str(num_blocks - 12)]
                thread, polls = await peer.ask("POLLS", "POLLS")
                if progress == "thread":
                    assert (thread, polls) == ("1", "0")  # the bytes landed with no poll of ours
                else:
                    assert thread == "0"
                    assert int(polls) > 0
                await data.remove_peer("peer:1#1")
            assert process.stdin is not None
            await process.stdin.send_all(b"EXIT\n")
            assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()


class PeerPool(NamedTuple):
    """What a peer process advertised on its ``READY`` line."""

    metadata: bytes
    base_addr: int
    num_blocks: int
    block_len: int


@asynccontextmanager
async def peer_process(
    num_blocks: int, block_len: int, progress: str = "pump"
) -> AsyncIterator[tuple[PeerProcess, PeerPool]]:
    """``tests/nixl_peer.py`` running, and its pool; the process is killed on exit.

    ``progress`` is "pump" by default: the tests that stop the peer (SIGSTOP) to
    hold a write in flight were measured that way. With NIXL's progress thread
    on in the stopped peer, the first write into it completed anyway in one
    run of three (the thread may have finished the endpoint's setup first).
    """
    process = await trio.lowlevel.open_process(
        [sys.executable, str(PEER_SCRIPT), str(num_blocks), str(block_len), progress],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        peer = PeerProcess(process)
        metadata, base_addr, blocks, length = await peer.line("READY")
        yield peer, PeerPool(bytes.fromhex(metadata), int(base_addr), int(blocks), int(length))
    finally:
        if process.returncode is None:
            process.kill()  # SIGKILL: ends a stopped process too
        with trio.CancelScope(shield=True):
            await process.wait()


async def add(data: NixlDataTransport, peer_id: str, pool: PeerPool) -> None:
    await data.add_peer(peer_id, pool.metadata, pool.base_addr, pool.num_blocks, pool.block_len)


async def test_a_write_into_a_killed_peer_process_fails_with_nixls_reason() -> None:
    """A peer whose process is gone: the write fails at once, with NIXL's reason.

    What NIXL 1.5.1 does (UCX, DRAM to DRAM on one host), measured: it notices a
    dead peer by itself, with no deadline involved. UCX's endpoint to the peer
    has a TCP lane (127.0.0.1) beside the shared-memory one (cma); the kernel
    resets that socket when the process dies, UCX fails the endpoint
    ("Connection reset by remote peer") and NIXL marks the remote agent
    disconnected. ``transfer()`` then raises ``NIXL_ERR_REMOTE_DISCONNECT``
    ("remote agent ... was disconnected after transfer request creation") in
    well under a millisecond, also when nothing progressed the agent since the
    death (UCX then fails the post itself with an I/O error first). The
    transport turns that into :class:`TransferError`, keeps nothing in flight,
    and serves its other peers as before.
    """
    num_blocks, block_len = 8, 64 * 1024
    pool, live_pool = pattern(4, num_blocks, block_len), bytearray(num_blocks * block_len)
    with trio.fail_after(60):
        async with (
            peer_process(num_blocks, block_len) as (peer, dead),
            open_nixl_transport(pool, block_len, name="test") as data,
            open_nixl_transport(live_pool, block_len, name="live") as live,
        ):
            await add(data, "peer:1#1", dead)
            await register(data, live, "live:1#1")
            await data.write("peer:1#1", [0], [0])  # the connection works
            peer.process.kill()
            await peer.process.wait()
            for attempt in range(2):  # and keeps failing the same way: nothing got stuck
                with pytest.raises(TransferError) as info:
                    await data.write("peer:1#1", [1, 2], [1, 2])
                message = str(info.value)
                assert "NIXL failed the write" in message, message
                assert "NIXL_ERR_REMOTE_DISCONNECT" in message, message
                # NIXL's own verdict, not our transfer_timeout's.
                assert "no completion within" not in message, f"attempt {attempt}: {message}"
            stats = data.statistics()
            assert (stats.writes_in_flight, stats.zombies) == (0, 0)
            assert (stats.writes_done, stats.writes_failed) == (1, 2)
            await data.write("live:1#1", [3, 4], [5, 6])  # another peer is unaffected
            await data.remove_peer("peer:1#1")
            await data.write("live:1#1", [7], [7])
            assert (data.statistics().peers, data.statistics().remote_agents) == (1, 1)
            assert data.statistics().writes_done == 3
        for src, dst in [(3, 5), (4, 6), (7, 7)]:
            assert block(live_pool, dst, block_len) == block(pool, src, block_len)


async def test_a_peer_process_killed_mid_write_fails_the_write_in_flight() -> None:
    """A peer that dies while a write is in flight: the write fails with NIXL's reason.

    To hold a write in flight deterministically, the peer is stopped (SIGSTOP)
    before the first write on the connection. Measured with NIXL 1.5.1 over UCX
    on one host: that write stays PROC for as long as the peer is stopped (UCX's
    flush of the new endpoint waits for the peer; so in every one of 70-odd
    tries, idle and under CPU load). A write posted after an earlier one
    completed stalls so only about two times in three, so this test makes none
    before. Once the stopped peer is killed, the TCP lane's reset fails the
    endpoint and ``check_xfer_state`` raises ``NIXL_ERR_REMOTE_DISCONNECT`` 5-15
    ms after the kill; the pump releases the handle (NIXL accepts) and the
    write raises. No deadline is needed (``transfer_timeout`` stays 30 s), and
    the transport keeps serving another peer.
    """
    num_blocks, block_len = 64, 1024 * 1024
    pool, live_pool = pattern(5, num_blocks, block_len), bytearray(4 * block_len)
    blocks = list(range(num_blocks))
    failed: list[tuple[float, str]] = []
    with trio.fail_after(60):
        async with (
            peer_process(num_blocks, block_len) as (peer, doomed),
            open_nixl_transport(pool, block_len, name="test") as data,
            open_nixl_transport(live_pool, block_len, name="live") as live,
        ):
            await add(data, "peer:1#1", doomed)
            await register(data, live, "live:1#1")
            peer.process.send_signal(signal.SIGSTOP)

            async def writer() -> None:
                with pytest.raises(TransferError) as info:
                    await data.write("peer:1#1", blocks, blocks)  # 64 MiB
                failed.append((trio.current_time(), str(info.value)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                await wait_for(lambda: data.statistics().writes_in_flight == 1)
                # Negative check: a stopped peer is no failure (a write failed
                # early would fail in milliseconds, not after the window).
                await trio.sleep(0.3)
                assert failed == [], "the write ended while the peer was stopped"
                assert data.statistics().writes_in_flight == 1
                peer.process.kill()
            [(_, message)] = failed
            assert "NIXL failed the write" in message, message
            assert "NIXL_ERR_REMOTE_DISCONNECT" in message, message
            # NIXL noticed the death; the write's deadline did not end it.
            assert "no completion within" not in message, message
            stats = data.statistics()
            assert (stats.writes_in_flight, stats.zombies, stats.writes_failed) == (0, 0, 1)
            await data.write("live:1#1", [0, 63], [3, 2])
            await data.remove_peer("peer:1#1")
            assert (data.statistics().peers, data.statistics().remote_agents) == (1, 1)
        assert block(live_pool, 3, block_len) == block(pool, 0, block_len)
        assert block(live_pool, 2, block_len) == block(pool, 63, block_len)


# --- two nodes ----------------------------------------------------------------------


async def test_two_nodes_fetch_over_nixl() -> None:
    torch = pytest.importorskip("torch")
    num_blocks, block_len = 16, 16 * 1024
    network = MemoryNetwork()
    tensors = {n: torch.zeros(num_blocks, block_len, dtype=torch.uint8) for n in "ab"}
    caches = {
        n: EmbeddedCache(num_blocks, block_len, memory=memoryview(t.numpy()))
        for n, t in tensors.items()
    }
    configs = {
        n: NodeConfig(host=n, port=5710, num_blocks=num_blocks, block_len=block_len) for n in "ab"
    }
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(6)]
    contents = {k: hashlib.sha256(k).digest() * (block_len // 32) for k in keys}
    for k in keys[:4]:  # b holds 0..3; 4 and 5 are nowhere
        caches["b"].store(k, contents[k])
    with trio.fail_after(30):
        async with (
            open_nixl_transport(tensors["a"], block_len, name="a") as data_a,
            open_nixl_transport(tensors["b"], block_len, name="b") as data_b,
            open_node(
                configs["a"],
                control=network.transport(configs["a"].node_id),
                data=data_a,
                parent=caches["a"],
            ) as a,
            open_node(
                configs["b"],
                control=network.transport(configs["b"].node_id),
                data=data_b,
                parent=caches["b"],
            ) as b,
        ):
            answers = await a.lookup(b.node_id, "req-1", keys)
            assert answers == [LookupResult.HIT] * 4 + [LookupResult.MISS] * 2
            hits = keys[:4]
            dest = caches["a"].allocate(len(hits))
            result = await a.fetch(b.node_id, "req-1", hits, dest)
            assert result.success, result.reason
            for k, i in zip(hits, dest, strict=True):
                caches["a"].commit(k, i)
                assert caches["a"].read(k) == contents[k]
                assert bytes(tensors["a"][i].numpy()) == contents[k]
            a.finish("req-1")
            await wait_for(lambda: not caches["b"].held_jobs(), limit=10)
            assert data_b.statistics().writes_done == 1
            assert data_b.statistics().bytes_written == 4 * block_len
    for cache in caches.values():
        assert cache.held_jobs() == set()
        assert cache.opened == set()
        assert all(n == 1 for n in cache.finished.values())
        assert all(n == 1 for n in cache.released.values())
    assert data_a.statistics().peers == data_b.statistics().peers == 0


class DataPlaneElsewhere:
    """A node's data transport whose pool is another process's NIXL agent.

    It advertises the peer process's agent and pool, so a producer writes
    there, and registers the node's own peers with ``local``, an in-process
    transport. The node's data plane can then die (SIGKILL) while the node and
    its control channel run on: a consumer whose KV pool vanished.
    """

    def __init__(self, local: NixlDataTransport, pool: PeerPool) -> None:
        self.local = local
        self.pool = pool

    @property
    def agent_metadata(self) -> bytes:
        return self.pool.metadata

    @property
    def base_addr(self) -> int:
        return self.pool.base_addr

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def block_len(self) -> int:
        return self.pool.block_len

    async def add_peer(
        self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int
    ) -> None:
        await self.local.add_peer(peer_id, agent_metadata, base_addr, num_blocks, block_len)

    async def remove_peer(self, peer_id: str) -> None:
        await self.local.remove_peer(peer_id)

    def start_write(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> None:
        self.local.start_write(peer_id, local_blocks, remote_blocks, done)

    def expect_writes(self, delta: int) -> None:
        self.local.expect_writes(delta)

    @property
    def late_write_window(self) -> float:
        return self.local.late_write_window


async def test_a_fetch_whose_destination_process_dies_mid_write_fails_with_a_reason() -> None:
    """The node-level view of a peer gone mid-transfer: a failed fetch, with a reason.

    The consumer's pool lives in a peer process (``DataPlaneElsewhere``). It is
    stopped before the fetch, so the producer's WRITE stays in flight (see
    ``test_a_peer_process_killed_mid_write_fails_the_write_in_flight``), then
    killed. The producer's write fails with NIXL's reason, which its event log
    keeps (``TransferFailed``); the consumer learns only what vLLM's wire says,
    ``transfer_done`` with ``success=False``, so its fetch fails with the
    consumer's own reason. Both nodes release everything they held.
    """
    torch = pytest.importorskip("torch")
    num_blocks, block_len = 16, 16 * 1024
    network = MemoryNetwork()
    tensors = {n: torch.zeros(num_blocks, block_len, dtype=torch.uint8) for n in "ab"}
    caches = {
        n: EmbeddedCache(num_blocks, block_len, memory=memoryview(t.numpy()))
        for n, t in tensors.items()
    }
    configs = {
        n: NodeConfig(host=n, port=5710, num_blocks=num_blocks, block_len=block_len) for n in "ab"
    }
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(4)]
    for k in keys:
        caches["b"].store(k, hashlib.sha256(k).digest() * (block_len // 32))
    outcome: list[FetchResult] = []
    with trio.fail_after(60):
        async with (
            peer_process(num_blocks, block_len) as (peer, pool_a),
            open_nixl_transport(tensors["a"], block_len, name="a") as data_a,
            open_nixl_transport(tensors["b"], block_len, name="b") as data_b,
            open_node(
                configs["a"],
                control=network.transport(configs["a"].node_id),
                data=DataPlaneElsewhere(data_a, pool_a),
                parent=caches["a"],
            ) as a,
            open_node(
                configs["b"],
                control=network.transport(configs["b"].node_id),
                data=data_b,
                parent=caches["b"],
            ) as b,
        ):
            answers = await a.lookup(b.node_id, "req-1", keys)
            assert answers == [LookupResult.HIT] * 4  # the session is up, pools registered
            dest = caches["a"].allocate(len(keys))
            peer.process.send_signal(signal.SIGSTOP)

            async def fetch() -> None:
                outcome.append(await a.fetch(b.node_id, "req-1", keys, dest))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(fetch)
                await wait_for(lambda: data_b.statistics().writes_in_flight == 1)
                # Negative check: a stopped pool fails nothing (a fetch failed early
                # would end in milliseconds, not after the window).
                await trio.sleep(0.3)
                assert outcome == [], "the fetch ended while the consumer's pool was stopped"
                peer.process.kill()
            [result] = outcome
            assert not result.success
            assert result.blocks == 0
            assert result.reason == "the peer reported the transfer failed"
            [failure] = [e for e in b.event_log.recent() if isinstance(e, TransferFailed)]
            assert "NIXL_ERR_REMOTE_DISCONNECT" in failure.reason, failure.reason
            stats = data_b.statistics()
            assert (stats.writes_in_flight, stats.writes_done, stats.writes_failed) == (0, 0, 1)
            caches["a"].free(dest)
            a.finish("req-1")
            await wait_for(lambda: not caches["b"].held_jobs(), limit=10)
    for cache in caches.values():
        assert cache.held_jobs() == set()
        assert cache.opened == set()
        assert cache.pinned() == 0


# --- the event loop -----------------------------------------------------------------


async def test_regression_guard_large_writes_are_posted_off_the_trio_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression guard: NIXL's ``transfer()`` of a large write never runs on the trio thread.

    On shared memory ``transfer()`` copies the whole write before it returns
    (here 128 MiB a write: 25-35 ms on a 2-core VM, over ten times the inline
    budget), so a post on the trio thread would stall the loop that long;
    the transport posts such writes from a worker thread
    (``inline_post_budget``: only writes predicted to post within 2 ms go
    inline). The test records the thread of every ``transfer()`` call, so it
    judges where the post ran, not how long the loop waited.
    """
    num_blocks, block_len, writes = 64, 2 * 1024 * 1024, 4
    pool_a, pool_b = bytearray(num_blocks * block_len), bytearray(num_blocks * block_len)
    pool_a[-1] = 7
    blocks = list(range(num_blocks))
    trio_thread = threading.get_ident()
    posted_on: list[int] = []  # the thread of each transfer() call, in order

    with trio.fail_after(60):
        async with (
            open_nixl_transport(pool_a, block_len, name="a") as a,
            open_nixl_transport(pool_b, block_len, name="b") as b,
        ):
            await register(a, b, "b")
            real_transfer = a._agent.transfer

            def transfer(handle: Any) -> str:
                posted_on.append(threading.get_ident())
                return str(real_transfer(handle))

            monkeypatch.setattr(a._agent, "transfer", transfer)
            await a.write("b", [0], [0])  # the connection is set up; the post rate is known
            for _ in range(writes):
                await a.write("b", blocks, blocks)
            stats = a.statistics()
            assert stats.writes_done == 1 + writes
    assert pool_b[-1] == 7
    assert len(posted_on) == 1 + writes  # one post a write, in order
    large = posted_on[1:]
    assert trio_thread not in large, "a 128 MiB write was posted on the trio thread"
    assert stats.posted_inline == 0


async def test_an_idle_transport_sleeps_and_polls_only_while_writes_may_run() -> None:
    """Without NIXL's progress thread: the pump drives progress only while a write may run.

    The windows in which it must not poll are turns of the trio loop
    (:func:`loop_turns`), not a fixed time: a pump polling every 1 ms, as it
    used to, polls in them on any machine.
    """
    options = NixlOptions(progress_thread_wakeup=None)
    with trio.fail_after(20):
        async with open_nixl_transport(pattern(1), BL, name="idle", options=options) as a:
            assert not a.statistics().progress_thread
            await wait_for(lambda: a.statistics().idle)
            polls = a.statistics().progress_polls
            await loop_turns(100)  # negative check: no poll while idle
            assert a.statistics().progress_polls == polls
            a.expect_writes(1)  # a load in flight: a peer's write may need our progress
            await wait_for(lambda: a.statistics().progress_polls >= polls + 5)
            assert not a.statistics().idle
            a.expect_writes(-1)
            await wait_for(lambda: a.statistics().idle)
            polls = a.statistics().progress_polls
            await loop_turns(100)  # negative check: no poll once idle again
            assert a.statistics().progress_polls == polls


class AgentConfigSpy:
    """Stands in for NIXL's binding module: records each agent's config as NIXL gets it."""

    def __init__(self, binding: Any) -> None:
        self._binding = binding
        self.configs: list[tuple[bool, int]] = []  # (useProgThread, pthrDelay in us)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # NIXL's name for it
        self.configs.append((bool(config.useProgThread), int(config.pthrDelay)))
        return self._binding.nixlAgent(name, config)


async def test_nixls_progress_thread_sleeps_while_idle_and_the_pump_never_polls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default: NIXL's progress thread, waking every 100 ms, and a pump that rests.

    NIXL's Python constructor sets the thread's delay to 0, which makes it
    spin a core (about 1 s of CPU a second); the transport gives it ours
    (``progress_thread_wakeup``, 0.1 s). The test reads the config NIXL's
    binding receives, and checks that the pump, with a peer's write expected,
    goes idle and never polls: the thread, not the pump, progresses it.
    (The CPU an idle node takes: ``docs/benchmarks.md``, control's idle CPU, last figures.)
    """
    api = import_nixl()
    spy = AgentConfigSpy(api.nixlBind)
    monkeypatch.setattr(api, "nixlBind", spy)
    with trio.fail_after(20):
        async with open_nixl_transport(pattern(1), BL, name="threaded") as a:
            assert spy.configs == [(True, 100_000)]  # the thread on, waking every 0.1 s
            assert a.statistics().progress_thread
            a.expect_writes(1)  # the thread, not the pump, progresses a peer's write
            await wait_for(lambda: a.statistics().idle)
            await loop_turns(100)  # negative check: the pump polls in none of them
            assert a.statistics().progress_polls == 0
            assert a.statistics().idle


def test_the_tcp_timeout_bounds_how_long_a_silent_peers_write_may_land() -> None:
    options = NixlOptions(tcp_timeout=1.0)
    assert options.ucx_environment() == {
        "UCX_TCP_USER_TIMEOUT": "1000ms",
        "UCX_TCP_KEEPIDLE": "1s",
        "UCX_TCP_KEEPINTVL": "1s",
    }
    assert options.late_write_window == 5.0
    assert NixlOptions(tcp_timeout=6.0).ucx_environment()["UCX_TCP_KEEPIDLE"] == "3s"
    unbounded = NixlOptions(tcp_timeout=None)
    assert (unbounded.ucx_environment(), unbounded.late_write_window) == ({}, 0.0)
    with pytest.raises(ConfigError):
        NixlOptions(tcp_timeout=0.0)


async def test_a_transport_sets_the_ucx_tcp_variables_the_environment_leaves_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for variable in NixlOptions().ucx_environment():
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("UCX_TCP_KEEPIDLE", "7s")  # the operator's own choice stays
    with trio.fail_after(20):
        async with open_nixl_transport(pattern(1), BL, name="env") as a:
            assert a.late_write_window == 5.0
    assert os.environ["UCX_TCP_USER_TIMEOUT"] == "1000ms"
    assert os.environ["UCX_TCP_KEEPINTVL"] == "1s"
    assert os.environ["UCX_TCP_KEEPIDLE"] == "7s"


@pytest.mark.parametrize(
    ("in_effect", "window"), [("2s", 9.0), ("2500ms", 11.0), ("3", 13.0), ("inf", 5.0)]
)
async def test_the_late_write_window_follows_the_ucx_timeout_in_effect(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, in_effect: str, window: float
) -> None:
    """UCX reads the process environment: an operator's timeout, not ours, sets the window."""
    monkeypatch.setenv("UCX_TCP_USER_TIMEOUT", in_effect)
    with trio.fail_after(20):
        async with open_nixl_transport(pattern(1), BL, name="env") as a:
            assert a.late_write_window == window
    assert os.environ["UCX_TCP_USER_TIMEOUT"] == in_effect
    bounded = "bounds nothing" not in caplog.text
    assert bounded == (in_effect != "inf"), caplog.text
