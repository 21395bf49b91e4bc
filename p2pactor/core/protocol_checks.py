"""What a refused frame is told, and the bounds a node tightens.

msgspec checks every bound as it decodes a frame (the field types of
:mod:`p2pactor.core.protocol` carry them). When it refuses one,
:func:`explain` turns its verdict into the :class:`~p2pactor.errors.ProtocolError`
the node logs: the message type, the field by its wire name, and what was
wrong with the value the peer sent (``is -3, expected at least 0``). That
path reads the frame a second time, untyped, which costs nothing a valid frame
pays.

A node may tighten the bounds (:class:`~p2pactor.core.protocol_limits.Limits`):
:func:`tuned_checker` derives, from the same field types, the checks a decoded
message then also passes; each bound names the ``Limits`` attribute that
lowers it.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, Final

import msgspec
import msgspec.inspect as mi

from p2pactor.core.protocol_limits import Limits
from p2pactor.errors import InvalidField, MalformedFrame, ProtocolError, UnknownMessageType

__all__ = ["explain", "tuned_checker"]

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
    return "nil" if value is None else type(value).__name__


def _too_long(value: Sized, most: int, unit: str) -> str:
    if unit == "items":
        return f"has {len(value)} items, more than the limit of {most}"
    return f"is {len(value)} {unit}, more than the limit of {most}"


def explain(frame: bytes, exc: msgspec.ValidationError, known: Mapping[str, type]) -> ProtocolError:
    """The error for a frame msgspec refused with ``exc``: what, where, and why."""
    if isinstance(exc.__cause__, ProtocolError):  # a message's own __post_init__ check
        return exc.__cause__
    try:
        wire = msgspec.msgpack.decode(frame)
    except Exception as err:
        return MalformedFrame(f"not valid msgpack: {err}")
    if type(wire) is not dict:
        return MalformedFrame(f"top-level value is {_kind(wire)}, expected a map")
    mtype = wire.get("type", _MISSING)
    if mtype is _MISSING:
        return MalformedFrame("map has no 'type' key")
    if type(mtype) is not str:
        return MalformedFrame(f"'type' is {_kind(mtype)}, expected str")
    if mtype not in known:
        return UnknownMessageType(
            f"unknown message type (known: {', '.join(known)})", message_type=_clip(mtype)
        )
    text, _, at = str(exc).partition(" - at `$")
    names: list[str] = []
    value: Any = wire
    item: int | None = None
    resolved = True  # whether ``value`` is what the peer sent at the path
    for name, index in _PATH.findall(at.rstrip("`")):
        if name:
            names.append(name)
            resolved = resolved and type(value) is dict and name in value
            value = value.get(name) if resolved else None
        else:
            item = int(index)
            resolved = resolved and type(value) is list and item < len(value)
            value = value[item] if resolved else None
    missing = re.fullmatch(r"Object missing required field `(.+)`", text)
    if missing:
        names.append(missing.group(1))
        return InvalidField("missing", message_type=mtype, field=".".join(names))
    problem = _problem(text, value, resolved)
    if item is not None:
        problem = f"item {item} {problem}"
    return InvalidField(problem, message_type=mtype, field=".".join(names))


def _problem(text: str, value: Any, resolved: bool) -> str:
    """What was wrong with ``value`` (if ``resolved``), from msgspec's words ``text``."""
    if found := re.fullmatch(r"Expected `(.+?)`, got `(.+?)`", text):
        expected, got = found.groups()
        what = _kind(value) if resolved else _GOT.get(got, got)
        return f"is {what}, expected {_EXPECTED.get(expected, expected)}"
    if found := re.fullmatch(r"Expected `(\w+)` of length <= (\d+)", text):
        kind, most = found.group(1), int(found.group(2))
        return _too_long(value, most, _UNITS.get(kind, "items"))
    if found := re.fullmatch(r"Expected `(\w+)` of length >= (\d+)", text):
        kind, least = found.group(1), found.group(2)
        return f"is {len(value)} {_UNITS.get(kind, 'items')}, expected at least {least}"
    if found := re.fullmatch(r"Expected `int` >= (-?\d+)", text):
        return f"is {value}, expected at least {found.group(1)}"
    if found := re.fullmatch(r"Expected `int` <= (-?\d+)", text):
        return f"is {value}, more than the limit of {found.group(1)}"
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
