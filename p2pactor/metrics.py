"""Prometheus metrics of one node: counters fed by its events, gauges read when scraped.

A node's operator surface (:func:`p2pactor.surface.open_operator_surface`) makes
its :class:`NodeMetrics`, with its own ``CollectorRegistry``: several nodes may
share a process (tests, the bench), and the global default registry would mix
them. The runtime does not know it exists: it follows the node's read-only view
(:class:`p2pactor.view.NodeView`). What they mean, their labels and
where they are served: ``docs/metrics.md``.

Two halves, for two costs:

* **counters and histograms** follow the node's event stream
  (:meth:`p2pactor.view.NodeView.watch_events`) and its handshakes. The node steps ~10k events/s, so
  the watcher does one dict lookup per event and adds to plain integers kept
  per peer; nothing is formatted, no label is resolved per event. Histograms
  have no labels; each is a list of bucket counts (a bisect per observation:
  prometheus-client's own ``Histogram.observe`` takes a lock and costs several
  times more).
* **gauges** (sessions, peers, actors, pinned blocks) and the event log's
  counters are read from the node only when someone scrapes (or calls
  :meth:`NodeMetrics.totals`), by a custom collector: no cost per event.

Labels are bounded: ``peer`` (a node id; at most ``max_peers`` live at once),
and small fixed sets (``outcome``, ``reason``, ``quota``, ``role``, ``state``).
A kv_request_id is never a label.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState
from p2pactor.core.ids import ActorId, Role

if TYPE_CHECKING:
    from p2pactor.view import NodeView

__all__ = [
    "CONTENT_TYPE",
    "HANDSHAKE_OUTCOMES",
    "LOOKUP_OUTCOMES",
    "SERVED_LOOKUP_OUTCOMES",
    "TRANSFER_FAILURE_REASONS",
    "NodeMetrics",
]

CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
"""The exposition format's content type (what ``GET /metrics`` answers with)."""

LOOKUP_OUTCOMES: Final = ("hit", "miss", "timeout")
"""How a key this node asked a peer about ended (``p2pactor_lookup_keys_total``)."""

SERVED_LOOKUP_OUTCOMES: Final = ("hit", "miss", "pending_resolved", "pending_expired", "refused")
"""How a key a peer asked this node about was answered (``p2pactor_served_lookup_keys_total``)."""

HANDSHAKE_OUTCOMES: Final = (
    "ok",
    "seed_mismatch",
    "block_size_mismatch",
    "fingerprint_mismatch",
    "identity_mismatch",
    "timeout",
    "unauthenticated",
)
"""How a session's handshake ended (``p2pactor_handshakes_total``)."""

TRANSFER_FAILURE_REASONS: Final = (
    "write_error",
    "peer_failed",
    "timeout",
    "session_lost",
)
"""Why a transfer failed (``p2pactor_transfers_failed_total``): ``write_error`` for a
write of ours (we serve), the others for a load of ours (we fetch): the peer
reported failure, the load deadline passed (an abort went out), the session died."""

_LATENCY_BUCKETS: Final = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_KEY_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_UNKNOWN_PEER: Final = "unknown"  # the transport refuses unauthenticated peers before naming them
_OTHER_PEERS: Final = "other"
"""The ``peer`` of the counts of peers folded away (see :meth:`NodeMetrics._peer`)."""
_MIN_REMEMBERED_PEERS: Final = 256


class _Histogram:
    """A histogram without labels: bucket counts, a sum; exported at scrape time."""

    __slots__ = ("bounds", "counts", "doc", "name", "sum")

    def __init__(self, name: str, doc: str, bounds: Sequence[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = tuple(float(b) for b in bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: over every bound (+Inf only)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Count one observation (in the first bucket whose bound is >= ``value``)."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self) -> HistogramMetricFamily:
        """The histogram as Prometheus has it: cumulative buckets up to ``+Inf``."""
        buckets: list[tuple[str, float]] = []
        seen = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), seen))
        return HistogramMetricFamily(self.name, self.doc, buckets=buckets, sum_value=self.sum)


class _Peer:
    """Cumulative counts for one peer. Plain ints: the trio thread alone adds to them."""

    __slots__ = (
        "blocks_received",
        "blocks_written",
        "failures",
        "handshakes",
        "keys",
        "lookups",
        "refusals",
        "served",
        "served_lookups",
    )

    def __init__(self) -> None:
        self.lookups = 0
        self.served_lookups = 0
        self.keys = dict.fromkeys(LOOKUP_OUTCOMES, 0)
        self.served = dict.fromkeys(SERVED_LOOKUP_OUTCOMES, 0)
        self.blocks_received = 0
        self.blocks_written = 0
        self.failures = dict.fromkeys(TRANSFER_FAILURE_REASONS, 0)
        self.refusals: dict[str, int] = {}
        self.handshakes: dict[str, int] = {}

    def absorb(self, other: _Peer) -> None:
        """Add ``other``'s counts to these."""
        self.lookups += other.lookups
        self.served_lookups += other.served_lookups
        self.blocks_received += other.blocks_received
        self.blocks_written += other.blocks_written
        for mine, theirs in (
            (self.keys, other.keys),
            (self.served, other.served),
            (self.failures, other.failures),
            (self.refusals, other.refusals),
            (self.handshakes, other.handshakes),
        ):
            for name, n in theirs.items():
                mine[name] = mine.get(name, 0) + n


class _Keys:
    """A producer lookup's keys that were ever pending, that expired, that were refused."""

    __slots__ = ("expired", "pending", "refused")

    def __init__(self) -> None:
        self.pending: set[bytes] = set()
        self.expired: set[bytes] = set()
        self.refused: set[bytes] = set()


class _Open:
    """What the metrics remember of one actor until it ends.

    Each table is made on first need: most actors need one or none.
    """

    __slots__ = ("fetches", "lookup_since", "lookups", "writes")

    def __init__(self) -> None:
        self.lookup_since: float | None = None  # consumer: when the open lookup went out
        self.fetches: dict[int, tuple[float, int]] | None = None  # round -> (sent at, blocks)
        self.writes: dict[int, int] | None = None  # producer: transfer -> blocks
        self.lookups: dict[int, _Keys] | None = None  # producer: lookups with unusual keys

    def keys_of(self, lookup_id: int) -> _Keys:
        """The unusual keys of one producer lookup, made if needed."""
        if self.lookups is None:
            self.lookups = {}
        found = self.lookups.get(lookup_id)
        if found is None:
            found = self.lookups[lookup_id] = _Keys()
        return found

    def pop_fetch(self, round_seq: int) -> tuple[float, int] | None:
        """Forget a consumer round's fetch; what it was, or None if none is remembered."""
        return None if self.fetches is None else self.fetches.pop(round_seq, None)

    def pop_write(self, transfer_id: int) -> int:
        """Forget a producer write; its blocks (0 if unknown)."""
        return 0 if self.writes is None else self.writes.pop(transfer_id, 0)

    def pop_lookup(self, lookup_id: int) -> _Keys | None:
        """Forget a producer lookup's unusual keys; them, or None if there were none."""
        return None if self.lookups is None else self.lookups.pop(lookup_id, None)


class NodeMetrics:
    """The Prometheus metrics of one node; see the module docstring and ``docs/metrics.md``.

    Made by the node's operator surface
    (:func:`p2pactor.surface.open_operator_surface`); it subscribes to the
    node's events and handshakes at once. Read it with :meth:`exposition`
    (the text format) or :meth:`totals` (flat numbers, for programs).
    """

    def __init__(self, node: NodeView) -> None:
        self._node = node
        self._block_len = node.config.block_len
        self._peers: dict[str, _Peer] = {}
        self._remembered_peers = max(_MIN_REMEMBERED_PEERS, 2 * node.config.max_peers)
        self._open: dict[ActorId, _Open] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        """This node's registry (never the process-wide default one)."""
        self._lookup_seconds = _Histogram(
            "p2pactor_lookup_seconds",
            "Time from a lookup sent to its last key answered (lookups that timed out excluded).",
            _LATENCY_BUCKETS,
        )
        self._fetch_seconds = _Histogram(
            "p2pactor_fetch_seconds",
            "Time from a fetch sent to the peer's transfer_done, for fetches that succeeded.",
            _LATENCY_BUCKETS,
        )
        self._lookup_keys = _Histogram(
            "p2pactor_keys_per_lookup", "Keys per lookup this node sent.", _KEY_BUCKETS
        )
        self.registry.register(_NodeCollector(self))
        self._handlers: dict[type[ev.Event], Callable[[Any], None]] = {
            ev.Probed: self._probed,
            ev.LookupResp: self._lookup_resp,
            ev.LookupTimedOut: self._lookup_timed_out,
            ev.FetchSent: self._fetch_sent,
            ev.TransferDone: self._transfer_done,
            ev.AbortSent: self._abort_sent,
            ev.Aborted: self._aborted,
            ev.Finished: self._ended,
            ev.LookupReceived: self._lookup_received,
            ev.LookupLimited: self._lookup_limited,
            ev.LookupRefused: self._lookup_refused,
            ev.KeysRefused: self._keys_refused,
            ev.FetchRefused: self._fetch_refused,
            ev.KeysResolved: self._keys_resolved,
            ev.PendingExpired: self._pending_expired,
            ev.LookupAnswered: self._lookup_answered,
            ev.LookupDropped: self._lookup_dropped,
            ev.TransferStarted: self._transfer_started,
            ev.TransferCompleted: self._transfer_completed,
            ev.TransferFailed: self._transfer_failed,
            ev.Closed: self._ended,
        }
        self._unwatch = node.watch_events(self._watch)
        self._unwatch_handshakes = node.watch_handshakes(self.handshake)

    # --- reading -------------------------------------------------------------------

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format 0.0.4 (:data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)

    def totals(self) -> dict[str, float]:
        """Flat cumulative figures over every peer, and the gauges now (call on the node's thread).

        Names are stable (other code builds on them): ``lookups``,
        ``keys_looked_up``, ``lookups_hit``, ``lookups_miss``,
        ``lookups_timeout`` (keys of our lookups, by answer), ``served_lookups``,
        ``served_keys``, ``served_hit``, ``served_miss``,
        ``served_pending_resolved``, ``served_pending_expired``,
        ``served_refused`` (keys peers asked us about), ``blocks_received``,
        ``bytes_received``, ``blocks_written``, ``bytes_written``,
        ``transfers_failed``, ``quota_refusals``, ``handshakes_ok``,
        ``handshakes_failed``, ``sessions_alive``, ``peers_ready``,
        ``actors``, ``pins_outstanding`` (blocks pinned for peers),
        ``log_appends``, ``log_events``, ``log_bytes``, ``log_append_seconds``.
        """
        out: dict[str, float] = dict.fromkeys(
            (
                "lookups",
                "keys_looked_up",
                "served_lookups",
                "served_keys",
                "blocks_received",
                "bytes_received",
                "blocks_written",
                "bytes_written",
                "transfers_failed",
                "quota_refusals",
                "handshakes_ok",
                "handshakes_failed",
            ),
            0.0,
        )
        for outcome in LOOKUP_OUTCOMES:
            out[f"lookups_{outcome}"] = 0.0
        for outcome in SERVED_LOOKUP_OUTCOMES:
            out[f"served_{outcome}"] = 0.0
        for p in list(self._peers.values()):
            out["lookups"] += p.lookups
            out["served_lookups"] += p.served_lookups
            for outcome, n in p.keys.items():
                out[f"lookups_{outcome}"] += n
                out["keys_looked_up"] += n
            for outcome, n in p.served.items():
                out[f"served_{outcome}"] += n
                out["served_keys"] += n
            out["blocks_received"] += p.blocks_received
            out["blocks_written"] += p.blocks_written
            out["transfers_failed"] += sum(p.failures.values())
            out["quota_refusals"] += sum(p.refusals.values())
            for outcome, n in p.handshakes.items():
                out["handshakes_ok" if outcome == "ok" else "handshakes_failed"] += n
        out["handshakes_failed"] += self._unauthenticated()
        out["bytes_received"] = out["blocks_received"] * self._block_len
        out["bytes_written"] = out["blocks_written"] * self._block_len
        gauges = self._gauges()
        out["sessions_alive"] = float(sum(gauges.sessions.values()))
        out["peers_ready"] = float(gauges.peers_ready)
        out["actors"] = float(sum(gauges.actors.values()))
        out["pins_outstanding"] = float(sum(gauges.pinned.values()))
        stats = self._node.event_log.statistics()
        out["log_appends"] = float(stats.appends)
        out["log_events"] = float(stats.events_appended)
        out["log_bytes"] = float(stats.bytes_appended)
        out["log_append_seconds"] = stats.append_seconds
        return out

    def close(self) -> None:
        """Stop following the node's events (the counts stay readable)."""
        self._unwatch()
        self._unwatch_handshakes()

    # --- what the session reports -----------------------------------------------------

    def handshake(self, peer: str, outcome: str) -> None:
        """Count a handshake with ``peer`` ending in ``outcome`` (:data:`HANDSHAKE_OUTCOMES`)."""
        counts = self._peer(peer).handshakes
        counts[outcome] = counts.get(outcome, 0) + 1

    # --- the event stream ---------------------------------------------------------------

    def _watch(self, events: Sequence[ev.AnyEvent], state: ActorState) -> None:
        del state
        handlers = self._handlers
        for event in events:
            handler = handlers.get(type(event))
            if handler is not None:
                handler(event)

    def _peer(self, peer: str) -> _Peer:
        found = self._peers.get(peer)
        if found is None:
            if len(self._peers) >= self._remembered_peers:
                self._fold_idle_peers()
            found = self._peers[peer] = _Peer()
        return found

    def _fold_idle_peers(self) -> None:
        """Fold the counts of peers without a session into ``peer="other"``.

        Without CURVE a peer is whoever claims a ``host:port``: one that comes
        back under ever new ids must not grow the label set without bound.
        Totals stay whole (and every counter monotonic); only the idle peers'
        own series end.
        """
        live = {session.peer_id for session in self._node.sessions()}
        other = self._peers.get(_OTHER_PEERS) or _Peer()
        for name in [p for p in self._peers if p not in live and p != _OTHER_PEERS]:
            other.absorb(self._peers.pop(name))
        self._peers[_OTHER_PEERS] = other

    def _track(self, actor: ActorId) -> _Open:
        found = self._open.get(actor)
        if found is None:
            found = self._open[actor] = _Open()
        return found

    def _ended(self, event: ev.Finished | ev.Closed) -> None:
        self._open.pop(event.actor, None)

    # consumer: our lookups and loads

    def _probed(self, event: ev.Probed) -> None:
        self._peer(event.actor.peer).lookups += 1
        self._lookup_keys.observe(len(event.keys))
        track = self._track(event.actor)
        if track.lookup_since is None:
            track.lookup_since = event.at

    def _lookup_resp(self, event: ev.LookupResp) -> None:
        keys = self._peer(event.actor.peer).keys
        hits = sum(event.hits)
        keys["hit"] += hits
        keys["miss"] += len(event.hits) - hits
        if event.lookup_deadline is None:  # nothing waits any more: the lookup is answered
            track = self._open.get(event.actor)
            if track is not None and track.lookup_since is not None:
                self._lookup_seconds.observe(event.at - track.lookup_since)
                track.lookup_since = None

    def _lookup_timed_out(self, event: ev.LookupTimedOut) -> None:
        self._peer(event.actor.peer).keys["timeout"] += len(event.keys)
        track = self._open.get(event.actor)
        if track is not None:
            track.lookup_since = None

    def _fetch_sent(self, event: ev.FetchSent) -> None:
        if event.keys:
            track = self._track(event.actor)
            if track.fetches is None:
                track.fetches = {}
            track.fetches[event.round_seq] = (event.at, len(event.keys))

    def _transfer_done(self, event: ev.TransferDone) -> None:
        track = self._open.get(event.actor)
        sent = None if track is None else track.pop_fetch(event.round_seq)
        if sent is None:
            return  # after an abort already counted it, or a fetch of no keys
        peer = self._peer(event.actor.peer)
        if event.success:
            self._fetch_seconds.observe(event.at - sent[0])
            peer.blocks_received += sent[1]
        else:
            peer.failures["peer_failed"] += 1

    def _abort_sent(self, event: ev.AbortSent) -> None:
        track = self._open.get(event.actor)
        if track is not None and track.pop_fetch(event.round_seq) is not None:
            self._peer(event.actor.peer).failures["timeout"] += 1

    def _aborted(self, event: ev.Aborted) -> None:
        track = self._open.get(event.actor)
        if track is not None and track.pop_fetch(event.round_seq) is not None:
            self._peer(event.actor.peer).failures["session_lost"] += 1

    # producer: what peers ask of us

    def _lookup_received(self, event: ev.LookupReceived) -> None:
        self._peer(event.actor.peer).served_lookups += 1

    def _lookup_limited(self, event: ev.LookupLimited) -> None:
        self._peer(event.actor.peer).served_lookups += 1
        self._refused(event.actor.peer, "keys_per_lookup")
        if event.admitted < len(event.keys):
            refused = self._track(event.actor).keys_of(event.lookup_id).refused
            refused.update(event.keys[event.admitted :])

    def _lookup_refused(self, event: ev.LookupRefused) -> None:
        peer = self._peer(event.actor.peer)
        peer.served_lookups += 1
        peer.served["refused"] += len(event.keys)
        self._refused(event.actor.peer, event.quota.value)

    def _keys_refused(self, event: ev.KeysRefused) -> None:
        self._refused(event.actor.peer, event.quota.value)
        self._track(event.actor).keys_of(event.lookup_id).refused.update(event.keys)

    def _fetch_refused(self, event: ev.FetchRefused) -> None:
        self._refused(event.actor.peer, event.quota.value)

    def _refused(self, peer: str, quota: str) -> None:
        refusals = self._peer(peer).refusals
        refusals[quota] = refusals.get(quota, 0) + 1

    def _keys_resolved(self, event: ev.KeysResolved) -> None:
        if event.pending:
            self._track(event.actor).keys_of(event.lookup_id).pending.update(event.pending)

    def _pending_expired(self, event: ev.PendingExpired) -> None:
        self._track(event.actor).keys_of(event.lookup_id).expired.update(event.keys)

    def _lookup_answered(self, event: ev.LookupAnswered) -> None:
        served = self._peer(event.actor.peer).served
        track = self._open.get(event.actor)
        unusual = None if track is None else track.pop_lookup(event.lookup_id)
        if unusual is None:
            hits = sum(event.hits)  # the common case: no key was ever pending or refused
            served["hit"] += hits
            served["miss"] += len(event.hits) - hits
            return
        for key, hit in zip(event.keys, event.hits, strict=True):
            if hit:
                served["pending_resolved" if key in unusual.pending else "hit"] += 1
            elif key in unusual.refused:
                served["refused"] += 1
            elif key in unusual.expired:
                served["pending_expired"] += 1
            else:
                served["miss"] += 1

    def _lookup_dropped(self, event: ev.LookupDropped) -> None:
        track = self._open.get(event.actor)
        if track is not None:
            track.pop_lookup(event.lookup_id)

    def _transfer_started(self, event: ev.TransferStarted) -> None:
        track = self._track(event.actor)
        if track.writes is None:
            track.writes = {}
        track.writes[event.transfer_id] = len(event.keys)

    def _transfer_completed(self, event: ev.TransferCompleted) -> None:
        track = self._open.get(event.actor)
        blocks = 0 if track is None else track.pop_write(event.transfer_id)
        self._peer(event.actor.peer).blocks_written += blocks

    def _transfer_failed(self, event: ev.TransferFailed) -> None:
        track = self._open.get(event.actor)
        if track is not None:
            track.pop_write(event.transfer_id)
        self._peer(event.actor.peer).failures["write_error"] += 1

    # --- read at scrape time ---------------------------------------------------------

    def _unauthenticated(self) -> int:
        """CURVE clients the control transport refused (0 when it does not say)."""
        statistics = getattr(self._node.control, "statistics", None)
        if not callable(statistics):
            return 0
        return int(getattr(statistics(), "auth_refused", 0) or 0)

    def _gauges(self) -> _Gauges:
        node = self._node
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


class _Gauges:
    __slots__ = ("actors", "peers_ready", "pinned", "sessions")

    def __init__(
        self,
        sessions: dict[str, int],
        peers_ready: int,
        actors: dict[str, int],
        pinned: dict[str, int],
    ) -> None:
        self.sessions = sessions
        self.peers_ready = peers_ready
        self.actors = actors
        self.pinned = pinned


class _NodeCollector(Collector):
    """Turns :class:`NodeMetrics`' counts and the node's state into metric families."""

    def __init__(self, metrics: NodeMetrics) -> None:
        self._m = metrics

    def collect(self) -> Iterable[Metric]:
        """The counters, the gauges and the event log's figures, now."""
        m = self._m
        peers = list(m._peers.items())
        yield from _counters(peers, m._block_len, m._unauthenticated())
        for histogram in (m._lookup_seconds, m._fetch_seconds, m._lookup_keys):
            yield histogram.family()
        gauges = m._gauges()
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
        yield from _log_families(m._node)


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
