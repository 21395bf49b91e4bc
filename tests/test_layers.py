"""Imports point downward: the runtime never knows the operator surface.

The operator surface (metrics, ``/status``, their HTTP server, the live
timeline, the status command) attaches to a node from outside, through
:class:`p2pactor.view.NodeView`. So no runtime module imports any of them, not
even inside a function or under ``TYPE_CHECKING``: that is how the old circle
(node -> metrics -> node) hid, and this test keeps it gone. Adapters count as
runtime, except the vLLM adapter, a program built on both.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_purity import ROOT, imported_modules

RUNTIME = [
    *(
        ROOT / "p2pactor" / f"{name}.py"
        for name in (
            "actor",
            "config",
            "engine",
            "errors",
            "handshake",
            "host",
            "log",
            "logread",
            "node",
            "parent",
            "peers",
            "protocol",
            "protocol_codec",
            "protocol_limits",
            "quotas",
            "serving",
            "session",
            "session_host",
            "stores",
            "testing",
            "testing_data",
            "threadsafe",
            "timers",
            "transport",
            "view",
            "zpl",
        )
    ),
    *sorted((ROOT / "p2pactor" / "core").glob("*.py")),
    ROOT / "adapters" / "zmq.py",
    *sorted((ROOT / "adapters").glob("_zmq_*.py")),
    ROOT / "adapters" / "nixl.py",
    *sorted((ROOT / "adapters").glob("_nixl_*.py")),
]
OPERATOR = (
    "metrics",
    "_metrics_counts",
    "_metrics_scrape",
    "status",
    "status_cli",
    "httpserve",
    "surface",
    "timeline",
    "dashboard",
)


def _operator(module: str) -> bool:
    return any(
        module == f"p2pactor.{name}" or module.startswith(f"p2pactor.{name}.") for name in OPERATOR
    )


def _from_package(path: Path) -> set[str]:
    """``from p2pactor import metrics``: names imported from the package itself."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "p2pactor":
            names.update(f"p2pactor.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", RUNTIME, ids=lambda p: str(p.relative_to(ROOT)))
def test_runtime_modules_never_import_the_operator_surface(path: Path) -> None:
    bad = sorted(m for m in imported_modules(path) | _from_package(path) if _operator(m))
    assert bad == [], f"{path.name} imports {bad}: attach it from outside, through NodeView"


def test_the_list_of_runtime_modules_is_complete() -> None:
    # A new runtime module must be listed above; operator and program modules are not.
    programs = {
        "cli",
        "serve",
        "replay",
        "replay_checks",
        "replay_cli",
        "replay_describe",
        "replay_results",
        "keygen_cli",
        "keys",
        "logsetup",
        "samples",
    }
    listed = {p.stem for p in RUNTIME if p.parent.name == "p2pactor"}
    found = {p.stem for p in (ROOT / "p2pactor").glob("*.py")} - {"__init__", "__main__"}
    assert found - listed - set(OPERATOR) - programs == set()
