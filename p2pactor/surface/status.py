"""A node's status as JSON: what ``GET /status`` answers and ``p2pactor status`` prints.

:func:`node_status` is a pure read of the node's state: no awaits, no I/O, only
counts over what the node already holds (its sessions, their actors' immutable
states, the quota ledger). The HTTP server calls it on the node's trio thread
for every request, so it must stay cheap: one pass over the live actors.

Every field is described in ``docs/status.md``; ``schema`` changes only when a
field changes meaning or goes away (new fields do not change it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Final, Literal

from p2pactor import __version__
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.producer import ProducerState
from p2pactor.core.protocol import EXTENSION
from p2pactor.runtime.handshake import SessionState
from p2pactor.surface._metrics_scrape import source_state

if TYPE_CHECKING:
    from p2pactor.runtime.loopwatch import LoopSnapshot
    from p2pactor.runtime.node import Node
    from p2pactor.runtime.quotas import PeerUsage
    from p2pactor.runtime.session import PeerSession, SessionCloseResult


SCHEMA: Final = 1
"""The version of the layout :func:`node_status` returns."""

_CLOSED_SHOWN: Final = 20
"""Closed sessions listed (the most recent); ``closed_sessions.total`` counts them all."""


def control_security(node: object) -> Literal["curve", "none"]:
    """How ``node``'s control channel is protected: ``"curve"`` or ``"none"``.

    The control transport's ``security`` property when it has one (the ZeroMQ
    transport does, see ``adapters/zmq.py``); ``"none"`` otherwise: a
    transport that does not say it authenticates its peers is taken not to.
    """
    security = getattr(getattr(node, "control", None), "security", None)
    return "curve" if security == "curve" else "none"


def node_status(
    node: Node, *, totals: dict[str, float], dashboard: str | None = None
) -> dict[str, Any]:
    """The node's status, JSON-serialisable (see docs/status.md).

    Call it on the node's trio thread (the HTTP server does): it reads the
    sessions' and actors' state without locking.

    Args:
        node: The node, as its operator surface sees it.
        totals: Its metrics' cumulative figures (``NodeMetrics.totals()``), so
            that ``/status`` and ``/metrics`` agree.
        dashboard: The URL of its live timeline, if it serves one.
    """
    config = node.config
    now = node.now()
    uptime = node.uptime
    usages = node.quota_usage()
    sessions = node.peers.sessions()
    limits = _quota_limits(node)
    peers = [_peer(s, now, usages, limits) for s in [*sessions, *node.peers.replaced_sessions()]]
    requests = {"consumer": 0, "producer": 0}
    transfers = {"loads": 0, "writes": 0}
    pins = {"jobs": 0, "blocks": 0}
    for peer in peers:
        for total, part in ((requests, peer["requests"]), (transfers, peer["transfers"])):
            for name in total:
                total[name] += part[name]
        pins["jobs"] += peer["pins"]["jobs"]
        pins["blocks"] += peer["pins"]["blocks"]
    pinned_by_peer = {peer: u.pinned_blocks for peer, u in usages.items() if u.pinned_blocks}
    return {
        "schema": SCHEMA,
        "node_id": node.node_id,
        "version": __version__,
        "started_at": round(time.time() - uptime, 3),
        "uptime_s": round(uptime, 3),
        "control": {
            "address": node.node_id,
            "security": control_security(node),
            "allowed_peers": (
                None if config.allowed_peers is None else sorted(config.allowed_peers)
            ),
            "extensions": bool(config.round_extension),
        },
        "dashboard": dashboard,
        "peers": peers,
        "requests": requests,
        "transfers": transfers,
        "pins": pins,
        "pins_by_peer": pinned_by_peer,
        "limits": _limits(node, len(sessions), sum(pinned_by_peer.values())),
        "quotas": limits,
        "quota_usage": {peer: _usage(u) for peer, u in usages.items()},
        "closed_sessions": _closed(node.peers.closed_sessions(), node.peers.closed_count),
        "sources": _source_status(node),
        "loop": _loop_status(node.loop_watch.snapshot()),
        # the same cumulative figures /metrics exposes, so the two agree
        "totals": totals,
    }


def _peer(
    session: PeerSession, now: float, usages: dict[str, PeerUsage], limits: dict[str, int]
) -> dict[str, Any]:
    """One session's entry: its handshake, dialect, activity, and what it has in flight."""
    consumers = producers = loads = writes = pin_jobs = pin_blocks = 0
    for actor in session.live_actors():
        state = actor.state
        if isinstance(state, ConsumerState):
            consumers += 1
            if not state.phase.terminal:
                loads += len(state.loads)
        elif isinstance(state, ProducerState):
            producers += 1
            writes += len(state.transfers)
            pin_jobs += len(state.jobs)
            pin_blocks += sum(len(job.blocks) for job in state.jobs.values())
    steps = session.handshake_steps()
    extension = session.peer_extension
    if not steps["peer_connect_accepted"]:
        dialect = "unknown"  # the peer's connect, which says it, has not come yet
    elif extension is None:
        dialect = "vllm"
    else:
        dialect = "p2pactor"
    features = sorted(EXTENSION.features & extension.features) if extension else []
    # last_activity is the session's start until a frame arrives
    received = round(max(0.0, now - session.last_activity), 3)
    sent = None if session.last_sent is None else round(max(0.0, now - session.last_sent), 3)
    usage = usages.get(session.peer_id)
    return {
        "peer": session.peer_id,
        "session": session.serial,
        "state": session.state.value,
        "established": session.state is SessionState.READY,
        "handshake": steps,
        "dialect": dialect,
        "extension_version": None if extension is None else extension.version,
        "features": features,
        "last_received_s": received,
        "last_sent_s": sent,
        "last_activity_s": received if sent is None else min(received, sent),
        "closing_reason": session.death_reason,
        "requests": {"consumer": consumers, "producer": producers},
        "transfers": {"loads": loads, "writes": writes},
        "pins": {"jobs": pin_jobs, "blocks": pin_blocks},
        "outbox": session.unsent,
        "quotas": _peer_quotas(usage, limits),
        "refusals": {} if usage is None else dict(usage.refusals),
    }


def _limit(name: str, used: int, limit: int, what: str) -> dict[str, Any]:
    return {
        "name": name,
        "used": used,
        "limit": limit,
        "percent": round(100.0 * used / limit, 2) if limit else None,
        "what": what,
    }


def _limits(node: Node, sessions: int, pinned: int) -> list[dict[str, Any]]:
    """The node-wide limits, with how much of each is used now."""
    config = node.config
    peers = node.peers.sessions()
    fullest = max(peers, key=lambda s: s.unsent, default=None)
    return [
        _limit("max_peers", sessions, config.max_peers, "sessions, inbound and outbound"),
        _limit(
            "num_blocks",
            pinned,
            config.num_blocks,
            "blocks pinned for peers' lookups, all peers together",
        ),
        _limit(
            "engine_inbox",
            node.engine_backlog,
            config.engine_inbox,
            "engine calls handed over and not yet applied",
        ),
        _limit(
            "session_outbox",
            0 if fullest is None else fullest.unsent,
            config.session_outbox,
            "frames queued for the slowest peer"
            + ("" if fullest is None or not fullest.unsent else f" ({fullest.peer_id})"),
        ),
    ]


def _quota_limits(node: Node) -> dict[str, int]:
    """The per-peer quota limits in force (docs/quotas.md)."""
    q = node.quotas.quotas
    return {
        "pinned_blocks": node.quotas.pinned_limit,
        "open_lookups": q.max_open_lookups,
        "keys_per_lookup": q.max_keys_per_lookup,
        "fetch_rounds": q.max_fetch_rounds,
        "open_requests": q.max_open_requests,
        "rounds_per_request": q.max_rounds_per_request,
    }


def _peer_quotas(usage: PeerUsage | None, limits: dict[str, int]) -> list[dict[str, Any]]:
    """The peer's counted quotas: what it holds here now against each limit."""
    used = {
        "pinned_blocks": 0 if usage is None else usage.pinned_blocks,
        "open_lookups": 0 if usage is None else usage.open_lookups,
        "fetch_rounds": 0 if usage is None else usage.fetch_rounds,
        "open_requests": 0 if usage is None else usage.open_requests,
    }
    return [_limit(name, count, limits[name], _QUOTA_WHAT[name]) for name, count in used.items()]


_QUOTA_WHAT: Final = {
    "pinned_blocks": "blocks pinned for the peer's lookups",
    "open_lookups": "the peer's lookups not yet answered",
    "fetch_rounds": "the peer's fetch rounds in flight",
    "open_requests": "the peer's requests being served",
}


def _usage(usage: PeerUsage) -> dict[str, Any]:
    return {
        "pinned_blocks": usage.pinned_blocks,
        "peak_pinned_blocks": usage.peak_pinned_blocks,
        "open_lookups": usage.open_lookups,
        "fetch_rounds": usage.fetch_rounds,
        "open_requests": usage.open_requests,
        "refusals": dict(usage.refusals),
    }


def _source_status(node: Node) -> dict[str, Any]:
    """The source directory: its choices and summaries (totals since start), its index now.

    The same figures ``/metrics`` exports as ``p2pactor_source_*`` and
    ``p2pactor_summary_*``.
    """
    sources = source_state(node)
    counts = sources.counts
    return {
        "enabled": sources.enabled,
        "choices": {
            "chosen": counts.chosen,
            "unclaimed": counts.unclaimed,
            "not_worth": counts.not_worth,
        },
        "probed_keys": counts.probed_keys,
        "false_claims": counts.false_claims,
        "refused_claims": counts.refused_claims,
        "undelivered_claims": counts.undelivered_claims,
        "summaries": {
            "deltas_sent": counts.deltas_sent,
            "parts_sent": counts.parts_sent,
            "resyncs_sent": counts.resyncs_sent,
            "bytes_sent": counts.bytes_sent,
            "bytes_received": counts.bytes_received,
            "floods": counts.summary_floods,
        },
        "advertised_keys": sources.advertised_keys,
        "index_claims": sources.index_claims,
        "index_bytes": sources.index_bytes,
        "index_pending": sources.index_pending,
        "peers": [
            {
                "peer": p.peer,
                "synced": p.synced,
                "claimed_keys": p.claimed_keys,
                "precision": round(p.precision, 4),
                "quarantined": p.quarantined,
            }
            for p in sources.peers
        ],
    }


def _loop_status(loop: LoopSnapshot) -> dict[str, Any]:
    """The slow-step watch's figures: ``/status``'s ``loop`` (docs/status.md)."""
    return {
        "steps": loop.steps,
        "slow_step_s": loop.slow_step_s,
        "slow_steps": loop.slow_steps,
        "longest_step_s": round(loop.longest_step_s, 6),
        "recent_slow": [
            {"at": round(s.at, 3), "seconds": round(s.seconds, 6), "task": s.task}
            for s in loop.recent_slow
        ],
    }


def _closed(results: list[SessionCloseResult], total: int) -> dict[str, Any]:
    return {
        "total": total,
        "recent": [
            {
                "peer": r.peer_id,
                "reason": r.reason,
                "failed_loads": len(r.failed_loads),
                "failed_requests": len(r.failed_requests),
                "held_pins": len(r.held_pins),
                "open_contexts": len(r.open_contexts),
            }
            for r in results[-_CLOSED_SHOWN:][::-1]
        ],
    }
