"""Hypothesis state machines over the pure consumer and producer cores.

Random sequences of engine calls, peer messages (well-formed and hostile), parent
answers, transfer results, session ends and arbitrary jumps in time. After every
step:

* replaying the event log through ``evolve`` gives exactly the live state;
* phases never go back, and a terminal state absorbs every input;
* every event survives a msgpack and a JSON round trip;
* a tick at ``now`` leaves no deadline at or before ``now``;
* each load job is reported at most once, each pin released at most once, each
  synthetic parent request closed at most once and only if it was opened.

At the end of every run the request is driven to its end (finish, session end,
transfers drained, parent served) and must then have reported every load, released
every pin and closed every context exactly once.
"""

from __future__ import annotations

from collections import Counter

import attrs
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from msgspec.structs import replace

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.consumer import (
    next_consumer_deadline,
    probe_answer,
    probe_answers,
    step_consumer,
)
from p2pactor.core.fold import fold
from p2pactor.core.producer import ProducerPhase, next_producer_deadline, pin_expired
from p2pactor.core.serde import decode_event, encode_event
from p2pactor.core.timings import Timings
from tests.harness import KV, ConsumerHarness, FakeCache, ProducerHarness, key

KEYS = [key(i) for i in range(6)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=0, max_size=6).map(tuple)
nonempty_keys = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6).map(tuple)
rounds = st.integers(min_value=0, max_value=6)
jumps = st.sampled_from(
    [0.0, 0.001, 0.004, 0.006, 0.5, 4.999, 5.0, 9.9, 10.0, 29.9, 30.0, 31.0, 100.0]
)

MACHINE_SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

CONSUMER_PHASE_RANK = {phase: rank for rank, phase in enumerate(ev.ConsumerPhase)}
PRODUCER_PHASE_RANK = {phase: rank for rank, phase in enumerate(ProducerPhase)}


def check_serde(events: tuple[ev.AnyEvent, ...]) -> None:
    for event in events:
        assert decode_event(encode_event(event, "msgpack"), "msgpack") == event
        assert decode_event(encode_event(event, "json"), "json") == event


class ConsumerMachine(RuleBasedStateMachine):
    """A consumer request under a random engine and a random, maybe hostile, peer."""

    def __init__(self) -> None:
        super().__init__()
        self.h = ConsumerHarness()
        self.next_job = 1
        self.submitted: set[int] = set()
        self.max_rank = 0

    def feed(self, event_input: object) -> None:
        was_terminal = self.h.state.phase.terminal
        before = self.h.state
        events = self.h.feed(event_input)  # type: ignore[arg-type]
        if was_terminal:
            assert events == ()
            assert self.h.state == before
        check_serde(events)

    @rule(keys=key_lists)
    def register(self, keys: tuple[bytes, ...]) -> None:
        self.feed(inp.Register(keys))

    @rule()
    def flush(self) -> None:
        self.feed(inp.Flush())

    @rule(keys=nonempty_keys)
    def engine_step(self, keys: tuple[bytes, ...]) -> None:
        self.feed(inp.Register(keys))
        self.feed(inp.Flush())

    @rule(keys=key_lists)
    def lookup_in_one_input(self, keys: tuple[bytes, ...]) -> None:
        # Node.lookup's one input asks exactly what a Register and then a Flush
        # ask, in one event: its Probed registers the keys it sends.
        state, now, timings = self.h.state, self.h.now, self.h.timings
        registered, first = step_consumer(state, inp.Register(keys), now, timings)
        flushed, second = step_consumer(registered, inp.Flush(), now, timings)
        before = len(self.h.log)
        self.feed(inp.Register(keys, flush=True))
        one = tuple(self.h.log[before:])
        assert len(one) == len(second)
        assert all(replace(a, seq=b.seq) == b for a, b in zip(one, second, strict=True))
        assert len(first) <= 1
        assert self.h.state == replace(flushed, seq=self.h.state.seq)

    @rule(
        keys=key_lists,
        data=st.data(),
        stamped=st.sampled_from(["none", "current", "other"]),
    )
    def lookup_resp(self, keys: tuple[bytes, ...], data: st.DataObject, stamped: str) -> None:
        hits = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)).map(tuple))
        current = self.h.state.round_seq or 0
        round_seq = {"none": wire.UNSET, "current": current, "other": current + 1}[stamped]
        self.feed(wire.LookupResp(kv_request_id=KV, keys=keys, hits=hits, round_seq=round_seq))

    @precondition(lambda self: self.h.state.waiting_keys())
    @rule(data=st.data())
    def peer_answers_waiting_keys(self, data: st.DataObject) -> None:
        waiting = list(self.h.state.waiting_keys())
        keys = data.draw(
            st.lists(st.sampled_from(waiting), min_size=1, max_size=len(waiting)).map(tuple)
        )
        hits = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)).map(tuple))
        round_seq = data.draw(st.sampled_from([wire.UNSET, self.h.state.round_seq or 0]))
        self.feed(wire.LookupResp(kv_request_id=KV, keys=keys, hits=hits, round_seq=round_seq))

    @precondition(lambda self: any(v for v in self.h.state.probes.values()))
    @rule(data=st.data())
    def engine_loads_hits(self, data: st.DataObject) -> None:
        hits = [k for k, v in self.h.state.probes.items() if v]
        keys = data.draw(st.lists(st.sampled_from(hits), min_size=1, max_size=len(hits)).map(tuple))
        job = self.next_job
        self.next_job += 1
        self.submitted.add(job)
        self.feed(inp.SubmitLoad(job_id=job, keys=keys, block_indexes=tuple(range(len(keys)))))

    @precondition(lambda self: self.h.state.loads)
    @rule(data=st.data(), success=st.booleans())
    def peer_finishes_a_load(self, data: st.DataObject, success: bool) -> None:
        round_seq = data.draw(st.sampled_from(sorted(self.h.state.loads)))
        if self.h.state.loads[round_seq].aborting and data.draw(st.booleans()):
            self.feed(wire.AbortAck(kv_request_id=KV, round_seq=round_seq))
        else:
            self.feed(wire.TransferDone(kv_request_id=KV, success=success, round_seq=round_seq))

    @precondition(lambda self: any(load.aborting for load in self.h.state.loads.values()))
    @rule(data=st.data())
    def peer_acks_an_abort(self, data: st.DataObject) -> None:
        aborting = [r for r, load in self.h.state.loads.items() if load.aborting]
        round_seq = data.draw(st.sampled_from(sorted(aborting)))
        self.feed(wire.AbortAck(kv_request_id=KV, round_seq=round_seq))

    @rule(keys=key_lists, data=st.data(), mismatched=st.booleans())
    def submit_load(self, keys: tuple[bytes, ...], data: st.DataObject, mismatched: bool) -> None:
        n = len(keys) + (1 if mismatched else 0)
        blocks = data.draw(st.lists(st.integers(0, 100), min_size=n, max_size=n).map(tuple))
        job = self.next_job
        self.next_job += 1
        if not self.h.state.phase.terminal:
            # A retired actor absorbs everything; the runtime answers loads
            # for it without asking the core.
            self.submitted.add(job)
        self.feed(inp.SubmitLoad(job_id=job, keys=keys, block_indexes=blocks))

    @rule(round_seq=rounds, success=st.booleans())
    def transfer_done(self, round_seq: int, success: bool) -> None:
        self.feed(wire.TransferDone(kv_request_id=KV, success=success, round_seq=round_seq))

    @rule(round_seq=rounds)
    def abort_ack(self, round_seq: int) -> None:
        self.feed(wire.AbortAck(kv_request_id=KV, round_seq=round_seq))

    @precondition(lambda self: len(self.h.log) >= 6)
    @rule()
    def finish(self) -> None:
        self.feed(inp.Finish())

    @rule(seconds=jumps)
    def time_passes(self, seconds: float) -> None:
        self.h.advance(seconds)
        self.feed(inp.Tick())
        deadline = next_consumer_deadline(self.h.state)
        assert deadline is None or deadline > self.h.now

    @precondition(lambda self: len(self.h.log) >= 6)
    @rule(
        reason=st.sampled_from(["peer died", "heartbeat timeout"]),
        grace=st.sampled_from([0.0, 0.5, 5.0]),
    )
    def session_ends(self, reason: str, grace: float) -> None:
        held = bool(self.h.state.loads) and grace > 0 and not self.h.state.session_lost
        reported = dict(self.h.reported)
        self.feed(inp.SessionEnded(reason, write_grace=grace))
        if not held:
            assert self.h.state.phase.terminal or self.h.state.session_lost
            return
        # Held: no load is reported until the grace has passed.
        assert self.h.reported == reported
        assert not self.h.state.phase.terminal
        until = self.h.now + grace
        assert all(load.ack_deadline == until for load in self.h.state.loads.values())

    @invariant()
    def replay_equals_live_state(self) -> None:
        if self.h.log:
            assert fold(self.h.log) == self.h.state

    @invariant()
    def phase_only_moves_forward(self) -> None:
        rank = CONSUMER_PHASE_RANK[self.h.state.phase]
        if not self.h.state.phase.terminal:
            assert rank >= self.max_rank
        self.max_rank = max(self.max_rank, rank)

    @invariant()
    def loads_reported_at_most_once(self) -> None:
        assert all(count == 1 for count in self.h.reported.values())
        assert set(self.h.reported) <= self.submitted
        in_flight = {load.job_id for load in self.h.state.loads.values()}
        assert not (in_flight & set(self.h.reported))

    @invariant()
    def answers_are_consistent(self) -> None:
        for k in KEYS:
            answer = probe_answer(self.h.state, k)
            if self.h.state.phase.terminal or self.h.state.lookup_failed:
                assert answer is inp.LookupResult.MISS
        # The batch form (what Node.lookup and LookupView.answers use) says the same.
        assert probe_answers(self.h.state, KEYS) == [probe_answer(self.h.state, k) for k in KEYS]

    def teardown(self) -> None:
        # Drive the request to its end, answering nothing: the deadlines alone
        # must end it, with every load reported exactly once.
        self.feed(inp.Finish())
        for _ in range(3):
            self.h.advance(31.0)
            self.feed(inp.Tick())
        assert self.h.state.phase.terminal
        assert self.h.retired
        assert Counter(self.h.reported) == Counter(self.submitted)
        assert self.h.state.loads == {}


@attrs.define
class BudgetedCache(FakeCache):
    """A FakeCache that pins at most ``budget`` blocks at once, as a node under a quota.

    Hits past the budget (in key order, so a prefix is pinned) are handed back
    as ``refused``, the way :func:`p2pactor.runtime.serving.serve_parent_request` does.
    """

    budget: int | None = None
    released_jobs: set[int] = attrs.field(factory=set)

    def held_blocks(self) -> int:
        return sum(len(keys) for job, keys in self.pins.items() if job not in self.released_jobs)

    def serve(self, req: fx.ParentLookup, now: float) -> inp.ParentAnswer:
        answer = super().serve(req, now)
        if self.budget is None or answer.pin is None:
            return answer
        room = max(0, self.budget - (self.held_blocks() - len(answer.pin.keys)))
        if len(answer.pin.keys) <= room:
            return answer
        job = answer.pin.job_id
        keep = answer.pin.keys[:room]
        refused = answer.pin.keys[room:]
        if keep:
            self.pins[job] = keep
            pin: inp.Pin | None = inp.Pin(job, keep, answer.pin.blocks[:room])
        else:
            del self.pins[job]
            pin = None
        assert self.held_blocks() <= max(self.budget, 0) or pin is None
        return replace(answer, pin=pin, refused=refused, refusal="over the test's budget")


class ProducerMachine(RuleBasedStateMachine):
    """A producer request under a random, maybe hostile, peer and a random cache.

    The peer may also be over a quota: its lookups and fetches then arrive as
    :class:`~p2pactor.core.inputs.OverQuota` verdicts, and the cache pins at
    most a (changing) budget of blocks, refusing the hits past it.
    """

    def __init__(self) -> None:
        super().__init__()
        # A lease cap that renewals 5 s after the first pin reach.
        timings = Timings(pin_lease_cap=35.0)
        self.h = ProducerHarness(auto_serve=False, cache=BudgetedCache(budget=2), timings=timings)
        self.h.cache.stored = {KEYS[0]: 0, KEYS[1]: 1, KEYS[2]: 2}
        self.h.cache.pending = {KEYS[3]}
        self.h.cache.retry = {KEYS[4]}
        self.next_store = 1
        self.max_rank = 0
        self.session_over = False
        self.sends_after_loss = 0

    def feed(self, event_input: object) -> None:
        was_closed = self.h.state.phase is ProducerPhase.CLOSED
        before = self.h.state
        sent_before = len(self.h.sent)
        events = self.h.feed(event_input)  # type: ignore[arg-type]
        if was_closed:
            assert events == ()
            assert self.h.state == before
        check_serde(events)
        self._check_events(events)
        assert isinstance(self.h.cache, BudgetedCache)
        self.h.cache.released_jobs = set(self.h.released)
        if self.session_over:
            assert len(self.h.sent) == sent_before, "sent a message after the session ended"

    def _check_events(self, events: tuple[ev.ProducerEvent, ...]) -> None:
        for event in events:
            if isinstance(event, ev.AbortAckSent):
                # The ack lets the consumer reuse its blocks: nothing of that
                # round may still be writing.
                assert not any(
                    t.round_seq == event.round_seq for t in self.h.state.transfers.values()
                ), "abort acknowledged while a write of the round is in flight"
            if isinstance(event, ev.SessionLost):
                self.session_over = True

    # the cache changes under the request
    @rule(k=st.sampled_from(KEYS), block=st.integers(0, 50))
    def cache_stores(self, k: bytes, block: int) -> None:
        self.h.cache.pending.discard(k)
        self.h.cache.retry.discard(k)
        self.h.cache.stored[k] = block

    @rule(k=st.sampled_from(KEYS), how=st.sampled_from(["pending", "retry", "evict"]))
    def cache_changes(self, k: bytes, how: str) -> None:
        self.h.cache.stored.pop(k, None)
        if how == "pending":
            self.h.cache.pending.add(k)
        elif how == "retry":
            self.h.cache.retry.add(k)

    @rule()
    def serve(self) -> None:
        self.h.serve()

    @rule(auto=st.booleans())
    def parent_lent_continuously(self, auto: bool) -> None:
        self.h.auto_serve = auto
        if auto:
            self.h.serve()

    # the peer, playing by the rules
    def _next_round(self) -> int:
        return self.h.state.closed_through + 1

    @rule(keys=nonempty_keys, deadline_ms=st.just(wire.UNSET) | st.integers(0, 8000))
    def honest_lookup(self, keys: tuple[bytes, ...], deadline_ms: int | wire.UnsetType) -> None:
        self.feed(
            wire.Lookup(
                kv_request_id=KV, keys=keys, round_seq=self._next_round(), deadline_ms=deadline_ms
            )
        )

    @rule(
        gaps=st.lists(jumps, min_size=1, max_size=6), start=st.integers(0, 5), ahead=st.booleans()
    )
    def trickle(self, gaps: list[float], start: int, ahead: bool) -> None:
        # A slow trickle: the request asks again and again (renewing its pins' leases) as time
        # passes, one key a step.
        for i, seconds in enumerate(gaps):
            k = KEYS[(start + i) % len(KEYS)]
            round_seq = self._next_round() + ahead
            self.feed(wire.Lookup(kv_request_id=KV, keys=(k,), round_seq=round_seq))
            self.h.serve()  # the engine steps
            self.time_passes(seconds)

    @rule(data=st.data())
    def honest_fetch(self, data: st.DataObject) -> None:
        rnd = self.h.state.rounds.get(self._next_round())
        candidates = sorted(rnd.supply) if rnd is not None and rnd.supply else KEYS
        keys = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=4).map(tuple))
        self.feed(
            wire.Fetch(
                kv_request_id=KV,
                keys=keys,
                block_indexes=tuple(range(len(keys))),
                round_seq=self._next_round(),
            )
        )

    @precondition(lambda self: self.h.state.closed_through >= 0)
    @rule(data=st.data())
    def honest_abort(self, data: st.DataObject) -> None:
        fetched = [r for r, rnd in self.h.state.rounds.items() if rnd.fetched]
        round_seq = data.draw(st.sampled_from(fetched or [self.h.state.closed_through]))
        self.feed(wire.AbortFetch(kv_request_id=KV, round_seq=round_seq))

    @precondition(lambda self: len(self.h.log) >= 6)
    @rule()
    def honest_close(self) -> None:
        self.feed(
            wire.Fetch(kv_request_id=KV, keys=(), block_indexes=(), round_seq=self._next_round())
        )

    # the peer, any which way
    @rule(keys=key_lists, round_seq=rounds, deadline_ms=st.just(wire.UNSET) | st.integers(0, 8000))
    def lookup(
        self, keys: tuple[bytes, ...], round_seq: int, deadline_ms: int | wire.UnsetType
    ) -> None:
        self.feed(
            wire.Lookup(kv_request_id=KV, keys=keys, round_seq=round_seq, deadline_ms=deadline_ms)
        )

    @rule(keys=key_lists, data=st.data(), round_seq=rounds)
    def fetch(self, keys: tuple[bytes, ...], data: st.DataObject, round_seq: int) -> None:
        blocks = data.draw(
            st.lists(st.integers(0, 100), min_size=len(keys), max_size=len(keys)).map(tuple)
        )
        self.feed(
            wire.Fetch(kv_request_id=KV, keys=keys, block_indexes=blocks, round_seq=round_seq)
        )

    @rule(round_seq=rounds)
    def abort(self, round_seq: int) -> None:
        self.feed(wire.AbortFetch(kv_request_id=KV, round_seq=round_seq))

    # the peer, over a quota
    @rule(
        keys=nonempty_keys,
        round_seq=rounds,
        honest=st.booleans(),
        quota=st.sampled_from(ev.Quota),
        admit=st.sampled_from([0, 0, 0, 1, 2, 7]),
    )
    def lookup_over_quota(
        self, keys: tuple[bytes, ...], round_seq: int, honest: bool, quota: ev.Quota, admit: int
    ) -> None:
        round_seq = self._next_round() if honest else round_seq
        msg = wire.Lookup(kv_request_id=KV, keys=keys, round_seq=round_seq)
        self.feed(inp.OverQuota(message=msg, quota=quota, reason="over quota", admit=admit))

    @rule(data=st.data(), quota=st.sampled_from(ev.Quota), honest=st.booleans())
    def fetch_over_quota(self, data: st.DataObject, quota: ev.Quota, honest: bool) -> None:
        rnd = self.h.state.rounds.get(self._next_round())
        candidates = sorted(rnd.supply) if rnd is not None and rnd.supply else KEYS
        keys = data.draw(st.lists(st.sampled_from(candidates), min_size=0, max_size=4).map(tuple))
        round_seq = self._next_round() if honest else data.draw(rounds)
        msg = wire.Fetch(
            kv_request_id=KV, keys=keys, block_indexes=tuple(range(len(keys))), round_seq=round_seq
        )
        self.feed(inp.OverQuota(message=msg, quota=quota, reason="over quota"))

    @rule(budget=st.none() | st.integers(0, 4))
    def pin_budget_changes(self, budget: int | None) -> None:
        assert isinstance(self.h.cache, BudgetedCache)
        self.h.cache.budget = budget

    # the engine
    @rule(keys=nonempty_keys, data=st.data())
    def store(self, keys: tuple[bytes, ...], data: st.DataObject) -> None:
        blocks = data.draw(
            st.lists(st.integers(0, 50), min_size=len(keys), max_size=len(keys)).map(tuple)
        )
        job = 10_000 + self.next_store
        self.next_store += 1
        self.feed(inp.AddStore(job_id=job, keys=keys, blocks=blocks))

    @precondition(lambda self: len(self.h.log) >= 6)
    @rule()
    def engine_finishes(self) -> None:
        self.feed(inp.Finish())

    # the data plane
    @precondition(lambda self: self.h.transfers)
    @rule(data=st.data(), ok=st.booleans())
    def transfer_ends(self, data: st.DataObject, ok: bool) -> None:
        tid = data.draw(st.sampled_from(sorted(self.h.transfers)))
        self.h.complete(tid, ok=ok, reason="" if ok else "injected failure")
        if self.h.log:
            assert fold(self.h.log) == self.h.state

    @rule(transfer_id=st.integers(0, 20), ok=st.booleans())
    def stray_transfer_result(self, transfer_id: int, ok: bool) -> None:
        if transfer_id not in self.h.transfers:
            self.feed(inp.TransferResult(transfer_id=transfer_id, ok=ok))

    @rule(seconds=jumps)
    def time_passes(self, seconds: float) -> None:
        self.h.advance(seconds)
        self.feed(inp.Tick())
        deadline = next_producer_deadline(self.h.state)
        assert deadline is None or deadline > self.h.now

    @precondition(lambda self: len(self.h.log) >= 6)
    @rule()
    def session_ends(self) -> None:
        self.feed(inp.SessionEnded("peer went away"))

    @invariant()
    def replay_equals_live_state(self) -> None:
        if self.h.log:
            assert fold(self.h.log) == self.h.state

    @invariant()
    def phase_only_moves_forward(self) -> None:
        rank = PRODUCER_PHASE_RANK[self.h.state.phase]
        assert rank >= self.max_rank
        self.max_rank = rank

    @invariant()
    def pins_and_contexts_settle_at_most_once(self) -> None:
        created = set(self.h.cache.pins) | {
            e.job_id for e in self.h.log if isinstance(e, ev.StoreAdded)
        }
        assert all(count == 1 for count in self.h.released.values())
        assert set(self.h.released) <= created
        held = set(self.h.state.jobs)
        assert not (held & set(self.h.released)), "a job is both held and released"
        closed = Counter(self.h.cache.closed)
        assert all(count == 1 for count in closed.values())
        assert set(closed) <= set(self.h.cache.opened)

    @invariant()
    def inflight_bookkeeping_agrees(self) -> None:
        # vLLM's "inflight per request" invariant, in our terms: every transfer
        # started and not ended, counted from the log, is in flight, counted by
        # its round and by the jobs it reads (held, serving it), and nothing else is.
        started: dict[int, ev.TransferStarted] = {}
        for e in self.h.log:
            if isinstance(e, ev.TransferStarted):
                started[e.transfer_id] = e
            elif isinstance(e, ev.TransferCompleted | ev.TransferFailed):
                del started[e.transfer_id]
        s = self.h.state
        assert set(s.transfers) == set(started) == set(self.h.transfers)
        assert s.writing() == {t.round_seq for t in started.values()}
        assert s.reading() == {j for t in started.values() for j in t.job_ids}
        for t in started.values():
            assert t.round_seq in s.rounds
            # A job a write reads serves its round (so it never expires under the write).
            assert all(t.round_seq in s.jobs[j].serving for j in t.job_ids)

    @invariant()
    def leases_renew_within_the_cap_and_only_silence_expires_them(self) -> None:
        # A renewal extends held pins to pin_timeout from then, never past the cap after the
        # request's first pin; a pin expires only once its lease ran out; and a lookup pin of a
        # round not fetched lives at least pin_timeout past the request's last lookup or fetch
        # admitted (a quota's refusal renews nothing).
        t = self.h.timings
        first: float | None = None
        until: dict[int, float] = {}
        alive = was_alive = -1.0
        for e in self.h.log:
            pin = e.pinned if isinstance(e, ev.LookupAnswered) else e
            if isinstance(pin, ev.Pinned | ev.KeysPinned | ev.StoreAdded):
                first = e.at if first is None else first
                until[pin.job_id] = pin.expires_at
            match e:
                case ev.LookupReceived() | ev.LookupLimited():
                    alive = e.at
                case ev.FetchReceived():
                    alive, was_alive = e.at, alive
                case ev.FetchRefused():  # a refusal renews nothing
                    alive = was_alive
                case ev.PinsRenewed():
                    assert first is not None
                    assert e.expires_at == min(e.at + t.pin_timeout, first + t.pin_lease_cap)
                    assert all(until[j] < e.expires_at for j in e.job_ids)
                    until.update(dict.fromkeys(e.job_ids, e.expires_at))
                case ev.PinReleased() if pin_expired(e):
                    assert e.at >= until[e.job_id], "a pin expired before its lease ran out"
                case _:
                    pass
        s = self.h.state
        for job in s.jobs.values():
            rnd = None if job.round_seq is None else s.rounds.get(job.round_seq)
            if job.round_seq is not None and (rnd is None or not rnd.fetched) and first:
                assert job.expires_at >= min(alive + t.pin_timeout, first + t.pin_lease_cap)

    @invariant()
    def one_answer_per_lookup(self) -> None:
        answered = Counter(e.lookup_id for e in self.h.log if isinstance(e, ev.LookupAnswered))
        assert all(count == 1 for count in answered.values())

    @invariant()
    def refusals_answer_miss_and_pin_nothing(self) -> None:
        # Keys refused by a quota (a whole lookup, the keys past a lookup's
        # admitted prefix, hits over the pin budget) are answered MISS and
        # never pinned; a refused fetch writes nothing and its round fails.
        never: dict[int, set[bytes]] = {}
        admitted: dict[int, int] = {}
        refused_rounds: set[int] = set()
        for e in self.h.log:
            match e:
                case ev.LookupLimited():
                    never[e.lookup_id] = set(e.keys[e.admitted :]) - set(e.keys[: e.admitted])
                    admitted[e.lookup_id] = e.admitted
                case ev.KeysRefused():
                    never.setdefault(e.lookup_id, set()).update(e.keys)
                case ev.KeysPinned():
                    assert not set(e.keys) & never.get(e.lookup_id, set())
                case ev.LookupAnswered():
                    for k, hit in zip(e.keys, e.hits, strict=True):
                        assert not (hit and k in never.get(e.lookup_id, set()))
                    # Every key past the admitted prefix, a repeat of an
                    # admitted one included, is a refused MISS.
                    prefix = admitted.get(e.lookup_id, len(e.keys))
                    assert not any(e.hits[prefix:])
                    if prefix < len(e.keys):
                        assert all(e.refused[prefix:])
                case ev.FetchRefused():
                    refused_rounds.add(e.round_seq)
                case ev.TransferStarted():
                    assert e.round_seq not in refused_rounds
                case ev.TransferDoneSent() if e.round_seq in refused_rounds:
                    assert not e.success
                case _:
                    pass
        for msg in self.h.sent:
            if isinstance(msg, wire.LookupResp) and msg.kv_request_id == KV:
                assert len(msg.keys) == len(msg.hits)

    def teardown(self) -> None:
        # End the session, let every write finish, lend the parent: the request
        # must end holding nothing, every pin and context settled exactly once.
        self.feed(inp.SessionEnded("teardown"))
        while self.h.transfers or self.h.parent_queue:
            self.h.serve()
            for tid in sorted(self.h.transfers):
                self.h.complete(tid)
        assert self.h.state.phase is ProducerPhase.CLOSED
        assert self.h.retired
        assert self.h.pinned_jobs() == set()
        assert sorted(self.h.cache.closed) == sorted(set(self.h.cache.opened))


TestConsumerMachine = ConsumerMachine.TestCase
TestConsumerMachine.settings = MACHINE_SETTINGS
TestProducerMachine = ProducerMachine.TestCase
TestProducerMachine.settings = MACHINE_SETTINGS
