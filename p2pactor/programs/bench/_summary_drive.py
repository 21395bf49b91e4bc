"""Runs one attack of the ``summary-attack`` section against the victim, and measures it.

:func:`run_attack` starts the hostile peer (:mod:`p2pactor.programs.bench._hostile`,
a process of its own, ``--paced``) and, before each of its steps, reads the
victim's RSS and starts its peak (``VmHWM``) afresh; after each step it reads
both again and asks the :class:`~p2pactor.programs.bench._summary_victim.Monitor`
what it saw meanwhile (the node thread's longest step, ``/status``'s
latency). Once the hostile peer has left and the victim has ended its
session, it reads what the victim kept. The honest peer's figures cover the
whole attack, from the first step to the session's end.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import attrs

from p2pactor.programs.bench._control_common import (
    LineProcess,
    percentile,
)
from p2pactor.programs.bench._summary_victim import (
    Monitor,
    Victim,
    Window,
)

HOSTILE = "p2pactor.programs.bench._hostile"
HONEST = "p2pactor.programs.bench._honest"
SETTLE_READ_S = 0.05
"""How often the victim's /status is read while it applies a step's summaries."""
SETTLE_CAP_S = 30.0
"""The longest the victim may take to fold a step's summaries in before it is read anyway."""
STEP_TIMEOUT_S = 300.0
"""The longest a step may take (a flood on a loaded 2-core machine)."""


class HostileProcess(LineProcess):
    """The hostile peer's process (:mod:`p2pactor.programs.bench._hostile`), paced by stdin."""

    def __init__(self, victim: str, attack: str, args: list[str], stderr: Path, **env: str) -> None:
        self.attack = attack
        super().__init__(
            HOSTILE, f"--victim={victim}", f"--attack={attack}", *args, stderr=str(stderr), **env
        )

    def expect(self, *words: str, timeout: float | None = STEP_TIMEOUT_S) -> tuple[str, Any]:
        """The next line starting with one of ``words`` (within a step's time by default)."""
        return super().expect(*words, timeout=timeout)

    def go(self) -> None:
        """Let it take its next step."""
        self.send("go")

    def leave(self, timeout: float = 60.0) -> dict[str, Any]:
        """Close its stdin (it says ``disconnect`` and exits); what it said meanwhile, by word."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        said: dict[str, Any] = {}
        while (got := self.expect("DONE", "RESULT", "LEFT", timeout=timeout))[0] != "LEFT":
            said[got[0]] = got[1]
        self.proc.wait(timeout=timeout)
        return said


class HonestPeer:
    """The honest node's process (:mod:`p2pactor.programs.bench._honest`)."""

    def __init__(self, port: int, victim: Victim, stderr: Path) -> None:
        s = victim.settings
        self._proc = LineProcess(
            HONEST,
            f"--port={port}",
            f"--victim={s.node_id}",
            "--keys=4",
            "--rate=50",
            f"--hash-seed={s.hash_seed}",
            f"--block-len={s.block_len}",
            f"--preload={s.preload}",
            stderr=str(stderr),
        )

    def start(self) -> None:
        """Wait until it is up, then start its lookups."""
        self._proc.wait_ready()
        self._proc.ask({"cmd": "start"})

    def window(self) -> dict[str, Any]:
        """Its figures since the last window; a new one begins."""
        return self._proc.ask({"cmd": "window"})

    def close(self) -> None:
        """Stop it."""
        self._proc.close()

    def kill(self) -> None:
        """Kill it if it still runs."""
        self._proc.kill()


@attrs.frozen(kw_only=True)
class StepResult:
    """One step of an attack, as the victim lived it."""

    label: str
    hostile: dict[str, Any]
    """What the hostile peer said of the step (its ``DONE`` line)."""
    rss_before_kib: int
    """The victim's RSS just before the step."""
    peak_kib: int
    """The victim's ``VmHWM`` after the step (started afresh just before it)."""
    rss_after_kib: int
    """The victim's RSS once the step was over (and what it sent folded in)."""
    claimed_keys: int | None
    """How many keys the victim takes the hostile peer to claim after the step (its
    ``/status``), None when the step had no session of its own."""
    honest: dict[str, Any]
    """The honest peer's figures during the step (:func:`merge_honest`'s keys)."""
    window: Window


@attrs.frozen(kw_only=True)
class AttackResult:
    """One attack: its steps, what the victim kept, the honest peer's figures."""

    attack: str
    steps: tuple[StepResult, ...]
    received: dict[str, int]
    """Messages the hostile peer received from the victim, by type."""
    rss_before_kib: int
    """The victim's RSS before the hostile peer connected."""
    peak_kib: int
    """The victim's largest RSS from the hostile peer's connect until its session ended."""
    kept_kib: int
    """The victim's RSS once the hostile session had ended."""
    honest: dict[str, Any]
    """The honest peer's figures over the same time (:func:`merge_honest`'s keys)."""
    window: Window
    """What the monitor saw over the same time."""

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


def run_attack(
    attack: str,
    args: list[str],
    *,
    victim: Victim,
    monitor: Monitor,
    honest: HonestPeer | None,
    work_dir: Path,
    settle_s: float = 0.3,
) -> AttackResult:
    """Run ``attack`` (with the hostile peer's extra ``args``) against ``victim``; measure it."""
    s = victim.settings
    hostile = HostileProcess(
        s.node_id,
        attack,
        ["--paced", "--linger", f"--hash-seed={s.hash_seed}", f"--block-len={s.block_len}", *args],
        work_dir / f"hostile-{attack}-{time.time_ns()}.err",
    )
    steps: list[StepResult] = []
    segments: list[dict[str, Any]] = []  # the honest peer's windows, the attack's whole life

    def honest_window() -> dict[str, Any]:
        window = honest.window() if honest is not None else merge_honest([])
        segments.append(window)
        return window

    try:
        hostile.expect("LOADED", timeout=120)
        # Its process is up: from here on what the victim does is the attack's.
        base, _ = victim.memory_kib()
        victim.reset_peak()
        if honest is not None:
            honest.window()  # before the attack: not its
        start = time.time()
        hostile.go()
        _, peer = hostile.expect("READY", timeout=120)
        _, between_peak = victim.memory_kib()
        while True:
            word, body = hostile.expect("STEP", "RESULT")
            if word == "RESULT":
                received = dict(body["received"])
                break
            rss, hwm = victim.memory_kib()
            between_peak = max(between_peak, hwm)
            victim.reset_peak()
            honest_window()
            t_go = time.time()
            hostile.go()
            _, done = hostile.expect("DONE")
            if done.get("mode") == "fresh":
                victim.wait_closed(str(done["peer"]))  # the victim read it and refused it
            # The victim may fold a summary in over several steps: the step lasts
            # until what it holds of the peer's claims stops changing.
            claimed = _settled_claims(victim, peer) if peer != "-" else None
            after, peak = victim.memory_kib()
            steps.append(
                StepResult(
                    label=str(done["label"]),
                    hostile=done,
                    rss_before_kib=rss,
                    peak_kib=peak,
                    rss_after_kib=after,
                    claimed_keys=claimed,
                    honest=honest_window(),
                    window=monitor.window(t_go, time.time()),  # the step's own
                )
            )
        _, hwm = victim.memory_kib()
        between_peak = max(between_peak, hwm)
        victim.reset_peak()
        hostile.leave()
        if peer != "-":
            victim.wait_gone(peer)
        time.sleep(settle_s)  # what leaving sets off (the session's end) runs its course
        kept, peak_end = victim.memory_kib()
        end = time.time()
        honest_window()
    finally:
        hostile.kill()
    whole = monitor.window(start, end)
    return AttackResult(
        attack=attack,
        steps=tuple(steps),
        received=received,
        rss_before_kib=base,
        peak_kib=max([between_peak, peak_end, whole.max_rss_kib, *(st.peak_kib for st in steps)]),
        kept_kib=kept,
        honest=merge_honest(segments),
        window=whole,
    )


def _claimed(victim: Victim, peer: str) -> int | None:
    """How many keys ``victim``'s index holds of ``peer``'s claims now (None: not listed)."""
    for entry in victim.status().get("sources", {}).get("peers", []):
        if entry.get("peer") == peer:
            return int(entry.get("claimed_keys", 0))
    return None


def _settled_claims(victim: Victim, peer: str) -> int | None:
    """``peer``'s claims at ``victim`` once it has applied every summary message it read.

    The victim read them all (the step ended with a lookup it answered after
    them); it applies them a slice at a time: ``/status`` says while any wait.
    """
    deadline = time.monotonic() + SETTLE_CAP_S
    while time.monotonic() < deadline:
        if not victim.status().get("sources", {}).get("index_pending", False):
            break
        time.sleep(SETTLE_READ_S)
    return _claimed(victim, peer)


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
