"""The data half of :mod:`p2pactor.testing`: NIXL in memory, with fault injection."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

import attrs
import trio

from p2pactor.runtime.transport import TransferError, WriteDone

__all__ = ["MemoryDataPlane", "MemoryDataTransport"]


@attrs.define
class _WriteFault:
    remaining: int
    reason: str
    peer: str | None


class MemoryDataTransport:
    """A node's data endpoint on a :class:`MemoryDataPlane`: its pool is ``memory``."""

    _serials = itertools.count(1)

    def __init__(
        self, plane: MemoryDataPlane, memory: bytearray | memoryview, block_len: int
    ) -> None:
        if len(memory) % block_len:
            raise ValueError("the pool must be a whole number of blocks")
        self._plane = plane
        self.memory = memory
        self._block_len = block_len
        self._serial = next(self._serials)
        self._name = f"mem-agent-{self._serial}"
        self._peers: dict[str, tuple[MemoryDataTransport, int]] = {}
        self._inflight: dict[str, int] = {}
        self._idle: dict[str, trio.Event] = {}
        self.closed = False
        self.expected = 0  # peer writes into this pool that may be running

    @property
    def agent_metadata(self) -> bytes:
        """The agent name peers use to find this pool."""
        return self._name.encode()

    @property
    def base_addr(self) -> int:
        """A fake address, distinct per pool."""
        return self._serial << 32

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return len(self.memory) // self._block_len

    @property
    def block_len(self) -> int:
        """Bytes per block."""
        return self._block_len

    @property
    def late_write_window(self) -> float:
        """The plane's :attr:`MemoryDataPlane.late_write_window`."""
        return self._plane.late_write_window

    def registered(self) -> list[str]:
        """Names of the peers currently registered."""
        return list(self._peers)

    def inflight(self, peer_id: str | None = None) -> int:
        """Writes in flight (to one peer, or to all)."""
        if peer_id is not None:
            return self._inflight.get(peer_id, 0)
        return sum(self._inflight.values())

    async def add_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register a peer's pool (after the plane's registration delay)."""
        del base_addr
        await trio.sleep(self._plane.registration_delay)
        remote = self._plane.find(agent_metadata)
        if remote is None:
            raise TransferError(f"no pool for agent {agent_metadata[:64]!r}")
        if block_len != self._block_len or num_blocks != remote.num_blocks:
            raise TransferError("the peer's advertised pool does not match its memory")
        self._peers[peer_id] = (remote, num_blocks)

    async def remove_peer(self, peer_id: str) -> None:
        """Forget a peer once its writes in flight have ended."""
        while self._inflight.get(peer_id, 0):
            await self._idle.setdefault(peer_id, trio.Event()).wait()
        self._peers.pop(peer_id, None)
        await trio.lowlevel.checkpoint()

    def start_write(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> None:
        """Copy our blocks into the peer's, once the plane's faults have had their say.

        Without a fault the copy happens at once and ``done`` is told before
        this returns; a held write waits for :meth:`MemoryDataPlane.release_writes`.
        """
        entry = self._peers.get(peer_id)
        if entry is None:
            done(f"{peer_id} is not registered")
            return
        remote, remote_blocks_total = entry
        if len(local_blocks) != len(remote_blocks):
            done("local and remote block lists differ in length")
            return
        if any(not 0 <= b < self.num_blocks for b in local_blocks) or any(
            not 0 <= b < remote_blocks_total for b in remote_blocks
        ):
            done("a block index is out of range")
            return
        self._inflight[peer_id] = self._inflight.get(peer_id, 0) + 1
        write = _Pending(self, peer_id, remote, tuple(local_blocks), tuple(remote_blocks), done)
        self._plane.submit(write)

    def _finish(self, write: _Pending, error: str | None = None) -> None:
        """Run a write the plane let through (or failed), then tell its caller."""
        error = error or self._plane.fault_for(write.peer_id)
        if error is None:
            size = self._block_len
            for src, dst in zip(write.local, write.remote, strict=True):
                write.target.memory[dst * size : (dst + 1) * size] = self.memory[
                    src * size : (src + 1) * size
                ]
            self._plane.bytes_written += size * len(write.local)
            self._plane.writes += 1
        self._inflight[write.peer_id] -= 1
        if not self._inflight[write.peer_id]:
            event = self._idle.pop(write.peer_id, None)
            if event is not None:
                event.set()
        write.done(error)

    async def write(
        self, peer_id: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> None:
        """:meth:`start_write`, waiting for the end.

        Raises:
            TransferError: The write failed.
        """
        over = trio.Event()
        outcome: list[str | None] = []

        def done(error: str | None) -> None:
            outcome.append(error)
            over.set()

        self.start_write(peer_id, local_blocks, remote_blocks, done)
        await over.wait()
        if outcome[0] is not None:
            raise TransferError(outcome[0])

    def expect_writes(self, delta: int) -> None:
        """Count peer writes that may be running into this pool (nothing to poll in memory)."""
        self.expected += delta


@attrs.define(eq=False)
class _Pending:
    """A write started and not yet run."""

    source: MemoryDataTransport
    peer_id: str
    target: MemoryDataTransport
    local: tuple[int, ...]
    remote: tuple[int, ...]
    done: WriteDone


class MemoryDataPlane:
    """NIXL, in memory: pools are ``bytearray`` s and writes are copies.

    Attributes:
        registration_delay: Seconds every peer registration takes.
        transfer_timeout: How long a held write waits before it fails.
        late_write_window: What every transport says of how long a silent
            peer's write may still land (0: a write in memory never outlives
            its session; set it to see consumers hold their loads' blocks).
        writes: Writes completed so far.
        bytes_written: Bytes copied by them.
    """

    def __init__(self) -> None:
        self._pools: dict[bytes, MemoryDataTransport] = {}
        self._faults: list[_WriteFault] = []
        self._holding = False
        self._held: deque[_Pending] = deque()
        self.registration_delay = 0.0
        self.transfer_timeout = 30.0
        self.late_write_window = 0.0
        self.writes = 0
        self.bytes_written = 0

    @property
    def held(self) -> int:
        """Writes held in flight now."""
        return len(self._held)

    def transport(self, memory: bytearray | memoryview, block_len: int) -> MemoryDataTransport:
        """A data endpoint over ``memory`` (a node's block pool)."""
        transport = MemoryDataTransport(self, memory, block_len)
        self._pools[transport.agent_metadata] = transport
        return transport

    def find(self, agent_metadata: bytes) -> MemoryDataTransport | None:
        """The pool a peer advertised."""
        return self._pools.get(agent_metadata)

    def fail_writes(
        self, count: int = 1, *, reason: str = "injected failure", peer: str | None = None
    ) -> None:
        """Make the next ``count`` writes (to ``peer``, or any) fail without copying."""
        self._faults.append(_WriteFault(count, reason, peer))

    def hold_writes(self) -> None:
        """Keep every write from now on in flight until :meth:`release_writes`."""
        self._holding = True

    def release_writes(self) -> None:
        """Let held writes run (in the order they were started)."""
        self._holding = False
        while self._held and not self._holding:
            write = self._held.popleft()
            write.source._finish(write)

    def submit(self, write: _Pending) -> None:
        """Run a started write now, or hold it while writes are held.

        A held write that is still held ``transfer_timeout`` later fails, as
        NIXL's transport cancels a write that runs past its deadline.
        """
        if self._holding or self._held:
            self._held.append(write)
            trio.lowlevel.spawn_system_task(self._expire, write, name="held write")
            return
        write.source._finish(write)

    async def _expire(self, write: _Pending) -> None:
        await trio.sleep(self.transfer_timeout)
        if write in self._held:
            self._held.remove(write)
            write.source._finish(write, f"no completion within {self.transfer_timeout:g} s")

    def fault_for(self, peer_id: str) -> str | None:
        """Why a write to ``peer_id`` fails now (one injected fault used), or None."""
        for fault in self._faults:
            if fault.remaining and (fault.peer is None or peer_id.startswith(fault.peer)):
                fault.remaining -= 1
                return fault.reason
        return None
