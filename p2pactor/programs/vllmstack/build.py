"""vLLM 0.33's offloading stack around a secondary tier, built the way an engine builds it.

:func:`build_stack` makes a real ``TieringOffloadingSpec`` over a real
``OffloadingConfig`` (one full-attention group, TP=1, no model and no GPU) and
calls its own ``get_manager()``: vLLM then creates the shared offload region
(``/dev/shm/vllm_offload_<engine_id>.mmap``), its ``CPUPrimaryTierOffloadingManager``
with the eviction policy named (vLLM's LRU by default), each secondary tier
through ``SecondaryTierFactory`` from its ``secondary_tiers`` entry, and the
``TieringOffloadingManager`` with its tier-poll thread. Nothing of it is ours
but the options.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

__all__ = ["Stack", "StackOptions", "build_stack", "spec_of", "tier_entry"]


def tier_entry(kind: str, host: str, port: int, **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry: ``ours`` (p2pactor's tier) or ``stock`` (vLLM's ``p2p``)."""
    if kind == "ours":
        entry: dict[str, Any] = {
            "type": "P2PActorTierManager",
            "module_path": "p2pactor.adapters.vllm",
        }
    elif kind == "stock":
        entry = {"type": "p2p"}
    else:
        raise ValueError(f"unknown tier kind {kind!r}: 'ours' or 'stock'")
    return {**entry, "host": host, "port": port, **options}


@attrs.frozen(kw_only=True)
class StackOptions:
    """One engine's offloading configuration (what its ``kv_transfer_config`` would say).

    Attributes:
        tiers: The ``secondary_tiers`` entries, in order (none: the CPU tier alone).
        num_chunks: CPU-tier chunks (``cpu_bytes_to_use`` is this many of vLLM's
            aligned chunk strides).
        chunk_bytes: Bytes of one chunk's KV (vLLM rounds its stride up to 4 KiB).
        tokens_per_block: Tokens of one KV block.
        blocks_per_chunk: KV blocks of one offloaded chunk (one key).
        layers: Attention layers of the model (they name the layer fingerprint).
        model: The model name the layout fingerprint carries.
        dtype: Its KV dtype.
        engine_id: Names the engine's shared offload region (unique per engine).
        eviction_policy: The CPU tier's policy, by vLLM's name.
        tier_poll_interval_s: vLLM's tier-poll thread's pause (0: no thread).
        data_parallel_index: The engine's data-parallel rank (offsets the tier port).
    """

    tiers: Sequence[Mapping[str, Any]] = ()
    num_chunks: int = 64
    chunk_bytes: int = 4096
    tokens_per_block: int = 16
    blocks_per_chunk: int = 1
    layers: int = 28
    model: str = "Qwen/Qwen3-0.6B"
    dtype: str = "bfloat16"
    engine_id: str = attrs.field(factory=lambda: f"p2pactor-stack-{os.getpid()}")
    eviction_policy: str = "lru"
    tier_poll_interval_s: float = 0.001
    data_parallel_index: int = 0

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens one key covers."""
        return self.tokens_per_block * self.blocks_per_chunk


def spec_of(options: StackOptions) -> Any:
    """VLLM's ``TieringOffloadingSpec`` for ``options`` (what its tiers are given)."""
    from vllm.v1.kv_offload.config import (  # noqa: PLC0415 - vLLM is optional
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.cpu.shared_offload_region import (  # noqa: PLC0415
        SharedOffloadRegion,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: PLC0415

    if options.chunk_bytes % options.blocks_per_chunk:
        raise ValueError("chunk_bytes must be a multiple of blocks_per_chunk")
    # vLLM lays each chunk out on an aligned stride: size the tier in strides,
    # so that it holds num_chunks of them.
    align = SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT
    stride = -(-options.chunk_bytes // align) * align
    config = OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=options.tokens_per_block,
                layer_names=tuple(
                    f"model.layers.{i}.self_attn.attn" for i in range(options.layers)
                ),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=options.chunk_bytes // options.blocks_per_chunk,
        enable_kv_cache_events=False,
        extra_config={
            "cpu_bytes_to_use": options.num_chunks * stride,
            "blocks_per_chunk": options.blocks_per_chunk,
            "eviction_policy": options.eviction_policy,
            "tier_poll_interval_s": options.tier_poll_interval_s,
            # vLLM's spec fills its entries in (backpressure): give it copies.
            "secondary_tiers": [dict(t) for t in options.tiers],
        },
        engine_id=options.engine_id,
        model=OffloadingModelConfig(name=options.model, dtype=options.dtype, max_model_len=40960),
        cache=OffloadingCacheConfig(
            tokens_per_hash=options.tokens_per_block, blocks_per_chunk=options.blocks_per_chunk
        ),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=options.data_parallel_index,
            data_parallel_size=max(1, options.data_parallel_index + 1),
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return TieringOffloadingSpec(config)


@attrs.define(eq=False)
class Stack:
    """One engine's offloading stack, as ``TieringOffloadingSpec.get_manager()`` made it.

    Attributes:
        options: What it was built from.
        spec: vLLM's spec (what its tiers were given).
        manager: vLLM's ``TieringOffloadingManager``.
    """

    options: StackOptions
    spec: Any
    manager: Any
    _shut: bool = False

    @property
    def memory(self) -> np.ndarray[Any, Any]:
        """The CPU tier's chunks, ``(num_chunks, row bytes)``, over vLLM's shared region.

        What its tiers read and write. Keep no array of it past :meth:`shutdown`:
        vLLM releases the region's view then, and an array still exporting it
        makes that fail.
        """
        # vLLM's view is of signed bytes ('b'): read them as the bytes they are.
        return np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)

    @property
    def primary(self) -> Any:
        """The CPU tier (vLLM's ``CPUPrimaryTierOffloadingManager``)."""
        return self.manager.primary_tier

    @property
    def tiers(self) -> list[Any]:
        """The secondary tiers, in configuration order."""
        return list(self.manager.secondary_tiers)

    @property
    def tier(self) -> Any:
        """The first secondary tier (the one under test)."""
        return self.manager.secondary_tiers[0]

    @property
    def lock(self) -> Any:
        """The manager's lock: every manager call holds it, as vLLM's scheduler does."""
        return self.manager.lock

    def shutdown(self) -> None:
        """The manager's ``shutdown()``: its poll thread, its tiers, then the shared region."""
        if not self._shut:
            self._shut = True
            self.manager.shutdown()


def build_stack(options: StackOptions) -> Stack:
    """Build one engine's stack with vLLM's own ``get_manager()``."""
    spec = spec_of(options)
    return Stack(options, spec, spec.get_manager())
