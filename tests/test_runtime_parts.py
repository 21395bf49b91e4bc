"""The runtime's small parts on their own: the runner, the timer, the frozen records.

The runner steps actors to completion in arrival order (an input handed over
during a step waits for it); the timer expires items at their deadlines, on
trio's clock, skipping entries an item has moved on from; the core's records
are frozen.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import msgspec
import pytest
import trio

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core.consumer_state import ConsumerState, Load
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer_state import ActiveLookup, PinJob, ProducerState, RoundState
from p2pactor.core.timings import DEFAULT_TIMINGS
from p2pactor.runtime.actor import ActorInput, RequestActor, Runner
from p2pactor.runtime.timers import Timers

CONSUMER = ActorId(Role.CONSUMER, "p:1", "req", 0)


class Host:
    """An actor host that records what happens and can feed inputs mid-step."""

    def __init__(self) -> None:
        self.runner = Runner()
        self.steps: list[tuple[str, list[str]]] = []
        self.then: list[tuple[RequestActor, ActorInput]] = []
        self.dropped: list[ActorInput] = []
        self.armed = 0

    def admit(self, actor: RequestActor, event_input: ActorInput) -> ActorInput | None:
        if actor.done:
            self.dropped.append(event_input)
            return None
        return event_input

    def stepped(
        self, actor: RequestActor, event_input: ActorInput, events: Sequence[ev.AnyEvent] | None
    ) -> None:
        if events is None:
            raise AssertionError(f"failed on {event_input}")
        self.armed += actor.moved
        if not events:
            return
        self.steps.append((actor.id.kv_request_id, [e.KIND for e in events]))
        # What an embedded parent does: answer inside the step that asked.
        while self.then:
            self.runner.deliver(*self.then.pop(0))
        assert self.steps[-1][1] == [e.KIND for e in events]  # nothing ran in between


def actor(host: Host, kv: str = "req") -> RequestActor:
    return RequestActor(ActorId(Role.CONSUMER, "p:1", kv, 0), host, DEFAULT_TIMINGS)


async def test_an_input_handed_over_during_a_step_waits_for_it() -> None:
    host = Host()
    a, b = actor(host, "a"), actor(host, "b")
    key = b"k" * 36
    host.then = [(b, inp.Register((key,))), (a, inp.Register((key,), flush=True))]
    host.runner.deliver(a, inp.Register((key,)))
    assert host.steps == [
        ("a", ["Registered"]),
        ("b", ["Registered"]),
        ("a", ["Probed"]),
    ]
    assert not host.runner.running
    assert host.armed == 1  # the lookup's progress deadline


async def test_an_input_for_an_ended_actor_is_dropped_and_reported() -> None:
    host = Host()
    a = actor(host)
    host.runner.deliver(a, inp.Register((b"k" * 36,)))
    host.runner.deliver(a, inp.Finish())
    assert a.done
    host.runner.deliver(a, inp.Flush())
    assert host.dropped == [inp.Flush()]
    a2 = actor(host, "other")
    a2.abandon()
    host.runner.deliver(a2, inp.Finish())
    assert host.dropped == [inp.Flush(), inp.Finish()]
    assert a2.state == ConsumerState.new(a2.id)


@attrs.define(eq=False)
class Alarm:
    name: str
    log: list[tuple[str, float]]
    deadline: float | None = None

    def expire(self) -> None:
        self.log.append((self.name, trio.current_time()))
        self.deadline = None


async def test_the_timer_expires_items_at_their_deadlines_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    timers = Timers()
    fired: list[tuple[str, float]] = []
    start = trio.current_time()
    late, early, moved = Alarm("late", fired), Alarm("early", fired), Alarm("moved", fired)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        late.deadline = start + 10
        timers.arm(late)
        await trio.sleep(1)
        early.deadline = start + 3  # earlier than what the timer sleeps for
        timers.arm(early)
        moved.deadline = start + 2
        timers.arm(moved)
        moved.deadline = start + 5  # moved on: its first entry is stale
        timers.arm(moved)
        await trio.sleep(20)
        nursery.cancel_scope.cancel()
    assert [(name, at - start) for name, at in fired] == [
        ("early", 3),
        ("moved", 5),
        ("late", 10),
    ]
    assert timers.fired == 3


async def test_an_item_disarmed_before_its_deadline_never_expires(
    autojump_clock: trio.abc.Clock,
) -> None:
    timers = Timers()
    fired: list[tuple[str, float]] = []
    item = Alarm("x", fired, deadline=trio.current_time() + 1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(timers.run)
        timers.arm(item)
        item.deadline = None
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert fired == []


def test_stale_entries_are_dropped_when_they_outnumber_live_ones() -> None:
    timers = Timers()
    items = [Alarm(str(i), []) for i in range(10)]
    for round_ in range(2000):
        for item in items:
            item.deadline = 100.0 + round_
            timers.arm(item)
    assert len(timers) < 5000  # 20,000 arms, 10 live items


CORE_RECORDS = [
    ConsumerState.new(CONSUMER),
    Load(job_id=1, deadline=2.0),
    ProducerState.new(ActorId(Role.PRODUCER, "p:1", "req", 0)),
    ActiveLookup(lookup_id=1, round_seq=0, keys=(b"k",), admitted=1, deadline=5.0),
    RoundState(round_seq=3),
    PinJob(job_id=1, round_seq=0, keys=(b"k",), blocks=(1,), expires_at=9.0),
    CONSUMER,
    inp.Register((b"k",), flush=True),
]


@pytest.mark.parametrize("record", CORE_RECORDS, ids=lambda r: type(r).__name__)
def test_core_records_are_frozen_and_copied_whole(record: msgspec.Struct) -> None:
    # State is replaced, never mutated: a watcher on another thread reads it whole.
    first = msgspec.structs.fields(record)[0].name
    with pytest.raises(AttributeError):
        setattr(record, first, getattr(record, first))
    copy = msgspec.structs.replace(record)
    assert copy == record
    assert copy is not record
    with pytest.raises(TypeError):
        msgspec.structs.replace(record, no_such_field=1)


def test_every_event_kind_is_either_effectful_or_a_record_only() -> None:
    from p2pactor.core import effects as fx  # noqa: PLC0415

    record_only = {
        ev.Ignored, ev.SessionLost, ev.FinishRequested, ev.Opened, ev.Registered,
        ev.LookupResp, ev.LookupTimedOut, ev.KeysResolved, ev.KeysPinned, ev.KeysRefused,
        ev.FetchRefused, ev.ParentExpired, ev.PendingExpired, ev.LookupDropped,
        ev.StoreAdded, ev.FetchReceived, ev.TransferCompleted, ev.TransferFailed,
        ev.AbortReceived, ev.RoundClosed, ev.CloseRequested, ev.PinsRenewed,
    }  # fmt: skip
    assert fx.EFFECTFUL.isdisjoint(record_only)
    assert fx.EFFECTFUL | record_only == set(ev.EVENT_TYPES.values())
