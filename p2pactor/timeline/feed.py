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

import enum
import itertools
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Final
from urllib.parse import parse_qs

import attrs
import msgspec
import trio

from p2pactor.core import checks
from p2pactor.core import events as ev
from p2pactor.core.consumer import ConsumerState
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.fold import ActorState, Phase, initial_phase, is_terminal, phase_after
from p2pactor.core.ids import ActorId
from p2pactor.core.producer import ProducerState
from p2pactor.errors import P2PActorError
from p2pactor.replay import describe

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

FEED_VERSION: Final = 1
"""The ``version`` in every ``hello``: the schema of ``docs/timeline.md``."""

_ENCODER: Final = msgspec.json.Encoder()
# A lookup over a quota is still a lookup received (as replay's summary counts it).
_LOOKUPS_RECEIVED: Final = frozenset({"LookupReceived", "LookupLimited", "LookupRefused"})
# Fields every event has; they are the event object's own keys, not its data.
_HEAD_FIELDS: Final = frozenset({"actor", "seq", "at"})
_DATA_FIELDS: Final[dict[type[ev.Event], tuple[str, ...]]] = {
    cls: tuple(f.name for f in attrs.fields(cls) if f.name not in _HEAD_FIELDS)
    for cls in ev.EVENT_TYPES.values()
}


class BadFilter(P2PActorError, ValueError):
    """A subscriber asked for a filter the feed cannot apply (an unknown event kind)."""


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


# --- the event object ---------------------------------------------------------------


def _data_value(name: str, value: Any) -> Any:
    if isinstance(value, tuple):
        if name == "job_ids":
            return sorted(set(value))  # parallel to the keys: the distinct jobs say it all
        if value and isinstance(value[0], bool):
            return sum(value)  # hits as flags: how many hit
        return len(value)  # keys, hits or misses as keys, block lists
    if isinstance(value, enum.Enum):
        return value.value
    return value


def event_data(event: ev.AnyEvent) -> dict[str, Any]:
    """The event's own fields, JSON-friendly: lists become counts, enums their values."""
    return {name: _data_value(name, getattr(event, name)) for name in _DATA_FIELDS[type(event)]}


def event_message(node: str, event: ev.AnyEvent, phase: Phase) -> dict[str, Any]:
    """The ``event`` message of ``docs/timeline.md`` for one event of ``node``."""
    actor = event.actor
    return {
        "type": "event",
        "node": node,
        "actor": str(actor),
        "role": actor.role.value,
        "peer": actor.peer,
        "request": actor.kv_request_id,
        "incarnation": actor.incarnation,
        "seq": event.seq,
        "at": event.at,
        "kind": event.KIND,
        "phase": phase.value,
        "detail": describe(event),
        "data": event_data(event),
    }


def gap_message(missed: int) -> str:
    """The ``gap`` message: ``missed`` events were dropped here."""
    return f'{{"type":"gap","missed":{missed}}}'


def encode(message: dict[str, Any]) -> str:
    """One message as JSON text (websocket text frames carry the feed)."""
    return _ENCODER.encode(message).decode()


class FeedRecord:
    """One event as the feed keeps it: encoded once, when first sent.

    Attributes:
        order: Position among every event this feed has seen.
        node: The node whose event it is.
        event: The event.
        phase: Its actor's phase after it.
    """

    __slots__ = ("_text", "event", "node", "order", "phase")

    def __init__(self, order: int, node: str, event: ev.AnyEvent, phase: Phase) -> None:
        self.order = order
        self.node = node
        self.event = event
        self.phase = phase
        self._text: str | None = None

    def message(self) -> dict[str, Any]:
        """The event message, as a dict."""
        return event_message(self.node, self.event, self.phase)

    def text(self) -> str:
        """The event message, as JSON; computed once and shared by every subscriber."""
        if self._text is None:
            self._text = encode(self.message())
        return self._text


# --- filters ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class FeedFilters:
    """What a subscriber wants to see; None lets everything through.

    Attributes:
        peer: Only actors whose peer is this ``host:port``.
        request: Only actors of this kv_request_id.
        kinds: Only events of these kinds (``LookupResp``, ``FetchSent``...).
    """

    peer: str | None = None
    request: str | None = None
    kinds: frozenset[str] | None = None

    @classmethod
    def from_query(cls, query: str) -> FeedFilters:
        """Parse ``peer=...&request=...&kinds=A,B`` (each optional, empty means none).

        Raises:
            BadFilter: ``kinds`` names an event kind that does not exist.
        """
        fields = parse_qs(query, keep_blank_values=False)

        def last(name: str) -> str | None:
            values = fields.get(name)
            return values[-1] if values else None

        kinds: frozenset[str] | None = None
        raw_kinds = [k.strip() for v in fields.get("kinds", ()) for k in v.split(",")]
        if any(raw_kinds):
            kinds = frozenset(k for k in raw_kinds if k)
            unknown = sorted(kinds - ev.EVENT_TYPES.keys())
            if unknown:
                raise BadFilter(
                    f"unknown event kinds {', '.join(unknown)}; "
                    f"known kinds: {', '.join(sorted(ev.EVENT_TYPES))}"
                )
        return cls(peer=last("peer"), request=last("request"), kinds=kinds)

    def accepts(self, event: ev.AnyEvent) -> bool:
        """Whether ``event`` passes every filter."""
        actor = event.actor
        if self.peer is not None and actor.peer != self.peer:
            return False
        if self.request is not None and actor.kv_request_id != self.request:
            return False
        return self.kinds is None or event.KIND in self.kinds

    def as_json(self) -> dict[str, Any]:
        """The filters as ``hello`` reports them."""
        kinds = None if self.kinds is None else sorted(self.kinds)
        return {"peer": self.peer, "request": self.request, "kinds": kinds}


# --- counters -----------------------------------------------------------------------


@attrs.define
class _Open:
    """What the counters remember about one actor until it ends."""

    pending: dict[int, set[bytes]] = attrs.field(factory=dict)  # lookup -> keys pending
    loads: dict[int, int] = attrs.field(factory=dict)  # round -> blocks fetched
    writes: dict[int, int] = attrs.field(factory=dict)  # transfer -> blocks written


@attrs.define
class Counters:
    """Running totals over the events the feed has seen (the ``counters`` message).

    Consumer side (our requests): ``lookups`` sent, keys the peers answered
    ``keys_hit``/``keys_missed``, ``fetches`` sent, ``bytes`` loaded by fetches
    that succeeded. Producer side (what we serve): ``pending`` keys that were
    still being written at a lookup and resolved later, ``expired`` pending keys
    that ran out of time, ``lookups_received``, ``fetches_received``,
    ``bytes_served``. ``failures``: our requests that finished failed or
    aborted, plus writes of ours that failed.
    """

    block_len: int
    lookups: int = 0
    keys_hit: int = 0
    keys_missed: int = 0
    pending: int = 0
    expired: int = 0
    fetches: int = 0
    bytes: int = 0
    failures: int = 0
    lookups_received: int = 0
    fetches_received: int = 0
    bytes_served: int = 0
    _open: dict[ActorId, _Open] = attrs.field(factory=dict, repr=False)

    def count(self, event: ev.AnyEvent) -> None:
        """Account for one event."""
        if event.KIND in _LOOKUPS_RECEIVED:
            self.lookups_received += 1
        match event:
            case ev.Probed():
                self.lookups += 1
            case ev.LookupResp():
                hits = sum(event.hits)
                self.keys_hit += hits
                self.keys_missed += len(event.hits) - hits
            case ev.FetchSent():
                self.fetches += 1
                self._actor(event.actor).loads[event.round_seq] = len(event.keys)
            case ev.TransferDone():
                blocks = self._actor(event.actor).loads.pop(event.round_seq, 0)
                if event.success:
                    self.bytes += blocks * self.block_len
            case ev.AbortAcked() | ev.Aborted():
                self._actor(event.actor).loads.pop(event.round_seq, None)
            case ev.Finished():
                if event.phase is not ConsumerPhase.DONE:
                    self.failures += 1
                self._open.pop(event.actor, None)
            case ev.KeysResolved():
                self._resolved(event)
            case ev.PendingExpired():
                self.expired += len(event.keys)
                waiting = self._actor(event.actor).pending.get(event.lookup_id)
                if waiting is not None:
                    waiting.difference_update(event.keys)
            case ev.LookupAnswered() | ev.LookupDropped():
                self._actor(event.actor).pending.pop(event.lookup_id, None)
            case ev.FetchReceived():
                self.fetches_received += 1
            case ev.TransferStarted():
                self._actor(event.actor).writes[event.transfer_id] = len(event.keys)
            case ev.TransferCompleted():
                blocks = self._actor(event.actor).writes.pop(event.transfer_id, 0)
                self.bytes_served += blocks * self.block_len
            case ev.TransferFailed():
                self.failures += 1
                self._actor(event.actor).writes.pop(event.transfer_id, None)
            case ev.Closed():
                self._open.pop(event.actor, None)
            case _:
                pass

    def _actor(self, actor: ActorId) -> _Open:
        found = self._open.get(actor)
        if found is None:
            found = self._open[actor] = _Open()
        return found

    def _resolved(self, event: ev.KeysResolved) -> None:
        pending = self._actor(event.actor).pending
        waiting = pending.get(event.lookup_id)
        if waiting:
            before = len(waiting)
            waiting.difference_update(event.hits)
            waiting.difference_update(event.misses)
            self.pending += before - len(waiting)
        if event.pending:
            pending.setdefault(event.lookup_id, set()).update(event.pending)

    def message(self, node: str) -> dict[str, Any]:
        """The ``counters`` message."""
        return {
            "type": "counters",
            "node": node,
            "lookups": self.lookups,
            "keys_hit": self.keys_hit,
            "keys_missed": self.keys_missed,
            "pending": self.pending,
            "expired": self.expired,
            "fetches": self.fetches,
            "bytes": self.bytes,
            "failures": self.failures,
            "lookups_received": self.lookups_received,
            "fetches_received": self.fetches_received,
            "bytes_served": self.bytes_served,
        }


# --- peers --------------------------------------------------------------------------


def _transfers(states: Iterable[ActorState]) -> int:
    count = 0
    for state in states:
        if isinstance(state, ConsumerState):
            count += 0 if state.phase.terminal else len(state.loads)
        elif isinstance(state, ProducerState):
            count += len(state.transfers)
    return count


def peers_message(node: str, sessions: Sequence[Any]) -> dict[str, Any]:
    """The ``peers`` message: one entry per live session of the node.

    Args:
        node: The node's id.
        sessions: Its :class:`p2pactor.session.PeerSession` objects.
    """
    return {
        "type": "peers",
        "node": node,
        "peers": [
            {
                "peer": s.peer_id,
                "state": s.state.value,
                "ready": s.ready,
                "dialect": "p2pactor" if s.extended else "vllm",
                "transfers": _transfers(a.state for a in s.live_actors()),
                "last_activity": s.last_activity,
            }
            for s in sessions
        ],
    }


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
