"""What the engine benchmark measures: tier-call wall times and threads' CPU time.

:class:`Meter` times the tier calls one thread makes (per call, per method,
per step) and its waits for the engine's lock; :func:`thread_cpu` reads every
thread's CPU time from ``/proc/<pid>/task/*/schedstat``.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from array import array
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from p2pactor.programs.bench._control_common import TIER_METHODS


def say(line: str = "") -> None:
    """Print one line of the report."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def pct(values: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of ``values``, nearest rank; 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return float(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))])


# --- CPU accounting -------------------------------------------------------------------


def thread_cpu(pid: int | str = "self") -> dict[int, int]:
    """Nanoseconds on CPU of every thread of ``pid``, by thread id."""
    out: dict[int, int] = {}
    base = Path(f"/proc/{pid}/task")
    try:
        tids = os.listdir(base)
    except FileNotFoundError:
        return out
    for tid in tids:
        try:
            out[int(tid)] = int((base / tid / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
    return out


def thread_names() -> dict[int, str]:
    """Names of this process's threads: Python's where it knows them, else the kernel's."""
    names: dict[int, str] = {}
    for tid in thread_cpu():
        try:
            names[tid] = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except FileNotFoundError:
            continue
    for t in threading.enumerate():
        if t.native_id is not None:
            names[t.native_id] = t.name
    return names


# --- measurement ------------------------------------------------------------------------


class Meter:
    """Wall time of tier calls made by one thread, by method, per call and per step."""

    def __init__(self) -> None:
        self.calls: dict[str, array[int]] = {m: array("q") for m in TIER_METHODS}
        self.steps: list[dict[str, int]] = []
        self._step: dict[str, int] = dict.fromkeys(TIER_METHODS, 0)
        self.lock_wait: array[int] = array("q")

    def call(self, method: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call ``fn(*args)``, timing it as ``method``."""
        t0 = time.perf_counter_ns()
        result = fn(*args)
        dt = time.perf_counter_ns() - t0
        self.calls[method].append(dt)
        self._step[method] += dt
        return result

    def acquire(self, lock: threading.Lock) -> None:
        """Take ``lock``, timing the wait."""
        t0 = time.perf_counter_ns()
        lock.acquire()
        self.lock_wait.append(time.perf_counter_ns() - t0)

    def end_step(self) -> None:
        """Close the current step."""
        self.steps.append(self._step)
        self._step = dict.fromkeys(TIER_METHODS, 0)

    def summary(self) -> dict[str, Any]:
        """Totals and distributions, in microseconds (totals in milliseconds)."""
        per_step = [sum(s.values()) / 1e3 for s in self.steps]
        methods: dict[str, dict[str, float]] = {}
        for m in TIER_METHODS:
            calls = self.calls[m]
            steps = [s[m] / 1e3 for s in self.steps]
            methods[m] = {
                "calls": len(calls),
                "total_ms": sum(calls) / 1e6,
                "call_mean_us": (sum(calls) / len(calls) / 1e3) if calls else 0.0,
                "call_p50_us": pct(calls, 0.5) / 1e3,
                "call_p99_us": pct(calls, 0.99) / 1e3,
                "call_max_us": max(calls, default=0) / 1e3,
                "step_mean_us": statistics.fmean(steps) if steps else 0.0,
                "step_p99_us": pct(steps, 0.99),
                "step_max_us": max(steps, default=0.0),
            }
        return {
            "steps": len(self.steps),
            "tier_ms": sum(sum(c) for c in self.calls.values()) / 1e6,
            "step_mean_us": statistics.fmean(per_step) if per_step else 0.0,
            "step_p50_us": pct(per_step, 0.5),
            "step_p99_us": pct(per_step, 0.99),
            "step_max_us": max(per_step, default=0.0),
            "lock_wait_ms": sum(self.lock_wait) / 1e6,
            "lock_wait_max_us": max(self.lock_wait, default=0) / 1e3,
            "methods": methods,
        }
