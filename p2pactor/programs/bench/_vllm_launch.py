"""Start the engine benchmark: its first producers first, then the heavy imports.

``python -m p2pactor.programs.bench._vllm_launch [ARGS]`` takes the arguments of
:mod:`p2pactor.programs.bench._vllm_engine`. With ``--prestart`` it starts the first
repeat's producer processes before importing vLLM, so that the three
interpreters' imports (about 10 s of CPU each) overlap; then it runs the
benchmark. Without it, it is the same as running ``_vllm_engine``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from p2pactor.programs.bench._control_common import free_port
from p2pactor.programs.bench._vllm_spawn import make_parser, spawn_producer


def main(argv: Sequence[str] | None = None) -> int:
    """Start the first producers (with ``--prestart``), then run the benchmark."""
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    args = make_parser().parse_args(argv)
    prespawned: dict[str, tuple[subprocess.Popen[str], int]] = {}
    if args.prestart:
        for kind in [t.strip() for t in args.tiers.split(",") if t.strip()]:
            port = free_port()
            prespawned[kind] = (spawn_producer(kind, port, args), port)
    from p2pactor.programs.bench import _vllm_engine  # noqa: PLC0415 - imports vLLM: after the spawn

    try:
        return _vllm_engine.main(argv, prespawned)
    finally:
        for proc, _ in prespawned.values():
            if proc.poll() is None:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
