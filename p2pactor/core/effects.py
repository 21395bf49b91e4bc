"""What the runtime must do because an event happened.

Effects are derived from events alone (:func:`effects_of`), never from state, so
the log says everything an actor did. When a log is replayed, its effects are
not performed again: replay rebuilds state, it does not resend messages.
"""

from __future__ import annotations

from typing import assert_never

import attrs

from p2pactor import protocol as wire
from p2pactor.core import events as ev
from p2pactor.core.ids import ActorId

__all__ = [
    "Disconnect",
    "Effect",
    "ParentClose",
    "ParentLookup",
    "ParentRequest",
    "ReleasePin",
    "ReportLoad",
    "Retire",
    "Send",
    "StartTransfer",
    "context_name",
    "effects_of",
]


@attrs.frozen
class Send:
    """Send ``message`` to the actor's peer."""

    message: wire.Message


@attrs.frozen(kw_only=True)
class StartTransfer:
    """Start one WRITE of our ``local_blocks`` into the peer's ``remote_blocks``.

    The runtime reports the end with a
    :class:`~p2pactor.core.inputs.TransferResult` carrying ``transfer_id``, and
    only once no part of the write can still be running.
    """

    transfer_id: int
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ParentLookup:
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


@attrs.frozen
class ParentClose:
    """Tell the parent the synthetic request ``context`` is finished."""

    context: str


ParentRequest = ParentLookup | ParentClose
"""What a producer actor may ask of the parent; served only with the handle."""


@attrs.frozen(kw_only=True)
class ReleasePin:
    """Release the parent job ``job_id`` (unpin its blocks). Happens once per job."""

    job_id: int
    success: bool


@attrs.frozen(kw_only=True)
class ReportLoad:
    """Report the engine's load job ``job_id`` finished. Happens once per job."""

    job_id: int
    success: bool
    reason: str


@attrs.frozen
class Disconnect:
    """The peer broke the protocol: close the whole session."""

    reason: str


@attrs.frozen
class Retire:
    """The actor reached a terminal state; its task may end."""


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
"""Anything an event asks the runtime to do."""


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


def effects_of(event: ev.AnyEvent) -> tuple[Effect, ...]:
    """Derive what the runtime must do because ``event`` happened."""
    kv_id = event.actor.kv_request_id
    match event:
        # consumer
        case ev.Probed():
            return (
                Send(
                    wire.Lookup(
                        kv_request_id=kv_id,
                        keys=event.keys,
                        round_seq=event.round_seq,
                        deadline_ms=_deadline_ms(event.lookup_deadline, event.at),
                    )
                ),
            )
        case ev.FetchSent():
            return (
                Send(
                    wire.Fetch(
                        kv_request_id=kv_id,
                        keys=event.keys,
                        block_indexes=event.block_indexes,
                        round_seq=event.round_seq,
                    )
                ),
            )
        case ev.LookupCancelled():
            return (
                Send(
                    wire.Fetch(
                        kv_request_id=kv_id, keys=(), block_indexes=(), round_seq=event.round_seq
                    )
                ),
            )
        case ev.AbortSent():
            return (Send(wire.AbortFetch(kv_request_id=kv_id, round_seq=event.round_seq)),)
        case ev.TransferDone():
            reason = "" if event.success else "the peer reported the transfer failed"
            return (ReportLoad(job_id=event.job_id, success=event.success, reason=reason),)
        case ev.AbortAcked():
            reason = "aborted; the peer confirmed no write can still land"
            return (ReportLoad(job_id=event.job_id, success=False, reason=reason),)
        case ev.Aborted():
            return (ReportLoad(job_id=event.job_id, success=False, reason=event.reason),)
        case ev.FetchSkipped():
            return (ReportLoad(job_id=event.job_id, success=event.success, reason=event.reason),)
        case ev.Finished() | ev.Closed():
            return (Retire(),)
        # producer
        case ev.LookupReceived():
            return (
                ParentLookup(
                    context=context_name(event.actor, event.lookup_id),
                    lookup_id=event.lookup_id,
                    keys=tuple(dict.fromkeys(event.keys)),
                    open_context=True,
                    not_after=None,
                ),
            )
        case ev.LookupLimited():
            return (
                ParentLookup(
                    context=context_name(event.actor, event.lookup_id),
                    lookup_id=event.lookup_id,
                    keys=tuple(dict.fromkeys(event.keys[: event.admitted])),
                    open_context=True,
                    not_after=None,
                ),
            )
        case ev.LookupRefused():
            return (
                Send(
                    wire.LookupResp(
                        kv_request_id=kv_id,
                        keys=event.keys,
                        hits=(False,) * len(event.keys),
                        round_seq=event.round_seq,
                    )
                ),
            )
        case ev.PendingPolled():
            return (
                ParentLookup(
                    context=context_name(event.actor, event.lookup_id),
                    lookup_id=event.lookup_id,
                    keys=event.keys,
                    open_context=False,
                    not_after=event.not_after,
                ),
            )
        case ev.LookupAnswered():
            return (
                Send(
                    wire.LookupResp(
                        kv_request_id=kv_id,
                        keys=event.keys,
                        hits=event.hits,
                        round_seq=event.round_seq,
                    )
                ),
            )
        case ev.ContextClosed():
            return (ParentClose(context_name(event.actor, event.lookup_id)),)
        case ev.PinReleased():
            return (ReleasePin(job_id=event.job_id, success=event.success),)
        case ev.TransferStarted():
            return (
                StartTransfer(
                    transfer_id=event.transfer_id,
                    local_blocks=event.local_blocks,
                    remote_blocks=event.remote_blocks,
                ),
            )
        case ev.TransferDoneSent():
            return (
                Send(
                    wire.TransferDone(
                        kv_request_id=kv_id, success=event.success, round_seq=event.round_seq
                    )
                ),
            )
        case ev.AbortAckSent():
            return (Send(wire.AbortAck(kv_request_id=kv_id, round_seq=event.round_seq)),)
        case ev.Rejected():
            return (Disconnect(f"{event.violation.value} in {event.input}: {event.detail}"),)
        case (
            ev.Ignored()
            | ev.SessionLost()
            | ev.FinishRequested()
            | ev.Opened()
            | ev.Registered()
            | ev.LookupResp()
            | ev.LookupTimedOut()
            | ev.KeysResolved()
            | ev.KeysPinned()
            | ev.KeysRefused()
            | ev.FetchRefused()
            | ev.ParentExpired()
            | ev.PendingExpired()
            | ev.LookupDropped()
            | ev.StoreAdded()
            | ev.FetchReceived()
            | ev.TransferCompleted()
            | ev.TransferFailed()
            | ev.AbortReceived()
            | ev.RoundClosed()
            | ev.CloseRequested()
        ):
            return ()
        case _:
            assert_never(event)
