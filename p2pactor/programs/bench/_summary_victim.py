"""The victim of the ``summary-attack`` section: ``p2pactor serve``, and what it is watched by.

:class:`Victim` runs the real command line (summaries on, as by default) as a
process of its own, preloaded so an honest peer has something to look up.
Its memory is read from ``/proc/PID/status`` (``VmRSS``; ``VmHWM``, the peak,
which :meth:`Victim.reset_peak` starts afresh by writing ``5`` to
``/proc/PID/clear_refs``). :class:`Monitor` polls both, and the node's
``/status``, on threads of its own, so that a window of time can be asked
afterwards for its largest RSS, the node thread's longest step (the slow-step
watch's ``loop.recent_slow``, when ``serve`` has ``--slow-step-ms``) and how
long ``/status`` took to answer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from p2pactor.programs.bench._control_common import (
    ChildError,
    LineProcess,
    percentile,
)

RSS_POLL_S = 0.01
"""How often the victim's RSS is read (a file read: cheap for it)."""
STATUS_POLL_S = 0.1
"""How often ``/status`` is asked: often enough that the 32 slow steps it lists never
overflow between two reads unless steps of over 3 ms follow each other back to back."""
STATUS_TIMEOUT_S = 30.0
FRESH_READ_S = 10.0
"""The longest a window waits for a read of ``/status`` asked after its end."""


def serve_has_slow_step() -> bool:
    """Whether ``p2pactor serve`` has ``--slow-step-ms`` (the node's slow-step watch)."""
    from p2pactor.programs.serve import register  # noqa: PLC0415

    commands = argparse.ArgumentParser().add_subparsers()
    register(commands)
    serve = commands.choices["serve"]
    return any("--slow-step-ms" in a.option_strings for a in serve._actions)


def memory_kib(pid: int) -> tuple[int, int]:
    """``(VmRSS, VmHWM)`` of process ``pid`` in KiB; ``(0, 0)`` once it is gone."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except OSError:
        pass
    return rss, hwm


@attrs.frozen(kw_only=True)
class VictimSettings:
    """How the victim is started (``p2pactor serve`` flags)."""

    port: int
    metrics_port: int
    num_blocks: int = 16_384
    block_len: int = 1024
    preload: int = 16_384
    hash_seed: str = "summary-attack"
    slow_step_ms: float | None = 10.0

    @property
    def node_id(self) -> str:
        """The victim's peer id."""
        return f"127.0.0.1:{self.port}"


class Victim:
    """``p2pactor serve`` as a process; SIGTERM (then SIGKILL) on :meth:`close`."""

    def __init__(self, settings: VictimSettings, stderr: Path) -> None:
        self.settings = s = settings
        argv = ["serve", "--host", "127.0.0.1", "--port", str(s.port)]
        argv += ["--num-blocks", str(s.num_blocks), "--block-len", str(s.block_len)]
        argv += ["--hash-seed", s.hash_seed, "--preload", str(s.preload)]
        argv += ["--metrics-port", str(s.metrics_port)]
        if s.slow_step_ms is not None:
            argv += ["--slow-step-ms", f"{s.slow_step_ms:g}"]
        self.child = LineProcess("p2pactor", *argv, stderr=str(stderr))
        self.proc, self.pid, self.stderr = self.child.proc, self.child.pid, stderr
        self.url = f"http://127.0.0.1:{s.metrics_port}/status"

    def why(self) -> str:
        """What its stderr ends with (for an error message)."""
        return self.child.why()

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Wait until it serves (its ``p2pactor node ... serving`` line) and ``/status`` answers."""
        deadline = time.monotonic() + timeout
        while not (
            (line := self.child.line(deadline - time.monotonic())).startswith("p2pactor node")
            and "serving" in line
        ):
            pass
        self.wait_status(lambda _: True, deadline - time.monotonic(), "its /status")

    def memory_kib(self) -> tuple[int, int]:
        """Its ``(VmRSS, VmHWM)`` in KiB."""
        return memory_kib(self.pid)

    def reset_peak(self) -> None:
        """Start ``VmHWM`` afresh from the RSS now (Linux: ``5`` to ``clear_refs``)."""
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")

    def status(self, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any]:
        """Its ``/status`` document."""
        with urllib.request.urlopen(self.url, timeout=timeout) as answer:  # noqa: S310 - loopback
            document: dict[str, Any] = json.load(answer)
        return document

    def wait_status(
        self, condition: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        """Poll ``/status`` until ``condition`` holds of it; raise naming ``what`` if not."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ChildError(
                    f"p2pactor serve exited with {self.proc.returncode} while it was watched "
                    f"for {what} (its stderr, {self.stderr}, ends: {self.why()})"
                )
            try:
                document = self.status()
                if condition(document):
                    return document
            except OSError:
                pass  # not serving yet, or too busy to answer in time: ask again
            if time.monotonic() > deadline:
                raise ChildError(
                    f"the victim did not show {what} within {timeout:g} s (its /status: "
                    f"{self.url}; its stderr: {self.stderr})"
                )
            time.sleep(0.05)

    def has_peer(self, peer: str) -> bool:
        """Whether the victim has a session with ``peer`` now."""
        return any(p.get("peer") == peer for p in self.status().get("peers", []))

    def wait_gone(self, peer: str, timeout: float = 60.0) -> None:
        """Wait until the victim has no session with ``peer`` (it left, or was refused)."""
        self.wait_status(
            lambda d: all(p.get("peer") != peer for p in d.get("peers", [])),
            timeout,
            f"the end of {peer}'s session",
        )

    def wait_closed(self, peer: str, timeout: float = 120.0) -> None:
        """Wait until a session of ``peer`` is among the victim's recently closed ones."""
        self.wait_status(
            lambda d: any(
                c.get("peer") == peer for c in d.get("closed_sessions", {}).get("recent", [])
            ),
            timeout,
            f"{peer}'s session closed",
        )

    def close(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 20 s) and reap it."""
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        self.child.kill()


@attrs.frozen(kw_only=True)
class Window:
    """What the monitor saw between two times (unix seconds)."""

    max_rss_kib: int
    """The largest RSS read (the victim's ``VmHWM`` since a reset is the exact peak)."""
    longest_step_s: float | None
    """The node thread's longest slow step that began in the window (None: no watch)."""
    longest_task: str
    """What the longest step ran (the task the slow-step watch names; "" if none)."""
    slow_steps: int
    """Slow steps that began in the window, as far as ``/status`` listed them."""
    overflowed: bool
    """Whether more slow steps happened between two reads than ``/status`` lists."""
    status_p50_s: float | None
    status_max_s: float | None
    """How long ``/status`` took to answer, median and most (None: never asked)."""


class Monitor:
    """Reads the victim's RSS and ``/status`` on two threads until :meth:`close`."""

    def __init__(self, victim: Victim) -> None:
        self._victim = victim
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rss: list[tuple[float, int]] = []
        self._status: list[tuple[float, float]] = []  # (asked at, seconds to answer)
        self._slow: dict[tuple[float, float, str], None] = {}
        self.watching = False  # the victim reports its slow steps (``loop`` in /status)
        self._overflows: list[float] = []
        self._threads = [
            threading.Thread(target=self._poll_rss, daemon=True),
            threading.Thread(target=self._poll_status, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _poll_rss(self) -> None:
        while not self._stop.wait(RSS_POLL_S):
            rss, _ = self._victim.memory_kib()
            with self._lock:
                self._rss.append((time.time(), rss))

    def _poll_status(self) -> None:
        last_count: int | None = None
        while not self._stop.wait(STATUS_POLL_S):
            t0 = time.time()
            try:
                document = self._victim.status()
            except (OSError, ValueError):
                continue
            took = time.time() - t0
            loop = document.get("loop")
            with self._lock:
                self._status.append((t0, took))
                if not isinstance(loop, dict):
                    continue
                self.watching = True
                recent = loop.get("recent_slow", [])
                for s in recent:
                    self._slow[float(s["at"]), float(s["seconds"]), str(s["task"])] = None
                count = int(loop.get("slow_steps", 0))
                if last_count is not None and count - last_count > len(recent):
                    self._overflows.append(t0)
                last_count = count

    def window(self, start: float, end: float) -> Window:
        """What was seen from ``start`` to ``end`` (unix seconds).

        Waits (at most :data:`FRESH_READ_S`) for a read of ``/status`` asked
        after ``end``: a slow step that ended in the window is listed only by
        the reads after it.
        """
        deadline = time.monotonic() + FRESH_READ_S
        while time.monotonic() < deadline and not self._asked_since(end):
            time.sleep(STATUS_POLL_S / 4)
        with self._lock:
            rss = [kib for t, kib in self._rss if start <= t <= end]
            took = [s for t, s in self._status if start <= t <= end]
            slow = sorted((s, task) for at, s, task in self._slow if start <= at <= end)
            overflowed = any(start <= t <= end for t in self._overflows)
            watching = self.watching
        return Window(
            max_rss_kib=max(rss, default=0),
            longest_step_s=(slow[-1][0] if slow else 0.0) if watching else None,
            longest_task=slow[-1][1] if slow else "",
            slow_steps=len(slow),
            overflowed=overflowed,
            status_p50_s=percentile(took, 0.5) if took else None,
            status_max_s=max(took, default=None),
        )

    def _asked_since(self, when: float) -> bool:
        with self._lock:
            return bool(self._status) and self._status[-1][0] >= when

    def close(self) -> None:
        """Stop polling."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=STATUS_TIMEOUT_S)
