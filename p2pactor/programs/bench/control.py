"""Control plane: lookup throughput and latency, ours against vLLM 0.33.0's P2P sessions.

Per side a producer holding 4,096 blocks and a consumer running C concurrent lookup loops
of K keys (every key a hit), processes of :mod:`p2pactor.programs.bench._control_peer`
(whose docstring says what each side runs: two p2pactor nodes, or vLLM's
``P2PSecondaryTierManager`` on both ends at its fastest, not held back by engine steps).
All four processes start together and stay up; every repeat runs every cell on both
sides in turn (alternating which goes first, the other side stopped), for a fixed time
each: lookups/s, latency p50 and p99 (from the lookup call to every answer), CPU per
lookup of both processes, medians over repeats with [min..max]; the ratios ours/vLLM per
repeat. Then idle CPU: per repeat (at most 3) a window of 10 s (``--quick``: 1 s) in which
nothing calls our nodes and vLLM's tiers are called every 1 ms as vLLM's tier-poll thread
calls an idle engine's; every thread's CPU (schedstat) of all four processes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from p2pactor.programs.bench._control_common import (
    LineProcess,
    free_port,
    process_cpu_s,
    thread_cpu_ns,
    vllm_missing,
)
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat

NAME = "control"
"""The section's name."""
TITLE = "lookup throughput and latency over ZeroMQ vs vLLM 0.33.0's P2P sessions"
"""One line saying what is measured."""

KEYS_FULL = (1, 16, 256)
"""Keys per lookup in a full run."""
CONC_FULL = (1, 8, 64)
"""Concurrent lookups in a full run."""
QUICK_CELLS = ((16, 1), (16, 8))
"""(keys, concurrent) cells of a quick run."""
HELPER = "p2pactor.programs.bench._control_peer"
"""The module each producer and consumer process runs."""
IDLE_S, QUICK_IDLE_S = 10.0, 1.0
"""The idle window (seconds), full and ``--quick``."""
IDLE_TARGET_CORES = 0.02
"""The target for an idle node of ours (a note, never asserted)."""


def _cells(quick: bool) -> list[tuple[int, int]]:
    if quick:
        return list(QUICK_CELLS)
    return [(k, c) for k in KEYS_FULL for c in CONC_FULL]


def _helper(*args: str) -> LineProcess:
    return LineProcess(HELPER, *args, PYTHONHASHSEED="0")


class _Side:
    """One side's producer and consumer."""

    def __init__(self, side: str) -> None:
        self.side = side
        producer_port, consumer_port = free_port(), free_port()
        self.producer = _helper(f"--side={side}", "--role=producer", f"--port={producer_port}")
        self.consumer = _helper(
            f"--side={side}",
            "--role=consumer",
            f"--port={consumer_port}",
            f"--peer-port={producer_port}",
        )

    def ready(self) -> None:
        self.producer.wait_ready()
        self.consumer.wait_ready()

    def cell(self, keys: int, conc: int, seconds: float) -> dict[str, Any]:
        p0 = process_cpu_s(self.producer.pid)
        result = self.consumer.ask({"keys": keys, "conc": conc, "seconds": seconds})
        result["producer_cpu_s"] = process_cpu_s(self.producer.pid) - p0
        return result

    def pause(self, *, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) both processes.

        An idle side must not run beside the measured one: vLLM's NIXL agent
        runs a progress thread that spins, and on two cores two idle vLLM
        processes took half the CPU from our side's run. Cells are seconds
        long, well inside both sides' 10 s heartbeat timeout.
        """
        for proc in (self.consumer, self.producer):
            proc.pause(paused=paused)
        if not paused:
            time.sleep(0.05)  # let them catch up with their sockets before measuring

    def close(self) -> dict[str, Any]:
        self.pause(paused=False)
        self.consumer.close()
        return self.producer.close()

    def kill(self) -> None:
        self.pause(paused=False)
        self.consumer.kill()
        self.producer.kill()


def run(options: BenchOptions) -> SectionResult:
    """Measure every cell on both sides, side by side, and tabulate."""
    missing = vllm_missing()
    sides = ["ours"] if missing else ["ours", "vllm"]
    cells = _cells(options.quick)
    seconds = 0.5 if options.quick else 2.0
    repeats = max(1, options.repeats)
    procs = {s: _Side(s) for s in sides}  # all start at once: their imports overlap
    results: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    leftovers: dict[str, dict[str, Any]] = {}
    try:
        t0 = time.perf_counter()
        for p in procs.values():
            p.ready()
        startup = time.perf_counter() - t0
        for p in procs.values():  # the handshake, and the first lookups' one-off costs
            p.cell(16, 1, 0.3)
        for rep in range(repeats):
            order = sides if rep % 2 == 0 else list(reversed(sides))
            for keys, conc in cells:
                for side in order:
                    for other, p in procs.items():
                        p.pause(paused=other != side)
                    r = procs[side].cell(keys, conc, seconds)
                    results.setdefault((side, keys, conc), []).append(r)
        for p in procs.values():
            p.pause(paused=False)
        idle = _idle(procs, QUICK_IDLE_S if options.quick else IDLE_S, min(repeats, 3))
        for side, p in procs.items():
            leftovers[side] = p.close()
    finally:
        for p in procs.values():
            p.kill()
    return _tabulate(
        sides=sides,
        cells=cells,
        results=results,
        leftovers=leftovers,
        missing=missing,
        seconds=seconds,
        repeats=repeats,
        startup=startup,
        idle=idle,
    )


def _cpu_ns(pid: int, before: dict[int, tuple[str, int]] | None = None) -> int:
    """CPU ns of every live thread of ``pid``, less what each had in ``before``."""
    was = before or {}
    return sum(ns - was.get(tid, ("", 0))[1] for tid, (_, ns) in thread_cpu_ns(pid).items())


def _idle(procs: dict[str, _Side], window: float, repeats: int) -> dict[str, list[float]]:
    """Cores each process (``ours producer``...) spent per idle window, all side by side."""
    every = {f"{s} {r}": getattr(p, r) for s, p in procs.items() for r in ("producer", "consumer")}
    cores: dict[str, list[float]] = {}
    for _ in range(repeats):
        before = {name: thread_cpu_ns(p.pid) for name, p in every.items()}
        w0 = time.perf_counter()
        for p in procs.values():
            p.consumer.send({"idle": window})
        for p in procs.values():
            p.consumer.answer()
        wall = time.perf_counter() - w0
        for name, p in every.items():
            cores.setdefault(name, []).append(_cpu_ns(p.pid, before[name]) / 1e9 / wall)
    return cores


def _rate(r: dict[str, Any]) -> float:
    return float(r["lookups"]) / float(r["elapsed_s"]) if r["elapsed_s"] > 0 else 0.0


def _cpu_us(r: dict[str, Any]) -> float:
    return (float(r["cpu_s"]) + float(r["producer_cpu_s"])) / max(1, int(r["lookups"])) * 1e6


def _figures(who: str, rs: list[dict[str, Any]]) -> dict[str, Cell]:
    return {
        f"{who} lookups/s": Stat.of(_rate(r) for r in rs),
        f"{who} p50 ms": Stat.of(r["p50_s"] * 1e3 for r in rs),
        f"{who} p99 ms": Stat.of(r["p99_s"] * 1e3 for r in rs),
        f"{who} CPU us/lookup": Stat.of(_cpu_us(r) for r in rs),
    }


def _tabulate(
    *,
    sides: Sequence[str],
    cells: Sequence[tuple[int, int]],
    results: dict[tuple[str, int, int], list[dict[str, Any]]],
    leftovers: dict[str, dict[str, Any]],
    missing: str | None,
    seconds: float,
    repeats: int,
    startup: float,
    idle: dict[str, list[float]],
) -> SectionResult:
    rows: list[dict[str, Cell]] = []
    ratios: dict[str, Stat] = {}
    medians: dict[str, list[float]] = {"tput": [], "p99": []}
    missed = []
    for keys, conc in cells:
        ours = results[("ours", keys, conc)]
        row: dict[str, Cell] = {"keys": keys, "concurrent": conc, **_figures("ours", ours)}
        if "vllm" in sides:
            theirs = results[("vllm", keys, conc)]
            row |= _figures("vLLM", theirs)
            pairs = list(zip(ours, theirs, strict=True))
            for what, per in (
                ("tput", [_rate(a) / _rate(b) for a, b in pairs if _rate(b)]),
                ("p99", [a["p99_s"] / b["p99_s"] for a, b in pairs if b["p99_s"]]),
            ):
                if per:
                    name = "throughput" if what == "tput" else what
                    ratios[f"{name} ours/vLLM {keys} keys x {conc}"] = Stat.of(per)
                    row[f"{what} ours/vLLM"] = Stat.of(per).median
                    medians[what].append(Stat.of(per).median)
            t, p = row.get("tput ours/vLLM"), row.get("p99 ours/vLLM")
            if isinstance(t, float) and isinstance(p, float) and (t < 1.0 or p > 1.0):
                missed.append(f"{keys}x{conc}: tput x{t:.2f}, p99 x{p:.2f}")
        rows.append(row)
    if medians["tput"]:
        ratios = {
            "throughput ours/vLLM (geomean of cells)": Stat.of([_geomean(medians["tput"])]),
            "p99 ours/vLLM (geomean of cells)": Stat.of([_geomean(medians["p99"])]),
            **ratios,
        }
    notes = [
        (
            f"{repeats} repeat(s) of {seconds:g} s per cell and side; every key a hit; "
            f"processes started in {startup:.0f} s (both sides at once)"
        ),
        (
            "the side not being measured is stopped (SIGSTOP) meanwhile; "
            "vLLM side: P2PSecondaryTierManager on both ends, each woken as soon as its ROUTER "
            "is readable (else every 1 ms); producer parent: a vLLM ParentManager over the same "
            "EmbeddedCache class"
        ),
    ]
    for role in ("producer", "consumer"):
        per = [
            a / b
            for a, b in zip(idle[f"ours {role}"], idle.get(f"vllm {role}", ()), strict=False)
            if b
        ]
        if per:
            ratios[f"idle cores ours/vLLM, {role}"] = Stat.of(per)
    worst = max(Stat.of(idle[f"ours {r}"]).median for r in ("producer", "consumer"))
    notes.append(
        "idle CPU ms per s (1000 = one core; every thread's schedstat): "
        + ", ".join(f"{name} {Stat.of(v).scaled(1e3).text()}" for name, v in idle.items())
        + f"; target ours <= {IDLE_TARGET_CORES:g} core per idle node: "
        + ("met" if worst <= IDLE_TARGET_CORES else "missed")
        + f" (highest median {worst:.4f} core)"
    )
    if missing:
        notes.append(f"vLLM side skipped: {missing}")
    misses = sum(
        int(r["misses"]) for (side, _, _), rs in results.items() if side == "ours" for r in rs
    )
    if misses:
        notes.append(f"ours answered {misses} MISS for keys the producer holds (should be 0)")
    for side, counters in leftovers.items():
        if held := {k: n for k, n in counters.items() if n}:
            notes.append(f"{side} producer still held after the run: {held}")
    if medians["tput"]:
        notes.append(
            "targets (throughput >= vLLM, p99 <= vLLM): "
            + ("met in every cell" if not missed else "missed in " + "; ".join(missed))
        )
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)


def _geomean(values: Sequence[float]) -> float:
    good = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in good) / len(good)) if good else math.nan
