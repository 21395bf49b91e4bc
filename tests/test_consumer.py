"""Example tests of the consumer core, ``p2pactor.core.consumer``.

A consumer actor is our request pulling KV blocks from one peer. These tests
drive it through :class:`tests.harness.ConsumerHarness` (which also checks,
after every step, that replaying the log rebuilds the live state) and assert
what it really does: the wire messages it sends, with every field; the load
reports it makes, with their success and reason; the events it records, in
order; its phase, outcome and next deadline.

The scenarios are the consumer-side ones of vLLM 0.33.0's P2P test suite
(``vllm-p2p-0.33.md`` §5: TestClientFlows, TestLookupFlow, the consumer half of
the #49820 round-isolation repro), plus p2pactor's own rules: the lookup
progress timeout fails only this request, ``lookup_resp`` may carry a round,
the round counter may jump (``SubmitLoad.next_round``), and a finished actor
absorbs every input. Timers are vLLM's: a load is aborted after 30 s, an
abort unacknowledged for 10 s fails the load, a lookup that resolves nothing
for 30 s fails the request.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.consumer import ConsumerInput, next_consumer_deadline, probe_answer
from p2pactor.core.consumer_state import Load
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.fold import fold
from p2pactor.core.inputs import LookupResult
from p2pactor.core.timings import Timings
from tests.harness import KV, ConsumerHarness, key

HIT = LookupResult.HIT
MISS = LookupResult.MISS
RETRY = LookupResult.RETRY

K0, K1, K2, K3, K9 = key(0), key(1), key(2), key(3), key(9)

LOAD_TIMEOUT = 30.0
ABORT_ACK_TIMEOUT = 10.0
LOOKUP_TIMEOUT = 30.0


# --- helpers ----------------------------------------------------------------------


@pytest.fixture
def h() -> ConsumerHarness:
    return ConsumerHarness()


def kinds(events: Iterable[ev.Event]) -> list[str]:
    return [e.KIND for e in events]


def tick_at(h: ConsumerHarness, when: float) -> list[str]:
    """Move the clock to ``when`` exactly, tick, and return the event kinds."""
    assert when >= h.now, "time only moves forward"
    h.advance(when - h.now)
    assert h.now == when
    return kinds(h.feed(inp.Tick()))


def step(h: ConsumerHarness, *keys: bytes) -> None:
    """One engine step that asks about ``keys``: register, then flush."""
    h.register(*keys)
    h.flush()


def answer(
    keys: Iterable[bytes], hits: Iterable[bool], round_seq: int | None = None
) -> wire.LookupResp:
    return wire.LookupResp(
        kv_request_id=KV,
        keys=tuple(keys),
        hits=tuple(hits),
        round_seq=wire.UNSET if round_seq is None else round_seq,
    )


def done(round_seq: int, *, success: bool = True) -> wire.TransferDone:
    return wire.TransferDone(kv_request_id=KV, success=success, round_seq=round_seq)


def ack(round_seq: int) -> wire.AbortAck:
    return wire.AbortAck(kv_request_id=KV, round_seq=round_seq)


def lookup_msg(keys: Iterable[bytes], round_seq: int = 0, deadline_ms: int = 30_000) -> wire.Lookup:
    return wire.Lookup(kv_request_id=KV, keys=keys, round_seq=round_seq, deadline_ms=deadline_ms)


def fetch_msg(keys: Iterable[bytes], idxs: Iterable[int], round_seq: int) -> wire.Fetch:
    return wire.Fetch(kv_request_id=KV, keys=keys, block_indexes=idxs, round_seq=round_seq)


def empty_fetch(round_seq: int) -> wire.Fetch:
    return fetch_msg((), (), round_seq)


def abort_msg(round_seq: int) -> wire.AbortFetch:
    return wire.AbortFetch(kv_request_id=KV, round_seq=round_seq)


def reports(h: ConsumerHarness) -> list[fx.ReportLoad]:
    """Every load report the actor made, in order (with the reasons)."""
    return [e for event in h.log for e in fx.effects_of(event) if isinstance(e, fx.ReportLoad)]


def answers(h: ConsumerHarness, *keys: bytes) -> list[LookupResult]:
    return [probe_answer(h.state, k) for k in keys]


def finished(h: ConsumerHarness) -> list[ev.Finished]:
    return [e for e in h.log if isinstance(e, ev.Finished)]


def only(events: Iterable[ev.Event], cls: type[ev.Event]) -> ev.Event:
    matching = [e for e in events if isinstance(e, cls)]
    assert len(matching) == 1, matching
    return matching[0]


# --- loads: fetch, transfer_done, abort ------------------------------------------


class TestClientFlows:
    def test_a_load_sends_one_fetch_with_its_keys_and_block_indexes(
        self, h: ConsumerHarness
    ) -> None:
        events = h.feed(inp.SubmitLoad(job_id=7, keys=(K1, K2), block_indexes=(4, 9)))

        assert kinds(events) == ["FetchSent"]
        assert h.sent == [fetch_msg((K1, K2), (4, 9), round_seq=0)]
        assert h.state.loads == {0: Load(job_id=7, deadline=LOAD_TIMEOUT)}
        assert h.state.phase is ConsumerPhase.FETCH_SENT
        assert reports(h) == []

    def test_transfer_done_success_reports_the_load_succeeded(self, h: ConsumerHarness) -> None:
        h.load(7, [K1, K2], [4, 9])

        events = h.feed(done(0, success=True))

        assert kinds(events) == ["TransferDone"]
        assert reports(h) == [fx.ReportLoad(job_id=7, success=True, reason="")]
        assert h.state.loads == {}
        assert h.state.outcome is ConsumerPhase.DONE

    def test_transfer_done_failure_reports_the_load_failed(self, h: ConsumerHarness) -> None:
        h.load(7, [K1, K2], [4, 9])

        h.feed(done(0, success=False))

        assert h.reported[7] == 1
        assert h.report_success[7] is False
        assert reports(h) == [
            fx.ReportLoad(job_id=7, success=False, reason="the peer reported the transfer failed")
        ]
        assert h.state.loads == {}
        assert h.state.outcome is ConsumerPhase.FAILED

    def test_a_duplicate_transfer_done_is_ignored_and_reports_nothing_more(
        self, h: ConsumerHarness
    ) -> None:
        h.load(7, [K1], [4])
        h.feed(done(0))

        events = h.feed(done(0, success=False))

        assert kinds(events) == ["Ignored"]
        assert h.reported[7] == 1
        assert h.report_success[7] is True

    def test_finishing_with_a_load_in_flight_sends_abort_fetch_for_its_round(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K1], [4])
        h.feed(done(0))
        h.load(2, [K2], [5])  # round 1, in flight

        events = h.feed(inp.Finish())

        assert kinds(events) == ["FinishRequested", "AbortSent"]
        assert h.sent[-1] == abort_msg(1)
        assert h.sent_of(wire.AbortFetch) == [abort_msg(1)]
        abort = only(events, ev.AbortSent)
        assert isinstance(abort, ev.AbortSent)
        assert abort.reason == "the request finished while its load was in flight"
        assert abort.ack_deadline == h.now + ABORT_ACK_TIMEOUT
        # The load is kept until the ack (or its timeout): the peer may still write.
        assert h.reported[2] == 0
        assert h.state.loads[1].aborting
        assert not h.state.phase.terminal
        assert not h.retired

    def test_a_load_is_aborted_after_exactly_30_seconds(self, h: ConsumerHarness) -> None:
        h.advance(5.0)
        h.load(7, [K1], [4])

        assert tick_at(h, 34.999) == []
        assert h.sent_of(wire.AbortFetch) == []

        assert tick_at(h, 35.0) == ["AbortSent"]
        assert h.sent[-1] == abort_msg(0)
        abort = h.log[-1]
        assert isinstance(abort, ev.AbortSent)
        assert abort.reason == "no transfer_done within 30 s"
        assert abort.ack_deadline == 45.0
        assert h.reported[7] == 0  # not failed yet: a write may still land

    def test_a_load_is_aborted_only_once(self, h: ConsumerHarness) -> None:
        h.load(7, [K1], [4])
        tick_at(h, 30.0)

        assert tick_at(h, 35.0) == []
        assert h.sent_of(wire.AbortFetch) == [abort_msg(0)]

    def test_no_abort_ack_within_10_seconds_fails_the_load_and_removes_it(
        self, h: ConsumerHarness
    ) -> None:
        h.load(7, [K1], [4])
        tick_at(h, 30.0)  # abort sent

        assert tick_at(h, 39.999) == []
        assert h.reported[7] == 0

        assert tick_at(h, 40.0) == ["Aborted"]
        assert reports(h) == [
            fx.ReportLoad(job_id=7, success=False, reason="no abort_ack within 10 s")
        ]
        assert h.state.loads == {}
        assert tick_at(h, 100.0) == []
        assert h.reported[7] == 1

    def test_an_abort_ack_clears_the_load_and_reports_it_failed(self, h: ConsumerHarness) -> None:
        h.load(7, [K1], [4])
        tick_at(h, 30.0)

        events = h.feed(ack(0))

        assert kinds(events) == ["AbortAcked"]
        assert reports(h) == [
            fx.ReportLoad(
                job_id=7,
                success=False,
                reason="aborted; the peer confirmed no write can still land",
            )
        ]
        assert h.state.loads == {}
        assert next_consumer_deadline(h.state) is None
        assert tick_at(h, 40.0) == []  # the ack timeout is gone with the load
        assert h.reported[7] == 1

    def test_an_abort_ack_for_a_load_we_never_aborted_is_ignored(self, h: ConsumerHarness) -> None:
        h.load(7, [K1], [4])

        events = h.feed(ack(0))

        assert kinds(events) == ["Ignored"]
        ignored = events[0]
        assert isinstance(ignored, ev.Ignored)
        assert ignored.input == "abort_ack"
        assert h.state.loads == {0: Load(job_id=7, deadline=LOAD_TIMEOUT)}
        assert h.reported[7] == 0
        # The load lives on: it is still aborted on time.
        assert tick_at(h, 30.0) == ["AbortSent"]

    def test_an_abort_ack_for_an_unknown_round_is_ignored(self, h: ConsumerHarness) -> None:
        h.load(7, [K1], [4])
        tick_at(h, 30.0)

        events = h.feed(ack(5))

        assert kinds(events) == ["Ignored"]
        assert h.state.loads[0].aborting
        assert h.reported[7] == 0

    def test_a_transfer_done_for_an_unknown_round_is_ignored(self, h: ConsumerHarness) -> None:
        h.load(7, [K1], [4])

        events = h.feed(done(3))

        assert kinds(events) == ["Ignored"]
        ignored = events[0]
        assert isinstance(ignored, ev.Ignored)
        assert ignored.input == "transfer_done"
        assert ignored.reason == "no load in flight for round 3"
        assert h.state.loads == {0: Load(job_id=7, deadline=LOAD_TIMEOUT)}
        assert reports(h) == []

    def test_a_transfer_done_crossing_our_timeout_abort_reports_the_true_result(
        self, h: ConsumerHarness
    ) -> None:
        h.load(7, [K1], [4])
        tick_at(h, 30.0)  # abort sent

        events = h.feed(done(0, success=True))

        assert kinds(events) == ["TransferDone"]
        assert reports(h) == [fx.ReportLoad(job_id=7, success=True, reason="")]
        assert h.state.loads == {}
        # The ack that follows finds nothing to settle.
        assert kinds(h.feed(ack(0))) == ["Ignored"]
        assert h.reported[7] == 1

    def test_a_transfer_done_crossing_the_finish_abort_reports_the_true_result_and_ends(
        self, h: ConsumerHarness
    ) -> None:
        h.load(7, [K1], [4])
        h.finish()

        events = h.feed(done(0, success=True))

        assert kinds(events) == ["TransferDone", "Finished"]
        assert reports(h) == [fx.ReportLoad(job_id=7, success=True, reason="")]
        assert h.retired


# --- lookups ------------------------------------------------------------------------


class TestLookupFlow:
    def test_register_flush_and_answer_in_one_round_trip(self, h: ConsumerHarness) -> None:
        h.register(K1, K2)
        assert h.sent == []
        assert answers(h, K1, K2) == [RETRY, RETRY]

        h.flush()
        assert h.sent == [lookup_msg((K1, K2), round_seq=0)]
        assert answers(h, K1, K2) == [RETRY, RETRY]  # in flight

        events = h.feed(answer((K1, K2), (True, False)))
        assert kinds(events) == ["LookupResp"]
        assert answers(h, K1, K2) == [HIT, MISS]
        assert len(h.sent) == 1

    def test_reflushing_sends_nothing(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)

        events = h.feed(inp.Flush())

        assert events == ()
        assert h.sent == [lookup_msg((K1, K2))]

    def test_cached_answers_need_no_new_lookup(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)
        h.feed(answer((K1, K2), (True, False)))

        registered = h.feed(inp.Register((K1, K2)))
        flushed = h.feed(inp.Flush())

        assert registered == ()
        assert flushed == ()
        assert answers(h, K1, K2) == [HIT, MISS]
        assert h.sent_of(wire.Lookup) == [lookup_msg((K1, K2))]

    def test_a_flush_sends_one_lookup_with_exactly_the_unsent_keys(
        self, h: ConsumerHarness
    ) -> None:
        h.register(K1)
        h.register(K2, K1, K2)  # repeats are asked once, in registration order

        h.flush()

        assert h.sent == [lookup_msg((K1, K2))]
        assert h.state.unsent == ()

    def test_lookups_across_steps_each_carry_only_the_new_keys(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)
        h.advance(10.0)
        step(h, K2, K3)
        h.advance(5.0)
        step(h, K1, K3, K9)

        # The progress deadline stays where the first lookup armed it (30 s).
        assert h.sent == [
            lookup_msg((K1, K2), deadline_ms=30_000),
            lookup_msg((K3,), deadline_ms=20_000),
            lookup_msg((K9,), deadline_ms=15_000),
        ]

    def test_a_split_response_resolves_across_messages(self, h: ConsumerHarness) -> None:
        step(h, K1, K2, K3)

        h.feed(answer((K2,), (True,)))
        assert answers(h, K1, K2, K3) == [RETRY, HIT, RETRY]

        h.feed(answer((K3, K1), (False, True)))
        assert answers(h, K1, K2, K3) == [HIT, HIT, MISS]
        assert h.state.waiting_keys() == ()
        assert len(h.sent) == 1

    def test_an_answer_repeating_a_key_applies_its_first_value(self, h: ConsumerHarness) -> None:
        step(h, K1)

        events = h.feed(answer((K1, K1), (True, False)))

        resp = only(events, ev.LookupResp)
        assert isinstance(resp, ev.LookupResp)
        assert resp.keys == (K1,)
        assert resp.hits == (True,)
        assert answers(h, K1) == [HIT]

    def test_a_fetch_forgets_hits_so_a_later_registration_reprobes_them(
        self, h: ConsumerHarness
    ) -> None:
        step(h, K1, K2)
        h.feed(answer((K1, K2), (True, False)))
        h.load(7, [K1], [4])

        # Both sides unpinned at the fetch: a cached HIT would be stale.
        assert h.state.probes == {K2: False}
        assert answers(h, K1, K2) == [RETRY, MISS]

        step(h, K1)
        assert h.sent[-1] == lookup_msg((K1,), round_seq=1)

    def test_a_miss_heard_before_a_fetch_is_a_miss_after_it_with_no_new_round(
        self, h: ConsumerHarness
    ) -> None:
        # vLLM asks the first missed key again once the hit run is loaded: a
        # MISS is always safe (the engine computes it), so no round is spent.
        step(h, K1, K2, K3)
        h.feed(answer((K1, K2, K3), (True, False, False)))
        h.load(7, [K1], [4])
        sent = list(h.sent)

        events = h.feed(inp.Register((K2, K3), flush=True))

        assert events == ()
        assert h.sent == sent
        assert answers(h, K2, K3) == [MISS, MISS]
        # Unanswered keys are not remembered: they are asked again.
        step(h, K0)
        assert h.sent[-1] == lookup_msg((K0,), round_seq=1)

    def test_finish_after_a_flushed_lookup_sends_exactly_one_empty_fetch(
        self, h: ConsumerHarness
    ) -> None:
        step(h, K1)
        h.feed(answer((K1,), (False,)))

        events = h.feed(inp.Finish())

        # One event: the engine's finish, the empty fetch and the end.
        assert kinds(events) == ["Finished"]
        (end,) = events
        assert isinstance(end, ev.Finished)
        assert end.requested
        assert end.cancelled_round == 0
        assert h.sent == [lookup_msg((K1,)), empty_fetch(0)]
        assert h.retired
        h.feed(inp.Finish())
        assert h.sent_of(wire.Fetch) == [empty_fetch(0)]

    def test_the_empty_fetch_carries_the_current_round(self, h: ConsumerHarness) -> None:
        h.load(1, [K0], [3])
        h.feed(done(0))
        step(h, K1)  # round 1's lookup

        h.finish()

        assert h.sent == [fetch_msg((K0,), (3,), 0), lookup_msg((K1,), round_seq=1), empty_fetch(1)]
        end = only(h.log, ev.Finished)
        assert isinstance(end, ev.Finished)
        assert end.cancelled_round == 1

    def test_with_a_load_in_flight_the_empty_fetch_is_an_event_of_its_own(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K0], [3])
        step(h, K1)  # round 1's lookup, round 0's load still in flight

        events = h.feed(inp.Finish())

        assert kinds(events) == ["FinishRequested", "AbortSent", "LookupCancelled"]
        cancelled = events[-1]
        assert isinstance(cancelled, ev.LookupCancelled)
        assert cancelled.round_seq == 1
        assert h.sent[-2:] == [wire.AbortFetch(kv_request_id=KV, round_seq=0), empty_fetch(1)]
        assert h.state.phase is ConsumerPhase.FETCH_SENT
        assert not h.retired

    def test_finish_without_a_flush_sends_nothing(self, h: ConsumerHarness) -> None:
        h.register(K1, K2)

        events = h.feed(inp.Finish())

        assert kinds(events) == ["Finished"]
        (end,) = events
        assert isinstance(end, ev.Finished)
        assert end.requested
        assert end.cancelled_round is None
        assert h.sent == []

    def test_finish_after_a_real_fetch_sends_no_empty_fetch(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.feed(answer((K1,), (True,)))
        h.load(7, [K1], [4])
        h.feed(done(0))

        events = h.feed(inp.Finish())

        assert kinds(events) == ["Finished"]
        (end,) = events
        assert isinstance(end, ev.Finished)
        assert end.cancelled_round is None
        assert h.sent == [lookup_msg((K1,)), fetch_msg((K1,), (4,), 0)]

    def test_the_first_lookup_arms_the_progress_deadline_30_seconds_out(
        self, h: ConsumerHarness
    ) -> None:
        h.advance(2.0)
        h.register(K1)
        assert h.state.lookup_deadline is None  # registered, nothing on the wire

        h.flush()

        probed = h.log[-1]
        assert isinstance(probed, ev.Probed)
        assert probed.lookup_deadline == 32.0
        assert h.state.lookup_deadline == 32.0

    def test_a_later_lookup_does_not_move_the_progress_deadline(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.advance(20.0)

        step(h, K2)

        assert h.state.lookup_deadline == 30.0
        assert tick_at(h, 30.0) == ["LookupTimedOut"]

    def test_an_answer_that_resolves_a_probe_rearms_the_deadline(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)
        h.advance(20.0)

        h.feed(answer((K1,), (True,)))

        assert h.state.lookup_deadline == 50.0
        assert tick_at(h, 49.999) == []
        assert tick_at(h, 50.0) == ["LookupTimedOut"]

    def test_an_answer_that_resolves_nothing_leaves_the_deadline(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.advance(20.0)

        events = h.feed(answer((K9,), (True,)))

        assert kinds(events) == ["Ignored"]
        assert h.state.lookup_deadline == 30.0

    def test_the_deadline_is_cleared_when_every_probe_resolves(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)

        h.feed(answer((K1, K2), (True, True)))

        resp = h.log[-1]
        assert isinstance(resp, ev.LookupResp)
        assert resp.lookup_deadline is None
        assert h.state.lookup_deadline is None
        assert tick_at(h, 100.0) == []

    def test_the_deadline_is_cleared_by_a_fetch(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)
        h.feed(answer((K1,), (True,)))  # K2 still waiting

        h.load(7, [K1], [4])

        assert h.state.lookup_deadline is None
        h.feed(done(0))
        assert tick_at(h, 100.0) == []

    def test_the_deadline_is_cleared_by_finish(self, h: ConsumerHarness) -> None:
        h.load(7, [K0], [3])  # keeps the request alive after finish
        h.advance(1.0)
        step(h, K1)  # lookup deadline 31
        armed = h.state.lookup_deadline

        h.finish()

        assert (armed, h.state.lookup_deadline) == (31.0, None)
        assert kinds(h.log[-2:]) == ["AbortSent", "LookupCancelled"]
        assert next_consumer_deadline(h.state) == 11.0  # the abort's ack, only
        assert tick_at(h, 11.0) == ["Aborted", "Finished"]  # no LookupTimedOut

    def test_the_lookup_times_out_after_exactly_30_seconds_without_progress(
        self, h: ConsumerHarness
    ) -> None:
        step(h, K1, K2)

        assert tick_at(h, 29.999) == []
        assert tick_at(h, 30.0) == ["LookupTimedOut"]
        timed_out = h.log[-1]
        assert isinstance(timed_out, ev.LookupTimedOut)
        assert timed_out.keys == (K1, K2)

    def test_a_lookup_timeout_fails_only_this_request(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)
        h.feed(answer((K1,), (True,)))  # K1 answered HIT; K2 never is
        tick_at(h, 30.0)

        # Every key answers MISS from now on, even one answered HIT before:
        # the engine computes it locally.
        assert answers(h, K1, K2, K9) == [MISS, MISS, MISS]
        assert h.state.outcome is ConsumerPhase.FAILED
        assert not h.state.phase.terminal  # the request lives until the engine finishes it
        assert h.state.phase is ConsumerPhase.PROBING
        assert not h.retired
        assert h.disconnects == []  # unlike vLLM, the session is not torn down
        # Nothing more is asked, and a late answer changes nothing.
        assert h.feed(inp.Register((K9,))) == ()
        assert h.feed(inp.Flush()) == ()
        assert kinds(h.feed(answer((K2,), (True,)))) == ["Ignored"]
        assert answers(h, K2) == [MISS]
        assert len(h.sent_of(wire.Lookup)) == 1
        assert next_consumer_deadline(h.state) is None

        events = h.feed(inp.Finish())

        # The peer may still hold the parked lookup: the empty fetch closes it.
        assert kinds(events) == ["Finished"]
        assert h.sent[-1] == empty_fetch(0)
        end = events[-1]
        assert isinstance(end, ev.Finished)
        assert end.cancelled_round == 0
        assert end.phase is ConsumerPhase.FAILED
        assert end.reason == "the peer answered no lookup key in time"

    def test_a_lookup_timeout_leaves_a_load_in_flight_alone(self) -> None:
        # A lookup armed after a fetch can only time out before that fetch's
        # load if the lookup timer is the shorter one.
        h = ConsumerHarness(timings=Timings(lookup_progress_timeout=10.0))
        h.load(7, [K0], [3])  # round 0, load deadline 30
        step(h, K1)  # round 1's lookup, deadline 10

        assert tick_at(h, 10.0) == ["LookupTimedOut"]
        assert h.state.loads == {0: Load(job_id=7, deadline=LOAD_TIMEOUT)}
        assert kinds(h.feed(done(0, success=True))) == ["TransferDone"]

        assert reports(h) == [fx.ReportLoad(job_id=7, success=True, reason="")]
        h.finish()
        assert h.state.phase is ConsumerPhase.FAILED


# --- rounds (#49820, consumer side) ---------------------------------------------------


class TestRoundIsolation:
    def test_the_round_increments_with_every_fetch(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [1])
        h.load(2, [K2], [2])
        h.load(3, [K3], [3])

        assert [m.round_seq for m in h.sent if isinstance(m, wire.Fetch)] == [0, 1, 2]
        assert h.state.round_seq == 3
        assert set(h.state.loads) == {0, 1, 2}

    def test_lookups_after_a_fetch_carry_the_next_round(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.feed(answer((K1,), (True,)))
        h.load(7, [K1], [4])

        step(h, K2)

        assert h.sent == [
            lookup_msg((K1,), round_seq=0),
            fetch_msg((K1,), (4,), round_seq=0),
            lookup_msg((K2,), round_seq=1),
        ]

    def test_an_answer_stamped_with_an_older_round_is_ignored(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.load(7, [K0], [4])  # closes round 0 before its answer came
        step(h, K1)  # K1 asked again, in round 1

        events = h.feed(answer((K1,), (True,), round_seq=0))

        assert kinds(events) == ["Ignored"]
        ignored = events[0]
        assert isinstance(ignored, ev.Ignored)
        assert ignored.reason == "answer for round 0, the request is in round 1"
        assert answers(h, K1) == [RETRY]
        assert h.state.lookup_deadline == 30.0  # no progress

        h.feed(answer((K1,), (False,), round_seq=1))
        assert answers(h, K1) == [MISS]

    def test_an_answer_stamped_with_a_future_round_is_ignored(self, h: ConsumerHarness) -> None:
        step(h, K1)

        events = h.feed(answer((K1,), (True,), round_seq=4))

        assert kinds(events) == ["Ignored"]
        assert answers(h, K1) == [RETRY]

    def test_a_base_dialect_answer_resolves_only_keys_in_flight(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.register(K2)  # registered this step, not on the wire yet

        events = h.feed(answer((K1, K2), (True, True), round_seq=None))

        resp = only(events, ev.LookupResp)
        assert isinstance(resp, ev.LookupResp)
        assert resp.round_seq is None
        assert resp.keys == (K1,)
        assert resp.hits == (True,)
        assert answers(h, K1, K2) == [HIT, RETRY]
        h.flush()
        assert h.sent[-1] == lookup_msg((K2,))

    def test_a_base_dialect_answer_arriving_after_the_fetch_resolves_nothing(
        self, h: ConsumerHarness
    ) -> None:
        step(h, K1)
        h.load(7, [K0], [4])

        events = h.feed(answer((K1,), (True,), round_seq=None))

        assert kinds(events) == ["Ignored"]
        assert answers(h, K1) == [RETRY]

    def test_concurrent_loads_of_two_rounds_complete_independently_and_out_of_order(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K1], [10])  # round 0
        h.load(2, [K2], [20])  # round 1

        h.feed(done(1, success=True))
        assert h.report_success == {2: True}
        assert h.state.loads == {0: Load(job_id=1, deadline=LOAD_TIMEOUT)}

        h.feed(done(0, success=False))
        assert h.report_success == {2: True, 1: False}
        assert h.reported == {1: 1, 2: 1}
        assert h.state.loads == {}

    def test_aborting_one_round_leaves_the_other_in_flight(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])  # round 0, deadline 30
        h.advance(10.0)
        h.load(2, [K2], [20])  # round 1, deadline 40

        assert tick_at(h, 30.0) == ["AbortSent"]
        h.feed(ack(0))

        assert h.sent_of(wire.AbortFetch) == [abort_msg(0)]
        assert h.report_success == {1: False}
        assert h.state.loads == {1: Load(job_id=2, deadline=40.0)}
        h.feed(done(1))
        assert h.report_success == {1: False, 2: True}

    def test_finish_aborts_every_round_in_flight_in_round_order(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        h.load(2, [K2], [20])

        h.finish()

        assert h.sent_of(wire.AbortFetch) == [abort_msg(0), abort_msg(1)]
        h.feed(ack(1))
        retired_after_round_1 = h.retired
        h.feed(ack(0))
        assert (retired_after_round_1, h.retired) == (False, True)
        assert h.report_success == {1: False, 2: False}

    def test_submit_load_next_round_is_honoured(self, h: ConsumerHarness) -> None:
        h.feed(inp.SubmitLoad(job_id=1, keys=(K1,), block_indexes=(10,), next_round=100))
        step(h, K2)
        h.load(2, [K2], [20])

        assert h.sent == [
            fetch_msg((K1,), (10,), round_seq=0),
            lookup_msg((K2,), round_seq=100),
            fetch_msg((K2,), (20,), round_seq=100),
        ]
        assert h.state.round_seq == 101
        h.feed(done(100))
        h.feed(done(0))
        assert h.report_success == {1: True, 2: True}

    def test_a_next_round_not_above_the_current_round_is_refused(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])  # now in round 1

        h.feed(inp.SubmitLoad(job_id=2, keys=(K2,), block_indexes=(20,), next_round=1))

        assert reports(h) == [
            fx.ReportLoad(job_id=2, success=False, reason="next_round 1 must be above round 1")
        ]
        assert h.sent == [fetch_msg((K1,), (10,), round_seq=0)]
        assert h.state.round_seq == 1

    def test_the_first_lookup_takes_the_requests_first_round(self, h: ConsumerHarness) -> None:
        h.first_round = 42
        step(h, K1)
        h.load(7, [K1], [4])

        assert h.sent == [lookup_msg((K1,), round_seq=42), fetch_msg((K1,), (4,), round_seq=42)]
        h.feed(done(42))
        assert h.report_success == {7: True}


# --- phases, outcomes and the end -------------------------------------------------------


def _phase_after(h: ConsumerHarness, event_input: ConsumerInput) -> ConsumerPhase:
    h.feed(event_input)
    return h.state.phase


class TestTerminalAndPhases:
    def test_phases_only_move_forward(self, h: ConsumerHarness) -> None:
        phases = [
            _phase_after(h, inp.Register((K1,))),
            _phase_after(h, inp.Flush()),
            _phase_after(h, answer((K1,), (True,))),
            _phase_after(h, inp.SubmitLoad(job_id=7, keys=(K1,), block_indexes=(4,))),
            _phase_after(h, inp.Register((K2,))),
            _phase_after(h, inp.Flush()),  # round 1's lookup: no going back to PROBING
            _phase_after(h, done(0)),
            _phase_after(h, inp.Finish()),
        ]

        assert phases == [
            ConsumerPhase.REGISTERED,
            ConsumerPhase.PROBING,
            ConsumerPhase.PROBING,
            ConsumerPhase.FETCH_SENT,
            ConsumerPhase.FETCH_SENT,
            ConsumerPhase.FETCH_SENT,
            ConsumerPhase.FETCH_SENT,
            ConsumerPhase.DONE,
        ]

    def test_the_empty_fetch_moves_a_probing_request_to_fetch_sent(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K0], [3])
        step(h, K1)  # round 1's lookup, round 0's load in flight: the request lives on
        h.finish()

        assert kinds(h.log[-1:]) == ["LookupCancelled"]
        assert h.state.phase is ConsumerPhase.FETCH_SENT
        h.feed(ack(0))
        assert h.state.phase is ConsumerPhase.ABORTED

    def test_a_probing_request_that_finishes_ends_in_one_step(self, h: ConsumerHarness) -> None:
        step(h, K1)
        before = h.state.phase
        h.finish()

        assert before is ConsumerPhase.PROBING
        assert kinds(h.log[-1:]) == ["Finished"]
        assert h.state.phase is ConsumerPhase.DONE
        assert fold(h.log) == h.state

    def test_a_prefill_decode_load_goes_straight_to_fetch_sent(self, h: ConsumerHarness) -> None:
        assert _phase_after(h, inp.SubmitLoad(job_id=7, keys=(K1,), block_indexes=(4,))) is (
            ConsumerPhase.FETCH_SENT
        )
        assert kinds(h.log) == ["FetchSent"]

    def test_finished_is_emitted_once(self, h: ConsumerHarness) -> None:
        h.load(7, [K1], [4])
        h.finish()
        h.finish()
        h.feed(ack(0))
        h.finish()
        tick_at(h, 100.0)

        assert len(finished(h)) == 1
        assert kinds(h.log) == [
            "FetchSent",
            "FinishRequested",
            "AbortSent",
            "AbortAcked",
            "Finished",
        ]
        assert h.retired

    def test_a_finished_request_absorbs_every_input(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.feed(answer((K1,), (True,)))
        h.load(7, [K1], [4])
        h.feed(done(0))
        h.finish()
        assert h.state.phase is ConsumerPhase.DONE
        state, log, sent = h.state, list(h.log), list(h.sent)

        late: list[ConsumerInput] = [
            inp.Register((K1, K2)),
            inp.Flush(),
            inp.SubmitLoad(job_id=8, keys=(K2,), block_indexes=(5,)),
            inp.Finish(),
            inp.Tick(),
            inp.SessionEnded("gone"),
            answer((K1,), (True,)),
            done(0),
            ack(0),
        ]
        for event_input in late:
            h.advance(100.0)
            assert h.feed(event_input) == (), event_input

        assert h.state == state
        assert h.log == log
        assert h.sent == sent
        assert len(finished(h)) == 1

    def test_every_key_answers_miss_once_finished(self, h: ConsumerHarness) -> None:
        step(h, K1, K2)
        h.feed(answer((K1,), (True,)))
        h.finish()

        assert h.state.phase.terminal
        assert answers(h, K1, K2, K9) == [MISS, MISS, MISS]

    def test_every_key_answers_miss_while_loads_drain_after_finish(
        self, h: ConsumerHarness
    ) -> None:
        h.load(7, [K0], [3])
        step(h, K1)
        h.feed(answer((K1,), (True,)))
        h.finish()
        assert not h.state.phase.terminal  # load 7 still aborting

        assert answers(h, K1, K9) == [MISS, MISS]
        assert h.feed(inp.Register((K9,))) == ()
        assert kinds(h.feed(answer((K1,), (True,)))) == ["Ignored"]

    def test_the_outcome_is_done_when_every_load_succeeded(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        h.load(2, [K2], [20])
        h.feed(done(0))
        h.feed(done(1))

        h.finish()

        (end,) = finished(h)
        assert end.phase is ConsumerPhase.DONE
        assert end.reason == "finished"
        assert h.state.phase is ConsumerPhase.DONE

    def test_the_outcome_is_failed_when_a_load_failed(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        h.load(2, [K2], [20])
        h.feed(done(0, success=False))
        h.feed(done(1))

        h.finish()

        (end,) = finished(h)
        assert end.phase is ConsumerPhase.FAILED
        assert end.reason == "round 0: the transfer failed"

    def test_the_outcome_is_failed_when_the_lookup_timed_out(self, h: ConsumerHarness) -> None:
        step(h, K1)
        tick_at(h, 30.0)

        h.finish()

        assert h.state.phase is ConsumerPhase.FAILED

    def test_the_outcome_is_aborted_when_a_load_timed_out(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        tick_at(h, 30.0)
        h.feed(ack(0))

        h.finish()

        (end,) = finished(h)
        assert end.phase is ConsumerPhase.ABORTED
        assert end.reason == "round 0: no transfer_done within 30 s"

    def test_the_outcome_is_aborted_when_finish_had_to_abort_a_load(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K1], [10])
        h.finish()

        assert tick_at(h, 10.0) == ["Aborted", "Finished"]

        (end,) = finished(h)
        assert end.phase is ConsumerPhase.ABORTED
        assert h.report_success == {1: False}

    def test_an_abort_outranks_a_failure(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        h.feed(done(0, success=False))
        h.load(2, [K2], [20])
        tick_at(h, 30.0)
        h.feed(ack(1))

        h.finish()

        assert h.state.phase is ConsumerPhase.ABORTED

    def test_a_session_end_fails_every_load_in_flight_and_ends_the_actor(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K1], [10])
        h.load(2, [K2], [20])
        tick_at(h, 30.0)  # both aborting

        events = h.feed(inp.SessionEnded("connection reset"))

        assert kinds(events) == ["SessionLost", "Aborted", "Aborted", "Finished"]
        assert reports(h) == [
            fx.ReportLoad(job_id=1, success=False, reason="session lost: connection reset"),
            fx.ReportLoad(job_id=2, success=False, reason="session lost: connection reset"),
        ]
        assert h.reported == {1: 1, 2: 1}
        assert h.sent_of(wire.AbortFetch) == [abort_msg(0), abort_msg(1)]  # nothing new
        assert h.state.phase.terminal
        assert h.retired
        assert next_consumer_deadline(h.state) is None

    def test_a_session_end_holds_the_loads_blocks_for_the_write_grace_then_fails_them(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K1], [10])
        h.load(2, [K2], [20])
        tick_at(h, 30.0)  # both aborting: their acks can no longer come either
        sent = list(h.sent)

        events = h.feed(inp.SessionEnded("connection reset", write_grace=5.0))

        (lost,) = events
        assert isinstance(lost, ev.SessionLost)
        assert lost.loads_held_until == 35.0
        assert reports(h) == []  # the engine may not reuse the blocks yet
        assert not h.state.phase.terminal
        assert next_consumer_deadline(h.state) == 35.0
        assert answers(h, K1, K2) == [MISS, MISS]
        assert h.feed(inp.SessionEnded("again", write_grace=5.0)) == ()
        skipped = h.feed(inp.SubmitLoad(job_id=3, keys=(K1,), block_indexes=(30,)))
        assert kinds(skipped) == ["FetchSkipped"]
        assert reports(h)[-1] == fx.ReportLoad(
            job_id=3,
            success=False,
            reason="the session to the peer is gone; look the keys up again",
        )
        h.feed(inp.Finish())  # the engine gives up on the request meanwhile
        assert tick_at(h, 34.999) == []
        assert h.sent == sent  # nothing goes out on a lost session

        assert tick_at(h, 35.0) == ["Aborted", "Aborted", "Finished"]
        why = "session lost: connection reset; its blocks were held until no write could land"
        assert reports(h)[-2:] == [
            fx.ReportLoad(job_id=1, success=False, reason=why),
            fx.ReportLoad(job_id=2, success=False, reason=why),
        ]
        assert h.reported == {1: 1, 2: 1, 3: 1}
        (end,) = finished(h)
        assert end.phase is ConsumerPhase.ABORTED  # the aborts went out before
        assert h.retired
        assert next_consumer_deadline(h.state) is None

    def test_a_held_load_fails_the_request(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])

        h.feed(inp.SessionEnded("silence", write_grace=2.0))
        assert tick_at(h, 2.0) == ["Aborted", "Finished"]

        (end,) = finished(h)
        assert end.phase is ConsumerPhase.FAILED
        assert end.reason.startswith("round 0: session lost: silence; its blocks were held")

    def test_writes_settled_end_the_hold_before_its_deadline(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        h.load(2, [K2], [20])
        h.feed(inp.SessionEnded("connection reset", write_grace=5.0))
        h.advance(0.5)

        events = h.feed(inp.WritesSettled("the peer's process exited"))

        assert kinds(events) == ["Aborted", "Aborted", "Finished"]
        assert reports(h) == [
            fx.ReportLoad(job_id=1, success=False, reason="the peer's process exited"),
            fx.ReportLoad(job_id=2, success=False, reason="the peer's process exited"),
        ]
        assert h.reported == {1: 1, 2: 1}
        assert h.retired
        assert next_consumer_deadline(h.state) is None
        assert tick_at(h, 5.0) == []  # the old deadline finds nothing left

    def test_writes_settled_with_nothing_held_change_nothing(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])  # in flight, its session alive: not held
        before = h.state

        assert h.feed(inp.WritesSettled("the peer's process exited")) == ()
        assert h.state == before
        assert reports(h) == []

    def test_a_write_grace_without_loads_ends_the_actor_at_once(self, h: ConsumerHarness) -> None:
        step(h, K1)

        events = h.feed(inp.SessionEnded("connection reset", write_grace=5.0))

        assert kinds(events) == ["SessionLost", "Finished"]
        lost = events[0]
        assert isinstance(lost, ev.SessionLost)
        assert lost.loads_held_until is None

    def test_a_session_end_with_a_load_in_flight_finishes_failed(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])

        h.feed(inp.SessionEnded("connection reset"))

        (end,) = finished(h)
        assert end.phase is ConsumerPhase.FAILED

    def test_a_session_end_with_probes_unanswered_finishes_failed(self, h: ConsumerHarness) -> None:
        step(h, K1)

        events = h.feed(inp.SessionEnded("connection reset"))

        assert kinds(events) == ["SessionLost", "Finished"]
        end = events[-1]
        assert isinstance(end, ev.Finished)
        assert end.phase is ConsumerPhase.FAILED
        assert end.reason == "session lost: connection reset"
        assert h.sent == [lookup_msg((K1,))]  # no empty fetch: nothing can be sent
        assert answers(h, K1) == [MISS]

    def test_a_session_end_with_nothing_outstanding_finishes_done(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.feed(answer((K1,), (True,)))

        h.feed(inp.SessionEnded("connection reset"))

        (end,) = finished(h)
        assert end.phase is ConsumerPhase.DONE
        assert h.sent == [lookup_msg((K1,))]

    def test_an_empty_load_reports_success_without_sending_anything(
        self, h: ConsumerHarness
    ) -> None:
        events = h.feed(inp.SubmitLoad(job_id=7, keys=(), block_indexes=()))

        assert kinds(events) == ["FetchSkipped"]
        assert reports(h) == [fx.ReportLoad(job_id=7, success=True, reason="nothing to load")]
        assert h.sent == []
        assert h.state.round_seq is None  # no round taken yet
        assert h.state.phase is ConsumerPhase.REGISTERED

    def test_a_load_with_mismatched_keys_and_blocks_is_refused_with_a_reason(
        self, h: ConsumerHarness
    ) -> None:
        h.feed(inp.SubmitLoad(job_id=7, keys=(K1, K2), block_indexes=(4,)))

        assert reports(h) == [
            fx.ReportLoad(
                job_id=7,
                success=False,
                reason="2 keys but 1 block indexes; pass one destination block per key",
            )
        ]
        assert h.sent == []
        assert h.state.round_seq is None
        assert h.state.loads == {}

    def test_a_load_submitted_while_finishing_is_refused(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        h.finish()

        h.feed(inp.SubmitLoad(job_id=2, keys=(K2,), block_indexes=(20,)))

        assert reports(h) == [
            fx.ReportLoad(job_id=2, success=False, reason="the request already finished")
        ]
        assert h.sent_of(wire.Fetch) == [fetch_msg((K1,), (10,), round_seq=0)]


# --- next_consumer_deadline -----------------------------------------------------------


class TestNextDeadline:
    def test_none_before_anything_is_on_the_wire(self, h: ConsumerHarness) -> None:
        assert next_consumer_deadline(h.state) is None
        h.register(K1)
        assert next_consumer_deadline(h.state) is None

    def test_the_lookup_progress_deadline(self, h: ConsumerHarness) -> None:
        h.advance(3.0)
        step(h, K1, K2)
        assert next_consumer_deadline(h.state) == 33.0

        h.advance(4.0)
        h.feed(answer((K1,), (False,)))
        assert next_consumer_deadline(h.state) == 37.0

        h.feed(answer((K2,), (False,)))
        assert next_consumer_deadline(h.state) is None

    def test_the_load_deadline(self, h: ConsumerHarness) -> None:
        h.advance(2.0)
        h.load(7, [K1], [4])

        assert next_consumer_deadline(h.state) == 32.0

    def test_the_abort_ack_deadline_replaces_the_load_deadline(self, h: ConsumerHarness) -> None:
        h.load(7, [K1], [4])
        tick_at(h, 30.0)

        assert next_consumer_deadline(h.state) == 40.0

    def test_the_earliest_of_several_loads(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])  # 30
        h.advance(5.0)
        h.load(2, [K2], [20])  # 35
        assert next_consumer_deadline(h.state) == 30.0

        tick_at(h, 30.0)  # round 0 aborting until 40
        assert next_consumer_deadline(h.state) == 35.0

        tick_at(h, 35.0)  # round 1 aborting until 45
        assert next_consumer_deadline(h.state) == 40.0

        h.feed(ack(0))
        assert next_consumer_deadline(h.state) == 45.0

    def test_the_earliest_of_a_load_and_a_lookup(self, h: ConsumerHarness) -> None:
        h.load(1, [K0], [10])  # load deadline 30
        h.advance(5.0)
        step(h, K1)  # lookup deadline 35
        assert next_consumer_deadline(h.state) == 30.0

        h.feed(done(0))
        assert next_consumer_deadline(h.state) == 35.0

        h.advance(1.0)
        h.load(2, [K1], [11])  # clears the lookup deadline; load deadline 36
        assert next_consumer_deadline(h.state) == 36.0

    def test_the_abort_ack_deadline_while_finishing(self, h: ConsumerHarness) -> None:
        h.load(1, [K1], [10])
        step(h, K2)
        h.advance(3.0)

        h.finish()

        assert next_consumer_deadline(h.state) == 13.0

    def test_none_once_finished(self, h: ConsumerHarness) -> None:
        step(h, K1)
        h.finish()

        assert h.state.phase.terminal
        assert next_consumer_deadline(h.state) is None

    def test_none_once_the_lookup_timed_out(self, h: ConsumerHarness) -> None:
        step(h, K1)
        tick_at(h, 30.0)

        assert next_consumer_deadline(h.state) is None

    def test_ticking_at_each_deadline_acts_and_just_before_it_does_nothing(
        self, h: ConsumerHarness
    ) -> None:
        h.load(1, [K0], [10])
        h.advance(2.0)
        step(h, K1)
        expected = [["AbortSent"], ["LookupTimedOut"], ["Aborted"]]

        for kinds_at_deadline in expected:
            deadline = next_consumer_deadline(h.state)
            assert deadline is not None
            assert tick_at(h, deadline - 0.001) == []
            assert tick_at(h, deadline) == kinds_at_deadline

        assert next_consumer_deadline(h.state) is None
