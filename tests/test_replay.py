"""Replaying recorded logs: ``p2pactor.surface.replay`` and the ``p2pactor replay`` command.

Logs are made the way the runtime will make them, without the runtime: each
scenario drives real consumer and producer cores through ``tests.harness``
(which performs their effects against in-memory doubles), and the events the
cores decided are written through :class:`p2pactor.runtime.log.EventLog`, several
actors interleaved as a node would interleave them. Replay must rebuild
exactly the state each live harness ended with, pass ``--check`` on every such
log, and name the request and the event when a log is broken on purpose:
a pin never released, a context closed twice, a round never ended, an
``abort_ack`` while a write is in flight, a phase going back, a gap in the
sequence. A log cut short (the node was killed) leaves *unfinished*
obligations, which are not violations.

The module also holds the scenario builders that ``tests/test_log.py`` and the
benchmarks use.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import attrs
import pytest
from msgspec.structs import replace

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerPhase, ProducerState
from p2pactor.programs.cli import main
from p2pactor.runtime.log import Durability, EventLog
from p2pactor.runtime.logread import read_log
from p2pactor.surface.replay import Replayer, ReplayResult, describe, replay, replay_logs
from tests.harness import ConsumerHarness, ProducerHarness, key

NODE_A = "10.0.0.1:5710"
"""The node whose requests pull blocks (its consumers' peer is NODE_B)."""
NODE_B = "10.0.0.2:5710"
"""The node that serves them (its producers' peer is NODE_A)."""

K1, K2, K3, K4 = key(1), key(2), key(3), key(4)
BLOCK = {K1: 11, K2: 12, K3: 13, K4: 14}
STEP = 0.001
"""Time between two inputs of a scenario, so timelines are not all at +0.000s."""


# --- scenarios: real cores driven by the harness ----------------------------------------


@attrs.define
class Scenario:
    """The consumers (on NODE_A) and producers (on NODE_B) of one scenario."""

    name: str
    consumers: list[ConsumerHarness] = attrs.field(factory=list)
    producers: list[ProducerHarness] = attrs.field(factory=list)


def consumer(kv: str) -> ConsumerHarness:
    return ConsumerHarness(state=ConsumerState.new(ActorId(Role.CONSUMER, NODE_B, kv)))


def producer(
    kv: str,
    *,
    stored: Iterable[bytes] = (),
    pending: Iterable[bytes] = (),
    auto_serve: bool = True,
) -> ProducerHarness:
    h = ProducerHarness(
        state=ProducerState.new(ActorId(Role.PRODUCER, NODE_A, kv)), auto_serve=auto_serve
    )
    h.cache.stored = {k: BLOCK[k] for k in stored}
    h.cache.pending = set(pending)
    return h


def kv_of(h: ConsumerHarness | ProducerHarness) -> str:
    return h.state.actor.kv_request_id


def resp(h: ConsumerHarness, keys: Sequence[bytes], hits: Sequence[bool], rnd: int = 0) -> None:
    h.advance(STEP)
    h.feed(wire.LookupResp(kv_request_id=kv_of(h), keys=keys, hits=hits, round_seq=rnd))


def done(h: ConsumerHarness, rnd: int = 0, *, success: bool = True) -> None:
    h.advance(STEP)
    h.feed(wire.TransferDone(kv_request_id=kv_of(h), success=success, round_seq=rnd))


def ask(h: ConsumerHarness, *keys: bytes) -> None:
    h.advance(STEP)
    h.register(*keys)
    h.flush()


def load(h: ConsumerHarness, job: int, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
    h.advance(STEP)
    h.load(job, keys, blocks)


def at(h: ConsumerHarness | ProducerHarness, t: float) -> None:
    assert t >= h.now
    h.now = t


def step(h: ProducerHarness) -> None:
    h.advance(STEP)


def happy(kv: str) -> Scenario:
    """Lookup, fetch, transfer, finish: both roles succeed."""
    c = consumer(kv)
    ask(c, K1, K2, K3)
    resp(c, [K1, K2, K3], [True, True, False])
    load(c, 7, [K1, K2], [3, 4])
    done(c)
    c.finish()
    p = producer(kv, stored=[K1, K2])
    p.lookup(K1, K2, K3)
    step(p)
    p.fetch([K1, K2], [3, 4])
    step(p)
    p.complete_all()
    return Scenario("happy", [c], [p])


def aborted(kv: str) -> Scenario:
    """The consumer finishes with its load in flight: abort, ack after the write ends."""
    c = consumer(kv)
    ask(c, K1)
    resp(c, [K1], [True])
    load(c, 8, [K1], [5])
    c.advance(0.5)
    c.finish()
    c.advance(STEP)
    c.feed(wire.AbortAck(kv_request_id=kv, round_seq=0))
    p = producer(kv, stored=[K1])
    p.lookup(K1)
    step(p)
    p.fetch([K1], [5])
    step(p)
    p.abort(0)
    step(p)
    p.complete(0)
    return Scenario("aborted", [c], [p])


def timeouts(kv: str) -> Scenario:
    """A lookup times out, a load is aborted and never acked; a pending key and a pin expire."""
    c = consumer(kv)
    ask(c, K1)
    at(c, 31.0)
    c.tick()
    load(c, 9, [K2], [6])
    at(c, 61.01)
    c.tick()
    at(c, 71.02)
    c.tick()
    c.finish()
    p = producer(kv, stored=[K2], pending=[K1])
    p.lookup(K1, K2)
    at(p, 1.0)
    p.tick()
    at(p, 5.0)
    p.tick()
    at(p, 35.0)
    p.tick()
    step(p)
    p.feed(inp.SessionEnded("peer gone"))
    return Scenario("timeouts", [c], [p])


def session_end(kv: str) -> Scenario:
    """The session dies with a load (consumer) and a write (producer) in flight."""
    c = consumer(kv)
    ask(c, K1, K2)
    resp(c, [K1, K2], [True, True])
    load(c, 10, [K1, K2], [1, 2])
    c.advance(STEP)
    c.feed(inp.SessionEnded("peer gone"))
    p = producer(kv, stored=[K1, K2])
    p.lookup(K1, K2)
    step(p)
    p.fetch([K1, K2], [1, 2])
    step(p)
    p.feed(inp.SessionEnded("peer gone"))
    step(p)
    p.complete(0)
    return Scenario("session_end", [c], [p])


def prefill_decode(kv: str) -> Scenario:
    """A decode node loads what a prefill node stores, without any lookup."""
    c = consumer(kv)
    load(c, 11, [K1, K2], [5, 6])
    c.advance(0.2)
    done(c)
    c.finish()
    p = producer(kv)
    p.fetch([K1, K2], [5, 6])
    step(p)
    p.feed(inp.AddStore(job_id=1, keys=(K1,), blocks=(21,)))
    step(p)
    p.complete(0)
    step(p)
    p.feed(inp.AddStore(job_id=2, keys=(K2,), blocks=(22,)))
    step(p)
    p.complete(1)
    step(p)
    p.feed(inp.Finish())
    return Scenario("prefill_decode", [c], [p])


def two_rounds(kv: str) -> Scenario:
    """Two lookup -> fetch rounds on one request, then a stray parent answer."""
    c = consumer(kv)
    ask(c, K1)
    resp(c, [K1], [True])
    load(c, 12, [K1], [1])
    done(c, 0)
    ask(c, K3)
    resp(c, [K3], [True], rnd=1)
    load(c, 13, [K3], [3])
    done(c, 1)
    c.finish()
    p = producer(kv, stored=[K1, K3])
    p.lookup(K1, round_seq=0)
    step(p)
    p.fetch([K1], [1], round_seq=0)
    step(p)
    # The next round's lookup comes while round 0 is still being written: a
    # producer with nothing left to serve closes, and its id would start afresh.
    p.lookup(K3, round_seq=1)
    step(p)
    p.complete(0)
    step(p)
    # A parent answer no lookup waits for: its pin is released at once.
    p.feed(inp.ParentAnswer(lookup_id=99, pin=inp.Pin(2000, (K4,), (14,))))
    step(p)
    p.fetch([K3], [3], round_seq=1)
    step(p)
    p.complete_all()
    return Scenario("two_rounds", [c], [p])


def rejected(kv: str) -> Scenario:
    """A peer fetches the same round twice: a protocol violation, then the session ends."""
    p = producer(kv, stored=[K1])
    p.lookup(K1)
    step(p)
    p.fetch([K1], [1])
    step(p)
    p.fetch([K1], [1])
    step(p)
    p.feed(inp.SessionEnded("protocol violation"))
    step(p)
    p.complete_all()
    return Scenario("rejected", [], [p])


SCENARIOS: dict[str, Callable[[str], Scenario]] = {
    "happy": happy,
    "aborted": aborted,
    "timeouts": timeouts,
    "session_end": session_end,
    "prefill_decode": prefill_decode,
    "two_rounds": two_rounds,
    "rejected": rejected,
}


def interleave(logs: Sequence[Sequence[ev.AnyEvent]]) -> list[ev.AnyEvent]:
    """Merge per-actor logs by time, as a node records concurrent actors (stable)."""
    tagged = [(e.at, i, n, e) for i, log in enumerate(logs) for n, e in enumerate(log)]
    tagged.sort(key=lambda t: (t[0], t[1], t[2]))
    return [e for _, _, _, e in tagged]


def all_scenarios() -> list[Scenario]:
    return [build(f"req-{name}") for name, build in SCENARIOS.items()]


def node_events(scenarios: Iterable[Scenario]) -> tuple[list[ev.AnyEvent], list[ev.AnyEvent]]:
    """Node A's events (consumers) and node B's (producers), interleaved."""
    scenarios = list(scenarios)
    a = interleave([c.log for s in scenarios for c in s.consumers])
    b = interleave([p.log for s in scenarios for p in s.producers])
    return a, b


def event_mix() -> list[ev.AnyEvent]:
    """Every scenario's events on both nodes: a realistic mix of event types and sizes."""
    a, b = node_events(all_scenarios())
    return a + b


def write_log(
    path: Path,
    events: Iterable[ev.AnyEvent],
    node_id: str,
    *,
    batch: int = 4,
    clock_origin: tuple[float, float] | None = None,
) -> Path:
    """Write ``events`` through an EventLog, ``batch`` at a time, and close it."""
    with EventLog(
        node_id, path=path, durability=Durability.on_close(), clock_origin=clock_origin
    ) as log:
        pending: list[ev.AnyEvent] = []
        for event in events:
            pending.append(event)
            if len(pending) == batch:
                log.append(pending)
                pending = []
        log.append(pending)
    return path


def write_nodes(tmp_path: Path, scenarios: Iterable[Scenario]) -> tuple[Path, Path]:
    a, b = node_events(scenarios)
    return (
        write_log(tmp_path / "a.log", a, NODE_A, clock_origin=(1_700_000_000.0, 0.0)),
        write_log(tmp_path / "b.log", b, NODE_B),
    )


def renumbered(events: Iterable[ev.AnyEvent]) -> list[ev.AnyEvent]:
    """One actor's events with seq 1, 2, 3... (after an edit that removed or added some)."""
    return [replace(e, seq=i) for i, e in enumerate(events, start=1)]


def repeated_pattern(total: int, *, group: int = 16) -> Iterator[ev.AnyEvent]:
    """About ``total`` events: the happy pair of actors again and again, distinct ids.

    ``group`` pairs at a time are interleaved, as a busy node interleaves them.
    """
    template = happy("req-0000000")
    pattern = [*template.consumers[0].log, *template.producers[0].log]
    pairs = -(-total // len(pattern))
    for first in range(0, pairs, group):
        logs = []
        for i in range(first, min(first + group, pairs)):
            kv = f"req-{i:07d}"
            offset = i * 0.01
            logs.append(
                [
                    replace(e, actor=replace(e.actor, kv_request_id=kv), at=e.at + offset)
                    for e in pattern
                ]
            )
        yield from interleave(logs)


# --- replay rebuilds the live state -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_rebuilds_every_live_state(tmp_path: Path, name: str) -> None:
    scenario = SCENARIOS[name](f"req-{name}")
    result = replay(write_nodes(tmp_path, [scenario]), check=True)

    for h in scenario.consumers:
        assert result.actor(NODE_A, h.state.actor).state == h.state
    for p in scenario.producers:
        assert result.actor(NODE_B, p.state.actor).state == p.state
    assert len(result.actors) == len(scenario.consumers) + len(scenario.producers)
    assert result.violations == ()
    assert result.unfinished == ()
    assert result.ok


def test_replay_of_many_interleaved_actors_rebuilds_each(tmp_path: Path) -> None:
    scenarios = all_scenarios()
    result = replay(write_nodes(tmp_path, scenarios), check=True)

    harnesses: list[tuple[str, ConsumerHarness | ProducerHarness]] = [
        (NODE_A, h) for s in scenarios for h in s.consumers
    ]
    harnesses += [(NODE_B, h) for s in scenarios for h in s.producers]
    assert len(result.actors) == len(harnesses)
    for node, h in harnesses:
        replayed = result.actor(node, h.state.actor)
        assert replayed.state == h.state
        assert replayed.events == len(h.log)
        assert replayed.terminal
    assert result.ok, result.violations


def test_final_phases_and_outcomes(tmp_path: Path) -> None:
    result = replay(write_nodes(tmp_path, all_scenarios()))

    def consumer_of(name: str) -> ConsumerState:
        state = result.actor(NODE_A, ActorId(Role.CONSUMER, NODE_B, f"req-{name}")).state
        assert isinstance(state, ConsumerState)
        return state

    assert consumer_of("happy").phase is ConsumerPhase.DONE
    assert consumer_of("aborted").phase is ConsumerPhase.ABORTED
    assert consumer_of("timeouts").phase is ConsumerPhase.ABORTED
    assert consumer_of("session_end").phase is ConsumerPhase.FAILED
    assert consumer_of("prefill_decode").phase is ConsumerPhase.DONE
    assert all(
        r.state.phase is ProducerPhase.CLOSED
        for r in result.actors
        if r.actor.role is Role.PRODUCER
    )
    session = result.actor(NODE_A, ActorId(Role.CONSUMER, NODE_B, "req-session_end"))
    assert session.outcome == "round 0: session lost: peer gone"


# --- timelines and summary ----------------------------------------------------------------


def test_timeline_rows_have_relative_times_kinds_and_details(tmp_path: Path) -> None:
    scenario = happy("req-1")
    result = replay(write_nodes(tmp_path, [scenario]))
    c = result.actor(NODE_A, scenario.consumers[0].state.actor)

    assert c.timeline is not None
    assert [row.kind for row in c.timeline] == scenario.consumers[0].kinds()
    assert [row.seq for row in c.timeline] == list(range(1, len(c.timeline) + 1))
    first = scenario.consumers[0].log[0].at
    assert [row.t for row in c.timeline] == [e.at - first for e in scenario.consumers[0].log]
    details = {row.kind: row.detail for row in c.timeline}
    assert details["Probed"] == "round 0, 3 keys"
    assert details["LookupResp"] == "round 0, 2 hits, 1 miss"
    assert details["FetchSent"] == "round 0, job 7, 2 blocks, next round 1"
    assert details["TransferDone"] == "round 0, job 7, success"
    assert details["Finished"] == "done: finished; the engine finished it"

    p = result.actor(NODE_B, scenario.producers[0].state.actor)
    assert p.timeline is not None
    details = {row.kind: row.detail for row in p.timeline}
    assert details["LookupAnswered"] == (
        "lookup 0, round 0, 2/3 hits, job 1000 pinned 2 blocks; the parent answered, context closed"
    )
    assert details["TransferStarted"] == "transfer 0, round 0, 2 blocks, jobs 1000"
    assert details["PinReleased"] == "job 1000, success: round served"


def test_every_event_kind_has_a_description() -> None:
    seen = {e.KIND: describe(e) for e in event_mix()}
    assert {"Ignored", "Rejected", "PendingExpired", "AbortAckSent", "StoreAdded"} <= set(seen)
    assert all(isinstance(d, str) for d in seen.values())


def test_summary_counts(tmp_path: Path) -> None:
    scenarios = all_scenarios()
    result = replay(write_nodes(tmp_path, scenarios))
    s = result.summary
    events = [e for sc in scenarios for h in [*sc.consumers, *sc.producers] for e in h.log]

    def count(kind: str) -> int:
        return sum(1 for e in events if kind == e.KIND)

    assert s.events == len(events)
    assert s.actors == sum(len(sc.consumers) + len(sc.producers) for sc in scenarios)
    assert s.phases == {
        "consumer": {"aborted": 2, "done": 3, "failed": 1},
        "producer": {"closed": 7},
    }
    assert s.lookups_sent == count("Probed")
    assert s.lookups_received == count("LookupReceived")
    assert s.fetches_sent == count("FetchSent")
    assert s.transfers_completed == count("TransferCompleted")
    assert s.aborts_sent == count("AbortSent") == 2
    answered_pins = sum(
        1 for e in events if isinstance(e, ev.LookupAnswered) and e.pinned is not None
    )
    closed_pins = sum(len(e.released) for e in events if isinstance(e, ev.Closed))
    assert answered_pins > 0
    assert s.pins_created == count("KeysPinned") + count("StoreAdded") + answered_pins == 9
    assert s.pins_released == count("PinReleased") + closed_pins == 10
    assert s.rejected == 1
    assert s.keys_hit == 7
    assert s.keys_missed == 1
    assert s.keys_timed_out == 1
    assert s.keys_served_timed_out == 1
    assert (s.keys_served_hit, s.keys_served_missed) == (9, 1)
    assert s.loads_done == 4
    assert s.loads_failed == 3
    assert s.violations == 0
    assert s.by_kind["Finished"] == 6


def test_request_limits_the_replay_to_one_kv_request_id(tmp_path: Path) -> None:
    result = replay(write_nodes(tmp_path, all_scenarios()), request="req-aborted")

    assert {(r.node_id, r.actor.role) for r in result.actors} == {
        (NODE_A, Role.CONSUMER),
        (NODE_B, Role.PRODUCER),
    }
    assert {r.actor.kv_request_id for r in result.actors} == {"req-aborted"}
    assert result.summary.actors == 2


def test_timelines_limit_keeps_rows_for_the_first_actors_only(tmp_path: Path) -> None:
    result = replay(write_nodes(tmp_path, all_scenarios()), timelines=2)

    assert sum(1 for r in result.actors if r.timeline is not None) == 2
    assert all(r.state is not None for r in result.actors)


def test_wall_times_come_from_the_clock_origin(tmp_path: Path) -> None:
    a, b = write_nodes(tmp_path, [happy("req-1")])
    assert read_log(a).header.wall_time(2.5) == 1_700_000_002.5
    assert read_log(b).header.wall_time(2.5) is None


# --- check: good logs pass, broken logs name the request and the event ---------------------


def check_one(tmp_path: Path, events: Sequence[ev.AnyEvent], node: str = NODE_B) -> ReplayResult:
    path = write_log(tmp_path / "x.log", events, node)
    result = replay([path], check=True)
    # Without timelines every event takes the inline path of Replayer.feed: it
    # must find exactly what the path that builds timeline rows finds.
    inline = replay([path], check=True, timelines=0)
    assert inline.violations == result.violations
    assert inline.unfinished == result.unfinished
    assert inline.summary == result.summary
    assert [r.state for r in inline.actors] == [r.state for r in result.actors]
    return result


def only_violation(result: ReplayResult, kind: str, seq: int, *, contains: str) -> None:
    matching = [v for v in result.violations if v.kind == kind and v.seq == seq]
    assert matching, result.violations
    assert any(contains in v.message for v in matching), matching
    for v in matching:
        assert v.actor.kv_request_id == "req-x"
        assert "req-x" in str(v)
        assert f"#{seq} {kind}" in str(v)


def without(events: Sequence[ev.AnyEvent], kind: str, nth: int = 0) -> list[ev.AnyEvent]:
    idx = [i for i, e in enumerate(events) if kind == e.KIND][nth]
    return renumbered([*events[:idx], *events[idx + 1 :]])


def index_of(events: Sequence[ev.AnyEvent], kind: str) -> int:
    return next(i for i, e in enumerate(events) if kind == e.KIND)


def test_check_passes_every_scenario(tmp_path: Path) -> None:
    result = replay(write_nodes(tmp_path, all_scenarios()), check=True)
    assert result.violations == ()
    assert result.unfinished == ()


def test_a_pin_never_released_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    broken = without(log, "PinReleased")

    result = check_one(tmp_path, broken)

    closed = broken[-1]
    assert closed.KIND == "Closed"
    only_violation(result, "Closed", closed.seq, contains="job 1000 is still pinned")


def closed_again(log: Sequence[ev.AnyEvent]) -> tuple[list[ev.AnyEvent], int]:
    """``log`` with a second close of the context its one-event answer closed; where."""
    i = index_of(log, "LookupAnswered")
    answered = log[i]
    assert isinstance(answered, ev.LookupAnswered)
    assert answered.resolved  # the answer closed the lookup's context
    again = ev.ContextClosed(actor=answered.actor, seq=0, at=answered.at, lookup_id=0)
    return renumbered([*log[: i + 1], again, *log[i + 1 :]]), i


def test_a_context_closed_twice_is_a_violation(tmp_path: Path) -> None:
    broken, i = closed_again(happy("req-x").producers[0].log)

    result = check_one(tmp_path, broken)

    only_violation(result, "ContextClosed", i + 2, contains="closed a second time")
    assert len(result.violations) == 1


def test_a_fetched_round_that_never_ends_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    broken = without(log, "TransferDoneSent")

    result = check_one(tmp_path, broken)

    only_violation(result, "Closed", broken[-1].seq, contains="round 0 was fetched and never ended")


def test_an_abort_ack_while_a_write_is_in_flight_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    i = index_of(log, "TransferStarted")
    ack = ev.AbortAckSent(actor=log[i].actor, seq=0, at=log[i].at, round_seq=0)
    broken = renumbered([*log[: i + 1], ack, *log[i + 1 :]])

    result = check_one(tmp_path, broken)

    only_violation(
        result, "AbortAckSent", i + 2, contains="while transfer 0 still writes into the peer's"
    )


def test_a_consumer_phase_going_back_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    i = index_of(log, "Probed")
    assert log[i + 1].KIND == "LookupResp"
    broken = renumbered([*log[:i], log[i + 1], log[i], *log[i + 2 :]])

    result = check_one(tmp_path, broken, NODE_A)

    only_violation(result, "LookupResp", i + 1, contains="phases only move forward")


def test_a_finished_phase_that_is_not_final_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    last = log[-1]
    assert isinstance(last, ev.Finished)
    bad = replace(last, phase=ConsumerPhase.PROBING)

    result = check_one(tmp_path, [*log[:-1], bad], NODE_A)

    only_violation(result, "Finished", bad.seq, contains="the phase went back")


def test_a_gap_in_seq_is_one_violation(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    gap = index_of(log, "LookupResp")  # an event the rest does not depend on
    broken = [*log[:gap], *log[gap + 1 :]]

    result = check_one(tmp_path, broken, NODE_A)

    only_violation(result, log[gap + 1].KIND, log[gap + 1].seq, contains="seq gap")
    assert len(result.violations) == 1


def test_a_gap_is_reported_even_without_check(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    gap = index_of(log, "LookupResp")
    result = replay([write_log(tmp_path / "x.log", [*log[:gap], *log[gap + 1 :]], NODE_A)])

    assert [v.message.split(":")[0] for v in result.violations] == ["seq gap"]


def test_a_repeated_seq_is_skipped_and_reported(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    result = check_one(tmp_path, [*log[:3], log[2], *log[3:]], NODE_A)

    only_violation(result, log[2].KIND, log[2].seq, contains="repeats or goes back")
    c = result.actors[0]
    assert c.state == happy("req-x").consumers[0].state


def test_an_event_after_finished_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    late = ev.Ignored(actor=log[0].actor, seq=len(log) + 1, at=1.0, input="x", reason="late")

    result = check_one(tmp_path, [*log, late], NODE_A)

    only_violation(result, "Ignored", late.seq, contains="after Finished")


def test_a_load_that_never_ends_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    broken = without(log, "TransferDone")

    result = check_one(tmp_path, broken, NODE_A)

    only_violation(result, "Finished", broken[-1].seq, contains="load of round 0 (job 7)")


def test_a_load_that_ends_twice_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    i = index_of(log, "TransferDone")
    broken = renumbered([*log[: i + 1], log[i], *log[i + 1 :]])

    result = check_one(tmp_path, broken, NODE_A)

    only_violation(result, "TransferDone", i + 2, contains="a load ends exactly once")


def test_a_release_of_a_job_never_pinned_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    i = index_of(log, "FetchReceived")
    stray = ev.PinReleased(
        actor=log[i].actor, seq=0, at=log[i].at, job_id=4242, success=False, reason="?"
    )
    broken = renumbered([*log[: i + 1], stray, *log[i + 1 :]])

    result = check_one(tmp_path, broken)

    only_violation(result, "PinReleased", i + 2, contains="job 4242 is released but was never")


def test_a_renewal_of_a_pin_not_held_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    i = index_of(log, "PinReleased")
    late = ev.PinsRenewed(actor=log[i].actor, seq=0, at=log[i].at, job_ids=(1000,), expires_at=99.0)
    broken = renumbered([*log[: i + 1], late, *log[i + 1 :]])

    result = check_one(tmp_path, broken)

    assert any("job 1000 is renewed but not held" in str(v) for v in result.violations)
    assert all(v.actor.kv_request_id == "req-x" for v in result.violations)


def test_the_core_release_of_a_stray_pin_is_allowed(tmp_path: Path) -> None:
    log = two_rounds("req-x").producers[0].log
    i = index_of(log, "Ignored")
    assert log[i + 1].KIND == "PinReleased"

    assert check_one(tmp_path, log).violations == ()


def test_a_pin_released_while_its_write_runs_is_a_violation(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    i = index_of(log, "TransferCompleted")
    j = index_of(log, "PinReleased")
    broken = renumbered([*log[:i], log[j], log[i], *log[i + 1 : j], *log[j + 1 :]])

    result = check_one(tmp_path, broken)

    only_violation(result, "PinReleased", i + 1, contains="while transfer 0 still reads")


def test_a_killed_producer_leaves_unfinished_obligations_not_violations(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    cut = log[: index_of(log, "TransferStarted") + 1]

    result = check_one(tmp_path, cut)

    assert result.violations == ()
    assert sorted(u.what for u in result.unfinished) == [
        "job 1000 is still pinned",
        "round 0 was fetched and never ended",
        "transfer 0 is in flight",
    ]
    (p,) = result.actors
    assert not p.terminal
    assert p.unfinished
    assert result.summary.unfinished_actors == 1
    assert result.ok


def test_a_killed_consumer_leaves_its_load_unfinished(tmp_path: Path) -> None:
    log = happy("req-x").consumers[0].log
    cut = log[: index_of(log, "FetchSent") + 1]

    result = check_one(tmp_path, cut, NODE_A)

    assert result.violations == ()
    assert [u.what for u in result.unfinished] == ["load of round 0 (job 7) in flight"]


def test_replayer_is_pure_and_yields_actors_as_they_end() -> None:
    scenario = happy("req-1")
    replayer = Replayer(check=True)
    ended = [r for e in scenario.consumers[0].log if (r := replayer.feed(NODE_A, e)) is not None]

    assert [r.actor for r in ended] == [scenario.consumers[0].state.actor]
    assert ended[0].state == scenario.consumers[0].state
    assert replayer.end() == []
    assert replayer.summary().events == len(scenario.consumers[0].log)


def test_replay_run_streams_results_before_the_end(tmp_path: Path) -> None:
    run = replay_logs(write_nodes(tmp_path, all_scenarios()), check=True)
    first = next(iter(run))
    assert first.terminal
    assert run.logs == [], "the first log is still being read"


# --- the command ----------------------------------------------------------------------------


@pytest.fixture
def logs(tmp_path: Path) -> tuple[Path, Path]:
    return write_nodes(tmp_path, all_scenarios())


def run_cli(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str, str]:
    status = main(["replay", *map(str, argv)])
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_prints_timelines_and_a_summary(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli(capsys, *logs)

    assert status == 0
    assert err == ""
    header = next(line for line in out.splitlines() if "req-happy  consumer" in line)
    assert header.startswith(NODE_A)
    assert "[done: finished]" in header
    assert "  +0.000s    #1    Registered         3 keys\n" in out
    assert "Probed             round 0, 3 keys" in out
    assert "\nsummary\n" in out
    assert "  actors             13: consumer 6 (aborted 2, done 3, failed 1), producer 7" in out
    assert "check:" not in out


def test_cli_request_shows_both_roles_of_one_request(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run_cli(capsys, *logs, "--request", "req-aborted")

    assert status == 0
    headers = [line for line in out.splitlines() if line and not line.startswith(" ")]
    assert len([h for h in headers if "req-aborted" in h]) == 2
    assert not any("req-happy" in h for h in headers)
    assert "AbortAckSent" in out


def test_cli_request_matching_nothing_exits_2(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run_cli(capsys, *logs, "--request", "nope")
    assert status == 2
    assert "no actor has kv_request_id 'nope'" in err


def test_cli_check_passes_good_logs(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run_cli(capsys, *logs, "--check")
    assert status == 0
    assert "check: no violations" in out


def test_cli_check_fails_and_names_the_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = without(happy("req-x").producers[0].log, "PinReleased")
    path = write_log(tmp_path / "x.log", broken, NODE_B)

    status, out, _ = run_cli(capsys, path, "--check")

    assert status == 1
    assert "check: 1 violations" in out
    line = next(line for line in out.splitlines() if "is still pinned" in line)
    assert f"{NODE_B}  req-x  #{broken[-1].seq} Closed: Closed while job 1000" in line


def test_cli_lists_replay_violations_even_without_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = happy("req-x").consumers[0].log
    gap = index_of(log, "LookupResp")
    path = write_log(tmp_path / "x.log", [*log[:gap], *log[gap + 1 :]], NODE_A)

    status, out, _ = run_cli(capsys, path)

    assert status == 0, "only --check turns violations into a failure"
    assert "replay: 1 violations" in out
    assert "seq gap" in out


def test_cli_limit_leaves_actors_out_but_counts_them(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, _ = run_cli(capsys, *logs, "--limit", "3", "--check")

    assert status == 0
    assert out.count(" events in ") == 3
    assert "(10 more actors not shown; use --limit N, --limit all or --request ID)" in out
    assert "  events             " in out


def test_cli_json_is_one_document_with_the_documented_keys(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run_cli(capsys, *logs, "--json", "--check")

    assert status == 0
    assert err == ""
    doc = json.loads(out)
    assert set(doc) == {
        "format",
        "check",
        "actors",
        "logs",
        "summary",
        "violations",
        "unfinished",
        "warnings",
        "ok",
    }
    assert doc["ok"] is True
    assert len(doc["actors"]) == 13
    actor = next(a for a in doc["actors"] if a["kv_request_id"] == "req-happy")
    assert set(actor) >= {"node_id", "role", "phase", "outcome", "timeline", "terminal"}
    assert actor["timeline"][0] == {"t": 0.0, "seq": 1, "kind": "Registered", "detail": "3 keys"}
    assert actor["first_wall"] is not None
    assert doc["summary"]["events"] > 0
    assert [log["node_id"] for log in doc["logs"]] == [NODE_A, NODE_B]


def test_cli_json_reports_violations_and_warnings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken, i = closed_again(happy("req-x").producers[0].log)
    path = write_log(tmp_path / "x.log", broken, NODE_B)
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # tear the tail

    status, out, err = run_cli(capsys, path, "--json", "--check")

    assert status == 1
    assert err == ""
    doc = json.loads(out)
    assert doc["ok"] is False
    (violation,) = doc["violations"]
    assert violation["kv_request_id"] == "req-x"
    assert violation["seq"] == i + 2
    assert violation["kind"] == "ContextClosed"
    (actor,) = doc["actors"]
    assert actor["terminal"] is False, "the torn tail cut the Closed event off"
    assert doc["unfinished"] == [], "nothing was held any more"
    assert "torn tail" in doc["warnings"][0]
    assert doc["logs"][0]["problem"]["kind"] == "torn_tail"


def test_cli_torn_tail_is_a_warning_not_a_failure(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = logs
    a.write_bytes(a.read_bytes()[:-5])

    status, _, err = run_cli(capsys, a, "--check")

    assert status == 0
    assert "warning:" in err
    assert "torn tail" in err


def test_cli_corruption_in_the_middle_fails_the_check(
    logs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a, _ = logs
    data = bytearray(a.read_bytes())
    data[len(data) // 2] ^= 0xFF
    a.write_bytes(bytes(data))

    status, _, err = run_cli(capsys, a, "--check")

    assert status == 1
    assert "error:" in err
    assert "corrupt at byte" in err


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: None, "no such file"),
        (lambda p: p.write_bytes(b"hello, world\n"), "is not a p2pactor event log"),
    ],
    ids=["missing", "not-a-log"],
)
def test_cli_unusable_file_exits_2_with_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], object],
    message: str,
) -> None:
    path = tmp_path / "x.log"
    make(path)

    status, out, err = run_cli(capsys, path)

    assert status == 2
    assert out == ""
    assert message in err
    assert err.count("\n") == 1


def test_cli_through_a_subprocess(logs: tuple[Path, Path], tmp_path: Path) -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "p2pactor", "replay", *map(str, logs), "--check", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ok"] is True

    broken = write_log(
        tmp_path / "x.log", without(happy("req-x").producers[0].log, "PinReleased"), NODE_B
    )
    bad = subprocess.run(
        [sys.executable, "-m", "p2pactor", "replay", str(broken), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 1
    assert "is still pinned" in bad.stdout

    missing = subprocess.run(
        [sys.executable, "-m", "p2pactor", "replay", str(tmp_path / "missing.log")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert missing.returncode == 2
    assert "no such file" in missing.stderr


# --- streaming: a big log in bounded memory ------------------------------------------------


_MEASURE = """
import contextlib, io, json, resource, sys, time
from p2pactor.programs.cli import main
from p2pactor.runtime.logread import read_log

def peak_kib():
    # VmHWM is this process's own high-water mark: ru_maxrss would include the
    # parent's, inherited across fork.
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

mode, path = sys.argv[1], sys.argv[2]
before = peak_kib()
start = time.perf_counter()
if mode == "replay":
    with contextlib.redirect_stdout(io.StringIO()) as out:
        status = main(["replay", path, "--check", "--limit", "5"])
    text = out.getvalue()
else:
    held = list(read_log(path))
    status, text = 0, str(len(held))
elapsed = time.perf_counter() - start
print(json.dumps({"growth_kib": peak_kib() - before, "status": status, "out": text,
                  "seconds": elapsed}))
"""


def measure(mode: str, path: Path) -> dict[str, object]:
    """Run replay (or load every event into a list) in a fresh interpreter; peak RSS growth."""
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, mode, str(path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_a_large_log_replays_with_check_in_bounded_memory(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    with EventLog(NODE_B, path=path, durability=Durability.interval(), keep=0) as log:
        for event in repeated_pattern(50_000):
            log.append([event])

    replayed = measure("replay", path)
    loaded = measure("load", path)

    events = int(str(loaded["out"]))
    assert events >= 50_000
    assert replayed["status"] == 0
    assert f"  events             {events}\n" in str(replayed["out"])
    assert "check: no violations" in str(replayed["out"])
    growth = int(str(replayed["growth_kib"]))
    whole = int(str(loaded["growth_kib"]))
    # Holding the events costs tens of megabytes; streaming them costs an index
    # of finished actors and one read chunk.
    assert growth < whole / 4, (growth, whole)
    print(
        f"replayed {events} events with --check in {replayed['seconds']:.2f}s; peak RSS grew "
        f"{growth} KiB (holding the events: {whole} KiB)"
    )


def test_a_reused_id_starting_a_new_life_is_not_a_violation(tmp_path: Path) -> None:
    # A reused kv_request_id on a new session can get the same ActorId again;
    # its stream restarts at seq 1 after the old life ended.
    first = happy("req-x").producers[0].log
    second = happy("req-x").producers[0].log
    result = check_one(tmp_path, [*first, *second])
    assert result.violations == ()
    assert result.unfinished == ()
    assert result.summary.actors == 2


def test_an_abandoned_life_is_unfinished_when_the_id_starts_again(tmp_path: Path) -> None:
    log = happy("req-x").producers[0].log
    cut = index_of(log, "FetchReceived")  # the node gave up on it here, pins held
    result = check_one(tmp_path, [*log[:cut], *log])
    assert result.violations == ()
    assert [u.actor.kv_request_id for u in result.unfinished] == ["req-x"]
    assert any("pin" in u.what for u in result.unfinished)


def test_summary_counts_agree_with_and_without_checks_and_timelines(tmp_path: Path) -> None:
    paths = write_nodes(tmp_path, all_scenarios())
    full = replay(paths, check=True)
    assert full.violations == ()
    for check, timelines in ((False, None), (False, 0), (True, 0)):
        other = replay(paths, check=check, timelines=timelines)
        assert other.summary == full.summary
        assert [r.state for r in other.actors] == [r.state for r in full.actors]
