"""Sample prompts: block keys chained as vLLM chains them, and block contents.

The demo, ``p2pactor serve --preload``, the benchmarks and the examples all need
keys that look like an engine's (a sha256 chain over a prompt's token blocks,
then a 4-byte group index) and bytes that anyone can check a fetched block
against without having seen it stored. Both are deterministic.
"""

from __future__ import annotations

import hashlib
import random


def chain_keys(seed: str, tokens: list[str], parent: bytes = b"") -> list[bytes]:
    """Offload keys of consecutive token blocks ``tokens``, chained from ``parent``.

    Two prompts that share their first blocks share those blocks' keys, as in
    an engine; ``seed`` plays the engine's hash seed (``NodeConfig.hash_seed``).
    """
    keys = []
    for block in tokens:
        parent = hashlib.sha256(parent + seed.encode() + block.encode()).digest()
        keys.append(parent + (0).to_bytes(4, "big"))
    return keys


def block_bytes(key: bytes, block_len: int) -> bytes:
    """The deterministic contents of the block with ``key`` (``block_len`` bytes)."""
    return random.Random(key).randbytes(block_len)  # noqa: S311 - test data, not secrets


def preload_keys(hash_seed: str, count: int) -> list[bytes]:
    """The keys ``p2pactor serve --preload count`` stores: one prompt of ``count`` blocks."""
    return chain_keys(hash_seed, [f"preloaded block {i}" for i in range(count)])
