"""The honest peer of the ``summary-attack`` section: a node that looks up the victim, steadily.

``python -m p2pactor.programs.bench._summary_honest --port N --victim HOST:PORT
--hash-seed S --block-len L --preload K``: a p2pactor node on real ZeroMQ and
NIXL on 127.0.0.1 whose victim is ``p2pactor serve --preload K`` (its keys are
:func:`~p2pactor.runtime.samples.preload_keys`, its bytes
:func:`~p2pactor.runtime.samples.block_bytes`). It prints ``READY``, then reads
one JSON command per line on stdin and answers each with one JSON line:

* ``{"cmd": "start"}``: start looking the victim up, :data:`RATE_HZ` times a
  second (a steady load, not a saturating one): each time a fresh request,
  ``Node.lookup`` of :data:`HONEST_KEYS` consecutive preloaded keys (timed
  from the call to its answers: the figure reported), ``Node.fetch`` of them,
  every byte compared with what the victim stored, ``Node.finish``.
* ``{"cmd": "window"}``: what was measured since ``start`` or the last
  ``window`` (lookups, latency p50/p99/max in seconds and every latency,
  blocks verified, failures: a MISS, a failed fetch, a wrong byte; the first
  few described), and a new window begins.
* ``{"cmd": "stop"}``: stop after the current request; answer the last window.

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

__all__ = ["HONEST_KEYS", "RATE_HZ", "main"]

HONEST_KEYS = 4
"""Keys per honest lookup (and blocks per fetch)."""
RATE_HZ = 50.0
"""Honest lookups a second: issue 30's honest node looked up about 50 times a second."""
POOL_BLOCKS = 8 * HONEST_KEYS
"""The honest node's own pool, fetched into."""
FAILURES_KEPT = 5
"""Failures described in an answer (all are counted)."""


class _Tally:
    """What the honest loop measured in one window."""

    def __init__(self) -> None:
        self.lookups: list[float] = []
        self.verified = 0
        self.failed = 0
        self.failures: list[str] = []
        self.start = time.time()

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.failures) < FAILURES_KEPT:
            self.failures.append(why)

    def result(self) -> dict[str, Any]:
        xs = self.lookups
        return {
            "lookups": len(xs),
            "start": self.start,
            "end": time.time(),
            "lookup_p50_s": percentile(xs, 0.5) if xs else None,
            "lookup_p99_s": percentile(xs, 0.99) if xs else None,
            "lookup_max_s": max(xs, default=None),
            "verified": self.verified,
            "failed": self.failed,
            "failures": self.failures,
            "latencies_s": [round(x, 6) for x in xs],
        }


async def _run(args: argparse.Namespace) -> None:
    import trio  # noqa: PLC0415

    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.core.inputs import LookupResult  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.node import Node, open_node  # noqa: PLC0415
    from p2pactor.runtime.parent import EmbeddedCache  # noqa: PLC0415
    from p2pactor.runtime.samples import block_bytes, preload_keys  # noqa: PLC0415

    block_len, victim = args.block_len, args.victim
    keys = preload_keys(args.hash_seed, args.preload)
    pool = bytearray(POOL_BLOCKS * block_len)
    cache = EmbeddedCache(POOL_BLOCKS, block_len, memory=memoryview(pool))
    config = NodeConfig(
        host="127.0.0.1",
        port=args.port,
        num_blocks=POOL_BLOCKS,
        block_len=block_len,
        hash_seed=args.hash_seed,
    )
    counter = iter(range(10**12))
    windows = len(keys) - HONEST_KEYS + 1

    async def one(node: Node, tally: _Tally) -> None:
        n = next(counter)
        kv = f"honest-{n}"
        first = (n * HONEST_KEYS) % windows
        wanted = keys[first : first + HONEST_KEYS]
        t0 = time.perf_counter()
        answers = await node.lookup(victim, kv, wanted)
        tally.lookups.append(time.perf_counter() - t0)
        if any(a is not LookupResult.HIT for a in answers):
            misses = sum(1 for a in answers if a is not LookupResult.HIT)
            tally.fail(f"{kv}: {misses} of {len(wanted)} preloaded keys answered MISS")
            node.finish(kv)
            return
        blocks = cache.allocate(len(wanted))
        try:
            result = await node.fetch(victim, kv, wanted, blocks)
            if not result.success:
                tally.fail(f"{kv}: fetch failed: {result.reason}")
                return
            for key, block in zip(wanted, blocks, strict=True):
                got = pool[block * block_len : (block + 1) * block_len]
                if got != block_bytes(key, block_len):
                    tally.fail(f"{kv}: a fetched block differs from what the victim stored")
                else:
                    tally.verified += 1
        finally:
            cache.free(blocks)
            node.finish(kv)

    async def loop(node: Node, box: list[_Tally], stop: trio.Event, done: trio.Event) -> None:
        period = 1.0 / RATE_HZ
        due = trio.current_time()
        try:
            while not stop.is_set():
                await one(node, box[0])
                # The next lookup on the beat; one that ran late does not make a burst.
                due = max(due + period, trio.current_time())
                await trio.sleep_until(due)
        finally:
            done.set()

    async with (
        open_zmq_transport(f"127.0.0.1:{args.port}", port=args.port) as control,
        open_nixl_transport(pool, block_len, name=f"summary-honest-{os.getpid()}") as data,
        open_node(config, control=control, data=data) as node,
        trio.open_nursery() as nursery,
    ):
        say("READY")
        running: tuple[list[_Tally], trio.Event, trio.Event] | None = None
        while True:
            line = await trio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)["cmd"]
            if cmd == "start" and running is None:
                running = ([_Tally()], trio.Event(), trio.Event())
                nursery.start_soon(loop, node, *running)
                say({"started": True})
            elif cmd == "window" and running is not None:
                box = running[0]
                done_window, box[0] = box[0], _Tally()
                say(done_window.result())
            elif cmd == "stop" and running is not None:
                box, stop, done = running
                stop.set()
                await done.wait()
                running = None
                say(box[0].result())
            else:
                say({"error": f"unexpected command {cmd!r}"})
        if running is not None:
            running[1].set()
            await running[2].wait()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the honest peer until its stdin closes."""
    parser = argparse.ArgumentParser(description="the honest peer of the summary-attack bench")
    parser.add_argument("--port", type=int, required=True, help="our control port")
    parser.add_argument("--victim", required=True, help="the victim's host:port")
    parser.add_argument("--hash-seed", required=True, help="the victim's hash seed")
    parser.add_argument("--block-len", type=int, required=True, help="the victim's block size")
    parser.add_argument("--preload", type=int, required=True, help="the victim's --preload")
    args = parser.parse_args(argv)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import trio  # noqa: PLC0415

    trio.run(_run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
