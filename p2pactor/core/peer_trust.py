"""How far a peer's claims are trusted: its precision, its failed fetches, its quarantines.

Every automatic lookup to a peer is scored once its claimed keys are answered
and their fetches are over: a key counts as held by word (the peer answered
HIT) and by deed (its fetch did not fail by the peer's doing). The peer's
precision is a moving average of that; too low, or too many failed fetches in
a row, and automatic choice skips it for a while (a quarantine, doubling each
time, up to a cap). Pure: time is an argument.
"""

from __future__ import annotations

from collections.abc import Mapping

from p2pactor.core.choice import ChoicePolicy

# Quarantines counted for the back-off (it reached its cap long before).
MAX_QUARANTINE_DOUBLINGS = 32


class PeerTrust:
    """One peer's record: precision, probes in flight, failed fetches, quarantines."""

    __slots__ = (
        "failed_fetches",
        "in_flight",
        "precision",
        "probed",
        "quarantined_until",
        "quarantines",
    )

    def __init__(self) -> None:
        self.precision = 1.0
        self.probed = 0
        self.in_flight = 0
        self.failed_fetches = 0  # in a row
        self.quarantines = 0
        self.quarantined_until = 0.0

    def score(self, claimed: int, held: int, now: float, policy: ChoicePolicy) -> bool:
        """``held`` of ``claimed`` keys held; whether that quarantined the peer now.

        Scores that come during a quarantine count for nothing: the burst
        that caused it is one quarantine, not several.
        """
        if claimed <= 0 or now < self.quarantined_until:
            return False
        keep = (1.0 - policy.precision_weight) ** claimed
        share = max(0, min(held, claimed)) / claimed
        self.precision = self.precision * keep + share * (1.0 - keep)
        self.probed += claimed
        if self.probed >= policy.min_probed_keys and self.precision < policy.min_precision:
            self._quarantine(now, policy)
            return True
        return False

    def fetches_ended(self, delivered: int, failed: int, now: float, policy: ChoicePolicy) -> bool:
        """One request's fetches ended; whether failures in a row quarantined the peer now."""
        if now < self.quarantined_until:
            return False
        if delivered:
            self.failed_fetches = 0
        self.failed_fetches += failed
        if self.failed_fetches >= policy.max_failed_fetches:
            self._quarantine(now, policy)
            return True
        return False

    def _quarantine(self, now: float, policy: ChoicePolicy) -> None:
        doublings = min(self.quarantines, MAX_QUARANTINE_DOUBLINGS)
        span = min(policy.max_quarantine_s, policy.quarantine_s * 2.0**doublings)
        self.quarantines += 1
        self.quarantined_until = now + span
        # After the quarantine it starts over, with the back-off remembered.
        self.precision, self.probed, self.failed_fetches = 1.0, 0, 0


class Trust:
    """The index's side of trust: probes in flight, scores, quarantines and their ends.

    A base of :class:`~p2pactor.core.sources.SourceIndex`, which keeps the records.

    Attributes:
        policy: How claims are trusted.
    """

    policy: ChoicePolicy
    _peers: Mapping[str, PeerTrust]
    # The quarantined peers, replaced whole (read by engine threads): a key
    # only they claim is unclaimed, a MISS with no wait.
    _excluded: frozenset[str]

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
        found = self._peers.get(peer)
        return found.precision if found is not None else 1.0

    def quarantined(self, peer: str, now: float) -> bool:
        """Whether automatic choice skips ``peer`` at ``now``."""
        found = self._peers.get(peer)
        return found is not None and now < found.quarantined_until

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
        too few of its claims hold (:class:`~p2pactor.core.peer_trust.PeerTrust`);
        returns whether it did.
        """
        found = self._peers.get(peer)
        return found is not None and self._excluding(
            peer, found.score(claimed, held, now, self.policy)
        )

    def fetches_ended(self, peer: str, *, delivered: int, failed: int, now: float) -> bool:
        """Fetches of ``peer``'s hits for one request ended: ``delivered`` did, ``failed`` not.

        Besides the precision (:meth:`score`): a peer whose fetches keep
        failing is quarantined after ``max_failed_fetches`` in a row, however
        few keys each carried. Returns whether this quarantined it.
        """
        found = self._peers.get(peer)
        quarantined = found is not None and found.fetches_ended(delivered, failed, now, self.policy)
        return self._excluding(peer, quarantined)

    def _excluding(self, peer: str, quarantined: bool) -> bool:
        if quarantined:  # replaced whole: engine threads read it
            self._excluded = self._excluded | {peer}
        return quarantined
