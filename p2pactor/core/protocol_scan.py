"""A frame's top level read from its headers, without decoding it.

Every message is a msgpack map whose first key is ``"type"``, as p2pactor and
vLLM encode it. Reading that first key and value from the frame's first bytes
tells a frame's type at no cost, where a decoder would walk the whole frame to
skip the rest. And a refused frame's error names a top-level field: where the
values before it are strings, bytes or scalars (whose msgpack headers say how
long they are), the field is found by jumping from header to header, never
walking a long array or map, whatever it holds.

Both give up (``None``) on anything else; the caller then does it the slow way
or words the error without the value. Pure: no I/O, no clock.
"""

from __future__ import annotations

from typing import Final, TypeAlias

__all__ = ["Extent", "Frame", "leading_type", "top_field"]

Frame: TypeAlias = bytes | memoryview
"""A frame as received: bytes, or a view of a large one the transport did not copy."""

_MAX_TYPE_BYTES: Final = 64
# Scalars and length-prefixed values: header byte -> (bytes of the length, fixed payload).
_FIXED: Final = {
    0xC0: 0,
    0xC2: 0,
    0xC3: 0,
    0xCA: 4,
    0xCB: 8,
    0xCC: 1,
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,
    0xD0: 1,
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,
    0xD4: 2,
    0xD5: 3,
    0xD6: 5,
    0xD7: 9,
    0xD8: 17,
}
_SIZED: Final = {  # str, bin: length bytes; ext: length bytes, then a type byte
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),
}
_MAPS: Final = {0xDE: 2, 0xDF: 4}
_ARRAYS: Final = {0xDC: 2, 0xDD: 4}


class Extent:
    """Where a value is in a frame: ``start`` to ``end``, or only where it starts.

    ``end`` is None for an array or map (its length is in items, not bytes).
    """

    __slots__ = ("end", "start")

    def __init__(self, start: int, end: int | None) -> None:
        self.start, self.end = start, end


def _map_start(frame: memoryview) -> tuple[int, int] | None:
    """The number of pairs of the top-level map, and where its first key starts."""
    if not frame:
        return None
    first = frame[0]
    if 0x80 <= first <= 0x8F:
        return first & 0x0F, 1
    width = _MAPS.get(first)
    if width is None or len(frame) < 1 + width:
        return None
    return int.from_bytes(frame[1 : 1 + width], "big"), 1 + width


def _extent(frame: memoryview, at: int) -> Extent | None:
    """The extent of the value starting at ``at`` (an array's or map's end unknown)."""
    if at >= len(frame):
        return None
    head = frame[at]
    if head <= 0x7F or head >= 0xE0:  # fixints
        return Extent(at, at + 1)
    if 0xA0 <= head <= 0xBF:  # fixstr
        return Extent(at, at + 1 + (head & 0x1F))
    if 0x80 <= head <= 0x9F or head in _MAPS or head in _ARRAYS:
        return Extent(at, None)
    if head in _FIXED:
        return Extent(at, at + 1 + _FIXED[head])
    sized = _SIZED.get(head)
    if sized is None:
        return None
    width, extra = sized
    if len(frame) < at + 1 + width:
        return None
    n = int.from_bytes(frame[at + 1 : at + 1 + width], "big")
    return Extent(at, at + 1 + width + extra + n)


def leading_type(frame: Frame) -> str | None:
    """The frame's ``"type"`` if it is its map's first key and a short string, else None."""
    view = memoryview(frame)
    start = _map_start(view)
    if start is None or start[0] == 0:
        return None
    at = start[1]
    if bytes(view[at : at + 5]) != b"\xa4type":
        return None
    value = _extent(view, at + 5)
    if value is None or value.end is None or value.end > len(view):
        return None
    head = view[value.start]
    skip = 1 if 0xA0 <= head <= 0xBF else 2 if head == 0xD9 else 0
    if not skip or value.end - value.start - skip > _MAX_TYPE_BYTES:
        return None
    try:
        return bytes(view[value.start + skip : value.end]).decode()
    except UnicodeDecodeError:
        return None


def top_field(frame: Frame, name: str) -> Extent | None:
    """Where top-level key ``name``'s value is, if only short values come before it."""
    view = memoryview(frame)
    start = _map_start(view)
    if start is None:
        return None
    pairs, at = start
    wanted = name.encode()
    for _ in range(pairs):
        key = _extent(view, at)
        if key is None or key.end is None:
            return None
        value = _extent(view, key.end)
        if value is None:
            return None
        head = view[at]
        skip = 1 if 0xA0 <= head <= 0xBF else 2 if head == 0xD9 else 3 if head == 0xDA else 0
        if skip and bytes(view[at + skip : key.end]) == wanted:
            return value
        if value.end is None:
            return None  # an array or map before it: finding its end means walking it
        at = value.end
    return None
