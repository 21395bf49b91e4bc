"""What a node holds and tells its peers (pure), and that a peer's index follows it.

Time is an argument. The machine at the end joins the two halves of issue 23's
summaries: a node's :class:`Holdings` as the sender, a peer's
:class:`SourceIndex` as the receiver, deltas that may be lost on the way, and
snapshots (in parts) that repair them.
"""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pactor.core.protocol_summaries import KvsumDelta, fingerprints, packed
from p2pactor.core.sources import SourceIndex, fingerprint
from p2pactor.core.sources import holdings as holdings_module
from p2pactor.core.sources.holdings import Holdings, SummaryOptions
from p2pactor.errors import ConfigError

E1, E2 = b"epoch-one-16byte", b"epoch-two-16byte"


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def fps(*ids: int) -> set[int]:
    return {fingerprint(key(i)) for i in ids}


def holdings(capacity: int = 4, **options: float) -> Holdings:
    return Holdings(capacity, epoch=E1, options=SummaryOptions(**options))  # type: ignore[arg-type]


def test_stores_are_flushed_as_one_delta_after_the_window() -> None:
    h = holdings(flush_s=0.05)
    assert h.next_flush() is None
    h.stored([key(1), key(2)], now=1.0)
    assert h.next_flush() == pytest.approx(1.05)
    assert h.flush(now=1.02) is None  # not due yet
    delta = h.flush(now=1.05)
    assert delta == KvsumDelta(
        epoch=E1, seq=1, add=packed([fingerprint(key(i)) for i in (1, 2)]), remove=b""
    )
    assert h.next_flush() is None
    assert h.flush(now=9.0) is None


def test_a_full_window_flushes_at_once() -> None:
    h = holdings(capacity=100, flush_keys=3)
    h.stored([key(1), key(2), key(3)], now=1.0)
    assert h.next_flush() == 1.0
    delta = h.flush(now=1.0)
    assert delta is not None
    assert len(fingerprints(delta.add)) == 3


def test_a_key_stored_and_gone_within_one_window_is_never_sent() -> None:
    h = holdings()
    h.stored([key(1)], now=0.0)
    h.gone([key(1)], now=0.01)
    assert h.next_flush() is None
    assert h.flush(now=1.0) is None
    h.stored([key(2)], now=2.0)
    assert h.flush(now=3.0) == KvsumDelta(
        epoch=E1, seq=1, add=packed([fingerprint(key(2))]), remove=b""
    )
    h.gone([key(2)], now=4.0)
    h.stored([key(2)], now=4.01)  # back where the peers last saw it
    assert h.flush(now=5.0) is None


def test_the_tier_s_capacity_evicts_the_least_recently_used() -> None:
    h = holdings(capacity=2)
    h.stored([key(1), key(2)], now=0.0)
    assert h.flush(now=1.0) is not None
    h.touched([key(1)])
    h.stored([key(3)], now=2.0)  # 2 is the oldest now
    assert key(2) not in h
    assert key(1) in h
    delta = h.flush(now=3.0)
    assert delta is not None
    assert (set(fingerprints(delta.add)), set(fingerprints(delta.remove))) == (fps(3), fps(2))


def test_loads_in_flight_take_room_and_give_it_back_when_they_end() -> None:
    h = holdings(capacity=4)
    h.stored([key(i) for i in range(4)], now=0.0)
    h.flush(now=0.0, force=True)
    # vLLM allocated 2 chunks for a load: the 2 least recently used went.
    h.reserve(2, now=1.0)
    assert h.room == 2
    assert [k for k in map(key, range(4)) if k in h] == [key(2), key(3)]
    delta = h.flush(now=1.0, force=True)
    assert delta is not None
    assert set(fingerprints(delta.remove)) == fps(0, 1)
    # The load ended: its room comes back, and its keys fill it.
    h.reserve(-2, now=2.0)
    h.stored([key(8), key(9)], now=2.0)
    assert len(h) == 4
    assert all(k in h for k in (key(2), key(3), key(8), key(9)))
    h.reserve(-5, now=3.0)  # more given back than taken: never more room than capacity
    assert h.room == 4
    h.reserve(9, now=4.0)  # more taken than there is: nothing held
    assert (h.room, len(h)) == (0, 0)


def test_a_snapshot_flushes_first_and_comes_in_bounded_parts() -> None:
    h = holdings(capacity=10, part_keys=3)
    h.stored([key(i) for i in range(7)], now=0.0)
    snap = h.snapshot(now=0.0)
    assert snap.delta is not None
    assert snap.delta.seq == 1
    assert [len(fingerprints(p.fps)) for p in snap.parts] == [3, 3, 1]
    assert {p.upto_seq for p in snap.parts} == {1}
    assert {p.parts for p in snap.parts} == {3}
    assert set().union(*(fingerprints(p.fps) for p in snap.parts)) == fps(*range(7))
    empty = holdings().snapshot(now=0.0)
    assert empty.delta is None
    assert [(p.part, p.parts, p.fps) for p in empty.parts] == [(0, 1, b"")]


def test_a_drain_starts_a_new_epoch_with_nothing_held() -> None:
    h = holdings()
    h.stored([key(1)], now=0.0)
    h.flush(now=1.0)
    told = h.reset(E2, now=2.0)
    assert (len(h), h.epoch, h.seq) == (0, E2, 0)
    # Every peer hears of the new epoch at once, with nothing in it.
    assert told.delta is None
    assert [(p.epoch, p.upto_seq, p.fps) for p in told.parts] == [(E2, 0, b"")]
    assert h.flush(now=2.0, force=True) is None


def test_the_scrub_asks_about_what_the_tier_would_lose_next_and_learns_from_the_answers() -> None:
    h = holdings(capacity=40)
    h.stored([key(i) for i in range(5)], now=0.0)
    assert h.churn == 5
    assert h.scrub(2) == [key(0), key(1)]
    assert h.churn == 0
    # The parent had lost 0 and still holds 1: 1 is not asked again for a while.
    h.gone([key(0)], now=0.0)
    h.kept([key(1)], now=0.0)
    assert h.scrub(3) == [key(2), key(3), key(4)]
    h.kept([key(2), key(3), key(4)], now=0.0)
    h.stored([key(5)], now=0.0)
    # Not asked again while the tier has not turned over: the others come first,
    # then, if the batch has room, the next to go, checked or not.
    assert h.scrub(1) == [key(5)]
    assert h.scrub(3) == [key(5), key(1), key(2)]
    # Once the tier turned over a quarter of its capacity (16 keys at least),
    # they come first again.
    h.stored([key(i) for i in range(100, 116)], now=1.0)
    assert h.scrub(3) == [key(1), key(2), key(3)]


def test_a_held_key_found_held_is_still_the_next_to_go() -> None:
    h = holdings(capacity=3)
    h.stored([key(1), key(2), key(3)], now=0.0)
    h.kept([key(1)], now=0.0)  # held: the parent needed no room yet
    h.stored([key(4)], now=1.0)
    assert (key(1) in h, key(2) in h) == (False, True)


def test_a_request_s_keys_rank_as_vllm_s_lru_ranks_them_tail_first() -> None:
    # vLLM 0.33's LRU: a request's chunks rank (request, -position) while it
    # runs, and afresh tail first when it finishes: a full tier evicts a
    # prompt's tail first and keeps its head.
    h = holdings(capacity=6)
    doc = [key(i) for i in range(4)]
    h.stored(doc, now=0.0, request="r1", positions=[16, 32, 48, 64])
    assert h.scrub(2) == [key(3), key(2)]  # the tail first, while it runs
    h.finished("r1")
    assert h.scrub(4) == [key(3), key(2), key(1), key(0)]
    h.stored([key(8), key(9), key(10)], now=1.0, request="r2", positions=[16, 32, 48])
    assert [k for k in doc if k in h] == [key(0), key(1), key(2)]  # r1's tail went
    h.finished("r2")
    h.stored([key(11), key(12)], now=2.0)  # no request: each the most recent
    assert [k for k in doc if k in h] == [key(0)]


def test_keys_dropped_for_room_are_checked_and_come_back_if_the_tier_kept_them() -> None:
    h = holdings(capacity=2)
    h.stored([key(1), key(2), key(3)], now=0.0)
    assert key(1) not in h
    batch = h.scrub(3)
    assert batch[0] == key(1)  # a suspect: dropped for room, perhaps still held
    h.kept([key(1)], now=1.0)  # it was: the tier evicted another (reused unseen)
    assert key(1) in h
    assert len(h) == 2
    assert key(2) not in h  # the lowest ranked left in its place: a suspect now
    assert h.scrub(3)[0] == key(2)
    h.gone([key(2)], now=1.0)  # answered: it is no suspect any more
    assert key(2) not in h.scrub(3)


def test_nonsense_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="capacity"):
        Holdings(0, epoch=E1)
    with pytest.raises(ConfigError, match=r"SummaryOptions\.flush_s"):
        SummaryOptions(flush_s=float("nan"))


def test_a_window_whose_changes_cancelled_out_starts_again_with_the_next_change() -> None:
    h = holdings(flush_s=0.05)
    h.stored([key(1)], now=0.0)
    h.gone([key(1)], now=0.01)
    h.stored([key(2)], now=10.0)
    assert h.next_flush() == pytest.approx(10.05)
    assert h.flush(now=10.01) is None


# --- sender and receiver ------------------------------------------------------------------

KEYS = st.lists(st.integers(0, 30), max_size=5)


def test_a_delta_carries_at_most_what_one_message_may(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(holdings_module, "MAX_DELTA_KEYS", 3)
    h = holdings(capacity=10, flush_keys=100, part_keys=2)
    h.stored([key(i) for i in range(5)], now=1.0)
    first = h.flush(now=1.0, force=True)
    assert first is not None
    assert fingerprints(first.add) == tuple(fingerprint(key(i)) for i in range(3))
    assert h.next_flush() == 1.0 + 0.05  # the rest stays pending, its window kept
    second = h.flush(now=2.0)
    assert second is not None
    assert (second.seq, fingerprints(second.add)) == (2, (fingerprint(key(3)), fingerprint(key(4))))
    assert h.flush(now=3.0, force=True) is None


def test_a_snapshot_part_fits_one_message() -> None:
    with pytest.raises(ConfigError, match="at most 65536 keys"):
        SummaryOptions(part_keys=65_537)
    assert SummaryOptions(part_keys=65_536).part_keys == 65_536


class SummaryMachine(RuleBasedStateMachine):
    """A node's holdings told to a peer's index over a lossy channel."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.epochs = 1
        options = SummaryOptions(flush_keys=4, part_keys=3)
        self.node = Holdings(8, epoch=self._epoch(), options=options)
        self.index = SourceIndex()
        self.index.add_peer("node", capacity=8)
        self.clean = False  # the index has seen everything since a whole snapshot

    def _epoch(self) -> bytes:
        return self.epochs.to_bytes(16, "big")

    def _deliver(self, delta: KvsumDelta | None, *, lost: bool) -> None:
        if delta is None:
            return
        if lost:
            self.clean = False
        else:
            self.index.delta("node", delta.epoch, delta.seq, delta.add, delta.remove)

    @rule(ids=KEYS)
    def store(self, ids: list[int]) -> None:
        self.node.stored([key(i) for i in ids], self.now)

    @rule(ids=KEYS)
    def touch(self, ids: list[int]) -> None:
        self.node.touched([key(i) for i in ids])

    @rule(ids=KEYS)
    def gone(self, ids: list[int]) -> None:
        self.node.gone([key(i) for i in ids], self.now)

    @rule(ids=KEYS, request=st.sampled_from(["r1", "r2"]), data=st.data())
    def store_for_a_request(self, ids: list[int], request: str, data: st.DataObject) -> None:
        positions = [data.draw(st.integers(1, 40)) for _ in ids]
        self.node.stored([key(i) for i in ids], self.now, request=request, positions=positions)

    @rule(request=st.sampled_from(["r1", "r2"]))
    def request_finishes(self, request: str) -> None:
        self.node.finished(request)

    @rule(most=st.integers(0, 6), data=st.data())
    def scrub(self, most: int, data: st.DataObject) -> None:
        batch = self.node.scrub(most)
        assert len(batch) <= max(most, 1)
        assert len(set(batch)) == len(batch)
        kept = [k for k in batch if data.draw(st.booleans())]
        self.node.kept(kept, self.now)
        self.node.gone([k for k in batch if k not in kept], self.now)

    @rule(blocks=st.integers(-8, 8))
    def loads_take_or_give_back(self, blocks: int) -> None:
        self.node.reserve(blocks, self.now)

    @rule(seconds=st.floats(0.0, 0.2), lost=st.booleans())
    def time_passes(self, seconds: float, lost: bool) -> None:
        self.now += seconds
        due = self.node.next_flush()
        if due is not None and due <= self.now:
            delta = self.node.flush(self.now)
            assert delta is not None
            self._deliver(delta, lost=lost)

    @rule()
    def resync(self) -> None:
        snap = self.node.snapshot(self.now)
        self._deliver(snap.delta, lost=False)
        for part in reversed(snap.parts):  # any order: only the whole counts
            self.index.snapshot(
                "node", part.epoch, part.upto_seq, part=part.part, parts=part.parts, fps=part.fps
            )
        self.clean = True

    @rule()
    def drain(self) -> None:
        self.epochs += 1
        told = self.node.reset(self._epoch(), self.now)
        for part in told.parts:  # every peer is told the new, empty epoch at once
            self.index.snapshot(
                "node", part.epoch, part.upto_seq, part=part.part, parts=part.parts, fps=part.fps
            )
        self.clean = True

    def _claimed(self) -> set[int]:
        return {fp for fp in map(fingerprint, map(key, range(31))) if self.index.claimed_by(fp)}

    def _held(self) -> set[int]:
        return {fingerprint(key(i)) for i in range(31) if key(i) in self.node}

    @rule()
    def flush_now(self) -> None:
        # What the timer does at once: afterwards, a repaired index is exact.
        self._deliver(self.node.flush(self.now, force=True), lost=False)
        if self.clean:
            assert self._claimed() == self._held()

    @invariant()
    def the_index_claims_at_most_what_it_may(self) -> None:
        assert len(self.index.peer("node").claims) == len(self._claimed())
        assert len(self.node) <= self.node.room <= 8
        if self.clean and self.node.next_flush() is None:
            assert self._claimed() == self._held()  # nothing unflushed: exact


TestSummaryMachine = SummaryMachine.TestCase
