"""The honest peer of the ``summary-attack`` section: a timed p2pactor node, run as a process.

``python -m p2pactor.programs.bench._honest JSON`` (``port``, and the victim's
:attr:`~p2pactor.programs.bench._summary_drive.VictimSettings.peer_spec`): a node on real
ZeroMQ and NIXL whose loop, :data:`RATE_HZ` times a second (one that ran late makes no
burst), looks up :data:`KEYS` consecutive keys ``p2pactor serve --preload`` holds (timed:
the figure reported), fetches their blocks, compares every byte and finishes. It says
``READY``; each stdin line ends a window: one JSON line of what was measured (every
lookup's latency in seconds, failures counted, the first few described). It exits, the
request under way cancelled, when its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from p2pactor.programs.bench._control_common import open_bench_node, say

KEYS, RATE_HZ = 4, 50.0
"""Keys a lookup; lookups a second."""
FAILURES_KEPT = 5
"""Failures described in a window (all are counted)."""


def _window() -> dict[str, Any]:
    """A new window's figures, as the driver reads them."""
    return {"latencies_s": [], "failed": 0, "failures": []}


def _fail(window: dict[str, Any], why: str) -> None:
    window["failed"] += 1
    if len(window["failures"]) < FAILURES_KEPT:
        window["failures"].append(why)


def _why_failed(node: Any, peer: str, kv: str) -> str:
    """Why request ``kv`` failed: a lost session, a timed-out lookup, or the victim said so."""
    from p2pactor.core.consumer import ConsumerState  # noqa: PLC0415

    actor = node.known_consumer(peer, kv)
    state = actor.state if actor is not None else None
    if not isinstance(state, ConsumerState):
        return "no request to the victim"
    if state.session_lost:
        ended = [c.reason for c in node.closed_sessions() if c.peer_id == peer]
        return f"the session to the victim was lost ({ended[-1] if ended else 'closed'})"
    return "its lookup timed out" if state.lookup_failed else "the victim said so"


async def _run(args: argparse.Namespace) -> None:
    import trio  # noqa: PLC0415

    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.node import Node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.runtime.samples import block_bytes, preload_keys  # noqa: PLC0415

    seed, block_len, victim, per = args.hash_seed, args.block_len, args.victim, KEYS
    keys = preload_keys(seed, args.preload)
    blocks = 4 * per
    pool = bytearray(blocks * block_len)
    cache = EmbeddedCache(blocks, block_len, memory=memoryview(pool))
    counter = iter(range(10**12))

    async def one(node: Node, tally: dict[str, Any]) -> None:
        n = next(counter)
        kv = f"honest-{n}"
        first = (n * per) % (len(keys) - per + 1)
        indexes = range(first, first + per)
        wanted = [keys[i] for i in indexes]
        t0 = time.perf_counter()
        answers = await node.lookup(victim, kv, wanted)
        t1 = time.perf_counter()
        tally["latencies_s"].append(round(t1 - t0, 6))
        if any(a is not LookupResult.HIT for a in answers):
            misses = sum(1 for a in answers if a is not LookupResult.HIT)
            why = _why_failed(node, victim, kv)
            _fail(tally, f"{kv}: {misses} of {per} keys the victim holds answered MISS: {why}")
            node.finish(kv)
            return
        into = cache.allocate(per)
        try:
            result = await node.fetch(victim, kv, wanted, into)
            if not result.success:
                _fail(tally, f"{kv}: fetch failed: {result.reason}")
                return
            for i, block in zip(indexes, into, strict=True):
                got = pool[block * block_len : (block + 1) * block_len]
                if got != block_bytes(keys[i], block_len):
                    _fail(tally, f"{kv}: the block of key {i} differs from what the victim stored")
        finally:
            cache.free(into)
            node.finish(kv)

    async def loop(node: Node, box: list[dict[str, Any]]) -> None:
        due = trio.current_time()
        while True:
            await one(node, box[0])
            due = max(due + 1.0 / RATE_HZ, trio.current_time())
            await trio.sleep_until(due)

    async with (
        open_bench_node(
            args.port, pool, block_len, name=f"bench-honest-{os.getpid()}", hash_seed=seed
        ) as node,
        trio.open_nursery() as nursery,
    ):
        box = [_window()]
        nursery.start_soon(loop, node, box)
        say("READY")
        while await trio.to_thread.run_sync(sys.stdin.readline):  # a window ends, one begins
            ended, box[0] = box[0], _window()
            say(ended)
        nursery.cancel_scope.cancel()


def main() -> int:
    """Run the honest peer (its one argument: the JSON of its options) until stdin closes."""
    import trio  # noqa: PLC0415

    trio.run(_run, argparse.Namespace(**json.loads(sys.argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
