"""Several nodes in one trio run, on in-memory transports: for runtime tests.

``open_cluster("a", "b")`` starts one node per name (with its operator surface:
metrics, and the dashboard or metrics server its config asks for), each with an
:class:`EmbeddedCache` parent (or, with ``lent=True``, a cache the test lends
through ``node.serve_parent``), and records every actor each node creates so
tests can compare live states with replayed logs.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs

from p2pactor.core.fold import fold
from p2pactor.core.ids import ActorId
from p2pactor.runtime.actor import RequestActor
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.log import Durability, EventLog
from p2pactor.runtime.node import Node, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.surface.attach import OperatorSurface, open_operator_surface
from p2pactor.testing import MemoryDataPlane, MemoryNetwork

BLOCK_LEN = 64
NUM_BLOCKS = 32


def key(i: int) -> bytes:
    """A 36-byte offload key."""
    return i.to_bytes(32, "big") + b"\x00\x00\x00\x00"


def block_bytes(k: bytes) -> bytes:
    """Deterministic contents for the block of key ``k``."""
    return hashlib.sha256(k).digest() * (BLOCK_LEN // 32)


@attrs.define
class Member:
    """One node of a cluster and what the test needs next to it."""

    name: str
    node: Node
    cache: EmbeddedCache
    log: EventLog
    actors: list[RequestActor]
    surface: OperatorSurface

    @property
    def id(self) -> str:
        return self.node.node_id

    def store(self, *keys: bytes) -> None:
        """The engine computed these blocks."""
        for k in keys:
            self.cache.store(k, block_bytes(k))

    def replayed_states(self) -> dict[ActorId, Any]:
        """Every actor's state rebuilt from this node's log."""
        by_actor: dict[ActorId, list[Any]] = {}
        for event in self.log.recent():
            by_actor.setdefault(event.actor, []).append(event)
        return {actor: fold(events) for actor, events in by_actor.items()}

    def live_states(self) -> dict[ActorId, Any]:
        """Every actor's state as the node had it."""
        return {a.id: a.state for a in self.actors}


@attrs.define
class Cluster:
    """The nodes, and the in-memory network and data plane between them."""

    network: MemoryNetwork
    plane: MemoryDataPlane
    members: dict[str, Member]

    def __getitem__(self, name: str) -> Member:
        return self.members[name]


def node_id(name: str) -> str:
    """The id of the node called ``name``."""
    return f"{name}:5710"


@asynccontextmanager
async def open_cluster(
    *names: str,
    lent: Iterable[str] = (),
    log_dir: Path | None = None,
    per_node: Mapping[str, Mapping[str, Any]] | None = None,
    **config: Any,
) -> AsyncIterator[Cluster]:
    """Start one node per name; nodes named in ``lent`` get no parent of their own.

    With ``log_dir``, each node also writes its log to ``log_dir/<name>.p2plog``.
    ``per_node`` adds config fields for some nodes (by name) over ``config``.
    """
    network = MemoryNetwork()
    plane = MemoryDataPlane()
    cluster = Cluster(network, plane, {})
    lent = set(lent)
    async with AsyncExitStack() as stack:
        for name in names:
            own = (per_node or {}).get(name, {})
            settings = {"num_blocks": NUM_BLOCKS, "block_len": BLOCK_LEN, **config, **own}
            cfg = NodeConfig(host=name, port=5710, **settings)
            cache = EmbeddedCache(cfg.num_blocks, cfg.block_len)
            path = None if log_dir is None else log_dir / f"{name}.p2plog"
            event_log = EventLog(
                cfg.node_id, keep=None, path=path, durability=Durability.every_event()
            )
            node = await stack.enter_async_context(
                open_node(
                    cfg,
                    control=network.transport(cfg.node_id),
                    data=plane.transport(cache.memory, cfg.block_len),
                    parent=None if name in lent else cache,
                    event_log=event_log,
                )
            )
            surface = await stack.enter_async_context(open_operator_surface(node))
            actors: list[RequestActor] = []
            node.watch_actors(actors.append)
            cluster.members[name] = Member(name, node, cache, event_log, actors, surface)
        yield cluster
    # Every end-to-end test checks the design's central promise on the way out:
    # replaying each node's log rebuilds exactly the states its actors ended in.
    for member in cluster.members.values():
        assert member.replayed_states() == member.live_states(), member.name
