"""p2pactor's figures in vLLM's ``/metrics``: which of the node's totals, under what names."""

from __future__ import annotations

from typing import Any

import attrs

from p2pactor.adapters._vllm_api import (
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
)
from p2pactor.surface.metrics import LOOKUP_OUTCOMES, SERVED_LOOKUP_OUTCOMES

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


@attrs.frozen
class _Series:
    """Where one figure of the node's ``metrics.totals()`` goes in vLLM's metrics."""

    metric: str
    gauge: bool
    labels: tuple[str, ...] = ()


def _series(metric: str, *labels: str) -> _Series:
    return _Series(METRIC_PREFIX + metric, METRICS[metric][0], labels)


# Figures without a series here are not sent: vLLM's frontend refuses a metric
# its tiers did not define at start.
SERIES: dict[str, _Series] = {
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


def metric_definitions() -> dict[str, Any]:
    """The tier's metrics, as vLLM's OffloadingMetricMetadata by name."""
    return {
        METRIC_PREFIX + name: (OffloadingGaugeMetadata if gauge else OffloadingCounterMetadata)(
            documentation=doc, labelnames=labelnames
        )
        for name, (gauge, doc, labelnames) in METRICS.items()
    }


def tier_stats(before: dict[str, float], now: dict[str, float]) -> Any:
    """What changed from ``before`` to ``now`` as vLLM's stats, or None if nothing.

    Counters carry their increase (vLLM's frontend adds it to the Prometheus
    counter), gauges their value now.
    """
    stats = OffloadingConnectorStats()
    for figure, value in now.items():
        series = SERIES.get(figure)
        if series is None:
            continue
        if series.gauge:
            stats.set_gauge(series.metric, value, series.labels)
        else:
            increase = value - before.get(figure, 0.0)
            if increase > 0:  # a Prometheus counter refuses to go down
                stats.increase_counter(series.metric, increase, series.labels)
    return None if stats.is_empty() else stats
