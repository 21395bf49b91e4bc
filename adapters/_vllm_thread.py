"""The tier's p2pactor node, on a trio thread of its own beside vLLM's threads."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import trio

from p2pactor.adapters._vllm_api import hash_seed
from p2pactor.adapters._vllm_metrics import SERIES, STATS_INTERVAL_S
from p2pactor.errors import P2PActorError
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.node import Node, open_node
from p2pactor.surface.attach import OperatorSurface, open_operator_surface

log = logging.getLogger("p2pactor.vllm")

_START_TIMEOUT_S = 60.0


class NodeThread:
    """A p2pactor node on its own trio thread, started and stopped from vLLM's."""

    def __init__(self, config: NodeConfig, pool: memoryview, log_path: str | None) -> None:
        self.config = config
        self._pool = pool
        self._log_path = log_path
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.node: Node | None = None
        self.surface: OperatorSurface | None = None
        # metrics.totals(), published by the node's thread: engine threads
        # read it without waiting, and never read the node's state themselves.
        self.totals: dict[str, float] = {}
        self._thread = threading.Thread(target=self._main, name="p2pactor-node", daemon=True)

    def start(self) -> Node:
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            raise P2PActorError(f"the p2pactor node did not start within {_START_TIMEOUT_S:g} s")
        if self._error is not None:
            raise P2PActorError(
                f"the p2pactor node failed to start: {self._error}"
            ) from self._error
        assert self.node is not None
        return self.node

    def stop(self, timeout: float) -> None:
        if self._token is not None and self._stop is not None:
            with contextlib.suppress(trio.RunFinishedError):  # already stopped
                self._token.run_sync_soon(self._stop.set)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning(
                "the p2pactor node thread did not stop within %.0f s; it is left running "
                "(a peer or transfer that never ended: see the lines above)",
                timeout,
            )

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:
            self._error = exc
            log.exception(
                "the p2pactor node stopped with an error; the tier serves no more loads "
                "(restart the engine once the cause in this traceback is fixed)"
            )
        finally:
            self._ready.set()

    async def _run(self) -> None:
        from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
        from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415

        config = self.config
        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        event_log = EventLog(
            config.node_id,
            path=self._log_path,
            clock_origin=(time.time(), trio.current_time()),
            keep=10_000,
            overwrite=True,
        )
        async with (
            open_zmq_transport(
                config.node_id, bind_host=config.bind_host, port=config.port, curve=config.curve
            ) as control,
            open_nixl_transport(self._pool, config.block_len) as data,
            open_node(
                config, control=control, data=data, event_log=event_log, hash_seed=hash_seed
            ) as node,
            open_operator_surface(node) as surface,
        ):
            self.node = node
            self.surface = surface
            self._ready.set()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._publish_totals, surface)
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    async def _publish_totals(self, surface: OperatorSurface) -> None:
        """Publish the figures vLLM gets whenever they change (checked every 0.1 s)."""
        while True:
            try:
                totals = {k: v for k, v in surface.metrics.totals().items() if k in SERIES}
            except Exception:  # the tier serves on; only its figures in vLLM stop
                log.exception(
                    "p2pactor stopped reporting to vLLM's metrics: metrics.totals() "
                    "failed; the tier still works (report this as a p2pactor bug)"
                )
                return
            if totals != self.totals:
                self.totals = totals
            await trio.sleep(STATS_INTERVAL_S)
