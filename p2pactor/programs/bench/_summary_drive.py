"""The bench's one hostile-peer driver: an attack run against the victim, and measured.

:func:`run_attack` starts the hostile peer (:mod:`p2pactor.programs.bench._hostile`,
``--paced``) and around each of its steps reads the victim's RSS and peak (its
``VmHWM`` started afresh before the step), the honest peer's figures and what the
:class:`~p2pactor.programs.bench._summary_victim.Monitor` saw; once the hostile peer has
left and the victim ended its session, what the victim kept. The ``summary-attack``
section and ``tests/test_summary_attack.py`` both drive their attacks through it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from p2pactor.programs.bench._control_common import LineProcess, free_port, percentile
from p2pactor.programs.bench._summary_victim import Monitor, Victim, VictimSettings, Window

STEP_TIMEOUT_S = 300.0
"""The longest a step may take (a flood on a loaded 2-core machine)."""
SETTLE_CAP_S = 30.0
"""The longest the victim may take to fold a step's summaries in before it is read anyway."""


class HonestPeer(LineProcess):
    """The honest node's process (:mod:`p2pactor.programs.bench._honest`): 4 keys, 50 Hz."""

    def __init__(self, port: int, victim: Victim, stderr: Path) -> None:
        s = victim.settings
        super().__init__(
            "p2pactor.programs.bench._honest",
            *(f"--port={port}", f"--victim={s.node_id}", "--keys=4", "--rate=50"),
            *(f"--hash-seed={s.hash_seed}", f"--block-len={s.block_len}", f"--preload={s.preload}"),
            stderr=str(stderr),
        )

    def start(self) -> None:
        """Wait until it is up, then start its lookups."""
        self.wait_ready()
        self.ask({"cmd": "start"})

    def window(self) -> dict[str, Any]:
        """Its figures since the last window; a new one begins."""
        return self.ask({"cmd": "window"})


@attrs.frozen(kw_only=True)
class StepResult:
    """One step of an attack, as the victim lived it (RSS and peak in KiB)."""

    label: str
    hostile: dict[str, Any]
    """What the hostile peer said of the step (its ``DONE`` line)."""
    rss_before_kib: int
    peak_kib: int
    """The victim's ``VmHWM`` after the step (started afresh just before it)."""
    rss_after_kib: int
    """The victim's RSS once the step was over (and what it sent folded in)."""
    claimed_keys: int | None
    """The keys the victim's ``/status`` says the hostile peer claims after the step (None:
    the step had no session of its own)."""
    honest: dict[str, Any]
    """The honest peer's figures during the step (:func:`merge_honest`'s keys)."""
    window: Window


@attrs.frozen(kw_only=True)
class AttackResult:
    """One attack: its steps, what the victim kept, the honest peer's figures (KiB)."""

    attack: str
    steps: tuple[StepResult, ...]
    rss_before_kib: int
    """The victim's RSS before the hostile peer connected."""
    peak_kib: int
    """The victim's largest RSS from the hostile peer's connect until its session ended."""
    kept_kib: int
    """The victim's RSS once the hostile session had ended."""
    honest: dict[str, Any]
    """The honest peer's figures over the same time (:func:`merge_honest`'s keys)."""
    window: Window

    @property
    def peak_growth_mib(self) -> float:
        """The victim's peak RSS over what it had before, in MiB."""
        return (self.peak_kib - self.rss_before_kib) / 1024

    @property
    def held_mib(self) -> float:
        """The victim's RSS after the last step, the session still open, over before, in MiB."""
        return (self.steps[-1].rss_after_kib - self.rss_before_kib) / 1024 if self.steps else 0.0

    @property
    def kept_mib(self) -> float:
        """The RSS the victim still had after the session ended, over before, in MiB."""
        return (self.kept_kib - self.rss_before_kib) / 1024


@contextlib.contextmanager
def arena(settings: VictimSettings, work: Path) -> Iterator[tuple[Victim, Monitor, HonestPeer]]:
    """A fresh victim, its monitor and an honest peer looking it up; all stopped after."""
    victim = Victim(settings, work / f"victim-{time.time_ns()}.err")
    honest: HonestPeer | None = None
    monitor: Monitor | None = None
    try:
        victim.wait_ready()
        honest = HonestPeer(free_port(), victim, work / f"honest-{time.time_ns()}.err")
        honest.start()
        monitor = Monitor(victim)
        yield victim, monitor, honest
    finally:
        if monitor is not None:
            monitor.close()
        if honest is not None:
            honest.close()  # it stops its lookups and exits once its stdin closes
            honest.kill()
        victim.close()


def run_attack(
    attack: str,
    args: list[str],
    *,
    victim: Victim,
    monitor: Monitor,
    honest: HonestPeer,
    work_dir: Path,
) -> AttackResult:
    """Run ``attack`` (with the hostile peer's extra ``args``) against ``victim``; measure it."""
    s = victim.settings
    hostile = LineProcess(
        "p2pactor.programs.bench._hostile",
        *(f"--victim={s.node_id}", f"--attack={attack}", "--paced", f"--preload={s.preload}"),
        *(f"--hash-seed={s.hash_seed}", f"--block-len={s.block_len}", *args),
        stderr=str(work_dir / f"hostile-{attack}-{time.time_ns()}.err"),
    )

    def said(*words: str, timeout: float = STEP_TIMEOUT_S) -> tuple[str, Any]:
        return hostile.expect(*words, timeout=timeout)

    steps: list[StepResult] = []
    segments: list[dict[str, Any]] = []  # the honest peer's windows, the attack's whole life

    def honest_window() -> dict[str, Any]:
        segments.append(honest.window())
        return merge_honest(segments[-1:])

    def peers(document: dict[str, Any], *, closed: bool = False) -> list[str]:
        recent = document.get("closed_sessions", {}).get("recent", [])
        return [str(p.get("peer")) for p in (recent if closed else document.get("peers", []))]

    try:
        said("LOADED", timeout=120)
        # Its process is up: from here on what the victim does is the attack's.
        base, _ = victim.memory_kib()
        victim.reset_peak()
        honest.window()  # before the attack: not its
        start = time.time()
        hostile.send("go")
        _, peer = said("READY", timeout=120)
        peaks = [victim.memory_kib()[1]]
        while said("STEP", "RESULT")[0] != "RESULT":
            rss, hwm = victim.memory_kib()
            peaks.append(hwm)
            victim.reset_peak()
            honest_window()
            t_go = time.time()
            hostile.send("go")
            _, done = said("DONE")
            if done.get("mode") == "fresh":  # the victim read it and refused it
                gone = str(done["peer"])
                victim.wait_status(lambda d: gone in peers(d, closed=True), 120, "a refusal")  # noqa: B023 - called at once
            claimed = _settled_claims(victim, peer) if peer != "-" else None
            after, peak = victim.memory_kib()
            window = monitor.window(t_go, time.time())  # the step's own
            steps.append(
                StepResult(
                    label=str(done["label"]),
                    hostile=done,
                    rss_before_kib=rss,
                    peak_kib=peak,
                    rss_after_kib=after,
                    claimed_keys=claimed,
                    honest=honest_window(),
                    window=window,
                )
            )
        peaks.append(victim.memory_kib()[1])
        victim.reset_peak()
        assert hostile.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            hostile.proc.stdin.close()  # it says disconnect, then LEFT, and exits
        said("LEFT", timeout=60)
        hostile.proc.wait(timeout=60)
        if peer != "-":
            victim.wait_status(lambda d: peer not in peers(d), 60, f"the end of {peer}")
        time.sleep(0.3)  # what leaving sets off (the session's end) runs its course
        kept, peak_end = victim.memory_kib()
        end = time.time()
        honest_window()
    finally:
        hostile.kill()
    whole = monitor.window(start, end)
    return AttackResult(
        attack=attack,
        steps=tuple(steps),
        rss_before_kib=base,
        peak_kib=max([*peaks, peak_end, *(st.peak_kib for st in steps)]),
        kept_kib=kept,
        honest=merge_honest(segments),
        window=whole,
    )


def _settled_claims(victim: Victim, peer: str) -> int | None:
    """``peer``'s claims at ``victim`` (None: not listed) once it applied all it read.

    The victim read them all (the step ended with a lookup it answered after them); it
    applies them a slice at a time, which may outlast the step: ``/status`` says while
    any wait.
    """
    deadline = time.monotonic() + SETTLE_CAP_S
    while victim.status().get("sources", {}).get("index_pending") and time.monotonic() < deadline:
        time.sleep(0.05)
    for entry in victim.status().get("sources", {}).get("peers", []):
        if entry.get("peer") == peer:
            return int(entry.get("claimed_keys", 0))
    return None


def merge_honest(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The honest peer's windows as one: lookups, p50/p99/max (s), verified, failures."""
    xs = [float(x) for w in windows for x in w.get("latencies_s", [])]
    return {
        "lookups": len(xs),
        "lookup_p50_s": percentile(xs, 0.5) if xs else None,
        "lookup_p99_s": percentile(xs, 0.99) if xs else None,
        "lookup_max_s": max(xs, default=None),
        "verified": sum(int(w.get("verified", 0)) for w in windows),
        "failed": sum(int(w.get("failed", 0)) for w in windows),
        "failures": [f for w in windows for f in w.get("failures", [])][:5],
        "latencies_s": xs,
    }
