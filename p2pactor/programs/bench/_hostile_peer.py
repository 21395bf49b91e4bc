"""The raw sockets of the bench's hostile peer (:mod:`p2pactor.programs.bench._hostile`).

A :class:`RawPeer` is one control session as vLLM 0.33.0 lays it out (a ROUTER bound on
our own ``host:port``, a DEALER with that id dialing the victim); its ``connect`` may offer
``kvsum/1``, so that the victim reads the summary messages it sends. A thread owns the
ROUTER and reads everything the victim says as it arrives (counted by type), while the
attack's thread owns the DEALER and sends as fast as libzmq takes it: two sockets, one
thread each, as libzmq requires.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

import zmq

from p2pactor.core import protocol as wire

HANDSHAKE_S = 30.0
"""How long the victim may take to finish the handshake (it registers our memory first)."""
PING_AGAIN_S = 5.0
"""How often a ping that may have been dropped with a cut connection is sent again."""


class Failure(Exception):
    """The attack could not go on; the message says why."""


class RawPeer:
    """One session's raw sockets: a ROUTER of our own and a DEALER to the victim.

    Every message the victim sends but summary data is queued for the attack's thread
    (:meth:`take`); snapshot parts and deltas are only counted (a flood of them must not
    pile up here). ``send_hwm``: the DEALER's send queue (0: unbounded, as a flooder
    wants it; libzmq's default 1000 makes a send wait once the victim lags).
    """

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, victim: str, *, send_hwm: int = 0
    ) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, 0)  # never make the victim think we stopped reading
        self.peer_id = f"{host}:{self.router.bind_to_random_port(f'tcp://{host}')}"
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, self.peer_id.encode())
        self.dealer.setsockopt(zmq.SNDHWM, send_hwm)
        self.dealer.connect(f"tcp://{victim}")
        self.sent_bytes = 0
        self.counts: collections.Counter[str] = collections.Counter()
        """Messages received, by wire type (``undecodable`` for a frame that did not decode)."""
        self.snapshots_whole = 0
        """The victim's snapshots received whole (every part of one epoch and ``upto_seq``)."""
        self.disconnected = threading.Event()
        self._parts: dict[tuple[bytes, int, int], set[int]] = {}
        self._queue: queue.Queue[wire.Message] = queue.Queue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, name="inbox", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            while True:
                try:
                    payload = self.router.recv_multipart(zmq.NOBLOCK)[-1]
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    return  # closed under us: the attack is over
                try:
                    msg = wire.decode(payload)
                except Exception:  # count it: the victim's bytes must never stop us
                    self.count("undecodable", 1)
                    continue
                self.count(msg.TYPE, 1)
                if isinstance(msg, wire.KvsumSnapshot):
                    got = self._parts.setdefault((msg.epoch, msg.upto_seq, msg.parts), set())
                    got.add(msg.part)
                    if len(got) == msg.parts:
                        self.snapshots_whole += 1
                        del self._parts[msg.epoch, msg.upto_seq, msg.parts]
                elif not isinstance(msg, wire.KvsumDelta):
                    if isinstance(msg, wire.Disconnect):
                        self.disconnected.set()
                    self._queue.put(msg)

    def count(self, type_name: str, more: int = 0) -> int:
        """How many messages of ``type_name`` arrived so far (``more``: the reader's count)."""
        with self._lock:
            self.counts[type_name] += more
            return self.counts[type_name]

    def take(self, timeout: float) -> wire.Message | None:
        """The next queued message, waiting up to ``timeout`` seconds; None if none came."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, msg: wire.Message) -> None:
        """Send one message to the victim."""
        self.send_raw(wire.encode(msg))

    def send_raw(self, frame: bytes) -> None:
        """Send one frame as it is (blocks while the DEALER's queue is full)."""
        self.dealer.send(frame)
        self.sent_bytes += len(frame)

    def handshake(self, blocks: tuple[bytes, int, int, int], seed: str, *, summaries: bool) -> None:
        """``connect`` offering ``kvsum/1`` (else vLLM's dialect); ack the victim's; its ack.

        ``blocks``: our NIXL agent's metadata, base address, blocks and block size.
        """
        metadata, base_addr, num_blocks, block_len = blocks
        ext = wire.ConnectExtension(version=1, features=frozenset({wire.FEATURE_SUMMARIES}))
        self.send(
            wire.Connect(
                peer_id=self.peer_id,
                agent_metadata=metadata,
                base_addr=base_addr,
                num_blocks=num_blocks,
                block_len=block_len,
                hash_seed=seed,
                extension=ext if summaries else wire.UNSET,
            )
        )
        connected = acked = False
        deadline = time.monotonic() + HANDSHAKE_S
        while not (connected and acked):
            if time.monotonic() > deadline:
                raise Failure(f"no handshake with the victim within {HANDSHAKE_S:g} s")
            msg = self.take(0.1)
            if isinstance(msg, wire.Connect):
                connected = True
                self.send(wire.ConnectAck(peer_id=self.peer_id))
            acked = acked or isinstance(msg, wire.ConnectAck)
            if isinstance(msg, wire.Disconnect):
                raise Failure("the victim refused the handshake (it sent disconnect)")
        deadline = time.monotonic() + HANDSHAKE_S
        while summaries and not self.snapshots_whole:  # it sends one once the session is up
            if self.disconnected.is_set() or time.monotonic() > deadline:
                raise Failure(f"no snapshot of the victim's within {HANDSHAKE_S:g} s")
            time.sleep(0.005)

    def ping(self, label: str, timeout: float = 120.0, *, may_cut: bool = False) -> bool:
        """Wait until the victim has stepped everything we sent before this call.

        The victim steps one connection's frames in order, so its answer to a lookup
        (of one key nobody holds, closed at once) sent now comes after all of them.
        False if it cut us off first (only with ``may_cut``): a victim that cuts a
        flooding peer drops what it had not handled, this lookup too, so it is sent
        again every :data:`PING_AGAIN_S`, answered on a connection it no longer has
        with a ``disconnect``. Raises :class:`Failure` past ``timeout``.
        """
        kv = f"ping-{label}"
        ping = wire.Lookup(kv_request_id=kv, keys=(bytes(36),), round_seq=0)
        self.send(ping)
        deadline = time.monotonic() + timeout
        again = time.monotonic() + PING_AGAIN_S
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise Failure(f"the victim did not answer a lookup within {timeout:g} s")
            if may_cut and time.monotonic() >= again:
                self.send(ping)
                again = time.monotonic() + PING_AGAIN_S
            msg = self.take(min(remaining, 0.5))
            if isinstance(msg, wire.LookupResp) and msg.kv_request_id == kv:
                break
            if isinstance(msg, wire.Disconnect):
                if may_cut:
                    return False
                raise Failure(f"the victim disconnected us before it answered {kv}")
        self.send(wire.Fetch(kv_request_id=kv, keys=(), block_indexes=(), round_seq=0))
        return True

    def flood(
        self, kind: str, count: int, keys: Callable[[], tuple[bytes, ...]], window: int
    ) -> dict[str, object]:
        """``count`` lookups of ``keys()``, at most ``window`` unanswered; the figures.

        Each under a fresh request id, or (``kind`` ``rounds``) all in one request, a
        new round each; never fetched or closed.
        """
        sent = answered = hits = 0
        start, last = time.perf_counter(), time.monotonic()
        while answered < count:
            while sent - answered < window and sent < count:
                rounds = kind == "rounds"
                kv = "flood" if rounds else f"flood-{kind}-{sent}"
                self.send(wire.Lookup(kv_request_id=kv, keys=keys(), round_seq=sent * rounds))
                sent += 1
            got = self.take(1.0)
            if isinstance(got, wire.Disconnect):
                raise Failure("the victim disconnected us")
            if isinstance(got, wire.LookupResp):
                answered, hits, last = answered + 1, hits + sum(got.hits), time.monotonic()
            if time.monotonic() - last > HANDSHAKE_S * 2:
                raise Failure(f"no answer for {HANDSHAKE_S * 2:g} s ({answered}/{count})")
        seconds = time.perf_counter() - start
        return {
            "phase": kind,
            "lookups": count,
            "answered": answered,
            "keys_hit": hits,
            "lookups_per_s": round(count / seconds, 1),
        }

    def close(self, *, disconnect: bool = True) -> None:
        """Say ``disconnect`` (unless told not to) and close both sockets."""
        if disconnect:
            self.send(wire.Disconnect())
        self.dealer.close(linger=1000)
        self._stop.set()
        self._reader.join(timeout=5)
        self.router.close(linger=0)
