"""The public namespace: ``from p2pactor import ...`` is all a user needs.

The names are pinned here so that one can't appear or vanish unnoticed; each
resolves to the object its implementation module defines, and importing the
package alone stays light (it loads the runtime and adapters on first use).
"""

from __future__ import annotations

import ast
import importlib
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest

import p2pactor
import p2pactor.errors

PUBLIC = [
    "DEFAULT_HASH_SEED",
    "CacheFull",
    "ConfigError",
    "CurveSecurity",
    "DataPlaneError",
    "Durability",
    "EmbeddedCache",
    "EventFormatError",
    "EventLog",
    "FetchResult",
    "FrameTooLarge",
    "InvalidField",
    "JsonFormatter",
    "Limits",
    "LoadResult",
    "LogError",
    "LogFormatError",
    "LookupResult",
    "MalformedFrame",
    "NixlOptions",
    "Node",
    "NodeConfig",
    "OperatorSurface",
    "P2PActorError",
    "Parent",
    "PeerQuotas",
    "ProtocolError",
    "ReplayError",
    "Timings",
    "TransferError",
    "UnknownMessageType",
    "ZmqOptions",
    "__version__",
    "block_bytes",
    "chain_keys",
    "configure_logging",
    "fingerprint_of",
    "fold",
    "generate_keypair",
    "open_nixl_transport",
    "open_node",
    "open_operator_surface",
    "open_zmq_transport",
    "preload_keys",
    "read_log",
]
INIT = Path(p2pactor.__file__)


def test_the_public_names_are_pinned() -> None:
    assert sorted(p2pactor.__all__) == sorted(PUBLIC)
    assert dir(p2pactor) == sorted(PUBLIC)


def test_every_public_name_is_its_modules_own_object() -> None:
    lazy: dict[str, str] = p2pactor._LAZY  # type: ignore[attr-defined]
    for name in PUBLIC:
        value = getattr(p2pactor, name)
        if name in lazy:
            assert value is getattr(importlib.import_module(lazy[name]), name), name


def test_the_type_checkers_imports_match_what_loads_lazily() -> None:
    tree = ast.parse(INIT.read_text())
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom)
                assert imp.module is not None
                checked.update({alias.name: imp.module for alias in imp.names})
    assert checked == p2pactor._LAZY  # type: ignore[attr-defined]
    errors = {n for n in PUBLIC if getattr(p2pactor.errors, n, None) is getattr(p2pactor, n)}
    assert set(checked) | errors | {"__version__"} == set(PUBLIC)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="'open_nodes'"):
        p2pactor.open_nodes  # type: ignore[attr-defined]  # noqa: B018


def test_importing_the_package_loads_no_runtime() -> None:
    code = (
        "import sys, p2pactor; "
        "heavy = {'trio', 'zmq', 'p2pactor.runtime.node', 'p2pactor.adapters.zmq'}; "
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_package_imports_from_bytecode_alone(tmp_path: Path) -> None:
    """A sourceless install (only ``.pyc`` files) imports and lists its names."""
    package = tmp_path / "p2pactor"
    package.mkdir()
    for module in ("__init__", "errors"):
        source = package / f"{module}.py"
        source.write_text((INIT.parent / f"{module}.py").read_text())
        py_compile.compile(str(source), cfile=str(package / f"{module}.pyc"), doraise=True)
        source.unlink()
    code = "import p2pactor; print(p2pactor.__file__, sorted(p2pactor.__all__))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    ).stdout
    assert out.strip() == f"{package / '__init__.pyc'} {sorted(PUBLIC)}"
