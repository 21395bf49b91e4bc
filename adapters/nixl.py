"""The data transport over NIXL, on trio, wire-compatible with vLLM 0.33.0's P2P tier.

A producer WRITEs its pinned blocks straight into the consumer's blocks, one
prepared NIXL transfer per fetch, exactly as vLLM's ``NixlTransport`` does, so a
p2pactor node and a stock vLLM node move bytes into each other's pools:

* the node's whole block pool is **one DRAM registration**, and its descriptor
  list is prepared **once**;
* a peer's pool (advertised in ``connect``: agent metadata, base address, block
  count and size) gets one ``add_remote_agent`` and one remote descriptor list,
  prepared once per peer;
* each list is **one strided row** (address, block length, device, stride,
  count: NIXL 1.5's Nx5 descriptor array), which NIXL indexes block by block as
  it would a list of one row per block (vLLM's), at a cost that does not grow
  with the block count: a peer advertising 4,000,000 blocks cost 274 MiB and a
  0.1 s GIL hold with per-block lists (issue 30). A peer whose pool NIXL will
  not take as one row (it spans several registrations) gets a per-block list, up
  to 65,536 blocks;
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
  write). It backs off when nothing changes (see
  :meth:`NixlOptions.poll_intervals`), is kicked by an event when new work
  arrives, and with nothing in flight it sleeps until there is.
* A *target's* progress matters too: a WRITE into an agent that nobody
  progresses can stay in flight forever (measured: a 1 MiB WRITE stalled until
  the target polled; on TCP, every write, and connection setup too). By default
  **NIXL's own progress thread** does it: a C++ thread that sleeps in
  ``poll()`` on the UCX worker's event fd, so it runs, without the GIL, the
  moment a peer's bytes arrive. Over TCP that sets how fast a peer's write
  lands: 0.78 of raw NIXL across hosts at 64 x 1 MiB, against 0.61 when the
  pump drove progress every 1 ms. NIXL's Python wrapper hard-codes the
  thread's periodic wakeup to 0, a ``poll()`` that never sleeps (measured 2.0
  cores for two idle agents); the transport sets
  :attr:`NixlOptions.progress_thread_wakeup` (100 ms) on the binding instead.
  With the thread off (``progress_thread_wakeup=None``) the pump drives the
  agent's progress (``get_new_notifs``) while a peer's write into our pool may
  be running (:meth:`~NixlDataTransport.expect_writes`, and ``wireup_grace``
  after a peer is added).
* ``transfer()`` may do the whole copy **inside the call** on shared memory
  (measured 20-40 ms for 64 MiB), and peer registration loads the peer's
  metadata and may connect. Both run in a worker thread
  (``trio.to_thread.run_sync``) so the event loop never stalls on them; polls
  run on the trio thread. The hop to the worker thread and back costs about
  0.25-0.4 ms, though, so a write predicted quick (``inline_post_budget``) is
  posted on the trio thread, right inside ``start_write``; small writes (and
  every write on RDMA, where ``transfer()`` only queues) skip the hop. The first
  write, and any write predicted slower, goes to the one *poster* task, which
  posts writes in order from a worker thread.
* The agent runs with ``NIXL_THREAD_SYNC_NONE``: its API is not thread-safe.
  Every call into it is made while holding one :class:`trio.Lock`, or (a
  quick write posted right inside ``start_write``) on the trio thread while
  nobody holds it, so the agent never sees two calls at once.
  (NIXL's progress thread touches only the UCX worker, which NIXL then creates
  in UCX's multi-threaded mode, ``UCS_THREAD_MODE_MULTI``: NIXL's
  ``makeMtType`` in its UCX plugin picks it whenever the progress thread is
  on; and the notification list, behind NIXL's own mutex.)
* **A peer's write cannot be recalled**, so the data path bounds how long one
  may still land once its peer went silent (``late_write_window``, which a
  consumer holds a lost load's blocks for). Before it makes its agent the
  transport sets ``UCX_TCP_USER_TIMEOUT`` and UCX's TCP keepalive in the
  *process* environment, where UCX reads them, unless they are set already
  (:attr:`NixlOptions.tcp_timeout`); the window follows the value in effect.
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

The code: options and counters in ``_nixl_options``; the transport is one
class in three layers: the pool and the calls into the agent (``_nixl_agent``),
writes (poster, pump; ``_nixl_writes``), peers and closing (``_nixl_transport``).
"""

from __future__ import annotations

import functools
import importlib
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType
from typing import TYPE_CHECKING

import trio

from p2pactor.adapters._nixl_options import NixlOptions, NixlStatistics
from p2pactor.adapters._nixl_transport import NixlDataTransport
from p2pactor.errors import DataPlaneError

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
