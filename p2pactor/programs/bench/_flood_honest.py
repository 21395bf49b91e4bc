"""The honest peer of the ``flood`` section: a p2pactor node that looks up, fetches and times.

``python -m p2pactor.programs.bench._flood_honest --port N --peer-port M``: a p2pactor
node on real ZeroMQ and NIXL on 127.0.0.1 (no parent: it only consumes),
whose producer at ``M`` (ours or vLLM's, :mod:`p2pactor.programs.bench._control_peer`)
holds :data:`~p2pactor.programs.bench._control_peer.KEYS`. It prints ``READY``, then
reads one JSON command per line on stdin and answers each with one JSON line:

* ``{"cmd": "start"}``: start the honest loop in the background, answer
  ``{"started": true}``. The loop, again and again until stopped: a fresh
  request id, ``Node.lookup`` of :data:`HONEST_KEYS` consecutive keys the
  producer holds (timed from the call to its answers: the figure the section
  reports), ``Node.fetch`` of the 16 blocks (timed apart), every byte of them
  compared with what the producer stored, ``Node.finish``, then a pause of
  :data:`PAUSE_S`.
* ``{"cmd": "stop"}``: stop the loop after its current request and answer what
  it measured since ``start``: lookups, lookup latency p50/p99/max (seconds),
  fetch p50/p99, blocks verified, failures (a lookup that answered MISS, a
  failed fetch, a block with a wrong byte; the first few described, with why
  a lookup answered MISS), how many of them failed because the session to the
  producer was lost (``lost_session``) and this process's CPU seconds.

It exits when its stdin closes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from p2pactor.programs.bench._control_common import percentile, say
from p2pactor.programs.bench._control_peer import (
    BLOCK_LEN,
    HASH_SEED,
    HOST,
    KEYS,
    NUM_KEYS,
    block_content,
)

__all__ = ["CONSUMER_BLOCKS", "HONEST_KEYS", "PAUSE_S", "main"]

HONEST_KEYS = 16
"""Keys per honest lookup (and blocks per fetch)."""
PAUSE_S = 0.01
"""The honest peer's pause between requests: a steady load, not a saturating one."""
CONSUMER_BLOCKS = 4 * HONEST_KEYS
"""The honest node's own pool, fetched into."""
FAILURES_KEPT = 5
"""Failures described in an answer (all are counted)."""


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class _Tally:
    """What the honest loop measured since ``start``."""

    def __init__(self) -> None:
        self.lookups: list[float] = []
        self.fetches: list[float] = []
        self.verified = 0
        self.failures: list[str] = []
        self.failed = 0
        self.lost_session = 0
        self.cpu0 = _cpu_s()
        self.start = time.perf_counter()

    def fail(self, why: str, *, lost_session: bool = False) -> None:
        self.failed += 1
        self.lost_session += lost_session
        if len(self.failures) < FAILURES_KEPT:
            self.failures.append(why)

    def result(self) -> dict[str, Any]:
        return {
            "lookups": len(self.lookups),
            "elapsed_s": time.perf_counter() - self.start,
            "lookup_p50_s": percentile(self.lookups, 0.5) if self.lookups else None,
            "lookup_p99_s": percentile(self.lookups, 0.99) if self.lookups else None,
            "lookup_max_s": max(self.lookups, default=None),
            "fetch_p50_s": percentile(self.fetches, 0.5) if self.fetches else None,
            "fetch_p99_s": percentile(self.fetches, 0.99) if self.fetches else None,
            "verified": self.verified,
            "failed": self.failed,
            "failures": self.failures,
            "lost_session": self.lost_session,
            "cpu_s": _cpu_s() - self.cpu0,
        }


async def _run(args: argparse.Namespace) -> None:
    import trio  # noqa: PLC0415

    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.core.consumer import ConsumerState  # noqa: PLC0415
    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.node import Node, open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415

    pool = bytearray(CONSUMER_BLOCKS * BLOCK_LEN)
    cache = EmbeddedCache(CONSUMER_BLOCKS, BLOCK_LEN, memory=memoryview(pool))
    config = NodeConfig(
        host=HOST,
        port=args.port,
        num_blocks=CONSUMER_BLOCKS,
        block_len=BLOCK_LEN,
        hash_seed=HASH_SEED,
    )
    peer = f"{HOST}:{args.peer_port}"
    counter = iter(range(10**12))

    def why_failed(node: Node, kv: str) -> tuple[str, bool]:
        """Why request ``kv`` failed, and whether it is because its session was lost.

        A lookup answers MISS for every key when its session is lost, when it
        timed out, or when the producer said so: the section tells them apart.
        """
        actor = node.known_consumer(peer, kv)
        state = actor.state if actor is not None else None
        if not isinstance(state, ConsumerState):
            return "no request to the producer", False
        if state.session_lost:
            session = node.session(peer)
            if session is not None and not session.alive:
                reason = session.death_reason or "closed"
            else:
                ended = [c.reason for c in node.closed_sessions() if c.peer_id == peer]
                reason = ended[-1] if ended else "closed"
            return f"the session to the producer was lost ({reason})", True
        if state.lookup_failed:
            return "its lookup timed out", False
        return "the producer said so", False

    async def one(node: Node, tally: _Tally) -> None:
        n = next(counter)
        kv = f"honest-{n}"
        first = (n * HONEST_KEYS) % (NUM_KEYS - HONEST_KEYS + 1)
        indexes = range(first, first + HONEST_KEYS)
        wanted = [KEYS[i] for i in indexes]
        t0 = time.perf_counter()
        answers = await node.lookup(peer, kv, wanted)
        t1 = time.perf_counter()
        tally.lookups.append(t1 - t0)
        if any(a is not LookupResult.HIT for a in answers):
            misses = sum(1 for a in answers if a is not LookupResult.HIT)
            why, lost = why_failed(node, kv)
            tally.fail(
                f"{kv}: {misses} of {len(wanted)} keys the producer holds answered MISS: {why}",
                lost_session=lost,
            )
            node.finish(kv)
            return
        blocks = cache.allocate(len(wanted))
        try:
            result = await node.fetch(peer, kv, wanted, blocks)
            tally.fetches.append(time.perf_counter() - t1)
            if not result.success:
                lost = why_failed(node, kv)[1]
                tally.fail(f"{kv}: fetch failed: {result.reason}", lost_session=lost)
                return
            for i, block in zip(indexes, blocks, strict=True):
                got = pool[block * BLOCK_LEN : (block + 1) * BLOCK_LEN]
                if got != block_content(i):
                    tally.fail(f"{kv}: the block of key {i} differs")
                else:
                    tally.verified += 1
        finally:
            cache.free(blocks)
            node.finish(kv)

    async def loop(node: Node, tally: _Tally, stop: trio.Event, done: trio.Event) -> None:
        try:
            while not stop.is_set():
                await one(node, tally)
                await trio.sleep(PAUSE_S)
        finally:
            done.set()

    async with (
        open_zmq_transport(f"{HOST}:{args.port}", port=args.port) as control,
        open_nixl_transport(pool, BLOCK_LEN, name=f"bench-honest-{os.getpid()}") as data,
        open_node(config, control=control, data=data) as node,
        trio.open_nursery() as nursery,
    ):
        say("READY")
        running: tuple[_Tally, trio.Event, trio.Event] | None = None
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)["cmd"]
            if cmd == "start" and running is None:
                running = (_Tally(), trio.Event(), trio.Event())
                nursery.start_soon(loop, node, *running)
                say({"started": True})
            elif cmd == "stop" and running is not None:
                tally, stop, done = running
                stop.set()
                await done.wait()
                running = None
                say(tally.result())
            else:
                say({"error": f"unexpected command {cmd!r}"})
        if running is not None:
            running[1].set()
            await running[2].wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the honest peer until its stdin closes."""
    parser = argparse.ArgumentParser(description="the honest peer of the flood benchmark")
    parser.add_argument("--port", type=int, required=True, help="our control port")
    parser.add_argument("--peer-port", type=int, required=True, help="the producer's port")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import trio  # noqa: PLC0415

    trio.run(_run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
