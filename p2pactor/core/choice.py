"""The choice of a source for a request that names none: its policy and its record.

:class:`ChoicePolicy` is the tier's configuration of how claims are weighed;
:class:`Choice` (with one :class:`Claim` per peer) is what
:meth:`~p2pactor.core.sources.SourceIndex.choose` decides, and what the
consumer's ``Probed`` event records; :func:`choose` decides it. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import msgspec

from p2pactor.core import checks

if TYPE_CHECKING:
    from p2pactor.core.fparrays import FpArray
    from p2pactor.core.sources import _Peer


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


def choose(
    policy: ChoicePolicy,
    wanted: FpArray,
    now: float,
    *,
    columns: Sequence[int],
    runs: Sequence[int],
    names: Mapping[int, str],
    peers: Mapping[str, _Peer],
    most: int | None,
) -> Choice:
    """The peer to look up for a request whose keys are ``wanted``, in order.

    ``columns`` and ``runs`` are the filter's candidates (by column, ``names``
    their peers) and their runs, each as long as its claims make it or longer
    (a "maybe" past the run's end); the best is checked against its exact
    claims, and cut down, until the best is one checked: the choice is exact,
    the other claims are as the filter reads them. ``most``: how many claims
    the choice records (the best; all with None).
    """
    most_probes = policy.max_probes_per_peer
    per_key = policy.tokens_per_key * policy.prefill_s_per_token
    cost, load = policy.round_trip_s, policy.load_s
    scored: list[tuple[float, int, str, int]] = []  # (-score, -run, peer, run): best first
    skipped = False
    for column, run in zip(columns, runs, strict=True):
        peer = names.get(column)
        if peer is None:
            continue
        found = peers[peer]
        if now < found.quarantined_until or found.in_flight >= most_probes:
            skipped = True
            continue
        # This loop runs for every peer claiming the first key: the score inline.
        score = run * per_key * found.precision - cost - load * found.in_flight
        scored.append((-score, -run, peer, run))
    checked: set[str] = set()
    while scored:
        best = min(scored)
        peer = best[2]
        if peer in checked:
            break
        checked.add(peer)
        found = peers[peer]
        held = found.summary.claims.mask(wanted[: best[3]])
        run = best[3] if held.all() else int(held.argmin())
        if run < best[3]:
            scored.remove(best)
            if run:
                saved = run * policy.tokens_per_key * policy.prefill_s_per_token
                score = saved * found.precision - cost - load * found.in_flight
                scored.append((-score, -run, peer, run))
    if not scored:
        if skipped:
            return Choice(None, 0, (), "every peer claiming the first key is quarantined or busy")
        return Choice(None, 0, (), "no peer claims the first key")
    scored.sort()
    claims = tuple(
        Claim(peer, run, peers[peer].precision, -score) for score, _, peer, run in scored[:most]
    )
    best_claim = claims[0]
    if best_claim.score <= 0:
        return Choice(None, 0, claims, "no claimed run is worth a round trip")
    keys = min(len(wanted), best_claim.run + policy.tail_keys)
    reason = f"longest worthwhile run: {best_claim.run} of {len(wanted)} keys"
    return Choice(best_claim.peer, keys, claims, reason)
