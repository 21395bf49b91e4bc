"""Injected faults, with real processes, real ZeroMQ and real NIXL where data moves.

Each test here is one row of ``docs/reliability.md``. Rows that other modules
already prove (in-memory fault injection, the transports on their own, the
codec's bounds) are listed there with their tests and not repeated here.

The processes:

* ``p2pactor serve`` (the real command line) is the producer: it preloads
  blocks whose keys and bytes the test computes too (``preload_keys``,
  ``block_bytes``), so every fetched byte is verified;
* this file, run as a script (``python tests/test_faults.py``), is a consumer
  node in its own process, driven by JSON lines on stdin (see ``_peer_main``);
  tests SIGKILL or SIGSTOP it;
* ``tests/nixl_peer.py`` holds a consumer's block pool in another process, so
  a test can stop the pool (a WRITE into it then stays in flight) while the
  consumer node runs on.

Where a test must hold a producer's WRITE in flight while the consumer is
alive, the producer's NIXL transport is wrapped in :class:`GatedWrites`: the
write waits at a gate the test opens, then goes through NIXL for real.

Timings are never asserted beyond generous bounds (the CI machine has two
cores): tests assert outcomes, and every wait is under ``trio.fail_after``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

import attrs
import pytest
import trio

from p2pactor.adapters.nixl import NixlDataTransport, import_nixl, open_nixl_transport
from p2pactor.adapters.zmq import ZmqOptions, open_zmq_transport
from p2pactor.core import events as ev
from p2pactor.core import protocol as wire
from p2pactor.core.ids import Role
from p2pactor.core.inputs import LookupResult
from p2pactor.core.timings import Timings
from p2pactor.errors import DataPlaneError, ProtocolError, UnknownMessageType
from p2pactor.programs.hosts import Host
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.keys import CurveSecurity
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.logread import read_log
from p2pactor.runtime.node import Node, open_node
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.runtime.quotas import PeerQuotas
from p2pactor.runtime.samples import block_bytes, preload_keys
from p2pactor.runtime.session import SessionCloseResult, SessionState
from p2pactor.runtime.transport import WriteDone
from p2pactor.surface.replay import replay
from tests.ports import free_port

try:
    import_nixl()
except DataPlaneError as exc:
    pytest.skip(f"no NIXL wheel imports: {exc}", allow_module_level=True)

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
SEED = "faults-seed"
BLOCK_LEN = 16 * 1024
NUM_BLOCKS = 32
FAST = ZmqOptions(
    heartbeat_interval=0.2, heartbeat_timeout=1.0, heartbeat_ttl=1.0, connect_timeout=5.0
)
SCRIPT = Path(__file__).resolve()
ROOT = SCRIPT.parent.parent
PREFIX = "@faults "


def child_env() -> dict[str, str]:
    """Children import p2pactor (and ``tests``) exactly as we do."""
    path = os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])
    return {**os.environ, "PYTHONPATH": path, "NIXL_LOG_LEVEL": "WARN"}


def keys_of(count: int) -> list[bytes]:
    """The keys ``p2pactor serve --preload count --hash-seed SEED`` stores."""
    return preload_keys(SEED, count)


def expected(key: bytes, block_len: int = BLOCK_LEN) -> bytes:
    return block_bytes(key, block_len)


async def wait_until(condition: Callable[[], object], limit: float = 60.0) -> None:
    """Poll ``condition`` (state other threads or processes change) until it holds."""
    with trio.fail_after(limit):
        while not condition():  # noqa: ASYNC110 -- nothing to wait on but the state
            await trio.sleep(0.01)


class LineReader:
    """Lines from a child's stdout; the lines of interest start with a known word."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def line(self, starts: str) -> str:
        while True:
            while b"\n" not in self._buffer:
                chunk = await self._stream.receive_some()
                if not chunk:
                    raise AssertionError(f"the process exited before saying {starts!r}")
                self._buffer += chunk
            raw, self._buffer = self._buffer.split(b"\n", 1)
            text = raw.decode(errors="replace")
            if text.startswith(starts):
                return text


# --- p2pactor serve, as a process ---------------------------------------------------------


@attrs.define
class Serve:
    """A ``p2pactor serve`` process and what the test needs to talk to it."""

    process: trio.Process | subprocess.Popen[bytes]
    node_id: str
    stderr_path: Path

    def alive(self) -> bool:
        """Whether the process runs (trio thread only: it may reap the process)."""
        return self.process.returncode is None and self.process.poll() is None

    def running(self) -> bool:
        """Whether the process runs, from any thread: its state, without reaping it."""
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except FileNotFoundError:
            return False
        return stat.rpartition(")")[2].split()[0] not in ("Z", "X")

    def kill(self) -> None:
        self.process.kill()  # SIGKILL

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


def serve_argv(
    address: str,
    port: int,
    preload: int = 8,
    block_len: int = BLOCK_LEN,
    num_blocks: int = NUM_BLOCKS,
    hash_seed: str = SEED,
    fingerprint: str | None = None,
) -> list[str]:
    """The command line of ``p2pactor serve`` on ``address:port``."""
    argv = [sys.executable, "-m", "p2pactor", "serve", "--host", address]
    argv += ["--port", str(port), "--num-blocks", str(num_blocks), "--block-len", str(block_len)]
    argv += ["--hash-seed", hash_seed, "--preload", str(preload)]
    return argv if fingerprint is None else [*argv, "--fingerprint", fingerprint]


@asynccontextmanager
async def serve_process(
    tmp_path: Path,
    name: str,
    *,
    port: int | None = None,
    preload: int = 8,
    block_len: int = BLOCK_LEN,
    num_blocks: int = NUM_BLOCKS,
    hash_seed: str = SEED,
    fingerprint: str | None = None,
    log: Path | None = None,
    on: Host | None = None,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[Serve]:
    """Run ``p2pactor serve``; yield it once it serves; SIGKILL it on exit.

    It serves on 127.0.0.1, or ``on`` a namespaced host (its address, its
    network, UCX over TCP only); ``extra`` are more ``serve`` flags, ``env``
    more environment variables.
    """
    port = (free_port() if on is None else 5710) if port is None else port
    address = "127.0.0.1" if on is None else on.address
    argv = serve_argv(address, port, preload, block_len, num_blocks, hash_seed, fingerprint)
    if log is not None:
        argv += ["--log", str(log)]
    argv += extra
    environ = {**child_env(), **(env or {})}
    if on is not None:
        argv, environ = on.command(argv), on.env(environ)
    stderr_path = tmp_path / f"{name}.stderr"
    with stderr_path.open("ab") as stderr:
        process = await trio.lowlevel.open_process(
            argv, stdout=subprocess.PIPE, stderr=stderr, env=environ
        )
    try:
        assert process.stdout is not None
        with trio.fail_after(60):
            line = await LineReader(process.stdout).line("p2pactor node")
        assert "serving" in line, line
        yield Serve(process, f"{address}:{port}", stderr_path)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


# --- a consumer node in its own process (this file as a script) ----------------------------


@attrs.define
class ConsumerProcess:
    """``python tests/test_faults.py``: a consumer node driven over stdin/stdout."""

    process: trio.Process
    node_id: str
    reader: LineReader
    replies: dict[tuple[int, str], dict[str, Any]] = attrs.field(factory=dict)
    ids: int = 0

    async def send(self, op: str, **fields: Any) -> int:
        """Start a command in the child; returns its id (replies come tagged with it)."""
        self.ids += 1
        assert self.process.stdin is not None
        line = json.dumps({"op": op, "id": self.ids, **fields}) + "\n"
        await self.process.stdin.send_all(line.encode())
        return self.ids

    async def reply(self, command: int, event: str = "done") -> dict[str, Any]:
        """The child's reply ``event`` to ``command``, waiting for it."""
        while (command, event) not in self.replies:
            message = json.loads((await self.reader.line(PREFIX))[len(PREFIX) :])
            self.replies[message["id"], message["event"]] = message
        return self.replies[command, event]


@asynccontextmanager
async def consumer_process(
    *, on: Host | None = None, extra: Sequence[str] = (), stderr: Path | None = None
) -> AsyncIterator[ConsumerProcess]:
    """This file as a consumer node, on 127.0.0.1 or ``on`` a namespaced host."""
    argv = [sys.executable, str(SCRIPT), "--hash-seed", SEED, *extra]
    env = child_env()
    if on is not None:
        argv, env = on.command([*argv, "--host", on.address]), on.env(env)
    with contextlib.ExitStack() as files:
        err = files.enter_context(stderr.open("ab")) if stderr is not None else None
        process = await trio.lowlevel.open_process(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
        )
    try:
        assert process.stdout is not None
        reader = LineReader(process.stdout)
        with trio.fail_after(60):
            ready = json.loads((await reader.line(PREFIX))[len(PREFIX) :])
        yield ConsumerProcess(process, ready["node_id"], reader)
    finally:
        if process.returncode is None:
            process.kill()
        with trio.CancelScope(shield=True):
            await process.wait()
            for stream in (process.stdin, process.stdout):
                if stream is not None:
                    await stream.aclose()


# --- a node in this process ------------------------------------------------------------------


class GatedWrites:
    """A NIXL data transport whose writes wait at a gate, then run on NIXL for real.

    It holds a producer's WRITE "in flight" for as long as the test wants, with
    the consumer alive: the one thing a real NIXL write cannot be made to do
    on demand. Everything else is the wrapped transport's.
    """

    def __init__(self, inner: NixlDataTransport) -> None:
        self.inner = inner
        self.opened = False
        self.held: list[tuple[str, Sequence[int], Sequence[int], WriteDone]] = []
        self.hold_ends = False
        self.unended = 0  # writes started whose end the node has not been told
        self.ends: list[tuple[WriteDone, str | None]] = []

    @property
    def waiting(self) -> int:
        return len(self.held)

    def open(self, *, hold_ends: bool = False) -> None:
        """Let the held writes (and every later one) go to NIXL.

        With ``hold_ends`` each write runs on NIXL for real but its end waits at a
        second gate (:meth:`end`): a stopped consumer does not stall a write over
        UCX shared memory for sure (a cross-memory-attach put completes one-sided).
        """
        self.opened, self.hold_ends = True, hold_ends
        held, self.held = self.held, []
        for write in held:
            self.start_write(*write)

    def end(self) -> None:
        """Tell the node of the writes that ended meanwhile, and of every later end."""
        self.hold_ends = False
        ends, self.ends = self.ends, []
        for done, error in ends:
            self.unended -= 1
            done(error)

    def _ended(self, done: WriteDone, error: str | None) -> None:
        if self.hold_ends:
            self.ends.append((done, error))
        else:
            self.unended -= 1
            done(error)

    @property
    def agent_metadata(self) -> bytes:
        return self.inner.agent_metadata

    @property
    def base_addr(self) -> int:
        return self.inner.base_addr

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def block_len(self) -> int:
        return self.inner.block_len

    async def add_peer(
        self, peer_id: str, agent_metadata: bytes, base_addr: int, num_blocks: int, block_len: int
    ) -> None:
        await self.inner.add_peer(peer_id, agent_metadata, base_addr, num_blocks, block_len)

    async def remove_peer(self, peer_id: str) -> None:
        await self.inner.remove_peer(peer_id)

    def start_write(
        self,
        peer_id: str,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        done: WriteDone,
    ) -> None:
        if self.opened:
            self.unended += 1
            self.inner.start_write(
                peer_id, local_blocks, remote_blocks, lambda error: self._ended(done, error)
            )
        else:
            self.held.append((peer_id, local_blocks, remote_blocks, done))

    def expect_writes(self, delta: int) -> None:
        self.inner.expect_writes(delta)

    @property
    def late_write_window(self) -> float:
        return self.inner.late_write_window


@attrs.define
class Local:
    """A node in the test's process: real ZeroMQ, real NIXL, an embedded cache."""

    node: Node
    cache: EmbeddedCache
    data: NixlDataTransport
    gated: GatedWrites | None
    log: EventLog

    def events(self, kind: type[ev.Event] | None = None) -> list[Any]:
        return [e for e in self.log.recent() if kind is None or isinstance(e, kind)]


@asynccontextmanager
async def local_node(
    name: str,
    *,
    gated: bool = False,
    block_len: int = BLOCK_LEN,
    num_blocks: int = NUM_BLOCKS,
    log_path: Path | None = None,
    **config: Any,
) -> AsyncIterator[Local]:
    pool = bytearray(num_blocks * block_len)
    cache = EmbeddedCache(num_blocks, block_len, memory=pool)
    async with (
        open_zmq_transport("127.0.0.1:0", port=0, options=FAST) as control,
        open_nixl_transport(pool, block_len, name=name) as data,
    ):
        settings: dict[str, Any] = {"hash_seed": SEED, **config}
        cfg = NodeConfig(
            host="127.0.0.1",
            port=control.port,
            num_blocks=num_blocks,
            block_len=block_len,
            **settings,
        )
        log = EventLog(cfg.node_id, keep=None, path=log_path)
        wrapper = GatedWrites(data) if gated else None
        async with open_node(
            cfg, control=control, data=wrapper or data, parent=cache, event_log=log
        ) as node:
            yield Local(node, cache, data, wrapper, log)


def assert_parent_clean(cache: EmbeddedCache) -> None:
    """Every pin released once, every synthetic request closed once, nothing held."""
    assert cache.pinned() == 0
    assert cache.held_jobs() == set()
    assert cache.opened == set()
    assert all(n == 1 for n in cache.finished.values()), cache.finished
    assert all(n == 1 for n in cache.released.values()), cache.released


def assert_log_checks(local: Local, path: Path) -> None:
    """The node's events, written to ``path``, replay with every invariant holding."""
    with EventLog(local.node.node_id, path=path) as out:
        out.append(local.log.recent())
    result = replay([path], check=True)
    assert not result.violations, result.violations
    assert not result.unfinished, result.unfinished


def _stray(result: SessionCloseResult) -> bool:
    # A disconnect the peer sent as it closed its side can cross our own close:
    # it then arrives as a new connection, whose one-message session ends at
    # once (unanswered, by design), sometimes before the session that matters
    # has finished draining.
    return result.reason.startswith("its first message is a disconnect")


async def closed_with(node: Node, peer: str, limit: float = 60.0) -> str:
    """Wait until a session with ``peer`` has closed; its reason (stray disconnects aside)."""

    def closed() -> list[SessionCloseResult]:
        return [r for r in node.peers.closed_sessions() if r.peer_id == peer and not _stray(r)]

    await wait_until(closed, limit)
    return closed()[0].reason


# --- rows ------------------------------------------------------------------------------------


async def test_a_producer_killed_mid_transfer_fails_the_load_and_spares_everything_else(
    tmp_path: Path,
) -> None:
    """SIGKILL of a producer whose WRITE into us is in flight.

    The consumer's block pool lives in a ``nixl_peer.py`` process, stopped
    before the fetch so that the producer's WRITE stays in flight (as measured
    in ``tests/test_nixl.py``); then the producer is killed. The load fails at
    once with a reason, long before its 30 s deadline; nothing lands in its
    blocks afterwards; the very same blocks then take a second producer's
    fetch, byte for byte, over a session the kill never touched.
    """
    from tests.test_nixl import DataPlaneElsewhere  # noqa: PLC0415
    from tests.test_nixl import peer_process as pool_process  # noqa: PLC0415

    keys = keys_of(4)
    dest = [3, 4, 5, 6]
    zero_sum = _sha256(bytes(BLOCK_LEN * len(dest)))
    with trio.fail_after(120):
        async with (
            serve_process(tmp_path, "p1", preload=4) as p1,
            serve_process(tmp_path, "p2", preload=4) as p2,
            pool_process(NUM_BLOCKS, BLOCK_LEN) as (pool, advertised),
            open_zmq_transport("127.0.0.1:0", port=0, options=FAST) as control,
            open_nixl_transport(bytearray(NUM_BLOCKS * BLOCK_LEN), BLOCK_LEN, name="c") as own,
        ):
            cfg = NodeConfig(
                host="127.0.0.1",
                port=control.port,
                num_blocks=NUM_BLOCKS,
                block_len=BLOCK_LEN,
                hash_seed=SEED,
            )
            data = DataPlaneElsewhere(own, advertised)
            async with open_node(cfg, control=control, data=data) as node:
                # Both sessions up, the pool registered with both producers.
                assert await node.lookup(p1.node_id, "r1", keys) == [HIT] * 4
                assert await node.lookup(p2.node_id, "r2", keys) == [HIT] * 4
                second = node.peers.session(p2.node_id)
                assert second is not None

                pool.process.send_signal(signal.SIGSTOP)
                outcome: list[Any] = []

                async def fetch() -> None:
                    outcome.append(await node.fetch(p1.node_id, "r1", keys, dest))

                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(fetch)
                        # Negative check: a stopped pool ends nothing (a fetch that
                        # failed early would end in milliseconds, not after the window).
                        await trio.sleep(1.0)
                        assert outcome == [], "the write finished while the pool was stopped"
                        p1.kill()
                    [result] = outcome
                finally:
                    pool.process.send_signal(signal.SIGCONT)
                assert not result.success
                assert "session lost" in result.reason, result.reason
                assert "went away" in result.reason, result.reason
                # The session's loss failed it, not its deadline.
                assert "no transfer_done within" not in result.reason, result.reason
                assert "went away" in await closed_with(node, p1.node_id)

                # The blocks no longer change, now that the pool runs again. (What
                # they hold is whatever p1 copied before it died: the stopped pool
                # held up the write's completion, not necessarily its bytes.)
                where = "SUM " + " ".join(map(str, dest))
                at_failure = await pool.ask(where, "SUM")
                await trio.sleep(1.0)  # negative check: nothing lands in them any more
                assert await pool.ask(where, "SUM") == at_failure
                want = _sha256(b"".join(expected(k) for k in keys))
                landed = {zero_sum: "none", want: "all"}.get(at_failure[0], "part")
                print(f"\n[faults] p1's bytes in the failed load's blocks: {landed}")

                # The consumer reuses those very blocks for p2's copy: byte for byte.
                result = await node.fetch(p2.node_id, "r2", keys, dest)
                assert result.success, result.reason
                assert await pool.ask(where, "SUM") == [want]
                await trio.sleep(1.0)  # negative check: nothing late overwrites them
                assert await pool.ask(where, "SUM") == [want]
                assert node.peers.session(p2.node_id) is second, "the kill disturbed p2's session"
                assert second.alive
                node.finish("r1")
                node.finish("r2")
            assert p2.alive()


HOLD = 5.0
"""The consumer process's late-write hold: NIXL's, 4 x its 1 s TCP timeout + 1 (_nixl_options)."""


async def killed_while_held(
    consumer: ConsumerProcess, producer: Serve
) -> tuple[dict[str, Any], float, float]:
    """A load held after its session died of silence; then its producer's process is killed.

    The producer is stopped (SIGSTOP) before the fetch: the consumer's session
    dies of silence (about a second) with the load in flight, and holds its
    blocks, since the producer's write may still land. Then the producer is
    killed. Returns the load's failure, and the seconds from the session's
    loss and from the kill to the failure.
    """
    hexed = [k.hex() for k in keys_of(4)]
    with trio.fail_after(60):
        lookup = await consumer.reply(
            await consumer.send("lookup", peer=producer.node_id, req="held", keys=hexed)
        )
        assert lookup["answers"] == ["hit"] * 4
        producer.process.send_signal(signal.SIGSTOP)
        fetch = await consumer.send(
            "fetch", peer=producer.node_id, req="held", keys=hexed, announce_session_lost=True
        )
        await consumer.reply(fetch, "session_lost")
        lost = trio.current_time()
        producer.kill()
        killed = trio.current_time()
        failed = await consumer.reply(fetch, "failed")
        ended = trio.current_time()
        await consumer.reply(fetch)
        await consumer.reply(await consumer.send("finish", req="held"))
    return failed, ended - lost, ended - killed


async def test_a_dead_producer_on_this_machine_ends_the_hold_at_its_death(tmp_path: Path) -> None:
    """The late-write hold ends as soon as no write can land: the producer's process exited.

    Producer and consumer share this kernel and its network: the consumer
    watches the producer's process (its pid came in the connect), so the kill
    ends the hold at once, not after its 5 s. (tests/test_hosts.py: across
    namespaced hosts the same kill leaves the hold to run out.)
    """
    async with (
        serve_process(tmp_path, "p", preload=4) as producer,
        consumer_process() as consumer,
    ):
        failed, since_lost, since_kill = await killed_while_held(consumer, producer)
    print(
        f"\n[faults] held load failed {since_kill:.2f} s after the kill, {since_lost:.2f} s "
        f"after the session was lost (hold {HOLD:g} s)"
    )
    assert "process exited" in failed["reason"], failed
    assert since_lost < HOLD, "the hold ran out: the producer's death was not seen"


async def test_a_consumer_killed_with_lookups_and_fetches_open_leaves_nothing_held(
    tmp_path: Path,
) -> None:
    """SIGKILL of a consumer that has a fetch in flight, pins unfetched and a lookup parked.

    The producer keeps the pins of the round being written until that WRITE
    ends (it may still read them), releases every other pin and closes every
    synthetic request at once; once the write has failed (NIXL: the remote
    agent is gone), nothing is held and the log's invariants hold.
    """
    keys = [bytes([i]) * 32 + bytes(4) for i in range(10)]
    # A pending key stays pending for the whole test: the lookup stays open.
    slow = Timings(pending_timeout=120.0)
    roomy = PeerQuotas(pinned_blocks_fraction=1.0)
    with trio.fail_after(120):
        async with (
            local_node("producer", gated=True, timings=slow, quotas=roomy) as p,
            consumer_process() as c,
        ):
            assert p.gated is not None
            for k in keys[:9]:
                p.cache.store(k, expected(k))
            p.cache.mark_pending(keys[9])
            hexes = [k.hex() for k in keys]

            fetching = await c.send("lookup", peer=p.node.node_id, req="fetching", keys=hexes[:4])
            assert (await c.reply(fetching))["answers"] == ["hit"] * 4
            await c.send("fetch", peer=p.node.node_id, req="fetching", keys=hexes[:4])
            pinned = await c.send("lookup", peer=p.node.node_id, req="pinned", keys=hexes[4:8])
            assert (await c.reply(pinned))["answers"] == ["hit"] * 4
            await c.send("lookup", peer=p.node.node_id, req="parked", keys=hexes[8:10])

            def of_parked(kind: type[ev.Event]) -> list[Any]:
                return [e for e in p.events(kind) if e.actor.kv_request_id == "parked"]

            await wait_until(lambda: p.gated is not None and p.gated.waiting == 1)
            await wait_until(lambda: of_parked(ev.KeysPinned))  # its hit, at the first serve
            assert of_parked(ev.LookupAnswered) == []  # still waiting for its pending key
            assert p.cache.pinned() == 9  # 4 being written, 4 unfetched, 1 of "parked"
            assert len(p.cache.opened) >= 1  # the parked lookup's synthetic request

            c.process.kill()
            await c.process.wait()
            await wait_until(lambda: (s := p.node.peers.session(c.node_id)) is None or not s.alive)
            # The write may still read its 4 blocks: they stay pinned; the rest is let go.
            await wait_until(lambda: p.cache.pinned() <= 4 and not p.cache.opened)
            await trio.sleep(0.5)  # negative check: the write's 4 stay pinned
            assert p.cache.pinned() == 4
            assert p.cache.opened == set()
            assert not any(r.peer_id == c.node_id for r in p.node.peers.closed_sessions())

            p.gated.open()  # the WRITE goes to NIXL, into a dead agent
            reason = await closed_with(p.node, c.node_id)
            assert "went away" in reason
            [failed] = p.events(ev.TransferFailed)
            assert "NIXL" in failed.reason, failed.reason
            assert p.events(ev.TransferCompleted) == []
            assert p.node.peer_usage(c.node_id).holds_nothing
        assert_parent_clean(p.cache)
    assert_log_checks(p, tmp_path / "producer.p2plog")


async def test_control_lost_while_a_write_runs_no_ack_and_no_release_until_it_ends(
    tmp_path: Path,
) -> None:
    """The control connection dies (heartbeat timeout) while a WRITE is in flight.

    The consumer asks to abort the round while the producer's WRITE waits; it
    is then stopped (SIGSTOP), so the producer's heartbeat gives up on the
    connection. The WRITE runs on NIXL for real, but its end is held at the
    gate until the consumer runs again (a stopped consumer alone does not
    stall a shared-memory write for sure, so the race is forced). Until the
    WRITE ends the producer sends no ``abort_ack`` and releases none of the
    round's pins; only once it ends is everything released.
    """
    keys = [bytes([i]) * 32 + bytes(4) for i in range(4)]
    hexes = [k.hex() for k in keys]
    with trio.fail_after(120):
        async with local_node("producer", gated=True) as p, consumer_process() as c:
            assert p.gated is not None
            for k in keys:
                p.cache.store(k, expected(k))
            looked = await c.send("lookup", peer=p.node.node_id, req="r", keys=hexes)
            assert (await c.reply(looked))["answers"] == ["hit"] * 4
            fetch = await c.send("fetch", peer=p.node.node_id, req="r", keys=hexes, reuse_wait=3)
            await wait_until(lambda: p.gated is not None and p.gated.waiting == 1)
            await c.send("finish", req="r")  # the load is in flight: abort_fetch goes out
            await wait_until(lambda: p.events(ev.AbortReceived))
            await trio.sleep(0.3)  # negative check: no ack while the write is pending
            assert p.events(ev.AbortAckSent) == [], "acked an abort with a write pending"
            assert p.cache.pinned() == 4

            c.process.send_signal(signal.SIGSTOP)
            try:
                p.gated.open(hold_ends=True)
                await wait_until(
                    lambda: (s := p.node.peers.session(c.node_id)) is None or not s.alive
                )
                await trio.sleep(1.0)  # negative check (below): nothing acked or released
                # Control is gone, the WRITE is not: nothing is acked or released.
                assert p.gated.unended == 1
                assert p.events(ev.AbortAckSent) == []
                assert p.events(ev.PinReleased) == []
                assert p.cache.pinned() == 4
                assert not any(r.peer_id == c.node_id for r in p.node.peers.closed_sessions())
            finally:
                c.process.send_signal(signal.SIGCONT)
                p.gated.end()
            await closed_with(p.node, c.node_id)
            await wait_until(lambda: p.data.statistics().writes_in_flight == 0)
            assert p.gated.unended == 0
            ended = p.events(ev.TransferCompleted) + p.events(ev.TransferFailed)
            assert len(ended) == 1
            print(f"\n[faults] the producer's write: {ended[0]}")
            released = p.events(ev.PinReleased)
            assert released
            log = p.log.recent()
            assert all(log.index(r) > log.index(ended[0]) for r in released)
            assert p.events(ev.AbortAckSent) == []
            outcome = await c.reply(fetch)
        assert_parent_clean(p.cache)
    assert_log_checks(p, tmp_path / "producer.p2plog")
    # What the consumer saw: the load ended, with its reason; if it failed, it
    # overwrote the blocks at once and checked three seconds later that
    # nothing had landed in them since.
    print(f"\n[faults] the consumer's load: {outcome}")
    if not outcome["success"]:
        assert outcome["reason"]
        assert outcome["intact"], f"a write landed after the load was reported failed: {outcome}"


async def test_a_peer_restarted_under_the_same_address_gets_a_fresh_session(
    tmp_path: Path,
) -> None:
    """A producer SIGKILLed and started again on the same port, with other contents.

    The consumer keeps a request open across the restart, with answers cached
    from the old process (pins it held there). Its next lookup under the same
    request id goes to a new session, and the answers are the new process's:
    nothing cached from the old session resolves it. The new process's log
    starts from nothing: every actor is a first incarnation.
    """
    keys = keys_of(4)
    port = free_port()
    with trio.fail_after(120):
        async with local_node("consumer") as c:
            async with serve_process(tmp_path, "old", port=port, preload=4) as old:
                assert await c.node.lookup(old.node_id, "r", keys) == [HIT] * 4
                blocks = c.cache.allocate(2)
                result = await c.node.fetch(old.node_id, "r", keys[:2], blocks)
                assert result.success, result.reason
                c.cache.free(blocks)
                assert await c.node.lookup(old.node_id, "r", keys[2:]) == [HIT] * 2  # cached
                first = c.node.peers.session(old.node_id)
                assert first is not None
                old.kill()
                assert "went away" in await closed_with(c.node, old.node_id)
            log = tmp_path / "new.p2plog"
            async with serve_process(tmp_path, "new", port=port, preload=2, log=log) as new:
                assert new.node_id == old.node_id
                # The request that lost its session answers MISS for the rest of its
                # life (the engine computes the blocks itself), as vLLM's does: none
                # of the old process's HITs is served from the cache.
                assert await c.node.lookup(new.node_id, "r", keys) == [MISS] * 4
                c.node.finish("r")
                await wait_until(
                    lambda: c.node.lookup_view(new.node_id, "r").answers(keys) == [RETRY] * 4
                )
                # The same id again: the new process's answers. Keys 2 and 3 were HITs
                # (and pinned) on the old process; the new one holds only keys 0 and 1.
                assert await c.node.lookup(new.node_id, "r", keys) == [HIT, HIT, MISS, MISS]
                second = c.node.peers.session(new.node_id)
                assert second is not None
                assert second is not first
                assert second.serial > first.serial
                assert second.data_name != first.data_name
                blocks = c.cache.allocate(2)
                result = await c.node.fetch(new.node_id, "r", keys[:2], blocks)
                assert result.success, result.reason
                for k, b in zip(keys[:2], blocks, strict=True):
                    assert bytes(c.cache.memory[b * BLOCK_LEN : (b + 1) * BLOCK_LEN]) == expected(k)
                c.cache.free(blocks)
                c.node.finish("r")
                assert c.data.statistics().peers == 1  # the old registration is gone
                # The new process's own log: one first incarnation, fresh rounds.
                await wait_until(lambda: any(e.KIND == "Closed" for e in read_log(log)))
                events = list(read_log(log))
                assert {e.actor.incarnation for e in events} == {0}
                assert {e.actor.kv_request_id for e in events} == {"r"}
                assert new.alive()
        # Two lives of "r" in the consumer's log: the first ended with its session
        # before the second began on the new one.
        events = c.log.recent()
        opened = [e for e in events if e.actor.role is Role.CONSUMER and e.seq == 1]
        ended = [e for e in c.events(ev.Finished) if e.actor.role is Role.CONSUMER]
        assert len(opened) == len(ended) == 2
        assert "session lost" in ended[0].reason
        assert events.index(ended[0]) < events.index(opened[1])
        assert_parent_clean(c.cache)
    assert_log_checks(c, tmp_path / "consumer.p2plog")


REFUSING_FINGERPRINT = "fedcba9876543210"


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    """One ``p2pactor serve`` that every mismatched peer below dials, SIGKILLed after.

    It refuses each at the handshake and keeps nothing of it (each is a new node
    on a new port), so the cases share one start-up; each reads its own lines of
    the log.
    """
    port = free_port()
    stderr_path = tmp_path_factory.mktemp("refusing") / "serve.stderr"
    argv = serve_argv("127.0.0.1", port, fingerprint=REFUSING_FINGERPRINT)
    with stderr_path.open("ab") as stderr:
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=stderr, env=child_env())
    too_long = threading.Timer(60, process.kill)  # not serving by then: its stdout ends
    too_long.start()
    try:
        assert process.stdout is not None
        line = b""
        while not line.startswith(b"p2pactor node"):
            line = process.stdout.readline()
            assert line, f"p2pactor serve exited before it served: {stderr_path.read_text()}"
        too_long.cancel()
        assert b"serving" in line, line
        yield Serve(process, f"127.0.0.1:{port}", stderr_path)
    finally:
        too_long.cancel()
        process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.parametrize(
    ("ours", "theirs", "words"),
    [
        (
            {"hash_seed": "another-seed"},
            "hash seed differs",
            "set PYTHONHASHSEED to the same value on every node",
        ),
        (
            {"block_len": 2 * BLOCK_LEN},
            "block size differs",
            "every peer must use the same KV block layout",
        ),
        (
            {"fingerprint": "0123456789abcdef"},
            "config fingerprint differs",
            "align them",
        ),
    ],
    ids=["hash_seed", "block_size", "fingerprint"],
)
async def test_a_mismatched_peer_is_refused_at_the_handshake_on_both_sides(
    refusing: Serve, ours: dict[str, Any], theirs: str, words: str
) -> None:
    """Seed, block size or fingerprint differ: both nodes refuse, and say what to align.

    The test's node dials ``p2pactor serve``; the refusal is in the test
    node's closed session and in the serve process's log, with the same advice.
    Neither side registers the other's memory; no block is looked up.
    """
    with trio.fail_after(120):
        config = {"fingerprint": REFUSING_FINGERPRINT, **ours}
        async with local_node("mismatched", **config) as c:
            assert await c.node.lookup(refusing.node_id, "r", keys_of(2)) == [MISS, MISS]
            reason = await closed_with(c.node, refusing.node_id)
            assert reason.startswith("incompatible peer: "), reason
            assert theirs in reason, reason
            assert words in reason, reason
            assert c.data.statistics().peers == 0
            assert c.events(ev.LookupResp) == []

            def refused() -> bool:
                return f"rejected {c.node.node_id}: {theirs}" in refusing.stderr()

            await wait_until(refused)
            line = next(
                x for x in refusing.stderr().splitlines() if f"rejected {c.node.node_id}:" in x
            )
            assert words in line, line
            assert refusing.alive()


class Fuzzer:
    """A hostile peer on plain pyzmq, run in a worker thread: one session per example.

    Each session binds its own ROUTER (the node dials back to the address the
    peer claims, as it would to any peer), mostly completes the handshake with
    real NIXL metadata (of an agent no honest node uses, so a fuzzed fetch that
    gets through could harm nobody), sends the fuzzed frames, and, when one of
    them cannot be decoded, waits for the node's ``disconnect``: that session,
    and only it, must be dropped.
    """

    def __init__(self, target: str, metadata: bytes, base_addr: int) -> None:
        import zmq  # noqa: PLC0415

        self.zmq = zmq
        self.ctx: Any = zmq.Context()
        self.target = target
        self.metadata = metadata
        self.base_addr = base_addr
        self.sessions = 0
        self.dropped = 0

    def close(self) -> None:
        self.ctx.term()

    @staticmethod
    def fatal(frames: Sequence[bytes]) -> bool:
        """Whether the node must drop the session: a frame it cannot decode comes
        before anything that ends the session quietly (a well-formed disconnect)."""
        for frame in frames:
            try:
                msg = wire.decode(frame)
            except UnknownMessageType:
                continue  # a newer peer's message: dropped, not fatal
            except ProtocolError:
                return True
            if isinstance(msg, wire.Disconnect):
                return False
        return False

    def expect(self, router: Any, wanted: str) -> None:
        """Read what the node sends this session until a ``wanted`` message."""
        zmq = self.zmq
        deadline = 30_000
        while router.poll(deadline):
            _, payload = router.recv_multipart(zmq.NOBLOCK)
            kind = wire.decode(payload).TYPE
            if kind == wanted:
                return
        raise AssertionError(f"no {wanted} from the node within 30 s")

    def session(self, frames: Sequence[bytes], handshake: bool) -> None:
        zmq = self.zmq
        self.sessions += 1
        router = self.ctx.socket(zmq.ROUTER)
        dealer = self.ctx.socket(zmq.DEALER)
        try:
            port = router.bind_to_random_port("tcp://127.0.0.1")
            me = f"127.0.0.1:{port}"
            dealer.setsockopt(zmq.IDENTITY, me.encode())
            dealer.connect(f"tcp://{self.target}")
            if handshake:
                connect = wire.Connect(
                    peer_id=me,
                    agent_metadata=self.metadata,
                    base_addr=self.base_addr,
                    num_blocks=NUM_BLOCKS,
                    block_len=BLOCK_LEN,
                    config_fingerprint="",
                    hash_seed=SEED,
                )
                dealer.send(wire.encode(connect))
                self.expect(router, "connect_ack")
                dealer.send(wire.encode(wire.ConnectAck(peer_id=self.target)))
            for frame in frames:
                dealer.send(frame)
            if handshake and self.fatal(frames):
                self.expect(router, "disconnect")
                self.dropped += 1
        finally:
            dealer.close(linger=0)
            router.close(linger=0)


async def test_malformed_frames_fuzzed_into_a_live_node_hurt_only_their_own_session(
    tmp_path: Path,
) -> None:
    """Hypothesis fuzzes frames into ``p2pactor serve`` while an honest peer works.

    Frames are random bytes, maps shaped like the nine messages with fields of
    random types, and valid messages with one field mutated (the strategies of
    ``tests/test_protocol_fuzz.py``), sent mostly after a real handshake. The
    node drops each session that sent an undecodable frame (with a
    ``disconnect``) and nothing else: the honest session is never re-opened
    and every one of its fetches, running all along, verifies byte for byte;
    the process never crashes, and no handler ever raised.
    """
    from hypothesis import HealthCheck, given, settings  # noqa: PLC0415
    from hypothesis import strategies as st  # noqa: PLC0415

    from tests.test_protocol_fuzz import encodable, fake_messages, mutated_messages  # noqa: PLC0415

    keys = keys_of(4)
    encoded = st.one_of(fake_messages, mutated_messages()).map(encodable).filter(bool)
    frames = st.lists(st.one_of(st.binary(max_size=64), encoded), min_size=1, max_size=3)
    handshakes = st.sampled_from([True, True, True, False])
    failures: list[str] = []
    rounds = 0
    with trio.fail_after(300):
        async with (
            serve_process(tmp_path, "target", preload=4) as s,
            local_node("honest") as h,
            open_nixl_transport(bytearray(NUM_BLOCKS * BLOCK_LEN), BLOCK_LEN, name="hostile") as x,
        ):
            assert await h.node.lookup(s.node_id, "warm-up", keys) == [HIT] * 4
            h.node.finish("warm-up")
            honest = h.node.peers.session(s.node_id)
            assert honest is not None
            fuzzer = Fuzzer(s.node_id, x.agent_metadata, x.base_addr)
            stop = threading.Event()

            @settings(
                max_examples=40,
                deadline=None,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            )
            @given(frames=frames, handshake=handshakes)
            def fuzz(frames: list[bytes], handshake: bool) -> None:
                fuzzer.session(frames, handshake)
                assert s.running(), f"the node died: {s.stderr()[-2000:]}"

            async def honest_peer() -> None:
                nonlocal rounds
                while not stop.is_set():
                    req = f"honest-{rounds}"
                    answers = await h.node.lookup(s.node_id, req, keys)
                    blocks = h.cache.allocate(len(keys))
                    result = await h.node.fetch(s.node_id, req, keys, blocks)
                    got = [
                        bytes(h.cache.memory[b * BLOCK_LEN : (b + 1) * BLOCK_LEN]) for b in blocks
                    ]
                    if answers != [HIT] * 4 or not result.success:
                        failures.append(f"{req}: {answers} {result}")
                    elif got != [expected(k) for k in keys]:
                        failures.append(f"{req}: wrong bytes")
                    h.cache.free(blocks)
                    h.node.finish(req)
                    rounds += 1

            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(honest_peer)
                    try:
                        await trio.to_thread.run_sync(fuzz)
                    finally:
                        stop.set()
            finally:
                fuzzer.close()
            assert failures == []
            assert rounds > 0
            assert h.node.peers.session(s.node_id) is honest
            assert honest.alive
            assert not any(r.peer_id == s.node_id for r in h.node.peers.closed_sessions())
            assert s.alive()
            log = s.stderr()
            assert "Traceback" not in log, log[-3000:]
            print(
                f"\n[faults] {fuzzer.sessions} hostile sessions, {fuzzer.dropped} dropped for an "
                f"undecodable frame; {rounds} honest fetches verified meanwhile"
            )
            assert fuzzer.sessions >= 10


async def test_the_event_log_survives_a_sigkill_of_its_node(tmp_path: Path) -> None:
    """``p2pactor serve --log`` is SIGKILLed in the middle of traffic.

    Its log reads back without error up to the kill: every request the
    consumer saw completed a second before the kill (twenty flush intervals of
    the default durability) is there in full, the request left holding pins is
    there with its pins, and
    ``p2pactor replay --check`` passes, listing what was still open as
    unfinished (the node stopped), not as violations.
    """
    keys = keys_of(4)
    path = tmp_path / "killed.p2plog"
    completed: dict[str, float] = {}

    async def request(c: Local, peer: str, req: str) -> None:
        assert await c.node.lookup(peer, req, keys) == [HIT] * 4
        blocks = c.cache.allocate(len(keys))
        result = await c.node.fetch(peer, req, keys, blocks)
        assert result.success, result.reason
        c.cache.free(blocks)
        c.node.finish(req)
        completed[req] = trio.current_time()

    with trio.fail_after(120):
        async with local_node("consumer") as c, serve_process(tmp_path, "s", log=path) as s:
            for i in range(3):
                await request(c, s.node_id, f"whole-{i}")
            assert await c.node.lookup(s.node_id, "open", keys) == [HIT] * 4

            async def traffic() -> None:
                i = 0
                while True:
                    await request(c, s.node_id, f"busy-{i}")
                    i += 1

            def durable_requests() -> list[str]:
                """Requests the consumer saw completed a second before now, at least."""
                return [r for r, t in completed.items() if t <= trio.current_time() - 1.0]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(traffic)
                # Traffic goes on until some busy requests are a second old, however
                # fast the machine serves them.
                await wait_until(lambda: len(durable_requests()) > 3)
                killed_at = trio.current_time()
                s.kill()
                nursery.cancel_scope.cancel()
            await s.process.wait()

    reader = read_log(path)
    events = list(reader)  # never raises on a cut log
    assert reader.problem is None or not reader.problem.fatal, reader.problem
    by_request: dict[str, set[str]] = {}
    for e in events:
        by_request.setdefault(e.actor.kv_request_id, set()).add(e.KIND)
    durable = [r for r, t in completed.items() if t <= killed_at - 1.0]
    assert len(durable) > 3, completed
    for req in durable:
        assert {"TransferCompleted", "TransferDoneSent"} <= by_request[req], req
    for i in range(3):
        assert "Closed" in by_request[f"whole-{i}"]
    # The request still open when the node died: its pin is in the log.
    assert any(
        isinstance(e, ev.LookupAnswered) and e.pinned is not None
        for e in events
        if e.actor.kv_request_id == "open"
    )
    assert "Closed" not in by_request["open"]

    result = replay([path], check=True)
    assert not result.violations, result.violations
    assert any(u.actor.kv_request_id == "open" for u in result.unfinished), result.unfinished

    cli = await trio.run_process(
        [sys.executable, "-m", "p2pactor", "replay", "--check", str(path)],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=child_env(),
    )
    out, err = cli.stdout.decode(), cli.stderr.decode()
    assert cli.returncode == 0, out + err
    assert "check: no violations" in out
    assert "(the node stopped; not violations)" in out
    assert "open  producer" in out
    assert "log ends here" in out
    if reader.torn_tail:
        assert "stopped mid-write (expected after a crash)" in err
    print(
        f"\n[faults] killed log: {len(events)} events read, torn tail: {reader.torn_tail}, "
        f"{len(result.unfinished)} obligations unfinished, {len(completed)} requests completed"
    )


def _sha256(data: bytes) -> str:
    import hashlib  # noqa: PLC0415

    return hashlib.sha256(data).hexdigest()


# --- the consumer process's side ---------------------------------------------------------------


def _say(**message: Any) -> None:
    sys.stdout.write(PREFIX + json.dumps(message) + "\n")
    sys.stdout.flush()


async def _command(node: Node, cache: EmbeddedCache, block_len: int, cmd: dict[str, Any]) -> None:
    op, ident = cmd["op"], cmd["id"]
    if op == "lookup":
        keys = [bytes.fromhex(k) for k in cmd["keys"]]
        answers = await node.lookup(cmd["peer"], cmd["req"], keys)
        _say(id=ident, event="done", answers=[a.value for a in answers])
    elif op == "fetch":
        keys = [bytes.fromhex(k) for k in cmd["keys"]]
        blocks = cache.allocate(len(keys))
        _say(id=ident, event="started", blocks=blocks)

        def block(i: int) -> bytes:
            return bytes(cache.memory[i * block_len : (i + 1) * block_len])

        async def announce_landing() -> None:
            # The first block whose start is no longer zeros: bytes are arriving.
            # Only each block's first bytes are read: a poll must cost next to
            # nothing, or the write ends before the test hears it began.
            zero = bytes(64)
            starts = [b * block_len for b in blocks]
            while all(cache.memory[i : i + 64] == zero for i in starts):  # noqa: ASYNC110 -- NIXL
                await trio.sleep(0.0005)
            _say(id=ident, event="landing")

        async def announce_session_lost() -> None:
            # Dead once it is no longer READY: it drains (CLOSING) while loads are held.
            def ready() -> bool:
                return any(
                    s.peer_id == cmd["peer"] and s.state is SessionState.READY
                    for s in node.peers.sessions()
                )

            while ready():  # noqa: ASYNC110 -- the node's own state
                await trio.sleep(0.01)
            _say(id=ident, event="session_lost")

        async with trio.open_nursery() as watch:
            if cmd.get("announce_landing"):
                watch.start_soon(announce_landing)
            if cmd.get("announce_session_lost"):
                watch.start_soon(announce_session_lost)
            result = await node.fetch(cmd["peer"], cmd["req"], keys, blocks)
            watch.cancel_scope.cancel()

        verified = intact = None
        if result.success:
            verified = all(
                block(b) == block_bytes(k, block_len) for k, b in zip(keys, blocks, strict=True)
            )
        else:
            _say(id=ident, event="failed", reason=result.reason)
            # The engine reuses failed blocks at once: so do we, and look again later.
            sentinel = b"\xa5" * block_len
            for b in blocks:
                cache.memory[b * block_len : (b + 1) * block_len] = sentinel
            await trio.sleep(float(cmd.get("reuse_wait", 0)))
            intact = all(block(b) == sentinel for b in blocks)
        cache.free(blocks)
        _say(
            id=ident,
            event="done",
            success=result.success,
            reason=result.reason,
            verified=verified,
            intact=intact,
        )
    elif op == "finish":
        node.finish(cmd["req"])
        _say(id=ident, event="done")


async def _peer_main(args: argparse.Namespace) -> None:
    pool = bytearray(args.num_blocks * args.block_len)
    cache = EmbeddedCache(args.num_blocks, args.block_len, memory=pool)
    stdin = trio.lowlevel.FdStream(os.dup(0))
    curve = None
    if args.curve_secret_key is not None:
        curve = CurveSecurity.load(args.curve_secret_key, args.curve_trusted)
    local = f"{args.host}:{args.port}"
    async with (
        open_zmq_transport(local, port=args.port, options=FAST, curve=curve) as control,
        open_nixl_transport(pool, args.block_len, name="consumer") as data,
    ):
        cfg = NodeConfig(
            host=args.host,
            port=control.port,
            num_blocks=args.num_blocks,
            block_len=args.block_len,
            hash_seed=args.hash_seed,
            curve_secret_key=args.curve_secret_key,
            curve_trusted=args.curve_trusted,
        )
        async with open_node(cfg, control=control, data=data) as node, trio.open_nursery() as n:
            _say(id=0, event="ready", node_id=node.node_id)
            buffer = b""
            async for chunk in stdin:
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    n.start_soon(_command, node, cache, args.block_len, json.loads(line))
            n.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a consumer node for tests/test_faults.py")
    parser.add_argument("--hash-seed", default=SEED)
    parser.add_argument("--num-blocks", type=int, default=NUM_BLOCKS)
    parser.add_argument("--block-len", type=int, default=BLOCK_LEN)
    parser.add_argument("--host", default="127.0.0.1", help="the address to bind and advertise")
    parser.add_argument("--port", type=int, default=0, help="the control port (0: any)")
    parser.add_argument("--curve-secret-key", help="CURVE: this node's secret key file")
    parser.add_argument("--curve-trusted", help="CURVE: the folder of trusted public keys")
    trio.run(_peer_main, parser.parse_args())
