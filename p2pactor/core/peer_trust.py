"""How far a peer's claims are trusted: its precision, its failed fetches, its quarantines.

Every automatic lookup to a peer is scored once its claimed keys are answered
and their fetches are over: a key counts as held by word (the peer answered
HIT) and by deed (its fetch did not fail by the peer's doing). The peer's
precision is a moving average of that; too low, or too many failed fetches in
a row, and automatic choice skips it for a while (a quarantine, doubling each
time, up to a cap). Pure: time is an argument.
"""

from __future__ import annotations

from p2pactor.core.choice import ChoicePolicy

MAX_QUARANTINE_DOUBLINGS = 32
"""Quarantines counted for the back-off (it reached its cap long before)."""


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
