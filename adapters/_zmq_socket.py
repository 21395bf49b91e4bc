"""A zmq socket waited on from trio (``shared/reference/trio-stack.md`` section 1), and made.

``zmq.FD`` is edge-triggered relative to the socket's state: it signals that
libzmq has internal commands to process, not that a message is there, and any
zmq call on the socket may consume the edge. ``zmq.EVENTS`` is the only truth.
So every operation first tries ``NOBLOCK``, and a task that must wait parks on
a :class:`trio.Event`, never on the fd: exactly one *watcher* task per
waited-on socket parks on the fd, drains it by reading ``EVENTS`` and wakes the
waiters.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable
from typing import Final, cast

import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from p2pactor.adapters._zmq_options import ZmqOptions
from p2pactor.core.protocol import Frame

COPY_BELOW: Final = 64 * 1024
"""Frames shorter than this are copied out of libzmq as bytes. A longer one is
handed on as a view of libzmq's own buffer: a large frame (up to
``max_frame_bytes``) then costs its size once, not twice, and no copy of the
node thread's time. A view costs a small frame more than the copy (about 1 us)."""


def _take(frame: zmq.Frame) -> Frame:
    return frame.bytes if len(frame) < COPY_BELOW else frame.buffer


def _ms(seconds: float) -> int:
    return round(seconds * 1000)


def _events(sock: zmq.Socket[bytes]) -> int:
    """``zmq.EVENTS``: ``POLLIN`` / ``POLLOUT``."""
    return cast("int", sock.getsockopt(zmq.EVENTS))


class _AsyncSocket:
    """A zmq socket any number of tasks wait on (none is ever woken by cancellation).

    Its watcher, if it needs one, starts with :meth:`start_watching`.
    """

    def __init__(self, sock: zmq.Socket[bytes]) -> None:
        self.sock = sock
        self._fd: int = sock.FD
        self._changed = trio.Event()
        self._wanted: dict[int, int] = {}  # flag -> tasks waiting for it
        self.closed = False
        self.watched = False  # its watcher task was started
        # A CURVE ROUTER: each message comes with its sender's User-Id (see
        # recv_routed).
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
            # came gives no new edge.
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
            while len(batch) < limit:
                try:
                    batch.append(self.sock.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
            if batch:
                self.after_operation()
                # From here on we own the messages: no cancellation may lose them.
                await trio.lowlevel.cancel_shielded_checkpoint()
                return batch
            await self.wait(zmq.POLLIN)

    def recv_routed(self, flags: int) -> tuple[bytes, list[Frame]]:
        """A ROUTER's message: its sender's identity, and its other frames.

        Large frames are views, not copies (:data:`COPY_BELOW`). On a CURVE
        ROUTER (``authenticated``) the User-Id ZAP gave the sender ("" if none)
        is appended to the frames: it is a property of the connection the
        message came on, which only a zero-copy receive exposes.

        Raises:
            zmq.Again: No message waits (with ``zmq.NOBLOCK``).
        """
        frames = self.sock.recv_multipart(flags, copy=False)
        parts = [_take(frame) for frame in frames[1:]]
        if self.authenticated:
            try:
                user_id = frames[-1].get("User-Id")
            except zmq.ZMQError:  # no ZAP handler answered for that connection
                user_id = ""
            parts.append(str(user_id).encode())
        return frames[0].bytes, parts

    def close(self, linger: float) -> None:
        """Close the socket, waking every task parked on it first. Idempotent.

        ``notify_closing`` wakes a task parked on the fd, which would otherwise
        sleep on an fd number the OS may reuse.
        """
        if self.closed:
            return
        self.closed = True
        trio.lowlevel.notify_closing(self._fd)
        self._changed.set()
        self.sock.close(linger=_ms(linger))


class _Monitor:
    """A socket's monitor: the events ``mask`` selects, on a PAIR of ours (:attr:`events`).

    libzmq's I/O thread sends monitor events *blocking*: one with no reader on
    the PAIR blocks that thread for good, and every socket of the context
    freezes. So the PAIR connects before the socket binds or dials (make this
    first), and :meth:`close` stops the events before it closes the PAIR (say,
    a closed DEALER that reconnects while it lingers still emits them).
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        sock: zmq.Socket[bytes],
        endpoint: str,
        mask: int,
    ) -> None:
        self._sock = sock
        self.events = _AsyncSocket(ctx.socket(zmq.PAIR))
        try:
            sock.monitor(endpoint, mask)
            self.events.sock.connect(endpoint)
        except zmq.ZMQError:
            self.close()
            raise

    async def receive(self) -> list[tuple[int, int]]:
        """The next events, 1 to 16 of them, as ``(event, value)``; a checkpoint.

        Raises:
            trio.ClosedResourceError: The monitor closed.
        """
        messages = map(parse_monitor_message, await self.events.receive_batch(16))
        return [(message["event"], message["value"]) for message in messages]

    def close(self) -> None:
        """Stop the events, then close the PAIR, waking its reader. Idempotent."""
        if self.events.closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self.events.close(0)


# A monitor endpoint unique per socket: libzmq releases an inproc name on its
# reaper thread after close() returned, so reusing one fails with EADDRINUSE.
_monitor_serials = itertools.count(1)


def make_socket(
    ctx: zmq.Context[zmq.Socket[bytes]],
    kind: int,
    address: str,
    options: ZmqOptions,
    *,
    linger: float,
    settings: Iterable[tuple[int, int | bytes]] = (),
    monitor_mask: int = 0,
) -> tuple[zmq.Socket[bytes], _Monitor | None]:
    """A socket of ``kind`` bound (a ROUTER) or dialed to ``address``, with its monitor.

    It gets the transport's heartbeat, ``linger`` and ``settings``; with a
    ``monitor_mask``, a :class:`_Monitor` of those events, made before it binds or dials.

    Raises:
        zmq.ZMQError: libzmq refused; nothing is left open.
    """
    sock = ctx.socket(kind)
    monitor: _Monitor | None = None
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
        if monitor_mask:
            endpoint = f"inproc://p2pactor-monitor-{next(_monitor_serials)}"
            monitor = _Monitor(ctx, sock, endpoint, monitor_mask)
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
