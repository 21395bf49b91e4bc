"""The tier's options and environment as the node's :class:`NodeConfig`.

Precedence: a ``secondary_tiers`` option, else its environment variable, else
the default (``docs/vllm.md``'s options table).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from p2pactor.adapters._vllm_api import layout_fingerprint
from p2pactor.errors import ConfigError
from p2pactor.runtime.config import NodeConfig, peer_ids, slow_step_from_ms
from p2pactor.runtime.source_options import SourceOptions

_CURVE_ENV = {
    "curve_secret_key": "P2PACTOR_CURVE_SECRET_KEY",
    "curve_trusted": "P2PACTOR_CURVE_TRUSTED",
}
# vLLM's own P2P tier takes these (its secondary_tiers entry): accepted and ignored.
_VLLM_ONLY = frozenset({"backends", "num_threads", "locality"})
TIER_OPTIONS = frozenset(
    {"host", "bind_host", "port", "unbound_store_timeout_s", "summaries", "slow_step_ms"}
    | {"allowed_peers", "seed_peers", *_CURVE_ENV}
)
"""The ``secondary_tiers`` options :func:`tier_config` takes (besides vLLM's, ignored)."""


def tier_config(
    offloading_spec: Any,
    view: memoryview,
    block_len: int,
    drain_timeout: float,
    options: Mapping[str, Any],
) -> NodeConfig:
    """The node's config for the tier's options (None: not given), over ``os.environ``.

    Raises:
        ValueError: An option or variable is unusable; the message says which.
    """
    given = {k: v for k, v in options.items() if k not in _VLLM_ONLY and v is not None}
    if unknown := set(given) - TIER_OPTIONS:
        raise ValueError(f"unknown p2pactor tier options: {sorted(unknown)}")
    # The options go in before the config is made: a wildcard
    # VLLM_P2P_SIDE_CHANNEL_HOST the tier's own "host" replaces is no error.
    # The CURVE keys are read once host and port are known: the key must
    # speak for this rank's id, not for the environment's default one.
    chosen = {k: given.pop(k) for k in ("host", "bind_host") if k in given}
    env = {k: v for k, v in os.environ.items() if k not in _CURVE_ENV.values()}
    base = NodeConfig.from_env(env, **chosen)
    slow_ms = given.get("slow_step_ms")
    dp_index = int(offloading_spec.config.parallel.data_parallel_index)
    try:
        fields: dict[str, Any] = {
            k: given.get(k, os.environ.get(v) or None) for k, v in _CURVE_ENV.items()
        }
        fields |= {k: peer_ids(given[k]) for k in ("allowed_peers", "seed_peers") if k in given}
        return attrs.evolve(
            base,
            **fields,
            port=int(given.get("port", base.port)) + dp_index,
            num_blocks=int(view.shape[0]) if view.shape else 0,
            block_len=int(block_len),
            fingerprint=layout_fingerprint(offloading_spec),
            sources=source_options(base.sources, offloading_spec, given.get("summaries")),
            unbound_store_timeout=float(given.get("unbound_store_timeout_s", 60.0)),
            drain_timeout=drain_timeout,
            slow_step_s=base.slow_step_s
            if slow_ms is None
            else slow_step_from_ms(slow_ms, said=f"slow_step_ms={slow_ms!r}"),
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
