"""Live request timelines: the event feed, the dashboard page's server, replay serving.

A node started with ``NodeConfig(dashboard_port=...)`` (or wrapped in
:func:`open_timeline_server`) serves, on one port, the dashboard page at
``http://HOST:PORT/`` and its websocket feed at ``ws://HOST:PORT/events``;
:func:`open_replay_server` serves recorded event logs to the same page. The
messages are specified in ``docs/timeline.md``.

* :mod:`p2pactor.surface.timeline.feed`: the publisher (history, bounded
  per-subscriber queues, eviction);
* :mod:`p2pactor.surface.timeline.messages`: the messages, built and encoded;
* :mod:`p2pactor.surface.timeline.filters`: what a subscriber asks to see;
* :mod:`p2pactor.surface.timeline.counters`: the ``counters`` totals;
* :mod:`p2pactor.surface.timeline.http`: request heads, the page's files, access checks;
* :mod:`p2pactor.surface.timeline.site`: one connection (routing, websocket, sending);
* :mod:`p2pactor.surface.timeline.server`: the live and replay servers.
"""

from __future__ import annotations

from p2pactor.surface.timeline.feed import (
    FEED_VERSION,
    BadFilter,
    Counters,
    Feed,
    FeedFilters,
    FeedFull,
    FeedLimits,
    FeedRecord,
    FeedStats,
    Subscriber,
    event_data,
    event_message,
    phase_after,
)
from p2pactor.surface.timeline.server import (
    FeedSource,
    TimelineServer,
    open_replay_server,
    open_timeline_server,
    page_url,
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
    "FeedSource",
    "FeedStats",
    "Subscriber",
    "TimelineServer",
    "event_data",
    "event_message",
    "open_replay_server",
    "open_timeline_server",
    "page_url",
    "phase_after",
]
