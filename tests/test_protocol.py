"""Example tests of the wire codec, ``p2pactor.core.protocol``.

Three things are checked here. First, byte-for-byte compatibility with vLLM
0.33.0: each message encodes to exactly ``msgspec.msgpack.encode`` of the dict
a stock vLLM peer builds (written out literally below, in vLLM's key order).
Second, the p2pactor extensions: absent when unset, round-tripping when set,
ignored by structure when a stock peer leaves them out. Third, every
validation rule of ``decode``, one row each of the ``INVALID`` table, asserting
the exception class and that the error names the message type and the field.
"""

from __future__ import annotations

import datetime
import math
import time
from typing import Any

import attrs
import msgspec
import msgspec.inspect
import pytest

from p2pactor.core.protocol import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_FRAME_BYTES,
    MAX_ADDRESS,
    MAX_AGENT_METADATA_BYTES,
    MAX_BLOCK_INDEX,
    MAX_DEADLINE_MS,
    MAX_FEATURE_CHARS,
    MAX_FEATURES,
    MAX_KEY_BYTES,
    MAX_LIST_ITEMS,
    MAX_NUM_BLOCKS,
    MAX_STRING_CHARS,
    MESSAGE_TYPES,
    UNSET,
    VLLM_MESSAGE_TYPES,
    AbortAck,
    AbortFetch,
    Connect,
    ConnectAck,
    ConnectExtension,
    Disconnect,
    Fetch,
    Limits,
    Lookup,
    LookupResp,
    Message,
    TransferDone,
    decode,
    encode,
)
from p2pactor.errors import (
    ConfigError,
    FrameTooLarge,
    InvalidField,
    MalformedFrame,
    ProtocolError,
    UnknownMessageType,
)

KEY_A = bytes.fromhex("aa" * 32) + (0).to_bytes(4, "big")
KEY_B = bytes.fromhex("bb" * 32) + (1).to_bytes(4, "big")
METADATA = b"\x00\x01nixl-agent-metadata\xff"
BASE_ADDR = 0x7F3A_0000_0000


# ---------------------------------------------------------------------------
# The dicts a stock vLLM 0.33.0 peer builds, key for key and in its order.
# ---------------------------------------------------------------------------


def vllm_connect() -> dict[str, Any]:
    return {
        "type": "connect",
        "peer_id": "10.0.0.1:5710",
        "agent_metadata": METADATA,
        "base_addr": BASE_ADDR,
        "num_blocks": 1024,
        "block_len": 65536,
        "config_fingerprint": "0123456789abcdef",
        "hash_seed": "vllm-none-hash",
    }


def vllm_connect_ack() -> dict[str, Any]:
    return {"type": "connect_ack", "peer_id": "10.0.0.2:5710"}


def vllm_disconnect() -> dict[str, Any]:
    return {"type": "disconnect"}


def vllm_lookup() -> dict[str, Any]:
    return {"type": "lookup", "kv_request_id": "req-1", "keys": [KEY_A, KEY_B], "round_seq": 2}


def vllm_lookup_resp() -> dict[str, Any]:
    return {
        "type": "lookup_resp",
        "kv_request_id": "req-1",
        "keys": [KEY_A, KEY_B],
        "hits": [True, False],
    }


def vllm_fetch() -> dict[str, Any]:
    return {
        "type": "fetch",
        "kv_request_id": "req-1",
        "keys": [KEY_A, KEY_B],
        "block_indexes": [7, 300],
        "round_seq": 2,
    }


def vllm_transfer_done() -> dict[str, Any]:
    return {"type": "transfer_done", "kv_request_id": "req-1", "success": True, "round_seq": 2}


def vllm_abort_fetch() -> dict[str, Any]:
    return {"type": "abort_fetch", "kv_request_id": "req-1", "round_seq": 2}


def vllm_abort_ack() -> dict[str, Any]:
    return {"type": "abort_ack", "kv_request_id": "req-1", "round_seq": 2}


# The same nine messages as p2pactor values, without extensions.
PAIRS: list[tuple[Message, dict[str, Any]]] = [
    (
        Connect(
            peer_id="10.0.0.1:5710",
            agent_metadata=METADATA,
            base_addr=BASE_ADDR,
            num_blocks=1024,
            block_len=65536,
            config_fingerprint="0123456789abcdef",
            hash_seed="vllm-none-hash",
        ),
        vllm_connect(),
    ),
    (ConnectAck(peer_id="10.0.0.2:5710"), vllm_connect_ack()),
    (Disconnect(), vllm_disconnect()),
    (Lookup(kv_request_id="req-1", keys=(KEY_A, KEY_B), round_seq=2), vllm_lookup()),
    (
        LookupResp(kv_request_id="req-1", keys=(KEY_A, KEY_B), hits=(True, False)),
        vllm_lookup_resp(),
    ),
    (
        Fetch(kv_request_id="req-1", keys=(KEY_A, KEY_B), block_indexes=(7, 300), round_seq=2),
        vllm_fetch(),
    ),
    (TransferDone(kv_request_id="req-1", success=True, round_seq=2), vllm_transfer_done()),
    (AbortFetch(kv_request_id="req-1", round_seq=2), vllm_abort_fetch()),
    (AbortAck(kv_request_id="req-1", round_seq=2), vllm_abort_ack()),
]
PAIR_IDS = [msg.TYPE for msg, _ in PAIRS]


def frame_of(wire: object) -> bytes:
    return msgspec.msgpack.encode(wire)


def without(wire: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in wire.items() if k != key}


def expect_invalid(
    wire: object, *, message_type: str, field: str, problem: str, limits: Limits = DEFAULT_LIMITS
) -> InvalidField:
    """Decode ``wire`` and check the InvalidField names type, field and problem."""
    with pytest.raises(InvalidField) as info:
        decode(frame_of(wire), limits=limits)
    err = info.value
    assert err.message_type == message_type
    assert err.field == field
    text = str(err)
    assert repr(message_type) in text
    assert repr(field) in text
    assert problem in text, text
    return err


# ---------------------------------------------------------------------------
# Byte-for-byte compatibility with vLLM 0.33.0
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("msg", "wire"), PAIRS, ids=PAIR_IDS)
def test_encode_matches_vllm_bytes(msg: Message, wire: dict[str, Any]) -> None:
    assert encode(msg) == msgspec.msgpack.encode(wire)


@pytest.mark.parametrize(("msg", "wire"), PAIRS, ids=PAIR_IDS)
def test_round_trip(msg: Message, wire: dict[str, Any]) -> None:
    assert decode(encode(msg)) == msg


@pytest.mark.parametrize(("msg", "wire"), PAIRS, ids=PAIR_IDS)
def test_decodes_what_vllm_sends(msg: Message, wire: dict[str, Any]) -> None:
    assert decode(msgspec.msgpack.encode(wire)) == msg


def test_type_key_comes_first_and_keys_travel_as_bin() -> None:
    frame = encode(PAIRS[3][0])
    # fixmap of 4, then fixstr "type"; the keys are bin 8 (0xc4) of 36 bytes.
    assert frame.startswith(b"\x84\xa4type\xa6lookup")
    assert b"\xc4\x24" + KEY_A in frame


def test_empty_fetch_matches_vllm_request_finished_signal() -> None:
    wire = {
        "type": "fetch",
        "kv_request_id": "req-1",
        "keys": [],
        "block_indexes": [],
        "round_seq": 0,
    }
    msg = Fetch(kv_request_id="req-1", keys=(), block_indexes=(), round_seq=0)
    assert encode(msg) == msgspec.msgpack.encode(wire)
    assert decode(encode(msg)) == msg


def test_stock_connect_without_fingerprint_decodes_as_empty() -> None:
    msg = decode(frame_of(without(vllm_connect(), "config_fingerprint")))
    assert isinstance(msg, Connect)
    assert msg.config_fingerprint == ""


def test_message_types_maps_every_wire_type() -> None:
    assert set(VLLM_MESSAGE_TYPES) == {msg.TYPE for msg, _ in PAIRS}
    extension = set(MESSAGE_TYPES) - set(VLLM_MESSAGE_TYPES)
    assert extension == {"kvsum_delta", "kvsum_snapshot", "kvsum_resync"}
    for type_name, cls in MESSAGE_TYPES.items():
        assert type_name == cls.TYPE


def test_sequences_are_tuples_and_messages_hashable() -> None:
    msg = Fetch(kv_request_id="r", keys=(KEY_A,), block_indexes=(1,), round_seq=0)
    decoded = decode(encode(msg))
    assert isinstance(decoded, Fetch)
    assert type(decoded.keys) is tuple
    assert type(decoded.block_indexes) is tuple
    assert hash(decoded) == hash(msg)


# ---------------------------------------------------------------------------
# Extensions
# ---------------------------------------------------------------------------

EXTENSION = ConnectExtension(version=1, features=frozenset({"round_seq", "deadline_ms"}))


def test_extensions_absent_when_unset() -> None:
    connect = PAIRS[0][0]
    assert isinstance(connect, Connect)
    assert connect.extension is UNSET
    assert encode(connect) == msgspec.msgpack.encode(vllm_connect())
    assert encode(Lookup(kv_request_id="req-1", keys=(KEY_A, KEY_B), round_seq=2)) == (
        msgspec.msgpack.encode(vllm_lookup())
    )
    assert encode(
        LookupResp(kv_request_id="req-1", keys=(KEY_A, KEY_B), hits=(True, False))
    ) == msgspec.msgpack.encode(vllm_lookup_resp())


@pytest.mark.parametrize(
    ("msg", "wire"),
    [
        pytest.param(
            Connect(
                peer_id="10.0.0.1:5710",
                agent_metadata=METADATA,
                base_addr=BASE_ADDR,
                num_blocks=1024,
                block_len=65536,
                config_fingerprint="0123456789abcdef",
                hash_seed="vllm-none-hash",
                extension=EXTENSION,
            ),
            # Features sorted, so the bytes are deterministic.
            {
                **vllm_connect(),
                "p2pactor": {"version": 1, "features": ["deadline_ms", "round_seq"]},
            },
            id="connect_extension_round_trips_after_the_base_keys",
        ),
        pytest.param(
            Lookup(kv_request_id="req-1", keys=(KEY_A, KEY_B), round_seq=2, deadline_ms=1500),
            {**vllm_lookup(), "deadline_ms": 1500},
            id="lookup_deadline_round_trips_after_the_base_keys",
        ),
        pytest.param(
            LookupResp(kv_request_id="req-1", keys=(KEY_A, KEY_B), hits=(True, False), round_seq=4),
            {**vllm_lookup_resp(), "round_seq": 4},
            id="lookup_resp_round_seq_round_trips_after_the_base_keys",
        ),
    ],
)
def test_extension_round_trips(msg: Message, wire: dict[str, Any]) -> None:
    frame = encode(msg)
    assert frame == msgspec.msgpack.encode(wire)
    assert decode(frame) == msg


def test_stock_peer_messages_decode_with_extensions_unset() -> None:
    connect = decode(frame_of(vllm_connect()))
    lookup = decode(frame_of(vllm_lookup()))
    lookup_resp = decode(frame_of(vllm_lookup_resp()))
    assert isinstance(connect, Connect)
    assert connect.extension is UNSET
    assert isinstance(lookup, Lookup)
    assert lookup.deadline_ms is UNSET
    assert isinstance(lookup_resp, LookupResp)
    assert lookup_resp.round_seq is UNSET


def test_unknown_keys_in_extension_map_are_ignored() -> None:
    wire = {**vllm_connect(), "p2pactor": {"version": 9, "features": ["x"], "later": [1, 2]}}
    msg = decode(frame_of(wire))
    assert isinstance(msg, Connect)
    assert msg.extension == ConnectExtension(version=9, features=frozenset({"x"}))


@pytest.mark.parametrize("features", [["b", "a"], "round_seq"], ids=["list", "bare_string"])
def test_extension_features_must_be_a_frozenset(features: object) -> None:
    # A bare str would be its letters; a decoded extension always has a frozenset.
    with pytest.raises(TypeError, match="features must be a frozenset of str"):
        ConnectExtension(version=1, features=features)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Validation, mirroring vLLM's validate() rules and going beyond them
# ---------------------------------------------------------------------------


def invalid(
    wire: object,
    message_type: str,
    field: str,
    problem: str,
    limits: Limits = DEFAULT_LIMITS,
    *,
    id: str,
) -> Any:
    """One row of INVALID: the arguments of one ``expect_invalid`` call."""
    return pytest.param(wire, message_type, field, problem, limits, id=id)


# The messages that carry round_seq, and those that carry kv_request_id.
ROUND_SEQ_WIRES = [
    vllm_lookup(),
    vllm_fetch(),
    vllm_transfer_done(),
    vllm_abort_fetch(),
    vllm_abort_ack(),
]
KV_REQUEST_ID_WIRES = [
    vllm_lookup(),
    vllm_lookup_resp(),
    vllm_fetch(),
    vllm_transfer_done(),
    vllm_abort_ack(),
]

# Each id is the name the case had as its own test, less "test_"; a case that
# was itself parametrized over messages gets "-<message type>" after it.
INVALID = [
    # -- Extensions -----------------------------------------------------------
    invalid(
        {**vllm_connect(), "p2pactor": [1, ["x"]]},
        "connect",
        "p2pactor",
        "is list, expected a map",
        id="extension_not_a_map",
    ),
    invalid(
        {**vllm_connect(), "p2pactor": {"features": []}},
        "connect",
        "p2pactor.version",
        "missing",
        id="extension_version_missing",
    ),
    invalid(
        {**vllm_connect(), "p2pactor": {"version": True, "features": []}},
        "connect",
        "p2pactor.version",
        "is bool, expected int",
        id="extension_version_bool",
    ),
    invalid(
        {**vllm_connect(), "p2pactor": {"version": 1, "features": ["ok", b"bad"]}},
        "connect",
        "p2pactor.features",
        "item 1 is bytes, expected str",
        id="extension_feature_not_str",
    ),
    invalid(
        {
            **vllm_connect(),
            "p2pactor": {"version": 1, "features": [f"f{i}" for i in range(MAX_FEATURES + 1)]},
        },
        "connect",
        "p2pactor.features",
        f"has {MAX_FEATURES + 1} items, more than the limit of {MAX_FEATURES}",
        id="extension_too_many_features",
    ),
    invalid(
        {
            **vllm_connect(),
            "p2pactor": {"version": 1, "features": ["ok", "x" * (MAX_FEATURE_CHARS + 1)]},
        },
        "connect",
        "p2pactor.features",
        f"item 1 is {MAX_FEATURE_CHARS + 1} characters",
        id="extension_feature_too_long",
    ),
    invalid(
        {**vllm_lookup(), "deadline_ms": MAX_DEADLINE_MS + 1},
        "lookup",
        "deadline_ms",
        f"more than the limit of {MAX_DEADLINE_MS}",
        id="lookup_deadline_out_of_range",
    ),
    invalid(
        {**vllm_lookup(), "deadline_ms": None},
        "lookup",
        "deadline_ms",
        "is nil, expected int",
        id="lookup_deadline_nil",
    ),
    invalid(
        {**vllm_lookup_resp(), "round_seq": -1},
        "lookup_resp",
        "round_seq",
        "is -1, expected at least 0",
        id="lookup_resp_round_seq_negative",
    ),
    # -- Connect and ConnectAck -----------------------------------------------
    invalid(
        without(vllm_connect(), "peer_id"),
        "connect",
        "peer_id",
        "missing",
        id="connect_missing_peer_id",
    ),
    invalid(
        {"type": "connect_ack", "peer_id": 5},
        "connect_ack",
        "peer_id",
        "is int, expected str",
        id="connect_ack_peer_id_not_str",
    ),
    invalid(
        without(vllm_connect(), "agent_metadata"),
        "connect",
        "agent_metadata",
        "missing",
        id="connect_missing_metadata",
    ),
    invalid(
        {**vllm_connect(), "agent_metadata": "not-bytes"},
        "connect",
        "agent_metadata",
        "is str, expected bytes",
        id="connect_wrong_metadata_type",
    ),
    invalid(
        {**vllm_connect(), "base_addr": -1},
        "connect",
        "base_addr",
        "is -1, expected at least 0",
        id="connect_negative_base_addr",
    ),
    invalid(
        {**vllm_connect(), "num_blocks": 0},
        "connect",
        "num_blocks",
        "is 0, expected at least 1",
        id="connect_num_blocks_zero",
    ),
    invalid(
        {**vllm_connect(), "num_blocks": MAX_NUM_BLOCKS + 1},
        "connect",
        "num_blocks",
        f"more than the limit of {MAX_NUM_BLOCKS}",
        id="connect_num_blocks_above_limit",
    ),
    invalid(
        {**vllm_connect(), "block_len": 0},
        "connect",
        "block_len",
        "is 0, expected at least 1",
        id="connect_block_len_zero",
    ),
    # vLLM's isinstance check would take True as num_blocks=1.
    invalid(
        {**vllm_connect(), "num_blocks": True},
        "connect",
        "num_blocks",
        "is bool, expected int",
        id="connect_bool_num_blocks",
    ),
    invalid(
        {**vllm_connect(), "base_addr": MAX_ADDRESS - 1000, "num_blocks": 2, "block_len": 1000},
        "connect",
        "base_addr",
        "past the 64-bit address space",
        id="connect_base_addr_overflow",
    ),
    invalid(
        without(vllm_connect(), "hash_seed"),
        "connect",
        "hash_seed",
        "missing",
        id="connect_missing_hash_seed",
    ),
    invalid(
        {**vllm_connect(), "hash_seed": 42},
        "connect",
        "hash_seed",
        "is int, expected str",
        id="connect_non_str_hash_seed",
    ),
    invalid(
        {**vllm_connect(), "config_fingerprint": None},
        "connect",
        "config_fingerprint",
        "is nil, expected str",
        id="connect_non_str_fingerprint",
    ),
    invalid(
        {**vllm_connect(), "peer_id": "h" * (MAX_STRING_CHARS + 1)},
        "connect",
        "peer_id",
        f"is {MAX_STRING_CHARS + 1} characters, more than the limit of {MAX_STRING_CHARS}",
        id="connect_oversized_string",
    ),
    invalid(
        {**vllm_connect(), "agent_metadata": bytes(MAX_AGENT_METADATA_BYTES + 1)},
        "connect",
        "agent_metadata",
        f"more than the limit of {MAX_AGENT_METADATA_BYTES}",
        # The frame bound is below the metadata's by default: raised, the
        # metadata's own bound is what refuses it.
        Limits(max_frame_bytes=MAX_AGENT_METADATA_BYTES + (1 << 20)),
        id="connect_oversized_metadata",
    ),
    invalid(
        {**vllm_connect(), "agent_metadata": bytes(9)},
        "connect",
        "agent_metadata",
        "is 9 bytes, more than the limit of 8",
        Limits(max_agent_metadata_bytes=8),
        id="connect_metadata_limit_is_configurable",
    ),
    # -- Fetch ----------------------------------------------------------------
    invalid(
        {**vllm_fetch(), "block_indexes": [7]},
        "fetch",
        "block_indexes",
        "has 1 items but 'keys' has 2",
        id="fetch_length_mismatch",
    ),
    invalid(
        {**vllm_fetch(), "block_indexes": [7, -1]},
        "fetch",
        "block_indexes",
        "item 1 is -1, expected at least 0",
        id="fetch_negative_index",
    ),
    invalid(
        {**vllm_fetch(), "block_indexes": [MAX_BLOCK_INDEX, MAX_BLOCK_INDEX + 1]},
        "fetch",
        "block_indexes",
        f"item 1 is {MAX_BLOCK_INDEX + 1}, more than the limit of {MAX_BLOCK_INDEX}",
        id="fetch_index_above_max",
    ),
    invalid(
        {**vllm_fetch(), "block_indexes": [7, True]},
        "fetch",
        "block_indexes",
        "item 1 is bool, expected int",
        id="fetch_bool_block_index",
    ),
    # -- Fields shared by several messages ------------------------------------
    *(
        invalid(
            {**wire, "round_seq": False},
            wire["type"],
            "round_seq",
            "is bool, expected int",
            id=f"bool_round_seq-{wire['type']}",
        )
        for wire in ROUND_SEQ_WIRES
    ),
    *(
        invalid(
            {**wire, "round_seq": -3},
            wire["type"],
            "round_seq",
            "is -3, expected at least 0",
            id=f"negative_round_seq-{wire['type']}",
        )
        for wire in ROUND_SEQ_WIRES
    ),
    *(
        invalid(
            without(wire, "kv_request_id"),
            wire["type"],
            "kv_request_id",
            "missing",
            id=f"missing_kv_request_id-{wire['type']}",
        )
        for wire in KV_REQUEST_ID_WIRES
    ),
    invalid(
        {**vllm_abort_fetch(), "kv_request_id": "r" * (MAX_STRING_CHARS + 1)},
        "abort_fetch",
        "kv_request_id",
        f"more than the limit of {MAX_STRING_CHARS}",
        id="oversized_kv_request_id",
    ),
    # -- TransferDone and LookupResp ------------------------------------------
    invalid(
        {**vllm_transfer_done(), "success": 1},
        "transfer_done",
        "success",
        "is int, expected bool",
        id="transfer_done_non_bool_success",
    ),
    invalid(
        {**vllm_lookup_resp(), "hits": [True, 0]},
        "lookup_resp",
        "hits",
        "item 1 is int, expected bool",
        id="lookup_resp_non_bool_hit",
    ),
    invalid(
        {**vllm_lookup_resp(), "hits": [True, False, True]},
        "lookup_resp",
        "hits",
        "has 3 items but 'keys' has 2",
        id="lookup_resp_length_mismatch",
    ),
    # -- Keys -----------------------------------------------------------------
    invalid(
        {**vllm_lookup(), "keys": [KEY_A, "deadbeef"]},
        "lookup",
        "keys",
        "item 1 is str, expected bytes",
        id="str_key_instead_of_bytes",
    ),
    # vLLM would turn 1_000_000 into a megabyte of zero bytes via bytes(n).
    invalid(
        {**vllm_fetch(), "keys": [1_000_000, KEY_B]},
        "fetch",
        "keys",
        "item 0 is int, expected bytes",
        id="int_key_is_rejected_not_coerced",
    ),
    invalid(
        {**vllm_lookup(), "keys": KEY_A},
        "lookup",
        "keys",
        "is bytes, expected list",
        id="keys_not_a_list",
    ),
    invalid(
        {**vllm_lookup(), "keys": [b""] * (MAX_LIST_ITEMS + 1)},
        "lookup",
        "keys",
        f"has {MAX_LIST_ITEMS + 1} items, more than the limit of {MAX_LIST_ITEMS}",
        id="oversized_key_list",
    ),
    invalid(
        {**vllm_lookup_resp(), "keys": [KEY_A, bytes(MAX_KEY_BYTES + 1)]},
        "lookup_resp",
        "keys",
        f"item 1 is {MAX_KEY_BYTES + 1} bytes, more than the limit of {MAX_KEY_BYTES}",
        id="oversized_key",
    ),
    # -- msgpack types in typed positions -------------------------------------
    invalid(
        {**vllm_abort_ack(), "round_seq": msgspec.msgpack.Ext(5, b"\x01")},
        "abort_ack",
        "round_seq",
        "is Ext, expected int",
        id="ext_type_in_typed_position",
    ),
    invalid(
        {**vllm_connect_ack(), "peer_id": datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)},
        "connect_ack",
        "peer_id",
        "is datetime, expected str",
        id="timestamp_in_typed_position",
    ),
    invalid(
        {**vllm_fetch(), "block_indexes": [7, 3.0]},
        "fetch",
        "block_indexes",
        "item 1 is float, expected int",
        id="float_in_typed_position",
    ),
    # -- Limits ---------------------------------------------------------------
    invalid(
        vllm_lookup(),
        "lookup",
        "keys",
        "has 2 items, more than the limit of 1",
        Limits(max_list_items=1),
        id="limits_list_bound_is_configurable",
    ),
    invalid(
        vllm_lookup(),
        "lookup",
        "keys",
        "item 0 is 36 bytes, more than the limit of 8",
        Limits(max_key_bytes=8),
        id="limits_key_bound_is_configurable",
    ),
    invalid(
        vllm_fetch(),
        "fetch",
        "block_indexes",
        "item 1 is 300, more than the limit of 100",
        Limits(max_block_index=100),
        id="limits_block_index_bound_is_configurable",
    ),
    invalid(
        vllm_lookup(),
        "lookup",
        "round_seq",
        "is 2, more than the limit of 1",
        Limits(max_round_seq=1),
        id="limits_round_bound_is_configurable",
    ),
    invalid(
        {**vllm_connect(), "p2pactor": {"version": 1, "features": ["a", "b"]}},
        "connect",
        "p2pactor.features",
        "has 2 items, more than the limit of 1",
        Limits(max_features=1),
        id="limits_nested_bound_is_configurable",
    ),
]


@pytest.mark.parametrize(("wire", "message_type", "field", "problem", "limits"), INVALID)
def test_invalid_field(
    wire: object, message_type: str, field: str, problem: str, limits: Limits
) -> None:
    expect_invalid(wire, message_type=message_type, field=field, problem=problem, limits=limits)


def test_every_bound_a_node_can_tighten_bounds_some_field() -> None:
    # Each Limits attribute but the frame's (checked before decoding) names a
    # field type's bound; a tightened copy of it refuses what the default takes.
    tunable = {f.name for f in attrs.fields(Limits)} - {"max_frame_bytes"}
    wired = {
        info.extra["limit"]
        for cls in MESSAGE_TYPES.values()
        for info in _bounds(msgspec.inspect.type_info(cls))
    }
    assert wired == tunable
    lookup = frame_of(vllm_lookup())
    assert decode(lookup, limits=Limits(max_list_items=2)) == decode(lookup)


def _bounds(info: Any) -> list[Any]:
    """Every inspected type under ``info`` with a Meta ``extra`` (a bound a node tightens)."""
    found = [info] if getattr(info, "extra", None) else []
    for child in (getattr(info, "type", None), getattr(info, "item_type", None)):
        if child is not None:
            found += _bounds(child)
    for field in getattr(info, "fields", ()):
        found += _bounds(field.type)
    return found


def test_connect_valid() -> None:
    msg = decode(frame_of(vllm_connect()))
    assert msg == PAIRS[0][0]


def test_connect_region_ending_at_top_of_address_space_is_accepted() -> None:
    wire = {**vllm_connect(), "base_addr": MAX_ADDRESS - 2000, "num_blocks": 2, "block_len": 1000}
    msg = decode(frame_of(wire))
    assert isinstance(msg, Connect)
    assert msg.base_addr == MAX_ADDRESS - 2000


def test_fetch_valid() -> None:
    assert decode(frame_of(vllm_fetch())) == PAIRS[5][0]


def test_full_key_list_is_accepted() -> None:
    msg = decode(frame_of({**vllm_lookup(), "keys": [KEY_A] * MAX_LIST_ITEMS}))
    assert isinstance(msg, Lookup)
    assert len(msg.keys) == MAX_LIST_ITEMS


def test_full_lookup_decodes_quickly() -> None:
    # About 6 ms on a laptop; the bound is loose so a loaded CI box passes.
    keys = [i.to_bytes(32, "big") + bytes(4) for i in range(MAX_LIST_ITEMS)]
    frame = encode(Lookup(kv_request_id="req-1", keys=keys, round_seq=0))
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        decode(frame)
        best = min(best, time.perf_counter() - start)
    assert best < 0.1


def test_unknown_extra_keys_are_ignored() -> None:
    wire = {**vllm_transfer_done(), "from_the_future": {"x": [1, 2.5, None]}}
    assert decode(frame_of(wire)) == PAIRS[6][0]


# Framing
# ---------------------------------------------------------------------------


def test_frame_over_the_limit_rejected_before_decoding() -> None:
    # Garbage that would be a MalformedFrame if it were decoded at all.
    frame = b"\xc1" * 101
    with pytest.raises(FrameTooLarge, match="101 bytes, more than the limit of 100"):
        decode(frame, limits=Limits(max_frame_bytes=100))
    with pytest.raises(MalformedFrame):
        decode(frame, limits=Limits(max_frame_bytes=101))


def test_unknown_extra_keys_count_toward_the_frame_limit() -> None:
    frame = frame_of({**vllm_disconnect(), "padding": bytes(200)})
    assert decode(frame, limits=Limits(max_frame_bytes=len(frame))) == Disconnect()
    with pytest.raises(FrameTooLarge):
        decode(frame, limits=Limits(max_frame_bytes=len(frame) - 1))


def test_default_frame_limit_fits_a_big_connect_and_the_largest_vllm_lookup() -> None:
    # Below the metadata bound on purpose (what one hostile frame may cost,
    # issue 30), but far above what a NIXL agent's metadata is (about 500
    # bytes for a DRAM pool) and above the largest lookup vLLM makes.
    assert DEFAULT_LIMITS.max_frame_bytes == DEFAULT_MAX_FRAME_BYTES
    assert DEFAULT_MAX_FRAME_BYTES < MAX_AGENT_METADATA_BYTES
    big = 15 << 20
    connect = frame_of(
        {
            **vllm_connect(),
            "peer_id": "p" * MAX_STRING_CHARS,
            "agent_metadata": b"m" * big,
            "config_fingerprint": "f" * MAX_STRING_CHARS,
            "hash_seed": "s" * MAX_STRING_CHARS,
        }
    )
    assert len(connect) <= DEFAULT_MAX_FRAME_BYTES
    assert isinstance(decode(connect), Connect)
    keys = [bytes(32) + i.to_bytes(4, "big") for i in range(MAX_LIST_ITEMS)]
    lookup = frame_of({**vllm_lookup(), "kv_request_id": "r" * MAX_STRING_CHARS, "keys": keys})
    assert len(lookup) <= DEFAULT_MAX_FRAME_BYTES
    assert isinstance(decode(lookup), Lookup)


def test_unknown_type_reported_by_name() -> None:
    with pytest.raises(UnknownMessageType) as info:
        decode(frame_of({"type": "gossip", "x": 1}))
    assert info.value.message_type == "gossip"
    assert "'gossip'" in str(info.value)


def test_unknown_type_name_is_clipped() -> None:
    with pytest.raises(UnknownMessageType) as info:
        decode(frame_of({"type": "z" * 10_000}))
    assert len(str(info.value)) < 500


@pytest.mark.parametrize(
    ("frame", "error", "match"),
    [
        pytest.param(
            frame_of(["type", "connect"]),
            MalformedFrame,
            "top-level value is list, expected a map",
            id="non_map_top_level",
        ),
        pytest.param(frame_of({}), MalformedFrame, "no 'type' key", id="empty_map"),
        pytest.param(
            frame_of({"type": b"connect"}),
            MalformedFrame,
            "'type' is bytes, expected str",
            id="type_not_str",
        ),
        pytest.param(b"\xc1\x00garbage", MalformedFrame, "not valid msgpack", id="garbage_bytes"),
        pytest.param(b"", MalformedFrame, None, id="empty_frame"),
        pytest.param(
            frame_of(vllm_disconnect()) + b"\x00", MalformedFrame, None, id="trailing_bytes"
        ),
        pytest.param(b"\x81\xa4type\xa2\xff\xfe", MalformedFrame, None, id="invalid_utf8"),
        pytest.param(b"\x91" * 200_000 + b"\xc0", ProtocolError, None, id="deep_nesting"),
        pytest.param(
            b"\xdd\xff\xff\xff\xff", MalformedFrame, None, id="truncated_huge_array_header"
        ),
        # Sessions treat ValueError-class violations as grounds to disconnect.
        pytest.param(b"\xc1", ValueError, None, id="protocol_errors_are_value_errors"),
    ],
)
def test_rejected_frame(frame: bytes, error: type[Exception], match: str | None) -> None:
    with pytest.raises(error, match=match):
        decode(frame)


# ---------------------------------------------------------------------------
# Limits
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        pytest.param({"max_list_items": -1}, "max_list_items", id="limits_reject_negative_bound"),
        pytest.param(
            {"max_frame_bytes": 0}, "max_frame_bytes", id="limits_reject_zero_frame_bound"
        ),
        pytest.param({"max_key_bytes": True}, "max_key_bytes is bool", id="limits_reject_non_int"),
        pytest.param(
            {"max_list_items": MAX_LIST_ITEMS + 1},
            f"max_list_items is {MAX_LIST_ITEMS + 1}, above the protocol's own bound",
            id="limits_reject_a_bound_above_the_protocols",
        ),
    ],
)
def test_limits_reject(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Limits(**kwargs)
