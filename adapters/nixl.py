"""The data transport over NIXL, on trio, wire-compatible with vLLM 0.33.0's P2P tier.

A producer WRITEs its pinned blocks straight into the consumer's blocks, one
prepared NIXL transfer per fetch, exactly as vLLM's ``NixlTransport`` does, so a
p2pactor node and a stock vLLM node move bytes into each other's pools:

* the node's whole block pool is **one DRAM registration**, and its per-block
  descriptor list is prepared **once**;
* a peer's pool (advertised in ``connect``: agent metadata, base address, block
  count and size) gets one ``add_remote_agent`` and one per-block remote
  descriptor list, prepared once per peer;
* a write is ``make_prepped_xfer("WRITE", local list, local indexes, remote list,
  remote indexes)`` plus ``transfer()``, with no notification attached (the
  consumer learns of completion from ``TransferDone`` on the control channel).

Use it as an async context manager::

    pool = torch.zeros(num_blocks, block_len, dtype=torch.uint8)
    async with open_nixl_transport(pool, block_len) as data:
        async with open_node(config, control=..., data=data, parent=...) as node:
            ...

How trio and NIXL meet (``shared/reference/trio-stack.md`` section 2):

* NIXL has no completion fd and no callback: completion is learned only by
  polling. One **pump** task per agent polls every write in flight
  (``check_xfer_state``, about 1 µs each) and reports each write's end to the
  callback its :meth:`~NixlDataTransport.start_write` was given (no task per
  write). It also drives the agent's progress (``get_new_notifs``) while a
  peer's write into our pool is *expected* (the node has a load in flight,
  :meth:`~NixlDataTransport.expect_writes`), because a *target's* progress
  matters too: a WRITE into an agent that nobody progresses can stay in
  flight forever (measured: a 1 MiB WRITE stalled until the target polled).
  The pump backs off when nothing changes (a few checkpoints, then 20 µs
  doubling to a 1 ms cap; see :class:`NixlOptions` for what epoll makes of
  sub-millisecond sleeps), is kicked by an event when new work arrives, and
  with nothing in flight and nothing expected it sleeps until there is (it
  used to poll every 1 ms for ever: 0.05-0.11 of a core per idle node).
* The **progress thread is off**. NIXL's Python wrapper hard-codes the progress
  thread's delay to 0, so with the default ``enable_prog_thread=True`` every
  agent spins a full core even when idle (measured 2.0 cores for two agents);
  on a 2-core machine that starves the engine. The pump drives progress instead.
* ``transfer()`` may do the whole copy **inside the call** on shared memory
  (measured 20-40 ms for 64 MiB), and peer registration is O(blocks). Both run
  in a worker thread (``trio.to_thread.run_sync``) so the event loop never
  stalls on them; polls cost about a microsecond and run on the trio thread.
  The hop to the worker thread and back costs about 0.25-0.4 ms, though, so a
  write whose ``transfer()`` is *predicted* to return within
  ``inline_post_budget`` (from the time per byte earlier posts took) is posted
  on the trio thread instead, right inside ``start_write``: the loop stalls at
  most about that long, and small writes (and every write on RDMA, where
  ``transfer()`` only queues) skip the hop. The first write, and any write
  predicted slower, goes to the one *poster* task, which posts writes in
  order from a worker thread.
* The agent runs with ``NIXL_THREAD_SYNC_NONE``: it is not thread-safe. Every
  call into it, from the trio thread or a worker thread, is made while holding
  one :class:`trio.Lock`, so the agent never sees two calls at once.
* Every write has a deadline (``transfer_timeout``). A write that misses it is
  cancelled through NIXL (``release_xfer_handle``); if NIXL refuses because the
  transfer is still running, the handle stays tracked as a *zombie* and the
  pump keeps polling it. A write's callback hears of a failure only once the
  transfer is over or NIXL has released it, never while NIXL still reports it
  running: a failure lets the consumer reuse its blocks. (NIXL's release is
  its only cancel. Its UCX backend accepts it for a running transfer and
  cancels the UCX requests, which cannot recall an RDMA put already handed to
  the NIC; vLLM saw bytes land after such a release, #59790. Only a write stuck
  for the whole ``transfer_timeout`` takes this path.)

Peers are named per session (``host:port#serial``), so the same remote agent may
be registered under two names while an old session drains. NIXL keeps one
registration per remote agent (adding it again is accepted; removing it once
removes it, and invalidates every descriptor list prepared for it), so the
transport counts references: each name has its own descriptor list, and the
remote agent is removed with its last name. A peer is removed only once its
writes have ended: NIXL's state check on a transfer whose remote agent was
removed frees the transfer underneath its handle.

NIXL itself is imported lazily, when a transport is opened, from the first of
``nixl._api`` (the ``nixl`` meta package, which picks the build matching
torch's CUDA), ``nixl_cu13._api`` and ``nixl_cu12._api`` that imports.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import itertools
import logging
import math
import operator
import sys
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from types import ModuleType
from typing import TYPE_CHECKING, Protocol, cast

import attrs
import numpy as np
import numpy.typing as npt
import trio

from p2pactor.errors import ConfigError, DataPlaneError
from p2pactor.logsetup import peer_context
from p2pactor.transport import TransferError, WriteDone

if TYPE_CHECKING:
    import torch

__all__ = [
    "NixlDataTransport",
    "NixlOptions",
    "NixlStatistics",
    "import_nixl",
    "open_nixl_transport",
]

log = logging.getLogger("p2pactor.nixl")

#: Where NIXL's Python API lives, in the order tried (see the module docstring).
NIXL_API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")

_MAX_BLOCKS = 2**31 - 1  # NIXL takes descriptor indexes as int32
_IN_PROGRESS = frozenset({"PROC", "PEND"})
_RATE_WEIGHT = 0.25  # of the newest post in the moving average of post times

Index = npt.NDArray[np.int32]
Descs = npt.NDArray[np.uint64]


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


class _Agent(Protocol):
    """The part of ``nixl_agent`` this module uses, typed (handles are opaque)."""

    def get_agent_metadata(self) -> bytes: ...

    def register_memory(
        self, reg_list: list[tuple[int, int, int, str]], mem_type: str
    ) -> object: ...

    def deregister_memory(self, dereg_list: object) -> None: ...

    def prep_xfer_dlist(self, agent_name: str, xfer_list: Descs, mem_type: str) -> object: ...

    def release_dlist_handle(self, handle: object) -> None: ...

    def add_remote_agent(self, metadata: bytes) -> str | bytes: ...

    def remove_remote_agent(self, agent: str) -> None: ...

    def make_connection(self, remote_agent: str) -> None: ...

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: object,
        local_indices: Index,
        remote_xfer_side: object,
        remote_indices: Index,
    ) -> object: ...

    def transfer(self, handle: object) -> str: ...

    def check_xfer_state(self, handle: object) -> str: ...

    def release_xfer_handle(self, handle: object) -> None: ...

    def get_new_notifs(self) -> dict[str, list[bytes]]: ...


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0 or not math.isfinite(value):
        raise ConfigError(f"{attribute.name} must be a positive number, got {value!r}")


def _not_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0 or not math.isfinite(value):
        raise ConfigError(f"{attribute.name} must be a number >= 0, got {value!r}")


def _not_negative_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value < 0:
        raise ConfigError(f"{attribute.name} must be an int >= 0, got {value!r}")


@attrs.frozen(kw_only=True)
class NixlOptions:
    """How a :class:`NixlDataTransport` drives its NIXL agent.

    Times are in seconds.

    Attributes:
        transfer_timeout: How long a write may run before it is cancelled
            (vLLM's load timeout is 30 s; a write must fail before the
            consumer's load does, or at the latest with it).
        close_timeout: How long closing waits for writes still in flight
            before it releases what is left anyway.
        connect_eagerly: Connect to a peer's agent as it is added, so its first
            write does not pay the connection setup (measured 0.2-19 ms).
        backends: NIXL backends the agent instantiates.
        num_threads: Worker threads of the UCX backend (0: none, UCX's own
            default). vLLM uses 4 on large hosts; on small ones threads only
            compete with the engine.
        busy_polls: Polls of a write in flight that only yield to other trio
            tasks before the pump starts sleeping between polls.
        min_poll_interval: The pump's first sleep once the busy polls found
            nothing; it doubles up to ``max_poll_interval``. On Linux trio
            waits in epoll, whose timeout is whole milliseconds, so any sleep
            under 1 ms lasts about 1 ms there (measured 1.1-1.2 ms); finer
            polling would mean spinning on the trio thread, against the
            engine's threads for the GIL.
        max_poll_interval: The longest the pump sleeps while writes are in
            flight: the most latency polling adds to a write.
        idle_poll_interval: How often the pump drives the agent's progress
            while a peer's write into this pool is expected (the node has a
            load in flight: :meth:`NixlDataTransport.expect_writes`) and no
            write of its own is. Peers' writes may need it (for connection
            setup, and for every write on TCP). With nothing expected and
            nothing in flight the pump sleeps.
        inline_post_budget: Post a write on the trio thread when its
            ``transfer()`` is predicted to return within this many seconds
            (the longest the loop may stall for it); slower ones, and the first
            write, are posted from a worker thread. 0 always uses the thread.
            A prediction is a moving average: on a loaded machine a post can
            run twice as long (measured on 2 busy cores: 4 ms predicted, up
            to 10 ms stalled), hence a default well under the few ms a
            control message may wait. It skips the hop (0.25-0.6 ms there)
            for writes up to about 4 MiB on shared memory.
        wireup_grace: How long after registering a peer the pump keeps
            driving progress (every ``idle_poll_interval``) even with nothing
            in flight or expected: the peer's side of the connection setup
            may need our agent to answer.
    """

    transfer_timeout: float = attrs.field(default=30.0, validator=_positive)
    close_timeout: float = attrs.field(default=5.0, validator=_positive)
    connect_eagerly: bool = True
    backends: tuple[str, ...] = attrs.field(default=("UCX",), converter=tuple)
    num_threads: int = attrs.field(default=0, validator=_not_negative_int)
    busy_polls: int = attrs.field(default=4, validator=_not_negative_int)
    min_poll_interval: float = attrs.field(default=20e-6, validator=_positive)
    max_poll_interval: float = attrs.field(default=1e-3, validator=_positive)
    idle_poll_interval: float = attrs.field(default=1e-3, validator=_positive)
    inline_post_budget: float = attrs.field(default=2e-3, validator=_not_negative)
    wireup_grace: float = attrs.field(default=2.0, validator=_not_negative)

    def poll_intervals(self) -> Iterator[float]:
        """The pump's sleeps between polls that found nothing new (0: a checkpoint)."""
        yield from itertools.repeat(0.0, self.busy_polls)
        interval = self.min_poll_interval
        while True:
            yield min(interval, self.max_poll_interval)
            interval *= 2


@attrs.frozen(kw_only=True)
class NixlStatistics:
    """Counters of a :class:`NixlDataTransport`, from :meth:`~NixlDataTransport.statistics`.

    Attributes:
        peers: Peer names registered (or being registered).
        remote_agents: Distinct remote NIXL agents loaded.
        writes_in_flight: Writes started and not yet over (zombies included).
        zombies: Writes past their deadline that NIXL would not cancel yet.
        writes_done: Writes that completed.
        writes_failed: Writes that raised :class:`TransferError` after reaching NIXL.
        bytes_written: Bytes of the completed writes.
        posted_inline: Writes posted on the trio thread (predicted quick).
        progress_polls: Times the pump drove the agent's progress.
        idle: The pump sleeps: nothing in flight, nothing expected.
    """

    peers: int
    remote_agents: int
    writes_in_flight: int
    zombies: int
    writes_done: int
    writes_failed: int
    bytes_written: int
    posted_inline: int = 0
    progress_polls: int = 0
    idle: bool = False


@attrs.define(eq=False)
class _Region:
    """The node's block pool as NIXL sees it: one address range, kept alive."""

    addr: int
    nbytes: int
    keepalive: object


def _pool_region(pool: torch.Tensor | bytearray | memoryview, block_len: int) -> _Region:
    if type(block_len) is not int or block_len <= 0:
        raise ConfigError(f"block_len must be a positive int, got {block_len!r}")
    torch_mod = sys.modules.get("torch")  # a tensor exists only if torch is imported
    if torch_mod is not None and isinstance(pool, torch_mod.Tensor):
        tensor = cast("torch.Tensor", pool)
        if tensor.device.type != "cpu":
            raise ConfigError(
                f"the block pool must be in host memory (DRAM), not on {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ConfigError("the block pool tensor must be contiguous")
        region = _Region(tensor.data_ptr(), tensor.numel() * tensor.element_size(), tensor)
    else:
        try:
            view = memoryview(cast("bytearray | memoryview", pool))
        except TypeError:
            raise ConfigError(
                "the block pool must be a CPU torch tensor or a writable buffer "
                f"(bytearray, memoryview), not {type(pool).__name__}"
            ) from None
        if view.readonly or not view.c_contiguous:
            raise ConfigError("the block pool buffer must be writable and contiguous")
        view = view.cast("B")
        # from_buffer exports the buffer: a bytearray cannot be resized (and so
        # moved) while NIXL has its address registered.
        array = (ctypes.c_char * view.nbytes).from_buffer(view)
        region = _Region(ctypes.addressof(array), view.nbytes, array)
    if region.nbytes == 0 or region.nbytes % block_len:
        raise ConfigError(
            f"the block pool ({region.nbytes} bytes) must be a whole, non-zero number of "
            f"{block_len}-byte blocks"
        )
    if region.nbytes // block_len > _MAX_BLOCKS:
        raise ConfigError(f"the block pool has more than {_MAX_BLOCKS} blocks")
    return region


def _block_descs(base_addr: int, num_blocks: int, block_len: int) -> Descs:
    """One ``(address, length, device 0)`` row per block, for ``prep_xfer_dlist``."""
    descs = np.zeros((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(base_addr) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(
        block_len
    )
    descs[:, 1] = block_len
    return descs


def _nixl_error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


@attrs.define(eq=False)
class _Peer:
    """One registered peer name (several may share one remote agent)."""

    peer_id: str
    num_blocks: int
    remote: str | None = None  # NIXL's name for the peer's agent, once added
    dlist: object | None = None  # the peer's prepared per-block descriptor list
    ready: trio.Event = attrs.field(factory=trio.Event)  # the add finished, either way
    removing: bool = False
    writes: set[_Write] = attrs.field(factory=set)  # started and not over


@attrs.define(eq=False)
class _Write:
    """One write, from validation to its terminal state."""

    peer: _Peer
    local: Index
    remote: Index
    nbytes: int
    deadline: float  # on trio's clock: cancelled through NIXL if still running then
    done: WriteDone  # told the outcome exactly once, by _end
    handle: object | None = None  # NIXL's transfer handle while it is in flight
    expired: str | None = None  # why it stopped being waited for, once it did
    zombie: bool = False
    error: str | None = None
    over: bool = False


@attrs.frozen
class _Posted:
    """What posting a write in the worker thread gave."""

    handle: object | None  # in flight; None if it is already over
    error: str | None = None


@attrs.frozen
class _Added:
    """What registering a peer in the worker thread gave."""

    remote: str
    dlist: object


@attrs.define(eq=False)
class _Leftovers:
    """NIXL resources taken from a closing transport, to release in a worker thread."""

    agent: _Agent | None
    local_dlist: object | None
    registration: object | None
    handles: list[object] = attrs.field(factory=list)
    dlists: list[object] = attrs.field(factory=list)
    remotes: list[str] = attrs.field(factory=list)


class NixlDataTransport:
    """A :class:`~p2pactor.transport.DataTransport` over one NIXL agent.

    Made by :func:`open_nixl_transport`, which owns its pump task and releases
    every NIXL resource when its block exits.
    """

    def __init__(
        self,
        agent_name: str,
        region: _Region,
        block_len: int,
        options: NixlOptions,
    ) -> None:
        self._agent: _Agent | None = None  # set by _open; None again once closed
        self._agent_name = agent_name
        self._region = region
        self._block_len = block_len
        self._num_blocks = region.nbytes // block_len
        self._options = options
        self._registration: object | None = None
        self._local_dlist: object | None = None
        self._metadata = b""
        # Every call into the agent holds this lock (see the module docstring).
        self._lock = trio.Lock()
        self._peers: dict[str, _Peer] = {}
        self._remote_refs: dict[str, int] = {}  # remote agent -> peer names using it
        self._inflight: list[_Write] = []  # posted, polled by the pump
        self._to_post: deque[_Write] = deque()  # waiting for the poster task
        self._kick = trio.Event()  # new work for the pump
        self._post_kick = trio.Event()  # new work for the poster
        # Peer writes into our pool that may be running (the node's loads in
        # flight): the pump drives progress for them, and sleeps when there
        # are none and no write of ours is in flight.
        self._expected = 0
        self._wireup_until = -math.inf  # progress for peers' connection setup until then
        self._changed = trio.Event()  # some write ended or a peer was settled
        self._closing = False
        self._done = 0
        self._failed = 0
        self._bytes = 0
        self._inline = 0
        self._polls = 0
        self._idle = False
        # Seconds per byte that posts took (moving average), to predict which
        # writes are quick enough to post without the worker thread's hop.
        self._post_rate: float | None = None

    # --- setup and teardown ------------------------------------------------------------

    def _open(self, api: ModuleType) -> None:
        """Make the agent, register the pool and prepare its descriptors (worker thread)."""
        options = self._options
        try:
            config = api.nixl_agent_config(
                enable_prog_thread=False,
                backends=list(options.backends),
                num_threads=options.num_threads,
            )
            agent = cast(_Agent, api.nixl_agent(self._agent_name, config))
        except Exception as exc:
            raise DataPlaneError(
                f"cannot create the NIXL agent ({_nixl_error(exc)}); check that the NIXL "
                f"wheel has the {'/'.join(options.backends)} backend plugin(s)"
            ) from exc
        region = self._region
        try:
            self._registration = agent.register_memory(
                [(region.addr, region.nbytes, 0, "")], mem_type="DRAM"
            )
            self._local_dlist = agent.prep_xfer_dlist(
                "NIXL_INIT_AGENT",
                _block_descs(region.addr, self._num_blocks, self._block_len),
                mem_type="DRAM",
            )
            # Taken after registering: the metadata carries the registered region.
            self._metadata = agent.get_agent_metadata()
        except Exception as exc:
            self._release_all(_Leftovers(agent, self._local_dlist, self._registration))
            raise DataPlaneError(
                f"cannot register the {region.nbytes}-byte block pool with NIXL: {_nixl_error(exc)}"
            ) from exc
        self._agent = agent

    def _leftovers(self) -> _Leftovers | None:
        """Take every NIXL resource still held, for :meth:`_release_all` (lock held)."""
        agent = self._agent
        if agent is None:
            return None
        left = _Leftovers(
            agent,
            self._local_dlist,
            self._registration,
            handles=[w.handle for w in self._inflight],
            dlists=[p.dlist for p in self._peers.values() if p.dlist is not None],
            remotes=list(self._remote_refs),
        )
        self._agent = self._local_dlist = self._registration = None
        for peer in self._peers.values():
            peer.dlist = None  # its wrapper keeps the native agent alive
        self._peers.clear()
        self._remote_refs.clear()
        return left

    def _release_all(self, left: _Leftovers) -> None:
        """Release what :meth:`_leftovers` took, in dependency order (worker thread).

        Each release is attempted on its own: one that fails is logged and does
        not keep the others (in particular the memory registration) alive.
        """
        agent = left.agent
        if agent is None:
            return

        def attempt(what: str, call: Callable[[], object]) -> None:
            try:
                call()
            except Exception as exc:
                log.warning(
                    "NIXL agent %s: %s failed: %s; its NIXL state leaks until the process "
                    "exits (NIXL_LOG_LEVEL=INFO shows why)",
                    self._agent_name,
                    what,
                    exc,
                )

        for handle in left.handles:
            attempt("releasing a write in flight", partial(agent.release_xfer_handle, handle))
        for dlist in left.dlists:
            attempt("releasing a peer's descriptors", partial(agent.release_dlist_handle, dlist))
        for remote in left.remotes:
            attempt(f"removing remote agent {remote}", partial(agent.remove_remote_agent, remote))
        if left.local_dlist is not None:
            attempt(
                "releasing the pool's descriptors",
                partial(agent.release_dlist_handle, left.local_dlist),
            )
        if left.registration is not None:
            attempt("deregistering the pool", partial(agent.deregister_memory, left.registration))
        # The agent (and its UCX context) goes with its last reference, here, in
        # this thread: tearing UCX down can take a while.
        left.agent = None
        del agent

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

    # --- the DataTransport interface --------------------------------------------------

    @property
    def agent_name(self) -> str:
        """This agent's NIXL name (unique: it ends with a uuid)."""
        return self._agent_name

    @property
    def agent_metadata(self) -> bytes:
        """The agent's NIXL metadata, for peers' ``add_remote_agent``."""
        return self._metadata

    @property
    def base_addr(self) -> int:
        """Address of block 0 of the pool."""
        return self._region.addr

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._num_blocks

    @property
    def block_len(self) -> int:
        """Bytes per block."""
        return self._block_len

    def statistics(self) -> NixlStatistics:
        """Counters, for tests and monitoring."""
        return NixlStatistics(
            peers=len(self._peers),
            remote_agents=len(self._remote_refs),
            writes_in_flight=sum(len(p.writes) for p in self._peers.values()),
            zombies=sum(w.zombie for w in self._inflight),
            writes_done=self._done,
            writes_failed=self._failed,
            bytes_written=self._bytes,
            posted_inline=self._inline,
            progress_polls=self._polls,
            idle=self._idle,
        )

    async def add_peer(
        self,
        peer_id: str,
        agent_metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
    ) -> None:
        """Register a peer's pool: its agent, and one descriptor per block.

        The NIXL work (O(num_blocks)) runs in a worker thread.

        Raises:
            TransferError: The name is taken, the pool does not match ours, or
                NIXL rejects the peer's metadata or pool.
        """
        if self._closing:
            raise TransferError("the NIXL transport is closed")
        if block_len != self._block_len:
            raise TransferError(
                f"{peer_id} uses {block_len}-byte blocks, this node {self._block_len}"
            )
        if not 0 < num_blocks <= _MAX_BLOCKS or base_addr <= 0:
            raise TransferError(
                f"{peer_id} advertised an impossible pool ({num_blocks} blocks at {base_addr:#x})"
            )
        if peer_id in self._peers:
            raise TransferError(f"{peer_id} is already registered; remove it first")
        peer = _Peer(peer_id, num_blocks)
        self._peers[peer_id] = peer
        self._wireup_until = trio.current_time() + self._options.wireup_grace
        self._kick.set()
        outcome: _Added | str = "cancelled"
        try:
            async with self._lock:
                agent = self._live_agent()
                known = frozenset(self._remote_refs)
                outcome = await trio.to_thread.run_sync(
                    self._add_sync, agent, agent_metadata, base_addr, num_blocks, known
                )
                # No checkpoint from here on: even if we were cancelled meanwhile,
                # what the thread made is recorded (and released by remove or close).
                if isinstance(outcome, _Added):
                    peer.remote, peer.dlist = outcome.remote, outcome.dlist
                    self._remote_refs[outcome.remote] = self._remote_refs.get(outcome.remote, 0) + 1
        finally:
            peer.ready.set()
            if not isinstance(outcome, _Added) and self._peers.get(peer_id) is peer:
                del self._peers[peer_id]
            self._signal()
        if isinstance(outcome, str):
            raise TransferError(f"cannot register {peer_id}'s pool with NIXL: {outcome}")
        log.debug(
            "NIXL agent %s: %s registered (agent %s)",
            self._agent_name,
            peer_id,
            peer.remote,
            extra=peer_context(peer_id),
        )

    def _add_sync(
        self,
        agent: _Agent,
        metadata: bytes,
        base_addr: int,
        num_blocks: int,
        known: frozenset[str],
    ) -> _Added | str:
        """The NIXL half of :meth:`add_peer` (worker thread, lock held)."""
        try:
            name = agent.add_remote_agent(metadata)
        except Exception as exc:
            return f"its agent metadata was rejected ({_nixl_error(exc)})"
        remote = name.decode() if isinstance(name, bytes) else name
        dlist: object | None = None
        try:
            dlist = agent.prep_xfer_dlist(
                remote, _block_descs(base_addr, num_blocks, self._block_len), mem_type="DRAM"
            )
            if self._options.connect_eagerly:
                agent.make_connection(remote)
        except Exception as exc:
            if dlist is not None:
                try:
                    agent.release_dlist_handle(dlist)
                except Exception as release_exc:
                    log.warning("releasing a peer's descriptors failed: %s", release_exc)
            # Another name may use this agent: only a first registration is undone.
            if remote not in known:
                try:
                    agent.remove_remote_agent(remote)
                except Exception as remove_exc:
                    log.warning("removing remote agent %s failed: %s", remote, remove_exc)
            return _nixl_error(exc)
        return _Added(remote, dlist)

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
        if self._peers.get(peer_id) is not peer:
            return  # removed meanwhile by another call
        del self._peers[peer_id]
        if peer.remote is None:
            return
        with trio.CancelScope(shield=True):  # half a removal would leak the agent
            async with self._lock:
                agent = self._agent
                refs = self._remote_refs.get(peer.remote, 0) - 1
                if refs > 0:
                    self._remote_refs[peer.remote] = refs
                else:
                    self._remote_refs.pop(peer.remote, None)
                if agent is not None:
                    await trio.to_thread.run_sync(
                        self._remove_sync, agent, peer.dlist, peer.remote if refs <= 0 else None
                    )
        log.debug(
            "NIXL agent %s: %s removed", self._agent_name, peer_id, extra=peer_context(peer_id)
        )

    def _remove_sync(self, agent: _Agent, dlist: object, remote: str | None) -> None:
        """The NIXL half of :meth:`remove_peer` (worker thread, lock held)."""
        try:
            agent.release_dlist_handle(dlist)
        except Exception as exc:
            log.warning("NIXL agent %s: releasing descriptors failed: %s", self._agent_name, exc)
        if remote is not None:
            try:
                agent.remove_remote_agent(remote)
            except Exception as exc:
                log.warning(
                    "NIXL agent %s: removing remote agent %s failed: %s",
                    self._agent_name,
                    remote,
                    exc,
                )

    def start_write(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> None:
        """Start one NIXL WRITE of our ``local_blocks`` into the peer's ``remote_blocks``.

        Never blocks. ``done`` is told the outcome exactly once, on the trio
        thread (possibly before this returns): None once NIXL reports every
        byte written; otherwise why not, once NIXL reports the write over or
        has released (cancelled) it. The peer and the indexes are checked
        before NIXL is asked anything.

        A write predicted to post quickly (see ``inline_post_budget``) is
        posted right here when the agent is free; others go to the poster
        task, which posts them in order from a worker thread. The pump polls
        it to its end, and cancels it if it runs past ``transfer_timeout``.
        """
        self._start(peer_id, local_blocks, remote_blocks, done)

    def _start(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> _Write | None:
        try:
            peer, local, remote = self._checked(peer_id, local_blocks, remote_blocks)
        except TransferError as exc:
            _tell(done, str(exc))
            return None
        if not len(local):
            _tell(done, None)
            return None
        deadline = trio.current_time() + self._options.transfer_timeout
        write = _Write(peer, local, remote, len(local) * self._block_len, deadline, done)
        peer.writes.add(write)
        if not self._to_post and self._quick(write):
            try:
                self._lock.acquire_nowait()
            except trio.WouldBlock:
                pass  # a worker thread holds the agent: queue behind it
            else:
                try:
                    self._inline += 1
                    self._posted(write, self._post_sync(self._live_agent(), write))
                finally:
                    self._lock.release()
                return write
        self._to_post.append(write)
        self._post_kick.set()
        return write

    def _checked(
        self, peer_id: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> tuple[_Peer, Index, Index]:
        peer = self._peers.get(peer_id)
        if self._closing or self._agent is None:
            raise TransferError("the NIXL transport is closed")
        if peer is None or peer.removing or peer.dlist is None:
            raise TransferError(f"{peer_id} is not registered")
        if len(local_blocks) != len(remote_blocks):
            raise TransferError(
                f"{len(local_blocks)} local blocks but {len(remote_blocks)} remote blocks"
            )
        local = _indexes(local_blocks, self._num_blocks, "local")
        remote = _indexes(remote_blocks, peer.num_blocks, f"{peer_id}'s")
        return peer, local, remote

    def _quick(self, write: _Write) -> bool:
        """Whether the write's post is predicted quicker than the worker thread's round trip."""
        rate = self._post_rate
        return rate is not None and rate * write.nbytes <= self._options.inline_post_budget

    async def write(
        self, peer_id: str, local_blocks: Sequence[int], remote_blocks: Sequence[int]
    ) -> None:
        """Write our ``local_blocks`` into the peer's ``remote_blocks`` and wait for the end.

        :meth:`start_write` for a caller that waits. If the calling task is
        cancelled meanwhile, the write is cancelled through NIXL (or polled
        until it ends); :meth:`remove_peer` and closing wait for it either way.

        Raises:
            TransferError: The peer is unknown, an index is out of range, NIXL
                failed the write, or it missed its deadline. It is raised only
                once NIXL reports the write over or has released (cancelled) it.
        """
        over = trio.Event()
        outcome: list[str | None] = []

        def done(error: str | None) -> None:
            outcome.append(error)
            over.set()

        write = self._start(peer_id, local_blocks, remote_blocks, done)
        try:
            await over.wait()
        except BaseException:
            if write is not None and not write.over:
                write.expired = write.expired or "the writing task was cancelled"
                self._kick.set()
            raise
        if outcome[0] is not None:
            raise TransferError(outcome[0])

    def expect_writes(self, delta: int) -> None:
        """``delta`` more (or fewer) peer writes into our pool may be running now.

        While any may, the pump drives the agent's progress every
        ``idle_poll_interval``: a write into an agent that nobody progresses
        can stay in flight (on TCP, every write). With none expected and none
        of our own in flight, the pump sleeps.
        """
        self._expected = max(0, self._expected + delta)
        if delta > 0:
            self._kick.set()

    def _posted(self, write: _Write, posted: _Posted) -> None:
        """Track a posted write (no checkpoint before this: nothing may lose the handle)."""
        if posted.handle is not None:
            write.handle = posted.handle
            self._inflight.append(write)
            self._kick.set()
        else:
            self._end(write, posted.error)

    async def _poster(self) -> None:
        """Post queued writes in order: from a worker thread, unless predicted quick."""
        while True:
            while not self._to_post:
                await self._post_kick.wait()
                self._post_kick = trio.Event()
            write = self._to_post.popleft()
            if trio.current_time() >= write.deadline:
                self._end(write, "timed out waiting to reach the NIXL agent", failed=False)
                continue
            async with self._lock:
                agent = self._agent
                if self._closing or agent is None:
                    self._end(write, "the NIXL transport is closed", failed=False)
                    continue
                if self._quick(write):
                    self._inline += 1
                    posted = self._post_sync(agent, write)
                else:
                    posted = await trio.to_thread.run_sync(self._post_sync, agent, write)
                self._posted(write, posted)

    def _post_sync(self, agent: _Agent, write: _Write) -> _Posted:
        """Make and post the WRITE (worker thread or trio thread, lock held).

        ``transfer()`` may copy everything before it returns (shared memory):
        then the handle is released here and the write is over already. How
        long the post took feeds the prediction of which posts may run inline.
        """
        start = time.perf_counter()
        try:
            handle = agent.make_prepped_xfer(
                "WRITE", self._local_dlist, write.local, write.peer.dlist, write.remote
            )
        except Exception as exc:
            return _Posted(None, f"NIXL could not prepare the write: {_nixl_error(exc)}")
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            state, why = "ERR", _nixl_error(exc)
        else:
            why = f"transfer() returned {state}"
            rate = (time.perf_counter() - start) / write.nbytes
            old = self._post_rate  # one writer at a time: the lock is held
            self._post_rate = rate if old is None else old + _RATE_WEIGHT * (rate - old)
        if state in _IN_PROGRESS:
            return _Posted(handle)
        try:
            agent.release_xfer_handle(handle)
        except Exception as exc:
            if state != "DONE":
                # NIXL will not let go of a failed post: poll it like any other.
                log.warning("NIXL agent %s: releasing a failed write: %s", self._agent_name, exc)
                return _Posted(handle)
            log.warning("NIXL agent %s: releasing a finished write: %s", self._agent_name, exc)
        if state == "DONE":
            return _Posted(None)
        return _Posted(None, f"NIXL failed the write: {why}")

    # --- the pump ---------------------------------------------------------------------

    async def _pump(self) -> None:
        """Poll writes in flight and drive the agent's progress while anything may run.

        With no write of ours in flight and none of a peer's expected, it
        sleeps until :meth:`start_write` or :meth:`expect_writes` wakes it: an
        idle node costs nothing.
        """
        intervals = self._options.poll_intervals()
        while True:
            busy = bool(self._inflight)
            if not busy and self._expected <= 0 and trio.current_time() >= self._wireup_until:
                self._idle = True
                await self._kick.wait()
                self._idle = False
                self._kick = trio.Event()
                intervals = self._options.poll_intervals()
                continue
            async with self._lock:
                progressed = self._poll_round() if busy else self._drive_progress()
            if progressed:
                intervals = self._options.poll_intervals()
                continue
            kick = self._kick
            interval = next(intervals) if busy else self._options.idle_poll_interval
            if interval == 0:
                await trio.lowlevel.checkpoint()
            else:
                with trio.move_on_after(interval):
                    await kick.wait()
            if kick.is_set():
                self._kick = trio.Event()
                intervals = self._options.poll_intervals()

    def _drive_progress(self) -> bool:
        """Let the agent make progress (lock held). Returns False: nothing of ours changed."""
        agent = self._agent
        if agent is None:
            return False
        self._polls += 1
        try:
            notifs = agent.get_new_notifs()
        except Exception as exc:
            log.warning("NIXL agent %s: get_new_notifs failed: %s", self._agent_name, exc)
            return False
        if notifs:
            # We attach no notifications and vLLM's tier sends none: drop them.
            log.debug(
                "NIXL agent %s: ignoring notifications from %s", self._agent_name, list(notifs)
            )
        return False

    def _poll_round(self) -> bool:
        """Check every write in flight once (lock held). Returns whether one ended."""
        agent = self._agent
        if agent is None:
            return False
        self._drive_progress()
        ended = False
        now = trio.current_time()
        for write in list(self._inflight):
            if write.expired is None and now >= write.deadline:
                # Unbounded after this on purpose: failing while NIXL may still
                # write would let the consumer reuse blocks under a running WRITE.
                write.expired = f"no completion within {self._options.transfer_timeout:g} s"
            try:
                state = agent.check_xfer_state(write.handle)
            except Exception as exc:
                state, why = "ERR", _nixl_error(exc)
            else:
                why = f"NIXL reported {state}"
            if state == "DONE":
                try:
                    agent.release_xfer_handle(write.handle)
                except Exception as exc:  # the bytes are there; only the handle leaks
                    log.warning(
                        "NIXL agent %s: releasing a finished write: %s", self._agent_name, exc
                    )
                late = write.expired
                self._end(write, f"{late}; it completed only afterwards" if late else None)
                ended = True
            elif state in _IN_PROGRESS:
                if write.expired is not None and self._release(agent, write):
                    self._end(write, f"{write.expired}; NIXL cancelled it")
                    ended = True
            elif self._release(agent, write):
                self._end(write, f"NIXL failed the write: {why}")
                ended = True
        return ended

    def _release(self, agent: _Agent, write: _Write) -> bool:
        """Release (cancel, if running) a write's handle. False: NIXL refused."""
        try:
            agent.release_xfer_handle(write.handle)
        except Exception as exc:
            if not write.zombie:
                write.zombie = True
                log.warning(
                    "NIXL agent %s: a write to %s cannot be released yet (%s); "
                    "polling it until it ends",
                    self._agent_name,
                    write.peer.peer_id,
                    _nixl_error(exc),
                    extra=peer_context(write.peer.peer_id),
                )
            return False
        return True

    def _end(self, write: _Write, error: str | None, *, failed: bool = True) -> None:
        """Record that ``write`` is over (no part of it can still run) and say so."""
        if write.over:
            return
        write.over = True
        write.error = error
        write.handle = None
        if write in self._inflight:
            self._inflight.remove(write)
        write.peer.writes.discard(write)
        if error is None:
            self._done += 1
            self._bytes += write.nbytes
        elif failed:
            self._failed += 1
        self._signal()
        _tell(write.done, error)

    # --- helpers ----------------------------------------------------------------------

    def _live_agent(self) -> _Agent:
        if self._agent is None or self._closing:
            raise TransferError("the NIXL transport is closed")
        return self._agent

    def _signal(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()


def _tell(done: WriteDone, error: str | None) -> None:
    try:
        done(error)
    except Exception:
        # The caller's bug must not stop the pump (every other write).
        log.exception(
            "a write's completion callback failed (a bug in p2pactor: please report it with "
            "this traceback)"
        )


def _indexes(blocks: Sequence[int], limit: int, whose: str) -> Index:
    """``blocks`` as NIXL's int32 index array, each checked to be in ``[0, limit)``."""
    try:
        values = [operator.index(b) for b in blocks]
    except TypeError:
        raise TransferError(f"{whose} block indexes must be ints") from None
    bad = next((b for b in values if not 0 <= b < limit), None)
    if bad is not None:
        raise TransferError(f"{whose} block index {bad} is out of range (0..{limit - 1})")
    return np.array(values, dtype=np.int32)


@asynccontextmanager
async def open_nixl_transport(
    pool: torch.Tensor | bytearray | memoryview,
    block_len: int,
    *,
    name: str | None = None,
    options: NixlOptions | None = None,
) -> AsyncIterator[NixlDataTransport]:
    """Open a NIXL agent over the node's block pool, and run it until the block exits.

    The pool is registered once as one DRAM region and its per-block descriptors
    are prepared once (in a worker thread). On exit, writes still in flight get
    ``close_timeout`` to end; then every transfer, descriptor list and remote
    agent is released and the pool is deregistered.

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
    region = _pool_region(pool, block_len)
    agent_name = f"{name}-{uuid.uuid4()}" if name else str(uuid.uuid4())
    transport = NixlDataTransport(agent_name, region, block_len, options)
    await trio.to_thread.run_sync(transport._open, api)
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
            async with transport._lock:
                unfinished = list(transport._inflight)
                left = transport._leftovers()
                if left is not None:
                    await trio.to_thread.run_sync(transport._release_all, left)
            region.keepalive = None  # a bytearray pool may be resized again
            # Released with the agent: its endpoints are closed, nothing more lands.
            for write in unfinished:
                transport._end(write, "the NIXL transport closed while it was in flight")
