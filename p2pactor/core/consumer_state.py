"""The consumer's state and its fold: :class:`ConsumerState` and :func:`evolve_consumer`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final

import msgspec
from msgspec.structs import replace

from p2pactor.core import events as ev
from p2pactor.core.builder import PHASE_RANK, ActorRecord, evolver, phase_after
from p2pactor.core.events import ConsumerPhase
from p2pactor.core.ids import Role


class Load(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One fetch in flight.

    Attributes:
        job_id: The engine's load job.
        deadline: When it is aborted if the peer has not answered.
        ack_deadline: Set once an abort went out, or the session was lost
            with the load held: when the load fails anyway.
        held: Why it fails at ``ack_deadline``, when no abort went out: the
            session was lost and its blocks are held for a late write.
    """

    job_id: int
    deadline: float
    ack_deadline: float | None = None
    held: str = ""

    @property
    def aborting(self) -> bool:
        """Whether the load is only waiting to end: an abort went out, or it is held."""
        return self.ack_deadline is not None


class ConsumerState(ActorRecord, frozen=True, kw_only=True, gc=False):
    """Everything a consumer actor knows, rebuilt exactly by replaying its events.

    Attributes:
        actor: Who this is.
        seq: The sequence number of the last event applied.
        phase: Where the request is; only moves forward.
        round_seq: The round the next lookup or fetch belongs to; None until
            the first of them, which takes the request's first round.
        probes: Cached answers: True (HIT), False (MISS), None (asked or about
            to be asked, unanswered). A fetch forgets the HITs and the
            unanswered keys (both sides unpin, so a HIT could be stale) and
            keeps the MISSes: the engine computes a missed key, so asking it
            again in a later round could only cost a round trip.
        refused: Keys the peer refused over a quota (answered MISS, and
            no evidence that it lacks them).
        unsent: Registered keys not yet on the wire, in registration order.
        lookup_open: A lookup went out and no fetch has closed it since.
        lookup_deadline: When the request fails if no probe resolves before.
        lookup_failed: The lookup timed out; every key answers MISS from now.
        loads: Loads in flight by round.
        finishing: The engine finished the request; waiting for loads to end.
        session_lost: The session ended; nothing can be sent.
        outcome: The worst outcome so far (DONE, FAILED or ABORTED).
        problem: What made the outcome worse, first time it got worse.
    """

    ROLE: ClassVar[Role] = Role.CONSUMER

    phase: ConsumerPhase = ConsumerPhase.REGISTERED
    round_seq: int | None = None
    probes: Mapping[bytes, bool | None] = msgspec.field(default_factory=dict)
    refused: frozenset[bytes] = frozenset()
    unsent: tuple[bytes, ...] = ()
    lookup_open: bool = False
    lookup_deadline: float | None = None
    lookup_failed: bool = False
    loads: Mapping[int, Load] = msgspec.field(default_factory=dict)
    finishing: bool = False
    session_lost: bool = False
    outcome: ConsumerPhase = ConsumerPhase.DONE
    problem: str = ""

    @property
    def asking(self) -> bool:
        """Whether keys may be asked: not finishing, its lookup not failed, its peer not lost."""
        return not (self.finishing or self.lookup_failed or self.session_lost)

    def waiting_keys(self) -> tuple[bytes, ...]:
        """Keys asked on the wire and not answered yet."""
        unsent = set(self.unsent)
        return tuple(k for k, v in self.probes.items() if v is None and k not in unsent)


# What a request that asks no more keys forgets (each key answers MISS from then on).
_NOT_ASKING: Final[dict[str, Any]] = {"probes": {}, "unsent": (), "lookup_deadline": None}


def _worse(state: ConsumerState, outcome: ConsumerPhase, problem: str) -> dict[str, Any]:
    """The changes an outcome of ``outcome`` makes: none unless it is worse (it only gets worse)."""
    if PHASE_RANK[outcome] <= PHASE_RANK[state.outcome]:
        return {}
    return {"outcome": outcome, "problem": problem}


def _registered(
    probes: Mapping[bytes, bool | None], keys: tuple[bytes, ...]
) -> Mapping[bytes, bool | None]:
    """``probes`` with every key of ``keys`` asked (unanswered unless it was answered)."""
    new = dict.fromkeys(k for k in keys if k not in probes)
    # None new: registered before (a Probed of version 1 followed a Registered).
    return {**probes, **new} if new else probes


def _without(loads: Mapping[int, Load], round_seq: int) -> dict[int, Load]:
    """``loads`` without the load of ``round_seq``, which it has (KeyError: a corrupt log)."""
    rest = dict(loads)
    del rest[round_seq]
    return rest


def _registered_keys(s: ConsumerState, e: ev.Registered) -> ConsumerState:
    return replace(s, seq=e.seq, probes=_registered(s.probes, e.keys), unsent=s.unsent + e.keys)


def _probed(s: ConsumerState, e: ev.Probed) -> ConsumerState:
    return replace(
        s,
        seq=e.seq,
        phase=phase_after(s.phase, e),
        round_seq=e.round_seq,
        probes=_registered(s.probes, e.keys),
        unsent=(),
        lookup_open=True,
        lookup_deadline=e.lookup_deadline,
    )


def _lookup_resp(s: ConsumerState, e: ev.LookupResp) -> ConsumerState:
    probes = {**s.probes, **dict(zip(e.keys, e.hits, strict=True))}
    refused = s.refused
    if e.refused:
        refused = refused | {k for k, no in zip(e.keys, e.refused, strict=True) if no}
    return replace(s, seq=e.seq, probes=probes, refused=refused, lookup_deadline=e.lookup_deadline)


def _finished(s: ConsumerState, e: ev.Finished) -> ConsumerState:
    return replace(
        s,
        seq=e.seq,
        phase=phase_after(s.phase, e),
        finishing=s.finishing or e.requested,
        outcome=e.phase,
        lookup_open=False,
        **_NOT_ASKING,
    )


def _fetch_sent(s: ConsumerState, e: ev.FetchSent) -> ConsumerState:
    loads = {**s.loads, e.round_seq: Load(job_id=e.job_id, deadline=e.load_deadline)}
    return replace(
        s,
        seq=e.seq,
        phase=phase_after(s.phase, e),
        round_seq=e.next_round,
        probes={k: False for k, hit in s.probes.items() if hit is False},
        unsent=(),
        lookup_open=False,
        lookup_deadline=None,
        loads=loads,
    )


def _transfer_done(s: ConsumerState, e: ev.TransferDone) -> ConsumerState:
    why = f"round {e.round_seq}: the transfer failed"
    worse = {} if e.success else _worse(s, ConsumerPhase.FAILED, why)
    return replace(s, seq=e.seq, loads=_without(s.loads, e.round_seq), **worse)


def _lookup_timed_out(s: ConsumerState, e: ev.LookupTimedOut) -> ConsumerState:
    worse = _worse(s, ConsumerPhase.FAILED, "the peer answered no lookup key in time")
    return replace(s, seq=e.seq, lookup_failed=True, **_NOT_ASKING, **worse)


def _fetch_skipped(s: ConsumerState, e: ev.FetchSkipped) -> ConsumerState:
    return replace(s, seq=e.seq, **({} if e.success else _worse(s, ConsumerPhase.FAILED, e.reason)))


def _abort_sent(s: ConsumerState, e: ev.AbortSent) -> ConsumerState:
    loads = {**s.loads, e.round_seq: replace(s.loads[e.round_seq], ack_deadline=e.ack_deadline)}
    worse = _worse(s, ConsumerPhase.ABORTED, f"round {e.round_seq}: {e.reason}")
    return replace(s, seq=e.seq, loads=loads, **worse)


def _aborted(s: ConsumerState, e: ev.Aborted) -> ConsumerState:
    # An abort that went out already made the outcome ABORTED; a load lost
    # with its session failed without one.
    worse = _worse(s, ConsumerPhase.FAILED, f"round {e.round_seq}: {e.reason}")
    return replace(s, seq=e.seq, loads=_without(s.loads, e.round_seq), **worse)


def _session_lost(s: ConsumerState, e: ev.SessionLost) -> ConsumerState:
    until = e.loads_held_until
    loads = s.loads
    if until is not None:
        why = f"session lost: {e.reason}; its blocks were held until no write could land"
        loads = {r: replace(load, ack_deadline=until, held=why) for r, load in loads.items()}
    return replace(s, seq=e.seq, session_lost=True, lookup_deadline=None, loads=loads)


# How each consumer event changes the state: ``evolve_consumer``'s table, without its checks of
# actor and sequence (for a caller that made them: replay).
CONSUMER_FOLDS: Final[dict[type[ev.Event], Callable[[ConsumerState, Any], ConsumerState]]] = {
    ev.Opened: lambda s, e: replace(s, seq=e.seq, round_seq=e.round_seq),
    ev.Registered: _registered_keys,
    ev.Probed: _probed,
    ev.LookupResp: _lookup_resp,
    ev.FinishRequested: lambda s, e: replace(s, seq=e.seq, finishing=True, **_NOT_ASKING),
    ev.LookupCancelled: lambda s, e: replace(
        s, seq=e.seq, phase=phase_after(s.phase, e), lookup_open=False
    ),
    ev.Finished: _finished,
    ev.FetchSent: _fetch_sent,
    ev.TransferDone: _transfer_done,
    ev.Ignored: lambda s, e: replace(s, seq=e.seq),
    ev.Rejected: lambda s, e: replace(s, seq=e.seq),
    ev.LookupTimedOut: _lookup_timed_out,
    ev.FetchSkipped: _fetch_skipped,
    ev.AbortSent: _abort_sent,
    ev.AbortAcked: lambda s, e: replace(s, seq=e.seq, loads=_without(s.loads, e.round_seq)),
    ev.Aborted: _aborted,
    ev.SessionLost: _session_lost,
}

# Apply one event to a consumer state; pure (ReplayError if it does not follow).
evolve_consumer: Callable[[ConsumerState, ev.ConsumerEvent], ConsumerState] = evolver(
    CONSUMER_FOLDS, ev.ConsumerEvent
)
