"""Drive the pure core as the runtime would, without I/O: for tests only.

A harness holds one actor's state, feeds it inputs, keeps its event log and
performs its effects against in-memory doubles: a :class:`FakeCache` parent that
records every call, a list of sent messages, and a table of transfers the test
completes or fails by hand.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

import attrs

from p2pactor.core import effects as fx
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.consumer import ConsumerInput, ConsumerState, step_consumer
from p2pactor.core.fold import fold
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import ProducerInput, ProducerState, step_producer
from p2pactor.core.timings import DEFAULT_TIMINGS, Timings

PEER = "10.0.0.2:5710"
KV = "req-1"


def key(i: int, group: int = 0) -> bytes:
    """A 36-byte offload key: a 32-byte block hash and a 4-byte group index."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


@attrs.define
class FakeCache:
    """A parent cache double, in the shape of vLLM's FakeParent.

    ``stored`` keys are HIT (at their block), ``pending`` HIT_PENDING, ``retry``
    RETRY, anything else MISS. Pin jobs count up from 1000.
    """

    stored: dict[bytes, int] = attrs.field(factory=dict)
    pending: set[bytes] = attrs.field(factory=set)
    retry: set[bytes] = attrs.field(factory=set)
    calls: list[tuple[str, object]] = attrs.field(factory=list)
    next_job: int = 1000
    pins: dict[int, tuple[bytes, ...]] = attrs.field(factory=dict)
    opened: list[str] = attrs.field(factory=list)
    closed: list[str] = attrs.field(factory=list)

    def lookup(self, k: bytes) -> inp.LookupResult:
        self.calls.append(("lookup", k))
        if k in self.stored:
            return inp.LookupResult.HIT
        if k in self.pending:
            return inp.LookupResult.HIT_PENDING
        if k in self.retry:
            return inp.LookupResult.RETRY
        return inp.LookupResult.MISS

    def serve(self, req: fx.ParentLookup, now: float) -> inp.ParentAnswer:
        """Serve a parent lookup the way the runtime must: open, look up, pin."""
        if req.not_after is not None and now >= req.not_after:
            self.calls.append(("expired", req.context))
            return inp.ParentAnswer(lookup_id=req.lookup_id, expired=True)
        if req.open_context:
            self.calls.append(("on_new_request", req.context))
            self.opened.append(req.context)
        results = [(k, self.lookup(k)) for k in req.keys]
        hits = tuple(k for k, r in results if r is inp.LookupResult.HIT)
        pin = None
        if hits:
            job = self.next_job
            self.next_job += 1
            self.calls.append(("create_store_job", hits))
            self.pins[job] = hits
            pin = inp.Pin(job, hits, tuple(self.stored[k] for k in hits))
        return inp.ParentAnswer(lookup_id=req.lookup_id, results=results, pin=pin)

    def close(self, req: fx.ParentClose) -> None:
        self.calls.append(("on_request_finished", req.context))
        self.closed.append(req.context)


@attrs.define
class Harness:
    """Common bookkeeping of both roles' harnesses."""

    timings: Timings = DEFAULT_TIMINGS
    now: float = 0.0
    log: list[ev.AnyEvent] = attrs.field(factory=list)
    sent: list[wire.Message] = attrs.field(factory=list)
    released: Counter[int] = attrs.field(factory=Counter)
    release_success: dict[int, bool] = attrs.field(factory=dict)
    reported: Counter[int] = attrs.field(factory=Counter)
    report_success: dict[int, bool] = attrs.field(factory=dict)
    disconnects: list[str] = attrs.field(factory=list)
    retired: bool = False

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def sent_of(self, cls: type[wire.Message]) -> list[wire.Message]:
        return [m for m in self.sent if isinstance(m, cls)]

    def events_of(self, cls: type[ev.Event]) -> list[ev.Event]:
        return [e for e in self.log if isinstance(e, cls)]

    def kinds(self) -> list[str]:
        return [e.KIND for e in self.log]


@attrs.define
class ConsumerHarness(Harness):
    """A consumer actor, its log and its effects."""

    state: ConsumerState = attrs.field(
        factory=lambda: ConsumerState.new(ActorId(Role.CONSUMER, PEER, KV))
    )
    first_round: int = 0  # the round the session gives the request

    def feed(self, event_input: ConsumerInput) -> tuple[ev.ConsumerEvent, ...]:
        self.state, events = step_consumer(
            self.state, event_input, self.now, self.timings, first_round=self.first_round
        )
        self.log.extend(events)
        for event in events:
            for effect in fx.effects_of(event):
                self._perform(effect)
        assert fold(self.log) == self.state if self.log else True
        return events

    def _perform(self, effect: fx.Effect) -> None:
        match effect:
            case fx.Send(message):
                self.sent.append(message)
            case fx.ReportLoad(job_id=job, success=ok):
                self.reported[job] += 1
                self.report_success[job] = ok
            case fx.Retire():
                self.retired = True
            case fx.Disconnect(reason):
                self.disconnects.append(reason)
            case _:
                raise AssertionError(f"a consumer asked for {effect}")

    # the engine's calls
    def register(self, *keys: bytes) -> None:
        self.feed(inp.Register(keys))

    def flush(self) -> None:
        self.feed(inp.Flush())

    def load(self, job_id: int, keys: Iterable[bytes], blocks: Iterable[int]) -> None:
        self.feed(inp.SubmitLoad(job_id=job_id, keys=tuple(keys), block_indexes=tuple(blocks)))

    def finish(self) -> None:
        self.feed(inp.Finish())

    def tick(self) -> None:
        self.feed(inp.Tick())


@attrs.define
class ProducerHarness(Harness):
    """A producer actor, its log, its parent and its transfers."""

    cache: FakeCache = attrs.field(factory=FakeCache)
    state: ProducerState = attrs.field(
        factory=lambda: ProducerState.new(ActorId(Role.PRODUCER, PEER, KV))
    )
    parent_queue: deque[fx.ParentRequest] = attrs.field(factory=deque)
    transfers: dict[int, fx.StartTransfer] = attrs.field(factory=dict)
    auto_serve: bool = True

    def feed(self, event_input: ProducerInput) -> tuple[ev.ProducerEvent, ...]:
        self.state, events = step_producer(self.state, event_input, self.now, self.timings)
        self.log.extend(events)
        for event in events:
            for effect in fx.effects_of(event):
                self._perform(effect)
        if self.log:
            assert fold(self.log) == self.state
        if self.auto_serve:
            self.serve()
        return events

    def _perform(self, effect: fx.Effect) -> None:
        match effect:
            case fx.Send(message):
                self.sent.append(message)
            case fx.ParentLookup() | fx.ParentClose():
                self.parent_queue.append(effect)
            case fx.ReleasePin(job_id=job, success=ok):
                self.released[job] += 1
                self.release_success[job] = ok
            case fx.StartTransfer():
                assert effect.transfer_id not in self.transfers
                self.transfers[effect.transfer_id] = effect
            case fx.Retire():
                self.retired = True
            case fx.Disconnect(reason):
                self.disconnects.append(reason)
            case _:
                raise AssertionError(f"a producer asked for {effect}")

    def serve(self) -> None:
        """Lend the parent: serve every queued parent request, in order."""
        auto, self.auto_serve = self.auto_serve, False
        try:
            while self.parent_queue:
                req = self.parent_queue.popleft()
                if isinstance(req, fx.ParentClose):
                    self.cache.close(req)
                else:
                    self.feed(self.cache.serve(req, self.now))
        finally:
            self.auto_serve = auto

    # messages from the peer
    def lookup(self, *keys: bytes, round_seq: int = 0, deadline_ms: int | None = None) -> None:
        self.feed(
            wire.Lookup(
                kv_request_id=KV,
                keys=keys,
                round_seq=round_seq,
                deadline_ms=wire.UNSET if deadline_ms is None else deadline_ms,
            )
        )

    def fetch(self, keys: Iterable[bytes], idxs: Iterable[int], round_seq: int = 0) -> None:
        self.feed(
            wire.Fetch(
                kv_request_id=KV,
                keys=tuple(keys),
                block_indexes=tuple(idxs),
                round_seq=round_seq,
            )
        )

    def abort(self, round_seq: int = 0) -> None:
        self.feed(wire.AbortFetch(kv_request_id=KV, round_seq=round_seq))

    # the data plane
    def complete(self, transfer_id: int, *, ok: bool = True, reason: str = "") -> None:
        del self.transfers[transfer_id]
        self.feed(inp.TransferResult(transfer_id=transfer_id, ok=ok, reason=reason))

    def complete_all(self) -> None:
        for tid in sorted(self.transfers):
            self.complete(tid)

    def tick(self) -> None:
        self.feed(inp.Tick())

    # invariants
    def pinned_jobs(self) -> set[int]:
        """Jobs pinned by the parent or stored by the engine and not released."""
        created = set(self.cache.pins) | {
            e.job_id for e in self.log if isinstance(e, ev.StoreAdded)
        }
        return {j for j in created if self.released[j] == 0}

    def open_contexts(self) -> list[str]:
        return [c for c in self.cache.opened if c not in self.cache.closed]
