"""A hostile p2pactor peer that attacks a node through its summaries, run as a process.

``python -m p2pactor.programs.bench._summary_hostile --victim HOST:PORT --attack NAME ...``.
Used by the ``summary-attack`` section of ``p2pactor bench`` and by
``tests/test_summary_attack.py``. Like :mod:`p2pactor.programs.bench._flood_hostile`
it is bare pyzmq laid out as vLLM lays its sockets out, with a real NIXL agent
(the victim registers its memory at the handshake, never written), but it
speaks p2pactor's dialect: its ``connect`` offers ``kvsum/1``, so the victim
reads what it sends as summaries. The attacks (issue 30), one a row:

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
import json
import mmap
import os
import sys
import threading
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from collections.abc import Callable, Sequence

import attrs
import trio
import zmq

from p2pactor.adapters.nixl import open_nixl_transport
from p2pactor.core import protocol as wire
from p2pactor.programs.bench._summary_peer import Failure, RawPeer, fingerprint

__all__ = ["ATTACKS", "DEFAULT_BLOCKS", "MAX_FPS", "main", "refused_frame"]

MAX_FPS = 65_536
"""Fingerprints in the largest summary field (``MAX_SUMMARY_BYTES`` / 8)."""
EPOCH_BYTES = 16
"""Epochs as p2pactor makes them: 16 random bytes."""
DEFAULT_BLOCKS = {
    "register-1m": 1_000_000,
    "snapshot-flood": 131_072,
    "deltas-mid-snapshot": 131_072,
    "max-frames": 131_072,
}
"""Blocks each attack registers unless ``--blocks`` says (others: :data:`SMALL_BLOCKS`).
131,072 leaves room for two of the largest parts a summary sends (65,536 keys each)
and for the deltas buffered meanwhile; more would only add what the victim's NIXL
costs per registered block, which ``register-1m`` measures on its own."""
DEFAULT_COUNTS = {
    "snapshot-flood": 300,
    "deltas-mid-snapshot": 255,
    "resync-flood": 100_000,
    "epoch-flip": 3_000,
    "max-frames": 2_000,
    "max-lookups": 300,
}
"""Messages each attack sends unless ``--count`` says."""
SMALL_BLOCKS = 64
"""Blocks the other attacks register: they attack with what they send, not with memory."""
_MAP_NORESERVE = 0x4000 if sys.platform == "linux" else 0
"""Linux's ``MAP_NORESERVE``, which Python's :mod:`mmap` does not name before 3.13."""


def _say(word: str, body: object = None) -> None:
    text = word if body is None else f"{word} {json.dumps(body)}"
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _wait_go() -> None:
    """Wait for the driver's line on stdin (it measures the victim first)."""
    if not sys.stdin.readline():
        raise Failure("stdin closed before the driver said go")


def refused_frame(size: int) -> bytes:
    """A ``kvsum_delta`` of about ``size`` bytes whose ``add`` is an array of empty maps.

    Written byte by byte (a list of millions of dicts would cost us gigabytes):
    a map of ``type``, ``epoch``, ``seq``, ``add`` (array32 of ``0x80``, the
    empty map) and ``remove``, in the field order of the message.
    """
    head = b"\x85\xa4type\xabkvsum_delta\xa5epoch\xc4\x01e\xa3seq\x01\xa3add"
    tail = b"\xa6remove\xc4\x00"
    items = max(1, size - len(head) - 5 - len(tail))
    return head + b"\xdd" + items.to_bytes(4, "big") + b"\x80" * items + tail


def _fps(count: int) -> bytes:
    """``count`` random fingerprints, packed (random: nobody holds them)."""
    return os.urandom(8 * count)


@attrs.define
class AttackContext:
    """What an attack has to hand: the options, our NIXL agent and the session."""

    args: argparse.Namespace
    ctx: zmq.Context[zmq.Socket[bytes]]
    metadata: bytes
    base_addr: int
    num_blocks: int
    peer: RawPeer | None = None
    strays: list[RawPeer] = attrs.field(factory=list)
    """Connections that never had a session (a refused first frame), closed as we leave."""
    stdin_closed: threading.Event = attrs.field(factory=threading.Event)

    def open_session(self) -> RawPeer:
        """A new session with the victim (a new id), the handshake done."""
        args = self.args
        hwm = 1000 if args.attack in ("max-frames", "max-lookups") else 0
        peer = RawPeer(self.ctx, args.host, args.victim, send_hwm=hwm)
        try:
            peer.handshake(
                self.metadata, self.base_addr, self.num_blocks, args.block_len, args.hash_seed
            )
            peer.wait_snapshot()
        except BaseException:
            peer.close(disconnect=False)
            raise
        return peer

    def step(self, label: str, body: Callable[[], dict[str, object]]) -> None:
        """Announce a step, wait for the driver if paced, run it and report its window."""
        _say("STEP", {"label": label})
        if self.args.paced:
            _wait_go()
        start = time.time()
        result = body()
        _say("DONE", {"label": label, "start": start, "end": time.time(), **result})

    def session(self) -> RawPeer:
        """The main session (opened before the first step)."""
        assert self.peer is not None
        return self.peer


PART_INTERVAL_S = 0.01
"""Seconds between two parts of the register attack's snapshot (a p2pactor sender's pacing)."""


def _register_1m(a: AttackContext) -> None:
    def body() -> dict[str, object]:
        peer, claims = a.session(), a.args.claims or a.num_blocks
        parts = -(-claims // MAX_FPS)
        epoch = os.urandom(EPOCH_BYTES)
        for part in range(parts):
            n = min(MAX_FPS, claims - part * MAX_FPS)
            peer.send(
                wire.KvsumSnapshot(epoch=epoch, upto_seq=0, part=part, parts=parts, fps=_fps(n))
            )
            # Paced as a p2pactor sender paces its parts (part_interval_s): a
            # valid snapshot the victim keeps, not a flood it drops.
            time.sleep(PART_INTERVAL_S)
        peer.ping("register")
        return {"claimed": claims, "parts": parts, "registered_blocks": a.num_blocks}

    a.step("register-1m", body)


def _snapshot_flood(a: AttackContext) -> None:
    def body() -> dict[str, object]:
        peer, epoch = a.session(), os.urandom(EPOCH_BYTES)
        for i in range(a.args.count):
            peer.send(
                wire.KvsumSnapshot(epoch=epoch, upto_seq=i, part=0, parts=1, fps=_fps(MAX_FPS))
            )
        sent = time.time()
        peer.ping("flood")
        return {"snapshots": a.args.count, "fps_each": MAX_FPS, "sent_at": sent}

    a.step("snapshot-flood", body)


def _deltas_mid_snapshot(a: AttackContext) -> None:
    def body() -> dict[str, object]:
        peer, epoch = a.session(), os.urandom(EPOCH_BYTES)
        before = peer.inbox.count("kvsum_resync")
        peer.send(wire.KvsumSnapshot(epoch=epoch, upto_seq=0, part=0, parts=2, fps=_fps(MAX_FPS)))
        for seq in range(1, a.args.count + 1):
            peer.send(wire.KvsumDelta(epoch=epoch, seq=seq, add=_fps(MAX_FPS), remove=b""))
        peer.send(wire.KvsumSnapshot(epoch=epoch, upto_seq=0, part=1, parts=2, fps=_fps(MAX_FPS)))
        peer.ping("deltas")
        return {"deltas": a.args.count, "resyncs": peer.inbox.count("kvsum_resync") - before}

    a.step("deltas-mid-snapshot", body)


def _liar(a: AttackContext) -> None:
    from p2pactor.runtime.samples import preload_keys  # noqa: PLC0415 - this attack only

    peer = a.session()
    keys = preload_keys(a.args.hash_seed, a.args.claims or 200)
    fps = wire.packed([fingerprint(k) for k in keys])
    peer.send(
        wire.KvsumSnapshot(epoch=os.urandom(EPOCH_BYTES), upto_seq=0, part=0, parts=1, fps=fps)
    )
    peer.ping("claimed")
    _say("CLAIMED", {"keys": len(keys)})
    lookups = fetches = aborts = 0
    while not a.stdin_closed.is_set():
        msg = peer.inbox.take(0.05)
        if isinstance(msg, wire.Lookup):
            lookups += 1
            hits = (True,) * len(msg.keys)
            peer.send(wire.LookupResp(kv_request_id=msg.kv_request_id, keys=msg.keys, hits=hits))
        elif isinstance(msg, wire.Fetch) and msg.keys:
            fetches += 1  # a HIT it never delivers: the fetch "failed" at once
            peer.send(
                wire.TransferDone(
                    kv_request_id=msg.kv_request_id, success=False, round_seq=msg.round_seq
                )
            )
        elif isinstance(msg, wire.AbortFetch):
            aborts += 1
            peer.send(wire.AbortAck(kv_request_id=msg.kv_request_id, round_seq=msg.round_seq))
        elif isinstance(msg, wire.Disconnect):
            raise Failure("the victim disconnected the liar")
    _say("DONE", {"label": "liar", "lookups": lookups, "fetches_failed": fetches, "aborts": aborts})


def _refused_frames(a: AttackContext) -> None:
    for size in a.args.sizes:
        frame = refused_frame(size)
        for mode in a.args.modes:

            def body(frame: bytes = frame, mode: str = mode) -> dict[str, object]:
                if mode == "session":
                    peer = a.open_session()
                    try:
                        peer.send_raw(frame)
                        _await_disconnect(peer)
                    finally:
                        peer.close(disconnect=False)
                    return {"mode": mode, "bytes": len(frame), "peer": peer.peer_id}
                # A fresh connection: no connect, the frame first. Our id names
                # a ROUTER of ours, kept open until we leave, so the victim's
                # dial-back finds someone.
                peer = RawPeer(a.ctx, a.args.host, a.args.victim)
                a.strays.append(peer)
                peer.send_raw(frame)
                return {"mode": mode, "bytes": len(frame), "peer": peer.peer_id}

            a.step(f"refused-frame {mode} {len(frame)}", body)


def _await_disconnect(peer: RawPeer) -> None:
    """Wait for the victim's ``disconnect``: it refused our frame and ended the session."""
    if not peer.inbox.disconnected.wait(120):
        raise Failure("the victim neither refused the frame nor ended the session in 120 s")


def _resync_flood(a: AttackContext) -> None:
    def body() -> dict[str, object]:
        peer, count = a.session(), a.args.count
        parts0 = len(peer.inbox.part_times)
        frame = wire.encode(wire.KvsumResync(epoch=b"", from_seq=0))
        t0 = time.time()
        for _ in range(count):
            peer.send_raw(frame)
        sent = time.time()
        peer.ping("resync")  # the victim has read every resync
        t1 = time.time()
        # A resync asked last is answered within a second: its parts count too.
        time.sleep(a.args.drain_s)
        times = peer.inbox.part_times[parts0:]
        return {
            "resyncs": count,
            "frame_bytes": len(frame),
            "send_s": sent - t0,
            "read_s": t1 - t0,
            "parts": len(times),
            "parts_in_flood": sum(1 for t in times if t <= t1),
            "most_parts_in_1s": _most_in(times, 1.0),
        }

    a.step("resync-flood", body)


def _most_in(times: Sequence[float], window: float) -> int:
    """The most of ``times`` (sorted) within any ``window`` seconds."""
    most, first = 0, 0
    for i, t in enumerate(times):
        while t - times[first] > window:
            first += 1
        most = max(most, i - first + 1)
    return most


def _epoch_flip(a: AttackContext) -> None:
    def body() -> dict[str, object]:
        peer = a.session()
        # First a summary as an honest peer's (the victim then has our epoch's
        # snapshot whole); then every message names a new epoch.
        peer.send(
            wire.KvsumSnapshot(
                epoch=os.urandom(EPOCH_BYTES), upto_seq=0, part=0, parts=1, fps=_fps(16)
            )
        )
        peer.ping("snapshot")
        before = peer.inbox.count("kvsum_resync")
        for i in range(a.args.count):
            fp = wire.packed([i + 1])
            peer.send(wire.KvsumDelta(epoch=os.urandom(EPOCH_BYTES), seq=1, add=fp, remove=b""))
        peer.ping("flip")  # every resync the deltas earned came before its answer
        return {"messages": a.args.count, "resyncs": peer.inbox.count("kvsum_resync") - before}

    a.step("epoch-flip", body)


def _max_frames(a: AttackContext) -> None:
    def body() -> dict[str, object]:
        peer, epoch = a.session(), os.urandom(EPOCH_BYTES)
        t0 = time.time()
        for i in range(a.args.count):
            peer.send(
                wire.KvsumSnapshot(epoch=epoch, upto_seq=i, part=0, parts=2, fps=_fps(MAX_FPS))
            )
        sent = time.time()
        peer.ping("frames")
        return {"frames": a.args.count, "bytes": peer.sent_bytes, "send_s": sent - t0}

    a.step("max-frames", body)


def _max_lookups(a: AttackContext) -> None:
    def body() -> dict[str, object]:
        peer = a.session()
        keys = tuple(os.urandom(32) + bytes(4) for _ in range(wire.MAX_LIST_ITEMS))
        t0 = time.time()
        for i in range(a.args.count):
            peer.send(wire.Lookup(kv_request_id=f"big-{i}", keys=keys, round_seq=0))
        sent = time.time()
        answered = peer.ping("lookups", may_cut=True)
        return {
            "frames": a.args.count,
            "bytes": peer.sent_bytes,
            "send_s": sent - t0,
            "cut": not answered,
        }

    a.step("max-lookups", body)


ATTACKS: dict[str, Callable[[AttackContext], None]] = {
    "register-1m": _register_1m,
    "snapshot-flood": _snapshot_flood,
    "deltas-mid-snapshot": _deltas_mid_snapshot,
    "liar": _liar,
    "refused-frame": _refused_frames,
    "resync-flood": _resync_flood,
    "epoch-flip": _epoch_flip,
    "max-frames": _max_frames,
    "max-lookups": _max_lookups,
}
"""Each attack by its ``--attack`` name."""


def _watch_stdin(closed: threading.Event) -> None:
    while sys.stdin.readline():
        pass
    closed.set()


def _attack(args: argparse.Namespace, metadata: bytes, base_addr: int, blocks: int) -> int:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a = AttackContext(args, ctx, metadata, base_addr, blocks)
    try:
        if args.paced:  # the driver reads the victim before we connect
            _say("LOADED")
            _wait_go()
        if args.attack != "refused-frame":
            a.peer = a.open_session()
        _say(f"READY {a.peer.peer_id if a.peer else '-'}")
        if args.attack == "liar":  # it lies until stdin closes
            threading.Thread(target=_watch_stdin, args=(a.stdin_closed,), daemon=True).start()
        ATTACKS[args.attack](a)
        counts = a.peer.inbox.snapshot_counts() if a.peer else {}
        _say("RESULT", {"received": counts, "sent": a.peer.sent if a.peer else 0})
        if args.linger and args.attack != "liar":
            _watch_stdin(a.stdin_closed)  # hold the session until stdin closes
    except Failure as exc:
        _say(f"ERROR {exc}")
        return 1
    finally:
        if a.peer is not None:
            a.peer.close()
        for stray in a.strays:
            stray.close(disconnect=False)
        ctx.term()
    _say("LEFT")
    return 0


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
    if not args.own_cpu and hasattr(os, "SCHED_IDLE"):
        # On a 2-core machine a peer that sends as fast as it can would take
        # a core from the victim and the honest peer, which a hostile peer on
        # another host never does: what it costs them is what is measured.
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    status: int = trio.run(_run, args)
    return status


if __name__ == "__main__":
    sys.exit(main())
