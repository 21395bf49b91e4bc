"""The peer registry: a node's sessions, who may connect, what closed sessions left, seed redials.

One live session per peer. Outbound, :meth:`PeerRegistry.session_for` starts
one when a request first names a peer; inbound, :meth:`PeerRegistry.accept`
runs the accept policy on each new connection: peers we may not dial are
refused, a peer that dials us while our session is about to dial it joins that
session, a peer that connects again replaces its old session, and a node at
``max_peers`` (or shutting down) turns newcomers away. A node known by a
loopback address neither dials nor accepts peers on other hosts, decided
before any socket (:meth:`~p2pactor.runtime.config.NodeConfig.dial_refusal`).
A seed peer whose session ended is dialed again (:class:`SeedRedial`,
``docs/sources.md``, "Membership").
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import attrs
import trio

from p2pactor.core import protocol as wire
from p2pactor.runtime.logcontext import peer_context
from p2pactor.runtime.session import PeerSession, SessionCloseResult
from p2pactor.runtime.timers import Timers
from p2pactor.runtime.transport import ControlConnection

if TYPE_CHECKING:
    from p2pactor.runtime.host import NodeHost


log = logging.getLogger("p2pactor.node")

CLOSED_KEPT = 1024
"""Closed sessions whose results :meth:`PeerRegistry.closed_sessions` keeps."""


@attrs.define(eq=False)
class PeerRegistry:
    """The sessions of one node, keyed by peer id.

    Args:
        host: What sessions need of the node: its configuration (``max_peers``,
            ``may_dial``), its control transport, and each closed session's
            result (:meth:`~p2pactor.runtime.host.NodeHost.session_closed`).
        nursery: Where session tasks run (the node's).
    """

    _host: NodeHost
    _nursery: trio.Nursery
    _sessions: dict[str, PeerSession] = attrs.field(factory=dict, init=False)
    _closing: set[PeerSession] = attrs.field(factory=set, init=False)
    # The most recent only: a long-lived node sees peers come and go for
    # ever, and each result holds what its session left owed.
    _closed_results: deque[SessionCloseResult] = attrs.field(
        factory=lambda: deque(maxlen=CLOSED_KEPT), init=False
    )
    closed_count: int = attrs.field(default=0, init=False)  # sessions closed since the start
    # Peers refused for a loopback id, said once each: an engine asks per
    # request, and the same line a thousand times hides everything else.
    _unreachable: set[str] = attrs.field(factory=set, init=False)
    shutting_down: bool = attrs.field(default=False, init=False)

    def sessions(self) -> list[PeerSession]:
        """Live sessions, one per peer."""
        return list(self._sessions.values())

    def replaced_sessions(self) -> list[PeerSession]:
        """Sessions a reconnecting peer replaced, still draining."""
        return list(self._closing)

    def session(self, peer: str) -> PeerSession | None:
        """The live session with ``peer``, if any."""
        return self._sessions.get(peer)

    def closed_sessions(self) -> list[SessionCloseResult]:
        """What the sessions that closed left behind, oldest first (the last 1,024)."""
        return list(self._closed_results)

    @property
    def draining(self) -> bool:
        """Whether a replaced session is still draining. Any thread."""
        return bool(self._closing)

    def session_for(self, peer: str) -> PeerSession | None:
        """The live session with ``peer``, started now if need be; None if it may not be dialed."""
        session = self._sessions.get(peer)
        if session is not None and session.alive:
            return session
        if self.shutting_down or not self.may_accept(peer, "not dialing"):
            return None
        return None if self._full(peer, "not dialing") else self._start(peer, None)

    def _full(self, peer: str, action: str) -> bool:
        """Whether the node is at ``max_peers`` (said with ``action``, and the fix, if so)."""
        if len(self._sessions) < self._host.config.max_peers:
            return False
        log.warning(
            "%s %s: at max_peers (%d); raise max_peers (VLLM_P2P_MAX_PEERS) to allow more",
            action,
            peer,
            self._host.config.max_peers,
            extra=peer_context(peer, node=self._host.node_id),
        )
        return True

    def may_accept(self, peer: str, action: str = "refused") -> bool:
        """Whether a first frame from ``peer`` may be taken (and ``peer`` dialed back).

        The transport asks before it dials back (``accept_only``); a refusal
        for a loopback id is logged here (once per peer, with ``action``), with
        both addresses and the fix.
        """
        if self._host.config.may_dial(peer):
            return True
        reason = self._host.config.dial_refusal(peer)
        if reason is not None and peer not in self._unreachable:
            if len(self._unreachable) < CLOSED_KEPT:  # bounded: peer ids come from frames too
                self._unreachable.add(peer)
            log.error(
                "%s %s: %s", action, peer, reason, extra=peer_context(peer, node=self._host.node_id)
            )
        return False

    def _start(
        self, peer: str, conn: ControlConnection | None, first: wire.Connect | None = None
    ) -> PeerSession:
        session = PeerSession(self._host, peer, conn, first)
        self._sessions[peer] = session
        self._nursery.start_soon(self._run, session, name=f"session {peer}")
        return session

    async def _run(self, session: PeerSession) -> None:
        try:
            await session.run()
        finally:
            if self._sessions.get(session.peer_id) is session:
                del self._sessions[session.peer_id]
            self._closing.discard(session)
            if session.result is not None:
                self._closed_results.append(session.result)
                self.closed_count += 1
                self._host.session_closed(session.result)

    def restarted(self, old: PeerSession, conn: ControlConnection, first: wire.Connect) -> None:
        """The peer opened a new session on ``old``'s connection: start one with ``first``."""
        self._closing.add(old)
        if self.shutting_down:
            return  # the connection closes with the node
        self._start(old.peer_id, conn, first)

    async def accept(self) -> None:
        """Take the peers that dial us, by the accept policy, until the transport closes."""
        while True:
            try:
                conn = await self._host.control.accept()
            except trio.ClosedResourceError:
                return  # the transport was closed under us: no more peers
            await self._admit(conn)

    async def _admit(self, conn: ControlConnection) -> None:
        peer = conn.peer_id
        existing = self._sessions.get(peer)
        context = peer_context(peer, node=self._host.node_id)
        if not self.may_accept(peer):  # (which says why a loopback id is refused)
            if self._host.config.dial_refusal(peer) is None:
                log.warning(
                    "refused %s: not in allowed_peers; add it to allowed_peers "
                    "(P2PACTOR_ALLOWED_PEERS) to accept it",
                    peer,
                    extra=context,
                )
            await conn.aclose()
            return
        if existing is not None and existing.dialing:
            # Both nodes dialed each other at once, and the peer's frame came
            # before this node's session ran its connect(): that connect()
            # takes this very connection from the transport's table. Closing
            # it would lose the peer's `connect`, and the session would never
            # finish its handshake (seen with 16 nodes starting together).
            log.debug(
                "%s dialed us while we dial it; the session takes its connection",
                peer,
                extra=context,
            )
            return
        if existing is not None and existing.alive:
            # A transport opens an inbound connection only for a peer it has
            # no live connection with: the session's own connection is gone
            # (the peer restarted or dropped it) and the session is about to
            # notice. The new connection is the peer now; the old session ends.
            log.info(
                "%s connected again; its old session ends and a new one starts",
                peer,
                extra=context,
            )
            existing.close("the peer connected again: this session's connection is gone")
        elif self.shutting_down or self._full(peer, "refused"):
            if self.shutting_down:
                log.info("refused %s: this node is shutting down", peer, extra=context)
            await conn.aclose()
            return
        if existing is not None:
            self._closing.add(existing)
        self._start(peer, conn)

    async def close_all(self, reason: str) -> None:
        """Close every session (draining each) and wait until all have closed."""
        self.shutting_down = True
        sessions = [*self._sessions.values(), *self._closing]
        for session in sessions:
            session.close(reason, node_closing=True)
        for session in sessions:
            await session.wait_closed()


@attrs.define(eq=False)
class SeedRedial:
    """When to dial each seed peer whose session ended again, and the back-off of each.

    The wait doubles per failed attempt, from ``first_s`` up to ``max_s``, and
    starts over once a handshake with the peer succeeds; peers that are not
    seeds are not redialed (they dial us, or a request names them).

    Args:
        seeds: The seed peers.
        dial: Opens the session with a peer (the node's host does).
        timers: The node's timer.
        clock: The node's clock.
        first_s: The first wait after a session ends.
        max_s: The longest wait between two attempts.
    """

    seeds: Collection[str]
    _dial: Callable[[str], None]
    _timers: Timers = attrs.field(kw_only=True)
    _clock: Callable[[], float] = attrs.field(kw_only=True)
    _first_s: float = attrs.field(default=1.0, kw_only=True)
    _max_s: float = attrs.field(default=60.0, kw_only=True)
    _due: dict[str, float] = attrs.field(factory=dict, init=False)
    # The next back-off of each peer that failed.
    _wait: dict[str, float] = attrs.field(factory=dict, init=False)

    @property
    def deadline(self) -> float | None:
        """When the next seed is dialed again (None: none is waiting)."""
        return min(self._due.values(), default=None)

    def lost(self, peer: str) -> None:
        """``peer``'s session ended with no other to replace it: dial it again later."""
        if peer not in self.seeds or peer in self._due:
            return
        wait = self._wait.get(peer, self._first_s)
        self._wait[peer] = min(self._max_s, wait * 2)
        self._due[peer] = self._clock() + wait
        self._timers.arm(self)

    def connected(self, peer: str) -> None:
        """A handshake with ``peer`` succeeded: its next loss waits ``first_s`` again."""
        self._wait.pop(peer, None)
        self._due.pop(peer, None)

    def stop(self) -> None:
        """The node is closing: dial nobody again."""
        self._due.clear()

    def expire(self) -> None:
        """Dial the seeds whose wait is over."""
        now = self._clock()
        for peer, when in list(self._due.items()):
            if when <= now:
                del self._due[peer]
                self._dial(peer)
        self._timers.arm(self)
