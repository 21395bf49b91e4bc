"""CI's smoke test of ``p2pactor bench``: the quick run finishes and writes valid JSON.

No speed thresholds (the machines are shared and noisy): the run must exit 0,
and the JSON must have the shape ``p2pactor/programs/bench/cli.py`` documents, every
section that ran must have rows, and every ratio must be finite numbers. A vLLM
comparison may be skipped with a note where vLLM is not importable.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from p2pactor.programs.bench.cli import REPORT_VERSION, SECTIONS

ROOT = Path(__file__).resolve().parent.parent
SECTION_KEYS = {"name", "title", "skipped", "rows", "ratios", "notes", "seconds"}
STAT_KEYS = {"median", "min", "max", "n"}
ALLOWED_SKIPS = (
    "vLLM is not importable",
    "no namespaced hosts",
    "no real vLLM engine here",
)


def _is_stat(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == STAT_KEYS


def _check_stat(where: str, stat: dict[str, Any], *, finite: bool) -> None:
    assert isinstance(stat["n"], int), where
    assert stat["n"] >= 1, where
    for key in ("median", "min", "max"):
        assert isinstance(stat[key], int | float), (where, key, stat)
        if finite:
            assert math.isfinite(stat[key]), (where, key, stat)
    if all(math.isfinite(stat[k]) for k in ("median", "min", "max")):
        assert stat["min"] <= stat["median"] <= stat["max"], (where, stat)


def test_quick_bench_writes_the_documented_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN")
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "p2pactor", "bench", "--quick", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, (
        f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    )
    report = json.loads(out.read_text())

    assert set(report) == {"version", "quick", "started", "machine", "sections"}
    assert report["version"] == REPORT_VERSION
    assert report["quick"] is True
    assert isinstance(report["started"], str)
    assert isinstance(report["machine"], dict)
    assert report["machine"]["cpus"] == os.cpu_count()
    assert [s["name"] for s in report["sections"]] == list(SECTIONS)

    ran = []
    for section in report["sections"]:
        name = section["name"]
        assert set(section) == SECTION_KEYS, name
        assert isinstance(section["notes"], list), name
        assert all(isinstance(n, str) for n in section["notes"]), name
        assert isinstance(section["seconds"], int | float), name
        skipped = section["skipped"]
        if skipped is not None:
            # A vLLM-only section where vLLM is missing (or no hosts, no real
            # engine): never a failure.
            assert skipped.startswith(ALLOWED_SKIPS), (name, skipped)
            continue
        ran.append(name)
        assert isinstance(section["title"], str), name
        assert section["title"], name
        rows = section["rows"]
        assert rows, f"section {name} ran but has no rows"
        keys = list(rows[0])
        for row in rows:
            assert list(row) == keys, (name, "every row has the same keys, in order")
            for col, value in row.items():
                if _is_stat(value):
                    _check_stat(f"{name}.{col}", value, finite=False)
                else:
                    assert value is None or isinstance(value, str | int | float), (name, col)
        for ratio, stat in section["ratios"].items():
            assert isinstance(ratio, str), name
            assert _is_stat(stat), (name, ratio)
            _check_stat(f"{name} ratio {ratio}", stat, finite=True)
        assert f"== {name}:" in done.stdout, f"the table of {name} was not printed"
    assert ran, "no section ran"
    # CI budget: the whole quick run should stay within a few minutes on 2 cores.
    print(f"p2pactor bench --quick took {elapsed:.0f} s; sections ran: {', '.join(ran)}")
    for section in report["sections"]:
        print(f"  {section['name']}: {section['seconds']} s")
