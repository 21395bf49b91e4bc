"""A hostile raw peer that floods a node with lookups, run as a separate process.

``python -m p2pactor.programs.bench._flood_hostile --victim HOST:PORT ...``. Used by the
``flood`` section of ``p2pactor bench`` and by ``tests/test_quotas.py``. It
speaks the wire protocol with bare pyzmq sockets laid out as vLLM 0.33.0 lays
them out (a ROUTER bound on ``--host``, a DEALER with our id dialing the
victim), in vLLM's base dialect, so it floods a p2pactor node and vLLM's own
P2P tier alike. Its NIXL agent is real (the victim registers its memory at the
handshake) but never used: it only looks up, never fetches, never closes.

It prints ``READY host:port`` (its peer id) once the handshake is done, then
floods phase after phase (``--phase random:N`` looks up N lookups of random
keys, ``--phase real:N`` of keys the victim holds: either ``--preload`` blocks
of ``p2pactor serve --preload``, or with ``--bench-keys`` the first N keys of
the bench's producers, :data:`p2pactor.programs.bench._control_peer.KEYS`), each lookup
under a fresh request id and with ``--keys`` keys (``--phase rounds:N``: real
keys, all in one request, each lookup for a new round), keeping at most
``--window`` lookups unanswered (more, and a p2pactor victim's transport would
drop the connection as a flood before any quota is reached). After each phase
it prints one line ``PHASE {json}``: lookups sent and answered, keys answered
HIT, seconds, lookups per second. With ``--close`` it closes every request (the
empty fetch) as soon as its answer arrives, so each lookup is served in full
instead of being refused for too many open requests. It ends with a
``disconnect`` (with ``--linger``: once its stdin closes, so that the victim's
work after the flood can be told apart from the flood) and exits 0; any
failure exits 1 with ``ERROR ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from collections.abc import Sequence

import trio
import zmq

from p2pactor.adapters.nixl import open_nixl_transport
from p2pactor.core import protocol as wire

__all__ = ["POOL_BLOCKS", "Failure", "Flooder", "main", "real_keys"]

POOL_BLOCKS = 4
"""Blocks of the hostile peer's own pool (registered, never written)."""


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def real_keys(args: argparse.Namespace) -> list[bytes]:
    """The keys the victim holds: ``--bench-keys`` of the bench, or ``serve --preload``'s."""
    if args.bench_keys:
        from p2pactor.programs.bench._control_peer import KEYS  # noqa: PLC0415

        return list(KEYS[: args.bench_keys])
    if args.preload:
        # Imported here: only the tests' victims preload serve's keys.
        from p2pactor.runtime.samples import preload_keys  # noqa: PLC0415

        return preload_keys(args.hash_seed, args.preload)
    return []


class Failure(Exception):
    """The flood could not go on; the message says why."""


class Flooder:
    """The raw sockets and the flood loop (blocking; runs in a worker thread)."""

    def __init__(self, args: argparse.Namespace, metadata: bytes, base_addr: int) -> None:
        self.args = args
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, 0)
        port = self.router.bind_to_random_port(f"tcp://{args.host}")
        self.peer_id = f"{args.host}:{port}"
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, self.peer_id.encode())
        self.dealer.setsockopt(zmq.SNDHWM, 0)
        self.dealer.connect(f"tcp://{args.victim}")
        self.metadata = metadata
        self.base_addr = base_addr
        self.rng = random.Random(args.seed)  # noqa: S311 - reproducible junk keys, not secrets
        self.real = real_keys(args)

    def send(self, msg: wire.Message) -> None:
        """Send one message to the victim."""
        self.dealer.send(wire.encode(msg))

    def receive(self, timeout: float) -> list[wire.Message]:
        """Everything that arrived, waiting up to ``timeout`` for the first frame."""
        if not self.router.poll(int(timeout * 1000)):
            return []
        out: list[wire.Message] = []
        while True:
            try:
                _identity, payload = self.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = wire.decode(payload)
            if isinstance(msg, wire.Disconnect):
                raise Failure("the victim disconnected us")
            out.append(msg)

    def handshake(self) -> None:
        """Connect as vLLM does: send ``connect``; ack the victim's; wait for its ack."""
        self.send(
            wire.Connect(
                peer_id=self.peer_id,
                agent_metadata=self.metadata,
                base_addr=self.base_addr,
                num_blocks=POOL_BLOCKS,
                block_len=self.args.block_len,
                hash_seed=self.args.hash_seed,
            )
        )
        connected = acked = False
        deadline = time.monotonic() + 30
        while not (connected and acked):
            if time.monotonic() > deadline:
                raise Failure("no handshake with the victim within 30 s")
            for msg in self.receive(1.0):
                if isinstance(msg, wire.Connect):
                    connected = True
                    self.send(wire.ConnectAck(peer_id=self.peer_id))
                elif isinstance(msg, wire.ConnectAck):
                    acked = True

    def keys(self, kind: str) -> tuple[bytes, ...]:
        """The keys of the next lookup: random, or a random window of the real ones."""
        count = self.args.keys
        if kind == "random":
            return tuple(self.rng.randbytes(32) + bytes(4) for _ in range(count))
        start = self.rng.randrange(max(1, len(self.real) - count + 1))
        return tuple(self.real[start : start + count])

    def phase(self, kind: str, count: int) -> dict[str, object]:
        """Flood ``count`` lookups of ``kind``, at most ``--window`` unanswered; the figures."""
        window = self.args.window
        sent = answered = hits = 0
        start = time.perf_counter()
        last_progress = time.monotonic()
        while answered < count:
            while sent - answered < window and sent < count:
                if kind == "rounds":  # one request, a new round every lookup
                    msg = wire.Lookup(kv_request_id="flood", keys=self.keys(kind), round_seq=sent)
                else:
                    kv = f"flood-{kind}-{sent}"
                    msg = wire.Lookup(kv_request_id=kv, keys=self.keys(kind), round_seq=0)
                self.send(msg)
                sent += 1
            for got in self.receive(1.0):
                if isinstance(got, wire.LookupResp):
                    answered += 1
                    hits += sum(got.hits)
                    last_progress = time.monotonic()
                    if self.args.close:
                        self.send(
                            wire.Fetch(
                                kv_request_id=got.kv_request_id,
                                keys=(),
                                block_indexes=(),
                                round_seq=0,
                            )
                        )
            if time.monotonic() - last_progress > self.args.stall_timeout:
                raise Failure(f"no answer for {self.args.stall_timeout:g} s ({answered}/{count})")
        seconds = time.perf_counter() - start
        return {
            "phase": kind,
            "lookups": count,
            "answered": answered,
            "keys_hit": hits,
            "seconds": round(seconds, 3),
            "lookups_per_s": round(count / seconds, 1),
        }

    def close(self) -> None:
        """Say ``disconnect`` and close the sockets."""
        self.send(wire.Disconnect())
        self.dealer.close(linger=1000)
        self.router.close(linger=0)
        self.ctx.term()


def _parse_phases(specs: Sequence[str], *, real: bool) -> list[tuple[str, int]]:
    phases = []
    for spec in specs:
        kind, _, count = spec.partition(":")
        if kind not in ("random", "real", "rounds") or not count.isdigit():
            raise Failure(f"bad --phase {spec!r}: random:N, real:N or rounds:N")
        if kind in ("real", "rounds") and not real:
            raise Failure(f"--phase {kind} needs --preload or --bench-keys")
        phases.append((kind, int(count)))
    return phases


def _flood(args: argparse.Namespace, metadata: bytes, base_addr: int) -> int:
    flooder = Flooder(args, metadata, base_addr)
    try:
        phases = _parse_phases(args.phase, real=bool(flooder.real))
        flooder.handshake()
        _say(f"READY {flooder.peer_id}")
        for kind, count in phases:
            _say("PHASE " + json.dumps(flooder.phase(kind, count)))
        if args.linger:
            sys.stdin.read()  # hold the session, idle, until told to leave
    except Failure as exc:
        _say(f"ERROR {exc}")
        return 1
    finally:
        flooder.close()
    return 0


async def _run(args: argparse.Namespace) -> int:
    pool = bytearray(POOL_BLOCKS * args.block_len)
    # One agent name per process: a victim may still know the last flooder's agent.
    name = f"flood-{os.getpid()}"
    async with open_nixl_transport(pool, args.block_len, name=name) as data:
        # The flood loop blocks on its sockets: a worker thread, not the trio loop.
        return await trio.to_thread.run_sync(_flood, args, data.agent_metadata, data.base_addr)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the arguments, flood, and return the exit status."""
    assert __doc__ is not None
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--victim", required=True, help="the node's host:port")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (our peer id)")
    parser.add_argument("--hash-seed", required=True, help="the victim's hash seed")
    parser.add_argument("--block-len", type=int, required=True, help="the victim's block size")
    parser.add_argument("--preload", type=int, default=0, help="the victim's --preload")
    parser.add_argument(
        "--bench-keys", type=int, default=0, help="the victim holds the bench's first N keys"
    )
    parser.add_argument(
        "--phase", action="append", default=[], help="random:N, real:N or rounds:N (repeatable)"
    )
    parser.add_argument("--keys", type=int, default=16, help="keys per lookup")
    parser.add_argument("--window", type=int, default=256, help="most lookups unanswered")
    parser.add_argument("--close", action="store_true", help="close each request when answered")
    parser.add_argument("--linger", action="store_true", help="disconnect only once stdin closes")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random keys")
    parser.add_argument("--stall-timeout", type=float, default=60.0, help="seconds")
    status: int = trio.run(_run, parser.parse_args(argv))
    return status


if __name__ == "__main__":
    sys.exit(main())
