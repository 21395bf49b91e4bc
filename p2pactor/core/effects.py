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


def _send(e: Any, message: Callable[..., wire.Message], **fields: Any) -> tuple[Effect, ...]:
    return (Send(message(kv_request_id=e.actor.kv_request_id, **fields)),)


def _copied(kind: type[Any], **given: Any) -> Callable[[Any], tuple[Effect, ...]]:
    """The maker of one ``kind``: its fields are the event's of the same names, but for ``given``.

    A wire message is sent to the actor's peer, about the actor's kv_request_id.
    """
    names = [n for n in kind.__struct_fields__ if n not in given and n != "kv_request_id"]
    if "kv_request_id" in kind.__struct_fields__:
        return lambda e: _send(e, kind, **given, **{n: getattr(e, n) for n in names})
    return lambda e: (kind(**given, **{n: getattr(e, n) for n in names}),)


def _ask(e: Any, keys: tuple[bytes, ...], not_after: float | None = None) -> tuple[Effect, ...]:
    """Ask the parent about a lookup's keys: a re-poll (``not_after``) or the first ask."""
    context = context_name(e.actor, e.lookup_id)
    first = not_after is None
    ask = ParentLookup(
        context=context, lookup_id=e.lookup_id, keys=keys, open_context=first, not_after=not_after
    )
    return (ask,)


def _answered(e: ev.LookupAnswered) -> tuple[Effect, ...]:
    """The answer to a lookup, and its synthetic request's close if it was answered whole."""
    # Said out (no _send): this is every lookup's answer, on the producer's hot path.
    resp = wire.LookupResp(
        kv_request_id=e.actor.kv_request_id,
        keys=e.keys,
        hits=e.hits,
        round_seq=e.round_seq,
        refused=e.refused or wire.UNSET,
    )
    if e.resolved:
        return (Send(resp), ParentClose(context_name(e.actor, e.lookup_id)))
    return (Send(resp),)


_RETIRE: tuple[Effect, ...] = (Retire(),)

# What each event that makes the runtime do something makes it do; every other event is a record.
_MAKERS: Final[dict[type[ev.Event], Callable[[Any], tuple[Effect, ...]]]] = {
    # consumer
    ev.Probed: lambda e: _send(
        e,
        wire.Lookup,
        keys=e.keys,
        round_seq=e.round_seq,
        deadline_ms=min(max(0, round((e.lookup_deadline - e.at) * 1000)), wire.MAX_DEADLINE_MS),
    ),
    ev.FetchSent: _copied(wire.Fetch),
    ev.LookupCancelled: _copied(wire.Fetch, keys=(), block_indexes=()),  # the terminal empty fetch
    ev.AbortSent: _copied(wire.AbortFetch),
    ev.TransferDone: lambda e: (
        ReportLoad(
            job_id=e.job_id,
            success=e.success,
            reason="" if e.success else "the peer reported the transfer failed",
        ),
    ),
    ev.AbortAcked: _copied(
        ReportLoad, success=False, reason="aborted; the peer confirmed no write can still land"
    ),
    ev.Aborted: _copied(ReportLoad, success=False),
    ev.FetchSkipped: _copied(ReportLoad),
    # The terminal empty fetch, if a lookup was still open.
    ev.Finished: lambda e: (
        _RETIRE
        if e.cancelled_round is None
        else (
            *_send(e, wire.Fetch, keys=(), block_indexes=(), round_seq=e.cancelled_round),
            *_RETIRE,
        )
    ),
    # producer
    ev.LookupReceived: lambda e: _ask(e, tuple(dict.fromkeys(e.keys))),
    ev.LookupLimited: lambda e: _ask(e, tuple(dict.fromkeys(e.keys[: e.admitted]))),
    ev.PendingPolled: lambda e: _ask(e, e.keys, e.not_after),
    ev.LookupRefused: lambda e: _send(
        e,
        wire.LookupResp,
        keys=e.keys,
        hits=(False,) * len(e.keys),
        round_seq=e.round_seq,
        refused=(True,) * len(e.keys),
    ),
    ev.LookupAnswered: _answered,
    ev.ContextClosed: lambda e: (ParentClose(context_name(e.actor, e.lookup_id)),),
    ev.PinReleased: _copied(ReleasePin),
    ev.TransferStarted: _copied(StartTransfer),
    ev.TransferDoneSent: _copied(wire.TransferDone),
    ev.AbortAckSent: _copied(wire.AbortAck),
    ev.Closed: lambda e: (
        (*(ReleasePin(job_id=j, success=False) for j in e.released), *_RETIRE)
        if e.released
        else _RETIRE
    ),
    ev.Rejected: lambda e: (Disconnect(f"{e.violation.value} in {e.input}: {e.detail}"),),
}

# The event types that make the runtime do something; every other event is a record only.
EFFECTFUL: Final[frozenset[type[ev.Event]]] = frozenset(_MAKERS)


def effects_of(event: ev.AnyEvent) -> tuple[Effect, ...]:
    """Derive what the runtime must do because ``event`` happened."""
    make = _MAKERS.get(type(event))
    return () if make is None else make(event)
