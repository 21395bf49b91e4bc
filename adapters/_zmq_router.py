"""The node's ZeroMQ control endpoint: its ROUTER, its receive task, its table of connections."""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable
from logging import DEBUG, INFO, WARNING
from typing import Literal

import attrs
import trio
import zmq

from p2pactor.adapters._zmq_connection import ZmqConnection
from p2pactor.adapters._zmq_curve import answer_zap, curve_server, impostor, report_refusals
from p2pactor.adapters._zmq_socket import (
    COPY_BELOW,
    Counts,
    ZmqOptions,
    ZmqStatistics,
    ZmqTransportError,
    _AsyncSocket,
    _events,
    make_socket,
    note,
    note_count,
)
from p2pactor.runtime.addresses import node_id_port, peer_host
from p2pactor.runtime.keys import CurveSecurity
from p2pactor.runtime.transport import ConnectionLost

_REFAIR_EVERY = 4  # frames read between the ROUTER's looks for newly readable connections


class ZmqControlTransport:
    """A node's ZeroMQ control endpoint. Open it with :func:`open_zmq_transport`.

    Implements :class:`p2pactor.runtime.transport.ControlTransport`.

    Attributes:
        local_id: This node's id, ``host:port``: the DEALER identity, and where peers dial.
        port: The TCP port the ROUTER is bound on (the ephemeral one if 0 was asked).
        closed: Whether the transport has been closed.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoint: str,
        host: str,
        options: ZmqOptions,
        curve: CurveSecurity | None,
    ) -> None:
        """Bind the ROUTER on ``endpoint`` (with CURVE, its ZAP handler first).

        Raises:
            ZmqTransportError: Either cannot be bound.
        """
        self._zap, settings, mask = curve_server(ctx, curve)
        # A peer that reconnects takes its identity over (see ZmqOptions.redial_delay);
        # libzmq drops a frame over max_frame_bytes (the decoder's bound stays a backstop).
        settings += [(zmq.MAXMSGSIZE, options.max_frame_bytes), (zmq.ROUTER_HANDOVER, 1)]
        try:
            router, self._monitor = make_socket(
                ctx, zmq.ROUTER, endpoint, options, settings, mask=mask
            )
        except zmq.ZMQError as exc:
            if self._zap is not None:
                self._zap.close(0)
            raise ZmqTransportError(f"cannot bind the control ROUTER on {endpoint}: {exc}") from exc
        self.port = int(router.get_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
        self.local_id = f"{host}:{self.port}"
        self._ctx = ctx
        self._router = _AsyncSocket(router)
        self._options = options
        self._curve = curve
        self._nursery: trio.Nursery  # set by _start
        self._connections: dict[str, ZmqConnection] = {}
        self._accept_in, self._accept_out = trio.open_memory_channel[ZmqConnection](
            options.accept_backlog
        )
        self._last_close: dict[str, float] = {}
        self.closed = False
        self._counts = Counts()
        self._allowed: Callable[[str], bool] | None = None
        # Connections with frames read and not yet handed on, in turn (see _receive_loop).
        self._turns: deque[ZmqConnection] = deque()

    def __repr__(self) -> str:
        return f"<ZmqControlTransport {self.local_id} ({len(self._connections)} connections)>"

    @property
    def security(self) -> Literal["curve", "none"]:
        """``"curve"`` (authenticated, encrypted, peers bound to their keys) or ``"none"``.

        ``"none"`` is vLLM's plain ZeroMQ: anyone who reaches the port can use and read it.
        """
        return "none" if self._curve is None else "curve"

    def connections(self) -> list[ZmqConnection]:
        """The live connections, one per peer."""
        return list(self._connections.values())

    def statistics(self) -> ZmqStatistics:
        """Counters, for tests and monitoring."""
        return ZmqStatistics(
            connections=len(self._connections),
            pending_accepts=self._accept_in.statistics().current_buffer_used,
            **attrs.asdict(self._counts),
        )

    async def connect(self, peer_id: str) -> ZmqConnection:
        """The live connection to ``peer_id``, or a new outbound one, returned at once.

        Frames sent before the TCP and ZeroMQ handshakes complete are queued (up
        to ``send_hwm``); an unreachable peer's connection dies with a reason.

        Raises:
            ConnectionLost: ``peer_id`` is not ``host:port``, no CURVE key is
                trusted for it (with CURVE), or the transport is closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        # The table holds live connections only.
        while not self.closed and (conn := self._connections.get(peer_id)) is None:
            redial = self._last_close.get(peer_id, -math.inf) + self._options.redial_delay
            if trio.current_time() >= redial:
                conn = self._open(peer_id, inbound=False)
                break
            # See ZmqOptions.redial_delay; then look again, as the peer may
            # have opened an inbound connection meanwhile.
            await trio.sleep_until(redial)
        if self.closed or conn is None:
            raise ConnectionLost("the control transport is closed")
        conn._claimed = True
        await trio.lowlevel.cancel_shielded_checkpoint()
        return conn

    async def accept(self) -> ZmqConnection:
        """Wait for a peer we have no connection with to send a frame; its connection.

        Each is returned once, its frame queued; one that died or that ``connect()``
        claimed first is skipped.

        Raises:
            trio.ClosedResourceError: The transport is closed.
        """
        while True:
            try:
                conn = await self._accept_out.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise trio.ClosedResourceError("the control transport is closed") from None
            if conn.alive and not conn._claimed:
                conn._claimed = True
                return conn

    def accept_only(self, allowed: Callable[[str], bool]) -> None:
        """Drop the first frame of any peer for which ``allowed`` is False.

        Checked before the dial-back to the identity's address: a sender outside
        ``allowed`` never makes this node connect anywhere (``open_node`` sets it
        to ``NodeConfig.may_dial``).
        """
        self._allowed = allowed

    async def aclose(self) -> None:
        """Close every connection and the ROUTER; wake everyone waiting. Idempotent.

        Receivers get :class:`ConnectionLost`, ``accept()`` ``trio.ClosedResourceError``.
        """
        self._close()
        await trio.lowlevel.checkpoint()

    # --- internals --------------------------------------------------------------

    def _start(self, nursery: trio.Nursery, bind_host: str | None) -> None:
        """Start the transport's tasks in ``nursery``; say how it is secured, and bound."""
        self._nursery = nursery
        node = self.local_id
        port = self.port
        zap = self._zap
        monitor = self._monitor
        curve = self._curve
        if zap is not None and monitor is not None and curve is not None:
            ring = curve.keyring
            nursery.start_soon(answer_zap, zap, ring, self._refuse, name="zmq zap")
            nursery.start_soon(report_refusals, monitor, self._refuse, name="zmq router monitor")
            what = "control ROUTER bound on port %d, CURVE on (key %s, %d trusted peer ids from %s)"
            note(INFO, node, what, port, curve.keypair.public_key, len(ring), ring.where())
        else:
            warning = (
                "the control channel on port %d is UNAUTHENTICATED and UNENCRYPTED (no CURVE keys "
                "configured): any host that reaches it can connect, read the hash seed and block "
                "keys, and look up and fetch blocks. Configure curve_secret_key and curve_trusted "
                "(docs/security.md) unless every peer is a stock vLLM node on a network you trust"
            )
            note(WARNING, node, warning, port)
        if bind_host and bind_host != peer_host(node):
            # Which address is which, said once: a wrong one shows only as peers that never answer.
            note(INFO, node, "control ROUTER bound on %s:%d; peers dial %s", bind_host, port, node)
        nursery.start_soon(self._receive_loop, name="zmq router")

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._turns.clear()
        for conn in list(self._connections.values()):
            conn._die("the control transport closed", linger=self._options.dealer_linger)
        self._accept_in.close()
        if self._monitor is not None:
            self._monitor.close()
        self._router.close(self._options.router_linger)
        if self._zap is not None:  # after the ROUTER: a CURVE client is admitted by none
            self._zap.close(0)

    def _open(self, peer_id: str, *, inbound: bool) -> ZmqConnection:
        """A new connection to ``peer_id``, in the table.

        Raises:
            ConnectionLost: ``peer_id`` is not ``host:port``, or (CURVE) has no trusted key.
        """
        conn = ZmqConnection(self, peer_id, inbound=inbound)
        self._connections[peer_id] = conn
        self._counts.connections_opened += 1
        way = "inbound" if inbound else "outbound"
        note(INFO, self.local_id, "%s connection to %s opened", way, peer_id, peer=peer_id)
        return conn

    def _retire(self, conn: ZmqConnection) -> None:
        """Take a dead connection out of the table (called by the connection)."""
        self._counts.connections_died += 1
        if self._connections.get(conn.peer_id) is conn:
            del self._connections[conn.peer_id]
        now = trio.current_time()
        horizon = now - self._options.redial_delay
        if len(self._last_close) > 1024:  # keep the table bounded
            self._last_close = {p: t for p, t in self._last_close.items() if t > horizon}
        self._last_close[conn.peer_id] = now
        if self.closed:
            return
        peer, why = conn.peer_id, conn.dead_reason
        note(INFO, self.local_id, "connection to %s ended: %s", peer, why, peer=peer)

    async def _receive_loop(self) -> None:
        """The ROUTER's one receive task: it reads frames ahead, and hands them on in turn.

        Each round reads up to ``receive_batch`` frames into their connections,
        then hands them on, one frame per connection in turn, for
        ``receive_slice_s``, then yields. A peer's backlog stays here, bounded
        in bytes (``inbound_bytes``), not in libzmq (bounded in frames only);
        a peer slow to handle holds others up for one frame, never its backlog.
        """
        router = self._router
        recv = router.sock.recv_multipart
        route = self._route
        limit = self._options.receive_batch
        slice_s = self._options.receive_slice_s
        clock = time.perf_counter
        turns = self._turns
        with contextlib.suppress(trio.ClosedResourceError):  # the ROUTER closed
            while True:
                await trio.lowlevel.checkpoint_if_cancelled()
                ends = clock() + slice_s
                read = 0
                while read < limit and not router.closed:
                    try:
                        frames = recv(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    except zmq.ZMQError as exc:
                        raise ZmqTransportError(f"the ROUTER failed: {exc}") from exc
                    read += 1
                    route(frames)
                    if read % _REFAIR_EVERY == 0 and not router.closed:
                        # libzmq notices a connection that has just become
                        # readable only when it processes its commands, which
                        # recv does once per 100 messages while one connection
                        # has a backlog: a flooding peer's 100 frames would be
                        # read before an honest peer's next one. Reading EVENTS
                        # processes them now, so the round-robin includes it.
                        router.sock.getsockopt(zmq.EVENTS)
                while turns and clock() < ends:
                    conn = turns.popleft()
                    if conn._hand_next():
                        turns.append(conn)
                if router.closed:
                    return
                if not turns and read < limit and not _events(router.sock) & zmq.POLLIN:
                    # Read dry, all handed on: this task is the ROUTER's only
                    # user, so it parks on the fd itself, and that is its one
                    # yield for the round (a lone frame costs one task wake-up,
                    # not two). EVENTS was just read, and no zmq call has
                    # consumed an edge since.
                    await trio.lowlevel.wait_readable(router._fd)
                else:
                    # More is waiting: let the node's other tasks run first.
                    await trio.lowlevel.cancel_shielded_checkpoint()

    def _route(self, frames: list[zmq.Frame]) -> None:
        """Take one message to its connection (which waits its turn to hand it on).

        On a CURVE ROUTER the claimed identity must be the key's (``_zmq_curve.impostor``).
        """
        self._counts.frames_received += 1
        identity = frames[0].bytes
        if self._curve and (wrong := impostor(self._curve.keyring, identity, frames[-1])):
            self._drop(wrong)
            return
        if len(frames) != 2:
            self._drop(f"a message of {len(frames) - 1} frames (expected [identity, payload])")
            return
        if len(identity) == 5 and identity[0] == 0:
            # libzmq's own name for a connection our ROUTER handed over to a
            # newer one of the same peer (ROUTER_HANDOVER): its last frames
            # belong to a connection both sides have given up. Not news.
            self._counts.frames_dropped += 1
            note(DEBUG, self.local_id, "dropped a frame from a replaced connection")
            return
        conn = self._connections.get(identity.decode("utf-8", "replace"))
        if conn is None and (conn := self._accept_new(identity)) is None:
            return
        frame = frames[1]  # large frames as views, not copies (COPY_BELOW)
        if not conn._deliver(frame.bytes if len(frame) < COPY_BELOW else frame.buffer):
            self._counts.frames_dropped += 1  # its connection died of it: logged there

    def _accept_new(self, identity: bytes) -> ZmqConnection | None:
        """An inbound connection for a peer's first frame, or None (frame dropped)."""
        peer_id = identity.decode("utf-8", "replace")
        if "\ufffd" in peer_id or not node_id_port(peer_id):  # not UTF-8, or not host:port
            self._drop(f"a frame from identity {identity[:64]!r}, which is not host:port")
            return None
        if self._allowed is not None and not self._allowed(peer_id):
            # Checked before _open, which dials back: the frame's identity is
            # the sender's claim, and must not pick our outbound connections.
            self._drop(
                f"a frame from {peer_id}, which this node may not dial; add it to "
                "allowed_peers (P2PACTOR_ALLOWED_PEERS) to accept it, unless "
                "p2pactor.node logged another reason for it",
                peer=peer_id,
            )
            return None
        if self._accept_in.statistics().current_buffer_used >= self._options.accept_backlog:
            self._drop(
                f"a frame from new peer {peer_id}: {self._options.accept_backlog} wait",
                peer=peer_id,
            )
            return None
        try:
            conn = self._open(peer_id, inbound=True)
        except ConnectionLost as exc:
            self._drop(f"a frame from {peer_id}: {exc.reason}", peer=peer_id)
            return None
        self._accept_in.send_nowait(conn)  # room checked above
        return conn

    def _drop(self, what: str, *, peer: str | None = None) -> None:
        self._counts.frames_dropped += 1
        note_count(self.local_id, "dropped", what, self._counts.frames_dropped, peer=peer)

    def _refuse(self, what: str) -> None:
        self._counts.auth_refused += 1
        note_count(self.local_id, "refused", what, self._counts.auth_refused)
