"""Which peers may claim a fingerprint, for all peers at once: a Bloom filter with a column each.

The source index must find, for a request's first key, the peers that claim
it, and for each of them how far its claimed run goes: over 128 keys and 127
peers in well under 100 us. An inverted index of exact sets did that, at
about 300 bytes a claim. :class:`ClaimFilter` is a register-blocked Bloom
filter laid out as a table: a fingerprint names one row (a 64-bit word in
each peer's column) and a pattern of up to 6 bits, and a peer may claim it
when its word holds the whole pattern. A request's keys are one gather of
their rows, so every peer's run comes out of a few array operations.

A filter says "maybe": it never misses a fingerprint added to a column,
and says yes to one never added with a small probability (measured in
``docs/sources.md``; the index checks every "maybe" it acts on against the
peer's exact :class:`~p2pactor.core.sources.claims.ClaimSet`). A filter cannot
forget: a removed claim stays in its column until the column is rebuilt
from the exact claims, in slices, once the stale ones outnumber the live
ones. The table doubles its rows (each copied twice, which keeps every
column a superset) when the columns hold more than three keys a word.

Read from other threads while the node thread writes: every write leaves
a column a superset of the peer's claims, and a grown table replaces the
old one whole.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
import numpy.typing as npt

from p2pactor.core.sources.claims import FpArray

# Keys a column's word holds on average before the table doubles its rows (16 to 32 bits a key).
KEYS_PER_WORD = 3
MIN_WORDS, MAX_WORDS = 1 << 10, 1 << 24
MIN_COLUMNS = 2
_FIRST_STAGE = 8  # keys every candidate's run is checked over before the rest
# Removed claims a column may keep past as many as it has live ones, before it is rebuilt.
STALE_SLACK = 4096

_MIX = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it is a bijection on 64 bits
_ROW_SHIFT = np.uint64(40)  # rows from the top 24 bits, patterns from the low 36
_FIELD = 4095
# Each 12-bit field of a fingerprint's mixed bits sets two of a pattern's
# 64 bits; three fields, up to six bits. A table look-up, not six shifts.
_PAIRS = np.array([(1 << (x & 63)) | (1 << (x >> 6)) for x in range(_FIELD + 1)], np.uint64)
_FIELDS = np.array([0, 12, 24], np.uint64)
_PAIRS_INT: list[int] = _PAIRS.tolist()
_MIX_INT = int(_MIX)
_MASK64 = (1 << 64) - 1
# Indexes into the table: its rows, or its columns.
Rows = npt.NDArray[np.intp]


@attrs.define
class _Rebuild:
    """A column being rebuilt from a peer's claims, a slice at a time."""

    todo: FpArray
    scratch: FpArray
    at: int = 0
    added: int = 0  # keys added to the column meanwhile (also put in ``scratch``)


class ClaimFilter:
    """One Bloom-filter column per peer, every column in one table."""

    __slots__ = ("_built", "_free", "_load", "_rebuilds", "_table")

    def __init__(self) -> None:
        self._table: FpArray = np.zeros((MIN_WORDS, MIN_COLUMNS), np.uint64)
        self._load = [0] * MIN_COLUMNS  # keys added to each column since it was (re)built
        self._built = [MIN_WORDS] * MIN_COLUMNS  # the rows it was built at
        self._free = list(range(MIN_COLUMNS - 1, -1, -1))
        self._rebuilds: dict[int, _Rebuild] = {}

    @property
    def words(self) -> int:
        """Rows of the table: words in each column."""
        return int(self._table.shape[0])

    @property
    def nbytes(self) -> int:
        """What the filter holds in memory."""
        scratch = sum(r.scratch.nbytes + r.todo.nbytes for r in self._rebuilds.values())
        return int(self._table.nbytes) + scratch

    # --- columns ----------------------------------------------------------------------

    def open(self) -> int:
        """A new, empty column."""
        if not self._free:  # twice the columns
            columns = len(self._load)
            self._table = np.hstack((self._table, np.zeros_like(self._table)))
            self._load += [0] * columns
            self._built += [self.words] * columns
            self._free = list(range(2 * columns - 1, columns - 1, -1))
        column = self._free.pop()
        self.clear(column)
        return column

    def close(self, column: int) -> None:
        """``column`` is no one's any more: empty it for the next."""
        self.clear(column)
        self._free.append(column)
        self._resize(shrink=True)

    def clear(self, column: int) -> None:
        """Empty ``column`` (its peer claims nothing now)."""
        self._rebuilds.pop(column, None)
        self._table[:, column] = 0
        self._set_load(column, 0)
        self._built[column] = self.words

    def load(self, column: int) -> int:
        """Keys added to ``column`` since it was last built (live and stale)."""
        return self._load[column]

    # --- writing ----------------------------------------------------------------------

    def locate(self, fps: FpArray, words: int | None = None) -> tuple[Rows, FpArray]:
        """Each fingerprint's row and pattern, in a table of ``words`` rows (this one's)."""
        mixed = np.multiply(fps, _MIX)
        rows = np.right_shift(mixed, _ROW_SHIFT).view(np.intp)  # < 2**24: a view is exact
        rows &= (words or self.words) - 1
        low = np.right_shift(mixed, np.uint64(32))
        low ^= mixed
        fields = np.right_shift(low[:, None], _FIELDS)
        fields &= np.uint64(_FIELD)
        pairs = _PAIRS.take(fields.view(np.int64))
        patterns = pairs[:, 0] | pairs[:, 1]
        patterns |= pairs[:, 2]
        return rows, patterns

    def add(self, column: int, fps: FpArray) -> None:
        """``column``'s peer claims ``fps`` now."""
        if not len(fps):
            return
        self._set_load(column, self._load[column] + len(fps))  # grows the table first
        self.fill(self._table[:, column], fps)
        rebuild = self._rebuilds.get(column)
        if rebuild is not None:
            self.fill(rebuild.scratch, fps)  # at its own size: the table may have grown since
            rebuild.added += len(fps)

    def scratch(self) -> FpArray:
        """An empty column to fill apart (a snapshot being assembled), then :meth:`install`."""
        return np.zeros(self.words, np.uint64)

    def fill(self, scratch: FpArray, fps: FpArray) -> None:
        """Put ``fps`` in a column made by :meth:`scratch` (or a view of one of the table's)."""
        if len(fps):
            rows, patterns = self.locate(fps, len(scratch))
            np.bitwise_or.at(scratch, rows, patterns)

    def install(self, column: int, scratch: FpArray, load: int) -> None:
        """``column`` becomes ``scratch``, filled with ``load`` keys.

        A scratch made at another size (the table grew or shrank while it was
        filled) is fitted to the table's, and its column is then due for a
        rebuild at the table's own size.
        """
        self._rebuilds.pop(column, None)
        self._set_load(column, load)
        self._table[:, column] = _fit(scratch, self.words)
        self._built[column] = min(len(scratch), self.words)

    def due(self, column: int, live: int) -> bool:
        """Whether ``column`` should be rebuilt: stale claims or a table grown since."""
        if column in self._rebuilds:
            return True
        return self._load[column] > 2 * live + STALE_SLACK or self._built[column] < self.words

    def rebuild(self, column: int, claims: Callable[[], FpArray], most: int) -> None:
        """Rebuild ``column`` from its peer's claims, ``most`` keys a call.

        The first call takes ``claims()``; later ones go on with them (adds
        meanwhile go to both the column and its rebuild), until the rebuilt
        column replaces the old one.
        """
        rebuild = self._rebuilds.get(column)
        if rebuild is None:
            rebuild = self._rebuilds[column] = _Rebuild(claims(), self.scratch())
        part = rebuild.todo[rebuild.at : rebuild.at + max(1, most)]
        self.fill(rebuild.scratch, part)
        rebuild.at += len(part)
        if rebuild.at >= len(rebuild.todo):
            self.install(column, rebuild.scratch, len(rebuild.todo) + rebuild.added)

    # --- reading ----------------------------------------------------------------------

    def holders(self, fp: int) -> list[int]:
        """The columns that may claim ``fp``. Safe from another thread."""
        # Python ints, not arrays: a third of the time for one key (engine threads ask it).
        table = self._table
        pairs = _PAIRS_INT
        mixed = (fp * _MIX_INT) & _MASK64
        low = mixed ^ (mixed >> 32)
        want = np.uint64(
            pairs[low & _FIELD] | pairs[(low >> 12) & _FIELD] | pairs[(low >> 24) & _FIELD]
        )
        row = table[(mixed >> 40) & (table.shape[0] - 1)]
        found: list[int] = np.flatnonzero((row & want) == want).tolist()
        return found

    def runs(self, fps: FpArray) -> tuple[Rows, Rows]:
        """The columns that may claim ``fps[0]``, and how many of ``fps`` in a row each may."""
        table = self._table
        rows, patterns = self.locate(fps, int(table.shape[0]))
        first = patterns[0]
        columns = np.flatnonzero((table[rows[0]] & first) == first)
        if not len(columns) or len(fps) == 1:
            return columns, np.ones(len(columns), np.intp)
        # Most runs end within a few keys (a shared prefix, then each its own):
        # the first few keys for every column, the rest for those still going.
        runs = np.full(len(columns), len(fps), np.intp)
        going = np.arange(len(columns))
        flat, width = table.reshape(-1), table.shape[1]
        start = 1
        for stop in (min(len(fps), _FIRST_STAGE + 1), len(fps)):
            if start >= stop or not len(going):
                break
            at = rows[start:stop, None] * width + columns[going][None, :]
            want = patterns[start:stop, None]
            missing = (flat[at] & want) != want
            ended = missing.any(axis=0)
            runs[going[ended]] = start + missing[:, ended].argmax(axis=0)
            going = going[~ended]
            start = stop
        return columns, runs

    # --- growing ----------------------------------------------------------------------

    def _set_load(self, column: int, load: int) -> None:
        self._load[column] = load
        self._resize()

    def _resize(self, *, shrink: bool = False) -> None:
        """Double the rows while the columns hold more than they may (``shrink``: halve them).

        With ``shrink``, the rows are halved while they hold under a quarter of it.
        """
        may = KEYS_PER_WORD * max(1, len(self._load) - len(self._free))  # keys a row may hold
        words = self.words
        total = sum(self._load)
        while not shrink and words < MAX_WORDS and total > may * words:
            words *= 2
        while shrink and words > MIN_WORDS and 4 * total < may * (words // 2):
            words //= 2
        if words != self.words:
            # A new table, never resized in place: a reader may hold the old one.
            self._table = _fit(self._table, words)
            self._built = [min(b, words) for b in self._built]


def _fit(rows: FpArray, words: int) -> FpArray:
    """``rows`` (a table's, or one column's) as ``words`` rows: a new array, or ``rows``.

    A key's row in a table twice the size is its row in the smaller one, or
    that plus the smaller size: repeating the rows keeps every key, and so
    does folding the halves together (OR).
    """
    n = len(rows)
    if n < words:
        return np.tile(rows, (words // n,) + (1,) * (rows.ndim - 1))
    if n > words:
        folded: FpArray = np.bitwise_or.reduce(rows.reshape(n // words, words, *rows.shape[1:]), 0)
        return folded
    return rows
