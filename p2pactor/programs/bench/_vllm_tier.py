"""The tiers of the vLLM comparisons (``engine``, ``control``), and the engine section's producer.

:func:`make_tier` makes one tier over a pool (``ours``: p2pactor's
``P2PActorTierManager``; ``vllm``: vLLM 0.33's ``P2PSecondaryTierManager``) from a
real ``TieringOffloadingSpec`` (:func:`~p2pactor.programs.vllmstack.spec_of`). Run as
``python -m p2pactor.programs.bench._vllm_tier --tier ours|vllm --port N ...`` it is
the ``engine`` section's *producer*: one tier over a pool holding every HIT key of the
workload (nothing evicts, so both tiers' serving is measured alone, the same for
both), its parent a scripted :class:`FakeParent`; it says ``READY``, then does what
vLLM's tier-poll thread does for an idle engine (every ``--poll-ms``:
``get_finished_jobs()`` and ``serve_external_requests(parent)``) until its stdin
closes, then shuts the tier down.

Importing it sets ``NIXL_LOG_LEVEL=WARN``, ``PYTHONHASHSEED=0`` and
``UCX_RCACHE_MAX_UNRELEASED=1024`` (what vLLM sets) unless they are set, and seeds
vLLM's ``NONE_HASH`` as an engine does at start-up: import it only where vLLM is.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
os.environ.setdefault("PYTHONHASHSEED", "0")
# What vLLM sets before it imports NIXL; set here so that both tiers run UCX
# alike whichever of them imports NIXL first in a process.
os.environ.setdefault("UCX_RCACHE_MAX_UNRELEASED", "1024")

import numpy as np
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import init_none_hash
from vllm.v1.kv_offload.base import (
    LookupResult,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob

from p2pactor.programs.bench._control_common import say
from p2pactor.programs.vllmstack import StackOptions, spec_of, tier_entry

init_none_hash(sha256)


HOST = "127.0.0.1"
"""Every benchmark process binds here."""
TIERS = ("ours", "vllm")
"""``ours``: p2pactor's vLLM adapter; ``vllm``: vLLM 0.33's own P2P tier."""
STAMP = struct.Struct("<II")
"""(request, key) at the head of every producer block, checked after each load."""
BLOCK_BYTES = 4096
"""Bytes per block of the engine section's pools."""


@dataclass(frozen=True)
class RequestSpec:
    """One request of the workload: its keys, of which the first ``hits`` are on the producer."""

    index: int
    keys: tuple[bytes, ...]
    hits: int


def offload_key(request: int, key: int) -> bytes:
    """A vLLM OffloadKey: a 32-byte block hash, then the 4-byte group index."""
    digest = hashlib.sha256(f"p2pactor-bench/{request}/{key}".encode()).digest()
    return digest + (0).to_bytes(4, "big")


def workload(requests: int, keys_per_request: int) -> list[RequestSpec]:
    """The deterministic workload: each request's HIT prefix is uniform in [K/2, K] (75% hit)."""
    rng = random.Random(0)  # noqa: S311 - a reproducible workload, not a secret
    out = []
    for i in range(requests):
        hits = rng.randint(keys_per_request // 2, keys_per_request)
        keys = tuple(offload_key(i, j) for j in range(keys_per_request))
        out.append(RequestSpec(i, keys, hits))
    return out


class FakeParent(ParentManager):  # type: ignore[misc] # vLLM's types are Any to mypy
    """VLLM's ParentManager over a dict of key -> chunk: what the tier serves from."""

    def __init__(self, blocks: dict[bytes, int] | None = None) -> None:
        self.blocks = blocks or {}
        self.next_job = 1_000_000

    def on_new_request(self, req_context: Any) -> Any:
        """A synthetic request for a peer's lookups opens."""
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: Any) -> Any:
        """HIT when the pool holds ``key``."""
        del req_context
        return LookupResult.HIT if bytes(key) in self.blocks else LookupResult.MISS

    def create_store_job(self, keys: Iterable[Any], req_context: Any) -> Any:
        """Pin the chunks of ``keys`` for a peer's fetch."""
        keys = list(keys)
        self.next_job += 1
        chunks = np.array([self.blocks[bytes(k)] for k in keys], dtype=np.int64)
        return TransferJob(
            job_id=self.next_job,
            keys=keys,
            chunk_ids=chunks,
            is_promotion=False,
            req_context=req_context,
        )

    def on_request_finished(self, req_context: Any) -> None:
        """A synthetic request closes (nothing to release: the pool never evicts)."""


def make_pool(blocks: int, block_bytes: int) -> Any:
    """A zeroed CPU pool, one row per chunk (what vLLM's primary tier lends as a view)."""
    return np.zeros((blocks, block_bytes), dtype=np.uint8)


def make_tier(kind: str, pool: Any, port: int) -> Any:
    """One tier of ``kind`` over ``pool``, bound to ``HOST:port``."""
    entry = tier_entry("ours" if kind == "ours" else "stock", HOST, port)
    options = StackOptions(
        tiers=[entry],
        num_chunks=pool.shape[0],
        chunk_bytes=pool.shape[1],
        engine_id="p2pactor-bench",
    )
    spec = spec_of(options)  # what vLLM hands its tiers: one full-attention group, TP=1
    view = memoryview(pool)
    if kind not in TIERS:
        raise ValueError(f"unknown tier {kind!r}; pick one of {TIERS}")
    if kind == "ours":
        from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415

        return P2PActorTierManager(spec, view, host=HOST, port=port)
    from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager  # noqa: PLC0415

    return P2PSecondaryTierManager(spec, view, host=HOST, port=port)


def producer_pool(
    requests: Sequence[RequestSpec], block_bytes: int
) -> tuple[Any, dict[bytes, int]]:
    """The producer's pool: every HIT key of the workload in its own stamped block."""
    total = sum(r.hits for r in requests)
    pool = make_pool(max(total, 1), block_bytes)
    blocks: dict[bytes, int] = {}
    for r in requests:
        for j in range(r.hits):
            b = len(blocks)
            blocks[r.keys[j]] = b
            pool[b, : STAMP.size] = np.frombuffer(STAMP.pack(r.index, j), dtype=np.uint8)
    return pool, blocks


def main(argv: Sequence[str] | None = None) -> int:
    """Serve the workload's blocks until stdin closes."""
    parser = argparse.ArgumentParser(description="the producer of the engine benchmark")
    parser.add_argument("--tier", choices=TIERS, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--keys", type=int, default=16)
    parser.add_argument("--poll-ms", type=float, default=1.0)
    args = parser.parse_args(argv)

    requests = workload(args.requests, args.keys)
    pool, blocks = producer_pool(requests, BLOCK_BYTES)
    parent = FakeParent(blocks)
    tier = make_tier(args.tier, pool, args.port)
    stop = threading.Event()

    def watch() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    say("READY")
    while not stop.wait(args.poll_ms / 1000):
        tier.get_finished_jobs()
        tier.serve_external_requests(parent)
    tier.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
