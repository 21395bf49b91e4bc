"""The raw sockets of the bench's hostile peer (:mod:`p2pactor.programs.bench._hostile`).

A :class:`RawPeer` is one control session as vLLM 0.33.0 lays it out (a ROUTER bound on
our own ``host:port``, a DEALER with that id dialing the victim); its ``connect`` may offer
``kvsum/1``, so that the victim reads the summary messages it sends.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import zmq

from p2pactor.core import protocol as wire

HANDSHAKE_S = 30.0
"""How long the victim may take to finish the handshake (it registers our memory first)."""
PING_AGAIN_S = 5.0
"""How often a ping that may have been dropped with a cut connection is sent again."""


class Failure(Exception):
    """The attack could not go on; the message says why."""


class RawPeer:
    """One session's raw sockets: a ROUTER bound on our own ``host:port``, a DEALER to the victim.

    libzmq wants one thread a socket: a reader thread owns the ROUTER, counts every message
    by type and queues all but summary data (a flood of parts must not pile up) for
    :meth:`take`. ``send_hwm``: the DEALER's send queue (0: unbounded, as a flooder wants).
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
        self.sent_bytes = self.snapshots_whole = 0
        # One writer (the reader thread): reads and dict() copies need no lock.
        self.counts: collections.Counter[str] = collections.Counter()
        self.disconnected, self._stop = threading.Event(), threading.Event()
        self._queue: queue.Queue[wire.Message] = queue.Queue()
        self._reader = threading.Thread(target=self._read, name="inbox", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.router.poll(50):
                    continue
                payload = self.router.recv_multipart()[-1]
            except zmq.ZMQError:
                return  # closed under us: the attack is over
            try:
                msg = wire.decode(payload)
            except Exception:  # count it: the victim's bytes must never stop us
                self.counts["undecodable"] += 1
                continue
            self.counts[msg.TYPE] += 1
            # A p2pactor sender sends a snapshot's parts in order: the last ends it.
            if isinstance(msg, wire.KvsumSnapshot) and msg.part == msg.parts - 1:
                self.snapshots_whole += 1
            elif not isinstance(msg, wire.KvsumSnapshot | wire.KvsumDelta):
                if isinstance(msg, wire.Disconnect):
                    self.disconnected.set()
                self._queue.put(msg)

    def take(self, timeout: float) -> wire.Message | None:
        """The next queued message, waiting up to ``timeout`` seconds; None if none came."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def send(self, msg: wire.Message | bytes) -> None:
        """Send one message (or a frame as it is; blocks while the DEALER's queue is full)."""
        frame = msg if isinstance(msg, bytes) else wire.encode(msg)
        self.dealer.send(frame)
        self.sent_bytes += len(frame)

    def handshake(self, blocks: tuple[bytes, int, int, int], seed: str, *, summaries: bool) -> None:
        """``connect`` with our agent's ``blocks`` (metadata, base, count, size); the acks."""
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
        while not (connected and acked and (self.snapshots_whole or not summaries)):
            if time.monotonic() > deadline or self.disconnected.is_set():
                raise Failure(f"disconnected, or no handshake and snapshot in {HANDSHAKE_S:g} s")
            msg = self.take(0.01)
            if isinstance(msg, wire.Connect):
                connected = True
                self.send(wire.ConnectAck(peer_id=self.peer_id))
            acked = acked or isinstance(msg, wire.ConnectAck)

    def ping(self, label: str, timeout: float = 120.0, *, may_cut: bool = False) -> bool:
        """Wait until the victim has stepped everything we sent before: it steps in order.

        The ping is a lookup of one key nobody holds. False if it cut us off first (only
        with ``may_cut``: a cut drops the ping too, so it is sent again every
        :data:`PING_AGAIN_S`, answered with a ``disconnect``); :class:`Failure` past ``timeout``.
        """
        kv = f"ping-{label}"
        ping = wire.Lookup(kv_request_id=kv, keys=(bytes(36),), round_seq=0)
        self.send(ping)
        deadline, again = time.monotonic() + timeout, time.monotonic() + PING_AGAIN_S
        while True:
            if may_cut and time.monotonic() >= again:
                self.send(ping)
                again = time.monotonic() + PING_AGAIN_S
            if (remaining := deadline - time.monotonic()) <= 0:
                raise Failure(f"the victim did not answer a lookup within {timeout:g} s")
            msg = self.take(min(remaining, 0.5))
            if isinstance(msg, wire.LookupResp) and msg.kv_request_id == kv:
                self.send(wire.Fetch(kv_request_id=kv, keys=(), block_indexes=(), round_seq=0))
                return True
            if isinstance(msg, wire.Disconnect):
                if may_cut:
                    return False
                raise Failure(f"the victim disconnected us before it answered {kv}")

    def close(self, *, disconnect: bool = True) -> None:
        """Say ``disconnect`` (unless told not to) and close both sockets."""
        if disconnect:
            self.send(wire.Disconnect())
        self.dealer.close(linger=1000)
        self._stop.set()
        self._reader.join(timeout=5)
        self.router.close(linger=0)
