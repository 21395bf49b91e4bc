"""The attrs validators and the environment reader the option and config classes share.

Each raises :class:`~p2pactor.errors.ConfigError` naming the class and the field
(``NodeConfig.port must be ...``), so the message tells an operator which
setting to fix. Unlike ``attrs.validators.gt``/``ge`` (plain ``ValueError``, and
``True`` passes as 1), these:

* refuse ``bool`` everywhere: ``True`` is never a timeout or a count;
* refuse NaN, and a value that cannot be compared with 0 (a string, None),
  with a ConfigError rather than a TypeError;
* take ints only where an int is asked for (:func:`positive_int`,
  :func:`non_negative_int`, :func:`port`);
* for numbers, make the caller decide about infinity: ``finite=True`` refuses
  ``inf``; ``finite=False`` lets it mean "never" (an endless timeout).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeGuard

import attrs

from p2pactor.errors import ConfigError

# What ``attrs.field(validator=...)`` takes.
Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def rule(what: str, test: Callable[[Any], object]) -> Validator:
    """A validator refusing, as not ``what``, each value ``test`` fails or cannot judge."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        try:
            # NaN fails every comparison; a non-number raises TypeError (or, for
            # an array, ValueError).
            passes = bool(test(value))
        except (TypeError, ValueError):
            passes = False
        if not passes:
            owner = "" if instance is None else f"{type(instance).__name__}."
            raise ConfigError(f"{owner}{attribute.name} must be {what}, got {value!r}")

    return check


def _number(what: str, test: Callable[[Any], object], *, finite: bool) -> Validator:
    def number(v: Any) -> bool:
        return not isinstance(v, bool) and bool(test(v)) and (not finite or math.isfinite(v))

    return rule(f"a finite {what}" if finite else f"a {what}", number)


def positive(*, finite: bool) -> Validator:
    """A number above 0 (int or float, not bool); ``finite=True`` also refuses ``inf``."""
    return _number("number above 0", lambda v: v > 0, finite=finite)


def non_negative(*, finite: bool) -> Validator:
    """A number >= 0 (int or float, not bool); ``finite=True`` also refuses ``inf``."""
    return _number("number >= 0", lambda v: v >= 0, finite=finite)


# A share: a number above 0 and at most 1 (not bool).
fraction = _number("number above 0 and at most 1", lambda v: 0 < v <= 1, finite=False)
# An int above 0 (not bool, not float).
positive_int = rule("a positive integer", lambda v: _is_int(v) and v > 0)
# An int >= 0 (not bool, not float).
non_negative_int = rule("an integer >= 0", lambda v: _is_int(v) and v >= 0)
# A TCP port: an int from 0 (any free port) to 65535.
port = rule("a TCP port (0-65535)", lambda v: _is_int(v) and 0 <= v <= 65535)
# A TCP port, or None for "off".
optional_port = rule(
    "a TCP port (0-65535) or None (off)", lambda v: v is None or (_is_int(v) and 0 <= v <= 65535)
)


def instance_of(kind: type) -> Validator:
    """An instance of ``kind`` (a bool where a bool is asked for, an options object)."""
    return rule(f"a {kind.__name__}", lambda v: isinstance(v, kind))


def env_values(
    env: Mapping[str, str], table: Mapping[str, tuple[str, Callable[[str], Any]]]
) -> dict[str, Any]:
    """The fields the variables of ``env`` set, parsed, as ``table`` says (name: field, parser).

    An unset or empty variable sets nothing, so the field keeps its default.

    Raises:
        ConfigError: A parser refused a value (a ValueError); the message names
            the variable.
    """
    values: dict[str, Any] = {}
    for name, (field, parse) in table.items():
        if raw := env.get(name):
            try:
                values[field] = parse(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a valid {parse.__name__}") from None
    return values
