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

from p2pactor import errors
from p2pactor.errors import *  # noqa: F403 - errors.__all__ names them

if TYPE_CHECKING:  # what the table below loads, spelled out for type checkers
    from p2pactor.adapters.nixl import NixlOptions as NixlOptions
    from p2pactor.adapters.nixl import open_nixl_transport as open_nixl_transport
    from p2pactor.adapters.zmq import ZmqOptions as ZmqOptions
    from p2pactor.adapters.zmq import generate_keypair as generate_keypair
    from p2pactor.adapters.zmq import open_zmq_transport as open_zmq_transport
    from p2pactor.core.fold import fold as fold
    from p2pactor.core.inputs import LookupResult as LookupResult
    from p2pactor.core.protocol import Limits as Limits
    from p2pactor.core.timings import Timings as Timings
    from p2pactor.runtime.config import DEFAULT_HASH_SEED as DEFAULT_HASH_SEED
    from p2pactor.runtime.config import NodeConfig as NodeConfig
    from p2pactor.runtime.config import fingerprint_of as fingerprint_of
    from p2pactor.runtime.engine import LoadResult as LoadResult
    from p2pactor.runtime.keys import CurveSecurity as CurveSecurity
    from p2pactor.runtime.log import Durability as Durability
    from p2pactor.runtime.log import EventLog as EventLog
    from p2pactor.runtime.logread import read_log as read_log
    from p2pactor.runtime.node import FetchResult as FetchResult
    from p2pactor.runtime.node import Node as Node
    from p2pactor.runtime.node import open_node as open_node
    from p2pactor.runtime.parent import CacheFull as CacheFull
    from p2pactor.runtime.parent import EmbeddedCache as EmbeddedCache
    from p2pactor.runtime.parent import Parent as Parent
    from p2pactor.runtime.quotas import PeerQuotas as PeerQuotas
    from p2pactor.runtime.samples import block_bytes as block_bytes
    from p2pactor.runtime.samples import chain_keys as chain_keys
    from p2pactor.runtime.samples import preload_keys as preload_keys
    from p2pactor.runtime.transport import TransferError as TransferError
    from p2pactor.surface.attach import OperatorSurface as OperatorSurface
    from p2pactor.surface.attach import open_operator_surface as open_operator_surface
    from p2pactor.surface.logsetup import JsonFormatter as JsonFormatter
    from p2pactor.surface.logsetup import configure_logging as configure_logging

# Where each lazily loaded name lives; tests/test_public.py checks that it
# agrees with the imports above.
_LAZY = {
    name: module
    for module, names in {
        "p2pactor.adapters.nixl": ("NixlOptions", "open_nixl_transport"),
        "p2pactor.adapters.zmq": ("ZmqOptions", "generate_keypair", "open_zmq_transport"),
        "p2pactor.core.fold": ("fold",),
        "p2pactor.core.inputs": ("LookupResult",),
        "p2pactor.core.protocol": ("Limits",),
        "p2pactor.core.timings": ("Timings",),
        "p2pactor.runtime.config": ("DEFAULT_HASH_SEED", "NodeConfig", "fingerprint_of"),
        "p2pactor.runtime.keys": ("CurveSecurity",),
        "p2pactor.runtime.log": ("Durability", "EventLog"),
        "p2pactor.runtime.logread": ("read_log",),
        "p2pactor.runtime.engine": ("LoadResult",),
        "p2pactor.runtime.node": ("FetchResult", "Node", "open_node"),
        "p2pactor.runtime.parent": ("CacheFull", "EmbeddedCache", "Parent"),
        "p2pactor.runtime.quotas": ("PeerQuotas",),
        "p2pactor.runtime.samples": ("block_bytes", "chain_keys", "preload_keys"),
        "p2pactor.runtime.transport": ("TransferError",),
        "p2pactor.surface.attach": ("OperatorSurface", "open_operator_surface"),
        "p2pactor.surface.logsetup": ("JsonFormatter", "configure_logging"),
    }.items()
    for name in names
}
__all__ = list(_LAZY)  # what the table loads, the errors and the version below
__all__ += errors.__all__
__all__ += ["__version__"]


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
