"""How a node finds sources by itself: summaries it exchanges, and how it chooses.

One frozen value, :class:`SourceOptions`, the ``sources`` field of
:class:`~p2pactor.runtime.config.NodeConfig`. The policy parts come from the
core (:class:`~p2pactor.core.sources.ChoicePolicy`,
:class:`~p2pactor.core.holdings.SummaryOptions`); this adds what the runtime
does with them. See ``docs/sources.md``.
"""

from __future__ import annotations

from typing import Any, Final

import attrs

from p2pactor.core import checks
from p2pactor.core.choice import ChoicePolicy
from p2pactor.core.holdings import SummaryOptions
from p2pactor.core.sources import BYTES_PER_CLAIM

_positive_rate = checks.positive(finite=True)


def _rate(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A positive finite rate, or None (no limit)."""
    if value is not None:
        _positive_rate(instance, attribute, value)


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
