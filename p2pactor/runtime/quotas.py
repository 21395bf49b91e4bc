"""Per-peer quotas: what one peer may make this node hold, and what it holds.

A peer that is served is trusted with a share of the node: the blocks its lookups
pin, the lookups it leaves unanswered, the fetch rounds it keeps in flight and
the requests it keeps open. vLLM 0.33.0 bounds none of these per peer
(``vllm-p2p-0.33.md`` §6.1.7): one peer can pin the whole cache with lookups it
never fetches. :class:`PeerQuotas` sets the limits (``NodeConfig.quotas``);
:class:`~p2pactor.runtime.ledger.QuotaLedger` counts what each peer holds
(:class:`PeerUsage`) and turns a message over a limit into a
:class:`~p2pactor.core.inputs.OverQuota` verdict for the pure core, which records
the refusal in the event log and answers safely:

================== ============================================================
quota              past the limit
================== ============================================================
pinned blocks      hits beyond the budget are not pinned and answer MISS
                   (``KeysRefused``); checked when the parent pins, so re-polls
                   of HIT_PENDING keys that resolve later count too
open lookups       the lookup is answered at once, all MISS, nothing pinned
                   (``LookupRefused``)
keys per lookup    only the first keys are looked up, the rest answer MISS
                   (``LookupLimited``)
fetch rounds       the round fails: ``transfer_done(false)``, its pins released,
                   nothing written (``FetchRefused``)
open requests      every lookup of the new request is answered all MISS and its
                   fetches fail; it closes at once (``LookupRefused``,
                   ``FetchRefused``)
rounds per request a lookup or fetch that would open one more round in the
                   request is answered all MISS / fails (``LookupRefused``,
                   ``FetchRefused``); its rounds already open go on
================== ============================================================

Every refusal is an event (so ``p2pactor replay`` and timelines show it, with
its reason) and a log line, rate-limited per peer and quota so that a flood
cannot flood the log. A peer's counts return to zero when its session ends and
its pins are released; no other peer is ever affected.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Final

import attrs

from p2pactor.core import checks
from p2pactor.core.events import Quota
from p2pactor.errors import ConfigError


@attrs.frozen(kw_only=True)
class PeerQuotas:
    """Limits on what one peer may make this node hold at once.

    Every limit is per peer (per ``host:port``), counted across all of the
    peer's requests and sessions. The defaults protect a node from one greedy
    or hostile peer and never bother an honest vLLM-like one (why each is what
    it is: ``docs/quotas.md``); the module table says what a peer past one gets.
    Each ``max_<quota>`` limits one :class:`~p2pactor.core.events.Quota`; a
    large number makes it effectively unlimited.

    Attributes:
        max_pinned_blocks: Most blocks pinned for the peer's lookups at once;
            None (the default): ``pinned_blocks_fraction`` of the node's blocks.
        pinned_blocks_fraction: That share (a quarter), so that most of the
            cache stays for the engine and other peers.
        max_open_lookups: Most lookups received and not yet answered (1,024).
        max_keys_per_lookup: Most keys of one lookup looked up (8,192).
        max_fetch_rounds: Most fetch rounds in flight: fetched, not ended (1,024).
        max_open_requests: Most requests served at once (4,096), each open from
            its first lookup until its fetch is served or the peer closes it.
        max_rounds_per_request: Most rounds one request holds: looked up or
            fetched, not ended (16); every step of a request walks its rounds.
        log_interval: Seconds between two log lines of one peer and quota; the
            refusals in between are counted in the next line.
    """

    max_pinned_blocks: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(checks.non_negative_int)
    )
    pinned_blocks_fraction: float = attrs.field(default=0.25, validator=checks.fraction)
    max_open_lookups: int = attrs.field(default=1024, validator=checks.positive_int)
    max_keys_per_lookup: int = attrs.field(default=8192, validator=checks.positive_int)
    max_fetch_rounds: int = attrs.field(default=1024, validator=checks.positive_int)
    max_open_requests: int = attrs.field(default=4096, validator=checks.positive_int)
    max_rounds_per_request: int = attrs.field(default=16, validator=checks.positive_int)
    log_interval: float = attrs.field(default=10.0, validator=checks.non_negative(finite=False))

    def pinned_blocks_limit(self, num_blocks: int) -> int:
        """The most blocks one peer may keep pinned on a node of ``num_blocks`` blocks."""
        if self.max_pinned_blocks is not None:
            return self.max_pinned_blocks
        return max(1, int(num_blocks * self.pinned_blocks_fraction))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PeerQuotas | None:
        """The quotas set by environment variables, the defaults for the rest.

        Reads ``P2PACTOR_QUOTA_<QUOTA>`` for each ``max_<quota>`` limit, and
        ``P2PACTOR_QUOTA_PINNED_FRACTION`` (:meth:`p2pactor.runtime.config.NodeConfig.from_env`
        calls this).

        Returns:
            None when none of them is set.

        Raises:
            ConfigError: A variable is set to something unusable; the message
                names it.
        """
        env = os.environ if env is None else env
        values = checks.env_values(env, _ENV)
        if not values:
            return None
        try:
            return cls(**values)
        except ConfigError as exc:
            names = ", ".join(n for n, (f, _) in _ENV.items() if f in values)
            raise ConfigError(f"{exc} (from {names})") from None


_ENV: Final[dict[str, tuple[str, type[int] | type[float]]]] = {
    f"P2PACTOR_QUOTA_{q.value.upper()}": (f"max_{q.value}", int) for q in Quota
} | {"P2PACTOR_QUOTA_PINNED_FRACTION": ("pinned_blocks_fraction", float)}

HELD: Final = {
    Quota.PINNED_BLOCKS: "blocks pinned",
    Quota.OPEN_LOOKUPS: "lookups unanswered",
    Quota.FETCH_ROUNDS: "fetch rounds in flight",
    Quota.OPEN_REQUESTS: "requests open",
}
"""What a peer holds, counted per peer, by the quota that bounds it (for refusals)."""


DEFAULT_QUOTAS: Final = PeerQuotas()
"""The quotas a node enforces unless configured otherwise."""


@attrs.frozen(kw_only=True)
class PeerUsage:
    """What one peer holds on this node right now, and what it was refused.

    Attributes:
        pinned_blocks: Blocks pinned for its lookups and not yet released.
        peak_pinned_blocks: The most it ever had pinned at once.
        open_lookups: Its lookups received and not yet answered.
        fetch_rounds: Its fetch rounds in flight.
        open_requests: Its requests being served (live producer actors).
        refusals: Refusals so far, by quota (``{"pinned_blocks": 12}``).
    """

    pinned_blocks: int = 0
    peak_pinned_blocks: int = 0
    open_lookups: int = 0
    fetch_rounds: int = 0
    open_requests: int = 0
    refusals: Mapping[str, int] = attrs.field(factory=dict)

    @property
    def holds_nothing(self) -> bool:
        """Whether the peer holds nothing on the node (its counts are all zero)."""
        return not any(getattr(self, quota.value) for quota in HELD)

    def to_json(self) -> str:
        """The usage as one line of JSON (``p2pactor serve`` prints it at exit)."""
        return json.dumps(attrs.asdict(self), sort_keys=True)
