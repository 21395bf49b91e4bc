"""A node's operator surface: metrics, ``/status``, the live timeline, and their servers.

The runtime knows nothing of these. They attach from outside, reading the
node (:class:`p2pactor.runtime.node.Node`) and following its event streams,
never driving it, with one call that
``p2pactor serve``, the demo and the vLLM adapter all make::

    async with open_node(config, control=..., data=...) as node:
        async with open_operator_surface(node) as surface:
            surface.metrics.totals()   # counters, always on
            surface.http_url           # /metrics and /status, when served

What is served comes from the node's configuration unless given: the
dashboard (page, websocket feed, ``/metrics`` and ``/status`` on one port) at
``dashboard_host:dashboard_port``, and a metrics-only server at
``metrics_host:metrics_port``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from p2pactor.surface.httpserve import NODE_PATHS, MetricsServer, answer, open_metrics_server
from p2pactor.surface.metrics import NodeMetrics
from p2pactor.surface.status import node_status
from p2pactor.surface.timeline import TimelineServer, open_timeline_server
from p2pactor.surface.timeline.http import HttpRequest

if TYPE_CHECKING:
    from p2pactor.runtime.node import Node

_FROM_CONFIG: Any = object()


class OperatorSurface:
    """What operators see of one node. Open it with :func:`open_operator_surface`.

    Attributes:
        node: The node.
        metrics: Its Prometheus metrics (``docs/metrics.md``).
        dashboard: Its live timeline server, when served.
        metrics_server: Its metrics-only server, when served.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self.metrics = NodeMetrics(node)
        self.dashboard: TimelineServer | None = None
        self.metrics_server: MetricsServer | None = None

    def __repr__(self) -> str:
        return f"<OperatorSurface {self.node.node_id} {self.http_url or '(not served)'}>"

    @property
    def node_id(self) -> str:
        """The node's id."""
        return self.node.node_id

    @property
    def http_url(self) -> str | None:
        """``http://HOST:PORT/`` answering ``/metrics`` and ``/status``, or None when not served.

        The dashboard's port when it is on, else the metrics-only port.
        """
        if self.dashboard is not None:
            return self.dashboard.url
        if self.metrics_server is not None:
            return self.metrics_server.url
        return None

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format (``GET /metrics``)."""
        return self.metrics.exposition()

    def status(self) -> dict[str, Any]:
        """The node's status document (``GET /status``, ``docs/status.md``)."""
        url = None if self.dashboard is None else self.dashboard.url
        return node_status(self.node, totals=self.metrics.totals(), dashboard=url)

    async def _routes(self, stream: trio.SocketStream, request: HttpRequest, host: str) -> bool:
        if request.path not in NODE_PATHS:
            return False
        await answer(stream, request, self, host)
        return True


@asynccontextmanager
async def open_operator_surface(
    node: Node,
    *,
    dashboard_host: str = _FROM_CONFIG,
    dashboard_port: int | None = _FROM_CONFIG,
    metrics_host: str = _FROM_CONFIG,
    metrics_port: int | None = _FROM_CONFIG,
) -> AsyncIterator[OperatorSurface]:
    """Attach metrics (always) and the configured servers to ``node`` until the block exits.

    Each argument defaults to the node's configuration (``NodeConfig``'s field
    of the same name); a port of None serves nothing there. Open it inside
    the node's block: the dashboard closes first, having shown the node's
    last events.

    Raises:
        OSError: A port can't be bound.
    """
    config = node.config
    if dashboard_host is _FROM_CONFIG:
        dashboard_host = config.dashboard_host
    if dashboard_port is _FROM_CONFIG:
        dashboard_port = config.dashboard_port
    if metrics_host is _FROM_CONFIG:
        metrics_host = config.metrics_host
    if metrics_port is _FROM_CONFIG:
        metrics_port = config.metrics_port
    surface = OperatorSurface(node)
    try:
        async with AsyncExitStack() as servers:
            if dashboard_port is not None:
                surface.dashboard = await servers.enter_async_context(
                    open_timeline_server(
                        node, host=dashboard_host, port=dashboard_port, routes=surface._routes
                    )
                )
            if metrics_port is not None:
                surface.metrics_server = await servers.enter_async_context(
                    open_metrics_server(surface, metrics_host, metrics_port)
                )
            yield surface
    finally:
        surface.metrics.close()
