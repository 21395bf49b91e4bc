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

How trio and libzmq meet:

* Every socket is used on the trio thread only, and waited on as
  ``_zmq_socket`` says: its fd alone never tells whether it is ready.
* Sockets that are waited on: the ROUTER (one receive task that hands each
  frame, as it is read, to the session attached to its connection, which steps
  it right there), each DEALER's monitor socket (one task per connection), and
  a DEALER only once its queue is full (``SNDHWM``): its watcher starts then,
  and senders wait for room at most ``send_timeout``.
* A frame read from the ROUTER is handled before the task next checkpoints, so
  cancellation never loses one. Each connection keeps the frames read and not
  yet handled in one bounded queue: for its session's turn, or, before a session
  attaches, for :meth:`ZmqConnection.receive`.

How a connection dies (never silently), with a reason in :class:`ConnectionLost`:

* the DEALER's monitor reports ``DISCONNECTED`` (the peer closed the connection or
  its process died, or no heartbeat came for ``heartbeat_timeout``), ``CLOSED``
  (refused, or closed before the ZeroMQ handshake) or ``HANDSHAKE_FAILED_*``;
* no ZeroMQ handshake within ``connect_timeout`` of dialing. Without this
  deadline an unreachable peer never "disconnects" in ZeroMQ: libzmq retries
  forever; vLLM leaves it to its 30 s handshake timeout, which still backs this up
  for a peer that speaks ZMTP but never answers ``connect``;
* the peer reads too little (``send_timeout``) or sends too much
  (``inbound_queue``, ``inbound_bytes``): see :class:`ZmqOptions`;
* :meth:`ZmqConnection.aclose`, or the transport closing.

A dead connection leaves the transport's table at once: the peer's next frame
(say, after it restarted) opens a fresh inbound connection and never lands in the
dead one (vLLM #49809), and :meth:`ZmqControlTransport.connect` dials afresh.
Frames that arrived before the death are still received from the dead connection,
then :class:`ConnectionLost`.

Detection times measured on 127.0.0.1 (heartbeat 0.2 s, timeout 1 s): a peer
process killed with SIGKILL is seen dead in ~2 ms (its OS closes the socket); a
stopped one (SIGSTOP) in ~1.2 s (heartbeat timeout plus an interval).

Security (``docs/security.md``). Without ``curve`` the channel is vLLM's: no
authentication, no encryption, and the ROUTER believes the identity a DEALER
claims; the transport says so in a warning when it opens. With ``curve`` (a
:class:`~p2pactor.runtime.keys.CurveSecurity`) every connection is ZeroMQ CURVE,
encrypted and authenticated both ways, and a frame counts only if the keyring
binds its claimed identity to the key that sent it (``_zmq_curve``).

The parts, each importing only those above it: ``_zmq_socket`` (options,
statistics, error; a socket waited on from trio, its monitor, and how sockets
are made), ``_zmq_curve`` (CURVE keys, socket options, the ZAP handler, the
ROUTER's refusals), ``_zmq_connection`` (:class:`ZmqConnection`, which dials its
DEALER and says why it died), ``_zmq_router`` (:class:`ZmqControlTransport`,
which binds the ROUTER); this module opens the transport.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import trio
import zmq

from p2pactor.adapters._zmq_connection import ZmqConnection
from p2pactor.adapters._zmq_curve import check_keypair, generate_keypair
from p2pactor.adapters._zmq_router import ZmqControlTransport
from p2pactor.adapters._zmq_socket import (
    ZmqOptions,
    ZmqStatistics,
    ZmqTransportError,
    log,
)
from p2pactor.runtime.addresses import node_id_port, peer_host
from p2pactor.runtime.keys import CurveSecurity

__all__ = [
    "ZmqConnection",
    "ZmqControlTransport",
    "ZmqOptions",
    "ZmqStatistics",
    "ZmqTransportError",
    "generate_keypair",
    "open_zmq_transport",
]


@contextlib.asynccontextmanager
async def open_zmq_transport(
    local_id: str,
    *,
    bind_host: str | None = None,
    port: int,
    options: ZmqOptions | None = None,
    curve: CurveSecurity | None = None,
) -> AsyncIterator[ZmqControlTransport]:
    """Bind the node's ROUTER and run the transport until the block exits.

    On exit every connection and socket is closed, then the context is
    terminated in a worker thread so a lingering DEALER never blocks trio.

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
            :meth:`CurveSecurity.load <p2pactor.runtime.keys.CurveSecurity.load>`):
            authenticate and encrypt every connection, bind each peer to its
            key. None (the default) is vLLM's plain ZeroMQ, which stock vLLM
            peers speak; a warning says the channel is open.

    Raises:
        ConfigError: ``curve``'s public key does not belong to its secret key.
        ValueError: ``local_id`` is not ``host:port`` or does not match ``port``.
        ZmqTransportError: The ROUTER cannot be bound.
    """
    if curve is not None:
        check_keypair(curve.keypair)  # before anything is bound
    options = options or ZmqOptions()
    host = peer_host(local_id)
    if node_id_port(local_id) != port:
        raise ValueError(f"local_id must be 'host:{port}', got {local_id!r}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    if options.batch_io_threads and hasattr(os, "SCHED_BATCH"):
        # Before the first socket: libzmq starts its threads with it.
        try:
            ctx.set(zmq.THREAD_SCHED_POLICY, os.SCHED_BATCH)
        except (zmq.ZMQError, AttributeError) as exc:  # a libzmq without it
            log.debug("cannot run the ZeroMQ I/O threads as SCHED_BATCH: %s", exc)
    try:
        endpoint = f"tcp://{bind_host or host}:{port or '*'}"
        transport = ZmqControlTransport(ctx, endpoint, host, options, curve)
        try:
            async with trio.open_nursery() as nursery:
                transport._start(nursery, bind_host)
                try:
                    yield transport
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # Our tasks never fail on their own: a lone exception is the body's;
            # raise it as itself, not wrapped by our nursery.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
        finally:
            transport._close()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(ctx.term)
