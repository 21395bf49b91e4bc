"""One peer's control connection over ZeroMQ: our DEALER to it, its frames from our ROUTER."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from p2pactor.adapters._zmq_curve import _HANDSHAKE_FAILED, _handshake_failure
from p2pactor.adapters._zmq_options import ZmqOptions, log
from p2pactor.adapters._zmq_socket import _AsyncSocket, _Monitor
from p2pactor.core.protocol import Frame
from p2pactor.runtime.keys import CurveSecurity
from p2pactor.runtime.logcontext import peer_context
from p2pactor.runtime.transport import ConnectionLost, FrameReceiver

# vLLM's fatal events, plus HANDSHAKE_SUCCEEDED, which tells a refused or
# unreachable peer from one that went away after we reached it.
_MONITOR_MASK = (
    zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED
)


@attrs.frozen
class _Owner:
    """What a connection needs of the transport that opened it."""

    local_id: str
    options: ZmqOptions
    nursery: trio.Nursery
    curve: CurveSecurity | None
    retire: Callable[[ZmqConnection], None]  # takes a dead connection out of its table


class ZmqConnection:
    """One peer's control channel: frames out through our DEALER, in from our ROUTER.

    Created by :meth:`ZmqControlTransport.connect` (outbound) or returned by
    :meth:`ZmqControlTransport.accept` (inbound); never directly.
    """

    def __init__(
        self,
        owner: _Owner,
        peer_id: str,
        dealer: _AsyncSocket,
        monitor: _Monitor,
        *,
        inbound: bool,
    ) -> None:
        self._owner = owner
        self._peer_id = peer_id
        self._dealer = dealer
        self._monitor = monitor
        self._inbound = inbound
        self._capacity = owner.options.inbound_queue
        self._frames_in, self._frames_out = trio.open_memory_channel[Frame](self._capacity)
        self._queued_bytes = 0
        # Frames read for the attached receiver and not handed to it yet: the
        # ROUTER task reads ahead of what it hands over, so that the peer's
        # backlog is here, counted in bytes, not in libzmq, counted in frames.
        self._unhandled: deque[Frame] = deque()
        self._unhandled_bytes = 0
        self._in_turn = False  # the ROUTER task has it among the connections to hand frames to
        self._dead_reason: str | None = None
        self._reached = False  # the ZeroMQ handshake with the peer completed
        self._claimed = False  # connect() or accept() handed it out
        self._receiver: FrameReceiver | None = None  # see attach()
        self._told_lost = False

    def __repr__(self) -> str:
        way = "inbound" if self._inbound else "outbound"
        state = "alive" if self.alive else f"dead: {self._dead_reason}"
        return f"<ZmqConnection {self._owner.local_id} -> {self._peer_id} {way} ({state})>"

    @property
    def peer_id(self) -> str:
        """The peer's id, ``host:port``."""
        return self._peer_id

    @property
    def inbound(self) -> bool:
        """Whether the peer opened it (by sending us a frame first)."""
        return self._inbound

    @property
    def alive(self) -> bool:
        """Whether the connection still works."""
        return self._dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        """Why the connection died, or None while it lives."""
        return self._dead_reason

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
        options = self._owner.options
        with trio.move_on_after(options.send_timeout):
            if not self._dealer.watched:  # the first full queue: start watching it
                self._dealer.start_watching(self._owner.nursery, f"zmq dealer fd {self}")
            while True:
                try:
                    await self._dealer.wait(zmq.POLLOUT)
                except trio.ClosedResourceError:  # it died meanwhile
                    raise self._lost() from None
                if self._try_send(frame):
                    return  # sent: no checkpoint may follow that could lose it
        # vLLM's rule, with a grace period: control frames are small, so a queue
        # that stays full means the peer stopped reading. Failing beats stalling.
        reason = (
            f"{self._peer_id} is not reading: {options.send_hwm} frames queued for it "
            f"and no room for {options.send_timeout:g} s"
        )
        self._die(reason)
        raise ConnectionLost(reason)

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
        if self._dead_reason is not None:
            raise ConnectionLost(self._dead_reason)
        return self._try_send(frame)

    def _try_send(self, frame: bytes) -> bool:
        """Queue ``frame`` if there is room (never blocks).

        Raises:
            ConnectionLost: libzmq refused it for another reason than room.
        """
        try:
            self._dealer.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as exc:
            reason = f"sending to {self._peer_id} failed: {exc}"
            self._die(reason)
            raise ConnectionLost(reason) from exc
        self._dealer.after_operation()
        return True

    def attach(self, receiver: FrameReceiver | None) -> None:
        """Hand every frame from now on to ``receiver``, on the ROUTER's task (None: buffer).

        Frames buffered so far are handed over first, before this returns; if
        the connection has died, ``receiver.connection_lost`` follows them.
        """
        self._receiver = None
        if receiver is None:
            # Frames read for the old receiver wait for the next, before later ones.
            while self._unhandled:
                frame = self._unhandled.popleft()
                self._unhandled_bytes -= len(frame)
                if not self._buffer(frame):
                    break  # it died of it, which dropped the rest
            return
        while True:
            try:
                frame = self._frames_out.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._queued_bytes -= len(frame)
            self._hand(receiver, frame)
        self._receiver = receiver
        if self._dead_reason is not None:
            self._tell_lost()

    def _hand(self, receiver: FrameReceiver, frame: Frame) -> None:
        try:
            receiver.frame_received(frame)
        except Exception:  # the receiver's bug must not take the ROUTER (every peer) down
            self._receiver_failed("on a frame; frame dropped")

    def _tell_lost(self) -> None:
        receiver = self._receiver
        if receiver is None or self._told_lost:
            return
        self._told_lost = True
        try:
            receiver.connection_lost(self._dead_reason or "connection closed")
        except Exception:
            self._receiver_failed("when told the connection died")

    def _receiver_failed(self, when: str) -> None:
        log.exception(
            "%s: the receiver of %s failed %s (a bug in p2pactor: please report it with "
            "this traceback)",
            self._owner.local_id,
            self._peer_id,
            when,
            extra=peer_context(self._peer_id, node=self._owner.local_id),
        )

    async def receive(self) -> Frame:
        """Wait for the peer's next frame (while no receiver is attached).

        Any number of tasks may wait at once; each frame goes to one of them.
        Cancellation never loses a frame. Frames that arrived before the
        connection died are still returned, then :class:`ConnectionLost`.

        Raises:
            ConnectionLost: The connection died (or was closed); no frame will come.
        """
        try:
            frame = await self._frames_out.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._lost() from None
        self._queued_bytes -= len(frame)
        return frame

    async def aclose(self) -> None:
        """Close the connection: frames still queued for the peer get ``dealer_linger``.

        Frames received but not yet taken are dropped. Idempotent. The peer is not
        told (send it a ``disconnect`` first); its own side lives on until it
        notices. A checkpoint.
        """
        self._die("connection closed", linger=self._owner.options.dealer_linger)
        self._frames_out.close()
        await trio.lowlevel.checkpoint()

    # --- what the transport does ------------------------------------------------

    def _lost(self) -> ConnectionLost:
        return ConnectionLost(self._dead_reason or "connection closed")

    def _deliver(self, frame: Frame) -> bool:
        """Take a frame from the peer: for the receiver, or queued for :meth:`receive`.

        Called by the ROUTER task, which then hands frames to the receiver in
        turn with other connections' (:meth:`_hand_next`). Returns whether it
        was taken. A frame that does not fit kills the connection and is
        dropped: the peer sends faster than we handle what it sends, and more
        than ``inbound_bytes`` of it wait.
        """
        if self._dead_reason is not None:
            return False
        if self._receiver is None:
            return self._buffer(frame)
        most = self._owner.options.inbound_bytes
        if self._unhandled and self._unhandled_bytes + len(frame) > most:
            self._die(
                f"{self._peer_id} flooded us: more than {most} bytes received and not yet handled"
            )
            return False
        self._unhandled.append(frame)
        self._unhandled_bytes += len(frame)
        return True

    def _hand_next(self) -> bool:
        """Hand the oldest frame read for the receiver to it; whether more wait."""
        if not self._unhandled:
            return False
        frame = self._unhandled.popleft()
        self._unhandled_bytes -= len(frame)
        receiver = self._receiver
        if receiver is not None:  # attach(None) moves what waits to the queue
            self._hand(receiver, frame)
        return bool(self._unhandled)

    def _buffer(self, frame: Frame) -> bool:
        """Queue a frame for :meth:`receive` (no receiver is attached); whether it fit."""
        most = self._owner.options.inbound_bytes
        if self._queued_bytes and self._queued_bytes + len(frame) > most:
            self._die(
                f"{self._peer_id} flooded us: more than {most} bytes "
                "queued before they were received"
            )
            return False
        try:
            self._frames_in.send_nowait(frame)
        except trio.WouldBlock:
            self._die(
                f"{self._peer_id} flooded us: more than {self._capacity} frames "
                "queued before they were received"
            )
            return False
        except trio.ClosedResourceError:
            return False  # died meanwhile (it is out of the table already)
        self._queued_bytes += len(frame)
        return True

    async def _watch(self) -> None:
        """Turn the DEALER's monitor events (and a missed dial deadline) into death."""
        opts = self._owner.options
        deadline = trio.current_time() + opts.connect_timeout
        monitor = self._monitor.events
        try:
            while self.alive:
                batch: list[list[bytes]] = []
                with trio.move_on_at(math.inf if self._reached else deadline):
                    batch = await monitor.receive_batch(16)
                if not batch and not self._reached:
                    self._die(
                        f"could not reach {self._peer_id} within {opts.connect_timeout:g} s "
                        "(no ZeroMQ handshake: host unreachable, name unresolvable, or "
                        "no ZeroMQ peer at that address)"
                    )
                    return
                for frames in batch:
                    message = parse_monitor_message(frames)
                    event, value = message["event"], message["value"]
                    log.debug(
                        "%s: monitor of %r: %r %r",
                        self._owner.local_id,
                        self,
                        event,
                        value,
                        extra=peer_context(self._peer_id, node=self._owner.local_id),
                    )
                    reason = self._death_reason(event, value)
                    if reason is not None:
                        self._die(reason)
                        return
        except trio.ClosedResourceError:
            return  # the connection closed its monitor

    def _death_reason(self, event: int, value: int) -> str | None:
        """What a monitor event (and its value) means: a reason to die, or None."""
        peer = self._peer_id
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._reached = True
            return None
        if event == zmq.EVENT_DISCONNECTED:
            # libzmq reports a heartbeat timeout as a plain disconnect.
            return (
                f"{peer} went away: the connection dropped (the peer closed it or "
                f"died, or sent nothing for {self._owner.options.heartbeat_timeout:g} s)"
            )
        if event == zmq.EVENT_CLOSED:
            if self._reached:
                return f"{peer} went away: the connection closed"
            return f"cannot connect to {peer}: refused (nothing listens there?)"
        if event & _HANDSHAKE_FAILED:
            return _handshake_failure(peer, event, value, self._owner.curve)
        return None

    def _die(self, reason: str, *, linger: float = 0.0) -> None:
        """Make the connection dead and release its sockets. Idempotent.

        ``linger`` is how long frames still queued on the DEALER may take to
        leave: ``dealer_linger`` when we close it (a final ``disconnect``), 0
        when it died, so that nothing queued for a peer we gave up on reaches
        it later (a refused peer that comes up, a stalled one that wakes).
        """
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._unhandled.clear()  # what waits for a receiver that will not get it
        self._unhandled_bytes = 0
        self._frames_in.close()  # receivers drain what came, then ConnectionLost
        self._owner.retire(self)
        self._monitor.close()  # wakes our monitor task
        self._dealer.close(linger)  # wakes senders waiting for room
        self._tell_lost()  # last: the receiver may close or replace us
