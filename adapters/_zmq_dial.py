"""The sockets of the control endpoint made: the ROUTER bound, a DEALER dialed."""

from __future__ import annotations

import itertools

import zmq

from p2pactor.adapters._zmq_connection import _MONITOR_MASK
from p2pactor.adapters._zmq_curve import _ROUTER_MONITOR_MASK, _make_curve_server
from p2pactor.adapters._zmq_options import ZmqOptions, ZmqTransportError
from p2pactor.adapters._zmq_socket import _Monitor, _ms
from p2pactor.runtime.keys import CurveSecurity

_transport_serials = itertools.count(1)


def _peer_address(peer_id: str) -> str | None:
    """``tcp://host:port`` for a peer id, or None if it is not ``host:port``."""
    host, sep, port = peer_id.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) <= 65535:
        return None
    if any(c.isspace() or c in "/;" for c in host):
        return None
    return f"tcp://{host}:{port}"


def dial(
    ctx: zmq.Context[zmq.Socket[bytes]],
    local_id: str,
    address: str,
    opts: ZmqOptions,
    *,
    curve_options: list[tuple[int, bytes]],
    endpoint: str,
) -> tuple[zmq.Socket[bytes], _Monitor]:
    """A DEALER (identity ``local_id``) dialing ``address``, and its monitor on ``endpoint``.

    Raises:
        zmq.ZMQError: libzmq refused; nothing is left open.
    """
    dealer = ctx.socket(zmq.DEALER)
    monitor: _Monitor | None = None
    try:
        _apply_heartbeat(dealer, opts)
        dealer.setsockopt(zmq.IDENTITY, local_id.encode())
        dealer.setsockopt(zmq.SNDHWM, opts.send_hwm)
        dealer.setsockopt(zmq.LINGER, _ms(opts.dealer_linger))
        if address.startswith("tcp://["):
            dealer.setsockopt(zmq.IPV6, 1)
        for option, value in curve_options:
            dealer.setsockopt(option, value)
        # ZMQ_IMMEDIATE stays 0 (vLLM): frames queue before the connection
        # completes, so the `connect` sent right away fits.
        monitor = _Monitor(ctx, dealer, endpoint, _MONITOR_MASK)
        dealer.connect(address)
    except zmq.ZMQError:
        if monitor is not None:
            monitor.close()
        dealer.close(linger=0)
        raise
    return dealer, monitor


def _apply_heartbeat(sock: zmq.Socket[bytes], options: ZmqOptions) -> None:
    sock.setsockopt(zmq.HEARTBEAT_IVL, _ms(options.heartbeat_interval))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _ms(options.heartbeat_timeout))
    sock.setsockopt(zmq.HEARTBEAT_TTL, _ms(options.heartbeat_ttl))


def _bind_router(
    ctx: zmq.Context[zmq.Socket[bytes]],
    host: str,
    port: int,
    options: ZmqOptions,
    curve: CurveSecurity | None = None,
) -> tuple[zmq.Socket[bytes], int, _Monitor | None]:
    """The bound ROUTER, its port, and (with CURVE) the monitor of its failed handshakes."""
    router = ctx.socket(zmq.ROUTER)
    monitor: _Monitor | None = None
    endpoint = f"tcp://{host}:{port or '*'}"
    try:
        _apply_heartbeat(router, options)
        if curve is not None:
            _make_curve_server(router, curve)
            events = f"inproc://p2pactor-router-monitor-{next(_transport_serials)}"
            monitor = _Monitor(ctx, router, events, _ROUTER_MONITOR_MASK)
        router.setsockopt(zmq.LINGER, _ms(options.router_linger))
        # See ZmqOptions.max_frame_bytes; the decoder's own bound stays as a backstop.
        router.setsockopt(zmq.MAXMSGSIZE, options.max_frame_bytes)
        # A peer that reconnects takes its identity over (see ZmqOptions.redial_delay).
        router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if host.startswith("["):
            router.setsockopt(zmq.IPV6, 1)
        router.bind(endpoint)
        bound = router.getsockopt(zmq.LAST_ENDPOINT)
    except zmq.ZMQError as exc:
        if monitor is not None:
            monitor.close()
        router.close(linger=0)
        raise ZmqTransportError(f"cannot bind the control ROUTER on {endpoint}: {exc}") from exc
    assert isinstance(bound, bytes)
    return router, int(bound.decode().rpartition(":")[2]), monitor
