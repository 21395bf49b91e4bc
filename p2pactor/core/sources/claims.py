"""Fingerprint arrays, and one peer's claims kept exactly in them.

The source index computes with 64-bit fingerprints packed in sorted ``uint64``
arrays, never one Python int at a time. They come as a summary carries them
(8 bytes each, big-endian) or as ints; a slice is converted when it is worked
on, never a whole message. :class:`ClaimSet` holds a peer's claims (a main
array with a live mask, and the few claimed since its last compaction);
:class:`MergeRuns` merges sorted runs, every step bounded. Why arrays, and
what they cost: ``docs/sources.md``, "The index".

Read from other threads (the engine's lookups) while the node thread
changes it: an array is never resized in place (a change makes a new one),
a reader takes the main array and its mask as one tuple, and a compaction
publishes the new main array before it empties the small one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

# Fingerprints as the index computes with them.
FpArray = npt.NDArray[np.uint64]
# Fingerprints as they wait: a packed field's view (8 bytes each, big-endian), or an array.
Raw = npt.NDArray[Any]
# Fingerprints as they come: a summary's packed field or ints.
Fingerprints = bytes | bytearray | memoryview | Sequence[int] | Raw

EMPTY: FpArray = np.zeros(0, np.uint64)
EMPTY.flags.writeable = False


def raw(fps: Fingerprints) -> Raw:
    """``fps`` as an array: a packed field's is a view of it, converted a slice at a time."""
    if isinstance(fps, bytes | bytearray | memoryview):
        return np.frombuffer(fps, ">u8")
    return fps if isinstance(fps, np.ndarray) else np.array(fps, np.uint64).reshape(-1)


def as_fps(fps: Fingerprints, most: int | None = None) -> FpArray:
    """The first ``most`` of ``fps`` (all by default) as ``uint64``; the rest is never converted."""
    return raw(fps)[:most].astype(np.uint64, copy=False)


def unique(fps: FpArray) -> FpArray:
    """``fps`` sorted, each once.

    ``np.unique`` does the same, 4 times slower on a slice of 2,048 (210 µs
    against 47 µs, numpy 2.4): it is not written for one sorted dtype.
    """
    ordered = np.sort(fps)
    return _distinct(ordered) if len(ordered) > 1 else ordered


def _distinct(ordered: FpArray, first: bool = True) -> FpArray:
    """``ordered`` (sorted, not empty) with each value once; its first one only if ``first``."""
    keep = np.empty(len(ordered), bool)
    keep[0] = first
    np.not_equal(ordered[1:], ordered[:-1], out=keep[1:])
    return ordered[keep]


class MergeRuns:
    """Sorted runs of distinct fingerprints merged into one, pairwise, a slice at a time.

    Runs are merged two by two in the order they come, each result going to
    the back (a tournament: every fingerprint is moved about log2(runs)
    times). Each :meth:`step` takes at most ``most`` from each run of the pair
    (those up to the smaller of the two values ``most`` ahead), so its work is
    bounded whatever the runs' sizes; a fingerprint in both is kept once.
    Args: ``runs``, each sorted and each value once within it.
    """

    __slots__ = ("_a", "_b", "_ia", "_ib", "_n", "_out", "_runs")

    def __init__(self, runs: Sequence[FpArray]) -> None:
        self._runs: deque[FpArray] = deque(r for r in runs if len(r))
        # The pair being merged, ``_a[:_ia]`` and ``_b[:_ib]`` into ``_out[:_n]`` (None: none).
        self._a = self._b = EMPTY
        self._ia = self._ib = self._n = 0
        self._out: FpArray | None = None

    @property
    def done(self) -> bool:
        """Whether one run is left (or none)."""
        return self._out is None and len(self._runs) <= 1

    @property
    def nbytes(self) -> int:
        """What the runs and the merge under way (its two runs and its output) hold."""
        held = sum(int(r.nbytes) for r in self._runs)
        out = self._out
        return held if out is None else held + int(self._a.nbytes + self._b.nbytes + out.nbytes)

    def step(self, most: int) -> int:
        """Merge the next slice; how much work it was (at least 1 while not done)."""
        out = self._out
        if out is None:
            if len(self._runs) <= 1:
                return 0
            self._a, self._b = self._runs.popleft(), self._runs.popleft()
            out = self._out = np.empty(len(self._a) + len(self._b), np.uint64)
            self._ia = self._ib = self._n = 0
        a, b, ia, ib = self._a, self._b, self._ia, self._ib
        most = max(1, most)
        ea, eb = min(ia + most, len(a)), min(ib + most, len(b))
        # Everything up to the lower of the two window ends is in the windows:
        # each side is sorted and each value is on it once.
        bounds = [int(x[e - 1]) for x, e in ((a, ea), (b, eb)) if e < len(x)]
        if bounds:
            upto = np.uint64(min(bounds))
            ea = ia + int(a[ia:ea].searchsorted(upto, "right"))
            eb = ib + int(b[ib:eb].searchsorted(upto, "right"))
        left, right = a[ia:ea], b[ib:eb]
        merged = np.insert(left, left.searchsorted(right), right)
        if len(merged):
            merged = _distinct(merged, self._n == 0 or out[self._n - 1] != merged[0])
            out[self._n : self._n + len(merged)] = merged
            self._n += len(merged)
        self._ia, self._ib = ea, eb
        if ea >= len(a) and eb >= len(b):
            self._runs.append(out[: self._n])
            self._out = None
            self._a = self._b = EMPTY
        return max(1, len(left) + len(right))

    def result(self) -> FpArray:
        """The one merged run (once :attr:`done`)."""
        return self._runs[0] if self._runs else EMPTY


# Changes since the last compaction below which a set is never compacted.
COMPACT_MIN = 1024

_Mask = npt.NDArray[np.bool_]


def _positions(keys: FpArray, fps: FpArray) -> tuple[npt.NDArray[np.intp], _Mask]:
    """Where each of ``fps`` is or would be in ``keys`` (not empty), and whether it is there."""
    at = keys.searchsorted(fps)
    np.minimum(at, len(keys) - 1, out=at)
    return at, keys[at] == fps


def _kill(keys: FpArray, live: _Mask, fps: FpArray) -> _Mask:
    """Mark those of ``fps`` live in ``keys`` dead: for each of ``fps``, whether it was."""
    if not (len(keys) and len(fps)):
        return np.zeros(len(fps), bool)
    at, found = _positions(keys, fps)
    found &= live[at]
    live[at[found]] = False
    return found


class ClaimSet:
    """The fingerprints one peer claims: a sorted array with a live mask, and the recent adds.

    Args:
        keys: The claims to start with, sorted and each once (:func:`unique`).
    """

    __slots__ = ("_compacting", "_dead", "_extra", "_sorted")

    def __init__(self, keys: FpArray | None = None) -> None:
        keys = EMPTY if keys is None else keys
        self._sorted = (keys, np.ones(len(keys), bool))
        # Claimed since the last compaction and not in ``keys``: sorted, each once.
        self._extra: FpArray = EMPTY
        self._dead = 0  # entries of ``keys`` no longer claimed
        self._compacting: Compaction | None = None

    def __len__(self) -> int:
        """How many fingerprints are claimed."""
        return len(self._sorted[0]) - self._dead + len(self._extra)

    @property
    def nbytes(self) -> int:
        """What the claims hold in memory."""
        keys, live = self._sorted
        return int(keys.nbytes + live.nbytes + self._extra.nbytes)

    def __contains__(self, fp: object) -> bool:
        """Whether ``fp`` (an int) is claimed. Safe from another thread."""
        if not isinstance(fp, int) or not 0 <= fp < 1 << 64:
            return False
        value = np.uint64(fp)
        extra = self._extra
        at = int(extra.searchsorted(value))
        if at < len(extra) and extra[at] == value:
            return True
        keys, live = self._sorted
        at = int(keys.searchsorted(value))
        return at < len(keys) and keys[at] == value and bool(live[at])

    def mask(self, fps: FpArray) -> _Mask:
        """For each of ``fps``, whether it is claimed."""
        return self._find(fps)[2]

    def _find(self, fps: FpArray) -> tuple[npt.NDArray[np.intp] | None, _Mask, _Mask]:
        """Each of ``fps``'s place in the main array (None: empty), if it is there, if claimed."""
        keys, live = self._sorted
        if len(keys):
            at, found = _positions(keys, fps)
            held = found & live[at]
        else:
            at, found = None, np.zeros(len(fps), bool)
            held = found.copy()
        extra = self._extra
        if len(extra):
            held |= _positions(extra, fps)[1]
        return at, found, held

    def array(self) -> FpArray:
        """Every claim, sorted (a new array)."""
        keys, live = self._sorted
        kept = keys[live] if self._dead else keys.copy()
        extra = self._extra
        return np.insert(kept, kept.searchsorted(extra), extra) if len(extra) else kept

    def superset(self) -> FpArray:
        """Every claim, and maybe some no longer claimed, in no order (no sort, no mask)."""
        keys, extra = self._sorted[0], self._extra
        return np.concatenate((keys, extra)) if len(extra) else keys

    def add(self, fps: FpArray, room: int) -> tuple[FpArray, int]:
        """Claim those of ``fps`` not claimed yet, at most ``room`` of them (the lowest).

        Returns the newly claimed, and how many more were refused for want of room.
        """
        fps = unique(fps)
        at, found, held = self._find(fps)
        fresh = ~held
        wanted = int(fresh.sum())
        refused = max(0, wanted - max(0, room))
        if refused:
            fresh[np.flatnonzero(fresh)[wanted - refused :]] = False
        if at is not None:
            revived = at[fresh & found]  # in the array but dead
            self._sorted[1][revived] = True
            self._dead -= len(revived)
        new = fps[fresh & ~found]
        extra = self._extra
        if len(new):
            self._extra = np.insert(extra, extra.searchsorted(new), new)
        self._compacting = None  # a compaction under way would miss them: it starts over
        return fps[fresh], refused

    def remove(self, fps: FpArray) -> int:
        """Claim none of ``fps`` any more: how many were claimed."""
        fps = unique(fps)
        found = _kill(*self._sorted, fps)
        gone = int(found.sum())
        self._dead += gone
        rest = fps[~found]
        extra = self._extra
        if len(extra) and len(rest):
            at, found = _positions(extra, rest)
            if found.any():
                self._extra = np.delete(extra, at[found])
                gone += int(found.sum())
        compacting = self._compacting
        if gone and compacting is not None:
            compacting.removed.append(fps)  # its result must lose them too
        return gone

    def truncate(self, most: int) -> None:
        """Keep ``most`` claims (the lowest fingerprints): the peer may claim no more."""
        if len(self) > most:
            self._compacting = None
            kept = self.array()[: max(0, most)]
            self._publish(kept, np.ones(len(kept), bool), 0)

    @property
    def compact_due(self) -> bool:
        """Whether the changes since the last compaction are enough to compact."""
        due = max(COMPACT_MIN, len(self._sorted[0]) >> 4)
        return len(self._extra) > due or self._dead > 4 * due

    @property
    def compacting(self) -> bool:
        """Whether a compaction is under way (removals meanwhile are kept for it)."""
        return self._compacting is not None

    def cancel_compaction(self) -> None:
        """Give up the compaction under way, if any (its steps will not be run)."""
        self._compacting = None

    def _publish(self, keys: FpArray, live: _Mask, dead: int) -> None:
        # The main array first, the small one after: a reader on another
        # thread that takes the emptied small array finds the new main one.
        self._sorted = (keys, live)
        self._extra = EMPTY
        self._dead = dead


class Compaction:
    """A :class:`ClaimSet`'s main array rebuilt with its recent adds, a slice at a time.

    Until it is done the set reads as before; removals meanwhile are kept
    and applied to the new array before it is published, and an add (or a
    truncation) meanwhile cancels it (the next one starts over).

    Attributes:
        work: Fingerprints its last step went over (masked, or merged).
    """

    __slots__ = ("_claims", "_merge", "removed", "work")

    def __init__(self, claims: ClaimSet) -> None:
        self._claims = claims
        self._merge: MergeRuns | None = None  # made by the first step: the mask is O(claims)
        self.removed: list[FpArray] = []
        self.work = 0
        claims._compacting = self

    def step(self, most: int) -> bool:
        """Merge the next ``most`` or so; whether it is over (done, or cancelled)."""
        claims = self._claims
        self.work = 0
        if claims._compacting is not self:
            return True  # its set changed in a way it cannot follow
        merge = self._merge
        if merge is None:
            keys, live = claims._sorted
            kept = keys[live] if claims._dead else keys
            merge = self._merge = MergeRuns((kept, claims._extra))
            self.work = len(keys)
            return False
        self.work = merge.step(most)
        if not merge.done:
            return False
        claims._compacting = None
        keys = merge.result()
        live = np.ones(len(keys), bool)
        dead = sum(int(_kill(keys, live, fps).sum()) for fps in self.removed)
        claims._publish(keys, live, dead)
        return True
