"""One peer's ZeroMQ control connection: our DEALER to it, its frames from our ROUTER, its death."""

from __future__ import annotations

import contextlib
import math
from collections import deque
from logging import DEBUG, ERROR
from typing import TYPE_CHECKING

import trio
import zmq

from p2pactor.adapters._zmq_curve import curve_client
from p2pactor.adapters._zmq_socket import _AsyncSocket, _Monitor, make_socket, note
from p2pactor.core.protocol import Frame
from p2pactor.runtime.addresses import node_id_port
from p2pactor.runtime.transport import ConnectionLost, FrameReceiver

# vLLM's fatal events, plus HANDSHAKE_SUCCEEDED, which tells a refused or
# unreachable peer from one that went away after we reached it.
_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_EVENTS |= zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_EVENTS |= zmq.EVENT_HANDSHAKE_FAILED_AUTH

if TYPE_CHECKING:
    from p2pactor.adapters._zmq_router import ZmqControlTransport


class ZmqConnection:
    """One peer's control channel: frames out through our DEALER, in from our ROUTER.

    Created by :meth:`ZmqControlTransport.connect` (outbound) or returned by
    :meth:`ZmqControlTransport.accept` (inbound); never directly.

    Attributes:
        peer_id: The peer's id, ``host:port``.
        inbound: Whether the peer opened it (by sending us a frame first).
        dead_reason: Why the connection died, or None while it lives.
    """

    def __init__(self, transport: ZmqControlTransport, peer_id: str, *, inbound: bool) -> None:
        """Dial ``peer_id``: a DEALER (identity ``local_id``), its monitor, and their tasks.

        Raises:
            ConnectionLost: ``peer_id`` is not ``host:port``, (CURVE) has no
                trusted key, or libzmq refused.
        """
        self._transport = transport
        self._options = transport._options
        self.peer_id = peer_id
        self.inbound = inbound
        # Frames read and not handed on yet: to the attached receiver, in turn
        # with other connections' (the ROUTER task reads ahead of what it hands
        # over, so the peer's backlog is here, counted in bytes, not in libzmq,
        # counted in frames), or else to receive().
        self._frames: deque[Frame] = deque()
        self._bytes = 0
        self._arrival = trio.lowlevel.ParkingLot()  # receive() waits here
        self.dead_reason: str | None = None
        self._receiver: FrameReceiver | None = None  # see attach()
        # _in_turn: the ROUTER task has it among the connections to hand frames to;
        # _reached: the ZeroMQ handshake with the peer completed;
        # _claimed: connect() or accept() handed it out.
        self._in_turn = self._reached = self._claimed = self._told_lost = False
        self._dial()

    def _dial(self) -> None:
        """A DEALER to the peer (identity ``local_id``), its monitor, and their tasks."""
        peer_id, transport, options = self.peer_id, self._transport, self._options
        if not node_id_port(peer_id):
            raise ConnectionLost(f"cannot dial {peer_id!r}: a peer id is host:port")
        settings = curve_client(transport._curve, peer_id)
        settings += [(zmq.IDENTITY, transport.local_id.encode()), (zmq.SNDHWM, options.send_hwm)]
        # ZMQ_IMMEDIATE stays 0 (vLLM): frames queue before the connection
        # completes, so the `connect` sent right away fits.
        try:
            address = f"tcp://{peer_id}"
            dealer, monitor = make_socket(
                transport._ctx, zmq.DEALER, address, options, settings, mask=_EVENTS
            )
        except zmq.ZMQError as exc:
            raise ConnectionLost(f"cannot dial {peer_id}: {exc}") from exc
        assert monitor is not None
        self._dealer = _AsyncSocket(dealer, zmq.POLLOUT)
        self._monitor = monitor
        self._reached = False
        transport._nursery.start_soon(self._watch, monitor, name=f"zmq monitor {peer_id}")

    def renew(self) -> None:
        """The peer started over: dial it again, dropping what was queued for it.

        Its new session came in on a new TCP connection, but ours to it may be
        one the peer closed while a cut link kept the news from us: the first
        frames of the new session would go down it and be lost when the reset
        arrives. So the DEALER is made anew (the peer's ROUTER takes the new
        one in its place). If libzmq refuses it, the connection dies of that.
        """
        if self.dead_reason is not None:
            return
        self._monitor.close()  # ends the old monitor's task
        self._dealer.close(0)
        try:
            self._dial()
        except ConnectionLost as exc:
            self._die(exc.reason)

    def __repr__(self) -> str:
        way = "inbound" if self.inbound else "outbound"
        state = "alive" if self.alive else f"dead: {self.dead_reason}"
        return f"<ZmqConnection {self._transport.local_id} -> {self.peer_id} {way} ({state})>"

    @property
    def alive(self) -> bool:
        """Whether the connection still works."""
        return self.dead_reason is None

    async def send(self, frame: bytes) -> None:
        """Queue ``frame`` for the peer, in order.

        Returns at once unless ``send_hwm`` frames are already queued; then it
        waits for room, at most ``send_timeout``. Always a checkpoint.
        Cancellation: either the frame was queued and this returns, or it was
        not and ``Cancelled`` is raised.

        Raises:
            ConnectionLost: The connection is dead, or the peer has not read
                what was queued for ``send_timeout`` (the connection dies of it).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        if self.send_nowait(frame):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        options = self._options
        dealer = self._dealer
        with trio.move_on_after(options.send_timeout):
            if not dealer.watched:  # the first full queue: start watching it
                dealer.start_watching(self._transport._nursery, f"zmq dealer fd {self}")
            while True:
                try:
                    await dealer.wait()
                except trio.ClosedResourceError:  # it died meanwhile
                    raise self._lost() from None
                if self.send_nowait(frame):
                    return  # sent: no checkpoint may follow that could lose it
        # vLLM's rule, with a grace period: control frames are small, so a queue
        # that stays full means the peer stopped reading. Failing beats stalling.
        raise self._die(
            f"{self.peer_id} is not reading: {options.send_hwm} frames queued for it "
            f"and no room for {options.send_timeout:g} s"
        )

    def send_nowait(self, frame: bytes) -> bool:
        """Queue ``frame`` for the peer now if there is room; never blocks, no checkpoint.

        For a caller on the trio thread that would otherwise hand the frame to
        a sender task: it spares that task's wake-up per frame. In order with
        :meth:`send` only if no ``send`` is in progress.

        Returns:
            Whether the frame was queued: False if ``send_hwm`` frames already
            are (then :meth:`send` waits for room).

        Raises:
            ConnectionLost: The connection is dead, or libzmq refused the frame
                for another reason than room (the connection dies of it).
        """
        if self.dead_reason is not None:
            raise ConnectionLost(self.dead_reason)
        try:
            self._dealer.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            raise self._die(f"sending to {self.peer_id} failed: {exc}") from exc
        self._dealer.after_operation()
        return True

    def attach(self, receiver: FrameReceiver | None) -> None:
        """Hand every frame from now on to ``receiver``, on the ROUTER's task (None: buffer).

        Frames buffered so far are handed over first, before this returns; if
        the connection has died, ``receiver.connection_lost`` follows them.
        """
        self._receiver = None
        if receiver is None:
            self._arrival.unpark_all()  # what waits now waits for receive()
            return
        while self._frames:
            self._hand(receiver, self._pop())
        self._receiver = receiver
        if self.dead_reason is not None:
            self._tell_lost()

    def _pop(self) -> Frame:
        frame = self._frames.popleft()
        self._bytes -= len(frame)
        return frame

    def _hand(self, receiver: FrameReceiver, frame: Frame | None) -> None:
        """Hand ``frame`` to ``receiver`` (None: tell it the connection died)."""
        try:
            if frame is None:
                receiver.connection_lost(self.dead_reason or "connection closed")
            else:
                receiver.frame_received(frame)
        except Exception:  # the receiver's bug must not take the ROUTER (every peer) down
            peer, node = self.peer_id, self._transport.local_id
            when = "when told the connection died" if frame is None else "on a frame; frame dropped"
            bug = "(a bug in p2pactor: please report it with this traceback)"
            note(ERROR, node, "the receiver of %s failed %s %s", peer, when, bug, peer=peer)

    def _tell_lost(self) -> None:
        if self._receiver is not None and not self._told_lost:
            self._told_lost = True
            self._hand(self._receiver, None)

    async def receive(self) -> Frame:
        """Wait for the peer's next frame (while no receiver is attached).

        Any number of tasks may wait at once; each frame goes to one of them.
        Cancellation never loses a frame. Frames that arrived before the
        connection died are still returned, then :class:`ConnectionLost`.

        Raises:
            ConnectionLost: The connection died (or was closed); no frame will come.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while not self._frames or self._receiver is not None:
            if self.dead_reason is not None:
                raise self._lost()
            await self._arrival.park()
        frame = self._pop()
        await trio.lowlevel.cancel_shielded_checkpoint()
        return frame

    async def aclose(self) -> None:
        """Close the connection: frames still queued for the peer get ``dealer_linger``.

        Frames received but not yet taken are dropped. Idempotent. The peer is not
        told (send it a ``disconnect`` first); its own side lives on until it
        notices. A checkpoint.
        """
        self._die("connection closed", linger=self._options.dealer_linger)
        self._frames.clear()
        self._bytes = 0
        await trio.lowlevel.checkpoint()

    # --- what the transport does ------------------------------------------------

    def _lost(self) -> ConnectionLost:
        return ConnectionLost(self.dead_reason or "connection closed")

    def _deliver(self, frame: Frame) -> bool:
        """Take a frame from the peer (the ROUTER task); whether it was taken.

        It waits its turn to be handed to the receiver (:meth:`_hand_next`),
        or for :meth:`receive`. A frame that does not fit kills the connection
        and is dropped: the peer sends faster than we handle what it sends,
        and more than ``inbound_bytes`` of it (or, with no receiver attached,
        ``inbound_queue`` frames) wait.
        """
        options = self._options
        if self._frames and self._bytes + len(frame) > options.inbound_bytes:
            too_many = f"{options.inbound_bytes} bytes"
        elif self._receiver is None and len(self._frames) >= options.inbound_queue:
            too_many = f"{options.inbound_queue} frames"
        else:
            self._frames.append(frame)
            self._bytes += len(frame)
            if self._receiver is None:
                self._arrival.unpark()
            elif not self._in_turn:
                self._in_turn = True
                self._transport._turns.append(self)
            return True
        self._die(f"{self.peer_id} flooded us: more than {too_many} received and not yet handled")
        return False

    def _hand_next(self) -> bool:
        """Hand the oldest frame read for the receiver to it; whether it keeps its turn."""
        if (receiver := self._receiver) is not None and self._frames:
            self._hand(receiver, self._pop())
        # Without a receiver (attach(None)) they wait for receive().
        self._in_turn = self._receiver is not None and bool(self._frames)
        return self._in_turn

    async def _watch(self, monitor: _Monitor) -> None:
        """Turn the DEALER's monitor events (and a missed dial deadline) into death."""
        deadline = trio.current_time() + self._options.connect_timeout
        peer, node = self.peer_id, self._transport.local_id
        with contextlib.suppress(trio.ClosedResourceError):  # the connection closed its monitor
            while self.alive:
                events = [(0, 0)]  # nothing by the deadline: never reached (_death_reason)
                with trio.move_on_at(math.inf if self._reached else deadline):
                    events = await monitor.receive()
                if monitor is not self._monitor:
                    return  # renew() replaced the DEALER: these were the old one's
                for event, value in events:
                    note(DEBUG, node, "monitor of %r: %r %r", self, event, value, peer=peer)
                    if why := self._death_reason(event, value):
                        self._die(why)
                        return

    def _death_reason(self, event: int, value: int) -> str | None:
        """Why a monitor event (0: none by the dial deadline) kills us, saying what to change.

        None for the one that does not (a handshake that succeeded).
        """
        peer = self.peer_id
        curve = self._transport._curve
        opts = self._options
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._reached = True
            return None
        if event == 0:
            return (
                f"could not reach {peer} within {opts.connect_timeout:g} s (no ZeroMQ handshake: "
                "host unreachable, name unresolvable, or no ZeroMQ peer at that address)"
            )
        if event == zmq.EVENT_DISCONNECTED:
            # libzmq reports a heartbeat timeout as a plain disconnect.
            return (
                f"{peer} went away: the connection dropped (the peer closed it or "
                f"died, or sent nothing for {opts.heartbeat_timeout:g} s)"
            )
        if event == zmq.EVENT_CLOSED:
            if self._reached:
                return f"{peer} went away: the connection closed"
            return f"cannot connect to {peer}: refused (nothing listens there?)"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value != zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                return (
                    f"the ZeroMQ handshake with {peer} failed: protocol error "
                    "(not a compatible ZeroMQ peer?)"
                )
            if curve is not None:
                return (
                    f"{peer} does not use CURVE (a stock vLLM peer, or a p2pactor node without "
                    "curve keys): this node has CURVE keys and talks only to peers that have "
                    f"them too; give {peer} a key pair (docs/security.md) or stop trusting it"
                )
            return (
                f"{peer} requires CURVE (authenticated, encrypted) connections and this node "
                "has no keys: configure curve_secret_key and curve_trusted (docs/security.md)"
            )
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            if curve is None:
                return (
                    f"the ZeroMQ handshake with {peer} failed: authentication "
                    "(security settings differ?)"
                )
            ours = curve.keypair.public_path() or "this node's public .key file"
            return (
                f"{peer} refused this node's CURVE key (ZAP status {value}): it does not "
                f"trust us; give its operator {ours} to put in its trusted directory, and "
                f"restart {peer}"
            )
        if curve is None:  # NO_DETAIL: a CURVE peer often closes before our side has read why
            return (
                f"the ZeroMQ handshake with {peer} broke off: the peer went away, does not "
                "speak ZeroMQ, or requires CURVE keys, which this node does not have "
                "(docs/security.md)"
            )
        return (
            f"the CURVE handshake with {peer} broke off: {peer} went away, or its key is "
            f"not the one trusted for it in {curve.keyring.where()} (did it make a new "
            "key pair? then get its current .key file)"
        )

    def _die(self, reason: str, *, linger: float = 0.0) -> ConnectionLost:
        """Make the connection dead and release its sockets; why, to raise. Idempotent.

        ``linger`` is how long frames still queued on the DEALER may take to
        leave: ``dealer_linger`` when we close it (a final ``disconnect``), 0
        when it died, so that nothing queued for a peer we gave up on reaches
        it later (a refused peer that comes up, a stalled one that wakes).
        """
        if self.dead_reason is None:
            self.dead_reason = reason
            if self._receiver is not None:  # what waits for a receiver that will not get it
                self._frames.clear()
                self._bytes = 0
            self._arrival.unpark_all()  # receivers drain what came, then ConnectionLost
            self._transport._retire(self)
            self._monitor.close()  # wakes our monitor task
            self._dealer.close(linger)  # wakes senders waiting for room
            self._tell_lost()  # last: the receiver may close or replace us
        return ConnectionLost(reason)
