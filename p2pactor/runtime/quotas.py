"""Per-peer quotas: what one peer may make this node hold, and the ledger that counts it.

A peer that is served is trusted with a share of the node: the blocks its lookups
pin, the lookups it leaves unanswered, the fetch rounds it keeps in flight and
the requests it keeps open. vLLM 0.33.0 bounds none of these per peer
(``vllm-p2p-0.33.md`` §6.1.7): one peer can pin the whole cache with lookups it
never fetches. :class:`PeerQuotas` sets the limits (``NodeConfig.quotas``);
:class:`QuotaLedger` counts and turns a message over a limit into a
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
import logging
import os
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Final

import attrs

from p2pactor.core import events as ev
from p2pactor.core import inputs as inp
from p2pactor.core import protocol as wire
from p2pactor.core.events import Quota
from p2pactor.core.ids import ActorId
from p2pactor.core.producer import ProducerState
from p2pactor.core.producer_state import RoundState
from p2pactor.errors import ConfigError
from p2pactor.runtime.logcontext import request_context

__all__ = ["DEFAULT_QUOTAS", "PeerQuotas", "PeerUsage", "QuotaLedger"]

log = logging.getLogger("p2pactor.quotas")


def _limit(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if type(value) is not int or value <= 0:
        raise ConfigError(
            f"PeerQuotas.{attribute.name} must be a positive integer, got {value!r}; "
            "set a large number to make it effectively unlimited"
        )


def _optional_limit(_: object, attribute: attrs.Attribute[int | None], value: int | None) -> None:
    if value is not None and (type(value) is not int or value < 0):
        raise ConfigError(
            f"PeerQuotas.{attribute.name} must be None or an integer >= 0, got {value!r}"
        )


def _fraction(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < value <= 1:
        raise ConfigError(
            f"PeerQuotas.{attribute.name} must be in (0, 1], got {value!r}; "
            "it is the share of the node's blocks one peer may keep pinned"
        )


def _interval(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"PeerQuotas.{attribute.name} must be >= 0 seconds, got {value!r}")


@attrs.frozen(kw_only=True)
class PeerQuotas:
    """Limits on what one peer may make this node hold at once.

    Every limit is per peer (per ``host:port``), counted across all of the
    peer's requests and sessions. The defaults protect a node from one greedy
    or hostile peer and never bother an honest vLLM-like one (why each is what
    it is: ``docs/quotas.md``); the module table says what a peer past one gets.

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

    max_pinned_blocks: int | None = attrs.field(default=None, validator=_optional_limit)
    pinned_blocks_fraction: float = attrs.field(default=0.25, validator=_fraction)
    max_open_lookups: int = attrs.field(default=1024, validator=_limit)
    max_keys_per_lookup: int = attrs.field(default=8192, validator=_limit)
    max_fetch_rounds: int = attrs.field(default=1024, validator=_limit)
    max_open_requests: int = attrs.field(default=4096, validator=_limit)
    max_rounds_per_request: int = attrs.field(default=16, validator=_limit)
    log_interval: float = attrs.field(default=10.0, validator=_interval)

    def pinned_blocks_limit(self, num_blocks: int) -> int:
        """The most blocks one peer may keep pinned on a node of ``num_blocks`` blocks."""
        if self.max_pinned_blocks is not None:
            return self.max_pinned_blocks
        return max(1, int(num_blocks * self.pinned_blocks_fraction))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> PeerQuotas | None:
        """The quotas set by environment variables, the defaults for the rest.

        Reads one ``P2PACTOR_QUOTA_*`` variable per limit (``_ENV`` names them;
        :meth:`p2pactor.runtime.config.NodeConfig.from_env` calls this).

        Returns:
            None when none of them is set.

        Raises:
            ConfigError: A variable is set to something unusable; the message
                names it.
        """
        env = os.environ if env is None else env
        values: dict[str, int | float] = {}
        for name, field, parse in _ENV:
            if not (raw := env.get(name)):
                continue
            try:
                values[field] = parse(raw)
            except ValueError:
                raise ConfigError(f"{name}={raw!r} is not a valid {parse.__name__}") from None
        if not values:
            return None
        try:
            return cls(**values)  # type: ignore[arg-type]
        except ConfigError as exc:
            names = ", ".join(n for n, f, _ in _ENV if f in values)
            raise ConfigError(f"{exc} (from {names})") from None


_ENV: Final[tuple[tuple[str, str, type[int] | type[float]], ...]] = (
    ("P2PACTOR_QUOTA_PINNED_BLOCKS", "max_pinned_blocks", int),
    ("P2PACTOR_QUOTA_PINNED_FRACTION", "pinned_blocks_fraction", float),
    ("P2PACTOR_QUOTA_OPEN_LOOKUPS", "max_open_lookups", int),
    ("P2PACTOR_QUOTA_KEYS_PER_LOOKUP", "max_keys_per_lookup", int),
    ("P2PACTOR_QUOTA_FETCH_ROUNDS", "max_fetch_rounds", int),
    ("P2PACTOR_QUOTA_OPEN_REQUESTS", "max_open_requests", int),
    ("P2PACTOR_QUOTA_ROUNDS_PER_REQUEST", "max_rounds_per_request", int),
)


DEFAULT_QUOTAS: Final = PeerQuotas()
"""The quotas a node enforces unless configured otherwise."""

_REMEMBERED_PEERS: Final = 4096
"""Peers whose counts the ledger keeps before it forgets those holding nothing."""


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
        return not (
            self.pinned_blocks or self.open_lookups or self.fetch_rounds or self.open_requests
        )

    def to_json(self) -> str:
        """The usage as one line of JSON (``p2pactor serve`` prints it at exit)."""
        return json.dumps(attrs.asdict(self), sort_keys=True)


@attrs.define(eq=False)
class _Peer:
    """One peer's counts (mutable, runtime only)."""

    pinned: int = 0
    peak_pinned: int = 0
    open_lookups: int = 0
    fetch_rounds: int = 0
    open_requests: int = 0
    refusals: Counter[Quota] = attrs.field(factory=Counter)
    last_logged: dict[Quota, float] = attrs.field(factory=dict)
    unlogged: Counter[Quota] = attrs.field(factory=Counter)


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

_COUNTED: Final = _CHANGES | {ev.LookupRefused, ev.KeysRefused, ev.FetchRefused, ev.Closed}
"""The events :meth:`QuotaLedger.observe` acts on; a step with none of them is skipped."""


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
        self._peers: dict[str, _Peer] = {}
        self._requests: dict[Hashable, _Request] = {}
        self._pins: dict[int, tuple[str, int]] = {}  # job -> (peer, blocks)

    def _peer(self, peer: str) -> _Peer:
        p = self._peers.get(peer)
        if p is None:
            if len(self._peers) >= _REMEMBERED_PEERS:
                self._forget_idle_peers()
            p = self._peers[peer] = _Peer()
        return p

    def _forget_idle_peers(self) -> None:
        """Drop the counts of peers that hold nothing (their refusal totals go too).

        Without CURVE a peer is whoever claims a ``host:port``: one that comes
        back under ever new ids must not grow the ledger without bound.
        """
        holding = {r.peer for r in self._requests.values()}
        holding.update(peer for peer, _ in self._pins.values())
        for peer in [peer for peer in self._peers if peer not in holding]:
            del self._peers[peer]

    # --- requests ---------------------------------------------------------------------

    def open_request(self, peer: str, handle: Hashable) -> bool:
        """Count a new producer request of ``peer``.

        Returns:
            False if the peer is over its open-requests quota: the request is
            still counted (it lives for one step), but every lookup of it is
            answered all MISS and every fetch fails.
        """
        p, limit = self._peer(peer), self.quotas.max_open_requests
        refusal = ""
        if p.open_requests >= limit:
            refusal = (
                f"{peer} already has {p.open_requests} requests open here (quota {limit} per peer)"
            )
        p.open_requests += 1
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
        if request is None:
            return message  # not a counted request (a consumer's, or a test's)
        fetch = isinstance(message, wire.Fetch)
        if fetch and not message.keys:
            return message  # the empty fetch closes the request: never refused
        if request.refusal:
            return inp.OverQuota(message=message, quota=Quota.OPEN_REQUESTS, reason=request.refusal)
        if over := self._rounds_refusal(request, message):
            return over
        q, p = self.quotas, self._peer(request.peer)
        if fetch:
            if p.fetch_rounds < q.max_fetch_rounds:
                return message
            reason = (
                f"{request.peer} already has {p.fetch_rounds} fetch rounds in flight here "
                f"(quota {q.max_fetch_rounds} per peer)"
            )
            return inp.OverQuota(message=message, quota=Quota.FETCH_ROUNDS, reason=reason)
        if p.open_lookups >= q.max_open_lookups:
            reason = (
                f"{request.peer} already has {p.open_lookups} lookups unanswered here "
                f"(quota {q.max_open_lookups} per peer)"
            )
            return inp.OverQuota(message=message, quota=Quota.OPEN_LOOKUPS, reason=reason)
        if len(message.keys) > q.max_keys_per_lookup:
            reason = (
                f"a lookup of {len(message.keys)} keys; only the first "
                f"{q.max_keys_per_lookup} are looked up (quota per lookup)"
            )
            return inp.OverQuota(
                message=message,
                quota=Quota.KEYS_PER_LOOKUP,
                reason=reason,
                admit=q.max_keys_per_lookup,
            )
        return message

    def _rounds_refusal(
        self, request: _Request, message: wire.Lookup | wire.Fetch
    ) -> inp.OverQuota | None:
        """The verdict on a message that would open one more round of ``request``."""
        limit, held = self.quotas.max_rounds_per_request, request.held
        if message.round_seq in held or len(held) < limit:
            return None
        reason = (
            f"request {message.kv_request_id!r} of {request.peer} already holds "
            f"{len(held)} rounds here (quota {limit} per request)"
        )
        return inp.OverQuota(message=message, quota=Quota.ROUNDS_PER_REQUEST, reason=reason)

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
        changed = False
        for event in events:
            kind = type(event)
            if kind not in _COUNTED:
                continue  # most events change no count: skip the match
            if kind in _CHANGES:
                changed = True
                if kind is not ev.LookupLimited:
                    continue
            match event:
                case ev.LookupRefused() | ev.KeysRefused() | ev.FetchRefused():
                    self._refused(request.peer, event.actor, event.quota, event.reason, now)
                case ev.LookupLimited():
                    quota = Quota.KEYS_PER_LOOKUP
                    self._refused(request.peer, event.actor, quota, event.reason, now)
                case ev.Closed():
                    self.forget(handle)
                    return
        if not changed:
            return
        lookups = rounds = 0
        for lookup in state.lookups.values():
            if not (lookup.answered or lookup.dropped):
                lookups += 1
        for rnd in state.rounds.values():
            if rnd.fetched:
                rounds += 1
        p = self._peers[request.peer]  # never forgotten while it has a request
        p.open_lookups += lookups - request.lookups
        p.fetch_rounds += rounds - request.rounds
        request.lookups, request.rounds, request.held = lookups, rounds, state.rounds

    def forget(self, handle: Hashable) -> None:
        """The request ended (or its session did): it holds nothing any more. Idempotent."""
        request = self._requests.pop(handle, None)
        if request is None:
            return
        p = self._peer(request.peer)
        p.open_requests -= 1
        p.open_lookups -= request.lookups
        p.fetch_rounds -= request.rounds

    def forget_all(self, handles: Iterable[Hashable]) -> None:
        """Forget every request in ``handles`` (a session ended)."""
        for handle in handles:
            self.forget(handle)

    # --- pins ---------------------------------------------------------------------------

    def pin_budget(self, peer: str) -> int:
        """How many more blocks ``peer`` may have pinned now."""
        p = self._peers.get(peer)
        return self.pinned_limit - (p.pinned if p is not None else 0)

    def pin_refusal(self, peer: str) -> str:
        """Why hits of ``peer`` are left unpinned, with the numbers."""
        p = self._peers.get(peer)
        held = p.pinned if p is not None else 0
        return f"{peer} already has {held} blocks pinned here (quota {self.pinned_limit} per peer)"

    def pinned(self, peer: str, job_id: int, blocks: int) -> None:
        """The parent pinned ``blocks`` blocks for ``peer`` as job ``job_id``."""
        p = self._peer(peer)
        self._pins[job_id] = (peer, blocks)
        p.pinned += blocks
        p.peak_pinned = max(p.peak_pinned, p.pinned)

    def released(self, job_id: int) -> None:
        """The parent released job ``job_id`` (a store job, not counted, is ignored)."""
        held = self._pins.pop(job_id, None)
        if held is not None:
            self._peer(held[0]).pinned -= held[1]

    # --- reporting ----------------------------------------------------------------------

    def usage(self, peer: str) -> PeerUsage:
        """What ``peer`` holds now and what it was refused (zeros for a stranger)."""
        p = self._peers.get(peer)
        if p is None:
            return PeerUsage()
        return PeerUsage(
            pinned_blocks=p.pinned,
            peak_pinned_blocks=p.peak_pinned,
            open_lookups=p.open_lookups,
            fetch_rounds=p.fetch_rounds,
            open_requests=p.open_requests,
            refusals={q.value: n for q, n in sorted(p.refusals.items(), key=lambda i: i[0].value)},
        )

    def usages(self) -> dict[str, PeerUsage]:
        """:meth:`usage` of every peer seen so far."""
        return {peer: self.usage(peer) for peer in sorted(self._peers)}

    def _refused(self, peer: str, actor: ActorId, quota: Quota, reason: str, now: float) -> None:
        p = self._peer(peer)
        p.refusals[quota] += 1
        last = p.last_logged.get(quota)
        if last is not None and now - last < self.quotas.log_interval:
            p.unlogged[quota] += 1
            return
        more = p.unlogged.pop(quota, 0)
        tail = f" ({more} more refusals of this kind since the last message)" if more else ""
        log.warning(
            "refused %s over its %s quota: %s%s; if this peer may use more, raise "
            "P2PACTOR_QUOTA_%s (docs/quotas.md)",
            peer,
            quota.value,
            reason,
            tail,
            quota.value.upper(),
            extra=request_context(peer, actor.kv_request_id),
        )
        p.last_logged[quota] = now
