"""The fleet benchmark's process (``python -m p2pactor.programs.bench._fleet_run``).

Chat, then RAG fleets, in one process (one import of vLLM): per engine vLLM 0.33's own
offloading stack (:func:`~p2pactor.programs.vllmstack.build_stack`) with p2pactor's or
vLLM's P2P tier, driven by a :class:`~p2pactor.programs.vllmstack.StackEngine`, the
engines stepped in lockstep. The arms, on the same turns: ``none`` (no P2P tier),
``oracle`` (each request names the engine whose CPU tier holds its longest prefix),
``auto`` (the tiers find it by summaries), ``mixed`` (``auto``, every other engine on
vLLM's own tier). It says ``RESULT {fleet: {arm: [figures of each repeat]}}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._control_common import say, spread_ports
from p2pactor.programs.bench.fleet import (
    TOKENS_PER_BLOCK,
    Turn,
    chat_turns,
    fleet_of,
    plan,
    rag_turns,
    working_set,
)
from p2pactor.programs.vllmstack import (
    Phase,
    Stack,
    StackEngine,
    StackOptions,
    StackRequest,
    build_stack,
    tier_entry,
)

BLOCK_BYTES = 4096
"""Bytes per chunk (the figures count keys and tokens; the bytes are checked)."""
STEP_S, ADMIT, PER_ENGINE = 0.010, 4, 4
"""The forward pass; new requests per step over the fleet; requests in flight per engine."""
RUN_TIMEOUT_S = 600.0
HUNG_STEPS = 500
"""A request whose lookups took longer than this many steps (5 s at 10 ms) to decide hung."""


@dataclass(eq=False)
class Request:
    """A turn on its engine, and what it saw (``auto``: it names no source; its tier finds one)."""

    turn: Turn
    req: StackRequest
    auto: bool

    @property
    def claimed(self) -> bool | None:
        """Whether the tier found a peer claiming the first key (else MISS); None: not auto."""
        if not self.auto:
            return None
        from p2pactor.adapters._vllm_auto import Auto  # noqa: PLC0415 - p2pactor's tier only

        state = self.req.ctx.get_state(Auto)
        return state is not None and bool(state.keys)


@dataclass(eq=False)
class Engine:
    """One engine of a fleet: its stack, its scheduler, its requests (``kind``: its tier)."""

    index: int
    stack: Stack
    port: int
    kind: str
    engine: StackEngine = field(init=False)
    requests: list[Request] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.engine = StackEngine(self.stack, name=f"engine-{self.index}")
        self.node: Any = self.stack.tier.node if self.kind == "ours" else None
        """The node of its p2pactor tier (None: it has none)."""
        self.peer_id = f"{shared.HOST}:{self.port}"

    def left(self) -> tuple[int, int]:
        """What vLLM's manager still tracks: jobs (pins, cascades, promotions), peers' requests."""
        mine = {r.req.req_id for r in self.requests}
        m = self.stack.manager
        return len(m._jobs), sum(1 for req_id in m._req_state if req_id not in mine)

    def settled(self) -> bool:
        """Every request done, nothing pinned or loading, no peer's request open.

        vLLM's own tier has pending work as long as it lives: its manager says instead.
        """
        if self.engine.busy:
            return False
        with self.stack.lock:
            quiet = self.left() == (0, 0)
        return quiet and not (self.node is not None and self.stack.tier.has_pending_work())

    def poll(self) -> None:
        """A step with no request of its own, if vLLM's engine core would take one."""
        if self.engine.wants_step():
            self.engine.step()


def build_fleet(arm: str, n: int, capacity: int) -> list[Engine]:
    """The engines of ``arm``'s fleet of ``n``, each on a free port, tiers of ``capacity``."""
    kinds = {"none": ["none"] * n, "mixed": ["ours", "stock"] * n}.get(arm, ["ours"] * n)
    ports = spread_ports(n)
    summaries = arm in ("auto", "mixed")
    engines: list[Engine] = []
    try:
        for i, kind in enumerate(kinds[:n]):
            seeds = [f"{shared.HOST}:{p}" for j, p in enumerate(ports) if j != i]
            options = {"seed_peers": seeds if summaries else [], "summaries": summaries}
            options = options if kind == "ours" else {}
            tiers = [] if kind == "none" else [tier_entry(kind, shared.HOST, ports[i], **options)]
            stack = build_stack(
                StackOptions(
                    tiers=tiers,
                    num_chunks=capacity,
                    chunk_bytes=BLOCK_BYTES,
                    engine_id=f"p2pactor-fleet-{os.getpid()}-{arm}-{i}",
                )
            )
            engines.append(Engine(i, stack, ports[i], kind))
    except BaseException:
        for e in engines:
            e.stack.shutdown()
        raise
    return engines


def _wait(engines: Sequence[Engine], done: Callable[[], bool], what: str) -> None:
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > 60:
            raise RuntimeError(f"not within 60 s: {what}")
        for e in engines:
            e.poll()
        time.sleep(0.005)


def _synced(engines: Sequence[Engine]) -> bool:
    """Every p2pactor engine has every other's summary."""
    ours = [e for e in engines if e.node is not None and e.node.config.sources.share]
    for e in ours:
        index = e.node.directory.index
        for p in ours:
            position = index.position(p.peer_id) if p is not e else (0, 0, True)
            if position is None or not position[2]:
                return False
    return True


def _params(arm: str, engine: Engine, engines: Sequence[Engine], turn: Turn) -> Any:
    """The oracle's ``kv_transfer_params``: the engine whose CPU tier holds the longest prefix."""
    if arm != "oracle":
        return None
    held = {e.index: e.engine.prefix(turn.keys) for e in engines}
    best = max((e for e in engines if e is not engine), key=lambda e: held[e.index])
    if held[best.index] <= held[engine.index]:
        return None
    source = {"remote_host": shared.HOST, "remote_port": best.port}
    return {"remote_kv_source": {**source, "kv_request_id": f"{arm}-{turn.index}"}}


def _drive(arm: str, engines: Sequence[Engine], turns: Sequence[Turn]) -> float:
    """Run every turn to its end; the seconds it took."""
    pending = list(turns)
    done: dict[tuple[int, int], int] = {}  # (conversation, turn) -> the step it ended
    in_flight = [0] * len(engines)
    step = 0
    t0 = time.monotonic()

    def ended(e: Engine, r: Request) -> None:
        done[r.turn.conversation, r.turn.turn] = step
        in_flight[e.index] -= 1

    while len(done) < len(turns):
        if time.monotonic() - t0 > RUN_TIMEOUT_S:
            raise RuntimeError(f"{arm}: {len(done)}/{len(turns)} turns after {RUN_TIMEOUT_S:g} s")
        admitted = 0
        for turn in pending[:64]:
            if admitted == ADMIT:
                break
            last = done.get((turn.conversation, turn.turn - 1))
            ready = turn.turn == 0 or (last is not None and step >= last + turn.think_steps)
            if not ready or in_flight[turn.engine] >= PER_ENGINE:
                continue
            e = engines[turn.engine]
            params = _params(arm, e, engines, turn)
            auto = params is None and e.node is not None and e.node.config.sources.share
            req = e.engine.add(f"{arm}-req-{turn.index}", turn.keys, turn.reply, params)
            e.requests.append(Request(turn, req, auto))
            pending.remove(turn)
            in_flight[turn.engine] += 1
            admitted += 1
        stepping = [e for e in engines if e.engine.wants_step()]
        for e in stepping:
            e.engine.begin()
        time.sleep(STEP_S)  # the forward pass
        for e in stepping:
            ran = [r for r in e.requests if r.req.phase is Phase.RUNNING]
            e.engine.end()
            for r in ran:
                ended(e, r)
        for e in engines:  # the client gives up on a request that hung
            for r in e.requests:
                if r.req.phase is Phase.WAITING and r.req.waited > HUNG_STEPS:
                    e.engine.abort(r.req)
                    ended(e, r)
        step += 1
    return time.monotonic() - t0


def _index_bytes(index: Any) -> int:
    """``SourceIndex.nbytes``, read again if its node thread changed it meanwhile."""
    for _ in range(100):
        try:
            return int(index.nbytes)
        except RuntimeError:  # changed size under us
            time.sleep(0.001)
    raise RuntimeError("the source index kept changing while it was measured")


def _counter(engines: Sequence[Engine], name: str) -> int:
    return sum(v for e in engines for (n, _), v in e.engine.counters.items() if n == name)


def _figures(engines: Sequence[Engine], seconds: float) -> dict[str, Any]:
    requests = [r for e in engines for r in e.requests]
    keys = sum(len(r.turn.keys) for r in requests)
    saved = sum(r.req.loaded for r in requests)
    waits: dict[str, list[int]] = {"claimed": [], "unclaimed": [], "named": []}
    for r in requests:
        wait = r.req.waited  # steps its scans were deferred for a tier's answer
        if r.claimed is not None:
            waits["claimed" if r.claimed else "unclaimed"].append(wait)
        elif r.req.ctx.kv_transfer_params is not None:
            waits["named"].append(wait)
    counts = [e.node.directory.counts for e in engines if e.node is not None]
    pairs = max(1, len(counts) * (len(counts) - 1))
    probed = sum(c.probed_keys for c in counts)
    return {
        "loaded_tokens": sum(r.req.promoted for r in requests) * TOKENS_PER_BLOCK,
        "saved_tokens": saved * TOKENS_PER_BLOCK,
        "hit_rate": saved / keys if keys else 0.0,
        **{f"wait_{k}_mean": (sum(v) / len(v) if v else 0.0) for k, v in waits.items()},
        **{f"wait_{k}_max": max(v, default=0) for k, v in waits.items()},
        # A request that waited over HUNG_STEPS for its lookups to decide hung
        # (vLLM's scheduler retries it every step; nobody gives up for it).
        "hung": sum(1 for r in requests if r.req.aborted),
        "named": sum(1 for r in requests if r.req.ctx.kv_transfer_params is not None),
        "probed_keys": probed,
        "false_claims": sum(c.false_claims for c in counts),
        "false_claim_rate": sum(c.false_claims for c in counts) / probed if probed else 0.0,
        "summary_bytes_per_s_per_peer": sum(c.bytes_sent for c in counts) / seconds / pairs,
        "loads_failed": _counter(engines, "vllm:kv_offload_tiering_promotion_job_failures"),
        "wrong_blocks": sum(r.req.wrong for r in requests),
        "seconds": seconds,
    }


def run_arm(arm: str, engines_n: int, capacity_share: float, turns: Sequence[Turn]) -> Any:
    """Build the fleet of ``arm``, run ``turns`` through it, settle, shut it down; its figures."""
    engines = build_fleet(arm, engines_n, max(16, int(capacity_share * working_set(turns))))
    try:
        _wait(engines, lambda: _synced(engines), "summaries")
        figures = _figures(engines, _drive(arm, engines, turns))
        _wait(engines, lambda: all(e.settled() for e in engines), "every tier settled")
        time.sleep(0.2)  # the tiers' figures reach vLLM's counters within 0.1 s
        for e in engines:
            e.poll()
        figures["pins_left"], figures["open_left"] = map(
            sum, zip(*(e.left() for e in engines), strict=True)
        )
        lookups = _counter(engines, "vllm:kv_offload_p2pactor_lookups")
        figures["lookups_per_named"] = lookups / figures["named"] if figures["named"] else 0.0
        indexes = [e.node.directory.index for e in engines if e.node is not None]
        figures["index_claims_per_engine"] = sum(len(i) for i in indexes) / max(1, len(indexes))
        figures["index_bytes_per_engine"] = sum(map(_index_bytes, indexes)) / max(1, len(indexes))
        return figures
    finally:
        for e in engines:
            e.stack.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``REPEATS [--quick]``: every arm on every fleet of :func:`plan`; print the figures."""
    repeats, *quick = sys.argv[1:] if argv is None else argv
    requests, fleets, arms = plan(quick == ["--quick"])
    runs: dict[str, dict[str, list[Any]]] = {}  # fleet: arm: figures of each repeat
    for repeat in range(int(repeats)):
        # The same turns in every arm of a repeat; another workload per repeat.
        for workload, n, share in fleets:
            make = chat_turns if workload == "chat" else rag_turns
            turns = make(n, requests[workload], repeat)
            for arm in arms:
                fleet = runs.setdefault(fleet_of(workload, n, share), {})
                fleet.setdefault(arm, []).append(run_arm(arm, n, share, turns))
    say(f"RESULT {json.dumps(runs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
