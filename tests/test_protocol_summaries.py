"""The summary extension's messages (``kvsum/1``): bytes, bounds and refusals."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pactor.core.protocol import (
    MAX_SUMMARY_BYTES,
    KvsumDelta,
    KvsumResync,
    KvsumSnapshot,
    Limits,
    decode,
    encode,
    fingerprints,
    packed,
)
from p2pactor.errors import InvalidField

EPOCH = bytes(range(16))
FPS = (0, 1, 2**64 - 1, 0x0123456789ABCDEF)


def frame_of(wire: object) -> bytes:
    return msgspec.msgpack.encode(wire)


def test_fingerprints_pack_big_endian_eight_bytes_each() -> None:
    blob = packed(FPS)
    assert len(blob) == 8 * len(FPS)
    assert blob[8:16] == b"\x00" * 7 + b"\x01"
    assert blob[24:] == bytes.fromhex("0123456789abcdef")
    assert fingerprints(blob) == FPS
    assert fingerprints(b"") == ()


@given(st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=64))
def test_fingerprints_round_trip(fps: list[int]) -> None:
    assert fingerprints(packed(fps)) == tuple(fps)


def test_delta_bytes_are_a_map_with_type_first() -> None:
    msg = KvsumDelta(epoch=EPOCH, seq=3, add=packed(FPS[:2]), remove=packed(FPS[2:]))
    wire = msgspec.msgpack.decode(encode(msg))
    assert list(wire) == ["type", "epoch", "seq", "add", "remove"]
    assert wire["type"] == "kvsum_delta"
    assert decode(encode(msg)) == msg


def test_snapshot_and_resync_round_trip() -> None:
    snap = KvsumSnapshot(epoch=EPOCH, upto_seq=7, part=1, parts=3, fps=packed(FPS))
    resync = KvsumResync(epoch=b"", from_seq=0)
    for msg in (snap, resync):
        assert decode(encode(msg)) == msg
    wire = msgspec.msgpack.decode(encode(snap))
    assert list(wire) == ["type", "epoch", "upto_seq", "part", "parts", "fps"]


def _delta(**fields: Any) -> dict[str, Any]:
    return {"type": "kvsum_delta", "epoch": EPOCH, "seq": 1, "add": b"", "remove": b"", **fields}


def _snapshot(**fields: Any) -> dict[str, Any]:
    base = {"type": "kvsum_snapshot", "epoch": EPOCH, "upto_seq": 0, "part": 0, "parts": 1}
    return {**base, "fps": b"", **fields}


@pytest.mark.parametrize(
    ("wire", "message_type", "field", "problem"),
    [
        (_delta(add=b"\x00" * 7), "kvsum_delta", "add", "not a whole number of 8-byte"),
        (_delta(remove=b"\x00" * 9), "kvsum_delta", "remove", "not a whole number"),
        (_delta(epoch=b""), "kvsum_delta", "epoch", "is 0 bytes, expected at least 1"),
        (_delta(epoch=b"x" * 65), "kvsum_delta", "epoch", "more than the limit of 64"),
        (_delta(seq=-1), "kvsum_delta", "seq", "expected at least 0"),
        (_delta(seq=2**63), "kvsum_delta", "seq", "more than the limit of"),
        (_delta(add=[1, 2]), "kvsum_delta", "add", "expected bytes"),
        (
            _delta(add=b"\x00" * (MAX_SUMMARY_BYTES + 8)),
            "kvsum_delta",
            "add",
            f"more than the limit of {MAX_SUMMARY_BYTES}",
        ),
        (_snapshot(part=2, parts=2), "kvsum_snapshot", "part", "only 2 parts"),
        (_snapshot(parts=0), "kvsum_snapshot", "parts", "expected at least 1"),
        (_snapshot(fps=b"\x01"), "kvsum_snapshot", "fps", "not a whole number"),
        ({"type": "kvsum_resync", "epoch": b""}, "kvsum_resync", "from_seq", "missing"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_summary_fields_are_refused_by_name(
    wire: dict[str, Any], message_type: str, field: str, problem: str
) -> None:
    with pytest.raises(InvalidField) as info:
        decode(frame_of(wire))
    assert info.value.message_type == message_type
    assert info.value.field == field
    assert problem in str(info.value), str(info.value)


def test_a_node_may_lower_the_summary_bound() -> None:
    frame = frame_of(_delta(add=packed(FPS)))
    assert isinstance(decode(frame), KvsumDelta)
    with pytest.raises(InvalidField, match="more than the limit of 16"):
        decode(frame, limits=Limits(max_summary_bytes=16))
