"""Bind one address, be known by another (``docs/deploy.md``, "Bind and advertise").

Real ZeroMQ sockets, loopback only: distinct 127.0.0.x aliases stand in for
hosts, and nothing is ever dialed outside 127.0.0.0/8. The peer ids off this
machine used below (``10.255.255.1``) are refused before any socket exists,
which is what the tests check.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import warnings
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import zmq

from p2pactor.adapters.zmq import ZmqControlTransport, open_zmq_transport
from p2pactor.core import protocol as wire
from p2pactor.core.inputs import LookupResult
from p2pactor.errors import ConfigError
from p2pactor.programs.cli import build_parser
from p2pactor.programs.serve import config_from_args
from p2pactor.runtime.addresses import is_loopback, is_wildcard
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.node import Node, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.testing import MemoryDataPlane
from tests.ports import free_port

# One in-memory data plane for every node here: the control channel is what is tested.
PLANE = MemoryDataPlane()
NUM_BLOCKS = 8
BLOCK_LEN = 64
TIMEOUT = 30.0
ELSEWHERE = "10.255.255.1:5710"  # another host's id: never dialed, only decided about


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\x00\x00\x00\x00"


class LogWaiter(logging.Handler):
    """Sets ``seen`` at the first record whose message starts with ``prefix``.

    The node logs on its trio thread, so setting a trio.Event from here is safe.
    """

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.seen = trio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.seen.set()


def refuses_connections(host: str, port: int) -> bool:
    """Whether nothing listens on ``host:port`` (a loopback address)."""
    assert is_loopback(host)
    with socket.socket() as probe:
        return probe.connect_ex((host, port)) != 0


@asynccontextmanager
async def zmq_node(
    host: str, *, bind_host: str | None = None, cache: EmbeddedCache | None = None
) -> AsyncIterator[tuple[ZmqControlTransport, Node]]:
    """A node on real ZeroMQ, known as ``host``, bound on ``bind_host`` (in-memory data)."""
    cache = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN) if cache is None else cache
    async with AsyncExitStack() as stack:
        control = await stack.enter_async_context(
            open_zmq_transport(f"{host}:0", bind_host=bind_host, port=0)
        )
        config = NodeConfig(
            host=host,
            bind_host=bind_host,
            port=control.port,
            num_blocks=NUM_BLOCKS,
            block_len=BLOCK_LEN,
        )
        assert config.node_id == control.local_id
        data = PLANE.transport(cache.memory, BLOCK_LEN)
        node = await stack.enter_async_context(
            open_node(config, control=control, data=data, parent=cache)
        )
        yield control, node


# --- the split, over real sockets ----------------------------------------------------------


async def test_a_node_bound_on_every_interface_is_reached_by_its_advertised_id() -> None:
    cache_b = EmbeddedCache(NUM_BLOCKS, BLOCK_LEN)
    cache_b.store(key(1), bytes(BLOCK_LEN))
    with trio.fail_after(TIMEOUT):
        async with (
            zmq_node("127.0.0.1") as (za, a),
            zmq_node("127.0.0.2", bind_host="0.0.0.0", cache=cache_b) as (zb, b),
        ):
            assert zb.local_id == f"127.0.0.2:{zb.port}"  # the id is host's, not 0.0.0.0's
            answers = await a.lookup(zb.local_id, "req-1", [key(1), key(2)])
            assert answers == [LookupResult.HIT, LookupResult.MISS]
            # b knows a by a's id and dialed it back there; a knows b by b's.
            session_a = a.peers.session(zb.local_id)
            session_b = b.peers.session(za.local_id)
            assert session_a is not None
            assert session_a.extended
            assert session_b is not None
            a.finish("req-1")


async def test_the_router_binds_bind_host_and_the_id_keeps_host() -> None:
    # Bound on one alias, known by another: a socket reaches the bound one
    # only (the advertised one would be a proxy's or a NAT's in real life).
    with trio.fail_after(TIMEOUT):
        async with zmq_node("127.0.0.3", bind_host="127.0.0.2") as (control, node):
            assert node.config.node_id == f"127.0.0.3:{control.port}"
            assert control.local_id == node.config.node_id
            assert not refuses_connections("127.0.0.2", control.port)
            assert refuses_connections("127.0.0.3", control.port)


# --- a wildcard is never an id ---------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*", "", " "])
def test_a_wildcard_host_is_refused_with_what_to_set(host: str) -> None:
    with pytest.raises(ConfigError) as caught:
        NodeConfig(host=host)
    message = str(caught.value)
    assert "bind_host=0.0.0.0" in message
    assert "host=<an address peers reach>" in message


def test_a_wildcard_bind_host_is_fine_and_unset_binds_host() -> None:
    config = NodeConfig(host="10.0.0.5", bind_host="0.0.0.0")
    assert (config.node_id, config.listen_host) == ("10.0.0.5:5710", "0.0.0.0")
    assert NodeConfig(host="10.0.0.5").listen_host == "10.0.0.5"
    with pytest.raises(ConfigError, match="bind_host"):
        NodeConfig(bind_host="")


def test_wildcard_and_loopback_spellings() -> None:
    assert all(is_wildcard(h) for h in ("0.0.0.0", "::", "[::]", "*", "", "0:0::0"))
    assert not any(is_wildcard(h) for h in ("127.0.0.1", "10.0.0.5", "node-a", "localhost"))
    loopback = ("localhost", "LOCALHOST.", "a.localhost", "127.0.0.1", "127.9.8.7", "::1", "[::1]")
    assert all(is_loopback(h) for h in loopback)
    assert not any(is_loopback(h) for h in ("10.0.0.5", "node-a", "0.0.0.0", "localhost.example"))


# --- a loopback id across hosts ------------------------------------------------------------


def test_a_loopback_node_may_dial_loopback_peers_only() -> None:
    local = NodeConfig(host="localhost")
    for peer in ("127.0.0.1:5711", "localhost:5711", "[::1]:5711", "127.0.0.2:1"):
        assert local.may_dial(peer)
        assert local.dial_refusal(peer) is None
    assert not local.may_dial(ELSEWHERE)
    reason = local.dial_refusal(ELSEWHERE)
    assert reason is not None
    for part in ("localhost:5710", ELSEWHERE, "VLLM_P2P_SIDE_CHANNEL_HOST", "--host"):
        assert part in reason
    # A node known by a real address dials anyone (allowlist and CURVE aside).
    assert NodeConfig(host="10.0.0.5").may_dial(ELSEWHERE)
    assert NodeConfig(host="10.0.0.5").may_dial("127.0.0.1:5711")


def test_may_dial_remembers_its_answers_within_a_bound() -> None:
    local = NodeConfig(host="localhost")
    peers = [f"127.0.0.{i % 250 + 1}:{1000 + i}" for i in range(5000)] + [ELSEWHERE]
    first = [local.may_dial(p) for p in peers]
    # Asked again (from memory, and past the bound, which forgets and recomputes):
    # the same answers, each the one the rules give.
    assert [local.may_dial(p) for p in reversed(peers)] == first[::-1]
    assert first == [p != ELSEWHERE for p in peers]
    assert len(local._dialable) <= 4096
    # An evolved config judges by its own rules, not by the original's memory.
    assert attrs.evolve(local, host="10.0.0.5").may_dial(ELSEWHERE)


async def test_a_loopback_node_refuses_to_dial_another_host_before_any_socket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with trio.fail_after(TIMEOUT):
        async with zmq_node("127.0.0.1") as (control, node):
            answers = await node.lookup(ELSEWHERE, "req-1", [key(1)])
            result = await node.fetch(ELSEWHERE, "req-2", [key(1)], [0])
            assert answers == [LookupResult.MISS]
            assert not result.success
            assert result.reason is not None
            assert "VLLM_P2P_SIDE_CHANNEL_HOST" in result.reason
            assert node.peers.session(ELSEWHERE) is None
            stats = control.statistics()
            assert (stats.connections, stats.connections_opened) == (0, 0)  # never dialed
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    said = [m for m in errors if ELSEWHERE in m and control.local_id in m]
    assert len(said) == 1, errors  # once per peer, naming both ids
    assert "not dialing" in said[0]
    assert "--host" in said[0]


async def test_a_loopback_node_drops_another_hosts_frame_without_dialing_it_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, ELSEWHERE.encode())  # claims another host
    waiter = LogWaiter(f"refused {ELSEWHERE}")
    logging.getLogger("p2pactor").addHandler(waiter)
    try:
        with trio.fail_after(TIMEOUT):
            async with zmq_node("127.0.0.1") as (control, node):
                dealer.connect(f"tcp://127.0.0.1:{control.port}")
                hello = wire.Connect(
                    peer_id=ELSEWHERE,
                    agent_metadata=b"x",
                    base_addr=0,
                    num_blocks=NUM_BLOCKS,
                    block_len=BLOCK_LEN,
                    hash_seed="0",
                )
                dealer.send(wire.encode(hello))
                await waiter.seen.wait()  # the node has decided about the frame
                stats = control.statistics()
                assert stats.frames_dropped == 1
                assert (stats.connections, stats.connections_opened) == (0, 0)  # no dial-back
                assert node.peers.session(ELSEWHERE) is None
    finally:
        logging.getLogger("p2pactor").removeHandler(waiter)
        dealer.close()
        ctx.term()
    refused = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.getMessage().startswith(f"refused {ELSEWHERE}")
    ]
    assert len(refused) == 1
    assert "loopback" in refused[0]


# --- where the setting comes from ------------------------------------------------------------


def test_the_environment_sets_bind_host() -> None:
    env = {"VLLM_P2P_SIDE_CHANNEL_HOST": "10.0.0.5", "P2PACTOR_BIND_HOST": "0.0.0.0"}
    config = NodeConfig.from_env(env)
    assert (config.host, config.bind_host, config.node_id) == (
        "10.0.0.5",
        "0.0.0.0",
        "10.0.0.5:5710",
    )
    assert NodeConfig.from_env({"P2PACTOR_BIND_HOST": ""}).bind_host is None  # empty: unset
    assert NodeConfig.from_env({}).bind_host is None
    with pytest.raises(ConfigError, match="wildcard"):
        NodeConfig.from_env({"VLLM_P2P_SIDE_CHANNEL_HOST": "0.0.0.0"})


def test_serve_takes_bind_host_and_host_flags() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--host", "10.0.0.5", "--bind-host", "0.0.0.0"])
    config = config_from_args(args, env={})
    assert (config.host, config.bind_host, config.node_id) == (
        "10.0.0.5",
        "0.0.0.0",
        "10.0.0.5:5710",
    )
    # The flag beats the environment; without it the environment's is used.
    env = {"P2PACTOR_BIND_HOST": "10.0.0.9", "VLLM_P2P_SIDE_CHANNEL_HOST": "10.0.0.5"}
    assert (
        config_from_args(parser.parse_args(["serve", "--bind-host", "0.0.0.0"]), env).bind_host
        == "0.0.0.0"
    )
    assert config_from_args(parser.parse_args(["serve"]), env).bind_host == "10.0.0.9"
    with pytest.raises(ConfigError, match=r"bind_host=0\.0\.0\.0"):
        config_from_args(parser.parse_args(["serve", "--host", "0.0.0.0"]), env={})
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help or "" for a in commands.choices["serve"]._actions}
    assert "bind" in helps["bind_host"]
    assert "dial" in helps["host"]


def test_serve_says_what_to_set_for_a_wildcard_host(capsys: pytest.CaptureFixture[str]) -> None:
    from p2pactor.programs.cli import main  # noqa: PLC0415

    assert main(["serve", "--host", "0.0.0.0", "--port", "5710"]) == 2
    assert "--bind-host" in capsys.readouterr().err


# --- the vLLM tier ---------------------------------------------------------------------------


def _offloading_spec() -> Any:
    """The stand-in OffloadingSpec of tests/test_vllm_tier.py (imported once vLLM is known)."""
    from tests.test_vllm_tier import offloading_spec  # noqa: PLC0415 - skips without vLLM

    return offloading_spec()


def _vllm_tier() -> tuple[Any, Any]:
    """The tier class and torch, or a skip where vLLM's tiering is not installed."""
    pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="vLLM tiering not installed")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    # What the adapter imports lazily, imported here first (as tests/test_vllm_tier.py
    # does): torch's import-time DeprecationWarnings stay out of pytest's "error" filter.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch  # noqa: PLC0415
        import vllm.v1.kv_offload.file_mapper  # noqa: F401, PLC0415
        from vllm.v1.core import kv_cache_utils  # noqa: F401, PLC0415

        from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415
    return P2PActorTierManager, torch


@pytest.mark.parametrize("through", ["option", "environment"])
def test_the_vllm_tier_binds_bind_host_and_is_known_by_host(
    through: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier_class, torch = _vllm_tier()

    options: dict[str, Any] = {"host": "127.0.0.3", "port": free_port()}
    if through == "option":
        options["bind_host"] = "127.0.0.2"
    else:
        monkeypatch.setenv("P2PACTOR_BIND_HOST", "127.0.0.2")
    memory = torch.zeros(4, 1024, dtype=torch.uint8)
    tier = tier_class(_offloading_spec(), memoryview(memory.numpy()), **options)
    try:
        config = tier.node.config
        assert (config.bind_host, config.node_id) == ("127.0.0.2", f"127.0.0.3:{options['port']}")
        assert not refuses_connections("127.0.0.2", options["port"])
        assert refuses_connections("127.0.0.3", options["port"])
    finally:
        tier.shutdown()


def test_the_vllm_tier_refuses_a_wildcard_host() -> None:
    tier_class, torch = _vllm_tier()

    memory = torch.zeros(4, 1024, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"bind_host=0\.0\.0\.0"):
        tier_class(_offloading_spec(), memoryview(memory.numpy()), host="0.0.0.0", port=free_port())


def test_serve_takes_its_seed_peers_and_can_turn_summaries_off() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--seed-peers", "10.0.0.2:5710, 10.0.0.3:5710"])
    config = config_from_args(args, env={})
    assert config.seed_peers == {"10.0.0.2:5710", "10.0.0.3:5710"}
    assert config.sources.share
    env = {"P2PACTOR_SEED_PEERS": "10.0.0.9:5710"}
    assert config_from_args(parser.parse_args(["serve"]), env).seed_peers == {"10.0.0.9:5710"}
    off = config_from_args(parser.parse_args(["serve", "--no-summaries"]), env={})
    assert not off.sources.share
