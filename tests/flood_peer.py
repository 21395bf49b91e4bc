"""A hostile raw peer that floods a node with lookups, run as a separate process.

Used by ``tests/test_quotas.py`` and ``benchmarks/flood.py``. It speaks the wire
protocol with bare pyzmq sockets laid out as vLLM 0.33.0 lays them out (a ROUTER
bound on ``--host``, a DEALER with our id dialing the victim), in vLLM's base
dialect. Its NIXL agent is real (the victim registers its memory at the
handshake) but never used: it only looks up, never fetches, never closes.

It prints ``READY host:port`` (its peer id) once the handshake is done, then
floods phase after phase (``--phase random:N`` looks up N lookups of random
keys, ``--phase real:N`` of keys the victim holds: ``--preload`` blocks of
``p2pactor serve --preload``), each lookup under a fresh request id and with
``--keys`` keys (``--phase rounds:N``: real keys, all in one request, each
lookup for a new round), keeping at most ``--window`` lookups unanswered (more, and the
victim's transport would drop the connection as a flood before any quota is
reached). After each phase it prints one line ``PHASE {json}``: lookups sent
and answered, keys answered HIT, seconds. With ``--close`` it closes every
request (the empty fetch) as soon as its answer arrives, so each lookup is
served in full instead of being refused for too many open requests. It ends
with a ``disconnect`` and exits 0; any failure exits 1 with ``ERROR ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import trio
import zmq

from p2pactor import protocol as wire
from p2pactor.adapters.nixl import open_nixl_transport
from p2pactor.serve import preload_keys

POOL_BLOCKS = 4


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


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
        self.rng = random.Random(args.seed)
        self.real = preload_keys(args.hash_seed, args.preload) if args.preload else []

    def send(self, msg: wire.Message) -> None:
        self.dealer.send(wire.encode(msg))

    def receive(self, timeout: float) -> list[wire.Message]:
        """Everything that arrived, waiting up to ``timeout`` for the first frame."""
        if not self.router.poll(int(timeout * 1000)):
            return []
        out = []
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
        count = self.args.keys
        if kind == "random":
            return tuple(self.rng.randbytes(32) + bytes(4) for _ in range(count))
        start = self.rng.randrange(max(1, len(self.real) - count + 1))
        return tuple(self.real[start : start + count])

    def phase(self, kind: str, count: int) -> dict[str, object]:
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
            for msg in self.receive(1.0):
                if isinstance(msg, wire.LookupResp):
                    answered += 1
                    hits += sum(msg.hits)
                    last_progress = time.monotonic()
                    if self.args.close:
                        self.send(
                            wire.Fetch(
                                kv_request_id=msg.kv_request_id,
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
        self.send(wire.Disconnect())
        self.dealer.close(linger=1000)
        self.router.close(linger=0)
        self.ctx.term()


def parse_phases(specs: list[str], *, real: bool) -> list[tuple[str, int]]:
    phases = []
    for spec in specs:
        kind, _, count = spec.partition(":")
        if kind not in ("random", "real", "rounds") or not count.isdigit():
            raise Failure(f"bad --phase {spec!r}: random:N, real:N or rounds:N")
        if kind in ("real", "rounds") and not real:
            raise Failure("--phase real needs --preload")
        phases.append((kind, int(count)))
    return phases


def flood(args: argparse.Namespace, metadata: bytes, base_addr: int) -> int:
    flooder = Flooder(args, metadata, base_addr)
    try:
        phases = parse_phases(args.phase, real=bool(flooder.real))
        flooder.handshake()
        say(f"READY {flooder.peer_id}")
        for kind, count in phases:
            say("PHASE " + json.dumps(flooder.phase(kind, count)))
    except Failure as exc:
        say(f"ERROR {exc}")
        return 1
    finally:
        flooder.close()
    return 0


async def main(args: argparse.Namespace) -> int:
    pool = bytearray(POOL_BLOCKS * args.block_len)
    async with open_nixl_transport(pool, args.block_len, name="flood") as data:
        return await trio.to_thread.run_sync(flood, args, data.agent_metadata, data.base_addr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--victim", required=True, help="the node's host:port")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (our peer id)")
    parser.add_argument("--hash-seed", required=True, help="the victim's hash seed")
    parser.add_argument("--block-len", type=int, required=True, help="the victim's block size")
    parser.add_argument("--preload", type=int, default=0, help="the victim's --preload")
    parser.add_argument("--phase", action="append", default=[], help="random:N or real:N")
    parser.add_argument("--keys", type=int, default=16, help="keys per lookup")
    parser.add_argument("--window", type=int, default=256, help="most lookups unanswered")
    parser.add_argument("--close", action="store_true", help="close each request when answered")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random keys")
    parser.add_argument("--stall-timeout", type=float, default=60.0, help="seconds")
    sys.exit(trio.run(main, parser.parse_args()))
