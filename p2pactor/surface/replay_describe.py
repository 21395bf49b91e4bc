"""One line per event: what a timeline row says about it.

The match over every event type ends in ``assert_never``, so mypy flags an
event added to :mod:`p2pactor.core.events` and not described here.
"""

from __future__ import annotations

from typing import assert_never

from p2pactor.core import events as ev

__all__ = ["describe"]


def _n(count: int, noun: str) -> str:
    if count == 1:
        return f"1 {noun}"
    return f"{count} {noun}es" if noun.endswith("s") else f"{count} {noun}s"


def _ok(success: bool) -> str:
    return "success" if success else "failed"


def describe(event: ev.AnyEvent) -> str:
    """A short description of ``event`` for a timeline row."""
    match event:
        case ev.Ignored():
            return f"{event.input}: {event.reason}"
        case ev.Rejected():
            return f"{event.input} {event.violation.value}: {event.detail}"
        case ev.SessionLost():
            if event.loads_held_until is None:
                return event.reason
            return f"{event.reason}; loads held {event.loads_held_until - event.at:g} s"
        case ev.FinishRequested():
            return ""
        case ev.Opened():
            return f"round {event.round_seq}"
        case ev.Registered():
            return _n(len(event.keys), "key")
        case ev.Probed():
            return f"round {event.round_seq}, {_n(len(event.keys), 'key')}"
        case ev.LookupResp():
            hits = sum(event.hits)
            rnd = "?" if event.round_seq is None else event.round_seq
            return f"round {rnd}, {_n(hits, 'hit')}, {_n(len(event.hits) - hits, 'miss')}"
        case ev.LookupTimedOut():
            return f"{_n(len(event.keys), 'key')} timed out"
        case ev.FetchSent():
            return (
                f"round {event.round_seq}, job {event.job_id}, "
                f"{_n(len(event.keys), 'block')}, next round {event.next_round}"
            )
        case ev.FetchSkipped():
            return f"job {event.job_id}, {_ok(event.success)}: {event.reason}"
        case ev.LookupCancelled():
            return f"round {event.round_seq}, empty fetch"
        case ev.TransferDone():
            return f"round {event.round_seq}, job {event.job_id}, {_ok(event.success)}"
        case ev.AbortSent():
            return f"round {event.round_seq}, job {event.job_id}: {event.reason}"
        case ev.AbortAcked():
            return f"round {event.round_seq}, job {event.job_id}"
        case ev.Aborted():
            return f"round {event.round_seq}, job {event.job_id}: {event.reason}"
        case ev.Finished():
            parts = [f"{event.phase.value}: {event.reason}"]
            if event.requested:
                parts.append("the engine finished it")
            if event.cancelled_round is not None:
                parts.append(f"empty fetch, round {event.cancelled_round}")
            return "; ".join(parts)
        case ev.LookupReceived():
            return (
                f"lookup {event.lookup_id}, round {event.round_seq}, {_n(len(event.keys), 'key')}"
            )
        case ev.LookupLimited():
            return (
                f"lookup {event.lookup_id}, round {event.round_seq}, "
                f"{event.admitted}/{_n(len(event.keys), 'key')} looked up: {event.reason}"
            )
        case ev.LookupRefused():
            return (
                f"round {event.round_seq}, {_n(len(event.keys), 'key')} answered MISS, "
                f"over {event.quota.value}: {event.reason}"
            )
        case ev.KeysRefused():
            return (
                f"lookup {event.lookup_id}, {_n(len(event.keys), 'hit')} not pinned, "
                f"over {event.quota.value}: {event.reason}"
            )
        case ev.FetchRefused():
            return f"round {event.round_seq}, over {event.quota.value}: {event.reason}"
        case ev.KeysResolved():
            return (
                f"lookup {event.lookup_id}: {_n(len(event.hits), 'hit')}, "
                f"{_n(len(event.misses), 'miss')}, {len(event.pending)} pending"
            )
        case ev.ParentExpired():
            return f"lookup {event.lookup_id}: the parent was not asked, too late"
        case ev.KeysPinned():
            return (
                f"lookup {event.lookup_id}, round {event.round_seq}, job {event.job_id}, "
                f"{_n(len(event.keys), 'block')}"
            )
        case ev.PendingPolled():
            return f"lookup {event.lookup_id}, {_n(len(event.keys), 'key')}"
        case ev.PendingExpired():
            return f"lookup {event.lookup_id}, {_n(len(event.keys), 'key')} timed out"
        case ev.LookupAnswered():
            hits = sum(event.hits)
            text = (
                f"lookup {event.lookup_id}, round {event.round_seq}, {hits}/{len(event.hits)} hits"
            )
            if event.pinned is not None:
                text += f", job {event.pinned.job_id} pinned {_n(len(event.pinned.keys), 'block')}"
            return text + ("; the parent answered, context closed" if event.resolved else "")
        case ev.LookupDropped():
            return f"lookup {event.lookup_id}: {event.reason}"
        case ev.ContextClosed():
            return f"lookup {event.lookup_id}"
        case ev.StoreAdded():
            return f"job {event.job_id}, {_n(len(event.keys), 'block')}"
        case ev.FetchReceived():
            return f"round {event.round_seq}, {_n(len(event.keys), 'block')}"
        case ev.TransferStarted():
            jobs = ",".join(str(j) for j in sorted(set(event.job_ids)))
            return (
                f"transfer {event.transfer_id}, round {event.round_seq}, "
                f"{_n(len(event.keys), 'block')}, jobs {jobs}"
            )
        case ev.TransferCompleted():
            return f"transfer {event.transfer_id}"
        case ev.TransferFailed():
            return f"transfer {event.transfer_id}: {event.reason}"
        case ev.TransferDoneSent():
            tail = f": {event.reason}" if event.reason else ""
            return f"round {event.round_seq}, {_ok(event.success)}{tail}"
        case ev.AbortReceived() | ev.AbortAckSent():
            return f"round {event.round_seq}"
        case ev.RoundClosed():
            return f"round {event.round_seq}: {event.reason}"
        case ev.PinsRenewed():
            return f"jobs {','.join(map(str, event.job_ids))} until {event.expires_at:.3f}"
        case ev.PinReleased():
            return f"job {event.job_id}, {_ok(event.success)}: {event.reason}"
        case ev.CloseRequested():
            return f"round {event.round_seq}: {event.reason}"
        case ev.Closed():
            parts = [event.reason]
            if event.requested_round is not None:
                parts.append(f"empty fetch, round {event.requested_round}")
            if event.released:
                parts.append(
                    f"released job{'s' * (len(event.released) > 1)} "
                    + ",".join(map(str, event.released))
                )
            if event.rounds_closed:
                parts.append(
                    f"closed round{'s' * (len(event.rounds_closed) > 1)} "
                    + ",".join(map(str, event.rounds_closed))
                )
            return "; ".join(parts)
        case _:
            assert_never(event)
