"""Seed peers are dialed again when their session ends, so the fleet's membership heals.

A node opens a session with each of its seed peers at start
(``NodeConfig.seed_peers``); a request naming no source can only find blocks
at a peer it has a session with. When such a session ends (the peer
restarted, the link was cut, an idle timeout), :class:`SeedRedial` dials the
peer again after a back-off that doubles per failed attempt, from
``first_s`` up to ``max_s``, and starts over once a handshake with it
succeeds. Peers that are not seeds are not redialed: they dial us, or a
request names them. Timed on the node's :class:`~p2pactor.runtime.timers.Timers`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import attrs

from p2pactor.runtime.timers import Timers


@attrs.define(eq=False)
class SeedRedial:
    """When to dial each seed peer whose session ended, and the back-off of each.

    Args:
        seeds: The seed peers.
        dial: Opens the session with a peer (the node's host does).
        timers: The node's timer.
        clock: The node's clock.
        first_s: The first wait after a session ends.
        max_s: The longest wait between two attempts.
    """

    seeds: Collection[str]
    _dial: Callable[[str], None]
    _timers: Timers = attrs.field(kw_only=True)
    _clock: Callable[[], float] = attrs.field(kw_only=True)
    _first_s: float = attrs.field(default=1.0, kw_only=True)
    _max_s: float = attrs.field(default=60.0, kw_only=True)
    _due: dict[str, float] = attrs.field(factory=dict, init=False)
    # The next back-off of each peer that failed.
    _wait: dict[str, float] = attrs.field(factory=dict, init=False)

    @property
    def deadline(self) -> float | None:
        """When the next seed is dialed again (None: none is waiting)."""
        return min(self._due.values(), default=None)

    def lost(self, peer: str) -> None:
        """``peer``'s session ended with no other to replace it: dial it again later."""
        if peer not in self.seeds or peer in self._due:
            return
        wait = self._wait.get(peer, self._first_s)
        self._wait[peer] = min(self._max_s, wait * 2)
        self._due[peer] = self._clock() + wait
        self._timers.arm(self)

    def connected(self, peer: str) -> None:
        """A handshake with ``peer`` succeeded: its next loss waits ``first_s`` again."""
        self._wait.pop(peer, None)
        self._due.pop(peer, None)

    def stop(self) -> None:
        """The node is closing: dial nobody again."""
        self._due.clear()

    def expire(self) -> None:
        """Dial the seeds whose wait is over."""
        now = self._clock()
        for peer, when in list(self._due.items()):
            if when <= now:
                del self._due[peer]
                self._dial(peer)
        self._timers.arm(self)
