"""Fetch KV blocks from a ``p2pactor serve`` process over real ZeroMQ and NIXL.

This is how you wire p2pactor into your own engine: start (or find) a serving
node, open your own node on real transports with your block pool, look up the
keys of a prompt and fetch the hits into blocks of your pool.

The script starts ``p2pactor serve --preload 16`` itself (a node holding 16
blocks of a known prompt), fetches those blocks, checks every byte, and stops
the server. Run it with ``python examples/serve_and_fetch.py``.

For the whole picture in one command, run ``p2pactor demo`` (N nodes as
processes, each fetching from the others, with a summary).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import torch
import trio

from p2pactor import (
    DEFAULT_HASH_SEED,
    EmbeddedCache,
    LookupResult,
    NodeConfig,
    block_bytes,
    open_nixl_transport,
    open_node,
    open_zmq_transport,
    preload_keys,
)

BLOCK_LEN = 64 * 1024
NUM_BLOCKS = 64
PRELOADED = 16


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def fetch_from(peer: str) -> None:
    """Open our own node, look up the server's prompt, fetch it, verify it."""
    pool = torch.zeros(NUM_BLOCKS * BLOCK_LEN, dtype=torch.uint8)  # our KV block pool
    cache = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN, memory=pool.numpy().data)
    keys = preload_keys(DEFAULT_HASH_SEED, PRELOADED + 2)  # two more than it holds
    async with (
        open_zmq_transport("127.0.0.1:0", port=0) as control,
        open_nixl_transport(pool, BLOCK_LEN) as data,
    ):
        host, port = control.local_id.rsplit(":", 1)
        config = NodeConfig(host=host, port=int(port), num_blocks=NUM_BLOCKS, block_len=BLOCK_LEN)
        async with open_node(config, control=control, data=data, parent=cache) as node:
            with trio.fail_after(30):  # the server may still be starting: ask until it answers
                while True:
                    answers = await node.lookup(peer, "example", keys)
                    if LookupResult.HIT in answers:
                        break
                    node.finish("example")
                    await trio.sleep(0.5)
            hits = [k for k, a in zip(keys, answers, strict=True) if a is LookupResult.HIT]
            print(f"{peer} holds {len(hits)} of the {len(keys)} blocks asked for")
            blocks = cache.allocate(len(hits))
            result = await node.fetch(peer, "example", hits, blocks)
            node.finish("example")
            assert result.success, result.reason
            for k, block in zip(hits, blocks, strict=True):
                got = bytes(cache.memory[block * BLOCK_LEN : (block + 1) * BLOCK_LEN])
                assert got == block_bytes(k, BLOCK_LEN), "a block arrived with the wrong bytes"
                cache.commit(k, block)
            kib = result.blocks * BLOCK_LEN >> 10
            print(f"fetched {result.blocks} blocks ({kib} KiB), all verified")


def main() -> None:
    """Start the server, fetch from it, stop it."""
    port = free_port()
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    server = subprocess.Popen(  # noqa: S603 - our own command line
        [
            sys.executable,
            "-m",
            "p2pactor",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-len",
            str(BLOCK_LEN),
            "--preload",
            str(PRELOADED),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        trio.run(fetch_from, f"127.0.0.1:{port}")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
