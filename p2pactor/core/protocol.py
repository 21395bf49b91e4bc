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
from typing import Any, ClassVar, Final, TypeAlias

import attrs
import msgspec

from p2pactor.core.protocol_codec import (
    _MISSING,
    _clip,
    _gen_decoder,
    _gen_to_wire,
    _kind,
    _w,
    _Wire,
)
from p2pactor.core.protocol_limits import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_FRAME_BYTES,
    MAX_ADDRESS,
    MAX_AGENT_METADATA_BYTES,
    MAX_BLOCK_INDEX,
    MAX_BLOCK_LEN,
    MAX_DEADLINE_MS,
    MAX_EXTENSION_VERSION,
    MAX_FEATURE_CHARS,
    MAX_FEATURES,
    MAX_KEY_BYTES,
    MAX_LIST_ITEMS,
    MAX_NUM_BLOCKS,
    MAX_ROUND_SEQ,
    MAX_STRING_CHARS,
    Limits,
)
from p2pactor.errors import (
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

EXTENSION_KEY: Final = "p2pactor"
"""The ``connect`` key under which p2pactor peers advertise their extensions."""


def _check_region(base_addr: int, num_blocks: int, block_len: int) -> None:
    # The data plane computes block addresses in 64 bits; a region that
    # wraps around would alias other memory.
    end = base_addr + num_blocks * block_len
    if end > MAX_ADDRESS:
        raise InvalidField(
            f"is {base_addr}, and {num_blocks} blocks of {block_len} bytes from there "
            f"end at {end}, past the 64-bit address space",
            message_type=Connect.TYPE,
            field="base_addr",
        )


_REQUEST_ID: Final = _w("str", most="max_string_chars")
_ROUND_SEQ: Final = _w("int", most="max_round_seq")
_KEYS: Final = _w("list", item=bytes, most="max_list_items", item_most="max_key_bytes")


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

    version: int = attrs.field(metadata=_w("int", most=MAX_EXTENSION_VERSION))
    features: frozenset[str] = attrs.field(
        factory=frozenset,
        converter=_str_frozenset,
        metadata=_w(
            "list", item=str, most="max_features", item_most="max_feature_chars", sort=True
        ),
    )


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

    peer_id: str = attrs.field(metadata=_w("str", most="max_string_chars"))
    agent_metadata: bytes = attrs.field(metadata=_w("bytes", most="max_agent_metadata_bytes"))
    base_addr: int = attrs.field(metadata=_w("int", most=MAX_ADDRESS))
    num_blocks: int = attrs.field(metadata=_w("int", least=1, most="max_num_blocks"))
    block_len: int = attrs.field(
        metadata=_w(
            "int",
            least=1,
            most="max_block_len",
            check=_check_region,
            check_with=("base_addr", "num_blocks", "block_len"),
        )
    )
    # vLLM reads the fingerprint with a default of "" and never checks it,
    # so a stock peer may legally leave it out.
    config_fingerprint: str = attrs.field(
        default="", metadata=_w("str", most="max_string_chars", optional=True)
    )
    hash_seed: str = attrs.field(metadata=_w("str", most="max_string_chars"))
    extension: ConnectExtension | None = attrs.field(
        default=None,
        metadata=_w("map", nested=ConnectExtension, key=EXTENSION_KEY, optional=True),
    )


@attrs.frozen(kw_only=True)
class ConnectAck:
    """Reply to a ``connect``: the acker has registered the sender's memory.

    Attributes:
        peer_id: The acker's own ``HOST:PORT`` id.
    """

    TYPE: ClassVar[str] = "connect_ack"

    peer_id: str = attrs.field(metadata=_w("str", most="max_string_chars"))


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

    kv_request_id: str = attrs.field(metadata=_REQUEST_ID)
    keys: tuple[bytes, ...] = attrs.field(converter=bytes_tuple, metadata=_KEYS)
    round_seq: int = attrs.field(metadata=_ROUND_SEQ)
    deadline_ms: int | None = attrs.field(
        default=None, metadata=_w("int", most="max_deadline_ms", optional=True)
    )


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

    kv_request_id: str = attrs.field(metadata=_REQUEST_ID)
    keys: tuple[bytes, ...] = attrs.field(converter=bytes_tuple, metadata=_KEYS)
    hits: tuple[bool, ...] = attrs.field(
        converter=bool_tuple,
        metadata=_w("list", item=bool, most="max_list_items", parallel_to="keys"),
    )
    round_seq: int | None = attrs.field(
        default=None, metadata=_w("int", most="max_round_seq", optional=True)
    )


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

    kv_request_id: str = attrs.field(metadata=_REQUEST_ID)
    keys: tuple[bytes, ...] = attrs.field(converter=bytes_tuple, metadata=_KEYS)
    block_indexes: tuple[int, ...] = attrs.field(
        converter=int_tuple,
        metadata=_w(
            "list",
            item=int,
            most="max_list_items",
            parallel_to="keys",
            item_most="max_block_index",
        ),
    )
    round_seq: int = attrs.field(metadata=_ROUND_SEQ)


@attrs.frozen(kw_only=True)
class TransferDone:
    """Producer to consumer: a fetch round's transfers have finished.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        success: Whether every block was written.
        round_seq: The round of the fetch.
    """

    TYPE: ClassVar[str] = "transfer_done"

    kv_request_id: str = attrs.field(metadata=_REQUEST_ID)
    success: bool = attrs.field(metadata=_w("bool"))
    round_seq: int = attrs.field(metadata=_ROUND_SEQ)


@attrs.frozen(kw_only=True)
class AbortFetch:
    """Consumer to producer: cancel a fetch round.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        round_seq: The round to cancel.
    """

    TYPE: ClassVar[str] = "abort_fetch"

    kv_request_id: str = attrs.field(metadata=_REQUEST_ID)
    round_seq: int = attrs.field(metadata=_ROUND_SEQ)


@attrs.frozen(kw_only=True)
class AbortAck:
    """Producer to consumer: no transfer of the aborted round can still run.

    Attributes:
        kv_request_id: The request the fetch belonged to.
        round_seq: The round that was cancelled.
    """

    TYPE: ClassVar[str] = "abort_ack"

    kv_request_id: str = attrs.field(metadata=_REQUEST_ID)
    round_seq: int = attrs.field(metadata=_ROUND_SEQ)


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


_ENCODER: Final = msgspec.msgpack.Encoder()

_TO_WIRE: Final[Mapping[str, Callable[[Any], dict[str, object]]]] = types.MappingProxyType(
    {cls.TYPE: _gen_to_wire(cls, cls.TYPE) for cls in _MESSAGE_CLASSES}
)


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
    return _ENCODER.encode(_TO_WIRE[msg.TYPE](msg))


# ---------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------

# Untyped decoding: msgspec builds plain Python values in C, and the checks
# below then see exactly what the peer sent (including bools where ints
# belong), which a schema would either coerce or reject without saying why.
_DECODER: Final = msgspec.msgpack.Decoder()


_READERS: Final[Mapping[str, Callable[[_Wire, Limits], Message]]] = types.MappingProxyType(
    {cls.TYPE: _gen_decoder(cls, cls.TYPE) for cls in _MESSAGE_CLASSES}
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
