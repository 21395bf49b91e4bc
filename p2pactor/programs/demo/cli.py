"""The ``p2pactor demo`` subcommand."""

from __future__ import annotations

import argparse
import os
from typing import Any

from p2pactor.errors import ConfigError
from p2pactor.programs.demo.workload import DemoPlan
from p2pactor.surface.logsetup import FORMAT_ENV, LEVEL_ENV

__all__ = ["register"]


def register(commands: Any) -> None:
    """Add ``demo`` to the command line's subcommands."""
    defaults = DemoPlan()
    parser: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help="run N nodes as processes on loopback, sharing KV blocks",
        description=(
            "Start N nodes as separate processes on 127.0.0.1 (real ZeroMQ, real NIXL), "
            "fill them with deterministic KV blocks, let each run requests that look up "
            "and fetch prompt prefixes from its peers, verify every byte, and summarise. "
            "Exit status 0 only when everything verified and no invariant broke."
        ),
    )
    parser.add_argument("--nodes", type=int, default=defaults.nodes, help="node processes (peers)")
    parser.add_argument("--requests", type=int, default=defaults.requests, help="requests per node")
    parser.add_argument(
        "--prefix-blocks",
        type=int,
        default=defaults.prefix_blocks,
        help="blocks of each shared system prompt",
    )
    parser.add_argument(
        "--suffix-blocks",
        type=int,
        default=defaults.suffix_blocks,
        help="blocks a producer's conversation adds to the prefix",
    )
    parser.add_argument(
        "--new-blocks",
        type=int,
        default=defaults.new_blocks,
        help="blocks a request adds that nobody holds (misses)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=defaults.block_len,
        help="bytes per KV block (default %(default)s)",
    )
    parser.add_argument(
        "--named",
        action="store_true",
        help=(
            "each request names its source (the node that served the conversation), as a "
            "router would; by default requests name none and the nodes find their sources "
            "in each other's summaries (docs/sources.md)"
        ),
    )
    parser.add_argument("--seed", type=int, default=defaults.seed, help="workload and hash seed")
    parser.add_argument(
        "--log-dir", default=None, help="folder for the event logs (default: a new temp folder)"
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="give up after this many seconds"
    )
    parser.add_argument(
        "--dashboard",
        type=int,
        metavar="PORT",
        help=(
            "serve the live dashboard: node i's timeline on PORT+i (0: free ports); the "
            "printed 'dashboard:' URL shows every node's requests in one page"
        ),
    )
    parser.add_argument(
        "--dashboard-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the dashboards bind (default %(default)s; anything else is exposed)",
    )
    parser.add_argument(
        "--linger",
        type=float,
        metavar="SECONDS",
        help=(
            "keep the nodes (their /metrics, /status and dashboards) up this long after the "
            "summary (default: until Ctrl-C with --dashboard, 0 without)"
        ),
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="BASE",
        help=(
            "node i serves /metrics (Prometheus) and /status on BASE+i (default 0: free "
            "ports; with --dashboard, on the dashboard's ports); the URLs are printed at "
            "start (docs/metrics.md)"
        ),
    )
    parser.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="address the metrics ports bind (default %(default)s)",
    )
    parser.add_argument(
        "--wait-for-page",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help=(
            "with --dashboard, start the requests when a page connects to the feeds, so "
            "it sees them from the start (at most this long; 0: start at once; "
            "default %(default)g)"
        ),
    )
    parser.add_argument(
        "--pace",
        type=float,
        default=None,
        metavar="SECONDS",
        help=(
            "start each node's requests this far apart (default: 0.25 with --dashboard, "
            "so the page shows them moving through their phases; 0 without)"
        ),
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help=(
            "authenticate and encrypt the control channel with CURVE: make keys for every "
            "node in a temp folder, each trusting the others (docs/security.md)"
        ),
    )
    parser.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from p2pactor.programs.demo.run import run_demo  # noqa: PLC0415 - heavy imports only when used

    try:
        plan = DemoPlan(
            nodes=args.nodes,
            requests=args.requests,
            prefix_blocks=args.prefix_blocks,
            suffix_blocks=args.suffix_blocks,
            new_blocks=args.new_blocks,
            block_len=args.block_size,
            seed=args.seed,
            named=args.named,
        )
    except ConfigError as exc:
        raise SystemExit(f"p2pactor demo: {exc}") from None
    if args.dashboard is not None and not 0 <= args.dashboard <= 65535 - (plan.nodes - 1):
        raise SystemExit(
            f"p2pactor demo: --dashboard {args.dashboard}: ports {args.dashboard}.."
            f"{args.dashboard + plan.nodes - 1} must be TCP ports (or give 0 for free ones)"
        )
    if args.linger is not None and args.linger < 0:
        raise SystemExit(f"p2pactor demo: --linger must be 0 or more, got {args.linger:g}")
    if args.wait_for_page < 0 or (args.pace is not None and args.pace < 0):
        raise SystemExit("p2pactor demo: --wait-for-page and --pace must be 0 or more")
    if not 0 <= args.metrics_port <= 65535 - (plan.nodes - 1):
        raise SystemExit(
            f"p2pactor demo: --metrics-port {args.metrics_port}: ports {args.metrics_port}.."
            f"{args.metrics_port + plan.nodes - 1} must be TCP ports (or give 0 for free ones)"
        )
    dashboard = None if args.dashboard is None else (args.dashboard_host, args.dashboard)
    # The node processes inherit the environment: their stderr logs match ours.
    for name, value in ((FORMAT_ENV, args.log_format), (LEVEL_ENV, args.log_level)):
        if value is not None:
            os.environ[name] = value
    report = run_demo(
        plan,
        log_dir=args.log_dir,
        timeout=args.timeout,
        dashboard=dashboard,
        linger=args.linger if args.linger is not None else (None if dashboard else 0.0),
        curve=args.curve,
        wait_for_page=args.wait_for_page if dashboard else 0.0,
        pace=args.pace if args.pace is not None else (0.25 if dashboard else 0.0),
        metrics=(args.metrics_host, args.metrics_port),
    )
    return 0 if report.ok else 1
