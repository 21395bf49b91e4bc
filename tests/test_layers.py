"""Imports point downward: the folders are the layers, and no layer imports one above it.

From the bottom: ``p2pactor.errors``; the pure core (``p2pactor/core``, protocol
included); the trio runtime (``p2pactor/runtime``); the transports that plug
into it (``adapters/`` ZeroMQ and NIXL, ``p2pactor.testing``'s in-memory ones);
the operator surface that attaches from outside (``p2pactor/surface``); the
programs on top (``p2pactor/programs`` and the vLLM adapter, built on all of
it). The check reads every import, even inside a function or under
``TYPE_CHECKING``: that is how the old circle (node -> metrics -> node) hid.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.test_purity import ROOT, imported_modules

LAYERS = ("errors", "core", "runtime", "transports", "surface", "programs")
"""Bottom to top."""


def layer_of(module: str) -> str | None:
    """The layer of a p2pactor module, None for the package itself (it lazily loads all)."""
    parts = module.split(".")
    if parts[0] != "p2pactor" or len(parts) == 1:
        return None
    head = parts[1]
    if head == "__main__":  # ``python -m p2pactor``: the CLI
        return "programs"
    if head in ("errors", "core", "runtime", "surface", "programs"):
        return head
    if head in ("testing", "testing_data"):
        return "transports"
    if head == "adapters":
        name = parts[2] if len(parts) > 2 else ""
        return "programs" if "vllm" in name else "transports"
    raise AssertionError(f"{module} is in no layer: put it in one of {LAYERS}'s folders")


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = ["p2pactor", *rel.parts] if rel.parts[0] == "adapters" else list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _from_package(path: Path) -> set[str]:
    """``from p2pactor import errors``: modules imported from the package itself.

    The package's other names (``NodeConfig``, ...) load lazily from wherever they
    live: a program may use them, and the layers below import the modules.
    """
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "p2pactor":
            names.update(
                f"p2pactor.{alias.name}"
                for alias in node.names
                if (ROOT / "p2pactor" / alias.name).is_dir()
                or (ROOT / "p2pactor" / f"{alias.name}.py").is_file()
            )
    return names


MODULES = sorted(
    [*(ROOT / "p2pactor").rglob("*.py"), *(ROOT / "adapters").glob("*.py")],
)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_downward(path: Path) -> None:
    here = layer_of(_module_name(path))
    if here is None:
        return
    rank = LAYERS.index(here)
    imported = {m for m in imported_modules(path) | _from_package(path) if m.startswith("p2pactor")}
    above = sorted(m for m in imported if (there := layer_of(m)) and LAYERS.index(there) > rank)
    assert above == [], f"{path.name} ({here}) imports {above}, a layer above it"


def test_every_layer_is_checked() -> None:
    # A check that finds nothing to check cannot fail: each layer has modules.
    found = {layer_of(_module_name(p)) for p in MODULES} - {None}
    assert found == set(LAYERS)


def test_a_runtime_import_of_the_surface_is_caught() -> None:
    assert layer_of("p2pactor.surface.metrics") == "surface"
    assert LAYERS.index("surface") > LAYERS.index(str(layer_of("p2pactor.runtime.node")))
    assert layer_of("p2pactor.adapters.vllm") == "programs"
    assert layer_of("p2pactor.adapters._zmq_router") == "transports"
