"""What an engine's threads tell the node about what it holds, and the choices it waits for.

The records the thread-safe side of a node (:mod:`p2pactor.runtime.threadsafe_sources`)
hands to the node's thread through the engine bridge, where
:meth:`~p2pactor.runtime.directory.SourceDirectory.apply` (or, for a choice,
the node's ``locate``) applies them; and the :class:`Decision` the engine
reads back for a request that names no source.
"""

from __future__ import annotations

import msgspec


class Decision(msgspec.Struct, frozen=True, gc=False):
    """The choice made for an engine's request that names no source.

    Attributes:
        peer: The peer asked, or None: nobody (every key is a MISS).
        asked: How many of the request's keys (its first ones) were asked.
    """

    peer: str | None
    asked: int


# What an engine's thread hands the node's thread about holdings and choices
# (through the engine bridge; applied by :meth:`SourceDirectory.apply`).
class Held(msgspec.Struct, frozen=True, gc=False):
    """The engine now holds ``keys`` (it stored them, or loaded them from a peer).

    For ``request`` (its id), at ``positions`` (the keys' end-token positions),
    when the engine says (:meth:`~p2pactor.core.holdings.Holdings.stored`);
    ``now``: tell the peers at once, not with the next batched delta.
    """

    keys: tuple[bytes, ...]
    request: str | None = None
    positions: tuple[int | None, ...] | None = None
    now: bool = False


class Reused(msgspec.Struct, frozen=True, gc=False):
    """The engine's ``request`` reused ``keys`` (at ``positions``) its cache held."""

    keys: tuple[bytes, ...]
    request: str
    positions: tuple[int | None, ...]


class Ended(msgspec.Struct, frozen=True, gc=False):
    """The engine's ``request`` finished: what it stored or loaded is its most recent."""

    request: str


class Touched(msgspec.Struct, frozen=True, gc=False):
    """The engine reused ``keys``."""

    keys: tuple[bytes, ...]


class Lacking(msgspec.Struct, frozen=True, gc=False):
    """A check with the engine found ``keys`` gone."""

    keys: tuple[bytes, ...]


class Reserved(msgspec.Struct, frozen=True, gc=False):
    """Loads in flight took ``blocks`` more of the engine's cache (negative: gave back)."""

    blocks: int


class Drained(msgspec.Struct, frozen=True, gc=False):
    """The engine dropped everything it held."""


class Scrubbed(msgspec.Struct, frozen=True, gc=False):
    """The engine checked a batch (``Node.take_scrub``): the keys it lacks, the ones it holds."""

    gone: tuple[bytes, ...]
    kept: tuple[bytes, ...]


class LocateWanted(msgspec.Struct, frozen=True, gc=False):
    """Choose a source for ``kv_request_id`` (which names none) and ask it about ``keys``."""

    kv_request_id: str
    keys: tuple[bytes, ...]


# An engine call about holdings or a choice.
SourcesCall = (
    Held | Reused | Ended | Touched | Lacking | Reserved | Drained | Scrubbed | LocateWanted
)
