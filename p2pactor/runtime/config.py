"""Node configuration: one frozen value, from keyword arguments or the environment.

Defaults follow vLLM 0.33.0 wherever vLLM has one, and the same environment
variables are read (vLLM's ``VLLM_P2P_*`` and ``PYTHONHASHSEED``, and p2pactor's own
``P2PACTOR_*``: :meth:`NodeConfig.from_env`, ``docs/vllm.md``), so an operator's
existing settings carry over. Which addresses a node binds, is known by and may
dial: :mod:`p2pactor.runtime.addresses`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import attrs

from p2pactor.core import checks
from p2pactor.core.protocol import DEFAULT_LIMITS, Limits
from p2pactor.core.timings import DEFAULT_TIMINGS, Timings
from p2pactor.errors import ConfigError
from p2pactor.runtime.addresses import is_loopback, is_wildcard, peer_host, peer_ids
from p2pactor.runtime.keys import CurveSecurity
from p2pactor.runtime.quotas import DEFAULT_QUOTAS, PeerQuotas
from p2pactor.runtime.sources import DEFAULT_SOURCES, SourceOptions

DEFAULT_HASH_SEED: Final = "vllm-none-hash"
"""The hash seed vLLM uses for sha256 block hashing when PYTHONHASHSEED is unset."""


def fingerprint_of(fields: Mapping[str, Any]) -> str:
    """The config fingerprint peers compare in the handshake.

    The first 16 hex digits of sha256 over the sorted, compact JSON of the
    layout fields that make blocks interchangeable (model, dtype, block sizes...),
    as vLLM computes it; "" when there are no fields (then nothing is compared).
    """
    if not fields:
        return ""
    text = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_positive = checks.positive(finite=False)  # timeouts and intervals may be inf: never


def _unused_actor_inbox(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value != attribute.default:
        warnings.warn(
            "NodeConfig.actor_inbox does nothing since actors are records (no inbox to "
            "bound); remove it from your config",
            DeprecationWarning,
            stacklevel=4,
        )


_DIAL_MEMORY = 4096  # peers whose may_dial answer a config remembers

SLOW_STEP_S: Final = 0.05
"""The default ``slow_step_s``; measured at under 1% of the node's hot path (docs/status.md)."""


# 0 would report every step: off is None (serve --slow-step-ms 0).
_slow_step: checks.Validator = attrs.validators.optional(checks.positive(finite=True))


def _check_host(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if is_wildcard(value):
        # Peers would dial back to "0.0.0.0:port": nowhere. Binding every
        # interface is bind_host's job; host is the address peers reach.
        raise ConfigError(
            f"NodeConfig.host={value!r} is a wildcard address: peers dial a node back at "
            "its host, and cannot dial that. Set bind_host=0.0.0.0 (P2PACTOR_BIND_HOST, "
            "--bind-host) to listen on every interface, and host=<an address peers reach> "
            "(VLLM_P2P_SIDE_CHANNEL_HOST, --host): this machine's IP or DNS name"
        )


_bind_host = checks.rule(
    "an address to bind (e.g. 0.0.0.0) or None (bind host)",
    lambda v: v is None or (isinstance(v, str) and v.strip()),
)


def _optional_path(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else os.fspath(value)


def _peer_set(value: Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        raise ConfigError(
            "allowed_peers and seed_peers take a collection of 'host:port' strings, not one string"
        )
    return frozenset(value)


@attrs.frozen(kw_only=True)
class NodeConfig:
    """Everything a node needs to know before it starts.

    Attributes:
        host: The address this node is known by: peers dial it back here, and
            it is half of the node's id (``host:port``, the DEALER identity).
            Use the address peers reach you at, an IP or DNS name (vLLM's
            default, ``localhost``, only works on one machine: a node known
            by a loopback address refuses peers on other hosts). Never a
            wildcard (``0.0.0.0``, ``::``, ``*``): that is ``bind_host``'s.
        bind_host: The address the control ROUTER binds (``0.0.0.0`` for
            every interface, or the pod's interface); None binds ``host``.
            Only where the node listens: its id stays ``host:port``.
        port: The control port (vLLM: 5710 plus the data-parallel rank).
        num_blocks: Blocks in the node's KV block pool.
        block_len: Bytes per block; must equal every peer's.
        hash_seed: The seed block hashes chain from; must equal every
            peer's, or the same tokens get different keys.
        fingerprint: The layout fingerprint (see :func:`fingerprint_of`);
            compared with a peer's only when both are non-empty.
        timings: The protocol's timers.
        limits: Bounds on what peers may send.
        max_peers: Most sessions at once, inbound and outbound together.
        handshake_timeout: A session not ready after this many seconds dies.
        idle_timeout: A session idle this long may be closed when near
            ``max_peers``.
        allowed_peers: Peers this node may dial, as ``host:port``; None
            allows any (vLLM's behaviour). Request parameters can never make
            the node dial anything outside this set.
        actor_inbox: Unused. Actors were tasks with an inbox each; they are
            records now, stepped where their inputs arrive, so nothing queues
            per actor. Accepted so that older configs still load; a value
            other than the default warns (DeprecationWarning), and the field
            goes away in a later release.
        session_outbox: Messages queued per peer before the peer counts as
            dead for not reading (vLLM: ZeroMQ SNDHWM 1000).
        max_dispatch_errors: Consecutive internal errors on one session
            before it is disconnected (vLLM: 5).
        engine_inbox: Engine calls queued for the node's trio thread before
            new lookups are answered RETRY without asking and new loads fail
            (the node is overloaded or stalled).
        engine_poll_interval: How often the node's thread, while awake, looks
            for engine calls handed over without waking it (``wake=False``);
            asleep, it waits for the engine's next flush or kick.
        drain_timeout: How long a closing session waits for writes in flight
            and owed parent answers before it gives up on them.
        unbound_store_timeout: How long stored blocks of a prefill/decode
            request wait for the fetch that binds them (vLLM: 60 s).
        quotas: What one peer may make this node hold at once (pinned blocks,
            open lookups, keys per lookup, fetch rounds, open requests); see
            :class:`~p2pactor.runtime.quotas.PeerQuotas` and ``docs/quotas.md``.
        round_extension: Use a session-wide round counter with p2pactor peers.
        dashboard_port: Serve the live timeline (the dashboard page and its
            websocket feed, see ``docs/timeline.md``) on this port; 0 picks a
            free one (``Node.dashboard`` says which); None serves nothing.
        dashboard_host: The address the dashboard binds. Loopback by default:
            the feed shows peers, request ids and timings, so serving it
            anywhere else is an explicit choice.
        metrics_port: Serve ``/metrics`` (Prometheus) and ``/status`` on
            this port of their own; 0 picks a free one (``Node.http_url``
            says which); None (the default) serves them only on the
            dashboard's port, when it is on. See ``docs/metrics.md``.
        metrics_host: The address the metrics port binds (loopback by
            default; ``0.0.0.0`` lets a Prometheus on another host scrape).
        curve_secret_key: Path of this node's secret CURVE certificate
            (``STEM.key_secret`` from ``p2pactor keygen``; mode 0600). With
            ``curve_trusted``, the control channel is authenticated and
            encrypted (``docs/security.md``) and talks only to peers that have
            keys too, never to stock vLLM peers. None (with ``curve_trusted``
            None): vLLM's plain, unauthenticated ZeroMQ.
        curve_trusted: Directory of the public certificates (``*.key``) of
            the peers this node trusts: only they may connect, and only they
            may be dialed. Read once when the config is made.
        seed_peers: Peers (``host:port``) to open sessions with as the node
            starts, so their summaries are here before the first request
            that names no source. Peers that connect to us join too.
        sources: Summaries and the automatic choice of a source
            (:class:`~p2pactor.runtime.sources.SourceOptions`,
            ``docs/sources.md``).
        slow_step_s: Report every step of a task on the node's trio thread
            that holds it at least this many seconds (one message handled in
            one go, a timer's work, a garbage-collector pause inside it):
            counted, kept among the recent ones in ``/status``'s ``loop``, in
            ``/metrics`` and logged (rate-limited). None turns the watch off
            (serve ``--slow-step-ms 0``). See
            :mod:`p2pactor.runtime.loopwatch` and ``docs/status.md``.
        curve: Not an argument: the CURVE keys loaded from ``curve_secret_key``
            and ``curve_trusted``, or None.
    """

    host: str = attrs.field(default="localhost", validator=[checks.instance_of(str), _check_host])
    bind_host: str | None = attrs.field(default=None, validator=_bind_host)
    port: int = attrs.field(default=5710, validator=checks.port)
    num_blocks: int = attrs.field(default=1024, validator=checks.positive_int)
    block_len: int = attrs.field(default=4096, validator=checks.positive_int)
    hash_seed: str = DEFAULT_HASH_SEED
    fingerprint: str = ""
    timings: Timings = DEFAULT_TIMINGS
    limits: Limits = DEFAULT_LIMITS
    max_peers: int = attrs.field(default=128, validator=checks.positive_int)
    handshake_timeout: float = attrs.field(default=30.0, validator=_positive)
    idle_timeout: float = attrs.field(default=300.0, validator=_positive)
    allowed_peers: frozenset[str] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_peer_set)
    )
    actor_inbox: int = attrs.field(
        default=256, validator=[checks.positive_int, _unused_actor_inbox]
    )
    session_outbox: int = attrs.field(default=1000, validator=checks.positive_int)
    max_dispatch_errors: int = attrs.field(default=5, validator=checks.positive_int)
    engine_inbox: int = attrs.field(default=100_000, validator=checks.positive_int)
    engine_poll_interval: float = attrs.field(default=0.005, validator=_positive)
    drain_timeout: float = attrs.field(default=30.0, validator=_positive)
    unbound_store_timeout: float = attrs.field(default=60.0, validator=_positive)
    quotas: PeerQuotas = DEFAULT_QUOTAS
    round_extension: bool = True
    dashboard_port: int | None = attrs.field(default=None, validator=checks.optional_port)
    dashboard_host: str = "127.0.0.1"
    metrics_port: int | None = attrs.field(default=None, validator=checks.optional_port)
    metrics_host: str = "127.0.0.1"
    curve_secret_key: str | None = attrs.field(default=None, converter=_optional_path)
    curve_trusted: str | None = attrs.field(default=None, converter=_optional_path)
    seed_peers: frozenset[str] = attrs.field(default=frozenset(), converter=_peer_set)
    sources: SourceOptions = attrs.field(
        default=DEFAULT_SOURCES, validator=checks.instance_of(SourceOptions)
    )
    slow_step_s: float | None = attrs.field(default=SLOW_STEP_S, validator=_slow_step)
    curve: CurveSecurity | None = attrs.field(init=False, eq=False, repr=False)
    # may_dial's answers by peer: each depends on the peer id and this
    # config alone, and the engine's thread asks for every request and key.
    _dialable: dict[str, bool] = attrs.field(init=False, eq=False, repr=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        # The key files are read once, here: a bad one fails the config at
        # startup, not the first dial, and may_dial stays a dict lookup.
        curve: CurveSecurity | None = None
        if (self.curve_secret_key is None) != (self.curve_trusted is None):
            raise ConfigError(
                "curve_secret_key and curve_trusted go together: give both (this node's "
                ".key_secret file and the directory of trusted peers' .key files) to "
                "authenticate the control channel, or neither"
            )
        if self.curve_secret_key is not None and self.curve_trusted is not None:
            curve = CurveSecurity.load(self.curve_secret_key, self.curve_trusted)
            own = curve.keypair.addresses
            if self.port and self.node_id not in own:
                # Peers would drop every frame we send: our identity would not
                # be the address they bind to our key.
                raise ConfigError(
                    f"{self.curve_secret_key} speaks for {', '.join(sorted(own))}, but this "
                    f"node is {self.node_id}: make a key pair for it with `p2pactor keygen "
                    f"STEM --address {self.node_id}` (several comma-separated addresses for "
                    "one key are allowed) and give its .key file to the peers"
                )
        object.__setattr__(self, "curve", curve)  # a frozen config's derived value: set once

    @property
    def node_id(self) -> str:
        """The node's id on the wire: ``host:port``, exactly as bound."""
        return f"{self.host}:{self.port}"

    @property
    def listen_host(self) -> str:
        """Where the control ROUTER binds: ``bind_host``, else ``host``."""
        return self.host if self.bind_host is None else self.bind_host

    def may_dial(self, peer_id: str) -> bool:
        """Whether this node may open a connection to ``peer_id``.

        It must be in ``allowed_peers`` (when set) and, with CURVE, have a
        trusted key: a peer we hold no key for could not be authenticated.
        And it must be able to dial us back (see :meth:`dial_refusal`).
        """
        known = self._dialable.get(peer_id)
        if known is None:
            known = (
                (self.allowed_peers is None or peer_id in self.allowed_peers)
                and self.dial_refusal(peer_id) is None
                and (self.curve is None or self.curve.trusts(peer_id))
            )
            if len(self._dialable) >= _DIAL_MEMORY:
                self._dialable.clear()  # a bound, not a policy: answers are recomputed
            self._dialable[peer_id] = known
        return known

    def dial_refusal(self, peer_id: str) -> str | None:
        """Why ``peer_id`` could never reach this node back, or None if it could.

        A node known by a loopback address (``localhost``, ``127.x``, ``::1``)
        and a peer on another host: the peer would dial ``localhost`` back,
        reach itself (or nothing), and the session would die at the handshake
        timeout with nothing said. Loopback peers of a loopback node (one
        machine) are fine. Decided from the two ids alone, before any socket.
        """
        # Asked only where may_dial's memory has no answer yet, and on refusals.
        if not is_loopback(self.host) or is_loopback(peer_host(peer_id)):
            return None
        return (
            f"this node is {self.node_id}, a loopback address, and {peer_id} is on another "
            f"host: it could not dial this node back. Set host (VLLM_P2P_SIDE_CHANNEL_HOST, "
            f"p2pactor serve --host, the vLLM tier's 'host') to an address {peer_id} "
            "reaches, this machine's IP or DNS name (and bind_host=0.0.0.0 to listen on "
            "every interface)"
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> NodeConfig:
        """Build a config from environment variables, then keyword overrides.

        Reads vLLM's ``VLLM_P2P_SIDE_CHANNEL_HOST``, ``VLLM_P2P_SIDE_CHANNEL_PORT``,
        ``VLLM_P2P_MAX_PEERS``, ``VLLM_P2P_HANDSHAKE_TIMEOUT_S``, ``VLLM_P2P_IDLE_TIMEOUT_S``
        and ``PYTHONHASHSEED`` (their defaults: ``docs/vllm.md``), and
        ``P2PACTOR_BIND_HOST``, ``P2PACTOR_NUM_BLOCKS``, ``P2PACTOR_BLOCK_LEN``,
        ``P2PACTOR_FINGERPRINT``, ``P2PACTOR_ALLOWED_PEERS`` and ``P2PACTOR_SEED_PEERS``
        (comma-separated ``host:port``), ``P2PACTOR_SUMMARIES`` (``0`` turns summaries
        off), ``P2PACTOR_DASHBOARD_PORT``, ``P2PACTOR_DASHBOARD_HOST``,
        ``P2PACTOR_METRICS_PORT``, ``P2PACTOR_METRICS_HOST``,
        ``P2PACTOR_CURVE_SECRET_KEY`` and ``P2PACTOR_CURVE_TRUSTED``,
        ``P2PACTOR_SLOW_STEP_MS`` (milliseconds; ``0`` turns the watch off), and the
        quotas' ``P2PACTOR_QUOTA_*`` (:meth:`~p2pactor.runtime.quotas.PeerQuotas.from_env`).

        Raises:
            ConfigError: A variable is set to something unusable; the message
                names it.
        """
        env = os.environ if env is None else env
        values = checks.env_values(env, _ENV)
        quotas = PeerQuotas.from_env(env)  # P2PACTOR_QUOTA_*: see docs/quotas.md
        if quotas is not None:
            values["quotas"] = quotas
        values.update(overrides)
        return cls(**values)


def _share(raw: str) -> SourceOptions:
    if raw not in ("0", "1"):
        raise ConfigError(f"P2PACTOR_SUMMARIES={raw!r}: set it to 1 (on) or 0 (off)")
    return attrs.evolve(DEFAULT_SOURCES, share=raw == "1")


def _slow_step_ms(raw: str) -> float | None:
    return slow_step_from_ms(raw, said=f"P2PACTOR_SLOW_STEP_MS={raw!r}")


# What NodeConfig.from_env reads: a variable's name, the field it sets, its parser.
_ENV: Final[dict[str, tuple[str, Callable[[str], Any]]]] = {
    "VLLM_P2P_SIDE_CHANNEL_HOST": ("host", str),
    "P2PACTOR_BIND_HOST": ("bind_host", str),
    "VLLM_P2P_SIDE_CHANNEL_PORT": ("port", int),
    "VLLM_P2P_MAX_PEERS": ("max_peers", int),
    "VLLM_P2P_HANDSHAKE_TIMEOUT_S": ("handshake_timeout", float),
    "VLLM_P2P_IDLE_TIMEOUT_S": ("idle_timeout", float),
    "PYTHONHASHSEED": ("hash_seed", str),
    "P2PACTOR_NUM_BLOCKS": ("num_blocks", int),
    "P2PACTOR_BLOCK_LEN": ("block_len", int),
    "P2PACTOR_FINGERPRINT": ("fingerprint", str),
    "P2PACTOR_DASHBOARD_PORT": ("dashboard_port", int),
    "P2PACTOR_DASHBOARD_HOST": ("dashboard_host", str),
    "P2PACTOR_METRICS_PORT": ("metrics_port", int),
    "P2PACTOR_METRICS_HOST": ("metrics_host", str),
    "P2PACTOR_CURVE_SECRET_KEY": ("curve_secret_key", str),
    "P2PACTOR_CURVE_TRUSTED": ("curve_trusted", str),
    "P2PACTOR_ALLOWED_PEERS": ("allowed_peers", peer_ids),
    "P2PACTOR_SEED_PEERS": ("seed_peers", peer_ids),
    "P2PACTOR_SUMMARIES": ("sources", _share),
    "P2PACTOR_SLOW_STEP_MS": ("slow_step_s", _slow_step_ms),
}


def slow_step_from_ms(ms: object, *, said: str) -> float | None:
    """Milliseconds, as given by a user, as ``NodeConfig.slow_step_s``: ``0`` turns the watch off.

    ``said`` names where the value came from (a flag, a variable, a tier
    option), for the error a bad value gets.
    """
    if isinstance(ms, str):
        try:
            ms = float(ms)
        except ValueError:
            ms = math.nan
    if isinstance(ms, bool) or not isinstance(ms, int | float) or not 0 <= ms < math.inf:
        raise ConfigError(
            f"{said}: give milliseconds above 0 (a step that holds the node's thread that "
            "long is reported), or 0 to turn the slow-step watch off"
        )
    return None if ms == 0 else ms / 1000
