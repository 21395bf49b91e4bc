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

from p2pactor.core import holdings as holdings_module
from p2pactor.core.holdings import Holdings, SummaryDelta, SummaryOptions
from p2pactor.core.sources import SourceIndex, fingerprint
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
    assert delta == SummaryDelta(E1, 1, tuple(fingerprint(key(i)) for i in (1, 2)), ())
    assert h.next_flush() is None
    assert h.flush(now=9.0) is None


def test_a_full_window_flushes_at_once() -> None:
    h = holdings(capacity=100, flush_keys=3)
    h.stored([key(1), key(2), key(3)], now=1.0)
    assert h.next_flush() == 1.0
    delta = h.flush(now=1.0)
    assert delta is not None
    assert len(delta.add) == 3


def test_a_key_stored_and_gone_within_one_window_is_never_sent() -> None:
    h = holdings()
    h.stored([key(1)], now=0.0)
    h.gone([key(1)], now=0.01)
    assert h.next_flush() is None
    assert h.flush(now=1.0) is None
    h.stored([key(2)], now=2.0)
    assert h.flush(now=3.0) == SummaryDelta(E1, 1, (fingerprint(key(2)),), ())
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
    assert (set(delta.add), set(delta.remove)) == (fps(3), fps(2))


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
    assert set(delta.remove) == fps(0, 1)
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
    assert [len(p.fps) for p in snap.parts] == [3, 3, 1]
    assert {p.upto_seq for p in snap.parts} == {1}
    assert {p.parts for p in snap.parts} == {3}
    assert set().union(*(p.fps for p in snap.parts)) == fps(*range(7))
    empty = holdings().snapshot(now=0.0)
    assert empty.delta is None
    assert [(p.part, p.parts, p.fps) for p in empty.parts] == [(0, 1, ())]


def test_a_drain_starts_a_new_epoch_with_nothing_held() -> None:
    h = holdings()
    h.stored([key(1)], now=0.0)
    h.flush(now=1.0)
    told = h.reset(E2, now=2.0)
    assert (len(h), h.epoch, h.seq) == (0, E2, 0)
    # Every peer hears of the new epoch at once, with nothing in it.
    assert told.delta is None
    assert [(p.epoch, p.upto_seq, p.fps) for p in told.parts] == [(E2, 0, ())]
    assert h.flush(now=2.0, force=True) is None


def test_the_scrub_checks_every_held_key_in_turn_and_skips_the_gone() -> None:
    h = holdings(capacity=10)
    h.stored([key(i) for i in range(5)], now=0.0)
    assert h.scrub(2) == [key(0), key(1)]
    h.gone([key(2)], now=0.0)
    assert h.scrub(2) == [key(3), key(4)]
    assert h.scrub(10) == [key(0), key(1), key(3), key(4)]  # the next turn


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
    assert first.add == tuple(fingerprint(key(i)) for i in range(3))
    assert h.next_flush() == 1.0 + 0.05  # the rest stays pending, its window kept
    second = h.flush(now=2.0)
    assert second is not None
    assert (second.seq, second.add) == (2, (fingerprint(key(3)), fingerprint(key(4))))
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

    def _deliver(self, delta: SummaryDelta | None, *, lost: bool) -> None:
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
        assert self.index.claims_of("node") == len(self._claimed())
        assert len(self.node) <= self.node.room <= 8
        if self.clean and self.node.next_flush() is None:
            assert self._claimed() == self._held()  # nothing unflushed: exact


TestSummaryMachine = SummaryMachine.TestCase
