"""Suite-wide rule: with ``CI`` set (``.ci/run`` sets ``CI=1``), a skip is a failure.

Every skip in this suite stands for a missing part (NIXL's wheel, vLLM, its
CPU kernels, Chromium, network namespaces). On a developer's machine that
skips with the reason; in CI the part must be there, so the run fails loudly
instead of passing with less tested.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

CI = bool(os.environ.get("CI"))


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
