"""The attacks of :mod:`p2pactor.programs.bench._hostile` (its docstring says each), by name.

Each is a function of an :class:`AttackContext` (the options, the NIXL agent, the
session); :data:`ATTACKS` names them for ``--attack``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Sequence

import attrs
import zmq

from p2pactor.core import protocol as wire
from p2pactor.programs.bench._hostile_peer import Failure, RawPeer, fingerprint

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


def say(word: str, body: object = None) -> None:
    text = word if body is None else f"{word} {json.dumps(body)}"
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def wait_go() -> None:
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
            summaries = args.attack != "lookup-flood"
            peer.handshake(
                self.metadata,
                self.base_addr,
                self.num_blocks,
                args.block_len,
                args.hash_seed,
                summaries=summaries,
            )
            if summaries:
                peer.wait_snapshot()
        except BaseException:
            peer.close(disconnect=False)
            raise
        return peer

    def step(self, label: str, body: Callable[[], dict[str, object]]) -> None:
        """Announce a step, wait for the driver if paced, run it and report its window."""
        say("STEP", {"label": label})
        if self.args.paced:
            wait_go()
        start = time.time()
        result = body()
        say("DONE", {"label": label, "start": start, "end": time.time(), **result})

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
    say("CLAIMED", {"keys": len(keys)})
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
    say("DONE", {"label": "liar", "lookups": lookups, "fetches_failed": fetches, "aborts": aborts})


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


def _real_keys(args: argparse.Namespace) -> list[bytes]:
    if args.bench_keys:
        from p2pactor.programs.bench._control_peer import KEYS  # noqa: PLC0415

        return list(KEYS[: args.bench_keys])
    if args.preload:
        from p2pactor.runtime.samples import preload_keys  # noqa: PLC0415

        return preload_keys(args.hash_seed, args.preload)
    return []


def _lookup_flood(a: AttackContext) -> None:
    args, peer = a.args, a.session()
    rng = random.Random(args.seed)  # noqa: S311 - reproducible junk keys, not secrets
    real = _real_keys(args)
    phases = [(kind, int(n)) for kind, _, n in (p.partition(":") for p in args.phase)]
    for kind, _ in phases:
        if kind not in ("random", "real", "rounds") or (kind != "random" and not real):
            raise Failure(f"bad --phase {kind}: random:N, real:N or rounds:N (with real keys)")

    def keys(kind: str) -> tuple[bytes, ...]:
        if kind == "random":
            return tuple(rng.randbytes(32) + bytes(4) for _ in range(args.keys))
        start = rng.randrange(max(1, len(real) - args.keys + 1))
        return tuple(real[start : start + args.keys])

    for kind, count in phases:
        figures = peer.flood(
            kind,
            count,
            functools.partial(keys, kind),
            args.window,
            args.stall_timeout,
            close=args.close,
        )
        say("PHASE", figures)


ATTACKS: dict[str, Callable[[AttackContext], None]] = {
    "lookup-flood": _lookup_flood,
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
