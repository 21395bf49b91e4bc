"""Helpers the bench sections share: subprocesses, ports, percentiles, what is installed."""

from __future__ import annotations

import importlib.util
import math
import os
import socket
import subprocess
import sys
from collections.abc import Sequence

__all__ = [
    "TIER_METHODS",
    "child_env",
    "free_port",
    "module_command",
    "nixl_missing",
    "peak_rss_kib",
    "percentile",
    "ratio_or_none",
    "run_module",
    "vllm_missing",
]

TIER_METHODS = (
    "has_pending_work",
    "on_new_request",
    "get_finished_jobs",
    "lookup",
    "serve_external_requests",
    "submit_load",
    "on_schedule_end",
    "on_request_finished",
)
"""The tier methods the engine section times on the engine's thread, in report order."""


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here (a note), or None when it is importable."""
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else "vLLM is not importable here (pip install vllm==0.33.0)"


def module_command(module: str, *args: str) -> list[str]:
    """The command line running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def child_env(**extra: str) -> dict[str, str]:
    """This environment for a helper process, with NIXL quiet and ``extra`` set."""
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    env.update(extra)
    return env


def run_module(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``python -m module args`` to the end; raise with its output's tail if it fails."""
    done = subprocess.run(  # noqa: S603 - runs our own helper module
        module_command(module, *args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        check=False,
    )
    if done.returncode != 0:
        tail = (done.stdout[-1500:] + "\n" + done.stderr[-3000:]).strip()
        raise RuntimeError(f"{module} exited with {done.returncode}:\n{tail}")
    return done


def nixl_missing() -> str:
    """Why NIXL cannot be used here ('' when it can): the data sections need it."""
    from p2pactor.adapters.nixl import import_nixl  # noqa: PLC0415 - loads NIXL
    from p2pactor.errors import DataPlaneError  # noqa: PLC0415

    try:
        import_nixl()
    except DataPlaneError as exc:
        return f"NIXL is not installed: {exc}"
    return ""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def percentile(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


def ratio_or_none(ours: float, theirs: float) -> float | None:
    """``ours / theirs`` when both are finite and ``theirs`` is not 0, else None."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs == 0:
        return None
    return ours / theirs


def peak_rss_kib() -> int:
    """This process's peak resident memory in KiB (VmHWM), 0 where /proc has none."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
