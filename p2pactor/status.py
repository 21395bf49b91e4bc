"""A node's status as JSON: what ``GET /status`` answers and ``p2pactor status`` prints."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pactor.node import Node

__all__ = ["node_status"]


def node_status(node: Node) -> dict[str, Any]:
    """The node's status, JSON-serialisable (see docs/status.md)."""
    return {"node_id": node.node_id}
