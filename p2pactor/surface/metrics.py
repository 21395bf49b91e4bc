"""Prometheus metrics of one node: counters fed by its events, gauges read when scraped.

A node's operator surface (:func:`p2pactor.surface.attach.open_operator_surface`) makes
its :class:`NodeMetrics`, with its own ``CollectorRegistry``: several nodes may
share a process (tests, the bench), and the global default registry would mix
them. The runtime does not know it exists: it reads and follows the node
(:class:`p2pactor.runtime.node.Node`). What they mean, their labels and
where they are served: ``docs/metrics.md``.

Two halves, for two costs:

* **counters and histograms** follow the node's event stream
  (:meth:`p2pactor.runtime.node.Node.watch_events`) and its handshakes. The
  node steps ~10k events/s, so
  the watcher does one dict lookup per event and adds to plain integers kept
  per peer (:mod:`p2pactor.surface._metrics_counts`, which says why its histograms
  are not prometheus-client's).
* **gauges** (sessions, peers, actors, pinned blocks), the event log's
  counters, the slow-step watch's and the source directory's (choices, summaries sent and received,
  the index, each summary peer's precision) are read from the node only when
  someone scrapes (or calls :meth:`NodeMetrics.totals`), by a custom collector
  (:mod:`p2pactor.surface._metrics_scrape`): no cost per event.

Labels are bounded: ``peer`` (a node id; at most ``max_peers`` live at once),
and small fixed sets (``outcome``, ``reason``, ``quota``, ``role``, ``state``,
``direction``, ``kind``).
A kv_request_id is never a label.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry, generate_latest

from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState
from p2pactor.core.ids import ActorId
from p2pactor.surface._metrics_counts import (
    LOOKUP_OUTCOMES,
    SERVED_LOOKUP_OUTCOMES,
    TRANSFER_FAILURE_REASONS,
    _Histogram,
    _Open,
    _Peer,
)
from p2pactor.surface._metrics_scrape import _gauges, _NodeCollector, _unauthenticated

if TYPE_CHECKING:
    from p2pactor.runtime.node import Node

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

HANDSHAKE_OUTCOMES: Final = (
    *("ok", "seed_mismatch", "block_size_mismatch", "fingerprint_mismatch"),
    *("identity_mismatch", "timeout", "unauthenticated"),
)
"""How a session's handshake ended (``p2pactor_handshakes_total``)."""

_LATENCY_BUCKETS: Final = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0),
)
_KEY_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_OTHER_PEERS: Final = "other"
"""The ``peer`` of the counts of peers folded away (see :meth:`NodeMetrics._peer`)."""
_MIN_REMEMBERED_PEERS: Final = 256


class NodeMetrics:
    """The Prometheus metrics of one node; see the module docstring and ``docs/metrics.md``.

    Made by the node's operator surface
    (:func:`p2pactor.surface.attach.open_operator_surface`); it subscribes to the
    node's events and handshakes at once. Read it with :meth:`exposition`
    (the text format) or :meth:`totals` (flat numbers, for programs).
    """

    def __init__(self, node: Node) -> None:
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
        self.registry.register(
            _NodeCollector(
                node, self._peers, (self._lookup_seconds, self._fetch_seconds, self._lookup_keys)
            )
        )
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
        out["handshakes_failed"] += _unauthenticated(self._node)
        out["bytes_received"] = out["blocks_received"] * self._block_len
        out["bytes_written"] = out["blocks_written"] * self._block_len
        gauges = _gauges(self._node)
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
        live = {session.peer_id for session in self._node.peers.sessions()}
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

    def _lookup_refused(self, event: ev.LookupRefused) -> None:
        peer = self._peer(event.actor.peer)
        peer.served_lookups += 1
        peer.served["refused"] += len(event.keys)
        self._refused(event.actor.peer, event.quota.value)

    def _keys_refused(self, event: ev.KeysRefused) -> None:
        self._refused(event.actor.peer, event.quota.value)

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
        # The answer says which MISSes are a quota's refusals: summed in C, as a
        # lookup over the keys-per-lookup quota may answer 65,536 keys.
        refused = sum(event.refused)
        if unusual is None:
            hits = sum(event.hits)  # the common case: no key was ever pending
            served["hit"] += hits
            served["refused"] += refused
            served["miss"] += len(event.hits) - hits - refused
            return
        flags = event.refused or (False,) * len(event.keys)
        for key, hit, no in zip(event.keys, event.hits, flags, strict=True):
            if hit:
                served["pending_resolved" if key in unusual.pending else "hit"] += 1
            elif no:
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
