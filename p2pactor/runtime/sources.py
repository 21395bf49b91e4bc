"""How a node finds sources by itself: its options, what it counts, the lookups it follows.

:class:`SourceOptions`, the ``sources`` field of
:class:`~p2pactor.runtime.config.NodeConfig`, says how this node tells peers
what it holds and picks a source for a request that names none. The policy
parts come from the core (:class:`~p2pactor.core.choice.ChoicePolicy`,
:class:`~p2pactor.core.sources.holdings.SummaryOptions`); this adds what the runtime
does with them. See ``docs/sources.md``.

:class:`DirectoryCounts` is what the
:class:`~p2pactor.runtime.directory.SourceDirectory` did, :class:`SummaryPeer`
a session it sends summaries on, :class:`AutoProbe` a lookup it started,
followed until it says what the peer's claims were worth: a claimed key it
answered MISS for is false at once; a key it answered HIT for counts as held
only once the request is over and no fetch of it failed by the peer's deed
(the peer reported the transfer failed, it never reported it, or its session
went down). A load the engine gave up first (it finished the request while
the load was in flight) says nothing of the peer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final, Protocol

import attrs
import msgspec

from p2pactor.core import checks
from p2pactor.core import events as ev
from p2pactor.core import protocol as wire
from p2pactor.core.choice import ChoicePolicy
from p2pactor.core.inputs import LookupResult
from p2pactor.core.sources import BYTES_PER_CLAIM, fingerprint
from p2pactor.core.sources.holdings import SummaryOptions

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


@attrs.define
class DirectoryCounts:
    """What the directory did, for metrics and the demo's table (totals since start).

    Attributes:
        chosen: Requests sent to a peer by automatic choice.
        unclaimed: Requests no live peer claimed: a MISS at once.
        not_worth: Requests a peer claimed, but not enough to be worth a round trip.
        probed_keys: Claimed keys asked of chosen peers.
        false_claims: Of those, the keys the peer answered MISS for (or never
            answered), refusals aside.
        refused_claims: Of those, the keys the peer refused over a quota.
        undelivered_claims: Of those, the keys answered HIT and then not delivered.
        bytes_sent: Summary bytes sent (fingerprints, 8 per key), to all peers.
        summary_floods: Times a peer's summary messages came faster than they
            were applied, and were dropped.
    """

    chosen: int = 0
    unclaimed: int = 0
    not_worth: int = 0
    probed_keys: int = 0
    false_claims: int = 0
    refused_claims: int = 0
    undelivered_claims: int = 0
    deltas_sent: int = 0
    parts_sent: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    resyncs_sent: int = 0
    summary_floods: int = 0


class SummaryPeer(Protocol):
    """A session summaries go over (a :class:`~p2pactor.runtime.session.PeerSession`)."""

    @property
    def peer_id(self) -> str:
        """The peer's id."""
        ...

    def send(self, msg: wire.Message) -> None:
        """Queue ``msg`` for the peer; never blocks."""


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
                    self.delivered += fetched.pop(job, None) is not None
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

    @property
    def held_by_deed(self) -> int:
        """The claimed keys that turned out held: answered HIT, and no fetch of them failed."""
        return max(0, self.held - self.failed)
