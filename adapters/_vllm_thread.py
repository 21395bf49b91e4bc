"""The tier's node on a trio thread of its own, and the figures it publishes for ``/metrics``."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import attrs
import trio

from p2pactor.adapters._vllm_api import (
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    hash_seed,
)
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

# Metric (without the prefix) -> (is a gauge, help text, label names). The names
# after the prefix are p2pactor's own (docs/metrics.md), summed over peers.
METRICS: dict[str, tuple[bool, str, tuple[str, ...]]] = {
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
# The figures of metrics.totals() a metric shows, where they are not the one of its
# name: each with its label values. Figures no metric shows are not sent: vLLM's
# frontend refuses a metric its tiers did not define at start.
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


@attrs.frozen
class _Series:
    """Where one figure of the node's ``metrics.totals()`` goes in vLLM's metrics."""

    metric: str
    gauge: bool
    labels: tuple[str, ...] = ()


SERIES: dict[str, _Series] = {
    figure: _Series(METRIC_PREFIX + metric, gauge, labels)
    for metric, (gauge, _, _) in METRICS.items()
    for figure, labels in _FIGURES.get(metric, {metric: ()}).items()
}
"""The figures of ``metrics.totals()`` sent to vLLM, each with its series."""


def metric_definitions() -> dict[str, Any]:
    """The tier's metrics, as vLLM's OffloadingMetricMetadata by name."""
    return {
        METRIC_PREFIX + name: (OffloadingGaugeMetadata if gauge else OffloadingCounterMetadata)(
            documentation=doc, labelnames=labelnames
        )
        for name, (gauge, doc, labelnames) in METRICS.items()
    }


class NodeThread:
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
        self._reported: dict[str, float] = {}  # the totals stats() last reported
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
                config.node_id, bind_host=config.bind_host, port=config.port, curve=config.curve
            ) as control,
            open_nixl_transport(self._pool, config.block_len) as data,
            open_node(
                config, control=control, data=data, event_log=event_log, hash_seed=hash_seed
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
        stats = OffloadingConnectorStats()
        for figure, value in now.items():
            series = SERIES[figure]
            if series.gauge:
                stats.set_gauge(series.metric, value, series.labels)
            elif (increase := value - self._reported.get(figure, 0.0)) > 0:  # counters never fall
                stats.increase_counter(series.metric, increase, series.labels)
        self._reported = now
        return None if stats.is_empty() else stats
