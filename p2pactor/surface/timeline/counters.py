"""The running totals of the ``counters`` message, kept over every event the feed sees."""

from __future__ import annotations

from typing import Any, Final

import attrs

from p2pactor.core import events as ev
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.ids import ActorId

__all__ = ["Counters"]

# A lookup over a quota is still a lookup received (as replay's summary counts it).
_LOOKUPS_RECEIVED: Final = frozenset({"LookupReceived", "LookupLimited", "LookupRefused"})


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
