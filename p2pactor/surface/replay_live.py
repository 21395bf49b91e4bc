"""What replay keeps of one actor while it runs, and what each event adds to the counts.

The per-actor record and the count table of :class:`~p2pactor.surface.replay.Replayer`.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Final

from p2pactor.core import events as ev
from p2pactor.core.consumer_state import CONSUMER_FOLDS
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.fold import ActorState, initial_state
from p2pactor.core.ids import ActorId, Role
from p2pactor.core.producer import PRODUCER_FOLDS, ProducerPhase
from p2pactor.surface.replay_checks import ConsumerCheck, ProducerCheck
from p2pactor.surface.replay_results import TimelineRow

CheckStep = Callable[[ev.AnyEvent, Any, Any, ev.AnyEvent | None], list[str]]
"""A check's step: (event, state before, state after, event before) -> what it breaks."""


class Live:
    """What replay keeps about one actor while it runs."""

    __slots__ = (
        "actor",
        "check",
        "check_step",
        "events",
        "fast",
        "first_at",
        "folds",
        "last_at",
        "node_id",
        "prev",
        "rows",
        "state",
        "violations",
    )

    def __init__(self, node_id: str, actor: ActorId, *, check: bool, rows: bool) -> None:
        self.node_id = node_id
        self.actor = actor
        self.state: ActorState = initial_state(actor)
        self.events = 0
        self.first_at = 0.0
        self.last_at = 0.0
        self.prev: ev.AnyEvent | None = None
        self.rows: list[TimelineRow] | None = [] if rows else None
        self.violations = 0
        self.check: ConsumerCheck | ProducerCheck | None = None
        # The check's step, bound once: (event, state before, state after, event before).
        self.check_step: CheckStep | None = None
        if check:
            self.check = ConsumerCheck() if actor.role is Role.CONSUMER else ProducerCheck()
            self.check_step = self.check.step
        self.folds: Mapping[type[ev.Event], Callable[[Any, Any], ActorState]] = (
            CONSUMER_FOLDS if actor.role is Role.CONSUMER else PRODUCER_FOLDS
        )
        # No timeline to show: each event is folded (and checked) inline (Replayer.feed).
        self.fast = self.rows is None


Counts = Counter[str]
REFUSED: Final = "refused:"
"""The prefix of the counts of quota refusals, by quota."""


def _count_lookup_resp(c: Counts, e: ev.LookupResp) -> None:
    hits = sum(e.hits)
    c["keys_hit"] += hits
    c["keys_missed"] += len(e.hits) - hits


def _count_lookup_answered(c: Counts, e: ev.LookupAnswered) -> None:
    if e.resolved:
        # What a KeysResolved (of distinct keys) and a KeysPinned said apart.
        answers = dict(zip(e.keys, e.hits, strict=True))
        hits = sum(answers.values())
        c["keys_served_hit"] += hits
        c["keys_served_missed"] += len(answers) - hits
        c["pins_answered"] += e.pinned is not None


def _count_keys_resolved(c: Counts, e: ev.KeysResolved) -> None:
    c["keys_served_hit"] += len(e.hits)
    c["keys_served_missed"] += len(e.misses)


def _count_load_failed(c: Counts, e: ev.AnyEvent) -> None:
    c["loads_failed"] += 1


def _count_refusal(c: Counts, e: ev.LookupRefused | ev.KeysRefused | ev.FetchRefused) -> None:
    c[REFUSED + e.quota.value] += 1


COUNTERS: Final[Mapping[type[ev.Event], Callable[[Counts, Any], None]]] = {
    ev.LookupResp: _count_lookup_resp,
    ev.LookupTimedOut: lambda c, e: c.update(keys_timed_out=len(e.keys)),
    ev.KeysResolved: _count_keys_resolved,
    ev.LookupAnswered: _count_lookup_answered,
    ev.Closed: lambda c, e: c.update(pins_closed=len(e.released)),
    ev.PendingExpired: lambda c, e: c.update(keys_served_timed_out=len(e.keys)),
    ev.TransferDone: lambda c, e: c.update(("loads_done" if e.success else "loads_failed",)),
    ev.AbortAcked: _count_load_failed,
    ev.Aborted: _count_load_failed,
    ev.FetchSkipped: lambda c, e: None if e.success else _count_load_failed(c, e),
    ev.LookupRefused: _count_refusal,
    ev.KeysRefused: _count_refusal,
    ev.FetchRefused: _count_refusal,
    ev.LookupLimited: lambda c, e: c.update((REFUSED + ev.Quota.KEYS_PER_LOOKUP.value,)),
}
"""What each counted event type adds to the summary's counts (one dict
lookup per event, where a ``match`` would test every arm in turn)."""

TERMINAL: Final = frozenset({*(p for p in ConsumerPhase if p.terminal), ProducerPhase.CLOSED})
"""The phases an actor of either role ends in."""

EndedKey = tuple[str, Role, str, str, int]


def ended_key(node_id: str, actor: ActorId) -> EndedKey:
    """What replay keeps of an ended actor.

    Flat, with the peer shared by all its actors: a third of the decoded
    ActorId it stands for.
    """
    return (node_id, actor.role, sys.intern(actor.peer), actor.kv_request_id, actor.incarnation)
