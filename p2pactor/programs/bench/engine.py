"""Engine-thread cost of the vLLM adapter, against vLLM 0.33.0's own P2P tier.

vLLM calls a secondary tier synchronously from its scheduler thread; whatever
the tier does inside those calls delays the step. The measurement is
:mod:`p2pactor.programs.bench._vllm_engine`:
a scripted engine drives p2pactor's ``P2PActorTierManager`` and vLLM's
``P2PSecondaryTierManager`` through the same scheduler calls (1,000 requests of
16 keys, 2 admitted per 10 ms step, a 1 ms tier-poll thread; quick: 100
requests), each against a producer tier of its own class in another process,
over real ZeroMQ and NIXL. It runs in a subprocess (vLLM's import is heavy and
NIXL's state is per process); this section reports its headline figures, per
tier the median over repeats with [min..max], and ours/vLLM per repeat.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import Any

from p2pactor.programs.bench._control_common import TIER_METHODS, run_module, vllm_missing
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat

NAME = "engine"
"""The section's name."""
TITLE = "engine-thread cost of the vLLM adapter vs vLLM 0.33.0's P2P tier (same scripted engine)"
"""One line saying what is measured."""

FIGURES: tuple[tuple[str, str], ...] = (
    ("engine thread in tier calls (ms)", "engine.tier_ms"),
    ("engine step p99 in tier calls (us)", "engine.step_p99_us"),
    ("engine step max in tier calls (us)", "engine.step_max_us"),
    *((f"  {m} on the engine thread (ms)", f"engine.methods.{m}.total_ms") for m in TIER_METHODS),
    ("  waiting for the engine's lock (ms)", "engine.lock_wait_ms"),
    ("poll thread in tier calls (ms)", "poll.tier_ms"),
    ("CPU: engine thread (ms)", "cpu_ms.engine_thread"),
    ("CPU: the tier's own threads (ms)", "cpu_ms.tier_threads"),
    ("CPU: consumer process (ms)", "cpu_ms.process"),
    ("CPU: producer process (ms)", "cpu_ms.producer_process"),
    ("loads ok", "counts.loads_ok"),
    ("loads failed", "counts.loads_failed"),
    ("blocks with wrong bytes", "counts.bad_blocks"),
    ("engine steps", "engine.steps"),
    ("wall time (s)", "wall_s"),
)
"""(row label, path into one run's figures), in table order."""

RATIOS: tuple[tuple[str, str], ...] = (
    ("engine thread time ours/vLLM", "engine.tier_ms"),
    ("engine step p99 ours/vLLM", "engine.step_p99_us"),
    ("poll thread time ours/vLLM", "poll.tier_ms"),
    ("consumer process CPU ours/vLLM", "cpu_ms.process"),
)
"""Headline ratios: ours over vLLM, one per repeat (both tiers run in each repeat)."""


def _get(run: dict[str, Any], path: str) -> float:
    value: Any = run
    for part in path.split("."):
        value = value[part]
    return float(value)


def run(options: BenchOptions) -> SectionResult:
    """Run the engine benchmark in a subprocess and tabulate its figures."""
    missing = vllm_missing()
    if missing is not None:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    requests = 100 if options.quick else 1000
    repeats = 1 if options.quick else max(1, options.repeats)
    out = os.path.join(options.work_dir, "engine.json")
    args = [f"--requests={requests}", f"--repeats={repeats}", f"--json={out}"]
    if options.quick:
        args.append("--prestart")  # the producers' vLLM imports overlap
    run_module(
        "p2pactor.programs.bench._vllm_spawn",
        *args,
        timeout=150 if options.quick else 1800 * repeats,
    )
    with open(out) as f:
        report = json.load(f)
    runs: dict[str, list[dict[str, Any]]] = report["runs"]
    ours, theirs = runs["ours"], runs["vllm"]
    rows: list[dict[str, Cell]] = []
    for label, path in FIGURES:
        a = Stat.of(_get(r, path) for r in ours)
        b = Stat.of(_get(r, path) for r in theirs)
        ratio = a.median / b.median if b.median else None
        rows.append({"figure": label, "ours": a, "vLLM": b, "ours/vLLM": ratio})
    ratios: dict[str, Stat] = {}
    for name, path in RATIOS:
        pairs = [
            _get(a_run, path) / _get(b_run, path)
            for a_run, b_run in zip(ours, theirs, strict=True)
            if _get(b_run, path) > 0
        ]
        if pairs and all(math.isfinite(x) for x in pairs):
            ratios[name] = Stat.of(pairs)
    notes = _notes(report, ours, theirs, requests, repeats)
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)


def _notes(
    report: dict[str, Any],
    ours: list[dict[str, Any]],
    theirs: list[dict[str, Any]],
    requests: int,
    repeats: int,
) -> list[str]:
    args = report["args"]
    notes = [
        (
            f"{requests} requests x {args['keys']} keys (75% HIT), {args['admit']} admitted per "
            f"{args['step_ms']:g} ms step, tier-poll every {args['poll_ms']:g} ms; {repeats} "
            "repeat(s), both tiers in each (alternating which goes first), fresh processes per run"
        ),
        (
            "engine thread: perf_counter around every tier call the scripted scheduler makes; "
            "CPU from /proc/self/task/*/schedstat"
        ),
    ]
    t_ours = statistics.median(_get(r, "engine.tier_ms") for r in ours)
    t_vllm = statistics.median(_get(r, "engine.tier_ms") for r in theirs)
    verdict = "lower" if t_ours <= t_vllm else "HIGHER"
    notes.append(
        f"engine thread in tier calls: ours {t_ours:.0f} ms vs vLLM {t_vllm:.0f} ms "
        f"(x{t_ours / t_vllm:.2f}, {verdict})"
        if t_vllm
        else "vLLM spent no time in tier calls"
    )
    failed = sum(_get(r, "counts.loads_failed") + _get(r, "counts.bad_blocks") for r in ours)
    if failed:
        notes.append(f"ours: {failed:.0f} failed loads or wrong blocks (should be 0)")
    tree = report.get("tree", {})
    if tree:
        notes.append("measured: " + ", ".join(f"{k} {v}" for k, v in tree.items()))
    return notes
