"""CURVE on the control transport: key pairs, socket keys, the ZAP handler, refused clients.

What the transport counts and logs as refused goes to the ``refuse`` it passes.

Making a key pair and checking one take libzmq, so they live here, not in
:mod:`p2pactor.runtime.keys` (which reads and writes the files and imports no pyzmq).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import trio
import zmq
from zmq.utils import z85

from p2pactor.adapters._zmq_socket import ZmqTransportError, _AsyncSocket, _Monitor
from p2pactor.errors import ConfigError
from p2pactor.runtime.keys import KEYGEN_HINT, CurveKeypair, CurveSecurity, Keyring, write_keypair
from p2pactor.runtime.transport import ConnectionLost

ZAP_DOMAIN: bytes = b"p2pactor"
"""The ZAP domain of a CURVE ROUTER: our handler answers for it only."""
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP spec (RFC 27)
_ZAP_REQUEST_FRAMES = 8  # routing id, delimiter, version, id, domain, address, identity, mechanism
_ZAP_VERSION = b"1.0"
# What a CURVE ROUTER turns away before ZAP is asked (see report_refusals).
_ROUTER_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
Refuse = Callable[[str], None]
"""Where the CURVE parts report a client turned away (the transport counts and logs it)."""


def generate_keypair(
    path_stem: str | os.PathLike[str],
    address: str | Iterable[str],
    *,
    force: bool = False,
) -> tuple[Path, Path]:
    """Make a new key pair and write ``<stem>.key`` and ``<stem>.key_secret``.

    Args:
        path_stem: The files' path without suffix (``/etc/p2pactor/runtime/node-a``).
        address: The node id(s) the key speaks for: ``host:port``, several
            comma-separated (or a collection) when one key serves several nodes.
        force: Replace existing files; otherwise refuse to touch them.

    Returns:
        The public and the secret file's paths.

    Raises:
        ConfigError: A file exists (and not ``force``), an address is not
            ``host:port``, or the files cannot be written.
    """
    public, secret = zmq.curve_keypair()
    return write_keypair(path_stem, address, public.decode(), secret.decode(), force=force)


def check_keypair(keypair: CurveKeypair) -> None:
    """Refuse a key pair whose public key is not the one of its secret key.

    Raises:
        ConfigError: The pair does not match: its file was edited or damaged.
    """
    try:
        public = zmq.curve_public(keypair.secret_key.encode("ascii")).decode("ascii")
    except (zmq.ZMQError, ValueError):
        public = None
    if public != keypair.public_key:
        where = keypair.path or "this node's CURVE key pair"
        raise ConfigError(
            f"{where}: its public-key does not belong to its secret-key (the file was edited "
            f"or damaged); make a new key pair with `{KEYGEN_HINT}`"
        )


def curve_client(curve: CurveSecurity | None, peer_id: str) -> list[tuple[int, int | bytes]]:
    """The options of a DEALER that accepts only the key we trust for ``peer_id`` (none: []).

    Raises:
        ConnectionLost: No key is trusted for ``peer_id``. Never dial without
            knowing whom to expect: CURVE would refuse anyway, and an
            untrusted address is no one we should reach.
    """
    if curve is None:
        return []
    if (server_key := curve.keyring.key_for(peer_id)) is None:
        raise ConnectionLost(
            f"cannot dial {peer_id}: no trusted CURVE key for it; put its public "
            f".key file (made on that node by `p2pactor keygen STEM --address "
            f"{peer_id}`) in {curve.keyring.where()} and restart this node"
        )
    return [
        (zmq.CURVE_SERVERKEY, server_key.encode("ascii")),
        (zmq.CURVE_PUBLICKEY, curve.keypair.public_key.encode("ascii")),
        (zmq.CURVE_SECRETKEY, curve.keypair.secret_key.encode("ascii")),
    ]


def curve_server(
    ctx: zmq.Context[zmq.Socket[bytes]], curve: CurveSecurity | None
) -> tuple[_AsyncSocket | None, list[tuple[int, int | bytes]], int]:
    """What a ROUTER needs to admit only the CURVE clients we trust: ZAP, options, monitor mask.

    The ZAP handler's socket is bound here, before the ROUTER (close it after
    the ROUTER: libzmq lets every client in when no ZAP handler answers).
    None of it without CURVE.

    Raises:
        ZmqTransportError: The ZAP handler cannot be bound.
    """
    if curve is None:
        return None, [], 0
    settings: list[tuple[int, int | bytes]] = [
        (zmq.CURVE_SERVER, 1),
        (zmq.CURVE_SECRETKEY, curve.keypair.secret_key.encode("ascii")),
        (zmq.ZAP_DOMAIN, ZAP_DOMAIN),
    ]
    if zmq.zmq_version_info() >= (4, 3):
        # A client is refused when no handler is bound, so a missing handler
        # can only mean "refuse". (Before 4.3 the handler's lifetime covers us.)
        settings.append((zmq.ZAP_ENFORCE_DOMAIN, 1))
    zap = ctx.socket(zmq.ROUTER)
    try:
        zap.setsockopt(zmq.LINGER, 0)
        zap.bind(_ZAP_ENDPOINT)
    except zmq.ZMQError as exc:
        zap.close(linger=0)
        raise ZmqTransportError(f"cannot bind the CURVE ZAP handler: {exc}") from exc
    return _AsyncSocket(zap), settings, _ROUTER_EVENTS


def impostor(keyring: Keyring, identity: bytes, frame: zmq.Frame) -> str | None:
    """What is wrong if ``frame``'s sender's User-Id is not the identity's key.

    The User-Id ZAP gave the connection the frame came on (which only a
    zero-copy receive exposes) is the sender's public key, which our ZAP
    handler vouched for. The identity (``host:port``) is only what the
    sender claims: a frame whose identity the keyring binds to another key
    (or to none) must be dropped, before it can open a connection or a dial-back.
    """
    try:
        user_id = str(frame.get("User-Id"))
    except zmq.ZMQError:  # no ZAP handler answered for that connection
        user_id = ""
    if user_id and keyring.key_for(identity.decode("utf-8", "replace")) == user_id:
        return None
    owner = ", ".join(sorted(keyring.addresses_of(user_id))) or "no trusted peer"
    return (
        f"a frame claiming to come from {identity[:64]!r} but sent with the CURVE "
        f"key of {owner}: a trusted peer posing as another, or a .key file whose "
        "address is not its node's id"
    )


async def answer_zap(zap: _AsyncSocket, keyring: Keyring, refuse: Refuse) -> None:
    """Answer libzmq's ZAP requests: admit the CURVE clients whose key we trust.

    Raises:
        ZmqTransportError: The handler's socket failed: no client could be
            admitted any more, so the transport fails rather than hang
            every handshake.
    """
    with contextlib.suppress(trio.ClosedResourceError):  # the transport closed it
        while True:
            try:
                batch = await zap.receive_batch(16)
            except zmq.ZMQError as exc:
                raise ZmqTransportError(f"the CURVE ZAP handler failed: {exc}") from exc
            for request in batch:
                reply = _zap_answer(request, keyring, refuse)
                # Room is never short on inproc for one small reply; if
                # libzmq refuses it, that handshake simply does not finish.
                with contextlib.suppress(zmq.ZMQError):
                    if reply is not None:
                        zap.sock.send_multipart(reply, zmq.NOBLOCK)


def _zap_answer(request: list[bytes], keyring: Keyring, refuse: Refuse) -> list[bytes] | None:
    """The reply to one ZAP request (RFC 27), or None for something that is not one."""
    if len(request) < _ZAP_REQUEST_FRAMES:
        return None  # libzmq never sends this; there is no request id to answer
    routing_id, _, version, request_id, domain, address, _, mechanism, *credentials = request
    head = [routing_id, b"", _ZAP_VERSION, request_id]
    if version != _ZAP_VERSION:
        return [*head, b"500", b"unsupported ZAP version", b"", b""]
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
    refuse(f"a CURVE client at {address.decode('ascii', 'replace')}: {why}")
    return [*head, b"400", b"key not trusted", b"", b""]


async def report_refusals(monitor: _Monitor, refuse: Refuse) -> None:
    """Report the clients a CURVE ROUTER turned away before ZAP was asked (its monitor's events).

    A client without CURVE (a stock vLLM peer, a p2pactor node without
    keys, a scanner) fails the ZMTP handshake on the mechanism; libzmq
    reports it on the ROUTER only, with our own endpoint, not the client's.
    """
    # Until the transport closes the monitor (or its ROUTER).
    with contextlib.suppress(trio.ClosedResourceError, zmq.ZMQError):
        while True:
            for event, value in await monitor.receive():
                if event != zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                    why = (
                        "the handshake broke off (a client without CURVE keys, one that "
                        "went away, or not a ZeroMQ peer)"
                    )
                elif value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                    why = (
                        "it came without CURVE keys (a stock vLLM peer, a p2pactor node "
                        "without keys, or not a peer at all); this node talks only to "
                        "peers with trusted CURVE keys"
                    )
                else:
                    why = f"it broke the ZeroMQ protocol (error {value:#x})"
                refuse(f"a client: {why}")
