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
  the node's loop is blocked meanwhile on purpose).
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import trio

from p2pactor.programs.bench._control_common import open_bench_node, say
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


async def _serve(num_blocks: int, block_len: int, address: str) -> None:
    import torch  # noqa: PLC0415 - only the benchmark's processes need torch

    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    pool = torch.zeros(num_blocks * block_len, dtype=torch.uint8)
    cache = EmbeddedCache(num_blocks, block_len, memory=pool.numpy().data)
    for i, key in enumerate(bench_keys(num_blocks, block_len)):
        cache.store(key, block_content(i, block_len))
    raw = RawAgent(pool.data_ptr(), num_blocks, block_len)
    async with (
        open_bench_node(
            0, pool, block_len, name="bench-producer", parent=cache, host=address, **CONFIG
        ) as node,
        open_operator_surface(node),  # as deployed: with its metrics
    ):
        blocks = [cache.block_of(k) for k in bench_keys(num_blocks, block_len)]
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
    """Entry point: ``NUM_BLOCKS BLOCK_LEN ADDRESS``."""
    trio.run(_serve, int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])


if __name__ == "__main__":
    main()
