"""The live feed's publisher: events in, JSON messages out, never waiting on anyone.

A :class:`Feed` is the node's event watcher (:meth:`Feed.watch`, registered with
``Node.watch_events``). For each event it builds a :class:`FeedRecord` (encoded to
JSON lazily, once, by the first subscriber that sends it), keeps it in a bounded
history for snapshots, updates the counters, and offers it to every subscriber
whose filters accept it. Offering never blocks: each :class:`Subscriber` has a
bounded queue; when it is full the event is dropped and counted, and a ``gap``
message saying how many were lost takes the dropped events' place as soon as
there is room. A subscriber that stays behind for longer than
:attr:`FeedLimits.max_behind_s` is evicted (its connection is closed with code
1013) by :meth:`Feed.evict_laggards`, which the server calls periodically.

The message schema is ``docs/timeline.md``; :func:`event_message` builds an
event object and :func:`~p2pactor.core.fold.phase_after` (the core's phase rule,
re-exported here) says what phase each event leaves its actor in. Nothing here
touches a socket.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from p2pactor.core import checks
from p2pactor.core import events as ev
from p2pactor.core.fold import ActorState, Phase, initial_phase, is_terminal, phase_after
from p2pactor.core.ids import ActorId
from p2pactor.errors import P2PActorError
from p2pactor.surface.timeline.counters import Counters
from p2pactor.surface.timeline.filters import BadFilter, FeedFilters
from p2pactor.surface.timeline.messages import (
    FEED_VERSION,
    FeedRecord,
    encode,
    event_data,
    event_message,
    gap_message,
    peers_message,
)

__all__ = [
    "FEED_VERSION",
    "BadFilter",
    "Counters",
    "Feed",
    "FeedFilters",
    "FeedFull",
    "FeedLimits",
    "FeedRecord",
    "FeedStats",
    "Phase",
    "Subscriber",
    "event_data",
    "event_message",
    "gap_message",
    "initial_phase",
    "peers_message",
    "phase_after",
]


class FeedFull(P2PActorError):
    """The feed already has as many subscribers as its limits allow."""


# Intervals and timeouts may be inf: never.
_positive = checks.positive(finite=False)


@attrs.frozen(kw_only=True)
class FeedLimits:
    """The bounds that keep the feed from ever costing the node more than a little.

    Attributes:
        queue: Messages queued per subscriber; past it events are dropped and
            the subscriber later gets a ``gap``.
        max_behind_s: A subscriber that keeps dropping events (its queue never
            empties) for this long is closed with code 1013.
        close_timeout_s: How long closing an evicted or departing subscriber
            may take (its last message and the close frame) before its
            connection is simply cut.
        finished_events: Events of finished actors kept for snapshots.
        actor_events: Events kept per actor still in flight (its oldest go first).
        snapshot_events: The most events one snapshot holds (the newest).
        max_subscribers: Subscribers at once; more are refused (HTTP 503).
        status_interval_s: How often ``peers`` and ``counters`` go out.
        batch_interval_s: A subscriber that has caught up waits this long for
            events to gather before it is sent the next ones, together (unless
            its queue is half full).
    """

    queue: int = attrs.field(default=1000, validator=checks.positive_int)
    max_behind_s: float = attrs.field(default=10.0, validator=_positive)
    close_timeout_s: float = attrs.field(default=5.0, validator=_positive)
    finished_events: int = attrs.field(default=2000, validator=checks.positive_int)
    actor_events: int = attrs.field(default=1000, validator=checks.positive_int)
    snapshot_events: int = attrs.field(default=10_000, validator=checks.positive_int)
    max_subscribers: int = attrs.field(default=64, validator=checks.positive_int)
    status_interval_s: float = attrs.field(default=1.0, validator=_positive)
    batch_interval_s: float = attrs.field(default=0.05, validator=_positive)


# --- subscribers --------------------------------------------------------------------

_Item = FeedRecord | str  # an event, or a message already encoded (gap, peers, counters)


class Subscriber:
    """One subscriber's bounded queue, its filters and its snapshot.

    The feed offers events with :meth:`offer`, which never blocks; the
    subscriber's connection takes messages with :meth:`next_message`.

    Attributes:
        filters: What it wants to see.
        snapshot: The history it gets first, oldest first (emptied once sent).
        truncated: How many older events the snapshot leaves out.
        dropped: Events dropped for it so far, all gaps together.
        scope: The cancel scope its connection runs in; eviction gives it a
            deadline, so a connection that can't even be closed is cut.
    """

    def __init__(
        self, filters: FeedFilters, queue: int, snapshot: list[FeedRecord], truncated: int
    ) -> None:
        self.filters = filters
        self.snapshot = snapshot
        self.truncated = truncated
        self.dropped = 0
        self.scope = trio.CancelScope()
        self._evicted = False
        self._missed = 0
        self._behind_since: float | None = None
        self._send, self._receive = trio.open_memory_channel[_Item](queue)
        # Known full since the last put failed and nothing was taken since: a
        # stalled subscriber then costs a flag test per event, not an exception.
        self._full = False

    @property
    def evicted(self) -> bool:
        """Whether the feed gave up on it (it stayed behind too long)."""
        return self._evicted

    def evict(self, deadline: float) -> None:
        """Stop sending it events; its connection must be closed by ``deadline``."""
        self._evicted = True
        self.scope.deadline = deadline
        self.close()

    @property
    def behind_since(self) -> float | None:
        """When it started dropping events without catching up since, or None."""
        return self._behind_since

    def offer(self, record: FeedRecord) -> None:
        """Queue ``record`` if there is room, else drop and count it. Never blocks."""
        if self._missed and not self._full and self._put(gap_message(self._missed)):
            self._missed = 0
        # While a gap is still owed, later events must not overtake it.
        if not self._missed and self._put(record):
            return
        self._missed += 1
        self.dropped += 1
        if self._behind_since is None:
            self._behind_since = trio.current_time()

    def offer_status(self, text: str) -> None:
        """Queue a ``peers`` or ``counters`` message if there is room; else skip it.

        The next one replaces it a second later, so it is not counted as missed.
        """
        self._put(text)

    def _put(self, item: _Item) -> bool:
        if self._full:
            return False
        try:
            self._send.send_nowait(item)
        except trio.WouldBlock:
            self._full = True
            return False
        except trio.ClosedResourceError:
            return False
        return True

    async def next_message(self) -> str | None:
        """The next message to send, waiting for one; None once the feed is done with us.

        Finding the queue empty means the subscriber has caught up: the gap
        still owed (events dropped after everything queued) goes out then.
        """
        try:
            item = self._receive.receive_nowait()
            self._full = False
        except trio.WouldBlock:
            self._behind_since = None
            if self._missed:
                missed, self._missed = self._missed, 0
                return gap_message(missed)
            try:
                item = await self._receive.receive()
                self._full = False
            except trio.EndOfChannel:
                return None
        except trio.EndOfChannel:
            return None
        if self.evicted:  # what is still queued is not worth the wait
            return None
        return item if isinstance(item, str) else item.text()

    async def next_batch(self) -> list[str] | None:
        """Every message queued now (at least one, waiting for it), oldest first.

        None once the feed is done with us. A gap still owed ends the batch,
        as it would :meth:`next_message`.
        """
        first = await self.next_message()
        if first is None:
            return None
        batch = [first]
        while True:
            try:
                item = self._receive.receive_nowait()
                self._full = False
            except trio.WouldBlock:
                # Not caught up yet: that is when the batch has gone out and
                # the next call finds the queue still empty (next_message).
                if self._missed:
                    batch.append(gap_message(self._missed))
                    self._missed = 0
                return batch
            except trio.EndOfChannel:
                return batch
            if self.evicted:
                return None
            batch.append(item if isinstance(item, str) else item.text())

    def close(self) -> None:
        """No more messages: :meth:`next_message` returns what is queued, then None."""
        self._send.close()


@attrs.frozen(kw_only=True)
class FeedStats:
    """What a feed has done so far.

    Attributes:
        events: Events published.
        subscribers: Subscribers now.
        dropped: Events dropped for slow subscribers, over all of them.
        evicted: Subscribers closed for staying behind.
    """

    events: int
    subscribers: int
    dropped: int
    evicted: int


class Feed:
    """The publisher of one node's events. See the module docs.

    Args:
        node: The node's id, stamped on every message.
        block_len: The node's block size, for the byte counters.
        limits: Queue, history and eviction bounds.
    """

    def __init__(self, node: str, *, block_len: int, limits: FeedLimits | None = None) -> None:
        self.node = node
        self.limits = limits or FeedLimits()
        self.counters = Counters(block_len)
        self._order = itertools.count()
        self._in_flight: dict[ActorId, deque[FeedRecord]] = {}
        self._finished: deque[FeedRecord] = deque(maxlen=self.limits.finished_events)
        self._truncated = 0
        self._subscribers: list[Subscriber] = []
        self._events = 0
        self._dropped_gone = 0  # dropped for subscribers that left, for the stats
        self._evicted = 0

    # --- publishing (the node's thread, inside an actor's step) -------------------

    def watch(self, events: Sequence[ev.AnyEvent], state: ActorState) -> None:
        """The ``Node.watch_events`` watcher: record, count and offer one step's events."""
        if not events:
            return
        actor = events[0].actor
        history = self._in_flight.get(actor)
        if history is None:
            history = self._in_flight[actor] = deque(maxlen=self.limits.actor_events)
            phase = initial_phase(actor)
        else:
            phase = history[-1].phase
        last = len(events) - 1
        subscribers = self._subscribers
        for i, event in enumerate(events):
            # The state is the truth after the step; the rule fills in the steps between.
            phase = state.phase if i == last else phase_after(phase, event)
            record = FeedRecord(next(self._order), self.node, event, phase)
            if len(history) == history.maxlen:
                self._truncated += 1
            history.append(record)
            self.counters.count(event)
            for subscriber in subscribers:
                if subscriber.filters.accepts(event):
                    subscriber.offer(record)
        self._events += len(events)
        if is_terminal(state):
            del self._in_flight[actor]
            finished = self._finished
            self._truncated += max(0, len(finished) + len(history) - self.limits.finished_events)
            finished.extend(history)

    def broadcast(self, message: dict[str, Any]) -> None:
        """Offer an unfiltered status message (``peers``, ``counters``) to everyone."""
        if not self._subscribers:
            return
        text = encode(message)
        for subscriber in self._subscribers:
            subscriber.offer_status(text)

    # --- subscribers ------------------------------------------------------------------

    def subscribe(self, filters: FeedFilters) -> Subscriber:
        """Add a subscriber; its snapshot and its first live event meet exactly.

        Synchronous on purpose: no event can slip between the snapshot and the
        queue, nor appear in both.

        Raises:
            FeedFull: There are already ``max_subscribers``.
        """
        if len(self._subscribers) >= self.limits.max_subscribers:
            raise FeedFull(
                f"the feed of {self.node} already has {len(self._subscribers)} subscribers "
                "(its limit); close a dashboard tab and retry"
            )
        records = [*self._finished]
        for history in self._in_flight.values():
            records.extend(history)
        records.sort(key=lambda r: r.order)
        truncated = self._truncated
        matching = [r for r in records if filters.accepts(r.event)]
        excess = len(matching) - self.limits.snapshot_events
        if excess > 0:
            truncated += excess
            matching = matching[excess:]
        subscriber = Subscriber(filters, self.limits.queue, matching, truncated)
        self._subscribers.append(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        """Remove a subscriber (idempotent); its connection sends nothing more."""
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)
            self._dropped_gone += subscriber.dropped
        subscriber.close()

    def evict_laggards(self, now: float) -> list[Subscriber]:
        """Evict every subscriber behind for more than ``max_behind_s``; return them."""
        limit = self.limits.max_behind_s
        evicted = []
        for subscriber in list(self._subscribers):
            since = subscriber.behind_since
            if since is not None and now - since > limit:
                subscriber.evict(now + self.limits.close_timeout_s)
                self.unsubscribe(subscriber)
                self._evicted += 1
                evicted.append(subscriber)
        return evicted

    def stats(self) -> FeedStats:
        """The feed's counts now."""
        return FeedStats(
            events=self._events,
            subscribers=len(self._subscribers),
            dropped=self._dropped_gone + sum(s.dropped for s in self._subscribers),
            evicted=self._evicted,
        )
