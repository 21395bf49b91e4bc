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
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, ClassVar, Final, NoReturn, TypeAlias

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
# Wire descriptions
# ---------------------------------------------------------------------------

# Each message field says once, in its ``attrs.field`` metadata, how it looks
# on the wire; encode and the strict decoder are derived from that at import.
# Field order is wire order and check order.

_SPEC: Final = "p2pactor.wire"

_Bound: TypeAlias = int | str
"""A bound: an int constant, or the name of the :class:`Limits` attribute."""


@attrs.frozen(kw_only=True)
class _Field:
    # kind: "str", "bytes", "int", "bool", "list" (of ``item``), or "map" (a
    # ``nested`` attrs class decoded with a dotted label prefix).
    kind: str
    most: _Bound | None = None
    least: int = 0
    item: type | None = None
    item_least: int = 0
    item_most: _Bound | None = None
    parallel_to: str | None = None
    key: str | None = None
    # May be absent from the wire; it then decodes as the attrs default.
    # Encoding leaves out a field whose value is None.
    optional: bool = False
    nested: type | None = None
    sort: bool = False
    # Cross-field check, called with the values of ``check_with`` once this
    # field is read.
    check: Callable[..., None] | None = None
    check_with: tuple[str, ...] = ()


def _w(kind: str, **spec: Any) -> dict[str, _Field]:
    return {_SPEC: _Field(kind=kind, **spec)}


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


# ---------------------------------------------------------------------------
# Code generation
# ---------------------------------------------------------------------------

# Encoders and decoders are generated as straight-line source, once per class
# at import (as attrs does for ``__init__``): decode is on the hot path, and
# inline checks beat a loop over field descriptions by a wide margin.


def _specs(cls: type) -> list[tuple[str, _Field, Any]]:
    """(name, spec, default) of each field of ``cls``, in wire order."""
    return [(a.name, a.metadata[_SPEC], a.default) for a in attrs.fields(cls)]


def _compile(name: str, lines: list[str], namespace: dict[str, Any]) -> Any:
    source = "\n".join(lines) + "\n"
    exec(compile(source, f"<p2pactor.protocol {name}>", "exec"), namespace)  # noqa: S102
    return namespace[name]


def _gen_to_wire(cls: type, type_name: str | None) -> Callable[[Any], dict[str, object]]:
    # Insertion order is wire order; vLLM 0.33.0 builds its dicts in exactly
    # this order, and extension keys go last so the base prefix is unchanged.
    namespace: dict[str, Any] = {}
    literal = [] if type_name is None else [f"'type': {type_name!r}"]
    tail: list[str] = []
    for name, spec, default in _specs(cls):
        key = spec.key or name
        value = f"msg.{name}"
        if spec.nested is not None:
            namespace[f"to_wire_{name}"] = _gen_to_wire(spec.nested, None)
            value = f"to_wire_{name}({value})"
        elif spec.sort:
            value = f"sorted({value})"
        if default is None:
            tail += [f"    if msg.{name} is not None:", f"        wire[{key!r}] = {value}"]
        elif tail:
            tail.append(f"    wire[{key!r}] = {value}")
        else:
            literal.append(f"{key!r}: {value}")
    lines = ["def to_wire(msg):", f"    wire = {{{', '.join(literal)}}}", *tail, "    return wire"]
    return _compile("to_wire", lines, namespace)  # type: ignore[no-any-return]


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

_MISSING: Final = object()

# Attacker-controlled text that ends up in an error message is clipped, so a
# hostile peer cannot flood the log with one message.
_CLIP_CHARS: Final = 64

_Wire: TypeAlias = dict[Any, Any]

_UNITS: Final[Mapping[type, str]] = {str: "characters", bytes: "bytes"}


def _clip(text: str) -> str:
    if len(text) <= _CLIP_CHARS:
        return text
    return f"{text[:_CLIP_CHARS]}... ({len(text)} characters)"


def _kind(value: object) -> str:
    # msgpack nil decodes to None; naming it as the wire does reads better.
    return "nil" if value is None else type(value).__name__


# The failure paths of the generated decoders: each builds the error text and
# raises, so the generated hot path is only comparisons.


def _fail(problem: str, mtype: str, label: str) -> NoReturn:
    raise InvalidField(problem, message_type=mtype, field=label)


def _bad_type(value: object, expected: str, mtype: str, label: str) -> NoReturn:
    if value is _MISSING:
        _fail("missing", mtype, label)
    _fail(f"is {_kind(value)}, expected {expected}", mtype, label)


def _too_long(value: Sized, most: int, unit: str, mtype: str, label: str) -> NoReturn:
    _fail(f"is {len(value)} {unit}, more than the limit of {most}", mtype, label)


def _out_of_range(value: int, least: int, most: int, mtype: str, label: str) -> NoReturn:
    if value < least:
        _fail(f"is {value}, expected at least {least}", mtype, label)
    _fail(f"is {value}, more than the limit of {most}", mtype, label)


def _too_many(items: list[Any], most: int, mtype: str, label: str) -> NoReturn:
    _fail(f"has {len(items)} items, more than the limit of {most}", mtype, label)


def _bad_item(items: list[Any], expected: type, mtype: str, label: str) -> None:
    for index, item in enumerate(items):
        if type(item) is not expected:
            _fail(f"item {index} is {_kind(item)}, expected {expected.__name__}", mtype, label)


def _not_parallel(
    items: list[Any], other: list[Any], other_name: str, mtype: str, label: str
) -> NoReturn:
    _fail(
        f"has {len(items)} items but {other_name!r} has {len(other)}; they must be parallel",
        mtype,
        label,
    )


def _item_too_long(items: list[Any], most: int, unit: str, mtype: str, label: str) -> None:
    for index, item in enumerate(items):
        if len(item) > most:
            _fail(
                f"item {index} is {len(item)} {unit}, more than the limit of {most}", mtype, label
            )


def _item_out_of_range(items: list[int], least: int, most: int, mtype: str, label: str) -> None:
    for position, index in enumerate(items):
        if not least <= index <= most:
            _fail(f"item {position} is {index}, expected {least} to {most}", mtype, label)


def _bound(bound: _Bound | None) -> str:
    assert bound is not None
    return repr(bound) if type(bound) is int else f"limits.{bound}"


def _gen_checks(
    spec: _Field, *, name: str, mtype: str, prefix: str, namespace: dict[str, Any]
) -> list[str]:
    """Lines (unindented) that check ``v_<name>``, naming ``mtype`` in errors."""
    var = f"v_{name}"
    where = f"{mtype!r}, {prefix + (spec.key or name)!r}"
    kind = spec.kind
    if kind == "map":
        assert spec.nested is not None
        label = prefix + (spec.key or name)
        namespace[f"decode_{name}"] = _gen_decoder(spec.nested, mtype, f"{label}.")
        return [
            f"if type({var}) is not dict: _bad_type({var}, 'a map', {where})",
            f"{var} = decode_{name}({var}, limits)",
        ]
    expected = {"str": str, "bytes": bytes, "int": int, "bool": bool, "list": list}[kind]
    type_name = expected.__name__
    lines = [f"if type({var}) is not {type_name}: _bad_type({var}, {type_name!r}, {where})"]
    if kind in ("str", "bytes"):
        most = _bound(spec.most)
        unit = _UNITS[expected]
        lines.append(f"if len({var}) > {most}: _too_long({var}, {most}, {unit!r}, {where})")
    elif kind == "int":
        least, most = spec.least, _bound(spec.most)
        lines.append(
            f"if not {least} <= {var} <= {most}: _out_of_range({var}, {least}, {most}, {where})"
        )
    elif kind == "list":
        assert spec.item is not None
        item = spec.item.__name__
        namespace[f"types_{name}"] = frozenset({spec.item})
        most = _bound(spec.most)
        lines += [
            f"if len({var}) > {most}: _too_many({var}, {most}, {where})",
            # One C-level pass over the types; the Python loop only runs to
            # name the culprit once we already know there is one.
            f"if not set(map(type, {var})) <= types_{name}: _bad_item({var}, {item}, {where})",
        ]
        if spec.parallel_to is not None:
            other = f"v_{spec.parallel_to}"
            lines.append(
                f"if len({var}) != len({other}): "
                f"_not_parallel({var}, {other}, {spec.parallel_to!r}, {where})"
            )
        if spec.item_most is not None:
            item_most = _bound(spec.item_most)
            if spec.item is int:
                least = spec.item_least
                lines.append(
                    f"if {var} and (min({var}) < {least} or max({var}) > {item_most}): "
                    f"_item_out_of_range({var}, {least}, {item_most}, {where})"
                )
            else:
                unit = _UNITS[spec.item]
                lines.append(
                    f"if {var} and max(map(len, {var})) > {item_most}: "
                    f"_item_too_long({var}, {item_most}, {unit!r}, {where})"
                )
    return lines


def _gen_decoder(cls: type, mtype: str, prefix: str = "") -> Callable[[_Wire, Limits], Any]:
    """The strict decoder of ``cls``'s fields from a wire map.

    Its errors name ``mtype``, and each field by its wire key after ``prefix``.
    """
    namespace: dict[str, Any] = {
        "_MISSING": _MISSING,
        "_bad_type": _bad_type,
        "_too_long": _too_long,
        "_out_of_range": _out_of_range,
        "_too_many": _too_many,
        "_bad_item": _bad_item,
        "_not_parallel": _not_parallel,
        "_item_too_long": _item_too_long,
        "_item_out_of_range": _item_out_of_range,
        "cls": cls,
    }
    lines = ["def decode(wire, limits):"]
    names = []
    for name, spec, default in _specs(cls):
        key = spec.key or name
        var = f"v_{name}"
        names.append(name)
        checks = _gen_checks(spec, name=name, mtype=mtype, prefix=prefix, namespace=namespace)
        lines.append(f"    {var} = wire.get({key!r}, _MISSING)")
        if spec.optional:
            namespace[f"default_{name}"] = default
            lines += [f"    if {var} is _MISSING:", f"        {var} = default_{name}", "    else:"]
            lines += [f"        {line}" for line in checks]
        else:
            lines += [f"    {line}" for line in checks]
        if spec.check is not None:
            namespace[f"check_{name}"] = spec.check
            lines.append(f"    check_{name}({', '.join(f'v_{n}' for n in spec.check_with)})")
    lines.append(f"    return cls({', '.join(f'{n}=v_{n}' for n in names)})")
    return _compile("decode", lines, namespace)  # type: ignore[no-any-return]


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
