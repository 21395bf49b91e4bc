"""Engine-thread cost of the vLLM adapter, against vLLM 0.33.0's own P2P tier.

vLLM calls a secondary tier synchronously from its scheduler thread, under the
offloading manager's lock: whatever the tier does there delays the step. A scripted
engine (:mod:`~p2pactor.programs.bench._vllm_engine`, whose docstring lists its calls)
drives p2pactor's ``P2PActorTierManager`` and vLLM's ``P2PSecondaryTierManager``
alike, each against a producer tier of its own class in another process
(:mod:`~p2pactor.programs.bench._vllm_tier`), over real ZeroMQ and NIXL on 127.0.0.1,
4 KiB blocks: each tier's own calls timed alone (a whole engine is ``engine-real``'s).
The consumers run in one subprocess (``python -m p2pactor.programs.bench.engine``:
vLLM's import is heavy, NIXL's state per process); each repeat runs both tiers,
alternating which goes first, fresh producers each. Per tier, the median over repeats
with [min..max]; ours/vLLM per repeat.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
from typing import Any

from p2pactor.programs.bench._control_common import (
    TIER_METHODS,
    LineProcess,
    free_port,
    run_module,
    vllm_missing,
)
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat, ratio

NAME = "engine"
"""The section's name."""
TITLE = "engine-thread cost of the vLLM adapter vs vLLM 0.33.0's P2P tier (same scripted engine)"
"""One line saying what is measured."""

TIERS = ("ours", "vllm")
WORKLOAD = {"keys": 16, "admit": 2, "step_ms": 10.0, "poll_ms": 1.0}
"""The scripted engine's workload: keys per request (75% HIT), requests admitted per
step, the forward pass and the tier-poll interval (0: no poll thread) in ms."""
FIGURES: tuple[tuple[str, str], ...] = (
    ("engine thread in tier calls (ms)", "engine.tier_ms"),
    ("engine step p99 in tier calls (us)", "engine.step_p99_us"),
    ("engine step max in tier calls (us)", "engine.step_max_us"),
    *((f"  {m} on the engine thread (ms)", f"engine.methods.{m}") for m in TIER_METHODS),
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
    ("steps from admission to answers, mean", "steps_to_answer_mean"),
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


def run(options: BenchOptions) -> SectionResult:
    """Run the engine benchmark in a subprocess and tabulate its figures."""
    missing = vllm_missing()
    if missing is not None:
        return SectionResult(name=NAME, title=TITLE, skipped=missing)
    requests = 100 if options.quick else 1000
    repeats = 1 if options.quick else max(1, options.repeats)
    out = os.path.join(options.work_dir, "engine.json")
    spec = WORKLOAD | {"requests": requests, "repeats": repeats, "json": out}
    run_module(__name__, json.dumps(spec), timeout=300 if options.quick else 1800 * repeats)
    with open(out) as f:
        report = json.load(f)

    def each(tier: str, path: str) -> list[float]:
        values = []
        for figures in report["runs"][tier]:
            value = figures
            for part in path.split("."):
                value = value[part]
            values.append(float(value))
        return values

    rows: list[dict[str, Cell]] = []
    for label, path in FIGURES:
        a, b = Stat.of(each("ours", path)), Stat.of(each("vllm", path))
        over = a.median / b.median if b.median else None
        rows.append({"figure": label, "ours": a, "vLLM": b, "ours/vLLM": over})
    ratios = {n: r for n, p in RATIOS if (r := ratio(each("ours", p), each("vllm", p)))}
    a = report["args"]
    t_ours, t_vllm = (statistics.median(each(t, "engine.tier_ms")) for t in TIERS)
    notes = [
        (
            f"{requests} requests x {a['keys']} keys (75% HIT), {a['admit']} admitted per "
            f"{a['step_ms']:g} ms step, tier-poll every {a['poll_ms']:g} ms; {repeats} repeat(s), "
            "both tiers in each (alternating which goes first), fresh processes per run; engine "
            "thread: perf_counter around every tier call; CPU from /proc/self/task/*/schedstat"
        ),
        f"engine thread in tier calls: ours {t_ours:.0f} ms vs vLLM {t_vllm:.0f} ms "
        f"(x{t_ours / t_vllm:.2f}, {'lower' if t_ours <= t_vllm else 'HIGHER'})"
        if t_vllm
        else "vLLM spent no time in tier calls",
    ]
    failed = sum(each("ours", "counts.loads_failed") + each("ours", "counts.bad_blocks"))
    if failed:
        notes.append(f"ours: {failed:.0f} failed loads or wrong blocks (should be 0)")
    return SectionResult(name=NAME, title=TITLE, rows=rows, ratios=ratios, notes=notes)


# --- the consumers' process ---------------------------------------------------------------


def main() -> int:
    """The consumers' process: every repeat, both tiers; write every figure as JSON.

    Its one argument: :data:`WORKLOAD` and ``requests``, ``repeats``, ``json`` (the
    file to write), as JSON.
    """
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    args = argparse.Namespace(**json.loads(sys.argv[1]))
    runs: dict[str, list[Any]] = {t: [] for t in TIERS}
    for rep in range(args.repeats):
        # A repeat's producers start together (their vLLM imports overlap, the first
        # repeat's with this process's), then stay stopped (SIGSTOP) until their turn:
        # vLLM's NIXL progress thread spins, and must not run beside the measured one.
        ports = {kind: free_port() for kind in TIERS}
        spawned = {
            kind: LineProcess(
                "p2pactor.programs.bench._vllm_tier",
                json.dumps({"tier": kind, "port": port, **vars(args)}),
                PYTHONHASHSEED=os.environ["PYTHONHASHSEED"],
            )
            for kind, port in ports.items()
        }
        scripted = importlib.import_module("p2pactor.programs.bench._vllm_engine")  # meanwhile
        try:
            for proc in spawned.values():
                proc.wait_ready()
                proc.pause(paused=True)
            for kind in TIERS if rep % 2 == 0 else TIERS[::-1]:
                run = scripted.measure(kind, args, spawned[kind], ports[kind])
                runs[kind].append(run)
                e = run["engine"]
                sys.stderr.write(f"repeat {rep + 1} {kind}: {e['tier_ms']:.1f} ms in tier calls\n")
        finally:
            for proc in spawned.values():
                proc.kill()
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "runs": runs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
