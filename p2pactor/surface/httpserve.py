"""A node's own HTTP routes, ``GET /metrics`` and ``GET /status``, and the metrics-only server.

Both routes are answered by the dashboard's server when the dashboard is on
(:mod:`p2pactor.surface.timeline.server` hands them to :func:`answer`), and otherwise by
the small server of :func:`open_metrics_server` (``NodeConfig.metrics_port``),
which answers nothing else.

Who may ask (``docs/metrics.md``, "Who may scrape"):

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

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Final, Protocol
from urllib.parse import urlsplit

import trio

from p2pactor.surface.metrics import CONTENT_TYPE
from p2pactor.surface.timeline.http import HttpRequest, forbidden, read_request, send_response

__all__ = ["NODE_PATHS", "MetricsServer", "Served", "answer", "open_metrics_server", "refusal"]

log = logging.getLogger("p2pactor.http")

NODE_PATHS: Final = frozenset({"/metrics", "/status"})
"""The paths :func:`answer` serves."""


class Served(Protocol):
    """What these routes show of a node (its operator surface is one)."""

    @property
    def node_id(self) -> str:
        """The node's id."""
        ...

    def exposition(self) -> bytes:
        """Its metrics in Prometheus' text format."""
        ...

    def status(self) -> dict[str, Any]:
        """Its status document (``docs/status.md``)."""
        ...


_HEAD_TIMEOUT_S: Final = 10.0


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def refusal(request: HttpRequest, bound_host: str) -> str | None:
    """Why ``request`` for ``/metrics`` or ``/status`` must get a 403, or None.

    See the module docstring for the rule.
    """
    problem = forbidden(request, bound_host)  # the Host rule (and websocket origins)
    if problem is not None:
        return problem
    origin = request.headers.get("origin")
    if origin is None:
        return None
    origin_host = (urlsplit(origin).hostname or "").lower()
    host = (urlsplit(f"//{request.headers.get('host', '')}").hostname or "").lower()
    if origin_host != host or not origin_host:
        return f"a page from {origin!r} may not read this node's {request.path}"
    return None


async def answer(
    stream: trio.abc.SendStream, request: HttpRequest, node: Served, bound_host: str
) -> None:
    """Answer one request for a path in :data:`NODE_PATHS` on ``stream``."""
    problem = refusal(request, bound_host)
    if problem is not None:
        await send_response(stream, 403, problem.encode() + b"\n")
        return
    if request.method not in ("GET", "HEAD"):
        await send_response(stream, 405, b"only GET\n", headers=[("Allow", "GET, HEAD")])
        return
    head_only = request.method == "HEAD"
    if request.path == "/metrics":
        await send_response(stream, 200, node.exposition(), CONTENT_TYPE, head_only=head_only)
        return
    body = json.dumps(node.status()).encode() + b"\n"
    await send_response(stream, 200, body, "application/json", head_only=head_only)


class MetricsServer:
    """A running metrics-only server; create it with :func:`open_metrics_server`.

    Attributes:
        host: The address it is bound to.
        port: The port it is bound to.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port

    def __repr__(self) -> str:
        return f"<MetricsServer {self.url}>"

    @property
    def url(self) -> str:
        """``http://HOST:PORT/``."""
        return f"http://{_authority(self.host, self.port)}/"

    @property
    def metrics_url(self) -> str:
        """``http://HOST:PORT/metrics``: what Prometheus scrapes."""
        return self.url + "metrics"

    @property
    def status_url(self) -> str:
        """``http://HOST:PORT/status``."""
        return self.url + "status"


async def _handle(stream: trio.SocketStream, node: Served, bound_host: str) -> None:
    """Serve one connection: one response, then close. Never raises (it runs in the node)."""
    try:
        request: HttpRequest | None = None
        with trio.move_on_after(_HEAD_TIMEOUT_S):
            request = await read_request(stream)
        if request is None:
            return  # not HTTP, too big or too slow
        if request.path in NODE_PATHS:
            await answer(stream, request, node, bound_host)
        elif request.method not in ("GET", "HEAD"):
            await send_response(stream, 405, b"only GET\n", headers=[("Allow", "GET, HEAD")])
        else:
            await send_response(
                stream, 404, f"no page at {request.path}: try /metrics or /status\n".encode()
            )
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the client went away
    except Exception:
        log.exception(
            "the metrics server failed on a connection; it goes on (a bug in p2pactor: "
            "please report it with this traceback)"
        )
    finally:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await stream.aclose()


@asynccontextmanager
async def open_metrics_server(
    node: Served, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[MetricsServer]:
    """Serve ``node``'s ``/metrics`` and ``/status`` (and nothing else) until the block exits.

    Args:
        node: The node.
        host: The address to bind; anything but loopback is an explicit choice
            (see the module docstring for who may then ask).
        port: The port; 0 picks a free one (:attr:`MetricsServer.port`).

    Raises:
        OSError: The address can't be bound (the port is taken, say).
    """
    listeners = await trio.open_tcp_listeners(port, host=host)
    if port == 0 and len(listeners) > 1:
        # One name, several addresses: each would get its own ephemeral port.
        for extra in listeners[1:]:
            await extra.aclose()
        listeners = listeners[:1]
    bound = listeners[0].socket.getsockname()[1]

    async def handler(stream: trio.SocketStream) -> None:
        await _handle(stream, node, host)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handler, listeners)
        server = MetricsServer(host, bound)
        log.info(
            "metrics of %s at %s", node.node_id, server.metrics_url, extra={"node": node.node_id}
        )
        yield server
        nursery.cancel_scope.cancel()
