"""The tier's node on a trio thread of its own, and the figures it publishes for ``/metrics``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, NamedTuple

import trio

from p2pactor.adapters import _vllm_api as api
from p2pactor.errors import P2PActorError
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.node import Node, open_node
from p2pactor.surface.attach import OperatorSurface, open_operator_surface
from p2pactor.surface.metrics import LOOKUP_OUTCOMES, SERVED_LOOKUP_OUTCOMES

log = logging.getLogger("p2pactor.vllm")

_START_TIMEOUT_S = 60.0
# vLLM's tiers name theirs vllm:kv_offload_<tier>_<what>; Prometheus adds _total
# to counters.
METRIC_PREFIX = "vllm:kv_offload_p2pactor_"
# How often the node's thread publishes its totals for get_stats. vLLM's
# frontend keeps what get_stats returned until a scrape, seconds apart.
STATS_INTERVAL_S = 0.1

# Metric (without the prefix) -> help text. The names after the prefix are p2pactor's
# own (docs/metrics.md), summed over peers.
_COUNTERS = {
    "lookups": "Lookups this engine sent to peers.",
    "lookup_keys": "Keys this engine asked peers about, by answer (hit, miss, timeout).",
    "served_lookups": "Lookups peers sent to this engine.",
    "served_lookup_keys": (
        "Keys peers asked this engine about, by answer "
        "(hit, miss, pending_resolved, pending_expired, refused)."
    ),
    "blocks_received": "KV blocks loaded from peers by fetches that succeeded.",
    "received_bytes": "Bytes loaded from peers by fetches that succeeded.",
    "blocks_written": "KV blocks this engine wrote into peers' memory.",
    "written_bytes": "Bytes this engine wrote into peers' memory.",
    "transfers_failed": "Block transfers that failed, loads and writes.",
    "quota_refusals": "Requests of peers refused over a quota.",
    "handshakes": "Session handshakes, by outcome (ok, failed).",
}
_GAUGES = {
    "sessions": "Sessions with peers now, in any state.",
    "peers": "Peers whose session is ready now.",
    "actors": "Live p2pactor request actors now.",
    "pinned_blocks": "Blocks of this engine pinned for peers' lookups and not yet released.",
}
# The figures of metrics.totals() a metric shows, where they are not the one of its
# name: each with its label values (its outcome). Figures no metric shows are not
# sent: vLLM's frontend refuses a metric its tiers did not define at start.
_FIGURES: dict[str, dict[str, tuple[str, ...]]] = {
    "lookup_keys": {f"lookups_{o}": (o,) for o in LOOKUP_OUTCOMES},
    "served_lookup_keys": {f"served_{o}": (o,) for o in SERVED_LOOKUP_OUTCOMES},
    "handshakes": {f"handshakes_{o}": (o,) for o in ("ok", "failed")},
    "received_bytes": {"bytes_received": ()},
    "written_bytes": {"bytes_written": ()},
    "sessions": {"sessions_alive": ()},
    "peers": {"peers_ready": ()},
    "pinned_blocks": {"pins_outstanding": ()},
}
METRICS: dict[str, tuple[bool, str, tuple[str, ...]]] = {
    name: (name in _GAUGES, doc, ("outcome",) if any(_FIGURES.get(name, {}).values()) else ())
    for name, doc in (_COUNTERS | _GAUGES).items()
}
"""Metric (without the prefix) -> (is a gauge, help text, label names)."""


class Series(NamedTuple):
    """Where one figure of the node's ``metrics.totals()`` goes in vLLM's metrics."""

    metric: str
    gauge: bool
    labels: tuple[str, ...] = ()


SERIES: dict[str, Series] = {
    figure: Series(METRIC_PREFIX + metric, gauge, labels)
    for metric, (gauge, _, _) in METRICS.items()
    for figure, labels in _FIGURES.get(metric, {metric: ()}).items()
}
"""The figures of ``metrics.totals()`` sent to vLLM, each with its series."""


def metric_definitions() -> dict[str, Any]:
    """The tier's metrics, as vLLM's OffloadingMetricMetadata by name."""
    kinds = (api.OffloadingCounterMetadata, api.OffloadingGaugeMetadata)
    return {
        METRIC_PREFIX + name: kinds[gauge](documentation=doc, labelnames=labelnames)
        for name, (gauge, doc, labelnames) in METRICS.items()
    }


class NodeThread:
    """A p2pactor node on its own trio thread, started and stopped from vLLM's."""

    def __init__(self, config: NodeConfig, pool: memoryview, log_path: str | None) -> None:
        self._started: Future[Node] = Future()
        self._stop = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self.surface: OperatorSurface | None = None
        # metrics.totals(), published by the node's thread: engine threads
        # read it without waiting, and never read the node's state themselves.
        self.totals: dict[str, float] = {}
        self._reported: dict[str, float] = {}  # the totals stats() last reported
        self._thread = threading.Thread(
            target=self._main, args=(config, pool, log_path), name="p2pactor-node", daemon=True
        )

    def start(self) -> Node:
        self._thread.start()
        try:
            return self._started.result(_START_TIMEOUT_S)
        except Exception as exc:  # Ctrl-C while it starts stays Ctrl-C
            if not self._started.done():
                what = f"did not start within {_START_TIMEOUT_S:g} s"
                raise P2PActorError(f"the p2pactor node {what}") from None
            raise P2PActorError(f"the p2pactor node failed to start: {exc}") from exc

    def stop(self, timeout: float) -> None:
        if self._token is not None:
            with contextlib.suppress(trio.RunFinishedError):  # already stopped
                self._token.run_sync_soon(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "the p2pactor node thread did not stop within %.0f s; it is left running "
                "(a peer or transfer that never ended: see the lines above)",
                timeout,
            )

    def _main(self, config: NodeConfig, pool: memoryview, log_path: str | None) -> None:
        try:
            trio.run(self._run, config, pool, log_path)
        except BaseException as exc:
            log.exception(
                "the p2pactor node stopped with an error; the tier serves no more loads "
                "(restart the engine once the cause in this traceback is fixed)"
            )
            if not self._started.done():
                self._started.set_exception(exc)

    async def _run(self, config: NodeConfig, pool: memoryview, log_path: str | None) -> None:
        from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
        from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415

        self._token = trio.lowlevel.current_trio_token()
        event_log = EventLog(
            config.node_id,
            path=log_path,
            clock_origin=(time.time(), trio.current_time()),
            keep=10_000,
            overwrite=True,
        )
        async with (
            open_zmq_transport(
                config.node_id, bind_host=config.bind_host, port=config.port, curve=config.curve
            ) as control,
            open_nixl_transport(pool, config.block_len) as data,
            open_node(
                config, control=control, data=data, event_log=event_log, hash_seed=api.hash_seed
            ) as node,
            open_operator_surface(node) as surface,
        ):
            self.surface = surface
            self._started.set_result(node)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._publish_totals, surface)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    async def _publish_totals(self, surface: OperatorSurface) -> None:
        """Publish the figures vLLM gets whenever they change (checked every 0.1 s)."""
        while True:
            try:
                totals = {k: v for k, v in surface.metrics.totals().items() if k in SERIES}
            except Exception:  # the tier serves on; only its figures in vLLM stop
                log.exception(
                    "p2pactor stopped reporting to vLLM's metrics: metrics.totals() "
                    "failed; the tier still works (report this as a p2pactor bug)"
                )
                return
            if totals != self.totals:
                self.totals = totals
            await trio.sleep(STATS_INTERVAL_S)

    def stats(self) -> Any:
        """What the node counted since the last call, as vLLM's stats: None if nothing.

        Never waits: it reads the totals the node's thread last published (at
        most 0.1 s old). Counters carry their increase (vLLM's frontend adds it
        to the Prometheus counter), gauges their value now.
        """
        now = self.totals
        if now is self._reported:
            return None
        stats = api.OffloadingConnectorStats()
        for figure, value in now.items():
            series = SERIES[figure]
            if series.gauge:
                stats.set_gauge(series.metric, value, series.labels)
            elif (increase := value - self._reported.get(figure, 0.0)) > 0:  # counters never fall
                stats.increase_counter(series.metric, increase, series.labels)
        self._reported = now
        return None if stats.is_empty() else stats
