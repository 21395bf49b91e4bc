"""Control plane: lookup throughput and latency, ours against vLLM 0.33.0's P2P sessions.

Per side a producer holding 4,096 blocks and a consumer running C concurrent lookup loops
of K keys (every key a hit), processes of :mod:`p2pactor.programs.bench._control_peer`
(whose docstring says what each side runs). All four processes start together and stay
up; every repeat runs every cell on both sides in turn (alternating which goes first,
the other side stopped), for a fixed time each: lookups/s, latency p50 and p99, medians
over repeats with [min..max]; ours/vLLM per cell (the
median over repeats) and over the cells (their geometric mean, per repeat).
"""

from __future__ import annotations

import itertools
import json
import statistics
from typing import Any

from p2pactor.programs.bench._control_common import (
    LineProcess,
    free_port,
    take_turns,
    vllm_missing,
)
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat

NAME = "control"
"""The section's name."""
TITLE = "lookup throughput and latency over ZeroMQ vs vLLM 0.33.0's P2P sessions"
"""One line saying what is measured."""

CELLS = [(k, c) for k in (1, 16, 256) for c in (1, 8, 64)]
"""(keys per lookup, concurrent lookups) of a full run."""
QUICK_CELLS = [(16, 1), (16, 8)]
"""(keys, concurrent) cells of a quick run."""


def _side(side: str) -> dict[str, LineProcess]:
    """One side's producer and consumer, by role, started."""
    ports = free_port(), free_port()
    return {
        role: LineProcess(
            "p2pactor.programs.bench._control_peer",
            json.dumps({"side": side, "role": role, "port": port, "peer_port": ports[0]}),
            PYTHONHASHSEED="0",
        )
        for role, port in zip(("producer", "consumer"), ports, strict=True)
    }


def run(options: BenchOptions) -> SectionResult:
    """Measure every cell on both sides, side by side, and tabulate."""
    missing = vllm_missing()
    sides = ["ours"] if missing else ["ours", "vllm"]
    cells = QUICK_CELLS if options.quick else CELLS
    seconds = 0.5 if options.quick else 2.0
    repeats = max(1, options.repeats)
    procs = {s: _side(s) for s in sides}  # all start at once: their imports overlap
    every = {side: list(p.values()) for side, p in procs.items()}
    results: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    leftovers: dict[str, dict[str, Any]] = {}
    try:
        for proc in itertools.chain(*every.values()):
            proc.wait_ready()
        for p in procs.values():  # the handshake, and the first lookups' one-off costs
            p["consumer"].ask({"keys": 16, "conc": 1, "seconds": 0.3})
        for rep in range(repeats):
            for keys, conc in cells:
                for side in take_turns(rep, every):
                    cell = {"keys": keys, "conc": conc, "seconds": seconds}
                    r = procs[side]["consumer"].ask(cell)
                    results.setdefault((side, keys, conc), []).append(r)
        for proc in itertools.chain(*every.values()):
            proc.pause(paused=False)
        for side, p in procs.items():
            p["consumer"].close()
            leftovers[side] = p["producer"].close()
    finally:
        for proc in itertools.chain(*every.values()):
            proc.kill()
    rows: list[dict[str, Cell]] = []
    missed = []
    per_cell: dict[str, list[list[float]]] = {"throughput": [], "p99": []}  # by cell, repeat
    for keys, conc in cells:
        ours = results["ours", keys, conc]
        row: dict[str, Cell] = {"keys": keys, "concurrent": conc, **_figures("ours", ours)}
        if "vllm" in sides:
            theirs = results["vllm", keys, conc]
            pairs = list(zip(ours, theirs, strict=True))
            per_cell["throughput"].append([_rate(a) / _rate(b) for a, b in pairs])
            per_cell["p99"].append([a["p99_s"] / b["p99_s"] for a, b in pairs])
            t, q = (statistics.median(per[-1]) for per in per_cell.values())
            row |= _figures("vLLM", theirs) | {"tput ours/vLLM": t, "p99 ours/vLLM": q}
            if t < 1.0 or q > 1.0:
                missed.append(f"{keys}x{conc}: tput x{t:.2f}, p99 x{q:.2f}")
        rows.append(row)
    ratios = {  # per repeat, over the cells
        f"{name} ours/vLLM (geomean of cells)": Stat.of(
            map(statistics.geometric_mean, zip(*per, strict=True))
        )
        for name, per in per_cell.items()
        if per
    }
    notes = []
    if missing:
        notes.append(f"vLLM side skipped: {missing}")
    if misses := sum(
        r["misses"] for (side, *_), rs in results.items() if side == "ours" for r in rs
    ):
        notes.append(f"ours answered {misses} MISS for keys the producer holds (should be 0)")
    for side, counters in leftovers.items():
        if held := {k: n for k, n in counters.items() if n}:
            notes.append(f"{side} producer still held after the run: {held}")
    if "vllm" in sides:
        notes.append(
            "targets (throughput >= vLLM, p99 <= vLLM): "
            + ("met in every cell" if not missed else "missed in " + "; ".join(missed))
        )
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)


def _rate(r: dict[str, Any]) -> float:
    return float(r["lookups"]) / float(r["elapsed_s"])


def _figures(who: str, rs: list[dict[str, Any]]) -> dict[str, Cell]:
    return {
        f"{who} lookups/s": Stat.of(_rate(r) for r in rs),
        f"{who} p50 ms": Stat.of(r["p50_s"] * 1e3 for r in rs),
        f"{who} p99 ms": Stat.of(r["p99_s"] * 1e3 for r in rs),
    }
