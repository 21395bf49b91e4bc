"""The choice of a source for a request that names none: its policy, its record, each peer's trust.

:class:`ChoicePolicy` is the tier's configuration of how claims are weighed;
:class:`Choice` (with one :class:`Claim` per peer) is what
:meth:`~p2pactor.core.sources.SourceIndex.choose` decides (:class:`Trust` does), and
what the consumer's ``Probed`` event records.

How far a peer's claims are trusted (:class:`Trust`): every automatic lookup
to a peer is scored once its claimed keys are answered and their fetches are
over: a key counts as held by word (the peer answered HIT) and by deed (its
fetch did not fail by the peer's doing). The peer's precision is a moving
average of that; too low, or too many failed fetches in a row, and automatic
choice skips it for a while (a quarantine, doubling each time, up to a cap).
Pure: time is an argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import msgspec
import numpy as np

from p2pactor.core import checks

if TYPE_CHECKING:
    from p2pactor.core.sources.filter import ClaimFilter
    from p2pactor.core.sources.peer import PeerClaims


@attrs.frozen
class ChoicePolicy:
    """How claims are trusted and when a lookup is worth sending (the tier's config).

    A peer's score for a request is the seconds of prefill its claimed run
    saves, times its precision, less its round trip and its load; the best
    peer is probed only if its score is above zero.

    Attributes:
        tokens_per_key: Tokens one key (a chunk) stands for.
        prefill_s_per_token: Seconds of prefill one token costs here.
        round_trip_s: What a lookup costs before anything is saved.
        load_s: Seconds of score each probe already in flight to a peer costs it.
        max_probes_per_peer: Automatic lookups in flight to one peer, at most.
        min_probed_keys: Probed keys before a peer's precision can quarantine it.
        min_precision: A peer whose claims hold less often than this is quarantined.
        precision_weight: Weight of each probed key in the precision's moving
            average. Small: an honest peer's claims fail in bursts (a whole
            conversation evicted before its delta went out), and one burst
            must not quarantine it; a liar misses on every probe, and a few
            probes of a long run are enough.
        max_failed_fetches: Fetches of a peer's hits in a row that may fail (it
            reported the transfer failed, never reported it, or its session
            went down) before it is quarantined, whatever its precision.
        quarantine_s: The first quarantine; each next one doubles, up to ``max_quarantine_s``.
        max_quarantine_s: The longest quarantine.
        tail_keys: Keys asked past a peer's claimed run (stores it made since
            its last delta).
    """

    tokens_per_key: int = attrs.field(default=256, validator=checks.positive_int)
    prefill_s_per_token: float = attrs.field(default=50e-6, validator=checks.positive(finite=True))
    round_trip_s: float = attrs.field(default=0.003, validator=checks.non_negative(finite=True))
    load_s: float = attrs.field(default=0.001, validator=checks.non_negative(finite=True))
    max_probes_per_peer: int = attrs.field(default=32, validator=checks.positive_int)
    min_probed_keys: int = attrs.field(default=100, validator=checks.positive_int)
    min_precision: float = attrs.field(default=0.5, validator=checks.fraction)
    precision_weight: float = attrs.field(default=0.005, validator=checks.fraction)
    max_failed_fetches: int = attrs.field(default=4, validator=checks.positive_int)
    quarantine_s: float = attrs.field(default=60.0, validator=checks.positive(finite=True))
    max_quarantine_s: float = attrs.field(default=3600.0, validator=checks.positive(finite=True))
    tail_keys: int = attrs.field(default=2, validator=checks.non_negative_int)


class Claim(msgspec.Struct, frozen=True, gc=False):
    """What one peer claimed of a request: its contiguous run from the first key."""

    peer: str
    run: int
    precision: float
    score: float


class Choice(msgspec.Struct, frozen=True, gc=False):
    """The source chosen for a request, and why (what the runtime records as an event).

    Attributes:
        chosen: The peer to look up, or None (every key is a MISS at once).
        keys: How many of the request's keys to ask it (its run, plus
            ``tail_keys`` it may have stored since its last delta).
        claims: Every live peer's claim, best first.
        reason: Why, in words.
    """

    chosen: str | None
    keys: int
    claims: tuple[Claim, ...]
    reason: str


# Quarantines counted for the back-off (it reached its cap long before).
MAX_QUARANTINE_DOUBLINGS = 32


@attrs.define(eq=False, kw_only=True)
class PeerTrust:
    """One peer's record: precision, probes in flight, failed fetches, quarantines."""

    precision: float = 1.0
    probed: int = 0
    in_flight: int = 0
    # Failed in a row.
    failed_fetches: int = 0
    quarantines: int = 0
    quarantined_until: float = 0.0


class Trust:
    """The index's side of the choice: probes in flight, scores, quarantines, the choice itself.

    A base of :class:`~p2pactor.core.sources.SourceIndex`, which keeps the records.

    Attributes:
        policy: How claims are trusted.
    """

    policy: ChoicePolicy
    _peers: Mapping[str, PeerClaims]
    _filter: ClaimFilter
    _columns: Mapping[int, str]  # the filter's column -> its peer
    # The quarantined peers, replaced whole (read by engine threads): a key
    # only they claim is unclaimed, a MISS with no wait.
    _excluded: frozenset[str]
    _nobody: PeerClaims  # what is read of a peer with no record here

    def next_release(self) -> float | None:
        """When the first quarantine ends (None: no peer is quarantined)."""
        peers = self._peers
        ends = [peers[p].quarantined_until for p in self._excluded if p in peers]
        return min(ends, default=None)

    def release(self, now: float) -> None:
        """End the quarantines that are over at ``now``: their claims count again."""
        if self._excluded:
            peers = self._peers
            self._excluded = frozenset(
                p for p in self._excluded if p in peers and now < peers[p].quarantined_until
            )

    def precision(self, peer: str) -> float:
        """How often ``peer``'s probed claims held (a moving average; 1.0 before any)."""
        return self._peers.get(peer, self._nobody).precision

    def quarantined(self, peer: str, now: float) -> bool:
        """Whether automatic choice skips ``peer`` at ``now``."""
        return now < self._peers.get(peer, self._nobody).quarantined_until

    def probe_started(self, peer: str) -> None:
        """An automatic lookup to ``peer`` was sent."""
        found = self._peers.get(peer)
        if found is not None:
            found.in_flight += 1

    def probe_ended(self, peer: str, claimed: int, hits: int, now: float) -> None:
        """An automatic lookup to ``peer`` ended: ``hits`` of the ``claimed`` keys it asked held.

        :meth:`probe_answered`, then :meth:`score`.
        """
        self.probe_answered(peer)
        self.score(peer, claimed, hits, now)

    def probe_answered(self, peer: str) -> None:
        """An automatic lookup to ``peer`` has its answers (or never will): no longer in flight."""
        found = self._peers.get(peer)
        if found is not None:
            found.in_flight = max(0, found.in_flight - 1)

    def score(self, peer: str, claimed: int, held: int, now: float) -> bool:
        """``held`` of ``claimed`` keys ``peer`` claimed turned out held (by answer and deed).

        A failed lookup (no answer) is ``held=0``; so is a HIT whose fetch the
        peer then failed. Updates the peer's precision and quarantines it when
        too few of its claims hold; returns whether it did. Scores that come
        during a quarantine count for nothing: the burst that caused it is one
        quarantine, not several.
        """
        found, policy = self._peers.get(peer), self.policy
        if found is None or claimed <= 0 or now < found.quarantined_until:
            return False
        keep = (1.0 - policy.precision_weight) ** claimed
        share = max(0, min(held, claimed)) / claimed
        found.precision = found.precision * keep + share * (1.0 - keep)
        found.probed += claimed
        low = found.precision < policy.min_precision
        return found.probed >= policy.min_probed_keys and low and self._quarantine(peer, now)

    def fetches_ended(self, peer: str, *, delivered: int, failed: int, now: float) -> bool:
        """Fetches of ``peer``'s hits for one request ended: ``delivered`` did, ``failed`` not.

        Besides the precision (:meth:`score`): a peer whose fetches keep
        failing is quarantined after ``max_failed_fetches`` in a row, however
        few keys each carried. Returns whether this quarantined it.
        """
        found = self._peers.get(peer)
        if found is None or now < found.quarantined_until:
            return False
        if delivered:
            found.failed_fetches = 0
        found.failed_fetches += failed
        failing = found.failed_fetches >= self.policy.max_failed_fetches
        return failing and self._quarantine(peer, now)

    def _quarantine(self, peer: str, now: float) -> bool:
        found, policy = self._peers[peer], self.policy
        doublings = min(found.quarantines, MAX_QUARANTINE_DOUBLINGS)
        found.quarantines += 1
        span = min(policy.max_quarantine_s, policy.quarantine_s * 2.0**doublings)
        found.quarantined_until = now + span
        # After the quarantine it starts over, with the back-off remembered.
        found.precision, found.probed, found.failed_fetches = 1.0, 0, 0
        self._excluded = self._excluded | {peer}  # replaced whole: engine threads read it
        return True

    def choose(self, fps: Sequence[int], now: float, *, most: int | None = None) -> Choice:
        """The peer to look up for a request whose keys are ``fps``, in order.

        The filter names the columns that may claim the first key and their
        runs, each as long as its claims make it or longer (a "maybe" past
        the run's end); the best is checked against its exact claims, and cut
        down, until the best is one checked: the choice is exact, the other
        claims are as the filter reads them. ``most``: how many claims the
        choice records (the best; all by default).
        """
        if not len(fps):
            return Choice(None, 0, (), "no keys")
        self.release(now)
        wanted = np.asarray(fps, np.uint64)
        policy, peers, names = self.policy, self._peers, self._columns
        per_key = policy.tokens_per_key * policy.prefill_s_per_token
        cost, load = policy.round_trip_s, policy.load_s
        scored: list[tuple[float, int, str, int]] = []  # (-score, -run, peer, run): best first
        skipped = False
        for column, run in zip(*(c.tolist() for c in self._filter.runs(wanted)), strict=True):
            peer = names.get(column)
            if peer is None:
                continue
            found = peers[peer]
            if now < found.quarantined_until or found.in_flight >= policy.max_probes_per_peer:
                skipped = True
            else:  # for every peer claiming the first key: the score inline
                score = run * per_key * found.precision - cost - load * found.in_flight
                scored.append((-score, -run, peer, run))
        checked: set[str] = set()
        while scored and (best := min(scored))[2] not in checked:
            peer, run = best[2:]
            checked.add(peer)
            found = peers[peer]
            held = found.claims.mask(wanted[:run])
            if not held.all():
                scored.remove(best)
                if run := int(held.argmin()):
                    score = run * per_key * found.precision - cost - load * found.in_flight
                    scored.append((-score, -run, peer, run))
        if not scored:
            quarantined = "every peer claiming the first key is quarantined or busy"
            return Choice(None, 0, (), quarantined if skipped else "no peer claims the first key")
        scored.sort()
        claims = tuple(Claim(p, run, peers[p].precision, -s) for s, _, p, run in scored[:most])
        best_claim = claims[0]
        if best_claim.score <= 0:
            return Choice(None, 0, claims, "no claimed run is worth a round trip")
        keys = min(len(wanted), best_claim.run + policy.tail_keys)
        reason = f"longest worthwhile run: {best_claim.run} of {len(wanted)} keys"
        return Choice(best_claim.peer, keys, claims, reason)
