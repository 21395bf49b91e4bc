"""Seed peers are dialed again after their session ends; the summaries come back with them.

The back-off alone (a fake clock and timer), then two nodes in memory on a
mock clock: the session with a seed is cut, the node dials it again after the
first wait, and the seed's summary is whole again.
"""

from __future__ import annotations

import trio

from p2pactor.runtime.peers import SeedRedial
from p2pactor.runtime.timers import Timed
from tests.cluster import key, node_id, open_cluster
from tests.test_directory import until


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Timers:
    def __init__(self) -> None:
        self.armed: list[Timed] = []

    def arm(self, item: Timed) -> None:
        self.armed.append(item)


def _redial() -> tuple[SeedRedial, _Clock, list[str]]:
    clock, dialed = _Clock(), []
    redial = SeedRedial(
        ["seed:1"], dialed.append, timers=_Timers(), clock=clock, first_s=1.0, max_s=5.0
    )  # type: ignore[arg-type]
    return redial, clock, dialed


def test_a_lost_seed_is_dialed_again_after_a_back_off_that_doubles_up_to_its_cap() -> None:
    redial, clock, dialed = _redial()
    waits = []
    for _ in range(5):  # each attempt fails: the session ends again
        redial.lost("seed:1")
        when = redial.deadline
        assert when is not None
        waits.append(when - clock.now)
        clock.now = when - 0.001
        redial.expire()
        assert dialed.count("seed:1") == len(waits) - 1  # not yet
        clock.now = when
        redial.expire()
        assert dialed.count("seed:1") == len(waits)
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    redial.connected("seed:1")  # a handshake held: the next loss waits 1 s again
    redial.lost("seed:1")
    assert redial.deadline == clock.now + 1.0


def test_only_seeds_are_dialed_again_and_none_once_the_node_closes() -> None:
    redial, clock, dialed = _redial()
    redial.lost("stranger:1")
    assert redial.deadline is None
    redial.lost("seed:1")
    redial.stop()
    clock.now = 100.0
    redial.expire()
    assert dialed == []


async def test_a_cut_session_with_a_seed_heals_and_its_summary_comes_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    seeds = {"a": {"seed_peers": [node_id("b")]}}
    async with open_cluster("a", "b", per_node=seeds) as cluster:
        a, b = cluster["a"], cluster["b"]
        b.store(key(1), key(2))
        index = a.node.directory.index
        await until(lambda: len(index.peer(b.id).claims) == 2)
        session = a.node.peers.session(b.id)
        assert session is not None
        cut = trio.current_time()
        session.close("test: the link was cut")
        await until(
            lambda: a.node.peers.session(b.id) is not session and len(index.peer(b.id).claims) == 0
        )
        await until(lambda: (s := a.node.peers.session(b.id)) is not None and s.ready, within=30)
        assert trio.current_time() - cut >= 1.0  # the first back-off, not a tight loop
        await until(lambda: len(index.peer(b.id).claims) == 2)
