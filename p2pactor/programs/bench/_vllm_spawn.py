"""The engine benchmark's command line, its producer processes, and its launcher.

``python -m p2pactor.programs.bench._vllm_spawn [ARGS]`` takes the arguments of
:mod:`p2pactor.programs.bench._vllm_engine`. With ``--prestart`` it starts the first
repeat's producers before importing vLLM, so that the three interpreters' imports
(about 10 s of CPU each) overlap; then it runs the benchmark. Without it, it is the same
as running ``_vllm_engine``. Here neither has to import the other.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from p2pactor.programs.bench._control_common import LineProcess, free_port


def make_parser() -> argparse.ArgumentParser:
    """The engine benchmark's command line."""
    parser = argparse.ArgumentParser(
        description="engine-thread cost: p2pactor's vLLM adapter vs vLLM's tier"
    )
    parser.add_argument("--requests", type=int, default=1000, help="requests per run (1000)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per tier (3)")
    parser.add_argument("--json", metavar="PATH", help="write every number here")
    parser.add_argument("--tiers", default="ours,vllm", help="which tiers (ours,vllm)")
    parser.add_argument("--keys", type=int, default=16, help="keys per request (16)")
    parser.add_argument("--admit", type=int, default=2, help="new requests per step (2)")
    parser.add_argument("--step-ms", type=float, default=10.0, help="forward pass (10 ms)")
    parser.add_argument("--poll-ms", type=float, default=1.0, help="tier-poll thread; 0: off")
    parser.add_argument("--producer-poll-ms", type=float, default=1.0, help="producer's poll")
    parser.add_argument("--block-bytes", type=int, default=4096, help="block size (4 KiB)")
    parser.add_argument("--consumer-blocks", type=int, default=4096, help="consumer's pool")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument(
        "--prestart", action="store_true", help="start a repeat's producers together (quicker)"
    )
    return parser


def spawn_producer(kind: str, port: int, args: argparse.Namespace) -> LineProcess:
    """Start the producer process (:mod:`~p2pactor.programs.bench._vllm_tier`); not yet ready."""
    return LineProcess(
        "p2pactor.programs.bench._vllm_tier",
        f"--tier={kind}",
        f"--port={port}",
        f"--requests={args.requests}",
        f"--keys={args.keys}",
        f"--seed={args.seed}",
        f"--block-bytes={args.block_bytes}",
        f"--poll-ms={args.producer_poll_ms}",
        NIXL_LOG_LEVEL="WARN",
        PYTHONHASHSEED=os.environ["PYTHONHASHSEED"],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Start the first producers (with ``--prestart``), then run the benchmark."""
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    args = make_parser().parse_args(argv)
    prespawned: dict[str, tuple[LineProcess, int]] = {}
    if args.prestart:
        for kind in [t.strip() for t in args.tiers.split(",") if t.strip()]:
            port = free_port()
            prespawned[kind] = (spawn_producer(kind, port, args), port)
    from p2pactor.programs.bench import _vllm_engine  # noqa: PLC0415 - imports vLLM: after the spawn

    try:
        return _vllm_engine.main(argv, prespawned)
    finally:
        for proc, _ in prespawned.values():
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
