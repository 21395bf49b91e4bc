"""vLLM 0.33's API as the tier sees it: the names it imports and the conversions."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs

from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.runtime.config import fingerprint_of

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats as OffloadingConnectorStats,
    )
    from vllm.v1.core import kv_cache_utils as _kv_cache_utils
    from vllm.v1.kv_offload.base import LookupResult, TierFilter
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata as OffloadingCounterMetadata
    from vllm.v1.kv_offload.base import OffloadingGaugeMetadata as OffloadingGaugeMetadata
    from vllm.v1.kv_offload.base import OffloadPolicy as OffloadPolicy
    from vllm.v1.kv_offload.base import ReqContext as ReqContext
    from vllm.v1.kv_offload.base import RequestOffloadingContext as RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import JobResult as JobResult
    from vllm.v1.kv_offload.tiering.base import ParentManager as ParentManager
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager as SecondaryTierManager
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as CacheHitSource
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "p2pactor.adapters.vllm needs vLLM 0.33 or newer (tiered KV offloading with "
        "ParentManager and a tier-poll thread); install vLLM, or p2pactor with its 'vllm' "
        f"extra. The import failed with: {exc}"
    ) from exc

VllmLookup = LookupResult
# vLLM serves tiers that ask for it between engine steps, from its tier-poll
# thread (0.33); before, only at steps, and an idle engine never steps.
POLLS_TIERS = hasattr(SecondaryTierManager, "tolerates_off_thread_polling")
# A lookup that asks the primary tier alone.
PRIMARY_ONLY = TierFilter(matchers=())

log = logging.getLogger("p2pactor.vllm")


@attrs.frozen
class Source:
    """A consumer request: pull ``kv_request_id`` from ``peer``."""

    peer: str
    kv_request_id: str
    probe: bool  # remote_kv_source probes first; remote_prefiller does not
    # Chosen by the tier (no source was named): the keys asked of the peer;
    # any other key is a MISS (nobody claimed it).
    only: frozenset[bytes] | None = None


@attrs.frozen
class Dest:
    """A prefill/decode producer request: keep its blocks for a remote puller."""

    kv_request_id: str | None


def parse_source(params: dict[str, Any] | None) -> Source | None:
    """The consumer role of ``kv_transfer_params``, as vLLM reads it."""
    if not params:
        return None
    for name, probe in (("remote_prefiller", False), ("remote_kv_source", True)):
        role = params.get(name)
        if isinstance(role, dict):
            host, port, kv_id = (
                role.get(k) for k in ("remote_host", "remote_port", "kv_request_id")
            )
            return Source(f"{host}:{port}", str(kv_id), probe) if host and port and kv_id else None
    return None


def parse_dest(params: dict[str, Any] | None) -> Dest | None:
    """The producer (remote_decoder) role of ``kv_transfer_params``."""
    if not params or not isinstance(params.get("remote_decoder"), dict):
        return None
    kv_id = params["remote_decoder"].get("kv_request_id")
    return Dest(str(kv_id) if kv_id else None)


# Our answers as vLLM's LookupResult, and back.
TO_VLLM: dict[Answer, Any] = {a: getattr(VllmLookup, a.name) for a in Answer}
VLLM_HIT, VLLM_MISS = TO_VLLM[Answer.HIT], TO_VLLM[Answer.MISS]


def from_vllm(result: Any) -> Answer:
    """VLLM's LookupResult as our answer."""
    return Answer(result.name.lower())


def positions(ctx: Any, keys: Sequence[bytes]) -> list[int | None]:
    """Each key's end-token position on the request, as vLLM's scheduler records it.

    vLLM's LRU ranks a request's chunks by it.
    """
    get = ctx.get_offload_key_position
    return [get(k) for k in keys]


def require_tier_polling() -> None:
    """Refuse a vLLM that would never serve an idle engine's peers, with what to do.

    Raises:
        ValueError: This vLLM has no tier-poll thread (0.32 and older).
    """
    if POLLS_TIERS:
        return
    import vllm  # noqa: PLC0415 - only to say which version it is

    raise ValueError(
        f"p2pactor's vLLM tier needs vLLM 0.33 or newer; this is vLLM "
        f"{getattr(vllm, '__version__', 'of unknown version')}, which serves secondary "
        "tiers only at engine steps, and an idle engine takes none: its peers' lookups "
        "would go unanswered. Upgrade vLLM (pip install 'vllm>=0.33'), or use vLLM's own "
        "'p2p' tier with this one."
    )


def request_keys(ctx: Any) -> dict[bytes, int] | None:
    """Every key of the request with its end-token position, as vLLM's scheduler recorded them.

    vLLM 0.33's connector records the positions of all of a request's keys on
    its ``ReqContext`` (``update_offload_keys``), for managers to recover
    prefix order; a tier is asked only past the keys the CPU tier holds, so
    this record is the one way it learns which held keys a request reuses
    (vLLM's LRU ranks those as the request's own). The record has no public
    iterator: it is read from the context's ``_offload_key_positions`` field,
    None where this vLLM has no such field (``tests/test_vllm_tier.py`` pins
    it, so an upgrade that drops it is noticed).
    """
    record = getattr(ctx, "_offload_key_positions", None)
    return record if isinstance(record, dict) else None


def job_ids(job: Any) -> list[int]:
    """A job's chunk ids (``TransferJob.chunk_ids``) as ints."""
    return [int(i) for i in job.chunk_ids]


def hash_seed() -> str:
    """VLLM's own seed resolution (PYTHONHASHSEED, else its sha256 default).

    Called on the node's thread at the first handshake: only by then has the
    engine set the seed up. The module is imported with this one, not then.
    """
    return str(_kv_cache_utils.get_none_hash_seed())


def layout_fingerprint(offloading_spec: Any) -> str:
    """The layout fingerprint from the same fields vLLM's own P2P tier uses."""
    try:
        from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: PLC0415

        fields = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        ).get_run_config()
    except Exception as exc:  # a partial spec: no fingerprint, as vLLM with no fields
        log.warning(
            "could not derive the layout fingerprint (%s); peers will not compare it, so "
            "check by hand that every peer runs the same model, dtype and block size",
            exc,
        )
        return ""
    return fingerprint_of(fields)
