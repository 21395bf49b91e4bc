"""The hostile peer of ``p2pactor bench`` (``flood``, ``summary-attack``), run as a process.

``python -m p2pactor.programs.bench._hostile --victim HOST:PORT --attack NAME ...``, also
used by ``tests/test_summary_attack.py`` and ``tests/test_quotas.py``: bare pyzmq laid
out as vLLM lays its sockets out (:class:`~p2pactor.programs.bench._hostile_peer.RawPeer`),
with a real NIXL agent (the victim registers its memory at the handshake, never
written). Its ``connect`` offers ``kvsum/1``, so the victim reads what it sends as
summaries, except for the lookup flood, in vLLM's base dialect so that it floods
vLLM's own tier alike. The attacks, one a row:

* ``lookup-flood``: ``--phase KIND:N`` after ``--phase`` (``random``: random keys;
  ``real``: keys the victim holds, ``serve --preload``'s or with ``--bench-keys``
  the bench producer's; ``rounds``: real keys, all in one request, a new round
  each), ``--keys`` keys a lookup under a fresh request id, at most ``--window``
  unanswered, never fetched (``--close``: each closed once answered); after each
  phase ``PHASE {...}`` (lookups sent and answered, keys HIT, seconds, rate). It
  runs at normal priority (the flood is the victim's load).
* ``register-1m``: register ``--blocks`` (1,000,000) blocks of a region mapped
  lazily (anonymous, never touched: it costs us nothing) and send a valid
  snapshot claiming that many fingerprints, in parts of 65,536 paced 10 ms apart.
* ``snapshot-flood``: ``--count`` (300) one-part snapshots of 65,536 fingerprints,
  each newer than the last.
* ``deltas-mid-snapshot``: part 0 of a 2-part snapshot, then ``--count`` (255)
  deltas of 65,536 fingerprints each, then the last part.
* ``liar``: claim the keys ``p2pactor serve --preload --claims`` would hold, answer
  HIT to every lookup and ``transfer_done(success=false)`` to every fetch, until
  stdin closes. Here the victim is a consumer that chooses its sources itself.
* ``refused-frame``: for each of ``--sizes`` (bytes) and ``--modes`` (``session``:
  after a handshake; ``fresh``: the first frame of a new connection), one
  ``kvsum_delta`` whose ``add`` is an array of empty maps, which the decoder
  must refuse; a new session for each.
* ``resync-flood``: ``--count`` (100,000) ``kvsum_resync`` as fast as libzmq takes
  them, counting the snapshot parts they earn.
* ``epoch-flip``: ``--count`` (3,000) deltas, each of a new epoch, counting the
  resyncs they earn.
* ``max-frames``: ``--count`` (2,000) snapshot parts of 65,536 fingerprints (the
  largest summary frame, 524,365 bytes) as fast as the victim takes them (the
  DEALER's queue is libzmq's default 1000, so a send waits once it lags).
* ``max-lookups``: ``--count`` (300) lookups of 65,536 keys of 36 bytes (the
  most keys a frame may carry, 2.4 MiB), each a new request, likewise.

What it prints, one line each, JSON after the word: ``READY peer`` once the
handshake is done and the victim's own snapshot has arrived; per step ``STEP
{label}`` (with ``--paced`` it then waits for a line on stdin, so the driver
can measure the victim first), ``DONE {...}`` (the step's window in unix time,
what it sent and received); at the end ``RESULT {...}`` (every message type
received); then with ``--linger`` it holds the session until stdin closes;
then it says ``disconnect``, prints ``LEFT`` and exits 0. Any failure exits 1
with ``ERROR ...``.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import threading

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from collections.abc import Sequence

import trio
import zmq

from p2pactor.adapters.nixl import open_nixl_transport
from p2pactor.programs.bench._attacks import (
    ATTACKS,
    DEFAULT_BLOCKS,
    DEFAULT_COUNTS,
    SMALL_BLOCKS,
    AttackContext,
    say,
    wait_go,
)
from p2pactor.programs.bench._hostile_peer import Failure


def _watch_stdin(closed: threading.Event) -> None:
    while sys.stdin.readline():
        pass
    closed.set()


def _attack(args: argparse.Namespace, metadata: bytes, base_addr: int, blocks: int) -> int:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a = AttackContext(args, ctx, metadata, base_addr, blocks)
    try:
        if args.paced:  # the driver reads the victim before we connect
            say("LOADED")
            wait_go()
        if args.attack != "refused-frame":
            a.peer = a.open_session()
        say(f"READY {a.peer.peer_id if a.peer else '-'}")
        if args.attack == "liar":  # it lies until stdin closes
            threading.Thread(target=_watch_stdin, args=(a.stdin_closed,), daemon=True).start()
        ATTACKS[args.attack](a)
        counts = a.peer.inbox.snapshot_counts() if a.peer else {}
        say("RESULT", {"received": counts, "sent": a.peer.sent if a.peer else 0})
        if args.linger and args.attack != "liar":
            _watch_stdin(a.stdin_closed)  # hold the session until stdin closes
    except Failure as exc:
        say(f"ERROR {exc}")
        return 1
    finally:
        if a.peer is not None:
            a.peer.close()
        for stray in a.strays:
            stray.close(disconnect=False)
        ctx.term()
    say("LEFT")
    return 0


_MAP_NORESERVE = 0x4000 if sys.platform == "linux" else 0
"""Linux's ``MAP_NORESERVE``, which Python's :mod:`mmap` does not name before 3.13."""


def _pool(blocks: int, block_len: int) -> memoryview:
    """Our registered memory: a lazily mapped region (never touched, so never resident)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", _MAP_NORESERVE)
    return memoryview(mmap.mmap(-1, blocks * block_len, flags=flags))


async def _run(args: argparse.Namespace) -> int:
    blocks = args.blocks or DEFAULT_BLOCKS.get(args.attack, SMALL_BLOCKS)
    pool = _pool(blocks, args.block_len)
    # One agent name per process: a victim may still know the last attacker's agent.
    name = f"summary-hostile-{os.getpid()}"
    async with open_nixl_transport(pool, args.block_len, name=name) as data:
        # The attack blocks on its sockets: a worker thread, not the trio loop.
        status: int = await trio.to_thread.run_sync(
            _attack, args, data.agent_metadata, data.base_addr, blocks
        )
        return status


def _sizes(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, attack, and return the exit status."""
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--victim", required=True, help="the node's host:port")
    parser.add_argument("--attack", required=True, choices=sorted(ATTACKS))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (our peer id)")
    parser.add_argument("--hash-seed", required=True, help="the victim's hash seed")
    parser.add_argument("--block-len", type=int, required=True, help="the victim's block size")
    parser.add_argument("--blocks", type=int, default=0, help="blocks to register (0: per attack)")
    parser.add_argument("--claims", type=int, default=0, help="register-1m/liar: keys claimed")
    parser.add_argument("--count", type=int, default=0, help="messages (0: the attack's default)")
    parser.add_argument("--sizes", type=_sizes, default=[1 << 20, 4 << 20], help="bytes, a,b,c")
    parser.add_argument(
        "--modes", type=lambda t: t.split(","), default=["session", "fresh"], help="session,fresh"
    )
    parser.add_argument("--drain-s", type=float, default=1.5, help="resync-flood: wait after")
    parser.add_argument("--phase", action="append", default=[], help="lookup-flood: KIND:N")
    parser.add_argument("--keys", type=int, default=16, help="lookup-flood: keys per lookup")
    parser.add_argument("--window", type=int, default=256, help="lookup-flood: most unanswered")
    parser.add_argument("--close", action="store_true", help="lookup-flood: close each request")
    parser.add_argument("--preload", type=int, default=0, help="lookup-flood: serve's --preload")
    parser.add_argument("--bench-keys", type=int, default=0, help="lookup-flood: bench's N keys")
    parser.add_argument("--seed", type=int, default=0, help="lookup-flood: random keys' seed")
    parser.add_argument("--stall-timeout", type=float, default=60.0, help="lookup-flood: s")
    parser.add_argument("--paced", action="store_true", help="wait for a stdin line per step")
    parser.add_argument("--linger", action="store_true", help="leave only once stdin closes")
    parser.add_argument(
        "--own-cpu",
        action="store_true",
        help="compete for the CPU as an ordinary process (default: idle priority, as a peer "
        "on another host, whose own sending takes no CPU from the victim or the honest peer)",
    )
    args = parser.parse_args(argv)
    args.count = args.count or DEFAULT_COUNTS.get(args.attack, 0)
    if not args.own_cpu and args.attack != "lookup-flood" and hasattr(os, "SCHED_IDLE"):
        # On a 2-core machine a peer that sends as fast as it can would take
        # a core from the victim and the honest peer, which a hostile peer on
        # another host never does: what it costs them is what is measured.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    status: int = trio.run(_run, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
