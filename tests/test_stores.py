"""The store desk: where prefill/decode stores wait for the fetch that binds them.

Time is a variable the test moves; producers are plain objects that record what
reaches them and whose end the test decides; released pins are recorded.
"""

from __future__ import annotations

import attrs
import pytest

from p2pactor.core import inputs as inp
from p2pactor.runtime.actor import Ground, Runner
from p2pactor.runtime.config import NodeConfig
from p2pactor.runtime.stores import REAPED_MEMORY_S, StoreDesk
from p2pactor.runtime.timers import Timers

TIMEOUT = 60.0


@attrs.define(eq=False)
class Handle:
    name: str
    done: bool = False
    got: list[object] = attrs.field(factory=list)

    @property
    def id(self) -> Handle:
        return self

    @property
    def kv_request_id(self) -> str:
        return self.name

    def step(self, item: object, now: float) -> None:
        self.got.append(item)


@attrs.define
class Desk:
    now: float = 0.0
    released: list[int] = attrs.field(factory=list)
    timers: Timers = attrs.field(factory=Timers)
    desk: StoreDesk = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        config = NodeConfig(unbound_store_timeout=TIMEOUT)
        runner = Runner(clock=lambda: self.now)
        ground = Ground(config, runner, self.timers, lambda: self.now)
        self.desk = StoreDesk(ground, self.released.append)

    def store(self, kv_id: str, job: int, now: float) -> None:
        self.now = now
        self.desk.store(kv_id, store(job))

    def reap(self, now: float) -> list[int]:
        self.now = now
        before = len(self.released)
        self.desk.expire()
        return self.released[before:]


def store(job: int) -> inp.AddStore:
    return inp.AddStore(job_id=job, keys=(b"k" * 36,), blocks=(job,))


def test_a_store_before_its_fetch_waits_and_goes_to_the_producer_the_fetch_opens() -> None:
    d = Desk()
    d.store("r", 1, now=0.0)
    d.store("r", 2, now=1.0)
    assert d.released == []
    assert d.desk.deadline == TIMEOUT  # both wait, the reaper armed
    producer = Handle("r")
    d.desk.bind(producer)
    assert producer.got == [store(1), store(2)]  # in order, and not finished
    d.store("r", 3, now=2.0)
    assert producer.got == [store(1), store(2), store(3)]  # bound from now on
    assert d.reap(now=10 * TIMEOUT) == []  # nothing waits any more


def test_a_finished_request_is_finished_when_its_fetch_binds_it() -> None:
    d = Desk()
    d.store("r", 1, now=0.0)
    d.desk.finish("r")  # nobody bound: remembered
    producer = Handle("r")
    d.desk.bind(producer)
    assert producer.got == [store(1), inp.Finish()]


def test_finish_reaches_the_live_bound_producer_only() -> None:
    d = Desk()
    producer = Handle("r")
    d.desk.bind(producer)
    d.desk.finish("r")
    assert producer.got == [inp.Finish()]
    producer.done = True
    d.desk.finish("r")
    assert producer.got == [inp.Finish()]
    # A store for an ended producer waits for the next fetch.
    d.store("r", 1, now=0.0)
    assert producer.got == [inp.Finish()]
    assert d.desk.deadline == TIMEOUT


def test_stores_nobody_fetched_are_reaped_and_later_ones_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = Desk()
    d.store("r", 1, now=0.0)
    d.store("r", 2, now=30.0)
    d.store("s", 3, now=10.0)
    assert d.desk.deadline == TIMEOUT
    assert d.reap(now=TIMEOUT - 0.001) == []
    assert d.reap(now=TIMEOUT) == [1, 2]
    assert d.desk.deadline == 10.0 + TIMEOUT
    d.store("r", 4, now=TIMEOUT + 1)  # refused: its pin released at once
    assert d.released == [1, 2, 4]
    (refused,) = [r for r in caplog.records if "refused a store" in r.getMessage()]
    assert refused.levelname == "WARNING"
    assert "unbound_store_timeout" in refused.getMessage()  # says what to raise
    # A fetch for a reaped id is finished at once: nothing can be served under it.
    late = Handle("r")
    d.desk.bind(late)
    assert late.got == [inp.Finish()]
    # Reaped ids are remembered for a while only.
    assert d.reap(now=TIMEOUT + REAPED_MEMORY_S) == [3]
    again = Handle("r")
    d.desk.bind(again)
    assert again.got == []


def test_bindings_of_a_closed_session_are_forgotten() -> None:
    d = Desk()
    mine, other = Handle("a"), Handle("b")
    d.desk.bind(mine)
    d.desk.bind(other)
    d.desk.forget(lambda h: h is mine)
    d.store("a", 1, now=0.0)
    d.store("b", 2, now=0.0)
    assert mine.got == []  # waits for the next fetch
    assert other.got == [store(2)]
    assert d.desk.deadline == TIMEOUT


def test_ended_bindings_do_not_pile_up_under_a_flood_of_request_ids() -> None:
    d = Desk()
    for i in range(5000):
        d.desk.bind(Handle(f"r{i}", done=True))
    assert len(d.desk._bound) <= 1024
