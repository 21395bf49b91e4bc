"""What :class:`p2pactor.surface.metrics.NodeMetrics` reads only when scraped: no cost per event.

The gauges (sessions, peers, actors, pinned blocks), the event log's counters,
the slow-step watch's (:mod:`p2pactor.runtime.loopwatch`) and the source
directory's (:func:`source_state`, which ``/status`` reads too) come
from the node's state now; the counters and histograms from the counts the
event stream left in :mod:`p2pactor.surface._metrics_counts`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Final, NamedTuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2pactor.core.ids import Role
from p2pactor.runtime.sources import DirectoryCounts
from p2pactor.surface._metrics_counts import _Histogram, _Peer

if TYPE_CHECKING:
    from p2pactor.runtime.node import Node

_UNKNOWN_PEER: Final = "unknown"  # the transport refuses unauthenticated peers before naming them


class _Gauges(NamedTuple):
    sessions: dict[str, int]
    peers_ready: int
    actors: dict[str, int]
    pinned: dict[str, int]


def _gauges(node: Node) -> _Gauges:
    sessions: dict[str, int] = {}
    actors = dict.fromkeys((Role.CONSUMER.value, Role.PRODUCER.value), 0)
    ready = 0
    for session in node.peers.sessions():
        state = session.state.value
        sessions[state] = sessions.get(state, 0) + 1
        ready += session.ready and session.alive
        for actor in session.live_actors():
            actors[actor.id.role.value] += 1
    pinned = {peer: u.pinned_blocks for peer, u in node.quota_usage().items()}
    return _Gauges(sessions, ready, actors, pinned)


class _SourcePeer(NamedTuple):
    peer: str
    claimed_keys: int
    precision: float
    quarantined: bool
    synced: bool


class _Sources(NamedTuple):
    enabled: bool
    counts: DirectoryCounts
    index_claims: int
    index_bytes: int
    index_pending: bool
    advertised_keys: int
    peers: list[_SourcePeer]


def source_state(node: Node) -> _Sources:
    """The source directory's counts and state now (for ``/metrics`` and ``/status``)."""
    directory = node.directory
    index = directory.index
    now = node.now()
    peers = []
    for peer in index.peers:
        position = index.position(peer)
        peers.append(
            _SourcePeer(
                peer,
                len(index.peer(peer).claims),
                index.precision(peer),
                index.quarantined(peer, now),
                position is not None and position[2],
            )
        )
    return _Sources(
        directory.options.share,
        directory.counts,
        len(index),
        index.nbytes,
        index.pending,
        # Not sharing, the node tells its peers nothing, whatever it may hold.
        len(directory.holdings) if directory.options.share else 0,
        peers,
    )


def _unauthenticated(node: Node) -> int:
    """CURVE clients the control transport refused (0 when it does not say)."""
    statistics = getattr(node.control, "statistics", None)
    if not callable(statistics):
        return 0
    return int(getattr(statistics(), "auth_refused", 0) or 0)


class _NodeCollector(Collector):
    """Turns a node's counts and its state into metric families."""

    def __init__(
        self, node: Node, peers: dict[str, _Peer], histograms: Sequence[_Histogram]
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
        yield from _loop_families(node)
        yield from _source_families(source_state(node))


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


# The event log's counters: each family's name after ``p2pactor_event_log_``, its field
# of LogStatistics, and its help.
_LOG_COUNTERS: Final = (
    ("appends", "appends", "Batches appended to the event log."),
    ("events", "events_appended", "Events appended to the event log."),
    (
        "append_seconds",
        "append_seconds",
        "Time spent in the event log's append (encoding, buffering, writes it made).",
    ),
    (
        "appended_bytes",
        "bytes_appended",
        "Bytes of event records appended (encoded; 0 for a log kept in memory only).",
    ),
    ("written_bytes", "bytes_written", "Bytes of the event log handed to the operating system."),
)


def _log_families(node: Node) -> Iterator[Metric]:
    stats = node.event_log.statistics()
    for name, field, doc in _LOG_COUNTERS:
        yield CounterMetricFamily(f"p2pactor_event_log_{name}", doc, value=getattr(stats, field))


def _loop_families(node: Node) -> Iterator[Metric]:
    """The slow-step watch on the node's trio thread (0 and 0 while it is off)."""
    loop = node.loop_watch.snapshot()
    yield CounterMetricFamily(
        "p2pactor_loop_slow_steps",
        "Task steps that held the node's trio thread at least slow_step_s (one message "
        "handled, a timer's work, a GC pause inside them).",
        value=loop.slow_steps,
    )
    yield GaugeMetricFamily(
        "p2pactor_loop_longest_step_seconds",
        "The longest task step on the node's trio thread since it started, slow or not.",
        value=loop.longest_step_s,
    )


def _counter_by(name: str, doc: str, label: str, values: dict[str, int]) -> Metric:
    """A counter family with one sample per value of ``label``."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in values.items():
        family.add_metric([value], count)
    return family


def _source_families(sources: _Sources) -> Iterator[Metric]:
    """The source directory's counters (totals since start) and its gauges now."""
    counts = sources.counts
    yield _counter_by(
        "p2pactor_source_choices",
        "Requests naming no source, by the node's choice: chosen (a peer was asked), "
        "unclaimed (no peer it could ask claimed the first key), not_worth (the claimed "
        "runs were too short to be worth a round trip).",
        "outcome",
        {"chosen": counts.chosen, "unclaimed": counts.unclaimed, "not_worth": counts.not_worth},
    )
    yield CounterMetricFamily(
        "p2pactor_source_probed_keys",
        "Keys a chosen peer's summary claimed, asked of it by automatic lookups.",
        value=counts.probed_keys,
    )
    yield CounterMetricFamily(
        "p2pactor_source_false_claims",
        "Of those keys, the ones the chosen peer answered MISS for (or never answered), "
        "refusals aside.",
        value=counts.false_claims,
    )
    yield CounterMetricFamily(
        "p2pactor_source_refused_claims",
        "Of those keys, the ones the chosen peer refused over a quota (it said so): no "
        "false claim.",
        value=counts.refused_claims,
    )
    yield CounterMetricFamily(
        "p2pactor_source_undelivered_claims",
        "Of those keys, the ones the chosen peer answered HIT for and then failed to deliver "
        "(it reported the transfer failed, never reported it, or its session went down).",
        value=counts.undelivered_claims,
    )
    yield _counter_by(
        "p2pactor_summary_bytes",
        "Summary bytes (key fingerprints, 8 per key; framing excluded) sent to every "
        "summary peer together, or received from them.",
        "direction",
        {"sent": counts.bytes_sent, "received": counts.bytes_received},
    )
    yield _counter_by(
        "p2pactor_summary_messages",
        "Summary messages this node sent, by kind: delta (one per peer per flush), "
        "snapshot_part (a part of a whole summary, to one peer).",
        "kind",
        {"delta": counts.deltas_sent, "snapshot_part": counts.parts_sent},
    )
    yield CounterMetricFamily(
        "p2pactor_summary_resyncs",
        "Snapshots this node asked of a peer whose summary had a gap or a new epoch.",
        value=counts.resyncs_sent,
    )
    yield CounterMetricFamily(
        "p2pactor_source_summary_floods",
        "Times a peer's summary messages came faster than this node applied them: "
        "what waited was dropped and its snapshot asked again.",
        value=counts.summary_floods,
    )
    yield GaugeMetricFamily(
        "p2pactor_source_index_claims",
        "Claims the source index holds: (peer, key fingerprint) pairs, a key two peers "
        "claim counting twice.",
        value=sources.index_claims,
    )
    yield GaugeMetricFamily(
        "p2pactor_source_index_bytes",
        "Memory the source index holds: every peer's claims, the filter, snapshots being "
        "assembled and summary messages waiting to be applied.",
        value=sources.index_bytes,
    )
    peers = GaugeMetricFamily(
        "p2pactor_source_peers",
        "Peers whose summary this node keeps, by state: synced (a whole snapshot arrived) "
        "or syncing.",
        labels=["state"],
    )
    synced = sum(p.synced for p in sources.peers)
    peers.add_metric(["synced"], synced)
    peers.add_metric(["syncing"], len(sources.peers) - synced)
    yield peers
    claimed = GaugeMetricFamily(
        "p2pactor_source_peer_claimed_keys",
        "Key fingerprints a peer's summary claims.",
        labels=["peer"],
    )
    precision = GaugeMetricFamily(
        "p2pactor_source_peer_precision",
        "How often a peer's claims held when probed (a moving average; 1 before any "
        "probe and after a quarantine).",
        labels=["peer"],
    )
    quarantined = GaugeMetricFamily(
        "p2pactor_source_peer_quarantined",
        "1 while automatic choice skips a peer whose claims kept missing, else 0.",
        labels=["peer"],
    )
    for p in sources.peers:
        claimed.add_metric([p.peer], p.claimed_keys)
        precision.add_metric([p.peer], p.precision)
        quarantined.add_metric([p.peer], int(p.quarantined))
    yield from (claimed, precision, quarantined)
    yield GaugeMetricFamily(
        "p2pactor_source_advertised_keys",
        "Keys this node's summary tells its peers it holds (0 when it shares none).",
        value=sources.advertised_keys,
    )
