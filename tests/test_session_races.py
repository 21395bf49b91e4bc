"""Sessions two nodes open towards each other at the same moment.

With 16 node processes starting together, node B's frame often reached node A
after A had created its session for B but before that session dialed: A's node
saw an inbound connection for a peer whose session was alive, refused it, and
lost B's ``connect``; A's session then never finished its handshake and every
lookup on it waited 30 s and failed. The first test forces that interleaving
and checks that it happened; the second makes both nodes dial each other
once both sessions exist, in both orders (crossed dials, not that race: see
its docstring). Both require one session per pair and answers.

Everything runs in one trio run over in-memory transports, so "every other
task has run until it blocked" (``trio.testing.wait_all_tasks_blocked``) is a
point the test can wait for, where a sleep would only make it likely.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
import trio.testing

from p2pactor.core.inputs import LookupResult
from tests.cluster import Member, key, open_cluster

HIT, MISS = LookupResult.HIT, LookupResult.MISS


async def test_a_peer_dialing_us_while_our_session_is_about_to_dial_it_is_that_session(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The race, forced: a's ``connect`` reaches b's node while b's session for a waits to dial.

    b's session starts first and its dial is held until a's connection is in
    b's transport and every other task has run until it blocked: b's node has
    then taken the inbound connection, with b's session still dialing. The
    test checks that it was so, and that b's node said it took that branch.
    """
    caplog.set_level(logging.DEBUG, logger="p2pactor")
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        a.store(key(1))
        b.store(key(2))
        transport = b.node.control
        dial = transport.connect
        dialing_when_a_came: list[bool] = []

        async def dial_once_a_has_dialed_us(peer: str) -> Any:
            # b's session exists but has not dialed yet when a's `connect` arrives.
            while a.id not in transport.connections:  # type: ignore[attr-defined]  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.001)
            await trio.testing.wait_all_tasks_blocked()  # b's node has seen the connection
            session = b.node.peers.session(a.id)
            dialing_when_a_came.append(session is not None and session.dialing)
            return await dial(peer)

        transport.connect = dial_once_a_has_dialed_us  # type: ignore[method-assign]
        answers: dict[str, list[LookupResult]] = {}

        async def ask(name: str, peer: str, k: bytes) -> None:
            answers[name] = await cluster[name].node.lookup(peer, "r", [k])

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask, "b", a.id, key(1))
                await trio.testing.wait_all_tasks_blocked()
                session = b.node.peers.session(a.id)
                assert session is not None, "b's session was not created"
                assert session.dialing, "b's session is not waiting to dial"
                nursery.start_soon(ask, "a", b.id, key(2))
        assert dialing_when_a_came == [True]
        assert any("while we dial it" in r.getMessage() for r in caplog.records), caplog.text
        assert answers == {"a": [HIT], "b": [HIT]}
        for member, peer in ((a, b), (b, a)):
            assert member.node.peers.closed_sessions() == []
            (session,) = member.node.peers.sessions()
            assert session.peer_id == peer.id
            assert session.ready


def hold_dials_until_both_sessions_exist(a: Member, b: Member, first: str) -> list[str]:
    """Make each node's dial wait until each has a session for the other; ``first`` dials first.

    The other dials as soon as ``first``'s dial has begun, before it can have
    reached its peer. Returns the list the held dials append their node's
    name to.
    """
    both, first_dials = trio.Event(), trio.Event()
    held: list[str] = []
    for member in (a, b):
        transport = member.node.control
        dial = transport.connect

        async def held_dial(peer: str, member: Member = member, dial: Any = dial) -> Any:
            held.append(member.name)
            if a.node.peers.session(b.id) is not None and b.node.peers.session(a.id) is not None:
                both.set()
            await both.wait()
            if member.name == first:
                first_dials.set()
            else:
                await first_dials.wait()
            return await dial(peer)

        transport.connect = held_dial  # type: ignore[method-assign]
    return held


async def test_nodes_dialing_each_other_at_once_share_one_session() -> None:
    """Both sessions exist before either dials, then both dial: crossed connects.

    Each order of the two dials is forced five times (the first dial has
    begun, not ended, when the second begins). This is not the race that
    lost connects: on in-memory transports the second dial finds the
    connection the first one opened, so no node sees an inbound connection
    while its session still dials (with that branch broken, this test still
    passes). The test above forces that race.
    """
    for attempt in range(10):
        first = "ab"[attempt % 2]
        async with open_cluster("a", "b") as cluster:
            a, b = cluster["a"], cluster["b"]
            a.store(key(1))
            b.store(key(2))
            held = hold_dials_until_both_sessions_exist(a, b, first)
            answers: dict[str, list[LookupResult]] = {}

            async def ask(
                name: str, peer: str, k: bytes, answers: dict[str, list[LookupResult]] = answers
            ) -> None:
                answers[name] = await cluster[name].node.lookup(peer, "r", [k])

            with trio.fail_after(10):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask, "a", b.id, key(2))
                    nursery.start_soon(ask, "b", a.id, key(1))
            assert sorted(held) == ["a", "b"], attempt  # one dial each, both held
            assert answers == {"a": [HIT], "b": [HIT]}, attempt
            for member, peer in ((a, b), (b, a)):
                assert member.node.peers.closed_sessions() == [], attempt
                (session,) = member.node.peers.sessions()
                assert session.peer_id == peer.id
                assert session.ready


async def test_a_peer_still_talking_in_a_session_that_died_here_is_told_to_disconnect() -> None:
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(2), key(3), key(4))
        with trio.fail_after(10):
            assert await a.node.lookup(b.id, "r1", [key(2)]) == [HIT]
            (first,) = a.node.peers.sessions()
            # b's side of the connection dies and b's session ends; a has not
            # noticed and sends its next lookup on the old session.
            b.node.control.connections[a.id].kill("dropped on b's side only")  # type: ignore[attr-defined]
            while b.node.peers.sessions():  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.01)
            # Answered because b's new inbound session says disconnect, not by
            # the 30 s lookup deadline (which fail_after(10) would not wait for).
            assert await a.node.lookup(b.id, "r2", [key(3)]) == [MISS]
            r2 = [e for e in a.log.recent() if e.actor.kv_request_id == "r2"]
            assert "LookupTimedOut" not in [e.KIND for e in r2]
            assert [e.reason for e in r2 if e.KIND == "SessionLost"] == ["the peer disconnected"]  # type: ignore[attr-defined]
            assert not first.alive
            assert await a.node.lookup(b.id, "r3", [key(4)]) == [HIT]
            (second,) = a.node.peers.sessions()
            assert second is not first
            assert second.ready


async def test_a_node_keeps_the_last_closed_sessions_and_counts_them_all(
    autojump_clock: trio.abc.Clock, monkeypatch: Any
) -> None:
    # A long-lived node sees peers come and go for ever: what their sessions
    # left behind is kept for the most recent ones only.
    import p2pactor.runtime.peers  # noqa: PLC0415
    from p2pactor.core import protocol as wire  # noqa: PLC0415
    from tests.test_session import node_and_peer  # noqa: PLC0415

    monkeypatch.setattr(p2pactor.runtime.peers, "CLOSED_KEPT", 2)
    async with node_and_peer() as (node, _, peer):
        for closed in range(1, 4):
            await peer.dial()
            await peer.send(wire.Disconnect())  # a stray disconnect: the session ends
            while node.peers.closed_count < closed:  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.01)
            assert peer.conn is not None
            await peer.conn.aclose()
            while node.peers.sessions():  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.01)
        assert node.peers.closed_count == 3
        assert len(node.peers.closed_sessions()) == 2
        assert all("disconnect" in r.reason for r in node.peers.closed_sessions())


async def test_a_peer_whose_side_of_the_session_died_starts_afresh_without_losing_a_request() -> (
    None
):
    # a's side of the connection dies; b's does not. a's next request dials
    # again and its `connect` reaches b's old, still live session: b hands the
    # connection to a new session instead of treating it as a violation, so
    # the request is answered (before, b disconnected and it was a MISS).
    async with open_cluster("a", "b") as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(2), key(3))
        with trio.fail_after(10):
            assert await a.node.lookup(b.id, "r1", [key(2)]) == [HIT]
            (old_b,) = b.node.peers.sessions()
            a.node.control.connections[b.id].kill("dropped on a's side only")  # type: ignore[attr-defined]
            while a.node.peers.sessions():  # noqa: ASYNC110 - no event to wait on
                await trio.sleep(0.01)
            assert old_b.alive  # b saw nothing
            assert await a.node.lookup(b.id, "r2", [key(3)]) == [HIT]
            (new_b,) = b.node.peers.sessions()
            assert new_b is not old_b
            assert new_b.ready
            assert not old_b.alive
            assert [r.reason for r in b.node.peers.closed_sessions()] == [
                "the peer started a new session on this connection"
            ]
