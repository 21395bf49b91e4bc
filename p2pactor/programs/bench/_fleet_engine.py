"""One engine of the fleet benchmark: vLLM's own offloading stack, stepped as vLLM steps it.

:class:`FleetEngine` is one engine's :class:`~p2pactor.programs.vllmstack.Stack`
(vLLM's ``TieringOffloadingManager`` from ``get_manager()``: its CPU tier with
vLLM's LRU, its tier-poll thread, the P2P tier, p2pactor's or vLLM's own, from
its ``secondary_tiers`` entry) driven by a
:class:`~p2pactor.programs.vllmstack.StackEngine` (the calls of vLLM's
connector scheduler: a request's keys looked up in order, past a RETRY, up to
the first MISS, every step until the scan decides; the hit run loaded from the
CPU tier, what a P2P tier promoted into it included; the rest computed and
stored, and cascaded to the tiers by vLLM). Nobody calls ``touch`` (vLLM 0.33's
scheduler never does). Every computed chunk holds its key's bytes, and every
chunk loaded is checked against them. :func:`build_fleet` builds an arm's engines.
"""

from __future__ import annotations

import os
import random
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._fleet_workload import Turn
from p2pactor.programs.vllmstack import (
    Phase,
    Stack,
    StackEngine,
    StackOptions,
    StackRequest,
    build_stack,
    tier_entry,
)


@dataclass(eq=False)
class FleetRequest:
    """A turn on its engine, and what it saw.

    Attributes:
        turn: The workload's request.
        req: The engine's request (its scans, loads, steps).
        auto: It names no source, on an engine whose tier finds one.
    """

    turn: Turn
    req: StackRequest
    auto: bool = False

    @property
    def claimed(self) -> bool | None:
        """Auto arms: whether a peer claimed the first key the tier was asked (None: not auto).

        What the tier itself decided (its state on the request): a request
        whose first key nobody claimed is a MISS at once.
        """
        if not self.auto:
            return None
        from p2pactor.adapters._vllm_auto import Auto  # noqa: PLC0415 - p2pactor's tier only

        state = self.req.ctx.get_state(Auto)
        return state is not None and bool(state.keys)

    @property
    def ctx(self) -> Any:
        """The request's ``ReqContext`` (vLLM's)."""
        return self.req.ctx

    @property
    def done(self) -> bool:
        """Whether its compute ran (its stores may still be in flight)."""
        return self.req.finished >= 0


class FleetEngine:
    """One engine: its stack, its scheduler, its requests, its counts."""

    def __init__(self, index: int, stack: Stack, port: int, *, p2p: bool) -> None:
        self.index = index
        self.stack = stack
        self.engine = StackEngine(stack, name=f"engine-{index}")
        self.port = port
        self.p2p = p2p
        self.requests: list[FleetRequest] = []
        self.counts: Counter[str] = Counter()

    @property
    def tier(self) -> Any:
        """The P2P tier (None: this engine has none)."""
        return self.stack.tier if self.p2p else None

    @property
    def ours(self) -> bool:
        """Whether its tier is p2pactor's."""
        return self.p2p and hasattr(self.stack.tier, "node")

    def admit(self, turn: Turn, req_id: str, params: dict[str, Any] | None) -> FleetRequest:
        """VLLM's ``add_request``: the tiers hear of it; it is looked up from the next schedule."""
        auto = self.ours and params is None and self.stack.tier.node.shares_summaries
        req = self.engine.add(req_id, turn.keys, turn.reply, params)
        fleet = FleetRequest(turn, req, auto)
        self.requests.append(fleet)
        return fleet

    def wants_step(self) -> bool:
        """Whether vLLM's engine core would step now."""
        return self.engine.wants_step()

    def begin(self) -> None:
        """The step's schedule (lookups, loads, stores, ``on_schedule_end``)."""
        self.engine.begin()

    def end(self) -> list[FleetRequest]:
        """The worker and the step's output; the requests whose compute ran this step."""
        ran = [r for r in self.requests if r.req.phase is Phase.RUNNING]
        self.engine.end()
        return ran

    def hung(self, steps: int) -> list[FleetRequest]:
        """Requests still waiting after ``steps`` scans deferred for a tier's answer."""
        return [r for r in self.requests if r.req.phase is Phase.WAITING and r.req.waited > steps]

    def prefix(self, keys: tuple[bytes, ...]) -> int:
        """How many of ``keys``, from the first, its CPU tier holds now (the oracle reads it)."""
        return self.engine.prefix(keys)

    # --- the end -----------------------------------------------------------------

    def jobs_left(self) -> int:
        """Transfer jobs vLLM's manager still tracks (pins, cascades, promotions)."""
        return len(self.stack.manager._jobs)

    def open_left(self) -> int:
        """Requests open in vLLM's manager that are not this engine's (a peer's lookups)."""
        mine = {r.req.req_id for r in self.requests}
        return sum(1 for req_id in self.stack.manager._req_state if req_id not in mine)

    def settled(self) -> bool:
        """Every request done, nothing pinned or loading, no peer's request open.

        vLLM's own tier says it has pending work for as long as it lives: for
        it, settled is what vLLM's manager tracks.
        """
        if self.engine.busy:
            return False
        with self.stack.lock:
            quiet = not self.jobs_left() and not self.open_left()
        return quiet and not (self.ours and self.stack.tier.has_pending_work())

    def poll(self) -> None:
        """A step with no request of its own, if vLLM's engine core would take one."""
        if self.engine.wants_step():
            self.engine.step()


def _kinds(arm: str, n: int) -> list[str]:
    if arm == "none":
        return ["none"] * n
    if arm == "mixed":
        return ["ours" if i % 2 == 0 else "stock" for i in range(n)]
    return ["ours"] * n


_PORTS = random.Random()  # noqa: S311 - spreads the ports, no secret


def _ports(n: int) -> list[int]:
    """``n`` ports free now, below the ephemeral range (not reused as source ports)."""
    ports: list[int] = []
    while len(ports) < n:
        port = _PORTS.randrange(20_000, 32_000)
        with socket.socket() as s:
            try:
                s.bind((shared.HOST, port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def build_fleet(arm: str, n: int, capacity: int, chunk_bytes: int) -> list[FleetEngine]:
    """The engines of ``arm``'s fleet of ``n``, each on a free port, tiers of ``capacity``."""
    kinds = _kinds(arm, n)
    ports = _ports(n)
    ids = [f"{shared.HOST}:{p}" for p in ports]
    summaries = arm in ("auto", "mixed", "silent", "hostile")
    engines: list[FleetEngine] = []
    try:
        for i, kind in enumerate(kinds):
            tiers = []
            if kind == "ours":
                seeds = [p for j, p in enumerate(ids) if j != i] if summaries else []
                shares = summaries and not (arm == "silent" and i == 0)
                entry = tier_entry(
                    "ours", shared.HOST, ports[i], seed_peers=seeds, summaries=shares
                )
                tiers = [entry]
            elif kind == "stock":
                tiers = [tier_entry("stock", shared.HOST, ports[i])]
            options = StackOptions(
                tiers=tiers,
                num_chunks=capacity,
                chunk_bytes=chunk_bytes,
                engine_id=f"p2pactor-fleet-{os.getpid()}-{arm}-{i}",
            )
            engines.append(FleetEngine(i, build_stack(options), ports[i], p2p=kind != "none"))
    except BaseException:
        for e in engines:
            e.stack.shutdown()
        raise
    return engines
