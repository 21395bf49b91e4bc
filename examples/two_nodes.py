"""Two p2pactor nodes in one process, sharing KV blocks both ways.

Each node has an in-process block cache (the engine's cache, in a real engine)
and talks to the other over in-memory transports: the same node code runs over
ZeroMQ and NIXL between processes. Node A pulls the blocks B holds and B pulls
A's, at the same time; then each node's event log is replayed to show it
rebuilds exactly what the live actors knew.

Run it with ``python examples/two_nodes.py``.
"""

from __future__ import annotations

import hashlib

import trio

from p2pactor import EmbeddedCache, EventLog, LookupResult, Node, NodeConfig, fold, open_node
from p2pactor.testing import MemoryDataPlane, MemoryNetwork

BLOCK_LEN = 256


def key(i: int) -> bytes:
    """The offload key of block ``i`` of some prompt: a hash and a group index."""
    return hashlib.sha256(f"prompt block {i}".encode()).digest() + b"\x00\x00\x00\x00"


def contents(k: bytes) -> bytes:
    """What the engine computed for key ``k`` (stand-in KV bytes)."""
    return hashlib.sha256(k).digest() * (BLOCK_LEN // 32)


async def pull(node: Node, cache: EmbeddedCache, peer: str, request: str, keys: list[bytes]) -> int:
    """Ask ``peer`` about ``keys``, fetch the hits into free blocks, keep them."""
    answers = await node.lookup(peer, request, keys)
    hits = [k for k, a in zip(keys, answers, strict=True) if a is LookupResult.HIT]
    blocks = cache.allocate(len(hits))
    result = await node.fetch(peer, request, hits, blocks)
    for k, block in zip(hits, blocks, strict=True):
        if result.success:
            cache.commit(k, block)
    node.finish(request)
    return result.blocks


async def main() -> None:
    """Start two nodes, share blocks both ways, replay the logs."""
    network, plane = MemoryNetwork(), MemoryDataPlane()
    configs = [NodeConfig(host=h, port=5710, num_blocks=64, block_len=BLOCK_LEN) for h in "ab"]
    caches = [EmbeddedCache(c.num_blocks, c.block_len) for c in configs]
    logs = [EventLog(c.node_id, keep=None) for c in configs]
    for i in range(16):  # A computed blocks 0..7 of the prompt, B blocks 8..15
        caches[i // 8].store(key(i), contents(key(i)))

    async with (
        open_node(
            configs[0],
            control=network.transport(configs[0].node_id),
            data=plane.transport(caches[0].memory, BLOCK_LEN),
            parent=caches[0],
            event_log=logs[0],
        ) as a,
        open_node(
            configs[1],
            control=network.transport(configs[1].node_id),
            data=plane.transport(caches[1].memory, BLOCK_LEN),
            parent=caches[1],
            event_log=logs[1],
        ) as b,
    ):
        got: dict[str, int] = {}

        async def a_pulls() -> None:
            got["a"] = await pull(a, caches[0], b.node_id, "a-req", [key(i) for i in range(8, 20)])

        async def b_pulls() -> None:
            got["b"] = await pull(b, caches[1], a.node_id, "b-req", [key(i) for i in range(8)])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(a_pulls)
            nursery.start_soon(b_pulls)
        print(f"a pulled {got['a']} blocks from b; b pulled {got['b']} blocks from a")
        assert all(caches[0].read(key(i)) == contents(key(i)) for i in range(8, 16))
        assert all(caches[1].read(key(i)) == contents(key(i)) for i in range(8))
        await trio.sleep(0.1)  # let the finishes settle

    for node_log in logs:
        actors = {e.actor for e in node_log.recent()}
        for actor in sorted(actors, key=str):
            state = fold(node_log.recent(actor))
            print(f"{node_log.node_id}  {actor}  -> {state.phase.value}")
    print("bytes equal on both sides")


if __name__ == "__main__":
    trio.run(main)
