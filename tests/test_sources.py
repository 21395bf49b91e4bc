"""The source index: peers' summaries folded into one index, and the choice of a source (pure).

Time is an argument. The reducer tests pin each rule; the state machine plays
senders whose deltas may be lost and whose snapshots arrive in parts with
deltas between them, and checks that the index always agrees with itself and,
once a snapshot has repaired every loss, with what each sender holds.
"""

from __future__ import annotations

import random
import tracemalloc

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from p2pactor.core.choice import ChoicePolicy
from p2pactor.core.sources import BYTES_PER_CLAIM, SLICE_FPS, SourceIndex, fingerprint
from p2pactor.core.sources.peer import Resync
from p2pactor.core.work_budget import WorkBudget
from p2pactor.errors import ConfigError

E1, E2 = b"epoch-one-16byte", b"epoch-two-16byte"


def synced(index: SourceIndex, peer: str, fps: list[int], *, epoch: bytes = E1) -> Resync | None:
    return index.snapshot(peer, epoch, 0, part=0, parts=1, fps=fps)


def an_index(**policy: float) -> SourceIndex:
    return SourceIndex(ChoicePolicy(**policy))  # type: ignore[arg-type]


# --- fingerprints -------------------------------------------------------------------------


def test_the_fingerprint_is_the_hash_low_64_bits_in_group_0_and_mixed_in_others() -> None:
    block_hash = bytes(range(32))
    key0 = block_hash + (0).to_bytes(4, "big")
    key1 = block_hash + (1).to_bytes(4, "big")
    assert fingerprint(key0) == int.from_bytes(block_hash[-8:], "big")
    assert fingerprint(key1) != fingerprint(key0)
    assert 0 <= fingerprint(key1) < 2**64
    assert fingerprint(b"short") == fingerprint(b"\0short") != fingerprint(b"shorT")


# --- summaries ----------------------------------------------------------------------------


def test_a_new_peer_is_asked_for_a_snapshot_and_its_claims_count_once_whole() -> None:
    index = SourceIndex()
    assert index.add_peer("b", capacity=100) == Resync("b", b"", 0)
    index.snapshot("b", E1, 5, part=1, parts=2, fps=[3, 4])
    assert len(index.peer("b").claims) == 0  # half a snapshot claims nothing yet
    index.snapshot("b", E1, 5, part=0, parts=2, fps=[1, 2])
    assert len(index.peer("b").claims) == 4
    assert index.position("b") == (E1, 5, True)
    assert index.claimed_by(3) == {"b"}


def test_deltas_in_sequence_add_and_remove_and_a_gap_asks_for_a_snapshot_once() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=100)
    synced(index, "b", [1, 2])
    assert index.delta("b", E1, 1, add=[3], remove=[1]) is None
    assert index.claimed_by(1) == frozenset()
    assert index.claimed_by(3) == {"b"}
    # Delta 2 was lost: 3 shows the gap, and 4 does not ask again.
    assert index.delta("b", E1, 3, add=[9], remove=[]) == Resync("b", E1, 2)
    assert index.delta("b", E1, 4, add=[10], remove=[]) is None
    assert index.claimed_by(9) == frozenset()
    # The snapshot at 4 repairs it; delta 5, sent while its parts were on the way, applies after.
    index.snapshot("b", E1, 4, part=0, parts=2, fps=[2, 3])
    assert index.delta("b", E1, 5, add=[11], remove=[2]) is None
    index.snapshot("b", E1, 4, part=1, parts=2, fps=[9, 10])
    assert {fp for fp in range(12) if index.claimed_by(fp)} == {3, 9, 10, 11}
    assert index.position("b") == (E1, 5, True)


def test_a_restarted_peer_s_new_epoch_replaces_its_summary_whole() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=100)
    synced(index, "b", [1, 2, 3])
    assert index.delta("b", E2, 1, add=[7], remove=[]) == Resync("b", E2, 0)
    assert len(index) == 0  # nothing of the old life is claimed any more
    synced(index, "b", [7, 8], epoch=E2)
    assert index.claimed_by(7) == {"b"}
    assert index.claimed_by(1) == frozenset()


def test_a_peer_claims_no_more_keys_than_it_registered_blocks() -> None:
    index = SourceIndex()
    index.add_peer("liar", capacity=3)
    assert synced(index, "liar", list(range(10))) is None
    assert len(index.peer("liar").claims) == 3  # a snapshot over its capacity is cut back to it
    assert index.peer("liar").strikes == 1
    assert all(index.claimed_by(fp) == {"liar"} for fp in range(10) if index.claimed(fp))
    synced(index, "liar", [1, 2])
    assert index.delta("liar", E1, 1, add=[50, 51, 52], remove=[]) is None
    assert len(index.peer("liar").claims) == 3  # what fits of the delta
    assert index.peer("liar").strikes == 2


def test_what_a_peer_sends_stays_within_what_it_registered() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=4)
    index.snapshot("b", E1, 0, part=0, parts=2**62, fps=[1])  # could never complete
    assert index.peer("b").strikes == 1
    index.snapshot("b", E1, 0, part=0, parts=2, fps=[1])
    resyncs = [index.delta("b", E1, seq, add=[seq], remove=[]) for seq in range(1, 400)]
    # Past MAX_BUFFERED_DELTAS the half snapshot is given up, and asked for again.
    assert Resync("b", E1, 0) in resyncs
    index.snapshot("b", E1, 0, part=1, parts=2, fps=[2])
    assert len(index.peer("b").claims) == 0  # its first part was given up: not whole


def test_of_two_snapshots_in_flight_the_newer_is_assembled_and_older_parts_are_dropped() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    index.snapshot("b", E1, 5, part=0, parts=2, fps=[1])
    index.snapshot("b", E1, 6, part=0, parts=2, fps=[3])
    index.snapshot("b", E1, 5, part=1, parts=2, fps=[2])
    assert index.position("b") == (E1, 0, False)
    index.snapshot("b", E1, 6, part=1, parts=2, fps=[4])
    assert index.position("b") == (E1, 6, True)
    assert {fp for fp in range(6) if index.claimed_by(fp)} == {3, 4}
    index.snapshot("b", E1, 5, part=0, parts=1, fps=[9])  # stale: deltas are past it
    assert index.position("b") == (E1, 6, True)
    assert index.claimed_by(9) == frozenset()


def test_a_snapshot_completes_though_deltas_overtake_it_while_its_parts_arrive() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=2)
    synced(index, "b", [1])
    index.delta("b", E1, 1, add=[2, 3], remove=[])  # one more than fits: truncated
    index.delta("b", E1, 2, add=[], remove=[1])
    assert len(index.peer("b").claims) == 1  # only a snapshot can repair it
    # The snapshot as of 2, and delta 3 between its parts (applied at once).
    index.snapshot("b", E1, 2, part=0, parts=2, fps=[2])
    assert index.delta("b", E1, 3, add=[], remove=[]) is None
    assert index.position("b") == (E1, 3, True)
    index.snapshot("b", E1, 2, part=1, parts=2, fps=[3])
    assert index.position("b") == (E1, 3, True)
    assert {fp for fp in range(5) if index.claimed_by(fp)} == {2, 3}


def test_a_part_count_that_changes_starts_the_snapshot_again() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    index.snapshot("b", E1, 1, part=0, parts=3, fps=[1])
    index.snapshot("b", E1, 1, part=1, parts=2, fps=[2])
    assert index.position("b") == (E1, 0, False)
    index.snapshot("b", E1, 1, part=0, parts=2, fps=[3])
    assert {fp for fp in range(4) if index.claimed_by(fp)} == {2, 3}


def test_a_delta_lost_during_a_snapshot_asks_for_a_resync_when_it_completes() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    index.snapshot("b", E1, 4, part=0, parts=2, fps=[1])
    index.delta("b", E1, 6, add=[6], remove=[])  # 5 was lost
    assert index.snapshot("b", E1, 4, part=1, parts=2, fps=[2]) == Resync("b", E1, 5)
    assert index.position("b") == (E1, 4, True)


def test_a_lasting_gap_asks_again_and_a_flipping_epoch_asks_once() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    synced(index, "b", [1])
    asked = [index.delta("b", E1, seq, add=[], remove=[]) for seq in range(2, 200)]
    assert sum(r is not None for r in asked) == 1 + (198 - 1) // 64  # at the gap, then every 64
    flips = [index.delta("b", (E1, E2)[i % 2], 1, add=[], remove=[]) for i in range(10)]
    assert sum(r is not None for r in flips) <= 1


def test_a_new_epoch_on_every_message_asks_one_resync() -> None:
    # A hostile peer alternates deltas and snapshot parts, each of a new epoch:
    # the parts used to clear the asked resync, so each delta asked another.
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    synced(index, "b", [1])
    asked = []
    for i in range(1500):
        asked.append(index.delta("b", b"d%015d" % i, 1, add=[2], remove=[]))
        asked.append(index.snapshot("b", b"s%015d" % i, 0, part=0, parts=2, fps=[3]))
    assert sum(r is not None for r in asked) == 1
    assert len(index.peer("b").claims) == 0  # each new epoch dropped the old summary whole
    # Once a snapshot arrives whole, the next new epoch asks again.
    assert index.snapshot("b", b"whole-epoch-16by", 0, part=0, parts=1, fps=[4]) is None
    assert index.delta("b", b"later-epoch-16by", 1, add=[], remove=[]) is not None


def test_a_miss_for_a_claimed_key_removes_the_claim_at_once() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    index.add_peer("c", capacity=10)
    synced(index, "b", [1, 2])
    synced(index, "c", [1])
    index.missed("b", [1, 99])
    assert index.claimed_by(1) == {"c"}
    assert index.claimed_by(2) == {"b"}


def test_a_peer_that_leaves_takes_its_claims_and_messages_without_a_session_are_dropped() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    synced(index, "b", [1, 2])
    index.remove_peer("b")
    assert len(index) == 0
    assert index.delta("b", E1, 1, add=[3], remove=[]) is None
    synced(index, "b", [4])
    assert len(index) == 0
    assert index.peers == ()


# --- choosing -----------------------------------------------------------------------------


def test_no_claim_on_the_first_key_is_a_miss_at_once() -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=10)
    synced(index, "b", [2, 3])
    choice = index.choose([1, 2, 3], now=0.0)
    assert choice.chosen is None
    assert choice.claims == ()
    assert index.choose([], now=0.0).chosen is None


def test_the_longest_claimed_run_from_the_first_key_wins_and_is_asked_with_a_tail() -> None:
    index = SourceIndex(ChoicePolicy(tail_keys=2))
    for peer, fps in (("b", [1, 2]), ("c", [1, 2, 3, 4, 9]), ("d", [2, 3, 4, 5])):
        index.add_peer(peer, capacity=10)
        synced(index, peer, fps)
    choice = index.choose([1, 2, 3, 4, 5, 6, 7, 8, 9], now=0.0)
    assert choice.chosen == "c"
    assert choice.keys == 6  # its run of 4, and 2 it may have stored since
    assert [(c.peer, c.run) for c in choice.claims] == [("c", 4), ("b", 2)]
    assert "4 of 9" in choice.reason


def test_a_run_too_short_to_pay_for_the_round_trip_is_not_probed() -> None:
    # 1 key of 16 tokens at 10 us a token saves 0.16 ms; the round trip costs 3 ms.
    index = an_index(tokens_per_key=16, prefill_s_per_token=10e-6, round_trip_s=0.003)
    index.add_peer("b", capacity=10)
    synced(index, "b", [1])
    choice = index.choose([1, 2], now=0.0)
    assert choice.chosen is None
    assert [c.peer for c in choice.claims] == ["b"]
    assert choice.claims[0].score < 0
    assert "worth" in choice.reason


def test_probes_in_flight_weigh_on_a_peer_and_are_bounded() -> None:
    index = an_index(load_s=1.0, max_probes_per_peer=2)
    for peer in ("b", "c"):
        index.add_peer(peer, capacity=10)
    synced(index, "b", [1, 2, 3])
    synced(index, "c", [1, 2])
    assert index.choose([1, 2, 3], now=0.0).chosen == "b"
    index.probe_started("b")
    assert index.choose([1, 2, 3], now=0.0).chosen == "c"  # b's load outweighs its longer run
    index.probe_started("b")
    assert [c.peer for c in index.choose([1, 2, 3], now=0.0).claims] == ["c"]  # b at its bound
    index.probe_ended("b", claimed=3, hits=3, now=0.0)
    assert "b" in [c.peer for c in index.choose([1, 2, 3], now=0.0).claims]


def test_a_peer_whose_claims_keep_missing_is_quarantined_with_a_growing_back_off() -> None:
    index = an_index(
        min_probed_keys=20, quarantine_s=10.0, max_quarantine_s=25.0, precision_weight=0.05
    )
    index.add_peer("liar", capacity=100)
    index.add_peer("honest", capacity=100)
    synced(index, "liar", list(range(8)))
    synced(index, "honest", [0, 1])

    def lie(now: float) -> None:
        for _ in range(3):
            index.probe_started("liar")
            index.probe_ended("liar", claimed=8, hits=0, now=now)

    lie(now=0.0)
    assert index.quarantined("liar", now=0.0)
    assert index.choose(list(range(8)), now=5.0).chosen == "honest"
    assert not index.quarantined("liar", now=10.0)
    assert index.choose(list(range(8)), now=10.0).chosen == "liar"  # a second chance
    lie(now=10.0)
    assert index.quarantined("liar", now=29.9)  # twice as long: 20 s
    assert not index.quarantined("liar", now=30.0)
    lie(now=30.0)
    assert index.quarantined("liar", now=54.9)  # 40 s, capped at 25
    assert not index.quarantined("liar", now=55.0)
    assert not index.quarantined("honest", now=0.0)


def test_by_default_a_burst_of_stale_claims_is_forgiven_and_a_liar_is_not() -> None:
    index = an_index()  # the defaults: 100 keys probed, precision under 0.5
    for peer in ("honest", "liar"):
        index.add_peer(peer, capacity=1000)
        synced(index, peer, list(range(64)))
    # An honest peer evicted a whole conversation before its delta went out:
    # one lookup of 40 claimed keys all missed, amid lookups that held.
    for hits in (40, 40, 0, 40, 40):
        index.probe_started("honest")
        index.probe_ended("honest", claimed=40, hits=hits, now=0.0)
    assert not index.quarantined("honest", now=0.0)
    # A liar misses every time: a few lookups of long runs quarantine it.
    probes = 0
    while not index.quarantined("liar", now=0.0):
        index.probe_started("liar")
        index.probe_ended("liar", claimed=64, hits=0, now=0.0)
        probes += 1
    assert probes <= 3


def test_a_key_only_a_quarantined_peer_claims_is_unclaimed_until_the_quarantine_ends() -> None:
    index = an_index(min_probed_keys=8, quarantine_s=10.0, precision_weight=0.05)
    index.add_peer("liar", capacity=100)
    index.add_peer("honest", capacity=100)
    synced(index, "liar", list(range(8)))
    synced(index, "honest", [0])
    assert index.next_release() is None
    for _ in range(3):
        index.probe_started("liar")
        index.probe_ended("liar", claimed=8, hits=0, now=1.0)
    assert index.quarantined("liar", now=1.0)
    assert index.next_release() == 11.0
    # The engine's check: a MISS at once for what only the liar claims.
    assert not index.claimed(5)
    assert index.claimed(0)  # the honest peer claims it too
    assert index.claimed_by(5) == {"liar"}  # its claims are kept, for after
    index.release(now=10.9)
    assert not index.claimed(5)
    index.release(now=11.0)
    assert index.claimed(5)
    assert index.next_release() is None
    index.remove_peer("liar")
    assert not index.claimed(5)


def test_a_burst_of_failed_probes_is_one_quarantine_and_the_back_off_never_overflows() -> None:
    index = an_index(
        min_probed_keys=8, quarantine_s=1.0, max_quarantine_s=10.0, precision_weight=0.05
    )
    index.add_peer("liar", capacity=100)
    synced(index, "liar", list(range(8)))
    for _ in range(32):
        index.probe_started("liar")
    for _ in range(32):
        index.probe_ended("liar", claimed=8, hits=0, now=0.0)
    assert index.quarantined("liar", now=0.99)
    assert not index.quarantined("liar", now=1.0)  # one quarantine of 1 s, not 32 doubling
    now = 1.0
    for _ in range(2000):
        index.probe_ended("liar", claimed=8, hits=-3, now=now)
        now += 11.0
    assert index.quarantined("liar", now=now - 11.0 + 9.9)
    assert index.precision("liar") == 1.0  # it starts over after each


def test_an_honest_peer_s_precision_stays_high_and_a_few_misses_do_not_quarantine() -> None:
    index = an_index(min_probed_keys=10)
    index.add_peer("b", capacity=100)
    synced(index, "b", list(range(16)))
    for i in range(50):
        index.probe_started("b")
        index.probe_ended("b", claimed=16, hits=16 if i % 10 else 12, now=float(i))
    assert index.precision("b") > 0.9
    assert not index.quarantined("b", now=50.0)


def test_the_policy_refuses_nonsense_with_the_field_named() -> None:
    with pytest.raises(ConfigError, match=r"ChoicePolicy\.min_precision"):
        ChoicePolicy(min_precision=1.5)
    with pytest.raises(ConfigError, match=r"ChoicePolicy\.tokens_per_key"):
        ChoicePolicy(tokens_per_key=0)


# --- the machine --------------------------------------------------------------------------

PEERS = ("b", "c")
CAPACITY = 12
FPS = st.lists(st.integers(0, 40), max_size=6)


class Sender:
    """What one peer holds and has said about it."""

    def __init__(self, epoch: bytes) -> None:
        self.epoch = epoch
        self.held: set[int] = set()
        self.seq = 0
        self.clean = False  # everything since the last whole snapshot arrived

    def change(self, add: list[int], remove: list[int]) -> tuple[int, list[int], list[int]]:
        self.seq += 1
        self.held -= set(remove)
        self.held |= set(add)
        if len(self.held) > CAPACITY:
            self.clean = False  # the index truncates: only a snapshot after it can agree
        return self.seq, add, remove


class SourceMachine(RuleBasedStateMachine):
    """Senders with lossy deltas and paced snapshots against one index."""

    def __init__(self) -> None:
        super().__init__()
        self.index = self.make_index()
        self.senders: dict[str, Sender] = {}
        self.last: dict[str, tuple[bytes, int, int, list[int]]] = {}
        self.epochs = 0
        for peer in PEERS:
            self._restart(peer)

    def make_index(self) -> SourceIndex:
        return SourceIndex()

    def _restart(self, peer: str) -> None:
        self.epochs += 1
        self.senders[peer] = Sender(self.epochs.to_bytes(16, "big"))
        self.index.add_peer(peer, capacity=CAPACITY)

    def _send_delta(self, peer: str, add: list[int], remove: list[int], lost: bool) -> None:
        sender = self.senders[peer]
        seq, add, remove = sender.change(add, remove)
        if lost:
            sender.clean = False
        else:
            self.index.delta(peer, sender.epoch, seq, add, remove)

    @rule(peer=st.sampled_from(PEERS), add=FPS, remove=FPS, lost=st.booleans())
    def delta(self, peer: str, add: list[int], remove: list[int], lost: bool) -> None:
        self._send_delta(peer, add, remove, lost)

    @rule(
        peer=st.sampled_from(PEERS),
        parts=st.integers(1, 3),
        order=st.randoms(use_true_random=False),
        between=st.lists(st.tuples(FPS, FPS, st.booleans()), max_size=3),
        twice=st.booleans(),
        lose_one=st.booleans(),
    )
    def snapshot(
        self,
        peer: str,
        parts: int,
        order: random.Random,
        between: list[tuple[list[int], list[int], bool]],
        twice: bool,
        lose_one: bool,
    ) -> None:
        sender = self.senders[peer]
        held, upto = sorted(sender.held), sender.seq
        clean = len(held) <= CAPACITY and not lose_one
        sequence = list(range(parts))
        order.shuffle(sequence)
        if twice:
            sequence.insert(order.randrange(len(sequence) + 1), sequence[0])
        if lose_one:
            sequence = [p for p in sequence if p != sequence[-1]]
        self.last[peer] = (sender.epoch, upto, parts, held)
        for i, part in enumerate(sequence):
            self.index.snapshot(
                peer, sender.epoch, upto, part=part, parts=parts, fps=held[part::parts]
            )
            if i < len(between) and i < len(sequence) - 1:
                add, remove, lost = between[i]
                self._send_delta(peer, add, remove, lost)
                clean = clean and not lost and len(sender.held) <= CAPACITY
        if sequence:
            sender.clean = clean
        else:
            sender.clean = False

    @rule(peer=st.sampled_from(PEERS))
    def stale_snapshot(self, peer: str) -> None:
        # A snapshot delivered late (the peer sent two): it must change nothing
        # once deltas have moved past it.
        if peer not in self.last:
            return
        epoch, upto, parts, held = self.last[peer]
        sender = self.senders[peer]
        if epoch != sender.epoch or upto >= sender.seq:
            return
        for part in range(parts):
            self.index.snapshot(peer, epoch, upto, part=part, parts=parts, fps=held[part::parts])

    @rule(peer=st.sampled_from(PEERS))
    def restart(self, peer: str) -> None:
        self.index.remove_peer(peer)
        self._restart(peer)

    @rule(peer=st.sampled_from(PEERS))
    def restart_within_the_session(self, peer: str) -> None:
        # The peer restarted and reconnected before our session noticed: only
        # its new epoch says so.
        self.epochs += 1
        self.senders[peer] = Sender(self.epochs.to_bytes(16, "big"))

    @rule(peer=st.sampled_from(PEERS), fp=st.integers(0, 40))
    def miss(self, peer: str, fp: int) -> None:
        sender = self.senders[peer]
        if fp not in sender.held:  # a MISS is the truth: the peer does not hold it
            self.index.missed(peer, [fp])

    @invariant()
    def the_index_agrees_with_itself(self) -> None:
        # The inverted index and the per-peer claims say the same.
        pairs = sum(len(self.index.claimed_by(fp)) for fp in range(41))
        assert pairs == sum(len(self.index.peer(peer).claims) for peer in PEERS)
        assert len(self.index) == pairs
        for peer in PEERS:
            assert len(self.index.peer(peer).claims) <= CAPACITY

    @invariant()
    def a_repaired_summary_is_what_the_sender_holds(self) -> None:
        if self.index.pending:
            return  # messages wait for their turn: what is applied so far is older
        for peer, sender in self.senders.items():
            position = self.index.position(peer)
            assert position is not None
            claimed = {fp for fp in range(41) if peer in self.index.claimed_by(fp)}
            assert len(claimed) == len(self.index.peer(peer).claims)
            if sender.clean:
                assert position == (sender.epoch, sender.seq, True)
                assert claimed == sender.held


TestSourceMachine = SourceMachine.TestCase


class SlicedSourceMachine(SourceMachine):
    """The same senders, with every message applied in slices of 1 to 4 fingerprints.

    Nothing is applied as it arrives: messages queue, and the node's work
    takes them in turn, a slice at a time, between any two messages. Once
    all is applied the index must say exactly what it says applied at once.
    """

    def make_index(self) -> SourceIndex:
        return SourceIndex(inline_fps=0)

    @rule(most=st.integers(1, 4), times=st.integers(1, 8))
    def work(self, most: int, times: int) -> None:
        for _ in range(times):
            self.index.work(most)

    @rule()
    def drain(self) -> None:
        while self.index.pending:
            self.index.work(3)


TestSlicedSourceMachine = SlicedSourceMachine.TestCase


def test_fetches_that_keep_failing_quarantine_a_peer_and_one_delivered_forgives() -> None:
    index = SourceIndex(ChoicePolicy(max_failed_fetches=3))
    index.add_peer("b", capacity=10)
    synced(index, "b", [1])
    index.fetches_ended("b", delivered=0, failed=2, now=0.0)
    index.fetches_ended("b", delivered=1, failed=0, now=0.0)  # a success between: in a row no more
    index.fetches_ended("b", delivered=0, failed=2, now=0.0)
    assert not index.quarantined("b", 0.0)
    index.fetches_ended("b", delivered=0, failed=1, now=1.0)
    assert index.quarantined("b", 1.0)
    assert index.precision("b") == 1.0  # the fetches quarantined it, not the answers
    # During the quarantine, failures count for nothing; after it, it starts over.
    index.fetches_ended("b", delivered=0, failed=5, now=2.0)
    later = 1.0 + ChoicePolicy().quarantine_s
    assert not index.quarantined("b", later)
    index.fetches_ended("b", delivered=0, failed=2, now=later)
    assert not index.quarantined("b", later)


def test_a_snapshot_over_the_budget_keeps_what_fits_in_bounded_memory() -> None:
    # Issue 30: a peer that registered 1,000,000 blocks and sent a snapshot of
    # as many fingerprints made the node hold +344 MiB. The node's budget for a
    # peer caps what it keeps, whatever the peer registered.
    budget = 8 << 20  # what the runtime's SourceOptions.peer_budget_bytes buys
    most = budget // BYTES_PER_CLAIM
    index = SourceIndex()
    tracemalloc.start()
    try:
        index.add_peer("b", capacity=min(1_000_000, most))
        parts = 16
        for part in range(parts):
            fps = range(part * 65_536, (part + 1) * 65_536)
            index.snapshot("b", E1, 0, part=part, parts=parts, fps=fps)
            while index.pending:  # as the node does, a slice at a time between messages
                index.work()
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(index.peer("b").claims) == most
    assert index.peer("b").strikes == 1
    assert held <= budget
    assert peak <= budget
    # Deltas buffered during a snapshot weigh no more than the claims it may make.
    index.snapshot("b", E1, 1, part=0, parts=2, fps=[1])
    for seq in range(2, 40):
        index.delta("b", E1, seq, add=range(seq * 10_000, seq * 10_000 + 10_000), remove=[])
        while index.pending:
            index.work()
    assert index.position("b") == (E1, 0, True)  # the half snapshot was given up
    assert index.peer("b").strikes == 2


def test_a_flood_drops_the_compaction_it_cut_short_with_the_rest() -> None:
    # A compaction queued behind a delta keeps every removal made meanwhile
    # for its result; dropped unrun by a flood, it must not keep them for ever.
    index = SourceIndex(max_queued_bytes=64 * 1024, inline_fps=0)
    index.add_peer("b", capacity=100_000)
    index.snapshot("b", E1, 0, part=0, parts=1, fps=[])
    while index.pending:
        index.work()
    index.delta("b", E1, 1, add=range(1, 3000), remove=[])
    claims = index._peers["b"].claims
    for _ in range(3000):  # a fingerprint at a time, to the one that makes it due
        if claims.compacting:
            break
        index.work(1)
    held = len(index.peer("b").claims)
    assert 1024 < held < 2999  # the rest of the delta waits behind the compaction
    for seq in range(2, 40):  # 8 KiB each, none applied: a flood
        index.delta("b", E1, seq, add=range(seq * 1000, seq * 1000 + 1000), remove=[])
    assert index.peer("b").floods >= 1
    assert not claims.compacting
    index.missed("b", list(range(1, 100)))
    assert len(index.peer("b").claims) == held - 99


def test_a_work_budget_refills_at_its_rate_and_bursts_a_tenth_of_a_second() -> None:
    budget = WorkBudget(1000.0, now=0.0)
    assert budget.ready(0.0)
    budget.spend(150, 0.0)  # past the burst (100): it waits
    assert not budget.ready(0.0)
    assert budget.ready_at(0.0) == pytest.approx(0.051)  # back above zero
    assert budget.ready(0.051)
    budget.spend(10**6, 1.0)
    assert budget.ready_at(1.0) == pytest.approx(1.0 + (10**6 - 100 + 1) / 1000)
    unlimited = WorkBudget(None)
    unlimited.spend(10**9, 0.0)
    assert unlimited.ready(0.0)
    assert budget.ready(None)  # no time said: no limit


def test_a_peer_past_its_work_budget_waits_and_the_others_go_on() -> None:
    # 10,000 fingerprints a second: a delta of 20,000 takes seconds to apply,
    # a slice at a time; another peer's messages are applied meanwhile.
    index = SourceIndex(work_fps_per_s=10_000, inline_fps=0)
    for peer in ("hog", "other"):
        index.add_peer(peer, capacity=100_000)
        index.snapshot(peer, E1, 0, part=0, parts=1, fps=[], now=0.0)
    index.work(now=0.0)
    index.work(now=0.0)
    index.delta("hog", E1, 1, add=range(1, 20_001), remove=[], now=0.0)
    for _ in range(10):
        index.work(now=0.0)
    assert len(index.peer("hog").claims) <= 1_000 + SLICE_FPS  # its burst, and a slice past it
    index.delta("other", E1, 1, add=[10**9], remove=[], now=0.0)
    ready = index.ready_at(0.0)
    assert ready is not None
    assert ready == 0.0  # the other peer's work may go on now
    index.work(now=0.0)
    index.work(now=0.0)
    assert index.claimed_by(10**9) == {"other"}
    assert index.ready_at(0.0) is not None
    assert index.ready_at(0.0) > 0.0  # only the hog waits, for its budget
    now = 0.0
    while index.pending:
        ready = index.ready_at(now)
        assert ready is not None
        now = max(now, ready)
        index.work(now=now)
    assert len(index.peer("hog").claims) == 20_000
    # 20,000 applied at 10,000 a second, less its first burst, and the
    # compactions they made (merging counts for an eighth of applying).
    assert (20_000 - 1_000) / 10_000 <= now < 5.0
