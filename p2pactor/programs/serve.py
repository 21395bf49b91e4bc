"""``p2pactor serve``: one long-lived node on real transports.

For people wiring their own engine: a node with ZeroMQ control on
``host:port`` (bound on ``--bind-host`` when given, see ``docs/deploy.md``), a
NIXL data plane over a torch block pool, and an embedded cache, configured from
flags or from the same environment variables as vLLM.
With ``--preload N`` it stores N deterministic blocks (the keys of a prompt of N
token blocks, see :func:`p2pactor.preload_keys`) so other nodes have something to fetch.
It runs until interrupted (Ctrl-C or SIGTERM), then closes cleanly.
"""

from __future__ import annotations

import argparse
import functools
import gc
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from p2pactor.errors import ConfigError
from p2pactor.runtime.addresses import peer_ids
from p2pactor.runtime.config import NodeConfig, slow_step_from_ms
from p2pactor.runtime.log import EventLog
from p2pactor.runtime.parent import EmbeddedCache
from p2pactor.runtime.samples import block_bytes, preload_keys

__all__ = ["config_from_args", "register", "serve"]

log = logging.getLogger("p2pactor.serve")


async def serve(config: NodeConfig, *, preload: int = 0, log_path: str | None = None) -> None:
    """Run one node until cancelled or signalled."""
    import torch  # noqa: PLC0415 - heavy; only the serving process needs it

    from p2pactor.adapters.nixl import open_nixl_transport  # noqa: PLC0415
    from p2pactor.adapters.zmq import open_zmq_transport  # noqa: PLC0415
    from p2pactor.runtime.node import open_node  # noqa: PLC0415
    from p2pactor.surface.attach import open_operator_surface  # noqa: PLC0415

    pool = torch.zeros(config.num_blocks * config.block_len, dtype=torch.uint8)
    cache = EmbeddedCache(config.num_blocks, config.block_len, memory=pool.numpy().data)
    keys = preload_keys(config.hash_seed, preload)
    for key in keys:
        cache.store(key, block_bytes(key, config.block_len))
    event_log = EventLog(
        config.node_id,
        path=log_path,
        clock_origin=(time.time(), trio.current_time()),
        overwrite=True,
    )
    # Nothing of the startup heap (modules, preloaded blocks) is ever
    # collected: frozen, a full collection skips it instead of pausing the
    # node tens of milliseconds (as vLLM's engine does). Done before the node
    # opens, so that this one long collection is no step of its (peers that
    # connect at once would wait behind it).
    gc.collect()
    gc.freeze()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with (
            open_zmq_transport(
                config.node_id, bind_host=config.bind_host, port=config.port, curve=config.curve
            ) as control,
            open_nixl_transport(pool, config.block_len, name=f"serve-{config.port}") as data,
            open_node(
                config, control=control, data=data, parent=cache, event_log=event_log
            ) as node,
            open_operator_surface(node) as surface,
        ):
            sys.stdout.write(
                f"p2pactor node {config.node_id} serving {config.num_blocks} blocks of "
                f"{config.block_len} bytes ({len(keys)} preloaded); Ctrl-C to stop\n"
            )
            sys.stdout.write(
                "control channel: CURVE, authenticated and encrypted "
                f"({len(config.curve.keyring)} trusted peer ids)\n"
                if config.curve is not None
                else "control channel: UNAUTHENTICATED (no CURVE keys; see docs/security.md)\n"
            )
            if surface.dashboard is not None:
                sys.stdout.write(f"dashboard: {surface.dashboard.url}\n")
            sys.stdout.flush()
            if surface.http_url is not None:  # docs/metrics.md; a log line: stderr, any format
                log.info(
                    "metrics: %smetrics  status: %sstatus",
                    surface.http_url,
                    surface.http_url,
                    extra={"node": config.node_id},
                )
            async for signum in signals:
                log.info("stopping on signal %d", signum)
                break
            for peer, usage in node.quota_usage().items():  # docs/quotas.md
                sys.stdout.write(f"quota usage {peer} {usage.to_json()}\n")
    sys.stdout.write(f"p2pactor node {config.node_id} stopped\n")


def register(commands: Any) -> None:
    """Add ``serve`` to the command line's subcommands."""
    parser: argparse.ArgumentParser = commands.add_parser(
        "serve",
        help="run one node (ZeroMQ + NIXL) until interrupted",
        description=(
            "Run a single long-lived p2pactor node: ZeroMQ control on HOST:PORT, a NIXL "
            "data plane over a block pool, an embedded cache. Flags override the "
            "environment (VLLM_P2P_SIDE_CHANNEL_HOST/PORT, P2PACTOR_BIND_HOST, VLLM_P2P_MAX_PEERS, "
            "PYTHONHASHSEED, P2PACTOR_NUM_BLOCKS, P2PACTOR_BLOCK_LEN, ...)."
        ),
    )
    parser.add_argument(
        "--host",
        help="address peers dial to reach this node, its IP or DNS name (half of its id, "
        "HOST:PORT; default VLLM_P2P_SIDE_CHANNEL_HOST, else localhost: one machine only); "
        "never 0.0.0.0: that is --bind-host's",
    )
    parser.add_argument(
        "--bind-host",
        metavar="HOST",
        help="address to bind the control port on, e.g. 0.0.0.0 for every interface "
        "(default P2PACTOR_BIND_HOST, else --host); peers still dial --host",
    )
    parser.add_argument("--port", type=int, help="control port (vLLM default 5710)")
    parser.add_argument("--num-blocks", type=int, help="blocks in the pool")
    parser.add_argument("--block-len", type=int, help="bytes per block")
    parser.add_argument("--hash-seed", help="hash seed shared by all peers")
    parser.add_argument("--fingerprint", help="layout fingerprint shared by all peers")
    parser.add_argument(
        "--allowed-peers", help="comma-separated host:port peers this node may dial"
    )
    parser.add_argument(
        "--seed-peers",
        help="comma-separated host:port peers to open sessions with at start, so that their "
        "summaries are here before the first request that names no source (default "
        "P2PACTOR_SEED_PEERS; docs/sources.md)",
    )
    parser.add_argument(
        "--no-summaries",
        action="store_true",
        help="neither tell peers which keys this node holds nor read what they tell "
        "(default: on, unless P2PACTOR_SUMMARIES=0)",
    )
    parser.add_argument("--preload", type=int, default=0, help="store N demo blocks at start")
    parser.add_argument("--log", help="write the event log to this file")
    parser.add_argument(
        "--curve-secret-key",
        metavar="PATH",
        help="this node's CURVE secret key (STEM.key_secret from `p2pactor keygen`): "
        "authenticate and encrypt the control channel (docs/security.md); needs --curve-trusted",
    )
    parser.add_argument(
        "--curve-trusted",
        metavar="DIR",
        help="folder of the .key files of the peers this node trusts (only they may connect "
        "or be dialed)",
    )
    parser.add_argument(
        "--dashboard",
        type=int,
        metavar="PORT",
        help="serve the live dashboard (page and websocket feed) on PORT; 0 picks a free one",
    )
    parser.add_argument(
        "--dashboard-host",
        metavar="HOST",
        help="address the dashboard binds (default 127.0.0.1; anything else is exposed)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve /metrics (Prometheus) and /status on PORT of their own; 0 picks a free "
        "one (with --dashboard they are on the dashboard's port too); see docs/metrics.md",
    )
    parser.add_argument(
        "--metrics-host",
        metavar="HOST",
        help="address the metrics port binds (default 127.0.0.1; 0.0.0.0 lets a Prometheus "
        "on another host scrape)",
    )
    parser.add_argument(
        "--slow-step-ms",
        type=float,
        metavar="MS",
        help="report every step of the node's trio thread that holds it at least MS "
        "milliseconds (counted in /status and /metrics, logged); 0 turns the watch off "
        "(default P2PACTOR_SLOW_STEP_MS, else 50; docs/status.md)",
    )
    parser.set_defaults(handler=_run)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> NodeConfig:
    """The node's config: ``serve``'s flags over the environment (``os.environ`` if None).

    Raises:
        ConfigError: A flag or variable is unusable; the message says which.
    """
    overrides: dict[str, Any] = {
        name: value
        for name, value in (
            ("host", args.host),
            ("bind_host", args.bind_host),
            ("port", args.port),
            ("num_blocks", args.num_blocks),
            ("block_len", args.block_len),
            ("hash_seed", args.hash_seed),
            ("fingerprint", args.fingerprint),
            ("curve_secret_key", args.curve_secret_key),
            ("curve_trusted", args.curve_trusted),
            ("dashboard_port", args.dashboard),
            ("dashboard_host", args.dashboard_host),
            ("metrics_port", args.metrics_port),
            ("metrics_host", args.metrics_host),
        )
        if value is not None
    }
    slow_ms = args.slow_step_ms
    if slow_ms is not None:
        overrides["slow_step_s"] = slow_step_from_ms(slow_ms, said=f"--slow-step-ms {slow_ms:g}")
    for flag, field in ((args.allowed_peers, "allowed_peers"), (args.seed_peers, "seed_peers")):
        if flag:
            overrides[field] = peer_ids(flag)
    config = NodeConfig.from_env(env, **overrides)
    if args.no_summaries:
        config = attrs.evolve(config, sources=attrs.evolve(config.sources, share=False))
    return config


def _run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        sys.stderr.write(f"p2pactor serve: {exc}\n")
        return 2
    if config.port == 0:
        # Peers dial a node at the HOST:PORT its id names: an ephemeral port
        # would give it an id nobody can dial back.
        sys.stderr.write(
            "p2pactor serve: the control port must be a real port (peers dial HOST:PORT, "
            "the node's id); give --port (vLLM's default is 5710)\n"
        )
        return 2
    if args.preload > config.num_blocks:
        sys.stderr.write("p2pactor serve: --preload cannot exceed --num-blocks\n")
        return 2
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    trio.run(functools.partial(serve, config, preload=args.preload, log_path=args.log))
    return 0
