"""What a peer session is and leaves, and what it needs from its node.

:class:`SessionHost` is the node's side of the contract with its
:class:`~p2pactor.runtime.session.PeerSession` objects (implemented by
:class:`~p2pactor.runtime.host.NodeHost`); :class:`SessionState` and
:class:`SessionCloseResult` are what the node reads back.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import attrs

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.runtime.actor import RequestActor, Runner
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.directory import SourceDirectory
from p2pactor.runtime.ledger import QuotaLedger
from p2pactor.runtime.timers import Timers
from p2pactor.runtime.transport import ControlTransport, DataTransport

__all__ = ["SessionCloseResult", "SessionHost", "SessionState"]


class SessionState(enum.Enum):
    """Where a session is in its life."""

    CONNECTING = "connecting"
    """Dialing, or waiting for the handshake to complete."""
    READY = "ready"
    """Both connects accepted and acked: requests flow both ways."""
    CLOSING = "closing"
    """Dead; actors are finishing what can't be abandoned."""
    CLOSED = "closed"
    """Gone. Its result says what was still owed."""


@attrs.frozen(kw_only=True)
class SessionCloseResult:
    """What a closed session leaves behind.

    Attributes:
        peer_id: The peer.
        reason: Why the session ended.
        failed_loads: Load jobs of this node that failed because it ended.
        failed_requests: Our kv_request_ids that lost their answers.
        held_pins: Pin jobs still held when the drain gave up; the node
            releases them.
        open_contexts: Synthetic parent requests still owed a close; the node
            closes them at the next serve.
    """

    peer_id: str
    reason: str
    failed_loads: tuple[int, ...] = ()
    failed_requests: tuple[str, ...] = ()
    held_pins: tuple[int, ...] = ()
    open_contexts: tuple[str, ...] = ()


class SessionHost(Protocol):
    """What a session needs from its node: its parts, and what to tell it."""

    config: NodeConfig
    control: ControlTransport
    data: DataTransport
    quotas: QuotaLedger
    """The node's per-peer quota counts."""
    runner: Runner
    """Every input reaches an actor through it."""
    timers: Timers
    """Actors' deadlines are armed on it."""
    directory: SourceDirectory
    """Summaries both ways (sessions that negotiated ``kvsum/1`` feed it)."""

    @property
    def hash_seed(self) -> str:
        """The hash seed to advertise and require."""
        ...

    def record(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """Append ``events`` to the node's event log."""

    def post_parent(self, actor: RequestActor, request: fx.ParentRequest) -> None:
        """Queue a parent request; its answer goes back to ``actor``."""

    def release_pin(self, job_id: int, *, success: bool) -> None:
        """Release a pin job (through the parent, when it is lent)."""

    def report_load(self, job_id: int, *, success: bool, reason: str) -> None:
        """Report one of the engine's load jobs finished."""

    def producer_opened(self, actor: RequestActor) -> None:
        """A producer actor was created (the node binds parked stores to it)."""

    def actor_created(self, actor: RequestActor) -> None:
        """An actor was created (observers may watch it)."""

    def handshake_ended(self, peer: str, outcome: str) -> None:
        """The handshake with ``peer`` ended: ``ok`` or why not (for metrics)."""
