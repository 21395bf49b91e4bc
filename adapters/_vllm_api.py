"""vLLM 0.33's API as the tier sees it: the names it imports, the conversions, the options.

The tier's options and environment become the node's :class:`NodeConfig`
(:func:`tier_config`). Precedence: a ``secondary_tiers`` option, else its
environment variable, else the default (``docs/vllm.md``'s options table).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.errors import ConfigError
from p2pactor.runtime.addresses import peer_ids
from p2pactor.runtime.config import NodeConfig, fingerprint_of, slow_step_from_ms
from p2pactor.runtime.sources import SourceOptions

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
    for name, probe in (("remote_prefiller", False), ("remote_kv_source", True)):
        role = (params or {}).get(name)
        if isinstance(role, dict):
            host, port, kv_id = (
                role.get(k) for k in ("remote_host", "remote_port", "kv_request_id")
            )
            return Source(f"{host}:{port}", str(kv_id), probe) if host and port and kv_id else None
    return None


def parse_dest(params: dict[str, Any] | None) -> Dest | None:
    """The producer (remote_decoder) role of ``kv_transfer_params``."""
    role = (params or {}).get("remote_decoder")
    kv_id = role.get("kv_request_id") if isinstance(role, dict) else None
    return Dest(str(kv_id) if kv_id else None) if isinstance(role, dict) else None


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
    return [ctx.get_offload_key_position(k) for k in keys]


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


SHUTDOWN_DRAIN_S = 3.0
"""How long a node's sessions drain at shutdown (vLLM's own: it waits this long for writes)."""
# vLLM's own P2P tier takes these (its secondary_tiers entry): accepted and ignored.
_VLLM_ONLY = frozenset({"backends", "num_threads", "locality"})
TIER_OPTIONS = frozenset(
    {"host", "bind_host", "port", "unbound_store_timeout_s", "summaries", "slow_step_ms"}
    | {"allowed_peers", "seed_peers", "curve_secret_key", "curve_trusted"}
    | {"pin_timeout_s", "pin_lease_cap_s"}
)
"""The ``secondary_tiers`` options :func:`tier_config` takes (besides vLLM's, ignored)."""


def tier_config(
    offloading_spec: Any,
    view: memoryview,
    block_len: int,
    options: Mapping[str, Any],
) -> NodeConfig:
    """The node's config for the tier's options (None: not given), over ``os.environ``.

    Raises:
        ValueError: An option or variable is unusable; the message says which.
    """
    if unknown := set(options) - TIER_OPTIONS - _VLLM_ONLY:
        raise ValueError(f"unknown p2pactor tier options: {sorted(unknown)}")
    # None is "not given", except for the one option whose default is not None.
    given = {
        k: v
        for k, v in options.items()
        if k in TIER_OPTIONS and (v is not None or k == "unbound_store_timeout_s")
    }
    # The options go in as the config is made: a wildcard VLLM_P2P_SIDE_CHANNEL_HOST
    # the tier's own "host" replaces is no error. It is made again once the port is
    # known, with the CURVE keys: the key must speak for this rank's id, not for the
    # environment's default one.
    hosts = {k: given.pop(k) for k in ("host", "bind_host") if k in given}
    base = NodeConfig.from_env(**hosts, curve_secret_key=None, curve_trusted=None)
    slow_ms = given.pop("slow_step_ms", None)
    port = given.pop("port", base.port)
    summaries = given.pop("summaries", None)
    unbound = given.pop("unbound_store_timeout_s", 60.0)
    try:
        unbound_s = float(unbound)
    except (TypeError, ValueError):
        unbound_s = math.nan
    if not unbound_s > 0:  # vLLM's p2p tier's words, then ours
        raise ValueError(
            f"unbound_store_timeout_s must be a positive number, got {unbound!r} (the seconds "
            "the p2pactor tier keeps a prefill's blocks for their decoder's fetch; 60 if not given)"
        )
    dp_index = int(offloading_spec.config.parallel.data_parallel_index)
    # The pin timers, in seconds: Timings validates them.
    timers = ("pin_timeout", "pin_lease_cap")
    timings = {k: given.pop(f"{k}_s") for k in timers if f"{k}_s" in given}
    try:
        given |= {k: peer_ids(given[k]) for k in ("allowed_peers", "seed_peers") if k in given}
        return NodeConfig.from_env(
            **hosts,
            **given,
            port=int(port) + dp_index,
            num_blocks=int(view.shape[0]) if view.shape else 0,
            block_len=int(block_len),
            fingerprint=layout_fingerprint(offloading_spec),
            sources=source_options(base.sources, offloading_spec, summaries),
            unbound_store_timeout=unbound_s,
            timings=attrs.evolve(base.timings, **timings),
            drain_timeout=SHUTDOWN_DRAIN_S,
            slow_step_s=base.slow_step_s
            if slow_ms is None
            else slow_step_from_ms(slow_ms, said=f"slow_step_ms={slow_ms!r}"),
        )
    except (ConfigError, TypeError) as exc:
        raise ValueError(f"bad p2pactor tier configuration: {exc}") from exc


def source_options(base: SourceOptions, spec: Any, summaries: bool | None) -> SourceOptions:
    """The tier's source options: ``base`` (the environment's), for ``spec``'s chunks.

    A key is one offload chunk: ``blocks_per_chunk`` blocks of the group's
    tokens, which is what a HIT saves in prefill; the choice weighs a claimed
    run by those tokens against the round trip. ``summaries`` (the tier
    option), when given, says whether summaries are shared at all.
    """
    if summaries is not None:
        base = attrs.evolve(base, share=bool(summaries))
    try:
        per_block = max(int(g.tokens_per_block) for g in spec.config.groups)
        tokens = per_block * int(spec.blocks_per_chunk)
    except (AttributeError, TypeError, ValueError):  # a spec that does not say
        tokens = 0
    if tokens <= 0:
        return base  # a spec that does not say: the policy's default
    return attrs.evolve(base, choice=attrs.evolve(base.choice, tokens_per_key=tokens))
