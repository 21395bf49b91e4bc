"""Events to bytes and back, as msgpack or JSON. Never pickle.

Every event travels in an envelope ``{"kind": ..., "v": ..., "event": {...}}``:
``kind`` names the event type, ``v`` its schema version. A reader rejects a
version it does not know instead of guessing, so a log written by a newer
p2pactor fails loudly rather than replaying wrongly. In JSON, bytes (keys) are
base64 strings.
"""

from __future__ import annotations

from typing import Literal, cast

import msgspec

from p2pactor.core.events import EVENT_TYPES, AnyEvent
from p2pactor.errors import EventFormatError

__all__ = ["Format", "decode_event", "encode_event"]

Format = Literal["msgpack", "json"]
"""The two encodings of an event."""


class _Envelope(msgspec.Struct):
    kind: str
    v: int
    event: msgspec.Raw


_MSGPACK = msgspec.msgpack.Encoder()
_JSON = msgspec.json.Encoder()
_MSGPACK_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_JSON_ENVELOPE = msgspec.json.Decoder(_Envelope)
# One typed decoder per event class, made once: msgspec.msgpack.decode(type=...)
# builds one per call, which is most of the cost of reading a log.
_MSGPACK_EVENTS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in EVENT_TYPES.items()}
_JSON_EVENTS = {kind: msgspec.json.Decoder(cls) for kind, cls in EVENT_TYPES.items()}


def encode_event(event: AnyEvent, fmt: Format = "msgpack") -> bytes:
    """Encode one event with its envelope."""
    envelope = {"kind": event.KIND, "v": event.VERSION, "event": event}
    return _MSGPACK.encode(envelope) if fmt == "msgpack" else _JSON.encode(envelope)


def decode_event(data: bytes, fmt: Format = "msgpack") -> AnyEvent:
    """Decode one event written by :func:`encode_event`.

    Raises:
        EventFormatError: The bytes are not an event this version can read.
    """
    try:
        envelope = (_MSGPACK_ENVELOPE if fmt == "msgpack" else _JSON_ENVELOPE).decode(data)
    except msgspec.DecodeError as exc:
        raise EventFormatError(f"not an event envelope: {exc}") from None
    cls = EVENT_TYPES.get(envelope.kind)
    if cls is None:
        raise EventFormatError(
            f"unknown event kind {envelope.kind[:64]!r}; was the log written by a newer p2pactor?"
        )
    if not cls.READS_SINCE <= envelope.v <= cls.VERSION:
        since = "" if cls.READS_SINCE == cls.VERSION else f"{cls.READS_SINCE} to "
        raise EventFormatError(
            f"{envelope.kind} version {envelope.v} is not readable here (this p2pactor reads "
            f"version {since}{cls.VERSION}); replay the log with the p2pactor that wrote it"
        )
    try:
        decoders = _MSGPACK_EVENTS if fmt == "msgpack" else _JSON_EVENTS
        event = decoders[envelope.kind].decode(envelope.event)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventFormatError(f"malformed {envelope.kind} event: {exc}") from None
    # EVENT_TYPES holds exactly the members of AnyEvent.
    return cast("AnyEvent", event)
