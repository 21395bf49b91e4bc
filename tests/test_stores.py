"""The store book: where prefill/decode stores wait for the fetch that binds them (pure).

Time is an argument; handles are plain objects whose liveness the test decides.
"""

from __future__ import annotations

import attrs

from p2pactor.core import inputs as inp
from p2pactor.core.stores import REAPED_MEMORY_S, Reaped, StoreBook, StoreRefused, Unbound

TIMEOUT = 60.0


@attrs.define(eq=False)
class Handle:
    name: str
    alive: bool = True


def book() -> StoreBook[Handle]:
    return StoreBook(TIMEOUT, alive=lambda h: h.alive)


def store(job: int) -> inp.AddStore:
    return inp.AddStore(job_id=job, keys=(b"k" * 36,), blocks=(job,))


def test_a_store_before_its_fetch_waits_and_goes_to_the_producer_the_fetch_opens() -> None:
    b = book()
    assert b.store("r", store(1), now=0.0) == Unbound()
    assert b.store("r", store(2), now=1.0) == Unbound()
    assert b.waiting == 2
    producer = Handle("p")
    assert b.bind("r", producer) == ((store(1), store(2)), False)
    assert b.waiting == 0
    assert b.store("r", store(3), now=2.0) is producer  # bound from now on


def test_a_finished_request_is_finished_when_its_fetch_binds_it() -> None:
    b = book()
    b.store("r", store(1), now=0.0)
    assert b.finish("r") is None
    assert b.bind("r", Handle("p")) == ((store(1),), True)


def test_finish_reaches_the_live_bound_producer_only() -> None:
    b = book()
    producer = Handle("p")
    b.bind("r", producer)
    assert b.finish("r") is producer
    producer.alive = False
    assert b.finish("r") is None
    # A store for an ended producer waits for the next fetch.
    assert b.store("r", store(1), now=0.0) == Unbound()


def test_stores_nobody_fetched_are_reaped_and_later_ones_refused() -> None:
    b = book()
    b.store("r", store(1), now=0.0)
    b.store("r", store(2), now=30.0)
    b.store("s", store(3), now=10.0)
    assert b.next_deadline() == TIMEOUT
    assert b.reap(now=TIMEOUT - 0.001) == []
    assert b.reap(now=TIMEOUT) == [
        Reaped(kv_request_id="r", job_id=1),
        Reaped(kv_request_id="r", job_id=2),
    ]
    assert b.reaped("r")
    assert b.next_deadline() == 10.0 + TIMEOUT
    refused = b.store("r", store(4), now=TIMEOUT + 1)
    assert isinstance(refused, StoreRefused)
    assert refused.job_id == 4
    assert "unbound_store_timeout" in refused.reason
    # A fetch for a reaped id is finished at once: nothing can be served under it.
    assert b.bind("r", Handle("late")) == ((), True)
    # Reaped ids are remembered for a while only.
    b.reap(now=TIMEOUT + REAPED_MEMORY_S)
    assert not b.reaped("r")


def test_bindings_of_a_closed_session_are_forgotten() -> None:
    b = book()
    mine, other = Handle("mine"), Handle("other")
    b.bind("a", mine)
    b.bind("b", other)
    b.unbind(lambda h: h is mine)
    assert b.store("a", store(1), now=0.0) == Unbound()
    assert b.store("b", store(2), now=0.0) is other


def test_ended_bindings_do_not_pile_up_under_a_flood_of_request_ids() -> None:
    b = book()
    for i in range(5000):
        b.bind(f"r{i}", Handle(str(i), alive=False))
    assert b.bound <= 1024
