"""The bench's one hostile-peer driver: the victim, the honest peer, an attack run and measured.

The victim is ``p2pactor serve`` as a process (:class:`Victim`), its memory read from
``/proc/PID/status``, its ``/status`` on a thread for the node thread's longest step.
:func:`run_attack` starts the hostile peer (:mod:`p2pactor.programs.bench._hostile`) and
measures each of its steps and the whole attack, for the ``summary-attack`` section and
``tests/test_summary_attack.py`` alike.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from p2pactor.programs.bench._control_common import (
    ChildError,
    LineProcess,
    free_port,
    memory_kib,
    percentile,
)

STEP_TIMEOUT_S = 300.0
"""The longest a step may take (a flood on a loaded 2-core machine)."""
SETTLE_CAP_S = 30.0
"""The longest the victim may take to fold a step's summaries in before it is read anyway."""
STATUS_POLL_S = 0.1
"""How often ``/status`` is asked: often enough that the 32 slow steps it lists do not
overflow between two reads unless slow steps follow each other back to back."""


@attrs.frozen(kw_only=True)
class VictimSettings:
    """How the victim is started: each field the ``p2pactor serve`` flag of its name."""

    port: int
    metrics_port: int
    num_blocks: int = 16_384
    block_len: int = 1024
    preload: int = 16_384
    hash_seed: str = "summary-attack"
    slow_step_ms: float | None = 10.0
    """``serve --slow-step-ms`` (the node's slow-step watch, for the longest step); None: none."""

    @property
    def peer_spec(self) -> dict[str, Any]:
        """What the honest and hostile peers are told of the victim (in their JSON argument)."""
        spec = {"victim": f"127.0.0.1:{self.port}", "hash_seed": self.hash_seed}
        return spec | {"preload": self.preload, "block_len": self.block_len}


class Victim(LineProcess):
    """``p2pactor serve`` as a process, its ``/status`` read on a thread; :meth:`stop` ends both."""

    def __init__(self, settings: VictimSettings, stderr: Path) -> None:
        self.settings = s = settings
        given = attrs.asdict(s).items()
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in given if v is not None]
        super().__init__("p2pactor", "serve", "--host=127.0.0.1", *flags, stderr=str(stderr))
        self.url = f"http://127.0.0.1:{s.metrics_port}/status"
        self._stop, self._lock = threading.Event(), threading.Lock()
        self._asked = 0.0  # when the last /status read that answered was asked (unix s)
        self._slow: set[tuple[float, float, str]] = set()
        self.watching = False  # it reports its slow steps (``loop`` in /status)
        self._watch = threading.Thread(target=self._poll, daemon=True)

    def wait_serving(self, timeout: float = 120.0) -> None:
        """Wait until it serves (its ``p2pactor node ... serving`` line) and ``/status`` answers."""
        deadline = time.monotonic() + timeout
        while not (
            (line := self.line(deadline - time.monotonic())).startswith("p2pactor node")
            and "serving" in line
        ):
            pass
        self.wait_status(lambda _: True, deadline - time.monotonic(), "its /status")
        self._watch.start()

    def _poll(self) -> None:
        while not self._stop.wait(STATUS_POLL_S):
            t0 = time.time()
            try:
                loop = self.status().get("loop")
            except (OSError, ValueError):
                continue
            with self._lock:
                self._asked = t0
                if isinstance(loop, dict):
                    self.watching = True
                    for s in loop.get("recent_slow", []):
                        self._slow.add((float(s["at"]), float(s["seconds"]), str(s["task"])))

    def window(self, start: float, end: float) -> tuple[float | None, str]:
        """Its node thread's longest slow step begun from ``start`` to ``end`` (unix s), its task.

        None if it has no watch, "" if no step was slow. Waits (at most 10 s) for a read of
        ``/status`` asked after ``end``: only those list a slow step that ended in the window.
        """
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self._asked < end:
            time.sleep(STATUS_POLL_S / 4)
        with self._lock:
            slow = max(((s, t) for at, s, t in self._slow if start <= at <= end), default=None)
        return ((slow[0] if slow else 0.0) if self.watching else None), slow[1] if slow else ""

    def reset_peak(self) -> tuple[int, int]:
        """Its ``(VmRSS, VmHWM)`` in KiB, then ``VmHWM`` started afresh (``5`` to clear_refs)."""
        now = memory_kib(self.pid)
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")
        return now

    def status(self) -> dict[str, Any]:
        """Its ``/status`` document."""
        with urllib.request.urlopen(self.url, timeout=30) as answer:  # noqa: S310 - loopback
            document: dict[str, Any] = json.load(answer)
        return document

    def wait_status(
        self, condition: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> None:
        """Poll ``/status`` until ``condition`` holds of it; raise naming ``what`` if not."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            with contextlib.suppress(OSError):  # not serving yet, or too busy: ask again
                if condition(self.status()):
                    return
            if time.monotonic() > deadline:
                raise ChildError(f"the victim did not show {what} within {timeout:g} s")
            time.sleep(0.05)
        raise ChildError(
            f"p2pactor serve exited with {self.proc.returncode} while it was "
            f"watched for {what} (its stderr ends: {self.why()})"
        )

    def stop(self) -> None:
        """Stop reading its ``/status``; stop it (SIGTERM, then SIGKILL after 20 s), reap it."""
        self._stop.set()
        if self._watch.is_alive():
            self._watch.join(timeout=30)
        if self.proc.poll() is None:
            self.proc.terminate()
        self.close(timeout=20)  # kills it if it has not exited by then
        self.kill()


class HonestPeer(LineProcess):
    """The honest node's process (:mod:`p2pactor.programs.bench.summary_attack`'s)."""

    def __init__(self, victim: Victim, stderr: Path) -> None:
        spec = json.dumps({"port": free_port(), **victim.settings.peer_spec})
        super().__init__("p2pactor.programs.bench.summary_attack", spec, stderr=str(stderr))
        self.wait_ready()  # its lookups have begun

    def window(self) -> dict[str, Any]:
        """Its figures since the last window (:func:`merge_honest`'s keys); a new one begins."""
        return merge_honest([self.ask({})])


def merge_honest(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The honest peer's windows as one: lookups, p50/p99 (s), failures."""
    xs = [float(x) for w in windows for x in w["latencies_s"]]
    return {
        "lookups": len(xs),
        "lookup_p50_s": percentile(xs, 0.5) if xs else None,
        "lookup_p99_s": percentile(xs, 0.99) if xs else None,
        "failed": sum(int(w["failed"]) for w in windows),
        "failures": [f for w in windows for f in w["failures"]][:5],
        "latencies_s": xs,
    }


@attrs.frozen(kw_only=True)
class StepResult:
    """A step of an attack, or the whole attack (its name its label), as the victim lived it.

    RSS in KiB: before the step; its peak (``VmHWM``, started afresh just before it).
    """

    label: str
    hostile: dict[str, Any]
    """What the hostile peer said of the step (its ``DONE`` line; an attack's: its last)."""
    rss_before_kib: int
    peak_kib: int
    claimed_keys: int | None = None
    """The keys the victim's ``/status`` says the hostile peer claims after the step (None:
    the step had no session of its own)."""
    honest: dict[str, Any]
    """The honest peer's figures during the step (:func:`merge_honest`'s keys)."""
    longest_step_s: float | None
    """The node thread's longest slow step that began in it (None: no watch)."""
    longest_task: str
    """What the longest step ran (the task the slow-step watch names; "" if none)."""
    steps: tuple[StepResult, ...] = ()
    """An attack's steps (none: this is a step)."""
    kept_kib: int | None = None
    """An attack's: the victim's RSS once the hostile session had ended."""

    @property
    def peak_growth_mib(self) -> float:
        """The victim's peak RSS over what it had before, in MiB."""
        return (self.peak_kib - self.rss_before_kib) / 1024

    @property
    def kept_mib(self) -> float | None:
        """The RSS the victim still had once the session ended, over before (None: a step)."""
        return None if self.kept_kib is None else (self.kept_kib - self.rss_before_kib) / 1024


@contextlib.contextmanager
def arena(settings: VictimSettings, work: Path) -> Iterator[tuple[Victim, HonestPeer]]:
    """A fresh victim and an honest peer looking it up; both stopped after."""
    victim = Victim(settings, work / f"victim-{time.time_ns()}.err")
    honest: HonestPeer | None = None
    try:
        victim.wait_serving()
        honest = HonestPeer(victim, work / f"honest-{time.time_ns()}.err")
        yield victim, honest
    finally:
        if honest is not None:
            honest.close()  # it stops its lookups and exits once its stdin closes
            honest.kill()
        victim.stop()


def _peers(document: dict[str, Any], *, closed: bool = False) -> list[str]:
    recent = document.get("closed_sessions", {}).get("recent", [])
    return [str(p.get("peer")) for p in (recent if closed else document.get("peers", []))]


def run_attack(
    attack: str, options: dict[str, Any], *, victim: Victim, honest: HonestPeer, work_dir: Path
) -> StepResult:
    """Run ``attack`` (with the hostile peer's ``options``) against ``victim``; measure it."""
    hostile = LineProcess(
        "p2pactor.programs.bench._hostile",
        json.dumps({**victim.settings.peer_spec, "attack": attack, **options}),
        stderr=str(work_dir / f"hostile-{attack}-{time.time_ns()}.err"),
    )

    def said(*words: str, timeout: float = STEP_TIMEOUT_S) -> tuple[str, Any]:
        return hostile.expect(*words, timeout=timeout)

    steps: list[StepResult] = []
    segments: list[dict[str, Any]] = []  # the honest peer's windows, the attack's whole life
    try:
        said("LOADED", timeout=120)
        # Its process is up: from here on what the victim does is the attack's.
        base = victim.reset_peak()[0]
        honest.window()  # before the attack: not its
        start = time.time()
        hostile.send("go")
        _, peer = said("READY", timeout=120)
        peaks: list[int] = []  # VmHWM before each reset: between them they saw every peak
        while said("STEP", "RESULT")[0] != "RESULT":
            rss, hwm = victim.reset_peak()
            peaks.append(hwm)
            segments.append(honest.window())
            t_go = time.time()
            hostile.send("go")
            _, done = said("DONE")
            if done.get("mode") == "fresh":  # the victim read it and refused it
                gone = str(done["peer"])
                victim.wait_status(lambda d: gone in _peers(d, closed=True), 120, "a refusal")  # noqa: B023 - called at once
            claimed = _settled_claims(victim, peer) if peer != "-" else None
            peak = memory_kib(victim.pid)[1]
            longest, task = victim.window(t_go, time.time())  # the step's own
            segments.append(honest.window())
            steps.append(
                StepResult(
                    label=str(done["label"]),
                    hostile=done,
                    rss_before_kib=rss,
                    peak_kib=peak,
                    claimed_keys=claimed,
                    honest=segments[-1],
                    longest_step_s=longest,
                    longest_task=task,
                )
            )
        peaks.append(victim.reset_peak()[1])
        assert hostile.proc.stdin is not None
        hostile.proc.stdin.close()  # it says disconnect, then LEFT, and exits
        said("LEFT", timeout=60)
        hostile.proc.wait(timeout=60)
        if peer != "-":
            victim.wait_status(lambda d: peer not in _peers(d), 60, f"the end of {peer}")
        time.sleep(0.3)  # what leaving sets off (the session's end) runs its course
        kept, peak_end = memory_kib(victim.pid)
        end = time.time()
        segments.append(honest.window())
    finally:
        hostile.kill()
    last = steps[-1] if steps else None
    longest, task = victim.window(start, end)
    return StepResult(
        label=attack,
        hostile=last.hostile if last else {},
        rss_before_kib=base,
        peak_kib=max(*peaks, peak_end),
        claimed_keys=last.claimed_keys if last else None,
        honest=merge_honest(segments),
        longest_step_s=longest,
        longest_task=task,
        steps=tuple(steps),
        kept_kib=kept,
    )


def _settled_claims(victim: Victim, peer: str) -> int | None:
    """``peer``'s claims at ``victim`` (None: not listed) once it applied all it read.

    It applies them a slice at a time, which may outlast the step: ``/status`` says while.
    """
    deadline = time.monotonic() + SETTLE_CAP_S
    while victim.status().get("sources", {}).get("index_pending") and time.monotonic() < deadline:
        time.sleep(0.05)
    for entry in victim.status().get("sources", {}).get("peers", []):
        if entry.get("peer") == peer:
            return int(entry.get("claimed_keys", 0))
    return None
