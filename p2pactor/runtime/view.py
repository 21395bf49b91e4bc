"""What the operator surface may see of a node: a read-only view and its event streams.

The runtime knows nothing of metrics, ``/status``, the live timeline or their
servers. They attach from outside (:mod:`p2pactor.surface.attach`) through this view:
state to read when asked (sessions, quota usage, the event log's counters)
and streams to follow (every actor step's events, every new actor, every
handshake's outcome). :class:`~p2pactor.runtime.node.Node` is a :class:`NodeView`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.directory import SourceDirectory
from p2pactor.runtime.ledger import QuotaLedger
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.loopwatch import LoopWatch
from p2pactor.runtime.quotas import PeerUsage
from p2pactor.runtime.session import PeerSession, SessionCloseResult
from p2pactor.runtime.transport import ControlTransport

__all__ = ["EventWatcher", "HandshakeWatcher", "NodeView", "control_security"]

EventWatcher = Callable[[Sequence[ev.AnyEvent], ActorState], None]
"""Called with an actor's events of one step and its state after them."""

HandshakeWatcher = Callable[[str, str], None]
"""Called with a peer and how its handshake ended: ``ok``, or why not."""


class NodeView(Protocol):
    """A node as its operator surface sees it: read it, follow it, never drive it.

    Reads are made on the node's thread (a scrape, a status request, a
    timeline tick); watchers run on it, inside the step they report, and must
    be quick and must not block.
    """

    @property
    def node_id(self) -> str:
        """``host:port``: the node's id on the wire."""
        ...

    @property
    def config(self) -> NodeConfig:
        """The node's configuration."""
        ...

    @property
    def control(self) -> ControlTransport:
        """The control transport (for its statistics and security, where it has them)."""
        ...

    @property
    def event_log(self) -> EventLog:
        """The node's event log (for its counters)."""
        ...

    @property
    def quotas(self) -> QuotaLedger:
        """The per-peer quota counts and limits."""
        ...

    @property
    def sources(self) -> SourceDirectory:
        """Its summaries both ways and its choices of a source (their counts, its index)."""
        ...

    @property
    def loop_watch(self) -> LoopWatch:
        """The slow-step watch on its trio thread (``snapshot()`` to read it)."""
        ...

    @property
    def uptime(self) -> float:
        """Seconds since the node started."""
        ...

    @property
    def engine_backlog(self) -> int:
        """Engine calls handed over and not yet applied."""
        ...

    @property
    def closed_session_count(self) -> int:
        """How many sessions have closed since the node started."""
        ...

    def now(self) -> float:
        """The node's clock (session activity times are on it)."""
        ...

    def sessions(self) -> list[PeerSession]:
        """Live sessions, one per peer."""
        ...

    def replaced_sessions(self) -> list[PeerSession]:
        """Sessions a reconnecting peer replaced, still draining."""
        ...

    def closed_sessions(self) -> list[SessionCloseResult]:
        """What recently closed sessions left behind."""
        ...

    def quota_usage(self) -> dict[str, PeerUsage]:
        """What each peer holds on the node and what its quotas refused."""
        ...

    def watch_events(self, watcher: EventWatcher) -> Callable[[], None]:
        """Follow every actor step; returns an unsubscribe."""
        ...

    def watch_actors(self, watcher: Callable[[RequestActor], None]) -> Callable[[], None]:
        """Follow every actor created; returns an unsubscribe."""
        ...

    def watch_handshakes(self, watcher: HandshakeWatcher) -> Callable[[], None]:
        """Follow every handshake's outcome; returns an unsubscribe."""
        ...


def control_security(node: object) -> Literal["curve", "none"]:
    """How ``node``'s control channel is protected: ``"curve"`` or ``"none"``.

    The control transport's ``security`` property when it has one (the ZeroMQ
    transport does, see ``adapters/zmq.py``); ``"none"`` otherwise: a
    transport that does not say it authenticates its peers is taken not to.
    """
    security = getattr(getattr(node, "control", None), "security", None)
    return "curve" if security == "curve" else "none"
