"""Fingerprints as arrays: taken from the wire, sorted, and merged a slice at a time.

The source index computes with 64-bit fingerprints packed in ``uint64``
arrays, never one Python int at a time. They come as a summary carries them
(8 bytes each, big-endian) or, from tests and embedders, as ints; a slice of
them is converted when it is worked on, so a message is never converted
whole. A peer's claims are a sorted array of distinct fingerprints, and a
snapshot's parts are merged into one by :class:`MergeRuns`, whose every step
is bounded: no call holds the node's thread in proportion to a whole summary.
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
