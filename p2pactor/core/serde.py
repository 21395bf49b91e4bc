"""Events to bytes and back, as msgpack or JSON. Never pickle.

An event is written as one map: its fields by name, after ``"kind"``, which
names its type and the schema version of its fields, ``"KeysPinned@1"``
(msgspec's tagged union: :attr:`Event.TAG <p2pactor.core.events.Event>`).
One decoder reads any kind straight into its typed event. A record of a kind
this p2pactor does not know, or of a version it cannot read, fails loudly
rather than replaying wrongly; a version it still reads (``READS_SINCE``:
only fields with defaults were added since) takes the defaults. In JSON,
bytes (keys) are base64 strings.

:func:`decode_legacy_event` reads the events of log format 1 (earlier p2pactor
versions), which wrapped each in ``{"kind": ..., "v": ..., "event": {...}}``.
"""

from __future__ import annotations

from typing import Any, Final, Literal, cast

import msgspec

from p2pactor.core.events import EVENT_TYPES, AnyEvent, Event
from p2pactor.errors import EventFormatError

# The two encodings of an event.
Format = Literal["msgpack", "json"]


class _Codec:
    """One encoding's encoder and decoders.

    The decoders read this version's events, any value (to tell what a record
    is), and each kind typed, for records the union does not take (another
    version of a known kind, or a legacy envelope's event).
    """

    def __init__(self, lib: Any) -> None:
        self.encoder = lib.Encoder()
        self.events = lib.Decoder(AnyEvent)
        self.untyped = lib.Decoder()
        self.by_kind = {kind: lib.Decoder(cls) for kind, cls in EVENT_TYPES.items()}


_CODECS: Final = {"msgpack": _Codec(msgspec.msgpack), "json": _Codec(msgspec.json)}
# msgspec's decoder of this version's records (msgpack), for readers that handle its errors
# themselves (by calling :func:`decode_event`, which says what they are).
EVENT_DECODER: Final[msgspec.msgpack.Decoder[AnyEvent]] = _CODECS["msgpack"].events


def encode_event(event: AnyEvent, fmt: Format = "msgpack") -> bytes:
    """Encode one event: a map of its fields after its ``"kind"``."""
    return cast("bytes", _CODECS[fmt].encoder.encode(event))


def decode_event(data: bytes, fmt: Format = "msgpack") -> AnyEvent:
    """Decode one event written by :func:`encode_event` (of this p2pactor or another).

    Raises:
        EventFormatError: The bytes are not an event this version can read.
    """
    codec = _CODECS[fmt]
    try:
        return cast("AnyEvent", codec.events.decode(data))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        first = exc
    # Not this version's form of a known kind: find out what it is.
    try:
        record = codec.untyped.decode(data)
    except msgspec.DecodeError:
        raise EventFormatError(f"not an event record: {first}") from None
    tag = record.get("kind") if type(record) is dict else None
    if type(tag) is not str:
        raise EventFormatError(f"not an event record: {first}")
    kind, _, version = tag.partition("@")
    cls = _readable(kind, int(version) if version.isdigit() else -1)
    if tag == cls.TAG:
        raise EventFormatError(f"malformed {kind} event: {first}") from None
    del record["kind"]
    return _typed(fmt, cls, codec.encoder.encode(record))


def decode_legacy_event(data: bytes) -> AnyEvent:
    """Decode one event of log format 1: ``{"kind": ..., "v": ..., "event": {...}}``, msgpack.

    Raises:
        EventFormatError: The bytes are not an event this version can read.
    """
    try:
        envelope = _LEGACY.decode(data)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"not an event envelope: {exc}") from None
    cls = _readable(envelope.kind, envelope.v)
    return _typed("msgpack", cls, envelope.event)


class _Envelope(msgspec.Struct):
    kind: str
    v: int
    event: msgspec.Raw


_LEGACY: Final = msgspec.msgpack.Decoder(_Envelope)


def _readable(kind: str, version: int) -> type[Event]:
    """The event type of ``kind``, if this p2pactor reads its ``version``."""
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise EventFormatError(
            f"unknown event kind {kind[:64]!r}; was the log written by a newer p2pactor?"
        )
    if not cls.READS_SINCE <= version <= cls.VERSION:
        since = "" if cls.READS_SINCE == cls.VERSION else f"{cls.READS_SINCE} to "
        raise EventFormatError(
            f"{kind} version {version} is not readable here (this p2pactor reads "
            f"version {since}{cls.VERSION}); replay the log with the p2pactor that wrote it"
        )
    return cls


def _typed(fmt: Format, cls: type[Event], fields: bytes | msgspec.Raw) -> AnyEvent:
    try:
        # EVENT_TYPES holds exactly the members of AnyEvent.
        return cast("AnyEvent", _CODECS[fmt].by_kind[cls.KIND].decode(fields))
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventFormatError(f"malformed {cls.KIND} event: {exc}") from None
