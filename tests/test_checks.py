"""The shared attrs validators of p2pactor.core.checks."""

from __future__ import annotations

import math
import re

import attrs
import pytest

from p2pactor.core import checks
from p2pactor.errors import ConfigError


@attrs.frozen(kw_only=True)
class Sample:
    seconds: float = attrs.field(default=1.0, validator=checks.positive(finite=False))
    finite_seconds: float = attrs.field(default=1.0, validator=checks.positive(finite=True))
    grace: float = attrs.field(default=0.0, validator=checks.non_negative(finite=False))
    finite_grace: float = attrs.field(default=0.0, validator=checks.non_negative(finite=True))
    count: int = attrs.field(default=1, validator=checks.positive_int)
    threads: int = attrs.field(default=0, validator=checks.non_negative_int)
    port: int = attrs.field(default=0, validator=checks.port)
    dashboard_port: int | None = attrs.field(default=None, validator=checks.optional_port)


INF = math.inf
NAN = math.nan

ACCEPTED = [
    ("seconds", 0.5),
    ("seconds", 3),
    ("seconds", INF),
    ("finite_seconds", 1e-6),
    ("grace", 0.0),
    ("grace", 0),
    ("grace", INF),
    ("finite_grace", 0.0),
    ("finite_grace", 2.5),
    ("count", 1),
    ("count", 10**12),
    ("threads", 0),
    ("port", 0),
    ("port", 65535),
    ("dashboard_port", None),
    ("dashboard_port", 8080),
]

REFUSED = [
    ("seconds", 0.0),
    ("seconds", -1.0),
    ("seconds", NAN),
    ("seconds", True),
    ("seconds", "1"),
    ("seconds", None),
    ("finite_seconds", INF),
    ("finite_seconds", 0),
    ("grace", -0.1),
    ("grace", NAN),
    ("grace", False),
    ("finite_grace", INF),
    ("finite_grace", -INF),
    ("count", 0),
    ("count", -3),
    ("count", 1.0),
    ("count", True),
    ("threads", -1),
    ("threads", 0.0),
    ("threads", False),
    ("port", -1),
    ("port", 65536),
    ("port", 80.0),
    ("port", True),
    ("port", None),
    ("dashboard_port", 70000),
    ("dashboard_port", "80"),
]


@pytest.mark.parametrize(("field", "value"), ACCEPTED)
def test_good_values_pass(field: str, value: object) -> None:
    assert getattr(Sample(**{field: value}), field) == value  # type: ignore[arg-type]


@pytest.mark.parametrize(("field", "value"), REFUSED)
def test_bad_values_raise_a_config_error_naming_class_and_field(field: str, value: object) -> None:
    pattern = rf"^Sample\.{field} must be .*, got {re.escape(repr(value))}$"
    with pytest.raises(ConfigError, match=pattern) as info:
        Sample(**{field: value})  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)


def test_messages_say_what_is_wanted() -> None:
    cases = {
        "seconds": "a number above 0",
        "finite_seconds": "a finite number above 0",
        "grace": "a number >= 0",
        "finite_grace": "a finite number >= 0",
        "count": "a positive integer",
        "threads": "an integer >= 0",
        "port": r"a TCP port \(0-65535\)",
        "dashboard_port": r"a TCP port \(0-65535\) or None \(off\)",
    }
    for field, wanted in cases.items():
        with pytest.raises(ConfigError, match=f"must be {wanted}, got -1"):
            Sample(**{field: -1})  # type: ignore[arg-type]


def test_validate_reruns_them() -> None:
    sample = Sample()
    object.__setattr__(sample, "count", 0)
    with pytest.raises(ConfigError, match="count"):
        attrs.validate(sample)


def test_the_callers_keep_their_rules() -> None:
    from p2pactor.adapters._nixl_options import NixlOptions  # noqa: PLC0415
    from p2pactor.adapters._zmq_socket import ZmqOptions  # noqa: PLC0415
    from p2pactor.core.timings import Timings  # noqa: PLC0415
    from p2pactor.runtime.config import NodeConfig  # noqa: PLC0415
    from p2pactor.runtime.log import Durability  # noqa: PLC0415
    from p2pactor.surface.timeline.feed import FeedLimits  # noqa: PLC0415

    # Timers and intervals of the node may be endless; the transports' may not.
    assert Timings(load_timeout=INF).load_timeout == INF
    assert NodeConfig(idle_timeout=INF).idle_timeout == INF
    assert FeedLimits(max_behind_s=INF).max_behind_s == INF
    assert Durability(interval_s=INF).interval_s == INF
    with pytest.raises(ConfigError, match=r"NixlOptions\.transfer_timeout"):
        NixlOptions(transfer_timeout=INF)
    with pytest.raises(ConfigError, match=r"ZmqOptions\.send_timeout"):
        ZmqOptions(send_timeout=INF)
    with pytest.raises(ConfigError, match=r"NodeConfig\.port"):
        NodeConfig(port=True)
    with pytest.raises(ConfigError, match=r"Timings\.pin_timeout"):
        Timings(pin_timeout=True)
