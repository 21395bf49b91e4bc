"""The summary extension (``kvsum/1``): which keys a p2pactor peer's engine holds.

Sent only between p2pactor peers that both offered the feature in their
``connect`` (a stock vLLM peer is never sent one, and logs a warning for any
message type it does not know). A node tells each such peer, over the session
it already has, what its engine's CPU tier holds, as 64-bit key fingerprints
(:func:`p2pactor.core.sources.fingerprint`) packed big-endian, 8 bytes each:

- :class:`KvsumDelta`: the keys that came and went since the previous delta,
  numbered from 1 in each epoch (a node's life: a restart or a drain starts a
  new one, which replaces the old summary whole);
- :class:`KvsumSnapshot`: one part of everything held as of a delta, sent when
  the session becomes ready and when the peer asks;
- :class:`KvsumResync`: the receiver saw a gap (or has no snapshot) and asks
  for one.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Annotated, Final

from msgspec import Meta

from p2pactor.core.protocol_limits import (
    MAX_EPOCH_BYTES,
    MAX_NUM_BLOCKS,
    MAX_SUMMARY_BYTES,
    MessageBase,
    bounded,
)
from p2pactor.errors import InvalidField

# The feature a ``connect`` offers when its sender sends and reads summaries.
FEATURE_SUMMARIES: Final = "kvsum/1"

_FP_BYTES: Final = 8
_MAX_SEQ: Final = 2**63 - 1

_Epoch = Annotated[bytes, Meta(min_length=1, max_length=MAX_EPOCH_BYTES)]
_Seq = Annotated[int, Meta(ge=0, le=_MAX_SEQ)]
_Packed = Annotated[bytes, bounded(MAX_SUMMARY_BYTES, "max_summary_bytes")]
_Part = Annotated[int, Meta(ge=0, le=MAX_NUM_BLOCKS)]
_Parts = Annotated[int, Meta(ge=1, le=MAX_NUM_BLOCKS + 1)]


def packed(fps: Sequence[int]) -> bytes:
    """Fingerprints as a summary field carries them: 8 bytes each, big-endian."""
    return struct.pack(f">{len(fps)}Q", *fps)


def fingerprints(blob: bytes) -> tuple[int, ...]:
    """The fingerprints of a summary field (its length is a multiple of 8: decode checked)."""
    return struct.unpack(f">{len(blob) // _FP_BYTES}Q", blob)


def _whole(msg: MessageBase, *names: str) -> None:
    for name in names:
        if (size := len(getattr(msg, name))) % _FP_BYTES:
            raise InvalidField(
                f"is {size} bytes, not a whole number of 8-byte fingerprints",
                message_type=msg.TYPE,
                field=name,
            )


class KvsumDelta(MessageBase, frozen=True, kw_only=True):
    """The keys the sender came to hold, and stopped holding, since delta ``seq - 1``.

    Attributes:
        epoch: The sender's life this belongs to.
        seq: This delta's number in the epoch (the first is 1).
        add: Fingerprints now held, packed.
        remove: Fingerprints no longer held, packed.
    """

    epoch: _Epoch
    seq: _Seq
    add: _Packed
    remove: _Packed

    def __post_init__(self) -> None:
        _whole(self, "add", "remove")


class KvsumSnapshot(MessageBase, frozen=True, kw_only=True):
    """Part ``part`` of ``parts`` of everything the sender holds as of delta ``upto_seq``.

    Attributes:
        epoch: The sender's life this belongs to.
        upto_seq: The last delta the snapshot includes (0: none yet).
        part: Which part this is, from 0.
        parts: How many parts the snapshot has.
        fps: This part's fingerprints, packed.
    """

    epoch: _Epoch
    upto_seq: _Seq
    part: _Part
    parts: _Parts
    fps: _Packed

    def __post_init__(self) -> None:
        if self.part >= self.parts:
            raise InvalidField(
                f"is {self.part}, but the snapshot has only {self.parts} parts",
                message_type=self.TYPE,
                field="part",
            )
        _whole(self, "fps")


class KvsumResync(MessageBase, frozen=True, kw_only=True):
    """Asks the receiver for a snapshot: the sender's copy of its summary has a gap.

    Attributes:
        epoch: The receiver's epoch as the sender knows it (empty: none yet).
        from_seq: The first delta the sender is missing (0: it has no snapshot).
    """

    epoch: Annotated[bytes, Meta(max_length=MAX_EPOCH_BYTES)]
    from_seq: _Seq


# Any message of the summary extension.
SummaryMessage = KvsumDelta | KvsumSnapshot | KvsumResync
