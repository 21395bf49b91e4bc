"""The attrs validators the option and config classes share.

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
from collections.abc import Callable
from typing import Any, TypeGuard

import attrs

from p2pactor.errors import ConfigError

# What ``attrs.field(validator=...)`` takes.
Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _refuse(instance: object, attribute: attrs.Attribute[Any], value: object, what: str) -> None:
    owner = "" if instance is None else f"{type(instance).__name__}."
    raise ConfigError(f"{owner}{attribute.name} must be {what}, got {value!r}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _number_passes(value: Any, test: Callable[[Any], object], *, finite: bool) -> bool:
    if isinstance(value, bool):
        return False
    try:
        # NaN fails every comparison; a non-number raises TypeError (or, for
        # an array, ValueError).
        return bool(test(value)) and (not finite or math.isfinite(value))
    except (TypeError, ValueError):
        return False


def positive(*, finite: bool) -> Validator:
    """A number above 0 (int or float, not bool); ``finite=True`` also refuses ``inf``."""
    what = "a finite number above 0" if finite else "a number above 0"

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not _number_passes(value, lambda v: v > 0, finite=finite):
            _refuse(instance, attribute, value, what)

    return check


def non_negative(*, finite: bool) -> Validator:
    """A number >= 0 (int or float, not bool); ``finite=True`` also refuses ``inf``."""
    what = "a finite number >= 0" if finite else "a number >= 0"

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not _number_passes(value, lambda v: v >= 0, finite=finite):
            _refuse(instance, attribute, value, what)

    return check


def fraction(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A share: a number above 0 and at most 1 (not bool)."""
    if not _number_passes(value, lambda v: 0 < v <= 1, finite=True):
        _refuse(instance, attribute, value, "a number above 0 and at most 1")


def positive_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An int above 0 (not bool, not float)."""
    if not (_is_int(value) and value > 0):
        _refuse(instance, attribute, value, "a positive integer")


def non_negative_int(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """An int >= 0 (not bool, not float)."""
    if not (_is_int(value) and value >= 0):
        _refuse(instance, attribute, value, "an integer >= 0")


def port(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A TCP port: an int from 0 (any free port) to 65535."""
    if not (_is_int(value) and 0 <= value <= 65535):
        _refuse(instance, attribute, value, "a TCP port (0-65535)")


def optional_port(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A TCP port, or None for "off"."""
    if value is not None and not (_is_int(value) and 0 <= value <= 65535):
        _refuse(instance, attribute, value, "a TCP port (0-65535) or None (off)")


def instance_of(kind: type) -> Validator:
    """An instance of ``kind`` (a bool where a bool is asked for, an options object)."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, kind):
            _refuse(instance, attribute, value, f"a {kind.__name__}")

    return check
