"""Every field of every ``kvsum/1`` message, fuzzed, into the source index.

A hostile peer sends summary frames whose fields take any value the codec
lets through (epochs of any length, sequence numbers and part counts at
their bounds, parts past the count, fingerprints repeated, extreme, or more
than it may claim), as fast as it likes, between an honest peer's deltas and
snapshots; the node applies them a slice at a time as its task does. Each
frame goes through the real codec first (encode, then decode: what the
codec refuses ends the session and never reaches the index). Whatever the
hostile peer sends, the index must never fail, keep to the node's budget
for it (claims, what is assembled and buffered, what waits), and keep the
honest peer's summary exactly what that peer holds.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pactor.core import protocol as wire
from p2pactor.core.protocol_limits import MAX_NUM_BLOCKS
from p2pactor.core.sources import BYTES_PER_CLAIM, SourceIndex
from p2pactor.errors import ProtocolError

CAPACITY = 40
QUEUE_BYTES = 2048
SLICE = 7
HONEST_EPOCH = b"honest-epoch-16b"

# Few values, so that they collide; both ends of the 64 bits among them.
VALUES = [0, 1, 2, 3, 2**63, 2**64 - 2, 2**64 - 1, *range(100, 140)]
fingerprint_lists = st.lists(st.sampled_from(VALUES), max_size=60)
epochs = st.one_of(
    st.sampled_from([b"e", b"hostile-epoch-1", b"hostile-epoch-2", b"x" * 64]),
    st.binary(min_size=1, max_size=64),
)
seqs = st.one_of(st.integers(0, 6), st.just(2**63 - 1), st.integers(0, 2**63 - 1))
part_counts = st.one_of(st.integers(1, 4), st.just(MAX_NUM_BLOCKS + 1), st.integers(1, 2**31))


def through_the_codec(message_type: str, **fields: object) -> wire.Message | None:
    """The frame of these fields as the node would see it, decoded (None: the codec refused it)."""
    try:
        return wire.decode(msgspec.msgpack.encode({"type": message_type, **fields}))
    except ProtocolError:
        return None


class HostileSummaries(RuleBasedStateMachine):
    """A hostile peer and an honest one, one index, its work done a few fingerprints a time."""

    def __init__(self) -> None:
        super().__init__()
        self.index = SourceIndex(max_queued_bytes=QUEUE_BYTES, inline_fps=3)
        self.index.add_peer("hostile", capacity=CAPACITY)
        self.index.add_peer("honest", capacity=CAPACITY)
        self.held: set[int] = set()
        self.seq = 0
        self.synced = False  # the honest peer's last snapshot was sent whole since any loss

    def _feed(self, peer: str, msg: wire.Message | None) -> None:
        floods = self.index.peer("honest").floods
        self._apply(peer, msg)
        if self.index.peer("honest").floods != floods:
            self.synced = False  # its own messages came faster than the work: some were lost

    def _apply(self, peer: str, msg: wire.Message | None) -> None:
        match msg:
            case wire.KvsumDelta():
                self.index.delta(peer, msg.epoch, msg.seq, msg.add, msg.remove)
            case wire.KvsumSnapshot():
                self.index.snapshot(
                    peer, msg.epoch, msg.upto_seq, part=msg.part, parts=msg.parts, fps=msg.fps
                )
            case _:
                pass

    # --- the hostile peer: any field, any value the codec takes ---------------------------

    @rule(epoch=epochs, seq=seqs, add=fingerprint_lists, remove=fingerprint_lists)
    def hostile_delta(self, epoch: bytes, seq: int, add: list[int], remove: list[int]) -> None:
        msg = through_the_codec(
            "kvsum_delta", epoch=epoch, seq=seq, add=wire.packed(add), remove=wire.packed(remove)
        )
        assert msg is not None  # every value here is within the codec's bounds
        self._feed("hostile", msg)

    @rule(
        epoch=epochs,
        upto=seqs,
        parts=part_counts,
        part=st.integers(0, 2**31),
        fps=fingerprint_lists,
    )
    def hostile_part(self, epoch: bytes, upto: int, parts: int, part: int, fps: list[int]) -> None:
        part = part % (parts + 1)  # now and then one past the last: the codec refuses it
        msg = through_the_codec(
            "kvsum_snapshot",
            epoch=epoch,
            upto_seq=upto,
            part=part,
            parts=parts,
            fps=wire.packed(fps),
        )
        assert (msg is None) == (part >= parts)
        self._feed("hostile", msg)

    @rule(blob=st.binary(max_size=40), field=st.sampled_from(["add", "remove"]))
    def hostile_ragged_field(self, blob: bytes, field: str) -> None:
        # Not a whole number of fingerprints: the codec must refuse it by name.
        fields = {"add": b"", "remove": b"", field: blob}
        decoded = through_the_codec("kvsum_delta", epoch=b"e", seq=1, **fields)
        assert (decoded is None) == bool(len(blob) % 8)
        self._feed("hostile", decoded)

    @rule(times=st.integers(1, 30), fps=fingerprint_lists)
    def hostile_flood(self, times: int, fps: list[int]) -> None:
        # Faster than the work: what waits is bounded, the rest is dropped.
        for seq in range(times):
            msg = through_the_codec(
                "kvsum_delta", epoch=b"e", seq=seq, add=wire.packed(fps), remove=b""
            )
            self._feed("hostile", msg)

    # --- the honest peer ------------------------------------------------------------------

    @rule(
        add=st.lists(st.integers(1000, 1030), max_size=5),
        remove=st.lists(st.integers(1000, 1030), max_size=3),
    )
    def honest_delta(self, add: list[int], remove: list[int]) -> None:
        if len(self.held - set(remove) | set(add)) > CAPACITY:
            return  # an honest peer claims no more than it registered
        self.seq += 1
        self.held = (self.held - set(remove)) | set(add)
        msg = through_the_codec(
            "kvsum_delta",
            epoch=HONEST_EPOCH,
            seq=self.seq,
            add=wire.packed(add),
            remove=wire.packed(remove),
        )
        assert msg is not None
        self._feed("honest", msg)

    @rule(parts=st.integers(1, 3))
    def honest_snapshot(self, parts: int) -> None:
        held = sorted(self.held)
        floods = self.index.peer("honest").floods
        for part in range(parts):
            msg = through_the_codec(
                "kvsum_snapshot",
                epoch=HONEST_EPOCH,
                upto_seq=self.seq,
                part=part,
                parts=parts,
                fps=wire.packed(held[part::parts]),
            )
            assert msg is not None
            self._feed("honest", msg)
        # Whole unless a flood dropped some of its parts (then a later one must repair it).
        self.synced = self.index.peer("honest").floods == floods

    # --- the node's task ------------------------------------------------------------------

    @rule(times=st.integers(1, 20))
    def work(self, times: int) -> None:
        for _ in range(times):
            self.index.work(SLICE)

    @precondition(lambda self: self.index.pending)
    @rule()
    def drain(self) -> None:
        while self.index.pending:
            self.index.work(SLICE)

    # --- what must hold -------------------------------------------------------------------

    @invariant()
    def the_node_keeps_to_its_budget_for_each_peer(self) -> None:
        for peer in ("hostile", "honest"):
            assert len(self.index.peer(peer).claims) <= CAPACITY
            # Claims, assembly, buffered deltas (the per-claim bound), what waits,
            # and the assembly's column of the filter (one column, as its own).
            most = CAPACITY * BYTES_PER_CLAIM + QUEUE_BYTES + self.index.column_bytes
            assert self.index.peer(peer).nbytes <= most

    @invariant()
    def the_honest_summary_is_exactly_what_the_honest_peer_holds(self) -> None:
        if self.index.pending or not self.synced:
            return
        position = self.index.position("honest")
        assert position == (HONEST_EPOCH, self.seq, True)
        claimed = {fp for fp in range(1000, 1031) if "honest" in self.index.claimed_by(fp)}
        assert claimed == self.held


TestHostileSummaries = HostileSummaries.TestCase
TestHostileSummaries.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("parts", [1, 2, MAX_NUM_BLOCKS + 1])
def test_a_snapshot_of_more_parts_than_the_peer_may_claim_never_assembles(parts: int) -> None:
    index = SourceIndex()
    index.add_peer("b", capacity=1)
    index.snapshot("b", b"e", 0, part=0, parts=parts, fps=wire.packed([5]))
    while index.pending:
        index.work()
    assert len(index.peer("b").claims) == (1 if parts == 1 else 0)
    assert index.peer("b").strikes == (1 if parts > 2 else 0)
