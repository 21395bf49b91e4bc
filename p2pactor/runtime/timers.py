"""One timer per node: a heap of deadlines and one task sleeping until the earliest.

Every actor with a deadline (a lookup's 30 s, a pending key's 5 s, a pin's
expiry) and every other thing of the node that must act at a time is a
:class:`Timed` item in one heap, so a step that changes its actor's deadline
costs a heap push, not a cancel scope per actor per step. How the task
sleeps and how stale entries go: ``docs/design.md``, "One timer per node".
"""

from __future__ import annotations

import heapq
import itertools
import math
from typing import Protocol

import trio

# Items expired before the timer task lets other tasks run (fairness).
_FIRED_PER_TURN = 256
_MIN_REBUILD = 1024


class Timed(Protocol):
    """Something that must act at its deadline."""

    @property
    def deadline(self) -> float | None:
        """When to call :meth:`expire` (trio's clock), or None: never."""
        ...

    def expire(self) -> None:
        """The deadline passed. Must not block."""


class Timers:
    """The node's timer. Run :meth:`run` in the node's nursery; :meth:`arm` from its thread."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timed]] = []
        self._serials = itertools.count()
        self._scope: trio.CancelScope | None = None
        self.fired = 0

    def __len__(self) -> int:
        return len(self._heap)

    def arm(self, item: Timed) -> None:
        """Expire ``item`` at its current deadline (a no-op when it has none)."""
        when = item.deadline
        if when is None:
            return
        heapq.heappush(self._heap, (when, next(self._serials), item))
        scope = self._scope
        if scope is not None and when < scope.deadline:
            scope.deadline = when
        if len(self._heap) > 4 * _MIN_REBUILD and len(self._heap) % _MIN_REBUILD == 0:
            self._compact()

    async def run(self) -> None:
        """Expire items as their deadlines pass, forever."""
        heap = self._heap
        while True:
            now = trio.current_time()
            fired = 0
            while heap and heap[0][0] <= now and fired < _FIRED_PER_TURN:
                when, _, item = heapq.heappop(heap)
                if item.deadline != when:
                    continue  # stale: the item moved on (or was disarmed)
                fired += 1
                self.fired += 1
                item.expire()
            if fired >= _FIRED_PER_TURN:
                await trio.lowlevel.checkpoint()
                continue
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._scope = scope
                try:
                    await trio.sleep_forever()
                finally:
                    self._scope = None

    def _compact(self) -> None:
        """Drop stale entries once they are most of the heap (bounded memory)."""
        live = [entry for entry in self._heap if entry[2].deadline == entry[0]]
        if len(live) * 2 < len(self._heap):
            heapq.heapify(live)
            self._heap[:] = live
