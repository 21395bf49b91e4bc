"""The data transport over NIXL, on trio, wire-compatible with vLLM 0.33.0's P2P tier.

A producer WRITEs its pinned blocks straight into the consumer's blocks, one
prepared NIXL transfer per fetch, exactly as vLLM's ``NixlTransport`` does;
how trio and NIXL meet (the pump, NIXL's progress thread, the poster, writes
that cannot be recalled): ``docs/design.md``, "The NIXL transport". Use it as
an async context manager::

    pool = torch.zeros(num_blocks, block_len, dtype=torch.uint8)
    async with open_nixl_transport(pool, block_len) as data:
        async with open_node(config, control=..., data=data, parent=...) as node:
            ...

The transport is one class in three layers: the pool and the calls into the
agent (``_nixl_agent``), writes (poster, pump; ``_nixl_writes``), and its
peers and life (here); options and counters in ``_nixl_options``.
"""

from __future__ import annotations

import functools
import importlib
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from logging import DEBUG, WARNING
from types import ModuleType
from typing import TYPE_CHECKING

import attrs
import trio

from p2pactor.adapters._nixl_agent import MAX_BLOCKS, Agent
from p2pactor.adapters._nixl_options import NixlOptions, NixlStatistics, note
from p2pactor.adapters._nixl_writes import Peer, Writes
from p2pactor.errors import DataPlaneError
from p2pactor.runtime.transport import TransferError

if TYPE_CHECKING:
    import torch

__all__ = [
    "NixlDataTransport",
    "NixlOptions",
    "NixlStatistics",
    "import_nixl",
    "open_nixl_transport",
]

#: Where NIXL's Python API lives, in the order tried (see the module docstring).
NIXL_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")


class NixlDataTransport(Writes):
    """A :class:`~p2pactor.runtime.transport.DataTransport` over one NIXL agent.

    Made by :func:`~p2pactor.adapters.nixl.open_nixl_transport`, which owns its
    pump task and releases every NIXL resource when its block exits.

    Attributes:
        agent_name: This agent's NIXL name (unique: it ends with a uuid).
        agent_metadata: The agent's NIXL metadata, for peers' ``add_remote_agent``.
        base_addr: Address of block 0 of the pool.
        num_blocks: Blocks in the pool.
        block_len: Bytes per block.
        late_write_window: How long a silent peer's write may still land
            (:attr:`NixlOptions.late_write_window`), from the
            ``UCX_TCP_USER_TIMEOUT`` in effect in the process when the agent
            was made: the operator's, or the one ``tcp_timeout`` set.
    """

    # --- setup and teardown ------------------------------------------------------------

    async def _drain(self) -> None:
        """Stop taking work and let the writes in flight end, for ``close_timeout``."""
        self._closing = True
        while self._to_post:
            self._end(self._to_post.popleft(), "the NIXL transport is closed", failed=False)
        for write in self._inflight:
            write.expired = write.expired or "the NIXL transport is closing"
        self._kick.set()
        with trio.move_on_after(self._options.close_timeout):
            await self._wait_until(lambda: not self._inflight)

    async def _close(self) -> None:
        """Release every NIXL resource (in a worker thread), then fail what was left."""
        async with self._lock:
            unfinished = list(self._inflight)
            # Taken here, on the trio thread: the worker gets lists, not our state.
            handles = [w.handle for w in unfinished]
            dlists = [p.dlist for p in self._peers.values() if p.dlist is not None]
            remotes = list(self._remotes())
            for peer in self._peers.values():
                peer.dlist = None  # its wrapper keeps the native agent alive
            self._peers.clear()
            assert self._agent is not None  # _close follows a successful open only
            held = [self._agent]  # the worker takes it out: its last reference goes there
            self._agent = None
            await trio.to_thread.run_sync(self._release_all, held, handles, dlists, remotes)
        self._keepalive = None  # a bytearray pool may be resized again
        # Released with the agent: its endpoints are closed, nothing more lands.
        for write in unfinished:
            self._end(write, "the NIXL transport closed while it was in flight")

    def _release_all(
        self, held: list[Agent], handles: list[object], dlists: list[object], remotes: list[str]
    ) -> None:
        """Release the writes, peer lists and remote agents, then the pool (worker thread).

        In dependency order, with the lock held; each release is attempted on its own.
        """
        agent = held.pop()
        for handle in handles:
            self._attempt("releasing a write in flight", agent.release_xfer_handle, handle)
        for dlist in dlists:
            self._remove_peer(agent, dlist, None)
        for remote in remotes:  # after the lists prepared for them
            self._remove_peer(agent, None, remote)
        self._release_pool(agent)
        # The agent (and its UCX context) goes with its last reference, here, in
        # this thread: tearing UCX down can take a while.
        del agent

    # --- the DataTransport interface --------------------------------------------------

    def statistics(self) -> NixlStatistics:
        """Counters, for tests and monitoring."""
        return NixlStatistics(
            peers=len(self._peers),
            remote_agents=len(self._remotes()),
            writes_in_flight=sum(len(p.writes) for p in self._peers.values()),
            zombies=sum(w.zombie for w in self._inflight),
            progress_thread=self._threaded,
            **attrs.asdict(self._tally),
        )

    async def add_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register a peer's pool: its agent, and its blocks as one strided descriptor.

        What this costs does not grow with ``num_blocks``, which the peer
        chooses (issue 30); the NIXL work runs in a worker thread all the same
        (loading the agent's metadata, connecting).

        Raises:
            TransferError: The name is taken, the pool does not match ours, or
                NIXL rejects the peer's metadata or pool.
        """
        self._live_agent()  # or the transport is closed
        if block_len != self.block_len:
            raise TransferError(
                f"{peer_id} uses {block_len}-byte blocks, this node {self.block_len}"
            )
        end = base_addr + num_blocks * block_len  # NIXL takes addresses as uint64
        if not 0 < num_blocks <= MAX_BLOCKS or base_addr <= 0 or end > 2**64:
            raise TransferError(
                f"{peer_id} advertised an impossible pool ({num_blocks} blocks at {base_addr:#x})"
            )
        if peer_id in self._peers:
            raise TransferError(f"{peer_id} is already registered; remove it first")
        peer = Peer(peer_id, num_blocks, base_addr)
        self._peers[peer_id] = peer
        self._wireup_until = trio.current_time() + self._options.wireup_grace
        self._kick.set()
        outcome: tuple[str, list[object]] | str = "cancelled"  # (remote agent, lists) or why not
        try:
            async with self._lock:
                agent = self._live_agent()
                known = self._remotes()
                outcome = await trio.to_thread.run_sync(
                    self._add_peer, agent, agent_metadata, [(base_addr, num_blocks)], known
                )
                # No checkpoint from here on: even if we were cancelled meanwhile,
                # what the thread made is recorded (and released by remove or close).
                if not isinstance(outcome, str):
                    peer.remote, (peer.dlist,) = outcome
            if peer.remote in known:
                outcome = await self._reload(peer.remote, agent_metadata) or outcome
        finally:
            peer.ready.set()
            if isinstance(outcome, str) and self._peers.get(peer_id) is peer:
                del self._peers[peer_id]
            self._signal()
        if isinstance(outcome, str):
            raise TransferError(f"cannot register {peer_id}'s pool with NIXL: {outcome}")
        note(DEBUG, self.agent_name, "%s registered (agent %s)", peer_id, peer.remote, peer=peer_id)

    async def _reload(self, remote: str, metadata: bytes) -> str | None:
        """Load an agent afresh for a new name, once its other names' writes are over.

        Those names are most likely the peer's earlier sessions: the peer may
        have dropped its end of their connection (a new session after a cut
        link), and NIXL learns that only when a write fails on it. Once none
        of their writes is in flight (waited for within the late-write
        window), the agent is released and loaded again, with a new
        connection, and every name's list prepared again. Returns why that
        failed, if it did: then no name of the agent can be written to.
        """

        def names() -> list[Peer]:
            return [p for p in self._peers.values() if p.remote == remote]

        with trio.move_on_after(self.late_write_window):
            await self._wait_until(lambda: not any(p.writes for p in names()))
        async with self._lock:
            agent, peers = self._live_agent(), names()
            if any(w.handle is not None for p in peers for w in p.writes):
                return None  # still in flight: the connection stays as it is
            pools = [(p.base_addr, p.num_blocks) for p in peers]
            stale = (remote, [p.dlist for p in peers])
            reloaded = await trio.to_thread.run_sync(
                self._add_peer, agent, metadata, pools, frozenset(), stale
            )
            for p in peers:  # their lists were released either way
                p.remote = p.dlist = None
            if isinstance(reloaded, str):
                what = "reloading agent %s failed (%s): %s can no longer be written to"
                note(WARNING, self.agent_name, what, remote, reloaded, [p.peer_id for p in peers])
                return reloaded
            for p, dlist in zip(peers, reloaded[1], strict=True):
                p.remote, p.dlist = reloaded[0], dlist
        return None

    async def remove_peer(self, peer_id: str) -> None:
        """Forget a peer once its writes have ended, then release its NIXL state.

        Writes to it fail from now on; those already running are waited for
        (a zombie write keeps the peer until NIXL lets it go). The remote agent
        is removed with the last peer name that uses it.
        """
        peer = self._peers.get(peer_id)
        if peer is None:
            await trio.lowlevel.checkpoint()
            return
        peer.removing = True
        await peer.ready.wait()
        await self._wait_until(lambda: not peer.writes)
        with trio.CancelScope(shield=True):  # half a removal would leak the agent
            # Under the lock, so that a reload (_reload) prepares its list again or sees it gone.
            async with self._lock:
                if self._peers.get(peer_id) is not peer:
                    return  # removed meanwhile by another call
                del self._peers[peer_id]
                agent = self._agent
                last = None if peer.remote in self._remotes() else peer.remote
                if agent is not None and peer.remote is not None:
                    await trio.to_thread.run_sync(self._remove_peer, agent, peer.dlist, last)
        note(DEBUG, self.agent_name, "%s removed", peer_id, peer=peer_id)

    def _remotes(self) -> frozenset[str]:
        """The remote agents loaded: one for any number of peer names."""
        return frozenset(p.remote for p in self._peers.values() if p.remote is not None)

    async def write(
        self, peer_id: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> None:
        """Write our ``local_blocks`` into the peer's ``remote_blocks`` and wait for the end.

        :meth:`start_write` for a caller that waits. If the calling task is
        cancelled meanwhile, the write is cancelled through NIXL (or polled
        until it ends); :meth:`remove_peer` and closing wait for it either way.

        Raises:
            TransferError: Why :meth:`start_write` would have told ``done`` the
                write failed: the peer is unknown, an index is out of range,
                NIXL failed the write, or it missed its deadline.
        """
        outcome: list[str | None] = []
        done = outcome.append
        self.start_write(peer_id, local_blocks, remote_blocks, done)
        try:
            await self._wait_until(lambda: bool(outcome))
        except BaseException:
            for write in [w for p in self._peers.values() for w in p.writes if w.done is done]:
                write.expired = write.expired or "the writing task was cancelled"
                self._kick.set()
            raise
        if outcome[0] is not None:
            raise TransferError(outcome[0])

    def expect_writes(self, delta: int) -> None:
        """``delta`` more (or fewer) peer writes into our pool may be running now.

        With NIXL's progress thread off (``progress_thread_wakeup=None``), the
        pump drives the agent's progress every ``idle_poll_interval`` while any
        may; with the thread on (the default) the thread does, and this only counts.
        """
        self._expected = max(0, self._expected + delta)
        if delta > 0:
            self._kick.set()


@functools.cache
def import_nixl() -> ModuleType:
    """NIXL's Python API module (the one that defines ``nixl_agent``).

    Returns:
        The first of :data:`NIXL_API_MODULES` that imports.

    Raises:
        DataPlaneError: No NIXL wheel imports; the message says what to install.
    """
    failures = []
    for name in NIXL_API_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            failures.append(f"{name}: {exc}")
    raise DataPlaneError(
        "NIXL is not installed, so blocks cannot move between nodes. Install the NIXL "
        "wheel matching your CUDA major version: `pip install nixl-cu12` (CUDA 12, or "
        "CPU-only hosts) or `pip install nixl-cu13` (CUDA 13); the `nixl` meta package "
        "installs both. Tried: " + "; ".join(failures)
    )


@asynccontextmanager
async def open_nixl_transport(
    pool: torch.Tensor | bytearray | memoryview,
    block_len: int,
    *,
    name: str | None = None,
    options: NixlOptions | None = None,
) -> AsyncIterator[NixlDataTransport]:
    """Open a NIXL agent over the node's block pool, and run it until the block exits.

    The pool is registered once as one DRAM region and its descriptors are
    prepared once (in a worker thread), as one strided row. On exit, writes
    still in flight get ``close_timeout`` to end; then every transfer,
    descriptor list and remote agent is released and the pool is deregistered.

    Args:
        pool: The node's KV block pool: a contiguous CPU torch tensor (any
            shape, e.g. ``num_blocks x block_len`` uint8) or a writable buffer
            (bytearray, memoryview). It must outlive the transport.
        block_len: Bytes per block; the pool holds a whole number of blocks.
        name: A readable prefix for the agent's NIXL name; a uuid is always
            appended, because names must be unique across every peer (vLLM
            learned this when every pod called itself ``localhost``).
        options: How the agent is driven; the defaults if None.

    Raises:
        ConfigError: The pool or ``block_len`` is unusable.
        DataPlaneError: NIXL is not installed, or cannot create the agent or
            register the pool.
    """
    options = options or NixlOptions()
    api = import_nixl()
    agent_name = f"{name}-{uuid.uuid4()}" if name else str(uuid.uuid4())
    transport = NixlDataTransport(pool, block_len, agent_name, options)
    transport._agent = await trio.to_thread.run_sync(transport._open, api)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(transport._pump)
            nursery.start_soon(transport._poster)
            try:
                yield transport
            finally:
                with trio.CancelScope(shield=True):
                    await transport._drain()
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await transport._close()
