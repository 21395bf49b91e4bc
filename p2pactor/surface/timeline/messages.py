"""The feed's messages (``docs/timeline.md``), built and encoded; nothing here sends.

Live and replay servers build the same messages here: ``hello``, ``snapshot``
(in chunks of bounded size), ``snapshot_end``, ``event``, ``gap`` and ``peers``
(``counters`` is :meth:`p2pactor.surface.timeline.counters.Counters.message`).
:class:`FeedRecord` is one event as the live feed keeps it, encoded once.
"""

from __future__ import annotations

import enum
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, Final, Literal

import msgspec

from p2pactor.core import events as ev
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.fold import ActorState, Phase
from p2pactor.core.producer import ProducerState
from p2pactor.surface.replay import describe
from p2pactor.surface.timeline.filters import FeedFilters

__all__ = [
    "FEED_VERSION",
    "FeedRecord",
    "Mode",
    "encode",
    "event_data",
    "event_message",
    "gap_message",
    "hello_message",
    "peers_message",
    "snapshot_chunks",
    "snapshot_end_message",
    "snapshot_message",
]

FEED_VERSION: Final = 1
"""The ``version`` in every ``hello``: the schema of ``docs/timeline.md``."""

Mode = Literal["live", "replay"]

_ENCODER: Final = msgspec.json.Encoder()
# Fields every event has; they are the event object's own keys, not its data.
_HEAD_FIELDS: Final = frozenset({"actor", "seq", "at"})
_DATA_FIELDS: Final[dict[type[ev.Event], tuple[str, ...]]] = {
    cls: tuple(f for f in cls.__struct_fields__ if f not in _HEAD_FIELDS)
    for cls in ev.EVENT_TYPES.values()
}
# The fields an event's log record leaves out while they hold their default
# (``omit_defaults``), and that default: the feed leaves them out too, so the
# Probed of a request that named its source has no ``source`` and looks as it
# did before the node could choose one.
_OMITTED_DEFAULTS: Final[dict[type[ev.Event], tuple[tuple[str, Any], ...]]] = {
    cls: tuple(
        (f.name, f.default)
        for f in msgspec.structs.fields(cls)
        if f.name not in _HEAD_FIELDS and f.default is not msgspec.NODEFAULT
    )
    for cls in ev.EVENT_TYPES.values()
    if cls.__struct_config__.omit_defaults
}
_SNAPSHOT_CHUNK_EVENTS: Final = 500
_SNAPSHOT_CHUNK_BYTES: Final = 256 * 1024  # well under trio-websocket's 1 MiB default


def encode(message: dict[str, Any]) -> str:
    """One message as JSON text (websocket text frames carry the feed)."""
    return _ENCODER.encode(message).decode()


def hello_message(mode: Mode, nodes: list[dict[str, Any]], filters: FeedFilters) -> str:
    """The ``hello`` message: the schema version, the mode, the nodes, the filters."""
    return encode(
        {
            "type": "hello",
            "version": FEED_VERSION,
            "mode": mode,
            "nodes": nodes,
            "filters": filters.as_json(),
        }
    )


def snapshot_message(texts: list[str], truncated: int) -> str:
    """A ``snapshot`` message of encoded events."""
    return f'{{"type":"snapshot","events":[{",".join(texts)}],"truncated":{truncated}}}'


def snapshot_chunks(texts: Iterator[str]) -> Generator[list[str], None, None]:
    """Group encoded events into snapshot messages of bounded size."""
    chunk: list[str] = []
    size = 0
    for text in texts:
        if chunk and (
            len(chunk) >= _SNAPSHOT_CHUNK_EVENTS or size + len(text) > _SNAPSHOT_CHUNK_BYTES
        ):
            yield chunk
            chunk, size = [], 0
        chunk.append(text)
        size += len(text) + 1
    if chunk:
        yield chunk


def snapshot_end_message(events: int, truncated: int, **extra: Any) -> str:
    """The ``snapshot_end`` message (replay adds its ``problems``)."""
    return encode({"type": "snapshot_end", "events": events, "truncated": truncated, **extra})


def _data_value(name: str, value: Any) -> Any:
    if isinstance(value, tuple):
        if name == "job_ids":
            return sorted(set(value))  # parallel to the keys: the distinct jobs say it all
        if value and isinstance(value[0], bool):
            return sum(value)  # hits as flags: how many hit
        return len(value)  # keys, hits or misses as keys, block lists
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)  # e.g. Probed's source: a Choice, with its claims
    return value


def event_data(event: ev.AnyEvent) -> dict[str, Any]:
    """The event's own fields, JSON-friendly: lists become counts, enums their values.

    A nested record (Probed's ``source``, the :class:`~p2pactor.core.sources.Choice`
    of an automatically chosen peer) becomes a dict, its lists kept whole; a
    field the event's log record omits at its default is omitted here too.
    """
    data = {name: _data_value(name, getattr(event, name)) for name in _DATA_FIELDS[type(event)]}
    for name, default in _OMITTED_DEFAULTS.get(type(event), ()):
        if getattr(event, name) == default:
            del data[name]
    return data


def event_message(node: str, event: ev.AnyEvent, phase: Phase) -> dict[str, Any]:
    """The ``event`` message of ``docs/timeline.md`` for one event of ``node``."""
    actor = event.actor
    return {
        "type": "event",
        "node": node,
        "actor": str(actor),
        "role": actor.role.value,
        "peer": actor.peer,
        "request": actor.kv_request_id,
        "incarnation": actor.incarnation,
        "seq": event.seq,
        "at": event.at,
        "kind": event.KIND,
        "phase": phase.value,
        "detail": describe(event),
        "data": event_data(event),
    }


def gap_message(missed: int) -> str:
    """The ``gap`` message: ``missed`` events were dropped here."""
    return f'{{"type":"gap","missed":{missed}}}'


class FeedRecord:
    """One event as the feed keeps it: encoded once, when first sent.

    Attributes:
        order: Position among every event this feed has seen.
        node: The node whose event it is.
        event: The event.
        phase: Its actor's phase after it.
    """

    __slots__ = ("_text", "event", "node", "order", "phase")

    def __init__(self, order: int, node: str, event: ev.AnyEvent, phase: Phase) -> None:
        self.order = order
        self.node = node
        self.event = event
        self.phase = phase
        self._text: str | None = None

    def message(self) -> dict[str, Any]:
        """The event message, as a dict."""
        return event_message(self.node, self.event, self.phase)

    def text(self) -> str:
        """The event message, as JSON; computed once and shared by every subscriber."""
        if self._text is None:
            self._text = encode(self.message())
        return self._text


def _transfers(states: Iterable[ActorState]) -> int:
    count = 0
    for state in states:
        if isinstance(state, ConsumerState):
            count += 0 if state.phase.terminal else len(state.loads)
        elif isinstance(state, ProducerState):
            count += len(state.transfers)
    return count


def peers_message(node: str, sessions: Sequence[Any]) -> dict[str, Any]:
    """The ``peers`` message: one entry per live session of the node.

    Args:
        node: The node's id.
        sessions: Its :class:`p2pactor.runtime.session.PeerSession` objects.
    """
    return {
        "type": "peers",
        "node": node,
        "peers": [
            {
                "peer": s.peer_id,
                "state": s.state.value,
                "ready": s.ready,
                "dialect": "p2pactor" if s.extended else "vllm",
                "transfers": _transfers(a.state for a in s.live_actors()),
                "last_activity": s.last_activity,
            }
            for s in sessions
        ],
    }
