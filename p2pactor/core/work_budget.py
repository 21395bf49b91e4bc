"""How much of the node's thread one peer's summaries may take: a token bucket in fingerprints.

Applying a peer's summary messages costs the node's thread about a quarter of
a microsecond a fingerprint. A peer that sends them as fast as it can would
keep the thread busy with its work alone, and every other peer's lookups
would wait their turn behind it. :class:`WorkBudget` gives each peer a rate of
fingerprints a second (and a burst of a tenth of a second's worth); past it,
its messages wait, and once what waits passes the node's budget for it they
are dropped as a flood. An honest peer's deltas (at most tens of thousands of
changes a second) and snapshots (a million keys in a few seconds) stay far
within it.

Pure: time is an argument.
"""

from __future__ import annotations

import math

# Seconds of the rate a peer may spend at once, after a quiet spell.
BURST_S = 0.1


class WorkBudget:
    """Fingerprints of work a peer may still have done now, refilled at ``rate`` a second.

    Args:
        rate: Fingerprints a second (``None``: no limit).
        now: The time it starts, full.
    """

    __slots__ = ("_at", "_most", "_rate", "_tokens")

    def __init__(self, rate: float | None, now: float = 0.0) -> None:
        self._rate = math.inf if rate is None else rate
        self._most = self._tokens = max(1.0, self._rate * BURST_S)
        self._at = now

    def ready(self, now: float | None) -> bool:
        """Whether the peer may have work done at ``now`` (always, with no rate or no time)."""
        return now is None or self.ready_at(now) <= now

    def spend(self, fingerprints: int, now: float | None) -> None:
        """``fingerprints`` of work were done for the peer at ``now``."""
        if now is not None:
            self.ready_at(now)
            self._tokens -= fingerprints

    def ready_at(self, now: float) -> float:
        """When the peer may next have work done (``now`` if it may already)."""
        if now > self._at:  # refilled first
            self._tokens = min(self._most, self._tokens + self._rate * (now - self._at))
            self._at = now
        return now if self._tokens > 0 else now + (1.0 - self._tokens) / self._rate
