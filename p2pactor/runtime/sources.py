"""How a node finds sources by itself: its options, the choice on its thread, the lookups followed.

:class:`SourceOptions`, the ``sources`` field of
:class:`~p2pactor.runtime.config.NodeConfig`, says how this node tells peers
what it holds and picks a source for a request that names none. The policy
parts come from the core (:class:`~p2pactor.core.choice.ChoicePolicy`,
:class:`~p2pactor.core.sources.holdings.SummaryOptions`); this adds what the runtime
does with them. See ``docs/sources.md``.

:class:`AutoChoice` is the part of the
:class:`~p2pactor.runtime.directory.SourceDirectory` that picks the peer worth
a lookup for a request that names none, publishes the choice to the engine's
thread, and follows the lookups it starts (:class:`AutoProbe`). A chosen
peer is scored on what its claims were worth
(:meth:`~p2pactor.core.sources.SourceIndex.score`): a claimed key it answered
MISS for is false at once; a key it answered HIT for counts as held only once
the request is over and no fetch of it failed by the peer's deed (the peer
reported the transfer failed, it never reported it, or its session went
down). A peer that answers HIT to everything and then fails every fetch is
as false as one that answers MISS; and a few failed fetches in a row
quarantine it whatever its precision (``ChoicePolicy.max_failed_fetches``). A load the
engine gave up first (it finished the request while the load was in flight)
says nothing of the peer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Final

import attrs
import msgspec

from p2pactor.core import checks
from p2pactor.core import events as ev
from p2pactor.core.choice import Choice, ChoicePolicy
from p2pactor.core.consumer import ConsumerState, probe_answers
from p2pactor.core.inputs import LookupResult
from p2pactor.core.sources import BYTES_PER_CLAIM, SourceIndex, fingerprint
from p2pactor.core.sources.holdings import SummaryOptions
from p2pactor.runtime.actor import RequestActor

if TYPE_CHECKING:
    from p2pactor.runtime.directory import DirectoryCounts

log = logging.getLogger("p2pactor.sources")

_MAX_DECISIONS = 1 << 16  # a bound, not a policy: every request's finish forgets its own
# A positive finite rate, or None (no limit).
_rate: checks.Validator = attrs.validators.optional(checks.positive(finite=True))


@attrs.frozen(kw_only=True)
class SourceOptions:
    """How this node tells peers what it holds, and picks a source for a request that names none.

    Attributes:
        share: Exchange summaries (the ``kvsum/1`` extension) with p2pactor
            peers that offer it: tell them which keys this node's engine holds
            and keep what they tell us. Off, the node neither sends nor reads
            them, and :meth:`~p2pactor.runtime.node.Node.locate` finds nothing.
            Stock vLLM peers never see the extension either way.
        choice: When a peer's claim is trusted and worth a lookup.
        summary: How changes are batched into deltas and snapshots split.
        part_interval_s: Seconds between two parts of one snapshot to one
            peer, so the lookups that share its socket never wait behind a
            whole snapshot.
        recorded_claims: Claims recorded with a choice (the best ones).
        refresh_s: Seconds between two whole snapshots to every summary peer
            (0: only on session ready, a resync or a new epoch). A receiver's
            copy may drift where nothing shows a gap (it dropped a claim its
            lookup found false, which we still hold); a refresh makes it
            exact again, at 8 bytes a held key per peer per refresh.
        resync_interval_s: The least time between two snapshots sent to one
            peer because it asked (``kvsum_resync``). A resync that comes
            sooner is answered when the interval ends, and one that comes
            while a snapshot to that peer is still being sent is answered by
            it: however often a peer asks, it costs one snapshot an interval.
        peer_budget_bytes: What one summary peer's messages may make this node
            hold, whatever the peer registers or sends: an eighth for its
            messages waiting to be applied (:attr:`max_queued_bytes_per_peer`;
            past it they are dropped as a flood and its summary asked
            again), the rest for its claims, the snapshot being assembled
            and the deltas buffered meanwhile, at
            :data:`~p2pactor.core.sources.BYTES_PER_CLAIM` each. A peer that
            registered more blocks than that buys is kept to
            :attr:`max_claims_per_peer` of them (logged once), and claims
            past it are cut and struck. 64 MiB keeps 1,223,338 claims and
            8 MiB of waiting messages.
        peer_work_fps_per_s: Fingerprints of one peer's summaries this node
            applies a second, at most (about a quarter of a microsecond each:
            500,000 is an eighth of its thread); past it the peer's messages
            wait, and are dropped as a flood once they fill its share of the
            budget. An honest peer's deltas are tens of thousands of changes
            a second at most, its snapshot of a million keys two seconds. None:
            no limit.
    """

    share: bool = attrs.field(default=True, validator=checks.instance_of(bool))
    choice: ChoicePolicy = attrs.field(
        factory=ChoicePolicy, validator=checks.instance_of(ChoicePolicy)
    )
    summary: SummaryOptions = attrs.field(
        factory=SummaryOptions, validator=checks.instance_of(SummaryOptions)
    )
    part_interval_s: float = attrs.field(default=0.01, validator=checks.non_negative(finite=True))
    recorded_claims: int = attrs.field(default=8, validator=checks.positive_int)
    refresh_s: float = attrs.field(default=300.0, validator=checks.non_negative(finite=True))
    resync_interval_s: float = attrs.field(default=1.0, validator=checks.non_negative(finite=True))
    peer_budget_bytes: int = attrs.field(default=64 << 20, validator=checks.positive_int)
    peer_work_fps_per_s: float | None = attrs.field(default=500_000.0, validator=_rate)

    @property
    def max_queued_bytes_per_peer(self) -> int:
        """What one peer's summary messages waiting to be applied may hold: an eighth of it all."""
        return self.peer_budget_bytes // 8

    @property
    def max_claims_per_peer(self) -> int:
        """The most claims kept of one peer: what is left of :attr:`peer_budget_bytes` buys them."""
        return max(1, (self.peer_budget_bytes - self.max_queued_bytes_per_peer) // BYTES_PER_CLAIM)


# Summaries on, the core's default policy.
DEFAULT_SOURCES: Final = SourceOptions()


class Decision(msgspec.Struct, frozen=True, gc=False):
    """The choice made for an engine's request that names no source.

    Attributes:
        peer: The peer asked, or None: nobody (every key is a MISS).
        asked: How many of the request's keys (its first ones) were asked.
    """

    peer: str | None
    asked: int


class AutoProbe(msgspec.Struct, gc=False):
    """A lookup the directory chose: its claimed keys, then what came of its hits.

    Attributes:
        peer: The chosen peer.
        claimed: The keys asked that its summary claimed.
        answered: Whether the claimed keys are answered (and scored as such).
        held: Claimed keys answered HIT.
        counted: Claimed keys that are scored (a quota's refusals are not).
        fetched: Fetches out: job -> keys.
        failed: Keys of fetches the peer failed; ``failed_jobs``: those fetches.
        delivered: Fetches it delivered.
        ended: Whether the request finished.
    """

    peer: str
    claimed: tuple[bytes, ...]
    answered: bool = False
    held: int = 0
    counted: int = 0
    fetched: dict[int, int] = msgspec.field(default_factory=dict)
    failed: int = 0
    failed_jobs: int = 0
    delivered: int = 0
    ended: bool = False

    def answer(self, answers: Sequence[LookupResult], refused: frozenset[bytes]) -> list[int]:
        """The claimed keys are answered; the fingerprints of the false claims (a MISS).

        A HIT awaits its fetch; a quota's refusal says nothing of what the peer holds.
        """
        self.answered = True
        self.held = answers.count(LookupResult.HIT)
        self.counted = len(self.claimed) - sum(1 for k in self.claimed if k in refused)
        return [
            fingerprint(k)
            for k, a in zip(self.claimed, answers, strict=True)
            if a is not LookupResult.HIT and k not in refused
        ]

    def follow(self, events: Iterable[ev.AnyEvent]) -> None:
        """Take in the request's new events: its fetches and how they ended."""
        fetched = self.fetched
        for event in events:
            match event:
                case ev.FetchSent(job_id=job, keys=keys):
                    fetched[job] = len(keys)
                case ev.TransferDone(job_id=job, success=True):
                    self.delivered += job in fetched
                    fetched.pop(job, None)
                case (
                    ev.TransferDone(job_id=job) | ev.Aborted(job_id=job) | ev.AbortAcked(job_id=job)
                ):
                    if job in fetched:
                        self.failed += fetched.pop(job)
                        self.failed_jobs += 1
                case ev.FinishRequested():
                    fetched.clear()  # the engine gave up its loads: not the peer's doing
                case ev.Finished():
                    self.ended = True
                case _:
                    pass

    @property
    def held_by_deed(self) -> int:
        """The claimed keys that turned out held: answered HIT, and no fetch of them failed."""
        return max(0, self.held - self.failed)


class AutoChoice:
    """The choice for requests that name no source, and the lookups it starts followed.

    Attributes:
        auto: The lookups followed, by their request's actor.
        decisions: The choices published, by ``kv_request_id`` (read by engine
            threads: one dict lookup, or a pop, atomic).
    """

    options: SourceOptions
    index: SourceIndex
    counts: DirectoryCounts
    auto: dict[RequestActor, AutoProbe]
    decisions: dict[str, Decision]
    _clock: Callable[[], float]

    def _arm(self) -> None:
        raise NotImplementedError

    def choose(self, keys: Sequence[bytes]) -> Choice:
        """The peer to look up for a request's ``keys`` (in order), and why."""
        most = self.options.recorded_claims
        choice = self.index.choose([fingerprint(k) for k in keys], self._clock(), most=most)
        counts = self.counts
        if choice.chosen is not None:
            counts.chosen += 1
        elif choice.claims:
            counts.not_worth += 1
        else:
            counts.unclaimed += 1
        return choice

    def decided(self, kv_request_id: str, decision: Decision) -> None:
        """Publish the choice for an engine's request (its thread reads :meth:`decision`)."""
        decisions = self.decisions
        if len(decisions) >= _MAX_DECISIONS:
            del decisions[next(iter(decisions))]
        decisions[kv_request_id] = decision

    def decision(self, kv_request_id: str) -> Decision | None:
        """The choice made for ``kv_request_id``, None while it is being made. Any thread."""
        return self.decisions.get(kv_request_id)

    def finished(self, kv_request_id: str) -> None:
        """The engine is done with ``kv_request_id``: forget its choice."""
        self.decisions.pop(kv_request_id, None)

    def probe_started(self, actor: RequestActor, choice: Choice, keys: Sequence[bytes]) -> None:
        """A lookup of ``keys`` went to ``choice.chosen`` through ``actor``; follow it."""
        assert choice.chosen is not None
        run = choice.claims[0].run if choice.claims else len(keys)
        claimed = tuple(keys[:run])
        if actor in self.auto:
            return  # the request asked again: its first probe is the one measured
        self.auto[actor] = AutoProbe(choice.chosen, claimed)
        self.index.probe_started(choice.chosen)
        self.counts.probed_keys += len(claimed)

    def stepped(self, actor: RequestActor, events: Sequence[ev.AnyEvent]) -> None:
        """``actor`` (of :attr:`auto`) stepped: score its answers, then its fetches' outcome."""
        probe, counts, index = self.auto[actor], self.counts, self.index
        probe.follow(events)
        if not probe.answered:
            state = actor.state
            assert isinstance(state, ConsumerState)
            answers = probe_answers(state, probe.claimed)
            if LookupResult.RETRY in answers and not actor.done:
                return
            missed = probe.answer(answers, state.refused)
            counts.false_claims += len(missed)
            counts.refused_claims += len(probe.claimed) - probe.counted
            index.missed(probe.peer, missed)
            index.probe_answered(probe.peer)
        if probe.held > 0 and not (probe.ended or actor.done):
            return  # its hits are scored once their fetches are over
        del self.auto[actor]
        counts.undelivered_claims += min(probe.held, probe.failed)
        now = self._clock()
        quarantined = index.score(probe.peer, probe.counted, probe.held_by_deed, now)
        if probe.delivered or probe.failed_jobs:
            quarantined |= index.fetches_ended(
                probe.peer, delivered=probe.delivered, failed=probe.failed_jobs, now=now
            )
        if quarantined:
            log.warning(
                "%s's summary claims keys it does not deliver (%d of %d probed held); not "
                "choosing it automatically for a while (it stays usable as a named source)",
                probe.peer,
                probe.held_by_deed,
                probe.counted,
            )
            self._arm()  # its claims count again when the quarantine ends
