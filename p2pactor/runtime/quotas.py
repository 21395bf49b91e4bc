"""Per-peer quotas: what one peer may make this node hold, and what it holds.

A peer that is served is trusted with a share of the node: the blocks its lookups
pin, the lookups it leaves unanswered, the fetch rounds it keeps in flight and
the requests it keeps open. vLLM 0.33.0 bounds none of these per peer
(``vllm-p2p-0.33.md`` §6.1.7): one peer can pin the whole cache with lookups it
never fetches. :class:`PeerQuotas` sets the limits (``NodeConfig.quotas``);
:class:`QuotaLedger` counts what each peer holds
(:class:`PeerUsage`) and turns a message over a limit into a
:class:`~p2pactor.core.inputs.OverQuota` verdict for the pure core, which records
the refusal in the event log and answers safely (what a peer past each limit
gets: ``docs/quotas.md``).

Every refusal is an event (so ``p2pactor replay`` and timelines show it, with
its reason) and a log line, rate-limited per peer and quota so that a flood
cannot flood the log. A peer's counts return to zero when its session ends and
its pins are released; no other peer is ever affected.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import Final

import attrs

from p2pactor.core import checks
from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.events import Quota
from p2pactor.core.producer import ProducerState
from p2pactor.core.producer_state import RoundState
from p2pactor.errors import ConfigError
from p2pactor.runtime.logcontext import Throttle, request_context

log = logging.getLogger("p2pactor.quotas")


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


_REMEMBERED_PEERS: Final = 4096
"""Peers whose counts the ledger keeps before it forgets those holding nothing."""


@attrs.define(eq=False)
class _Peer:
    """One peer's counts (mutable, runtime only)."""

    held: Counter[Quota] = attrs.field(factory=Counter)  # by the quotas of HELD
    peak_pinned: int = 0
    refusals: Counter[Quota] = attrs.field(factory=Counter)
    said: dict[Quota, Throttle] = attrs.field(factory=dict)  # its refusals' log lines


@attrs.define(eq=False)
class _Request:
    """What one producer request of a peer holds as of its last observed state."""

    peer: str
    refusal: str  # why the request is refused whole, or ""
    lookups: int = 0  # its open lookups, counted in its peer's total
    rounds: int = 0  # its fetch rounds in flight, counted likewise
    held: Mapping[int, RoundState] = attrs.field(factory=dict)  # its rounds (keys only)


_CHANGES: Final = frozenset(
    {ev.LookupReceived, ev.LookupLimited, ev.LookupAnswered, ev.LookupDropped, ev.FetchReceived}
    | {ev.TransferDoneSent, ev.AbortAckSent, ev.RoundClosed}
)
"""The events that open or end a lookup or round: only they change what a state holds."""

_REFUSED: Final = (ev.LookupRefused, ev.KeysRefused, ev.FetchRefused, ev.LookupLimited)
"""The events of a refusal, which :meth:`QuotaLedger.observe` counts and logs."""


class QuotaLedger:
    """The runtime's per-peer counts, and its verdicts on what goes over a limit.

    Requests are tracked by a handle (the runtime's actor object), so that two
    sessions of the same peer (an old one draining, a new one) never mix their
    counts. Lookups and rounds are read from a request's state right after
    each step (:meth:`observe`), a verdict is asked right before one
    (:meth:`admit`), both inside one synchronous step on the node's thread, so
    a count can never be overtaken by messages queued behind it. Pins are
    counted where the parent pins them (:meth:`pin_budget`, :meth:`pinned`,
    :meth:`released`), on whichever thread lends the parent; those three are
    only ever called from one thread at a time.

    Args:
        quotas: The limits.
        num_blocks: The node's blocks, for a pinned-blocks limit given as a
            fraction.
    """

    def __init__(self, quotas: PeerQuotas, num_blocks: int) -> None:
        self.quotas = quotas
        self.pinned_limit = quotas.pinned_blocks_limit(num_blocks)
        self._limits = {q: getattr(quotas, f"max_{q.value}") for q in Quota}
        self._limits[Quota.PINNED_BLOCKS] = self.pinned_limit
        self._peers: dict[str, _Peer] = {}
        self._requests: dict[Hashable, _Request] = {}
        self._pins: dict[int, tuple[str, int]] = {}  # job -> (peer, blocks)

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            if len(self._peers) >= _REMEMBERED_PEERS:
                # Without CURVE a peer is whoever claims a ``host:port``: one that
                # comes back under ever new ids must not grow the ledger without
                # bound. Those holding nothing go (their refusal totals too).
                holding = {r.peer for r in self._requests.values()}
                holding.update(peer for peer, _ in self._pins.values())
                for idle in self._peers.keys() - holding:
                    del self._peers[idle]
            p = self._peers[peer] = _Peer()
        return p

    def _held(self, peer: str, quota: Quota) -> int:
        p = self._peers.get(peer)  # (a stranger is not remembered for being asked about)
        return p.held[quota] if p is not None else 0

    def _refusal(self, peer: str, quota: Quota, *, full: bool = True) -> str:
        """Why ``peer`` may not hold more of ``quota``, with the numbers ("" while it may).

        ``full=False``: the reason whatever the count (the caller knows it is over).
        """
        held, limit = self._held(peer, quota), self._limits[quota]
        if full and held < limit:
            return ""
        return f"{peer} already has {held} {HELD[quota]} here (quota {limit} per peer)"

    # --- requests ---------------------------------------------------------------------

    def open_request(self, peer: str, handle: Hashable) -> bool:
        """Count a new producer request of ``peer``.

        Returns:
            False if the peer is over its open-requests quota: the request is
            still counted (it lives for one step), but every lookup of it is
            answered all MISS and every fetch fails.
        """
        p = self._peer(peer)
        refusal = self._refusal(peer, Quota.OPEN_REQUESTS)
        p.held[Quota.OPEN_REQUESTS] += 1
        self._requests[handle] = _Request(peer, refusal)
        return not refusal

    def admit(
        self, handle: Hashable, message: wire.Lookup | wire.Fetch
    ) -> wire.Lookup | wire.Fetch | inp.OverQuota:
        """The verdict on a peer's lookup or fetch, just before its request steps it.

        Returns:
            ``message`` itself when it is within every quota, else an
            :class:`~p2pactor.core.inputs.OverQuota` carrying it.
        """
        request = self._requests.get(handle)
        fetch = isinstance(message, wire.Fetch)
        if request is None or (fetch and not message.keys):
            # Not a counted request (a consumer's, or a test's), or the empty
            # fetch that closes one: never refused.
            return message
        limit = self._limits[Quota.ROUNDS_PER_REQUEST]
        held = request.held
        quota = Quota.FETCH_ROUNDS if fetch else Quota.OPEN_LOOKUPS
        cap = 0
        if request.refusal:
            quota, reason = Quota.OPEN_REQUESTS, request.refusal
        elif message.round_seq not in held and len(held) >= limit:
            quota = Quota.ROUNDS_PER_REQUEST
            reason = (
                f"request {message.kv_request_id!r} of {request.peer} already holds "
                f"{len(held)} rounds here (quota {limit} per request)"
            )
        elif not (reason := self._refusal(request.peer, quota)):
            cap = self._limits[Quota.KEYS_PER_LOOKUP]
            if fetch or len(message.keys) <= cap:
                return message
            quota = Quota.KEYS_PER_LOOKUP
            reason = f"a lookup of {len(message.keys)} keys; only the first {cap} are looked up"
            reason += " (quota per lookup)"
        return inp.OverQuota(message=message, quota=quota, reason=reason, admit=cap)

    def observe(
        self, handle: Hashable, events: Sequence[ev.AnyEvent], state: ProducerState, now: float
    ) -> None:
        """Take up what a request holds after a step (its ``state``); log the step's refusals.

        Its open lookups: ``state.lookups`` neither answered nor dropped; its
        fetch rounds: ``state.rounds`` fetched; the rounds it holds: all of
        ``state.rounds``. Only a step with one of :data:`_CHANGES` changes them.
        """
        request = self._requests.get(handle)
        if request is None:
            return
        for event in events:
            if isinstance(event, _REFUSED):
                quota = getattr(event, "quota", Quota.KEYS_PER_LOOKUP)  # limited: keys
                self._refused(request.peer, event.actor.kv_request_id, quota, event.reason, now)
            elif type(event) is ev.Closed:
                self.forget(handle)
                return
        if _CHANGES.isdisjoint(map(type, events)):
            return
        lookups = sum(not (lookup.answered or lookup.dropped) for lookup in state.lookups.values())
        rounds = sum(rnd.fetched for rnd in state.rounds.values())
        held = self._peers[request.peer].held  # never forgotten while it has a request
        held[Quota.OPEN_LOOKUPS] += lookups - request.lookups
        held[Quota.FETCH_ROUNDS] += rounds - request.rounds
        request.lookups, request.rounds, request.held = lookups, rounds, state.rounds

    def forget(self, handle: Hashable) -> None:
        """The request ended (or its session did): it holds nothing any more. Idempotent."""
        request = self._requests.pop(handle, None)
        if request is not None:
            held = self._peer(request.peer).held
            held[Quota.OPEN_REQUESTS] -= 1
            held[Quota.OPEN_LOOKUPS] -= request.lookups
            held[Quota.FETCH_ROUNDS] -= request.rounds

    # --- pins ---------------------------------------------------------------------------

    def pin_budget(self, peer: str) -> int:
        """How many more blocks ``peer`` may have pinned now."""
        return self.pinned_limit - self._held(peer, Quota.PINNED_BLOCKS)

    def pin_refusal(self, peer: str) -> str:
        """Why hits of ``peer`` are left unpinned, with the numbers."""
        return self._refusal(peer, Quota.PINNED_BLOCKS, full=False)

    def pinned(self, peer: str, job_id: int, blocks: int) -> None:
        """The parent pinned ``blocks`` blocks for ``peer`` as job ``job_id``."""
        p = self._peer(peer)
        self._pins[job_id] = (peer, blocks)
        p.held[Quota.PINNED_BLOCKS] += blocks
        p.peak_pinned = max(p.peak_pinned, p.held[Quota.PINNED_BLOCKS])

    def released(self, job_id: int) -> None:
        """The parent released job ``job_id`` (a store job, not counted, is ignored)."""
        held = self._pins.pop(job_id, None)
        if held is not None:
            self._peer(held[0]).held[Quota.PINNED_BLOCKS] -= held[1]

    # --- reporting ----------------------------------------------------------------------

    def usage(self, peer: str) -> PeerUsage:
        """What ``peer`` holds now and what it was refused (zeros for a stranger)."""
        p = self._peers.get(peer)
        if p is None:
            return PeerUsage()
        return PeerUsage(
            **{q.value: p.held[q] for q in HELD},
            peak_pinned_blocks=p.peak_pinned,
            refusals=dict(sorted((q.value, n) for q, n in p.refusals.items())),
        )

    def usages(self) -> dict[str, PeerUsage]:
        """:meth:`usage` of every peer seen so far."""
        return {peer: self.usage(peer) for peer in sorted(self._peers)}

    def _refused(
        self, peer: str, kv_request_id: str, quota: Quota, reason: str, now: float
    ) -> None:
        p = self._peer(peer)
        p.refusals[quota] += 1
        if (more := p.said.setdefault(quota, Throttle(self.quotas.log_interval)).due(now)) is None:
            return
        tail = f" ({more} more refusals of this kind since the last message)" if more else ""
        log.warning(
            "refused %s over its %s quota: %s%s; if this peer may use more, raise "
            "P2PACTOR_QUOTA_%s (docs/quotas.md)",
            peer,
            quota.value,
            reason,
            tail,
            quota.value.upper(),
            extra=request_context(peer, kv_request_id),
        )
