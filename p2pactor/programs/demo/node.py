"""One node of the demo, as its own OS process.

It opens real transports (ZeroMQ on loopback, NIXL over a torch block pool),
fills its embedded cache with the conversations it served, and talks to the
orchestrator over stdin/stdout: it says ``ready`` with its id, waits for ``go``
with its peers' ids, opens a session with every peer (and, for requests that
name no source, waits for every peer's summary; that setup is timed apart),
runs its requests (find the source or use the named one, lookup, fetch the hit
prefix, verify every byte), reports progress and results, and keeps serving
peers until ``stop``. Lines for the orchestrator start with ``@p2pactor``;
anything else on stdout (NIXL's own logging, say) is ignored.

Run by ``p2pactor demo``; not meant to be started by hand.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import attrs
import trio
import trio.lowlevel

from p2pactor.core.inputs import LookupResult
from p2pactor.programs.demo.workload import DemoPlan, Expect, Request, requests_of
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.log import Durability, EventLog
from p2pactor.runtime.node import Node, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.runtime.quotas import PeerQuotas
from p2pactor.runtime.samples import block_bytes
from p2pactor.surface.attach import open_operator_surface
from p2pactor.surface.logsetup import configure_logging

__all__ = ["PREFIX", "main", "run_node"]

PREFIX = "@p2pactor "
"""Marks the lines the orchestrator reads."""

METRICS_PORT_ENV = "P2PACTOR_METRICS_PORT"
"""The node's metrics-only port (``NodeConfig.metrics_port``), set by the orchestrator."""
METRICS_HOST_ENV = "P2PACTOR_METRICS_HOST"
"""The address it binds (``NodeConfig.metrics_host``)."""


def _metrics_port(dashboard: tuple[str, int] | None) -> int | None:
    """The node's metrics-only port: none with a dashboard (it serves them), else the env's."""
    raw = os.environ.get(METRICS_PORT_ENV)
    return None if dashboard is not None or not raw else int(raw)


def say(**message: Any) -> None:
    """Tell the orchestrator something (one JSON line on stdout)."""
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


@attrs.define
class Outcome:
    """What one request saw."""

    request: str
    source: str | None = None
    """The peer asked: named, or chosen from the summaries (None: nobody claimed it)."""
    found: bool = False
    """It named no source and found the one that served its conversation."""
    lookup_s: float = 0.0
    fetch_s: float = 0.0
    hits: int = 0
    misses: int = 0
    pending: int = 0
    expired: int = 0
    fetched: int = 0
    verified: int = 0
    failures: list[str] = attrs.field(factory=list)


async def _commands(
    stdin: trio.abc.ReceiveStream, out: trio.MemorySendChannel[dict[str, Any]]
) -> None:
    buffer = b""
    async with out:
        async for chunk in stdin:
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    await out.send(json.loads(line))


def _fill(cache: EmbeddedCache, plan: DemoPlan, index: int) -> tuple[list[bytes], list[bytes]]:
    """Store the conversations this node served; return (pending, never-stored) keys."""
    pending: list[bytes] = []
    expiring: list[bytes] = []
    for request in requests_of(plan):
        if request.producer != index:
            continue
        for k, e in zip(request.keys, request.expect, strict=True):
            if e is Expect.HIT:
                cache.store(k, block_bytes(k, plan.block_len))
            elif e is Expect.PENDING:
                cache.mark_pending(k)
                pending.append(k)
            elif e is Expect.EXPIRE:
                cache.mark_pending(k)
                expiring.append(k)
    return pending, expiring


async def _open_sessions(node: Node, peers: list[str], *, summaries: bool) -> bool:
    """Open a session with each of ``peers`` and wait until all are ready.

    With ``summaries``, also until each peer's whole summary has arrived: a
    request naming no source can then find any block held before the run.
    A real node does this once, at start (its seed peers); the demo times it
    apart, so that the lookup latencies it reports are lookups, not handshakes.
    """
    for peer in peers:
        node.prepare(peer)

    def ready(peer: str) -> bool:
        session = node.peers.session(peer)
        if session is None or not session.ready:
            return False
        position = node.directory.index.position(peer)
        return not summaries or (position is not None and position[2])

    # No event says "every session ready and synced"; a 5 ms poll for the
    # few milliseconds that takes costs nothing.
    with trio.move_on_after(node.config.handshake_timeout):
        while not all(ready(peer) for peer in peers):  # noqa: ASYNC110
            await trio.sleep(0.005)
        return True
    return False


async def _run_request(
    node: Node, cache: EmbeddedCache, plan: DemoPlan, producer: str, request: Request
) -> Outcome:
    out = Outcome(request.kv_request_id)
    start = trio.current_time()
    if plan.named:
        peer: str | None = producer
        answers = await node.lookup(producer, request.kv_request_id, request.keys)
    else:
        located = await node.locate(request.kv_request_id, request.keys)
        peer, answers = located.peer, list(located.answers)
        out.found = peer == producer
    out.source = peer
    out.lookup_s = trio.current_time() - start
    for k, expect, answer in zip(request.keys, request.expect, answers, strict=True):
        got_hit = answer is LookupResult.HIT
        if expect is Expect.PENDING:
            out.pending += 1
        elif expect is Expect.EXPIRE:
            out.expired += 1
        out.hits += got_hit
        out.misses += not got_hit
        wanted = expect in (Expect.HIT, Expect.PENDING)
        if got_hit != wanted:
            out.failures.append(f"{k[:4].hex()} answered {answer.value}, expected {expect.value}")
    prefix = 0
    while prefix < len(answers) and answers[prefix] is LookupResult.HIT:
        prefix += 1
    keys = list(request.keys[:prefix])
    if keys and peer is not None:
        blocks = cache.allocate(len(keys))
        start = trio.current_time()
        result = await node.fetch(peer, request.kv_request_id, keys, blocks)
        out.fetch_s = trio.current_time() - start
        if not result.success:
            out.failures.append(f"fetch failed: {result.reason}")
            cache.free(blocks)
        else:
            out.fetched = len(keys)
            size = plan.block_len
            for k, block in zip(keys, blocks, strict=True):
                if bytes(cache.memory[block * size : (block + 1) * size]) == block_bytes(k, size):
                    out.verified += 1
                else:
                    out.failures.append(f"block {k[:4].hex()} arrived with the wrong bytes")
                cache.commit(k, block)
    node.finish(request.kv_request_id)
    return out


async def run_node(
    index: int, plan: DemoPlan, log_dir: str, dashboard: tuple[str, int] | None = None
) -> None:
    """Run demo node ``index`` until the orchestrator says stop.

    With ``dashboard`` (host, port), the node serves its live timeline there
    (``docs/timeline.md``).
    """
    import torch  # noqa: PLC0415 - only the demo's processes need torch loaded

    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.programs.demo.curve import node_curve  # noqa: PLC0415
    from p2pactor.runtime.keys import CurveSecurity  # noqa: PLC0415

    curve_setup = node_curve()  # p2pactor demo --curve: a fixed port, the key speaks for it
    curve = (
        None
        if curve_setup is None
        else CurveSecurity.load(curve_setup.secret_key, curve_setup.trusted)
    )
    listen = 0 if curve_setup is None else curve_setup.port
    num_blocks = plan.pool_blocks()
    pool = torch.zeros(num_blocks * plan.block_len, dtype=torch.uint8)
    cache = EmbeddedCache(num_blocks, plan.block_len, memory=pool.numpy().data)
    pending, _ = _fill(cache, plan, index)
    commands_send, commands = trio.open_memory_channel[dict[str, Any]](16)
    async with (
        open_zmq_transport(f"127.0.0.1:{listen}", port=listen, curve=curve) as control,
        open_nixl_transport(pool, plan.block_len, name=f"demo-{index}") as data,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_commands, trio.lowlevel.FdStream(os.dup(0)), commands_send)
        host, port = control.local_id.rsplit(":", 1)
        config = NodeConfig(
            host=host,
            port=int(port),
            num_blocks=num_blocks,
            block_len=plan.block_len,
            hash_seed=plan.hash_seed,
            # The pool is sized to the workload, not to a real tier: every
            # held block may be pinned at once by one honest peer here.
            quotas=PeerQuotas(pinned_blocks_fraction=1.0),
            handshake_timeout=plan.handshake_timeout,
            dashboard_host=dashboard[0] if dashboard else "127.0.0.1",
            dashboard_port=dashboard[1] if dashboard else None,
            # /metrics and /status: on the dashboard's port, else on their own
            # (the orchestrator sets these per node; docs/metrics.md).
            metrics_port=_metrics_port(dashboard),
            metrics_host=os.environ.get(METRICS_HOST_ENV) or "127.0.0.1",
            curve_secret_key=None if curve_setup is None else curve_setup.secret_key,
            curve_trusted=None if curve_setup is None else curve_setup.trusted,
        )
        log = EventLog(
            config.node_id,
            path=os.path.join(log_dir, f"node-{index}.p2plog"),
            durability=Durability.interval(0.05),
            clock_origin=(time.time(), trio.current_time()),
            keep=0,
        )
        async with (
            open_node(config, control=control, data=data, parent=cache, event_log=log) as node,
            open_operator_surface(node) as surface,
        ):
            board = surface.dashboard
            say(
                event="ready",
                index=index,
                node_id=node.node_id,
                pid=os.getpid(),
                dashboard=None if board is None else {"page": board.url, "feed": board.events_url},
                http=surface.http_url,
            )
            go = await commands.receive()
            peers: list[str] = go["peers"]
            if board is not None and go.get("feeds"):
                board.set_page_feeds(go["feeds"])  # the bare page URL shows every node
            await trio.lowlevel.checkpoint()
            if board is not None and go.get("wait_for_page"):
                # A page that connects late would see finished lanes only; the
                # demo is for watching requests move through their phases.
                # The feed signals no subscriptions; polling at 20 Hz while
                # nothing else runs costs nothing.
                with trio.move_on_after(go["wait_for_page"]):
                    while (stats := board.stats()) is not None and stats.subscribers == 0:  # noqa: ASYNC110
                        await trio.sleep(0.05)
            pace = float(go.get("pace", 0.0))
            setup_started = trio.current_time()
            others = [p for i, p in enumerate(peers) if i != index]
            sessions_ready = await _open_sessions(node, others, summaries=not plan.named)
            setup_s = trio.current_time() - setup_started

            async def finish_pending() -> None:
                await trio.sleep(plan.pending_delay)
                for k in pending:
                    cache.store(k, block_bytes(k, plan.block_len))

            nursery.start_soon(finish_pending)
            mine = [r for r in requests_of(plan) if r.consumer == index]
            limiter = trio.CapacityLimiter(plan.concurrency)
            outcomes: list[Outcome] = []

            async def one(request: Request) -> None:
                async with limiter:
                    outcome = await _run_request(
                        node, cache, plan, peers[request.producer], request
                    )
                outcomes.append(outcome)
                say(event="progress", index=index, done=len(outcomes), total=len(mine))

            started = trio.current_time()
            async with trio.open_nursery() as requests:
                for i, request in enumerate(mine):
                    if pace and i:
                        await trio.sleep(pace)
                    requests.start_soon(one, request)
            elapsed = trio.current_time() - started
            say(
                event="done",
                index=index,
                elapsed=elapsed,
                setup_s=setup_s,
                sessions_ready=sessions_ready,
                outcomes=[attrs.asdict(o) for o in outcomes],
                pinned=cache.pinned(),
            )
            await commands.receive()  # stop: the others are done too
        # The node is closed: every pin released, every parent request closed.
        say(event="closed", index=index, held_jobs=len(cache.held_jobs()), open=len(cache.opened))
        nursery.cancel_scope.cancel()


def main() -> None:
    """Entry point: ``python -m p2pactor.programs.demo.node INDEX PLAN LOG_DIR [HOST:PORT]``."""
    index, plan_json, log_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    plan = DemoPlan(**json.loads(plan_json))
    configure_logging()  # P2PACTOR_LOG_FORMAT/LEVEL from the orchestrator; stderr only
    dashboard = None
    if len(sys.argv) > 4:
        host, port = sys.argv[4].rsplit(":", 1)
        dashboard = (host, int(port))
        # Ctrl-C in the terminal reaches the whole process group; it ends the
        # dashboard's linger, and the orchestrator then tells us to stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    trio.run(run_node, index, plan, log_dir, dashboard)


if __name__ == "__main__":
    main()
