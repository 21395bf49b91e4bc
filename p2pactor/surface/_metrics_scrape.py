"""What :class:`p2pactor.surface.metrics.NodeMetrics` reads only when scraped: no cost per event.

The gauges (sessions, peers, actors, pinned blocks) and the event log's counters
come from the node's state now; the counters and histograms from the counts the
event stream left in :mod:`p2pactor.surface._metrics_counts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2pactor.core.ids import Role
from p2pactor.surface._metrics_counts import _Histogram, _Peer

if TYPE_CHECKING:
    from p2pactor.runtime.view import NodeView

_UNKNOWN_PEER: Final = "unknown"  # the transport refuses unauthenticated peers before naming them


class _Gauges(NamedTuple):
    sessions: dict[str, int]
    peers_ready: int
    actors: dict[str, int]
    pinned: dict[str, int]


def _gauges(node: NodeView) -> _Gauges:
    sessions: dict[str, int] = {}
    actors = dict.fromkeys((Role.CONSUMER.value, Role.PRODUCER.value), 0)
    ready = 0
    for session in node.sessions():
        state = session.state.value
        sessions[state] = sessions.get(state, 0) + 1
        ready += session.ready and session.alive
        for actor in session.live_actors():
            actors[actor.id.role.value] += 1
    pinned = {peer: u.pinned_blocks for peer, u in node.quota_usage().items()}
    return _Gauges(sessions, ready, actors, pinned)


def _unauthenticated(node: NodeView) -> int:
    """CURVE clients the control transport refused (0 when it does not say)."""
    statistics = getattr(node.control, "statistics", None)
    if not callable(statistics):
        return 0
    return int(getattr(statistics(), "auth_refused", 0) or 0)


class _NodeCollector(Collector):
    """Turns a node's counts and its state into metric families."""

    def __init__(
        self, node: NodeView, peers: dict[str, _Peer], histograms: Sequence[_Histogram]
    ) -> None:
        self._node = node
        self._peers = peers
        self._histograms = histograms

    def collect(self) -> Iterable[Metric]:
        """The counters, the gauges and the event log's figures, now."""
        node = self._node
        yield from _counters(
            list(self._peers.items()), node.config.block_len, _unauthenticated(node)
        )
        for histogram in self._histograms:
            yield histogram.family()
        gauges = _gauges(node)
        family = GaugeMetricFamily(
            "p2pactor_sessions", "Sessions with peers, by state.", labels=["state"]
        )
        for state in ("connecting", "ready", "closing"):
            family.add_metric([state], gauges.sessions.get(state, 0))
        yield family
        yield GaugeMetricFamily(
            "p2pactor_peers", "Peers whose session is ready.", value=gauges.peers_ready
        )
        family = GaugeMetricFamily(
            "p2pactor_actors", "Live request actors, by role.", labels=["role"]
        )
        for role, n in gauges.actors.items():
            family.add_metric([role], n)
        yield family
        family = GaugeMetricFamily(
            "p2pactor_pinned_blocks",
            "Blocks pinned for a peer's lookups and not yet released (pins outstanding).",
            labels=["peer"],
        )
        for peer, n in gauges.pinned.items():
            family.add_metric([peer], n)
        yield family
        yield from _log_families(node)


def _counters(
    peers: list[tuple[str, _Peer]], block_len: int, unauthenticated: int
) -> Iterator[Metric]:
    def family(name: str, doc: str, labels: list[str]) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=labels)

    lookups = family("p2pactor_lookups", "Lookups this node sent to a peer.", ["peer"])
    keys = family(
        "p2pactor_lookup_keys",
        "Keys this node asked a peer about, by answer (hit, miss, timeout).",
        ["peer", "outcome"],
    )
    served_lookups = family(
        "p2pactor_served_lookups", "Lookups a peer sent to this node.", ["peer"]
    )
    served = family(
        "p2pactor_served_lookup_keys",
        "Keys a peer asked this node about, by answer "
        "(hit, miss, pending_resolved, pending_expired, refused).",
        ["peer", "outcome"],
    )
    blocks_received = family(
        "p2pactor_blocks_received", "Blocks loaded from a peer by fetches that succeeded.", ["peer"]
    )
    bytes_received = family(
        "p2pactor_received_bytes", "Bytes loaded from a peer by fetches that succeeded.", ["peer"]
    )
    blocks_written = family(
        "p2pactor_blocks_written", "Blocks this node wrote into a peer's memory.", ["peer"]
    )
    bytes_written = family(
        "p2pactor_written_bytes", "Bytes this node wrote into a peer's memory.", ["peer"]
    )
    failed = family(
        "p2pactor_transfers_failed", "Transfers that failed, by reason.", ["peer", "reason"]
    )
    refusals = family(
        "p2pactor_quota_refusals", "Requests of a peer refused over a quota.", ["peer", "quota"]
    )
    handshakes = family(
        "p2pactor_handshakes", "Session handshakes, by outcome.", ["peer", "outcome"]
    )
    for peer, p in peers:
        lookups.add_metric([peer], p.lookups)
        for outcome, n in p.keys.items():
            keys.add_metric([peer, outcome], n)
        served_lookups.add_metric([peer], p.served_lookups)
        for outcome, n in p.served.items():
            served.add_metric([peer, outcome], n)
        blocks_received.add_metric([peer], p.blocks_received)
        bytes_received.add_metric([peer], p.blocks_received * block_len)
        blocks_written.add_metric([peer], p.blocks_written)
        bytes_written.add_metric([peer], p.blocks_written * block_len)
        for reason, n in p.failures.items():
            failed.add_metric([peer, reason], n)
        for quota, n in list(p.refusals.items()):
            refusals.add_metric([peer, quota], n)
        for outcome, n in list(p.handshakes.items()):
            handshakes.add_metric([peer, outcome], n)
    if unauthenticated:
        handshakes.add_metric([_UNKNOWN_PEER, "unauthenticated"], unauthenticated)
    yield from (
        lookups,
        keys,
        served_lookups,
        served,
        blocks_received,
        bytes_received,
        blocks_written,
        bytes_written,
        failed,
        refusals,
        handshakes,
    )


def _log_families(node: NodeView) -> Iterator[Metric]:
    stats = node.event_log.statistics()
    yield CounterMetricFamily(
        "p2pactor_event_log_appends", "Batches appended to the event log.", value=stats.appends
    )
    yield CounterMetricFamily(
        "p2pactor_event_log_events",
        "Events appended to the event log.",
        value=stats.events_appended,
    )
    yield CounterMetricFamily(
        "p2pactor_event_log_append_seconds",
        "Time spent in the event log's append (encoding, buffering, writes it made).",
        value=stats.append_seconds,
    )
    yield CounterMetricFamily(
        "p2pactor_event_log_appended_bytes",
        "Bytes of event records appended (encoded; 0 for a log kept in memory only).",
        value=stats.bytes_appended,
    )
    yield CounterMetricFamily(
        "p2pactor_event_log_written_bytes",
        "Bytes of the event log handed to the operating system.",
        value=stats.bytes_written,
    )
