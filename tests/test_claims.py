"""The source index's packed parts: exact claims (ClaimSet) and the filter (ClaimFilter).

Each against a model of Python sets: the claims must say exactly what the
model says; the filter may say "maybe" to a fingerprint it was never given,
but never "no" to one it was, through adds, slices of rebuilds, growth and
columns reused. And the choice the index makes over them is the exact one.
"""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pactor.core.protocol_summaries import packed
from p2pactor.core.sources import SourceIndex
from p2pactor.core.sources import filter as claimfilter
from p2pactor.core.sources.claims import ClaimSet, Compaction, as_fps, unique
from p2pactor.core.sources.filter import ClaimFilter

# Low and high fingerprints (the top bit set too), few enough to collide often.
POOL = [*range(40), *((1 << 64) - 1 - i for i in range(20)), *(1 << 63 | i for i in range(20))]
FPS = st.lists(st.sampled_from(POOL), max_size=12)


def test_fingerprints_come_packed_or_as_ints_and_the_rest_is_never_converted() -> None:
    fps = [0, 1, (1 << 64) - 1, 1 << 63]
    assert as_fps(packed(fps)).tolist() == fps
    assert as_fps(fps).tolist() == fps
    assert as_fps(packed(fps), most=2).tolist() == fps[:2]
    assert as_fps(np.array(fps, np.uint64), most=3).tolist() == fps[:3]
    assert as_fps(b"").tolist() == []


class ClaimSetMachine(RuleBasedStateMachine):
    """A ClaimSet against a set, with compactions run a slice at a time between changes."""

    def __init__(self) -> None:
        super().__init__()
        self.claims = ClaimSet()
        self.model: set[int] = set()
        self.compaction: Compaction | None = None

    @rule(fps=FPS, room=st.integers(0, 12))
    def add(self, fps: list[int], room: int) -> None:
        new, refused = self.claims.add(as_fps(fps), room)
        fresh = sorted(set(fps) - self.model)
        assert new.tolist() == fresh[:room]  # the lowest new ones fit
        assert refused == max(0, len(fresh) - room)
        self.model |= set(fresh[:room])

    @rule(fps=FPS)
    def remove(self, fps: list[int]) -> None:
        gone = self.claims.remove(as_fps(fps))
        assert gone == len(self.model & set(fps))
        self.model -= set(fps)

    @rule()
    def start_a_compaction(self) -> None:
        if self.compaction is None:
            self.compaction = Compaction(self.claims)

    @rule(most=st.integers(1, 8))
    def compact_a_slice(self, most: int) -> None:
        if self.compaction is not None and self.compaction.step(most):
            self.compaction = None

    @rule(most=st.integers(0, 30))
    def truncate(self, most: int) -> None:
        self.claims.truncate(most)
        self.model = set(sorted(self.model)[:most])

    @rule(fps=st.lists(st.sampled_from(POOL), max_size=40))
    def replace(self, fps: list[int]) -> None:
        self.claims = ClaimSet(unique(as_fps(packed(fps))))
        self.model = set(fps)
        self.compaction = None

    @invariant()
    def it_says_what_the_model_says(self) -> None:
        assert len(self.claims) == len(self.model)
        assert self.claims.array().tolist() == sorted(self.model)
        assert set(self.claims.superset().tolist()) >= self.model
        assert all((fp in self.claims) == (fp in self.model) for fp in POOL)
        mask = self.claims.mask(as_fps(POOL))
        assert mask.tolist() == [fp in self.model for fp in POOL]
        assert -1 not in self.claims
        assert 1 << 64 not in self.claims
        assert "0" not in self.claims


TestClaimSet = ClaimSetMachine.TestCase


class FilterMachine(RuleBasedStateMachine):
    """A ClaimFilter's columns against sets: a superset always, whatever is done to them."""

    def __init__(self) -> None:
        super().__init__()
        self.filter = ClaimFilter()
        self.model: dict[int, set[int]] = {}
        self.rng = random.Random(0)

    def _fresh(self, n: int) -> list[int]:
        return [self.rng.getrandbits(64) for _ in range(n)]

    @rule()
    def open(self) -> None:
        column = self.filter.open()
        assert column not in self.model
        assert self.filter.load(column) == 0
        self.model[column] = set()

    @rule(data=st.data(), n=st.integers(0, 3000))
    def add(self, data: st.DataObject, n: int) -> None:
        if self.model:
            column = data.draw(st.sampled_from(sorted(self.model)))
            fps = self._fresh(n)
            self.filter.add(column, as_fps(fps))
            self.model[column] |= set(fps)

    @rule(data=st.data(), keep=st.floats(0, 1), most=st.integers(1, 5000))
    def rebuild_a_slice(self, data: st.DataObject, keep: float, most: int) -> None:
        # The peer dropped some claims; its column is rebuilt from the rest,
        # a slice at a time, with adds between the slices.
        if self.model:
            column = data.draw(st.sampled_from(sorted(self.model)))
            held = sorted(self.model[column])
            kept = set(held[: int(len(held) * keep)])
            self.model[column] = kept
            self.filter.rebuild(column, lambda: as_fps(sorted(kept)), most)

    @rule(data=st.data())
    def close(self, data: st.DataObject) -> None:
        if self.model:
            column = data.draw(st.sampled_from(sorted(self.model)))
            self.filter.close(column)
            del self.model[column]

    @invariant()
    def no_column_misses_a_key_it_was_given(self) -> None:
        for column, held in self.model.items():
            sample = sorted(held)[:200]
            for fp in sample[:20]:
                assert column in self.filter.holders(fp)
            if sample:
                columns, runs = self.filter.runs(as_fps(sample))
                assert column in columns.tolist()
                assert runs[columns.tolist().index(column)] == len(sample)


TestClaimFilter = FilterMachine.TestCase
TestClaimFilter.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)


def test_the_filter_grows_with_its_columns_and_keeps_every_key() -> None:
    filt = ClaimFilter()
    rng = np.random.default_rng(1)
    columns = [filt.open() for _ in range(3)]
    held = [rng.integers(0, 2**63, 20_000, dtype=np.uint64) * np.uint64(2) for _ in columns]
    for column, fps in zip(columns, held, strict=True):
        filt.add(column, fps)
    assert filt.words >= 20_000 // claimfilter.KEYS_PER_WORD  # it grew from MIN_WORDS
    for column, fps in zip(columns, held, strict=True):
        got, runs = filt.runs(fps[:128])
        assert column in got.tolist()
        assert runs[got.tolist().index(column)] == 128
    many = [filt.open() for _ in range(20)]  # past MIN_COLUMNS: the table widens
    assert len(set(many) | set(columns)) == 23
    for column, fps in zip(columns, held, strict=True):
        assert all(column in filt.holders(int(fp)) for fp in fps[:50])


def test_the_filter_says_maybe_to_under_one_percent_of_keys_it_never_had() -> None:
    # The rate docs/sources.md quotes: a column holding its share of a full
    # table (three keys a word), probed with 200,000 keys it never had.
    filt = ClaimFilter()
    rng = np.random.default_rng(2)
    columns = [filt.open() for _ in range(8)]
    held = [rng.integers(0, 2**64 - 1, 50_000, dtype=np.uint64) for _ in columns]
    for column, fps in zip(columns, held, strict=True):
        filt.add(column, fps)
    # The first columns were filled in a smaller table: due for a rebuild,
    # which the index does a slice with each of their peer's deltas.
    for column, fps in zip(columns, held, strict=True):
        while filt.due(column, len(fps)):
            filt.rebuild(column, lambda fps=fps: fps, 8192)
    loaded = 8 * 50_000 / (filt.words * 8)
    assert 1.5 <= loaded <= claimfilter.KEYS_PER_WORD
    strangers = rng.integers(0, 2**64 - 1, 200_000, dtype=np.uint64)
    rows, patterns = filt.locate(strangers)
    words = filt._table[rows][:, columns]
    maybe = (words & patterns[:, None]) == patterns[:, None]
    assert maybe.mean() < 0.01


@settings(max_examples=60, deadline=None)
@given(
    held=st.lists(st.sets(st.integers(0, 30), max_size=25), min_size=1, max_size=6),
    wanted=st.lists(st.integers(0, 30), min_size=1, max_size=20),
)
def test_the_choice_is_the_exact_one_whatever_the_filter_says(
    held: list[set[int]], wanted: list[int]
) -> None:
    index = SourceIndex()
    exact = {}
    for i, fps in enumerate(held):
        peer = f"p{i}"
        index.add_peer(peer, capacity=100)
        index.snapshot(peer, b"e", 0, part=0, parts=1, fps=sorted(fps))
        run = 0
        while run < len(wanted) and wanted[run] in fps:
            run += 1
        exact[peer] = run
    choice = index.choose(wanted, 0.0)
    best = max(exact.values())
    if best == 0:
        assert choice.chosen is None
        assert choice.claims == ()
        return
    top = choice.claims[0]
    assert top.run == best
    assert exact[top.peer] == best
    assert all(c.run >= exact[c.peer] for c in choice.claims)  # the others: at least their run
    assert {c.peer for c in choice.claims} >= {p for p, r in exact.items() if r}
