"""The raw sockets of the ``summary-attack`` section's hostile peer, and what it hears.

A :class:`RawPeer` is one control session as vLLM 0.33.0 lays it out (a ROUTER
bound on our own ``host:port``, a DEALER with that id dialing the victim), but
speaking p2pactor's dialect: its ``connect`` offers ``kvsum/1`` (and nothing
else), so the victim reads the summary messages it sends. An :class:`Inbox`
thread owns the ROUTER and reads everything the victim says as it arrives
(counted by type, with the time of every snapshot part, so that a rate can be
told), while the attack's thread owns the DEALER and sends as fast as libzmq
takes it: two sockets, one thread each, as libzmq requires.

Used by :mod:`p2pactor.programs.bench._hostile` only: every attack, and the lookup flood
(:meth:`RawPeer.flood`, in vLLM's dialect: no ``kvsum/1`` offered).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
from collections.abc import Callable

import zmq

from p2pactor.core import protocol as wire

_GROUP_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
HANDSHAKE_S = 30.0
"""How long the victim may take to finish the handshake (it registers our memory first)."""
PING_AGAIN_S = 5.0
"""How often a ping that may have been dropped with a cut connection is sent again."""


class Failure(Exception):
    """The attack could not go on; the message says why."""


def fingerprint(key: bytes) -> int:
    """A key's 64-bit summary fingerprint, as ``docs/protocol.md`` defines it.

    Written from the document, not imported: the attacker is a separate
    implementation of the wire format, as a real one would be.
    """
    low = int.from_bytes(key[-12:-4], "big")
    group = int.from_bytes(key[-4:], "big")
    return low ^ ((group * _GROUP_MIX) & _MASK64)


class Inbox:
    """Reads the victim's frames on a thread of its own, counting them as they come.

    Every message but summary data is also queued for the attack's thread
    (:meth:`take`): the handshake's, lookups and fetches (the liar answers
    them), a ``disconnect``. Snapshot parts and deltas are only counted: a
    flood of them must not pile up here.
    """

    def __init__(self, router: zmq.Socket[bytes]) -> None:
        self._router = router
        self._stop = threading.Event()
        self._queue: queue.Queue[wire.Message] = queue.Queue()
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        """Messages received, by wire type (``undecodable`` for a frame that did not decode)."""
        self.part_times: list[float] = []
        """``time.time()`` of every snapshot part received."""
        self.snapshots_whole = 0
        """Snapshots of the victim's received whole (every part of one epoch and ``upto_seq``)."""
        self.disconnected = threading.Event()
        self._parts: dict[tuple[bytes, int, int], set[int]] = {}
        self._thread = threading.Thread(target=self._run, name="inbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            while True:
                try:
                    frames = self._router.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    return  # closed under us: the attack is over
                self._note(frames[-1])

    def _note(self, payload: bytes) -> None:
        try:
            msg = wire.decode(payload)
        except Exception:  # count it: the victim's bytes must never stop us
            with self._lock:
                self.counts["undecodable"] += 1
            return
        with self._lock:
            self.counts[msg.TYPE] += 1
            if isinstance(msg, wire.KvsumSnapshot):
                self.part_times.append(time.time())
                got = self._parts.setdefault((msg.epoch, msg.upto_seq, msg.parts), set())
                got.add(msg.part)
                if len(got) == msg.parts:
                    self.snapshots_whole += 1
                    del self._parts[msg.epoch, msg.upto_seq, msg.parts]
                return
            if isinstance(msg, wire.KvsumDelta):
                return
        if isinstance(msg, wire.Disconnect):
            self.disconnected.set()
        self._queue.put(msg)

    def count(self, type_name: str) -> int:
        """How many messages of ``type_name`` arrived so far."""
        with self._lock:
            return self.counts[type_name]

    def snapshot_counts(self) -> dict[str, int]:
        """The counts by type so far, as a plain dict."""
        with self._lock:
            return dict(self.counts)

    def take(self, timeout: float) -> wire.Message | None:
        """The next queued message, waiting up to ``timeout`` seconds; None if none came."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def wait_for(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``condition()`` holds; raise :class:`Failure` naming ``what`` if not."""
        deadline = time.monotonic() + timeout
        while not condition():
            if self.disconnected.is_set():
                raise Failure(f"the victim disconnected us while waiting for {what}")
            if time.monotonic() > deadline:
                raise Failure(f"no {what} within {timeout:g} s")
            time.sleep(0.005)

    def close(self) -> None:
        """Stop reading (the thread ends within 50 ms)."""
        self._stop.set()
        self._thread.join(timeout=5)


class RawPeer:
    """One session's raw sockets: a ROUTER of our own and a DEALER to the victim.

    Args:
        ctx: The process's ZeroMQ context.
        host: The address to bind our ROUTER on (our id is ``host:port``).
        victim: The victim's ``host:port``.
        send_hwm: The DEALER's send queue (0: unbounded, as a flooder wants it;
            libzmq's default 1000 makes a send wait once the victim lags).
    """

    def __init__(
        self, ctx: zmq.Context[zmq.Socket[bytes]], host: str, victim: str, *, send_hwm: int = 0
    ) -> None:
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.RCVHWM, 0)  # never make the victim think we stopped reading
        port = self.router.bind_to_random_port(f"tcp://{host}")
        self.peer_id = f"{host}:{port}"
        self.dealer = ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, self.peer_id.encode())
        self.dealer.setsockopt(zmq.SNDHWM, send_hwm)
        self.dealer.connect(f"tcp://{victim}")
        self.inbox = Inbox(self.router)
        self.sent = 0
        self.sent_bytes = 0

    def send(self, msg: wire.Message) -> None:
        """Send one message to the victim."""
        self.send_raw(wire.encode(msg))

    def send_raw(self, frame: bytes) -> None:
        """Send one frame as it is (blocks while the DEALER's queue is full)."""
        self.dealer.send(frame)
        self.sent += 1
        self.sent_bytes += len(frame)

    def handshake(
        self,
        metadata: bytes,
        base_addr: int,
        num_blocks: int,
        block_len: int,
        hash_seed: str,
        *,
        summaries: bool = True,
    ) -> None:
        """``connect`` offering ``kvsum/1`` (else vLLM's dialect); ack the victim's; its ack."""
        features = frozenset({wire.FEATURE_SUMMARIES})
        self.send(
            wire.Connect(
                peer_id=self.peer_id,
                agent_metadata=metadata,
                base_addr=base_addr,
                num_blocks=num_blocks,
                block_len=block_len,
                hash_seed=hash_seed,
                extension=(
                    wire.ConnectExtension(version=1, features=features) if summaries else wire.UNSET
                ),
            )
        )
        connected = acked = False
        deadline = time.monotonic() + HANDSHAKE_S
        while not (connected and acked):
            if time.monotonic() > deadline:
                raise Failure(f"no handshake with the victim within {HANDSHAKE_S:g} s")
            msg = self.inbox.take(0.1)
            if isinstance(msg, wire.Connect):
                connected = True
                self.send(wire.ConnectAck(peer_id=self.peer_id))
            elif isinstance(msg, wire.ConnectAck):
                acked = True
            elif isinstance(msg, wire.Disconnect):
                raise Failure("the victim refused the handshake (it sent disconnect)")

    def wait_snapshot(self, timeout: float = HANDSHAKE_S) -> None:
        """Wait for the victim's first snapshot, whole (it sends it once the session is ready)."""
        self.inbox.wait_for(lambda: self.inbox.snapshots_whole > 0, timeout, "snapshot")

    def ping(self, label: str, timeout: float = 120.0, *, may_cut: bool = False) -> bool:
        """Wait until the victim has stepped everything we sent before this call.

        The victim steps one connection's frames in order, so the answer to a
        lookup sent now comes after it stepped every frame before it. The
        lookup is of one key nobody holds, and its request is closed at once.

        Returns:
            True once answered; False if the victim cut us off first (only
            with ``may_cut``). A victim that cuts a flooding peer drops what
            it had not handled, this lookup too, and tells it nothing: the
            lookup is sent again every :data:`PING_AGAIN_S`, and the victim
            answers one on a connection it no longer has with a ``disconnect``.

        Raises:
            Failure: No answer within ``timeout``, or cut off without ``may_cut``.
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
            msg = self.inbox.take(min(remaining, 0.5))
            if isinstance(msg, wire.LookupResp) and msg.kv_request_id == kv:
                break
            if isinstance(msg, wire.Disconnect):
                if may_cut:
                    return False
                raise Failure(f"the victim disconnected us before it answered {kv}")
        self.send(wire.Fetch(kv_request_id=kv, keys=(), block_indexes=(), round_seq=0))
        return True

    def flood(
        self,
        kind: str,
        count: int,
        keys: Callable[[], tuple[bytes, ...]],
        window: int,
        stall_s: float,
        *,
        close: bool = False,
    ) -> dict[str, object]:
        """``count`` lookups of ``keys()``, at most ``window`` unanswered; the figures.

        Each under a fresh request id, or (``kind`` ``rounds``) all in one request, a
        new round each; with ``close``, each request closed (the empty fetch) once
        answered, so that it is served in full.
        """
        sent = answered = hits = 0
        start = time.perf_counter()
        last = time.monotonic()
        while answered < count:
            while sent - answered < window and sent < count:
                rounds = kind == "rounds"
                kv = "flood" if rounds else f"flood-{kind}-{sent}"
                self.send(wire.Lookup(kv_request_id=kv, keys=keys(), round_seq=sent * rounds))
                sent += 1
            got = self.inbox.take(1.0)
            if isinstance(got, wire.Disconnect):
                raise Failure("the victim disconnected us")
            if isinstance(got, wire.LookupResp):
                answered += 1
                hits += sum(got.hits)
                last = time.monotonic()
                if close:
                    kv = got.kv_request_id
                    self.send(wire.Fetch(kv_request_id=kv, keys=(), block_indexes=(), round_seq=0))
            if time.monotonic() - last > stall_s:
                raise Failure(f"no answer for {stall_s:g} s ({answered}/{count})")
        seconds = time.perf_counter() - start
        return {
            "phase": kind,
            "lookups": count,
            "answered": answered,
            "keys_hit": hits,
            "seconds": round(seconds, 3),
            "lookups_per_s": round(count / seconds, 1),
        }

    def close(self, *, disconnect: bool = True) -> None:
        """Say ``disconnect`` (unless told not to) and close both sockets."""
        if disconnect:
            self.send(wire.Disconnect())
        self.dealer.close(linger=1000)
        self.inbox.close()
        self.router.close(linger=0)
