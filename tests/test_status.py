"""A node's status: ``node_status``, ``GET /status`` and ``p2pactor status``.

* In memory (mock clock): the content is what the node really holds: the
  peer's session and handshake, its dialect, requests, pins (equal to the
  cache's held jobs) and quota usage (equal to ``Node.quota_usage()``).
* Over real HTTP: the dashboard's ``/status`` and the ``p2pactor status``
  command against it (table, ``--json``, a refused port).
* During a real demo (processes, ZeroMQ, NIXL): every node's ``/status`` lists
  every other node with an established session, and the sessions agree.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from typing import Any

import attrs
import pytest
import trio

from p2pactor.core.inputs import LookupResult
from p2pactor.core.protocol import EXTENSION, Connect, ConnectAck
from p2pactor.programs.cli import main
from p2pactor.programs.status_cli import format_status
from p2pactor.runtime.node import Node
from p2pactor.runtime.session import PeerSession
from p2pactor.surface.status import SCHEMA
from p2pactor.testing import message_is
from tests.cluster import key, node_id, open_cluster
from tests.ports import free_port

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def peer_entry(status: dict[str, Any], peer: str) -> dict[str, Any]:
    (entry,) = [p for p in status["peers"] if p["peer"] == peer]
    return entry


def quota(entry: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [q for q in entry["quotas"] if q["name"] == name]
    return found


def usage_json(node: Node) -> dict[str, Any]:
    return {peer: attrs.asdict(u) for peer, u in node.quota_usage().items()}


async def wait_for(predicate: Any, what: str) -> None:
    with trio.move_on_after(10):
        # polled: the states waited on (a cache, a node) have no event to wait for
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)
        return
    raise AssertionError(f"timed out waiting for {what}")


async def test_status_shows_the_session_requests_pins_and_quotas(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(*[key(i) for i in range(4)])
        keys = [key(i) for i in range(6)]
        answers = await a.node.lookup(node_id("b"), "req-1", keys)
        assert answers == [HIT] * 4 + [MISS] * 2

        # b holds the 4 hits pinned for a until a fetches them
        status = b.surface.status()
        assert json.loads(json.dumps(status)) == status
        assert status["schema"] == SCHEMA
        assert status["node_id"] == node_id("b")
        assert [p["peer"] for p in status["peers"]] == [node_id("a")]
        entry = peer_entry(status, node_id("a"))
        assert entry["state"] == "ready"
        assert entry["established"] is True
        assert all(entry["handshake"].values())
        assert entry["dialect"] == "p2pactor"
        assert entry["features"] == sorted(EXTENSION.features)
        assert entry["requests"] == {"consumer": 0, "producer": 1}
        assert entry["pins"] == {"jobs": len(b.cache.held_jobs()), "blocks": 4}
        assert len(b.cache.held_jobs()) == 1
        assert status["pins_by_peer"] == {node_id("a"): 4}
        assert status["quota_usage"] == usage_json(b.node)
        assert status["quota_usage"][node_id("a")]["pinned_blocks"] == 4
        pinned = quota(entry, "pinned_blocks")
        # the default quota: a quarter of the node's 32 blocks
        assert (pinned["used"], pinned["limit"], pinned["percent"]) == (4, 8, 50.0)
        assert quota(entry, "open_requests")["used"] == 1
        limits = {limit["name"]: limit for limit in status["limits"]}
        assert (limits["max_peers"]["used"], limits["max_peers"]["limit"]) == (1, 128)
        assert (limits["num_blocks"]["used"], limits["num_blocks"]["percent"]) == (4, 12.5)
        assert entry["last_activity_s"] is not None
        assert entry["last_activity_s"] >= 0

        # a sees its own request to b, and holds no pins
        mine = a.surface.status()
        theirs = peer_entry(mine, node_id("b"))
        assert theirs["requests"] == {"consumer": 1, "producer": 0}
        assert theirs["pins"] == {"jobs": 0, "blocks": 0}
        assert mine["quota_usage"] == usage_json(a.node)
        assert (mine["totals"]["lookups_hit"], mine["totals"]["lookups_miss"]) == (4, 2)
        assert status["totals"]["served_hit"] == 4

        # fetched: b's pins are released; finished: nobody has a request open
        blocks = a.cache.allocate(4)
        result = await a.node.fetch(node_id("b"), "req-1", keys[:4], blocks)
        assert result.success, result.reason
        a.node.finish("req-1")
        await wait_for(lambda: not b.cache.held_jobs(), "b's pins released")
        await wait_for(lambda: not a.node.has_pending_work(), "a settled")
        await trio.sleep(1)
        after = b.surface.status()
        entry = peer_entry(after, node_id("a"))
        assert entry["pins"] == {"jobs": 0, "blocks": 0}
        assert after["pins_by_peer"] == {}
        assert after["quota_usage"] == usage_json(b.node)
        assert after["quota_usage"][node_id("a")]["peak_pinned_blocks"] == 4
        assert peer_entry(a.surface.status(), node_id("b"))["requests"]["consumer"] == 0


async def test_a_closed_session_leaves_the_peers_and_is_listed_with_its_reason(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b") as cluster:
        a = cluster["a"]
        await a.node.lookup(node_id("b"), "req-1", [key(1)])
        session = a.node.peers.session(node_id("b"))
        assert session is not None
        session.close("the test closed it")
        await session.wait_closed()
        await trio.lowlevel.checkpoint()
        status = a.surface.status()
        assert status["peers"] == []
        assert status["closed_sessions"]["total"] == 1
        (closed,) = status["closed_sessions"]["recent"]
        assert closed["peer"] == node_id("b")
        assert closed["reason"] == "the test closed it"


async def test_a_peer_without_extensions_shows_the_vllm_dialect(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b", round_extension=False) as cluster:
        a = cluster["a"]
        await a.node.lookup(node_id("b"), "req-1", [key(1)])
        entry = peer_entry(a.surface.status(), node_id("b"))
        assert (entry["dialect"], entry["features"], entry["extension_version"]) == (
            "vllm",
            [],
            None,
        )
        assert a.surface.status()["control"]["extensions"] is False


async def test_a_stalled_handshake_shows_connecting_and_the_missing_step(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_cluster("a", "b", handshake_timeout=60.0) as cluster:
        a = cluster["a"]
        # b's connect and ack never reach a: a waits for them
        cluster.network.drop(message_is(Connect, ConnectAck, src=node_id("b")))
        a.node.prepare(node_id("b"))
        await trio.sleep(1)
        entry = peer_entry(a.surface.status(), node_id("b"))
        assert entry["state"] == "connecting"
        assert entry["established"] is False
        assert entry["dialect"] == "unknown"
        assert entry["handshake"] == {
            "connected": True,
            "peer_connect_accepted": False,
            "our_connect_acked": False,
            "peer_memory_registered": False,
        }
        session = a.node.peers.session(node_id("b"))
        assert isinstance(session, PeerSession)
        session.close("the test is over")


# --- over real HTTP ---------------------------------------------------------------------

VOLATILE = {
    "uptime_s",
    "started_at",
    "last_received_s",
    "last_sent_s",
    "last_activity_s",
    "log_append_seconds",
    "loop",  # the slow-step watch counts every step, the answering one's too
}


def steady(value: Any) -> Any:
    """``value`` without the fields that change by the moment (times)."""
    if isinstance(value, dict):
        return {k: steady(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [steady(v) for v in value]
    return value


def get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.headers.get("Content-Type", ""), response.read()


async def p2pactor(*args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "p2pactor", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_the_dashboard_serves_status_and_the_command_prints_it() -> None:
    async with open_cluster("a", "b", dashboard_port=0) as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(1), key(2))
        assert await a.node.lookup(node_id("b"), "req-1", [key(1), key(2), key(3)]) == [
            HIT,
            HIT,
            MISS,
        ]
        board = a.surface.dashboard
        assert board is not None
        address = f"127.0.0.1:{board.port}"

        code, content_type, body = await trio.to_thread.run_sync(get, f"http://{address}/status")
        assert code == 200
        assert content_type.startswith("application/json")
        served = json.loads(body)
        assert served["node_id"] == node_id("a")
        assert steady(served) == steady(a.surface.status())
        (entry,) = served["peers"]
        assert (entry["peer"], entry["state"], entry["dialect"]) == (
            node_id("b"),
            "ready",
            "p2pactor",
        )
        assert entry["requests"] == {"consumer": 1, "producer": 0}

        # the table: the node, its peer's row, the limits
        table = await p2pactor("status", address)
        assert table.returncode == 0, table.stderr.decode()
        text = table.stdout.decode()
        assert text.startswith(f"node {node_id('a')}")
        # the peer's row comes first; its quotas follow in the limits table
        row = next(line for line in text.splitlines() if line.startswith(node_id("b") + " "))
        assert row.split()[:3] == [node_id("b"), "ready", "p2pactor"]
        assert "1/0" in row.split()  # one request of ours, none of theirs
        assert re.search(r"^max_peers\s+1\s+128\s+0\.78%$", text, re.MULTILINE), text

        # --json: the node's answer as it came
        raw = await p2pactor("status", address, "--json")
        assert raw.returncode == 0, raw.stderr.decode()
        assert steady(json.loads(raw.stdout)) == steady(a.surface.status())

        # b's status names a as its peer, serving a's request with 2 blocks pinned
        b_board = b.surface.dashboard
        assert b_board is not None
        _, _, b_body = await trio.to_thread.run_sync(get, f"{b_board.url.rstrip('/')}/status")
        (theirs,) = json.loads(b_body)["peers"]
        assert theirs["peer"] == node_id("a")
        assert theirs["requests"] == {"consumer": 0, "producer": 1}
        assert theirs["pins"]["blocks"] == 2
        # its table shows a's pinned blocks against a's quota (a quarter of 32 blocks)
        table_b = io.StringIO()
        format_status(json.loads(b_body), table_b)
        pattern = rf"^{node_id('a')} pinned_blocks\s+2\s+8\s+25\.0%$"
        assert re.search(pattern, table_b.getvalue(), re.MULTILINE), table_b.getvalue()
        a.node.finish("req-1")


@pytest.fixture
def silent_server() -> Any:
    """A TCP port that accepts connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    yield f"127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def test_the_command_says_what_to_check_when_nothing_answers(
    capsys: pytest.CaptureFixture[str], silent_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    assert main(["status", f"127.0.0.1:{port}"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert f"nothing listens at 127.0.0.1:{port} (connection refused)" in err
    assert "--dashboard PORT" in err

    # The silent server holds the request until the client gives up: at its
    # --timeout, which the request carries (no clock needed to tell).
    timeouts: list[float] = []
    urlopen = urllib.request.urlopen

    def timed_urlopen(url: str, *, timeout: float) -> Any:
        timeouts.append(timeout)
        return urlopen(url, timeout=timeout)

    monkeypatch.setattr(urllib.request, "urlopen", timed_urlopen)
    assert main(["status", silent_server, "--timeout", "0.5"]) == 1
    assert timeouts == [0.5]
    out, err = capsys.readouterr()
    assert out == ""
    assert "no answer from" in err
    assert "within 0.5 s" in err


async def test_the_command_refuses_a_server_without_a_status() -> None:
    async def not_p2pactor(stream: trio.SocketStream) -> None:
        await stream.receive_some()
        await stream.send_all(b"HTTP/1.0 200 OK\r\nContent-Type: text/html\r\n\r\n<html>hi</html>")
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, not_p2pactor, 0, host="127.0.0.1")
        (listener,) = await nursery.start(serve)
        port = listener.socket.getsockname()[1]
        run = await p2pactor("status", f"127.0.0.1:{port}")
        assert run.returncode == 1
        assert run.stdout == b""
        assert b"did not answer JSON" in run.stderr
        nursery.cancel_scope.cancel()

    async with open_cluster("a", dashboard_port=0) as cluster:
        board = cluster["a"].surface.dashboard
        assert board is not None
        # the dashboard's own 404 for a path that has no /status under it
        run = await p2pactor("status", f"http://127.0.0.1:{board.port}/nothing")
        assert run.returncode == 1
        assert b"answered 404" in run.stderr


# --- during a real demo ------------------------------------------------------------------


def status_urls(lines: list[str]) -> list[str]:
    """Each demo node's /status URL, as the demo printed it before its requests."""
    found = [re.search(r"\bstatus: (http://\S+/status)", line) for line in lines]
    return list(dict.fromkeys(m.group(1) for m in found if m))


def test_during_a_demo_every_node_lists_every_other_with_an_established_session() -> None:
    nodes = 3
    env = {**os.environ, "NIXL_LOG_LEVEL": "WARN"}
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "p2pactor",
            "demo",
            "--nodes",
            str(nodes),
            "--requests",
            "2",
            "--block-size",
            "4096",
            "--linger",
            "60",
            "--timeout",
            "90",
            # Named sources: every key is looked up, so the nodes' lookup
            # totals count every key of the summary's table.
            "--named",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: list[str] = []
    try:
        assert demo.stdout is not None
        for line in demo.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("The nodes stay up"):
                break
        else:
            pytest.fail("the demo ended before lingering:\n" + "\n".join(lines))
        urls = status_urls(lines)
        assert len(urls) == nodes, lines
        statuses = [json.loads(get(url)[2]) for url in urls]
        # as a user would: the command's table for the first node
        table = subprocess.run(
            [sys.executable, "-m", "p2pactor", "status", urls[0].removesuffix("/status")],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    finally:
        demo.send_signal(signal.SIGINT)  # ends the linger; the demo then checks its logs
        rest, errors = demo.communicate(timeout=60)
    lines += rest.splitlines()
    assert demo.returncode == 0, "\n".join(lines) + errors
    assert any(line.startswith("Demo OK") for line in lines)

    ids = [s["node_id"] for s in statuses]
    assert len(set(ids)) == nodes
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines()]
    others = set(ids) - {statuses[0]["node_id"]}
    assert {row[0] for row in rows if row[1:3] == ["ready", "p2pactor"]} == others, table.stdout
    # the summary's rows are these nodes, and its totals are theirs
    summary = {line.split()[0] for line in lines if line.split() and line.split()[0] in ids}
    assert summary == set(ids)
    total = next(line.split() for line in lines if line.startswith("total "))
    hits, misses, blocks = int(total[3]), int(total[4]), int(total[7])
    assert hits > 0
    assert sum(s["totals"]["lookups_hit"] for s in statuses) == hits
    missed = sum(s["totals"]["lookups_miss"] + s["totals"]["lookups_timeout"] for s in statuses)
    assert missed == misses
    assert sum(s["totals"]["blocks_received"] for s in statuses) == blocks
    sessions = {}
    for status in statuses:
        others = sorted(set(ids) - {status["node_id"]})
        assert sorted(p["peer"] for p in status["peers"]) == others
        for peer in status["peers"]:
            assert peer["state"] == "ready", peer
            assert peer["established"] is True
            assert all(peer["handshake"].values())
            assert peer["dialect"] == "p2pactor"
            assert peer["requests"] == {"consumer": 0, "producer": 0}  # all done
            assert peer["pins"] == {"jobs": 0, "blocks": 0}
            sessions[status["node_id"], peer["peer"]] = peer
        assert status["pins_by_peer"] == {}
        # Summaries flow between p2pactor nodes whether or not requests name a source.
        sources = status["sources"]
        assert sources["enabled"] is True
        assert sorted(p["peer"] for p in sources["peers"] if p["synced"]) == others
    # both ends of every session see it the same way
    for (me, other), peer in sessions.items():
        mirror = sessions[other, me]
        assert (mirror["state"], mirror["dialect"], mirror["features"]) == (
            peer["state"],
            peer["dialect"],
            peer["features"],
        )
