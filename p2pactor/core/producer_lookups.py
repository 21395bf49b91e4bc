"""A producer's lookups: admit them, hear the parent, answer once; and how their events fold."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import msgspec
from msgspec.structs import replace

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.builder import drop, put
from p2pactor.core.events import ProducerPhase, Quota, Violation
from p2pactor.core.producer_state import (
    _B,
    ActiveLookup,
    PinJob,
    ProducerState,
    _pinned,
    _release,
    _round,
    _set_round,
)


def _reject(b: _B, msg: wire.Message, violation: Violation, detail: str) -> None:
    b.emit(ev.Rejected, input=msg.TYPE, violation=violation, detail=detail)


def _expirable(s: ProducerState, job: PinJob) -> bool:
    """A pin no fetch is using or about to use: it may time out.

    A job that a write reads serves the write's round until the round ends,
    which is after the write: ``serving`` covers the job's readers too.
    """
    if job.serving:
        return False
    rnd = None if job.round_seq is None else s.rounds.get(job.round_seq)
    return rnd is None or not rnd.fetched


def _renew(b: _B) -> None:
    """The request showed it is alive: renew its idle pins' leases, within the lease cap."""
    s = b.state
    if s.first_pinned_at is None:
        return  # it never pinned
    until = min(b.now + b.t.pin_timeout, s.first_pinned_at + b.t.pin_lease_cap)
    renewed = tuple(
        j for j, job in sorted(s.jobs.items()) if job.expires_at < until and _expirable(s, job)
    )
    if renewed:
        b.emit(ev.PinsRenewed, job_ids=renewed, expires_at=until)


def _on_lookup(b: _B, msg: wire.Lookup, verdict: inp.OverQuota | None = None) -> None:
    s = b.state
    if s.phase is ProducerPhase.CLOSING:
        _reject(b, msg, Violation.AFTER_CLOSE, "lookup after the request was closed")
        return
    if msg.round_seq <= s.closed_through:
        detail = (
            f"lookup for round {msg.round_seq}, but round {s.closed_through} was already "
            "fetched; rounds only move forward"
        )
        _reject(b, msg, Violation.STALE_ROUND, detail)
        return
    if not msg.keys:
        b.ignore(msg.TYPE, "a lookup without keys")
        return
    # A quota refusal is checked after the protocol's own rules: a peer over
    # quota that also breaks the protocol is still disconnected.
    admit = len(msg.keys) if verdict is None else min(verdict.admit, len(msg.keys))
    if verdict is not None and admit <= 0:
        quota = verdict.quota
        reason = verdict.reason
        b.emit(ev.LookupRefused, round_seq=msg.round_seq, keys=msg.keys, quota=quota, reason=reason)
        return
    _renew(b)  # a lookup admitted: the request is alive (a refused one changes nothing held)
    budget = b.t.pending_timeout
    if msg.deadline_ms is not wire.UNSET:
        budget = min(budget, msg.deadline_ms / 1000)
    whole = verdict is None or admit >= len(msg.keys)
    b.emit(
        ev.LookupReceived if whole else ev.LookupLimited,
        lookup_id=s.next_lookup_id,
        round_seq=msg.round_seq,
        keys=msg.keys,
        deadline=b.now + budget,
        **({} if verdict is None or whole else {"admitted": admit, "reason": verdict.reason}),
    )


def _pin_refusal(s: ProducerState, lookup: ActiveLookup) -> str:
    """Why a fresh pin for ``lookup`` can't be kept, or "" if it can."""
    if lookup.dropped or s.phase is not ProducerPhase.OPEN:
        return "the request closed before the pin arrived"
    if lookup.answered:
        return "the lookup was answered at its deadline before the parent served it"
    if lookup.round_seq <= s.closed_through:
        return f"round {lookup.round_seq} was fetched before the pin arrived"
    return ""


def _on_parent_answer(b: _B, answer: inp.ParentAnswer) -> None:
    lookup = b.state.lookups.get(answer.lookup_id)
    if lookup is None or not lookup.outstanding:
        b.ignore("parent_answer", f"no lookup {answer.lookup_id} is waiting for the parent")
        if answer.pin is not None:
            _release(b, answer.pin.job_id, "stray parent answer")
        return
    if answer.expired:
        b.emit(ev.ParentExpired, lookup_id=lookup.lookup_id)
        if answer.pin is not None:  # the runtime never pins past not_after; if it did:
            reason = "an expired parent answer carried a pin"
            b.ignore("parent_answer", reason)
            _release(b, answer.pin.job_id, reason)
    elif _resolve(b, lookup, answer):
        return
    lookup = b.state.lookups[answer.lookup_id]
    if lookup.waiting and b.now >= lookup.deadline:
        b.emit(ev.PendingExpired, lookup_id=lookup.lookup_id, keys=_ordered(lookup))
    _settle_lookup(b, answer.lookup_id)


def _ordered(lookup: ActiveLookup) -> tuple[bytes, ...]:
    """The lookup's pending keys in wire order, once each."""
    pending = lookup.pending
    return tuple(k for k in dict.fromkeys(lookup.keys[: lookup.admitted]) if k in pending)


def _resolve(b: _B, lookup: ActiveLookup, answer: inp.ParentAnswer) -> bool:
    """Record the parent's answer; whether it answered the lookup whole, in one event.

    The common case: every key of the lookup is a HIT the parent pinned or a
    MISS, at its first answer, and nothing else happened to the lookup. What
    the parent's answer, its pin, the lookup's answer and its close would
    record as four events is then one :class:`~p2pactor.core.events.LookupAnswered`.
    """
    results = dict(answer.results)
    pin = answer.pin
    pinned = frozenset(pin.keys) if pin is not None else frozenset()
    resolved: dict[bytes, bool] = {}
    for key in lookup.pending:
        result = results.get(key)
        if result is inp.LookupResult.HIT or result is inp.LookupResult.MISS:
            # A hit the parent could not pin may be evicted: a MISS. HIT_PENDING,
            # RETRY, or not answered: still pending.
            resolved[key] = result is inp.LookupResult.HIT and key in pinned
    held = None
    refusal = ""
    if pin is not None:
        held = ev.Pinned(**msgspec.structs.asdict(pin), expires_at=b.now + b.t.pin_timeout)
        refusal = _pin_refusal(b.state, lookup)
    # Not whole: a quota's refusal, a close, a deadline, keys settled before or still pending.
    settled = lookup.dropped or lookup.answered or lookup.resolved or lookup.refused
    if len(resolved) == len(lookup.pending) and not (answer.refused or refusal or settled):
        _answer(b, lookup, resolved, whole=True, pinned=held)
        return True
    order = _ordered(lookup)
    refused = set(answer.refused) - pinned
    if refused and (keys := tuple(k for k in order if k in refused)):
        reason = answer.refusal or "the peer is over its pinned-blocks quota"
        quota = Quota.PINNED_BLOCKS
        b.emit(ev.KeysRefused, lookup_id=lookup.lookup_id, keys=keys, quota=quota, reason=reason)
    pending = tuple(k for k in order if k not in resolved)
    poll = pending and b.now < lookup.deadline
    next_poll = min(b.now + b.t.pending_poll_interval, lookup.deadline) if poll else None
    b.emit(
        ev.KeysResolved,
        lookup_id=lookup.lookup_id,
        hits=tuple(k for k in order if resolved.get(k) is True),
        misses=tuple(k for k in order if resolved.get(k) is False),
        pending=pending,
        next_poll_at=next_poll,
    )
    if held is not None:
        fields = msgspec.structs.asdict(held)
        b.emit(ev.KeysPinned, lookup_id=lookup.lookup_id, round_seq=lookup.round_seq, **fields)
        if refusal:
            _release(b, held.job_id, refusal)
    return False


def _settle_lookup(b: _B, lookup_id: int) -> None:
    """Answer (or forget) a lookup once nothing about it is outstanding."""
    lookup = b.state.lookups.get(lookup_id)
    if lookup is None or lookup.outstanding:
        return
    if not (lookup.dropped or lookup.answered):
        if lookup.pending:
            return
        _answer(b, lookup)
    if lookup_id in b.state.open_contexts:
        b.emit(ev.ContextClosed, lookup_id=lookup_id)


def _answer(
    b: _B,
    lookup: ActiveLookup,
    answers: Mapping[bytes, bool] | None = None,
    *,
    whole: bool = False,
    pinned: ev.Pinned | None = None,
) -> None:
    """Send the lookup's one answer, keys in wire order, duplicates included.

    Its hits (``answers``, or those the lookup resolved) and refusals are each
    parallel to the lookup's keys; the refusals are empty when no admitted key's
    MISS is a refusal of the pin budget. Every key past the admitted prefix
    answers MISS refused, whatever it is: those keys are never looked at one by
    one, as a lookup may carry 65,536 of them, and what they cost must stay far
    below what the quota admits.
    """
    keys = lookup.keys
    admitted = lookup.admitted
    refused = lookup.refused
    answers = lookup.resolved if answers is None else answers
    head = keys[:admitted]
    beyond = len(keys) - admitted
    hits = tuple([answers[k] for k in head]) + (False,) * beyond
    flags = tuple([k in refused for k in head]) + (True,) * beyond if refused or beyond else ()
    b.emit(
        ev.LookupAnswered,
        lookup_id=lookup.lookup_id,
        round_seq=lookup.round_seq,
        keys=keys,
        hits=hits,
        refused=flags,
        resolved=whole,
        pinned=pinned,
    )


def _drop_lookups(b: _B, reason: str) -> None:
    for lookup_id, lookup in sorted(b.state.lookups.items()):
        if not lookup.dropped:
            b.emit(ev.LookupDropped, lookup_id=lookup_id, reason=reason)
            if lookup_id in b.state.open_contexts and lookup_id not in b.state.lookups:
                b.emit(ev.ContextClosed, lookup_id=lookup_id)


def _tick_lookups(b: _B) -> None:
    now = b.now
    for lookup_id, lookup in sorted(b.state.lookups.items()):
        if not lookup.waiting:
            continue
        if now >= lookup.deadline:
            # The deadline holds even while the parent has not served us (an
            # engine that stopped stepping): answer now, clean up when it does.
            b.emit(ev.PendingExpired, lookup_id=lookup_id, keys=_ordered(lookup))
            if lookup.outstanding:
                _answer(b, b.state.lookups[lookup_id])
            else:
                _settle_lookup(b, lookup_id)
        elif not lookup.outstanding and (poll := lookup.next_poll_at) is not None and now >= poll:
            keys = _ordered(lookup)
            not_after = lookup.deadline
            b.emit(ev.PendingPolled, lookup_id=lookup_id, keys=keys, not_after=not_after)


def _opened(
    s: ProducerState, e: ev.LookupReceived | ev.LookupLimited, admitted: int
) -> ProducerState:
    """Open a lookup whose first ``admitted`` keys go to the parent; the rest answer MISS."""
    lookup = ActiveLookup(
        lookup_id=e.lookup_id,
        round_seq=e.round_seq,
        keys=e.keys,
        admitted=admitted,
        deadline=e.deadline,
        pending=frozenset(e.keys[:admitted]),
    )
    return _set_round(
        s,
        e,
        replace(_round(s, e.round_seq), lookup_supplied=True),
        lookups=put(s.lookups, e.lookup_id, lookup),
        next_lookup_id=e.lookup_id + 1,
        looked_up_through=max(s.looked_up_through, e.round_seq),
    )


def _lookup(s: ProducerState, e: Any, **changes: Any) -> ProducerState:
    """``s`` after ``e``, with the changes to the lookup ``e`` names."""
    lookup = replace(s.lookups[e.lookup_id], **changes)
    return replace(s, seq=e.seq, lookups=put(s.lookups, e.lookup_id, lookup))


def _forget(s: ProducerState, e: Any) -> ProducerState:
    """``s`` after ``e``, the lookup ``e`` names over and its synthetic request closed."""
    contexts = s.open_contexts - {e.lookup_id}
    return replace(s, seq=e.seq, lookups=drop(s.lookups, e.lookup_id), open_contexts=contexts)


def _keys_resolved(s: ProducerState, e: ev.KeysResolved) -> ProducerState:
    hits = dict.fromkeys(e.hits, True)
    misses = dict.fromkeys(e.misses, False)
    resolved = {**s.lookups[e.lookup_id].resolved, **hits, **misses}
    pending = frozenset(e.pending)
    poll = e.next_poll_at
    s = _lookup(s, e, resolved=resolved, pending=pending, outstanding=False, next_poll_at=poll)
    return replace(s, open_contexts=s.open_contexts | {e.lookup_id})


def _lookup_answered(s: ProducerState, e: ev.LookupAnswered) -> ProducerState:
    if not e.resolved:
        return _lookup_ended(s, e, answered=True)  # at its deadline
    # The parent's answer, its pin and the answer in one step: the lookup is
    # over, its synthetic request closed with it.
    return _forget(s if e.pinned is None else _pinned(s, e, e.round_seq, e.pinned), e)


def _context_closed(s: ProducerState, e: ev.ContextClosed) -> ProducerState:
    closing = s.lookups.get(e.lookup_id)
    if closing is not None and (closing.dropped or closing.answered):
        return _forget(s, e)
    return replace(s, seq=e.seq, open_contexts=s.open_contexts - {e.lookup_id})


def _lookup_ended(s: ProducerState, e: Any, **how: bool) -> ProducerState:
    """The lookup ``e`` names answered or dropped: forgotten, or marked ``how`` for the parent.

    A lookup the parent has not served yet is kept for its answer, whose pin must be released.
    """
    if s.lookups[e.lookup_id].outstanding:
        return _lookup(s, e, next_poll_at=None, **how)
    return replace(s, seq=e.seq, lookups=drop(s.lookups, e.lookup_id))


def _pending_expired(s: ProducerState, e: ev.PendingExpired) -> ProducerState:
    lookup = s.lookups[e.lookup_id]
    resolved = {**lookup.resolved, **dict.fromkeys(e.keys, False)}
    pending = lookup.pending - frozenset(e.keys)
    return _lookup(s, e, resolved=resolved, pending=pending, next_poll_at=None)


# How each lookup event changes the state: the lookups' part of ``evolve_producer``'s table.
LOOKUP_FOLDS: Final[dict[type[ev.Event], Callable[[ProducerState, Any], ProducerState]]] = {
    ev.LookupReceived: lambda s, e: _opened(s, e, len(e.keys)),
    ev.LookupLimited: lambda s, e: _opened(s, e, e.admitted),
    # No lookup opens and nothing is held (so a refused request can close at once), but the round
    # counts as looked up: a fetch for it fails fast instead of waiting for stored blocks.
    ev.LookupRefused: lambda s, e: replace(
        s, seq=e.seq, looked_up_through=max(s.looked_up_through, e.round_seq)
    ),
    ev.KeysResolved: _keys_resolved,
    # The KeysResolved that follows counts the keys as misses; the answer says why.
    ev.KeysRefused: lambda s, e: _lookup(
        s, e, refused=s.lookups[e.lookup_id].refused | frozenset(e.keys)
    ),
    ev.PendingPolled: lambda s, e: _lookup(s, e, outstanding=True, next_poll_at=None),
    ev.ParentExpired: lambda s, e: _lookup(s, e, outstanding=False),
    ev.PendingExpired: _pending_expired,
    ev.LookupAnswered: _lookup_answered,
    ev.LookupDropped: lambda s, e: _lookup_ended(s, e, dropped=True),
    ev.ContextClosed: _context_closed,
}
