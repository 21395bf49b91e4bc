"""How a message's fields look on the wire, and the code generated from that.

Each message class of :mod:`p2pactor.core.protocol` describes its fields once, in
``attrs.field`` metadata made by :func:`_w`; this module turns those
descriptions into straight-line encoders and strict decoders, and holds the
error-text helpers the decoders call on their failure paths. It never imports
the message module: the classes are passed in.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sized
from typing import Any, Final, NoReturn, TypeAlias

import attrs

from p2pactor.core.protocol_limits import Limits
from p2pactor.errors import InvalidField

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
    exec(compile(source, f"<p2pactor.core.protocol {name}>", "exec"), namespace)  # noqa: S102
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


# ---------------------------------------------------------------------------
# Strict decoding
# ---------------------------------------------------------------------------

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
