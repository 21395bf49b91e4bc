"""p2pactor: peer-to-peer KV-cache sharing for LLM inference engines.

Every engine ("node") asks peers which KV blocks they hold, pulls the hits over
NIXL, and serves its own blocks to others. Each request is an actor that reduces
an immutable event log into typed state; see ``docs/design.md``.

Import what you use from here::

    from p2pactor import NodeConfig, open_node, open_zmq_transport, open_nixl_transport

Everything a user needs is in this namespace; the modules behind it are the
implementation, free to move between releases. Three namespaces stay separate:
``p2pactor.core`` (the sans-IO core: states, ``step``/``evolve``, ``fold``; its
``events``, ``inputs`` and ``effects`` modules are the vocabulary),
``p2pactor.testing`` (in-memory transports with fault injection, for your tests)
and ``p2pactor.adapters.vllm`` (vLLM's tier entry point, which imports vLLM).

Layers, imports pointing downward only:

* ``p2pactor.core`` and ``p2pactor.core.protocol``: the pure core (no I/O, no clock).
* the trio runtime (actors, sessions, the node, the event log).
* ``p2pactor.adapters``: ZeroMQ, NIXL and vLLM.
* the operator surface (metrics, status, the timeline), attached from outside.

The names below load on first use, so that importing the pure core (or this
package for its errors) does not pull in trio, pyzmq or NIXL.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from p2pactor.errors import (
    ConfigError,
    DataPlaneError,
    EventFormatError,
    FrameTooLarge,
    InvalidField,
    LogError,
    LogFormatError,
    MalformedFrame,
    P2PActorError,
    ProtocolError,
    ReplayError,
    UnknownMessageType,
)

if TYPE_CHECKING:  # what the table below loads, spelled out for type checkers
    from p2pactor.adapters.nixl import NixlOptions, open_nixl_transport
    from p2pactor.adapters.zmq import ZmqOptions, generate_keypair, open_zmq_transport
    from p2pactor.core.fold import fold
    from p2pactor.core.inputs import LookupResult
    from p2pactor.core.protocol import Limits
    from p2pactor.core.timings import Timings
    from p2pactor.runtime.config import DEFAULT_HASH_SEED, NodeConfig, fingerprint_of
    from p2pactor.runtime.keys import CurveSecurity
    from p2pactor.runtime.log import Durability, EventLog
    from p2pactor.runtime.logread import read_log
    from p2pactor.runtime.node import FetchResult, LoadResult, Node, open_node
    from p2pactor.runtime.parent import CacheFull, EmbeddedCache, Parent
    from p2pactor.runtime.quotas import PeerQuotas
    from p2pactor.runtime.samples import block_bytes, chain_keys, preload_keys
    from p2pactor.runtime.transport import TransferError
    from p2pactor.surface.attach import OperatorSurface, open_operator_surface
    from p2pactor.surface.logsetup import JsonFormatter, configure_logging

__all__ = [
    "DEFAULT_HASH_SEED",
    "CacheFull",
    "ConfigError",
    "CurveSecurity",
    "DataPlaneError",
    "Durability",
    "EmbeddedCache",
    "EventFormatError",
    "EventLog",
    "FetchResult",
    "FrameTooLarge",
    "InvalidField",
    "JsonFormatter",
    "Limits",
    "LoadResult",
    "LogError",
    "LogFormatError",
    "LookupResult",
    "MalformedFrame",
    "NixlOptions",
    "Node",
    "NodeConfig",
    "OperatorSurface",
    "P2PActorError",
    "Parent",
    "PeerQuotas",
    "ProtocolError",
    "ReplayError",
    "Timings",
    "TransferError",
    "UnknownMessageType",
    "ZmqOptions",
    "__version__",
    "block_bytes",
    "chain_keys",
    "configure_logging",
    "fingerprint_of",
    "fold",
    "generate_keypair",
    "open_nixl_transport",
    "open_node",
    "open_operator_surface",
    "open_zmq_transport",
    "preload_keys",
    "read_log",
]

# Where each lazily loaded name lives; tests/test_public.py checks that it
# agrees with the imports above and with ``__all__``.
_LAZY = {
    name: module
    for module, names in {
        "p2pactor.adapters.nixl": ("NixlOptions", "open_nixl_transport"),
        "p2pactor.adapters.zmq": ("ZmqOptions", "generate_keypair", "open_zmq_transport"),
        "p2pactor.runtime.config": ("DEFAULT_HASH_SEED", "NodeConfig", "fingerprint_of"),
        "p2pactor.core.fold": ("fold",),
        "p2pactor.core.inputs": ("LookupResult",),
        "p2pactor.core.timings": ("Timings",),
        "p2pactor.runtime.keys": ("CurveSecurity",),
        "p2pactor.runtime.log": ("Durability", "EventLog"),
        "p2pactor.runtime.logread": ("read_log",),
        "p2pactor.surface.logsetup": ("JsonFormatter", "configure_logging"),
        "p2pactor.runtime.node": ("FetchResult", "LoadResult", "Node", "open_node"),
        "p2pactor.runtime.parent": ("CacheFull", "EmbeddedCache", "Parent"),
        "p2pactor.core.protocol": ("Limits",),
        "p2pactor.runtime.quotas": ("PeerQuotas",),
        "p2pactor.runtime.samples": ("block_bytes", "chain_keys", "preload_keys"),
        "p2pactor.surface.attach": ("OperatorSurface", "open_operator_surface"),
        "p2pactor.runtime.transport": ("TransferError",),
    }.items()
    for name in names
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pactor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


try:
    __version__ = version("p2pactor")
except PackageNotFoundError:  # pragma: no cover - running from a bare checkout
    __version__ = "0+unknown"
