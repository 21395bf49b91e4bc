"""``p2pactor demo --curve``: CURVE keys for every demo node, each trusting the others.

The orchestrator picks a free port per node (a CURVE key speaks for one
``host:port``, so the ports are known before the keys are made), writes every
node's key pair into one temporary folder with :func:`p2pactor.adapters.zmq.generate_keypair`,
and hands each node process its port and key files in the environment
(:data:`ENV`). The folder is both every node's trusted directory (the
``*.key`` files) and where the secrets live; it is deleted when the demo ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import attrs

from p2pactor.adapters.zmq import generate_keypair

__all__ = ["ENV", "NodeCurve", "demo_keys", "node_curve"]

ENV: Final = "P2PACTOR_DEMO_CURVE"
"""The environment variable a demo node reads its CURVE setup from (JSON)."""

HOST: Final = "127.0.0.1"


@attrs.frozen(kw_only=True)
class NodeCurve:
    """One demo node's CURVE setup.

    Attributes:
        port: The control port its key speaks for.
        secret_key: Its secret certificate.
        trusted: The folder of every demo node's public certificate.
    """

    port: int
    secret_key: str
    trusted: str

    def to_env(self) -> str:
        """The value of :data:`ENV` for the node."""
        return json.dumps(attrs.asdict(self))


def _free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on loopback now (held together, then released)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((HOST, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


@contextlib.contextmanager
def demo_keys(nodes: int) -> Iterator[list[NodeCurve]]:
    """Make a key pair per node in a temporary folder; delete it on exit."""
    with tempfile.TemporaryDirectory(prefix="p2pactor-demo-keys-") as folder:
        setups = []
        for index, port in enumerate(_free_ports(nodes)):
            _, secret = generate_keypair(Path(folder) / f"node-{index}", f"{HOST}:{port}")
            setups.append(NodeCurve(port=port, secret_key=str(secret), trusted=folder))
        yield setups


def node_curve() -> NodeCurve | None:
    """This demo node's CURVE setup from :data:`ENV`, or None without ``--curve``."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    return NodeCurve(**json.loads(raw))
