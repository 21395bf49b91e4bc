"""The fleet benchmark's process (``python -m p2pactor.programs.bench._fleet_run --json OUT``).

Chat, then RAG fleets, in one process (one import of vLLM).

Each arm builds its fleet here: a :class:`~p2pactor.programs.bench._fleet_engine.FleetEngine`
per engine, each with its own tier (p2pactor's vLLM adapter or vLLM 0.33's
``P2PSecondaryTierManager``) over its own CPU pool and port on 127.0.0.1, real ZeroMQ
and NIXL between them, stepped in lockstep (scheduler calls, a forward-pass sleep,
output processing). The arms, on the same turns: ``none`` (no P2P tier); ``oracle``
(each request names the engine whose CPU tier holds its longest prefix, read at
admission); ``random`` (a random peer named); ``auto`` (none named; the tiers exchange
summaries); ``mixed`` (``auto``, every other engine on vLLM's own tier); ``silent``
(``auto``, engine 0 sharing no summary: what a quarantine leaves, the hostile arm's
reference); ``hostile`` (``auto``, engine 0 claiming as many workload keys as its
summary may hold, never dropping one, its honesty checks off; its producer answers
what its tier holds).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._fleet_engine import FleetEngine, FleetRequest, build_fleet
from p2pactor.programs.bench._fleet_workload import (
    TOKENS_PER_BLOCK,
    FleetPlan,
    RagPlan,
    Turn,
    rag_turns_of,
    turns_of,
    working_set,
)

ARMS = ("none", "oracle", "random", "auto", "mixed", "silent", "hostile")
"""The arms, in the order they run."""
BLOCK_BYTES = 4096
"""Bytes per chunk (the figures count keys and tokens; the bytes are checked)."""
RUN_TIMEOUT_S = 600.0
SYNC_TIMEOUT_S = 60.0
HUNG_STEPS = 500
"""A request whose lookups took longer than this many steps (5 s at 10 ms) to decide hung."""


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


def _ours(engines: Sequence[FleetEngine]) -> list[FleetEngine]:
    return [e for e in engines if e.ours]


def _peer_id(engine: FleetEngine) -> str:
    return f"{shared.HOST}:{engine.port}"


def _make_hostile(engine: FleetEngine, keys: list[bytes]) -> None:
    """Engine 0 claims keys it does not hold, as many as it may, and never takes one back.

    Its producer still answers honestly (its lies are in its summary only).
    """
    node = engine.tier.node
    # Hostile patches, on purpose: it never drops a claim, and checks nothing.
    setattr(node.sources, "gone", lambda keys: None)  # noqa: B010
    setattr(node, "take_scrub", lambda: None)  # noqa: B010
    setattr(node, "take_frontier", list)  # noqa: B010
    # Whole prompts, the workload's first (its most asked) first: its claimed
    # runs are the longest, so it is chosen, as a liar that wants traffic is.
    node.holds(list(keys), wake=True)
    # And nothing it really stores, loads or evicts ever reaches its summary:
    # its mirror (a cache of the tier's size) would push the lies out.
    for name in ("holds", "reused", "ended", "touch", "lacks", "reserve"):
        setattr(node, name, lambda *args, **kwargs: None)


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
    if arm == "oracle":  # the engine vLLM's CPU tiers say holds the longest prefix
        held = {e.index: e.prefix(turn.keys) for e in (*others, engine)}
        best = max(others, key=lambda e: held[e.index])
        if held[best.index] <= held[engine.index]:
            return None
    elif arm == "random":
        best = rng.choice(others)
    else:
        return None
    return {
        "remote_kv_source": {
            "kv_request_id": f"{arm}-{turn.index}",
            "remote_host": shared.HOST,
            "remote_port": best.port,
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
            requests.append(engine.admit(turn, f"{arm}-req-{turn.index}", params))
            pending.remove(turn)
            in_flight[turn.engine] += 1
            admitted += 1
        stepping = [e for e in engines if e.wants_step()]
        for e in stepping:
            e.begin()
        time.sleep(pace.step_ms / 1000)  # the forward pass
        for e in stepping:
            for req in e.end():
                done[req.turn.conversation, req.turn.turn] = step
                in_flight[e.index] -= 1
        for e in engines:  # the client gives up on a request that hung
            for req in e.hung(HUNG_STEPS):
                e.engine.abort(req.req)
                done[req.turn.conversation, req.turn.turn] = step
                in_flight[e.index] -= 1
        step += 1
    return requests, step, time.monotonic() - t0


def _index_bytes(index: Any) -> int:
    """What the index holds in memory (``SourceIndex.nbytes``: claims, filter, assemblies).

    Read while its node thread may still apply a late delta: a read that
    meets a change is read again.
    """
    for _ in range(100):
        try:
            return int(index.nbytes)
        except RuntimeError:  # changed size under us
            time.sleep(0.001)
    raise RuntimeError("the source index kept changing while it was measured")


def _figures(
    arm: str,
    engines: Sequence[FleetEngine],
    requests: Sequence[FleetRequest],
    seconds: float,
    setup_s: float,
) -> dict[str, Any]:
    keys = sum(len(r.turn.keys) for r in requests)
    local = sum(r.req.loaded - r.req.promoted for r in requests)
    loaded = sum(r.req.promoted for r in requests)
    waits: dict[str, list[int]] = {"claimed": [], "unclaimed": [], "named": [], "all": []}
    for r in requests:
        wait = r.req.waited  # steps its scans were deferred for a tier's answer
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
    failures = "vllm:kv_offload_tiering_promotion_job_failures"
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
        # A request that waited over HUNG_STEPS for its lookups to decide hung
        # (vLLM's scheduler retries it every step; nobody gives up for it).
        "hung": sum(1 for r in requests if r.req.aborted),
        "named": named,
        "probes_per_request": (sum(c.chosen for c in counts) + named) / len(requests),
        "probed_keys": sum(c.probed_keys for c in honest_counts),
        "false_claims": sum(c.false_claims for c in honest_counts),
        "summary_bytes_per_s_per_peer": sum(c.bytes_sent for c in counts) / seconds / pairs,
        "loads_failed": sum(
            v for e in engines for (name, _), v in e.engine.counters.items() if name == failures
        ),
        "wrong_blocks": sum(r.req.wrong for r in requests),
        "steps": max((r.req.finished - r.req.admitted for r in requests), default=0) + 1,
        "seconds": seconds,
        "setup_s": setup_s,
        "saved_by_engine": [
            sum((r.req.loaded) * TOKENS_PER_BLOCK for r in requests if r.turn.engine == i)
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


def run_arm(
    plan: FleetPlan | RagPlan, arm: str, turns: Sequence[Turn], pace: Pace
) -> dict[str, Any]:
    """Build the fleet of ``arm``, run ``turns`` through it, settle, shut it down; its figures."""
    every = working_set(turns)
    capacity = max(16, int(plan.capacity * every))
    engines = build_fleet(arm, plan.engines, capacity, BLOCK_BYTES)
    try:
        hostile = None
        if arm == "hostile":
            all_keys = list(dict.fromkeys(k for t in turns for k in (*t.keys, *t.reply)))
            _make_hostile(engines[0], all_keys)
            hostile = (engines[0], min(len(all_keys), capacity))
        setup_s = _wait(engines, lambda: _synced(engines, hostile), "summaries", SYNC_TIMEOUT_S)
        requests, _, seconds = _drive(arm, engines, turns, pace)
        figures = _figures(arm, engines, requests, seconds, setup_s)
        _wait(engines, lambda: all(e.settled() for e in engines), "every tier settled", 60.0)
        time.sleep(0.2)  # the tiers' figures reach vLLM's counters within 0.1 s
        for e in engines:
            e.poll()
        figures["pins_left"] = sum(e.jobs_left() for e in engines)
        figures["open_left"] = sum(e.open_left() for e in engines)
        lookups = "vllm:kv_offload_p2pactor_lookups"
        figures["lookups_sent"] = sum(
            v for e in engines for (name, _), v in e.engine.counters.items() if name == lookups
        )
        indexes = [e.tier.node.sources.index for e in _ours(engines)]
        figures["index_claims_per_engine"] = sum(len(i) for i in indexes) / max(1, len(indexes))
        figures["index_bytes_per_engine"] = sum(map(_index_bytes, indexes)) / max(1, len(indexes))
        figures["capacity_share"] = plan.capacity
        return figures
    finally:
        for e in engines:
            e.stack.shutdown()


def _plans(args: argparse.Namespace, repeat: int) -> list[FleetPlan | RagPlan]:
    seed, workloads = args.seed + repeat, args.workloads.split(",")
    chat: list[FleetPlan | RagPlan] = [
        FleetPlan(engines=int(size), conversations=args.conversations, seed=seed)
        for size in args.chat_sizes.split(",")
        if "chat" in workloads
    ]
    return chat + [
        RagPlan(engines=int(size), requests=args.requests, capacity=float(share), seed=seed)
        for size in args.rag_sizes.split(",")
        for share in args.capacities.split(",")
        if "rag" in workloads
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Run every arm on every fleet (size, tier share); write the figures as JSON."""
    parser = argparse.ArgumentParser(description="the fleet benchmark's process")
    parser.add_argument("--json", required=True)
    parser.add_argument("--workloads", default="chat,rag", help="chat, rag or both")
    parser.add_argument("--chat-sizes", default="4,8", help="engines per chat fleet")
    parser.add_argument("--rag-sizes", default="5", help="engines per RAG fleet")
    parser.add_argument("--conversations", type=int, default=FleetPlan().conversations)
    parser.add_argument("--requests", type=int, default=RagPlan().requests)
    parser.add_argument("--capacities", default="0.25,0.1", help="rag: CPU tier shares")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    pace = Pace()
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for plan in _plans(args, repeat):
            # The same turns in every arm of a repeat; another workload per repeat.
            turns = rag_turns_of(plan) if isinstance(plan, RagPlan) else turns_of(plan)
            for arm in args.arms.split(","):
                figures = run_arm(plan, arm, turns, pace)
                figures["workload"] = "rag" if isinstance(plan, RagPlan) else "chat"
                figures["working_set"] = working_set(turns)
                figures["repeat"] = repeat
                runs.append(figures)
    with open(args.json, "w") as f:
        json.dump({"workloads": args.workloads, "pace": attrs.asdict(pace), "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
