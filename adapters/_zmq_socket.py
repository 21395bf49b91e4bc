"""The ZeroMQ transport's base: options, statistics, error, logger, and sockets waited on from trio.

A socket is waited on as ``shared/reference/trio-stack.md`` section 1 says.
``zmq.FD`` is edge-triggered relative to the socket's state: it signals that
libzmq has internal commands to process, not that a message is there, and any
zmq call on the socket may consume the edge. ``zmq.EVENTS`` is the only truth.
So every operation first tries ``NOBLOCK``, and only then waits. A socket
with one user (the ROUTER, a monitor, the ZAP handler) is waited on by that
task alone, on the fd, right after it read ``EVENTS``. Where several tasks
wait (senders on a full DEALER) they park on a :class:`trio.Event`, never on
the fd: one *watcher* task parks on the fd, drains it by reading ``EVENTS``
and wakes them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterable
from functools import partial
from typing import Final, cast

import attrs
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from p2pactor.core import checks
from p2pactor.core.protocol import DEFAULT_MAX_FRAME_BYTES
from p2pactor.errors import P2PActorError
from p2pactor.runtime import logcontext

log = logging.getLogger("p2pactor.zmq")

# libzmq takes whole milliseconds: inf has no value there.
_positive = checks.positive(finite=True)
_not_negative = checks.non_negative(finite=True)
_int = checks.positive_int


class ZmqTransportError(P2PActorError):
    """The ZeroMQ transport itself failed (it cannot bind, or its ROUTER broke)."""


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
        inbound_bytes: Bytes of one peer's frames received and not yet
            handled (by its session, or by ``receive`` before a session
            attaches); past it the peer counts as flooding us and the
            connection dies. A frame arriving when none waits always fits.
            Twice the largest frame (32 MiB): an honest peer's backlog is its
            frames of one burst, which the node handles as they come.
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
        receive_batch: Frames the ROUTER task reads in one round, before it
            hands them on and yields to others.
        receive_slice_s: Seconds of handling frames after which the ROUTER
            task yields to others, however few it read: frames that take
            long to handle (a peer's large messages, or many with work each)
            hold the node's other tasks up for about this long at most.
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
    send_hwm: int = attrs.field(default=1000, validator=_int)
    send_timeout: float = attrs.field(default=1.0, validator=_not_negative)
    dealer_linger: float = attrs.field(default=0.5, validator=_not_negative)
    router_linger: float = attrs.field(default=0.0, validator=_not_negative)
    max_frame_bytes: int = attrs.field(default=DEFAULT_MAX_FRAME_BYTES, validator=_int)
    inbound_queue: int = attrs.field(default=10_000, validator=_int)
    inbound_bytes: int = attrs.field(default=2 * DEFAULT_MAX_FRAME_BYTES, validator=_int)
    accept_backlog: int = attrs.field(default=128, validator=_int)
    connect_timeout: float = attrs.field(default=10.0, validator=_positive)
    redial_delay: float = attrs.field(default=0.05, validator=_not_negative)
    receive_batch: int = attrs.field(default=64, validator=_int)
    receive_slice_s: float = attrs.field(default=0.001, validator=_positive)
    batch_io_threads: bool = True


@attrs.define
class Counts:
    """The counters of :class:`ZmqStatistics` a transport keeps up to date as it runs."""

    frames_received: int = 0
    frames_dropped: int = 0
    connections_opened: int = 0
    connections_died: int = 0
    auth_refused: int = 0


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


note: Final = partial(logcontext.note, log, who_is_node=True)
"""Log ``node: message`` (``%``-formatted), with ``node`` and ``peer`` as its fields."""


def note_count(node: str, done: str, what: str, count: int, *, peer: str | None = None) -> None:
    """Warn that ``what`` was ``done`` (``dropped``, ``refused``), the ``count``-th so far.

    The first 10, then 1 in 1000: a misbehaving peer must not flood the log.
    """
    if count <= 10 or count % 1000 == 0:
        note(logging.WARNING, node, f"{done} %s (%d {done} so far)", what, count, peer=peer)


COPY_BELOW: Final = 64 * 1024
"""Frames shorter than this are copied out of libzmq as bytes. A longer one is
handed on as a view of libzmq's own buffer: a large frame (up to
``max_frame_bytes``) then costs its size once, not twice, and no copy of the
node thread's time. A view costs a small frame more than the copy (about 1 us)."""


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _events(sock: zmq.Socket[bytes]) -> int:
    """``zmq.EVENTS``: ``POLLIN`` / ``POLLOUT``."""
    return cast("int", sock.getsockopt(zmq.EVENTS))


# A monitor endpoint unique per socket: libzmq releases an inproc name on its
# reaper thread after close() returned, so reusing one (pyzmq's default names
# it after the socket's fd) fails with EADDRINUSE.
_monitor_serials = itertools.count(1)


class _AsyncSocket:
    """A zmq socket waited on from trio, for ``flag`` (``POLLIN`` or ``POLLOUT``).

    With a watcher (:meth:`start_watching`) any number of tasks wait at once,
    none ever woken by cancellation; without one, its one user parks on the fd itself.
    """

    def __init__(self, sock: zmq.Socket[bytes], flag: int = zmq.POLLIN) -> None:
        self.sock = sock
        self._fd: int = sock.FD
        self._flag = flag
        self._changed = trio.Event()
        self._waiting = 0  # tasks parked on _changed
        self.closed = False
        self.watched = False  # its watcher task was started

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
                # and may make the socket ready.
                self._wake_for(_events(self.sock))
        except trio.ClosedResourceError:
            return  # notify_closing: the socket is being closed

    def _is_closed(self) -> bool:
        # A method, not the attribute: the type checker would assume that an
        # attribute it has just checked cannot change across an await.
        return self.closed

    def after_operation(self) -> None:
        """Wake waiters whose condition this task's zmq call may have satisfied.

        The call may have consumed the fd edge their watcher was parked on, so
        the watcher may never see it: look at EVENTS ourselves.
        """
        if self._waiting:  # nobody waits: the hot path pays nothing
            self._wake_for(_events(self.sock))

    def _wake_for(self, events: int) -> None:
        if self._waiting and events & self._flag:
            self._changed.set()
            self._changed = trio.Event()

    async def wait(self) -> None:
        """Wait until ``zmq.EVENTS`` has the socket's flag.

        Raises:
            trio.ClosedResourceError: The socket closed.
        """
        while True:
            if self.closed:
                raise trio.ClosedResourceError("the socket is closed")
            # Re-read EVENTS right before parking: a message queued before we
            # came gives no new edge. Reading it may consume an edge others parked for.
            events = _events(self.sock)
            self._wake_for(events)
            if events & self._flag:
                return
            if not self.watched:  # its one user: EVENTS was just read, no edge lost
                await trio.lowlevel.wait_readable(self._fd)
                continue
            changed = self._changed
            self._waiting += 1
            try:
                await changed.wait()
            finally:
                self._waiting -= 1

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
            with contextlib.suppress(zmq.Again):
                while len(batch) < limit:
                    batch.append(self.sock.recv_multipart(zmq.NOBLOCK))
            if batch:
                self.after_operation()
                # From here on we own the messages: no cancellation may lose them.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            await self.wait()

    def close(self, linger: float) -> None:
        """Close the socket, waking every task parked on it first. Idempotent.

        ``notify_closing`` wakes a task parked on the fd, which would otherwise
        sleep on an fd number the OS may reuse.
        """
        if not self.closed:
            self.closed = True
            trio.lowlevel.notify_closing(self._fd)
            self._changed.set()
            self.sock.close(linger=_ms(linger))


class _Monitor(_AsyncSocket):
    """A socket's monitor: the events ``mask`` selects, on a PAIR of ours.

    libzmq's I/O thread sends monitor events *blocking*: one with no reader on
    the PAIR blocks that thread for good, and every socket of the context
    freezes. So the PAIR connects before the socket binds or dials (make this
    first), and :meth:`close` stops the events before it closes the PAIR (say,
    a closed DEALER that reconnects while it lingers still emits them).
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], mask: int):
        super().__init__(ctx.socket(zmq.PAIR))
        self._source = sock
        endpoint = f"inproc://p2pactor-monitor-{next(_monitor_serials)}"
        try:
            sock.monitor(endpoint, mask)
            self.sock.connect(endpoint)
        except zmq.ZMQError:
            self.close()  # an open PAIR would keep ctx.term() waiting
            raise

    async def receive(self) -> list[tuple[int, int]]:
        """The next events, 1 to 16 of them, as ``(event, value)``; a checkpoint.

        Raises:
            trio.ClosedResourceError: The monitor closed.
        """
        messages = map(parse_monitor_message, await self.receive_batch(16))
        return [(message["event"], message["value"]) for message in messages]

    def close(self, linger: float = 0.0) -> None:
        """Stop the events, then close the PAIR, waking its reader. Idempotent."""
        if not self.closed:
            with contextlib.suppress(zmq.ZMQError):
                self._source.disable_monitor()
        super().close(linger)


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    address: str,
    options: ZmqOptions,
    settings: Iterable[tuple[int, int | bytes]],
    *,
    mask: int,
) -> tuple[zmq.Socket[bytes], _Monitor | None]:
    """A socket of ``kind`` bound (a ROUTER) or dialed to ``address``, with its monitor.

    It gets the transport's heartbeat, its kind's linger and ``settings``; with a
    ``mask``, a :class:`_Monitor` of those events, made before it binds or dials.

    Raises:
        zmq.ZMQError: libzmq refused; nothing is left open.
    """
    sock = ctx.socket(kind)
    monitor: _Monitor | None = None
    linger = options.router_linger if kind == zmq.ROUTER else options.dealer_linger
    try:
        for option, value in (
            (zmq.HEARTBEAT_IVL, _ms(options.heartbeat_interval)),
            (zmq.HEARTBEAT_TIMEOUT, _ms(options.heartbeat_timeout)),
            (zmq.HEARTBEAT_TTL, _ms(options.heartbeat_ttl)),
            (zmq.LINGER, _ms(linger)),
            (zmq.IPV6, int(address.startswith("tcp://["))),
            *settings,
        ):
            sock.setsockopt(option, value)
        if mask:
            monitor = _Monitor(ctx, sock, mask)
        if kind == zmq.ROUTER:
            sock.bind(address)
        else:
            sock.connect(address)
    except zmq.ZMQError:
        if monitor is not None:
            monitor.close()
        sock.close(linger=0)
        raise
    return sock, monitor
