"""The wire codec: p2pactor messages to and from msgpack frames.

The base dialect is byte-for-byte what vLLM 0.33.0's built-in P2P tier speaks
(see ``PROTOCOL.md``): one msgpack map per frame, ``"type"`` first, then the
fields in the order vLLM writes them, keys as msgpack bin. Extensions are
optional fields that only p2pactor peers send; when a message carries none,
its bytes are exactly the base dialect, so a stock vLLM peer never notices.

Decoding is strict where vLLM is lenient: exact types (a bool is not an int,
a key is bytes and nothing else), bounds on every list, string and number,
and parallel lists of equal length. Whatever the input, :func:`decode` raises
only :class:`~p2pactor.errors.ProtocolError` subclasses, because a peer's
bytes must never crash the node that reads them.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Final, TypeAlias, assert_never

import attrs
import msgspec

from p2pactor.errors import (
    ConfigError,
    FrameTooLarge,
    InvalidField,
    MalformedFrame,
    UnknownMessageType,
)

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_MAX_FRAME_BYTES",
    "EXTENSION_KEY",
    "MAX_ADDRESS",
    "MAX_AGENT_METADATA_BYTES",
    "MAX_BLOCK_INDEX",
    "MAX_BLOCK_LEN",
    "MAX_DEADLINE_MS",
    "MAX_EXTENSION_VERSION",
    "MAX_FEATURES",
    "MAX_FEATURE_CHARS",
    "MAX_KEY_BYTES",
    "MAX_LIST_ITEMS",
    "MAX_NUM_BLOCKS",
    "MAX_ROUND_SEQ",
    "MAX_STRING_CHARS",
    "MESSAGE_TYPES",
    "AbortAck",
    "AbortFetch",
    "Connect",
    "ConnectAck",
    "ConnectExtension",
    "Disconnect",
    "Fetch",
    "Limits",
    "Lookup",
    "LookupResp",
    "Message",
    "TransferDone",
    "decode",
    "encode",
]

# ---------------------------------------------------------------------------
# Bounds
# ---------------------------------------------------------------------------

MAX_LIST_ITEMS: Final = 65_536
"""Most items in one list field (``keys``, ``hits``, ``block_indexes``)."""

MAX_KEY_BYTES: Final = 4_096
"""Longest offload key, in bytes (a vLLM key is a hash plus 4 bytes)."""

MAX_STRING_CHARS: Final = 4_096
"""Longest string field (peer ids, request ids, fingerprints, hash seeds)."""

MAX_AGENT_METADATA_BYTES: Final = 64 * 1024 * 1024
"""Largest NIXL agent metadata blob a ``connect`` may carry."""

MAX_BLOCK_INDEX: Final = 2**31 - 1
"""Largest block index a ``fetch`` may name."""

MAX_DEADLINE_MS: Final = 3_600_000
"""Largest lookup budget a ``lookup`` extension may ask for (one hour)."""

MAX_ROUND_SEQ: Final = 2**63 - 1
"""Largest round number; fits a signed 64-bit counter on any peer."""

MAX_NUM_BLOCKS: Final = 2**31 - 1
"""Most blocks a peer may advertise in its ``connect``."""

MAX_BLOCK_LEN: Final = 2**31 - 1
"""Largest block a peer may advertise in its ``connect``, in bytes."""

MAX_ADDRESS: Final = 2**64 - 1
"""Highest address: a peer's block region must end within 64 bits."""

MAX_FEATURES: Final = 64
"""Most feature names in the ``p2pactor`` extension of a ``connect``."""

MAX_FEATURE_CHARS: Final = 64
"""Longest feature name in the ``p2pactor`` extension of a ``connect``."""

MAX_EXTENSION_VERSION: Final = 2**31 - 1
"""Largest version number in the ``p2pactor`` extension of a ``connect``."""

DEFAULT_MAX_FRAME_BYTES: Final = MAX_AGENT_METADATA_BYTES + 1024 * 1024
"""Largest frame :func:`decode` reads by default: the metadata bound plus room
for the other ``connect`` fields and for a full 65,536-key lookup."""

EXTENSION_KEY: Final = "p2pactor"
"""The ``connect`` key under which p2pactor peers advertise their extensions."""


@attrs.frozen(kw_only=True)
class Limits:
    """The bounds :func:`decode` enforces, so a node can tune them.

    Every bound is inclusive. Raising ``max_agent_metadata_bytes`` or the list
    and key bounds usually means raising ``max_frame_bytes`` too, since the
    frame bound is checked first.

    Attributes:
        max_frame_bytes: Largest frame read at all; larger ones are rejected
            before any decoding.
        max_list_items: Most items in one list field.
        max_key_bytes: Longest offload key.
        max_string_chars: Longest string field, in characters.
        max_agent_metadata_bytes: Largest ``agent_metadata`` blob.
        max_block_index: Largest block index in a ``fetch``.
        max_round_seq: Largest ``round_seq``.
        max_deadline_ms: Largest ``deadline_ms`` on a ``lookup``.
        max_num_blocks: Largest ``num_blocks`` in a ``connect``.
        max_block_len: Largest ``block_len`` in a ``connect``.
        max_features: Most feature names in a ``connect`` extension.
        max_feature_chars: Longest feature name in a ``connect`` extension.

    Raises:
        ConfigError: A bound is not an int, or is negative (zero, for the
            frame, ``num_blocks`` and ``block_len`` bounds).
    """

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_list_items: int = MAX_LIST_ITEMS
    max_key_bytes: int = MAX_KEY_BYTES
    max_string_chars: int = MAX_STRING_CHARS
    max_agent_metadata_bytes: int = MAX_AGENT_METADATA_BYTES
    max_block_index: int = MAX_BLOCK_INDEX
    max_round_seq: int = MAX_ROUND_SEQ
    max_deadline_ms: int = MAX_DEADLINE_MS
    max_num_blocks: int = MAX_NUM_BLOCKS
    max_block_len: int = MAX_BLOCK_LEN
    max_features: int = MAX_FEATURES
    max_feature_chars: int = MAX_FEATURE_CHARS

    def __attrs_post_init__(self) -> None:
        # A zero bound on these would reject every valid connect or frame,
        # which is a misconfiguration, not a policy.
        positive = {"max_frame_bytes", "max_num_blocks", "max_block_len"}
        for field in attrs.fields(Limits):
            value = getattr(self, field.name)
            if type(value) is not int:
                raise ConfigError(
                    f"Limits.{field.name} is {type(value).__name__}; set it to an int"
                )
            least = 1 if field.name in positive else 0
            if value < least:
                raise ConfigError(f"Limits.{field.name} is {value}; set it to {least} or more")


DEFAULT_LIMITS: Final = Limits()
"""The bounds :func:`decode` uses unless told otherwise."""


# ---------------------------------------------------------------------------
# Messages
# ---------------------------------------------------------------------------


# Converters for sequence fields, here and in the core's events and inputs: any
# iterable in (a list from a decoded frame, say), an immutable tuple stored.
# Typed functions, not ``converter=tuple``, so mypy's attrs plugin knows the
# constructor's argument types.
def bytes_tuple(items: Iterable[bytes]) -> tuple[bytes, ...]:
    """The byte strings (keys, mostly) as a tuple."""
    return tuple(items)


def bool_tuple(items: Iterable[bool]) -> tuple[bool, ...]:
    """The booleans as a tuple."""
    return tuple(items)


def int_tuple(items: Iterable[int]) -> tuple[int, ...]:
    """The integers as a tuple."""
    return tuple(items)


def _str_frozenset(items: Iterable[str]) -> frozenset[str]:
    # A bare str is an Iterable[str] too; its letters are never what was meant.
    if isinstance(items, str):
        raise TypeError("features must be a collection of str, not one str")
    return frozenset(items)


@attrs.frozen(kw_only=True)
class ConnectExtension:
    """The ``p2pactor`` map of a ``connect``: which extensions the sender speaks.

    A stock vLLM peer never sends it; a peer that does is a p2pactor node.
    Unknown keys inside the map are ignored, so later versions can add some.

    Attributes:
        version: The sender's extension protocol version.
        features: Names of the optional extensions the sender supports.
            Encoded as a sorted list so the bytes are deterministic.
    """

    version: int
    features: frozenset[str] = attrs.field(factory=frozenset, converter=_str_frozenset)


@attrs.frozen(kw_only=True)
class Connect:
    """Handshake opener, sent both ways as soon as a connection exists.

    Attributes:
        peer_id: The sender's own ``HOST:PORT`` id.
        agent_metadata: The sender's NIXL agent metadata (opaque).
        base_addr: Base address of the sender's KV block region.
        num_blocks: Number of blocks in that region.
        block_len: Size of one block, in bytes; must equal the receiver's.
        config_fingerprint: Hash of the block layout, or ``""`` if unknown.
            Compared only when both sides have one. A stock peer may omit it
            on the wire; it then decodes as ``""``.
        hash_seed: The sender's effective prefix-cache hash seed; must
            equal the receiver's.
        extension: p2pactor extensions the sender speaks, or None for a
            stock vLLM peer (and then absent from the wire).
    """

    TYPE: ClassVar[str] = "connect"

    peer_id: str
    agent_metadata: bytes
    base_addr: int
    num_blocks: int
    block_len: int
    config_fingerprint: str = ""
    hash_seed: str
    extension: ConnectExtension | None = None


@attrs.frozen(kw_only=True)
class ConnectAck:
    """Reply to a ``connect``: the acker has registered the sender's memory.

    Attributes:
        peer_id: The acker's own ``HOST:PORT`` id.
    """

    TYPE: ClassVar[str] = "connect_ack"

    peer_id: str


@attrs.frozen(kw_only=True)
class Disconnect:
    """Graceful close, sent by either side. Carries no fields."""

    TYPE: ClassVar[str] = "disconnect"


@attrs.frozen(kw_only=True)
class Lookup:
    """Consumer to producer: which of these keys do you hold?

    Attributes:
        kv_request_id: The request the keys belong to.
        keys: Offload keys to probe, in order; duplicates allowed.
        round_seq: The lookup round these probes belong to.
        deadline_ms: Extension: the consumer's remaining lookup budget, or
            None (absent from the wire, as a stock peer sends it).
    """

    TYPE: ClassVar[str] = "lookup"

    kv_request_id: str
    keys: tuple[bytes, ...] = attrs.field(converter=bytes_tuple)
    round_seq: int
    deadline_ms: int | None = None


@attrs.frozen(kw_only=True)
class LookupResp:
    """Producer to consumer: the answer to one ``lookup``, one bool per key.

    Attributes:
        kv_request_id: The request the lookup belonged to.
        keys: The looked-up keys, in wire order, duplicates included.
        hits: Parallel to ``keys``: True if the producer holds (and has
            pinned) the block.
        round_seq: Extension: the round of the lookup this answers, or None
            (absent from the wire; stock vLLM sends no round here).
    """

    TYPE: ClassVar[str] = "lookup_resp"

    kv_request_id: str
    keys: tuple[bytes, ...] = attrs.field(converter=bytes_tuple)
    hits: tuple[bool, ...] = attrs.field(converter=bool_tuple)
    round_seq: int | None = None


@attrs.frozen(kw_only=True)
class Fetch:
    """Consumer to producer: write these blocks into mine, closing a round.

    An empty fetch (no keys, no indexes) closes the whole request instead.

    Attributes:
        kv_request_id: The request the blocks belong to.
        keys: Offload keys to transfer.
        block_indexes: Parallel to ``keys``: the consumer's block index each
            key is written into.
        round_seq: The round this fetch closes.
    """

    TYPE: ClassVar[str] = "fetch"

    kv_request_id: str
    keys: tuple[bytes, ...] = attrs.field(converter=bytes_tuple)
    block_indexes: tuple[int, ...] = attrs.field(converter=int_tuple)
    round_seq: int


@attrs.frozen(kw_only=True)
class TransferDone:
    """Producer to consumer: a fetch round's transfers have finished.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        success: Whether every block was written.
        round_seq: The round of the fetch.
    """

    TYPE: ClassVar[str] = "transfer_done"

    kv_request_id: str
    success: bool
    round_seq: int


@attrs.frozen(kw_only=True)
class AbortFetch:
    """Consumer to producer: cancel a fetch round.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        round_seq: The round to cancel.
    """

    TYPE: ClassVar[str] = "abort_fetch"

    kv_request_id: str
    round_seq: int


@attrs.frozen(kw_only=True)
class AbortAck:
    """Producer to consumer: no transfer of the aborted round can still run.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        round_seq: The round that was cancelled.
    """

    TYPE: ClassVar[str] = "abort_ack"

    kv_request_id: str
    round_seq: int


Message: TypeAlias = (
    Connect
    | ConnectAck
    | Disconnect
    | Lookup
    | LookupResp
    | Fetch
    | TransferDone
    | AbortFetch
    | AbortAck
)
"""Any message of the protocol."""

_MESSAGE_CLASSES: Final[tuple[type[Message], ...]] = (
    Connect,
    ConnectAck,
    Disconnect,
    Lookup,
    LookupResp,
    Fetch,
    TransferDone,
    AbortFetch,
    AbortAck,
)

MESSAGE_TYPES: Final[Mapping[str, type[Message]]] = types.MappingProxyType(
    {cls.TYPE: cls for cls in _MESSAGE_CLASSES}
)
"""Each message class by its wire ``"type"`` string."""


# ---------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------

_ENCODER: Final = msgspec.msgpack.Encoder()


def _to_wire(msg: Message) -> dict[str, object]:
    # Insertion order is wire order; vLLM 0.33.0 builds its dicts in exactly
    # this order, and extension keys go last so the base prefix is unchanged.
    wire: dict[str, object]
    match msg:
        case Connect():
            wire = {
                "type": msg.TYPE,
                "peer_id": msg.peer_id,
                "agent_metadata": msg.agent_metadata,
                "base_addr": msg.base_addr,
                "num_blocks": msg.num_blocks,
                "block_len": msg.block_len,
                "config_fingerprint": msg.config_fingerprint,
                "hash_seed": msg.hash_seed,
            }
            if msg.extension is not None:
                wire[EXTENSION_KEY] = {
                    "version": msg.extension.version,
                    "features": sorted(msg.extension.features),
                }
        case ConnectAck():
            wire = {"type": msg.TYPE, "peer_id": msg.peer_id}
        case Disconnect():
            wire = {"type": msg.TYPE}
        case Lookup():
            wire = {
                "type": msg.TYPE,
                "kv_request_id": msg.kv_request_id,
                "keys": msg.keys,
                "round_seq": msg.round_seq,
            }
            if msg.deadline_ms is not None:
                wire["deadline_ms"] = msg.deadline_ms
        case LookupResp():
            wire = {
                "type": msg.TYPE,
                "kv_request_id": msg.kv_request_id,
                "keys": msg.keys,
                "hits": msg.hits,
            }
            if msg.round_seq is not None:
                wire["round_seq"] = msg.round_seq
        case Fetch():
            wire = {
                "type": msg.TYPE,
                "kv_request_id": msg.kv_request_id,
                "keys": msg.keys,
                "block_indexes": msg.block_indexes,
                "round_seq": msg.round_seq,
            }
        case TransferDone():
            wire = {
                "type": msg.TYPE,
                "kv_request_id": msg.kv_request_id,
                "success": msg.success,
                "round_seq": msg.round_seq,
            }
        case AbortFetch() | AbortAck():
            wire = {
                "type": msg.TYPE,
                "kv_request_id": msg.kv_request_id,
                "round_seq": msg.round_seq,
            }
        case _:
            assert_never(msg)
    return wire


def encode(msg: Message) -> bytes:
    """Encode a message as one msgpack frame.

    The bytes equal what vLLM 0.33.0 sends for the same message: a map with
    ``"type"`` first and vLLM's field order, tuples as msgpack arrays, keys
    and metadata as bin. Extension fields that are None are left out.

    Encoding trusts its input: field values are not checked against the
    bounds :func:`decode` enforces, since messages are built by our own code.

    Args:
        msg: The message to encode.

    Returns:
        The frame payload.
    """
    return _ENCODER.encode(_to_wire(msg))


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------

# Untyped decoding: msgspec builds plain Python values in C, and the checks
# below then see exactly what the peer sent (including bools where ints
# belong), which a schema would either coerce or reject without saying why.
_DECODER: Final = msgspec.msgpack.Decoder()

_MISSING: Final = object()

# Attacker-controlled text that ends up in an error message is clipped, so a
# hostile peer cannot flood the log with one message.
_CLIP_CHARS: Final = 64

_Wire: TypeAlias = dict[Any, Any]


def _clip(text: str) -> str:
    if len(text) <= _CLIP_CHARS:
        return text
    return f"{text[:_CLIP_CHARS]}... ({len(text)} characters)"


def _kind(value: object) -> str:
    # msgpack nil decodes to None; naming it as the wire does reads better.
    return "nil" if value is None else type(value).__name__


def _get(wire: _Wire, mtype: str, field: str, label: str) -> Any:
    value = wire.get(field, _MISSING)
    if value is _MISSING:
        raise InvalidField("missing", message_type=mtype, field=label)
    return value


def _check_type(value: object, expected: type, mtype: str, label: str) -> None:
    if type(value) is not expected:
        raise InvalidField(
            f"is {_kind(value)}, expected {expected.__name__}", message_type=mtype, field=label
        )


def _read_str(
    wire: _Wire, mtype: str, field: str, max_chars: int, *, label: str | None = None
) -> str:
    label = label or field
    value = _get(wire, mtype, field, label)
    _check_type(value, str, mtype, label)
    if len(value) > max_chars:
        raise InvalidField(
            f"is {len(value)} characters, more than the limit of {max_chars}",
            message_type=mtype,
            field=label,
        )
    return value  # type: ignore[no-any-return]


def _read_bytes(wire: _Wire, mtype: str, field: str, max_bytes: int) -> bytes:
    value = _get(wire, mtype, field, field)
    _check_type(value, bytes, mtype, field)
    if len(value) > max_bytes:
        raise InvalidField(
            f"is {len(value)} bytes, more than the limit of {max_bytes}",
            message_type=mtype,
            field=field,
        )
    return value  # type: ignore[no-any-return]


def _read_int(
    wire: _Wire, mtype: str, field: str, least: int, most: int, *, label: str | None = None
) -> int:
    label = label or field
    value = _get(wire, mtype, field, label)
    _check_type(value, int, mtype, label)
    if value < least:
        raise InvalidField(
            f"is {value}, expected at least {least}", message_type=mtype, field=label
        )
    if value > most:
        raise InvalidField(
            f"is {value}, more than the limit of {most}", message_type=mtype, field=label
        )
    return value  # type: ignore[no-any-return]


def _read_optional_int(wire: _Wire, mtype: str, field: str, least: int, most: int) -> int | None:
    if field not in wire:
        return None
    return _read_int(wire, mtype, field, least, most)


def _read_bool(wire: _Wire, mtype: str, field: str) -> bool:
    value = _get(wire, mtype, field, field)
    _check_type(value, bool, mtype, field)
    return value  # type: ignore[no-any-return]


def _read_list(
    wire: _Wire, mtype: str, field: str, expected: type, max_items: int, *, label: str | None = None
) -> list[Any]:
    """Reads a list field whose items must all be exactly of type ``expected``."""
    label = label or field
    items = _get(wire, mtype, field, label)
    _check_type(items, list, mtype, label)
    if len(items) > max_items:
        raise InvalidField(
            f"has {len(items)} items, more than the limit of {max_items}",
            message_type=mtype,
            field=label,
        )
    # One C-level pass over the types; the Python loop only runs to name the
    # culprit once we already know there is one.
    if not set(map(type, items)) <= {expected}:
        for index, item in enumerate(items):
            if type(item) is not expected:
                raise InvalidField(
                    f"item {index} is {_kind(item)}, expected {expected.__name__}",
                    message_type=mtype,
                    field=label,
                )
    return items  # type: ignore[no-any-return]


def _check_max_len(items: list[Any], mtype: str, field: str, most: int, unit: str) -> None:
    if items and max(map(len, items)) > most:
        for index, item in enumerate(items):
            if len(item) > most:
                raise InvalidField(
                    f"item {index} is {len(item)} {unit}, more than the limit of {most}",
                    message_type=mtype,
                    field=field,
                )


def _read_keys(wire: _Wire, mtype: str, limits: Limits) -> list[bytes]:
    keys = _read_list(wire, mtype, "keys", bytes, limits.max_list_items)
    _check_max_len(keys, mtype, "keys", limits.max_key_bytes, "bytes")
    return keys


def _check_parallel(keys: list[bytes], other: list[Any], mtype: str, field: str) -> None:
    if len(other) != len(keys):
        raise InvalidField(
            f"has {len(other)} items but 'keys' has {len(keys)}; they must be parallel",
            message_type=mtype,
            field=field,
        )


def _decode_extension(raw: object, limits: Limits) -> ConnectExtension:
    mtype = Connect.TYPE
    if type(raw) is not dict:
        raise InvalidField(
            f"is {_kind(raw)}, expected a map", message_type=mtype, field=EXTENSION_KEY
        )
    version = _read_int(
        raw, mtype, "version", 0, MAX_EXTENSION_VERSION, label=f"{EXTENSION_KEY}.version"
    )
    label = f"{EXTENSION_KEY}.features"
    features = _read_list(raw, mtype, "features", str, limits.max_features, label=label)
    _check_max_len(features, mtype, label, limits.max_feature_chars, "characters")
    return ConnectExtension(version=version, features=features)


def _decode_connect(wire: _Wire, limits: Limits) -> Connect:
    mtype = Connect.TYPE
    peer_id = _read_str(wire, mtype, "peer_id", limits.max_string_chars)
    agent_metadata = _read_bytes(wire, mtype, "agent_metadata", limits.max_agent_metadata_bytes)
    base_addr = _read_int(wire, mtype, "base_addr", 0, MAX_ADDRESS)
    num_blocks = _read_int(wire, mtype, "num_blocks", 1, limits.max_num_blocks)
    block_len = _read_int(wire, mtype, "block_len", 1, limits.max_block_len)
    # The data plane computes block addresses in 64 bits; a region that
    # wraps around would alias other memory.
    end = base_addr + num_blocks * block_len
    if end > MAX_ADDRESS:
        raise InvalidField(
            f"is {base_addr}, and {num_blocks} blocks of {block_len} bytes from there "
            f"end at {end}, past the 64-bit address space",
            message_type=mtype,
            field="base_addr",
        )
    # vLLM reads the fingerprint with a default of "" and never checks it,
    # so a stock peer may legally leave it out.
    if "config_fingerprint" in wire:
        fingerprint = _read_str(wire, mtype, "config_fingerprint", limits.max_string_chars)
    else:
        fingerprint = ""
    hash_seed = _read_str(wire, mtype, "hash_seed", limits.max_string_chars)
    raw_extension = wire.get(EXTENSION_KEY, _MISSING)
    return Connect(
        peer_id=peer_id,
        agent_metadata=agent_metadata,
        base_addr=base_addr,
        num_blocks=num_blocks,
        block_len=block_len,
        config_fingerprint=fingerprint,
        hash_seed=hash_seed,
        extension=(None if raw_extension is _MISSING else _decode_extension(raw_extension, limits)),
    )


def _decode_connect_ack(wire: _Wire, limits: Limits) -> ConnectAck:
    return ConnectAck(peer_id=_read_str(wire, ConnectAck.TYPE, "peer_id", limits.max_string_chars))


def _decode_disconnect(wire: _Wire, limits: Limits) -> Disconnect:
    del wire, limits  # a disconnect carries nothing to check
    return Disconnect()


def _decode_lookup(wire: _Wire, limits: Limits) -> Lookup:
    mtype = Lookup.TYPE
    return Lookup(
        kv_request_id=_read_str(wire, mtype, "kv_request_id", limits.max_string_chars),
        keys=_read_keys(wire, mtype, limits),
        round_seq=_read_int(wire, mtype, "round_seq", 0, limits.max_round_seq),
        deadline_ms=_read_optional_int(wire, mtype, "deadline_ms", 0, limits.max_deadline_ms),
    )


def _decode_lookup_resp(wire: _Wire, limits: Limits) -> LookupResp:
    mtype = LookupResp.TYPE
    kv_request_id = _read_str(wire, mtype, "kv_request_id", limits.max_string_chars)
    keys = _read_keys(wire, mtype, limits)
    hits = _read_list(wire, mtype, "hits", bool, limits.max_list_items)
    _check_parallel(keys, hits, mtype, "hits")
    return LookupResp(
        kv_request_id=kv_request_id,
        keys=keys,
        hits=hits,
        round_seq=_read_optional_int(wire, mtype, "round_seq", 0, limits.max_round_seq),
    )


def _decode_fetch(wire: _Wire, limits: Limits) -> Fetch:
    mtype = Fetch.TYPE
    kv_request_id = _read_str(wire, mtype, "kv_request_id", limits.max_string_chars)
    keys = _read_keys(wire, mtype, limits)
    indexes: list[int] = _read_list(wire, mtype, "block_indexes", int, limits.max_list_items)
    _check_parallel(keys, indexes, mtype, "block_indexes")
    if indexes and (min(indexes) < 0 or max(indexes) > limits.max_block_index):
        for position, index in enumerate(indexes):
            if not 0 <= index <= limits.max_block_index:
                raise InvalidField(
                    f"item {position} is {index}, expected 0 to {limits.max_block_index}",
                    message_type=mtype,
                    field="block_indexes",
                )
    return Fetch(
        kv_request_id=kv_request_id,
        keys=keys,
        block_indexes=indexes,
        round_seq=_read_int(wire, mtype, "round_seq", 0, limits.max_round_seq),
    )


def _decode_transfer_done(wire: _Wire, limits: Limits) -> TransferDone:
    mtype = TransferDone.TYPE
    return TransferDone(
        kv_request_id=_read_str(wire, mtype, "kv_request_id", limits.max_string_chars),
        success=_read_bool(wire, mtype, "success"),
        round_seq=_read_int(wire, mtype, "round_seq", 0, limits.max_round_seq),
    )


def _decode_abort_fetch(wire: _Wire, limits: Limits) -> AbortFetch:
    mtype = AbortFetch.TYPE
    return AbortFetch(
        kv_request_id=_read_str(wire, mtype, "kv_request_id", limits.max_string_chars),
        round_seq=_read_int(wire, mtype, "round_seq", 0, limits.max_round_seq),
    )


def _decode_abort_ack(wire: _Wire, limits: Limits) -> AbortAck:
    mtype = AbortAck.TYPE
    return AbortAck(
        kv_request_id=_read_str(wire, mtype, "kv_request_id", limits.max_string_chars),
        round_seq=_read_int(wire, mtype, "round_seq", 0, limits.max_round_seq),
    )


_READERS: Final[Mapping[str, Callable[[_Wire, Limits], Message]]] = types.MappingProxyType(
    {
        Connect.TYPE: _decode_connect,
        ConnectAck.TYPE: _decode_connect_ack,
        Disconnect.TYPE: _decode_disconnect,
        Lookup.TYPE: _decode_lookup,
        LookupResp.TYPE: _decode_lookup_resp,
        Fetch.TYPE: _decode_fetch,
        TransferDone.TYPE: _decode_transfer_done,
        AbortFetch.TYPE: _decode_abort_fetch,
        AbortAck.TYPE: _decode_abort_ack,
    }
)


def decode(frame: bytes, *, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode and validate one msgpack frame from a peer.

    Unknown keys in a known message are ignored, so a newer peer may add
    fields; they still count toward the frame size bound.

    Args:
        frame: The frame payload, as received.
        limits: The bounds to enforce.

    Returns:
        The message, with every field of the right type and within bounds.

    Raises:
        FrameTooLarge: The frame is longer than ``limits.max_frame_bytes``;
            it was not decoded at all.
        MalformedFrame: The frame is not msgpack, or not a map with a str
            ``"type"``.
        UnknownMessageType: The ``"type"`` is not one this module knows.
        InvalidField: A field is missing, of the wrong type or out of
            bounds; the error names the message type and the field.
    """
    if len(frame) > limits.max_frame_bytes:
        raise FrameTooLarge(
            f"frame is {len(frame)} bytes, more than the limit of {limits.max_frame_bytes}; "
            "it was dropped unread (raise Limits.max_frame_bytes if the peer is legitimate)"
        )
    try:
        wire = _DECODER.decode(frame)
    except Exception as exc:
        # Besides DecodeError, msgspec raises RecursionError on deep nesting
        # and TypeError on a non-buffer; all of them mean "not a frame".
        raise MalformedFrame(f"not valid msgpack: {exc}") from exc
    if type(wire) is not dict:
        raise MalformedFrame(f"top-level value is {_kind(wire)}, expected a map")
    mtype = wire.get("type", _MISSING)
    if mtype is _MISSING:
        raise MalformedFrame("map has no 'type' key")
    if type(mtype) is not str:
        raise MalformedFrame(f"'type' is {_kind(mtype)}, expected str")
    reader = _READERS.get(mtype)
    if reader is None:
        raise UnknownMessageType(
            f"unknown message type (known: {', '.join(MESSAGE_TYPES)})",
            message_type=_clip(mtype),
        )
    return reader(wire, limits)
