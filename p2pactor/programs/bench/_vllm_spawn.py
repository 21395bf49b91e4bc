"""The engine benchmark's command line and its producer processes.

Both :mod:`p2pactor.programs.bench._vllm_launch` (which starts producers before the heavy
imports) and :mod:`p2pactor.programs.bench._vllm_engine` (the benchmark) need them; here
neither has to import the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


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


def spawn_producer(kind: str, port: int, args: argparse.Namespace) -> subprocess.Popen[str]:
    """Start the producer process; :func:`wait_ready` waits for its tier."""
    cmd = [
        sys.executable,
        "-m",
        "p2pactor.programs.bench._vllm_tier",
        f"--tier={kind}",
        f"--port={port}",
        f"--requests={args.requests}",
        f"--keys={args.keys}",
        f"--seed={args.seed}",
        f"--block-bytes={args.block_bytes}",
        f"--poll-ms={args.producer_poll_ms}",
    ]
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN", PYTHONHASHSEED=os.environ["PYTHONHASHSEED"])
    return subprocess.Popen(  # noqa: S603 - runs our own helper
        cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def start_producer(kind: str, port: int, args: argparse.Namespace) -> subprocess.Popen[str]:
    """Start the producer process and wait until its tier is up."""
    return wait_ready(kind, spawn_producer(kind, port, args))


def wait_ready(kind: str, proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    """Wait until the producer ``proc`` says READY; kill it if it says anything else."""
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "READY":
        proc.kill()
        raise RuntimeError(f"the {kind} producer did not start (it said {line!r})")
    return proc


def stop_producer(proc: subprocess.Popen[str]) -> dict[str, Any]:
    """Close the producer's stdin and collect its counters."""
    try:
        out, _ = proc.communicate(input="", timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {}
    for line in reversed(out.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    return {}
