"""The hostile peer of ``p2pactor bench``'s ``summary-attack``: raw sockets, run as a process.

``python -m p2pactor.programs.bench._hostile JSON`` (``victim``, ``hash_seed``,
``block_len``, ``attack`` and any of :data:`OPTIONS`): a :class:`RawPeer` with a real NIXL
agent over lazily mapped memory, offering ``kvsum/1`` (but for the lookup flood), running
one of :data:`ATTACKS` at idle CPU priority (but the flood). Its lines: ``LOADED``; after a
stdin line ``READY peer`` (the handshake done); per step ``STEP label``, after a stdin line
``DONE {...}`` (its unix-time window, figures); ``RESULT``; ``LEFT`` once stdin closes
(exit 0), or ``ERROR ...`` (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import random
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import attrs
import trio
import zmq

from p2pactor.adapters.nixl import open_nixl_transport
from p2pactor.core import protocol as wire
from p2pactor.programs.bench._control_common import say
from p2pactor.programs.bench._hostile_peer import HANDSHAKE_S, Failure, RawPeer

MAX_FPS = 65_536
"""Fingerprints in the largest summary field (``MAX_SUMMARY_BYTES`` / 8)."""
HOST = "127.0.0.1"
FLOOD_KEYS = 16
"""Keys a lookup of the lookup flood (held keys, never fetched, 256 unanswered)."""
DEFAULT_BLOCKS = {"register-1m": 1_000_000} | dict.fromkeys(
    ("snapshot-flood", "deltas-mid-snapshot", "max-frames"), 131_072
)
"""Blocks registered (else 64: the others attack with what they send, not with memory).
131,072 holds two of the largest parts and the deltas buffered meanwhile."""
PART_INTERVAL_S = 0.01
"""Seconds between two parts of the register attack's snapshot (a p2pactor sender's pacing)."""
OPTIONS: dict[str, object] = {
    "blocks": 0,  # blocks to register (0: DEFAULT_BLOCKS)
    "claims": 0,  # register-1m: keys claimed (0: every block)
    "count": 0,  # messages the attack sends
    "sizes": [1 << 20, 4 << 20],  # refused-frame: frame sizes in bytes
    "modes": ["session", "fresh"],  # refused-frame
    "drain_s": 1.5,  # resync-flood: the wait after
}
"""The attacks' options, and their defaults."""


def _epoch() -> bytes:
    return os.urandom(16)  # as p2pactor makes them


def _fps(count: int) -> bytes:
    """``count`` random fingerprints, packed (random: nobody holds them)."""
    return os.urandom(8 * count)


def _snapshot(fps: bytes, epoch: bytes, seq: int = 0, part: int = 0, parts: int = 1) -> Any:
    return wire.KvsumSnapshot(epoch=epoch, upto_seq=seq, part=part, parts=parts, fps=fps)


def refused_frame(size: int) -> bytes:
    """A ``kvsum_delta`` of about ``size`` bytes whose ``add`` is an array of empty maps.

    Written byte by byte: millions of dicts would cost us gigabytes.
    """
    head = b"\x85\xa4type\xabkvsum_delta\xa5epoch\xc4\x01e\xa3seq\x01\xa3add"
    tail = b"\xa6remove\xc4\x00"
    items = max(1, size - len(head) - 5 - len(tail))
    return head + b"\xdd" + items.to_bytes(4, "big") + b"\x80" * items + tail


@attrs.define
class Attack:
    """What an attack has to hand: the options, our NIXL agent and the session."""

    args: argparse.Namespace
    ctx: zmq.Context[zmq.Socket[bytes]]
    agent: tuple[bytes, int, int, int]
    """Our NIXL agent's metadata, base address, blocks and block size."""
    peer: RawPeer | None = None
    strays: list[RawPeer] = attrs.field(factory=list)
    """Connections that never had a session (a refused first frame), closed as we leave."""

    def open_session(self) -> RawPeer:
        """A new session with the victim (a new id), the handshake done."""
        a = self.args
        hwm = 1000 if a.attack in ("max-frames", "max-lookups") else 0
        peer = RawPeer(self.ctx, HOST, a.victim, send_hwm=hwm)
        try:
            peer.handshake(self.agent, a.hash_seed, summaries=a.attack != "lookup-flood")
        except BaseException:
            peer.close(disconnect=False)
            raise
        return peer

    @property
    def session(self) -> RawPeer:
        """The main session (opened before the first step)."""
        assert self.peer is not None
        return self.peer

    def step(self, label: str, body: Callable[[], dict[str, object]]) -> None:
        """Announce a step, wait for the driver's go, run it and report its window."""
        say(f"STEP {label}")
        _wait_go()
        start = time.time()
        result = body()
        say(f"DONE {json.dumps({'label': label, 'start': start, 'end': time.time(), **result})}")


def _wait_go() -> None:
    if not sys.stdin.readline():
        raise Failure("stdin closed before the driver said go")


def _register_1m(a: Attack) -> dict[str, object]:
    """Register ``blocks`` blocks; a valid snapshot claiming ``claims`` (0: all), paced parts."""
    peer, claims, epoch = a.session, a.args.claims or a.agent[2], _epoch()
    parts = -(-claims // MAX_FPS)
    for part in range(parts):
        peer.send(_snapshot(_fps(min(MAX_FPS, claims - part * MAX_FPS)), epoch, 0, part, parts))
        time.sleep(PART_INTERVAL_S)  # paced as p2pactor paces: a snapshot kept, not dropped
    peer.ping("register")
    return {"claimed": claims, "parts": parts, "registered_blocks": a.agent[2]}


def _snapshots(a: Attack) -> dict[str, object]:
    """``count`` snapshot parts of 65,536 fingerprints (the largest summary frame).

    ``snapshot-flood``: whole snapshots; ``max-frames``: parts 0 of 2, as fast as taken.
    """
    peer, epoch, parts = a.session, _epoch(), 2 if a.args.attack == "max-frames" else 1
    for i in range(a.args.count):
        peer.send(_snapshot(_fps(MAX_FPS), epoch, i, 0, parts))
    peer.ping("snapshots")
    return {"frames": a.args.count, "bytes": peer.sent_bytes}


def _deltas_mid_snapshot(a: Attack) -> dict[str, object]:
    """Part 0 of 2, ``count`` deltas of 65,536, then part 1; the resyncs earned."""
    peer, epoch = a.session, _epoch()
    before = peer.counts["kvsum_resync"]
    peer.send(_snapshot(_fps(MAX_FPS), epoch, 0, 0, 2))
    for seq in range(1, a.args.count + 1):
        peer.send(wire.KvsumDelta(epoch=epoch, seq=seq, add=_fps(MAX_FPS), remove=b""))
    peer.send(_snapshot(_fps(MAX_FPS), epoch, 0, 1, 2))
    peer.ping("deltas")
    return {"deltas": a.args.count, "resyncs": peer.counts["kvsum_resync"] - before}


def _refused_frames(a: Attack) -> None:
    """A ``kvsum_delta`` the decoder must refuse (:func:`refused_frame`), a step each.

    Per ``sizes`` and ``modes`` (``session``: after a handshake; ``fresh``: a first frame).
    """
    for size in a.args.sizes:
        frame = refused_frame(size)
        for mode in a.args.modes:

            def body(frame: bytes = frame, mode: str = mode) -> dict[str, object]:
                if mode == "session":
                    peer = a.open_session()
                    try:
                        peer.send(frame)
                        if not peer.disconnected.wait(120):
                            raise Failure("the victim neither refused the frame nor ended us")
                    finally:
                        peer.close(disconnect=False)
                else:  # no connect, the frame first; our ROUTER stays up for the dial-back
                    peer = RawPeer(a.ctx, HOST, a.args.victim)
                    a.strays.append(peer)
                    peer.send(frame)
                return {"mode": mode, "bytes": len(frame), "peer": peer.peer_id}

            a.step(f"refused-frame {mode} {len(frame)}", body)


def _resync_flood(a: Attack) -> dict[str, object]:
    """``count`` ``kvsum_resync``; the snapshot parts earned."""
    peer, count = a.session, a.args.count
    parts0 = peer.counts["kvsum_snapshot"]
    frame = wire.encode(wire.KvsumResync(epoch=b"", from_seq=0))
    for _ in range(count):
        peer.send(frame)
    peer.ping("resync")  # the victim has read every resync
    time.sleep(a.args.drain_s)  # a resync asked last is answered within a second
    return {"resyncs": count, "parts": peer.counts["kvsum_snapshot"] - parts0}


def _epoch_flip(a: Attack) -> dict[str, object]:
    """A snapshot, then ``count`` deltas, each of a new epoch; the resyncs earned."""
    peer = a.session
    peer.send(_snapshot(_fps(16), _epoch()))  # first a whole snapshot, as an honest peer's
    peer.ping("snapshot")
    before = peer.counts["kvsum_resync"]
    for i in range(a.args.count):
        peer.send(wire.KvsumDelta(epoch=_epoch(), seq=1, add=wire.packed([i + 1]), remove=b""))
    peer.ping("flip")  # every resync the deltas earned came before its answer
    return {"messages": a.args.count, "resyncs": peer.counts["kvsum_resync"] - before}


def _max_lookups(a: Attack) -> dict[str, object]:
    """``count`` lookups of 65,536 keys (the most a frame may carry), never closed."""
    peer = a.session
    keys = tuple(os.urandom(32) + bytes(4) for _ in range(wire.MAX_LIST_ITEMS))
    for i in range(a.args.count):
        peer.send(wire.Lookup(kv_request_id=f"big-{i}", keys=keys, round_seq=0))
    return {"frames": a.args.count, "cut": not peer.ping("lookups", may_cut=True)}


def flood(
    peer: RawPeer, count: int, lookup: Callable[[int], wire.Lookup], window: int = 256
) -> dict[str, object]:
    """Send ``lookup(i)`` for i below ``count``, ``window`` unanswered at most; the figures."""
    sent = answered = hits = 0
    start, last = time.perf_counter(), time.monotonic()
    while answered < count:
        while sent - answered < window and sent < count:
            peer.send(lookup(sent))
            sent += 1
        got = peer.take(1.0)
        if isinstance(got, wire.Disconnect):
            raise Failure("the victim disconnected us")
        if isinstance(got, wire.LookupResp):
            answered, hits, last = answered + 1, hits + sum(got.hits), time.monotonic()
        if time.monotonic() - last > HANDSHAKE_S * 2:
            raise Failure(f"no answer for {HANDSHAKE_S * 2:g} s ({answered}/{count})")
    seconds = time.perf_counter() - start
    return {
        "lookups": count,
        "answered": answered,
        "keys_hit": hits,
        "lookups_per_s": round(count / seconds, 1),
    }


def _lookup_flood(a: Attack) -> dict[str, object]:
    """``count`` lookups of :data:`FLOOD_KEYS` preloaded keys, each its own request."""
    from p2pactor.runtime.samples import preload_keys  # noqa: PLC0415 - this attack only

    real, rng = preload_keys(a.args.hash_seed, a.args.preload), random.Random(0)  # noqa: S311

    def lookup(i: int) -> wire.Lookup:
        start = rng.randrange(max(1, len(real) - FLOOD_KEYS + 1))  # reproducible, not secret
        keys = tuple(real[start : start + FLOOD_KEYS])
        return wire.Lookup(kv_request_id=f"flood-{i}", keys=keys, round_seq=0)

    return flood(a.session, a.args.count, lookup)


ATTACKS: dict[str, Callable[[Attack], Any]] = {
    "refused-frame": _refused_frames,
    "lookup-flood": _lookup_flood,
    "register-1m": _register_1m,
    "snapshot-flood": _snapshots,
    "deltas-mid-snapshot": _deltas_mid_snapshot,
    "resync-flood": _resync_flood,
    "epoch-flip": _epoch_flip,
    "max-frames": _snapshots,
    "max-lookups": _max_lookups,
}
"""Each attack by its ``attack`` name: one step (``refused-frame``: its own steps)."""


def _attack(args: argparse.Namespace, agent: tuple[bytes, int, int, int]) -> int:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a = Attack(args, ctx, agent)
    try:
        say("LOADED")  # the driver reads the victim before we connect
        _wait_go()
        if args.attack != "refused-frame":
            a.peer = a.open_session()
        say(f"READY {a.peer.peer_id if a.peer else '-'}")
        body = ATTACKS[args.attack]
        if args.attack == "refused-frame":
            body(a)
        else:
            a.step(args.attack, lambda: body(a))
        say("RESULT")
        while sys.stdin.readline():  # hold the session until stdin closes
            pass
    except Failure as exc:
        say(f"ERROR {exc}")
        return 1
    finally:
        for peer in [*([a.peer] if a.peer else []), *a.strays]:
            peer.close(disconnect=peer is a.peer)
        ctx.term()
    say("LEFT")
    return 0


@contextlib.asynccontextmanager
async def nixl_agent(blocks: int, block_len: int) -> AsyncIterator[tuple[bytes, int, int, int]]:
    """A NIXL agent over ``blocks`` lazily mapped blocks: its metadata, base, blocks, size."""
    # Lazily mapped (MAP_NORESERVE, 0x4000 on Linux), never touched: never resident.
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
    pool = memoryview(mmap.mmap(-1, blocks * block_len, flags=flags))
    # One agent name per process: a victim may still know the last attacker's agent.
    name = f"summary-hostile-{os.getpid()}"
    async with open_nixl_transport(pool, block_len, name=name) as data:
        yield data.agent_metadata, data.base_addr, blocks, block_len


async def _run(args: argparse.Namespace) -> int:
    blocks = args.blocks or DEFAULT_BLOCKS.get(args.attack, 64)
    async with nixl_agent(blocks, args.block_len) as agent:
        # The attack blocks on its sockets: a worker thread, not the trio loop.
        status: int = await trio.to_thread.run_sync(_attack, args, agent)
        return status


def main() -> int:
    """Attack as its one argument (JSON) says; the exit status."""
    args = argparse.Namespace(**OPTIONS | json.loads(sys.argv[1]))
    if args.attack != "lookup-flood" and hasattr(os, "SCHED_IDLE"):
        # On 2 cores a peer sending flat out would take a core from the victim and
        # the honest peer, which one on another host never does.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    status: int = trio.run(_run, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
