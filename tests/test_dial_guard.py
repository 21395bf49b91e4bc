"""A sender's claimed identity never steers a node's outbound connections.

vLLM's layout dials back to the address in the identity of an inbound
DEALER's first frame. With ``allowed_peers`` set, that claim must be checked
before the dial: a stranger sending one frame must not make the node open a
TCP connection to an address of the stranger's choosing. Real sockets: a raw
DEALER sends the frame, and a plain TCP listener at the claimed address counts
the connections the node opens to it.
"""

from __future__ import annotations

import socket

import trio
import zmq

from p2pactor.adapters.zmq import ZmqControlTransport, open_zmq_transport
from p2pactor.core import protocol as wire
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.node import open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.testing import MemoryDataPlane

BLOCK_LEN = 64


async def _dials_after_claim(allowed: frozenset[str] | None) -> tuple[int, int]:
    """Send one frame claiming a trap's address.

    Returns:
        The connections the trap saw, and the connections the transport opened.
    """
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(8)
    trap.setblocking(False)
    claimed = f"127.0.0.1:{trap.getsockname()[1]}"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, claimed.encode())
    accepted = 0
    try:
        async with open_zmq_transport("127.0.0.1:0", port=0) as control:
            assert isinstance(control, ZmqControlTransport)
            config = NodeConfig(
                host="127.0.0.1",
                port=control.port,
                num_blocks=4,
                block_len=BLOCK_LEN,
                allowed_peers=allowed,
            )
            cache = EmbeddedCache(4, BLOCK_LEN)
            data = MemoryDataPlane().transport(cache.memory, BLOCK_LEN)
            async with open_node(config, control=control, data=data, parent=cache):
                dealer.connect(f"tcp://127.0.0.1:{control.port}")
                hello = wire.Connect(
                    peer_id=claimed,
                    agent_metadata=b"x",
                    base_addr=0,
                    num_blocks=4,
                    block_len=BLOCK_LEN,
                    hash_seed="0",
                )
                dealer.send(wire.encode(hello))
                with trio.move_on_after(1.5):
                    while True:
                        try:
                            conn, _ = trap.accept()
                        except BlockingIOError:
                            await trio.sleep(0.02)
                            continue
                        conn.close()
                        accepted += 1
                        break
                stats = control.statistics()
    finally:
        dealer.close()
        ctx.term()
        trap.close()
    return accepted, stats.connections_opened


async def test_a_stranger_claiming_an_address_is_not_dialed_back() -> None:
    with trio.fail_after(30):
        accepted, opened = await _dials_after_claim(frozenset({"127.0.0.1:1"}))
    assert (accepted, opened) == (0, 0)


async def test_without_an_allowlist_the_claimed_address_is_dialed_back() -> None:
    """The control case: vLLM's layout does dial back, so the guard above is what stops it."""
    with trio.fail_after(30):
        accepted, opened = await _dials_after_claim(None)
    assert (accepted, opened) == (1, 1)
