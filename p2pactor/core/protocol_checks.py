"""What a refused frame is told.

msgspec checks every bound as it decodes a frame (the field types of
:mod:`p2pactor.core.protocol` carry them). When it refuses one,
:func:`explain` turns its verdict into the :class:`~p2pactor.errors.ProtocolError`
the node logs: the message type, the field by its wire name, and what was
wrong with the value the peer sent (``is -3, expected at least 0``). Only a
refused frame pays for that, and never more than about its own size: the
path msgspec names is followed through the frame as zero-copy ``Raw`` views
(each step decodes one field and skips the rest), a collection's length is
read from its msgpack header, and only a value of at most ``QUOTE_BYTES``
(or a string, which costs its size) is decoded to be quoted. Decoding the
whole frame again untyped, as this once did, cost a hostile peer's frame of
empty maps 72 times its size. A frame's top level can also be read from its
headers alone: where the values before a key are strings, bytes or scalars
(whose headers say how long they are), its value is found by jumping from
header to header, never walking a long array or map, whatever it holds.
That is how a frame's ``"type"`` is read before it is decoded.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any, Final, TypeAlias

import msgspec

from p2pactor.core.protocol_limits import UNITS, over_limit
from p2pactor.errors import InvalidField, MalformedFrame, ProtocolError, UnknownMessageType

Frame: TypeAlias = bytes | memoryview
"""A frame as received: bytes, or a view of a large one the transport did not copy."""

QUOTE_BYTES: Final = 4096
"""A value (or list to index) longer than this is not decoded to word an error."""
EXPLAIN_BYTES: Final = 65_536
"""A refused frame longer than this is not walked to word its error (only its top level)."""

# Attacker-controlled text that ends up in an error message is clipped, so a
# hostile peer cannot flood the log with one message.
_CLIP_CHARS: Final = 64
_MISSING: Final = object()  # a value that could not be had cheaply
_PATH: Final = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
# msgspec's names of msgpack types, as this protocol's errors name them.
_GOT: Final = {"None": "nil", "null": "nil", "array": "list", "object": "dict", "ext": "Ext"}
_EXPECTED: Final = {"array": "list", "object": "a map"}
# msgpack's headers (the format is regular): scalars by the bytes that follow
# (nil, bools, floats, ints, fixext), and values whose length follows the
# first byte by (kind, bytes of that length).
_SCALARS: Final = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8}
_SCALARS.update({0xCC + i: 1 << (i % 4) for i in range(8)})
_SCALARS.update({0xD4 + i: 1 + (1 << i) for i in range(5)})
_SIZED: Final = {0xC4 + i: ("bytes", 1 << i) for i in range(3)}
_SIZED.update({0xC7 + i: ("Ext", 1 << i) for i in range(3)})
_SIZED.update({0xD9 + i: ("str", 1 << i) for i in range(3)})
_SIZED.update({0xDC + i: ("list", 2 << i) for i in range(2)})
_SIZED.update({0xDE + i: ("dict", 2 << i) for i in range(2)})
_COLLECTIONS: Final = ("list", "dict")


def _clip(text: str) -> str:
    if len(text) <= _CLIP_CHARS:
        return text
    return f"{text[:_CLIP_CHARS]}... ({len(text)} characters)"


def _kind(value: object) -> str:
    # msgpack nil decodes to None; naming it as the wire does reads better.
    if isinstance(value, _Shape):
        return value.kind
    return "nil" if value is None else type(value).__name__


class _Shape(msgspec.Struct, frozen=True):
    """A long value's kind and length, read from its msgpack header, in place of it."""

    kind: str
    n: int

    def __len__(self) -> int:
        return self.n


def _head(view: memoryview, at: int) -> tuple[str, int, int] | None:
    """The kind, header bytes and length of the value at ``at`` (items, or bytes of payload)."""
    if at >= len(view):
        return None
    first = view[at]
    if first <= 0x7F or first >= 0xE0:
        return "int", 1, 0
    if first <= 0x8F:
        return "dict", 1, first & 0x0F
    if first <= 0x9F:
        return "list", 1, first & 0x0F
    if first <= 0xBF:
        return "str", 1, first & 0x1F
    if first in _SCALARS:
        return "scalar", 1, _SCALARS[first]
    if first not in _SIZED:
        return None
    kind, width = _SIZED[first]
    if len(view) < at + 1 + width:
        return None
    n = int.from_bytes(view[at + 1 : at + 1 + width], "big")
    return kind, 1 + width + (kind == "Ext"), n  # an Ext's type byte follows its length


def _shape(raw: memoryview) -> _Shape | None:
    """The kind and length of the string, bytes, array or map ``raw`` starts with, if any."""
    head = _head(raw, 0)
    if head is None or head[0] not in ("str", "bytes", *_COLLECTIONS):
        return None
    return _Shape(head[0], head[2])


def _value(raw: memoryview) -> Any:
    """What ``raw`` holds: decoded if short or bytes (each costs its size), else its shape."""
    shape = None if len(raw) <= QUOTE_BYTES else _shape(raw)
    if shape is not None and shape.kind in _COLLECTIONS:
        return shape
    try:
        return msgspec.msgpack.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        # Framed, but not a value untyped decoding makes: an extension type
        # msgpack reserves (a malformed timestamp, type -1).
        return _Shape("Ext", len(raw))


def _top_field(
    view: memoryview, name: str, *, first: bool = False
) -> tuple[int, int | None] | None:
    """Where top-level key ``name``'s value starts and ends (None: a collection's end).

    Found only if nothing but strings, bytes and scalars come before it
    (finding the end of an array or map means walking it), or with ``first``
    only if it is the first key.
    """
    top = _head(view, 0)
    if top is None or top[0] != "dict":
        return None
    _, at, pairs = top
    for _ in range(min(pairs, 1) if first else pairs):
        key = _head(view, at)
        value = None if key is None else _head(view, at + key[1] + key[2])
        if key is None or value is None or key[0] in _COLLECTIONS:
            return None
        start = at + key[1] + key[2]
        end = None if value[0] in _COLLECTIONS else start + value[1] + value[2]
        if key[0] == "str" and bytes(view[at + key[1] : start]) == name.encode():
            return start, end
        if end is None:
            return None
        at = end
    return None


@functools.lru_cache(maxsize=256)  # names from msgspec's paths: our schema's fields
def _one_field(name: str) -> msgspec.msgpack.Decoder[Any]:
    """A decoder of a map that keeps only ``name`` (its wire name), as a ``Raw``."""
    struct = msgspec.defstruct(
        "_Field", [("value", msgspec.Raw, msgspec.Raw())], rename={"value": name}
    )
    return msgspec.msgpack.Decoder(struct)


def _step(raw: memoryview, name: str, index: str) -> memoryview | None:
    """The part of ``raw`` at one step of msgspec's path, or None if it cannot be had cheaply."""
    try:
        if name:
            got = memoryview(_one_field(name).decode(raw).value)
            return got if len(got) > 0 else None
        shape = _shape(raw)
        # A Raw view costs about 64 bytes: index only a list whose views cost
        # no more than the list's own bytes (a list of empty maps never).
        if shape is None or (len(raw) > QUOTE_BYTES and 64 * len(shape) > len(raw)):
            return None
        items = msgspec.msgpack.decode(raw, type=list[msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    item = int(index)
    return memoryview(items[item]) if item < len(items) else None


def _find(frame: Frame, steps: list[tuple[str, str]]) -> Any:
    """The value at msgspec's path ``steps``, or ``_MISSING`` if it cannot be had cheaply.

    A frame over ``EXPLAIN_BYTES`` is never walked: only a top-level field is
    found, by its headers (:func:`_top_field`).
    """
    view = memoryview(frame)
    if len(frame) > EXPLAIN_BYTES:
        found = _top_field(view, steps[0][0]) if len(steps) == 1 and steps[0][0] else None
        if found is None:
            return _MISSING
        start, end = found
        # A string is measured from its header too (in bytes, not decoded).
        shape = _shape(view[start:])
        return shape if shape is not None or end is None else _value(view[start:end])
    raw: memoryview | None = view
    for name, index in steps:
        raw = None if raw is None else _step(raw, name, index)
    return _MISSING if raw is None else _value(raw)


def type_error(
    frame: Frame, known: Mapping[str, type], *, quick: bool = False
) -> ProtocolError | str:
    """The frame's message type, or the error if it has none this protocol knows.

    Only the ``"type"`` is decoded, every other key skipped unread; a long
    unknown type is not decoded at all, so no error quotes it whole. With
    ``quick`` (a frame not decoded yet: msgspec checks the rest next), a known
    type that leads, as every encoder here puts it, is read from the first
    bytes and taken as is.
    """
    found = _top_field(memoryview(frame), "type", first=True) if quick else None
    if found is not None and found[1] is not None and found[1] - found[0] <= QUOTE_BYTES:
        mtype = _value(memoryview(frame)[found[0] : found[1]])
        if type(mtype) is str and mtype in known:
            return mtype
    try:
        raw = memoryview(_one_field("type").decode(frame).value)
    except msgspec.ValidationError as err:
        got = re.search(r"got `(\w+)`", str(err))
        kind = _GOT.get(got.group(1), got.group(1)) if got else "not a map"
        return MalformedFrame(f"top-level value is {kind}, expected a map")
    except Exception as err:
        return MalformedFrame(f"not valid msgpack: {err}")
    if not raw:
        return MalformedFrame("map has no 'type' key")
    long = _head(raw, 0) if len(raw) > QUOTE_BYTES else None
    if long is not None and long[0] == "str":  # longer than any type's name: not decoded
        _, width, n = long
        text = bytes(raw[width : width + 4 * _CLIP_CHARS]).decode("utf-8", "replace")
        name = f"{text[:_CLIP_CHARS]}... ({n} bytes)"
    else:
        mtype = _value(raw)
        if type(mtype) is not str:
            return MalformedFrame(f"'type' is {_kind(mtype)}, expected str")
        if mtype in known:
            return mtype
        name = _clip(mtype)
    return UnknownMessageType(
        f"unknown message type (known: {', '.join(known)})", message_type=name
    )


def explain(
    frame: Frame,
    exc: msgspec.ValidationError,
    known: Mapping[str, type],
    mtype: str | None = None,
) -> ProtocolError:
    """The error for a frame msgspec refused with ``exc``: what, where, and why.

    ``mtype``: the frame's type, if the caller read it already.
    """
    if isinstance(exc.__cause__, ProtocolError):  # a message's own __post_init__ check
        return exc.__cause__
    found = mtype or type_error(frame, known)
    if isinstance(found, ProtocolError):
        return found
    text, _, at = str(exc).partition(" - at `$")
    steps = _PATH.findall(at.rstrip("`"))
    names = [name for name, _ in steps if name]
    missing = re.fullmatch(r"Object missing required field `(.+)`", text)
    if missing:
        return InvalidField(
            "missing", message_type=found, field=".".join([*names, missing.group(1)])
        )
    problem = _problem(_clip(text), _find(frame, steps))
    items = [index for name, index in steps if not name]
    if items:
        problem = f"item {items[-1]} {problem}"
    return InvalidField(problem, message_type=found, field=".".join(names))


def _problem(text: str, value: Any) -> str:
    """What was wrong with ``value`` (unless ``_MISSING``), from msgspec's words ``text``."""
    resolved = value is not _MISSING
    if found := re.fullmatch(r"Expected `(.+?)`, got `(.+?)`", text):
        expected, got = found.groups()
        what = _kind(value) if resolved else _GOT.get(got, got)
        return f"is {what}, expected {_EXPECTED.get(expected, expected)}"
    if found := re.fullmatch(r"Expected `(\w+)`( of length)? ([<>])= (-?\d+)", text):
        kind, sized, sign, bound = found.groups()
        unit = UNITS.get(kind, "items") if sized else "value"
        of = f" {unit}" if sized else ""  # a length's unit; a number's value has none
        if sign == "<" and resolved:
            return over_limit(value, int(bound), unit)
        if sign == "<":
            return f"is {'over' if sized else 'more than'} the limit of {bound}{of}"
        if resolved:
            return f"is {len(value) if sized else value}{of}, expected at least {bound}"
        return f"expected at least {bound}{of}"
    return text
