"""The victim of the bench's hostile-peer driver: ``p2pactor serve``, and what watches it.

:class:`Victim` is ``p2pactor serve`` as a process (summaries on, preloaded so that an
honest peer has something to look up); its memory is read from ``/proc/PID/status``
(``VmRSS``; ``VmHWM``, the peak, started afresh by :meth:`Victim.reset_peak`).
:class:`Monitor` polls its ``/status`` on a thread, so that a window of time can be
asked afterwards for the node thread's longest step (the slow-step
watch's ``loop.recent_slow``) and the longest ``/status`` took.
"""

from __future__ import annotations

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

from p2pactor.programs.bench._control_common import ChildError, LineProcess

STATUS_POLL_S = 0.1
"""How often ``/status`` is asked: often enough that the 32 slow steps it lists do not
overflow between two reads unless slow steps follow each other back to back."""
STATUS_TIMEOUT_S = 30.0


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
    """``serve --slow-step-ms`` (the node's slow-step watch, for the longest step); None: none."""

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
        """Its ``(VmRSS, VmHWM)`` in KiB; ``(0, 0)`` once it is gone."""
        got = {"VmRSS:": 0, "VmHWM:": 0}
        with contextlib.suppress(OSError), open(f"/proc/{self.pid}/status") as status:
            for fields in map(str.split, status):
                if fields and fields[0] in got:
                    got[fields[0]] = int(fields[1])
        return got["VmRSS:"], got["VmHWM:"]

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
                    f"for {what} (its stderr, {self.stderr}, ends: {self.child.why()})"
                )
            with contextlib.suppress(OSError):  # not serving yet, or too busy: ask again
                if condition(document := self.status()):
                    return document
            if time.monotonic() > deadline:
                raise ChildError(f"the victim did not show {what} within {timeout:g} s")
            time.sleep(0.05)

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

    longest_step_s: float | None
    """The node thread's longest slow step that began in the window (None: no watch)."""
    longest_task: str
    """What the longest step ran (the task the slow-step watch names; "" if none)."""
    status_max_s: float | None
    """The longest ``/status`` took to answer (None: never asked)."""


class Monitor:
    """Reads the victim's ``/status`` on a thread until :meth:`close`.

    Its RSS needs no polling: its ``VmHWM``, read before each reset, is the exact peak.
    """

    def __init__(self, victim: Victim) -> None:
        self._victim = victim
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._status: list[tuple[float, float]] = []  # (asked at, seconds to answer)
        self._slow: set[tuple[float, float, str]] = set()
        self.watching = False  # the victim reports its slow steps (``loop`` in /status)
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(STATUS_POLL_S):
            t0 = time.time()
            try:
                loop = self._victim.status().get("loop")
            except (OSError, ValueError):
                continue
            with self._lock:
                self._status.append((t0, time.time() - t0))
                if isinstance(loop, dict):
                    self.watching = True
                    for s in loop.get("recent_slow", []):
                        self._slow.add((float(s["at"]), float(s["seconds"]), str(s["task"])))

    def window(self, start: float, end: float) -> Window:
        """What was seen from ``start`` to ``end`` (unix seconds).

        Waits (at most 10 s) for a read of ``/status`` asked after ``end``: a slow step
        that ended in the window is listed only by the reads after it.
        """
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with self._lock:
                if self._status and self._status[-1][0] >= end:
                    break
            time.sleep(STATUS_POLL_S / 4)
        with self._lock:
            took = [s for t, s in self._status if start <= t <= end]
            slow = max(((s, t) for at, s, t in self._slow if start <= at <= end), default=None)
            watching = self.watching
        return Window(
            longest_step_s=(slow[0] if slow else 0.0) if watching else None,
            longest_task=slow[1] if slow else "",
            status_max_s=max(took, default=None),
        )

    def close(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join(timeout=STATUS_TIMEOUT_S)
