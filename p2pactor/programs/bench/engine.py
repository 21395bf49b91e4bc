"""Engine-thread cost of the vLLM adapter, against vLLM 0.33.0's own P2P tier.

vLLM calls a secondary tier from its scheduler thread, under the offloading manager's lock:
what the tier does there delays the step. :mod:`~p2pactor.programs.bench._vllm_tier`'s
scripted engine drives either tier, both in turn each repeat, in one consumer process
(``python -m p2pactor.programs.bench.engine``) against producers of their own class.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any

from p2pactor.programs.bench._control_common import (
    LineProcess,
    child_result,
    free_port,
    say,
    take_turns,
    vllm_missing,
)
from p2pactor.programs.bench.cli import BenchOptions, Cell, SectionResult, Stat, ratio

TITLE = "engine-thread cost of the vLLM adapter vs vLLM 0.33.0's P2P tier (same scripted engine)"
"""One line saying what is measured."""

TIERS = ("ours", "vllm")
WORKLOAD = {"keys": 16, "admit": 2, "step_ms": 10.0, "poll_ms": 1.0}
"""The scripted engine's workload: keys per request (75% HIT), requests admitted per
step, the forward pass and the tier-poll interval in ms."""
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("engine thread in tier calls", "ms", "engine_ms"),
    ("engine step p99 in tier calls", "us", "step_p99_us"),
    ("poll thread in tier calls", "ms", "poll_ms"),
)
"""(row label, unit, key of one run's figures), in table order; each is a ratio ours/vLLM
too, one per repeat (both tiers run in each repeat)."""


def run(options: BenchOptions) -> SectionResult:
    """Run the engine benchmark in a subprocess and tabulate its figures."""
    if missing := vllm_missing():
        return SectionResult(skipped=missing)
    requests = 100 if options.quick else 1000
    repeats = 1 if options.quick else max(1, options.repeats)
    spec = WORKLOAD | {"requests": requests, "repeats": repeats}
    stderr, timeout = f"{options.work_dir}/engine.stderr", 300 if options.quick else 1800 * repeats
    runs = child_result(__name__, json.dumps(spec), stderr=stderr, timeout=timeout)
    rows: list[dict[str, Cell]] = []
    ratios: dict[str, Stat] = {}
    for label, unit, key in FIGURES:
        ours, theirs = ([r[key] for r in runs[tier]] for tier in TIERS)
        if per := ratio(ours, theirs):
            ratios[f"{label} ours/vLLM"] = per
        rows.append({"figure": f"{label} ({unit})", "ours": Stat.of(ours), "vLLM": Stat.of(theirs)})
    failed = sum(r["bad"] for r in runs["ours"])
    notes = [f"ours: {failed} failed loads or wrong blocks (should be 0)"] if failed else []
    return SectionResult(rows=rows, ratios=ratios, notes=notes)


def main() -> int:
    """The consumers' process (:data:`WORKLOAD`, ``requests``, ``repeats``: JSON).

    Every repeat runs both tiers; it says ``RESULT {tier: [figures of each repeat]}``.
    """
    args = argparse.Namespace(**json.loads(sys.argv[1]))
    runs: dict[str, list[Any]] = {t: [] for t in TIERS}
    for rep in range(args.repeats):
        # A repeat's producers start together (their vLLM imports overlap, the first
        # repeat's with this process's), then take turns.
        ports = {kind: free_port() for kind in TIERS}
        spawned = {
            kind: LineProcess(
                "p2pactor.programs.bench._vllm_tier",
                json.dumps({"tier": kind, "port": port, **vars(args)}),
                PYTHONHASHSEED="0",
            )
            for kind, port in ports.items()
        }
        scripted = importlib.import_module("p2pactor.programs.bench._vllm_tier")  # meanwhile
        try:
            for proc in spawned.values():
                proc.wait_ready()
            for kind in take_turns(rep, {k: [p] for k, p in spawned.items()}):
                runs[kind].append(scripted.measure(kind, args, spawned[kind], ports[kind]))
        finally:
            for proc in spawned.values():
                proc.kill()
    say("RESULT " + json.dumps(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
