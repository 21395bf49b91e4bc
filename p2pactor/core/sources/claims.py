"""One peer's claims, exactly: 64-bit fingerprints packed in sorted arrays.

The source index keeps, for each peer, the fingerprints its summary claims.
As Python sets they cost about 300 bytes a claim, and a fleet of them made
the garbage collector's full passes stall the node thread (issue 30).
:class:`ClaimSet` keeps them in two sorted ``uint64`` arrays: the main one
with a live mask (9 bytes a claim), and the few claimed since its last
compaction, each array a handful of Python objects whatever its length. A
delta's adds and removes cost work in proportion to the delta and to the
small array; the main one is rebuilt (a merge, never a sort, and a slice at
a time: :class:`Compaction`) once the changes since reach a sixteenth of it.

Read from other threads (the engine's lookups) while the node thread
changes it: an array is never resized in place (a change makes a new one),
a reader takes the main array and its mask as one tuple, and a compaction
publishes the new main array before it empties the small one.

"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from p2pactor.core.sources.arrays import EMPTY, FpArray, MergeRuns, unique

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
