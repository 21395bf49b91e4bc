"""The fleet benchmark's process: every arm of router-less chat, on 4 and on 8 engines.

Run by the ``fleet`` section (``python -m p2pactor.programs.bench._fleet_run
--json OUT``). Each arm builds its fleet in this process: one
:class:`~p2pactor.programs.bench._fleet_engine.FleetEngine` per engine, each
with its own tier (p2pactor's vLLM adapter, whose node thread is its own, or
vLLM 0.33's ``P2PSecondaryTierManager``) over its own CPU pool, bound to its
own port on 127.0.0.1: real ZeroMQ and NIXL between them. The engines step
in lockstep (each its scheduler calls, then one forward-pass sleep, then each
its output processing). The arms, on the same turns:

- ``none``: no P2P tier; each engine reuses its own CPU tier only;
- ``oracle``: each request names the engine whose CPU tier holds the longest
  prefix of it (read from every engine's tier at admission), when longer
  than its own;
- ``random``: each request names a peer drawn at random;
- ``auto``: no request names a source; the tiers exchange summaries;
- ``mixed``: as ``auto``, every other engine running vLLM's own tier;
- ``silent``: as ``auto``, engine 0 sharing no summary (what a quarantine
  leaves of it: the reference the hostile arm's cost is measured from);
- ``hostile``: as ``auto``, engine 0 claiming every key of the workload (its
  honesty checks off, its registered blocks the whole working set) and
  holding no more than the others.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs
from vllm.v1.kv_offload.base import ReqContext

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._fleet_engine import FleetEngine, FleetRequest, Primary
from p2pactor.programs.bench._fleet_workload import (
    TOKENS_PER_BLOCK,
    FleetPlan,
    Turn,
    turns_of,
    working_set,
)

__all__ = ["ARMS", "main", "run_arm"]

ARMS = ("none", "oracle", "random", "auto", "mixed", "silent", "hostile")
"""The arms, in the order they run."""
BLOCK_BYTES = 4096
"""Bytes per chunk (the figures count keys and tokens; the bytes are checked)."""
RUN_TIMEOUT_S = 600.0
SYNC_TIMEOUT_S = 60.0


@attrs.frozen(kw_only=True)
class Pace:
    """How the engines step.

    Attributes:
        step_ms: The forward pass of one step.
        admit: New requests per step, over the fleet.
        per_engine: Requests one engine has in flight, at most.
    """

    step_ms: float = 10.0
    admit: int = 4
    per_engine: int = 4


def _tier(kind: str, pool: Any, port: int, seeds: list[str], summaries: bool) -> Any:
    if kind == "stock":
        return shared.make_tier("vllm", pool, port)
    from p2pactor.adapters.vllm import P2PActorTierManager  # noqa: PLC0415

    spec = shared.make_spec("ours", pool.shape[1], pool.shape[0], port)
    return P2PActorTierManager(
        spec, memoryview(pool), host=shared.HOST, port=port, seed_peers=seeds, summaries=summaries
    )


def _kinds(arm: str, n: int) -> list[str]:
    if arm == "none":
        return ["none"] * n
    if arm == "mixed":
        return ["ours" if i % 2 == 0 else "stock" for i in range(n)]
    return ["ours"] * n


_PORTS = random.Random()  # noqa: S311 - spreads the ports, no secret


def _ports(n: int) -> list[int]:
    """``n`` ports free now, below the ephemeral range.

    A port the kernel hands out (bind to 0) may be taken again at once as
    the source port of an outgoing connection: the fleet opens hundreds.
    """
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


def _build(arm: str, n: int, capacity: int, every_key: int) -> list[FleetEngine]:
    kinds = _kinds(arm, n)
    ports = _ports(n)
    ids = [f"{shared.HOST}:{p}" for p in ports]
    summaries = arm in ("auto", "mixed", "silent", "hostile")
    engines = []
    for i, kind in enumerate(kinds):
        rows = every_key if (arm == "hostile" and i == 0) else capacity
        pool = shared.make_pool(rows, BLOCK_BYTES)
        seeds = [p for j, p in enumerate(ids) if j != i] if summaries else []
        shares = summaries and not (arm == "silent" and i == 0)
        tier = None if kind == "none" else _tier(kind, pool, ports[i], seeds, shares)
        engine = FleetEngine(i, tier, Primary(pool, capacity))
        engine.counts["port"] = ports[i]
        engines.append(engine)
    return engines


def _ours(engines: Sequence[FleetEngine]) -> list[FleetEngine]:
    return [e for e in engines if e.tier is not None and hasattr(e.tier, "node")]


def _peer_id(engine: FleetEngine) -> str:
    return f"{shared.HOST}:{engine.counts['port']}"


def _make_hostile(engine: FleetEngine, keys: list[bytes]) -> None:
    """Engine 0 claims every key, and never takes a claim back."""
    node = engine.tier.node
    setattr(node.sources, "gone", lambda keys: None)  # noqa: B010 - a hostile patch, on purpose
    node.holds(keys, wake=True)


def _synced(engines: Sequence[FleetEngine], hostile: tuple[FleetEngine, int] | None) -> bool:
    ours = [e for e in _ours(engines) if e.tier.node.shares_summaries]
    for e in ours:
        index = e.tier.node.sources.index
        for p in ours:
            if p is e:
                continue
            position = index.position(_peer_id(p))
            if position is None or not position[2]:
                return False
            if (
                hostile is not None
                and p is hostile[0]
                and index.claims_of(_peer_id(p)) < hostile[1]
            ):
                return False
    return True


def _wait(engines: Sequence[FleetEngine], done: Any, what: str, timeout: float) -> float:
    t0 = time.monotonic()
    while not done():
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"not within {timeout:g} s: {what}")
        for e in engines:
            e.poll()
        time.sleep(0.005)
    return time.monotonic() - t0


def _params(
    arm: str, engine: FleetEngine, engines: Sequence[FleetEngine], turn: Turn, rng: random.Random
) -> dict[str, Any] | None:
    others = [e for e in engines if e is not engine]
    if arm == "oracle":
        best = max(others, key=lambda e: e.primary.prefix(turn.keys))
        if best.primary.prefix(turn.keys) <= engine.primary.prefix(turn.keys):
            return None
    elif arm == "random":
        best = rng.choice(others)
    else:
        return None
    return {
        "remote_kv_source": {
            "kv_request_id": f"{arm}-{turn.index}",
            "remote_host": shared.HOST,
            "remote_port": best.counts["port"],
        }
    }


def _drive(
    arm: str, engines: Sequence[FleetEngine], turns: Sequence[Turn], pace: Pace
) -> tuple[list[FleetRequest], int, float]:
    """Run every turn to its end; (the requests, the steps, the seconds)."""
    rng = random.Random(0)  # noqa: S311 - which peer the random arm names
    pending = list(turns)
    done: dict[tuple[int, int], int] = {}  # (conversation, turn) -> the step it ended
    in_flight = [0] * len(engines)
    requests: list[FleetRequest] = []
    step = 0
    t0 = time.monotonic()
    while len(done) < len(turns):
        if time.monotonic() - t0 > RUN_TIMEOUT_S:
            raise RuntimeError(f"{arm}: {len(done)}/{len(turns)} turns after {RUN_TIMEOUT_S:g} s")
        admitted = 0
        for turn in pending[:64]:
            if admitted == pace.admit:
                break
            ended = done.get((turn.conversation, turn.turn - 1))
            ready = turn.turn == 0 or (ended is not None and step >= ended + turn.think_steps)
            if not ready or in_flight[turn.engine] >= pace.per_engine:
                continue
            engine = engines[turn.engine]
            params = _params(arm, engine, engines, turn, rng)
            ctx = ReqContext(req_id=f"{arm}-req-{turn.index}", kv_transfer_params=params)
            req = FleetRequest(turn, ctx, admitted=step)
            engine.admit(req)
            requests.append(req)
            pending.remove(turn)
            in_flight[turn.engine] += 1
            admitted += 1
        for e in engines:
            e.step(step)
        time.sleep(pace.step_ms / 1000)
        for e in engines:
            for req in e.end_step(step):
                done[req.turn.conversation, req.turn.turn] = step
                in_flight[e.index] -= 1
        step += 1
    return requests, step, time.monotonic() - t0


def _index_bytes(index: Any) -> int:
    """What the index's own objects take (``sys.getsizeof``; the ints counted once).

    Read while its node thread may still apply a late delta: a read that
    meets a change is read again.
    """
    for _ in range(100):
        try:
            return _index_bytes_once(index)
        except RuntimeError:  # changed size under us
            time.sleep(0.001)
    raise RuntimeError("the source index kept changing while it was measured")


def _index_bytes_once(index: Any) -> int:
    holders = index._holders
    total = sys.getsizeof(holders) + sum(sys.getsizeof(s) for s in holders.values())
    total += sum(sys.getsizeof(fp) for fp in holders)
    for peer in index._peers.values():
        total += sys.getsizeof(peer.claims)
    return total


def _figures(
    arm: str,
    engines: Sequence[FleetEngine],
    requests: Sequence[FleetRequest],
    seconds: float,
    setup_s: float,
) -> dict[str, Any]:
    keys = sum(len(r.turn.keys) for r in requests)
    local = sum(r.local for r in requests)
    loaded = sum(r.loaded for r in requests)
    waits: dict[str, list[int]] = {"claimed": [], "unclaimed": [], "named": [], "all": []}
    for r in requests:
        wait = r.answered - r.admitted
        waits["all"].append(wait)
        if r.claimed is not None:
            waits["claimed" if r.claimed else "unclaimed"].append(wait)
        elif r.ctx.kv_transfer_params is not None:
            waits["named"].append(wait)
    ours = _ours(engines)
    counts = [e.tier.node.sources.counts for e in ours]
    honest = [e for e in ours if not (arm in ("hostile", "silent") and e.index == 0)]
    honest_counts = [e.tier.node.sources.counts for e in honest]
    pairs = max(1, len(ours) * (len(ours) - 1))
    named = sum(1 for r in requests if r.ctx.kv_transfer_params is not None)
    out: dict[str, Any] = {
        "arm": arm,
        "engines": len(engines),
        "requests": len(requests),
        "prompt_tokens": keys * TOKENS_PER_BLOCK,
        "local_tokens": local * TOKENS_PER_BLOCK,
        "loaded_tokens": loaded * TOKENS_PER_BLOCK,
        "saved_tokens": (local + loaded) * TOKENS_PER_BLOCK,
        "hit_rate": (local + loaded) / keys if keys else 0.0,
        "wait_steps_mean": {k: (sum(v) / len(v) if v else 0.0) for k, v in waits.items()},
        "wait_steps_max": {k: max(v, default=0) for k, v in waits.items()},
        "requests_by_claim": {k: len(v) for k, v in waits.items()},
        "probes_per_request": (sum(c.chosen for c in counts) + named) / len(requests),
        "probed_keys": sum(c.probed_keys for c in honest_counts),
        "false_claims": sum(c.false_claims for c in honest_counts),
        "summary_bytes_per_s_per_peer": sum(c.bytes_sent for c in counts) / seconds / pairs,
        "loads_failed": sum(e.counts["loads_failed"] for e in engines),
        "wrong_blocks": sum(e.counts["wrong_blocks"] for e in engines),
        "evicted": sum(e.primary.evicted for e in engines),
        "steps": max((r.finished for r in requests), default=0) + 1,
        "seconds": seconds,
        "setup_s": setup_s,
        "saved_by_engine": [
            sum((r.local + r.loaded) * TOKENS_PER_BLOCK for r in requests if r.turn.engine == i)
            for i in range(len(engines))
        ],
    }
    if arm == "hostile":
        hostile = _peer_id(engines[0])
        now = [(e, e.tier.node.now()) for e in honest]
        out["hostile_quarantined_by"] = sum(
            e.tier.node.sources.index.quarantined(hostile, t) for e, t in now
        )
        out["hostile_precision"] = [e.tier.node.sources.index.precision(hostile) for e in honest]
    return out


def run_arm(plan: FleetPlan, arm: str, turns: Sequence[Turn], pace: Pace) -> dict[str, Any]:
    """Build the fleet of ``arm``, run ``turns`` through it, settle, shut it down; its figures."""
    every = working_set(turns)
    capacity = max(16, int(plan.capacity * every))
    engines = _build(arm, plan.engines, capacity, every)
    try:
        hostile = None
        if arm == "hostile":
            all_keys = list(dict.fromkeys(k for t in turns for k in (*t.keys, *t.reply)))
            _make_hostile(engines[0], all_keys)
            hostile = (engines[0], len(all_keys))
        setup_s = _wait(engines, lambda: _synced(engines, hostile), "summaries", SYNC_TIMEOUT_S)
        requests, _, seconds = _drive(arm, engines, turns, pace)
        figures = _figures(arm, engines, requests, seconds, setup_s)
        _wait(engines, lambda: all(e.settled() for e in engines), "every tier settled", 60.0)
        figures["pins_left"] = sum(len(e.pins) for e in engines)
        figures["open_left"] = sum(len(e.parent.open) for e in engines)
        indexes = [e.tier.node.sources.index for e in _ours(engines)]
        figures["index_claims_per_engine"] = sum(len(i) for i in indexes) / max(1, len(indexes))
        figures["index_bytes_per_engine"] = sum(map(_index_bytes, indexes)) / max(1, len(indexes))
        return figures
    finally:
        for e in engines:
            if e.tier is not None:
                e.tier.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Run every arm on every fleet size; write the figures as JSON."""
    parser = argparse.ArgumentParser(description="the fleet benchmark's process")
    parser.add_argument("--json", required=True)
    parser.add_argument("--sizes", default="4,8")
    parser.add_argument("--conversations", type=int, default=FleetPlan().conversations)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    pace = Pace()
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for size in (int(s) for s in args.sizes.split(",")):
            # The same turns in every arm of a repeat; another workload per repeat.
            plan = FleetPlan(
                engines=size, conversations=args.conversations, seed=args.seed + repeat
            )
            turns = turns_of(plan)
            for arm in args.arms.split(","):
                t0 = time.monotonic()
                figures = run_arm(plan, arm, turns, pace)
                figures["working_set"] = working_set(turns)
                figures["repeat"] = repeat
                time.monotonic() - t0
                runs.append(figures)
    plan = FleetPlan(conversations=args.conversations, seed=args.seed)
    with open(args.json, "w") as f:
        json.dump({"plan": attrs.asdict(plan), "pace": attrs.asdict(pace), "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
