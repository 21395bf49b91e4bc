"""Suite-wide rules: under ``CI`` a skip is a failure; the slowest files run first.

Every skip in this suite stands for a missing part (NIXL's wheel, vLLM, its
CPU kernels, Chromium, network namespaces). On a developer's machine that
skips with the reason; in CI (``.ci/run`` sets ``CI=1``) the part must be
there, so the run fails loudly instead of passing with less tested.

``scripts/test`` hands each worker a whole file at a time, in collection order
(``--no-loadscope-reorder``; xdist's own order puts the files with fewest tests,
which are the slowest, last). Collected slowest first, the long files start at
once on their own workers and the short ones fill in around them, so the run
takes about its total over the workers rather than that plus a long file.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

CI = bool(os.environ.get("CI"))

SLOWEST_FIRST = (
    "test_summary_attack.py",
    "test_bench.py",
    "test_hosts.py",
    "test_vllm_real.py",
    "test_vllm_interop.py",
    "test_faults.py",
    "test_dashboard_browser.py",
    "test_hosts_vllm.py",
    "test_nixl.py",
    "test_packaging.py",
    "test_demo.py",
    "test_sources.py",
    "test_timeline.py",
    "test_status.py",
    "test_metrics.py",
    "test_curve.py",
    "test_protocol_fuzz.py",
    "test_vllm_tier.py",
    "test_engine_bridge.py",
    "test_examples.py",
    "test_logsetup.py",
    "test_core_machines.py",
)
"""The files that take longest, longest first (their tests' ``--durations`` summed,
on 2 cores); the others follow in their own order."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the slowest files' tests first (each file's own order kept)."""
    here = Path(__file__).parent
    gone = [name for name in SLOWEST_FIRST if not (here / name).exists()]
    if gone:
        raise pytest.UsageError(f"tests/conftest.py SLOWEST_FIRST names no file: {gone}")
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def _fail_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
        report.outcome = "failed"
        report.longrepr = f"CI=1: a skip is a failure (a part is missing): {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, Any]:
    """A module skipped at import (a missing part) fails its collection under CI."""
    report = yield
    _fail_skip(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, Any]:
    """A test skipped in setup or its body fails under CI."""
    report = yield
    _fail_skip(report)
    return report
