"""What refusing a hostile frame costs: at most about its own size, for every message.

A peer's frame is decoded once, typed; a refusal is worded from msgspec's
verdict (``core/protocol_checks.py``). Before, the frame was decoded again,
untyped, to word it: a ``kvsum_delta`` whose ``add`` was an array of empty
maps cost 72 times its size (1 MiB -> +60 MiB; at the 64 MiB frame limit
about 4.7 GiB), also as the first frame of an unauthenticated connection.
Memory is measured with ``tracemalloc`` (every allocation msgspec makes goes
through Python's allocator), peak over the decode, against the frame's size.
"""

from __future__ import annotations

import tracemalloc

import msgspec
import msgspec.inspect as mi
import pytest

from p2pactor.core.protocol import MESSAGE_TYPES, decode
from p2pactor.errors import InvalidField, MalformedFrame, ProtocolError

SIZE = 1 << 20  # about a MiB of empty maps (one byte each)


def peak_of_refusal(frame: bytes) -> tuple[ProtocolError, int]:
    """The error decoding ``frame`` raised, and the peak bytes it allocated."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with pytest.raises(ProtocolError) as info:
            decode(frame)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    return info.value, peak


def fields_of(mtype: str) -> list[str]:
    info = mi.type_info(MESSAGE_TYPES[mtype])
    assert isinstance(info, mi.StructType)
    return [f.encode_name for f in info.fields if f.encode_name != "type"]


CASES = [(t, f) for t in MESSAGE_TYPES for f in fields_of(t)]


@pytest.mark.parametrize(("mtype", "field"), CASES, ids=[f"{t}.{f}" for t, f in CASES])
def test_a_field_of_empty_maps_costs_at_most_twice_the_frame(mtype: str, field: str) -> None:
    frame = msgspec.msgpack.encode({"type": mtype, field: [{}] * SIZE})
    error, peak = peak_of_refusal(frame)
    assert peak <= 2 * len(frame), f"{peak} bytes to refuse a {len(frame)}-byte frame"
    assert isinstance(error, InvalidField)
    assert error.message_type == mtype
    assert error.field is not None
    assert error.field.split(".")[0] == field


@pytest.mark.parametrize(
    "wire",
    [
        pytest.param([{}] * SIZE, id="top_level_list"),
        pytest.param({"x": [{}] * SIZE}, id="no_type"),
        pytest.param({"type": [{}] * SIZE}, id="type_a_list"),
        pytest.param({"type": "z" * SIZE}, id="unknown_type"),
        pytest.param({"type": "lookup", "keys": [[{}] * 64] * (SIZE // 64)}, id="nested"),
        pytest.param({str(i): {} for i in range(SIZE // 8)} | {"type": "gossip"}, id="many_keys"),
    ],
)
def test_malformed_frames_cost_at_most_twice_the_frame(wire: object) -> None:
    frame = msgspec.msgpack.encode(wire)
    error, peak = peak_of_refusal(frame)
    assert peak <= 2 * len(frame), f"{peak} bytes to refuse a {len(frame)}-byte frame"
    assert isinstance(error, MalformedFrame | InvalidField | ProtocolError)
    assert len(str(error)) < 500


def test_a_big_list_is_still_measured_from_its_header() -> None:
    keys = [b"k" * 16] * 70_000  # over the protocol's 65,536 keys
    frame = msgspec.msgpack.encode({"type": "lookup", "kv_request_id": "r", "keys": keys})
    error, _ = peak_of_refusal(frame)
    assert "has 70000 items, more than the limit of 65536" in str(error)


def test_a_reserved_extension_value_is_named_not_decoded() -> None:
    # msgpack's timestamp (extension -1) with a bad length: untyped decoding
    # refuses it, so the error is worded without decoding it (the fuzz found it).
    bad = msgspec.msgpack.Ext(-1, b"")
    frame = msgspec.msgpack.encode({"type": "abort_ack", "kv_request_id": "", "round_seq": bad})
    error, _ = peak_of_refusal(frame)
    assert isinstance(error, InvalidField)
    assert "is Ext, expected int" in str(error)
    error, _ = peak_of_refusal(msgspec.msgpack.encode({"type": bad}))
    assert isinstance(error, MalformedFrame)
    assert "'type' is Ext, expected str" in str(error)
