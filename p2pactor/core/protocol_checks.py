"""What a refused frame is told, and the bounds a node tightens.

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
empty maps 72 times its size.

A node may tighten the bounds (:class:`~p2pactor.core.protocol_limits.Limits`):
:func:`tuned_checker` derives, from the same field types, the checks a decoded
message then also passes; each bound names the ``Limits`` attribute that
lowers it.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, Final

import msgspec
import msgspec.inspect as mi

from p2pactor.core.protocol_limits import Limits
from p2pactor.core.protocol_scan import Frame, top_field
from p2pactor.errors import InvalidField, MalformedFrame, ProtocolError, UnknownMessageType

__all__ = ["EXPLAIN_BYTES", "QUOTE_BYTES", "explain", "tuned_checker", "type_error"]

# Attacker-controlled text that ends up in an error message is clipped, so a
# hostile peer cannot flood the log with one message.
_CLIP_CHARS: Final = 64
_MISSING: Final = object()
_PATH: Final = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
# msgspec's names of msgpack types, as this protocol's errors name them.
_GOT: Final = {"None": "nil", "null": "nil", "array": "list", "object": "dict", "ext": "Ext"}
_EXPECTED: Final = {"array": "list", "object": "a map"}
_UNITS: Final = {"str": "characters", "bytes": "bytes"}


def _clip(text: str) -> str:
    if len(text) <= _CLIP_CHARS:
        return text
    return f"{text[:_CLIP_CHARS]}... ({len(text)} characters)"


def _kind(value: object) -> str:
    # msgpack nil decodes to None; naming it as the wire does reads better.
    if isinstance(value, _Shape):
        return value.kind
    return "nil" if value is None else type(value).__name__


def _too_long(value: Sized, most: int, unit: str) -> str:
    if unit == "items":
        return f"has {len(value)} items, more than the limit of {most}"
    return f"is {len(value)} {unit}, more than the limit of {most}"


QUOTE_BYTES: Final = 4096
"""A value (or list to index) longer than this is not decoded to word an error."""
EXPLAIN_BYTES: Final = 65_536
"""A refused frame longer than this is not walked to word its error (only its top level)."""


class _Shape:
    """A long value's kind and length, read from its msgpack header, in place of it.

    ``head`` is the start of a long string (to quote it, clipped).
    """

    __slots__ = ("head", "kind", "n")

    def __init__(self, kind: str, n: int, head: str = "") -> None:
        self.kind = kind
        self.n = n
        self.head = head

    def __len__(self) -> int:
        return self.n


class _Top(msgspec.Struct):
    """A frame's ``"type"``, every other key skipped unread."""

    type: msgspec.Raw = msgspec.Raw()


_TOP: Final = msgspec.msgpack.Decoder(_Top)
# msgpack's headers of variable-length values: (kind, bytes of the length that follows).
_HEADERS: Final = {
    0xD9: ("str", 1),
    0xDA: ("str", 2),
    0xDB: ("str", 4),
    0xC4: ("bytes", 1),
    0xC5: ("bytes", 2),
    0xC6: ("bytes", 4),
    0xDC: ("list", 2),
    0xDD: ("list", 4),
    0xDE: ("dict", 2),
    0xDF: ("dict", 4),
}


def _header(raw: memoryview) -> _Shape | None:
    """The kind and length of the string, bytes, array or map ``raw`` starts with, if any."""
    first = raw[0]
    if 0x80 <= first <= 0x8F:
        return _Shape("dict", first & 0x0F)
    if 0x90 <= first <= 0x9F:
        return _Shape("list", first & 0x0F)
    if first not in _HEADERS:
        return None  # a fixstr or a scalar: short
    kind, width = _HEADERS[first]
    n = int.from_bytes(raw[1 : 1 + width], "big")
    if kind == "str":
        head = bytes(raw[1 + width : 1 + width + 4 * _CLIP_CHARS]).decode("utf-8", "replace")
        return _Shape(kind, n, head)
    return _Shape(kind, n)


def _value(raw: memoryview) -> Any:
    """What ``raw`` holds: decoded if short or bytes (each costs its size), else its shape."""
    shape = None if len(raw) <= QUOTE_BYTES else _header(raw)
    if shape is not None and shape.kind not in ("str", "bytes"):
        return shape
    try:
        return msgspec.msgpack.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        # Framed, but not a value untyped decoding makes: an extension type
        # msgpack reserves (a malformed timestamp, type -1).
        return _Shape("Ext", len(raw))


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
        shape = _header(raw)
        # A Raw view costs about 64 bytes: index only a list whose views cost
        # no more than the list's own bytes (a list of empty maps never).
        if shape is None or (len(raw) > QUOTE_BYTES and 64 * len(shape) > len(raw)):
            return None
        items = msgspec.msgpack.decode(raw, type=list[msgspec.Raw])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    item = int(index)
    return memoryview(items[item]) if item < len(items) else None


def type_error(frame: Frame, known: Mapping[str, type]) -> ProtocolError | str:
    """The frame's message type, or the error if it has none this protocol knows.

    Only the ``"type"`` is read; every other key is skipped unread. A frame
    longer than ``QUOTE_BYTES`` is checked so before it is decoded: a long
    unknown type would otherwise be quoted whole in msgspec's own error.
    """
    try:
        top = _TOP.decode(frame)
    except msgspec.ValidationError as err:
        got = re.search(r"got `(\w+)`", str(err))
        kind = _GOT.get(got.group(1), got.group(1)) if got else "not a map"
        return MalformedFrame(f"top-level value is {kind}, expected a map")
    except Exception as err:
        return MalformedFrame(f"not valid msgpack: {err}")
    if not len(top.type):
        return MalformedFrame("map has no 'type' key")
    long = _header(memoryview(top.type)) if len(top.type) > QUOTE_BYTES else None
    if long is not None and long.kind == "str":  # longer than any type's name: not decoded
        return UnknownMessageType(
            f"unknown message type (known: {', '.join(known)})",
            message_type=f"{long.head[:_CLIP_CHARS]}... ({long.n} bytes)",
        )
    mtype = long if long is not None else _value(memoryview(top.type))
    if type(mtype) is not str:
        return MalformedFrame(f"'type' is {_kind(mtype)}, expected str")
    if mtype not in known:
        return UnknownMessageType(
            f"unknown message type (known: {', '.join(known)})", message_type=_clip(mtype)
        )
    return mtype


def explain(
    frame: Frame,
    exc: msgspec.ValidationError,
    known: Mapping[str, type],
    mtype: str | None = None,
) -> ProtocolError:
    """The error for a frame msgspec refused with ``exc``: what, where, and why.

    ``mtype``: the frame's type, if the caller read it already. A frame over
    ``EXPLAIN_BYTES`` is never walked to word its error: the value is read
    from its header where :func:`~p2pactor.core.protocol_scan.top_field`
    finds it by jumping from header to header, else msgspec's words say it.
    """
    if isinstance(exc.__cause__, ProtocolError):  # a message's own __post_init__ check
        return exc.__cause__
    if mtype is None:
        found = type_error(frame, known)
        if isinstance(found, ProtocolError):
            return found
        mtype = found
    if len(frame) > EXPLAIN_BYTES:
        return _explain_long(frame, str(exc), mtype)
    text, _, at = str(exc).partition(" - at `$")
    names: list[str] = []
    raw: memoryview | None = memoryview(frame)
    item: int | None = None
    for name, index in _PATH.findall(at.rstrip("`")):
        if name:
            names.append(name)
        else:
            item = int(index)
        raw = None if raw is None else _step(raw, name, index)
    missing = re.fullmatch(r"Object missing required field `(.+)`", text)
    if missing:
        names.append(missing.group(1))
        return InvalidField("missing", message_type=mtype, field=".".join(names))
    resolved = raw is not None
    problem = _problem(text, _value(raw) if raw is not None else None, resolved)
    if item is not None:
        problem = f"item {item} {problem}"
    return InvalidField(problem, message_type=mtype, field=".".join(names))


def _explain_long(frame: Frame, verdict: str, mtype: str) -> ProtocolError:
    """:func:`explain` for a long frame: its cost bounded by the frame's top-level keys."""
    text, _, at = verdict.partition(" - at `$")
    steps = _PATH.findall(at.rstrip("`"))
    names = [name for name, _ in steps if name]
    missing = re.fullmatch(r"Object missing required field `(.+)`", text)
    if missing:
        return InvalidField(
            "missing", message_type=mtype, field=".".join([*names, missing.group(1)])
        )
    value: Any = None
    resolved = False
    if len(steps) == 1 and steps[0][0]:  # a top-level field: perhaps found by its headers
        extent = top_field(frame, steps[0][0])
        if extent is not None:
            view = memoryview(frame)[extent.start : extent.end]
            shape = _header(view)
            if shape is not None:
                value, resolved = shape, True
            elif extent.end is not None:  # a scalar or short string: its own few bytes
                value, resolved = _value(view), True
    problem = _problem(_clip(text), value, resolved)
    items = [index for name, index in steps if not name]
    if items:
        problem = f"item {items[-1]} {problem}"
    return InvalidField(problem, message_type=mtype, field=".".join(names))


def _problem(text: str, value: Any, resolved: bool) -> str:
    """What was wrong with ``value`` (if ``resolved``), from msgspec's words ``text``."""
    if found := re.fullmatch(r"Expected `(.+?)`, got `(.+?)`", text):
        expected, got = found.groups()
        what = _kind(value) if resolved else _GOT.get(got, got)
        return f"is {what}, expected {_EXPECTED.get(expected, expected)}"
    if found := re.fullmatch(r"Expected `(\w+)` of length <= (\d+)", text):
        kind, most = found.group(1), int(found.group(2))
        unit = _UNITS.get(kind, "items")
        return _too_long(value, most, unit) if resolved else f"is over the limit of {most} {unit}"
    if found := re.fullmatch(r"Expected `(\w+)` of length >= (\d+)", text):
        kind, least = found.group(1), found.group(2)
        unit = _UNITS.get(kind, "items")
        return (
            f"is {len(value)} {unit}, expected at least {least}"
            if resolved
            else (f"expected at least {least} {unit}")
        )
    if found := re.fullmatch(r"Expected `int` >= (-?\d+)", text):
        at = f"is {value}, " if resolved else ""
        return f"{at}expected at least {found.group(1)}"
    if found := re.fullmatch(r"Expected `int` <= (-?\d+)", text):
        at = f"is {value}," if resolved else "is"
        return f"{at} more than the limit of {found.group(1)}"
    return text


# --- bounds a node tightens --------------------------------------------------------

_Check = Callable[[Any, Limits], str | None]


def _bound_check(info: Any, unit: str) -> _Check | None:
    """The check of the Limits attribute that tightens ``info`` (an inspected type), if any."""
    extra = getattr(info, "extra", None) or {}
    limit = extra.get("limit")
    if limit is None:
        return None

    def check(value: Any, limits: Limits) -> str | None:
        most = getattr(limits, limit)
        if unit == "value":
            return None if value <= most else f"is {value}, more than the limit of {most}"
        return None if len(value) <= most else _too_long(value, most, unit)

    return check


def _unit(info: Any) -> str:
    kind = type(getattr(info, "type", info)).__name__
    return {"StrType": "characters", "BytesType": "bytes", "IntType": "value"}.get(kind, "items")


def _field_checks(prefix: str, struct: Any) -> Iterable[tuple[str, tuple[str, ...], _Check]]:
    """``(label, attribute path, check)`` for each tightenable bound of ``struct``."""
    for field in struct.fields:
        label = prefix + field.encode_name
        info = field.type
        inner = getattr(info, "type", info)
        if isinstance(inner, mi.StructType):
            for sub, path, check in _field_checks(f"{label}.", inner):
                yield sub, (field.name, *path), check
            continue
        own = _bound_check(info, _unit(info))
        if own is not None:
            yield label, (field.name,), own
        item_info = getattr(inner, "item_type", None)
        item = None if item_info is None else _bound_check(item_info, _unit(item_info))
        if item is not None:
            yield label, (field.name,), _each(item)


def _each(check: _Check) -> _Check:
    """``check`` on every item of a collection; its problem names the item."""

    def check_items(values: Any, limits: Limits) -> str | None:
        for index, value in enumerate(values):
            problem = check(value, limits)
            if problem is not None:
                return f"item {index} {problem}"
        return None

    return check_items


def tuned_checker(types: Mapping[str, type]) -> Callable[[Any, Limits], None]:
    """A check of a decoded message against tightened :class:`Limits`, derived from its types.

    Raises:
        InvalidField: From the check, naming the message type and the field.
    """
    table = {cls: list(_field_checks("", mi.type_info(cls))) for cls in types.values()}

    def check(msg: Any, limits: Limits) -> None:
        for label, path, bound in table[type(msg)]:
            value = msg
            for name in path:
                value = getattr(value, name)
                if value is msgspec.UNSET:  # an extension the peer did not send
                    break
            else:
                problem = bound(value, limits)
                if problem is not None:
                    raise InvalidField(problem, message_type=msg.TYPE, field=label)

    return check
