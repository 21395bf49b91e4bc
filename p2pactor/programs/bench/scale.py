"""Actor scale: 10,000 concurrent requests on one node; replay speed; in-process costs.

Each measurement runs in a fresh interpreter, so that its peak RSS is its own
(:mod:`p2pactor.programs.bench._scale_run`, whose docstring says each): 10,000 requests
at once (quick: 1,000) between two nodes over the in-memory transports, both logging to
disk; the replay of a log of 1,000,000 events (quick: 100,000), the first run's events
repeated (replay streams: memory must not grow with the log); the pure core's cost
per input, as the old ``benchmarks/event_cost.py`` measured it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from p2pactor.programs.bench._control_common import LineProcess
from p2pactor.programs.bench.report import BenchOptions, Cell, SectionResult, Stat

NAME = "scale"
"""The section's name."""
TITLE = "N concurrent requests on one node (in-memory network, logs on disk); replay speed"
"""One line saying what is measured."""

HELPER = "p2pactor.programs.bench._scale_run"
"""The module each measurement runs in (a fresh interpreter)."""
REPLAY_MODES = ("read", "replay", "replay --check")
"""Reading the log only; replaying it; replaying it with invariant checks."""


def _run(work: str, what: str, *args: str, timeout: float) -> dict[str, Any]:
    """Run one measurement in a fresh interpreter; its ``RESULT``."""
    child = LineProcess(HELPER, what, *args, stderr=os.path.join(work, f"scale-{what}.err"))
    try:
        result: dict[str, Any] = child.expect("RESULT", timeout=timeout)[1]
        return result
    finally:
        child.kill()


def run(options: BenchOptions) -> SectionResult:
    """Run the requests and the replays; tabulate medians over repeats."""
    n = 1_000 if options.quick else 10_000
    events = 100_000 if options.quick else 1_000_000
    repeats = 1 if options.quick else max(1, min(options.repeats, 3))
    measure = functools.partial(_run, options.work_dir)
    runs: list[dict[str, Any]] = []
    for rep in range(repeats):
        folder = os.path.join(options.work_dir, f"scale-{rep}")
        os.makedirs(folder, exist_ok=True)
        runs.append(measure("requests", str(n), folder, timeout=600 + n / 10))
    first = [os.path.join(options.work_dir, "scale-0", f"{x}.log") for x in "ab"]
    big = os.path.join(options.work_dir, "replay.log")
    w = measure("write", str(events), big, *first, timeout=1200)
    # One replay each: a million events take minutes to replay with checks.
    replays = {m: [measure("replay", m, big, timeout=1200)] for m in REPLAY_MODES}
    os.remove(big)
    ev = measure("costs", str(200 if options.quick else 2000), timeout=600)

    def stat(key: str, scale: float = 1.0, rs: list[dict[str, Any]] = runs) -> Stat:
        return Stat.of(float(r[key]) * scale for r in rs)

    def per_s(rs: list[dict[str, Any]], what: str = "events") -> Stat:
        return Stat.of(float(r[what]) / r["seconds"] for r in rs)

    table: list[tuple[str, Cell, str]] = [
        ("concurrent requests", n, "requests"),
        ("time until all done", stat("seconds"), "s"),
        ("requests per second", per_s(runs, "requests"), "1/s"),
        ("events logged (both nodes)", stat("events"), "events"),
        ("events through decide/evolve/log", per_s(runs), "events/s"),
        ("peak RSS", stat("peak_rss_kib", 1 / 1024), "MiB"),
        ("RSS growth during the run", stat("rss_growth_kib", 1 / 1024), "MiB"),
        ("RSS growth per request", stat("rss_growth_kib", 1 / n), "KiB"),
        ("failed requests", stat("failed"), "requests"),
        ("replay log", int(w["events"]), "events"),
        ("replay log size", w["bytes"] / 2**20, "MiB"),
        ("writing the replay log", w["events"] / w["seconds"], "events/s"),
    ]
    for mode, rs in replays.items():
        table += [(f"{mode}: speed", per_s(rs), "events/s")]
        table += [(f"{mode}: peak RSS growth", stat("growth_kib", 1 / 1024, rs), "MiB")]
    table += [(f"event cost: {k}", v, "us") for k, v in ev["inputs"].items()]
    table += [(f"event cost: {k} per life", v, "us") for k, v in ev["lives"].items()]
    rows: list[dict[str, Cell]] = [{"figure": f, "value": v, "unit": u} for f, v, u in table]
    notes = [
        (
            f"{repeats} repeat(s) of the requests and 1 of each replay, each "
            "in a fresh interpreter; 4 keys per request (3 hits, 1 miss), fetch of the hits; "
            "both nodes log to disk (Durability.interval)"
        ),
        "the replay log repeats the first run's events (both nodes) under fresh request ids",
        (
            "event cost: the pure core stepped through lives of 1 and 16 keys (lookup then "
            "close, lookup then fetch), median per input (in-process, "
            "p2pactor.programs.bench._scale_run costs)"
        ),
    ]
    failed = sum(int(r["failed"]) for r in runs)
    if failed:
        notes.append(f"{failed} request(s) failed (should be 0)")
    violations = sum(int(r["violations"]) for r in replays["replay --check"])
    if violations:
        notes.append(f"replay --check found {violations} violation(s) in the repeated log")
    return SectionResult(name=NAME, title=TITLE, rows=rows, notes=notes)
