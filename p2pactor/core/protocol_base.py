"""What every wire message is made of: bounded field types and the tagged base class.

:mod:`p2pactor.core.protocol` (vLLM's base dialect and the connect extension)
and :mod:`p2pactor.core.protocol_summaries` (the summary extension) build
their messages from these; :mod:`p2pactor.core.protocol` gathers them into
one decoder.

This module is pure: no I/O, no clock, no concurrency.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from p2pactor.core.protocol_limits import (
    MAX_AGENT_METADATA_BYTES,
    MAX_BLOCK_INDEX,
    MAX_BLOCK_LEN,
    MAX_DEADLINE_MS,
    MAX_EXTENSION_VERSION,
    MAX_FEATURE_CHARS,
    MAX_FEATURES,
    MAX_KEY_BYTES,
    MAX_LIST_ITEMS,
    MAX_NUM_BLOCKS,
    MAX_ROUND_SEQ,
    MAX_STRING_CHARS,
)
from p2pactor.errors import InvalidField

# ---------------------------------------------------------------------------
# Field types: the bound each has on the wire, and the Limits attribute that
# may lower it on one node (named in the Meta's ``extra``).
# ---------------------------------------------------------------------------


def bounded(most: int, limit: str) -> Meta:
    """At most ``most`` items, bytes or characters; the ``Limits`` attribute ``limit`` lowers it."""
    return Meta(max_length=most, extra={"limit": limit})


def in_range(least: int, most: int, limit: str) -> Meta:
    """Between ``least`` and ``most``; the ``Limits`` attribute ``limit`` lowers the top."""
    return Meta(ge=least, le=most, extra={"limit": limit})


Text = Annotated[str, bounded(MAX_STRING_CHARS, "max_string_chars")]
Key = Annotated[bytes, bounded(MAX_KEY_BYTES, "max_key_bytes")]
Keys = Annotated[tuple[Key, ...], bounded(MAX_LIST_ITEMS, "max_list_items")]
Hits = Annotated[tuple[bool, ...], bounded(MAX_LIST_ITEMS, "max_list_items")]
BlockIndex = Annotated[int, in_range(0, MAX_BLOCK_INDEX, "max_block_index")]
BlockIndexes = Annotated[tuple[BlockIndex, ...], bounded(MAX_LIST_ITEMS, "max_list_items")]
Round = Annotated[int, in_range(0, MAX_ROUND_SEQ, "max_round_seq")]
DeadlineMs = Annotated[int, in_range(0, MAX_DEADLINE_MS, "max_deadline_ms")]
Metadata = Annotated[bytes, bounded(MAX_AGENT_METADATA_BYTES, "max_agent_metadata_bytes")]
NumBlocks = Annotated[int, in_range(1, MAX_NUM_BLOCKS, "max_num_blocks")]
BlockLen = Annotated[int, in_range(1, MAX_BLOCK_LEN, "max_block_len")]
# msgpack's own integers end at 2**64 - 1: no bound to check above.
Address = Annotated[int, Meta(ge=0)]
Feature = Annotated[str, bounded(MAX_FEATURE_CHARS, "max_feature_chars")]
Features = Annotated[frozenset[Feature], bounded(MAX_FEATURES, "max_features")]
Version = Annotated[int, Meta(ge=0, le=MAX_EXTENSION_VERSION)]


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
