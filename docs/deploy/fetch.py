"""Fetch the blocks a ``p2pactor serve --preload N`` node holds, from another host.

A check for a new deployment: it opens a node of its own on this host's
address (``--host``, the address the serving node dials back), looks up the
keys ``--preload`` stored on the peer, fetches the hits over NIXL and checks
every byte. It exits 0 when every preloaded block arrived intact.

    python docs/deploy/fetch.py --host 10.231.0.1 10.231.0.2:5710

The serving node must use the same block size (``--block-len``, default 4096),
hash seed and fingerprint as this one (``p2pactor serve``'s defaults match).
Under CURVE pass ``--curve-secret-key`` and ``--curve-trusted`` as for
``p2pactor serve``. See docs/deploy.md.
"""

from __future__ import annotations

import argparse
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


async def fetch(args: argparse.Namespace) -> int:
    """Look up the peer's preloaded keys, fetch the hits, verify them."""
    config = NodeConfig(
        host=args.host,
        bind_host=args.bind_host,
        port=args.port,
        num_blocks=args.count,
        block_len=args.block_len,
        curve_secret_key=args.curve_secret_key,
        curve_trusted=args.curve_trusted,
    )
    pool = torch.zeros(config.num_blocks * config.block_len, dtype=torch.uint8)
    cache = EmbeddedCache(config.num_blocks, config.block_len, memory=pool.numpy().data)
    keys = preload_keys(DEFAULT_HASH_SEED, args.count)
    async with (
        open_zmq_transport(
            config.node_id, bind_host=config.bind_host, port=config.port, curve=config.curve
        ) as control,
        open_nixl_transport(pool, config.block_len) as data,
        open_node(config, control=control, data=data, parent=cache) as node,
    ):
        with trio.move_on_after(args.timeout) as waited:  # the peer may still be starting
            while True:
                answers = await node.lookup(args.peer, "deploy-check", keys)
                if LookupResult.HIT in answers:
                    break
                node.finish("deploy-check")
                await trio.sleep(0.5)
        if waited.cancelled_caught:
            sys.stderr.write(f"{args.peer} answered no hit within {args.timeout} s\n")
            return 1
        hits = [k for k, a in zip(keys, answers, strict=True) if a is LookupResult.HIT]
        blocks = cache.allocate(len(hits))
        result = await node.fetch(args.peer, "deploy-check", hits, blocks)
        node.finish("deploy-check")
        if not result.success:
            sys.stderr.write(f"fetch from {args.peer} failed: {result.reason}\n")
            return 1
        for k, block in zip(hits, blocks, strict=True):
            start = block * config.block_len
            got = bytes(cache.memory[start : start + config.block_len])
            if got != block_bytes(k, config.block_len):
                sys.stderr.write(f"block {block} arrived with the wrong bytes\n")
                return 1
        sys.stdout.write(
            f"{args.peer} held {len(hits)} of {len(keys)} blocks; "
            f"fetched {result.blocks} blocks of {config.block_len} bytes, all verified\n"
        )
        return 0 if len(hits) == len(keys) else 1


def main() -> int:
    """Parse the command line and run the check."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("peer", help="the serving node's id, HOST:PORT")
    parser.add_argument("--host", required=True, help="this host's address, as the peer dials it")
    parser.add_argument("--bind-host", default=None, help="where to bind (default --host)")
    parser.add_argument("--port", type=int, default=5710, help="this node's control port")
    parser.add_argument("--count", type=int, default=16, help="the peer's --preload N")
    parser.add_argument("--block-len", type=int, default=4096, help="bytes per block")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a hit")
    parser.add_argument("--curve-secret-key", default=None, metavar="PATH")
    parser.add_argument("--curve-trusted", default=None, metavar="DIR")
    return trio.run(fetch, parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
