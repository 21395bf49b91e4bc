"""The pure core stays pure: no trio, no I/O, no clock.

Every module of ``p2pactor.core`` and ``p2pactor.core.protocol`` may import only other
core modules, ``p2pactor.errors``, attrs, msgspec, numpy and a short list of pure
standard-library modules. Importing the core must not pull in trio, pyzmq,
NIXL, torch or vLLM.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE_FILES = sorted((ROOT / "p2pactor" / "core").rglob("*.py"))
PURE_STDLIB = {
    "__future__",
    "abc",
    "collections",
    "collections.abc",
    "enum",
    "functools",
    "heapq",  # the order a parent's LRU evicts in: lists in, lists out
    "itertools",
    "math",
    "operator",
    "re",
    "struct",  # packs summary fingerprints: bytes in, bytes out
    "types",
    "typing",
}
# numpy: the source index packs fingerprints in arrays; arithmetic, no I/O.
ALLOWED_THIRD_PARTY = {"attrs", "msgspec", "numpy"}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: use absolute imports"
            assert node.module is not None
            names.add(node.module)
    return names


def is_allowed(module: str) -> bool:
    if module in PURE_STDLIB or module.partition(".")[0] in ALLOWED_THIRD_PARTY:
        return True
    return module in {"p2pactor.errors", "p2pactor"} or module.startswith("p2pactor.core")


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_core_module_imports_only_pure_modules(path: Path) -> None:
    bad = sorted(m for m in imported_modules(path) if not is_allowed(m))
    assert bad == [], f"{path.name} imports {bad}; the core must stay free of I/O and clocks"


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_core_module_reads_no_clock(path: Path) -> None:
    source = path.read_text()
    for clock in ("time.monotonic", "time.time", "perf_counter", "current_time", "datetime.now"):
        assert clock not in source, f"{path.name} mentions {clock}; time must be an argument"


def test_importing_the_core_loads_no_io_library() -> None:
    probe = (
        "import sys, p2pactor.core, p2pactor.core.protocol;"
        "heavy = {'trio', 'zmq', 'torch', 'nixl', 'nixl_cu12', 'vllm', 'trio_websocket'};"
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert out.stdout.strip() == "[]"
