"""What every wire message is made of: the tagged base class and the bound a node tightens.

:mod:`p2pactor.core.protocol` (vLLM's base dialect and the connect extension)
and :mod:`p2pactor.core.protocol_summaries` (the summary extension) build
their messages from these; :mod:`p2pactor.core.protocol` gathers them into
one decoder.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import msgspec
from msgspec import Meta

from p2pactor.errors import InvalidField


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
