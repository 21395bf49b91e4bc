"""The tier's options and environment as the node's :class:`NodeConfig`.

Precedence: a ``secondary_tiers`` option, else its environment variable, else
the default (``docs/vllm.md``'s options table).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Collection
from typing import Any

import attrs

from p2pactor.adapters._vllm_api import layout_fingerprint
from p2pactor.errors import ConfigError
from p2pactor.runtime.config import NodeConfig, peer_ids, slow_step_from_ms
from p2pactor.runtime.sources import SourceOptions

_CURVE_ENV = frozenset({"P2PACTOR_CURVE_SECRET_KEY", "P2PACTOR_CURVE_TRUSTED"})


def tier_config(
    offloading_spec: Any,
    view: memoryview,
    block_len: int,
    drain_timeout: float,
    *,
    host: str | None = None,
    bind_host: str | None = None,
    port: int | str | None = None,
    unbound_store_timeout_s: float = 60.0,
    allowed_peers: Collection[str] | str | None = None,
    seed_peers: Collection[str] | str | None = None,
    summaries: bool | None = None,
    slow_step_ms: float | None = None,
    curve_secret_key: str | None = None,
    curve_trusted: str | None = None,
) -> NodeConfig:
    """The node's config for the tier's options (the keywords), over ``os.environ``.

    Raises:
        ValueError: An option or variable is unusable; the message says which.
    """
    dp_index = int(offloading_spec.config.parallel.data_parallel_index)
    # The CURVE keys are read once host and port are known: the key must
    # speak for this rank's id, not for the environment's default one.
    # The options go in before the config is made: a wildcard
    # VLLM_P2P_SIDE_CHANNEL_HOST the tier's own "host" replaces is no error.
    chosen = {k: v for k, v in (("host", host), ("bind_host", bind_host)) if v is not None}
    base = NodeConfig.from_env(
        {k: v for k, v in os.environ.items() if k not in _CURVE_ENV}, **chosen
    )
    if curve_secret_key is None:
        curve_secret_key = os.environ.get("P2PACTOR_CURVE_SECRET_KEY") or None
    if curve_trusted is None:
        curve_trusted = os.environ.get("P2PACTOR_CURVE_TRUSTED") or None
    try:
        return attrs.evolve(
            base,
            port=int(port if port is not None else base.port) + dp_index,
            num_blocks=int(view.shape[0]) if view.shape else 0,
            block_len=int(block_len),
            fingerprint=layout_fingerprint(offloading_spec),
            allowed_peers=base.allowed_peers if allowed_peers is None else peer_ids(allowed_peers),
            seed_peers=base.seed_peers if seed_peers is None else peer_ids(seed_peers),
            sources=source_options(base.sources, offloading_spec, summaries),
            unbound_store_timeout=float(unbound_store_timeout_s),
            drain_timeout=drain_timeout,
            slow_step_s=base.slow_step_s
            if slow_step_ms is None
            else slow_step_from_ms(slow_step_ms, said=f"slow_step_ms={slow_step_ms!r}"),
            curve_secret_key=curve_secret_key,
            curve_trusted=curve_trusted,
        )
    except (ConfigError, TypeError) as exc:
        raise ValueError(f"bad p2pactor tier configuration: {exc}") from exc


def source_options(base: SourceOptions, spec: Any, summaries: bool | None) -> SourceOptions:
    """The tier's source options: ``base`` (the environment's), for ``spec``'s chunks.

    A key is one offload chunk: ``blocks_per_chunk`` blocks of the group's
    tokens, which is what a HIT saves in prefill; the choice weighs a claimed
    run by those tokens against the round trip. ``summaries`` (the tier
    option), when given, says whether summaries are shared at all.
    """
    if summaries is not None:
        base = attrs.evolve(base, share=bool(summaries))
    config = getattr(spec, "config", None)
    groups = getattr(config, "groups", ())
    per_chunk = getattr(spec, "blocks_per_chunk", None) or getattr(
        getattr(config, "cache", None), "blocks_per_chunk", 0
    )
    tokens = max((int(g.tokens_per_block) for g in groups), default=0) * int(per_chunk or 0)
    if tokens <= 0:
        return base  # a spec that does not say: the policy's default
    return attrs.evolve(base, choice=attrs.evolve(base.choice, tokens_per_key=tokens))


TIER_OPTIONS = frozenset(
    name
    for name, parameter in inspect.signature(tier_config).parameters.items()
    if parameter.kind is parameter.KEYWORD_ONLY
)
"""The ``secondary_tiers`` options :func:`tier_config` takes."""
