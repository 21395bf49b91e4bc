"""What every wire message is made of: the tagged base class, and the bounds a node tightens.

:mod:`p2pactor.core.protocol` (vLLM's base dialect and the connect extension)
and :mod:`p2pactor.core.protocol_summaries` (the summary extension) build
their messages on :class:`MessageBase`. The constants are the default bounds,
which their field types carry (:func:`bounded`) and msgspec checks as it
decodes; :class:`Limits` lets a node tighten them: :func:`tuned_checker`
derives, from the same field types, the checks a decoded message then also
passes (each bound names the ``Limits`` attribute that lowers it). The
constants and :class:`Limits` are re-exported by :mod:`p2pactor.core.protocol`,
where they are documented to live. Pure: no I/O, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar, Final, TypeAlias, cast

import attrs
import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from p2pactor.errors import ConfigError, InvalidField

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

MAX_SUMMARY_BYTES: Final = 8 * 65_536
"""Most bytes of packed fingerprints in one summary field (65,536 keys of 8 bytes)."""

MAX_EPOCH_BYTES: Final = 64
"""Longest epoch id a summary names."""

DEFAULT_MAX_FRAME_BYTES: Final = 16 * 1024 * 1024
"""Largest frame :func:`~p2pactor.core.protocol.decode` (and the ZeroMQ transport) reads by default.

Less than the protocol's metadata bound on purpose: whatever a peer sends,
a frame costs the node up to about twice its size while it is read and
refused, so the frame bound is what one frame of a hostile peer may cost
(issue 30). 16 MiB holds a ``connect`` with 15 MiB of NIXL agent metadata
(a DRAM pool's is about 500 bytes) and a full lookup of 65,536 vLLM keys
(2.4 MiB). Raise ``Limits.max_frame_bytes`` and ``ZmqOptions.max_frame_bytes``
for a peer whose metadata is larger."""


def bounded(most: int, limit: str) -> Meta:
    """At most ``most`` items, bytes or characters; the ``Limits`` attribute ``limit`` lowers it."""
    return Meta(max_length=most, extra={"limit": limit})


def wire_name(class_name: str) -> str:
    """A message class's wire ``"type"``: its name in snake case (``lookup_resp``)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", class_name).lower()


class MessageBase(
    msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type", tag=wire_name
):
    """Base of every message: frozen, tagged on the wire by ``"type"``."""

    TYPE: ClassVar[str]
    """The wire ``"type"`` (the class's tag)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TYPE = wire_name(cls.__name__)


def parallel(msg: MessageBase, name: str, items: tuple[Any, ...], keys: tuple[bytes, ...]) -> None:
    """Refuse ``msg`` unless its field ``name`` has one item per key."""
    if len(items) != len(keys):
        raise InvalidField(
            f"has {len(items)} items but 'keys' has {len(keys)}; they must be parallel",
            message_type=msg.TYPE,
            field=name,
        )


@attrs.frozen(kw_only=True)
class Limits:
    """The bounds :func:`~p2pactor.core.protocol.decode` enforces, so a node can tighten them.

    Every bound is inclusive. Each defaults to the protocol's own bound (the
    ``MAX_*`` constant of the same name), which the message types carry and
    msgspec checks as it decodes; a node may lower any of them, never raise
    one. Only ``max_frame_bytes``, checked before any decoding, may also be
    raised.

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
        max_summary_bytes: Most bytes of fingerprints in one summary field
            (8 per key).

    Raises:
        ConfigError: A bound is not an int, is negative (zero, for the
            frame, ``num_blocks`` and ``block_len`` bounds), or is above the
            protocol's own.
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
    max_summary_bytes: int = MAX_SUMMARY_BYTES

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
            most = value if field.name == "max_frame_bytes" else cast("int", field.default)
            if value > most:
                raise ConfigError(
                    f"Limits.{field.name} is {value}, above the protocol's own bound "
                    f"({most}); a node can only lower it"
                )


DEFAULT_LIMITS: Final = Limits()
"""The bounds :func:`~p2pactor.core.protocol.decode` uses unless told otherwise."""


UNITS: Final = {"str": "characters", "bytes": "bytes", "int": "value"}
"""What a bound of each kind of value counts (anything else: ``items``; a number: its value)."""


def over_limit(value: Any, most: int, unit: str) -> str:
    """How ``value`` (a number if ``unit`` is ``"value"``, else sized) is over ``most``."""
    if unit == "value":
        return f"is {value}, more than the limit of {most}"
    if unit == "items":
        return f"has {len(value)} items, more than the limit of {most}"
    return f"is {len(value)} {unit}, more than the limit of {most}"


def _unit(info: Any) -> str:
    kind = type(getattr(info, "type", info)).__name__.removesuffix("Type").lower()
    return UNITS.get(kind, "items")


_Bound: TypeAlias = tuple[str, tuple[str, ...], str, str, bool]


def _bounds(prefix: str, path: tuple[str, ...], struct: Any) -> Iterator[_Bound]:
    """``(label, attribute path, Limits attribute, unit, per item)``: each bound of ``struct``."""
    for field in struct.fields:
        label, info = prefix + field.encode_name, field.type
        inner = getattr(info, "type", info)
        if isinstance(inner, mi.StructType):
            yield from _bounds(f"{label}.", (*path, field.name), inner)
            continue
        for each, bound in ((False, info), (True, getattr(inner, "item_type", None))):
            limit = (getattr(bound, "extra", None) or {}).get("limit")
            if limit is not None:
                yield label, (*path, field.name), limit, _unit(bound), each


def tuned_checker(types: Mapping[str, type]) -> Callable[[Any, Limits], None]:
    """A check of a decoded message against tightened :class:`Limits`, derived from its types.

    Raises:
        InvalidField: From the check, naming the message type and the field.
    """
    table = {cls: list(_bounds("", (), mi.type_info(cls))) for cls in types.values()}

    def check(msg: Any, limits: Limits) -> None:
        for label, path, limit, unit, each in table[type(msg)]:
            value = msg
            for name in path:
                value = getattr(value, name)
                if value is msgspec.UNSET:  # an extension the peer did not send
                    break
            else:
                most = getattr(limits, limit)
                for index, item in enumerate(value) if each else [(None, value)]:
                    if (item if unit == "value" else len(item)) > most:
                        problem = over_limit(item, most, unit)
                        raise InvalidField(
                            problem if index is None else f"item {index} {problem}",
                            message_type=msg.TYPE,
                            field=label,
                        )

    return check
