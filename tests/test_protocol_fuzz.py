"""Property tests of the wire codec, ``p2pactor.core.protocol``, with hypothesis.

Two properties. Robustness: whatever bytes a peer sends (random bytes, random
msgpack structures, maps that look like one of the twelve messages with fields
of random types, valid messages with one field mutated), ``decode`` either
returns a message that re-encodes and decodes to itself, or raises a
``ProtocolError`` subclass, and nothing else. Fidelity: every valid message
round-trips exactly, with deterministic bytes, and without extensions its map
has exactly vLLM 0.33.0's keys in vLLM's order (the summary extension's
messages, which only p2pactor peers send, have their own keys in theirs).
"""

from __future__ import annotations

import datetime
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pactor.core.protocol import (
    MAX_ADDRESS,
    MAX_BLOCK_INDEX,
    MAX_BLOCK_LEN,
    MAX_DEADLINE_MS,
    MAX_EXTENSION_VERSION,
    MAX_FEATURE_CHARS,
    MAX_FEATURES,
    MAX_NUM_BLOCKS,
    MAX_ROUND_SEQ,
    MESSAGE_TYPES,
    UNSET,
    AbortAck,
    AbortFetch,
    Connect,
    ConnectAck,
    ConnectExtension,
    Disconnect,
    Fetch,
    KvsumDelta,
    KvsumResync,
    KvsumSnapshot,
    Lookup,
    LookupResp,
    Message,
    TransferDone,
    decode,
    encode,
    packed,
)
from p2pactor.errors import ProtocolError

# 200 examples a property, twice Hypothesis's default: generating the nested
# values is what the file's time goes to (400 took twice as long).
FUZZ = settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# The keys vLLM 0.33.0 writes for each message, in its order.
VLLM_KEYS: dict[str, list[str]] = {
    "connect": [
        "type",
        "peer_id",
        "agent_metadata",
        "base_addr",
        "num_blocks",
        "block_len",
        "config_fingerprint",
        "hash_seed",
    ],
    "connect_ack": ["type", "peer_id"],
    "disconnect": ["type"],
    "lookup": ["type", "kv_request_id", "keys", "round_seq"],
    "lookup_resp": ["type", "kv_request_id", "keys", "hits"],
    "fetch": ["type", "kv_request_id", "keys", "block_indexes", "round_seq"],
    "transfer_done": ["type", "kv_request_id", "success", "round_seq"],
    "abort_fetch": ["type", "kv_request_id", "round_seq"],
    "abort_ack": ["type", "kv_request_id", "round_seq"],
}
EXTENSION_KEYS = ["p2pactor", "deadline_ms", "round_seq"]
# The summary extension's messages (p2pactor peers only), in the order written.
SUMMARY_KEYS: dict[str, list[str]] = {
    "kvsum_delta": ["type", "epoch", "seq", "add", "remove"],
    "kvsum_snapshot": ["type", "epoch", "upto_seq", "part", "parts", "fps"],
    "kvsum_resync": ["type", "epoch", "from_seq"],
}
WIRE_KEYS = {**VLLM_KEYS, **SUMMARY_KEYS}
ALL_FIELDS = sorted({key for keys in WIRE_KEYS.values() for key in keys[1:]} | set(EXTENSION_KEYS))


# ---------------------------------------------------------------------------
# Valid messages, one strategy per type
# ---------------------------------------------------------------------------

ids = st.text(max_size=24)
round_seqs = st.integers(min_value=0, max_value=MAX_ROUND_SEQ)
offload_keys = st.binary(max_size=40)


@st.composite
def connects(draw: st.DrawFn) -> Connect:
    num_blocks = draw(st.integers(min_value=1, max_value=MAX_NUM_BLOCKS))
    block_len = draw(st.integers(min_value=1, max_value=MAX_BLOCK_LEN))
    base_addr = draw(st.integers(min_value=0, max_value=MAX_ADDRESS - num_blocks * block_len))
    extension = draw(
        st.just(UNSET)
        | st.builds(
            ConnectExtension,
            version=st.integers(min_value=0, max_value=MAX_EXTENSION_VERSION),
            features=st.frozensets(st.text(max_size=MAX_FEATURE_CHARS), max_size=MAX_FEATURES),
        )
    )
    return Connect(
        peer_id=draw(ids),
        agent_metadata=draw(st.binary(max_size=64)),
        base_addr=base_addr,
        num_blocks=num_blocks,
        block_len=block_len,
        config_fingerprint=draw(ids),
        hash_seed=draw(ids),
        extension=extension,
    )


@st.composite
def lookup_resps(draw: st.DrawFn) -> LookupResp:
    keys = draw(st.lists(offload_keys, max_size=16).map(tuple))
    hits = draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)).map(tuple))
    return LookupResp(
        kv_request_id=draw(ids),
        keys=keys,
        hits=hits,
        round_seq=draw(st.just(UNSET) | round_seqs),
    )


@st.composite
def fetches(draw: st.DrawFn) -> Fetch:
    keys = draw(st.lists(offload_keys, max_size=16).map(tuple))
    indexes = draw(
        st.lists(
            st.integers(min_value=0, max_value=MAX_BLOCK_INDEX),
            min_size=len(keys),
            max_size=len(keys),
        ).map(tuple)
    )
    return Fetch(
        kv_request_id=draw(ids), keys=keys, block_indexes=indexes, round_seq=draw(round_seqs)
    )


epochs = st.binary(min_size=1, max_size=64)
packed_fps = st.lists(st.integers(min_value=0, max_value=2**64 - 1), max_size=8).map(packed)


@st.composite
def snapshots(draw: st.DrawFn) -> KvsumSnapshot:
    parts = draw(st.integers(min_value=1, max_value=MAX_NUM_BLOCKS + 1))
    return KvsumSnapshot(
        epoch=draw(epochs),
        upto_seq=draw(round_seqs),
        part=draw(st.integers(min_value=0, max_value=parts - 1)),
        parts=parts,
        fps=draw(packed_fps),
    )


messages: st.SearchStrategy[Message] = st.one_of(
    connects(),
    st.builds(ConnectAck, peer_id=ids),
    st.just(Disconnect()),
    st.builds(
        Lookup,
        kv_request_id=ids,
        keys=st.lists(offload_keys, max_size=16).map(tuple),
        round_seq=round_seqs,
        deadline_ms=st.just(UNSET) | st.integers(min_value=0, max_value=MAX_DEADLINE_MS),
    ),
    lookup_resps(),
    fetches(),
    st.builds(TransferDone, kv_request_id=ids, success=st.booleans(), round_seq=round_seqs),
    st.builds(AbortFetch, kv_request_id=ids, round_seq=round_seqs),
    st.builds(AbortAck, kv_request_id=ids, round_seq=round_seqs),
    st.builds(
        KvsumDelta,
        epoch=epochs,
        seq=round_seqs,
        add=packed_fps,
        remove=packed_fps,
    ),
    snapshots(),
    st.builds(KvsumResync, epoch=st.binary(max_size=64), from_seq=round_seqs),
)


# ---------------------------------------------------------------------------
# Arbitrary msgpack values
# ---------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    # The whole msgpack int range, edges included.
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from([-(2**63), -1, 0, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1]),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.binary(max_size=20),
    st.builds(
        msgspec.msgpack.Ext,
        st.integers(min_value=-128, max_value=127),
        st.binary(max_size=12),
    ),
    st.datetimes(timezones=st.just(datetime.UTC)),
)
map_keys = st.one_of(st.text(max_size=12), st.integers(-5, 5), st.binary(max_size=4))
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(map_keys, children, max_size=6)
    ),
    max_leaves=24,
)

# Per field, a value of roughly the right type (bounds and lengths ignored),
# so that fuzzed maps get past the first field check often enough.
small_ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
key_lists = st.lists(st.binary(max_size=8), max_size=4)
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "peer_id": ids,
    "agent_metadata": st.binary(max_size=8),
    "base_addr": small_ints,
    "num_blocks": small_ints,
    "block_len": small_ints,
    "config_fingerprint": ids,
    "hash_seed": ids,
    "kv_request_id": ids,
    "keys": key_lists,
    "hits": st.lists(st.booleans(), max_size=4),
    "block_indexes": st.lists(small_ints, max_size=4),
    "round_seq": small_ints,
    "success": st.booleans(),
    "deadline_ms": small_ints,
    "epoch": st.binary(max_size=20),
    "seq": small_ints,
    "upto_seq": small_ints,
    "from_seq": small_ints,
    "part": small_ints,
    "parts": small_ints,
    "add": st.binary(max_size=24),
    "remove": st.binary(max_size=24),
    "fps": st.binary(max_size=24),
    "p2pactor": st.fixed_dictionaries(
        {}, optional={"version": small_ints, "features": st.lists(ids, max_size=3)}
    ),
}
assert set(PLAUSIBLE) == set(ALL_FIELDS)


def fake_message(type_name: str) -> st.SearchStrategy[dict[str, Any]]:
    """Maps that claim to be a ``type_name``: its fields present, each of them
    plausible two times in three and random otherwise, plus any other field.

    This reaches the later field checks far more often than random maps do.
    """
    base = WIRE_KEYS[type_name][1:]

    def field_value(field: str) -> st.SearchStrategy[Any]:
        return st.one_of(PLAUSIBLE[field], PLAUSIBLE[field], values)

    return st.fixed_dictionaries(
        {"type": st.just(type_name), **{field: field_value(field) for field in base}},
        optional={field: field_value(field) for field in ALL_FIELDS if field not in base},
    )


fake_messages = st.sampled_from(sorted(MESSAGE_TYPES)).flatmap(fake_message)


@st.composite
def mutated_messages(draw: st.DrawFn) -> dict[Any, Any]:
    """A valid message's map with one field replaced by a random value or removed."""
    wire: dict[Any, Any] = msgspec.msgpack.decode(encode(draw(messages)))
    field = draw(st.sampled_from([*wire, *EXTENSION_KEYS, "unknown"]))
    if draw(st.booleans()):
        wire.pop(field, None)
    else:
        wire[field] = draw(values)
    return wire


def check_decode(frame: bytes) -> None:
    """The robustness property: a sound message, or a ProtocolError."""
    try:
        msg = decode(frame)
    except ProtocolError:
        return
    assert type(msg) is MESSAGE_TYPES[msg.TYPE]
    again = encode(msg)
    assert decode(again) == msg
    assert encode(decode(again)) == again


def encodable(value: object) -> bytes | None:
    try:
        return msgspec.msgpack.encode(value)
    except (TypeError, OverflowError, ValueError):
        return None


# ---------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes(frame: bytes) -> None:
    check_decode(frame)


@FUZZ
@given(st.binary(max_size=64))
def test_random_bytes_after_a_map_header(tail: bytes) -> None:
    # Random bytes mostly fail at the first byte; a map header forces the
    # decoder deeper.
    check_decode(b"\x82\xa4type\xa5fetch" + tail)


@FUZZ
@given(values)
def test_random_structures(value: object) -> None:
    frame = encodable(value)
    if frame is not None:
        check_decode(frame)


@FUZZ
@given(fake_messages)
def test_maps_shaped_like_messages(wire: dict[str, Any]) -> None:
    frame = encodable(wire)
    if frame is not None:
        check_decode(frame)


@FUZZ
@given(mutated_messages())
def test_valid_messages_with_one_field_mutated(wire: dict[Any, Any]) -> None:
    frame = encodable(wire)
    if frame is not None:
        check_decode(frame)


@FUZZ
@given(messages)
def test_valid_messages_round_trip(msg: Message) -> None:
    frame = encode(msg)
    assert decode(frame) == msg
    assert encode(decode(frame)) == frame


@FUZZ
@given(messages)
def test_keys_are_vllms_in_vllms_order_and_summaries_in_theirs(msg: Message) -> None:
    keys = list(msgspec.msgpack.decode(encode(msg)))
    if msg.TYPE in SUMMARY_KEYS:
        assert keys == SUMMARY_KEYS[msg.TYPE]
        return
    base = VLLM_KEYS[msg.TYPE]
    assert keys[: len(base)] == base
    # Extensions only ever follow the base keys, and only when set.
    assert set(keys[len(base) :]) <= set(EXTENSION_KEYS)
    has_extension = (
        (isinstance(msg, Connect) and msg.extension is not UNSET)
        or (isinstance(msg, Lookup) and msg.deadline_ms is not UNSET)
        or (isinstance(msg, LookupResp) and msg.round_seq is not UNSET)
    )
    assert (len(keys) > len(base)) == has_extension
