"""What the runtime must do because an event happened.

Effects are derived from events alone (:func:`effects_of`), never from state, so
the log says everything an actor did. When a log is replayed, its effects are
not performed again: replay rebuilds state, it does not resend messages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import msgspec

from p2pactor.core import events as ev
from p2pactor.core import protocol as wire
from p2pactor.core.builder import filed_under
from p2pactor.core.ids import ActorId


class Send(msgspec.Struct, frozen=True, gc=False):
    """Send ``message`` to the actor's peer."""

    message: wire.Message


class StartTransfer(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Start one WRITE of our ``local_blocks`` into the peer's ``remote_blocks``.

    The runtime reports the end with a
    :class:`~p2pactor.core.inputs.TransferResult` carrying ``transfer_id``, and
    only once no part of the write can still be running.
    """

    transfer_id: int
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


class ParentLookup(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Ask the parent about ``keys`` and pin the hits, in one hold of the parent.

    The runtime serves it while it holds the parent handle: open the synthetic
    request ``context`` first if ``open_context``; skip everything and answer
    ``expired`` if the time is past ``not_after``; look each key up; pin all
    hits with one job. The answer is a :class:`~p2pactor.core.inputs.ParentAnswer`.

    A re-poll (``open_context`` false) that finds every key still pending may
    be kept by the runtime and asked again at its next serve, answering only
    once a key resolves or ``not_after`` passes; the core works either way.
    """

    context: str
    lookup_id: int
    keys: tuple[bytes, ...]
    open_context: bool
    not_after: float | None


class ParentClose(msgspec.Struct, frozen=True, gc=False):
    """Tell the parent the synthetic request ``context`` is finished."""

    context: str


# What a producer actor may ask of the parent; served only with the handle.
ParentRequest = ParentLookup | ParentClose


class ReleasePin(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Release the parent job ``job_id`` (unpin its blocks). Happens once per job."""

    job_id: int
    success: bool


class ReportLoad(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Report the engine's load job ``job_id`` finished. Happens once per job."""

    job_id: int
    success: bool
    reason: str


class Disconnect(msgspec.Struct, frozen=True, gc=False):
    """The peer broke the protocol: close the whole session."""

    reason: str


class Retire(msgspec.Struct, frozen=True, gc=False):
    """The actor reached a terminal state; its task may end."""


# Anything an event asks the runtime to do.
Effect = (
    Send
    | StartTransfer
    | ParentLookup
    | ParentClose
    | ReleasePin
    | ReportLoad
    | Disconnect
    | Retire
)


def context_name(actor: ActorId, lookup_id: int) -> str:
    """Name the synthetic parent request of one lookup, as vLLM names it.

    ``p2p:{peer}:{kv_request_id}:lu{n}``; later incarnations of a reused id add
    ``#{incarnation}`` to the id so that names never repeat.
    """
    kv_id = actor.kv_request_id
    if actor.incarnation:
        kv_id = f"{kv_id}#{actor.incarnation}"
    return f"p2p:{actor.peer}:{kv_id}:lu{lookup_id}"


def _deadline_ms(deadline: float, now: float) -> int:
    return min(max(0, round((deadline - now) * 1000)), wire.MAX_DEADLINE_MS)


_Maker = Callable[[Any], tuple[Effect, ...]]
_MAKERS: dict[type[ev.Event], _Maker] = {}


_of = filed_under(_MAKERS)


# consumer


@_of(ev.Probed)
def _probed(e: ev.Probed) -> tuple[Effect, ...]:
    lookup = wire.Lookup(
        kv_request_id=e.actor.kv_request_id,
        keys=e.keys,
        round_seq=e.round_seq,
        deadline_ms=_deadline_ms(e.lookup_deadline, e.at),
    )
    return (Send(lookup),)


@_of(ev.FetchSent)
def _fetch_sent(e: ev.FetchSent) -> tuple[Effect, ...]:
    fetch = wire.Fetch(
        kv_request_id=e.actor.kv_request_id,
        keys=e.keys,
        block_indexes=e.block_indexes,
        round_seq=e.round_seq,
    )
    return (Send(fetch),)


def _empty_fetch(actor: ActorId, round_seq: int) -> Send:
    """The terminal empty fetch: the peer may drop the whole request."""
    return Send(
        wire.Fetch(
            kv_request_id=actor.kv_request_id, keys=(), block_indexes=(), round_seq=round_seq
        )
    )


@_of(ev.LookupCancelled)
def _lookup_cancelled(e: ev.LookupCancelled) -> tuple[Effect, ...]:
    return (_empty_fetch(e.actor, e.round_seq),)


@_of(ev.AbortSent)
def _abort_sent(e: ev.AbortSent) -> tuple[Effect, ...]:
    return (Send(wire.AbortFetch(kv_request_id=e.actor.kv_request_id, round_seq=e.round_seq)),)


@_of(ev.TransferDone)
def _transfer_done(e: ev.TransferDone) -> tuple[Effect, ...]:
    reason = "" if e.success else "the peer reported the transfer failed"
    return (ReportLoad(job_id=e.job_id, success=e.success, reason=reason),)


@_of(ev.AbortAcked)
def _abort_acked(e: ev.AbortAcked) -> tuple[Effect, ...]:
    reason = "aborted; the peer confirmed no write can still land"
    return (ReportLoad(job_id=e.job_id, success=False, reason=reason),)


@_of(ev.Aborted)
def _aborted(e: ev.Aborted) -> tuple[Effect, ...]:
    return (ReportLoad(job_id=e.job_id, success=False, reason=e.reason),)


@_of(ev.FetchSkipped)
def _fetch_skipped(e: ev.FetchSkipped) -> tuple[Effect, ...]:
    return (ReportLoad(job_id=e.job_id, success=e.success, reason=e.reason),)


_RETIRE: tuple[Effect, ...] = (Retire(),)


@_of(ev.Finished)
def _finished(e: ev.Finished) -> tuple[Effect, ...]:
    if e.cancelled_round is None:
        return _RETIRE
    return (_empty_fetch(e.actor, e.cancelled_round), *_RETIRE)


@_of(ev.Closed)
def _closed(e: ev.Closed) -> tuple[Effect, ...]:
    if not e.released:
        return _RETIRE
    return (*(ReleasePin(job_id=job, success=False) for job in e.released), *_RETIRE)


# producer


@_of(ev.LookupReceived, ev.LookupLimited)
def _lookup_received(e: ev.LookupReceived | ev.LookupLimited) -> tuple[Effect, ...]:
    keys = e.keys if isinstance(e, ev.LookupReceived) else e.keys[: e.admitted]
    ask = ParentLookup(
        context=context_name(e.actor, e.lookup_id),
        lookup_id=e.lookup_id,
        keys=tuple(dict.fromkeys(keys)),
        open_context=True,
        not_after=None,
    )
    return (ask,)


@_of(ev.LookupRefused)
def _lookup_refused(e: ev.LookupRefused) -> tuple[Effect, ...]:
    resp = wire.LookupResp(
        kv_request_id=e.actor.kv_request_id,
        keys=e.keys,
        hits=(False,) * len(e.keys),
        round_seq=e.round_seq,
        refused=(True,) * len(e.keys),
    )
    return (Send(resp),)


@_of(ev.PendingPolled)
def _pending_polled(e: ev.PendingPolled) -> tuple[Effect, ...]:
    ask = ParentLookup(
        context=context_name(e.actor, e.lookup_id),
        lookup_id=e.lookup_id,
        keys=e.keys,
        open_context=False,
        not_after=e.not_after,
    )
    return (ask,)


@_of(ev.LookupAnswered)
def _lookup_answered(e: ev.LookupAnswered) -> tuple[Effect, ...]:
    resp = wire.LookupResp(
        kv_request_id=e.actor.kv_request_id,
        keys=e.keys,
        hits=e.hits,
        round_seq=e.round_seq,
        refused=e.refused or wire.UNSET,
    )
    if not e.resolved:
        return (Send(resp),)
    return (Send(resp), ParentClose(context_name(e.actor, e.lookup_id)))


@_of(ev.ContextClosed)
def _context_closed(e: ev.ContextClosed) -> tuple[Effect, ...]:
    return (ParentClose(context_name(e.actor, e.lookup_id)),)


@_of(ev.PinReleased)
def _pin_released(e: ev.PinReleased) -> tuple[Effect, ...]:
    return (ReleasePin(job_id=e.job_id, success=e.success),)


@_of(ev.TransferStarted)
def _transfer_started(e: ev.TransferStarted) -> tuple[Effect, ...]:
    start = StartTransfer(
        transfer_id=e.transfer_id, local_blocks=e.local_blocks, remote_blocks=e.remote_blocks
    )
    return (start,)


@_of(ev.TransferDoneSent)
def _transfer_done_sent(e: ev.TransferDoneSent) -> tuple[Effect, ...]:
    done = wire.TransferDone(
        kv_request_id=e.actor.kv_request_id, success=e.success, round_seq=e.round_seq
    )
    return (Send(done),)


@_of(ev.AbortAckSent)
def _abort_ack_sent(e: ev.AbortAckSent) -> tuple[Effect, ...]:
    return (Send(wire.AbortAck(kv_request_id=e.actor.kv_request_id, round_seq=e.round_seq)),)


@_of(ev.Rejected)
def _rejected(e: ev.Rejected) -> tuple[Effect, ...]:
    return (Disconnect(f"{e.violation.value} in {e.input}: {e.detail}"),)


# The event types that make the runtime do something; every other event is a record only.
EFFECTFUL: Final[frozenset[type[ev.Event]]] = frozenset(_MAKERS)


def effects_of(event: ev.AnyEvent) -> tuple[Effect, ...]:
    """Derive what the runtime must do because ``event`` happened."""
    make = _MAKERS.get(type(event))
    return () if make is None else make(event)
