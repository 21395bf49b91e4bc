"""Across hosts: nodes in their own network namespaces, ZeroMQ over TCP, NIXL over UCX TCP.

Each host is a namespace of :mod:`p2pactor.programs.hosts` (its own network,
hostname and ``/dev/shm``; UCX limited to ``tcp,self`` on its ``eth0``), so the
bytes between two nodes cross the kernel's TCP stack as between machines. The
producer is the real ``p2pactor serve``; the consumer is the driven node of
``tests/test_faults.py``. Every address is inside namespaces the test made and
removes (``open_hosts``), whatever happens.

UCX says which transport carried the writes: the producer runs with
``UCX_PROTO_INFO=y`` into a log file, and the tests read its ``ucp_put`` tables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pactor.core.timings import Timings
from p2pactor.programs.hosts import Host, hosts_unavailable, open_hosts
from tests.test_faults import (
    HOLD,
    ConsumerProcess,
    Serve,
    consumer_process,
    keys_of,
    killed_while_held,
    serve_process,
)

REASON = hosts_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no namespaced hosts: {REASON}")

SHARED_MEMORY = ("posix", "sysv", "cma", "xpmem", "knem", "shm")


def put_transports(log: str) -> set[tuple[str, str]]:
    """(peer kind, transport) of every ``ucp_put`` protocol UCX_PROTO_INFO printed.

    The kind is UCX's own word for the endpoint: ``self``, ``intra-node`` (same
    host: shared memory possible) or ``inter-node``.
    """
    found: set[tuple[str, str]] = set()
    kind = ""
    in_put = False
    for line in log.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 1 and " cfg#" in cells[0]:
            kind = cells[0].split()[1]
            in_put = False
        elif len(cells) == 1:
            in_put = "ucp_put" in cells[0]
        elif in_put and len(cells) == 3 and cells[0] != "Range":
            found.add((kind, cells[2]))
    return found


def test_put_transports_reads_ucx_tables() -> None:
    log = "\n".join(
        [
            "[1.0] [h2:1:0]   | serve-1 inter-node cfg#1   |",
            "[1.0] [h2:1:0]   | remote memory write by ucp_put* from host memory to host |",
            "[1.0] [h2:1:0]   +--------+-------------+------------+",
            "[1.0] [h2:1:0]   | Range  | Description |   Config   |",
            "[1.0] [h2:1:0]   | 0..inf | zero-copy   | tcp/eth0   |",
            "[1.0] [h2:1:0]   | active message by ucp_am_send* from host memory |",
            "[1.0] [h2:1:0]   | 0..inf | zero-copy   | sysv/memory |",
            "[1.0] [h2:1:0]   | serve-1 intra-node cfg#2   |",
            "[1.0] [h2:1:0]   | remote memory write by ucp_put* from host memory to host |",
            "[1.0] [h2:1:0]   | 0..8K  | short       | posix/memory |",
        ]
    )
    assert put_transports(log) == {("inter-node", "tcp/eth0"), ("intra-node", "posix/memory")}


UCX_LOGGED = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": "stderr"}
"""UCX's protocol tables into the process's stderr: unbuffered, unlike a log file of its own."""


def assert_writes_went_over_tcp(serve: Serve) -> None:
    log = serve.stderr()
    puts = put_transports(log)
    assert puts, f"UCX printed no ucp_put protocol in {serve.stderr_path}"
    remote = {transport for kind, transport in puts if kind != "self"}
    assert remote == {"tcp/eth0"}, puts
    assert not any(shm in log for shm in SHARED_MEMORY), "a shared-memory transport was set up"


async def fetch_all(
    consumer: ConsumerProcess, peer: str, request: str, keys: list[bytes]
) -> dict[str, object]:
    """Look ``keys`` up on ``peer``, expect every one a HIT, fetch them, finish."""
    hexed = [k.hex() for k in keys]
    lookup = await consumer.reply(await consumer.send("lookup", peer=peer, req=request, keys=hexed))
    assert lookup["answers"] == ["hit"] * len(keys), lookup
    fetched = await consumer.reply(await consumer.send("fetch", peer=peer, req=request, keys=hexed))
    await consumer.reply(await consumer.send("finish", req=request))
    return fetched


async def stop(serve: Serve) -> str:
    """SIGTERM ``serve`` (it closes cleanly) and return what it printed from then on."""
    serve.process.send_signal(signal.SIGTERM)
    assert serve.process.stdout is not None
    out = b""
    with trio.fail_after(60):
        while chunk := await serve.process.stdout.receive_some():
            out += chunk
        await serve.process.wait()
    assert serve.process.returncode == 0, serve.stderr()
    return out.decode(errors="replace")


def assert_no_pins_left(printed: str) -> None:
    """``serve`` prints each peer's quota usage as it stops: nothing may stay pinned."""
    usage = [line for line in printed.splitlines() if line.startswith("quota usage ")]
    assert usage, printed[-2000:]
    assert all('"pinned_blocks": 0' in line for line in usage), usage


async def test_two_hosts_fetch_byte_exact_over_tcp(tmp_path: Path) -> None:
    with open_hosts(2) as (h1, h2):
        async with (
            serve_process(tmp_path, "h2", on=h2, preload=8, env=UCX_LOGGED) as producer,
            consumer_process(on=h1) as consumer,
        ):
            assert producer.node_id == f"{h2.address}:5710"
            assert consumer.node_id.startswith(f"{h1.address}:")
            hexed = [k.hex() for k in keys_of(10)]
            with trio.fail_after(60):
                lookup = await consumer.reply(
                    await consumer.send("lookup", peer=producer.node_id, req="r1", keys=hexed)
                )
                assert lookup["answers"] == ["hit"] * 8 + ["miss"] * 2
                fetched = await consumer.reply(
                    await consumer.send("fetch", peer=producer.node_id, req="r1", keys=hexed[:8])
                )
                await consumer.reply(await consumer.send("finish", req="r1"))
            assert fetched["success"] is True, fetched
            assert fetched["verified"] is True
            assert_no_pins_left(await stop(producer))
        assert_writes_went_over_tcp(producer)


async def test_three_hosts_one_consumer_fetches_from_two_producers(tmp_path: Path) -> None:
    with open_hosts(3) as (h1, h2, h3):
        async with (
            serve_process(tmp_path, "h1", on=h1, preload=4, env=UCX_LOGGED) as first,
            serve_process(tmp_path, "h2", on=h2, preload=8, env=UCX_LOGGED) as second,
            consumer_process(on=h3) as consumer,
        ):
            keys = keys_of(8)  # h1 holds the first 4, h2 all 8: fetch half from each
            with trio.fail_after(90):
                a = await fetch_all(consumer, first.node_id, "r-a", keys[:4])
                b = await fetch_all(consumer, second.node_id, "r-b", keys[4:])
            assert (a["success"], a["verified"]) == (True, True), a
            assert (b["success"], b["verified"]) == (True, True), b
            assert_no_pins_left(await stop(first))
            assert_no_pins_left(await stop(second))
        assert_writes_went_over_tcp(first)
        assert_writes_went_over_tcp(second)


async def test_a_producer_restarted_under_its_address_is_served_again(tmp_path: Path) -> None:
    with open_hosts(2) as (h1, h2):
        async with consumer_process(on=h1) as consumer:
            async with serve_process(tmp_path, "old", on=h2, preload=4) as old:
                with trio.fail_after(60):
                    first = await fetch_all(consumer, old.node_id, "before", keys_of(4))
                assert (first["success"], first["verified"]) == (True, True), first
                old.kill()  # SIGKILL: no goodbye on the wire
                with trio.fail_after(30):
                    await old.process.wait()
            async with serve_process(tmp_path, "new", on=h2, preload=2) as new:
                assert new.node_id == old.node_id
                with trio.fail_after(60):
                    # The consumer's old session dies of silence; a lookup
                    # dials again and meets the new process.
                    while True:
                        hexed = [k.hex() for k in keys_of(2)]
                        got = await consumer.reply(
                            await consumer.send("lookup", peer=new.node_id, req="after", keys=hexed)
                        )
                        await consumer.reply(await consumer.send("finish", req="after"))
                        if got["answers"] == ["hit", "hit"]:
                            break
                        await trio.sleep(0.2)
                    again = await fetch_all(consumer, new.node_id, "after-2", keys_of(2))
                assert (again["success"], again["verified"]) == (True, True), again
                assert_no_pins_left(await stop(new))


async def test_a_cut_link_fails_the_load_and_the_restored_link_serves(tmp_path: Path) -> None:
    with open_hosts(2) as (h1, h2):
        async with (
            serve_process(tmp_path, "h2", on=h2, preload=4) as producer,
            consumer_process(on=h1) as consumer,
        ):
            hexed = [k.hex() for k in keys_of(4)]
            with trio.fail_after(60):
                lookup = await consumer.reply(
                    await consumer.send("lookup", peer=producer.node_id, req="cut", keys=hexed)
                )
            assert lookup["answers"] == ["hit"] * 4
            h2.link(up=False)  # the producer's cable: pinned, and now unreachable
            started = trio.current_time()
            with trio.fail_after(60):  # the consumer's session dies of silence in ~1 s
                cut = await consumer.reply(
                    await consumer.send(
                        "fetch", peer=producer.node_id, req="cut", keys=hexed, reuse_wait=1.0
                    )
                )
                await consumer.reply(await consumer.send("finish", req="cut"))
            assert cut["success"] is False, cut
            assert cut["reason"], cut  # the log and the engine say why
            # Well inside the load's own 30 s deadline (minus the 1 s reuse wait).
            assert trio.current_time() - started < Timings().load_timeout, cut
            assert cut["intact"] is True, "bytes landed in blocks the engine had reused"
            h2.link(up=True)
            back = trio.current_time()
            with trio.fail_after(90):
                while True:  # the consumer dials again once the link is back
                    got = await consumer.reply(
                        await consumer.send("lookup", peer=producer.node_id, req="r2", keys=hexed)
                    )
                    await consumer.reply(await consumer.send("finish", req="r2"))
                    if got["answers"] == ["hit"] * 4:
                        break
                    await trio.sleep(0.2)
                again = await fetch_all(consumer, producer.node_id, "r3", keys_of(4))
            assert (again["success"], again["verified"]) == (True, True), again
            # Not through a timeout: the producer's first answers to the new session
            # once went down a TCP connection the cut had killed, and the lookup
            # waited out its 30 s before the consumer dialed again.
            stalled = trio.current_time() - back >= Timings().lookup_progress_timeout
            assert not stalled, "the restored link served only after a lookup timed out"
            assert producer.alive()  # served again without a restart
            assert_no_pins_left(await stop(producer))


async def test_a_dead_producer_across_hosts_leaves_the_hold_to_run_out(tmp_path: Path) -> None:
    """Across namespaced hosts a killed producer's write may still be on the link: the hold stays.

    The same kill that ends the hold at once on one machine
    (tests/test_faults.py) proves nothing here: the two processes share no
    network, so a link that comes back could still deliver what the dead
    process sent. The load fails only when the hold runs out.
    """
    with open_hosts(2) as (h1, h2):
        async with (
            serve_process(tmp_path, "h2", on=h2, preload=4) as producer,
            consumer_process(on=h1) as consumer,
        ):
            failed, since_lost, since_kill = await killed_while_held(consumer, producer)
    print(
        f"\n[hosts] held load failed {since_kill:.2f} s after the kill, {since_lost:.2f} s "
        f"after the session was lost (hold {HOLD:g} s)"
    )
    assert "held until no write could land" in failed["reason"], failed
    assert since_lost >= HOLD - 0.5, "the hold ended early across hosts"


def test_hosts_are_removed_when_the_block_fails() -> None:
    prefix = f"p2pa{os.getpid()}x"
    made: list[str] = []

    def fail_inside() -> None:
        with open_hosts(2, prefix=prefix) as hosts:
            assert [h.address for h in hosts] == ["10.231.0.1", "10.231.0.2"]
            made.extend(h.netns for h in hosts)
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        fail_inside()
    assert made == [f"{prefix}-h1", f"{prefix}-h2"]
    listed = Path("/run/netns")
    left = [p.name for p in listed.iterdir()] if listed.exists() else []
    assert not [n for n in left if n.startswith(f"{prefix}-")]


MIB = 1 << 20


def status_on(host: Host, port: int) -> dict[str, Any]:
    """``/status`` of the node serving it on ``host``'s loopback (reached from inside)."""
    probe = f"import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:{port}/status').read().decode())"
    done = subprocess.run(
        ["ip", "netns", "exec", host.netns, sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
    )
    status: dict[str, Any] = json.loads(done.stdout)
    return status


BLOCKS = 256  # of 1 MiB: long enough over veth TCP to pull the cable while it runs


@asynccontextmanager
async def big_transfer_pair(
    tmp_path: Path, h1: Host, h2: Host
) -> AsyncIterator[tuple[Serve, ConsumerProcess]]:
    """A producer on h2 holding BLOCKS blocks of 1 MiB, a consumer on h1 with room for them."""
    async with (
        serve_process(
            tmp_path,
            "h2",
            on=h2,
            preload=BLOCKS,
            block_len=MIB,
            num_blocks=BLOCKS,
            env={"P2PACTOR_QUOTA_PINNED_FRACTION": "1"},  # one peer may pin them all
            extra=["--metrics-port", "9100"],
        ) as producer,
        consumer_process(on=h1, extra=["--num-blocks", str(BLOCKS), "--block-len", str(MIB)]) as c,
    ):
        yield producer, c


async def cut_while_landing(
    producer: Serve, consumer: ConsumerProcess, h2: Host, *, back: str = "after the failure"
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fetch every block; pull h2's cable once bytes arrive; plug it back in.

    ``back``: the link comes back "after the failure" (once the load failed)
    or "while held" (once the consumer's session died, while it still holds
    the load's blocks for a late write).

    Returns the consumer's "failed" and "done" replies: between the two it
    holds the failed blocks as the engine would after reusing them (a
    sentinel written over them, 5 s), with the link back up.
    """
    hexed = [k.hex() for k in keys_of(BLOCKS)]
    with trio.fail_after(60):
        lookup = await consumer.reply(
            await consumer.send("lookup", peer=producer.node_id, req="cut", keys=hexed)
        )
    assert lookup["answers"] == ["hit"] * BLOCKS
    fetch = await consumer.send(
        "fetch",
        peer=producer.node_id,
        req="cut",
        keys=hexed,
        reuse_wait=5.0,
        announce_landing=True,
        announce_session_lost=True,
    )
    with trio.fail_after(60):
        await consumer.reply(fetch, "landing")
    h2.link(up=False)
    try:
        with trio.fail_after(Timings().load_timeout):  # within the load's deadline
            await consumer.reply(fetch, "session_lost")
            if back == "while held":
                h2.link(up=True)
            failed = await consumer.reply(fetch, "failed")
    finally:
        h2.link(up=True)  # a stalled TCP stream may resume from here on
    with trio.fail_after(60):
        done = await consumer.reply(fetch)
        await consumer.reply(await consumer.send("finish", req="cut"))
    return failed, done


async def test_the_link_cut_mid_transfer_fails_the_load_and_the_pins_go(tmp_path: Path) -> None:
    """The consumer's load fails within its deadline; the producer's stalled write ends.

    The consumer's session dies of silence in about a second; it holds the
    load's blocks for the data path's late-write window (5 s), then fails it.
    The producer's stalled write ends when UCX drops the connection (its TCP
    timeout, 1 s) or at the latest at NIXL's transfer_timeout (30 s): only then
    do its pins go. Then the same pair serves again, no process restarted.
    """
    with open_hosts(2) as (h1, h2):
        async with big_transfer_pair(tmp_path, h1, h2) as (producer, consumer):
            failed, done = await cut_while_landing(producer, consumer, h2)
            assert "session lost" in failed["reason"], failed
            assert "held until no write could land" in failed["reason"], failed
            assert done["success"] is False
            with trio.fail_after(90):  # transfer_timeout (30 s) cancels a stalled write
                while (await trio.to_thread.run_sync(status_on, h2, 9100))["pins_by_peer"]:  # noqa: ASYNC110 -- another process's state
                    await trio.sleep(0.5)
            again = await fetch_all(consumer, producer.node_id, "after", keys_of(4))
            assert (again["success"], again["verified"]) == (True, True), again
            assert producer.alive()
            assert_no_pins_left(await stop(producer))


@pytest.mark.parametrize("back", ["after the failure", "while held"])
async def test_the_link_cut_mid_transfer_lands_nothing_in_reused_blocks(
    tmp_path: Path, back: str
) -> None:
    """No byte of the cut write lands once the engine has the blocks back.

    The link comes back after the load failed (the stalled write could resume
    into reused blocks: UCX dropped its connections first), or while the
    consumer still held the blocks (whatever resumes lands in the hold).
    """
    with open_hosts(2) as (h1, h2):
        async with big_transfer_pair(tmp_path, h1, h2) as (producer, consumer):
            failed, done = await cut_while_landing(producer, consumer, h2, back=back)
            assert "held until no write could land" in failed["reason"], failed
            assert done["intact"] is True, "bytes landed in blocks the engine had reused"


async def test_curve_across_hosts_serves_the_trusted_and_refuses_a_stranger(
    tmp_path: Path,
) -> None:
    from tests.test_curve import keypair  # noqa: PLC0415

    with open_hosts(3) as (h1, h2, h3):
        trusted = tmp_path / "trusted"  # the one folder every trusted node reads
        server_id, client_id = f"{h2.address}:5710", f"{h1.address}:5711"
        server_secret = keypair(trusted, "server", server_id)
        client_secret = keypair(trusted, "client", client_id)
        # The stranger trusts the server (it has its public key) but is not trusted.
        stranger_trusts = tmp_path / "stranger-trusts"
        stranger_trusts.mkdir()
        (stranger_trusts / "server.key").write_bytes((trusted / "server.key").read_bytes())
        stranger_secret = keypair(tmp_path / "stranger", "stranger", f"{h3.address}:5711")
        curve = ["--curve-secret-key", str(server_secret), "--curve-trusted", str(trusted)]
        async with serve_process(tmp_path, "h2", on=h2, preload=4, extra=curve) as producer:
            assert producer.node_id == server_id
            as_client = ["--port", "5711", "--curve-secret-key", str(client_secret)]
            async with consumer_process(
                on=h1, extra=[*as_client, "--curve-trusted", str(trusted)]
            ) as consumer:
                with trio.fail_after(60):
                    got = await fetch_all(consumer, server_id, "trusted", keys_of(4))
                assert (got["success"], got["verified"]) == (True, True), got
            as_stranger = ["--port", "5711", "--curve-secret-key", str(stranger_secret)]
            async with consumer_process(
                on=h3, extra=[*as_stranger, "--curve-trusted", str(stranger_trusts)]
            ) as stranger:
                hexed = [k.hex() for k in keys_of(4)]
                with trio.fail_after(60):
                    refused = await stranger.reply(
                        await stranger.send("lookup", peer=server_id, req="s", keys=hexed)
                    )
                assert refused["answers"] == ["miss"] * 4  # its session never formed
            printed = await stop(producer)
        assert "is not trusted" in producer.stderr(), producer.stderr()[-2000:]
        assert_no_pins_left(printed)
