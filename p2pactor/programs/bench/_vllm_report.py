"""The engine benchmark's report: the rows, their aggregation across repeats, the table.

Also :func:`provenance`: what tree was measured.
"""

from __future__ import annotations

import hashlib
import statistics
import subprocess
from pathlib import Path
from typing import Any

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._control_common import TIER_METHODS

LABEL = {"ours": "p2pactor", "vllm": "vLLM"}


def _get(run: dict[str, Any], path: str) -> float:
    value: Any = run
    for part in path.split("."):
        value = value[part]
    return float(value)


ROWS: list[tuple[str, str, str]] = [
    ("steps", "engine.steps", "{:.0f}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
    ("steps from admission to answers, mean", "latency_steps.steps_to_answer_mean", "{:.2f}"),
    ("steps from admission to answers, max", "latency_steps.steps_to_answer_max", "{:.0f}"),
    ("steps from admission to finish, mean", "latency_steps.steps_to_finish_mean", "{:.2f}"),
    ("steps from admission to finish, max", "latency_steps.steps_to_finish_max", "{:.0f}"),
    ("ENGINE THREAD: time in tier calls (ms)", "engine.tier_ms", "{:.1f}"),
    ("  per step, mean (us)", "engine.step_mean_us", "{:.0f}"),
    ("  per step, p50 (us)", "engine.step_p50_us", "{:.0f}"),
    ("  per step, p99 (us)", "engine.step_p99_us", "{:.0f}"),
    ("  per step, max (us)", "engine.step_max_us", "{:.0f}"),
    *[
        row
        for m in TIER_METHODS
        for row in (
            (f"  {m}: total (ms)", f"engine.methods.{m}.total_ms", "{:.2f}"),
            (f"  {m}: calls", f"engine.methods.{m}.calls", "{:.0f}"),
            (f"  {m}: mean per call (us)", f"engine.methods.{m}.call_mean_us", "{:.1f}"),
            (f"  {m}: p99 per call (us)", f"engine.methods.{m}.call_p99_us", "{:.1f}"),
            (f"  {m}: max per call (us)", f"engine.methods.{m}.call_max_us", "{:.0f}"),
        )
    ],
    ("  waiting for the lock (ms)", "engine.lock_wait_ms", "{:.2f}"),
    ("  longest lock wait (us)", "engine.lock_wait_max_us", "{:.0f}"),
    ("POLL THREAD: time in tier calls (ms)", "poll.tier_ms", "{:.1f}"),
    ("  rounds", "poll.rounds", "{:.0f}"),
    ("  get_finished_jobs (ms)", "poll.methods.get_finished_jobs.total_ms", "{:.1f}"),
    ("  serve_external_requests (ms)", "poll.methods.serve_external_requests.total_ms", "{:.1f}"),
    ("CPU (ms): engine thread, all of it", "cpu_ms.engine_thread", "{:.0f}"),
    ("  tier-poll thread", "cpu_ms.poll_thread", "{:.0f}"),
    ("  the tier's own threads", "cpu_ms.tier_threads", "{:.0f}"),
    ("  other threads of this process", "cpu_ms.other_threads", "{:.0f}"),
    ("  this process (os.times)", "cpu_ms.process", "{:.0f}"),
    ("  producer process", "cpu_ms.producer_process", "{:.0f}"),
    ("loads ok", "counts.loads_ok", "{:.0f}"),
    ("loads failed", "counts.loads_failed", "{:.0f}"),
    ("keys loaded", "counts.keys_loaded", "{:.0f}"),
    ("blocks with wrong bytes", "counts.bad_blocks", "{:.0f}"),
    ("warm-up: wall (ms)", "warmup.wall_s", "{:.0f}"),
    ("warm-up: engine time in tier calls (ms)", "warmup.tier_ms", "{:.1f}"),
    ("consumer construction (s)", "construct_s", "{:.2f}"),
    ("consumer shutdown (s)", "shutdown_s", "{:.2f}"),
]
SCALE = {"warmup.wall_s": 1e3}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max across repeats of every row."""
    out: dict[str, dict[str, float]] = {}
    for _, path, _ in ROWS:
        values = [_get(r, path) * SCALE.get(path, 1.0) for r in runs]
        out[path] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
        }
    return out


def table(summary: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """Median [min..max] per tier, side by side, and the ratio of the medians ours/vLLM."""

    def cell(stats: dict[str, float], fmt: str) -> str:
        med, lo, hi = (fmt.format(stats[k]) for k in ("median", "min", "max"))
        return med if lo == hi else f"{med} [{lo}..{hi}]"

    tiers = [t for t in shared.TIERS if t in summary]
    both = len(tiers) == len(shared.TIERS)
    header = f"{'':42}" + "".join(f" {LABEL[t]:>26}" for t in tiers)
    header += f" {'ours/vLLM':>10}" if both else ""
    lines = [header, "-" * len(header)]
    for label, path, fmt in ROWS:
        line = f"{label:42}" + "".join(f" {cell(summary[t][path], fmt):>26}" for t in tiers)
        if both:
            ours, theirs = summary["ours"][path]["median"], summary["vllm"][path]["median"]
            ratio = f"{ours / theirs:.2f}" if theirs else ("-" if not ours else "inf")
            line += f" {ratio:>10}"
        lines.append(line)
    return lines


def provenance() -> dict[str, str]:
    """The commit, whether the tree differs from it, and digests of the files measured."""
    import p2pactor.adapters.vllm as adapter  # noqa: PLC0415
    from p2pactor.runtime import node  # noqa: PLC0415

    root = Path(__file__).resolve().parents[3]
    out: dict[str, str] = {}
    for key, cmd in (
        ("commit", ["git", "rev-parse", "--short", "HEAD"]),
        ("dirty", ["git", "status", "--porcelain", "--untracked-files=no"]),
    ):
        try:
            done = subprocess.run(  # noqa: S603 - fixed git commands
                cmd, cwd=root, capture_output=True, text=True, check=False
            )
            out[key] = done.stdout.strip()
        except OSError:
            out[key] = "?"
    out["dirty"] = "yes" if out["dirty"] not in ("", "?") else "no"
    for name, module in (("adapters/vllm.py", adapter), ("p2pactor/runtime/node.py", node)):
        path = Path(str(module.__file__))
        if path.exists():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()[:12]
    return out
