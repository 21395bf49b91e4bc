"""``tests/test_quotas.py``'s flooding peer: ``python -m tests.flood_peer --victim HOST:PORT ...``.

The bench's hostile peer (:class:`~p2pactor.programs.bench._hostile_peer.RawPeer`, a
real NIXL agent over 64 lazily mapped blocks) in vLLM's base dialect, flooding lookups
through :func:`~p2pactor.programs.bench._hostile.flood`: per ``--phase KIND:N`` N
lookups of ``--keys`` keys, at most ``--window`` unanswered, never fetched or closed.
``random`` keys; ``real``: the keys of ``serve --preload``; ``rounds``: real keys, all in
one request, a new round each. It prints ``READY peer``, a ``DONE {...}`` per phase and
exits 0 (``ERROR why``, 1). These modes were the bench hostile peer's, which only this
test used (issue 36 moved them here; the bench keeps its paced lookup flood).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence

import trio
import zmq

from p2pactor.core import protocol as wire
from p2pactor.programs.bench._control_common import say
from p2pactor.programs.bench._hostile import HOST, flood, nixl_agent
from p2pactor.programs.bench._hostile_peer import Failure, RawPeer
from p2pactor.runtime.samples import preload_keys


def _flood(args: argparse.Namespace, agent: tuple[bytes, int, int, int]) -> int:
    rng = random.Random(0)  # reproducible junk keys, not secrets
    real = preload_keys(args.hash_seed, args.preload)

    def keys(kind: str) -> tuple[bytes, ...]:
        if kind == "random":
            return tuple(rng.randbytes(32) + bytes(4) for _ in range(args.keys))
        start = rng.randrange(max(1, len(real) - args.keys + 1))
        return tuple(real[start : start + args.keys])

    def lookup(kind: str, i: int) -> wire.Lookup:
        rounds = kind == "rounds"
        kv = "flood" if rounds else f"flood-{kind}-{i}"
        return wire.Lookup(kv_request_id=kv, keys=keys(kind), round_seq=i * rounds)

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    peer = RawPeer(ctx, HOST, args.victim)
    try:
        peer.handshake(agent, args.hash_seed, summaries=False)
        say(f"READY {peer.peer_id}")
        for kind, _, n in (p.partition(":") for p in args.phase):
            figures = flood(peer, int(n), lambda i, k=kind: lookup(k, i), args.window)
            say(f"DONE {json.dumps({'phase': kind, **figures})}")
    except Failure as exc:
        say(f"ERROR {exc}")
        return 1
    finally:
        peer.close()
        ctx.term()
    return 0


async def _run(args: argparse.Namespace) -> int:
    async with nixl_agent(64, args.block_len) as agent:
        status: int = await trio.to_thread.run_sync(_flood, args, agent)
        return status


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, flood, and return the exit status."""
    p = argparse.ArgumentParser()
    for flag in ("--victim", "--hash-seed"):
        p.add_argument(flag, required=True)
    for flag in ("--block-len", "--preload", "--keys", "--window"):
        p.add_argument(flag, type=int, required=True)
    p.add_argument("--phase", action="append", default=[], help="KIND:N")
    status: int = trio.run(_run, p.parse_args(argv))
    return status


if __name__ == "__main__":
    sys.exit(main())
