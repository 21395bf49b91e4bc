"""Example tests of the producer core, ``p2pactor.core.producer``.

The producer serves a peer's request from our blocks: it answers lookups
(looking keys up in the parent cache and pinning the hits at once), matches
fetches against what a round's lookups pinned or what the engine stores for a
prefill/decode request, writes the matched blocks, reports ``transfer_done``
per round, acknowledges aborts only once no write can still land, and releases
every pin and closes every synthetic parent request exactly once.

Each test drives one request through ``tests.harness.ProducerHarness`` (the
parent is its ``FakeCache``, transfers are completed by hand, time is
``harness.now``) and checks one behaviour of vLLM 0.33.0's server role
(``vllm-p2p-0.33.md`` §1.4-1.8, §2.2 and the producer-side scenarios of §5:
``test_sessions.py`` and ``test_issue_49820_repro.py``) through real outcomes:
the messages sent, the parent's calls in order, pin releases and their success
flags, and the events recorded. Most tests end with :func:`end_and_check`, which
ends the session if the request is still open and then checks the invariants:
every pin released exactly once, every opened context closed exactly once, one
``lookup_resp`` per answered lookup. The harness itself checks after every step
that replaying the log rebuilds the live state.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import pytest

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.producer import ProducerPhase, next_producer_deadline
from p2pactor.core.timings import Timings
from tests.harness import KV, PEER, ProducerHarness, key

K1, K2, K3, K4 = key(1), key(2), key(3), key(4)
BLOCK = {K1: 11, K2: 12, K3: 13, K4: 14}
"""Where the parent holds each key, when it holds it."""

FIRST_PIN = 1000
"""FakeCache numbers its pin jobs from here."""


# --- helpers ---------------------------------------------------------------------------


def make(
    *,
    stored: Iterable[bytes] = (),
    pending: Iterable[bytes] = (),
    retry: Iterable[bytes] = (),
    auto_serve: bool = True,
) -> ProducerHarness:
    """A producer whose parent holds ``stored`` (HIT), ``pending`` and ``retry``."""
    h = ProducerHarness(auto_serve=auto_serve)
    h.cache.stored = {k: BLOCK[k] for k in stored}
    h.cache.pending = set(pending)
    h.cache.retry = set(retry)
    return h


def ctx(lookup_id: int) -> str:
    """The synthetic parent request of the actor's ``lookup_id``-th lookup."""
    return f"p2p:{PEER}:{KV}:lu{lookup_id}"


def resp(keys: Iterable[bytes], hits: Iterable[bool], round_seq: int = 0) -> wire.LookupResp:
    return wire.LookupResp(
        kv_request_id=KV, keys=tuple(keys), hits=tuple(hits), round_seq=round_seq
    )


def done(success: bool, round_seq: int = 0) -> wire.TransferDone:
    return wire.TransferDone(kv_request_id=KV, success=success, round_seq=round_seq)


def ack(round_seq: int = 0) -> wire.AbortAck:
    return wire.AbortAck(kv_request_id=KV, round_seq=round_seq)


def write(transfer_id: int, local: Iterable[int], remote: Iterable[int]) -> fx.StartTransfer:
    return fx.StartTransfer(
        transfer_id=transfer_id, local_blocks=tuple(local), remote_blocks=tuple(remote)
    )


def advance_to(h: ProducerHarness, t: float) -> None:
    """Move the clock to exactly ``t`` (summing steps would drift at the boundaries)."""
    assert t >= h.now
    h.now = t


def tick_at(h: ProducerHarness, t: float) -> None:
    advance_to(h, t)
    h.tick()


def store(h: ProducerHarness, job_id: int, keys: Iterable[bytes], blocks: Iterable[int]) -> None:
    """The engine stored (and pinned) blocks of a prefill/decode request."""
    h.feed(inp.AddStore(job_id=job_id, keys=tuple(keys), blocks=tuple(blocks)))


def close_request(h: ProducerHarness, round_seq: int = 0) -> None:
    """The consumer's terminal empty fetch."""
    h.fetch([], [], round_seq=round_seq)


def parent_calls(h: ProducerHarness, name: str) -> list[object]:
    return [arg for call, arg in h.cache.calls if call == name]


def created_pins(h: ProducerHarness) -> set[int]:
    """Every job the parent pinned for a lookup or the engine stored."""
    stores = {e.job_id for e in h.events_of(ev.StoreAdded)}  # type: ignore[attr-defined]
    return set(h.cache.pins) | stores


def rejections(h: ProducerHarness) -> list[ev.Violation]:
    return [e.violation for e in h.events_of(ev.Rejected)]  # type: ignore[attr-defined]


def assert_settled(h: ProducerHarness) -> None:
    """The invariants of a request that has ended."""
    assert h.retired
    assert h.state.phase is ProducerPhase.CLOSED
    assert h.kinds()[-1] == "Closed"
    assert not h.parent_queue, "parent requests left unserved"
    assert not h.transfers, "transfers left running"
    # every pin created is released exactly once, and nothing else is released
    assert set(h.released) == created_pins(h)
    assert all(n == 1 for n in h.released.values()), h.released
    assert h.pinned_jobs() == set()
    # every opened synthetic parent request is closed exactly once
    assert Counter(h.cache.closed) == Counter(h.cache.opened)
    assert all(n == 1 for n in Counter(h.cache.opened).values())
    assert h.open_contexts() == []
    # exactly one lookup_resp per answered lookup; every other lookup was dropped
    answered = [e.lookup_id for e in h.events_of(ev.LookupAnswered)]  # type: ignore[attr-defined]
    assert len(answered) == len(set(answered)) == len(h.sent_of(wire.LookupResp))
    received = {e.lookup_id for e in h.events_of(ev.LookupReceived)}  # type: ignore[attr-defined]
    dropped = {e.lookup_id for e in h.events_of(ev.LookupDropped)}  # type: ignore[attr-defined]
    assert set(answered) | dropped == received
    assert not set(answered) & dropped


def end_and_check(h: ProducerHarness) -> None:
    """End the request if it is still open (the session goes), then check invariants."""
    if not h.retired:
        h.feed(inp.SessionEnded("test over"))
        h.serve()
        h.complete_all()
    assert_settled(h)


# --- lookups ---------------------------------------------------------------------------


class TestServerLookupHandling:
    def test_immediate_hits_are_pinned_in_one_job_and_answered_all_true(self) -> None:
        h = make(stored=[K1, K2])

        h.lookup(K1, K2)

        assert h.cache.calls == [
            ("on_new_request", ctx(0)),
            ("lookup", K1),
            ("lookup", K2),
            ("create_store_job", (K1, K2)),
            ("on_request_finished", ctx(0)),
        ]
        assert h.sent == [resp([K1, K2], [True, True])]
        assert h.cache.pins == {FIRST_PIN: (K1, K2)}
        assert h.pinned_jobs() == {FIRST_PIN}, "the pin waits for the fetch"
        (answered,) = h.events_of(ev.LookupAnswered)
        assert isinstance(answered, ev.LookupAnswered)
        assert answered.round_seq == 0
        assert answered.pinned == ev.Pinned(
            job_id=FIRST_PIN, keys=(K1, K2), blocks=(11, 12), expires_at=h.timings.pin_timeout
        )
        assert h.kinds() == ["LookupReceived", "LookupAnswered"]  # the parent answered at once
        end_and_check(h)

    def test_all_misses_pin_nothing_and_still_close_the_context(self) -> None:
        h = make()

        h.lookup(K1, K2)

        assert h.cache.calls == [
            ("on_new_request", ctx(0)),
            ("lookup", K1),
            ("lookup", K2),
            ("on_request_finished", ctx(0)),
        ]
        assert h.sent == [resp([K1, K2], [False, False])]
        assert h.cache.pins == {}
        end_and_check(h)

    def test_mixed_batch_defers_the_answer_but_pins_the_hit_at_the_first_serve(self) -> None:
        h = make(stored=[K1], pending=[K2], auto_serve=False)

        h.lookup(K1, K2, K3)
        assert h.cache.calls == [], "the parent is only touched while it is lent"
        h.advance(0.5)
        h.serve()

        assert h.cache.calls == [
            ("on_new_request", ctx(0)),
            ("lookup", K1),
            ("lookup", K2),
            ("lookup", K3),
            ("create_store_job", (K1,)),
        ]
        assert h.sent == [], "the answer waits for the pending key"
        assert h.pinned_jobs() == {FIRST_PIN}
        assert h.open_contexts() == [ctx(0)], "the lookup is parked with its context open"
        end_and_check(h)

    def test_lookup_is_answered_only_once_the_parent_is_lent(self) -> None:
        h = make(auto_serve=False)

        h.lookup(K1, K2)
        assert h.sent == []
        assert h.cache.calls == []
        h.serve()

        assert h.sent == [resp([K1, K2], [False, False])]
        assert h.cache.calls[0] == ("on_new_request", ctx(0))
        assert h.cache.calls[-1] == ("on_request_finished", ctx(0))
        end_and_check(h)

    def test_lookup_without_keys_is_ignored(self) -> None:
        h = make()

        h.lookup()

        assert h.kinds() == ["Ignored", "Closed"], "nothing is held, so the request ends"
        assert h.sent == []
        assert h.cache.calls == []
        assert_settled(h)

    def test_pending_key_turning_into_a_hit_answers_once_in_wire_order(self) -> None:
        h = make(stored=[K1], pending=[K2])
        h.lookup(K2, K1, K2)
        assert h.sent == []

        h.cache.pending.discard(K2)
        h.cache.stored[K2] = BLOCK[K2]
        tick_at(h, 0.005)

        assert h.cache.calls == [
            ("on_new_request", ctx(0)),
            ("lookup", K2),
            ("lookup", K1),
            ("create_store_job", (K1,)),
            ("lookup", K2),
            ("create_store_job", (K2,)),
            ("on_request_finished", ctx(0)),
        ]
        assert h.sent == [resp([K2, K1, K2], [True, True, True])]
        assert h.cache.pins == {FIRST_PIN: (K1,), FIRST_PIN + 1: (K2,)}
        end_and_check(h)

    def test_retry_key_is_asked_again_until_it_resolves(self) -> None:
        h = make(retry=[K1])
        h.lookup(K1)
        tick_at(h, 0.005)
        assert parent_calls(h, "lookup") == [K1, K1]
        assert h.sent == []

        h.cache.retry.clear()  # now a plain MISS
        tick_at(h, 0.010)

        assert parent_calls(h, "lookup") == [K1, K1, K1]
        assert h.sent == [resp([K1], [False])]
        end_and_check(h)

    def test_pending_key_answers_miss_exactly_five_seconds_after_arrival(self) -> None:
        h = make(pending=[K1], auto_serve=False)
        h.lookup(K1)  # arrives at t=0
        advance_to(h, 1.0)
        h.serve()  # first served a second later: the deadline still counts from arrival

        tick_at(h, 4.999)
        h.serve()
        assert h.sent == [], "still pending at 4.999 s"
        assert parent_calls(h, "lookup") == [K1, K1]

        h.cache.pending.discard(K1)
        h.cache.stored[K1] = BLOCK[K1]  # readable now, but too late
        tick_at(h, 5.0)
        h.serve()

        assert h.sent == [resp([K1], [False])]
        assert h.cache.calls == [
            ("on_new_request", ctx(0)),
            ("lookup", K1),
            ("lookup", K1),
            ("on_request_finished", ctx(0)),
        ], "not asked again at the deadline, and a timed-out key is never pinned"
        assert h.kinds().count("PendingPolled") == 1
        (expired,) = h.events_of(ev.PendingExpired)
        assert expired.keys == (K1,)  # type: ignore[attr-defined]
        assert expired.at == 5.0
        end_and_check(h)

    def test_parent_serve_after_the_deadline_does_not_look_the_key_up(self) -> None:
        h = make(pending=[K1], auto_serve=False)
        h.lookup(K1)
        h.serve()
        tick_at(h, 4.999)  # a poll is posted, but the parent is not lent before 5 s
        h.cache.pending.discard(K1)
        h.cache.stored[K1] = BLOCK[K1]

        advance_to(h, 5.0)
        h.serve()

        assert h.cache.calls == [
            ("on_new_request", ctx(0)),
            ("lookup", K1),
            ("expired", ctx(0)),
            ("on_request_finished", ctx(0)),
        ]
        assert h.sent == [resp([K1], [False])]
        assert h.cache.pins == {}
        end_and_check(h)

    def test_each_lookup_gets_its_own_synthetic_context(self) -> None:
        h = make(stored=[K1])

        h.lookup(K1)
        h.lookup(K1, K2)

        assert h.cache.opened == [ctx(0), ctx(1)]
        assert all(c.startswith("p2p:") and f":{KV}:" in c for c in h.cache.opened)
        assert parent_calls(h, "on_request_finished") == [ctx(0), ctx(1)]
        assert h.sent == [resp([K1], [True]), resp([K1, K2], [True, False])]
        end_and_check(h)

    def test_empty_fetch_drops_parked_lookups_and_closes_their_contexts_at_next_serve(
        self,
    ) -> None:
        h = make(stored=[K1], pending=[K2], auto_serve=False)
        h.lookup(K1, K2)
        h.serve()
        calls_before = len(h.cache.calls)

        close_request(h)

        assert h.sent == [], "no lookup_resp and no transfer_done"
        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is False
        assert len(h.cache.calls) == calls_before, "the parent is not touched before the serve"
        h.serve()
        assert h.cache.calls[calls_before:] == [("on_request_finished", ctx(0))]
        assert [e.lookup_id for e in h.events_of(ev.LookupDropped)] == [0]  # type: ignore[attr-defined]
        assert_settled(h)

    def test_engine_finish_drops_parked_lookups_and_queues_their_close(self) -> None:
        h = make(pending=[K1], auto_serve=False)
        h.lookup(K1)
        h.serve()

        h.feed(inp.Finish())
        assert parent_calls(h, "on_request_finished") == []
        h.serve()

        assert parent_calls(h, "on_request_finished") == [ctx(0)]
        assert h.sent == []
        tick_at(h, 5.0)
        assert h.sent == [], "a dropped lookup is never answered"
        end_and_check(h)

    @pytest.mark.parametrize(
        ("deadline_ms", "answered_at"),
        [(1000, 1.0), (2500, 2.5), (5000, 5.0), (60_000, 5.0)],
    )
    def test_lookup_deadline_ms_answers_by_the_smaller_of_five_seconds_and_the_budget(
        self, deadline_ms: int, answered_at: float
    ) -> None:
        h = make(pending=[K1])

        h.lookup(K1, deadline_ms=deadline_ms)
        tick_at(h, answered_at - 0.001)
        assert h.sent == []
        tick_at(h, answered_at)

        assert h.sent == [resp([K1], [False])]
        end_and_check(h)

    def test_lookup_with_zero_budget_answers_pending_keys_at_the_first_serve(self) -> None:
        h = make(stored=[K1], pending=[K2])

        h.lookup(K1, K2, deadline_ms=0)

        assert h.sent == [resp([K1, K2], [True, False])]
        assert h.cache.pins == {FIRST_PIN: (K1,)}, "hits are still pinned"
        end_and_check(h)

    def test_lookup_fetch_transfer_reports_success_and_releases_the_pin(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1, K2)
        h.fetch([K1, K2], [7, 8])
        assert h.transfers == {0: write(0, [11, 12], [7, 8])}

        h.complete(0)

        assert h.sent == [resp([K1, K2], [True, True]), done(True)]
        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is True
        assert h.cache.opened[0].startswith("p2p:")
        assert_settled(h)


# --- fetch, completion and abort --------------------------------------------------------


class TestServerFlows:
    def test_fetch_matches_lookup_supply_in_one_write(self) -> None:
        h = make(stored=[K1, K2, K3])
        h.lookup(K1, K2, K3)

        h.fetch([K3, K1, K2], [30, 10, 20])

        assert h.transfers == {0: write(0, [13, 11, 12], [30, 10, 20])}
        (started,) = h.events_of(ev.TransferStarted)
        assert started.job_ids == (FIRST_PIN,) * 3  # type: ignore[attr-defined]
        assert h.sent_of(wire.TransferDone) == []
        assert h.released == {}, "pins are held while the write reads them"
        end_and_check(h)

    def test_completion_sends_transfer_done_with_the_round_and_releases_the_pin(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1, round_seq=2)
        h.fetch([K1], [5], round_seq=2)

        h.complete(0)

        assert h.sent[-1] == done(True, round_seq=2)
        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is True
        assert_settled(h)

    def test_abort_with_transfer_in_flight_acks_only_after_the_transfer_ends(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)
        h.fetch([K1], [5])

        h.abort(0)
        assert h.sent_of(wire.AbortAck) == [], "NIXL cannot stop a write that has started"
        assert h.released == {}, "the pin stays while the write reads it"

        h.complete(0)

        assert h.sent_of(wire.AbortAck) == [ack(0)]
        assert h.sent_of(wire.TransferDone) == [], "an aborted round gets no transfer_done"
        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is False
        assert_settled(h)

    def test_abort_with_nothing_in_flight_acks_at_once(self) -> None:
        h = make()
        h.fetch([K1], [5])  # prefill/decode demand, parked: nothing stored yet

        h.abort(0)

        assert h.sent == [ack(0)]
        assert_settled(h)

    def test_repeated_abort_while_draining_acks_once(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)
        h.fetch([K1], [5])

        h.abort(0)
        h.abort(0)
        h.complete(0)

        assert h.sent_of(wire.AbortAck) == [ack(0)]
        assert h.kinds().count("AbortReceived") == 1
        assert_settled(h)

    def test_abort_for_a_round_that_already_finished_acks_at_once(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)  # keeps the request alive past round 0
        h.complete(0)
        assert h.sent_of(wire.TransferDone) == [done(True, 0)]

        h.abort(0)  # crossed the transfer_done on the wire

        assert h.sent[-1] == ack(0)
        assert h.disconnects == []
        assert h.released == {FIRST_PIN: 1}, "round 1's pin is untouched"
        end_and_check(h)

    def test_abort_for_a_round_never_fetched_is_a_protocol_violation(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)

        h.abort(0)

        assert rejections(h) == [ev.Violation.UNKNOWN_ROUND]
        assert len(h.disconnects) == 1
        assert h.disconnects[0].startswith("unknown_round in abort_fetch")
        assert h.sent_of(wire.AbortAck) == []
        end_and_check(h)

    def test_unused_pin_is_released_after_thirty_seconds(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)

        tick_at(h, 29.999)
        assert h.released == {}
        tick_at(h, 30.0)

        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is False
        tick_at(h, 60.0)
        assert h.released == {FIRST_PIN: 1}
        end_and_check(h)

    def test_fetch_after_the_pin_expired_fails_fast(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)
        tick_at(h, 30.0)

        h.fetch([K1], [5])

        assert h.sent[-1] == done(False)
        assert h.events_of(ev.TransferStarted) == []
        assert h.released == {FIRST_PIN: 1}
        assert_settled(h)

    def test_transfer_failure_reports_failure_and_releases_pins_unsuccessfully(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1, K2)
        h.fetch([K1, K2], [5, 6])

        h.complete(0, ok=False, reason="NIXL_ERR_REMOTE_DISCONNECT")

        assert h.sent[-1] == done(False)
        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is False
        (failed,) = h.events_of(ev.TransferFailed)
        assert failed.reason == "NIXL_ERR_REMOTE_DISCONNECT"  # type: ignore[attr-defined]
        assert_settled(h)

    def test_pin_read_by_a_transfer_outlives_the_pin_timeout(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)
        h.fetch([K1], [5])

        tick_at(h, 45.0)
        assert h.released == {}, "the write still reads the block"
        h.complete(0)

        assert h.sent[-1] == done(True)
        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is True
        assert_settled(h)

    def test_late_result_for_an_unknown_transfer_is_ignored(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)  # keeps the request alive past round 0
        h.complete(0)
        sent, released = list(h.sent), Counter(h.released)

        h.feed(inp.TransferResult(transfer_id=0, ok=False, reason="late"))
        h.feed(inp.TransferResult(transfer_id=99, ok=True))

        assert h.kinds()[-2:] == ["Ignored", "Ignored"]
        assert h.sent == sent
        assert h.released == released
        end_and_check(h)


# --- pin leases (issue 37: a slow trickle, vLLM #56836) ---------------------------------


def renewals(h: ProducerHarness) -> list[tuple[float, tuple[int, ...], float]]:
    """Each PinsRenewed as (when, jobs, until)."""
    return [(e.at, e.job_ids, e.expires_at) for e in h.events_of(ev.PinsRenewed)]  # type: ignore[attr-defined]


class TestPinLeases:
    def test_a_later_lookup_of_the_request_renews_its_pins(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        advance_to(h, 20.0)
        h.lookup(K2)  # the same round, as a stock consumer's next step sends it
        assert renewals(h) == [(20.0, (FIRST_PIN,), 50.0)]
        tick_at(h, 49.999)
        assert h.released == {}
        tick_at(h, 50.0)
        assert h.released == {FIRST_PIN: 1, FIRST_PIN + 1: 1}, "silent from 20 s: both expire"
        end_and_check(h)

    def test_a_fetch_renews_the_pins_of_rounds_it_does_not_fetch(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        advance_to(h, 1.0)
        h.lookup(K2, round_seq=1)
        advance_to(h, 25.0)
        h.fetch([K1], [5])
        # Round 0's pin serves the fetch (no lease); round 1's is renewed.
        assert renewals(h) == [(1.0, (FIRST_PIN,), 31.0), (25.0, (FIRST_PIN + 1,), 55.0)]
        h.complete(0)
        tick_at(h, 54.0)
        assert h.released == {FIRST_PIN: 1}
        tick_at(h, 55.0)
        assert h.released == {FIRST_PIN: 1, FIRST_PIN + 1: 1}
        end_and_check(h)

    def test_one_lookup_then_its_fetch_renews_nothing(self) -> None:
        # The common request, and a prefill/decode one, log no renewal.
        h = make(stored=[K1])
        h.lookup(K1)
        advance_to(h, 5.0)
        h.fetch([K1], [5])
        store(h, 7, [K2], [3])
        advance_to(h, 6.0)
        h.fetch([K2], [6], round_seq=1)
        h.complete_all()
        assert renewals(h) == []
        end_and_check(h)

    def test_renewals_stop_at_the_lease_cap(self) -> None:
        h = ProducerHarness(timings=Timings(pin_timeout=30.0, pin_lease_cap=60.0))
        h.cache.stored = dict(BLOCK)
        h.lookup(K1)
        for t, k in ((20.0, K2), (40.0, K3), (55.0, K4)):
            advance_to(h, t)
            h.lookup(k)
        # At 55 s every pin's lease already reaches the cap: nothing left to renew.
        assert [until for _, _, until in renewals(h)] == [50.0, 60.0]
        tick_at(h, 59.999)
        assert h.released == {}
        tick_at(h, 60.0)
        assert set(h.released) == {FIRST_PIN, FIRST_PIN + 1}, "held past the cap by no renewal"
        tick_at(h, 70.0)  # a fresh pin keeps its own 30 s
        assert set(h.released) == {FIRST_PIN, FIRST_PIN + 1, FIRST_PIN + 2}
        end_and_check(h)

    def test_a_slow_trickle_then_one_fetch_of_all_its_keys_is_served(self) -> None:
        keys = [key(100 + i) for i in range(40)]
        h = ProducerHarness()
        h.cache.stored = {k: i for i, k in enumerate(keys)}
        for i, k in enumerate(keys):
            advance_to(h, float(i))
            h.lookup(k)
            h.tick()
        tick_at(h, 45.0)  # 45 s after the first pin, 6 s after the last lookup
        assert h.released == {}
        h.fetch(keys, range(40))
        h.complete_all()
        assert h.sent[-1] == done(True)
        assert h.released == {FIRST_PIN + i: 1 for i in range(40)}
        assert all(h.release_success.values())
        close_request(h, round_seq=1)
        assert_settled(h)

    def test_a_pin_renewed_once_is_released_once(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        advance_to(h, 10.0)
        h.lookup(K2)
        tick_at(h, 40.0)
        advance_to(h, 41.0)
        h.lookup(K1)  # a new pin; the released ones are not renewed
        assert renewals(h) == [(10.0, (FIRST_PIN,), 40.0)]
        assert h.released == {FIRST_PIN: 1, FIRST_PIN + 1: 1}
        end_and_check(h)


# --- prefill/decode: stores instead of lookups -----------------------------------------


class TestPrefillDecode:
    def test_leftover_stores_are_released_once_finished_and_served(self) -> None:
        # vLLM settles a round's store jobs when the round ends; leftovers of a
        # finished request must not stay pinned for the 30 s pin timeout.
        h = make()
        store(h, 1, [K1], [21])
        store(h, 2, [K3], [23])
        h.feed(inp.Finish())
        h.fetch([K1, K2], [5, 6])

        assert h.sent == [done(False)]
        assert h.transfers == {}
        assert h.released == {1: 1, 2: 1}
        assert h.release_success == {1: False, 2: False}
        end_and_check(h)

    def test_leftover_stores_wait_for_a_fetch_before_the_engine_finishes(self) -> None:
        h = make()
        store(h, 1, [K1, K3], [21, 23])
        h.fetch([K1], [5])
        h.complete_all()

        assert h.sent == [done(True)]
        assert h.released == {}, "K3 may still be fetched in a later round"
        h.feed(inp.Finish())
        assert h.released == {1: 1}
        end_and_check(h)

    def test_store_then_fetch_matches(self) -> None:
        h = make()
        store(h, 1, [K1, K2], [21, 22])

        h.fetch([K1, K2], [5, 6])
        assert h.transfers == {0: write(0, [21, 22], [5, 6])}
        h.complete(0)

        assert h.sent == [done(True)]
        assert h.released == {1: 1}
        assert h.release_success[1] is True
        assert_settled(h)

    def test_fetch_then_store_matches_parked_demand(self) -> None:
        h = make()
        h.fetch([K1, K2], [5, 6])
        assert h.transfers == {}
        assert h.sent == [], "prefill/decode demand parks instead of failing"

        store(h, 1, [K1, K2], [21, 22])
        assert h.transfers == {0: write(0, [21, 22], [5, 6])}
        h.complete(0)

        assert h.sent == [done(True)]
        assert h.released == {1: 1}
        assert_settled(h)

    def test_partial_match_finishes_across_two_stores(self) -> None:
        h = make()
        h.fetch([K1, K2], [5, 6])

        store(h, 1, [K1], [21])
        assert h.transfers == {0: write(0, [21], [5])}
        h.complete(0)
        assert h.sent == [], "one block is still owed"
        store(h, 2, [K2], [22])
        assert h.transfers == {1: write(1, [22], [6])}
        h.complete(1)

        assert h.sent == [done(True)]
        assert h.released == {1: 1, 2: 1}
        assert h.release_success == {1: True, 2: True}
        assert_settled(h)

    def test_finish_with_unmatched_demand_and_nothing_in_flight_fails_at_once(self) -> None:
        h = make()
        h.fetch([K1], [5])

        h.feed(inp.Finish())

        assert h.sent == [done(False)]
        assert_settled(h)

    def test_finish_with_a_transfer_in_flight_defers_the_failure_until_it_ends(self) -> None:
        h = make()
        h.fetch([K1, K2], [5, 6])
        store(h, 1, [K1], [21])

        h.feed(inp.Finish())
        assert h.sent == [], "a write may still land: wait for it"
        h.complete(0)

        assert h.sent == [done(False)]
        assert h.released == {1: 1}
        assert_settled(h)

    def test_demand_fully_met_succeeds_even_if_finish_came_first(self) -> None:
        h = make()
        h.fetch([K1, K2], [5, 6])
        store(h, 1, [K1, K2], [21, 22])

        h.feed(inp.Finish())
        h.complete(0)

        assert h.sent == [done(True)]
        assert h.release_success == {1: True}
        assert_settled(h)

    def test_prefiller_finished_before_the_fetch_with_all_blocks_stored_succeeds(self) -> None:
        h = make()
        store(h, 1, [K1, K2], [21, 22])
        h.feed(inp.Finish())

        h.fetch([K1, K2], [5, 6])
        h.complete(0)

        assert h.sent == [done(True)]
        assert h.release_success == {1: True}
        assert_settled(h)

    def test_prefiller_finished_before_a_fetch_larger_than_its_stores_fails_at_once(
        self,
    ) -> None:
        h = make()
        store(h, 1, [K1], [21])
        h.feed(inp.Finish())

        h.fetch([K1, K2], [5, 6])

        assert h.sent == [done(False)]
        assert h.events_of(ev.TransferStarted) == [], "no partial write"
        end_and_check(h)

    def test_write_failure_while_another_write_runs_fails_the_round_after_both_end(
        self,
    ) -> None:
        h = make()
        h.fetch([K1, K2], [5, 6])
        store(h, 1, [K1], [21])
        store(h, 2, [K2], [22])

        h.complete(0, ok=False, reason="NIXL_ERR_BACKEND")
        assert h.sent == [], "the other write may still land"
        assert h.released == {1: 1}, "the failed write's job is released at once"
        assert h.release_success[1] is False
        h.complete(1)

        assert h.sent == [done(False)]
        assert h.released == {1: 1, 2: 1}
        assert_settled(h)

    def test_write_failure_fails_the_other_jobs_of_its_round(self) -> None:
        h = make()
        h.fetch([K1, K2], [5, 6])
        store(h, 1, [K1], [21])
        store(h, 2, [K2], [22])

        h.complete(0, ok=False, reason="NIXL_ERR_BACKEND")
        h.complete(1)

        assert h.release_success == {1: False, 2: False}
        assert_settled(h)

    def test_store_no_fetch_used_is_released_after_thirty_seconds(self) -> None:
        h = make()
        store(h, 1, [K1], [21])

        tick_at(h, 29.999)
        assert h.released == {}
        tick_at(h, 30.0)

        assert h.released == {1: 1}
        assert h.release_success[1] is False
        assert_settled(h)

    def test_same_key_stored_twice_serves_two_demands(self) -> None:
        h = make()
        store(h, 1, [K1], [21])
        store(h, 2, [K1], [31])

        h.fetch([K1, K1], [5, 6])

        assert h.transfers == {0: write(0, [21, 31], [5, 6])}
        h.complete(0)
        assert h.sent == [done(True)]
        assert h.release_success == {1: True, 2: True}
        assert_settled(h)


# --- round isolation (vLLM issue #49820) ------------------------------------------------


class TestRoundIsolation:
    def test_completing_round_zero_leaves_round_one_supply_and_pin_alone(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)

        h.complete(0)

        assert h.released == {FIRST_PIN: 1}
        assert h.pinned_jobs() == {FIRST_PIN + 1}
        h.fetch([K2], [6], round_seq=1)
        assert h.transfers == {1: write(1, [12], [6])}, "round 1's supply survived"
        end_and_check(h)

    def test_each_round_gets_its_own_transfer_done(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)
        h.complete(0)

        h.fetch([K2], [6], round_seq=1)
        h.complete(1)

        assert h.sent_of(wire.TransferDone) == [done(True, 0), done(True, 1)]
        assert h.release_success == {FIRST_PIN: True, FIRST_PIN + 1: True}
        assert_settled(h)

    def test_terminal_empty_fetch_leaves_no_round_behind(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)  # a miss: round 1 is looked up but never fetched
        h.complete(0)

        close_request(h, round_seq=1)

        assert h.state.rounds == {}
        assert h.sent_of(wire.TransferDone) == [done(True, 0)], "no transfer_done for round 1"
        assert_settled(h)

    def test_symmetric_fetch_for_keys_never_pinned_fails_fast_without_writing(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1, K2)

        h.fetch([K1, K2], [5, 6])

        assert h.sent[-1] == done(False)
        assert h.events_of(ev.TransferStarted) == []
        assert h.transfers == {}
        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is False
        assert_settled(h)

    def test_abort_of_round_zero_leaves_round_one_supply_intact(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)

        h.abort(0)
        h.complete(0)
        assert h.sent[-1] == ack(0)
        assert h.released == {FIRST_PIN: 1}

        h.fetch([K2], [6], round_seq=1)
        h.complete(1)
        assert h.sent_of(wire.TransferDone) == [done(True, 1)]
        assert h.release_success == {FIRST_PIN: False, FIRST_PIN + 1: True}
        assert_settled(h)

    def test_concurrent_rounds_complete_per_round_even_out_of_order(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)
        h.fetch([K2], [6], round_seq=1)

        h.complete(1)
        assert h.sent_of(wire.TransferDone) == [done(True, 1)]
        assert h.released == {FIRST_PIN + 1: 1}
        h.complete(0)

        assert h.sent_of(wire.TransferDone) == [done(True, 1), done(True, 0)]
        assert h.release_success == {FIRST_PIN: True, FIRST_PIN + 1: True}
        assert_settled(h)

    def test_keys_probed_but_not_fetched_are_pinned_again_in_the_next_round(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1, K2)
        h.fetch([K1], [5])

        h.lookup(K2, round_seq=1)

        assert parent_calls(h, "create_store_job") == [(K1, K2), (K2,)]
        assert h.released == {}, "round 0's pin is held until round 0 ends"
        h.complete(0)
        assert h.released == {FIRST_PIN: 1}
        h.fetch([K2], [6], round_seq=1)
        assert h.transfers == {1: write(1, [12], [6])}
        (_, second) = h.events_of(ev.TransferStarted)
        assert second.job_ids == (FIRST_PIN + 1,)  # type: ignore[attr-defined]
        h.complete(1)
        assert h.sent_of(wire.TransferDone) == [done(True, 0), done(True, 1)]
        assert_settled(h)


# --- protocol violations -----------------------------------------------------------------


class TestAdversarial:
    def test_second_fetch_for_the_same_round_is_rejected(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)
        h.fetch([K1], [5])

        h.fetch([K1], [6])

        assert rejections(h) == [ev.Violation.DUPLICATE_FETCH]
        assert len(h.disconnects) == 1
        assert h.disconnects[0].startswith("duplicate_fetch in fetch")
        assert list(h.transfers) == [0], "no second write"
        end_and_check(h)

    def test_fetch_repeating_a_finished_round_is_rejected(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, round_seq=1)
        h.complete(0)

        h.fetch([K1], [5])

        assert rejections(h) == [ev.Violation.DUPLICATE_FETCH]
        assert len(h.disconnects) == 1
        end_and_check(h)

    def test_fetch_for_an_older_round_is_rejected_as_stale(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1, round_seq=1)
        h.fetch([K1], [5], round_seq=1)

        h.fetch([K1], [6], round_seq=0)

        assert rejections(h) == [ev.Violation.STALE_ROUND]
        assert len(h.disconnects) == 1
        assert list(h.transfers) == [0]
        end_and_check(h)

    def test_lookup_for_a_round_already_fetched_is_rejected_as_stale(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])

        h.lookup(K2, round_seq=0)

        assert rejections(h) == [ev.Violation.STALE_ROUND]
        assert len(h.disconnects) == 1
        assert K2 not in parent_calls(h, "lookup"), "the parent is not asked"
        end_and_check(h)

    @pytest.mark.parametrize("late", ["lookup", "fetch"])
    def test_lookup_or_fetch_after_the_empty_fetch_is_rejected(self, late: str) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        close_request(h, round_seq=1)  # round 0's write still runs: the request is closing
        assert h.state.phase is ProducerPhase.CLOSING

        if late == "lookup":
            h.lookup(K2, round_seq=1)
        else:
            h.fetch([K2], [6], round_seq=1)

        assert rejections(h) == [ev.Violation.AFTER_CLOSE]
        assert len(h.disconnects) == 1
        assert K2 not in parent_calls(h, "lookup")
        assert list(h.transfers) == [0]
        end_and_check(h)

    def test_violations_leak_no_pins_once_the_session_ends(self) -> None:
        h = make(stored=[K1, K2, K3], pending=[K4])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, K4, round_seq=1)  # pinned and parked
        h.fetch([K1], [5])  # duplicate
        h.abort(7)  # never fetched
        assert rejections(h) == [ev.Violation.DUPLICATE_FETCH, ev.Violation.UNKNOWN_ROUND]

        h.feed(inp.SessionEnded("disconnected for a protocol violation"))
        h.complete(0)

        assert h.released == {FIRST_PIN: 1, FIRST_PIN + 1: 1}
        assert_settled(h)


# --- the end of the session ------------------------------------------------------------


class TestSessionEnded:
    def test_session_end_releases_every_pin_and_closes_every_context_once(self) -> None:
        h = make(stored=[K1, K2], pending=[K3])
        h.lookup(K1)  # answered, pinned
        h.lookup(K2, K3)  # pinned, parked

        h.feed(inp.SessionEnded("peer gone"))

        assert h.released == {FIRST_PIN: 1, FIRST_PIN + 1: 1}
        assert h.release_success == {FIRST_PIN: False, FIRST_PIN + 1: False}
        assert h.cache.closed == [ctx(0), ctx(1)]
        assert_settled(h)

    def test_session_end_sends_nothing_more(self) -> None:
        h = make(stored=[K1, K2], pending=[K3])
        h.lookup(K1)
        h.fetch([K1], [5])
        h.lookup(K2, K3, round_seq=1)
        sent = list(h.sent)

        h.feed(inp.SessionEnded("peer gone"))
        h.abort(0)
        tick_at(h, 5.0)
        h.complete(0)

        assert h.sent == sent
        assert_settled(h)

    def test_session_end_waits_for_transfers_in_flight_before_releasing_their_pins(
        self,
    ) -> None:
        h = make(stored=[K1])
        h.lookup(K1)
        h.fetch([K1], [5])

        h.feed(inp.SessionEnded("peer gone"))
        assert h.released == {}
        assert not h.retired

        h.complete(0)

        assert h.released == {FIRST_PIN: 1}
        assert h.sent_of(wire.TransferDone) == []
        assert_settled(h)

    def test_session_end_with_a_parent_request_outstanding_releases_the_late_pin(
        self,
    ) -> None:
        h = make(stored=[K1], auto_serve=False)
        h.lookup(K1)

        h.feed(inp.SessionEnded("peer gone"))
        assert not h.retired, "the parent's answer may carry a pin"
        h.serve()

        assert h.released == {FIRST_PIN: 1}
        assert h.release_success[FIRST_PIN] is False
        assert h.sent == []
        assert_settled(h)

    def test_session_end_closes_parked_contexts_only_at_the_next_serve(self) -> None:
        h = make(pending=[K1], auto_serve=False)
        h.lookup(K1)
        h.serve()
        calls_before = len(h.cache.calls)

        h.feed(inp.SessionEnded("peer gone"))
        assert len(h.cache.calls) == calls_before, "no parent handle at teardown"
        h.serve()

        assert h.cache.calls[calls_before:] == [("on_request_finished", ctx(0))]
        assert h.sent == []
        assert_settled(h)

    def test_session_end_retires_the_actor(self) -> None:
        h = make(stored=[K1])
        h.lookup(K1)

        h.feed(inp.SessionEnded("peer gone"))

        assert h.kinds()[-1] == "Closed"
        assert h.retired
        assert h.feed(inp.Tick()) == ()
        assert h.feed(inp.SessionEnded("again")) == ()
        assert_settled(h)


# --- when the actor next needs a tick -----------------------------------------------------


class TestNextDeadline:
    def test_a_fresh_request_needs_no_tick(self) -> None:
        assert next_producer_deadline(make().state) is None

    def test_a_lookup_waiting_on_the_parent_keeps_its_deadline(self) -> None:
        # Better than vLLM, whose 5 s deadline is only checked during serves: a
        # lookup is answered on time even when the engine stops lending the parent.
        h = make(stored=[K2], pending=[K1], auto_serve=False)
        h.lookup(K1, K2)
        assert next_producer_deadline(h.state) == 5.0

        tick_at(h, 4.999)
        assert h.sent == []
        tick_at(h, 5.0)
        assert h.sent == [resp([K1, K2], [False, False])]
        assert next_producer_deadline(h.state) is None

        h.serve()  # the parent comes back late: its pin is released at once
        assert h.cache.pins == {1000: (K2,)}
        assert h.released == {1000: 1}
        assert h.release_success[1000] is False
        assert h.cache.closed == h.cache.opened
        assert h.sent == [resp([K1, K2], [False, False])]
        end_and_check(h)

    def test_pending_keys_need_the_next_poll(self) -> None:
        h = make(pending=[K1])
        advance_to(h, 1.0)
        h.lookup(K1)
        assert next_producer_deadline(h.state) == pytest.approx(1.005)

    def test_last_poll_is_capped_at_the_lookup_deadline(self) -> None:
        h = make(pending=[K1])
        h.lookup(K1)
        tick_at(h, 4.998)
        assert next_producer_deadline(h.state) == 5.0

    def test_unused_pins_need_their_expiry(self) -> None:
        h = make(stored=[K1, K2])
        advance_to(h, 2.0)
        h.lookup(K1)
        advance_to(h, 3.0)
        h.lookup(K2)  # renews the first pin's lease too
        assert next_producer_deadline(h.state) == 33.0

    def test_pins_of_a_fetched_round_need_no_tick(self) -> None:
        h = make(stored=[K1, K2])
        h.lookup(K1)
        h.fetch([K1], [5])
        assert next_producer_deadline(h.state) is None

        advance_to(h, 4.0)
        h.lookup(K2, round_seq=1)
        assert next_producer_deadline(h.state) == 34.0
