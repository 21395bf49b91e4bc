"""The producer process of ``p2pactor bench``'s ``dataplane`` and ``hosts`` sections.

Run as ``python -m p2pactor.programs.bench._dataplane_peer NUM_BLOCKS BLOCK_LEN ADDRESS``
(its node binds ADDRESS). It stores ``NUM_BLOCKS`` deterministic blocks
(:func:`bench_keys`, :func:`block_content`) in a node on real transports (ZeroMQ,
NIXL over a torch pool), opens a second, bare NIXL agent over the same pool for the
raw-NIXL reference, says ``READY {"node_id", "blocks"}`` and answers
:class:`~p2pactor.programs.bench._control_common.LineProcess` commands until its
stdin closes:

* ``{"cmd": "raw_peer", "metadata": hex, "base_addr": n, "num_blocks": n}``:
  add the consumer's bare agent as the raw agent's peer;
* ``{"cmd": "raw", "local": [...], "remote": [...], "iters": n}``: ``n`` raw
  WRITEs, each timed alone (post, then poll until DONE, no trio in between:
  the node's loop is blocked meanwhile on purpose);
* ``{"cmd": "trace"}``: the node's write timestamps since the last ``trace``
  (``time.perf_counter``, CLOCK_MONOTONIC on Linux: comparable with the
  consumer's), its loop's longest gap, its CPU seconds and write counters.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import trio
import trio.lowlevel

from p2pactor.programs.bench._control_common import say
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.quotas import PeerQuotas
from p2pactor.runtime.samples import chain_keys

HASH_SEED = "p2pactor-bench"
"""The hash seed both nodes of the benchmark advertise."""


CONFIG: dict[str, Any] = {"hash_seed": HASH_SEED, "quotas": PeerQuotas(pinned_blocks_fraction=1.0)}
"""Both nodes' :class:`~p2pactor.runtime.config.NodeConfig` fields beyond the pool's.

A peer may pin every block: the bench fetches whole pools at once."""


def bench_keys(count: int, block_len: int) -> list[bytes]:
    """The keys of the ``count`` blocks the producer holds (one prompt's chain)."""
    return chain_keys(HASH_SEED, [f"bench {block_len} block {i}" for i in range(count)])


def block_content(index: int, block_len: int) -> bytes:
    """The bytes of block ``index`` (cheap to make, different per block)."""
    return np.random.default_rng(index).bytes(block_len)


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


def _instrument(data: Any, trace: list[tuple[float, ...]]) -> None:
    """Record each write's (started, posted in thread, transfer() returned, done).

    Wrappers shadow the methods, for this process only: the transport's code
    is what runs, the timestamps are added around it. Every post, inline or
    from the poster's thread, goes through the pool's ``post``; the pool is
    slotted, so its class is patched (this process has one pool).
    """
    pool_type = type(data._pool)
    post_sync: Callable[..., Any] = pool_type.post
    start_write: Callable[..., None] = data.start_write
    posts: list[tuple[float, float]] = []

    def timed_post(pool: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return post_sync(pool, *args)
        finally:
            posts.append((start, time.perf_counter()))

    def timed_start(peer: str, local: Any, remote: Any, done: Callable[[str | None], None]) -> None:
        called = time.perf_counter()
        posts.clear()

        def timed_done(error: str | None) -> None:
            finished = time.perf_counter()
            post = posts[-1] if posts else (called, called)
            trace.append((called, post[0], post[1], finished))
            done(error)

        start_write(peer, local, remote, timed_done)

    setattr(pool_type, "post", timed_post)  # noqa: B010 - shadowing a method on purpose
    setattr(data, "start_write", timed_start)  # noqa: B010


async def _serve(num_blocks: int, block_len: int, address: str) -> None:
    import torch  # noqa: PLC0415 - only the benchmark's processes need torch

    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.programs.demo.node import _commands  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    pool = torch.zeros(num_blocks * block_len, dtype=torch.uint8)
    cache = EmbeddedCache(num_blocks, block_len, memory=pool.numpy().data)
    for i, key in enumerate(bench_keys(num_blocks, block_len)):
        cache.store(key, block_content(i, block_len))
    raw = RawAgent(pool.data_ptr(), num_blocks, block_len)
    trace: list[tuple[float, ...]] = []
    gaps = [0.0]  # the loop's longest gap since the last trace
    commands_send, commands = trio.open_memory_channel[dict[str, Any]](16)

    async def ticker() -> None:
        # A 1 ms sleeper: its longest gap is how long the loop stalled (plus
        # about 1 ms of sleep), e.g. on a write posted inline.
        last = time.perf_counter()
        while True:
            await trio.sleep(0.001)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    async with (
        open_zmq_transport(f"{address}:0", port=0) as control,
        open_nixl_transport(pool, block_len, name="bench-producer") as data,
        trio.open_nursery() as nursery,
    ):
        _instrument(data, trace)
        nursery.start_soon(_commands, trio.lowlevel.FdStream(os.dup(0)), commands_send)
        nursery.start_soon(ticker)
        host, port = control.local_id.rsplit(":", 1)
        config = NodeConfig(
            host=host, port=int(port), num_blocks=num_blocks, block_len=block_len, **CONFIG
        )
        async with (
            open_node(config, control=control, data=data, parent=cache) as node,
            open_operator_surface(node),  # as deployed: with its metrics
        ):
            blocks = [cache.block_of(k) for k in bench_keys(num_blocks, block_len)]
            say("READY " + json.dumps({"node_id": node.node_id, "blocks": blocks}))
            async for cmd in commands:
                if cmd["cmd"] == "raw_peer":
                    raw.add_peer(
                        bytes.fromhex(cmd["metadata"]), cmd["base_addr"], cmd["num_blocks"]
                    )
                    say({})
                elif cmd["cmd"] == "raw":
                    times = [raw.write(cmd["local"], cmd["remote"]) for _ in range(cmd["iters"])]
                    gaps[0] = 0.0  # the raw loop blocked this loop on purpose
                    say({"times": times})
                elif cmd["cmd"] == "trace":
                    stats = data.statistics()
                    reply = {"writes": trace[:], "max_gap": gaps[0], "cpu": time.process_time()}
                    say(reply | {"inline": stats.posted_inline, "done": stats.writes_done})
                    trace.clear()
                    gaps[0] = 0.0
        nursery.cancel_scope.cancel()
    raw.close()


def main() -> None:
    """Entry point: ``NUM_BLOCKS BLOCK_LEN ADDRESS``."""
    trio.run(_serve, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


if __name__ == "__main__":
    main()
