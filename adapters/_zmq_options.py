"""The ZeroMQ transport's options, statistics, error and logger, for all its parts."""

from __future__ import annotations

import logging

import attrs

from p2pactor.core import checks
from p2pactor.core.protocol import DEFAULT_MAX_FRAME_BYTES
from p2pactor.errors import P2PActorError
from p2pactor.runtime.logcontext import request_context

log = logging.getLogger("p2pactor.zmq")

# libzmq takes whole milliseconds: inf has no value there.
_positive = checks.positive(finite=True)
_not_negative = checks.non_negative(finite=True)


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
    send_hwm: int = attrs.field(default=1000, validator=checks.positive_int)
    send_timeout: float = attrs.field(default=1.0, validator=_not_negative)
    dealer_linger: float = attrs.field(default=0.5, validator=_not_negative)
    router_linger: float = attrs.field(default=0.0, validator=_not_negative)
    max_frame_bytes: int = attrs.field(
        default=DEFAULT_MAX_FRAME_BYTES, validator=checks.positive_int
    )
    inbound_queue: int = attrs.field(default=10_000, validator=checks.positive_int)
    inbound_bytes: int = attrs.field(
        default=2 * DEFAULT_MAX_FRAME_BYTES, validator=checks.positive_int
    )
    accept_backlog: int = attrs.field(default=128, validator=checks.positive_int)
    connect_timeout: float = attrs.field(default=10.0, validator=_positive)
    redial_delay: float = attrs.field(default=0.05, validator=_not_negative)
    receive_batch: int = attrs.field(default=64, validator=checks.positive_int)
    receive_slice_s: float = attrs.field(default=0.001, validator=_positive)
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


def note(level: int, node: str, message: str, *args: object, peer: str | None = None) -> None:
    """Log ``node: message`` (``%``-formatted), with ``node`` and ``peer`` as its fields.

    At ``ERROR`` and above, the exception being handled goes with it.
    """
    line = "%s: " + message
    extra = request_context(peer, None, node=node)
    log.log(level, line, node, *args, extra=extra, exc_info=level >= logging.ERROR, stacklevel=2)


def _worth_logging(count: int) -> bool:
    """Whether to log the ``count``-th frame dropped or client refused.

    The first 10, then 1 in 1000: a misbehaving peer must not flood the log.
    """
    return count <= 10 or count % 1000 == 0
