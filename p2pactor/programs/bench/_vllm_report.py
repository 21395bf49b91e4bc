"""The engine benchmark's report: the rows, their aggregation across repeats, the table.

Also :func:`provenance`: what tree was measured.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

from p2pactor.programs.bench import _vllm_tier as shared
from p2pactor.programs.bench._control_common import TIER_METHODS
from p2pactor.programs.bench.report import Cell, SectionResult, Stat

LABEL = {"ours": "p2pactor", "vllm": "vLLM"}


def _get(run: dict[str, Any], path: str) -> float:
    value: Any = run
    for part in path.split("."):
        value = value[part]
    return float(value)


ROWS: list[tuple[str, str]] = [
    ("steps", "engine.steps"),
    ("wall time (s)", "wall_s"),
    ("steps from admission to answers, mean", "latency_steps.steps_to_answer_mean"),
    ("steps from admission to answers, max", "latency_steps.steps_to_answer_max"),
    ("steps from admission to finish, mean", "latency_steps.steps_to_finish_mean"),
    ("steps from admission to finish, max", "latency_steps.steps_to_finish_max"),
    ("ENGINE THREAD: time in tier calls (ms)", "engine.tier_ms"),
    ("  per step, mean (us)", "engine.step_mean_us"),
    ("  per step, p50 (us)", "engine.step_p50_us"),
    ("  per step, p99 (us)", "engine.step_p99_us"),
    ("  per step, max (us)", "engine.step_max_us"),
    *[
        row
        for m in TIER_METHODS
        for row in (
            (f"  {m}: total (ms)", f"engine.methods.{m}.total_ms"),
            (f"  {m}: calls", f"engine.methods.{m}.calls"),
            (f"  {m}: mean per call (us)", f"engine.methods.{m}.call_mean_us"),
            (f"  {m}: p99 per call (us)", f"engine.methods.{m}.call_p99_us"),
            (f"  {m}: max per call (us)", f"engine.methods.{m}.call_max_us"),
        )
    ],
    ("  waiting for the lock (ms)", "engine.lock_wait_ms"),
    ("  longest lock wait (us)", "engine.lock_wait_max_us"),
    ("POLL THREAD: time in tier calls (ms)", "poll.tier_ms"),
    ("  rounds", "poll.rounds"),
    ("  get_finished_jobs (ms)", "poll.methods.get_finished_jobs.total_ms"),
    ("  serve_external_requests (ms)", "poll.methods.serve_external_requests.total_ms"),
    ("CPU (ms): engine thread, all of it", "cpu_ms.engine_thread"),
    ("  tier-poll thread", "cpu_ms.poll_thread"),
    ("  the tier's own threads", "cpu_ms.tier_threads"),
    ("  other threads of this process", "cpu_ms.other_threads"),
    ("  this process (os.times)", "cpu_ms.process"),
    ("  producer process", "cpu_ms.producer_process"),
    ("loads ok", "counts.loads_ok"),
    ("loads failed", "counts.loads_failed"),
    ("keys loaded", "counts.keys_loaded"),
    ("blocks with wrong bytes", "counts.bad_blocks"),
    ("warm-up: wall (ms)", "warmup.wall_s"),
    ("warm-up: engine time in tier calls (ms)", "warmup.tier_ms"),
    ("consumer construction (s)", "construct_s"),
    ("consumer shutdown (s)", "shutdown_s"),
]
SCALE = {"warmup.wall_s": 1e3}


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Every row: median [min..max] per tier over the repeats, and ours/vLLM of the medians."""
    rows: list[dict[str, Cell]] = []
    for label, path in ROWS:
        stats = {
            t: Stat.of(_get(r, path) * SCALE.get(path, 1.0) for r in rs) for t, rs in runs.items()
        }
        row: dict[str, Cell] = {"figure": label} | {LABEL[t]: st for t, st in stats.items()}
        if len(stats) == len(shared.TIERS):
            ours, theirs = (stats[t].median for t in shared.TIERS)
            row["ours/vLLM"] = ours / theirs if theirs else None
        rows.append(row)
    return SectionResult(name="engine", title="every figure", rows=rows).table()


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
