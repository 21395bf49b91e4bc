"""Ports for the tests' own servers, where no outgoing connection can take them first.

A port from ``bind(0)`` is one of the kernel's ephemeral ports, the same range
it gives every outgoing connection (ZeroMQ's, UCX's, the browser's) its local
port from. A test that picks one and binds it only later (a process started
in between, vLLM's import takes seconds) can find it taken. These come from
below that range, which the kernel hands out to no one.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["free_port"]

_LOWEST = 20_000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on ``host`` now, outside the ephemeral range."""
    top = _ephemeral_low()
    for _ in range(1000):
        port = random.randrange(_LOWEST, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # bound, or lingering: another
        return port
    raise RuntimeError(f"no free port on {host} between {_LOWEST} and {top}")
