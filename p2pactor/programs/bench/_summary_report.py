"""The ``summary-attack`` section's table: one row per attack, against issue 30's targets.

:func:`tabulate` turns the repeats (each a fresh victim: a baseline, every
attack, the liar) into a :class:`~p2pactor.programs.bench.report.SectionResult`:
medians over repeats with ``[min..max]``, each row's own figure, and a
verdict per row naming every target it missed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from p2pactor.programs.bench._summary_drive import AttackResult, StepResult
from p2pactor.programs.bench._summary_liar import LiarResult
from p2pactor.programs.bench._summary_victim import VictimSettings, Window
from p2pactor.programs.bench.report import Cell, SectionResult, Stat

RSS_TARGET_MIB = 64.0
"""Issue 30: the victim's RSS grows at most this much per hostile peer."""
STALL_TARGET_MS = 50.0
"""Issue 30: no step of the node thread longer than this."""
P99_TARGET_X = 2.0
"""Issue 30: the honest peer's lookup p99 at most this many times the baseline's."""
LIAR_TARGET = 10
"""Issue 30: a HIT-then-fail liar quarantined after at most this many misrouted requests."""
FRAME_TARGET_X = 2.0
"""Issue 30: a refused frame costs at most this many times its size."""
EPOCH_TARGET = 2
"""Issue 30: an epoch flipper earns one resync, or a small constant: at most this many."""
PART_KEYS = 8192
"""Fingerprints in one snapshot part the victim sends (``SummaryOptions.part_keys``)."""
MIB = 1 << 20


@attrs.frozen
class Attack:
    """One attack of the plan: its row, the hostile peer's ``--attack`` and extra arguments."""

    row: str
    name: str
    args: tuple[str, ...] = ()


@attrs.frozen(kw_only=True)
class Repeat:
    """One repeat: a fresh victim's baseline and attacks, and the liar row."""

    baseline: dict[str, Any]
    attacks: dict[str, AttackResult]
    liar: LiarResult
    watched: bool
    """Whether the victim's ``/status`` had the slow-step watch's ``loop``."""


def parts_per_snapshot(settings: VictimSettings) -> int:
    """Parts of one of the victim's snapshots (it holds its preloaded keys)."""
    return max(1, -(-settings.preload // PART_KEYS))


def _stat(values: Sequence[float | None]) -> Stat | None:
    xs = [v for v in values if v is not None]
    return Stat.of(xs) if xs else None


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def _size(n: int) -> str:
    return f"{n / MIB:g} MiB" if n % MIB == 0 else f"{n:,} B"


@attrs.define
class _Row:
    """What one row gathers over the repeats, before it becomes a table row."""

    name: str
    peak: list[float | None] = attrs.field(factory=list)
    held: list[float | None] = attrs.field(factory=list)
    kept: list[float | None] = attrs.field(factory=list)
    step_ms: list[float | None] = attrs.field(factory=list)
    task: str = ""
    p50: list[float | None] = attrs.field(factory=list)
    p99: list[float | None] = attrs.field(factory=list)
    ratio: list[float | None] = attrs.field(factory=list)
    failed: int = 0
    status_ms: list[float | None] = attrs.field(factory=list)
    figure: str = ""
    value: list[float | None] = attrs.field(factory=list)
    misses: list[str] = attrs.field(factory=list)

    def watch(self, window: Window, honest: dict[str, Any], base_p99: float | None) -> None:
        """Add one repeat's node-thread, honest and ``/status`` figures."""
        self.step_ms.append(_ms(window.longest_step_s))
        longest = max((x for x in self.step_ms if x is not None), default=0.0)
        if window.longest_step_s is not None and window.longest_step_s * 1e3 >= longest:
            self.task = window.longest_task
        p99 = honest.get("lookup_p99_s")
        self.p50.append(_ms(honest.get("lookup_p50_s")))
        self.p99.append(_ms(p99))
        self.ratio.append(p99 / base_p99 if p99 is not None and base_p99 else None)
        self.failed += int(honest.get("failed", 0))
        self.status_ms.append(_ms(window.status_max_s))

    def verdict(self, own: Callable[[float], str | None] | None) -> str:
        """``ok``, or every target the medians missed."""
        out = []
        peak = _stat(self.peak)
        if peak is not None and peak.median > RSS_TARGET_MIB:
            out.append(f"RSS +{peak.median:.0f} MiB > {RSS_TARGET_MIB:g}")
        stall = _stat(self.step_ms)
        if stall is not None and stall.median > STALL_TARGET_MS:
            out.append(f"stall {stall.median:.0f} ms > {STALL_TARGET_MS:g}")
        ratio = _stat(self.ratio)
        if ratio is not None and ratio.median > P99_TARGET_X:
            out.append(f"p99 x{ratio.median:.1f} > {P99_TARGET_X:g}")
        if self.failed:
            out.append(f"{self.failed} honest lookups failed")
        value = _stat(self.value)
        if own is not None and value is not None and (miss := own(value.median)):
            out.append(miss)
        self.misses = out
        return "; ".join(out) or "ok"

    def cells(self, own: Callable[[float], str | None] | None = None) -> dict[str, Cell]:
        """The table row."""
        return {
            "attack": self.name,
            "RSS peak MiB": _stat(self.peak),
            "RSS held MiB": _stat(self.held),
            "RSS kept MiB": _stat(self.kept),
            "longest step ms": _stat(self.step_ms),
            "honest p50 ms": _stat(self.p50),
            "honest p99 ms": _stat(self.p99),
            "p99 / baseline": _stat(self.ratio),
            "honest failed": self.failed if self.p99 else None,
            "/status max ms": _stat(self.status_ms),
            "figure": self.figure,
            "value": _stat(self.value),
            "verdict": self.verdict(own),
        }


def _figure(attack: str, result: AttackResult) -> tuple[str, float | None]:
    """The attack's own figure: what it names, and its value in one repeat."""
    done = result.steps[-1].hostile if result.steps else {}
    seconds = float(done.get("end", 0)) - float(done.get("start", 0))
    if attack == "register-1m":
        return "claims the victim kept", result.steps[-1].claimed_keys
    if attack == "snapshot-flood":
        return "s until the victim read them", seconds
    if attack in ("deltas-mid-snapshot", "epoch-flip"):
        return "resyncs the hostile peer got", float(done["resyncs"])
    if attack == "resync-flood":
        return "snapshot parts/s it got", float(done["parts"]) / seconds if seconds else None
    if attack == "max-lookups":
        # Cut off as a flood (its frames waited past inbound_bytes), or every lookup answered.
        return "cut off (1) or all answered (0)", float(bool(done.get("cut")))
    if attack == "max-frames":
        return "MB/s the victim read", float(done["bytes"]) / seconds / 1e6 if seconds else None
    return "", None


def _own_target(attack: str, settings: VictimSettings) -> Callable[[float], str | None] | None:
    """The row's own target, as a check of its median figure (None: it has none)."""
    parts = parts_per_snapshot(settings)
    if attack == "epoch-flip":
        return lambda v: f"{v:.0f} resyncs > {EPOCH_TARGET}" if v > EPOCH_TARGET else None
    if attack == "resync-flood":
        # One snapshot a second per peer, however often it asks (resync_interval_s).
        most = 2 * parts
        return lambda v: f"{v:.1f} parts/s > {most}" if v > most else None
    return None


def _frame_target(value: float) -> str | None:
    """A refused frame's own target: its RSS peak over its size."""
    return f"x{value:.2f} > {FRAME_TARGET_X:g}" if value > FRAME_TARGET_X else None


def _step_row(step: StepResult) -> str:
    mode, size = str(step.hostile["mode"]), int(step.hostile["bytes"])
    where = "in a session" if mode == "session" else "first on a new connection"
    return f"refused frame {where}, {_size(size)}"


def tabulate(
    name: str,
    title: str,
    *,
    attacks: Sequence[Attack],
    runs: Sequence[Repeat],
    settings: VictimSettings,
    baseline_s: float,
    slow_step: bool,
) -> SectionResult:
    """The section's result: the baseline, one row per attack (per frame), the liar."""
    base = _Row("none: the honest peer alone (baseline)", figure="honest lookups")
    for r in runs:
        base.p50.append(_ms(r.baseline.get("lookup_p50_s")))
        base.p99.append(_ms(r.baseline.get("lookup_p99_s")))
        base.failed += int(r.baseline.get("failed", 0))
        base.value.append(float(r.baseline.get("lookups", 0)))
    rows: dict[str, _Row] = {}
    owns: dict[str, Callable[[float], str | None] | None] = {}
    for attack in attacks:
        for r in runs:
            result = r.attacks[attack.row]
            base_p99 = r.baseline.get("lookup_p99_s")
            if attack.name == "refused-frame":
                for step in result.steps:
                    row = rows.setdefault(_step_row(step), _Row(_step_row(step)))
                    row.figure = "RSS peak / frame size"
                    owns[row.name] = _frame_target
                    row.peak.append((step.peak_kib - step.rss_before_kib) / 1024)
                    row.held.append((step.rss_after_kib - step.rss_before_kib) / 1024)
                    row.kept.append(None)
                    row.watch(step.window, step.honest, base_p99)
                    grown = (step.peak_kib - step.rss_before_kib) * 1024
                    row.value.append(grown / int(step.hostile["bytes"]))
                continue
            row = rows.setdefault(attack.row, _Row(attack.row))
            owns[row.name] = _own_target(attack.name, settings)
            row.peak.append(result.peak_growth_mib)
            row.held.append(result.held_mib)
            row.kept.append(result.kept_mib)
            row.watch(result.window, result.honest, base_p99)
            row.figure, value = _figure(attack.name, result)
            row.value.append(value)
    liar = _Row("liar: claims, HIT to every lookup, fails every fetch", figure="misrouted requests")
    liar.value = [float(r.liar.misrouted) for r in runs]
    unquarantined = sum(not r.liar.quarantined for r in runs)
    table = [base.cells()]
    table += [row.cells(owns.get(row.name)) for row in rows.values()]
    table.append(
        liar.cells(
            lambda v: (
                f"{v:.0f} misrouted > {LIAR_TARGET}" if v > LIAR_TARGET or unquarantined else None
            )
        )
    )
    notes = _notes(runs, settings, baseline_s, slow_step=slow_step)
    notes += _targets(base, list(rows.values()), liar, runs)
    return SectionResult(name=name, title=title, rows=table, notes=notes)


def _notes(
    runs: Sequence[Repeat], settings: VictimSettings, baseline_s: float, *, slow_step: bool
) -> list[str]:
    s = settings
    notes = [
        (
            f"{len(runs)} repeat(s), each a fresh victim: p2pactor serve, summaries on (the "
            f"default), {s.preload:,} preloaded blocks of {s.block_len} B "
            f"({parts_per_snapshot(s)} parts a snapshot), /status asked every 0.1 s; the "
            f"honest peer alone {baseline_s:g} s (baseline; its p99 is the median of its 2-s "
            "windows' p99), then each attack with a fresh "
            "hostile process and session, measured from its connect until the victim ended "
            "its session"
        ),
        (
            "honest peer: a p2pactor node looking up 4 preloaded keys 50 times a second, fetching "
            "them and checking every byte; p50/p99 of the lookups, failed = a MISS, a failed fetch "
            f"or a wrong byte; the victim, the honest peer and the hostile process share this "
            f"machine's {os.cpu_count()} cores: the hostile process runs at idle CPU priority "
            "(SCHED_IDLE), as a peer on another host, so that its own sending takes no CPU from "
            "the other two (what it costs the victim is what is measured; _hostile "
            "--own-cpu competes as an ordinary process)"
        ),
        (
            "RSS over the victim's RSS before the hostile peer connected: peak (VmHWM, started "
            "afresh before each step, and polled every 10 ms), held (its last step done, the "
            "session open), kept (once the victim ended the session); refused frames: per "
            "frame, over the RSS just before it"
        ),
        (
            "hostile peer: bare pyzmq, a real NIXL agent over lazily mapped memory, a connect "
            "offering kvsum/1; the liar row's victim is a consumer node in the bench process that "
            "chooses its sources itself (Node.locate, then a fetch of the hits), 10 keys a request"
        ),
    ]
    if not slow_step:
        notes.append(
            "longest step: not measured, this p2pactor serve has no --slow-step-ms (the node's "
            "slow-step watch, /status's loop)"
        )
    elif not all(r.watched for r in runs):
        notes.append("longest step: the victim's /status had no loop object in some repeats")
    else:
        notes.append(
            "longest step: the longest step of the victim's node thread that began in the "
            "attack's window (serve --slow-step-ms 10: /status lists the last 32; 0 = none "
            "over 10 ms); time the node thread waits for the GIL between steps (a worker "
            "thread holding it) is in no step"
        )
    return notes


def _targets(base: _Row, rows: list[_Row], liar: _Row, runs: Sequence[Repeat]) -> list[str]:
    def missed(prefix: str) -> list[str]:
        return [f"{r.name} ({m})" for r in rows for m in r.misses if m.startswith(prefix)]

    out = []
    checks = [
        (f"victim RSS growth <= {RSS_TARGET_MIB:g} MiB per hostile peer", missed("RSS")),
        (f"no node-thread step over {STALL_TARGET_MS:g} ms", missed("stall")),
        (f"honest lookup p99 <= {P99_TARGET_X:g}x the baseline's", missed("p99")),
        (f"a refused frame costs <= {FRAME_TARGET_X:g}x its size", missed("x")),
    ]
    for what, misses in checks:
        out.append(f"target {what}: " + ("met" if not misses else "MISSED by " + "; ".join(misses)))
    counted = [
        f"{r.name} ({m})" for r in rows for m in r.misses if "resyncs >" in m or "parts/s >" in m
    ]
    out.append(
        f"target resync answers bounded per peer per second, an epoch flipper <= {EPOCH_TARGET} "
        "resyncs: " + ("met" if not counted else "MISSED by " + "; ".join(counted))
    )
    misrouted = _stat(liar.value)
    quarantined = all(r.liar.quarantined for r in runs)
    if misrouted is not None:
        met = quarantined and misrouted.max <= LIAR_TARGET
        out.append(
            f"target liar quarantined after <= {LIAR_TARGET} misrouted requests: "
            f"{'met' if met else 'MISSED'} ({misrouted.text(0)} misrouted"
            f"{'' if quarantined else ', never quarantined in some repeats'})"
        )
    failed = base.failed + sum(r.failed for r in rows)
    out.append(
        "target honest service never stops: "
        + ("met (no honest lookup failed)" if not failed else f"MISSED ({failed} failed)")
    )
    stalls = [f"{r.name}: {r.task}" for r in rows if r.task and "stall" in "".join(r.misses)]
    if stalls:
        out.append("the longest steps over the target ran in: " + "; ".join(stalls))
    return out
