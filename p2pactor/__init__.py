"""p2pactor: peer-to-peer KV-cache sharing for LLM inference engines.

Every engine ("node") asks peers which KV blocks they hold, pulls the hits over
NIXL, and serves its own blocks to others. Each request is an actor that reduces
an immutable event log into typed state; see ``DESIGN.md`` in the repository.

Layers, imports pointing downward only:

* ``p2pactor.core`` and ``p2pactor.protocol``: the pure core (no I/O, no clock).
* the trio runtime (actors, sessions, the node, the event log).
* ``p2pactor.adapters``: ZeroMQ, NIXL and vLLM.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from p2pactor.errors import ConfigError, P2PActorError, ProtocolError

__all__ = ["ConfigError", "P2PActorError", "ProtocolError", "__version__"]

try:
    __version__ = version("p2pactor")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"
