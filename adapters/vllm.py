"""p2pactor as a secondary tier of vLLM's tiered KV offloading (vLLM 0.33).

Load it out of tree by naming it in the engine's KV transfer config::

    "secondary_tiers": [{"type": "P2PActorTierManager",
                         "module_path": "p2pactor.adapters.vllm",
                         "host": "10.0.0.1", "port": 5710}]

It speaks vLLM's P2P wire dialect, so engines running it and engines running
vLLM's own ``p2p`` tier share blocks with each other.

How it meets vLLM's threading contract: vLLM calls every method synchronously,
under its lock, from the scheduler thread or its tier-poll thread. A p2pactor
node runs on its own trio thread (sockets, timers, decoding, NIXL completions
all live there); the methods here only hand work over without waiting
(``Node.register_lookup``, ``flush``, ``submit_load``, ...) and read what the
trio thread has already published (``get_stats`` too: the node's metrics reach
vLLM's ``/metrics`` as ``vllm:kv_offload_p2pactor_*``). The parent handle vLLM lends to
``serve_external_requests`` is used only inside that call, through
:class:`_LentParent`, and never kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any, ClassVar

import attrs
import trio

from p2pactor.config import NodeConfig, fingerprint_of
from p2pactor.core import inputs as inp
from p2pactor.core.inputs import LookupResult as Answer
from p2pactor.errors import ConfigError, P2PActorError
from p2pactor.log import EventLog
from p2pactor.logsetup import request_context
from p2pactor.metrics import LOOKUP_OUTCOMES, SERVED_LOOKUP_OUTCOMES
from p2pactor.node import Node, open_node
from p2pactor.surface import OperatorSurface, open_operator_surface

try:
    from vllm.v1.kv_offload.base import ReqContext, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import (
        JobResult,
        ParentManager,
        SecondaryTierManager,
    )
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "p2pactor.adapters.vllm needs vLLM 0.26 or newer (tiered KV offloading with "
        "ParentManager); install vLLM, or p2pactor with its 'vllm' extra. "
        f"The import failed with: {exc}"
    ) from exc

# API variants in the field, detected once at import time: a job's chunk ids
# are TransferJob.chunk_ids since vLLM ~0.27 (JobMetadata.block_ids before);
# LookupResult arrived in 0.25 (tiers answered True/False/None before).
from vllm.v1.core import kv_cache_utils as _kv_cache_utils
from vllm.v1.kv_offload import base as _vllm_base
from vllm.v1.kv_offload.tiering import base as _tiering_base

_JOB_IDS = "chunk_ids" if hasattr(_tiering_base, "TransferJob") else "block_ids"
# JobResult.transfer_time and transfer_bytes (vLLM's tier metrics read them).
_TRANSFER_FIELDS = {"transfer_time", "transfer_bytes"} <= {
    f.name for f in dataclasses.fields(JobResult)
}
_VllmLookup = getattr(_vllm_base, "LookupResult", None)
OffloadPolicy = getattr(_vllm_base, "OffloadPolicy", None)
try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # pragma: no cover - before per-source hit metrics
    CacheHitSource = None
try:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata
except ImportError:  # pragma: no cover - before tiers reported their own metrics
    OffloadingConnectorStats = None

__all__ = ["P2PActorTierManager"]

log = logging.getLogger("p2pactor.vllm")

_SHUTDOWN_DRAIN_S = 3.0  # vLLM's own: wait this long for writes, then give up
_DRAIN_TIMEOUT_S = 30.0
_START_TIMEOUT_S = 60.0
_CURVE_ENV = frozenset({"P2PACTOR_CURVE_SECRET_KEY", "P2PACTOR_CURVE_TRUSTED"})
# The clock of the jobs' transfer_time, bound once: vLLM's own (its
# TransferJob.submit_time is time.monotonic), read on the engine's threads only.
_now = time.monotonic
# Most store jobs (prefill/decode stores and peers' pins) tracked for their
# results at once. Each is released within unbound_store_timeout or the pin
# timeout, so a working node holds far fewer; this bounds the tier's memory if
# releases stop coming (a node that died), at the cost of the oldest jobs'
# transfer fields (None) and their failure line.
_MAX_TRACKED_STORES = 1 << 16


@attrs.frozen
class _Source:
    """A consumer request: pull ``kv_request_id`` from ``peer``."""

    peer: str
    kv_request_id: str
    probe: bool  # remote_kv_source probes first; remote_prefiller does not


@attrs.frozen
class _Dest:
    """A prefill/decode producer request: keep its blocks for a remote puller."""

    kv_request_id: str | None


def _peer_of(role: dict[str, Any]) -> str | None:
    host, port = role.get("remote_host"), role.get("remote_port")
    return f"{host}:{port}" if host and port else None


def _parse_source(params: dict[str, Any] | None) -> _Source | None:
    """The consumer role of ``kv_transfer_params``, as vLLM reads it."""
    if not params:
        return None
    for name, probe in (("remote_prefiller", False), ("remote_kv_source", True)):
        role = params.get(name)
        if isinstance(role, dict):
            peer = _peer_of(role)
            kv_id = role.get("kv_request_id")
            if peer is None or not kv_id:
                return None
            return _Source(peer, str(kv_id), probe)
    return None


def _parse_dest(params: dict[str, Any] | None) -> _Dest | None:
    """The producer (remote_decoder) role of ``kv_transfer_params``."""
    if not params or not isinstance(params.get("remote_decoder"), dict):
        return None
    kv_id = params["remote_decoder"].get("kv_request_id")
    return _Dest(str(kv_id) if kv_id else None)


# Our answers as vLLM's LookupResult (or, before vLLM 0.25, True/False/None).
_TO_VLLM: dict[Answer, Any] = (
    {Answer.HIT: True, Answer.MISS: False, Answer.RETRY: None, Answer.HIT_PENDING: None}
    if _VllmLookup is None
    else {a: getattr(_VllmLookup, a.name) for a in Answer}
)
_VLLM_HIT, _VLLM_MISS = _TO_VLLM[Answer.HIT], _TO_VLLM[Answer.MISS]


def _from_vllm(result: Any) -> Answer:
    """VLLM's LookupResult (or a legacy bool/None) as our answer."""
    if result is True:
        return Answer.HIT
    if result is False:
        return Answer.MISS
    if result is None:
        return Answer.RETRY
    return Answer(result.name.lower())


def _job_ids(job: Any) -> list[int]:
    return [int(i) for i in getattr(job, _JOB_IDS)]


def _job_result(job_id: int, *, success: bool, seconds: float | None, size: int | None) -> Any:
    """A job's result for vLLM, with its transfer time (s) and bytes where vLLM has them.

    What vLLM 0.33 reads of them: ``TieringMetricsTracker`` adds
    ``transfer_time`` to ``kv_offload_tiering_read_time`` (loads) or
    ``write_time`` (stores) for a job that succeeded, and reads neither field of
    a failed one (``tiering/metrics.py:205-240``; its byte counters count the
    job's keys times the chunk size instead). ``transfer_bytes`` feeds only a
    successful store's backpressure detector (``tiering/manager.py:559-576``),
    which this tier refuses.
    """
    if _TRANSFER_FIELDS:
        return JobResult(job_id=job_id, success=success, transfer_time=seconds, transfer_bytes=size)
    return JobResult(job_id=job_id, success=success)  # pragma: no cover - older vLLM


def _hash_seed() -> str:
    """VLLM's own seed resolution (PYTHONHASHSEED, else its sha256 default).

    Called on the node's thread at the first handshake: only by then has the
    engine set the seed up. The module is imported with this one, not then.
    """
    return str(_kv_cache_utils.get_none_hash_seed())


def _fingerprint(offloading_spec: Any) -> str:
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


# --- p2pactor's figures in vLLM's /metrics -----------------------------------------

# vLLM's tiers name theirs vllm:kv_offload_<tier>_<what>; Prometheus adds _total
# to counters.
_METRIC_PREFIX = "vllm:kv_offload_p2pactor_"
# How often the node's thread publishes its totals for get_stats. vLLM's
# frontend keeps what get_stats returned until a scrape, seconds apart.
_STATS_INTERVAL_S = 0.1

# Metric (without the prefix) -> (is a gauge, help text, label names). The names
# after the prefix are p2pactor's own (docs/metrics.md), summed over peers.
_METRICS: dict[str, tuple[bool, str, tuple[str, ...]]] = {
    "lookups": (False, "Lookups this engine sent to peers.", ()),
    "lookup_keys": (
        False,
        "Keys this engine asked peers about, by answer (hit, miss, timeout).",
        ("outcome",),
    ),
    "served_lookups": (False, "Lookups peers sent to this engine.", ()),
    "served_lookup_keys": (
        False,
        (
            "Keys peers asked this engine about, by answer "
            "(hit, miss, pending_resolved, pending_expired, refused)."
        ),
        ("outcome",),
    ),
    "blocks_received": (False, "KV blocks loaded from peers by fetches that succeeded.", ()),
    "received_bytes": (False, "Bytes loaded from peers by fetches that succeeded.", ()),
    "blocks_written": (False, "KV blocks this engine wrote into peers' memory.", ()),
    "written_bytes": (False, "Bytes this engine wrote into peers' memory.", ()),
    "transfers_failed": (False, "Block transfers that failed, loads and writes.", ()),
    "quota_refusals": (False, "Requests of peers refused over a quota.", ()),
    "handshakes": (False, "Session handshakes, by outcome (ok, failed).", ("outcome",)),
    "sessions": (True, "Sessions with peers now, in any state.", ()),
    "peers": (True, "Peers whose session is ready now.", ()),
    "actors": (True, "Live p2pactor request actors now.", ()),
    "pinned_blocks": (
        True,
        "Blocks of this engine pinned for peers' lookups and not yet released.",
        (),
    ),
}


@attrs.frozen
class _Series:
    """Where one figure of the node's ``metrics.totals()`` goes in vLLM's metrics."""

    metric: str
    gauge: bool
    labels: tuple[str, ...] = ()


def _series(metric: str, *labels: str) -> _Series:
    return _Series(_METRIC_PREFIX + metric, _METRICS[metric][0], labels)


# Figures without a series here are not sent: vLLM's frontend refuses a metric
# its tiers did not define at start.
_SERIES: dict[str, _Series] = {
    "lookups": _series("lookups"),
    **{f"lookups_{o}": _series("lookup_keys", o) for o in LOOKUP_OUTCOMES},
    "served_lookups": _series("served_lookups"),
    **{f"served_{o}": _series("served_lookup_keys", o) for o in SERVED_LOOKUP_OUTCOMES},
    "blocks_received": _series("blocks_received"),
    "bytes_received": _series("received_bytes"),
    "blocks_written": _series("blocks_written"),
    "bytes_written": _series("written_bytes"),
    "transfers_failed": _series("transfers_failed"),
    "quota_refusals": _series("quota_refusals"),
    "handshakes_ok": _series("handshakes", "ok"),
    "handshakes_failed": _series("handshakes", "failed"),
    "sessions_alive": _series("sessions"),
    "peers_ready": _series("peers"),
    "actors": _series("actors"),
    "pins_outstanding": _series("pinned_blocks"),
}


def _metric_definitions() -> dict[str, Any]:
    """The tier's metrics, as vLLM's OffloadingMetricMetadata by name."""
    if OffloadingConnectorStats is None:  # pragma: no cover - vLLM without tier metrics
        return {}
    return {
        _METRIC_PREFIX + name: (OffloadingGaugeMetadata if gauge else OffloadingCounterMetadata)(
            documentation=doc, labelnames=labelnames
        )
        for name, (gauge, doc, labelnames) in _METRICS.items()
    }


def _tier_stats(before: dict[str, float], now: dict[str, float]) -> Any:
    """What changed from ``before`` to ``now`` as vLLM's stats, or None if nothing.

    Counters carry their increase (vLLM's frontend adds it to the Prometheus
    counter), gauges their value now.
    """
    if OffloadingConnectorStats is None:  # pragma: no cover - vLLM without tier metrics
        return None
    stats = OffloadingConnectorStats()
    for figure, value in now.items():
        series = _SERIES.get(figure)
        if series is None:
            continue
        if series.gauge:
            stats.set_gauge(series.metric, value, series.labels)
        else:
            increase = value - before.get(figure, 0.0)
            if increase > 0:  # a Prometheus counter refuses to go down
                stats.increase_counter(series.metric, increase, series.labels)
    return None if stats.is_empty() else stats


class _NodeThread:
    """A p2pactor node on its own trio thread, started and stopped from vLLM's."""

    def __init__(self, config: NodeConfig, pool: memoryview, log_path: str | None) -> None:
        self.config = config
        self._pool = pool
        self._log_path = log_path
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.node: Node | None = None
        self.surface: OperatorSurface | None = None
        # metrics.totals(), published by the node's thread: engine threads
        # read it without waiting, and never read the node's state themselves.
        self.totals: dict[str, float] = {}
        self._thread = threading.Thread(target=self._main, name="p2pactor-node", daemon=True)

    def start(self) -> Node:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise P2PActorError(f"the p2pactor node did not start within {_START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise P2PActorError(
                f"the p2pactor node failed to start: {self._error}"
            ) from self._error
        assert self.node is not None
        return self.node

    def stop(self, timeout: float) -> None:
        if self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):  # already stopped
                self._token.run_sync_soon(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "the p2pactor node thread did not stop within %.0f s; it is left running "
                "(a peer or transfer that never ended: see the lines above)",
                timeout,
            )

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:
            self._error = exc
            log.exception(
                "the p2pactor node stopped with an error; the tier serves no more loads "
                "(restart the engine once the cause in this traceback is fixed)"
            )
        finally:
            self._ready.set()

    async def _run(self) -> None:
        from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
        from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415

        config = self.config
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        event_log = EventLog(
            config.node_id,
            path=self._log_path,
            clock_origin=(time.time(), trio.current_time()),
            keep=10_000,
            overwrite=True,
        )
        async with (
            open_zmq_transport(
                config.node_id, bind_host=config.host, port=config.port, curve=config.curve
            ) as control,
            open_nixl_transport(self._pool, config.block_len) as data,
            open_node(
                config, control=control, data=data, event_log=event_log, hash_seed=_hash_seed
            ) as node,
            open_operator_surface(node) as surface,
        ):
            self.node = node
            self.surface = surface
            self._ready.set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._publish_totals, surface)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    async def _publish_totals(self, surface: OperatorSurface) -> None:
        """Publish the figures vLLM gets whenever they change (checked every 0.1 s)."""
        while True:
            try:
                totals = {k: v for k, v in surface.metrics.totals().items() if k in _SERIES}
            except Exception:  # the tier serves on; only its figures in vLLM stop
                log.exception(
                    "p2pactor stopped reporting to vLLM's metrics: metrics.totals() "
                    "failed; the tier still works (report this as a p2pactor bug)"
                )
                return
            if totals != self.totals:
                self.totals = totals
            await trio.sleep(_STATS_INTERVAL_S)


class _LentParent:
    """vLLM's ParentManager, lent for one ``serve_external_requests`` call, as a p2pactor Parent.

    Synthetic requests are named by p2pactor and live across serves, so their
    vLLM ``ReqContext`` objects are kept by the tier, not here.
    """

    def __init__(self, tier: P2PActorTierManager, parent: ParentManager) -> None:
        self._tier = tier
        self._parent = parent

    def on_new_request(self, context: str) -> None:
        ctx = ReqContext(req_id=context, kv_transfer_params=None)
        self._tier._contexts[context] = ctx
        self._parent.on_new_request(ctx)

    def lookup(self, key: bytes, context: str) -> Answer:
        ctx = self._tier._contexts[context]
        return _from_vllm(self._parent.lookup(key, ctx))

    def create_store_job(self, keys: Sequence[bytes], context: str) -> inp.Pin:
        ctx = self._tier._contexts[context]
        job = self._parent.create_store_job(list(keys), ctx)
        job_id = int(job.job_id)
        self._tier._track_store(job_id, None, len(job.keys))
        return inp.Pin(job_id, tuple(job.keys), tuple(_job_ids(job)))

    def on_request_finished(self, context: str) -> None:
        ctx = self._tier._contexts.pop(context)
        self._parent.on_request_finished(ctx)

    def release_job(self, job_id: int, *, success: bool) -> None:
        # vLLM unpins a job when the tier reports it in get_finished_jobs().
        self._tier._store_released(job_id, success)


class P2PActorTierManager(SecondaryTierManager):  # type: ignore[misc]  # vLLM is Any to mypy
    """A vLLM secondary tier backed by a p2pactor node.

    Args:
        offloading_spec: What vLLM's factory passes: the offloading
            configuration (model and cache layout give the fingerprint; the
            data-parallel index offsets the port).
        primary_kv_view: The CPU primary tier's memory, one row per chunk: it
            becomes the NIXL block pool.
        tier_type: The tier's type name.
        backpressure_detector: Must be None: like vLLM's P2P tier, this tier
            can't fail fast on store backpressure.
        host: Address to bind and to be known by (default
            ``VLLM_P2P_SIDE_CHANNEL_HOST``, ``localhost``; set the pod's IP for
            cross-host use).
        port: Base control port (default ``VLLM_P2P_SIDE_CHANNEL_PORT``,
            5710), plus the data-parallel index.
        unbound_store_timeout_s: How long stored blocks of a prefill/decode
            request wait for their fetch (vLLM's default, 60 s).
        allowed_peers: Peers this engine may dial, as ``host:port`` (a list
            or a comma-separated string); request parameters naming anything
            else are treated as having no source. Default: any peer.
        event_log: Write the node's event log to this file (for
            ``p2pactor replay``).
        curve_secret_key: This engine's secret CURVE certificate (made by
            ``p2pactor keygen``, with an ``--address`` for every data-parallel
            rank's ``host:port``); with ``curve_trusted``, the control channel is
            authenticated and encrypted and talks only to trusted p2pactor
            peers, never to stock vLLM ones (``docs/security.md``). Default:
            ``P2PACTOR_CURVE_SECRET_KEY``, else off.
        curve_trusted: Folder of the trusted peers' ``.key`` files (default
            ``P2PACTOR_CURVE_TRUSTED``); with CURVE, request parameters naming
            a peer without a trusted key are treated as having no source.
        **kwargs: Keys vLLM's own P2P tier takes (``backends``,
            ``num_threads``) are accepted and ignored; anything else is an error.
    """

    cache_hit_source: ClassVar[Any] = CacheHitSource.P2P if CacheHitSource is not None else None
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "p2pactor",
        *,
        backpressure_detector: Any = None,
        host: str | None = None,
        port: int | str | None = None,
        unbound_store_timeout_s: float = 60.0,
        allowed_peers: Collection[str] | str | None = None,
        event_log: str | None = None,
        curve_secret_key: str | None = None,
        curve_trusted: str | None = None,
        **kwargs: Any,
    ) -> None:
        if backpressure_detector is not None:
            raise ValueError(
                "Backpressure is not supported for the p2pactor tier (as for vLLM's p2p "
                "tier): remove the 'backpressure' config from its secondary_tiers entry."
            )
        for ignored in ("backends", "num_threads", "locality"):
            kwargs.pop(ignored, None)
        if kwargs:
            raise ValueError(f"unknown p2pactor tier options: {sorted(kwargs)}")
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        if isinstance(allowed_peers, str):
            allowed_peers = [p.strip() for p in allowed_peers.split(",") if p.strip()]
        dp_index = int(offloading_spec.config.parallel.data_parallel_index)
        # The CURVE keys are read once host and port are known: the key must
        # speak for this rank's id, not for the environment's default one.
        base = NodeConfig.from_env({k: v for k, v in os.environ.items() if k not in _CURVE_ENV})
        if curve_secret_key is None:
            curve_secret_key = os.environ.get("P2PACTOR_CURVE_SECRET_KEY") or None
        if curve_trusted is None:
            curve_trusted = os.environ.get("P2PACTOR_CURVE_TRUSTED") or None
        view = primary_kv_view
        try:
            config = attrs.evolve(
                base,
                host=host if host is not None else base.host,
                port=int(port if port is not None else base.port) + dp_index,
                num_blocks=int(view.shape[0]) if view.shape else 0,
                block_len=int(self.block_size_bytes),
                fingerprint=_fingerprint(offloading_spec),
                allowed_peers=None if allowed_peers is None else frozenset(allowed_peers),
                unbound_store_timeout=float(unbound_store_timeout_s),
                drain_timeout=_SHUTDOWN_DRAIN_S,
                curve_secret_key=curve_secret_key,
                curve_trusted=curve_trusted,
            )
        except (ConfigError, TypeError) as exc:
            raise ValueError(f"bad p2pactor tier configuration: {exc}") from exc
        self._contexts: dict[str, ReqContext] = {}
        self._finished: list[JobResult] = []
        self._block_len = config.block_len
        # Loads submitted and not yet reported: job id -> (kv_request_id, when
        # submitted (_now), blocks). An entry goes when its result is collected;
        # the node reports every load it was handed (its load timeout bounds
        # the wait), and each holds primary chunks of its own until then.
        self._load_requests: dict[int, tuple[str, float, int]] = {}
        # Store jobs not yet released: job id -> (kv_request_id of a
        # prefill/decode store, None for a peer's pin; when submitted or
        # pinned (_now); blocks). An entry goes at the job's one release
        # (_store_released), at shutdown, or past _MAX_TRACKED_STORES.
        self._stores: dict[int, tuple[str | None, float, int]] = {}
        self._asks: dict[tuple[str, str], dict[bytes, None]] = {}
        self._failed: set[str] = set()
        self._runner = _NodeThread(config, view, event_log)
        self._reported: dict[str, float] = {}  # the totals get_stats last reported
        self._node: Node = self._runner.start()
        log.info(
            "p2pactor tier %s ready (%d blocks of %d bytes)",
            config.node_id,
            config.num_blocks,
            config.block_len,
        )

    # --- per request -------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Read the request's role from its kv_transfer_params, once."""
        params = req_context.kv_transfer_params
        source = _parse_source(params)
        if source is not None and not self._node.config.may_dial(source.peer):
            log.warning(
                "request %s names %s, which is not in allowed_peers or has no trusted CURVE "
                "key; not dialing it (add it to allowed_peers, or its .key to curve_trusted)",
                req_context.req_id,
                source.peer,
                extra=request_context(
                    source.peer, source.kv_request_id, node=self._node.config.node_id
                ),
            )
            source = None
        if source is not None:
            req_context.set_state(source)
            self._node.prepare(source.peer, wake=False)  # handshake before its lookups
        dest = _parse_dest(params)
        if dest is not None:
            req_context.set_state(dest)
            if dest.kv_request_id is not None and OffloadPolicy is not None:
                return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def lookup(self, key: Any, req_context: ReqContext) -> Any:
        """HIT, MISS or RETRY (while the peer is being asked) for one key."""
        source = req_context.get_state(_Source)
        if source is None or source.kv_request_id in self._failed:
            return _VLLM_MISS
        if not source.probe:
            return _VLLM_HIT  # prefill/decode: the prefiller holds everything
        k = bytes(key)
        answer = self._node.peek_lookup(source.peer, source.kv_request_id, (k,))[0]
        if answer is Answer.RETRY:
            # Asked at the step's end, all keys of the request in one go: vLLM
            # calls this once per key per step while the answer is out.
            self._asks.setdefault((source.peer, source.kv_request_id), {})[k] = None
        return _TO_VLLM[answer]

    def on_request_finished(self, req_context: ReqContext) -> None:
        """The engine is done with the request (either role)."""
        source = req_context.get_state(_Source)
        dest = req_context.get_state(_Dest)
        for kv_id in {
            source.kv_request_id if source else None,
            dest.kv_request_id if dest else None,
        } - {None}:
            assert kv_id is not None
            self._failed.discard(kv_id)
            self._node.finish(kv_id, wake=False)

    def submit_store(self, job_metadata: Any) -> None:
        """Keep a prefill/decode request's blocks for its remote puller."""
        dest = job_metadata.req_context.get_state(_Dest)
        job_id = int(job_metadata.job_id)
        if dest is None:
            # Symmetric P2P: blocks stay in the CPU primary tier; nothing moves.
            self._finished.append(_job_result(job_id, success=True, seconds=0.0, size=0))
        elif dest.kv_request_id is None:
            self._finished.append(_job_result(job_id, success=False, seconds=0.0, size=0))
        else:
            keys = [bytes(k) for k in job_metadata.keys]
            self._track_store(job_id, dest.kv_request_id, len(keys))
            self._node.submit_store(
                dest.kv_request_id, job_id, keys, _job_ids(job_metadata)
            )  # woken at once: a store may come with no step to follow it

    def submit_load(self, job_metadata: Any) -> None:
        """Pull keys from the request's source peer into the given chunks."""
        source = job_metadata.req_context.get_state(_Source)
        job_id = int(job_metadata.job_id)
        keys = [bytes(k) for k in job_metadata.keys]
        if source is None:
            self._finished.append(_job_result(job_id, success=False, seconds=0.0, size=0))
        elif not keys:
            self._finished.append(_job_result(job_id, success=True, seconds=0.0, size=0))
        else:
            self._load_requests[job_id] = (source.kv_request_id, _now(), len(keys))
            self._node.submit_load(
                source.peer,
                source.kv_request_id,
                job_id,
                keys,
                _job_ids(job_metadata),
                wake=False,
            )

    # --- per step ----------------------------------------------------------------

    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Loads and stores that finished since the last call, each exactly once."""
        self._collect()
        finished, self._finished = self._finished, []
        return finished

    def _collect(self) -> None:
        """Move the node's load results into the tier's list of finished jobs.

        A load's ``transfer_time`` is the seconds from its ``submit_load`` to
        this call, the first to see its result (so it includes the wait for
        the node's thread, the fetch round trip, the peer's write and the time
        until vLLM polls next). Its ``transfer_bytes`` is its blocks times the
        block size if it succeeded, else 0: a load is all or nothing (no
        ``successful_keys``), so vLLM recomputes every block of a failed one
        and counts none of it (``tiering/metrics.py``).
        """
        results = self._node.finished_jobs()
        if not results:
            return
        now = _now()
        for result in results:
            entry = self._load_requests.pop(result.job_id, None)
            if entry is None:  # submitted before a shutdown: nothing known of it
                self._finished.append(
                    _job_result(result.job_id, success=result.success, seconds=None, size=None)
                )
                continue
            kv_id, submitted, blocks = entry
            if result.success:
                size = blocks * self._block_len
            else:
                self._failed.add(kv_id)  # its lookups answer MISS: prefill locally
                size = 0
            self._finished.append(
                _job_result(
                    result.job_id, success=result.success, seconds=now - submitted, size=size
                )
            )

    def _track_store(self, job_id: int, kv_request_id: str | None, blocks: int) -> None:
        """A store job starts: a prefill/decode store (``kv_request_id``) or a peer's pin."""
        stores = self._stores
        if len(stores) >= _MAX_TRACKED_STORES:
            del stores[next(iter(stores))]  # the oldest; see _MAX_TRACKED_STORES
        stores[job_id] = (kv_request_id, _now(), blocks)

    def _store_released(self, job_id: int, success: bool) -> None:
        """A store job's one release (through the lent parent): report it to vLLM.

        ``transfer_time`` is the seconds from its ``submit_store`` (a peer's
        pin: from ``create_store_job``) to this release, which comes once the
        fetch was served, or when the job failed or timed out.
        ``transfer_bytes`` is its blocks times the block size if it succeeded
        (a prefill/decode store succeeds once every block of it was written to
        the decoder; a pin, once the fetch of its round was served, counted
        whole as vLLM counts a job's keys), else 0.
        """
        entry = self._stores.pop(job_id, None)
        if entry is None:  # over _MAX_TRACKED_STORES: its figures are gone
            self._finished.append(_job_result(job_id, success=success, seconds=None, size=None))
            return
        kv_id, submitted, blocks = entry
        seconds = _now() - submitted
        self._finished.append(
            _job_result(
                job_id,
                success=success,
                seconds=seconds,
                size=blocks * self._block_len if success else 0,
            )
        )
        if not success and kv_id is not None:  # a pin that no fetch used is routine
            config = self._node.config
            log.warning(
                "store job %d of %s failed %.1f s after it was stored, and vLLM unpins its "
                "blocks: the decode side did not fetch them all within "
                "unbound_store_timeout (%g s), or its fetch failed (check that the decoder "
                "runs and reaches this node, and the lines above for this request)",
                job_id,
                kv_id,
                seconds,
                config.unbound_store_timeout,
                extra=request_context(None, kv_id, node=config.node_id),
            )

    def serve_external_requests(self, parent: ParentManager) -> None:
        """Let peers' lookups, pins and releases run against the lent parent."""
        self._node.serve_parent(_LentParent(self, parent))

    def on_schedule_end(self, context: Any) -> None:
        """The step ended: hand its new lookups and calls to the node, wake it once."""
        del context
        asks, self._asks = self._asks, {}
        for (peer, kv_id), keys in asks.items():
            self._node.ask(peer, kv_id, list(keys))
        self._node.flush()

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for this tier."""
        return self._node.has_pending_work()

    def drain_jobs(self) -> None:
        """Wait (bounded) until every load submitted has finished and no write runs.

        Loads are tracked here from the moment vLLM submits them, not from when
        the node's thread picks them up: a load still queued for the node must
        hold the drain too, or it would write into chunks vLLM reuses.
        """
        self._node.kick()
        deadline = time.monotonic() + _DRAIN_TIMEOUT_S
        while True:
            self._collect()
            if not self._load_requests and not self._node.has_transfers_in_flight():
                return
            if time.monotonic() > deadline:
                log.warning(
                    "drain_jobs gave up after %.0f s: %d loads still in flight (their peers "
                    "stopped answering; see the session lines above)",
                    _DRAIN_TIMEOUT_S,
                    len(self._load_requests),
                )
                return
            time.sleep(0.001)

    def shutdown(self) -> None:
        """Close the node: sessions drain for up to 3 s, as vLLM's tier does."""
        self._runner.stop(timeout=_SHUTDOWN_DRAIN_S + 10)
        # No result can come from a stopped node: forget the jobs still out.
        self._load_requests.clear()
        self._stores.clear()

    # --- vLLM's /metrics -----------------------------------------------------------

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The ``vllm:kv_offload_p2pactor_*`` metrics this tier reports (docs/vllm.md)."""
        del extra_config  # always on: the figures cost the engine's thread nothing
        return _metric_definitions()

    def get_stats(self) -> Any:
        """What the node counted since the last call: counter increases, gauges now.

        Never waits: it reads the totals the node's thread last published (at
        most 0.1 s old), and returns None while they have not changed.
        """
        totals = self._runner.totals
        if totals is self._reported:
            return None
        stats = _tier_stats(self._reported, totals)
        self._reported = totals
        return stats

    # --- introspection -------------------------------------------------------------

    @property
    def node(self) -> Node:
        """The p2pactor node behind the tier."""
        return self._node

    def __repr__(self) -> str:
        return f"<P2PActorTierManager {self._node.node_id}>"
