"""The control transport over ZeroMQ, on trio, wire-compatible with vLLM 0.33.0's P2P tier.

Socket layout (``docs/protocol.md``, "Transport and framing")::

    this node                                   peer "H:P"
    ROUTER bound on tcp://host:port   <-----   DEALER identity "H:P"     (peer -> us)
    DEALER identity local_id          ----->   ROUTER bound on tcp://H:P (us -> peer)

One ROUTER per node, receive only; one DEALER per peer, send only, with
``identity = local_id``. The ROUTER sees ``[identity, payload]``; the identity
names the peer, and is also the address its connection dials back to.

Use it as an async context manager::

    async with open_zmq_transport("10.0.0.5:5710", port=5710) as control:
        async with open_node(config, control=control, data=..., parent=...) as node:
            ...

How trio and libzmq meet (``shared/reference/trio-stack.md`` section 1):

* Every socket is used on the trio thread only; only ``Context.term`` runs in a
  worker thread, once every socket is closed.
* ``zmq.FD`` is edge-triggered relative to the socket's state: it signals that
  libzmq has internal commands to process, not that a message is there, and any
  zmq call on the socket may consume the edge. ``zmq.EVENTS`` is the only truth.
  So every operation first tries ``NOBLOCK``; a task that must wait re-reads
  ``EVENTS`` right before it parks; and it parks on a :class:`trio.Event`, never
  on the fd. Exactly one *watcher* task per waited-on socket parks on the fd,
  drains it with ``getsockopt(EVENTS)`` and wakes the waiters. The ROUTER is
  the exception: its receive task is its only user, so it parks on the fd
  itself, and each batch costs one task wake-up, not two.
* Sockets that are waited on: the ROUTER (one receive task that hands each
  frame, as it is read, to the session attached to its connection: the session
  steps it right there, and libzmq's round-robin across connections keeps a
  flooding peer from holding up the others), each DEALER's monitor socket (one
  task per connection), and a DEALER only once its queue is full (``SNDHWM``):
  its watcher starts then, and senders wait for room at most ``send_timeout``.
* A frame read from the ROUTER is handled before the task next checkpoints, so
  cancellation never loses one. A connection no session has attached yet keeps
  its frames in a bounded trio memory channel (:meth:`ZmqConnection.receive`).
* ``trio.lowlevel.notify_closing`` runs before every ``close``, so a task parked
  on a closing socket's fd is woken instead of sleeping on a reused fd.

How a connection dies (never silently), with a reason in :class:`ConnectionLost`:

* the DEALER's monitor reports ``DISCONNECTED`` (the peer closed the connection or
  its process died, or no heartbeat came for ``heartbeat_timeout``), ``CLOSED``
  (refused, or closed before the ZeroMQ handshake) or ``HANDSHAKE_FAILED_*``;
* no ZeroMQ handshake with the peer within ``connect_timeout`` of dialing it
  (unreachable host, unresolvable name, nothing that speaks ZMTP there). Without
  this deadline an unreachable peer never "disconnects" in ZeroMQ: libzmq retries
  forever; vLLM leaves it to its 30 s handshake timeout, which still backs this up
  for a peer that speaks ZMTP but never answers ``connect``;
* a send finds ``SNDHWM`` frames queued and no room for ``send_timeout``: the
  peer is not reading;
* the peer sent more frames than ``inbound_queue`` before they were received
  here: it floods us;
* :meth:`ZmqConnection.aclose`, or the transport closing.

A dead connection leaves the transport's table at once: the peer's next frame
(say, after it restarted) opens a fresh inbound connection and never lands in the
dead one (vLLM #49809), and :meth:`ZmqControlTransport.connect` dials afresh.
Frames that arrived before the death are still received from the dead connection,
then :class:`ConnectionLost`. A dead connection's DEALER closes with linger 0:
nothing queued for a peer we gave up on reaches it later; ``aclose()`` and the
transport's close give queued frames ``dealer_linger`` (a final ``disconnect``).

Detection times measured on 127.0.0.1 (heartbeat 0.2 s, timeout 1 s): a peer
process killed with SIGKILL is seen dead in ~2 ms (its OS closes the socket); a
stopped one (SIGSTOP) in ~1.2 s (heartbeat timeout plus an interval).

Security (``docs/security.md``). Without ``curve`` the channel is vLLM's: no
authentication, no encryption, and the ROUTER believes the identity a DEALER
claims; the transport says so in a warning when it opens. With ``curve`` (a
:class:`~p2pactor.keys.CurveSecurity`) every connection is ZeroMQ CURVE,
encrypted and authenticated both ways:

* our ROUTER is a CURVE server. A ZAP handler (a task of ours, on
  ``inproc://zeromq.zap.01`` in the transport's own context, bound before the
  ROUTER and closed after it: libzmq lets every client in when no handler
  answers, and ``ZMQ_ZAP_ENFORCE_DOMAIN`` turns that into "refuse") admits a
  client only if its key is in the keyring, and names the key as its User-Id;
* the ROUTER drops every frame whose claimed identity (``host:port``) is not
  an address the keyring binds to the key that authenticated it: a trusted
  peer cannot pose as another, and no dial-back goes to an address whose key
  did not sign the frame;
* each DEALER is a CURVE client that expects the keyring's key for the peer it
  dials; a peer with no trusted key is not dialed at all.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal, cast

import attrs
import trio
import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from p2pactor.errors import P2PActorError
from p2pactor.keys import CurveSecurity
from p2pactor.logsetup import peer_context, request_context
from p2pactor.protocol import DEFAULT_MAX_FRAME_BYTES
from p2pactor.transport import ConnectionLost, FrameReceiver

__all__ = [
    "ZmqConnection",
    "ZmqControlTransport",
    "ZmqOptions",
    "ZmqStatistics",
    "ZmqTransportError",
    "open_zmq_transport",
]

log = logging.getLogger("p2pactor.zmq")


class ZmqTransportError(P2PActorError):
    """The ZeroMQ transport itself failed (it cannot bind, or its ROUTER broke)."""


def _positive(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value > 0 or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a positive number, got {value!r}")


def _not_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be zero or more, got {value!r}")


def _positive_int(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive int, got {value!r}")


@attrs.frozen(kw_only=True)
class ZmqOptions:
    """Socket options and bounds of the ZeroMQ control transport.

    Times are in seconds (libzmq takes milliseconds; they are rounded). The
    defaults are vLLM 0.33.0's wherever it has one.

    Attributes:
        heartbeat_interval: ZMTP heartbeat period on every socket (vLLM: 2 s).
        heartbeat_timeout: A connection whose peer sends nothing, not even a
            heartbeat, for this long is dropped (vLLM: 10 s).
        heartbeat_ttl: How long the peer should wait for our traffic before it
            drops us, sent in our heartbeats (vLLM: 10 s).
        send_hwm: Frames a DEALER queues for its peer (vLLM: 1000).
        send_timeout: How long a send waits for room once ``send_hwm`` frames
            are queued; then the connection is dead, as the peer is not
            reading. 0 is vLLM's rule (dead at once). The default rides out a
            burst that outruns libzmq's I/O thread for a moment (on a busy
            2-core machine 1000 small frames take ~5 ms to send).
        dealer_linger: How long a closed DEALER keeps trying to deliver what it
            still queues, such as a final ``disconnect`` (vLLM: 0.5 s).
        router_linger: The ROUTER's linger; it never sends (vLLM: 0).
        max_frame_bytes: Largest frame the ROUTER accepts (``ZMQ_MAXMSGSIZE``).
            libzmq drops a larger one before we read it, and with it the TCP
            connection it came on: the *sender's* connection dies; ours to the
            sender lives on.
        inbound_queue: Frames queued per connection until they are received;
            one more and the peer counts as flooding us and the connection dies.
        inbound_bytes: The same bound in bytes (a frame arriving at an empty
            queue always fits): frames may be up to ``max_frame_bytes`` each.
        accept_backlog: New inbound connections waiting for :meth:`accept`;
            frames from further new peers are dropped (and logged) meanwhile.
        connect_timeout: A connection that has not completed the ZeroMQ
            handshake this long after dialing is dead (unreachable peer).
        redial_delay: After a DEALER to a peer closes, ``connect()`` waits
            this long before it dials the same peer again. A stock vLLM ROUTER
            does not set ``ZMQ_ROUTER_HANDOVER``: it ignores, for good, a new
            connection that shows our identity while the old one is still
            open there (measured: 19 in 100 immediate re-dials on 127.0.0.1,
            none after 1 ms). An inbound connection's dial-back does not wait.
        receive_batch: Frames the ROUTER task reads before it yields to others.
        batch_io_threads: Run libzmq's I/O threads under ``SCHED_BATCH``
            (Linux; elsewhere ignored). Each send wakes the I/O thread, and
            on a busy machine the kernel then often runs it in place of the
            trio thread, mid-send, until it and what it wakes are done:
            measured on a loaded 2-core VM, a non-blocking send of a small
            frame took 80-650 us of wall time for 10-20 us of CPU, and the
            work queued behind it (the next message) waited. A batch thread
            never preempts on wake-up: it runs on an idle core, or once the
            trio thread parks (sends then took 10-20 us). Its fair share of
            the CPU is unchanged.
    """

    heartbeat_interval: float = attrs.field(default=2.0, validator=_positive)
    heartbeat_timeout: float = attrs.field(default=10.0, validator=_positive)
    heartbeat_ttl: float = attrs.field(default=10.0, validator=_positive)
    send_hwm: int = attrs.field(default=1000, validator=_positive_int)
    send_timeout: float = attrs.field(default=1.0, validator=_not_negative)
    dealer_linger: float = attrs.field(default=0.5, validator=_not_negative)
    router_linger: float = attrs.field(default=0.0, validator=_not_negative)
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_FRAME_BYTES, validator=_positive_int)
    inbound_queue: int = attrs.field(default=10_000, validator=_positive_int)
    inbound_bytes: int = attrs.field(default=256 * 1024 * 1024, validator=_positive_int)
    accept_backlog: int = attrs.field(default=128, validator=_positive_int)
    connect_timeout: float = attrs.field(default=10.0, validator=_positive)
    redial_delay: float = attrs.field(default=0.05, validator=_not_negative)
    receive_batch: int = attrs.field(default=64, validator=_positive_int)
    batch_io_threads: bool = True


@attrs.frozen(kw_only=True)
class ZmqStatistics:
    """Counters of a :class:`ZmqControlTransport`, from :meth:`~ZmqControlTransport.statistics`.

    Attributes:
        connections: Live connections.
        pending_accepts: Inbound connections waiting for ``accept()`` (some may
            have died or been claimed by ``connect()`` since).
        frames_received: Frames read from the ROUTER.
        frames_dropped: Of those, frames dropped (malformed, bad identity, full
            accept backlog, a flooding peer's frame that did not fit); oversize
            frames never reach us and are not counted.
        connections_opened: Connections opened so far, both directions.
        connections_died: Connections that died or were closed so far.
        auth_refused: Clients our CURVE ZAP handler refused (key not trusted,
            or not a CURVE handshake); 0 without CURVE.
    """

    connections: int
    pending_accepts: int
    frames_received: int
    frames_dropped: int
    connections_opened: int
    connections_died: int
    auth_refused: int = 0


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _peer_address(peer_id: str) -> str | None:
    """``tcp://host:port`` for a peer id, or None if it is not ``host:port``."""
    host, sep, port = peer_id.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        return None
    if any(c.isspace() or c in "/;" for c in host):
        return None
    return f"tcp://{host}:{port}"


_FAILED_HANDSHAKE: dict[int, str] = {
    # libzmq's "no detail": mostly the connection dropping mid-handshake.
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: (
        "the ZeroMQ handshake with {peer} broke off: the peer went away, or does not speak ZeroMQ"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: (
        "the ZeroMQ handshake with {peer} failed: protocol error (not a compatible ZeroMQ peer?)"
    ),
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: (
        "the ZeroMQ handshake with {peer} failed: authentication (security settings differ?)"
    ),
}
ZAP_DOMAIN: bytes = b"p2pactor"
"""The ZAP domain of a CURVE ROUTER: our handler answers for it only."""
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
_ZAP_VERSION = b"1.0"
_ZAP_REQUEST_FRAMES = 8  # routing id, delimiter, version, id, domain, address, identity, mechanism
# vLLM's fatal events, plus HANDSHAKE_SUCCEEDED, which tells a refused or
# unreachable peer from one that went away after we reached it.
_MONITOR_MASK = (
    zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CLOSED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
# A CURVE ROUTER's failed handshakes: clients without CURVE (protocol, mechanism
# mismatch) and broken handshakes; ZAP refusals are logged by the handler.
_ROUTER_MONITOR_MASK = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_transport_serials = itertools.count(1)
_REFAIR_EVERY = 4  # frames between the ROUTER's looks for newly readable connections


def _events(sock: zmq.Socket[bytes]) -> int:
    """``zmq.EVENTS`` (``POLLIN`` / ``POLLOUT``): the only truth about readiness."""
    return cast("int", sock.getsockopt(zmq.EVENTS))


class _AsyncSocket:
    """A zmq socket waited on from trio: one watcher task parks on its ``zmq.FD``.

    Tasks that need the socket ready wait on a :class:`trio.Event` the watcher
    sets, so any number of them can wait, and none is ever woken by
    cancellation. Run :meth:`watch` in a nursery for the socket's lifetime.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._fd: int = sock.FD
        self._changed = trio.Event()
        self._wanted: dict[int, int] = {}  # flag -> tasks waiting for it
        self.closed = False
        self.watched = False  # its watcher task was started
        # A CURVE ROUTER: each message comes with its sender's User-Id (see
        # _recv_authenticated). A flag read once per batch, so the plain path
        # pays nothing for it.
        self.authenticated = False

    def start_watching(self, nursery: trio.Nursery, name: str) -> None:
        """Start the socket's one watcher task (:meth:`watch`) in ``nursery``."""
        assert not self.watched, "one watcher per socket"
        self.watched = True
        nursery.start_soon(self.watch, name=name)

    async def watch(self) -> None:
        """The one task parked on the fd; returns once the socket closes."""
        try:
            # Check before parking too: the socket may close before this task
            # first runs, and its fd number may then belong to something else.
            while not self._is_closed():
                await trio.lowlevel.wait_readable(self._fd)
                if self._is_closed():
                    return
                # Reading EVENTS makes libzmq process its pending commands: that
                # drains the fd (or wait_readable would return at once forever)
                # and may make the socket ready; whoever waits re-checks.
                self.sock.getsockopt(zmq.EVENTS)
                self._wake()
        except trio.ClosedResourceError:
            return  # notify_closing: the socket is being closed

    def _is_closed(self) -> bool:
        # A method, not the attribute: the type checker would assume that an
        # attribute it has just checked cannot change across an await.
        return self.closed

    def _wake(self) -> None:
        if self._wanted:
            self._changed.set()
            self._changed = trio.Event()

    def after_operation(self) -> None:
        """Wake waiters whose condition this task's zmq call may have satisfied.

        The call may have consumed the fd edge their watcher was parked on, so
        the watcher may never see it: look at EVENTS ourselves.
        """
        if not self._wanted:
            return  # nobody waits: the hot path pays nothing
        self._wake_for(_events(self.sock))

    def _wake_for(self, events: int) -> None:
        if any(events & flag for flag in self._wanted):
            self._changed.set()
            self._changed = trio.Event()

    async def wait(self, flag: int) -> None:
        """Wait until ``zmq.EVENTS`` has ``flag``.

        Raises:
            trio.ClosedResourceError: The socket closed.
        """
        while True:
            if self.closed:
                raise trio.ClosedResourceError("the socket is closed")
            # Re-read EVENTS right before parking: a message queued before we
            # came gives no new edge (the trap this whole class exists for).
            events = _events(self.sock)
            # Reading it may have consumed an edge that others parked for.
            self._wake_for(events)
            if events & flag:
                return
            changed = self._changed
            self._wanted[flag] = self._wanted.get(flag, 0) + 1
            try:
                await changed.wait()
            finally:
                self._wanted[flag] -= 1
                if not self._wanted[flag]:
                    del self._wanted[flag]

    async def receive_batch(self, limit: int) -> list[list[bytes]]:
        """Receive between 1 and ``limit`` multipart messages; a checkpoint.

        Cancellation never loses a message: either this returns what it took,
        or it raises ``Cancelled`` having taken nothing.

        Raises:
            trio.ClosedResourceError: The socket closed.
            zmq.ZMQError: libzmq failed (not for want of a message).
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self.closed:
                raise trio.ClosedResourceError("the socket is closed")
            batch: list[list[bytes]] = []
            recv = self._recv_authenticated if self.authenticated else self.sock.recv_multipart
            while len(batch) < limit:
                try:
                    batch.append(recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
            if batch:
                self.after_operation()
                # From here on we own the messages: no cancellation may lose them.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            await self.wait(zmq.POLLIN)

    def _recv_authenticated(self, flags: int) -> list[bytes]:
        """A message's frames and, appended, the User-Id ZAP gave its sender ("" if none).

        The User-Id is a property of the connection the message came on, which
        only a zero-copy receive exposes.
        """
        frames = self.sock.recv_multipart(flags, copy=False)
        try:
            user_id = frames[-1].get("User-Id")
        except zmq.ZMQError:  # no ZAP handler answered for that connection
            user_id = ""
        return [*(frame.bytes for frame in frames), str(user_id).encode()]

    def close(self, linger: float) -> None:
        """Close the socket, waking every task parked on it first. Idempotent."""
        if self.closed:
            return
        self.closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._changed.set()
        self.sock.close(linger=_ms(linger))


class ZmqConnection:
    """One peer's control channel: frames out through our DEALER, in from our ROUTER.

    Created by :meth:`ZmqControlTransport.connect` (outbound) or returned by
    :meth:`ZmqControlTransport.accept` (inbound); never directly.
    """

    def __init__(
        self,
        transport: ZmqControlTransport,
        peer_id: str,
        dealer: _AsyncSocket,
        monitor: _AsyncSocket,
        *,
        inbound: bool,
    ) -> None:
        self._transport = transport
        self._peer_id = peer_id
        self._dealer = dealer
        self._monitor = monitor
        self._inbound = inbound
        self._capacity = transport.options.inbound_queue
        self._frames_in, self._frames_out = trio.open_memory_channel[bytes](self._capacity)
        self._queued_bytes = 0
        self._dead_reason: str | None = None
        self._reached = False  # the ZeroMQ handshake with the peer completed
        self._claimed = False  # connect() or accept() handed it out
        # Once a session attaches, the ROUTER task hands it each frame where it
        # arrives; until then (and while detached) frames wait in the channel.
        self._receiver: FrameReceiver | None = None
        self._told_lost = False

    def __repr__(self) -> str:
        way = "inbound" if self._inbound else "outbound"
        state = "alive" if self.alive else f"dead: {self._dead_reason}"
        return f"<ZmqConnection {self._transport.local_id} -> {self._peer_id} {way} ({state})>"

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
    def reached(self) -> bool:
        """Whether the ZeroMQ handshake with the peer has completed."""
        return self._reached

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
        if self._dead_reason is not None:
            raise ConnectionLost(self._dead_reason)
        if self._try_send(frame):
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        options = self._transport.options
        with trio.move_on_after(options.send_timeout):
            if not self._dealer.watched:  # the first full queue: start watching it
                self._dealer.start_watching(self._transport._nursery, f"zmq dealer fd {self}")
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
            return
        while True:
            try:
                frame = self._frames_out.receive_nowait()
            except trio.WouldBlock:
                break
            except (trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._queued_bytes -= len(frame)
            self._hand(receiver, frame)
        self._receiver = receiver
        if self._dead_reason is not None:
            self._tell_lost()

    def _hand(self, receiver: FrameReceiver, frame: bytes) -> None:
        try:
            receiver.frame_received(frame)
        except Exception:
            # The receiver's bug must not take the ROUTER (every peer) down.
            log.exception(
                "%s: the receiver of %s failed on a frame; frame dropped (a bug in "
                "p2pactor: please report it with this traceback)",
                self._transport.local_id,
                self._peer_id,
                extra=peer_context(self._peer_id, node=self._transport.local_id),
            )

    def _tell_lost(self) -> None:
        receiver = self._receiver
        if receiver is None or self._told_lost:
            return
        self._told_lost = True
        try:
            receiver.connection_lost(self._dead_reason or "connection closed")
        except Exception:
            log.exception(
                "%s: the receiver of %s failed when told the connection died (a bug in "
                "p2pactor: please report it with this traceback)",
                self._transport.local_id,
                self._peer_id,
                extra=peer_context(self._peer_id, node=self._transport.local_id),
            )

    async def receive(self) -> bytes:
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
        self._die("connection closed", linger=self._transport.options.dealer_linger)
        self._frames_out.close()
        await trio.lowlevel.checkpoint()

    # --- what the transport does ------------------------------------------------

    def _lost(self) -> ConnectionLost:
        return ConnectionLost(self._dead_reason or "connection closed")

    def _deliver(self, frame: bytes) -> bool:
        """Hand a frame from the peer to the receiver, or queue it for :meth:`receive`.

        Called by the ROUTER task. Returns whether it was taken; a frame that
        does not fit the queue kills the connection (the peer floods us) and is
        dropped.
        """
        receiver = self._receiver
        if receiver is not None:
            if self._dead_reason is not None:
                return False
            self._hand(receiver, frame)
            return True
        most = self._transport.options.inbound_bytes
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
        self._frames_in.close()  # receivers drain what came, then ConnectionLost
        self._transport._retire(self)
        # Stop the monitor before closing our end of it. libzmq's I/O thread
        # sends monitor events *blocking*: one emitted after our PAIR closed
        # (say, by a closed DEALER that reconnects while it lingers) blocks
        # that thread for good, and every socket of the context freezes.
        with contextlib.suppress(zmq.ZMQError):
            self._dealer.sock.disable_monitor()
        # Then the PAIR: our monitor task is parked on it (notify_closing wakes it).
        self._monitor.close(0)
        self._dealer.close(linger)  # wakes senders waiting for room
        self._tell_lost()  # last: the receiver may close or replace us


class ZmqControlTransport:
    """A node's ZeroMQ control endpoint. Open it with :func:`open_zmq_transport`.

    Implements :class:`p2pactor.transport.ControlTransport`.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        router: _AsyncSocket,
        *,
        local_id: str,
        port: int,
        options: ZmqOptions,
        nursery: trio.Nursery,
        curve: CurveSecurity | None = None,
    ) -> None:
        self._ctx = ctx
        self._router = router
        self._local_id = local_id
        self._port = port
        self._options = options
        self._nursery = nursery
        self._serial = next(_transport_serials)
        self._monitor_serials = itertools.count()
        self._connections: dict[str, ZmqConnection] = {}
        self._accept_in, self._accept_out = trio.open_memory_channel[ZmqConnection](
            options.accept_backlog
        )
        self._last_close: dict[str, float] = {}
        self._closed = False
        self._received = 0
        self._dropped = 0
        self._opened = 0
        self._died = 0
        self._curve = curve
        self._auth_refused = 0
        self._router_monitor: _AsyncSocket | None = None  # with CURVE: failed handshakes
        self._allowed: Callable[[str], bool] | None = None

    def __repr__(self) -> str:
        return f"<ZmqControlTransport {self._local_id} ({len(self._connections)} connections)>"

    @property
    def local_id(self) -> str:
        """This node's id, ``host:port``: the DEALER identity, and where peers dial."""
        return self._local_id

    @property
    def port(self) -> int:
        """The TCP port the ROUTER is bound on (the ephemeral one if 0 was asked)."""
        return self._port

    @property
    def options(self) -> ZmqOptions:
        """The transport's options."""
        return self._options

    @property
    def closed(self) -> bool:
        """Whether the transport has been closed."""
        return self._closed

    @property
    def security(self) -> Literal["curve", "none"]:
        """How the control channel is protected.

        ``"curve"``: every connection is authenticated and encrypted with
        ZeroMQ CURVE, and peers are bound to their keys. ``"none"``: vLLM's
        plain ZeroMQ, which anyone who reaches the port can use and read.
        """
        return "none" if self._curve is None else "curve"

    @property
    def curve(self) -> CurveSecurity | None:
        """The CURVE keys the transport uses, or None without CURVE."""
        return self._curve

    def connections(self) -> list[ZmqConnection]:
        """The live connections, one per peer."""
        return list(self._connections.values())

    def statistics(self) -> ZmqStatistics:
        """Counters, for tests and monitoring."""
        return ZmqStatistics(
            connections=len(self._connections),
            pending_accepts=self._accept_in.statistics().current_buffer_used,
            frames_received=self._received,
            frames_dropped=self._dropped,
            connections_opened=self._opened,
            connections_died=self._died,
            auth_refused=self._auth_refused,
        )

    async def connect(self, peer_id: str) -> ZmqConnection:
        """The live connection to ``peer_id``, or a new outbound one.

        A new connection is returned at once: frames sent before the TCP and
        ZeroMQ handshakes complete are queued (up to ``send_hwm``). If the peer
        cannot be reached, the connection dies with a reason soon after.

        Raises:
            ConnectionLost: ``peer_id`` is not ``host:port``, no CURVE key is
                trusted for it (with CURVE), or the transport is closed.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        while True:
            if self._closed:
                raise ConnectionLost("the control transport is closed")
            conn = self._connections.get(peer_id)
            if conn is not None:  # the table holds live connections only
                break
            last = self._last_close.get(peer_id)
            if last is None or trio.current_time() >= last + self._options.redial_delay:
                conn = self._open(peer_id, inbound=False)
                break
            # Let the peer's ROUTER see our old connection close before it
            # sees the new one (see ZmqOptions.redial_delay); then look again,
            # as the peer may have opened an inbound connection meanwhile.
            await trio.sleep_until(last + self._options.redial_delay)
        conn._claimed = True
        await trio.lowlevel.cancel_shielded_checkpoint()
        return conn

    async def accept(self) -> ZmqConnection:
        """Wait for a peer we have no connection with to send a frame.

        Each connection is returned once, with that frame queued; one that died
        or that ``connect()`` claimed before it was accepted is skipped.

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

        The check comes before the dial-back to the address the frame's
        identity claims, so a sender outside ``allowed`` never makes this
        node connect anywhere. :func:`~p2pactor.node.open_node` sets it to
        :meth:`NodeConfig.may_dial <p2pactor.config.NodeConfig.may_dial>`.
        """
        self._allowed = allowed

    async def aclose(self) -> None:
        """Close every connection and the ROUTER; wake everyone waiting. Idempotent.

        Waiting receivers get :class:`ConnectionLost`, waiting ``accept()`` calls
        ``trio.ClosedResourceError``. Closing the context manager calls this.
        """
        self._close()
        await trio.lowlevel.checkpoint()

    # --- internals --------------------------------------------------------------

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._connections.values()):
            conn._die("the control transport closed", linger=self._options.dealer_linger)
        self._accept_in.close()
        if self._router_monitor is not None:
            # As for a DEALER (ZmqConnection._die): stop the events, then their PAIR.
            with contextlib.suppress(zmq.ZMQError):
                self._router.sock.disable_monitor()
            self._router_monitor.close(0)
        # Closing the sockets ends every task of ours (each sees its socket
        # closed); the nursery is not cancelled here, as the caller's body runs
        # in it too.
        self._router.close(self._options.router_linger)

    def _open(self, peer_id: str, *, inbound: bool) -> ZmqConnection:
        """A new connection to ``peer_id``: DEALER, monitor, and their task.

        Raises:
            ConnectionLost: The peer id is not a dialable ``host:port``, or
                (with CURVE) no key is trusted for it.
        """
        address = _peer_address(peer_id)
        if address is None:
            raise ConnectionLost(f"cannot dial {peer_id!r}: a peer id is host:port")
        curve = self._curve
        server_key: str | None = None
        if curve is not None:
            server_key = curve.keyring.key_for(peer_id)
            if server_key is None:
                # Never dial without knowing whom to expect: CURVE would refuse
                # anyway, and an untrusted address is no one we should reach.
                raise ConnectionLost(
                    f"cannot dial {peer_id}: no trusted CURVE key for it; put its public "
                    f".key file (made on that node by `p2pactor keygen STEM --address "
                    f"{peer_id}`) in {curve.keyring.where()} and restart this node"
                )
        opts = self._options
        dealer = self._ctx.socket(zmq.DEALER)
        monitor: zmq.Socket[bytes] | None = None
        try:
            _apply_heartbeat(dealer, opts)
            dealer.setsockopt(zmq.IDENTITY, self._local_id.encode())
            dealer.setsockopt(zmq.SNDHWM, opts.send_hwm)
            dealer.setsockopt(zmq.LINGER, _ms(opts.dealer_linger))
            if address.startswith("tcp://["):
                dealer.setsockopt(zmq.IPV6, 1)
            if curve is not None and server_key is not None:
                # A CURVE client that accepts only the key we trust for the peer.
                dealer.setsockopt(zmq.CURVE_SERVERKEY, server_key.encode("ascii"))
                dealer.setsockopt(zmq.CURVE_PUBLICKEY, curve.keypair.public_key.encode("ascii"))
                dealer.setsockopt(zmq.CURVE_SECRETKEY, curve.keypair.secret_key.encode("ascii"))
            # ZMQ_IMMEDIATE stays 0 (vLLM): frames queue before the connection
            # completes, so the `connect` sent right away fits.
            # A monitor endpoint unique per connection, not per peer: libzmq
            # releases an inproc name on its reaper thread after close()
            # returned, so reusing it on a reconnect fails with EADDRINUSE.
            endpoint = f"inproc://p2pactor-monitor-{self._serial}-{next(self._monitor_serials)}"
            dealer.monitor(endpoint, _MONITOR_MASK)
            # Our PAIR connects before the DEALER dials: no event may find the
            # monitor without a reader (libzmq would block on it; see _die).
            monitor = self._ctx.socket(zmq.PAIR)
            monitor.connect(endpoint)
            dealer.connect(address)
        except zmq.ZMQError as exc:
            with contextlib.suppress(zmq.ZMQError):
                dealer.disable_monitor()  # before the PAIR closes: see ZmqConnection._die
            if monitor is not None:
                monitor.close(linger=0)
            dealer.close(linger=0)
            raise ConnectionLost(f"cannot dial {peer_id}: {exc}") from exc
        watched = _AsyncSocket(monitor)
        conn = ZmqConnection(self, peer_id, _AsyncSocket(dealer), watched, inbound=inbound)
        self._connections[peer_id] = conn
        self._opened += 1
        watched.start_watching(self._nursery, f"zmq monitor fd {peer_id}")
        self._nursery.start_soon(self._watch_connection, conn, name=f"zmq monitor {peer_id}")
        log.info(
            "%s: %s connection to %s opened",
            self._local_id,
            "inbound" if inbound else "outbound",
            peer_id,
            extra=peer_context(peer_id, node=self._local_id),
        )
        return conn

    def _retire(self, conn: ZmqConnection) -> None:
        """Take a dead connection out of the table (called by the connection)."""
        self._died += 1
        if self._connections.get(conn.peer_id) is conn:
            del self._connections[conn.peer_id]
        now = trio.current_time()
        horizon = now - self._options.redial_delay
        if len(self._last_close) > 1024:  # keep the table bounded
            self._last_close = {p: t for p, t in self._last_close.items() if t > horizon}
        self._last_close[conn.peer_id] = now
        if self._closed:
            return
        log.info(
            "%s: connection to %s ended: %s",
            self._local_id,
            conn.peer_id,
            conn.dead_reason,
            extra=peer_context(conn.peer_id, node=self._local_id),
        )

    async def _watch_connection(self, conn: ZmqConnection) -> None:
        """Turn the DEALER's monitor events (and a missed dial deadline) into death."""
        opts = self._options
        deadline = trio.current_time() + opts.connect_timeout
        monitor = conn._monitor
        try:
            while conn.alive:
                batch: list[list[bytes]] = []
                with trio.move_on_at(math.inf if conn._reached else deadline):
                    batch = await monitor.receive_batch(16)
                if not batch and not conn._reached:
                    conn._die(
                        f"could not reach {conn.peer_id} within {opts.connect_timeout:g} s "
                        "(no ZeroMQ handshake: host unreachable, name unresolvable, or "
                        "no ZeroMQ peer at that address)"
                    )
                    return
                for frames in batch:
                    message = parse_monitor_message(frames)
                    event, value = message["event"], message["value"]
                    log.debug(
                        "%s: monitor of %r: %r %r",
                        self._local_id,
                        conn,
                        event,
                        value,
                        extra=peer_context(conn.peer_id, node=self._local_id),
                    )
                    reason = self._death_reason(conn, event, value)
                    if reason is not None:
                        conn._die(reason)
                        return
        except trio.ClosedResourceError:
            return  # the connection closed its monitor

    def _death_reason(self, conn: ZmqConnection, event: int, value: int) -> str | None:
        """What a monitor event (and its value) means: a reason to die, or None."""
        peer = conn.peer_id
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            conn._reached = True
            return None
        if event == zmq.EVENT_DISCONNECTED:
            # libzmq reports a heartbeat timeout as a plain disconnect.
            return (
                f"{peer} went away: the connection dropped (the peer closed it or "
                f"died, or sent nothing for {self._options.heartbeat_timeout:g} s)"
            )
        if event == zmq.EVENT_CLOSED:
            if conn._reached:
                return f"{peer} went away: the connection closed"
            return f"cannot connect to {peer}: refused (nothing listens there?)"
        if event in _FAILED_HANDSHAKE:
            return self._handshake_failure(peer, event, value)
        return None

    def _handshake_failure(self, peer: str, event: int, value: int) -> str:
        """Why a ZeroMQ handshake failed, in words that say what to change."""
        curve = self._curve
        if (
            event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
        ):
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
        if curve is not None and event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            ours = curve.keypair.public_path() or "this node's public .key file"
            return (
                f"{peer} refused this node's CURVE key (ZAP status {value}): it does not "
                f"trust us; give its operator {ours} to put in its trusted directory, and "
                f"restart {peer}"
            )
        if curve is None and event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            # A CURVE peer often closes before our side has read why.
            return (
                f"the ZeroMQ handshake with {peer} broke off: the peer went away, does not "
                "speak ZeroMQ, or requires CURVE keys, which this node does not have "
                "(docs/security.md)"
            )
        if curve is not None and event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
            return (
                f"the CURVE handshake with {peer} broke off: {peer} went away, or its key is "
                f"not the one trusted for it in {curve.keyring.where()} (did it make a new "
                "key pair? then get its current .key file)"
            )
        return _FAILED_HANDSHAKE[event].format(peer=peer)

    async def _receive_loop(self) -> None:
        """The ROUTER's one receive task: each frame goes to its connection as it is read.

        A frame is handed on (to its session, which steps it) before the next
        is read. libzmq's ROUTER takes messages round-robin across its
        connections, so a peer that floods us gets one frame handled in turn
        with each other peer's, never a batch of its own ahead of theirs. After
        ``receive_batch`` frames the task lets the node's other tasks run.
        """
        route = self._route if self._curve is None else self._route_authenticated
        router = self._router
        recv = router._recv_authenticated if router.authenticated else router.sock.recv_multipart
        limit = self._options.receive_batch
        try:
            while True:
                await trio.lowlevel.checkpoint_if_cancelled()
                handled = 0
                while handled < limit and not router.closed:
                    try:
                        frames = recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError as exc:
                        if self._closed:
                            return
                        raise ZmqTransportError(f"the ROUTER failed: {exc}") from exc
                    handled += 1
                    route(frames)
                    if not handled % _REFAIR_EVERY and not router.closed:
                        # libzmq notices a connection that has just become
                        # readable only when it processes its commands, which
                        # recv does once per 100 messages while one connection
                        # has a backlog: a flooding peer's 100 frames would go
                        # before an honest peer's next one. Reading EVENTS
                        # processes them now, so the round-robin includes it.
                        router.sock.getsockopt(zmq.EVENTS)
                if router.closed:
                    return
                if handled:
                    await trio.lowlevel.cancel_shielded_checkpoint()
                elif not _events(router.sock) & zmq.POLLIN:
                    # This task is the ROUTER's only user: it parks on the fd
                    # itself. EVENTS was read right before, with no zmq call
                    # on the socket in between (see _AsyncSocket).
                    await trio.lowlevel.wait_readable(router._fd)
        except trio.ClosedResourceError:
            return

    def _route_authenticated(self, frames: list[bytes]) -> None:
        """:meth:`_route` for a CURVE ROUTER: the claimed identity must be the key's.

        ``frames`` ends with the sender's User-Id, its public key, which our ZAP
        handler vouched for. The identity (``host:port``) is only what the
        sender claims: a frame whose identity the keyring binds to another key
        (or to none) is dropped, before it can open a connection or a dial-back.
        """
        assert self._curve is not None
        user_id = frames.pop().decode("ascii", "replace")
        keyring = self._curve.keyring
        try:
            bound = keyring.key_for(frames[0].decode())
        except UnicodeDecodeError:
            bound = None
        if not user_id or bound != user_id:
            self._received += 1
            owner = ", ".join(sorted(keyring.addresses_of(user_id))) or "no trusted peer"
            self._drop(
                f"a frame claiming to come from {frames[0][:64]!r} but sent with the CURVE "
                f"key of {owner}: a trusted peer posing as another, or a .key file whose "
                "address is not its node's id"
            )
            return
        self._route(frames)

    async def _zap_loop(self, zap: _AsyncSocket) -> None:
        """Answer libzmq's ZAP requests: admit the CURVE clients whose key we trust.

        Raises:
            ZmqTransportError: The handler's socket failed: no client could be
                admitted any more, so the transport fails rather than hang
                every handshake.
        """
        try:
            while True:
                try:
                    batch = await zap.receive_batch(16)
                except zmq.ZMQError as exc:
                    if self._closed:
                        return
                    raise ZmqTransportError(f"the CURVE ZAP handler failed: {exc}") from exc
                for request in batch:
                    reply = self._zap_answer(request)
                    if reply is None:
                        continue
                    # Room is never short on inproc for one small reply; if
                    # libzmq refuses it, that handshake simply does not finish.
                    with contextlib.suppress(zmq.ZMQError):
                        zap.sock.send_multipart(reply, zmq.NOBLOCK)
                    zap.after_operation()
        except trio.ClosedResourceError:
            return

    def _zap_answer(self, request: list[bytes]) -> list[bytes] | None:
        """The reply to one ZAP request (RFC 27), or None for something that is not one."""
        assert self._curve is not None
        if len(request) < _ZAP_REQUEST_FRAMES:
            return None  # libzmq never sends this; there is no request id to answer
        routing_id, _, version, request_id, domain, address, _, mechanism, *credentials = request
        head = [routing_id, b"", _ZAP_VERSION, request_id]
        if version != _ZAP_VERSION:
            return [*head, b"500", b"unsupported ZAP version", b"", b""]
        keyring = self._curve.keyring
        if mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            why = f"it used the {mechanism.decode('ascii', 'replace')} mechanism, not CURVE"
        else:
            key = z85.encode(credentials[0]).decode("ascii")
            if domain == ZAP_DOMAIN and keyring.trusts(key):
                return [*head, b"200", b"OK", key.encode("ascii"), b""]
            why = (
                f"its key {key} is not trusted: if it is a peer of ours, put its .key "
                f"file in {keyring.where()} and restart this node"
            )
        self._refused(f"a CURVE client at {address.decode('ascii', 'replace')}: {why}")
        return [*head, b"400", b"key not trusted", b"", b""]

    async def _router_monitor_loop(self, monitor: _AsyncSocket) -> None:
        """Log the clients a CURVE ROUTER turned away before ZAP was asked.

        A client without CURVE (a stock vLLM peer, a p2pactor node without
        keys, a scanner) fails the ZMTP handshake on the mechanism; libzmq
        reports it on the ROUTER only, with our own endpoint, not the client's.
        """
        try:
            while True:
                for frames in await monitor.receive_batch(16):
                    message = parse_monitor_message(frames)
                    event, value = message["event"], message["value"]
                    if (
                        event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                        and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                    ):
                        why = (
                            "it came without CURVE keys (a stock vLLM peer, a p2pactor node "
                            "without keys, or not a peer at all); this node talks only to "
                            "peers with trusted CURVE keys"
                        )
                    elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                        why = f"it broke the ZeroMQ protocol (error {value:#x})"
                    else:
                        why = (
                            "the handshake broke off (a client without CURVE keys, one that "
                            "went away, or not a ZeroMQ peer)"
                        )
                    self._refused(f"a client: {why}")
        except (trio.ClosedResourceError, zmq.ZMQError):
            return  # the transport closed the monitor (or its ROUTER)

    def _refused(self, what: str) -> None:
        """Count a client turned away, and log it (a flood must not flood the log)."""
        self._auth_refused += 1
        if self._auth_refused <= 10 or self._auth_refused % 1000 == 0:
            log.warning(
                "%s: refused %s (%d refused so far)",
                self._local_id,
                what,
                self._auth_refused,
                extra={"node": self._local_id},
            )

    def _route(self, frames: list[bytes]) -> None:
        self._received += 1
        if len(frames) != 2:
            self._drop(f"a message of {len(frames) - 1} frames (expected [identity, payload])")
            return
        identity, payload = frames
        if len(identity) == 5 and identity[0] == 0:
            # libzmq's own name for a connection our ROUTER handed over to a
            # newer one of the same peer (ROUTER_HANDOVER): its last frames
            # belong to a connection both sides have given up. Not news.
            self._dropped += 1
            log.debug(
                "%s: dropped a frame from a replaced connection",
                self._local_id,
                extra={"node": self._local_id},
            )
            return
        try:
            peer_id = identity.decode()
        except UnicodeDecodeError:
            self._drop(f"a frame from identity {identity[:64]!r}, which is not host:port")
            return
        conn = self._connections.get(peer_id)
        if conn is None:
            conn = self._accept_new(peer_id)
            if conn is None:
                return
        if not conn._deliver(payload):
            self._dropped += 1  # its connection died of it: logged there

    def _accept_new(self, peer_id: str) -> ZmqConnection | None:
        """An inbound connection for a peer's first frame, or None (frame dropped)."""
        if self._closed:
            return None
        if _peer_address(peer_id) is None:
            self._drop(f"a frame from identity {peer_id[:64]!r}, which is not host:port")
            return None
        if self._allowed is not None and not self._allowed(peer_id):
            # Checked before _open, which dials back: the frame's identity is
            # the sender's claim, and must not pick our outbound connections.
            self._drop(
                f"a frame from {peer_id}, which is not in allowed_peers; add it to "
                "allowed_peers (P2PACTOR_ALLOWED_PEERS) to accept it",
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
        self._dropped += 1
        # A misbehaving peer must not flood the log: the first few, then 1 in 1000.
        if self._dropped <= 10 or self._dropped % 1000 == 0:
            log.warning(
                "%s: dropped %s (%d dropped so far)",
                self._local_id,
                what,
                self._dropped,
                extra=request_context(peer, None, node=self._local_id),
            )


def _apply_heartbeat(sock: zmq.Socket[bytes], options: ZmqOptions) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(options.heartbeat_interval))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(options.heartbeat_timeout))
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(options.heartbeat_ttl))


def _bind_zap(ctx: zmq.Context[zmq.Socket[bytes]]) -> zmq.Socket[bytes]:
    """The socket libzmq sends its ZAP requests to (answered by ``_zap_loop``)."""
    zap = ctx.socket(zmq.ROUTER)
    try:
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(_ZAP_ENDPOINT)
    except zmq.ZMQError as exc:
        zap.close(linger=0)
        raise ZmqTransportError(f"cannot bind the CURVE ZAP handler: {exc}") from exc
    return zap


def _make_curve_server(router: zmq.Socket[bytes], curve: CurveSecurity) -> None:
    router.setsockopt(zmq.CURVE_SERVER, 1)
    router.setsockopt(zmq.CURVE_SECRETKEY, curve.keypair.secret_key.encode("ascii"))
    router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    # libzmq admits every client when no ZAP handler answers (RFC 27). Ours is
    # bound before the ROUTER and closed after it; this option (a draft in
    # libzmq 4.3's header, honoured by its builds: a client is refused when no
    # handler is bound) makes sure a missing handler can only mean "refuse".
    try:
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    except (zmq.ZMQError, AttributeError) as exc:  # older: the handler's lifetime covers us
        log.debug("ZMQ_ZAP_ENFORCE_DOMAIN not supported by this libzmq: %s", exc)


def _bind_router(
    ctx: zmq.Context[zmq.Socket[bytes]],
    host: str,
    port: int,
    options: ZmqOptions,
    curve: CurveSecurity | None = None,
) -> tuple[zmq.Socket[bytes], int, zmq.Socket[bytes] | None]:
    """The bound ROUTER, its port, and (with CURVE) the PAIR its handshake failures reach."""
    router = ctx.socket(zmq.ROUTER)
    monitor: zmq.Socket[bytes] | None = None
    endpoint = f"tcp://{host}:{port or '*'}"
    try:
        _apply_heartbeat(router, options)
        if curve is not None:
            _make_curve_server(router, curve)
            # Watched before it binds, its PAIR connected before any client can
            # come: libzmq must never hold an event with no reader (see _die).
            events = f"inproc://p2pactor-router-monitor-{next(_transport_serials)}"
            router.monitor(events, _ROUTER_MONITOR_MASK)
            monitor = ctx.socket(zmq.PAIR)
            monitor.connect(events)
        router.setsockopt(zmq.LINGER, _ms(options.router_linger))
        # libzmq drops an oversize frame before we read it (and the TCP
        # connection it came on); the decoder's own bound stays as a backstop.
        router.setsockopt(zmq.MAXMSGSIZE, options.max_frame_bytes)
        # A peer that reconnects (restarted, or re-dialing after its old
        # DEALER closed) takes its identity over; without this, libzmq ignores
        # its new connection for good while the old one is still open.
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if host.startswith("["):
            router.setsockopt(zmq.IPV6, 1)
        router.bind(endpoint)
        bound = router.getsockopt(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as exc:
        if monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                router.disable_monitor()
            monitor.close(linger=0)
        router.close(linger=0)
        raise ZmqTransportError(f"cannot bind the control ROUTER on {endpoint}: {exc}") from exc
    assert isinstance(bound, bytes)
    return router, int(bound.decode().rpartition(":")[2]), monitor


def _log_security(transport: ZmqControlTransport, port: int) -> None:
    curve = transport.curve
    if curve is None:
        log.warning(
            "%s: the control channel on port %d is UNAUTHENTICATED and UNENCRYPTED (no CURVE "
            "keys configured): any host that reaches it can connect, read the hash seed and "
            "block keys, and look up and fetch blocks. Configure curve_secret_key and "
            "curve_trusted (docs/security.md) unless every peer is a stock vLLM node on a "
            "network you trust",
            transport.local_id,
            port,
            extra={"node": transport.local_id},
        )
        return
    log.info(
        "%s: control ROUTER bound on port %d, CURVE on (key %s, %d trusted peer ids from %s)",
        transport.local_id,
        port,
        curve.keypair.public_key,
        len(curve.keyring),
        curve.keyring.where(),
        extra={"node": transport.local_id},
    )


@asynccontextmanager
async def open_zmq_transport(
    local_id: str,
    *,
    bind_host: str | None = None,
    port: int,
    options: ZmqOptions | None = None,
    curve: CurveSecurity | None = None,
) -> AsyncIterator[ZmqControlTransport]:
    """Bind the node's ROUTER and run the transport until the block exits.

    On exit every connection and socket is closed (frames still queued on a
    DEALER get ``dealer_linger`` to leave), then the context is terminated in a
    worker thread so a lingering DEALER never blocks trio.

    Args:
        local_id: This node's id, ``host:port``: the identity our DEALERs show
            and the address peers dial back. With ``port=0`` its port must be 0
            too and is replaced by the bound one.
        bind_host: Where to bind the ROUTER (e.g. ``0.0.0.0``); default: the
            host of ``local_id``.
        port: The ROUTER's TCP port; 0 binds an ephemeral one (see
            :attr:`ZmqControlTransport.port`).
        options: Socket options and bounds; vLLM's defaults if None.
        curve: This node's CURVE keys and the peers it trusts (see
            :meth:`CurveSecurity.load <p2pactor.keys.CurveSecurity.load>`):
            authenticate and encrypt every connection, bind each peer to its
            key. None (the default) is vLLM's plain ZeroMQ, which stock vLLM
            peers speak; a warning says the channel is open.

    Raises:
        ValueError: ``local_id`` is not ``host:port`` or does not match ``port``.
        ZmqTransportError: The ROUTER cannot be bound.
    """
    options = options or ZmqOptions()
    host, sep, id_port = local_id.rpartition(":")
    if not sep or not host or not (id_port.isascii() and id_port.isdigit()) or int(id_port) != port:
        raise ValueError(f"local_id must be 'host:{port}', got {local_id!r}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    if options.batch_io_threads and hasattr(os, "SCHED_BATCH"):
        # Before the first socket: libzmq starts its threads with it.
        try:
            ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        except (zmq.ZMQError, AttributeError) as exc:  # a libzmq without it
            log.debug("cannot run the ZeroMQ I/O threads as SCHED_BATCH: %s", exc)
    try:
        # The ZAP handler's socket is bound before the ROUTER and closed after
        # it: a CURVE ROUTER with no handler to ask would let any client in.
        zap = _bind_zap(ctx) if curve is not None else None
        try:
            router, bound_port, router_monitor = _bind_router(
                ctx, bind_host or host, port, options, curve
            )
            try:
                async with trio.open_nursery() as nursery:
                    transport = ZmqControlTransport(
                        ctx,
                        _AsyncSocket(router),
                        local_id=f"{host}:{bound_port}",
                        port=bound_port,
                        options=options,
                        nursery=nursery,
                        curve=curve,
                    )
                    if zap is not None:
                        transport._router.authenticated = True
                        zap_socket = _AsyncSocket(zap)
                        zap_socket.start_watching(nursery, "zmq zap fd")
                        nursery.start_soon(transport._zap_loop, zap_socket, name="zmq zap")
                    if router_monitor is not None:
                        watched = transport._router_monitor = _AsyncSocket(router_monitor)
                        watched.start_watching(nursery, "zmq router monitor fd")
                        nursery.start_soon(
                            transport._router_monitor_loop, watched, name="zmq router monitor"
                        )
                    # No watcher for the ROUTER: its receive task is its only
                    # user and parks on its fd itself (see receive_batch).
                    nursery.start_soon(transport._receive_loop, name="zmq router")
                    _log_security(transport, bound_port)
                    try:
                        yield transport
                    finally:
                        transport._close()
                        nursery.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                # Our tasks never fail on their own: a lone exception is the body's;
                # raise it as itself, not wrapped by our nursery.
                if len(group.exceptions) == 1:
                    raise group.exceptions[0] from None
                raise
            finally:
                # Already closed unless the nursery failed to start.
                if router_monitor is not None and not router_monitor.closed:
                    with contextlib.suppress(zmq.ZMQError):
                        router.disable_monitor()
                    router_monitor.close(linger=0)
                router.close(linger=0)
        finally:
            if zap is not None:
                zap.close(linger=0)  # only now that the ROUTER is closed
    finally:
        with trio.CancelScope(shield=True):
            # Every socket is closed; term() waits for lingering DEALERs (at most
            # dealer_linger), so it must not run on the trio thread.
            await trio.to_thread.run_sync(ctx.term)
