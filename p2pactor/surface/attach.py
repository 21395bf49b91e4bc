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
``metrics_host:metrics_port``, which answers nothing else.

Who may ask for ``/metrics`` and ``/status`` (``docs/metrics.md``, "Who may scrape"):

* A server bound to a loopback address answers only requests whose ``Host``
  is a loopback name, as the dashboard does: a web page elsewhere must not
  reach it through a DNS name rebound to 127.0.0.1.
* Bound to any other address (an operator's explicit choice, so that
  Prometheus can scrape from another host), any ``Host`` is accepted.
* Either way, a request with an ``Origin`` (a browser's cross-origin fetch)
  from a host other than the one it addresses is refused, and no CORS header
  is ever sent: pages from other sites can't read a node's numbers.
  Prometheus sends no ``Origin``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import urlsplit

import trio

from p2pactor.surface.metrics import CONTENT_TYPE, NodeMetrics
from p2pactor.surface.status import node_status
from p2pactor.surface.timeline import TimelineServer, open_timeline_server
from p2pactor.surface.timeline.http import HttpRequest, forbidden, send_response
from p2pactor.surface.timeline.server import _listen
from p2pactor.surface.timeline.site import Site, authority

if TYPE_CHECKING:
    from p2pactor.runtime.node import Node

log = logging.getLogger("p2pactor.http")

_FROM_CONFIG: Any = object()

_NODE_PATHS: Final = frozenset({"/metrics", "/status"})


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
        return f"<OperatorSurface {self.node_id} {self.http_url or '(not served)'}>"

    @property
    def node_id(self) -> str:
        """The node's id."""
        return self.node.node_id

    @property
    def http_url(self) -> str | None:
        """``http://HOST:PORT/`` answering ``/metrics`` and ``/status``, or None when not served.

        The dashboard's port when it is on, else the metrics-only port.
        """
        server = self.dashboard or self.metrics_server
        return None if server is None else server.url

    def exposition(self) -> bytes:
        """Every metric in Prometheus' text format (``GET /metrics``)."""
        return self.metrics.exposition()

    def status(self) -> dict[str, Any]:
        """The node's status document (``GET /status``, ``docs/status.md``)."""
        url = None if self.dashboard is None else self.dashboard.url
        return node_status(self.node, totals=self.metrics.totals(), dashboard=url)

    async def _routes(
        self, stream: trio.SocketStream, request: HttpRequest, bound_host: str
    ) -> bool:
        """Answer a request for ``/metrics`` or ``/status``; False (nothing sent) for another path.

        ``bound_host`` is the address the server is bound to: a 403 for whom the
        module docstring's rule refuses.
        """
        if request.path not in _NODE_PATHS:
            return False
        problem = forbidden(request, bound_host)  # the Host rule (and websocket origins)
        origin = request.headers.get("origin")
        if problem is None and origin is not None:
            origin_host = (urlsplit(origin).hostname or "").lower()
            host = (urlsplit(f"//{request.headers.get('host', '')}").hostname or "").lower()
            if origin_host != host or not origin_host:
                problem = f"a page from {origin!r} may not read this node's {request.path}"
        head = request.method == "HEAD"
        if problem is not None:
            await send_response(stream, 403, problem.encode() + b"\n")
        elif not await _only_get(stream, request):
            return True
        elif request.path == "/metrics":
            await send_response(stream, 200, self.exposition(), CONTENT_TYPE, head_only=head)
        else:
            body = json.dumps(self.status()).encode() + b"\n"
            await send_response(stream, 200, body, "application/json", head_only=head)
        return True


class MetricsServer(Site):
    """A running metrics-only server: its surface's routes, 404 for any other page.

    Attributes:
        host: The address it is bound to.
        port: The port it is bound to.
    """

    def __init__(self, surface: OperatorSurface, bound_host: str, port: int) -> None:
        super().__init__(bound_host)
        self._surface = surface
        self.host = bound_host
        self.port = port

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``; Prometheus scrapes its ``metrics``."""
        return f"http://{authority(self.bound_host, self.port)}/"

    async def answer_node(self, stream: trio.SocketStream, request: HttpRequest) -> bool:
        """Answer every request: this server serves nothing of the dashboard's."""
        routed = await self._surface._routes(stream, request, self.bound_host)
        if not routed and await _only_get(stream, request):
            page = f"no page at {request.path}: try /metrics or /status\n"
            await send_response(stream, 404, page.encode())
        return True


async def _only_get(stream: trio.SocketStream, request: HttpRequest) -> bool:
    """Whether ``request`` is a GET or HEAD; a 405 answers any other method."""
    if request.method in ("GET", "HEAD"):
        return True
    await send_response(stream, 405, b"only GET\n", headers=[("Allow", "GET, HEAD")])
    return False


@asynccontextmanager
async def _metrics_server(
    surface: OperatorSurface, host: str, port: int
) -> AsyncIterator[MetricsServer]:
    """Serve ``surface``'s ``/metrics`` and ``/status`` (and nothing else) until the block exits.

    Raises:
        OSError: The address can't be bound (the port is taken, say).
    """
    listeners, bound = await _listen(host, port)
    server = MetricsServer(surface, host, bound)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, server.handle, listeners)
        node = surface.node_id
        log.info("metrics of %s at %smetrics", node, server.url, extra={"node": node})
        yield server
        nursery.cancel_scope.cancel()


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
    dashboard_host = config.dashboard_host if dashboard_host is _FROM_CONFIG else dashboard_host
    dashboard_port = config.dashboard_port if dashboard_port is _FROM_CONFIG else dashboard_port
    metrics_host = config.metrics_host if metrics_host is _FROM_CONFIG else metrics_host
    metrics_port = config.metrics_port if metrics_port is _FROM_CONFIG else metrics_port
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
                    _metrics_server(surface, metrics_host, metrics_port)
                )
            yield surface
    finally:
        surface.metrics.close()
