"""CURVE on the control channel: key files, authentication, identity binding, secrecy.

Rules of this module:

* Real sockets on loopback, real ZeroMQ CURVE, real NIXL where blocks move, and
  a real ``p2pactor serve`` process for the end-to-end tests; nothing mocked.
* A CURVE key speaks for a fixed ``host:port``, so nodes here bind ports
  picked up front (:func:`free_port`), not port 0.
* Trio's real clock; every wait is bounded with ``trio.fail_after``, generously
  (the machine is small and shared).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import attrs
import pytest
import trio
import zmq

from p2pactor.adapters.zmq import (
    ZmqControlTransport,
    ZmqOptions,
    generate_keypair,
    open_zmq_transport,
)
from p2pactor.core import protocol as wire
from p2pactor.core.inputs import LookupResult
from p2pactor.errors import ConfigError
from p2pactor.programs.cli import main
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.keys import (
    CurveSecurity,
    Keyring,
    load_keyring,
    load_public,
    load_secret,
)
from p2pactor.runtime.node import Node, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.runtime.samples import block_bytes, preload_keys
from p2pactor.testing import MemoryDataPlane
from tests.ports import free_port

HOST = "127.0.0.1"
TIMEOUT = 60.0  # generous: a small shared machine; every wait ends as soon as it can
FAST = ZmqOptions(
    heartbeat_interval=0.2, heartbeat_timeout=2.0, heartbeat_ttl=2.0, connect_timeout=5.0
)
BLOCK_LEN = 4096
NUM_BLOCKS = 16
SEED = "curve-test-seed-7d1e3b"  # a hash seed this module can look for in raw bytes


def keypair(folder: Path, name: str, address: str) -> Path:
    """Make ``folder/name.key`` and ``.key_secret``; the secret's path."""
    folder.mkdir(parents=True, exist_ok=True)
    _, secret = generate_keypair(folder / name, address)
    return secret


def messages(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


async def until(condition: Callable[[], object], interval: float = 0.01) -> None:
    while not condition():  # noqa: ASYNC110 -- libzmq's threads change it; nothing to wait on
        await trio.sleep(interval)


# --- key files ------------------------------------------------------------------------


def test_keygen_writes_a_public_and_a_private_file_and_says_what_to_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stem = tmp_path / "node-a"
    assert (
        main(["keygen", str(stem), "--address", "10.0.0.5:5710", "--address", "10.0.0.5:5711"]) == 0
    )
    public, secret = tmp_path / "node-a.key", tmp_path / "node-a.key_secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) == 0o644
    out = capsys.readouterr().out
    assert str(public) in out
    assert "give it to every peer" in out
    assert str(secret) in out
    assert "never share it" in out
    assert "--curve-secret-key" in out
    assert "--curve-trusted" in out

    pair = load_secret(secret)
    key, addresses = load_public(public)
    assert pair.public_key == key
    assert pair.addresses == addresses == {"10.0.0.5:5710", "10.0.0.5:5711"}
    assert pair.public_key in out
    assert pair.secret_key not in out  # the secret is never printed
    assert pair.secret_key not in repr(pair)
    assert pair.secret_key not in public.read_text()
    assert zmq.curve_public(pair.secret_key.encode()).decode() == pair.public_key
    ring = load_keyring(tmp_path)  # the secret beside it is ignored
    assert ring.key_for("10.0.0.5:5711") == key
    assert ring.addresses_of(key) == addresses


def test_keygen_never_overwrites_without_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stem = str(tmp_path / "n")
    assert main(["keygen", stem, "--address", "h:1"]) == 0
    first = load_secret(stem + ".key_secret").public_key
    capsys.readouterr()
    assert main(["keygen", stem, "--address", "h:1"]) == 2
    assert "already exist" in capsys.readouterr().err
    assert load_secret(stem + ".key_secret").public_key == first
    assert main(["keygen", stem, "--address", "h:1", "--force"]) == 0
    assert load_secret(stem + ".key_secret").public_key != first
    assert stat.S_IMODE(os.stat(stem + ".key_secret").st_mode) == 0o600


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--address", "no-port"], "not a node id"),
        (["--address", "h:0"], "not a node id"),
        (["--address", "h:70000"], "not a node id"),
        (["--address", " , "], "no address"),
    ],
)
def test_keygen_refuses_bad_addresses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["keygen", str(tmp_path / "n"), *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_keygen_refuses_a_stem_with_a_suffix_or_a_missing_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["keygen", str(tmp_path / "n.key"), "--address", "h:1"]) == 2
    assert "without a suffix" in capsys.readouterr().err
    assert main(["keygen", str(tmp_path / "nope" / "n"), "--address", "h:1"]) == 2
    assert "does not exist" in capsys.readouterr().err


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    mode = stat.S_IMODE(path.stat().st_mode)
    path.write_text(text.replace(old, new))
    path.chmod(mode)


def _bad_secret(tmp_path: Path, case: str) -> Path:
    secret = keypair(tmp_path, "n", "h:1")
    public = tmp_path / "n.key"
    if case == "missing":
        return tmp_path / "absent.key_secret"
    if case == "readable by others":
        secret.chmod(0o644)
    elif case == "a public file":
        public.chmod(0o600)
        return public
    elif case == "damaged key":
        text = secret.read_text()
        key = load_secret(secret).secret_key
        # A character inside the key: the last one encodes bits that Curve25519's
        # clamping drops, so changing it may leave the public key the same.
        _edit(secret, key, key[:10] + ("a" if key[10] != "a" else "b") + key[11:])
        assert text != secret.read_text()
    elif case == "truncated key":
        key = load_secret(secret).secret_key
        _edit(secret, key, key[:20])
    elif case == "no address":
        _edit(secret, 'address = "h:1"', 'name = "h:1"')
    elif case == "not a certificate":
        secret.write_text("hello\n")
    elif case == "binary":
        secret.write_bytes(b"\xff\xfe\x00garbage")
    elif case == "a directory":
        return tmp_path
    return secret


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "does not exist: make one with `p2pactor keygen"),
        ("readable by others", "chmod 600"),
        ("a public file", "public certificate, not a secret one"),
        ("truncated key", "not a 40-character Z85 CURVE key"),
        ("no address", "no address metadata"),
        ("not a certificate", "not a ZeroMQ CURVE certificate"),
        ("binary", "not a text certificate"),
        ("a directory", "is a directory"),
    ],
)
def test_a_bad_secret_key_file_is_a_config_error_that_says_what_to_do(
    tmp_path: Path, case: str, message: str
) -> None:
    secret = _bad_secret(tmp_path, case)
    with pytest.raises(ConfigError, match=message):
        load_secret(secret)
    # The same error stops a node at startup, before it binds anything.
    trusted = tmp_path / "trusted"
    keypair(trusted, "peer", "h:2")
    with pytest.raises(ConfigError, match=message):
        NodeConfig(host="h", port=1, curve_secret_key=secret, curve_trusted=trusted)


async def test_a_secret_key_file_whose_keys_do_not_match_is_refused_by_the_transport(
    tmp_path: Path,
) -> None:
    # Only libzmq can tell that the public key is not the secret's: the file
    # reads, and the zmq transport refuses it when it sets up CURVE, before
    # it binds anything.
    secret = _bad_secret(tmp_path, "damaged key")
    trusted = tmp_path / "trusted"
    keypair(trusted, "peer", "h:2")
    config = NodeConfig(host="h", port=1, curve_secret_key=secret, curve_trusted=trusted)
    assert config.curve is not None
    address = f"{HOST}:{free_port()}"
    message = (
        f"{secret}: its public-key does not belong to its secret-key (the file was edited "
        "or damaged); make a new key pair with `p2pactor keygen STEM --address HOST:PORT`"
    )
    with pytest.raises(ConfigError) as refused:
        async with curve_transport(address, config.curve):
            pytest.fail("a transport opened with a damaged key pair")
    assert str(refused.value) == message
    # A pair made in memory is checked too.
    pair = attrs.evolve(config.curve.keypair, path=None)
    with pytest.raises(ConfigError, match="this node's CURVE key pair: its public-key does not"):
        async with curve_transport(address, attrs.evolve(config.curve, keypair=pair)):
            pytest.fail("a transport opened with a damaged key pair")


def test_bad_trusted_directories_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist or is not a directory"):
        load_keyring(tmp_path / "absent")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"holds no \.key file"):
        load_keyring(tmp_path / "empty")
    # A secret copied in under a public name: refused, and the operator told to rotate.
    leaked = tmp_path / "leaked"
    secret = keypair(tmp_path / "elsewhere", "peer", "h:2")
    leaked.mkdir()
    shutil.copy(secret, leaked / "peer.key")
    with pytest.raises(ConfigError, match="holds a SECRET key"):
        load_keyring(leaked)
    # Two files binding one address to different keys: one is stale.
    stale = tmp_path / "stale"
    keypair(stale, "old", "h:2")
    keypair(stale, "new", "h:2")
    with pytest.raises(ConfigError, match="bind h:2 to different keys"):
        load_keyring(stale)
    # A public file without the address it speaks for cannot bind an identity.
    bare = tmp_path / "bare"
    keypair(bare, "peer", "h:2")
    _edit(bare / "peer.key", 'address = "h:2"', 'x = "h:2"')
    with pytest.raises(ConfigError, match="no address metadata"):
        load_keyring(bare)


def test_node_config_takes_both_curve_settings_or_neither(tmp_path: Path) -> None:
    secret = keypair(tmp_path, "me", "h:1")
    with pytest.raises(ConfigError, match="go together"):
        NodeConfig(host="h", port=1, curve_secret_key=secret)
    with pytest.raises(ConfigError, match="go together"):
        NodeConfig(host="h", port=1, curve_trusted=tmp_path)
    with pytest.raises(ConfigError, match=r"speaks for h:1, but this node is h:2.*keygen"):
        NodeConfig(host="h", port=2, curve_secret_key=secret, curve_trusted=tmp_path)
    config = NodeConfig.from_env(
        {
            "VLLM_P2P_SIDE_CHANNEL_HOST": "h",
            "VLLM_P2P_SIDE_CHANNEL_PORT": "1",
            "P2PACTOR_CURVE_SECRET_KEY": str(secret),
            "P2PACTOR_CURVE_TRUSTED": str(tmp_path),
        }
    )
    assert config.curve is not None
    assert config.curve.keypair.public_key == load_secret(secret).public_key
    assert NodeConfig(host="h", port=1).curve is None


def test_may_dial_needs_a_trusted_key_and_the_allowlist(tmp_path: Path) -> None:
    secret = keypair(tmp_path / "mine", "me", "h:1")
    trusted = tmp_path / "trusted"
    keypair(trusted, "b", "h:2")
    keypair(trusted, "c", "h:3")
    config = NodeConfig(host="h", port=1, curve_secret_key=secret, curve_trusted=trusted)
    assert config.may_dial("h:2")
    assert config.may_dial("h:3")
    assert not config.may_dial("h:4")  # no key for it: never dialed
    assert not config.may_dial("evil:2")
    both = attrs.evolve(config, allowed_peers=frozenset({"h:2", "h:4"}))
    assert both.may_dial("h:2")
    assert not both.may_dial("h:3")  # trusted, but not allowed
    assert not both.may_dial("h:4")  # allowed, but no key


# --- transports -----------------------------------------------------------------------


@attrs.define
class Keys:
    """Key pairs for some addresses, and one trusted directory holding them all."""

    root: Path
    trusted: Path
    secrets: dict[str, Path] = attrs.field(factory=dict)

    def add(self, name: str, address: str, *, trusted: bool = True) -> None:
        folder = self.trusted if trusted else self.root / "untrusted"
        self.secrets[name] = keypair(folder, name, address)

    def security(self, name: str) -> CurveSecurity:
        return CurveSecurity.load(self.secrets[name], self.trusted)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    return Keys(root=tmp_path, trusted=tmp_path / "trusted")


def curve_transport(
    address: str, curve: CurveSecurity | None, **kwargs: Any
) -> contextlib.AbstractAsyncContextManager[ZmqControlTransport]:
    port = int(address.rpartition(":")[2])
    return open_zmq_transport(address, port=port, curve=curve, options=FAST, **kwargs)


async def test_curve_peers_talk_and_everyone_else_is_turned_away(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Trusted keys connect both ways; a stranger's key, or no CURVE, never gets a frame in."""
    caplog.set_level(logging.INFO, logger="p2pactor.zmq")
    ids = {n: f"{HOST}:{free_port()}" for n in ("a", "b", "stranger", "plain")}
    keys.add("a", ids["a"])
    keys.add("b", ids["b"])
    keys.add("stranger", ids["stranger"], trusted=False)
    a_keys, b_keys = keys.security("a"), keys.security("b")
    stranger = keys.security("stranger")  # trusts a, but a does not trust it
    with trio.fail_after(TIMEOUT):
        async with curve_transport(ids["a"], a_keys) as a, curve_transport(ids["b"], b_keys) as b:
            assert (a.security, b.security) == ("curve", "curve")
            to_b = await a.connect(b.local_id)
            await to_b.send(b"hello b")
            from_a = await b.accept()
            assert (from_a.peer_id, await from_a.receive()) == (a.local_id, b"hello b")
            assert await b.connect(a.local_id) is from_a  # one connection per peer
            await from_a.send(b"hello a")
            assert await to_b.receive() == b"hello a"  # b dialed back, with CURVE too

            # A key a does not trust: the handshake is refused, and both sides say why.
            async with curve_transport(ids["stranger"], stranger) as s:
                conn = await s.connect(a.local_id)
                await conn.send(b"let me in")
                await until(lambda: not conn.alive)
                assert conn.dead_reason is not None
                assert "refused this node's CURVE key" in conn.dead_reason
            # No CURVE at all (a stock vLLM peer, say): the mechanisms do not match.
            async with curve_transport(ids["plain"], None) as p:
                assert p.security == "none"
                conn = await p.connect(a.local_id)
                await conn.send(b"let me in")
                await until(lambda: not conn.alive)
                assert conn.dead_reason is not None
                assert "requires CURVE" in conn.dead_reason
            await until(lambda: a.statistics().auth_refused >= 2)
            log = messages(caplog)
            assert f"key {stranger.keypair.public_key} is not trusted" in log
            assert "without CURVE keys" in log
            assert "UNAUTHENTICATED" in log  # the plain transport warned at startup

            # Nothing from them ever reached a's ROUTER, no session, no dial-back.
            stats = a.statistics()
            assert stats.frames_received == 1
            assert stats.connections == 1
            assert stats.pending_accepts == 0
            # And a keeps talking to b.
            await to_b.send(b"still here")
            assert await from_a.receive() == b"still here"


async def test_a_malformed_zap_request_is_answered_or_ignored_and_curve_keeps_working(
    keys: Keys,
) -> None:
    """A ZAP request too short to answer is dropped; another version is refused (500)."""
    ids = {n: f"{HOST}:{free_port()}" for n in ("a", "b")}
    keys.add("a", ids["a"])
    keys.add("b", ids["b"])
    with trio.fail_after(TIMEOUT):
        async with curve_transport(ids["a"], keys.security("a")) as a:
            zap = a._ctx.socket(zmq.DEALER)  # a's own context: ZAP is inproc
            zap.setsockopt(zmq.LINGER, 0)
            zap.setsockopt(zmq.RCVTIMEO, int(TIMEOUT * 1000))
            try:
                zap.connect("inproc://zeromq.zap.01")
                zap.send_multipart([b"", b"1.0"])
                request = [b"", b"2.0", b"7", b"p2pactor", b"h", b"", b"CURVE", bytes(32)]
                zap.send_multipart(request)
                reply = await trio.to_thread.run_sync(zap.recv_multipart)
            finally:
                zap.close()
            assert reply == [b"", b"1.0", b"7", b"500", b"unsupported ZAP version", b"", b""]
            async with curve_transport(ids["b"], keys.security("b")) as b:
                to_a = await b.connect(a.local_id)
                await to_a.send(b"still admitting")
                from_b = await a.accept()
                assert await from_b.receive() == b"still admitting"


async def test_a_trusted_key_claiming_another_peers_address_is_dropped(
    keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """b's key authenticates, but the frame claims c's id: a drops it and dials nobody."""
    caplog.set_level(logging.INFO, logger="p2pactor.zmq")
    ids = {n: f"{HOST}:{free_port()}" for n in "abc"}
    for name in "abc":
        keys.add(name, ids[name])
    a_keys, b_posing_as_c = keys.security("a"), keys.security("b")
    with trio.fail_after(TIMEOUT):
        async with (
            curve_transport(ids["a"], a_keys) as a,
            # Identity c (its DEALERs show it), b's key pair: what a thief of b's key sends.
            curve_transport(ids["c"], b_posing_as_c) as spoof,
        ):
            conn = await spoof.connect(a.local_id)
            frame = wire.encode(
                wire.Connect(
                    peer_id=ids["c"],
                    agent_metadata=b"",
                    base_addr=0,
                    num_blocks=NUM_BLOCKS,
                    block_len=BLOCK_LEN,
                    hash_seed=SEED,
                )
            )
            await conn.send(frame)
            await until(lambda: a.statistics().frames_dropped >= 1)
            with trio.move_on_after(0.5):
                await a.accept()
                pytest.fail("a accepted a connection from a spoofed identity")
            stats = a.statistics()
            assert (stats.frames_received, stats.frames_dropped) == (1, 1)
            assert stats.connections_opened == 0  # no dial-back to the claimed address
            assert conn.alive  # the handshake itself was fine: b's key is trusted
    log = messages(caplog)
    assert f"claiming to come from {ids['c'].encode()!r} but sent with the CURVE key of" in log
    assert ids["b"] in log


# --- nodes: what an eavesdropper sees -------------------------------------------------


@asynccontextmanager
async def recording_proxy(
    listen: tuple[str, int], target: tuple[str, int], record: bytearray
) -> AsyncIterator[None]:
    """A TCP proxy that keeps every byte it forwards, both ways."""

    async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await src.receive_some(65536):
                record.extend(data)
                await dst.send_all(data)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await dst.send_eof()

    async def handle(client: trio.SocketStream) -> None:
        async with client:
            try:
                server = await trio.open_tcp_stream(*target)
            except OSError:
                # The target is gone (its ROUTER closes before the dialing node's
                # DEALER, which keeps reconnecting through us): refuse, as it would.
                return
            async with server, trio.open_nursery() as n:
                n.start_soon(pump, client, server)
                n.start_soon(pump, server, client)

    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(listen[1], host=listen[0])
        nursery.start_soon(trio.serve_listeners, handle, listeners)
        yield
        nursery.cancel_scope.cancel()


async def eavesdrop(keys: Keys | None) -> tuple[bytearray, list[bytes]]:
    """Node a looks up keys on node b through a recording proxy; what went over the wire.

    b is known as 127.0.0.3:P (where the proxy listens) and binds 127.0.0.2:P,
    so a's connection to b, with a's ``connect`` (the hash seed) and its
    ``lookup`` (the keys), goes through the proxy.
    """
    a_id, port = f"{HOST}:{free_port()}", free_port("127.0.0.2")
    b_id = f"127.0.0.3:{port}"
    curves: dict[str, CurveSecurity | None] = {"a": None, "b": None}
    configs: dict[str, dict[str, Any]] = {"a": {}, "b": {}}
    if keys is not None:
        keys.add("a", a_id)
        keys.add("b", b_id)
        for name in "ab":
            curves[name] = keys.security(name)
            configs[name] = {
                "curve_secret_key": keys.secrets[name],
                "curve_trusted": keys.trusted,
            }
    held = [SEED.encode() + b"/held-block-%d" % i for i in range(3)]
    record = bytearray()
    plane = MemoryDataPlane()
    cache_a, cache_b = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN), EmbeddedCache(NUM_BLOCKS, BLOCK_LEN)
    for k in held:
        cache_b.store(k, block_bytes(k, BLOCK_LEN))
    config = {"num_blocks": NUM_BLOCKS, "block_len": BLOCK_LEN, "hash_seed": SEED}
    with trio.fail_after(TIMEOUT):
        async with (
            recording_proxy(("127.0.0.3", port), ("127.0.0.2", port), record),
            curve_transport(a_id, curves["a"]) as za,
            curve_transport(b_id, curves["b"], bind_host="127.0.0.2") as zb,
            open_node(
                NodeConfig(host=HOST, port=za.port, **config, **configs["a"]),
                control=za,
                data=plane.transport(cache_a.memory, BLOCK_LEN),
                parent=cache_a,
            ) as a,
            open_node(
                NodeConfig(host="127.0.0.3", port=port, **config, **configs["b"]),
                control=zb,
                data=plane.transport(cache_b.memory, BLOCK_LEN),
                parent=cache_b,
            ),
        ):
            answers = await a.lookup(b_id, "req-1", held)
            assert answers == [LookupResult.HIT] * len(held)
            a.finish("req-1")
            session = a.peers.session(b_id)
            assert session is not None
            assert session.extended
    return record, held


async def test_an_eavesdropper_reads_the_seed_and_keys_without_curve_and_nothing_with_it(
    keys: Keys,
) -> None:
    plain, held = await eavesdrop(None)
    assert SEED.encode() in plain  # the hash seed, in a's connect
    assert all(k in plain for k in held)  # every key a asked about
    assert b"127.0.0.1:" in plain  # and who is asking

    sealed, held = await eavesdrop(keys)
    assert len(sealed) > 0  # the traffic went through the proxy
    assert SEED.encode() not in sealed
    assert not any(k in sealed for k in held)
    assert not any(k[-12:] in sealed for k in held)
    assert b"CURVE" in sealed  # the ZMTP greeting names the mechanism; nothing else is clear


@pytest.mark.parametrize("impostor", ["a CURVE server with another key", "a raw TCP listener"])
async def test_the_hash_seed_never_leaves_for_a_peer_that_cannot_prove_its_key(
    keys: Keys, impostor: str
) -> None:
    """Something listens at a trusted peer's address without that peer's secret key.

    Our node dials it (the address is trusted) and queues its ``connect``, with
    the hash seed; CURVE sends nothing until the server has proved it holds the
    trusted key, so the impostor receives a greeting and nothing else.
    """
    me, peer = f"{HOST}:{free_port()}", f"{HOST}:{free_port()}"
    keys.add("me", me)
    keys.add("peer", peer)
    received = bytearray()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    listener = socket.socket()
    try:
        if impostor == "a raw TCP listener":
            listener.bind((HOST, int(peer.rpartition(":")[2])))
            listener.listen()
        else:
            router.curve_server = True
            router.curve_secretkey = zmq.curve_keypair()[1]
            router.bind(f"tcp://{peer}")
        config = NodeConfig(
            host=HOST,
            port=int(me.rpartition(":")[2]),
            num_blocks=NUM_BLOCKS,
            block_len=BLOCK_LEN,
            hash_seed=SEED,
            curve_secret_key=keys.secrets["me"],
            curve_trusted=keys.trusted,
        )
        cache = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN)
        with trio.fail_after(TIMEOUT):
            async with (
                curve_transport(me, keys.security("me")) as control,
                open_node(
                    config,
                    control=control,
                    data=MemoryDataPlane().transport(cache.memory, BLOCK_LEN),
                    parent=cache,
                ) as node,
            ):
                assert config.may_dial(peer)
                node.prepare(peer)  # dials, and queues connect (hash seed and all)
                if impostor == "a raw TCP listener":
                    conn, _ = await trio.to_thread.run_sync(listener.accept)
                    with conn:
                        conn.settimeout(1.0)
                        with contextlib.suppress(TimeoutError):
                            while chunk := conn.recv(65536):
                                received.extend(chunk)
                    # The start of a ZMTP greeting (it waits for the server's), nothing more.
                    assert received.startswith(b"\xff")
                    assert len(received) <= 64
                else:
                    await trio.sleep(1.0)
                    assert router.poll(0) == 0  # no frame got through
                    assert await node.lookup(peer, "req-1", [b"k" * 36]) == [LookupResult.MISS]
    finally:
        listener.close()
        router.close(linger=0)
        ctx.term()
    assert SEED.encode() not in received


# --- nodes: outbound allowlist --------------------------------------------------------


async def test_request_parameters_never_make_a_curve_node_dial_an_untrusted_address(
    keys: Keys,
) -> None:
    """A lookup naming an address without a trusted key is a MISS; no packet leaves."""
    me, friend = f"{HOST}:{free_port()}", f"{HOST}:{free_port()}"
    keys.add("me", me)
    keys.add("friend", friend)
    curve = keys.security("me")
    config = NodeConfig(
        host=HOST,
        port=int(me.rpartition(":")[2]),
        num_blocks=NUM_BLOCKS,
        block_len=BLOCK_LEN,
        curve_secret_key=keys.secrets["me"],
        curve_trusted=keys.trusted,
    )
    cache = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN)
    with trio.fail_after(TIMEOUT), socket.socket() as victim:
        victim.bind((HOST, 0))
        victim.listen()
        victim.setblocking(False)
        target = f"{HOST}:{victim.getsockname()[1]}"
        async with (
            curve_transport(me, curve) as control,
            open_node(
                config,
                control=control,
                data=MemoryDataPlane().transport(cache.memory, BLOCK_LEN),
                parent=cache,
            ) as node,
        ):
            assert not config.may_dial(target)
            assert await node.lookup(target, "req-1", [b"k" * 36]) == [LookupResult.MISS]
            node.prepare(target)
            node.register_lookup(target, "req-2", [b"k" * 36])
            node.flush()
            await trio.sleep(0.5)
            with pytest.raises(BlockingIOError):
                victim.accept()  # nobody knocked
            assert control.statistics().connections_opened == 0
            assert node.peers.session(target) is None
            # The transport refuses too, should anything ask it directly.
            with pytest.raises(Exception, match="no trusted CURVE key"):
                await control.connect(target)


def import_vllm() -> None:
    """Skip without vLLM; import what the adapter imports lazily, torch's warnings muted."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="vLLM is not installed")
        import vllm.v1.kv_offload.file_mapper  # noqa: F401, PLC0415
        from vllm.v1.core import kv_cache_utils  # noqa: F401, PLC0415


def test_the_vllm_tier_never_dials_an_untrusted_remote_kv_source(keys: Keys) -> None:
    """kv_transfer_params naming an address without a trusted key: no source, a MISS."""
    import_vllm()
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace  # noqa: PLC0415

    from vllm.v1.kv_offload.base import LookupResult as VllmLookup  # noqa: PLC0415
    from vllm.v1.kv_offload.base import ReqContext  # noqa: PLC0415

    from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415

    parallel = SimpleNamespace(
        data_parallel_index=0,
        tp_size=1,
        pp_size=1,
        pcp_size=1,
        dcp_size=1,
        rank=0,
        is_parallelism_agnostic=True,
    )
    spec = SimpleNamespace(
        config=SimpleNamespace(
            parallel=parallel,
            model=SimpleNamespace(name="p2pactor/tiny-test-model", dtype="bfloat16"),
            cache=SimpleNamespace(tokens_per_hash=16),
            groups=[SimpleNamespace(tokens_per_block=16, layer_names=["model.layers.0.attn"])],
            canonical_layout=False,
            kv_cache_layout=None,
            replicated_layout=False,
        ),
        blocks_per_chunk=1,
    )
    port = free_port()
    keys.add("engine", f"{HOST}:{port}")
    keys.add("friend", f"{HOST}:{free_port()}")
    memory = torch.zeros(4, 1024, dtype=torch.uint8)
    with socket.socket() as victim:
        victim.bind((HOST, 0))
        victim.listen()
        victim.setblocking(False)
        tier = P2PActorTierManager(
            spec,
            memoryview(memory.numpy()),
            host=HOST,
            port=port,
            curve_secret_key=str(keys.secrets["engine"]),
            curve_trusted=str(keys.trusted),
        )
        try:
            node: Node = tier._node
            assert node.config.curve is not None
            params = {
                "remote_kv_source": {
                    "kv_request_id": "kv-1",
                    "remote_host": HOST,
                    "remote_port": victim.getsockname()[1],
                }
            }
            ctx = ReqContext(req_id="req-1", kv_transfer_params=params)
            tier.on_new_request(ctx)
            miss = tier.lookup(b"k" * 36, ctx)  # the request has no source
            assert miss in (VllmLookup.MISS, False)
            time.sleep(0.5)
            with pytest.raises(BlockingIOError):
                victim.accept()
        finally:
            tier.shutdown()


def test_the_vllm_tier_reads_its_curve_keys_once_host_and_port_are_known(
    keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The env's keys are checked against this rank's id, not the default localhost:5710."""
    import_vllm()
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace  # noqa: PLC0415

    from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415

    port = free_port()
    keys.add("engine", f"{HOST}:{port}")
    monkeypatch.setenv("P2PACTOR_CURVE_SECRET_KEY", str(keys.secrets["engine"]))
    monkeypatch.setenv("P2PACTOR_CURVE_TRUSTED", str(keys.trusted))
    spec = SimpleNamespace(
        config=SimpleNamespace(parallel=SimpleNamespace(data_parallel_index=0)),
        blocks_per_chunk=1,
    )
    with pytest.raises(ValueError, match="speaks for"):  # a wrong port: told what to do
        P2PActorTierManager(
            spec,
            memoryview(torch.zeros(4, 1024, dtype=torch.uint8).numpy()),
            host=HOST,
            port=port + 1,
        )


# --- a real serve process ---------------------------------------------------------------


@attrs.define
class Server:
    """A ``p2pactor serve`` process with CURVE, and the keys around it."""

    node_id: str
    keys: Keys
    clients: dict[str, str]  # trusted client name -> its node id
    stderr: Path
    process: subprocess.Popen[bytes]

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")


TRUSTED_CLIENTS = ("trusted-1", "trusted-after-stranger", "trusted-after-plain")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("curve-serve")
    keys = Keys(root=root, trusted=root / "trusted")
    port = free_port()
    node_id = f"{HOST}:{port}"
    keys.add("server", node_id)
    clients = {name: f"{HOST}:{free_port()}" for name in TRUSTED_CLIENTS}
    for name, address in clients.items():
        keys.add(name, address)  # the server reads its trusted folder once, at startup
    stdout, stderr = root / "serve.out", root / "serve.err"
    command = [
        sys.executable, "-m", "p2pactor", "serve",
        "--host", HOST, "--port", str(port),
        # 64 blocks: a peer may pin a quarter of them (the default quota), the 8 we fetch.
        "--num-blocks", "64", "--block-len", str(BLOCK_LEN),
        "--hash-seed", SEED, "--preload", "8",
        "--curve-secret-key", str(keys.secrets["server"]),
        "--curve-trusted", str(keys.trusted),
    ]  # fmt: skip
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    with stdout.open("wb") as out, stderr.open("wb") as err:
        process = subprocess.Popen(command, stdout=out, stderr=err, env=env)
    try:
        deadline = time.monotonic() + 120
        while "serving" not in stdout.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"p2pactor serve did not start:\n{stderr.read_text()}")
            time.sleep(0.1)
        banner = stdout.read_text()
        assert "control channel: CURVE" in banner, banner
        yield Server(node_id, keys, clients, stderr, process)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@asynccontextmanager
async def client(
    name: str, server: Server, *, trusted: bool = True, curve: bool = True
) -> AsyncIterator[tuple[Node, EmbeddedCache, Any]]:
    """A node with a NIXL pool that trusts ``server``; ``trusted``: the server trusts it."""
    torch = pytest.importorskip("torch")
    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415

    settings: dict[str, Any] = {}
    security = None
    if trusted:  # its key went into the server's trusted folder before the server started
        assert curve
        node_id = server.clients[name]
        secret = server.keys.secrets[name]
    else:
        node_id = f"{HOST}:{free_port()}"
        secret = keypair(server.keys.root / "strangers", name, node_id)
    port = int(node_id.rpartition(":")[2])
    if curve:
        # Its own trusted folder: the server's key (the server may not trust it back).
        folder = server.keys.root / f"{name}-trusts"
        folder.mkdir()
        shutil.copy(server.keys.trusted / "server.key", folder / "server.key")
        settings = {"curve_secret_key": secret, "curve_trusted": folder}
        security = CurveSecurity.load(secret, folder)
    config = NodeConfig(
        host=HOST, port=port, num_blocks=NUM_BLOCKS, block_len=BLOCK_LEN, hash_seed=SEED,
        **settings,
    )  # fmt: skip
    pool = torch.zeros(NUM_BLOCKS, BLOCK_LEN, dtype=torch.uint8)
    cache = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN, memory=memoryview(pool.numpy()))
    async with (
        curve_transport(node_id, security) as control,
        open_nixl_transport(pool, BLOCK_LEN, name=f"curve-{name}") as data,
        open_node(config, control=control, data=data, parent=cache) as node,
    ):
        yield node, cache, control


async def fetch_and_verify(node: Node, cache: EmbeddedCache, peer: str, kv_id: str) -> None:
    keys = preload_keys(SEED, 8)
    assert await node.lookup(peer, kv_id, keys) == [LookupResult.HIT] * 8
    blocks = cache.allocate(len(keys))
    result = await node.fetch(peer, kv_id, keys, blocks)
    assert result.success, result.reason
    for k, block in zip(keys, blocks, strict=True):
        cache.commit(k, block)
        assert cache.read(k) == block_bytes(k, BLOCK_LEN)  # byte for byte, through NIXL
    node.finish(kv_id)


async def test_a_curve_serve_process_serves_a_trusted_node_over_nixl(server: Server) -> None:
    with trio.fail_after(TIMEOUT):
        async with client("trusted-1", server) as (node, cache, control):
            await fetch_and_verify(node, cache, server.node_id, "kv-trusted-1")
            session = node.peers.session(server.node_id)
            assert session is not None
            assert session.extended
            assert control.security == "curve"
    assert server.process.poll() is None


@pytest.mark.parametrize("who", ["an untrusted key", "no CURVE"])
async def test_a_curve_serve_process_turns_away_strangers_and_keeps_serving(
    server: Server, who: str
) -> None:
    with trio.fail_after(TIMEOUT):
        name = "stranger" if who == "an untrusted key" else "plain"
        async with client(name, server, trusted=False, curve=who != "no CURVE") as (
            node,
            _,
            control,
        ):
            answers = await node.lookup(server.node_id, "kv-stranger", preload_keys(SEED, 8))
            assert answers == [LookupResult.MISS] * 8  # its session never formed
            await until(lambda: node.peers.session(server.node_id) is None)  # it closed for good
            stats = control.statistics()
            assert stats.frames_received == 0  # the server never said a word to it
            assert stats.connections == 0
        # The server says why, in its log.
        # Without CURVE: libzmq reports a mechanism mismatch, or a handshake broken off
        # when the client hung up first (it learns it was refused at the same time).
        why = "is not trusted" if who == "an untrusted key" else "without CURVE keys"
        with trio.move_on_after(10):
            await until(lambda: why in server.log(), interval=0.1)
        assert why in server.log()
        # And a trusted peer is still served.
        async with client(f"trusted-after-{name}", server) as (node, cache, _):
            await fetch_and_verify(node, cache, server.node_id, f"kv-after-{name}")
    assert server.process.poll() is None


# --- the demo ---------------------------------------------------------------------------


def test_the_demo_runs_with_curve(tmp_path: Path) -> None:
    from io import StringIO  # noqa: PLC0415

    from p2pactor.programs.demo.run import run_demo  # noqa: PLC0415
    from p2pactor.programs.demo.workload import DemoPlan  # noqa: PLC0415

    out = StringIO()
    plan = DemoPlan(nodes=2, requests=3, prefix_blocks=2, suffix_blocks=1, new_blocks=1)
    report = run_demo(plan, log_dir=tmp_path, out=out, timeout=120, curve=True)
    text = out.getvalue()
    assert report.ok, text
    assert "control channel: CURVE" in text
    folder = text.split("others' keys (", 1)[1].split(",", 1)[0]
    assert not Path(folder).exists()  # the secrets did not outlive the demo


def test_keyring_equality_and_lookup() -> None:
    ring = Keyring(keys={"h:1": "k" * 40, "h:2": "k" * 40})
    assert ring.addresses_of("k" * 40) == {"h:1", "h:2"}
    assert ring.trusts("k" * 40)
    assert not ring.trusts("x" * 40)
    assert ring.key_for("h:3") is None
    assert ring == Keyring(keys={"h:2": "k" * 40, "h:1": "k" * 40})
