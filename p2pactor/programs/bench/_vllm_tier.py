"""The tiers of the vLLM comparisons (``engine``, ``control``), and their producers' loop.

:func:`make_tier` makes one tier over a pool (``ours``: p2pactor's
``P2PActorTierManager``; ``vllm``: vLLM 0.33's ``P2PSecondaryTierManager``) from a
real ``TieringOffloadingSpec`` (:func:`~p2pactor.programs.vllmstack.spec_of`);
:func:`serve` is a producer: its tier serves peers from an
:class:`~p2pactor.runtime.parent.EmbeddedCache` through :class:`CacheParent` until
its stdin closes. Run as ``python -m p2pactor.programs.bench._vllm_tier JSON``
(:func:`main`) it is the ``engine`` section's producer: every HIT key of the
workload in a stamped block (nothing evicts, so both tiers' serving is measured alone),
woken every ``poll_ms`` as vLLM's tier-poll thread is for an idle engine.

Importing it sets ``NIXL_LOG_LEVEL=WARN``, ``PYTHONHASHSEED=0`` and
``UCX_RCACHE_MAX_UNRELEASED=1024`` (what vLLM sets) unless they are set, and seeds
vLLM's ``NONE_HASH`` as an engine does at start-up: import it only where vLLM is.
"""

from __future__ import annotations

import json
import os
import random
import struct
import sys
import threading
import time
from collections.abc import Callable
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
from vllm.v1.kv_offload.base import LookupResult, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import ParentManager, TransferJob

from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.programs.bench._control_common import held, offload_key, say
from p2pactor.programs.vllmstack import StackOptions, spec_of, tier_entry
from p2pactor.runtime.parent import EmbeddedCache

init_none_hash(sha256)


HOST = "127.0.0.1"
"""Every benchmark process binds here."""
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


def workload(requests: int, keys_per_request: int) -> list[RequestSpec]:
    """The deterministic workload: each request's HIT prefix is uniform in [K/2, K] (75% hit)."""
    rng = random.Random(0)  # noqa: S311 - a reproducible workload, not a secret
    out = []
    for i in range(requests):
        hits = rng.randint(keys_per_request // 2, keys_per_request)
        keys = tuple(offload_key(f"p2pactor-bench/{i}/{j}") for j in range(keys_per_request))
        out.append(RequestSpec(i, keys, hits))
    return out


_AS_VLLM = {answer: LookupResult[answer.name] for answer in Answer}
"""Our cache's answers as vLLM's (a dict: as cheap per key as the lookup itself)."""


class CacheParent(ParentManager):  # type: ignore[misc] # vLLM's types are Any to mypy
    """VLLM's ``ParentManager`` over an :class:`~p2pactor.runtime.parent.EmbeddedCache`.

    The cache class our own producer node serves from, so that both sides do the same
    work per key (a dict lookup, a pin per job).
    """

    def __init__(self, cache: EmbeddedCache) -> None:
        self.cache = cache

    def on_new_request(self, req_context: Any) -> Any:
        """Open the synthetic request of a peer's lookup."""
        self.cache.on_new_request(req_context.req_id)
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: Any) -> Any:
        """The cache's answer, as vLLM's LookupResult."""
        return _AS_VLLM[self.cache.lookup(bytes(key), req_context.req_id)]

    def create_store_job(self, keys: Any, req_context: Any) -> Any:
        """Pin the blocks of ``keys``; the tier reports the job when it lets go."""
        keys = [bytes(k) for k in keys]
        pin = self.cache.create_store_job(keys, req_context.req_id)
        chunks = np.array(pin.blocks, dtype=np.int64)
        return TransferJob(
            job_id=pin.job_id,
            keys=keys,
            chunk_ids=chunks,
            is_promotion=False,
            req_context=req_context,
        )

    def on_request_finished(self, req_context: Any) -> None:
        """Close the synthetic request."""
        self.cache.on_request_finished(req_context.req_id)


def make_tier(kind: str, pool: Any, port: int) -> Any:
    """One tier of ``kind`` over ``pool`` (a row per chunk), bound to ``HOST:port``.

    ``ours``: p2pactor's vLLM adapter; ``vllm``: vLLM 0.33's own P2P tier.
    """
    entry = tier_entry("ours" if kind == "ours" else "stock", HOST, port)
    options = StackOptions(
        tiers=[entry],
        num_chunks=pool.shape[0],
        chunk_bytes=pool.shape[1],
        engine_id="p2pactor-bench",
    )
    spec = spec_of(options)  # what vLLM hands its tiers: one full-attention group, TP=1
    if kind == "ours":
        from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415

        return P2PActorTierManager(spec, memoryview(pool), host=HOST, port=port)
    from vllm.v1.kv_offload.tiering.p2p.manager import P2PSecondaryTierManager  # noqa: PLC0415

    return P2PSecondaryTierManager(spec, memoryview(pool), host=HOST, port=port)


def serve(tier: Any, cache: EmbeddedCache, wait: Callable[[], object]) -> None:
    """Serve peers from ``cache`` after each ``wait()`` until stdin closes; say :func:`held`."""
    parent = CacheParent(cache)
    stop = threading.Event()

    def watch() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch, daemon=True).start()
    while not stop.is_set():
        wait()
        for result in tier.get_finished_jobs():
            cache.release_job(int(result.job_id), success=bool(result.success))
        tier.serve_external_requests(parent)
    tier.shutdown()
    say(held(cache))


def main() -> int:
    """The engine section's producer: serve the workload's blocks until stdin closes.

    Its one argument, JSON: ``tier``, ``port``, ``requests``, ``keys``, ``poll_ms``.
    """
    args = json.loads(sys.argv[1])
    requests = workload(args["requests"], args["keys"])
    pool = np.zeros((max(1, sum(r.hits for r in requests)), BLOCK_BYTES), dtype=np.uint8)
    cache = EmbeddedCache(pool.shape[0], BLOCK_BYTES, memory=pool.data.cast("B"))
    for r in requests:
        for j in range(r.hits):
            cache.store(r.keys[j], STAMP.pack(r.index, j).ljust(BLOCK_BYTES, b"\0"))
    tier = make_tier(args["tier"], pool, args["port"])
    say("READY")
    serve(tier, cache, lambda: time.sleep(args["poll_ms"] / 1000))
    return 0


if __name__ == "__main__":
    sys.exit(main())
